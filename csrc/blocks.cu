// A static decode layout's per-step block bookkeeping in one launch: what hf_cascade/decode/whole_step.py `advance`
// runs as ~80 tiny torch kernels (device_blocks.reorder, device_blocks.append, the copy of the step's plan into the
// layout's plan buffers, the peak of blocks in use), value for value, including the overflow contract (the module
// docstring of hf_cascade/decode/device_blocks.py is the spec). One CTA of 1024 threads, thread i owning row i
// (R <= 1024): no host read, a fixed grid, no allocation, so the launch is captured with the rest of the step.
//
// Phases (each ends at a CTA barrier, which also makes the global writes before it visible to the whole CTA):
// 1. the reorder, unless a flag is set: tables gathered by parents one tile of columns at a time through shared
//    memory (every read of a tile before any write to it); reference counts updated only where an entry changes
//    (integer adds commute: the same counts as rebuilding them);
// 2. per row: copy-on-write (the j-th partly filled sharer of a block copies while count - j > 1), the rows that
//    take a new id and their ranks (a CTA scan: the k-th requesting row takes the k-th lowest free id);
// 3. the pool: free ids (count 0) counted per chunk of 4096 ids by the warps, the chunks' running totals scanned,
//    then only the chunks holding the first n_need free ids scanned id by id;
// 4. the flag (pool, then levels, then capacity; off for an inactive step), the commit, the plan (write slots,
//    copy pairs padded as the host pads, suffix tables from the committed state), the peak.

#include "hfc/errors.h"
#include "hfc/launch.h"

#include <cstdint>

namespace hfc {
namespace {

constexpr int kBlocksThreads = 1024;          // one CTA; thread i owns row i
constexpr int kTileInts = 4096;               // the reorder's tile of table entries in shared memory
constexpr int kChunk = 4 * kBlocksThreads;    // pool ids per chunk: 4 per thread when a chunk is scanned id by id
constexpr int kMaxChunks = 2 * kBlocksThreads;  // chunk totals scanned 2 per thread
constexpr unsigned kAll = 0xffffffffu;
constexpr int kPoolExhausted = 1, kLeftLevels = 2, kOutgrown = 4;   // hf_cascade/decode/device_blocks.py


// The exclusive prefix sum of v over the CTA's 1024 threads; *total gets the sum. Every thread must call it.
__device__ __forceinline__ int cta_scan(int v, int* warp_sums, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int x = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(kAll, x, off);
    if (lane >= off) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = warp_sums[lane];
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(kAll, w, off);
      if (lane >= off) w += y;
    }
    warp_sums[lane] = w;
  }
  __syncthreads();
  const int before = (warp ? warp_sums[warp - 1] : 0) + x - v;
  *total = warp_sums[31];
  __syncthreads();  // (warp_sums is the next scan's)
  return before;
}

// One row's suffix table (the blocks after its first `skip`) and q_limit, from the committed state.
__device__ __forceinline__ void suffix(const BlocksAdvanceArgs& a, const int64_t* skip_blocks, int64_t width,
                                      int32_t* table, int32_t* q_limit, int64_t length, bool row) {
  const int64_t W = a.width, bs = a.block_size, n = a.rows * width;
  for (int64_t k = threadIdx.x; k < n; k += kBlocksThreads) {
    const int64_t r = k / width, c = k % width, skip = skip_blocks[r];
    const bool held = c < (a.lengths[r] + bs - 1) / bs - skip;
    table[k] = held ? a.tables[r * W + min(skip + c, W - 1)] : -1;
  }
  if (row) q_limit[threadIdx.x] = (int32_t)(length - skip_blocks[threadIdx.x] * bs);
}

__global__ void __launch_bounds__(kBlocksThreads, 1) blocks_advance_kernel(const BlocksAdvanceArgs a) {
  __shared__ int tile[kTileInts];
  __shared__ int parent_s[kBlocksThreads];
  __shared__ int last_s[kBlocksThreads];    // a partly filled row's last block, -1 for a row that is not
  __shared__ int col_s[kBlocksThreads];     // the column the row's new token goes to
  __shared__ int value_s[kBlocksThreads];   // the id the append leaves there
  __shared__ int free_ids[kBlocksThreads];  // the lowest free ids, in order
  __shared__ int chunk_end[kMaxChunks];     // free ids per chunk, then their running total (inclusive)
  __shared__ int warp_sums[32];
  __shared__ int positives_s;               // ids in use after the reorder
  __shared__ int64_t fill_s[3];             // the first copying row's source and destination; row 0's write block

  const int t = threadIdx.x;
  const int R = (int)a.rows, P = (int)a.pool_blocks;
  const int64_t W = a.width, bs = a.block_size;
  const bool row = t < R;
  const int flags0 = *a.flags;
  const bool live = flags0 == 0;            // (once a flag is set, the reorder and every append are no-ops)
  for (int c = t; c < kMaxChunks; c += kBlocksThreads) chunk_end[c] = 0;
  if (t == 0) positives_s = 0;

  // ---- 1. the reorder: row i takes row parents[i]'s table and length
  int64_t length = 0;
  if (row) {
    const int p = (int)a.parents[t];
    parent_s[t] = p;
    length = a.lengths[live ? p : t];
  }
  __syncthreads();
  if (live) {
    if (row) a.lengths[t] = length;
    const int cols = kTileInts / R;
    for (int64_t c0 = 0; c0 < W; c0 += cols) {
      const int tc = (int)min((int64_t)cols, W - c0), n = R * tc;
      for (int k = t; k < n; k += kBlocksThreads) tile[k] = a.tables[(k / tc) * W + c0 + k % tc];
      __syncthreads();
      for (int k = t; k < n; k += kBlocksThreads) {
        const int r = k / tc, c = k % tc, p = parent_s[r];
        const int old = tile[k], now = tile[p * tc + c];
        if (now == old) continue;
        a.tables[r * W + c0 + c] = now;
        // (a -1 entry counts nowhere: the torch code counts it in slot P, which it keeps at 0)
        if (now >= 0 && now < P) atomicAdd(a.refcount + now, 1);
        if (old >= 0 && old < P) atomicSub(a.refcount + old, 1);
      }
      __syncthreads();
    }
  }

  // ---- 2. each row's append on the reordered state
  bool partial = false, cow = false, need = false;
  int last = P, col = 0, kept = 0, same = 0, last_count = 0;
  if (row) {
    partial = length % bs != 0;
    const int64_t last_col = min(max(length - 1, (int64_t)0) / bs, W - 1);
    const int v = a.tables[t * W + last_col];
    last = v >= 0 && v <= P ? v : P;
    col = (int)min(length / bs, W - 1);
    kept = a.tables[t * W + col];
    last_s[t] = partial ? last : -1;
  }
  __syncthreads();
  if (row && partial) {
    for (int j = 0; j < t; ++j) same += last_s[j] == last;
    last_count = a.refcount[last];
    cow = last_count - same > 1;
  }
  need = row && (cow || !partial);      // at most one new id per row: a copy or a fresh block
  int totals;
  const int before = cta_scan((need ? 1 : 0) | (cow ? 1 << 16 : 0), warp_sums, &totals);   // (R <= 1024 < 2^16)
  const int rank = before & 0xffff, slot = before >> 16, n_need = totals & 0xffff, n_cow = totals >> 16;

  // ---- 3. the pool's free ids (and the ids in use, for the peak)
  const int chunks = (P + kChunk - 1) / kChunk;
  {
    const int warp = t / 32, lane = t % 32;
    int positives = 0;
    for (int c = warp; c < chunks; c += kBlocksThreads / 32) {
      const int base = c * kChunk, end = min(kChunk, P - base);
      int zeros = 0;
#pragma unroll 8
      for (int k = lane; k < end; k += 32) {
        const int v = a.refcount[base + k];
        zeros += v == 0;
        positives += v > 0;
      }
      zeros = __reduce_add_sync(kAll, zeros);
      if (lane == 0) chunk_end[c] = zeros;
    }
    positives = __reduce_add_sync(kAll, positives);
    if (lane == 0) atomicAdd(&positives_s, positives);
  }
  __syncthreads();
  int total_free;
  {
    const int x = chunk_end[2 * t], y = chunk_end[2 * t + 1];
    const int run = cta_scan(x + y, warp_sums, &total_free);
    chunk_end[2 * t] = run + x;
    chunk_end[2 * t + 1] = run + x + y;
  }
  __syncthreads();
  const int target = min(n_need, total_free);
  for (int found = 0; found < target;) {     // (uniform: every thread reads the same running totals)
    int lo = 0, hi = chunks - 1;             // the chunk holding free rank `found`
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (chunk_end[mid] > found) hi = mid; else lo = mid + 1;
    }
    const int base = lo * kChunk + 4 * t;
    int v[4], zeros = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[k] = base + k < P ? a.refcount[base + k] : 1;
      zeros += v[k] == 0;
    }
    int unused;
    int q = (lo ? chunk_end[lo - 1] : 0) + cta_scan(zeros, warp_sums, &unused);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (v[k] != 0) continue;
      if (q < target) free_ids[q] = base + k;
      ++q;
    }
    found = chunk_end[lo];
  }
  __syncthreads();

  // ---- 4. the step's ids, its flag, the commit and the plan
  const bool pool_short = n_need > total_free;
  int id = P, value = kept;                  // value: the entry at (row, col) after the append
  if (need) {
    id = min(rank < total_free ? free_ids[rank] : P, max(P - 1, 0));
    value = id;
  }
  if (row) {
    col_s[t] = col;
    value_s[t] = value;
  }
  __syncthreads();
  bool mismatch = false;                     // a grouped row no longer holds its frozen prefix blocks
  for (int64_t k = t; k < a.checks; k += kBlocksThreads) {
    if (!a.check_used[k]) continue;
    const int64_t r = a.check_rows[k], c = a.check_cols[k];
    mismatch |= (c == col_s[r] ? value_s[r] : a.tables[r * W + c]) != a.check_ids[k];
  }
  const bool left = __syncthreads_or(mismatch);
  bool over = false;
  if (row) {
    const int64_t blocks = (length + 1 + bs - 1) / bs;
    over = length + 1 > *a.token_limit || blocks - a.row_prefix_blocks[t] > a.suffix_width ||
           (a.inner_width > 0 && blocks - a.row_inner_blocks[t] > a.inner_width);
  }
  const bool outgrown = __syncthreads_or(over);
  const bool active = !*a.done;
  const int flag = !active ? 0 : pool_short ? kPoolExhausted : left ? kLeftLevels : outgrown ? kOutgrown : 0;
  const bool ok = live && flag == 0 && active;
  if (t == 0) {
    if (live) *a.flags = flag;               // (sticky: a set flag stays)
    *a.steps += ok ? 1 : 0;
  }
  const int64_t offset = length % bs;       // (taken before the commit lengthens the row)
  if (ok && row) {
    a.tables[t * W + col] = value;
    a.lengths[t] = length + 1;
    if (cow) atomicSub(a.refcount + last, 1);
    if (need) a.refcount[id] = 1;
    length += 1;
  }
  if (cow && slot == 0) {
    fill_s[0] = last;
    fill_s[1] = id;
  }
  if (t == 0) fill_s[2] = ok ? value : P;
  __syncthreads();
  // a copied block left with no holder (never, where the counts are the tables' entries: kept exact anyway)
  const int emptied = __syncthreads_count(ok && cow && same == 0 && last_count > 0 && a.refcount[last] <= 0);
  if (t == 0) {
    a.refcount[P] = 0;
    const int64_t in_use = positives_s + (ok ? n_need - emptied : 0);   // (the ids taken were free)
    if (in_use > *a.peak) *a.peak = in_use;
  }

  // write slots and copy pairs: a failed or inactive step's all name the scratch block P; the pairs padded to R
  // with the first pair, or with none, row 0's write block copied onto itself
  if (row) {
    a.write_block[t] = ok ? value : P;
    a.write_offset[t] = ok ? offset : 0;
    if (cow) {
      a.copy_src[slot] = ok ? last : P;
      a.copy_dst[slot] = ok ? id : P;
    }
    if (t >= n_cow) {
      const int64_t src = n_cow ? fill_s[0] : fill_s[2], dst = n_cow ? fill_s[1] : src;
      a.copy_src[t] = ok ? src : P;
      a.copy_dst[t] = ok ? dst : P;
    }
  }
  suffix(a, a.row_prefix_blocks, a.suffix_width, a.suffix_table, a.q_limit, length, row);
  if (a.inner_width > 0)
    suffix(a, a.row_inner_blocks, a.inner_width, a.inner_suffix_table, a.inner_q_limit, length, row);
}

}  // namespace

cudaError_t blocks_advance_launch(const BlocksAdvanceArgs& in, cudaStream_t stream) {
  const int64_t R = in.rows, P = in.pool_blocks;
  if (R < 1 || R > kBlocksThreads || in.width < 1 || P < 1 || P > (int64_t)kChunk * kMaxChunks ||
      in.block_size < 1 || in.suffix_width < 0 || in.inner_width < 0 || in.checks < 0)
    return fail(cudaErrorInvalidValue,
                "blocks_advance: rows %lld (1..%d), width %lld, pool_blocks %lld (1..%lld), block_size %lld, "
                "suffix_width %lld, inner_width %lld, checks %lld",
                (long long)R, kBlocksThreads, (long long)in.width, (long long)P, (long long)kChunk * kMaxChunks,
                (long long)in.block_size, (long long)in.suffix_width, (long long)in.inner_width, (long long)in.checks);
  if (!in.tables || !in.lengths || !in.refcount || !in.flags || !in.steps || !in.token_limit ||
      !in.row_prefix_blocks || !in.row_inner_blocks || !in.parents || !in.done || !in.peak || !in.q_limit ||
      (in.suffix_width > 0 && !in.suffix_table) || !in.write_block || !in.write_offset || !in.copy_src ||
      !in.copy_dst || (in.inner_width > 0 && (!in.inner_suffix_table || !in.inner_q_limit)) ||
      (in.checks > 0 && (!in.check_rows || !in.check_cols || !in.check_ids || !in.check_used)))
    return fail(cudaErrorInvalidValue, "blocks_advance: a NULL pointer");
  blocks_advance_kernel<<<1, kBlocksThreads, 0, stream>>>(in);
  return cudaGetLastError();
}

}  // namespace hfc
