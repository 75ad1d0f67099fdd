"""The decoding entry for cascade models: prefill each unique prompt once, fork, then hand over to
transformers' own beam search / sampling loop.

``generate`` prepares inputs as usual (expanding every prompt to ``n`` rows, n = beams or returned
sequences) and calls :func:`cascade_generate` (``patches`` makes it the default for cascade models).
We run the model on rows ``0, n, 2n, ...`` minus their last token into a :class:`CascadeCache`
(padding not stored), fork the cache to all rows without copying K/V, and call
``GenerationMixin._beam_search`` / ``_sample``, whose own prefill then feeds the last prompt token
for all rows.
"""
from __future__ import annotations

import contextlib
import logging

import torch
from transformers import GenerationMixin
from transformers.generation.configuration_utils import GenerationMode

from . import encoder_decoder, graphs
from .attention import stock_attention
from .cache import CascadeCache
from .config import CascadeConfig

logger = logging.getLogger("hf_cascade")

SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH,
                   GenerationMode.BEAM_SAMPLE)


def _text_config(model):
    return model.config.get_text_config(decoder=True)


def unsupported_reason(model) -> str | None:
    """Why the cascade path cannot serve ``model`` (None when it can)."""
    config, text = model.config, _text_config(model)
    if getattr(config, "is_encoder_decoder", False):   # encoder-decoder: hf_cascade/encoder_decoder.py
        return encoder_decoder.unsupported_reason(model)
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} does not route its attention through transformers' AttentionInterface"
    if getattr(text, "kv_lora_rank", None) or getattr(text, "q_lora_rank", None):
        return "it uses multi-head latent attention (MLA), whose cache payload is not plain K/V"
    if getattr(text, "num_kv_shared_layers", 0):
        return "some of its layers reuse other layers' K/V (KV sharing)"
    layer_types = getattr(text, "layer_types", None) or []
    other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if other:
        return f"it has non-attention or special layers ({', '.join(other)})"
    return None


def check_model_supported(model) -> None:
    reason = unsupported_reason(model)
    if reason is not None:
        raise NotImplementedError(
            f"attn_implementation='cascade' cannot serve this model: {reason}. "
            f"Load it with attn_implementation='{stock_attention(model)}' instead.")


def model_fingerprint(model) -> tuple:
    text = _text_config(model)
    heads = getattr(text, "num_attention_heads", None)
    return (type(model).__name__, text.num_hidden_layers, getattr(text, "num_key_value_heads", heads),
            getattr(text, "head_dim", None), text.hidden_size)


def _cache_key(model_kwargs) -> str:
    return "cache" if "cache" in model_kwargs else "past_key_values"   # 5.24 renamed past_key_values -> cache


@torch.no_grad()
def prefill(model, cache: CascadeCache, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
            position_ids: torch.Tensor | None = None, cache_kwarg: str | None = None):
    """Run ``model`` on ``input_ids`` [B, L] into ``cache``, storing only the tokens where
    ``attention_mask`` [B, L] is 1. If the cache already holds tokens, the new ones follow them (and
    ``position_ids`` should say where). Returns the model output (logits of the last position only)."""
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
        if not bool(attention_mask.all()):
            cache.set_write_mask(attention_mask)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
            position_ids = position_ids + cache.get_seq_length()
        past = cache.get_seq_length()
        if past:   # the model's mask covers what the cache holds, too
            attention_mask = torch.cat([attention_mask.new_ones(attention_mask.shape[0], past), attention_mask], 1)
    kwargs = {cache_kwarg or ("cache" if _accepts(model, "cache") else "past_key_values"): cache}
    if _accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = 1
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                 **kwargs)


def shared_prefix_length(input_ids: torch.LongTensor, attention_mask: torch.Tensor | None, min_tokens: int) -> int:
    """How many tokens every left-padded prompt of the batch begins with (a common system prompt),
    leaving each prompt at least one token of its own; 0 if fewer than ``min_tokens``."""
    batch, width = input_ids.shape
    if batch < 2:
        return 0
    ids = input_ids.cpu()
    if attention_mask is None:
        starts = torch.zeros(batch, dtype=torch.long)
    else:
        mask = attention_mask.cpu().bool()
        starts = width - mask.sum(1)
        if not torch.equal(mask, torch.arange(width)[None, :] >= starts[:, None]):
            return 0                                 # not plain left padding: no sharing
    longest = int((width - starts).min()) - 1
    if longest < min_tokens:
        return 0
    real = ids.gather(1, starts[:, None] + torch.arange(longest)[None, :])       # [B, longest], pads skipped
    differs = (real != real[:1]).any(0)
    shared = int(differs.int().argmax()) if bool(differs.any()) else longest
    return shared if shared >= min_tokens else 0


def _has_sliding_window(model) -> bool:
    text = _text_config(model)
    return bool(getattr(text, "sliding_window", None)) or "sliding_attention" in (getattr(text, "layer_types", None)
                                                                                 or [])


@torch.no_grad()
def prefill_prompts(model, cache: CascadeCache, prompts: torch.LongTensor, mask: torch.Tensor | None,
                    positions: torch.Tensor | None, cache_kwarg: str) -> int:
    """Prefill B left-padded prompts [B, L] once each; tokens they all begin with (a shared system
    prompt) are prefilled and stored once for the whole batch. Returns the shared length."""
    shared = 0
    if not _has_sliding_window(model):               # a window would count the other prompts' pads
        shared = shared_prefix_length(prompts, mask, min_tokens=cache.block_size)
    if not shared:
        prefill(model, cache, prompts, attention_mask=mask, position_ids=positions, cache_kwarg=cache_kwarg)
        return 0
    batch, width = prompts.shape
    start = 0 if mask is None else width - int(mask[0].sum())
    prefill(model, cache, prompts[:1, start:start + shared], cache_kwarg=cache_kwarg,
            position_ids=torch.arange(shared, device=prompts.device)[None])
    cache.batch_repeat_interleave(batch)
    if width > shared:
        # Each prompt's rest, left-padded among themselves: with left padding, column c of the rest is
        # column c + shared of the prompt, and it is real exactly where the prompt's column c is.
        rest_mask = None if mask is None else mask[:, : width - shared]
        rest_positions = None if positions is None else positions[:, shared:]
        prefill(model, cache, prompts[:, shared:], attention_mask=rest_mask, position_ids=rest_positions,
                cache_kwarg=cache_kwarg)
    return shared


def _accepts(model, name: str) -> bool:
    import inspect
    return name in inspect.signature(model.forward).parameters


def cascade_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                     hf_cascade_streamer=None, hf_cascade_config: CascadeConfig | None = None, tokenizer=None,
                     **model_kwargs):
    """``generate(custom_generate=...)`` entry: one prefill per prompt, fork, then stock decoding.

    ``hf_cascade_streamer`` carries generate's ``streamer`` (transformers drops it for custom callables);
    ``hf_cascade_config`` sets the cache's :class:`CascadeConfig` when generate creates the cache;
    ``tokenizer`` is generate's own (the patch keeps it for generate's stop-string criteria; unused here).
    """
    mode = generation_config.get_generation_mode()
    if mode not in SUPPORTED_MODES:
        raise NotImplementedError(f"cascade generate supports greedy, sampling and beam search, not {mode.value}; "
                                  f"use attn_implementation='{stock_attention(model)}' for it.")
    if hf_cascade_streamer is not None:
        if mode in (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE):
            raise ValueError("`streamer` cannot be used with beam search (yet!). Make sure that `num_beams` is set to 1.")
        model_kwargs["streamer"] = hf_cascade_streamer
        hf_cascade_streamer.put(input_ids.cpu())
    decode = GenerationMixin._beam_search if generation_config.num_beams > 1 else GenerationMixin._sample
    key = _cache_key(model_kwargs)
    if getattr(model.config, "is_encoder_decoder", False):   # encoder-decoder: hf_cascade/encoder_decoder.py
        return encoder_decoder.generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                        synced_gpus, decode, hf_cascade_config, key, **model_kwargs)
    existing = model_kwargs.get(key)
    if existing is not None and not isinstance(existing, CascadeCache) and \
            generation_config.cache_implementation not in (None, "dynamic"):
        raise ValueError(f"cache_implementation={generation_config.cache_implementation!r} conflicts with "
                         "attn_implementation='cascade', which brings its own cache. Unset it, or use "
                         f"{stock_attention(model)}.")
    if generation_config.return_dict_in_generate and (generation_config.output_hidden_states
                                                      or generation_config.output_attentions):
        # stock returns them for every prompt position, which a once-per-prompt prefill does not compute
        if isinstance(existing, CascadeCache):
            raise ValueError("output_hidden_states/output_attentions need every prompt position's outputs, which a "
                             "CascadeCache prefill does not keep; pass no cache (dense decoding) or use "
                             f"{stock_attention(model)}.")
        logger.warning("hf_cascade: output_hidden_states/output_attentions run with dense attention "
                       "(no prompt sharing).")
        return decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                      synced_gpus=synced_gpus, **model_kwargs)
    if not generation_config.use_cache or (existing is not None and not isinstance(existing, CascadeCache)
                                           and getattr(existing, "_is_user_defined", False)):
        # No cache, or the user's own non-cascade cache: stock decoding; attention takes the dense path.
        return decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                      synced_gpus=synced_gpus, **model_kwargs)
    if model_kwargs.get("inputs_embeds") is not None:
        raise NotImplementedError("cascade generate needs input_ids, not inputs_embeds; use "
                                  f"attn_implementation='{stock_attention(model)}'.")

    owned = not isinstance(existing, CascadeCache)
    cache = graphs.owned_cache(model, hf_cascade_config) if owned else existing
    fingerprint = model_fingerprint(model)
    if cache.model_fingerprint is not None and cache.model_fingerprint != fingerprint:
        raise ValueError(f"This CascadeCache was used with another model ({cache.model_fingerprint}); this one is "
                         f"{fingerprint}. Call cache.reset() or pass a new CascadeCache.")
    if cache.get_seq_length() > 0:
        raise ValueError(f"The CascadeCache passed to generate already holds {cache.get_seq_length()} tokens; "
                         "continuing from a filled cache is not supported. Call cache.reset() or pass a new one.")
    cache.model_fingerprint = fingerprint
    model_kwargs[key] = cache

    n = max(generation_config.num_beams, generation_config.num_return_sequences or 1)
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask[:, -1].all()):
        raise ValueError("The last prompt token of some row is padding (right padding). Decoder-only generation "
                         "needs left padding: set tokenizer.padding_side='left'.")
    ok, runner = False, None
    try:
        if input_ids.shape[1] > 1:
            positions = model_kwargs.get("position_ids")
            prefill_prompts(model, cache, input_ids[::n, :-1], None if mask is None else mask[::n, :-1],
                            None if positions is None else positions[::n, :-1], key)
            cache.batch_repeat_interleave(n)
        if cache.cascade_config.static_decode:
            cache.begin_decode(generation_config.max_length or input_ids.shape[1] + 1)
        runner = graphs.decode_runner(model, cache, generation_config)
        with runner if runner is not None else contextlib.nullcontext():
            result = decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                            synced_gpus=synced_gpus, **model_kwargs)
        ok = True
        return result
    finally:
        handed_out = ok and generation_config.return_dict_in_generate
        # nobody else can reach an owned cache that is not handed out: every block goes back now (what a
        # captured graph points at is kept for the model's next call of the same shape)
        graphs.finish_call(model, cache, runner, owned=owned and not handed_out, ok=ok)
