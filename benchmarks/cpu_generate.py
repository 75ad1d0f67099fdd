"""The issue's CPU benchmark: beam search with stock sdpa vs cascade on 2 CPU cores.

Built-in random Llama-shaped model (``python -m hf_cascade``'s), float32, prompt 1024, 8 beams,
16 new tokens. One warm-up of each, then ``--repeats`` timed runs alternating stock and cascade;
times are medians. Prints a table and writes JSON with the environment and the two targets:
cascade peak KV <= 0.2 x stock's final DynamicCache, and cascade wall time <= 0.5 x stock's.

    python benchmarks/cpu_generate.py [--repeats 3] [--output benchmarks/results/cpu_generate.json]
"""
from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path

import torch
import transformers
from rich.console import Console

from common import git_commit
from hf_cascade.__main__ import print_table, run_comparison, write_json

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = dict(prompt_len=1024, beams=8, new_tokens=16, batch=1, device="cpu", dtype="float32")
THREADS = 2
KV_TARGET, TIME_TARGET = 0.2, 0.5


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each (median reported)")
    p.add_argument("--backend", default="auto", help="CascadeConfig.backend for the cascade runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "cpu_generate.json"))
    args = p.parse_args(argv)

    torch.set_num_threads(THREADS)
    result = run_comparison(**SETTINGS, backend=args.backend, seed=args.seed, repeats=args.repeats, warmup=1)
    result.update(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch=torch.__version__, transformers=transformers.__version__, git_commit=git_commit(),
        command=shlex.join([Path(sys.executable).name] + sys.argv if argv is None else ["cpu_generate.py", *argv]),
        threads=torch.get_num_threads(),
        targets={
            "kv": dict(ratio=result["kv_ratio"], limit=KV_TARGET, met=result["kv_ratio"] <= KV_TARGET),
            "time": dict(ratio=result["time_ratio"], limit=TIME_TARGET, met=result["time_ratio"] <= TIME_TARGET),
        })

    console = Console()
    print_table(result, console)
    for name, t in result["targets"].items():
        mark = "[green]met[/]" if t["met"] else "[red]MISSED[/]"
        console.print(f"target {name}: cascade / stock = {t['ratio']:.3f} <= {t['limit']}: {mark}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(result, str(out))
    console.print(f"wrote {out}")
    return 0 if result["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
