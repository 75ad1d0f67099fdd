"""generate on one cascade model (and on two) from several threads at once: every call gives stock's tokens, a
plain ``model(...)`` in another thread meanwhile gets the model's own forward, and afterwards ``model.forward``
is what it was and the model works. On the CPU, ``cuda_graphs="eager"`` installs the graph runner (its static
path without capture), which is what used to break the model for good when two calls overlapped."""
from __future__ import annotations

import threading

import pytest
import torch

import hf_cascade
from hf_cascade import session

from conftest import cache_kw, model_pair, padded_batch

CONFIGS = [pytest.param(None, id="default"), pytest.param(dict(cuda_graphs="eager"), id="runner")]
CALLS = [  # greedy, beam search and sampling that cannot differ from greedy (top_k=1: exact whatever the RNG)
    dict(num_beams=3, max_new_tokens=7),
    dict(max_new_tokens=8),
    dict(do_sample=True, top_k=1, num_return_sequences=3, max_new_tokens=6),
    dict(num_beams=2, num_return_sequences=2, max_new_tokens=5),
]
THREADS, ROUNDS = 3, 3


def _run_threads(work, count):
    """Run ``work(i)`` in ``count`` threads started together; returns the exceptions they raised."""
    errors, start = [], threading.Barrier(count)

    def body(i):
        start.wait()
        try:
            work(i)
        except BaseException as err:  # noqa: BLE001 — reported by the test
            errors.append(err)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a generate thread hung"
    return errors


def _meeting(threads):
    """A logits processor factory: the calls made with ``meet()`` wait at their first decode step until ``threads``
    of them are there, so that the calls surely overlap (it leaves the scores as they are)."""
    barrier = threading.Barrier(threads)

    def meet():
        met = []

        def processor(input_ids, scores):
            if not met:
                met.append(barrier.wait(timeout=120))
            return scores

        return [processor]

    return meet


def _expected(stock, prompts):
    return {(p, c): stock.generate(input_ids=ids, attention_mask=mask, pad_token_id=0, **CALLS[c])
            for p, (ids, mask) in enumerate(prompts) for c in range(len(CALLS))}


def _check_model_intact(stock, cascade, prompts, config):
    """model.forward is the class's again (no instance attribute left), and the model works."""
    assert "forward" not in cascade.__dict__, cascade.__dict__.get("forward")
    assert cascade.forward.__func__ is type(cascade).forward
    ids, mask = prompts[0]
    with torch.no_grad():
        assert torch.equal(cascade(input_ids=ids, attention_mask=mask).logits,
                           stock(input_ids=ids, attention_mask=mask).logits)
    kw = dict(pad_token_id=0, **CALLS[0])
    assert torch.equal(cascade.generate(input_ids=ids, attention_mask=mask, hf_cascade_config=config, **kw),
                       stock.generate(input_ids=ids, attention_mask=mask, **kw))


@pytest.mark.parametrize("config", CONFIGS)
def test_threads_on_one_model_give_stock_tokens(config, runner_spy):
    stock, cascade = model_pair("llama")
    prompts = [padded_batch(seed=s, lengths=lengths) for s, lengths in ((1, (23, 17)), (2, (19, 30)), (3, (12,)))]
    expected = _expected(stock, prompts)
    got, meet = {}, _meeting(THREADS)

    def work(i):
        for r in range(ROUNDS):
            p, c = (i + r) % len(prompts), (i + 2 * r) % len(CALLS)
            ids, mask = prompts[p]
            got[i, r] = (p, c), cascade.generate(input_ids=ids, attention_mask=mask, pad_token_id=0,
                                                 hf_cascade_config=config, logits_processor=meet() if r == 0 else None,
                                                 **CALLS[c])

    assert _run_threads(work, THREADS) == []
    assert len(got) == THREADS * ROUNDS
    for (p, c), out in got.values():
        assert torch.equal(out, expected[p, c]), (p, c)
    if config is not None:       # the runners really ran their static path (none fell back for a thread's sake)
        runners = [r for r in runner_spy.runners if r is not None]
        assert len(runners) == THREADS * ROUNDS
        # (a call with the barrier processor keeps transformers' loop, replaying the forward; the others run the
        # whole step on the device)
        assert all(r.disabled is None and r.replays + r.device_steps > 0 for r in runners), \
            [(r.disabled, r.replays, r.device_steps) for r in runners]
        assert any(r.device_steps > 0 for r in runners)
    _check_model_intact(stock, cascade, prompts, config)


@pytest.mark.parametrize("config", CONFIGS)
def test_threads_on_two_models_give_stock_tokens(config):
    pairs = [model_pair("llama", seed=0), model_pair("qwen2", seed=1)]
    prompts = [padded_batch(seed=4), padded_batch(seed=5, lengths=(9, 21))]
    expected = [_expected(stock, prompts) for stock, _ in pairs]
    got, meet = [], _meeting(4)

    def work(i):
        for r in range(ROUNDS):
            m, p, c = (i + r) % 2, r % len(prompts), (i + r) % len(CALLS)
            ids, mask = prompts[p]
            out = pairs[m][1].generate(input_ids=ids, attention_mask=mask, pad_token_id=0, hf_cascade_config=config,
                                       logits_processor=meet() if r == 0 else None, **CALLS[c])
            got.append((m, p, c, out))

    assert _run_threads(work, 4) == []
    assert len(got) == 4 * ROUNDS
    for m, p, c, out in got:
        assert torch.equal(out, expected[m][p, c]), (m, p, c)
    for stock, cascade in pairs:
        _check_model_intact(stock, cascade, prompts, config)


def test_plain_forward_in_another_thread_during_generate():
    """A thread calling ``model(...)`` while others generate gets the model's own forward (stock's logits), and a
    forward the instance had of its own (as accelerate sets one) runs it and is restored exactly."""
    stock, cascade = model_pair("llama")
    calls = []
    own = type(cascade).forward.__get__(cascade)

    def instance_forward(*args, **kwargs):
        calls.append(1)
        return own(*args, **kwargs)

    cascade.forward = instance_forward
    ids, mask = padded_batch(seed=6)
    kw = dict(pad_token_id=0, **CALLS[0])
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    with torch.no_grad():
        logits = stock(input_ids=ids, attention_mask=mask).logits
    outs, plain, meet = [], [], _meeting(3)

    def work(i):
        for r in range(3):
            if i == 0:
                with torch.no_grad():
                    plain.append(cascade(input_ids=ids, attention_mask=mask).logits)
                    if r == 0:     # while the other two threads are inside their decode loops
                        meet()[0](None, None)
            else:
                outs.append(cascade.generate(input_ids=ids, attention_mask=mask, logits_processor=meet() if r == 0
                                             else None, hf_cascade_config=dict(cuda_graphs="eager"), **kw))

    assert _run_threads(work, 3) == []
    assert len(outs) == 6 and all(torch.equal(o, expected) for o in outs)
    assert len(plain) == 3 and all(torch.equal(p, logits) for p in plain)
    assert cascade.__dict__["forward"] is instance_forward and calls       # restored, and it ran
    del cascade.forward
    _check_model_intact(stock, cascade, [(ids, mask)], dict(cuda_graphs="eager"))


def test_a_failing_call_among_threads_leaves_the_others_and_the_model_intact():
    stock, cascade = model_pair("llama")
    ids, mask = padded_batch(seed=7)
    kw = dict(pad_token_id=0, **CALLS[0])
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw)

    class Boom(Exception):
        pass

    def stop(input_ids, scores, **_):
        if input_ids.shape[1] == ids.shape[1] + 3:
            raise Boom()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    outs, meet, failed = [], _meeting(3), threading.Event()

    def after_the_failure(input_ids, scores):
        if input_ids.shape[1] == ids.shape[1] + 2:
            assert failed.wait(timeout=120)
        return scores

    def work(i):
        for r in range(3):
            processors = meet() if r == 0 else None
            if (i + r) % 2:
                with pytest.raises(Boom):
                    cascade.generate(input_ids=ids, attention_mask=mask, stopping_criteria=[stop],
                                     logits_processor=processors, hf_cascade_config=dict(cuda_graphs="eager"), **kw)
                failed.set()
            elif r == 0:     # the first calls overlap the failing one, and run on after it raised
                outs.append(cascade.generate(input_ids=ids, attention_mask=mask,
                                             logits_processor=processors + [after_the_failure],
                                             hf_cascade_config=dict(cuda_graphs="eager"), **kw))
            else:
                outs.append(cascade.generate(input_ids=ids, attention_mask=mask, logits_processor=processors,
                                             hf_cascade_config=dict(cuda_graphs="eager"), **kw))

    assert _run_threads(work, 3) == []
    assert outs and all(torch.equal(o, expected) for o in outs)
    _check_model_intact(stock, cascade, [(ids, mask)], dict(cuda_graphs="eager"))
    hf_cascade.release(cascade)
    assert cascade not in session._kept


def test_one_cache_in_two_threads_is_refused_and_the_first_call_is_exact():
    """Two concurrent calls on one CascadeCache would interleave their rows: the second is refused with what to do,
    and the first runs on with stock's tokens (the refusal does not touch the cache)."""
    stock, cascade = model_pair("llama")
    ids, mask = padded_batch(seed=8)
    kw = dict(pad_token_id=0, **CALLS[0])
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    cache = hf_cascade.CascadeCache(cascade.config)
    inside, refused, results = threading.Event(), threading.Event(), {}

    def wait_for_the_other(input_ids, scores):
        inside.set()
        assert refused.wait(timeout=120)
        return scores

    def work(i):
        if i == 0:
            results[0] = cascade.generate(input_ids=ids, attention_mask=mask,
                                          logits_processor=[wait_for_the_other], **cache_kw(cascade, cache), **kw)
        else:
            assert inside.wait(timeout=120)
            try:
                with pytest.raises(ValueError, match="in use by a generate call in another thread"):
                    cascade.generate(input_ids=ids, attention_mask=mask, **cache_kw(cascade, cache), **kw)
            finally:
                refused.set()

    assert _run_threads(work, 2) == []
    assert torch.equal(results[0], expected)
    cache.reset()          # (beam search filled it: the next call starts from the whole prompt)
    assert torch.equal(cascade.generate(input_ids=ids, attention_mask=mask, **cache_kw(cascade, cache), **kw),
                       expected)     # the cache is free again
