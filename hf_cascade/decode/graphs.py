"""The step runner of generate's decode loop: the forward a step runs, and the one way a step is captured.

A generate call's :class:`~hf_cascade.session.DecodeSession` hands its decode loop (:mod:`hf_cascade.whole_step`) one
:class:`DecodeGraphRunner`, which says how each decode step runs:

- **eager** (the CPU and steps that cannot be captured, :func:`capture_reason`; ``cuda_graphs="eager"``, any device;
  or where hooks must run): every step runs its Python;
- **captured** (CUDA): a layout's first device step runs eagerly on a side stream, then the same step is captured as a
  CUDA graph (:meth:`DecodeGraphRunner.capture`: the one capture recipe) and replayed for the rest of the layout;
- **compiled** (``CascadeConfig(compile=True)`` or ``"regional"``): the forward the step runs is
  ``torch.compile(fullgraph=True)`` of the model's forward (or :class:`hf_cascade.regional.RegionalForward`), which
  gets the step context as its ``cascade_step`` argument; a forward that cannot compile runs uncompiled, logged once.

The runner keeps the captured steps for the model's next calls of the same shape (``kept_steps``: the latest first,
as many as the cache keeps layouts; each with one reuse key, :class:`hf_cascade.whole_step._Captured`'s), whatever
the prompt's length where a kept layout adopts the call's values (:meth:`hf_cascade.plan.DecodeLayout.adopt`). transformers' own ``_sample`` / ``_beam_search`` never run a runner, and
``model.forward`` is never replaced: where the decode loop is transformers' (hf_cascade.whole_step.decode says when),
its forwards are the model's own, eager.

This module owns the runner and the support policy (:func:`runner_reason`: whether a call's steps run on a runner at
all; :func:`capture_reason`: whether they are captured, with quantized layers' capture safety in
:func:`quantized_capture_reason`; and the hooks that keep steps eager); which runner a call uses, what is kept for
the next call and the capture guard belong to :mod:`hf_cascade.session`.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
import traceback
import weakref
from typing import Callable

import torch
import torch.nn.modules.module as module_hooks

from . import regional
from ..kv.cache import KEPT_LAYOUTS, CascadeCache
from ..config import CascadeConfig
from ..kv.static_step import StaticStepCache
from ..kv.context import STEP_KWARG
from ..logs import log_once

logger = logging.getLogger("hf_cascade")
# generate may run in several threads: guards _side_streams
_lock = threading.RLock()


def runner_reason(model, cascade_config: CascadeConfig) -> str | None:
    """Why ``model``'s decode steps cannot run on a step runner at all under ``cascade_config`` (None when they can:
    hf_cascade's decode loop serves the call, captured where :func:`capture_reason` allows, else eager); where they
    cannot, transformers' loop runs with the model's own eager forwards."""
    if cascade_config.cuda_graphs is False:
        return "CascadeConfig(cuda_graphs=False)"
    devices = {str(p.device) for p in model.parameters()}
    if not devices:
        return "the model has no parameters"
    if len(devices) > 1 or len(set((getattr(model, "hf_device_map", None) or {}).values())) > 1:
        return "the model spans several devices (device_map)"
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        return "accelerate hooks (offloading or a device map) run inside the forward"
    text = model.config.get_text_config(decoder=True)
    rope = getattr(text, "rope_scaling", None) or getattr(text, "rope_parameters", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope"):
        return f"{rope.get('rope_type', rope.get('type'))} RoPE changes its frequencies on the host with the length"
    return None


def capture_reason(model, cascade_config: CascadeConfig) -> str | None:
    """Why a runner's decode steps cannot be captured as CUDA graphs (None where they can); they then run eagerly on
    the runner (not compiled either: compile applies to captured steps, or to ``cuda_graphs="eager"``, which asks for
    eager steps and is not asked this)."""
    reason = quantized_capture_reason(model)
    if reason is not None:
        return reason
    can_set_experts = getattr(type(model), "_can_set_experts_implementation", None)
    if (getattr(model.config, "_experts_implementation", None) == "eager"
            and can_set_experts is not None and can_set_experts()):
        return ("experts_implementation='eager' (its loop over the experts synchronises with the host); load the "
                "model with experts_implementation='grouped_mm' (the default on CUDA) for graphs")
    device = next(model.parameters()).device
    if device.type != "cuda":
        return f"the model is on {device.type}, not CUDA"
    return None


def unsupported_reason(model, cascade_config: CascadeConfig) -> str | None:
    """Why generate's decode steps cannot run as asked (None when they can: captured and replayed, or with
    ``cuda_graphs="eager"`` the runner's eager steps on any device): :func:`runner_reason`, else
    :func:`capture_reason` unless the config asks for eager steps."""
    reason = runner_reason(model, cascade_config)
    if reason is None and cascade_config.cuda_graphs != "eager":
        reason = capture_reason(model, cascade_config)
    return reason


def _hooked(module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def outer_hooks_reason(model) -> str | None:
    """Why a decode step must go through ``model.__call__`` (None where nothing runs there but ``forward``): forward
    hooks or pre-hooks on the model itself, or on every module (``register_module_forward_hook``). They run on the
    host around each step's forward, as in stock's loop."""
    if _hooked(model):
        return "forward hooks on the model (they run around every step's forward, as stock's)"
    return _global_hooks_reason()


def _global_hooks_reason() -> str | None:
    if module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
        return "global module forward hooks (torch.nn.modules.module.register_module_forward_hook)"
    return None


def inner_hooks_reason(model) -> str | None:
    """Why a decode step's forward must run eagerly (None where it may be captured or compiled): forward hooks on a
    module inside the model (a captured graph would replay their tensor work and never run their Python) or global
    ones."""
    name = next((name for name, module in model.named_modules() if name and _hooked(module)), None)
    if name is not None:
        return f"forward hooks on {name} (a captured step would not run them)"
    # (global hooks run on every submodule too; hooks on the model itself: outer_hooks_reason)
    return _global_hooks_reason()


def quantized_capture_reason(model) -> str | None:
    """Why ``model``'s quantized linear layers cannot run inside a CUDA graph (None where they can, or where it has
    none). Found by the modules' types, so that a model quantized by hand is seen as one loaded with a
    ``quantization_config``. bitsandbytes 4-bit and torchao launch plain kernels on the current stream (captured:
    tests/test_gpu_quantized.py); bitsandbytes 8-bit with outlier decomposition tests ``outliers.any()`` on the host
    in every layer."""
    for name, module in model.named_modules():
        if type(module).__name__ != "Linear8bitLt":
            continue
        threshold = getattr(getattr(module, "state", None), "threshold", 0.0)
        if threshold > 0.0:
            return (f"bitsandbytes 8-bit layers with llm_int8_threshold={threshold} (the first: {name}) check their "
                    f"inputs for outliers on the host in every forward; decode steps run eagerly. For graphs, load "
                    f"with BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0) (no outlier decomposition) "
                    f"or use 4-bit / torchao weights")
    return None


def pool_signature(cache) -> tuple:
    """What a captured step bakes in of ``cache``'s pools: each layer's pool address and shape, and the address of its
    quantization scales (an fp8 pool's kernels read them by address)."""
    storages = [layer.storage for layer in cache.layers if layer.storage is not None]
    return tuple((view.data_ptr(), tuple(view.shape), None if storage.scale is None else storage.scale.data_ptr())
                 for storage, view in ((storage, storage.stable_view()) for storage in storages))


class DecodeGraphRunner:
    """One generate call's step runner (see the module docstring); kept with its cache for the model's next call.

    ``capture_guard()`` is entered from a capture's warm-up to its end (the session's: captures one at a time in the
    process, the pools' memory held). ``capture=False``: every step eager. ``through_call``: the eager forward is
    ``model(...)`` (``nn.Module.__call__``), so that hooks on the model run around every step as in stock's loop.
    Counters of one call, for tests and benchmarks: ``captures``, ``capture_seconds``, ``first_steps`` (a layout's first
    device step: the one that captures, or would with ``capture=True``), ``replays`` (the layout's later device steps:
    replays of its graph, or of its eager form), ``eager_calls`` (steps that ran the forward's Python: host steps and
    first steps), ``device_steps`` (all device steps).

    The cache is a :class:`~hf_cascade.cache.CascadeCache`, or for the T5 family's decoder self-attention a
    :class:`~hf_cascade.dense_cache.StaticSelfAttentionCache` (both :class:`~hf_cascade.static_step.StaticStepCache`).
    """

    def __init__(self, model, cache: StaticStepCache, capture_guard, capture: bool = True, compile: bool = False,
                 through_call: bool = False):
        # the model only weakly: a runner kept for the model's next call must not keep a deleted model alive;
        # the cache too: the session (or what it keeps for the next call) holds it
        self._model = weakref.ref(model)
        self._cache = weakref.ref(cache)
        self.through_call = through_call
        self.capture_enabled = capture and not through_call
        self.compiled = False if through_call else compile
        self.capture_guard = capture_guard
        self.original = self.forward_fn = None
        self.attach(model)
        self.disabled: str | None = None      # why the call's steps stopped being captured
        # hf_cascade.whole_step's captured steps kept for the next calls, the latest first: as many as the cache keeps
        # layouts (one per way the rows share)
        self.kept_steps: list = []
        self.begin_call()

    @property
    def whole_step_kept(self):
        """The latest captured step kept for the next call (None: none)."""
        return self.kept_steps[0] if self.kept_steps else None

    def keep_step(self, kept) -> None:
        """Keep ``kept`` (a new captured step, or one about to be captured) first; a kept step of the same layout
        (the same hold kind and serial: superseded) and the oldest beyond :data:`KEPT_LAYOUTS` are dropped."""
        same = kept.step_key[:2]
        others = [k for k in self.kept_steps if k is not kept and k.step_key[:2] != same]
        self.kept_steps = ([kept] + others)[:KEPT_LAYOUTS]

    def drop_dead(self, alive=None) -> None:
        """Drop the kept steps that ``alive(step_key)`` says can no longer replay (None: keep them all)."""
        if alive is not None:
            self.kept_steps = [k for k in self.kept_steps if alive(k.step_key)]

    @property
    def model(self):
        return self._model()

    @property
    def cache(self) -> CascadeCache:
        return self._cache()

    def attach(self, model) -> None:
        """Take the model's forward for a call (dropped again by :meth:`detach` when the runner is kept)."""
        if self.original is None:
            self.original = model if self.through_call else model.forward
            # the whole decode forward as one compiled graph (cache write and cascade attention included), inside the
            # captured graph: inductor fuses the norms, rotary and MLP glue
            self.forward_fn = _compiled(self.original, self.compiled) if self.compiled else self.original

    def detach(self) -> None:
        """Drop every strong reference to the model (its bound forward); the kept step stays."""
        self.original = self.forward_fn = None

    def begin_call(self) -> None:
        """Counters of one generate call (a kept runner serves several)."""
        self.captures, self.capture_seconds, self.replays, self.eager_calls, self.first_steps = 0, 0.0, 0, 0, 0
        self.device_steps = 0
        self.disabled = None

    def release(self) -> None:
        """Drop the kept steps (their graphs, memory pools and tensors)."""
        self.kept_steps = []

    # ---- one forward --------------------------------------------------------------------------------
    def _call(self, static):
        """``forward_fn`` on a static step begun before it; a compiled forward gets the step's context as its own
        argument (it reaches every attention call, on every transformers version: the per-thread shim cannot be read
        inside a traced graph)."""
        if self.forward_fn is self.original:
            return self.original(**static)
        return self.forward_fn(**static, **{STEP_KWARG: self.cache.step})

    def forward_step(self, static):
        """:meth:`_call`, and where the compiled forward fails to compile (:func:`compile_failure`): the plain forward
        from then on, logged once. Any other error (the model's, a hook's) propagates as it is, once."""
        if self.forward_fn is self.original:
            return self.original(**static)
        try:
            return self._call(static)
        except Exception as err:  # noqa: BLE001 — sorted by compile_failure; the rest is re-raised
            if not compile_failure(err):
                raise
            log_once(("compile", type(err).__name__), logging.WARNING,
                     "CascadeConfig(compile=%r) failed (%s: %s); decode runs uncompiled",
                     self.compiled, type(err).__name__, str(err)[:200])
            self.forward_fn = self.original
            self.cache.rewind_step()           # the layers that ran wrote their K/V: the same slots again
            return self.original(**static)

    def replay_refusal(self, ctx) -> str | None:
        """Why the step just run on ``ctx`` cannot be replayed from a graph (None when it can)."""
        if len(ctx.written) != len(self.cache.layers):
            return "not every layer wrote its K/V through the cascade cache"
        unsafe = sorted({b.name for b in ctx.backends.values() if not b.graph_safe})
        if unsafe:
            return f"the {', '.join(unsafe)} attention backend cannot be captured"
        if not ctx.backends:
            return "no layer ran the cascade attention"
        return None

    # ---- the one capture recipe -----------------------------------------------------------------------
    def capture(self, step: Callable[[], object], refusal: Callable[[], str | None]):
        """``step()`` run eagerly on a side stream (as the capture runs on one), then, unless ``refusal()`` names a
        reason, the same step captured as a CUDA graph. ``step`` must leave what it reads as it found it but for what
        it advances on purpose (a whole step reads its inputs and state and writes the next step's). Returns
        ``(result, graph, captured_result)``: the eager step's result, and the graph with the tensors its replays
        write, or ``None, None`` where the step cannot be captured (the reason logged once; ``disabled`` says it)."""
        self.first_steps += 1
        with self.capture_guard():
            side = _side_stream(torch.cuda.current_device())
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                result = step()
            torch.cuda.current_stream().wait_stream(side)
            self.eager_calls += 1
            reason = refusal()
            if reason is not None:
                self._disable(reason, "the whole decode step runs eagerly: %s", reason)
                return result, None, None
            started = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            try:
                # no cyclic garbage collection inside the capture: it would run the finalizers of whatever dead cycles
                # it finds (a dead CascadeCache's VMM pool unmaps and synchronises the device), and their CUDA calls
                # would invalidate the capture
                with _gc_paused(), torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle(),
                                                    capture_error_mode="thread_local"):
                    captured = step()
            except Exception as err:  # noqa: BLE001 — e.g. a host sync in the model's forward: run eagerly
                _end_failed_capture()
                where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                                    for f in reversed(traceback.extract_tb(err.__traceback__)[-4:]))
                self._disable(f"capture failed ({type(err).__name__}: {str(err)[:200]})",
                              "the whole decode step could not be captured (%s: %s; at %s); it runs eagerly",
                              type(err).__name__, str(err)[:200], where, level=logging.WARNING)
                return result, None, None
            self.capture_seconds += time.perf_counter() - started
            self.captures += 1
            if self.captures > 1:
                logger.info("decode step re-captured (%d captures this call)", self.captures)
        return result, graph, captured

    def _disable(self, reason: str, message: str, *args, level=logging.INFO) -> None:
        """The call's steps run eagerly from now on (``disabled`` says why); ``message % args`` logged once."""
        self.disabled = reason
        log_once(("disabled", reason), level, message, *args)


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic garbage collector off for the block (as it was before, after it). Captures run one at a
    time (the runner's capture guard), so no other thread's block overlaps."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _end_failed_capture() -> None:
    """PyTorch ends the CUDA generator's capture (its epilogue) only when a capture succeeds: after a failed one
    the device's default generator stays marked as capturing, and every later random op on it raises ("Offset
    increment outside graph capture"), sampling included. One small capture that succeeds ends it."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.zeros(1, device=torch.cuda.current_device())
        del graph
    except Exception as err:  # noqa: BLE001 — nothing more can be done here; say so
        logger.warning("after a failed decode-graph capture, CUDA's random generator could not be reset "
                       "(%s: %s); random ops on this device may fail", type(err).__name__, str(err)[:200])


_side_streams: dict = {}


def _side_stream(device: int) -> "torch.cuda.Stream":
    """The stream a capture's warm-up runs on: one per device for the process, so that what libraries keep per
    stream (cuBLAS's workspace) is allocated once, not at every capture."""
    with _lock:
        if device not in _side_streams:
            _side_streams[device] = torch.cuda.Stream(device)
        return _side_streams[device]


# how every compiled part of a decode step compiles (the forward here, the whole step's bookkeeping and token choice)
COMPILE_OPTIONS = dict(dynamic=False, fullgraph=True, mode="default")


def compile_options(compile) -> dict:
    """``torch.compile``'s arguments for ``CascadeConfig(compile=True)`` (never a mode with inductor's own CUDA
    graphs, which would copy the cache's pools: ours captures the compiled step)."""
    return dict(COMPILE_OPTIONS)


def compile_failure(err: BaseException) -> bool:
    """Whether ``err`` is torch.compile's own failure, which a compiled part of the step answers by running uncompiled:
    dynamo could not trace (a graph break under ``fullgraph``, a compiled static step refusing host work, an exception
    met while tracing: the uncompiled run raises it again as itself) or inductor could not build. Errors a compiled
    graph raises when it runs, and every error of an uncompiled forward, are the model's: they propagate. Dynamo's
    recompile limit met under ``fullgraph`` is one too (a process that compiled ``torch._dynamo.config.recompile_limit``
    shapes of one function: the forward, or the one compiled layer of ``compile="regional"``, which every kind of layer
    of every model shares)."""
    from torch._dynamo import exc
    limit = getattr(exc, "FailOnRecompileLimitHit", None)
    return (isinstance(err, exc.TorchDynamoException) or (limit is not None and isinstance(err, limit))
            or type(err).__module__.startswith("torch._inductor"))


def _compiled(forward, compile=True):
    """``forward`` compiled for a fixed shape as one graph (``fullgraph``: a graph break would compile each layer's
    frames apart, one recompile per layer; a model that breaks runs uncompiled instead), in ``compile``'s mode;
    ``compile="regional"``: each decoder layer compiled on its own by one shared compiled layer
    (:mod:`hf_cascade.regional`), the rest of the forward eager; a model whose layers it cannot find compiles whole,
    logged once."""
    if compile == "regional":
        model = getattr(forward, "__self__", None)       # (an instance's own forward, e.g. accelerate's, has none)
        reason = "the model's forward is not its class's" if model is None else regional.unsupported_reason(model)
        if reason is None:
            return regional.RegionalForward(forward, compile_options(compile))
        log_once(("regional", reason), logging.INFO, "CascadeConfig(compile='regional'): %s; the decode forward "
                 "compiles whole", reason)
    return torch.compile(forward, **compile_options(compile))
