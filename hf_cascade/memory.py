"""Where a layer's KV pool lives: a tensor ``[num_blocks, 2, block_size, kv_heads, head_dim]``.

Two policies for now: ``grow`` (amortised doubling with one copy, portable) and ``static`` (a fixed
number of blocks allocated once). Block ids index dim 0, so growth never renumbers blocks.
"""
from __future__ import annotations

import torch


class BlockStorage:
    """The bytes of one layer's paged KV pool.

    Args:
        block_shape: ``(2, block_size, kv_heads, head_dim)``, the shape of one block (K and V).
        dtype, device: of the pool; those of the first K/V written to the layer.
        policy: ``"grow"`` or ``"static"``.
        max_blocks: the cap (``static`` allocates exactly this many at once); ``None`` for no cap.
    """

    MIN_BLOCKS = 16

    def __init__(self, block_shape, dtype: torch.dtype, device: torch.device, policy: str = "grow",
                 max_blocks: int | None = None):
        if policy == "static" and max_blocks is None:
            raise ValueError("static storage needs max_blocks")
        self.block_shape = tuple(block_shape)
        self.dtype, self.device, self.policy, self.max_blocks = dtype, torch.device(device), policy, max_blocks
        initial = max_blocks if policy == "static" else 0
        self.tensor = self._allocate(initial)

    def _allocate(self, num_blocks: int) -> torch.Tensor:
        return torch.empty((num_blocks, *self.block_shape), dtype=self.dtype, device=self.device)

    @property
    def num_blocks(self) -> int:
        return self.tensor.shape[0]

    @property
    def block_nbytes(self) -> int:
        n = self.tensor.element_size()
        for s in self.block_shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    def ensure(self, num_blocks: int) -> torch.Tensor:
        """Make block ids ``[0, num_blocks)`` addressable; returns the (possibly new) pool tensor."""
        if num_blocks <= self.num_blocks:
            return self.tensor
        if self.policy == "static" or (self.max_blocks is not None and num_blocks > self.max_blocks):
            raise MemoryError(
                f"KV pool needs {num_blocks} blocks but holds at most {self.max_blocks or self.num_blocks}; "
                "raise CascadeConfig.max_kv_bytes or lower beams, prompt length or new tokens.")
        new_size = max(num_blocks, 2 * self.num_blocks, self.MIN_BLOCKS)
        if self.max_blocks is not None:
            new_size = min(new_size, self.max_blocks)
        grown = self._allocate(new_size)
        grown[: self.num_blocks].copy_(self.tensor)   # the one copy growth costs; block ids stay valid
        self.tensor = grown
        return grown

    def release(self) -> None:
        """Give the pool's memory back (``static`` keeps its fixed allocation)."""
        if self.policy != "static":
            self.tensor = self._allocate(0)


def make_storage(block_shape, dtype: torch.dtype, device, policy: str = "grow", max_blocks: int | None = None):
    """The storage object of one layer's pool for the configured policy."""
    return BlockStorage(block_shape, dtype, device, policy, max_blocks)
