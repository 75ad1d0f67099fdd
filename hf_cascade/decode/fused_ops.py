"""A cascade generate call's RMSNorms and rotary embeddings as one kernel each (``CascadeConfig.fuse_elementwise``).

Uncompiled, transformers' ``LlamaRMSNorm`` is eight kernels (a cast, the square, the mean, the epsilon, the rsqrt, the
product, the cast back, the weight) and ``apply_rotary_pos_emb`` ten (for q and k: two products, rotate_half's
negation and concatenation, the sum): ~27 launches a decoder layer, ~850 in an 8B model's decode step, each a few
microseconds of a step otherwise bound by reading the weights. A compiled step fuses them; this does it without a
compile, with the library's kernels (``csrc/elementwise.cu``).

What takes them: the norm classes whose ``forward`` is ``LlamaRMSNorm``'s and the modeling modules whose
``apply_rotary_pos_emb`` and ``rotate_half`` are Llama's, source for source (Mistral, Qwen2/3, Mixtral, Granite,
DeepSeek-V3, ... share them; Gemma's and OLMo2's norms, Phi-3's and GLM's rotary differ and are left alone).
:func:`configure` wraps those of a model's classes and modules once (a wrapper per class or module, kept for the
process), and the wrappers run the kernel only:

- inside a generate call whose config asked for it (this thread's flag, set by :func:`configure`, cleared by
  :func:`call_ended`), not under ``torch.compile`` (the compiled step fuses them itself), no gradient wanted;
- on a CUDA device whose kernel library is there before the call's first forward (loaded, or the prebuilt one:
  decided once a call), bf16 or fp16, the tensors in one dtype, the last dimension
  contiguous (:func:`hf_cascade.kernels.cuda_library.rms_norm`, :func:`~hf_cascade.kernels.cuda_library.rotary`);

and the original otherwise: every other model, call and thread, float32 and float64 (stock's bits). The rotary
kernel rounds each product and the sum as eager mode does: eager's result bit for bit
(:func:`rotary_reference`). The norm keeps the eager roundings (:func:`rms_norm_reference`) but orders its sum of
squares otherwise: a normalised value can differ from eager's in its last float32 bits before the cast.

The MLP's activation, where :data:`act_kernel` is on: eager ``LlamaMLP.forward`` runs ``act_fn(gate)`` and ``* up``
as two kernels a decoder layer (64 launches in an 8B step, 32 with the kernel); the MLP classes whose ``forward`` is
``LlamaMLP``'s, source for source (Mistral, Qwen2/3, Granite, OLMo2, ...; Phi-3's fused ``gate_up_proj``, GPT-OSS's
experts differ), with a SiLU ``act_fn`` (transformers' ``ACT2FN["silu"]``; Gemma's gelu is left alone) compute
``down_proj(silu_mul(gate_proj(x), up_proj(x)))`` with one kernel, under the conditions above
(:func:`hf_cascade.kernels.cuda_library.silu_mul`; the gate and up products may be the column halves of one fused
product, :mod:`hf_cascade.decode.fused_linears`). It rounds as eager mode does, ``T(T(silu(g)) * u)`` with PyTorch's
CUDA silu op for op although the library is built with fast math (inline PTX, ``csrc/elementwise.cu``): eager's result
bit for bit (:func:`silu_mul_reference`). Where the kernel declines (float32, a CPU tensor) the MLP runs the original's
ops on the same products.

A decoder layer's first residual add and the norm after it, where :data:`add_norm_kernel` is on: eager
``LlamaDecoderLayer.forward`` runs ``residual + hidden_states`` and then ``post_attention_layernorm`` as two
launches; the decoder layer classes whose ``forward`` is Llama's, source for source (of the installed transformers),
with Llama's norm there, run that forward with the two as one kernel (:func:`hf_cascade.kernels.cuda_library.
add_rms_norm`: the add rounded as eager's, the norm as the norm kernel's) under the conditions above: 32 launches fewer
in an 8B step. The forward is the class's own source with those lines replaced by one call (:func:`_add_norm`), which
runs the original two ops wherever the kernel declines.
"""
from __future__ import annotations

import __future__
import functools
import inspect
import sys
import textwrap
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from .. import compat
from ..kernels import cuda_library

_lock = threading.Lock()
_call = threading.local()       # .on: this thread's generate call asked for the kernels
_wrapped: dict = {}             # norm class -> its original forward; modeling module -> its original rotary
_checked: dict = {}             # (class or module) -> whether it is Llama's, source for source
_last: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # model -> (its last call asked, act_kernel too)
_mlps: set = set()              # the wrapped MLP classes (also in _wrapped)
_layers: set = set()            # the wrapped decoder layer classes (also in _wrapped)
_norm_kernel = cuda_library.rms_norm        # (tests put CPU stand-ins here)
_rotary_kernel = cuda_library.rotary
_act_kernel = cuda_library.silu_mul
_add_norm_kernel = cuda_library.add_rms_norm

# the MLP's silu(gate) * up as one kernel (csrc/elementwise.cu) in the calls that take the elementwise kernels
# (tests/decode/test_gpu_fused_ops.py's silu_mul tests passed on the H200, 2026-12-05: eager's bits; 8B 16k x 8 beam
# step: 231 us of silu and product kernels -> 70 us). False: no MLP class is wrapped or changed
act_kernel = True

# a decoder layer's first residual add and post-attention norm as one kernel (csrc/elementwise.cu hfc_add_rms_norm) in
# the calls that take the elementwise kernels. Its GPU tests passed on an H100 (2026-12-05,
# tests/decode/test_gpu_fused_ops.py -k add_norm). False: no decoder layer class is wrapped or changed
add_norm_kernel = True


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm kernel's semantics: ``LlamaRMSNorm.forward`` (float32, cast back before the weight's product)."""
    y = x.to(torch.float32)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def rotary_reference(q, k, cos, sin):
    """The rotary kernel's semantics: ``apply_rotary_pos_emb(q, k, cos, sin)`` (``unsqueeze_dim=1``)."""
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The activation kernel's semantics: ``LlamaMLP``'s ``act_fn(gate) * up`` with a SiLU ``act_fn`` (eager: silu in
    float32, rounded to the element type, then the product rounded again)."""
    return F.silu(gate) * up


def _active() -> bool:
    if torch.compiler.is_compiling():       # (first: a traced forward reads no thread state)
        return False
    return getattr(_call, "on", False) and not torch.is_grad_enabled()


# ---- which classes and modules are Llama's --------------------------------------------------------------------
def _source(obj) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        return None


def _function_source(obj) -> str | None:
    function = compat.hub_function(obj)
    return None if function is None else _source(function)


def _llama():
    from transformers.models.llama import modeling_llama
    return modeling_llama


def _original_forward(cls):
    return _wrapped.get(cls, cls.forward)


def _norm_eligible(module: nn.Module) -> bool:
    cls = type(module)
    if not cls.__name__.endswith("RMSNorm") or "forward" in module.__dict__:
        return False
    if cls not in _checked:
        reference = _source(_original_forward(_llama().LlamaRMSNorm))
        _checked[cls] = reference is not None and _source(_original_forward(cls)) == reference
    weight = getattr(module, "weight", None)
    return (_checked[cls] and isinstance(weight, nn.Parameter) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float))


@functools.lru_cache(maxsize=None)      # (read at every MLP forward)
def _silu_types() -> tuple:
    from transformers import activations
    found = getattr(activations, "SiLUActivation", None)     # (ACT2FN["silu"] in 5.x; nn.SiLU before)
    return (nn.SiLU,) if found is None else (nn.SiLU, found)


def _is_silu(act_fn) -> bool:
    """Whether ``act_fn`` is SiLU as transformers makes it (``ACT2FN["silu"]``), its forward not replaced."""
    return type(act_fn) in _silu_types() and "forward" not in act_fn.__dict__


def _mlp_eligible(module: nn.Module) -> bool:
    cls = type(module)
    if "forward" in module.__dict__ or not all(hasattr(module, name) for name in ("gate_proj", "up_proj",
                                                                                  "down_proj", "act_fn")):
        return False
    if cls not in _checked:
        reference = _source(_original_forward(_llama().LlamaMLP))
        _checked[cls] = reference is not None and _source(_original_forward(cls)) == reference
    return _checked[cls] and _is_silu(module.act_fn)


# the lines of LlamaDecoderLayer.forward that the fused forward replaces (the residual add, the norm after it), and
# what replaces them
# (as _source gives it: dedented to the def's column)
_ADD_THEN_NORM = """    hidden_states = residual + hidden_states

    # Fully Connected
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
"""
_ADD_AND_NORM = """    residual, hidden_states = _add_norm(residual, hidden_states, self.post_attention_layernorm)
"""


def _layer_eligible(module: nn.Module) -> bool:
    """A decoder layer whose class's forward is Llama's (source for source) and whose post-attention norm is Llama's."""
    cls = type(module)
    if not cls.__name__.endswith("DecoderLayer") or "forward" in module.__dict__:
        return False
    if cls not in _checked:
        reference = _source(_original_forward(_llama().LlamaDecoderLayer))
        _checked[cls] = (reference is not None and reference.count(_ADD_THEN_NORM) == 1
                         and _source(_original_forward(cls)) == reference)
    norm = getattr(module, "post_attention_layernorm", None)
    return _checked[cls] and isinstance(norm, nn.Module) and _norm_eligible(norm)


def _add_norm(residual: torch.Tensor, hidden_states: torch.Tensor, norm: nn.Module):
    """``(residual + hidden_states, norm(residual + hidden_states))``: one kernel where it runs and the norm is Llama's
    (the fused forward runs only in the calls that take the kernels: :func:`_wrap_layer`), the two original ops
    otherwise."""
    if _norm_eligible(norm):
        out = _add_norm_kernel(hidden_states, residual, norm.weight, norm.variance_epsilon)
        if out is not None:
            return out
    hidden_states = residual + hidden_states
    return hidden_states, norm(hidden_states)


def _fused_layer_forward(cls):
    """``cls.forward``'s own source with the residual add and the norm after it as one :func:`_add_norm` call,
    compiled in the namespace of the class's module (its decorators and names resolve as the original's)."""
    source = _source(_original_forward(cls)).replace(_ADD_THEN_NORM, _ADD_AND_NORM)
    module = sys.modules[cls.__module__]
    namespace = dict(vars(module), _add_norm=_add_norm)
    # (the module's own future flags, not this one's: its annotations stay what they are there)
    flags = __future__.annotations.compiler_flag if getattr(module, "annotations", None) is __future__.annotations \
        else 0
    code = compile(source, f"<hf_cascade fused {cls.__qualname__}.forward>", "exec", flags=flags, dont_inherit=True)
    exec(code, namespace)  # noqa: S102 — the class's own source, checked to be Llama's
    return namespace["forward"]


def _rotary_module(module: nn.Module):
    """The modeling module of an attention layer whose ``apply_rotary_pos_emb`` and ``rotate_half`` are Llama's."""
    found = sys.modules.get(type(module).__module__)
    if found is None or not hasattr(found, "apply_rotary_pos_emb") or not hasattr(found, "rotate_half"):
        return None
    if found not in _checked:
        llama = _llama()
        # (from 5.25 apply_rotary_pos_emb is kernels' module around the function: the function's source is compared)
        pairs = ((_wrapped.get(found, found.apply_rotary_pos_emb), _wrapped.get(llama, llama.apply_rotary_pos_emb)),
                 (found.rotate_half, llama.rotate_half))
        sources = [(_function_source(a), _function_source(b)) for a, b in pairs]
        _checked[found] = all(a is not None and a == b for a, b in sources)
    return found if _checked[found] else None


# ---- the wrappers ----------------------------------------------------------------------------------------------
def _wrap_norm(cls) -> None:
    original = cls.forward

    @functools.wraps(original)
    def forward(self, hidden_states):
        if _active():
            out = _norm_kernel(hidden_states, self.weight, self.variance_epsilon)
            if out is not None:
                return out
        return original(self, hidden_states)

    _wrapped[cls] = original
    cls.forward = forward


def _wrap_mlp(cls) -> None:
    original = cls.forward

    @functools.wraps(original)
    def forward(self, x):
        if act_kernel and _active() and _is_silu(self.act_fn):
            gate, up = self.gate_proj(x), self.up_proj(x)
            hidden = _act_kernel(gate, up)
            if hidden is None:                  # (the original's ops on these products: none computed twice)
                hidden = self.act_fn(gate) * up
            return self.down_proj(hidden)
        return original(self, x)

    _wrapped[cls] = original
    _mlps.add(cls)
    cls.forward = forward


def _wrap_layer(cls) -> None:
    original, fused = cls.forward, _fused_layer_forward(cls)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if add_norm_kernel and _active():
            return fused(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    _wrapped[cls] = original
    _layers.add(cls)
    cls.forward = forward


def _wrap_rotary(module) -> None:
    original = module.apply_rotary_pos_emb

    @functools.wraps(compat.hub_function(original))      # (the function's name and docstring, not a module's)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if not args and not kwargs and _active():
            out = _rotary_kernel(q, k, cos, sin)
            if out is not None:
                return out
        return original(q, k, cos, sin, *args, **kwargs)

    _wrapped[module] = original
    module.apply_rotary_pos_emb = apply_rotary_pos_emb


def configure(model: nn.Module, on: bool) -> bool:
    """This thread's generate call takes the kernels where ``on`` and a CUDA model's kernel library is there before
    the call's first forward (loaded, or the prebuilt one: :func:`~hf_cascade.kernels.cuda_library.prebuilt_or_loaded`;
    a library that the attention backend loaded during the prefill would leave the first norms on the original and
    the rest on the kernel, and the first call of a process unlike the later ones). The model's classes and modules
    are wrapped first, once. Returns whether the choice differs from the model's last call (its kept graphs hold the
    other)."""
    device = _device_of(model)
    if on and device is not None and device.type == "cuda" and cuda_library.prebuilt_or_loaded(device) is None:
        on = False
    # (graphs kept with the activation or add-and-norm kernel hold it: a change drops them)
    choice = (on, on and act_kernel, on and add_norm_kernel)
    with _lock:
        changed = _last.get(model, (False, False, False)) != choice
        _last[model] = choice
        if on:
            for module in model.modules():
                if type(module) not in _wrapped and _norm_eligible(module):
                    _wrap_norm(type(module))
                if act_kernel and type(module) not in _wrapped and _mlp_eligible(module):
                    _wrap_mlp(type(module))
                if add_norm_kernel and type(module) not in _wrapped and _layer_eligible(module):
                    _wrap_layer(type(module))
                rotary = _rotary_module(module) if hasattr(module, "q_proj") else None
                if rotary is not None and rotary not in _wrapped:
                    _wrap_rotary(rotary)
    _call.on = on
    return changed


def _device_of(model: nn.Module) -> torch.device | None:
    parameter = next(model.parameters(), None)
    return None if parameter is None else parameter.device


def call_ended() -> None:
    """The end of this thread's generate call (the next forward outside one runs the originals)."""
    _call.on = False


def takes_kernels(module: nn.Module) -> bool:
    """Whether ``module``'s norm forward, its attention's rotary embedding, (:data:`act_kernel` on) its MLP's
    activation, or (:data:`add_norm_kernel` on) its decoder layer's add and norm is wrapped and would take the kernel
    (for tests)."""
    if type(module) in _mlps:
        return act_kernel and _is_silu(module.act_fn)
    if type(module) in _layers:
        return add_norm_kernel and _norm_eligible(module.post_attention_layernorm)
    found = sys.modules.get(type(module).__module__)
    return type(module) in _wrapped or (hasattr(module, "q_proj") and found in _wrapped)
