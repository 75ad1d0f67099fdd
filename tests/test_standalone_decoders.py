"""Decoders of encoder-decoder families used alone (``*ForCausalLM``) or inside EncoderDecoderModel /
VisionEncoderDecoderModel, token-exact against stock sdpa in float64.

Used alone (no cross-attention inputs) they run the decoder-only cascade: each prompt prefilled once into a
CascadeCache. Given ``encoder_hidden_states`` they run on stock's path (logged), and a caller's CascadeCache
is refused. The composite models run on stock's path (logged once). TrOCR's decoder computes attention in
its own code: refused alone, with the reason and the attention to load instead.
"""
from __future__ import annotations

import logging

import pytest
import torch
import transformers as T

import hf_cascade
from hf_cascade import CascadeCache, generation, logs
from conftest import FirstForwardRows, cache_kw, padded_batch

V = 96
_BART = dict(vocab_size=V, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=48,
             encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=48, max_position_embeddings=64,
             pad_token_id=0, bos_token_id=1, eos_token_id=None, decoder_start_token_id=2, init_std=0.2)
DECODERS = {
    "BartForCausalLM": lambda: T.BartConfig(**_BART),
    "MBartForCausalLM": lambda: T.MBartConfig(**_BART),
    "MarianForCausalLM": lambda: T.MarianConfig(**_BART, decoder_vocab_size=V),
    "WhisperForCausalLM": lambda: T.WhisperConfig(
        vocab_size=V, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_source_positions=32,
        max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=None, decoder_start_token_id=3,
        init_std=0.2),
}
MODES = {
    "beam": dict(num_beams=4, num_return_sequences=2),
    "sample": dict(do_sample=True, num_return_sequences=3, top_k=0),
    "greedy": dict(),
}


def pair(make_model, stock_attention="sdpa"):
    torch.manual_seed(0)
    stock, cascade = make_model(stock_attention), make_model("cascade")
    cascade.load_state_dict(stock.state_dict())
    assert cascade.config._attn_implementation == "cascade"
    return stock.eval(), cascade.eval()


def decoder_pair(name):
    return pair(lambda attn: getattr(T, name)._from_config(DECODERS[name](), attn_implementation=attn,
                                                           dtype=torch.float64))


def both(stock, cascade, seed=1, cascade_kw=None, **kw):
    outs = []
    for model, extra in ((stock, {}), (cascade, cascade_kw or {})):
        torch.manual_seed(seed)
        outs.append(model.generate(max_new_tokens=6, pad_token_id=0, return_dict_in_generate=True,
                                   output_scores=True, **kw, **extra))
    return outs


def assert_same(want, got):
    assert torch.equal(want.sequences, got.sequences)
    if getattr(want, "sequences_scores", None) is not None:
        torch.testing.assert_close(got.sequences_scores, want.sequences_scores, rtol=0, atol=1e-9)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(DECODERS))
def test_decoder_alone_runs_the_cascade(name, mode):
    stock, cascade = decoder_pair(name)
    assert generation.unsupported_reason(cascade) is None
    ids, mask = padded_batch(seed=4, lengths=(11, 7))
    rows = FirstForwardRows(cascade)
    try:
        want, got = both(stock, cascade, input_ids=ids, attention_mask=mask, **MODES[mode],
                         cascade_kw=cache_kw(cascade, CascadeCache(cascade.config)))
    finally:
        rows.remove()
    assert_same(want, got)
    assert rows.rows[0] == 2 and isinstance(rows.caches[0], CascadeCache)   # each prompt prefilled once


@pytest.mark.parametrize("name", ["BartForCausalLM", "WhisperForCausalLM"])
def test_decoder_alone_with_encoder_states_runs_on_stock_path(name, caplog):
    stock, cascade = decoder_pair(name)
    ids, mask = padded_batch(seed=5, lengths=(9, 6))
    states = torch.randn(2, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    if name == "WhisperForCausalLM":       # its forward takes encoder_outputs; generate does not expand them
        kw = dict(input_ids=ids, attention_mask=mask, encoder_outputs=(states,), do_sample=True)
    else:
        kw = dict(input_ids=ids, attention_mask=mask, encoder_hidden_states=states, num_beams=3)
    rows = FirstForwardRows(cascade)
    try:
        with caplog.at_level(logging.INFO, logger="hf_cascade"):
            want, got = both(stock, cascade, **kw)
    finally:
        rows.remove()
    assert_same(want, got)
    assert "cross-attention inputs (encoder_" in caplog.text and "stock's dense path" in caplog.text
    assert not any(isinstance(c, CascadeCache) for c in rows.caches)
    # test setup: the encoder states matter
    without = {k: v for k, v in kw.items() if not k.startswith("encoder_")}
    assert not torch.equal(want.sequences, both(stock, stock, **without)[0].sequences)
    with pytest.raises(ValueError, match="cross-attention inputs.*Pass no cache"):
        cascade.generate(**kw, max_new_tokens=3, pad_token_id=0, **cache_kw(cascade, CascadeCache(cascade.config)))


def _encoder_decoder_model(attn):
    encoder = T.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=48, max_position_embeddings=64, initializer_range=0.2)
    decoder = T.BartConfig(**_BART, is_decoder=True, add_cross_attention=True)
    config = T.EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = 2, 0
    return T.EncoderDecoderModel._from_config(config, attn_implementation=attn, dtype=torch.float64)


def _vision_encoder_decoder_model(attn, decoder="mbart"):
    encoder = T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                          image_size=16, patch_size=8, num_channels=3, initializer_range=0.2)
    if decoder == "trocr":
        dec = T.TrOCRConfig(vocab_size=V, d_model=32, decoder_layers=2, decoder_attention_heads=4,
                            decoder_ffn_dim=48, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                            eos_token_id=None, decoder_start_token_id=2, init_std=0.2)
    else:
        dec = T.MBartConfig(**_BART)
    dec.is_decoder, dec.add_cross_attention = True, True
    config = T.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, dec)
    config.decoder_start_token_id, config.pad_token_id = 2, 0
    return T.VisionEncoderDecoderModel._from_config(config, attn_implementation=attn, dtype=torch.float64)


COMPOSITES = {
    "EncoderDecoderModel": (_encoder_decoder_model,
                            lambda: dict(input_ids=padded_batch(seed=7, lengths=(10, 6))[0],
                                         attention_mask=padded_batch(seed=7, lengths=(10, 6))[1])),
    "VisionEncoderDecoderModel": (_vision_encoder_decoder_model,
                                  lambda: dict(pixel_values=torch.randn(2, 3, 16, 16, dtype=torch.float64,
                                                                        generator=torch.Generator().manual_seed(8)))),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(COMPOSITES))
def test_composite_models_run_on_stock_path(name, mode, caplog, monkeypatch):
    make, inputs = COMPOSITES[name]
    stock, cascade = pair(make)
    monkeypatch.setattr(logs, "_logged", set())
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        want, got = both(stock, cascade, **inputs(), **MODES[mode])
    assert_same(want, got)
    assert "runs generate on stock's dense path" in caplog.text


def test_composite_model_holds_max_kv_bytes():
    stock, cascade = pair(_encoder_decoder_model)
    kw = dict(**COMPOSITES["EncoderDecoderModel"][1](), num_beams=3, max_new_tokens=4, pad_token_id=0)
    with pytest.raises(hf_cascade.PoolExhausted, match="max_kv_bytes=1024"):
        cascade.generate(**kw, hf_cascade_config={"max_kv_bytes": 1024})
    assert torch.equal(stock.generate(**kw), cascade.generate(**kw, hf_cascade_config={"max_kv_bytes": 10 ** 7}))


def test_trocr_decoder_alone_is_refused_with_the_reason():
    """TrOCR's attention is its own code (no ALL_ATTENTION_FUNCTIONS call): the cascade would never run, and a
    CascadeCache would hand it only the new K/V. Refused, naming eager (TrOCR has no sdpa)."""
    config = T.TrOCRConfig(vocab_size=V, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=48,
                           max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    model = T.TrOCRForCausalLM._from_config(config, attn_implementation="cascade").eval()
    with pytest.raises(NotImplementedError, match="computes attention in its own code.*attn_implementation='eager'"):
        model.generate(input_ids=torch.tensor([[3, 4, 5]]), max_new_tokens=2, num_beams=2)
    T.TrOCRForCausalLM._from_config(config, attn_implementation="eager")    # what the message names loads


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", ["BartForCausalLM", "WhisperForCausalLM"])
def test_decoder_alone_with_a_shared_system_prompt(name, padded):
    """These decoders take their positions from the cache length (columns, pads included), not from the mask:
    a prefix common to the batch is stored once where the rows are unpadded, and per row where padding shifts
    them (stock's positions either way)."""
    stock, cascade = decoder_pair(name)
    g = torch.Generator().manual_seed(9)
    system = torch.randint(3, V, (20,), generator=g)
    tails = (torch.randint(3, V, (6,), generator=g), torch.randint(3, V, (6 if not padded else 3,), generator=g))
    width = 26
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tail in enumerate(tails):
        seq = torch.cat([system, tail])
        ids[row, width - len(seq):], mask[row, width - len(seq):] = seq, 1
    want, got = both(stock, cascade, input_ids=ids, attention_mask=mask, num_beams=3,
                     cascade_kw=cache_kw(cascade, CascadeCache(cascade.config)))
    assert_same(want, got)
    shared = generation._shareable_length(cascade, 16, ids[:, :-1], mask[:, :-1], None, {})
    assert shared == (0 if padded else 20)


def test_trocr_inside_vision_encoder_decoder_is_refused_with_the_reason():
    """TrOCR's own attention code cannot take the "cascade" mask even on stock's path: refused before running,
    naming eager (TrOCR has no sdpa), which then runs."""
    model = _vision_encoder_decoder_model("cascade", "trocr").eval()
    pixels = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match=r"decoder \(TrOCRForCausalLM\) computes attention in its own "
                                                  r"code.*attn_implementation='eager'"):
        model.generate(pixel_values=pixels, max_new_tokens=2, num_beams=2)
    _vision_encoder_decoder_model("eager", "trocr").eval().generate(pixel_values=pixels, max_new_tokens=2)


def test_a_decoder_only_model_without_transformers_flag_is_served():
    """StableLM routes its attention through ALL_ATTENTION_FUNCTIONS without `_supports_attention_backend`
    (it was refused for the flag): served, stock's tokens."""
    def config():
        return T.StableLmConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    stock, cascade = pair(lambda attn: T.AutoModelForCausalLM.from_config(config(), attn_implementation=attn,
                                                                           dtype=torch.float64))
    assert not getattr(cascade, "_supports_attention_backend", False) and generation.unsupported_reason(cascade) is None
    ids, mask = padded_batch(seed=10)
    want, got = both(stock, cascade, input_ids=ids, attention_mask=mask, num_beams=3,
                     cascade_kw=cache_kw(cascade, CascadeCache(cascade.config)))
    assert_same(want, got)
