"""CPU emulation of prefix_kernel's index math (csrc/prefix.cu), written without a GPU.

A line-by-line transliteration of the kernel for one CTA at a time, lane by lane: the swizzled shared
layout, the cp.async loader (zero-fill), ldmatrix (.trans) and mma.m16n8k16 with the fragment layouts of
the PTX ISA, the warp roles (WM x WN, sub-tile rotation), the register online softmax and the epilogue
merge. Shared memory starts as NaN so a read of anything not written shows up. Arithmetic is float64
with no bf16 rounding of P, so the partials must match the float64 reference to ~1e-15. It checks the
index math only as far as the transliteration is faithful; the CUDA harness prefix_v2_check.cu is the
real test. Usage: python csrc/tests/prefix_v2_emulate.py   (about 15 s)
"""
import math

import numpy as np
NEG = -np.inf

def cfg(D, M):
    WM = M // 16; WN = 4 // WM
    N = 64 if D == 64 else 32 if D == 128 else 16
    KW = N // WN if N // WN >= 16 else 16
    SUB = N // KW
    STAGES = 4 if D == 64 else (5 if M == 64 else 4) if D == 128 else 5
    return dict(WM=WM, WN=WN, N=N, KW=KW, SUB=SUB, STAGES=STAGES, CH=D // 8, NT=KW // 8, DN=D // 8,
                LD_TOK=128 // (D // 8), LD_PASSES=N // (128 // (D // 8)), LDO=D + 8)

def swz(D, r, c): return r * D + ((c ^ (r & 7)) << 3)

def ldsm(smem, addrs, trans=False):
    # addrs[lane] = element offset of the row given by that lane; returns regs[lane][i] = (lo, hi)
    regs = [[None] * 4 for _ in range(32)]
    for i in range(4):
        mat = np.stack([smem[addrs[8 * i + r]: addrs[8 * i + r] + 8] for r in range(8)])  # 8x8
        for l in range(32):
            if not trans:
                regs[l][i] = (mat[l // 4, 2 * (l % 4)], mat[l // 4, 2 * (l % 4) + 1])
            else:
                regs[l][i] = (mat[2 * (l % 4), l // 4], mat[2 * (l % 4) + 1, l // 4])
    return regs

def mma(c, a, b0, b1):
    # c[lane][4] floats, a[lane][4] pairs, b0[lane], b1[lane] pairs
    A = np.zeros((16, 16)); B = np.zeros((16, 8)); C = np.zeros((16, 8))
    for l in range(32):
        g, t = l >> 2, l & 3
        for j in range(2):
            A[g, 2 * t + j] = a[l][0][j]; A[g + 8, 2 * t + j] = a[l][1][j]
            A[g, 8 + 2 * t + j] = a[l][2][j]; A[g + 8, 8 + 2 * t + j] = a[l][3][j]
            B[2 * t + j, g] = b0[l][j]; B[8 + 2 * t + j, g] = b1[l][j]
            C[g, 2 * t + j] = c[l][j]; C[g + 8, 2 * t + j] = c[l][2 + j]
    Dm = A @ B + C
    for l in range(32):
        g, t = l >> 2, l & 3
        c[l] = [Dm[g, 2 * t], Dm[g, 2 * t + 1], Dm[g + 8, 2 * t], Dm[g + 8, 2 * t + 1]]

def shfl_xor(vals, m): return [vals[l ^ m] for l in range(32)]

def run_cta(D, M, q, pool, group_rows, prefix_table, prefix_len, part_o, part_lse, R, Lq, Hq, Hkv, bs, Rg, Mp,
            chunk_tokens, row_tiles, scale_log2, bx, h, g):
    C = cfg(D, M); N, KW, NT, DN, CH, STAGES, WN, SUB = (C[k] for k in "N KW NT DN CH STAGES WN SUB".split())
    tile = bx % row_tiles; chunk = bx // row_tiles
    grp = Hq // Hkv; per_row = Lq * grp; rows_q = Rg * per_row
    rows_here = min(M, rows_q - tile * M)
    if rows_here <= 0: return
    def item_of(m):
        mg = tile * M + m
        if m >= rows_here: return -1
        rg, rem = divmod(mg, per_row); lq, j = divmod(rem, grp)
        row = group_rows[g * Rg + rg]
        if row < 0: return -1
        return ((chunk * R + row) * Lq + lq) * Hq + h * grp + j
    plen = prefix_len[g]; t_begin = chunk * chunk_tokens
    if t_begin >= plen:
        for m in range(M):
            it_ = item_of(m)
            if it_ < 0: continue
            part_o[it_ * D:(it_ + 1) * D] = 0; part_lse[it_] = NEG
        return
    t_end = min(t_begin + chunk_tokens, plen)
    slot_stride = Hkv * D; kv_stride = bs * Hkv * D
    Q_s = np.full(M * D, np.nan); KV = np.full(STAGES * 2 * N * D, np.nan)
    for i in range(M * CH):
        m, c = divmod(i, CH); mg = tile * M + m
        val = np.zeros(8)
        if m < rows_here:
            rg, rem = divmod(mg, per_row); lq, j = divmod(rem, grp)
            row = group_rows[g * Rg + rg]
            if row >= 0:
                base = ((row * Lq + lq) * Hq + h * grp + j) * D + c * 8
                val = q[base:base + 8]
        Q_s[swz(D, m, c): swz(D, m, c) + 8] = val
    def load_tile(t0, stage):
        Ks = stage * 2 * N * D; Vs = Ks + N * D
        for tid in range(128):
            ld_c, ld_n0 = tid % CH, tid // CH
            for p in range(C["LD_PASSES"]):
                n = ld_n0 + p * C["LD_TOK"]; t = t0 + n
                blk = prefix_table[g * Mp + t // bs] if t < t_end else -1
                off = swz(D, n, ld_c)
                if blk >= 0:
                    src = h * D + (blk * 2 * bs + t % bs) * slot_stride + ld_c * 8
                    KV[Ks + off:Ks + off + 8] = pool[src:src + 8]
                    KV[Vs + off:Vs + off + 8] = pool[src + kv_stride:src + kv_stride + 8]
                else:
                    KV[Ks + off:Ks + off + 8] = 0; KV[Vs + off:Vs + off + 8] = 0
    ntiles = (t_end - t_begin + N - 1) // N
    for s in range(STAGES - 1):
        if s < ntiles: load_tile(t_begin + s * N, s)
    warps = []
    for warp in range(4):
        warps.append(dict(o=[[[0.0] * 4 for _ in range(32)] for _ in range(DN)],
                          m=[[NEG, NEG] for _ in range(32)], l=[[0.0, 0.0] for _ in range(32)]))
    for it in range(ntiles):
        nx = it + STAGES - 1
        if nx < ntiles: load_tile(t_begin + nx * N, nx % STAGES)
        Kb = (it % STAGES) * 2 * N * D; Vb = Kb + N * D
        for warp in range(4):
            wm, wn = warp // WN, warp % WN
            if not (wm * 16 < rows_here): continue
            W = warps[warp]
            for s in range(SUB):
                if WN > 1 and (it * SUB + s) % WN != wn: continue
                tok0 = s * KW; valid = t_end - (t_begin + it * N + tok0)
                if valid <= 0: continue
                sacc = [[[0.0] * 4 for _ in range(32)] for _ in range(NT)]
                for kk in range(D // 16):
                    qa = [swz(D, wm * 16 + ((l >> 3) & 1) * 8 + (l & 7), 2 * kk + ((l >> 3) >> 1)) for l in range(32)]
                    a = ldsm(Q_s, qa)
                    for tp in range(KW // 16):
                        ka = [Kb + swz(D, tok0 + tp * 16 + ((l >> 3) >> 1) * 8 + (l & 7), 2 * kk + ((l >> 3) & 1)) for l in range(32)]
                        b = ldsm(KV, ka)
                        mma(sacc[2 * tp], a, [b[l][0] for l in range(32)], [b[l][1] for l in range(32)])
                        mma(sacc[2 * tp + 1], a, [b[l][2] for l in range(32)], [b[l][3] for l in range(32)])
                mx = [[NEG, NEG] for _ in range(32)]
                for nt in range(NT):
                    for l in range(32):
                        for e in range(4):
                            v = sacc[nt][l][e] * scale_log2
                            if valid < KW and nt * 8 + 2 * (l & 3) + (e & 1) >= valid: v = NEG
                            sacc[nt][l][e] = v
                            mx[l][e >> 1] = max(mx[l][e >> 1], v)
                alpha = [[0, 0] for _ in range(32)]; mu = [[0, 0] for _ in range(32)]
                for r in range(2):
                    col = [mx[l][r] for l in range(32)]
                    col = [max(a_, b_) for a_, b_ in zip(col, shfl_xor(col, 1))]
                    col = [max(a_, b_) for a_, b_ in zip(col, shfl_xor(col, 2))]
                    for l in range(32):
                        m_new = max(W["m"][l][r], col[l])
                        alpha[l][r] = 0.0 if W["m"][l][r] == NEG else 2.0 ** (W["m"][l][r] - m_new)
                        mu[l][r] = 0.0 if m_new == NEG else m_new
                        W["m"][l][r] = m_new
                pf = [[[None] * 4 for _ in range(32)] for _ in range(KW // 16)]
                rs = [[0.0, 0.0] for _ in range(32)]
                for nt in range(NT):
                    for l in range(32):
                        p = [2.0 ** (sacc[nt][l][e] - mu[l][e >> 1]) for e in range(4)]
                        rs[l][0] += p[0] + p[1]; rs[l][1] += p[2] + p[3]
                        pf[nt >> 1][l][(nt & 1) * 2 + 0] = (p[0], p[1])
                        pf[nt >> 1][l][(nt & 1) * 2 + 1] = (p[2], p[3])
                for l in range(32):
                    for r in range(2): W["l"][l][r] = W["l"][l][r] * alpha[l][r] + rs[l][r]
                    for dn in range(DN):
                        o = W["o"][dn][l]
                        o[0] *= alpha[l][0]; o[1] *= alpha[l][0]; o[2] *= alpha[l][1]; o[3] *= alpha[l][1]
                for jt in range(KW // 16):
                    for dp in range(D // 16):
                        va = [Vb + swz(D, tok0 + jt * 16 + ((l >> 3) & 1) * 8 + (l & 7), 2 * dp + ((l >> 3) >> 1)) for l in range(32)]
                        b = ldsm(KV, va, trans=True)
                        mma(W["o"][2 * dp], pf[jt], [b[l][0] for l in range(32)], [b[l][1] for l in range(32)])
                        mma(W["o"][2 * dp + 1], pf[jt], [b[l][2] for l in range(32)], [b[l][3] for l in range(32)])
    # epilogue
    m_s = np.full(WN * M, np.nan); l_s = np.full(WN * M, np.nan); lse_s = np.full(M, np.nan)
    LDO = C["LDO"]; O_s = np.full(WN * M * LDO, np.nan)
    for warp in range(4):
        wm, wn = warp // WN, warp % WN; W = warps[warp]
        for r in range(2):
            col = [W["l"][l][r] for l in range(32)]
            col = [a_ + b_ for a_, b_ in zip(col, shfl_xor(col, 1))]
            col = [a_ + b_ for a_, b_ in zip(col, shfl_xor(col, 2))]
            for l in range(32): W["l"][l][r] = col[l]
        for l in range(32):
            if l & 3 == 0:
                row0 = wm * 16 + (l >> 2)
                m_s[wn * M + row0] = W["m"][l][0]; m_s[wn * M + row0 + 8] = W["m"][l][1]
                l_s[wn * M + row0] = W["l"][l][0]; l_s[wn * M + row0 + 8] = W["l"][l][1]
    for warp in range(4):
        wm, wn = warp // WN, warp % WN; W = warps[warp]
        for l in range(32):
            row0 = wm * 16 + (l >> 2); f = [0, 0]
            for r in range(2):
                row = row0 + 8 * r
                mt = max(m_s[w * M + row] for w in range(WN))
                lt = sum(l_s[w * M + row] * 2.0 ** (m_s[w * M + row] - mt) for w in range(WN) if m_s[w * M + row] != NEG)
                f[r] = 0.0 if (W["m"][l][r] == NEG or not lt > 0) else 2.0 ** (W["m"][l][r] - mt) / lt
                if wn == 0 and (l & 3) == 0: lse_s[row] = mt + math.log2(lt) if lt > 0 else NEG
            for dn in range(DN):
                col = dn * 8 + 2 * (l & 3); o = W["o"][dn][l]; base = wn * M * LDO
                O_s[base + row0 * LDO + col: base + row0 * LDO + col + 2] = [o[0] * f[0], o[1] * f[0]]
                O_s[base + (row0 + 8) * LDO + col: base + (row0 + 8) * LDO + col + 2] = [o[2] * f[1], o[3] * f[1]]
    for m in range(M):
        it_ = item_of(m)
        if it_ < 0: continue
        acc = sum(O_s[(w * M + m) * LDO:(w * M + m) * LDO + D] for w in range(WN))
        part_o[it_ * D:(it_ + 1) * D] = acc; part_lse[it_] = lse_s[m]

def reference(D, q, pool, group_rows, prefix_table, prefix_len, R, Lq, Hq, Hkv, bs, G, Rg, Mp, chunk_tokens, max_chunks, scale_log2):
    grp = Hq // Hkv; out = {}
    P = pool.reshape(-1, 2, bs, Hkv, D); Q = q.reshape(R, Lq, Hq, D)
    for g in range(G):
        for c in range(max_chunks):
            t0 = c * chunk_tokens; t1 = min(t0 + chunk_tokens, prefix_len[g])
            for rg in range(Rg):
                row = group_rows[g * Rg + rg]
                if row < 0: continue
                for lq in range(Lq):
                    for hq in range(Hq):
                        item = ((c * R + row) * Lq + lq) * Hq + hq
                        if t1 <= t0: out[item] = (np.zeros(D), NEG); continue
                        ts = np.arange(t0, t1); blk = np.array([prefix_table[g * Mp + t // bs] for t in ts])
                        K = P[blk, 0, ts % bs, hq // grp]; V = P[blk, 1, ts % bs, hq // grp]
                        s = K @ Q[row, lq, hq] * scale_log2; m = s.max(); p = 2.0 ** (s - m); l = p.sum()
                        out[item] = (p @ V / l, m + math.log2(l))
    return out

def case(seed, D, M, bs, Lq, sizes, plens, chunk_tokens, Hkv=2, grp=4, lone=2, Rg=None):
    rng = np.random.default_rng(seed)
    Rg = Rg or max(sizes); G = len(sizes); R = sum(sizes) + lone; Hq = Hkv * grp
    rows = rng.permutation(R); at = 0
    group_rows = np.full(G * Rg, -1)
    for g, n in enumerate(sizes):
        slots = rng.permutation(Rg)[:n]
        group_rows[g * Rg + slots] = rows[at:at + n]; at += n
    nb = [-(-p // bs) for p in plens]; Mp = max(nb) + 1; NB = sum(nb) + 3
    blocks = rng.permutation(NB); prefix_table = np.full(G * Mp, -1); bat = 0
    valid = np.zeros((NB, bs), bool)
    for g in range(G):
        for j in range(nb[g]):
            b = blocks[bat]; bat += 1; prefix_table[g * Mp + j] = b
            valid[b, :min(bs, plens[g] - j * bs)] = True
    pool = rng.standard_normal((NB, 2, bs, Hkv, D))
    pool[~np.broadcast_to(valid[:, None, :, None, None], pool.shape)] = np.nan
    pool = pool.ravel(); q = (1.5 * rng.standard_normal(R * Lq * Hq * D))
    scale_log2 = 1 / math.sqrt(D) * 1.4426950408889634
    max_chunks = -(-max(plens) // chunk_tokens)
    rows_q = Rg * Lq * grp; row_tiles = -(-rows_q // M)
    part_o = np.full(max_chunks * R * Lq * Hq * D, 12345.0); part_lse = np.full(max_chunks * R * Lq * Hq, 12345.0)
    for g in range(G):
        for h in range(Hkv):
            for bx in range(row_tiles * max_chunks):
                run_cta(D, M, q, pool, group_rows, prefix_table, plens, part_o, part_lse, R, Lq, Hq, Hkv, bs, Rg, Mp,
                        chunk_tokens, row_tiles, scale_log2, bx, h, g)
    ref = reference(D, q, pool, group_rows, prefix_table, plens, R, Lq, Hq, Hkv, bs, G, Rg, Mp, chunk_tokens, max_chunks, scale_log2)
    eo = el = 0.0
    for item, (o, l) in ref.items():
        got_o = part_o[item * D:(item + 1) * D]; got_l = part_lse[item]
        if l == NEG:
            assert got_l == NEG and (got_o == 0).all(), item
            continue
        assert np.isfinite(got_o).all() and np.isfinite(got_l), item
        eo = max(eo, np.abs(got_o - o).max()); el = max(el, abs(got_l - l))
    written = set(np.nonzero(part_lse != 12345.0)[0])
    assert written == set(ref), "stray or missing writes"
    print(f"D={D} M={M} bs={bs} Lq={Lq} rows_q={Rg*Lq*grp} chunk={chunk_tokens}: max|dO| {eo:.2e} max|dLSE| {el:.2e}",
          "OK" if eo < 1e-9 and el < 1e-9 else "BAD")
    assert eo < 1e-9 and el < 1e-9

if __name__ == "__main__":
    for (D, M) in [(64, 16), (64, 32), (64, 64), (128, 16), (128, 32), (128, 64), (256, 16), (256, 32)]:
        Lq = M // 16
        case(D + M, D, M, 16, Lq, [5, 3, 2, 4], [150, 37, 0, 70], 72 if D == 64 else 56, Rg=5)
    case(11, 128, 32, 16, 2, [5, 3], [700, 333], 400, Rg=5)                   # 13 tiles per chunk: ring wraps
    case(12, 128, 16, 64, 1, [4, 2, 3], [500, 65, 0], 200, Rg=4)              # 4 warp columns, bs 64, chunk % bs
    case(13, 64, 64, 16, 4, [4, 1], [900, 10], 520, Rg=4)
    case(14, 256, 16, 16, 1, [3, 3], [300, 129], 112, Rg=4, Hkv=1, grp=8)
    case(15, 128, 64, 16, 1, [8, 8], [400, 17], 384, Rg=8, Hkv=1, grp=8)      # one full 64-row tile
