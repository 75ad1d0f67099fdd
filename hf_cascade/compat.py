"""What differs between the transformers versions hf_cascade supports, in one place.

The supported range (:data:`SUPPORTED`; the packaging metadata's ``install_requires`` says the same, checked by
tests/test_compat.py), and each difference between the oldest (5.17) and the newest (5.25) checked, decided once at
import from the installed version or read from the code it concerns:

- generate's and the models' cache keyword: ``cache`` from 5.24, ``past_key_values`` before (:data:`CACHE_KWARG`,
  :func:`cache_kwarg`, :func:`cache_of`);
- how the step context reaches the attention: from 5.24 ``Cache.update(k, v, layer_idx, kwargs=<the attention
  kwargs>)``, before it the per-thread shim of :mod:`hf_cascade.context` (:data:`UPDATE_PASSES_KWARGS`);
- two rules of beam search and the repetition penalty that 5.24 changed (:data:`BEAM_RULES_5_24`, read by
  :mod:`hf_cascade.device_select`);
- a modeling function decorated with ``use_kernel_forward_from_hub`` (Llama's ``apply_rotary_pos_emb``): from 5.25
  an ``nn.Module`` instance of kernels' making that calls the function, before it the function
  (:func:`hub_function`, read by :mod:`hf_cascade.decode.fused_ops`);
- Falcon's attention: from 5.25 through the attention interface, before it its own table of classes
  (:data:`FALCON_ROUTES_ATTENTION`, read by the Falcon patch).

Imports nothing of the package: every module may use it.
"""
from __future__ import annotations

import inspect

import transformers
from packaging.version import Version

# [min, max) transformers versions hf_cascade supports; the patches act only inside it. CI runs both ends checked
# (TESTED: .ci/run's 5.17 virtual environment and the default one). Capped below 5.26 until that is tested.
SUPPORTED = (Version("5.17.0"), Version("5.26.0"))
TESTED = (Version("5.17.0"), Version("5.25.0"))
VERSION = Version(Version(transformers.__version__).base_version)    # (a dev or rc build as its release)
_5_24 = VERSION >= Version("5.24")


def in_range() -> bool:
    """Whether the installed transformers is inside :data:`SUPPORTED`."""
    return SUPPORTED[0] <= VERSION < SUPPORTED[1]


def range_text() -> str:
    """The supported range as messages and the metadata say it: ``>=5.17,<5.26``."""
    low, high = SUPPORTED
    return f">={low.major}.{low.minor},<{high.major}" + (f".{high.minor}" if high.minor else "")


# ---- the cache keyword: 5.24 renamed generate's and the models' ``past_key_values`` to ``cache`` ------------------
CACHE_KWARG = "cache" if _5_24 else "past_key_values"
CACHE_KWARGS = ("cache", "past_key_values")          # every name a cache may come under (the new one first)


def cache_kwarg(fn) -> str:
    """The cache keyword ``fn`` (a forward, or a model: its forward) takes: ``cache`` where its signature names it,
    else ``past_key_values`` (a modeling file of before 5.24, or one not renamed yet)."""
    fn = getattr(fn, "forward", fn)
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


def cache_key(kwargs) -> str:
    """The name the cache goes under in ``kwargs`` (generate's model_kwargs: ``cache`` where given so)."""
    return "cache" if "cache" in kwargs else "past_key_values"


def cache_of(kwargs):
    """The cache ``kwargs`` hold under either name (the first not None), or None."""
    return next((kwargs[name] for name in CACHE_KWARGS if kwargs.get(name) is not None), None)


# ---- the attention kwargs route: from 5.24 Cache.update(..., kwargs=) gets the dict the attention receives --------
UPDATE_PASSES_KWARGS = _5_24

# ---- device_select: 5.24's beam search and repetition-penalty rules (shared/reference/device_beam_search.md) -----
BEAM_RULES_5_24 = _5_24


# ---- Falcon: 5.25 removed modeling_falcon's FALCON_ATTENTION_CLASSES table; its FalconAttention calls the attention
# interface itself (and caches the K/V heads unbroadcast), so patches/families.py's Falcon module is for before only --
FALCON_ROUTES_ATTENTION = VERSION >= Version("5.25")


# ---- hub-kernel functions: 5.25 requires kernels>=0.19.1, whose use_kernel_forward_from_hub turns a decorated
# function into an instance of an nn.Module class it makes (``_create_func_module.<locals>.Func``) whose forward calls
# the function; 5.17-5.24 accepted no kernels release that does this and kept the function -------------------------
def hub_function(obj):
    """The plain function behind ``obj``: ``obj`` itself where it is a function; where it is kernels' module for a
    function decorated with ``use_kernel_forward_from_hub``, the function it calls; None for anything else."""
    if inspect.isfunction(obj):
        return obj
    cls = type(obj)
    if cls.__qualname__ != "_create_func_module.<locals>.Func" or not hasattr(cls, "kernel_layer_name"):
        return None
    try:
        func = inspect.getclosurevars(cls.forward).nonlocals.get("func")
    except (TypeError, AttributeError):
        return None
    return func if inspect.isfunction(func) else None
