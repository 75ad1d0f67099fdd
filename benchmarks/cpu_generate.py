"""The issue's CPU benchmark: beam search with stock sdpa vs cascade on 2 CPU cores.

Built-in random Llama-shaped model (``python -m hf_cascade``'s), float32, prompt 1024, 8 beams,
16 new tokens. One warm-up of each, then ``--repeats`` timed runs alternating stock and cascade;
times are medians. Prints a table and writes JSON with the environment and the two targets:
cascade peak KV <= 0.2 x stock's final DynamicCache, and cascade wall time <= 0.5 x stock's.

``--grid`` runs instead the no-loss grid (issue 13): greedy, sampling (1 and 4 per prompt) and beam
search (4 beams) on a short and a long prompt, stock and cascade interleaved in one run, medians;
target: cascade <= 1.1 x stock's wall time in every case (calls that share nothing run on stock's path).

    python benchmarks/cpu_generate.py [--repeats 3] [--output benchmarks/results/cpu/cpu_generate.json]
    python benchmarks/cpu_generate.py --grid [--repeats 5] [--output benchmarks/results/cpu/cpu_generate_grid.json]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from rich.console import Console

import harness
import hf_cascade
from hf_cascade.__main__ import build_model, print_table, run_comparison

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = dict(prompt_len=1024, beams=8, new_tokens=16, batch=1, device="cpu", dtype="float32")
THREADS = 2
KV_TARGET, TIME_TARGET = 0.2, 0.5
GRID_TARGET = 1.1
GRID_PROMPTS = {"short": 32, "long": 1024}
GRID_MODES = {"greedy": dict(do_sample=False), "sample": dict(do_sample=True, top_k=0),
              "sample x4": dict(do_sample=True, top_k=0, num_return_sequences=4), "beam x4": dict(num_beams=4)}
GRID_NEW = 16


def run_grid(repeats: int, seed: int, backend: str, console: Console) -> dict:
    """Every (mode, prompt) case: one warm-up each, then ``repeats`` rounds of (stock, cascade) per case."""
    stock = build_model("sdpa", seed=seed)
    cascade = build_model("cascade", seed=seed)
    cascade.load_state_dict(stock.state_dict())
    gen = torch.Generator().manual_seed(seed)
    prompts = {name: torch.randint(1, stock.config.vocab_size, (1, n), generator=gen)
               for name, n in GRID_PROMPTS.items()}
    config = hf_cascade.CascadeConfig(backend=backend)

    def once(model, ids, mode):
        extra = {"hf_cascade_config": config} if model is cascade else {}
        torch.manual_seed(seed)
        with torch.inference_mode():
            return harness.timed(lambda: model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=GRID_NEW, min_new_tokens=GRID_NEW,
                pad_token_id=0, **GRID_MODES[mode], **extra))

    models = {"stock": stock, "cascade": cascade}
    cases = []
    for mode in GRID_MODES:
        for prompt, ids in prompts.items():
            runs = harness.interleave(list(models), lambda name, _: once(models[name], ids, mode), repeats, warmup=1)
            same = all(torch.equal(a, c) for (_, a), (_, c) in zip(runs["stock"], runs["cascade"]))
            times = {name: [t for t, _ in rs] for name, rs in runs.items()}
            s, c = harness.median(times["stock"]), harness.median(times["cascade"])
            case = dict(mode=mode, prompt=prompt, prompt_len=ids.shape[1], seconds_stock=s, seconds_cascade=c,
                        ratio=c / s, tokens_identical=same, seconds_stock_all=times["stock"],
                        seconds_cascade_all=times["cascade"])
            console.print(f"{mode:10s} {prompt:5s} stock {s:7.3f} s  cascade {c:7.3f} s  ratio {c / s:5.3f}  "
                          f"identical {same}")
            cases.append(case)
    worst = max(c["ratio"] for c in cases)
    return dict(model="built-in random Llama (8 layers, hidden 512, 8 heads, 2 KV heads)", dtype="float32",
                new_tokens=GRID_NEW, repeats=repeats, warmup=1, backend=backend, cases=cases,
                tokens_identical=all(c["tokens_identical"] for c in cases),
                target=dict(worst_ratio=worst, limit=GRID_TARGET, met=worst <= GRID_TARGET))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each (median reported)")
    p.add_argument("--backend", default="auto", help="CascadeConfig.backend for the cascade runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None,
                   help="JSON path (default: benchmarks/results/cpu/cpu_generate[_grid].json)")
    p.add_argument("--grid", action="store_true", help="the no-loss grid: greedy/sampling/beam x short/long prompts")
    p.add_argument("--threads", type=int, default=THREADS,
                   help="torch threads (1 on a machine busy with other work: spinning OpenMP threads distort timings)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.grid:
        return grid_main(args, argv)
    args.output = args.output or str(ROOT / "benchmarks" / "results" / "cpu" / "cpu_generate.json")
    result = run_comparison(**SETTINGS, backend=args.backend, seed=args.seed, repeats=args.repeats, warmup=1)
    result.update(
        _record(argv), threads=torch.get_num_threads(),
        targets={
            "kv": dict(ratio=result["kv_ratio"], limit=KV_TARGET, met=result["kv_ratio"] <= KV_TARGET),
            "time": dict(ratio=result["time_ratio"], limit=TIME_TARGET, met=result["time_ratio"] <= TIME_TARGET),
        })

    console = Console()
    print_table(result, console)
    for name, t in result["targets"].items():
        mark = "[green]met[/]" if t["met"] else "[red]MISSED[/]"
        console.print(f"target {name}: cascade / stock = {t['ratio']:.3f} <= {t['limit']}: {mark}")
    console.print(f"wrote {harness.write_json(args.output, result, indent=2)}")
    return 0 if result["tokens_identical"] else 1


def _record(argv) -> dict:
    record = harness.run_record(__file__, argv)
    return dict(record, git_commit=record["commit"])           # git_commit: the field's name before the harness


def grid_main(args, argv) -> int:
    console = Console()
    result = run_grid(args.repeats, args.seed, args.backend, console)
    result.update(_record(argv), threads=torch.get_num_threads())
    t = result["target"]
    mark = "[green]met[/]" if t["met"] else "[red]MISSED[/]"
    console.print(f"target: worst cascade / stock = {t['worst_ratio']:.3f} <= {t['limit']}: {mark}")
    out = harness.write_json(args.output or ROOT / "benchmarks" / "results" / "cpu" / "cpu_generate_grid.json",
                             result, indent=2)
    console.print(f"wrote {out}")
    return 0 if result["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
