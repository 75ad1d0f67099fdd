// The token choice's bookkeeping of one decode step in one or two launches: what hf_cascade/decode/device_select.py
// `_sample_step` / `_beam_step` and hf_cascade/decode/whole_step.py `choose` run as ~30 (greedy, sampling) and ~75
// (beam search) tiny torch kernels on [rows] and [batch, candidates] tensors, value for value. The vocabulary-sized
// work (the float32 logits, processors, log-softmax, multinomial draws) stays torch's. Beam search's top-k's (the
// candidates over beams x vocabulary, then the two small ones) are torch.topk's between the launches, or, where the
// caller asks (hf_cascade/decode/whole_step.py select_topk), this file's in torch's own order on CUDA, ties included:
// topk_chunks + topk_final for the candidates, choose_beams inside beam_scores for the small ones.
//
// - sample_finish (greedy and sampling, one CTA): finished rows repeat the pad token, the token written at cur_len,
//   the stopping criteria (max length, eos), cur_len and done, the next step's ids, parents and positions.
// - beam_scores (beam search, before the two top-k's; one CTA): the candidates' tokens, parents and stopping hits, the
//   running scores (a hit pushed down by -1e9) and the finished store's merged scores (the length-penalised
//   candidates that may enter it, each excluded one pushed down by -1e9), and a snapshot of cur_len and done for
//   beam_finish (whose CTA 0 updates them while the others still read).
// - beam_finish (beam search, after them): CTA 0 the running and finished stores' scores, lengths and flags, the
//   sticky early-stop heuristic, cur_len, done, the next step's ids, parents and positions; every CTA a tile of the
//   sequence columns [prompt_len, cur_len] of both stores (the only columns a step changes: the prompt's are the same
//   in every beam of a prompt, the columns past cur_len hold the fill in every row), read before any is written.
//
// Floats are added, multiplied and compared as torch's ops do (hfc/rounding.cuh, whatever the build's fast math): the
// torch ops' bits. Semantics and the order of the roundings are device_select.py's; tests/decode/test_select_emulation.py
// runs this source on the CPU against it.

#include "hfc/errors.h"
#include "hfc/launch.h"
#include "hfc/rounding.cuh"

#include <cstdint>

namespace hfc {
namespace {

constexpr int kSelectThreads = 1024;   // thread i owns row i (a CTA's rows at most: launchers check)
constexpr float kNegScore = -1.0e9f;   // device_select.NEG_INF_SCORE: a candidate that cannot be chosen
constexpr int kMaxFinishCtas = 64;     // beam_finish's sequence tiles: a grid-stride loop over the new columns

// the bits of x
__device__ __forceinline__ uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  __builtin_memcpy(&bits, &x, sizeof bits);
  return bits;
#endif
}

// x is neither NaN nor infinite (read from its bits: no test of them left to fast math)
__device__ __forceinline__ bool finite(float x) { return (float_bits(x) & 0x7f800000u) != 0x7f800000u; }

// `flag_invalid`: a step that runs and drew from probabilities that are not all finite (their sum is not) sets it
__device__ __forceinline__ bool step_invalid(const uint8_t* invalid, const float* probs_total, bool active) {
  return *invalid || (active && probs_total != nullptr && !finite(*probs_total));
}

__device__ __forceinline__ bool is_eos(int64_t token, const int64_t* __restrict__ eos_ids, int64_t n_eos) {
  bool hit = false;
  for (int64_t e = 0; e < n_eos; ++e) hit |= token == eos_ids[e];
  return hit;
}

// `_divide_by_length` on a CUDA state: the score times the table's reciprocal of `generated ** length_penalty`,
// the length clamped into the table
__device__ __forceinline__ float by_length(float score, const float* __restrict__ factors, int64_t n_factors,
                                           int64_t generated) {
  const int64_t i = generated < 0 ? 0 : generated > n_factors - 1 ? n_factors - 1 : generated;
  return mul_rn(score, factors[i]);
}

// The next step's inputs: every position + 1 (`choose`)
__device__ __forceinline__ void advance_positions(const SelectNext& n, int t) {
  for (int64_t i = t; i < n.n_positions; i += kSelectThreads) n.positions[i] += 1;
  for (int64_t i = t; i < n.n_cache_position; i += kSelectThreads) n.cache_position[i] += 1;
}

__global__ void __launch_bounds__(kSelectThreads) sample_finish_kernel(const SampleFinishArgs a) {
  const int t = threadIdx.x;
  const bool active = !*a.done;
  const int64_t cur = *a.cur_len, W = a.width;
  const int64_t column = cur < W - 1 ? cur : W - 1;      // (clamped: it reaches W only once the call is done)
  const bool length_hit = cur + 1 >= *a.max_len;
  bool running = false;
  for (int64_t r = t; r < a.rows; r += kSelectThreads) {
    const bool unfinished = a.unfinished[r];
    int64_t token = a.tokens[r];
    if (a.n_eos > 0 && !unfinished) token = a.pad;         // finished rows repeat the pad token
    if (!active) token = a.fill;
    if (active) a.sequences[r * W + column] = token;
    const bool hit = length_hit || is_eos(token, a.eos_ids, a.n_eos);
    const bool still = unfinished && !(hit && active);
    a.unfinished[r] = still;
    running |= still;
    a.next.parents[r] = r;
    a.next.input_ids[r] = token < 0 ? 0 : token;
  }
  const bool any_running = __syncthreads_or(running);      // (every thread has read done and cur_len)
  if (t == 0) {
    const bool invalid = step_invalid(a.invalid, a.probs_total, active);
    *a.invalid = invalid;
    *a.cur_len = cur + (active ? 1 : 0);
    *a.done = !active || !any_running || invalid;
  }
  advance_positions(a.next, t);
}

// ---- beam search's two small top-k's as torch.topk(largest=True, sorted=True) orders them on CUDA, ties included ----
// torch (aten/src/ATen/native/cuda: TensorTopK.cu, SortUtils.cuh; k <= 32): the k-th largest value is found in a radix
// order of the float bits (NaN the largest, -0 below +0); the elements above it, then those equal to it, are gathered
// in index order (k in all); then sorted by a 32-slot bitonic network (16 threads x 2 slots, slots past k invalid)
// with GTOp<float, true> (NaN above all, then >). Here one CTA does it for every prompt's two lists: the running
// beams among the K candidates, the finished store's among its nb + K entries; kChooseGroup lists at a time.
constexpr int kSortSlots = 32;         // the bitonic network's slots (k <= 32)
constexpr int kChooseGroup = 32;       // lists ranked at once (shared memory: kChooseGroup x kMaxChooseInputs)
constexpr int kMaxChooseInputs = 128;  // a list's entries at most (nb + K)

__device__ __forceinline__ bool is_nan(float x) { return (float_bits(x) & 0x7fffffffu) > 0x7f800000u; }

// TopKTypeConfig<float>::convert: the radix order torch's selection uses
__device__ __forceinline__ uint32_t radix_key(float x) {
  const uint32_t bits = float_bits(x);
  return is_nan(x) ? 0xffffffffu : bits ^ ((bits & 0x80000000u) ? 0xffffffffu : 0x80000000u);
}

// GTOp<float, true>: a NaN above any number, else a > b
__device__ __forceinline__ bool gt_op(float a, float b) { return (is_nan(a) && !is_nan(b)) || greater(a, b); }

// bitonicSwap: invalid slots sort to the end; equal keys swap where the direction asks
__device__ __forceinline__ void bitonic_swap(float* key, int32_t* value, uint8_t* valid, int i, int j, bool dir) {
  const bool swap = (gt_op(key[i], key[j]) && valid[i]) || !valid[j];
  if (swap == dir) {
    const float k = key[i];
    key[i] = key[j], key[j] = k;
    const int32_t v = value[i];
    value[i] = value[j], value[j] = v;
    const uint8_t ok = valid[i];
    valid[i] = valid[j], valid[j] = ok;
  }
}

// bitonicSort<32> (SortUtils.cuh) of one list's slots, its network thread x < 16 (`mine`; the CTA's other threads
// pass mine = false): the same compare-exchanges in the same stages. Every thread of the CTA calls it (barriers).
__device__ __forceinline__ void bitonic_sort32(float* key, int32_t* value, uint8_t* valid, int x, bool mine) {
  for (int size = 2; size < kSortSlots; size *= 2) {
    const bool flag = (x & (size / 2)) != 0;
    for (int stride = size / 2; stride > 0; stride /= 2) {
      __syncthreads();
      const int pos = 2 * x - (x & (stride - 1));
      if (mine) bitonic_swap(key, value, valid, pos, pos + stride, flag);
    }
  }
  for (int stride = kSortSlots / 2; stride > 0; stride /= 2) {
    __syncthreads();
    const int pos = 2 * x - (x & (stride - 1));
    if (mine) bitonic_swap(key, value, valid, pos, pos + stride, false);
  }
  __syncthreads();
}

// next_indices [B, nb] (the top nb of running [B, K]) and keep [B, nb] (of merged [B, nb + K]), as torch.topk
__device__ void choose_beams(const BeamScoresArgs& a) {
  __shared__ uint32_t radix_s[kChooseGroup][kMaxChooseInputs];
  __shared__ uint8_t chosen_s[kChooseGroup][kMaxChooseInputs];
  __shared__ uint32_t kth_s[kChooseGroup];
  __shared__ float key_s[kChooseGroup][kSortSlots];
  __shared__ int32_t value_s[kChooseGroup][kSortSlots];
  __shared__ uint8_t valid_s[kChooseGroup][kSortSlots];
  const int t = threadIdx.x;
  const int nb = (int)a.beams, K = (int)a.candidates, width = nb + K;
  const int64_t lists = 2 * a.batch;        // list 2b: prompt b's running scores, 2b + 1: its merged ones
  for (int64_t l0 = 0; l0 < lists; l0 += kChooseGroup) {
    for (int item = t; item < kChooseGroup * width; item += kSelectThreads) {   // the entries' radix keys
      const int g = item / width, i = item % width;
      const int64_t l = l0 + g;
      const int n = l % 2 ? width : K;
      if (l < lists && i < n) {
        const float* x = l % 2 ? a.merged + (l / 2) * width : a.running + (l / 2) * K;
        radix_s[g][i] = radix_key(x[i]);
      }
    }
    for (int slot = t; slot < kChooseGroup * kSortSlots; slot += kSelectThreads) {
      key_s[slot / kSortSlots][slot % kSortSlots] = 0.0f;
      value_s[slot / kSortSlots][slot % kSortSlots] = 0;
      valid_s[slot / kSortSlots][slot % kSortSlots] = 0;
    }
    __syncthreads();
    for (int item = t; item < kChooseGroup * width; item += kSelectThreads) {   // chosen: among the nb first by
      const int g = item / width, i = item % width;                             // (radix desc, index asc)
      const int64_t l = l0 + g;
      const int n = l % 2 ? width : K;
      if (l < lists && i < n) {
        const uint32_t r = radix_s[g][i];
        int rank = 0;
        for (int j = 0; j < n; ++j) rank += radix_s[g][j] > r || (radix_s[g][j] == r && j < i);
        chosen_s[g][i] = rank < nb;
        if (rank == nb - 1) kth_s[g] = r;
      }
    }
    __syncthreads();
    for (int item = t; item < kChooseGroup * width; item += kSelectThreads) {   // gathered: above the k-th, then
      const int g = item / width, i = item % width;                             // equal to it, in index order
      const int64_t l = l0 + g;
      const int n = l % 2 ? width : K;
      if (l < lists && i < n && chosen_s[g][i]) {
        const uint32_t r = radix_s[g][i], kth = kth_s[g];
        int above = 0, slot = 0;
        for (int j = 0; j < n; ++j) {
          const bool other = chosen_s[g][j] != 0;
          above += other && radix_s[g][j] > kth;
          slot += other && j < i && (r > kth ? radix_s[g][j] > kth : radix_s[g][j] == kth);
        }
        if (r == kth) slot += above;
        const float* x = l % 2 ? a.merged + (l / 2) * width : a.running + (l / 2) * K;
        key_s[g][slot] = x[i];
        value_s[g][slot] = i;
        valid_s[g][slot] = 1;
      }
    }
    const int g = t / (kSortSlots / 2);
    if (g < kChooseGroup) bitonic_sort32(key_s[g], value_s[g], valid_s[g], t % (kSortSlots / 2), true);
    else bitonic_sort32(key_s[0], value_s[0], valid_s[0], 0, false);
    for (int item = t; item < kChooseGroup * nb; item += kSelectThreads) {
      const int gi = item / nb, s = item % nb;
      const int64_t l = l0 + gi;
      if (l < lists) (l % 2 ? a.keep : a.next_indices)[(l / 2) * nb + s] = value_s[gi][s];
    }
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kSelectThreads) beam_scores_kernel(const BeamScoresArgs a) {
  const int t = threadIdx.x;
  const int64_t nb = a.beams, K = a.candidates, cur = *a.cur_len;
  const bool length_hit = cur + 1 >= *a.max_len;
  const int64_t generated = cur + 1 - *a.prompt_len;
  for (int64_t i = t; i < a.batch * K; i += kSelectThreads) {
    const int64_t b = i / K, k = i % K;
    const int64_t index = a.top_indices[i];
    const int64_t token = index % a.vocab;
    a.top_tokens[i] = token;
    a.top_parents[i] = index / a.vocab;
    const bool hit = length_hit || is_eos(token, a.eos_ids, a.n_eos);
    a.hits[i] = hit;
    const float score = a.top_log_probs[i];
    a.running[i] = add_rn(score, hit ? kNegScore : 0.0f);
    // the candidates that stopped within the first num_beams ranks may enter the finished store
    float finished = by_length(score, a.length_factors, a.n_factors, generated);
    if (a.early_stopping_true) {
      bool full = true;
      for (int64_t j = 0; j < nb; ++j) full &= a.is_finished[b * nb + j] != 0;
      finished = add_rn(finished, full ? kNegScore : 0.0f);
    }
    finished = add_rn(finished, a.improvement_possible[b] ? 0.0f : kNegScore);
    finished = add_rn(finished, hit && k < nb ? 0.0f : kNegScore);
    a.merged[b * (nb + K) + nb + k] = finished;
  }
  for (int64_t i = t; i < a.batch * nb; i += kSelectThreads)
    a.merged[(i / nb) * (nb + K) + i % nb] = a.finished_scores[i];
  if (t == 0) {
    const bool active = !*a.done;
    a.snapshot[0] = cur;
    a.snapshot[1] = !active;
    *a.invalid = step_invalid(a.invalid, a.probs_total, active);     // (beam_finish reads it for done)
  }
  if (a.next_indices != nullptr) {
    __syncthreads();                                  // (running and merged, written above, read by other threads)
    choose_beams(a);
  }
}

// Candidate k of prompt b's sequence at column c: its parent beam's, with its token at cur_len
__device__ __forceinline__ int64_t candidate_column(const BeamFinishArgs& a, int64_t b, int64_t k, int64_t c,
                                                    int64_t cur) {
  const int64_t i = b * a.candidates + k;
  return c == cur ? a.top_tokens[i] : a.sequences[(b * a.beams + a.top_parents[i]) * a.width + c];
}

__global__ void __launch_bounds__(kSelectThreads) beam_finish_kernel(const BeamFinishArgs a) {
  const int t = threadIdx.x;
  const int64_t nb = a.beams, K = a.candidates, R = a.batch * nb, W = a.width;
  const int64_t cur = a.snapshot[0];
  const bool active = a.snapshot[1] == 0;

  // the sequences: tiles of `tile` columns x R rows, thread t at row t / tile, column t % tile of the tile
  const int64_t tile = kSelectThreads / R, first = *a.prompt_len;
  const int64_t r = t / tile, b = r / nb;
  for (int64_t c0 = first + blockIdx.x * tile; active && c0 <= cur; c0 += (int64_t)gridDim.x * tile) {
    const int64_t c = c0 + t % tile;
    const bool mine = r < R && c <= cur && c < W;
    int64_t next = 0, finished = 0;
    if (mine) {
      next = candidate_column(a, b, a.next_indices[r], c, cur);
      const int64_t kept = a.keep[r];
      finished = kept < nb ? a.finished_sequences[(b * nb + kept) * W + c] : candidate_column(a, b, kept - nb, c, cur);
    }
    __syncthreads();                                      // (every read of the tile before any write)
    if (mine) {
      a.sequences[r * W + c] = next;
      a.finished_sequences[r * W + c] = finished;
    }
    __syncthreads();
  }
  if (blockIdx.x != 0) return;

  // CTA 0: the stores' scores, lengths and flags (read, then written after a barrier), the heuristic, the step's end
  __shared__ float scores_s[kSelectThreads];
  __shared__ uint8_t better_s[kSelectThreads];
  const bool row = t < R;
  const int64_t tb = t / nb, tj = t % nb;
  float score = 0.0f, running = 0.0f;
  int64_t length = 0, parent = t, token = a.fill;
  bool is_finished = false;
  if (row) {
    const int64_t kept = a.keep[t];
    score = a.merged[tb * (nb + K) + kept];
    if (kept < nb) {
      length = a.finished_lengths[tb * nb + kept];
      is_finished = a.is_finished[tb * nb + kept];
    } else {
      length = cur + 1 - *a.prompt_len;
      is_finished = a.hits[tb * K + kept - nb] && kept - nb < nb;
    }
    const int64_t chosen = tb * K + a.next_indices[t];
    running = a.running[chosen];
    parent = a.top_parents[chosen] + tb * nb;
    token = a.top_tokens[chosen];
    scores_s[t] = score;
  }
  __syncthreads();
  if (row) {
    float worst = scores_s[tb * nb];                      // torch.min: NaN if any is
    for (int64_t i = 1; i < nb; ++i) {
      const float v = scores_s[tb * nb + i];
      worst = (v != v || greater(worst, v)) ? v : worst;
    }
    if (!is_finished) worst = kNegScore;
    const int64_t best_length = a.best_length_never ? *a.max_len - *a.prompt_len : cur + 1 - *a.prompt_len;
    const float best = by_length(a.running[tb * K + a.next_indices[tb * nb]], a.length_factors, a.n_factors,
                                 best_length);
    better_s[t] = greater(best, worst);
  }
  __syncthreads();
  bool improvement = false;
  if (row && tj == 0) {
    bool any = false;
    for (int64_t i = 0; i < nb; ++i) any |= better_s[tb * nb + i] != 0;
    improvement = a.improvement_possible[tb] && any;
  }
  bool all_hit = true;
  for (int64_t i = t; i < a.batch * K; i += kSelectThreads) all_hit &= a.hits[i] != 0;
  const bool any_improvement = __syncthreads_or(improvement);
  const bool every_hit = !__syncthreads_or(!all_hit);
  const bool all_finished = !__syncthreads_or(row && !is_finished);
  bool still_running = any_improvement && !every_hit;
  if (a.early_stopping_true) still_running = still_running && !all_finished;

  if (row) {
    if (active) {
      a.beam_scores[t] = running;
      a.finished_scores[t] = score;
      a.finished_lengths[t] = length;
      a.is_finished[t] = is_finished;
      if (tj == 0) a.improvement_possible[tb] = improvement;
    }
    a.next.parents[t] = active ? parent : t;
    const int64_t next_token = active ? token : a.fill;
    a.next.input_ids[t] = next_token < 0 ? 0 : next_token;
  }
  if (t == 0) {
    *a.cur_len = cur + (active ? 1 : 0);
    *a.done = !active || !still_running || *a.invalid;
  }
  advance_positions(a.next, t);
}

// ---- the candidates' top-K over beams x vocabulary: torch.topk(largest, sorted) of rows [B, n], k <= 32 ----
// The same order as choose_beams (torch's on CUDA), in two launches: each CTA of topk_chunks_kernel keeps its chunk's k
// best by (radix desc, index asc) (a thread's sorted list in registers, then the CTA's lists merged pairwise in shared
// memory); topk_final_kernel merges the chunks' lists of a row, gathers the k as torch does and sorts them with the
// bitonic network. (A 64-bit key, radix << 32 | ~index, orders both at once: every key distinct, 0 none.)
constexpr int kTopkThreads = 128;

__device__ __forceinline__ uint64_t topk_key(float x, int64_t i) {
  return (uint64_t)radix_key(x) << 32 | (uint64_t)(0xffffffffu - (uint32_t)i);
}

__device__ __forceinline__ int64_t key_index(uint64_t key) { return 0xffffffffu - (uint32_t)(key & 0xffffffffu); }

// list (sorted descending, kSortSlots keys) with `key` put in its place, the smallest dropped
__device__ __forceinline__ void insert_key(uint64_t (&list)[kSortSlots], uint64_t key) {
#pragma unroll
  for (int j = 0; j < kSortSlots; ++j) {
    const uint64_t here = list[j];
    const bool in = key > here;
    list[j] = in ? key : here;
    key = in ? here : key;
  }
}

// The CTA's threads' lists (lists_s[thread][0..k)) merged pairwise into lists_s[0][0..k)
__device__ __forceinline__ void merge_lists(uint64_t (*lists_s)[kSortSlots], int k) {
  const int t = threadIdx.x;
  for (int width = 1; width < kTopkThreads; width *= 2) {
    __syncthreads();
    uint64_t merged[kSortSlots];
    const bool merges = t % (2 * width) == 0;
    if (merges) {
      const uint64_t* a = lists_s[t];
      const uint64_t* b = lists_s[t + width];
      int i = 0, j = 0;
#pragma unroll
      for (int s = 0; s < kSortSlots; ++s) {
        const bool from_a = s < k && a[i] > b[j];
        merged[s] = s < k ? (from_a ? a[i] : b[j]) : 0;
        i += s < k && from_a;
        j += s < k && !from_a;
      }
    }
    __syncthreads();
    if (merges) {
#pragma unroll
      for (int s = 0; s < kSortSlots; ++s)
        if (s < k) lists_s[t][s] = merged[s];
    }
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kTopkThreads)
    topk_chunks_kernel(const float* __restrict__ x, int64_t n, int k, int64_t chunk, uint64_t* __restrict__ best) {
  __shared__ uint64_t lists_s[kTopkThreads][kSortSlots];
  const int t = threadIdx.x;
  const int64_t row = blockIdx.y, start = blockIdx.x * chunk, end = start + chunk < n ? start + chunk : n;
  const float* xs = x + row * n;
  uint64_t list[kSortSlots];
#pragma unroll
  for (int j = 0; j < kSortSlots; ++j) list[j] = 0;
  uint64_t threshold = 0;                     // (list[k - 1]: a key must beat it to enter the k best)
  for (int64_t i = start + t; i < end; i += kTopkThreads) {
    const uint64_t key = topk_key(xs[i], i);
    if (key > threshold) {
      insert_key(list, key);
#pragma unroll
      for (int j = 0; j < kSortSlots; ++j) threshold = j == k - 1 ? list[j] : threshold;
    }
  }
#pragma unroll
  for (int j = 0; j < kSortSlots; ++j)
    if (j < k) lists_s[t][j] = list[j];
  merge_lists(lists_s, k);
  for (int j = t; j < k; j += kTopkThreads) best[(row * gridDim.x + blockIdx.x) * k + j] = lists_s[0][j];
}

__global__ void __launch_bounds__(kTopkThreads)
    topk_final_kernel(const float* __restrict__ x, int64_t n, int k, int chunks, const uint64_t* __restrict__ best,
                      float* __restrict__ values, int64_t* __restrict__ indices) {
  __shared__ uint64_t lists_s[kTopkThreads][kSortSlots];
  __shared__ float key_s[kSortSlots];
  __shared__ int32_t value_s[kSortSlots];
  __shared__ uint8_t valid_s[kSortSlots];
  const int t = threadIdx.x;
  const int64_t row = blockIdx.x;
  uint64_t list[kSortSlots];
#pragma unroll
  for (int j = 0; j < kSortSlots; ++j) list[j] = 0;
  for (int c = t; c < chunks; c += kTopkThreads)         // (chunks <= kTopkThreads: the launcher sizes them so)
    for (int j = 0; j < k; ++j) insert_key(list, best[(row * chunks + c) * k + j]);
#pragma unroll
  for (int j = 0; j < kSortSlots; ++j)
    if (j < k) lists_s[t][j] = list[j];
  merge_lists(lists_s, k);
  // gathered as torch gathers: the k above the k-th's radix in index order, then those equal to it in index order
  if (t < kSortSlots) {
    key_s[t] = 0.0f, value_s[t] = 0, valid_s[t] = 0;
  }
  __syncthreads();
  if (t < k) {
    const uint64_t kth = lists_s[0][k - 1] >> 32, mine = lists_s[0][t];
    const uint64_t r = mine >> 32;
    const int64_t i = key_index(mine);
    int above = 0, slot = 0;
    for (int j = 0; j < k; ++j) {
      const uint64_t other = lists_s[0][j];
      above += (other >> 32) > kth;
      slot += key_index(other) < i && (r > kth ? (other >> 32) > kth : (other >> 32) == kth);
    }
    if (r == kth) slot += above;
    key_s[slot] = x[row * n + i];
    value_s[slot] = (int32_t)i;
    valid_s[slot] = 1;
  }
  bitonic_sort32(key_s, value_s, valid_s, t, t < kSortSlots / 2);
  if (t < k) {
    values[row * k + t] = key_s[t];
    indices[row * k + t] = value_s[t];
  }
}

bool next_ok(const SelectNext& n, int64_t rows) {
  return n.parents && n.input_ids && (n.n_positions == 0 || n.positions) &&
         (n.n_cache_position == 0 || n.cache_position) && n.n_positions >= 0 && n.n_cache_position >= 0 && rows >= 1;
}

}  // namespace

cudaError_t sample_finish_launch(const SampleFinishArgs& a, cudaStream_t stream) {
  if (a.rows < 1 || a.rows > kSelectThreads || a.width < 1 || a.n_eos < 0)
    return fail(cudaErrorInvalidValue, "sample_finish: rows %lld (1..%d), width %lld, n_eos %lld",
                (long long)a.rows, kSelectThreads, (long long)a.width, (long long)a.n_eos);
  if (!a.tokens || !a.unfinished || !a.done || !a.invalid || !a.sequences || !a.cur_len || !a.max_len ||
      (a.n_eos > 0 && !a.eos_ids) || !next_ok(a.next, a.rows))
    return fail(cudaErrorInvalidValue, "sample_finish: a NULL pointer");
  sample_finish_kernel<<<1, kSelectThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t beam_scores_launch(const BeamScoresArgs& a, cudaStream_t stream) {
  if (a.batch < 1 || a.beams < 2 || a.batch * a.beams > kSelectThreads || a.candidates < a.beams || a.vocab < 1 ||
      a.n_eos < 0 || a.n_factors < 1)
    return fail(cudaErrorInvalidValue,
                "beam_scores: batch %lld x beams %lld (2.., at most %d rows), candidates %lld, vocab %lld, n_eos %lld, "
                "n_factors %lld", (long long)a.batch, (long long)a.beams, kSelectThreads, (long long)a.candidates,
                (long long)a.vocab, (long long)a.n_eos, (long long)a.n_factors);
  if (a.next_indices != nullptr && (a.beams > kSortSlots || a.beams + a.candidates > kMaxChooseInputs || !a.keep))
    return fail(cudaErrorInvalidValue,
                "beam_scores: the top-k's in the kernel take beams <= %d and beams + candidates <= %d (got %lld, %lld) "
                "and both outputs", kSortSlots, kMaxChooseInputs, (long long)a.beams, (long long)a.candidates);
  if (!a.top_log_probs || !a.top_indices || !a.cur_len || !a.max_len || !a.prompt_len || !a.done || !a.invalid ||
      (a.n_eos > 0 && !a.eos_ids) || !a.is_finished || !a.improvement_possible || !a.finished_scores ||
      !a.length_factors || !a.top_tokens || !a.top_parents || !a.hits || !a.running || !a.merged || !a.snapshot)
    return fail(cudaErrorInvalidValue, "beam_scores: a NULL pointer");
  beam_scores_kernel<<<1, kSelectThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t topk_launch(const float* x, int64_t rows, int64_t n, int64_t k, uint64_t* best, int64_t chunks,
                        float* values, int64_t* indices, cudaStream_t stream) {
  if (rows < 1 || rows > 65535 || k < 1 || k > kSortSlots || n < k || n > 0x7fffffff || chunks < 1 ||
      chunks > kTopkThreads || chunks > n)
    return fail(cudaErrorInvalidValue, "topk: rows %lld (1..65535), n %lld (k..2^31-1), k %lld (1..%d), chunks %lld "
                "(1..%d)", (long long)rows, (long long)n, (long long)k, kSortSlots, (long long)chunks, kTopkThreads);
  if (!x || !best || !values || !indices) return fail(cudaErrorInvalidValue, "topk: a NULL pointer");
  const int64_t chunk = (n + chunks - 1) / chunks;
  const dim3 grid((unsigned)chunks, (unsigned)rows);
  topk_chunks_kernel<<<grid, kTopkThreads, 0, stream>>>(x, n, (int)k, chunk, best);
  topk_final_kernel<<<(unsigned)rows, kTopkThreads, 0, stream>>>(x, n, (int)k, (int)chunks, best, values, indices);
  return cudaGetLastError();
}

cudaError_t beam_finish_launch(const BeamFinishArgs& a, cudaStream_t stream) {
  const int64_t R = a.batch * a.beams;
  if (a.batch < 1 || a.beams < 2 || R > kSelectThreads || a.candidates < a.beams || a.width < 1 || a.n_factors < 1)
    return fail(cudaErrorInvalidValue,
                "beam_finish: batch %lld x beams %lld (2.., at most %d rows), candidates %lld, width %lld, "
                "n_factors %lld", (long long)a.batch, (long long)a.beams, kSelectThreads, (long long)a.candidates,
                (long long)a.width, (long long)a.n_factors);
  if (!a.next_indices || !a.keep || !a.top_tokens || !a.top_parents || !a.hits || !a.running || !a.merged ||
      !a.snapshot || !a.prompt_len || !a.max_len || !a.invalid || !a.length_factors || !a.sequences ||
      !a.finished_sequences || !a.beam_scores || !a.finished_scores || !a.finished_lengths || !a.is_finished ||
      !a.improvement_possible || !a.cur_len || !a.done || !next_ok(a.next, R))
    return fail(cudaErrorInvalidValue, "beam_finish: a NULL pointer");
  const int64_t tile = kSelectThreads / R, tiles = (a.width + tile - 1) / tile;
  const unsigned ctas = (unsigned)(tiles < kMaxFinishCtas ? tiles : kMaxFinishCtas);
  beam_finish_kernel<<<ctas, kSelectThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace hfc
