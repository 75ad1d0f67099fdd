// Standalone check of the level-0 prefix kernel (csrc/prefix.cu) through the library's C ABI (hfc_prefix_setup,
// hfc_prefix, hfc_merge: csrc/include/hfc/api.h).
//
// 1. Correctness, small shapes: bf16 and fp16, head_dim 64/128/256, row tiles M 16/32/64 (each with two
//    row tiles, the second one partly padding), groups of different sizes with -1 padding in group_rows,
//    rows in no group, prefix lengths that are not a multiple of the K/V tile, the block size or the
//    chunk, a group with an empty prefix and chunks with no tokens; unused pool slots hold NaN. The
//    partials are compared per chunk with a float32 CPU reference (max abs error of O, of LSE); chunks
//    with no tokens must hold O = 0, LSE = -inf; nothing may be written for rows in no group.
// 2. Timing with CUDA events (L2 overwritten before each call), Llama-3-8B layer: 32 query / 8 KV heads,
//    head_dim 128, bf16, block 16, 8 prompt groups, prefix 16k; 8 beams (32 query rows per group and KV
//    head: M 32) and 16 beams (64 rows: M 64), at the chunk length of the rule of
//    hf_cascade/kernels/cuda_tuning.py (choose_chunk_blocks, fed by hfc_prefix_setup) and a few fixed ones.
//
// Build and run: csrc/tests/run_prefix_v2_check.sh [--no-timing] [--iters N]
// Exit status 0 when every check passes.

#include "hfc/api.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define CK(x)                                                                                        \
  do {                                                                                               \
    cudaError_t e_ = (x);                                                                            \
    if (e_ != cudaSuccess) {                                                                         \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                                  \
    }                                                                                                \
  } while (0)
#define CKI(x) CK(static_cast<cudaError_t>(x))


// ------------------------------------------------------------------------------------- host helpers

static uint16_t f2bf(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static float bf2f(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static uint16_t f2h(float f) {
  __half h = __float2half_rn(f);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
static float h2f(uint16_t b) {
  __half h;
  std::memcpy(&h, &b, 2);
  return __half2float(h);
}
static uint16_t to16(int dtype, float f) { return dtype == 0 ? f2bf(f) : f2h(f); }
static float from16(int dtype, uint16_t b) { return dtype == 0 ? bf2f(b) : h2f(b); }

// port of hf_cascade.kernels.cuda_tuning.choose_chunk_blocks
static long long choose_chunk_blocks(const std::vector<long long>& blocks, long long ctas_per_chunk, long long slots,
                                     long long bs, long long tile, long long min_tokens = 256, int max_waves = 8) {
  std::vector<long long> pb;
  for (long long b : blocks)
    if (b > 0) pb.push_back(b);
  if (pb.empty()) return 1;
  const long long align = (bs <= tile && tile % bs == 0) ? tile / bs : 1;
  auto round_up = [&](long long x) { return (x + align - 1) / align * align; };
  const long long min_cb = round_up(std::max(1LL, (min_tokens + bs - 1) / bs));
  const long long max_cb = round_up(*std::max_element(pb.begin(), pb.end()));
  long long total = 0;
  for (long long b : pb) total += b;
  total *= ctas_per_chunk;
  long long best_cb = max_cb;
  double best_eff = -1.0;
  for (int waves = 1; waves <= max_waves; ++waves) {
    const long long cb = std::min(std::max(round_up((total + waves * slots - 1) / (waves * slots)), min_cb), max_cb);
    long long ctas = 0;
    for (long long b : pb) ctas += (b + cb - 1) / cb;
    ctas *= ctas_per_chunk;
    const double eff = (double)ctas / (double)(((ctas + slots - 1) / slots) * slots);
    if (eff > best_eff + 1e-9) {
      best_cb = cb;
      best_eff = eff;
    }
    if (eff >= 0.9 || cb == min_cb) break;
  }
  return best_cb;
}

// ------------------------------------------------------------------------------------------ a problem

struct Problem {
  int dtype, D, Hkv, grp, Lq, bs, G, Rg, R, Mp, num_blocks;
  std::vector<int> group_rows, prefix_table, prefix_len;
  std::vector<uint16_t> q, pool;  // host copies (16-bit)
  int* d_group_rows = nullptr;
  int* d_prefix_table = nullptr;
  int* d_prefix_len = nullptr;
  void* d_q = nullptr;
  void* d_pool = nullptr;
  int Hq() const { return Hkv * grp; }
  int rows_q() const { return Rg * Lq * grp; }
  size_t pool_elems() const { return (size_t)num_blocks * 2 * bs * Hkv * D; }
  // element index of (block, kv, slot, head, d)
  size_t pidx(int blk, int kv, int slot, int h, int d) const {
    return ((((size_t)blk * 2 + kv) * bs + slot) * Hkv + h) * D + d;
  }
  // device copies; the pool from the host copy, or (large pools) a repeated random pattern of 1M values
  void upload() {
    CK(cudaMalloc(&d_group_rows, group_rows.size() * 4));
    CK(cudaMalloc(&d_prefix_table, prefix_table.size() * 4));
    CK(cudaMalloc(&d_prefix_len, prefix_len.size() * 4));
    CK(cudaMalloc(&d_q, q.size() * 2));
    CK(cudaMalloc(&d_pool, pool_elems() * 2));
    CK(cudaMemcpy(d_group_rows, group_rows.data(), group_rows.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_prefix_table, prefix_table.data(), prefix_table.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_prefix_len, prefix_len.data(), prefix_len.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_q, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
    if (!pool.empty()) {
      CK(cudaMemcpy(d_pool, pool.data(), pool.size() * 2, cudaMemcpyHostToDevice));
      return;
    }
    std::mt19937 rng(77);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<uint16_t> pat(1 << 20);
    for (auto& x : pat) x = to16(dtype, nd(rng));
    for (size_t off = 0; off < pool_elems(); off += pat.size()) {
      const size_t n = std::min(pat.size(), pool_elems() - off);
      CK(cudaMemcpy(static_cast<uint16_t*>(d_pool) + off, pat.data(), n * 2, cudaMemcpyHostToDevice));
    }
  }
  void release() {
    cudaFree(d_group_rows);
    cudaFree(d_prefix_table);
    cudaFree(d_prefix_len);
    cudaFree(d_q);
    cudaFree(d_pool);
  }
};

// sizes: rows of each group (<= Rg; the rest of group_rows is -1), plens: prefix tokens of each group
static Problem make_problem(unsigned seed, int dtype, int D, int Hkv, int grp, int Lq, int bs, int Rg,
                            const std::vector<int>& sizes, const std::vector<int>& plens, int lone_rows,
                            bool fill_host_pool = true) {
  std::mt19937 rng(seed);
  Problem p{};
  p.dtype = dtype;
  p.D = D;
  p.Hkv = Hkv;
  p.grp = grp;
  p.Lq = Lq;
  p.bs = bs;
  p.G = (int)sizes.size();
  p.Rg = Rg;
  int members = 0;
  for (int s : sizes) members += s;
  p.R = members + lone_rows;
  int maxblk = 0, used = 0;
  for (int l : plens) {
    maxblk = std::max(maxblk, (l + bs - 1) / bs);
    used += (l + bs - 1) / bs;
  }
  p.Mp = maxblk + 1;
  p.num_blocks = used + 3;
  std::vector<int> rows(p.R);
  for (int i = 0; i < p.R; ++i) rows[i] = i;
  std::shuffle(rows.begin(), rows.end(), rng);
  std::vector<int> blocks(p.num_blocks);
  for (int i = 0; i < p.num_blocks; ++i) blocks[i] = i;
  std::shuffle(blocks.begin(), blocks.end(), rng);
  p.group_rows.assign((size_t)p.G * Rg, -1);
  p.prefix_table.assign((size_t)p.G * p.Mp, -1);
  p.prefix_len.assign(p.G, 0);
  std::vector<char> valid((size_t)p.num_blocks * bs, 0);
  int at = 0, bat = 0;
  for (int g = 0; g < p.G; ++g) {
    // members in random slots of the group's Rg entries (padding -1 in between)
    std::vector<int> slots(Rg);
    for (int i = 0; i < Rg; ++i) slots[i] = i;
    std::shuffle(slots.begin(), slots.end(), rng);
    for (int i = 0; i < sizes[g]; ++i) p.group_rows[(size_t)g * Rg + slots[i]] = rows[at++];
    p.prefix_len[g] = plens[g];
    for (int j = 0; j < (plens[g] + bs - 1) / bs; ++j) {
      const int b = blocks[bat++];
      p.prefix_table[(size_t)g * p.Mp + j] = b;
      for (int s = 0; s < std::min(bs, plens[g] - j * bs); ++s) valid[(size_t)b * bs + s] = 1;
    }
  }
  std::normal_distribution<float> nd(0.0f, 1.0f);
  p.q.resize((size_t)p.R * Lq * p.Hq() * D);
  for (auto& x : p.q) x = to16(dtype, 1.5f * nd(rng));
  const uint16_t nan16 = dtype == 0 ? (uint16_t)0x7fc0 : (uint16_t)0x7e00;
  if (fill_host_pool) {
    p.pool.resize(p.pool_elems());
    for (int b = 0; b < p.num_blocks; ++b)
      for (int kv = 0; kv < 2; ++kv)
        for (int s = 0; s < bs; ++s)
          for (int h = 0; h < Hkv; ++h)
            for (int d = 0; d < D; ++d)
              p.pool[p.pidx(b, kv, s, h, d)] = valid[(size_t)b * bs + s] ? to16(dtype, nd(rng)) : nan16;
  }
  return p;
}

// float32 reference of one partial: query (row, lq, head hq) against tokens [t0, t1) of group g
static void ref_partial(const Problem& p, int g, int row, int lq, int hq, int t0, int t1, float scale_log2,
                        std::vector<float>& o, float& lse) {
  const int D = p.D, h = hq / p.grp;
  std::vector<float> qv(D), s(t1 - t0);
  for (int d = 0; d < D; ++d) qv[d] = from16(p.dtype, p.q[(((size_t)row * p.Lq + lq) * p.Hq() + hq) * D + d]);
  float mx = -INFINITY;
  for (int t = t0; t < t1; ++t) {
    const int blk = p.prefix_table[(size_t)g * p.Mp + t / p.bs];
    float acc = 0.0f;
    for (int d = 0; d < D; ++d) acc += qv[d] * from16(p.dtype, p.pool[p.pidx(blk, 0, t % p.bs, h, d)]);
    s[t - t0] = acc * scale_log2;
    mx = std::max(mx, s[t - t0]);
  }
  o.assign(D, 0.0f);
  float l = 0.0f;
  for (int t = t0; t < t1; ++t) {
    const int blk = p.prefix_table[(size_t)g * p.Mp + t / p.bs];
    const float w = std::exp2(s[t - t0] - mx);
    l += w;
    for (int d = 0; d < D; ++d) o[d] += w * from16(p.dtype, p.pool[p.pidx(blk, 1, t % p.bs, h, d)]);
  }
  if (t1 <= t0) {
    lse = -INFINITY;
    return;
  }
  for (int d = 0; d < D; ++d) o[d] /= l;
  lse = mx + std::log2(l);
}

struct Partials {
  int slots = 0;
  size_t items = 0;  // R * Lq * Hq
  float* d_o = nullptr;
  float* d_lse = nullptr;
  std::vector<float> o, lse;
  void alloc(const Problem& p, int nslots) {
    slots = nslots;
    items = (size_t)p.R * p.Lq * p.Hq();
    CK(cudaMalloc(&d_o, (size_t)slots * items * p.D * 4));
    CK(cudaMalloc(&d_lse, (size_t)slots * items * 4));
  }
  void poison(const Problem& p) {  // 0xff bytes: a NaN pattern that no kernel writes
    CK(cudaMemset(d_o, 0xff, (size_t)slots * items * p.D * 4));
    CK(cudaMemset(d_lse, 0xff, (size_t)slots * items * 4));
  }
  void download(const Problem& p) {
    o.resize((size_t)slots * items * p.D);
    lse.resize((size_t)slots * items);
    CK(cudaMemcpy(o.data(), d_o, o.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(lse.data(), d_lse, lse.size() * 4, cudaMemcpyDeviceToHost));
  }
  void release() {
    cudaFree(d_o);
    cudaFree(d_lse);
  }
};

static bool is_poison(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u == 0xffffffffu;
}

static hfc_prefix_info setup(int dtype, int D, int m_tile) {  // once per variant, before its first launch
  hfc_prefix_info info{};
  CKI(hfc_prefix_setup(dtype, D, m_tile, 0, &info));
  return info;
}

static int launch(const Problem& p, int m_tile, int chunk_tokens, int max_chunks, Partials& out, float scale_log2,
                  cudaStream_t st = 0) {
  hfc_prefix_params pp{};
  pp.q = p.d_q;
  pp.pool = p.d_pool;
  pp.group_rows = p.d_group_rows;
  pp.prefix_table = p.d_prefix_table;
  pp.prefix_len = p.d_prefix_len;
  pp.part_o = out.d_o;
  pp.part_lse = out.d_lse;
  pp.R = p.R;
  pp.Lq = p.Lq;
  pp.Hq = p.Hq();
  pp.Hkv = p.Hkv;
  pp.block_size = p.bs;
  pp.G = p.G;
  pp.Rg = p.Rg;
  pp.Mp = p.Mp;
  pp.chunk_tokens = chunk_tokens;
  pp.max_chunks = max_chunks;
  pp.row_tiles = (p.rows_q() + m_tile - 1) / m_tile;
  pp.scale_log2 = scale_log2;
  pp.dtype = p.dtype;
  pp.head_dim = p.D;
  pp.m_tile = m_tile;
  return hfc_prefix(&pp, (uintptr_t)st);
}

static int merge(const Problem& p, const Partials& in, const int* row_nchunks, void* out) {
  hfc_merge_params mp{};
  mp.part_o = in.d_o;
  mp.part_lse = in.d_lse;
  mp.row_nchunks = row_nchunks;
  mp.out = out;
  mp.R = p.R;
  mp.Lq = p.Lq;
  mp.Hq = p.Hq();
  mp.slot0 = in.slots;
  mp.nsplit = 0;
  mp.dtype = p.dtype;
  mp.head_dim = p.D;
  return hfc_merge(&mp, 0);
}

// ------------------------------------------------------------------------------------- correctness

static int g_failures = 0;

static void check_case(int dtype, int D, int M, int bs, unsigned seed) {
  // rows_q = Rg * Lq * grp = 20 * Lq: two row tiles, the second one partly padding
  const int grp = 4, Hkv = 2, Rg = 5, Lq = M / 16;
  const std::vector<int> sizes = {5, 3, 2, 4};
  const int chunk_tokens = (bs == 16) ? 176 : 200;  // not a multiple of the K/V tile (16/32/64 tokens)
  const std::vector<int> plens = {517, 37, 0, chunk_tokens + 1};
  Problem p = make_problem(seed, dtype, D, Hkv, grp, Lq, bs, Rg, sizes, plens, 2);
  p.upload();
  const float scale_log2 = (1.0f / std::sqrt((float)D)) * 1.4426950408889634f;
  int max_plen = 0;
  for (int l : plens) max_plen = std::max(max_plen, l);
  const int max_chunks = (max_plen + chunk_tokens - 1) / chunk_tokens;
  setup(dtype, D, M);
  Partials res;
  res.alloc(p, max_chunks);
  res.poison(p);
  CKI(launch(p, M, chunk_tokens, max_chunks, res, scale_log2));
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  res.download(p);
  // which rows are members of a group
  std::vector<int> group_of(p.R, -1);
  for (int g = 0; g < p.G; ++g)
    for (int i = 0; i < Rg; ++i)
      if (p.group_rows[(size_t)g * Rg + i] >= 0) group_of[p.group_rows[(size_t)g * Rg + i]] = g;

  double err_o = 0, err_lse = 0;
  bool bad_empty = false, bad_stray = false, bad_nan = false;
  std::vector<float> ro;
  float rlse;
  const int Hq = p.Hq();
  for (int c = 0; c < max_chunks; ++c)
    for (int row = 0; row < p.R; ++row)
      for (int lq = 0; lq < Lq; ++lq)
        for (int hq = 0; hq < Hq; ++hq) {
          const size_t item = (((size_t)c * p.R + row) * Lq + lq) * Hq + hq;
          const int g = group_of[row];
          if (g < 0) {  // the kernel may not write a row in no group
            if (!is_poison(res.lse[item]) || !is_poison(res.o[item * D])) bad_stray = true;
            continue;
          }
          const int t0 = c * chunk_tokens, t1 = std::min(t0 + chunk_tokens, p.prefix_len[g]);
          if (t1 <= t0) {  // a chunk with no tokens: O = 0, LSE = -inf
            if (!(std::isinf(res.lse[item]) && res.lse[item] < 0)) bad_empty = true;
            for (int d = 0; d < D; ++d)
              if (res.o[item * D + d] != 0.0f) bad_empty = true;
            continue;
          }
          ref_partial(p, g, row, lq, hq, t0, t1, scale_log2, ro, rlse);
          const float l = res.lse[item];
          if (!std::isfinite(l)) bad_nan = true;
          err_lse = std::max(err_lse, (double)std::fabs(l - rlse));
          for (int d = 0; d < D; ++d) {
            const float x = res.o[item * D + d];
            if (!std::isfinite(x)) bad_nan = true;
            err_o = std::max(err_o, (double)std::fabs(x - ro[d]));
          }
        }
  const double tol_o = dtype == 0 ? 2e-2 : 5e-3, tol_lse = 5e-3;
  const bool ok = !bad_nan && err_o <= tol_o && err_lse <= tol_lse && !bad_empty && !bad_stray;
  std::printf("  %-4s D=%3d M=%2d bs=%2d rows_q=%3d: max|O-ref| %.3e  max|LSE-ref| %.3e%s%s%s  %s\n",
              dtype == 0 ? "bf16" : "fp16", D, M, bs, p.rows_q(), err_o, err_lse, bad_nan ? "  non-finite!" : "",
              bad_empty ? "  empty chunk not (O = 0, LSE = -inf)!" : "",
              bad_stray ? "  wrote a row that is in no group!" : "", ok ? "PASS" : "FAIL");
  if (!ok) ++g_failures;
  res.release();
  p.release();
}

// ------------------------------------------------------------------------------------------ timing

static void time_shape(int beams, int iters) {
  const int dtype = 0, D = 128, Hkv = 8, grp = 4, Lq = 1, bs = 16, G = 8, plen = 16384;
  const std::vector<int> sizes(G, beams), plens(G, plen);
  Problem p = make_problem(1234 + beams, dtype, D, Hkv, grp, Lq, bs, beams, sizes, plens, 0, false);
  p.upload();
  const int rows_q = p.rows_q();
  const int M = rows_q <= 16 ? 16 : rows_q <= 32 ? 32 : 64;  // cuda.py's m_tile rule for D 128
  const int row_tiles = (rows_q + M - 1) / M;
  const float scale_log2 = (1.0f / std::sqrt((float)D)) * 1.4426950408889634f;
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const double bytes = (double)G * plen * Hkv * D * 2 /*K,V*/ * 2 /*bytes*/;
  std::printf("\nshape: %d groups x %d beams, prefix %d, Hq %d, Hkv %d, D %d, bf16, block %d -> %d query rows per "
              "(group, KV head), M %d; prefix K/V bytes %.1f MB\n",
              G, beams, plen, p.Hq(), Hkv, D, bs, rows_q, M, bytes / 1e6);

  const hfc_prefix_info info = setup(dtype, D, M);
  const std::vector<long long> pb(G, (plen + bs - 1) / bs);
  const int chunk_rule =
      (int)(choose_chunk_blocks(pb, (long long)Hkv * row_tiles, (long long)sms * info.ctas_per_sm, bs,
                                info.tile_tokens) * bs);
  std::printf("  %d CTAs/SM, %d bytes smem, tile %d tokens -> chunk rule: %d tokens\n", info.ctas_per_sm,
              info.smem_bytes, info.tile_tokens, chunk_rule);
  void* flush = nullptr;
  const size_t flush_bytes = 256u << 20;
  CK(cudaMalloc(&flush, flush_bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));

  // chunk lengths to time: the rule's, plus a few fixed ones
  std::vector<int> chunks = {chunk_rule, 512, 1024, 2048};
  std::sort(chunks.begin(), chunks.end());
  chunks.erase(std::unique(chunks.begin(), chunks.end()), chunks.end());
  // the merge of the prefix partials alone (no suffix slots): what a different chunk count costs after
  int* d_nchunks = nullptr;
  void* d_out = nullptr;
  CK(cudaMalloc(&d_nchunks, (size_t)p.R * 4));
  CK(cudaMalloc(&d_out, (size_t)p.R * Lq * p.Hq() * D * 2));
  for (int ct : chunks) {
    const int max_chunks = (plen + ct - 1) / ct;
    {
      std::vector<int> nch(p.R, max_chunks);
      CK(cudaMemcpy(d_nchunks, nch.data(), nch.size() * 4, cudaMemcpyHostToDevice));
    }
    Partials res;
    float med = 0, best = 0, med_merge = 0;
    res.alloc(p, max_chunks);
    CKI(launch(p, M, ct, max_chunks, res, scale_log2));  // warm-up
    CK(cudaDeviceSynchronize());
    for (int with_merge = 0; with_merge < 2; ++with_merge) {
      std::vector<float> ts;
      for (int i = 0; i < iters; ++i) {
        CK(cudaMemsetAsync(flush, i & 0xff, flush_bytes));
        CK(cudaEventRecord(e0));
        CKI(launch(p, M, ct, max_chunks, res, scale_log2));
        if (with_merge) CKI(merge(p, res, d_nchunks, d_out));
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        ts.push_back(ms * 1000.0f);
      }
      std::sort(ts.begin(), ts.end());
      if (with_merge) {
        med_merge = ts[ts.size() / 2];
      } else {
        med = ts[ts.size() / 2];
        best = ts[0];
      }
    }
    res.download(p);
    bool finite = true;
    for (size_t i = 0; i < res.lse.size(); ++i)
      if (!std::isfinite(res.lse[i])) finite = false;
    for (size_t i = 0; i < res.o.size(); ++i)
      if (!std::isfinite(res.o[i])) finite = false;
    if (!finite) ++g_failures;
    std::printf("  chunk %5d tokens (%3d chunks, %5d CTAs)%s: prefix %7.1f us (min %7.1f, %.2f TB/s), "
                "prefix+merge %7.1f us  %s\n",
                ct, max_chunks, max_chunks * row_tiles * Hkv * G, ct == chunk_rule ? " [rule]" : "", med, best,
                bytes / (med * 1e-6) / 1e12, med_merge, finite ? "finite" : "NON-FINITE: FAIL");
    res.release();
  }
  cudaFree(d_nchunks);
  cudaFree(d_out);
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  cudaFree(flush);
  p.release();
}

int main(int argc, char** argv) {
  bool timing = true;
  int iters = 20;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--no-timing")) timing = false;
    else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::atoi(argv[++i]);
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d, %d SMs, %zu KB smem/SM)\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, prop.sharedMemPerMultiprocessor / 1024);

  std::printf("\noccupancy (CTAs/SM, smem bytes, tile tokens):\n");
  for (int dtype = 0; dtype < 2; ++dtype)
    for (int D : {64, 128, 256})
      for (int M : {16, 32, 64}) {
        if (D == 256 && M == 64) continue;
        const hfc_prefix_info info = setup(dtype, D, M);
        std::printf("  %s D=%3d M=%2d: %d CTAs/SM, %6d B, %2d tok\n", dtype == 0 ? "bf16" : "fp16", D, M,
                    info.ctas_per_sm, info.smem_bytes, info.tile_tokens);
      }

  std::printf("\ncorrectness (per-chunk partials vs a float32 CPU reference; chunks with and without tokens):\n");
  unsigned seed = 1;
  for (int dtype = 0; dtype < 2; ++dtype)
    for (int D : {64, 128, 256})
      for (int M : {16, 32, 64}) {
        if (D == 256 && M == 64) continue;
        check_case(dtype, D, M, (M == 32) ? 64 : 16, seed++);
      }
  if (timing) {
    time_shape(8, iters);
    time_shape(16, iters);
  }
  std::printf("\n%s (%d failure%s)\n", g_failures ? "FAIL" : "ALL PASS", g_failures, g_failures == 1 ? "" : "s");
  return g_failures ? 1 : 0;
}
