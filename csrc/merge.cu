// Merge: the log-sum-exp of a row's partials (its prefix chunks' slots [0, row_nchunks[r]), with three levels its
// middle-level chunks' slots [mid_slot0, mid_slot0 + row_nmid[r]), and its suffix slots [slot0, slot0 + nsplit))
// into the output in q's dtype; one warp per (row, query, head). An attention sink is one more partial (O = 0,
// LSE = sinks[h] x log2 e): it joins the maximum and the weight sum only. All -inf (and no sink) -> 0, never NaN.
// The merge's math (slot order, weights): csrc/include/hfc/merge_math.cuh, shared with the suffix kernel's fused
// epilogue. Semantics: hf_cascade/kernels/reference.py (merge_state, merge_sink); layouts: csrc/include/hfc/params.h.

#include "hfc/common.cuh"
#include "hfc/dispatch.h"
#include "hfc/launch.h"
#include "hfc/merge_math.cuh"

namespace hfc {
namespace {

// EXTRA: middle-level slots and/or sinks compiled in (the plain instantiation is the code from before them)
template <typename T, int D, bool EXTRA>
__global__ void __launch_bounds__(kThreads) merge_kernel(const __grid_constant__ hfc_merge_params p) {
  const float* __restrict__ part_o = p.part_o;
  const float* __restrict__ part_lse = p.part_lse;
  const int* __restrict__ row_nchunks = p.row_nchunks;
  T* __restrict__ out = static_cast<T*>(p.out);
  const int* __restrict__ row_nmid = p.row_nmid;
  const float* __restrict__ sinks = p.sinks;
  const int Lq = (int)p.Lq, Hq = (int)p.Hq, slot0 = (int)p.slot0, nsplit = (int)p.nsplit;
  const int mid_slot0 = (int)p.mid_slot0;
  const int64_t total = (int64_t)(int)p.R * Lq * Hq;
  constexpr int EPL = D / 32;  // elements per lane: 2, 4, 8
  const int64_t item = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (item >= total) return;  // whole warp
  const int lane = threadIdx.x & 31;
  const int r = (int)(item / ((int64_t)Lq * Hq));
  const int npre = row_nchunks[r];
  // slot s of the row's list: prefix chunks, then (three levels) middle chunks, then suffix splits
  const int nmid = (EXTRA && row_nmid != nullptr) ? row_nmid[r] : 0;
  const int nslots = npre + nmid + nsplit;
  const RowSlots slots{npre, nmid, mid_slot0, slot0};

  float mx = warp_max_lse(part_lse, total, item, slots, nslots, lane);
  const float sink = EXTRA ? sink_lse(sinks, (int)(item % Hq)) : neg_inf();
  if (EXTRA) mx = fmaxf(mx, sink);

  float acc[EPL];
#pragma unroll
  for (int e = 0; e < EPL; ++e) acc[e] = 0.0f;
  float wsum = 0.0f;
  if (mx != neg_inf()) {
    if (EXTRA && sink != neg_inf()) wsum = exp2f(sink - mx);  // the sink's weight, with no value
    merge_slots(part_lse, total, item, slots, nslots, mx, wsum, acc, [&](int64_t at, float (&v)[EPL]) {
      const float* src = part_o + at * D + lane * EPL;
      if constexpr (EPL == 2) {
        const float2 v2 = *reinterpret_cast<const float2*>(src);
        v[0] = v2.x;
        v[1] = v2.y;
      } else {
#pragma unroll
        for (int e4 = 0; e4 < EPL / 4; ++e4) {
          const float4 v4 = *reinterpret_cast<const float4*>(src + e4 * 4);
          v[e4 * 4 + 0] = v4.x;
          v[e4 * 4 + 1] = v4.y;
          v[e4 * 4 + 2] = v4.z;
          v[e4 * 4 + 3] = v4.w;
        }
      }
    });
  }
  const float inv = merge_norm(wsum);
  T* dst = out + item * D + lane * EPL;
#pragma unroll
  for (int e = 0; e < EPL; ++e) dst[e] = Cvt<T>::from_float(acc[e] * inv);
}

template <typename T, int D>
cudaError_t launch_t(const hfc_merge_params& p, cudaStream_t stream) {
  const long long items = (long long)p.R * p.Lq * p.Hq;
  const long long blocks = (items + kWarps - 1) / kWarps;
  if (!fits_int(blocks)) return cudaErrorInvalidConfiguration;
  const bool extra = p.row_nmid != nullptr || p.sinks != nullptr;
  (extra ? merge_kernel<T, D, true> : merge_kernel<T, D, false>)<<<(unsigned)blocks, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t merge_launch(const hfc_merge_params& p, cudaStream_t stream) {
  if (!fits_int(p.R) || !fits_int(p.Lq) || !fits_int(p.Hq) || !fits_int(p.slot0) || !fits_int(p.nsplit) ||
      !fits_int(p.R * p.Lq * p.Hq) || !fits_int(p.mid_slot0))
    return cudaErrorInvalidValue;
  if (p.R == 0 || p.Lq == 0 || p.Hq == 0) return cudaSuccess;
  HFC_DISPATCH_DTYPE(p.dtype, T, HFC_DISPATCH_HEAD_DIM(p.head_dim, D, return launch_t<T, D>(p, stream);))
}

}  // namespace hfc
