"""Each RMSNorm of a cascade generate call's forwards as one kernel (``CascadeConfig.fuse_norms``).

Uncompiled, transformers' ``LlamaRMSNorm`` is eight kernels (a cast, the square, the mean, the epsilon, the rsqrt, the
product, the cast back, the weight): two norms per decoder layer and the final one make ~520 tiny launches in an 8B
model's decode step, each a few microseconds of a step that is otherwise bound by reading the weights. A compiled
step fuses them; this does it without a compile: :func:`install` gives every norm whose class's ``forward`` is
Llama's, source for source (Mistral, Qwen2/3, Mixtral, Phi-3, Granite, GLM, DeepSeek-V3, ... share it; Gemma's,
OLMo2's and Helium's differ and are left alone), a forward that runs ``csrc/norm.cu`` where it can:

- inside a cascade generate call (:func:`hf_cascade.fused_linears.serving_now`), not under ``torch.compile`` (the
  compiled step fuses the norm itself), no gradient wanted;
- on a CUDA device whose kernel library is loaded, bf16 or fp16, the weight in the input's dtype, the hidden size
  contiguous (:func:`hf_cascade.kernels.cuda_library.rms_norm`);

and the module's own forward otherwise (float32 and float64 models keep stock's norm bit for bit). The kernel keeps
the eager forward's roundings (:func:`rms_norm_reference`); only its sum of squares is ordered otherwise, so a
normalised value can differ from eager's in its last float32 bits before the cast.

The forward is an instance attribute (hooks still run: ``nn.Module.__call__`` calls it); :func:`uninstall` removes it.
Nothing else of the module changes (its ``weight`` Parameter and ``state_dict`` are the same objects).
"""
from __future__ import annotations

import inspect
import textwrap
import threading
import weakref

import torch
from torch import nn

from . import fused_linears
from .kernels import cuda_library

_lock = threading.Lock()
_sources: dict = {}          # class -> whether its forward is Llama's, source for source
_kernel = cuda_library.rms_norm     # (tests put a CPU stand-in here)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel's semantics: transformers' ``LlamaRMSNorm.forward`` (computed in float32, cast back to the input's
    dtype before the weight's product)."""
    y = x.to(torch.float32)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def _llama_source() -> str | None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    return _source(LlamaRMSNorm)


def _source(cls) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return None


def eligible(module: nn.Module) -> bool:
    """Whether ``module`` is an RMSNorm whose class's forward is Llama's (and not given a forward of its own)."""
    cls = type(module)
    if not cls.__name__.endswith("RMSNorm") or "forward" in module.__dict__:
        return False
    if cls not in _sources:
        reference = _llama_source()
        _sources[cls] = reference is not None and _source(cls) == reference
    weight = getattr(module, "weight", None)
    return (_sources[cls] and isinstance(weight, nn.Parameter) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float))


class _NormForward:
    """A norm's forward while installed: the kernel where it runs (see the module docstring), else the class's."""

    def __init__(self, module: nn.Module):
        self.module = weakref.ref(module)     # (the module holds this object: no cycle)

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        module = self.module()
        weight = module.weight
        if (fused_linears.serving_now() and not torch.compiler.is_compiling()
                and not (torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad))):
            out = _kernel(hidden_states, weight, module.variance_epsilon)
            if out is not None:
                return out
        return type(module).forward(module, hidden_states)


def installed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), _NormForward)


def install(model: nn.Module) -> int:
    """Give every eligible norm of ``model`` the kernel's forward; the number installed now (0 on a second call)."""
    with _lock:
        count = 0
        for module in model.modules():
            if not installed(module) and eligible(module):
                module.forward = _NormForward(module)
                count += 1
        return count


def uninstall(model: nn.Module) -> int:
    """Give every norm of ``model`` its class's forward back; the number removed."""
    with _lock:
        count = 0
        for module in model.modules():
            if installed(module):
                del module.forward
                count += 1
        return count
