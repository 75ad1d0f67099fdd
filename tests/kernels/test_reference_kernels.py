"""Tests of the PyTorch reference cascade kernels against a float64 dense attention.

The dense reference materialises, token by token, the explicit key list of every
row (group prefix followed by the row's suffix) and runs a plain softmax attention
in float64 -- it shares no code with the kernels.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_cascade.kernels.reference import (
    cascade_attention,
    merge_state,
    prefix_attention,
    suffix_attention,
)
from hf_cascade.kernels.base import AttentionParams
from kernel_helpers import random_layout

LN2 = math.log(2.0)


# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """The tensors here are tiny; intra-op threads only add overhead (and stall badly on a
    loaded machine), so run this module single-threaded and restore the setting afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_layout(seed, *, Lq, Hkv, ratio, D, bs, dtype, garbage=1e4, extra_blocks=3):
    """Random paged layout (:func:`kernel_helpers.random_layout`): 7 rows in groups of sizes 3, 2, 1 (in
    random order, one with an empty prefix, one longer than three blocks) and one row in no group; one row
    has a suffix of exactly Lq tokens; unused blocks and slots hold ``garbage``."""
    rng = np.random.default_rng(seed)
    plens = [int(rng.integers(1, 3 * bs + 6)), 0, int(rng.integers(1, 40))]
    groups = [((3, 2, 1)[i], plens[i]) for i in rng.permutation(3)]
    return random_layout(seed, groups=groups, lone_rows=1, suffix=(Lq, Lq + 19), Lq=Lq, Hkv=Hkv, ratio=ratio, D=D,
                         bs=bs, dtype=dtype, garbage=garbage, extra_blocks=extra_blocks, q_scale=2.0)


def dense_reference(lay, *, use_prefix=True, use_suffix=True):
    """float64 softmax attention over explicitly materialised per-row key lists.

    returns o [R, Lq, Hq, D] float64, lse [R, Lq, Hq] float64 (base 2)."""
    q, pool = lay.q.double(), lay.pool.double()
    R, Lq, Hq, D = q.shape
    bs, Hkv = pool.shape[2], pool.shape[3]
    ratio = Hq // Hkv
    gr, pt, pl = lay.group_rows.tolist(), lay.prefix_table.tolist(), lay.prefix_len.tolist()
    st_, ql = lay.suffix_table.tolist(), lay.q_limit.tolist()
    o = torch.zeros(R, Lq, Hq, D, dtype=torch.float64)
    lse = torch.full((R, Lq, Hq), -math.inf, dtype=torch.float64)
    for r in range(R):
        prefix = []
        for g, rows in enumerate(gr):
            if r in rows:
                prefix = [(pt[g][t // bs], t % bs) for t in range(pl[g])]
        for i in range(Lq):
            suffix = [(st_[r][t // bs], t % bs) for t in range(ql[r][i])]
            keys = (prefix if use_prefix else []) + (suffix if use_suffix else [])
            if not keys:
                continue
            blk, slot = (torch.tensor(x) for x in zip(*keys))
            K, V = pool[blk, 0, slot], pool[blk, 1, slot]  # [n, Hkv, D]: the row's keys, in order
            K, V = K.repeat_interleave(ratio, dim=1), V.repeat_interleave(ratio, dim=1)  # [n, Hq, D]
            sc = torch.einsum("hd,nhd->hn", q[r, i], K) * lay.scale
            lse[r, i] = torch.logsumexp(sc, dim=-1) / LN2
            o[r, i] = torch.einsum("hn,nhd->hd", torch.softmax(sc, dim=-1), V)
    return o, lse


def caches(lay):
    pool = lay.pool
    return pool[:, 0], pool[:, 1]  # non-contiguous views


def run_prefix(lay):
    k, v = caches(lay)
    return prefix_attention(lay.q, k, v, lay.group_rows, lay.prefix_table, lay.prefix_len, lay.scale)


def run_suffix(lay):
    k, v = caches(lay)
    return suffix_attention(lay.q, k, v, lay.suffix_table, lay.q_limit, lay.scale)


def run_cascade(lay):
    k, v = caches(lay)
    return cascade_attention(
        lay.q, k, v, lay.group_rows, lay.prefix_table, lay.prefix_len,
        lay.suffix_table, lay.q_limit, lay.scale,
    )


def tol(dtype):
    return dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)


def check(actual, expected, dtype):
    assert not torch.isnan(actual).any()
    torch.testing.assert_close(actual.double(), expected, **tol(dtype))


# --------------------------------------------------------------------------- main grid


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("Lq", [1, 3])
@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("D", [32, 64, 96, 128])
@pytest.mark.parametrize("ratio", [1, 2, 4, 8])
def test_against_dense(ratio, D, bs, Lq, dtype):
    Hkv = 2 if ratio <= 4 else 1
    seed = 1000 * ratio + 10 * D + 3 * bs + Lq + (dtype == torch.float32)
    lay = make_layout(seed, Lq=Lq, Hkv=Hkv, ratio=ratio, D=D, bs=bs, dtype=dtype)
    cdt = torch.float64 if dtype == torch.float64 else torch.float32

    o_full, lse_full = dense_reference(lay)
    o_pre, lse_pre = dense_reference(lay, use_suffix=False)
    o_suf, lse_suf = dense_reference(lay, use_prefix=False)

    o = run_cascade(lay)
    assert o.shape == lay.q.shape and o.dtype == dtype
    check(o, o_full, dtype)

    op, lp = run_prefix(lay)
    assert op.dtype == dtype and lp.dtype == cdt and lp.shape == lay.q.shape[:3]
    check(op, o_pre, dtype)
    check(lp, lse_pre, dtype)

    os_, ls = run_suffix(lay)
    assert os_.dtype == dtype and ls.dtype == cdt and ls.shape == lay.q.shape[:3]
    check(os_, o_suf, dtype)
    check(ls, lse_suf, dtype)

    # merging (prefix, suffix) == attention over the concatenation, LSE included
    om, lm = merge_state(op, lp, os_, ls)
    check(om, o_full, dtype)
    check(lm, lse_full, dtype)

    # the layout really exercises the special cases
    assert (lse_pre == -math.inf).all(dim=(1, 2)).any()  # rows in no group / empty prefix
    assert (lse_pre > -math.inf).all(dim=(1, 2)).any()


# --------------------------------------------------------------------------- edge cases


def test_empty_segments_and_extreme_logits():
    """q_limit 0, no prefix, a single-token suffix, and logits far beyond exp's range."""
    lay = make_layout(7, Lq=2, Hkv=2, ratio=2, D=32, bs=4, dtype=torch.float64)
    lay.q = lay.q * 200.0  # exp(scores) would overflow without max subtraction
    ungrouped = [r for r in range(7) if r not in lay.group_rows.flatten().tolist()][0]
    grouped = int(lay.group_rows[lay.prefix_len > 0][0, 0])
    lay.q_limit[ungrouped] = 0  # no key at all -> o = 0, lse = -inf
    lay.q_limit[grouped] = torch.tensor([0, 1])  # prefix only / prefix + one suffix token
    o_ref, lse_ref = dense_reference(lay)
    o = run_cascade(lay)
    check(o, o_ref, torch.float64)
    assert (o[ungrouped] == 0).all()
    ls = run_suffix(lay)[1]
    assert (ls[ungrouped] == -math.inf).all() and (ls[grouped, 0] == -math.inf).all()
    assert torch.isfinite(ls[grouped, 1]).all()
    om, lm = merge_state(*run_prefix(lay), *run_suffix(lay))
    check(lm, lse_ref, torch.float64)


def test_merge_two_empty_states():
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        o = torch.zeros(3, 2, 4, 8, dtype=dt)
        lse = torch.full((3, 2, 4), -math.inf, dtype=torch.float64 if dt == torch.float64 else torch.float32)
        om, lm = merge_state(o, lse, o.clone(), lse.clone())
        assert om.dtype == dt and om.shape == o.shape and lm.shape == lse.shape
        assert not torch.isnan(om).any() and not torch.isnan(lm).any()
        assert (om == 0).all() and (lm == -math.inf).all()


def test_merge_with_one_empty_state_is_identity():
    g = torch.Generator().manual_seed(0)
    o = torch.randn(5, 3, 16, generator=g, dtype=torch.float64)
    lse = 50 * torch.randn(5, 3, generator=g, dtype=torch.float64)
    empty_o, empty_l = torch.zeros_like(o), torch.full_like(lse, -math.inf)
    for args in ((o, lse, empty_o, empty_l), (empty_o, empty_l, o, lse)):
        om, lm = merge_state(*args)
        torch.testing.assert_close(om, o, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(lm, lse, rtol=1e-14, atol=1e-14)


def _dense_state(q, K, V, scale):
    """q [H, D], K/V [n, H, D] -> o [H, D], lse [H] (base 2), float64; n == 0 -> (0, -inf)."""
    if K.shape[0] == 0:
        return torch.zeros_like(q), torch.full(q.shape[:1], -math.inf, dtype=q.dtype)
    s = torch.einsum("hd,nhd->hn", q, K) * scale
    return torch.einsum("hn,nhd->hd", torch.softmax(s, -1), V), torch.logsumexp(s, -1) / LN2


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 12),
    seed=st.integers(0, 2**31 - 1),
    mag=st.sampled_from([0.1, 1.0, 30.0]),
)
def test_merge_equals_concatenation(n, seed, mag):
    """merge(attn(A), attn(B)) == attn(A ∪ B) for any split, including empty sides."""
    g = torch.Generator().manual_seed(seed)
    H, D = 3, 8
    q = mag * torch.randn(H, D, generator=g, dtype=torch.float64)
    K = torch.randn(n, H, D, generator=g, dtype=torch.float64)
    V = torch.randn(n, H, D, generator=g, dtype=torch.float64)
    in_a = torch.rand(n, generator=g) < 0.5
    oa, la = _dense_state(q, K[in_a], V[in_a], 0.3)
    ob, lb = _dense_state(q, K[~in_a], V[~in_a], 0.3)
    o_ref, l_ref = _dense_state(q, K, V, 0.3)
    om, lm = merge_state(oa, la, ob, lb)
    assert not torch.isnan(om).any() and not torch.isnan(lm).any()
    torch.testing.assert_close(om, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lm, l_ref, rtol=1e-12, atol=1e-12)
    # float32 path
    om32, lm32 = merge_state(oa.float(), la.float(), ob.float(), lb.float())
    assert om32.dtype == torch.float32 and lm32.dtype == torch.float32
    torch.testing.assert_close(om32.double(), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lm32.double(), l_ref, rtol=1e-5, atol=1e-5)


def test_nan_garbage_never_leaks():
    """Unused slots, unused blocks and the block read through -1 padding hold NaN."""
    for bs in (1, 4, 16):
        lay = make_layout(11 + bs, Lq=3, Hkv=2, ratio=4, D=32, bs=bs, dtype=torch.float64, garbage=math.nan)
        o_ref, _ = dense_reference(lay)
        check(run_cascade(lay), o_ref, torch.float64)
        assert not torch.isnan(run_prefix(lay)[1]).any() and not torch.isnan(run_suffix(lay)[1]).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(dtype):
    lay = make_layout(5, Lq=2, Hkv=2, ratio=2, D=64, bs=4, dtype=dtype, garbage=0.0)
    o_ref, lse_ref = dense_reference(lay)  # dense float64 on the rounded half inputs
    o = run_cascade(lay)
    assert o.dtype == dtype
    tol_ = 1e-2 if dtype == torch.float16 else 4e-2
    torch.testing.assert_close(o.double(), o_ref, rtol=tol_, atol=tol_)
    _, ls = run_suffix(lay)
    assert ls.dtype == torch.float32
    torch.testing.assert_close(ls.double(), _dense_suffix_lse(lay), rtol=1e-3, atol=1e-3)


def _dense_suffix_lse(lay):
    return dense_reference(lay, use_prefix=False)[1]


def test_groups_without_rows_and_empty_tables():
    """G == 0 (no groups at all) and an empty suffix table reduce to the other level."""
    lay = make_layout(3, Lq=1, Hkv=1, ratio=8, D=32, bs=4, dtype=torch.float64)
    k, v = caches(lay)
    R, Lq, Hq, D = lay.q.shape
    o, lse = prefix_attention(
        lay.q, k, v, torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, 2, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32), lay.scale,
    )
    assert (o == 0).all() and (lse == -math.inf).all() and lse.shape == (R, Lq, Hq)
    o, lse = suffix_attention(
        lay.q, k, v, torch.zeros(R, 0, dtype=torch.int32), torch.zeros(R, Lq, dtype=torch.int32), lay.scale,
    )
    assert (o == 0).all() and (lse == -math.inf).all()
    o_ref, _ = dense_reference(lay, use_suffix=False)
    o = cascade_attention(
        lay.q, k, v, lay.group_rows, lay.prefix_table, lay.prefix_len,
        torch.zeros(R, 0, dtype=torch.int32), torch.zeros(R, Lq, dtype=torch.int32), lay.scale,
    )
    check(o, o_ref, torch.float64)


def test_pool_is_never_copied_whole():
    """No intermediate tensor is as large as one half of the pool: only used blocks are gathered."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MaxNumel(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            flat_in = torch.utils._pytree.tree_leaves((args, kwargs))
            in_ptrs = {a.untyped_storage().data_ptr() for a in flat_in if isinstance(a, torch.Tensor)}
            for t in torch.utils._pytree.tree_leaves(out):
                # views (e.g. pool[:, 0]) alias an input; count only freshly allocated tensors
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in in_ptrs:
                    MaxNumel.biggest = max(MaxNumel.biggest, t.numel())
            return out

    lay = make_layout(9, Lq=2, Hkv=2, ratio=2, D=32, bs=4, dtype=torch.float32, extra_blocks=400)
    o_ref, _ = dense_reference(lay)
    half = lay.pool[:, 0].numel()
    with MaxNumel():
        o = run_cascade(lay)
    check(o, o_ref, torch.float32)
    assert MaxNumel.biggest < half // 4, (MaxNumel.biggest, half)


# --------------------------------------------------------------------------- softcap and sliding window


def _dense_quirks(lay, softcap, window):
    """float64 per-row key lists as in dense_reference, with a logit soft-cap and a sliding window of the
    last ``window`` keys of each query (itself included)."""
    q, pool = lay.q.double(), lay.pool.double()
    R, Lq, Hq, D = q.shape
    bs, Hkv = pool.shape[2], pool.shape[3]
    gr, pt, pl = lay.group_rows.tolist(), lay.prefix_table.tolist(), lay.prefix_len.tolist()
    st_, ql = lay.suffix_table.tolist(), lay.q_limit.tolist()
    o = torch.zeros(R, Lq, Hq, D, dtype=torch.float64)
    for r in range(R):
        prefix = next(([(pt[g][t // bs], t % bs) for t in range(pl[g])] for g, rows in enumerate(gr) if r in rows), [])
        for i in range(Lq):
            keys = prefix + [(st_[r][t // bs], t % bs) for t in range(ql[r][i])]
            if window is not None:
                keys = keys[max(0, len(keys) - window):]
            if not keys:
                continue
            blk, slot = (torch.tensor(x) for x in zip(*keys))
            K = pool[blk, 0, slot].repeat_interleave(Hq // Hkv, dim=1)
            V = pool[blk, 1, slot].repeat_interleave(Hq // Hkv, dim=1)
            sc = torch.einsum("hd,nhd->hn", q[r, i], K) * lay.scale
            if softcap is not None:
                sc = softcap * torch.tanh(sc / softcap)
            o[r, i] = torch.einsum("hn,nhd->hd", torch.softmax(sc, dim=-1), V)
    return o


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("window", [None, 1, 3, 9, 40])
@pytest.mark.parametrize("Lq", [1, 3])
def test_softcap_and_window_against_dense(softcap, window, Lq):
    lay = make_layout(77 + Lq, Lq=Lq, Hkv=2, ratio=2, D=32, bs=4, dtype=torch.float64)
    k, v = caches(lay)
    o = cascade_attention(lay.q, k, v, lay.group_rows, lay.prefix_table, lay.prefix_len,
                          lay.suffix_table, lay.q_limit, AttentionParams(lay.scale, softcap=softcap, window=window))
    check(o, _dense_quirks(lay, softcap, window), torch.float64)
    if softcap is not None or window in (1, 3, 9):   # the quirk changes the result (40 cuts nothing here)
        assert not torch.allclose(o, _dense_quirks(lay, None, None))


def test_attend_applies_the_layer_quirks():

    from hf_cascade.kernels import reference

    lay = make_layout(5, Lq=2, Hkv=2, ratio=2, D=32, bs=4, dtype=torch.float64)
    dp = SimpleNamespace(**{n: getattr(lay, n) for n in ("group_rows", "prefix_table", "prefix_len", "suffix_table",
                                                 "q_limit")})
    plan = SimpleNamespace(on=lambda device: dp)
    o = reference.attend(lay.q, lay.pool, plan, AttentionParams(lay.scale, softcap=1.5, window=5))
    check(o, _dense_quirks(lay, 1.5, 5), torch.float64)
    sinks = torch.linspace(-2.0, 3.0, lay.q.shape[2], dtype=torch.float64)
    o = reference.attend(lay.q, lay.pool, plan, AttentionParams(lay.scale, softcap=1.5, window=5, sinks=sinks))
    check(o, _dense_from_keys(lay.q, lay.pool, _two_level_keys(lay), lay.scale, 1.5, 5, sinks), torch.float64)


def test_select_skips_backends_lacking_a_layer_quirk(monkeypatch):
    """A backend that does not declare softcap/window/sinks in its ``quirks`` is never chosen for such a layer."""
    import types
    from hf_cascade import kernels
    from hf_cascade.kernels import reference as reference_backend
    from hf_cascade.kernels.base import Backend
    plain = Backend()           # takes everything, implements no quirk
    monkeypatch.setitem(kernels._loaded, "cuda", plain)
    monkeypatch.setitem(kernels._loaded, "flashinfer", ImportError("absent"))
    q, pool, plan = torch.zeros(1, 1, 2, 8), torch.zeros(1, 2, 4, 1, 8), types.SimpleNamespace(src_index=None)
    assert kernels.select("auto", q, pool, plan) is plain
    for quirk in ({"softcap": 30.0}, {"window": 4}, {"sinks": torch.zeros(2)}):
        assert kernels.select("auto", q, pool, plan, AttentionParams(0.5, **quirk)) is reference_backend.BACKEND
        assert plain.refusal(AttentionParams(0.5, **quirk)) is not None
        with pytest.raises(NotImplementedError, match="not implemented in this backend"):
            kernels.select("cuda", q, pool, plan, AttentionParams(0.5, **quirk))
    assert plain.refusal(AttentionParams(0.5)) is None



def test_quirk_sets_tell_layers_sinks_apart():
    """Sinks are a tensor per layer: AttentionParams (the step context's keys) compare them by identity, so two
    layers with equal-valued sinks still get backend choices of their own, and a layer gets the same one every
    time."""
    from hf_cascade.context import StepContext
    P = AttentionParams
    a, b = torch.zeros(4), torch.zeros(4)
    assert P(0.5, sinks=a) == P(0.5, sinks=a) and hash(P(0.5, sinks=a)) == hash(P(0.5, sinks=a))
    assert P(0.5, sinks=a) != P(0.5, sinks=b) and P(0.5, sinks=a) != P(0.5) and P(0.5) != P(0.25)
    assert P(0.5, softcap=2.0, window=4) == P(0.5, softcap=2.0, window=4)
    assert P(0.5, 2.0, 4, a).serves(0.5, 2.0, 4, a) and not P(0.5, 2.0, 4, a).serves(0.5, 2.0, 4, b)
    assert P(0.5, window=4).without_window() == P(0.5) and P(0.5, sinks=a).quirks() == ("sinks",)
    ctx = StepContext(cache=None, plan=SimpleNamespace(src_index=None), step_id=0)
    q, pool = torch.zeros(1, 1, 4, 8), torch.zeros(1, 2, 4, 2, 8)
    for params in (P(0.5, sinks=a), P(0.5, sinks=b), P(0.5, sinks=a), P(0.5)):
        ctx.backend("reference", q, pool, params)
    assert [key[0] for key in ctx.backends] == [P(0.5, sinks=a), P(0.5, sinks=b), P(0.5)]
    assert next(iter(ctx.backends))[0].sinks is a

# --------------------------------------------------------------------------- attention sinks


def _dense_from_keys(q, pool, keys_of, scale, softcap=None, window=None, sinks=None):
    """float64 softmax attention of each query over its explicit key list ``keys_of(r, i)`` -> [(block, slot)],
    with optional soft-cap, sliding window (last ``window`` keys) and sinks: one more logit sinks[h] per head
    whose value is 0 (neither scaled, capped nor windowed). Returns o [R, Lq, Hq, D] float64."""
    q, pool = q.double(), pool.double()
    R, Lq, Hq, D = q.shape
    Hkv = pool.shape[3]
    o = torch.zeros(R, Lq, Hq, D, dtype=torch.float64)
    for r in range(R):
        for i in range(Lq):
            keys = keys_of(r, i)
            if window is not None:
                keys = keys[max(0, len(keys) - window):]
            if not keys:
                continue   # no key: o = 0 with or without a sink (the sink's value is 0)
            blk, slot = (torch.tensor(x) for x in zip(*keys))
            K = pool[blk, 0, slot].repeat_interleave(Hq // Hkv, dim=1)
            V = pool[blk, 1, slot].repeat_interleave(Hq // Hkv, dim=1)
            sc = torch.einsum("hd,nhd->hn", q[r, i], K) * scale
            if softcap is not None:
                sc = softcap * torch.tanh(sc / softcap)
            if sinks is not None:
                sc = torch.cat([sc, sinks.double()[:, None]], dim=1)
                V = torch.cat([V, V.new_zeros(1, Hq, D)])
            o[r, i] = torch.einsum("hn,nhd->hd", torch.softmax(sc, dim=-1), V)
    return o


def _two_level_keys(lay):
    bs = lay.pool.shape[2]
    gr, pt, pl = lay.group_rows.tolist(), lay.prefix_table.tolist(), lay.prefix_len.tolist()
    st_, ql = lay.suffix_table.tolist(), lay.q_limit.tolist()

    def keys_of(r, i):
        prefix = next(([(pt[g][t // bs], t % bs) for t in range(pl[g])] for g, rows in enumerate(gr) if r in rows), [])
        return prefix + [(st_[r][t // bs], t % bs) for t in range(ql[r][i])]
    return keys_of


def make_three_level(seed, *, Lq, Hkv, ratio, D, bs, dtype, garbage=math.nan):
    """A paged layout with three levels, and the same keys as two: group prefix -> subgroup prefix (whole blocks
    after the group prefix, as the plan builds them) -> each row's inner suffix; the two-level ``suffix_table`` /
    ``q_limit`` of a row are its subgroup blocks followed by its inner suffix.

    10 rows: group 0 (rows 0-5) has subgroups {0, 1, 2} and {3, 4} (the latter with an empty middle level),
    row 5 in no subgroup; group 1 (rows 6, 7) has an empty prefix and subgroup {6, 7}; rows 8 and 9 are in
    no group, row 9 with no key at all. Unused slots and blocks hold ``garbage``."""
    rng = np.random.default_rng(seed)
    R, Hq = 10, Hkv * ratio
    nblk = lambda n: -(-n // bs)  # noqa: E731
    groups, plens = [[0, 1, 2, 3, 4, 5], [6, 7]], [int(rng.integers(1, 3 * bs + 3)), 0]
    subgroups, mlens = [[0, 1, 2], [3, 4], [6, 7]], [bs * int(rng.integers(1, 3)), 0, bs]
    inner = rng.integers(Lq, Lq + 2 * bs, size=R)
    inner[int(rng.integers(0, 3))] = Lq              # a subgroup row whose inner suffix is just its queries
    N = sum(nblk(p) for p in plens) + sum(nblk(m) for m in mlens) + sum(nblk(int(n)) for n in inner) + 3
    blocks = iter(rng.permutation(N).tolist())     # 3 blocks stay unused
    valid = torch.zeros(N, bs, dtype=torch.bool)

    def table(n_tokens, width):
        ids = [next(blocks) for _ in range(nblk(n_tokens))]
        for j, b in enumerate(ids):
            valid[b, : min(bs, n_tokens - j * bs)] = True
        return ids + [-1] * (width - len(ids))

    pw, mw = max(nblk(p) for p in plens) + 1, max(nblk(m) for m in mlens) + 1
    prefix_table = torch.tensor([table(p, pw) for p in plens], dtype=torch.int32)
    mid_table = torch.tensor([table(m, mw) for m in mlens], dtype=torch.int32)
    iw = max(nblk(int(n)) for n in inner) + 1
    inner_table = torch.tensor([table(int(n), iw) for n in inner], dtype=torch.int32)

    mid_of = {r: s for s, rows in enumerate(subgroups) for r in rows}
    inner_q_limit = torch.as_tensor(inner[:, None] - Lq + 1 + np.arange(Lq)[None, :], dtype=torch.int32)
    inner_q_limit[9] = 0
    suffix_table = torch.full((R, mw - 1 + iw), -1, dtype=torch.int32)
    q_limit = inner_q_limit.clone()
    for r in range(R):   # two levels: the subgroup's whole blocks, then the inner suffix
        mids = [b for b in mid_table[mid_of[r]].tolist() if b >= 0] if r in mid_of else []
        inn = [b for b in inner_table[r].tolist() if b >= 0]
        suffix_table[r, : len(mids) + len(inn)] = torch.tensor(mids + inn, dtype=torch.int32)
        q_limit[r] += len(mids) * bs
    pad = lambda rows, w: [x + [-1] * (w - len(x)) for x in rows]  # noqa: E731

    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(N, 2, bs, Hkv, D, generator=gen, dtype=torch.float64)
    pool = pool.masked_fill(~valid[:, None, :, None, None], garbage).to(dtype)
    return SimpleNamespace(
        q=(2.0 * torch.randn(R, Lq, Hq, D, generator=gen, dtype=torch.float64)).to(dtype), pool=pool,
        group_rows=torch.tensor(pad(groups, 6), dtype=torch.int32), prefix_table=prefix_table,
        prefix_len=torch.tensor(plens, dtype=torch.int32),
        mid_group_rows=torch.tensor(pad(subgroups, 3), dtype=torch.int32), mid_table=mid_table,
        mid_len=torch.tensor(mlens, dtype=torch.int32), inner_suffix_table=inner_table, inner_q_limit=inner_q_limit,
        suffix_table=suffix_table, q_limit=q_limit, scale=1.0 / math.sqrt(D),
        sinks=(3.0 * torch.randn(Hq, generator=gen, dtype=torch.float64)).to(dtype),
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("window", [None, 3, 40])
@pytest.mark.parametrize("ratio,Lq", [(1, 1), (4, 3)])
def test_sinks_against_dense(ratio, Lq, window, softcap, dtype):
    """Two levels (a group prefix, each row's suffix), NaN in unused slots, a row in no group, an empty prefix."""
    lay = make_layout(300 + 7 * ratio + Lq, Lq=Lq, Hkv=2, ratio=ratio, D=32, bs=4, dtype=dtype, garbage=math.nan)
    Hq = lay.q.shape[2]
    sinks = (3.0 * torch.randn(Hq, generator=torch.Generator().manual_seed(Hq), dtype=torch.float64)).to(dtype)
    k, v = caches(lay)
    o = cascade_attention(lay.q, k, v, lay.group_rows, lay.prefix_table, lay.prefix_len,
                          lay.suffix_table, lay.q_limit, AttentionParams(lay.scale, softcap, window, sinks))
    assert o.dtype == dtype
    expected = _dense_from_keys(lay.q, lay.pool, _two_level_keys(lay), lay.scale, softcap, window, sinks)
    check(o, expected, dtype)
    without = _dense_from_keys(lay.q, lay.pool, _two_level_keys(lay), lay.scale, softcap, window)
    assert not torch.allclose(o.double(), without, atol=1e-3)     # the sinks matter here


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("bs", [1, 4])
@pytest.mark.parametrize("ratio,Lq", [(1, 1), (2, 3), (4, 1)])
def test_sinks_enter_once_with_three_levels(ratio, Lq, bs, dtype):
    """The sink is one key per query: merged once after the three levels, the three-level and the two-level
    paths both equal the float64 dense attention (with the sink a second time, or per level, they would not)."""
    from hf_cascade.kernels import reference
    from hf_cascade.kernels.reference import merge_sink, three_level_attention

    lay = make_three_level(500 + 10 * ratio + bs + Lq, Lq=Lq, Hkv=2, ratio=ratio, D=16, bs=bs, dtype=dtype)
    k, v = caches(lay)
    expected = _dense_from_keys(lay.q, lay.pool, _two_level_keys(lay), lay.scale, sinks=lay.sinks)
    three = three_level_attention(lay.q, k, v, lay.group_rows, lay.prefix_table, lay.prefix_len,
                                  lay.mid_group_rows, lay.mid_table, lay.mid_len, lay.inner_suffix_table,
                                  lay.inner_q_limit, AttentionParams(lay.scale, sinks=lay.sinks))
    two = cascade_attention(lay.q, k, v, lay.group_rows, lay.prefix_table, lay.prefix_len,
                            lay.suffix_table, lay.q_limit, AttentionParams(lay.scale, sinks=lay.sinks))
    check(three, expected, dtype)
    check(two, expected, dtype)
    assert (three[9] == 0).all()         # no key at all: the whole weight goes to the sink (value 0)
    # attend() takes the three-level path for such a plan and applies the layer's sinks
    dp = SimpleNamespace(**{n: getattr(lay, n) for n in ("group_rows", "prefix_table", "prefix_len", "suffix_table", "q_limit",
                                                 "mid_group_rows", "mid_table", "mid_len", "inner_suffix_table",
                                                 "inner_q_limit")})
    plan = SimpleNamespace(on=lambda device: dp)
    check(reference.attend(lay.q, lay.pool, plan, AttentionParams(lay.scale, sinks=lay.sinks)), expected, dtype)
    # what the test tells apart: no sinks, and a sink merged into every level's partial state
    without = three_level_attention(lay.q, k, v, lay.group_rows, lay.prefix_table, lay.prefix_len,
                                    lay.mid_group_rows, lay.mid_table, lay.mid_len, lay.inner_suffix_table,
                                    lay.inner_q_limit, lay.scale)
    levels = [prefix_attention(lay.q, k, v, lay.group_rows, lay.prefix_table, lay.prefix_len, lay.scale),
              prefix_attention(lay.q, k, v, lay.mid_group_rows, lay.mid_table, lay.mid_len, lay.scale),
              suffix_attention(lay.q, k, v, lay.inner_suffix_table, lay.inner_q_limit, lay.scale)]
    per_level = [merge_sink(o, lse, lay.sinks) for o, lse in levels]
    per_level = merge_state(*merge_state(*per_level[0], *per_level[1]), *per_level[2])[0]
    for wrong in (without, per_level):
        assert not torch.allclose(wrong.double(), expected, atol=1e-3)


def test_merge_sink_is_one_more_key():
    """merge_sink(state over A, s) == attention over A plus a key of score s and value 0; an empty state
    becomes (0, s·log2 e); a sink of -inf changes nothing."""
    from hf_cascade.kernels.reference import merge_sink

    g = torch.Generator().manual_seed(4)
    H, D, n = 3, 8, 5
    q, K, V = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((H, D), (n, H, D), (n, H, D)))
    s = torch.tensor([-2.0, 0.5, 40.0], dtype=torch.float64)
    o, lse = merge_sink(*_dense_state(q, K, V, 0.3), s)
    scores = torch.cat([torch.einsum("hd,nhd->hn", q, K) * 0.3, s[:, None]], dim=1)
    V0 = torch.cat([V, V.new_zeros(1, H, D)])
    torch.testing.assert_close(o, torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), V0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1) / LN2, rtol=1e-12, atol=1e-12)
    o, lse = merge_sink(torch.zeros(H, D, dtype=torch.float64), torch.full((H,), -math.inf, dtype=torch.float64), s)
    assert (o == 0).all() and torch.equal(lse, s / LN2)
    state = _dense_state(q, K, V, 0.3)
    o, lse = merge_sink(*state, torch.full((H,), -math.inf, dtype=torch.float64))
    assert torch.equal(o, state[0]) and torch.equal(lse, state[1])
