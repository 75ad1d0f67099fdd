"""What a generate call and a CascadeCache leave behind: a model that ran generate is freed when dropped; a dropped
cache frees its pools at once (no reference cycle, nothing kept per thread); a filled cache deep-copies into an
independent cache (transformers' prompt-reuse idiom) and pickles / ``torch.save`` s as a DynamicCache does."""
from __future__ import annotations

import copy
import gc
import io
import logging
import pickle
import weakref

import numpy as np
import pytest
import torch

import hf_cascade
from hf_cascade import CascadeCache, context, kernels, logs, session

from conftest import cache_kw, model_pair, padded_batch, returned_cache

CONFIGS = [pytest.param(None, id="default"), pytest.param(dict(cuda_graphs="eager"), id="runner")]


@pytest.fixture
def gc_off():
    """The cyclic collector off for the test: what is freed, is freed by reference counting, at once."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _pool_refs(cache):
    refs = [weakref.ref(layer.storage) for layer in cache.layers if layer.storage is not None]
    refs += [weakref.ref(layer.storage.tensor) for layer in cache.layers if layer.storage is not None]
    assert refs and all(r() is not None for r in refs)
    return refs


# ---- the model ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("kw", [dict(num_beams=3), dict(do_sample=True, top_k=1, num_return_sequences=2)],
                         ids=["beam", "sample"])
def test_a_model_that_ran_generate_is_freed(config, kw, monkeypatch, caplog):
    # backends load (and fail to load) inside this test's first call, as in a fresh process; its log records kept
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(kernels, "_logged", set())
    monkeypatch.setattr(logs, "_logged", set())
    caplog.set_level(logging.DEBUG, logger="hf_cascade")
    _, cascade = model_pair("llama")
    ids, mask = padded_batch(seed=2)
    cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, hf_cascade_config=config,
                     **kw)
    ref = weakref.ref(cascade)
    del cascade
    gc.collect()
    assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]


def test_a_failed_backend_load_holds_no_frames(monkeypatch):
    monkeypatch.setattr(kernels, "_loaded", {})
    with pytest.raises(ImportError, match="unavailable"):
        kernels.load("flashinfer")
    assert isinstance(kernels._loaded["flashinfer"], str)
    with pytest.raises(ImportError, match="unavailable") as raised:   # the reason again, chained to nothing
        kernels.load("flashinfer")
    assert raised.value.__cause__ is None


# ---- a dropped cache ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS)
def test_a_dropped_cache_frees_its_pools_at_once(config, llama_pair, gc_off):
    _, cascade = llama_pair
    ids, mask = padded_batch(seed=3)
    cache = CascadeCache(cascade.config, config)
    cascade.generate(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=5, pad_token_id=0,
                     **cache_kw(cascade, cache))
    assert cache.step is None and session.active(cache) is None    # a finished cache keeps no step of the call
    assert context.get_context() is None
    refs = _pool_refs(cache) + [weakref.ref(cache)]
    del cache
    assert all(r() is None for r in refs)


def test_a_cache_handed_out_by_generate_frees_its_pools_when_dropped(llama_pair, gc_off):
    _, cascade = llama_pair
    ids, mask = padded_batch(seed=4)
    out = cascade.generate(input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=4, pad_token_id=0,
                           return_dict_in_generate=True, hf_cascade_config=dict(cuda_graphs="eager"))
    refs = _pool_refs(returned_cache(out))
    del out
    assert all(r() is None for r in refs)


def test_a_cache_used_by_plain_forwards_frees_its_pools_when_dropped(llama_pair, gc_off):
    _, cascade = llama_pair
    ids, _ = padded_batch(seed=5, lengths=(12, 12))
    cache = CascadeCache(cascade.config)
    seen = []       # the step's context after a layer's attention ran: the cache holds it until the next step
    # (the per-thread channel of transformers < 5.24 holds it only weakly)
    hook = cascade.model.layers[0].self_attn.register_forward_hook(lambda *_: seen.append(cache.step))
    try:
        with torch.no_grad():
            cascade(input_ids=ids, use_cache=True, **cache_kw(cascade, cache))
            cascade(input_ids=ids[:, -1:], use_cache=True, **cache_kw(cascade, cache))
    finally:
        hook.remove()
    assert len(seen) == 2 and seen[-1] is cache.step is not None
    assert 0 in seen[-1].written and not seen[-1].unread        # layer 0's attention read what it stored
    del seen
    refs = _pool_refs(cache)
    del cache
    assert all(r() is None for r in refs)
    assert context.get_context() is None


# ---- copies ------------------------------------------------------------------------------------------------
def _prefix_and_questions(seed=6):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 90, (1, 37), generator=g)
    return prefix, [torch.randint(3, 90, (1, n), generator=g) for n in (3, 9, 1)]


def _snapshot(cache):
    return (cache.get_seq_length(), cache.blocks.tables().copy(), cache.blocks.lengths.copy(),
            # as bytes: blocks no row uses yet hold uninitialised memory, NaN patterns included
            [layer.storage.tensor.clone().view(torch.uint8) for layer in cache.layers], cache.stats())


def _same(a, b):
    assert a[0] == b[0] and np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2]) and a[4] == b[4]
    assert all(torch.equal(x, y) for x, y in zip(a[3], b[3]))


def test_deepcopy_is_independent(llama_pair):
    _, cascade = llama_pair
    prefix, _ = _prefix_and_questions()
    cache = CascadeCache(cascade.config)
    hf_cascade.prefill(cascade, cache, prefix.repeat(2, 1))
    cache.batch_repeat_interleave(2)                 # rows share blocks: reference counts above one
    with torch.no_grad():                            # a decode step (its context holds the kernel backend)
        cascade(input_ids=torch.full((4, 1), 5), use_cache=True, **cache_kw(cascade, cache))
    before = _snapshot(cache)
    twin = copy.deepcopy(cache)
    _same(_snapshot(twin), before)
    assert twin.blocks is not cache.blocks and all(t.cache is twin for t in twin.layers)
    for mine, theirs in zip(vars(cache.blocks).values(), vars(twin.blocks).values()):
        if isinstance(mine, np.ndarray) and mine.size:
            assert not np.shares_memory(mine, theirs)
    for mine, theirs in zip(cache.layers, twin.layers):
        assert mine.storage is not theirs.storage
        assert mine.storage.tensor.untyped_storage().data_ptr() != theirs.storage.tensor.untyped_storage().data_ptr()
    # the copy moves on (new tokens, a beam reorder, copy-on-write); the original stays as it was
    with torch.no_grad():
        cascade(input_ids=torch.full((4, 1), 7), use_cache=True, **cache_kw(cascade, twin))
    twin.reorder_cache(torch.tensor([1, 1, 3, 2]))
    with torch.no_grad():
        cascade(input_ids=torch.full((4, 1), 9), use_cache=True, **cache_kw(cascade, twin))
    _same(_snapshot(cache), before)
    cache.reset()
    assert twin.get_seq_length() == prefix.shape[1] + 3 and twin.stats().tokens_stored > 0


@pytest.mark.parametrize("kw", [dict(), dict(num_beams=3), dict(do_sample=True, top_k=1, num_return_sequences=2)],
                         ids=["greedy", "beam", "sample"])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("chunks", [1, 2])
def test_prompt_reuse_by_deepcopy_gives_stock_tokens(kw, config, chunks, llama_pair):
    """transformers' "Re-use cache to continue generation": prefill a common prefix once (in one or two chunks:
    the second attends to the first through the cascade), deep-copy the cache per question, continue each copy.
    Stock runs the same with a DynamicCache (greedy; its 1-row cache cannot meet beams) and without any (every
    mode); the original cache is unchanged."""
    from transformers import DynamicCache
    stock, cascade = llama_pair
    prefix, questions = _prefix_and_questions()
    dynamic = DynamicCache()
    cache = CascadeCache(cascade.config, config)
    for part in prefix.tensor_split(chunks, dim=1):
        with torch.no_grad():
            stock(input_ids=part, use_cache=True, **cache_kw(stock, dynamic))
        hf_cascade.prefill(cascade, cache, part)
    before = _snapshot(cache)
    gen = dict(max_new_tokens=6, pad_token_id=0, **kw)
    for question in questions:
        full = torch.cat([prefix, question], 1)
        expected = stock.generate(input_ids=full, **gen)
        if not kw:
            assert torch.equal(stock.generate(input_ids=full, **cache_kw(stock, copy.deepcopy(dynamic)), **gen),
                               expected)
        got = cascade.generate(input_ids=full, **cache_kw(cascade, copy.deepcopy(cache)), **gen)
        assert torch.equal(got, expected)
    _same(_snapshot(cache), before)


def _round_trips():
    def by_pickle(cache):
        return pickle.loads(pickle.dumps(cache))

    def by_torch_save(cache):
        buffer = io.BytesIO()
        torch.save(cache, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    return [pytest.param(copy.deepcopy, id="deepcopy"), pytest.param(by_pickle, id="pickle"),
            pytest.param(by_torch_save, id="torch.save")]


@pytest.mark.parametrize("round_trip", _round_trips())
def test_a_filled_cache_round_trips_and_continues(round_trip, llama_pair):
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=8)
    kw = dict(max_new_tokens=5, pad_token_id=0)
    cache = CascadeCache(cascade.config, dict(cuda_graphs="eager"))
    first = cascade.generate(input_ids=ids, attention_mask=mask, **cache_kw(cascade, cache), **kw)
    back = round_trip(cache)
    assert type(back) is CascadeCache and back.get_seq_length() == cache.get_seq_length()
    assert back.step is None and back.layout is None and session.active(back) is None
    assert all(layer.cache is back for layer in back.layers)
    _same(_snapshot(back), _snapshot(cache))
    # the next turn from the copy: stock's tokens for the whole conversation
    turn = torch.cat([first, torch.full((first.shape[0], 2), 5)], 1)
    turn_mask = torch.cat([mask, torch.ones(first.shape[0], turn.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    expected = stock.generate(input_ids=turn, attention_mask=turn_mask, num_beams=2, **kw)
    got = cascade.generate(input_ids=turn, attention_mask=turn_mask, num_beams=2, **cache_kw(cascade, back), **kw)
    assert torch.equal(got, expected)


def test_copies_of_a_beam_filled_cache_still_refuse_to_continue(llama_pair):
    _, cascade = llama_pair
    ids, mask = padded_batch(seed=9)
    cache = CascadeCache(cascade.config)
    out = cascade.generate(input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=3, pad_token_id=0,
                           **cache_kw(cascade, cache))
    more = torch.cat([out, torch.full((out.shape[0], 1), 5)], 1)
    more_mask = torch.cat([mask, torch.ones(out.shape[0], more.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    for twin in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        with pytest.raises(ValueError, match="filled by beam search"):
            cascade.generate(input_ids=more, attention_mask=more_mask, max_new_tokens=2, pad_token_id=0,
                             **cache_kw(cascade, twin))


def test_deepcopy_during_a_call_drops_the_call_state(llama_pair):
    """A copy taken mid-call (a stopping criterion's) copies the tokens, not the step context, layout or runner."""
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=10)
    kw = dict(num_beams=3, max_new_tokens=6, pad_token_id=0)
    cache = CascadeCache(cascade.config, dict(cuda_graphs="eager"))
    copies = []

    def stop(input_ids, scores, **_):
        if input_ids.shape[1] == ids.shape[1] + 3:
            assert session.active(cache).runner is not None and cache.layout is not None
            copies.append(copy.deepcopy(cache))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    got = cascade.generate(input_ids=ids, attention_mask=mask, stopping_criteria=[stop], **cache_kw(cascade, cache),
                           **kw)
    assert torch.equal(got, stock.generate(input_ids=ids, attention_mask=mask, **kw))
    (twin,) = copies
    assert twin.step is None and twin.layout is None and session.active(twin) is None
    assert twin.get_seq_length() == ids.shape[1] + 2 and twin.batch_size == 6


@pytest.mark.gpu
@pytest.mark.parametrize("memory", ["vmm", "static"])
def test_gpu_pools_copy_and_pickle(memory):
    """A VMM pool comes back as a plain "grow" pool holding the same blocks; a static one as it was."""
    from hf_cascade.memory import GrowStorage, StaticStorage
    stock, cascade = model_pair("llama", dtype=torch.float32)
    stock, cascade = stock.cuda(), cascade.cuda()
    ids, mask = (t.cuda() for t in padded_batch(seed=11))
    kw = dict(max_new_tokens=4, pad_token_id=0)
    cache = CascadeCache(cascade.config, dict(memory=memory, max_kv_bytes=1 << 22))
    first = cascade.generate(input_ids=ids, attention_mask=mask, **cache_kw(cascade, cache), **kw)
    turn = torch.cat([first, torch.full((first.shape[0], 2), 5, device="cuda")], 1)
    turn_mask = torch.cat([mask, mask.new_ones(first.shape[0], turn.shape[1] - mask.shape[1])], 1)
    expected = cascade.generate(input_ids=turn, attention_mask=turn_mask, **cache_kw(cascade, copy.deepcopy(cache)),
                                **kw)
    for twin in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        kind = GrowStorage if memory == "vmm" else StaticStorage
        assert all(type(layer.storage) is kind for layer in twin.layers)
        _same(_snapshot(twin), _snapshot(cache))
        got = cascade.generate(input_ids=turn, attention_mask=turn_mask, **cache_kw(cascade, twin), **kw)
        assert torch.equal(got, expected)
