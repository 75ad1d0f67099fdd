"""The decoding entry for cascade models: check the call, prefill each unique prompt once, fork, then decode in
one :class:`~hf_cascade.decode.session.DecodeSession` (:mod:`hf_cascade.decode`).

``generate`` prepares inputs as usual (expanding every prompt to ``n`` rows, n = beams or returned
sequences) and calls :func:`cascade_generate` (``patches`` makes it the default for cascade models).
We run the model on rows ``0, n, 2n, ...`` minus their last token into a :class:`CascadeCache`
(padding not stored), fork the cache to all rows without copying K/V, and decode: the one loop
(:mod:`hf_cascade.decode.whole_step`), whose first step feeds the last prompt token for all rows, or where it cannot
serve the call ``GenerationMixin._beam_search`` / ``_sample`` with eager forwards. Other per-token model inputs
(``token_type_ids``, ``inputs_embeds``) are sliced the same way. A call that shares too little to pay for the paged
cache runs on stock's own path instead (:func:`stock_path_reason`). The call's cache, decode layout, step runner and
end belong to its :class:`~hf_cascade.decode.session.DecodeSession`; this module gives it the decoder-only strategy
(:class:`PromptPrefill`).
"""
from __future__ import annotations

import functools
import inspect
import logging
import numbers
import sys

import torch
from transformers import GenerationMixin
from transformers.generation.configuration_utils import GenerationMode

from . import compat
from .seq2seq import encoder_decoder, seq2seq_models
from .decode import fused_linears, fused_ops, graphs, session, whole_step
from .attention import stock_attention
from .kv.cache import CascadeCache
from .config import CascadeConfig
from .logs import log_once
from .decode.session import DecodeSession, prefill_forward, register_prefill_hook  # noqa: F401 (re-exported)

logger = logging.getLogger("hf_cascade")

SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH,
                   GenerationMode.BEAM_SAMPLE)


def _text_config(model):
    return model.config.get_text_config(decoder=True)


def routes_attention(model) -> bool:
    """Whether ``model``'s attention layers call the implementation chosen by ``attn_implementation`` through
    transformers' ``ALL_ATTENTION_FUNCTIONS`` (else "cascade" would never run and its cache would mislead them).
    transformers' ``_supports_attention_backend`` says so for most models, but not for all that do: the
    decoders of BART, mBART, Marian and Whisper used alone (``*ForCausalLM``) route it but lack the flag. So
    read the code: some module's ``forward`` (or ``_attn``, where hf_cascade.patches routes GPT-Neo's attention,
    and GPT-J's and CodeGen's of transformers < 5.2x) names ``ALL_ATTENTION_FUNCTIONS``."""
    if getattr(model, "_supports_attention_backend", False):
        return True
    seen = set()
    for module in model.modules():
        cls = type(module)
        if cls in seen:
            continue
        seen.add(cls)
        for method in (cls.forward, getattr(cls, "_attn", None)):
            code = getattr(inspect.unwrap(method), "__code__", None) if method else None   # under decorators
            if code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names:
                return True
    return False


def uses_alibi(model) -> bool:
    """Whether ``model`` adds ALiBi biases to its attention scores: its config's flag where the family has one
    (Falcon ``alibi``, MPT ``attn_config.alibi``), else whether its modeling file builds them (Bloom: always)."""
    text = _text_config(model)
    for flag in (getattr(text, "alibi", None), getattr(getattr(text, "attn_config", None), "alibi", None)):
        if flag is not None:
            return bool(flag)
    modeling = sys.modules.get(type(model).__module__)
    names = vars(modeling).items() if modeling is not None else ()
    return any("alibi" in name.lower() and callable(obj) for name, obj in names)


def unsupported_reason(model) -> str | None:
    """Why the cascade path cannot serve ``model`` (None when it can)."""
    config, text = model.config, _text_config(model)
    if getattr(config, "is_encoder_decoder", False):   # encoder-decoder: hf_cascade/seq2seq/encoder_decoder.py
        reason = seq2seq_models.unsupported_reason(model)
        if reason is None and config.model_type in seq2seq_models.COMPOSITE:
            # stock's path, but the "cascade" mask reaches every part: each must take it through the interface
            for part in (model.get_encoder(), model.get_decoder()):
                if not routes_attention(part):
                    return (f"its {'encoder' if part is model.get_encoder() else 'decoder'} "
                            f"({type(part).__name__}) computes attention in its own code: it does not call "
                            "transformers' AttentionInterface (ALL_ATTENTION_FUNCTIONS)")
        return reason
    if getattr(text, "num_attention_heads", None) is None:
        return f"{type(model).__name__} has no attention layers (e.g. a state-space model): there is no K/V to share"
    # ALiBi before routing: a model that routes its attention and adds ALiBi to the mask (Falcon from 5.25) would
    # otherwise run the cascade attention, which takes no additive bias
    if uses_alibi(model):
        return (f"{type(model).__name__} adds ALiBi position biases to its attention scores, and the cascade "
                "kernels have no ALiBi bias (a model with rotary or learned positions is served)")
    if not routes_attention(model):
        return (f"{type(model).__name__} computes attention in its own code: no module of it calls transformers' "
                "AttentionInterface (ALL_ATTENTION_FUNCTIONS), so the cascade attention would never run")
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
        # a composite model (VisionEncoderDecoderModel, ...): what its decoder has (TrOCR: eager only)
        part = model.get_decoder() if model.config.model_type in seq2seq_models.COMPOSITE else model
        raise NotImplementedError(
            f"attn_implementation='cascade' cannot serve this model: {reason}. "
            f"Load it with attn_implementation='{stock_attention(part)}' instead.")


def model_fingerprint(model) -> tuple:
    text = _text_config(model)
    heads = getattr(text, "num_attention_heads", None)
    return (type(model).__name__, text.num_hidden_layers, getattr(text, "num_key_value_heads", heads),
            getattr(text, "head_dim", None), text.hidden_size)



@torch.no_grad()
def prefill(model, cache: CascadeCache, input_ids: torch.LongTensor | None, attention_mask: torch.Tensor | None = None,
            position_ids: torch.Tensor | None = None, cache_kwarg: str | None = None,
            inputs_embeds: torch.Tensor | None = None, run_hooks: bool = True, **model_inputs):
    """Run ``model`` on ``input_ids`` [B, L] (or ``inputs_embeds`` [B, L, H]) into ``cache``, storing only
    the tokens where ``attention_mask`` [B, L] is 1. If the cache already holds tokens, the new ones follow
    them (and ``position_ids`` should say where). ``model_inputs`` (e.g. ``token_type_ids`` [B, L]) go to
    the model's forward as they are. ``run_hooks=False``: the model's ``forward`` without the hooks on the model itself
(generate's own prefill, which stock's loop has no counterpart of: hooks on the model run once per chosen token, as
in stock). Returns the model output (logits of the last position only)."""
    shape = tuple((input_ids if inputs_embeds is None else inputs_embeds).shape[:2])
    if attention_mask is not None:
        if tuple(attention_mask.shape) != shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match the inputs' {shape}")
        if not bool(attention_mask.all()):
            cache.set_write_mask(attention_mask)
        if position_ids is None and _accepts(model, "position_ids"):   # else (BART-family decoders): columns
            position_ids = _mask_positions(attention_mask) + cache.get_seq_length()
        past = cache.get_seq_length()
        if past:   # the model's mask covers what the cache holds, too
            attention_mask = torch.cat([attention_mask.new_ones(attention_mask.shape[0], past), attention_mask], 1)
    kwargs = {cache_kwarg or compat.cache_kwarg(model): cache}
    if _accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = 1
    if inputs_embeds is not None:
        kwargs["inputs_embeds"] = inputs_embeds
        input_ids = None
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                  **{**model_inputs, **kwargs})
    if run_hooks:
        return model(**kwargs)
    return prefill_forward(model, **kwargs)


def shared_prefix_length(input_ids: torch.LongTensor, attention_mask: torch.Tensor | None, min_tokens: int,
                         also: tuple = ()) -> int:
    """How many tokens every left-padded prompt of the batch begins with (a common system prompt),
    leaving each prompt at least one token of its own; 0 if fewer than ``min_tokens``. Tensors in
    ``also`` ([B, L, ...]: token types, positions) must agree over the shared tokens too."""
    if input_ids.dim() != 2:
        raise ValueError(f"shared_prefix_length takes input_ids of shape [batch, length], got {tuple(input_ids.shape)}.")
    batch, width = input_ids.shape
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, width):
        raise ValueError(f"shared_prefix_length got attention_mask of shape {tuple(attention_mask.shape)} for input_ids "
                         f"of shape {(batch, width)}: the mask must have the ids' shape (1 for tokens, 0 for padding).")
    for t in also:
        if t.dim() < 2 or tuple(t.shape[:2]) != (batch, width):
            raise ValueError(f"shared_prefix_length got a per-token input of shape {tuple(t.shape)} for input_ids of "
                             f"shape {(batch, width)}: it must be laid out like the ids ([batch, length, ...]).")
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
    columns = starts[:, None] + torch.arange(longest)[None, :]                   # [B, longest], pads skipped
    differs = torch.zeros(longest, dtype=torch.bool)
    for t in (ids, *also):
        real = t.cpu()[torch.arange(batch)[:, None], columns].reshape(batch, longest, -1)
        differs |= (real != real[:1]).flatten(2).any(2).any(0)
    shared = int(differs.int().argmax()) if bool(differs.any()) else longest
    return shared if shared >= min_tokens else 0


def _sliding_window(model) -> int | None:
    text = _text_config(model)
    window = getattr(text, "sliding_window", None)
    if not window and "local" in (getattr(text, "attention_layers", None) or []):    # GPT-Neo's local layers
        window = getattr(text, "window_size", None)
    return window


def _has_sliding_window(model) -> bool:
    text = _text_config(model)
    return bool(_sliding_window(model)) or "sliding_attention" in (getattr(text, "layer_types", None) or [])


def _shareable_length(model, block_size: int, prompts, mask, positions, inputs: dict) -> int:
    """The tokens :func:`prefill_prompts` stores once for the whole batch (0: none)."""
    if prompts is None or "inputs_embeds" in inputs or _has_sliding_window(model):
        return 0                  # embeddings are not compared; a window would count the other prompts' pads
    if positions is None and mask is not None and not _accepts(model, "position_ids") and not bool(mask.all()):
        return 0                  # positions are columns (BART-family decoders): pads shift each row's tokens
    also = tuple(v for v in inputs.values() if isinstance(v, torch.Tensor)) + (() if positions is None else (positions,))
    return shared_prefix_length(prompts, mask, min_tokens=block_size, also=also)


@torch.no_grad()
def prefill_prompts(model, cache: CascadeCache, prompts: torch.LongTensor | None, mask: torch.Tensor | None,
                    positions: torch.Tensor | None, cache_kwarg: str, run_hooks: bool = True, **inputs) -> int:
    """Prefill B left-padded prompts [B, L] once each; tokens they all begin with (a shared system
    prompt) are prefilled and stored once for the whole batch. ``inputs`` are per-row model inputs
    laid out like the prompt ([B, L, ...]: ``inputs_embeds``, ``token_type_ids``), sliced with it.
    Returns the shared length."""
    shared = _shareable_length(model, cache.block_size, prompts, mask, positions, inputs)
    if not shared:
        prefill(model, cache, prompts, attention_mask=mask, position_ids=positions, cache_kwarg=cache_kwarg,
                run_hooks=run_hooks, **inputs)
        return 0
    batch, width = prompts.shape
    start = 0 if mask is None else width - int(mask[0].sum())
    part = slice(start, start + shared)
    prefill(model, cache, prompts[:1, part], cache_kwarg=cache_kwarg, run_hooks=run_hooks,
            position_ids=(torch.arange(shared, device=prompts.device)[None] if positions is None
                          else positions[:1, part]),
            **{name: t[:1, part] for name, t in inputs.items()})
    cache.batch_repeat_interleave(batch)
    if width > shared:
        # Each prompt's rest, left-padded among themselves: with left padding, column c of the rest is
        # column c + shared of the prompt, and it is real exactly where the prompt's column c is.
        rest_mask = None if mask is None else mask[:, : width - shared]
        rest_positions = None if positions is None else positions[:, shared:]
        prefill(model, cache, prompts[:, shared:], attention_mask=rest_mask, position_ids=rest_positions,
                cache_kwarg=cache_kwarg, run_hooks=run_hooks, **{name: t[:, shared:] for name, t in inputs.items()})
    return shared


def _accepts(model, name: str) -> bool:
    import inspect
    return name in inspect.signature(model.forward).parameters


# Model inputs that stock generate lays out like input_ids ([rows, L], sliced on the sequence axis every
# step): the cascade prefill takes each prompt's columns of them.
SEQUENCE_INPUTS = ("inputs_embeds", "token_type_ids", "mm_token_type_ids", "moe_mm_token_type_ids")
# model_kwargs this module places itself
_OWN_KWARGS = ("attention_mask", "position_ids", *compat.CACHE_KWARGS, "use_cache", "logits_to_keep", "streamer",
               "labels", "next_sequence_length")   # the last two: stock never forwards them


def _prompt_inputs(model, model_kwargs: dict, rows: int, width: int, strict: bool = True) -> dict:
    """The model inputs besides ids, mask and positions that stock's prefill forward would get: per-row
    sequence inputs (trimmed to the prompt's ``width`` columns, as stock slices them) and plain options.
    A tensor we cannot place per prompt is refused rather than dropped (it would change the tokens);
    ``strict=False`` leaves it out instead (for deciding the path only)."""
    inputs = {}
    for name, value in model_kwargs.items():
        if name in _OWN_KWARGS or value is None:
            continue
        if name in SEQUENCE_INPUTS and isinstance(value, torch.Tensor):
            if value.dim() < 2 or value.shape[0] != rows or value.shape[1] < width:
                raise ValueError(f"generate got {name} of shape {tuple(value.shape)}; it must have one row per "
                                 f"sequence ({rows}) and cover the prompt's {width} positions.")
            inputs[name] = value[:, value.shape[1] - width:]
        elif isinstance(value, (bool, int, float, str)):
            inputs[name] = value               # an option every forward gets, the prefill too
        elif strict:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise NotImplementedError(
                f"generate got the model input {name!r} ({shape}), which the cascade prefill cannot place per "
                f"prompt (it handles {', '.join(SEQUENCE_INPUTS)}, position_ids and attention_mask). Load the model "
                f"with attn_implementation='{stock_attention(model)}' to use it.")
    return inputs


# Where the paged cache starts to pay: prompt tokens that sharing saves per layer and step (each prompt's
# tokens x (sequences per prompt - 1), plus a batch's common prefix x (prompts - 1)). Below it, the cascade's
# per-step bookkeeping costs more than the reads it saves. Measured on 2 CPU threads (benchmarks/RESULTS.md,
# "no loss where nothing is shared"): cascade / stock 1.12-1.19 at 381 saved (4 beams or samples, prompt 128),
# 1.05 at 889 (8 beams, 128), <= 0.96 from 765 (4 x 256) up. Devices not listed: any sharing runs the cascade.
MIN_SHARED_TOKENS = {"cpu": 1024}


def stock_path_reason(model, cascade_config: CascadeConfig, generation_config, input_ids: torch.LongTensor,
                      mask: torch.Tensor | None, positions: torch.Tensor | None = None,
                      inputs: dict | None = None) -> str | None:
    """Why this generate call (without a CascadeCache of the caller's) runs on stock's own path — dense
    attention with transformers' default cache — or None to run the cascade. A call pays for the paged
    cache only where enough is shared: several sequences per prompt, or a prefix common to the batch,
    worth at least ``MIN_SHARED_TOKENS`` on the model's device — or where its decode steps will run as a
    graph (:mod:`hf_cascade.graphs`), which is faster than stock's even with nothing to share.
    ``input_ids``/``mask``/``positions``/``inputs`` are as generate expanded them (rows = prompts x n)."""
    if graphs.unsupported_reason(model, cascade_config) is None:
        return None       # a decode step replayed as a graph beats stock's even with nothing shared
    n = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    inputs = inputs or {}
    embeds = inputs.get("inputs_embeds")
    rows, width = (input_ids if embeds is None else embeds).shape[:2]
    prompts = rows // n
    stored = prompts * (width - 1) if mask is None else int(mask[::n, :-1].sum())   # prompt tokens prefilled
    sequence = {k: v[::n, :-1] for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    shared = _shareable_length(model, cascade_config.block_size,
                               input_ids[::n, :-1] if input_ids.shape[1] == width else None,
                               None if mask is None else mask[::n, :-1],
                               None if positions is None or positions.dim() != 2 else positions[::n, :-1], sequence)
    saved = (n - 1) * stored + shared * (prompts - 1)
    if saved == 0:
        return "one sequence per prompt and no prefix common to the batch: nothing to share"
    device = model.device.type
    threshold = MIN_SHARED_TOKENS.get(device, 0)
    if saved < threshold:
        return (f"sharing would save {saved} prompt-token reads per step, fewer than the {threshold} where the "
                f"paged cache pays on {device} (MIN_SHARED_TOKENS)")
    return None


def input_stock_reason(model, model_kwargs: dict, generation_config) -> str | None:
    """Why this call's inputs need stock's own path for stock's tokens (None: the cascade serves them).

    Padding that is not plain left padding (right padding, holes) is stored exactly (pads are never stored;
    positions come from the mask as stock's), except under a sliding window the call can exceed: stock counts
    the pad columns inside the window, the cascade only stored tokens. Cross-attention inputs
    (``encoder_hidden_states``: a decoder used alone) would be written into the decoder's own cache."""
    given = [k for k in ("encoder_hidden_states", "encoder_outputs") if model_kwargs.get(k) is not None]
    if given:     # WhisperForCausalLM takes encoder_outputs, the BART family's decoders encoder_hidden_states
        return (f"the decoder gets cross-attention inputs ({given[0]}), which the decoder-only cascade does not "
                "store; use the encoder-decoder model, whose cascade stores the cross K/V once per input")
    mask = model_kwargs.get("attention_mask")
    if mask is None or mask.dim() != 2 or not _has_sliding_window(model):
        return None
    window = _sliding_window(model)
    if window is not None and (generation_config.max_length or 0) <= window:
        return None
    if bool((mask[:, 1:] < mask[:, :-1]).any()):      # a pad after a real token: not left padding
        return (f"a batch that is not left-padded (right padding) on a model with a sliding window ({window}) that "
                "the call can exceed: stock counts the pad columns inside the window. Left-pad the batch "
                "(tokenizer.padding_side='left') to share its prompts")
    return None


def _log_stock_path(reason: str) -> None:
    log_once("stock path", logging.INFO, "generate runs on stock's dense path where %s; pass a CascadeCache to "
             "generate to run the cascade anyway (logged once).", reason)


def _mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """Each row's positions from its left-padded mask [B, L]: 0, 1, ... over its tokens, 0 on its pads."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def _prefill_chunk(model, generation_config, tensors: dict, tokens: int) -> int:
    """generate's ``prefill_chunk_size`` where the prefill of ``tokens`` positions runs in chunks of it (0: in one
    forward): models that take position ids (each chunk's are the prompt's own, from the mask), no sliding window,
    no ``inputs_embeds``."""
    chunk = getattr(generation_config, "prefill_chunk_size", None)
    if not chunk or tokens <= chunk or "inputs_embeds" in tensors or _has_sliding_window(model) \
            or not _accepts(model, "position_ids"):
        return 0
    return int(chunk)


def _prefill_in_chunks(model, cache, ids, mask, positions, key, end: int, chunk: int, tensors: dict,
                       options: dict) -> None:
    """Prefill prompt columns ``[0, end)`` of ``ids`` [B, L] ``chunk`` columns at a time (stock's
    ``prefill_chunk_size``: the activations of one chunk at a time): the first as a fresh prefill (tokens every
    prompt begins with stored once), each later one continuing the rows, with the prompt's own positions."""
    if positions is None:
        positions = (torch.arange(ids.shape[1], device=ids.device).expand_as(ids) if mask is None else
                     _mask_positions(mask))
    for start in range(0, end, chunk):
        part = slice(start, min(start + chunk, end))
        args = (None if mask is None else mask[:, part], positions[:, part], key)
        sliced = {k: v[:, part] for k, v in tensors.items()}
        run = prefill_prompts if start == 0 else prefill
        run(model, cache, ids[:, part], *args, run_hooks=False, **sliced, **options)


def _check_continuation(cache: CascadeCache, past: int, prompts: int, width: int) -> None:
    """What continuing from a filled CascadeCache needs (a chat's next turn)."""
    if getattr(cache, "_filled_by_beam_search", False):
        raise ValueError("This CascadeCache was filled by beam search: its rows are the running beams, not the "
                         "sequences generate returned, so it cannot be continued. Call cache.reset() (or pass a new "
                         "cache) and generate from the whole conversation.")
    if cache.batch_size != prompts:
        raise ValueError(f"The CascadeCache holds {cache.batch_size} rows (sequences of the previous call) but this "
                         f"call has {prompts} prompts; continuing needs one prompt per stored row, each the previous "
                         "sequence followed by its new tokens. Call cache.reset() or pass a new cache otherwise.")
    if width <= past:
        raise ValueError(f"The CascadeCache already holds {past} positions but the prompt has {width}: continuing "
                         "needs the previous sequences followed by at least one new token.")


def _serving_fused(generate):
    """Its forwards take the fused projections (:func:`hf_cascade.fused_linears.serving`); forwards outside generate
    stock's products. The signature stays ``generate``'s: transformers checks the keywords a custom generate takes."""
    @functools.wraps(generate)
    def serving(*args, **kwargs):
        try:
            with fused_linears.serving():
                return generate(*args, **kwargs)
        finally:
            fused_ops.call_ended()
    return serving


@_serving_fused
def cascade_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                     hf_cascade_streamer=None, hf_cascade_config: CascadeConfig | None = None, tokenizer=None,
                     **model_kwargs):
    """``generate(custom_generate=...)`` entry: one prefill per prompt, fork, then stock decoding.

    ``hf_cascade_streamer`` carries generate's ``streamer`` (transformers drops it for custom callables);
    ``hf_cascade_config`` sets the cache's :class:`CascadeConfig` when generate creates the cache;
    ``tokenizer`` is generate's own (the patch keeps it for generate's stop-string criteria; unused here).

    A call with nothing to share runs on stock's path (:func:`stock_path_reason`) unless the caller passed
    a CascadeCache. A CascadeCache that a previous greedy or sampling call returned is continued: its rows
    must be this call's prompts (each the previous sequence plus new tokens); only the new tokens are
    prefilled, and the rows fork to this call's beams or samples. A call that raises leaves the caller's
    CascadeCache empty.
    """
    _check_counts(generation_config)
    _check_no_dropout(model)
    given, hf_cascade_config = hf_cascade_config, CascadeConfig.coerce(hf_cascade_config)   # checked on every path
    mode = generation_config.get_generation_mode()
    if mode not in SUPPORTED_MODES:
        raise NotImplementedError(f"cascade generate supports greedy, sampling and beam search, not {mode.value}; "
                                  f"use attn_implementation='{stock_attention(model)}' for it.")
    if hf_cascade_streamer is not None:
        if mode in (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE):
            raise ValueError("`streamer` cannot be used with beam search (yet!). Make sure that `num_beams` is set to 1.")
        model_kwargs["streamer"] = hf_cascade_streamer
        hf_cascade_streamer.put(input_ids.cpu())
    beam = generation_config.num_beams > 1
    decode = GenerationMixin._beam_search if beam else GenerationMixin._sample
    key = compat.cache_key(model_kwargs)
    if getattr(model.config, "is_encoder_decoder", False):   # encoder-decoder: hf_cascade/seq2seq/encoder_decoder.py
        _fuse_model(model, hf_cascade_config)     # (it refuses a cache of the caller's: this is the call's config)
        states = model_kwargs.get("encoder_outputs")
        states = states[0] if states is not None and len(states) else None
        if isinstance(states, torch.Tensor) and states.dim() != 3:
            raise ValueError(f"the encoder output has shape {list(states.shape)}, not [batch, length, hidden size]: "
                             "generate takes input_ids of shape [batch, length] (or inputs_embeds [batch, length, "
                             "hidden size]).")
        return encoder_decoder.generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                        synced_gpus, decode, hf_cascade_config, key, **model_kwargs)
    existing = model_kwargs.get(key)
    explicit = isinstance(existing, CascadeCache)
    _check_inputs(model, input_ids, generation_config, model_kwargs)
    if explicit:
        if given is not None and hf_cascade_config != existing.cascade_config:
            raise ValueError("generate got both a CascadeCache and hf_cascade_config; the cache keeps the config it "
                             "was made with, so hf_cascade_config would be ignored. Make the cache with it "
                             "(CascadeCache(model.config, hf_cascade_config)) or pass only one of them.")
        hf_cascade_config = existing.cascade_config
    _fuse_model(model, hf_cascade_config)
    _warn_unused_compile(model, hf_cascade_config)
    capped = hf_cascade_config.max_kv_bytes is not None

    def stock():
        return decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                      synced_gpus=synced_gpus, **model_kwargs)

    def decode_loop(session):
        return whole_step.decode(session, input_ids, logits_processor, stopping_criteria, generation_config,
                                 model_kwargs, synced_gpus, stock)

    if explicit:
        return _run(model, existing, hf_cascade_config, input_ids, generation_config, model_kwargs, key, decode_loop)
    if existing is not None and generation_config.cache_implementation not in (None, "dynamic"):
        raise ValueError(f"cache_implementation={generation_config.cache_implementation!r} conflicts with "
                         "attn_implementation='cascade', which brings its own cache. Unset it, or use "
                         f"attn_implementation='{stock_attention(model)}'.")
    if not generation_config.use_cache:
        return stock()        # no cache: nothing is stored, so a max_kv_bytes cap holds; attention runs dense
    if _per_position_outputs(generation_config):
        if capped:
            raise ValueError(_uncapped("output_hidden_states/output_attentions (they run stock's dense cache, which "
                                       "stores every row's prompt)", "drop them"))
        logger.warning("output_hidden_states/output_attentions run with dense attention "
                       "(no prompt sharing).")
        return stock()
    if existing is not None and getattr(existing, "_is_user_defined", False):
        if capped:    # the user's own non-cascade cache: stock decoding; attention takes the dense path
            raise ValueError(_uncapped(f"a {type(existing).__name__} of yours", "pass a CascadeCache (or no cache)"))
        return stock()
    mask, positions = model_kwargs.get("attention_mask"), model_kwargs.get("position_ids")
    width = _prompt_width(input_ids, model_kwargs)
    inputs = _prompt_inputs(model, model_kwargs, input_ids.shape[0], width, strict=False)   # _cascade checks
    reason = input_stock_reason(model, model_kwargs, generation_config)
    if reason is not None:
        if capped:
            raise ValueError(_uncapped(f"this call, which runs on stock's dense path ({reason})",
                                       "change the input as that reason says"))
        logger.info("generate runs on stock's dense path: %s.", reason)
        return stock()
    # a capped call runs the cascade, whose pool enforces the cap (stock's cache would not), and an fp8 cache is ours
    # too (stock's would hold the model's dtype)
    ours = capped or hf_cascade_config.kv_dtype is not None
    reason = None if ours else stock_path_reason(model, hf_cascade_config, generation_config, input_ids, mask,
                                                 positions, inputs)
    if reason is not None:
        _log_stock_path(reason)
        return stock()
    return _run(model, None, hf_cascade_config, input_ids, generation_config, model_kwargs, key, decode_loop)


def _uncapped(what: str, fix: str) -> str:
    return (f"CascadeConfig.max_kv_bytes cannot be enforced for {what}: only a CascadeCache's pool is capped. "
            f"Unset max_kv_bytes, or {fix}.")


def _check_counts(generation_config) -> None:
    """What stock generate refuses only by crashing somewhere inside (num_beams=0: ZeroDivisionError; beam search
    with num_return_sequences=0) or lets through to a different decoding (num_beams=-2 would run greedy here; beam
    search with num_return_sequences=-1 returns rows of no prompt)."""
    beams = generation_config.num_beams
    if isinstance(beams, numbers.Real) and not isinstance(beams, bool) and beams < 1:
        raise ValueError(f"num_beams must be a positive integer (1: greedy search or sampling, > 1: beam search), got "
                         f"{beams!r}.")
    returned = generation_config.num_return_sequences
    if (isinstance(beams, numbers.Real) and beams > 1 and isinstance(returned, numbers.Real)
            and not isinstance(returned, bool) and returned < 1):
        # stock crashes inside its beam search (0) or returns rows that belong to no prompt (-1)
        raise ValueError(f"num_return_sequences must be a positive integer, at most num_beams ({beams}), got "
                         f"{returned!r}.")


def active_dropout(model) -> str | None:
    """The dropout that would be active in ``model``'s forward (None in eval mode, or where every rate is 0): a dropout
    module in training mode with p > 0, or a config rate the modeling file applies functionally (BART's ``dropout``)."""
    if not model.training:
        return None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.training and module.p > 0:
            return f"{name or type(model).__name__} (p={module.p})"
    for config in {id(c): c for c in (model.config, _text_config(model))}.values():
        for field, value in vars(config).items():
            if (("dropout" in field or "pdrop" in field) and "classifier" not in field
                    and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                return f"config.{field}={value}"
    return None


def _check_no_dropout(model) -> None:
    """A model in training mode with dropout active: stock's beams each draw their own dropout masks on their own copy
    of the prompt, the cascade's prefill runs each prompt once, so the tokens would differ. Refused with the fix."""
    dropout = active_dropout(model)
    if dropout is not None:
        raise ValueError(f"generate got a model in training mode with dropout active ({dropout}): the cascade prefills "
                         "each prompt once for all its beams, so its tokens would not be stock's. Call model.eval() "
                         "before generate (Trainer's evaluation does), or load the model with "
                         f"attn_implementation='{stock_attention(model)}' to generate with dropout.")


def _check_inputs(model, input_ids, generation_config, model_kwargs: dict) -> None:
    """Shapes generate's inputs must have for a decoder-only call, named before anything runs (a mismatch would
    otherwise fail inside the prefill, or run with the mask of other positions)."""
    embeds = model_kwargs.get("inputs_embeds")
    ids_name = "input_ids" if embeds is None else "inputs_embeds"
    reference = input_ids if embeds is None else embeds
    n = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    if input_ids.dim() != 2 or (embeds is not None and (embeds.dim() != 3 or embeds.shape[0] != input_ids.shape[0])):
        raise ValueError(f"generate got {ids_name} of shape {tuple(reference.shape)}; it takes input_ids of shape "
                         "[batch, prompt length] (or inputs_embeds [batch, prompt length, hidden size]).")
    rows, width = reference.shape[:2]

    def as_passed(t):       # a shape as the caller passed it, before generate expanded each prompt to n rows
        return [t.shape[0] // n if t.shape[0] % n == 0 else t.shape[0], *t.shape[1:]]

    expected = f"the {ids_name}' shape {as_passed(reference)[:2]}, one entry per prompt token"
    mask = model_kwargs.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"generate got attention_mask of type {type(mask).__name__}; it takes a tensor of "
                            f"{expected} (1 for tokens, 0 for left padding).")
        if mask.dim() < 2:
            raise ValueError(f"generate got attention_mask of shape {list(mask.shape)}; it must have {expected} "
                             "(1 for tokens, 0 for left padding), as the tokenizer returns it with the ids.")
        if mask.dim() > 2:
            raise NotImplementedError(
                f"generate got a {mask.dim()}D attention_mask; the cascade prefill takes a padding mask of {expected} "
                f"(1 for tokens, 0 for left padding). For a custom {mask.dim()}D mask, load the model with "
                f"attn_implementation='{stock_attention(model)}'.")
        if tuple(mask.shape) != (rows, width):
            raise ValueError(f"generate got attention_mask of shape {as_passed(mask)}; it must have {expected} "
                             "(1 for tokens, 0 for left padding), as the tokenizer returns it with the ids.")
    positions = model_kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() == 2 and tuple(positions.shape) != (rows, width):
        raise ValueError(f"generate got position_ids of shape {as_passed(positions)} (generate derives them from "
                         f"attention_mask where not given); attention_mask and position_ids must have {expected}.")


def _fuse_model(model, cascade_config: CascadeConfig) -> None:
    """``CascadeConfig.fuse_projections``: fuse the model's projections before anything is compiled or captured; a
    model whose fusion no longer holds (:func:`fused_linears.check` unfuses it) or is fused now drops the graphs
    kept for it, which point at the weights' old storage. ``CascadeConfig.fuse_elementwise`` likewise: a model whose
    call asks otherwise than its last drops the graphs captured with the other choice."""
    changed = fused_ops.configure(model, cascade_config.fuse_elementwise)
    if cascade_config.fuse_projections:
        held = fused_linears.check(model)
        changed = fused_linears.fuse(model) or not held or changed
    if changed:
        session.release(model)


def _warn_unused_compile(model, cascade_config: CascadeConfig) -> None:
    if not cascade_config.compile:
        return
    reason = graphs.unsupported_reason(model, cascade_config)
    if reason is not None:
        log_once(("compile unused", reason), logging.WARNING,
                 "CascadeConfig(compile=True) is ignored: it compiles the decode step replayed as a CUDA "
                 "graph, and decode steps run without graphs here (%s).", reason)


def _run(model, cache: CascadeCache | None, cascade_config: CascadeConfig, input_ids, generation_config,
         model_kwargs: dict, key: str, decode_loop):
    """Fill the cache (the caller's; None: one the call owns) with the prompts' new tokens, then
    ``decode_loop(session)`` (the whole step on the device, or transformers' loop with a captured graph where it can
    run), in one :class:`~hf_cascade.session.DecodeSession`."""
    strategy = PromptPrefill(model, input_ids, generation_config, model_kwargs, key)
    call = DecodeSession(model, strategy, generation_config, rows=input_ids.shape[0], prompt_width=input_ids.shape[1],
                         cascade_config=cascade_config, cache=cache, keep=cache is None,
                         hands_out=bool(generation_config.return_dict_in_generate))
    with call.running():
        return decode_loop(call)


class PromptPrefill:
    """The decoder-only :class:`~hf_cascade.session.DecodeStrategy`: each prompt's new tokens prefilled once into
    the session's cache, which is then forked to all rows (beams or samples)."""

    def __init__(self, model, input_ids, generation_config, model_kwargs: dict, key: str):
        self.model, self.input_ids, self.generation_config = model, input_ids, generation_config
        self.model_kwargs, self.key = model_kwargs, key

    def prepare(self, cache: CascadeCache) -> CascadeCache:
        _prefill_call(self.model, cache, self.input_ids, self.generation_config, self.model_kwargs, self.key)
        return cache

    def decoded(self, cache: CascadeCache) -> None:
        if self.generation_config.num_beams > 1:
            cache._filled_by_beam_search = True

    def release(self, ok: bool) -> None:
        pass                       # nothing besides the cache


def _per_position_outputs(generation_config) -> bool:
    # stock returns them for every prompt position, which a once-per-prompt prefill does not compute
    return bool(generation_config.return_dict_in_generate and (generation_config.output_hidden_states
                                                               or generation_config.output_attentions))


def _prompt_width(input_ids, model_kwargs) -> int:
    embeds = model_kwargs.get("inputs_embeds")
    return input_ids.shape[1] if embeds is None else embeds.shape[1]


def _prefill_call(model, cache: CascadeCache, input_ids, generation_config, model_kwargs: dict, key: str) -> None:
    """Check the call, prefill each prompt's new tokens once into ``cache`` and fork it to all rows."""
    if _per_position_outputs(generation_config):
        raise ValueError("output_hidden_states/output_attentions need every prompt position's outputs, which a "
                         "CascadeCache prefill does not keep; pass no cache (dense decoding) or use "
                         f"attn_implementation='{stock_attention(model)}'.")
    if not generation_config.use_cache:
        raise ValueError("generate got a CascadeCache and use_cache=False; pass no cache, or use_cache=True.")
    fingerprint = model_fingerprint(model)
    if cache.model_fingerprint is not None and cache.model_fingerprint != fingerprint:
        raise ValueError(f"This CascadeCache was used with another model ({cache.model_fingerprint}); this one is "
                         f"{fingerprint}. Call cache.reset() or pass a new CascadeCache.")
    rows = input_ids.shape[0]
    n = max(generation_config.num_beams, generation_config.num_return_sequences or 1)
    width = _prompt_width(input_ids, model_kwargs)
    mask, positions = model_kwargs.get("attention_mask"), model_kwargs.get("position_ids")
    reason = input_stock_reason(model, model_kwargs, generation_config)
    if reason is not None:
        raise ValueError(f"This call cannot run on a CascadeCache: {reason}. Pass no cache (generate then runs it on "
                         "stock's path, with stock's tokens), or change the input as said.")
    inputs = _prompt_inputs(model, model_kwargs, rows, width)
    past = cache.get_seq_length()
    if past:
        _check_continuation(cache, past, rows // n, width)
    if positions is not None and positions.dim() != 2:
        raise NotImplementedError(f"position_ids of shape {tuple(positions.shape)} (several position axes) are not "
                                  "supported by the cascade prefill; load the model with "
                                  f"attn_implementation='{stock_attention(model)}'.")
    last_is_pad = None
    if mask is not None and not bool(mask[:, -1].all()):
        # an empty prompt, or right padding (stock feeds the pad and generates after it): the pad is not stored
        last_is_pad = mask[:, -1] == 0
    cache.model_fingerprint = fingerprint
    model_kwargs[key] = cache
    cache._filled_by_beam_search = False
    new = slice(past, width - 1)          # the prompt positions this call prefills (generate feeds the last)
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    options = {k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)}
    chunk = 0 if past else _prefill_chunk(model, generation_config, tensors, width - 1)
    if chunk:
        _prefill_in_chunks(model, cache, input_ids[::n], None if mask is None else mask[::n],
                           None if positions is None else positions[::n], key, width - 1, chunk,
                           {k: v[::n] for k, v in tensors.items()}, options)
    elif width - past > 1:
        ids = None if "inputs_embeds" in tensors and input_ids.shape[1] != width else input_ids[::n, new]
        args = (None if mask is None else mask[::n, new], None if positions is None else positions[::n, new], key)
        sliced = {k: v[::n, new] for k, v in tensors.items()}
        if past:
            prefill(model, cache, ids, *args, run_hooks=False, **sliced, **options)
        else:
            prefill_prompts(model, cache, ids, *args, run_hooks=False, **sliced, **options)
    if cache.batch_size:
        cache.batch_repeat_interleave(n)
    if last_is_pad is not None:
        cache.set_write_mask(~last_is_pad[:, None])   # an empty prompt's last (pad) token is not stored either
