"""Typed entry points of the CUDA kernels: ``torch.ops.hf_cascade.{prefix,suffix,merge}``.

Each kernel is a ``torch.library`` custom operator that writes into buffers it is given (partials, output), with a
fake implementation, so that ``torch.compile`` traces through the layers around it and the shapes, dtypes and
devices are checked in one place (:func:`check_prefix`, :func:`check_suffix`, :func:`check_merge`; errors name the
argument). Shapes (``csrc/include/hfc/params.h``)::

    q            [R, Lq, Hq, D]               bfloat16 / float16, contiguous
    pool         [num_blocks, 2, bs, Hkv, D]  q's dtype, or float8_e4m3fn with kv_scale; contiguous (K then V)
    kv_scale     [2, Hkv] float32 (an fp8 pool's: K's scale per KV head, then V's) or None
    group_rows   [G, Rg] int32   prefix_table [G, Mp] int32   prefix_len [G] int32
    suffix_table [R, Ms] int32   q_limit [R, Lq] int32        row_nchunks [R] int32
    part_o       float32, >= slots x R x Lq x Hq x D elements; part_lse float32, >= slots x R x Lq x Hq
    out          [R, Lq, Hq, D]  q's dtype
    row_nmid     [R] int32 or None (three levels)               sinks [Hq] float32 or None

Per-layer variants (0: off): ``softcap`` (logits -> softcap x tanh(logit / softcap)) and ``window`` (each query
sees its last ``window`` keys over the group prefix and its suffix; the prefix kernel reads the suffix level's
``q_limit`` for it) in the prefix and suffix kernels, ``sinks`` in the merge. The prefix kernel writes its
chunks from slot ``slot0`` on (the middle level of a three-level plan follows the group prefix's chunks).

The eager path does not go through the operator dispatcher: a custom-op call that does nothing costs ~16 us of host
time, the ctypes launches of one layer's three kernels ~7 us together (x86 CPU, torch 2.13;
``benchmarks/kernel_call_overhead.py``). So :func:`prefix`, :func:`suffix` and :func:`merge` call the library
directly in eager mode (the backend checks q and the pool per call and the plan once per step; with
``$HF_CASCADE_CUDA_DEBUG`` the operators' checks run on every launch too) and the operators while ``torch.compile``
traces.
"""
from __future__ import annotations

from typing import Optional

import torch

from .cuda_binding import DTYPE_CODES, KV_DTYPE_CODES   # the C side's codes (the binding owns the C ABI)
from torch.compiler import is_compiling as _is_compiling   # bound once: the eager path pays for every lookup

__all__ = ["check_prefix", "check_suffix", "check_merge", "prefix", "suffix", "merge", "DTYPE_CODES", "HEAD_DIMS"]

HEAD_DIMS = (64, 128, 256)
M_TILES = (16, 32, 64)


# -------------------------------------------------------------------------------------------- checks

def _fail(op: str, message: str, kind=ValueError):
    raise kind(f"hf_cascade::{op}: {message}")


def _tensor(op: str, name: str, t, *, dtype=None, dim=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a tensor, got {type(t).__name__}", TypeError)
    if dtype is not None and t.dtype != dtype:
        _fail(op, f"{name} must be {dtype}, got {t.dtype}", TypeError)
    if dim is not None and t.dim() != dim:
        _fail(op, f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        _fail(op, f"{name} is on {t.device}, q on {device}")
    if not t.is_contiguous():
        _fail(op, f"{name} must be contiguous (call .contiguous())")


def _q_pool(op: str, q, pool, kv_scale=None) -> tuple[int, int, int, int, int, int]:
    _tensor(op, "q", q, dim=4)
    if q.dtype not in DTYPE_CODES:
        _fail(op, f"q must be bfloat16 or float16, got {q.dtype}", TypeError)
    _tensor(op, "pool", pool, dtype=None if pool.dtype in KV_DTYPE_CODES else q.dtype, dim=5, device=q.device)
    R, Lq, Hq, D = q.shape
    _, two, bs, Hkv, Dp = pool.shape
    if pool.dtype in KV_DTYPE_CODES:
        if kv_scale is None:
            _fail(op, f"a {pool.dtype} pool needs kv_scale (float32 [2, Hkv])")
        _tensor(op, "kv_scale", kv_scale, dtype=torch.float32, dim=2, device=q.device)
        if tuple(kv_scale.shape) != (2, Hkv):
            _fail(op, f"kv_scale has shape {tuple(kv_scale.shape)}, expected (2, {Hkv})")
    if D not in HEAD_DIMS:
        _fail(op, f"q's head_dim {D} is not supported (supported: {HEAD_DIMS})")
    if two != 2 or Dp != D or bs < 1 or Hkv < 1 or Hq % Hkv:
        _fail(op, f"pool of shape {tuple(pool.shape)} does not fit q {tuple(q.shape)}: expected "
                  f"[num_blocks, 2, block_size, Hkv, {D}] with Hkv dividing {Hq}")
    return R, Lq, Hq, D, bs, Hkv


def _index(op: str, name: str, t, shape, device) -> None:
    _tensor(op, name, t, dtype=torch.int32, dim=len(shape), device=device)
    if any(want is not None and got != want for got, want in zip(t.shape, shape)):
        _fail(op, f"{name} has shape {tuple(t.shape)}, expected {tuple('*' if s is None else s for s in shape)}")


def _partials(op: str, part_o, part_lse, slots: int, items: int, D: int, device) -> None:
    _tensor(op, "part_o", part_o, dtype=torch.float32, device=device)
    _tensor(op, "part_lse", part_lse, dtype=torch.float32, device=device)
    if part_o.numel() < slots * items * D:
        _fail(op, f"part_o holds {part_o.numel()} floats, the kernel writes up to {slots} x {items} x {D}")
    if part_lse.numel() < slots * items:
        _fail(op, f"part_lse holds {part_lse.numel()} floats, the kernel writes up to {slots} x {items}")


def _variants(op: str, softcap: float, window: int) -> None:
    if not softcap >= 0.0 or window < 0:
        _fail(op, f"softcap {softcap} and window {window} must be >= 0 (0: off)")


def check_prefix(q, pool, group_rows, prefix_table, prefix_len, part_o, part_lse, m_tile: int, row_tiles: int,
                 chunk_tokens: int, max_chunks: int, q_limit=None, slot0: int = 0, softcap: float = 0.0,
                 window: int = 0, kv_scale=None) -> None:
    """Raise TypeError / ValueError naming the argument unless the prefix kernel can take these arguments."""
    R, Lq, Hq, D, bs, Hkv = _q_pool("prefix", q, pool, kv_scale)
    _variants("prefix", softcap, window)
    if window > 0:                          # read only with a window
        _index("prefix", "q_limit", q_limit, (R, Lq), q.device)
    if slot0 < 0:
        _fail("prefix", f"slot0 {slot0} must be >= 0")
    _index("prefix", "group_rows", group_rows, (None, None), q.device)
    G, Rg = group_rows.shape
    _index("prefix", "prefix_table", prefix_table, (G, None), q.device)
    _index("prefix", "prefix_len", prefix_len, (G,), q.device)
    if m_tile not in M_TILES or (m_tile == 64 and D > 128):
        _fail("prefix", f"m_tile {m_tile} (16, 32, or 64 for head_dim <= 128)")
    if row_tiles < 1 or row_tiles * m_tile < Rg * Lq * (Hq // Hkv):
        _fail("prefix", f"row_tiles {row_tiles} x m_tile {m_tile} < the {Rg * Lq * (Hq // Hkv)} query rows of a "
                        "group and KV head")
    if chunk_tokens < 1 or max_chunks < 0:
        _fail("prefix", f"chunk_tokens {chunk_tokens} must be >= 1 and max_chunks {max_chunks} >= 0")
    _partials("prefix", part_o, part_lse, slot0 + max_chunks, R * Lq * Hq, D, q.device)


def check_suffix(q, pool, suffix_table, q_limit, part_o, part_lse, split_tokens: int, nsplit: int, slot0: int,
                 softcap: float = 0.0, window: int = 0, kv_scale=None) -> None:
    """Raise TypeError / ValueError naming the argument unless the suffix kernel can take these arguments."""
    R, Lq, Hq, D, _, _ = _q_pool("suffix", q, pool, kv_scale)
    _variants("suffix", softcap, window)
    _index("suffix", "suffix_table", suffix_table, (R, None), q.device)
    _index("suffix", "q_limit", q_limit, (R, Lq), q.device)
    if split_tokens < 1 or nsplit < 1 or slot0 < 0:
        _fail("suffix", f"split_tokens {split_tokens} and nsplit {nsplit} must be >= 1, slot0 {slot0} >= 0")
    _partials("suffix", part_o, part_lse, slot0 + nsplit, R * Lq * Hq, D, q.device)


def check_merge(part_o, part_lse, row_nchunks, out, slot0: int, nsplit: int, row_nmid=None, mid_slot0: int = 0,
                sinks=None) -> None:
    """Raise TypeError / ValueError naming the argument unless the merge kernel can take these arguments."""
    _tensor("merge", "out", out, dim=4)
    if out.dtype not in DTYPE_CODES:
        _fail("merge", f"out must be bfloat16 or float16, got {out.dtype}", TypeError)
    R, Lq, Hq, D = out.shape
    if D not in HEAD_DIMS:
        _fail("merge", f"out's head_dim {D} is not supported (supported: {HEAD_DIMS})")
    if slot0 < 0 or nsplit < 0 or mid_slot0 < 0:
        _fail("merge", f"slot0 {slot0}, nsplit {nsplit} and mid_slot0 {mid_slot0} must be >= 0")
    _merged_levels("merge", row_nchunks, R, Hq, slot0, row_nmid, mid_slot0, sinks, out.device)
    _partials("merge", part_o, part_lse, slot0 + nsplit, R * Lq * Hq, D, out.device)


def _merged_levels(op: str, row_nchunks, R: int, Hq: int, slot0: int, row_nmid, mid_slot0: int, sinks, device) -> None:
    """The merge's per-row slot counts (prefix, middle level from mid_slot0, before the suffix's slot0) and sinks."""
    _index(op, "row_nchunks", row_nchunks, (R,), device)
    if row_nmid is not None:
        _index(op, "row_nmid", row_nmid, (R,), device)
        if mid_slot0 > slot0:
            _fail(op, f"the middle level's slots (from {mid_slot0}) must come before the suffix's ({slot0})")
    if sinks is not None:
        _tensor(op, "sinks", sinks, dtype=torch.float32, dim=1, device=device)
        if sinks.shape[0] != Hq:
            _fail(op, f"sinks has {sinks.shape[0]} entries, out {Hq} query heads")


# ---------------------------------------------------------------------------------------- operators

def _aligned(**tensors) -> None:
    for name, t in tensors.items():
        if t.data_ptr() % 16:
            raise ValueError(f"hf_cascade: {name} must be 16-byte aligned (clone it)")


def _lib(device):
    from .cuda_library import library   # the operators' CUDA implementations need the loaded library (its binding
    return library(device)              # imports ops: imported here, not at the top)


def _stream(device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


@torch.library.custom_op("hf_cascade::prefix", mutates_args=("part_o", "part_lse"), device_types="cuda")
def prefix_op(q: torch.Tensor, pool: torch.Tensor, group_rows: torch.Tensor, prefix_table: torch.Tensor,
              prefix_len: torch.Tensor, part_o: torch.Tensor, part_lse: torch.Tensor, m_tile: int, row_tiles: int,
              chunk_tokens: int, max_chunks: int, scale_log2: float, q_limit: torch.Tensor, slot0: int,
              softcap: float, window: int, tune: int = 0, kv_scale: Optional[torch.Tensor] = None) -> None:
    """Level 0 (or the middle level): writes partial slots [slot0, slot0 + max_chunks) of every row in a group
    (csrc/prefix.cu; ``tune``: the prefix kernel's code, hf_cascade.kernels.cuda_tuning: a tuning variant's or
    HOPPER_KERNEL, 0 by default; an fp8 pool: 0, with ``kv_scale``)."""
    check_prefix(q, pool, group_rows, prefix_table, prefix_len, part_o, part_lse, m_tile, row_tiles, chunk_tokens,
                 max_chunks, q_limit, slot0, softcap, window, kv_scale)
    _aligned(q=q, pool=pool, part_o=part_o)      # 16-byte vector loads and stores
    with torch.cuda.device(q.device):
        _lib(q.device).prefix(q, pool, group_rows, prefix_table, prefix_len, part_o, part_lse, m_tile, row_tiles,
                              chunk_tokens, max_chunks, scale_log2, _stream(q.device), q_limit, slot0, softcap, window,
                              tune, kv_scale)


@prefix_op.register_fake
def _prefix_fake(q, pool, group_rows, prefix_table, prefix_len, part_o, part_lse, m_tile, row_tiles, chunk_tokens,
                 max_chunks, scale_log2, q_limit, slot0, softcap, window, tune=0, kv_scale=None) -> None:
    check_prefix(q, pool, group_rows, prefix_table, prefix_len, part_o, part_lse, m_tile, row_tiles, chunk_tokens,
                 max_chunks, q_limit, slot0, softcap, window, kv_scale)


@torch.library.custom_op("hf_cascade::suffix", mutates_args=("part_o", "part_lse"), device_types="cuda")
def suffix_op(q: torch.Tensor, pool: torch.Tensor, suffix_table: torch.Tensor, q_limit: torch.Tensor,
              part_o: torch.Tensor, part_lse: torch.Tensor, split_tokens: int, nsplit: int, slot0: int,
              scale_log2: float, softcap: float, window: int, kv_scale: Optional[torch.Tensor] = None) -> None:
    """Level 1: writes partial slots [slot0, slot0 + nsplit) of every row (csrc/suffix.cu)."""
    check_suffix(q, pool, suffix_table, q_limit, part_o, part_lse, split_tokens, nsplit, slot0, softcap, window,
                 kv_scale)
    _aligned(q=q, pool=pool, part_o=part_o)      # 16-byte vector loads and stores
    with torch.cuda.device(q.device):
        _lib(q.device).suffix(q, pool, suffix_table, q_limit, part_o, part_lse, split_tokens, nsplit, slot0,
                              scale_log2, _stream(q.device), softcap, window, kv_scale)


@suffix_op.register_fake
def _suffix_fake(q, pool, suffix_table, q_limit, part_o, part_lse, split_tokens, nsplit, slot0, scale_log2, softcap,
                 window, kv_scale=None) -> None:
    check_suffix(q, pool, suffix_table, q_limit, part_o, part_lse, split_tokens, nsplit, slot0, softcap, window,
                 kv_scale)


@torch.library.custom_op("hf_cascade::merge", mutates_args=("out",), device_types="cuda")
def merge_op(part_o: torch.Tensor, part_lse: torch.Tensor, row_nchunks: torch.Tensor, out: torch.Tensor, slot0: int,
             nsplit: int, row_nmid: Optional[torch.Tensor], mid_slot0: int, sinks: Optional[torch.Tensor]) -> None:
    """Log-sum-exp of each row's slots [0, row_nchunks[r]), [mid_slot0, mid_slot0 + row_nmid[r]) and [slot0, slot0 +
    nsplit), and the head's sink, into out (csrc/merge.cu)."""
    check_merge(part_o, part_lse, row_nchunks, out, slot0, nsplit, row_nmid, mid_slot0, sinks)
    _aligned(part_o=part_o)
    with torch.cuda.device(out.device):
        _lib(out.device).merge(part_o, part_lse, row_nchunks, out, slot0, nsplit, _stream(out.device), row_nmid,
                               mid_slot0, sinks)


@merge_op.register_fake
def _merge_fake(part_o, part_lse, row_nchunks, out, slot0, nsplit, row_nmid, mid_slot0, sinks) -> None:
    check_merge(part_o, part_lse, row_nchunks, out, slot0, nsplit, row_nmid, mid_slot0, sinks)


# ------------------------------------------------------------------------------ entry points for attend

def prefix(lib, stream: int, q, pool, group_rows, prefix_table, prefix_len, part_o, part_lse, m_tile: int,
           row_tiles: int, chunk_tokens: int, max_chunks: int, scale_log2: float, q_limit, slot0: int = 0,
           softcap: float = 0.0, window: int = 0, tune: int = 0, kv_scale=None) -> None:
    """The prefix kernel: the operator while torch.compile traces, else the library directly on ``stream``."""
    if _is_compiling():
        torch.ops.hf_cascade.prefix(q, pool, group_rows, prefix_table, prefix_len, part_o, part_lse, m_tile,
                                    row_tiles, chunk_tokens, max_chunks, scale_log2, q_limit, slot0, softcap, window,
                                    tune, kv_scale)
    else:
        if lib.debug:
            check_prefix(q, pool, group_rows, prefix_table, prefix_len, part_o, part_lse, m_tile, row_tiles,
                         chunk_tokens, max_chunks, q_limit, slot0, softcap, window, kv_scale)
        lib.prefix(q, pool, group_rows, prefix_table, prefix_len, part_o, part_lse, m_tile, row_tiles, chunk_tokens,
                   max_chunks, scale_log2, stream, q_limit, slot0, softcap, window, tune, kv_scale)


def suffix(lib, stream: int, q, pool, suffix_table, q_limit, part_o, part_lse, split_tokens: int, nsplit: int,
           slot0: int, scale_log2: float, softcap: float = 0.0, window: int = 0, kv_scale=None) -> None:
    """The suffix kernel: the operator while torch.compile traces, else the library directly on ``stream``."""
    if _is_compiling():
        torch.ops.hf_cascade.suffix(q, pool, suffix_table, q_limit, part_o, part_lse, split_tokens, nsplit, slot0,
                                    scale_log2, softcap, window, kv_scale)
    else:
        if lib.debug:
            check_suffix(q, pool, suffix_table, q_limit, part_o, part_lse, split_tokens, nsplit, slot0, softcap,
                         window, kv_scale)
        lib.suffix(q, pool, suffix_table, q_limit, part_o, part_lse, split_tokens, nsplit, slot0, scale_log2, stream,
                   softcap, window, kv_scale)


def merge(lib, stream: int, part_o, part_lse, row_nchunks, out, slot0: int, nsplit: int, row_nmid=None,
          mid_slot0: int = 0, sinks=None) -> None:
    """The merge kernel: the operator while torch.compile traces, else the library directly on ``stream``."""
    if _is_compiling():
        torch.ops.hf_cascade.merge(part_o, part_lse, row_nchunks, out, slot0, nsplit, row_nmid, mid_slot0, sinks)
    else:
        if lib.debug:
            check_merge(part_o, part_lse, row_nchunks, out, slot0, nsplit, row_nmid, mid_slot0, sinks)
        lib.merge(part_o, part_lse, row_nchunks, out, slot0, nsplit, stream, row_nmid, mid_slot0, sinks)
