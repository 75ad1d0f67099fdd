"""The token choice kernels' source (csrc/select.cu) run on the CPU (no GPU needed).

select.cu as it is (its kernels and launchers, with their argument checks) and csrc/api.cu's hfc_sample_finish,
hfc_beam_scores and hfc_beam_finish, compiled with the system C++ compiler over a shim of the CUDA built-ins they use:
each ``kernel<<<grid, threads, 0, stream>>>(...)`` runs its CTAs one after another, CTA 0 first (beam_finish's CTA 0
updates cur_len and done, which the other CTAs must not read), each CTA as 1024 std::threads with a std::barrier for
``__syncthreads`` / ``__syncthreads_or`` and function-static arrays for ``__shared__``. Called through the real
ctypes binding (cuda_binding._Lib.sample_finish / beam_scores / beam_finish, by whole_step.choose_on_library) with CPU
tensors, every step must leave the selection state and the next step's inputs byte for byte as the torch ops of
device_select and whole_step.choose do: greedy and sampling with and without eos, beam search with one and two eos
ids, every early_stopping, length penalties, beam sampling, a logits processor, prompts of several lengths, logits
rounded to bf16 (ties among the candidates), through the end of the call and steps after it. The CPU's torch divides
by the length penalty where CUDA multiplies by its reciprocal, so both sides here take CUDA's multiplication
(``device_select._length_multiplied``). This checks the kernels' logic and indexing, not the GPU's code for them:
tests/decode/test_gpu_whole_step.py runs them on a GPU.
"""
from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from hf_cascade.decode import device_select, whole_step
from hf_cascade.kernels import cuda_binding, cuda_library

from conftest import CTA_SHIM, RUNTIME_SHIM, emulated_api, emulated_binding, host_library

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++20 compiler (g++)")

CSRC = Path(__file__).resolve().parents[2] / "csrc"

SHIM = r"""
#include <atomic>
#include <barrier>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>
""" + RUNTIME_SHIM + r"""
static dim3 blockIdx, gridDim, blockDim;
static thread_local dim3 threadIdx;
static std::barrier<>* emu_cta;
static std::atomic<int> emu_count;

"""
SHIM += CTA_SHIM + r"""

// a launch: the CTAs one after another (CTA 0 first), each as `threads` threads meeting at one barrier (a thread that
// returns leaves it)
template <class Kernel, class... Args>
void emu_launch(dim3 grid, unsigned threads, Kernel kernel, Args... args) {
  gridDim = grid, blockDim = dim3(threads);
  for (unsigned y = 0; y < grid.y; ++y)
  for (unsigned x = 0; x < grid.x; ++x) {
    blockIdx = dim3(x, y);
    std::barrier<> cta(threads);
    emu_cta = &cta;
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        threadIdx = dim3(t);
        kernel(args...);
        emu_cta->arrive_and_drop();
      });
    for (auto& th : pool) th.join();
  }
}
"""

def _source() -> str:
    """The shim, launch.h's select structs, select.cu with its launches turned into emu_launch, api.cu's error
    functions and its three entries."""
    header = (CSRC / "include" / "hfc" / "launch.h").read_text(encoding="utf-8")
    structs = header[header.index("struct SelectNext {"):]
    structs = structs[:structs.index("cudaError_t beam_finish_launch(")]
    rounding = (CSRC / "include" / "hfc" / "rounding.cuh").read_text(encoding="utf-8").replace("#pragma once\n", "")
    cu = (CSRC / "select.cu").read_text(encoding="utf-8")
    cu = rounding + re.sub(r'#include "hfc/[a-z]+\.(?:cu)?h"\n', "", cu)
    cu, launches = re.subn(r"(\w+)<<<([^,]+),\s*([^,]+),\s*[^,]+,\s*[^>]+>>>\(", r"emu_launch(\2, \3, \1, ", cu)
    assert launches == 5, "select.cu's five launches not found"
    cu = cu.replace("namespace hfc {", "namespace hfc {\n" + structs, 1)
    error_functions, entries = emulated_api(("hfc_sample_finish", "hfc_beam_scores", "hfc_beam_finish", "hfc_topk"))
    return f"{SHIM}\n{error_functions}\n{cu}\n{entries}"


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The binding (cuda_binding._Lib's own sample_finish / beam_scores / beam_finish and error check) on the
    emulated library."""
    lib = host_library(tmp_path_factory.mktemp("select"), "select", _source(),
                       ["-std=c++20", "-pthread", "-Wall", "-Werror", "-Wno-unused-function",
                        "-Wno-unknown-pragmas"])
    assert cuda_binding.declare_select(lib)
    binding = emulated_binding(lib)
    binding.has_topk = True
    return binding


@pytest.fixture(autouse=True)
def cuda_length_rounding(monkeypatch):
    """Both sides divide by the length penalty as CUDA does: a multiplication by the float32 reciprocal."""
    monkeypatch.setattr(device_select, "_length_multiplied", lambda device: True)


VOCAB = 40

# name -> (SelectionConfig fields, prompt length, steps); max_length is prompt + new tokens
CASES = {
    "greedy-eos": (dict(batch_size=3, eos_token_ids=(3,), max_length=14), 5, 14),
    "greedy-no-eos": (dict(batch_size=2, max_length=12), 4, 10),
    "sample-eos": (dict(batch_size=2, num_return_sequences=3, do_sample=True, top_k=8, eos_token_ids=(3, 5)), 4, 14),
    "beam-eos": (dict(batch_size=2, num_beams=4, eos_token_ids=(3,)), 5, 16),
    "beam-two-eos-early": (dict(batch_size=2, num_beams=3, eos_token_ids=(3, 7), early_stopping=True,
                                length_penalty=0.7), 4, 16),
    "beam-never": (dict(batch_size=1, num_beams=4, eos_token_ids=(2,), early_stopping="never",
                        length_penalty=1.5), 6, 16),
    "beam-no-eos": (dict(batch_size=2, num_beams=2, length_penalty=-0.5), 3, 12),
    "beam-sample": (dict(batch_size=2, num_beams=3, do_sample=True, eos_token_ids=(3,)), 4, 14),
    "beam-repetition": (dict(batch_size=1, num_beams=5, eos_token_ids=(4,), repetition_penalty=1.3), 5, 14),
    # 64 rows: beam_finish's tiles are 16 columns wide, so the new columns span the tiles of two CTAs
    "beam-many-rows": (dict(batch_size=16, num_beams=4, eos_token_ids=(3,), max_length=26), 4, 24),
    # a NaN in one row's logits at step NAN_STEP: the draw flags it, the call ends there, finalize raises
    "sample-nan": (dict(batch_size=2, num_return_sequences=2, do_sample=True, eos_token_ids=(3,)), 4, 8),
    "beam-sample-nan": (dict(batch_size=2, num_beams=3, do_sample=True, eos_token_ids=(3,)), 4, 8),
}
NAN_STEP = 3


def _logits(generator, rows, step, eos, device):
    """``[rows, 1, VOCAB]`` float32 logits rounded to bf16 (ties among the top candidates), eos likely at some steps."""
    logits = (torch.randn(rows, 1, VOCAB, generator=generator) * 2).to(torch.bfloat16).to(torch.float32)
    if eos and step % 3 == 1:
        logits[:, :, eos[step % len(eos)]] += 3.0
    return logits.to(device)


def _call(case, device):
    fields, prompt_length, _ = CASES[case]
    fields = dict(fields)
    fields.setdefault("max_length", prompt_length + 9)
    config = device_select.SelectionConfig(prompt_length=prompt_length, **fields)
    g = torch.Generator().manual_seed(len(case))
    prompts = torch.randint(0, VOCAB, (config.batch_size, prompt_length), generator=g)
    per_prompt = config.rows // config.batch_size
    return config, prompts.repeat_interleave(per_prompt, dim=0).to(device)


def _inputs(rows, start, device="cpu"):
    return (torch.zeros(rows, dtype=torch.int64, device=device), torch.zeros(rows, 1, dtype=torch.int64, device=device),
            (torch.full((rows, 1), start, dtype=torch.int64, device=device),
             torch.tensor([start], dtype=torch.int64, device=device)))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte for byte (float signs of zero and NaN payloads included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def drive(case: str, lib, device, stream: int = 0) -> None:
    """CASES[case]'s call step by step on two states, one with the torch ops (whole_step.choose, select_kernel off),
    one with ``lib``'s kernels (whole_step.choose_on_library): the states and the next step's inputs byte for byte
    equal after every step; the call reaches its end and steps run after it. (tests/decode/test_gpu_whole_step.py runs
    it with the library on a GPU.)"""
    config, input_ids = _call(case, device)
    steps = CASES[case][2]
    states = [device_select.new_state(config, input_ids, generator=torch.Generator(device).manual_seed(1234))
              for _ in range(2)]
    nexts = [_inputs(config.rows, config.prompt_length, device) for _ in range(2)]
    g = torch.Generator().manual_seed(7)
    finished_at = None
    for step in range(steps):
        logits = _logits(g, config.rows, step, config.eos_token_ids, device)
        if case.endswith("-nan") and step == NAN_STEP:
            logits[-1, 0, 5] = float("nan")      # (the last prompt's: the first runs on but for the flag)
        whole_step.choose(states[0], logits[:, -1], *nexts[0])
        whole_step.choose_on_library(lib, states[1], logits[:, -1], *nexts[1], stream=stream)
        for name, tensor in states[0].tensors().items():
            assert _same(states[1].tensors()[name], tensor), (case, step, name)
        for want, got in zip((nexts[0][0], nexts[0][1], *nexts[0][2]), (nexts[1][0], nexts[1][1], *nexts[1][2])):
            assert torch.equal(want, got), (case, step)
        if finished_at is None and bool(states[0].done):
            finished_at = step
    # the case reached the end of its call and ran steps after it (which change nothing but the positions)
    assert finished_at is not None and finished_at < steps - 1, (case, finished_at)
    if case.endswith("-nan"):
        assert finished_at == NAN_STEP and bool(states[1].invalid)
        for state in states:
            with pytest.raises(RuntimeError, match="probability tensor contains"):
                device_select.finalize(state)
        return
    if config.is_beam:
        assert bool(states[0].is_finished.any()), case
    assert device_select.finalize(states[0]).sequences.equal(device_select.finalize(states[1]).sequences)


def cuda_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``torch.topk(scores, k)[1]`` as torch computes it on CUDA for k <= 32, ties included (the CPU's topk orders ties
    otherwise): the k-th largest in the radix order of the float bits (NaN the largest, -0 below +0), the entries
    above it and then those equal to it gathered in index order, then torch's 32-slot bitonic sort (16 threads x 2
    slots, the slots past k invalid, GTOp: NaN above all, else >). What csrc/select.cu's choose_beams computes;
    tests/decode/test_gpu_whole_step.py checks it against torch.topk on a GPU."""
    assert k <= 32
    bits = scores.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    radix = torch.where(bits & 0x80000000 != 0, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
    radix = torch.where(torch.isnan(scores), 0xFFFFFFFF, radix)
    rows = []
    for r, x in zip(radix.tolist(), scores.tolist()):
        chosen = sorted(range(len(r)), key=lambda i: (-r[i], i))[:k]
        kth = r[chosen[-1]]
        gathered = sorted(i for i in chosen if r[i] > kth) + sorted(i for i in chosen if r[i] == kth)
        keys, values, valid = [x[i] for i in gathered] + [0.0] * (32 - k), gathered + [0] * (32 - k), \
            [True] * k + [False] * (32 - k)

        def greater(a, b):
            return (math.isnan(a) and not math.isnan(b)) or a > b

        def swap(i, j, direction):
            if ((greater(keys[i], keys[j]) and valid[i]) or not valid[j]) == direction:
                for array in (keys, values, valid):
                    array[i], array[j] = array[j], array[i]

        stages = [(size, stride, None) for size in (2, 4, 8, 16) for stride in (8, 4, 2, 1) if stride < size]
        stages += [(32, stride, False) for stride in (16, 8, 4, 2, 1)]
        for size, stride, direction in stages:
            for thread in range(16):
                position = 2 * thread - (thread & (stride - 1))
                flag = (thread & (size // 2)) != 0 if direction is None else direction
                swap(position, position + stride, flag)
        rows.append(values[:k])
    return torch.tensor(rows, dtype=torch.int64, device=scores.device)


@pytest.mark.parametrize("topk", [False, True], ids=["torch-topk", "kernel-topk"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_source_equals_the_torch_ops(emulated, monkeypatch, case, topk):
    """With whole_step.select_topk the kernel ranks the two small top-k's itself: both sides then rank as torch does
    on CUDA (cuda_topk_indices; the CPU's torch.topk orders ties otherwise)."""
    monkeypatch.setattr(whole_step, "select_kernel", False)
    monkeypatch.setattr(whole_step, "select_topk", topk)
    if topk:
        monkeypatch.setattr(device_select, "top_beams", cuda_topk_indices)
        monkeypatch.setattr(device_select, "top_candidates", cuda_topk)
        monkeypatch.setattr(cuda_library, "TOPK_CHUNK_MIN", 16)       # (several chunks a row: their merge)
    drive(case, emulated, "cpu")


def cuda_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(scores, k)`` as CUDA orders it (:func:`cuda_topk_indices`)."""
    indices = cuda_topk_indices(scores, k)
    return scores.gather(1, indices), indices


@pytest.mark.parametrize("rows,n,k", [(1, 5000, 16), (3, 700, 32), (2, 64, 8), (1, 33, 33 - 1), (4, 1000, 1)])
def test_the_topk_kernel_source_is_torch_s_cuda_order(emulated, monkeypatch, rows, n, k):
    """hfc_topk (its chunks' best, then the row's, gathered and sorted as torch does) equals the model of torch.topk on
    CUDA on scores with heavy ties or distinct ones, -1e9, zeros of both signs, NaN and infinities, over one chunk and
    over many."""
    g = torch.Generator().manual_seed(rows * n + k)
    for chunk_min, levels in ((4096, 6), (16, 6), (4096, None), (16, None)):
        monkeypatch.setattr(cuda_library, "TOPK_CHUNK_MIN", chunk_min)
        x = (torch.randn(rows, n, generator=g) if levels is None       # (distinct values, in no order)
             else (torch.randint(0, levels, (rows, n), generator=g).float() - 3) / 4)
        x[torch.rand(rows, n, generator=g) < 0.2] = -1.0e9
        x[torch.rand(rows, n, generator=g) < 0.05] = -0.0
        if levels is not None:
            x[0, 1] = float("nan")
            x[-1, n // 2] = float("inf")
        elif n >= 128 * (k + 2):        # the best all in thread 0's stride, best first: its list holds all k of them
            stride = torch.arange(k + 2) * 128      # (the kernel's CTAs have 128 threads)
            x[:, stride] = 10.0 + torch.arange(k + 2, 0, -1).float()
        values, indices = cuda_library.topk(emulated, x, k)
        want = cuda_topk_indices(x, k)
        assert torch.equal(indices, want), (chunk_min, indices, want)
        assert torch.equal(values.view(torch.int32), x.gather(1, want).view(torch.int32))


def test_the_cuda_topk_model_is_a_top_k():
    """cuda_topk_indices picks the k largest (NaN largest) and orders distinct values as topk does; a tie's order is
    the bitonic network's: equal values may leave index order (which torch.topk on CUDA does too)."""
    g = torch.Generator().manual_seed(3)
    for n, k in ((16, 8), (48, 16), (24, 8), (96, 32), (5, 2)):
        distinct = torch.randperm(n, generator=g).float().view(1, -1) - n / 2
        assert torch.equal(cuda_topk_indices(distinct, k), torch.topk(distinct, k)[1])
        tied = (torch.randn(3, n, generator=g) * 2).round()
        got = cuda_topk_indices(tied, k)
        assert torch.equal(tied.gather(1, got), torch.topk(tied, k)[0])
    # (a tie of two leaves index order in this network: ties are where the model and the CPU's order part)
    tied = torch.tensor([[5.0, 5.0, 1.0, 0.0]])
    assert cuda_topk_indices(tied, 2).tolist() in ([[0, 1]], [[1, 0]])
    special = torch.tensor([[0.0, -0.0, float("nan"), -1e9, -1e9, 3.0, float("inf")]])
    got = cuda_topk_indices(special, 5)[0].tolist()
    assert got[:2] == [2, 6] and got[2] == 5 and sorted(got[3:]) == [0, 1]


def test_the_launchers_refuse_rows_past_a_cta(emulated):
    """More rows than a CTA's threads: the launcher refuses with the limits named (select_fits keeps such calls on the
    torch ops)."""
    config = device_select.SelectionConfig(batch_size=1025, prompt_length=2, max_length=6)
    state = device_select.new_state(config, torch.zeros(1025, 2, dtype=torch.int64))
    parents, ids, positions = _inputs(1025, 2)
    with pytest.raises(RuntimeError, match=r"sample_finish: rows 1025 \(1\.\.1024\)"):
        emulated.sample_finish(state, torch.zeros(1025, dtype=torch.int64), None, parents, ids, positions, 0, -1, 0)
