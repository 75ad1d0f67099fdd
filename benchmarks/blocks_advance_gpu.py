"""GPU time of the whole step's block bookkeeping (hf_cascade/decode/whole_step.py ``advance``) per step: the torch ops
(~80 small kernels) against the kernel library's one launch (csrc/blocks.cu), each as 20 steps captured in one CUDA
graph and timed with CUDA events around a replay (the state restored between replays, outside the timing), median of
the replays. The states are built on the host as a call's first decode step leaves them (tests/decode/
test_device_blocks.py's prefill and fork); each shape says prompts x beams, the prompts' tokens, the block size, and
whether a system prompt makes a middle level.

    PYTHONPATH=. python benchmarks/blocks_advance_gpu.py [--replays 30] [--out PATH]

Writes its rows as JSON (default: benchmarks/results/<sm90|...>/blocks_advance_gpu.json).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

import harness
from hf_cascade import device_blocks as db
from hf_cascade.decode import whole_step
from hf_cascade.kernels import cuda_library
from hf_cascade.kv.plan import DecodeLayout, _StaticBuffers, decode_room, shape_bucket

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "decode"))
from test_device_blocks import _prefilled  # noqa: E402  (the tests' prefill and fork, shared)

# name: (block size, system prompt tokens, prompt tokens, beams)
SHAPES = {
    "16k x 8 beams, bs 16": (16, 0, [16384], 8),
    "3 x 4 beams (system prompt), bs 16": (16, 500, [700, 460, 590], 4),
    "64 x 4 beams, bs 16": (16, 0, [300] * 64, 4),
    "4k x 8 beams, bs 1": (1, 0, [4096], 8),
}
STEPS = 20


def _state(bs, system_len, prompt_lens, beams):
    m = _prefilled(bs, system_len, prompt_lens, beams)
    room = decode_room(0)
    layout = DecodeLayout.freeze(m.tables(), m.lengths, bs, STEPS * 4, min_group_rows=2)
    # the pool as BlocksHold.take sizes it
    pool = shape_bucket(max(m.capacity, m.blocks_in_use + m.num_rows * (-(-room // bs) + 1) + 1) + 1) - 1
    pool = max(pool, m.capacity + m.num_rows * (STEPS // bs + 2))
    return db.DeviceBlocks.from_host(m, layout, pool, device="cuda"), _StaticBuffers(layout, torch.device("cuda")).plan


def _parents(rng, prompts, beams):
    return torch.as_tensor(np.concatenate([p * beams + rng.integers(0, beams, beams) for p in range(prompts)]),
                           device="cuda")


def time_advance(shape, kernel: bool, replays: int) -> tuple[float, int]:
    """(µs per step, flags after the last replay)."""
    bs, system_len, prompt_lens, beams = SHAPES[shape]
    blocks, plan = _state(bs, system_len, prompt_lens, beams)
    rng = np.random.default_rng(0)
    staged = [_parents(rng, len(prompt_lens), beams) for _ in range(STEPS)]
    done = torch.tensor(False, device="cuda")
    peak = torch.zeros((), dtype=torch.int64, device="cuda")
    was, whole_step.blocks_kernel = whole_step.blocks_kernel, kernel
    try:
        kept = [t.clone() for t in (blocks.tables, blocks.lengths, blocks.refcount, blocks.flags, blocks.steps)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for parents in staged[:3]:
                whole_step.advance(blocks, plan, parents, done, peak)       # (warm-up)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for parents in staged:
                whole_step.advance(blocks, plan, parents, done, peak)
        if kernel and not cuda_library.blocks_fit(blocks, plan, staged[0], done, peak):
            raise RuntimeError("the kernel does not take this shape")
        times = []
        for _ in range(replays):
            for t, k in zip((blocks.tables, blocks.lengths, blocks.refcount, blocks.flags, blocks.steps), kept):
                t.copy_(k)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000 / STEPS)
        return float(np.median(times)), int(blocks.flags)
    finally:
        whole_step.blocks_kernel = was


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--out", help="JSON path (default: benchmarks/results/<sm90|...>/blocks_advance_gpu.json)")
    args = parser.parse_args()
    results = []
    device = torch.device("cuda")
    lib = cuda_library.prebuilt_or_loaded(device) or cuda_library.library(device)    # (advance takes a loaded one)
    assert lib.has_blocks, "no kernel library with hfc_blocks_advance"
    print(f"{'shape':40s} {'rows':>5s} {'torch ops µs':>13s} {'kernel µs':>10s} {'flags':>6s}")
    for shape in SHAPES:
        ops, flags_ops = time_advance(shape, False, args.replays)
        one, flags_one = time_advance(shape, True, args.replays)
        rows = len(SHAPES[shape][2]) * SHAPES[shape][3]
        print(f"{shape:40s} {rows:5d} {ops:13.1f} {one:10.1f} {flags_ops:>3d}/{flags_one:<2d}")
        results.append(dict(shape=shape, rows=rows, torch_ops_us=ops, kernel_us=one, flags_torch_ops=flags_ops,
                            flags_kernel=flags_one))
    harness.write_json(args.out or harness.results_path("blocks_advance_gpu"),
                       {**harness.run_record(__file__), "replays": args.replays, "results": results})


if __name__ == "__main__":
    main()
