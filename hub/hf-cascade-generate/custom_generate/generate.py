"""hf_cascade's decoding as a Hub ``custom_generate`` method, for a model loaded without ``import hf_cascade``.

``model.generate(..., custom_generate="<this repository or folder>", trust_remote_code=True)`` runs
:func:`generate`: it switches the model to ``attn_implementation="cascade"`` for the call, runs hf_cascade's
decoding entry (generate of a cascade model: prompts prefilled once, K/V shared across beams and samples,
stock's tokens) and puts back every config's attention implementation as it was, also when the call raises.

What the cascade does not take runs stock ``generate`` on the model as loaded, warned once per reason:
a model hf_cascade cannot serve (``hf_cascade.generation.unsupported_reason``), a model that does not take the
switch, and decoding other than greedy, sampling and beam search (assisted, contrastive, DoLa, group or
constrained beam search). Inside the cascade, calls where sharing saves little run stock's path as they do
for any cascade model (hf_cascade's docs, docs/usage.md).

Concurrent calls on one model are counted: the first switches the model, the last puts it back. While a call
runs, the model's other users (another thread's stock ``generate`` or forward) see "cascade" attention, which
gives them stock's results on its dense path.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import weakref

import hf_cascade  # noqa: F401  registers attn_implementation="cascade" and routes generate of cascade models
from hf_cascade.config import CascadeConfig
from hf_cascade.generation import SUPPORTED_MODES, unsupported_reason
from hf_cascade.logs import log_once
from transformers import GenerationMixin, PreTrainedConfig

CASCADE = "cascade"
_ATTRIBUTE = "_attn_implementation_internal"      # what config._attn_implementation reads and writes
_MISSING = object()
# generate's named parameters; the rest of its keyword arguments are generation options or model inputs
_NAMED = frozenset(inspect.signature(GenerationMixin.generate).parameters) - {"self", "kwargs"}

_lock = threading.Lock()                           # guards _switched
_switched: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # model -> [running calls, snapshot]


def generate(model, *args, **kwargs):
    """``generate`` with hf_cascade's decoding; takes what ``model.generate`` takes (``hf_cascade_config`` too)."""
    reason = stock_reason(model, kwargs)
    if reason is None:
        with cascade_attention(model) as refused:
            reason = refused
            if reason is None:
                # the class's generate: an instance attribute may be this function (a model repo shipping it)
                return type(model).generate(model, *args, **kwargs)
    log_once(("hub stock path", reason), logging.WARNING,
             "custom_generate hf-cascade-generate runs stock generate: %s.", reason)
    return type(model).generate(model, *args, **_stock_arguments(kwargs, reason))


def stock_reason(model, kwargs: dict) -> str | None:
    """Why this call runs stock ``generate`` on the model as loaded (None: it runs the cascade)."""
    reason = unsupported_reason(model)
    if reason is not None:
        return f"hf_cascade cannot serve this model: {reason}"
    options = {key: value for key, value in kwargs.items() if key not in _NAMED}
    # the generation config generate itself will use (the model's defaults under the caller's options)
    config, _ = model._prepare_generation_config(kwargs.get("generation_config"), **options)
    mode = config.get_generation_mode(kwargs.get("assistant_model"))
    if mode not in SUPPORTED_MODES:
        return f"the cascade runs greedy, sampling and beam search, not {mode.value}"
    return None


def _stock_arguments(kwargs: dict, reason: str) -> dict:
    """``kwargs`` without hf_cascade's settings, which stock generate refuses; a KV cap cannot hold there."""
    kwargs = dict(kwargs)
    settings = kwargs.pop("hf_cascade_config", None)
    if settings is not None and CascadeConfig.coerce(settings).max_kv_bytes is not None:
        raise ValueError(f"CascadeConfig.max_kv_bytes cannot be enforced on stock's path, whose cache is not capped; "
                         f"this call runs there because {reason}. Unset max_kv_bytes, or change the call so that the "
                         "cascade takes it.")
    return kwargs


@contextlib.contextmanager
def cascade_attention(model):
    """The model on "cascade" attention inside the block, every config's choice put back after it. Yields None,
    or why the model did not take the switch (then it is already put back)."""
    refused = None
    with _lock:
        entry = _switched.get(model)
        if entry is None:
            snapshot = _snapshot(model)
            try:
                model.set_attn_implementation(CASCADE)
                refused = _unswitched_part(model)
            except BaseException:
                _restore(snapshot)
                raise
            if refused is None:
                entry = _switched[model] = [0, snapshot]
            else:
                _restore(snapshot)
        if entry is not None:
            entry[0] += 1
    if refused is not None:
        yield refused
        return
    try:
        yield None
    finally:
        with _lock:
            entry[0] -= 1
            if entry[0] == 0:
                del _switched[model]
                _restore(entry[1])


def _configs(model) -> list:
    """Every config the model's modules hold, and their sub-configs at any depth (each once)."""
    found, pending = {}, [getattr(module, "config", None) for module in model.modules()]
    while pending:
        config = pending.pop()
        if isinstance(config, PreTrainedConfig) and id(config) not in found:
            found[id(config)] = config
            pending.extend(getattr(config, key, None) for key in getattr(config, "sub_configs", {}))
    return list(found.values())


def _snapshot(model) -> list:
    return [(config, config.__dict__.get(_ATTRIBUTE, _MISSING)) for config in _configs(model)]


def _restore(snapshot: list) -> None:
    for config, value in snapshot:
        if value is _MISSING:
            config.__dict__.pop(_ATTRIBUTE, None)
        else:
            setattr(config, _ATTRIBUTE, value)


def _unswitched_part(model) -> str | None:
    """Why the switch did not reach the model or its decoder (transformers warns and skips models that do not
    take it; 5.17 does not reach T5's decoder stack, which keeps a config of its own)."""
    parts = [("model", model)]
    get_decoder = getattr(model, "get_decoder", None)
    try:
        parts.append(("decoder", get_decoder() if callable(get_decoder) else None))
    except Exception:  # noqa: BLE001 — no separable decoder: the model's config is the decoder's
        pass
    for name, part in parts:
        used = getattr(getattr(part, "config", None), "_attn_implementation", CASCADE)
        if used != CASCADE:
            return (f"its {name} ({type(part).__name__}) kept {used!r} attention when switched to 'cascade' "
                    "(load it with attn_implementation='cascade' after `import hf_cascade` instead)")
    return None
