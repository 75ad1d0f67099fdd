"""The log-sum-exp merge's slot loop (csrc/include/hfc/merge_math.cuh ``merge_slots``, which the merge kernel and the
suffix kernel's fused epilogue run) on the CPU: the header's own code, compiled with the system C++ compiler over a
shim of the two CUDA names it uses, against the plain loop it replaces (one slot after another, empty partials
skipped). ``merge_slots`` loads eight slots ahead (the solo kernel's last CTA sixteen, through L2); the sums must stay
those of the plain loop bit for bit, for every slot count (the last, part-filled group) and any pattern of empty partials. The kernels themselves run on
the GPU in tests/kernels/test_gpu_kernels.py.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++17 compiler (g++)")

HEADER = Path(__file__).resolve().parents[2] / "csrc" / "include" / "hfc" / "merge_math.cuh"
N = 4           # values per thread (the merge kernel's elements per lane at head_dim 128)

SHIM = r"""
#include <cmath>
#include <cstdint>
#include <limits>
#define __device__
#define __forceinline__ inline
namespace hfc {
constexpr unsigned kFull = 0xffffffffu;
inline float neg_inf() { return -std::numeric_limits<float>::infinity(); }
inline float __shfl_xor_sync(unsigned, float v, int) { return v; }
inline float __ldcg(const float* p) { return *p; }
}
"""

DRIVER = r"""
namespace {
constexpr int N = %(N)d;
int past_end = 0;            // loads of a slot-item past the row's slots (must stay 0)
struct Load {
  const float* part_o;
  int64_t end;
  void operator()(int64_t at, float (&v)[N]) const {
    if (at >= end) { ++past_end; return; }
    for (int e = 0; e < N; ++e) v[e] = part_o[at * N + e];
  }
};
}
extern "C" int loads_past_end() { return past_end; }
// merge_slots of the header (plain = 0) or the loop it replaces (plain = 1) over one item's slots
extern "C" void merge(const float* part_lse, const float* part_o, int nslots, int64_t total, int64_t item, float mx,
                      int plain, float* acc_out, float* wsum_out) {
  // plain: 1 the loop, 0 merge_slots as the merge kernel takes it, 2 as csrc/solo.cu's last CTA does (16 ahead, L2)
  const hfc::RowSlots slots{nslots, 0, 0, nslots};
  float acc[N] = {}, wsum = 0.0f;
  Load load{part_o, (int64_t)nslots * total};
  if (plain == 1) {
    for (int s = 0; s < nslots; ++s) {
      const int64_t at = (int64_t)slots(s) * total + item;
      if (part_lse[at] == hfc::neg_inf()) continue;
      float v[N];
      load(at, v);
      hfc::merge_add(part_lse[at], v, mx, wsum, acc);
    }
  } else if (plain == 2) {
    hfc::merge_slots<N, true, 16>(part_lse, total, item, slots, nslots, mx, wsum, acc, load);
  } else {
    hfc::merge_slots(part_lse, total, item, slots, nslots, mx, wsum, acc, load);
  }
  for (int e = 0; e < N; ++e) acc_out[e] = acc[e];
  *wsum_out = wsum;
}
"""


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    body = HEADER.read_text().replace("#pragma once", "").replace('#include "hfc/common.cuh"', "")
    folder = tmp_path_factory.mktemp("merge_math")
    source = folder / "merge_math.cpp"
    source.write_text(SHIM + body + DRIVER % {"N": N})
    lib = folder / "libmerge_math.so"
    # no -ffast-math: float arithmetic as written (the sums are compared bit for bit)
    subprocess.run(["g++", "-std=c++17", "-O2", "-ffp-contract=off", "-shared", "-fPIC", str(source), "-o", str(lib)],
                   check=True, capture_output=True, text=True)
    found = ctypes.CDLL(str(lib))
    p = ctypes.POINTER(ctypes.c_float)
    found.merge.argtypes = [p, p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int, p, p]
    return found


def _merge(lib, lse, o, nslots, total, item, mx, plain):
    acc, wsum = np.zeros(N, np.float32), np.zeros(1, np.float32)
    ptr = lambda a: a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))  # noqa: E731
    lib.merge(ptr(lse), ptr(o), nslots, total, item, mx, plain, ptr(acc), ptr(wsum))
    return acc, wsum


@pytest.mark.parametrize("nslots", [0, 1, 3, 4, 5, 7, 8, 9, 16, 17, 33, 38])
@pytest.mark.parametrize("seed", range(3))
def test_merge_slots_loads_ahead_and_sums_as_the_plain_loop(library, nslots, seed):
    rng = np.random.default_rng(seed)
    total, item = 3, 1
    lse = (rng.standard_normal(max(nslots, 1) * total) * 4).astype(np.float32)
    empty = rng.random(lse.size) < 0.4
    lse[empty] = -np.inf                      # empty partials: LSE -inf, values 0 (as the kernels write them)
    o = rng.standard_normal(lse.size * N).astype(np.float32)
    o.reshape(-1, N)[empty] = 0.0
    mine = lse.reshape(-1, total)[:nslots, item]
    mx = np.float32(mine.max()) if nslots and np.isfinite(mine).any() else np.float32(0.0)
    plain = _merge(library, lse, o, nslots, total, item, mx, plain=1)
    for way in (0, 2):
        fast = _merge(library, lse, o, nslots, total, item, mx, plain=way)
        for a, b in zip(fast, plain):
            assert a.tobytes() == b.tobytes()
    assert library.loads_past_end() == 0          # the last, part-filled group reads no slot past the row's
    if np.isfinite(mine).any():
        w = np.exp2(mine[np.isfinite(mine)].astype(np.float64) - float(mx))
        assert np.isclose(plain[1][0], w.sum(), rtol=1e-5)      # the loop merges what it should
