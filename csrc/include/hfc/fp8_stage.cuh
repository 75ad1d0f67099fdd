// The Hopper prefix kernel's fp8 producers (csrc/prefix_sm90.cu, HFC_PREFIX_KERNEL_SM90_FP8): where a warp's cp.async
// copies put a 64-token fp8 tile of K (or V) in its staging ring, and how the warp converts a staged tile into the
// 16-bit tile the wgmma reads. Plain integer and memory code, so tests/kernels/test_fp8_stage_emulation.py runs it on
// the CPU against the 16-bit layout.
//
// Staging: [64 tokens][128 bytes] (one byte a dim), 16-byte chunk c (dims 16c..16c+15) of token n at c ^ (n & 7).
// 16-bit tile: [2 halves of 64 dims][64 tokens][128 bytes], 16-byte chunk cc (dims 8cc..8cc+7 of the half) of token n
// at cc ^ (n & 7): the 128-byte swizzle, as csrc/prefix_sm90.cu's 16-bit producer writes it.
#pragma once

#include <stdint.h>

namespace hfc {
namespace fp8_stage {

constexpr int kTokens = 64, kDims = 128;
constexpr int kTileBytes = kTokens * kDims;          // a staged fp8 tile: 8 KB
constexpr int kHalfBytes = kTokens * 128;            // one 64-dim half of the 16-bit tile: 8 KB
constexpr int kCopyPasses = kTokens * 8 / 32;        // 16-byte copies per lane per tile
constexpr int kConvertItems = kTokens * 8 / 32;      // staged chunks per lane per tile

__host__ __device__ __forceinline__ int staging_offset(int n, int c) { return n * 128 + ((c ^ (n & 7)) << 4); }

// the token and chunk lane `lane` copies in pass `pass` (8 lanes a token: a token's 128 bytes in one phase)
__host__ __device__ __forceinline__ void copy_item(int pass, int lane, int& n, int& c) {
  n = 4 * pass + (lane >> 3);
  c = lane & 7;
}

// the token and chunk lane `lane` converts in item `it`: the 8 lanes of a shared-memory phase take one chunk of 8
// consecutive tokens, so both the staging reads and the 16-bit writes fall in 8 different 16-byte bank groups
__host__ __device__ __forceinline__ void convert_item(int it, int lane, int& n, int& c) {
  n = 8 * (it >> 1) + (lane & 7);
  c = 4 * (it & 1) + (lane >> 3);
}

// byte offset in the 16-bit tile of 16-bit chunk `half8` (0: dims 16c..16c+7, 1: 16c+8..16c+15) of staged chunk c
__host__ __device__ __forceinline__ int tile_offset(int n, int c, int half8) {
  const int cc = 2 * (c & 3) + half8;
  return (c >> 2) * kHalfBytes + n * 128 + ((cc ^ (n & 7)) << 4);
}

// lane's share of one staged tile converted into the 16-bit tile at dst: Convert(pair) is 2 fp8 (the low 16 bits,
// the first in the low byte) -> 2 16-bit values packed in 32 bits (the first in the low half), exact
template <class Convert>
__device__ __forceinline__ void convert_tile(const unsigned char* staged, unsigned char* dst, int lane, Convert cvt) {
#pragma unroll 4
  for (int it = 0; it < kConvertItems; ++it) {
    int n, c;
    convert_item(it, lane, n, c);
    const uint4 w = *reinterpret_cast<const uint4*>(staged + staging_offset(n, c));
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    uint32_t o[8];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      o[2 * q] = cvt(words[q] & 0xffffu);
      o[2 * q + 1] = cvt(words[q] >> 16);
    }
    *reinterpret_cast<uint4*>(dst + tile_offset(n, c, 0)) = make_uint4(o[0], o[1], o[2], o[3]);
    *reinterpret_cast<uint4*>(dst + tile_offset(n, c, 1)) = make_uint4(o[4], o[5], o[6], o[7]);
  }
}

}  // namespace fp8_stage
}  // namespace hfc
