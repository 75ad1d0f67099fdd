"""A clear error when a model that picks its attention class from a table of its own with no "cascade" entry
(Falcon, GPT-Neo, GPT-J on older transformers, where patches/families.py does not apply) is built with
attn_implementation="cascade".

Such models index a per-model dict with ``config._attn_implementation`` while they are built and
fail with a bare ``KeyError: 'cascade'``; ``from_pretrained`` / ``from_config`` now turn that into an
error that names the reason and the alternative.

Also refused as they are built: models that add ALiBi biases and route their attention through the interface
(Falcon with ``alibi=True`` from transformers 5.25; before, its table's "cascade" entry refused it). Their forward
would call the cascade attention, which adds no bias, and fail on the deferred mask; the refusal is generate's
(:func:`hf_cascade.generation.check_model_supported`), given at load as before 5.25.
"""
from __future__ import annotations

import functools

from transformers import PreTrainedModel

_originals: dict = {}


def _wrap(name: str):
    original = getattr(PreTrainedModel, name).__func__

    @functools.wraps(original)
    def loader(cls, *args, **kwargs):
        try:
            loaded = original(cls, *args, **kwargs)
        except KeyError as err:
            if err.args and err.args[0] == "cascade":
                stock = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"   # GPT-Neo has no sdpa
                raise NotImplementedError(
                    f"{cls.__name__} chooses its attention class from a table of its own, which has no 'cascade' "
                    "entry, so attn_implementation='cascade' cannot serve it. Load it with "
                    f"attn_implementation='{stock}' instead.") from err
            raise
        _refuse_routed_alibi(loaded[0] if isinstance(loaded, tuple) else loaded)    # (output_loading_info: a tuple)
        return loaded

    loader.__hf_cascade_original__ = original
    return classmethod(loader)


def _refuse_routed_alibi(model) -> None:
    if not isinstance(model, PreTrainedModel) or getattr(model.config, "_attn_implementation", None) != "cascade":
        return
    from hf_cascade.generation import check_model_supported, routes_attention, uses_alibi
    if uses_alibi(model) and routes_attention(model):
        check_model_supported(model)        # raises: ALiBi is its first refusal


def is_applied() -> bool:
    return bool(_originals)


def apply() -> None:
    """Wrap PreTrainedModel.from_pretrained and _from_config once (idempotent)."""
    if _originals:
        return
    for name in ("from_pretrained", "_from_config"):
        _originals[name] = getattr(PreTrainedModel, name)
        setattr(PreTrainedModel, name, _wrap(name))
