"""The decode step's matrix products at decode batch sizes: how fast each reads its weights (issue 33 item 3).

A decode step's linear layers multiply a few rows (prompts x beams) by each weight matrix once, so each is bound by
reading the weight: the figure that matters is weight bytes / time against the device's copy bandwidth. For the
Llama-3-8B layer shapes (fused q/k/v and gate/up as ``CascadeConfig(fuse_projections=True)`` makes them, the unfused
k and v, o, down, lm_head) and rows 1..64, each GEMM path torch offers without compiling:

- ``cublas``: ``F.linear`` as transformers calls it (torch's default BLAS library);
- ``cublaslt``: the same with ``torch.backends.cuda.preferred_blas_library("cublaslt")``;

timed with CUDA events (median of --reps, the L2 cache overwritten before each call).

    PYTHONPATH=. python benchmarks/gemm_gpu.py [--rows 1 8 16 32 64] [--reps 50] [--out ...gemm_gpu.json]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from kernels_gpu import copy_bandwidth  # noqa: E402

# (name, out features, in features): one Llama-3-8B decoder layer and its head
SHAPES = [("qkv fused", 6144, 4096), ("k or v", 1024, 4096), ("q", 4096, 4096), ("o", 4096, 4096),
          ("gate_up fused", 28672, 4096), ("down", 4096, 14336), ("lm_head", 128256, 4096)]
LIBRARIES = ("cublas", "cublaslt")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", help="JSON path (default: benchmarks/results/<hardware>/gemm_gpu.json)")
    args = p.parse_args(argv)
    console = Console()
    bandwidth = copy_bandwidth()
    flush_buffer = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    default_library = torch.backends.cuda.preferred_blas_library()
    results = []
    for name, n, k in SHAPES:
        weight = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5
        for rows in args.rows:
            x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
            for library in LIBRARIES:
                torch.backends.cuda.preferred_blas_library(library)
                median, low = harness.cuda_time_us(lambda: F.linear(x, weight), args.reps, 5, flush_buffer.zero_)
                nbytes = weight.numel() * 2 + x.numel() * 2 + rows * n * 2
                results.append(dict(shape=name, out_features=n, in_features=k, rows=rows, library=library,
                                    median_us=median, min_us=low, bytes=nbytes,
                                    fraction_of_bandwidth=nbytes / (median * 1e-6) / bandwidth))
        del weight
    torch.backends.cuda.preferred_blas_library(default_library)
    rows_out = [[r["shape"], r["rows"], r["library"], f"{r['median_us']:.1f}",
                 f"{r['fraction_of_bandwidth']:.0%}"] for r in results]
    harness.table("decode GEMMs: weight read time", ["shape", "rows", "library", "µs", "of copy bandwidth"],
                  rows_out, console=console)
    record = harness.run_record("benchmarks/gemm_gpu.py", argv)
    record.update(copy_bandwidth_bytes_per_s=bandwidth, default_library=str(default_library), results=results)
    console.print("wrote", harness.write_json(args.out or harness.results_path("gemm_gpu"), record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
