"""The block bookkeeping kernel (csrc/blocks.cu, hf_cascade.kernels.cuda_library.blocks_advance): one launch equal bit
for bit to the torch ops of hf_cascade/decode/whole_step.py `advance` (device_blocks.reorder, device_blocks.append, the
plan buffers, the peak) in every state and plan tensor, step after step, over random beam parents on layouts of block
size 1, 16 and 64, with and without a middle level, through each overflow flag (a small pool, a parent from another
prompt, the token limit) and inactive (done) steps; where it cannot run (CPU tensors, shapes it does not take) the torch
ops do. The end-to-end check: a bf16 Llama's captured whole-step beam search gives the same tokens with it on and off.

Run on the GPU machine: ``pytest -m gpu tests/decode/test_gpu_device_blocks.py`` (the CPU tests run anywhere).
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hf_cascade import CascadeConfig
from hf_cascade import device_blocks as db
from hf_cascade.decode import whole_step
from hf_cascade.kernels import cuda_library
from hf_cascade.kv.plan import DecodeLayout, _StaticBuffers

from test_device_blocks import _parents, _prefilled

STATE = ("tables", "lengths", "refcount", "flags", "steps")
PLAN = ("suffix_table", "q_limit", "inner_suffix_table", "inner_q_limit", "write_block", "write_offset", "copy_src",
        "copy_dst")

# name: (block size, system prompt, prompt lengths, beams, room, spare pool blocks, cross rate, the flag it ends on)
CASES = {
    "bs16-mid": (16, 37, [50, 81, 120], 4, 60, 400, 0.0, 0),
    "bs16-flat": (16, 0, [33, 64, 97, 5], 3, 60, 400, 0.0, 0),
    "bs64-mid": (64, 130, [70, 200], 5, 100, 60, 0.0, 0),
    "bs1-mid": (1, 9, [30, 41], 4, 60, 4000, 0.0, 0),
    # 3 x ~3000 tokens in blocks of 1: ids across several 4096-id chunks, a pool of ~70 chunks
    "bs1-big-pool": (1, 0, [2990, 3100, 3300], 4, 60, 280_000, 0.0, 0),
    "bs16-many-rows": (16, 20, [int(x) for x in np.random.default_rng(3).integers(1, 90, 75)], 4, 60, 2000, 0.0, 0),
    "bs1-pool-exhausted": (1, 5, [12, 9], 3, 60, 40, 0.0, db.POOL_EXHAUSTED),
    "bs16-pool-exhausted": (16, 0, [20, 47], 4, 200, 14, 0.0, db.POOL_EXHAUSTED),
    "bs16-left-levels": (16, 40, [40, 50, 33], 3, 60, 400, 0.03, db.LEFT_LEVELS),
    "bs1-left-levels": (1, 0, [6, 9], 4, 60, 400, 0.08, db.LEFT_LEVELS),
    "bs16-outgrown": (16, 20, [30, 45], 3, 9, 400, 0.0, db.OUTGROWN),
    "bs64-outgrown": (64, 0, [60, 70], 4, 12, 400, 0.0, db.OUTGROWN),
}
STEPS = 50


def _setup(case):
    """(a BlockManager after prefill and fork, its layout frozen, the pool's size) of ``case``."""
    bs, system_len, prompt_lens, beams, room, spare, _, _ = CASES[case]
    m = _prefilled(bs, system_len, prompt_lens, beams)
    layout = DecodeLayout.freeze(m.tables(), m.lengths, bs, room, min_group_rows=2)
    pool = m.capacity + spare
    return m, layout, pool


def _fresh(m, layout, pool, device):
    """A DeviceBlocks, a DevicePlan of its own (the layout's buffers are one per device) and a peak."""
    return (db.DeviceBlocks.from_host(m, layout, pool, device=device),
            _StaticBuffers(layout, torch.device(device)).plan, torch.zeros((), dtype=torch.int64, device=device))


def _torch_advance(blocks, plan, parents, done, peak):
    was, whole_step.blocks_kernel = whole_step.blocks_kernel, False
    try:
        whole_step.advance(blocks, plan, parents, done, peak)
    finally:
        whole_step.blocks_kernel = was


def _kernel_advance(blocks, plan, parents, done, peak):
    assert cuda_library.blocks_advance(blocks, plan, parents, done, peak), "the kernel did not run"


def _assert_same(a, b, what):
    """(blocks, plan, peak) of the torch ops ``a`` and of the kernel ``b`` equal bit for bit."""
    def same(x, y, name):
        if not torch.equal(x, y):
            at = (x != y).nonzero()[:5].tolist() if x.shape == y.shape else "shape"
            raise AssertionError(f"{name} differs at {what}: at {at}; torch {x.flatten()[:24].tolist()}, "
                                 f"kernel {y.flatten()[:24].tolist()}")

    for name in STATE:
        same(getattr(a[0], name), getattr(b[0], name), name)
    for name in PLAN:
        x, y = getattr(a[1], name), getattr(b[1], name)
        assert (x is None) == (y is None), (name, what)
        if x is not None:
            same(x, y, name)
    same(a[2], b[2], "peak")


def _drive(case, advance, device, seed=0, steps=STEPS):
    """The torch ops and ``advance`` over the same random parents and done flags from one host state, compared after
    every step (``steps`` at most); returns (the flags they ended on, the steps appended, the layout)."""
    bs, system_len, prompt_lens, beams, room, spare, cross_rate, _ = CASES[case]
    m, layout, pool = _setup(case)
    want, got = _fresh(m, layout, pool, device), _fresh(m, layout, pool, device)
    _assert_same(want, got, "from_host")
    rng = np.random.default_rng(seed)
    flagged_at = None
    for step in range(steps):
        parents = torch.as_tensor(_parents(rng, len(prompt_lens), beams, rng.random() < cross_rate), device=device)
        done = torch.tensor(bool(rng.random() < 0.1), device=device)
        _torch_advance(*want[:2], parents, done, want[2])
        advance(*got[:2], parents, done, got[2])
        _assert_same(want, got, (case, step))
        if flagged_at is None and int(want[0].flags):
            flagged_at = step
        if flagged_at is not None and step >= flagged_at + 3:      # a few steps after the flag: they are no-ops
            break
    return int(want[0].flags), int(want[0].steps), layout


def test_the_cases_cover_what_they_name():
    """The cases themselves (on the CPU, torch ops both sides): each ends on its flag after appending some steps;
    "mid" cases have a middle level, "flat" ones none."""
    for case, spec in CASES.items():
        if case in ("bs1-big-pool", "bs16-many-rows"):
            continue                # (slow on the CPU; no flag; the GPU test checks that they end on none)
        flags, steps, layout = _drive(case, _torch_advance, "cpu")
        assert flags == spec[-1], case
        assert steps >= 2, case
        if "mid" in case:
            assert layout.inner_width > 0, case
        if "flat" in case:
            assert layout.inner_width == 0, case


def test_cpu_tensors_and_tensors_it_does_not_take_fall_back_to_torch():
    m, layout, pool = _setup("bs16-mid")
    blocks, plan, peak = _fresh(m, layout, pool, "cpu")
    parents, done = torch.arange(blocks.num_rows), torch.tensor(False)
    assert not cuda_library.blocks_advance(blocks, plan, parents, done, peak)     # CPU tensors
    assert cuda_library.blocks_fit(blocks, plan, parents, done, peak)
    bad = [
        ("parents int32", dict(parents=parents.int())),
        ("done not a scalar", dict(done=done[None])),
        ("peak int32", dict(peak=peak.int())),
        ("tables int64", dict(blocks=dataclasses.replace(blocks, tables=blocks.tables.long()))),
        ("tables strided", dict(blocks=dataclasses.replace(blocks, tables=blocks.tables.t().contiguous().t()))),
        ("refcount short", dict(blocks=dataclasses.replace(blocks, refcount=blocks.refcount[:-1]))),
        ("pool past the kernel's chunks", dict(blocks=dataclasses.replace(
            blocks, pool_blocks=cuda_library.BLOCKS_MAX_POOL + 1,
            refcount=torch.zeros(cuda_library.BLOCKS_MAX_POOL + 2, dtype=torch.int32)))),
        ("no middle level in the plan", dict(plan=dataclasses.replace(plan, inner_suffix_table=None))),
        ("q_limit flat", dict(plan=dataclasses.replace(plan, q_limit=plan.q_limit.view(-1)))),
    ]
    for what, change in bad:
        args = {**dict(blocks=blocks, plan=plan, parents=parents, done=done, peak=peak), **change}
        assert not cuda_library.blocks_fit(**args), what
    many = 1025                                                    # past a thread per row of one CTA
    wide = SimpleNamespace(**{f.name: getattr(blocks, f.name) for f in dataclasses.fields(blocks)})
    wide.tables = torch.zeros(many, blocks.tables.shape[1], dtype=torch.int32)
    assert not cuda_library.blocks_fit(wide, plan, torch.zeros(many, dtype=torch.int64), done, peak)


def test_advance_on_cpu_runs_the_torch_ops(monkeypatch):
    """whole_step.advance asks the kernel first (where blocks_kernel is on) and, where it does not run (CPU), runs the
    torch ops itself."""
    monkeypatch.setattr(whole_step, "blocks_kernel", True)
    asked = []
    real = cuda_library.blocks_advance
    monkeypatch.setattr(cuda_library, "blocks_advance", lambda *a: asked.append(1) or real(*a))
    m, layout, pool = _setup("bs16-mid")
    blocks, plan, peak = _fresh(m, layout, pool, "cpu")
    whole_step.advance(blocks, plan, torch.arange(blocks.num_rows), torch.tensor(False), peak)
    assert asked == [1] and int(blocks.steps) == 1 and int(peak) > 0


# ---- on the GPU ---------------------------------------------------------------------------------------------------
def _library():
    device = torch.device("cuda")
    lib = cuda_library.prebuilt_or_loaded(device) or cuda_library.library(device)    # (advance takes a loaded one)
    if not lib.has_blocks:
        pytest.fail("the kernel library (with hfc_blocks_advance) does not load: build it (csrc/)")
    return lib


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_the_torch_ops_step_for_step(case, seed):
    _library()
    flags, steps, _ = _drive(case, _kernel_advance, "cuda", seed)
    assert flags == CASES[case][-1] and steps >= 2, case


@pytest.mark.gpu
def test_kernel_runs_in_a_captured_graph_and_advance_uses_it(monkeypatch):
    """Captured (the whole step's use): 20 replays of 20 captured steps equal the torch ops' 400 steps; and advance
    runs the kernel (one launch) where it runs, the torch ops where blocks_kernel is off."""
    _library()
    monkeypatch.setattr(whole_step, "blocks_kernel", True)
    m, _, _ = _setup("bs16-many-rows")
    layout = DecodeLayout.freeze(m.tables(), m.lengths, 16, 420, min_group_rows=2)     # room for every step
    pool = m.capacity + 40_000
    want, got = _fresh(m, layout, pool, "cuda"), _fresh(m, layout, pool, "cuda")
    parents = torch.arange(want[0].num_rows, device="cuda")
    done = torch.tensor(False, device="cuda")
    rng = np.random.default_rng(5)
    beams, prompts = 4, len(CASES["bs16-many-rows"][2])
    calls = []
    real = cuda_library.blocks_advance
    monkeypatch.setattr(cuda_library, "blocks_advance", lambda *a: calls.append(1) or real(*a))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        whole_step.advance(*got[:2], parents, done, got[2])    # (a warm-up step outside the capture)
        _torch_advance(*want[:2], parents, done, want[2])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    sequence = [torch.as_tensor(_parents(rng, prompts, beams, False), device="cuda") for _ in range(20 * 20)]
    staged = torch.stack(sequence[:20])
    with torch.cuda.graph(graph):
        for i in range(20):
            parents.copy_(staged[i])
            whole_step.advance(*got[:2], parents, done, got[2])
    assert len(calls) == 21
    for replay in range(20):
        staged.copy_(torch.stack(sequence[20 * replay:20 * replay + 20]))
        graph.replay()
        for i in range(20):
            _torch_advance(*want[:2], sequence[20 * replay + i], done, want[2])
        _assert_same(want, got, replay)
    assert int(got[0].steps) == 401 and int(got[0].flags) == 0
    monkeypatch.setattr(whole_step, "blocks_kernel", False)
    whole_step.advance(*got[:2], parents, done, got[2])
    assert len(calls) == 21


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["beam", "beam-eos"])
def test_whole_step_beam_search_gives_the_same_tokens_with_the_kernel_on_and_off(monkeypatch, case):
    """A captured whole step (bf16 Llama, beam search over 80 tokens: a layout widening, steps after the end) with the
    kernel and with the torch ops; a model each (a runner keeps its captured step for the next call)."""
    from conftest import RunnerSpy
    from test_gpu_graphs import _batch
    from test_gpu_whole_step import CASES as GENERATE_CASES, _models

    _library()
    ids, mask = _batch((300, 170, 240), seed=4)
    calls = []
    real = cuda_library.blocks_advance
    monkeypatch.setattr(cuda_library, "blocks_advance", lambda *a: calls.append(real(*a)) or calls[-1])
    spy = RunnerSpy(monkeypatch)
    outs = []
    for on in (True, False):
        monkeypatch.setattr(whole_step, "blocks_kernel", on)
        _, model = _models(torch.bfloat16)
        config = CascadeConfig(cuda_graphs=True)
        outs.append(model.generate(input_ids=ids, attention_mask=mask, hf_cascade_config=config, max_new_tokens=80,
                                   pad_token_id=0, **GENERATE_CASES[case]))
        if on:
            assert len(calls) >= 2 and all(calls)     # the kernel ran for every step the device held
            used = len(calls)
    assert len(calls) == used                         # off: never asked
    assert all(r.device_steps > 30 and r.replays > 20 for r in spy.runners) and len(spy.runners) == 2
    assert torch.equal(outs[0], outs[1])
