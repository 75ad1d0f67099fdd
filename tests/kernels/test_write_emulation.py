"""The cache write kernel's source (csrc/write.cu) run on the CPU (no GPU needed).

write.cu as it is (its kernels and its launchers, write_launch, write_fp8_launch and copy_blocks_layers_launch, with
their argument checks) and csrc/api.cu's hfc_write, hfc_write_strided, hfc_write_fp8 and hfc_copy_blocks_layers,
compiled with the system C++
compiler over a shim of the CUDA built-ins they use (``blockIdx``, ``blockDim``, ``threadIdx``, ``gridDim``,
``__ldg``, ``uint4``, ``dim3``); each ``kernel<<<grid, threads, smem, stream>>>(...)`` launch becomes a host loop
calling the kernel once per (CTA, thread) of its grid, one after another (the write's CTAs share nothing: no barriers,
no atomics). Called through the real ctypes binding (cuda_binding._Lib.write / write_strided / copy_blocks_layers)
with CPU tensors, it must leave the pool byte for byte as the torch write (hf_cascade/kv/cache.py
``_write_slots_torch``): K/V contiguous and strided (V, and K, as column slices of a fused [tokens, (Hq + 2 Hkv) x D]
product), with and without block copies (a static step's padding pairs among them), a bf16 and an fp8 pool, block
sizes 1 and 16; and the all-layer copy (a static step's copies in every layer's pool in one launch, the pools found by
their addresses) leaves every pool as each layer's own torch copy would. This checks the kernels' indexing and the
launchers' grids and checks, not the GPU's code for them: tests/kernels/test_gpu_kernels.py runs them on a GPU.
"""
from __future__ import annotations

import ctypes
import re
import shutil
from pathlib import Path

import pytest
import torch

from hf_cascade.kernels import cuda_library
from hf_cascade.kv import cache as cache_module

from conftest import RUNTIME_SHIM, emulated_api, emulated_binding, host_library
from kernel_helpers import padded_pairs, wide_values

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++17 compiler (g++)")

CSRC = Path(__file__).resolve().parents[2] / "csrc"

SHIM = r"""
#include <cstdarg>
#include <cstdint>
#include <cstdio>
""" + RUNTIME_SHIM + r"""
static dim3 blockIdx, threadIdx, blockDim, gridDim;
template <class T> T __ldg(const T* p) { return *p; }

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)

// the fp8 write's device types and conversions (csrc/include/hfc/common.cuh's Cvt<T>::unpack8, cuda_fp8.h's
// saturating e4m3 pair conversion) on the host: e4m3 by search for the nearest value, ties to the even code
#include <cmath>
#include <cstring>
struct uint2 { unsigned x, y; };
struct float2 { float x, y; };
static uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
static float2 make_float2(float x, float y) { return {x, y}; }
struct __nv_bfloat16 { uint16_t bits; };
struct __half { uint16_t bits; };
static float __fdiv_rn(float a, float b) { return a / b; }
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
static double e4m3_value(int code) {     // codes 0 .. 0x7e: the finite non-negative values
  const int exponent = code >> 3, mantissa = code & 7;
  return exponent ? std::ldexp(1.0 + mantissa / 8.0, exponent - 7) : std::ldexp(mantissa, -9);
}
static unsigned e4m3(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const unsigned sign = (bits >> 24) & 0x80;
  if (std::isnan(x)) return sign | 0x7f;
  const double a = std::fabs((double)x);
  int best = 0;
  for (int code = 1; code <= 0x7e; ++code) {
    const double d = std::fabs(e4m3_value(code) - a), best_d = std::fabs(e4m3_value(best) - a);
    if (d < best_d || (d == best_d && code % 2 == 0)) best = code;
  }
  return sign | (unsigned)best;
}
static unsigned short __nv_cvt_float2_to_fp8x2(float2 v, __nv_saturation_t, __nv_fp8_interpretation_t) {
  return (unsigned short)(e4m3(v.x) | (e4m3(v.y) << 8));
}
static float from_bf16(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; std::memcpy(&f, &u, 4); return f; }
static float from_fp16(uint16_t h) {
  const int exponent = (h >> 10) & 31, mantissa = h & 1023;
  const double m = exponent == 31 ? (mantissa ? NAN : INFINITY)
                   : exponent ? std::ldexp(1.0 + mantissa / 1024.0, exponent - 15) : std::ldexp(mantissa, -24);
  return (float)((h & 0x8000) ? -m : m);
}
template <typename T> struct Cvt;
template <> struct Cvt<__nv_bfloat16> {
  static void unpack8(const uint4& u, float* f) {
    uint16_t h[8]; std::memcpy(h, &u, 16);
    for (int i = 0; i < 8; ++i) f[i] = from_bf16(h[i]);
  }
};
template <> struct Cvt<__half> {
  static void unpack8(const uint4& u, float* f) {
    uint16_t h[8]; std::memcpy(h, &u, 16);
    for (int i = 0; i < 8; ++i) f[i] = from_fp16(h[i]);
  }
};

// a launch: every CTA of the grid, every thread of the CTA, one after another
template <class Kernel, class... Args>
void emu_launch(dim3 grid, unsigned threads, Kernel kernel, Args... args) {
  gridDim = grid, blockDim = dim3(threads);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x)
        for (unsigned t = 0; t < threads; ++t) {
          blockIdx = dim3(x, y, z), threadIdx = dim3(t);
          kernel(args...);
        }
}

"""


def _source() -> str:
    """The shim, write.cu with its launches turned into emu_launch, and api.cu's write and all-layer copy entries."""
    cu = (CSRC / "write.cu").read_text(encoding="utf-8")
    cu = re.sub(r'#include "hfc/[a-z_]+\.(?:h|cuh)"\n', "", cu)
    cu, launches = re.subn(r"(\w+(?:<\w+>)?)<<<([^,]+),\s*([^,]+),\s*[^,]+,\s*[^>]+>>>\(", r"emu_launch(\2, \3, \1, ",
                           cu)
    assert launches == 5, ("write.cu's five launches (the block copies, the tokens, the fp8 tokens from bf16 and from "
                           "fp16, the all-layer copies) not found")
    params = (CSRC / "include" / "hfc" / "params.h").read_text(encoding="utf-8").replace("#pragma once", "")  # dtypes
    error_functions, entries = emulated_api(("hfc_write", "hfc_write_strided", "hfc_write_fp8",
                                             "hfc_copy_blocks_layers"))
    return f"{params}\n{SHIM}\n{error_functions}\n{cu}\n{entries}"


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The binding (cuda_binding._Lib's own write / write_strided / write_fp8 / copy_blocks_layers and error check) on the
    emulated library."""
    lib = host_library(tmp_path_factory.mktemp("write"), "write", _source(),
                       ["-std=c++17", "-Wall", "-Werror", "-Wno-unused-function", "-Wno-unknown-pragmas"])
    _vp, _i64 = ctypes.c_void_p, ctypes.c_int64
    lib.hfc_write.restype = lib.hfc_write_strided.restype = ctypes.c_int
    lib.hfc_write.argtypes = [_vp, _vp, _vp, _vp, _vp, _i64, _vp, _vp, _i64, _i64, _i64, ctypes.c_size_t]
    lib.hfc_write_strided.argtypes = [_vp, _vp, _vp, _i64, _i64, _vp, _vp, _i64, _vp, _vp, _i64, _i64, _i64,
                                      ctypes.c_size_t]
    lib.hfc_write_fp8.restype = ctypes.c_int
    lib.hfc_write_fp8.argtypes = [_vp, _vp, _vp, _i64, _i64, _vp, _vp, _vp, _i64, _vp, _vp, _i64, _i64, _i64, _i64,
                                  ctypes.c_int32, ctypes.c_size_t]
    lib.hfc_copy_blocks_layers.restype = ctypes.c_int
    lib.hfc_copy_blocks_layers.argtypes = [_vp, _i64, _vp, _vp, _i64, _i64, ctypes.c_size_t]
    return emulated_binding(lib)


HQ, HKV, D, BLOCKS = 4, 2, 16, 12


def _aligned(rows, width, dtype, generator, row_stride=None) -> torch.Tensor:
    """``[rows, width]`` random values (random bytes for fp8), rows ``row_stride`` elements apart (default: packed),
    the data 16-byte aligned as the kernel needs."""
    row_stride = width if row_stride is None else row_stride
    n = rows * row_stride + 16
    if dtype == torch.float8_e4m3fn:
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator).view(dtype)
    else:
        raw = torch.randn(n, generator=generator).to(dtype)
    skip = (-raw.data_ptr() % 16) // raw.element_size()
    out = raw[skip:].as_strided((rows, width), (row_stride, 1))
    assert out.data_ptr() % 16 == 0
    return out


def _case(tokens, copies, block_size, dtype, layout, seed):
    """(pool, key, value, write_block, write_offset, copy_src, copy_dst, copies): copy pairs as a static step pads
    them (pair 0 repeated, a block copied onto itself), tokens written into the copied blocks and others (each token
    its own block: one slot per token, whatever the offsets); K/V contiguous ("contiguous"), V a column slice of a
    fused [tokens, q | k | v] product ("fused_v"), or both K and V slices of it ("fused_kv")."""
    g = torch.Generator().manual_seed(seed)
    pool = _aligned(BLOCKS, 2 * block_size * HKV * D, dtype, g).view(BLOCKS, 2, block_size, HKV, D)
    fused = _aligned(tokens, (HQ + 2 * HKV) * D, dtype, g)
    k_slice = fused[:, HQ * D:(HQ + HKV) * D].view(tokens, HKV, D)
    v_slice = fused[:, (HQ + HKV) * D:].view(tokens, HKV, D)
    key = k_slice if layout == "fused_kv" else k_slice.contiguous()
    value = v_slice.contiguous() if layout == "contiguous" else v_slice
    assert value.is_contiguous() == (layout == "contiguous" or tokens <= 1)
    ids = torch.randperm(BLOCKS, generator=g)
    real = max(copies - 2, min(copies, 1))                 # the rest pads: pair 0 repeated, one self-copy
    src, dst = ids[:real], ids[real:2 * real]
    pad = max(copies - real - 1, 0)
    copy_src = torch.cat([src, src[:1].expand(pad), ids[-1:]])[:copies].contiguous()
    copy_dst = torch.cat([dst, dst[:1].expand(pad), ids[-1:]])[:copies].contiguous()
    write_block = torch.cat([dst, ids[2 * real:]])[:tokens].contiguous()
    assert len(write_block) == tokens
    write_offset = torch.randint(0, block_size, (tokens,), generator=g)
    return pool, key, value, write_block, write_offset, copy_src, copy_dst, copies > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("layout", ["contiguous", "fused_v", "fused_kv"])
@pytest.mark.parametrize("tokens, copies", [(5, 4), (1, 1), (6, 0), (0, 3)])
def test_the_write_kernel_source_equals_the_torch_write(emulated, dtype, block_size, layout, tokens, copies):
    pool, key, value, *rest = _case(tokens, copies, block_size, dtype, layout, seed=tokens * 7 + copies)
    want, got = pool.clone(), pool.clone()
    cache_module._write_slots_torch(want, key, value, *rest)
    before = got.view(torch.uint8).clone()
    if layout == "contiguous":
        emulated.write(got, key, value, *rest, 0)
        strided = pool.clone()
        emulated.write_strided(strided, key, value, *rest, 0)        # the strided entry with tokens packed
        assert torch.equal(strided.view(torch.uint8), want.view(torch.uint8))
    else:
        emulated.write_strided(got, key, value, *rest, 0)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(got.view(torch.uint8), before)          # (every case moves something)


def test_the_old_entry_reads_tokens_packed(emulated):
    """hfc_write (the ABI as it was) passes a token's bytes as both strides: handed a strided V's pointer it reads the
    tokens packed, so it differs from the torch write exactly where a strided read is needed (the test above could not
    tell the strides apart otherwise)."""
    pool, key, value, *rest = _case(5, 0, 16, torch.bfloat16, "fused_v", seed=3)
    want, got = pool.clone(), pool.clone()
    cache_module._write_slots_torch(want, key, value, *rest)
    emulated.write(got, key, value, *rest, 0)
    got_v, want_v = got[:, 1].view(torch.uint8), want[:, 1].view(torch.uint8)
    assert torch.equal(got[:, 0], want[:, 0]) and not torch.equal(got_v, want_v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["contiguous", "fused_v", "fused_kv"])
@pytest.mark.parametrize("tokens, copies", [(5, 4), (1, 1), (6, 0)])
def test_the_fp8_write_kernel_source_encodes_as_the_storage_does(emulated, dtype, layout, tokens, copies):
    """hfc_write_fp8 (an fp8 pool fed the model's 16-bit K/V) leaves the pool byte for byte as BlockStorage.encode
    (divide by the head's scale, saturate, round to e4m3) followed by the torch write: per-head scales of K and V
    apart, values over 10 decades with zeros of both signs and infinities, K/V contiguous or column slices of the
    fused product, with and without block copies."""
    from hf_cascade.kv.memory import BlockStorage
    g = torch.Generator().manual_seed(tokens * 11 + copies)
    _, key, value, *rest = _case(tokens, copies, 16, dtype, layout, seed=tokens * 5 + copies)
    for t in {key.data_ptr(): key, value.data_ptr(): value}.values():
        t.copy_(wide_values(t.shape, g, specials=8))
    pool = _aligned(BLOCKS, 2 * 16 * HKV * D, torch.float8_e4m3fn, g).view(BLOCKS, 2, 16, HKV, D)
    storage = BlockStorage((2, 16, HKV, D), torch.float8_e4m3fn, "cpu")
    storage.scale.copy_(10.0 ** (torch.rand(2, HKV, generator=g) * 3 - 2))
    storage.scale_fixed = True
    want, got = pool.clone(), pool.clone()
    cache_module._write_slots_torch(want, *storage.encode(key, value), *rest)
    emulated.write_fp8(got, key, value, storage.scale, *rest, 0)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    written = want.view(torch.uint8)[rest[0], :, rest[1]]
    assert ((written & 0x7f) == 0x7e).any() and ((written & 0x7f) == 0).any()     # saturated and flushed values


def test_the_fp8_write_refuses_what_it_cannot_encode(emulated):
    """A dtype code other than bf16 / fp16, a head_dim not a multiple of 8, K/V tokens closer than a token's bytes:
    refused with a message naming them, the pool left as it was."""
    g = torch.Generator().manual_seed(4)
    pool = _aligned(BLOCKS, 2 * 16 * HKV * D, torch.float8_e4m3fn, g).view(BLOCKS, 2, 16, HKV, D)
    key = _aligned(3, HKV * D, torch.bfloat16, g).view(3, HKV, D)
    scale, index = torch.ones(2, HKV), torch.arange(3)
    before = pool.clone()
    lib = emulated.lib
    args = (index.data_ptr(), index.data_ptr(), 3, index.data_ptr(), index.data_ptr(), 0, 16)

    def call(k_stride, heads, dim, dtype_code):
        return lib.hfc_write_fp8(pool.data_ptr(), key.data_ptr(), key.data_ptr(), k_stride, 2 * HKV * D,
                                 scale.data_ptr(), *args, heads, dim, dtype_code, 0)
    assert call(2 * HKV * D, HKV, D, 2) != 0 and b"dtype code 2" in lib.hfc_last_error()
    assert call(2 * HKV * D, 4, 12, 0) != 0 and b"head_dim 12" in lib.hfc_last_error()
    assert call(HKV * D, HKV, D, 0) != 0 and b"key_stride_bytes 32" in lib.hfc_last_error()
    assert torch.equal(pool.view(torch.uint8), before.view(torch.uint8))


def test_the_strided_entry_refuses_strides_it_cannot_read(emulated):
    """Token strides that are not whole 16-byte vectors, or shorter than a token, are refused with a message naming
    them; the pool is left as it was."""
    g = torch.Generator().manual_seed(0)
    pool = _aligned(BLOCKS, 2 * 16 * HKV * D, torch.bfloat16, g).view(BLOCKS, 2, 16, HKV, D)
    key = _aligned(3, HKV * D, torch.bfloat16, g).view(3, HKV, D)                          # 64-byte tokens
    index = torch.arange(3)
    before = pool.clone()
    odd = _aligned(3, HKV * D, torch.bfloat16, g, row_stride=HKV * D + 4).view(3, HKV, D)  # 72 bytes apart
    with pytest.raises(RuntimeError, match=r"write_strided failed: .*value_stride_bytes 72 \(multiples of 16"):
        emulated.write_strided(pool, key, odd, index, index, index, index, False, 0)
    overlapping = key.as_strided(key.shape, (HKV * D // 2, D, 1))                         # 32 bytes apart
    with pytest.raises(RuntimeError, match=r"key_stride_bytes 32, value_stride_bytes 64 \(.*at least token_bytes 64"):
        emulated.write_strided(pool, overlapping, key, index, index, index, index, False, 0)
    assert torch.equal(pool, before)


def test_the_fit_check_takes_what_the_kernel_reads():
    """cuda_library's strided fit (each token's Hkv x D contiguous, a 16-byte multiple token stride no shorter than a
    token, 16-byte aligned data) takes the layouts the emulated kernel reads above and refuses the others."""
    fits = cuda_library._tokens_fit
    g = torch.Generator().manual_seed(1)
    fused = _aligned(5, (HQ + 2 * HKV) * D, torch.bfloat16, g)
    v = fused[:, (HQ + HKV) * D:].view(5, HKV, D)
    assert fits(v) and fits(v.contiguous()) and fits(fused[:, HQ * D:(HQ + HKV) * D].view(5, HKV, D))
    assert fits(fused[:1, (HQ + HKV) * D:].view(1, HKV, D))                    # one token: its stride is immaterial
    assert not fits(v.transpose(1, 2).contiguous().transpose(1, 2))            # D strided
    assert not fits(fused[:, HQ * D:].view(5, 2 * HKV, D)[:, ::2])              # heads strided
    assert not fits(fused[:, (HQ + HKV) * D + 1:][:, :HKV * D - 8].view(5, HKV, D - 4))   # not 16-byte aligned
    assert not fits(_aligned(5, HKV * D, torch.bfloat16, g, row_stride=HKV * D + 4).view(5, HKV, D))  # 72 bytes apart
    assert not fits(v.as_strided(v.shape, (8, D, 1)))                          # tokens overlap


def _layer_pools(layers: int, block_shape, dtype, seed: int, blocks: int = BLOCKS) -> list[torch.Tensor]:
    """``layers`` pools ``[blocks, *block_shape]`` of random bytes, each 16-byte aligned (as the kernel needs)."""
    g = torch.Generator().manual_seed(seed)
    width = 1
    for n in block_shape:
        width *= n
    return [_aligned(blocks, width, dtype, g).view(blocks, *block_shape) for _ in range(layers)]


def _padded_pairs(real: int, copies: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return padded_pairs(torch.Generator().manual_seed(seed), BLOCKS, real, copies)


def _addresses(pools) -> torch.Tensor:
    return torch.tensor([p.data_ptr() for p in pools], dtype=torch.int64)


def _torch_copies(pools, copy_src, copy_dst) -> list[torch.Tensor]:
    """Each pool as its layer's own write leaves it with copies and no tokens (the per-layer path)."""
    out = []
    for pool in pools:
        want, none = pool.clone(), torch.zeros(0, dtype=torch.int64)
        empty = want.new_empty((0, *want.shape[3:]))
        cache_module._write_slots_torch(want, empty, empty, none, none, copy_src, copy_dst, True)
        out.append(want)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("block_shape", [(2, 1, HKV, D), (2, 16, HKV, D), (2, 64, 8, 64)],
                         ids=["block1", "block16", "parts16"])
@pytest.mark.parametrize("layers, real, copies", [(3, 4, 7), (1, 1, 1), (4, 2, 2), (2, 0, 3), (5, 3, 5)])
def test_the_all_layer_copy_source_equals_each_layers_torch_copy(emulated, dtype, block_shape, layers, real, copies):
    """hfc_copy_blocks_layers over the pools' addresses leaves every layer's pool byte for byte as its own torch copy
    does: ragged pairs (``real`` copies, the rest a static step's padding: pair 0 repeated, a self-copy; or padding
    alone), bf16 and fp8 (1-byte) pools, one to five layers, blocks of 1, 16 and 64 tokens (the widest over 16 parts
    of the grid's second dimension, each thread moving several vectors)."""
    pools = _layer_pools(layers, block_shape, dtype, seed=layers * 31 + real * 7 + copies)
    copy_src, copy_dst = _padded_pairs(real, copies, seed=real + copies)
    want = _torch_copies(pools, copy_src, copy_dst)
    got = [p.clone() for p in pools]
    block_bytes = got[0][0].numel() * got[0].element_size()
    emulated.copy_blocks_layers(_addresses(got), copy_src, copy_dst, block_bytes, 0)
    for g, w, before in zip(got, want, pools):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
        assert torch.equal(g.view(torch.uint8), before.view(torch.uint8)) == (real == 0)   # (real copies move bytes)


def test_the_all_layer_copy_takes_pools_of_any_dtype_with_the_same_block_bytes(emulated):
    """The kernel moves raw bytes: a bf16 pool and an fp8 pool with twice the heads (the same bytes a block) are
    copied in one launch, each as its own torch copy does; a pool left out of the addresses is left as it was."""
    (bf16,) = _layer_pools(1, (2, 16, HKV, D), torch.bfloat16, seed=1)
    (fp8, other) = _layer_pools(2, (2, 16, 2 * HKV, D), torch.float8_e4m3fn, seed=2)
    copy_src, copy_dst = _padded_pairs(3, 6, seed=5)
    want = _torch_copies([bf16, fp8], copy_src, copy_dst)
    got, left_out = [bf16.clone(), fp8.clone()], other.clone()
    emulated.copy_blocks_layers(_addresses(got), copy_src, copy_dst, 2 * 16 * HKV * D * 2, 0)
    assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want))
    assert torch.equal(left_out.view(torch.uint8), other.view(torch.uint8))


def test_the_all_layer_copy_refuses_what_it_cannot_copy(emulated):
    """Block bytes that are not whole 16-byte vectors, a layer count past the grid's third dimension and a NULL
    address array are refused with a message naming them; nothing is copied. No layers or no pairs copy nothing."""
    pools = _layer_pools(2, (2, 16, HKV, D), torch.bfloat16, seed=3)
    before = [p.clone() for p in pools]
    copy_src, copy_dst = _padded_pairs(2, 2, seed=1)
    addresses = _addresses(pools)
    with pytest.raises(RuntimeError, match=r"copy_blocks_layers failed: .*block_bytes 24 \(a multiple of 16 needed"):
        emulated.copy_blocks_layers(addresses, copy_src, copy_dst, 24, 0)
    lib = emulated.lib
    rc = lib.hfc_copy_blocks_layers(addresses.data_ptr(), 65536, copy_src.data_ptr(), copy_dst.data_ptr(), 2, 2048, 0)
    assert rc != 0 and b"65536 layers (65535 at most)" in lib.hfc_last_error()
    rc = lib.hfc_copy_blocks_layers(None, 2, copy_src.data_ptr(), copy_dst.data_ptr(), 2, 2048, 0)
    assert rc != 0 and b"NULL" in lib.hfc_last_error()
    assert lib.hfc_copy_blocks_layers(None, 0, None, None, 2, 2048, 0) == 0
    assert lib.hfc_copy_blocks_layers(addresses.data_ptr(), 2, None, None, 0, 2048, 0) == 0
    assert all(torch.equal(p, b) for p, b in zip(pools, before))
