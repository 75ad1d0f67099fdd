"""Block-pool bookkeeping for a paged KV cache.

Pure index logic in numpy: no torch, no model or kernel knowledge.  Every layer
owns a KV pool tensor shaped ``[num_blocks, 2, block_size, heads, head_dim]``;
block ids are shared by all layers and this module decides which block id and
slot each token of each row (sequence) goes to.

Rows may share blocks (a prompt stored once, forked to many beams).  A shared
block is never written: appending to a row whose last block is partially
filled and shared triggers copy-on-write (the caller copies the whole block to
a fresh id, then writes into the copy).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

__all__ = ["PoolExhausted", "AppendPlan", "BlockManager"]


class PoolExhausted(MemoryError):
    """The KV pool is full: more blocks are needed than its cap allows (``CascadeConfig.max_kv_bytes``).

    Raised by :meth:`BlockManager.append` when ``max_blocks`` would be exceeded (the manager's state is
    unchanged) and by a pool storage asked for more blocks than its cap. A ``MemoryError``, so
    ``except MemoryError`` catches it too; exported as ``hf_cascade.PoolExhausted``.
    """


@dataclass
class AppendPlan:
    """What the caller must do to the KV pools for one :meth:`BlockManager.append`.

    Contract: apply ALL copies first, as one simultaneous gather->scatter
    (``pool[copy_dst] = pool[copy_src]``), then write token ``i`` (row-major over
    rows, in order within a row) to ``pool[write_block[i], :, write_offset[i]]``.

    Guarantees: no id appears in both ``copy_src`` and ``copy_dst``; no write
    targets a block in ``copy_src`` unless the writing row is now its sole owner.
    """

    write_block: np.ndarray  # int64 [total_new_tokens]: block id of each new token
    write_offset: np.ndarray  # int64 [total_new_tokens]: slot inside that block
    copy_src: np.ndarray  # int64 [num_copies]: copy-on-write source block ids
    copy_dst: np.ndarray  # int64 [num_copies]: copy-on-write destination block ids


def _readonly(a: np.ndarray) -> np.ndarray:
    # Hand out views the caller cannot mutate: refcounts/lengths are invariants.
    v = a.view()
    v.flags.writeable = False
    return v


def _as_int_vector(x, name: str, length: int | None = None) -> np.ndarray:
    """Validate ``x`` as a 1-D integer vector and return it as int64."""
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {a.dtype}")
    if length is not None and a.shape[0] != length:
        raise ValueError(f"{name} must have one entry per row ({length}), got {a.shape[0]}")
    return a.astype(np.int64, copy=False)


class BlockManager:
    """Maps the tokens of ``num_rows`` rows onto shared, refcounted block ids.

    State: a padded int32 table ``[num_rows, width]`` (-1 = no block), int64
    ``lengths[num_rows]``, int32 ``refcount[capacity]`` and a min-heap of free
    ids below ``capacity`` (lowest id handed out first, so pools stay compact).
    """

    def __init__(self, block_size: int, max_blocks: int | None = None):
        if int(block_size) != block_size or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if max_blocks is not None and (int(max_blocks) != max_blocks or max_blocks < 0):
            raise ValueError(f"max_blocks must be None or a non-negative integer, got {max_blocks!r}")
        self.block_size = int(block_size)
        self.max_blocks = None if max_blocks is None else int(max_blocks)
        # the advice PoolExhausted gives; the owner of the cap words it in its own setting's name
        self.cap_hint = "raise max_blocks"
        self._tables = np.full((0, 4), -1, dtype=np.int32)
        self._lengths = np.zeros(0, dtype=np.int64)
        # Over-allocated buffer so growing capacity one block at a time is amortised O(1).
        self._rc = np.zeros(16, dtype=np.int32)
        self._capacity = 0
        self._free: list[int] = []  # min-heap of ids < capacity with refcount 0

    # ------------------------------------------------------------------ views
    @property
    def num_rows(self) -> int:
        return int(self._lengths.shape[0])

    @property
    def lengths(self) -> np.ndarray:
        """int64 [num_rows]: tokens stored per row (read-only view)."""
        return _readonly(self._lengths)

    @property
    def refcount(self) -> np.ndarray:
        """int32 [capacity]: number of row tables holding each block id (read-only view)."""
        return _readonly(self._rc[: self._capacity])

    @property
    def capacity(self) -> int:
        """1 + largest block id ever handed out; KV pools must hold >= this many blocks."""
        return self._capacity

    @property
    def id_bound(self) -> int:
        """1 + the largest block id a table holds now (0 when none): a pool of this many blocks holds every block in
        use (``capacity`` counts every id ever handed out, and a longer call before may have raised it)."""
        used = np.flatnonzero(self._rc[: self._capacity])
        return int(used[-1]) + 1 if used.size else 0

    @property
    def blocks_in_use(self) -> int:
        return int(np.count_nonzero(self._rc[: self._capacity] > 0))

    @property
    def blocks_shared(self) -> int:
        return int(np.count_nonzero(self._rc[: self._capacity] > 1))

    def _nblocks(self, lengths: np.ndarray) -> np.ndarray:
        return (lengths + self.block_size - 1) // self.block_size

    def _width_used(self) -> int:
        return int(self._nblocks(self._lengths).max()) if self.num_rows else 0

    def tokens_stored(self) -> int:
        """Distinct tokens physically stored.

        Sum over distinct in-use blocks of the largest fill any holder has in it
        (rows sharing a block after a truncate may fill it to different depths).
        """
        w = self._width_used()
        if w == 0:
            return 0
        tab = self._tables[:, :w]
        fill = np.clip(self._lengths[:, None] - np.arange(w, dtype=np.int64) * self.block_size, 0, self.block_size)
        valid = tab >= 0
        best = np.zeros(self._capacity, dtype=np.int64)
        np.maximum.at(best, tab[valid], fill[valid])
        return int(best.sum())

    def table(self, row: int) -> np.ndarray:
        """int32 [ceil(lengths[row] / block_size)]: block ids of ``row``."""
        if not (-self.num_rows <= row < self.num_rows):
            raise ValueError(f"row {row} out of range for {self.num_rows} rows")
        n = int(self._nblocks(self._lengths[row]))
        return self._tables[row, :n].copy()

    def tables(self, min_width: int = 0) -> np.ndarray:
        """int32 [num_rows, max(min_width, widest row)]: block tables padded with -1."""
        if min_width < 0:
            raise ValueError(f"min_width must be >= 0, got {min_width}")
        w = max(int(min_width), self._width_used())
        out = np.full((self.num_rows, w), -1, dtype=np.int32)
        k = min(w, self._tables.shape[1])
        out[:, :k] = self._tables[:, :k]
        return out

    # -------------------------------------------------------------- internals
    def _grow_width(self, need: int) -> None:
        w = self._tables.shape[1]
        if need <= w:
            return
        new_w = max(need, 2 * w)  # geometric, so per-step appends stay amortised O(1)
        pad = np.full((self._tables.shape[0], new_w - w), -1, dtype=np.int32)
        self._tables = np.concatenate([self._tables, pad], axis=1)

    def _alloc(self) -> int:
        """Lowest free id; a new id (capacity grows) only when none below is free."""
        if self._free:
            b = heapq.heappop(self._free)
        else:
            b = self._capacity
            self._capacity += 1
            if self._capacity > self._rc.shape[0]:
                grown = np.zeros(2 * self._rc.shape[0], dtype=np.int32)
                grown[: self._rc.shape[0]] = self._rc
                self._rc = grown
        self._rc[b] = 1
        return b

    def _push_free(self, ids: np.ndarray) -> None:
        if ids.size <= 8:
            for b in ids.tolist():
                heapq.heappush(self._free, b)
        else:
            self._free.extend(ids.tolist())
            heapq.heapify(self._free)

    def _valid_ids(self, tab: np.ndarray) -> np.ndarray:
        return tab[tab >= 0]

    def _counts_of(self, tab: np.ndarray) -> np.ndarray:
        """int32 [capacity]: how many times each id appears in ``tab``."""
        return np.bincount(self._valid_ids(tab), minlength=self._capacity).astype(np.int32)

    # -------------------------------------------------------------- mutations
    def add_rows(self, n: int) -> None:
        """Append ``n`` empty rows."""
        if int(n) != n or n < 0:
            raise ValueError(f"add_rows needs a non-negative integer, got {n!r}")
        n = int(n)
        self._tables = np.concatenate(
            [self._tables, np.full((n, self._tables.shape[1]), -1, dtype=np.int32)], axis=0
        )
        self._lengths = np.concatenate([self._lengths, np.zeros(n, dtype=np.int64)])

    def _blocks_needed(self, rows: np.ndarray, counts: np.ndarray) -> int:
        """New ids the append of ``counts`` would take, simulating copy-on-write order."""
        bs = self.block_size
        L = self._lengths[rows]
        need = int((self._nblocks(L + counts[rows]) - self._nblocks(L)).sum())
        sim: dict[int, int] = {}  # refcounts of last blocks as earlier rows' CoW decref them
        for r in rows[(L % bs) != 0].tolist():
            last = int(self._tables[r, (int(self._lengths[r]) - 1) // bs])
            rc = sim.get(last, int(self._rc[last]))
            if rc > 1:
                need += 1
                sim[last] = rc - 1
        return need

    def append(self, counts) -> AppendPlan:
        """Reserve slots for ``counts[r]`` new tokens on each row r.

        counts: int [num_rows], >= 0.  Returns the :class:`AppendPlan` the caller
        must apply to every layer's pool.  Raises :class:`PoolExhausted` (state
        unchanged) if more than ``max_blocks`` ids would be in use.
        """
        counts = _as_int_vector(counts, "counts", self.num_rows)
        if (counts < 0).any():
            raise ValueError(f"counts must be >= 0, got {counts.tolist()}")
        bs = self.block_size
        rows = np.flatnonzero(counts)

        # Check before mutating anything so a failure leaves the manager intact.
        if self.max_blocks is not None and rows.size:
            need = self._blocks_needed(rows, counts)
            # The heap holds exactly the unused ids below capacity, so this is
            # max_blocks - blocks_in_use without an O(capacity) count.
            in_use = self._capacity - len(self._free)
            free = max(0, self.max_blocks - in_use)
            if need > free:
                raise PoolExhausted(
                    f"KV block pool exhausted: append needs {need} new blocks but only {free} "
                    f"are free (max_blocks={self.max_blocks}, {in_use} in use, "
                    f"block_size={bs}). Lower the number of beams, the prompt length or the "
                    f"number of new tokens, or {self.cap_hint}."
                )

        new_len = self._lengths + counts
        if rows.size:
            self._grow_width(int(self._nblocks(new_len[rows]).max()))
        wb: list[np.ndarray] = []
        wo: list[np.ndarray] = []
        src: list[int] = []
        dst: list[int] = []
        for r in rows.tolist():
            L = int(self._lengths[r])
            c = int(counts[r])
            nb0 = (L + bs - 1) // bs
            nb1 = (L + c + bs - 1) // bs
            if L % bs:
                last = int(self._tables[r, nb0 - 1])
                if self._rc[last] > 1:
                    # Partial and shared: other holders still need its contents
                    # untouched, so this row continues in a private copy.  The old
                    # block keeps >= 1 holder, so nothing is freed here; ids freed
                    # during an append would anyway only be reused after it ends.
                    new = self._alloc()
                    src.append(last)
                    dst.append(new)
                    self._rc[last] -= 1
                    self._tables[r, nb0 - 1] = new
            for col in range(nb0, nb1):  # loop over new blocks, not tokens
                self._tables[r, col] = self._alloc()
            t = np.arange(L, L + c, dtype=np.int64)
            wb.append(self._tables[r, t // bs].astype(np.int64))
            wo.append(t % bs)
        self._lengths = new_len

        def cat(parts: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

        return AppendPlan(
            write_block=cat(wb),
            write_offset=cat(wo),
            copy_src=np.asarray(src, dtype=np.int64),
            copy_dst=np.asarray(dst, dtype=np.int64),
        )

    def fork(self, n: int) -> None:
        """Row r becomes rows r*n .. r*n+n-1 (torch.repeat_interleave order); no data copied."""
        if int(n) != n or n < 1:
            raise ValueError(f"fork needs an integer n >= 1, got {n!r}")
        n = int(n)
        if n == 1:
            return
        w = self._width_used()
        # Each existing reference gains n-1 siblings.
        self._rc[: self._capacity] += (n - 1) * self._counts_of(self._tables[:, :w])
        self._tables = np.repeat(self._tables, n, axis=0)
        self._lengths = np.repeat(self._lengths, n)

    def select(self, index) -> None:
        """New row i = old row ``index[i]`` (beam reorder / batch select; repeats and drops allowed)."""
        index = _as_int_vector(index, "index")
        if index.size and (index.min() < 0 or index.max() >= self.num_rows):
            raise ValueError(f"select index out of range [0, {self.num_rows}): {index.tolist()}")
        w = self._width_used()
        old = self._tables[:, :w]
        new = old[index]
        before = self._rc[: self._capacity].copy()
        # Incref new before decref old, so blocks kept by any new row never hit 0.
        rc = before + self._counts_of(new) - self._counts_of(old)
        self._rc[: self._capacity] = rc
        self._push_free(np.flatnonzero((before > 0) & (rc == 0)))
        self._tables = self._tables[index]
        self._lengths = self._lengths[index]

    def restore(self, tables: np.ndarray, lengths: np.ndarray, refcount: np.ndarray) -> None:
        """Take the state that a device copy of this manager reached (:mod:`hf_cascade.device_blocks`): tables
        ``[num_rows, W]`` (-1 padded), lengths ``[num_rows]`` and the reference count of every id below
        ``refcount.size``. Ids whose count is 0 become free; capacity covers every id handed out."""
        tables = np.asarray(tables, dtype=np.int32)
        lengths = _as_int_vector(lengths, "lengths", tables.shape[0])
        refcount = np.asarray(refcount, dtype=np.int32)
        used = tables[tables >= 0]
        if used.size and used.max() >= refcount.size:
            raise ValueError(f"a table holds block {int(used.max())}, the reference counts cover {refcount.size}")
        if (np.bincount(used, minlength=refcount.size) != refcount).any():
            raise ValueError("the reference counts do not match the tables")
        capacity = max(self._capacity, int(used.max()) + 1 if used.size else 0)
        rc = np.zeros(max(16, 2 * capacity), dtype=np.int32)
        rc[: min(capacity, refcount.size)] = refcount[:capacity]
        self._rc, self._capacity = rc, capacity
        self._free = np.flatnonzero(rc[:capacity] == 0).tolist()     # sorted: a valid min-heap
        self._tables = np.ascontiguousarray(tables)
        self._lengths = lengths.copy()

    def truncate(self, counts) -> None:
        """Remove ``counts[r]`` tokens from the end of row r; emptied blocks are released."""
        counts = _as_int_vector(counts, "counts", self.num_rows)
        if (counts < 0).any():
            raise ValueError(f"counts must be >= 0, got {counts.tolist()}")
        if (counts > self._lengths).any():
            bad = np.flatnonzero(counts > self._lengths)
            raise ValueError(
                f"cannot truncate more tokens than a row holds: rows {bad.tolist()} hold "
                f"{self._lengths[bad].tolist()}, asked to remove {counts[bad].tolist()}"
            )
        w = self._width_used()
        new_len = self._lengths - counts
        col = np.arange(w)
        drop = (col >= self._nblocks(new_len)[:, None]) & (col < self._nblocks(self._lengths)[:, None])
        ids = self._tables[:, :w][drop]
        if ids.size:
            before = self._rc[: self._capacity].copy()
            rc = before - np.bincount(ids, minlength=self._capacity).astype(np.int32)
            self._rc[: self._capacity] = rc
            self._push_free(np.flatnonzero((before > 0) & (rc == 0)))
            self._tables[:, :w][drop] = -1
        self._lengths = new_len

    def release(self) -> None:
        """Drop all rows; every block id below capacity becomes free; num_rows 0."""
        self._rc[: self._capacity] = 0
        self._free = list(range(self._capacity))  # sorted list is a valid min-heap
        self._tables = np.full((0, 4), -1, dtype=np.int32)
        self._lengths = np.zeros(0, dtype=np.int64)
