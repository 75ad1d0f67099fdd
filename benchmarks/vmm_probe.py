"""What the CUDA virtual-memory calls of memory="vmm" cost on this GPU: reserving a range (by size),
mapping chunks into it (by size), unmapping, and a 16-layer pool set up as a cache does it.

    PYTHONPATH=. python benchmarks/vmm_probe.py [--out probe.json]
"""
from __future__ import annotations

import argparse

import torch

import harness
from hf_cascade import memory

MIB = 1 << 20


def timed(fn, reps=5):
    """Median ms of ``fn`` over ``reps`` calls, the GPU synchronised around each."""
    return harness.median(1e3 * harness.timed(fn, "cuda")[0] for _ in range(reps))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    args = p.parse_args(argv)
    reason = memory.vmm_unavailable_reason("cuda")
    if reason:
        print(f"vmm unavailable: {reason}")
        return 2
    total = torch.cuda.get_device_properties(0).total_memory
    res = {"device_total_bytes": total}
    for label, size in (("total", total), ("total/16", total // 16), ("1 GiB", 1 << 30), ("64 MiB", 64 * MIB)):
        res[f"reserve+free {label} ms"] = timed(lambda: memory._VirtualRange(0, size).close())
    vr = memory._VirtualRange(0, 8 << 30)
    for mib in (2, 8, 32, 128):
        def once():
            vr.grow(vr.mapped + mib * MIB, vr.mapped + mib * MIB)
        res[f"map {mib} MiB ms"] = timed(once, reps=3)
    res["unmap all ms"] = timed(lambda: vr.shrink(0), reps=1)
    vr.close()
    block_shape, dtype = (2, 16, 8, 64), torch.bfloat16      # Llama-3.2-1B layer, block 16

    def pool_setup():
        stores = [memory.VMMStorage(block_shape, dtype, "cuda") for _ in range(16)]
        for s in stores:
            s.ensure(256)
        for s in stores:
            s.close()
    res["16 layers: create, ensure 256 blocks, close ms"] = timed(pool_setup, reps=3)
    for k, v in res.items():
        print(f"{k:50s} {v:.3f}" if isinstance(v, float) else f"{k:50s} {v}")
    if args.out:
        harness.write_json(args.out, {**harness.run_record(__file__, argv), **res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
