"""The decode step on a layout fixed for the whole generate call (hf_cascade.plan.DecodeLayout) and the graph
runner's static path (hf_cascade.graphs) in its eager form, on the CPU.

- Plans: a static step attends exactly like the step planned anew (float64 reference backend) over random
  beam histories (forks, reorders inside prompts, copy-on-write), and outgrowing the layout re-plans.
- Tokens: every family the GPU path can serve gives stock's tokens with per-step plans, with the static
  layout, and through the runner (fixed input tensors, one plan upload per step, the forward re-run on them).
- Faults: a failing step leaves the model's forward restored and the next generate exact.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_cascade
from hf_cascade import CascadeConfig, graphs, session
from hf_cascade.blocks import BlockManager
from hf_cascade.decode import device_select
from hf_cascade.kernels import reference
from hf_cascade.plan import DecodeLayout, LayoutOutgrown, build_step_plan

from conftest import RunnerSpy, cache_kw, host_loop, model_pair, padded_batch, plans_every_step
from test_families import FAMILIES, generate_kwargs
from test_families import model_pair as family_pair

BS = 4


# ---- plans ------------------------------------------------------------------------------------------------
def _history(rng, prompts, beams, steps):
    """A block manager after a prefill of ``prompts`` rows, a fork to ``beams`` each, and ``steps`` decode
    steps with random reorders inside each prompt's beams; yields (manager, step plan inputs) per step."""
    blocks = BlockManager(BS)
    blocks.add_rows(len(prompts))
    blocks.append(np.asarray(prompts))
    blocks.fork(beams)
    for _ in range(steps):
        base = np.repeat(np.arange(len(prompts)) * beams, beams)
        blocks.select(base + rng.integers(0, beams, size=base.size))
        yield blocks


def _attend(plan, q, pool, scale=0.3):
    return reference.attend(q, pool, plan, scale)


@pytest.mark.parametrize("solo", [False, True], ids=["", "solo rows"])
@pytest.mark.parametrize("seed", range(6))
def test_static_step_attends_like_a_step_planned_anew(seed, solo):
    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, 23, size=rng.integers(1, 4))
    beams, steps = int(rng.integers(1, 5)), 9
    Hkv, Hq, D = 2, 4, 8
    layout = None
    for blocks in _history(rng, prompts, beams, steps):
        prev = blocks.lengths.copy()
        if layout is None:
            layout = DecodeLayout.freeze(blocks.tables(), prev, BS, steps, solo_rows=solo)
            if solo:          # every row with a full block reads it through the prefix level
                assert (layout.row_prefix_blocks == prev // BS).all() or beams > 1
        counts = np.ones(blocks.num_rows, dtype=np.int64)
        append = blocks.append(counts)
        static = layout.step(blocks.tables(), blocks.lengths, append)
        anew = build_step_plan(blocks.tables(), blocks.lengths, counts, None, 1, append, BS, 2)
        assert static.static and not anew.static
        assert static.suffix_table.shape == (blocks.num_rows, layout.suffix_width)   # fixed for the call
        assert np.array_equal(static.write_block, anew.write_block)
        assert static.copy_src.shape == (blocks.num_rows,)                           # padded copy pairs
        assert set(zip(anew.copy_src, anew.copy_dst)) <= set(zip(static.copy_src, static.copy_dst))
        pool = torch.randn(blocks.capacity + 1, 2, BS, Hkv, D, dtype=torch.float64)
        q = torch.randn(blocks.num_rows, 1, Hq, D, dtype=torch.float64)
        torch.testing.assert_close(_attend(static, q, pool), _attend(anew, q, pool), rtol=1e-12, atol=1e-12)


def test_static_buffers_keep_their_addresses_and_take_each_step():
    rng = np.random.default_rng(0)
    layout, seen = None, []
    for blocks in _history(rng, np.array([9, 13]), 3, 5):
        if layout is None:
            layout = DecodeLayout.freeze(blocks.tables(), blocks.lengths.copy(), BS, 6)
        plan = layout.step(blocks.tables(), blocks.lengths, blocks.append(np.ones(blocks.num_rows, np.int64)))
        dp = plan.on("cpu")
        seen.append((dp.suffix_table.data_ptr(), dp.write_block.data_ptr(), dp.prefix_table.data_ptr()))
        assert np.array_equal(dp.suffix_table.numpy(), plan.suffix_table)
        assert np.array_equal(dp.q_limit.numpy(), plan.q_limit)
        assert np.array_equal(dp.write_offset.numpy(), plan.write_offset)
        assert plan.layout is layout and plan.static
    assert len(set(seen)) == 1


def _frozen(prompts, beams, steps=6):
    """(block manager, layout) after a prefill of ``prompts`` (token counts), a fork to ``beams`` each."""
    blocks = BlockManager(BS)
    blocks.add_rows(len(prompts))
    blocks.append(np.asarray(prompts))
    blocks.fork(beams)
    return blocks, DecodeLayout.freeze(blocks.tables(), blocks.lengths.copy(), BS, steps)


@pytest.mark.parametrize("seed", range(4))
def test_a_kept_layout_adopts_a_shorter_prompts_values_and_attends_like_its_own(seed):
    """A layout frozen for longer prompts takes the values of a later call's layout of the same rows and levels
    (DecodeLayout.adopt): its host arrays and its device level tensors (written in place: a captured step reads
    them by address) become the new call's, padded to its own widths, and every step then attends as the new
    call's own layout and a per-step plan do (float64 reference)."""
    rng = np.random.default_rng(seed)
    long_prompts = rng.integers(100, 130, size=2)
    kept = _frozen(long_prompts, 3)[1]
    device_levels = kept.device_plan("cpu")
    addresses = [getattr(device_levels, name).data_ptr() for name in ("prefix_table", "prefix_len", "group_rows")]
    blocks, own = _frozen(rng.integers(30, 70, size=2), 3)
    assert not np.array_equal(kept.prefix_len, own.prefix_len)
    assert not kept.holds(own) and kept.adopt(own)
    assert kept.prefix_table.shape[1] >= own.prefix_table.shape[1]
    assert np.array_equal(kept.prefix_len, own.prefix_len)
    assert np.array_equal(kept.row_prefix_blocks, own.row_prefix_blocks)
    dp = kept.device_plan("cpu")
    assert [getattr(dp, name).data_ptr() for name in ("prefix_table", "prefix_len", "group_rows")] == addresses
    assert np.array_equal(dp.prefix_table.numpy(), kept.prefix_table)
    assert np.array_equal(dp.prefix_len.numpy(), own.prefix_len)
    Hkv, Hq, D = 2, 4, 8
    for _ in range(5):
        blocks.select(np.repeat(np.arange(2) * 3, 3) + rng.integers(0, 3, size=6))
        counts = np.ones(blocks.num_rows, dtype=np.int64)
        append = blocks.append(counts)
        adopted = kept.step(blocks.tables(), blocks.lengths, append)
        anew = build_step_plan(blocks.tables(), blocks.lengths, counts, None, 1, append, BS, 2)
        pool = torch.randn(blocks.capacity + 1, 2, BS, Hkv, D, dtype=torch.float64)
        q = torch.randn(blocks.num_rows, 1, Hq, D, dtype=torch.float64)
        torch.testing.assert_close(_attend(adopted, q, pool), _attend(anew, q, pool), rtol=1e-12, atol=1e-12)
        assert adopted.on("cpu") is dp


def test_a_kept_layout_refuses_other_rows_levels_or_widths():
    """adopt takes nothing where the shapes do not serve: other rows or sharing, a wider need, or tables more
    than ADOPT_SPAN times as wide as the call's own (a launch planned for the capacity would read a short prompt's
    prefix in too few chunks)."""
    from hf_cascade.plan import ADOPT_SPAN
    kept = _frozen([300, 330], 3)[1]
    before = kept.prefix_table.copy()
    for prompts, beams in (([300, 330], 2), ([300], 3), ([600, 660], 3), ([5, 6], 3)):
        other = _frozen(prompts, beams)[1]
        assert not kept.adopt(other), (prompts, beams)
        assert np.array_equal(kept.prefix_table, before)
    tiny = _frozen([5, 6], 3)[1]
    assert kept.prefix_table.shape[1] > ADOPT_SPAN * tiny.prefix_table.shape[1]


def test_layout_outgrown_when_rows_pass_max_length_or_leave_their_prefix():
    blocks = BlockManager(BS)
    blocks.add_rows(1)
    blocks.append([9])
    blocks.fork(2)
    layout = DecodeLayout.freeze(blocks.tables(), blocks.lengths.copy(), BS, max_new_tokens=1)
    assert layout.num_rows == 2 and layout.prefix_len.tolist() == [8]
    with pytest.raises(LayoutOutgrown, match="the layout holds") as outgrown:
        for _ in range(12):
            layout.step(blocks.tables(), blocks.lengths, blocks.append([1, 1]))
    assert outgrown.value.capacity
    wide = layout.widened(blocks.lengths - 1, 8)         # capacity only: the same levels, more room
    assert wide.suffix_width > layout.suffix_width and wide.prefix_table is layout.prefix_table
    other = BlockManager(BS)
    other.add_rows(2)
    other.append([9, 9])           # two rows that share nothing
    with pytest.raises(LayoutOutgrown, match="frozen prefix"):
        layout.step(other.tables(), other.lengths, other.append([1, 1]))


def test_cache_replans_when_the_layout_is_outgrown(llama_pair, caplog):
    """A decode that runs past the max_length the layout was frozen for widens the layout (logged), still exact."""
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=2)
    kw = dict(num_beams=3, max_new_tokens=6, pad_token_id=0)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    real = hf_cascade.CascadeCache.begin_decode

    def too_short(self, max_length):                 # as if a stopping criterion let rows run longer
        real(self, ids.shape[1] + 1)

    with pytest.MonkeyPatch.context() as mp, caplog.at_level("INFO", logger="hf_cascade"):
        mp.setattr(hf_cascade.CascadeCache, "begin_decode", too_short)
        got = cascade.generate(input_ids=ids, attention_mask=mask, **kw, hf_cascade_config=CascadeConfig(block_size=2))
    assert torch.equal(expected, got)
    assert "decode layout widened" in caplog.text


# ---- tokens -----------------------------------------------------------------------------------------------
# every family that gives stock's tokens: the static path serves sliding windows (also once the sequence passes
# them during the call), softcap and sinks as well
GPU_SERVED = [name for name, f in FAMILIES.items() if f.status == "exact"]


@pytest.mark.parametrize("name", GPU_SERVED)
@pytest.mark.parametrize("mode", ["beam", "sample"])
def test_family_tokens_per_step_plans_and_runner(name, mode, monkeypatch):
    stock, cascade = family_pair(name)
    family = FAMILIES[name]
    ids, mask = padded_batch(seed=3, lengths=(21, 15))

    def run(model, **extra):
        torch.manual_seed(123)
        return model.generate(input_ids=ids, attention_mask=mask, **generate_kwargs(mode), **family.extra, **extra)

    expected = run(stock)
    with pytest.MonkeyPatch.context() as mp:
        plans_every_step(mp)
        assert torch.equal(run(cascade), expected)
    spy = RunnerSpy(monkeypatch)
    # the runner's static step with the token choice on the host (tests/decode/test_whole_step.py runs the families with it
    # on the device, the default); a forward input the loop does not advance (GPT-2's token types) keeps
    # transformers' loop, eager
    config = CascadeConfig(cuda_graphs="eager")
    assert torch.equal(run(cascade, hf_cascade_config=config, **host_loop()), expected)
    runner, = spy.runners
    assert graphs.unsupported_reason(cascade, config) is None
    advanced = "token_type_ids" not in family.extra
    assert runner.disabled is None and (runner.device_steps >= 5) == advanced, (runner.disabled, runner.device_steps)
    assert "forward" not in cascade.__dict__            # the model's own forward is back


@pytest.mark.parametrize("whole_step", [False, True], ids=["transformers' loop", "whole step"])
@pytest.mark.parametrize("window", [24, 40], ids=["passed during the call", "never passed"])
@pytest.mark.parametrize("mode", ["beam", "sample", "greedy"])
def test_sliding_window_crossed_during_the_call_through_the_runner(mode, window, whole_step, monkeypatch):
    """Rows enter the call inside the window and pass it while the runner replays: the static step keeps the
    window from its first step on (a captured graph cannot change its mind on the host); stock's tokens. A call
    that never reaches its window runs plain causal attention (which more backends take)."""
    stock, cascade = model_pair("mistral", sliding_window=window)
    ids, mask = padded_batch(seed=8, lengths=(21, 15))          # 21 + 9 new tokens pass the window of 24
    kw = dict(generate_kwargs(mode), max_new_tokens=9)

    def run(model, **extra):
        torch.manual_seed(11)
        return model.generate(input_ids=ids, attention_mask=mask, **kw, **extra)

    expected = run(stock)
    windows = []                      # the window each decode attention call was given
    real_forward = reference.BACKEND.forward

    def forward(q, pool, metadata, params):
        windows.append((metadata.plan.static, params.window))
        return real_forward(q, pool, metadata, params)

    monkeypatch.setattr(reference.BACKEND, "forward", forward)
    spy = RunnerSpy(monkeypatch)
    # greedy shares nothing and would run on stock's own path: a cache of our own keeps it on the cascade
    config = CascadeConfig(cuda_graphs="eager")
    extra = cache_kw(cascade, hf_cascade.CascadeCache(cascade.config, config)) \
        if mode == "greedy" else dict(hf_cascade_config=config)
    assert torch.equal(run(cascade, **extra, **({} if whole_step else host_loop())), expected)
    runner, = spy.runners
    assert runner.disabled is None and (runner.device_steps if whole_step else runner.replays) >= 6
    # every static step had the window, also those whose rows were all still inside it (what a graph bakes in)
    assert {w for static, w in windows if static} == {24 if window == 24 else None}
    assert sum(static for static, _ in windows) >= 7 * 2


CASES = {
    "greedy": dict(do_sample=False),
    "beam, eos ends beams early": dict(num_beams=4, num_return_sequences=2, eos_token_id=7, early_stopping=True),
    "sampling": dict(do_sample=True, num_return_sequences=3, top_k=0, temperature=1.5),
}


@pytest.mark.parametrize("whole_step", [False, True], ids=["transformers' loop", "whole step"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shared", [False, True], ids=["own prompts", "shared system prompt"])
def test_runner_gives_stock_tokens(case, shared, whole_step, llama_pair, monkeypatch):
    """The runner's static path: padding, several prompts, a shared system prompt, eos, a pool that grows
    during decode (block size 2, grow policy)."""
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=5, lengths=(27, 19, 23))
    if shared:
        ids[:, -19:-5] = ids[0, -19:-5]
    kw = dict(max_new_tokens=9, pad_token_id=0, **CASES[case])
    torch.manual_seed(7)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    spy = RunnerSpy(monkeypatch)
    torch.manual_seed(7)
    got = cascade.generate(input_ids=ids, attention_mask=mask, **kw, **({} if whole_step else host_loop()),
                           hf_cascade_config=CascadeConfig(cuda_graphs="eager", block_size=2, memory="grow"))
    assert torch.equal(expected, got)
    runner, = spy.runners
    assert (runner.device_steps if whole_step else runner.replays) >= 5 and runner.disabled is None


@pytest.mark.parametrize("case", ["greedy", "sampling"])
def test_solo_rows_give_stock_tokens(case, llama_pair, monkeypatch):
    """A backend that reads lone rows through its prefix kernel (the cuda backend's ``solo_prefix``)."""
    stock, cascade = llama_pair
    monkeypatch.setattr(reference.BACKEND, "solo_prefix", True)
    ids, mask = padded_batch(seed=6, lengths=(37, 21))
    kw = dict(max_new_tokens=9, pad_token_id=0, **CASES[case])
    torch.manual_seed(3)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    plans = []
    real = hf_cascade.CascadeCache._freeze_layout

    def keep(self, *args):
        plans.append(real(self, *args))
        return plans[-1]

    monkeypatch.setattr(hf_cascade.CascadeCache, "_freeze_layout", keep)
    torch.manual_seed(3)
    # greedy shares nothing (it would run on stock's path): a CascadeCache of our own keeps it on the cascade
    got = cascade.generate(input_ids=ids, attention_mask=mask, **kw,
                           **cache_kw(cascade, hf_cascade.CascadeCache(cascade.config, CascadeConfig(block_size=4))))
    assert torch.equal(expected, got)
    layout, = plans
    assert (layout.row_prefix_blocks > 0).all()


def test_second_call_of_the_same_shape_reuses_the_graph(llama_pair, monkeypatch):
    """The owned cache, its layout and its runner are kept for the model's next call: a call of the same
    shape (other prompt contents) replays from its first decode step; another shape captures anew; a cache
    handed out (return_dict_in_generate) is not kept."""
    stock, cascade = llama_pair
    config = CascadeConfig(cuda_graphs="eager", memory="static", max_kv_bytes=2 ** 22, block_size=4)
    kw = dict(num_beams=3, num_return_sequences=2, max_new_tokens=7, pad_token_id=0)
    spy = RunnerSpy(monkeypatch)
    for seed in (1, 2):
        ids, mask = padded_batch(seed=seed)
        expected = stock.generate(input_ids=ids, attention_mask=mask, **kw)
        assert torch.equal(cascade.generate(input_ids=ids, attention_mask=mask, **kw, hf_cascade_config=config),
                           expected)
    first, second = spy.runners
    assert second is first and first.first_steps == 0 and first.replays >= 6
    assert session._kept[cascade].cache.get_seq_length() == 0
    ids, mask = padded_batch(seed=3)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **{**kw, "num_beams": 4})
    assert torch.equal(cascade.generate(input_ids=ids, attention_mask=mask, **{**kw, "num_beams": 4},
                                        hf_cascade_config=config), expected)
    assert spy.runners[-1].first_steps == 1
    out = cascade.generate(input_ids=ids, attention_mask=mask, **kw, hf_cascade_config=config,
                           return_dict_in_generate=True)
    assert cascade not in session._kept and spy.runners[-1].whole_step_kept is None   # the handed-out cache's step dropped
    # other settings: a new cache
    cascade.generate(input_ids=ids, attention_mask=mask, **kw, hf_cascade_config=CascadeConfig(cuda_graphs="eager"))
    assert session._kept[cascade].cache.cascade_config == CascadeConfig(cuda_graphs="eager")
    hf_cascade.release(cascade)
    assert cascade not in session._kept
    cascade.generate(input_ids=ids, attention_mask=mask, **kw, hf_cascade_config=config)
    assert cascade in session._kept
    hf_cascade.release()                                 # every model's
    assert not session._kept


# an evaluation loop's prompt lengths, in its order (block size 4: 2 to 10 blocks each)
EVAL_LENGTHS = (36, 9, 27, 14, 40, 6, 21, 31)
# eval_loop_gpu.py's lengths / 10, in its order: 15 to 100 blocks, the longest prompt's whole tables 8 times as wide
# as the shortest's (its level tables 4 times)
WIDE_EVAL_LENGTHS = (360, 90, 270, 140, 400, 60, 210, 310)
# the same with a 30-token prompt, whose room on the 90-token prompt's kept layout (whose beams read it as rows of their
# own, as the 30's do) is 7 times its own 10 steps
TWO_WAY_EVAL_LENGTHS = (360, 90, 270, 140, 520, 30, 210, 310)


@pytest.mark.parametrize("case", ["beam", "beam, two ways to share", "greedy", "sample",
                                  "beam, min_new_tokens, 7x apart", "beam, two ways to share, min_new_tokens, 13x apart"])
def test_an_evaluation_loop_over_prompt_lengths_captures_once(llama_pair, monkeypatch, case):
    """Eight prompt lengths, twice over, on one model (pools of a fixed address: memory="static"): a step kept
    from a call serves every later one whose layout of the same rows and levels it holds: that layout hands the kept
    one its values (DecodeLayout.adopt) and the call's state takes the kept step's wider shapes (the sequence buffers,
    the block tables and pool). With a cascade threshold that only the longer prompts pass, the beams of the others
    read as rows of their own: the runner keeps a step for each way the rows share (KEPT_LAYOUTS). No call of the
    second pass captures; every call gives stock's tokens. ``min_new_tokens`` (transformers turns it into a
    ``min_length`` of each prompt's own) and lengths whose whole tables are more than ADOPT_SPAN apart share the kept
    step too (eval_loop_gpu.py's loop); there the first pass captures once per way to share and once where a prompt
    is longer than all before it: a shorter prompt's device pool follows its own steps, not the room of the kept
    layout it adopts, nor the pool a longer call grew."""
    stock, cascade = llama_pair
    wide = "x apart" in case
    # (a pool cap that no call's device pool meets: the pools follow the calls' needs)
    config = CascadeConfig(cuda_graphs="eager", memory="static", max_kv_bytes=2 ** (26 if wide else 22), block_size=4,
                           min_saved_tokens=(300 if wide else 60) if "two ways" in case else None)
    kw = {"greedy": dict(do_sample=False), "sample": dict(do_sample=True, num_return_sequences=3, top_k=0)}.get(
        case, dict(num_beams=4, early_stopping=False))
    kw.update(max_new_tokens=10, pad_token_id=0)
    lengths = EVAL_LENGTHS
    if "min_new_tokens" in case:
        kw.update(min_new_tokens=10)
        lengths = TWO_WAY_EVAL_LENGTHS if "two ways" in case else WIDE_EVAL_LENGTHS
    spy = RunnerSpy(monkeypatch)
    real_freeze = DecodeLayout.freeze.__func__
    shared = []          # whether each frozen layout has a group prefix

    def freeze(cls, *args, **kwargs):
        layout = real_freeze(cls, *args, **kwargs)
        shared.append(layout.group_rows.size > 0)
        return layout

    monkeypatch.setattr(DecodeLayout, "freeze", classmethod(freeze))
    first_steps = []
    for _ in range(2):
        for n in lengths:
            ids = torch.randint(3, 60, (1, n), generator=torch.Generator().manual_seed(n))
            torch.manual_seed(n)
            expected = stock.generate(input_ids=ids, **kw)
            torch.manual_seed(n)
            assert torch.equal(cascade.generate(input_ids=ids, **kw, hf_cascade_config=config), expected), n
            first_steps.append(spy.runners[-1].first_steps)
            for kept in spy.runners[-1].kept_steps:     # past its last call's max_length, a kept state holds the fill
                state = kept.state
                assert (state.sequences[:, state.config.max_length:] == device_select.fill_value(state.config)).all()
    assert len({id(r) for r in spy.runners}) == 1
    if "two ways" in case:
        assert len(set(shared)) == 2, shared
    cold, warm = first_steps[:len(lengths)], first_steps[len(lengths):]
    # the first pass captures where a prompt is longer than every one before that shares alike (a kept layout's
    # token limit is its call's) and where the pool's bucket grows; the second pass, never
    assert cold[0] == 1 and sum(cold) < len(lengths) - 2, first_steps
    assert warm == [0] * len(lengths), warm
    if wide and "two ways" in case:     # 360 (shared), 90 (read as rows of their own), 400 (longer): nothing else
        assert cold == [1, 1, 0, 0, 1, 0, 0, 0], cold


def test_a_wider_kept_step_holds_no_earlier_calls_tokens(llama_pair, monkeypatch):
    """A call moves into a kept step whose sequence buffers are wider than its own (a 600-token call into the step a
    1100-token call captured, after a short prompt's beams, read as rows of their own, captured theirs): past its own
    width the buffers hold the fill, not the longer call's tokens, and it gives stock's tokens."""
    stock, cascade = llama_pair
    config = CascadeConfig(cuda_graphs="eager", memory="static", max_kv_bytes=2 ** 26, block_size=4,
                           min_saved_tokens=300)
    kw = dict(num_beams=4, early_stopping=False, max_new_tokens=10, min_new_tokens=10, pad_token_id=0)
    spy = RunnerSpy(monkeypatch)
    for n in (1100, 90, 600):
        ids = torch.randint(3, 60, (1, n), generator=torch.Generator().manual_seed(n))
        assert torch.equal(cascade.generate(input_ids=ids, **kw, hf_cascade_config=config),
                           stock.generate(input_ids=ids, **kw)), n
    widths = [kept.state.sequences.shape[1] for kept in spy.runners[-1].kept_steps]
    assert spy.runners[-1].first_steps == 0 and max(widths) == 2048 and min(widths) <= 512, widths
    for kept in spy.runners[-1].kept_steps:
        state = kept.state
        assert (state.sequences[:, state.config.max_length:] == device_select.fill_value(state.config)).all()


def test_kept_steps_and_layouts_stay_bounded(llama_pair, monkeypatch):
    """Calls of many prompt lengths and ways to share keep at most KEPT_LAYOUTS layouts and captured steps, the
    latest first; a layout that is no longer kept holds no buffers (they are released, not leaked)."""
    from hf_cascade.kv.cache import KEPT_LAYOUTS
    stock, cascade = llama_pair
    config = CascadeConfig(cuda_graphs="eager", memory="static", max_kv_bytes=2 ** 22, block_size=4,
                           min_saved_tokens=60)
    spy = RunnerSpy(monkeypatch)
    seen = []
    real_freeze = DecodeLayout.freeze.__func__

    def freeze(cls, *args, **kwargs):
        layout = real_freeze(cls, *args, **kwargs)
        seen.append(layout)
        return layout

    monkeypatch.setattr(DecodeLayout, "freeze", classmethod(freeze))
    for n in (8, 50, 12, 70, 20, 90, 30, 110, 9, 41):
        ids = torch.randint(3, 60, (1, n), generator=torch.Generator().manual_seed(n))
        kw = dict(num_beams=4, max_new_tokens=6, pad_token_id=0, early_stopping=False)
        assert torch.equal(cascade.generate(input_ids=ids, **kw, hf_cascade_config=config),
                           stock.generate(input_ids=ids, **kw)), n
        runner, cache = spy.runners[-1], session._kept[cascade].cache
        assert len(runner.kept_steps) <= KEPT_LAYOUTS and len(cache._kept_layouts) <= KEPT_LAYOUTS
        kept = {id(layout) for layout in cache._kept_layouts}
        assert {k.step_key[1] for k in runner.kept_steps} <= {layout.serial for layout in cache._kept_layouts}
        for layout in seen:
            if id(layout) not in kept:
                assert not layout._buffers and not layout.metadata, "a layout no longer kept holds its buffers"
    assert len(seen) > KEPT_LAYOUTS


def test_the_graph_descriptor_decides_what_a_next_call_reuses(llama_pair):
    """Same model, config and rows: the kept graph replays; other rows: the kept pools serve, the graph is captured
    anew; another model (even of the same shape) or other settings: nothing is reused."""
    _, cascade = llama_pair
    twin = model_pair("llama")[1]
    config = CascadeConfig(cuda_graphs="eager")
    kept = session.GraphDescriptor.of(cascade, config, rows=6)
    assert kept == session.GraphDescriptor.of(cascade, CascadeConfig(cuda_graphs="eager"), rows=6)
    more_rows = session.GraphDescriptor.of(cascade, config, rows=8)
    assert kept != more_rows and kept.fits_pools(more_rows)
    for other in (session.GraphDescriptor.of(twin, config, rows=6),
                  session.GraphDescriptor.of(cascade, CascadeConfig(cuda_graphs="eager", block_size=4), rows=6)):
        assert other != kept and not kept.fits_pools(other)
    assert (kept.capture, kept.compile, kept.encoder_decoder) == (False, False, False)


def test_a_kept_graph_does_not_keep_its_model_alive():
    import gc
    import weakref
    _, cascade = model_pair("llama")
    ids, mask = padded_batch(seed=1)
    cascade.generate(input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=4, pad_token_id=0,
                     hf_cascade_config=CascadeConfig(cuda_graphs="eager"))
    assert cascade in session._kept
    ref = weakref.ref(cascade)
    del cascade
    gc.collect()
    assert ref() is None


def test_failed_step_restores_forward_and_next_generate_is_exact(llama_pair):
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=4)
    kw = dict(num_beams=3, max_new_tokens=6, pad_token_id=0)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw)

    class Boom(Exception):
        pass

    calls = []

    def stop(input_ids, scores, **_):
        calls.append(1)
        if len(calls) == 3:
            raise Boom()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    from transformers import StoppingCriteriaList
    config = CascadeConfig(cuda_graphs="eager")
    with pytest.raises(Boom):
        cascade.generate(input_ids=ids, attention_mask=mask, **kw, hf_cascade_config=config,
                         stopping_criteria=StoppingCriteriaList([stop]))
    assert "forward" not in cascade.__dict__
    assert torch.equal(cascade.generate(input_ids=ids, attention_mask=mask, **kw, hf_cascade_config=config), expected)


def test_graphs_refused_with_a_reason_where_they_cannot_apply():
    stock, cascade = model_pair("llama")
    def config(mode, **fields):
        return CascadeConfig(cuda_graphs=mode, **fields)

    assert "not CUDA" in graphs.unsupported_reason(cascade, config(None))
    _, windowed = model_pair("mistral", sliding_window=8)
    assert graphs.unsupported_reason(windowed, config("eager")) is None     # the kernels apply windows on the device
    moe = AutoModelForCausalLM.from_config(FAMILIES["GPT-OSS"].make(), experts_implementation="eager")
    assert "experts_implementation='eager'" in graphs.unsupported_reason(moe, config(True))
    assert graphs.unsupported_reason(moe, config("eager")) is None      # the eager form captures nothing
    moe = AutoModelForCausalLM.from_config(FAMILIES["GPT-OSS"].make(), experts_implementation="grouped_mm")
    assert "not CUDA" in graphs.unsupported_reason(moe, config(True))
    _, dynamic = model_pair("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "dynamic RoPE" in graphs.unsupported_reason(dynamic, config("eager"))
    import accelerate
    hooked = accelerate.cpu_offload(model_pair("llama")[1], execution_device=torch.device("cpu"))
    assert "accelerate hooks" in graphs.unsupported_reason(hooked, config("eager"))
    assert graphs.unsupported_reason(cascade, config(False)) == "CascadeConfig(cuda_graphs=False)"
    assert graphs.unsupported_reason(cascade, config("eager")) is None
    with pytest.raises(ValueError, match="cuda_graphs"):
        CascadeConfig(cuda_graphs="sometimes")


def test_both_caches_implement_the_static_step_interface():
    """CascadeCache and StaticSelfAttentionCache implement every member of hf_cascade.static_step.StaticStepCache,
    methods with its parameters (names and order), properties as properties."""
    import inspect

    from hf_cascade.cache import CascadeCache
    from hf_cascade.dense_cache import StaticSelfAttentionCache
    from hf_cascade.static_step import StaticStepCache

    members = [name for name in vars(StaticStepCache) if not name.startswith("_")]
    assert {"prepare_step", "begin_planned_step", "step", "layout", "rewind_step", "end_step"} <= set(members)
    for cls in (CascadeCache, StaticSelfAttentionCache):
        for name in members:
            declared, implemented = vars(StaticStepCache)[name], inspect.getattr_static(cls, name, None)
            assert implemented is not None, (cls.__name__, name)
            if isinstance(declared, property):
                assert isinstance(implemented, property), (cls.__name__, name)
                continue
            want = list(inspect.signature(declared).parameters)
            got = list(inspect.signature(implemented).parameters)
            assert got[:len(want)] == want, (cls.__name__, name, got)
