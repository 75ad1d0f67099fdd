// Level 0, the shared prefix: all of a group's query rows for one KV head against a chunk of the group's prefix,
// on tensor cores. Semantics: hf_cascade/kernels/reference.py (prefix_attention); layouts: csrc/include/hfc/params.h.
//
// Grid: one CTA per (prefix chunk x row tile, KV head, group). A CTA takes up to M query rows (rows x Lq x GQA
// group, M = 16/32/64) and the chunk's tokens [chunk x chunk_tokens, ...) of the group's prefix, and writes one
// partial (O fp32 normalised, LSE fp32 base 2) per query row into slot `chunk`; a chunk with no tokens writes
// O = 0, LSE = -inf. Rows in no group are never written. K/V tokens that are not valid are never read (zero
// filled in shared memory), so garbage (even NaN) in unused pool slots cannot leak into the result.
//
// FlashAttention-2 style (this replaced a WMMA kernel that kept S and P in shared memory: 81-114 KB per CTA,
// 2 CTAs per SM, one 32 KB K/V tile in flight each, ~64 KB outstanding per SM, about half of what HBM3e needs;
// benchmarks/RESULTS.md has the comparison):
//   * S = Q K^T and O += P V with mma.sync.m16n8k16 (inline PTX, fp32 accumulate), operands loaded
//     with ldmatrix from an XOR-swizzled shared layout (16-byte chunk c of row r at c ^ (r & 7): no bank
//     conflicts and no padding); S, P, the running max/sum and O live in registers; P is re-packed from
//     the S accumulators into the A fragment of the P V product without touching shared memory.
//   * shared memory holds only Q and a STAGES-deep ring of small K/V tiles (16 KB each), filled by
//     cp.async (zero-fill form for invalid tokens: nothing is read for them); one barrier per tile.
//     Result (D 128, 32 rows): 72 KB per CTA, 3 CTAs per SM, 3 tiles in flight per CTA = 144 KB
//     outstanding per SM; D 128 / 64 rows: 96 KB, 2 CTAs, 4 tiles in flight = 128 KB.
//   * warps: WM = M/16 warps along the rows (16 rows each), WN = 4/WM along the tokens. A tile's tokens
//     are cut into sub-tiles of KW >= 16 tokens (one mma k step or more); sub-tile `gs` (counted over
//     the whole chunk) belongs to warp column gs % WN. Each warp keeps its own online softmax over its
//     sub-tiles; the WN partial states of a row are merged through shared memory at the end (the K/V
//     ring is idle then). So 16- and 32-row tiles keep all 4 warps busy without splitting D.
//   * an fp8 pool (F8, HFC_KV_FP8_E4M3): the ring holds the fp8 bytes as they are in the pool, filled by the same
//     16-byte cp.async (16 elements per copy, twice bf16's), so the same shared memory holds twice the stages (2 x
//     STAGES - 1 tiles in flight per CTA). The bytes are converted in registers, straight into the MMA operands: an
//     ldmatrix over the fp8 tile (its b16 units are pairs of bytes) gives each lane 4 bytes, converted pairwise
//     (__nv_cvt_fp8x2_to_halfraw2: cvt.rn.f16x2.e4m3x2; bf16 from that f16 pair by an exact re-biasing, see
//     fp8x2_to<T>). For S = Q K^T a lane's 4 bytes are 4 consecutive dims of one token, so the k order of every
//     16-dim step is permuted (slots 2j, 2j+1 <- dims 4j, 4j+1; slots 8+2j, 8+2j+1 <- dims 4j+2, 4j+3), and Q's A
//     fragments are read in the same order (two 8-byte loads instead of ldmatrix). For O += P V the transposed
//     ldmatrix gives 2 tokens x 2 dims, regrouped by one byte permute into the B pairs of two output columns: O's
//     n-tiles then hold dims 2g and 2g + 1 of each 16-dim chunk (undone in the epilogue, where a lane's 4 values of
//     a chunk are 4 consecutive dims). K's scale of the CTA's KV head joins scale_log2, V's scales the output: once
//     per CTA, never per element. Default configuration only (tune 0).
// Not chosen here: TMA / cp.async.bulk (a paged gather of 256-byte rows needs one bulk copy per token and
// block table: no gain over cp.async at these sizes). On Hopper, bf16/fp16 head_dim-128 layers with >= 16 query
// rows per group run csrc/prefix_sm90.cu instead (wgmma on 64-row tiles fed by a producer warp): this kernel's
// ldmatrix re-reads of each K/V tile per 16 rows and its per-tile barrier kept it near 57% of the DRAM peak there.

#include "hfc/common.cuh"
#include "hfc/dispatch.h"
#include "hfc/launch.h"

#include <type_traits>

namespace hfc {
namespace {

// Tuning variants for a sweep (hfc_prefix_params.tune; hf_cascade.kernels.cuda_tuning.PREFIX_VARIANTS names them):
// 0 is the configuration below, the default everywhere. The others trade CTAs per SM against tile size, ring
// depth and warps per CTA (bytes in flight and independent work per SM). They are compiled for bf16, head_dim
// 128 and the plain path only, for the row tiles with_tune lists (compile time); tests/test_prefix_tune.py checks
// that these tables and cuda.py's agree. A field of 0 keeps PrefixCfg's default. At D 128 (smem per CTA, CTAs/SM):
//   n64    64-token tiles (32 KB), 3 stages: fewer barriers, twice the tokens per warp sub-tile; 104 KB at 32 rows, 2
//   n64w8  n64 with 8 warps (128 registers): 64 rows get 2 warp columns; 112 KB at 64 rows, 2
//   w8     8 warps (128 registers), 5 stages of 32 tokens; 96 KB at 64 rows, 88 KB at 32 rows, 2
//   s3c4   3 stages, 4 CTAs (128 registers): 56 KB at 32 rows, 4
//   s6     6 stages: 5 tiles in flight per CTA; 104 KB at 32 rows, 2
template <int V> struct PrefixTune { static constexpr int N = 0, STAGES = 0, WARPS = 0, MIN_CTAS = 0; };
template <> struct PrefixTune<1> { static constexpr int N = 64, STAGES = 3, WARPS = 0, MIN_CTAS = 2; };  // n64
template <> struct PrefixTune<2> { static constexpr int N = 64, STAGES = 3, WARPS = 8, MIN_CTAS = 2; };  // n64w8
template <> struct PrefixTune<3> { static constexpr int N = 32, STAGES = 5, WARPS = 8, MIN_CTAS = 2; };  // w8
template <> struct PrefixTune<4> { static constexpr int N = 32, STAGES = 3, WARPS = 0, MIN_CTAS = 4; };  // s3c4
template <> struct PrefixTune<5> { static constexpr int N = 32, STAGES = 6, WARPS = 0, MIN_CTAS = 2; };  // s6

template <int D, int M, int V = 0>
struct PrefixCfg {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim");
  static_assert(M == 16 || M == 32 || M == 64, "row tile");
  using TV = PrefixTune<V>;
  static constexpr int WARPS = TV::WARPS ? TV::WARPS : kWarps;
  static constexpr int THREADS = WARPS * 32;
  static constexpr int WM = M / 16;                                  // warps along rows
  static constexpr int WN = WARPS / WM;                              // warps along tokens
  // tokens per K/V tile (16 KB K+V by default)
  static constexpr int N = TV::N ? TV::N : (D == 64) ? 64 : (D == 128) ? 32 : 16;
  static constexpr int KW = (N / WN >= 16) ? N / WN : 16;            // tokens per warp sub-tile
  static constexpr int SUB = N / KW;                                 // sub-tiles per K/V tile
  static constexpr int STAGES = TV::STAGES ? TV::STAGES : (D == 64) ? 4 : (D == 128) ? (M == 64 ? 5 : 4) : 5;
  // register cap
  static constexpr int MIN_CTAS = TV::MIN_CTAS ? TV::MIN_CTAS : (D == 256 || (D == 128 && M == 64)) ? 2 : 3;
  static constexpr int CH = D / 8;                                   // 16-byte chunks per row
  static constexpr int NT = KW / 8;                                  // n tiles of S per sub-tile
  static constexpr int DN = D / 8;                                   // n tiles of O
  static constexpr int TILE_ELEMS = 2 * N * D;                       // K then V
  static constexpr int Q_BYTES = M * D * 2;
  static constexpr int KV_OFF = align128(Q_BYTES);
  static constexpr int KV_BYTES = STAGES * TILE_ELEMS * 2;
  static constexpr int LDO = D + 8;                                  // O staging row stride (floats)
  static constexpr int O_BYTES = WN * M * LDO * 4;
  static constexpr int SMEM = KV_OFF + (KV_BYTES > O_BYTES ? KV_BYTES : O_BYTES);
  static constexpr int LD_TOK = THREADS / CH;                        // tokens per loader pass
  static constexpr int LD_PASSES = N / LD_TOK;
  // an fp8 pool: the ring's bytes hold twice the stages of fp8 tiles (one byte an element), D / 16 16-byte chunks a row
  static constexpr int F8_STAGES = 2 * STAGES;
  static constexpr int F8_TILE_BYTES = 2 * N * D;                    // K then V
  static constexpr int CH8 = D / 16;
  static constexpr int LD8_TOK = THREADS / CH8;
  static constexpr int LD8_PASSES = N / LD8_TOK;
  static_assert(F8_STAGES * F8_TILE_BYTES == KV_BYTES, "the fp8 ring fills the 16-bit ring's bytes");
  static_assert(LD8_TOK * CH8 == THREADS && LD8_PASSES * LD8_TOK == N, "fp8 loader tiling");
  static_assert(KW % 16 == 0 && N % KW == 0 && SUB * KW == N, "sub-tiling");
  static_assert(LD_TOK * CH == THREADS && LD_PASSES * LD_TOK == N, "loader tiling");
  static_assert(WM <= WARPS && WN * WM == WARPS, "warp grid");
  static_assert((2 * WN + 1) * M * 4 <= Q_BYTES, "softmax statistics must fit in the Q buffer");
  static_assert(CH % 8 == 0, "swizzle needs >= 8 chunks per row");
};

// element offset of 16-byte chunk c of row r in a [rows][D] tile, XOR-swizzled
template <int D>
__device__ __forceinline__ int swz(int r, int c) { return r * D + ((c ^ (r & 7)) << 3); }

// byte offset of 16-byte chunk c of row r in an fp8 [rows][D] tile: the tile's chunks in order, the low three bits of
// the index XOR-ed with the row's, so the 8 rows an ldmatrix reads (any D of 64, 128, 256) hit 8 distinct bank groups
template <int D>
__device__ __forceinline__ int swz8(int r, int c) { return ((r * (D / 16) + c) ^ (r & 7)) << 4; }


__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}

// c[0..3] += A(16x16, row) * B(16x8, col), fp32 accumulate; A = 4 x (2 elements), B = 2 x (2 elements)
template <typename T> struct Mma;
template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <> struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), with
// g = lane >> 2, q4 = lane & 3:
//   A regs a[0..3]: (row g, cols 2q4..+1), (row g+8, cols 2q4..+1), (row g, cols 8+2q4..), (row g+8, 8+2q4..)
//   B regs b0, b1:  (k 2q4..+1, col g), (k 8+2q4..+1, col g)
//   C c[0..3]:      (row g, cols 2q4, 2q4+1), (row g+8, cols 2q4, 2q4+1)
// ldmatrix .x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i, register i holds its
// (row lane>>2, cols 2q4..+1); with .trans it holds (rows 2q4..+1, col lane>>2) instead.
//   Q (A of S):  matrix i = rows 8(i&1).., d chunk 2kk + (i>>1)      -> a[0..3] as above
//   K (B of S):  matrix i = tokens 8(i>>1).., d chunk 2kk + (i&1)    -> b0, b1 of token n-tile 0, then 1
//   V (B of PV, .trans): matrix i = tokens 8(i&1).., d chunk 2dp + (i>>1) -> b0, b1 of d n-tile 0, then 1
//   P (A of PV): S n-tiles 2j, 2j+1 of the sub-tile: a = {pack(c0,c1) of 2j, pack(c2,c3) of 2j,
//                pack(c0,c1) of 2j+1, pack(c2,c3) of 2j+1} (probabilities() in csrc/include/hfc/common.cuh).

// VAR: the per-layer variants (csrc/include/hfc/params.h) are compiled in; the plain instantiation (VAR false)
// is the same code as before they existed. cap_out > 0: softcap, logit = cap_out x tanh(cap_in x q.k) (log2
// domain); window > 0: query row sees the prefix tokens >= prefix_len + q_limit[row, lq] - window. F8: the pool holds
// float8_e4m3fn with kv_scale (see the header).
template <typename T, int D, int M, bool VAR, int V = 0, bool F8 = false>
__global__ void __launch_bounds__(PrefixCfg<D, M, V>::THREADS, PrefixCfg<D, M, V>::MIN_CTAS)
prefix_kernel(const __grid_constant__ hfc_prefix_params p) {
  using KV = std::conditional_t<F8, uint8_t, T>;     // a pool element
  const T* __restrict__ q = static_cast<const T*>(p.q);
  const KV* __restrict__ pool = static_cast<const KV*>(p.pool);
  const int* __restrict__ group_rows = p.group_rows;
  const int* __restrict__ prefix_table = p.prefix_table;
  const int* __restrict__ prefix_len = p.prefix_len;
  const int* __restrict__ q_limit = p.q_limit;
  float* __restrict__ part_o = p.part_o;
  float* __restrict__ part_lse = p.part_lse;
  const int R = (int)p.R, Lq = (int)p.Lq, Hq = (int)p.Hq, Hkv = (int)p.Hkv, bs = (int)p.block_size;
  const int Rg = (int)p.Rg, Mp = (int)p.Mp, chunk_tokens = (int)p.chunk_tokens, row_tiles = (int)p.row_tiles;
  const int window = (int)p.window;
  // F8: the stored K of KV head blockIdx.y times its scale is the real K (a scalar of the scores, folded in once);
  // V's scale is applied to the output once, in the epilogue
  float scale_log2 = p.scale_log2, v_scale = 1.0f;
  if constexpr (F8) {
    scale_log2 *= __ldg(p.kv_scale + blockIdx.y);
    v_scale = __ldg(p.kv_scale + p.Hkv + blockIdx.y);
  }
  // softcap: cap x tanh(scale q.k / cap) in the log2 domain (in double, as the host did before)
  float cap_in = 0.0f, cap_out = 0.0f;
  if constexpr (VAR) {
    if (p.softcap > 0.0f) {
      cap_in = (float)(scale_log2 * 0.6931471805599453 / p.softcap);
      cap_out = (float)(p.softcap * 1.4426950408889634);
    }
  }
  using C = PrefixCfg<D, M, V>;
  constexpr int N = C::N, KW = C::KW, NT = C::NT, DN = C::DN, CH = C::CH;
  constexpr int STAGES = F8 ? C::F8_STAGES : C::STAGES;     // ring slots (tiles)
  constexpr int TILE = F8 ? C::F8_TILE_BYTES : C::TILE_ELEMS * 2;   // bytes of one ring slot
  extern __shared__ __align__(128) unsigned char smem[];
  T* Q_s = reinterpret_cast<T*>(smem);
  unsigned char* KV_s = smem + C::KV_OFF;           // the ring: STAGES slots of TILE bytes (K then V)

  const int tile = blockIdx.x % row_tiles;
  const int chunk = blockIdx.x / row_tiles;
  const int h = blockIdx.y;
  const int g = blockIdx.z;
  const int grp = Hq / Hkv;
  const int per_row = Lq * grp;
  const int rows_q = Rg * per_row;
  const int rows_here = min(M, rows_q - tile * M);
  if (rows_here <= 0) return;  // a row tile past the group's rows: nothing to write
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;

  // query row m of this tile -> its partial's item index (R, Lq, Hq flattened), or -1
  auto item_of = [&](int m) -> int64_t {
    const int mg = tile * M + m;
    if (m >= rows_here) return -1;
    const int rg = mg / per_row, rem = mg - rg * per_row;
    const int lq = rem / grp, j = rem - lq * grp;
    const int row = __ldg(group_rows + (int64_t)g * Rg + rg);
    if (row < 0) return -1;
    return (((int64_t)chunk * R + row) * Lq + lq) * Hq + (int64_t)h * grp + j;
  };

  const int plen = __ldg(prefix_len + g);
  const int t_begin = chunk * chunk_tokens;
  // first token the CTA reads: with a window, the tile holding the earliest token any of its rows sees
  int t_first = t_begin;
  // the first prefix token of this lane's two rows (g, g + 8 of its warp's 16) inside the window
  int win_lo[2] = {0, 0};
  if constexpr (VAR) {
    if (window > 0) {
      auto row_start = [&](int m) -> int {  // INT_MAX: a padding row (sees nothing, never written)
        if (m >= rows_here) return 0x7fffffff;
        const int mg = tile * M + m;
        const int rg = mg / per_row, lq = (mg - rg * per_row) / grp;
        const int row = __ldg(group_rows + (int64_t)g * Rg + rg);
        if (row < 0) return 0x7fffffff;
        return plen + __ldg(q_limit + (int64_t)row * Lq + lq) - window;
      };
      const int wrow = (warp / C::WN) * 16 + (lane >> 2);
      win_lo[0] = row_start(wrow);
      win_lo[1] = row_start(wrow + 8);
      // CTA-wide minimum through the K/V ring (nothing is in flight yet), so every thread skips the same tiles
      int lo = 0x7fffffff;
      for (int m = tid; m < rows_here; m += C::THREADS) lo = min(lo, row_start(m));
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) lo = min(lo, __shfl_xor_sync(kFull, lo, off));
      int* red = reinterpret_cast<int*>(smem + C::KV_OFF);
      if (lane == 0) red[warp] = lo;
      __syncthreads();
#pragma unroll
      for (int w = 0; w < C::WARPS; ++w) lo = min(lo, red[w]);
      __syncthreads();  // everyone has read red[] before the ring is filled
      if (lo > t_begin)
        t_first = lo - t_begin >= chunk_tokens ? t_begin + chunk_tokens : t_begin + (lo - t_begin) / N * N;
    }
  }
  // a chunk with no tokens (or none inside any row's window): O = 0, LSE = -inf (uniform over the CTA)
  if (t_begin >= plen || (VAR && t_first >= min(t_begin + chunk_tokens, plen))) {
    for (int i = tid; i < M * (D / 4); i += C::THREADS) {
      const int m = i / (D / 4), v = i % (D / 4);
      const int64_t item = item_of(m);
      if (item < 0) continue;
      *reinterpret_cast<float4*>(part_o + item * D + v * 4) = make_float4(0.f, 0.f, 0.f, 0.f);
      if (v == 0) part_lse[item] = neg_inf();
    }
    return;
  }
  const int t_end = min(t_begin + chunk_tokens, plen);
  const int64_t slot_stride = (int64_t)Hkv * D;     // between token slots of a block
  const int64_t kv_stride = (int64_t)bs * Hkv * D;  // V after K inside a block
  const int* table = prefix_table + (int64_t)g * Mp;
  const KV* pool_h = pool + (int64_t)h * D;

  // ---- queries of this row tile -> Q_s (swizzled; zero rows for padding), in the first cp.async group
  for (int i = tid; i < M * CH; i += C::THREADS) {
    const int m = i / CH, c = i % CH;
    const int mg = tile * M + m;
    const T* src = q;
    int bytes = 0;
    if (m < rows_here) {
      const int rg = mg / per_row, rem = mg - rg * per_row;
      const int lq = rem / grp, j = rem - lq * grp;
      const int row = __ldg(group_rows + (int64_t)g * Rg + rg);
      if (row >= 0) {
        src = q + (((int64_t)row * Lq + lq) * Hq + (int64_t)h * grp + j) * D + c * 8;
        bytes = 16;
      }
    }
    cp_async16_zfill(Q_s + swz<D>(m, c), src, bytes);
  }

  // ---- K/V tile loader: tokens [t0, t0 + N) of the chunk into ring slot `stage`. Each thread always
  // copies chunk ld_c of tokens ld_n0 + p * LD_TOK. Tokens past the chunk end or in a -1 block are
  // zero-filled (src-size 0: no global read; the address passed is the pool's base, never dereferenced).
  const int ld_c = tid % CH, ld_n0 = tid / CH;
  auto load_tile = [&](int t0, int stage) {      // (the 16-bit pool's)
    T* Ks = reinterpret_cast<T*>(KV_s + stage * TILE);
    T* Vs = Ks + N * D;
#pragma unroll
    for (int p = 0; p < C::LD_PASSES; ++p) {
      const int n = ld_n0 + p * C::LD_TOK;
      const int t = t0 + n;
      int blk = -1;
      if (t < t_end) blk = __ldg(table + t / bs);
      const KV* ksrc = pool;
      const KV* vsrc = pool;
      int bytes = 0;
      if (blk >= 0) {
        ksrc = pool_h + ((int64_t)blk * 2 * bs + (t % bs)) * slot_stride + ld_c * 8;
        vsrc = ksrc + kv_stride;
        bytes = 16;
      }
      const int off = swz<D>(n, ld_c);
      cp_async16_zfill(Ks + off, ksrc, bytes);
      cp_async16_zfill(Vs + off, vsrc, bytes);
    }
  };
  // F8: the same, 16 fp8 bytes (16 dims) per copy: chunk ld8_c of tokens ld8_n0 + p * LD8_TOK, at swz8
  const int ld8_c = tid % C::CH8, ld8_n0 = tid / C::CH8;
  auto load_tile8 = [&](int t0, int stage) {
    unsigned char* Ks = KV_s + stage * TILE;
    unsigned char* Vs = Ks + N * D;
#pragma unroll
    for (int p = 0; p < C::LD8_PASSES; ++p) {
      const int n = ld8_n0 + p * C::LD8_TOK;
      const int t = t0 + n;
      int blk = -1;
      if (t < t_end) blk = __ldg(table + t / bs);
      const KV* ksrc = pool;
      const KV* vsrc = pool;
      int bytes = 0;
      if (blk >= 0) {
        ksrc = pool_h + ((int64_t)blk * 2 * bs + (t % bs)) * slot_stride + ld8_c * 16;
        vsrc = ksrc + kv_stride;
        bytes = 16;
      }
      const int off = swz8<D>(n, ld8_c);
      cp_async16_zfill(Ks + off, ksrc, bytes);
      cp_async16_zfill(Vs + off, vsrc, bytes);
    }
  };

  const int ntiles = (t_end - t_first + N - 1) / N;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ntiles) {
      if constexpr (F8) load_tile8(t_first + s * N, s);
      else load_tile(t_first + s * N, s);
    }
    cp_async_commit();  // always commit (possibly empty): group k <-> tile k
  }

  const int wm = warp / C::WN, wn = warp % C::WN;
  const bool active = wm * 16 < rows_here;  // warp-uniform: a warp of padding rows only skips the math
  const int lr = lane & 7, li = lane >> 3, q4 = lane & 3;
  const int q_row = wm * 16 + (li & 1) * 8 + lr;  // ldmatrix row of this lane for Q
  const int q_chunk = li >> 1;
  const int k_tok = (li >> 1) * 8 + lr;           // ... for K (non-transposed)
  const int k_chunk = li & 1;
  const int v_tok = (li & 1) * 8 + lr;            // ... for V (transposed)
  const int v_chunk = li >> 1;
  // F8: matrix li of an ldmatrix over the fp8 tile is tokens 8 (li & 1).. of 16-byte chunk li >> 1, for K and V alike
  const int f8_tok = (li & 1) * 8 + lr;
  const int f8_chunk = li >> 1;
  const int q8_row = wm * 16 + (lane >> 2);       // F8: this lane's Q row (and + 8) for the A fragments

  float o[DN][4];
#pragma unroll
  for (int dn = 0; dn < DN; ++dn)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[dn][e] = 0.0f;
  float m_run[2] = {neg_inf(), neg_inf()};  // rows g and g + 8 of the warp's 16
  float l_run[2] = {0.0f, 0.0f};            // this lane's share of the row sums (reduced at the end)

  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait<STAGES - 2>();  // this thread's copies of tile `it` have landed
    __syncthreads();              // everyone's have; everyone is done with tile it - 1 (its slot is free)
    const int nx = it + STAGES - 1;
    if (nx < ntiles) {
      if constexpr (F8) load_tile8(t_first + nx * N, nx % STAGES);
      else load_tile(t_first + nx * N, nx % STAGES);
    }
    cp_async_commit();
    if (!active) continue;
    const T* Ks = reinterpret_cast<const T*>(KV_s + (it % STAGES) * TILE);
    const T* Vs = Ks + N * D;
    const unsigned char* Ks8 = KV_s + (it % STAGES) * TILE;   // (F8's view of the same slot)
    const unsigned char* Vs8 = Ks8 + N * D;
#pragma unroll
    for (int s = 0; s < C::SUB; ++s) {
      if (C::WN > 1 && (it * C::SUB + s) % C::WN != wn) continue;
      const int tok0 = s * KW;                               // first token of the sub-tile in the tile
      const int valid = t_end - (t_first + it * N + tok0);   // valid tokens of the sub-tile (if < KW)
      if (valid <= 0) continue;

      // ---- S = Q K^T (16 rows x KW tokens, fp32)
      float sacc[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[nt][e] = 0.0f;
      if constexpr (F8) {
        // two 16-dim k steps per ldmatrix: b[i] holds dims 16 (2 kp + (i >> 1)) + 4 q4 .. + 3 of token g of n-tile
        // 2 tp + (i & 1); Q's A fragments in the same permuted k order (see the header)
#pragma unroll
        for (int kp = 0; kp < D / 32; ++kp) {
          uint32_t a[2][4];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int c = 2 * (2 * kp + j) + (q4 >> 1), e = 4 * (q4 & 1);
            const uint2 lo = *reinterpret_cast<const uint2*>(Q_s + swz<D>(q8_row, c) + e);
            const uint2 hi = *reinterpret_cast<const uint2*>(Q_s + swz<D>(q8_row + 8, c) + e);
            a[j][0] = lo.x;
            a[j][1] = hi.x;
            a[j][2] = lo.y;
            a[j][3] = hi.y;
          }
#pragma unroll
          for (int tp = 0; tp < KW / 16; ++tp) {
            uint32_t b[4];
            ldsm_x4(b, Ks8 + swz8<D>(tok0 + tp * 16 + f8_tok, 2 * kp + f8_chunk));
#pragma unroll
            for (int i = 0; i < 4; ++i)
              Mma<T>::run(sacc[2 * tp + (i & 1)], a[i >> 1], fp8x2_to<T>(b[i] & 0xffffu), fp8x2_to<T>(b[i] >> 16));
          }
        }
      } else {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          uint32_t a[4];
          ldsm_x4(a, Q_s + swz<D>(q_row, 2 * kk + q_chunk));
#pragma unroll
          for (int tp = 0; tp < KW / 16; ++tp) {
            uint32_t b[4];
            ldsm_x4(b, Ks + swz<D>(tok0 + tp * 16 + k_tok, 2 * kk + k_chunk));
            Mma<T>::run(sacc[2 * tp], a, b[0], b[1]);
            Mma<T>::run(sacc[2 * tp + 1], a, b[2], b[3]);
          }
        }
      }

      // ---- online softmax in registers (log2 domain); masked columns -> -inf
      float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = sacc[nt][e] * scale_log2;
          if constexpr (VAR) {
            if (cap_out > 0.0f) v = cap_out * tanhf(sacc[nt][e] * cap_in);
            if (window > 0 && t_first + it * N + tok0 + nt * 8 + 2 * q4 + (e & 1) < win_lo[e >> 1]) v = neg_inf();
          }
          if (valid < KW && nt * 8 + 2 * q4 + (e & 1) >= valid) v = neg_inf();
          sacc[nt][e] = v;
          mx[e >> 1] = fmaxf(mx[e >> 1], v);
        }
      float alpha[2], m_use[2], rsum[2] = {0.0f, 0.0f};
      online_max(mx, m_run, alpha, m_use);
      uint32_t pf[KW / 16][4];
      probabilities<T>(sacc, m_use, rsum, pf);
      rescale_state(l_run, o, alpha, rsum);

      // ---- O += P V
      if constexpr (F8) {
        // b[i]: tokens 8 (i & 1) + 2 q4, + 1 of the k step x dims 2g, 2g + 1 of chunk 2 cp + (i >> 1); one byte
        // permute makes the two tokens of each dim a pair: the B operands of o[2c] (dims 2g of chunk c) and o[2c + 1]
        // (dims 2g + 1)
#pragma unroll
        for (int jt = 0; jt < KW / 16; ++jt)
#pragma unroll
          for (int cp = 0; cp < D / 32; ++cp) {
            uint32_t b[4];
            ldsm_x4_t(b, Vs8 + swz8<D>(tok0 + jt * 16 + f8_tok, 2 * cp + f8_chunk));
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const int c = 2 * cp + j;
              const uint32_t lo = __byte_perm(b[2 * j], 0u, 0x3120);      // tokens 2 q4, + 1: dims 2g | 2g + 1
              const uint32_t hi = __byte_perm(b[2 * j + 1], 0u, 0x3120);  // tokens 8 + 2 q4, + 1
              Mma<T>::run(o[2 * c], pf[jt], fp8x2_to<T>(lo & 0xffffu), fp8x2_to<T>(hi & 0xffffu));
              Mma<T>::run(o[2 * c + 1], pf[jt], fp8x2_to<T>(lo >> 16), fp8x2_to<T>(hi >> 16));
            }
          }
      } else {
#pragma unroll
        for (int jt = 0; jt < KW / 16; ++jt)
#pragma unroll
          for (int dp = 0; dp < D / 16; ++dp) {
            uint32_t b[4];
            ldsm_x4_t(b, Vs + swz<D>(tok0 + jt * 16 + v_tok, 2 * dp + v_chunk));
            Mma<T>::run(o[2 * dp], pf[jt], b[0], b[1]);
            Mma<T>::run(o[2 * dp + 1], pf[jt], b[2], b[3]);
          }
      }
    }
  }

  // ---- epilogue: merge the WN warp columns' states of each row, normalise, write partials
  cp_async_wait<0>();  // only empty groups can be left; the ring and Q_s are reused below
  __syncthreads();
  float* m_s = reinterpret_cast<float*>(smem);   // [WN][M]   (in Q_s, idle now)
  float* l_s = m_s + C::WN * M;                   // [WN][M]
  float* lse_s = l_s + C::WN * M;                 // [M]
  float* O_s = reinterpret_cast<float*>(smem + C::KV_OFF);  // [WN][M][LDO]
  const int row0 = wm * 16 + (lane >> 2);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(kFull, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(kFull, l_run[r], 2);
  }
  if (q4 == 0) {
    m_s[wn * M + row0] = m_run[0];
    m_s[wn * M + row0 + 8] = m_run[1];
    l_s[wn * M + row0] = l_run[0];
    l_s[wn * M + row0 + 8] = l_run[1];
  }
  __syncthreads();
  float f[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    float mt = neg_inf();
#pragma unroll
    for (int w = 0; w < C::WN; ++w) mt = fmaxf(mt, m_s[w * M + row]);
    float lt = 0.0f;
#pragma unroll
    for (int w = 0; w < C::WN; ++w) {
      const float mw = m_s[w * M + row];
      if (mw != neg_inf()) lt += l_s[w * M + row] * exp2f(mw - mt);
    }
    f[r] = (m_run[r] == neg_inf() || !(lt > 0.0f)) ? 0.0f : exp2f(m_run[r] - mt) / lt;
    if constexpr (F8) f[r] *= v_scale;
    if (wn == 0 && q4 == 0) lse_s[row] = (lt > 0.0f) ? mt + log2f(lt) : neg_inf();
  }
  float* Ow = O_s + wn * M * C::LDO;
  if constexpr (F8) {      // o[2c], o[2c + 1] hold dims 16c + 4 q4 + {0, 2} and {1, 3}: 4 consecutive dims
#pragma unroll
    for (int c = 0; c < D / 16; ++c) {
      const int col = c * 16 + 4 * q4;
      const float* e = o[2 * c];
      const float* d = o[2 * c + 1];
      *reinterpret_cast<float4*>(Ow + row0 * C::LDO + col) =
          make_float4(e[0] * f[0], d[0] * f[0], e[1] * f[0], d[1] * f[0]);
      *reinterpret_cast<float4*>(Ow + (row0 + 8) * C::LDO + col) =
          make_float4(e[2] * f[1], d[2] * f[1], e[3] * f[1], d[3] * f[1]);
    }
  } else {
#pragma unroll
    for (int dn = 0; dn < DN; ++dn) {
      const int col = dn * 8 + 2 * q4;
      *reinterpret_cast<float2*>(Ow + row0 * C::LDO + col) = make_float2(o[dn][0] * f[0], o[dn][1] * f[0]);
      *reinterpret_cast<float2*>(Ow + (row0 + 8) * C::LDO + col) = make_float2(o[dn][2] * f[1], o[dn][3] * f[1]);
    }
  }
  __syncthreads();
  for (int i = tid; i < M * (D / 4); i += C::THREADS) {
    const int m = i / (D / 4), v = i % (D / 4);
    const int64_t item = item_of(m);
    if (item < 0) continue;
    float4 acc = *reinterpret_cast<const float4*>(O_s + m * C::LDO + v * 4);
#pragma unroll
    for (int w = 1; w < C::WN; ++w) {
      const float4 x = *reinterpret_cast<const float4*>(O_s + (w * M + m) * C::LDO + v * 4);
      acc.x += x.x;
      acc.y += x.y;
      acc.z += x.z;
      acc.w += x.w;
    }
    *reinterpret_cast<float4*>(part_o + item * D + v * 4) = acc;
    if (v == 0) part_lse[item] = lse_s[m];
  }
}

// The dynamic shared memory limit and carve-out are per-function attributes (one non-stream call each): set
// once per variant and device by hfc_prefix_setup, never on the launch path (CUDA-graph capture).
template <typename T, int D, int M, int V = 0>
cudaError_t setup_t(hfc_prefix_info* info) {
  using C = PrefixCfg<D, M, V>;
  auto kern = prefix_kernel<T, D, M, false, V>;
  // plain and variants, each for a 16-bit and an fp8 pool (a tuning variant has only the plain 16-bit path)
  decltype(kern) kerns[4] = {kern, kern, kern, kern};
  if constexpr (V == 0) {
    kerns[1] = prefix_kernel<T, D, M, true, V>;
    kerns[2] = prefix_kernel<T, D, M, false, V, true>;
    kerns[3] = prefix_kernel<T, D, M, true, V, true>;
  }
  cudaError_t err = cudaSuccess;
  for (auto k : kerns) {
    err = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM);
    if (err != cudaSuccess) return err;
    // several CTAs of up to ~100 KB each per SM: ask for the largest shared-memory carve-out
    err = cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    if (err != cudaSuccess) return err;
  }
  if (info == nullptr) return err;
  info->smem_bytes = C::SMEM;
  info->tile_tokens = C::N;
  int ctas = 0;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kern, C::THREADS, C::SMEM);
  info->ctas_per_sm = ctas;
  return err;
}

template <typename T, int D, int M, int V = 0>
cudaError_t launch_t(const hfc_prefix_params& p, cudaStream_t stream) {
  using C = PrefixCfg<D, M, V>;
  const long long gx = (long long)p.row_tiles * p.max_chunks;
  if (!fits_int(gx) || p.Hkv > 65535 || p.G > 65535) return cudaErrorInvalidConfiguration;
  dim3 grid((unsigned)gx, (unsigned)p.Hkv, (unsigned)p.G);
  const bool var = p.softcap > 0.0f || p.window > 0;
  const bool f8 = p.kv_dtype == HFC_KV_FP8_E4M3;
  auto kern = prefix_kernel<T, D, M, false, V>;
  if constexpr (V == 0) {
    if (f8) kern = var ? prefix_kernel<T, D, M, true, V, true> : prefix_kernel<T, D, M, false, V, true>;
    else if (var) kern = prefix_kernel<T, D, M, true, V>;
  } else if (f8) {
    return fail(cudaErrorInvalidValue, "prefix tuning variant %d reads no float8_e4m3fn pool (use 0)", V);
  } else if (var) {  // not compiled: a tuning variant serves the plain path only
    return fail(cudaErrorInvalidValue, "prefix tuning variant %d has no softcap / window instantiation (use 0)", V);
  }
  kern<<<grid, C::THREADS, C::SMEM, stream>>>(p);
  return cudaGetLastError();
}

// tune > 0: f(V, M) (std::integral_constant) for the compiled (variant, row tile) pairs, bf16 and head_dim 128 only;
// hf_cascade.kernels.cuda_tuning.PREFIX_VARIANTS lists the same pairs
template <typename F>
cudaError_t with_tune(int tune, int dtype, int head_dim, int m_tile, F&& f) {
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I3 = std::integral_constant<int, 3>;
  using I4 = std::integral_constant<int, 4>;
  using I5 = std::integral_constant<int, 5>;
  using M16 = std::integral_constant<int, 16>;
  using M32 = std::integral_constant<int, 32>;
  using M64 = std::integral_constant<int, 64>;
  if (dtype != HFC_BF16 || head_dim != 128)
    return fail(cudaErrorInvalidValue, "prefix tuning variant %d has no instantiation for dtype code %d, head_dim %d "
                "(compiled: bf16 = %d, head_dim 128)", tune, dtype, head_dim, HFC_BF16);
  switch (tune * 100 + m_tile) {
    case 116: return f(I1{}, M16{});
    case 132: return f(I1{}, M32{});
    case 164: return f(I1{}, M64{});
    case 232: return f(I2{}, M32{});
    case 264: return f(I2{}, M64{});
    case 332: return f(I3{}, M32{});
    case 364: return f(I3{}, M64{});
    case 416: return f(I4{}, M16{});
    case 432: return f(I4{}, M32{});
    case 532: return f(I5{}, M32{});
    case 564: return f(I5{}, M64{});
    default:
      return fail(cudaErrorInvalidValue, "prefix kernel code %d with m_tile %d has no instantiation (compiled: 0 "
                  "default; tuning variants 1: m 16/32/64, 2, 3: m 32/64, 4: m 16/32, 5: m 32/64; %d: the Hopper "
                  "kernel, m 64; %d: its fp8 code)", tune, m_tile, HFC_PREFIX_KERNEL_SM90, HFC_PREFIX_KERNEL_SM90_FP8);
  }
}

}  // namespace

cudaError_t prefix_setup(int dtype, int head_dim, int m_tile, int tune, hfc_prefix_info* info) {
  if (tune == HFC_PREFIX_KERNEL_SM90 || tune == HFC_PREFIX_KERNEL_SM90_FP8)
    return prefix_sm90_setup(dtype, head_dim, m_tile, tune == HFC_PREFIX_KERNEL_SM90_FP8, info);
  if (tune != 0)
    return with_tune(tune, dtype, head_dim, m_tile, [&](auto v, auto m) {
      return setup_t<__nv_bfloat16, 128, decltype(m)::value, decltype(v)::value>(info);
    });
  HFC_DISPATCH_DTYPE(dtype, T, HFC_DISPATCH_HEAD_DIM(head_dim, D, HFC_DISPATCH_M_TILE(D, m_tile, M,
      return setup_t<T, D, M>(info);)))
}

cudaError_t prefix_launch(const hfc_prefix_params& p, cudaStream_t stream) {
  if (!fits_int(p.R) || !fits_int(p.Lq) || !fits_int(p.Hq) || !fits_int(p.Hkv) || !fits_int(p.block_size) ||
      !fits_int(p.G) || !fits_int(p.Rg) || !fits_int(p.Mp) || !fits_int(p.chunk_tokens) ||
      !fits_int(p.max_chunks) || !fits_int(p.row_tiles))
    return cudaErrorInvalidValue;
  if (p.Hkv < 1 || p.Hq % p.Hkv != 0 || p.block_size < 1 || p.chunk_tokens < 1 || p.row_tiles < 1 || p.Lq < 1)
    return cudaErrorInvalidValue;
  if (p.window < 0 || (p.window > 0 && p.q_limit == nullptr) || !(p.softcap >= 0.0f)) return cudaErrorInvalidValue;
  if (p.R == 0 || p.G == 0 || p.Rg == 0 || p.Mp == 0 || p.max_chunks == 0) return cudaSuccess;  // nothing to do
  if (p.Rg * p.Lq * (p.Hq / p.Hkv) > p.row_tiles * (long long)p.m_tile) return cudaErrorInvalidValue;
  if (p.kv_dtype != HFC_KV_SAME && p.kv_dtype != HFC_KV_FP8_E4M3)
    return fail(cudaErrorInvalidValue, "prefix: kv_dtype code %d (compiled: %d the queries' dtype, %d float8_e4m3fn)",
                (int)p.kv_dtype, HFC_KV_SAME, HFC_KV_FP8_E4M3);
  if (p.kv_dtype == HFC_KV_FP8_E4M3 && (p.kv_scale == nullptr || (p.tune != 0 && p.tune != HFC_PREFIX_KERNEL_SM90_FP8)))
    return fail(cudaErrorInvalidValue, "prefix: a float8_e4m3fn pool needs kv_scale and the default kernel (tune 0) "
                "or the Hopper kernel's fp8 code (%d), got %d", HFC_PREFIX_KERNEL_SM90_FP8, (int)p.tune);
  if (p.tune == HFC_PREFIX_KERNEL_SM90 || p.tune == HFC_PREFIX_KERNEL_SM90_FP8) return prefix_sm90_launch(p, stream);
  if (p.tune != 0)
    return with_tune(p.tune, p.dtype, p.head_dim, p.m_tile, [&](auto v, auto m) {
      return launch_t<__nv_bfloat16, 128, decltype(m)::value, decltype(v)::value>(p, stream);
    });
  HFC_DISPATCH_DTYPE(p.dtype, T, HFC_DISPATCH_HEAD_DIM(p.head_dim, D, HFC_DISPATCH_M_TILE(D, p.m_tile, M,
      return launch_t<T, D, M>(p, stream);)))
}

}  // namespace hfc
