"""Encoder-decoder models on the cascade path give stock's tokens (float64, tiny random models).

Each family is built twice from its config (stock sdpa and "cascade", same weights). Beam search
(4 beams, 2 returned), sampling (3 returned, fixed seed) and greedy run on a padded batch of two
sources (right padding, as the tokenizers of these families pad; left padding once). Besides the
tokens: the encoder output is not copied per beam, the cross K/V is projected once per input from
its real tokens only, and a forward without generate (a loss pass) is bit-identical to sdpa.
"""
from __future__ import annotations

import pytest
import torch
import transformers as T
from transformers import AutoModelForSeq2SeqLM

import hf_cascade  # noqa: F401  registers "cascade"
from hf_cascade import cross_kv, dense_cache, seq2seq_models

from conftest import RunnerSpy, cache_kw

VOCAB = 96
NEW = 7
SOURCES = (13, 9)


def _bart_like(cls, **extra):
    common = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
                  forced_bos_token_id=None, forced_eos_token_id=None)
    common.update(extra)
    return lambda: cls(**common)


FAMILIES = {
    "bart": _bart_like(T.BartConfig),
    "mbart": _bart_like(T.MBartConfig),
    "marian": _bart_like(T.MarianConfig, decoder_start_token_id=0, decoder_vocab_size=VOCAB),
    "m2m_100": _bart_like(T.M2M100Config),
    "t5": lambda: T.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                             num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                             pad_token_id=0, eos_token_id=1, decoder_start_token_id=0),
    "mt5": lambda: T.MT5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                               num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                               pad_token_id=0, eos_token_id=1, decoder_start_token_id=0),
}
MODES = {
    "beam": dict(num_beams=4, num_return_sequences=2),
    "sample": dict(do_sample=True, num_return_sequences=3, top_k=0),
    "greedy": dict(),
}


def pair(family: str, dtype=torch.float64, seed: int = 0):
    torch.manual_seed(seed)
    make = FAMILIES[family]
    stock = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="sdpa", dtype=dtype).eval()
    cascade = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="cascade", dtype=dtype).eval()
    cascade.load_state_dict(stock.state_dict())
    return stock, cascade


def sources(lengths=SOURCES, side="right", seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        cols = slice(0, n) if side == "right" else slice(width - n, width)
        mask[row, cols] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def run(model, ids, mask, mode, **extra):
    torch.manual_seed(1234)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                         return_dict_in_generate=True, output_scores=True, **MODES[mode], **extra)
    return out


_PAIRS = {}


def cached_pair(family):
    if family not in _PAIRS:
        _PAIRS[family] = pair(family)
    return _PAIRS[family]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_stock_tokens(family, mode):
    stock, cascade = cached_pair(family)
    ids, mask = sources()
    want, got = run(stock, ids, mask, mode), run(cascade, ids, mask, mode)
    assert torch.equal(want.sequences, got.sequences)
    if mode == "beam":
        torch.testing.assert_close(got.sequences_scores, want.sequences_scores, rtol=0, atol=1e-9)


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_left_padded_sources_and_more_beams(family):
    stock, cascade = cached_pair(family)
    ids, mask = sources(lengths=(5, 16, 11), side="left", seed=3)
    kwargs = dict(max_new_tokens=9, num_beams=5, num_return_sequences=5, length_penalty=0.7)
    assert torch.equal(stock.generate(input_ids=ids, attention_mask=mask, **kwargs),
                       cascade.generate(input_ids=ids, attention_mask=mask, **kwargs))


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_cross_kv_projected_once_per_input_from_real_tokens(family):
    """Stock projects the cross K/V from B x beams encoder rows (pads included); here from each input's
    real tokens, once; and the encoder output reaching the decoder is never a real per-beam copy."""
    _, cascade = cached_pair(family)
    ids, mask = sources()
    rows_seen, storages = [], []
    first = seq2seq_models.cross_attention_modules(cascade)[0]
    linear = first.k_proj if hasattr(first, "k_proj") else first.k
    hooks = [linear.register_forward_hook(lambda m, a, o: rows_seen.append(tuple(a[0].shape))),
             cascade.get_decoder().register_forward_pre_hook(
                 lambda m, a, kw: storages.append(kw.get("encoder_hidden_states")), with_kwargs=True)]
    try:
        cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, num_beams=4)
    finally:
        for h in hooks:
            h.remove()
    assert rows_seen == [(sum(SOURCES), cascade.config.d_model)]
    assert storages and all(s.stride(0) == 0 and s.shape[0] == 8 for s in storages)


def test_cross_reorder_copies_nothing_and_stays_within_inputs():
    _, cascade = cached_pair("bart")
    cross = cross_kv.CrossAttentionCache(2)
    ids, mask = sources()
    states = cascade.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    cross.fill(seq2seq_models.cross_projections(cascade), states, mask)
    before = [layer.pool.clone() for layer in cross.layers]
    cross.reorder_cache(torch.tensor([1, 1, 0, 0, 5, 4, 4, 7]))
    assert all(torch.equal(b, layer.pool) for b, layer in zip(before, cross.layers))
    with pytest.raises(RuntimeError, match="another input"):
        cross.reorder_cache(torch.tensor([4, 1, 0, 0, 5, 4, 4, 7]))
    tokens = cross.kv_bytes // (2 * 2 * 32 * 8)              # layers x K/V x d_model x float64 bytes
    assert tokens == 16 + 16                                 # blocks of 16: one per input, pads not stored


def test_reordered_self_cache_equals_dynamic_cache():
    """The CPU's dense self-attention cache: stock's K/V after any sequence of updates, reorders (also two
    in a row), growth past its capacity, and the operations that turn it back into a plain DynamicLayer."""
    g = torch.Generator().manual_seed(0)
    ref, ours = T.DynamicCache(), dense_cache.ReorderedCache(capacity=3)

    def step(q, rows=4):
        for layer in range(2):
            k, v = (torch.randn(rows, 2, q, 8, generator=g) for _ in range(2))
            want, got = ref.update(k, v, layer), ours.update(k, v, layer)
            assert all(torch.equal(w, o) for w, o in zip(want, got))
        assert ours.get_seq_length() == ref.get_seq_length()

    step(2)
    for i in range(6):
        for _ in range(2 if i == 3 else 1):
            beam_idx = torch.randint(0, 4, (4,), generator=g)
            ref.reorder_cache(beam_idx)
            ours.reorder_cache(beam_idx)
        step(1)
    spares = ours.layers[0]._spares
    assert spares is ours.layers[1]._spares and len(spares) <= 1     # one spare buffer for all layers
    ref.reorder_cache(torch.tensor([3, 3, 0, 1]))
    ours.reorder_cache(torch.tensor([3, 3, 0, 1]))
    for cache in (ref, ours):
        cache.batch_select_indices(torch.tensor([0, 2]))
        cache.batch_repeat_interleave(2)
    step(1)
    for cache in (ref, ours):
        cache.crop(-2)
    step(1)
    ours.reset()
    assert ours.layers[0]._buffers is None and not ours.layers[0]._spares


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_loss_forward_bit_identical(family):
    stock, cascade = cached_pair(family)
    ids, mask = sources()
    labels = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    want, got = stock(input_ids=ids, attention_mask=mask, labels=labels), \
        cascade(input_ids=ids, attention_mask=mask, labels=labels)
    assert torch.equal(want.logits, got.logits) and torch.equal(want.loss, got.loss)


def test_unsupported_family_refused():
    config = T.ProphetNetConfig(vocab_size=VOCAB, hidden_size=32, encoder_ffn_dim=48, decoder_ffn_dim=48,
                                num_encoder_layers=1, num_decoder_layers=1, num_encoder_attention_heads=4,
                                num_decoder_attention_heads=4, max_position_embeddings=64)
    model = AutoModelForSeq2SeqLM.from_config(config, attn_implementation="cascade").eval()
    with pytest.raises(NotImplementedError,
                       match="encoder-decoder model of type 'prophetnet'.*attn_implementation='(sdpa|eager)'"):
        model.generate(input_ids=torch.ones(1, 4, dtype=torch.long), max_new_tokens=2)


# ---- Whisper: its own generate (init tokens, timestamps, segments, temperature fallback) ------------------
def _whisper_config():
    return T.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                           decoder_ffn_dim=48, init_std=0.2, max_source_positions=32, max_target_positions=64,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3,
                           suppress_tokens=[], begin_suppress_tokens=[])


def whisper_tiny(attn: str, dtype=torch.float64):
    """A tiny random Whisper with the special tokens its generate needs (timestamps: ids 10..95)."""
    model = T.WhisperForConditionalGeneration._from_config(_whisper_config(), attn_implementation=attn,
                                                           dtype=dtype).eval()
    g = model.generation_config
    g.decoder_start_token_id, g.no_timestamps_token_id, g.prev_sot_token_id = 3, 9, 8
    g.lang_to_id, g.task_to_id = {"<|en|>": 4, "<|de|>": 5}, {"transcribe": 6, "translate": 7}
    g.is_multilingual, g.eos_token_id, g.pad_token_id, g.max_initial_timestamp_index = True, 2, 0, 5
    g.suppress_tokens, g.begin_suppress_tokens = [], []
    return model


_WHISPER = {}


def whisper_pair():
    if not _WHISPER:
        torch.manual_seed(0)
        stock = whisper_tiny("sdpa")
        cascade = whisper_tiny("cascade")
        cascade.load_state_dict(stock.state_dict())
        _WHISPER["pair"] = (stock, cascade)
    return _WHISPER["pair"]


_SHORT = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
_LONG = torch.randn(2, 8, 200, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
_LONG_MASK = (torch.arange(200)[None, :] < torch.tensor([[200], [150]])).long()
WHISPER_CASES = {
    "beams": (_SHORT, dict(num_beams=3, no_repeat_ngram_size=2)),
    "beams_returned": (_SHORT, dict(num_beams=3, num_return_sequences=2, no_repeat_ngram_size=2)),
    "timestamps": (_SHORT, dict(num_beams=3, return_timestamps=True)),
    "greedy": (_SHORT, dict()),
    "prompt_shared_by_beams": (_SHORT, dict(num_beams=2, prompt_ids=torch.tensor([8] + list(range(20, 40))),
                                            no_repeat_ngram_size=2)),
    "temperature_fallback": (_SHORT, dict(num_beams=2, temperature=(0.0, 0.4, 0.8), logprob_threshold=0.0,
                                          compression_ratio_threshold=1.2)),
    "long_form": (_LONG, dict(attention_mask=_LONG_MASK, return_timestamps=True, num_beams=2)),
    "language_detected": (_SHORT, dict(num_beams=3, language=None)),
    "long_form_fallback": (_LONG, dict(attention_mask=_LONG_MASK, return_timestamps=True, num_beams=2,
                                       temperature=(0.0, 0.5), logprob_threshold=0.0, condition_on_prev_tokens=True)),
}


@pytest.mark.parametrize("case", list(WHISPER_CASES))
def test_whisper_stock_tokens(case, monkeypatch):
    stock, cascade = whisper_pair()
    features, kwargs = WHISPER_CASES[case]
    fills = []
    original = cross_kv.CrossAttentionCache.fill
    monkeypatch.setattr(cross_kv.CrossAttentionCache, "fill",
                        lambda self, *a: (fills.append(a[1].shape), original(self, *a))[1])
    kwargs = {"language": "en", **kwargs}
    torch.manual_seed(5)
    want = stock.generate(features, max_new_tokens=10, **kwargs)
    torch.manual_seed(5)
    got = cascade.generate(features, max_new_tokens=10, **kwargs)
    assert want.shape == got.shape and torch.equal(want, got)
    # the cascade entry ran with one encoder row per input (also where Whisper repeats the features per
    # returned sequence: identical inputs share their cross K/V)
    assert fills and all(shape[0] <= 2 for shape in fills)


def _beam_search_pair(family, config):
    """Stock's and the cascade's beam search sequences for ``family`` (Whisper: its own generate)."""
    if family == "whisper":
        stock, cascade = whisper_pair()
        kw = dict(language="en", max_new_tokens=8, num_beams=3, no_repeat_ngram_size=2)
        return stock.generate(_SHORT, **kw), cascade.generate(_SHORT, **kw, hf_cascade_config=config)
    stock, cascade = cached_pair(family)
    ids, mask = sources()
    kw = dict(max_new_tokens=NEW, num_beams=4, num_return_sequences=2)
    return (stock.generate(input_ids=ids, attention_mask=mask, **kw),
            cascade.generate(input_ids=ids, attention_mask=mask, **kw, hf_cascade_config=config))


@pytest.mark.parametrize("family", [*FAMILIES, "whisper"])
def test_paged_plan_through_reference_backend(family, monkeypatch):
    """backend="reference" (as on a GPU) reads the cross K/V through the paged plan and backend.attend (what
    the GPU backends serve), block size 4 so inputs span several blocks, and runs the decoder self-attention
    on the paged CascadeCache (T5: DynamicCache); "auto" on the CPU reads the cross K/V in place."""
    config = hf_cascade.CascadeConfig(backend="reference", block_size=4)
    plans = []
    original = cross_kv.CrossAttentionCache.plan
    monkeypatch.setattr(cross_kv.CrossAttentionCache, "plan",
                        lambda self, *a: plans.append(a) or original(self, *a))
    selfs = []
    init = cross_kv.CascadeEncoderDecoderCache.__init__
    monkeypatch.setattr(cross_kv.CascadeEncoderDecoderCache, "__init__",
                        lambda self, own, cross: selfs.append(own) or init(self, own, cross))
    want, got = _beam_search_pair(family, config)
    assert torch.equal(want, got)
    assert plans
    if family not in ("t5", "mt5"):
        assert selfs and all(isinstance(c, hf_cascade.CascadeCache) for c in selfs)


def test_dense_fallbacks_give_stock_tokens(caplog):
    """Options the cascade path does not serve run stock's dense decoding (encoder output expanded as stock)."""
    stock, cascade = cached_pair("bart")
    ids, mask = sources()
    kw = dict(max_new_tokens=5, num_beams=3, return_dict_in_generate=True, output_hidden_states=True)
    with caplog.at_level("WARNING", logger="hf_cascade"):
        got = cascade.generate(input_ids=ids, attention_mask=mask, **kw)
    want = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(want.sequences, got.sequences) and "dense attention" in caplog.text
    assert torch.equal(want.encoder_hidden_states[-1], got.encoder_hidden_states[-1])
    kw = dict(max_new_tokens=5, num_beams=3, use_cache=False)
    assert torch.equal(stock.generate(input_ids=ids, attention_mask=mask, **kw),
                       cascade.generate(input_ids=ids, attention_mask=mask, **kw))


def test_cache_passed_by_the_caller_is_refused():
    _, cascade = cached_pair("bart")
    ids, mask = sources()
    with pytest.raises(ValueError, match="cache_implementation='static' conflicts"):
        cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, num_beams=2,
                         cache_implementation="static")
    cache = hf_cascade.CascadeCache(cascade.config)
    with pytest.raises(ValueError, match="encoder-decoder.*pass no cache"):
        cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, num_beams=2,
                         **cache_kw(cascade, cache))


@pytest.mark.parametrize("mode", ["sample", "greedy"])
@pytest.mark.parametrize("family", ["bart", "marian", "m2m_100"])
def test_paged_self_attention_sampling_and_greedy(family, mode):
    stock, cascade = cached_pair(family)
    ids, mask = sources()
    config = hf_cascade.CascadeConfig(backend="reference", block_size=4)
    want, got = run(stock, ids, mask, mode), run(cascade, ids, mask, mode, hf_cascade_config=config)
    assert torch.equal(want.sequences, got.sequences)


def test_whisper_token_timestamps_warn_and_give_stock_tokens(caplog):
    """Whisper turns the model eager for token timestamps (its own behaviour): logged, stock's tokens."""
    torch.manual_seed(0)
    stock, cascade = whisper_tiny("sdpa"), whisper_tiny("cascade")
    cascade.load_state_dict(stock.state_dict())
    for model in (stock, cascade):
        model.generation_config.alignment_heads = [[0, 0], [1, 1]]
    kw = dict(language="en", max_new_tokens=6, num_beams=2, return_token_timestamps=True)
    want = stock.generate(_SHORT, **kw)
    with caplog.at_level("WARNING", logger="hf_cascade"):
        got = cascade.generate(_SHORT, **kw)
    assert torch.equal(want["sequences"], got["sequences"])
    assert torch.equal(want["token_timestamps"], got["token_timestamps"])
    assert "switches this model to eager attention" in caplog.text


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_beam_sample_and_precomputed_encoder_outputs(family):
    stock, cascade = cached_pair(family)
    ids, mask = sources()
    kw = dict(max_new_tokens=NEW, num_beams=3, do_sample=True, num_return_sequences=2)
    torch.manual_seed(3)
    want = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    torch.manual_seed(3)
    got = cascade.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(want, got)
    # encoder outputs computed by the caller: not expanded per beam either, same tokens
    with torch.no_grad():
        encoded = stock.get_encoder()(input_ids=ids, attention_mask=mask)
    kw = dict(max_new_tokens=NEW, num_beams=4, num_return_sequences=2)
    want = stock.generate(encoder_outputs=encoded, attention_mask=mask, **kw)
    with torch.no_grad():
        encoded = cascade.get_encoder()(input_ids=ids, attention_mask=mask)
    states = encoded.last_hidden_state
    got = cascade.generate(encoder_outputs=encoded, attention_mask=mask, **kw)
    assert torch.equal(want, got)
    assert encoded.last_hidden_state is states                     # the caller's encoder outputs are untouched
    assert torch.equal(cascade.generate(encoder_outputs=encoded, attention_mask=mask, **kw), got)
    greedy = cascade.generate(encoder_outputs=encoded, attention_mask=mask, max_new_tokens=NEW)   # n = 1
    assert encoded.last_hidden_state is states
    assert torch.equal(greedy, stock.generate(encoder_outputs=encoded, attention_mask=mask, max_new_tokens=NEW))


def test_identical_inputs_share_their_cross_kv(monkeypatch):
    stock, cascade = cached_pair("bart")
    ids, mask = sources(lengths=(13, 13, 9, 9), seed=4)
    ids[1], ids[3] = ids[0], ids[2]                               # runs of two identical sources
    fills = []
    original = cross_kv.CrossAttentionCache.fill
    monkeypatch.setattr(cross_kv.CrossAttentionCache, "fill",
                        lambda self, *a: (fills.append(a[1].shape[0]), original(self, *a))[1])
    kw = dict(max_new_tokens=NEW, num_beams=3, num_return_sequences=2, no_repeat_ngram_size=2)
    assert torch.equal(stock.generate(input_ids=ids, attention_mask=mask, **kw),
                       cascade.generate(input_ids=ids, attention_mask=mask, **kw))
    ids[3, 0] = ids[3, 0] % 90 + 4                                # no longer runs of equal length
    assert torch.equal(stock.generate(input_ids=ids, attention_mask=mask, **kw),
                       cascade.generate(input_ids=ids, attention_mask=mask, **kw))
    assert fills == [2, 4]


@pytest.mark.parametrize("family", ["bart", "whisper"])
def test_gpu_pool_layout_through_the_plan(family, monkeypatch):
    """The contiguous [blocks, 2, block_size, H, D] cross pool the GPU kernels take, read through the paged
    plan by the reference backend (on the CPU, as a GPU run would with backend="reference")."""
    monkeypatch.setattr(cross_kv, "in_place_layout", lambda device: False)
    config = hf_cascade.CascadeConfig(block_size=4)
    pools = []
    original = cross_kv.CrossLayer.fill
    monkeypatch.setattr(cross_kv.CrossLayer, "fill",
                        lambda self, *a: (original(self, *a), pools.append(self.pool))[0])
    want, got = _beam_search_pair(family, config)
    assert torch.equal(want, got)
    assert pools and all(p.is_contiguous() and p.shape[1:3] == (2, 4) for p in pools)


# ---- decode steps through the graph runner (its eager form here: the static path a CUDA graph replays) ----------
_STATIC = hf_cascade.CascadeConfig(backend="reference", cuda_graphs="eager", block_size=4)


@pytest.mark.parametrize("case", ["beams", "beams_returned", "timestamps", "prompt_shared_by_beams", "long_form",
                                  "temperature_fallback"])
def test_whisper_decode_steps_through_the_graph_runner(case, monkeypatch):
    """Whisper's decoder takes its positions as an input (decoder_position_ids, from the decoder mask), so its
    decode steps run on fixed inputs and a static layout, replayed step after step; stock's tokens."""
    stock, cascade = whisper_pair()
    features, kwargs = WHISPER_CASES[case]
    kwargs = {"language": "en", **kwargs}
    spy = RunnerSpy(monkeypatch)
    torch.manual_seed(5)
    want = stock.generate(features, max_new_tokens=10, **kwargs)
    torch.manual_seed(5)
    got = cascade.generate(features, max_new_tokens=10, **kwargs, hf_cascade_config=_STATIC)
    assert want.shape == got.shape and torch.equal(want, got)
    runners = [r for r in spy.runners if r is not None]
    assert runners and all(r.disabled is None for r in runners), [r.disabled for r in runners]
    # (replays of transformers' loop, or steps of the whole step on the device where its token choice runs there)
    assert sum(r.replays + r.device_steps for r in runners) >= 5
    assert "forward" not in cascade.__dict__


@pytest.mark.parametrize("family", ["bart", "marian"])
def test_decoders_with_positions_from_the_cache_length_stay_eager(family, monkeypatch):
    """A decoder that computes its positions from the cache length on the host (BART in transformers 5.17) would be
    frozen by a graph: the runner says so and steps run eagerly; stock's tokens either way."""
    stock, cascade = cached_pair(family)
    ids, mask = sources()
    kw = dict(max_new_tokens=NEW, num_beams=4, num_return_sequences=2)
    spy = RunnerSpy(monkeypatch)
    want = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    got = cascade.generate(input_ids=ids, attention_mask=mask, **kw, hf_cascade_config=_STATIC)
    assert torch.equal(want, got)
    runner, = spy.runners
    served = runner.replays + runner.device_steps     # (the whole step on the device runs the same static steps)
    assert (runner.disabled is None and served >= 5) or "positions" in runner.disabled, runner.disabled


# ---- issue 18: padded decoder prompts, hf_cascade_config as a dict, max_kv_bytes -------------------------------
def _padded_decoder_prompt(family, side="left", lengths=(6, 3), n=1):
    """Decoder prompts of different lengths (a prompt per input, padded) and their mask, one row per input."""
    g = torch.Generator().manual_seed(9)
    width = max(lengths)
    start = FAMILIES[family]().decoder_start_token_id if family in FAMILIES else 3
    ids = torch.randint(10, VOCAB, (len(lengths), width), generator=g)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        cols = slice(width - length, width) if side == "left" else slice(0, length)
        mask[row, cols] = 1
        ids[row, cols.start] = start
    return ids.masked_fill(mask == 0, 0), mask


_PAGED = hf_cascade.CascadeConfig(backend="reference", block_size=4)


@pytest.mark.parametrize("config", [None, _PAGED], ids=["dense_self_cache", "paged_self_cache"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", ["bart", "t5", "whisper"])
def test_padded_decoder_prompt_gives_stock_tokens(family, mode, side, config):
    """decoder_attention_mask with zeros (what Whisper's batched long-form builds when its rows' previous text
    differs in length): stock masks the pads; the paged cache never stores them."""
    if family == "whisper":
        stock, cascade = whisper_pair()
        inputs = dict(input_features=_SHORT)
        # Whisper's own generate builds its decoder prompt; GenerationMixin.generate takes one as given
        call = lambda model, **kw: T.GenerationMixin.generate(model, **kw)   # noqa: E731
    else:
        stock, cascade = cached_pair(family)
        ids, mask = sources()
        inputs = dict(input_ids=ids, attention_mask=mask)
        call = lambda model, **kw: model.generate(**kw)   # noqa: E731
    decoder_ids, decoder_mask = _padded_decoder_prompt(family, side)
    kw = dict(**inputs, decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask, max_new_tokens=NEW,
              min_new_tokens=NEW, return_dict_in_generate=True, output_scores=True, **MODES[mode])
    outs = []
    for model, extra in ((stock, {}), (cascade, {} if config is None else {"hf_cascade_config": config})):
        torch.manual_seed(1234)
        outs.append(call(model, **kw, **extra))
    want, got = outs
    assert torch.equal(want.sequences, got.sequences)
    if mode == "beam":
        torch.testing.assert_close(got.sequences_scores, want.sequences_scores, rtol=0, atol=1e-9)


@pytest.mark.parametrize("config", [{"backend": "reference", "block_size": 4},
                                    hf_cascade.CascadeConfig(backend="reference", block_size=4)],
                         ids=["dict", "CascadeConfig"])
@pytest.mark.parametrize("family", ["bart", "whisper"])
def test_cascade_config_as_a_dict(family, config, monkeypatch):
    plans = []
    original = cross_kv.CrossAttentionCache.plan
    monkeypatch.setattr(cross_kv.CrossAttentionCache, "plan",
                        lambda self, *a: plans.append(self.block_size) or original(self, *a))
    want, got = _beam_search_pair(family, config)
    assert torch.equal(want, got)
    assert plans and set(plans) == {4}                           # the dict's values were used


@pytest.mark.parametrize("config,error,match", [
    ({"blocksize": 4}, TypeError, "blocksize.*did you mean 'block_size'"),
    ({"block_size": 0}, ValueError, "block_size must be an int >= 1"),
    ({"backend": "fast"}, ValueError, "backend must be one of"),
])
def test_bad_cascade_config_dict_names_the_field(config, error, match):
    _, cascade = cached_pair("bart")
    ids, mask = sources()
    with pytest.raises(error, match=match):
        cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, num_beams=2, hf_cascade_config=config)


def _kv_bytes_reached(cache, seen: dict) -> int:
    """Bytes of the distinct storages of K/V that ``cache`` holds now, read from the tensors themselves."""
    tensors = []
    caches = [cache.self_attention_cache, cache.cross_attention_cache] if hasattr(cache, "cross_attention_cache") \
        else [cache]
    for part in caches:
        for layer in part.layers:
            for name in ("pool", "kv", "keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor) and t.stride() != (0,) * t.dim():
                    tensors.append(t)
            tensors += list(getattr(layer, "_buffers", None) or ()) + list(getattr(layer, "_spares", {}).values())
            storage = getattr(layer, "storage", None)
            if storage is not None:
                tensors.append(storage.tensor)
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class KVMeter:
    """The largest K/V footprint the model's forwards saw (each forward's cache, measured before and after)."""

    def __init__(self, model):
        self.peak = 0
        self.handles = [model.register_forward_pre_hook(self._hook, with_kwargs=True),
                        model.register_forward_hook(self._hook_after, with_kwargs=True)]

    def _measure(self, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and hasattr(cache, "layers") or hasattr(cache, "cross_attention_cache"):
            self.peak = max(self.peak, _kv_bytes_reached(cache, {}))

    def _hook(self, module, args, kwargs):
        self._measure(kwargs)

    def _hook_after(self, module, args, kwargs, output):
        self._measure(kwargs)

    def remove(self):
        for h in self.handles:
            h.remove()


def _capped_call(family, config, output_hidden_states=False):
    if family == "whisper":
        stock, cascade = whisper_pair()
        kw = dict(language="en", max_new_tokens=8, num_beams=3)
        args = (_SHORT,)
    else:
        stock, cascade = cached_pair(family)
        ids, mask = sources()
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, num_beams=4, num_return_sequences=2)
        args = ()
    if output_hidden_states:
        kw.update(return_dict_in_generate=True, output_hidden_states=True)
    meter = KVMeter(cascade)
    try:
        got = cascade.generate(*args, **kw, hf_cascade_config=config)
    finally:
        meter.remove()
    want = stock.generate(*args, **kw)
    return want, got, meter.peak


@pytest.mark.parametrize("paged", [False, True], ids=["dense_self_cache", "paged_self_cache"])
@pytest.mark.parametrize("family", ["bart", "t5", "whisper"])
def test_max_kv_bytes_holds(family, paged):
    """The cap counts the cross K/V and the self-attention cache (dense or paged): a small one raises
    PoolExhausted naming max_kv_bytes before it is passed; a large enough one gives stock's tokens, and the K/V
    measured in every forward never exceed it."""
    base = dict(backend="reference", block_size=4) if paged else {}
    with pytest.raises(hf_cascade.PoolExhausted, match="max_kv_bytes"):
        _capped_call(family, {**base, "max_kv_bytes": 2048})
    # find what the call needs on the path a capped call takes (a cap no call reaches), then cap just above it (and a
    # little below: refused)
    want, got, need = _capped_call(family, hf_cascade.CascadeConfig(**base, max_kv_bytes=1 << 40))
    assert torch.equal(want, got) and need > 2048
    want, got, peak = _capped_call(family, {**base, "max_kv_bytes": need})
    assert torch.equal(want, got) and 0 < peak <= need
    with pytest.raises(hf_cascade.PoolExhausted, match="max_kv_bytes"):
        _capped_call(family, {**base, "max_kv_bytes": need // 2})


def test_max_kv_bytes_holds_on_the_dense_fallback():
    """output_hidden_states runs stock's dense decoding: its caches count against the cap too."""
    want, got, need = _capped_call("bart", None, output_hidden_states=True)
    assert torch.equal(want.sequences, got.sequences) and need > 0
    want, got, peak = _capped_call("bart", {"max_kv_bytes": need}, output_hidden_states=True)
    assert torch.equal(want.sequences, got.sequences) and peak <= need
    with pytest.raises(hf_cascade.PoolExhausted, match="max_kv_bytes"):
        _capped_call("bart", {"max_kv_bytes": need // 2}, output_hidden_states=True)
