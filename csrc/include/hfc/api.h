/* The C ABI of the hf_cascade kernel library (csrc/api.cu), loaded by hf_cascade/kernels/cuda_binding.py with ctypes.
 * Every function returns a cudaError_t code (0: success; hfc_error_string names it, hfc_last_error says in words
 * what the calling thread's last failing call refused, e.g. a head_dim with no instantiation, or "").
 *
 *   hfc_params_layout  the size of every params struct and the offset and size of each field (layout.h), checked
 *                      by the Python binding at load; *count receives the number of rows.
 *
 *   hfc_prefix_setup  once per (dtype, head_dim, m_tile, tune) and device, before the first hfc_prefix launch of that
 *                     variant: raises the kernel's shared-memory limit and reports its occupancy. Not capture safe
 *                     (a non-stream CUDA call); hfc_prefix, hfc_suffix, hfc_merge, hfc_write(_strided, _fp8),
 *                     hfc_copy_blocks_layers are: they only launch on `stream` (a cudaStream_t as an integer),
 *                     with grids computed from the params alone.
 */
#pragma once

#include <stdint.h>

#include "hfc/layout.h"
#include "hfc/params.h"

#define HFC_ABI_VERSION 9

#if defined(_WIN32)
#define HFC_API __declspec(dllexport)
#else
#define HFC_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

HFC_API int hfc_abi_version(void);
HFC_API const char* hfc_error_string(int err);
HFC_API const char* hfc_last_error(void);
HFC_API const hfc_layout_entry* hfc_params_layout(int32_t* count);
HFC_API int hfc_sync(void);  /* debugging aid ($HF_CASCADE_CUDA_DEBUG): wait for the device, report errors */
HFC_API int hfc_prefix_setup(int32_t dtype, int32_t head_dim, int32_t m_tile, int32_t tune, hfc_prefix_info* info);
HFC_API int hfc_prefix(const hfc_prefix_params* params, uintptr_t stream);
HFC_API int hfc_suffix(const hfc_suffix_params* params, uintptr_t stream);
HFC_API int hfc_merge(const hfc_merge_params* params, uintptr_t stream);
/* rows that share no prefix: prefix, suffix and merge in one launch (csrc/solo.cu; hfc_solo_params). Capture safe.
   Added without an ABI bump: the binding looks it up, and a library without it runs the three kernels. */
HFC_API int hfc_solo(const hfc_solo_params* params, uintptr_t stream);
/* the cache write of one layer (csrc/write.cu): pool [num_blocks, 2, block_size, Hkv, D] of any element type;
   key, value [tokens, Hkv, D] contiguous; token_bytes = Hkv x D x element size (a multiple of 16); copies may be 0 */
HFC_API int hfc_write(void* pool, const void* key, const void* value, const int64_t* write_block,
                      const int64_t* write_offset, int64_t tokens, const int64_t* copy_src, const int64_t* copy_dst,
                      int64_t copies, int64_t block_size, int64_t token_bytes, uintptr_t stream);
/* hfc_write with K's and V's tokens key_stride_bytes and value_stride_bytes apart (multiples of 16, at least
   token_bytes; a token's Hkv x D elements contiguous): e.g. V as a column slice of a fused q|k|v product, read where it
   lies. hfc_write is this with token_bytes for both strides. Capture safe. Added without an ABI bump: the binding
   looks it up and makes K/V contiguous for hfc_write where a library lacks it. */
HFC_API int hfc_write_strided(void* pool, const void* key, const void* value, int64_t key_stride_bytes,
                              int64_t value_stride_bytes, const int64_t* write_block, const int64_t* write_offset,
                              int64_t tokens, const int64_t* copy_src, const int64_t* copy_dst, int64_t copies,
                              int64_t block_size, int64_t token_bytes, uintptr_t stream);
/* hfc_write_strided into a float8_e4m3fn pool [num_blocks, 2, block_size, heads, head_dim] from K/V in bf16 or fp16
   (dtype: HFC_BF16, HFC_FP16; strides in their bytes), encoded on the way: each value divided by its head's scale
   (scale [2, heads] float32 on the device: K's, then V's) and saturated to +-448, rounded to nearest even, as
   hf_cascade.kv.memory.BlockStorage.encode does in torch. head_dim a multiple of 8, heads x head_dim of 16. Capture
   safe; added as hfc_write_strided was. */
HFC_API int hfc_write_fp8(void* pool, const void* key, const void* value, int64_t key_stride_bytes,
                          int64_t value_stride_bytes, const float* scale, const int64_t* write_block,
                          const int64_t* write_offset, int64_t tokens, const int64_t* copy_src, const int64_t* copy_dst,
                          int64_t copies, int64_t block_size, int64_t heads, int64_t head_dim, int32_t dtype,
                          uintptr_t stream);
/* A static step's copy-on-write copies pool[copy_dst[i]] = pool[copy_src[i]] in every layer's pool at once
   (csrc/write.cu), before the forward, so that the layers' writes pass no copies: pools [layers] a device array of the
   pools' base addresses (16-byte aligned; any element type, blocks of block_bytes each, a multiple of 16), copy_src,
   copy_dst [copies] int64 on the same device; a pair that copies a block onto itself or repeats pair 0 is skipped, as
   in hfc_write. Capture safe; added as hfc_write_strided was. */
HFC_API int hfc_copy_blocks_layers(const uint64_t* pools, int64_t layers, const int64_t* copy_src,
                                   const int64_t* copy_dst, int64_t copies, int64_t block_bytes, uintptr_t stream);
/* RMSNorm of a step's rows (csrc/elementwise.cu): x [rows, hidden] with row stride x_stride elements, weight [hidden],
   out [rows, hidden] contiguous, one dtype code (HFC_BF16, HFC_FP16) for all three. Added without an ABI bump: the
   binding looks it up and leaves the norms to torch where a library lacks it. */
HFC_API int hfc_rms_norm(void* out, const void* x, const void* weight, int64_t rows, int64_t hidden, int64_t x_stride,
                         float eps, int32_t dtype, uintptr_t stream);
/* The rotary embedding of q [batch, q_heads, tokens, head_dim] and k [batch, k_heads, tokens, head_dim] (strides in
   elements: q_stride, k_stride of batch, head, token; head_dim contiguous) with cos, sin [batch, tokens, head_dim]
   (cs_stride of batch, token; 0 broadcasts) into contiguous q_out, k_out (csrc/elementwise.cu); added as
   hfc_rms_norm was. */
HFC_API int hfc_rotary(const void* q, const void* k, const void* cos, const void* sin, void* q_out, void* k_out,
                       int64_t batch, int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t head_dim,
                       const int64_t* q_stride, const int64_t* k_stride, const int64_t* cs_stride, int32_t dtype,
                       uintptr_t stream);
/* A decoder layer's residual add and the RMSNorm after it in one launch (csrc/elementwise.cu): sum_out = T(x +
   residual) ([rows, hidden] contiguous), out = hfc_rms_norm of sum_out; x and residual rows strided (x_stride,
   residual_stride in elements, the hidden dimension contiguous), everything 16-byte aligned, hidden a multiple of 8
   and at most 8192; the add rounded as eager mode's. Capture safe; added as hfc_rms_norm was. */
HFC_API int hfc_add_rms_norm(void* out, void* sum_out, const void* x, const void* residual, const void* weight,
                             int64_t rows, int64_t hidden, int64_t x_stride, int64_t residual_stride, float eps,
                             int32_t dtype, uintptr_t stream);
/* The MLP's activation silu(gate) * up (csrc/elementwise.cu): gate, up [rows, width] with row strides gate_stride,
   up_stride in elements (the width contiguous: e.g. the two halves of a fused gate|up product), out [rows, width]
   contiguous, one dtype code (HFC_BF16, HFC_FP16); eager mode's roundings, T(T(silu(g)) * u). Capture safe; added as
   hfc_rms_norm was. */
HFC_API int hfc_silu_mul(void* out, const void* gate, const void* up, int64_t rows, int64_t width,
                         int64_t gate_stride, int64_t up_stride, int32_t dtype, uintptr_t stream);
/* A static decode layout's block bookkeeping of one step in one launch (csrc/blocks.cu): the beam reorder by parents
   [R] (int64), one token appended per row unless *done, the step's plan written into the layout's plan buffers, the
   peak of blocks in use raised; bit for bit hf_cascade/decode/whole_step.py `advance` (device_blocks.py is the spec).
   The state: tables [R, W] int32, lengths [R] int64, refcount [pool_blocks + 1] int32, flags [] int32, steps [] int64,
   token_limit [] int64, row_prefix_blocks / row_inner_blocks [R] int64, the K prefix checks (rows, cols int64, ids
   int32, used bool); done [] bool, peak [] int64; the plan: suffix_table [R, suffix_width], q_limit [R],
   inner_suffix_table [R, inner_width], inner_q_limit [R] (NULL where inner_width is 0) int32, write_block,
   write_offset, copy_src, copy_dst [R] int64. All contiguous; 1 <= R <= 1024, 1 <= pool_blocks <= 2^23. One CTA;
   capture safe. Added as hfc_rms_norm was. */
HFC_API int hfc_blocks_advance(int32_t* tables, int64_t* lengths, int32_t* refcount, int32_t* flags, int64_t* steps,
                               const int64_t* token_limit, const int64_t* row_prefix_blocks,
                               const int64_t* row_inner_blocks, const int64_t* check_rows, const int64_t* check_cols,
                               const int32_t* check_ids, const uint8_t* check_used, const int64_t* parents,
                               const uint8_t* done, int64_t* peak, int32_t* suffix_table, int32_t* q_limit,
                               int32_t* inner_suffix_table, int32_t* inner_q_limit, int64_t* write_block,
                               int64_t* write_offset, int64_t* copy_src, int64_t* copy_dst, int64_t rows,
                               int64_t width, int64_t pool_blocks, int64_t block_size, int64_t suffix_width,
                               int64_t inner_width, int64_t checks, uintptr_t stream);

/* The token choice's bookkeeping of one decode step (csrc/select.cu), bit for bit hf_cascade/decode/device_select.py's
   torch code around the vocabulary-sized torch ops: hfc_sample_finish after a greedy / sampling step's chosen tokens,
   hfc_beam_scores and hfc_beam_finish before and after beam search's two small top-k's. Shapes and meanings:
   csrc/include/hfc/launch.h (SampleFinishArgs, BeamScoresArgs, BeamFinishArgs; the next step's inputs SelectNext);
   bools as bytes, every tensor contiguous on one device, at most 1024 rows. hfc_beam_scores also ranks the two
   top-k's as torch.topk does on CUDA where next_indices and keep are given (beams <= 32, beams + candidates <= 128).
   Capture safe; added as hfc_rms_norm was. */
HFC_API int hfc_sample_finish(const int64_t* tokens, const float* probs_total, uint8_t* unfinished, uint8_t* done,
                              uint8_t* invalid, int64_t* sequences, int64_t* cur_len, const int64_t* max_len, const int64_t* eos_ids,
                              int64_t* parents, int64_t* input_ids, int64_t* positions, int64_t* cache_position,
                              int64_t n_positions, int64_t n_cache_position, int64_t rows, int64_t width, int64_t n_eos,
                              int64_t pad, int64_t fill, uintptr_t stream);
HFC_API int hfc_beam_scores(const float* top_log_probs, const int64_t* top_indices, const int64_t* cur_len,
                            const int64_t* max_len, const int64_t* prompt_len, const uint8_t* done,
                            const float* probs_total, uint8_t* invalid, const int64_t* eos_ids,
                            const uint8_t* is_finished, const uint8_t* improvement_possible,
                            const float* finished_scores, const float* length_factors, int64_t* top_tokens,
                            int64_t* top_parents, uint8_t* hits, float* running, float* merged, int64_t* snapshot,
                            int64_t* next_indices, int64_t* keep, int64_t batch, int64_t beams, int64_t candidates,
                            int64_t vocab, int64_t n_eos, int64_t n_factors, int32_t early_stopping_true,
                            uintptr_t stream);
HFC_API int hfc_beam_finish(const int64_t* next_indices, const int64_t* keep, const int64_t* top_tokens,
                            const int64_t* top_parents, const uint8_t* hits, const float* running, const float* merged,
                            const int64_t* snapshot, const int64_t* prompt_len, const int64_t* max_len,
                            const uint8_t* invalid, const float* length_factors, int64_t* sequences,
                            int64_t* finished_sequences, float* beam_scores, float* finished_scores,
                            int64_t* finished_lengths, uint8_t* is_finished, uint8_t* improvement_possible,
                            int64_t* cur_len, uint8_t* done, int64_t* parents, int64_t* input_ids, int64_t* positions,
                            int64_t* cache_position, int64_t n_positions, int64_t n_cache_position, int64_t batch,
                            int64_t beams, int64_t candidates, int64_t width, int64_t n_factors, int64_t fill,
                            int32_t early_stopping_true, int32_t best_length_never, uintptr_t stream);
/* torch.topk(x, k) (largest=True, sorted=True) of rows x [rows, n] float32 (contiguous) as torch orders it on CUDA,
   ties included, k <= 32 (csrc/select.cu: the candidates of a beam step): values [rows, k] float32, indices [rows, k]
   int64; best [rows, chunks, k] 64-bit scratch, chunks (1..128, <= n) CTAs a row. Capture safe; added as
   hfc_rms_norm was. */
HFC_API int hfc_topk(const float* x, int64_t rows, int64_t n, int64_t k, uint64_t* best, int64_t chunks,
                     float* values, int64_t* indices, uintptr_t stream);

#ifdef __cplusplus
}
#endif
