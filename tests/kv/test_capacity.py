"""A generate call's decode cost follows the tokens it makes, not its ``max_new_tokens`` (issue 18, item 4).

The static decode layout (hf_cascade.plan.DecodeLayout) is first sized for a few new tokens per row and widened
geometrically as rows grow (plan.decode_room), so a call with a huge ``max_new_tokens`` that a StoppingCriteria
ends early allocates and attends over what it made. Each widening is logged once and re-captures the graph
(here the runner's eager form, ``cuda_graphs="eager"``); a sliding window is left out only while no row can pass
it on the layout in force. Everything is float64 and token-exact against stock sdpa with the same stopping.
"""
from __future__ import annotations

import math

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_cascade
from hf_cascade import CascadeConfig, plan as plan_module
from hf_cascade.kernels import reference

from conftest import RunnerSpy, cache_kw, model_pair, padded_batch, returned_cache

WIDENED = "decode layout widened"
FIRST_ROOM = getattr(plan_module, "FIRST_ROOM", 64)      # new tokens the first layout makes room for
# a pool that never moves, so that the runner captures anew only for a new layout
FIXED_POOL = dict(memory="static", max_kv_bytes=2 ** 22)


class StopAfter(StoppingCriteria):
    """Ends the call once ``n`` tokens were added to the ``prompt``-wide input (every row at once)."""

    def __init__(self, prompt: int, n: int):
        self.limit = prompt + n

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.limit, dtype=torch.bool)


MODES = {
    "beam": dict(num_beams=4, num_return_sequences=2, length_penalty=0.7),
    "sample": dict(do_sample=True, num_return_sequences=3, top_k=0, temperature=1.5),
    "greedy": dict(do_sample=False),
}


def _generate(model, ids, mask, mode, max_new_tokens, stop_after, **extra):
    torch.manual_seed(5)
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=0,
                          stopping_criteria=StoppingCriteriaList([StopAfter(ids.shape[1], stop_after)]),
                          **MODES[mode], **extra)


def _cascade_kwargs(model, mode, **config):
    """Greedy shares nothing and would run on stock's path: a CascadeCache of our own keeps it on the cascade."""
    config = CascadeConfig(**config)
    if mode == "greedy":
        return cache_kw(model, hf_cascade.CascadeCache(model.config, config))
    return dict(hf_cascade_config=config)


class Steps:
    """What every static decode attention call ran on: its layout, its window, its plan on the device and the
    tokens its rows held."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = reference.BACKEND.forward

        def forward(q, pool, metadata, params):
            plan = metadata.plan
            if plan.static:
                layout = plan.layout
                rows = layout.row_prefix_blocks * layout.block_size + plan.q_limit[:, -1]
                self.calls.append(dict(layout=layout, window=params.window, device_plan=metadata.device,
                                       longest=int(rows.max())))
            return real(q, pool, metadata, params)

        monkeypatch.setattr(reference.BACKEND, "forward", forward)

    @property
    def layouts(self):
        seen = {}
        for call in self.calls:
            seen.setdefault(call["layout"].serial, call["layout"])
        return list(seen.values())


def test_the_layout_follows_the_tokens_made_not_max_new_tokens(llama_pair, monkeypatch):
    """max_new_tokens=32768 stopped after 20 tokens: the suffix tables, the device plan's shapes and the pool
    are those of a call of 20 tokens (the widths bucketed: plan.shape_bucket)."""
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=1)
    expected = _generate(stock, ids, mask, "beam", 32768, 20)
    assert expected.shape[1] == ids.shape[1] + 20
    steps = Steps(monkeypatch)
    out = _generate(cascade, ids, mask, "beam", 32768, 20, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    layout, = steps.layouts                       # 20 tokens fit the first layout: no widening
    assert layout.suffix_width <= plan_module.shape_bucket(math.ceil((ids.shape[1] + FIRST_ROOM) / layout.block_size))
    assert layout.token_limit <= ids.shape[1] + FIRST_ROOM
    for call in steps.calls:
        assert tuple(call["device_plan"].suffix_table.shape) == (8, layout.suffix_width)
        assert call["longest"] <= layout.max_row_tokens <= layout.token_limit
    # the pool holds what the 20 tokens need: the same as a call that asks for 20
    reserved = returned_cache(out).stats().kv_bytes_reserved
    short = _generate(cascade, ids, mask, "beam", 20, 20, return_dict_in_generate=True)
    assert torch.equal(short.sequences, expected)
    assert reserved == returned_cache(short).stats().kv_bytes_reserved


@pytest.mark.parametrize("mode", list(MODES))
def test_tokens_stay_exact_across_widenings_through_the_runner(mode, monkeypatch, caplog):
    """A first layout for 2 new tokens, block size 2: a 40-token call widens its layout about log2(40 / 2) times,
    each logged once and each re-captured by the runner (its eager form), with stock's tokens."""
    monkeypatch.setattr(plan_module, "FIRST_ROOM", 2, raising=False)
    stock, cascade = model_pair("llama")
    ids, mask = padded_batch(seed=4, lengths=(13, 9))
    expected = _generate(stock, ids, mask, mode, 4096, 40)
    spy = RunnerSpy(monkeypatch)
    steps = Steps(monkeypatch)
    with caplog.at_level("INFO", logger="hf_cascade"):
        got = _generate(cascade, ids, mask, mode, 4096, 40,
                        **_cascade_kwargs(cascade, mode, cuda_graphs="eager", block_size=2, **FIXED_POOL))
    assert torch.equal(got, expected)
    widenings = caplog.text.count(WIDENED)
    layouts = steps.layouts
    assert 4 <= widenings <= math.log2(40 / 2) + 1, caplog.text
    assert len(layouts) == widenings + 1                   # one message per widening, no more
    assert [l.token_limit for l in layouts] == sorted({l.token_limit for l in layouts})
    runner, = spy.runners
    assert runner.disabled is None and runner.first_steps == len(layouts)   # captured once per layout
    assert runner.replays >= 40 - 2 * len(layouts)


def test_a_300_token_call_makes_a_few_layouts(llama_pair, monkeypatch, caplog):
    """300 tokens of a call that allows 100000: the default first room, then a few doublings, never one per step;
    the last layout holds about twice the tokens made at most (its table width bucketed: up to twice that again, in
    int32 table entries, not K/V)."""
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=6)
    expected = _generate(stock, ids, mask, "sample", 100_000, 300)
    steps = Steps(monkeypatch)
    with caplog.at_level("INFO", logger="hf_cascade"):
        got = _generate(cascade, ids, mask, "sample", 100_000, 300)
    assert torch.equal(got, expected)
    widenings = caplog.text.count(WIDENED)
    assert 1 <= widenings <= math.ceil(math.log2(300 / FIRST_ROOM)), caplog.text
    assert len(steps.layouts) == widenings + 1
    last = steps.layouts[-1]
    assert last.suffix_width <= plan_module.shape_bucket(2 * (23 + 300) // last.block_size)
    assert last.token_limit <= ids.shape[1] + 2 * 300


@pytest.mark.parametrize("first_room", [2, None], ids=["small first room", "default first room"])
@pytest.mark.parametrize("mode", list(MODES))
def test_sliding_window_passed_while_the_layout_widens(mode, first_room, monkeypatch):
    """Mistral with a window of 12, prompts inside it, a long max_new_tokens stopped after 24 tokens: a layout
    whose rows cannot pass the window runs plain causal attention, one whose rows can keeps the window from its
    first step (what a graph captured on it bakes in); stock's tokens either way."""
    if first_room is not None:
        monkeypatch.setattr(plan_module, "FIRST_ROOM", first_room, raising=False)
    window = 12
    stock, cascade = model_pair("mistral", sliding_window=window)
    ids, mask = padded_batch(seed=8, lengths=(7, 5))
    expected = _generate(stock, ids, mask, mode, 4096, 24)
    spy = RunnerSpy(monkeypatch)
    steps = Steps(monkeypatch)
    got = _generate(cascade, ids, mask, mode, 4096, 24,
                    **_cascade_kwargs(cascade, mode, cuda_graphs="eager", block_size=2, **FIXED_POOL))
    assert torch.equal(got, expected)
    runner, = spy.runners
    assert runner.disabled is None
    by_layout = {}
    for call in steps.calls:
        by_layout.setdefault(call["layout"].serial, set()).add(call["window"])
        if call["longest"] > window:
            assert call["window"] == window
    assert all(len(w) == 1 for w in by_layout.values())                 # one decision per layout (per capture)
    windows = {w for ws in by_layout.values() for w in ws}
    # the decision follows the capacity of the layout in force, not max_length (which is far past the window)
    assert windows == ({None, window} if first_room == 2 else {window})
    assert all(call["longest"] <= call["layout"].max_row_tokens for call in steps.calls)
