"""GPU: ``csrc/elementwise.cu`` against :func:`hf_cascade.fused_ops.rms_norm_reference`,
:func:`~hf_cascade.fused_ops.rotary_reference` and :func:`~hf_cascade.fused_ops.silu_mul_reference` (the eager ops),
the residual add with the norm (``hfc_add_rms_norm``) against eager's add and the norm kernel, and a bf16 model's
tokens with ``CascadeConfig(fuse_elementwise=True)`` (and ``fused_ops.act_kernel``, ``fused_ops.add_norm_kernel`` on)
in a captured whole step. CPU side: tests/decode/test_fused_ops.py, tests/kernels/test_silu_ptx.py."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_cascade import CascadeConfig, fused_ops
from hf_cascade.kernels import cuda_library

from conftest import RunnerSpy

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def lib():
    return cuda_library.library(torch.device("cuda"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# (a warp a row up to 1024 wide: 64, Qwen3's 128-wide q/k norms, 1000 rows past a CTA's last; a CTA a row up to
# 8192; 100 and 16384: element by element)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (256, 128), (1001, 1024), (8, 4096), (33, 5120), (64, 2048),
                                         (2, 8192), (3, 100), (2, 16384)])
def test_norm_kernel_equals_the_eager_norm_but_for_the_sum_order(lib, dtype, rows, hidden):
    g = torch.Generator("cuda").manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, device="cuda", generator=g) * 4).to(dtype)
    weight = torch.randn(hidden, device="cuda", generator=g).to(dtype)
    got = cuda_library.rms_norm(x, weight, 1e-5)
    assert got is not None and got.shape == x.shape and got.dtype == dtype
    want = fused_ops.rms_norm_reference(x, weight, 1e-5)
    # the normalised value before the cast may differ in its last float32 bits: at most a step of the element type
    # after the cast and the weight's product, and almost everywhere none
    step = torch.finfo(dtype).eps * want.abs().float().clamp_min(torch.finfo(dtype).tiny) * 2
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() >= 0.99


def test_norm_kernel_takes_rows_that_are_not_16_byte_aligned(lib):
    g = torch.Generator("cuda").manual_seed(3)
    base = torch.randn(5, 4096 + 8, device="cuda", generator=g).to(torch.bfloat16)
    weight = torch.randn(4096 + 8, device="cuda", generator=g).to(torch.bfloat16)
    for offset in (1, 2, 8):            # (an element's offset: 2 or 4 bytes; 8 elements: aligned again)
        x, w = base[:, offset:offset + 4096], weight[offset:offset + 4096]
        want = fused_ops.rms_norm_reference(x, w, 1e-6)
        assert (cuda_library.rms_norm(x, w, 1e-6) == want).float().mean() >= 0.99, offset


def test_norm_kernel_takes_strided_rows_and_declines_what_it_does_not_run(lib):
    wide = torch.randn(8, 3 * 256, device="cuda", dtype=torch.bfloat16)
    rows = wide[:, 256:512]                               # (a column slice: rows 768 elements apart)
    weight = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    want = fused_ops.rms_norm_reference(rows, weight, 1e-6)
    assert (cuda_library.rms_norm(rows, weight, 1e-6) == want).float().mean() >= 0.99
    assert cuda_library.rms_norm(rows.float(), weight.float(), 1e-6) is None      # float32: the original
    assert cuda_library.rms_norm(rows, weight.float(), 1e-6) is None              # weight in another dtype
    assert cuda_library.rms_norm(wide.t(), torch.ones(8, device="cuda", dtype=torch.bfloat16), 1e-6) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,q_heads,k_heads,tokens,dim", [(8, 32, 8, 1, 128), (2, 4, 2, 37, 64), (1, 16, 16, 5, 256)])
def test_rotary_kernel_is_the_eager_rotary_bit_for_bit(lib, dtype, batch, q_heads, k_heads, tokens, dim):
    g = torch.Generator("cuda").manual_seed(batch * tokens + dim)
    # q and k as a fused q|k|v product gives them: [B, L, (Hq + 2 Hk) D], viewed per head and transposed
    fused = torch.randn(batch, tokens, (q_heads + 2 * k_heads) * dim, device="cuda", generator=g).to(dtype) * 3
    q = fused[..., :q_heads * dim].view(batch, tokens, q_heads, dim).transpose(1, 2)
    k = fused[..., q_heads * dim:(q_heads + k_heads) * dim].view(batch, tokens, k_heads, dim).transpose(1, 2)
    angles = torch.rand(batch, tokens, dim, device="cuda", generator=g) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = cuda_library.rotary(q, k, cos, sin)
    assert got is not None
    for a, b in zip(got, fused_ops.rotary_reference(q, k, cos, sin)):
        assert torch.equal(a, b)
    one = cuda_library.rotary(q, k, cos[:1], sin[:1])     # cos/sin of one row for every batch row (broadcast)
    for a, b in zip(one, fused_ops.rotary_reference(q, k, cos[:1].expand_as(cos), sin[:1].expand_as(sin))):
        assert torch.equal(a, b)


def _llama():
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="cascade",
                                            dtype=torch.bfloat16).cuda().eval()


@pytest.mark.parametrize("kw", [dict(), dict(num_beams=4)], ids=["greedy", "beam"])
def test_bf16_captured_step_with_the_kernels_follows_the_unfused_tokens(lib, kw, monkeypatch):
    model = _llama()
    ids = torch.randint(3, 512, (2, 300), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    calls = []
    for name in ("_norm_kernel", "_rotary_kernel"):
        real = getattr(fused_ops, name)
        monkeypatch.setattr(fused_ops, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    kw = dict(input_ids=ids, max_new_tokens=24, min_new_tokens=24, pad_token_id=0, **kw)
    plain = model.generate(**kw, hf_cascade_config=CascadeConfig(cuda_graphs=True, fuse_elementwise=False))
    assert not calls
    spy = RunnerSpy(monkeypatch)
    fused = model.generate(**kw, hf_cascade_config=CascadeConfig(cuda_graphs=True))     # the default takes them
    runner, = spy.runners
    assert runner.disabled is None and runner.captures >= 1 and runner.replays >= 15
    # (a forward: 9 norms, 4 rotary embeddings; the captured step's calls happen when it is captured)
    assert calls.count("_norm_kernel") >= 9 * 2 and calls.count("_rotary_kernel") >= 4 * 2
    # the norm sums its squares in another order than eager's (its last float32 bits): a bf16 tie late in a call may
    # break otherwise (the kernel of 6f0731c gave these very tokens, the vectorised one parts at one of 48 greedy)
    new = ids.shape[1]
    assert torch.equal(plain[:, :new + 12], fused[:, :new + 12])
    agree = (plain[:, new:] == fused[:, new:]).float().mean().item()
    assert agree >= 0.9, f"new tokens agree {agree:.3f}"


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Elementwise: the same bits, or both NaN (a NaN's payload is not eager's promise)."""
    return (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())


# the values where fast math would part from eager mode: silu's tails (exp over- and underflowing, a result below
# float32's normal range), signed zeros, infinities, NaN, tiny products
_EDGES = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), -88.0, -90.0, -100.0, -104.0, 88.0, 100.0, 1e-3,
          -1e-3, 3e-39, -3e-39, 1e-20, 65000.0, -65000.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# (14336: Llama-3-8B's intermediate size; 11008, 8 and 512: the 16-byte kernel; 100, 1001 and 13: element by element)
@pytest.mark.parametrize("width", [14336, 11008, 512, 8, 1001, 100, 13])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_silu_mul_kernel_is_the_eager_activation_bit_for_bit(lib, dtype, rows, width):
    g = torch.Generator("cuda").manual_seed(rows * 100003 + width)
    # gate and up as the fused gate|up product gives them: the column halves of [rows, 2 width]
    fused = (torch.randn(rows, 2 * width, device="cuda", generator=g) * 6).to(dtype)
    edges = torch.tensor(_EDGES, device="cuda").to(dtype)[:width]
    fused[0, :len(edges)] = edges
    fused[-1, width:width + len(edges)] = edges.flip(0)
    gate, up = fused[:, :width], fused[:, width:]
    got = cuda_library.silu_mul(gate, up)
    assert got is not None and got.shape == gate.shape and got.dtype == dtype and got.is_contiguous()
    want = fused_ops.silu_mul_reference(gate, up)
    assert _same_bits(got, want).all(), (got[~_same_bits(got, want)][:8], want[~_same_bits(got, want)][:8])
    # the whole float range of the element type through silu: every bf16/fp16 bit pattern as a gate value
    every = torch.arange(-2 ** 15, 2 ** 15, device="cuda", dtype=torch.int32).to(torch.int16).view(dtype)
    ones = torch.ones_like(every)
    assert _same_bits(cuda_library.silu_mul(every, ones), fused_ops.silu_mul_reference(every, ones)).all()
    assert _same_bits(cuda_library.silu_mul(every[:-3], every.flip(0)[3:]),
                      fused_ops.silu_mul_reference(every[:-3], every.flip(0)[3:])).all()


def test_silu_mul_kernel_takes_batched_offset_views_and_declines_what_it_does_not_run(lib):
    g = torch.Generator("cuda").manual_seed(5)
    fused = (torch.randn(3, 5, 2 * 4096 + 24, device="cuda", generator=g) * 4).to(torch.bfloat16)
    for offset in (0, 1, 3, 8):          # (1, 3: rows not on 16 bytes, element by element; 8: aligned again)
        gate, up = fused[..., offset:offset + 4096], fused[..., 4096 + 2 * offset:8192 + 2 * offset]
        got = cuda_library.silu_mul(gate, up)
        assert got.shape == (3, 5, 4096) and torch.equal(got, fused_ops.silu_mul_reference(gate, up)), offset
    gate, up = fused[..., :4096], fused[..., 4096:8192]
    assert torch.equal(cuda_library.silu_mul(gate.transpose(0, 1), up.transpose(0, 1)),
                       fused_ops.silu_mul_reference(gate.transpose(0, 1), up.transpose(0, 1)))
    assert cuda_library.silu_mul(gate.float(), up.float()) is None                # float32: the torch ops
    assert cuda_library.silu_mul(gate, up.half()) is None                          # two dtypes
    assert cuda_library.silu_mul(gate.transpose(1, 2), up.transpose(1, 2)) is None  # last dim strided
    assert cuda_library.silu_mul(gate.cpu(), up.cpu()) is None
    assert cuda_library.silu_mul(gate[:0], up[:0]).shape == (0, 5, 4096)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 4096), (8, 4096), (64, 2048), (1001, 1024), (3, 8192), (5, 64)])
def test_add_norm_kernel_is_the_eager_add_then_the_norm_kernel(lib, dtype, rows, hidden):
    """hfc_add_rms_norm: the sum is eager's ``residual + x`` bit for bit, and the normalised rows are the norm kernel's
    of that sum bit for bit (the same kernel, the same sum order); x may be a strided view (a product's rows)."""
    g = torch.Generator("cuda").manual_seed(rows + hidden)
    residual = (torch.randn(rows, hidden, device="cuda", generator=g) * 3).to(dtype)
    x = (torch.randn(rows, 2 * hidden, device="cuda", generator=g) * 3).to(dtype)[:, hidden:]   # (strided rows)
    weight = torch.randn(hidden, device="cuda", generator=g).to(dtype)
    got = cuda_library.add_rms_norm(x, residual, weight, 1e-5)
    assert got is not None
    total, normed = got
    assert torch.equal(total, residual + x)
    assert torch.equal(normed, cuda_library.rms_norm(residual + x, weight, 1e-5))


def test_add_norm_kernel_declines_what_it_does_not_run(lib):
    g = torch.Generator("cuda").manual_seed(3)
    x = torch.randn(4, 4096, device="cuda", generator=g).bfloat16()
    weight = torch.randn(4096, device="cuda", generator=g).bfloat16()
    assert cuda_library.add_rms_norm(x, x.clone(), weight, 1e-5) is not None
    assert cuda_library.add_rms_norm(x.float(), x.float(), weight.float(), 1e-5) is None       # float32
    assert cuda_library.add_rms_norm(x, x[:2], weight, 1e-5) is None                           # two shapes
    assert cuda_library.add_rms_norm(x[:, 1:], x[:, 1:].clone(), weight[1:], 1e-5) is None     # not aligned
    wide = torch.randn(2, 16384, device="cuda", generator=g).bfloat16()
    assert cuda_library.add_rms_norm(wide, wide.clone(), wide[0].clone(), 1e-5) is None        # past 8192


# the kernels that give eager's bits where they replace eager ops: (their switch, their place in fused_ops)
BITWISE_KERNELS = {"silu_mul": ("act_kernel", "_act_kernel"), "add_norm": ("add_norm_kernel", "_add_norm_kernel")}


@pytest.mark.parametrize("kernel", list(BITWISE_KERNELS))
@pytest.mark.parametrize("kw", [dict(), dict(num_beams=4)], ids=["greedy", "beam"])
def test_bf16_captured_step_with_the_kernel_gives_the_same_tokens(lib, kw, kernel, monkeypatch):
    """The activation kernel is eager's bit for bit, the add-and-norm kernel eager's add and the norm kernel's norm:
    a captured step with one (its switch on) gives the very tokens of one without (the norm and rotary kernels on in
    both), and the call that turns it on drops the graphs kept without it."""
    switch, place = BITWISE_KERNELS[kernel]
    model = _llama()
    ids = torch.randint(3, 512, (2, 300), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    calls = []
    real = getattr(fused_ops, place)
    monkeypatch.setattr(fused_ops, place, lambda *args: calls.append(1) or real(*args))
    kw = dict(input_ids=ids, max_new_tokens=24, min_new_tokens=24, pad_token_id=0, **kw)
    monkeypatch.setattr(fused_ops, switch, False)
    spy = RunnerSpy(monkeypatch)
    plain = model.generate(**kw, hf_cascade_config=CascadeConfig(cuda_graphs=True))
    assert not calls
    monkeypatch.setattr(fused_ops, switch, True)
    fused = model.generate(**kw, hf_cascade_config=CascadeConfig(cuda_graphs=True))
    first, runner = spy.runners          # (a new runner: the graphs kept without the kernel were dropped)
    assert runner is not first
    assert runner.disabled is None and runner.captures >= 1 and runner.replays >= 15
    # (a forward: 4 MLPs, 4 decoder layers; the captured step's calls happen when it is captured)
    assert len(calls) >= 4 * 2
    assert torch.equal(plain, fused)
