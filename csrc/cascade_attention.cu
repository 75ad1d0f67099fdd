// hf_cascade: cascade decode attention over a paged KV pool (see hf_cascade/kernels/reference.py for
// the exact semantics and /work/shared/DESIGN.md, "A kernel plan that reaches the roofline").
//
// Three kernels, each behind a plain C launcher (raw device pointers, 64-bit sizes, the stream as an
// integer), so that Python loads this file's shared library with ctypes:
//
//   hfc_prefix  level 0. One CTA per (prefix chunk x row tile, KV head, prefix group): the group's
//               query rows for that KV head (rows x Lq x GQA group, up to M_TILE = 16/32/64 of them)
//               against the chunk's tokens. K/V tiles of N_TILE tokens are streamed through shared
//               memory once (cp.async, 16-byte pieces, double buffered) and used by all query rows;
//               S = Q K^T and O += P V run on tensor cores (WMMA 16x16x16, fp32 accumulate), the
//               online softmax runs on the S tile in shared memory. Each CTA writes one partial
//               (O fp32 normalised, LSE fp32 base 2) per query row into slot `chunk`.
//   hfc_prefix_v2  the same launcher, grid and outputs (plus O = 0, LSE = -inf for a chunk with no
//               tokens), FlashAttention-2 style: mma.sync m16n8k16 + ldmatrix, S/P/O and the online
//               softmax in registers, only Q and a 4-5 deep cp.async ring of 16 KB K/V tiles in shared
//               memory (72-98 KB per CTA, 2-3 CTAs per SM, 3-4 tiles in flight each). See its section.
//               hf_cascade/kernels/cuda.py picks v1 or v2 from $HF_CASCADE_PREFIX_KERNEL.
//   hfc_suffix  level 1. One CTA per (suffix split x query block, KV head, row): up to 4 query vectors
//               of the row for that KV head against the row's own suffix tokens [split range),
//               query (lq) seeing the first q_limit[r, lq] of them. CUDA cores: each token is read by
//               D/8 lanes (16 bytes each), several tokens per warp, online softmax per lane group,
//               warp and CTA reductions at the end. Writes one partial into slot `slot0 + split`.
//   hfc_merge   one warp per (row, query, head): log-sum-exp merge of the row's prefix-chunk slots
//               [0, row_nchunks[r]) and its suffix slots [slot0, slot0 + nsplit) into q's dtype.
//               All -inf -> 0, never NaN.
//
// Partial buffers: part_o  float32 [slots, R, Lq, Hq, D], part_lse float32 [slots, R, Lq, Hq].
// Pool: [num_blocks, 2, block_size, Hkv, D] contiguous; token t of a table lives at block
// table[t / bs], slot t % bs. Tokens that are not valid are never read (zero-filled in shared memory),
// so garbage (even NaN) in unused slots cannot leak into the result.
//
// Build: nvcc -O3 --use_fast_math -std=c++17 -arch=sm_XY -Xcompiler -fPIC -shared (sm_80 or newer).

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <mma.h>
#include <stdint.h>

using namespace nvcuda;

#define HFC_API extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kThreads = 128;  // every kernel: 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kQB = 4;         // suffix kernel: query vectors per CTA
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ------------------------------------------------------------------------------------------ types

template <typename T> struct Cvt;
template <> struct Cvt<__half> {
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
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

// --------------------------------------------------------------------------------------- cp.async

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem_src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__host__ __device__ constexpr int align128(int x) { return (x + 127) / 128 * 128; }

// ============================================================================ level 0: the prefix

template <int D, int M>
struct PrefixCfg {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim");
  static_assert(M == 16 || M == 32 || M == 64, "row tile");
  static constexpr int N = (D >= 256) ? 32 : 64;  // tokens per K/V tile
  static constexpr int LDK = D + 8;                 // K/V/Q smem row stride (elements): 16 B pad
  static constexpr int LDS = N + 4;                 // S row stride (floats)
  static constexpr int LDP = N + 8;                 // P row stride (elements)
  static constexpr int LDO = D + 4;                 // O staging row stride (floats)
  static constexpr int MT = M / 16;                 // m tiles
  static constexpr int NT = N / 16;                 // n tiles of S
  static constexpr int DT = D / 16;                 // n tiles of O, k steps of S
  static constexpr int PT = N / 16;                 // k steps of P V
  // S = Q K^T: WN warps along n, WM along m
  static constexpr int WN = NT < kWarps ? NT : kWarps;
  static constexpr int WM = kWarps / WN;
  static constexpr int S_NPW = NT / WN;
  static constexpr int S_MPW = (MT + WM - 1) / WM;
  static constexpr int S_KUNROLL = (MT >= 4) ? 2 : 4;  // k steps unrolled in S (register pressure)
  // O += P V: the warps split the head dimension
  static constexpr int O_DPW = DT / kWarps;
  static constexpr int P_KUNROLL = (MT >= 4) ? 1 : 2;  // k steps unrolled in P V (register pressure)
  static_assert(NT % WN == 0 && DT % kWarps == 0, "warp tiling");
  // softmax: TPR threads per row
  static constexpr int TPR = kThreads / M;
  static constexpr int CPT = N / TPR;  // columns per thread
  static_assert(TPR * M == kThreads && CPT * TPR == N && (32 % TPR) == 0, "softmax tiling");
  // shared memory carve-up (bytes)
  static constexpr int Q_OFF = 0;
  static constexpr int Q_BYTES = M * LDK * 2;
  static constexpr int KV_OFF = align128(Q_OFF + Q_BYTES);
  static constexpr int STAGE_ELEMS = 2 * N * LDK;  // K then V
  static constexpr int KV_BYTES = 2 * STAGE_ELEMS * 2;
  static constexpr int S_OFF = align128(KV_OFF + KV_BYTES);
  static constexpr int S_BYTES = M * LDS * 4;
  static constexpr int P_OFF = align128(S_OFF + S_BYTES);
  static constexpr int P_BYTES = M * LDP * 2;
  static constexpr int ST_OFF = align128(P_OFF + P_BYTES);  // alpha[M], inv_l[M], lse[M]
  static constexpr int SMEM = align128(ST_OFF + 3 * M * 4);
  static_assert(M * LDO * 4 <= KV_BYTES, "O staging must fit in the K/V buffers");
  static_assert(16 * 16 * 4 <= S_BYTES, "row-index scratch must fit in S");
};

using AccFrag = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
constexpr int kAccElems = AccFrag::num_elements;

template <typename T, int D, int M>
__global__ void __launch_bounds__(kThreads, 2)
prefix_kernel(const T* __restrict__ q, const T* __restrict__ pool, const int* __restrict__ group_rows,
              const int* __restrict__ prefix_table, const int* __restrict__ prefix_len,
              float* __restrict__ part_o, float* __restrict__ part_lse, int R, int Lq, int Hq, int Hkv,
              int bs, int Rg, int Mp, int chunk_tokens, int row_tiles, float scale_log2) {
  using C = PrefixCfg<D, M>;
  constexpr int N = C::N;
  constexpr int LDK = C::LDK;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Q_s = reinterpret_cast<T*>(smem + C::Q_OFF);
  T* KV_s = reinterpret_cast<T*>(smem + C::KV_OFF);
  float* S_s = reinterpret_cast<float*>(smem + C::S_OFF);
  T* P_s = reinterpret_cast<T*>(smem + C::P_OFF);
  float* alpha_s = reinterpret_cast<float*>(smem + C::ST_OFF);
  float* invl_s = alpha_s + M;
  float* lse_s = invl_s + M;

  const int tile = blockIdx.x % row_tiles;
  const int chunk = blockIdx.x / row_tiles;
  const int h = blockIdx.y;
  const int g = blockIdx.z;
  const int plen = prefix_len[g];
  const int t_begin = chunk * chunk_tokens;
  if (t_begin >= plen) return;  // uniform over the CTA, before any barrier
  const int t_end = min(t_begin + chunk_tokens, plen);
  const int grp = Hq / Hkv;
  const int per_row = Lq * grp;
  const int rows_q = Rg * per_row;
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const uint4 zero4 = make_uint4(0u, 0u, 0u, 0u);
  const int64_t slot_stride = (int64_t)Hkv * D;          // between token slots of a block
  const int64_t kv_stride = (int64_t)bs * Hkv * D;       // V after K inside a block
  const int* table = prefix_table + (int64_t)g * Mp;

  // ---- queries of this row tile -> Q_s (zero rows for padding)
  for (int i = tid; i < M * (D / 8); i += kThreads) {
    const int m = i / (D / 8), v = i % (D / 8);
    const int mg = tile * M + m;
    uint4 val = zero4;
    if (mg < rows_q) {
      const int rg = mg / per_row, rem = mg - rg * per_row;
      const int lq = rem / grp, j = rem - lq * grp;
      const int row = group_rows[(int64_t)g * Rg + rg];
      if (row >= 0)
        val = *reinterpret_cast<const uint4*>(q + (((int64_t)row * Lq + lq) * Hq + (int64_t)h * grp + j) * D + v * 8);
    }
    *reinterpret_cast<uint4*>(Q_s + m * LDK + v * 8) = val;
  }

  // ---- K/V tile loader: tokens [t0, t0 + N) of the chunk into stage `stage`
  auto load_tile = [&](int t0, int stage) {
    T* Ks = KV_s + stage * C::STAGE_ELEMS;
    T* Vs = Ks + N * LDK;
#pragma unroll 4
    for (int i = tid; i < N * (D / 8); i += kThreads) {
      const int n = i / (D / 8), v = i % (D / 8);
      const int t = t0 + n;
      T* kd = Ks + n * LDK + v * 8;
      T* vd = Vs + n * LDK + v * 8;
      int blk = -1;
      if (t < t_end) blk = __ldg(table + t / bs);
      if (blk >= 0) {
        const T* src = pool + ((int64_t)blk * 2 * bs + (t % bs)) * slot_stride + (int64_t)h * D + v * 8;
        cp_async16(kd, src);
        cp_async16(vd, src + kv_stride);
      } else {
        *reinterpret_cast<uint4*>(kd) = zero4;
        *reinterpret_cast<uint4*>(vd) = zero4;
      }
    }
  };

  // ---- which row of a 16x16 accumulator each fragment element holds (layout is opaque in WMMA)
  for (int i = tid; i < 256; i += kThreads) S_s[i] = (float)(i / 16);
  __syncthreads();
  int rowid[kAccElems];
  {
    AccFrag idx;
    wmma::load_matrix_sync(idx, S_s, 16, wmma::mem_row_major);
#pragma unroll
    for (int e = 0; e < kAccElems; ++e) rowid[e] = (int)idx.x[e];
  }
  __syncthreads();  // S_s is overwritten below

  AccFrag oacc[C::MT][C::O_DPW];
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
    for (int di = 0; di < C::O_DPW; ++di) wmma::fill_fragment(oacc[mt][di], 0.0f);

  // softmax state: row r_sm, replicated over its TPR threads
  const int r_sm = tid / C::TPR, sub_sm = tid % C::TPR;
  float m_run = neg_inf(), l_run = 0.0f;
  const int wn = warp % C::WN, wm = warp / C::WN;

  const int ntiles = (t_end - t_begin + N - 1) / N;
  load_tile(t_begin, 0);
  cp_async_commit();
  for (int it = 0; it < ntiles; ++it) {
    const int stage = it & 1;
    if (it + 1 < ntiles) {
      load_tile(t_begin + (it + 1) * N, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // (A) tile `it` (and Q_s) visible to all
    const T* Ks = KV_s + stage * C::STAGE_ELEMS;
    const T* Vs = Ks + N * LDK;

    // ---- S = Q K^T  (fp32, raw dot products)
#pragma unroll
    for (int ni = 0; ni < C::S_NPW; ++ni) {
      const int nt = wn + ni * C::WN;
      AccFrag sacc[C::S_MPW];
#pragma unroll
      for (int mi = 0; mi < C::S_MPW; ++mi) wmma::fill_fragment(sacc[mi], 0.0f);
#pragma unroll C::S_KUNROLL
      for (int kt = 0; kt < C::DT; ++kt) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bf;
        wmma::load_matrix_sync(bf, Ks + nt * 16 * LDK + kt * 16, LDK);
#pragma unroll
        for (int mi = 0; mi < C::S_MPW; ++mi) {
          const int mt = wm + mi * C::WM;
          if (mt < C::MT) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> af;
            wmma::load_matrix_sync(af, Q_s + mt * 16 * LDK + kt * 16, LDK);
            wmma::mma_sync(sacc[mi], af, bf, sacc[mi]);
          }
        }
      }
#pragma unroll
      for (int mi = 0; mi < C::S_MPW; ++mi) {
        const int mt = wm + mi * C::WM;
        if (mt < C::MT)
          wmma::store_matrix_sync(S_s + mt * 16 * C::LDS + nt * 16, sacc[mi], C::LDS, wmma::mem_row_major);
      }
    }
    __syncthreads();  // (B)

    // ---- online softmax on the tile (log2 domain); P -> P_s, rescale factor -> alpha_s
    {
      const int valid_n = min(N, t_end - (t_begin + it * N));
      const float* srow = S_s + r_sm * C::LDS;
      float sv[C::CPT];
      float mx = neg_inf();
#pragma unroll
      for (int j = 0; j < C::CPT; ++j) {
        const int col = sub_sm + j * C::TPR;
        const float s = (col < valid_n) ? srow[col] * scale_log2 : neg_inf();
        sv[j] = s;
        mx = fmaxf(mx, s);
      }
#pragma unroll
      for (int off = C::TPR / 2; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, off));
      const float m_new = fmaxf(m_run, mx);
      const float alpha = (m_run == neg_inf()) ? 0.0f : exp2f(m_run - m_new);
      const float m_use = (m_new == neg_inf()) ? 0.0f : m_new;
      float sum = 0.0f;
      T* prow = P_s + r_sm * C::LDP;
#pragma unroll
      for (int j = 0; j < C::CPT; ++j) {
        const float p = exp2f(sv[j] - m_use);  // exp2(-inf) = 0 for masked columns
        sum += p;
        prow[sub_sm + j * C::TPR] = Cvt<T>::from_float(p);
      }
#pragma unroll
      for (int off = C::TPR / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(kFull, sum, off);
      l_run = l_run * alpha + sum;
      m_run = m_new;
      if (sub_sm == 0) alpha_s[r_sm] = alpha;
    }
    __syncthreads();  // (C)

    // ---- O = O * alpha + P V
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
      for (int di = 0; di < C::O_DPW; ++di)
#pragma unroll
        for (int e = 0; e < kAccElems; ++e) oacc[mt][di].x[e] *= alpha_s[mt * 16 + rowid[e]];
#pragma unroll C::P_KUNROLL
    for (int kt = 0; kt < C::PT; ++kt) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pf[C::MT];
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt) wmma::load_matrix_sync(pf[mt], P_s + mt * 16 * C::LDP + kt * 16, C::LDP);
#pragma unroll
      for (int di = 0; di < C::O_DPW; ++di) {
        const int dt = warp + di * kWarps;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vf;
        wmma::load_matrix_sync(vf, Vs + kt * 16 * LDK + dt * 16, LDK);
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt) wmma::mma_sync(oacc[mt][di], pf[mt], vf, oacc[mt][di]);
      }
    }
    __syncthreads();  // (D) stage `it`, P_s, alpha_s free again
  }

  // ---- epilogue: normalise, stage O in the (now idle) K/V buffers, write partials
  if (sub_sm == 0) {
    const bool any = l_run > 0.0f;
    invl_s[r_sm] = any ? 1.0f / l_run : 0.0f;
    lse_s[r_sm] = any ? m_run + log2f(l_run) : neg_inf();
  }
  __syncthreads();
  float* O_s = reinterpret_cast<float*>(smem + C::KV_OFF);
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
    for (int di = 0; di < C::O_DPW; ++di) {
      const int dt = warp + di * kWarps;
#pragma unroll
      for (int e = 0; e < kAccElems; ++e) oacc[mt][di].x[e] *= invl_s[mt * 16 + rowid[e]];
      wmma::store_matrix_sync(O_s + mt * 16 * C::LDO + dt * 16, oacc[mt][di], C::LDO, wmma::mem_row_major);
    }
  __syncthreads();
  for (int i = tid; i < M * (D / 4); i += kThreads) {
    const int m = i / (D / 4), v = i % (D / 4);
    const int mg = tile * M + m;
    if (mg >= rows_q) continue;
    const int rg = mg / per_row, rem = mg - rg * per_row;
    const int lq = rem / grp, j = rem - lq * grp;
    const int row = group_rows[(int64_t)g * Rg + rg];
    if (row < 0) continue;
    const int64_t item = (((int64_t)chunk * R + row) * Lq + lq) * Hq + (int64_t)h * grp + j;
    *reinterpret_cast<float4*>(part_o + item * D + v * 4) = *reinterpret_cast<const float4*>(O_s + m * C::LDO + v * 4);
    if (v == 0) part_lse[item] = lse_s[m];
  }
}

// ======================================================================= level 0: the prefix, v2
//
// hfc_prefix_v2: same grid, launcher, inputs and partial outputs as hfc_prefix, different insides.
// Why: v1 keeps S and P in shared memory (WMMA fragments are opaque), which costs 81-114 KB per CTA, so
// only 2 CTAs fit on an SM and each keeps one 32 KB K/V tile in flight: ~64 KB outstanding per SM,
// about half of what HBM3e needs (benchmarks/RESULTS.md). v2 is FlashAttention-2 style:
//   * S = Q K^T and O += P V with mma.sync.m16n8k16 (inline PTX, fp32 accumulate), operands loaded
//     with ldmatrix from an XOR-swizzled shared layout (16-byte chunk c of row r at c ^ (r & 7): no bank
//     conflicts and no padding); S, P, the running max/sum and O live in registers; P is re-packed from
//     the S accumulators into the A fragment of the P V product without touching shared memory.
//   * shared memory holds only Q and a STAGES-deep ring of small K/V tiles (16 KB each), filled by
//     cp.async (zero-fill form for invalid tokens: nothing is read for them); one barrier per tile.
//     Result (D 128, 32 rows): 72 KB per CTA, 3 CTAs per SM, 3 tiles in flight per CTA = 144 KB
//     outstanding per SM (v1: 64 KB); D 128 / 64 rows: 96 KB, 2 CTAs, 4 tiles in flight = 128 KB.
//   * warps: WM = M/16 warps along the rows (16 rows each), WN = 4/WM along the tokens. A tile's tokens
//     are cut into sub-tiles of KW >= 16 tokens (one mma k step or more); sub-tile `gs` (counted over
//     the whole chunk) belongs to warp column gs % WN. Each warp keeps its own online softmax over its
//     sub-tiles; the WN partial states of a row are merged through shared memory at the end (the K/V
//     ring is idle then). So 16- and 32-row tiles keep all 4 warps busy without splitting D.
// Not chosen: TMA / cp.async.bulk (a paged gather of 256-byte rows needs one bulk copy per token and
// block table: no gain over cp.async at these sizes, more risk); wgmma (64-row minimum, sm_90a only:
// 16-32-row decode tiles would waste most of it, and the kernel is memory bound with mma.sync).

template <int D, int M>
struct PrefixV2Cfg {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim");
  static_assert(M == 16 || M == 32 || M == 64, "row tile");
  static constexpr int WM = M / 16;                                  // warps along rows
  static constexpr int WN = kWarps / WM;                             // warps along tokens
  static constexpr int N = (D == 64) ? 64 : (D == 128) ? 32 : 16;    // tokens per K/V tile (16 KB K+V)
  static constexpr int KW = (N / WN >= 16) ? N / WN : 16;            // tokens per warp sub-tile
  static constexpr int SUB = N / KW;                                 // sub-tiles per K/V tile
  static constexpr int STAGES = (D == 64) ? 4 : (D == 128) ? (M == 64 ? 5 : 4) : 5;
  static constexpr int MIN_CTAS = (D == 256 || (D == 128 && M == 64)) ? 2 : 3;  // register cap
  static constexpr int CH = D / 8;                                   // 16-byte chunks per row
  static constexpr int NT = KW / 8;                                  // n tiles of S per sub-tile
  static constexpr int DN = D / 8;                                   // n tiles of O
  static constexpr int TILE_ELEMS = 2 * N * D;                       // K then V
  static constexpr int Q_BYTES = M * D * 2;
  static constexpr int KV_OFF = align128(Q_BYTES);
  static constexpr int KV_BYTES = STAGES * TILE_ELEMS * 2;
  static constexpr int LDO = D + 8;                                  // O staging row stride (floats)
  static constexpr int O_BYTES = WN * M * LDO * 4;
  static constexpr int SMEM = KV_OFF + (KV_BYTES > O_BYTES ? KV_BYTES : O_BYTES);
  static constexpr int LD_TOK = kThreads / CH;                       // tokens per loader pass
  static constexpr int LD_PASSES = N / LD_TOK;
  static_assert(KW % 16 == 0 && N % KW == 0 && SUB * KW == N, "sub-tiling");
  static_assert(LD_TOK * CH == kThreads && LD_PASSES * LD_TOK == N, "loader tiling");
  static_assert((2 * WN + 1) * M * 4 <= Q_BYTES, "softmax statistics must fit in the Q buffer");
  static_assert(CH % 8 == 0, "swizzle needs >= 8 chunks per row");
};

// element offset of 16-byte chunk c of row r in a [rows][D] tile, XOR-swizzled
template <int D>
__device__ __forceinline__ int swz(int r, int c) { return r * D + ((c ^ (r & 7)) << 3); }

__device__ __forceinline__ void cp_async16_zfill(void* smem_dst, const void* gmem_src, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem_src), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}

// c[0..3] += A(16x16, row) * B(16x8, col), fp32 accumulate; A = 4 x (2 elements), B = 2 x (2 elements)
template <typename T> struct Mma;
template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low 16 bits
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <> struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), with
// g = lane >> 2, q4 = lane & 3:
//   A regs a[0..3]: (row g, cols 2q4..+1), (row g+8, cols 2q4..+1), (row g, cols 8+2q4..), (row g+8, 8+2q4..)
//   B regs b0, b1:  (k 2q4..+1, col g), (k 8+2q4..+1, col g)
//   C c[0..3]:      (row g, cols 2q4, 2q4+1), (row g+8, cols 2q4, 2q4+1)
// ldmatrix .x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i, register i holds its
// (row lane>>2, cols 2q4..+1); with .trans it holds (rows 2q4..+1, col lane>>2) instead.
//   Q (A of S):  matrix i = rows 8(i&1).., d chunk 2kk + (i>>1)      -> a[0..3] as above
//   K (B of S):  matrix i = tokens 8(i>>1).., d chunk 2kk + (i&1)    -> b0, b1 of token n-tile 0, then 1
//   V (B of PV, .trans): matrix i = tokens 8(i&1).., d chunk 2dp + (i>>1) -> b0, b1 of d n-tile 0, then 1
//   P (A of PV): S n-tiles 2j, 2j+1 of the sub-tile: a = {pack(c0,c1) of 2j, pack(c2,c3) of 2j,
//                pack(c0,c1) of 2j+1, pack(c2,c3) of 2j+1}.

template <typename T, int D, int M>
__global__ void __launch_bounds__(kThreads, PrefixV2Cfg<D, M>::MIN_CTAS)
prefix_v2_kernel(const T* __restrict__ q, const T* __restrict__ pool, const int* __restrict__ group_rows,
                 const int* __restrict__ prefix_table, const int* __restrict__ prefix_len,
                 float* __restrict__ part_o, float* __restrict__ part_lse, int R, int Lq, int Hq, int Hkv,
                 int bs, int Rg, int Mp, int chunk_tokens, int row_tiles, float scale_log2) {
  using C = PrefixV2Cfg<D, M>;
  constexpr int N = C::N, KW = C::KW, NT = C::NT, DN = C::DN, CH = C::CH, STAGES = C::STAGES;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Q_s = reinterpret_cast<T*>(smem);
  T* KV_s = reinterpret_cast<T*>(smem + C::KV_OFF);

  const int tile = blockIdx.x % row_tiles;
  const int chunk = blockIdx.x / row_tiles;
  const int h = blockIdx.y;
  const int g = blockIdx.z;
  const int grp = Hq / Hkv;
  const int per_row = Lq * grp;
  const int rows_q = Rg * per_row;
  const int rows_here = min(M, rows_q - tile * M);
  if (rows_here <= 0) return;  // a row tile past the group's rows: nothing to write
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;

  // query row m of this tile -> its partial's item index (R, Lq, Hq flattened), or -1
  auto item_of = [&](int m) -> int64_t {
    const int mg = tile * M + m;
    if (m >= rows_here) return -1;
    const int rg = mg / per_row, rem = mg - rg * per_row;
    const int lq = rem / grp, j = rem - lq * grp;
    const int row = group_rows[(int64_t)g * Rg + rg];
    if (row < 0) return -1;
    return (((int64_t)chunk * R + row) * Lq + lq) * Hq + (int64_t)h * grp + j;
  };

  const int plen = prefix_len[g];
  const int t_begin = chunk * chunk_tokens;
  if (t_begin >= plen) {  // a chunk with no tokens: O = 0, LSE = -inf (uniform over the CTA, no barrier)
    for (int i = tid; i < M * (D / 4); i += kThreads) {
      const int m = i / (D / 4), v = i % (D / 4);
      const int64_t item = item_of(m);
      if (item < 0) continue;
      *reinterpret_cast<float4*>(part_o + item * D + v * 4) = make_float4(0.f, 0.f, 0.f, 0.f);
      if (v == 0) part_lse[item] = neg_inf();
    }
    return;
  }
  const int t_end = min(t_begin + chunk_tokens, plen);
  const int64_t slot_stride = (int64_t)Hkv * D;     // between token slots of a block
  const int64_t kv_stride = (int64_t)bs * Hkv * D;  // V after K inside a block
  const int* table = prefix_table + (int64_t)g * Mp;
  const T* pool_h = pool + (int64_t)h * D;

  // ---- queries of this row tile -> Q_s (swizzled; zero rows for padding), in the first cp.async group
  for (int i = tid; i < M * CH; i += kThreads) {
    const int m = i / CH, c = i % CH;
    const int mg = tile * M + m;
    const T* src = q;
    int bytes = 0;
    if (m < rows_here) {
      const int rg = mg / per_row, rem = mg - rg * per_row;
      const int lq = rem / grp, j = rem - lq * grp;
      const int row = group_rows[(int64_t)g * Rg + rg];
      if (row >= 0) {
        src = q + (((int64_t)row * Lq + lq) * Hq + (int64_t)h * grp + j) * D + c * 8;
        bytes = 16;
      }
    }
    cp_async16_zfill(Q_s + swz<D>(m, c), src, bytes);
  }

  // ---- K/V tile loader: tokens [t0, t0 + N) of the chunk into ring slot `stage`. Each thread always
  // copies chunk ld_c of tokens ld_n0 + p * LD_TOK. Tokens past the chunk end or in a -1 block are
  // zero-filled (src-size 0: no global read; the address passed is the pool's base, never dereferenced).
  const int ld_c = tid % CH, ld_n0 = tid / CH;
  auto load_tile = [&](int t0, int stage) {
    T* Ks = KV_s + stage * C::TILE_ELEMS;
    T* Vs = Ks + N * D;
#pragma unroll
    for (int p = 0; p < C::LD_PASSES; ++p) {
      const int n = ld_n0 + p * C::LD_TOK;
      const int t = t0 + n;
      int blk = -1;
      if (t < t_end) blk = __ldg(table + t / bs);
      const T* ksrc = pool;
      const T* vsrc = pool;
      int bytes = 0;
      if (blk >= 0) {
        ksrc = pool_h + ((int64_t)blk * 2 * bs + (t % bs)) * slot_stride + ld_c * 8;
        vsrc = ksrc + kv_stride;
        bytes = 16;
      }
      const int off = swz<D>(n, ld_c);
      cp_async16_zfill(Ks + off, ksrc, bytes);
      cp_async16_zfill(Vs + off, vsrc, bytes);
    }
  };

  const int ntiles = (t_end - t_begin + N - 1) / N;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ntiles) load_tile(t_begin + s * N, s);
    cp_async_commit();  // always commit (possibly empty): group k <-> tile k
  }

  const int wm = warp / C::WN, wn = warp % C::WN;
  const bool active = wm * 16 < rows_here;  // warp-uniform: a warp of padding rows only skips the math
  const int lr = lane & 7, li = lane >> 3, q4 = lane & 3;
  const int q_row = wm * 16 + (li & 1) * 8 + lr;  // ldmatrix row of this lane for Q
  const int q_chunk = li >> 1;
  const int k_tok = (li >> 1) * 8 + lr;           // ... for K (non-transposed)
  const int k_chunk = li & 1;
  const int v_tok = (li & 1) * 8 + lr;            // ... for V (transposed)
  const int v_chunk = li >> 1;

  float o[DN][4];
#pragma unroll
  for (int dn = 0; dn < DN; ++dn)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[dn][e] = 0.0f;
  float m_run[2] = {neg_inf(), neg_inf()};  // rows g and g + 8 of the warp's 16
  float l_run[2] = {0.0f, 0.0f};            // this lane's share of the row sums (reduced at the end)

  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait<STAGES - 2>();  // this thread's copies of tile `it` have landed
    __syncthreads();              // everyone's have; everyone is done with tile it - 1 (its slot is free)
    {
      const int nx = it + STAGES - 1;
      if (nx < ntiles) load_tile(t_begin + nx * N, nx % STAGES);
      cp_async_commit();
    }
    if (!active) continue;
    const T* Ks = KV_s + (it % STAGES) * C::TILE_ELEMS;
    const T* Vs = Ks + N * D;
#pragma unroll
    for (int s = 0; s < C::SUB; ++s) {
      if (C::WN > 1 && (it * C::SUB + s) % C::WN != wn) continue;
      const int tok0 = s * KW;                               // first token of the sub-tile in the tile
      const int valid = t_end - (t_begin + it * N + tok0);   // valid tokens of the sub-tile (if < KW)
      if (valid <= 0) continue;

      // ---- S = Q K^T (16 rows x KW tokens, fp32)
      float sacc[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[nt][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        ldsm_x4(a, Q_s + swz<D>(q_row, 2 * kk + q_chunk));
#pragma unroll
        for (int tp = 0; tp < KW / 16; ++tp) {
          uint32_t b[4];
          ldsm_x4(b, Ks + swz<D>(tok0 + tp * 16 + k_tok, 2 * kk + k_chunk));
          Mma<T>::run(sacc[2 * tp], a, b[0], b[1]);
          Mma<T>::run(sacc[2 * tp + 1], a, b[2], b[3]);
        }
      }

      // ---- online softmax in registers (log2 domain); masked columns -> -inf
      float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = sacc[nt][e] * scale_log2;
          if (valid < KW && nt * 8 + 2 * q4 + (e & 1) >= valid) v = neg_inf();
          sacc[nt][e] = v;
          mx[e >> 1] = fmaxf(mx[e >> 1], v);
        }
      float alpha[2], m_use[2], rsum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFull, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFull, mx[r], 2));
        const float m_new = fmaxf(m_run[r], mx[r]);
        alpha[r] = (m_run[r] == neg_inf()) ? 0.0f : exp2f(m_run[r] - m_new);
        m_use[r] = (m_new == neg_inf()) ? 0.0f : m_new;
        m_run[r] = m_new;
      }
      uint32_t pf[KW / 16][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float p0 = exp2f(sacc[nt][0] - m_use[0]);  // exp2(-inf) = 0 for masked columns
        const float p1 = exp2f(sacc[nt][1] - m_use[0]);
        const float p2 = exp2f(sacc[nt][2] - m_use[1]);
        const float p3 = exp2f(sacc[nt][3] - m_use[1]);
        rsum[0] += p0 + p1;
        rsum[1] += p2 + p3;
        pf[nt >> 1][(nt & 1) * 2 + 0] = Mma<T>::pack(p0, p1);
        pf[nt >> 1][(nt & 1) * 2 + 1] = Mma<T>::pack(p2, p3);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + rsum[r];
#pragma unroll
      for (int dn = 0; dn < DN; ++dn) {
        o[dn][0] *= alpha[0];
        o[dn][1] *= alpha[0];
        o[dn][2] *= alpha[1];
        o[dn][3] *= alpha[1];
      }

      // ---- O += P V
#pragma unroll
      for (int jt = 0; jt < KW / 16; ++jt)
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t b[4];
          ldsm_x4_t(b, Vs + swz<D>(tok0 + jt * 16 + v_tok, 2 * dp + v_chunk));
          Mma<T>::run(o[2 * dp], pf[jt], b[0], b[1]);
          Mma<T>::run(o[2 * dp + 1], pf[jt], b[2], b[3]);
        }
    }
  }

  // ---- epilogue: merge the WN warp columns' states of each row, normalise, write partials
  cp_async_wait<0>();  // only empty groups can be left; the ring and Q_s are reused below
  __syncthreads();
  float* m_s = reinterpret_cast<float*>(smem);   // [WN][M]   (in Q_s, idle now)
  float* l_s = m_s + C::WN * M;                   // [WN][M]
  float* lse_s = l_s + C::WN * M;                 // [M]
  float* O_s = reinterpret_cast<float*>(smem + C::KV_OFF);  // [WN][M][LDO]
  const int row0 = wm * 16 + (lane >> 2);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(kFull, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(kFull, l_run[r], 2);
  }
  if (q4 == 0) {
    m_s[wn * M + row0] = m_run[0];
    m_s[wn * M + row0 + 8] = m_run[1];
    l_s[wn * M + row0] = l_run[0];
    l_s[wn * M + row0 + 8] = l_run[1];
  }
  __syncthreads();
  float f[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    float mt = neg_inf();
#pragma unroll
    for (int w = 0; w < C::WN; ++w) mt = fmaxf(mt, m_s[w * M + row]);
    float lt = 0.0f;
#pragma unroll
    for (int w = 0; w < C::WN; ++w) {
      const float mw = m_s[w * M + row];
      if (mw != neg_inf()) lt += l_s[w * M + row] * exp2f(mw - mt);
    }
    f[r] = (m_run[r] == neg_inf() || !(lt > 0.0f)) ? 0.0f : exp2f(m_run[r] - mt) / lt;
    if (wn == 0 && q4 == 0) lse_s[row] = (lt > 0.0f) ? mt + log2f(lt) : neg_inf();
  }
  float* Ow = O_s + wn * M * C::LDO;
#pragma unroll
  for (int dn = 0; dn < DN; ++dn) {
    const int col = dn * 8 + 2 * q4;
    *reinterpret_cast<float2*>(Ow + row0 * C::LDO + col) = make_float2(o[dn][0] * f[0], o[dn][1] * f[0]);
    *reinterpret_cast<float2*>(Ow + (row0 + 8) * C::LDO + col) = make_float2(o[dn][2] * f[1], o[dn][3] * f[1]);
  }
  __syncthreads();
  for (int i = tid; i < M * (D / 4); i += kThreads) {
    const int m = i / (D / 4), v = i % (D / 4);
    const int64_t item = item_of(m);
    if (item < 0) continue;
    float4 acc = *reinterpret_cast<const float4*>(O_s + m * C::LDO + v * 4);
#pragma unroll
    for (int w = 1; w < C::WN; ++w) {
      const float4 x = *reinterpret_cast<const float4*>(O_s + (w * M + m) * C::LDO + v * 4);
      acc.x += x.x;
      acc.y += x.y;
      acc.z += x.z;
      acc.w += x.w;
    }
    *reinterpret_cast<float4*>(part_o + item * D + v * 4) = acc;
    if (v == 0) part_lse[item] = lse_s[m];
  }
}

// =========================================================================== level 1: the suffix

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
suffix_kernel(const T* __restrict__ q, const T* __restrict__ pool, const int* __restrict__ suffix_table,
              const int* __restrict__ q_limit, float* __restrict__ part_o, float* __restrict__ part_lse, int R,
              int Lq, int Hq, int Hkv, int bs, int Ms, int split_tokens, int nqb, int slot0, float scale_log2) {
  constexpr int LPT = D / 8;         // lanes per token, 8 elements (16 bytes) each
  constexpr int TPW = 32 / LPT;      // tokens per warp and step
  constexpr int STEP = kWarps * TPW; // tokens per CTA and step
  __shared__ float red_o[kWarps][kQB][D];
  __shared__ float red_m[kWarps][kQB];
  __shared__ float red_l[kWarps][kQB];

  const int qb = blockIdx.x % nqb;
  const int split = blockIdx.x / nqb;
  const int h = blockIdx.y;
  const int r = blockIdx.z;
  const int grp = Hq / Hkv;
  const int nq = Lq * grp;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane % LPT, tg = lane / LPT;
  const int cap = Ms * bs;

  float qr[kQB][8];
  int lim[kQB];
  int tmax = 0;
#pragma unroll
  for (int qi = 0; qi < kQB; ++qi) {
    const int qidx = qb * kQB + qi;
    lim[qi] = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) qr[qi][e] = 0.0f;
    if (qidx < nq) {
      const int lq = qidx / grp, j = qidx - lq * grp;
      lim[qi] = max(0, min(q_limit[(int64_t)r * Lq + lq], cap));
      tmax = max(tmax, lim[qi]);
      const uint4 raw =
          *reinterpret_cast<const uint4*>(q + (((int64_t)r * Lq + lq) * Hq + (int64_t)h * grp + j) * D + sub * 8);
      Cvt<T>::unpack8(raw, qr[qi]);
#pragma unroll
      for (int e = 0; e < 8; ++e) qr[qi][e] *= scale_log2;
    }
  }
  const int t_lo = split * split_tokens;
  const int t_hi = min(t_lo + split_tokens, tmax);
  const int* table = suffix_table + (int64_t)r * Ms;
  const int64_t slot_stride = (int64_t)Hkv * D;
  const int64_t kv_stride = (int64_t)bs * Hkv * D;
  const uint4 zero4 = make_uint4(0u, 0u, 0u, 0u);

  float m[kQB], l[kQB], o[kQB][8];
#pragma unroll
  for (int qi = 0; qi < kQB; ++qi) {
    m[qi] = neg_inf();
    l[qi] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[qi][e] = 0.0f;
  }

  auto load_tok = [&](int t, uint4& kk, uint4& vv) -> bool {
    kk = zero4;
    vv = zero4;
    if (t >= t_hi) return false;
    const int blk = __ldg(table + t / bs);
    if (blk < 0) return false;
    const T* src = pool + ((int64_t)blk * 2 * bs + (t % bs)) * slot_stride + (int64_t)h * D + sub * 8;
    kk = __ldg(reinterpret_cast<const uint4*>(src));
    vv = __ldg(reinterpret_cast<const uint4*>(src + kv_stride));
    return true;
  };
  auto process = [&](const uint4& kk, const uint4& vv, bool ok, int t) {
    float kf[8], vf[8];
    Cvt<T>::unpack8(kk, kf);
    Cvt<T>::unpack8(vv, vf);
#pragma unroll
    for (int qi = 0; qi < kQB; ++qi) {
      float s = 0.0f;
#pragma unroll
      for (int e = 0; e < 8; ++e) s = fmaf(qr[qi][e], kf[e], s);
#pragma unroll
      for (int off = LPT / 2; off > 0; off >>= 1) s += __shfl_xor_sync(kFull, s, off);  // every lane takes part
      if (ok && t < lim[qi]) {
        const float mn = fmaxf(m[qi], s);
        const float a = exp2f(m[qi] - mn);  // m = -inf -> 0
        const float p = exp2f(s - mn);
        l[qi] = l[qi] * a + p;
#pragma unroll
        for (int e = 0; e < 8; ++e) o[qi][e] = fmaf(o[qi][e], a, p * vf[e]);
        m[qi] = mn;
      }
    }
  };

  // the loop condition is uniform over the warp (tb does not depend on the lane)
  for (int tb = t_lo + warp * TPW; tb < t_hi; tb += 2 * STEP) {
    uint4 k0, v0, k1, v1;
    const int t0 = tb + tg, t1 = tb + STEP + tg;
    const bool ok0 = load_tok(t0, k0, v0);
    const bool ok1 = load_tok(t1, k1, v1);
    process(k0, v0, ok0, t0);
    process(k1, v1, ok1, t1);
  }

  // merge the TPW token groups of the warp (lanes sub, sub + LPT, ...)
#pragma unroll
  for (int off = LPT; off < 32; off <<= 1) {
#pragma unroll
    for (int qi = 0; qi < kQB; ++qi) {
      const float m2 = __shfl_xor_sync(kFull, m[qi], off);
      const float l2 = __shfl_xor_sync(kFull, l[qi], off);
      const float mn = fmaxf(m[qi], m2);
      const float a1 = (m[qi] == neg_inf()) ? 0.0f : exp2f(m[qi] - mn);
      const float a2 = (m2 == neg_inf()) ? 0.0f : exp2f(m2 - mn);
      l[qi] = l[qi] * a1 + l2 * a2;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float o2 = __shfl_xor_sync(kFull, o[qi][e], off);
        o[qi][e] = o[qi][e] * a1 + o2 * a2;
      }
      m[qi] = mn;
    }
  }
  if (tg == 0) {
#pragma unroll
    for (int qi = 0; qi < kQB; ++qi) {
#pragma unroll
      for (int e = 0; e < 8; ++e) red_o[warp][qi][sub * 8 + e] = o[qi][e];
      if (sub == 0) {
        red_m[warp][qi] = m[qi];
        red_l[warp][qi] = l[qi];
      }
    }
  }
  __syncthreads();
  for (int idx = tid; idx < kQB * D; idx += kThreads) {
    const int qi = idx / D, d = idx % D;
    const int qidx = qb * kQB + qi;
    if (qidx >= nq) continue;
    float mx = neg_inf();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, red_m[w][qi]);
    float L = 0.0f, O = 0.0f;
    if (mx != neg_inf()) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float mw = red_m[w][qi];
        const float a = (mw == neg_inf()) ? 0.0f : exp2f(mw - mx);
        L += a * red_l[w][qi];
        O += a * red_o[w][qi][d];
      }
    }
    const bool any = L > 0.0f;
    const int lq = qidx / grp, j = qidx - lq * grp;
    const int64_t item = (((int64_t)(slot0 + split) * R + r) * Lq + lq) * Hq + (int64_t)h * grp + j;
    part_o[item * D + d] = any ? O / L : 0.0f;
    if (d == 0) part_lse[item] = any ? mx + log2f(L) : neg_inf();
  }
}

// ================================================================================ merge partials

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
merge_kernel(const float* __restrict__ part_o, const float* __restrict__ part_lse,
             const int* __restrict__ row_nchunks, T* __restrict__ out, int R, int Lq, int Hq, int slot0,
             int nsplit) {
  constexpr int EPL = D / 32;  // elements per lane: 2, 4, 8
  const int64_t total = (int64_t)R * Lq * Hq;
  const int64_t item = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (item >= total) return;  // whole warp
  const int lane = threadIdx.x & 31;
  const int r = (int)(item / ((int64_t)Lq * Hq));
  const int npre = row_nchunks[r];
  const int nslots = npre + nsplit;

  float mx = neg_inf();
  for (int s = lane; s < nslots; s += 32) {
    const int slot = s < npre ? s : slot0 + (s - npre);
    mx = fmaxf(mx, part_lse[(int64_t)slot * total + item]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, off));

  float acc[EPL];
#pragma unroll
  for (int e = 0; e < EPL; ++e) acc[e] = 0.0f;
  float wsum = 0.0f;
  if (mx != neg_inf()) {
    for (int s = 0; s < nslots; ++s) {
      const int slot = s < npre ? s : slot0 + (s - npre);
      const int64_t at = (int64_t)slot * total + item;
      const float lse = part_lse[at];
      if (lse == neg_inf()) continue;  // same for the whole warp
      const float w = exp2f(lse - mx);
      wsum += w;
      const float* src = part_o + at * D + lane * EPL;
      if constexpr (EPL == 2) {
        const float2 v = *reinterpret_cast<const float2*>(src);
        acc[0] = fmaf(w, v.x, acc[0]);
        acc[1] = fmaf(w, v.y, acc[1]);
      } else {
#pragma unroll
        for (int e4 = 0; e4 < EPL / 4; ++e4) {
          const float4 v = *reinterpret_cast<const float4*>(src + e4 * 4);
          acc[e4 * 4 + 0] = fmaf(w, v.x, acc[e4 * 4 + 0]);
          acc[e4 * 4 + 1] = fmaf(w, v.y, acc[e4 * 4 + 1]);
          acc[e4 * 4 + 2] = fmaf(w, v.z, acc[e4 * 4 + 2]);
          acc[e4 * 4 + 3] = fmaf(w, v.w, acc[e4 * 4 + 3]);
        }
      }
    }
  }
  const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
  T* dst = out + item * D + lane * EPL;
#pragma unroll
  for (int e = 0; e < EPL; ++e) dst[e] = Cvt<T>::from_float(acc[e] * inv);
}

// ===================================================================================== launchers

inline bool fits_int(long long x) { return x >= 0 && x <= 0x7fffffffLL; }

template <typename T, int D, int M>
cudaError_t prefix_info_t(int* ctas_per_sm, int* smem_bytes, int* tile_tokens) {
  using C = PrefixCfg<D, M>;
  auto kern = prefix_kernel<T, D, M>;
  cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM);
  if (err != cudaSuccess) return err;
  if (smem_bytes) *smem_bytes = C::SMEM;
  if (tile_tokens) *tile_tokens = C::N;
  if (ctas_per_sm) return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas_per_sm, kern, kThreads, C::SMEM);
  return cudaSuccess;
}

template <typename T, int D, int M>
cudaError_t prefix_launch_t(const void* q, const void* pool, const int* group_rows, const int* prefix_table,
                            const int* prefix_len, float* part_o, float* part_lse, int R, int Lq, int Hq, int Hkv,
                            int bs, int G, int Rg, int Mp, int chunk_tokens, int max_chunks, int row_tiles,
                            float scale_log2, cudaStream_t stream) {
  using C = PrefixCfg<D, M>;
  auto kern = prefix_kernel<T, D, M>;
  cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM);
  if (err != cudaSuccess) return err;
  const long long gx = (long long)row_tiles * max_chunks;
  if (!fits_int(gx) || Hkv > 65535 || G > 65535) return cudaErrorInvalidConfiguration;
  dim3 grid((unsigned)gx, (unsigned)Hkv, (unsigned)G);
  kern<<<grid, kThreads, C::SMEM, stream>>>(static_cast<const T*>(q), static_cast<const T*>(pool), group_rows,
                                            prefix_table, prefix_len, part_o, part_lse, R, Lq, Hq, Hkv, bs, Rg, Mp,
                                            chunk_tokens, row_tiles, scale_log2);
  return cudaGetLastError();
}

template <typename T, int D, int M>
cudaError_t prefix_v2_setup() {
  using C = PrefixV2Cfg<D, M>;
  auto kern = prefix_v2_kernel<T, D, M>;
  cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM);
  if (err != cudaSuccess) return err;
  // several CTAs of up to ~100 KB each per SM: ask for the largest shared-memory carve-out
  return cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
}

template <typename T, int D, int M>
cudaError_t prefix_v2_info_t(int* ctas_per_sm, int* smem_bytes, int* tile_tokens) {
  using C = PrefixV2Cfg<D, M>;
  cudaError_t err = prefix_v2_setup<T, D, M>();
  if (err != cudaSuccess) return err;
  if (smem_bytes) *smem_bytes = C::SMEM;
  if (tile_tokens) *tile_tokens = C::N;
  if (ctas_per_sm)
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas_per_sm, prefix_v2_kernel<T, D, M>, kThreads, C::SMEM);
  return cudaSuccess;
}

template <typename T, int D, int M>
cudaError_t prefix_v2_launch_t(const void* q, const void* pool, const int* group_rows, const int* prefix_table,
                               const int* prefix_len, float* part_o, float* part_lse, int R, int Lq, int Hq,
                               int Hkv, int bs, int G, int Rg, int Mp, int chunk_tokens, int max_chunks,
                               int row_tiles, float scale_log2, cudaStream_t stream) {
  using C = PrefixV2Cfg<D, M>;
  cudaError_t err = prefix_v2_setup<T, D, M>();
  if (err != cudaSuccess) return err;
  const long long gx = (long long)row_tiles * max_chunks;
  if (!fits_int(gx) || Hkv > 65535 || G > 65535) return cudaErrorInvalidConfiguration;
  dim3 grid((unsigned)gx, (unsigned)Hkv, (unsigned)G);
  prefix_v2_kernel<T, D, M><<<grid, kThreads, C::SMEM, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(pool), group_rows, prefix_table, prefix_len, part_o, part_lse,
      R, Lq, Hq, Hkv, bs, Rg, Mp, chunk_tokens, row_tiles, scale_log2);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t suffix_launch_t(const void* q, const void* pool, const int* suffix_table, const int* q_limit,
                            float* part_o, float* part_lse, int R, int Lq, int Hq, int Hkv, int bs, int Ms,
                            int split_tokens, int nsplit, int slot0, float scale_log2, cudaStream_t stream) {
  const int nqb = (Lq * (Hq / Hkv) + kQB - 1) / kQB;
  const long long gx = (long long)nsplit * nqb;
  if (!fits_int(gx) || Hkv > 65535 || R > 65535) return cudaErrorInvalidConfiguration;
  dim3 grid((unsigned)gx, (unsigned)Hkv, (unsigned)R);
  suffix_kernel<T, D><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(q), static_cast<const T*>(pool),
                                                      suffix_table, q_limit, part_o, part_lse, R, Lq, Hq, Hkv, bs,
                                                      Ms, split_tokens, nqb, slot0, scale_log2);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t merge_launch_t(const float* part_o, const float* part_lse, const int* row_nchunks, void* out, int R,
                           int Lq, int Hq, int slot0, int nsplit, cudaStream_t stream) {
  const long long items = (long long)R * Lq * Hq;
  const long long blocks = (items + kWarps - 1) / kWarps;
  if (!fits_int(blocks)) return cudaErrorInvalidConfiguration;
  merge_kernel<T, D><<<(unsigned)blocks, kThreads, 0, stream>>>(part_o, part_lse, row_nchunks, static_cast<T*>(out),
                                                                 R, Lq, Hq, slot0, nsplit);
  return cudaGetLastError();
}

// dtype: 0 = bfloat16, 1 = float16
#define HFC_DISPATCH_D(D_, ...)                     \
  switch (D_) {                                     \
    case 64: { constexpr int kD = 64; __VA_ARGS__ } \
    case 128: { constexpr int kD = 128; __VA_ARGS__ } \
    case 256: { constexpr int kD = 256; __VA_ARGS__ } \
    default: return cudaErrorInvalidValue;          \
  }

#define HFC_DISPATCH_T(dtype_, ...)                         \
  switch (dtype_) {                                         \
    case 0: { using kT = __nv_bfloat16; __VA_ARGS__ }       \
    case 1: { using kT = __half; __VA_ARGS__ }              \
    default: return cudaErrorInvalidValue;                  \
  }

#define HFC_DISPATCH_M(D_, M_, ...)                                           \
  switch (M_) {                                                               \
    case 16: { constexpr int kM = 16; __VA_ARGS__ }                           \
    case 32: { constexpr int kM = 32; __VA_ARGS__ }                           \
    case 64: { if constexpr (D_ <= 128) { constexpr int kM = 64; __VA_ARGS__ } \
               else return cudaErrorInvalidValue; }                           \
    default: return cudaErrorInvalidValue;                                    \
  }

// The prefix launchers' shared argument check: kPrefixGo to launch, else the status to return
// (cudaSuccess when there is nothing to do).
constexpr int kPrefixGo = -1;
inline int prefix_args_status(long long R, long long Lq, long long Hq, long long Hkv, long long bs, long long G,
                              long long Rg, long long Mp, long long chunk_tokens, long long max_chunks,
                              long long row_tiles, int m_tile) {
  if (!fits_int(R) || !fits_int(Lq) || !fits_int(Hq) || !fits_int(Hkv) || !fits_int(bs) || !fits_int(G) ||
      !fits_int(Rg) || !fits_int(Mp) || !fits_int(chunk_tokens) || !fits_int(max_chunks) || !fits_int(row_tiles))
    return (int)cudaErrorInvalidValue;
  if (Hkv < 1 || Hq % Hkv != 0 || bs < 1 || chunk_tokens < 1 || row_tiles < 1 || Lq < 1)
    return (int)cudaErrorInvalidValue;
  if (R == 0 || G == 0 || Rg == 0 || Mp == 0 || max_chunks == 0) return (int)cudaSuccess;  // nothing to do
  if (Rg * Lq * (Hq / Hkv) > row_tiles * m_tile) return (int)cudaErrorInvalidValue;
  return kPrefixGo;
}

}  // namespace

// ---------------------------------------------------------------------------------------- C ABI

HFC_API int hfc_abi_version() { return 2; }

HFC_API const char* hfc_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

// Debugging aid (HF_CASCADE_CUDA_DEBUG): wait for the device and report any asynchronous error.
HFC_API int hfc_sync() { return (int)cudaDeviceSynchronize(); }

// Occupancy of the prefix kernel: CTAs per SM, dynamic shared memory bytes, tokens per K/V tile.
HFC_API int hfc_prefix_info(int dtype, int head_dim, int m_tile, int* ctas_per_sm, int* smem_bytes, int* tile_tokens) {
  HFC_DISPATCH_T(dtype, HFC_DISPATCH_D(head_dim, HFC_DISPATCH_M(kD, m_tile,
      return (int)prefix_info_t<kT, kD, kM>(ctas_per_sm, smem_bytes, tile_tokens);)))
}

HFC_API int hfc_prefix(int dtype, int head_dim, int m_tile, const void* q, const void* pool, const int* group_rows,
                       const int* prefix_table, const int* prefix_len, float* part_o, float* part_lse, long long R,
                       long long Lq, long long Hq, long long Hkv, long long bs, long long G, long long Rg,
                       long long Mp, long long chunk_tokens, long long max_chunks, long long row_tiles,
                       float scale_log2, uintptr_t stream) {
  const int status = prefix_args_status(R, Lq, Hq, Hkv, bs, G, Rg, Mp, chunk_tokens, max_chunks, row_tiles, m_tile);
  if (status != kPrefixGo) return status;
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  HFC_DISPATCH_T(dtype, HFC_DISPATCH_D(head_dim, HFC_DISPATCH_M(kD, m_tile,
      return (int)prefix_launch_t<kT, kD, kM>(q, pool, group_rows, prefix_table, prefix_len, part_o, part_lse,
                                              (int)R, (int)Lq, (int)Hq, (int)Hkv, (int)bs, (int)G, (int)Rg, (int)Mp,
                                              (int)chunk_tokens, (int)max_chunks, (int)row_tiles, scale_log2, st);)))
}

// The v2 prefix kernel (FlashAttention-2 style, registers + mma.sync; see prefix_v2_kernel): same
// arguments, grid and outputs as hfc_prefix_info / hfc_prefix. Additionally, a chunk with no tokens
// writes O = 0, LSE = -inf for its rows (v1 skips it; the merge reads neither).
HFC_API int hfc_prefix_v2_info(int dtype, int head_dim, int m_tile, int* ctas_per_sm, int* smem_bytes,
                               int* tile_tokens) {
  HFC_DISPATCH_T(dtype, HFC_DISPATCH_D(head_dim, HFC_DISPATCH_M(kD, m_tile,
      return (int)prefix_v2_info_t<kT, kD, kM>(ctas_per_sm, smem_bytes, tile_tokens);)))
}

HFC_API int hfc_prefix_v2(int dtype, int head_dim, int m_tile, const void* q, const void* pool, const int* group_rows,
                          const int* prefix_table, const int* prefix_len, float* part_o, float* part_lse, long long R,
                          long long Lq, long long Hq, long long Hkv, long long bs, long long G, long long Rg,
                          long long Mp, long long chunk_tokens, long long max_chunks, long long row_tiles,
                          float scale_log2, uintptr_t stream) {
  const int status = prefix_args_status(R, Lq, Hq, Hkv, bs, G, Rg, Mp, chunk_tokens, max_chunks, row_tiles, m_tile);
  if (status != kPrefixGo) return status;
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  HFC_DISPATCH_T(dtype, HFC_DISPATCH_D(head_dim, HFC_DISPATCH_M(kD, m_tile,
      return (int)prefix_v2_launch_t<kT, kD, kM>(q, pool, group_rows, prefix_table, prefix_len, part_o, part_lse,
                                                 (int)R, (int)Lq, (int)Hq, (int)Hkv, (int)bs, (int)G, (int)Rg,
                                                 (int)Mp, (int)chunk_tokens, (int)max_chunks, (int)row_tiles,
                                                 scale_log2, st);)))
}

HFC_API int hfc_suffix(int dtype, int head_dim, const void* q, const void* pool, const int* suffix_table,
                       const int* q_limit, float* part_o, float* part_lse, long long R, long long Lq, long long Hq,
                       long long Hkv, long long bs, long long Ms, long long split_tokens, long long nsplit,
                       long long slot0, float scale_log2, uintptr_t stream) {
  if (!fits_int(R) || !fits_int(Lq) || !fits_int(Hq) || !fits_int(Hkv) || !fits_int(bs) || !fits_int(Ms) ||
      !fits_int(split_tokens) || !fits_int(nsplit) || !fits_int(slot0) || !fits_int(Ms * bs))
    return (int)cudaErrorInvalidValue;
  if (Hkv < 1 || Hq % Hkv != 0 || bs < 1 || split_tokens < 1 || nsplit < 1 || Lq < 1)
    return (int)cudaErrorInvalidValue;
  if (R == 0) return (int)cudaSuccess;
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  HFC_DISPATCH_T(dtype, HFC_DISPATCH_D(head_dim,
      return (int)suffix_launch_t<kT, kD>(q, pool, suffix_table, q_limit, part_o, part_lse, (int)R, (int)Lq, (int)Hq,
                                          (int)Hkv, (int)bs, (int)Ms, (int)split_tokens, (int)nsplit, (int)slot0,
                                          scale_log2, st);))
}

HFC_API int hfc_merge(int dtype, int head_dim, const float* part_o, const float* part_lse, const int* row_nchunks,
                      void* out, long long R, long long Lq, long long Hq, long long slot0, long long nsplit,
                      uintptr_t stream) {
  if (!fits_int(R) || !fits_int(Lq) || !fits_int(Hq) || !fits_int(slot0) || !fits_int(nsplit) ||
      !fits_int(R * Lq * Hq))
    return (int)cudaErrorInvalidValue;
  if (R == 0 || Lq == 0 || Hq == 0) return (int)cudaSuccess;
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  HFC_DISPATCH_T(dtype, HFC_DISPATCH_D(head_dim,
      return (int)merge_launch_t<kT, kD>(part_o, part_lse, row_nchunks, out, (int)R, (int)Lq, (int)Hq, (int)slot0,
                                         (int)nsplit, st);))
}
