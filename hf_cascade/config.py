"""CascadeConfig: the knobs of the cascade cache and attention."""
from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "flashinfer", "cuda", "reference")
MEMORY_POLICIES = ("auto", "vmm", "grow", "static")


@dataclass
class CascadeConfig:
    """Settings of one :class:`~hf_cascade.CascadeCache`.

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
            beyond device memory). Required for ``memory="static"``.
        keep_kv_bytes: bytes of all layers together that a ``"vmm"`` pool keeps mapped when the
            cache is reset, for the next call (0: everything goes back to the device).
        min_group_rows: rows that must share a prefix before it is read once for all of them
            (level 0 of the cascade); smaller groups read their whole table as a suffix.
        min_prefix_tokens: a shared prefix shorter than this is not read as its own level: its rows
            read their whole tables as suffixes (where a cascade does not pay). 0: always cascade —
            on the H200 it paid at every prefix measured, from 1k tokens up (benchmarks/RESULTS.md).
        min_saved_tokens: a step reads shared prefixes once (a cascade) only when that saves at least
            this many token reads per layer, i.e. the sum over prefix groups of (rows - 1) x prefix
            tokens; below it every row reads its whole table (one kernel fewer, no merge). ``None``
            (default): the threshold measured for the kernel backend that runs (its
            ``MIN_SAVED_TOKENS``: cuda 8192, flashinfer 262144, reference 0; benchmarks/RESULTS.md).
        cuda_graphs: run generate's decode steps as a replayed CUDA graph of the whole forward
            (:mod:`hf_cascade.graphs`). ``None`` (default): on where it applies (CUDA, one device, the
            ``cuda`` kernels for every layer, ...; the reason is logged once where it does not); ``False``:
            off; ``True``: as None, but a model it cannot apply to is logged at WARNING; ``"eager"``: the
            runner's static path (fixed buffers, one plan upload per step) run without capturing, on any
            device (for debugging and CPU tests).
        compile: with CUDA graphs, compile the decode forward with ``torch.compile`` (default mode, fixed
            shapes) and capture the compiled forward: fused norms, rotary and MLP glue. The first call of a
            shape compiles (tens of seconds for an 8B model); off by default.
        static_decode: inside generate, plan decode steps on a layout fixed for the call
            (:class:`~hf_cascade.plan.DecodeLayout`; needed by graphs). ``False`` plans every step anew.
    """

    backend: str = "auto"
    block_size: int = 16
    memory: str = "auto"
    max_kv_bytes: int | None = None
    keep_kv_bytes: int = 0
    min_group_rows: int = 2
    min_prefix_tokens: int = 0
    min_saved_tokens: int | None = None
    cuda_graphs: bool | str | None = None
    static_decode: bool = True
    compile: bool = False

    def __post_init__(self):
        if self.cuda_graphs not in (None, True, False, "eager"):
            raise ValueError(f"CascadeConfig.cuda_graphs must be None (on where supported), True, False or 'eager', "
                             f"got {self.cuda_graphs!r}.")
        if not isinstance(self.compile, bool):
            raise ValueError(f"CascadeConfig.compile must be a bool, got {self.compile!r}.")
        if not isinstance(self.static_decode, bool):
            raise ValueError(f"CascadeConfig.static_decode must be a bool, got {self.static_decode!r}.")
        if self.backend not in BACKENDS:
            raise ValueError(f"CascadeConfig.backend must be one of {BACKENDS}, got {self.backend!r}.")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"CascadeConfig.block_size must be a positive int, got {self.block_size!r}.")
        if self.memory not in MEMORY_POLICIES:
            raise ValueError(f"CascadeConfig.memory must be one of {MEMORY_POLICIES}, got {self.memory!r}.")
        if self.max_kv_bytes is not None:
            if not _is_number(self.max_kv_bytes) or self.max_kv_bytes < 1:
                raise ValueError(f"CascadeConfig.max_kv_bytes must be a positive number of bytes or None, "
                                 f"got {self.max_kv_bytes!r}.")
            self.max_kv_bytes = int(self.max_kv_bytes)
        if not _is_number(self.keep_kv_bytes) or self.keep_kv_bytes < 0:
            raise ValueError(f"CascadeConfig.keep_kv_bytes must be a non-negative number of bytes, "
                             f"got {self.keep_kv_bytes!r}.")
        self.keep_kv_bytes = int(self.keep_kv_bytes)
        if self.memory == "static" and self.max_kv_bytes is None:
            raise ValueError('CascadeConfig(memory="static") needs max_kv_bytes: the size of the fixed pool.')
        if self.min_group_rows < 2:
            raise ValueError(f"CascadeConfig.min_group_rows must be >= 2, got {self.min_group_rows!r}.")
        if not isinstance(self.min_prefix_tokens, int) or self.min_prefix_tokens < 0:
            raise ValueError(f"CascadeConfig.min_prefix_tokens must be an int >= 0, got {self.min_prefix_tokens!r}.")
        if self.min_saved_tokens is not None and (not isinstance(self.min_saved_tokens, int)
                                                  or isinstance(self.min_saved_tokens, bool)
                                                  or self.min_saved_tokens < 0):
            raise ValueError(f"CascadeConfig.min_saved_tokens must be an int >= 0 or None (the backend's "
                             f"measured threshold), got {self.min_saved_tokens!r}.")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x   # not NaN
