"""The whole decode step captured on the GPU (hf_cascade/decode/whole_step.py): block bookkeeping, forward and token choice
in one CUDA graph per decode layout. Replays equal the same step run eagerly bitwise in bf16; float32 (TF32 off)
gives stock's tokens for greedy, beam search and seeded sampling; a second call and a layout widening work; beam steps
that copy every layer's blocks at once (cuda_library.layer_copies) give the tokens of per-layer copies; the token
choice's bookkeeping on the library's kernels (whole_step.select_kernel, csrc/select.cu) equals the torch ops byte for
byte, step by step and captured, and gives stock's tokens in float32; greedy steps on the solo kernel
(cuda_tuning.solo_kernel) replay bitwise and follow the three kernels' tokens.

Run on the GPU machine: ``pytest -m gpu tests/decode/test_gpu_whole_step.py``.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_cascade import CascadeConfig
from hf_cascade.decode import whole_step
from hf_cascade.kernels import cuda_library

from conftest import RunnerSpy
from test_gpu_graphs import _batch
from test_select_emulation import CASES as SELECT_CASES, cuda_topk_indices, drive

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden_size=512, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             intermediate_size=1024, vocab_size=1000, max_position_embeddings=8192, pad_token_id=0,
             bos_token_id=None, eos_token_id=None)
CASES = {
    "beam": dict(num_beams=4, num_return_sequences=2),
    "beam-eos": dict(num_beams=4, eos_token_id=[5, 6, 7, 8, 9], early_stopping=True, length_penalty=1.5),
    "sample": dict(do_sample=True, num_return_sequences=3, top_k=50, top_p=0.95, temperature=0.8),
    "greedy": dict(do_sample=False, repetition_penalty=1.2),
}


def _models(dtype, **overrides):
    torch.manual_seed(0)
    shape = {**SHAPE, **overrides}
    with torch.device("cuda"):
        stock = AutoModelForCausalLM.from_config(LlamaConfig(**shape), attn_implementation="sdpa", dtype=dtype)
        cascade = AutoModelForCausalLM.from_config(LlamaConfig(**shape), attn_implementation="cascade", dtype=dtype)
    cascade.load_state_dict(stock.state_dict())
    return stock.eval(), cascade.eval()


@pytest.fixture(scope="module")
def bf16_models():
    return _models(torch.bfloat16)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["cuda", "reference"])
@pytest.mark.parametrize("elementwise", [True, False], ids=["elementwise", "no-elementwise"])
def test_captured_whole_step_equals_eager_whole_step_bitwise(bf16_models, monkeypatch, case, backend, elementwise):
    _, model = bf16_models
    ids, mask = _batch((700, 460, 590), seed=1)
    kw = dict(max_new_tokens=90, pad_token_id=0, **CASES[case])     # 90 > the first layout's room: one widening
    outs = []
    spy = RunnerSpy(monkeypatch)
    for mode in ("eager", True):
        torch.manual_seed(11)
        config = CascadeConfig(cuda_graphs=mode, backend=backend, fuse_elementwise=elementwise)
        outs.append(model.generate(input_ids=ids, attention_mask=mask, hf_cascade_config=config, **kw))
    eager_run, graph_run = spy.runners
    assert eager_run.device_steps > 30 and graph_run.device_steps > 30
    assert graph_run.captures >= 2 and graph_run.replays > 30      # one graph per layout
    assert torch.equal(outs[0], outs[1])
    assert "forward" not in model.__dict__


def _count_select(monkeypatch) -> list:
    """The token choice kernels' launches from now on (their binding's method names)."""
    launches = []
    for name in ("sample_finish", "beam_scores", "beam_finish"):
        real = getattr(type(cuda_library.library(torch.device("cuda"))), name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            launches.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(type(cuda_library.library(torch.device("cuda"))), name, spy)
    return launches


# greedy without processors too: its argmax reads the logits as they are (no float32 copy)
SELECT_GENERATE = {**CASES, "greedy-plain": dict(do_sample=False)}


@pytest.mark.parametrize("select", [False, True, "topk"], ids=["torch-choice", "select-kernels", "select-topk"])
@pytest.mark.parametrize("case", list(SELECT_GENERATE))
def test_float32_whole_step_gives_stock_tokens(monkeypatch, case, select):
    """float32 (TF32 off): captured calls give stock's tokens, the token choice's bookkeeping on torch ops or on the
    library's kernels (whole_step.select_kernel; and select_topk: the small top-k's ranked in the kernel)."""
    if select == "topk" and not SELECT_GENERATE[case].get("num_beams"):
        pytest.skip("the top-k's are beam search's")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    monkeypatch.setattr(whole_step, "select_kernel", bool(select))
    monkeypatch.setattr(whole_step, "select_topk", select == "topk")
    launches = _count_select(monkeypatch)
    stock, cascade = _models(torch.float32)
    ids, mask = _batch((300, 210), seed=2)
    spy = RunnerSpy(monkeypatch)
    kw = dict(max_new_tokens=24, pad_token_id=0, **SELECT_GENERATE[case])
    torch.manual_seed(5)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    torch.manual_seed(5)
    got = cascade.generate(input_ids=ids, attention_mask=mask, hf_cascade_config=CascadeConfig(cuda_graphs=True),
                           **kw)
    assert torch.equal(expected, got), case
    assert bool(launches) == bool(select)
    assert all(r.device_steps > 10 and r.captures >= 1 for r in spy.runners)


# real tokens per prompt, left padded to at least 8 columns
EMPTY_BATCHES = {"all-empty": (0, 0), "empty-and-one-token": (0, 1), "empty-and-longer": (0, 200)}


@pytest.mark.parametrize("case", ["beam", "greedy", "sample"])
@pytest.mark.parametrize("batch", list(EMPTY_BATCHES))
def test_float32_empty_prompts_captured_give_stock_tokens(monkeypatch, case, batch):
    """Empty prompts (all padding, the pad an embedding of its own): the first step runs with the mask (the last pad's
    query sees nothing, as stock's), the device takes the steps over from the third and captures them."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    stock, cascade = _models(torch.float32, pad_token_id=None)
    lengths = torch.tensor(EMPTY_BATCHES[batch], device="cuda")
    width = max(int(lengths.max()), 8)
    mask = (torch.arange(width, device="cuda")[None, :] >= width - lengths[:, None]).long()
    ids = torch.randint(3, 1000, mask.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    ids = ids.masked_fill(mask == 0, 0)
    spy = RunnerSpy(monkeypatch)
    kw = dict(max_new_tokens=24, pad_token_id=0, **CASES[case])
    torch.manual_seed(5)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    torch.manual_seed(5)
    got = cascade.generate(input_ids=ids, attention_mask=mask, hf_cascade_config=CascadeConfig(cuda_graphs=True),
                           **kw)
    assert torch.equal(expected, got), (batch, case)
    assert all(r.device_steps > 10 and r.captures >= 1 for r in spy.runners)


def test_second_call_gives_the_same_tokens(bf16_models, monkeypatch):
    _, model = bf16_models
    ids, mask = _batch((500, 380), seed=3)
    kw = dict(num_beams=4, max_new_tokens=30, pad_token_id=0, hf_cascade_config=CascadeConfig(cuda_graphs=True))
    first = model.generate(input_ids=ids, attention_mask=mask, **kw)
    spy = RunnerSpy(monkeypatch)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **kw), first)
    assert spy.runners[0].device_steps > 20
    assert spy.runners[0].captures == 0          # the kept graph replays (vmm pools keep their addresses)


# an evaluation loop's prompt lengths: with 8 beams the cuda backend's cascade pays from ~1.2k shared tokens (its
# min_saved_tokens), so the loop alternates beams that read their prompt once and beams read as rows of their own
EVAL_LENGTHS = (1500, 700, 1300, 1800, 400, 1600)


@pytest.mark.parametrize("case", ["beam", "greedy"])
@pytest.mark.parametrize("backend", ["cuda", "reference"])
def test_an_evaluation_loop_replays_the_kept_steps_across_prompt_lengths(bf16_models, monkeypatch, case, backend):
    """One model, one call per prompt of 6 lengths, twice over: the calls of the second pass capture nothing (a kept
    layout adopts each call's prefix tables and lengths; the cuda backend's static launches follow the layout's
    shapes) and every captured call gives the tokens of the same call's eager whole step, bitwise."""
    _, model = bf16_models
    kw = dict(max_new_tokens=40, pad_token_id=0, **({"num_beams": 8} if case == "beam" else {"do_sample": False}))
    spy = RunnerSpy(monkeypatch)
    eager = {}
    for n in EVAL_LENGTHS:
        ids, mask = _batch((n,), seed=n)
        eager[n] = model.generate(input_ids=ids, attention_mask=mask, **kw,
                                  hf_cascade_config=CascadeConfig(cuda_graphs="eager", backend=backend))
    captures = []
    for _ in range(2):
        for n in EVAL_LENGTHS:
            ids, mask = _batch((n,), seed=n)
            got = model.generate(input_ids=ids, attention_mask=mask, **kw,
                                 hf_cascade_config=CascadeConfig(cuda_graphs=True, backend=backend))
            assert torch.equal(got, eager[n]), n
            assert spy.runners[-1].device_steps > 30
            captures.append(spy.runners[-1].captures)
    assert sum(captures[:len(EVAL_LENGTHS)]) < len(EVAL_LENGTHS), captures
    assert captures[len(EVAL_LENGTHS):] == [0] * len(EVAL_LENGTHS), captures


def _count_layer_copies(monkeypatch) -> list:
    """The all-layer copy's launches from now on (True each; False where it did not run)."""
    launches, real = [], cuda_library.copy_blocks_layers

    def spy(*args):
        launches.append(real(*args))
        return launches[-1]

    monkeypatch.setattr(cuda_library, "copy_blocks_layers", spy)
    return launches


@pytest.mark.parametrize("case", ["beam", "beam-eos"])
@pytest.mark.parametrize("memory", ["auto", "grow"])
def test_captured_beam_steps_with_the_all_layer_copy_give_the_same_tokens(monkeypatch, case, memory):
    """cuda_library.layer_copies on: a captured beam whole step copies the copy-on-write blocks of every layer's pool in
    one launch as it begins (inside the graph) and its layers' writes launch none; it gives the tokens of the same
    call with the flag off, bitwise (bf16), across a layout widening (a second graph), with vmm pools (fixed addresses)
    and grow pools (they move as they grow: the address tensor is rewritten in place between graphs); a second call
    replays the kept graph (vmm) and gives the same tokens again. One model per setting: a model keeps its graph."""
    ids, mask = _batch((700, 460, 590), seed=1)
    kw = dict(max_new_tokens=90, pad_token_id=0, **CASES[case])     # 90 > the first layout's room: one widening
    outs = []
    spy = RunnerSpy(monkeypatch)
    launches = _count_layer_copies(monkeypatch)
    for on in (False, True):
        monkeypatch.setattr(cuda_library, "layer_copies", on)
        _, model = _models(torch.bfloat16)
        torch.manual_seed(11)
        outs.append(model.generate(input_ids=ids, attention_mask=mask,
                                   hf_cascade_config=CascadeConfig(cuda_graphs=True, memory=memory), **kw))
        assert bool(launches) == on and all(launches)
    off, on = spy.runners
    assert off.captures >= 2 and on.captures >= 2 and on.replays > 30
    assert torch.equal(outs[0], outs[1])
    if memory == "auto":
        torch.manual_seed(11)
        again = model.generate(input_ids=ids, attention_mask=mask,
                               hf_cascade_config=CascadeConfig(cuda_graphs=True, memory=memory), **kw)
        assert spy.runners[-1].captures == 0 and spy.runners[-1].replays > 30
        assert torch.equal(again, outs[0])


def test_float32_beam_steps_with_the_all_layer_copy_give_stock_tokens(monkeypatch):
    """float32 (TF32 off), cuda_library.layer_copies on: a captured beam call gives stock's tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    monkeypatch.setattr(cuda_library, "layer_copies", True)
    launches = _count_layer_copies(monkeypatch)
    stock, cascade = _models(torch.float32)
    ids, mask = _batch((300, 210), seed=2)
    spy = RunnerSpy(monkeypatch)
    kw = dict(max_new_tokens=24, pad_token_id=0, **CASES["beam"])
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    got = cascade.generate(input_ids=ids, attention_mask=mask, hf_cascade_config=CascadeConfig(cuda_graphs=True),
                           **kw)
    assert torch.equal(expected, got)
    assert launches and all(launches)
    assert all(r.device_steps > 10 and r.captures >= 1 for r in spy.runners)


@pytest.mark.parametrize("topk", [False, True], ids=["torch-topk", "kernel-topk"])
@pytest.mark.parametrize("case", list(SELECT_CASES))
def test_select_kernels_equal_the_torch_ops_step_by_step(monkeypatch, case, topk):
    """csrc/select.cu on the GPU against device_select's torch ops, byte for byte after every step (the cases of
    tests/decode/test_select_emulation.py: bf16-rounded logits with tied candidates, every early_stopping, beam
    sampling, a NaN draw), eagerly, on the current stream; the two small top-k's by CUDA's torch.topk between the
    launches, or (whole_step.select_topk) ranked in the first launch against torch.topk itself."""
    monkeypatch.setattr(whole_step, "select_kernel", False)
    monkeypatch.setattr(whole_step, "select_topk", topk)
    lib = cuda_library.library(torch.device("cuda"))
    assert lib.has_select
    drive(case, lib, "cuda", torch.cuda.current_stream().cuda_stream)


@pytest.mark.parametrize("n,k", [(16, 8), (48, 16), (24, 8), (96, 32), (12, 4), (6, 2), (128, 32)])
def test_the_cuda_topk_model_is_torch_topk(n, k):
    """tests/decode/test_select_emulation.py's cuda_topk_indices (what select.cu's choose_beams ranks) is torch.topk's
    order on this GPU, ties included: values rounded to few levels (many ties), the -1e9 of stopped candidates,
    zeros of both signs, NaN and infinities."""
    g = torch.Generator().manual_seed(n * k)
    for levels in (3, 8, 1000):
        x = (torch.randint(0, levels, (64, n), generator=g).float() - levels / 2) / 4
        x[torch.rand(64, n, generator=g) < 0.2] = -1.0e9
        x[torch.rand(64, n, generator=g) < 0.05] = -0.0
        x[:4, :2] = float("nan")
        x[4:8, 1] = float("inf")
        x[8:12, 3] = -float("inf")
        assert torch.equal(cuda_topk_indices(x, k), torch.topk(x.cuda(), k)[1].cpu()), (levels, n, k)


@pytest.mark.parametrize("rows,n,k", [(1, 8 * 128256, 16), (2, 4 * 128256, 8), (8, 32000, 16), (1, 16 * 32000, 32),
                                      (3, 5000, 24), (1, 40, 8)])
def test_the_topk_kernel_is_torch_topk(rows, n, k):
    """cuda_library.topk (csrc/select.cu's two launches) is torch.topk on this GPU, values and indices, ties included:
    bf16-rounded log-probabilities over a vocabulary (many ties), a row's best in one place, -1e9, NaN, inf."""
    lib = cuda_library.library(torch.device("cuda"))
    g = torch.Generator("cuda").manual_seed(rows * k)
    logits = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16).float() * 3
    for x in (torch.log_softmax(logits, dim=-1), logits.round(), logits):
        x = x.clone()
        x[:, : n // 7] = -1.0e9
        x[0, n // 3] = float("inf")
        x[-1, n // 2] = float("nan")
        got = cuda_library.topk(lib, x, k)
        assert got is not None
        want = torch.topk(x, k)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))


@pytest.mark.parametrize("topk", [False, True], ids=["torch-topk", "kernel-topk"])
@pytest.mark.parametrize("case", list(SELECT_GENERATE))
def test_captured_steps_with_the_select_kernels_give_the_same_tokens(monkeypatch, case, topk):
    """whole_step.select_kernel on (and select_topk): the captured whole step runs the token choice's bookkeeping on
    the library's kernels and gives the tokens of the torch ops' step, bitwise (bf16), across a layout widening. One
    model per setting: a model keeps its graph."""
    if topk and not SELECT_GENERATE[case].get("num_beams"):
        pytest.skip("the top-k's are beam search's")
    monkeypatch.setattr(whole_step, "select_topk", topk)
    ids, mask = _batch((700, 460, 590), seed=1)
    kw = dict(max_new_tokens=90, pad_token_id=0, **SELECT_GENERATE[case])
    outs = []
    spy = RunnerSpy(monkeypatch)
    launches = _count_select(monkeypatch)
    for on in (False, True):
        monkeypatch.setattr(whole_step, "select_kernel", on)
        _, model = _models(torch.bfloat16)
        torch.manual_seed(11)
        outs.append(model.generate(input_ids=ids, attention_mask=mask,
                                   hf_cascade_config=CascadeConfig(cuda_graphs=True), **kw))
        assert bool(launches) == on
    off, on = spy.runners
    assert off.captures >= 2 and on.captures >= 2 and on.replays > 30
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("case", ["greedy", "greedy-plain"])
def test_greedy_steps_on_the_solo_kernel(bf16_models, monkeypatch, case):
    """Rows that share no prefix in one launch (cuda_tuning.solo_kernel, csrc/solo.cu): the captured step replays the
    eager one bitwise (the splits are merged in slot order whichever CTA finishes last). Its tokens are not bound to
    the three kernels' (another order of the same bf16 sums): on an H100 (2026-12-05) a greedy row of this random
    model broke a tie within its first 8 new tokens and went on from there; the agreement is printed (pytest -s), and
    the kernel's numbers are checked against the float64 reference in tests/kernels/test_gpu_kernels.py -k solo."""
    from hf_cascade.kernels import cuda_binding, cuda_tuning
    _, model = bf16_models
    ids, mask = _batch((700, 460, 590), seed=1)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=60, min_new_tokens=60, pad_token_id=0,
              **SELECT_GENERATE[case])
    three = model.generate(**kw, hf_cascade_config=CascadeConfig(cuda_graphs=True, backend="cuda"))
    launches = []
    real = cuda_binding._Lib.solo
    monkeypatch.setattr(cuda_binding._Lib, "solo", lambda self, *a, **k: launches.append(1) or real(self, *a, **k))
    monkeypatch.setattr(cuda_tuning, "solo_kernel", True)
    outs = [model.generate(**kw, hf_cascade_config=CascadeConfig(cuda_graphs=mode, backend="cuda"))
            for mode in ("eager", True)]
    assert len(launches) >= 12 * 30           # the eager call's layers, and the captured step's
    assert torch.equal(outs[0], outs[1])
    new = ids.shape[1]
    agree = (three[:, new:] == outs[1][:, new:]).float().mean().item()
    print(f"\n[solo] {case}: new tokens equal to the three kernels' at {agree:.3f} of positions")
