"""Host cost of calling the CUDA kernels: a torch.library custom operator vs a plain call, and the three launches
of one layer as attend makes them (hf_cascade.kernels.ops -> ctypes, params structs).

Runs without a GPU: the library is loaded from the wheel's prebuilt copy or built for sm_90 with nvcc, and the
launches get R = 0 rows, so the C side returns after its argument checks, before any CUDA call. Prints the best of
several rounds (the host is shared; single rounds move by 2-3x).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/kernel_call_overhead.py [--old-library old.so]

``--old-library``: also time the same three launches through ABI 2 (positional ctypes arguments, before the
params structs), built from commit 0abb577:
    git show 0abb577:csrc/cascade_attention.cu > /tmp/old.cu && nvcc -O3 --use_fast_math -std=c++17 \
        -Xcompiler -fPIC -shared -arch=sm_90 -o /tmp/old.so /tmp/old.cu
"""
from __future__ import annotations

import argparse
import ctypes
import time

import torch

import harness
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
    """Host µs per call of ``fn``: the best of ``rounds`` loops of ``n`` calls (a call overhead, not a GPU time)."""
    for _ in range(1000):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def old_abi_layer(path, a):
    """The three launches as attend made them with ABI 2 (positional arguments, argtypes conversions)."""
    old = ctypes.CDLL(path)
    vp, ll, i, f, st = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_float, ctypes.c_uint64
    old.hfc_prefix_v2.restype = old.hfc_suffix.restype = old.hfc_merge.restype = i
    old.hfc_prefix_v2.argtypes = [i, i, i, vp, vp, vp, vp, vp, vp, vp] + [ll] * 11 + [f, st]
    old.hfc_suffix.argtypes = [i, i, vp, vp, vp, vp, vp, vp] + [ll] * 9 + [f, st]
    old.hfc_merge.argtypes = [i, i, vp, vp, vp, vp] + [ll] * 5 + [st]

    def check(rc, what):
        if rc != 0:
            raise RuntimeError(what)

    def layer():
        q, pool = a["q"], a["pool"]
        R, Lq, Hq, D = q.shape
        _, _, bs, Hkv, _ = pool.shape
        G, Rg = a["gr"].shape
        check(old.hfc_prefix_v2(0, D, 32, q.data_ptr(), pool.data_ptr(), a["gr"].data_ptr(), a["pt"].data_ptr(),
                                a["pl"].data_ptr(), a["po"].data_ptr(), a["pls"].data_ptr(), R, Lq, Hq, Hkv, bs, G, Rg,
                                a["pt"].shape[1], 1024, 16, 1, 0.1, 0), "prefix")
        check(old.hfc_suffix(0, D, q.data_ptr(), pool.data_ptr(), a["st"].data_ptr(), a["ql"].data_ptr(),
                             a["po"].data_ptr(), a["pls"].data_ptr(), R, Lq, Hq, Hkv, bs, a["st"].shape[1], 64, 1, 16,
                             0.1, 0), "suffix")
        check(old.hfc_merge(0, D, a["po"].data_ptr(), a["pls"].data_ptr(), a["rn"].data_ptr(), a["out"].data_ptr(), R,
                            Lq, Hq, 16, 1, 0), "merge")
    return layer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-library", help="an ABI 2 library built from commit 0abb577 (see above)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    x, o = torch.zeros(4), torch.zeros(4)
    print(harness.run_record(__file__))
    noop_us = best_us(lambda: torch.ops.hfc_bench.noop(x, o, 1, 2, .5))
    print(f"custom op (mutating, 5 args) via torch.ops: {noop_us:6.2f} us")
    print(f"plain Python function, same arguments:      {best_us(lambda: _plain(x, o, 1, 2, .5)):6.2f} us")

    try:
        lib = cuda._Lib(cuda.PREBUILT) if cuda.PREBUILT.is_file() else cuda._Lib(cuda.build_library("sm_90"))
    except RuntimeError as err:
        print(f"no kernel library to time the launches with: {err}")
        return
    a = dict(q=torch.zeros(0, 1, 32, 128, dtype=torch.bfloat16),
             pool=torch.zeros(4, 2, 16, 8, 128, dtype=torch.bfloat16),
             gr=torch.zeros(1, 8, dtype=torch.int32), pt=torch.zeros(1, 4, dtype=torch.int32),
             pl=torch.zeros(1, dtype=torch.int32), st=torch.zeros(0, 4, dtype=torch.int32),
             ql=torch.zeros(0, 1, dtype=torch.int32), rn=torch.zeros(0, dtype=torch.int32), po=torch.zeros(16),
             pls=torch.zeros(16), out=torch.zeros(0, 1, 32, 128, dtype=torch.bfloat16))
    lib._info[(0, 128, 32, None)] = (3, 0, 32)      # CPU tensors: skip the one-time setup (a CUDA call)

    def layer():
        ops.prefix(lib, 0, ops.PrefixArgs(a["q"], a["pool"], a["gr"], a["pt"], a["pl"], a["po"], a["pls"], 32, 1, 1024,
                                          16, 0.1, a["ql"]))
        ops.suffix(lib, 0, ops.SuffixArgs(a["q"], a["pool"], a["st"], a["ql"], a["po"], a["pls"], 64, 1, 16, 0.1))
        ops.merge(lib, 0, ops.MergeArgs(a["po"], a["pls"], a["rn"], a["out"], 16, 1))

    def checks():
        ops.check_prefix(ops.PrefixArgs(a["q"], a["pool"], a["gr"], a["pt"], a["pl"], a["po"], a["pls"], 32, 1, 1024,
                                        0, 0.1, a["ql"]))
        ops.check_suffix(ops.SuffixArgs(a["q"], a["pool"], a["st"], a["ql"], a["po"], a["pls"], 64, 1, 0, 0.1))
        ops.check_merge(ops.MergeArgs(a["po"], a["pls"], a["rn"], a["out"], 0, 1))

    old = old_abi_layer(args.old_library, a) if args.old_library else None
    for _ in range(3 if old else 1):          # interleaved: the host's load moves single figures
        print(f"one layer's 3 launches, eager path (ctypes):   {best_us(layer):6.2f} us")
        if old:
            print(f"the same through ABI 2 (positional ctypes):    {best_us(old):6.2f} us")
    print(f"the operators' 3 argument checks (debug only): {best_us(checks):6.2f} us")


if __name__ == "__main__":
    main()
