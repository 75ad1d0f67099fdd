"""BART-family decode steps on the graph runner's static path (issue 21, item 1): positions from a device tensor.

BART, mBART, PLBart, Blenderbot(-small), Pegasus, Marian and M2M100/NLLB decoders compute their positions from the
cache length on the host, which a replayed CUDA graph would freeze; hf_cascade.patches.positions makes them read
``decoder_position_ids`` that generate's cascade entry gives them. On the CPU the runner's eager form
(``cuda_graphs="eager"``) runs the static path without capture, re-running the forward each step, so a host length
would still be right there: the tests freeze it (the decoder sees a stale cache length in its decode steps, as in a
replayed graph) and still get stock's tokens, and a control shows that the same freeze changes the tokens where the
positions come from the host. Every test checks that the runner served the steps (no "disabled" reason, replays).
Tiny random models in float64 (stock sdpa and cascade, same weights); beam search with bart-large-cnn's processors
(4 beams, no_repeat_ngram_size=3, length_penalty=2.0, min_length), greedy and sampling, on padded sources.

Whisper (issue 21, item 3): best-of-n and temperature fallback run the encoder once per window on its distinct rows
(hf_cascade.patches.whisper_encoder), with stock's tokens.

The ``gpu`` tests (run on the GPU machine: pytest -m gpu tests/seq2seq/test_seq2seq_graphs.py) capture BART and Marian decode
steps on CUDA: the replayed graph equals the eager static step bitwise in bf16, and float32 equals stock; and Whisper's
fallback with the encoder reused gives stock's tokens in float32.
"""
from __future__ import annotations

import functools
import logging

import pytest
import torch
import transformers as T
from transformers import AutoModelForSeq2SeqLM

import hf_cascade  # noqa: F401  registers "cascade", applies the patches
from hf_cascade import cross_kv, seq2seq_models
from hf_cascade.config import CascadeConfig
from hf_cascade.patches import positions as positions_patch, whisper_encoder as whisper_encoder_patch

from conftest import RunnerSpy, assert_captured_matches_stock, assert_replay_equals_eager, host_loop
from test_encoder_decoder import _LONG, _LONG_MASK, _SHORT, WHISPER_CASES, whisper_pair

VOCAB = 96
NEW = 10
_STATIC = CascadeConfig(backend="reference", cuda_graphs="eager", block_size=4)


def _bart_like(cls, **extra):
    common = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
                  forced_bos_token_id=None, forced_eos_token_id=None,
                  init_std=0.2)     # (stock's 0.02 makes tiny models repeat one token whatever the positions)
    common.update(extra)
    return lambda: cls(**common)


FAMILIES = {
    "bart": _bart_like(T.BartConfig),
    "mbart": _bart_like(T.MBartConfig),
    "plbart": _bart_like(T.PLBartConfig),
    "blenderbot": _bart_like(T.BlenderbotConfig),
    "blenderbot-small": _bart_like(T.BlenderbotSmallConfig),
    "pegasus": _bart_like(T.PegasusConfig),
    "marian": _bart_like(T.MarianConfig, decoder_start_token_id=0, decoder_vocab_size=VOCAB),
    "m2m_100": _bart_like(T.M2M100Config),
    # NLLB checkpoints are M2M100 models (model_type m2m_100): pad 1, so padding_idx 1 in its positions
    "nllb": _bart_like(T.M2M100Config, pad_token_id=1, bos_token_id=0),
}
MODES = {
    # bart-large-cnn's generation config, shortened
    "beam": dict(num_beams=4, num_return_sequences=2, no_repeat_ngram_size=3, length_penalty=2.0, min_length=8),
    "greedy": dict(min_new_tokens=NEW),
}


@functools.lru_cache(maxsize=None)
def pair(family: str, dtype=torch.float64):
    torch.manual_seed(0)
    make = FAMILIES[family]
    stock = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="sdpa", dtype=dtype).eval()
    cascade = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="cascade", dtype=dtype).eval()
    cascade.load_state_dict(stock.state_dict())
    return stock, cascade


def sources(lengths=(13, 9, 5), seed=0, pad=0):
    """Right-padded sources (as these families' tokenizers pad) of different lengths, and their mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=g)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, pad), mask


def generate(model, ids, mask, mode, **extra):
    """Inside transformers' loop (host_loop(): the runner's path) unless ``extra`` brings processors of its own."""
    torch.manual_seed(1234)
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, return_dict_in_generate=True,
                          output_scores=True, **{**host_loop(), **MODES[mode], **extra})


def assert_same(want, got, mode):
    """Stock's tokens, and its scores of every step (float64: equal to 1e-9)."""
    assert torch.equal(want.sequences, got.sequences), (want.sequences, got.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=0, atol=1e-9)
    if mode == "beam":
        torch.testing.assert_close(got.sequences_scores, want.sequences_scores, rtol=0, atol=1e-9)


def assert_served(spy, min_replays=NEW - 3):
    """The call's runner ran the decode steps on its static path (replays), never refused them."""
    runners = [r for r in spy.runners if r is not None]
    assert runners, "no graph runner was made"
    for runner in runners:
        assert runner.disabled is None, runner.disabled
        assert runner.replays >= min_replays, (runner.replays, runner.eager_calls)


@pytest.fixture
def frozen_host_length(monkeypatch):
    """What a replayed graph does to a decoder that reads the cache length on the host: in every decode step
    (one token per row) the decoder's ``cache.get_seq_length()`` answers a stale length (0). generate's own calls,
    outside the decoder, see the true length. Yields the true lengths it hid, one per stale answer."""
    inside, hidden = [], []
    real = cross_kv.CascadeEncoderDecoderCache.get_seq_length

    def stale(self, *args, **kwargs):
        if inside and inside[-1]:
            hidden.append(real(self, *args, **kwargs))
            return 0
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cross_kv.CascadeEncoderDecoderCache, "get_seq_length", stale)
    for _, decoder_cls in positions_patch._applied:
        forward = decoder_cls.forward

        def step(self, *args, _forward=forward, **kwargs):
            ids = kwargs.get("input_ids")
            inside.append(ids is not None and ids.shape[-1] == 1)
            try:
                return _forward(self, *args, **kwargs)
            finally:
                inside.pop()

        monkeypatch.setattr(decoder_cls, "forward", step)
    return hidden


# ---- what the patch relies on ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,decoder,embedding,kind", positions_patch.FAMILIES,
                         ids=[family[0] for family in positions_patch.FAMILIES])
def test_the_patch_fits_every_family(name, decoder, embedding, kind):
    """Each family's decoder computes its positions from get_seq_length() through embed_positions, with the
    embedding forward the patch replaces; all of them are patched and registered on this transformers."""
    assert positions_patch.unchanged_reason(name, decoder, embedding, kind) is None
    assert name in positions_patch.applied_families()
    decoder_cls = getattr(positions_patch._modeling(name), decoder)
    assert decoder_cls in seq2seq_models._DEVICE_POSITIONS


def test_stock_forwards_are_untouched():
    """Without the keyword (any forward but generate's cascade decode steps) the decoder runs stock's code: the
    same logits as the sdpa model, bitwise, and decoder_position_ids are ignored as stock ignores them."""
    stock, cascade = pair("bart")
    ids, mask = sources()
    decoder_ids = torch.randint(3, VOCAB, (3, 6))
    with torch.no_grad():
        want = stock(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        got = cascade(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                      decoder_position_ids=torch.full((3, 6), 20)).logits
    assert torch.equal(want, got)


# ---- item 1: stock's tokens, the steps served from the static path ----------------------------------------------
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_stock_tokens_on_the_static_path(family, mode, monkeypatch, frozen_host_length):
    stock, cascade = pair(family)
    pad = stock.config.pad_token_id
    ids, mask = sources(pad=pad)
    want = generate(stock, ids, mask, mode)
    spy = RunnerSpy(monkeypatch)
    got = generate(cascade, ids, mask, mode, hf_cascade_config=_STATIC)
    assert_same(want, got, mode)
    assert_served(spy)
    assert max(frozen_host_length) >= NEW - 1          # the decode steps' decoder saw a stale cache length


@pytest.mark.parametrize("family", ["bart", "m2m_100"])
def test_sampling_on_the_static_path(family, monkeypatch, frozen_host_length):
    """Sampling, 3 sequences per source (fixed seed): stock's tokens, the steps served."""
    stock, cascade = pair(family)
    ids, mask = sources(pad=stock.config.pad_token_id)
    kw = dict(do_sample=True, num_return_sequences=3, top_k=0)
    want = generate(stock, ids, mask, "greedy", **kw)
    spy = RunnerSpy(monkeypatch)
    got = generate(cascade, ids, mask, "greedy", **kw, hf_cascade_config=_STATIC)
    assert_same(want, got, "greedy")
    assert_served(spy)
    assert frozen_host_length


def padded_decoder_prompt(start, pad, side):
    """Decoder prompts of different lengths (one per source), padded on ``side``, and their mask."""
    g = torch.Generator().manual_seed(9)
    lengths, width = (6, 3, 4), 6
    ids = torch.randint(10, VOCAB, (3, width), generator=g)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        cols = slice(width - length, width) if side == "left" else slice(0, length)
        mask[row, cols] = 1
        ids[row, cols.start] = start
    return dict(decoder_input_ids=ids.masked_fill(mask == 0, pad), decoder_attention_mask=mask)


@pytest.mark.parametrize("family,side", [("bart", "left"), ("bart", "right"), ("m2m_100", "right")])
def test_padded_decoder_prompt(family, side, monkeypatch, frozen_host_length):
    """Decoder prompts of different lengths, padded (pads count in stock's positions of the decode steps: they
    follow the cache length), prefilled once per input, then beam search on the static path."""
    stock, cascade = pair(family)
    ids, mask = sources(pad=stock.config.pad_token_id)
    kw = padded_decoder_prompt(stock.config.decoder_start_token_id, stock.config.pad_token_id, side)
    want = generate(stock, ids, mask, "beam", **kw)
    spy = RunnerSpy(monkeypatch)
    got = generate(cascade, ids, mask, "beam", **kw, hf_cascade_config=_STATIC)
    assert_same(want, got, "beam")
    assert_served(spy)
    assert frozen_host_length


def test_m2m100_left_padded_decoder_prompt_stays_dense(monkeypatch, caplog):
    """M2M100/NLLB position a decoder prompt token after the real tokens before it (pads not counted), a decode
    step after the cache length (pads counted): prefilling a left-padded prompt but its last token, then feeding
    that token at the cache length, would move it. Such a call runs on stock's dense cache, the reason logged."""
    stock, cascade = pair("m2m_100")
    ids, mask = sources(pad=stock.config.pad_token_id)
    kw = padded_decoder_prompt(stock.config.decoder_start_token_id, stock.config.pad_token_id, "left")
    caplog.set_level(logging.INFO, logger="hf_cascade")
    want = generate(stock, ids, mask, "beam", **kw)
    spy = RunnerSpy(monkeypatch)
    got = generate(cascade, ids, mask, "beam", **kw, hf_cascade_config=_STATIC)
    assert_same(want, got, "beam")
    assert spy.runners == []
    assert seq2seq_models.prompt_positions_reason(cascade, kw["decoder_attention_mask"]) is not None
    assert seq2seq_models.prompt_positions_reason(pair("bart")[1], kw["decoder_attention_mask"]) is None


def test_greedy_rows_that_finished_feed_pads(monkeypatch, frozen_host_length):
    """Greedy rows that ended feed the pad token: M2M100 gives a pad the padding position (from the input ids, on
    the device), the others the cache length; stock's tokens either way."""
    for family in ("m2m_100", "bart"):
        stock, cascade = pair(family)
        ids, mask = sources(pad=stock.config.pad_token_id)
        # a row's first new token that no other row makes ends that row at once: the rest of it is pads
        made = generate(stock, ids, mask, "greedy").sequences
        row = next(r for r in range(len(made)) if not (made[torch.arange(len(made)) != r] == made[r, 1]).any())
        eos = [stock.config.eos_token_id, int(made[row, 1])]
        want = generate(stock, ids, mask, "greedy", eos_token_id=eos, min_new_tokens=0)
        assert (want.sequences[row, 2:] == stock.config.pad_token_id).all() and want.sequences.shape[1] == NEW + 1
        spy = RunnerSpy(monkeypatch)
        got = generate(cascade, ids, mask, "greedy", eos_token_id=eos, min_new_tokens=0, hf_cascade_config=_STATIC)
        assert_same(want, got, "greedy")
        assert_served(spy)
    assert frozen_host_length


# ---- what the patch cannot serve: eagerly, the reason logged once ---------------------------------------------------
class BartTakingPositions(T.BartForConditionalGeneration):
    """A model variant whose forward takes decoder_position_ids (so generate accepts a caller's), which its
    BART decoder never reads: its positions still follow the cache length."""

    def forward(self, *args, decoder_position_ids=None, **kwargs):
        return super().forward(*args, **kwargs)


def test_callers_decoder_position_ids_run_eagerly(monkeypatch, caplog):
    torch.manual_seed(0)
    config = FAMILIES["bart"]()
    stock = BartTakingPositions._from_config(config, attn_implementation="sdpa", dtype=torch.float64).eval()
    cascade = BartTakingPositions._from_config(FAMILIES["bart"](), attn_implementation="cascade",
                                               dtype=torch.float64).eval()
    cascade.load_state_dict(stock.state_dict())
    ids, mask = sources()
    # not the cache length: a runner that took them as the step's positions would be silently wrong
    kw = dict(decoder_position_ids=torch.full((3, 1), 17))
    want = generate(stock, ids, mask, "beam", **kw)
    spy = RunnerSpy(monkeypatch)
    caplog.set_level(logging.INFO, logger="hf_cascade")
    for _ in range(2):
        got = generate(cascade, ids, mask, "beam", **kw, hf_cascade_config=_STATIC)
        assert_same(want, got, "beam")
    assert len(spy.runners) == 2
    for runner in spy.runners:      # (transformers' loop, eager: the whole step does not take the call)
        assert runner.device_steps == 0 and runner.replays == 0
    logged = [r for r in caplog.records if "caller's decoder_position_ids" in r.getMessage()]
    assert len(logged) == 1


def test_positions_past_the_table_run_eagerly(monkeypatch, caplog):
    """M2M100 grows its sinusoidal table on the host when a position passes its end (a graph could not): a call
    that could reach it runs its steps eagerly, the reason logged; stock's tokens."""
    torch.manual_seed(0)
    make = _bart_like(T.M2M100Config, max_position_embeddings=8)
    stock = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="sdpa", dtype=torch.float64).eval()
    cascade = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="cascade", dtype=torch.float64).eval()
    cascade.load_state_dict(stock.state_dict())
    ids, mask = sources()
    caplog.set_level(logging.INFO, logger="hf_cascade")
    want = generate(stock, ids, mask, "beam")
    spy = RunnerSpy(monkeypatch)
    got = generate(cascade, ids, mask, "beam", hf_cascade_config=_STATIC)
    assert_same(want, got, "beam")
    runner, = spy.runners           # (transformers' loop, eager: the whole step does not take the call)
    assert runner.device_steps == 0 and runner.replays == 0
    assert any("reaches past M2M100SinusoidalPositionalEmbedding" in r.getMessage() for r in caplog.records)


# ---- item 3: Whisper's best-of-n and temperature fallback encode each window once -----------------------------
WHISPER_ENCODER_CASES = {
    "temperature_fallback": WHISPER_CASES["temperature_fallback"],
    "long_form_fallback": WHISPER_CASES["long_form_fallback"],
    "beams_returned": WHISPER_CASES["beams_returned"],
    "best_of": (_SHORT, dict(do_sample=True, temperature=0.8, num_return_sequences=3)),
    "best_of_fallback": (_SHORT, dict(do_sample=True, temperature=(0.2, 0.6, 1.0), num_return_sequences=3,
                                      logprob_threshold=0.0, compression_ratio_threshold=1.2)),
    "long_form_best_of_fallback": (_LONG, dict(attention_mask=_LONG_MASK, return_timestamps=True, do_sample=True,
                                               temperature=(0.0, 0.5), num_return_sequences=2,
                                               logprob_threshold=0.0)),
}


def test_the_whisper_encoder_patch_fits():
    assert whisper_encoder_patch.unchanged_reason() is None and whisper_encoder_patch.is_applied()


@pytest.mark.parametrize("case", list(WHISPER_ENCODER_CASES))
def test_whisper_encodes_each_window_once(case, monkeypatch):
    """Stock's tokens; the cascade model runs its encoder once per window (generate_with_fallback call), on the
    window's distinct rows, where stock runs it once per returned sequence and again for every retry."""
    stock, cascade = whisper_pair()
    features, kwargs = WHISPER_ENCODER_CASES[case]
    kwargs = {"language": "en", **kwargs}
    windows, encoded = [], {id(stock): [], id(cascade): []}
    mixin = whisper_encoder_patch._whisper_mixin()
    real = mixin.generate_with_fallback

    def counted(self, *args, **kw):
        windows.append(self)
        return real(self, *args, **kw)

    monkeypatch.setattr(mixin, "generate_with_fallback", counted)
    hooks = [model.get_encoder().register_forward_hook(
        lambda module, args, out, key=id(model): encoded[key].append(out.last_hidden_state.shape[0]))
        for model in (stock, cascade)]
    try:
        outs = []
        for model in (stock, cascade):
            torch.manual_seed(5)
            outs.append(model.generate(features, max_new_tokens=10, **kwargs))
    finally:
        for hook in hooks:
            hook.remove()
    want, got = outs
    assert want.shape == got.shape and torch.equal(want, got)
    cascade_windows = sum(window is cascade for window in windows)
    assert len(encoded[id(cascade)]) == cascade_windows
    assert encoded[id(cascade)][0] <= features.shape[0]     # the first window: the inputs, each once
    assert sum(encoded[id(stock)]) > sum(encoded[id(cascade)])


# ---- on the GPU: captured and replayed ---------------------------------------------------------------------------
def _gpu_pair(family, dtype):
    make = {"bart": lambda: T.BartConfig(vocab_size=1000, d_model=256, encoder_layers=2, decoder_layers=2,
                                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=512,
                                         decoder_ffn_dim=512, max_position_embeddings=1100,
                                         forced_bos_token_id=None, forced_eos_token_id=None),
            "marian": lambda: T.MarianConfig(vocab_size=1000, decoder_vocab_size=1000, d_model=256, encoder_layers=2,
                                             decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                             encoder_ffn_dim=512, decoder_ffn_dim=512, max_position_embeddings=512,
                                             pad_token_id=999, decoder_start_token_id=999, eos_token_id=0,
                                             forced_eos_token_id=None)}[family]
    torch.manual_seed(0)
    stock = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="sdpa", dtype=dtype).cuda().eval()
    cascade = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="cascade", dtype=dtype).cuda().eval()
    cascade.load_state_dict(stock.state_dict())
    return stock, cascade


def _gpu_sources(pad):
    lengths = torch.tensor([[400], [250], [96], [37]], device="cuda")
    ids = torch.randint(3, 990, (4, 400), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    mask = (torch.arange(400, device="cuda")[None, :] < lengths).long()
    return ids.masked_fill(mask == 0, pad), mask


_GPU_MODES = {"beam": dict(num_beams=4, num_return_sequences=2, no_repeat_ngram_size=3, length_penalty=2.0,
                           min_length=24),
              "greedy": dict(min_new_tokens=24)}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(_GPU_MODES))
@pytest.mark.parametrize("family", ["bart", "marian"])
def test_gpu_float32_captured_steps_match_stock(family, mode, monkeypatch, no_tf32):
    stock, cascade = _gpu_pair(family, torch.float32)
    ids, mask = _gpu_sources(stock.config.pad_token_id)
    assert_captured_matches_stock(stock, cascade, ids, mask, monkeypatch, **_GPU_MODES[mode])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(_GPU_MODES))
@pytest.mark.parametrize("family", ["bart", "marian"])
def test_gpu_bf16_replay_equals_eager_bitwise(family, mode, monkeypatch):
    """bf16 on the cuda kernels: the replayed decode step gives bitwise the eager static step's tokens and scores."""
    _, cascade = _gpu_pair(family, torch.bfloat16)
    ids, mask = _gpu_sources(cascade.config.pad_token_id)
    assert_replay_equals_eager(cascade, ids, mask, monkeypatch, **_GPU_MODES[mode])


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(num_beams=2, temperature=(0.0, 0.4, 0.8), logprob_threshold=0.0,
                                     compression_ratio_threshold=1.2),
                                dict(do_sample=True, temperature=(0.2, 0.8), num_return_sequences=3,
                                     logprob_threshold=0.0)], ids=["fallback", "best_of_fallback"])
def test_gpu_whisper_fallback_encodes_once_float32(kw):
    """Whisper's retries and best-of-n on the GPU take their rows' encoder output from the window's one encoder
    run (batched differently from stock's runs): stock's tokens in float32."""
    from test_gpu_encoder_decoder import _whisper
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    stock, cascade = _whisper("sdpa"), _whisper("cascade")
    cascade.load_state_dict(stock.state_dict())
    features = torch.randn(4, 80, 3000, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    rows = {id(stock): 0, id(cascade): 0}
    hooks = [model.get_encoder().register_forward_hook(
        lambda module, args, out, key=id(model): rows.__setitem__(key, rows[key] + out.last_hidden_state.shape[0]))
        for model in (stock, cascade)]
    try:
        outs = []
        for model in (stock, cascade):
            torch.manual_seed(3)
            outs.append(model.generate(features, language="en", max_new_tokens=24, **kw))
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(*outs)
    assert rows[id(stock)] > rows[id(cascade)], rows
