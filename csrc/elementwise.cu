// The decode step's elementwise work that eager mode runs as many tiny kernels, one launch each: RMSNorm and the
// rotary embedding (hf_cascade/fused_ops.py installs them).
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

#include <cstdint>

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

// CTA r: row r of x [rows, hidden] (row stride x_stride elements) into out [rows, hidden] (contiguous)
template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    rms_norm_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight, int64_t hidden,
                    int64_t x_stride, float eps) {
  const T* row = x + (int64_t)blockIdx.x * x_stride;
  T* dst = out + (int64_t)blockIdx.x * hidden;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = to_float(row[i]);
    sum += v * v;
  }
  // the row's sum: a warp tree, then the warps' partial sums through shared memory
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(kFull, sum, offset);
  __shared__ float warp_sums[kNormThreads / 32];
  __shared__ float inv_rms;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = sum;
  __syncthreads();
  if (warp == 0) {
    sum = lane < kNormThreads / 32 ? warp_sums[lane] : 0.f;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(kFull, sum, offset);
    if (lane == 0) inv_rms = rsqrtf(sum / (float)hidden + eps);
  }
  __syncthreads();
  const float r = inv_rms;
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

cudaError_t rms_norm_launch(void* out, const void* x, const void* weight, int64_t rows, int64_t hidden,
                            int64_t x_stride, float eps, int dtype, cudaStream_t stream) {
  if (rows < 0 || hidden < 1 || x_stride < hidden || !(eps >= 0.f))
    return fail(cudaErrorInvalidValue, "rms_norm: rows %lld, hidden %lld, x_stride %lld, eps %g",
                (long long)rows, (long long)hidden, (long long)x_stride, (double)eps);
  if (rows > 0x7fffffff) return fail(cudaErrorInvalidConfiguration, "rms_norm: %lld rows in one launch", (long long)rows);
  if (rows == 0) return cudaSuccess;
  if (out == nullptr || x == nullptr || weight == nullptr) return fail(cudaErrorInvalidValue, "rms_norm: a NULL pointer");
  HFC_DISPATCH_DTYPE(dtype, T, {
    rms_norm_kernel<T><<<(unsigned)rows, kNormThreads, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(x), static_cast<const T*>(weight), hidden, x_stride, eps);
    return cudaGetLastError();
  })
}

}  // namespace hfc
