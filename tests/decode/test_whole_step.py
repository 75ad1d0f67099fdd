"""The decode loop with the whole step on the device (hf_cascade/decode/whole_step.py) against stock transformers.

On the CPU the loop runs with ``cuda_graphs="eager"``: the same step (device block bookkeeping, the forward on the
static layout's buffers, device token choice) that a GPU captures, run eagerly. Every test checks that the device
steps really ran (``runner.device_steps``), so a silent fallback to transformers' loop cannot pass for the loop.
"""
from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from hf_cascade import CascadeCache, device_select, whole_step
from hf_cascade.kv import cache as cache_module
from conftest import EOS, VOCAB, cache_kw, model_pair, padded_batch

import test_families

EAGER = dict(cuda_graphs="eager")


def _generate(model, ids, mask, config=EAGER, seed=123, **kwargs):
    torch.manual_seed(seed)
    extra = {} if config is None else dict(hf_cascade_config=config)
    return model.generate(input_ids=ids, attention_mask=mask, **extra, **kwargs)


def _device_steps(runner_spy) -> int:
    return sum(r.device_steps for r in runner_spy.runners if r is not None)


# ---- processors and criteria, on a tiny Llama in float64 ---------------------------------------------------------
SETTINGS = {
    "greedy": dict(do_sample=False),
    "greedy-eos": dict(do_sample=False, eos_token_id=EOS, pad_token_id=0),
    "greedy-penalties": dict(do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=5,
                             eos_token_id=EOS, pad_token_id=0),
    "sample": dict(do_sample=True, num_return_sequences=3),
    "sample-warpers": dict(do_sample=True, num_return_sequences=2, temperature=0.7, top_k=12, top_p=0.9,
                           eos_token_id=EOS, pad_token_id=0),
    "sample-min-p": dict(do_sample=True, num_return_sequences=2, min_p=0.05, repetition_penalty=1.2),
    "beam": dict(num_beams=4),
    "beam-returned": dict(num_beams=4, num_return_sequences=3, eos_token_id=EOS, pad_token_id=0),
    "beam-length-penalty": dict(num_beams=3, length_penalty=2.0, no_repeat_ngram_size=3, min_length=12,
                                eos_token_id=EOS, pad_token_id=0),
    "beam-early-stopping": dict(num_beams=4, early_stopping=True, length_penalty=0.5, eos_token_id=EOS,
                                pad_token_id=0),
    "beam-never": dict(num_beams=3, early_stopping="never", eos_token_id=EOS, pad_token_id=0),
    "beam-sample": dict(num_beams=3, do_sample=True, top_k=20, eos_token_id=EOS, pad_token_id=0),
    # stock prefills in chunks, and so does hf_cascade's prefill (test_prefill_chunk_size_prefills_in_chunks...)
    "greedy-prefill-chunks": dict(do_sample=False, prefill_chunk_size=6),
    "beam-prefill-chunks": dict(num_beams=3, prefill_chunk_size=6, eos_token_id=EOS, pad_token_id=0),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_settings_equal_stock(name, eos_llama, runner_spy):
    stock, cascade = eos_llama
    ids, mask = padded_batch(seed=5, lengths=(23, 17))
    kwargs = dict(max_new_tokens=40, **SETTINGS[name])
    expected = _generate(stock, ids, mask, config=None, **kwargs)
    got = _generate(cascade, ids, mask, **kwargs)
    assert _device_steps(runner_spy) > 0
    assert expected.shape == got.shape and torch.equal(expected, got), name


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("shared", [False, True], ids=["own-prompts", "shared-start"])
def test_prefill_chunk_size_prefills_in_chunks_with_stock_tokens(family, shared, monkeypatch, runner_spy):
    """generate's prefill_chunk_size: the prompts' prefill forwards see at most that many positions each (Mistral's
    sliding window: one forward, unchunked), and the tokens are stock's (which prefills in chunks too)."""
    from hf_cascade import generation
    stock, cascade = model_pair(family)
    ids, mask = padded_batch(seed=6, lengths=(30, 19))
    if shared:                                   # both prompts begin with the same 16 tokens
        ids[1, 11:27] = ids[0, :16]
    seen = []
    real = generation.prefill_forward
    monkeypatch.setattr(generation, "prefill_forward",
                        lambda model, **kw: seen.append(kw["input_ids"].shape[1]) or real(model, **kw))
    kwargs = dict(max_new_tokens=10, num_beams=3, prefill_chunk_size=7, pad_token_id=0)
    expected = _generate(stock, ids, mask, config=None, **kwargs)
    assert torch.equal(_generate(cascade, ids, mask, **kwargs), expected)
    assert _device_steps(runner_spy) > 0
    # (the prompt's last position is the first decode step's)
    assert seen == ([29] if family == "mistral" else [7, 7, 7, 7, 1]), seen


def test_layout_widens_on_the_host_between_device_chunks(llama_pair, runner_spy, caplog):
    """Past the first layout's room (64 new tokens) the host takes the block state back, widens the layout, and the
    device goes on: 150 new tokens cross two widenings."""
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=2)
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        got = _generate(cascade, ids, mask, max_new_tokens=150, num_beams=3)
    assert torch.equal(_generate(stock, ids, mask, config=None, max_new_tokens=150, num_beams=3), got)
    assert sum("decode layout widened" in r.getMessage() for r in caplog.records) >= 2
    assert _device_steps(runner_spy) > 140


@pytest.mark.parametrize("name", ["greedy", "sample", "beam"])
def test_only_steps_that_can_copy_blocks_launch_the_copies(name, llama_pair, runner_spy, monkeypatch):
    """The device's steps launch the copy-on-write copies only where a row can append to a block another row holds:
    beam search (the rows follow new parents every step). Greedy and sampling rows hold their blocks alone from the
    first decode step on (a prompt's part-filled last block, shared by its samples, is copied there, on the host):
    their steps launch none, and give stock's tokens (prompts of 10-17 tokens: part-filled last blocks)."""
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=4)
    planned, writes = [], []
    real_begin, real_write = CascadeCache.begin_planned_step, cache_module._write_slots

    def begin(self, device, copies=True):
        planned.append(copies)
        return real_begin(self, device, copies)

    def write(*args):
        writes.append(args[-1])
        return real_write(*args)

    monkeypatch.setattr(CascadeCache, "begin_planned_step", begin)
    monkeypatch.setattr(cache_module, "_write_slots", write)
    kwargs = dict(SETTINGS[name], max_new_tokens=12)
    assert torch.equal(_generate(cascade, ids, mask, **kwargs), _generate(stock, ids, mask, config=None, **kwargs))
    assert _device_steps(runner_spy) >= 10 and len(planned) >= 10
    assert set(planned) == {name == "beam"}
    if name != "beam":      # (no device step's layer wrote with copies; the host's first decode step may)
        assert writes.count(False) >= len(planned) * len(cascade.model.layers)


def _stored_tokens(cache) -> list[torch.Tensor]:
    """Each layer's K/V of every row's tokens, ``[tokens of all rows, 2, Hkv, D]``, read through the block tables: what
    a later step reads (slots no row holds are left out: their bytes are whatever the pool held)."""
    tables, lengths, bs = cache.blocks.tables(), cache.blocks.lengths, cache.block_size
    t = [np.arange(int(n)) for n in lengths]
    blocks = torch.from_numpy(np.concatenate([tables[row, tokens // bs] for row, tokens in enumerate(t)])).long()
    offsets = torch.from_numpy(np.concatenate([tokens % bs for tokens in t])).long()
    return [layer.storage.tensor[blocks, :, offsets] for layer in cache.layers]


def _call_with_layer_copies(cascade, ids, mask, kwargs, monkeypatch, on: bool):
    """A call on a cache of its own with the all-layer copy's CPU form on or off: (tokens, the cache)."""
    monkeypatch.setattr(cache_module, "cpu_layer_copies", on)
    cache = CascadeCache(cascade.config, EAGER)
    return _generate(cascade, ids, mask, config=None, **kwargs, **cache_kw(cascade, cache)), cache


@pytest.mark.parametrize("name", ["beam", "beam-returned", "beam-sample"])
def test_beam_steps_copy_every_layer_at_once_with_stock_tokens(name, eos_llama, runner_spy, monkeypatch):
    """With the all-layer copy on (its CPU form, cache_module.cpu_layer_copies, as cuda_library.layer_copies on a GPU),
    each static step of a beam call copies its copy-on-write blocks in every layer's pool once as it begins, and no
    layer's write of such a step copies: the tokens are stock's, and after each call (two prompt batches) every layer
    stores the K/V of the per-layer copies' call byte for byte."""
    stock, cascade = eos_llama
    planned, copied, writes = [], [], []
    real_begin, real_copy, real_write = (CascadeCache.begin_planned_step, cache_module._copy_blocks_torch,
                                         cache_module._write_slots)

    def begin(self, device, copies=True):
        ctx = real_begin(self, device, copies)
        planned.append(ctx.plan.copies)
        return ctx

    def copy_blocks(pool, src, dst):
        copied.append(pool.data_ptr())
        return real_copy(pool, src, dst)

    def write(*args):
        writes.append(args[-1])
        return real_write(*args)

    monkeypatch.setattr(CascadeCache, "begin_planned_step", begin)
    monkeypatch.setattr(cache_module, "_copy_blocks_torch", copy_blocks)
    monkeypatch.setattr(cache_module, "_write_slots", write)
    kwargs = dict(SETTINGS[name], max_new_tokens=24)
    layers = len(cascade.model.layers)
    for seed, lengths in ((4, (23, 17)), (6, (9, 30, 14))):
        ids, mask = padded_batch(seed=seed, lengths=lengths)
        per_layer, per_layer_cache = _call_with_layer_copies(cascade, ids, mask, kwargs, monkeypatch, on=False)
        assert not copied and set(planned) == {True}
        del planned[:], writes[:]
        steps = _device_steps(runner_spy)
        got, cache = _call_with_layer_copies(cascade, ids, mask, kwargs, monkeypatch, on=True)
        assert _device_steps(runner_spy) - steps >= 10 and len(planned) >= 10
        assert set(planned) == {False}                       # every device step's copies were made as it began
        assert len(copied) % layers == 0 and len(copied) >= len(planned) * layers
        assert {layer.storage.tensor.data_ptr() for layer in cache.layers} <= set(copied)   # (grow pools move)
        assert writes.count(False) >= len(planned) * layers
        assert torch.equal(got, per_layer)
        assert torch.equal(got, _generate(stock, ids, mask, config=None, **kwargs))
        for mine, theirs in zip(_stored_tokens(cache), _stored_tokens(per_layer_cache), strict=True):
            assert torch.equal(mine, theirs)
        del planned[:], copied[:], writes[:]


def test_a_skipped_all_layer_copy_is_seen(eos_llama, runner_spy, monkeypatch):
    """The comparison above sees a copy that does not happen: with the all-layer copy on but copying nothing (the
    layers' writes skip theirs all the same), the rows' copy-on-write blocks lack their earlier tokens, and the stored
    K/V differ from the per-layer copies'."""
    _, cascade = eos_llama
    ids, mask = padded_batch(seed=4)
    kwargs = dict(SETTINGS["beam"], max_new_tokens=24)
    _, per_layer = _call_with_layer_copies(cascade, ids, mask, kwargs, monkeypatch, on=False)
    monkeypatch.setattr(cache_module, "_copy_blocks_torch", lambda pool, src, dst: None)
    _, skipped = _call_with_layer_copies(cascade, ids, mask, kwargs, monkeypatch, on=True)
    assert _device_steps(runner_spy) >= 10
    assert not all(torch.equal(a, b) for a, b in zip(_stored_tokens(skipped), _stored_tokens(per_layer)))


def test_the_all_layer_copy_follows_pools_that_move(llama_pair, monkeypatch):
    """The all-layer copy's address tensor (what a captured step reads by address) is made once per device and, where a
    pool moves (a grow pool that grows), rewritten in place at the next point where pools are made ready
    (follow_pool_addresses: a host step's begin, a device hold), never inside a capture, where a stale one is not
    used (the layers copy their own blocks then). Pools of two block sizes, or a layer without a pool, take no
    all-layer copy."""
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=4)
    cache = CascadeCache(cascade.config, dict(EAGER, memory="grow"))
    _generate(cascade, ids, mask, config=None, max_new_tokens=4, num_beams=2, **cache_kw(cascade, cache))
    cpu = torch.device("cpu")
    addresses = cache._pool_addresses_on(cpu)
    assert addresses.tolist() == [layer.storage.tensor.data_ptr() for layer in cache.layers]
    assert cache._pool_addresses_on(cpu) is addresses                   # made once
    storage = cache.layers[1].storage
    storage.ensure(2 * storage.num_blocks)                              # the pool grows: a new tensor
    assert addresses[1] != storage.tensor.data_ptr()
    monkeypatch.setattr(cache_module, "capture_underway", lambda: True)
    assert cache._pool_addresses_on(cpu) is None                        # stale, and no upload inside a capture
    cache.follow_pool_addresses()
    assert addresses[1] != storage.tensor.data_ptr()
    monkeypatch.setattr(cache_module, "capture_underway", lambda: False)
    cache.follow_pool_addresses()
    assert addresses.tolist() == [layer.storage.tensor.data_ptr() for layer in cache.layers]
    assert cache._pool_addresses_on(cpu) is addresses                   # in place: the same tensor
    # which steps take the all-layer copy
    monkeypatch.setattr(cache_module, "cpu_layer_copies", True)
    cache.begin_decode(cache.logical_length + 8)
    cache.prepare_step(cache.blocks.num_rows)
    plan = cache.plan
    assert plan.static and not plan.copies                              # copied as the step began
    plan.copies = True
    monkeypatch.setattr(storage, "block_nbytes", storage.block_nbytes // 2)
    assert not cache._copy_blocks_of_all_layers(plan)                   # two block sizes
    monkeypatch.undo()
    monkeypatch.setattr(cache_module, "cpu_layer_copies", True)
    assert cache._copy_blocks_of_all_layers(plan)
    monkeypatch.setattr(cache.layers[0], "is_initialized", False)
    assert not cache._copy_blocks_of_all_layers(plan)                   # a layer without its pool
    monkeypatch.setattr(cache_module, "cpu_layer_copies", False)
    monkeypatch.setattr(cache.layers[0], "is_initialized", True)
    assert not cache._copy_blocks_of_all_layers(plan)                   # off


def test_shared_system_prompt_three_levels(llama_pair, runner_spy):
    """Prompts that share a system prompt and then their own text: the layout has a middle level."""
    stock, cascade = llama_pair
    g = torch.Generator().manual_seed(9)
    system = torch.randint(4, VOCAB, (40,), generator=g)
    ids = torch.stack([torch.cat([system, torch.randint(4, VOCAB, (20,), generator=g)]) for _ in range(3)])
    mask = torch.ones_like(ids)
    kwargs = dict(max_new_tokens=30, num_beams=3)
    assert torch.equal(_generate(stock, ids, mask, config=None, **kwargs), _generate(cascade, ids, mask, **kwargs))
    assert _device_steps(runner_spy) > 0


def test_caller_cache_continues_after_device_steps(llama_pair, runner_spy):
    """The host takes the block state back at the end: a greedy call's cache holds what stock's does and the next
    turn continues from it with stock's tokens."""
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=4)
    cache = CascadeCache(cascade.config, EAGER)
    first = _generate(cascade, ids, mask, config=None, max_new_tokens=20, **cache_kw(cascade, cache))
    assert _device_steps(runner_spy) > 0
    assert torch.equal(first, _generate(stock, ids, mask, config=None, max_new_tokens=20))
    assert cache.get_seq_length() == first.shape[1] - 1          # the last token is never fed, as in stock
    more = torch.randint(4, VOCAB, (first.shape[0], 3), generator=torch.Generator().manual_seed(1))
    ids2 = torch.cat([first, more], dim=1)
    mask2 = torch.cat([mask, torch.ones(mask.shape[0], 20 + 3, dtype=mask.dtype)], dim=1)
    got = _generate(cascade, ids2, mask2, config=None, max_new_tokens=10, **cache_kw(cascade, cache))
    assert torch.equal(got, _generate(stock, ids2, mask2, config=None, max_new_tokens=10))


class _BanToken(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores.index_fill(1, torch.tensor([7]), float("-inf"))


@pytest.mark.parametrize("kind", ["processor", "return_dict", "streamer"])
def test_token_choice_the_device_does_not_reproduce_runs_the_loop_on_the_host(kind, llama_pair, runner_spy, caplog,
                                                                              monkeypatch):
    """A processor of the user's own, return_dict_in_generate, a streamer: the loop runs, its token choice on the host
    (hf_cascade.host_select; tests/decode/test_host_select.py compares whole outputs), the reason logged once."""
    from hf_cascade import logs
    from transformers.generation.streamers import BaseStreamer

    class Quiet(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            pass

    monkeypatch.setattr(logs, "_logged", set())        # the reason is logged once per process: see this call's
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=6)
    kwargs = dict(max_new_tokens=12, num_beams=3)
    if kind == "processor":
        kwargs["logits_processor"] = LogitsProcessorList([_BanToken()])
    elif kind == "return_dict":
        kwargs["return_dict_in_generate"] = True
    else:
        ids, mask, kwargs = ids[:1], mask[:1], dict(max_new_tokens=12, streamer=Quiet())
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        got = _generate(cascade, ids, mask, **kwargs)
    expected = _generate(stock, ids, mask, config=None, **kwargs)
    if kind == "return_dict":
        got, expected = got.sequences, expected.sequences
    assert torch.equal(expected, got)
    assert _device_steps(runner_spy) > 0
    assert any("token choice on the host" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kind", ["pre", "forward"])
def test_hooks_on_the_model_run_around_every_step(llama_pair, runner_spy, caplog, monkeypatch, kind):
    """Forward hooks on the model run around every decode step's forward, as in stock's loop: the whole step serves
    the call with its steps eager, each through ``model.__call__`` (a captured step would not run them); the hooks see
    as many forwards as stock's, and a forward hook that changes the logits changes the tokens as in stock's."""
    from hf_cascade import logs
    monkeypatch.setattr(logs, "_logged", set())
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=6)
    kwargs = dict(max_new_tokens=12, num_beams=3)

    def run(model):
        calls = []
        if kind == "pre":
            handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
        else:       # (a hook that returns a new output: the step's logits, halved)
            def halve(module, args, out):
                calls.append(1)
                out.logits = out.logits * 0.5
                return out
            handle = model.register_forward_hook(halve)
        try:
            with caplog.at_level(logging.INFO, logger="hf_cascade"):
                return _generate(model, ids, mask, config=None if model is stock else EAGER, **kwargs), calls
        finally:
            handle.remove()

    expected, stock_calls = run(stock)
    got, calls = run(cascade)
    assert torch.equal(expected, got)
    assert _device_steps(runner_spy) > 0 and len(calls) == len(stock_calls)
    assert all(r.captures == 0 and r.through_call for r in runner_spy.runners if r is not None)
    assert any("forward hooks on the model" in r.getMessage() for r in caplog.records)


class _SeesForward:
    """A stopping criterion that records, at every step, whether ``model.forward`` is replaced (never stops)."""

    def __init__(self, model):
        self.model, self.seen = model, []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append("forward" in self.model.__dict__)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize("loop", ["whole-step", "transformers-loop"])
def test_model_forward_is_never_replaced(loop, llama_pair, runner_spy, caplog, monkeypatch):
    """``model.forward`` stays the model's own through every call: the whole step calls its runner itself, and
    transformers' loop (here: graphs off) runs the model's own eager forwards with no runner inside; the mode is said
    once."""
    from transformers import StoppingCriteriaList
    from hf_cascade import logs
    monkeypatch.setattr(logs, "_logged", set())
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=8)
    seen = _SeesForward(cascade)
    kwargs = dict(max_new_tokens=6, num_beams=2)
    config = EAGER if loop == "whole-step" else dict(cuda_graphs=False)
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        got = _generate(cascade, ids, mask, config=config, stopping_criteria=StoppingCriteriaList([seen]), **kwargs)
    assert torch.equal(got, _generate(stock, ids, mask, config=None, **kwargs))
    assert len(seen.seen) >= 5 and not any(seen.seen)
    assert "forward" not in cascade.__dict__
    assert (_device_steps(runner_spy) > 0) == (loop == "whole-step")
    said = [r.getMessage() for r in caplog.records if "decode" in r.getMessage()]
    if loop == "whole-step":
        assert any("the whole step, eager, token choice on the host" in m for m in said), said
    else:
        assert any("stays transformers' (eager forwards): CascadeConfig(cuda_graphs=False)" in m for m in said), said


def test_interrupt_leaves_model_and_cache_usable(llama_pair, runner_spy, monkeypatch):
    """Ctrl-C in a device step: the model's forward is restored and the caller's cache is empty and reusable."""
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=7)
    real, calls = device_select.step, []

    def interrupted(state, logits):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(state, logits)

    monkeypatch.setattr(device_select, "step", interrupted)
    cache = CascadeCache(cascade.config, EAGER)
    with pytest.raises(KeyboardInterrupt):
        _generate(cascade, ids, mask, config=None, max_new_tokens=20, num_beams=2, **cache_kw(cascade, cache))
    monkeypatch.setattr(device_select, "step", real)
    assert "forward" not in cascade.__dict__
    assert cache.get_seq_length() == 0 and cache.blocks.num_rows == 0
    got = _generate(cascade, ids, mask, config=None, max_new_tokens=20, num_beams=2, **cache_kw(cascade, cache))
    assert torch.equal(got, _generate(stock, ids, mask, config=None, max_new_tokens=20, num_beams=2))


def test_finished_call_wastes_no_cache_tokens(eos_llama, runner_spy, monkeypatch):
    """Steps queued after every row finished change nothing: with checks every 16 steps, a greedy call whose rows
    all end early leaves the cache at stock's length."""
    monkeypatch.setattr(whole_step, "CHECK_EVERY", 16)
    stock, cascade = eos_llama
    ids, mask = padded_batch(seed=5)
    kwargs = dict(max_new_tokens=60, eos_token_id=EOS, pad_token_id=0)
    cache = CascadeCache(cascade.config, EAGER)
    got = _generate(cascade, ids, mask, config=None, **kwargs, **cache_kw(cascade, cache))
    expected = _generate(stock, ids, mask, config=None, **kwargs)
    assert torch.equal(expected, got)
    assert got.shape[1] < ids.shape[1] + 60            # the rows ended early (the test would prove nothing else)
    assert cache.get_seq_length() == got.shape[1] - 1
    assert int(cache.blocks.lengths.max()) == got.shape[1] - 1


EXACT = [name for name, family in test_families.FAMILIES.items() if family.status == "exact"]
# families whose decode forward takes an input the device loop does not advance: transformers' loop, logged
KEEPS_TRANSFORMERS_LOOP = {"GPT-2 (token types)": "token_type_ids"}


@pytest.mark.parametrize("name", EXACT)
@pytest.mark.parametrize("mode", ["beam", "sample"])
def test_families_equal_stock(name, mode, runner_spy):
    family = test_families.FAMILIES[name]
    if mode not in family.modes:
        pytest.skip(f"{name} does not run {mode}")
    stock, cascade = test_families.model_pair(name)
    ids, mask = padded_batch(seed=3, lengths=test_families.PROMPTS)
    expected = test_families.run(stock, mode, ids, mask, **family.extra)
    got = test_families.run(cascade, mode, ids, mask, **family.extra, hf_cascade_config=copy.deepcopy(EAGER))
    assert torch.equal(expected, got), f"{name} {mode}"
    if not any(r is not None for r in runner_spy.runners):
        pytest.skip(f"{name}: the graph runner does not serve this family (its reason is logged)")
    if name in KEEPS_TRANSFORMERS_LOOP:
        assert _device_steps(runner_spy) == 0      # (the reason is logged once per process)
    else:
        assert _device_steps(runner_spy) > 0, f"{name} {mode}: the device loop did not run"


def test_a_second_call_of_the_same_shape_reuses_the_kept_step(llama_pair, runner_spy):
    """The step's tensors (and on a GPU its graph) are kept with the cache for the model's next call of the same
    shape; that call fills them with its own values and gives its own tokens. Another prompt width of the same
    bucketed shapes (plan.shape_bucket) is the same shape; another batch shape starts afresh."""
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=8)
    kw = dict(max_new_tokens=20, num_beams=3)
    config = EAGER       # (a grow pool on the CPU moves between calls, so the block state is made anew; the GPU's
                         # vmm pools stay: tests/decode/test_gpu_whole_step.py checks that a second call captures nothing)
    first = _generate(cascade, ids, mask, config=config, **kw)
    kept = runner_spy.runners[-1].whole_step_kept
    assert kept is not None and kept.held_tensors is not None
    sequences = kept.state.sequences
    other_ids = torch.randint(4, VOCAB, ids.shape, generator=torch.Generator().manual_seed(3)).masked_fill(mask == 0, 0)
    second = _generate(cascade, other_ids, mask, config=config, **kw)
    assert runner_spy.runners[-1].whole_step_kept is kept                  # same tensors, same step key
    assert kept.state.sequences is sequences
    assert torch.equal(first, _generate(stock, ids, mask, config=None, **kw))
    assert torch.equal(second, _generate(stock, other_ids, mask, config=None, **kw))
    third = _generate(cascade, ids[:, 2:], mask[:, 2:], config=config, **kw)    # another prompt width: same buckets
    assert runner_spy.runners[-1].whole_step_kept is kept
    assert torch.equal(third, _generate(stock, ids[:, 2:], mask[:, 2:], config=None, **kw))
    _generate(cascade, ids, mask, config=config, max_new_tokens=20, num_beams=2)   # another batch shape: new tensors
    assert runner_spy.runners[-1].whole_step_kept is not kept
