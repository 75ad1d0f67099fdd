"""What the one decode loop costs on the CPU: the default (hf_cascade's whole step, its steps eager: nothing is
captured on a CPU) against transformers' loop with the cascade cache (``CascadeConfig(cuda_graphs=False)``: eager
forwards, the CPU default before the one loop), on ``python -m hf_cascade``'s built-in model, float32, one thread.

Each case's two variants interleaved after a warm-up, medians of ``--rounds``; the tokens of the two compared (the
same seed). Writes ``benchmarks/results/cpu/cpu_decode_loop.json``.

    python benchmarks/cpu_decode_loop.py [--rounds 3] [--new-tokens 32]
"""
from __future__ import annotations

import argparse

import torch
from rich.console import Console

import harness
from hf_cascade import CascadeConfig
from hf_cascade.__main__ import build_model

# (name, prompt tokens, generate's settings)
CASES = [("beam 8, 1k", 1024, dict(num_beams=8)), ("beam 4, 512", 512, dict(num_beams=4)),
         ("sampling n=4, 256", 256, dict(do_sample=True, num_return_sequences=4))]
VARIANTS = {"default (the whole step, eager)": None, "transformers' loop": CascadeConfig(cuda_graphs=False)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model("cascade")
    rows = []
    for name, prompt, settings in CASES:
        ids = torch.randint(1, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))

        def one(variant, _round):
            config = VARIANTS[variant]
            torch.manual_seed(1)
            seconds, out = harness.timed(lambda: model.generate(
                ids, max_new_tokens=args.new_tokens, pad_token_id=0, **settings,
                **({} if config is None else dict(hf_cascade_config=config))))
            return seconds, out

        runs = harness.interleave(list(VARIANTS), one, args.rounds, warmup=1)
        tokens = [runs[v][-1][1] for v in VARIANTS]
        base = harness.median(s for s, _ in runs[next(iter(VARIANTS))])
        for variant in VARIANTS:
            wall = harness.median(s for s, _ in runs[variant])
            rows.append({"case": name, "variant": variant, "wall_s": round(wall, 3), "vs_default": round(wall / base, 3),
                         "all_s": [round(s, 3) for s, _ in runs[variant]],
                         "same_tokens": bool(torch.equal(tokens[0], runs[variant][-1][1]))})
    harness.table(f"CPU decode loop, {args.new_tokens} new tokens, {args.threads} thread(s), median of {args.rounds}",
                  ["case", "variant", "wall_s", "vs_default", "same_tokens"], rows, Console())
    harness.write_json(args.out or harness.results_path("cpu_decode_loop"),
                       {"meta": harness.run_record(__file__), "results": rows})


if __name__ == "__main__":
    main()
