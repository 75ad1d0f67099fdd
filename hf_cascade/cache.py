"""CascadeCache: the transformers Cache API over a paged, copy-on-write block pool.

All layers share one block bookkeeping (:mod:`hf_cascade.blocks`); each layer owns a KV pool
``[num_blocks, 2, block_size, kv_heads, head_dim]`` on the device and dtype of its first K/V
(:mod:`hf_cascade.memory`). A forward step is planned once, at the first layer's ``update``
(:mod:`hf_cascade.plan`), and every layer then writes its new K/V with a few index ops. The
attention function finds the layer and the step's plan through :func:`take_handoff`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .blocks import BlockManager
from .config import CascadeConfig
from .memory import make_storage
from .plan import StepPlan, build_step_plan

# update() -> attention hand-off. transformers <5.24 gives the attention function neither the cache
# nor the layer index, so the layer that just wrote K/V leaves a note here for the attention call
# that follows it in the same thread.
_handoff = threading.local()


@dataclass
class Handoff:
    layer: "CascadeLayer"
    key: torch.Tensor
    value: torch.Tensor
    plan: StepPlan
    step_id: int
    first_in_step: bool         # the first layer written this step (per-step checks run once)


def take_handoff(layer_idx: int) -> Handoff | None:
    """The note left by the CascadeCache layer ``layer_idx`` just updated, if any (consumed)."""
    note = getattr(_handoff, "note", None)
    if note is None or note.layer.layer_idx != layer_idx:
        return None
    _handoff.note = None
    return note


@dataclass
class CacheStats:
    """Memory accounting of a CascadeCache (bytes are K and V of all layers)."""

    kv_bytes_in_use: int        # K/V bytes in blocks held by some row
    peak_kv_bytes_in_use: int   # the largest kv_bytes_in_use since the cache was created or reset
    kv_bytes_reserved: int      # capacity of the layers' pools
    blocks_in_use: int
    blocks_shared: int          # blocks held by more than one row
    tokens_stored: int          # distinct tokens physically stored
    tokens_logical: int         # tokens a dense per-row cache would hold (rows x sequence length, pads included)


class CascadeLayer(CacheLayerMixin):
    """One layer's KV pool. Bookkeeping lives in the owning :class:`CascadeCache`."""

    is_compileable = False      # no auto-compile and no 4D masks from generate
    is_sliding = False

    def __init__(self, cache: "CascadeCache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.storage = None   # a memory.make_storage(...) object, created with the first K/V

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, num_heads, _, head_dim = key_states.shape
        block_shape = (2, self.cache.block_size, num_heads, head_dim)
        self.cache._set_block_cap(block_shape, key_states.dtype)
        kept = self.storage
        if kept is None or (kept.block_shape, kept.dtype, kept.device) != (block_shape, key_states.dtype,
                                                                           key_states.device):
            config = self.cache.cascade_config
            keep = config.keep_kv_bytes // max(1, len(self.cache.layers))
            self.storage = make_storage(block_shape, key_states.dtype, key_states.device, config.memory,
                                        self.cache.blocks.max_blocks, keep_bytes=keep)
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True

    @property
    def pool(self) -> torch.Tensor:
        """``[num_blocks, 2, block_size, kv_heads, head_dim]``."""
        return self.storage.tensor

    def update(self, key_states, value_states, *args, **kwargs):
        return self.cache.update(key_states, value_states, self.layer_idx)

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, plan: StepPlan) -> None:
        """Copy-on-write copies, then this step's new tokens into their slots."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        _, num_heads, _, head_dim = key_states.shape
        _, _, pool_heads, pool_dim = self.storage.block_shape
        if (num_heads, head_dim, key_states.dtype) != (pool_heads, pool_dim, self.storage.dtype):
            raise ValueError(
                f"CascadeCache layer {self.layer_idx} stores K/V with {pool_heads} heads x {pool_dim} dims in "
                f"{self.storage.dtype}, but got {num_heads} x {head_dim} in {key_states.dtype}: the cache was filled "
                "by another model or config. Call cache.reset() or use a new CascadeCache.")
        pool = self.storage.ensure(self.cache.blocks.capacity)
        dp = plan.on(pool.device)
        if dp.copy_src.numel():
            pool[dp.copy_dst] = pool[dp.copy_src]
        for kv, states in ((0, key_states), (1, value_states)):
            flat = states.transpose(1, 2).reshape(-1, num_heads, head_dim)      # [R*q, H, D], row-major
            if dp.src_index is not None:
                flat = flat.index_select(0, dp.src_index)
            pool[dp.write_block, kv, dp.write_offset] = flat.to(pool.device)

    def get_seq_length(self) -> int:
        return self.cache.logical_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.logical_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Give the pool's memory back (a vmm pool may keep ``keep_kv_bytes`` mapped for the next call);
        the next K/V may come with another shape."""
        if self.storage is not None:
            self.storage.release()
            if self.storage.nbytes == 0:
                self.storage = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx):
        raise RuntimeError("CascadeLayer is reordered by its CascadeCache (cache.reorder_cache), never alone.")


class CascadeCache(Cache):
    """A paged KV cache whose rows share blocks: prompts stored once for all their beams/samples.

    Args:
        config: the model config (sets the number of layers up front; needed with ``max_kv_bytes``).
            Without it, layers are added as ``update`` first sees them.
        cascade_config: a :class:`CascadeConfig` (backend, block size, memory policy).
    """

    def __init__(self, config=None, cascade_config: CascadeConfig | None = None):
        self.cascade_config = cascade_config or CascadeConfig()
        if self.cascade_config.max_kv_bytes is not None and config is None:
            raise ValueError("CascadeCache(max_kv_bytes=...) needs the model config: CascadeCache(model.config, ...).")
        num_layers = config.get_text_config(decoder=True).num_hidden_layers if config is not None else 0
        super().__init__(layers=[CascadeLayer(self, i) for i in range(num_layers)])
        self.block_size = self.cascade_config.block_size
        self.blocks = BlockManager(self.block_size)
        self.logical_length = 0
        self.model_fingerprint = None        # set by the generate entry; guards reuse with another model
        self._plan: StepPlan | None = None
        self._step_id = 0
        self._layers_in_step: set[int] = set()
        self._next_write_mask: np.ndarray | None = None
        self._peak_blocks = 0
        # the running kernel backend's MIN_SAVED_TOKENS, told by the attention (0 until it has run)
        self.backend_min_saved_tokens = 0

    # ---- transformers' Cache API ------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Store this step's K/V of layer ``layer_idx``; returns them unchanged (the attention reads the pool)."""
        if self.offloading:
            raise ValueError("CascadeCache does not offload layers to the CPU.")
        while len(self.layers) <= layer_idx:
            self.layers.append(CascadeLayer(self, len(self.layers)))
        note = getattr(_handoff, "note", None)
        if note is not None and note.layer.cache is self and note.step_id == self._step_id:
            _handoff.note = None
            raise RuntimeError(
                f"The K/V that CascadeCache stored for layer {note.layer.layer_idx} were not read by the cascade "
                "attention: the model does not run attn_implementation='cascade'. Load it with "
                "attn_implementation='cascade' (after `import hf_cascade`), or use a DynamicCache.")
        if self._plan is None or layer_idx in self._layers_in_step:
            self._begin_step(key_states)
        first = not self._layers_in_step
        self._layers_in_step.add(layer_idx)
        layer = self.layers[layer_idx]
        layer.write(key_states, value_states, self._plan)
        _handoff.note = Handoff(layer, key_states, value_states, self._plan, self._step_id, first)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.logical_length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.logical_length + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.logical_length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return self.logical_length > 0

    @property
    def batch_size(self) -> int:
        return self.blocks.num_rows

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam reorder: row i becomes old row ``beam_idx[i]``. Moves block tables, copies no K/V."""
        index = np.asarray(beam_idx.detach().cpu() if isinstance(beam_idx, torch.Tensor) else beam_idx, dtype=np.int64)
        if index.size == self.blocks.num_rows and (index == np.arange(index.size)).all():
            return
        self.blocks.select(index)
        self._plan = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes ``repeats`` rows sharing its blocks (a fork; no K/V copied)."""
        self.blocks.fork(int(repeats))
        self._plan = None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens of every row (a positive value is the length to keep)."""
        remove = self.logical_length - tokens_to_remove if tokens_to_remove > 0 else -tokens_to_remove
        if remove <= 0:
            return
        if self.blocks.num_rows and remove > int(self.blocks.lengths.min()):
            raise ValueError(f"Cannot crop {remove} tokens: some row stores only {int(self.blocks.lengths.min())} "
                             "(its prompt padding is not stored).")
        self.blocks.truncate(np.full(self.blocks.num_rows, remove, dtype=np.int64))
        self.logical_length -= remove
        self._plan = None

    def reset(self) -> None:
        """Return every block to the pool and the pools' memory to the device; the cache becomes empty."""
        self.blocks.release()
        for layer in self.layers:
            layer.reset()
        self.logical_length = 0
        self.model_fingerprint = None
        self._plan, self._next_write_mask = None, None
        self._layers_in_step = set()
        self._peak_blocks = 0
        if getattr(_handoff, "note", None) is not None and _handoff.note.layer.cache is self:
            _handoff.note = None

    # ---- cascade specifics --------------------------------------------------------------------
    def set_write_mask(self, mask) -> None:
        """Only the tokens where ``mask`` [rows, q_len] is true are stored in the next forward (drops padding)."""
        mask = np.asarray(mask.detach().cpu() if isinstance(mask, torch.Tensor) else mask).astype(bool)
        self._next_write_mask = mask

    def stats(self) -> CacheStats:
        block_bytes = self._block_bytes_all_layers()
        return CacheStats(
            kv_bytes_in_use=self.blocks.blocks_in_use * block_bytes,
            peak_kv_bytes_in_use=self._peak_blocks * block_bytes,
            kv_bytes_reserved=sum(l.storage.nbytes for l in self.layers if l.storage is not None),
            blocks_in_use=self.blocks.blocks_in_use,
            blocks_shared=self.blocks.blocks_shared,
            tokens_stored=self.blocks.tokens_stored(),
            tokens_logical=self.blocks.num_rows * self.logical_length)

    @property
    def plan(self) -> StepPlan | None:
        """The plan of the step in progress (None between steps)."""
        return self._plan

    def _block_bytes_all_layers(self) -> int:
        return sum(l.storage.block_nbytes for l in self.layers if l.storage is not None)

    def _set_block_cap(self, block_shape, dtype) -> None:
        """Translate max_kv_bytes into a block cap when the first layer learns its block size."""
        cap = self.cascade_config.max_kv_bytes
        if cap is None or self.blocks.max_blocks is not None:
            return
        per_layer = torch.empty((), dtype=dtype).element_size() * int(np.prod(block_shape))
        max_blocks = cap // (per_layer * len(self.layers))
        if max_blocks < 1:
            raise ValueError(f"max_kv_bytes={cap} holds less than one block ({per_layer * len(self.layers)} bytes "
                             "over all layers); raise it or lower CascadeConfig.block_size.")
        self.blocks.max_blocks = int(max_blocks)

    def _begin_step(self, key_states: torch.Tensor) -> None:
        """Bookkeeping of one forward step, once for all layers: rows, blocks, plan."""
        num_rows, _, q_len, _ = key_states.shape
        if self.blocks.num_rows == 0 and self.logical_length == 0:
            self.blocks.add_rows(num_rows)
        elif self.blocks.num_rows != num_rows:
            if self.blocks.num_rows == 0 or num_rows % self.blocks.num_rows:
                raise ValueError(f"CascadeCache holds {self.blocks.num_rows} rows but the model was called with "
                                 f"{num_rows}; a batch can only grow by a whole factor (beams/samples per prompt).")
            self.blocks.fork(num_rows // self.blocks.num_rows)   # a prefilled batch meets its beams
        mask, self._next_write_mask = self._next_write_mask, None
        if mask is not None and mask.shape != (num_rows, q_len):
            raise ValueError(f"write mask of shape {mask.shape} does not match the step's {(num_rows, q_len)}")
        counts = mask.sum(axis=1).astype(np.int64) if mask is not None else np.full(num_rows, q_len, dtype=np.int64)
        append_plan = self.blocks.append(counts)
        self._step_id += 1
        self._layers_in_step = set()
        saved = self.cascade_config.min_saved_tokens
        self._plan = build_step_plan(self.blocks.tables(), self.blocks.lengths, counts, mask, q_len, append_plan,
                                     self.block_size, self.cascade_config.min_group_rows,
                                     self.cascade_config.min_prefix_tokens,
                                     self.backend_min_saved_tokens if saved is None else saved)
        self.logical_length += q_len
        self._peak_blocks = max(self._peak_blocks, self.blocks.blocks_in_use)
