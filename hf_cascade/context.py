"""The step context: everything one forward step of a CascadeCache needs, in one object.

The cache builds one :class:`StepContext` when a step begins (the first layer's ``update``, or the graph
runner before it replays a captured step). Each layer's ``update`` records the K/V it just stored in it,
and the attention function registered as "cascade" reads it back: which layer and pool, the step's plan,
the layer's quirks and the kernel backend (chosen once per step and quirk set). This is the shape of
nano-vllm's ``utils/context.py``: transformers < 5.24 hands the attention function neither the cache nor
the layer's K/V bookkeeping, so the current context is kept per thread (two threads may generate with two
models, or with one model and two caches, at once) rather than passed as an argument.

Lifetime: the thread holds its current context weakly (the cache holds its step's context until the next step),
and a context refers to its cache weakly, so a cache that is dropped frees its pools at once (no reference cycle,
nothing kept per thread).
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from . import kernels

if TYPE_CHECKING:
    from .cache import CascadeCache, CascadeLayer
    from .plan import StepPlan

_local = threading.local()


@dataclass(frozen=True, eq=False)
class Quirks:
    """One layer's attention variants, as the model's attention call passes them (None: off).

    ``sinks``: the layer's attention-sink logits [Hq] (GPT-OSS ``s_aux``), a tensor, so quirk sets compare
    (and key the context's dicts) by its identity: the same parameter every step of a layer."""

    softcap: float | None = None
    window: int | None = None
    sinks: torch.Tensor | None = None

    def _key(self):
        return self.softcap, self.window, None if self.sinks is None else id(self.sinks)

    def __eq__(self, other):
        return isinstance(other, Quirks) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


class LayerPlan:
    """The step's plan as one layer's kernels read it: the plan's fields plus the layer's quirks
    (``softcap``, ``window``, ``sinks``). Built once per (step, quirks) by the context, shared by the layers
    that have the same quirks."""

    def __init__(self, plan: "StepPlan", quirks: Quirks = Quirks()):
        self.plan, self.quirks = plan, quirks
        self.softcap, self.window, self.sinks = quirks.softcap, quirks.window, quirks.sinks

    def __getattr__(self, name):
        return getattr(self.plan, name)


@dataclass
class LayerWrite:
    """What one layer's ``update`` stored: the attention call that follows checks it got these K/V."""

    layer: "CascadeLayer"
    key: torch.Tensor
    value: torch.Tensor


def _no_cache():
    return None


class StepContext:
    """One forward step of one CascadeCache.

    - ``cache``: the cache (held weakly: the cache holds its context until the next step);
    - ``plan``: the step's :class:`~hf_cascade.plan.StepPlan` (host arrays, device tensors via ``plan.on``);
    - ``step_id``: increases by one per step of the cache;
    - ``layers_written``: layers whose K/V this step already stored (a layer written twice means a new step);
    - ``pending``: the layer that wrote last and whose attention has not run yet;
    - ``backends``: the kernel backend chosen for each quirk set (once per step; the graph runner checks them);
    - ``layer_plans``: the plan as each quirk set sees it.
    """

    def __init__(self, cache: "CascadeCache", plan: "StepPlan", step_id: int):
        self._cache = weakref.ref(cache) if cache is not None else _no_cache
        self.plan, self.step_id = plan, step_id
        self.layers_written: set = set()
        self.pending: LayerWrite | None = None
        self.backends: dict = {}
        self.layer_plans: dict = {}

    @property
    def cache(self) -> "CascadeCache | None":
        return self._cache()

    @property
    def first_write(self) -> bool:
        return len(self.layers_written) == 1

    def layer_plan(self, quirks: Quirks) -> LayerPlan:
        found = self.layer_plans.get(quirks)
        if found is None:
            found = self.layer_plans[quirks] = LayerPlan(self.plan, quirks)
        return found

    def backend(self, name: str, q: torch.Tensor, pool: torch.Tensor, quirks: Quirks) -> ModuleType:
        """The kernel backend for this step and quirk set (``kernels.select`` runs once per step each)."""
        key = (quirks, q.device, q.dtype, q.shape[-2], q.shape[-1])
        found = self.backends.get(key)
        if found is None:
            found = self.backends[key] = kernels.select(name, q, pool, self.layer_plan(quirks))
        return found

    def min_saved_tokens(self) -> int:
        """The threshold of the backend(s) that ran this step (the strictest), for the next step's plan."""
        return max((getattr(b, "MIN_SAVED_TOKENS", 0) for b in self.backends.values()), default=0)


def current() -> StepContext | None:
    """The context of this thread's last layer write (None when none, or when its cache has moved on or is gone):
    its attention call takes the write (:func:`take_pending`); an encoder-decoder's cross-attention that follows
    records its backend in it."""
    ref = getattr(_local, "context", None)
    return None if ref is None else ref()


def set_current(context: StepContext | None) -> None:
    _local.context = None if context is None else weakref.ref(context)


def take_pending(layer_idx: int) -> tuple[StepContext, LayerWrite] | None:
    """The context and the K/V the CascadeCache layer ``layer_idx`` just stored, if any (consumed)."""
    context = current()
    if context is None or context.pending is None or context.pending.layer.layer_idx != layer_idx:
        return None
    write, context.pending = context.pending, None
    return context, write


def forget(cache: Any) -> None:
    """Drop this thread's context if it belongs to ``cache`` (the cache was reset)."""
    context = current()
    if context is not None and context.cache is cache:
        set_current(None)
