// Level 0, the shared prefix, on Hopper (sm_90a): warpgroup MMA (wgmma) fed by a producer warp. Same semantics,
// grid and partials as csrc/prefix.cu's kernel (hf_cascade/kernels/reference.py, prefix_attention), for plain layers
// (no softcap, no window), head_dim 128, 64-row tiles, bf16 and fp16; csrc/prefix.cu's prefix_launch dispatches here
// for kernel code HFC_PREFIX_KERNEL_SM90 (csrc/include/hfc/params.h), which hf_cascade.kernels.cuda_tuning picks by
// architecture (HOPPER_KERNEL) where this library's sm_90a code runs on the GPU.
//
// Why (benchmarks/RESULTS.md, ncu on the H200): the mma.sync kernel re-reads every K/V tile from shared memory
// once per 16 query rows (ldmatrix), and the same warps that compute also issue the loads and meet at a barrier
// per tile: at 8 prompts x 8 beams x 16k it moved 57% of the DRAM peak with the issue slots half busy. Here one
// warpgroup multiplies all 64 rows against a tile straight from shared memory, and one warp only loads.
//
// CTA (160 threads, 2 per SM): warps 0-3, the consumer warpgroup; warp 4, the producer.
//   producer  per 64-token K/V tile: waits for a free ring slot (mbarrier `empty`), gathers the tile's paged rows
//             with cp.async (zero fill past the chunk: garbage never enters the product), and has the copies arrive
//             on `full` as they land (cp.async.mbarrier.arrive.noinc), so it runs ahead as far as the ring allows.
//   consumer  Q in registers (the A operand); per tile, once `full`: the proxy fence, S = Q K^T (8 x wgmma
//             m64n64k16, B = K in shared memory, K-major), the online softmax in registers (log2 domain), P
//             re-packed in registers as the A operand of O += P V (4 x wgmma m64n128k16, B = V, MN-major), then
//             frees the slot. Each query row lives in one thread quad, so the epilogue writes the partials with no
//             exchange.
// Shared memory: STAGES slots of [K | V], each [2 halves of 64 dims][64 tokens][128 bytes] with the 128-byte
// swizzle (16-byte chunk c of token n at c ^ (n & 7)), which is the canonical wgmma layout for K (K-major: rows
// are tokens, SBO 1024) and for V (MN-major: k rows are tokens, LBO 8192 to the second half, SBO 1024).
// csrc/tests/wgmma_layout_check.cu checks these descriptors and fragments on the GPU against a host product.

#include "hfc/dispatch.h"
#include "hfc/fp8_stage.cuh"
#include "hfc/launch.h"
#include "hfc/sm90.cuh"

namespace hfc {
namespace {

template <bool F8>
struct Sm90Cfg {
  static constexpr int D = 128, M = 64, N = 64;  // head_dim, query rows, tokens per K/V tile
  static constexpr int STAGES = F8 ? 2 : 3;       // 16-bit [K | V] slots the consumers read
  static constexpr int CONSUMERS = 128;
  static constexpr int PRODUCERS = F8 ? 64 : 32;  // fp8: warp 4 fills K, warp 5 V
  static constexpr int THREADS = CONSUMERS + PRODUCERS;
  static constexpr int HALF_BYTES = N * 128;                 // one 64-dim half of K or V: 8 KB
  static constexpr int SLOT_BYTES = 4 * HALF_BYTES;          // K and V: 32 KB
  static constexpr int RING_BYTES = STAGES * SLOT_BYTES;
  static constexpr int F8_STAGES = 2;                        // fp8 tiles in flight per producer warp
  static constexpr int F8_TILE_BYTES = fp8_stage::kTileBytes;  // 64 tokens of K (or V) in fp8: 8 KB
  static constexpr int STAGING_BYTES = F8 ? 2 * F8_STAGES * F8_TILE_BYTES : 0;
  static constexpr int BARRIER_BYTES = 128;                  // full and empty, STAGES x 8 bytes each (padded)
  static constexpr int SMEM = 1024 + RING_BYTES + BARRIER_BYTES + STAGING_BYTES;  // + alignment slack
};
static_assert(2 * (Sm90Cfg<false>::SMEM + 1024) <= 228 * 1024, "two CTAs per SM");
static_assert(2 * (Sm90Cfg<true>::SMEM + 1024) <= 228 * 1024, "two CTAs per SM (fp8)");
static_assert(2 * Sm90Cfg<true>::STAGES * 8 <= Sm90Cfg<true>::BARRIER_BYTES &&
              2 * Sm90Cfg<false>::STAGES * 8 <= Sm90Cfg<false>::BARRIER_BYTES, "the barriers fit their bytes");
static_assert(Sm90Cfg<true>::D == Sm90Cfg<false>::D && Sm90Cfg<true>::M == Sm90Cfg<false>::M &&
              Sm90Cfg<true>::N == Sm90Cfg<false>::N, "one tile geometry: the setup reports Sm90Cfg<false>'s");
static_assert(fp8_stage::kTokens == Sm90Cfg<true>::N && fp8_stage::kDims == Sm90Cfg<true>::D &&
              fp8_stage::kHalfBytes == Sm90Cfg<true>::HALF_BYTES, "the staging helpers' tile is the kernel's");

template <typename T, bool F8>
__global__ void __launch_bounds__(Sm90Cfg<F8>::THREADS, 2)
    prefix_sm90_kernel(const __grid_constant__ hfc_prefix_params p) {
#if defined(HFC_SM90A)
  using C = Sm90Cfg<F8>;
  using namespace sm90;
  extern __shared__ __align__(128) unsigned char smem[];
  const int row_tiles = (int)p.row_tiles, Hq = (int)p.Hq, Hkv = (int)p.Hkv, Lq = (int)p.Lq, Rg = (int)p.Rg;
  const int tile = blockIdx.x % row_tiles;
  const int chunk = blockIdx.x / row_tiles;
  const int h = blockIdx.y;
  const int g = blockIdx.z;
  const int grp = Hq / Hkv;
  const int per_row = Lq * grp;
  const int rows_here = min(C::M, Rg * per_row - tile * C::M);
  if (rows_here <= 0) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int* group_rows = p.group_rows + (int64_t)g * Rg;

  // query row m of this tile -> (row, lq, query head) flattened, or -1 (padding)
  auto query_of = [&](int m) -> int64_t {
    if (m >= rows_here) return -1;
    const int mg = tile * C::M + m;
    const int rg = mg / per_row, rem = mg - rg * per_row;
    const int lq = rem / grp, j = rem - lq * grp;
    const int row = group_rows[rg];
    if (row < 0) return -1;
    return ((int64_t)row * Lq + lq) * Hq + (int64_t)h * grp + j;
  };
  const int64_t slot_items = (int64_t)chunk * p.R * Lq * Hq;  // this chunk's partial slot

  const int plen = p.prefix_len[g];
  const int t_begin = chunk * (int)p.chunk_tokens;
  if (t_begin >= plen) {  // a chunk with no tokens: O = 0, LSE = -inf
    if (tid >= C::CONSUMERS) return;
    for (int i = tid; i < C::M * (C::D / 4); i += C::CONSUMERS) {
      const int m = i / (C::D / 4), v = i % (C::D / 4);
      const int64_t qi = query_of(m);
      if (qi < 0) continue;
      *reinterpret_cast<float4*>(p.part_o + (slot_items + qi) * C::D + v * 4) = make_float4(0.f, 0.f, 0.f, 0.f);
      if (v == 0) p.part_lse[slot_items + qi] = neg_inf();
    }
    return;
  }
  const int t_end = min(t_begin + (int)p.chunk_tokens, plen);
  const int ntiles = (t_end - t_begin + C::N - 1) / C::N;

  // the ring, 1024-byte aligned (the swizzle atoms), then the barriers, then (fp8) the producers' staging
  const uint32_t raw = smem_addr(smem);
  const uint32_t ring = (raw + 1023u) & ~1023u;
  const uint32_t full_bar = ring + C::RING_BYTES;  // STAGES x 8 bytes: the producer(s) filled slot s
  const uint32_t empty_bar = full_bar + C::STAGES * 8;  // ... the consumers are done with slot s
  if (tid == 0) {
    for (int s = 0; s < C::STAGES; ++s) {
      mbar_init(full_bar + 8 * s, C::PRODUCERS);
      mbar_init(empty_bar + 8 * s, C::CONSUMERS);
    }
  }
  __syncthreads();

  if constexpr (F8) {
    if (warp >= C::CONSUMERS / 32) {
      // ------------------------------------------------------------------------------ fp8 producers
      // warp 4 fills the slots' K, warp 5 their V. Each copies its fp8 tiles (cp.async, zero fill past the chunk)
      // into its own staging ring F8_STAGES tiles ahead, and as a tile lands converts it (exact: fp8x2_to) into the
      // 16-bit slot's swizzled layout, the same bytes the 16-bit producer's copies write; then the proxy fence and
      // its arrival on `full`. The consumers apply K's and V's scales.
      const int kv = warp - C::CONSUMERS / 32;
      const uint8_t* pool_h = static_cast<const uint8_t*>(p.pool) + (int64_t)h * C::D;
      const int64_t slot_stride = p.Hkv * C::D;                            // bytes between token slots of a block
      const int64_t kv_off = (int64_t)kv * p.block_size * p.Hkv * C::D;    // V after K inside a block
      const int bs_shift = __ffs((int)p.block_size) - 1;
      const int bs_mask = (int)p.block_size - 1;
      const int* table = p.prefix_table + (int64_t)g * p.Mp;
      unsigned char* staging = smem + (full_bar - raw) + C::BARRIER_BYTES + kv * C::F8_STAGES * C::F8_TILE_BYTES;
      const uint32_t staging_addr = full_bar + C::BARRIER_BYTES + kv * C::F8_STAGES * C::F8_TILE_BYTES;
      unsigned char* ring_ptr = smem + (ring - raw);
      int blk_next[2];  // the block-table entries of tokens `lane` and `lane + 32` of the next tile to copy
      auto lookup = [&](int i) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int t = t_begin + i * C::N + lane + 32 * j;
          blk_next[j] = i < ntiles && t < t_end ? __ldg(table + (t >> bs_shift)) : -1;
        }
      };
      // copy tile i (if any) into its staging slot, one commit group per call so the groups count tiles
      auto copy = [&](int i) {
        if (i < ntiles) {
          const int t0 = t_begin + i * C::N;
          int64_t row[2];
#pragma unroll
          for (int j = 0; j < 2; ++j)
            row[j] = blk_next[j] >= 0
                         ? ((int64_t)blk_next[j] * 2 * p.block_size + ((t0 + lane + 32 * j) & bs_mask)) * slot_stride
                         : -1;
          lookup(i + 1);
          const uint32_t dst = staging_addr + (i % C::F8_STAGES) * C::F8_TILE_BYTES;
#pragma unroll
          for (int pass = 0; pass < fp8_stage::kCopyPasses; ++pass) {
            int n, c;
            fp8_stage::copy_item(pass, lane, n, c);                 // 8 lanes a token, 16 bytes (16 dims) each
            const int64_t r = __shfl_sync(kFull, row[pass >= fp8_stage::kCopyPasses / 2], n & 31);
            const uint8_t* src = r >= 0 ? pool_h + r + kv_off + c * 16 : pool_h;
            cp_async16(dst + fp8_stage::staging_offset(n, c), src, r >= 0 ? 16 : 0);
          }
        }
        cp_async_commit();
      };
      lookup(0);
#pragma unroll
      for (int i = 0; i < C::F8_STAGES; ++i) copy(i);
      for (int i = 0; i < ntiles; ++i) {
        const int s = i % C::STAGES;
        cp_async_wait<C::F8_STAGES - 1>();  // this lane's copies of tile i have landed ...
        __syncwarp();                       // ... and every lane's, visible to the warp
        if (i >= C::STAGES) mbar_wait(empty_bar + 8 * s, ((i / C::STAGES) - 1) & 1);
        const unsigned char* src_tile = staging + (i % C::F8_STAGES) * C::F8_TILE_BYTES;
        unsigned char* dst_kv = ring_ptr + s * C::SLOT_BYTES + kv * 2 * C::HALF_BYTES;
        fp8_stage::convert_tile(src_tile, dst_kv, lane, [](uint32_t pair) { return fp8x2_to<T>(pair); });
        fence_proxy_async();  // these generic-proxy stores before the consumers' wgmma reads them
        mbar_arrive(full_bar + 8 * s);
        __syncwarp();  // every lane is done reading staging slot i before it is refilled
        copy(i + C::F8_STAGES);
      }
      cp_async_wait<0>();  // leave no copy in flight behind an exited thread
      return;
    }
  }
  if (!F8 && warp == C::CONSUMERS / 32) {
    // ---------------------------------------------------------------------------------------- producer
    const T* pool_h = static_cast<const T*>(p.pool) + (int64_t)h * C::D;
    const int64_t slot_stride = p.Hkv * C::D;                 // between token slots of a block
    const int64_t kv_stride = p.block_size * p.Hkv * C::D;    // V after K inside a block
    const int bs_shift = __ffs((int)p.block_size) - 1;        // block_size is a power of two (checked at launch)
    const int bs_mask = (int)p.block_size - 1;
    const int* table = p.prefix_table + (int64_t)g * p.Mp;
    const int c = lane & 15, half = c >> 3, cc = c & 7;       // this lane's 16-byte chunk of a token's 256 bytes
    // each lane looks up the block-table entries of tokens `lane` and `lane + 32` of a tile (-1: past the chunk, or
    // a -1 block); the copies fetch the rows with shuffles, so the copy loop is shuffles and copies. The entries of
    // tile i + 1 are loaded before tile i's copies are issued: their latency (a DRAM round trip under the copies'
    // load) is then spent while the producer waits for a free slot and issues copies, not before each tile's copies
    int blk_next[2];
    auto lookup = [&](int i, int (&blk)[2]) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int t = t_begin + i * C::N + lane + 32 * j;
        blk[j] = t < t_end ? __ldg(table + (t >> bs_shift)) : -1;
      }
    };
    lookup(0, blk_next);
    for (int i = 0; i < ntiles; ++i) {
      const int s = i % C::STAGES;
      const int t0 = t_begin + i * C::N;
      int blk[2] = {blk_next[0], blk_next[1]};
      if (i + 1 < ntiles) lookup(i + 1, blk_next);
      int64_t row[2];
#pragma unroll
      for (int j = 0; j < 2; ++j)
        row[j] = blk[j] >= 0 ? ((int64_t)blk[j] * 2 * p.block_size + ((t0 + lane + 32 * j) & bs_mask)) * slot_stride
                             : -1;
      if (i >= C::STAGES) mbar_wait(empty_bar + 8 * s, ((i / C::STAGES) - 1) & 1);
      const uint32_t kdst = ring + s * C::SLOT_BYTES + half * C::HALF_BYTES;
      const uint32_t vdst = kdst + 2 * C::HALF_BYTES;
#pragma unroll
      for (int pass = 0; pass < C::N / 2; ++pass) {
        const int n = 2 * pass + (lane >> 4);                   // lanes 0-15: token 2 pass, 16-31: 2 pass + 1
        const int64_t r = __shfl_sync(kFull, row[pass >= C::N / 4], n & 31);
        const T* ksrc = r >= 0 ? pool_h + r + c * 8 : pool_h;
        const int bytes = r >= 0 ? 16 : 0;
        const uint32_t off = n * 128 + ((cc ^ (n & 7)) << 4);
        cp_async16(kdst + off, ksrc, bytes);
        cp_async16(vdst + off, r >= 0 ? ksrc + kv_stride : ksrc, bytes);
      }
      cp_async_arrive_noinc(full_bar + 8 * s);
    }
    cp_async_wait<0>();  // leave no copy in flight behind an exited thread
    return;
  }

  // ------------------------------------------------------------------------------------------ consumers
  const int gq = lane >> 2, q4 = lane & 3;
  const int r0 = warp * 16 + gq;  // this thread's rows: r0 and r0 + 8
  uint32_t qa[C::D / 16][4];
  {
    const T* qrow[2];
    for (int r = 0; r < 2; ++r) {
      const int64_t qi = query_of(r0 + 8 * r);
      qrow[r] = qi < 0 ? nullptr : static_cast<const T*>(p.q) + qi * C::D;
    }
#pragma unroll
    for (int kk = 0; kk < C::D / 16; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const T* src = qrow[e & 1];
        qa[kk][e] = src ? __ldg(reinterpret_cast<const unsigned int*>(src + kk * 16 + (e >> 1) * 8 + 2 * q4)) : 0u;
      }
  }
  // accumulators as n-tiles of 8 columns (mma.m16n8's C fragments), flat for wgmma
  float o[C::D / 8][4] = {};
  float sacc[C::N / 8][4] = {};
  auto& o_flat = reinterpret_cast<float(&)[C::D / 2]>(o);
  auto& s_flat = reinterpret_cast<float(&)[C::N / 2]>(sacc);
  float m_run[2] = {neg_inf(), neg_inf()};
  float l_run[2] = {0.0f, 0.0f};  // this lane's share of the row sums (reduced over the quad at the end)
  float scale_log2 = p.scale_log2, v_scale = 1.0f;
  if constexpr (F8) {  // real = stored x scale: K's on the scores, V's on the output
    scale_log2 *= __ldg(p.kv_scale + h);
    v_scale = __ldg(p.kv_scale + Hkv + h);
  }

  for (int it = 0; it < ntiles; ++it) {
    const int s = it % C::STAGES;
    mbar_wait(full_bar + 8 * s, (it / C::STAGES) & 1);
    fence_proxy_async();  // the producer's cp.async writes (generic proxy) before wgmma's reads (async proxy)
    const uint32_t kbase = ring + s * C::SLOT_BYTES;
    const uint32_t vbase = kbase + 2 * C::HALF_BYTES;

    // ---- S = Q K^T (64 rows x 64 tokens)
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < C::D / 16; ++kk)
      Wgmma<T>::m64n64k16(s_flat, qa[kk], sw128_desc(kbase + (kk >> 2) * C::HALF_BYTES + (kk & 3) * 32, 16, 1024),
                          kk > 0);
    wg_commit();
    wg_wait<0>();
    reg_fence(s_flat);

    // ---- online softmax (log2 domain); tokens past the chunk -> -inf
    const int valid = t_end - (t_begin + it * C::N);
    float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
    for (int nt = 0; nt < C::N / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = sacc[nt][e] * scale_log2;
        if (valid < C::N && nt * 8 + 2 * q4 + (e & 1) >= valid) v = neg_inf();
        sacc[nt][e] = v;
        mx[e >> 1] = fmaxf(mx[e >> 1], v);
      }
    float alpha[2], m_use[2], rsum[2] = {0.0f, 0.0f};
    online_max(mx, m_run, alpha, m_use);
    uint32_t pf[C::N / 16][4];
    probabilities<T>(sacc, m_use, rsum, pf);
    rescale_state(l_run, o, alpha, rsum);

    // ---- O += P V (64 rows x 128 dims, 16 tokens per step)
    wg_fence();
#pragma unroll
    for (int kt = 0; kt < C::N / 16; ++kt)
      Wgmma<T>::m64n128k16_tb(o_flat, pf[kt], sw128_desc(vbase + kt * 16 * 128, C::HALF_BYTES, 1024), 1);
    wg_commit();
    wg_wait<0>();
    reg_fence(o_flat);
    mbar_arrive(empty_bar + 8 * s);
  }

  // ---- epilogue: normalise and write this thread's two rows' partials
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(kFull, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(kFull, l_run[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t qi = query_of(r0 + 8 * r);
    if (qi < 0) continue;
    const bool any = l_run[r] > 0.0f;
    const float inv = any ? v_scale / l_run[r] : 0.0f;
    float* dst = p.part_o + (slot_items + qi) * C::D + 2 * q4;
#pragma unroll
    for (int dn = 0; dn < C::D / 8; ++dn)
      *reinterpret_cast<float2*>(dst + dn * 8) = make_float2(o[dn][2 * r] * inv, o[dn][2 * r + 1] * inv);
    if (q4 == 0) p.part_lse[slot_items + qi] = any ? m_run[r] + log2f(l_run[r]) : neg_inf();
  }
#else
  (void)p;  // not an sm_90a pass: never launched (prefix_sm90_setup reports the kernel unavailable)
#endif
}

// 1 where this library holds the kernel's sm_90a code for the current device, else 0
__global__ void sm90_probe_kernel(int* out) {
#if defined(HFC_SM90A)
  *out = 1;
#else
  *out = 0;
#endif
}

cudaError_t sm90_available(bool* ok) {
  constexpr int kMaxDevices = 64;
  static int known[kMaxDevices] = {};  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < kMaxDevices && known[dev] != 0) {
    *ok = known[dev] == 1;
    return cudaSuccess;
  }
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  int found = 0;
  if (major == 9 && minor == 0) {
    int* flag = nullptr;
    err = cudaMalloc(&flag, sizeof(int));
    if (err != cudaSuccess) return err;
    sm90_probe_kernel<<<1, 1>>>(flag);
    err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaMemcpy(&found, flag, sizeof(int), cudaMemcpyDeviceToHost);
    cudaFree(flag);
    if (err == cudaErrorNoKernelImageForDevice) err = cudaSuccess, found = 0;
    if (err != cudaSuccess) return err;
  }
  if (dev < kMaxDevices) known[dev] = found ? 1 : 2;
  *ok = found != 0;
  return cudaSuccess;
}

template <typename T, bool F8>
cudaError_t setup_sm90_t(hfc_prefix_info* info) {
  using C = Sm90Cfg<F8>;
  auto kern = prefix_sm90_kernel<T, F8>;
  cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM);
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (err != cudaSuccess || info == nullptr) return err;
  info->smem_bytes = C::SMEM;
  info->tile_tokens = C::N;
  int ctas = 0;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kern, C::THREADS, C::SMEM);
  info->ctas_per_sm = ctas;
  return err;
}

template <typename T, bool F8>
void launch_sm90_t(const hfc_prefix_params& p, dim3 grid, cudaStream_t stream) {
  using C = Sm90Cfg<F8>;
  prefix_sm90_kernel<T, F8><<<grid, C::THREADS, C::SMEM, stream>>>(p);
}

}  // namespace

cudaError_t prefix_sm90_setup(int dtype, int head_dim, int m_tile, bool fp8, hfc_prefix_info* info) {
  using C = Sm90Cfg<false>;
  if (head_dim != C::D || m_tile != C::M || (dtype != HFC_BF16 && dtype != HFC_FP16))
    return fail(cudaErrorInvalidValue, "the Hopper prefix kernel has no instantiation for dtype code %d, head_dim %d, "
                "m_tile %d (compiled: bf16 = %d / fp16 = %d, head_dim %d, m_tile %d)", dtype, head_dim, m_tile,
                HFC_BF16, HFC_FP16, C::D, C::M);
  bool ok = false;
  cudaError_t err = sm90_available(&ok);
  if (err != cudaSuccess) return err;
  if (!ok) {  // no sm_90a code in this library for this GPU: "cannot run" (hf_cascade falls back)
    if (info != nullptr) *info = hfc_prefix_info{0, fp8 ? Sm90Cfg<true>::SMEM : C::SMEM, C::N};
    return cudaSuccess;
  }
  if (dtype == HFC_BF16) return fp8 ? setup_sm90_t<__nv_bfloat16, true>(info) : setup_sm90_t<__nv_bfloat16, false>(info);
  return fp8 ? setup_sm90_t<__half, true>(info) : setup_sm90_t<__half, false>(info);
}

cudaError_t prefix_sm90_launch(const hfc_prefix_params& p, cudaStream_t stream) {
  using C = Sm90Cfg<false>;
  const bool fp8 = p.tune == HFC_PREFIX_KERNEL_SM90_FP8;
  if (p.head_dim != C::D || p.m_tile != C::M || p.softcap != 0.0f || p.window != 0 ||
      (p.block_size & (p.block_size - 1)) != 0 || (p.dtype != HFC_BF16 && p.dtype != HFC_FP16) ||
      p.kv_dtype != (fp8 ? HFC_KV_FP8_E4M3 : HFC_KV_SAME) || (fp8 && p.kv_scale == nullptr))
    return fail(cudaErrorInvalidValue, "the Hopper prefix kernel (code %d) has no instantiation for dtype code %d, "
                "kv_dtype code %d, head_dim %d, m_tile %d, block_size %lld, softcap %g, window %d (compiled: bf16 / "
                "fp16, head_dim %d, m_tile %d, a power-of-two block_size, no softcap / window; code %d: K/V in q's "
                "dtype, code %d: float8_e4m3fn with kv_scale)", (int)p.tune, (int)p.dtype, (int)p.kv_dtype,
                (int)p.head_dim, (int)p.m_tile, (long long)p.block_size, (double)p.softcap, (int)p.window, C::D, C::M,
                HFC_PREFIX_KERNEL_SM90, HFC_PREFIX_KERNEL_SM90_FP8);
  const long long gx = (long long)p.row_tiles * p.max_chunks;
  if (!fits_int(gx) || p.Hkv > 65535 || p.G > 65535) return cudaErrorInvalidConfiguration;
  dim3 grid((unsigned)gx, (unsigned)p.Hkv, (unsigned)p.G);
  if (p.dtype == HFC_BF16)
    fp8 ? launch_sm90_t<__nv_bfloat16, true>(p, grid, stream) : launch_sm90_t<__nv_bfloat16, false>(p, grid, stream);
  else
    fp8 ? launch_sm90_t<__half, true>(p, grid, stream) : launch_sm90_t<__half, false>(p, grid, stream);
  return cudaGetLastError();
}

}  // namespace hfc
