"""Make ``generate`` on a cascade model run hf_cascade's decoding entry with no extra argument.

``GenerationMixin.generate`` is wrapped: for a model with ``attn_implementation="cascade"`` and no
``custom_generate`` of the caller's, it adds ``custom_generate=hf_cascade.generation.cascade_generate``
and forwards ``streamer`` (which transformers drops for custom callables). Other models are untouched.
Assisted decoding (an assistant model, prompt lookup, early exit, MTP) runs stock dense decoding, warned.

``GenerationMixin._extract_generation_mode_kwargs`` is wrapped too: for our entry it keeps ``tokenizer``
(stop strings, token healing) and ``synced_gpus``, which transformers drops for custom callables.
"""
from __future__ import annotations

import functools
import inspect
import logging
import threading

from transformers import GenerationMixin

from hf_cascade.compat import SUPPORTED, VERSION, cache_of, in_range

logger = logging.getLogger("hf_cascade")

ASSISTED = ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")   # generation options that mean assisted
_original_generate = None
_original_extract = None
_original_expand = None
_state = threading.local()     # set while generate runs our entry on an encoder-decoder model


def is_applied() -> bool:
    return _original_generate is not None


def _is_cascade(model) -> bool:
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == "cascade"


def _is_assisted(model, arguments, extra) -> bool:
    if arguments.get("assistant_model") is not None:
        return True
    configs = [c for c in (arguments.get("generation_config"), model.generation_config) if c is not None]
    return any(extra[k] if k in extra else any(getattr(c, k, None) for c in configs) for k in ASSISTED)


def _check_switched(model) -> None:
    """A model switched to "cascade" after loading by setting ``model.config._attn_implementation``: models whose
    decoder keeps a config of its own (T5's stacks hold copies) still run their old attention there, while generate
    would run hf_cascade's entry (which, for an encoder-decoder, leaves the encoder output unexpanded for the cascade
    cross-attention): refuse rather than crash inside with a size mismatch."""
    get_decoder = getattr(model, "get_decoder", None)
    try:
        decoder = get_decoder() if callable(get_decoder) else None
    except Exception:  # noqa: BLE001 — a model without a separable decoder: its config is the model's
        decoder = None
    used = getattr(getattr(decoder, "config", None), "_attn_implementation", "cascade")
    if used != "cascade":
        raise ValueError(
            f"model.config._attn_implementation is 'cascade' but {type(model).__name__}'s decoder still runs "
            f"{used!r} attention (its layers keep a config of their own, so setting the attribute on model.config "
            "switches only part of the model). Load the model with attn_implementation='cascade' (after "
            "`import hf_cascade`), or call model.set_attn_implementation('cascade') on a transformers version whose "
            "set_attn_implementation reaches the decoder's config (5.24 does; 5.17 does not for T5).")


def _wrap_extract(original):
    @functools.wraps(original)
    def extract(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer):
        from hf_cascade.generation import cascade_generate

        if custom_generate is not cascade_generate:
            return original(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer)
        stock = original(self, None, {"tokenizer": kwargs.pop("tokenizer", None)}, synced_gpus, None, None)
        return {**original(self, custom_generate, kwargs, synced_gpus, assistant_model, streamer), **stock}

    return extract


def _wrap(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        from hf_cascade.kv.cache import CascadeCache
        from hf_cascade.generation import cascade_generate, check_model_supported
        from hf_cascade.decode.session import capturing_call

        bound = signature.bind_partial(self, *args, **kwargs)
        arguments = bound.arguments
        extra = arguments.pop("kwargs", {})
        user_cache = cache_of(extra)
        if not _is_cascade(self):
            # a custom decoding method of the caller's (hub/hf-cascade-generate among them) takes these itself
            if arguments.get("custom_generate") is None and (isinstance(user_cache, CascadeCache)
                                                             or "hf_cascade_config" in extra):
                what = "A CascadeCache" if isinstance(user_cache, CascadeCache) else "hf_cascade_config"
                raise ValueError(f"{what} applies only to models loaded with attn_implementation='cascade' (after "
                                 "`import hf_cascade`); this model uses "
                                 f"{getattr(self.config, '_attn_implementation', None)!r}. Load it with "
                                 "attn_implementation='cascade', or leave the argument out.")
            return original(self, *args, **kwargs)
        _check_switched(self)
        check_model_supported(self)
        if arguments.get("custom_generate") is not None:
            return original(self, *args, **kwargs)          # the caller chose a decoding method
        if _is_assisted(self, arguments, extra):
            config = extra.pop("hf_cascade_config", None)
            if config is not None:
                from hf_cascade.config import CascadeConfig
                if CascadeConfig.coerce(config).max_kv_bytes is not None:
                    raise ValueError("CascadeConfig.max_kv_bytes cannot be enforced with assisted decoding (an "
                                     "assistant model, prompt lookup, early exit, MTP), which runs stock's dense cache. "
                                     "Unset max_kv_bytes, or drop the assistant.")
            logger.warning("assisted decoding runs with dense attention (no prompt sharing).")
            return original(self, **{k: v for k, v in arguments.items() if k != "self"}, **extra)
        arguments["custom_generate"] = cascade_generate
        streamer = arguments.pop("streamer", None)
        if streamer is not None:
            extra["hf_cascade_streamer"] = streamer
        arguments.pop("self")
        outer = getattr(_state, "defer_encoder_expansion", False)
        _state.defer_encoder_expansion = bool(getattr(self.config, "is_encoder_decoder", False))
        config = user_cache.cascade_config if isinstance(user_cache, CascadeCache) else extra.get("hf_cascade_config")
        try:
            # the whole call, transformers' own work before our entry included: where decode steps may be captured
            # as a CUDA graph, such calls run one at a time (hf_cascade.session.capturing_call)
            with capturing_call(self, config):
                return original(self, **arguments, **extra)
        finally:
            _state.defer_encoder_expansion = outer

    generate.__hf_cascade_original__ = original
    return generate


def _wrap_expand(original):
    """Encoder-decoder models on our entry: the encoder output is not copied once per beam
    (hf_cascade.encoder_expansion.defer_expansion keeps one row per input; the rest is expanded as stock)."""
    function = original.__func__ if isinstance(original, staticmethod) else original   # static before 5.2x

    @functools.wraps(function)
    def expand(*args, **kwargs):
        encoder_outputs = kwargs.get("encoder_outputs")
        size = kwargs.get("expand_size", 1)
        if not getattr(_state, "defer_encoder_expansion", False) or encoder_outputs is None or size == 1 \
                or not kwargs.get("is_encoder_decoder", False):
            return function(*args, **kwargs)
        from hf_cascade.seq2seq.encoder_expansion import defer_expansion

        kwargs = {**kwargs, "is_encoder_decoder": False}
        del kwargs["encoder_outputs"]
        input_ids, model_kwargs = function(*args, **kwargs)
        model_kwargs["encoder_outputs"] = defer_expansion(encoder_outputs, size)
        return input_ids, model_kwargs

    return staticmethod(expand) if isinstance(original, staticmethod) else expand


def _wrap_whisper(original):
    """Whisper's generate switches the whole model to eager attention for token timestamps (it needs the
    cross-attention weights): say so once for a cascade model, whose later calls then run stock eager."""
    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if _is_cascade(self) and kwargs.get("return_token_timestamps"):
            logger.warning("return_token_timestamps needs cross-attention weights, so Whisper switches "
                           "this model to eager attention (its own behaviour): this and every later generate call "
                           "run stock eager attention. Use a separate model for token timestamps.")
        return original(self, *args, **kwargs)

    return generate


def apply() -> None:
    """Wrap GenerationMixin.generate once (idempotent); outside the checked versions, log and skip."""
    global _original_generate, _original_extract
    if _original_generate is not None:
        return
    version = VERSION
    if not in_range():
        logger.warning("transformers %s is outside the checked range [%s, %s): generate() on cascade "
                       "models will not prefill prompts once (attention still works).", version, *SUPPORTED)
        return
    _original_generate, _original_extract = GenerationMixin.generate, GenerationMixin._extract_generation_mode_kwargs
    global _original_expand
    _original_expand = GenerationMixin.__dict__["_expand_inputs_for_generation"]
    GenerationMixin.generate = _wrap(_original_generate)
    GenerationMixin._extract_generation_mode_kwargs = _wrap_extract(_original_extract)
    GenerationMixin._expand_inputs_for_generation = _wrap_expand(_original_expand)
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin
    WhisperGenerationMixin.generate = _wrap_whisper(WhisperGenerationMixin.generate)
