"""Token choice on the host for the project's decode loop: transformers' own ``_sample`` / ``_beam_search`` step.

Where a call chooses its tokens in a way :mod:`hf_cascade.device_select` does not reproduce (a logits processor or
stopping criterion of the user's own, a streamer, ``return_dict_in_generate`` with its scores, logits and beam
indices), :mod:`hf_cascade.whole_step` still runs its decode loop: the block bookkeeping and the forward as one step
(captured and replayed on a GPU), then :class:`HostChooser` on that step's logits, eagerly, outside the step. The
chooser does per step what transformers' loop does, in its order and dtypes: the logits taken as a float32 copy, the
call's ``logits_processor`` and ``stopping_criteria`` (sequences so far as their ``input_ids``), finished rows fed the
pad token, ``streamer.put`` of each step's tokens; beam search through ``GenerationMixin``'s own helpers (top-k
continuations, running and finished beams, the early-stop heuristic), so that the installed transformers decides
their rules (5.17 and 5.24 differ in beam sampling). It reads one value per step on the host (has the call finished?),
as transformers' loop does, and :meth:`HostChooser.finalize` returns what transformers' loop returns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.utils import (GenerateBeamDecoderOnlyOutput, GenerateBeamEncoderDecoderOutput,
                                           GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput)

from .. import compat


@dataclass
class HostState:
    """What a captured step reads of the host chooser: ``done [] bool``, set once the call has finished (the step's
    bookkeeping appends no token after it). Kept with the captured step, as the device chooser's state is."""
    done: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"done": self.done}


class HostChooser:
    """One call's token choice on the host (see the module docstring). ``input_ids [rows, prompt]`` as transformers'
    loop gets them (prompts expanded per beam or returned sequence); ``model``: its ``GenerationMixin`` helpers and
    whether it is an encoder-decoder. Call :meth:`choose` once per step, then :meth:`finalize`."""

    in_step = False         # runs after each step, outside the captured graph
    key = ("host",)         # what a captured step bakes in of it: nothing but ``state.done``

    def __init__(self, model, input_ids, logits_processor, stopping_criteria, generation_config, streamer=None):
        gc = generation_config
        self.model, self.processors, self.criteria, self.streamer = model, logits_processor, stopping_criteria, streamer
        self.device = input_ids.device
        self.beam = gc.num_beams > 1
        self.do_sample = bool(gc.do_sample)
        self.max_length = gc.max_length
        self.returned = bool(gc.return_dict_in_generate)
        self.output_scores = self.returned and bool(gc.output_scores)
        self.scores = () if self.output_scores else None
        self.raw_logits = () if self.returned and gc.output_logits else None
        self.state = HostState(torch.zeros((), dtype=torch.bool, device=self.device))
        self.finished = False
        if self.beam:
            self._init_beams(input_ids, gc)
        else:
            self.sequences = input_ids
            self.unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=self.device)
            pad = gc._pad_token_tensor
            self.pad = None if pad is None else pad.to(self.device)
            self.has_eos = any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)

    def _init_beams(self, input_ids, gc) -> None:
        """``_beam_search``'s running and finished beams, as it makes them."""
        m, device = self.model, self.device
        pad, eos = gc._pad_token_tensor, gc._eos_token_tensor
        self.num_beams, self.num_return = gc.num_beams, gc.num_return_sequences
        self.early_stopping, self.length_penalty = gc.early_stopping, gc.length_penalty
        self.batch = input_ids.shape[0] // self.num_beams
        self.cur_len = self.prompt_len = input_ids.shape[1]
        batch, beams = self.batch, self.num_beams
        self.beams_to_keep = max(2, 1 + (eos.shape[0] if eos is not None else 0)) * beams
        self.top_num_beam_mask = torch.cat((torch.ones(beams, dtype=torch.bool),
                                            torch.zeros(self.beams_to_keep - beams, dtype=torch.bool))).to(device)
        fill = pad or eos[0] if eos is not None else -1         # (stock's expression, precedence included)
        self.running_sequences = torch.full((batch, beams, self.max_length), fill_value=fill, dtype=torch.int64,
                                            device=device)
        self.running_sequences[:, :, :self.cur_len] = m._unflatten_beam_dim(input_ids, batch, beams)
        self.sequences = self.running_sequences.detach().clone()
        self.running_beam_scores = torch.zeros((batch, beams), dtype=torch.float, device=device)
        self.running_beam_scores[:, 1:] = -1e9
        self.beam_scores = torch.full((batch, beams), fill_value=-1e9, dtype=torch.float, device=device)
        self.is_sent_finished = torch.zeros((batch, beams), dtype=torch.bool, device=device)
        self.heuristic_unsatisfied = torch.ones((batch, 1), dtype=torch.bool, device=device)
        self.running_beam_indices = torch.full((batch, beams, self.max_length - self.cur_len), fill_value=-1,
                                               dtype=torch.int32, device=device)
        self.beam_indices = self.running_beam_indices.detach().clone()

    def adopt(self, kept: HostState) -> None:
        """Run on ``kept`` (a kept step's state, already filled with this call's values)."""
        self.state = kept

    # ---- one step ------------------------------------------------------------------------------------------------
    def choose(self, logits: torch.Tensor, parents: torch.Tensor, input_ids: torch.Tensor, positions: tuple) -> None:
        """The choice on the step's ``logits [rows, q, vocab]`` (its last position's); the next step's ``input_ids
        [rows, 1]``, ``positions`` (each moved on by one) and, in beam search, ``parents [rows]`` (the row each new row
        continues), in place. Sets :attr:`finished` (the one host read of the step)."""
        tokens = self._beam_step(logits, parents) if self.beam else self._sample_step(logits)
        input_ids.copy_(tokens[:, None])
        for position in positions:
            position.add_(1)
        if self.finished:
            self.state.done.fill_(True)

    def _sample_step(self, logits: torch.Tensor) -> torch.Tensor:
        """``_sample``'s loop body after the forward."""
        next_token_logits = logits[:, -1].to(copy=True, dtype=torch.float32, device=self.device)
        next_token_scores = self.processors(self.sequences, next_token_logits)
        if self.scores is not None:
            self.scores += (next_token_scores,)
        if self.raw_logits is not None:
            self.raw_logits += (next_token_logits,)
        if self.do_sample:
            probs = torch.nn.functional.softmax(next_token_scores, dim=-1)
            next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
        else:
            next_tokens = torch.argmax(next_token_scores, dim=-1)
        if self.has_eos:        # finished rows repeat the pad token
            next_tokens = next_tokens * self.unfinished + self.pad * (1 - self.unfinished)
        self.sequences = torch.cat([self.sequences, next_tokens[:, None]], dim=-1)
        self.unfinished = self.unfinished & ~self.criteria(self.sequences, self.scores)
        if self.streamer is not None:
            self.streamer.put(next_tokens.cpu())
        self.finished = bool(self.unfinished.max() == 0)
        return next_tokens

    def _beam_step(self, logits: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """``_beam_search``'s loop body after the forward (its cache reorder: ``parents``, which the next step's
        bookkeeping applies)."""
        m, batch, beams, cur_len = self.model, self.batch, self.num_beams, self.cur_len
        logits = logits[:, -1, :].to(copy=True, dtype=torch.float32, device=self.device)
        log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
        log_probs = self.processors(m._flatten_beam_dim(self.running_sequences[:, :, :cur_len]), log_probs)
        if self.raw_logits is not None:
            self.raw_logits += (logits.clone(),)
        if self.scores is not None:
            self.scores += (log_probs.clone(),)
        vocab = log_probs.shape[-1]
        log_probs = m._unflatten_beam_dim(log_probs, batch, beams) + self.running_beam_scores[:, :, None]
        log_probs = torch.reshape(log_probs, (batch, -1))
        # (vocab_size: 5.17's keyword; 5.24 takes it from the scores' shape)
        topk_log_probs, topk_running_sequences, topk_running_beam_indices = m._get_top_k_continuations(
            accumulated_log_probs=log_probs, running_sequences=self.running_sequences,
            running_beam_indices=self.running_beam_indices, cur_len=cur_len, decoder_prompt_len=self.prompt_len,
            do_sample=self.do_sample, beams_to_keep=self.beams_to_keep, num_beams=beams, vocab_size=vocab,
            batch_size=batch)
        hits = self.criteria(m._flatten_beam_dim(topk_running_sequences[:, :, :cur_len + 1]), self.scores)
        hits = m._unflatten_beam_dim(hits, batch, self.beams_to_keep)
        self.running_sequences, self.running_beam_scores, self.running_beam_indices = (
            m._get_running_beams_for_next_iteration(
                topk_log_probs=topk_log_probs, topk_running_sequences=topk_running_sequences,
                topk_running_beam_indices=topk_running_beam_indices, next_token_hits_stopping_criteria=hits,
                num_beams=beams))
        self.sequences, self.beam_scores, self.beam_indices, self.is_sent_finished = m._update_finished_beams(
            sequences=self.sequences, topk_running_sequences=topk_running_sequences, beam_scores=self.beam_scores,
            topk_log_probs=topk_log_probs, beam_indices=self.beam_indices,
            topk_running_beam_indices=topk_running_beam_indices,
            is_early_stop_heuristic_unsatisfied=self.heuristic_unsatisfied, is_sent_finished=self.is_sent_finished,
            next_token_hits_stopping_criteria=hits, top_num_beam_mask=self.top_num_beam_mask, num_beams=beams,
            cur_len=cur_len, decoder_prompt_len=self.prompt_len, length_penalty=self.length_penalty,
            early_stopping=self.early_stopping)
        parents.copy_(m._flatten_beam_dim(self.running_beam_indices[..., cur_len - self.prompt_len]))
        self.cur_len = cur_len = cur_len + 1
        self.heuristic_unsatisfied = m._check_early_stop_heuristic(
            is_early_stop_heuristic_unsatisfied=self.heuristic_unsatisfied,
            running_beam_scores=self.running_beam_scores, beam_scores=self.beam_scores,
            is_sent_finished=self.is_sent_finished, cur_len=cur_len, max_length=self.max_length,
            decoder_prompt_len=self.prompt_len, early_stopping=self.early_stopping,
            length_penalty=self.length_penalty)
        self.finished = not bool(m._beam_search_has_unfinished_sequences(
            self.heuristic_unsatisfied, self.is_sent_finished, hits, self.early_stopping))
        return m._flatten_beam_dim(self.running_sequences[:, :, cur_len - 1])

    # ---- the end -------------------------------------------------------------------------------------------------
    def finalize(self, cache=None):
        """What transformers' loop returns: the sequences, or (``return_dict_in_generate``) its output object with
        ``cache`` (the call's cache, under this transformers' field name). Ends the streamer."""
        if self.streamer is not None:
            self.streamer.end()
        encoder_decoder = bool(getattr(self.model.config, "is_encoder_decoder", False))
        cached = {compat.CACHE_KWARG: cache}
        if not self.beam:
            if not self.returned:
                return self.sequences
            output = GenerateEncoderDecoderOutput if encoder_decoder else GenerateDecoderOnlyOutput
            return output(sequences=self.sequences, scores=self.scores, logits=self.raw_logits, **cached)
        m, returned = self.model, self.num_return
        sequences = m._flatten_beam_dim(self.sequences[:, :returned, :])
        beam_scores = m._flatten_beam_dim(self.beam_scores[:, :returned])
        beam_indices = m._flatten_beam_dim(self.beam_indices[:, :returned, :])
        # transformers crops to the longest returned hypothesis, counted from its beam indices
        max_generated_length = ((beam_indices + 1).bool()).sum(dim=1).max()
        sequences = sequences[:, :self.prompt_len + max_generated_length]
        beam_indices = beam_indices[:, :max_generated_length]
        if not self.returned:
            return sequences
        output = GenerateBeamEncoderDecoderOutput if encoder_decoder else GenerateBeamDecoderOnlyOutput
        return output(sequences=sequences, sequences_scores=beam_scores if self.output_scores else None,
                      scores=self.scores, logits=self.raw_logits, beam_indices=beam_indices, **cached)
