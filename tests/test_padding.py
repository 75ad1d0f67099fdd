"""Padding that stock runs, run here with stock's tokens (float64, tiny random models).

Decoder-only: a right-padded batch (stock warns, then generates after the pads; the mask hides them and
positions come from its cumulative sum) is stored without its pads and gives stock's tokens, on a cache of
the call's own or one of the caller's. Under a sliding window the call can exceed, stock counts the pad
columns inside the window: such a call runs on stock's path (logged), and a caller's CascadeCache is refused.
Encoder-decoder: a padded decoder prompt (``decoder_attention_mask`` with zeros; Whisper's batched long-form
with a prompt and previous segments of different lengths) gives stock's tokens, paged or dense.
"""
from __future__ import annotations

import logging

import pytest
import torch

from hf_cascade import CascadeCache, CascadeConfig
from conftest import VOCAB, FirstForwardRows, cache_kw, model_pair

MODES = {
    "beam": dict(num_beams=4, num_return_sequences=2, length_penalty=0.7),
    "sample": dict(do_sample=True, num_return_sequences=3, top_k=0),
    "greedy": dict(),
}


def right_padded(seed=0, lengths=(12, 20, 17)):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=g)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def generate(model, seed=1, **kw):
    torch.manual_seed(seed)
    return model.generate(max_new_tokens=8, pad_token_id=0, return_dict_in_generate=True, output_scores=True, **kw)


def assert_same(want, got):
    assert torch.equal(want.sequences, got.sequences)
    if getattr(want, "sequences_scores", None) is not None:
        torch.testing.assert_close(got.sequences_scores, want.sequences_scores, rtol=0, atol=1e-9)


@pytest.fixture(scope="module")
def llama():
    return model_pair("llama")


@pytest.mark.parametrize("explicit", [False, True], ids=["own_cache", "callers_cache"])
@pytest.mark.parametrize("mode", list(MODES))
def test_right_padded_batch_gives_stock_tokens(llama, mode, explicit):
    stock, cascade = llama
    ids, mask = right_padded()
    kw = dict(input_ids=ids, attention_mask=mask, **MODES[mode])
    want = generate(stock, **kw)
    # test setup: the pads matter (stock generates after them, from the pad's own output)
    left = torch.stack([torch.cat([r[m == 0], r[m == 1]]) for r, m in zip(ids, mask)])
    assert not torch.equal(generate(stock, input_ids=left, attention_mask=mask.sort(1).values, **MODES[mode])
                           .sequences[:, -8:], want.sequences[:, -8:])
    cache = CascadeCache(cascade.config)
    rows = FirstForwardRows(cascade)
    try:
        got = generate(cascade, **kw, **(cache_kw(cascade, cache) if explicit else {}))
    finally:
        rows.remove()
    assert_same(want, got)
    if mode != "greedy" or explicit:          # own cache, greedy: nothing to share, stock's path by design
        assert rows.rows[0] == 3, "each prompt prefilled once, on the cascade path"
        assert isinstance(rows.caches[0], CascadeCache)


def test_right_padded_batch_through_the_static_decode_path(llama):
    """The graph runner's eager form (the static layout a CUDA graph replays) after a right-padded prefill."""
    stock, cascade = llama
    ids, mask = right_padded(seed=2)
    kw = dict(input_ids=ids, attention_mask=mask, num_beams=3)
    config = CascadeConfig(backend="reference", cuda_graphs="eager", block_size=4)
    assert_same(generate(stock, **kw), generate(cascade, **kw, hf_cascade_config=config))


@pytest.fixture(scope="module")
def windowed():
    return model_pair("mistral", sliding_window=6)


@pytest.mark.parametrize("mode", list(MODES))
def test_right_padding_under_an_exceeded_window_runs_on_stock_path(windowed, mode, caplog):
    stock, cascade = windowed
    ids, mask = right_padded(seed=3)
    kw = dict(input_ids=ids, attention_mask=mask, **MODES[mode])
    rows = FirstForwardRows(cascade)
    try:
        with caplog.at_level(logging.INFO, logger="hf_cascade"):
            got = generate(cascade, **kw)
    finally:
        rows.remove()
    assert_same(generate(stock, **kw), got)
    assert "stock's dense path" in caplog.text and "sliding window (6)" in caplog.text
    assert not any(isinstance(c, CascadeCache) for c in rows.caches)
    # a caller's CascadeCache cannot take it: refused before anything is stored, and left reusable
    cache = CascadeCache(cascade.config)
    with pytest.raises(ValueError, match="padding_side='left'.*Pass no cache"):
        generate(cascade, **kw, **cache_kw(cascade, cache))
    assert cache.get_seq_length() == 0
    # left padding on the same model runs the cascade with stock's tokens
    left = torch.stack([torch.cat([r[m == 0], r[m == 1]]) for r, m in zip(ids, mask)])
    kw = dict(input_ids=left, attention_mask=mask.sort(1).values, **MODES[mode])
    assert_same(generate(stock, **kw), generate(cascade, **kw, **cache_kw(cascade, cache)))
