// Rows that share no prefix (groups of one row: greedy search, one sample per prompt): a row's whole sequence, its
// group prefix then its own suffix, in one launch instead of the prefix, suffix and merge kernels. Semantics: the
// cascade's (hf_cascade/kernels/reference.py: prefix_attention, suffix_attention, merge_state), up to the order of the
// sums; layouts: csrc/include/hfc/params.h (hfc_solo_params).
//
// Why: a one-row group's layer reads a few MB of K/V (8B greedy at 4k: 16.8 MB, ~4 us at the H200's bandwidth), but
// three dependent launches took ~20 us of it (benchmarks/RESULTS.md, issue 33): the prefix kernel's 64-row tiles hold
// 4 query rows, the suffix ran 8 CTAs, and the merge waited on both.
//
// Grid: one CTA per (split x query block, KV head, row), as csrc/suffix.cu's, whose per-token code this follows: up to
// kQB = 4 query vectors of the row for one KV head. Token t of the row's sequence is prefix token t below plen (the
// group's prefix length) and suffix token t - plen above it; query lq sees the tokens below plen + q_limit[r, lq].
// Split s takes the tokens [s x split_tokens, (s + 1) x split_tokens): their pool rows are looked up once as the CTA
// starts (two tables, one round of loads), then kU tokens per lane group are loaded together before they are used.
// Each CTA writes its partial (O, LSE base 2) into slot s; the last CTA of its (query block, KV head, row) to finish
// (a counter, which it sets back to 0) merges the row's slots in slot order into out: the merge kernel's math
// (csrc/include/hfc/merge_math.cuh), its loads from L2 (the other CTAs' partials).

#include "hfc/common.cuh"
#include "hfc/dispatch.h"
#include "hfc/launch.h"
#include "hfc/merge_math.cuh"
#include "hfc/row_state.cuh"

namespace hfc {
namespace {

constexpr int kQB = 4;            // query vectors per CTA (SOLO_QB in hf_cascade/kernels/cuda_tuning.py)
constexpr int kU = 4;             // tokens per lane group loaded before the first of them is used
constexpr int kMergeAhead = 16;   // the last CTA's slots loaded together (a row of 4k tokens in 128-token splits: 33)
constexpr int kMaxSplit = 512;    // tokens per split at most (SOLO_MAX_SPLIT; the staged pool rows: 4 KB of shared memory)

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) solo_kernel(const __grid_constant__ hfc_solo_params p) {
  const T* __restrict__ q = static_cast<const T*>(p.q);
  const T* __restrict__ pool = static_cast<const T*>(p.pool);
  float* __restrict__ part_o = p.part_o;
  float* __restrict__ part_lse = p.part_lse;
  const int R = (int)p.R, Lq = (int)p.Lq, Hq = (int)p.Hq, Hkv = (int)p.Hkv, bs = (int)p.block_size;
  const int Mp = (int)p.Mp, Ms = (int)p.Ms, split_tokens = (int)p.split_tokens, nsplit = (int)p.nsplit;
  const int nqb = (Lq * (Hq / Hkv) + kQB - 1) / kQB;
  constexpr int LPT = D / 8;          // lanes per token, 8 elements (16 bytes) each
  constexpr int TPW = 32 / LPT;       // tokens per warp and step
  constexpr int STEP = kWarps * TPW;  // tokens per CTA and step
  __shared__ int64_t stage_row[kMaxSplit];  // token i of the split: its pool row (block x 2 x bs + slot), -1: none
  __shared__ float red_o[kWarps][kQB][D];
  __shared__ float red_m[kWarps][kQB];
  __shared__ float red_l[kWarps][kQB];
  __shared__ int last_cta;

  const int qb = blockIdx.x % nqb;
  const int split = blockIdx.x / nqb;
  const int h = blockIdx.y;
  const int r = blockIdx.z;
  const int grp = Hq / Hkv;
  const int nq = Lq * grp;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane % LPT, tg = lane / LPT;

  // the row's group and prefix length, its queries and their limits (independent loads, issued together)
  const int g = __ldg(p.row_group + r);
  float qr[kQB][8];
  int lim[kQB];
  const int smax = load_queries<T, D, kQB>(q, p.q_limit, r, Lq, Hq, h, grp, qb, sub, Ms * bs, p.scale_log2, qr, lim);
  const int plen = g >= 0 ? max(0, min(__ldg(p.prefix_len + g), Mp * bs)) : 0;
  const int t_lo = split * split_tokens;
  const int t_hi = min(t_lo + split_tokens, plen + smax);

  // the split's pool rows, one round of table loads for the whole CTA
  for (int i = tid; i < split_tokens; i += kThreads) {
    const int t = t_lo + i;
    int64_t row = -1;
    if (t < t_hi) {
      const int u = t < plen ? t : t - plen;
      const int blk = t < plen ? __ldg(p.prefix_table + (int64_t)g * Mp + u / bs)
                               : __ldg(p.suffix_table + (int64_t)r * Ms + u / bs);
      if (blk >= 0) row = (int64_t)blk * 2 * bs + u % bs;
    }
    stage_row[i] = row;
  }
  __syncthreads();

  const int64_t token_stride = (int64_t)Hkv * D;     // between pool rows
  const int64_t kv_stride = (int64_t)bs * Hkv * D;   // V after K inside a block
  const uint4 zero4 = {};
  float m[kQB], l[kQB], o[kQB][8];
  empty_state(m, l, o);
  auto load_tok = [&](int t, uint4& kk, uint4& vv) -> bool {
    kk = zero4;
    vv = zero4;
    if (t >= t_hi) return false;
    const int64_t row = stage_row[t - t_lo];
    if (row < 0) return false;
    const T* src = pool + row * token_stride + (int64_t)h * D + sub * 8;
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
      const float s = token_score<LPT>(qr[qi], kf);  // every lane takes part
      if (ok && t < plen + lim[qi]) online_add(m[qi], l[qi], o[qi], s, vf);
    }
  };

  // the loop condition is uniform over the warp (tb does not depend on the lane)
  for (int tb = t_lo + warp * TPW; tb < t_hi; tb += kU * STEP) {
    uint4 kk[kU], vv[kU];
    bool ok[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) ok[u] = load_tok(tb + u * STEP + tg, kk[u], vv[u]);
#pragma unroll
    for (int u = 0; u < kU; ++u) process(kk[u], vv[u], ok[u], tb + u * STEP + tg);
  }

  // the TPW token groups of the warp, then each warp's state for the CTA's (csrc/include/hfc/row_state.cuh)
  fold_token_groups<kQB, LPT>(m, l, o);
  if (tg == 0) stash_warp_state(red_o, red_m, red_l, warp, sub, m, l, o);
  __syncthreads();
  const int64_t total = (int64_t)R * Lq * Hq;  // partial items per slot
  for (int idx = tid; idx < kQB * D; idx += kThreads) {
    const int qi = idx / D, d = idx % D;
    const int qidx = qb * kQB + qi;
    if (qidx >= nq) continue;
    float mx, L, O;
    cta_state(red_o, red_m, red_l, qi, d, mx, L, O);
    const bool any = L > 0.0f;
    const int lq = qidx / grp, j = qidx - lq * grp;
    const int64_t item = (int64_t)split * total + ((int64_t)r * Lq + lq) * Hq + (int64_t)h * grp + j;
    part_o[item * D + d] = any ? O / L : 0.0f;
    if (d == 0) part_lse[item] = any ? mx + log2f(L) : neg_inf();
  }

  // the last CTA of (query block, KV head, row) merges: each CTA's partial is visible device-wide before it counts
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int* counter = p.counters + ((int64_t)r * Hkv + h) * nqb + qb;
    const int done = atomicAdd(counter, 1);
    last_cta = done == nsplit - 1;
    if (last_cta) *counter = 0;  // every CTA of the group has counted: the next launch starts from 0
  }
  __syncthreads();
  if (!last_cta) return;
  __threadfence();
  // one warp per query of the CTA (kQB == kWarps), lanes over D as in csrc/merge.cu; the slots through L2
  static_assert(kWarps == kQB, "the merge takes one warp per query of the CTA");
  constexpr int EPL = D / 32;
  const int qidx = qb * kQB + warp;
  if (qidx >= nq) return;  // the whole warp
  const int lq = qidx / grp, j = qidx - lq * grp;
  const int64_t item = ((int64_t)r * Lq + lq) * Hq + (int64_t)h * grp + j;
  const RowSlots slots{0, 0, 0, 0};
  const float mx = warp_max_lse<true>(part_lse, total, item, slots, nsplit, lane);
  float acc[EPL];
#pragma unroll
  for (int e = 0; e < EPL; ++e) acc[e] = 0.0f;
  float wsum = 0.0f;
  if (mx != neg_inf()) {
    merge_slots<EPL, true, kMergeAhead>(part_lse, total, item, slots, nsplit, mx, wsum, acc, [&](int64_t at, float (&v)[EPL]) {
      const float* src = part_o + at * D + lane * EPL;
#pragma unroll
      for (int e = 0; e < EPL; ++e) v[e] = __ldcg(src + e);
    });
  }
  const float inv = merge_norm(wsum);
  T* dst = static_cast<T*>(p.out) + item * D + lane * EPL;
#pragma unroll
  for (int e = 0; e < EPL; ++e) dst[e] = Cvt<T>::from_float(acc[e] * inv);
}

template <typename T, int D>
cudaError_t launch_t(const hfc_solo_params& p, cudaStream_t stream) {
  const long long nqb = (p.Lq * (p.Hq / p.Hkv) + kQB - 1) / kQB;
  const long long gx = p.nsplit * nqb;
  if (!fits_int(gx) || p.Hkv > 65535 || p.R > 65535) return cudaErrorInvalidConfiguration;
  solo_kernel<T, D><<<dim3((unsigned)gx, (unsigned)p.Hkv, (unsigned)p.R), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t solo_launch(const hfc_solo_params& p, cudaStream_t stream) {
  if (!fits_int(p.R) || !fits_int(p.Lq) || !fits_int(p.Hq) || !fits_int(p.Hkv) || !fits_int(p.block_size) ||
      !fits_int(p.G) || !fits_int(p.Mp) || !fits_int(p.Ms) || !fits_int(p.split_tokens) || !fits_int(p.nsplit) ||
      !fits_int(p.R * p.Lq * p.Hq) || !fits_int((p.Mp + p.Ms) * p.block_size))
    return fail(cudaErrorInvalidValue, "solo: a size exceeds int");
  if (p.Hkv < 1 || p.Hq % p.Hkv != 0 || p.block_size < 1 || p.Lq < 1)
    return fail(cudaErrorInvalidValue, "solo: Hq %lld is not a multiple of Hkv %lld, or block_size / Lq < 1",
                (long long)p.Hq, (long long)p.Hkv);
  if (p.split_tokens < 1 || p.split_tokens > kMaxSplit || p.nsplit < 1 ||
      p.split_tokens * p.nsplit < (p.Mp + p.Ms) * p.block_size)
    return fail(cudaErrorInvalidValue, "solo: %lld splits of %lld tokens (1 to %d) must cover the tables' %lld tokens",
                (long long)p.nsplit, (long long)p.split_tokens, kMaxSplit, (long long)((p.Mp + p.Ms) * p.block_size));
  if (p.counters == nullptr || p.out == nullptr || p.row_group == nullptr)
    return fail(cudaErrorInvalidValue, "solo: counters, out and row_group are required");
  if (p.R == 0) return cudaSuccess;
  HFC_DISPATCH_DTYPE(p.dtype, T, HFC_DISPATCH_HEAD_DIM(p.head_dim, D, return launch_t<T, D>(p, stream);))
}

}  // namespace hfc
