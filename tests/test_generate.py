"""Token-exact equality of cascade generate with stock sdpa (float64) on tiny random models."""
from __future__ import annotations

import pytest
import torch

from conftest import FirstForwardRows, cache_kw, model_pair, padded_batch, returned_cache

FAMILIES = ["llama", "mistral", "qwen2"]
NEW = 10


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    return model_pair(request.param)


def _eos_seen_early(sequences, prompt_len, eos):
    generated = sequences[:, prompt_len:]
    return bool((generated[:, :-1] == eos).any())


def _pick_eos(stock, ids, mask, **kw):
    """A token stock actually generates a few steps in, so that eos is reached early."""
    out = stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, **kw)
    return int(out[0, ids.shape[1] + 2])


@pytest.mark.parametrize("beams,returned", [(2, 1), (4, 2), (8, 8)])
@pytest.mark.parametrize("with_eos", [False, True])
def test_beam_search_matches_stock(pair, beams, returned, with_eos):
    stock, cascade = pair
    ids, mask = padded_batch(seed=beams)
    kw = dict(num_beams=beams, num_return_sequences=returned, max_new_tokens=NEW, pad_token_id=0,
              length_penalty=0.7, early_stopping=True)
    eos = _pick_eos(stock, ids, mask, num_beams=beams) if with_eos else None
    expected = stock.generate(input_ids=ids, attention_mask=mask, eos_token_id=eos, **kw)
    got = cascade.generate(input_ids=ids, attention_mask=mask, eos_token_id=eos, **kw)
    if with_eos:
        assert _eos_seen_early(expected, ids.shape[1], eos), "test setup: eos should end some beam early"
    assert torch.equal(expected, got)


@pytest.mark.parametrize("early_stopping", [False, "never"])
def test_beam_search_early_stopping_modes(llama_pair, early_stopping):
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=7)
    eos = _pick_eos(stock, ids, mask, num_beams=3)
    kw = dict(num_beams=3, num_return_sequences=3, max_new_tokens=NEW, pad_token_id=0, eos_token_id=eos,
              early_stopping=early_stopping, length_penalty=1.3)
    assert torch.equal(stock.generate(input_ids=ids, attention_mask=mask, **kw),
                       cascade.generate(input_ids=ids, attention_mask=mask, **kw))


@pytest.mark.parametrize("with_eos", [False, True])
def test_sampling_matches_stock(pair, with_eos):
    stock, cascade = pair
    ids, mask = padded_batch(seed=11)
    eos = _pick_eos(stock, ids, mask) if with_eos else None
    kw = dict(do_sample=True, num_return_sequences=3, max_new_tokens=NEW, pad_token_id=0, eos_token_id=eos,
              top_k=0, temperature=1.5)
    torch.manual_seed(123)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    torch.manual_seed(123)
    got = cascade.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(expected, got)


def test_greedy_matches_stock(pair):
    stock, cascade = pair
    ids, mask = padded_batch(seed=5)
    kw = dict(max_new_tokens=NEW, pad_token_id=0)
    assert torch.equal(stock.generate(input_ids=ids, attention_mask=mask, **kw),
                       cascade.generate(input_ids=ids, attention_mask=mask, **kw))


def test_unpadded_batch_and_single_prompt(llama_pair):
    stock, cascade = llama_pair
    ids = torch.randint(3, 90, (2, 20), generator=torch.Generator().manual_seed(1))
    for batch in (ids, ids[:1]):
        kw = dict(num_beams=4, max_new_tokens=NEW, pad_token_id=0)
        assert torch.equal(stock.generate(input_ids=batch, **kw), cascade.generate(input_ids=batch, **kw))


def test_prompt_of_one_token(llama_pair):
    stock, cascade = llama_pair
    ids = torch.tensor([[5], [9]])
    kw = dict(num_beams=3, max_new_tokens=6, pad_token_id=0)
    assert torch.equal(stock.generate(input_ids=ids, **kw), cascade.generate(input_ids=ids, **kw))


def test_prompt_prefilled_once(llama_pair):
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=2)
    counters = FirstForwardRows(stock), FirstForwardRows(cascade)
    try:
        kw = dict(num_beams=4, max_new_tokens=3, pad_token_id=0)
        stock.generate(input_ids=ids, attention_mask=mask, **kw)
        cascade.generate(input_ids=ids, attention_mask=mask, **kw)
    finally:
        for c in counters:
            c.remove()
    stock_rows, cascade_rows = counters[0].rows, counters[1].rows
    assert stock_rows[0] == 2 * 4
    assert cascade_rows[0] == 2                     # one row per unique prompt
    assert cascade_rows[1:] == [2 * 4] * 3          # then last prompt token + 2 decode steps for all beams


def test_explicit_cache_is_used_and_returned(llama_pair):
    stock, cascade = llama_pair
    from hf_cascade import CascadeCache, CascadeConfig
    ids, mask = padded_batch(seed=4)
    cache = CascadeCache(cascade.config, CascadeConfig(block_size=4))
    kw = dict(num_beams=4, max_new_tokens=NEW, pad_token_id=0, return_dict_in_generate=True)
    out = cascade.generate(input_ids=ids, attention_mask=mask, **cache_kw(cascade, cache), **kw)
    assert returned_cache(out) is cache
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw).sequences
    assert torch.equal(out.sequences, expected)
    stats = cache.stats()
    assert stats.blocks_in_use > 0 and stats.tokens_stored < stats.tokens_logical
    cache.reset()
    assert cache.stats().blocks_in_use == 0 and cache.blocks.num_rows == 0


def test_generate_owned_cache_is_released(llama_pair):
    _, cascade = llama_pair
    ids, mask = padded_batch(seed=3)
    seen = FirstForwardRows(cascade)
    try:
        cascade.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=4, pad_token_id=0)
    finally:
        seen.remove()
    cache = seen.caches[0]
    assert type(cache).__name__ == "CascadeCache"
    stats = cache.stats()
    assert stats.blocks_in_use == 0 and stats.kv_bytes_reserved == 0 and cache.blocks.num_rows == 0
    assert cache.blocks.capacity > 0                 # it did hold blocks during generate


class _Boom(Exception):
    pass


def _exploding_criteria(after_calls):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Explode(StoppingCriteria):
        calls = 0

        def __call__(self, input_ids, scores, **kwargs):
            Explode.calls += 1
            if Explode.calls >= after_calls:
                raise _Boom()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    return StoppingCriteriaList([Explode()])


def test_blocks_released_after_exception(llama_pair):
    _, cascade = llama_pair
    from hf_cascade import CascadeCache
    ids, mask = padded_batch(seed=6)
    # a cache generate made for itself: released in generate's cleanup
    seen = FirstForwardRows(cascade)
    try:
        with pytest.raises(_Boom):
            cascade.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=8, pad_token_id=0,
                             stopping_criteria=_exploding_criteria(3))
    finally:
        seen.remove()
    assert seen.caches[0].stats().blocks_in_use == 0
    # the user's cache: left empty (tests/test_parity.py covers more failures)
    cache = CascadeCache(cascade.config)
    with pytest.raises(_Boom):
        cascade.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=8, pad_token_id=0,
                         **cache_kw(cascade, cache), stopping_criteria=_exploding_criteria(3))
    assert cache.stats().blocks_in_use == 0 and cache.blocks.refcount.sum() == 0
    # and the model still generates correctly afterwards
    out = cascade.generate(input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=3, pad_token_id=0,
                           **cache_kw(cascade, cache))
    assert out.shape == (2, ids.shape[1] + 3)


def test_no_cache_and_second_call(llama_pair):
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=8)
    kw = dict(num_beams=2, max_new_tokens=5, pad_token_id=0, use_cache=False)
    assert torch.equal(stock.generate(input_ids=ids, attention_mask=mask, **kw),
                       cascade.generate(input_ids=ids, attention_mask=mask, **kw))
    kw["use_cache"] = True
    first = cascade.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(first, cascade.generate(input_ids=ids, attention_mask=mask, **kw))
