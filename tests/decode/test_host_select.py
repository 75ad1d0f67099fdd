"""The decode loop with the token choice on the host (hf_cascade/decode/host_select.py) against stock transformers.

Calls whose token choice hf_cascade.device_select does not reproduce (a processor or stopping criterion of the user's
own, a streamer, ``return_dict_in_generate`` with scores and logits) run hf_cascade.whole_step's loop with the
``HostChooser``: the block bookkeeping and the forward as the (eager on the CPU: ``cuda_graphs="eager"``) whole step,
transformers' per-step choice after it. Tiny random models in float64, stock sdpa on a twin of its own config: the
whole returned object equals stock's (sequences, scores, logits, beam indices, sequences_scores: ``torch.equal``), and
every test checks that the loop ran (``runner.device_steps``) and transformers' ``_sample`` / ``_beam_search`` did
not, so that a silent fallback cannot pass.

The ``gpu`` test (``pytest -m gpu tests/decode/test_host_select.py`` on the GPU machine): float32 Llama on CUDA with the
steps captured and replayed, a user processor and ``output_scores``: stock's tokens and scores.
"""
from __future__ import annotations

import functools
import logging

import pytest
import torch
from transformers import GenerationMixin, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_cascade import CascadeCache, CascadeConfig, host_select, logs
from conftest import EOS, RunnerSpy, model_pair, padded_batch, returned_cache
from test_capture_safety import emulated_capture  # noqa: F401  (a fixture)

EAGER = CascadeConfig(cuda_graphs="eager")


class PenaliseRepeat(LogitsProcessor):
    """A processor of the user's own (no transformers class): lowers each row's last token's score, so that it reads
    the sequences it is given."""

    def __call__(self, input_ids, scores):
        return scores.scatter_add(1, input_ids[:, -1:], torch.full_like(scores[:, :1], -1.5))


class StopOnRepeat(StoppingCriteria):
    """A criterion of the user's own: a row stops at a token it made in its last three, once it has ``after`` new
    tokens (rows and hypotheses end at different steps). Counts its calls and the rows it stopped."""

    def __init__(self, prompt_length: int, after: int = 3):
        self.prompt_length, self.after = prompt_length, after
        self.calls = self.hits = 0

    def __call__(self, input_ids, scores, **kwargs):
        repeated = (input_ids[:, -4:-1] == input_ids[:, -1:]).any(dim=1)
        done = repeated & (input_ids.shape[1] >= self.prompt_length + self.after)
        self.calls, self.hits = self.calls + 1, self.hits + int(done.sum())
        return done


class Tokens(BaseStreamer):
    """Keeps every tensor generate puts (the prompt, then each step's tokens) and whether it ended."""

    def __init__(self):
        self.put_values, self.ended = [], 0

    def put(self, value):
        self.put_values.append(value.clone())

    def end(self):
        self.ended += 1


MODES = {
    "greedy": dict(),
    "greedy-eos": dict(eos_token_id=EOS, pad_token_id=0, min_new_tokens=4),
    "sample": dict(do_sample=True, num_return_sequences=2, top_k=20, eos_token_id=EOS, pad_token_id=0),
    "beam": dict(num_beams=3),
    "beam-returned-length-penalty": dict(num_beams=4, num_return_sequences=2, length_penalty=1.7, eos_token_id=EOS,
                                         pad_token_id=0),
    "beam-sample": dict(num_beams=3, do_sample=True, top_k=20, eos_token_id=EOS, pad_token_id=0),
}


@pytest.fixture
def loops(monkeypatch):
    """The attention implementations of the models whose generate ran transformers' ``_sample`` / ``_beam_search``."""
    ran = []

    def spying(real):
        @functools.wraps(real)     # (generate reads _sample's signature)
        def spy(self, *args, **kwargs):
            ran.append(self.config._attn_implementation)
            return real(self, *args, **kwargs)
        return spy

    for name in ("_sample", "_beam_search"):
        monkeypatch.setattr(GenerationMixin, name, spying(getattr(GenerationMixin, name)))
    return ran


def _generate(model, ids, mask, seed=123, **kwargs):
    torch.manual_seed(seed)
    return model.generate(input_ids=ids, attention_mask=mask, **kwargs)


def assert_same_output(want, got):
    """generate's whole output: the same type and fields, every tensor equal (tuples of per-step tensors too); the
    returned cache holds as many tokens as stock's."""
    assert type(want) is type(got)
    if isinstance(want, torch.Tensor):
        assert want.dtype == got.dtype and want.shape == got.shape and torch.equal(want, got)
        return
    names = {"cache", "past_key_values"}
    assert set(want.keys()) - names == set(got.keys()) - names
    for name in set(want.keys()) - names:
        a, b = getattr(want, name), getattr(got, name)
        if isinstance(a, tuple):
            assert len(a) == len(b), name
            assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b)), name
        else:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (name, a, b)


def _ran_the_loop(spy, loops):
    assert sum(r.device_steps for r in spy.runners if r is not None) > 0, "the whole step did not run"
    assert "cascade" not in loops, "transformers' loop served the cascade call"


@pytest.mark.parametrize("returned", [False, True], ids=["tensor", "return_dict"])
@pytest.mark.parametrize("mode", list(MODES))
def test_user_processor_and_criterion_equal_stock(mode, returned, eos_llama, monkeypatch, loops, caplog):
    monkeypatch.setattr(logs, "_logged", set())
    stock, cascade = eos_llama
    ids, mask = padded_batch(seed=8, lengths=(23, 17))
    kwargs = dict(max_new_tokens=24, **MODES[mode])
    if returned:
        kwargs.update(return_dict_in_generate=True, output_scores=True, output_logits=True)

    criteria = [StopOnRepeat(ids.shape[1]), StopOnRepeat(ids.shape[1])]

    def run(model, criterion, **extra):     # (each call its own processor and criterion, as a user makes them)
        return _generate(model, ids, mask, logits_processor=LogitsProcessorList([PenaliseRepeat()]),
                         stopping_criteria=StoppingCriteriaList([criterion]), **kwargs, **extra)

    want = run(stock, criteria[0])
    spy = RunnerSpy(monkeypatch)
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        got = run(cascade, criteria[1], hf_cascade_config=EAGER)
    _ran_the_loop(spy, loops)
    assert any("token choice on the host" in r.getMessage() for r in caplog.records)
    assert_same_output(want, got)
    # the criterion ran as often and stopped as many rows or candidates as in stock (some: else it proves little)
    assert (criteria[0].calls, criteria[0].hits) == (criteria[1].calls, criteria[1].hits) and criteria[0].hits > 0
    if returned:
        cache = returned_cache(got)
        assert isinstance(cache, CascadeCache) and cache.get_seq_length() == returned_cache(want).get_seq_length()


@pytest.mark.parametrize("mode", ["greedy", "beam", "sample"])
def test_return_dict_alone_equals_stock(mode, eos_llama, monkeypatch, loops):
    """return_dict_in_generate with scores and logits, and no processor of the user's: the host chooser too."""
    stock, cascade = eos_llama
    ids, mask = padded_batch(seed=7, lengths=(21, 14))
    kwargs = dict(max_new_tokens=16, return_dict_in_generate=True, output_scores=True, output_logits=True,
                  eos_token_id=EOS, pad_token_id=0, **{"greedy": {}, "beam": dict(num_beams=3),
                                                       "sample": dict(do_sample=True, num_return_sequences=3)}[mode])
    want = _generate(stock, ids, mask, **kwargs)
    spy = RunnerSpy(monkeypatch)
    got = _generate(cascade, ids, mask, hf_cascade_config=EAGER, **kwargs)
    _ran_the_loop(spy, loops)
    assert_same_output(want, got)


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_streamer_gets_stock_tokens(mode, eos_llama, monkeypatch, loops):
    stock, cascade = eos_llama
    ids, mask = padded_batch(seed=3, lengths=(19,))
    kwargs = dict(max_new_tokens=20, pad_token_id=0, logits_processor=LogitsProcessorList([PenaliseRepeat()]),
                  **(dict(do_sample=True, top_k=30) if mode == "sample" else {}))
    streamers = [Tokens(), Tokens()]
    want = _generate(stock, ids, mask, streamer=streamers[0], **kwargs)
    spy = RunnerSpy(monkeypatch)
    got = _generate(cascade, ids, mask, streamer=streamers[1], hf_cascade_config=EAGER, **kwargs)
    _ran_the_loop(spy, loops)
    assert_same_output(want, got)
    a, b = streamers
    assert a.ended == b.ended == 1 and len(a.put_values) == len(b.put_values) == want.shape[1] - ids.shape[1] + 1
    assert all(torch.equal(x, y) for x, y in zip(a.put_values, b.put_values))


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_encoder_decoder_with_a_user_processor_and_scores(family, monkeypatch, loops):
    """Encoder-decoder calls (BART: the paged cache; T5: its dense static cache, dense_cache.DenseHold): the decoder's
    steps on the loop, the host chooser's output object stock's."""
    if family == "t5":
        from test_t5_graphs import pair, sources
    else:
        from test_seq2seq_graphs import pair, sources
    stock, cascade = pair(family)
    ids, mask = sources()
    for mode in (dict(num_beams=3, num_return_sequences=2, length_penalty=1.3), dict(do_sample=True, top_k=20)):
        kwargs = dict(max_new_tokens=12, return_dict_in_generate=True, output_scores=True, output_logits=True,
                      logits_processor=LogitsProcessorList([PenaliseRepeat()]), **mode)
        want = _generate(stock, ids, mask, **kwargs)
        spy = RunnerSpy(monkeypatch)
        got = _generate(cascade, ids, mask, hf_cascade_config=CascadeConfig(backend="reference", cuda_graphs="eager",
                                                                            block_size=4), **kwargs)
        _ran_the_loop(spy, loops)
        assert_same_output(want, got)
        loops.clear()


@pytest.mark.parametrize("mode", ["beam", "sample"])
def test_the_captured_step_holds_no_host_choice(mode, llama_pair, monkeypatch, emulated_capture):  # noqa: F811
    """The capture path with the host chooser (emulated on the CPU: tests/decode/test_capture_safety.py): the captured step
    is the bookkeeping and the forward, with no host sync inside; the chooser runs after each replay on the captured
    step's logits (the emulated replay computes nothing, so tokens are compared on the GPU: the ``gpu`` test)."""
    _, cascade = llama_pair
    ids, mask = padded_batch(seed=4, lengths=(27, 19, 23))
    spy = RunnerSpy(monkeypatch)
    chosen = []
    real = host_select.HostChooser.choose

    def choose(self, logits, *args):
        chosen.append(logits)
        return real(self, logits, *args)

    monkeypatch.setattr(host_select.HostChooser, "choose", choose)
    cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0,
                     logits_processor=LogitsProcessorList([PenaliseRepeat()]),
                     **(dict(num_beams=3) if mode == "beam" else dict(do_sample=True, num_return_sequences=2)),
                     hf_cascade_config=CascadeConfig(cuda_graphs=True, block_size=2, memory="grow",
                                                     backend="reference"))
    runner, = spy.runners
    assert runner.captures == 1 and runner.replays >= 3 and runner.device_steps == runner.replays + 1
    assert emulated_capture.host_syncs == [] and not any(emulated_capture.gc_enabled)
    # every replay's choice read the captured step's own logits (the graph's output), not a copy made once
    assert len(chosen) == 8 and all(logits is runner.whole_step_kept.logits for logits in chosen[-runner.replays:])


@pytest.mark.gpu
def test_gpu_captured_steps_with_a_user_processor_give_stock_scores(monkeypatch, no_tf32):
    """float32 Llama on CUDA: the steps captured and replayed, a user processor and return_dict_in_generate with
    output_scores: stock's tokens and scores (TF32 off), and the captured steps' outputs bitwise the eager steps'."""
    stock, cascade = (m.cuda() for m in model_pair("llama", dtype=torch.float32))
    ids, mask = (t.cuda() for t in padded_batch(seed=5, lengths=(23, 17)))
    for mode in (dict(num_beams=3), dict(do_sample=True, num_return_sequences=2), dict()):
        kwargs = dict(max_new_tokens=40, pad_token_id=0, return_dict_in_generate=True, output_scores=True,
                      logits_processor=LogitsProcessorList([PenaliseRepeat()]), **mode)
        want = _generate(stock, ids, mask, **kwargs)
        spy = RunnerSpy(monkeypatch)
        eager, got = (_generate(cascade, ids, mask, hf_cascade_config=CascadeConfig(cuda_graphs=graphs), **kwargs)
                      for graphs in ("eager", True))
        eager_run, runner = spy.runners
        assert eager_run.device_steps > 30 and eager_run.captures == 0, (eager_run.device_steps, mode)
        assert runner.captures >= 1 and runner.replays > 30, (runner.captures, runner.replays, mode)
        assert_same_output(eager, got)
        assert torch.equal(want.sequences, got.sequences), mode
        assert len(want.scores) == len(got.scores)
        for a, b in zip(want.scores, got.scores):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
        if "num_beams" in mode:
            torch.testing.assert_close(want.sequences_scores, got.sequences_scores, rtol=0, atol=1e-4)
            assert torch.equal(want.beam_indices, got.beam_indices)
