"""T5-family decoders take a static decode step's self-attention mask from their cache, so that the step can replay.

On the graph runner's static path the T5 family's decoder self-attention (a relative position bias) runs over
``hf_cascade.dense_cache.StaticSelfAttentionCache``: K/V buffers of the call's capacity, written at a device position,
whose ``get_seq_length`` answers that position as a device tensor (the model computes its bias from it, on the device).
The mask must come from the device too: stock builds it from the 2D decoder mask, whose width grows every step, and a
replayed graph would keep the first step's. For a forward whose self-attention cache is in a static step, the patched
decoder stack takes the cache's boolean mask ``[rows or 1, 1, 1, capacity]`` (not a decoder-prompt pad, not past the
step's position) as its ``attention_mask``: a 4D mask passes ``create_causal_mask`` unchanged, and each layer's sdpa
adds the bias where it is True and the dtype's minimum elsewhere, as stock does for a padded decoder mask. Every other
forward (no such cache, the decoder prompt's, the encoder's) runs stock's code unchanged.

Guarded by the transformers versions it was checked on and by what it relies on (the stack builds its mask with
``create_causal_mask`` from its ``attention_mask`` argument; the self-attention computes its bias from
``get_seq_length(self.layer_idx)``); tests/seq2seq/test_t5_graphs.py checks each reliance. A stack outside them is not
registered, and its decode steps run eagerly on the dense cache, the reason logged, as before.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging

import transformers

from hf_cascade.compat import SUPPORTED, cache_of, in_range

logger = logging.getLogger("hf_cascade")

# (modeling module, decoder stack class, its attention class)
FAMILIES = (
    ("t5", "T5Stack", "T5Attention"),
    ("mt5", "MT5Stack", "MT5Attention"),
    ("umt5", "UMT5Stack", "UMT5Attention"),
)
_applied: list = []     # (module name, stack class) of each family patched
_checked: list = []     # apply() ran


def is_applied() -> bool:
    return bool(_applied)


def applied_families() -> list[str]:
    """The modeling modules whose decoder stacks the patch serves (for tests and diagnostics)."""
    return [name for name, _ in _applied]


def _modeling(name: str):
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def unchanged_reason(name: str, stack: str, attention: str) -> str | None:
    """Why the patch would not fit family ``name`` in the installed transformers (None when it fits)."""
    try:
        modeling = _modeling(name)
    except ImportError as err:
        return f"transformers.models.{name} cannot be imported ({err})"
    stack_cls, attention_cls = getattr(modeling, stack, None), getattr(modeling, attention, None)
    if stack_cls is None or attention_cls is None:
        return f"modeling_{name} has no {stack if stack_cls is None else attention}"
    try:
        stack_source = inspect.getsource(_original(stack_cls.forward))
        attention_source = inspect.getsource(attention_cls.forward)
    except (OSError, TypeError):
        return f"the source of {stack}.forward or {attention}.forward cannot be read"
    params = tuple(inspect.signature(_original(stack_cls.forward)).parameters)
    if params[:3] != ("self", "input_ids", "attention_mask") or "create_causal_mask(" not in stack_source:
        return f"{stack}.forward no longer builds its mask with create_causal_mask from its attention_mask argument"
    if "get_seq_length(self.layer_idx)" not in attention_source or "compute_bias(" not in attention_source:
        return f"{attention}.forward no longer computes its bias from the cache's get_seq_length(self.layer_idx)"
    return None


def _original(forward):
    return getattr(forward, "__hf_cascade_original__", forward)


def _wrap_stack(original):
    """The stack's forward: in a static step of its self-attention cache, that cache's mask as ``attention_mask``."""

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        cache = cache_of(kwargs)
        step_mask = getattr(getattr(cache, "self_attention_cache", None), "static_step_mask", None)
        mask = step_mask() if step_mask is not None else None
        if mask is None or self.config._attn_implementation != "cascade":
            return original(self, *args, **kwargs)
        if len(args) >= 2:          # (input_ids, attention_mask, ...) passed by position
            args = (args[0], mask, *args[2:])
        else:
            kwargs["attention_mask"] = mask
        return original(self, *args, **kwargs)

    forward.__hf_cascade_original__ = original
    return forward


def apply() -> None:
    """Patch every family of :data:`FAMILIES` that fits (once; nothing outside :data:`SUPPORTED`)."""
    if _checked:
        return
    _checked.append(True)
    if not in_range():
        logger.debug("hf_cascade.patches.t5_mask: transformers %s is outside %s; T5-family decode steps run "
                     "eagerly", transformers.__version__, SUPPORTED)
        return
    from hf_cascade.seq2seq.seq2seq_models import register_static_mask

    for name, stack, attention in FAMILIES:
        reason = unchanged_reason(name, stack, attention)
        if reason is not None:
            logger.debug("hf_cascade.patches.t5_mask: %s not patched: %s", name, reason)
            continue
        stack_cls = getattr(_modeling(name), stack)
        stack_cls.forward = _wrap_stack(stack_cls.forward)
        register_static_mask(stack_cls)
        _applied.append((name, stack_cls))
