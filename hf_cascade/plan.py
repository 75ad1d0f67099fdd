"""From block tables to one step's cascade plan, built once per forward and reused by every layer.

Level 0 groups rows whose tables begin with the same full blocks (the beams or samples of one
prompt): their queries read that shared prefix once. Level 1 is each row's own rest of the table,
block-aligned after its group's prefix. Writes (where this step's new tokens go, and the
copy-on-write copies that must happen first) ride along so each layer's update is a few index ops.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


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
    _on_device: dict = field(default_factory=dict, repr=False)
    scratch: dict = field(default_factory=dict, repr=False)   # per-step state of kernel backends (their own plans)

    @property
    def num_groups(self) -> int:
        return self.group_rows.shape[0]

    def on(self, device: torch.device) -> "DevicePlan":
        """The plan's tensors on ``device``, uploaded once per step and device (layers may sit on several)."""
        device = torch.device(device)
        key = str(device)
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

    groups, prefix_blocks = ([], []) if fresh else find_prefix_groups(tables, prev, block_size, min_group_rows)
    if min_prefix_tokens:      # too short to pay: those rows read their whole tables as suffixes
        kept = [(g, nb) for g, nb in zip(groups, prefix_blocks) if nb * block_size >= min_prefix_tokens]
        groups, prefix_blocks = [g for g, _ in kept], [nb for _, nb in kept]
    if min_saved_tokens and sum((len(g) - 1) * nb * block_size for g, nb in zip(groups, prefix_blocks)) \
            < min_saved_tokens:
        groups, prefix_blocks = [], []
    num_groups = len(groups)
    rows_per_group = max((len(g) for g in groups), default=0)
    group_rows = np.full((num_groups, rows_per_group), -1, dtype=np.int32)
    prefix_table = np.full((num_groups, max(prefix_blocks, default=0)), -1, dtype=np.int32)
    prefix_len = np.zeros(num_groups, dtype=np.int32)
    row_prefix_blocks = np.zeros(num_rows, dtype=np.int64)
    for g, (rows, nb) in enumerate(zip(groups, prefix_blocks)):
        group_rows[g, : len(rows)] = rows
        prefix_table[g, :nb] = tables[rows[0], :nb]
        prefix_len[g] = nb * block_size
        row_prefix_blocks[rows] = nb

    # Middle level: subgroups of a group that share more blocks (each prompt's rest after a shared
    # system prompt), found the same way on the tables past the group prefix.
    mid_groups, mid_spans = [], []
    for rows, nb in zip(groups, prefix_blocks):
        subgroups, extra = find_prefix_groups(tables[rows, nb:], prev[rows] - nb * block_size, block_size,
                                              min_group_rows)
        for sub, more in zip(subgroups, extra):
            if len(sub) < len(rows):
                mid_groups.append(rows[sub])
                mid_spans.append((nb, more))
    mid_group_rows = np.full((len(mid_groups), max((len(g) for g in mid_groups), default=0)), -1, dtype=np.int32)
    mid_table = np.full((len(mid_groups), max((m for _, m in mid_spans), default=0)), -1, dtype=np.int32)
    mid_len = np.zeros(len(mid_groups), dtype=np.int32)
    inner_prefix_blocks = row_prefix_blocks.copy()
    for g, (rows, (nb, more)) in enumerate(zip(mid_groups, mid_spans)):
        mid_group_rows[g, : len(rows)] = rows
        mid_table[g, :more] = tables[rows[0], nb:nb + more]
        mid_len[g] = more * block_size
        inner_prefix_blocks[rows] = nb + more

    # Last level: each row's table shifted past its deepest shared prefix.
    suffix_table, q_limit = _suffix(tables, lengths, prev, seen_new, row_prefix_blocks, block_size)
    inner_suffix_table, inner_q_limit = (_suffix(tables, lengths, prev, seen_new, inner_prefix_blocks, block_size)
                                         if mid_groups else (None, None))

    return StepPlan(
        fresh=fresh, q_len=q_len, src_index=src_index,
        write_block=append_plan.write_block.astype(np.int64), write_offset=append_plan.write_offset.astype(np.int64),
        copy_src=append_plan.copy_src.astype(np.int64), copy_dst=append_plan.copy_dst.astype(np.int64),
        group_rows=group_rows, prefix_table=prefix_table, prefix_len=prefix_len,
        suffix_table=suffix_table, q_limit=q_limit,
        mid_group_rows=mid_group_rows, mid_table=mid_table, mid_len=mid_len,
        inner_suffix_table=inner_suffix_table, inner_q_limit=inner_q_limit)


def _suffix(tables, lengths, prev, seen_new, prefix_blocks, block_size):
    """Each row's blocks after its first ``prefix_blocks[r]`` blocks, and what each query sees of them."""
    num_rows = tables.shape[0]
    suffix_blocks = -(-lengths // block_size) - prefix_blocks
    width = int(suffix_blocks.max(initial=0))
    padded = np.concatenate([tables, np.full((num_rows, width + 1), -1, dtype=np.int32)], axis=1)
    cols = prefix_blocks[:, None] + np.arange(width)[None, :]
    suffix_table = np.where(np.arange(width)[None, :] < suffix_blocks[:, None],
                            np.take_along_axis(padded, cols, axis=1), -1).astype(np.int32)
    q_limit = ((prev - prefix_blocks * block_size)[:, None] + seen_new).astype(np.int32)
    return suffix_table, q_limit
