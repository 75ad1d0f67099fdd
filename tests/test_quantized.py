"""Quantized weights on the CPU: a model loaded with a ``quantization_config`` and ``attn_implementation="cascade"``
gives the tokens of the same quantized model on stock sdpa (float32 compute: neither quantizer here takes float64),
on every decode path the CPU has (per-step plans, the graph runner's static path, the whole step), and the layers
whose kernels synchronise with the host refuse capture with the reason.

Quantizers with CPU kernels in the versions pip gives for torch 2.13: torchao int8 weight-only, int8 dynamic
activation, float8 weight-only (int4 tile-packed and float8 dynamic activation need CUDA); bitsandbytes nf4 and 8-bit.
Each test skips where its package is not installed (CI does not install them). GPU: tests/test_gpu_quantized.py.
"""
from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_cascade
from hf_cascade import CascadeConfig, graphs

from conftest import RunnerSpy, host_loop, padded_batch, returned_cache, tiny_config

SHAPE = dict(hidden_size=128, intermediate_size=256)      # bitsandbytes quantizes blocks of 64 inputs


def _torchao(config_name):
    def make():
        ao = pytest.importorskip("torchao.quantization")
        from transformers import TorchAoConfig
        return TorchAoConfig(getattr(ao, config_name)())
    return make


def _bnb(**fields):
    def make():
        pytest.importorskip("bitsandbytes")
        from transformers import BitsAndBytesConfig
        return BitsAndBytesConfig(**fields)
    return make


QUANTIZERS = {
    "torchao-int8-weight-only": _torchao("Int8WeightOnlyConfig"),
    "torchao-int8-dynamic": _torchao("Int8DynamicActivationInt8WeightConfig"),
    "torchao-float8-weight-only": _torchao("Float8WeightOnlyConfig"),
    "bnb-nf4": _bnb(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
    "bnb-int8": _bnb(load_in_8bit=True),
    "bnb-int8-no-outliers": _bnb(load_in_8bit=True, llm_int8_threshold=0.0),
}

# quantizers that round the activations: to int8 (torchao dynamic, bitsandbytes 8-bit), or to bf16 (bitsandbytes'
# CPU 4-bit kernel for a single input row takes bf16 only). A float32 rounding difference in the attention output
# (the cascade's merge vs sdpa's one softmax) can move an activation across a rounding step, which moves the
# log-probs by ~1e-3 (the tokens stay equal); weight-only float32 quantizers agree to ~5e-5 after 8 steps
ACTIVATION_ROUNDING = {"torchao-int8-dynamic", "bnb-int8", "bnb-int8-no-outliers", "bnb-nf4"}

PATHS = {
    "per-step plans": CascadeConfig(cuda_graphs=False),      # transformers' loop, no runner
    "default": CascadeConfig(),                              # on the CPU: the whole step's eager steps
    "runner": CascadeConfig(cuda_graphs="eager"),           # host_loop() keeps transformers' loop around the runner
    "whole step": CascadeConfig(cuda_graphs="eager"),       # tokens only: the token choice on the device
    "whole step, host choice": CascadeConfig(cuda_graphs="eager"),  # scores: the token choice on the host
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama saved in float32, for from_pretrained to quantize as it loads."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    AutoModelForCausalLM.from_config(tiny_config("llama", **SHAPE), dtype=torch.float32).save_pretrained(path)
    return path


def _load(checkpoint, quantizer: str, attn: str):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation=attn, dtype=torch.float32,
                                                 quantization_config=QUANTIZERS[quantizer](), device_map="cpu")
    return model.eval()


_loaded: dict = {}


@pytest.fixture(params=list(QUANTIZERS))
def quantized_pair(request, checkpoint):
    """(stock sdpa model, cascade model), the same checkpoint quantized by the same config (kept for the module)."""
    return _pair(checkpoint, request.param)


def _pair(checkpoint, name):
    if name not in _loaded:
        _loaded.clear()                  # one pair alive at a time
        stock, cascade = _load(checkpoint, name, "sdpa"), _load(checkpoint, name, "cascade")
        _assert_quantized(cascade, name)
        _loaded[name] = stock, cascade
    return (name, *_loaded[name])


def _assert_quantized(model, name):
    """The weights really are the quantizer's (a silent fallback to float32 weights would make the test vacuous)."""
    proj = model.model.layers[0].self_attn.q_proj
    kind = f"{type(proj).__module__}.{type(proj).__name__} / {type(proj.weight).__module__}"
    assert ("bitsandbytes" in kind) if name.startswith("bnb") else ("torchao" in kind), kind


@pytest.mark.parametrize("path", list(PATHS))
def test_beam_search_gives_the_quantized_stock_tokens(quantized_pair, path, monkeypatch):
    name, stock, cascade = quantized_pair
    ids, mask = padded_batch(seed=3)
    # scores keep the whole step's token choice on the host (hf_cascade.host_select); host_loop() keeps the runner in
    # transformers' loop
    scored = path != "whole step"
    kw = dict(input_ids=ids, attention_mask=mask, num_beams=4, num_return_sequences=2, max_new_tokens=8,
              pad_token_id=0, return_dict_in_generate=scored, output_scores=scored,
              **(host_loop() if path == "runner" else {}))
    expected = stock.generate(**kw)
    spy = RunnerSpy(monkeypatch)
    got = cascade.generate(**kw, hf_cascade_config=PATHS[path])
    if scored:
        tol = 2e-3 if name in ACTIVATION_ROUNDING else 1e-4
        torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, rtol=tol, atol=tol)
        cache = returned_cache(got)
        assert isinstance(cache, hf_cascade.CascadeCache)
        # the pools hold the K/V the layers computed (float32), not the stored weights' dtype (int8, uint8, float8)
        assert {layer.storage.dtype for layer in cache.layers if layer.storage is not None} == {torch.float32}
        expected, got = expected.sequences, got.sequences
    assert torch.equal(expected, got), name
    runner, = spy.runners
    if path == "per-step plans":
        assert runner is None
    elif path == "default":
        assert not runner.capture_enabled and runner.device_steps >= 5
    else:
        assert runner.disabled is None, runner.disabled
        assert (runner.replays if path == "runner" else runner.device_steps) >= 5


@pytest.mark.parametrize("whole_step", [False, True], ids=["runner", "whole step"])
def test_sampling_gives_the_quantized_stock_tokens(quantized_pair, whole_step, monkeypatch):
    name, stock, cascade = quantized_pair
    ids, mask = padded_batch(seed=4)
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=True, num_return_sequences=3, top_k=0,
              max_new_tokens=8, pad_token_id=0)
    torch.manual_seed(5)
    expected = stock.generate(**kw)
    spy = RunnerSpy(monkeypatch)
    torch.manual_seed(5)
    got = cascade.generate(**kw, **({} if whole_step else host_loop()),
                           hf_cascade_config=CascadeConfig(cuda_graphs="eager"))
    assert torch.equal(expected, got), name
    runner, = spy.runners
    assert runner.disabled is None and (runner.device_steps if whole_step else runner.replays) >= 5


def test_capture_refused_only_where_a_quantized_kernel_syncs_the_host(quantized_pair):
    """bitsandbytes 8-bit with outlier decomposition (the default threshold 6.0) tests ``outliers.any()`` on the
    host: capture is refused with that reason (before the CPU's own "not CUDA"), the eager static path is not.
    Every other quantizer's layers are no reason to refuse."""
    name, _, cascade = quantized_pair
    captured = graphs.unsupported_reason(cascade, CascadeConfig(cuda_graphs=True))
    assert graphs.unsupported_reason(cascade, CascadeConfig(cuda_graphs="eager")) is None
    if name == "bnb-int8":
        assert "llm_int8_threshold=6.0" in captured and "llm_int8_threshold=0.0" in captured, captured
        assert "outliers on the host" in graphs.quantized_capture_reason(cascade)
    else:
        assert graphs.quantized_capture_reason(cascade) is None
        assert captured == "the model is on cpu, not CUDA"


def test_generate_with_graphs_asked_for_says_why_bnb_int8_steps_run_eagerly(checkpoint, monkeypatch, caplog):
    """``cuda_graphs=True`` on a model whose layers sync the host: its steps run eagerly on the runner, the reason
    logged as a warning (the quantizer's, ahead of the CPU's own), stock's tokens."""
    _, stock, cascade = _pair(checkpoint, "bnb-int8")
    caplog.set_level(logging.INFO, logger="hf_cascade")
    ids, mask = padded_batch(seed=6)
    kw = dict(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=6, pad_token_id=0)
    expected = stock.generate(**kw)
    spy = RunnerSpy(monkeypatch)
    got = cascade.generate(**kw, hf_cascade_config=CascadeConfig(cuda_graphs=True))
    assert torch.equal(expected, got)
    runner, = spy.runners
    assert not runner.capture_enabled and runner.captures == 0 and runner.device_steps >= 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("without CUDA graphs" in m and "llm_int8_threshold=6.0" in m for m in warned), warned
