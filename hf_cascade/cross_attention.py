"""Encoder-decoder cross-attention over K/V stored once per input: how the attention call finds them and runs.

The generate entry of an encoder-decoder model gives every decoder forward one more keyword argument,
``cascade_cross=`` a :class:`CrossContext` (:func:`forward_kwargs`); transformers passes a forward's keyword
arguments down to every attention call, so the attention function registered as "cascade" receives it. The context
holds the call's ``EncoderDecoderCache``: a cross-attention call is one whose module's ``layer_idx`` names a layer of
its cross-attention cache and whose K/V are that layer's (the model reads them from the cache and passes them on:
placeholders of stock's shape, the real K/V sit in the layer's paged pool). The context also keeps, for the call,
the kernel backend chosen per layer shape and its metadata per plan (a cross plan is fixed for the call).
"""
from __future__ import annotations

from . import kernels
from .kernels.base import NO_QUIRKS

# the forward (and so attention) keyword argument that carries the CrossContext
CROSS_KWARG = "cascade_cross"


class CrossContext:
    """One generate call's cross-attention: ``cache`` (the EncoderDecoderCache whose ``cross_attention_cache``
    holds the K/V), the backend per layer shape and the backends' metadata per plan."""

    def __init__(self, cache):
        self.cache = cache
        self.backends: dict = {}
        self.metadata: dict = {}

    def layer(self, module, key):
        """The cross-attention cache layer this attention call reads, or None (a self-attention call)."""
        layer_idx = getattr(module, "layer_idx", None)
        cross = getattr(self.cache, "cross_attention_cache", None)
        if layer_idx is None or cross is None or layer_idx >= len(cross.layers):
            return None
        layer = cross.layers[layer_idx]
        return layer if key is layer.keys else None

    def backend(self, layer, q, plan):
        """The kernel backend for cross-attention layers of this shape (chosen once per call and shape)."""
        pool = layer.pool
        key = (q.device, q.dtype, q.shape[-2], q.shape[-1], pool.shape[2], pool.shape[3])
        found = self.backends.get(key)
        if found is None:
            found = self.backends[key] = kernels.select(layer.cache.cascade_config.backend, q, pool, plan)
        return found

    def backend_metadata(self, backend, plan, q, pool):
        key = (id(plan), backend.name) + backend.metadata_key(q, pool, NO_QUIRKS, plan)
        entry = self.metadata.get(key)     # (plan, metadata): the plan kept alive, so its id names only it
        if entry is None or entry[0] is not plan or not backend.reusable(entry[1]):
            entry = self.metadata[key] = (plan, backend.build(plan, q, pool, NO_QUIRKS))
        return entry[1]


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
    q = query.transpose(1, 2)                                          # [R, q, H, D]
    plan = cache.plan(q.shape[0], q.shape[1])
    backend = context.backend(layer, q, plan)
    step = getattr(getattr(context.cache, "self_attention_cache", None), "step", None)
    if step is not None:       # the decoder's step: a graph runner checks that this backend can be captured too
        step.backends.setdefault(("cross", q.dtype, q.shape[-1]), backend)
    metadata = context.backend_metadata(backend, plan, q, layer.pool)
    return backend.forward(q, layer.pool, metadata, scale).contiguous(), None
