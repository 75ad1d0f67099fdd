"""Whisper's best-of-n and temperature fallback run its encoder once per window, not once per sequence and retry.

``WhisperGenerationMixin.generate`` repeats the input features once per returned sequence (best-of-n:
``num_return_sequences``) and ``generate_with_fallback`` calls ``GenerationMixin.generate`` again for the rows
that need a retry at the next temperature; every such call runs the encoder on its rows anew: identical
rows, and rows it already encoded. For a cascade model, while ``generate_with_fallback`` runs, the encoder runs
once on the window's distinct rows (consecutive repeats counted once) and every ``generate`` call of that window
takes its rows' encoder output from there, where each row it asks for equals one encoded row exactly (else it runs
the encoder as stock). The encoder's output of a row does not depend on the other rows of its batch (per-row
convolutions, attention within the row): on the CPU it is bitwise the same (the tests compare the tokens with stock's
in float64); on a GPU, a kernel chosen for another batch size may round a row differently, as it may between stock's
own runs of different batches (a GPU test compares the tokens in float32).

Not with ``output_attentions`` / ``output_hidden_states`` (the encoder's per-layer outputs are then part of the
result: stock's way). Guarded by the transformers versions it was checked on and by what it relies on
(``generate_with_fallback`` and the encoder step's names and parameters); tests/seq2seq/test_seq2seq_graphs.py checks them.
"""
from __future__ import annotations

import contextvars
import functools
import inspect
import logging

import torch
from transformers import GenerationMixin
from transformers.modeling_outputs import BaseModelOutput

from hf_cascade.compat import SUPPORTED, in_range

logger = logging.getLogger("hf_cascade")

# GenerationMixin's step that runs the encoder of an encoder-decoder model (renamed in 5.2x), and its parameters
ENCODER_STEPS = ("_prepare_text_encoder_decoder_kwargs_for_generation",
                 "_prepare_encoder_decoder_kwargs_for_generation")
ENCODER_STEP_PARAMS = ("self", "inputs_tensor", "model_kwargs", "model_input_name", "generation_config")
FALLBACK_PARAMS = ("self", "segment_input")

# the EncodedWindow of the generate_with_fallback call running in this thread, or None
_window: contextvars.ContextVar = contextvars.ContextVar("hf_cascade_whisper_window", default=None)
_applied: list = []     # (owner class, attribute name, original) of each wrapped method
_checked: list = []


def is_applied() -> bool:
    return bool(_applied)


def _whisper_mixin():
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin
    return WhisperGenerationMixin


def encoder_step_name() -> str | None:
    """The name of GenerationMixin's encoder step in the installed transformers."""
    return next((name for name in ENCODER_STEPS if callable(getattr(GenerationMixin, name, None))), None)


def unchanged_reason() -> str | None:
    """Why the patch would not fit the installed transformers (None when it fits)."""
    name = encoder_step_name()
    if name is None:
        return f"GenerationMixin has none of {ENCODER_STEPS}"
    params = tuple(inspect.signature(getattr(GenerationMixin, name)).parameters)
    if params != ENCODER_STEP_PARAMS:
        return f"GenerationMixin.{name} takes {params}, not {ENCODER_STEP_PARAMS}"
    fallback = getattr(_whisper_mixin(), "generate_with_fallback", None)
    if fallback is None:
        return "WhisperGenerationMixin has no generate_with_fallback"
    params = tuple(inspect.signature(fallback).parameters)
    if params[:2] != FALLBACK_PARAMS:
        return f"WhisperGenerationMixin.generate_with_fallback takes {params}, not {FALLBACK_PARAMS} first"
    return None


class EncodedWindow:
    """One ``generate_with_fallback`` call's encoder output: its distinct rows, encoded at the first request."""

    def __init__(self, model):
        self.model = model
        self.features: torch.Tensor | None = None      # the distinct rows encoded [U, ...]
        self.states: torch.Tensor | None = None        # their encoder output [U, frames, d]
        self.encodes = 0                                # encoder runs (for tests)

    def encode(self, original, model, inputs, model_kwargs, name, generation_config) -> dict:
        """``original``'s result for ``inputs``, the encoder run on the distinct rows only at the first request, and
        not at all for later requests whose rows it encoded; stock's own step otherwise."""
        if self.features is None:
            distinct = _distinct_rows(inputs)
            rows = inputs.shape[0]
            sub = {k: v[distinct] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows else v
                   for k, v in model_kwargs.items()}
            encoded = original(model, inputs[distinct], sub, name, generation_config)["encoder_outputs"]
            if set(k for k, v in encoded.items() if v is not None) != {"last_hidden_state"}:
                return original(model, inputs, model_kwargs, name, generation_config)     # (not expected)
            self.features, self.states, self.encodes = inputs[distinct], encoded.last_hidden_state, 1
        index = _rows_in(inputs, self.features)
        if index is None:
            return original(model, inputs, model_kwargs, name, generation_config)
        model_kwargs["encoder_outputs"] = BaseModelOutput(last_hidden_state=self.states[index])
        return model_kwargs


def _distinct_rows(inputs: torch.Tensor) -> torch.Tensor:
    """Indices of the rows of ``inputs`` that differ from the row before them (Whisper repeats a row's features
    consecutively, once per returned sequence)."""
    if inputs.shape[0] == 1:
        return torch.zeros(1, dtype=torch.long, device=inputs.device)
    repeat = (inputs[1:] == inputs[:-1]).flatten(1).all(1)
    return torch.cat([repeat.new_zeros(1), repeat]).logical_not().nonzero().flatten()


def _rows_in(inputs: torch.Tensor, encoded: torch.Tensor) -> torch.Tensor | None:
    """For each row of ``inputs``, the index of an equal row of ``encoded`` (None where a row has none)."""
    if inputs.shape[1:] != encoded.shape[1:] or inputs.dtype != encoded.dtype or inputs.device != encoded.device:
        return None
    equal = torch.stack([(inputs == row).flatten(1).all(1) for row in encoded], dim=1)       # [rows, encoded]
    found, index = equal.int().max(dim=1)
    return index if bool(found.all()) else None


def _wrap_encoder_step(original):
    @functools.wraps(original)
    def step(self, inputs_tensor, model_kwargs, model_input_name, generation_config):
        window = _window.get()
        if window is None or window.model is not self or not isinstance(inputs_tensor, torch.Tensor) \
                or generation_config.output_attentions or generation_config.output_hidden_states:
            return original(self, inputs_tensor, model_kwargs, model_input_name, generation_config)
        return window.encode(original, self, inputs_tensor, model_kwargs, model_input_name, generation_config)

    step.__hf_cascade_original__ = original
    return step


def _wrap_fallback(original):
    @functools.wraps(original)
    def generate_with_fallback(self, *args, **kwargs):
        if getattr(self.config, "_attn_implementation", None) != "cascade":
            return original(self, *args, **kwargs)
        token = _window.set(EncodedWindow(self))
        try:
            return original(self, *args, **kwargs)
        finally:
            _window.reset(token)

    generate_with_fallback.__hf_cascade_original__ = original
    return generate_with_fallback


def apply() -> None:
    """Wrap the two methods once; nothing outside :data:`SUPPORTED` or where :func:`unchanged_reason` says so."""
    if _checked:
        return
    _checked.append(True)
    if not in_range():
        return
    reason = unchanged_reason()
    if reason is not None:
        logger.debug("hf_cascade.patches.whisper_encoder not applied: %s", reason)
        return
    name, mixin = encoder_step_name(), _whisper_mixin()
    for owner, attribute, wrap in ((GenerationMixin, name, _wrap_encoder_step),
                                   (mixin, "generate_with_fallback", _wrap_fallback)):
        original = getattr(owner, attribute)
        setattr(owner, attribute, wrap(original))
        _applied.append((owner, attribute, original))
