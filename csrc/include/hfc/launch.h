// Host launchers of the three components, one per .cu file (csrc/prefix.cu, csrc/suffix.cu, csrc/merge.cu; the
// prefix also has a Hopper kernel, csrc/prefix_sm90.cu),
// called by the C ABI in csrc/api.cu. Each checks its params, dispatches on dtype / head_dim (/ m_tile) and
// launches on `stream`; cudaSuccess without a launch when there is nothing to do.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "hfc/params.h"

namespace hfc {

cudaError_t prefix_setup(int dtype, int head_dim, int m_tile, int tune, hfc_prefix_info* info);  // not capture safe
cudaError_t prefix_launch(const hfc_prefix_params& p, cudaStream_t stream);
cudaError_t suffix_launch(const hfc_suffix_params& p, cudaStream_t stream);
cudaError_t merge_launch(const hfc_merge_params& p, cudaStream_t stream);
// csrc/solo.cu: rows that share no prefix, prefix + suffix + merge in one launch
cudaError_t solo_launch(const hfc_solo_params& p, cudaStream_t stream);
// csrc/write.cu: the cache write of one layer (copy-on-write block copies, then the new tokens' K/V), raw bytes; K's
// and V's tokens key_stride_bytes / value_stride_bytes apart (multiples of 16, >= token_bytes)
cudaError_t write_launch(void* pool, const void* key, const void* value, int64_t key_stride_bytes,
                         int64_t value_stride_bytes, const int64_t* write_block, const int64_t* write_offset,
                         int64_t tokens, const int64_t* copy_src, const int64_t* copy_dst, int64_t copies,
                         int64_t block_size, int64_t token_bytes, cudaStream_t stream);
// csrc/write.cu: write_launch for an fp8 (e4m3) pool fed 16-bit K/V (dtype HFC_BF16 / HFC_FP16) [tokens, heads,
// head_dim], each head's values divided by scale[kv * heads + head] and saturated on the way (strides in K/V's bytes)
cudaError_t write_fp8_launch(void* pool, const void* key, const void* value, int64_t key_stride_bytes,
                             int64_t value_stride_bytes, const float* scale, const int64_t* write_block,
                             const int64_t* write_offset, int64_t tokens, const int64_t* copy_src,
                             const int64_t* copy_dst, int64_t copies, int64_t block_size, int64_t heads,
                             int64_t head_dim, int dtype, cudaStream_t stream);
// csrc/write.cu: a static step's copy-on-write copies in every layer's pool at once: pools[layers] (device) holds each
// pool's base address (16-byte aligned), every pool has blocks of block_bytes (a multiple of 16)
cudaError_t copy_blocks_layers_launch(const uint64_t* pools, int64_t layers, const int64_t* copy_src,
                                      const int64_t* copy_dst, int64_t copies, int64_t block_bytes,
                                      cudaStream_t stream);
// csrc/elementwise.cu: RMSNorm of rows [rows, hidden] (row stride x_stride) into contiguous out; the rotary
// embedding of q [batch, q_heads, tokens, head_dim] and k (strided, head_dim contiguous) into contiguous q_out,
// k_out; both with eager mode's roundings
// (with a residual [rows, hidden] (row stride residual_stride): the rows normalised are T(x + residual), written to
// sum_out (contiguous) too; aligned rows of at most 8192 only)
cudaError_t rms_norm_launch(void* out, const void* x, const void* weight, int64_t rows, int64_t hidden,
                            int64_t x_stride, float eps, int dtype, cudaStream_t stream, const void* residual = nullptr,
                            int64_t residual_stride = 0, void* sum_out = nullptr);
cudaError_t rotary_launch(const void* q, const void* k, const void* cos, const void* sin, void* q_out, void* k_out,
                          int64_t batch, int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t head_dim,
                          const int64_t* q_stride, const int64_t* k_stride, const int64_t* cs_stride, int dtype,
                          cudaStream_t stream);
// csrc/elementwise.cu: the MLP's silu(gate) * up of rows [rows, width] (row strides gate_stride, up_stride; the
// width contiguous) into contiguous out, with eager mode's roundings
cudaError_t silu_mul_launch(void* out, const void* gate, const void* up, int64_t rows, int64_t width,
                            int64_t gate_stride, int64_t up_stride, int dtype, cudaStream_t stream);

// csrc/blocks.cu: a decode step's block bookkeeping in one launch (hf_cascade/decode/whole_step.py `advance`:
// device_blocks.reorder, device_blocks.append, the plan buffers, the peak), bit for bit the torch code's. Every
// tensor contiguous on one device; shapes with R rows, W table columns, P = pool_blocks, K checks.
struct BlocksAdvanceArgs {
  int32_t* tables;                     // [R, W], -1 padded
  int64_t* lengths;                    // [R]
  int32_t* refcount;                   // [P + 1]
  int32_t* flags;                      // []
  int64_t* steps;                      // []
  const int64_t* token_limit;          // []
  const int64_t* row_prefix_blocks;    // [R]
  const int64_t* row_inner_blocks;     // [R]
  const int64_t* check_rows;           // [K]
  const int64_t* check_cols;           // [K]
  const int32_t* check_ids;            // [K]
  const uint8_t* check_used;           // [K] bool
  const int64_t* parents;              // [R]
  const uint8_t* done;                 // [] bool
  int64_t* peak;                       // []
  int32_t* suffix_table;               // [R, suffix_width]
  int32_t* q_limit;                    // [R]
  int32_t* inner_suffix_table;         // [R, inner_width]; NULL without a middle level (inner_width 0)
  int32_t* inner_q_limit;              // [R]; likewise
  int64_t* write_block;                // [R]
  int64_t* write_offset;               // [R]
  int64_t* copy_src;                   // [R]
  int64_t* copy_dst;                   // [R]
  int64_t rows, width, pool_blocks, block_size, suffix_width, inner_width, checks;
};
cudaError_t blocks_advance_launch(const BlocksAdvanceArgs& a, cudaStream_t stream);

// csrc/select.cu: the token choice's bookkeeping of one step (hf_cascade/decode/device_select.py's torch code, bit for
// bit), around the vocabulary-sized torch ops and beam search's top-k's. Every tensor contiguous on one device, bools
// as bytes; R rows (at most 1024), W sequence columns.
struct SelectNext {                    // the next step's inputs (hf_cascade/decode/whole_step.py `choose`)
  int64_t* parents;                    // [R]: the row each new row continues
  int64_t* input_ids;                  // [R]: the chosen tokens, clamped at 0
  int64_t* positions;                  // [n_positions] += 1 (NULL where n_positions is 0)
  int64_t* cache_position;             // [n_cache_position] += 1 (likewise)
  int64_t n_positions, n_cache_position;
};
struct SampleFinishArgs {              // greedy and sampling, after the argmax / the draw
  const int64_t* tokens;               // [R] the chosen tokens
  const float* probs_total;            // []: the draw's probabilities summed (NULL: greedy); not finite: invalid
  uint8_t* unfinished;                 // [R]
  uint8_t* done;                       // []
  uint8_t* invalid;                    // []
  int64_t* sequences;                  // [R, W]
  int64_t* cur_len;                    // []
  const int64_t* max_len;              // []
  const int64_t* eos_ids;              // [n_eos]
  SelectNext next;
  int64_t rows, width, n_eos, pad, fill;
};
cudaError_t sample_finish_launch(const SampleFinishArgs& a, cudaStream_t stream);
struct BeamScoresArgs {                // beam search, after the top-K candidates (B prompts, nb beams, K candidates)
  const float* top_log_probs;          // [B, K]
  const int64_t* top_indices;          // [B, K] into nb x vocab
  const int64_t* cur_len;              // []
  const int64_t* max_len;              // []
  const int64_t* prompt_len;           // []
  const uint8_t* done;                 // []
  const float* probs_total;            // []: the beams' draw's probabilities summed (NULL: not sampled)
  uint8_t* invalid;                    // []: set where probs_total is not finite in a step that runs
  const int64_t* eos_ids;              // [n_eos]
  const uint8_t* is_finished;          // [B, nb]
  const uint8_t* improvement_possible; // [B]
  const float* finished_scores;        // [B, nb]
  const float* length_factors;         // [n_factors]: 1 / t ** length_penalty
  int64_t* top_tokens;                 // out [B, K]
  int64_t* top_parents;                // out [B, K]: the beam within its prompt
  uint8_t* hits;                       // out [B, K]
  float* running;                      // out [B, K]: the scores the next beams are chosen from
  float* merged;                       // out [B, nb + K]: the finished store's, then the candidates'
  int64_t* snapshot;                   // out [2]: cur_len, done as the step began
  int64_t* next_indices;               // out [B, nb]: torch.topk(running, nb)'s indices (NULL: torch runs it)
  int64_t* keep;                       // out [B, nb]: torch.topk(merged, nb)'s (beams <= 32, nb + K <= 128)
  int64_t batch, beams, candidates, vocab, n_eos, n_factors;
  int32_t early_stopping_true;         // early_stopping=True
};
cudaError_t beam_scores_launch(const BeamScoresArgs& a, cudaStream_t stream);
struct BeamFinishArgs {                // beam search, after the top-nb of running and of merged
  const int64_t* next_indices;         // [B, nb] into K
  const int64_t* keep;                 // [B, nb] into nb + K
  const int64_t* top_tokens;           // [B, K] (beam_scores' outputs, and its snapshot)
  const int64_t* top_parents;          // [B, K]
  const uint8_t* hits;                 // [B, K]
  const float* running;                // [B, K]
  const float* merged;                 // [B, nb + K]
  const int64_t* snapshot;             // [2]
  const int64_t* prompt_len;           // []
  const int64_t* max_len;              // []
  const uint8_t* invalid;              // []
  const float* length_factors;         // [n_factors]
  int64_t* sequences;                  // [B * nb, W]
  int64_t* finished_sequences;         // [B * nb, W]
  float* beam_scores;                  // [B, nb]
  float* finished_scores;              // [B, nb]
  int64_t* finished_lengths;           // [B, nb]
  uint8_t* is_finished;                // [B, nb]
  uint8_t* improvement_possible;       // [B]
  int64_t* cur_len;                    // []
  uint8_t* done;                       // []
  SelectNext next;
  int64_t batch, beams, candidates, width, n_factors, fill;
  int32_t early_stopping_true;         // early_stopping=True
  int32_t best_length_never;           // early_stopping="never" with length_penalty > 0: the best possible length
};
cudaError_t beam_finish_launch(const BeamFinishArgs& a, cudaStream_t stream);
// torch.topk(x, k) (largest, sorted) of rows x [rows, n] float32 as torch orders it on CUDA, ties included, k <= 32:
// values [rows, k], indices [rows, k]; best [rows, chunks, k] scratch (chunks <= 128 CTAs a row)
cudaError_t topk_launch(const float* x, int64_t rows, int64_t n, int64_t k, uint64_t* best, int64_t chunks,
                        float* values, int64_t* indices, cudaStream_t stream);

// csrc/prefix_sm90.cu: the Hopper prefix kernel, code HFC_PREFIX_KERNEL_SM90 (params.h), reached through prefix_setup
// and prefix_launch (same params); its setup reports 0 CTAs per SM where the library has no sm_90a code for the GPU
cudaError_t prefix_sm90_setup(int dtype, int head_dim, int m_tile, bool fp8, hfc_prefix_info* info);  // not capture safe
cudaError_t prefix_sm90_launch(const hfc_prefix_params& p, cudaStream_t stream);

}  // namespace hfc
