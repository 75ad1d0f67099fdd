// The per-row decode state of the CUDA-core kernels (csrc/suffix.cu, csrc/solo.cu): a CTA holds kQB query vectors of
// one KV head, each lane group of LPT lanes reads a token (8 elements a lane) and keeps an online softmax (log2
// domain: maximum m, weight sum l, output sum o over its 8 elements) per query: load_queries, empty_state, then per token and query
// token_score and online_add. After the token loop, the warp's TPW lane groups are folded (fold_token_groups), each
// warp leaves its state in shared memory (stash_warp_state), and the CTA's state of one (query, element) is its warps'
// merged (cta_state).
#pragma once

#include "hfc/common.cuh"

namespace hfc {

// The CTA's queries: query block qb's kQB query vectors of row r and KV head h (those past the nq of a head group
// zero, seeing nothing), this lane's 8 elements each times `scale`, and how many suffix tokens each sees (q_limit
// within [0, cap]). Returns the most any of them sees.
template <typename T, int D, int QB>
__device__ __forceinline__ int load_queries(const T* __restrict__ q, const int* __restrict__ q_limit, int r, int Lq,
                                            int Hq, int h, int grp, int qb, int sub, int cap, float scale,
                                            float (&qr)[QB][8], int (&lim)[QB]) {
  const int nq = Lq * grp;
  int most = 0;
#pragma unroll
  for (int qi = 0; qi < QB; ++qi) {
    const int qidx = qb * QB + qi;
    lim[qi] = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) qr[qi][e] = 0.0f;
    if (qidx < nq) {
      const int lq = qidx / grp, j = qidx - lq * grp;
      lim[qi] = max(0, min(__ldg(q_limit + (int64_t)r * Lq + lq), cap));
      most = max(most, lim[qi]);
      const uint4 raw =
          __ldg(reinterpret_cast<const uint4*>(q + (((int64_t)r * Lq + lq) * Hq + (int64_t)h * grp + j) * D + sub * 8));
      Cvt<T>::unpack8(raw, qr[qi]);
#pragma unroll
      for (int e = 0; e < 8; ++e) qr[qi][e] *= scale;
    }
  }
  return most;
}

// No token seen yet: m = -inf, l = 0, o = 0.
template <int QB>
__device__ __forceinline__ void empty_state(float (&m)[QB], float (&l)[QB], float (&o)[QB][8]) {
#pragma unroll
  for (int qi = 0; qi < QB; ++qi) {
    m[qi] = neg_inf();
    l[qi] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[qi][e] = 0.0f;
  }
}

// A query's score of a token: its 8 elements' products with the token's K summed over the LPT lanes of the group
// (shuffles over the whole warp: every lane must call it).
template <int LPT>
__device__ __forceinline__ float token_score(const float (&q)[8], const float (&k)[8]) {
  float s = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) s = fmaf(q[e], k[e], s);
#pragma unroll
  for (int off = LPT / 2; off > 0; off >>= 1) s += __shfl_xor_sync(kFull, s, off);
  return s;
}

// A seen token of score s and values v into a query's state.
__device__ __forceinline__ void online_add(float& m, float& l, float (&o)[8], float s, const float (&v)[8]) {
  const float mn = fmaxf(m, s);
  const float a = exp2f(m - mn);  // m = -inf -> 0
  const float p = exp2f(s - mn);
  l = l * a + p;
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = fmaf(o[e], a, p * v[e]);
  m = mn;
}

// The warp's token groups (lanes sub, sub + LPT, ...) merged into every lane of the group: shuffles over the whole
// warp, so every lane must call it.
template <int QB, int LPT>
__device__ __forceinline__ void fold_token_groups(float (&m)[QB], float (&l)[QB], float (&o)[QB][8]) {
#pragma unroll
  for (int off = LPT; off < 32; off <<= 1) {
#pragma unroll
    for (int qi = 0; qi < QB; ++qi) {
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
}

// Each warp's folded state in shared memory: red_o[warp][query][element], red_m / red_l[warp][query] (the kernel's
// __shared__ arrays). The warp's state goes in from the lanes of token group 0 (lane `sub` holds elements sub x 8 ...).
template <int QB, int D>
__device__ __forceinline__ void stash_warp_state(float (&red_o)[kWarps][QB][D], float (&red_m)[kWarps][QB],
                                                 float (&red_l)[kWarps][QB], int warp, int sub, const float (&m)[QB],
                                                 const float (&l)[QB], const float (&o)[QB][8]) {
#pragma unroll
  for (int qi = 0; qi < QB; ++qi) {
#pragma unroll
    for (int e = 0; e < 8; ++e) red_o[warp][qi][sub * 8 + e] = o[qi][e];
    if (sub == 0) {
      red_m[warp][qi] = m[qi];
      red_l[warp][qi] = l[qi];
    }
  }
}

// The CTA's state of query qi at element d, its warps' merged: maximum mx, weight sum L, output sum O.
template <int QB, int D>
__device__ __forceinline__ void cta_state(const float (&red_o)[kWarps][QB][D], const float (&red_m)[kWarps][QB],
                                          const float (&red_l)[kWarps][QB], int qi, int d, float& mx, float& L,
                                          float& O) {
  mx = neg_inf();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, red_m[w][qi]);
  L = 0.0f;
  O = 0.0f;
  if (mx != neg_inf()) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = red_m[w][qi];
      const float a = (mw == neg_inf()) ? 0.0f : exp2f(mw - mx);
      L += a * red_l[w][qi];
      O += a * red_o[w][qi][d];
    }
  }
}

}  // namespace hfc
