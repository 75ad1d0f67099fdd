"""What differs per encoder-decoder family (``model.config.model_type``) on the cascade path: one adapter each.

An adapter knows where a model's decoder and its cross-attention modules are, how such a module projects
encoder states to K/V, and the family's rules (T5's relative position bias; Whisper's unmasked
cross-attention and its decoder positions). The rest of the encoder-decoder path asks :func:`family_of`
and never tests a model_type itself, so serving a new family means one entry in :data:`SUPPORTED` here
(and its stock-token test in tests/test_encoder_decoder.py).
"""
from __future__ import annotations

import dataclasses

import torch

from .config import CascadeConfig

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
    """The BART-style layout (BART/mBART, Marian, M2M100/NLLB, Whisper): ``decoder.layers[i].encoder_attn``
    with ``k_proj``/``v_proj``. The flags are the family's rules where it departs from stock's defaults."""

    # the self-attention bias is computed from the width of the K/V the cache returns: it stays dense
    relative_bias: bool = False
    # False where the model's attention_mask is for the encoder only (Whisper: over mel frames)
    masked_cross_attention: bool = True
    # True where generate derives decoder positions from the decoder mask (Whisper's
    # prepare_inputs_for_generation); elsewhere they follow the cache length, pads included
    positions_from_decoder_mask: bool = False

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
    """T5 / mT5: ``decoder.block[i].layer[1].EncDecAttention`` with ``k``/``v``; a relative position bias."""

    relative_bias: bool = True

    def cross_attention_modules(self, model) -> list:
        return [block.layer[1].EncDecAttention for block in self.decoder(model).block]

    def cross_projection(self, attn) -> CrossProjection:
        return CrossProjection(attn.k, attn.v, attn.key_value_proj_dim)


_BART, _T5 = Seq2SeqFamily(), T5Family()
# model_type -> adapter; every entry is tested token-exact against stock (tests/test_encoder_decoder.py)
SUPPORTED: dict[str, Seq2SeqFamily] = {
    "bart": _BART, "mbart": _BART, "marian": _BART, "m2m_100": _BART,
    "whisper": Seq2SeqFamily(masked_cross_attention=False, positions_from_decoder_mask=True),
    "t5": _T5, "mt5": _T5,
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


def paged_self_attention(model, decoder_ids: torch.Tensor, device: torch.device, config: CascadeConfig) -> bool:
    """Whether the decoder self-attention runs on a paged CascadeCache (else dense: ``dense_cache``).

    Not for relative-bias families (T5: the bias is computed from the width of the K/V the cache returns).
    On a GPU, or with a backend chosen explicitly, always: no per-step reorder copy of the self K/V. On the
    CPU with backend="auto", only where the beams can share decoder prompt blocks (a prompt of at least
    one block, e.g. Whisper with prompt_ids): with a one-token decoder prompt there is nothing to share,
    and the PyTorch paged attention costs more per step than DynamicCache's small reorder copy
    (bart-base, 8 beams: 10.5 vs 9.0 s; benchmarks/RESULTS.md)."""
    if uses_relative_bias(model):
        return False
    if device.type != "cpu" or config.backend != "auto":
        return True
    return decoder_ids.shape[1] - 1 >= config.block_size
