"""Encoder-decoder models (T5, BART/mBART/PLBart, Pegasus, Blenderbot, Marian, M2M100/NLLB, Whisper) on the cascade
path: the generate entry, and the attention of a cross-attention call.

Stock ``generate(num_beams=k)`` copies the encoder output k times, projects every decoder layer's
cross-attention K/V from the k copies and copies that K/V again at every beam reorder. Here:

- the encoder output is not expanded (``encoder_expansion``: ``patches`` hands us the B unexpanded rows; the
  decoder sees a zero-stride placeholder of the expanded shape, which nothing reads);
- ``cross_kv.CrossAttentionCache`` projects each decoder layer's cross K/V once per input, with the
  layer's own linears, storing only the input's real (unpadded) encoder tokens; its reorder is a no-op;
- every cross-attention call runs as a cascade with one level (:mod:`hf_cascade.cross_attention`): the group of an
  input's beams reads that input's encoder blocks once, through the same ``backend.forward(q, pool, metadata,
  params)`` as the decoder-only path (a :class:`~hf_cascade.plan.StepPlan` with groups = inputs and an empty
  suffix); on the CPU with backend="auto", one sdpa per input (its beams stacked on the query axis) reads the
  input's K/V in place instead (the PyTorch backend would gather a copy of it every layer and step);
- decoder self-attention runs on a :class:`~hf_cascade.cache.CascadeCache` as for decoder-only
  models (a shared decoder prompt, e.g. Whisper's start tokens and ``prompt_ids``, is prefilled
  once) — ``seq2seq_models.paged_self_attention`` says where it stays dense (T5's relative position bias;
  one-token decoder prompts on the CPU): there on ``dense_cache``'s caches; for the T5 family where the decode steps
  run on the graph runner, on ``dense_cache.StaticSelfAttentionCache`` (a fixed room, device length and mask);
- the decode steps' decoder positions are an input of the step (what a replayed graph needs): Whisper's
  decoder_position_ids as stock's generate builds them; for the BART family, which computes them from the cache
  length on the host, decoder_position_ids of stock's values that ``hf_cascade.patches.positions`` makes the
  decoder read (``EncoderSide._positions_as_input``);
- what differs per model_type comes from its adapter (``seq2seq_models.family_of``);
- the decode loop is :func:`hf_cascade.whole_step.decode`'s, as for decoder-only models: the whole step on the
  device where it can serve the call, else transformers' loop with the graph runner (the reason logged once);
- a call whose shape (``EncoderSide.keep_key`` and the session's
  descriptor) equals the model's last call's, and whose sources the kept cross storages take (``EncoderSide.fits``:
  as long or shorter, within ``plan.ADOPT_SPAN``), takes that call's caches, cross-attention context and runner
  (:class:`KeptCross` beside :class:`~hf_cascade.session.KeptCall`): its K/V are written into the same memory, its
  cross plans' tables and lengths into their device tensors, and the kept decode step replays from the first decode
  step; any difference starts afresh (with cross storages at least as large where its sources outgrew the kept
  ones: an evaluation loop's kept state comes to serve all its batches).

The model's cross-attention modules read ``cache.cross_attention_cache.layers[i].keys/.values``
directly and pass them to the attention function: those tensors are placeholders; the decoder's forwards carry a
:class:`~hf_cascade.cross_attention.CrossContext` by which the attention finds the layer
(:mod:`hf_cascade.cross_attention`).
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from transformers.cache_utils import EncoderDecoderCache

from .. import compat
from . import cross_attention
from ..decode import graphs, whole_step
from ..kv.blocks import PoolExhausted
from ..kv.cache import CascadeCache
from ..config import CascadeConfig
from ..logs import log_once
from .cross_kv import (CascadeEncoderDecoderCache, CrossAttentionCache, KVCap, KVCapExceeded, geometry,
                       real_lengths, repeated_inputs)
from .dense_cache import (StaticSelfAttentionCache, capped_dynamic_cache, self_attention_cache,
                          static_self_attention_cache)
from .encoder_expansion import placeholder, restore_expansion, unexpanded_states
# unsupported_reason and COMPOSITE: also generation's checks before it calls this entry
from .seq2seq_models import (COMPOSITE, DEVICE_POSITIONS_KWARG, SUPPORTED, cross_projections, device_positions_reason,
                             family_of, paged_self_attention, static_mask_reason, unsupported_reason)
from ..decode.session import DecodeSession, prefill_forward

logger = logging.getLogger("hf_cascade")

# ---- the generate entry -----------------------------------------------------------------------------
def _dense(decode, model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
           model_kwargs, cascade_config: CascadeConfig, key: str):
    """Stock dense decoding (stock's expanded encoder output restored); ``max_kv_bytes`` holds on its caches too
    (stock's EncoderDecoderCache with the growth of both halves counted against it)."""
    if model_kwargs.get("encoder_outputs") is not None:
        restore_expansion(model_kwargs["encoder_outputs"])
    cap = cascade_config.max_kv_bytes
    if cap is not None and generation_config.use_cache:
        existing = model_kwargs.get(key)
        if existing is not None and getattr(existing, "_is_user_defined", False):
            raise ValueError(f"CascadeConfig.max_kv_bytes={cap} cannot be held on a cache of the caller's "
                             f"({type(existing).__name__}), which this call decodes into as stock does; pass no "
                             "cache, or leave max_kv_bytes unset.")
        kv_cap = KVCap(cap)
        model_kwargs[key] = EncoderDecoderCache(
            capped_dynamic_cache(kv_cap, "the decoder's self-attention K/V (stock's dense cache, every beam)"),
            capped_dynamic_cache(kv_cap, "the cross-attention K/V (stock's dense cache: every beam's copy)"))
    return decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                  synced_gpus=synced_gpus, **model_kwargs)


def _log_composite(model) -> None:
    log_once("composite", logging.INFO, "%s runs generate on stock's dense path (the cascade's encoder-decoder path "
             "serves %s, not a pairing of any encoder and decoder); load its decoder alone for the decoder-only "
             "cascade (logged once).", type(model).__name__, ", ".join(sorted(SUPPORTED)))


def _without_cache(result):
    """generate's output without the cache (ours is released; ModelOutput cannot delete a field)."""
    names = compat.CACHE_KWARGS
    if not hasattr(result, "keys") or not any(name in result.keys() for name in names):
        return result
    return type(result)(**{k: v for k, v in result.items() if k not in names})


def generate(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, decode,
             cascade_config: CascadeConfig | dict | None, key: str, **model_kwargs):
    """:func:`hf_cascade.generation.cascade_generate` for encoder-decoder models (see the module docstring)."""
    cascade_config = CascadeConfig.coerce(cascade_config)      # a dict too; every field checked
    existing = model_kwargs.get(key)
    if generation_config.cache_implementation not in (None, "dynamic"):
        raise ValueError(f"cache_implementation={generation_config.cache_implementation!r} conflicts with "
                         "attn_implementation='cascade', which brings its own cache. Unset it, or use sdpa.")
    if isinstance(existing, (CascadeCache, CascadeEncoderDecoderCache)):
        raise ValueError("A cache passed to generate of an encoder-decoder model is not supported by the cascade "
                         "path (Whisper reuses it across segments); pass no cache.")
    dense = (decode, model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
             model_kwargs, cascade_config, key)
    if model.config.model_type in COMPOSITE:
        _log_composite(model)
        return _dense(*dense)
    if generation_config.return_dict_in_generate and (generation_config.output_hidden_states
                                                      or generation_config.output_attentions):
        logger.warning("output_hidden_states/output_attentions run with dense attention "
                       "(encoder output expanded per beam, as stock).")
        return _dense(*dense)
    if not generation_config.use_cache or (existing is not None and getattr(existing, "_is_user_defined", False)):
        return _dense(*dense)
    encoder_outputs = model_kwargs.get("encoder_outputs")
    if encoder_outputs is None:
        raise ValueError("generate of an encoder-decoder model reached the cascade entry without encoder_outputs.")
    n = max(generation_config.num_beams, generation_config.num_return_sequences or 1)
    rows = input_ids.shape[0]
    states = unexpanded_states(encoder_outputs, n)
    if states.shape[0] * n != rows:
        raise ValueError(f"{states.shape[0]} encoder rows do not match {rows} decoder rows / {n} per input.")
    mask = model_kwargs.get("attention_mask")
    source_mask = None if mask is None or not family_of(model).masked_cross_attention else mask[::n]
    if source_mask is not None and source_mask.shape != states.shape[:2]:
        raise ValueError(f"attention_mask {tuple(source_mask.shape)} does not match the encoder output "
                         f"{tuple(states.shape[:2])}; use attn_implementation='sdpa' for this model.")
    decoder_mask = model_kwargs.get("decoder_attention_mask")
    if decoder_mask is not None and tuple(decoder_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"decoder_attention_mask {tuple(decoder_mask.shape)} must match the decoder prompt "
                         f"{tuple(input_ids.shape)} (one row per beam or returned sequence).")

    projections = cross_projections(model)
    cap = None if cascade_config.max_kv_bytes is None else KVCap(cascade_config.max_kv_bytes)
    side = EncoderSide(model, input_ids, generation_config, model_kwargs, key, cascade_config, cap, projections, states,
                       source_mask, decoder_mask, n, keep=True)
    # kept for the model's next call of the same shape, which refills the K/V in place (0.88x a call's time on the
    # H200: benchmarks/seq2seq_keep_gpu.py)
    call = DecodeSession(model, side, generation_config, rows=rows, prompt_width=input_ids.shape[1],
                         cascade_config=cascade_config, keep=side.keep_key is not None)

    def stock():            # transformers' loop (model_kwargs as the session's prepare left them)
        return decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                      synced_gpus=synced_gpus, **model_kwargs)

    try:
        with call.running():
            result = whole_step.decode(call, input_ids, logits_processor, stopping_criteria, generation_config,
                                       model_kwargs, synced_gpus, stock)
        return _without_cache(result)
    except PoolExhausted as err:
        if cap is None or not side.paged or isinstance(err, KVCapExceeded):
            raise
        raise PoolExhausted(f"{err} (Of CascadeConfig.max_kv_bytes={cap.cap}, the cross-attention K/V of this call "
                            f"take {side.cross.kv_bytes} bytes; the decoder's paged self-attention cache gets the "
                            "rest.)") from err


class EncoderSide:
    """The encoder-decoder :class:`~hf_cascade.session.DecodeStrategy`: the cross-attention K/V stored once per
    input, the decoder's self-attention cache (paged, or dense where :func:`paged_self_attention` says so: static
    where :func:`_static_self_attention` says so), the decoder prompt prefilled once per input, placeholder encoder
    outputs of stock's shape; all given back at the end of the call (nobody else can reach these caches)."""

    def __init__(self, model, input_ids, generation_config, model_kwargs: dict, key: str,
                 cascade_config: CascadeConfig, cap: KVCap | None, projections: list, states, source_mask,
                 decoder_mask, n: int, keep: bool = False):
        self.model, self.input_ids, self.generation_config = model, input_ids, generation_config
        self.model_kwargs, self.key, self.cascade_config, self.cap = model_kwargs, key, cascade_config, cap
        self.projections, self.states, self.source_mask, self.decoder_mask, self.n = (
            projections, states, source_mask, decoder_mask, n)
        self.cross = CrossAttentionCache(len(projections), cascade_config)
        self.paged = paged_self_attention(model, input_ids, states.device, cascade_config, decoder_mask)
        self.static = not self.paged and _static_self_attention(model, cascade_config)
        self.self_cache = None
        self.repeats = repeated_inputs(states, source_mask)     # rows of one input, n each, then the next input's
        self.keep_key = self._keep_key() if keep else None
        self.lengths = (real_lengths(states[::self.repeats], None if source_mask is None else
                                     source_mask[::self.repeats]) if self.keep_key is not None else None)
        self._reused: KeptCross | None = None       # the model's last call's state, refilled by prepare
        self._room = (0, 0)                          # the cross storages' least capacity (fits)
        self._handed_over = False                   # kept_state() gave the caches to the session

    def _keep_key(self):
        """What this call's kept state must match for the next call to reuse it (the session's KeptCall keys the
        rest: rows, dtype, device, CascadeConfig): the stored inputs' geometry (how many, dtype, device: the sources'
        lengths need only fit, :meth:`fits`), the decoder prompt's width and padding, each layer's projection. None
        where nothing is kept: the T5 family's dense self-attention (its static cache is not kept). Under
        ``max_kv_bytes`` a kept state that serves a call holds the bytes that passed the check of the call it was
        made for (the same cap: the descriptor's CascadeConfig)."""
        if not self.paged:
            return None
        r = self.repeats
        return (geometry(self.states[::r]), r, self.n, self.input_ids.shape[1], self.decoder_mask is None,
                tuple((p.width, p.head_dim, str(p.device), p.key.weight.dtype) for p in self.projections))

    def fits(self, kept: "KeptCross") -> bool:
        """Whether ``kept`` (of this call's keep_key) serves this call's sources in place
        (:meth:`CrossAttentionCache.serves`: as long or shorter, within ``plan.ADOPT_SPAN``). Where they outgrow it,
        this call's storages are made at least as large (:meth:`CrossAttentionCache.room_for`), so that the state
        kept over an evaluation loop's batches comes to serve them all."""
        if kept.cross.serves(self.lengths):
            return True
        # (not under max_kv_bytes: room this call does not need would come out of its decoder cache's share)
        self._room = kept.cross.room_for(self.lengths) if self.cap is None else (0, 0)
        return False

    def reuse(self, kept: "KeptCross") -> None:
        """The model's last call's caches and cross-attention context (its keep_key was this call's, and it
        :meth:`fits`): refilled with this call's K/V and lengths by :meth:`prepare`, at the addresses the kept graph
        reads."""
        self._reused = kept
        self.cross = kept.cross

    def kept_state(self) -> "KeptCross | None":
        """At the end of a successful call: the caches and context to keep beside the session's cache and runner."""
        if self.keep_key is None or self.self_cache is None:
            return None
        both = self.model_kwargs.get(self.key)
        context = self.model_kwargs.get(cross_attention.CROSS_KWARG)
        if not isinstance(both, CascadeEncoderDecoderCache) or context is None or context.cache is not both:
            return None
        self._handed_over = True
        return KeptCross(self.cross, both, context)

    def prepare(self, cache: CascadeCache | None) -> CascadeCache | StaticSelfAttentionCache | None:
        """``cache``: None (this strategy makes the caches), or the kept self-attention cache of :meth:`reuse`."""
        model, input_ids, model_kwargs, n = self.model, self.input_ids, self.model_kwargs, self.n
        states, source_mask, decoder_mask, cap, cross = self.states, self.source_mask, self.decoder_mask, self.cap, \
            self.cross
        padded = decoder_mask is not None and not bool(decoder_mask.all())
        if cap is not None:
            cap.caches.append(cross)
        repeats, kept = self.repeats, self._reused
        if kept is not None and (cache is None or kept.both.self_attention_cache is not cache):
            raise RuntimeError("hf_cascade internal error: a kept encoder-decoder state without its own "
                               "self-attention cache; please report it")
        stored = states[::repeats], None if source_mask is None else source_mask[::repeats]
        if kept is not None:     # (the bytes of the last call's, whose max_kv_bytes check they passed)
            cross.refill(self.projections, *stored)
            kept.context.refilled()
        else:
            cross.fill(self.projections, *stored, cap, self._room)
        if kept is not None:        # the same objects the kept step was captured on (the runner keys them by identity)
            self.self_cache = self_cache = cache
            both = kept.both
            model_kwargs[self.key] = both
            model_kwargs[cross_attention.CROSS_KWARG] = kept.context
        else:
            self.self_cache = self_cache = self._self_cache(input_ids.shape[0])
            both = CascadeEncoderDecoderCache(self_cache, cross)
            model_kwargs[self.key] = both
            model_kwargs.update(cross_attention.forward_kwargs(both))
        # the decoder never reads the encoder states (is_updated is set): a placeholder of stock's shape
        encoder_outputs = model_kwargs["encoder_outputs"]
        if getattr(encoder_outputs, "hf_cascade_unexpanded", None) is None:   # not expanded (n = 1): a copy
            model_kwargs["encoder_outputs"] = encoder_outputs = type(encoder_outputs)(**encoder_outputs)
            encoder_outputs.hf_cascade_unexpanded = {"last_hidden_state": states}
            encoder_outputs.hf_cascade_expand_size = n
            encoder_outputs["last_hidden_state"] = placeholder(states, input_ids.shape[0])
        if self.static:
            return self_cache    # the decoder prompt in the first forward; then static steps on the graph runner
        if not self.paged:
            return None          # the decode steps run on a dense cache: no layout, no runner
        if input_ids.shape[1] > 1:
            # the decoder prompt (Whisper's start tokens, a prompt) is the same for an input's beams: once
            _prefill_decoder_prompt(model, both, input_ids[::n, :-1], None if not padded else decoder_mask[::n, :-1],
                                    states, source_mask, self.key)
            self_cache.batch_repeat_interleave(n)
            if decoder_mask is None:   # with a mask, generate's first step feeds only the tokens past the cache
                model_kwargs["decoder_attention_mask"] = input_ids.new_ones(input_ids.shape)
        if padded and not bool(decoder_mask[:, -1].all()):
            self_cache.set_write_mask(decoder_mask[:, -1:])   # a last pad is not stored either
        self._positions_as_input()
        return self_cache       # the decode steps on a static layout, as a captured graph where one can run

    def _self_cache(self, rows: int):
        """The decoder's self-attention cache: paged, static dense, or dense (see the class docstring)."""
        if self.paged:
            return _paged_self_cache(self.model, self.cascade_config, self.cap)
        if self.static:
            return static_self_attention_cache(rows, len(self.projections), self.generation_config,
                                               self.cascade_config, self.decoder_mask, self.cap)
        return self_attention_cache(self.states.device, self.generation_config, self.cap)

    def _positions_as_input(self) -> None:
        """A decoder that computes its positions from the cache length on the host (the BART family) gets them as
        a step input where ``hf_cascade.patches.positions`` serves it: decoder_position_ids of stock's values (the
        cache length, pads included; generate advances them on the device every step) and the keyword that makes
        the patched decoder read them, so that its decode steps can be replayed. Not where no runner would replay
        them, nor over a caller's own decoder_position_ids (the runner then says why its steps run eagerly)."""
        model, model_kwargs, width = self.model, self.model_kwargs, self.input_ids.shape[1]
        if family_of(model).positions_from_decoder_mask or "decoder_position_ids" in model_kwargs \
                or graphs.runner_reason(model, self.cascade_config) is not None:
            return
        reason = device_positions_reason(model, self.generation_config.max_length or width + 1)
        if reason is not None:
            log_once(("positions", reason), logging.INFO, "decode steps run without CUDA graphs: %s", reason)
            return
        model_kwargs["decoder_position_ids"] = torch.arange(width, device=self.input_ids.device).unsqueeze(0)
        model_kwargs[DEVICE_POSITIONS_KWARG] = True

    def decoded(self, cache) -> None:
        pass

    def release(self, ok: bool) -> None:
        if self._handed_over:
            return               # kept for the model's next call (the session's KeptCall releases them)
        if self.self_cache is not None:
            self.self_cache.reset()
        self.cross.reset()
        if self._reused is not None:
            self._reused.context.steps.clear()


@dataclasses.dataclass
class KeptCross:
    """What an encoder-decoder call keeps for the model's next call besides the decoder's cache and the runner
    (:class:`~hf_cascade.session.KeptCall`): the cross-attention storages (refilled in place, also with shorter
    sources), the EncoderDecoderCache pairing them with the decoder's cache, and the cross-attention context whose
    step contexts (plans, rewritten in place; backend metadata, which follows the plans' widths) the kept graph reads.
    Holds nothing of the model."""

    cross: CrossAttentionCache
    both: CascadeEncoderDecoderCache
    context: "cross_attention.CrossContext"

    def release(self) -> None:
        self.cross.reset()
        self.context.steps.clear()


def _static_self_attention(model, config: CascadeConfig) -> bool:
    """Whether a relative-bias family's decoder self-attention runs on ``dense_cache.StaticSelfAttentionCache``: where
    the decode steps run on the graph runner and ``hf_cascade.patches.t5_mask`` serves the decoder stack (else the
    dense cache, every step eager, the reason logged once). Not where the steps cannot be captured (the CPU): the
    static buffers hold ``max_length`` from the first step, the dense cache grows with the tokens as stock's does."""
    if not family_of(model).relative_bias or graphs.unsupported_reason(model, config) is not None:
        return False
    reason = static_mask_reason(model)
    if reason is not None:
        log_once(("static mask", reason), logging.INFO, "decode steps run without CUDA graphs: %s", reason)
        return False
    return True


def _paged_self_cache(model, config: CascadeConfig, cap: KVCap | None) -> CascadeCache:
    """The decoder's paged self-attention CascadeCache; under max_kv_bytes, capped at what the cross K/V leave."""
    if cap is None:
        return CascadeCache(model.config, config)
    left = cap.cap - cap.held()
    try:
        return CascadeCache(model.config, dataclasses.replace(config, max_kv_bytes=max(left, 1)))
    except ValueError as err:        # less than one block left for the self-attention
        raise KVCapExceeded(f"CascadeConfig.max_kv_bytes={cap.cap} would be exceeded: the cross-attention K/V of "
                            f"this call take {cap.held()} bytes, leaving {left}, less than one block of the "
                            "decoder's self-attention. Raise max_kv_bytes, or lower the number or length of the "
                            "inputs.") from err


def _prefill_decoder_prompt(model, cache, ids: torch.Tensor, mask: torch.Tensor | None, states, source_mask,
                            key: str) -> None:
    """The decoder prompt's tokens but the last, once per input, into the paged self-attention cache; pad tokens
    (``mask`` zeros) are not stored. Positions as stock's: Whisper's from the decoder mask (its
    prepare_inputs_for_generation), the other families' from the cache length (pads count)."""
    extra = {}
    if mask is not None:
        cache.self_attention_cache.set_write_mask(mask)
        extra["decoder_attention_mask"] = mask
        positions = family_of(model).decoder_position_ids(mask)
        if positions is not None:
            extra["decoder_position_ids"] = positions
    with torch.no_grad():
        prefill_forward(model, decoder_input_ids=ids, encoder_outputs=(placeholder(states, ids.shape[0]),),
                        attention_mask=source_mask, use_cache=True, **extra, **{key: cache},
                        **cross_attention.forward_kwargs(cache))
