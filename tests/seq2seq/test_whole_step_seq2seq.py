"""The whole decode step on the device (hf_cascade/decode/whole_step.py) for encoder-decoder models, against stock.

BART, mBART, PLBart, Pegasus, Blenderbot, Marian, M2M100/NLLB and Whisper: the decoder's ids and positions advanced
on the device, the cross-attention K/V fixed for the call, token choice by :mod:`hf_cascade.device_select` with the
processors these checkpoints' own generation configs use (bart-large-cnn: 4 beams, no_repeat_ngram_size 3,
length_penalty 2.0, min_length, forced BOS/EOS, early stopping; mBART/NLLB/M2M100: forced BOS; opus-mt: its pad token
as a bad word; Blenderbot: encoder_no_repeat_ngram_size; Whisper: its SuppressTokens / SuppressTokensAtBegin
processor objects). On the CPU the loop runs with ``cuda_graphs="eager"`` (the
step a GPU captures, run eagerly); every test checks ``runner.device_steps`` (a silent fallback to transformers' loop
cannot pass), and the BART-family tests freeze the host's cache length inside the decoder (tests/seq2seq/test_seq2seq_graphs.py
``frozen_host_length``) so that positions taken from the host would give other tokens. Tiny random models in float64,
stock sdpa and cascade with the same weights, padded sources of different lengths.

The ``gpu`` test (pytest -m gpu tests/seq2seq/test_whole_step_seq2seq.py on the GPU machine): the captured whole step equals
the eager whole step bitwise in bf16 for BART with bart-large-cnn's settings, and float32 equals stock.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math

import pytest
import torch
import transformers as T
from transformers import AutoModelForSeq2SeqLM,  GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation import logits_process as hf_processors

from hf_cascade import device_select, logs
from hf_cascade.config import CascadeConfig
from hf_cascade.device_select import SelectionConfig, new_state

from conftest import RunnerSpy
from test_encoder_decoder import WHISPER_CASES, whisper_pair
from test_seq2seq_graphs import (FAMILIES, VOCAB, BartTakingPositions, _bart_like, _gpu_pair,  # noqa: F401
                                 _gpu_sources, frozen_host_length, padded_decoder_prompt, pair, sources)

EAGER = CascadeConfig(backend="reference", cuda_graphs="eager", block_size=4)
EOS = 2

# bart-large-cnn's generation config, shortened to the tiny models' 64 positions
CNN = dict(num_beams=4, no_repeat_ngram_size=3, length_penalty=2.0, min_length=12, max_length=24, early_stopping=True,
           forced_bos_token_id=0, forced_eos_token_id=EOS)
MODES = {
    "cnn": CNN,
    # opus-mt / NLLB translation: 4 beams; NLLB / M2M100 / mBART force the target language's token first
    "translate": dict(num_beams=4, max_new_tokens=14),
    "translate-forced-bos": dict(num_beams=4, max_new_tokens=14, forced_bos_token_id=7),
    "translate-bad-words": dict(num_beams=4, max_new_tokens=14, bad_words_ids=[[0], [9], [EOS]]),   # opus-mt's pad
    "returned": dict(num_beams=4, num_return_sequences=2, max_new_tokens=12, length_penalty=0.5),
    "greedy": dict(max_new_tokens=14, min_new_tokens=4, forced_bos_token_id=7),
    "sample": dict(do_sample=True, num_return_sequences=2, top_k=20, max_new_tokens=12),
}


def _device_steps(spy) -> int:
    return sum(r.device_steps for r in spy.runners if r is not None)


def _generate(model, ids, mask, seed=1234, **kwargs):
    torch.manual_seed(seed)
    return model.generate(input_ids=ids, attention_mask=mask, **kwargs)


def _assert_equal_to_stock(stock, cascade, ids, mask, spy, config=EAGER, **kwargs):
    want = _generate(stock, ids, mask, **kwargs)
    got = _generate(cascade, ids, mask, hf_cascade_config=config, **kwargs)
    assert want.shape == got.shape and torch.equal(want, got), (want, got)
    assert _device_steps(spy) > 0, "the whole step did not run (transformers' loop served the call)"
    return got


# ---- the processors of the seq2seq generation configs, against transformers' objects ------------------------------
def _state(sequences, cur_len, prompt_length, **config):
    selection = SelectionConfig(batch_size=sequences.shape[0], prompt_length=prompt_length,
                                max_length=sequences.shape[1], eos_token_ids=(EOS, 5), **config)
    state = new_state(selection, sequences[:, :prompt_length])
    state.sequences[:, :sequences.shape[1]].copy_(sequences)     # (the state's buffer is bucketed: wider)
    state.cur_len.fill_(cur_len)
    return state


@pytest.mark.parametrize("prompt_length", [1, 3])
def test_each_processor_equals_transformers_at_every_length(prompt_length):
    rows, width = 4, 10
    for cur_len in range(prompt_length, width):
        generator = torch.Generator().manual_seed(cur_len)
        sequences = torch.randint(0, VOCAB, (rows, width), generator=generator)
        sequences[:, cur_len:] = -1
        input_ids = sequences[:, :cur_len]
        scores = torch.randn(rows, VOCAB, generator=generator, dtype=torch.float64).float() * 3
        log_probs = torch.log_softmax(scores, dim=-1)          # beam search processes log-probs
        begin = prompt_length + (1 if prompt_length == 1 else 0)
        cases = [
            (dict(forced_bos_token_id=0), hf_processors.ForcedBOSTokenLogitsProcessor(0)),
            (dict(forced_bos_token_id=9), hf_processors.ForcedBOSTokenLogitsProcessor(9)),
            (dict(forced_eos_token_ids=(EOS,)), hf_processors.ForcedEOSTokenLogitsProcessor(width, EOS)),
            (dict(forced_eos_token_ids=(EOS, 5)), hf_processors.ForcedEOSTokenLogitsProcessor(width, [EOS, 5])),
            (dict(suppress_tokens=(3, 4, 11)), hf_processors.SuppressTokensLogitsProcessor([3, 4, 11])),
            (dict(suppress_tokens=()), hf_processors.SuppressTokensLogitsProcessor([])),
            (dict(begin_suppress_tokens=(EOS, 8), forced_bos_token_id=None),
             hf_processors.SuppressTokensAtBeginLogitsProcessor([EOS, 8], prompt_length)),
            (dict(begin_suppress_tokens=(EOS, 8), begin_suppress_index=begin),
             hf_processors.SuppressTokensAtBeginLogitsProcessor([EOS, 8], begin)),
            (dict(bad_words_ids=(9, 4)), hf_processors.NoBadWordsLogitsProcessor([[9], [EOS], [4]], (EOS, 5))),
        ]
        for config, processor in cases:
            for values in (scores, log_probs):
                state = _state(sequences, cur_len, prompt_length, **config)
                want = processor(input_ids, values.clone())
                got = device_select.process_logits(state, values.clone())
                assert torch.equal(got, want), (config, cur_len)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_encoder_no_repeat_ngram_equals_transformers_at_every_length(size):
    """EncoderNoRepeatNGramLogitsProcessor: each row against its own input's n-grams (two inputs, two rows each;
    few distinct ids, so n-grams of the sources recur in the rows)."""
    generator = torch.Generator().manual_seed(size)
    encoder_ids = torch.randint(0, 6, (2, 9), generator=generator)
    processor = hf_processors.EncoderNoRepeatNGramLogitsProcessor(size, encoder_ids)
    rows, width, prompt_length = 4, 10, 1
    for cur_len in range(prompt_length, width):
        sequences = torch.randint(0, 6, (rows, width), generator=generator)
        sequences[:, cur_len:] = -1
        scores = torch.randn(rows, VOCAB, generator=generator)
        selection = SelectionConfig(batch_size=2, num_beams=2, prompt_length=prompt_length, max_length=width,
                                    encoder_no_repeat_ngram_size=size)
        state = new_state(selection, sequences[:, :prompt_length], encoder_ngrams=processor.generated_ngrams)
        state.sequences[:, :sequences.shape[1]].copy_(sequences)     # (the state's buffer is bucketed: wider)
        state.cur_len.fill_(cur_len)
        want = processor(sequences[:, :cur_len], scores.clone())
        assert torch.equal(device_select.process_logits(state, scores.clone()), want), cur_len


@pytest.mark.parametrize("family", ["bart", "blenderbot"])
def test_encoder_no_repeat_ngram(family, monkeypatch, frozen_host_length):  # noqa: F811
    """Blenderbot's generation setting: no 3-gram of the source repeated. Token 6's logit raised and a run of 6s in
    every source but the last: the model writes 6s until the ban bites (the tokens differ from the unbanned call's)."""
    stock, cascade = _biased(family, 8.0, (6,))
    ids, mask = sources(pad=stock.config.pad_token_id)
    ids[:-1, 1:4] = 6
    kwargs = dict(num_beams=4, max_new_tokens=12)
    spy = RunnerSpy(monkeypatch)
    got = _assert_equal_to_stock(stock, cascade, ids, mask, spy, **kwargs, encoder_no_repeat_ngram_size=3)
    unbanned = _generate(stock, ids, mask, **kwargs, encoder_no_repeat_ngram_size=0)
    assert got.shape != unbanned.shape or not torch.equal(got, unbanned)


def test_the_default_begin_index_is_transformers():
    """generate puts SuppressTokensAtBegin at the first generated position, one later after a forced BOS token
    (one-token prompt): the config reads it so from a generation config, and Whisper's objects are taken as they
    are."""
    base = dict(batch_size=1, max_length=10, begin_suppress_tokens=(3,))
    assert SelectionConfig(prompt_length=1, **base).begin_suppress_index == 1
    assert SelectionConfig(prompt_length=1, forced_bos_token_id=4, **base).begin_suppress_index == 2
    assert SelectionConfig(prompt_length=3, forced_bos_token_id=4, **base).begin_suppress_index == 3
    config = SelectionConfig(batch_size=1, prompt_length=4, max_length=10)
    adopted = config.adopting_suppressions([hf_processors.SuppressTokensAtBeginLogitsProcessor([7], 5),
                                            hf_processors.SuppressTokensLogitsProcessor([1, 2])])
    assert adopted.begin_suppress_tokens == (7,) and adopted.begin_suppress_index == 5
    assert adopted.suppress_tokens == (1, 2)


# ---- stock's tokens from the whole step ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", ["bart", "marian", "m2m_100", "nllb", "mbart"])
def test_stock_tokens(family, mode, monkeypatch, frozen_host_length):  # noqa: F811
    stock, cascade = pair(family)
    ids, mask = sources(pad=stock.config.pad_token_id)
    spy = RunnerSpy(monkeypatch)
    _assert_equal_to_stock(stock, cascade, ids, mask, spy, **MODES[mode])
    assert frozen_host_length          # the decoder saw a stale host length: its positions came from the device


@pytest.mark.parametrize("family", ["pegasus", "plbart", "blenderbot", "blenderbot-small"])
def test_other_bart_family_decoders(family, monkeypatch, frozen_host_length):  # noqa: F811
    stock, cascade = pair(family)
    ids, mask = sources(lengths=(11, 4), seed=3, pad=stock.config.pad_token_id)
    spy = RunnerSpy(monkeypatch)
    # (Blenderbot's config brings encoder_no_repeat_ngram_size=3: the n-grams of each source are banned too)
    _assert_equal_to_stock(stock, cascade, ids, mask, spy, **CNN)


def test_a_length_limit_shorter_than_an_ngram():
    """One new token with bart-large-cnn's no_repeat_ngram_size 3 (max_length 2, what a benchmark's one-token call
    asks): no n-gram can be complete, nothing is banned, as transformers bans nothing."""
    sequences = torch.tensor([[EOS, -1], [EOS, -1]])
    state = _state(sequences, 1, 1, no_repeat_ngram_size=3)
    scores = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    want = hf_processors.NoRepeatNGramLogitsProcessor(3)(sequences[:, :1], scores.clone())
    assert torch.equal(device_select.process_logits(state, scores.clone()), want)


@pytest.mark.parametrize("family,side", [("bart", "left"), ("bart", "right"), ("m2m_100", "right"), ("mbart", "right")])
def test_padded_decoder_prompts(family, side, monkeypatch, frozen_host_length):  # noqa: F811
    """Decoder prompts of different lengths (mBART's [eos, language] and longer), padded, prefilled once per input:
    the call's first step writes under a mask (not a static step), the device takes over from the second."""
    stock, cascade = pair(family)
    ids, mask = sources(pad=stock.config.pad_token_id)
    kw = padded_decoder_prompt(stock.config.decoder_start_token_id, stock.config.pad_token_id, side)
    spy = RunnerSpy(monkeypatch)
    _assert_equal_to_stock(stock, cascade, ids, mask, spy, **kw, num_beams=4, no_repeat_ngram_size=3,
                           max_new_tokens=12)
    assert frozen_host_length


def test_greedy_rows_that_finished_feed_pads(monkeypatch, frozen_host_length):  # noqa: F811
    """Rows that ended feed the pad token on the device: M2M100 gives a pad the padding position (from the input
    ids), BART the cache length; stock's tokens either way."""
    for family in ("m2m_100", "bart"):
        stock, cascade = pair(family)
        ids, mask = sources(pad=stock.config.pad_token_id)
        made = _generate(stock, ids, mask, max_new_tokens=10, min_new_tokens=10)
        # a row's first new token that no other row makes: as an eos it ends that row at once
        row = next(r for r in range(len(made)) if not (made[torch.arange(len(made)) != r] == made[r, 1]).any())
        eos = [stock.config.eos_token_id, int(made[row, 1])]
        spy = RunnerSpy(monkeypatch)
        got = _assert_equal_to_stock(stock, cascade, ids, mask, spy, max_new_tokens=10, eos_token_id=eos)
        assert (got[row, 2:] == stock.config.pad_token_id).all() and got.shape[1] == 11


@functools.lru_cache(maxsize=None)
def _long_pair(family):
    """A model of ``family`` with 256 positions: room for a call past the first layouts' capacity."""
    make = {"bart": _bart_like(T.BartConfig, max_position_embeddings=256),
            "marian": _bart_like(T.MarianConfig, decoder_start_token_id=0, decoder_vocab_size=VOCAB,
                                 max_position_embeddings=256)}[family]
    torch.manual_seed(0)
    stock = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="sdpa", dtype=torch.float64).eval()
    cascade = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="cascade", dtype=torch.float64).eval()
    cascade.load_state_dict(stock.state_dict())
    return stock, cascade


@pytest.mark.parametrize("family", ["bart", "marian"])
def test_past_the_layout_room(family, monkeypatch, caplog):
    """bart-large-cnn's settings up to 150 tokens: past the first layout's room (64 new tokens) the host takes the
    block state back, widens the layout, and the device goes on (as bart-large-cnn's 142 tokens do on a GPU)."""
    stock, cascade = _long_pair(family)
    ids, mask = sources()
    spy = RunnerSpy(monkeypatch)
    settings = dict(CNN, max_length=150, min_length=140)
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        _assert_equal_to_stock(stock, cascade, ids, mask, spy, **settings)
    assert sum("decode layout widened" in r.getMessage() for r in caplog.records) >= 2
    assert _device_steps(spy) > 140


def test_the_checkpoints_generation_config(monkeypatch):
    """bart-large-cnn's settings as a GenerationConfig (what a checkpoint brings), four sources of other lengths."""
    stock, cascade = pair("bart")
    ids, mask = sources(lengths=(16, 3, 12, 7), seed=5)
    spy = RunnerSpy(monkeypatch)
    config = GenerationConfig(**CNN, bos_token_id=0, eos_token_id=EOS, pad_token_id=1, decoder_start_token_id=EOS)
    _assert_equal_to_stock(stock, cascade, ids, mask, spy, generation_config=config)


def _biased(family, bias, tokens=(EOS,)):
    """A copy of ``pair(family)`` (same weights) whose logits of ``tokens`` are raised."""
    models = []
    for model in pair(family):
        copy = type(model)._from_config(FAMILIES[family](), attn_implementation=model.config._attn_implementation,
                                        dtype=torch.float64).eval()
        copy.load_state_dict(model.state_dict())
        with torch.no_grad():
            copy.final_logits_bias[..., list(tokens)] += bias
        models.append(copy)
    return tuple(models)


@pytest.mark.parametrize("mode,bias", [("cnn", 1.5), ("returned", 1.0), ("greedy", 2.0)])
def test_eos_ends_rows_and_hypotheses_early(mode, bias, monkeypatch, frozen_host_length):  # noqa: F811
    """The eos logit raised: hypotheses finish at different steps (beam search), greedy rows end and feed pads."""
    stock, cascade = _biased("bart", bias)
    ids, mask = sources(seed=2)
    spy = RunnerSpy(monkeypatch)
    kwargs = dict(MODES[mode], min_length=0) if mode == "cnn" else MODES[mode]
    got = _assert_equal_to_stock(stock, cascade, ids, mask, spy, **kwargs)
    if mode == "greedy":        # a row ended before the others (its eos after the decoder start token, also eos)
        assert int((got == EOS).sum(-1).max()) >= 2 and got.shape[1] == 1 + kwargs["max_new_tokens"]
    else:                       # every hypothesis ended before the length limit
        assert got.shape[1] < (kwargs.get("max_length") or 1 + kwargs["max_new_tokens"])


# ---- Whisper: its own processor objects ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["beams", "beams_returned", "greedy", "prompt_shared_by_beams", "language_detected"])
def test_whisper(case, monkeypatch):
    """Whisper's generate brings SuppressTokens / SuppressTokensAtBegin as processor objects (its generation config's
    fields unset): the whole step takes their parameters from them."""
    stock, cascade = whisper_pair()
    features, kwargs = WHISPER_CASES[case]
    kwargs = {"language": "en", **kwargs}
    spy = RunnerSpy(monkeypatch)
    torch.manual_seed(5)
    want = stock.generate(features, max_new_tokens=10, **kwargs)
    torch.manual_seed(5)
    got = cascade.generate(features, max_new_tokens=10, hf_cascade_config=EAGER, **kwargs)
    assert want.shape == got.shape and torch.equal(want, got)
    assert _device_steps(spy) > 0


# decoder prompts of Whisper's tokens (start 3, language 4, task 6) whose last token is a pad in some row
WHISPER_PADDED_PROMPTS = {"right-padded": [[3, 4, 0], [3, 4, 6]], "empty-and-one-token": [[0, 0, 0], [0, 0, 3]],
                          "all-empty": [[0, 0, 0], [0, 0, 0]]}


@pytest.mark.parametrize("mode", ["beams", "greedy", "sample"])
@pytest.mark.parametrize("prompt", sorted(WHISPER_PADDED_PROMPTS))
def test_whisper_decoder_prompt_ending_in_a_pad(prompt, mode, monkeypatch):
    """Stock Whisper takes its decoder positions from the decoder mask every step (``cumsum - 1``, a pad at 0:
    WhisperForConditionalGeneration.prepare_inputs_for_generation), so after a last pad the next position is the
    row's count of real tokens; the device steps' plus one gave the pad's 0 + 1. Where no row stores a token before
    the first step, that step also needs the decoder mask (tests/test_edges.py's empty prompts)."""
    stock, cascade = whisper_pair()
    ids = torch.tensor(WHISPER_PADDED_PROMPTS[prompt])
    kwargs = dict(decoder_input_ids=ids, decoder_attention_mask=(ids != 0).long(), max_new_tokens=6,
                  min_new_tokens=6, **{"beams": dict(num_beams=3), "greedy": {},
                                       "sample": dict(do_sample=True, num_return_sequences=2)}[mode])
    features = WHISPER_CASES["beams"][0]
    spy = RunnerSpy(monkeypatch)
    outs = []
    for model, extra in ((stock, {}), (cascade, dict(hf_cascade_config=EAGER))):
        torch.manual_seed(5)     # (GenerationMixin's generate: Whisper's own builds its decoder prompt itself)
        outs.append(T.GenerationMixin.generate(model, input_features=features, **kwargs, **extra))
    want, got = outs
    assert want.shape == got.shape and torch.equal(want, got), (want, got)
    assert _device_steps(spy) > 0


@pytest.mark.parametrize("case", ["timestamps", "temperature_fallback"])
def test_whisper_timestamps_and_fallback_choose_on_the_host(case, monkeypatch, caplog):
    """Whisper's timestamp processor and its temperature fallback (scores kept for the fallback's log-probability
    check): the loop runs, the token choice on the host (hf_cascade.host_select)."""
    monkeypatch.setattr(logs, "_logged", set())
    stock, cascade = whisper_pair()
    features, kwargs = WHISPER_CASES[case]
    spy = RunnerSpy(monkeypatch)
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        torch.manual_seed(0)
        got = cascade.generate(features, max_new_tokens=10, language="en", hf_cascade_config=EAGER, **kwargs)
    torch.manual_seed(0)
    assert torch.equal(stock.generate(features, max_new_tokens=10, language="en", **kwargs), got)
    assert _device_steps(spy) > 0
    reason = "WhisperTimeStampLogitsProcessor" if case == "timestamps" else "return_dict_in_generate"
    assert any("token choice on the host" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


# ---- what the whole step does not serve: transformers' loop, the reason logged -----------------------------------
class _BanToken(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores.index_fill(1, torch.tensor([7]), -math.inf)


# what device_select does not reproduce: the loop with the token choice on the host (hf_cascade.host_select); what the
# loop does not serve: transformers' loop
REFUSED = {
    "own processor": (dict(logits_processor=LogitsProcessorList([_BanToken()])), None, "processors", "host"),
    "scores": (dict(return_dict_in_generate=True, output_scores=True), None, "return_dict_in_generate", "host"),
    "bad words": (dict(bad_words_ids=[[9, 10]]), None, "bad_words_ids", "host"),
    "encoder repetition penalty": (dict(encoder_repetition_penalty=1.3), None, "encoder_repetition_penalty", "host"),
    "max_kv_bytes": ({}, dict(max_kv_bytes=1 << 24), "max_kv_bytes", "transformers"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_the_device_choice_does_not_serve(case, monkeypatch, caplog):
    monkeypatch.setattr(logs, "_logged", set())        # the reason is logged once per process: see this call's
    extra, config, reason, loop = REFUSED[case]
    config = dataclasses.replace(EAGER, **(config or {}))
    stock, cascade = pair("bart")
    ids, mask = sources()
    kwargs = dict(CNN, **extra)
    spy = RunnerSpy(monkeypatch)
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        got = _generate(cascade, ids, mask, hf_cascade_config=config, **kwargs)
    want = _generate(stock, ids, mask, **kwargs)
    if case == "scores":
        assert all(torch.equal(a, b) for a, b in zip(want.scores, got.scores)) and len(want.scores) == len(got.scores)
        want, got = want.sequences, got.sequences
    assert torch.equal(want, got)
    assert (_device_steps(spy) > 0) == (loop == "host")
    said = "token choice on the host" if loop == "host" else "decode loop stays transformers'"
    messages = [r.getMessage() for r in caplog.records if said in r.getMessage()]
    assert any(reason in m for m in messages), messages


def test_callers_decoder_position_ids_keep_transformers_loop(monkeypatch, caplog):
    """A caller's own decoder_position_ids (a model that takes them; BART's decoder computes its positions from the
    cache length): the whole step cannot advance what the decoder reads, so transformers' loop runs the call."""
    monkeypatch.setattr(logs, "_logged", set())
    torch.manual_seed(0)
    stock = BartTakingPositions._from_config(FAMILIES["bart"](), attn_implementation="sdpa", dtype=torch.float64)
    cascade = BartTakingPositions._from_config(FAMILIES["bart"](), attn_implementation="cascade", dtype=torch.float64)
    cascade.load_state_dict(stock.state_dict())
    ids, mask = sources()
    kwargs = dict(MODES["translate"], decoder_position_ids=torch.full((3, 1), 17))
    spy = RunnerSpy(monkeypatch)
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        got = _generate(cascade.eval(), ids, mask, hf_cascade_config=EAGER, **kwargs)
    assert torch.equal(_generate(stock.eval(), ids, mask, **kwargs), got)
    assert _device_steps(spy) == 0
    assert any("caller's decoder_position_ids" in r.getMessage() for r in caplog.records)


# ---- GPU: the captured whole step -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_captured_whole_step_equals_eager_bitwise_bf16_and_stock_float32(monkeypatch):
    """BART with bart-large-cnn's settings on the cuda kernels: the captured whole step gives bitwise the tokens of
    the same step run eagerly (bf16), and float32 (TF32 off) gives stock's tokens."""
    settings = dict(CNN, max_length=48, min_length=32)
    _, cascade = _gpu_pair("bart", torch.bfloat16)
    ids, mask = _gpu_sources(cascade.config.pad_token_id)
    spy = RunnerSpy(monkeypatch)
    outs = []
    for graphs in ("eager", True):
        outs.append(cascade.generate(input_ids=ids, attention_mask=mask,
                                     hf_cascade_config=CascadeConfig(backend="cuda", cuda_graphs=graphs), **settings))
    eager_run, graph_run = spy.runners
    assert eager_run.device_steps > 20 and graph_run.device_steps > 20
    assert graph_run.captures >= 1 and graph_run.replays > 20
    assert torch.equal(outs[0], outs[1])

    torch.backends.cuda.matmul.allow_tf32 = False
    stock, cascade = _gpu_pair("bart", torch.float32)
    want = stock.generate(input_ids=ids, attention_mask=mask, **settings)
    got = cascade.generate(input_ids=ids, attention_mask=mask, **settings)
    assert torch.equal(want, got)
    assert spy.runners[-1].device_steps > 20 and spy.runners[-1].captures >= 1
