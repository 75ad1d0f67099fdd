/* One parameter struct per kernel (the shape of flash-attention's flash.h), plain C: the only definition of a
 * kernel's arguments. Every kernel takes its struct by value (`const __grid_constant__`, read in place from the
 * launch's parameter space); the host launchers only check it and compute the grid.
 * hf_cascade/kernels/cuda_binding.py mirrors each struct as a ctypes.Structure (_PrefixParams, _SuffixParams,
 * _MergeParams, _PrefixInfo) and checks the mirrors against the library's layout table at load
 * (csrc/include/hfc/layout.h, hfc_params_layout): a field changed here must change there and in layout.h.
 *
 * Layouts (all contiguous): q [R, Lq, Hq, D] and out in the dtype; pool [num_blocks, 2, block_size, Hkv, D]
 * (K then V of each block; token t of a table is slot t % block_size of block table[t / block_size]);
 * partials part_o float32 [slots, R, Lq, Hq, D], part_lse float32 [slots, R, Lq, Hq] (LSE base 2). Sizes are
 * 64-bit here and checked against int range by the launchers. Every grid size comes from these fields.
 */
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { HFC_BF16 = 0, HFC_FP16 = 1 };  /* dtype codes */

/* K/V element codes (the kv_dtype fields): HFC_KV_SAME, the pool holds q's dtype; HFC_KV_FP8_E4M3, the pool holds
 * float8_e4m3fn bytes with kv_scale = float [2, Hkv] (K's scale per KV head, then V's; real = stored x scale). The
 * kernels convert the fp8 values to q's dtype in registers (exact: e4m3 fits in bf16 and fp16; the prefix kernel
 * stages the bytes as they are and converts them straight into its MMA operands), apply K's scale to the scores and
 * V's to the output (one scalar per CTA: a CTA serves one KV head). The prefix kernel reads fp8 with its default
 * configuration (tune 0, not the tuning variants) or with the Hopper kernel's fp8 code (HFC_PREFIX_KERNEL_SM90_FP8,
 * whose producer warps convert the staged bytes into the 16-bit tiles its wgmma reads). */
enum { HFC_KV_SAME = 0, HFC_KV_FP8_E4M3 = 1 };

/* prefix kernel codes (hfc_prefix_params.tune, hfc_prefix_setup's tune): 0 the mma.sync kernel of csrc/prefix.cu,
 * 1-5 its tuning variants (PrefixTune<V> there; for a sweep), HFC_PREFIX_KERNEL_SM90 the Hopper kernel of
 * csrc/prefix_sm90.cu, which Python picks by architecture where the library's sm_90a code runs on the GPU, and
 * HFC_PREFIX_KERNEL_SM90_FP8 the same kernel for a float8_e4m3fn pool (kv_dtype HFC_KV_FP8_E4M3 with kv_scale) */
enum { HFC_PREFIX_KERNEL_SM90 = 6, HFC_PREFIX_KERNEL_SM90_FP8 = 7 };

/* level 0: one CTA per (prefix chunk x row tile, KV head, group); writes slots [0, max_chunks) */
typedef struct {
  const void* q;
  const void* pool;
  const int32_t* group_rows;   /* [G, Rg] the rows of each group, -1 padding */
  const int32_t* prefix_table; /* [G, Mp] block ids of each group's prefix */
  const int32_t* prefix_len;   /* [G] prefix tokens of each group */
  float* part_o;
  float* part_lse;
  int64_t R, Lq, Hq, Hkv, block_size;
  int64_t G, Rg, Mp;
  int64_t chunk_tokens, max_chunks, row_tiles; /* row_tiles x m_tile >= Rg x Lq x (Hq / Hkv) */
  float scale_log2;                            /* softmax scale x log2(e) */
  int32_t dtype, head_dim, m_tile;             /* m_tile: 16, 32, or 64 (head_dim <= 128) */
  /* per-layer variants (0: off). softcap: logits s -> softcap x tanh(s / softcap) (s scaled, natural log) before
   * the softmax. window: query lq of row r sees the prefix tokens t >= prefix_len[g] + q_limit[r, lq] - window
   * (its last `window` keys over the prefix and its suffix, itself included); whole K/V tiles and chunks before
   * the CTA's earliest visible token are skipped. q_limit [R, Lq]: the suffix level's (read only with a window). */
  const int32_t* q_limit;
  float softcap;
  int32_t window;
  /* which prefix kernel (the codes above; 0: the default). A tuning variant exists for bf16, head_dim 128, no
   * softcap / window; the Hopper kernel for bf16 / fp16, head_dim 128, m_tile 64, no softcap / window. Each needs
   * hfc_prefix_setup with the same code first. */
  int32_t tune;
  int32_t kv_dtype;       /* HFC_KV_SAME or HFC_KV_FP8_E4M3 (pool then in bytes: [num_blocks, 2, bs, Hkv, D]) */
  const float* kv_scale;  /* [2, Hkv] with HFC_KV_FP8_E4M3, else NULL */
} hfc_prefix_params;

/* what hfc_prefix_setup reports for one (dtype, head_dim, m_tile, tune) */
typedef struct {
  int32_t ctas_per_sm;  /* resident CTAs per SM (0: cannot run on this GPU) */
  int32_t smem_bytes;   /* dynamic shared memory per CTA */
  int32_t tile_tokens;  /* tokens per K/V tile: chunks should be a multiple of it */
} hfc_prefix_info;

/* level 1: one CTA per (split x query block, KV head, row); writes slots [slot0, slot0 + nsplit), or with fuse_merge
 * the merged output */
typedef struct {
  const void* q;
  const void* pool;
  const int32_t* suffix_table; /* [R, Ms] block ids of each row's own tokens */
  const int32_t* q_limit;      /* [R, Lq] query lq of row r sees the first q_limit[r, lq] suffix tokens */
  float* part_o;
  float* part_lse;
  int64_t R, Lq, Hq, Hkv, block_size, Ms;
  int64_t split_tokens, nsplit, slot0;
  float scale_log2;
  int32_t dtype, head_dim;
  /* per-layer variants (0: off), as in hfc_prefix_params; with a window, query lq of row r sees the suffix
   * tokens [q_limit[r, lq] - window, q_limit[r, lq]) and a CTA starts at its earliest visible token */
  float softcap;
  int32_t window;
  int32_t kv_dtype;       /* as in hfc_prefix_params */
  const float* kv_scale;
  /* the merge fused into the suffix kernel (1; 0: off, the suffix writes its partial into slot slot0). One split only
   * (nsplit 1; the launcher refuses more): each CTA merges its queries' suffix state, as the row's last partial, with
   * the row's prefix partials (slots [0, row_nchunks[r]) and, three levels, [mid_slot0, mid_slot0 + row_nmid[r]))
   * and the head's sink, as hfc_merge_params does, and writes out [R, Lq, Hq, D] in the dtype; no partial of its
   * own. row_nchunks, row_nmid, mid_slot0, sinks: as in hfc_merge_params. */
  int32_t fuse_merge;
  const int32_t* row_nchunks;
  void* out;
  const int32_t* row_nmid;
  int64_t mid_slot0;
  const float* sinks;
} hfc_suffix_params;

/* merge: one warp per (row, query, head) over slots [0, row_nchunks[r]), [mid_slot0, mid_slot0 + row_nmid[r])
 * (three levels only) and [slot0, slot0 + nsplit), plus the head's attention sink if any */
typedef struct {
  const float* part_o;
  const float* part_lse;
  const int32_t* row_nchunks; /* [R] prefix partials of each row (0: in no group) */
  void* out;                  /* [R, Lq, Hq, D] in the dtype */
  int64_t R, Lq, Hq, slot0, nsplit;
  int32_t dtype, head_dim;
  const int32_t* row_nmid;    /* [R] middle-level partials of each row from mid_slot0 on, or NULL (two levels) */
  int64_t mid_slot0;
  const float* sinks;         /* [Hq] attention-sink logits (natural log): one more partial (O = 0, LSE =
                               * sinks[h] x log2 e) per query, or NULL */
} hfc_merge_params;

/* solo (csrc/solo.cu): rows that share no prefix, each row's whole sequence (its group's prefix, then its own suffix) in
 * one launch: one CTA per (split x query block, KV head, row) writes slot `split` of part_o / part_lse ([nsplit, R, Lq,
 * Hq, D] / [nsplit, R, Lq, Hq]); the last CTA of each (query block, KV head, row) merges the row's slots into out and
 * sets its counter back to 0. Token t of row r is prefix token t below prefix_len[row_group[r]], suffix token
 * t - prefix_len above; query lq sees the tokens below prefix_len + q_limit[r, lq]. split_tokens x nsplit covers
 * (Mp + Ms) x block_size. bf16 / fp16, K/V in q's dtype, no softcap / window / sinks. */
typedef struct {
  const void* q;
  const void* pool;
  const int32_t* row_group;    /* [R] each row's group (its prefix), -1: none */
  const int32_t* prefix_table; /* [G, Mp] */
  const int32_t* prefix_len;   /* [G] */
  const int32_t* suffix_table; /* [R, Ms] */
  const int32_t* q_limit;      /* [R, Lq] */
  float* part_o;
  float* part_lse;
  int32_t* counters;           /* [R, Hkv, query blocks] all 0 before a launch, and after it */
  void* out;                   /* [R, Lq, Hq, D] in the dtype */
  int64_t R, Lq, Hq, Hkv, block_size, G, Mp, Ms;
  int64_t split_tokens, nsplit;
  float scale_log2;
  int32_t dtype, head_dim;
} hfc_solo_params;

#ifdef __cplusplus
}
#endif
