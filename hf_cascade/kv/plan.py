"""From block tables to one step's cascade plan, built once per forward and reused by every layer.

Level 0 groups rows whose tables begin with the same full blocks (the beams or samples of one
prompt): their queries read that shared prefix once. Level 1 is each row's own rest of the table,
block-aligned after its group's prefix. Writes (where this step's new tokens go, and the
copy-on-write copies that must happen first) ride along so each layer's update is a few index ops.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from ..kernels.capture import refuse_in_capture


@dataclass
class StepPlan:
    """Index tensors of one step (numpy on the host; :meth:`on` gives torch tensors on a device).

    Shapes: R rows, Lq query tokens per row, G prefix groups.

    - ``fresh``: no row held any token before this step (a prefill into an empty cache): attention
      needs no cache reads and runs densely over the new K/V.
    - ``q_len``: Lq; ``num_new``: tokens written this step (pads are not written).
    - ``src_index`` int64 [num_new] or None: which of the R*Lq incoming tokens (row-major) are
      written; None means all of them.
    - ``write_block``/``write_offset`` int64 [num_new]; ``copy_src``/``copy_dst`` int64 [C]:
      copy-on-write block copies, applied before the writes.
    - ``group_rows`` int32 [G, Rg] (-1 pad), ``prefix_table`` int32 [G, Mp] (-1 pad),
      ``prefix_len`` int32 [G]: level 0.
    - ``suffix_table`` int32 [R, Ms] (-1 pad), ``q_limit`` int32 [R, Lq]: level 1; query i of row r
      sees the first ``q_limit[r, i]`` tokens of its suffix.
    - Optional middle level, when a group's rows split into subgroups that share more blocks (a
      system prompt shared by a batch, then each prompt's own rest shared by its beams):
      ``mid_group_rows`` int32 [G2, R2], ``mid_table`` int32 [G2, M2], ``mid_len`` int32 [G2] (the
      blocks after the group prefix that a subgroup shares), and ``inner_suffix_table`` /
      ``inner_q_limit``: each row's suffix after its deepest shared level. Backends that take two
      levels use ``suffix_table``/``q_limit`` (after the group prefix), which stay exact.
    """

    fresh: bool
    q_len: int
    src_index: np.ndarray | None
    write_block: np.ndarray
    write_offset: np.ndarray
    copy_src: np.ndarray
    copy_dst: np.ndarray
    group_rows: np.ndarray
    prefix_table: np.ndarray
    prefix_len: np.ndarray
    suffix_table: np.ndarray
    q_limit: np.ndarray
    mid_group_rows: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))
    mid_table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))
    mid_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    inner_suffix_table: np.ndarray | None = None
    inner_q_limit: np.ndarray | None = None
    layout: "DecodeLayout | None" = None    # set for a static decode step: the call's fixed part of the plan
    # the tables' widths are fixed while their values and the prefix lengths may be rewritten in place for a later
    # call (:meth:`rewrite_prefix`: a kept encoder-decoder state's cross plan, seq2seq/cross_kv.py)
    fixed_widths: bool = False
    # whether the step's layers launch the copy-on-write copies (a static step pads its pairs and always does); False
    # for a planned step of rows that append to no shared block (DecodeLayout.planned_step(copies=False)), and for a
    # static step whose copies of every layer were made as it began (CascadeCache._copy_blocks_of_all_layers)
    copies: bool = True
    _on_device: dict = field(default_factory=dict, repr=False)

    @property
    def num_groups(self) -> int:
        return self.group_rows.shape[0]

    @property
    def static(self) -> bool:
        """A decode step of a static layout: fixed shapes, persistent device buffers (graph-safe)."""
        return self.layout is not None

    @property
    def launch_by_widths(self) -> bool:
        """A backend's launch state must follow the tables' widths, not the lengths: a static decode step (its layout
        may adopt another call's values) or a plan whose values are rewritten in place (``fixed_widths``)."""
        return self.layout is not None or self.fixed_widths

    def rewrite_prefix(self, prefix_table: np.ndarray, prefix_len: np.ndarray) -> None:
        """Level 0's tables and lengths replaced by ``prefix_table`` (of the same shape) and ``prefix_len``, on the host
        and in every device copy in place (a kept graph reads those by address). Only for a plan of ``fixed_widths``."""
        if not self.fixed_widths or prefix_table.shape != self.prefix_table.shape \
                or prefix_len.shape != self.prefix_len.shape:
            raise RuntimeError("hf_cascade internal error: a plan's prefix rewritten in place with other shapes; "
                               "please report it")
        self.prefix_table, self.prefix_len = prefix_table, prefix_len.astype(np.int32)
        for dp in self._on_device.values():
            dp.write_levels(self, ("prefix_table", "prefix_len"))

    def kv_reads(self) -> tuple[int, int]:
        """K/V tokens this step's attention reads per layer and KV head: ``(cascade, per_row)``. ``cascade``: each
        shared level once (group prefix, middle level) plus each row's own suffix; ``per_row``: every row reading
        its whole sequence, as a per-row cache does (stock). Multiply by ``2 * head_dim * dtype bytes * KV heads *
        layers`` for bytes."""
        rows = self.q_limit.shape[0]
        member = self.group_rows >= 0
        prefix_of_row = np.zeros(rows, np.int64)
        prefix_of_row[self.group_rows[member]] = np.broadcast_to(self.prefix_len[:, None], member.shape)[member]
        suffix = self.q_limit[:, -1].astype(np.int64)
        per_row = int((prefix_of_row + suffix).sum())
        shared = int(self.prefix_len.sum())
        if self.mid_len.size and self.inner_q_limit is not None:
            return shared + int(self.mid_len.sum()) + int(self.inner_q_limit[:, -1].sum()), per_row
        return shared + int(suffix.sum()), per_row

    def on(self, device: torch.device) -> "DevicePlan":
        """The plan's tensors on ``device``, uploaded once per step and device (layers may sit on several).
        A static step writes into the layout's persistent buffers (one copy per step), which keep their
        addresses for the whole call."""
        device = torch.device(device)
        key = str(device)
        if key not in self._on_device:     # uploads (and, for a static step, an event sync): before any capture
            refuse_in_capture(f"the step plan's upload to {key} ({'static' if self.layout is not None else 'per-step'}"
                              " plan buffers)")
        if key not in self._on_device and self.layout is not None:
            self._on_device[key] = self.layout.upload(self, device)
        if key not in self._on_device:
            def t(a, dtype):
                return None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)
            self._on_device[key] = DevicePlan(
                src_index=t(self.src_index, torch.long),
                write_block=t(self.write_block, torch.long), write_offset=t(self.write_offset, torch.long),
                copy_src=t(self.copy_src, torch.long), copy_dst=t(self.copy_dst, torch.long),
                group_rows=t(self.group_rows, torch.int32), prefix_table=t(self.prefix_table, torch.int32),
                prefix_len=t(self.prefix_len, torch.int32), suffix_table=t(self.suffix_table, torch.int32),
                q_limit=t(self.q_limit, torch.int32),
                mid_group_rows=t(self.mid_group_rows, torch.int32), mid_table=t(self.mid_table, torch.int32),
                mid_len=t(self.mid_len, torch.int32), inner_suffix_table=t(self.inner_suffix_table, torch.int32),
                inner_q_limit=t(self.inner_q_limit, torch.int32))
        return self._on_device[key]


@dataclass
class DevicePlan:
    src_index: torch.Tensor | None
    write_block: torch.Tensor
    write_offset: torch.Tensor
    copy_src: torch.Tensor
    copy_dst: torch.Tensor
    group_rows: torch.Tensor
    prefix_table: torch.Tensor
    prefix_len: torch.Tensor
    suffix_table: torch.Tensor
    q_limit: torch.Tensor
    mid_group_rows: torch.Tensor
    mid_table: torch.Tensor
    mid_len: torch.Tensor
    inner_suffix_table: torch.Tensor | None
    inner_q_limit: torch.Tensor | None

    def write_levels(self, source, names: tuple) -> None:
        """``source``'s host arrays of ``names`` (level fields, of these tensors' shapes) written into these tensors in
        place: a kept graph reads them by address."""
        for name in names:
            values = getattr(source, name)
            if values.size:
                getattr(self, name).copy_(torch.from_numpy(np.ascontiguousarray(values)).to(torch.int32))


def find_prefix_groups(tables: np.ndarray, prev_lengths: np.ndarray, block_size: int, min_rows: int):
    """Rows sharing their leading full blocks.

    Returns ``(groups, prefix_blocks)``: a list of row-index arrays and, per group, how many
    leading blocks all its rows share (only blocks filled before this step: those are never written).
    """
    full_before = prev_lengths // block_size                     # blocks each row had completely filled
    candidates = np.nonzero(full_before >= 1)[0]
    if candidates.size < min_rows:
        return [], []
    first = tables[candidates, 0]
    order = np.argsort(first, kind="stable")
    first_sorted = first[order]
    starts = np.flatnonzero(np.r_[True, first_sorted[1:] != first_sorted[:-1]])
    ends = np.r_[starts[1:], first_sorted.size]
    groups, prefix_blocks = [], []
    for s, e in zip(starts, ends):                               # one iteration per group (a prompt), not per block
        if e - s < min_rows:
            continue
        rows = np.sort(candidates[order[s:e]])
        limit = int(full_before[rows].min())
        sub = tables[rows, :limit]
        same = (sub == sub[0]).all(axis=0)
        shared = limit if same.all() else int(np.argmin(same))
        if shared >= 1:
            groups.append(rows)
            prefix_blocks.append(shared)
    return groups, prefix_blocks


@dataclass
class SharedLevels:
    """Which rows share which leading blocks: groups (level 0) and, inside a group, subgroups sharing
    more blocks (the middle level: each prompt's rest after a system prompt shared by the batch)."""

    groups: list          # int arrays of rows
    prefix_blocks: list   # blocks each group shares
    mid_groups: list
    mid_spans: list       # (group prefix blocks, further blocks the subgroup shares)
    block_size: int

    @classmethod
    def find(cls, tables, prev, block_size, min_group_rows, min_prefix_tokens=0, min_saved_tokens=0, fresh=False):
        groups, prefix_blocks = ([], []) if fresh else find_prefix_groups(tables, prev, block_size, min_group_rows)
        if min_prefix_tokens:      # too short to pay: those rows read their whole tables as suffixes
            kept = [(g, nb) for g, nb in zip(groups, prefix_blocks) if nb * block_size >= min_prefix_tokens]
            groups, prefix_blocks = [g for g, _ in kept], [nb for _, nb in kept]
        if min_saved_tokens and sum((len(g) - 1) * nb * block_size for g, nb in zip(groups, prefix_blocks)) \
                < min_saved_tokens:
            groups, prefix_blocks = [], []
        mid_groups, mid_spans = [], []
        for rows, nb in zip(groups, prefix_blocks):
            subgroups, extra = find_prefix_groups(tables[rows, nb:], prev[rows] - nb * block_size, block_size,
                                                  min_group_rows)
            for sub, more in zip(subgroups, extra):
                if len(sub) < len(rows):
                    mid_groups.append(rows[sub])
                    mid_spans.append((nb, more))
        return cls(groups, prefix_blocks, mid_groups, mid_spans, block_size)

    def add_solo_rows(self, full_blocks) -> None:
        """Each row in no group and with full blocks becomes a group of one over them."""
        grouped = np.zeros(len(full_blocks), dtype=bool)
        for rows in self.groups:
            grouped[rows] = True
        for row in np.flatnonzero(~grouped & (full_blocks >= 1)):    # one iteration per row, once per call
            self.groups.append(np.array([row]))
            self.prefix_blocks.append(int(full_blocks[row]))

    def group_arrays(self, tables):
        """``group_rows`` int32 [G, Rg] (-1 pad), ``prefix_table`` int32 [G, Mp] (-1 pad), ``prefix_len`` int32 [G]."""
        group_rows = np.full((len(self.groups), max((len(g) for g in self.groups), default=0)), -1, dtype=np.int32)
        prefix_table = np.full((len(self.groups), max(self.prefix_blocks, default=0)), -1, dtype=np.int32)
        prefix_len = np.zeros(len(self.groups), dtype=np.int32)
        for g, (rows, nb) in enumerate(zip(self.groups, self.prefix_blocks)):
            group_rows[g, : len(rows)] = rows
            prefix_table[g, :nb] = tables[rows[0], :nb]
            prefix_len[g] = nb * self.block_size
        return group_rows, prefix_table, prefix_len

    def mid_arrays(self, tables):
        """``mid_group_rows`` int32 [G2, R2], ``mid_table`` int32 [G2, M2], ``mid_len`` int32 [G2]."""
        mid_group_rows = np.full((len(self.mid_groups), max((len(g) for g in self.mid_groups), default=0)), -1,
                                 dtype=np.int32)
        mid_table = np.full((len(self.mid_groups), max((m for _, m in self.mid_spans), default=0)), -1, dtype=np.int32)
        mid_len = np.zeros(len(self.mid_groups), dtype=np.int32)
        for g, (rows, (nb, more)) in enumerate(zip(self.mid_groups, self.mid_spans)):
            mid_group_rows[g, : len(rows)] = rows
            mid_table[g, :more] = tables[rows[0], nb:nb + more]
            mid_len[g] = more * self.block_size
        return mid_group_rows, mid_table, mid_len

    def row_blocks(self, num_rows):
        """int64 [R] each: blocks of a row's group prefix, and of its deepest shared level."""
        row_prefix_blocks = np.zeros(num_rows, dtype=np.int64)
        for rows, nb in zip(self.groups, self.prefix_blocks):
            row_prefix_blocks[rows] = nb
        inner = row_prefix_blocks.copy()
        for rows, (nb, more) in zip(self.mid_groups, self.mid_spans):
            inner[rows] = nb + more
        return row_prefix_blocks, inner


def build_step_plan(tables: np.ndarray, lengths: np.ndarray, counts: np.ndarray, new_mask: np.ndarray | None,
                    q_len: int, append_plan, block_size: int, min_group_rows: int,
                    min_prefix_tokens: int = 0, min_saved_tokens: int = 0) -> StepPlan:
    """Plan one forward step after the block manager has appended this step's tokens.

    Args:
        tables: int32 [R, W] block tables after the append (-1 pad).
        lengths: int64 [R] tokens per row after the append.
        counts: int64 [R] tokens appended this step per row.
        new_mask: bool [R, q_len], which incoming tokens are real (None: all of them).
        append_plan: the block manager's AppendPlan for this step.
        min_prefix_tokens: groups whose shared prefix is shorter are dropped (their rows read whole tables).
        min_saved_tokens: when all groups together save fewer token reads than this (sum of
            (rows - 1) x prefix tokens), no group is kept: a cascade would cost more than it saves.
    """
    num_rows = tables.shape[0]
    prev = lengths - counts
    fresh = bool((prev == 0).all())
    if new_mask is None:
        seen_new = np.broadcast_to(np.arange(1, q_len + 1, dtype=np.int64), (num_rows, q_len))
        src_index = None
    else:
        seen_new = np.cumsum(new_mask, axis=1, dtype=np.int64)  # real new tokens up to and including each query
        src_index = np.flatnonzero(new_mask.reshape(-1)).astype(np.int64)

    levels = SharedLevels.find(tables, prev, block_size, min_group_rows, min_prefix_tokens, min_saved_tokens,
                               fresh)
    group_rows, prefix_table, prefix_len = levels.group_arrays(tables)
    mid_group_rows, mid_table, mid_len = levels.mid_arrays(tables)
    row_prefix_blocks, inner_prefix_blocks = levels.row_blocks(num_rows)

    # Last level: each row's table shifted past its deepest shared prefix.
    suffix_table, q_limit = _suffix(tables, lengths, prev, seen_new, row_prefix_blocks, block_size)
    inner_suffix_table, inner_q_limit = (_suffix(tables, lengths, prev, seen_new, inner_prefix_blocks, block_size)
                                         if levels.mid_groups else (None, None))

    return StepPlan(
        fresh=fresh, q_len=q_len, src_index=src_index,
        write_block=append_plan.write_block.astype(np.int64), write_offset=append_plan.write_offset.astype(np.int64),
        copy_src=append_plan.copy_src.astype(np.int64), copy_dst=append_plan.copy_dst.astype(np.int64),
        group_rows=group_rows, prefix_table=prefix_table, prefix_len=prefix_len,
        suffix_table=suffix_table, q_limit=q_limit,
        mid_group_rows=mid_group_rows, mid_table=mid_table, mid_len=mid_len,
        inner_suffix_table=inner_suffix_table, inner_q_limit=inner_q_limit)


def _suffix(tables, lengths, prev, seen_new, prefix_blocks, block_size, width=None):
    """Each row's blocks after its first ``prefix_blocks[r]`` blocks, and what each query sees of them.
    ``width``: the table's fixed width (a static layout's capacity); LayoutOutgrown if a row needs more."""
    num_rows = tables.shape[0]
    suffix_blocks = -(-lengths // block_size) - prefix_blocks
    need = int(suffix_blocks.max(initial=0))
    if width is None:
        width = need
    elif need > width:
        raise LayoutOutgrown(f"a row's suffix needs {need} blocks, the layout holds {width}", capacity=True)
    padded = np.concatenate([tables, np.full((num_rows, width + 1), -1, dtype=np.int32)], axis=1)
    cols = prefix_blocks[:, None] + np.arange(width)[None, :]
    suffix_table = np.where(np.arange(width)[None, :] < suffix_blocks[:, None],
                            np.take_along_axis(padded, cols, axis=1), -1).astype(np.int32)
    q_limit = ((prev - prefix_blocks * block_size)[:, None] + seen_new).astype(np.int32)
    return suffix_table, q_limit


# ------------------------------------------------------------------------------ static decode layout

_LAYOUT_SERIALS = itertools.count()
# the level arrays a static step's buffers hold as device tensors (DecodeLayout.adopt rewrites them)
_LEVEL_TENSORS = ("group_rows", "prefix_table", "prefix_len", "mid_group_rows", "mid_table", "mid_len")
_LEVEL_FIELDS = ("group_rows", "prefix_table", "prefix_len", "mid_group_rows", "mid_table", "mid_len",
                 "row_prefix_blocks", "row_inner_blocks")


class LayoutOutgrown(Exception):
    """A decode step no longer fits its static layout (other rows, a row that left its prefix, or a
    suffix longer than the capacity): the caller widens the layout or freezes a new one (and re-captures
    its graph). ``capacity`` is True when only the suffix capacity was too small."""

    def __init__(self, message: str, capacity: bool = False):
        super().__init__(message)
        self.capacity = capacity


@dataclass
class DecodeLayout:
    """The part of the decode plan that is fixed for a whole generate call.

    Beam search and sampling feed one token per row per step, never change the rows, and never move a row
    to another prompt (``beam_idx`` stays inside a prompt's beams). So the levels (which rows share which
    prefix blocks, and whether a cascade pays at all) are decided once, at the first decode step, and kept:
    blocks that rows come to share later are read as part of their suffix (exact, a few reads more). Per
    step only the suffix tables and lengths, the write slots and the copy-on-write pairs change; they go to
    persistent device buffers of fixed shape (suffix tables ``[R, suffix_width]``) with one host-to-device copy
    per step. ``suffix_width`` is the layout's capacity: room for the tokens rows hold plus a few more
    (:func:`decode_room`), never for the call's ``max_new_tokens`` up front; a row that outgrows it raises
    ``LayoutOutgrown(capacity=True)`` and the cache steps on to :meth:`widened` (which a captured graph is
    re-captured for). Kernel backends whose metadata holds for the layout (their launch configuration and
    partial buffers) keep it in ``metadata`` for as long as the layout holds (the step context puts it there).
    """

    num_rows: int
    block_size: int
    group_rows: np.ndarray
    prefix_table: np.ndarray
    prefix_len: np.ndarray
    mid_group_rows: np.ndarray
    mid_table: np.ndarray
    mid_len: np.ndarray
    row_prefix_blocks: np.ndarray      # int64 [R]: blocks of each row's group prefix (0: in no group)
    row_inner_blocks: np.ndarray       # int64 [R]: blocks of each row's deepest shared level
    suffix_width: int
    inner_width: int                   # 0 without a middle level
    token_limit: int                   # the most tokens a row may hold on this layout (LayoutOutgrown past it)
    metadata: dict = field(default_factory=dict, repr=False)
    _buffers: dict = field(default_factory=dict, repr=False)
    serial: int = field(default_factory=lambda: next(_LAYOUT_SERIALS))   # never reused (unlike id())

    def same_geometry(self, other: "DecodeLayout") -> bool:
        """The same rows, levels and capacities: ``other``'s buffers and backend state fit this layout."""
        return (self.num_rows == other.num_rows and self.block_size == other.block_size
                and self.suffix_width == other.suffix_width and self.inner_width == other.inner_width
                and self.token_limit == other.token_limit
                and all(np.array_equal(getattr(self, f), getattr(other, f)) for f in _LEVEL_FIELDS))

    def holds(self, other: "DecodeLayout") -> bool:
        """The same rows and levels as ``other`` and at least its capacities: this layout (its buffers, its
        backend state, a graph captured on it) serves every step ``other`` would."""
        return (self.num_rows == other.num_rows and self.block_size == other.block_size
                and self.suffix_width >= other.suffix_width and self.inner_width >= other.inner_width
                and self.token_limit >= other.token_limit and (self.inner_width > 0) == (other.inner_width > 0)
                and all(np.array_equal(getattr(self, f), getattr(other, f)) for f in _LEVEL_FIELDS))

    def adopt(self, other: "DecodeLayout") -> bool:
        """Take ``other``'s values where this layout's shapes serve it: the same rows in the same levels (which rows
        share, not how many blocks), this layout's widths and capacities at least ``other``'s and at most
        :data:`ADOPT_SPAN` times its level tables' widths. ``other`` is the layout a new call froze; this one, the last call's,
        then carries the new call's prefix tables and lengths (host arrays and device buffers, written in place), so
        the graph captured on it replays for a call of another prompt length (a backend's launch state on a static
        layout follows its shapes, not its lengths). Returns whether it did."""
        if not self.serves(other):
            return False
        self.prefix_table = _padded_to(other.prefix_table, self.prefix_table.shape[1])
        self.mid_table = _padded_to(other.mid_table, self.mid_table.shape[1])
        self.prefix_len, self.mid_len = other.prefix_len, other.mid_len
        self.row_prefix_blocks, self.row_inner_blocks = other.row_prefix_blocks, other.row_inner_blocks
        for buffers in self._buffers.values():
            buffers.adopt_levels(self)
        return True

    def same_levels(self, other: "DecodeLayout") -> bool:
        """The same rows in the same shared levels (which rows share, not how many blocks)."""
        return (self.num_rows == other.num_rows and self.block_size == other.block_size
                and (self.inner_width > 0) == (other.inner_width > 0)
                and np.array_equal(self.group_rows, other.group_rows)
                and np.array_equal(self.mid_group_rows, other.mid_group_rows))

    def serves(self, other: "DecodeLayout") -> bool:
        """Whether this layout's buffers hold ``other``'s values (see :meth:`adopt`)."""
        # (the attention reads the level tables to their width: those within ADOPT_SPAN; the whole table is the
        # bookkeeping's, a few values a row a step, and its width follows the token limit)
        wider = ((self.prefix_table.shape[1], other.prefix_table.shape[1]),
                 (self.mid_table.shape[1], other.mid_table.shape[1]))
        return (self.same_levels(other)
                and self.suffix_width >= other.suffix_width and self.inner_width >= other.inner_width
                and self.token_limit >= other.token_limit and self.table_width >= other.table_width
                and all(theirs <= ours <= ADOPT_SPAN * max(theirs, 1) for ours, theirs in wider))

    @property
    def max_row_tokens(self) -> int:
        """The most tokens any row can hold while this layout is in force (a row that would hold more raises
        LayoutOutgrown in :meth:`step`): how far a step's attention must be right for."""
        tables = int((self.row_prefix_blocks + self.suffix_width).max(initial=0)) * self.block_size
        return min(self.token_limit, tables)

    def __post_init__(self):
        # (plain ints, computed here: a compiled step reads mask_length while dynamo traces, where numpy is traced)
        bs = self.block_size
        self.table_width = shape_bucket(max(
            -(-self.token_limit // bs) + 1, int((self.row_prefix_blocks + self.suffix_width).max(initial=0)),
            int((self.row_inner_blocks + self.inner_width).max(initial=0)) if self.has_mid else 0))
        """Blocks per row of a whole block table that holds every row of this layout to its capacity (a bucket:
        :func:`shape_bucket`): the device bookkeeping's table width (:mod:`hf_cascade.device_blocks`)."""

    @property
    def mask_length(self) -> int:
        """The length a compiled static step tells the model (``CascadeCache.get_seq_length`` while dynamo traces):
        fixed for the layout's shapes, not its prompt's length (a value the model's Python reads is a guard, and a
        guard on the prompt length recompiles per prompt length)."""
        return self.table_width * self.block_size

    @classmethod
    def freeze(cls, tables: np.ndarray, prev_lengths: np.ndarray, block_size: int, max_new_tokens: int,
               min_group_rows: int = 2, min_prefix_tokens: int = 0, min_saved_tokens: int = 0,
               solo_rows: bool = False) -> "DecodeLayout":
        """The layout of a call whose rows hold ``prev_lengths`` tokens in ``tables`` before its first decode
        step, with room for ``max_new_tokens`` more each (a call passes :func:`decode_room`). ``solo_rows``: a row
        that shares no prefix becomes a group of its own over its full blocks (a backend whose prefix kernel spreads
        a long context over the whole GPU reads it faster than its suffix kernel does)."""
        num_rows = tables.shape[0]
        levels = SharedLevels.find(tables, prev_lengths, block_size, min_group_rows, min_prefix_tokens,
                                   min_saved_tokens)
        if solo_rows:
            levels.add_solo_rows(prev_lengths // block_size)
        group_rows, prefix_table, prefix_len = levels.group_arrays(tables)
        mid_group_rows, mid_table, mid_len = levels.mid_arrays(tables)
        # the prefix tables' widths bucketed (-1 padding past prefix_len / mid_len, which every backend masks): a
        # range of prompt lengths shares one shape (see shape_bucket)
        prefix_table, mid_table = _padded_columns(prefix_table), _padded_columns(mid_table)
        row_prefix, row_inner = levels.row_blocks(num_rows)
        suffix_width, inner_width = _widths(prev_lengths, max_new_tokens, block_size, row_prefix,
                                            row_inner if levels.mid_groups else None)
        return cls(num_rows, block_size, group_rows, prefix_table, prefix_len, mid_group_rows, mid_table, mid_len,
                   row_prefix, row_inner, suffix_width, inner_width, _token_limit(prev_lengths, max_new_tokens))

    def widened(self, prev_lengths: np.ndarray, max_new_tokens: int) -> "DecodeLayout":
        """The same levels with room for ``max_new_tokens`` more tokens per row (levels are never re-found
        mid-call: beams that came to share decode blocks would make levels the next reorder breaks)."""
        suffix_width, inner_width = _widths(prev_lengths, max_new_tokens, self.block_size, self.row_prefix_blocks,
                                            self.row_inner_blocks if self.has_mid else None)
        return DecodeLayout(
            self.num_rows, self.block_size, self.group_rows, self.prefix_table, self.prefix_len, self.mid_group_rows,
            self.mid_table, self.mid_len, self.row_prefix_blocks, self.row_inner_blocks,
            max(self.suffix_width, suffix_width), max(self.inner_width, inner_width),
            max(self.token_limit, _token_limit(prev_lengths, max_new_tokens)))

    def room(self, lengths: np.ndarray) -> int:
        """How many more one-token steps rows holding ``lengths`` tokens can take on this layout (every row grows by
        one a step) before :meth:`step` would raise LayoutOutgrown(capacity=True)."""
        bs = self.block_size
        room = self.token_limit - int(lengths.max(initial=0))
        room = min(room, int(((self.row_prefix_blocks + self.suffix_width) * bs - lengths).min(initial=room)))
        if self.has_mid:
            room = min(room, int(((self.row_inner_blocks + self.inner_width) * bs - lengths).min(initial=room)))
        return room

    @property
    def has_mid(self) -> bool:
        return self.inner_width > 0

    def _check_prefixes(self, tables: np.ndarray) -> None:
        for rows, table, lens in ((self.group_rows, self.prefix_table, self.prefix_len),
                                  (self.mid_group_rows, self.mid_table, self.mid_len)):
            if rows.size == 0 or table.shape[1] == 0:
                continue
            table = table[:, :int((lens // self.block_size).max(initial=0))]     # (past it: the bucket's padding)
            if table.shape[1] == 0:
                continue
            if rows is self.mid_group_rows:       # the middle level's blocks start after the group prefix
                start = self.row_prefix_blocks[rows.clip(0)]                       # [G2, R2]
                cols = start[..., None] + np.arange(table.shape[1])               # [G2, R2, M2]
            else:
                cols = np.broadcast_to(np.arange(table.shape[1]), rows.shape + (table.shape[1],))
            if cols.max(initial=0) >= tables.shape[1]:
                raise LayoutOutgrown("a row holds fewer blocks than its frozen prefix")
            held = tables[rows.clip(0)[..., None], cols]                           # [G, Rg, M]
            used = (rows >= 0)[..., None] & (np.arange(table.shape[1]) < (lens // self.block_size)[:, None])[:, None]
            if not (np.where(used, held == table[:, None, :], True)).all():
                raise LayoutOutgrown("a row no longer begins with its group's frozen prefix blocks")

    def step(self, tables: np.ndarray, lengths: np.ndarray, append_plan) -> StepPlan:
        """The plan of one decode step (one new token per row), after the block manager's append."""
        R = self.num_rows
        if tables.shape[0] != R or append_plan.write_block.shape[0] != R:
            raise LayoutOutgrown(f"the step has {tables.shape[0]} rows / {append_plan.write_block.shape[0]} new "
                                 f"tokens, the layout {R}")
        self._check_prefixes(tables)
        longest = int(lengths.max(initial=0))
        if longest > self.token_limit:      # what attention_horizon promised (a sliding window left out) ends here
            raise LayoutOutgrown(f"a row holds {longest} tokens, the layout holds {self.token_limit}", capacity=True)
        prev = lengths - 1
        seen_new = np.ones((R, 1), dtype=np.int64)
        suffix_table, q_limit = _suffix(tables, lengths, prev, seen_new, self.row_prefix_blocks, self.block_size,
                                        self.suffix_width)
        inner_table = inner_limit = None
        if self.has_mid:
            inner_table, inner_limit = _suffix(tables, lengths, prev, seen_new, self.row_inner_blocks,
                                               self.block_size, self.inner_width)
        # copy-on-write pairs padded to R: a repeated pair writes the same values again, and with no pair a
        # block copied onto itself (before this step's writes) changes nothing
        src, dst = append_plan.copy_src.astype(np.int64), append_plan.copy_dst.astype(np.int64)
        if src.size > R:
            raise LayoutOutgrown(f"{src.size} copy-on-write copies in one step of {R} rows")
        fill = int(src[0]) if src.size else int(append_plan.write_block[0])
        fill_dst = int(dst[0]) if dst.size else fill
        copy_src = np.concatenate([src, np.full(R - src.size, fill, dtype=np.int64)])
        copy_dst = np.concatenate([dst, np.full(R - dst.size, fill_dst, dtype=np.int64)])
        return StepPlan(
            fresh=False, q_len=1, src_index=None,
            write_block=append_plan.write_block.astype(np.int64), write_offset=append_plan.write_offset.astype(np.int64),
            copy_src=copy_src, copy_dst=copy_dst,
            group_rows=self.group_rows, prefix_table=self.prefix_table, prefix_len=self.prefix_len,
            suffix_table=suffix_table, q_limit=q_limit,
            mid_group_rows=self.mid_group_rows, mid_table=self.mid_table, mid_len=self.mid_len,
            inner_suffix_table=inner_table, inner_q_limit=inner_limit, layout=self)

    def upload(self, plan: StepPlan, device: torch.device) -> "DevicePlan":
        """Write ``plan``'s per-step arrays into this layout's persistent buffers on ``device``."""
        return self._buffers_on(device).fill(plan)

    def planned_step(self, device: torch.device, copies: bool = True) -> StepPlan:
        """The plan of a decode step whose per-step tensors were written into this layout's buffers on ``device``
        by the device itself (:mod:`hf_cascade.whole_step`): the layers read the buffers as they are, nothing is
        uploaded. Made once per device and shared by every such step: its host arrays of per-step values are zeros of
        the right shapes (only their shapes are read: each layer's attention was bound at the layout's first step, on
        the host plan). ``copies=False``: the same plan for steps that copy no block (``StepPlan.copies``)."""
        buffers = self._buffers_on(device)
        if buffers.planned is None:
            R, W, W2 = self.num_rows, self.suffix_width, self.inner_width
            zeros = np.zeros(R, dtype=np.int64)
            buffers.planned = StepPlan(
                fresh=False, q_len=1, src_index=None, write_block=zeros, write_offset=zeros, copy_src=zeros,
                copy_dst=zeros, group_rows=self.group_rows, prefix_table=self.prefix_table,
                prefix_len=self.prefix_len, suffix_table=np.full((R, W), -1, dtype=np.int32),
                q_limit=np.zeros((R, 1), dtype=np.int32), mid_group_rows=self.mid_group_rows,
                mid_table=self.mid_table, mid_len=self.mid_len,
                inner_suffix_table=np.full((R, W2), -1, dtype=np.int32) if W2 else None,
                inner_q_limit=np.zeros((R, 1), dtype=np.int32) if W2 else None, layout=self)
            buffers.planned._on_device[str(buffers.device)] = buffers.plan
        if copies:
            return buffers.planned
        if buffers.planned_without_copies is None:      # (the same buffers: one device plan, shared)
            buffers.planned_without_copies = dataclasses.replace(buffers.planned, copies=False,
                                                                 _on_device=buffers.planned._on_device)
        return buffers.planned_without_copies

    def device_plan(self, device: torch.device) -> "DevicePlan":
        """This layout's persistent plan tensors on ``device`` (made on first use), as the last step left them."""
        return self._buffers_on(device).plan

    def _buffers_on(self, device) -> "_StaticBuffers":
        key = str(torch.device(device))
        buffers = self._buffers.get(key)
        if buffers is None:
            buffers = self._buffers[key] = _StaticBuffers(self, torch.device(device))
        return buffers

    def release(self) -> None:
        """Drop the device buffers and the backends' metadata (the layout's call is over)."""
        self._buffers.clear()
        self.metadata.clear()


# a kept layout adopts a new call's values (DecodeLayout.adopt) while its tables are at most this many times as wide as
# the call's own: a prefix level's launch follows the tables' width (its chunks cover the capacity), so a layout much
# wider than a call needs would read that call's prefix in fewer, longer chunks
ADOPT_SPAN = 4

FIRST_ROOM = 64      # new tokens per row that a call's first decode layout makes room for


def decode_room(made: int, left: int | None = None) -> int:
    """New tokens per row that a decode layout makes room for, after ``made`` decode tokens of the call, when the
    call can add at most ``left`` more (its ``max_length``; None or <= 0: unknown, or already passed). As many as
    were made and at least FIRST_ROOM: each widening doubles the room, so a call of N tokens re-plans (and
    re-captures its graph) about log2(N / FIRST_ROOM) times, and a layout never holds more than about twice the
    tokens made (plus FIRST_ROOM) however large ``max_new_tokens`` is."""
    room = max(FIRST_ROOM, int(made))
    return min(room, int(left)) if left is not None and left > 0 else room


def _widths(prev_lengths, max_new_tokens, block_size, row_prefix_blocks, row_inner_blocks=None):
    """Suffix table widths (blocks) for rows holding ``prev_lengths`` tokens that get at most ``max_new_tokens``
    more: row r ends with at most ceil((prev + max_new) / bs) blocks, minus the blocks its shared levels cover.
    The inner width is 0 without a middle level."""
    total = -(-(prev_lengths.astype(np.int64) + max(int(max_new_tokens), 1)) // block_size)
    # a shared row's suffix needs at most the new tokens' blocks and one partly filled block of its prompt, whatever
    # the prompt's length and alignment: that many, bucketed; where a row's suffix holds its prompt (it shares none)
    # the width follows the prompt's length: bucketed with the floor of such shapes
    room = -(-max(int(max_new_tokens), 1) // block_size) + 1

    def width(shared_blocks) -> int:
        need = int((total - shared_blocks).max(initial=1))
        return shape_bucket(max(need, room), floor=MIN_BUCKET_BLOCKS if (shared_blocks == 0).any() else 1)

    suffix = width(row_prefix_blocks)
    inner = 0 if row_inner_blocks is None else width(row_inner_blocks)
    return suffix, inner


# the smallest bucket of a shape that follows the prompt's length, in blocks (tables, pools) and in tokens (the token
# choice's sequence buffers): prompts up to 16 blocks (256 tokens at block_size 16) share one shape; past it, powers
# of two
MIN_BUCKET_BLOCKS = 16
MIN_BUCKET_TOKENS = 256


def shape_bucket(n: int, floor: int = MIN_BUCKET_BLOCKS) -> int:
    """``n`` rounded up to the next power of two, at least ``floor`` (0 stays 0): what a static decode step's shapes
    that follow the prompt's length (block-table widths, the device pool's block count, the token choice's buffers)
    are rounded to, so that a range of prompt lengths (up to twice the shortest past the floor) shares one shape, and
    so one compiled graph and one captured graph: a compiled step bakes its shapes in. At most twice what is needed
    past the floor (a table wider than its rows' blocks holds -1 there, which no kernel reads)."""
    n = int(n)
    return 0 if n <= 0 else max(int(floor), 1 << (n - 1).bit_length())


def _padded_columns(table: np.ndarray) -> np.ndarray:
    """``table [G, M]`` (-1 padded) widened to ``shape_bucket(M)`` columns of -1."""
    return table if table.shape[0] == 0 else _padded_to(table, shape_bucket(table.shape[1]))


def _padded_to(table: np.ndarray, width: int) -> np.ndarray:
    """``table [G, M]`` (-1 padded) widened to ``width >= M`` columns of -1."""
    if width == table.shape[1]:
        return table
    return np.concatenate([table, np.full((table.shape[0], width - table.shape[1]), -1, dtype=table.dtype)], axis=1)


def _token_limit(prev_lengths, max_new_tokens) -> int:
    return int(np.asarray(prev_lengths).max(initial=0)) + max(int(max_new_tokens), 1)


class _StaticBuffers:
    """One device's persistent plan tensors of a DecodeLayout, and the pinned staging they are filled from.

    Per step: int32 ``[suffix_table | q_limit | inner_suffix_table | inner_q_limit]`` and int64
    ``[write_block | write_offset | copy_src | copy_dst]`` are written on the host into one of two pinned
    buffers (two, so that writing step t+1 never races the copy of step t still queued) and copied with
    one non-blocking copy each on the current stream."""

    def __init__(self, layout: DecodeLayout, device: torch.device):
        R, W, W2 = layout.num_rows, layout.suffix_width, layout.inner_width
        self.sizes32 = (R * W, R, R * W2, R if W2 else 0)
        self.shape32 = ((R, W), (R, 1), (R, W2), (R, 1 if W2 else 0))
        self.device = device
        n32, n64 = sum(self.sizes32), 4 * R
        self.dev32 = torch.zeros(n32, dtype=torch.int32, device=device)
        self.dev64 = torch.zeros(n64, dtype=torch.int64, device=device)
        cuda = device.type == "cuda"
        self.host = [(torch.zeros(n32, dtype=torch.int32, pin_memory=True),
                      torch.zeros(n64, dtype=torch.int64, pin_memory=True)) for _ in range(2)] if cuda else             [(self.dev32, self.dev64)]
        self.events = [torch.cuda.Event() for _ in self.host] if cuda else None
        self.turn = 0
        self.planned: StepPlan | None = None    # DecodeLayout.planned_step's plan over these buffers
        self.planned_without_copies: StepPlan | None = None     # the same with copies=False

        def t(a, dtype):
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

        views32, at = [], 0
        for size, shape in zip(self.sizes32, self.shape32):
            views32.append(self.dev32[at:at + size].view(shape))
            at += size
        d64 = self.dev64.view(4, R)
        self.plan = DevicePlan(
            src_index=None, write_block=d64[0], write_offset=d64[1], copy_src=d64[2], copy_dst=d64[3],
            group_rows=t(layout.group_rows, torch.int32), prefix_table=t(layout.prefix_table, torch.int32),
            prefix_len=t(layout.prefix_len, torch.int32), suffix_table=views32[0], q_limit=views32[1],
            mid_group_rows=t(layout.mid_group_rows, torch.int32), mid_table=t(layout.mid_table, torch.int32),
            mid_len=t(layout.mid_len, torch.int32),
            inner_suffix_table=views32[2] if W2 else None, inner_q_limit=views32[3] if W2 else None)

    def adopt_levels(self, layout: DecodeLayout) -> None:
        """Write ``layout``'s level arrays (same shapes) into the level tensors in place (a graph reads them by
        address); the planned step's host arrays are made again from the layout's."""
        refuse_in_capture("a decode layout's level tensors written from the host")
        self.plan.write_levels(layout, _LEVEL_TENSORS)
        self.planned = self.planned_without_copies = None

    def fill(self, plan: StepPlan) -> DevicePlan:
        i = self.turn
        self.turn = (self.turn + 1) % len(self.host)
        host32, host64 = self.host[i]
        if self.events is not None:
            self.events[i].synchronize()      # the copy that last read this staging buffer has run
        a32, a64 = host32.numpy(), host64.numpy()
        parts = (plan.suffix_table, plan.q_limit, plan.inner_suffix_table, plan.inner_q_limit)
        at = 0
        for size, part in zip(self.sizes32, parts):
            if size:
                a32[at:at + size] = part.reshape(-1)
            at += size
        a64.reshape(4, -1)[:] = (plan.write_block, plan.write_offset, plan.copy_src, plan.copy_dst)
        if self.events is not None:
            self.dev32.copy_(host32, non_blocking=True)
            self.dev64.copy_(host64, non_blocking=True)
            self.events[i].record()
        return self.plan
