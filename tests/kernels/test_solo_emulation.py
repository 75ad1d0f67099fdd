"""The solo kernel's source (csrc/solo.cu: rows that share no prefix, prefix + suffix + merge in one launch) run on the
CPU (no GPU needed).

solo.cu as it is (solo_kernel, launch_t, solo_launch with its argument checks), the headers it uses
(common.cuh's constants and its Cvt conversions, merge_math.cuh, row_state.cuh, dispatch.h) and csrc/api.cu's hfc_solo, compiled
with the system C++ compiler over a shim of the CUDA built-ins they use. The launch ``solo_kernel<T, D><<<grid,
kThreads, 0, stream>>>(p)`` runs its CTAs one after another (in grid order, reversed, or shuffled: the last CTA of a
(query block, KV head, row) to count merges, whichever it is), each CTA as 128 std::threads: ``__syncthreads`` a
std::barrier of the CTA, ``__shfl_xor_sync`` a per-warp exchange (each lane writes its value, a barrier of the
warp's 32 threads, each reads lane ^ off's, a barrier), ``__shared__`` function-static arrays (filled with garbage
before every CTA: NaN floats, huge integers), ``atomicAdd`` a std::atomic_ref, ``__threadfence`` a fence, ``__ldg`` /
``__ldcg`` plain loads checked against the ranges of the launch's tensors. bf16 and fp16 are 16-bit structs with
round-to-nearest-even conversions (checked against torch's bit for bit), so the real Cvt specialisations run.

Called through the real ctypes binding (cuda_binding._Lib.solo with a SoloArgs of CPU tensors), the output must match
the float64 reference attention (hf_cascade.kernels.reference.attend) within the GPU tests' tolerances, rows that see
nothing exactly 0; every counter is 0 again after a launch, exactly one CTA per (query block, KV head, row) merges
(the only CTAs that load through L2), a second launch gives the same bytes, no load leaves the launch's tensors and
every shuffle has its 32 lanes. A mutant (queries that see one token too many) fails the comparison. This checks the
kernel's logic and indexing, not the GPU's code for it, nor races between CTAs (they run one after another here):
tests/kernels/test_gpu_kernels.py -k solo runs it on a GPU.
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from hf_cascade.kernels import cuda_binding, cuda_tuning, ops, reference
from hf_cascade.kernels.ops import LOG2E, SOLO_QB, SoloArgs

from conftest import CTA_SHIM, RUNTIME_SHIM, emulated_api, emulated_binding, host_library
from kernel_helpers import random_layout
from test_gpu_kernels import compare     # the GPU tests' comparison: overall, per (row, query), exact zeros


def _has_cxx20() -> bool:
    if shutil.which("g++") is None:
        return False
    probe = subprocess.run(["g++", "-std=c++20", "-x", "c++", "-fsyntax-only", "-"], capture_output=True, text=True,
                           input="#include <barrier>\n#include <atomic>\nint x; std::atomic_ref<int> r{x};\n"
                                 "std::barrier<> b{1};\n_Float16 h;\n")
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _has_cxx20(), reason="needs a C++20 compiler (g++ with <barrier>, _Float16)")

CSRC = Path(__file__).resolve().parents[2] / "csrc"
HFC = CSRC / "include" / "hfc"
BF, FP = torch.bfloat16, torch.float16

SHIM = r"""
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <utility>
#include <vector>
""" + RUNTIME_SHIM + r"""
struct float2 { float x, y; };
static dim3 blockIdx, gridDim, blockDim;
static thread_local dim3 threadIdx;
static std::barrier<>* emu_cta;
static std::atomic<int> emu_count;
#define __host__
#define __grid_constant__
"""
SHIM += CTA_SHIM + r"""
// ------------------------------------------------------------------------------------------ what a launch did
// faults: 0 a load outside the launch's tensors, 1 a shuffle that was not the whole warp's (a lane gone, a lane at
// another call, a mask other than all lanes); merging CTAs: those that loaded through L2 (__ldcg: the other CTAs'
// partials, which only the last CTA of a (query block, KV head, row) reads)
static std::atomic<int> emu_fault[2];
static std::atomic<bool> emu_cta_read_l2;
static long long emu_l2_ctas;
extern "C" int emu_faults(int kind) { return emu_fault[kind].load(); }
extern "C" long long emu_merging_ctas() { return emu_l2_ctas; }
extern "C" void emu_reset() { emu_fault[0] = 0, emu_fault[1] = 0, emu_l2_ctas = 0; }

// the byte ranges a load may touch (the launch's tensors), set by the test before the launch
static std::vector<std::pair<uintptr_t, uintptr_t>> emu_ranges;
extern "C" void emu_clear_ranges() { emu_ranges.clear(); }
extern "C" void emu_add_range(uintptr_t at, uint64_t bytes) { emu_ranges.emplace_back(at, at + bytes); }
template <class T> inline bool emu_readable(const T* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (const auto& r : emu_ranges)
    if (a >= r.first && a + sizeof(T) <= r.second) return true;
  emu_fault[0].fetch_add(1);
  return false;
}
template <class T> inline T __ldg(const T* p) { return emu_readable(p) ? *p : T{}; }
template <class T> inline T __ldcg(const T* p) {
  emu_cta_read_l2.store(true, std::memory_order_relaxed);
  return emu_readable(p) ? *p : T{};
}

// ------------------------------------------------------------------------------------------ arithmetic
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int atomicAdd(int* at, int v) { return std::atomic_ref<int>(*at).fetch_add(v); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// bf16 and fp16: 16-bit structs (the first of a pair in the low half), float -> 16 bits rounded to nearest even
struct __nv_bfloat16 { uint16_t bits; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
struct __half { uint16_t bits; };
struct __half2 { __half x, y; };
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x40u)};  // NaN stays (quiet) NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(u >> 16)};
}
inline float emu_bf16_float(__nv_bfloat16 h) {
  const uint32_t u = static_cast<uint32_t>(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return {__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {emu_bf16_float(v.x), emu_bf16_float(v.y)}; }
inline __half __float2half_rn(float f) {
  const _Float16 h = static_cast<_Float16>(f);  // IEEE binary16, round to nearest even
  __half r;
  std::memcpy(&r.bits, &h, 2);
  return r;
}
inline float emu_half_float(__half h) {
  _Float16 v;
  std::memcpy(&v, &h.bits, 2);
  return static_cast<float>(v);
}
inline __half2 __floats2half2_rn(float lo, float hi) { return {__float2half_rn(lo), __float2half_rn(hi)}; }
inline float2 __half22float2(__half2 v) { return {emu_half_float(v.x), emu_half_float(v.y)}; }

// ------------------------------------------------------------------------------------------ warps and CTAs
// a warp's shuffle exchange: each lane writes its value, the warp's 32 threads meet, each reads lane ^ off's, meet
struct EmuWarp {
  std::barrier<> bar{32};
  uint64_t slot[32];
  uint64_t calls[32];   // each lane's shuffles so far: the lanes of one exchange must be at the same call
  bool gone[32];
};
static EmuWarp* emu_warp;

template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int off) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "a shuffled value fits the slot");
  const unsigned lane = threadIdx.x & 31;
  EmuWarp& w = emu_warp[threadIdx.x >> 5];
  if (mask != 0xffffffffu || off < 0 || off > 31) emu_fault[1].fetch_add(1);
  const unsigned from = lane ^ static_cast<unsigned>(off & 31);
  std::memcpy(&w.slot[lane], &v, sizeof(T));
  ++w.calls[lane];
  w.bar.arrive_and_wait();
  if (w.gone[from] || w.calls[from] != w.calls[lane]) emu_fault[1].fetch_add(1);
  T r;
  std::memcpy(&r, &w.slot[from], sizeof(T));
  w.bar.arrive_and_wait();
  return r;
}

// __shared__ arrays: function-static (the CTAs run one after another), registered at their first use and filled with
// a garbage byte before every CTA (shared memory starts undefined on a GPU: the kernel must write before it reads)
struct EmuShared { void* at; size_t bytes; int fill; };
static std::mutex emu_shared_mutex;
static std::vector<EmuShared> emu_shared_arrays;
inline bool emu_shared(void* at, size_t bytes, int fill) {
  std::lock_guard<std::mutex> lock(emu_shared_mutex);
  emu_shared_arrays.push_back({at, bytes, fill});
  std::memset(at, fill, bytes);
  return true;
}

// the order of a launch's CTAs: 0 the grid's (x fastest, then y, z), 1 reversed, 2 shuffled with emu_seed
static int emu_order;
static unsigned emu_seed;
static long long emu_ctas;  // CTAs run, all launches
extern "C" void emu_set_order(int order, unsigned seed) { emu_order = order, emu_seed = seed; }
extern "C" long long emu_ctas_run() { return emu_ctas; }

// a launch: its CTAs one after another, each as `threads` threads meeting at one barrier (a thread that returns
// leaves it, and its warp's)
template <class Kernel, class... Args>
void emu_launch(dim3 grid, unsigned threads, Kernel kernel, Args... args) {
  if (threads % 32 != 0) emu_fault[1].fetch_add(1);
  gridDim = grid, blockDim = dim3(threads);
  std::vector<dim3> ctas;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) ctas.emplace_back(x, y, z);
  if (emu_order == 1) std::reverse(ctas.begin(), ctas.end());
  if (emu_order == 2) std::shuffle(ctas.begin(), ctas.end(), std::mt19937(emu_seed));
  for (const dim3& cta_index : ctas) {
    blockIdx = cta_index;
    for (const EmuShared& s : emu_shared_arrays) std::memset(s.at, s.fill, s.bytes);
    std::barrier<> cta(threads);
    emu_cta = &cta;
    std::unique_ptr<EmuWarp[]> warps(new EmuWarp[threads / 32]());
    emu_warp = warps.get();
    emu_cta_read_l2 = false;
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        threadIdx = dim3(t);
        kernel(args...);
        EmuWarp& w = emu_warp[t >> 5];
        w.gone[t & 31] = true;
        w.bar.arrive_and_drop();
        emu_cta->arrive_and_drop();
      });
    for (auto& th : pool) th.join();
    ++emu_ctas;
    if (emu_cta_read_l2) ++emu_l2_ctas;
  }
}
"""

DRIVER = r"""
// n floats -> 16-bit values through Cvt<T>::from_float (dtype: HFC_BF16 / HFC_FP16), and back through unpack8
extern "C" void emu_convert(int dtype, const float* in, uint16_t* out, float* back, int n) {
  for (int i = 0; i < n; ++i) {
    if (dtype == HFC_BF16) out[i] = hfc::Cvt<__nv_bfloat16>::from_float(in[i]).bits;
    else out[i] = hfc::Cvt<__half>::from_float(in[i]).bits;
  }
  for (int i = 0; i + 8 <= n; i += 8) {
    uint4 u;
    std::memcpy(&u, out + i, 16);
    if (dtype == HFC_BF16) hfc::Cvt<__nv_bfloat16>::unpack8(u, back + i);
    else hfc::Cvt<__half>::unpack8(u, back + i);
  }
}
"""

LAUNCH = re.compile(r"solo_kernel<T, D><<<(dim3\(.*?\)),\s*kThreads,\s*0,\s*stream>>>\(p\);")
SHARED = re.compile(r"^(\s*)__shared__ (\w+) (\w+)(\[[^;]*)?;(?:\s*//.*)?$", re.M)


def _strip(text: str) -> str:
    """A header's text without its #pragma once and #include lines."""
    return re.sub(r"^#(?:pragma once|include [<\"][^>\"]+[>\"])\s*$", "", text, flags=re.M)


def _source(solo_cu: str | None = None) -> str:
    """The shim; params.h, errors.h, dispatch.h; common.cuh's constants and conversions (up to its fp8 part, which
    solo.cu does not use); merge_math.cuh and row_state.cuh; api.cu's error functions; solo.cu (``solo_cu``: a mutant's text) with its
    launch turned into emu_launch and its __shared__ arrays registered; api.cu's hfc_solo; the conversion driver."""
    common = (HFC / "common.cuh").read_text(encoding="utf-8")
    start, end = common.index("namespace hfc {"), common.index("// 8 float8_e4m3fn values")
    common = common[start:end] + "}  // namespace hfc\n"
    assert "struct Cvt<__nv_bfloat16>" in common and "neg_inf()" in common and "fits_int" in common
    headers = "\n".join(_strip((HFC / name).read_text(encoding="utf-8"))
                        for name in ("params.h", "errors.h", "dispatch.h"))
    merge_math = "\n".join(_strip((HFC / name).read_text(encoding="utf-8"))
                           for name in ("merge_math.cuh", "row_state.cuh"))
    cu = (CSRC / "solo.cu").read_text(encoding="utf-8") if solo_cu is None else solo_cu
    cu = _strip(cu)
    cu, launches = LAUNCH.subn(r"emu_launch(\1, kThreads, solo_kernel<T, D>, p);", cu)
    assert launches == 1, "solo.cu's launch not found"

    def register(m):
        indent, type_, name = m.group(1), m.group(2), m.group(3)
        fill = "0xff" if type_ == "float" else "0x7f"     # NaN floats; huge integers (a pool row far out of range)
        return (f"{m.group(0)}\n{indent}[[maybe_unused]] static const bool emu_shared_{name} = "
                f"emu_shared(&{name}, sizeof({name}), {fill});")

    cu, shared = SHARED.subn(register, cu)
    assert shared == 5, f"solo.cu's five __shared__ arrays not found ({shared})"
    error_functions, entries = emulated_api(("hfc_solo",))
    return "\n".join((SHIM, headers, common, merge_math, error_functions, cu, entries, DRIVER))


def _compile(folder, name: str, source: str):
    lib = host_library(folder, name, source,
                       ["-std=c++20", "-pthread", "-fno-strict-aliasing", "-Wall", "-Werror", "-Wno-unused-function",
                        "-Wno-unknown-pragmas"])
    lib.hfc_solo.restype = ctypes.c_int
    lib.hfc_solo.argtypes = [ctypes.POINTER(cuda_binding._SoloParams), ctypes.c_size_t]
    lib.emu_faults.argtypes, lib.emu_faults.restype = [ctypes.c_int], ctypes.c_int
    lib.emu_set_order.argtypes = [ctypes.c_int, ctypes.c_uint]
    lib.emu_add_range.argtypes = [ctypes.c_size_t, ctypes.c_uint64]
    lib.emu_ctas_run.restype = lib.emu_merging_ctas.restype = ctypes.c_longlong
    lib.emu_convert.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return emulated_binding(lib)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The binding (cuda_binding._Lib's own solo and error check) on the emulated library."""
    return _compile(tmp_path_factory.mktemp("solo"), "solo", _source())


@pytest.fixture(autouse=True)
def _no_sync(monkeypatch):
    monkeypatch.setattr(cuda_binding, "debug_sync", False)   # (the emulated library has no hfc_sync)


# ------------------------------------------------------------------------------------------ one launch

def solo_args(lay, *, split=None, waves=3):
    """The SoloArgs of a layout of one-row groups: the split ``split`` tokens (their count to cover the tables), or
    cuda_tuning.choose_solo_split's where ``waves`` x the CTAs of one split are resident (about ``waves`` splits, the
    shortest 64 tokens); partials and out filled with NaN (every value read must have been written)."""
    q, pool = lay.q, lay.pool
    R, Lq, Hq, D = q.shape
    Hkv, bs = pool.shape[3], pool.shape[2]
    G, Mp = lay.prefix_table.shape
    Ms = lay.suffix_table.shape[1]
    row_group = torch.full((R,), -1, dtype=torch.int32)
    for g, rows in enumerate(lay.group_rows.tolist()):
        members = [r for r in rows if r >= 0]
        assert len(members) <= 1, "the solo kernel takes groups of one row"
        row_group[members] = g
    nqb = -(-(Lq * (Hq // Hkv)) // SOLO_QB)
    capacity = (Mp + Ms) * bs
    if split is None:
        split, nsplit = cuda_tuning.choose_solo_split(capacity, R * Hkv * nqb, waves * R * Hkv * nqb)
    else:
        nsplit = -(-capacity // split)
    counters = torch.zeros(R * Hkv * nqb, dtype=torch.int32)
    part_o = torch.full((nsplit * R * Lq * Hq * D,), float("nan"), dtype=torch.float32)
    part_lse = torch.full((nsplit * R * Lq * Hq,), float("nan"), dtype=torch.float32)
    out = torch.full_like(q, float("nan"))
    return SoloArgs(q, pool, row_group, lay.prefix_table, lay.prefix_len, lay.suffix_table, lay.q_limit, part_o,
                    part_lse, counters, out, split, nsplit, lay.scale * LOG2E)


def launch(lib, a: SoloArgs, order: int = 0, seed: int = 0) -> None:
    """One launch through the binding (ops.check_solo first, as the torch operator does), loads checked against the
    tensors' ranges, CTAs in ``order`` (0 the grid's, 1 reversed, 2 shuffled)."""
    ops.check_solo(a)
    c = lib.lib
    c.emu_reset()
    c.emu_clear_ranges()
    for t in (a.q, a.pool, a.row_group, a.prefix_table, a.prefix_len, a.suffix_table, a.q_limit, a.part_o,
              a.part_lse):
        c.emu_add_range(t.data_ptr(), t.numel() * t.element_size())
    c.emu_set_order(order, seed)
    lib.solo(a, 0)
    assert c.emu_faults(0) == 0, "a load outside the launch's tensors"
    assert c.emu_faults(1) == 0, "a shuffle without all 32 lanes of its warp"
    R, Lq, Hq, _ = a.q.shape
    Hkv = a.pool.shape[3]
    merging = R * Hkv * -(-(Lq * (Hq // Hkv)) // SOLO_QB)
    assert c.emu_merging_ctas() == merging, "one merging CTA per (query block, KV head, row): the last to count"


def check(lib, lay, *, split=None, waves=3, orders=((0, 0),), min_splits=2):
    """Launch the layout's solo call once per order in ``orders`` on the same tensors: each output within the
    tolerances of the float64 reference, the counters 0 after each launch, every launch's output the same bytes.
    Returns the SoloArgs and the reference."""
    a = solo_args(lay, split=split, waves=waves)
    assert a.nsplit >= min_splits, (a.split_tokens, a.nsplit)
    ref = reference.attend(lay.q.double(), lay.pool.double(), lay.plan(), lay.scale)
    first = None
    for order, seed in orders:
        launch(lib, a, order, seed)
        assert (a.counters == 0).all(), "the last CTAs must leave the counters at 0"
        compare(a.out, ref, lay.q)
        got = a.out.clone()
        if first is None:
            first = got
        else:
            assert torch.equal(got.view(torch.int16), first.view(torch.int16)), "another launch, other bytes"
    return a, ref


# ------------------------------------------------------------------------------------------ the tests

def test_the_shim_converts_as_torch(emulated):
    """Cvt<bf16 / fp16>::from_float (round to nearest even: ties, subnormals, overflow to inf) and unpack8 in the
    shim give torch's bits and values."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=g) * 10.0 ** torch.randint(-8, 6, (4000,), generator=g),
                   torch.tensor([0.0, -0.0, 1.0, 65504.0, 65520.0, 70000.0, 3e38, -3e38, 1e-8, -6e-8, 2.0 ** -24,
                                 float("inf"), -float("inf")])])
    # exact ties: the midpoints of neighbouring bf16 / fp16 values (exact in float32), of both signs
    for dtype, top in ((BF, 0x7F7F), (FP, 0x7BFF)):
        k = torch.randint(0, top, (512,), generator=g, dtype=torch.int32).to(torch.int16)
        lo, hi = k.view(dtype).float(), (k + 1).view(dtype).float()
        sign = torch.where(torch.rand(512, generator=g) < 0.5, -1.0, 1.0)
        x = torch.cat([x, sign * (lo + hi) / 2])
    x = x[~torch.isnan(x)]
    x = x[: len(x) // 8 * 8].contiguous()
    for code, dtype in ((ops.DTYPE_CODES[BF], BF), (ops.DTYPE_CODES[FP], FP)):
        bits = torch.empty(len(x), dtype=torch.int16)
        back = torch.empty(len(x), dtype=torch.float32)
        emulated.lib.emu_convert(code, x.data_ptr(), bits.data_ptr(), back.data_ptr(), len(x))
        want = x.to(dtype)
        assert torch.equal(bits, want.view(torch.int16)), dtype
        assert torch.equal(back, want.float()), dtype


SHAPES = [
    # (dtype, D, Hkv, ratio, bs): GQA 1, 4 and 6 (two query blocks, the second half empty), head_dim 64 / 128 / 256,
    # block sizes 4, 16 and 64
    (BF, 128, 2, 4, 16),
    (FP, 64, 2, 1, 4),
    (BF, 64, 1, 6, 16),
    (FP, 128, 1, 6, 64),
    (BF, 256, 1, 1, 16),
    (FP, 256, 1, 4, 64),
]
SHAPE_IDS = [f"{'bf16' if s[0] is BF else 'fp16'}-d{s[1]}-hkv{s[2]}-gqa{s[3]}-bs{s[4]}" for s in SHAPES]


@pytest.mark.parametrize("dtype,D,Hkv,ratio,bs", SHAPES, ids=SHAPE_IDS)
def test_the_kernel_source_matches_the_reference(emulated, dtype, D, Hkv, ratio, bs):
    """Groups of one row (prefixes ending inside a block, one empty), a row in no group, suffixes of 1 to 2 blocks;
    the production split rule where about three splits of the grid are resident (prefix splits, suffix splits and
    ones across the boundary); launched in the grid's order and reversed, the same bytes."""
    lay = random_layout(4000 + D + ratio + bs + (dtype is FP), groups=((1, max(3 * bs, 64) + 5), (1, 17), (1, 0)),
                        lone_rows=1, suffix=(1, 2 * bs), Hkv=Hkv, ratio=ratio, D=D, bs=bs, dtype=dtype)
    check(emulated, lay, orders=((0, 0), (1, 0)))


def test_many_short_splits_in_any_order(emulated):
    """64-token splits (the shortest the rule gives), a row of several hundred tokens: many splits per row, the CTAs
    run in the grid's order, reversed and shuffled (whichever counts last merges); the same bytes each time."""
    lay = random_layout(4100, groups=((1, 300), (1, 64 + 7)), lone_rows=1, suffix=(1, 40), Hkv=1, ratio=4, D=64,
                        bs=16, dtype=BF)
    a, _ = check(emulated, lay, split=64, orders=((0, 0), (1, 0), (2, 1), (2, 2)), min_splits=6)
    assert a.nsplit * a.split_tokens >= (lay.prefix_table.shape[1] + lay.suffix_table.shape[1]) * 16


def test_more_splits_than_the_merge_loads_at_once(emulated):
    """8-token splits: more than 16 slots per row, so the last CTA's merge (merge_slots, 16 slots a round) takes a
    second, part-filled round; CTAs shuffled."""
    lay = random_layout(4150, groups=((1, 130),), lone_rows=1, suffix=(1, 12), Hkv=1, ratio=1, D=64, bs=4, dtype=BF)
    check(emulated, lay, split=8, orders=((2, 7),), min_splits=17)


def test_splits_not_a_multiple_of_the_step(emulated):
    """Splits of 24 and 40 tokens (the kernel takes any split up to 512; its step of tokens per round is 32 at
    head_dim 128): a split's last round part-filled, the prefix's end and the suffix's start in one split."""
    lay = random_layout(4200, groups=((1, 45),), lone_rows=1, suffix=(3, 30), Hkv=2, ratio=2, D=128, bs=8, dtype=FP)
    for split in (24, 40):
        check(emulated, lay, split=split, orders=((2, split),))


def test_several_queries_per_row(emulated):
    """Lq 2 and 3 with random limits (each query its own part of the suffix, one none at all): the per-query limit
    inside a split, queries of a row in two query blocks."""
    lay = random_layout(4300, groups=((1, 37), (1, 0)), lone_rows=1, suffix=(1, 24), Lq=3, Hkv=1, ratio=2, D=64,
                        bs=4, dtype=BF, random_limits=True)
    lay.q_limit[0, 0] = 0
    check(emulated, lay, split=32, orders=((0, 0), (1, 0)))


def test_nothing_visible_gives_zeros(emulated):
    """A row in no group and a row of an empty prefix whose queries see nothing: exactly 0 (every split's partial
    empty, the merge's weight sum 0), beside rows that see their prefix only or prefix and suffix."""
    lay = random_layout(4400, groups=((1, 0), (1, 40), (1, 21)), lone_rows=2, suffix=(1, 30), Hkv=2, ratio=4, D=64,
                        bs=16, dtype=BF)
    gr = lay.group_rows[:, 0].tolist()
    lone = sorted(set(range(lay.q.shape[0])) - set(gr))
    lay.q_limit[lone[0]] = 0
    lay.q_limit[gr[0]] = 0
    lay.q_limit[gr[2]] = 0              # (its prefix only)
    a, ref = check(emulated, lay, split=64)
    for r in (lone[0], gr[0]):
        assert (ref[r] == 0).all()
        assert (a.out[r].view(torch.int16) == 0).all(), "a row that sees nothing must be +0 exactly"
    assert (a.out[gr[2]] != 0).any()


def test_a_mutant_is_caught(emulated, tmp_path):
    """The test can fail: a kernel whose queries see one token too many (``t <= plen + lim``) is rejected by the
    comparison (two queries per row, causal: the first sees one token fewer than the second)."""
    text = (CSRC / "solo.cu").read_text(encoding="utf-8")
    assert text.count("t < plen + lim[qi]") == 1
    mutant = _compile(tmp_path, "solo_mutant", _source(text.replace("t < plen + lim[qi]", "t <= plen + lim[qi]")))
    lay = random_layout(4500, groups=((1, 9),), lone_rows=2, suffix=(2, 8), Lq=2, Hkv=1, ratio=1, D=64, bs=4,
                        dtype=BF)
    check(emulated, lay, split=64, min_splits=1)          # the kernel as it is passes
    with pytest.raises(AssertionError, match="relative error"):
        check(mutant, lay, split=64, min_splits=1)


def test_the_launcher_refuses_splits_short_of_the_tables(emulated):
    """split_tokens x nsplit short of the tables' tokens, or a split past 512: solo_launch refuses, the binding raises
    naming solo and the limits, and nothing runs."""
    lay = random_layout(4600, groups=((1, 30),), lone_rows=1, suffix=(1, 20), Hkv=1, ratio=1, D=64, bs=16, dtype=BF)
    a = solo_args(lay, split=64)
    before = emulated.lib.emu_ctas_run()
    with pytest.raises(RuntimeError, match=r"kernel solo failed: .*solo: 1 splits of 64 tokens \(1 to 512\) must "
                                           r"cover the tables' \d+ tokens"):
        emulated.solo(a._replace(nsplit=1), 0)
    with pytest.raises(RuntimeError, match=r"solo: 1 splits of 600 tokens"):
        emulated.solo(a._replace(split_tokens=600, nsplit=1), 0)
    with pytest.raises(RuntimeError, match=r"head_dim 48 has no instantiation"):
        q = torch.zeros(*a.q.shape[:3], 48, dtype=BF)
        emulated.solo(a._replace(q=q), 0)
    assert emulated.lib.emu_ctas_run() == before
    assert (a.out.isnan()).all()
