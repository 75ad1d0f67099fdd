"""Tests for hf_cascade.blocks: paged-KV block bookkeeping."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hf_cascade.blocks import AppendPlan, BlockManager, PoolExhausted


# --------------------------------------------------------------------- helpers
def apply_plan(pool: np.ndarray, plan: AppendPlan, values: np.ndarray) -> np.ndarray:
    """Apply a plan to a [capacity, block_size] pool exactly as the contract says."""
    pool[plan.copy_dst] = pool[plan.copy_src]  # one simultaneous gather -> scatter
    pool[plan.write_block, plan.write_offset] = values
    return pool


def grow(pool: np.ndarray, capacity: int) -> np.ndarray:
    if pool.shape[0] >= capacity:
        return pool
    extra = np.full((capacity - pool.shape[0], pool.shape[1]), -1, dtype=pool.dtype)
    return np.concatenate([pool, extra])


def ref_refcount(m: BlockManager) -> np.ndarray:
    rc = np.zeros(m.capacity, dtype=np.int64)
    for r in range(m.num_rows):
        for b in m.table(r):
            rc[b] += 1
    return rc


# ------------------------------------------------------------------ unit tests
def test_append_basic_layout_and_lowest_id_first():
    m = BlockManager(4)
    m.add_rows(2)
    plan = m.append([6, 3])
    assert plan.write_block.tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2]
    assert plan.write_offset.tolist() == [0, 1, 2, 3, 0, 1, 0, 1, 2]
    assert plan.copy_src.size == 0 and plan.copy_dst.size == 0
    assert plan.write_block.dtype == np.int64 and plan.write_offset.dtype == np.int64
    assert m.lengths.tolist() == [6, 3]
    assert m.capacity == 3 and m.blocks_in_use == 3
    # Free block 0 (row 0 dropped) -> the next allocation reuses it, not id 3.
    m.select([1])
    assert m.refcount.tolist() == [0, 0, 1]
    assert m.capacity == 3
    plan = m.append([2])  # fills block 2 (slot 3), then needs a new block
    assert plan.write_block.tolist() == [2, 0]
    assert plan.write_offset.tolist() == [3, 0]
    assert m.table(0).tolist() == [2, 0]
    assert m.capacity == 3
    m.add_rows(1)
    m.append([0, 1])
    assert m.table(1).tolist() == [1]  # lowest free id again
    m.append([0, 1])
    assert m.capacity == 3  # no new id while a lower one was free
    m.append([0, 4])
    assert m.table(1).tolist() == [1, 3]
    assert m.capacity == 4


def test_fork_shares_blocks():
    m = BlockManager(4)
    m.add_rows(2)
    m.append([5, 2])  # row0: [0, 1], row1: [2]
    cap = m.capacity
    m.fork(3)
    assert m.num_rows == 6
    assert m.capacity == cap  # no new ids
    assert m.lengths.tolist() == [5, 5, 5, 2, 2, 2]
    assert [m.table(r).tolist() for r in range(6)] == [[0, 1]] * 3 + [[2]] * 3
    assert m.refcount.tolist() == [3, 3, 3]
    assert m.blocks_shared == 3 and m.blocks_in_use == 3
    assert m.tables().tolist() == [[0, 1]] * 3 + [[2, -1]] * 3
    assert m.tables(min_width=4).shape == (6, 4)
    m.fork(1)  # no-op
    assert m.num_rows == 6
    with pytest.raises(ValueError):
        m.fork(0)


def test_append_after_fork_copy_on_write():
    bs = 4
    m = BlockManager(bs)
    m.add_rows(1)
    pool = np.full((0, bs), -1, dtype=np.int64)
    plan = m.append([6])  # blocks [0 (full), 1 (2/4)]
    pool = apply_plan(grow(pool, m.capacity), plan, np.arange(6))
    m.fork(3)
    plan = m.append([1, 1, 1])
    # Rows 0 and 1 copy the shared partial block 1; row 2 is then the sole owner.
    assert plan.copy_src.tolist() == [1, 1]
    assert plan.copy_dst.tolist() == [2, 3]
    assert [m.table(r).tolist() for r in range(3)] == [[0, 2], [0, 3], [0, 1]]
    assert plan.write_block.tolist() == [2, 3, 1]
    assert plan.write_offset.tolist() == [2, 2, 2]
    assert m.refcount.tolist() == [3, 1, 1, 1]
    assert not set(plan.copy_src.tolist()) & set(plan.copy_dst.tolist())
    pool = apply_plan(grow(pool, m.capacity), plan, np.array([100, 101, 102]))
    for r, tail in enumerate([100, 101, 102]):
        t = np.arange(m.lengths[r])
        got = pool[m.table(r)[t // bs], t % bs].tolist()
        assert got == [0, 1, 2, 3, 4, 5, tail]


def test_full_shared_block_no_copy():
    m = BlockManager(4)
    m.add_rows(1)
    m.append([4])
    m.fork(2)
    plan = m.append([2, 1])
    assert plan.copy_src.size == 0
    assert plan.write_block.tolist() == [1, 1, 2]
    assert plan.write_offset.tolist() == [0, 1, 0]
    assert m.refcount.tolist() == [2, 1, 1]


def test_append_zero_counts_and_validation():
    m = BlockManager(2)
    m.add_rows(2)
    plan = m.append([0, 0])
    assert plan.write_block.size == 0 and m.capacity == 0
    with pytest.raises(ValueError):
        m.append([1])
    with pytest.raises(ValueError):
        m.append([1, -1])
    with pytest.raises(ValueError):
        m.append([[1, 1]])
    with pytest.raises(ValueError):
        m.append([0.5, 1.0])
    assert m.lengths.tolist() == [0, 0]


def test_select_repeats_and_drops():
    m = BlockManager(2)
    m.add_rows(3)
    m.append([3, 2, 1])  # row0 [0,1], row1 [2], row2 [3]
    m.select([0, 0, 2, 0])  # drop row 1, repeat row 0
    assert m.num_rows == 4
    assert m.lengths.tolist() == [3, 3, 1, 3]
    assert m.refcount.tolist() == [3, 3, 0, 1]
    assert m.blocks_in_use == 3 and m.blocks_shared == 2
    assert m._free == [2]
    np.testing.assert_array_equal(m.refcount, ref_refcount(m))
    m.select([2])
    assert m.refcount.tolist() == [0, 0, 0, 1]
    assert sorted(m._free) == [0, 1, 2]
    with pytest.raises(ValueError):
        m.select([1])
    with pytest.raises(ValueError):
        m.select([-1])
    m.select([])
    assert m.num_rows == 0 and m.blocks_in_use == 0


def test_truncate():
    m = BlockManager(4)
    m.add_rows(2)
    m.append([10, 5])  # row0 [0,1,2], row1 [3,4]
    m.fork(2)  # rows 0,1 -> [0,1,2]; rows 2,3 -> [3,4]
    m.truncate([6, 0, 1, 5])
    assert m.lengths.tolist() == [4, 10, 4, 0]
    assert m.table(0).tolist() == [0]
    assert m.table(2).tolist() == [3]
    assert m.table(3).tolist() == []
    assert m.refcount.tolist() == [2, 1, 1, 1, 0]
    assert sorted(m._free) == [4]
    assert m.tables().tolist() == [[0, -1, -1], [0, 1, 2], [3, -1, -1], [-1, -1, -1]]
    with pytest.raises(ValueError, match="truncate"):
        m.truncate([5, 0, 0, 0])
    with pytest.raises(ValueError):
        m.truncate([0, 0, 0])
    assert m.lengths.tolist() == [4, 10, 4, 0]
    # Row 0 shares block 0 (full for row 1): cropping row 0 into it leaves it
    # shared and partial for row 0 -> row 0's next append copies it.
    m.truncate([1, 0, 0, 0])
    plan = m.append([1, 0, 0, 0])
    assert plan.copy_src.tolist() == [0]
    assert plan.copy_dst.tolist() == [4]
    assert plan.write_block.tolist() == [4] and plan.write_offset.tolist() == [3]


def test_release_empties_everything():
    m = BlockManager(3)
    m.add_rows(2)
    m.append([7, 4])
    m.fork(2)
    cap = m.capacity
    m.release()
    assert m.num_rows == 0
    assert m.blocks_in_use == 0 and m.blocks_shared == 0
    assert m.capacity == cap and m.id_bound == 0
    assert sorted(m._free) == list(range(cap))
    assert m.tokens_stored() == 0
    assert m.tables().shape == (0, 0)
    m.add_rows(1)
    plan = m.append([1])
    assert plan.write_block.tolist() == [0]
    assert m.id_bound == 1 < m.capacity


def test_pool_exhausted_message_and_state_unchanged():
    m = BlockManager(4, max_blocks=4)
    m.add_rows(1)
    m.append([6])  # 2 blocks
    m.fork(3)
    snap = (m.tables().copy(), m.lengths.copy(), m.refcount.copy(), m.capacity, list(m._free))
    # 3 rows each need a fresh block for their 3rd block; 2 of them also CoW block 1.
    with pytest.raises(PoolExhausted) as ei:
        m.append([3, 3, 3])
    msg = str(ei.value)
    assert "5" in msg and "2 are free" in msg and "max_blocks=4" in msg
    assert "beams" in msg and "prompt length" in msg and "new tokens" in msg and "raise max_blocks" in msg
    assert isinstance(ei.value, MemoryError)
    np.testing.assert_array_equal(m.tables(), snap[0])
    np.testing.assert_array_equal(m.lengths, snap[1])
    np.testing.assert_array_equal(m.refcount, snap[2])
    assert m.capacity == snap[3] and list(m._free) == snap[4]
    # Rows 0 and 2 both copy block 1 (row 1 still holds it): 4 blocks, exactly the limit.
    plan = m.append([1, 0, 1])
    assert plan.copy_src.tolist() == [1, 1] and plan.copy_dst.tolist() == [2, 3]
    assert m.blocks_in_use == 4 and m.capacity == 4
    plan = m.append([0, 1, 0])  # row 1 is now sole owner of block 1: in place, no new block
    assert plan.copy_src.size == 0 and plan.write_block.tolist() == [1]
    with pytest.raises(PoolExhausted, match="needs 1 new blocks but only 0 are free"):
        m.append([0, 0, 2])


def test_pool_exhausted_counts_cow_order():
    # Two holders of a partial block both appending: only one copy is needed.
    m = BlockManager(4, max_blocks=2)
    m.add_rows(1)
    m.append([2])
    m.fork(2)
    m.append([1, 1])  # 1 copy -> 2 blocks in use, fits exactly
    assert m.blocks_in_use == 2 and m.capacity == 2
    with pytest.raises(PoolExhausted):
        m.append([3, 0])


def test_tokens_stored_counts_shared_once():
    m = BlockManager(4)
    m.add_rows(1)
    m.append([6])
    m.fork(4)
    assert m.tokens_stored() == 6
    m.truncate([1, 0, 0, 0])  # shared partial block: max fill still 2
    assert m.tokens_stored() == 6
    m.truncate([0, 2, 2, 2])  # everyone cropped block 1 except row 0 (fill 1)
    assert m.tokens_stored() == 5
    m.append([0, 1, 0, 0])  # row 1's shared block 0 is full: new block with 1 token
    assert m.tokens_stored() == 6


def test_readonly_views():
    m = BlockManager(2)
    m.add_rows(1)
    m.append([3])
    with pytest.raises(ValueError):
        m.lengths[0] = 0
    with pytest.raises(ValueError):
        m.refcount[0] = 0


def test_vectorised_ops_scale():
    # 64 rows x 1000+ blocks: fork/select/append must stay fast.
    import time

    m = BlockManager(16)
    m.add_rows(1)
    m.append([16 * 1200 + 3])
    t0 = time.perf_counter()
    m.fork(64)
    rng = np.random.default_rng(0)
    for _ in range(50):
        m.append(np.ones(64, dtype=np.int64))
        m.select(rng.integers(0, 64, size=64))
    assert time.perf_counter() - t0 < 5.0
    np.testing.assert_array_equal(m.refcount, ref_refcount(m))


# -------------------------------------------------------------- stateful test
class BlockMachine(RuleBasedStateMachine):
    MAX_ROWS = 12

    @initialize(
        bs=st.integers(1, 5),
        max_blocks=st.none() | st.integers(4, 30),
        prompts=st.lists(st.integers(1, 12), min_size=1, max_size=3),
        beams=st.integers(2, 4),
        decode=st.integers(0, 2),
    )
    def setup(self, bs, max_blocks, prompts, beams, decode):
        self.bs = bs
        self.m = BlockManager(bs, max_blocks=max_blocks)
        self.rows: list[list[int]] = []
        self.pool = np.full((0, bs), -1, dtype=np.int64)
        self.next_tok = 0
        self.peak = 0
        self.last_written = np.zeros(0, dtype=np.int64)
        # Start like beam search does (prompts stored once, forked to beams), so
        # its first decode step and the random steps after it hit copy-on-write often.
        self.do_add_rows(len(prompts))
        self.do_append(prompts)
        self.do_fork(beams)
        self.do_append([decode] * len(self.rows))

    def snapshot(self):
        m = self.m
        return (m.tables().tolist(), m.lengths.tolist(), m.refcount.tolist(), m.capacity, sorted(m._free))

    @rule(n=st.integers(0, 3))
    def add_rows(self, n):
        self.do_add_rows(n)

    def do_add_rows(self, n):
        n = min(n, self.MAX_ROWS - len(self.rows))
        self.m.add_rows(n)
        self.rows += [[] for _ in range(n)]
        self.last_written = np.zeros(0, dtype=np.int64)

    @rule(data=st.data())
    def append(self, data):
        k = len(self.rows)
        self.do_append(data.draw(st.lists(st.integers(0, 2 * self.bs + 1), min_size=k, max_size=k)))

    def do_append(self, counts):
        before = self.snapshot()
        self.check_limit_boundary(counts)
        try:
            plan = self.m.append(counts)
        except PoolExhausted:
            assert self.m.max_blocks is not None
            assert self.snapshot() == before
            # The refusal must be justified: unbounded, the append needs more blocks.
            unbounded = copy.deepcopy(self.m)
            unbounded.max_blocks = None
            unbounded.append(counts)
            assert unbounded.blocks_in_use > self.m.max_blocks
            self.last_written = np.zeros(0, dtype=np.int64)
            return
        if self.m.max_blocks is not None:
            assert self.m.blocks_in_use <= self.m.max_blocks
        # Lowest id first: the ids taken are the smallest of (free ids, fresh ids).
        old_cap, old_free = before[3], before[4]
        taken = sorted(set(self.m.tables().ravel().tolist()) - {-1} - {b for b, c in enumerate(before[2]) if c})
        candidates = sorted(old_free) + list(range(old_cap, old_cap + len(taken)))
        assert taken == candidates[: len(taken)]
        total = sum(counts)
        assert plan.write_block.shape == (total,) and plan.write_offset.shape == (total,)
        assert plan.copy_src.shape == plan.copy_dst.shape
        assert not set(plan.copy_src.tolist()) & set(plan.copy_dst.tolist())
        assert len(set(plan.copy_dst.tolist())) == plan.copy_dst.size
        # Copy destinations are fresh: nobody held them before this append.
        old_rc = np.asarray(before[2] + [0] * (self.m.capacity - before[3]))
        assert (old_rc[plan.copy_dst] == 0).all()
        assert ((plan.write_offset >= 0) & (plan.write_offset < self.bs)).all()
        if self.m.max_blocks is not None:
            assert self.m.capacity <= self.m.max_blocks
        values = np.arange(self.next_tok, self.next_tok + total, dtype=np.int64)
        self.next_tok += total
        self.pool = apply_plan(grow(self.pool, self.m.capacity), plan, values)
        i = 0
        for r, c in enumerate(counts):
            self.rows[r] += values[i : i + c].tolist()
            i += c
        event(f"copies={min(plan.copy_src.size, 3)}")
        self.last_written = plan.write_block

    def check_limit_boundary(self, counts):
        """max_blocks exactly at the need succeeds; one below raises, state unchanged."""
        probe = copy.deepcopy(self.m)
        probe.max_blocks = None
        probe.append(counts)
        need = probe.blocks_in_use
        tight = copy.deepcopy(self.m)
        tight.max_blocks = need
        tight.append(counts)
        if need > self.m.blocks_in_use:
            short = copy.deepcopy(self.m)
            short.max_blocks = need - 1
            with pytest.raises(PoolExhausted):
                short.append(counts)
            assert short.lengths.tolist() == self.m.lengths.tolist()
            assert short.refcount.tolist() == self.m.refcount.tolist()

    @rule(n=st.integers(1, 3))
    def fork(self, n):
        self.do_fork(n)

    def do_fork(self, n):
        if len(self.rows) * n > self.MAX_ROWS:
            n = 1
        cap = self.m.capacity
        self.m.fork(n)
        assert self.m.capacity == cap
        self.rows = [list(r) for r in self.rows for _ in range(n)]
        self.last_written = np.zeros(0, dtype=np.int64)

    @rule(data=st.data())
    def select(self, data):
        k = len(self.rows)
        index = data.draw(st.lists(st.integers(0, k - 1), max_size=self.MAX_ROWS)) if k else []
        self.m.select(index)
        self.rows = [list(self.rows[i]) for i in index]
        self.last_written = np.zeros(0, dtype=np.int64)

    @rule(data=st.data())
    def truncate(self, data):
        counts = [data.draw(st.integers(0, len(r))) for r in self.rows]
        self.m.truncate(counts)
        self.rows = [r[: len(r) - c] for r, c in zip(self.rows, counts)]
        self.last_written = np.zeros(0, dtype=np.int64)

    @precondition(lambda self: any(self.rows))
    @rule(data=st.data())
    def bad_truncate(self, data):
        r = data.draw(st.sampled_from([i for i, row in enumerate(self.rows) if row]))
        counts = [0] * len(self.rows)
        counts[r] = len(self.rows[r]) + 1
        before = self.snapshot()
        with pytest.raises(ValueError):
            self.m.truncate(counts)
        assert self.snapshot() == before

    @rule()
    def release(self):
        self.m.release()
        self.rows = []
        self.last_written = np.zeros(0, dtype=np.int64)
        assert self.m.blocks_in_use == 0
        assert sorted(self.m._free) == list(range(self.m.capacity))

    @invariant()
    def consistent(self):
        if not hasattr(self, "m"):
            return
        m, bs = self.m, self.bs
        assert m.num_rows == len(self.rows)
        assert m.lengths.tolist() == [len(r) for r in self.rows]
        assert m.refcount.shape == (m.capacity,)
        # refcount == number of table entries per id.
        np.testing.assert_array_equal(m.refcount, ref_refcount(m))
        # Blocks written by the last plan are exclusively owned now.
        if self.last_written.size:
            assert (m.refcount[self.last_written] == 1).all()
        # Every row reads back its shadow through its table.
        self.pool = grow(self.pool, m.capacity)
        for r, shadow in enumerate(self.rows):
            tab = m.table(r)
            assert tab.dtype == np.int32
            assert tab.shape == (-(-len(shadow) // bs),)
            assert len(set(tab.tolist())) == tab.size
            t = np.arange(len(shadow))
            assert self.pool[tab[t // bs], t % bs].tolist() == shadow
        tabs = m.tables()
        width = max((-(-len(s) // bs) for s in self.rows), default=0)
        assert tabs.shape == (m.num_rows, width)
        for r in range(m.num_rows):
            row = m.table(r)
            assert tabs[r, : row.size].tolist() == row.tolist()
            assert (tabs[r, row.size :] == -1).all()
        # Counters and the free list.
        assert m.blocks_in_use == int((m.refcount > 0).sum())
        assert m.blocks_shared == int((m.refcount > 1).sum())
        assert len(m._free) == len(set(m._free))
        assert sorted(m._free) == np.flatnonzero(m.refcount == 0).tolist()
        # id_bound: one past the largest id any table holds (a device pool of that many blocks holds them all)
        held = tabs[tabs >= 0]
        assert m.id_bound == (int(held.max()) + 1 if held.size else 0) <= m.capacity
        # Lowest-id-first: capacity only grows when every lower id is in use.
        self.peak = max(self.peak, m.blocks_in_use)
        assert m.capacity == self.peak
        # tokens_stored: per distinct block, the largest fill any holder has.
        fill: dict[int, int] = {}
        for r, shadow in enumerate(self.rows):
            for j, b in enumerate(m.table(r).tolist()):
                fill[b] = max(fill.get(b, 0), min(bs, len(shadow) - j * bs))
        assert m.tokens_stored() == sum(fill.values())


BlockMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockMachine = BlockMachine.TestCase
