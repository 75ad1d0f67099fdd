"""The dtype attention computes in under ``torch.autocast``, so that the cascade stores and reads K/V as stock does.

Under autocast a float32 model's projections leave in the autocast dtype (bf16/fp16) while rotary embeddings promote
K back to float32: stock's DynamicCache then holds K in float32 and V in bf16, and ``scaled_dot_product_attention``
(on autocast's lower-precision list on the CPU and CUDA) casts Q, K and V to the autocast dtype before computing. A
paged pool holds one dtype, so the cascade casts K and V to that dtype when it stores them, and Q when it reads:
the values stock's attention computes on, stored once. Outside autocast nothing changes.
"""
from __future__ import annotations

import contextlib

import torch


def autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes attention in for ``tensor``'s device (None: autocast is off there, or the tensor
    is not one autocast casts: float64 and integer tensors stay as they are)."""
    kind = tensor.device.type
    if tensor.dtype == torch.float64 or not tensor.is_floating_point() or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def as_computed(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` in the dtype autocast computes attention in (as they are outside autocast)."""
    dtype = autocast_dtype(tensors[0])
    if dtype is None:
        return tensors
    return tuple(t if t.dtype == dtype else t.to(dtype) for t in tensors)


def kernels_context(device: torch.device) -> contextlib.AbstractContextManager:
    """Where the attention kernels run: outside autocast (their inputs already carry its dtype; the reference
    backend's float32 softmax and log-sum-exp must not be cast down), nothing where autocast is off."""
    kind = device.type
    return torch.autocast(kind, enabled=False) if torch.is_autocast_enabled(kind) else contextlib.nullcontext()


def state(device: torch.device | str) -> tuple[bool, torch.dtype | None]:
    """Autocast's state for ``device``'s type, for what a captured step bakes in (its casts)."""
    kind = torch.device(device).type if device else "cpu"
    try:
        enabled = torch.is_autocast_enabled(kind)
    except RuntimeError:          # a device type autocast does not know ("meta")
        return False, None
    return enabled, torch.get_autocast_dtype(kind) if enabled else None
