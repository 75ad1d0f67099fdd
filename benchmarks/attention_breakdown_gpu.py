"""Where one layer's decode attention spends its time, kernel by kernel (issue 34: one prompt x k beams).

The cuda backend's ``forward`` on the Llama-3-8B layer of ``kernels_gpu.py`` (metadata built once, as a step does for
all its layers), under ``torch.profiler`` with the L2 cache overwritten before each call: every CUDA kernel the call
launches (prefix, suffix, merge, anything else) with its mean device time, and the call's wall time on the device from
CUDA events. The gap between the sum of the kernels and the call's time is launch latency and idle time between the
dependent launches.

    PYTHONPATH=. python benchmarks/attention_breakdown_gpu.py [--shapes 1x8x16k 8x8x16k] [--reps 30]
"""
from __future__ import annotations

import argparse
import collections
import math
import sys
from pathlib import Path

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import harness  # noqa: E402
from hf_cascade import kernels  # noqa: E402
from hf_cascade.kernels.base import AttentionParams  # noqa: E402
from kernels_gpu import HEAD_DIM, make_step  # noqa: E402


def parse_shape(text: str) -> dict:
    """"1x8x16k" -> groups 1, beams 8, prefix 16384 (suffix 64)."""
    g, b, p = text.lower().split("x")
    prefix = int(float(p[:-1]) * 1024) if p.endswith("k") else int(p)
    return dict(groups=int(g), beams=int(b), prefix=prefix, suffix=64)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1x8x16k", "1x16x32k", "8x8x16k"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", help="JSON path (default: benchmarks/results/<hardware>/attention_breakdown_gpu.json)")
    args = ap.parse_args(argv)
    console = Console()
    backend = kernels.load("cuda")
    flush_buffer = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    params = AttentionParams(1.0 / math.sqrt(HEAD_DIM))
    results = []
    for text in args.shapes:
        shape = parse_shape(text)
        q, pool, plan, _ = make_step(**shape)
        meta = backend.build(plan, q, pool)

        def call():
            return backend.forward(q, pool, meta, params)

        median, _ = harness.cuda_time_us(call, args.reps, 5, flush_buffer.zero_)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                flush_buffer.zero_()
                call()
            torch.cuda.synchronize()
        per_kernel = collections.defaultdict(list)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA and "fill" not in event.name.lower():
                per_kernel[event.name].append(event.device_time)
        kernels_us = {name[:80]: sum(times) / args.reps for name, times in per_kernel.items()}
        results.append(dict(shape=text, **shape, call_us=median, kernels_us=kernels_us,
                            kernels_sum_us=sum(kernels_us.values())))
        console.print(f"[bold]{text}[/bold]: call {median:.1f} µs (CUDA events), kernels "
                      f"{sum(kernels_us.values()):.1f} µs")
        for name, us in sorted(kernels_us.items(), key=lambda kv: -kv[1]):
            console.print(f"  {us:8.1f} µs  {name}")
    record = harness.run_record("benchmarks/attention_breakdown_gpu.py", argv)
    record.update(results=results)
    console.print("wrote", harness.write_json(args.out or harness.results_path("attention_breakdown_gpu"), record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
