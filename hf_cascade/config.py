"""CascadeConfig: the knobs of the cascade cache and attention."""
from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "flashinfer", "cuda", "reference")
MEMORY_POLICIES = ("grow", "static")


@dataclass
class CascadeConfig:
    """Settings of one :class:`~hf_cascade.CascadeCache`.

    Args:
        backend: which kernels compute attention. ``"auto"`` picks the best available one;
            ``"reference"`` is the PyTorch implementation that runs everywhere.
        block_size: tokens per KV block. Small blocks waste less memory on beams' private tails;
            large blocks make fewer, longer reads.
        memory: where the pool's bytes live. ``"grow"`` doubles the pool when it runs out (the
            portable default); ``"static"`` allocates ``max_kv_bytes`` up front and never grows.
        max_kv_bytes: cap on the KV pool of all layers together, in bytes (``None``: no cap
            beyond device memory). Required for ``memory="static"``.
        min_group_rows: rows that must share a prefix before it is read once for all of them
            (level 0 of the cascade); smaller groups read their whole table as a suffix.
    """

    backend: str = "auto"
    block_size: int = 16
    memory: str = "grow"
    max_kv_bytes: int | None = None
    min_group_rows: int = 2

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"CascadeConfig.backend must be one of {BACKENDS}, got {self.backend!r}.")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"CascadeConfig.block_size must be a positive int, got {self.block_size!r}.")
        if self.memory not in MEMORY_POLICIES:
            raise ValueError(f"CascadeConfig.memory must be one of {MEMORY_POLICIES}, got {self.memory!r}.")
        if self.max_kv_bytes is not None and self.max_kv_bytes <= 0:
            raise ValueError(f"CascadeConfig.max_kv_bytes must be positive or None, got {self.max_kv_bytes!r}.")
        if self.memory == "static" and self.max_kv_bytes is None:
            raise ValueError('CascadeConfig(memory="static") needs max_kv_bytes: the size of the fixed pool.')
        if self.min_group_rows < 2:
            raise ValueError(f"CascadeConfig.min_group_rows must be >= 2, got {self.min_group_rows!r}.")
