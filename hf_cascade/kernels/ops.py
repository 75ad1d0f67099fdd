"""Typed entry points of the CUDA kernels: ``torch.ops.hf_cascade.{prefix,suffix,merge,solo}``.

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
    row_group    [R] int32 (solo: each row's group, -1: none)   counters [R x Hkv x query blocks] int32, all 0

Each kernel's arguments are one value, :class:`PrefixArgs`, :class:`SuffixArgs`, :class:`MergeArgs`: their fields
(in order, with their annotations and defaults) are the operator's schema, and the checks, the eager launcher
(``cuda_binding._Lib``, which packs them into the C struct) and the tests' emulations take the value whole, so a new
kernel argument is a field here, its check, and its place in the C struct. The layer's variants come from its
:class:`~hf_cascade.kernels.base.AttentionParams` through :func:`layer_args` (one place), as :class:`LayerArgs`
(0: off): ``scale_log2``; ``softcap`` (logits -> softcap x tanh(logit / softcap)) and ``window`` (each query sees
its last ``window`` keys over the group prefix and its suffix; the prefix kernel reads the suffix level's
``q_limit`` for it) in the prefix and suffix kernels; ``sinks`` in the merge. The prefix kernel writes its chunks
from slot ``slot0`` on (the middle level of a three-level plan follows the group prefix's chunks).

The eager path does not go through the operator dispatcher: a custom-op call that does nothing costs ~16 us of host
time, the ctypes launches of one layer's three kernels ~7 us together (x86 CPU, torch 2.13;
``benchmarks/kernel_call_overhead.py``). So :func:`prefix`, :func:`suffix` and :func:`merge` call the library
directly in eager mode (the backend checks q and the pool per call and the plan once per step; with
``$HF_CASCADE_CUDA_DEBUG`` the operators' checks run on every launch too) and the operators while ``torch.compile``
traces.
"""
from __future__ import annotations

import inspect
import math
import typing
from typing import NamedTuple, Optional

import torch

from .cuda_binding import DTYPE_CODES, KV_DTYPE_CODES   # the C side's codes (the binding owns the C ABI)
from .cuda_tuning import SOLO_MAX_SPLIT, SOLO_QB, solo_counters   # noqa: F401 (SOLO_QB re-exported)
from torch.compiler import is_compiling as _is_compiling   # bound once: the eager path pays for every lookup

__all__ = ["LayerArgs", "layer_args", "PrefixArgs", "SuffixArgs", "MergeArgs", "SoloArgs", "check_prefix",
           "check_suffix", "check_merge", "check_solo", "prefix", "suffix", "merge", "solo", "DTYPE_CODES",
           "HEAD_DIMS"]

HEAD_DIMS = (64, 128, 256)
M_TILES = (16, 32, 64)
LOG2E = 1.0 / math.log(2.0)


# ---------------------------------------------------------------------------------------- arguments

class LayerArgs(NamedTuple):
    """One layer's :class:`~hf_cascade.kernels.base.AttentionParams` as the kernels take them (:func:`layer_args`):
    the fields of :class:`PrefixArgs`, :class:`SuffixArgs` and :class:`MergeArgs` of the same names come from here."""

    scale_log2: float                       # the softmax scale x log2(e) (the kernels' exp2 domain)
    softcap: float                          # 0: off
    window: int                             # 0: off
    sinks: Optional[torch.Tensor]           # float32 [Hq] on q's device, or None


def layer_args(params, q: torch.Tensor) -> LayerArgs:
    """``params`` (the layer's AttentionParams) as the kernels take them, for queries ``q``: the one place where a
    layer's variants become kernel arguments (0 for off; the sinks float32 [Hq] on q's device, a no-op when the
    parameter is so already). Raises ValueError for a value the kernels cannot take."""
    softcap, window, sinks = params.softcap, params.window, params.sinks
    if softcap is not None and not float(softcap) > 0.0:
        raise ValueError(f"cuda backend: softcap {softcap} must be > 0 (None: off)")
    if window is not None and int(window) < 1:
        raise ValueError(f"cuda backend: sliding window {window} must be >= 1 (None: off)")
    if sinks is not None:
        if sinks.shape != (q.shape[2],):
            raise ValueError(f"cuda backend: sinks of shape {tuple(sinks.shape)}, expected ({q.shape[2]},) (one per "
                             "query head)")
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()   # a no-op when it is already so
    return LayerArgs(float(params.scale) * LOG2E, 0.0 if softcap is None else float(softcap),
                     0 if window is None else int(window), sinks)


class PrefixArgs(NamedTuple):
    """The prefix kernel's arguments (``hfc_prefix_params``, as tensors and sizes): the operator's schema, in this
    order; what the checks, the launcher (``cuda_binding._Lib.prefix``) and the tests' emulations take."""

    q: torch.Tensor
    pool: torch.Tensor
    group_rows: torch.Tensor
    prefix_table: torch.Tensor
    prefix_len: torch.Tensor
    part_o: torch.Tensor
    part_lse: torch.Tensor
    m_tile: int
    row_tiles: int
    chunk_tokens: int
    max_chunks: int
    scale_log2: float
    q_limit: torch.Tensor                   # the suffix level's (read with a window only)
    slot0: int = 0
    softcap: float = 0.0
    window: int = 0
    tune: int = 0
    kv_scale: Optional[torch.Tensor] = None


class SuffixArgs(NamedTuple):
    """The suffix kernel's arguments (``hfc_suffix_params``), as :class:`PrefixArgs`."""

    q: torch.Tensor
    pool: torch.Tensor
    suffix_table: torch.Tensor
    q_limit: torch.Tensor
    part_o: torch.Tensor
    part_lse: torch.Tensor
    split_tokens: int
    nsplit: int
    slot0: int
    scale_log2: float
    softcap: float = 0.0
    window: int = 0
    kv_scale: Optional[torch.Tensor] = None


class MergeArgs(NamedTuple):
    """The merge kernel's arguments (``hfc_merge_params``), as :class:`PrefixArgs`."""

    part_o: torch.Tensor
    part_lse: torch.Tensor
    row_nchunks: torch.Tensor
    out: torch.Tensor
    slot0: int
    nsplit: int
    row_nmid: Optional[torch.Tensor] = None
    mid_slot0: int = 0
    sinks: Optional[torch.Tensor] = None


class SoloArgs(NamedTuple):
    """The solo kernel's arguments (``hfc_solo_params``: rows that share no prefix, prefix, suffix and merge in one
    launch; csrc/solo.cu), as :class:`PrefixArgs`. Its partials are slots [0, nsplit) and ``counters`` (int32, one
    per (row, KV head, query block of SOLO_QB queries)) must be 0, as every launch leaves them."""

    q: torch.Tensor
    pool: torch.Tensor
    row_group: torch.Tensor
    prefix_table: torch.Tensor
    prefix_len: torch.Tensor
    suffix_table: torch.Tensor
    q_limit: torch.Tensor
    part_o: torch.Tensor
    part_lse: torch.Tensor
    counters: torch.Tensor
    out: torch.Tensor
    split_tokens: int
    nsplit: int
    scale_log2: float


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


def check_prefix(a: PrefixArgs) -> None:
    """Raise TypeError / ValueError naming the argument unless the prefix kernel can take these arguments."""
    q = a.q
    R, Lq, Hq, D, bs, Hkv = _q_pool("prefix", q, a.pool, a.kv_scale)
    _variants("prefix", a.softcap, a.window)
    if a.window > 0:                          # read only with a window
        _index("prefix", "q_limit", a.q_limit, (R, Lq), q.device)
    if a.slot0 < 0:
        _fail("prefix", f"slot0 {a.slot0} must be >= 0")
    _index("prefix", "group_rows", a.group_rows, (None, None), q.device)
    G, Rg = a.group_rows.shape
    _index("prefix", "prefix_table", a.prefix_table, (G, None), q.device)
    _index("prefix", "prefix_len", a.prefix_len, (G,), q.device)
    m_tile, row_tiles = a.m_tile, a.row_tiles
    if m_tile not in M_TILES or (m_tile == 64 and D > 128):
        _fail("prefix", f"m_tile {m_tile} (16, 32, or 64 for head_dim <= 128)")
    if row_tiles < 1 or row_tiles * m_tile < Rg * Lq * (Hq // Hkv):
        _fail("prefix", f"row_tiles {row_tiles} x m_tile {m_tile} < the {Rg * Lq * (Hq // Hkv)} query rows of a "
                        "group and KV head")
    if a.chunk_tokens < 1 or a.max_chunks < 0:
        _fail("prefix", f"chunk_tokens {a.chunk_tokens} must be >= 1 and max_chunks {a.max_chunks} >= 0")
    _partials("prefix", a.part_o, a.part_lse, a.slot0 + a.max_chunks, R * Lq * Hq, D, q.device)


def check_suffix(a: SuffixArgs) -> None:
    """Raise TypeError / ValueError naming the argument unless the suffix kernel can take these arguments."""
    q = a.q
    R, Lq, Hq, D, _, _ = _q_pool("suffix", q, a.pool, a.kv_scale)
    _variants("suffix", a.softcap, a.window)
    _index("suffix", "suffix_table", a.suffix_table, (R, None), q.device)
    _index("suffix", "q_limit", a.q_limit, (R, Lq), q.device)
    if a.split_tokens < 1 or a.nsplit < 1 or a.slot0 < 0:
        _fail("suffix", f"split_tokens {a.split_tokens} and nsplit {a.nsplit} must be >= 1, slot0 {a.slot0} >= 0")
    _partials("suffix", a.part_o, a.part_lse, a.slot0 + a.nsplit, R * Lq * Hq, D, q.device)


def check_merge(a: MergeArgs) -> None:
    """Raise TypeError / ValueError naming the argument unless the merge kernel can take these arguments."""
    out = a.out
    _tensor("merge", "out", out, dim=4)
    if out.dtype not in DTYPE_CODES:
        _fail("merge", f"out must be bfloat16 or float16, got {out.dtype}", TypeError)
    R, Lq, Hq, D = out.shape
    if D not in HEAD_DIMS:
        _fail("merge", f"out's head_dim {D} is not supported (supported: {HEAD_DIMS})")
    if a.slot0 < 0 or a.nsplit < 0 or a.mid_slot0 < 0:
        _fail("merge", f"slot0 {a.slot0}, nsplit {a.nsplit} and mid_slot0 {a.mid_slot0} must be >= 0")
    _merged_levels("merge", a.row_nchunks, R, Hq, a.slot0, a.row_nmid, a.mid_slot0, a.sinks, out.device)
    _partials("merge", a.part_o, a.part_lse, a.slot0 + a.nsplit, R * Lq * Hq, D, out.device)


def check_solo(a: SoloArgs) -> None:
    """Raise TypeError / ValueError naming the argument unless the solo kernel can take these arguments."""
    q = a.q
    if a.pool.dtype != q.dtype:
        _fail("solo", f"the pool must hold q's dtype {q.dtype}, got {a.pool.dtype} (an fp8 pool runs the three "
                      "kernels)", TypeError)
    R, Lq, Hq, D, bs, Hkv = _q_pool("solo", q, a.pool)
    _index("solo", "row_group", a.row_group, (R,), q.device)
    _index("solo", "prefix_table", a.prefix_table, (None, None), q.device)
    G, Mp = a.prefix_table.shape
    _index("solo", "prefix_len", a.prefix_len, (G,), q.device)
    _index("solo", "suffix_table", a.suffix_table, (R, None), q.device)
    _index("solo", "q_limit", a.q_limit, (R, Lq), q.device)
    Ms = a.suffix_table.shape[1]
    if not 1 <= a.split_tokens <= SOLO_MAX_SPLIT or a.nsplit < 1 or a.split_tokens * a.nsplit < (Mp + Ms) * bs:
        _fail("solo", f"{a.nsplit} splits of {a.split_tokens} tokens (1 to {SOLO_MAX_SPLIT}) do not cover the "
                      f"tables' {(Mp + Ms) * bs} tokens")
    _tensor("solo", "counters", a.counters, dtype=torch.int32, device=q.device)
    if a.counters.numel() < solo_counters(R, Lq, Hq, Hkv):
        _fail("solo", f"counters holds {a.counters.numel()} ints, the kernel counts in {solo_counters(R, Lq, Hq, Hkv)} "
                      f"({R} rows x {Hkv} KV heads x query blocks of {SOLO_QB})")
    _tensor("solo", "out", a.out, dtype=q.dtype, dim=4, device=q.device)
    if a.out.shape != q.shape:
        _fail("solo", f"out has shape {tuple(a.out.shape)}, q {tuple(q.shape)}")
    _partials("solo", a.part_o, a.part_lse, a.nsplit, R * Lq * Hq, D, q.device)


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


def _signature(args_type) -> inspect.Signature:
    """``args_type``'s fields as a function's parameters (their annotations and defaults): the operator's schema."""
    hints = typing.get_type_hints(args_type)
    P = inspect.Parameter
    return inspect.Signature([P(name, P.POSITIONAL_OR_KEYWORD, annotation=hints[name],
                                default=args_type._field_defaults.get(name, P.empty)) for name in args_type._fields],
                             return_annotation=None)


def _operator(name: str, args_type, run, check, mutates_args: tuple):
    """The custom operator ``hf_cascade::<name>``: its schema is ``args_type``'s fields (in order), its CUDA
    implementation ``run(args)``, its fake implementation ``check(args)``."""
    def operator(*args, **kwargs) -> None:
        run(args_type(*args, **kwargs))

    def fake(*args, **kwargs) -> None:
        check(args_type(*args, **kwargs))

    operator.__signature__ = _signature(args_type)
    operator.__name__ = operator.__qualname__ = f"{name}_op"
    operator.__doc__ = run.__doc__
    op = torch.library.custom_op(f"hf_cascade::{name}", operator, mutates_args=mutates_args, device_types="cuda")
    op.register_fake(fake)
    return op


def _run_prefix(a: PrefixArgs) -> None:
    """Level 0 (or the middle level): writes partial slots [slot0, slot0 + max_chunks) of every row in a group
    (csrc/prefix.cu; ``tune``: the prefix kernel's code, hf_cascade.kernels.cuda_tuning: a tuning variant's or
    HOPPER_KERNEL, 0 by default; an fp8 pool: 0 or HOPPER_FP8_KERNEL, with ``kv_scale``)."""
    check_prefix(a)
    _aligned(q=a.q, pool=a.pool, part_o=a.part_o)      # 16-byte vector loads and stores
    with torch.cuda.device(a.q.device):
        _lib(a.q.device).prefix(a, _stream(a.q.device))


def _run_suffix(a: SuffixArgs) -> None:
    """Level 1: writes partial slots [slot0, slot0 + nsplit) of every row (csrc/suffix.cu)."""
    check_suffix(a)
    _aligned(q=a.q, pool=a.pool, part_o=a.part_o)      # 16-byte vector loads and stores
    with torch.cuda.device(a.q.device):
        _lib(a.q.device).suffix(a, _stream(a.q.device))


def _run_merge(a: MergeArgs) -> None:
    """Log-sum-exp of each row's slots [0, row_nchunks[r]), [mid_slot0, mid_slot0 + row_nmid[r]) and [slot0, slot0 +
    nsplit), and the head's sink, into out (csrc/merge.cu)."""
    check_merge(a)
    _aligned(part_o=a.part_o)
    with torch.cuda.device(a.out.device):
        _lib(a.out.device).merge(a, _stream(a.out.device))


def _run_solo(a: SoloArgs) -> None:
    """Rows that share no prefix: each row's prefix and suffix in one launch, merged into out (csrc/solo.cu)."""
    check_solo(a)
    _aligned(q=a.q, pool=a.pool, part_o=a.part_o)
    with torch.cuda.device(a.q.device):
        _lib(a.q.device).solo(a, _stream(a.q.device))


prefix_op = _operator("prefix", PrefixArgs, _run_prefix, check_prefix, ("part_o", "part_lse"))
suffix_op = _operator("suffix", SuffixArgs, _run_suffix, check_suffix, ("part_o", "part_lse"))
merge_op = _operator("merge", MergeArgs, _run_merge, check_merge, ("out",))
solo_op = _operator("solo", SoloArgs, _run_solo, check_solo, ("part_o", "part_lse", "counters", "out"))


# ------------------------------------------------------------------------------ entry points for attend

def prefix(lib, stream: int, a: PrefixArgs) -> None:
    """The prefix kernel: the operator while torch.compile traces, else the library directly on ``stream``."""
    if _is_compiling():
        torch.ops.hf_cascade.prefix(*a)
    else:
        if lib.debug:
            check_prefix(a)
        lib.prefix(a, stream)


def suffix(lib, stream: int, a: SuffixArgs) -> None:
    """The suffix kernel: the operator while torch.compile traces, else the library directly on ``stream``."""
    if _is_compiling():
        torch.ops.hf_cascade.suffix(*a)
    else:
        if lib.debug:
            check_suffix(a)
        lib.suffix(a, stream)


def merge(lib, stream: int, a: MergeArgs) -> None:
    """The merge kernel: the operator while torch.compile traces, else the library directly on ``stream``."""
    if _is_compiling():
        torch.ops.hf_cascade.merge(*a)
    else:
        if lib.debug:
            check_merge(a)
        lib.merge(a, stream)


def solo(lib, stream: int, a: SoloArgs) -> None:
    """The solo kernel: the operator while torch.compile traces, else the library directly on ``stream``."""
    if _is_compiling():
        torch.ops.hf_cascade.solo(*a)
    else:
        if lib.debug:
            check_solo(a)
        lib.solo(a, stream)
