"""The step context: everything one forward step of a CascadeCache needs, in one object, and how it reaches
the attention function.

The cache builds one :class:`StepContext` when a step begins, in one place (``CascadeCache._new_context``): before the
forward where the device planned the step (``begin_planned_step``: the whole step), or at the first layer's ``update``
(a step planned on the host: the prefill, a host step, a caller running the model directly). Each layer's
``update`` stores its K/V and records the layer in the context; the attention function registered as "cascade" then
reads from it the layer's pool, the step's plan, and the kernel backend and its metadata for the layer's shape
(chosen and built once per step, or once per static decode layout).

How the context reaches the attention function (decided once, at import, by the transformers version):

- transformers >= 5.24 calls ``Cache.update(k, v, layer_idx, kwargs=<the attention kwargs>)`` and then splats the
  same dict into the attention call: ``update`` puts the context in it under :data:`STEP_KWARG`, an argument;
- below 5.24 ``update`` gets no such dict (nor from the few modeling files that pass none, e.g. GPT-NeoX's):
  :func:`set_context` / :func:`get_context` / :func:`reset_context` are then the one channel (nano-vllm's
  ``utils/context.py``). It keeps the context per thread, because two threads may generate at once
  (tests/decode/test_threads.py), and weakly, so that a dropped cache frees its pools at once. The attention reads it
  only for a layer written and not yet read in that step, so a stale context never reaches a later dense forward.

- a compiled forward (the graph runner's ``compile``) gets the context as the forward's own ``cascade_step`` argument,
  which transformers hands on to every attention call: a thread-local cannot be read inside a traced graph, so the
  shim is left out there on every transformers version.

On a static decode step (:attr:`~hf_cascade.plan.StepPlan.static`) a layer's attention is resolved once for the
layout: its backend, the :class:`~hf_cascade.kernels.base.AttentionParams` the kernels get (a window no row can pass
during the layout left out) and, where the backend keeps it per layout, its metadata, as one :class:`BoundAttention`
kept in the layout. Every later step of the layout finds it with one lookup; a compiled forward traces only that
lookup and the kernels (the graph runner runs the first step of a layout eagerly, which binds every layer).

A context refers to its cache weakly (the cache holds its step's context until the next step): no reference cycle.
"""
from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import kernels
from ..compat import UPDATE_PASSES_KWARGS  # noqa: F401 (re-exported: the route, decided by the transformers version)
from ..kernels.base import AttentionParams
from ..precision import as_computed

if TYPE_CHECKING:
    from ..kernels.base import Backend
    from .plan import StepPlan

# the attention kwargs entry that carries the step context (transformers >= 5.24)
STEP_KWARG = "cascade_step"


def _no_cache():
    return None


class BoundAttention(NamedTuple):
    """One layer's attention on a static decode layout, resolved by its first step and kept by the layout.

    - ``backend``: the kernel backend; ``backend_key``: its key in :attr:`StepContext.backends`;
    - ``params``: the :class:`~hf_cascade.kernels.base.AttentionParams` the kernels get (a window no row can pass
      while the layout holds is left out: the layout's capacity bounds every row);
    - ``metadata``: the backend's metadata kept for the layout, or None where the backend builds it per step;
    - ``call``: the AttentionParams of the model's attention call; the binding serves a call that passes the same
      (``call.serves``)."""

    backend: "Backend"
    backend_key: tuple
    params: AttentionParams
    metadata: Any
    call: AttentionParams


def _binding_key(layer_idx: int) -> tuple:
    """Where a layout's ``metadata`` dict keeps a layer's :class:`BoundAttention` (backends' keys begin with a name)."""
    return ("bound attention", layer_idx)


class StepContext:
    """One forward step of one CascadeCache.

    - ``cache``: the cache (held weakly: the cache holds its context until the next step);
    - ``plan``: the step's :class:`~hf_cascade.plan.StepPlan` (host arrays, device tensors via ``plan.on``);
    - ``step_id``: increases by one per step of the cache;
    - ``written``: layer index -> (layer, K shape) of the layers whose K/V this step stored (a layer written twice
      means a new step); the attention finds its layer's pool here by ``module.layer_idx``;
    - ``unread``: layers written whose attention has not run (the next ``update`` refuses to go on while one is);
    - ``backends``: the kernel backend chosen for each layer shape and AttentionParams (the graph runner checks them);
      on a static decode step each layer's choice is bound once for the layout (:meth:`bind_attention`);
    - ``metadata``: each backend's per-step metadata (a static decode layout keeps its own for the call);
    - ``finished``: the step is over though its layers may not have written (a replayed CUDA graph): the next
      ``update`` begins a new step.
    """

    def __init__(self, cache, plan: "StepPlan", step_id: int):      # cache: the CascadeCache of the step
        self._cache = weakref.ref(cache) if cache is not None else _no_cache
        self.plan, self.step_id = plan, step_id
        self.written: dict[int, tuple[Any, Any]] = {}     # layer_idx -> (its CascadeLayer, the K shape it stored)
        self.unread: set[int] = set()
        self.backends: dict = {}
        self.metadata: dict = {}
        self.finished = False

    @property
    def cache(self):        # the CascadeCache, or None once it is gone
        return self._cache()

    @property
    def first_write(self) -> bool:
        return len(self.written) == 1

    def rewind(self) -> None:
        """Let the step's layers write again (same slots, same values), as into a step just begun (what a compiled
        forward, traced on a step begun before it, expects)."""
        self.written.clear()
        self.unread.clear()
        self.backends.clear()
        self.metadata.clear()
        self.finished = False

    def finish(self) -> None:
        self.finished = True

    def bound_attention(self, layer_idx: int, passed: tuple) -> BoundAttention | None:
        """The layer's attention resolved for this static step's layout, if it serves a call that passes ``passed``
        (the fields of :class:`~hf_cascade.kernels.base.AttentionParams`, in order; its backend is then recorded as
        one this step ran). Dict lookups and comparisons only: what a compiled forward traces."""
        bound = self.plan.layout.metadata.get(_binding_key(layer_idx))
        if bound is None or not bound.call.serves(*passed):
            return None
        self.backends[bound.backend_key] = bound.backend
        return bound

    def bind_attention(self, layer_idx: int, name: str, q, pool, call: AttentionParams) -> BoundAttention:
        """Resolve the layer's attention for this static step's layout (host work: backend choice, metadata) and
        keep it in the layout for the steps after; ``call``: what the model's attention call passed."""
        # a window no row passes while the layout holds (its capacity bounds every row) is left out: plain causal
        # attention, which more backends take
        passes = call.window is not None and self.cache.attention_horizon(True) > call.window
        params = call if passes else call.without_window()
        backend = self.backend(name, q, pool, params)
        metadata = self.backend_metadata(backend, q, pool, params) if backend.layout_metadata else None
        bound = BoundAttention(backend, self._backend_key(q, params), params, metadata, call)
        self.plan.layout.metadata[_binding_key(layer_idx)] = bound
        return bound

    @staticmethod
    def _backend_key(q, params: AttentionParams) -> tuple:
        return (params, q.device, q.dtype, q.shape[-2], q.shape[-1])

    def backend(self, name: str, q, pool, params: AttentionParams) -> "Backend":
        """The kernel backend for this step, layer shape and params (``kernels.select`` runs once per step each)."""
        key = self._backend_key(q, params)
        found = self.backends.get(key)
        if found is None:
            found = self.backends[key] = kernels.select(name, q, pool, self.plan, params)
        return found

    def backend_metadata(self, backend: "Backend", q, pool, params: AttentionParams):
        """``backend``'s metadata of this step for layers like this one: built by the first, reused by the others.
        On a static decode step a backend whose metadata holds for the layout keeps it in the layout (the call)."""
        plan = self.plan
        store = plan.layout.metadata if plan.layout is not None and backend.layout_metadata else self.metadata
        key = (backend.name,) + backend.metadata_key(q, pool, params, plan)
        found = store.get(key)
        if found is None or not backend.reusable(found):
            found = store[key] = backend.build(plan, q, pool, params)
        return found


class LayerStep:
    """One layer's share of a static decode step, for a decoder layer compiled on its own
    (``CascadeConfig(compile="regional")``: :mod:`hf_cascade.regional`), found on the host before the layer's compiled
    code runs, so that nothing in that code reads the layer's ``layer_idx`` (one compiled layer then serves every
    layer). It comes into the layer as its cache (:meth:`update` writes into this layer's pool, whatever index it is
    given) and as the ``cascade_step`` argument of its attention call (:func:`hf_cascade.attention.cascade_attention`).

    - ``plan``: the step's :class:`~hf_cascade.plan.StepPlan`;
    - ``layer``: the layer's :class:`~hf_cascade.cache.CascadeLayer`, its static pool made ready (``step_pool``);
    - ``bound``: the layer's :class:`BoundAttention` on the layout."""

    def __init__(self, plan: "StepPlan", layer, bound: BoundAttention):
        self.plan, self.layer, self.bound = plan, layer, bound

    def update(self, key_states, value_states, *args, **kwargs):
        """``Cache.update`` of the layer: its K/V written into its pool (tensor work only); returns them (in
        autocast's dtype under autocast, as ``CascadeCache.update``)."""
        key_states, value_states = as_computed(key_states, value_states)
        self.layer.write(key_states, value_states, self.plan)
        return key_states, value_states


# ---- transformers < 5.24: the one per-thread channel -------------------------------------------------------------
_local = threading.local()


def set_context(context: StepContext | None) -> None:
    """Make ``context`` this thread's current step (held weakly): where ``Cache.update`` gets no attention kwargs."""
    _local.context = None if context is None else weakref.ref(context)


def get_context() -> StepContext | None:
    """This thread's current step set by :func:`set_context`, if its cache still holds it."""
    ref = getattr(_local, "context", None)
    return None if ref is None else ref()


def reset_context(cache: Any = None) -> None:
    """Forget this thread's current step (only if it belongs to ``cache``, when one is given)."""
    context = get_context()
    if context is not None and (cache is None or context.cache is cache):
        set_context(None)
