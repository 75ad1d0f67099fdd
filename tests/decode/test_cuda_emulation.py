"""The cuda backend's index and mask arithmetic, emulated on the CPU (no GPU needed).

``hf_cascade.kernels.cuda._launch`` (the chunking, the slot layout of the partials, the three-level and
variant launches) runs for real, with numpy transliterations of the three kernels of ``csrc/`` in place of
``hf_cascade.kernels.ops``: each emulated kernel walks its grid as the CUDA code does (CTA -> warps -> K/V
tiles -> sub-tiles for the prefix kernel, the token loop of the suffix kernel, the slot list of the merge),
with the same skips and masks (sliding window: chunks and tiles skipped before the CTA's earliest visible
token, the edge masked per row; softcap; sinks; middle-level slots), and computes the selected keys' softmax in
float64. The result must equal the float64 reference (hf_cascade/kernels/reference.py) and every key must be
taken at most once; unused pool slots hold NaN, so a key read that should not be shows up. This checks the
arithmetic only as far as the transliteration is faithful; tests/kernels/test_gpu_kernels.py runs the real kernels.

"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from hf_cascade.kernels.base import AttentionParams
from hf_cascade.kernels import cuda as cuda_backend
from hf_cascade.kernels import cuda_tuning
from hf_cascade.kernels import ops, reference
from kernel_helpers import random_layout, random_three_level, step_plan
from test_reference_kernels import make_three_level

INT_MAX = 0x7FFFFFFF
LOG2E = 1.0 / math.log(2.0)
NEG = -np.inf


# PrefixTune<V> of csrc/prefix.cu: (tokens per K/V tile, warps per CTA) of each tuning variant, 0: the default's
# code -> (tokens per K/V tile, warps) of csrc/prefix.cu's PrefixTune<code>; 6 is csrc/prefix_sm90.cu's kernel (64-token
# tiles, one warpgroup over all 64 rows: 4 warps along the rows, one along the tokens), 7 the same over an fp8 pool
PREFIX_TUNES = {0: (0, 0), 1: (64, 0), 2: (64, 8), 3: (32, 8), 4: (32, 0), 5: (32, 0), 6: (64, 4), 7: (64, 4)}


def prefix_cfg(D, M, tune=0):
    """PrefixCfg<D, M, tune> of csrc/prefix.cu: (WM, WN, N, KW, SUB, warps)."""
    tn, tw = PREFIX_TUNES[tune]
    warps = tw or 4
    WM = M // 16
    WN = warps // WM
    N = tn or (64 if D == 64 else 32 if D == 128 else 16)
    KW = N // WN if N // WN >= 16 else 16
    return WM, WN, N, KW, N // KW, warps


def f32(x) -> float:
    return float(np.float32(x))


def softmax_state(scores, values, D):
    """(o, lse base 2) of log2-domain scores [n] over values [n, D]; no key: (0, -inf)."""
    if len(scores) == 0:
        return np.zeros(D), NEG
    s = np.asarray(scores)
    m = s.max()
    p = np.exp2(s - m)
    return (p[:, None] * np.asarray(values)).sum(0) / p.sum(), m + math.log2(p.sum())


class Emulated:
    """numpy stand-ins for hf_cascade.kernels.ops.{prefix,suffix,merge} (same signatures: one kernel's arguments as
    ops.PrefixArgs / SuffixArgs / MergeArgs; the emulation reads the fields it emulates by name)."""

    def __init__(self):
        self.launched = []       # the kernels launched, in order
        self.taken = []          # (level, row, lq, head, key position) of every key a kernel used
        self.prefix_tiles = 0    # K/V tiles the prefix kernel loaded
        self.tunes = []          # the tuning variant of every prefix launch

    def prefix(self, lib, stream, a):
        ops.check_prefix(a)
        self._prefix(**a._asdict())

    def _prefix(self, q, pool, group_rows, prefix_table, prefix_len, part_o, part_lse, m_tile, row_tiles,
                chunk_tokens, max_chunks, scale_log2, q_limit, slot0=0, softcap=0.0, window=0, tune=0, **_):
        self.launched.append("prefix")
        R, Lq, Hq, D = q.shape
        _, _, bs, Hkv, _ = pool.shape
        qn, pn = q.double().numpy(), pool.double().numpy()
        gr, pt, pl, ql = group_rows.numpy(), prefix_table.numpy(), prefix_len.numpy(), q_limit.numpy()
        po = part_o.view(-1, R, Lq, Hq, D).numpy()[slot0:]       # the launcher's pointer offset
        plse = part_lse.view(-1, R, Lq, Hq).numpy()[slot0:]
        G, Rg = gr.shape
        M = m_tile
        WM, WN, N, KW, SUB, warps = prefix_cfg(D, M, tune)
        self.tunes.append(tune)
        var = softcap > 0 or window > 0
        cap_in = f32(scale_log2 * math.log(2.0) / softcap) if softcap > 0 else 0.0
        cap_out = f32(softcap * LOG2E) if softcap > 0 else 0.0
        grp = Hq // Hkv
        per_row = Lq * grp
        rows_q = Rg * per_row
        for g in range(G):
            for h in range(Hkv):
                for bx in range(row_tiles * max_chunks):
                    tile, chunk = bx % row_tiles, bx // row_tiles
                    rows_here = min(M, rows_q - tile * M)
                    if rows_here <= 0:
                        continue

                    def where(m):          # query row m of the tile -> (row, lq, head) or None
                        if m >= rows_here:
                            return None
                        mg = tile * M + m
                        rg, rem = divmod(mg, per_row)
                        lq, j = divmod(rem, grp)
                        row = int(gr[g, rg])
                        return None if row < 0 else (row, lq, h * grp + j)

                    plen = int(pl[g])
                    t_begin = chunk * chunk_tokens
                    t_first = t_begin

                    def row_start(m):
                        w = where(m)
                        return INT_MAX if w is None else plen + int(ql[w[0], w[1]]) - window

                    if var and window > 0:
                        lo = min(row_start(m) for m in range(rows_here))
                        if lo > t_begin:
                            t_first = t_begin + chunk_tokens if lo - t_begin >= chunk_tokens else \
                                t_begin + (lo - t_begin) // N * N
                    items = [where(m) for m in range(M)]
                    if t_begin >= plen or (var and t_first >= min(t_begin + chunk_tokens, plen)):
                        for w in items:
                            if w is not None:
                                po[chunk][w] = 0.0
                                plse[chunk][w] = NEG
                        continue
                    t_end = min(t_begin + chunk_tokens, plen)
                    ntiles = (t_end - t_first + N - 1) // N
                    qtile = np.zeros((M, D))
                    for m, w in enumerate(items):
                        if w is not None:
                            qtile[m] = qn[w]
                    scores = [[] for _ in range(M)]
                    values = [[] for _ in range(M)]
                    keys = [[] for _ in range(M)]
                    for it in range(ntiles):
                        self.prefix_tiles += 1
                        K = np.zeros((N, D))
                        V = np.zeros((N, D))
                        for n in range(N):            # the loader: zero fill past the chunk and in -1 blocks
                            t = t_first + it * N + n
                            blk = int(pt[g, t // bs]) if t < t_end else -1
                            if blk >= 0:
                                K[n], V[n] = pn[blk, 0, t % bs, h], pn[blk, 1, t % bs, h]
                        for warp in range(warps):
                            wm, wn = warp // WN, warp % WN
                            if not wm * 16 < rows_here:
                                continue
                            for s in range(SUB):
                                if WN > 1 and (it * SUB + s) % WN != wn:
                                    continue
                                tok0 = s * KW
                                valid = t_end - (t_first + it * N + tok0)
                                if valid <= 0:
                                    continue
                                for m in range(wm * 16, wm * 16 + 16):
                                    lo_m = row_start(m) if (var and window > 0) else 0
                                    for c in range(KW):
                                        tok = t_first + it * N + tok0 + c
                                        if (var and window > 0 and tok < lo_m) or (valid < KW and c >= valid):
                                            continue
                                        dot = float(qtile[m] @ K[tok0 + c])
                                        v = cap_out * math.tanh(dot * cap_in) if (var and cap_out > 0) \
                                            else dot * scale_log2
                                        scores[m].append(v)
                                        values[m].append(V[tok0 + c])
                                        keys[m].append(tok)
                    for m, w in enumerate(items):
                        if w is None:
                            continue
                        po[chunk][w], plse[chunk][w] = softmax_state(scores[m], values[m], D)
                        self.taken += [(f"prefix from slot {slot0}", g, *w, t) for t in keys[m]]

    def suffix(self, lib, stream, a):
        ops.check_suffix(a)
        self._suffix(**a._asdict())

    def _suffix(self, q, pool, suffix_table, q_limit, part_o, part_lse, split_tokens, nsplit, slot0, scale_log2,
                softcap=0.0, window=0, **_):
        self.launched.append("suffix")
        R, Lq, Hq, D = q.shape
        po = part_o.view(-1, R, Lq, Hq, D).numpy()
        plse = part_lse.view(-1, R, Lq, Hq).numpy()
        for split, where, o, lse in self._suffix_states(q, pool, suffix_table, q_limit, split_tokens, nsplit,
                                                        scale_log2, softcap, window):
            po[slot0 + split][where], plse[slot0 + split][where] = o, lse

    def _suffix_states(self, q, pool, suffix_table, q_limit, split_tokens, nsplit, scale_log2, softcap, window):
        """(split, (row, lq, head), o, lse) of every query of every CTA of the suffix kernel's grid."""
        R, Lq, Hq, D = q.shape
        _, _, bs, Hkv, _ = pool.shape
        qn, pn, tb_, ql = q.double().numpy(), pool.double().numpy(), suffix_table.numpy(), q_limit.numpy()
        grp = Hq // Hkv
        nq = Lq * grp
        nqb = -(-nq // 4)
        Ms = tb_.shape[1]
        TPW = 32 // (D // 8)
        STEP = 4 * TPW
        var = softcap > 0 or window > 0
        cap_in = f32(math.log(2.0) / softcap) if softcap > 0 else 0.0
        cap_out = f32(softcap * LOG2E) if softcap > 0 else 0.0
        for r in range(R):
            for h in range(Hkv):
                for bx in range(nsplit * nqb):
                    qb, split = bx % nqb, bx // nqb
                    qis = [qi for qi in range(4) if qb * 4 + qi < nq]
                    where = {qi: (r, (qb * 4 + qi) // grp, h * grp + (qb * 4 + qi) % grp) for qi in qis}
                    lim = {qi: max(0, min(int(ql[r, where[qi][1]]), Ms * bs)) for qi in qis}
                    tmax = max([0] + list(lim.values()))
                    t_lo = split * split_tokens
                    t_hi = min(t_lo + split_tokens, tmax)
                    lo = {qi: 0 for qi in qis}
                    if var:
                        lo = {qi: lim[qi] - window if window > 0 else 0 for qi in qis}
                        if window > 0:
                            t_lo = max(t_lo, min(lo.values()))
                    scores = {qi: [] for qi in qis}
                    values = {qi: [] for qi in qis}
                    keys = {qi: [] for qi in qis}
                    for warp in range(4):
                        tb = t_lo + warp * TPW
                        while tb < t_hi:
                            for tg in range(TPW):
                                for t in (tb + tg, tb + STEP + tg):
                                    blk = int(tb_[r, t // bs]) if t < t_hi else -1
                                    if blk < 0:
                                        continue
                                    k, v = pn[blk, 0, t % bs, h], pn[blk, 1, t % bs, h]
                                    for qi in qis:
                                        if not (t < lim[qi] and t >= lo[qi]):
                                            continue
                                        dot = float((qn[where[qi]] * scale_log2) @ k)
                                        s = cap_out * math.tanh(dot * cap_in) if (var and cap_out > 0) else dot
                                        scores[qi].append(s)
                                        values[qi].append(v)
                                        keys[qi].append(t)
                            tb += 2 * STEP
                    for qi in qis:
                        self.taken += [("suffix", -1, *where[qi], t) for t in keys[qi]]
                        yield (split, where[qi], *softmax_state(scores[qi], values[qi], D))

    def merge(self, lib, stream, a):
        self._merge(**a._asdict())

    def _merge(self, part_o, part_lse, row_nchunks, out, slot0, nsplit, row_nmid=None, mid_slot0=0, sinks=None, **_):
        self.launched.append("merge")
        R, Lq, Hq, D = out.shape
        po = part_o.view(-1, R, Lq, Hq, D).numpy()
        plse = part_lse.view(-1, R, Lq, Hq).numpy()
        on = out.numpy()
        for r in range(R):
            slots = row_slots(r, row_nchunks, row_nmid, mid_slot0) + [slot0 + i for i in range(nsplit)]
            for lq in range(Lq):
                for hq in range(Hq):
                    sink = float(sinks[hq]) * LOG2E if sinks is not None else NEG
                    on[r, lq, hq] = merge_item(po[slots, r, lq, hq], plse[slots, r, lq, hq], sink)


def row_slots(r, row_nchunks, row_nmid, mid_slot0) -> list[int]:
    """csrc/include/hfc/merge_math.cuh's RowSlots before the suffix's: the row's prefix chunks, then its middle-level
    chunks."""
    nmid = int(row_nmid[r]) if row_nmid is not None else 0
    return list(range(int(row_nchunks[r]))) + [mid_slot0 + i for i in range(nmid)]


def merge_item(o_slots, lse_slots, sink):
    """The merge of one (row, query, head), csrc/include/hfc/merge_math.cuh's steps: the slots' partials (o [n, D],
    lse [n]) in order, against the maximum over them and the sink."""
    partials = list(zip(np.asarray(o_slots, dtype=np.float64), np.asarray(lse_slots, dtype=np.float64)))
    mx = max([lse for _, lse in partials] + [sink, NEG])
    acc, wsum = np.zeros(np.asarray(o_slots).shape[-1]), 0.0
    if mx != NEG:
        wsum = math.exp2(sink - mx) if sink != NEG else 0.0
        for o, lse in partials:
            if lse == NEG:
                continue
            w = math.exp2(lse - mx)
            wsum += w
            acc += w * o
    return acc / wsum if wsum > 0 else 0.0


class _FakeLib:
    """prefix_info as the library reports it (2 CTAs per SM, the kernel's K/V tile); ``sm90``: the Hopper kernel runs."""
    sm90 = False

    def prefix_info(self, dtype_code, D, m_tile, tune=0):
        return 2, 0, prefix_cfg(D, m_tile, tune)[2]

    def prefix_runs(self, dtype_code, D, m_tile, tune):
        return self.sm90 or tune not in (cuda_tuning.HOPPER_KERNEL, cuda_tuning.HOPPER_FP8_KERNEL)


@pytest.fixture(autouse=True)
def _small_pieces(monkeypatch):
    # short prefix chunks (two K/V tiles) and a suffix split in several parts, so that small layouts exercise
    # the window's chunk and tile skips and the slot layout of many partials
    monkeypatch.setattr(cuda_backend, "_sm_count", lambda dev: 16)
    monkeypatch.setattr(cuda_tuning, "choose_chunk_blocks",
                        lambda pb, ctas, slots, bs, tile, **kw: 2 * max(1, tile // bs))
    monkeypatch.setattr(cuda_backend, "choose_suffix_split",
                        lambda tmax, ctas, slots, min_tokens=None: (100, max(1, -(-tmax // 100))))


def check_launches(emu) -> None:
    """The layer ran the suffix, then the merge."""
    assert emu.launched[-2:] == ["suffix", "merge"] and emu.launched.count("merge") == 1, emu.launched


def run(lay, plan, *, softcap=None, window=None, sinks=None):
    """The emulated cuda backend and the float64 reference on the same (bf16) inputs; returns both and the
    emulation (its list of the keys taken, and ``state``: the launch state it ran on)."""
    q = lay.q.to(torch.bfloat16)
    pool = lay.pool.to(torch.bfloat16)
    params = AttentionParams(lay.scale, softcap=softcap, window=window, sinks=sinks)
    emu = Emulated()
    out = torch.zeros(q.shape, dtype=torch.float64)
    emu.state = cuda_backend.BACKEND.build(plan, q, pool, params, lib=_FakeLib())
    cuda_backend._launch(_FakeLib(), 0, q, pool, emu.state, params, out, kernels=emu)
    ref = reference.attend(q.double(), pool.double(), plan,
                           replace(params, sinks=None if sinks is None else sinks.double()))
    return out, ref, emu


def check(out, ref, emu, tol=2e-5):
    assert torch.isfinite(out).all(), "a NaN key (an unused pool slot) was read"
    err = (out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
    assert err < tol, f"max error {err:.2e} relative to the largest output"
    taken = emu.taken
    assert len(set(taken)) == len(taken), "a key was taken twice"


@pytest.mark.parametrize("D,ratio,Lq", [(64, 4, 1), (128, 8, 2), (256, 1, 1), (64, 16, 3)])
@pytest.mark.parametrize("window,softcap", [(None, None), (40, None), (None, 20.0), (300, 30.0), (1, None)])
def test_two_levels_with_variants(D, ratio, Lq, window, softcap):
    # prefixes long enough for several chunks (the SM count is patched to 2), suffixes for several splits
    lay = random_layout(D + ratio + Lq + (window or 0), groups=((3, 700), (2, 90), (2, 0)), lone_rows=1,
                        suffix=(Lq, 300), Lq=Lq, Hkv=2, ratio=ratio, D=D, bs=16, dtype=torch.float32,
                        random_limits=Lq > 1, q_scale=1.5)
    plan = step_plan(lay)
    out, ref, emu = run(lay, plan, softcap=softcap, window=window)
    check(out, ref, emu)
    check_launches(emu)
    st = emu.state
    assert st.max_chunks > 1 and st.nsplit > 1
    if window is not None and window < 100:
        # tiles and chunks before the window are never read: a query takes at most `window` keys
        counts = {}
        for _, _, r, lq, hq, _ in emu.taken:
            counts[(r, lq, hq)] = counts.get((r, lq, hq), 0) + 1
        assert max(counts.values()) <= window
        _, _, full = run(lay, step_plan(lay), softcap=softcap)
        assert emu.prefix_tiles < full.prefix_tiles / 2


@pytest.mark.parametrize("window", [None, 64])
def test_sinks(window):
    lay = random_layout(5, groups=((3, 400), (2, 0)), lone_rows=2, suffix=(1, 40), Lq=1, Hkv=2, ratio=4, D=64,
                        bs=16, dtype=torch.float32, q_scale=1.5)
    plan = step_plan(lay)
    plan.q_limit[0] = 0          # a row that sees no key at all (in no group or with an empty prefix): o = 0
    sinks = 3.0 * torch.randn(lay.q.shape[2], generator=torch.Generator().manual_seed(1))
    out, ref, emu = run(lay, plan, sinks=sinks, window=window)
    check(out, ref, emu)
    check_launches(emu)
    plain, _, _ = run(lay, step_plan(lay), window=window)
    assert not torch.allclose(plain, out, atol=1e-3)


@pytest.mark.parametrize("ratio,Lq,softcap", [(1, 1, None), (4, 1, 25.0), (8, 2, None)])
def test_three_levels(ratio, Lq, softcap):
    lay = make_three_level(60 + ratio + Lq, Lq=Lq, Hkv=2, ratio=ratio, D=128, bs=16, dtype=torch.float32)
    plan = step_plan(lay)
    sinks = torch.randn(lay.q.shape[2], generator=torch.Generator().manual_seed(2))
    out, ref, emu = run(lay, plan, softcap=softcap, sinks=sinks)
    check(out, ref, emu)
    check_launches(emu)
    st = emu.state
    assert st.three and st.mid.has and st.row_nmid is not None
    # the middle level was read once per subgroup by the prefix kernel, not per row by the suffix kernel
    mid_rows = set(plan.mid_group_rows[plan.mid_group_rows >= 0].tolist())
    assert mid_rows
    # a window turns the middle level off (the reference's semantics): two levels, same result as the reference
    out_w, ref_w, emu_w = run(lay, step_plan(lay), window=20)
    check(out_w, ref_w, emu_w)
    check_launches(emu_w)


@pytest.mark.parametrize("window,softcap", [(None, None), (None, 10.0), (100, None)])
def test_three_levels_chunked(window, softcap):
    # a system prompt and each prompt's own part long enough for several chunks each
    lay = random_three_level(7, sys_tokens=320, prompts=2, beams=2, own_tokens=(150, 260), suffix=(1, 40),
                             lone_rows=1, Lq=1, Hkv=2, ratio=4, D=64, bs=16)
    plan = step_plan(lay)
    out, ref, emu = run(lay, plan, softcap=softcap, window=window)
    check(out, ref, emu)
    check_launches(emu)
    st = emu.state
    assert st.three == (window is None)
    if st.three:
        assert st.max_chunks > 1 and st.mid.max_chunks > 1


def emulated_write(pool, key, value, write_block, write_offset, copy_src, copy_dst, copies: bool) -> None:
    """csrc/write.cu transliterated: the pool, K and V as arrays of 16-byte vectors; the copy kernel's CTAs (pair i,
    its parts) then the write kernel's (token i, K or V), with the same skips and vector offsets."""
    vec = lambda t: t.view(torch.uint8).reshape(-1, 16).numpy()         # noqa: E731 (a view: writes land in t)
    pool_v, key_v, value_v = vec(pool), vec(key), vec(value)
    token_vecs = key.shape[1] * key.shape[2] * key.element_size() // 16
    block_size = pool.shape[2]
    block_vecs = 2 * block_size * token_vecs
    src, dst = copy_src.numpy(), copy_dst.numpy()
    for i in range(len(src) if copies else 0):
        s, d = src[i], dst[i]
        if s == d or (i > 0 and s == src[0] and d == dst[0]):
            continue
        pool_v[d * block_vecs:(d + 1) * block_vecs] = pool_v[s * block_vecs:(s + 1) * block_vecs]
    for i in range(key.shape[0]):
        for kv, source in enumerate((key_v, value_v)):
            at = ((int(write_block[i]) * 2 + kv) * block_size + int(write_offset[i])) * token_vecs
            pool_v[at:at + token_vecs] = source[i * token_vecs:(i + 1) * token_vecs]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_the_write_kernel_addresses_the_slots_the_torch_write_does(dtype):
    """The cache write kernel's vector arithmetic (csrc/write.cu, emulated) leaves the pool byte for byte as the torch
    write (hf_cascade/kv/cache.py) does: copy-on-write copies (with a static step's padding: pair 0 repeated, a block
    copied onto itself), then tokens written into the copied blocks and others."""
    from hf_cascade import cache as cache_module
    g = torch.Generator().manual_seed(5)
    blocks, bs, H, D = 12, 4, 2, 16 if dtype == torch.float8_e4m3fn else 8
    pool = torch.randn(blocks, 2, bs, H, D, generator=g).to(dtype)
    key, value = (torch.randn(5, H, D, generator=g).to(dtype) for _ in range(2))
    ids = torch.randperm(blocks, generator=g)
    copy_src = torch.stack([ids[0], ids[1], ids[0], ids[9]])
    copy_dst = torch.stack([ids[2], ids[3], ids[2], ids[9]])
    write_block = torch.stack([ids[2], ids[3], ids[4], ids[4], ids[5]])
    write_offset = torch.tensor([3, 1, 0, 2, 3])
    args = (key, value, write_block, write_offset, copy_src, copy_dst, True)
    want, got = pool.clone(), pool.clone()
    cache_module._write_slots_torch(want, *args)
    emulated_write(got, *args)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(got.view(torch.uint8), pool.view(torch.uint8))


class _StubLayout:
    """Marks a plan as a static decode step's (``plan.static``); its device plan is the plan's own tensors."""

    def upload(self, plan, device):
        return replace(plan, layout=None, _on_device={}).on(device)


def _static_plan(lay, prefix_width: int, suffix_width: int):
    """``lay``'s plan as a static layout's step, its tables padded to the given widths (-1: as a layout pads)."""
    plan = step_plan(lay)
    pad = lambda a, w: np.concatenate([a, np.full((a.shape[0], w - a.shape[1]), -1, a.dtype)], axis=1)  # noqa: E731
    return replace(plan, prefix_table=pad(plan.prefix_table, prefix_width),
                   suffix_table=pad(plan.suffix_table, suffix_width), layout=_StubLayout())


@pytest.mark.parametrize("bs", [1, 4, 16, 64])
@pytest.mark.parametrize("sm90", [False, True], ids=["portable", "hopper"])
def test_a_static_launch_follows_the_shapes_and_serves_shorter_prefixes(sm90, bs, monkeypatch):
    """A static step's launch state (chunks, slots, each row's partial count) follows the layout's table widths,
    not its prefix lengths: built for a 600-token prefix, it is the state a 150-token prefix of the same rows and
    widths gets, and run on the shorter prefix's values (what a kept layout holds after adopting a new call's:
    plan.DecodeLayout.adopt) it gives the reference's attention; the chunks past the prefix write empty partials."""
    monkeypatch.setattr(_FakeLib, "sm90", sm90)
    common = dict(groups=((3, 600),), lone_rows=1, suffix=(1, 20), D=128, ratio=4, shuffle=False, dtype=torch.float64,
                  bs=bs)
    long = random_layout(11, **common)
    short = random_layout(12, **{**common, "groups": ((3, 150),)})
    assert np.array_equal(long.group_rows.numpy(), short.group_rows.numpy())
    widths = (long.prefix_table.shape[1], max(long.suffix_table.shape[1], short.suffix_table.shape[1]))
    params = AttentionParams(long.scale)

    def state(lay):
        return cuda_backend.BACKEND.build(_static_plan(lay, *widths), lay.q.to(torch.bfloat16),
                                          lay.pool.to(torch.bfloat16), params, lib=_FakeLib())

    kept, own = state(long), state(short)
    launch = ("has_prefix", "m_tile", "row_tiles", "chunk_tokens", "max_chunks", "split_tokens", "nsplit", "slots",
              "tune")
    assert [getattr(kept, f) for f in launch] == [getattr(own, f) for f in launch]
    assert torch.equal(kept.row_nchunks, own.row_nchunks) and kept.max_chunks > 2
    # the per-step state of the short prefix alone has fewer chunks: the static one covers the capacity
    assert cuda_backend.BACKEND.build(step_plan(short), short.q.to(torch.bfloat16), short.pool.to(torch.bfloat16),
                                      params, lib=_FakeLib()).max_chunks < kept.max_chunks
    plan = _static_plan(short, *widths)
    kept.dp = plan.on("cpu")
    q, pool = short.q.to(torch.bfloat16), short.pool.to(torch.bfloat16)
    emu = Emulated()
    out = torch.zeros(q.shape, dtype=torch.float64)
    cuda_backend._launch(_FakeLib(), 0, q, pool, kept, params, out, kernels=emu)
    check_launches(emu)
    check(out, reference.attend(q.double(), pool.double(), plan, params), emu)


def test_a_kept_cross_plan_launches_by_its_tables_and_serves_shorter_sources(monkeypatch):
    """An encoder-decoder's cross plan (``CrossAttentionCache.plan``: groups = inputs, no suffix) launches by its
    tables' width, not its sources' lengths: the launch state built for long sources is the one the plan gets after
    a refill with shorter ones (what a kept encoder-decoder state serves: ``CrossAttentionCache.refill``), and run on
    the refilled plan, whose tables and lengths were rewritten in its device tensors in place, it gives the
    reference's attention over the shorter sources; the chunks past a source write empty partials. The pool's slots
    are NaN before the refill: a stale key of the longer sources would show."""
    from hf_cascade.seq2seq import cross_kv
    from hf_cascade.seq2seq.cross_kv import CrossAttentionCache, real_lengths
    from hf_cascade.seq2seq.seq2seq_models import CrossProjection
    from hf_cascade.config import CascadeConfig
    monkeypatch.setattr(cross_kv, "in_place_layout", lambda device: False)   # the GPU's contiguous paged pool
    g = torch.Generator().manual_seed(5)
    Hkv, Hq, D, d, n = 2, 4, 128, 16, 2
    projection = CrossProjection(torch.nn.Linear(d, Hkv * D, dtype=torch.bfloat16),
                                 torch.nn.Linear(d, Hkv * D, dtype=torch.bfloat16), D)

    def sources(lengths):
        width = max(lengths)
        mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
        return torch.randn(len(lengths), width, d, generator=g).to(torch.bfloat16), mask

    cache = CrossAttentionCache(1, CascadeConfig(block_size=4))
    cache.fill([projection], *sources((150, 60, 20)))        # blocks of 4: (38, 15, 5), tables 38 wide
    plan = cache.plan(3 * n, 1)
    q = torch.randn(3 * n, 1, Hq, D, generator=g).to(torch.bfloat16)
    params = AttentionParams(D ** -0.5)
    layer = cache.layers[0]

    def state():
        return cuda_backend.BACKEND.build(plan, q, layer.pool, params, lib=_FakeLib())

    kept = state()
    short = sources((40, 100, 12))                           # (10, 25, 3) blocks: 25 wide, within ADOPT_SPAN
    assert cache.serves(real_lengths(*short))
    layer.pool.fill_(float("nan"))
    cache.refill([projection], *short)
    assert cache.plan(3 * n, 1) is plan and plan.prefix_len.tolist() == [40, 100, 12]
    launch = ("has_prefix", "m_tile", "row_tiles", "chunk_tokens", "max_chunks", "split_tokens", "nsplit", "slots",
              "tune")
    again = state()
    assert [getattr(kept, f) for f in launch] == [getattr(again, f) for f in launch]
    assert torch.equal(kept.row_nchunks, again.row_nchunks)
    assert kept.dp is again.dp and kept.dp.prefix_len.tolist() == [40, 100, 12]   # rewritten in place
    # the shorter sources in storages of their own: fewer chunks (their tables are narrower)
    own = CrossAttentionCache(1, CascadeConfig(block_size=4))
    own.fill([projection], *short)
    assert cuda_backend.BACKEND.build(own.plan(3 * n, 1), q, own.layers[0].pool, params,
                                      lib=_FakeLib()).max_chunks < kept.max_chunks
    emu = Emulated()
    out = torch.zeros(q.shape, dtype=torch.float64)
    cuda_backend._launch(_FakeLib(), 0, q, layer.pool, kept, params, out, kernels=emu)
    check_launches(emu)
    check(out, reference.attend(q.double(), layer.pool.double(), plan, params), emu)
