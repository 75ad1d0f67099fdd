// The log-sum-exp merge of partials (O, LSE base 2) into one output: which slots a row merges and in what order, the
// maximum, each partial's weight and the final scale. csrc/merge.cu runs it per (row, query, head); the suffix
// kernel's fused epilogue (csrc/suffix.cu, hfc_suffix_params.fuse_merge) runs the same steps in the same order with
// its own suffix state as the row's last partial, so that the fused output equals suffix + merge.
// Semantics: hf_cascade/kernels/reference.py (merge_state, merge_sink).
#pragma once

#include "hfc/common.cuh"

namespace hfc {

// A row's partial slots in merge order: its prefix chunks [0, npre), its middle-level chunks [mid_slot0, mid_slot0 +
// nmid) (three levels), then its suffix splits [slot0, ...).
struct RowSlots {
  int npre, nmid, mid_slot0, slot0;
  __device__ __forceinline__ int operator()(int s) const {
    return s < npre ? s : s < npre + nmid ? mid_slot0 + (s - npre) : slot0 + (s - npre - nmid);
  }
};

// An attention sink as one more partial's LSE (O = 0): sinks[hq] (natural log) in base 2; -inf without sinks.
__device__ __forceinline__ float sink_lse(const float* sinks, int hq) {
  return sinks != nullptr ? sinks[hq] * 1.4426950408889634f : neg_inf();
}

// A partial's LSE: through L2 where other CTAs of the same launch wrote it (L2: csrc/solo.cu's last CTA), else a
// plain load.
template <bool L2>
__device__ __forceinline__ float load_lse(const float* at) {
  if constexpr (L2) return __ldcg(at);
  return *at;
}

// The warp's maximum LSE of item's slots [0, nslots) (lanes stride over them; every lane of the warp must call it).
template <bool L2 = false>
__device__ __forceinline__ float warp_max_lse(const float* part_lse, int64_t total, int64_t item, const RowSlots& slots,
                                              int nslots, int lane) {
  float mx = neg_inf();
  for (int s = lane; s < nslots; s += 32) mx = fmaxf(mx, load_lse<L2>(part_lse + (int64_t)slots(s) * total + item));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, off));
  return mx;
}

// One partial (lse > -inf, N values of its o) into the weight sum and the accumulators, against the maximum mx.
template <int N>
__device__ __forceinline__ void merge_add(float lse, const float (&o)[N], float mx, float& wsum, float (&acc)[N]) {
  const float w = exp2f(lse - mx);
  wsum += w;
#pragma unroll
  for (int e = 0; e < N; ++e) acc[e] = fmaf(w, o[e], acc[e]);
}

// item's slots [0, nslots) in order into wsum and acc (empty partials skipped); load(at, v) reads the N values of
// slot-item `at` (at x D + the caller's offset) that the caller accumulates. kAhead slots at a time, the last round
// too: their LSEs and values are loaded together, then added in slot order (a row of a 16k prefix has 33 slots; the
// merge's time is these rounds' memory latency, so 8 a round: 5 rounds there, where 4 a round and one at a time for
// the rest took 9 and 2 loads waited on per leftover slot). Every slot of a row is written by the step's kernels (an
// empty one with values 0), so loading an empty slot's values is in bounds.
template <int N, bool L2 = false, int kAhead = 8, typename Load>
__device__ __forceinline__ void merge_slots(const float* part_lse, int64_t total, int64_t item, const RowSlots& slots,
                                            int nslots, float mx, float& wsum, float (&acc)[N], Load load) {
  for (int s = 0; s < nslots; s += kAhead) {
    float lse[kAhead], v[kAhead][N];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      lse[u] = neg_inf();
      if (s + u < nslots) {  // the same for every thread of an item
        const int64_t at = (int64_t)slots(s + u) * total + item;
        lse[u] = load_lse<L2>(part_lse + at);
        load(at, v[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u)
      if (lse[u] != neg_inf()) merge_add(lse[u], v[u], mx, wsum, acc);  // the same for every thread of an item
  }
}

// The factor of the accumulators: 1 / wsum, or 0 where nothing was seen (all -inf and no sink: 0, never NaN).
__device__ __forceinline__ float merge_norm(float wsum) { return wsum > 0.0f ? 1.0f / wsum : 0.0f; }

}  // namespace hfc
