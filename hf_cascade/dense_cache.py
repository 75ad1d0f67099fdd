"""The decoder self-attention cache of an encoder-decoder call where it stays dense (not a paged CascadeCache).

That is for the relative-bias families (T5: the bias is computed from the width of the K/V the cache returns)
and for one-token decoder prompts on the CPU (``seq2seq_models.paged_self_attention`` decides). On the CPU,
:class:`ReorderedCache` replaces stock's DynamicCache: one copy of the self K/V per beam step instead of
stock's two. Elsewhere stock's DynamicCache, its growth counted against ``max_kv_bytes`` where one is set
(:func:`capped_dynamic_cache`, also used for both halves of stock's cache on the dense fallback path).
"""
from __future__ import annotations

import functools

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from .cross_kv import KVCap


# ---- CascadeConfig.max_kv_bytes over stock's DynamicCache --------------------------------------------
class CappedLayer(DynamicLayer):
    """Stock's DynamicLayer whose growth is counted against a :class:`KVCap` before it happens."""

    def __init__(self, cap: KVCap, what: str):
        super().__init__()
        self._cap, self._what = cap, what

    def update(self, key_states, value_states, *args, **kwargs):
        self._cap.check(key_states.nbytes + value_states.nbytes, self._what)
        return super().update(key_states, value_states, *args, **kwargs)


def capped_dynamic_cache(cap: KVCap, what: str) -> DynamicCache:
    """A DynamicCache of :class:`CappedLayer` (registered with ``cap``)."""
    cache = DynamicCache()
    Cache.__init__(cache, layer_class_to_replicate=functools.partial(CappedLayer, cap, what))
    cap.caches.append(cache)
    return cache


# ---- decoder self-attention where it stays dense -----------------------------------------------------
class ReorderedLayer(DynamicLayer):
    """A DynamicLayer for beam search without its two copies per step: stock's ``reorder_cache`` copies
    the whole K/V (``index_select``) and the next ``update`` copies it again (``torch.cat``) into a new
    tensor. Here K and V each live time-major in a preallocated buffer ``[capacity, rows, H, D]``; a
    reorder is only noted (composed with a pending one) and the next ``update`` applies it as one
    ``index_select`` of a contiguous run of ``t`` positions into a spare buffer shared by all layers of
    the cache (which then takes this layer's old buffer as the next spare), and writes the new positions
    in place. The model gets ``[rows, H, t, D]`` views of the buffers: stock's values, and sdpa gives the
    same result on the strided view as on a contiguous copy (tests compare tokens with stock). Any other
    operation (crop, batch_select_indices, ...) first turns the layer back into a plain DynamicLayer."""

    def __init__(self, capacity: int = 64, spares: dict | None = None, cap: KVCap | None = None):
        super().__init__()
        self.capacity = max(int(capacity), 1)
        self._cap = cap                 # max_kv_bytes: checked before each buffer is allocated
        self._spares = {} if spares is None else spares     # (shape, dtype, device) -> a free buffer
        self._buffers = None          # [K buffer, V buffer]
        self._pending = None          # a reorder not applied yet

    def _settle(self) -> None:
        """Back to a plain DynamicLayer: the pending reorder applied, K/V contiguous tensors of their own."""
        if self._buffers is not None or self._pending is not None:
            if self.is_initialized and self.keys is not None and self.keys.numel():
                keys, values = self.keys, self.values
                if self._pending is not None:
                    keys, values = keys.index_select(0, self._pending), values.index_select(0, self._pending)
                self.keys, self.values = keys.contiguous(), values.contiguous()
            self._buffers = self._pending = None

    def _spare(self, like: torch.Tensor) -> torch.Tensor:
        key = (tuple(like.shape), like.dtype, like.device)
        spare = self._spares.pop(key, None)
        if spare is None and self._cap is not None:
            self._cap.check(like.nbytes, _DENSE_SELF)
        return like.new_empty(like.shape) if spare is None else spare

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        past, new = self.get_seq_length(), key_states.shape[-2]
        rows = key_states.shape[0]
        buffers = self._buffers
        if buffers is None or buffers[0].shape[0] < past + new or buffers[0].shape[1] != rows:
            self._settle()
            if buffers is not None:       # outgrown: the spare of the old shape is no use any more
                self._spares.pop((tuple(buffers[0].shape), buffers[0].dtype, buffers[0].device), None)
            capacity = max(self.capacity, past + new) if buffers is None else max(self.capacity, 2 * (past + new))
            shape = (capacity, rows, key_states.shape[1], key_states.shape[3])
            if self._cap is not None:
                self._cap.check(2 * int(np.prod(shape)) * key_states.element_size(), _DENSE_SELF)
            buffers = self._buffers = [key_states.new_empty(shape), value_states.new_empty(shape)]
            if past:
                buffers[0][:past].copy_(self.keys.permute(2, 0, 1, 3))
                buffers[1][:past].copy_(self.values.permute(2, 0, 1, 3))
        elif self._pending is not None:
            for i, current in enumerate(buffers):    # one copy per step: the rows' histories into a spare buffer
                spare = self._spare(current)
                torch.index_select(current[:past], 1, self._pending, out=spare[:past])
                buffers[i] = spare
                self._spares[(tuple(current.shape), current.dtype, current.device)] = current
        self._pending = None
        keys, values = buffers
        keys[past:past + new].copy_(key_states.permute(2, 0, 1, 3))
        values[past:past + new].copy_(value_states.permute(2, 0, 1, 3))
        self.keys, self.values = keys[:past + new].permute(1, 2, 0, 3), values[:past + new].permute(1, 2, 0, 3)
        return self.keys, self.values

    def reorder_cache(self, beam_idx) -> None:
        if self.get_seq_length() > 0:
            beam_idx = beam_idx.to(self.keys.device)
            self._pending = beam_idx.clone() if self._pending is None else self._pending.index_select(0, beam_idx)

    def crop(self, *args, **kwargs):
        self._settle()
        return super().crop(*args, **kwargs)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._settle()
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices) -> None:
        self._settle()
        super().batch_select_indices(indices)

    def reset(self) -> None:
        self._buffers = self._pending = None
        self._spares.clear()
        super().reset()


class ReorderedCache(DynamicCache):
    """The decoder self-attention cache where it is not paged (see ``seq2seq_models.paged_self_attention``): a
    DynamicCache of :class:`ReorderedLayer` sized for the call's ``max_length``, one copy of the K/V per
    beam step instead of two, and one spare buffer for all layers (about stock's memory at the last step)."""

    def __init__(self, capacity: int = 64, cap: KVCap | None = None):
        Cache.__init__(self, layer_class_to_replicate=functools.partial(ReorderedLayer, capacity, {}, cap))
        if cap is not None:
            cap.caches.append(self)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K/V held now: every layer's buffers and the spares they share (what ``KVCap`` counts)."""
        spares = self.layers[0]._spares if self.layers else {}
        return sum(b.nbytes for l in self.layers for b in (l._buffers or ())) + sum(b.nbytes for b in spares.values())


_DENSE_SELF = "the decoder's self-attention K/V (a dense cache: the K/V of every beam)"


def self_attention_cache(device: torch.device, generation_config, cap: KVCap | None = None) -> DynamicCache:
    """The dense self-attention cache: :class:`ReorderedCache` on the CPU (sized for the generate call's
    ``max_length``), stock's DynamicCache elsewhere (the strided K/V views are not yet checked against stock
    on the GPU kernels); its allocations counted against ``cap`` (max_kv_bytes) where one is set."""
    if device.type != "cpu":
        return DynamicCache() if cap is None else capped_dynamic_cache(cap, _DENSE_SELF)
    return ReorderedCache(min(int(getattr(generation_config, "max_length", None) or 64), 4096), cap)
