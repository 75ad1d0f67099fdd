"""Host cost of calling the CUDA kernels: a torch.library custom operator vs a plain call, and the three launches
of one layer as attend makes them (hf_cascade.kernels.ops -> ctypes, params structs).

Runs without a GPU: the library is loaded from the wheel's prebuilt copy or built for sm_90 with nvcc, and the
launches get R = 0 rows, so the C side returns after its argument checks, before any CUDA call. Prints the best of
several rounds (the host is shared; single rounds move by 2-3x).

    OMP_NUM_THREADS=1 python benchmarks/kernel_call_overhead.py
"""
from __future__ import annotations

import time

import torch

from hf_cascade.kernels import cuda, ops


@torch.library.custom_op("hfc_bench::noop", mutates_args=("out",))
def _noop(x: torch.Tensor, out: torch.Tensor, a: int, b: int, c: float) -> None:
    pass


@_noop.register_fake
def _(x, out, a, b, c):
    pass


def _plain(x, out, a, b, c):
    pass


def best_us(fn, n=20000, rounds=7) -> float:
    for _ in range(1000):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def main():
    torch.set_num_threads(1)
    x, o = torch.zeros(4), torch.zeros(4)
    print(f"torch {torch.__version__}")
    print(f"custom op (mutating, 5 args) via torch.ops: {best_us(lambda: torch.ops.hfc_bench.noop(x, o, 1, 2, .5)):6.2f} us")
    print(f"plain Python function, same arguments:      {best_us(lambda: _plain(x, o, 1, 2, .5)):6.2f} us")

    try:
        lib = cuda._Lib(cuda.PREBUILT) if cuda.PREBUILT.is_file() else cuda._Lib(cuda.build_library("sm_90"))
    except RuntimeError as err:
        print(f"no kernel library to time the launches with: {err}")
        return
    a = dict(q=torch.zeros(0, 1, 32, 128, dtype=torch.bfloat16), pool=torch.zeros(4, 2, 16, 8, 128, dtype=torch.bfloat16),
             gr=torch.zeros(1, 8, dtype=torch.int32), pt=torch.zeros(1, 4, dtype=torch.int32),
             pl=torch.zeros(1, dtype=torch.int32), st=torch.zeros(0, 4, dtype=torch.int32),
             ql=torch.zeros(0, 1, dtype=torch.int32), rn=torch.zeros(0, dtype=torch.int32), po=torch.zeros(16),
             pls=torch.zeros(16), out=torch.zeros(0, 1, 32, 128, dtype=torch.bfloat16))
    lib._info[(0, 128, 32, None)] = (3, 0, 32)      # CPU tensors: skip the one-time setup (a CUDA call)

    def layer():
        ops.prefix(lib, 0, a["q"], a["pool"], a["gr"], a["pt"], a["pl"], a["po"], a["pls"], 32, 1, 1024, 16, 0.1)
        ops.suffix(lib, 0, a["q"], a["pool"], a["st"], a["ql"], a["po"], a["pls"], 64, 1, 16, 0.1)
        ops.merge(lib, 0, a["po"], a["pls"], a["rn"], a["out"], 16, 1)

    def checks():
        ops.check_prefix(a["q"], a["pool"], a["gr"], a["pt"], a["pl"], a["po"], a["pls"], 32, 1, 1024, 0)
        ops.check_suffix(a["q"], a["pool"], a["st"], a["ql"], a["po"], a["pls"], 64, 1, 0)
        ops.check_merge(a["po"], a["pls"], a["rn"], a["out"], 0, 1)

    print(f"one layer's 3 launches, eager path (ctypes):   {best_us(layer):6.2f} us")
    print(f"the operators' 3 argument checks (debug only): {best_us(checks):6.2f} us")


if __name__ == "__main__":
    main()
