"""``CascadeConfig(fuse_norms=True)`` (hf_cascade/fused_norms.py): each Llama-style RMSNorm as one kernel.

CPU: the kernel's documented semantics are the eager forward bit for bit; exactly the norms whose class's forward is
Llama's get the kernel's forward (Qwen3's q/k norms too; Gemma's and OLMo2's differ and are left alone), state_dict
unchanged, uninstalled by a call without it; inside a cascade generate call (and only there) every norm of every
forward goes to the kernel (a CPU stand-in here: the library's kernel declines CPU tensors), stock's tokens in
float64; a compiled forward traces the module's own forward. GPU (tests/test_gpu_fused_norms.py): the kernel against
the reference, and tokens with it in a captured step.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hf_cascade import CascadeConfig, fused_linears, fused_norms
from hf_cascade.config import ConfigTypeError

from conftest import padded_batch
from test_families import FAMILIES

EAGER = CascadeConfig(cuda_graphs="eager", fuse_norms=True)
# installed norms of the tiny 2-layer families: 2 per layer and the final one; Qwen3 adds q_norm and k_norm per layer
NORMS = {"Llama": 5, "Mistral": 5, "Qwen2": 5, "Qwen3": 9, "Phi3": 5, "Granite": 5, "Gemma": 0, "OLMo2": 0, "OPT": 0}


def _model(name, attn="cascade", dtype=torch.float64):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(FAMILIES[name].make(), attn_implementation=attn, dtype=dtype).eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_reference_is_the_eager_forward_bit_for_bit(dtype):
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=torch.Generator().manual_seed(1)))
    x = (torch.randn(7, 3, 96, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    with torch.no_grad():
        assert torch.equal(norm(x), fused_norms.rms_norm_reference(x, norm.weight, norm.variance_epsilon))


@pytest.mark.parametrize("name", list(NORMS))
def test_install_takes_exactly_the_llama_norms(name):
    model = _model(name)
    state = model.state_dict(keep_vars=True)
    assert fused_norms.install(model) == NORMS[name]
    assert fused_norms.install(model) == 0                       # (idempotent)
    chosen = [m for m in model.modules() if fused_norms.installed(m)]
    assert all(type(m).__name__.endswith("RMSNorm") for m in chosen)
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(state) and all(after[k] is state[k] for k in state)
    assert fused_norms.uninstall(model) == NORMS[name]
    assert not any(fused_norms.installed(m) or "forward" in m.__dict__ for m in model.modules())


class StandIn:
    """The kernel's place on the CPU: counts its calls and computes the reference (what the kernel computes)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x, weight, eps):
        self.calls += 1
        return fused_norms.rms_norm_reference(x, weight, eps)


@pytest.mark.parametrize("name", ["Llama", "Qwen3"])
@pytest.mark.parametrize("mode", ["greedy", "beam"])
def test_generate_runs_every_norm_on_the_kernel_with_stock_tokens(name, mode, monkeypatch):
    stock, cascade = _model(name, "sdpa"), _model(name)
    kernel = StandIn()
    monkeypatch.setattr(fused_norms, "_kernel", kernel)
    ids, mask = padded_batch(seed=3)
    new = 10
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
              **(dict(num_beams=3) if mode == "beam" else {}))
    expected = stock.generate(**kw)
    assert torch.equal(cascade.generate(**kw, hf_cascade_config=EAGER), expected)
    # every norm of every forward (the prefill, then the decode steps)
    assert kernel.calls % NORMS[name] == 0 and kernel.calls >= NORMS[name] * new, kernel.calls
    before = kernel.calls
    with torch.no_grad():
        cascade(input_ids=ids, attention_mask=mask)                  # a forward outside generate: the module's own
    assert kernel.calls == before
    # a call without it takes the forwards back (and gives the same tokens)
    assert torch.equal(cascade.generate(**kw, hf_cascade_config=CascadeConfig(cuda_graphs="eager")), expected)
    assert kernel.calls == before and not any(fused_norms.installed(m) for m in cascade.modules())


def test_a_norm_that_wants_gradients_runs_its_own_forward(monkeypatch):
    kernel = StandIn()
    monkeypatch.setattr(fused_norms, "_kernel", kernel)
    norm = LlamaRMSNorm(32)
    norm.forward = fused_norms._NormForward(norm)
    x = torch.randn(2, 32, requires_grad=True)
    with fused_linears.serving():
        norm(x).sum().backward()
        with torch.no_grad():
            norm(x)
    assert kernel.calls == 1 and x.grad is not None


def test_a_compiled_forward_traces_the_modules_own_forward(monkeypatch):
    kernel = StandIn()
    monkeypatch.setattr(fused_norms, "_kernel", kernel)
    norm = LlamaRMSNorm(32)
    norm.forward = fused_norms._NormForward(norm)
    x = torch.randn(2, 32)
    compiled = torch.compile(lambda t: norm(t) * 2, fullgraph=True, backend="eager")
    with fused_linears.serving(), torch.no_grad():
        assert torch.equal(compiled(x), LlamaRMSNorm.forward(norm, x) * 2)
    assert kernel.calls == 0


def test_fuse_norms_must_be_a_bool():
    with pytest.raises(ConfigTypeError, match="fuse_norms must be a bool"):
        CascadeConfig(fuse_norms="yes")
