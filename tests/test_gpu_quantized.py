"""Quantized weights on the GPU: a small random Llama (hidden 512, 4 layers) loaded with a ``quantization_config`` and
``attn_implementation="cascade"`` against the same checkpoint, same quantization, on stock sdpa.

- float32 compute (TF32 off) where the quantizer takes it: weight-only quantizers give stock's tokens; quantizers
  that round the activations too (bitsandbytes 8-bit, torchao float8 dynamic) are held to >= 90% token agreement
  (a float32 rounding difference in attention can move an activation across a rounding step).
- bf16: token agreement and the log-prob gap are printed (random-weight models have near-flat distributions, where
  bf16 flips tokens between any two attention implementations; nothing is asserted of them).
- Graphs: bitsandbytes nf4 and torchao are captured (the whole step, and the runner's per-step graph); bitsandbytes
  8-bit with outlier decomposition is refused with its reason (a host sync in every layer); 8-bit without it
  (``llm_int8_threshold=0.0``) is reported, captured or not.

Run on the GPU machine (the quantizers from tools/prepare_quant_wheels.sh; -s shows the figures):
``source .device/quant/setup.sh && PYTHONPATH=. python -m pytest -q -s -m gpu tests/test_gpu_quantized.py``.
"""
from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_cascade  # noqa: F401  registers "cascade"
from hf_cascade import CascadeConfig, graphs

from conftest import RunnerSpy, host_loop

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             intermediate_size=1024, vocab_size=1000, max_position_embeddings=8192, pad_token_id=0,
             bos_token_id=None, eos_token_id=None)
F32, BF16 = torch.float32, torch.bfloat16


def _bnb(**fields):
    def make(dtype):
        pytest.importorskip("bitsandbytes")
        from transformers import BitsAndBytesConfig
        extra = dict(bnb_4bit_compute_dtype=dtype) if fields.get("load_in_4bit") else {}
        return BitsAndBytesConfig(**fields, **extra)
    return make


def _torchao(config_name, **fields):
    def make(dtype):
        ao = pytest.importorskip("torchao.quantization")
        from transformers import TorchAoConfig
        return TorchAoConfig(getattr(ao, config_name)(**fields))
    return make


# name: (quantization config for a compute dtype, the compute dtypes it takes)
QUANTIZERS = {
    "bnb-nf4": (_bnb(load_in_4bit=True, bnb_4bit_quant_type="nf4"), (F32, BF16)),
    "bnb-int8": (_bnb(load_in_8bit=True), (F32, BF16)),
    "bnb-int8-no-outliers": (_bnb(load_in_8bit=True, llm_int8_threshold=0.0), (F32, BF16)),
    # tinygemm (aten._weight_int4pack_mm): the default "plain" packing needs mslk, which has no wheel for the GPU
    # machine; this packing takes bfloat16 only
    "torchao-int4-weight-only": (_torchao("Int4WeightOnlyConfig", group_size=128,
                                          int4_packing_format="tile_packed_to_4d"), (BF16,)),
    "torchao-float8-dynamic": (_torchao("Float8DynamicActivationFloat8WeightConfig"), (F32, BF16)),
    "torchao-int8-weight-only": (_torchao("Int8WeightOnlyConfig"), (F32, BF16)),
}
ACTIVATION_ROUNDING = {"bnb-int8", "bnb-int8-no-outliers", "torchao-float8-dynamic"}
REFUSED = {"bnb-int8": "llm_int8_threshold=6.0"}       # capture refused up front (steps run eagerly), so said
REPORTED = {"bnb-int8-no-outliers"}                     # captured or not: reported, not asserted
CASES = [(name, dtype) for name, (_, dtypes) in QUANTIZERS.items() for dtype in dtypes]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama-512")
    AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), dtype=torch.float32).save_pretrained(path)
    return path


def _load(checkpoint, name, dtype, attn):
    make, _ = QUANTIZERS[name]
    return AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation=attn, dtype=dtype, device_map="cuda",
                                                quantization_config=make(dtype)).eval()


def _batch(lengths=(300, 200, 250), seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, 1000, (len(lengths), width), generator=g)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        mask[r, width - n:] = 1
    return ids.masked_fill(mask == 0, 0).cuda(), mask.cuda()


def _agreement(a, b, prompt_width):
    return (a[:, prompt_width:] == b[:, prompt_width:]).float().mean().item()


def _capture_state(runner, caplog) -> str:
    if runner is None:
        return "refused"
    if runner.captures and runner.disabled is None:
        return f"captured ({runner.captures} captures, {runner.replays} replays)"
    said = [r.getMessage() for r in caplog.records if "capture" in r.getMessage() or "without CUDA" in r.getMessage()]
    return f"not captured: {runner.disabled or said}"


@pytest.mark.parametrize("whole_step", [True, False], ids=["whole step", "runner"])
@pytest.mark.parametrize("name,dtype", CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_quantized_cascade_against_quantized_stock(checkpoint, name, dtype, whole_step, no_tf32, monkeypatch,
                                                   caplog):
    caplog.set_level(logging.INFO, logger="hf_cascade")
    try:
        stock = _load(checkpoint, name, dtype, "sdpa")
    except (RuntimeError, AssertionError, ValueError, NotImplementedError) as err:
        if dtype != F32:
            raise
        pytest.skip(f"{name} does not quantize float32 weights here: {type(err).__name__}: {str(err)[:200]}")
    cascade = _load(checkpoint, name, dtype, "cascade")       # (stock's loaded: a failure here is ours)
    ids, mask = _batch()
    # the whole step keeps no per-step outputs: scores from the runner's path only
    scored = not whole_step
    kw = dict(input_ids=ids, attention_mask=mask, num_beams=4, num_return_sequences=2, max_new_tokens=24,
              pad_token_id=0, return_dict_in_generate=scored, output_scores=scored, **(host_loop() if scored else {}))
    expected = stock.generate(**kw)
    spy = RunnerSpy(monkeypatch)
    got = cascade.generate(**kw)       # (scored: host_loop() keeps transformers' loop around the runner)
    runner, = spy.runners
    gap = None
    if scored:
        same = (expected.sequences == got.sequences).all(dim=1)
        gap = (expected.sequences_scores - got.sequences_scores)[same].abs().max().item() if same.any() else None
        expected, got = expected.sequences, got.sequences
    agreement = _agreement(expected, got, ids.shape[1])
    state = _capture_state(runner, caplog)
    print(f"\n[quantized] {name} {dtype} {'whole step' if whole_step else 'runner'}: token agreement "
          f"{agreement:.3f}, log-prob gap (equal beams) {gap}, graphs {state}")

    if name in REFUSED:     # (the one loop runs the steps eagerly: a runner that captures nothing)
        assert runner is not None and runner.captures == 0 and runner.device_steps > 0, state
        assert REFUSED[name] in graphs.capture_reason(cascade, CascadeConfig())
    elif name not in REPORTED:
        assert runner is not None and runner.captures >= 1 and runner.disabled is None, state
    if dtype == F32:
        if name in ACTIVATION_ROUNDING:
            assert agreement >= 0.9, agreement
        else:
            assert torch.equal(expected, got), agreement
