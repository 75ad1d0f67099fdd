"""The attention and mask functions registered as ``attn_implementation="cascade"``.

The step context (:mod:`hf_cascade.context`) arrives with the call: as the ``cascade_step`` keyword argument that
``CascadeCache.update`` put in the attention kwargs (transformers >= 5.24), else through the context shim. With K/V
that a :class:`~hf_cascade.cache.CascadeCache` just stored for ``module.layer_idx``, attention runs as a cascade
over the paged pool (shared prefix once per group, each row's suffix, log-sum-exp merge), except
for a prefill into an empty cache, which runs densely over the fresh K/V exactly like sdpa. Any
other K/V (no cache, ``use_cache=False``, a DynamicCache: Trainer's loss pass) take the dense
fallback, transformers' own sdpa. An encoder-decoder's cross-attention calls go to :mod:`hf_cascade.cross_attention`.

Inside a compiled forward (the graph runner's ``compile``, ``fullgraph=True``) only a static decode step's path is
traced: the context is an argument, the layer's attention was bound on the layout by the step's eager first run
(:class:`~hf_cascade.context.BoundAttention`), and what is left is dict lookups, constants and the kernels. Host work
(the per-thread shim, choosing a backend) stays eager (``torch.compiler.disable``); reaching it, or a dense path, in
a compiled static step is an error the runner answers by running uncompiled.
"""
from __future__ import annotations

import inspect
import sys

import torch
from torch.compiler import is_compiling as _is_compiling   # bound once: the eager path pays for every lookup
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, eager_mask, sdpa_mask

from .seq2seq import cross_attention
from .kv.context import STEP_KWARG, BoundAttention, LayerStep, StepContext, get_context
from .kernels.base import AttentionParams
from .precision import as_computed, kernels_context

NAME = "cascade"


class CascadeMask:
    """What the mask function hands to every layer: the 2D padding mask plus the recipe of the
    dense sdpa mask, which is only built (once per forward) if some layer takes the dense path."""

    def __init__(self, **mask_kwargs):
        self.mask_kwargs = mask_kwargs
        self.padding_mask = mask_kwargs.get("attention_mask")       # bool [B, kv_len] or None
        self.plain_causal = mask_kwargs.get("mask_function") is causal_mask_function
        self._dense = None
        self._built = False

    def dense(self):
        """The mask stock sdpa would get (a 4D bool tensor, or None for plain causal)."""
        if not self._built:
            self._dense, self._built = sdpa_mask(**self.mask_kwargs), True
        return self._dense

    def eager(self):
        """The mask stock eager attention would get (a 4D additive float tensor)."""
        if getattr(self, "_eager", None) is None:
            self._eager = eager_mask(**self.mask_kwargs)
        return self._eager

    def __repr__(self):
        shape = None if self.padding_mask is None else tuple(self.padding_mask.shape)
        return f"CascadeMask(padding_mask={shape}, plain_causal={self.plain_causal})"


def cascade_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                 attention_mask=None, **kwargs):
    """Mask function registered for "cascade": defers the dense mask until a layer needs it."""
    return CascadeMask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                       kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)


def stock_attention(module) -> str:
    """An attention implementation that the model of ``module`` (one of its modules, or the model) really has,
    for messages: "sdpa", or "eager" where its modeling file's models lack sdpa (e.g. GPT-OSS: sdpa cannot add
    attention sinks) or cannot be told."""
    modeling = sys.modules.get(type(module).__module__)
    models = [c for c in vars(modeling).values() if isinstance(c, type) and issubclass(c, PreTrainedModel)
              and c.__module__ == modeling.__name__] if modeling is not None else []
    return "sdpa" if any(getattr(c, "_supports_sdpa", False) for c in models) else "eager"


def _model_eager(module, kwargs):
    """The eager attention function of ``module``'s own modeling file if the dense path needs it (sdpa has no
    softcap and no sinks; stock runs such models in eager), else None. Raises if it is needed but unusable."""
    softcap, sinks = kwargs.get("softcap") is not None, kwargs.get("s_aux") is not None
    if not (softcap or sinks):
        return None
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    usable = fn is not None and (not softcap or "softcap" in inspect.signature(fn).parameters)
    # transformers' sink models pass s_aux=self.sinks and their eager function reads module.sinks
    usable = usable and (not sinks or getattr(module, "sinks", None) is kwargs["s_aux"])
    if not usable:
        quirk = " and ".join(q for q, on in (("attention logit softcapping", softcap), ("attention sinks", sinks)) if on)
        raise NotImplementedError(
            f"{type(module).__name__} uses {quirk}, but its modeling file has no eager attention function that "
            "applies it for the dense (prefill) path. Load the model with "
            f"attn_implementation='{stock_attention(module)}' instead.")
    return fn


def _dense_fallback(module, query, key, value, attention_mask, dropout, scaling, fresh: bool = False, **kwargs):
    fn = _model_eager(module, kwargs)
    if fn is not None:
        if isinstance(attention_mask, CascadeMask):
            attention_mask = attention_mask.eager()
        if fresh:
            attention_mask = _new_columns(attention_mask, key)
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~attention_mask, torch.finfo(query.dtype).min)
        out, _ = fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return out, None
    if isinstance(attention_mask, CascadeMask):
        attention_mask = attention_mask.dense()
    if fresh:
        attention_mask = _new_columns(attention_mask, key)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _new_columns(attention_mask, key):
    """A fresh step's keys are its new tokens only; where every earlier position was padding (never stored: a batch
    of one-token prompts, left-padded) the model's mask still spans them. Its last columns are the new tokens'."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] > key.shape[-2]:
        return attention_mask[..., -key.shape[-2]:]
    return attention_mask


def _check_supported(module, ctx, layer, attention_mask, dropout, kwargs) -> None:
    """Refuse what the cascade path would silently get wrong."""
    reasons = []
    if kwargs.get("position_bias") is not None:
        reasons.append("an additive position bias")
    if dropout:
        reasons.append("attention dropout (the model is in training mode; call model.eval())")
    window = kwargs.get("sliding_window")
    # a static step has no padding among its new tokens (src_index None), tested first: a compiled step never reads
    # the cache's length, which changes every step
    if (window is not None and ctx.plan.src_index is not None and not ctx.plan.fresh
            and ctx.cache.logical_length > window):
        reasons.append(f"a sliding window of {window} tokens exceeded by a sequence of "
                       f"{ctx.cache.logical_length} in a step with padding among its new tokens")
    if isinstance(attention_mask, CascadeMask):
        if not attention_mask.plain_causal and window is None:
            reasons.append("a mask that is not plain causal (e.g. bidirectional image tokens or packed sequences)")
    elif attention_mask is not None:
        reasons.append("a 4D attention mask passed by the caller")
    if reasons:
        raise NotImplementedError(
            f"{type(module).__name__} (layer {layer.layer_idx}) uses {', '.join(reasons)}, which the cascade "
            f"attention does not support yet. Load the model with attn_implementation='{stock_attention(module)}' "
            "instead.")


def _check_padding_known(plan, attention_mask) -> None:
    """A padded multi-token step whose padding the cache was not told would store pad tokens."""
    if plan.src_index is not None or not isinstance(attention_mask, CascadeMask):
        return
    padding = attention_mask.padding_mask
    if padding is None:
        return
    new = padding[:, -plan.q_len:]
    if not bool(new.all()):   # one host sync, only for multi-token steps of a padded batch
        raise ValueError(
            "A padded batch reached a CascadeCache that was not told which tokens are padding, so pad tokens would "
            "be stored. Use model.generate(...), or hf_cascade.prefill(model, cache, input_ids, attention_mask).")


_shim_context = torch.compiler.disable(get_context)     # a thread-local: read eagerly, never traced


def _passed(scale, kwargs) -> tuple:
    """The layer's :class:`~hf_cascade.kernels.base.AttentionParams` fields as the model's attention call passes
    them, in the fields' order (scale, softcap, window, sinks: transformers' ``scaling``, ``softcap``,
    ``sliding_window``, ``s_aux``): the one place that reads them. A tuple, not yet the value: a static step only
    compares it with the value its layout bound (no object built per call)."""
    return scale, kwargs.get("softcap"), kwargs.get("sliding_window"), kwargs.get("s_aux")


@torch.compiler.disable          # host work: chooses the backend and builds metadata (the first step of a layout)
def _bind(ctx: StepContext, layer_idx, q, pool, passed: tuple) -> BoundAttention:
    return ctx.bind_attention(layer_idx, ctx.cache.cascade_config.backend, q, pool, AttentionParams(*passed))


def _refuse_in_compiled_step(ctx, what: str) -> None:
    """A compiled static step traces no host work: raise (the graph runner then runs the step uncompiled)."""
    if ctx is not None and _is_compiling() and ctx.plan.static:
        raise RuntimeError(f"a compiled static decode step reached {what}; it runs on the eager forward instead (the "
                           "graph runner binds every layer in the layout's first, eager step)")


def cascade_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """``query`` [B, Hq, q, D]; ``key``/``value`` as ``cache.update`` returned them. Returns ([B, q, Hq, D], None)."""
    ctx = kwargs.pop(STEP_KWARG, None)        # taken out first: a dense attention function must not get them
    cross = cross_attention.cross_layer_of(module, key, kwargs)
    if cross is not None:    # encoder-decoder cross-attention over K/V stored once per input
        return cross_attention.cross_attention(*cross, module, query, dropout, scaling, kwargs)
    if isinstance(ctx, LayerStep):      # a decoder layer compiled on its own: its share of the step, found on the host
        return _layer_step_attention(ctx, query, scaling, kwargs), None
    # a module without layer_idx (a ViT encoder's) never writes a cache: dense
    layer_idx = getattr(module, "layer_idx", None)
    if ctx is None:       # where update got no attention kwargs: the shim (a stale context has no unread layer)
        ctx = _shim_context() if _is_compiling() else get_context()
    if ctx is None or layer_idx not in ctx.unread:
        _refuse_in_compiled_step(ctx, f"the dense attention path (layer {layer_idx} stored no K/V in the step)")
        return _dense_fallback(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    ctx.unread.discard(layer_idx)
    layer, key_shape = ctx.written[layer_idx]
    if key.shape != key_shape or value.shape != key_shape:
        raise RuntimeError(
            f"{type(module).__name__} changed the K/V between cache.update and the attention call; the cascade "
            "attention reads K/V from its cache and cannot follow. Use "
            f"attn_implementation='{stock_attention(module)}' for this model.")
    _check_supported(module, ctx, layer, attention_mask, dropout, kwargs)
    plan = ctx.plan
    if plan.q_len > 1 and ctx.first_write:
        _check_padding_known(plan, attention_mask)
    if plan.fresh:      # prefill into an empty cache: the new K/V are the whole context
        return _dense_fallback(module, query, key, value, attention_mask, dropout, scaling, fresh=True, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    pool = layer.step_pool
    q = as_computed(query)[0].transpose(1, 2)     # [R, q, Hq, D] (autocast: the pool's dtype, as sdpa casts it)
    passed = _passed(scale, kwargs)
    if plan.static:     # resolved once for the layout: one lookup per step (and all a compiled step traces)
        bound = ctx.bound_attention(layer_idx, passed)
        if bound is None:
            _refuse_in_compiled_step(ctx, f"layer {layer_idx}'s backend choice, not bound on the layout")
            bound = _bind(ctx, layer_idx, q, pool, passed)
        backend, params, metadata = bound.backend, bound.params, bound.metadata
        if metadata is None:
            metadata = ctx.backend_metadata(backend, q, pool, params)
        with kernels_context(q.device):
            return backend.forward(q, pool, metadata, params).contiguous(), None
    return _per_step_attention(ctx, q, pool, passed), None


def _layer_step_attention(step: LayerStep, query, scaling, kwargs):
    """A static decode step's attention in a decoder layer compiled on its own (``CascadeConfig(compile="regional")``):
    the layer's pool and bound attention come with ``step``, so nothing here reads ``module.layer_idx`` (one compiled
    layer serves every layer); the layout's first, eager step checked and bound the layer."""
    bound = step.bound
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if not bound.call.serves(*_passed(scale, kwargs)):
        raise RuntimeError("a compiled decoder layer's attention call passes other parameters than its layout bound; "
                           "it runs on the eager forward instead")
    backend, params, pool = bound.backend, bound.params, step.layer.step_pool
    q = as_computed(query)[0].transpose(1, 2)     # [R, q, Hq, D]
    # metadata per step (a backend that keeps none for the layout) is built for each layer: the reference backend's
    # is a view of the plan's device tensors, nothing to compute
    metadata = bound.metadata if bound.metadata is not None else backend.build(step.plan, q, pool, params)
    with kernels_context(q.device):
        return backend.forward(q, pool, metadata, params).contiguous()


@torch.compiler.disable          # host work every step (backend choice, metadata): eager inside a compiled forward
def _per_step_attention(ctx: StepContext, q, pool, passed: tuple):
    """A step planned anew (prefill into a filled cache, a decode step off a static layout)."""
    params = AttentionParams(*passed)
    if params.window is not None and ctx.cache.attention_horizon(False) <= params.window:
        params = params.without_window()   # no sequence passes the window: plain causal attention, which more take
    backend = ctx.backend(ctx.cache.cascade_config.backend, q, pool, params)
    metadata = ctx.backend_metadata(backend, q, pool, params)
    with kernels_context(q.device):
        return backend.forward(q, pool, metadata, params).contiguous()


def register() -> None:
    """Register "cascade" with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(NAME, cascade_attention)
    AttentionMaskInterface.register(NAME, cascade_mask)
