"""PyTorch reference backend for cascade decode attention over a paged KV cache.

Level 0 (``prefix_attention``): all queries of all rows of a group attend to the
group's shared prefix (non-causal, the prefix precedes every query).
Level 1 (``suffix_attention``): every query of a row attends to the first
``q_limit[r, i]`` tokens of that row's own suffix.
The two partial states (o, lse) are combined with ``merge_state``.

Conventions
-----------
* ``k_cache``/``v_cache`` are ``pool[:, 0]``/``pool[:, 1]`` of a pool shaped
  ``[num_blocks, 2, block_size, Hkv, D]``; only the referenced blocks are gathered
  (advanced indexing on the block dim), the pool is never copied whole.
* LSE is base 2.  float64 inputs are computed in float64 (float64 LSE); every
  other dtype is computed in float32 (float32 LSE) and o is returned in q.dtype.
* An empty key set gives (o = 0, lse = -inf); nothing ever becomes NaN, even if
  unused cache slots / padding blocks contain NaN garbage.
* GQA: query head h uses KV head h // (Hq // Hkv); K/V are never repeated, the
  queries are reshaped to [..., Hkv, group, ...] instead.
* Index tensors are int32 (-1 = padding); they are converted to int64 internally.
* The layer's :class:`~hf_cascade.kernels.base.AttentionParams` (``params``: the scale and the optional variants,
  all default off; :func:`cascade_attention` and :func:`three_level_attention` take one, or a bare scale):
  ``scale`` -- scores = scale * q.k;
  ``softcap`` -- logit soft-capping (Gemma2): scores = softcap * tanh(scores / softcap), scores being
  the scaled dot products, before the softmax;
  ``window`` -- a sliding window, applied per level as ``key_start`` int [R, Lq] (:func:`window_key_start`): query
  i of row r only sees the keys at positions >= key_start[r, i] of its row's key list (group prefix, then the row's
  suffix).
  ``sinks`` float [Hq] -- attention sinks (GPT-OSS ``s_aux``): one learned logit per query head (natural
  log, neither scaled nor soft-capped nor windowed) added to every query's softmax denominator, i.e. an
  extra key with score ``sinks[h]`` and value 0.  Merging is associative over disjoint key sets, so the
  sink is exact as one more state (o = 0, lse = sinks * log2 e) merged once per query after the levels
  (:func:`merge_sink`); giving it to every level would count it once per level.
* A quantized pool (float8_e4m3fn, :mod:`hf_cascade.kernels.base`): ``k_scale``/``v_scale`` float [Hkv] dequantise
  the gathered tokens (real K = stored K x k_scale[kv head], in the compute dtype) before the attention above;
  :class:`ReferenceBackend` takes them from the pool (``kv_scale``).

:data:`BACKEND` is these functions as a kernel backend (:mod:`hf_cascade.kernels.base`); :func:`attend` runs it on
one layer.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .base import KV_SCALED_DTYPES, AttentionParams, Backend, as_params, kv_scale

__all__ = ["prefix_attention", "suffix_attention", "merge_state", "merge_sink", "cascade_attention",
           "three_level_attention", "window_key_start", "attend", "ReferenceBackend", "BACKEND"]

_LOG2E = 1.0 / math.log(2.0)


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _gather_tokens(cache: Tensor, table: Tensor, scale: Tensor | None = None, cdt=None) -> Tensor:
    """cache [N, bs, Hkv, D], table int [B, M] -> [B, M*bs, Hkv, D].

    Padding entries (-1) read block 0; those tokens must be masked by the caller.
    Only the selected blocks are copied. With ``scale`` [Hkv] (a quantized cache), the tokens come dequantised in
    the compute dtype ``cdt``.
    """
    blocks = table.long().clamp_min(0)
    if scale is None:
        return cache[blocks].flatten(1, 2)
    # gathered as bytes (float8 indexing is not implemented everywhere), then dequantised
    tokens = cache.view(torch.uint8)[blocks].view(cache.dtype).flatten(1, 2).to(cdt)
    return tokens * scale.to(device=tokens.device, dtype=cdt)[:, None]


def _masked_attention(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, mask: Tensor, scale: float,
                      softcap: float | None = None):
    """Masked softmax attention with base-2 LSE.

    q: [B, Hkv, M, D] (compute dtype); k, v: [B, T, Hkv, D] (cache dtype)
    key_valid: bool [B, T] (tokens that hold real data; V outside is zeroed so
    garbage such as NaN cannot leak through 0 * NaN)
    mask: bool, broadcastable to [B, Hkv, M, T] (which key each query may see)
    softcap: None, or scores = softcap * tanh(scale * q.k / softcap) before the softmax
    returns o [B, Hkv, M, D], lse [B, Hkv, M] in the compute dtype.
    """
    B, Hkv, M, D = q.shape
    cdt = q.dtype
    if k.shape[1] == 0:
        return q.new_zeros(B, Hkv, M, D), q.new_full((B, Hkv, M), float("-inf"))
    k = k.to(cdt).transpose(1, 2)  # [B, Hkv, T, D]
    v = v.to(cdt).masked_fill(~key_valid[:, :, None, None], 0.0).transpose(1, 2)
    if softcap is None:
        s = torch.matmul(q, k.transpose(-1, -2)) * (scale * _LOG2E)  # log2 domain
    else:
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        s = torch.tanh(s / softcap) * (softcap * _LOG2E)
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # fully masked -> exp2(-inf) = 0
    p = torch.exp2(s - m)
    l = p.sum(dim=-1, keepdim=True)
    o = torch.matmul(p, v) / torch.where(l > 0, l, torch.ones_like(l))
    lse = (m + torch.log2(l)).squeeze(-1)  # l == 0 -> -inf
    return o, lse


def prefix_attention(q, k_cache, v_cache, group_rows, prefix_table, prefix_len, scale, softcap=None, key_start=None,
                     k_scale=None, v_scale=None):
    """Level 0: every query of every row of group g attends to all prefix_len[g] tokens of the group's prefix (non-causal: the prefix precedes all queries).
    q: [R, Lq, Hq, D]; k_cache/v_cache: [N, bs, Hkv, D]
    group_rows: int32 [G, Rg] rows of each group, -1 = padding (a row is in at most one group; groups may have different sizes)
    prefix_table: int32 [G, Mp] block ids of each group's prefix in order, -1 padding
    prefix_len: int32 [G] prefix tokens (<= Mp*bs; token t lives at block prefix_table[g, t // bs], slot t % bs)
    softcap: optional logit soft-cap; key_start: optional int [R, Lq], query i of row r sees prefix tokens >= key_start[r, i] only
    k_scale, v_scale: float [Hkv] of a quantized cache (None: not quantized)
    returns o [R, Lq, Hq, D] (q.dtype), lse [R, Lq, Hq]; rows in no group and groups with prefix_len 0 get o=0, lse=-inf."""
    R, Lq, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    assert Hq % Hkv == 0, "Hq must be a multiple of Hkv"
    grp = Hq // Hkv
    G, Rg = group_rows.shape
    cdt = _compute_dtype(q.dtype)
    dev = q.device

    rows = group_rows.long()
    # queries of each group: [G, Rg, Lq, Hq, D] -> [G, Hkv, Rg*Lq*grp, D]
    qg = q[rows.clamp_min(0)].to(cdt)
    qg = qg.reshape(G, Rg, Lq, Hkv, grp, D).permute(0, 3, 1, 2, 4, 5).reshape(G, Hkv, Rg * Lq * grp, D)

    k = _gather_tokens(k_cache, prefix_table, k_scale, cdt)  # [G, T, Hkv, D]
    v = _gather_tokens(v_cache, prefix_table, v_scale, cdt)
    T = k.shape[1]
    key_valid = torch.arange(T, device=dev)[None, :] < prefix_len.to(dev).long()[:, None]  # [G, T]
    mask = key_valid[:, None, None, :]
    if key_start is not None:  # per query: [G, Rg, Lq] -> [G, 1, Rg*Lq*grp, T]
        start = key_start.to(dev).long()[rows.clamp_min(0)]
        sees = torch.arange(T, device=dev)[None, None, None, :] >= start[..., None]          # [G, Rg, Lq, T]
        sees = sees[:, :, :, None, :].expand(G, Rg, Lq, grp, T).reshape(G, 1, Rg * Lq * grp, T)
        mask = mask & sees
    o, lse = _masked_attention(qg, k, v, key_valid, mask, scale, softcap)

    o = o.reshape(G, Hkv, Rg, Lq, grp, D).permute(0, 2, 3, 1, 4, 5).reshape(G * Rg, Lq, Hq, D)
    lse = lse.reshape(G, Hkv, Rg, Lq, grp).permute(0, 2, 3, 1, 4).reshape(G * Rg, Lq, Hq)

    # scatter back to rows; padding entries go to a dummy row R that is dropped (no host sync)
    dst = torch.where(rows >= 0, rows, torch.full_like(rows, R)).flatten()
    o_out = q.new_zeros(R + 1, Lq, Hq, D)
    lse_out = torch.full((R + 1, Lq, Hq), float("-inf"), dtype=cdt, device=dev)
    o_out[dst] = o.to(q.dtype)
    lse_out[dst] = lse
    return o_out[:R], lse_out[:R]


def suffix_attention(q, k_cache, v_cache, suffix_table, q_limit, scale, softcap=None, key_start=None, k_scale=None,
                     v_scale=None):
    """Level 1: query i of row r attends to the first q_limit[r, i] tokens of row r's suffix (laid out in suffix_table[r]'s blocks in order; token t at block suffix_table[r, t // bs], slot t % bs).
    suffix_table: int32 [R, Ms] (-1 padding); q_limit: int32 [R, Lq] (0 allowed -> o=0, lse=-inf). Causality within a tail is expressed by q_limit alone.
    softcap: optional logit soft-cap; key_start: optional int [R, Lq], query i of row r sees suffix tokens >= key_start[r, i] only (may be negative)
    k_scale, v_scale: float [Hkv] of a quantized cache (None: not quantized)
    returns o [R, Lq, Hq, D], lse [R, Lq, Hq]."""
    R, Lq, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    assert Hq % Hkv == 0, "Hq must be a multiple of Hkv"
    grp = Hq // Hkv
    cdt = _compute_dtype(q.dtype)
    dev = q.device

    qh = q.to(cdt).reshape(R, Lq, Hkv, grp, D).permute(0, 2, 1, 3, 4).reshape(R, Hkv, Lq * grp, D)
    k = _gather_tokens(k_cache, suffix_table, k_scale, cdt)  # [R, T, Hkv, D]
    v = _gather_tokens(v_cache, suffix_table, v_scale, cdt)
    T = k.shape[1]

    lim = q_limit.to(dev).long()  # [R, Lq]
    t = torch.arange(T, device=dev)
    sees = t[None, None, :] < lim[:, :, None]  # [R, Lq, T]
    if key_start is not None:
        sees = sees & (t[None, None, :] >= key_start.to(dev).long()[:, :, None])
    key_valid = sees.any(dim=1)  # [R, T]: tokens seen by some query (i.e. < max limit)
    mask = sees[:, None, :, None, :].expand(R, 1, Lq, grp, T).reshape(R, 1, Lq * grp, T)
    o, lse = _masked_attention(qh, k, v, key_valid, mask, scale, softcap)

    o = o.reshape(R, Hkv, Lq, grp, D).permute(0, 2, 1, 3, 4).reshape(R, Lq, Hq, D)
    lse = lse.reshape(R, Hkv, Lq, grp).permute(0, 2, 1, 3).reshape(R, Lq, Hq)
    return o.to(q.dtype), lse


def merge_state(o_a, lse_a, o_b, lse_b):
    """Merge two partial attention states over disjoint key sets: returns (o, lse) with the same shapes; (0,-inf)+(0,-inf) -> (0,-inf)."""
    cdt = _compute_dtype(o_a.dtype, o_b.dtype, lse_a.dtype, lse_b.dtype)
    la, lb = lse_a.to(cdt), lse_b.to(cdt)
    m = torch.maximum(la, lb)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa = torch.exp2(la - m)
    wb = torch.exp2(lb - m)
    w = wa + wb
    o = (o_a.to(cdt) * wa[..., None] + o_b.to(cdt) * wb[..., None]) / torch.where(w > 0, w, torch.ones_like(w))[..., None]
    lse = m + torch.log2(w)  # w == 0 -> -inf
    return o.to(o_a.dtype), lse


def merge_sink(o, lse, sinks):
    """Merge the attention sinks into a state over all of a query's keys: ``merge_state`` with the state
    (o = 0, lse = sinks[h] * log2 e) of one extra key of value 0, without materialising that zero state.
    o [..., Hq, D], lse [..., Hq] (base 2), sinks [Hq] (natural-log logits); returns (o, lse) as merge_state.
    A query with no keys keeps o = 0 (its whole weight goes to the sink)."""
    cdt = _compute_dtype(o.dtype, lse.dtype)
    la = lse.to(cdt)
    ls = (sinks.to(device=la.device, dtype=cdt) * _LOG2E).expand_as(la)
    m = torch.maximum(la, ls)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa = torch.exp2(la - m)
    w = wa + torch.exp2(ls - m)
    o_new = o.to(cdt) * (wa / torch.where(w > 0, w, torch.ones_like(w)))[..., None]
    return o_new.to(o.dtype), m + torch.log2(w)


def window_key_start(group_rows, prefix_len, q_limit, window):
    """Sliding window of ``window`` keys ending at each query (itself included), as the first visible key position
    of each query's key list (group prefix, then suffix): int64 [R, Lq] (may be negative: nothing cut)."""
    R = q_limit.shape[0]
    dev = q_limit.device
    rows = group_rows.long().flatten()
    lens = prefix_len.long().to(dev)[:, None].expand(group_rows.shape).flatten()
    dst = torch.where(rows >= 0, rows, torch.full_like(rows, R))
    row_prefix = torch.zeros(R + 1, dtype=torch.long, device=dev)
    row_prefix[dst] = lens
    own = row_prefix[:R, None] + q_limit.long()        # keys each query sees without a window (itself included)
    return own - int(window)


def cascade_attention(q, k_cache, v_cache, group_rows, prefix_table, prefix_len, suffix_table, q_limit,
                      params: AttentionParams | float, k_scale=None, v_scale=None):
    """prefix_attention + suffix_attention + merge_state (+ merge_sink); returns o [R, Lq, Hq, D].
    params: the layer's AttentionParams (or a bare scale): its softcap, its window (each query sees its last
    ``window`` keys, itself included) and its sinks (float [Hq] logits); k_scale, v_scale: a quantized cache's."""
    params = as_params(params)
    scale, softcap, window, sinks = params.scale, params.softcap, params.window, params.sinks
    dq = dict(k_scale=k_scale, v_scale=v_scale)
    start = None if window is None else window_key_start(group_rows, prefix_len, q_limit.to(q.device), window)
    o_p, lse_p = prefix_attention(q, k_cache, v_cache, group_rows, prefix_table, prefix_len, scale, softcap, start,
                                  **dq)
    # in suffix coordinates (positions after the row's group prefix) the window starts at q_limit - window
    suffix_start = None if window is None else q_limit.to(q.device).long() - int(window)
    o_s, lse_s = suffix_attention(q, k_cache, v_cache, suffix_table, q_limit, scale, softcap, suffix_start, **dq)
    o, lse = merge_state(o_p, lse_p, o_s, lse_s)
    if sinks is not None:
        o, _ = merge_sink(o, lse, sinks)
    return o


def three_level_attention(q, k_cache, v_cache, group_rows, prefix_table, prefix_len, mid_group_rows, mid_table,
                          mid_len, inner_suffix_table, inner_q_limit, params: AttentionParams | float, k_scale=None,
                          v_scale=None):
    """Group prefix (e.g. a batch's system prompt) + subgroup prefix (each prompt's rest, shared by its
    beams) + each row's own suffix, each read once per (sub)group, merged (the sinks, if any, once after
    the three). Rows in no subgroup get (0, -inf) from the middle level and their whole rest from
    ``inner_suffix_table``. params: the layer's AttentionParams (or a bare scale) without a window (a window is
    defined over two levels: :func:`cascade_attention`); k_scale, v_scale: a quantized cache's."""
    params = as_params(params)
    if params.window is not None:
        raise ValueError("three_level_attention: a sliding window is defined over the group prefix and the row's "
                         "suffix (two levels): use cascade_attention")
    scale, softcap, sinks = params.scale, params.softcap, params.sinks
    dq = dict(k_scale=k_scale, v_scale=v_scale)
    o_p, lse_p = prefix_attention(q, k_cache, v_cache, group_rows, prefix_table, prefix_len, scale, softcap, **dq)
    o_m, lse_m = prefix_attention(q, k_cache, v_cache, mid_group_rows, mid_table, mid_len, scale, softcap, **dq)
    o_s, lse_s = suffix_attention(q, k_cache, v_cache, inner_suffix_table, inner_q_limit, scale, softcap, **dq)
    o, lse = merge_state(o_p, lse_p, o_m, lse_m)
    o, lse = merge_state(o, lse, o_s, lse_s)
    if sinks is not None:
        o, _ = merge_sink(o, lse, sinks)
    return o


class ReferenceMetadata(NamedTuple):
    """A step's metadata on the reference backend: the plan and its tensors on the pool's device."""

    plan: object
    device: object


class ReferenceBackend(Backend):
    """The functions above as a kernel backend: any device, dtype and head_dim, every quirk, quantized pools."""

    name = "reference"
    quirks = ("softcap", "window", "sinks")
    kv_dtypes = auto_kv_dtypes = KV_SCALED_DTYPES
    # no host sync, shapes from the plan's tables, windows applied from the device lengths: a static decode step
    # can be captured (hf_cascade.graphs)
    graph_safe = True
    min_saved_tokens = 0   # the PyTorch path always gains from reading a shared prefix once (CPU: 1k tokens up)

    def metadata_key(self, q, pool, quirks, plan=None):
        return (str(pool.device),)          # the plan's tensors on the pool's device: one per device

    def build(self, plan, q, pool, params: AttentionParams | None = None) -> ReferenceMetadata:
        return ReferenceMetadata(plan, plan.on(pool.device))

    def forward(self, q, pool, metadata: ReferenceMetadata, params: AttentionParams):
        dp = metadata.device
        kv = kv_scale(pool)
        dq = {} if kv is None else dict(k_scale=kv[0], v_scale=kv[1])
        if params.window is None and dp.mid_group_rows.shape[0]:
            return three_level_attention(q, pool[:, 0], pool[:, 1], dp.group_rows, dp.prefix_table, dp.prefix_len,
                                         dp.mid_group_rows, dp.mid_table, dp.mid_len, dp.inner_suffix_table,
                                         dp.inner_q_limit, params, **dq)
        return cascade_attention(q, pool[:, 0], pool[:, 1], dp.group_rows, dp.prefix_table, dp.prefix_len,
                                 dp.suffix_table, dp.q_limit, params, **dq)


BACKEND = ReferenceBackend()


def attend(q, pool, plan, params: AttentionParams | float):
    """One layer's cascade attention for one step (see :mod:`hf_cascade.kernels.base`); ``params``: the layer's
    AttentionParams, or a bare scale."""
    return BACKEND.attend(q, pool, plan, params)
