"""The Hopper prefix kernel's fp8 staging (csrc/include/hfc/fp8_stage.cuh, used by csrc/prefix_sm90.cu's fp8 producer
warps) run on the CPU: the header as it is, compiled with the system C++ compiler over a shim of the CUDA qualifiers
and uint4 (conftest.RUNTIME_SHIM's), with a host e4m3 -> 16-bit conversion in place of fp8x2_to (which the portable
kernel's fp8 path shares and the GPU tests check).

A random fp8 tile of 64 tokens x 128 dims is copied into a staging tile as the warp's cp.async passes address it (every
lane, every pass), then converted lane by lane as the producer does; the result must be, byte for byte, the 16-bit
tile the 16-bit producer writes from the same values (two 64-dim halves, 128-byte rows, chunk cc of token n at
cc ^ (n & 7): the wgmma layout csrc/tests/wgmma_layout_check.cu checks on the GPU). Also: each pass and item covers
every (token, chunk) once, and the 8 lanes of each shared-memory phase read and write 8 different 16-byte bank groups.
A mutant layout (the 16-bit writes unswizzled) is rejected.
"""
from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import RUNTIME_SHIM, host_library

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")

HEADER = Path(__file__).resolve().parents[2] / "csrc" / "include" / "hfc" / "fp8_stage.cuh"
TOKENS, DIMS, LANES = 64, 128, 32

SHIM = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#define __host__
#define __device__
#define __forceinline__ inline
""" + RUNTIME_SHIM + r"""
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
"""

DRIVER = r"""
using namespace hfc::fp8_stage;

// e4m3 (bias 7, no infinities) -> float, exact
static float e4m3(uint32_t b) {
  const int s = (b >> 7) & 1, e = (b >> 3) & 15, m = b & 7;
  const float v = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
  return s ? -v : v;
}
static uint32_t to16(float f, int fp16) {
  if (fp16) { const _Float16 h = static_cast<_Float16>(f); uint16_t u; std::memcpy(&u, &h, 2); return u; }
  uint32_t u; std::memcpy(&u, &f, 4); return u >> 16;   // exact: e4m3 has 3 mantissa bits
}

extern "C" int stage(const uint8_t* tile, uint8_t* staged, int* covered) {
  for (int pass = 0; pass < kCopyPasses; ++pass)
    for (int lane = 0; lane < 32; ++lane) {
      int n, c;
      copy_item(pass, lane, n, c);
      if (n < 0 || n >= kTokens || c < 0 || c >= 8) return 1;
      covered[n * 8 + c] += 1;
      std::memcpy(staged + staging_offset(n, c), tile + n * kDims + c * 16, 16);
    }
  return 0;
}

extern "C" void convert(const uint8_t* staged, uint8_t* dst, int fp16) {
  auto cvt = [fp16](uint32_t pair) { return to16(e4m3(pair & 0xff), fp16) | (to16(e4m3(pair >> 8), fp16) << 16); };
  for (int lane = 0; lane < 32; ++lane) convert_tile(staged, dst, lane, cvt);
}

// per (item, lane): token, chunk, the staging read's offset and the two 16-bit writes' offsets
extern "C" void items(int* out) {
  for (int it = 0; it < kConvertItems; ++it)
    for (int lane = 0; lane < 32; ++lane) {
      int n, c;
      convert_item(it, lane, n, c);
      int* o = out + (it * 32 + lane) * 5;
      o[0] = n, o[1] = c, o[2] = staging_offset(n, c), o[3] = tile_offset(n, c, 0), o[4] = tile_offset(n, c, 1);
    }
}
"""


def _build(tmp_path, header_text: str):
    header_text = header_text.replace("#pragma once", "")        # (the header is the main file here)
    lib = host_library(tmp_path, "fp8_stage", SHIM + header_text + DRIVER, ["-std=c++17"])
    lib.stage.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.convert.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.items.argtypes = [ctypes.c_void_p]
    return lib


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("fp8_stage"), HEADER.read_text())


def _random_tile(seed: int) -> np.ndarray:
    """fp8 e4m3 bytes [64 tokens, 128 dims], every code but NaN (0x7f, 0xff): zeros, subnormals, the extremes."""
    rng = np.random.default_rng(seed)
    tile = rng.integers(0, 256, size=(TOKENS, DIMS), dtype=np.uint8)
    tile[(tile & 0x7F) == 0x7F] = 0x7E
    tile[0, :8] = [0x00, 0x80, 0x01, 0x81, 0x07, 0x08, 0x7E, 0xFE]
    return tile


def _expected(tile: np.ndarray, dtype) -> np.ndarray:
    """The 16-bit tile the 16-bit producer writes for these values: [2 halves][64 tokens][8 chunks ^ (n & 7)][8]."""
    vals = torch.from_numpy(tile.copy()).view(torch.float8_e4m3fn).to(dtype).view(torch.int16).numpy()
    out = np.zeros((2, TOKENS, 8, 8), dtype=np.int16)
    for n in range(TOKENS):
        for half in range(2):
            for cc in range(8):
                out[half, n, cc ^ (n & 7)] = vals[n, 64 * half + 8 * cc: 64 * half + 8 * cc + 8]
    return out.reshape(-1)


def _run(lib, tile: np.ndarray, fp16: bool):
    staged = np.full(TOKENS * DIMS, 0xA5, dtype=np.uint8)          # garbage: every byte must be written
    covered = np.zeros(TOKENS * 8, dtype=np.int32)
    assert lib.stage(tile.ctypes.data, staged.ctypes.data, covered.ctypes.data) == 0
    assert (covered == 1).all(), "the copy passes must cover every (token, chunk) once"
    out = np.full(2 * TOKENS * 128, 0x5A, dtype=np.uint8)
    lib.convert(staged.ctypes.data, out.ctypes.data, int(fp16))
    return out.view(np.int16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_staged_fp8_tile_converts_to_the_16_bit_tile(lib, dtype, seed):
    tile = _random_tile(seed)
    got = _run(lib, tile, dtype == torch.float16)
    np.testing.assert_array_equal(got, _expected(tile, dtype))


def test_items_cover_the_tile_once_and_phases_avoid_bank_conflicts(lib):
    items = np.zeros((16, LANES, 5), dtype=np.int32)
    lib.items(items.ctypes.data)
    pairs = {(int(n), int(c)) for n, c in items[..., :2].reshape(-1, 2)}
    assert len(pairs) == TOKENS * 8 == items.shape[0] * LANES
    for it in range(items.shape[0]):
        for phase in range(4):          # a 16-byte access is served 8 lanes at a time (128 bytes a wavefront)
            lanes = items[it, 8 * phase: 8 * phase + 8]
            for column in (2, 3, 4):    # the staging read, the two 16-bit writes
                groups = (lanes[:, column] % 128) // 16
                assert len(set(groups.tolist())) == 8, (it, phase, column, groups)


def test_a_mutant_layout_is_rejected(tmp_path):
    # the 16-bit writes unswizzled (chunk cc of every token at cc): the wgmma would read other dims than it multiplies
    text = HEADER.read_text()
    mutant = text.replace("return (c >> 2) * kHalfBytes + n * 128 + ((cc ^ (n & 7)) << 4);",
                          "return (c >> 2) * kHalfBytes + n * 128 + (cc << 4);")
    assert mutant != text
    bad = _build(tmp_path, mutant)
    tile = _random_tile(5)
    assert not np.array_equal(_run(bad, tile, False), _expected(tile, torch.bfloat16))
