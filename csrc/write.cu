// The cache write of one layer (the paged pool's K/V): the copy-on-write block copies, then the step's new tokens
// into their slots, in two launches on one stream (every copy lands before any write into the copied blocks), all
// moved as 16-byte vectors of raw bytes (any element type: bf16, fp16, an fp8 pool's encoded bytes). K and V are read
// with their own token strides (a token's Hkv x D elements contiguous): with fused projections V is a column slice of
// the fused q|k|v product, read where it lies instead of copied first.
// A static step's copies of every layer's pool can also go in one launch before the forward (copy_blocks_layers_launch:
// the pairs are the same for all layers, and nothing writes a source block before the layers' own writes); the
// layers' writes then pass no copies.
// An fp8 pool's new tokens can also be encoded here (write_fp8_launch): K/V in bf16 / fp16 divided by the pool's
// per-head scales and saturated to e4m3's range on the way, bit for bit what BlockStorage.encode's four torch ops per
// tensor (to float32, divide, clamp, to float8) give, in the one launch of the raw write.
// Semantics: hf_cascade/kv/cache.py `_write_slots` (pool[copy_dst] = pool[copy_src]; then
// pool[write_block[i], 0|1, write_offset[i]] = key[i] | value[i]); layout: csrc/include/hfc/params.h.

#include "hfc/common.cuh"
#include "hfc/errors.h"
#include "hfc/launch.h"

#include <cstdint>

namespace hfc {
namespace {

constexpr int kWriteThreads = 128;

// Part y (of gridDim.y) of block copy i within one pool. A pair copying a block onto itself, or repeating pair 0 (a
// static step pads its pairs so), does nothing: the copies of one step are simultaneous (no id is both a source and a
// destination), so skipping an exact repeat changes nothing.
__device__ __forceinline__ void copy_block_part(uint4* pool, const int64_t* __restrict__ src,
                                                const int64_t* __restrict__ dst, int64_t block_vecs) {
  const int i = blockIdx.x;
  const int64_t s = __ldg(src + i), d = __ldg(dst + i);
  if (s == d || (i > 0 && s == __ldg(src) && d == __ldg(dst))) return;
  const uint4* from = pool + s * block_vecs;
  uint4* to = pool + d * block_vecs;
  for (int64_t v = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; v < block_vecs; v += (int64_t)gridDim.y * blockDim.x)
    to[v] = from[v];
}

// CTA (pair i, part y): part y of block copy i.
__global__ void __launch_bounds__(kWriteThreads)
    copy_blocks_kernel(uint4* pool, const int64_t* __restrict__ src, const int64_t* __restrict__ dst,
                       int64_t block_vecs) {
  copy_block_part(pool, src, dst, block_vecs);
}

// CTA (pair i, part y, layer z): part y of block copy i in layer z's pool, whose base address is pools[z].
__global__ void __launch_bounds__(kWriteThreads)
    copy_blocks_layers_kernel(const uint64_t* __restrict__ pools, const int64_t* __restrict__ src,
                              const int64_t* __restrict__ dst, int64_t block_vecs) {
  copy_block_part(reinterpret_cast<uint4*>(__ldg(pools + blockIdx.z)), src, dst, block_vecs);
}

// The copy grid's parts per pair: ~4 vectors per thread, at most 16 CTAs a block.
dim3 copy_grid(int64_t copies, int64_t block_vecs, int64_t layers) {
  const int64_t parts = (block_vecs + 4 * kWriteThreads - 1) / (4 * kWriteThreads);
  return dim3((unsigned)copies, (unsigned)(parts < 16 ? parts : 16), (unsigned)layers);
}

// CTA (token i, kv): token i's K (kv 0) or V (kv 1), token_vecs vectors starting key_stride_vecs (value_stride_vecs)
// vectors after token i - 1's, into its slot of the pool [num_blocks, 2, block_size, Hkv, D].
__global__ void __launch_bounds__(kWriteThreads)
    write_tokens_kernel(uint4* pool, const uint4* __restrict__ key, const uint4* __restrict__ value,
                        const int64_t* __restrict__ write_block, const int64_t* __restrict__ write_offset,
                        int64_t token_vecs, int64_t key_stride_vecs, int64_t value_stride_vecs, int64_t block_size) {
  const int64_t i = blockIdx.x;
  const int kv = blockIdx.y;
  const uint4* from = kv ? value + i * value_stride_vecs : key + i * key_stride_vecs;
  uint4* to = pool + ((__ldg(write_block + i) * 2 + kv) * block_size + __ldg(write_offset + i)) * token_vecs;
  for (int64_t v = threadIdx.x; v < token_vecs; v += blockDim.x) to[v] = from[v];
}

// 8 floats divided by `scale` and saturated to e4m3's finite range (round to nearest even): torch's
// (x.float() / scale).clamp(-448, 448).to(float8_e4m3fn) for every finite x and inf. __fdiv_rn: an IEEE division
// whatever --use_fast_math makes of `/`, as torch's is. The first value lands in the lowest byte.
__device__ __forceinline__ uint2 encode_e4m3x8(const float* f, float scale) {
  uint32_t pairs[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    pairs[i] = __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(f[2 * i], scale), __fdiv_rn(f[2 * i + 1], scale)),
                                        __NV_SATFINITE, __NV_E4M3);
  return make_uint2(pairs[0] | (pairs[1] << 16), pairs[2] | (pairs[3] << 16));
}

// CTA (token i, kv): write_tokens_kernel for an fp8 pool fed 16-bit K/V (T): each 16-byte vector of 8 elements of head
// v / head_vecs is encoded with that head's scale (scale [2, heads] float32: K's, then V's) into 8 bytes of the pool.
template <typename T>
__global__ void __launch_bounds__(kWriteThreads)
    write_tokens_fp8_kernel(uint2* pool, const uint4* __restrict__ key, const uint4* __restrict__ value,
                            const float* __restrict__ scale, const int64_t* __restrict__ write_block,
                            const int64_t* __restrict__ write_offset, int64_t token_vecs, int64_t key_stride_vecs,
                            int64_t value_stride_vecs, int64_t block_size, int64_t head_vecs, int64_t heads) {
  const int64_t i = blockIdx.x;
  const int kv = blockIdx.y;
  const uint4* from = kv ? value + i * value_stride_vecs : key + i * key_stride_vecs;
  uint2* to = pool + ((__ldg(write_block + i) * 2 + kv) * block_size + __ldg(write_offset + i)) * token_vecs;
  const float* head_scale = scale + kv * heads;
  for (int64_t v = threadIdx.x; v < token_vecs; v += blockDim.x) {
    float f[8];
    Cvt<T>::unpack8(from[v], f);
    to[v] = encode_e4m3x8(f, __ldg(head_scale + v / head_vecs));
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

cudaError_t write_launch(void* pool, const void* key, const void* value, int64_t key_stride_bytes,
                         int64_t value_stride_bytes, const int64_t* write_block, const int64_t* write_offset,
                         int64_t tokens, const int64_t* copy_src, const int64_t* copy_dst, int64_t copies,
                         int64_t block_size, int64_t token_bytes, cudaStream_t stream) {
  if (tokens < 0 || copies < 0 || block_size < 1 || token_bytes < 16 || token_bytes % 16 != 0)
    return fail(cudaErrorInvalidValue, "write: tokens %lld, copies %lld, block_size %lld, token_bytes %lld (a multiple "
                "of 16 needed)", (long long)tokens, (long long)copies, (long long)block_size, (long long)token_bytes);
  // (every token starts on a 16-byte vector; a stride below a token's bytes is a mistaken argument: the tokens of
  // K/V [tokens, Hkv, D] never overlap)
  if (key_stride_bytes < token_bytes || key_stride_bytes % 16 != 0 || value_stride_bytes < token_bytes ||
      value_stride_bytes % 16 != 0)
    return fail(cudaErrorInvalidValue, "write: key_stride_bytes %lld, value_stride_bytes %lld (multiples of 16, at "
                "least token_bytes %lld, needed)", (long long)key_stride_bytes, (long long)value_stride_bytes,
                (long long)token_bytes);
  if (tokens > 0x7fffffff || copies > 0x7fffffff)
    return fail(cudaErrorInvalidConfiguration, "write: %lld tokens, %lld copies in one launch",
                (long long)tokens, (long long)copies);
  if (pool == nullptr || !aligned16(pool) || (tokens > 0 && (!aligned16(key) || !aligned16(value) ||
                                                             write_block == nullptr || write_offset == nullptr)) ||
      (copies > 0 && (copy_src == nullptr || copy_dst == nullptr)))
    return fail(cudaErrorInvalidValue, "write: a NULL or not 16-byte aligned pointer");
  const int64_t token_vecs = token_bytes / 16;
  if (copies > 0) {
    const int64_t block_vecs = 2 * block_size * token_vecs;
    const dim3 grid = copy_grid(copies, block_vecs, 1);
    copy_blocks_kernel<<<grid, kWriteThreads, 0, stream>>>(static_cast<uint4*>(pool), copy_src, copy_dst,
                                                           block_vecs);
  }
  if (tokens > 0) {
    const dim3 grid((unsigned)tokens, 2);
    write_tokens_kernel<<<grid, kWriteThreads, 0, stream>>>(static_cast<uint4*>(pool), static_cast<const uint4*>(key),
                                                            static_cast<const uint4*>(value), write_block,
                                                            write_offset, token_vecs, key_stride_bytes / 16,
                                                            value_stride_bytes / 16, block_size);
  }
  return cudaGetLastError();
}

cudaError_t write_fp8_launch(void* pool, const void* key, const void* value, int64_t key_stride_bytes,
                             int64_t value_stride_bytes, const float* scale, const int64_t* write_block,
                             const int64_t* write_offset, int64_t tokens, const int64_t* copy_src,
                             const int64_t* copy_dst, int64_t copies, int64_t block_size, int64_t heads,
                             int64_t head_dim, int dtype, cudaStream_t stream) {
  if (dtype != HFC_BF16 && dtype != HFC_FP16)
    return fail(cudaErrorInvalidValue, "write_fp8: dtype code %d (K/V in bf16 or fp16 only)", dtype);
  if (heads < 1 || head_dim < 8 || head_dim % 8 != 0)
    return fail(cudaErrorInvalidValue, "write_fp8: %lld heads x head_dim %lld (head_dim a multiple of 8 needed)",
                (long long)heads, (long long)head_dim);
  if (tokens > 0 && scale == nullptr) return fail(cudaErrorInvalidValue, "write_fp8: scale is NULL");
  const int64_t pool_token_bytes = heads * head_dim;     // one byte an element; K/V have two
  if (pool_token_bytes % 16 != 0)
    return fail(cudaErrorInvalidValue, "write_fp8: heads x head_dim = %lld (a multiple of 16 needed)",
                (long long)pool_token_bytes);
  // the block copies (raw bytes) and the argument checks of the raw write, with K/V's own token bytes
  cudaError_t err = write_launch(pool, key, value, key_stride_bytes, value_stride_bytes, write_block, write_offset, 0,
                                 copy_src, copy_dst, copies, block_size, pool_token_bytes, stream);
  if (err != cudaSuccess || tokens == 0) return err;
  const int64_t src_token_bytes = 2 * pool_token_bytes;
  if (tokens > 0x7fffffff || key_stride_bytes < src_token_bytes || key_stride_bytes % 16 != 0 ||
      value_stride_bytes < src_token_bytes || value_stride_bytes % 16 != 0)
    return fail(cudaErrorInvalidValue, "write_fp8: %lld tokens, key_stride_bytes %lld, value_stride_bytes %lld "
                "(multiples of 16, at least a token's %lld bytes, needed)", (long long)tokens,
                (long long)key_stride_bytes, (long long)value_stride_bytes, (long long)src_token_bytes);
  if (!aligned16(key) || !aligned16(value) || write_block == nullptr || write_offset == nullptr)
    return fail(cudaErrorInvalidValue, "write_fp8: a NULL or not 16-byte aligned pointer");
  const dim3 grid((unsigned)tokens, 2);
  auto* to = static_cast<uint2*>(pool);
  auto* k = static_cast<const uint4*>(key);
  auto* v = static_cast<const uint4*>(value);
  const int64_t token_vecs = pool_token_bytes / 8;      // 8 elements a vector, both sides
  if (dtype == HFC_BF16)
    write_tokens_fp8_kernel<__nv_bfloat16><<<grid, kWriteThreads, 0, stream>>>(
        to, k, v, scale, write_block, write_offset, token_vecs, key_stride_bytes / 16, value_stride_bytes / 16,
        block_size, head_dim / 8, heads);
  else
    write_tokens_fp8_kernel<__half><<<grid, kWriteThreads, 0, stream>>>(
        to, k, v, scale, write_block, write_offset, token_vecs, key_stride_bytes / 16, value_stride_bytes / 16,
        block_size, head_dim / 8, heads);
  return cudaGetLastError();
}

cudaError_t copy_blocks_layers_launch(const uint64_t* pools, int64_t layers, const int64_t* copy_src,
                                      const int64_t* copy_dst, int64_t copies, int64_t block_bytes,
                                      cudaStream_t stream) {
  if (layers < 0 || copies < 0 || block_bytes < 16 || block_bytes % 16 != 0)
    return fail(cudaErrorInvalidValue, "copy_blocks_layers: layers %lld, copies %lld, block_bytes %lld (a multiple of "
                "16 needed)", (long long)layers, (long long)copies, (long long)block_bytes);
  if (layers > 65535 || copies > 0x7fffffff)
    return fail(cudaErrorInvalidConfiguration, "copy_blocks_layers: %lld layers (65535 at most), %lld copies in one "
                "launch", (long long)layers, (long long)copies);
  if (layers == 0 || copies == 0) return cudaSuccess;
  // (the pools' base addresses are read on the device: the caller checks that each is 16-byte aligned)
  if (pools == nullptr || (reinterpret_cast<uintptr_t>(pools) & 7) != 0 || copy_src == nullptr || copy_dst == nullptr)
    return fail(cudaErrorInvalidValue, "copy_blocks_layers: a NULL pointer, or pools not 8-byte aligned");
  const dim3 grid = copy_grid(copies, block_bytes / 16, layers);
  copy_blocks_layers_kernel<<<grid, kWriteThreads, 0, stream>>>(pools, copy_src, copy_dst, block_bytes / 16);
  return cudaGetLastError();
}

}  // namespace hfc
