// Shared device-side building blocks of the hf_cascade kernels: launch shape, -inf, 16-bit <-> float
// conversion, cp.async. Included by csrc/prefix.cu, csrc/suffix.cu and csrc/merge.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace hfc {

constexpr int kThreads = 128;  // every kernel: 4 warps
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__host__ __device__ constexpr int align128(int x) { return (x + 127) / 128 * 128; }

inline bool fits_int(long long x) { return x >= 0 && x <= 0x7fffffffLL; }

// ------------------------------------------------------------------------------------------ types

template <typename T> struct Cvt;
template <> struct Cvt<__half> {
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {  // lo in the low 16 bits
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ void unpack8(const uint4& u, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 v = __half22float2(h[i]);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
};
template <> struct Cvt<__nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ uint32_t pack2(float lo, float hi) {  // lo in the low 16 bits
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ void unpack8(const uint4& u, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 v = __bfloat1622float2(h[i]);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
};

// 8 float8_e4m3fn values (8 bytes, the first in the lowest byte) -> 8 floats: exact (hardware cvt from sm_89 on)
__device__ __forceinline__ void fp8x8_to_float(const uint2& u, float* f) {
  const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3);
    const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&raw));
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

// 2 float8_e4m3fn values (the low 16 bits, the first in the low byte) -> 2 T packed in 32 bits (the first in the low
// half), exact: the MMA operands of csrc/prefix.cu's fp8 path. fp16: one cvt.rn.f16x2.e4m3x2 (sm_89 on; emulated by
// the intrinsic before). bf16: that f16 pair re-biased. An e4m3 value is a normal f16 (2^-9 <= |x| <= 448) with 3
// mantissa bits, so its f16 bits shifted right by 3 (sign kept) are the normal bf16 x * 2^-112 (0 stays 0), made x
// by an exact multiply with 2^112 (bf16 0x7780): no subnormal on the way, and two integer ops and one HMUL2 against
// the four conversions of the route through float.
template <typename T> __device__ __forceinline__ uint32_t fp8x2_to(uint32_t pair);
template <> __device__ __forceinline__ uint32_t fp8x2_to<__half>(uint32_t pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}
template <> __device__ __forceinline__ uint32_t fp8x2_to<__nv_bfloat16>(uint32_t pair) {
  const uint32_t h = fp8x2_to<__half>(pair);
  uint32_t bits = (h & 0x80008000u) | ((h >> 3) & 0x0fff0fffu);
  const __nv_bfloat16 two112 = __ushort_as_bfloat16(0x7780);
  const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits), __halves2bfloat162(two112, two112));
  return *reinterpret_cast<const uint32_t*>(&v);
}

// --------------------------------------------------------------------------------- online softmax

// One tile's step of the online softmax (log2 domain) for rows g and g + 8 of an mma.m16n8 / wgmma accumulator, whose
// row is held by a quad of lanes: mx, this lane's maxima of the tile -> the quad's; m_run, the running maxima ->
// the new ones; alpha, the factor for the old state (0 where there was none); m_use, the maximum to subtract (0 where
// everything is -inf, so that exp2 gives 0, never NaN). Used by csrc/prefix.cu and csrc/prefix_sm90.cu.
__device__ __forceinline__ void online_max(float (&mx)[2], float (&m_run)[2], float (&alpha)[2], float (&m_use)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFull, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFull, mx[r], 2));
    const float m_new = fmaxf(m_run[r], mx[r]);
    alpha[r] = (m_run[r] == neg_inf()) ? 0.0f : exp2f(m_run[r] - m_new);
    m_use[r] = (m_new == neg_inf()) ? 0.0f : m_new;
    m_run[r] = m_new;
  }
}

// The tile's probabilities P = exp2(S - m_use) of the same rows, from S's accumulators s (NT n-tiles of 8 columns,
// masked columns at -inf give 0): their row sums added to rsum, and P packed in T pairs as the A operand of P V
// (k step j = n-tiles 2j, 2j + 1: mma.m16n8k16's A fragment, which is also wgmma's register A fragment per warp).
template <typename T, int NT>
__device__ __forceinline__ void probabilities(const float (&s)[NT][4], const float (&m_use)[2], float (&rsum)[2],
                                              uint32_t (&pf)[NT / 2][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const float p0 = exp2f(s[nt][0] - m_use[0]);  // exp2(-inf) = 0 for masked columns
    const float p1 = exp2f(s[nt][1] - m_use[0]);
    const float p2 = exp2f(s[nt][2] - m_use[1]);
    const float p3 = exp2f(s[nt][3] - m_use[1]);
    rsum[0] += p0 + p1;
    rsum[1] += p2 + p3;
    pf[nt >> 1][(nt & 1) * 2 + 0] = Cvt<T>::pack2(p0, p1);
    pf[nt >> 1][(nt & 1) * 2 + 1] = Cvt<T>::pack2(p2, p3);
  }
}

// The running state of the same rows rescaled for the new maximum: row sums l (this lane's share) and the output
// accumulators o (DN n-tiles of 8 columns).
template <int DN>
__device__ __forceinline__ void rescale_state(float (&l)[2], float (&o)[DN][4], const float (&alpha)[2],
                                              const float (&rsum)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + rsum[r];
#pragma unroll
  for (int dn = 0; dn < DN; ++dn) {
    o[dn][0] *= alpha[0];
    o[dn][1] *= alpha[0];
    o[dn][2] *= alpha[1];
    o[dn][3] *= alpha[1];
  }
}

// --------------------------------------------------------------------------------------- cp.async

// src_bytes 0: nothing is read, the 16 bytes are zero-filled
__device__ __forceinline__ void cp_async16_zfill(void* smem_dst, const void* gmem_src, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem_src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace hfc
