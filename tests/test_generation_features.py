"""generate() features on a cascade model behave exactly as with stock sdpa: streamers, stopping criteria and
stop strings, logits processors, scores/logits, generation configs, and the warned or refused fallbacks."""
from __future__ import annotations

import logging

import pytest
import torch
from transformers import (GenerationConfig, PreTrainedTokenizerFast, StoppingCriteria, StoppingCriteriaList,
                          TextIteratorStreamer, TextStreamer)

from conftest import VOCAB, FirstForwardRows, model_pair, padded_batch

NEW = 8
MODES = {"greedy": {}, "sample": dict(do_sample=True, top_k=0, temperature=1.3), "beam": dict(num_beams=3)}


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer over the tiny models' vocabulary (no downloads): id i >= 4 is the word "w<i>";
    "abcdef" is the probe StopStringCriteria tokenizes to learn each token's string."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {"<pad>": 0, "<s>": 1, "\u2581": 2, "abcdef": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="\u2581"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", unk_token="\u2581")


def both(pair, seed=None, **kw):
    """(stock output, cascade output) of the same generate call, with the same RNG seed when given."""
    outs = []
    for model in pair:
        if seed is not None:
            torch.manual_seed(seed)
        outs.append(model.generate(**kw))
    return outs


def batch(seed=0, rows=2):
    ids, mask = padded_batch(seed=seed)
    return dict(input_ids=ids[:rows], attention_mask=mask[:rows], pad_token_id=0, max_new_tokens=NEW)


def _token_at(stock, step, **kw):
    """The token stock generates for row 0 at ``step``: a stop token that is actually reached."""
    out = stock.generate(**kw)
    return int(out[0, kw["input_ids"].shape[1] + step])


class Collect(TextStreamer):
    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.text = []

    def on_finalized_text(self, text, stream_end=False):
        self.text.append((text, stream_end))


@pytest.mark.parametrize("mode", ["greedy", "sample"])
@pytest.mark.parametrize("iterator", [False, True])
def test_streamers_match_stock(llama_pair, tokenizer, mode, iterator):
    texts, outs = [], []
    for model in llama_pair:
        streamer = TextIteratorStreamer(tokenizer, timeout=5) if iterator else Collect(tokenizer)
        torch.manual_seed(3)
        outs.append(model.generate(**batch(seed=1, rows=1), **MODES[mode], streamer=streamer))
        texts.append(list(streamer) if iterator else streamer.text)   # the queue is unbounded: read it afterwards
    assert torch.equal(*outs)
    assert texts[0] == texts[1] and "".join(t if iterator else t[0] for t in texts[0])


def test_streamer_with_beam_search_is_refused_like_stock(llama_pair, tokenizer):
    for model in llama_pair:
        with pytest.raises(ValueError, match="cannot be used with beam search"):
            model.generate(**batch(rows=1), num_beams=2, streamer=TextStreamer(tokenizer))


class StopOnToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("mode", ["greedy", "beam"])
def test_custom_stopping_criteria_and_stop_strings(llama_pair, tokenizer, mode):
    kw = dict(**batch(seed=2, rows=2 if mode == "beam" else 1), **MODES[mode])   # greedy: all rows must stop
    unstopped = llama_pair[0].generate(**kw)
    stop = int(unstopped[0, kw["input_ids"].shape[1] + 2])        # reached: generation ends early
    for extra in (dict(stopping_criteria=StoppingCriteriaList([StopOnToken(stop)])),
                  dict(stop_strings=[tokenizer.decode([stop])], tokenizer=tokenizer)):
        expected, got = both(llama_pair, **kw, **extra)
        assert torch.equal(expected, got)
        assert expected.shape != unstopped.shape or not torch.equal(expected, unstopped), "test setup: no stop"


def test_max_time(llama_pair):
    kw = dict(**batch(seed=3), num_beams=2)
    expected, got = both(llama_pair, **kw, max_time=1e-9)       # stops after the first new token
    assert torch.equal(expected, got) and got.shape[1] == kw["input_ids"].shape[1] + 1
    assert torch.equal(*both(llama_pair, **kw, max_time=600.0))


@pytest.mark.parametrize("mode", list(MODES))
def test_logits_processors(llama_pair, mode):
    kw = dict(**batch(seed=4), **MODES[mode])
    stock = llama_pair[0]
    torch.manual_seed(0)
    eos = _token_at(stock, 1, **kw)
    a, b = _token_at(stock, 0, **kw), _token_at(stock, 3, **kw)
    for extra in (dict(eos_token_id=eos, min_new_tokens=6), dict(repetition_penalty=1.8),
                  dict(no_repeat_ngram_size=2), dict(bad_words_ids=[[a], [b, eos]])):
        expected, got = both(llama_pair, seed=5, **kw, **extra)
        assert torch.equal(expected, got), extra


@pytest.mark.parametrize("mode", list(MODES))
def test_scores_and_logits(llama_pair, mode):
    kw = dict(**batch(seed=6), **MODES[mode], return_dict_in_generate=True, output_scores=True,
              output_logits=True, num_return_sequences=2 if mode != "greedy" else 1)
    expected, got = both(llama_pair, seed=7, **kw)
    assert torch.equal(expected.sequences, got.sequences)
    names = ["scores", "logits"] + (["sequences_scores", "beam_indices"] if mode == "beam" else [])
    for name in names:
        want, have = getattr(expected, name), getattr(got, name)
        want, have = (torch.stack(x) if isinstance(x, tuple) else x for x in (want, have))
        assert want.shape == have.shape and torch.allclose(want, have, rtol=0, atol=1e-10), name


def test_second_generate_gives_the_same_result(llama_pair):
    _, cascade = llama_pair
    for mode in MODES.values():
        kw = dict(**batch(seed=8), **mode)
        first, second = both((cascade, cascade), seed=9, **kw)
        assert torch.equal(first, second)


def test_generation_config_positional_and_model_defaults():
    pair = model_pair("llama", seed=1)
    ids, mask = padded_batch(seed=9)
    config = GenerationConfig(num_beams=3, num_return_sequences=2, max_new_tokens=NEW, pad_token_id=0)
    rows = FirstForwardRows(pair[1])
    try:
        expected, got = (m.generate(ids, config, attention_mask=mask) for m in pair)
        assert torch.equal(expected, got) and expected.shape[0] == 4
        for model in pair:
            model.generation_config.num_beams = 4
            model.generation_config.length_penalty = 0.5
        expected, got = both(pair, input_ids=ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0)
        assert torch.equal(expected, got)
    finally:
        rows.remove()
    assert rows.rows[0] == 2 and rows.rows[NEW + 1] == 2        # both calls took the cascade path (prefill once)
    with pytest.raises(ValueError, match="cannot be used with beam search"):   # model default beams: as stock
        pair[1].generate(ids[:1], streamer=TextIteratorStreamer(None), max_new_tokens=2, pad_token_id=0)


def test_assisted_decoding_falls_back_to_stock_with_a_warning(llama_pair, caplog):
    assistant, _ = model_pair("llama", seed=2)
    kw = batch(seed=10, rows=1)
    for extra in (dict(assistant_model=assistant), dict(prompt_lookup_num_tokens=3)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_cascade"):
            expected, got = both(llama_pair, **kw, **extra)
        assert torch.equal(expected, got), extra
        assert "assisted decoding runs with dense attention" in caplog.text


def test_per_position_outputs_fall_back_to_stock_with_a_warning(llama_pair, caplog):
    kw = dict(**batch(seed=11), return_dict_in_generate=True, output_hidden_states=True, output_scores=True)
    with caplog.at_level(logging.WARNING, logger="hf_cascade"):
        expected, got = both(llama_pair, **kw)
    assert "dense attention" in caplog.text and torch.equal(expected.sequences, got.sequences)
    for want, have in zip(expected.hidden_states, got.hidden_states):
        assert all(torch.allclose(w, h, rtol=0, atol=1e-10) for w, h in zip(want, have))


def test_static_cache_is_refused_and_dynamic_is_served():
    stock, cascade = model_pair("llama", seed=3)
    kw = dict(**batch(seed=12), num_beams=2)
    with pytest.raises(ValueError, match="cache_implementation='static' conflicts"):
        cascade.generate(**kw, cache_implementation="static")
    cascade.generation_config.cache_implementation = "static"
    with pytest.raises(ValueError, match="cache_implementation='static' conflicts"):
        cascade.generate(**kw)
    cascade.generation_config.cache_implementation = None
    expected, got = both((stock, cascade), **kw, cache_implementation="dynamic")
    assert torch.equal(expected, got)
