"""The decoder self-attention cache of an encoder-decoder call where it stays dense (not a paged CascadeCache).

That is for the relative-bias families (T5: the bias is added to the scores of every key, which the paged kernels
do not take) and for one-token decoder prompts on the CPU (``seq2seq_models.paged_self_attention`` decides).

- Where the call's decode steps run on the graph runner (a GPU, or ``cuda_graphs="eager"``), the relative-bias
  families run on :class:`StaticSelfAttentionCache`: K/V buffers of a fixed room (widened geometrically up to the
  call's max_length), written at a device position, the beams' histories followed by a gather table on the device,
  the step's length and mask device tensors: a fixed-shape step that a CUDA graph replays. In the whole step on the
  device (hf_cascade.whole_step) :class:`DenseHold` holds it: each step's position, beam reorder and mask computed on
  the device (:func:`advance`), the host taking it back at the end of the room.
- Otherwise on the CPU, :class:`ReorderedCache` replaces stock's DynamicCache: one copy of the self K/V per beam step
  instead of stock's two. Elsewhere stock's DynamicCache, its growth counted against ``max_kv_bytes`` where one is
  set (:func:`capped_dynamic_cache`, also used for both halves of stock's cache on the dense fallback path).
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import NamedTuple

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

from ..config import CascadeConfig
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


# ---- the relative-bias families' self-attention on the graph runner's static path ---------------------------------
class _StaticPlan:
    """What the graph runner reads of a step's plan: the step is static (shapes and buffers fixed for the call), and
    there is nothing to upload (the cache wrote the step's device tensors in ``prepare_step``)."""

    static = True

    @staticmethod
    def on(device) -> None:
        return None


class _DenseAttention(NamedTuple):
    """The attention a static dense step runs, as the runner checks a step's backends: transformers' sdpa over the
    buffers, with the bias and the step's mask added (device ops only: capturable)."""

    name: str
    graph_safe: bool


_DENSE_SDPA = _DenseAttention("dense sdpa (relative position bias)", True)


@dataclasses.dataclass(frozen=True)
class StaticLayout:
    """The layout a static step's graph bakes in: ``serial`` changes when the buffers (their room) or the reorder mode
    change (the runner then captures again)."""

    serial: tuple
    room: int


class StaticStep:
    """One decode step of a :class:`StaticSelfAttentionCache`, as the graph runner handles a CascadeCache's
    :class:`~hf_cascade.context.StepContext`: ``written`` (the layers that stored their K/V), ``backends`` (what ran:
    the dense sdpa, and cross-attention's backends, which record themselves here), :meth:`finish` (the step is over:
    the cache's length advances, once), :meth:`rewind` (the layers write again: a capture re-runs the step)."""

    def __init__(self, cache: "StaticSelfAttentionCache"):
        self._cache = weakref.ref(cache)
        self.plan = _StaticPlan()
        self.written: dict[int, bool] = {}
        # no layer waits for the cascade attention: a step context that reaches it (a compiled forward's argument)
        # sends the layers to the dense path, which a compiled static step refuses (the runner then runs uncompiled)
        self.unread: frozenset = frozenset()
        self.backends: dict = {"self": _DENSE_SDPA}
        self.finished = False
        self._advanced = False

    def rewind(self) -> None:
        self.written.clear()
        self.backends = {"self": _DENSE_SDPA}
        self.finished = False

    def finish(self) -> None:
        self.finished = True
        cache = self._cache()
        if not self._advanced and cache is not None:
            self._advanced = True
            cache._advance()


class _StaticSelfLayer(CacheLayerMixin):
    """One layer of a :class:`StaticSelfAttentionCache` (its buffers and lengths live in the cache)."""

    is_compileable = False      # no auto-compile by generate: the graph runner captures the step
    is_sliding = False
    storage = None              # no paged pool: the runner keys its graph on the cache's layout instead

    def __init__(self, cache: "StaticSelfAttentionCache", layer_idx: int):
        super().__init__()
        self._cache, self.layer_idx = weakref.ref(cache), layer_idx

    def lazy_initialization(self, key_states, value_states) -> None:
        self._cache()._allocate(key_states)

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cache().update(key_states, value_states, self.layer_idx, *args, **kwargs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache().get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        return self._cache().get_seq_length(self.layer_idx)

    def get_max_length(self) -> int:
        return self._cache().capacity

    def reorder_cache(self, beam_idx):
        raise RuntimeError("a StaticSelfAttentionCache layer is reordered by its cache (cache.reorder_cache), never "
                           "alone.")


class StaticSelfAttentionCache(Cache):
    """The decoder self-attention of a relative-bias family (T5, mT5, UMT5) in a form a CUDA graph replays.

    Each layer keeps K and V in buffers ``[rows, room, heads, head_dim]``, zero where nothing was written. The room
    follows the tokens, as the decoder-only layouts do: 64 positions first (or the decoder prompt's), doubled when a
    row would pass it, and the call's capacity (its ``max_length``) at most, taken whole once a doubling would come
    within a quarter of it; a widening copies the buffers (a new layout: the runner captures its step again). A decode
    step the graph runner serves (:meth:`prepare_step` ... its ``finish``) is static:

    - :meth:`prepare_step` writes the step's device state once, outside the graph: the write position (the length
      before the step, which the model's ``get_seq_length`` reads: its bias is computed on the device from it) and the
      step's mask ``[rows or 1, 1, 1, room]`` (not a decoder-prompt pad, not past the position: the patched decoder
      stack takes it, ``hf_cascade.patches.t5_mask``);
    - every layer writes its new K/V at that position (``index_copy_``) and returns the whole room; the model's sdpa
      adds the bias and the mask (the dtype's minimum on masked keys: they weigh exactly 0);
    - a beam reorder copies no K/V: the gather table ``[rows, room]`` (for each row and position, the flat index of
      the buffer row and position that hold its token) has its rows permuted on the device over the positions
      written; a layer then gathers its rows' histories into one spare pair shared by all layers (one
      ``index_select`` per K and V: what stock's reorder copies, without stock's second copy in ``torch.cat``).

    In the whole step on the device (:class:`DenseHold`) the device writes the position and the mask (:func:`advance`,
    the same values) and :meth:`begin_planned_step` begins the step; the host's counts follow when it takes the cache
    back.

    Any other forward (the decoder prompt's, or every step where the runner is off) runs on the host's lengths,
    returning the written positions only, as stock's DynamicCache would, with stock's mask.

    Memory: ``2 x layers x rows x room x heads x head_dim`` elements, plus one spare pair
    ``2 x rows x room x heads x head_dim`` once beams are reordered; stock's DynamicCache holds
    ``2 x layers x rows x length x heads x head_dim`` (and copies it twice per beam step).
    """

    FIRST_ROOM = 64

    def __init__(self, rows: int, num_layers: int, capacity: int, cascade_config: CascadeConfig,
                 prompt_mask: torch.Tensor | None = None, cap: KVCap | None = None):
        if capacity < 1:
            raise ValueError(f"StaticSelfAttentionCache needs a capacity of at least one token, got {capacity}.")
        super().__init__(layers=[_StaticSelfLayer(self, i) for i in range(num_layers)])
        self.rows, self.capacity, self.cascade_config = int(rows), int(capacity), cascade_config
        self._prompt_mask = prompt_mask      # [rows, prompt] of a padded decoder prompt (0: a pad), else None
        self._cap = cap
        if cap is not None:
            cap.caches.append(self)
        self._stored = [0] * num_layers      # tokens each layer holds (a host forward advances them layer by layer)
        self._step: StaticStep | None = None
        self._serial = 0
        self.reordered = False               # a beam reorder happened: layers read through the gather table
        self._release()

    def _release(self) -> None:
        self.room = 0                        # positions per row the buffers hold now
        self._keys = self._values = None     # per layer: [rows, room, heads, head_dim]
        self._spares = None                  # (K, V) gather targets shared by all layers, once reordered
        # [rows, room] int64: row * room + position of the buffer slot holding each row's token at each position (its
        # own, until a reorder permutes the rows of the positions written)
        self._gather = None
        self._host_gather = None             # (width, flat index) of a host forward's gather
        self._valid = None                   # [rows or 1, room] bool: not a decoder-prompt pad
        self._columns = None                 # [room] int64
        self._position = None                # [1] int64: a static step's write position
        self._step_mask = None               # [rows or 1, 1, 1, room] bool

    # ---- buffers -----------------------------------------------------------------------------------------------
    def _allocate(self, key_states: torch.Tensor) -> None:
        """The first K/V: the buffers' heads, dims, dtype and device, and room for this forward's tokens."""
        rows = key_states.shape[0]
        if rows != self.rows:
            raise ValueError(f"StaticSelfAttentionCache was made for {self.rows} rows, got K/V of {rows}.")
        self._position = torch.zeros(1, dtype=torch.long, device=key_states.device)
        self._widen(key_states.shape[2], key_states)

    def _next_room(self, needed: int) -> int:
        if needed > self.capacity:
            raise ValueError(f"The decoder sequences reached {needed} tokens, past the {self.capacity} this call's "
                             "static self-attention cache holds (generate's max_length); raise max_length.")
        room = min(self.capacity, max(needed, 2 * self.room if self.room else self.FIRST_ROOM))
        return self.capacity if 4 * self.capacity <= 5 * room else room

    def _widen(self, needed: int, like: torch.Tensor) -> None:
        """Room for ``needed`` positions per row: every buffer (and the spare pair, the gather table, the masks)
        widened, what was written copied (outside any captured step: a new layout)."""
        old, room = self.room, self._next_room(needed)
        rows, heads, dim = self.rows, like.shape[1], like.shape[3]
        shape, device = (rows, room, heads, dim), like.device
        copies = 2 * len(self.layers) + (2 if self.reordered else 0)
        if self._cap is not None:
            self._cap.check(copies * rows * (room - old) * heads * dim * like.element_size(), _DENSE_SELF)
        # zeros, not garbage: a masked key still enters q.k (then weighs 0), and NaN bits would poison it
        keys, values = [like.new_zeros(shape) for _ in self.layers], [like.new_zeros(shape) for _ in self.layers]
        gather = torch.arange(rows * room, device=device).view(rows, room)
        valid = torch.ones((1 if self._prompt_mask is None else rows, room), dtype=torch.bool, device=device)
        if old:
            for new, current in zip(keys + values, self._keys + self._values):
                new[:, :old] = current
            gather[:, :old] = self._gather // old * room + self._gather % old
            valid[:, :old] = self._valid
        elif self._prompt_mask is not None:
            valid[:, :self._prompt_mask.shape[1]] = self._prompt_mask.to(device=device, dtype=torch.bool)
        self._keys, self._values, self._gather, self._valid, self.room = keys, values, gather, valid, room
        for layer, k, v in zip(self.layers, keys, values):
            layer.keys, layer.values, layer.is_initialized = k, v, True
        self._spares = (like.new_empty(shape), like.new_empty(shape)) if self.reordered else None
        self._columns = torch.arange(room, device=device)
        self._step_mask = torch.zeros((valid.shape[0], 1, 1, room), dtype=torch.bool, device=device)
        self._host_gather = None
        self._serial += 1

    def _check_fits(self, key_states: torch.Tensor, layer_idx: int) -> None:
        keys = self._keys[layer_idx]
        rows, heads, _, dim = key_states.shape
        if (rows, heads, dim) != (keys.shape[0], keys.shape[2], keys.shape[3]) or key_states.dtype != keys.dtype \
                or key_states.device != keys.device:
            raise ValueError(f"StaticSelfAttentionCache layer {layer_idx} holds {keys.shape[0]} rows x {keys.shape[2]} "
                             f"heads x {keys.shape[3]} dims in {keys.dtype} on {keys.device}, got K/V "
                             f"{tuple(key_states.shape)} in {key_states.dtype} on {key_states.device}: call reset() "
                             "or use a new cache.")

    @property
    def kv_bytes(self) -> int:
        """Bytes of K/V held now (the layers' buffers and the spare pair), what ``KVCap`` counts."""
        tensors = [*(self._keys or ()), *(self._values or ()), *(self._spares or ())]
        return sum(t.nbytes for t in tensors)

    # ---- transformers' Cache API -------------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Store this forward's K/V of layer ``layer_idx``; returns every row's K/V ``[rows, heads, width, dim]``: the
        whole room in a static step, the written positions otherwise."""
        if self._keys is None:
            self._allocate(key_states)
        self._check_fits(key_states, layer_idx)
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        step = self._step
        if step is not None and not step.finished and key_states.shape[2] == 1:
            # device ops only: the position is a device tensor the step set (what a replayed graph runs)
            keys.index_copy_(1, self._position, key_states.transpose(1, 2))
            values.index_copy_(1, self._position, value_states.transpose(1, 2))
            step.written[layer_idx] = True
            return self._read(layer_idx, self.room, self._gather.view(-1))
        start = self._stored[layer_idx]
        end = start + key_states.shape[2]
        if end > self.room:
            self._widen(end, key_states)
            keys, values = self._keys[layer_idx], self._values[layer_idx]
        keys[:, start:end] = key_states.transpose(1, 2)
        values[:, start:end] = value_states.transpose(1, 2)
        self._stored[layer_idx] = end
        return self._read(layer_idx, end, self._host_index(end) if self.reordered else None)

    def _read(self, layer_idx: int, width: int, gather: torch.Tensor | None):
        """Layer ``layer_idx``'s first ``width`` positions of every row, ``[rows, heads, width, dim]``: views of its
        buffers while no beam was reordered; gathered through the gather table into the spare pair after."""
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        if not self.reordered:
            return keys[:, :width].transpose(1, 2), values[:, :width].transpose(1, 2)
        rows, _, heads, dim = keys.shape
        out = []
        for buffer, spare in zip((keys, values), self._spares):
            target = spare.view(-1, heads * dim)[:rows * width]
            torch.index_select(buffer.view(-1, heads * dim), 0, gather, out=target)
            out.append(target.view(rows, width, heads, dim).transpose(1, 2))
        return out[0], out[1]

    def _host_index(self, width: int) -> torch.Tensor:
        """The flat gather index of a host forward's first ``width`` positions (built once per width and reorder)."""
        if self._host_gather is None or self._host_gather[0] != width:
            self._host_gather = (width, self._gather[:, :width].reshape(-1))
        return self._host_gather[1]

    def get_seq_length(self, layer_idx: int = 0):
        """Tokens stored before this forward: in a static step the device tensor of its position (the model's bias is
        computed from it on the device), otherwise the host's count."""
        if self._step is not None and not self._step.finished:
            return self._position[0]
        return self._stored[layer_idx] if layer_idx < len(self._stored) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._stored[layer_idx] + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._stored[layer_idx]

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self._stored[0] > 0

    @property
    def batch_size(self) -> int:
        return self.rows

    @property
    def logical_length(self) -> int:
        """Tokens every row holds (pads of a padded decoder prompt included, as stock's positions count them)."""
        return self._stored[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam reorder: row i continues old row ``beam_idx[i]``. Device ops on the gather table (and the rows'
        prompt masks), no K/V copied and no host read."""
        length = self._stored[0]
        if self._keys is None or length == 0:
            return
        index = beam_idx.to(self._gather.device)
        self._gather[:, :length] = self._gather[:, :length].index_select(0, index)
        if self._valid.shape[0] > 1:
            self._valid.copy_(self._valid.index_select(0, index))
        self._host_gather = None
        self._read_through_gather()

    def _read_through_gather(self) -> None:
        """From now on the layers read their rows' histories through the gather table (the spare pair made: a new
        layout)."""
        if not self.reordered:
            keys = self._keys[0]
            if self._cap is not None:
                self._cap.check(2 * keys.nbytes, _DENSE_SELF)
            self._spares = (torch.empty_like(keys), torch.empty_like(keys))
            self.reordered = True
            self._serial += 1

    def _unsupported(self, what: str):
        raise NotImplementedError(f"{what} is not supported on the static self-attention cache of a T5-family "
                                  "generate call; load the model with attn_implementation='sdpa' for it.")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("crop (assisted or speculative decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._unsupported("batch_select_indices")

    def reset(self) -> None:
        """Drop the buffers (the call is over)."""
        for layer in self.layers:
            layer.keys = layer.values = None
            layer.is_initialized = False
        self._stored = [0] * len(self.layers)
        self._step, self.reordered = None, False
        self._release()

    # ---- the graph runner's static step (the interface it uses of a CascadeCache) -------------------------------
    def prepare_step(self, num_rows: int, q_len: int = 1) -> StaticStep:
        """Begin a static decode step before the forward: its device state written once (the position and the mask),
        read by every layer."""
        length = self._stored[0]
        if q_len != 1 or num_rows != self.rows or self._keys is None or length == 0:
            raise RuntimeError(f"a static step of StaticSelfAttentionCache takes one new token for each of its "
                               f"{self.rows} rows after the decoder prompt; got {num_rows} x {q_len} at {length}.")
        if length >= self.room:
            # before the runner keys its graph: a new layout (the buffer as K/V states are shaped: [rows, H, room, D])
            self._widen(length + 1, self._keys[0].transpose(1, 2))
        self._position.fill_(length)
        torch.logical_and(self._valid, self._columns <= length, out=self._step_mask.view(self._valid.shape))
        self._step = StaticStep(self)
        return self._step

    def _advance(self) -> None:
        """A static step finished: every layer wrote one token per row."""
        self._stored = [stored + 1 for stored in self._stored]

    @property
    def device_hold(self) -> type:
        """How the whole step on the device (hf_cascade.whole_step) holds this cache: :class:`DenseHold`."""
        return DenseHold

    def begin_planned_step(self, device=None, copies: bool = True) -> StaticStep:
        """Begin a static step whose position and mask the device wrote (:func:`advance`, the whole step on the
        device): nothing is written here, and the host's counts stay until :meth:`DenseHold.take_back`."""
        if self._keys is None:
            raise RuntimeError("begin_planned_step needs the buffers of a decode in progress")
        self._step = StaticStep(self)
        return self._step

    def static_step_mask(self) -> torch.Tensor | None:
        """The self-attention mask of the static step in progress ``[rows or 1, 1, 1, room]`` (bool: True where a key
        counts), or None outside one (the model builds stock's from the decoder mask)."""
        if self._step is None or self._step.finished:
            return None
        return self._step_mask

    @property
    def step(self) -> StaticStep | None:
        return self._step

    def rewind_step(self) -> None:
        if self._step is not None:
            self._step.rewind()

    def end_step(self) -> None:
        self._step = None

    @property
    def layout(self) -> StaticLayout:
        return StaticLayout((self._serial, self.reordered), self.room)

    def begin_decode(self, max_length: int) -> None:
        if max_length > self.capacity:
            raise ValueError(f"generate's max_length={max_length} exceeds the {self.capacity} tokens of this call's "
                             "static self-attention cache.")

    def end_decode(self) -> None:
        pass


def static_self_attention_cache(rows: int, num_layers: int, generation_config, cascade_config: CascadeConfig,
                                decoder_mask: torch.Tensor | None, cap: KVCap | None) -> StaticSelfAttentionCache:
    """The relative-bias families' self-attention cache for a call whose decode steps run on the graph runner, sized
    for its ``max_length``; a decoder prompt with pads masks them in every step."""
    padded = decoder_mask is not None and not bool(decoder_mask.all())
    capacity = int(getattr(generation_config, "max_length", None) or 0)
    if decoder_mask is not None:
        capacity = max(capacity, decoder_mask.shape[1] + 1)
    return StaticSelfAttentionCache(rows, num_layers, max(capacity, 2), cascade_config,
                                    decoder_mask if padded else None, cap)


# ---- the whole decode step on the device (hf_cascade.whole_step) over a StaticSelfAttentionCache --------------------
@dataclasses.dataclass
class DenseDeviceState:
    """The tensors of a :class:`StaticSelfAttentionCache` that a device step advances: the cache's own, so that the
    layers of a captured step read them where the device wrote them."""

    position: torch.Tensor          # int64 [1]: the last position written; a step's advance moves it to its own
    valid: torch.Tensor             # bool [rows or 1, room]: not a decoder-prompt pad
    step_mask: torch.Tensor         # bool [rows or 1, 1, 1, room]: the step's self-attention mask
    columns: torch.Tensor           # int64 [room]
    gather: torch.Tensor | None     # int64 [rows, room] where beams reorder rows (None: greedy, sampling)


def advance(state: DenseDeviceState, parents: torch.Tensor) -> None:
    """One device step's bookkeeping, device ops only: the write position moved on; the beam reorder by ``parents``
    (int64 [rows]: row i continues row ``parents[i]``) of the gather table's written positions and of a padded decoder
    prompt's rows; the step's mask (not a pad, not past the position). The values of the host's ``reorder_cache`` and
    ``prepare_step``: positions at and past the write position keep each row's own slot, as the host leaves them (a
    host step after the device's writes at its position through that slot)."""
    state.position.add_(1)
    if state.gather is not None:
        written = state.columns < state.position
        state.gather.copy_(torch.where(written, state.gather.index_select(0, parents), state.gather))
        if state.valid.shape[0] > 1:
            state.valid.copy_(state.valid.index_select(0, parents))
    state.step_mask.view(state.valid.shape).copy_(state.valid & (state.columns <= state.position))


class DenseHold:
    """A :class:`StaticSelfAttentionCache` while the device runs its decode steps: the interface
    ``hf_cascade.whole_step.WholeStepLoop`` uses of a held cache (see ``whole_step.DeviceHold``).

    The device holds the cache from a host step on, for the steps its buffers' room allows (``room`` positions per row
    minus those written): each step's :func:`advance` moves the position, follows the beams and writes the mask, the
    layers write at the position (:meth:`StaticSelfAttentionCache.begin_planned_step`). Nothing can overflow between
    two checks (the host bounds the steps by the room), so there are no flags. At the end of the room (or of the call)
    the host takes the cache back: its counts advance by the steps run, and the next host step (a static step run
    eagerly, :meth:`host_forward`) widens the buffers."""

    advance_fn = staticmethod(advance)    # what the loop runs (compiled with CascadeConfig(compile=True))
    copies = True               # (a dense cache copies no blocks: begin_planned_step ignores it)
    positions_in_cache = True   # the decoder's positions are the cache's device position (its relative bias)
    flags = None

    def __init__(self, cache: StaticSelfAttentionCache, tensors: DenseDeviceState, room: int, advance_fn,
                 replay_refusal):
        self.cache, self.tensors, self.room, self._advance = cache, tensors, room, advance_fn
        self._replay_refusal = replay_refusal
        self.steps = 0
        tracked = [*cache._keys, *cache._values, *(cache._spares or ()), *(t for t in vars(tensors).values()
                                                                            if t is not None)]
        # a captured step reads and writes these tensors by address
        self.key = ("dense", cache.layout.serial, tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in tracked))

    @classmethod
    def take(cls, loop) -> tuple["DenseHold | None", str | None]:
        """The cache of ``loop`` (a WholeStepLoop after a host step) held by the device, or ``(None, None)`` where its
        buffers have no room for another step (the next host step widens them)."""
        cache = loop.cache
        length = cache.logical_length
        room = cache.room - length
        if room < 1 or cache._keys is None:
            return None, None
        if loop.beam:
            cache._read_through_gather()      # every device step may reorder the rows
        cache._position.fill_(length - 1)
        tensors = DenseDeviceState(cache._position, cache._valid, cache._step_mask, cache._columns,
                                   cache._gather if cache.reordered else None)
        return cls(cache, tensors, room, loop.advance_fn, loop.runner.replay_refusal), None

    @staticmethod
    def host_forward(cache: StaticSelfAttentionCache, forward, inputs: dict, first: bool):
        """One step on the host: the decoder prompt's forward as stock runs it (``first``), later a static step run
        eagerly (its buffers widened where the rows reached their room)."""
        if first:
            return forward(**inputs)
        step = cache.prepare_step(cache.rows, 1)
        try:
            out = forward(**inputs)
            step.finish()
        finally:
            cache.end_step()
        return out

    def advance(self, parents: torch.Tensor, done: torch.Tensor) -> None:
        # (steps after the call finished write on within the room the host counted: the cache is dropped after)
        self._advance(self.tensors, parents)

    def count_step(self) -> None:
        self.steps += 1

    def capture_refusal(self, step: StaticStep) -> str | None:
        """Why a device step that ran as ``step`` cannot be captured: the graph runner's answer (every layer wrote, each
        backend it ran can be captured: the cross-attention's is known only once a static step ran, the warm-up's)."""
        return self._replay_refusal(step)

    def take_back(self) -> None:
        """The host's counts past the device steps run (every layer wrote one token per row in each)."""
        cache = self.cache
        cache.end_step()
        cache._stored = [stored + self.steps for stored in cache._stored]
        cache._host_gather = None
