"""One decode step's token choice as plain torch on fixed-size buffers: greedy, multinomial sampling and beam search.

It owns the selection state of one generate call and the step that updates it, nothing else (no model, no cache):
``new_state`` builds the buffers once per call, ``step(state, logits)`` turns one forward's last-position logits into
the next tokens and the row each one continues (its parent, for the cache reorder), ``finalize`` returns what
transformers' ``generate`` returns. The step has static shapes and never reads a tensor on the host (no ``.item()``,
no Python branch on a tensor, no data-dependent shape), so it can run inside a captured CUDA graph; the host reads
``state.done`` when it chooses to. Once ``done`` is set, further steps leave the state unchanged.

The arithmetic and its order are transformers' own (``GenerationMixin._sample`` / ``_beam_search`` and the
processors of ``generation/logits_process.py``, 5.24): the same torch ops on the same shapes, so tokens and scores are
bitwise equal, ties included. Where transformers' processors depend on the sequence length through a shape
(repetition penalty, no-repeat n-gram, min length, min new tokens, max length), the device variant reads the whole
buffer and masks by the current length instead.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields

import torch

from ..compat import BEAM_RULES_5_24
from ..kv.plan import MIN_BUCKET_TOKENS, shape_bucket

NEG_INF_SCORE = -1.0e9      # transformers' "cannot be chosen" score in beam search (added, so such scores tie)


# transformers 5.24 differs from 5.17 in two rules (shared/reference/device_beam_search.md; 5.18-5.23 not checked for
# the second): beam sampling re-sorts its sampled candidates by score, and the repetition penalty skips left padding.
_TRANSFORMERS_5_24 = BEAM_RULES_5_24


class UnsupportedSelection(ValueError):
    """A generation setting this module does not reproduce; the caller keeps transformers' own loop."""


# GenerationConfig fields whose processors or criteria have no device variant here, with the value meaning "off".
_OFF_VALUES = {
    "sequence_bias": None, "encoder_repetition_penalty": 1.0,
    "remove_invalid_values": False, "exponential_decay_length_penalty": None,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None, "watermarking_config": None,
    "renormalize_logits": False, "guidance_scale": 1.0, "max_time": None, "stop_strings": None,
    "num_beam_groups": 1, "diversity_penalty": 0.0, "constraints": None, "force_words_ids": None,
    "low_memory": None, "prompt_lookup_num_tokens": None,
}


@dataclass(frozen=True)
class SelectionConfig:
    """What one call selects with, read once on the host. ``batch_size`` counts prompts; a call has
    ``batch_size * num_beams`` rows in beam search and ``batch_size * num_return_sequences`` rows otherwise."""
    batch_size: int
    prompt_length: int                  # the padded prompt width, transformers' ``decoder_prompt_len``
    max_length: int
    do_sample: bool = False
    num_beams: int = 1
    num_return_sequences: int = 1
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    encoder_no_repeat_ngram_size: int = 0   # (Blenderbot's config: its n-grams come from the processor, see new_state)
    min_length: int = 0
    min_new_tokens: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # the seq2seq checkpoints' own processors (mBART/NLLB/M2M100 forced_bos, BART forced_eos, Whisper's suppressions)
    forced_bos_token_id: int | None = None
    forced_eos_token_ids: tuple[int, ...] | None = None
    suppress_tokens: tuple[int, ...] | None = None
    begin_suppress_tokens: tuple[int, ...] | None = None
    begin_suppress_index: int | None = None     # None: where transformers puts it for the generation config
    bad_words_ids: tuple[int, ...] | None = None    # single-token bad words (opus-mt bans its pad token), eos left out

    def __post_init__(self):
        self._default_begin_index()
        if self.eos_token_ids and self.pad_token_id is None:   # what generate does (with a warning)
            object.__setattr__(self, "pad_token_id", self.eos_token_ids[0])
        if self.is_beam and self.num_return_sequences > self.num_beams:
            raise ValueError(f"num_return_sequences ({self.num_return_sequences}) > num_beams ({self.num_beams})")

    @property
    def is_beam(self) -> bool:
        return self.num_beams > 1

    @property
    def rows(self) -> int:
        return self.batch_size * (self.num_beams if self.is_beam else self.num_return_sequences)

    @property
    def candidates(self) -> int:
        """Beam search keeps this many continuations per prompt, so that num_beams stay open if the best end."""
        return max(2, 1 + len(self.eos_token_ids)) * self.num_beams

    @property
    def min_tokens_to_keep(self) -> int:
        return len(self.eos_token_ids) + 1 if self.is_beam else 1

    @classmethod
    def from_generation_config(cls, generation_config, batch_size: int, prompt_length: int) -> "SelectionConfig":
        """From the GenerationConfig transformers hands ``_sample`` / ``_beam_search`` (defaults already applied,
        ``max_length`` already set). Raises UnsupportedSelection, naming the setting, for anything not reproduced."""
        gc = generation_config
        for name, off in _OFF_VALUES.items():
            value = getattr(gc, name, off)
            if not (value is None or value is False or value == off):
                raise UnsupportedSelection(f"device selection off: {name}={value!r} is not supported")
        # the special tokens as generate prepared them for its loop (pad falls back to eos[0] there)
        eos = getattr(gc, "_eos_token_tensor", None)
        eos = () if eos is None else tuple(int(e) for e in eos.reshape(-1))
        pad = getattr(gc, "_pad_token_tensor", None)
        pad = None if pad is None else int(pad)
        return cls(
            batch_size=batch_size, prompt_length=prompt_length, max_length=gc.max_length,
            do_sample=bool(gc.do_sample), num_beams=gc.num_beams or 1,
            num_return_sequences=gc.num_return_sequences or 1, eos_token_ids=eos, pad_token_id=pad,
            temperature=gc.temperature if gc.temperature is not None else 1.0, top_k=gc.top_k,
            top_p=gc.top_p if gc.top_p is not None else 1.0, min_p=gc.min_p,
            repetition_penalty=gc.repetition_penalty if gc.repetition_penalty is not None else 1.0,
            no_repeat_ngram_size=gc.no_repeat_ngram_size or 0,
            encoder_no_repeat_ngram_size=gc.encoder_no_repeat_ngram_size or 0, min_length=gc.min_length or 0,
            min_new_tokens=gc.min_new_tokens or 0, length_penalty=gc.length_penalty,
            early_stopping=gc.early_stopping, forced_bos_token_id=gc.forced_bos_token_id,
            forced_eos_token_ids=_token_tuple(gc.forced_eos_token_id), suppress_tokens=_token_tuple(gc.suppress_tokens),
            begin_suppress_tokens=_token_tuple(gc.begin_suppress_tokens),
            bad_words_ids=_single_token_bad_words(gc.bad_words_ids, eos))

    def check_against(self, logits_processor, stopping_criteria, attention_mask: torch.Tensor | None = None) -> None:
        """Raise UnsupportedSelection unless transformers' prepared lists are exactly what this config reproduces:
        the same processor and criterion types (exact types: a subclass may compute anything) with the same
        parameters, every attribute compared (a user's object replaces the default one of its type, and an attribute
        this does not know, e.g. of a newer transformers, refuses). ``attention_mask``: the call's ``[rows, L]`` mask,
        whose left padding the repetition penalty skips on transformers >= 5.24."""
        from transformers.generation import logits_process, stopping_criteria as criteria_module
        names = _commuted(tuple(type(p).__name__ for p in logits_processor))
        if names != self.processor_names():
            raise UnsupportedSelection(f"device selection off: processors {names} (reproduced: "
                                       f"{self.processor_names()})")
        for processor in logits_processor:
            if type(processor) is not getattr(logits_process, type(processor).__name__):
                raise UnsupportedSelection(f"device selection off: {type(processor).__qualname__} not supported")
            name = type(processor).__name__
            expected = self._parameters_of(name)
            unknown = sorted(set(vars(processor)) - set(expected) - set(_DERIVED_STATE.get(name, ())))
            if unknown:
                raise UnsupportedSelection(f"device selection off: {name} has attributes the device choice does not "
                                           f"reproduce ({', '.join(unknown)})")
            found = {key: _plain(getattr(processor, key, None)) for key in expected}
            if name == "RepetitionPenaltyLogitsProcessor":       # compared as the columns it ignores, per row
                found["prompt_ignore_length"] = _ignored_columns(processor.prompt_ignore_length, self.rows)
                expected["prompt_ignore_length"] = _plain(penalty_start(attention_mask, self.rows, "cpu"))
            if found != expected:
                raise UnsupportedSelection(f"device selection off: {name} {found} differs from "
                                           f"the generation config's {expected}")
        for criterion in stopping_criteria:
            name = type(criterion).__name__
            if name not in ("MaxLengthCriteria", "EosTokenCriteria") or type(criterion) is not getattr(
                    criteria_module, name):
                raise UnsupportedSelection(f"device selection off: {type(criterion).__qualname__} not supported")
            found = (criterion.max_length if name == "MaxLengthCriteria" else _plain(criterion.eos_token_id))
            expected = self.max_length if name == "MaxLengthCriteria" else self.eos_token_ids
            if found != expected:
                raise UnsupportedSelection(f"device selection off: {name} {found} differs from {expected}")

    def _parameters_of(self, processor_name: str) -> dict:
        keep = self.min_tokens_to_keep
        return {
            "RepetitionPenaltyLogitsProcessor": {"penalty": self.repetition_penalty, "prompt_ignore_length": None,
                                                 "logits_indices": None, "cu_seq_lens_q": None},
            "NoBadWordsLogitsProcessor": {"sequence_bias": {(t,): -math.inf for t in self.bad_words_ids or ()}},
            "NoRepeatNGramLogitsProcessor": {"ngram_size": self.no_repeat_ngram_size},
            "EncoderNoRepeatNGramLogitsProcessor": {"ngram_size": self.encoder_no_repeat_ngram_size,
                                                    "batch_size": self.batch_size},
            "MinLengthLogitsProcessor": {"min_length": self.min_length, "eos_token_id": self.eos_token_ids},
            "MinNewTokensLengthLogitsProcessor": {"prompt_length_to_skip": self.prompt_length,
                                                  "min_new_tokens": self.min_new_tokens,
                                                  "eos_token_id": self.eos_token_ids},
            "TemperatureLogitsWarper": {"temperature": self.temperature},
            "TopKLogitsWarper": {"top_k": max(self.top_k or 0, keep), "filter_value": -math.inf},
            "TopPLogitsWarper": {"top_p": self.top_p, "min_tokens_to_keep": keep, "filter_value": -math.inf},
            "MinPLogitsWarper": {"min_p": self.min_p, "min_tokens_to_keep": keep, "filter_value": -math.inf},
            "ForcedBOSTokenLogitsProcessor": {"bos_token_id": self.forced_bos_token_id},
            "ForcedEOSTokenLogitsProcessor": {"max_length": self.max_length, "eos_token_id": self.forced_eos_token_ids},
            "SuppressTokensLogitsProcessor": {"suppress_tokens": self.suppress_tokens},
            "SuppressTokensAtBeginLogitsProcessor": {"begin_suppress_tokens": self.begin_suppress_tokens,
                                                     "begin_index": self.begin_suppress_index},
        }[processor_name]

    def _default_begin_index(self) -> None:
        """Where transformers' SuppressTokensAtBegin applies for the generation config: the first generated
        position, or the one after a forced BOS token (a one-token prompt)."""
        if self.begin_suppress_tokens is not None and self.begin_suppress_index is None:
            forced = self.prompt_length == 1 and self.forced_bos_token_id is not None
            object.__setattr__(self, "begin_suppress_index", self.prompt_length + int(forced))

    def adopting_suppressions(self, logits_processor) -> "SelectionConfig":
        """This config plus the token suppressions that a caller's list brings as processor objects (Whisper's
        generate makes its SuppressTokens / SuppressTokensAtBegin processors itself, the generation config's fields
        unset): their parameters read from the objects, which :meth:`check_against` then compares as usual."""
        from transformers.generation import logits_process
        changes = {}
        for processor in logits_processor:
            if type(processor) is logits_process.SuppressTokensLogitsProcessor and self.suppress_tokens is None:
                changes["suppress_tokens"] = _token_tuple(processor.suppress_tokens)
            elif (type(processor) is logits_process.SuppressTokensAtBeginLogitsProcessor
                  and self.begin_suppress_tokens is None):
                changes["begin_suppress_tokens"] = _token_tuple(processor.begin_suppress_tokens)
                changes["begin_suppress_index"] = int(processor.begin_index)
        return dataclasses.replace(self, **changes) if changes else self

    def processor_names(self) -> tuple[str, ...]:
        """The transformers processors this config applies, in transformers' order (``_get_logits_processor``)."""
        names = []
        if self.repetition_penalty != 1.0:
            names.append("RepetitionPenaltyLogitsProcessor")
        if self.no_repeat_ngram_size > 0:
            names.append("NoRepeatNGramLogitsProcessor")
        if self.encoder_no_repeat_ngram_size > 0:
            names.append("EncoderNoRepeatNGramLogitsProcessor")
        if self.bad_words_ids is not None:
            names.append("NoBadWordsLogitsProcessor")
        if self.min_length > 0 and self.eos_token_ids:
            names.append("MinLengthLogitsProcessor")
        if self.min_new_tokens > 0 and self.eos_token_ids:
            names.append("MinNewTokensLengthLogitsProcessor")
        if self.forced_bos_token_id is not None:
            names.append("ForcedBOSTokenLogitsProcessor")
        if self.forced_eos_token_ids is not None:
            names.append("ForcedEOSTokenLogitsProcessor")
        if self.suppress_tokens is not None:
            names.append("SuppressTokensLogitsProcessor")
        if self.begin_suppress_tokens is not None:
            names.append("SuppressTokensAtBeginLogitsProcessor")
        if self.do_sample:
            if self.temperature != 1.0:
                names.append("TemperatureLogitsWarper")
            if self.top_k is not None and self.top_k != 0:
                names.append("TopKLogitsWarper")
            if self.top_p < 1.0:
                names.append("TopPLogitsWarper")
            if self.min_p is not None:
                names.append("MinPLogitsWarper")
        return tuple(names)


# the config's fields that follow the prompt's length: the step reads them from the state's tensors (of
# ``min_length`` — transformers sets it to the prompt's length + ``min_new_tokens`` — only whether it applies)
_PER_PROMPT = ("prompt_length", "max_length", "begin_suppress_index", "min_length")


def shape_key(config: SelectionConfig) -> tuple:
    """What a compiled or captured step bakes in of ``config``: every field but those that follow the prompt's length
    (the state holds them as tensors: ``prompt_len``, ``max_len``, ``begin_suppress_at``, ``min_len``)."""
    return (*((f.name, getattr(config, f.name)) for f in fields(config) if f.name not in _PER_PROMPT),
            ("min_length > 0", config.min_length > 0))


@dataclass
class SelectionState:
    """The buffers of one call, created once by ``new_state`` and updated in place by ``step`` (a captured graph
    keeps their addresses). Beam-search fields are ``[batch, num_beams, ...]``; the others are per row."""
    config: SelectionConfig
    sequences: torch.Tensor             # [rows, W] int64: prompt, then the chosen tokens (running beams); W is
                                        # max_length bucketed (plan.shape_bucket), the columns past it never read
    cur_len: torch.Tensor               # [] int64: filled width of ``sequences``
    done: torch.Tensor                  # [] bool: the call has finished; later steps change nothing
    invalid: torch.Tensor               # [] bool: a sampling step met NaN/inf probabilities (finalize raises, as stock)
    unfinished: torch.Tensor            # [rows] bool: sampling/greedy rows still generating
    row_ids: torch.Tensor               # [rows] int64: the identity parents
    eos_ids: torch.Tensor               # [n_eos] int64
    prompt_start: torch.Tensor          # [rows] int64: first non-pad prompt position (repetition penalty skips pads)
    generator: torch.Generator | None = None
    # the token ids of the forcing / suppressing processors the config applies, by role (int64 tensors)
    token_ids: dict[str, torch.Tensor] = field(default_factory=dict)
    # encoder_no_repeat_ngram_size: each row's encoder n-grams, [rows, G, n - 1] prefixes and [rows, G] last tokens
    # (vocab-free padding: -1 prefixes never match a written token, padded last tokens are -1 and masked)
    encoder_ngram_prefixes: torch.Tensor | None = None
    encoder_ngram_lasts: torch.Tensor | None = None
    # beam search only
    beam_scores: torch.Tensor | None = None         # [B, nb] float32: running beams' summed log-probs
    finished_sequences: torch.Tensor | None = None  # [B, nb, max_length] int64: the best finished hypotheses
    finished_scores: torch.Tensor | None = None     # [B, nb] float32, length-penalised, sorted descending
    finished_lengths: torch.Tensor | None = None    # [B, nb] int64: generated tokens of each hypothesis
    is_finished: torch.Tensor | None = None         # [B, nb] bool: the slot holds a finished hypothesis
    improvement_possible: torch.Tensor | None = None  # [B, 1] bool: transformers' sticky early-stop heuristic
    length_divisors: torch.Tensor | None = None     # [max_length - prompt_length + 2] float32: t ** length_penalty
    top_num_beams: torch.Tensor | None = None       # [candidates] bool: only these ranks may finish
    batch_offsets: torch.Tensor | None = None       # [B, 1] int64: first row of each prompt
    # the call's lengths as device values, not Python numbers (a compiled step guards on every number it reads: one
    # compile would serve one prompt length): [] int64 each
    prompt_len: torch.Tensor | None = None          # config.prompt_length
    max_len: torch.Tensor | None = None             # config.max_length
    begin_suppress_at: torch.Tensor | None = None   # config.begin_suppress_index (with begin_suppress_tokens)
    min_len: torch.Tensor | None = None             # config.min_length (where it is > 0)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state's buffers by name (what a captured graph must keep alive and in place)."""
        tensors = {f.name: getattr(self, f.name) for f in fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        tensors.update({f"token_ids.{role}": ids for role, ids in self.token_ids.items()})
        return tensors


def new_state(config: SelectionConfig, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
              generator: torch.Generator | None = None, encoder_ngrams: list[dict] | None = None,
              width: int | None = None) -> SelectionState:
    """The state for one call. ``input_ids`` / ``attention_mask`` are ``[rows, prompt_length]``, expanded as
    transformers expands them (each prompt repeated num_beams or num_return_sequences times, prompt-major).
    ``encoder_ngrams``: with ``encoder_no_repeat_ngram_size``, the call's EncoderNoRepeatNGramLogitsProcessor's
    ``generated_ngrams`` (one dict per prompt: n-gram prefix -> the tokens that complete it in that encoder input).
    ``width``: the sequence buffers' width where it is wider than ``max_length`` bucketed (a kept step's, which a
    call of a shorter prompt then fills: the columns past ``max_length`` are never read)."""
    rows, prompt_length = input_ids.shape
    if rows != config.rows or prompt_length != config.prompt_length:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} do not match the config's {config.rows} rows of "
                         f"{config.prompt_length} tokens; expand the prompts as generate does first")
    if config.max_length <= prompt_length:
        raise ValueError(f"max_length {config.max_length} leaves no room after a {prompt_length}-token prompt")
    device = input_ids.device
    sequences = torch.full((rows, max(shape_bucket(config.max_length, MIN_BUCKET_TOKENS), width or 0)),
                           fill_value(config),
                           dtype=torch.int64, device=device)
    sequences[:, :prompt_length] = input_ids
    prompt_start = penalty_start(attention_mask, rows, device)
    state = SelectionState(
        config=config, sequences=sequences,
        cur_len=torch.tensor(prompt_length, dtype=torch.int64, device=device),
        done=torch.zeros((), dtype=torch.bool, device=device),
        invalid=torch.zeros((), dtype=torch.bool, device=device),
        unfinished=torch.ones(rows, dtype=torch.bool, device=device),
        row_ids=torch.arange(rows, device=device),
        eos_ids=torch.tensor(config.eos_token_ids, dtype=torch.int64, device=device),
        prompt_start=prompt_start, generator=generator,
        prompt_len=torch.tensor(prompt_length, dtype=torch.int64, device=device),
        max_len=torch.tensor(config.max_length, dtype=torch.int64, device=device))
    if config.begin_suppress_tokens is not None:
        state.begin_suppress_at = torch.tensor(config.begin_suppress_index, dtype=torch.int64, device=device)
    if config.min_length > 0:
        state.min_len = torch.tensor(config.min_length, dtype=torch.int64, device=device)
    for role, ids in (("forced_bos", None if config.forced_bos_token_id is None else (config.forced_bos_token_id,)),
                      ("forced_eos", config.forced_eos_token_ids), ("suppress", config.suppress_tokens),
                      ("begin_suppress", config.begin_suppress_tokens), ("bad_words", config.bad_words_ids)):
        if ids is not None:
            state.token_ids[role] = torch.tensor(ids, dtype=torch.int64, device=device)
    if config.encoder_no_repeat_ngram_size > 0:
        state.encoder_ngram_prefixes, state.encoder_ngram_lasts = _encoder_ngram_tensors(
            config, encoder_ngrams, rows, device)
    if config.is_beam:
        batch, beams = config.batch_size, config.num_beams
        state.beam_scores = torch.zeros((batch, beams), dtype=torch.float32, device=device)
        state.beam_scores[:, 1:] = NEG_INF_SCORE     # only beam 0 expands at first: the beams start equal
        state.finished_sequences = sequences.view(batch, beams, -1).clone()
        state.finished_scores = torch.full((batch, beams), NEG_INF_SCORE, dtype=torch.float32, device=device)
        state.finished_lengths = torch.zeros((batch, beams), dtype=torch.int64, device=device)
        state.is_finished = torch.zeros((batch, beams), dtype=torch.bool, device=device)
        state.improvement_possible = torch.ones((batch, 1), dtype=torch.bool, device=device)
        state.length_divisors = _length_divisors(config, device)
        state.top_num_beams = torch.arange(config.candidates, device=device) < beams
        state.batch_offsets = torch.arange(batch, device=device).view(-1, 1) * beams
    return state


def step(state: SelectionState, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step from the forward's last-position ``logits [rows, vocab]``: updates ``state`` in place and returns
    ``(next_tokens [rows], parents [rows])``, the row of the previous step each new row continues (the identity
    outside beam search; the cache reorders by it). After ``done``, returns the fill token and the identity."""
    if state.config.is_beam:
        return _beam_step(state, logits)
    return _sample_step(state, logits)


@dataclass
class SelectionOutput:
    sequences: torch.Tensor                     # [batch * num_return_sequences, length]
    sequences_scores: torch.Tensor | None       # beam search only: the length-penalised scores


def finalize(state: SelectionState) -> SelectionOutput:
    """What ``generate`` returns for the call (runs once, on the host: it reads lengths). Raises stock's error where a
    sampling step drew from NaN or infinite probabilities (``torch.multinomial`` raises it there)."""
    config = state.config
    if bool(state.invalid):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0 (a sampling step of "
                           "generate met NaN or infinite scores, e.g. all -inf logits or a NaN in the model's "
                           "output; stock's torch.multinomial raises this error at that step)")
    if not config.is_beam:
        return SelectionOutput(state.sequences[:, :int(state.cur_len)].clone(), None)
    returned = config.num_return_sequences
    sequences = state.finished_sequences[:, :returned].reshape(config.batch_size * returned, -1)
    scores = state.finished_scores[:, :returned].reshape(-1)
    # transformers crops to the longest returned hypothesis, counted from its beam indices
    length = config.prompt_length + int(state.finished_lengths[:, :returned].max())
    return SelectionOutput(sequences[:, :length].clone(), scores.clone())


# --- the step -----------------------------------------------------------------------------------------------

def sample_tokens(state: SelectionState, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A greedy / sampling step's chosen token per row ``[rows]``, before finished rows take the pad token: the
    processors, then the argmax or the draw; and, sampling, the draw's probabilities summed (:func:`flag_invalid`'s
    argument; None for greedy). Greedy without processors takes the argmax of the logits as they are: their float32
    copy has the same order and the same first maximum."""
    config = state.config
    if not config.do_sample and not config.processor_names():
        return torch.argmax(logits, dim=-1), None
    scores = process_logits(state, logits.to(copy=True, dtype=torch.float32))
    if config.do_sample:
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return _multinomial(probs, 1, state.generator).squeeze(1), probs.sum()
    return torch.argmax(scores, dim=-1), None


def _sample_step(state: SelectionState, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    config, active = state.config, ~state.done
    tokens, probs_total = sample_tokens(state, logits)
    flag_invalid(state, probs_total)
    if config.eos_token_ids:    # finished rows repeat the pad token
        unfinished = state.unfinished.to(torch.int64)
        tokens = tokens * unfinished + config.pad_token_id * (1 - unfinished)
    tokens = torch.where(active, tokens, fill_value(config))
    _write_column(state.sequences, state.cur_len, tokens, active)
    hits = _stopping_hits(state, tokens, state.cur_len + 1)
    state.unfinished.copy_(state.unfinished & ~(hits & active))
    state.cur_len.add_(active.to(torch.int64))
    state.done.copy_(state.done | ~state.unfinished.any() | state.invalid)
    return tokens, state.row_ids


def beam_candidates(state: SelectionState, logits: torch.Tensor, topk=None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A beam step's ``candidates`` continuations per prompt over beams x vocab (transformers'
    ``_get_top_k_continuations``): ``(top_log_probs [B, K] float32, top_indices [B, K] int64, probs_total)``, an index
    being ``beam * vocab + token``; ``probs_total`` the draw's probabilities summed where the beams are sampled
    (:func:`flag_invalid`'s argument), else None. ``topk(scores, k)``: what ranks them where they are not sampled
    (default :func:`top_candidates`; one that returns None leaves it to that)."""
    config = state.config
    batch, beams, candidates = config.batch_size, config.num_beams, config.candidates
    log_probs = torch.nn.functional.log_softmax(logits.to(copy=True, dtype=torch.float32), dim=-1)
    log_probs = process_logits(state, log_probs)            # beam search processes log-probs, not logits
    vocab = log_probs.shape[-1]
    log_probs = log_probs.reshape(batch, beams, vocab) + state.beam_scores[:, :, None]
    log_probs = torch.reshape(log_probs, (batch, -1))
    if config.do_sample:
        probs = torch.nn.functional.softmax(log_probs, dim=-1)
        top_indices = _multinomial(probs, candidates, state.generator)
        top_log_probs = torch.gather(input=log_probs, dim=1, index=top_indices)
        if _TRANSFORMERS_5_24:
            top_log_probs, order = top_log_probs.sort(dim=-1, descending=True)
            top_indices = top_indices.gather(dim=-1, index=order)
        return top_log_probs, top_indices, probs.sum()
    ranked = None if topk is None else topk(log_probs, candidates)
    return *(top_candidates(log_probs, candidates) if ranked is None else ranked), None


def top_candidates(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` of the ``k`` best of ``scores [B, n]`` as transformers ranks them (``torch.topk``, its tie
    order)."""
    return torch.topk(scores, k=k)


def top_beams(scores: torch.Tensor, beams: int) -> torch.Tensor:
    """The indices of the ``beams`` best of ``scores [B, n]`` as transformers ranks them (``torch.topk``, its tie
    order): the running beams among the candidates, the finished store's among its own and the candidates."""
    return torch.topk(scores, k=beams)[1]


def _beam_step(state: SelectionState, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    config, active, cur_len = state.config, ~state.done, state.cur_len
    batch, beams, candidates = config.batch_size, config.num_beams, config.candidates
    vocab = logits.shape[-1]
    top_log_probs, top_indices, probs_total = beam_candidates(state, logits)
    flag_invalid(state, probs_total)
    top_parents = top_indices // vocab                              # [B, K] beam within the prompt
    top_tokens = top_indices % vocab
    running = state.sequences.view(batch, beams, -1)
    top_sequences = _gather_beams(running, top_parents)
    top_sequences = torch.where(_column_mask(state, cur_len), top_tokens[:, :, None], top_sequences)
    top_rows = top_parents + state.batch_offsets                    # global parent rows

    hits = _stopping_hits(state, top_tokens, cur_len + 1)           # [B, K]

    # the num_beams best candidates that did not stop run on (_get_running_beams_for_next_iteration)
    # (x + flag x NEG_INF_SCORE in one kernel: a 0/1 flag makes the product exact, so the sums are transformers' bits)
    running_log_probs = torch.add(top_log_probs, hits, alpha=NEG_INF_SCORE)
    next_indices = top_beams(running_log_probs, beams)
    next_sequences = _gather_beams(top_sequences, next_indices)
    next_scores = _gather_beams(running_log_probs, next_indices)
    parents = _gather_beams(top_rows, next_indices).reshape(-1)

    # candidates that stopped within the first num_beams ranks enter the finished store (_update_finished_beams)
    just_finished = hits & state.top_num_beams[None, :]
    finished_log_probs = _divide_by_length(state, top_log_probs, cur_len + 1 - state.prompt_len)
    if config.early_stopping is True:
        full = torch.all(state.is_finished, dim=-1, keepdim=True)
        finished_log_probs = torch.add(finished_log_probs, full, alpha=NEG_INF_SCORE)
    finished_log_probs = torch.add(finished_log_probs, ~state.improvement_possible, alpha=NEG_INF_SCORE)
    finished_log_probs = torch.add(finished_log_probs, ~just_finished, alpha=NEG_INF_SCORE)
    candidate_lengths = (cur_len + 1 - state.prompt_len).expand(batch, candidates)
    merged_scores = torch.cat((state.finished_scores, finished_log_probs), dim=1)
    keep = top_beams(merged_scores, beams)
    finished_sequences = _gather_beams(torch.cat((state.finished_sequences, top_sequences), dim=1), keep)
    finished_scores = _gather_beams(merged_scores, keep)
    finished_lengths = _gather_beams(torch.cat((state.finished_lengths, candidate_lengths), dim=1), keep)
    is_finished = _gather_beams(torch.cat((state.is_finished, just_finished), dim=1), keep)

    # the sticky early-stop heuristic, on the next length (_check_early_stop_heuristic)
    if config.early_stopping == "never" and config.length_penalty > 0.0:
        best_length = (state.max_len - state.prompt_len).expand_as(cur_len)
    else:
        best_length = cur_len + 1 - state.prompt_len
    best_possible = _divide_by_length(state, next_scores[:, :1], best_length)
    worst_finished = torch.where(is_finished, torch.min(finished_scores, dim=1, keepdim=True)[0], NEG_INF_SCORE)
    improvement_possible = state.improvement_possible & torch.any(best_possible > worst_finished, dim=-1,
                                                                  keepdim=True)
    # _beam_search_has_unfinished_sequences
    still_running = torch.any(improvement_possible) & ~torch.all(hits)
    if config.early_stopping is True:
        still_running = still_running & ~torch.all(is_finished)

    _assign(state.sequences, next_sequences.reshape(config.rows, -1), active)
    _assign(state.beam_scores, next_scores, active)
    _assign(state.finished_sequences, finished_sequences, active)
    _assign(state.finished_scores, finished_scores, active)
    _assign(state.finished_lengths, finished_lengths, active)
    _assign(state.is_finished, is_finished, active)
    _assign(state.improvement_possible, improvement_possible, active)
    next_tokens = torch.where(active, _gather_beams(top_tokens, next_indices).reshape(-1), fill_value(config))
    parents = torch.where(active, parents, state.row_ids)
    state.cur_len.add_(active.to(torch.int64))
    state.done.copy_(state.done | ~still_running | state.invalid)
    return next_tokens, parents


# --- logits processing ----------------------------------------------------------------------------------------

def process_logits(state: SelectionState, scores: torch.Tensor) -> torch.Tensor:
    """transformers' processors of ``SelectionConfig.processor_names``, in its order, on ``scores [rows, vocab]``
    float32 (logits for sampling/greedy, log-probs for beam search), reading the sequences up to ``cur_len``."""
    config = state.config
    if config.repetition_penalty != 1.0:
        scores = _repetition_penalty(state, scores, config.repetition_penalty)
    if config.no_repeat_ngram_size > 0:
        scores = _no_repeat_ngram(state, scores, config.no_repeat_ngram_size)
    if config.encoder_no_repeat_ngram_size > 0:
        scores = _encoder_no_repeat_ngram(state, scores, config.encoder_no_repeat_ngram_size)
    if config.bad_words_ids is not None:       # (a bias of -inf added, as SequenceBiasLogitsProcessor adds it)
        scores = scores + torch.where(_token_mask(scores, state.token_ids["bad_words"]), -math.inf, 0.0).to(
            scores.dtype)
    if state.min_len is not None and config.eos_token_ids:     # (not config.min_length: a compile would guard on it)
        scores = _ban_eos_while(state, scores, state.cur_len < state.min_len)
    if config.min_new_tokens > 0 and config.eos_token_ids:
        scores = _ban_eos_while(state, scores, state.cur_len - state.prompt_len < config.min_new_tokens)
    if config.forced_bos_token_id is not None:
        scores = _force_while(scores, state.token_ids["forced_bos"], state.cur_len == 1)
    if config.forced_eos_token_ids is not None:
        scores = _force_while(scores, state.token_ids["forced_eos"], state.cur_len == state.max_len - 1)
    if config.suppress_tokens is not None:
        scores = _suppress_while(scores, state.token_ids["suppress"], None)
    if config.begin_suppress_tokens is not None:
        scores = _suppress_while(scores, state.token_ids["begin_suppress"],
                                 state.cur_len == state.begin_suppress_at)
    if config.do_sample:
        keep = config.min_tokens_to_keep
        if config.temperature != 1.0:
            scores = scores / config.temperature
        if config.top_k is not None and config.top_k != 0:
            scores = _top_k(scores, max(config.top_k, keep))
        if config.top_p < 1.0:
            scores = _top_p(scores, config.top_p, keep)
        if config.min_p is not None:
            scores = _min_p(scores, config.min_p, keep)
    return scores


def _repetition_penalty(state: SelectionState, scores: torch.Tensor, penalty: float) -> torch.Tensor:
    """RepetitionPenaltyLogitsProcessor: each token seen (left padding excepted) has its score divided by the
    penalty, or multiplied where negative. Positions past cur_len point at a spare column that is dropped."""
    vocab = scores.shape[-1]
    positions = torch.arange(state.sequences.shape[1], device=scores.device)
    seen = (positions[None, :] < state.cur_len) & (positions[None, :] >= state.prompt_start[:, None])
    ids = torch.where(seen, state.sequences.clamp(min=0, max=vocab), vocab)
    token_mask = torch.zeros((scores.shape[0], vocab + 1), dtype=torch.bool, device=scores.device)
    token_mask.scatter_(1, ids, True)
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(token_mask[:, :vocab], penalized, scores)


def _no_repeat_ngram(state: SelectionState, scores: torch.Tensor, size: int) -> torch.Tensor:
    """NoRepeatNGramLogitsProcessor: a token that would complete an n-gram already in the sequence is banned.
    Windows over the whole buffer; only those ending before cur_len count (none while cur_len < n)."""
    vocab, sequences = scores.shape[-1], state.sequences
    if sequences.shape[1] < size:       # max_length shorter than an n-gram: none is ever complete (a static shape)
        return scores
    windows = sequences.unfold(dimension=1, size=size, step=1)            # [rows, max_length - n + 1, n]
    starts = torch.arange(windows.shape[1], device=scores.device)
    complete = starts <= state.cur_len - size
    prefix_positions = (state.cur_len - size + 1 + torch.arange(size - 1, device=scores.device)).clamp(min=0)
    prefix = sequences.index_select(1, prefix_positions)                  # the last n - 1 tokens
    matches = (windows[..., :-1] == prefix.unsqueeze(1)).all(dim=-1) & complete[None, :]
    banned = torch.zeros((scores.shape[0], vocab + 1), dtype=torch.bool, device=scores.device)
    banned.scatter_(1, torch.where(matches, windows[..., -1].clamp(min=0, max=vocab), vocab), True)
    return scores.masked_fill(banned[:, :vocab], -float("inf"))


def _encoder_no_repeat_ngram(state: SelectionState, scores: torch.Tensor, size: int) -> torch.Tensor:
    """EncoderNoRepeatNGramLogitsProcessor: a token that would complete an n-gram of the row's encoder input is banned
    once the sequence holds n - 1 tokens (its last n - 1 against the input's n-gram prefixes)."""
    vocab = scores.shape[-1]
    positions = (state.cur_len - size + 1 + torch.arange(size - 1, device=scores.device)).clamp(min=0)
    recent = state.sequences.index_select(1, positions)                   # [rows, n - 1]
    matches = (state.encoder_ngram_prefixes == recent[:, None, :]).all(dim=-1) & (state.cur_len >= size - 1)
    lasts = torch.where(matches & (state.encoder_ngram_lasts >= 0), state.encoder_ngram_lasts, vocab)
    banned = torch.zeros((scores.shape[0], vocab + 1), dtype=torch.bool, device=scores.device)
    banned.scatter_(1, lasts.clamp(max=vocab), True)
    return scores.masked_fill(banned[:, :vocab], -float("inf"))


def _encoder_ngram_tensors(config: SelectionConfig, encoder_ngrams, rows: int, device):
    """Each row's encoder n-grams as ``([rows, G, n - 1] prefixes, [rows, G] last tokens)``, padded with -1 (built
    once per call, on the host, from the processor's dicts; rows of one prompt share its input's)."""
    if encoder_ngrams is None or len(encoder_ngrams) != config.batch_size:
        raise ValueError(f"encoder_no_repeat_ngram_size={config.encoder_no_repeat_ngram_size} needs the call's "
                         f"EncoderNoRepeatNGramLogitsProcessor n-grams, one dict per prompt ({config.batch_size})")
    entries = [[(prefix, last) for prefix, lasts in ngrams.items() for last in lasts] for ngrams in encoder_ngrams]
    width, prefix_length = max(1, max(len(e) for e in entries)), config.encoder_no_repeat_ngram_size - 1
    prefixes = [[list(p) for p, _ in e] + [[-1] * prefix_length] * (width - len(e)) for e in entries]
    lasts = [[t for _, t in e] + [-1] * (width - len(e)) for e in entries]
    per_prompt = rows // config.batch_size
    prefixes = torch.tensor(prefixes, dtype=torch.int64).view(config.batch_size, width, prefix_length)
    lasts = torch.tensor(lasts, dtype=torch.int64)
    return (prefixes.repeat_interleave(per_prompt, dim=0).to(device),
            lasts.repeat_interleave(per_prompt, dim=0).to(device))


def _ban_eos_while(state: SelectionState, scores: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
    """MinLength / MinNewTokensLength: eos scores are -inf while ``condition`` (a device bool) holds."""
    vocab_ids = torch.arange(scores.shape[-1], device=scores.device)
    eos_mask = (vocab_ids[:, None] == state.eos_ids[None, :]).any(dim=-1)
    return torch.where(eos_mask & condition, -math.inf, scores)


def _token_mask(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[vocab]`` bool, true at the token ids ``ids`` (a state tensor: no host read, nothing uploaded)."""
    return torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device).index_fill_(0, ids, True)


def _force_while(scores: torch.Tensor, ids: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
    """ForcedBOSToken / ForcedEOSToken: while ``condition`` (a device bool), every score is -inf but those of
    ``ids`` (0)."""
    forced = torch.where(_token_mask(scores, ids), 0.0, -math.inf).to(scores.dtype)
    return torch.where(condition, forced, scores)


def _suppress_while(scores: torch.Tensor, ids: torch.Tensor, condition: torch.Tensor | None) -> torch.Tensor:
    """SuppressTokens (always: ``condition`` None) / SuppressTokensAtBegin: the scores of ``ids`` are -inf."""
    mask = _token_mask(scores, ids)
    return torch.where(mask if condition is None else mask & condition, -math.inf, scores)


def _top_k(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    top_k = min(top_k, scores.size(-1))
    return scores.masked_fill(scores < torch.topk(scores, top_k)[0][..., -1, None], -float("inf"))


def _top_p(scores: torch.Tensor, top_p: float, min_tokens_to_keep: int) -> torch.Tensor:
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_to_remove = cumulative_probs <= (1 - top_p)
    sorted_to_remove[..., -min_tokens_to_keep:].fill_(False)     # a view (no host scalar copied: capturable)
    to_remove = sorted_to_remove.scatter(1, sorted_indices, sorted_to_remove)
    return scores.masked_fill(to_remove, -float("inf"))


def _min_p(scores: torch.Tensor, min_p: float, min_tokens_to_keep: int) -> torch.Tensor:
    probs = torch.softmax(scores, dim=-1)
    to_remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    kept = torch.topk(probs, min(min_tokens_to_keep, probs.shape[-1]), dim=-1).indices
    to_remove.scatter_(-1, kept, False)
    return scores.masked_fill(to_remove, -float("inf"))


# --- helpers --------------------------------------------------------------------------------------------------

def _stopping_hits(state: SelectionState, tokens: torch.Tensor, new_len: torch.Tensor) -> torch.Tensor:
    """MaxLengthCriteria | EosTokenCriteria for sequences of ``new_len`` tokens ending in ``tokens``."""
    hits = (new_len >= state.max_len).expand(tokens.shape)
    if state.config.eos_token_ids:
        hits = hits | (tokens[..., None] == state.eos_ids).any(dim=-1)
    return hits


def _single_token_bad_words(bad_words_ids, eos: tuple[int, ...]) -> tuple[int, ...] | None:
    """The tokens NoBadWordsLogitsProcessor bans for ``bad_words_ids`` (a sequence that is one eos token is left
    out, as transformers leaves it out); UnsupportedSelection where a bad word has several tokens."""
    if bad_words_ids is None:
        return None
    sequences = [tuple(int(t) for t in sequence) for sequence in bad_words_ids]
    if any(len(sequence) != 1 for sequence in sequences):
        raise UnsupportedSelection(f"device selection off: bad_words_ids={bad_words_ids!r} is not supported "
                                   "(only single-token bad words are)")
    return tuple(sequence[0] for sequence in sequences if sequence[0] not in eos)


def _commuted(names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` with SuppressTokensAtBegin before SuppressTokens swapped into transformers' order (Whisper lists
    them so): both only set scores to -inf, so either order gives the same scores."""
    names = list(names)
    for i in range(len(names) - 1):
        if names[i:i + 2] == ["SuppressTokensAtBeginLogitsProcessor", "SuppressTokensLogitsProcessor"]:
            names[i:i + 2] = names[i + 1], names[i]
    return tuple(names)


def _token_tuple(value) -> tuple[int, ...] | None:
    """A generation config's token id setting (an int, a list, a tensor) as a tuple; None stays None."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return tuple(int(v) for v in value.reshape(-1))
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


# what a processor keeps besides its parameters that cannot change its result (caches it prepares from them on its
# first call), or that the device loop reads from the object itself (the encoder n-grams)
_DERIVED_STATE = {"NoBadWordsLogitsProcessor": ("length_1_bias", "multi_token_biases", "prepared_bias_variables",
                                                "bad_word_ids"),      # (as given: its sequence_bias is what applies)
                  "TopKLogitsWarper": ("min_tokens_to_keep",),       # folded into its top_k when it is made
                  "EncoderNoRepeatNGramLogitsProcessor": ("generated_ngrams",)}


def penalty_start(attention_mask: torch.Tensor | None, rows: int, device) -> torch.Tensor:
    """``[rows]`` int64: the first prompt column the repetition penalty counts, as transformers' default processor
    has it: the left padding from 5.24 (its ``prompt_ignore_length``), none before."""
    if attention_mask is None or not _TRANSFORMERS_5_24:
        return torch.zeros(rows, dtype=torch.int64, device=device)
    return (attention_mask != 0).int().argmax(dim=1).to(device=device, dtype=torch.int64)



def _ignored_columns(prompt_ignore_length, rows: int) -> tuple | str:
    """A RepetitionPenaltyLogitsProcessor's ``prompt_ignore_length`` as the columns it skips per row (None: none; an
    int: that many in every row; a tensor: per row), comparable with :func:`penalty_start`."""
    if prompt_ignore_length is None:
        return (0,) * rows
    if isinstance(prompt_ignore_length, int):
        return (prompt_ignore_length,) * rows
    if isinstance(prompt_ignore_length, torch.Tensor) and prompt_ignore_length.shape == (rows,):
        return _plain(prompt_ignore_length)
    return f"an unexpected prompt_ignore_length {prompt_ignore_length!r}"


def _plain(value):
    """A processor's parameter as a comparable Python value (eos ids as a tuple)."""
    if isinstance(value, torch.Tensor):
        return tuple(int(v) for v in value.reshape(-1))
    if isinstance(value, list):
        return tuple(value)
    return value


def flag_invalid(state: SelectionState, probs_total: torch.Tensor | None) -> None:
    """What ATen's multinomial checks on the host before it draws, as a sticky device flag (no sync): a NaN or infinite
    probability (softmax of NaN, or of a row of -inf scores) in a step that runs. The call then stops (``done``) and
    :func:`finalize` raises. ``probs_total``: the draw's softmax probabilities summed (None: no draw). Each is in
    [0, 1] or NaN (a softmax gives no inf), so the sum is finite exactly where every probability is: one reduction
    instead of the elementwise test's four passes."""
    if probs_total is not None:
        state.invalid.copy_(state.invalid | (~state.done & ~torch.isfinite(probs_total)))


def _multinomial(probs: torch.Tensor, num_samples: int, generator: torch.Generator | None) -> torch.Tensor:
    """``torch.multinomial(probs, num_samples)`` (without replacement) as ATen computes it, drawing the same random
    numbers: the top ``num_samples`` of ``probs / q`` with ``q ~ Exp(1)``. ATen first checks the probabilities
    with a host read, which this leaves out (a bad distribution gives some token instead of an error)."""
    draws = probs / torch.empty_like(probs).exponential_(1, generator=generator)
    if num_samples == 1:
        return torch.argmax(draws, dim=-1, keepdim=True)
    return torch.topk(draws, num_samples)[1]


def fill_value(config: SelectionConfig) -> int:
    """transformers' fill of unwritten positions: ``pad_token_id or eos[0]`` (so pad 0 fills with eos), -1 without
    eos; sampling fills nothing visible (its output stops at cur_len)."""
    if not config.eos_token_ids:
        return -1
    return config.pad_token_id if config.pad_token_id else config.eos_token_ids[0]


def _column_mask(state: SelectionState, position: torch.Tensor) -> torch.Tensor:
    """``[max_length]`` bool, true at ``position`` (none when position == max_length: nothing written)."""
    return torch.arange(state.sequences.shape[1], device=position.device) == position


def _write_column(sequences: torch.Tensor, position: torch.Tensor, tokens: torch.Tensor,
                  active: torch.Tensor) -> None:
    """``sequences[:, position] = tokens`` while ``active``; otherwise rewrites what is there (the position is
    clamped: it can only reach max_length once the call is done)."""
    column = position.clamp(max=sequences.shape[1] - 1).expand(sequences.shape[0], 1)
    current = sequences.gather(1, column).squeeze(1)
    sequences.scatter_(1, column, torch.where(active, tokens, current)[:, None])


def _assign(target: torch.Tensor, value: torch.Tensor, active: torch.Tensor) -> None:
    target.copy_(torch.where(active, value, target))


def _gather_beams(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """transformers' ``_gather_beams``: ``tensor[b, indices[b, i], ...]`` (``indices`` >= 0). One gather on the indices
    expanded (``take_along_dim`` would first wrap them with a remainder over the whole expanded shape: a kernel and a
    materialised index tensor per call, ~10 a beam step)."""
    while indices.dim() < tensor.dim():
        indices = indices.unsqueeze(-1)
    return tensor.gather(1, indices.expand(*indices.shape[:2], *tensor.shape[2:]))


def _length_divisors(config: SelectionConfig, device) -> torch.Tensor:
    """``t ** length_penalty`` for every generated length t, computed on the host as transformers does (a Python
    number). Dividing a float32 tensor by a Python number rounds the number to float32 on the CPU; on CUDA the
    division is a multiplication by float32(1 / s), so there the table holds reciprocals (see _divide_by_length)."""
    lengths = range(shape_bucket(config.max_length - config.prompt_length + 2, 1))   # (bucketed: new_state)
    values = [float(max(t, 1) ** config.length_penalty) for t in lengths]
    if _length_multiplied(device):     # reciprocal in double, then float32 (torch >= 2.11)
        values = [1.0 / v for v in values]
    return torch.tensor(values, dtype=torch.float32, device=device)


def _divide_by_length(state: SelectionState, scores: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
    """``scores / generated ** length_penalty`` bitwise as transformers computes it with a Python divisor, for a
    device length ``generated`` (clamped into the table; out-of-range lengths only occur after ``done``)."""
    index = generated.clamp(min=0, max=state.length_divisors.shape[0] - 1).view(1)
    factor = state.length_divisors.index_select(0, index)
    if _length_multiplied(factor.device):
        return scores * factor
    return scores / factor


def _length_multiplied(device) -> bool:
    """Whether torch divides a float32 tensor by a Python number on ``device`` as a multiplication by the number's
    float32 reciprocal (CUDA; the CPU divides). The kernel library's beam step multiplies (csrc/select.cu)."""
    return torch.device(device).type == "cuda"
