// The decode step's elementwise work that eager mode runs as many tiny kernels, one launch each: RMSNorm, the
// rotary embedding and the MLP's SiLU x up (hf_cascade/decode/fused_ops.py installs them).
//
// RMSNorm of a step's rows in one launch: transformers' LlamaRMSNorm (and its copies in Mistral, Qwen2, Qwen3,
// ...) is eight elementwise and reduction kernels in eager mode, 2 per decoder layer plus the final norm: ~520 tiny
// launches in an 8B model's step. Semantics (hf_cascade/fused_ops.py `rms_norm_reference`), with the eager
// forward's roundings: y = float(x); r = rsqrt(mean(y * y) + eps); out = T(float(w) * float(T(y * r))), T the
// model's element type (bf16, fp16). Only the sum of squares is ordered differently (a tree over the row's
// threads), so the normalised value can differ from eager's in its last float32 bits.

#include "hfc/common.cuh"
#include "hfc/dispatch.h"
#include "hfc/errors.h"
#include "hfc/launch.h"
#include "hfc/rounding.cuh"

#include <cstdint>
#include <type_traits>

namespace hfc {
namespace {

constexpr int kNormThreads = 256;

// the rotary kernel's arguments (internal to this file: the C ABI passes them one by one)
struct RotaryArgs {
  const void *q, *k, *cos, *sin;
  void *q_out, *k_out;
  int64_t batch, tokens, q_heads, k_heads, head_dim;
  int64_t q_stride[3], k_stride[3], cs_stride[2];  // (batch, head, token) of q and k; (batch, token) of cos and sin
};

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

// The row's sum of squares over `threads` threads (a warp tree, then, for more than one warp, the warps' sums
// through shared memory: `warp_sums` holds kNormThreads / 32 floats), returned to every thread of the row.
__device__ __forceinline__ float row_sum(float sum, int threads, float* warp_sums) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(kFull, sum, offset);
  if (threads <= 32) return sum;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = sum;
  __syncthreads();
  sum = lane < threads / 32 ? warp_sums[lane] : 0.f;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(kFull, sum, offset);
  return sum;
}

// out = T(w * T(x * rsqrt(mean(x^2) + eps))) for 8 elements at once (one 16-byte vector of x, w and out)
template <typename T>
__device__ __forceinline__ uint4 norm_vector(const uint4 x, const uint4 w, float r) {
  const T* xs = reinterpret_cast<const T*>(&x);
  const T* ws = reinterpret_cast<const T*>(&w);
  uint4 out;
  uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const T lo = Cvt<T>::from_float(to_float(xs[2 * j]) * r), hi = Cvt<T>::from_float(to_float(xs[2 * j + 1]) * r);
    o[j] = Cvt<T>::pack2(to_float(ws[2 * j]) * to_float(lo), to_float(ws[2 * j + 1]) * to_float(hi));
  }
  return out;
}

__device__ __forceinline__ float sum_of_squares(const uint4 v, float sum, bool bf16) {
  const uint32_t* p = reinterpret_cast<const uint32_t*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float lo, hi;
    if (bf16) {
      lo = __uint_as_float(p[j] << 16), hi = __uint_as_float(p[j] & 0xffff0000u);
    } else {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&p[j]));
      lo = f.x, hi = f.y;
    }
    sum += lo * lo;
    sum += hi * hi;
  }
  return sum;
}

// T(a + b) for 8 elements at once: eager's `residual + hidden_states` (float sum, rounded once to T)
template <typename T>
__device__ __forceinline__ uint4 add_vector(const uint4 a, const uint4 b) {
  const T* as = reinterpret_cast<const T*>(&a);
  const T* bs = reinterpret_cast<const T*>(&b);
  uint4 out;
  uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
  for (int j = 0; j < 4; ++j)
    o[j] = Cvt<T>::pack2(add_rn(to_float(as[2 * j]), to_float(bs[2 * j])),
                         add_rn(to_float(as[2 * j + 1]), to_float(bs[2 * j + 1])));
  return out;
}

// Rows whose ends and strides are 16-byte aligned, the row held in registers (kVecs vectors of 8 a thread) so that
// every load of a row is in flight at once: `threads` threads a row (a warp, or the CTA), kNormThreads / threads rows
// a CTA. A row of hidden <= threads * 8 * kVecs. With a `residual` (non-NULL): the row normalised is T(x + residual),
// also written to `sum_out` (contiguous rows): a decoder layer's residual add and the norm after it in one launch.
template <typename T, int kVecs>
__global__ void __launch_bounds__(kNormThreads)
    rms_norm_vec_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight, int64_t rows,
                        int64_t hidden, int64_t x_stride, float eps, int threads, const T* __restrict__ residual,
                        int64_t residual_stride, T* __restrict__ sum_out) {
  __shared__ float warp_sums[kNormThreads / 32];
  const int64_t r = (int64_t)blockIdx.x * (kNormThreads / threads) + threadIdx.x / threads;
  const int t = threadIdx.x % threads;
  const int64_t vecs = hidden / 8;
  const bool live = r < rows;   // (a warp past the last row still joins its CTA's barriers: threads = kNormThreads)
  const uint4* row = reinterpret_cast<const uint4*>(x + (live ? r : 0) * x_stride);
  uint4 v[kVecs];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int64_t c = t + (int64_t)i * threads;
    v[i] = live && c < vecs ? row[c] : make_uint4(0, 0, 0, 0);
  }
  if (residual != nullptr) {
    const uint4* res = reinterpret_cast<const uint4*>(residual + (live ? r : 0) * residual_stride);
    uint4* sums = reinterpret_cast<uint4*>(sum_out + (live ? r : 0) * hidden);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int64_t c = t + (int64_t)i * threads;
      if (live && c < vecs) {
        v[i] = add_vector<T>(v[i], res[c]);
        sums[c] = v[i];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kVecs; ++i) sum = sum_of_squares(v[i], sum, std::is_same<T, __nv_bfloat16>::value);
  sum = row_sum(sum, threads, warp_sums);
  if (!live) return;
  const float inv_rms = rsqrtf(sum / (float)hidden + eps);
  const uint4* w = reinterpret_cast<const uint4*>(weight);
  uint4* dst = reinterpret_cast<uint4*>(out + r * hidden);
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int64_t c = t + (int64_t)i * threads;
    if (c < vecs) dst[c] = norm_vector<T>(v[i], w[c], inv_rms);
  }
}

// Any other row (hidden not a multiple of 8, unaligned, or wider than the vector kernel's registers): CTA r, row r,
// element by element.
template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    rms_norm_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight, int64_t hidden,
                    int64_t x_stride, float eps) {
  __shared__ float warp_sums[kNormThreads / 32];
  const T* row = x + (int64_t)blockIdx.x * x_stride;
  T* dst = out + (int64_t)blockIdx.x * hidden;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = to_float(row[i]);
    sum += v * v;
  }
  const float r = rsqrtf(row_sum(sum, kNormThreads, warp_sums) / (float)hidden + eps);
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const T normed = Cvt<T>::from_float(to_float(row[i]) * r);        // hidden_states.to(input_dtype)
    dst[i] = Cvt<T>::from_float(to_float(weight[i]) * to_float(normed));  // self.weight * ...
  }
}

// CTA (row, head): the rotary embedding of one head's vector of one token, q's heads first, then k's. Semantics
// (hf_cascade/fused_ops.py `rotary_reference`, transformers' apply_rotary_pos_emb with rotate_half): each product
// and the sum rounded to T as eager mode rounds each of its ops, so the result is eager's bit for bit.
template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    rotary_kernel(const RotaryArgs a) {
  const int64_t row = blockIdx.x, b = row / a.tokens, l = row % a.tokens;
  const bool is_q = (int64_t)blockIdx.y < a.q_heads;
  const int64_t h = is_q ? blockIdx.y : blockIdx.y - a.q_heads;
  const T* src = static_cast<const T*>(is_q ? a.q : a.k) +
                 b * (is_q ? a.q_stride[0] : a.k_stride[0]) + h * (is_q ? a.q_stride[1] : a.k_stride[1]) +
                 l * (is_q ? a.q_stride[2] : a.k_stride[2]);
  const int64_t heads = is_q ? a.q_heads : a.k_heads;
  T* dst = static_cast<T*>(is_q ? a.q_out : a.k_out) + ((b * heads + h) * a.tokens + l) * a.head_dim;
  const T* cos = static_cast<const T*>(a.cos) + b * a.cs_stride[0] + l * a.cs_stride[1];
  const T* sin = static_cast<const T*>(a.sin) + b * a.cs_stride[0] + l * a.cs_stride[1];
  const int64_t half = a.head_dim / 2;
  for (int64_t d = threadIdx.x; d < a.head_dim; d += blockDim.x) {
    const float x = to_float(src[d]);
    const float rotated = d < half ? -to_float(src[d + half]) : to_float(src[d - half]);   // rotate_half
    const T x_cos = Cvt<T>::from_float(x * to_float(cos[d]));
    const T r_sin = Cvt<T>::from_float(rotated * to_float(sin[d]));
    dst[d] = Cvt<T>::from_float(to_float(x_cos) + to_float(r_sin));
  }
}

// PyTorch's CUDA silu, float x / (1 + expf(-x)), as nvcc compiles it without fast math: libdevice's expf (a range
// reduction by fma, ex2.approx of the remainder, the scale by 2^i contracted with the `1 +` into one fma), then an
// IEEE division, subnormals kept. Inline PTX because this library is built with --use_fast_math (hf_cascade/kernels/
// _build.py, csrc/check_compile.sh), which would turn expf into ex2.approx of one product, the division into
// div.approx and flush subnormals: other bits. The sequence is the PTX nvcc 13 emits for that expression without fast
// math (tests/kernels/test_silu_ptx.py compares it with the installed nvcc's).
__device__ __forceinline__ float eager_silu(float x) {
  float y;
  asm("{\n\t"
      ".reg .f32 sl_n, sl_t, sl_j, sl_k, sl_f, sl_p, sl_e, sl_d;\n\t"
      ".reg .b32 sl_b;\n\t"
      "neg.f32 sl_n, %1;\n\t"
      "fma.rn.f32 sl_t, sl_n, 0f3BBB989D, 0f3F000000;\n\t"
      "cvt.sat.f32.f32 sl_t, sl_t;\n\t"
      "fma.rm.f32 sl_j, sl_t, 0f437C0000, 0f4B400001;\n\t"
      "add.rn.f32 sl_k, sl_j, 0fCB40007F;\n\t"
      "neg.f32 sl_k, sl_k;\n\t"
      "fma.rn.f32 sl_f, sl_n, 0f3FB8AA3B, sl_k;\n\t"
      "fma.rn.f32 sl_f, sl_n, 0f32A57060, sl_f;\n\t"
      "mov.b32 sl_b, sl_j;\n\t"
      "shl.b32 sl_b, sl_b, 23;\n\t"
      "mov.b32 sl_p, sl_b;\n\t"
      "ex2.approx.ftz.f32 sl_e, sl_f;\n\t"
      "fma.rn.f32 sl_d, sl_e, sl_p, 0f3F800000;\n\t"
      "div.rn.f32 %0, %1, sl_d;\n\t"
      "}"
      : "=f"(y)
      : "f"(x));
  return y;
}

// One element of the MLP's activation, eager mode's ops and roundings: T(silu(g)), then T(float * float).
template <typename T>
__device__ __forceinline__ T silu_mul_element(T g, T u) {
  const T act = Cvt<T>::from_float(eager_silu(to_float(g)));
  return Cvt<T>::from_float(mul_rn(to_float(act), to_float(u)));
}

// Thread i: vector i of the [rows, width / kVec] grid, kVec elements (8: rows whose width, strides and pointers are
// whole 16-byte vectors, one vector load each; 1: any other rows, element by element).
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    silu_mul_kernel(T* __restrict__ out, const T* __restrict__ gate, const T* __restrict__ up, int64_t total,
                    int64_t per_row, int64_t gate_stride, int64_t up_stride) {
  using Vec = std::conditional_t<kVec == 8, uint4, T>;
  static_assert(sizeof(Vec) == kVec * sizeof(T), "a vector of kVec elements");
  const int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  if (i >= total) return;
  const int64_t r = i / per_row, c = (i % per_row) * kVec;    // row, first column
  const Vec g = *reinterpret_cast<const Vec*>(gate + r * gate_stride + c);
  const Vec u = *reinterpret_cast<const Vec*>(up + r * up_stride + c);
  const T* gs = reinterpret_cast<const T*>(&g);
  const T* us = reinterpret_cast<const T*>(&u);
  Vec o;
  T* os = reinterpret_cast<T*>(&o);
#pragma unroll
  for (int j = 0; j < kVec; ++j) os[j] = silu_mul_element<T>(gs[j], us[j]);
  *reinterpret_cast<Vec*>(out + r * per_row * kVec + c) = o;
}

}  // namespace

cudaError_t rotary_launch(const void* q, const void* k, const void* cos, const void* sin, void* q_out, void* k_out,
                          int64_t batch, int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t head_dim,
                          const int64_t* q_stride, const int64_t* k_stride, const int64_t* cs_stride, int dtype,
                          cudaStream_t stream) {
  if (batch < 0 || tokens < 0 || q_heads < 1 || k_heads < 1 || head_dim < 2 || head_dim % 2 != 0)
    return fail(cudaErrorInvalidValue, "rotary: batch %lld, tokens %lld, heads %lld + %lld, head_dim %lld",
                (long long)batch, (long long)tokens, (long long)q_heads, (long long)k_heads, (long long)head_dim);
  if (q_stride == nullptr || k_stride == nullptr || cs_stride == nullptr)
    return fail(cudaErrorInvalidValue, "rotary: a NULL stride array");
  RotaryArgs a{q, k, cos, sin, q_out, k_out, batch, tokens, q_heads, k_heads, head_dim,
               {q_stride[0], q_stride[1], q_stride[2]}, {k_stride[0], k_stride[1], k_stride[2]},
               {cs_stride[0], cs_stride[1]}};
  const int64_t rows = a.batch * a.tokens;
  if (rows > 0x7fffffff || a.q_heads + a.k_heads > 65535)
    return fail(cudaErrorInvalidConfiguration, "rotary: %lld rows, %lld heads in one launch", (long long)rows,
                (long long)(a.q_heads + a.k_heads));
  if (rows == 0) return cudaSuccess;
  if (!a.q || !a.k || !a.cos || !a.sin || !a.q_out || !a.k_out) return fail(cudaErrorInvalidValue, "rotary: a NULL pointer");
  const dim3 grid((unsigned)rows, (unsigned)(a.q_heads + a.k_heads));
  const unsigned threads = a.head_dim >= 128 ? 128u : 64u;
  HFC_DISPATCH_DTYPE(dtype, T, {
    rotary_kernel<T><<<grid, threads, 0, stream>>>(a);
    return cudaGetLastError();
  })
}

namespace {

// 16-byte aligned address
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

cudaError_t rms_norm_launch(void* out, const void* x, const void* weight, int64_t rows, int64_t hidden,
                            int64_t x_stride, float eps, int dtype, cudaStream_t stream, const void* residual,
                            int64_t residual_stride, void* sum_out) {
  if (rows < 0 || hidden < 1 || x_stride < hidden || !(eps >= 0.f) || (residual && residual_stride < hidden))
    return fail(cudaErrorInvalidValue, "rms_norm: rows %lld, hidden %lld, x_stride %lld, residual_stride %lld, eps %g",
                (long long)rows, (long long)hidden, (long long)x_stride, (long long)residual_stride, (double)eps);
  if (rows > 0x7fffffff) return fail(cudaErrorInvalidConfiguration, "rms_norm: %lld rows in one launch", (long long)rows);
  if (rows == 0) return cudaSuccess;
  if (out == nullptr || x == nullptr || weight == nullptr || (residual != nullptr && sum_out == nullptr))
    return fail(cudaErrorInvalidValue, "rms_norm: a NULL pointer");
  const bool aligned = hidden % 8 == 0 && x_stride % 8 == 0 && aligned16(x) && aligned16(out) && aligned16(weight) &&
                       (residual == nullptr || (residual_stride % 8 == 0 && aligned16(residual) && aligned16(sum_out)));
  const int64_t vecs = hidden / 8;
  if (residual != nullptr && !(aligned && vecs <= kNormThreads * 4))
    return fail(cudaErrorInvalidValue, "add_rms_norm: rows of %lld elements, %s (the residual's add takes aligned rows "
                "of at most %d, a multiple of 8)", (long long)hidden, aligned ? "aligned" : "not 16-byte aligned",
                kNormThreads * 32);
  HFC_DISPATCH_DTYPE(dtype, T, {
    T* o = static_cast<T*>(out);
    const T* xs = static_cast<const T*>(x);
    const T* w = static_cast<const T*>(weight);
    const T* res = static_cast<const T*>(residual);
    T* sums = static_cast<T*>(sum_out);
    if (aligned && vecs <= 32 * 4) {            // a warp a row (Qwen3's q/k norms over head_dim; hidden <= 1024)
      const int64_t ctas = (rows + kNormThreads / 32 - 1) / (kNormThreads / 32);
      rms_norm_vec_kernel<T, 4><<<(unsigned)ctas, kNormThreads, 0, stream>>>(o, xs, w, rows, hidden, x_stride, eps, 32,
                                                                              res, residual_stride, sums);
    } else if (aligned && vecs <= kNormThreads * 4) {     // a CTA a row (hidden <= 8192)
      rms_norm_vec_kernel<T, 4><<<(unsigned)rows, kNormThreads, 0, stream>>>(o, xs, w, rows, hidden, x_stride, eps,
                                                                              kNormThreads, res, residual_stride, sums);
    } else {
      rms_norm_kernel<T><<<(unsigned)rows, kNormThreads, 0, stream>>>(o, xs, w, hidden, x_stride, eps);
    }
    return cudaGetLastError();
  })
}


cudaError_t silu_mul_launch(void* out, const void* gate, const void* up, int64_t rows, int64_t width,
                            int64_t gate_stride, int64_t up_stride, int dtype, cudaStream_t stream) {
  if (rows < 0 || width < 1 || gate_stride < width || up_stride < width)
    return fail(cudaErrorInvalidValue, "silu_mul: rows %lld, width %lld, gate_stride %lld, up_stride %lld",
                (long long)rows, (long long)width, (long long)gate_stride, (long long)up_stride);
  if (rows == 0) return cudaSuccess;
  if (out == nullptr || gate == nullptr || up == nullptr) return fail(cudaErrorInvalidValue, "silu_mul: a NULL pointer");
  const bool aligned = width % 8 == 0 && gate_stride % 8 == 0 && up_stride % 8 == 0 &&
                       reinterpret_cast<uintptr_t>(gate) % 16 == 0 && reinterpret_cast<uintptr_t>(up) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t per_row = aligned ? width / 8 : width;   // threads a row: a vector or an element each
  if (rows > INT64_MAX / per_row || (rows * per_row + kThreads - 1) / kThreads > 0x7fffffff)
    return fail(cudaErrorInvalidConfiguration, "silu_mul: %lld rows of %lld in one launch", (long long)rows,
                (long long)width);
  const int64_t total = rows * per_row;
  const unsigned ctas = (unsigned)((total + kThreads - 1) / kThreads);
  HFC_DISPATCH_DTYPE(dtype, T, {
    T* o = static_cast<T*>(out);
    const T* g = static_cast<const T*>(gate);
    const T* u = static_cast<const T*>(up);
    if (aligned) {
      silu_mul_kernel<T, 8><<<ctas, kThreads, 0, stream>>>(o, g, u, total, per_row, gate_stride, up_stride);
    } else {
      silu_mul_kernel<T, 1><<<ctas, kThreads, 0, stream>>>(o, g, u, total, per_row, gate_stride, up_stride);
    }
    return cudaGetLastError();
  })
}

}  // namespace hfc
