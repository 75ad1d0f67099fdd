"""A static decode layout's per-step block bookkeeping as tensor code on the device.

The host path of a decode step is :meth:`blocks.BlockManager.select` (beam reorder),
:meth:`blocks.BlockManager.append` (one token per row: a new block when the last is full, copy-on-write when it
is partly filled and shared) and :meth:`plan.DecodeLayout.step` (suffix tables, ``q_limit``, write slots, copy
pairs padded to R). This module computes the same tensors, value for value, from the step's ``parents`` with
static shapes and no host read (no ``.item``, ``.tolist``, ``bool()`` on a tensor, no data-dependent shape), so
the step can run inside a captured CUDA graph. It is built once from the host state at the first decode step
(:meth:`DeviceBlocks.from_host`) and owns nothing else: no model, kernel or cache knowledge.

Free pool: the block ids ``[0, pool_blocks)`` whose reference count is 0. A step takes the lowest free ids, in
row order, exactly as the host's min-heap does (so K/V land in the same blocks as on the host path); one
cumulative sum over the pool and one ``searchsorted`` find them (O(pool) per step, not measured on a GPU). A stack of
free ids would allocate in another order and make the two paths write different blocks.

Overflow contract. A step never raises; it sets one bit of ``flags`` (a sticky int32 scalar on the device):

- ``POOL_EXHAUSTED``: the append needs more blocks than are free (the host's ``PoolExhausted``);
- ``LEFT_LEVELS``: a grouped row no longer begins with its frozen prefix blocks (``LayoutOutgrown``,
  ``capacity=False``: a parent taken from another prompt);
- ``OUTGROWN``: a row past ``token_limit`` or a suffix wider than the layout (``LayoutOutgrown(capacity=True)``).

Precedence is the host's: the pool first, then the levels, then the capacity. More copy-on-write pairs than R
cannot happen (at most one per row when each row appends one token), so it has no flag. The step that sets a
flag and every step after it leave the state as it was after that step's :func:`reorder` (tables, lengths,
reference counts, ``steps``): their write slots and copy pairs all name ``scratch_block`` (= ``pool_blocks``;
the K/V storage must hold one block more), so the forward of a failed step writes nothing live. The host reads
:func:`read_flags` once every N steps (its only host read); when it is not 0, ``steps`` appends were applied,
the tokens of later steps are discarded, and the host re-plans from :func:`host_state` (a widened layout, a new
freeze) or raises ``PoolExhausted``. The host can make the capacity flag impossible between two checks (every row
grows by one token a step, so it knows when ``token_limit`` comes) and the pool flag too (a step takes at most R
blocks: N steps need at most N x R free), leaving only a parent from another prompt to discover late.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..kv.plan import shape_bucket

__all__ = ["POOL_EXHAUSTED", "LEFT_LEVELS", "OUTGROWN", "DeviceBlocks", "DeviceStep", "reorder", "append",
           "read_flags", "host_state"]

POOL_EXHAUSTED = 1
LEFT_LEVELS = 2
OUTGROWN = 4


@dataclass
class DeviceStep:
    """One decode step's plan tensors, shaped as :meth:`plan.DecodeLayout.step` makes them (R rows)."""

    suffix_table: torch.Tensor                 # int32 [R, suffix_width]
    q_limit: torch.Tensor                      # int32 [R, 1]
    inner_suffix_table: torch.Tensor | None    # int32 [R, inner_width] with a middle level
    inner_q_limit: torch.Tensor | None         # int32 [R, 1] with a middle level
    write_block: torch.Tensor                  # int64 [R]
    write_offset: torch.Tensor                 # int64 [R]
    copy_src: torch.Tensor                     # int64 [R], padded as the host pads
    copy_dst: torch.Tensor                     # int64 [R]


@dataclass
class DeviceBlocks:
    """The device state of a static decode layout's blocks; mutated in place by :func:`reorder` / :func:`append`
    (its tensors keep their addresses, as a captured graph needs)."""

    block_size: int
    pool_blocks: int             # block ids [0, pool_blocks) make the pool; pool_blocks is the scratch block
    suffix_width: int
    inner_width: int             # 0 without a middle level
    token_limit: torch.Tensor    # int64 []: the layout's token limit (a value: it follows the prompt's length)
    tables: torch.Tensor         # int32 [R, W]: each row's whole block table, -1 padded (W: the layout's table_width)
    lengths: torch.Tensor        # int64 [R]
    refcount: torch.Tensor       # int32 [pool_blocks + 1]: table entries per id; the last slot absorbs -1 entries
    row_prefix_blocks: torch.Tensor   # int64 [R]
    row_inner_blocks: torch.Tensor    # int64 [R]
    check_rows: torch.Tensor     # int64 [K]: (row, column, id) of every frozen prefix block a grouped row holds
    check_cols: torch.Tensor     # int64 [K]
    check_ids: torch.Tensor      # int32 [K]
    check_used: torch.Tensor     # bool [K]: the checks that count (K is bucketed: the rest is padding)
    flags: torch.Tensor          # int32 []: sticky overflow bits (module docstring)
    steps: torch.Tensor          # int64 []: appends applied

    @property
    def num_rows(self) -> int:
        return self.tables.shape[0]

    @property
    def scratch_block(self) -> int:
        return self.pool_blocks

    @classmethod
    def from_host(cls, manager, layout, pool_blocks: int | None = None, device=None,
                  like: "DeviceBlocks | None" = None) -> "DeviceBlocks":
        """The state of ``manager`` (a BlockManager at the first decode step of ``layout``) on ``device``.
        ``pool_blocks``: the pool's fixed size (default the manager's ``max_blocks``). ``like``: a kept state of the
        same layout whose shapes are at least this one's (a captured step's): its table width and count of prefix
        checks where they are wider (padding, which no step reads), so that the state fits the kept step."""
        pool_blocks = manager.max_blocks if pool_blocks is None else int(pool_blocks)
        if pool_blocks is None:
            raise ValueError("a device pool needs a fixed size: pass pool_blocks or give the manager max_blocks")
        if manager.id_bound > pool_blocks:
            raise ValueError(f"the manager holds block ids up to {manager.id_bound - 1}; the pool holds {pool_blocks} blocks")
        if manager.num_rows != layout.num_rows:
            raise ValueError(f"the manager holds {manager.num_rows} rows, the layout {layout.num_rows}")
        bs = layout.block_size
        # every shape bucketed (plan.shape_bucket), every value that follows the prompt's length a tensor: one
        # compiled (and captured) step serves a range of prompt lengths
        width = max(layout.table_width, shape_bucket(manager.tables().shape[1]))
        rows, cols, ids = _prefix_checks(layout)
        # as many as the level tables' widths allow (their shapes, not the prompt's length: see DecodeLayout.adopt)
        checks = shape_bucket(max(rows.size, _check_capacity(layout)))
        if like is not None:
            width, checks = max(width, like.tables.shape[1]), max(checks, like.check_rows.shape[0])
        tables = manager.tables(width)
        refcount = np.zeros(pool_blocks + 1, dtype=np.int32)
        held = min(manager.capacity, pool_blocks)     # (ids from id_bound on are free: a pool may stop before them)
        refcount[:held] = manager.refcount[:held]
        used = np.arange(checks) < rows.size
        rows, cols, ids = (np.concatenate([a, np.zeros(checks - a.size, dtype=a.dtype)]) for a in (rows, cols, ids))

        def t(a, dtype):
            return torch.as_tensor(np.array(a)).to(device=device, dtype=dtype)

        return cls(bs, pool_blocks, layout.suffix_width, layout.inner_width, t(layout.token_limit, torch.int64),
                   t(tables, torch.int32), t(manager.lengths, torch.int64), t(refcount, torch.int32),
                   t(layout.row_prefix_blocks, torch.int64), t(layout.row_inner_blocks, torch.int64),
                   t(rows, torch.int64), t(cols, torch.int64), t(ids, torch.int32), t(used, torch.bool),
                   torch.zeros((), dtype=torch.int32, device=device), torch.zeros((), dtype=torch.int64, device=device))


def _check_capacity(layout) -> int:
    """The most prefix checks a layout of these rows, levels and table widths can have."""
    members = ((layout.group_rows >= 0).sum(), (layout.mid_group_rows >= 0).sum())
    return int(members[0]) * layout.prefix_table.shape[1] + int(members[1]) * layout.mid_table.shape[1]


def _prefix_checks(layout):
    """(row, column, id) of each frozen prefix block (group and middle level) a grouped row must hold: what
    ``DecodeLayout._check_prefixes`` compares, flattened once so a step checks it with one gather."""
    rows, cols, ids = [], [], []
    levels = ((layout.group_rows, layout.prefix_table, layout.prefix_len, None),
              (layout.mid_group_rows, layout.mid_table, layout.mid_len, layout.row_prefix_blocks))
    for group_rows, table, lens, start in levels:     # two levels, once per call
        if group_rows.size == 0 or table.shape[1] == 0:
            continue
        used_blocks = lens // layout.block_size                                     # [G]
        member = group_rows >= 0                                                    # [G, Rg]
        col = np.arange(table.shape[1])
        used = member[..., None] & (col < used_blocks[:, None])[:, None]           # [G, Rg, M]
        r = np.broadcast_to(group_rows[..., None], used.shape)
        base = 0 if start is None else start[group_rows.clip(0)][..., None]
        c = np.broadcast_to(base + col, used.shape)
        i = np.broadcast_to(table[:, None, :], used.shape)
        rows.append(r[used]), cols.append(c[used]), ids.append(i[used])
    cat = (lambda parts: np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
    return cat(rows), cat(cols), cat(ids)


def _counts(state: DeviceBlocks, tables: torch.Tensor) -> torch.Tensor:
    """int32 [pool_blocks + 1]: table entries per id (-1 entries land in the last slot)."""
    ids = tables.reshape(-1).long()
    ids = torch.where(ids >= 0, ids, state.pool_blocks)
    out = torch.zeros_like(state.refcount).scatter_add_(0, ids, torch.ones_like(ids, dtype=state.refcount.dtype))
    # the -1 entries' count means nothing; keep the slot at 0 (fill_ on a view: `out[i] = 0` copies a host scalar,
    # which a CUDA graph capture refuses)
    out.narrow(0, state.pool_blocks, 1).zero_()
    return out


def reorder(state: DeviceBlocks, parents: torch.Tensor) -> None:
    """Beam reorder: row i takes row ``parents[i]``'s table and length; reference counts follow, and ids no
    longer referenced become free (their count is 0). ``parents``: int64 [R] in range (not checked: the check
    would read the device). Sampling's identity step needs no call. A no-op once a flag is set."""
    new_tables = state.tables[parents]
    refcount = state.refcount + _counts(state, new_tables) - _counts(state, state.tables)
    live = state.flags == 0
    state.refcount.copy_(torch.where(live, refcount, state.refcount))
    state.tables.copy_(torch.where(live, new_tables, state.tables))
    state.lengths.copy_(torch.where(live, state.lengths[parents], state.lengths))


def append(state: DeviceBlocks, active: torch.Tensor | None = None) -> DeviceStep:
    """One token per row: the step's plan, and the state advanced past it (module docstring for overflow).
    ``active``: a bool scalar tensor; where False (the call has finished), the step changes nothing and sets no
    flag: its writes and copies name the scratch block, as a failed step's do."""
    bs, pool = state.block_size, state.pool_blocks
    tables, lengths, refcount = state.tables, state.lengths, state.refcount
    R, W = tables.shape
    rows = torch.arange(R, device=tables.device)

    # copy-on-write, in the host's row order: of the rows whose partly filled last block is the same id, the
    # j-th copies while the block still has another holder (refcount - j > 1)
    partial = (lengths % bs) != 0
    last_col = ((lengths - 1).clamp(min=0) // bs).clamp(max=W - 1)
    last = tables.gather(1, last_col[:, None]).squeeze(1).long()
    last = torch.where(last >= 0, last, pool)
    same = (last[:, None] == last[None, :]) & partial[:, None] & partial[None, :] & (rows[None, :] < rows[:, None])
    cow = partial & (refcount[last] - same.sum(1) > 1)
    need = cow | ~partial                         # at most one new id per row: a copy or a fresh block

    # the k-th request (row order) takes the k-th lowest free id
    free_upto = torch.cumsum(refcount[:pool] == 0, 0)                               # [pool]
    rank = torch.cumsum(need, 0) - 1
    ids = torch.searchsorted(free_upto, rank + 1)
    total_free = free_upto[-1] if pool else torch.zeros((), dtype=torch.int64, device=tables.device)
    pool_short = need.sum() > total_free
    ids = ids.clamp(max=max(pool - 1, 0))

    col = (lengths // bs).clamp(max=W - 1)        # the block token L goes to: the copy's column, or the new block's
    kept = tables.gather(1, col[:, None]).squeeze(1)
    new_tables = tables.scatter(1, col[:, None], torch.where(need, ids, kept.long()).to(tables.dtype)[:, None])
    new_refcount = refcount.scatter_add(0, torch.where(cow, last, pool), -cow.to(refcount.dtype))
    new_refcount = new_refcount.scatter(0, torch.where(need, ids, pool), torch.ones_like(ids, dtype=refcount.dtype))
    new_lengths = lengths + 1
    offset = lengths % bs                         # taken before the commit below overwrites lengths in place

    # overflow, with the host's precedence: the pool, then the levels, then the capacity
    left = ((new_tables[state.check_rows, state.check_cols] != state.check_ids) & state.check_used).any()
    outgrown = (new_lengths.max() > state.token_limit) | \
        (_suffix_blocks(new_lengths, state.row_prefix_blocks, bs).max() > state.suffix_width)
    if state.inner_width:
        outgrown = outgrown | (_suffix_blocks(new_lengths, state.row_inner_blocks, bs).max() > state.inner_width)
    flag = torch.where(pool_short, POOL_EXHAUSTED,
                       torch.where(left, LEFT_LEVELS, torch.where(outgrown, OUTGROWN, 0))).to(torch.int32)
    if active is not None:
        flag = torch.where(active, flag, 0).to(torch.int32)
    ok = (state.flags == 0) & (flag == 0)
    if active is not None:
        ok = ok & active
    state.flags.copy_(torch.where(state.flags == 0, flag, state.flags))
    state.steps.add_(ok.long())
    state.tables.copy_(torch.where(ok, new_tables, tables))
    state.refcount.copy_(torch.where(ok, new_refcount, refcount))
    state.refcount.narrow(0, pool, 1).zero_()
    state.lengths.copy_(torch.where(ok, new_lengths, lengths))

    # write slots and copy pairs; the host pads the pairs to R with its first pair (or, with none, the first
    # write block copied onto itself)
    scratch = torch.full_like(new_lengths, pool)
    write_block = torch.where(ok, new_tables.gather(1, col[:, None]).squeeze(1).long(), scratch)
    write_offset = torch.where(ok, offset, 0)
    first = torch.argmax(cow.to(torch.int32)).view(1)     # the first copying row (a gather: no index read)
    any_cow = cow.any()
    fill_src = torch.where(any_cow, last.gather(0, first), write_block[:1])[0]
    fill_dst = torch.where(any_cow, ids.gather(0, first), fill_src)
    slot = torch.where(cow, torch.cumsum(cow, 0) - 1, R)
    copy_src = fill_src.expand(R + 1).clone().scatter_(0, slot, last)[:R]
    copy_dst = fill_dst.expand(R + 1).clone().scatter_(0, slot, ids)[:R]
    copy_src, copy_dst = torch.where(ok, copy_src, scratch), torch.where(ok, copy_dst, scratch)

    suffix_table, q_limit = _suffix(state, state.row_prefix_blocks, state.suffix_width)
    inner_table = inner_limit = None
    if state.inner_width:
        inner_table, inner_limit = _suffix(state, state.row_inner_blocks, state.inner_width)
    return DeviceStep(suffix_table, q_limit, inner_table, inner_limit, write_block, write_offset, copy_src, copy_dst)


def _suffix_blocks(lengths, prefix_blocks, bs):
    return (lengths + bs - 1) // bs - prefix_blocks


def _suffix(state: DeviceBlocks, prefix_blocks: torch.Tensor, width: int):
    """Each row's blocks after its first ``prefix_blocks`` (``plan._suffix`` for one new token per row)."""
    bs, W = state.block_size, state.tables.shape[1]
    col = torch.arange(width, device=state.tables.device)
    cols = (prefix_blocks[:, None] + col[None, :]).clamp(max=W - 1)
    held = col[None, :] < _suffix_blocks(state.lengths, prefix_blocks, bs)[:, None]
    table = torch.where(held, state.tables.gather(1, cols), -1).to(torch.int32)
    q_limit = (state.lengths - prefix_blocks * bs)[:, None].to(torch.int32)
    return table, q_limit


def host_state(state: DeviceBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tables [R, W] int32, lengths [R] int64, refcount [pool_blocks] int32)`` on the host: what a re-plan
    after a flag starts from (a read: only after :func:`read_flags` said so, never inside a step)."""
    return (state.tables.cpu().numpy().copy(), state.lengths.cpu().numpy().copy(),
            state.refcount[: state.pool_blocks].cpu().numpy().copy())


def read_flags(state: DeviceBlocks) -> int:
    """The host's check, once every N steps (the one host read of this module): 0, or the overflow bits."""
    return int(state.flags)
