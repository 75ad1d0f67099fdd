"""The encoder output of an encoder-decoder generate call, never expanded once per beam.

Stock's generate copies the encoder output k times (``_expand_inputs_for_generation``); ``patches`` calls
:func:`defer_expansion` instead, which keeps the B unexpanded rows and puts a zero-stride placeholder of the
expanded shape in their place. The cascade entry reads the kept rows (:func:`unexpanded_states`); a path that
decodes as stock does puts stock's copies back first (:func:`restore_expansion`).
"""
from __future__ import annotations

import torch


def defer_expansion(encoder_outputs, expand_size: int):
    """Called by ``patches`` instead of ``repeat_interleave``: keep the B unexpanded rows of every
    tensor field (in ``encoder_outputs.hf_cascade_unexpanded``) and put a zero-stride NaN placeholder
    of the expanded shape in its place (reading it would give NaN, never plausible values)."""
    kept = {}
    encoder_outputs = type(encoder_outputs)(**encoder_outputs)    # a copy: the caller's object stays as it was
    for key in list(encoder_outputs.keys()):
        value = encoder_outputs[key]
        if isinstance(value, torch.Tensor):
            kept[key] = value
            encoder_outputs[key] = placeholder(value, value.shape[0] * expand_size)
    encoder_outputs.hf_cascade_unexpanded = kept
    encoder_outputs.hf_cascade_expand_size = expand_size
    return encoder_outputs


def placeholder(like: torch.Tensor, rows: int) -> torch.Tensor:
    """A zero-stride NaN tensor of ``like``'s shape with ``rows`` rows (no memory; nothing may read it)."""
    return like.new_full((), float("nan")).expand(rows, *like.shape[1:])


def unexpanded_states(encoder_outputs, n: int) -> torch.Tensor:
    """The encoder's last hidden state, one row per input [B, S, d] (no copy)."""
    kept = getattr(encoder_outputs, "hf_cascade_unexpanded", None)
    if kept is not None:
        return kept["last_hidden_state"] if "last_hidden_state" in kept else next(iter(kept.values()))
    return encoder_outputs[0][::n]               # expanded by stock (patch not applied): a view of row 0, n, ...


def restore_expansion(encoder_outputs) -> None:
    """Undo :func:`defer_expansion` (stock's k copies) for a path that runs stock dense decoding."""
    kept = getattr(encoder_outputs, "hf_cascade_unexpanded", None)
    if kept:
        for key, value in kept.items():
            encoder_outputs[key] = value.repeat_interleave(encoder_outputs.hf_cascade_expand_size, dim=0)
        encoder_outputs.hf_cascade_unexpanded = None
