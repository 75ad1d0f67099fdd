"""What may run inside a CUDA graph capture (hf_cascade.graphs), on the CPU with the capture emulated.

A captured decode step must only launch kernels: setups (hfc_prefix_setup's cudaFuncSetAttribute), host-to-device
uploads, pool growth (cuMemMap) and device synchronisation happen before it, in the eager warm-up step or the step's
plan upload. CUDA answers such a call inside a capture only by invalidating the capture, and the error then names
a later launch; here each raises a RuntimeError naming itself (the runner reports it in ``disabled``). The runner
also keeps Python's cyclic garbage collector off during the capture (a dead CascadeCache's VMM pool unmaps and
synchronises when collected: the H200 failure of test_replay_equals_eager_bitwise[300-vmm-cuda-beam-eos]).
GPU: tests/test_gpu_graphs.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import types

import numpy as np
import pytest
import torch

from hf_cascade import CascadeCache, CascadeConfig, graphs
from hf_cascade.kernels import cuda as cuda_backend
from hf_cascade.plan import DecodeLayout
from conftest import RunnerSpy, padded_batch
from kernel_helpers import random_layout, step_plan
from test_cuda_emulation import Emulated, _FakeLib, _small_pieces  # noqa: F401  (_small_pieces: autouse fixture)
from test_static_decode import BS, _history


@pytest.fixture
def capturing(monkeypatch):
    """``capturing.on``: torch reports a CUDA graph capture on this thread's current stream."""
    state = types.SimpleNamespace(on=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state.on)
    return state


# ---- the cuda backend ------------------------------------------------------------------------------------------
class _SetupLib:
    """The C library's hfc_prefix_setup, recording its calls."""

    def __init__(self):
        self.calls = []

    def hfc_prefix_setup(self, *args):
        self.calls.append(args[:4])
        return 0


def test_prefix_setup_inside_a_capture_is_an_error_naming_it(capturing):
    lib = object.__new__(cuda_backend._Lib)
    lib.lib, lib._info = _SetupLib(), {(0, 64, 16, 0, 0): (3, 0, 64)}
    capturing.on = True
    assert lib.prefix_info(0, 64, 16, device_index=0) == (3, 0, 64)          # set up before: a lookup
    with pytest.raises(RuntimeError, match=r"during CUDA graph capture: hfc_prefix_setup \(cudaFuncSetAttribute\) "
                                           r"of the prefix kernel variant dtype code 0, head_dim 128, m_tile 64, tune 2"):
        lib.prefix_info(0, 128, 64, device_index=0, tune=2)
    assert lib.lib.calls == []


def _bf16(lay):
    return lay.q.to(torch.bfloat16), lay.pool.to(torch.bfloat16)


def _build(plan, lay):
    q, pool = _bf16(lay)
    return cuda_backend.BACKEND.build(plan, q, pool, lib=_FakeLib())


def _launch(state, lay):
    q, pool = _bf16(lay)
    out = torch.zeros(q.shape, dtype=torch.float64)
    cuda_backend._launch(_FakeLib(), 0, q, pool, state, lay.scale, out, kernels=Emulated())
    return out


def test_cuda_launch_state_is_built_before_the_capture_and_only_reused_inside(capturing):
    lay = random_layout(3, groups=((4, 40), (3, 24)), suffix=(1, 9), D=64)
    state = _build(step_plan(lay), lay)          # the warm-up: builds the launch state, uploads, sets up
    eager = _launch(state, lay)
    capturing.on = True
    assert torch.equal(_launch(state, lay), eager)         # the captured step: the same state, launches only
    with pytest.raises(RuntimeError, match="during CUDA graph capture: a new cuda-backend launch state"):
        _build(step_plan(lay), lay)              # a state the warm-up did not build


# ---- the plan's upload -----------------------------------------------------------------------------------------
def test_plan_upload_inside_a_capture_is_an_error_naming_it(capturing):
    rng = np.random.default_rng(0)
    layout = None
    for blocks in _history(rng, np.array([9, 13]), 3, 2):
        layout = layout or DecodeLayout.freeze(blocks.tables(), blocks.lengths.copy(), BS, 6)
        plan = layout.step(blocks.tables(), blocks.lengths, blocks.append(np.ones(blocks.num_rows, np.int64)))
        dp = plan.on("cpu")                     # the runner's upload, before the replay
        capturing.on = True
        assert plan.on("cpu") is dp             # the layers inside the captured forward
        with pytest.raises(RuntimeError, match=r"during CUDA graph capture: the step plan's upload to cuda:0 \(static"):
            plan.on("cuda:0")
        lay = random_layout(1)
        with pytest.raises(RuntimeError, match=r"the step plan's upload to cpu \(per-step"):
            step_plan(lay).on("cpu")
        capturing.on = False


# ---- the runner's capture path, with torch's capture emulated ------------------------------------------------------
class _EmulatedCapture:
    """Stands in for torch.cuda.graph: marks the stream as capturing and records whether Python's garbage
    collector could run during the capture."""

    gc_enabled: list = []

    def __init__(self, graph, pool=None, capture_error_mode="global"):
        self.mode = capture_error_mode

    def __enter__(self):
        _CAPTURING.on = True
        _EmulatedCapture.gc_enabled.append(gc.isenabled())

    def __exit__(self, *exc):
        _CAPTURING.on = False
        return False


_CAPTURING = types.SimpleNamespace(on=False)


@pytest.fixture
def emulated_capture(monkeypatch):
    """graphs' CUDA calls on the CPU: the capture sets the capturing flag, the graph's replay does nothing (the
    static output stays the captured step's), streams are no-ops."""
    _CAPTURING.on = False
    _EmulatedCapture.gc_enabled = []
    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: _CAPTURING.on)
    monkeypatch.setattr(torch.cuda, "graph", _EmulatedCapture)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: types.SimpleNamespace(replay=lambda: None))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(graphs, "_side_stream", lambda device: stream)
    real = graphs.unsupported_reason
    monkeypatch.setattr(graphs, "unsupported_reason",           # a CPU model "on CUDA"
                        lambda model, config: real(model, dataclasses.replace(config, cuda_graphs="eager")
                                                   if config.cuda_graphs is True else config))
    return _EmulatedCapture


@pytest.mark.parametrize("case", [dict(num_beams=3, eos_token_id=[5, 6, 7], early_stopping=True),
                                  dict(do_sample=True, num_return_sequences=2)], ids=["beam-eos", "sample"])
def test_the_captured_forward_only_launches_and_runs_without_the_collector(case, llama_pair, monkeypatch,
                                                                          emulated_capture):
    """The real warm-up / capture code path: the forward re-run inside the (emulated) capture builds nothing (every
    guarded call raises there: plan uploads, pool growth, kernel state) and no cyclic collection runs in it."""
    _, cascade = llama_pair
    ids, mask = padded_batch(seed=4, lengths=(27, 19, 23))
    spy = RunnerSpy(monkeypatch)
    gc.enable()
    cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, **case,
                     hf_cascade_config=CascadeConfig(cuda_graphs=True, block_size=2, memory="grow",
                                                     backend="reference", whole_step=False))
    runner, = spy.runners
    assert runner.disabled is None, runner.disabled
    assert runner.captures == 1 and runner.replays >= 3
    assert emulated_capture.gc_enabled == [False], "the garbage collector could run inside the capture"
    assert gc.isenabled()


@pytest.mark.parametrize("case", [dict(num_beams=3, eos_token_id=[5, 6, 7], early_stopping=True),
                                  dict(do_sample=True, num_return_sequences=2)], ids=["beam-eos", "sample"])
def test_the_captured_whole_step_only_launches(case, llama_pair, monkeypatch, emulated_capture, caplog):
    """hf_cascade.whole_step's capture (block bookkeeping, forward, token choice): nothing inside it builds, uploads
    or grows (every guarded call would raise, and the loop would log that it runs eagerly), and no cyclic collection
    runs in it. (The emulated replay does nothing, so the tokens are not compared here: tests/test_gpu_whole_step.py.)"""
    _, cascade = llama_pair
    ids, mask = padded_batch(seed=4, lengths=(27, 19, 23))
    spy = RunnerSpy(monkeypatch)
    gc.enable()
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, **case,
                         hf_cascade_config=CascadeConfig(cuda_graphs=True, block_size=2, memory="grow",
                                                         backend="reference"))
    runner, = spy.runners
    assert runner.captures >= 1 and runner.device_steps >= 1
    assert not [r for r in caplog.records if "could not be captured" in r.getMessage()]
    assert emulated_capture.gc_enabled and not any(emulated_capture.gc_enabled)
    assert gc.isenabled()


def test_a_guarded_call_inside_the_capture_is_reported_by_name(llama_pair, monkeypatch, emulated_capture):
    """A step whose captured forward finds its plan not uploaded (dropped here between the warm-up and the capture):
    the runner's reason names the upload, where CUDA would only have said that the capture was invalidated."""
    _, cascade = llama_pair
    real = CascadeCache.rewind_step

    def rewind_and_forget_the_upload(self):      # the runner rewinds the step just before capturing it
        self.step.plan._on_device.clear()
        real(self)

    monkeypatch.setattr(CascadeCache, "rewind_step", rewind_and_forget_the_upload)
    ids, mask = padded_batch(seed=4, lengths=(27, 19, 23))
    spy = RunnerSpy(monkeypatch)
    cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, num_beams=3,
                     hf_cascade_config=CascadeConfig(cuda_graphs=True, block_size=2, memory="grow",
                                                     backend="reference", whole_step=False))
    runner, = spy.runners
    assert runner.disabled is not None and runner.disabled.startswith(
        "capture failed (RuntimeError: hf_cascade: not capture safe, during CUDA graph capture: the step plan's upload "
        "to cpu (static plan buffers)"), runner.disabled
