"""What may run inside a CUDA graph capture (hf_cascade.graphs), on the CPU with the capture emulated.

A captured decode step must only launch kernels: setups (hfc_prefix_setup's cudaFuncSetAttribute), host-to-device
uploads, pool growth (cuMemMap) and device synchronisation happen before it, in the eager warm-up step or the step's
plan upload. CUDA answers such a call inside a capture only by invalidating the capture, and the error then names
a later launch; here each raises a RuntimeError naming itself (the runner reports it in ``disabled``). The runner
also keeps Python's cyclic garbage collector off during the capture (a dead CascadeCache's VMM pool unmaps and
synchronises when collected: the H200 failure of test_replay_equals_eager_bitwise[300-vmm-cuda-beam-eos]).
Inside the emulated capture a torch function mode (:class:`HostSyncTrap`) also records every tensor call that would
wait for the device or upload from the host on a GPU (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``,
``.nonzero()``, boolean-mask indexing, ``torch.tensor(...)`` from host data, ...): the steps captured here, on a
16-bit and on an fp8 cache, make none. GPU: tests/decode/test_gpu_graphs.py, tests/kv/test_gpu_fp8.py.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import types

import numpy as np
import pytest
import torch

from torch.overrides import TorchFunctionMode

from hf_cascade import CascadeConfig, graphs
from hf_cascade.kernels import cuda as cuda_backend
from hf_cascade.kernels import cuda_binding, ops
from hf_cascade.kernels.base import AttentionParams, kv_scale, with_kv_scale
from hf_cascade.plan import DecodeLayout
from conftest import RunnerSpy, host_loop, padded_batch
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


class _SyncLib:
    """The C library's hfc_sync, counting its calls."""

    def __init__(self):
        self.syncs = 0

    def hfc_sync(self):
        self.syncs += 1
        return 0


def test_debug_sync_never_synchronises_inside_a_capture(capturing, monkeypatch):
    """$HF_CASCADE_CUDA_DEBUG's device sync after each launch is skipped inside a capture: there it is refused
    (cudaErrorStreamCaptureUnsupported), and its error was left for the next launch to report: the H200 failure of
    fp8 generate in tests/kv/test_gpu_fp8.py (debug_sync on), which kept fp8 steps uncaptured."""
    monkeypatch.setattr(cuda_binding, "debug_sync", True)
    lib = object.__new__(cuda_backend._Lib)
    lib.lib = _SyncLib()
    lib.check(0, "prefix")
    assert lib.lib.syncs == 1
    capturing.on = True
    lib.check(0, "prefix")
    assert lib.lib.syncs == 1


def _bf16(lay):
    return lay.q.to(torch.bfloat16), lay.pool.to(torch.bfloat16)


def _fp8(lay):
    """The layout's pool as float8_e4m3fn carrying per-(K/V, KV head) scales, and bf16 queries."""
    Hkv = lay.pool.shape[3]
    scale = torch.linspace(0.5, 2.0, 2 * Hkv, dtype=torch.float32).view(2, Hkv)
    return lay.q.to(torch.bfloat16), with_kv_scale(lay.pool.clamp(-448, 448).to(torch.float8_e4m3fn), scale)


class _EmulatedFp8(Emulated):
    """The emulated kernels on an fp8 pool: what the real ones read (stored value x its head's scale)."""

    def __init__(self):
        super().__init__()
        self.scales = []           # the kv_scale tensor of every launch

    def _dequantized(self, q, pool, kv_scale):
        self.scales.append(kv_scale)
        return (pool.double() * kv_scale.double()[None, :, None, :, None]).to(q.dtype)

    def prefix(self, lib, stream, a):
        ops.check_prefix(a)
        return super().prefix(lib, stream, a._replace(pool=self._dequantized(a.q, a.pool, a.kv_scale), kv_scale=None))

    def suffix(self, lib, stream, a):
        ops.check_suffix(a)
        return super().suffix(lib, stream, a._replace(pool=self._dequantized(a.q, a.pool, a.kv_scale), kv_scale=None))


def _build(plan, lay):
    q, pool = _bf16(lay)
    return cuda_backend.BACKEND.build(plan, q, pool, lib=_FakeLib())


def _launch(state, lay):
    q, pool = _bf16(lay)
    out = torch.zeros(q.shape, dtype=torch.float64)
    cuda_backend._launch(_FakeLib(), 0, q, pool, state, AttentionParams(lay.scale), out, kernels=Emulated())
    return out


def test_cuda_launch_state_is_built_before_the_capture_and_only_reused_inside(capturing):
    lay = random_layout(3, groups=((4, 40), (3, 24)), suffix=(1, 9), D=64)
    state = _build(step_plan(lay), lay)          # the warm-up: builds the launch state, uploads, sets up
    eager = _launch(state, lay)
    capturing.on = True
    assert torch.equal(_launch(state, lay), eager)         # the captured step: the same state, launches only
    with pytest.raises(RuntimeError, match="during CUDA graph capture: a new cuda-backend launch state"):
        _build(step_plan(lay), lay)              # a state the warm-up did not build


def test_cuda_fp8_launches_inside_a_capture_read_the_pools_own_scales(capturing):
    """On an fp8 pool the captured layer is the warm-up's launches (the same state), each handed the pool's own scale
    tensor (a graph reads it by address, so a change in place is seen), and nothing waits for the device."""
    lay = random_layout(5, groups=((4, 40), (3, 24)), suffix=(1, 9), D=64)
    q, pool = _fp8(lay)
    state = cuda_backend.BACKEND.build(step_plan(lay), q, pool, lib=_FakeLib())
    assert state.tune == 0                        # the default prefix kernel: the one that reads fp8

    def launch():
        kernels, out = _EmulatedFp8(), torch.zeros(q.shape, dtype=torch.float64)
        cuda_backend._launch(_FakeLib(), 0, q, pool, state, AttentionParams(lay.scale), out, kernels=kernels)
        assert kernels.scales and all(s is kv_scale(pool) for s in kernels.scales)
        return out

    eager = launch()
    capturing.on = True
    with HostSyncTrap() as trap:
        assert torch.equal(launch(), eager)
    assert trap.calls == []


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
class HostSyncTrap(TorchFunctionMode):
    """Records the tensor calls made while it is on that would wait for the device or upload from pageable host
    memory if the tensors were on a GPU (inside a CUDA capture: cudaErrorStreamCaptureUnsupported, or a capture that
    silently bakes a stale value); ``calls`` names each (function, where it was called from)."""

    SYNCING = {"item", "tolist", "cpu", "numpy", "nonzero", "argwhere", "masked_select", "unique",
               "unique_consecutive", "__bool__", "__int__", "__float__", "__index__", "pin_memory", "tensor",
               "as_tensor", "from_numpy"}
    INDEXING = {"__getitem__": 1, "__setitem__": 1, "index_put_": 1, "index_put": 1}   # name -> position of the index

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in self.SYNCING or (name in self.INDEXING and _has_mask(args[self.INDEXING[name]])):
            caller = _caller()
            if caller is not None:
                self.calls.append((name, caller))
        return func(*args, **(kwargs or {}))


def _has_mask(index) -> bool:
    """Whether an index holds a boolean (or uint8) mask: its indexing runs a nonzero, a device-to-host sync."""
    parts = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype in (torch.bool, torch.uint8) for p in parts)


def _caller() -> str | None:
    """file:line of the innermost frame outside torch; None where that is a test's own code (the emulated kernels
    stand in for the device and may compute on the host)."""
    import traceback
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename:
            return None if "/tests/" in frame.filename else f"{frame.filename}:{frame.lineno}"
    return None


class _EmulatedCapture:
    """Stands in for torch.cuda.graph: marks the stream as capturing and records whether Python's garbage
    collector could run during the capture."""

    gc_enabled: list = []
    host_syncs: list = []       # HostSyncTrap's records, of every capture

    def __init__(self, graph, pool=None, capture_error_mode="global"):
        self.mode = capture_error_mode
        self.trap = HostSyncTrap()

    def __enter__(self):
        _CAPTURING.on = True
        _EmulatedCapture.gc_enabled.append(gc.isenabled())
        self.trap.__enter__()

    def __exit__(self, *exc):
        self.trap.__exit__(*exc)
        _EmulatedCapture.host_syncs += self.trap.calls
        _CAPTURING.on = False
        return False


_CAPTURING = types.SimpleNamespace(on=False)


@pytest.fixture
def emulated_capture(monkeypatch):
    """graphs' CUDA calls on the CPU: the capture sets the capturing flag, the graph's replay does nothing (the
    static output stays the captured step's), streams are no-ops."""
    _CAPTURING.on = False
    _EmulatedCapture.gc_enabled = []
    _EmulatedCapture.host_syncs = []
    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: _CAPTURING.on)
    monkeypatch.setattr(torch.cuda, "graph", _EmulatedCapture)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: types.SimpleNamespace(replay=lambda: None))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(graphs, "_side_stream", lambda device: stream)
    real = graphs.capture_reason

    def on_cuda(model, config):         # a CPU model "on CUDA" where the call asks for graphs
        reason = real(model, config)
        return None if config.cuda_graphs is True and reason is not None and reason.endswith("not CUDA") else reason

    monkeypatch.setattr(graphs, "capture_reason", on_cuda)
    return _EmulatedCapture


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"], ids=["16bit", "fp8"])
@pytest.mark.parametrize("case", [dict(num_beams=3, eos_token_id=[5, 6, 7], early_stopping=True),
                                  dict(do_sample=True, num_return_sequences=2)], ids=["beam-eos", "sample"])
def test_the_captured_forward_only_launches_and_runs_without_the_collector(case, kv_dtype, llama_pair, monkeypatch,
                                                                          emulated_capture):
    """The real warm-up / capture code path: the forward re-run inside the (emulated) capture builds nothing (every
    guarded call raises there: plan uploads, pool growth, kernel state) and no cyclic collection runs in it."""
    _, cascade = llama_pair
    ids, mask = padded_batch(seed=4, lengths=(27, 19, 23))
    spy = RunnerSpy(monkeypatch)
    writes = _spy_writes(monkeypatch)
    gc.enable()
    cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, **case, **host_loop(),
                     hf_cascade_config=CascadeConfig(cuda_graphs=True, block_size=2, memory="grow",
                                                     backend="reference", kv_dtype=kv_dtype))
    runner, = spy.runners
    assert runner.disabled is None, runner.disabled
    assert runner.captures == 1 and runner.replays >= 3
    assert emulated_capture.gc_enabled == [False], "the garbage collector could run inside the capture"
    assert emulated_capture.host_syncs == []
    _assert_captured_writes(writes, kv_dtype)
    assert gc.isenabled()


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"], ids=["16bit", "fp8"])
@pytest.mark.parametrize("case", [dict(num_beams=3, eos_token_id=[5, 6, 7], early_stopping=True),
                                  dict(do_sample=True, num_return_sequences=2)], ids=["beam-eos", "sample"])
def test_the_captured_whole_step_only_launches(case, kv_dtype, llama_pair, monkeypatch, emulated_capture, caplog):
    """hf_cascade.whole_step's capture (block bookkeeping, forward, token choice): nothing inside it builds, uploads
    or grows (every guarded call would raise, and the loop would log that it runs eagerly), and no cyclic collection
    runs in it. (The emulated replay does nothing, so the tokens are not compared here: tests/decode/test_gpu_whole_step.py.)"""
    _, cascade = llama_pair
    ids, mask = padded_batch(seed=4, lengths=(27, 19, 23))
    spy = RunnerSpy(monkeypatch)
    writes = _spy_writes(monkeypatch)
    gc.enable()
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, **case,
                         hf_cascade_config=CascadeConfig(cuda_graphs=True, block_size=2, memory="grow",
                                                         backend="reference", kv_dtype=kv_dtype))
    runner, = spy.runners
    assert runner.captures >= 1 and runner.device_steps >= 1
    assert not [r for r in caplog.records if "could not be captured" in r.getMessage()]
    assert emulated_capture.gc_enabled and not any(emulated_capture.gc_enabled)
    assert emulated_capture.host_syncs == []
    _assert_captured_writes(writes, kv_dtype)
    assert gc.isenabled()


def _spy_writes(monkeypatch) -> list:
    """(pool dtype, inside the capture) of every cache write (BlockStorage.encode) from now on."""
    from hf_cascade.memory import BlockStorage
    writes, real = [], BlockStorage.encode

    def encode(self, key, value):
        writes.append((self.dtype, _CAPTURING.on))
        return real(self, key, value)

    monkeypatch.setattr(BlockStorage, "encode", encode)
    return writes


def _assert_captured_writes(writes, kv_dtype):
    """The capture wrote the cache, into pools of ``kv_dtype`` (an fp8 write quantizes inside the graph)."""
    dtype = torch.float8_e4m3fn if kv_dtype else torch.float64
    assert {d for d, _ in writes} == {dtype} and any(inside for _, inside in writes)
