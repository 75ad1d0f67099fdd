"""Cost follows the tokens made, not ``max_new_tokens`` (issue 18, item 4): stock sdpa vs cascade on the CPU.

Built-in random Llama-shaped model (``python -m hf_cascade``'s), float32, 2 prompts x 300 tokens, 4 beams, a huge
``max_new_tokens`` (default 32768) and a StoppingCriteria that ends the call after ``--stop-after`` new tokens (20).
One warm-up of each, then ``--repeats`` rounds alternating stock and cascade; medians. Per call: wall time, and peak
memory as the peak resident set size above the one at the call's start (``/proc/self/status`` VmHWM, reset through
``/proc/self/clear_refs`` before each call; glibc's mmap threshold is fixed at 256 KiB, so that freed tensors leave
the resident set at once and a call's peak is its own). Targets: cascade <= 1.5 x stock's time and <= 1.2 x stock's
peak memory; tokens identical. Also counts the cascade's decode-layout widenings (log records).

    python benchmarks/capacity_cpu.py [--repeats 3] [--max-new-tokens 32768 1000000] [--output ...]
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

MMAP_THRESHOLD = str(256 * 1024)
if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:      # glibc reads it at start: run again with it
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402
from transformers import StoppingCriteria, StoppingCriteriaList  # noqa: E402

import harness  # noqa: E402
from hf_cascade.__main__ import build_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = dict(prompts=2, prompt_len=300, beams=4, stop_after=20)
THREADS = 2
TIME_TARGET, MEMORY_TARGET = 1.5, 1.2


class StopAfter(StoppingCriteria):
    """Ends the call once ``n`` tokens were added to the prompt (all rows at once)."""

    def __init__(self, prompt_len: int, n: int):
        self.limit = prompt_len + n

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.limit, dtype=torch.bool)


class Widenings(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record):
        self.count += "decode layout widened" in record.getMessage()


def _status(key: str) -> int:
    """A /proc/self/status figure in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def measure(model, ids, max_new_tokens: int, stop_after: int, beams: int, widenings: Widenings) -> dict:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                       # VmHWM := VmRSS
    before, widenings.count = _status("VmRSS"), 0
    with torch.inference_mode():
        seconds, out = harness.timed(lambda: model.generate(
            ids, attention_mask=torch.ones_like(ids), num_beams=beams, do_sample=False, max_new_tokens=max_new_tokens,
            pad_token_id=0, stopping_criteria=StoppingCriteriaList([StopAfter(ids.shape[1], stop_after)])))
    return dict(seconds=seconds, peak_rss_delta=_status("VmHWM") - before, sequences=out, widenings=widenings.count)


def run(max_new_tokens: int, repeats: int, seed: int, stock, cascade, ids, log) -> dict:
    widenings = Widenings()
    logger = logging.getLogger("hf_cascade")
    logger.addHandler(widenings)
    logger.setLevel(logging.INFO)
    models = {"stock": stock, "cascade": cascade}

    def one(name, rnd):
        r = measure(models[name], ids, max_new_tokens, SETTINGS["stop_after"], SETTINGS["beams"], widenings)
        log(f"max_new_tokens {max_new_tokens:>8}  {name:7s} {'warm-up' if not rnd else f'run {rnd}':7s} "
            f"{r['seconds']:7.3f} s  peak RSS +{r['peak_rss_delta'] / 2**20:8.1f} MiB")
        return r

    try:
        runs = harness.interleave(list(models), one, repeats, warmup=1)        # round 0: warm-up
    finally:
        logger.removeHandler(widenings)
    ref = runs["stock"][0]["sequences"]
    med = {name: {k: harness.median(r[k] for r in rs) for k in ("seconds", "peak_rss_delta")}
           for name, rs in runs.items()}
    time_ratio = med["cascade"]["seconds"] / med["stock"]["seconds"]
    memory_ratio = med["cascade"]["peak_rss_delta"] / med["stock"]["peak_rss_delta"]
    return dict(
        max_new_tokens=max_new_tokens, new_tokens_made=int(ref.shape[1] - ids.shape[1]),
        tokens_identical=all(torch.equal(r["sequences"], ref) for rs in runs.values() for r in rs),
        seconds_stock=med["stock"]["seconds"], seconds_cascade=med["cascade"]["seconds"], time_ratio=time_ratio,
        peak_rss_delta_stock=med["stock"]["peak_rss_delta"], peak_rss_delta_cascade=med["cascade"]["peak_rss_delta"],
        memory_ratio=memory_ratio,
        layout_widenings_cascade=[r["widenings"] for r in runs["cascade"]],
        seconds_stock_all=[r["seconds"] for r in runs["stock"]],
        seconds_cascade_all=[r["seconds"] for r in runs["cascade"]],
        peak_rss_delta_stock_all=[r["peak_rss_delta"] for r in runs["stock"]],
        peak_rss_delta_cascade_all=[r["peak_rss_delta"] for r in runs["cascade"]],
        targets={"time": dict(ratio=time_ratio, limit=TIME_TARGET, met=time_ratio <= TIME_TARGET),
                 "memory": dict(ratio=memory_ratio, limit=MEMORY_TARGET, met=memory_ratio <= MEMORY_TARGET)})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-new-tokens", type=int, nargs="+", default=[32768])
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of (stock, cascade); medians reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=THREADS)
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "cpu" / "capacity.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    stock = build_model("sdpa", seed=args.seed)
    cascade = build_model("cascade", seed=args.seed)
    cascade.load_state_dict(stock.state_dict())
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(1, stock.config.vocab_size, (SETTINGS["prompts"], SETTINGS["prompt_len"]), generator=gen)
    cases = [run(n, args.repeats, args.seed, stock, cascade, ids, lambda s: print(s, flush=True))
             for n in args.max_new_tokens]
    for c in cases:
        print(f"max_new_tokens {c['max_new_tokens']}: {c['new_tokens_made']} made, identical {c['tokens_identical']}; "
              f"time stock {c['seconds_stock']:.3f} s cascade {c['seconds_cascade']:.3f} s (x{c['time_ratio']:.2f}, "
              f"target <= {TIME_TARGET}: {'met' if c['targets']['time']['met'] else 'MISSED'}); peak RSS stock "
              f"+{c['peak_rss_delta_stock'] / 2**20:.1f} MiB cascade +{c['peak_rss_delta_cascade'] / 2**20:.1f} MiB "
              f"(x{c['memory_ratio']:.2f}, target <= {MEMORY_TARGET}: "
              f"{'met' if c['targets']['memory']['met'] else 'MISSED'}); widenings {c['layout_widenings_cascade']}")
    result = dict(
        model="built-in random Llama (8 layers, hidden 512, 8 heads, 2 KV heads)", dtype="float32", **SETTINGS,
        memory_measure="peak RSS above the call's start (/proc/self/status VmHWM after clear_refs; "
                       f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD})",
        repeats=args.repeats, warmup=1, seed=args.seed, cases=cases,
        tokens_identical=all(c["tokens_identical"] for c in cases), threads=torch.get_num_threads())
    record = harness.run_record(__file__, argv)
    result = dict(record, git_commit=record["commit"], **result)   # git_commit: the field's name before the harness
    print(f"wrote {harness.write_json(args.output, result, indent=2)}")
    return 0 if result["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
