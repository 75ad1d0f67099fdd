// Level 1, each row's own suffix: a row's queries against its own paged tokens, on CUDA cores. Semantics:
// hf_cascade/kernels/reference.py (suffix_attention); layouts: csrc/include/hfc/params.h.
//
// Grid: one CTA per (suffix split x query block, KV head, row). A CTA takes up to kQB = 4 query vectors of the row
// for that KV head against the row's suffix tokens [split range), query (lq) seeing the first q_limit[r, lq] of
// them. Each token is read by D/8 lanes (16 bytes each), several tokens per warp, online softmax per lane group,
// warp and CTA reductions at the end. Writes one partial into slot `slot0 + split`; or, with the merge fused in
// (hfc_suffix_params.fuse_merge, one split), merges it as the row's last partial with the row's prefix partials and
// writes the output (csrc/include/hfc/merge_math.cuh: the merge kernel's steps in its order), saving the merge's
// launch and the round trip of the suffix partial.

#include "hfc/common.cuh"
#include "hfc/dispatch.h"
#include "hfc/launch.h"
#include "hfc/merge_math.cuh"
#include "hfc/row_state.cuh"

#include <type_traits>

namespace hfc {
namespace {

constexpr int kQB = 4;  // query vectors per CTA (SUFFIX_QB in hf_cascade/kernels/cuda_tuning.py)

// VAR: the per-layer variants compiled in (the plain instantiation is the code from before them). cap_out > 0:
// softcap, logit = cap_out x tanh(cap_in x s) with s the log2-domain dot product; window > 0: query lq sees
// the suffix tokens [q_limit - window, q_limit). F8: the pool holds float8_e4m3fn (HFC_KV_FP8_E4M3): a lane loads
// its 8 elements as 8 bytes and converts them; K's scale of the CTA's KV head joins the query's, V's the output's.
// FUSE: the merge fused in (nsplit 1): the output instead of a partial (the instantiations without it are the code
// from before it).
template <typename T, int D, bool VAR, bool F8 = false, bool FUSE = false>
__global__ void __launch_bounds__(kThreads) suffix_kernel(const __grid_constant__ hfc_suffix_params p) {
  using KV = std::conditional_t<F8, uint8_t, T>;     // a pool element
  using Raw = std::conditional_t<F8, uint2, uint4>;  // a lane's 8 elements of one token
  const T* __restrict__ q = static_cast<const T*>(p.q);
  const KV* __restrict__ pool = static_cast<const KV*>(p.pool);
  const int* __restrict__ suffix_table = p.suffix_table;
  const int* __restrict__ q_limit = p.q_limit;
  float* __restrict__ part_o = p.part_o;
  float* __restrict__ part_lse = p.part_lse;
  const int R = (int)p.R, Lq = (int)p.Lq, Hq = (int)p.Hq, Hkv = (int)p.Hkv, bs = (int)p.block_size, Ms = (int)p.Ms;
  const int split_tokens = (int)p.split_tokens, slot0 = (int)p.slot0, window = (int)p.window;
  const float scale_log2 = p.scale_log2;
  const int nqb = (Lq * (Hq / Hkv) + kQB - 1) / kQB;  // query blocks per (row, KV head): the grid's x / nsplit
  // softcap: s is scale x q.k x log2(e); cap x tanh(scale q.k / cap) x log2(e) (in double, as the host did before)
  float cap_in = 0.0f, cap_out = 0.0f;
  if constexpr (VAR) {
    if (p.softcap > 0.0f) {
      cap_in = (float)(0.6931471805599453 / p.softcap);
      cap_out = (float)(p.softcap * 1.4426950408889634);
    }
  }
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
  float k_scale = 1.0f, v_scale = 1.0f;  // the dequantisation scales of this KV head (F8)
  if constexpr (F8) {
    k_scale = __ldg(p.kv_scale + h);
    v_scale = __ldg(p.kv_scale + Hkv + h);
  }

  float qr[kQB][8];
  int lim[kQB];
  const int tmax = load_queries<T, D, kQB>(q, q_limit, r, Lq, Hq, h, grp, qb, sub, cap,
                                           F8 ? scale_log2 * k_scale : scale_log2, qr, lim);
  int t_lo = split * split_tokens;
  const int t_hi = min(t_lo + split_tokens, tmax);
  if constexpr (VAR) {
    if (window > 0) {  // start at the earliest token a query of the CTA sees (query qi: lim[qi] - window on)
      int tmin = 0x7fffffff;  // the same in every thread (all read the same q_limit): no reduction needed
#pragma unroll
      for (int qi = 0; qi < kQB; ++qi)
        if (qb * kQB + qi < nq) tmin = min(tmin, lim[qi] - window);
      t_lo = max(t_lo, tmin);
    }
  }
  const int* table = suffix_table + (int64_t)r * Ms;
  const int64_t slot_stride = (int64_t)Hkv * D;
  const int64_t kv_stride = (int64_t)bs * Hkv * D;
  const Raw zero4 = {};

  float m[kQB], l[kQB], o[kQB][8];
  empty_state(m, l, o);

  auto load_tok = [&](int t, Raw& kk, Raw& vv) -> bool {
    kk = zero4;
    vv = zero4;
    if (t >= t_hi) return false;
    const int blk = __ldg(table + t / bs);
    if (blk < 0) return false;
    const KV* src = pool + ((int64_t)blk * 2 * bs + (t % bs)) * slot_stride + (int64_t)h * D + sub * 8;
    kk = __ldg(reinterpret_cast<const Raw*>(src));
    vv = __ldg(reinterpret_cast<const Raw*>(src + kv_stride));
    return true;
  };
  auto process = [&](const Raw& kk, const Raw& vv, bool ok, int t) {
    float kf[8], vf[8];
    if constexpr (F8) {
      fp8x8_to_float(kk, kf);
      fp8x8_to_float(vv, vf);
    } else {
      Cvt<T>::unpack8(kk, kf);
      Cvt<T>::unpack8(vv, vf);
    }
#pragma unroll
    for (int qi = 0; qi < kQB; ++qi) {
      float s = token_score<LPT>(qr[qi], kf);  // every lane takes part
      bool sees = ok && t < lim[qi];
      if constexpr (VAR) {
        if (cap_out > 0.0f) s = cap_out * tanhf(s * cap_in);
        sees = sees && (window <= 0 || t + window >= lim[qi]);
      }
      if (sees) online_add(m[qi], l[qi], o[qi], s, vf);
    }
  };

  // the loop condition is uniform over the warp (tb does not depend on the lane)
  for (int tb = t_lo + warp * TPW; tb < t_hi; tb += 2 * STEP) {
    Raw k0, v0, k1, v1;
    const int t0 = tb + tg, t1 = tb + STEP + tg;
    const bool ok0 = load_tok(t0, k0, v0);
    const bool ok1 = load_tok(t1, k1, v1);
    process(k0, v0, ok0, t0);
    process(k1, v1, ok1, t1);
  }

  // the TPW token groups of the warp, then each warp's state for the CTA's (csrc/include/hfc/row_state.cuh)
  fold_token_groups<kQB, LPT>(m, l, o);
  if (tg == 0) stash_warp_state(red_o, red_m, red_l, warp, sub, m, l, o);
  if constexpr (FUSE) {
    // the merge kernel's steps (csrc/include/hfc/merge_math.cuh) per (query, d): the row's prefix slots, its middle
    // slots, then this CTA's suffix state as the last partial (the values the unfused kernel writes), against the
    // maximum over all of them and the sink. First the maximum of the slots and the sink, one warp per query as the
    // merge kernel's warp finds it (the suffix LSE joins it per element below).
    static_assert(kWarps == kQB, "the fused merge takes one warp per query of the CTA for its maximum");
    __shared__ float slots_mx[kQB];
    const int64_t total = (int64_t)R * Lq * Hq;
    const int npre = __ldg(p.row_nchunks + r);
    const int nmid = p.row_nmid != nullptr ? __ldg(p.row_nmid + r) : 0;
    const RowSlots slots{npre, nmid, (int)p.mid_slot0, 0};
    const int qidx_w = qb * kQB + warp;
    if (qidx_w < nq) {  // the whole warp
      const int lq = qidx_w / grp, j = qidx_w - lq * grp;
      const int64_t item = ((int64_t)r * Lq + lq) * Hq + (int64_t)h * grp + j;
      const float mx = warp_max_lse(part_lse, total, item, slots, npre + nmid, lane);
      if (lane == 0) slots_mx[warp] = fmaxf(mx, sink_lse(p.sinks, h * grp + j));
    }
    __syncthreads();
    T* __restrict__ out = static_cast<T*>(p.out);
    for (int idx = tid; idx < kQB * D; idx += kThreads) {
      const int qi = idx / D, d = idx % D;
      const int qidx = qb * kQB + qi;
      if (qidx >= nq) continue;
      float mx, L, O;
      cta_state(red_o, red_m, red_l, qi, d, mx, L, O);
      const bool any = L > 0.0f;
      const float lse_s = any ? mx + log2f(L) : neg_inf();
      const float o_s[1] = {any ? (F8 ? O / L * v_scale : O / L) : 0.0f};
      const int lq = qidx / grp, j = qidx - lq * grp;
      const int64_t item = ((int64_t)r * Lq + lq) * Hq + (int64_t)h * grp + j;
      const float m_all = fmaxf(slots_mx[qi], lse_s);
      float acc[1] = {0.0f};
      float wsum = 0.0f;
      if (m_all != neg_inf()) {
        const float sink = sink_lse(p.sinks, h * grp + j);
        if (sink != neg_inf()) wsum = exp2f(sink - m_all);  // the sink's weight, with no value
        merge_slots(part_lse, total, item, slots, npre + nmid, m_all, wsum, acc,
                    [&](int64_t at, float (&v)[1]) { v[0] = part_o[at * D + d]; });
        if (lse_s != neg_inf()) merge_add(lse_s, o_s, m_all, wsum, acc);
      }
      out[item * D + d] = Cvt<T>::from_float(acc[0] * merge_norm(wsum));
    }
  } else {
    __syncthreads();
    for (int idx = tid; idx < kQB * D; idx += kThreads) {
      const int qi = idx / D, d = idx % D;
      const int qidx = qb * kQB + qi;
      if (qidx >= nq) continue;
      float mx, L, O;
      cta_state(red_o, red_m, red_l, qi, d, mx, L, O);
      const bool any = L > 0.0f;
      const int lq = qidx / grp, j = qidx - lq * grp;
      const int64_t item = (((int64_t)(slot0 + split) * R + r) * Lq + lq) * Hq + (int64_t)h * grp + j;
      part_o[item * D + d] = any ? (F8 ? O / L * v_scale : O / L) : 0.0f;
      if (d == 0) part_lse[item] = any ? mx + log2f(L) : neg_inf();
    }
  }
}

template <typename T, int D, bool FUSE>
void launch_kernel(const hfc_suffix_params& p, dim3 grid, cudaStream_t stream) {
  const bool var = p.softcap > 0.0f || p.window > 0;
  if (p.kv_dtype == HFC_KV_FP8_E4M3)
    (var ? suffix_kernel<T, D, true, true, FUSE>
         : suffix_kernel<T, D, false, true, FUSE>)<<<grid, kThreads, 0, stream>>>(p);
  else
    (var ? suffix_kernel<T, D, true, false, FUSE>
         : suffix_kernel<T, D, false, false, FUSE>)<<<grid, kThreads, 0, stream>>>(p);
}

template <typename T, int D>
cudaError_t launch_t(const hfc_suffix_params& p, cudaStream_t stream) {
  const int nqb = (int)((p.Lq * (p.Hq / p.Hkv) + kQB - 1) / kQB);
  const long long gx = (long long)p.nsplit * nqb;
  if (!fits_int(gx) || p.Hkv > 65535 || p.R > 65535) return cudaErrorInvalidConfiguration;
  dim3 grid((unsigned)gx, (unsigned)p.Hkv, (unsigned)p.R);
  if (p.fuse_merge)
    launch_kernel<T, D, true>(p, grid, stream);
  else
    launch_kernel<T, D, false>(p, grid, stream);
  return cudaGetLastError();
}

}  // namespace

cudaError_t suffix_launch(const hfc_suffix_params& p, cudaStream_t stream) {
  if (!fits_int(p.R) || !fits_int(p.Lq) || !fits_int(p.Hq) || !fits_int(p.Hkv) || !fits_int(p.block_size) ||
      !fits_int(p.Ms) || !fits_int(p.split_tokens) || !fits_int(p.nsplit) || !fits_int(p.slot0) ||
      !fits_int(p.Ms * p.block_size))
    return cudaErrorInvalidValue;
  if (p.Hkv < 1 || p.Hq % p.Hkv != 0 || p.block_size < 1 || p.split_tokens < 1 || p.nsplit < 1 || p.Lq < 1)
    return cudaErrorInvalidValue;
  if (p.window < 0 || !(p.softcap >= 0.0f)) return cudaErrorInvalidValue;
  if (p.kv_dtype != HFC_KV_SAME && p.kv_dtype != HFC_KV_FP8_E4M3)
    return fail(cudaErrorInvalidValue, "suffix: kv_dtype code %d (compiled: %d the queries' dtype, %d float8_e4m3fn)",
                (int)p.kv_dtype, HFC_KV_SAME, HFC_KV_FP8_E4M3);
  if (p.kv_dtype == HFC_KV_FP8_E4M3 && p.kv_scale == nullptr)
    return fail(cudaErrorInvalidValue, "suffix: a float8_e4m3fn pool needs kv_scale");
  if (p.fuse_merge != 0) {
    if (p.fuse_merge != 1)
      return fail(cudaErrorInvalidValue, "suffix: fuse_merge %d (0: off, 1: the merge fused in)", (int)p.fuse_merge);
    if (p.nsplit != 1)
      return fail(cudaErrorInvalidValue, "suffix: the fused merge takes one suffix split, got nsplit %lld (launch "
                  "the suffix unfused and the merge kernel after it)", (long long)p.nsplit);
    if (p.row_nchunks == nullptr || p.out == nullptr)
      return fail(cudaErrorInvalidValue, "suffix: the fused merge needs row_nchunks and out");
    if (!fits_int(p.mid_slot0) || !fits_int(p.R * p.Lq * p.Hq))
      return fail(cudaErrorInvalidValue, "suffix: the fused merge's mid_slot0 %lld or R x Lq x Hq %lld exceeds int",
                  (long long)p.mid_slot0, (long long)(p.R * p.Lq * p.Hq));
  }
  if (p.R == 0) return cudaSuccess;
  HFC_DISPATCH_DTYPE(p.dtype, T, HFC_DISPATCH_HEAD_DIM(p.head_dim, D, return launch_t<T, D>(p, stream);))
}

}  // namespace hfc
