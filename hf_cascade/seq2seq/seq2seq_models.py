"""What differs per encoder-decoder family (``model.config.model_type``) on the cascade path: one adapter each.

An adapter knows where a model's decoder and its cross-attention modules are, how such a module projects
encoder states to K/V, and the family's rules (T5's relative position bias; Whisper's unmasked
cross-attention and its decoder positions). The rest of the encoder-decoder path asks :func:`family_of`
and never tests a model_type itself, so serving a new family means one entry in :data:`SUPPORTED` here
(and its stock-token test in tests/seq2seq/test_encoder_decoder.py or tests/seq2seq/test_seq2seq_graphs.py).

This module also owns where a decode step's decoder positions come from (:func:`step_positions_reason`): Whisper's
decoder reads ``decoder_position_ids``; the BART family's computes them from the cache length on the host, which a
replayed graph would freeze, unless ``hf_cascade.patches.positions`` registered its decoder class here
(:func:`register_device_positions`) and the call's forwards carry :data:`DEVICE_POSITIONS_KWARG`. The T5 family's
positions are relative: its bias is computed from the length its self-attention cache reports, which
``dense_cache.StaticSelfAttentionCache`` gives as a device tensor in a static step; the step's mask comes from that
cache where ``hf_cascade.patches.t5_mask`` registered the decoder stack here (:func:`register_static_mask`).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from ..config import CascadeConfig
from ..logs import log_once

# Models that pair any encoder with any decoder: generate runs them on stock's dense path (their decoders'
# cross-attention modules and an encoder-to-decoder projection differ per pairing), logged once.
COMPOSITE = ("encoder-decoder", "vision-encoder-decoder", "speech-encoder-decoder")


@dataclasses.dataclass(frozen=True)
class CrossProjection:
    """One decoder layer's cross-attention K/V projection: the module's own two linears."""

    key: torch.nn.Linear
    value: torch.nn.Linear
    head_dim: int

    def __call__(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``states`` [N, d] -> K and V, each [N, H, D]."""
        n = states.shape[0]
        return self.key(states).view(n, -1, self.head_dim), self.value(states).view(n, -1, self.head_dim)

    @property
    def device(self) -> torch.device:
        return self.key.weight.device

    @property
    def width(self) -> int:
        """K plus V features per token."""
        return self.key.out_features + self.value.out_features

    def itemsize(self, states: torch.Tensor) -> int:
        """Bytes per projected feature of ``states`` (the linears' result dtype)."""
        weight = self.key.weight
        return torch.promote_types(weight.dtype, states.dtype).itemsize if weight.is_floating_point() \
            else states.element_size()


@dataclasses.dataclass(frozen=True)
class Seq2SeqFamily:
    """The BART-style layout (BART/mBART/PLBart, Pegasus, Blenderbot, Marian, M2M100/NLLB, Whisper):
    ``decoder.layers[i].encoder_attn`` with ``k_proj``/``v_proj``. The flags are the family's rules where it departs
    from stock's defaults."""

    # the self-attention bias is computed from the width of the K/V the cache returns: it stays dense
    relative_bias: bool = False
    # False where the model's attention_mask is for the encoder only (Whisper: over mel frames)
    masked_cross_attention: bool = True
    # True where generate derives decoder positions from the decoder mask (Whisper's
    # prepare_inputs_for_generation) and the decoder reads them (decoder_position_ids); elsewhere they follow the
    # cache length, pads included, computed by the decoder on the host
    positions_from_decoder_mask: bool = False
    # True where a decoder prompt token's position counts only the real tokens before it (M2M100/NLLB: a pad keeps
    # padding_idx), while a decode step's follows the cache length, pads included
    positions_skip_pads: bool = False

    def decoder(self, model):
        decoder = model.get_decoder()
        nested = hasattr(decoder, "get_decoder") and not hasattr(decoder, "layers") and not hasattr(decoder, "block")
        return decoder.get_decoder() if nested else decoder

    def cross_attention_modules(self, model) -> list:
        """Each decoder layer's cross-attention module, in layer order."""
        return [layer.encoder_attn for layer in self.decoder(model).layers]

    def cross_projection(self, attn) -> CrossProjection:
        return CrossProjection(attn.k_proj, attn.v_proj, attn.head_dim)

    def decoder_position_ids(self, decoder_mask: torch.Tensor) -> torch.Tensor | None:
        """The decoder prompt's position ids as stock's generate gives them for ``decoder_mask`` (None: from the
        cache length, which the model does itself)."""
        if not self.positions_from_decoder_mask:
            return None
        return (decoder_mask.long().cumsum(-1) - 1).masked_fill(decoder_mask == 0, 0)


@dataclasses.dataclass(frozen=True)
class T5Family(Seq2SeqFamily):
    """T5 / mT5 / UMT5: ``decoder.block[i].layer[1].EncDecAttention`` with ``k``/``v``; a relative position bias (in
    the first layer's self-attention, shared by the others; UMT5: in every layer's)."""

    relative_bias: bool = True

    def cross_attention_modules(self, model) -> list:
        return [block.layer[1].EncDecAttention for block in self.decoder(model).block]

    def cross_projection(self, attn) -> CrossProjection:
        return CrossProjection(attn.k, attn.v, attn.key_value_proj_dim)


_BART, _T5 = Seq2SeqFamily(), T5Family()
_M2M100 = Seq2SeqFamily(positions_skip_pads=True)
# model_type -> adapter; every entry is tested token-exact against stock (tests/seq2seq/test_encoder_decoder.py;
# pegasus, plbart and blenderbot(-small) in tests/seq2seq/test_seq2seq_graphs.py)
SUPPORTED: dict[str, Seq2SeqFamily] = {
    "bart": _BART, "mbart": _BART, "marian": _BART, "m2m_100": _M2M100,
    "pegasus": _BART, "plbart": _BART, "blenderbot": _BART, "blenderbot-small": _BART,
    "whisper": Seq2SeqFamily(masked_cross_attention=False, positions_from_decoder_mask=True),
    "t5": _T5, "mt5": _T5, "umt5": _T5,
}


def family_of(model) -> Seq2SeqFamily:
    """The adapter of ``model``'s family (a model :func:`unsupported_reason` accepts and not a COMPOSITE one)."""
    return SUPPORTED[model.config.model_type]


def unsupported_reason(model) -> str | None:
    """Why the encoder-decoder cascade path cannot serve ``model`` (None when it can, also on stock's path)."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED and model_type not in COMPOSITE:
        return (f"it is an encoder-decoder model of type {model_type!r}; the cascade path serves "
                f"{', '.join(sorted(SUPPORTED))}")
    if not hasattr(model, "get_decoder"):
        return f"{type(model).__name__} has no decoder to generate with"
    return None


def cross_attention_modules(model) -> list:
    """Each decoder layer's cross-attention module of ``model``, in layer order."""
    return family_of(model).cross_attention_modules(model)


def cross_projections(model) -> list[CrossProjection]:
    """Each decoder layer's cross K/V projection of ``model``, in layer order."""
    family = family_of(model)
    return [family.cross_projection(attn) for attn in family.cross_attention_modules(model)]


def uses_relative_bias(model) -> bool:
    family = SUPPORTED.get(getattr(model.config, "model_type", None))
    return family is not None and family.relative_bias


def paged_self_attention(model, decoder_ids: torch.Tensor, device: torch.device, config: CascadeConfig,
                         decoder_mask: torch.Tensor | None = None) -> bool:
    """Whether the decoder self-attention runs on a paged CascadeCache (else dense: ``dense_cache``).

    Not for relative-bias families (T5: the bias is added to the scores of every key, which the paged kernels do
    not take; their decode steps reach the graph runner on ``dense_cache.StaticSelfAttentionCache`` instead).
    Not where a prefilled decoder prompt would move a position (:func:`prompt_positions_reason`).
    On a GPU, or with a backend chosen explicitly, always: no per-step reorder copy of the self K/V. On the
    CPU with backend="auto", only where the beams can share decoder prompt blocks (a prompt of at least
    one block, e.g. Whisper with prompt_ids): with a one-token decoder prompt there is nothing to share,
    and the PyTorch paged attention costs more per step than DynamicCache's small reorder copy
    (bart-base, 8 beams: 10.5 vs 9.0 s; benchmarks/RESULTS.md)."""
    if uses_relative_bias(model):
        return False
    reason = prompt_positions_reason(model, decoder_mask)
    if reason is not None:
        log_once(("dense positions", reason), logging.INFO, "the decoder self-attention stays dense: %s", reason)
        return False
    if device.type != "cpu" or config.backend != "auto":
        return True
    return decoder_ids.shape[1] - 1 >= config.block_size


def prompt_positions_reason(model, decoder_mask: torch.Tensor | None) -> str | None:
    """Why the paged path, which prefills the decoder prompt but its last token and then feeds that token with the
    cache length (pads included), would give that token another position than stock's one forward over the prompt
    (None when it would not). M2M100/NLLB count only the real tokens before a prompt token: a row with pads before a
    real last token would move."""
    family = SUPPORTED.get(getattr(model.config, "model_type", None))
    if family is None or not family.positions_skip_pads or decoder_mask is None:
        return None
    moved = (decoder_mask[:, -1] != 0) & ((decoder_mask != 0).sum(-1) < decoder_mask.shape[-1])
    if not bool(moved.any()):
        return None
    return (f"{type(model).__name__} positions a decoder prompt token after the real tokens before it (pads not "
            "counted): a padded decoder prompt ending in a real token runs on stock's dense cache")


# ---- where a decode step's decoder positions come from ---------------------------------------------------------
# The forward keyword by which a generate call tells a decoder that hf_cascade.patches.positions serves to take its
# positions from the step's decoder_position_ids (a device tensor that generate advances every step) instead of the
# cache length on the host. Only generate's cascade entry gives it, with positions of its own.
DEVICE_POSITIONS_KWARG = "cascade_positions"
# decoder class -> reason(decoder, max_length): why its positions cannot come from a device tensor for a call whose
# decoder sequences reach max_length tokens (None: they can). Filled by the positions patch.
_DEVICE_POSITIONS: dict[type, Callable] = {}


def register_device_positions(decoder_class: type, reason: Callable) -> None:
    """``decoder_class`` takes its positions from ``decoder_position_ids`` when a forward carries
    :data:`DEVICE_POSITIONS_KWARG` (see the module docstring); ``reason(decoder, max_length)`` says when it cannot."""
    _DEVICE_POSITIONS[decoder_class] = reason


def device_positions_reason(model, max_length: int) -> str | None:
    """Why ``model``'s decoder cannot take a call's positions (up to ``max_length`` tokens) from a device tensor
    (None when it can: the call gives it decoder_position_ids and :data:`DEVICE_POSITIONS_KWARG`)."""
    decoder = family_of(model).decoder(model)
    reason = _DEVICE_POSITIONS.get(type(decoder))
    if reason is None:
        return (f"{type(decoder).__name__} computes its positions from the cache length on the host and no patch of "
                "hf_cascade.patches.positions serves it (not a family it knows, or a transformers version it was not "
                "checked on)")
    return reason(decoder, max_length)


def step_positions_reason(model, kwargs: dict) -> str | None:
    """Why the positions of an encoder-decoder decode step (its forward's ``kwargs``) are not an input the decoder
    reads from the device, which a replayed graph needs (None when they are)."""
    family = SUPPORTED.get(getattr(model.config, "model_type", None))
    if family is not None and family.relative_bias:
        # relative positions: the bias reads the length the self-attention cache reports, a device tensor in a
        # static step (dense_cache.StaticSelfAttentionCache, the only cache a runner drives for this family)
        return None
    positions = kwargs.get("decoder_position_ids")
    if not isinstance(positions, torch.Tensor):
        return "the decoder's positions are not an input of the step (computed on the host)"
    if kwargs.get(DEVICE_POSITIONS_KWARG) or (family is not None and family.positions_from_decoder_mask):
        return None
    return (f"the caller's decoder_position_ids cannot be honoured on the static path: {type(model).__name__}'s "
            "decoder computes its positions from the cache length on the host (hf_cascade.patches.positions "
            "replaces that only with the positions generate's cascade entry gives itself); the decode steps run "
            "the model's own forward, as stock")


# ---- where a static decode step's self-attention mask comes from (the relative-bias families) ------------------
# decoder stack classes whose forward takes a static step's mask from its self-attention cache (filled by
# hf_cascade.patches.t5_mask)
_STATIC_MASK: set = set()


def register_static_mask(stack_class: type) -> None:
    """``stack_class`` (a T5-family decoder stack) takes its self-attention mask from a
    ``dense_cache.StaticSelfAttentionCache`` in a static step (``static_step_mask()``) instead of building it from
    the 2D decoder mask on the host."""
    _STATIC_MASK.add(stack_class)


def static_mask_reason(model) -> str | None:
    """Why ``model``'s decoder cannot take a static step's self-attention mask from the device (None when it can)."""
    decoder = family_of(model).decoder(model)
    if type(decoder) in _STATIC_MASK:
        return None
    return (f"{type(decoder).__name__} builds its self-attention mask from the decoder mask on the host and no patch "
            "of hf_cascade.patches.t5_mask serves it (not a stack it knows, or a transformers version it was not "
            "checked on)")
