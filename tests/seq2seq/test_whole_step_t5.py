"""The whole decode step on the device (hf_cascade/decode/whole_step.py) for the T5 family, against stock.

T5, mT5, UMT5 and flan-T5 decode on ``dense_cache.StaticSelfAttentionCache`` (relative position bias: dense K/V
buffers of a fixed room). In the whole step its bookkeeping runs on the device (``dense_cache.DenseHold``): the write
position moved on, the beam reorder of the gather table and of a padded decoder prompt's rows, the step's mask; the
host takes the cache back at the end of the room and widens it. On the CPU the loop runs with ``cuda_graphs="eager"``
(the step a GPU captures, run eagerly); every test checks ``runner.device_steps`` and that no reason kept
transformers' loop, so a silent fallback cannot pass. Tiny random models in float64, stock sdpa and cascade with the
same weights, right-padded sources of different lengths; flan-T5's usual settings (4 beams, no_repeat_ngram_size 3,
length_penalty 2, min_length), greedy and sampling; decoder prompts of several tokens, padded; calls past the first
room (64 positions), and past several small rooms.

The device's bookkeeping is also compared value for value with the host's (``reorder_cache`` + ``prepare_step``) under
random parents; a control shows the device's beam reorder is what gives stock's tokens (without it they differ); an
emulated capture on the CPU shows the captured step makes no host sync, and that a step whose cross-attention backend
cannot be captured runs eagerly. Ctrl-C in a device step leaves the model usable; ``compile=True`` compiles the
dense bookkeeping and the token choice.

The ``gpu`` test (on the GPU machine: ``pytest -m gpu tests/seq2seq/test_whole_step_t5.py``): a flan-T5-shaped model, the
captured whole step equals the eager whole step bitwise in bf16, and float32 (TF32 off) equals stock, past the first
room.
"""
from __future__ import annotations

import dataclasses
import logging
import types

import pytest
import torch

import hf_cascade
from hf_cascade import dense_cache, logs, whole_step
from hf_cascade.config import CascadeConfig

from conftest import RunnerSpy
from test_capture_safety import emulated_capture  # noqa: F401  (a fixture)
from test_t5_graphs import FAMILIES, _gpu_pair, _gpu_sources, decoder_prompt, pair, sources

EAGER = CascadeConfig(backend="reference", cuda_graphs="eager", block_size=4)
FLAN = dict(num_beams=4, no_repeat_ngram_size=3, length_penalty=2.0, min_length=8)
MODES = {
    "beam": dict(FLAN, max_new_tokens=12),
    "beam-returned": dict(num_beams=4, num_return_sequences=2, length_penalty=0.5, max_new_tokens=12),
    "greedy": dict(max_new_tokens=12, min_new_tokens=6),
    "sample": dict(do_sample=True, num_return_sequences=3, top_k=20, max_new_tokens=12),
}
KEPT_LOOP = "decode loop stays transformers'"


@pytest.fixture
def whole_step_logs(monkeypatch, caplog):
    """The INFO lines of hf_cascade (every log-once line shows again)."""
    monkeypatch.setattr(logs, "_logged", set())
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        yield caplog


def _generate(model, config=None, seed=1234, **kwargs):
    torch.manual_seed(seed)
    extra = {} if config is None else {"hf_cascade_config": config}
    return model.generate(**kwargs, **extra)


def _device_steps(spy) -> int:
    return sum(r.device_steps for r in spy.runners if r is not None)


def _assert_whole_step_equals_stock(stock, cascade, spy, caplog, config=EAGER, min_device_steps=1, **kwargs):
    want = _generate(stock, **kwargs)
    got = _generate(cascade, config, **kwargs)
    assert want.shape == got.shape and torch.equal(want, got), (want, got)
    assert not [r.getMessage() for r in caplog.records if KEPT_LOOP in r.getMessage()]
    assert _device_steps(spy) >= min_device_steps, "the whole step did not run (transformers' loop served the call)"
    return got


# ---- the device's bookkeeping against the host's ---------------------------------------------------------------------
def _filled_cache(prompt_mask):
    cache = dense_cache.StaticSelfAttentionCache(4, 1, 16, EAGER, prompt_mask)
    k = torch.randn(4, 2, prompt_mask.shape[1], 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    cache.update(k, k.clone(), 0)
    return cache


def test_device_advance_equals_the_hosts_reorder_and_step():
    """Step after step with random parents (any row, across prompts too: the pads of a padded decoder prompt follow
    them), the device's :func:`dense_cache.advance` leaves the gather table, the pad rows, the position and the mask
    exactly as the host's ``reorder_cache`` and ``prepare_step`` do."""
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1], [1, 1, 1]])
    host, device = _filled_cache(prompt_mask), _filled_cache(prompt_mask)
    loop = types.SimpleNamespace(cache=device, beam=True, advance_fn=dense_cache.advance,
                                 runner=types.SimpleNamespace(replay_refusal=None))
    held, reason = dense_cache.DenseHold.take(loop)
    assert reason is None and held.room == 16 - 3
    generator = torch.Generator().manual_seed(1)
    for _ in range(held.room):
        parents = torch.randint(0, 4, (4,), generator=generator)
        host.reorder_cache(parents)
        step = host.prepare_step(4, 1)
        held.count_step()
        held.advance(parents, torch.tensor(False))
        for name in ("_gather", "_valid", "_step_mask", "_position"):
            assert torch.equal(getattr(host, name), getattr(device, name)), name
        step.finish()
        host.end_step()
    held.take_back()
    assert device.logical_length == host.logical_length == 16


# ---- stock's tokens -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_stock_tokens(family, mode, monkeypatch, whole_step_logs):
    stock, cascade = pair(family)
    ids, mask = sources()
    spy = RunnerSpy(monkeypatch)
    # every step but the decoder prompt's on the device (sampling's rows may all end early)
    _assert_whole_step_equals_stock(stock, cascade, spy, whole_step_logs, input_ids=ids, attention_mask=mask,
                                    min_device_steps=4 if mode == "sample" else 10, **MODES[mode])


@pytest.mark.parametrize("mode", ["beam", "greedy"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", ["t5", "umt5"])
def test_padded_decoder_prompts(family, side, mode, monkeypatch, whole_step_logs):
    """Decoder prompts of several tokens, of one length and padded to a common one: the first step runs the prompt with
    its mask as transformers does, then the device masks the pads in every step, through the beams' reorders."""
    stock, cascade = pair(family)
    ids, mask = sources()
    spy = RunnerSpy(monkeypatch)
    for lengths in ((4, 4, 4), (5, 2, 3)):
        decoder_ids, decoder_mask = decoder_prompt(lengths=lengths, side=side)
        _assert_whole_step_equals_stock(stock, cascade, spy, whole_step_logs, input_ids=ids, attention_mask=mask,
                                        decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask,
                                        min_device_steps=10, **MODES[mode])


def test_past_the_first_room(monkeypatch, whole_step_logs):
    """flan-T5's settings up to 100 new tokens: past the first room (64 positions) the host takes the cache back,
    widens it to the call's capacity, and the device goes on."""
    rooms = _record_rooms(monkeypatch)
    stock, cascade = pair("flan-t5")
    ids, mask = sources()
    spy = RunnerSpy(monkeypatch)
    _assert_whole_step_equals_stock(stock, cascade, spy, whole_step_logs, input_ids=ids, attention_mask=mask,
                                    **dict(FLAN, max_new_tokens=100, min_new_tokens=100))
    assert rooms == [64, 101], rooms
    assert _device_steps(spy) == 100 - 2       # all but the decoder prompt's step and the one that widened


@pytest.mark.parametrize("mode", ["beam", "greedy"])
def test_many_small_rooms(mode, monkeypatch, whole_step_logs):
    """Rooms of 4, 8, 16, ... positions: many hand-overs between the host and the device, with a padded decoder
    prompt through beam reorders (the device's reorder and the host's, one after the other, on one gather table)."""
    monkeypatch.setattr(dense_cache.StaticSelfAttentionCache, "FIRST_ROOM", 4)
    rooms = _record_rooms(monkeypatch)
    stock, cascade = pair("t5")
    ids, mask = sources()
    decoder_ids, decoder_mask = decoder_prompt(lengths=(3, 1, 2), side="left")
    spy = RunnerSpy(monkeypatch)
    _assert_whole_step_equals_stock(stock, cascade, spy, whole_step_logs, input_ids=ids, attention_mask=mask,
                                    decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask,
                                    **dict(MODES[mode], max_new_tokens=40, min_new_tokens=40))
    assert rooms == [4, 8, 16, 32, 43], rooms
    assert _device_steps(spy) == 40 - 5       # the first step and the four that widened ran on the host


def _record_rooms(monkeypatch) -> list:
    rooms = []
    widen = dense_cache.StaticSelfAttentionCache._widen
    monkeypatch.setattr(dense_cache.StaticSelfAttentionCache, "_widen",
                        lambda self, *a: (widen(self, *a), rooms.append(self.room))[0])
    return rooms


def test_a_second_call(monkeypatch, whole_step_logs):
    """Two calls in a row on one model, other sources: each its own cache and runner (an encoder-decoder call keeps
    nothing for the next: its encoder outputs differ), each with stock's tokens."""
    stock, cascade = pair("t5")
    spy = RunnerSpy(monkeypatch)
    for lengths, seed in (((13, 9, 5), 0), ((4, 11, 7), 3)):
        ids, mask = sources(lengths=lengths, seed=seed)
        _assert_whole_step_equals_stock(stock, cascade, spy, whole_step_logs, input_ids=ids, attention_mask=mask,
                                        min_device_steps=10, **MODES["beam"])
    first, second = spy.runners
    assert first is not second and first.device_steps >= 5 and second.device_steps >= 5
    assert first.whole_step_kept is None       # released with the call


def test_max_kv_bytes(monkeypatch, whole_step_logs):
    """A cap on the K/V bytes holds in the whole step too (the dense cache allocates only on the host: its buffers,
    the spare pair when the device takes a beam search, and each widening); a cap below the buffers refuses the call
    before the device runs."""
    stock, cascade = pair("t5")
    ids, mask = sources()
    spy = RunnerSpy(monkeypatch)
    capped = dataclasses.replace(EAGER, max_kv_bytes=1 << 30)
    _assert_whole_step_equals_stock(stock, cascade, spy, whole_step_logs, capped, input_ids=ids, attention_mask=mask,
                                    min_device_steps=10, **MODES["beam"])
    config = cascade.config
    # one layer's K and V: rows x room (the call's 13 positions) x heads x dim x float64
    one_layer = 3 * 4 * 13 * config.num_heads * config.d_kv * 8 * 2
    with pytest.raises(hf_cascade.PoolExhausted, match="max_kv_bytes"):
        _generate(cascade, dataclasses.replace(EAGER, max_kv_bytes=one_layer), input_ids=ids, attention_mask=mask,
                  **MODES["beam"])


def test_control_without_the_device_reorder_the_tokens_differ(monkeypatch):
    """Control: a device step that does not follow the beams' parents in the gather table gives other tokens than
    stock's, so the tests above see the device's reorder (the steps on the device are the ones that matter)."""
    real = dense_cache.advance

    def no_reorder(state, parents):
        real(state, torch.arange(parents.shape[0], device=parents.device))

    monkeypatch.setattr(dense_cache.DenseHold, "advance_fn", staticmethod(no_reorder))
    stock, cascade = pair("t5")
    ids, mask = sources()
    spy = RunnerSpy(monkeypatch)
    kwargs = dict(input_ids=ids, attention_mask=mask, **MODES["beam"])
    got = _generate(cascade, EAGER, **kwargs)
    assert _device_steps(spy) > 0
    assert not torch.equal(_generate(stock, **kwargs), got)


def test_compile_advances_the_dense_cache_compiled(monkeypatch, whole_step_logs):
    """``CascadeConfig(compile=True)``: the dense cache's bookkeeping and the token choice run compiled (each one
    graph, no break); T5's forward does not compile (its static step's dense attention refuses a compiled trace), runs
    uncompiled, logged; stock's tokens. A second call of other sources (the same shapes) compiles nothing more."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    try:
        stock, cascade = pair("t5")
        config = dataclasses.replace(EAGER, compile=True)
        ids, mask = sources()
        spy = RunnerSpy(monkeypatch)
        _assert_whole_step_equals_stock(stock, cascade, spy, whole_step_logs, config,
                                        input_ids=ids, attention_mask=mask, min_device_steps=10, **MODES["beam"])
        messages = [r.getMessage() for r in whole_step_logs.records]
        assert not [m for m in messages if "whole step's" in m and "failed to compile" in m], messages
        graphs = counters["stats"]["unique_graphs"]
        assert graphs >= 2 and not counters["graph_break"]
        ids, mask = sources((7, 13, 11), seed=1)
        with torch._dynamo.config.patch(error_on_recompile=True):
            _assert_whole_step_equals_stock(stock, cascade, RunnerSpy(monkeypatch), whole_step_logs, config,
                                            input_ids=ids, attention_mask=mask, min_device_steps=10,
                                            **MODES["beam"])
        messages = [r.getMessage() for r in whole_step_logs.records]
        assert not [m for m in messages if "whole step's" in m and "failed to compile" in m], messages
        assert counters["stats"]["unique_graphs"] == graphs
    finally:
        torch._dynamo.reset()
        counters.clear()


def test_interrupt_in_a_device_step_leaves_the_model_usable(monkeypatch, whole_step_logs):
    """Ctrl-C in a device step: the model's forward is restored, the call's cache emptied, and the next call gives
    stock's tokens."""
    stock, cascade = pair("t5")
    ids, mask = sources()
    real, calls = dense_cache.advance, []

    def interrupted(state, parents):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        real(state, parents)

    made = _record_caches(monkeypatch)
    monkeypatch.setattr(dense_cache.DenseHold, "advance_fn", staticmethod(interrupted))
    with pytest.raises(KeyboardInterrupt):
        _generate(cascade, EAGER, input_ids=ids, attention_mask=mask, **MODES["beam"])
    monkeypatch.setattr(dense_cache.DenseHold, "advance_fn", staticmethod(real))
    assert "forward" not in cascade.__dict__
    cache, = made
    assert cache.kv_bytes == 0 and cache.step is None and cache.logical_length == 0
    spy = RunnerSpy(monkeypatch)
    _assert_whole_step_equals_stock(stock, cascade, spy, whole_step_logs, input_ids=ids, attention_mask=mask,
                                    min_device_steps=5, **MODES["beam"])


def _record_caches(monkeypatch) -> list:
    made = []
    init = dense_cache.StaticSelfAttentionCache.__init__
    monkeypatch.setattr(dense_cache.StaticSelfAttentionCache, "__init__",
                        lambda self, *a, **k: (made.append(self), init(self, *a, **k))[1])
    return made


class _Captured(Exception):
    """Ends a call after its first capture."""


@pytest.mark.parametrize("mode", ["beam", "greedy", "sample"])
def test_the_captured_step_only_launches(mode, monkeypatch, whole_step_logs, emulated_capture):  # noqa: F811
    """The whole step's capture (the dense cache's bookkeeping, the forward, the token choice), emulated on the CPU:
    captured without error and without a host sync inside it. The emulated capture runs the step and its replay does
    nothing, so the call ends after the capture (tokens are compared on the GPU)."""
    real = whole_step.WholeStepLoop._warm_up_and_capture

    def capture_once(loop):
        real(loop)
        raise _Captured

    monkeypatch.setattr(whole_step.WholeStepLoop, "_warm_up_and_capture", capture_once)
    _, cascade = pair("t5")
    ids, mask = sources()
    spy = RunnerSpy(monkeypatch)
    with pytest.raises(_Captured):
        cascade.generate(input_ids=ids, attention_mask=mask, **MODES[mode],
                         hf_cascade_config=dataclasses.replace(EAGER, cuda_graphs=True))
    runner, = spy.runners
    assert runner.captures == 1
    assert not [r.getMessage() for r in whole_step_logs.records if "could not be captured" in r.getMessage()]
    assert emulated_capture.host_syncs == []
    assert emulated_capture.gc_enabled == [False]


def test_a_cross_attention_backend_that_cannot_be_captured_runs_eagerly(monkeypatch, whole_step_logs,
                                                                         emulated_capture):  # noqa: F811
    """The cross-attention's backend is known once a static step ran (the capture's warm-up): one that cannot be
    captured leaves the whole step eager (logged), with stock's tokens (the emulated capture never replays)."""
    from hf_cascade.kernels import reference
    monkeypatch.setattr(reference.ReferenceBackend, "graph_safe", False)
    stock, cascade = pair("t5")
    ids, mask = sources()
    spy = RunnerSpy(monkeypatch)
    _assert_whole_step_equals_stock(stock, cascade, spy, whole_step_logs, dataclasses.replace(EAGER, cuda_graphs=True),
                                    input_ids=ids, attention_mask=mask, min_device_steps=10, **MODES["beam"])
    runner, = spy.runners
    assert runner.captures == 0 and runner.replays == 0
    assert [r for r in whole_step_logs.records if "whole decode step runs eagerly" in r.getMessage()
            and "reference" in r.getMessage()]


# ---- GPU: the captured whole step -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_captured_whole_step_equals_eager_bitwise_bf16_and_stock_float32(monkeypatch, no_tf32, whole_step_logs):
    """A flan-T5-shaped model with flan-T5's beam settings, 80 new tokens (two rooms, each layout captured): the
    captured whole step gives bitwise the tokens of the same step run eagerly (bf16), and float32 (TF32 off) gives
    stock's tokens."""
    settings = dict(FLAN, max_new_tokens=80, min_new_tokens=80)
    _, cascade = _gpu_pair(torch.bfloat16)
    ids, mask = _gpu_sources()
    spy = RunnerSpy(monkeypatch)
    outs = [cascade.generate(input_ids=ids, attention_mask=mask, **settings,
                             hf_cascade_config=CascadeConfig(backend="cuda", cuda_graphs=graphs))
            for graphs in ("eager", True)]
    eager_run, graph_run = spy.runners
    assert eager_run.device_steps > 70 and graph_run.device_steps > 70
    assert graph_run.captures == 2 and graph_run.replays > 70
    assert torch.equal(outs[0], outs[1])

    stock, cascade = _gpu_pair(torch.float32)
    want = stock.generate(input_ids=ids, attention_mask=mask, **settings)
    got = cascade.generate(input_ids=ids, attention_mask=mask, **settings)
    assert torch.equal(want, got)
    assert spy.runners[-1].device_steps > 70 and spy.runners[-1].captures == 2
    assert not [r.getMessage() for r in whole_step_logs.records if KEPT_LOOP in r.getMessage()]
