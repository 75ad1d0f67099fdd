"""Make ``generate`` on a cascade model run hf_cascade's decoding entry with no extra argument.

``GenerationMixin.generate`` is wrapped: for a model with ``attn_implementation="cascade"`` and no
``custom_generate`` of the caller's, it adds ``custom_generate=hf_cascade.generation.cascade_generate``
and forwards ``streamer`` (which transformers drops for custom callables). Other models are untouched.
"""
from __future__ import annotations

import functools
import inspect
import logging

import transformers
from packaging.version import Version
from transformers import GenerationMixin

logger = logging.getLogger("hf_cascade")

SUPPORTED = (Version("5.17.0"), Version("6.0.0"))   # [min, max) transformers versions this patch was checked on
_original_generate = None


def is_applied() -> bool:
    return _original_generate is not None


def _is_cascade(model) -> bool:
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == "cascade"


def _wrap(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        from hf_cascade.cache import CascadeCache
        from hf_cascade.generation import cascade_generate, check_model_supported

        bound = signature.bind_partial(self, *args, **kwargs)
        arguments = bound.arguments
        extra = arguments.pop("kwargs", {})
        user_cache = extra.get("cache", extra.get("past_key_values"))
        if not _is_cascade(self):
            if isinstance(user_cache, CascadeCache):
                raise ValueError("A CascadeCache needs a model loaded with attn_implementation='cascade' "
                                 "(after `import hf_cascade`); this model uses "
                                 f"{getattr(self.config, '_attn_implementation', None)!r}.")
            return original(self, *args, **kwargs)
        check_model_supported(self)
        if arguments.get("custom_generate") is not None:
            return original(self, *args, **kwargs)          # the caller chose a decoding method
        if arguments.get("assistant_model") is not None or extra.get("prompt_lookup_num_tokens") is not None:
            logger.warning("hf_cascade: assisted decoding runs with dense attention (no prompt sharing).")
            return original(self, *args, **kwargs)
        arguments["custom_generate"] = cascade_generate
        streamer = arguments.pop("streamer", None)
        if streamer is not None:
            extra["hf_cascade_streamer"] = streamer
        arguments.pop("self")
        return original(self, **arguments, **extra)

    generate.__hf_cascade_original__ = original
    return generate


def apply() -> None:
    """Wrap GenerationMixin.generate once (idempotent); outside the checked versions, log and skip."""
    global _original_generate
    if _original_generate is not None:
        return
    version = Version(transformers.__version__)
    if not SUPPORTED[0] <= version < SUPPORTED[1]:
        logger.warning("hf_cascade: transformers %s is outside the checked range [%s, %s): generate() on cascade "
                       "models will not prefill prompts once (attention still works).", version, *SUPPORTED)
        return
    _original_generate = GenerationMixin.generate
    GenerationMixin.generate = _wrap(_original_generate)
