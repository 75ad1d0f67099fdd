// RMSNorm of a decode step's rows in one launch: transformers' LlamaRMSNorm (and its copies in Mistral, Qwen2, Qwen3,
// ...) is eight elementwise and reduction kernels in eager mode, 2 per decoder layer plus the final norm: ~520 tiny
// launches in an 8B model's step. Semantics (hf_cascade/fused_norms.py `rms_norm_reference`), with the eager
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

}  // namespace

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
