"""CascadeConfig: the knobs of the cascade cache and attention."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

BACKENDS = ("auto", "flashinfer", "cuda", "reference")
MEMORY_POLICIES = ("auto", "vmm", "grow", "static")
# CascadeConfig.compile's values besides True and False: "regional" compiles one decoder layer for all of them
COMPILE_MODES = ("regional",)
# KV cache element types besides the model's own (None). float8_e4m3fn: K and V stored as e4m3 with a float32 scale per
# layer, K/V and KV head (hf_cascade.memory says how they are chosen); half the bytes of bf16.
KV_DTYPES = ("float8_e4m3fn",)
# the backends that read an fp8 pool, as each declares it (kernels.base.Backend.kv_dtypes; tests/kv/test_fp8_kv.py keeps
# the two in step): FlashInfer's wrappers read K/V in the queries' dtype only
FP8_BACKENDS = ("auto", "cuda", "reference")
# Largest block_size accepted. A block is what a row's private tail and every shared prefix are rounded up to, and
# each row holds at least one: 65536 tokens per block is already past most models' context windows (one block of
# an 8B model is 8 GiB over its layers), and beyond it the kernels' int32 slot indices (block id x block_size)
# overflow after a few thousand blocks. Larger values are typos (block_size=10**9 asked for 8 TB on one layer).
MAX_BLOCK_SIZE = 2 ** 16


# Settings that were measured or made obsolete and removed: name -> (the value that still means what it did, so an old
# config that gave it is accepted as is; why it went and what to do instead).
REMOVED = {
    "static_decode": (True, "CascadeConfig.static_decode was removed: generate plans every decode step on a layout "
                            "fixed for the call. For steps planned anew each time, run your own decode loop calling "
                            "the model with a CascadeCache (outside generate)."),
    "whole_step": (True, "CascadeConfig.whole_step was removed: where decode steps run on the graph runner, the whole "
                         "step runs on the device wherever its token choice reproduces transformers'. For transformers' "
                         "own decode loop (with the cascade attention, eager forwards), use cuda_graphs=False."),
}
REMOVED_COMPILE_MODE = ("CascadeConfig(compile='max-autotune') was removed: it measured 6% slower than compile=True on "
                        "the H200 (inductor's Triton GEMMs against cuBLAS's). Use compile=True.")


class ConfigTypeError(TypeError, ValueError):
    """A CascadeConfig field of the wrong type: a TypeError, and a ValueError as such errors were before."""


@dataclass
class CascadeConfig:
    """Settings of one :class:`~hf_cascade.CascadeCache`.

    Every field is checked when the config is made: a value of the wrong type raises
    :class:`ConfigTypeError` (a ``TypeError`` and a ``ValueError``), an out-of-range or unknown one
    ``ValueError``, each naming the field and what it accepts.
    ``generate(..., hf_cascade_config=...)`` and :class:`~hf_cascade.CascadeCache` also take a plain
    dict of these fields (:meth:`coerce`).

    Args:
        backend: which kernels compute attention. ``"auto"`` picks the best available one;
            ``"reference"`` is the PyTorch implementation that runs everywhere.
        block_size: tokens per KV block. Small blocks waste less memory on beams' private tails;
            large blocks make fewer, longer reads.
        memory: where the pool's bytes live (:mod:`hf_cascade.memory`). ``"vmm"`` grows the pool in
            place in CUDA virtual memory (needs cuda-bindings and a device with virtual memory
            management): no copy, and memory is mapped only as the pool fills. ``"grow"`` doubles the
            pool with one copy when it runs out (portable). ``"static"`` allocates ``max_kv_bytes`` up
            front and never grows. ``"auto"`` (default) picks ``"vmm"`` where it can run, else ``"grow"``.
        max_kv_bytes: cap on the KV pool of all layers together, in bytes (``None``: no cap
            beyond device memory). Required for ``memory="static"``. Running out of it raises
            :class:`~hf_cascade.PoolExhausted`.
        keep_kv_bytes: bytes of all layers together that a ``"vmm"`` pool keeps mapped when the
            cache is reset, for the next call (0: everything goes back to the device), or ``"auto"``: what
            the call mapped, up to 1/16 of the device's memory (a later call of that size maps no new
            memory), as torch's caching allocator keeps a finished call's memory;
            ``hf_cascade.release(model)`` gives it back.
        min_group_rows: rows that must share a prefix before it is read once for all of them
            (level 0 of the cascade); smaller groups read their whole table as a suffix.
        min_prefix_tokens: a shared prefix shorter than this is not read as its own level: its rows
            read their whole tables as suffixes (where a cascade does not pay). 0: always cascade —
            on the H200 it paid at every prefix measured, from 1k tokens up (benchmarks/RESULTS.md).
        min_saved_tokens: a step reads shared prefixes once (a cascade) only when that saves at least
            this many token reads per layer, i.e. the sum over prefix groups of (rows - 1) x prefix
            tokens; below it every row reads its whole table (one kernel fewer, no merge). ``None``
            (default): the threshold measured for the kernel backend the layers' shapes get (its declared
            ``min_saved_tokens``: cuda 8192, flashinfer 262144, reference 0; benchmarks/RESULTS.md).
        cuda_graphs: run generate's decode steps in hf_cascade's decode loop as a replayed CUDA graph of the whole
            step: block bookkeeping, forward and token choice (:mod:`hf_cascade.decode`). ``None`` (default): on
            where it applies (CUDA, one device, the ``cuda`` kernels for every layer, ...; the reason is logged once
            where it does not, and the same loop runs its steps eagerly, as on the CPU); ``False``: off (transformers'
            loop, eager forwards); ``True``: as None, but a model it cannot apply to is logged at WARNING;
            ``"eager"``: the same loop and static step run without capturing, on any device (for debugging and CPU
            tests).
        compile: with CUDA graphs, compile the decode forward with ``torch.compile`` (default mode, fixed
            shapes; in the whole step also its bookkeeping and token choice) and capture the compiled step: fused
            norms, rotary and MLP glue. The first call of a shape compiles (5-41 s for the H200 benchmarks); off by
            default for that reason. ``"regional"``: instead of the whole forward, one compiled decoder layer serves
            every layer (:mod:`hf_cascade.regional`: dynamo compiles one graph per kind of layer, e.g. sliding and
            full attention, not per layer), the embedding, final norm and logits eager; the bookkeeping and token
            choice compile as with ``True``. On the CPU its forward compiled in 18-25 s for 4 and 16 layers against
            45-95 s whole (benchmarks/regional_compile_cpu.py); on the H200 (8B, 16k x 8 beams) its step is within
            1% of the whole forward's compile (6.32 vs 6.27 ms, uncompiled 8.71) for half the compile (13 vs 26 s
            from empty caches; benchmarks/RESULTS.md).
            Encoder-decoder models compile whole (logged).
        kv_dtype: the element type of the self-attention KV pools. ``None`` (default): the model's dtype, as the
            K/V come. ``"float8_e4m3fn"`` (or ``torch.float8_e4m3fn``): one byte per element, half a bf16 pool, with
            one float32 scale per layer, K/V and KV head fixed by the first K/V written after a reset (the prefill:
            :mod:`hf_cascade.memory`); the cuda and reference backends read it (FlashInfer does not: refused). An
            encoder-decoder's cross-attention K/V stay in the model's dtype.
        fuse_projections: store each layer's ``q_proj``/``k_proj``/``v_proj`` weights as row slices of one buffer, and
            ``gate_proj``/``up_proj`` of another, so that each group is one matrix product
            (:mod:`hf_cascade.fused_linears`): fewer, larger products that read the weights closer to the device's
            rate. Done in place by the first generate call that asks for it (the Parameters stay, as views; state_dict
            unchanged); plain ``nn.Linear`` members only (LoRA wrappers, quantized linears are left as they are). A
            later call finds weights that moved off their buffer (``model.to(dtype)``, a new Parameter), unfuses, logs
            it once, and fuses again. Under tensor parallelism (transformers' ``tp_plan``) each rank fuses its local
            shards of colwise-sharded groups (its own heads, its own intermediate columns), transformers' sharded
            forward kept around the fused one; other sharded groups stay as they are, the reason logged once. On by
            default: faster in every shape measured on the H200 (compiled 8B 16k x 8 beams 8.96 -> 8.72 ms a step,
            greedy 8.11 -> 7.04, sampling n=8 8.63 -> 6.61); a model with no plain projections to fuse runs as it
            is. ``False``: the model's own separate products.
        fuse_elementwise: run each RMSNorm whose class's ``forward`` is transformers' ``LlamaRMSNorm``'s, and each
            rotary embedding whose ``apply_rotary_pos_emb`` is Llama's (Llama, Mistral, Qwen2/3, Mixtral, Granite,
            ...), as one kernel of the library (``csrc/elementwise.cu``) instead of eager mode's eight and ten, in the
            call's forwards on a CUDA device whose kernel library is there before the call (prebuilt, or loaded
            already), bf16 or fp16, uncompiled (:mod:`hf_cascade.fused_ops`; a compiled step fuses them itself;
            float32 keeps stock's ops). The rotary kernel gives eager's bits; the norm eager's roundings with its
            sum of squares ordered otherwise. The MLPs whose ``forward`` is ``LlamaMLP``'s with a SiLU run
            ``silu(gate) * up`` as one kernel too (eager's bits). On by default: on the H200 (bf16, uncompiled
            whole step replayed) 8B 16k x 8 beams 8.70 -> 6.93 ms a step, greedy 4k 7.22 -> 5.80, with no compile
            (norms and rotary; the activation kernel: 231 -> 70 us of the 8B beam step). The decoder layers whose
            ``forward`` is ``LlamaDecoderLayer``'s can run their first residual add and the norm after it as one
            kernel too (``fused_ops.add_norm_kernel``, on). ``False``: the model's own
            norm, rotary and MLP ops.

    Removed settings are refused with what to do instead (:data:`REMOVED`): ``static_decode=False``,
    ``whole_step=False`` and ``compile="max-autotune"``.
    """

    backend: str = "auto"
    block_size: int = 16
    memory: str = "auto"
    max_kv_bytes: int | None = None
    keep_kv_bytes: int | str = 0
    min_group_rows: int = 2
    min_prefix_tokens: int = 0
    min_saved_tokens: int | None = None
    cuda_graphs: bool | str | None = None
    compile: bool | str = False
    kv_dtype: str | None = None
    fuse_projections: bool = True
    fuse_elementwise: bool = True

    def __post_init__(self):
        if not (self.cuda_graphs is None or isinstance(self.cuda_graphs, bool) or self.cuda_graphs == "eager"):
            error = ValueError if isinstance(self.cuda_graphs, str) else ConfigTypeError
            raise error(f"CascadeConfig.cuda_graphs must be None (on where supported), True, False or 'eager', "
                        f"got {self.cuda_graphs!r}.")
        if self.compile == "max-autotune":
            raise ValueError(REMOVED_COMPILE_MODE)
        if not (isinstance(self.compile, bool) or self.compile in COMPILE_MODES):
            error = ValueError if isinstance(self.compile, str) else ConfigTypeError
            raise error(f"CascadeConfig.compile must be True, False or one of {COMPILE_MODES}, got {self.compile!r}.")
        if not isinstance(self.fuse_projections, bool):
            raise ConfigTypeError(f"CascadeConfig.fuse_projections must be a bool, got {self.fuse_projections!r}.")
        if not isinstance(self.fuse_elementwise, bool):
            raise ConfigTypeError(f"CascadeConfig.fuse_elementwise must be a bool, got {self.fuse_elementwise!r}.")
        self.backend = _choice("backend", self.backend, BACKENDS)
        self.memory = _choice("memory", self.memory, MEMORY_POLICIES)
        self.block_size = _integer("block_size", self.block_size, low=1)
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"CascadeConfig.block_size must be at most {MAX_BLOCK_SIZE} tokens, got {self.block_size}: "
                             "a block is the unit every row and shared prefix is rounded up to (16-256 are usual).")
        if self.max_kv_bytes is not None:
            self.max_kv_bytes = _byte_count("max_kv_bytes", self.max_kv_bytes, low=1, or_none=True)
        if not (isinstance(self.keep_kv_bytes, str) and self.keep_kv_bytes == "auto"):
            self.keep_kv_bytes = _byte_count("keep_kv_bytes", self.keep_kv_bytes, low=0, or_auto=True)
        if self.memory == "static" and self.max_kv_bytes is None:
            raise ValueError('CascadeConfig(memory="static") needs max_kv_bytes: the size of the fixed pool.')
        self.min_group_rows = _integer("min_group_rows", self.min_group_rows, low=2)
        self.min_prefix_tokens = _integer("min_prefix_tokens", self.min_prefix_tokens, low=0)
        if self.min_saved_tokens is not None:
            self.min_saved_tokens = _integer("min_saved_tokens", self.min_saved_tokens, low=0,
                                             note=" or None (the backend's measured threshold)")
        self.kv_dtype = _kv_dtype(self.kv_dtype)
        if self.kv_dtype is not None and self.backend not in FP8_BACKENDS:
            raise ValueError(f"CascadeConfig(kv_dtype={self.kv_dtype!r}) cannot run on backend={self.backend!r}: its "
                             f"kernels read K/V in the model's dtype only. Use backend='auto' (the cuda kernels on a "
                             f"GPU, else the reference), one of {FP8_BACKENDS[1:]}, or kv_dtype=None.")

    @property
    def kv_torch_dtype(self):
        """``kv_dtype`` as a torch dtype, or None (the model's dtype)."""
        if self.kv_dtype is None:
            return None
        import torch     # here, not at the top: config imports nothing heavy
        return getattr(torch, self.kv_dtype)

    @classmethod
    def coerce(cls, obj) -> "CascadeConfig":
        """``obj`` as a CascadeConfig: ``None`` gives the defaults, a CascadeConfig is returned as is,
        a mapping gives ``CascadeConfig(**obj)`` (an unknown key raises ``TypeError`` naming the
        fields); anything else raises ``TypeError``."""
        if obj is None:
            return cls()
        if isinstance(obj, cls):
            return obj
        if isinstance(obj, Mapping):
            obj = _without_removed(obj)
            unknown = [k for k in obj if k not in _FIELDS]
            if unknown:
                raise TypeError(_unknown_fields(unknown))
            return cls(**obj)
        raise TypeError(f"expected a hf_cascade.CascadeConfig, a dict of its fields or None, got "
                        f"{type(obj).__name__}: e.g. hf_cascade_config=hf_cascade.CascadeConfig(backend='reference').")


_FIELDS = [f.name for f in dataclasses.fields(CascadeConfig)]


def _hinting_init(init):
    """The dataclass's ``__init__``, with a misspelt field named and the likely one suggested (as ``coerce`` does
    for a dict) instead of a bare "unexpected keyword argument"."""
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        kwargs = _without_removed(kwargs)
        unknown = [k for k in kwargs if k not in _FIELDS]
        if unknown:
            raise TypeError(_unknown_fields(unknown))
        init(self, *args, **kwargs)

    return __init__


CascadeConfig.__init__ = _hinting_init(CascadeConfig.__init__)


def _without_removed(fields: Mapping) -> dict:
    """``fields`` less the removed settings given their old default (:data:`REMOVED`); any other value of one is
    refused with why it went and what to do instead."""
    for name, (kept, message) in REMOVED.items():
        if name in fields and fields[name] is not kept:
            raise ValueError(f"{message} (got {name}={fields[name]!r})")
    return {k: v for k, v in fields.items() if k not in REMOVED}


def _unknown_fields(unknown: list) -> str:
    hints = "".join(f" ({k!r}: did you mean {m[0]!r}?)" for k in unknown
                    if (m := difflib.get_close_matches(str(k), _FIELDS, n=1)))
    return f"unknown CascadeConfig field(s) {unknown}{hints}; the fields are {_FIELDS}."


def _choice(name: str, value, choices: tuple) -> str:
    if not isinstance(value, str):
        raise ConfigTypeError(f"CascadeConfig.{name} must be a string, one of {choices}; got {type(value).__name__} "
                        f"{value!r}.")
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"CascadeConfig.{name} must be one of {choices}, got {value!r}{hint}.")
    return value


def _kv_dtype(value) -> str | None:
    """``kv_dtype`` as its name: None, a name of KV_DTYPES, or the torch dtype of one."""
    if value is None:
        return None
    name = str(value).removeprefix("torch.") if type(value).__name__ == "dtype" else value
    if not isinstance(name, str):
        raise ConfigTypeError(f"CascadeConfig.kv_dtype must be None (the model's dtype) or one of {KV_DTYPES}, got "
                              f"{type(value).__name__} {value!r}.")
    if name not in KV_DTYPES:
        close = difflib.get_close_matches(name, KV_DTYPES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"CascadeConfig.kv_dtype must be None (the model's dtype) or one of {KV_DTYPES}, got "
                         f"{value!r}{hint}.")
    import torch
    if not hasattr(torch, name):
        raise ValueError(f"CascadeConfig.kv_dtype={name!r} needs a torch with {name} (this is {torch.__version__}).")
    return name


def _integer(name: str, value, *, low: int, note: str = "") -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ConfigTypeError(f"CascadeConfig.{name} must be an int >= {low}{note}, "
                              f"got {type(value).__name__} {value!r}.")
    if value < low:
        raise ValueError(f"CascadeConfig.{name} must be an int >= {low}{note}, got {value!r}.")
    return int(value)


def _byte_count(name: str, value, *, low: int, or_none: bool = False, or_auto: bool = False) -> int:
    """A number of bytes: an int, or a float such as 4e9 (rounded down)."""
    what = f"a number of bytes >= {low}" + (" or None" if or_none else "") + (' or "auto"' if or_auto else "")
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ConfigTypeError(f"CascadeConfig.{name} must be {what}, got {type(value).__name__} {value!r}.")
    if not math.isfinite(value) or value < low:
        raise ValueError(f"CascadeConfig.{name} must be {what}, got {value!r}.")
    return int(value)
