"""Generate's decode loop with the whole step on the device: block bookkeeping, forward and token choice.

Where a call chooses its tokens in a way :mod:`hf_cascade.device_select` reproduces (greedy, sampling and beam
search with the processors and criteria transformers uses by default and the common ones, the seq2seq checkpoints'
forced BOS/EOS, bad words and suppressed tokens; see :func:`decode`), the session runs :func:`decode` instead of
transformers' ``_sample`` / ``_beam_search``. Encoder-decoder models too: where their decoder's self-attention is
paged and its positions are a step input (the BART family through ``hf_cascade.patches.positions``, Whisper from its
decoder mask), the decoder's ids and positions are advanced like a decoder-only model's; the T5 family (relative
position bias) decodes on ``dense_cache.StaticSelfAttentionCache``, whose device position is the decoder's position.
The encoder side (the cross-attention K/V stored once per input, the placeholder encoder outputs) is fixed for the
call. One step:

1. the cache's bookkeeping, by the :class:`DeviceHold` of its kind: for a paged cache (:class:`BlocksHold`,
   :mod:`hf_cascade.device_blocks`) the beam reorder by the last step's parents, one token appended per row
   (copy-on-write of a shared, partly filled block), the step's suffix tables, write slots and copies written into the
   static decode layout's plan buffers (uncompiled on a GPU, where :data:`blocks_kernel` is on: one launch of
   ``csrc/blocks.cu``, the same values); for a dense one (``dense_cache.DenseHold``) the write position moved on,
   the beam reorder of its gather table and the step's mask;
2. the forward on that plan (the runner's forward: the model's own, or the compiled one);
3. token choice (:mod:`hf_cascade.device_select`) and the next step's inputs (ids, positions) written in place.

Where the call's token choice is not one device_select reproduces (a processor or stopping criterion of the user's
own, a streamer, ``return_dict_in_generate``), the chooser is :class:`hf_cascade.host_select.HostChooser` instead: the
step is 1 and 2, and after each step the host runs transformers' own per-step choice on its logits, writes the next
step's ids, positions and parents into the step's inputs, and reads once whether the call finished.

With ``CascadeConfig(compile=True)`` each of the three is also one compiled graph (the token choice of a sampling
call stays eager: its generator). On CUDA the three are captured as one graph per decode layout and replayed
(``cuda_graphs="eager"``: the same step runs eagerly, on any device). The host replays and reads two scalars every
:data:`CHECK_EVERY` steps (has the call finished? did a step overflow?); it does no block bookkeeping and never waits
on the device in between.

The first step of a layout runs on the host path: for a paged cache the block manager's append and
``DecodeLayout.step``, the host beam reorder and the eager forward, which builds the kernel backends' layout metadata
that a capture needs (for a dense one the decoder prompt's forward, or a static step run eagerly). The device then
holds the cache's state (``DeviceHold``) while the layout has room; when its room is used up the host takes the state
back and the next host step widens the layout. Steps queued after the call finished change nothing that is read again
(a paged cache's writes go to a scratch block, a dense cache's to positions past the end; the selection state stays):
at most ``CHECK_EVERY - 1`` forwards are wasted at the end.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Protocol

import numpy as np
import torch

from . import device_blocks, device_select, graphs, host_select
from ..seq2seq import seq2seq_models
from ..kernels import cuda_library
from ..kv.blocks import PoolExhausted
from ..kv.plan import ADOPT_SPAN, shape_bucket
from ..logs import log_once

logger = logging.getLogger("hf_cascade")

# steps between two host reads of the finished and overflow flags: each read waits for the device to drain, and up
# to CHECK_EVERY - 1 steps after the end are wasted (benchmarks/generate_gpu.py --whole-step measures the choice)
CHECK_EVERY = 8

# steps a device hold takes at most where steps cannot be captured (WholeStepLoop.frugal): each hold begins with a host
# step, which costs an eager step no more on the CPU
EAGER_ROOM = 4 * CHECK_EVERY

# the uncompiled step's block bookkeeping in one launch of the kernel library's csrc/blocks.cu where it runs (bit for
# bit the torch ops of `advance`, ~80 launches: tests/decode/test_gpu_device_blocks.py on the H200; 11-57 us a step
# against 250-300 us of the torch ops, benchmarks/blocks_advance_gpu.py). False: the torch ops everywhere
blocks_kernel = True

# the uncompiled step's token-choice bookkeeping on the kernel library's csrc/select.cu where it runs (bit for bit the
# torch ops of device_select around its vocabulary-sized ops and top-k's: one launch for greedy and sampling instead of
# ~30 torch kernels, two for beam search instead of ~75; tests/decode/test_select_emulation.py on the CPU). Its GPU
# tests passed on an H100 (2026-12-05, tests/decode/test_gpu_whole_step.py -k select); with the kernels below, 8B 16k x
# 8 beams' replayed step 8.05 -> 7.79 ms, 1B 2.29 -> 2.06 ms (whole_step_parts_gpu.py). False: the torch ops everywhere
select_kernel = True

# with select_kernel: beam search's top-k's ranked as torch.topk ranks them on CUDA (its radix selection, index-ordered
# gather and 32-slot bitonic sort, ties included): the candidates over beams x vocabulary in two launches
# (csrc/select.cu topk_chunks / topk_final) instead of torch's ~6 (~90 us at 8 x 128k in the 8B beam step's profile),
# and the two small ones inside the first select launch (choose_beams) instead of torch's 4. Its GPU tests passed on an
# H100 (tests/decode/test_gpu_whole_step.py -k topk: against torch.topk itself on tied scores). False: torch
select_topk = True

# an encoder-decoder model's decode forward names its decoder inputs so (the encoder outputs, an object fixed for the
# call that the decoder does not read once the cross-attention K/V are stored, are passed through as they are)
_DECODER = {"input_ids": "decoder_input_ids", "position_ids": "decoder_position_ids",
            "inputs_embeds": "decoder_inputs_embeds"}


class _Names:
    """The decode step's input names: the decoder-only ones, or an encoder-decoder model's ``decoder_*`` (its encoder
    outputs and cross K/V are fixed for the call: objects the step passes through as they are)."""

    def __init__(self, model):
        self.encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
        rename = _DECODER if self.encoder_decoder else {}
        self.ids, self.positions, self.embeds = (rename.get(name, name) for name in (
            "input_ids", "position_ids", "inputs_embeds"))
        self.mask = "decoder_attention_mask" if self.encoder_decoder else "attention_mask"
        self.advanced = (self.ids, self.positions, "cache_position")      # the inputs a step advances on the device
        # not inputs of a static step (the graph runner leaves them out too): its attention reads each row's stored
        # tokens (pads are never stored) and takes positions from the position ids; an encoder-decoder's
        # cross-attention reads each input's stored (unpadded) K/V
        self.dropped = ("attention_mask", "decoder_attention_mask") if self.encoder_decoder else ("attention_mask",)


def refusal(session, generation_config, model_kwargs, synced_gpus: bool) -> str | None:
    """Why this call's settings keep transformers' decode loop (None: the loop serves it, with the token choice on
    the device or on the host, see :func:`decode`). Runs before any step."""
    model, cache = session.model, session.cache
    blocks = getattr(cache, "blocks", None)
    if blocks is not None and cache.cascade_config.max_kv_bytes is not None and blocks.max_blocks is None:
        return "CascadeConfig.max_kv_bytes without a block cap on the cache's block manager"
    if synced_gpus:
        return "synced_gpus"
    if generation_config.num_beams > 1 and generation_config.low_memory:
        return "low_memory (transformers' beam search refuses it)"
    names = _Names(model)
    if model_kwargs.get(names.embeds) is not None:
        return names.embeds
    return None


def _selection_config(input_ids, logits_processor, stopping_criteria, generation_config, attention_mask=None):
    """``(config, None)``: the call's token choice as device_select reproduces it; ``(None, reason)`` where it does
    not."""
    per_prompt = generation_config.num_beams if generation_config.num_beams > 1 else (
        generation_config.num_return_sequences or 1)
    try:
        config = device_select.SelectionConfig.from_generation_config(
            generation_config, input_ids.shape[0] // per_prompt, input_ids.shape[1])
        config = config.adopting_suppressions(logits_processor)
        config.check_against(logits_processor, stopping_criteria, attention_mask)
        ngrams = _encoder_ngrams(logits_processor)
        if config.encoder_no_repeat_ngram_size and len(ngrams) != config.batch_size:
            return None, (f"EncoderNoRepeatNGramLogitsProcessor holds {len(ngrams)} encoder inputs' n-grams for "
                          f"{config.batch_size} prompts")
    except device_select.UnsupportedSelection as err:
        return None, str(err).replace("device selection off: ", "")
    return config, None


def host_choice_reason(generation_config, model_kwargs) -> str | None:
    """Why this call's token choice runs on the host whatever its processors (None: :func:`_selection_config`
    decides)."""
    if generation_config.return_dict_in_generate:
        return "return_dict_in_generate (scores, logits and beam indices are kept on the host)"
    if model_kwargs.get("streamer") is not None:
        return "a streamer (it takes every token as it is chosen)"
    return None


@dataclasses.dataclass(frozen=True)
class DecodeMode:
    """How one call's decode steps run: decided once, before the first step (:func:`decode`), and logged once per
    mode. ``loop``: ``"whole step"`` (this module's loop, on the session's step runner) or ``"transformers' loop"``
    (its ``_sample`` / ``_beam_search`` with the model's own eager forwards, where the whole step cannot serve the
    call); ``steps``: ``"captured"``, ``"compiled, captured"``, ``"compiled"`` or ``"eager"``; ``chooser``:
    ``"device"`` or ``"host"``; ``reason``: why the loop, the steps or the chooser is not the fastest, in words."""

    loop: str
    steps: str | None = None
    chooser: str | None = None
    reason: str | None = None

    @classmethod
    def of_runner(cls, runner, chooser: str, *reasons) -> "DecodeMode":
        steps = ("compiled, captured" if runner.compiled else "captured") if runner.capture_enabled else (
            "compiled" if runner.compiled else "eager")
        return cls("whole step", steps, chooser, "; ".join(r for r in reasons if r) or None)

    def __str__(self) -> str:
        if self.loop != "whole step":
            return f"generate's decode loop stays transformers' (eager forwards): {self.reason}"
        said = f"decode steps: the whole step, {self.steps}, token choice on the {self.chooser}"
        return said if self.reason is None else f"{said} ({self.reason})"


def decode(session, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs: dict,
           synced_gpus: bool, stock):
    """The call's decode, in the one :class:`DecodeMode` decided here and logged once: this module's loop on the
    session's step runner, with the token choice on the device where :mod:`hf_cascade.device_select` reproduces it,
    else on the host (:mod:`hf_cascade.host_select`); where the loop cannot serve the call (no runner, or
    :func:`refusal`), ``stock()``: transformers' loop with eager forwards (``session.transformers_loop``)."""
    if session.cache is None:
        return _transformers_loop(session, stock, "no cache of the call's own")
    if session.runner is None:
        return _transformers_loop(session, stock, session.runner_refusal)
    names = _Names(session.model)
    reason = refusal(session, generation_config, model_kwargs, synced_gpus)
    inputs = first = None
    if reason is None:          # (the streamer is generate's, not the forward's)
        forward_kwargs = {k: v for k, v in model_kwargs.items() if k != "streamer"}
        inputs, first, reason = _first_inputs(session.model, session.cache, input_ids, forward_kwargs,
                                              hold_kind(session.cache))
    if reason is not None:
        return _transformers_loop(session, stock, reason)
    mask = model_kwargs.get(names.mask)
    reason = host_choice_reason(generation_config, model_kwargs)
    if reason is None:
        config, reason = _selection_config(input_ids, logits_processor, stopping_criteria, generation_config, mask)
    runner = session.runner
    eager = session.descriptor.eager_reason or session.capture_refusal or (
        "CascadeConfig(cuda_graphs='eager')" if session.descriptor.cascade_config.cuda_graphs == "eager" else None)
    if reason is None:
        mode = DecodeMode.of_runner(runner, "device", eager)
        chooser = DeviceChooser(config, input_ids, mask, _encoder_ngrams(logits_processor), runner.compiled,
                                kept=runner.kept_steps)
    else:
        mode = DecodeMode.of_runner(runner, "host", eager, f"token choice on the host: {reason}")
        chooser = host_select.HostChooser(session.model, input_ids, logits_processor, stopping_criteria,
                                          generation_config, model_kwargs.get("streamer"))
    session.mode = mode
    log_once(("decode mode", mode), logging.INFO, "%s", mode)
    return WholeStepLoop(session, chooser, input_ids, inputs, first_inputs=first,
                         second_positions=_second_positions(session.model, mask)).run()


def _transformers_loop(session, stock, reason: str):
    session.mode = mode = DecodeMode("transformers' loop", reason=reason)
    log_once(("decode mode", mode), logging.INFO, "%s", mode)
    return session.transformers_loop(stock)


def _second_positions(model, decoder_mask) -> torch.Tensor | None:
    """The second step's decoder positions as stock computes them where the family takes them from the decoder mask
    every step (Whisper: ``cumsum - 1``, a pad at 0), or None where the steps' plus one gives them. After a decoder
    prompt whose last token is a pad, Whisper's next position is the count of the row's real tokens, not the pad's
    position (0) plus one."""
    if not _Names(model).encoder_decoder or not isinstance(decoder_mask, torch.Tensor):
        return None
    grown = torch.cat([decoder_mask, decoder_mask.new_ones(decoder_mask.shape[0], 1)], -1)   # + the chosen token
    positions = seq2seq_models.family_of(model).decoder_position_ids(grown)
    return None if positions is None else positions[:, -1:]


def _encoder_ngrams(logits_processor) -> list[dict] | None:
    """The encoder n-grams of the call's EncoderNoRepeatNGramLogitsProcessor (built by generate from the encoder
    input), or None."""
    from transformers.generation.logits_process import EncoderNoRepeatNGramLogitsProcessor
    found = [p for p in logits_processor if type(p) is EncoderNoRepeatNGramLogitsProcessor]
    return found[0].generated_ngrams if found else None


def _first_inputs(model, cache, input_ids, model_kwargs, kind) -> tuple[dict | None, dict | None, str | None]:
    """``(inputs, first, reason)``: the decode steps' forward arguments, as transformers' first iteration makes them
    (``first``: the first step's own where they differ: a dense cache's decoder prompt, all its tokens and its mask),
    or the reason the loop cannot advance them on the device."""
    past = cache.get_seq_length()
    names = _Names(model)
    inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=input_ids.shape[1] - past,
                                                 is_first_iteration=True, **model_kwargs)
    unknown = sorted(k for k, v in inputs.items()
                     if isinstance(v, torch.Tensor) and k not in names.advanced + names.dropped)
    if unknown:
        return None, None, f"the decode forward takes {', '.join(unknown)}, which the device loop does not advance"
    ids, positions = inputs.get(names.ids), inputs.get(names.positions)
    first = None
    if kind.positions_in_cache and isinstance(ids, torch.Tensor) and ids.dim() == 2 \
            and ids.shape[0] == input_ids.shape[0]:
        # the decoder prompt (and its mask) in the first forward, as transformers runs it; one token per row after
        first = {**inputs, "return_dict": True}
        ids = ids[:, -1:]
    if not (isinstance(ids, torch.Tensor) and ids.shape == (input_ids.shape[0], 1)):
        return None, None, "the first decode step is not one token per row"
    # (an encoder-decoder's positions may be one row for all: the BART family's cache length, pads included)
    if not kind.positions_in_cache and not (
            isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[1] == 1
            and positions.shape[0] in ((ids.shape[0], 1) if names.encoder_decoder else (ids.shape[0],))):
        return None, None, "the decoder's positions are not an input of the step (computed on the host)"
    if names.encoder_decoder:      # the BART family reads them only where hf_cascade.patches.positions serves it
        reason = seq2seq_models.step_positions_reason(model, inputs)
        if reason is not None:
            return None, None, reason
    steps = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in {**inputs, names.ids: ids}.items()
             if k not in names.dropped}
    steps["return_dict"] = True
    if first is None:
        # the first step runs on the host path with the masks, as transformers' first iteration (and the graph runner's
        # step that is not static) runs it: where no row holds a token yet (every prompt empty, or one token after
        # left padding) it is a fresh step, whose dense attention takes the pads from the mask alone (without it an
        # empty prompt's last pad attended to itself, where stock's sees nothing)
        first = {**steps, **{k: inputs[k] for k in names.dropped if k in inputs}}
    return steps, first, None


class _Captured:
    """A captured whole step and the tensors it reads and writes, kept on the graph runner for the model's next call:
    a call of the same shape (same chooser and selection settings, inputs, decode layout, pools) fills the same
    tensors with its own values and replays the graph without capturing. ``call_key`` covers the chooser's state,
    inputs and parents (decided before the first step); ``step_key`` the held cache state, layout and pools (decided
    when the device takes the state: ``DeviceHold.key``). ``logits``: the captured step's output, which the host
    chooser reads after each replay."""

    def __init__(self, call_key, state, inputs: dict, parents, peak):
        self.call_key, self.state, self.inputs, self.parents, self.peak = call_key, state, inputs, parents, peak
        self.step_key = self.held_tensors = self.graph = self.logits = None


def _fill(kept: dict, fresh: dict) -> None:
    for name, tensor in fresh.items():
        if name in SEQUENCE_BUFFERS and kept[name].shape[-1] != tensor.shape[-1]:
            width = min(kept[name].shape[-1], tensor.shape[-1])     # (both hold max_length: the rest is never read)
            kept[name][..., :width].copy_(tensor[..., :width])
            # (and holds the fresh state's fill, as a kept step of the call's own width would: its last column, which
            # no step has written when a call moves into a kept step)
            kept[name][..., width:].copy_(tensor[..., -1:].expand_as(kept[name][..., width:]))
        else:
            kept[name].copy_(tensor)


# the token choice's buffers whose last dimension is the sequence width: a kept step's serve any call whose max_length
# they hold (the columns past it are never read), up to ADOPT_SPAN times its own width (a beam step reorders them)
SEQUENCE_BUFFERS = ("sequences", "finished_sequences")


class DeviceChooser:
    """The token choice inside the step (:mod:`hf_cascade.device_select`'s state and step): what
    :class:`WholeStepLoop` asks of a chooser (``host_select.HostChooser`` is the other one, run after each step).
    ``state``: the device tensors the step reads and writes, kept with a captured step."""

    in_step = True

    def __init__(self, config: device_select.SelectionConfig, input_ids, attention_mask,
                 encoder_ngrams: list[dict] | None = None, compiled=False, kept: "list[_Captured]" = ()):
        # (the config less its prompt's lengths, which the state holds as tensors: a call of another prompt length
        # of the same bucketed shapes refills the kept tensors)
        self.key = ("device", device_select.shape_key(config))
        # a kept step's sequence buffers where they are wider, up to ADOPT_SPAN times this call's (a shorter prompt
        # than the kept step's call: its state then fits the kept step)
        own = _own_sequence_width(config.max_length)
        width = next((k.state.sequences.shape[1] for k in kept if k.call_key[0] == self.key), own)
        self.state = device_select.new_state(config, input_ids, attention_mask, encoder_ngrams=encoder_ngrams,
                                             width=width if own <= width <= ADOPT_SPAN * own else None)
        self.beam, self.max_length = config.is_beam, config.max_length
        # with compile the token choice is one compiled graph too (but for sampling: its generator stays eager)
        self._choose = _Compiled(choose, "token choice", compiled) if compiled and not config.do_sample else choose

    def adopt(self, kept: device_select.SelectionState) -> None:
        """Run on ``kept`` (a kept step's state, already filled with this call's values)."""
        kept.config = self.state.config         # (read on the host only: finalize's crop)
        self.state = kept

    @property
    def finished(self) -> bool:
        return bool(self.state.done)            # (a host read)

    def choose(self, logits: torch.Tensor, parents: torch.Tensor, input_ids: torch.Tensor, positions: tuple) -> None:
        self._choose(self.state, logits[:, -1], parents, input_ids, positions)

    def finalize(self, cache=None) -> torch.Tensor:
        return device_select.finalize(self.state).sequences


class WholeStepLoop:
    """One call's decode loop (see the module docstring). ``chooser``: the token choice, inside the step
    (:class:`DeviceChooser`) or after it on the host (``host_select.HostChooser``). ``inputs``: the decode steps'
    forward arguments; their tensors are the loop's static inputs, advanced in place by every step. ``first_inputs``:
    the first step's, where they differ (a dense cache's decoder prompt; the masks). ``second_positions``: the decoder
    positions the first step leads to where they are not its own plus one (:func:`_second_positions`)."""

    def __init__(self, session, chooser, input_ids, inputs: dict, first_inputs: dict | None = None,
                 second_positions: torch.Tensor | None = None):
        self.model, self.cache, self.runner = session.model, session.cache, session.runner
        # steps that cannot be captured (the CPU, a quantized layer that syncs): nothing replays a shape, so the device
        # pool is not bucketed and takes only EAGER_ROOM steps at a time (reserved memory follows the tokens, as on
        # transformers' loop)
        self.frugal = session.capture_refusal is not None
        self.names = _Names(self.model)
        self.kind = hold_kind(self.cache)
        self.chooser = chooser
        state = chooser.state
        self.call_key = (chooser.key, _signature(inputs), _signature(state.tensors(), any_width=SEQUENCE_BUFFERS),
                         self.runner.compiled)
        # the call's own tensors until its first device step, which moves them into a kept step that fits, or keeps
        # them for the step it captures (_hold_on_device)
        kept = _Captured(self.call_key, state, inputs, torch.arange(input_ids.shape[0], device=input_ids.device),
                         torch.zeros((), dtype=torch.int64, device=input_ids.device))
        self.kept = kept
        self.inputs, self.parents, self.peak = kept.inputs, kept.parents, kept.peak
        self.first_inputs = first_inputs or self.inputs
        self.second_positions = second_positions     # (see _second_positions)
        self.device = input_ids.device
        self.beam = chooser.beam
        self.made = input_ids.shape[1]                 # sequence width after the steps run (an upper bound)
        self.max_length = chooser.max_length
        self.held: DeviceHold | None = None    # set while the device holds the cache's state
        self.first_of_hold = False             # the next device step is the first of its hold, with no graph kept
        self.step_context = None               # the last device step's (its layers' writes, its backends)
        self.graph = None
        self.capture = self.runner.capture_enabled
        self.room = 0
        self.device_ok = True       # False: a step cannot be planned on the device (see _hold_on_device)
        self.host_planned = False   # the last step ran on the host path (its context tells how it was planned)
        # with compile, the bookkeeping runs as one compiled graph too: a hundred small kernels fused into a few
        compiled = self.runner.compiled
        self.advance_fn = (_Compiled(self.kind.advance_fn, "cache bookkeeping", compiled) if compiled
                           else self.kind.advance_fn)
        self.host_steps = 0

    def kept_blocks(self, layout) -> "device_blocks.DeviceBlocks | None":
        """The block state of a step kept from an earlier call of this call's key, captured on ``layout`` (which
        then adopted this call's values, or held them already): the shapes this call's state takes where they are
        wider, so that the kept step replays."""
        return next((kept.held_tensors for kept in self.runner.kept_steps
                     if self._serves_call(kept) and kept.step_key is not None
                     and kept.step_key[:2] == ("blocks", layout.serial)), None)

    def _serves_call(self, kept: _Captured) -> bool:
        """Whether ``kept``'s tensors take this call's state, inputs and parents: the same call key, and sequence
        buffers that hold this call's ``max_length``, at most ADOPT_SPAN times as wide as its own."""
        if kept.call_key != self.call_key:
            return False
        width = _sequence_width(kept.state)
        return width is None or self.max_length <= width <= ADOPT_SPAN * _own_sequence_width(self.max_length)

    # ---- the loop ----------------------------------------------------------------------------------------
    def run(self):
        """What generate returns: the chooser's ``finalize``."""
        try:
            self._host_step(first=True)
            if self.second_positions is not None:
                self.inputs[self.names.positions].copy_(self.second_positions)
            finished = self.chooser.finished
            while not finished:
                if self.held is None and self.device_ok and self.host_planned:
                    self._hold_on_device()
                if self.held is None:
                    self._host_step()
                    finished = self.chooser.finished
                else:
                    finished = self._chunk(max(1, min(CHECK_EVERY, self.room, self.max_length - self.made)))
        except BaseException:
            self.held = None            # the session empties the cache: nothing to take back
            self.runner.release()       # a step may have stopped half way: keep nothing of it
            raise
        self._take_back()
        if self.beam and not self.chooser.in_step:
            self.cache.reorder_cache(self.parents)  # as transformers' loop leaves the cache (a call may return it)
        # what is kept for the next call holds none of this call's objects (an encoder-decoder's encoder outputs keep
        # its encoder states alive): a call that reuses the kept step puts its own in (same names: same call_key)
        for name, value in self.kept.inputs.items():
            if not isinstance(value, torch.Tensor) and not isinstance(value, (bool, int, float, str, type(None))):
                self.kept.inputs[name] = None
        return self.chooser.finalize(self.cache)

    def _host_step(self, first: bool = False) -> None:
        """One step on the host path (a layout that is outgrown widens here)."""
        self._take_back()
        if self.beam and not first:
            self.cache.reorder_cache(self.parents)
        out = self.kind.host_forward(self.cache, self.runner.original, self.first_inputs if first else self.inputs,
                                     first)
        self.runner.eager_calls += 1
        self._choose(out.logits)
        self.made += 1
        self.host_steps += 1
        self.host_planned = True

    def _hold_on_device(self) -> None:
        """Hand the cache's state to the device where the layout in force has room for another step."""
        held, reason = self.kind.take(self)
        if reason is not None:
            self.device_ok = False
            log_once(("whole step host", reason), logging.INFO, "decode steps are planned on the host: %s", reason)
            return
        if held is None:
            return
        alive = getattr(self.kind, "alive", None)
        alive = None if alive is None else functools.partial(alive, self.cache)
        self.runner.drop_dead(alive)        # (steps of released layouts: their slots serve live ones)
        mine = [kept for kept in self.runner.kept_steps if self._serves_call(kept)]
        kept = next((kept for kept in mine if kept.step_key == held.key), None)
        fits = kept is not None
        if not fits:    # a step to capture: on the tensors of a kept step of this layout it supersedes, else the call's
            kept = next((kept for kept in mine if kept.step_key[:2] == held.key[:2]), self.kept)
        if kept is not self.kept:
            self._move_to(kept)
        if fits:                          # the captured step fits: this call's state into its tensors
            _fill(_tensors(kept.held_tensors), _tensors(held.tensors))
            held.tensors = kept.held_tensors
        else:
            kept.step_key, kept.held_tensors, kept.graph, kept.logits = held.key, held.tensors, None, None
            self.runner.keep_step(kept)
        if isinstance(held, BlocksHold):         # (the peak the kept step's graph raises)
            held.peak = kept.peak.zero_()
        self.held, self.graph, self.room = held, kept.graph, held.room
        self.first_of_hold = not fits     # (in the eager form: the step a GPU would capture)

    def _move_to(self, kept: _Captured) -> None:
        """Carry the call's state, inputs and parents into ``kept``'s tensors (a kept step whose graph fits, of the
        same call key: the same shapes) and run on them from now on."""
        _fill(kept.state.tensors(), self.kept.state.tensors())
        self.chooser.adopt(kept.state)
        _fill(kept.inputs, {k: v for k, v in self.inputs.items() if isinstance(v, torch.Tensor)})
        kept.inputs.update({k: v for k, v in self.inputs.items() if not isinstance(v, torch.Tensor)})
        kept.parents.copy_(self.parents)
        self.kept = kept
        self.inputs, self.parents, self.peak = kept.inputs, kept.parents, kept.peak

    def _chunk(self, steps: int) -> bool:
        """``steps`` device steps, then one read of the flags; returns whether the call has finished. With the
        chooser on the host, its choice after each step (and its read: the chunk ends where the call does)."""
        ran = 0
        while ran < steps:
            self.held.count_step()
            if self.graph is not None:
                self.graph.replay()
                self.runner.replays += 1
                logits = self.kept.logits
            elif self.capture:
                logits = self._warm_up_and_capture()
            else:
                logits = self._device_step()
                if self.runner.capture_enabled:     # a capture was refused or failed: eager from now on
                    self.runner.eager_calls += 1
                elif self.first_of_hold:            # the step's eager form: the step a GPU captures ...
                    self.runner.first_steps += 1
                    self.runner.eager_calls += 1
                else:                               # ... and its replays
                    self.runner.replays += 1
            self.first_of_hold = False
            ran += 1
            if not self.chooser.in_step:
                self._choose(logits)
                if self.chooser.finished:
                    break
        self.room -= ran
        self.made += ran
        self.host_planned = False
        self.runner.device_steps += ran
        done = self.chooser.state.done
        if self.held.flags is None:
            flags, done = 0, bool(done)      # the one read
        else:
            flags, done = torch.stack((self.held.flags.long(), done.long())).tolist()   # the one read
        if flags & device_blocks.POOL_EXHAUSTED:
            raise PoolExhausted("KV block pool exhausted in a decode step on the device")
        if flags:
            raise RuntimeError(f"hf_cascade internal error: a device decode step left its layout (flags {flags}) "
                               "although the host bounded the steps by the layout's room; please report it")
        if self.room == 0:
            self._take_back()
        return bool(done)

    def _take_back(self) -> None:
        """The host takes the cache's state back from the device (the end of a layout's room, or of the call)."""
        if self.held is None:
            return
        held, self.held, self.graph = self.held, None, None     # (the graph stays in self.kept)
        held.take_back()

    # ---- one device step ------------------------------------------------------------------------------------
    def _device_step(self) -> torch.Tensor:
        """The step (the token choice too where it is on the device); returns its logits."""
        self._advance()
        logits = self._forward()
        if self.chooser.in_step:
            self._choose(logits)
        return logits

    def _advance(self) -> None:
        self.held.advance(self.parents, self.chooser.state.done)

    def _forward(self) -> torch.Tensor:
        """The forward on the planned step: the runner's (compiled where ``compile`` is on and the model compiles,
        with the step context as its argument; else the model's own)."""
        self.step_context = self.cache.begin_planned_step(self.device, self.held.copies)  # (see capture_refusal)
        try:
            return self.runner.forward_step(self.inputs).logits
        finally:
            self.cache.end_step()

    def _choose(self, logits: torch.Tensor) -> None:
        """Token choice on the last position's logits; the next step's inputs and parents, in place."""
        positions = tuple(self.inputs[name] for name in self.names.advanced[1:]
                          if isinstance(self.inputs.get(name), torch.Tensor))
        self.chooser.choose(logits, self.parents, self.inputs[self.names.ids], positions)

    def _warm_up_and_capture(self) -> torch.Tensor:
        """This step, then the same step captured (the runner's recipe); returns the eager step's logits."""
        logits, graph, captured = self.runner.capture(self._device_step,
                                                      lambda: self.held.capture_refusal(self.step_context))
        if graph is None:
            self.capture = False
            return logits
        self.graph = self.kept.graph = graph
        self.kept.logits = None if self.chooser.in_step else captured      # (the host chooser reads the replays')
        return logits


# ---- the cache's state on the device: one kind per cache kind --------------------------------------------------
def advance(blocks: device_blocks.DeviceBlocks, plan, parents: torch.Tensor, done: torch.Tensor,
            peak: torch.Tensor) -> None:
    """The step's block bookkeeping: beam reorder by ``parents``, one token appended per row unless the call is
    ``done``, the step's tables and slots copied into the layout's plan buffers ``plan`` (a DevicePlan), the peak of
    blocks in use raised. One launch of the library's kernel where it runs (:data:`blocks_kernel`), except where the
    step is compiled (torch.compile fuses the ops below)."""
    if blocks_kernel and not torch.compiler.is_compiling() and cuda_library.blocks_advance(blocks, plan, parents, done,
                                                                                          peak):
        return
    device_blocks.reorder(blocks, parents)
    step = device_blocks.append(blocks, active=~done)
    for field in dataclasses.fields(step):        # (the plan's per-step tensors, by the same names)
        value = getattr(step, field.name)
        if value is not None:
            getattr(plan, field.name).copy_(value)
    torch.maximum(peak, (blocks.refcount > 0).sum(), out=peak)


class DeviceHold(Protocol):
    """A cache's per-step state while the device holds it: what :class:`WholeStepLoop` needs of it. One kind per cache
    kind (:func:`hold_kind`): :class:`BlocksHold` for a paged CascadeCache, ``dense_cache.DenseHold`` for the T5
    family's StaticSelfAttentionCache. A kind also says how its cache takes the call's first inputs
    (``positions_in_cache``: the decoder's positions are the cache's, not a step input), how a step runs on the host
    (``host_forward``), which function advances it (``advance_fn``: compiled with ``compile``), when the device can
    take it (``take(loop)``: the hold, or None with the reason it never can, or None and None: not now) and, where a
    kind's layouts outlive calls, whether a kept step can still replay (``alive(cache, step_key)``; without it every
    kept step counts as alive)."""

    room: int                         # device steps it may run before the host takes it back
    key: tuple                        # what a captured step bakes in of it (shapes, addresses)
    copies: bool                      # whether its steps may copy blocks (False: the layers launch no copy)
    tensors: object                   # what its steps advance (a dataclass of tensors, kept with the captured step)
    flags: torch.Tensor | None        # sticky overflow bits the host reads with the finished flag (None: no overflow)

    def advance(self, parents: torch.Tensor, done: torch.Tensor) -> None:
        """The step's bookkeeping from the last step's ``parents``: device ops only."""

    def count_step(self) -> None:
        """On the host, once per device step (outside any graph)."""

    def capture_refusal(self, step_context) -> str | None:
        """Why a device step that ran on ``step_context`` cannot be captured (None when it can)."""

    def take_back(self) -> None:
        """The host takes the state back (the end of the room, or of the call)."""


class BlocksHold:
    """A CascadeCache's block state while the device holds it (:mod:`hf_cascade.device_blocks`): the tables, lengths
    and reference counts, the layout's plan buffers the steps write, the peak of blocks in use."""

    advance_fn = staticmethod(advance)    # what the loop runs (compiled with CascadeConfig(compile=True))
    positions_in_cache = False

    def __init__(self, cache, blocks: device_blocks.DeviceBlocks, plan, room: int, key: tuple, peak, advance_fn,
                 copies: bool = True):
        self.cache, self.tensors, self.plan, self.room, self.key = cache, blocks, plan, room, key
        self.copies = copies
        self.peak, self._advance = peak, advance_fn
        self.base_length = cache.logical_length

    @property
    def flags(self) -> torch.Tensor:
        return self.tensors.flags

    @classmethod
    def take(cls, loop) -> tuple["BlocksHold | None", str | None]:
        """The block state of ``loop``'s cache handed to the device where the layout in force has room for another
        step."""
        cache, layout = loop.cache, loop.cache.layout
        ctx = cache.step
        if ctx is None or layout is None or ctx.plan.layout is not layout:
            # the call's first step may not be static (an encoder-decoder's one-token decoder prompt leaves the
            # rows empty, a padded prompt's last token a write mask), nor one that began with an empty row (an empty
            # prompt's first token; after the first step a row holding at most one token was empty before it): the
            # step after is
            if loop.host_steps == 1 or bool((cache.blocks.lengths <= 1).any()):
                return None, None
            return None, "the step was not planned on a static decode layout"
        # the device writes the plan into the layout's buffers: every layer must read it from there
        reason = loop.runner.replay_refusal(ctx)
        if reason is not None:
            return None, reason
        manager = cache.blocks
        bs = layout.block_size
        room = layout.room(manager.lengths)
        if cache.decode_steps_left is not None:     # (a kept layout adopted by a shorter prompt has room to spare)
            room = min(room, cache.decode_steps_left)
        if room < 1:
            return None, None
        # every id a step takes is the lowest free one, and ids in use never exceed those held now plus what each
        # row adds in `steps` steps (at most one id a step; one block per block_size tokens and one copy-on-write):
        # the pool never overflows
        R = manager.num_rows

        def pool_for(steps: int) -> int:
            return max(manager.id_bound, manager.blocks_in_use + R * min(steps, -(-steps // bs) + 1) + 1)

        like = None if loop.frugal else loop.kept_blocks(layout)
        if loop.frugal:
            # the most steps (up to EAGER_ROOM) that the pools hold with the scratch block: as they are, else grown
            # as a growing pool doubles
            held = min((layer.storage.num_blocks for layer in cache.layers if layer.storage is not None), default=0)
            while pool_for(1) + 1 > held:
                held = max(2 * held, 16)
            room = next(steps for steps in range(min(room, EAGER_ROOM), 0, -1) if pool_for(steps) + 1 <= held)
            pool_blocks = pool_for(room)
        else:
            # (bucketed with the scratch block, as the layout's widths are: a range of prompt lengths shares one shape)
            # (per row one block per block_size tokens and one copy-on-write: the bound the captured steps were
            # measured with)
            pool_blocks = shape_bucket(max(manager.id_bound, manager.blocks_in_use + R * (-(-room // bs) + 1) + 1)
                                       + 1) - 1
            if like is not None and pool_blocks <= like.pool_blocks:
                pool_blocks = like.pool_blocks      # (the kept step's pool, already held: a larger pool serves as well)
        if manager.max_blocks is not None:
            # a cap (max_kv_bytes): the device's pool and its scratch block inside it, and only as many steps as
            # cannot pass it; the steps the device cannot take run on the host path, whose block manager raises
            # PoolExhausted at the very step transformers' loop would
            pool_blocks = min(pool_blocks, manager.max_blocks - 1)
            room = min(room, bs * ((pool_blocks - manager.blocks_in_use) // R - 1))
            if room < 1 or manager.id_bound > pool_blocks:
                return None, None
        for layer in cache.layers:
            if layer.storage is not None:
                layer.storage.ensure(pool_blocks + 1)     # + the scratch block
        # (a kept step may replay from here on without a step begun on the host: the all-layer copy's addresses
        # follow pools that moved first)
        cache.follow_pool_addresses()
        if like is not None and like.pool_blocks != pool_blocks:     # (a cap kept this pool below the kept one)
            like = None
        blocks = device_blocks.DeviceBlocks.from_host(manager, layout, pool_blocks, device=loop.device, like=like)
        scalars = tuple(getattr(blocks, f) for f in ("block_size", "pool_blocks", "suffix_width", "inner_width"))
        # rows whose parents never change (no beam search) copy a block only where one appends to a block another
        # holds: a prompt's last, part-filled block that its samples share (forked at the prefill; the first decode
        # step, on the host, copies it). Where none does, no step of the hold copies: the layers launch no copy
        copies = loop.beam or _appends_to_shared_block(manager)
        key = ("blocks", layout.serial, scalars, _signature(_tensors(blocks)), graphs.pool_signature(cache), copies)
        return cls(cache, blocks, layout.device_plan(loop.device), room, key, loop.peak, loop.advance_fn,
                   copies), None

    @staticmethod
    def alive(cache, step_key: tuple) -> bool:
        """Whether a kept step of ``step_key`` can still replay: its layout is ``cache``'s in force or one it keeps."""
        layouts = (cache.layout, *cache.kept_layouts)
        return step_key[0] == "blocks" and any(layout is not None and layout.serial == step_key[1]
                                               for layout in layouts)

    @staticmethod
    def host_forward(cache, forward, inputs: dict, first: bool):
        """One step on the host path (the block manager plans it; a layout that is outgrown widens here)."""
        return forward(**inputs)

    def advance(self, parents: torch.Tensor, done: torch.Tensor) -> None:
        self._advance(self.tensors, self.plan, parents, done, self.peak)

    def count_step(self) -> None:
        self.cache.logical_length += 1

    def capture_refusal(self, step_context) -> None:
        return None         # (the host step's context was asked when the device took the state: take)

    def take_back(self) -> None:
        tables, lengths, refcount = device_blocks.host_state(self.tensors)
        self.cache.restore_blocks(tables, lengths, refcount, self.base_length + int(self.tensors.steps),
                                  int(self.peak))


def _appends_to_shared_block(manager) -> bool:
    """Whether a row's next token goes into a block another row holds too (its last block part-filled and shared)."""
    lengths = manager.lengths
    partial = np.flatnonzero(lengths % manager.block_size)
    if not partial.size:
        return False
    last = manager.tables()[partial, (lengths[partial] - 1) // manager.block_size]
    return bool((manager.refcount[last] > 1).any())


def hold_kind(cache) -> type:
    """The :class:`DeviceHold` kind of ``cache``: the one it names (``device_hold``: a dense cache's), else the paged
    cache's (asked so, not by the cache's type: whole_step stays below the dense caches' module)."""
    return getattr(cache, "device_hold", None) or BlocksHold


# ---- token choice ------------------------------------------------------------------------------------------------
def choose(state: device_select.SelectionState, logits: torch.Tensor, parents: torch.Tensor, input_ids: torch.Tensor,
           positions: tuple) -> None:
    """Token choice on ``logits [rows, vocab]``; the next step's ``input_ids [rows, 1]``, ``positions`` and
    ``parents``, in place. Uncompiled on a GPU, where :data:`select_kernel` is on, the bookkeeping around the
    vocabulary-sized ops runs on the kernel library (:func:`choose_on_library`)."""
    if select_kernel and not torch.compiler.is_compiling():
        lib = cuda_library.select_library(state, parents, input_ids, positions)
        if lib is not None:
            choose_on_library(lib, state, logits, parents, input_ids, positions,
                              torch.cuda.current_stream(logits.device).cuda_stream)
            return
    tokens, chosen = device_select.step(state, logits)
    parents.copy_(chosen)
    # (after the end the fill token may be -1, which no embedding takes: the steps queued after it feed 0 and change
    # nothing)
    input_ids.copy_(tokens.clamp(min=0)[:, None])
    for position in positions:
        position.add_(1)


def choose_on_library(lib, state: device_select.SelectionState, logits: torch.Tensor, parents: torch.Tensor,
                      input_ids: torch.Tensor, positions: tuple, stream: int) -> None:
    """:func:`choose` with the bookkeeping on ``lib``'s kernels (``csrc/select.cu``, bit for bit the torch ops of
    device_select): the chosen tokens (greedy, sampling) or the candidates and the two top-k's (beam search) stay the
    torch ops, the rest is one launch (greedy, sampling) or two (beam search) instead of ~30 / ~75 torch kernels; with
    :data:`select_topk` the top-k's are the library's too (torch.topk's order on CUDA). ``lib``: a loaded binding
    whose tensors fit (:func:`cuda_library.select_library`; tests pass an emulated one)."""
    config = state.config
    fill = device_select.fill_value(config)
    if not config.is_beam:
        tokens, probs_total = device_select.sample_tokens(state, logits)
        lib.sample_finish(state, tokens, probs_total, parents, input_ids, positions, config.pad_token_id or 0, fill,
                          stream)
        return
    ranking = (lambda scores, k: cuda_library.topk(lib, scores, k)) if select_topk else None
    top_log_probs, top_indices, probs_total = device_select.beam_candidates(state, logits, topk=ranking)
    batch, candidates = top_indices.shape
    beams = config.num_beams
    device = top_indices.device
    # (the two small top-k's in the kernel too where they fit its ranking: torch.topk's order, ties included)
    ranked = select_topk and cuda_library.ranks_beams(beams, candidates)
    scratch = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape, dtype in (
        ("top_tokens", (batch, candidates), torch.int64), ("top_parents", (batch, candidates), torch.int64),
        ("hits", (batch, candidates), torch.bool), ("running", (batch, candidates), torch.float32),
        ("merged", (batch, beams + candidates), torch.float32), ("snapshot", (2,), torch.int64),
        *((name, (batch, beams), torch.int64) for name in (("next_indices", "keep") if ranked else ())))}
    early_true = config.early_stopping is True
    lib.beam_scores(state, top_log_probs.contiguous(), top_indices.contiguous(), probs_total, logits.shape[-1],
                    scratch, early_true, stream)
    if ranked:
        next_indices, keep = scratch["next_indices"], scratch["keep"]
    else:
        next_indices = device_select.top_beams(scratch["running"], beams)
        keep = device_select.top_beams(scratch["merged"], beams)
    lib.beam_finish(state, scratch, next_indices, keep, parents, input_ids, positions, fill, early_true,
                    config.early_stopping == "never" and config.length_penalty > 0.0, stream)


class _Compiled:
    """``fn`` compiled as one graph for fixed shapes (``graphs.COMPILE_OPTIONS``); where it fails to compile,
    ``fn`` itself from then on, logged once (a failure leaves no state changed: dynamo raises before the graph runs)."""

    def __init__(self, fn, what: str, compile=True):
        self.fn, self.what, self.compiled = fn, what, torch.compile(fn, **graphs.compile_options(compile))

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as err:  # noqa: BLE001 — sorted by compile_failure; the rest is re-raised
                if not graphs.compile_failure(err):
                    raise
                log_once(("compile", self.what, type(err).__name__), logging.WARNING,
                         "CascadeConfig(compile=True): the whole step's %s failed to compile (%s: %s); it runs "
                         "uncompiled", self.what, type(err).__name__, str(err)[:200])
                self.compiled = None
        return self.fn(*args)


def _signature(tensors: dict, any_width: tuple = ()) -> tuple:
    """What a captured graph bakes in of named arguments: tensors by shape, dtype and device; plain values as such;
    other objects (the cache) by type. The tensors named in ``any_width``: all but their last dimension (checked
    apart: :meth:`WholeStepLoop._serves_call`)."""
    def one(k, v):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape[:-1]) if k in any_width else tuple(v.shape), v.dtype, str(v.device)
        return v if isinstance(v, (bool, int, float, str, type(None))) else type(v)
    return tuple(sorted((k, one(k, v)) for k, v in tensors.items()))


def _own_sequence_width(max_length: int) -> int:
    """The width of a call's own sequence buffers (``max_length`` bucketed, as ``device_select.new_state`` makes them)."""
    return shape_bucket(max_length, device_select.MIN_BUCKET_TOKENS)


def _sequence_width(state) -> int | None:
    """The width of a token choice state's sequence buffers (None for a state without them: the host chooser's)."""
    sequences = getattr(state, "sequences", None)
    return None if sequences is None else sequences.shape[-1]


def _tensors(held_tensors) -> dict:
    """The tensors of a held state's dataclass (DeviceBlocks, dense_cache.DenseDeviceState), by name."""
    return {name: value for name, value in vars(held_tensors).items() if isinstance(value, torch.Tensor)}
