"""CUDA graphs of the decode step (hf_cascade.graphs) on the GPU: a replayed step equals the eager step on the
same static plan bitwise (bf16), float32 with TF32 off gives stock's tokens, graphs are reused for the call and
re-captured when a pool moves, and a failing step leaves nothing captured behind. Models with sliding windows
(rows that pass the window while the graph replays), softcap and sinks are captured too.

Run on the GPU machine: ``pytest -m gpu tests/decode/test_gpu_graphs.py``.
"""
from __future__ import annotations

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, GptOssConfig, LlamaConfig, MistralConfig,
                          StoppingCriteriaList)

import hf_cascade
from hf_cascade import CascadeConfig, graphs

from conftest import RunnerSpy, host_loop

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             intermediate_size=1024, vocab_size=1000, max_position_embeddings=8192, pad_token_id=0,
             bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), attn_implementation="cascade",
                                             dtype=torch.bfloat16)
    return m.eval()


def float32_pair(shape: dict):
    """(stock sdpa, cascade) float32 Llamas of ``shape`` on CUDA with the same random weights."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        stock = AutoModelForCausalLM.from_config(LlamaConfig(**shape), attn_implementation="sdpa",
                                                 dtype=torch.float32).eval()
        cascade = AutoModelForCausalLM.from_config(LlamaConfig(**shape), attn_implementation="cascade",
                                                   dtype=torch.float32).eval()
    cascade.load_state_dict(stock.state_dict())
    return stock, cascade


def _batch(lengths, seed=0, shared=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, 1000, (len(lengths), width), generator=g)
    if shared:
        ids[:, width - min(lengths): width - min(lengths) + shared] = ids[0, width - min(lengths):
                                                                            width - min(lengths) + shared]
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        mask[r, width - n:] = 1
    return ids.masked_fill(mask == 0, 0).cuda(), mask.cuda()


CASES = {
    "beam": dict(num_beams=4, num_return_sequences=2),
    "beam-eos": dict(num_beams=4, eos_token_id=[5, 6, 7, 8, 9], early_stopping=True),
    "sample": dict(do_sample=True, num_return_sequences=3, top_k=0),
    "greedy": dict(do_sample=False),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["cuda", "reference"])
@pytest.mark.parametrize("memory", ["vmm", "grow"])
@pytest.mark.parametrize("shared", [0, 300])
def test_replay_equals_eager_bitwise(model, monkeypatch, case, backend, memory, shared):
    """Same tokens and bitwise-equal scores: the graph replays exactly the eager static step. block_size 4
    makes the pool grow during decode (a grow pool moves: re-captured)."""
    if memory == "vmm" and hf_cascade.memory.vmm_unavailable_reason("cuda"):
        pytest.skip("no CUDA virtual memory here")
    ids, mask = _batch((700, 460, 590), seed=1, shared=shared)
    kw = dict(max_new_tokens=40, pad_token_id=0, return_dict_in_generate=True, output_scores=True, **CASES[case],
              **host_loop())      # (transformers' loop around the runner)
    outs = []
    spy = RunnerSpy(monkeypatch)
    for mode in ("eager", True):
        torch.manual_seed(11)
        config = CascadeConfig(cuda_graphs=mode, backend=backend, memory=memory, block_size=4)
        outs.append(model.generate(input_ids=ids, attention_mask=mask, hf_cascade_config=config, **kw))
    eager_run, graph_run = spy.runners
    assert graph_run.disabled is None, graph_run.disabled
    assert graph_run.captures >= 1 and graph_run.replays >= 30
    if memory == "vmm":
        assert graph_run.captures == 1                   # the pool never moves
    a, b = outs
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores):
        assert torch.equal(sa, sb)
    assert "forward" not in model.__dict__


def test_float32_graphs_give_stock_tokens(monkeypatch):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    stock, cascade = float32_pair(SHAPE)
    ids, mask = _batch((300, 210), seed=2)
    spy = RunnerSpy(monkeypatch)
    for case in ("beam", "greedy"):
        kw = dict(max_new_tokens=24, pad_token_id=0, **CASES[case])
        expected = stock.generate(input_ids=ids, attention_mask=mask, **kw)
        got = cascade.generate(input_ids=ids, attention_mask=mask, hf_cascade_config=CascadeConfig(cuda_graphs=True),
                               **kw)
        assert torch.equal(expected, got), case
    assert all(r.disabled is None and r.replays > 10 for r in spy.runners)


def test_exception_inside_a_step_leaves_no_graph_and_next_call_is_the_same(model, monkeypatch):
    ids, mask = _batch((500, 380), seed=3)
    kw = dict(num_beams=4, max_new_tokens=20, pad_token_id=0, hf_cascade_config=CascadeConfig(cuda_graphs=True))
    expected = model.generate(input_ids=ids, attention_mask=mask, **kw)
    calls = []

    def boom(input_ids, scores, **_):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    with pytest.raises(KeyboardInterrupt):
        model.generate(input_ids=ids, attention_mask=mask, stopping_criteria=StoppingCriteriaList([boom]), **kw)
    assert "forward" not in model.__dict__
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **kw), expected)


def test_graphs_are_off_when_asked_and_for_several_devices(model, monkeypatch, caplog):
    spy = RunnerSpy(monkeypatch)
    ids, mask = _batch((200,), seed=4)
    # two beams: a call that shares nothing (greedy) would run on stock's path and make no runner at all
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, num_beams=2,
                   hf_cascade_config=CascadeConfig(cuda_graphs=False))
    assert spy.runners == [None]
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}
    try:
        assert "several devices" in graphs.unsupported_reason(model, CascadeConfig())
    finally:
        del model.hf_device_map


@pytest.mark.parametrize("memory", ["vmm", "static"])
def test_second_call_of_the_same_shape_replays_without_capturing(model, monkeypatch, memory):
    if memory == "vmm" and hf_cascade.memory.vmm_unavailable_reason("cuda"):
        pytest.skip("no CUDA virtual memory here")
    hf_cascade.release(model)
    config = CascadeConfig(cuda_graphs=True, memory=memory, max_kv_bytes=2 ** 30)
    spy = RunnerSpy(monkeypatch)
    outs, counts = [], []
    for seed in (5, 6, 5):
        ids, mask = _batch((600, 420), seed=seed)
        outs.append(model.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=24,
                                   pad_token_id=0, hf_cascade_config=config))
        runner = spy.runners[-1]
        counts.append((runner.captures, runner.first_steps, runner.replays))
    assert spy.runners[0] is spy.runners[1] is spy.runners[2]
    assert counts[0][:2] == (1, 1)
    assert counts[1][:2] == (0, 0) and counts[2][:2] == (0, 0) and counts[2][2] >= 20
    assert torch.equal(outs[0], outs[2])             # the same prompts: the same tokens from a reused graph
    hf_cascade.release(model)


# ---- sliding windows, softcap, sinks: rows enter inside the window and pass it while the graph replays ----------
WINDOW = 480


def _windowed_config(name):
    common = dict(SHAPE, sliding_window=WINDOW)
    if name == "mistral":                     # every layer windowed
        return MistralConfig(**common)
    if name == "gemma2":                      # softcap 50, every other layer windowed, final logit softcap
        return Gemma2Config(**common, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                            query_pre_attn_scalar=64)
    # GPT-OSS: sinks, every other layer windowed, 4 small experts (2 per token; batched_mm copies weights per token)
    return GptOssConfig(**dict(common, intermediate_size=128), num_local_experts=4, num_experts_per_tok=2)


STOCK_ATTENTION = {"mistral": "sdpa", "gemma2": "eager", "gpt-oss": "eager"}


def _windowed_pair(name, dtype, **kw):
    torch.manual_seed(0)
    with torch.device("cuda"):
        stock = AutoModelForCausalLM.from_config(_windowed_config(name), attn_implementation=STOCK_ATTENTION[name],
                                                 dtype=dtype, **kw).eval()
        cascade = AutoModelForCausalLM.from_config(_windowed_config(name), attn_implementation="cascade",
                                                   dtype=dtype, **kw).eval()
    if name == "gpt-oss":        # random sinks spread out, so that they matter
        for layer in stock.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=2.0)
    cascade.load_state_dict(stock.state_dict())
    return stock, cascade


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gpt-oss"])
@pytest.mark.parametrize("case", ["beam", "sample"])
def test_windowed_models_replay_equals_eager_bitwise(monkeypatch, name, case):
    _, model = _windowed_pair(name, torch.bfloat16)
    ids, mask = _batch((700, 460, 590), seed=7)          # the 460-token row passes the window at step 20
    kw = dict(max_new_tokens=40, pad_token_id=0, return_dict_in_generate=True, output_scores=True, **CASES[case],
              **host_loop())      # (transformers' loop around the runner)
    spy = RunnerSpy(monkeypatch)
    outs = []
    for mode in ("eager", True):
        torch.manual_seed(11)
        outs.append(model.generate(input_ids=ids, attention_mask=mask, hf_cascade_config=CascadeConfig(
            cuda_graphs=mode, backend="cuda"), **kw))
    _, graph_run = spy.runners
    assert graph_run.disabled is None, graph_run.disabled
    assert graph_run.captures == 1 and graph_run.replays >= 30
    a, b = outs
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores):
        assert torch.equal(sa, sb)


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gpt-oss"])
def test_windowed_models_float32_graphs_give_stock_tokens(monkeypatch, name):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # grouped_mm takes no float32: GPT-OSS's experts as batched matrix products (no host sync: capturable)
    extra = dict(experts_implementation="batched_mm") if name == "gpt-oss" else {}
    stock, cascade = _windowed_pair(name, torch.float32, **extra)
    ids, mask = _batch((600, 465), seed=8)            # the 465-token row passes the window during the call
    spy = RunnerSpy(monkeypatch)
    kw = dict(max_new_tokens=24, pad_token_id=0, num_beams=4, num_return_sequences=2)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    got = cascade.generate(input_ids=ids, attention_mask=mask, hf_cascade_config=CascadeConfig(cuda_graphs=True),
                           **kw)
    assert torch.equal(expected, got)
    runner, = spy.runners
    assert runner.disabled is None and runner.replays > 10, runner.disabled


def test_a_failed_capture_leaves_sampling_and_random_ops_working(model, monkeypatch):
    """A forward that synchronises with the host while it is captured: the capture fails, decode runs on
    eagerly with the same tokens, and CUDA's random generator (which PyTorch leaves marked as capturing after a
    failed capture) still serves sampling and random ops afterwards."""
    mlp = model.model.layers[0].mlp
    real = mlp.forward

    def syncing(*args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream().synchronize()        # not allowed while capturing: the capture fails
        return real(*args, **kwargs)

    ids, mask = _batch((300, 210), seed=9)
    kw = dict(do_sample=True, num_return_sequences=2, top_k=0, max_new_tokens=12, pad_token_id=0)
    torch.manual_seed(5)
    expected = model.generate(input_ids=ids, attention_mask=mask, hf_cascade_config=CascadeConfig(cuda_graphs=False),
                              **kw)
    monkeypatch.setattr(mlp, "forward", syncing)
    spy = RunnerSpy(monkeypatch)
    torch.manual_seed(5)
    got = model.generate(input_ids=ids, attention_mask=mask, hf_cascade_config=CascadeConfig(cuda_graphs=True), **kw,
                         **host_loop())
    runner, = spy.runners
    assert runner.disabled is not None and "capture failed" in runner.disabled
    assert torch.equal(got, expected)
    assert torch.isfinite(torch.randn(4, device="cuda")).all()
    # the whole step on the device: its capture fails the same way and its steps run eagerly with stock's tokens
    # (beam search: the failed capture's random offsets are not a sampling call's), and random ops still work
    beam = dict(max_new_tokens=12, pad_token_id=0, num_beams=2)
    expected = model.generate(input_ids=ids, attention_mask=mask, hf_cascade_config=CascadeConfig(cuda_graphs=False),
                              **beam)
    got = model.generate(input_ids=ids, attention_mask=mask, hf_cascade_config=CascadeConfig(cuda_graphs=True), **beam)
    whole = spy.runners[-1]
    assert whole.captures == 0 and whole.device_steps > 0
    assert torch.equal(got, expected)
    assert torch.isfinite(torch.randn(4, device="cuda")).all()
