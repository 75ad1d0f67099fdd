"""The FlashInfer backend (hf_cascade.kernels.flashinfer).

GPU tests (marked ``gpu``; skipped without CUDA or FlashInfer): the backend against the reference
backend computed in float32 on the same bf16/fp16 pool, on random paged layouts built with
``build_step_plan`` (random block permutations, groups of different sizes, a row in no group, an
empty-prefix step, prefixes up to 16k, suffixes up to 1024): one grid of dtype/head_dim x GQA 1/4/8 x
block sizes 16 and 64 x 1 and 3 query tokens per row, and named layouts x query tokens, in both MODEs.

CPU tests (always run): the backend's own logic against a stand-in ``flashinfer`` module written in
torch with FlashInfer's documented semantics (paged NHD layout, int32 CPU plan arrays, bottom-right
causal mask, base-2 LSE), which checks the plan arrays and the gather/merge/scatter plumbing; the
support check's reasons; the version gate; and that ``select("auto")`` falls through to the
reference with one logged line.

Distinct (dtype, head_dim) pairs compile FlashInfer modules on first use (about 80 s each on the
H200); the GPU cases use only bf16 x {64, 128} and fp16 x 128.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import sys
import threading
import types
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_cascade import kernels
from hf_cascade.kernels import reference
from hf_cascade.plan import build_step_plan
from kernel_helpers import random_layout, step_context_of

FI_PATH = Path(kernels.__file__).with_name("flashinfer.py")
LN2 = math.log(2.0)


# --------------------------------------------------------------------------- layouts

@dataclass
class _Append:
    """A stand-in for blocks.AppendPlan (build_step_plan only copies these through)."""
    write_block: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    write_offset: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    copy_src: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    copy_dst: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def make_case(seed, *, groups, prefixes, suffix, bs, Lq, Hq, Hkv, D, dtype, device, shuffle=True,
              garbage=1e4, extra_blocks=5, new_mask=None):
    """A random paged step: (q [R, Lq, Hq, D] non-contiguous view, pool, plan).

    ``groups[i]`` rows share a prompt of ``prefixes[i]`` tokens; its full blocks are stored once (a
    group of one row, or a prompt shorter than a block, gives rows in no group). Every row then holds
    the prompt's partial last block (its own copy) and ``suffix`` = (lo, hi) more tokens, the last Lq
    of which are this step's (:func:`kernel_helpers.random_layout` with ``aligned_prefixes``); the plan
    comes from the rows' block tables through ``build_step_plan``, as the cache builds it.
    """
    lay = random_layout(seed, groups=list(zip(groups, prefixes)), lone_rows=0, suffix=suffix, Lq=Lq, Hkv=Hkv, Hq=Hq,
                        D=D, bs=bs, dtype=dtype, device=device, garbage=garbage, extra_blocks=extra_blocks,
                        aligned_prefixes=True, shuffle=shuffle, q_view=True)
    tables, lengths = lay.tables()
    counts = np.full(len(lengths), Lq, dtype=np.int64) if new_mask is None else new_mask.sum(axis=1).astype(np.int64)
    plan = build_step_plan(tables, lengths, counts, new_mask, Lq, _Append(), bs, min_group_rows=2)
    expected_groups = sum(1 for n, p in zip(groups, prefixes) if n >= 2 and p >= bs)
    assert plan.num_groups == expected_groups
    return lay.q, lay.pool, plan


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()



def attend(module, q, pool, plan, scale):
    """One layer on the FlashInfer backend of ``module`` as the attention runs it: the step's metadata (its planned
    wrappers, shared by the step's layers), then the layer's forward."""
    params = kernels.AttentionParams(scale)
    metadata = step_context_of(plan).backend_metadata(module.BACKEND, q, pool, params)
    return module.BACKEND.forward(q, pool, metadata, params)


def reference_out(q, pool, plan, scale):
    return reference.attend(q.float(), pool.float(), plan, scale)


# --------------------------------------------------------------------------- a torch stand-in for flashinfer

def _fake_flashinfer(version="0.7.2.post1"):
    """A module with FlashInfer's names and semantics, in torch (float32 math), for CPU tests."""
    fi = types.ModuleType("flashinfer")
    fi.__version__ = version
    fi.calls = []

    def check_i32_cpu(*ts):
        for t in ts:
            assert isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.device.type == "cpu", t

    def paged_attention(q, cache, qo, kv, idx, last, ps, causal, scale):
        Hq, D = q.shape[1], q.shape[2]
        Hkv = cache.shape[3]
        grp = Hq // Hkv
        o = torch.zeros(q.shape, dtype=torch.float32)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32)
        for i in range(len(qo) - 1):
            q_i = q[qo[i]:qo[i + 1]].float()                       # [n, Hq, D]
            pages = idx[kv[i]:kv[i + 1]].long()
            assert 1 <= int(last[i]) <= ps and len(pages) >= 1
            kv_len = (len(pages) - 1) * ps + int(last[i])
            k = cache[pages, 0].reshape(-1, Hkv, D)[:kv_len].float().repeat_interleave(grp, dim=1)
            v = cache[pages, 1].reshape(-1, Hkv, D)[:kv_len].float().repeat_interleave(grp, dim=1)
            s = torch.einsum("nhd,thd->hnt", q_i, k) * scale
            n = q_i.shape[0]
            if causal:   # bottom-right aligned
                allowed = torch.arange(kv_len)[None, :] <= torch.arange(n)[:, None] + kv_len - n
                s = s.masked_fill(~allowed[None], float("-inf"))
            lse[qo[i]:qo[i + 1]] = (torch.logsumexp(s, dim=-1) / LN2).transpose(0, 1)
            o[qo[i]:qo[i + 1]] = torch.einsum("hnt,thd->nhd", torch.softmax(s, dim=-1), v)
        return o.to(q.dtype), lse

    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, **kw):
            assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8

        def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                 num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
                 causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None,
                 window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16",
                 kv_data_type=None, o_data_type=None, non_blocking=True):
            check_i32_cpu(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
            assert isinstance(q_data_type, torch.dtype) and isinstance(kv_data_type, torch.dtype)
            fi.calls.append(("prefill.plan", causal, len(qo_indptr) - 1))
            self.args = (qo_indptr.tolist(), paged_kv_indptr.tolist(), paged_kv_indices, paged_kv_last_page_len,
                         page_size, causal, sm_scale if sm_scale is not None else head_dim_qk ** -0.5)
            self.shape = (num_qo_heads, num_kv_heads, head_dim_qk, q_data_type)

        def run(self, q, paged_kv_cache, *args, out=None, lse=None, return_lse=False):
            assert q.is_contiguous() and q.dim() == 3 and paged_kv_cache.dim() == 5
            assert (q.shape[1], paged_kv_cache.shape[3], q.shape[2], q.dtype) == self.shape
            qo, kv, idx, last, ps, causal, scale = self.args
            assert q.shape[0] == qo[-1]
            fi.calls.append(("prefill.run", q.shape[0]))
            o, s = paged_attention(q, paged_kv_cache, qo, kv, idx, last, ps, causal, scale)
            return (o, s) if return_lse else o

    class BatchDecodeWithPagedKVCacheWrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                     **kw):
            assert kv_layout == "NHD" and use_tensor_cores

        def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
                 pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
                 kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
                 non_blocking=True):
            check_i32_cpu(indptr, indices, last_page_len)
            assert isinstance(q_data_type, torch.dtype) and isinstance(kv_data_type, torch.dtype)
            fi.calls.append(("decode.plan", len(indptr) - 1))
            n = len(indptr) - 1
            self.args = (list(range(n + 1)), indptr.tolist(), indices, last_page_len, page_size, False,
                         sm_scale if sm_scale is not None else head_dim ** -0.5)

        def run(self, q, paged_kv_cache, *args, out=None, lse=None, return_lse=False):
            assert q.is_contiguous() and q.shape[0] == len(self.args[0]) - 1
            fi.calls.append(("decode.run", q.shape[0]))
            o, s = paged_attention(q, paged_kv_cache, *self.args)
            return (o, s) if return_lse else o

    def merge_state_in_place(v, s, v_other, s_other, mask=None):
        assert s.dtype == torch.float32 and s_other.dtype == torch.float32
        assert torch.isfinite(s_other).all() and torch.isfinite(s).all(), "merged an empty segment"
        m = torch.maximum(s, s_other)
        wa, wb = torch.exp2(s - m), torch.exp2(s_other - m)
        v.copy_(((v.float() * wa[..., None] + v_other.float() * wb[..., None]) / (wa + wb)[..., None]).to(v.dtype))
        s.copy_(m + torch.log2(wa + wb))
        fi.calls.append(("merge", v.shape[0]))

    class MultiLevelCascadeAttentionWrapper:
        def __init__(self, num_levels, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, *bufs):
            self.levels = [BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
                           for _ in range(num_levels)]

        def plan(self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len,
                 num_qo_heads, num_kv_heads, head_dim, page_size, causal=False, pos_encoding_mode="NONE",
                 use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None,
                 rope_theta=None, q_data_type="float16", kv_data_type=None):
            fi.calls.append(("multilevel.plan", len(self.levels)))
            for i, w in enumerate(self.levels):
                w.plan(qo_indptr_arr[i], paged_kv_indptr_arr[i], paged_kv_indices_arr[i], paged_kv_last_page_len[i],
                       num_qo_heads, num_kv_heads, head_dim, page_size, causal=causal and i == len(self.levels) - 1,
                       sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type)

        def run(self, q, paged_kv_cache):
            out, lse = self.levels[-1].run(q, paged_kv_cache, return_lse=True)
            for w in self.levels[:-1]:
                o_i, l_i = w.run(q, paged_kv_cache, return_lse=True)
                merge_state_in_place(out, lse, o_i, l_i)
            return out

    fi.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    fi.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    fi.MultiLevelCascadeAttentionWrapper = MultiLevelCascadeAttentionWrapper
    fi.merge_state_in_place = merge_state_in_place
    return fi


def _load_backend_with(monkeypatch, fake, name="_hfc_flashinfer_under_test"):
    """Import kernels/flashinfer.py under a private name with ``fake`` as the flashinfer module
    (the real hf_cascade.kernels.flashinfer, if loaded, is left untouched)."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    spec = importlib.util.spec_from_file_location(name, FI_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fake_backend(monkeypatch):
    return _load_backend_with(monkeypatch, _fake_flashinfer())


# --------------------------------------------------------------------------- CPU tests

CPU_CASES = [
    # groups, prefixes, suffix, bs, Lq, Hq, Hkv, D, shuffle
    ([3, 2, 1], [40, 17, 30], (1, 20), 8, 1, 8, 2, 64, True),      # a row in no group, shuffled rows
    ([3, 2, 1], [40, 17, 30], (3, 20), 8, 3, 8, 2, 64, True),      # Lq 3: causal level 1
    ([2, 2], [3, 5], (1, 12), 8, 1, 4, 4, 64, True),               # prompts shorter than a block: no groups
    ([4, 3], [70, 33], (1, 9), 16, 1, 8, 1, 64, False),            # every row grouped, in order (identity)
    ([4, 3], [70, 33], (3, 40), 16, 3, 8, 1, 64, True),            # every row grouped, shuffled
]


@pytest.mark.parametrize("mode", ["two_wrappers", "multilevel"])
@pytest.mark.parametrize("case", range(len(CPU_CASES)))
def test_plumbing_against_reference_with_torch_flashinfer(fake_backend, monkeypatch, case, mode):
    groups, prefixes, suffix, bs, Lq, Hq, Hkv, D, shuffle = CPU_CASES[case]
    monkeypatch.setattr(fake_backend, "MODE", mode)
    q, pool, plan = make_case(case, groups=groups, prefixes=prefixes, suffix=suffix, bs=bs, Lq=Lq, Hq=Hq,
                              Hkv=Hkv, D=D, dtype=torch.bfloat16, device="cpu", shuffle=shuffle)
    scale = D ** -0.5
    ref = reference_out(q, pool, plan, scale)
    fi = sys.modules["flashinfer"]
    out = attend(fake_backend, q, pool, plan, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, ref) < 1e-2
    plans = [c for c in fi.calls if c[0].endswith(".plan")]
    all_grouped = plan.num_groups and (plan.group_rows >= 0).sum() == q.shape[0]
    if mode == "multilevel" and all_grouped:
        assert plans[0] == ("multilevel.plan", 2)
    else:
        assert ("decode.plan" in [c[0] for c in plans]) == (Lq == 1)
        assert any(c[0] == "prefill.plan" and c[1] is False for c in plans) == bool(plan.num_groups)
    # a second layer reuses the step's wrappers: no new plan() calls
    n_plans = len(plans)
    out2 = attend(fake_backend, q * 0.5, pool, plan, scale)
    assert len([c for c in fi.calls if c[0].endswith(".plan")]) == n_plans
    assert rel_err(out2, reference_out(q * 0.5, pool, plan, scale)) < 1e-2


def test_interleaved_plans_replan(fake_backend):
    """Two steps' plans alive at once (two caches): sharing the wrappers must not mix their plans."""
    kw = dict(groups=[3, 2, 1], prefixes=[40, 17, 30], suffix=(1, 20), bs=8, Lq=1, Hq=8, Hkv=2, D=64,
              dtype=torch.bfloat16, device="cpu")
    qa, pa, plan_a = make_case(11, **kw)
    qb, pb, plan_b = make_case(12, **kw)
    for q, pool, plan in [(qa, pa, plan_a), (qb, pb, plan_b), (qa, pa, plan_a), (qb, pb, plan_b)]:
        assert rel_err(attend(fake_backend, q, pool, plan, 0.125), reference_out(q, pool, plan, 0.125)) < 1e-2


def test_concurrent_threads_never_run_each_others_plans(fake_backend):
    """Two threads' steps at once: thread B plans its step while thread A's layer is inside a wrapper's run. Each
    thread has wrappers of its own (a wrapper holds its last plan), so A's run still reads A's plan."""
    kw = dict(groups=[3, 2, 1], prefixes=[40, 17, 30], suffix=(1, 20), bs=8, Lq=1, Hq=8, Hkv=2, D=64,
              dtype=torch.bfloat16, device="cpu")
    cases = {"a": make_case(21, **kw), "b": make_case(22, **kw)}
    decode = sys.modules["flashinfer"].BatchDecodeWithPagedKVCacheWrapper
    plain_run, a_running, b_planned = decode.run, threading.Event(), threading.Event()

    def run(self, *args, **kwargs):
        if threading.current_thread().name == "a" and not a_running.is_set():
            a_running.set()
            assert b_planned.wait(30)          # B plans while A is between its plan and its run
        return plain_run(self, *args, **kwargs)

    decode.run = run
    outs, errors = {}, []

    def body(name):
        try:
            if name == "b":
                assert a_running.wait(30)
            q, pool, plan = cases[name]
            outs[name] = attend(fake_backend, q, pool, plan, 0.125)
        except BaseException as err:  # noqa: BLE001 — reported below
            errors.append(err)
        finally:
            if name == "b":
                b_planned.set()

    threads = [threading.Thread(target=body, args=(name,), name=name) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for name, (q, pool, plan) in cases.items():
        assert rel_err(outs[name], reference_out(q, pool, plan, 0.125)) < 1e-2, name


def test_unsupported_reasons(fake_backend):
    kw = dict(groups=[2, 1], prefixes=[20, 9], suffix=(1, 5), bs=8, Lq=1, Hkv=2, device="cpu")
    q, pool, plan = make_case(0, Hq=4, D=64, dtype=torch.bfloat16, **kw)
    assert "CUDA" in fake_backend.BACKEND.unsupported_reason(q, pool, plan)
    q32, pool32, plan32 = make_case(0, Hq=4, D=64, dtype=torch.float32, **kw)
    assert "float32" in fake_backend.BACKEND.unsupported_reason(q32, pool32, plan32)
    q96, pool96, plan96 = make_case(0, Hq=4, D=96, dtype=torch.float16, **kw)
    assert "head_dim 96" in fake_backend.BACKEND.unsupported_reason(q96, pool96, plan96)
    q6, pool6, plan6 = make_case(0, Hq=6, D=64, dtype=torch.float16, groups=[2, 1], prefixes=[20, 9], suffix=(1, 5),
                                 bs=8, Lq=1, Hkv=4, device="cpu")
    assert "multiple" in fake_backend.BACKEND.unsupported_reason(q6, pool6, plan6)
    mask = np.ones((3, 3), dtype=bool)
    mask[1, 0] = False                                     # a left pad among the step's new tokens
    qp, poolp, planp = make_case(0, Hq=4, D=64, dtype=torch.bfloat16, groups=[2, 1], prefixes=[20, 9],
                                 suffix=(3, 5), bs=8, Lq=3, Hkv=2, device="cpu", new_mask=mask)
    assert "padding" in fake_backend.BACKEND.unsupported_reason(qp, poolp, planp)


def test_version_gate_and_missing_package(monkeypatch):
    with pytest.raises(ImportError, match=r"0\.2\.0\.post1"):
        _load_backend_with(monkeypatch, _fake_flashinfer(version="0.1.6"), name="_hfc_fi_old")
    monkeypatch.setitem(sys.modules, "flashinfer", None)        # "not installed"
    spec = importlib.util.spec_from_file_location("_hfc_fi_missing", FI_PATH)
    with pytest.raises(ImportError, match="hf_cascade\\[flashinfer\\]"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


@pytest.fixture
def fresh_selection(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(kernels, "_logged", set())
    caplog.set_level(logging.INFO, logger="hf_cascade")
    return caplog


def _flashinfer_lines(caplog):
    return [r.getMessage() for r in caplog.records if "flashinfer" in r.getMessage()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_auto_falls_through_for_cpu_and_float32(fake_backend, fresh_selection, dtype):
    """FlashInfer importable (stand-in) but the step is CPU / float32: auto picks the reference, one log line."""
    kernels._loaded["flashinfer"] = fake_backend.BACKEND
    q, pool, plan = make_case(1, groups=[2, 1], prefixes=[20, 9], suffix=(1, 5), bs=8, Lq=1, Hq=4, Hkv=2, D=64,
                              dtype=dtype, device="cpu")
    for _ in range(3):   # one line, not one per layer/step
        assert kernels.select("auto", q, pool, plan) is reference.BACKEND
    lines = _flashinfer_lines(fresh_selection)
    assert len(lines) == 1, lines
    assert ("float32" if dtype == torch.float32 else "CUDA") in lines[0]
    with pytest.raises(NotImplementedError, match="float32" if dtype == torch.float32 else "CUDA"):
        kernels.select("flashinfer", q, pool, plan)


def test_auto_falls_through_when_flashinfer_missing(monkeypatch, fresh_selection):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setitem(sys.modules, "hf_cascade.kernels.flashinfer", None)
    q, pool, plan = make_case(1, groups=[2, 1], prefixes=[20, 9], suffix=(1, 5), bs=8, Lq=1, Hq=4, Hkv=2, D=64,
                              dtype=torch.bfloat16, device="cpu")
    for _ in range(3):
        assert kernels.select("auto", q, pool, plan) is reference.BACKEND
    lines = _flashinfer_lines(fresh_selection)
    assert len(lines) == 1 and "unavailable" in lines[0], lines


# --------------------------------------------------------------------------- GPU tests

@pytest.fixture(scope="module")
def fib():
    """The real FlashInfer backend on CUDA (the ``gpu`` marker skips without CUDA; this, without FlashInfer)."""
    try:
        return importlib.import_module("hf_cascade.kernels.flashinfer")
    except ImportError as err:
        pytest.skip(f"flashinfer backend unavailable: {err}")


BF, FP = torch.bfloat16, torch.float16
# (dtype, head_dim) pairs FlashInfer compiles a module for on first use (about 80 s each on the H200)
DTYPE_DIMS = [(BF, 64), (BF, 128), (FP, 128)]
LAYOUTS = {
    # name: (groups, prefixes, suffix (lo, hi), shuffle), block sizes and Lq from the grid
    "mixed": ([4, 3, 1], [1000, 130, 300], (1, 200), True),           # a row in no group, prefixes mid-block
    "p16k": ([4, 3, 1], [16384, 1000, 300], (1, 64), True),
    "noprefix": ([3, 3], [5, 9], (1, 200), True),                       # prompts shorter than a block
    "allgrouped": ([8, 8], [2048, 640], (1, 100), False),
    "allgrouped-shuffled": ([4, 4], [3000, 200], (1, 300), True),
    "long-suffix": ([4, 2, 1], [1024, 64, 32], (1, 1024), True),
    "empty-prefix-groups": ([2, 2, 2, 1], [0, 700, 16384, 20], (1, 1024), True),
    "no-groups": ([1, 1, 1], [0, 0, 0], (1, 64), True),
}


def _check_against_reference(fib, q, pool, plan, scale, label):
    assert fib.BACKEND.unsupported_reason(q, pool, plan) is None
    ref = reference_out(q, pool, plan, scale)
    out = attend(fib, q, pool, plan, scale)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any()
    err = rel_err(out, ref)
    assert err < 1e-2, f"{label}: relative error {err:.2e}"
    # the next layer of the step: same plan, other queries and pool; the wrappers are not re-planned
    metadata, = step_context_of(plan).metadata.values()
    planned = dict(metadata.steps)
    q2, pool2 = q * 0.7, pool * -0.5
    out2 = attend(fib, q2, pool2, plan, scale)
    assert list(step_context_of(plan).metadata.values()) == [metadata] and metadata.steps == planned
    assert rel_err(out2, reference_out(q2, pool2, plan, scale)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["two_wrappers", "multilevel"])
@pytest.mark.parametrize("Lq", [1, 3])
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("dtype,D", DTYPE_DIMS, ids=["bf16-d64", "bf16-d128", "fp16-d128"])
def test_flashinfer_shape_grid(fib, monkeypatch, dtype, D, ratio, bs, Lq, mode):
    """dtype x head_dim x GQA ratio x block size x query tokens, on one mixed layout, in both MODEs."""
    groups, prefixes, suffix, shuffle = LAYOUTS["mixed"]
    monkeypatch.setattr(fib, "MODE", mode)
    Hkv = {1: 8, 4: 4, 8: 2}[ratio]
    q, pool, plan = make_case(D + 10 * ratio + bs + Lq, groups=groups, prefixes=prefixes, suffix=(Lq, suffix[1]),
                              bs=bs, Lq=Lq, Hq=Hkv * ratio, Hkv=Hkv, D=D, dtype=dtype, device="cuda", shuffle=shuffle)
    _check_against_reference(fib, q, pool, plan, D ** -0.5, f"{dtype} D{D} gqa{ratio} bs{bs} Lq{Lq} {mode}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["two_wrappers", "multilevel"])
@pytest.mark.parametrize("Lq", [1, 3])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_flashinfer_layouts(fib, monkeypatch, name, Lq, mode):
    """Layouts that stress the plan (16k prefixes, no groups, every row grouped, long suffixes) x Lq x MODE."""
    groups, prefixes, suffix, shuffle = LAYOUTS[name]
    monkeypatch.setattr(fib, "MODE", mode)
    q, pool, plan = make_case(zlib.crc32(name.encode()) % 1000 + Lq, groups=groups, prefixes=prefixes,
                              suffix=(max(Lq, suffix[0]), suffix[1]), bs=16, Lq=Lq, Hq=32, Hkv=8, D=128, dtype=BF,
                              device="cuda", shuffle=shuffle)
    _check_against_reference(fib, q, pool, plan, 128 ** -0.5, f"{name} Lq{Lq} {mode}")


@pytest.mark.gpu
def test_flashinfer_nan_garbage_in_unused_slots(fib):
    """Unused slots of partially filled blocks (torch.empty pools) may hold NaN: never read into the output."""
    q, pool, plan = make_case(5, groups=[3, 2, 1], prefixes=[1000, 50, 20], suffix=(1, 40), bs=16, Lq=1, Hq=32,
                              Hkv=8, D=128, dtype=BF, device="cuda", garbage=float("nan"))
    out = attend(fib, q, pool, plan, 128 ** -0.5)
    assert not torch.isnan(out).any()
    assert rel_err(out, reference_out(q, pool, plan, 128 ** -0.5)) < 1e-2


@pytest.mark.gpu
def test_flashinfer_interleaved_plans(fib):
    kw = dict(groups=[3, 2, 1], prefixes=[500, 40, 30], suffix=(1, 20), bs=16, Lq=1, Hq=32, Hkv=8, D=128,
              dtype=BF, device="cuda")
    qa, pa, plan_a = make_case(21, **kw)
    qb, pb, plan_b = make_case(22, **kw)
    for q, pool, plan in [(qa, pa, plan_a), (qb, pb, plan_b), (qa, pa, plan_a)]:
        assert rel_err(attend(fib, q, pool, plan, 0.1), reference_out(q, pool, plan, 0.1)) < 1e-2


@pytest.mark.gpu
def test_auto_prefers_cuda_then_flashinfer_on_cuda_bf16(fib, monkeypatch):
    """The registry is fastest first as measured: our CUDA kernels, then FlashInfer, then the reference."""
    monkeypatch.setattr(kernels, "_logged", set())
    q, pool, plan = make_case(3, groups=[2, 1], prefixes=[64, 9], suffix=(1, 5), bs=16, Lq=1, Hq=8, Hkv=2, D=128,
                              dtype=BF, device="cuda")
    try:
        cuda_backend = kernels.load("cuda")
        cuda_ok = cuda_backend.unsupported_reason(q, pool, plan) is None
    except ImportError:
        cuda_ok = False
    if cuda_ok:
        assert kernels.select("auto", q, pool, plan) is cuda_backend
    monkeypatch.setitem(kernels._loaded, "cuda", ImportError("cuda backend disabled for this test"))
    assert kernels.select("auto", q, pool, plan) is fib.BACKEND
    q32, pool32, plan32 = make_case(3, groups=[2, 1], prefixes=[64, 9], suffix=(1, 5), bs=16, Lq=1, Hq=8, Hkv=2,
                                    D=128, dtype=torch.float32, device="cuda")
    assert kernels.select("auto", q32, pool32, plan32) is not fib.BACKEND
