"""The decode step as one captured CUDA graph, inside transformers' own generate loop.

transformers' ``_beam_search`` and ``_sample`` call ``model(**model_inputs)`` once per step; on a GPU that
step is bound by the host (hundreds of small launches from Python). A generate call's
:class:`~hf_cascade.session.DecodeSession` installs a :class:`DecodeGraphRunner` that stands in for
``model.forward`` while the decode loop runs. For a decode-shaped call (one new token per row, on the call's
static :class:`~hf_cascade.plan.DecodeLayout`) it

1. begins the cache's step on the host (block bookkeeping, plan) and uploads the plan into the layout's
   persistent device buffers (one copy per step);
2. copies the step's fixed-shape inputs (ids, positions, ...) into static input tensors;
3. replays a graph of the whole forward (embeddings, every layer with its K/V write and cascade attention,
   final norm, logits) captured at the first such step.

The first decode step runs eagerly on the static inputs (its result is the step's result), then the same
step is captured (nothing runs during a capture, so the pool is not touched). Every other call (prefill,
other shapes, output_attentions, ...) runs the model's own forward. The graph is kept for the call and
re-captured when what it baked in changes: the input shapes, the layout (rows outgrew its capacity) or a
pool's address (``memory="grow"`` moves its pool when it grows; ``vmm`` and ``static`` never do).

With ``CascadeConfig(compile=True)`` the forward the runner captures (or, with ``cuda_graphs="eager"``, runs) is
``torch.compile(fullgraph=True)`` of the model's forward: every layer's cache write and cascade attention inside one
graph, the kernels as typed operators. A new key's first step runs the plain forward first (it binds each layer's
attention on the layout: :mod:`hf_cascade.context`), then the compiled one, which gets the step context as its
``cascade_step`` argument; a forward that cannot compile runs uncompiled, logged once. With ``compile="regional"`` the
compiled forward is :class:`hf_cascade.regional.RegionalForward` (the forward eager, each decoder layer one shared
compiled layer), called the same way.

This module owns the runner (capture and replay), the forward dispatcher and the support policy
(:func:`unsupported_reason`, with quantized layers' capture safety in :func:`quantized_capture_reason`);
which runner a call uses, what is kept for the next call and the capture guard
belong to :mod:`hf_cascade.session`.

Threads: while any generate call runs a runner in transformers' loop on a model (the whole step calls its runner
itself), ``model.forward`` is one :class:`_ForwardDispatch`
(installed by the first such call, removed by the last, exceptions included), which runs the runner of the
calling thread's generate call, and the model's own forward for every other caller (another thread's
``model(...)``, or its generate call without a runner). Several threads may so generate with one model at
once, each with its own cache and runner.
"""
from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import threading
import time
import weakref

import torch
import torch.nn.modules.module as module_hooks

from . import compat, regional
from .cache import CascadeCache
from .config import CascadeConfig
from .static_step import StaticStepCache
from .context import STEP_KWARG
from .logs import log_once
from .seq2seq_models import step_positions_reason

logger = logging.getLogger("hf_cascade")
# generate may run in several threads: guards the forward dispatchers and _side_streams
_lock = threading.RLock()

# kwargs of a decode forward that the graph does not take from the call (see _static_kwargs)
_IGNORED = ("attention_mask", "decoder_attention_mask")
# an encoder-decoder model's decode forward names its decoder inputs so (the encoder outputs, an object fixed for
# the call that the decoder does not read once the cross-attention K/V are stored, are passed through as they are)
_DECODER = {"input_ids": "decoder_input_ids", "position_ids": "decoder_position_ids",
            "inputs_embeds": "decoder_inputs_embeds"}


def unsupported_reason(model, cascade_config: CascadeConfig) -> str | None:
    """Why generate's decode steps cannot run on the graph runner for ``model`` under ``cascade_config`` (None when
    they can: captured and replayed, or with ``cuda_graphs="eager"`` its static path without capture)."""
    mode = cascade_config.cuda_graphs
    if mode is False:
        return "CascadeConfig(cuda_graphs=False)"
    devices = {str(p.device) for p in model.parameters()}
    if not devices:
        return "the model has no parameters"
    if len(devices) > 1 or len(set((getattr(model, "hf_device_map", None) or {}).values())) > 1:
        return "the model spans several devices (device_map)"
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        return "accelerate hooks (offloading or a device map) run inside the forward"
    if mode != "eager":                    # (the runner's eager form captures nothing)
        reason = quantized_capture_reason(model)
        if reason is not None:
            return reason
    text = model.config.get_text_config(decoder=True)
    can_set_experts = getattr(type(model), "_can_set_experts_implementation", None)
    if (mode != "eager" and getattr(model.config, "_experts_implementation", None) == "eager"
            and can_set_experts is not None and can_set_experts()):     # (the runner's eager form captures nothing)
        return ("experts_implementation='eager' (its loop over the experts synchronises with the host); load the "
                "model with experts_implementation='grouped_mm' (the default on CUDA) for graphs")
    rope = getattr(text, "rope_scaling", None) or getattr(text, "rope_parameters", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope"):
        return f"{rope.get('rope_type', rope.get('type'))} RoPE changes its frequencies on the host with the length"
    device = next(model.parameters()).device
    if device.type != "cuda" and mode != "eager":        # "eager": the static path without capture, any device
        return f"the model is on {device.type}, not CUDA"
    return None


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
    # (global hooks run on every submodule too; hooks on the model itself run in its __call__, around the replayed
    # forward)
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
    """Stands in for ``model.forward`` during one generate call's decode loop (a context manager).

    ``capture_guard()`` is entered from the first step's warm-up to the end of its capture (the session's:
    captures one at a time in the process, the pools' memory held). ``capture=False`` runs the same static path
    (fixed input tensors, the layout's buffers, one plan upload per step) with an eager forward instead of a
    replay: on any device, for debugging and tests.
    Attributes for benchmarks: ``captures`` (count), ``capture_seconds``, ``replays``, ``eager_calls``.

    The cache is a :class:`~hf_cascade.cache.CascadeCache`, or for the T5 family's decoder self-attention a
    :class:`~hf_cascade.dense_cache.StaticSelfAttentionCache`, which offers the same static-step interface
    (``prepare_step`` and its step's ``finish``/``rewind``, ``step``, ``rewind_step``, ``layout.serial``, ``layers``,
    ``batch_size``, ``logical_length``).
    """

    def __init__(self, model, cache: StaticStepCache, capture_guard, capture: bool = True, compile: bool = False):
        # the model only weakly: a runner kept for the model's next call must not keep a deleted model alive;
        # the cache too: the session (or what it keeps for the next call) holds it
        self._model = weakref.ref(model)
        self._cache = weakref.ref(cache)
        self.capture_enabled, self.compiled = capture, compile
        # a context for the warm-up and capture: serialises them with other calls and holds the pools' memory
        self.capture_guard = capture_guard
        self.encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
        self.original = self.forward_fn = None
        self.attach(model)
        self.graph = None
        self.pool = None
        self.static_kwargs: dict = {}
        self.static_out = None
        self._out_args: dict = {}             # static_out's fields that are the call's own objects (the cache)
        self.key = None
        self.disabled: str | None = None      # why graphs stopped for the rest of the call
        self._installed: list = []            # (model, thread) of each __enter__ not yet exited
        self.whole_step_kept = None           # hf_cascade.whole_step's captured step, kept for the next call
        self.begin_call()

    @property
    def model(self):
        return self._model()

    @property
    def cache(self) -> CascadeCache:
        return self._cache()

    def attach(self, model) -> None:
        """Take the model's forward for a call (dropped again by :meth:`detach` when the runner is kept)."""
        if self.original is None:
            self.original = plain_forward(model)      # never a dispatcher: a concurrent call may have installed one
            # the whole decode forward as one compiled graph (cache write and cascade attention included: see
            # _run), inside the captured graph: inductor fuses the norms, rotary and MLP glue
            self.forward_fn = _compiled(self.original, self.compiled) if self.compiled else self.original

    def detach(self) -> None:
        """Drop every strong reference to the model (its bound forward); the graph and static tensors stay."""
        self.original = self.forward_fn = None

    def begin_call(self) -> None:
        """Counters of one generate call (a kept runner serves several)."""
        self.captures, self.capture_seconds, self.replays, self.eager_calls, self.first_steps = 0, 0.0, 0, 0, 0
        self.device_steps = 0       # steps of hf_cascade.whole_step's loop (planned and chosen on the device)
        self.disabled = None

    # ---- installing ---------------------------------------------------------------------------------
    def __enter__(self):
        """This thread's calls of ``model.forward`` run this runner until ``__exit__`` (see _ForwardDispatch)."""
        model, thread = self.model, threading.get_ident()
        _ForwardDispatch.install(model, self, thread)
        self._installed.append((model, thread))
        return self

    def __exit__(self, *exc):
        model, thread = self._installed.pop()
        _ForwardDispatch.uninstall(model, self, thread)
        if exc[0] is not None:        # a step failed: nothing half-captured stays
            self.release()
        return False

    def release(self) -> None:
        """Drop the graph, its memory pool and the static tensors."""
        self.graph, self.pool, self.static_kwargs, self.static_out, self.key = None, None, {}, None, None
        self._out_args = {}
        self.whole_step_kept = None

    # ---- one forward --------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if args or not self._decode_shaped(kwargs):
            self.eager_calls += 1
            return self.original(*args, **kwargs)
        ctx = self.cache.prepare_step(self._arg(kwargs, "input_ids").shape[0], 1)
        if not ctx.plan.static:        # the cache planned this step anew: nothing fixed to replay
            self.eager_calls += 1
            return self.original(*args, **kwargs)
        self._upload(ctx)               # first: a pool that grows may move, which the key must see
        key = self._key(kwargs)
        if self.graph is None or key != self.key:
            return self._first_step(kwargs, key)
        self._copy_inputs(kwargs)
        if isinstance(self.graph, _EagerGraph):
            self.graph.replay(kwargs)
        else:
            self.graph.replay()
        self._step_done(ctx)
        self.replays += 1
        return self._output(kwargs)

    def _arg(self, kwargs, name):
        """A decoder input by its decoder-only name (an encoder-decoder model's call names it ``decoder_*``)."""
        return kwargs.get(_DECODER[name]) if self.encoder_decoder else kwargs.get(name)

    def _decode_shaped(self, kwargs) -> bool:
        ids = self._arg(kwargs, "input_ids")
        cache = compat.cache_of(kwargs)
        if self.encoder_decoder:       # the decoder's self-attention cache inside the EncoderDecoderCache
            cache = getattr(cache, "self_attention_cache", None)
        shaped = (self.disabled is None and cache is self.cache and isinstance(ids, torch.Tensor) and ids.dim() == 2
                  and ids.shape[1] == 1 and ids.shape[0] == self.cache.batch_size
                  and self.cache.logical_length > 0 and self._arg(kwargs, "inputs_embeds") is None
                  and not kwargs.get("output_attentions") and not kwargs.get("output_hidden_states"))
        if not shaped:
            return False
        # the model would compute its positions from the cache length on the host, which a graph freezes
        if self.encoder_decoder:         # the BART family reads decoder_position_ids only through patches/positions
            reason = step_positions_reason(self.model, kwargs)
        elif not isinstance(self._arg(kwargs, "position_ids"), torch.Tensor):
            reason = "the decoder's positions are not an input of the step (computed on the host)"
        else:
            reason = None
        if reason is not None:
            self.disabled = reason
            log_once(("disabled", self.disabled), logging.INFO, "decode steps run without CUDA graphs: "
                      "%s", self.disabled)
            return False
        return True

    def _key(self, kwargs):
        """What the captured graph baked in: input shapes and options, the layout, the pools' addresses."""
        inputs = tuple(sorted((k, tuple(v.shape), v.dtype, str(v.device)) if isinstance(v, torch.Tensor)
                              else (k, v if _plain(v) else self._object_key(k, v))
                              for k, v in kwargs.items() if k not in _IGNORED))
        layout = self.cache.layout
        return inputs, None if layout is None else layout.serial, pool_signature(self.cache)

    def _object_key(self, name, value):
        """An object argument in the key: the same live object; but an encoder-decoder's encoder outputs by their
        fields' shapes, since the decoder never reads them (NaN placeholders: the cross K/V are stored) and each call
        brings its own (a kept graph replays for the next call of the same shape)."""
        if self.encoder_decoder and name == "encoder_outputs" and hasattr(value, "items"):
            return ("encoder_outputs", type(value), tuple(
                (field, tuple(t.shape), t.dtype, str(t.device)) if isinstance(t, torch.Tensor) else (field, type(t))
                for field, t in value.items()))
        return _Same(value)

    def _static_kwargs(self, kwargs):
        """The forward's tensor and plain arguments, the tensors copied into tensors the graph owns. The 2D
        attention mask grows every step and is left out: decode attention reads each row's own tokens from
        the cache (pads are never stored) and positions come from ``position_ids``. Other objects (the cache,
        encoder outputs) are not kept: each forward takes them from its call (:meth:`_with_objects`), so that
        a kept runner holds no cache."""
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()
                if k not in _IGNORED and (isinstance(v, torch.Tensor) or _plain(v))}

    @staticmethod
    def _with_objects(static, kwargs):
        """``static`` plus the call's other objects from ``kwargs`` (same keys as when static was made)."""
        return {**{k: v for k, v in kwargs.items() if k not in _IGNORED and k not in static}, **static}

    def _keep_output(self, out, kwargs):
        """Keep a step's output for the replays, less the fields that are objects of the call (its cache:
        a kept runner must not hold it); :meth:`_output` puts the replaying call's own back."""
        objects = {id(v): k for k, v in kwargs.items() if not isinstance(v, torch.Tensor) and not _plain(v)}
        self._out_args = {name: objects[id(v)] for name, v in out.items() if id(v) in objects}
        self.static_out = out.__class__(**{name: v for name, v in out.items() if name not in self._out_args})

    def _output(self, kwargs):
        fields = dict(self.static_out.items())
        fields.update({name: kwargs[arg] for name, arg in self._out_args.items()})
        return self.static_out.__class__(**fields)

    def _copy_inputs(self, kwargs):
        for k, v in self.static_kwargs.items():
            if isinstance(v, torch.Tensor):
                v.copy_(kwargs[k], non_blocking=True)

    def _upload(self, ctx):
        """What the layers' Python does before their kernels: upload the plan (``prepare_step`` made the pools ready:
        a static step does so when it begins)."""
        for layer in self.cache.layers:
            if layer.storage is not None:
                ctx.plan.on(layer.storage.device)

    def _step_done(self, ctx):
        ctx.finish()                     # the next forward begins a new step

    # ---- capture --------------------------------------------------------------------------------------
    def _first_step(self, kwargs, key):
        """Run this step eagerly on fresh static inputs (its result is returned), then capture it."""
        self.release()
        self.first_steps += 1
        static = self._static_kwargs(kwargs)
        ctx = self.cache.step
        if not self.capture_enabled:
            out = self._run(self._with_objects(static, kwargs))
            self._step_done(ctx)
            self.static_kwargs, self.key = static, key
            self.graph = _EagerGraph(self, static)
            self.eager_calls += 1
            return out
        with self.capture_guard():
            return self._warm_up_and_capture(static, ctx, key, kwargs)

    def _warm_up_and_capture(self, static_tensors, ctx, key, kwargs):
        static = self._with_objects(static_tensors, kwargs)
        side = _side_stream(torch.cuda.current_device())
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):          # warm-up on a side stream, as capture will run on one
            out = self._run(static)
        torch.cuda.current_stream().wait_stream(side)
        self.eager_calls += 1
        reason = self.replay_refusal(ctx)
        if reason is not None:
            return self._disable(reason, ctx, out)
        started = time.perf_counter()
        self.cache.rewind_step()
        graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        try:
            # no cyclic garbage collection inside the capture: it would run the finalizers of whatever dead cycles
            # it finds (a dead CascadeCache's VMM pool unmaps and synchronises the device; torch stopped collecting
            # before a capture), and their CUDA calls would invalidate the capture
            with _gc_paused(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                static_out = self._call(static)
        except Exception as err:  # noqa: BLE001 — e.g. a host sync inside the model's forward
            _end_failed_capture()
            return self._disable(f"capture failed ({type(err).__name__}: {str(err)[:200]})", ctx, out)
        finally:
            self._step_done(ctx)
        self.capture_seconds += time.perf_counter() - started
        self.captures += 1
        if self.captures > 1:
            logger.info("decode graph re-captured (%d captures this call)", self.captures)
        self.graph, self.pool, self.static_kwargs, self.key = graph, pool, static_tensors, key
        self._keep_output(static_out, kwargs)
        return out

    def _run(self, static):
        """The first step's forward on the step's static inputs. With ``compile``: the eager forward first, which binds
        every layer's attention on the layout (the compiled one traces no host work), then the compiling one, whose
        result is the step's; a model dynamo cannot compile runs uncompiled, logged."""
        if self.forward_fn is self.original:
            return self.original(**static)
        self.original(**static)
        self.cache.rewind_step()               # the same slots again, from the compiled forward
        return self.forward_step(static)

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
        """Why the step just run cannot be replayed from a graph (None when it can); the whole step on the device
        (:mod:`hf_cascade.whole_step`) asks the same of its host steps."""
        if len(ctx.written) != len(self.cache.layers):
            return "not every layer wrote its K/V through the cascade cache"
        unsafe = sorted({b.name for b in ctx.backends.values() if not b.graph_safe})
        if unsafe:
            return f"the {', '.join(unsafe)} attention backend cannot be captured"
        if not ctx.backends:
            return "no layer ran the cascade attention"
        return None

    def _disable(self, reason, ctx, out):
        self.disabled = reason
        self._step_done(ctx)
        self.release()
        log_once(("disabled", reason), logging.INFO, "decode steps run without CUDA graphs: %s", reason)
        return out


class _EagerGraph:
    """``capture=False``: "replays" by running the forward eagerly on the static inputs."""

    def __init__(self, runner, static):
        self.runner, self.static = weakref.ref(runner), static     # (the runner holds this graph)

    def replay(self, kwargs):
        runner = self.runner()
        runner.cache.rewind_step()
        runner._keep_output(runner.forward_step(runner._with_objects(self.static, kwargs)), kwargs)


def _plain(value) -> bool:
    """A forward argument a graph's key compares by value (an option: use_cache, logits_to_keep, ...)."""
    return isinstance(value, (bool, int, float, str, type(None)))


class _Same:
    """A forward argument that is an object (the cache, encoder outputs) in a graph's key: equal to another for
    the same live object. Held weakly where it can be (a kept runner must not keep its cache alive; a dead one
    equals nothing, so an id reused by a new object cannot match)."""

    __slots__ = ("ref",)

    def __init__(self, obj):
        try:
            self.ref = weakref.ref(obj)
        except TypeError:             # not weakly referenceable: held, as before
            self.ref = lambda obj=obj: obj

    def __eq__(self, other):
        mine = self.ref()
        return isinstance(other, _Same) and mine is not None and mine is other.ref()

    __hash__ = None


def plain_forward(model):
    """``model.forward`` without a dispatcher of ours: the instance's own (accelerate sets one) or the class's."""
    forward = model.__dict__.get("forward")
    if isinstance(forward, _ForwardDispatch):
        return forward.plain(model)
    return model.forward


class _ForwardDispatch:
    """``model.forward`` while generate calls run :class:`DecodeGraphRunner` s on the model: the runner of the
    calling thread's innermost call, else the forward it replaced. Installed by the first call (:meth:`install`),
    reference-counted, and the replaced forward restored exactly (an instance attribute, e.g. accelerate's, or
    none) when the last call ends (:meth:`uninstall`), also when it raises."""

    def __init__(self, model, saved):
        self._model = weakref.ref(model)   # (weakly: no cycle through the model's __dict__)
        self.saved = saved          # the instance's own forward it replaced, or None (the class's)
        self.runners: dict = {}     # thread ident -> the runners of that thread's calls (innermost last)
        self.calls = 0
        # what inspect.signature(model.forward) tells: generate reads it (position_ids, logits_to_keep, ...), also
        # in a thread that starts its call while another's runs
        try:
            self.__signature__ = inspect.signature(self.plain(model))
        except (TypeError, ValueError):      # a forward without one: generate sees (*args, **kwargs)
            pass

    def plain(self, model):
        return self.saved if self.saved is not None else type(model).forward.__get__(model, type(model))

    def __call__(self, *args, **kwargs):
        runners = self.runners.get(threading.get_ident())
        if runners:
            return runners[-1](*args, **kwargs)
        # another thread's call of the model (or its generate without a runner, or a call that looked the
        # dispatcher up just before the last generate call removed it): the model's own forward
        return self.plain(self._model())(*args, **kwargs)

    @classmethod
    def install(cls, model, runner, thread) -> None:
        with _lock:
            dispatch = model.__dict__.get("forward")
            if not isinstance(dispatch, cls):
                dispatch = cls(model, dispatch)
                model.forward = dispatch
            dispatch.calls += 1
            dispatch.runners.setdefault(thread, []).append(runner)

    @classmethod
    def uninstall(cls, model, runner, thread) -> None:
        with _lock:
            dispatch = model.__dict__.get("forward")
            if not isinstance(dispatch, cls):
                return                # someone replaced it meanwhile: theirs stays (it calls ours, which still works)
            runners = dispatch.runners.get(thread, [])
            for i in range(len(runners) - 1, -1, -1):
                if runners[i] is runner:
                    del runners[i]
                    break
            if not runners:
                dispatch.runners.pop(thread, None)
            dispatch.calls -= 1
            if dispatch.calls <= 0:
                if dispatch.saved is not None:
                    model.forward = dispatch.saved
                else:
                    model.__dict__.pop("forward", None)


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
