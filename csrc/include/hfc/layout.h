/* The layout of every parameter struct of csrc/include/hfc/params.h as the compiler lays it out (sizeof, offsetof),
 * for hfc_params_layout (csrc/api.cu): hf_cascade/kernels/cuda_binding.py compares its ctypes mirrors with this table
 * when it loads the library and names the struct and field that differ. Plain C, so that a test can compile the
 * table with the system C compiler (tests/test_kernel_library.py). A field added to a struct in params.h goes here
 * too; a field forgotten here still changes the struct's size, which is checked.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "hfc/params.h"

#ifdef __cplusplus
extern "C" {
#endif

/* one row: a field of a struct, or (field NULL) the struct itself with its size */
typedef struct {
  const char* struct_name;
  const char* field;
  int64_t offset;
  int64_t size;
} hfc_layout_entry;

#define HFC_LAYOUT_STRUCT(S) {#S, NULL, 0, (int64_t)sizeof(S)}
#define HFC_LAYOUT_FIELD(S, f) {#S, #f, (int64_t)offsetof(S, f), (int64_t)sizeof(((S*)0)->f)}

#define HFC_PARAMS_LAYOUT_ROWS                                                                                   \
  HFC_LAYOUT_STRUCT(hfc_prefix_params), HFC_LAYOUT_FIELD(hfc_prefix_params, q),                                  \
  HFC_LAYOUT_FIELD(hfc_prefix_params, pool), HFC_LAYOUT_FIELD(hfc_prefix_params, group_rows),                    \
  HFC_LAYOUT_FIELD(hfc_prefix_params, prefix_table), HFC_LAYOUT_FIELD(hfc_prefix_params, prefix_len),            \
  HFC_LAYOUT_FIELD(hfc_prefix_params, part_o), HFC_LAYOUT_FIELD(hfc_prefix_params, part_lse),                    \
  HFC_LAYOUT_FIELD(hfc_prefix_params, R), HFC_LAYOUT_FIELD(hfc_prefix_params, Lq),                               \
  HFC_LAYOUT_FIELD(hfc_prefix_params, Hq), HFC_LAYOUT_FIELD(hfc_prefix_params, Hkv),                             \
  HFC_LAYOUT_FIELD(hfc_prefix_params, block_size), HFC_LAYOUT_FIELD(hfc_prefix_params, G),                       \
  HFC_LAYOUT_FIELD(hfc_prefix_params, Rg), HFC_LAYOUT_FIELD(hfc_prefix_params, Mp),                              \
  HFC_LAYOUT_FIELD(hfc_prefix_params, chunk_tokens), HFC_LAYOUT_FIELD(hfc_prefix_params, max_chunks),            \
  HFC_LAYOUT_FIELD(hfc_prefix_params, row_tiles), HFC_LAYOUT_FIELD(hfc_prefix_params, scale_log2),               \
  HFC_LAYOUT_FIELD(hfc_prefix_params, dtype), HFC_LAYOUT_FIELD(hfc_prefix_params, head_dim),                     \
  HFC_LAYOUT_FIELD(hfc_prefix_params, m_tile), HFC_LAYOUT_FIELD(hfc_prefix_params, q_limit),                     \
  HFC_LAYOUT_FIELD(hfc_prefix_params, softcap), HFC_LAYOUT_FIELD(hfc_prefix_params, window),                     \
  HFC_LAYOUT_FIELD(hfc_prefix_params, tune), HFC_LAYOUT_FIELD(hfc_prefix_params, kv_dtype),                     \
  HFC_LAYOUT_FIELD(hfc_prefix_params, kv_scale),                                                                 \
  HFC_LAYOUT_STRUCT(hfc_prefix_info), HFC_LAYOUT_FIELD(hfc_prefix_info, ctas_per_sm),                            \
  HFC_LAYOUT_FIELD(hfc_prefix_info, smem_bytes), HFC_LAYOUT_FIELD(hfc_prefix_info, tile_tokens),                 \
  HFC_LAYOUT_STRUCT(hfc_suffix_params), HFC_LAYOUT_FIELD(hfc_suffix_params, q),                                  \
  HFC_LAYOUT_FIELD(hfc_suffix_params, pool), HFC_LAYOUT_FIELD(hfc_suffix_params, suffix_table),                  \
  HFC_LAYOUT_FIELD(hfc_suffix_params, q_limit), HFC_LAYOUT_FIELD(hfc_suffix_params, part_o),                     \
  HFC_LAYOUT_FIELD(hfc_suffix_params, part_lse), HFC_LAYOUT_FIELD(hfc_suffix_params, R),                         \
  HFC_LAYOUT_FIELD(hfc_suffix_params, Lq), HFC_LAYOUT_FIELD(hfc_suffix_params, Hq),                              \
  HFC_LAYOUT_FIELD(hfc_suffix_params, Hkv), HFC_LAYOUT_FIELD(hfc_suffix_params, block_size),                     \
  HFC_LAYOUT_FIELD(hfc_suffix_params, Ms), HFC_LAYOUT_FIELD(hfc_suffix_params, split_tokens),                    \
  HFC_LAYOUT_FIELD(hfc_suffix_params, nsplit), HFC_LAYOUT_FIELD(hfc_suffix_params, slot0),                       \
  HFC_LAYOUT_FIELD(hfc_suffix_params, scale_log2), HFC_LAYOUT_FIELD(hfc_suffix_params, dtype),                   \
  HFC_LAYOUT_FIELD(hfc_suffix_params, head_dim), HFC_LAYOUT_FIELD(hfc_suffix_params, softcap),                   \
  HFC_LAYOUT_FIELD(hfc_suffix_params, window), HFC_LAYOUT_FIELD(hfc_suffix_params, kv_dtype),                   \
  HFC_LAYOUT_FIELD(hfc_suffix_params, kv_scale), HFC_LAYOUT_FIELD(hfc_suffix_params, fuse_merge),               \
  HFC_LAYOUT_FIELD(hfc_suffix_params, row_nchunks), HFC_LAYOUT_FIELD(hfc_suffix_params, out),                    \
  HFC_LAYOUT_FIELD(hfc_suffix_params, row_nmid), HFC_LAYOUT_FIELD(hfc_suffix_params, mid_slot0),                 \
  HFC_LAYOUT_FIELD(hfc_suffix_params, sinks),                                                                    \
  HFC_LAYOUT_STRUCT(hfc_merge_params), HFC_LAYOUT_FIELD(hfc_merge_params, part_o),                               \
  HFC_LAYOUT_FIELD(hfc_merge_params, part_lse), HFC_LAYOUT_FIELD(hfc_merge_params, row_nchunks),                 \
  HFC_LAYOUT_FIELD(hfc_merge_params, out), HFC_LAYOUT_FIELD(hfc_merge_params, R),                                \
  HFC_LAYOUT_FIELD(hfc_merge_params, Lq), HFC_LAYOUT_FIELD(hfc_merge_params, Hq),                                \
  HFC_LAYOUT_FIELD(hfc_merge_params, slot0), HFC_LAYOUT_FIELD(hfc_merge_params, nsplit),                         \
  HFC_LAYOUT_FIELD(hfc_merge_params, dtype), HFC_LAYOUT_FIELD(hfc_merge_params, head_dim),                       \
  HFC_LAYOUT_FIELD(hfc_merge_params, row_nmid), HFC_LAYOUT_FIELD(hfc_merge_params, mid_slot0),                   \
  HFC_LAYOUT_FIELD(hfc_merge_params, sinks),                                                                     \
  HFC_LAYOUT_STRUCT(hfc_solo_params), HFC_LAYOUT_FIELD(hfc_solo_params, q),                                      \
  HFC_LAYOUT_FIELD(hfc_solo_params, pool), HFC_LAYOUT_FIELD(hfc_solo_params, row_group),                         \
  HFC_LAYOUT_FIELD(hfc_solo_params, prefix_table), HFC_LAYOUT_FIELD(hfc_solo_params, prefix_len),                \
  HFC_LAYOUT_FIELD(hfc_solo_params, suffix_table), HFC_LAYOUT_FIELD(hfc_solo_params, q_limit),                   \
  HFC_LAYOUT_FIELD(hfc_solo_params, part_o), HFC_LAYOUT_FIELD(hfc_solo_params, part_lse),                        \
  HFC_LAYOUT_FIELD(hfc_solo_params, counters), HFC_LAYOUT_FIELD(hfc_solo_params, out),                           \
  HFC_LAYOUT_FIELD(hfc_solo_params, R), HFC_LAYOUT_FIELD(hfc_solo_params, Lq),                                   \
  HFC_LAYOUT_FIELD(hfc_solo_params, Hq), HFC_LAYOUT_FIELD(hfc_solo_params, Hkv),                                 \
  HFC_LAYOUT_FIELD(hfc_solo_params, block_size), HFC_LAYOUT_FIELD(hfc_solo_params, G),                           \
  HFC_LAYOUT_FIELD(hfc_solo_params, Mp), HFC_LAYOUT_FIELD(hfc_solo_params, Ms),                                  \
  HFC_LAYOUT_FIELD(hfc_solo_params, split_tokens), HFC_LAYOUT_FIELD(hfc_solo_params, nsplit),                    \
  HFC_LAYOUT_FIELD(hfc_solo_params, scale_log2), HFC_LAYOUT_FIELD(hfc_solo_params, dtype),                       \
  HFC_LAYOUT_FIELD(hfc_solo_params, head_dim)

/* the table and its row count (a definition: include this header in one translation unit) */
static const hfc_layout_entry hfc_params_layout_table[] = {HFC_PARAMS_LAYOUT_ROWS};
static const int32_t hfc_params_layout_rows = (int32_t)(sizeof(hfc_params_layout_table) / sizeof(hfc_layout_entry));

#ifdef __cplusplus
}
#endif
