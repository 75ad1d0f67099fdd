"""The static decode step's interface of a cache: what the graph runner (:mod:`hf_cascade.graphs`) and the whole
step on the device (:mod:`hf_cascade.whole_step`) call, declared once.

Two caches implement it: :class:`~hf_cascade.cache.CascadeCache` (the paged, copy-on-write cache of decoder
self-attention) and :class:`~hf_cascade.dense_cache.StaticSelfAttentionCache` (the T5 family's dense self-attention
in a form a CUDA graph replays). A step's life: :meth:`StaticStepCache.begin_decode` once per call, then per step
:meth:`~StaticStepCache.prepare_step` (the host writes the step's device state) or
:meth:`~StaticStepCache.begin_planned_step` (the device wrote it: the whole step), the forward with
:attr:`~StaticStepCache.step` as its step context, :meth:`~StaticStepCache.rewind_step` where a capture re-runs it,
:meth:`~StaticStepCache.end_step`; :meth:`~StaticStepCache.end_decode` at the end. :attr:`~StaticStepCache.layout`
is what a captured step bakes in: a new layout (a widened room, a new table) means a new capture.
tests/kv/test_static_decode.py checks that both caches implement every member with these parameters.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class StaticStepCache(Protocol):
    """A cache whose decode steps can run static (fixed shapes and buffers for a layout), captured or compiled."""

    def begin_decode(self, max_length: int) -> None:
        """From the next one-token-per-row step on, decode steps are static until :meth:`end_decode`;
        ``max_length`` (generate's) caps the capacity."""

    def end_decode(self) -> None:
        """The call's decode ended: the static layout is released."""

    def prepare_step(self, num_rows: int, q_len: int = 1) -> Any:
        """Begin a step before the forward (the host writes its device state once); returns its step context."""

    def begin_planned_step(self, device: torch.device, copies: bool = True) -> Any:
        """Begin a step whose device state the device computed (the whole step); returns its step context.
        ``copies=False``: no row appends to a block another row holds (a paged cache launches no copy)."""

    @property
    def step(self) -> Any:
        """The context of the step in progress (None between steps)."""

    def rewind_step(self) -> None:
        """Let the step's layers write again (a capture re-runs the step just run: same slots, same values)."""

    def end_step(self) -> None:
        """End the step in progress."""

    @property
    def layout(self) -> Any:
        """What a captured step bakes in (compared by the runner before it replays)."""

    def reset(self) -> None:
        """Empty the cache (every block or buffer back; the next call starts afresh)."""
