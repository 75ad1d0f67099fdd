"""Encoder-decoder cross-attention over K/V stored once per input: how the attention call finds them and runs.

The generate entry of an encoder-decoder model gives every decoder forward one more keyword argument,
``cascade_cross=`` a :class:`CrossContext` (:func:`forward_kwargs`); transformers passes a forward's keyword
arguments down to every attention call, so the attention function registered as "cascade" receives it. The context
holds the call's ``EncoderDecoderCache``: a cross-attention call is one whose module's ``layer_idx`` names a layer of
its cross-attention cache and whose K/V are that layer's (the model reads them from the cache and passes them on:
placeholders of stock's shape, the real K/V sit in the layer's paged pool). The context also keeps, for the call,
one :class:`~hf_cascade.context.StepContext` per cross plan: the backend per layer shape and its metadata. Kept with
the model's last call, it serves a later one whose sources refill the cross storages (:meth:`CrossContext.refilled`).
"""
from __future__ import annotations

import torch

from ..kv.context import StepContext
from ..kernels.base import AttentionParams
from ..precision import as_computed, kernels_context

# the forward (and so attention) keyword argument that carries the CrossContext
CROSS_KWARG = "cascade_cross"


class CrossContext:
    """One generate call's cross-attention: ``cache`` (the EncoderDecoderCache whose ``cross_attention_cache``
    holds the K/V) and a step context per cross plan (a cross plan is fixed for the call), which chooses the backend
    per layer shape and builds its metadata once, as for a decoder step."""

    def __init__(self, cache):
        self.cache = cache
        self.steps: dict = {}

    def layer(self, module, key):
        """The cross-attention cache layer this attention call reads, or None (a self-attention call)."""
        layer_idx = getattr(module, "layer_idx", None)
        cross = getattr(self.cache, "cross_attention_cache", None)
        if layer_idx is None or cross is None or layer_idx >= len(cross.layers):
            return None
        layer = cross.layers[layer_idx]
        return layer if key is layer.keys else None

    def refilled(self) -> None:
        """The cross plans' tables and lengths were rewritten in place (a later call's sources): metadata a backend
        built from their host values (one that is not graph-safe: FlashInfer plans on the host) is built anew; a
        graph-safe backend's reads only the tables' widths and the plans' device tensors (the cuda backend's launch
        follows the widths: ``StepPlan.fixed_widths``), so the kept graph's stays."""
        for step in self.steps.values():
            safe = {backend.name for backend in step.backends.values() if backend.graph_safe}
            step.metadata = {key: value for key, value in step.metadata.items() if key[0] in safe}

    def step(self, cross_cache, rows: int, q_len: int) -> StepContext:
        """The step context of ``rows`` x ``q_len`` query tokens over ``cross_cache`` (its plan is fixed for the call).
        Keyed by the shape, never by an object's identity: a compiled forward would guard on that identity and
        recompile for every call's new plan."""
        entry = self.steps.get((rows, q_len))
        if torch.compiler.is_compiling():
            if entry is None:       # built in the layout's first (eager) step; a trace would bake it in
                raise RuntimeError("a compiled step reached cross-attention that no eager step has planned; it runs "
                                   "on the eager forward instead")
            return entry
        plan = cross_cache.plan(rows, q_len)
        if entry is None or entry.plan is not plan:     # (eagerly: the cache's plan is the one the context holds)
            entry = self.steps[(rows, q_len)] = StepContext(None, plan, 0)
        return entry


def forward_kwargs(cache) -> dict:
    """The keyword arguments that make the decoder's forwards run cross-attention on ``cache``'s stored K/V."""
    return {CROSS_KWARG: CrossContext(cache)}


def cross_layer_of(module, key, kwargs) -> tuple[CrossContext, object] | None:
    """(context, cross-attention layer) when this attention call is a cross-attention over stored K/V, else None.
    Takes the context out of ``kwargs`` (it must not reach a dense attention function)."""
    context = kwargs.pop(CROSS_KWARG, None)
    if context is None:
        return None
    layer = context.layer(module, key)
    return None if layer is None else (context, layer)


def cross_attention(context: CrossContext, layer, module, query, dropout, scaling, kwargs):
    """``query`` [R, H, q, D] of R = B x n rows against their input's stored encoder K/V.
    Returns ([R, q, H, D], None)."""
    reasons = []
    if dropout:
        reasons.append("attention dropout (the model is in training mode; call model.eval())")
    if kwargs.get("position_bias") is not None and getattr(module, "has_relative_attention_bias", False):
        reasons.append("a relative position bias in cross-attention")
    if reasons:   # T5's cross-attention bias is zeros (no relative bias in EncDecAttention): nothing to add
        raise NotImplementedError(f"{type(module).__name__} cross-attention uses {', '.join(reasons)}, which the "
                                  "cascade attention does not support. Load the model with attn_implementation='sdpa'.")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cache = layer.cache
    if layer.kv is not None and cache.cascade_config.backend == "auto" \
            and query.shape[1] == layer.kv.shape[2] and query.shape[0] % cache.batch == 0:
        return cache.sdpa_in_place(layer, query, scale), None
    q = as_computed(query)[0].transpose(1, 2)        # [R, q, H, D] (autocast: the stored K/V's dtype)
    step = context.step(cache, q.shape[0], q.shape[1])
    params = AttentionParams(scale)      # cross-attention: no causal window, softcap nor sinks
    backend = step.backend(cache.cascade_config.backend, q, layer.pool, params)
    decoder_step = getattr(getattr(context.cache, "self_attention_cache", None), "step", None)
    if decoder_step is not None:   # the decoder's step: a graph runner checks that this backend can be captured too
        decoder_step.backends.setdefault(("cross", q.dtype, q.shape[-1]), backend)
    metadata = step.backend_metadata(backend, q, layer.pool, params)
    with kernels_context(q.device):
        return backend.forward(q, layer.pool, metadata, params).contiguous(), None
