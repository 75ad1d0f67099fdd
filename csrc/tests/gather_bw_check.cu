// Read bandwidth of the prefix kernels' K/V access pattern, without the attention math: how fast can a paged
// pool [blocks, 2, 16 slots, 8 KV heads, 128] bf16 be read
//   head   one CTA per (chunk, KV head, group), 256-byte rows 2 KB apart (what csrc/prefix*.cu do),
//   token  one CTA per (chunk, group) reading all heads of its tokens (2 KB contiguous rows),
//   flat   the same bytes as one contiguous array,
// with 16-byte loads, 8 in flight per thread. Llama-3-8B layer shape, 8 prompts x 16k prefix, random block order.
//   nvcc -std=c++17 -O3 -arch=sm_90 -o /tmp/gather_bw csrc/tests/gather_bw_check.cu && /tmp/gather_bw

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

constexpr int BS = 16, HKV = 8, D = 128, G = 8, PREFIX = 16384, BLOCKS_PER_G = PREFIX / BS;
constexpr int ROW = D * 2;  // bytes of one head's K (or V) row

// grid (chunks, HKV, G): chunk c of group g, head h: K and V rows of its tokens
__global__ void head_kernel(const uint4* pool, const int* table, int chunk_tokens, unsigned* sink) {
  const int h = blockIdx.y, g = blockIdx.z;
  const int t0 = blockIdx.x * chunk_tokens;
  unsigned acc = 0;
  constexpr int PER_ROW = ROW / 16;  // 16 uint4 per row
  for (int base = threadIdx.x; base < chunk_tokens * 2 * PER_ROW; base += blockDim.x * 8) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = base + u * blockDim.x;
      const int c = i % PER_ROW, kv = (i / PER_ROW) & 1, n = i / (2 * PER_ROW);
      const int t = t0 + n;
      const int blk = table[g * BLOCKS_PER_G + t / BS];
      const size_t row = (((size_t)blk * 2 + kv) * BS + t % BS) * HKV + h;
      v[u] = i < chunk_tokens * 2 * PER_ROW ? __ldg(pool + row * PER_ROW + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].w;
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

// grid (chunks * HKV, G): the same bytes per CTA as head_kernel, as whole 2 KB token rows (all heads)
__global__ void token_kernel(const uint4* pool, const int* table, int chunk_tokens, unsigned* sink) {
  const int g = blockIdx.y;
  const int tokens = chunk_tokens / HKV;  // same bytes per CTA as a head CTA
  const int t0 = blockIdx.x * tokens;
  unsigned acc = 0;
  constexpr int PER_TOKEN = HKV * ROW / 16;  // 128 uint4
  for (int base = threadIdx.x; base < tokens * 2 * PER_TOKEN; base += blockDim.x * 8) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = base + u * blockDim.x;
      const int c = i % PER_TOKEN, kv = (i / PER_TOKEN) & 1, n = i / (2 * PER_TOKEN);
      const int t = t0 + n;
      const int blk = table[g * BLOCKS_PER_G + t / BS];
      const size_t tok = ((size_t)blk * 2 + kv) * BS + t % BS;
      v[u] = i < tokens * 2 * PER_TOKEN ? __ldg(pool + tok * PER_TOKEN + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].w;
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

__global__ void flat_kernel(const uint4* data, size_t n, unsigned* sink) {
  unsigned acc = 0;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t base = (size_t)blockIdx.x * blockDim.x + threadIdx.x; base < n; base += stride * 8) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const size_t i = base + u * stride;
      v[u] = i < n ? __ldg(data + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].w;
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

template <typename F>
float time_ms(F f, void* flush, size_t flush_bytes) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> t;
  for (int r = 0; r < 12; ++r) {
    cudaMemsetAsync(flush, r, flush_bytes);
    cudaEventRecord(a);
    f();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    if (r >= 2) t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main() {
  const int nblocks = G * BLOCKS_PER_G + 64;
  const size_t pool_bytes = (size_t)nblocks * 2 * BS * HKV * ROW;
  const double moved = (double)G * PREFIX * HKV * ROW * 2;  // K and V of every prefix token, once
  std::vector<int> ids(nblocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(3));
  uint4* pool;
  int* table;
  unsigned* sink;
  void* flush;
  const size_t flush_bytes = 512u << 20;
  cudaMalloc(&pool, pool_bytes);
  cudaMalloc(&table, G * BLOCKS_PER_G * sizeof(int));
  cudaMalloc(&sink, 4);
  cudaMalloc(&flush, flush_bytes);
  cudaMemset(pool, 1, pool_bytes);
  cudaMemcpy(table, ids.data(), G * BLOCKS_PER_G * sizeof(int), cudaMemcpyHostToDevice);
  for (int chunks : {2, 4, 8}) {
    const int chunk_tokens = PREFIX / chunks;
    for (int threads : {128, 256}) {
      const float h = time_ms([&] { head_kernel<<<dim3(chunks, HKV, G), threads>>>(pool, table, chunk_tokens, sink); },
                              flush, flush_bytes);
      const float t = time_ms([&] { token_kernel<<<dim3(chunks * HKV, G), threads>>>(pool, table, chunk_tokens, sink); },
                              flush, flush_bytes);
      printf("chunks %d (%d CTAs) x %d threads: head %.1f us %.2f TB/s | token %.1f us %.2f TB/s\n", chunks,
             chunks * HKV * G, threads, h * 1e3, moved / (h * 1e-3) / 1e12, t * 1e3, moved / (t * 1e-3) / 1e12);
    }
  }
  const float f = time_ms([&] { flat_kernel<<<132 * 4, 256>>>(pool, (size_t)(moved / 16), sink); }, flush, flush_bytes);
  printf("flat: %.1f us %.2f TB/s\n", f * 1e3, moved / (f * 1e-3) / 1e12);
  cudaError_t err = cudaDeviceSynchronize();
  printf("%s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
