// The C ABI of the kernel library (declared in csrc/include/hfc/api.h): thin wrappers over the component
// launchers of csrc/prefix.cu, csrc/suffix.cu, csrc/merge.cu and csrc/write.cu, so that Python loads one shared library
// with ctypes (hf_cascade/kernels/cuda_binding.py), plus the struct layout table and the error messages.
// Build: see hf_cascade/kernels/_build.py (sources, nvcc flags).

#include "hfc/api.h"
#include "hfc/errors.h"
#include "hfc/launch.h"

#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdio>

namespace hfc {
namespace {
thread_local char error_message[512] = "";  // per thread: concurrent callers keep their own message
}  // namespace

void clear_error() { error_message[0] = '\0'; }

const char* last_error() { return error_message; }

cudaError_t fail(cudaError_t err, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(error_message, sizeof(error_message), fmt, args);
  va_end(args);
  return err;
}

}  // namespace hfc

extern "C" {

HFC_API int hfc_abi_version(void) { return HFC_ABI_VERSION; }

HFC_API const char* hfc_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

HFC_API const char* hfc_last_error(void) { return hfc::last_error(); }

HFC_API const hfc_layout_entry* hfc_params_layout(int32_t* count) {
  if (count != nullptr) *count = hfc_params_layout_rows;
  return hfc_params_layout_table;
}

HFC_API int hfc_sync(void) {
  hfc::clear_error();
  const cudaError_t err = cudaDeviceSynchronize();
  // reported here, so consumed here: a launcher's cudaGetLastError() must not report it again for a later launch
  // (a non-sticky error such as cudaErrorStreamCaptureUnsupported would otherwise fail the next, healthy launch)
  if (err != cudaSuccess) (void)cudaGetLastError();
  return (int)err;
}

HFC_API int hfc_prefix_setup(int32_t dtype, int32_t head_dim, int32_t m_tile, int32_t tune, hfc_prefix_info* info) {
  hfc::clear_error();
  return (int)hfc::prefix_setup(dtype, head_dim, m_tile, tune, info);
}

HFC_API int hfc_prefix(const hfc_prefix_params* params, uintptr_t stream) {
  hfc::clear_error();
  if (params == nullptr) return (int)hfc::fail(cudaErrorInvalidValue, "hfc_prefix: params is NULL");
  return (int)hfc::prefix_launch(*params, reinterpret_cast<cudaStream_t>(stream));
}

HFC_API int hfc_suffix(const hfc_suffix_params* params, uintptr_t stream) {
  hfc::clear_error();
  if (params == nullptr) return (int)hfc::fail(cudaErrorInvalidValue, "hfc_suffix: params is NULL");
  return (int)hfc::suffix_launch(*params, reinterpret_cast<cudaStream_t>(stream));
}

HFC_API int hfc_merge(const hfc_merge_params* params, uintptr_t stream) {
  hfc::clear_error();
  if (params == nullptr) return (int)hfc::fail(cudaErrorInvalidValue, "hfc_merge: params is NULL");
  return (int)hfc::merge_launch(*params, reinterpret_cast<cudaStream_t>(stream));
}

HFC_API int hfc_solo(const hfc_solo_params* params, uintptr_t stream) {
  hfc::clear_error();
  if (params == nullptr) return (int)hfc::fail(cudaErrorInvalidValue, "hfc_solo: params is NULL");
  return (int)hfc::solo_launch(*params, reinterpret_cast<cudaStream_t>(stream));
}

HFC_API int hfc_write(void* pool, const void* key, const void* value, const int64_t* write_block,
                      const int64_t* write_offset, int64_t tokens, const int64_t* copy_src, const int64_t* copy_dst,
                      int64_t copies, int64_t block_size, int64_t token_bytes, uintptr_t stream) {
  hfc::clear_error();
  return (int)hfc::write_launch(pool, key, value, token_bytes, token_bytes, write_block, write_offset, tokens,
                                copy_src, copy_dst, copies, block_size, token_bytes,
                                reinterpret_cast<cudaStream_t>(stream));
}

HFC_API int hfc_write_strided(void* pool, const void* key, const void* value, int64_t key_stride_bytes,
                              int64_t value_stride_bytes, const int64_t* write_block, const int64_t* write_offset,
                              int64_t tokens, const int64_t* copy_src, const int64_t* copy_dst, int64_t copies,
                              int64_t block_size, int64_t token_bytes, uintptr_t stream) {
  hfc::clear_error();
  return (int)hfc::write_launch(pool, key, value, key_stride_bytes, value_stride_bytes, write_block, write_offset,
                                tokens, copy_src, copy_dst, copies, block_size, token_bytes,
                                reinterpret_cast<cudaStream_t>(stream));
}

HFC_API int hfc_write_fp8(void* pool, const void* key, const void* value, int64_t key_stride_bytes,
                          int64_t value_stride_bytes, const float* scale, const int64_t* write_block,
                          const int64_t* write_offset, int64_t tokens, const int64_t* copy_src, const int64_t* copy_dst,
                          int64_t copies, int64_t block_size, int64_t heads, int64_t head_dim, int32_t dtype,
                          uintptr_t stream) {
  hfc::clear_error();
  return (int)hfc::write_fp8_launch(pool, key, value, key_stride_bytes, value_stride_bytes, scale, write_block,
                                    write_offset, tokens, copy_src, copy_dst, copies, block_size, heads, head_dim,
                                    dtype, reinterpret_cast<cudaStream_t>(stream));
}

HFC_API int hfc_copy_blocks_layers(const uint64_t* pools, int64_t layers, const int64_t* copy_src,
                                   const int64_t* copy_dst, int64_t copies, int64_t block_bytes, uintptr_t stream) {
  hfc::clear_error();
  return (int)hfc::copy_blocks_layers_launch(pools, layers, copy_src, copy_dst, copies, block_bytes,
                                             reinterpret_cast<cudaStream_t>(stream));
}

HFC_API int hfc_rms_norm(void* out, const void* x, const void* weight, int64_t rows, int64_t hidden, int64_t x_stride,
                         float eps, int32_t dtype, uintptr_t stream) {
  hfc::clear_error();
  return (int)hfc::rms_norm_launch(out, x, weight, rows, hidden, x_stride, eps, dtype,
                                   reinterpret_cast<cudaStream_t>(stream));
}

HFC_API int hfc_rotary(const void* q, const void* k, const void* cos, const void* sin, void* q_out, void* k_out,
                       int64_t batch, int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t head_dim,
                       const int64_t* q_stride, const int64_t* k_stride, const int64_t* cs_stride, int32_t dtype,
                       uintptr_t stream) {
  hfc::clear_error();
  return (int)hfc::rotary_launch(q, k, cos, sin, q_out, k_out, batch, tokens, q_heads, k_heads, head_dim, q_stride,
                                 k_stride, cs_stride, dtype, reinterpret_cast<cudaStream_t>(stream));
}

HFC_API int hfc_add_rms_norm(void* out, void* sum_out, const void* x, const void* residual, const void* weight,
                             int64_t rows, int64_t hidden, int64_t x_stride, int64_t residual_stride, float eps,
                             int32_t dtype, uintptr_t stream) {
  hfc::clear_error();
  if (residual == nullptr) return (int)hfc::fail(cudaErrorInvalidValue, "add_rms_norm: a NULL residual");
  return (int)hfc::rms_norm_launch(out, x, weight, rows, hidden, x_stride, eps, dtype,
                                   reinterpret_cast<cudaStream_t>(stream), residual, residual_stride, sum_out);
}

HFC_API int hfc_silu_mul(void* out, const void* gate, const void* up, int64_t rows, int64_t width,
                         int64_t gate_stride, int64_t up_stride, int32_t dtype, uintptr_t stream) {
  hfc::clear_error();
  return (int)hfc::silu_mul_launch(out, gate, up, rows, width, gate_stride, up_stride, dtype,
                                   reinterpret_cast<cudaStream_t>(stream));
}

HFC_API int hfc_blocks_advance(int32_t* tables, int64_t* lengths, int32_t* refcount, int32_t* flags, int64_t* steps,
                               const int64_t* token_limit, const int64_t* row_prefix_blocks,
                               const int64_t* row_inner_blocks, const int64_t* check_rows, const int64_t* check_cols,
                               const int32_t* check_ids, const uint8_t* check_used, const int64_t* parents,
                               const uint8_t* done, int64_t* peak, int32_t* suffix_table, int32_t* q_limit,
                               int32_t* inner_suffix_table, int32_t* inner_q_limit, int64_t* write_block,
                               int64_t* write_offset, int64_t* copy_src, int64_t* copy_dst, int64_t rows,
                               int64_t width, int64_t pool_blocks, int64_t block_size, int64_t suffix_width,
                               int64_t inner_width, int64_t checks, uintptr_t stream) {
  hfc::clear_error();
  const hfc::BlocksAdvanceArgs args{tables, lengths, refcount, flags, steps, token_limit, row_prefix_blocks,
                                    row_inner_blocks, check_rows, check_cols, check_ids, check_used, parents, done,
                                    peak, suffix_table, q_limit, inner_suffix_table, inner_q_limit, write_block,
                                    write_offset, copy_src, copy_dst, rows, width, pool_blocks, block_size,
                                    suffix_width, inner_width, checks};
  return (int)hfc::blocks_advance_launch(args, reinterpret_cast<cudaStream_t>(stream));
}


HFC_API int hfc_sample_finish(const int64_t* tokens, const float* probs_total, uint8_t* unfinished, uint8_t* done,
                              uint8_t* invalid, int64_t* sequences, int64_t* cur_len, const int64_t* max_len, const int64_t* eos_ids,
                              int64_t* parents, int64_t* input_ids, int64_t* positions, int64_t* cache_position,
                              int64_t n_positions, int64_t n_cache_position, int64_t rows, int64_t width, int64_t n_eos,
                              int64_t pad, int64_t fill, uintptr_t stream) {
  hfc::clear_error();
  const hfc::SampleFinishArgs args{tokens, probs_total, unfinished, done, invalid, sequences, cur_len, max_len, eos_ids,
                                   {parents, input_ids, positions, cache_position, n_positions, n_cache_position},
                                   rows, width, n_eos, pad, fill};
  return (int)hfc::sample_finish_launch(args, reinterpret_cast<cudaStream_t>(stream));
}

HFC_API int hfc_beam_scores(const float* top_log_probs, const int64_t* top_indices, const int64_t* cur_len,
                            const int64_t* max_len, const int64_t* prompt_len, const uint8_t* done,
                            const float* probs_total, uint8_t* invalid, const int64_t* eos_ids,
                            const uint8_t* is_finished, const uint8_t* improvement_possible,
                            const float* finished_scores, const float* length_factors, int64_t* top_tokens,
                            int64_t* top_parents, uint8_t* hits, float* running, float* merged, int64_t* snapshot,
                            int64_t* next_indices, int64_t* keep, int64_t batch, int64_t beams, int64_t candidates,
                            int64_t vocab, int64_t n_eos, int64_t n_factors, int32_t early_stopping_true,
                            uintptr_t stream) {
  hfc::clear_error();
  const hfc::BeamScoresArgs args{top_log_probs, top_indices, cur_len, max_len, prompt_len, done, probs_total,
                                 invalid, eos_ids, is_finished, improvement_possible, finished_scores, length_factors,
                                 top_tokens, top_parents, hits, running, merged, snapshot, next_indices, keep, batch,
                                 beams, candidates, vocab, n_eos, n_factors,
                                 early_stopping_true};
  return (int)hfc::beam_scores_launch(args, reinterpret_cast<cudaStream_t>(stream));
}

HFC_API int hfc_beam_finish(const int64_t* next_indices, const int64_t* keep, const int64_t* top_tokens,
                            const int64_t* top_parents, const uint8_t* hits, const float* running, const float* merged,
                            const int64_t* snapshot, const int64_t* prompt_len, const int64_t* max_len,
                            const uint8_t* invalid, const float* length_factors, int64_t* sequences,
                            int64_t* finished_sequences, float* beam_scores, float* finished_scores,
                            int64_t* finished_lengths, uint8_t* is_finished, uint8_t* improvement_possible,
                            int64_t* cur_len, uint8_t* done, int64_t* parents, int64_t* input_ids, int64_t* positions,
                            int64_t* cache_position, int64_t n_positions, int64_t n_cache_position, int64_t batch,
                            int64_t beams, int64_t candidates, int64_t width, int64_t n_factors, int64_t fill,
                            int32_t early_stopping_true, int32_t best_length_never, uintptr_t stream) {
  hfc::clear_error();
  const hfc::BeamFinishArgs args{next_indices, keep, top_tokens, top_parents, hits, running, merged, snapshot,
                                 prompt_len, max_len, invalid, length_factors, sequences, finished_sequences,
                                 beam_scores, finished_scores, finished_lengths, is_finished, improvement_possible,
                                 cur_len, done,
                                 {parents, input_ids, positions, cache_position, n_positions, n_cache_position},
                                 batch, beams, candidates, width, n_factors, fill, early_stopping_true,
                                 best_length_never};
  return (int)hfc::beam_finish_launch(args, reinterpret_cast<cudaStream_t>(stream));
}

HFC_API int hfc_topk(const float* x, int64_t rows, int64_t n, int64_t k, uint64_t* best, int64_t chunks,
                     float* values, int64_t* indices, uintptr_t stream) {
  hfc::clear_error();
  return (int)hfc::topk_launch(x, rows, n, k, best, chunks, values, indices, reinterpret_cast<cudaStream_t>(stream));
}
}  // extern "C"
