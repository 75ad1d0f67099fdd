"""``CascadeConfig(fuse_elementwise=True)``, the default (hf_cascade/decode/fused_ops.py): Llama-style RMSNorms and rotary
embeddings as one kernel each.

CPU: the kernels' documented semantics are the eager ops bit for bit; exactly the norm classes and modeling modules
that are Llama's, source for source, are wrapped (Gemma's and OLMo2's norms, Phi-3's rotary are left alone), the
model's state_dict unchanged; inside a generate call that asks (and only there) every norm and every rotary
embedding of every forward goes to the kernels (CPU stand-ins here: the library's kernels decline CPU tensors), stock's
tokens in float64, and a call that does not ask, a forward outside generate, a forward that wants gradients and a
compiled forward run the originals. The MLP activation kernel (``fused_ops.act_kernel``, on by default; tests set it)
likewise for exactly the MLPs with Llama's forward and a SiLU, and with the flag off no MLP is wrapped. GPU
(tests/decode/test_gpu_fused_ops.py): the kernels against the references, and tokens with them in a captured step.
"""
from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hf_cascade import CascadeConfig, compat, fused_ops
from hf_cascade.config import ConfigTypeError
from hf_cascade.kernels import cuda_library

from conftest import padded_batch
from test_families import FAMILIES

EAGER = CascadeConfig(cuda_graphs="eager", fuse_elementwise=True)
# per forward of the tiny 2-layer families: (norms: 2 a layer and the final one, Qwen3's q/k norms 2 more a layer;
# rotary embeddings: 1 a layer; OLMo2's rotary casts, Phi-3's is partial)
PER_FORWARD = {"Llama": (5, 2), "Mistral": (5, 2), "Qwen2": (5, 2), "Qwen3": (9, 2), "Granite": (5, 2),
               "Phi3": (5, 0), "Gemma": (0, 2), "OLMo2": (0, 0), "OPT": (0, 0)}
# MLP activations per forward (1 a layer) where the MLP is Llama's with a SiLU: Phi-3's fused gate_up_proj, Gemma's
# gelu and OPT's fc1/fc2 are not
MLPS_PER_FORWARD = {"Llama": 2, "Mistral": 2, "Qwen2": 2, "Qwen3": 2, "Granite": 2, "Phi3": 0, "Gemma": 0,
                    "OLMo2": 2, "OPT": 0}


def _model(name, attn="cascade", dtype=torch.float64):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(FAMILIES[name].make(), attn_implementation=attn, dtype=dtype).eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_references_are_the_eager_ops_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(2)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
    x = (torch.randn(7, 3, 96, generator=g) * 3).to(dtype)
    q, k = (torch.randn(2, h, 5, 32, generator=g).to(dtype) for h in (4, 2))
    cos, sin = (torch.randn(2, 5, 32, generator=g).to(dtype) for _ in range(2))
    with torch.no_grad():
        assert torch.equal(fused_ops._original_forward(LlamaRMSNorm)(norm, x),
                           fused_ops.rms_norm_reference(x, norm.weight, norm.variance_epsilon))
        original = fused_ops._wrapped.get(modeling_llama, modeling_llama.apply_rotary_pos_emb)
        for got, want in zip(fused_ops.rotary_reference(q, k, cos, sin), original(q, k, cos, sin)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_the_activation_reference_is_the_eager_mlp_s_rounding_for_rounding(dtype):
    """silu_mul_reference is LlamaMLP's act_fn(gate) * up, and in 16 bits the kernel's documented roundings: silu in
    float32 rounded to the element type, then the product of the two rounded again."""
    g = torch.Generator().manual_seed(7)
    gate, up = ((torch.randn(5, 3, 200, generator=g) * 6).to(dtype) for _ in range(2))
    act_fn = modeling_llama.ACT2FN["silu"]
    got = fused_ops.silu_mul_reference(gate, up)
    assert torch.equal(got, act_fn(gate) * up)
    if dtype in (torch.bfloat16, torch.float16):
        rounded = (torch.nn.functional.silu(gate.float()).to(dtype).float() * up.float()).to(dtype)
        assert torch.equal(got, rounded)
        # (the rounding between silu and the product is there: without it some values differ)
        assert not torch.equal(got, (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype))


class StandIns:
    """The kernels' places on the CPU: count their calls and compute the references (what the kernels compute)."""

    def __init__(self, monkeypatch, decline_add_norm=False):
        self.norms = self.rotary = self.acts = self.add_norms = 0
        self.decline_add_norm = decline_add_norm
        monkeypatch.setattr(fused_ops, "_norm_kernel", self.norm)
        monkeypatch.setattr(fused_ops, "_rotary_kernel", self.rope)
        monkeypatch.setattr(fused_ops, "_act_kernel", self.act)
        monkeypatch.setattr(fused_ops, "_add_norm_kernel", self.add_norm)

    def add_norm(self, x, residual, weight, eps):
        self.add_norms += 1
        if self.decline_add_norm:
            return None
        total = residual + x
        return total, fused_ops.rms_norm_reference(total, weight, eps)

    def act(self, gate, up):
        self.acts += 1
        return fused_ops.silu_mul_reference(gate, up)

    def norm(self, x, weight, eps):
        self.norms += 1
        return fused_ops.rms_norm_reference(x, weight, eps)

    def rope(self, q, k, cos, sin):
        self.rotary += 1
        return fused_ops.rotary_reference(q, k, cos, sin)


@pytest.mark.parametrize("name", list(PER_FORWARD))
def test_exactly_the_llama_norms_and_rotary_take_the_kernels(name, monkeypatch):
    kernels = StandIns(monkeypatch)
    stock, cascade = _model(name, "sdpa"), _model(name)
    state = cascade.state_dict(keep_vars=True)
    ids, mask = padded_batch(seed=3)
    new = 6
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    expected = stock.generate(**kw)
    assert torch.equal(cascade.generate(**kw, hf_cascade_config=EAGER), expected)
    norms, rotary = PER_FORWARD[name]
    # every one of every forward (the prefill, then the decode steps); a layer's post-attention norm runs in the add +
    # norm kernel where fused_ops.add_norm_kernel is on (the default)
    taken = kernels.norms + kernels.add_norms
    forwards = max(taken // max(norms, 1), kernels.rotary // max(rotary, 1))
    assert (taken, kernels.rotary) == (norms * forwards, rotary * forwards)
    assert forwards >= new or norms == rotary == 0
    after = cascade.state_dict(keep_vars=True)
    assert list(after) == list(state) and all(after[k] is state[k] for k in state)


@pytest.mark.parametrize("mode", ["greedy", "beam"])
def test_only_the_calls_that_ask_take_the_kernels(mode, monkeypatch):
    kernels = StandIns(monkeypatch)
    stock, cascade = _model("Qwen3", "sdpa"), _model("Qwen3")
    ids, mask = padded_batch(seed=4)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0,
              **(dict(num_beams=3) if mode == "beam" else {}))
    expected = stock.generate(**kw)
    assert torch.equal(cascade.generate(**kw, hf_cascade_config=EAGER), expected)
    assert kernels.norms and kernels.rotary
    seen = kernels.norms, kernels.rotary
    with torch.no_grad():
        cascade(input_ids=ids, attention_mask=mask)                  # a forward outside generate
        stock(input_ids=ids, attention_mask=mask)                    # another model (the classes are wrapped)
    off = CascadeConfig(cuda_graphs="eager", fuse_elementwise=False)
    assert torch.equal(cascade.generate(**kw, hf_cascade_config=off), expected)
    assert torch.equal(stock.generate(**kw), expected)
    assert (kernels.norms, kernels.rotary) == seen


@pytest.mark.parametrize("kind", ["norm", "mlp"])
def test_a_forward_that_wants_gradients_or_is_compiled_runs_the_originals(kind, monkeypatch):
    """A wrapped norm or MLP takes its kernel in the call's own forwards only: not where gradients are wanted, not in a
    compiled forward, not after the call."""
    monkeypatch.setattr(fused_ops, "act_kernel", True)
    kernels = StandIns(monkeypatch)
    model = _model("Llama", dtype=torch.float32)
    module = model.model.norm if kind == "norm" else model.model.layers[0].mlp
    original = fused_ops._original_forward(type(module))

    def kernel_calls():
        return kernels.norms if kind == "norm" else kernels.acts

    fused_ops.configure(model, True)             # (as a generate call that asks: the flag is this thread's)
    try:
        assert fused_ops.takes_kernels(module) and fused_ops.takes_kernels(model.model.layers[0].self_attn)
        x = torch.randn(2, 3, 64, requires_grad=True)
        module(x).sum().backward()                                    # gradients wanted: the original
        assert kernel_calls() == 0 and x.grad is not None
        with torch.no_grad():
            compiled = torch.compile(lambda t: module(t) * 2, fullgraph=True, backend="eager")
            assert torch.equal(compiled(x), original(module, x) * 2)
            assert kernel_calls() == 0
            assert torch.equal(module(x), original(module, x))        # the call's own forward: the kernel
            assert kernel_calls() == 1
    finally:
        fused_ops.call_ended()
    with torch.no_grad():
        module(x)
    assert kernel_calls() == 1


def test_the_default_call_takes_the_kernels(monkeypatch):
    kernels = StandIns(monkeypatch)
    stock, cascade = _model("Llama", "sdpa"), _model("Llama")
    ids, mask = padded_batch(seed=5)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    assert CascadeConfig().fuse_elementwise
    assert torch.equal(cascade.generate(**kw), stock.generate(**kw))
    assert kernels.norms and kernels.rotary


@pytest.mark.parametrize("library", [None, "loaded"])
def test_a_cuda_call_decides_on_the_kernels_before_its_first_forward(library, monkeypatch):
    """On a CUDA model the call takes the kernels only where the library is there before its first forward (loaded,
    or the prebuilt one): one the attention backend loaded during the prefill would put the first norms of a
    process's first call on the original and the rest on the kernel (a captured step then differed from the eager
    one). Here the model is on the CPU and says it is on CUDA."""
    kernels = StandIns(monkeypatch)
    asked = []
    monkeypatch.setattr(fused_ops, "_device_of", lambda model: torch.device("cuda", 0))
    monkeypatch.setattr(cuda_library, "prebuilt_or_loaded", lambda device: asked.append(device) or library)
    stock, cascade = _model("Llama", "sdpa"), _model("Llama")
    ids, mask = padded_batch(seed=6)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0)
    assert torch.equal(cascade.generate(**kw, hf_cascade_config=EAGER), stock.generate(**kw))
    assert asked == [torch.device("cuda", 0)]
    assert (kernels.norms > 0) == (library is not None) and (kernels.rotary > 0) == (library is not None)


def _rotary_of_another_kind(q, k, cos, sin, unsqueeze_dim=2):     # Llama's, but for [batch, length, heads, dim]
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (modeling_llama.rotate_half(q) * sin), (k * cos) + (modeling_llama.rotate_half(k) * sin)


def test_the_rotary_is_llama_s_by_the_source_of_the_function_it_runs(monkeypatch):
    """From transformers 5.25 ``apply_rotary_pos_emb`` is kernels' ``nn.Module`` around the function
    (``use_kernel_forward_from_hub``): the function inside is compared, source for source. A module whose rotary runs
    another function, plain or inside kernels' module, is left alone; so is an object that only looks like one."""
    llama = fused_ops._wrapped.get(modeling_llama, modeling_llama.apply_rotary_pos_emb)
    function = compat.hub_function(llama)
    assert inspect.isfunction(function) and function.__module__ == modeling_llama.__name__
    assert (function is llama) == inspect.isfunction(llama)      # (5.17-5.24: the function itself)
    impostor = type("Func", (torch.nn.Module,), {"kernel_layer_name": "rotary_pos_emb", "forward": llama})
    assert compat.hub_function(impostor()) is None and compat.hub_function(len) is None

    def module_with(rotary):
        name = f"fake_modeling_{len(fused_ops._checked)}"
        fake = types.ModuleType(name)
        fake.apply_rotary_pos_emb, fake.rotate_half = rotary, modeling_llama.rotate_half
        monkeypatch.setitem(sys.modules, name, fake)
        return type("FakeAttention", (torch.nn.Module,), {"__module__": name})()

    kinds = [(function, True), (_rotary_of_another_kind, False)]
    if not inspect.isfunction(llama):                           # kernels' module around each
        kinds += [(type(llama)(), True), (_hub_module(_rotary_of_another_kind), False)]
    for rotary, llama_s in kinds:
        assert (fused_ops._rotary_module(module_with(rotary)) is not None) == llama_s, rotary


def _hub_module(function):
    from kernels import use_kernel_forward_from_hub
    return use_kernel_forward_from_hub("rotary_pos_emb")(function)


def test_fuse_elementwise_must_be_a_bool():
    with pytest.raises(ConfigTypeError, match="fuse_elementwise must be a bool"):
        CascadeConfig(fuse_elementwise="yes")


# ---- the MLP activation kernel (fused_ops.act_kernel) ----------------------------------------------------------
def _fresh_llama_mlp_class():
    """A class of its own whose forward is LlamaMLP's source for source (never wrapped before this test)."""
    class CopiedMLP(modeling_llama.LlamaMLP):
        def forward(self, x):
            down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
            return down_proj
    return CopiedMLP


@pytest.mark.parametrize("name", list(MLPS_PER_FORWARD))
def test_exactly_the_llama_silu_mlps_take_the_activation_kernel(name, monkeypatch):
    monkeypatch.setattr(fused_ops, "act_kernel", True)
    kernels = StandIns(monkeypatch)
    stock, cascade = _model(name, "sdpa"), _model(name)
    mlps = [m for m in cascade.modules() if type(m).__name__.endswith("MLP")]
    originals = {type(m): type(m).forward for m in mlps}
    ids, mask = padded_batch(seed=8)
    new = 6
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    expected = stock.generate(**kw)
    forwards = []
    cascade.get_decoder().register_forward_pre_hook(lambda module, args: forwards.append(1))
    assert torch.equal(cascade.generate(**kw, hf_cascade_config=EAGER), expected)
    per_forward = MLPS_PER_FORWARD[name]
    # every MLP of every forward (the prefill, then the decode steps)
    assert len(forwards) >= new and kernels.acts == per_forward * len(forwards)
    assert all(fused_ops.takes_kernels(m) == bool(per_forward) for m in mlps)
    if not per_forward:                         # left alone: the class's own forward
        assert all(type(m).forward is originals[type(m)] for m in mlps)
    seen = kernels.acts
    with torch.no_grad():
        cascade(input_ids=ids, attention_mask=mask)                  # a forward outside generate
    off = CascadeConfig(cuda_graphs="eager", fuse_elementwise=False)
    assert torch.equal(cascade.generate(**kw, hf_cascade_config=off), expected)
    assert kernels.acts == seen


def test_with_the_flag_off_no_mlp_is_wrapped(monkeypatch):
    monkeypatch.setattr(fused_ops, "act_kernel", False)
    kernels = StandIns(monkeypatch)
    stock, cascade = _model("Llama", "sdpa"), _model("Llama")
    copied = _fresh_llama_mlp_class()
    own_forward = copied.forward
    for layer in cascade.model.layers:
        layer.mlp.__class__ = copied
    ids, mask = padded_batch(seed=9)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0)
    expected = stock.generate(**kw)
    assert torch.equal(cascade.generate(**kw, hf_cascade_config=EAGER), expected)
    assert kernels.norms and kernels.acts == 0
    assert copied.forward is own_forward and copied not in fused_ops._wrapped
    assert not fused_ops.takes_kernels(cascade.model.layers[0].mlp)
    # the same class is taken once the flag is on (the check above could fail), and the call's choice changed
    monkeypatch.setattr(fused_ops, "act_kernel", True)
    assert fused_ops.configure(cascade, True)
    fused_ops.call_ended()
    assert torch.equal(cascade.generate(**kw, hf_cascade_config=EAGER), expected)
    assert copied.forward is not own_forward and kernels.acts > 0
    assert fused_ops.takes_kernels(cascade.model.layers[0].mlp)


def test_an_mlp_of_another_forward_or_activation_is_left_alone(monkeypatch):
    monkeypatch.setattr(fused_ops, "act_kernel", True)
    kernels = StandIns(monkeypatch)
    model = _model("Llama", dtype=torch.float32)

    class ScaledMLP(modeling_llama.LlamaMLP):       # Llama's forward but for one factor
        def forward(self, x):
            down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 2)
            return down_proj

    first, second = model.model.layers[0].mlp, model.model.layers[1].mlp
    first.__class__ = ScaledMLP
    second.__class__ = _fresh_llama_mlp_class()
    second.act_fn = torch.nn.GELU()                 # Llama's forward, another activation
    fused_ops.configure(model, True)
    try:
        assert not fused_ops.takes_kernels(first) and not fused_ops.takes_kernels(second)
        assert ScaledMLP not in fused_ops._wrapped
        with torch.no_grad():
            x = torch.randn(2, 3, 64)
            first(x), second(x)
        assert kernels.acts == 0
        second.act_fn = modeling_llama.ACT2FN["silu"]
        fused_ops.configure(model, True)
        assert fused_ops.takes_kernels(second)
        with torch.no_grad():
            second(x)
        assert kernels.acts == 1
    finally:
        fused_ops.call_ended()


def test_where_the_kernel_declines_the_mlp_computes_each_product_once(monkeypatch):
    """The kernel returns None (float32, a CPU tensor, a library without it): the original's ops on the products
    already computed, the original's result bit for bit, gate_proj and up_proj run once each."""
    monkeypatch.setattr(fused_ops, "act_kernel", True)
    declined = []
    monkeypatch.setattr(fused_ops, "_act_kernel", lambda gate, up: declined.append(gate.shape) and None)
    model = _model("Llama", dtype=torch.float32)
    mlp = model.model.layers[1].mlp
    products = []
    for proj in (mlp.gate_proj, mlp.up_proj):
        proj.register_forward_hook(lambda module, args, out: products.append(module))
    fused_ops.configure(model, True)
    try:
        with torch.no_grad():
            x = torch.randn(3, 2, 64)
            got = mlp(x)
            assert len(declined) == 1 and products == [mlp.gate_proj, mlp.up_proj]
            assert torch.equal(got, fused_ops._original_forward(type(mlp))(mlp, x))
    finally:
        fused_ops.call_ended()


# decoder layers per forward whose forward is Llama's (source for source) with Llama's post-attention norm: Granite's
# scales its residuals, Phi-3's, Gemma's, OLMo2's and OPT's layers differ
LAYERS_PER_FORWARD = {"Llama": 2, "Mistral": 2, "Qwen2": 2, "Qwen3": 2, "Granite": 0, "Phi3": 0, "Gemma": 0,
                      "OLMo2": 0, "OPT": 0}


@pytest.mark.parametrize("decline", [False, True], ids=["kernel", "declined"])
@pytest.mark.parametrize("name", list(LAYERS_PER_FORWARD))
def test_exactly_the_llama_decoder_layers_take_the_add_and_norm_kernel(name, decline, monkeypatch):
    """fused_ops.add_norm_kernel on: the decoder layers whose forward is Llama's run it with the residual add and the
    post-attention norm as one kernel (a CPU stand-in computing their references; or declining, where the layer runs
    the two original ops), every layer of every forward of the call, stock's tokens in float64; the norm kernel then
    serves the other norms only. Other layers keep their class's forward; a forward outside generate and a call
    without the kernels run the original."""
    monkeypatch.setattr(fused_ops, "add_norm_kernel", True)
    kernels = StandIns(monkeypatch, decline_add_norm=decline)
    stock, cascade = _model(name, "sdpa"), _model(name)
    layers = [m for m in cascade.modules() if type(m).__name__.endswith("DecoderLayer")]
    originals = {type(m): type(m).forward for m in layers}
    ids, mask = padded_batch(seed=10)
    new = 6
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    expected = stock.generate(**kw)
    forwards = []
    cascade.get_decoder().register_forward_pre_hook(lambda module, args: forwards.append(1))
    assert torch.equal(cascade.generate(**kw, hf_cascade_config=EAGER), expected)
    per_forward = LAYERS_PER_FORWARD[name]
    assert len(forwards) >= new and kernels.add_norms == per_forward * len(forwards)
    norms = PER_FORWARD[name][0]
    # the norm kernel: the others (or, declined, the post-attention norms too)
    assert kernels.norms == (norms - (0 if decline else per_forward)) * len(forwards)
    assert all(fused_ops.takes_kernels(m) == bool(per_forward) for m in layers)
    if not per_forward:
        assert all(type(m).forward is originals[type(m)] for m in layers)
    seen = kernels.add_norms
    with torch.no_grad():
        cascade(input_ids=ids, attention_mask=mask)                  # a forward outside generate
    off = CascadeConfig(cuda_graphs="eager", fuse_elementwise=False)
    assert torch.equal(cascade.generate(**kw, hf_cascade_config=off), expected)
    assert kernels.add_norms == seen


def test_the_fused_layer_forward_is_the_original_but_for_the_add_and_norm():
    """The fused forward is compiled from the class's own source with exactly the residual add and the norm after it
    replaced (so a transformers whose Llama layer differs elsewhere still runs its own code): its code differs from the
    original's in that call alone, and its signature and decorators are the original's."""
    cls = modeling_llama.LlamaDecoderLayer
    original = fused_ops._original_forward(cls)
    fused = fused_ops._fused_layer_forward(cls)
    assert inspect.signature(fused) == inspect.signature(original)
    source = fused_ops._source(original)
    assert source.count(fused_ops._ADD_THEN_NORM) == 1
    names = set(inspect.unwrap(fused).__code__.co_names) - set(inspect.unwrap(original).__code__.co_names)
    assert names == {"_add_norm"}
