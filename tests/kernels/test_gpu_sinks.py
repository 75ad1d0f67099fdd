"""Attention sinks (GPT-OSS ``s_aux``) in the GPU backends, against the reference backend in float32.

A GPU backend takes layers with sinks once it lists "sinks" in its ``quirks``; until then these tests skip
for it (``select`` sends such layers to the reference). Each case runs the backend in bf16/fp16 and the
reference in float32 on the same inputs, NaN garbage in unused slots, and asks for no NaN and a relative
error below 1e-2 overall (2e-2 per row and query), as tests/kernels/test_gpu_kernels.py does.

Run on the GPU machine:  PYTHONPATH=. python -m pytest -q -m gpu tests/kernels/test_gpu_sinks.py
"""
from __future__ import annotations

import math

import pytest
import torch

from hf_cascade import kernels
from hf_cascade.kernels.base import AttentionParams
from hf_cascade.kernels import reference
from kernel_helpers import step_plan
from test_reference_kernels import make_layout, make_three_level

pytestmark = pytest.mark.gpu
GPU_BACKENDS = ("cuda", "flashinfer")


@pytest.fixture(params=GPU_BACKENDS)
def backend(request):
    try:
        backend = kernels.load(request.param)
    except ImportError as err:
        pytest.skip(str(err))
    if "sinks" not in backend.quirks:
        pytest.skip(f"backend {request.param!r} does not declare attention sinks (its quirks) yet")
    return backend


def check_against_reference(backend, q, pool, plan, scale, sinks, *, tol=1e-2, row_tol=2e-2, **quirks):
    """The backend with the sinks (and other quirks) vs the float32 reference on the same inputs."""
    out = backend.attend(q, pool, plan, AttentionParams(scale, sinks=sinks, **quirks))
    torch.cuda.synchronize()
    ref = reference.attend(q.float(), pool.float(), plan, AttentionParams(scale, sinks=sinks.float(), **quirks))
    assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out.float()).all()
    o = out.float()
    assert (o - ref).norm() / ref.norm().clamp_min(1e-30) < tol
    diff, size = (o - ref).flatten(2).norm(dim=-1), ref.flatten(2).norm(dim=-1)
    assert (diff[size == 0] == 0).all(), "queries that see no key must give exactly 0 (all weight on the sink)"
    if (size > 0).any():
        assert (diff[size > 0] / size[size > 0]).max() < row_tol
    # the sinks changed the result, so the comparison above checks them
    plain = reference.attend(q.float(), pool.float(), plan, AttentionParams(scale, **quirks))
    assert not torch.allclose(plain, ref, atol=1e-2)


def _on_gpu(lay, dtype):
    return lay.q.to("cuda", dtype), lay.pool.to("cuda", dtype), lay.sinks.to("cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("ratio,Lq", [(1, 1), (4, 1), (8, 3)])
def test_two_levels(backend, ratio, Lq, D, dtype):
    """Groups of several sizes, one with an empty prefix, a row in no group, NaN in unused slots, GQA."""
    lay = make_layout(40 + ratio + D + Lq, Lq=Lq, Hkv=2, ratio=ratio, D=D, bs=16, dtype=torch.float32,
                      garbage=math.nan)
    lay.sinks = 3.0 * torch.randn(lay.q.shape[2], generator=torch.Generator().manual_seed(D + ratio))
    q, pool, sinks = _on_gpu(lay, dtype)
    check_against_reference(backend, q, pool, step_plan(lay), lay.scale, sinks)


@pytest.mark.parametrize("ratio,Lq", [(1, 1), (4, 1), (8, 2)])
def test_three_levels(backend, ratio, Lq):
    """System prompt, each prompt's rest, each row's suffix: the sink enters once per query."""
    lay = make_three_level(60 + ratio + Lq, Lq=Lq, Hkv=2, ratio=ratio, D=128, bs=16, dtype=torch.float32)
    q, pool, sinks = _on_gpu(lay, torch.bfloat16)
    check_against_reference(backend, q, pool, step_plan(lay), lay.scale, sinks)


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 30.0), (7, 20.0)])
def test_with_other_quirks(backend, window, softcap):
    """Sinks together with a sliding window (GPT-OSS's sliding layers) and/or a softcap, where declared."""
    quirks = {name: value for name, value in (("window", window), ("softcap", softcap)) if value is not None}
    lacking = [name for name in quirks if name not in backend.quirks]
    if lacking:
        pytest.skip(f"{backend.name} does not declare {', '.join(lacking)}")
    lay = make_layout(80 + (window or 0), Lq=1, Hkv=2, ratio=4, D=64, bs=16, dtype=torch.float32, garbage=math.nan)
    lay.sinks = 3.0 * torch.randn(lay.q.shape[2], generator=torch.Generator().manual_seed(5))
    q, pool, sinks = _on_gpu(lay, torch.bfloat16)
    check_against_reference(backend, q, pool, step_plan(lay), lay.scale, sinks, **quirks)


@pytest.mark.parametrize("mode", ["beam", "sample"])
def test_gpt_oss_float32_generate_matches_stock_eager(mode):
    """The tiny GPT-OSS of the family matrix on the GPU in float32 (TF32 off): backend "auto" sends its sink
    layers to a backend that declares sinks (the reference until a GPU backend does) and gives stock eager's
    tokens."""
    import test_families as tf
    from transformers import AutoModelForCausalLM

    family = tf.FAMILIES["GPT-OSS"]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch.manual_seed(0)
        with torch.device("cuda"):
            stock = AutoModelForCausalLM.from_config(family.make(), attn_implementation="eager", dtype=torch.float32,
                                                     **family.load).eval()
            with torch.no_grad():
                family.init(stock)
            cascade = AutoModelForCausalLM.from_config(family.make(), attn_implementation="cascade",
                                                       dtype=torch.float32, **family.load).eval()
        cascade.load_state_dict(stock.state_dict())
        ids, mask = (t.cuda() for t in tf.padded_batch(seed=3, lengths=tf.PROMPTS))
        assert torch.equal(tf.run(stock, mode, ids, mask), tf.run(cascade, mode, ids, mask))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
