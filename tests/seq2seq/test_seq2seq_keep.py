"""An encoder-decoder generate call of the same shape as the model's last one reuses that call's state
(always, as a decoder-only call's: ``hf_cascade.release(model)`` drops it): the cross-attention storages (refilled in place), the decoder's paged
self-attention cache, the cross-attention step context and the graph runner with its captured step
(hf_cascade/decode/session.py ``KeptCall``, hf_cascade/seq2seq/encoder_decoder.py ``KeptCross``).

On the CPU the runner's eager form (``cuda_graphs="eager"``) runs the step a GPU captures on the same static buffers:
its ``first_steps`` counts what a GPU would capture. The whole step, with the token choice on the host
(``return_dict_in_generate``, scores compared) or on the device, reuses its kept step object, and on a CPU grow pool
(which moves between calls) makes its block state anew. Tiny random BART / Marian / Whisper in float64 against stock sdpa.

The ``gpu`` test (pytest -m gpu tests/seq2seq/test_seq2seq_keep.py): the same three calls captured on CUDA in float32, the
second and third capturing nothing.
"""
from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, StoppingCriteria, StoppingCriteriaList

import hf_cascade
from hf_cascade import encoder_decoder, session
from hf_cascade.decode import graphs
from hf_cascade.config import CascadeConfig

from conftest import RunnerSpy
from test_encoder_decoder import whisper_pair, whisper_tiny
from test_seq2seq_graphs import FAMILIES, _gpu_pair, frozen_host_length, pair, sources  # noqa: F401 (a fixture)

# the whole step with the token choice on the host (scores returned: "runner" in the test ids) and on the device
RUNNER = WHOLE = CascadeConfig(backend="reference", cuda_graphs="eager", block_size=4)
EOS = 2
CNN = dict(num_beams=4, no_repeat_ngram_size=3, length_penalty=2.0, min_length=12, max_length=24, early_stopping=True,
           forced_bos_token_id=0, forced_eos_token_id=EOS)
TRANSLATE = dict(num_beams=4, max_new_tokens=14)
WHISPER = dict(language="en", num_beams=3, no_repeat_ngram_size=2, max_new_tokens=10)

def _pair(family):
    return whisper_pair() if family == "whisper" else pair(family)     # (both cached for the module)


def _inputs(family, seed, lengths=(13, 9, 5)):
    """The call's generate arguments: other contents per seed, the same shape."""
    if family == "whisper":
        return dict(input_features=torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(seed),
                                               dtype=torch.float64), **WHISPER)
    ids, mask = sources(lengths=lengths, seed=seed)
    return dict(input_ids=ids, attention_mask=mask, **(CNN if family == "bart" else TRANSLATE))


def _generate(model, kwargs, **extra):
    torch.manual_seed(1234)
    return model.generate(**kwargs, **extra)


def _assert_same(want, got, scores: bool):
    if not scores:
        assert want.shape == got.shape and torch.equal(want, got), (want, got)
        return
    assert torch.equal(want.sequences, got.sequences), (want.sequences, got.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=0, atol=1e-9)
    if getattr(want, "sequences_scores", None) is not None:
        torch.testing.assert_close(got.sequences_scores, want.sequences_scores, rtol=0, atol=1e-9)


def _kept(model):
    return session._kept.get(model)


@pytest.mark.parametrize("path", ["runner", "whole_step"])
@pytest.mark.parametrize("family", ["bart", "marian", "whisper"])
def test_three_calls_of_one_shape_reuse_the_first(family, path, monkeypatch, request):
    if family != "whisper":
        request.getfixturevalue("frozen_host_length")     # positions read on the host would give other tokens
    stock, cascade = _pair(family)
    hf_cascade.release(cascade)
    scores = path == "runner"
    extra = dict(return_dict_in_generate=True, output_scores=True) if scores else {}
    config = RUNNER if scores else WHOLE
    spy = RunnerSpy(monkeypatch)
    seen = []
    for seed in (1, 2, 3):
        kwargs = _inputs(family, seed)
        want = _generate(stock, kwargs, **extra)
        got = _generate(cascade, kwargs, hf_cascade_config=config, **extra)
        _assert_same(want, got, scores)
        kept = _kept(cascade)
        assert kept is not None and kept.extra is not None
        runner = spy.runners[-1]
        assert runner is kept.runner and runner.disabled is None
        seen.append((runner, runner.first_steps, runner.replays, runner.device_steps, kept.cache, kept.extra.cross,
                     kept.extra.context, [layer.pool.data_ptr() for layer in kept.extra.cross.layers],
                     runner.whole_step_kept))
    first, second, third = seen
    for later in (second, third):
        assert later[0] is first[0]                              # the same runner
        assert later[4] is first[4] and later[5] is first[5]     # the same decoder cache and cross storages
        assert later[6] is first[6]                              # the same cross step contexts
        assert later[7] == first[7]                              # refilled in place: the same memory
    assert all(each[3] > 0 for each in seen), "the whole step did not run"
    assert first[1] >= 1                                         # the step built (a GPU captures it)
    assert first[8] is not None
    assert second[8] is first[8] and third[8] is first[8]        # the kept whole step's tensors, refilled


def test_another_shape_starts_afresh_and_the_first_shape_works_again(monkeypatch, frozen_host_length):
    """Sources the kept cross storages serve (as many inputs, no more blocks, the widest within ADOPT_SPAN of the
    tables' width) reuse the kept state; other rows, longer sources, or sources much shorter start afresh (the kept
    state freed); the first shape then works again (served by the state last kept, which grew to take it)."""
    stock, cascade = _pair("bart")
    hf_cascade.release(cascade)
    extra = dict(return_dict_in_generate=True, output_scores=True)
    spy = RunnerSpy(monkeypatch)

    def call(kwargs):
        _assert_same(_generate(stock, kwargs, **extra),
                     _generate(cascade, kwargs, hf_cascade_config=RUNNER, **extra), scores=True)
        return spy.runners[-1], _kept(cascade).extra.cross

    runner, cross = call(_inputs("bart", 1))                     # blocks of 4: (4, 3, 2) = 9, table width 4
    served = {"narrower": (11, 9, 5), "other order": (5, 13, 9), "within the last block": (16, 9, 5)}
    for what, lengths in served.items():
        assert call(_inputs("bart", 2, lengths=lengths)) == (runner, cross), what
    # (5, 4, 3) = 3 blocks: the kept tables' width is within ADOPT_SPAN of the widest's 2 blocks
    others = {"rows": (13, 9), "longer": (17, 9, 5), "more blocks": (16, 13, 9), "much shorter": (3, 2, 1)}
    for what, lengths in others.items():
        other_runner, other_cross = call(_inputs("bart", 4, lengths=lengths))
        assert other_runner is not runner and other_cross is not cross, what
        assert other_runner.first_steps == 1, what
        assert cross.layers[0].storage is None, what            # the state it replaced was freed
        runner, cross = other_runner, other_cross
    again, again_cross = call(_inputs("bart", 5))                # the first shape again: afresh, stock's tokens
    assert again is not runner and again.first_steps == 1
    kept_step = again.whole_step_kept
    call(_inputs("bart", 6))
    assert spy.runners[-1] is again and again.whole_step_kept is kept_step and again.device_steps > 0


# an evaluation loop's batches: one batch size, other source lengths, none needing more blocks (of 4) than the first
EVAL_BATCHES = ((13, 9, 5), (11, 12, 6), (5, 13, 9), (8, 8, 8), (16, 3, 10), (7, 7, 7))
# pools of a fixed address on the CPU (a grow pool is given back at the end of a call: the next one's moves, and its
# step is built anew); a cap makes the decode loop transformers' until the decoder's cache knows its block size, so
# the calls bring a two-token decoder prompt, which the entry prefills before the loop
STATIC = dict(memory="static", max_kv_bytes=2 ** 22)


def _eval_inputs(family, seed, lengths):
    kwargs = _inputs(family, seed, lengths=lengths)
    start = _pair(family)[0].config.decoder_start_token_id
    kwargs["decoder_input_ids"] = torch.tensor([[start, 7]] * len(lengths))
    return kwargs


@pytest.mark.parametrize("path", ["runner", "whole_step"])
@pytest.mark.parametrize("family", ["bart", "marian"])
def test_an_evaluation_loop_over_source_lengths_captures_once(family, path, monkeypatch, frozen_host_length):
    """Seq2SeqTrainer's evaluation: batches of one size and other source lengths. The first call's kept state serves
    every later batch, whose sources its cross storages take in place (refilled, the cross plans' tables and lengths
    rewritten in their device tensors; the decoder's own layout is the same): its decode step replays, ``first_steps``
    0 (a GPU captures nothing) from the second call on, over two passes, on the same storages at the same addresses;
    stock's tokens every call (float64)."""
    stock, cascade = _pair(family)
    hf_cascade.release(cascade)
    scores = path == "runner"
    extra = dict(return_dict_in_generate=True, output_scores=True) if scores else {}
    config = dataclasses.replace(RUNNER if scores else WHOLE, **STATIC)
    spy = RunnerSpy(monkeypatch)
    seen = []
    for epoch in range(2):
        for i, lengths in enumerate(EVAL_BATCHES):
            kwargs = _eval_inputs(family, 10 * epoch + i, lengths)
            _assert_same(_generate(stock, kwargs, **extra), _generate(cascade, kwargs, hf_cascade_config=config,
                                                                       **extra), scores)
            kept, runner = _kept(cascade), spy.runners[-1]
            assert kept is not None and runner is kept.runner and runner.disabled is None and runner.device_steps > 0
            seen.append((runner, runner.first_steps, kept.cache, kept.extra.cross, kept.extra.context,
                         [layer.pool.data_ptr() for layer in kept.extra.cross.layers],
                         graphs.pool_signature(kept.cache), runner.whole_step_kept))
    first = seen[0]
    assert first[1] >= 1                                         # the step built (a GPU captures it)
    for each in seen[1:]:
        assert each[1] == 0                                      # nothing built: a GPU replays the kept graph
        assert each[0] is first[0] and each[2] is first[2]       # the same runner and decoder cache
        assert each[3] is first[3] and each[4] is first[4]       # the same cross storages and step contexts
        assert each[5] == first[5] and each[6] == first[6]       # refilled in place: the same memory
        assert each[7] is first[7]                               # the kept whole step's tensors
    hf_cascade.release(cascade)


# blocks of 4: the third batch is wider than the first (5 blocks), the fifth holds more blocks (10)
OUTGROWING = ((13, 9, 5), (11, 12, 6), (17, 4, 9), (8, 8, 8), (16, 16, 8), (14, 10, 3))


def test_a_batch_that_outgrows_the_kept_state_leaves_room_for_the_others(monkeypatch, frozen_host_length):
    """A batch whose sources the kept cross storages cannot take starts afresh (the kept state freed), with storages
    at least as large as the kept ones: over a second pass the state kept at the end of the first serves every batch
    (the same runner, storages and step contexts; on the CPU's grow pools, which move between calls, the decode step
    itself is built anew each call). Stock's tokens every call."""
    stock, cascade = _pair("bart")
    hf_cascade.release(cascade)
    spy = RunnerSpy(monkeypatch)
    seen = []
    for epoch in range(2):
        for i, lengths in enumerate(OUTGROWING):
            kwargs = _inputs("bart", 10 * epoch + i, lengths=lengths)
            _assert_same(_generate(stock, kwargs), _generate(cascade, kwargs, hf_cascade_config=WHOLE), scores=False)
            kept = _kept(cascade)
            seen.append((spy.runners[-1], kept.extra.cross, kept.extra.context))
    first_pass, second_pass = seen[:len(OUTGROWING)], seen[len(OUTGROWING):]
    made = [i for i in range(1, len(OUTGROWING)) if first_pass[i][1] is not first_pass[i - 1][1]]
    assert made == [2, 4]                                        # afresh where a batch outgrew the kept state
    assert first_pass[1][1].layers[0].storage is None            # (the state it replaced was freed)
    assert (first_pass[-1][1].num_blocks, first_pass[-1][1].prefix_table.shape[1]) == (10, 5)
    for each in second_pass:
        assert all(a is b for a, b in zip(each, first_pass[-1]))
    hf_cascade.release(cascade)


def test_release_between_calls_starts_afresh(monkeypatch):
    """Kept by default; ``hf_cascade.release(model)`` before a call of the same shape: the call builds and captures
    afresh (another runner) and gives stock's tokens."""
    stock, cascade = _pair("bart")
    spy = RunnerSpy(monkeypatch)
    for seed in (1, 2):
        hf_cascade.release(cascade)
        assert _kept(cascade) is None
        kwargs = _inputs("bart", seed)
        _assert_same(_generate(stock, kwargs), _generate(cascade, kwargs, hf_cascade_config=WHOLE), scores=False)
        assert _kept(cascade) is not None
    assert spy.runners[0] is not spy.runners[1]
    hf_cascade.release(cascade)


def test_concurrent_calls_never_share_the_kept_state(monkeypatch):
    """Two threads' calls of the kept shape at once: one may take the kept state, the other starts afresh (the
    kept state serves one call); both give stock's tokens."""
    import threading
    stock, cascade = _pair("bart")
    hf_cascade.release(cascade)
    spy = RunnerSpy(monkeypatch)
    _generate(cascade, _inputs("bart", 1), hf_cascade_config=WHOLE)
    first = spy.runners[-1]
    wants = {seed: _generate(stock, _inputs("bart", seed)) for seed in (2, 3)}
    gots, errors = {}, []
    start = threading.Barrier(2)

    def run(seed):
        try:
            start.wait()
            gots[seed] = cascade.generate(**_inputs("bart", seed), hf_cascade_config=WHOLE)
        except BaseException as err:  # noqa: BLE001 — reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in (2, 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for seed in (2, 3):
        assert torch.equal(gots[seed], wants[seed])
    a, b = spy.runners[-2:]
    assert a is not b and (a is first) + (b is first) <= 1
    assert _kept(cascade) is not None


class _Boom(StoppingCriteria):
    def __init__(self, after):
        self.calls, self.after = 0, after

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("boom")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize("config", [RUNNER, WHOLE], ids=["runner", "whole_step"])
def test_a_failed_call_keeps_nothing(config, monkeypatch):
    stock, cascade = _pair("bart")
    hf_cascade.release(cascade)
    spy = RunnerSpy(monkeypatch)
    _generate(cascade, _inputs("bart", 1), hf_cascade_config=config)
    kept = _kept(cascade)
    assert kept is not None
    with pytest.raises(RuntimeError, match="boom"):            # takes the kept state, fails half way
        _generate(cascade, _inputs("bart", 2), hf_cascade_config=config,
                  stopping_criteria=StoppingCriteriaList([_Boom(after=3)]))
    assert spy.runners[-1] is kept.runner
    assert _kept(cascade) is None
    assert kept.extra.cross.layers[0].storage is None and not kept.extra.context.steps
    kwargs = _inputs("bart", 3)
    _assert_same(_generate(stock, kwargs), _generate(cascade, kwargs, hf_cascade_config=config), scores=False)
    assert spy.runners[-1] is not kept.runner and _kept(cascade) is not None


def test_release_frees_the_kept_state_and_the_model_can_be_collected():
    cascade = AutoModelForSeq2SeqLM.from_config(FAMILIES["bart"](), attn_implementation="cascade",
                                                dtype=torch.float64).eval()       # (not the cached pair's)
    kwargs = _inputs("bart", 1)
    _generate(cascade, kwargs, hf_cascade_config=WHOLE)
    kept = _kept(cascade)
    assert kept is not None
    hf_cascade.release(cascade)
    assert _kept(cascade) is None
    assert all(layer.storage is None for layer in kept.extra.cross.layers) and not kept.extra.context.steps
    assert kept.runner.whole_step_kept is None
    _generate(cascade, kwargs, hf_cascade_config=WHOLE)
    assert _kept(cascade) is not None
    ref = weakref.ref(cascade)
    del cascade, kept
    gc.collect()
    assert ref() is None


def test_whisper_model_can_be_collected_while_kept():
    torch.manual_seed(0)
    model = whisper_tiny("cascade")
    _generate(model, _inputs("whisper", 1), hf_cascade_config=WHOLE)
    assert _kept(model) is not None
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_t5_keeps_nothing(monkeypatch):
    """The T5 family's decoder self-attention is a static dense cache: not kept (stock's tokens, afresh each call)."""
    import transformers as T
    config = lambda: T.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,  # noqa: E731
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    stock = AutoModelForSeq2SeqLM.from_config(config(), attn_implementation="sdpa", dtype=torch.float64).eval()
    cascade = AutoModelForSeq2SeqLM.from_config(config(), attn_implementation="cascade", dtype=torch.float64).eval()
    cascade.load_state_dict(stock.state_dict())
    for seed in (1, 2):
        ids, mask = sources(seed=seed)
        kw = dict(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=8)
        _assert_same(_generate(stock, kw), _generate(cascade, kw, hf_cascade_config=WHOLE), scores=False)
        assert _kept(cascade) is None


# ---- on the GPU: the second and third calls capture nothing ----------------------------------------------------
def _gpu_call_inputs(seed, pad):
    lengths = torch.tensor([[400], [250], [96], [37]], device="cuda")
    ids = torch.randint(3, 990, (4, 400), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    mask = (torch.arange(400, device="cuda")[None, :] < lengths).long()
    return ids.masked_fill(mask == 0, pad), mask


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["runner", "whole_step"])
def test_gpu_three_calls_capture_once(path, monkeypatch, no_tf32):
    stock, cascade = _gpu_pair("bart", torch.float32)
    hf_cascade.release(cascade)
    extra = dict(return_dict_in_generate=True, output_scores=True) if path == "runner" else {}
    kw = dict(num_beams=4, no_repeat_ngram_size=3, length_penalty=2.0, min_length=24, max_new_tokens=32, **extra)
    spy = RunnerSpy(monkeypatch)
    counts, pools = [], []
    for seed in (1, 2, 3):
        ids, mask = _gpu_call_inputs(seed, stock.config.pad_token_id)
        want = stock.generate(input_ids=ids, attention_mask=mask, **kw)
        # (float32: the auto backend, which the cuda kernels do not take)
        got = cascade.generate(input_ids=ids, attention_mask=mask, **kw)
        if extra:
            want, got = want.sequences, got.sequences
        assert torch.equal(want, got)
        runner = spy.runners[-1]
        assert runner.disabled is None
        counts.append((runner.captures, runner.replays, runner.device_steps))
        pools.append([layer.pool.data_ptr() for layer in _kept(cascade).extra.cross.layers])
    assert spy.runners[0] is spy.runners[1] is spy.runners[2]
    assert counts[0][0] >= 1
    assert counts[1][0] == 0 and counts[2][0] == 0               # the kept graph replays: nothing captured
    assert all(c[1] + c[2] >= 20 for c in counts)
    assert pools[0] == pools[1] == pools[2]
    hf_cascade.release(cascade)
