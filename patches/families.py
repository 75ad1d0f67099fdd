"""Families whose modeling code does not route attention through transformers' AttentionInterface, served
by an attention module of our own that does.

Falcon before transformers 5.25 (:data:`hf_cascade.compat.FALCON_ROUTES_ATTENTION`: from 5.25 it routes its
attention itself and is left alone) picks its attention class from
``FALCON_ATTENTION_CLASSES[config._attn_implementation]`` while it is built and calls
``torch.nn.functional.scaled_dot_product_attention`` itself. A "cascade" entry is added to
that table: ``FalconCascadeAttention`` keeps stock's projections, head split and RoPE, stores the K/V heads
once (the new decoder architecture broadcasts its K/V heads to every query head before caching them; we
store the ``num_kv_heads`` heads and let the attention group the queries), and calls the "cascade"
attention function. ALiBi Falcons are refused at load: the cascade kernels add no ALiBi bias.

GPT-Neo, and GPT-J and CodeGen before transformers routed them through AttentionInterface (5.17 – 5.2x),
compute their attention in ``_attn(query, key, value, attention_mask)`` after stock's projections, RoPE and
cache update: GPT-Neo's and GPT-J's tables get a "cascade" entry and CodeGen's blocks of a cascade model get
the subclass, whose ``_attn`` calls the "cascade" attention function (stock's ``_attn`` where stock's math is
asked for: attention weights, or an eager model). GPT-Neo's local layers pass their window as
``sliding_window`` (stock masks it from a buffer inside ``_attn``).

XGLM computes its attention inside ``XGLMAttention.forward`` (shared by self- and cross-attention): the
self-attention of a cascade model's decoder layers gets a subclass that routes it.

Guarded by the transformers versions it was checked on and by what it relies on (the tables, the attention
classes' forward / ``_attn`` signatures); each reliance has a test in tests/test_patches.py. Outside them
nothing is patched and these families are refused with the reason as before (patches/loading.py at load,
hf_cascade.generation.unsupported_reason at generate).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS   # a global name: routes_attention reads it

from hf_cascade.compat import (CACHE_KWARGS, FALCON_ROUTES_ATTENTION, SUPPORTED, UPDATE_PASSES_KWARGS, VERSION,
                               cache_kwarg, cache_of, in_range)

logger = logging.getLogger("hf_cascade")

# the parameters FalconAttention.forward takes from FalconDecoderLayer (ours takes the same)
FALCON_FORWARD = ("self", "hidden_states", "alibi", "attention_mask", "position_ids", "layer_past", "use_cache",
                  "output_attentions", "position_embeddings", "kwargs")
ALIBI_REASON = ("the cascade kernels have no ALiBi bias (they apply no additive position bias), so "
                "attn_implementation='cascade' cannot serve it")
_applied: list = []     # the attention classes installed
_checked: list = []     # apply() ran


def is_applied() -> bool:
    return bool(_applied)


def _falcon_module():
    from transformers.models.falcon import modeling_falcon
    return modeling_falcon


def falcon_unchanged_reason() -> str | None:
    """Why the Falcon patch would not fit the installed transformers (None when it fits)."""
    modeling = _falcon_module()
    if not isinstance(getattr(modeling, "FALCON_ATTENTION_CLASSES", None), dict):
        return "modeling_falcon has no FALCON_ATTENTION_CLASSES table"
    attention = getattr(modeling, "FalconAttention", None)
    if attention is None or not callable(getattr(attention, "_split_heads", None)):
        return "modeling_falcon has no FalconAttention._split_heads"
    params = tuple(inspect.signature(attention.forward).parameters)
    if params != FALCON_FORWARD:
        return f"FalconAttention.forward takes {params}, not {FALCON_FORWARD}"
    if not callable(getattr(modeling, "apply_rotary_pos_emb", None)):
        return "modeling_falcon has no apply_rotary_pos_emb"
    return None


def _falcon_classes():
    """(FalconCascadeAttention, the factory registered as the table's "cascade" entry), built against the
    installed modeling_falcon."""
    from hf_cascade.attention import CascadeMask

    modeling = _falcon_module()

    class FalconCascadeAttention(modeling.FalconAttention):
        """FalconAttention whose attention runs through AttentionInterface (``config._attn_implementation``)."""

        def __init__(self, config, layer_idx=None):
            super().__init__(config, layer_idx)
            # the dense path (sdpa_attention_forward) groups the queries per K/V head with this
            self.num_key_value_groups = self.num_heads // self.num_kv_heads

        def _split_kv_heads(self, fused_qkv):
            """query [B, H, L, D], key and value [B, kv, L, D]: stock's split, without broadcasting the new
            architecture's K/V heads to every query head."""
            batch, length, _ = fused_qkv.shape
            if self.new_decoder_architecture:
                qkv = fused_qkv.view(batch, length, -1, self.num_heads // self.num_kv_heads + 2, self.head_dim)
                query, key, value = qkv[:, :, :, :-2].flatten(2, 3), qkv[:, :, :, -2], qkv[:, :, :, -1]
            else:
                query, key, value = self._split_heads(fused_qkv)
            return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)

        def forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                    output_attentions=False, position_embeddings=None, **kwargs):
            implementation = self.config._attn_implementation
            if alibi is not None or output_attentions or implementation in ("eager", "sdpa"):
                # stock's own code: its eager branch returns the attention weights; ALiBi never loads as cascade
                if isinstance(attention_mask, CascadeMask):     # the "cascade" mask function defers it
                    attention_mask = attention_mask.eager()
                return super().forward(hidden_states, alibi, attention_mask, position_ids=position_ids,
                                       layer_past=layer_past, use_cache=use_cache,
                                       output_attentions=output_attentions,
                                       position_embeddings=position_embeddings, **kwargs)
            batch, length, _ = hidden_states.shape
            query, key, value = self._split_kv_heads(self.query_key_value(hidden_states))
            cos, sin = position_embeddings
            query, key = modeling.apply_rotary_pos_emb(query, key, cos, sin)
            attention_kwargs: dict = {}
            if layer_past is not None:
                # from 5.24 the cache hands the step's state to the attention through this dict (as Llama's does)
                extra = {"kwargs": attention_kwargs} if UPDATE_PASSES_KWARGS else {}
                key, value = layer_past.update(key, value, self.layer_idx, **extra)
            attend = ALL_ATTENTION_FUNCTIONS[implementation]
            output, _ = attend(self, query, key, value, attention_mask, dropout=0.0, scaling=self.inv_norm_factor,
                               **attention_kwargs)
            return self.dense(output.reshape(batch, length, self.num_heads * self.head_dim)), None

    def cascade_entry(config, layer_idx=None):
        if config.alibi:
            raise NotImplementedError(
                f"Falcon with ALiBi (config.alibi=True): {ALIBI_REASON}. Load it with attn_implementation='sdpa' "
                "instead (Falcons with rotary positions, alibi=False, are served by 'cascade').")
        return FalconCascadeAttention(config, layer_idx)

    return FalconCascadeAttention, cascade_entry


def _routed_attn_class(base):
    """``base`` (an attention class whose ``_attn(query, key, value, attention_mask)`` computes the attention: GPT-J's
    and CodeGen's before 5.2x, GPT-Neo's) with that ``_attn`` through AttentionInterface."""
    from hf_cascade.attention import CascadeMask

    class Routed(base):
        def forward(self, hidden_states, *args, output_attentions=False, **kwargs):
            attention_mask = kwargs.get("attention_mask")
            if output_attentions and isinstance(attention_mask, CascadeMask):
                kwargs["attention_mask"] = attention_mask.eager()   # the weights are stock's math: its eager mask
            return super().forward(hidden_states, *args, output_attentions=output_attentions, **kwargs)

        def _attention_arguments(self, attention_mask):
            """(mask, scaling, extra attention kwargs) for the attention function."""
            return attention_mask, 1.0 / self.scale_attn, {}

        def _attn(self, query, key, value, attention_mask=None):
            """query/key/value [B, H, L, D] (key/value as the cache returned them); returns ([B, H, q, D], None)."""
            implementation = self.config._attn_implementation
            if implementation == "eager" or isinstance(attention_mask, torch.Tensor):
                return super()._attn(query, key, value, attention_mask)
            attention_mask, scaling, extra = self._attention_arguments(attention_mask)
            output, _ = ALL_ATTENTION_FUNCTIONS[implementation](self, query, key, value, attention_mask, dropout=0.0,
                                                               scaling=scaling, **extra)
            return output.transpose(1, 2), None

    Routed.__name__ = Routed.__qualname__ = base.__name__.replace("Attention", "CascadeAttention")
    return Routed


def _gpt_neo_class(base):
    """GPT-Neo's self-attention through AttentionInterface: unscaled scores; a local layer's window of
    ``config.window_size`` keys (stock masks it in ``_attn`` from a buffer) goes to the attention function as
    ``sliding_window`` and into the deferred dense mask (``kv_idx > q_idx - window``, stock's band)."""
    from transformers.masking_utils import and_masks, sliding_window_overlay

    from hf_cascade.attention import CascadeMask

    class GPTNeoCascadeSelfAttention(_routed_attn_class(base)):
        def __init__(self, config, attention_type, layer_id=None):
            super().__init__(config, attention_type, layer_id)
            self.layer_idx = layer_id           # the cache's and the cascade attention's name for it
            self.window = config.window_size if attention_type == "local" else None

        def _attention_arguments(self, attention_mask):
            if self.window is None:
                return attention_mask, 1.0, {}
            if isinstance(attention_mask, CascadeMask):
                # one windowed mask per forward, shared by its local layers (the mask is built once per forward)
                windowed = getattr(attention_mask, "_hf_cascade_windowed", None)
                if windowed is None:
                    kwargs = attention_mask.mask_kwargs
                    function = and_masks(kwargs["mask_function"], sliding_window_overlay(self.window))
                    windowed = CascadeMask(**{**kwargs, "mask_function": function})
                    attention_mask._hf_cascade_windowed = windowed
                attention_mask = windowed
            return attention_mask, 1.0, {"sliding_window": self.window}

    return GPTNeoCascadeSelfAttention


def _unrouted(module_name: str, attention: str):
    """The modeling module and its attention class if they predate AttentionInterface and keep stock's ``_attn``
    signature, else None."""
    modeling = importlib.import_module(module_name)
    base = getattr(modeling, attention, None)
    if "ALL_ATTENTION_FUNCTIONS" in vars(modeling) or base is None or not hasattr(base, "_attn"):
        return None
    if tuple(inspect.signature(base._attn).parameters) != ("self", "query", "key", "value", "attention_mask"):
        return None
    return modeling, base


def _xglm_class(base):
    """XGLM's self-attention through AttentionInterface: stock's projections (the query scaled before the product,
    as stock does), then the attention function with scaling 1. Cross-attention stays stock's code."""
    cache_name = cache_kwarg(base.forward)

    class XGLMCascadeAttention(base):
        def forward(self, hidden_states, key_value_states=None, attention_mask=None, **kwargs):
            cache = cache_of(kwargs)
            for name in CACHE_KWARGS:
                kwargs.pop(name, None)
            implementation = self.config._attn_implementation
            if key_value_states is not None or implementation in ("eager", "sdpa"):
                return super().forward(hidden_states, key_value_states, attention_mask=attention_mask,
                                       **{cache_name: cache}, **kwargs)
            batch, length, _ = hidden_states.shape
            query = (self.q_proj(hidden_states) * self.scaling).view(batch, length, -1, self.head_dim).transpose(1, 2)
            key = self.k_proj(hidden_states).view(batch, length, -1, self.head_dim).transpose(1, 2)
            value = self.v_proj(hidden_states).view(batch, length, -1, self.head_dim).transpose(1, 2)
            attention_kwargs: dict = {}
            if cache is not None:
                cache = getattr(cache, "self_attention_cache", cache)       # an EncoderDecoderCache's own part
                extra = {"kwargs": attention_kwargs} if UPDATE_PASSES_KWARGS else {}
                key, value = cache.update(key, value, self.layer_idx, **extra)
            output, _ = ALL_ATTENTION_FUNCTIONS[implementation](self, query, key, value, attention_mask, dropout=0.0,
                                                               scaling=1.0, **attention_kwargs)
            return self.out_proj(output.reshape(batch, length, self.embed_dim)), None

    return XGLMCascadeAttention


def _route_on_init(owner: type, attr: str, base: type, routed: type) -> None:
    """Wrap ``owner.__init__``: in a cascade model, its ``attr`` module of class ``base`` becomes a ``routed`` one (same
    parameters and buffers: only the attention's forward changes) and keeps the config, which XGLM's and CodeGen's
    attention modules do not keep themselves (GPT-J's does)."""
    original_init = owner.__init__

    @functools.wraps(original_init)
    def init(self, config, layer_idx=None):
        original_init(self, config, layer_idx)
        module = getattr(self, attr)
        if config._attn_implementation == "cascade" and type(module) is base:
            module.__class__ = routed
            module.config = config

    init.__hf_cascade_original__ = original_init
    owner.__init__ = init


def _apply_xglm() -> None:
    modeling = importlib.import_module("transformers.models.xglm.modeling_xglm")
    base = getattr(modeling, "XGLMAttention", None)
    if "ALL_ATTENTION_FUNCTIONS" in vars(modeling) or base is None:
        return                                    # routed upstream (or gone): nothing to patch
    routed = _xglm_class(base)
    _route_on_init(modeling.XGLMDecoderLayer, "self_attn", base, routed)     # cross-attention stays stock's
    _applied.append(routed)


def _apply_gpt_neo() -> None:
    modeling = importlib.import_module("transformers.models.gpt_neo.modeling_gpt_neo")
    base = getattr(modeling, "GPTNeoSelfAttention", None)
    if (base is None or not isinstance(getattr(modeling, "GPT_NEO_ATTENTION_CLASSES", None), dict)
            or tuple(inspect.signature(base._attn).parameters) != ("self", "query", "key", "value", "attention_mask")):
        logger.warning("modeling_gpt_neo changed: GPT-Neo is not served by attn_implementation='cascade'.")
        return
    modeling.GPT_NEO_ATTENTION_CLASSES["cascade"] = _gpt_neo_class(base)
    _applied.append(modeling.GPT_NEO_ATTENTION_CLASSES["cascade"])


def _apply_gptj_codegen() -> None:
    found = _unrouted("transformers.models.gptj.modeling_gptj", "GPTJAttention")
    if found is not None and isinstance(getattr(found[0], "GPTJ_ATTENTION_CLASSES", None), dict):
        found[0].GPTJ_ATTENTION_CLASSES["cascade"] = _routed_attn_class(found[1])
        _applied.append(found[0].GPTJ_ATTENTION_CLASSES["cascade"])
    found = _unrouted("transformers.models.codegen.modeling_codegen", "CodeGenAttention")
    if found is not None:
        modeling, base = found
        routed = _routed_attn_class(base)
        _route_on_init(modeling.CodeGenBlock, "attn", base, routed)
        _applied.append(routed)


def _apply_falcon() -> None:
    reason = falcon_unchanged_reason()
    if reason is not None:
        logger.warning("%s: Falcon is not served by attn_implementation='cascade'.", reason)
        return
    attention, entry = _falcon_classes()
    _falcon_module().FALCON_ATTENTION_CLASSES["cascade"] = entry
    _applied.append(attention)


def apply() -> None:
    """Route the families above once (idempotent); outside the checked versions, or where modeling_falcon changed
    under the patch, log and leave it (Falcon is then refused at load, patches/loading.py). From 5.25 Falcon routes
    its attention itself and is left alone."""
    if _checked:
        return
    _checked.append(True)
    version = VERSION
    if not in_range():
        logger.warning("transformers %s is outside the checked range [%s, %s): Falcon, GPT-Neo, and GPT-J and CodeGen "
                       "where they compute attention in their own code, are not served by "
                       "attn_implementation='cascade'.",
                       version, *SUPPORTED)
        return
    if not FALCON_ROUTES_ATTENTION:     # (from 5.25 stock's Falcon routes its attention itself)
        _apply_falcon()
    _apply_gptj_codegen()
    _apply_gpt_neo()
    _apply_xglm()
