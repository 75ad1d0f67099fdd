"""device_blocks: the device bookkeeping of a static decode layout equals the host path (BlockManager.select,
BlockManager.append, DecodeLayout.step) step for step, keeps the pool's invariants, reads nothing on the host,
and flags exactly the steps the host path refuses."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from hf_cascade import device_blocks as db
from hf_cascade.blocks import BlockManager, PoolExhausted
from hf_cascade.plan import DecodeLayout, LayoutOutgrown


def _prefilled(bs, system_len, prompt_lens, beams):
    """A manager after prefill and fork: an optional system prompt stored once for all prompts (its partly
    filled last block copied on write by the prompts' own tokens), each prompt stored once for its beams."""
    m = BlockManager(bs)
    if system_len:
        m.add_rows(1)
        m.append([system_len])
        m.fork(len(prompt_lens))
    else:
        m.add_rows(len(prompt_lens))
    m.append(prompt_lens)
    m.fork(beams)
    return m


def _parents(rng, prompts, beams, cross):
    """One step's parents: per prompt, its beams reordered at random, kept (sampling, or its beams finished),
    or all taken from one beam; ``cross``: one row takes a parent from another prompt (leaves its levels)."""
    parents = np.arange(prompts * beams)
    for p in range(prompts):
        rows = slice(p * beams, (p + 1) * beams)
        mode = rng.integers(3)
        if mode == 0:
            parents[rows] = p * beams + rng.integers(0, beams, beams)
        elif mode == 2:
            parents[rows] = p * beams + rng.integers(beams)
    if cross and prompts > 1:
        parents[0] = beams + rng.integers(beams)
    return parents


def _host_step(m, layout, parents, first):
    """The host path of one step: its plan, or the overflow bit of what it raised."""
    if not first:
        m.select(parents)
    try:
        append_plan = m.append(np.ones(m.num_rows, dtype=np.int64))
        return layout.step(m.tables(), m.lengths, append_plan), 0
    except PoolExhausted:
        return None, db.POOL_EXHAUSTED
    except LayoutOutgrown as err:
        return None, db.OUTGROWN if err.capacity else db.LEFT_LEVELS


def _assert_state_equal(state, m):
    P = state.pool_blocks
    np.testing.assert_array_equal(state.tables.numpy(), m.tables(state.tables.shape[1]))
    np.testing.assert_array_equal(state.lengths.numpy(), m.lengths)
    rc = state.refcount.numpy()
    np.testing.assert_array_equal(rc[: m.capacity], m.refcount)
    assert (rc[m.capacity:] == 0).all()
    # pool invariants: counts are the table entries; a free id (count 0) is in no table
    ids = state.tables.numpy()
    counts = np.bincount(ids[ids >= 0], minlength=P + 1)
    np.testing.assert_array_equal(rc, counts)
    assert (ids < P).all()


def _snapshot(state):
    return [t.clone() for t in (state.tables, state.lengths, state.refcount, state.steps)]


@settings(max_examples=200, deadline=None)
@given(bs=st.sampled_from([1, 2, 3, 4]), system_len=st.integers(0, 9),
       prompt_lens=st.lists(st.integers(1, 9), min_size=1, max_size=3), beams=st.integers(1, 4),
       room=st.one_of(st.integers(1, 4), st.integers(12, 16)), spare=st.one_of(st.integers(0, 4), st.integers(20, 40)),
       cross_rate=st.sampled_from([0.0, 0.0, 0.1]),
       solo_rows=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_device_steps_equal_host_steps(bs, system_len, prompt_lens, beams, room, spare, cross_rate, solo_rows, seed):
    _drive(bs, system_len, prompt_lens, beams, room, spare, cross_rate, solo_rows, seed)


@pytest.mark.parametrize("flag, args", [
    (db.POOL_EXHAUSTED, dict(bs=1, prompt_lens=[3, 2], beams=2, room=8, spare=1)),
    (db.LEFT_LEVELS, dict(bs=2, prompt_lens=[4, 5], beams=2, room=8, spare=40, cross_rate=1.0)),
    (db.OUTGROWN, dict(bs=2, prompt_lens=[3, 3], beams=2, room=2, spare=40)),
])
def test_each_overflow_is_flagged_where_the_host_raises(flag, args):
    assert _drive(system_len=0, solo_rows=False, seed=1, **dict(dict(cross_rate=0.0), **args)) == flag


def _drive(bs, system_len, prompt_lens, beams, room, spare, cross_rate, solo_rows, seed):
    """Run the host path and the device path over the same random parents, asserting every step equal; returns
    the overflow bit that ended the run (0: none in 12 steps)."""
    rng = np.random.default_rng(seed)
    m = _prefilled(bs, system_len, prompt_lens, beams)
    pool = m.capacity + spare
    m.max_blocks = pool
    layout = DecodeLayout.freeze(m.tables(), m.lengths, bs, room, min_group_rows=2, solo_rows=solo_rows)
    state = db.DeviceBlocks.from_host(m, layout)
    _assert_state_equal(state, m)
    for step in range(12):
        parents = _parents(rng, len(prompt_lens), beams, rng.random() < cross_rate)
        plan, host_flag = _host_step(m, layout, parents, step == 0)
        if step:
            db.reorder(state, torch.as_tensor(parents))
        before = _snapshot(state)
        out = db.append(state)
        assert int(state.flags) == host_flag, (step, parents)
        if host_flag:
            # the flagged append left the state as the reorder did; its writes and copies name the scratch block
            for old, new in zip(before, _snapshot(state)):
                assert torch.equal(old, new)
            for t in (out.write_block, out.copy_src, out.copy_dst):
                assert (t == state.scratch_block).all()
            if host_flag == db.POOL_EXHAUSTED:      # the host's append refused before changing anything too
                _assert_state_equal(state, m)
                tables, lengths, refcount = db.host_state(state)
                np.testing.assert_array_equal(tables, m.tables(tables.shape[1]))
                np.testing.assert_array_equal(lengths, m.lengths)
                np.testing.assert_array_equal(refcount[: m.capacity], m.refcount)
            db.reorder(state, torch.as_tensor(_parents(rng, len(prompt_lens), beams, False)))
            db.append(state)                        # later steps are no-ops until the host re-plans
            for old, new in zip(before, _snapshot(state)):
                assert torch.equal(old, new)
            assert int(state.flags) == host_flag
            return host_flag
        assert int(state.steps) == step + 1
        _assert_state_equal(state, m)
        for name in ("suffix_table", "q_limit", "inner_suffix_table", "inner_q_limit", "write_block",
                     "write_offset", "copy_src", "copy_dst"):
            want, got = getattr(plan, name), getattr(out, name)
            if want is None:
                assert got is None, name
                continue
            assert got.shape == want.shape, name
            np.testing.assert_array_equal(got.numpy(), want, err_msg=f"{name} at step {step}")
    return 0


def test_shared_partly_filled_blocks_copy_on_write_in_row_order():
    # 2 prompts of 5 tokens (block 4) x 3 beams: each prompt's last block is partly filled and held by 3 rows,
    # so the first two rows of each prompt copy it and the third writes in place
    m = _prefilled(4, 0, [5, 5], 3)
    m.max_blocks = 32
    layout = DecodeLayout.freeze(m.tables(), m.lengths, 4, 8)
    state = db.DeviceBlocks.from_host(m, layout)
    out = db.append(state)
    plan = layout.step(m.tables(), m.lengths, m.append(np.ones(6, dtype=np.int64)))
    assert plan.copy_src.tolist()[:4] == out.copy_src.tolist()[:4] == [1, 1, 3, 3]
    np.testing.assert_array_equal(out.copy_dst.numpy(), plan.copy_dst)
    np.testing.assert_array_equal(out.write_block.numpy(), plan.write_block)


def test_a_step_reads_nothing_on_the_host(monkeypatch):
    m = _prefilled(2, 3, [3, 4], 3)
    m.max_blocks = m.capacity + 2          # small: the pool runs out within the steps below
    layout = DecodeLayout.freeze(m.tables(), m.lengths, 2, 4, min_group_rows=2)
    state = db.DeviceBlocks.from_host(m, layout)
    parents = torch.tensor([2, 2, 0, 4, 3, 3])

    def refuse(*args, **kwargs):
        raise AssertionError("host read inside a device step")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for _ in range(6):
        db.reorder(state, parents)
        db.append(state)
    monkeypatch.undo()
    assert db.read_flags(state) == db.POOL_EXHAUSTED


def test_pool_size_is_fixed_and_covers_the_host_ids():
    m = _prefilled(2, 0, [5], 2)
    layout = DecodeLayout.freeze(m.tables(), m.lengths, 2, 4)
    with pytest.raises(ValueError, match="fixed size"):
        db.DeviceBlocks.from_host(m, layout)
    with pytest.raises(ValueError, match="pool holds"):
        db.DeviceBlocks.from_host(m, layout, pool_blocks=m.capacity - 1)


def test_a_step_traces_as_one_graph_and_computes_the_same():
    # dynamo with fullgraph=True refuses any graph break (a host read, a data-dependent shape or branch): the
    # step is fit for capture; the eager backend keeps the check fast and the values those of plain torch
    def step(state, parents):
        db.reorder(state, parents)
        return db.append(state)

    states = []
    for _ in range(2):
        m = _prefilled(2, 3, [3, 4], 3)
        m.max_blocks = m.capacity + 30
        layout = DecodeLayout.freeze(m.tables(), m.lengths, 2, 16, min_group_rows=2)
        states.append(db.DeviceBlocks.from_host(m, layout))
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    rng = np.random.default_rng(0)
    for _ in range(4):
        parents = torch.as_tensor(_parents(rng, 2, 3, False))
        want, got = step(states[0], parents), compiled(states[1], parents)
        for name in ("suffix_table", "q_limit", "inner_suffix_table", "write_block", "write_offset", "copy_src",
                     "copy_dst"):
            assert torch.equal(getattr(want, name), getattr(got, name)), name
    assert torch.equal(states[0].tables, states[1].tables) and int(states[1].steps) == 4


def test_an_inactive_step_changes_nothing_and_flags_nothing():
    """A step queued after the call finished (``active`` False) leaves the state and writes into the scratch block,
    even where it would overflow; the host's state then restores into a BlockManager as it was."""
    m = _prefilled(2, 3, [3, 4], 2)
    layout = DecodeLayout.freeze(m.tables(), m.lengths, 2, 1)
    state = db.DeviceBlocks.from_host(m, layout, pool_blocks=m.capacity + 8)
    before = _snapshot(state)
    for _ in range(3):                 # a live step would outgrow the layout's room of one token
        db.reorder(state, torch.arange(state.num_rows))
        step = db.append(state, active=torch.tensor(False))
        assert (step.write_block == state.scratch_block).all() and (step.copy_dst == state.scratch_block).all()
    assert int(state.flags) == 0
    for a, b in zip(before, _snapshot(state)):
        assert torch.equal(a, b)
    db.append(state, active=torch.tensor(True))        # the layout's one token of room
    assert int(state.flags) == 0 and int(state.steps) == 1
    db.append(state, active=torch.tensor(True))
    assert int(state.flags) == db.OUTGROWN and int(state.steps) == 1


def test_host_state_restores_into_a_block_manager():
    """BlockManager.restore takes what device steps reached: the same tables, lengths, counts and free ids (the
    next host append takes the ids the device path would)."""
    m = _prefilled(2, 3, [3, 5], 3)
    layout = DecodeLayout.freeze(m.tables(), m.lengths, 2, 12)
    state = db.DeviceBlocks.from_host(m, layout, pool_blocks=m.capacity + 40)
    rng = np.random.default_rng(0)
    host = _prefilled(2, 3, [3, 5], 3)
    for i in range(6):
        parents = _parents(rng, 2, 3, cross=False)
        if i:
            db.reorder(state, torch.as_tensor(parents))
            host.select(parents)
        db.append(state)
        host.append(np.ones(host.num_rows, dtype=np.int64))
    restored = _prefilled(2, 3, [3, 5], 3)
    restored.restore(*db.host_state(state))
    np.testing.assert_array_equal(restored.tables(), host.tables())
    np.testing.assert_array_equal(restored.lengths, host.lengths)
    np.testing.assert_array_equal(restored.refcount[: host.capacity], host.refcount)
    plan_a, plan_b = restored.append(np.ones(6, dtype=np.int64)), host.append(np.ones(6, dtype=np.int64))
    np.testing.assert_array_equal(plan_a.write_block, plan_b.write_block)
    np.testing.assert_array_equal(plan_a.copy_dst, plan_b.copy_dst)
    with pytest.raises(ValueError, match="reference counts"):
        restored.restore(restored.tables(), restored.lengths, np.zeros(restored.capacity, dtype=np.int32))
