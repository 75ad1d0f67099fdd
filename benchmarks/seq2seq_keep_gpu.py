Whether keeping an encoder-decoder call's state pays: generate calls of one shape, back to back, kept ("on", the
default) and released before every call ("off": ``hf_cascade.release(model)``) (issue 32's decision).

Kept, a call of the same shape as the model's last one reuses that call's cross-attention storages, decoder cache,
plans and captured decode step (no capture, no warm-up step); released, every call builds and captures afresh. (Until
2026-12-02 keeping was the opt-in ``$HF_CASCADE_KEEP_SEQ2SEQ``; the first figures were measured with it.)
Shapes and settings are ``encdec_gpu.py``'s (random-weight models of the real shapes, bf16): whisper-large-v3 16 x
30 s of audio x 5 beams, nllb-600M 32 sentences x 4 beams. Per round and variant, ``--calls`` calls back to back
(each variant's calls in a row: the kept state of the "on" calls survives between them); the first call of an "on"
run fills what is kept, the later ones reuse it. Reported: the median wall seconds of the later calls per variant,
their ratio, whether every call's tokens equal the first "off" call's, and the graph captures per call.

    PYTHONPATH=. python benchmarks/seq2seq_keep_gpu.py [--models whisper-large-v3,nllb-600M] [--rounds 2]
    python benchmarks/seq2seq_keep_gpu.py --device cpu --dtype float32 --scale tiny --rounds 1   # a smoke test
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import hf_cascade  # noqa: E402
import encdec_gpu  # noqa: E402
import harness  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="whisper-large-v3,nllb-600M")
    p.add_argument("--new", type=int, default=32, help="new tokens of the models with a fixed count (whisper)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--calls", type=int, default=3, help="calls back to back per variant and round")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--scale", default="real", choices=["real", "tiny"])
    p.add_argument("--output", help="JSON path (default: benchmarks/results/<sm90|cpu>/seq2seq_keep_gpu.json)")
    args = p.parse_args(argv)
    args.output = args.output or str(harness.results_path("seq2seq_keep_gpu"))
    dtype = getattr(torch, args.dtype)
    runners = encdec_gpu.Runners()
    started = time.perf_counter()
    rows = []
    for name in args.models.split(","):
        model, batch, beams, source = encdec_gpu.build(name, "cascade", dtype, args.device, args.scale)
        kwargs = dict(encdec_gpu.inputs(name, model, batch, source, args.device, dtype),
                      **encdec_gpu.settings(name, args.new, args.scale))
        seconds = {"off": [], "on": []}
        captures = {"off": [], "on": []}
        same = {"off": True, "on": True}
        reference = None

        def calls(variant, _round):
            nonlocal reference
            hf_cascade.release(model)            # each run starts from nothing kept
            try:
                for i in range(args.calls):
                    if variant == "off":
                        hf_cascade.release(model)
                    t, out = encdec_gpu.timed(model, kwargs, args.device)
                    runner = runners.made[-1] if runners.made else None     # (its counters are this call's)
                    if i:
                        seconds[variant].append(t)
                        captures[variant].append(0 if runner is None else runner.captures)
                    if reference is None:
                        reference = out
                    same[variant] &= bool(out.shape == reference.shape and torch.equal(out, reference))
            finally:
                hf_cascade.release(model)

        harness.interleave(["off", "on"], calls, args.rounds, warmup=1)
        off, on = harness.median(seconds["off"]), harness.median(seconds["on"])
        row = dict(model=name, batch=batch, beams=beams, source=source, dtype=args.dtype, calls=args.calls,
                   off_s=round(off, 4), on_s=round(on, 4), on_over_off=round(on / off, 4),
                   saved_s_per_call=round(off - on, 4), same_tokens=same,
                   captures_per_call={k: v for k, v in captures.items()})
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    record = harness.run_record(__file__, argv)
    result = dict(record, device=torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
                  total_s=round(time.perf_counter() - started, 1), rows=rows)
    harness.write_json(args.output, result)
    print("| model | batch x beams | call s, off / on | on / off | same tokens | captures per call off / on |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['batch']} x {r['beams']} | {r['off_s']} / {r['on_s']} | {r['on_over_off']} | "
              f"{r['same_tokens']} | {r['captures_per_call']['off']} / {r['captures_per_call']['on']} |")
    print(f"total {result['total_s']} s; JSON: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
