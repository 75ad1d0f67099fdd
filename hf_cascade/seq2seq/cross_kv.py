"""The cross-attention K/V of an encoder-decoder generate call, stored once per input, and the call's K/V cap.

Stock ``generate(num_beams=k)`` projects every decoder layer's cross K/V from k copies of the encoder output
and copies it again at every beam reorder. :class:`CrossAttentionCache` projects it once per input, with the
layer's own linears, from the input's real (unpadded) encoder tokens only, into a
:class:`~hf_cascade.memory.FixedStorage` per layer (made by ``memory``, as the self-attention pools are):

- on the CPU as one K run and one V run (``CrossLayer.kv``), where an input's tokens are contiguous and sdpa
  reads them in place (:meth:`CrossAttentionCache.sdpa_in_place`); ``CrossLayer.pool`` is the same memory in
  the paged layout;
- elsewhere as the contiguous paged pool ``[num_blocks, 2, block_size, H, D]`` the GPU kernels take, read
  through a one-level cascade plan (:meth:`CrossAttentionCache.plan`: groups = inputs, no suffix).

Its reorder is a no-op (beams never move between inputs; checked every step). Its storages and plans, kept with the
model's last call, serve a later call of as many inputs whose sources need no more blocks
(:meth:`CrossAttentionCache.serves`): refilled in place, the plans' tables and lengths rewritten in their device
tensors.
:class:`CascadeEncoderDecoderCache` pairs it with the decoder's self-attention cache. :class:`KVCap` holds
``CascadeConfig.max_kv_bytes`` over all of a call's caches (these pools, a dense self-attention cache).
"""
from __future__ import annotations


import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, EncoderDecoderCache

from ..kv.blocks import PoolExhausted
from ..kv.cache import CascadeCache
from ..config import CascadeConfig
from ..kv.memory import make_fixed_storage
from ..kv.plan import ADOPT_SPAN, StepPlan
from .seq2seq_models import CrossProjection


# ---- CascadeConfig.max_kv_bytes over the caches that are not paged --------------------------------------
class KVCapExceeded(PoolExhausted):
    """A :class:`~hf_cascade.PoolExhausted` raised by :class:`KVCap` (its message says what it counted)."""


class KVCap:
    """``CascadeConfig.max_kv_bytes`` for one encoder-decoder generate call: the bytes of K/V that the call's
    caches hold (the cross K/V stored once per input, a dense self-attention cache) are counted before each of
    their allocations, and one that would pass the cap raises :class:`~hf_cascade.PoolExhausted` before it
    happens. A paged self-attention CascadeCache gets what the cross K/V leave as its own cap."""

    def __init__(self, cap: int):
        self.cap = int(cap)
        self.caches: list = []          # the call's caches, as :func:`held_bytes` counts them

    def held(self) -> int:
        return sum(held_bytes(c) for c in self.caches)

    def check(self, extra: int, what: str) -> None:
        held = self.held()              # a loop over layers, only where a cache allocates (not every step)
        if held + extra > self.cap:
            raise KVCapExceeded(
                f"CascadeConfig.max_kv_bytes={self.cap} would be exceeded: {what} needs {extra} more bytes with "
                f"{held} held already. Raise max_kv_bytes, or lower the number of beams or returned sequences, "
                "the source length or max_new_tokens.")


def held_bytes(cache) -> int:
    """Bytes of K/V ``cache`` holds now (buffers, spares and pools; a view is not counted twice)."""
    if isinstance(cache, (CascadeCache, CrossAttentionCache)):     # what their layers' storages hold
        return sum(l.storage.nbytes for l in cache.layers if l.storage is not None)
    if hasattr(cache, "kv_bytes"):          # a cache that counts its own (dense_cache.ReorderedCache)
        return cache.kv_bytes
    return sum(t.nbytes for l in getattr(cache, "layers", ()) if getattr(l, "is_initialized", False)
               for t in (l.keys, l.values) if isinstance(t, torch.Tensor))


def geometry(states: torch.Tensor) -> tuple:
    """What a filled :class:`CrossAttentionCache`'s storages and plans must share with a later call's inputs to
    serve them (besides the model; the lengths are :meth:`CrossAttentionCache.serves`'s): the number of inputs, the
    dtype and the device."""
    return states.shape[0], states.dtype, str(states.device)


def real_lengths(states: torch.Tensor, mask: torch.Tensor | None) -> np.ndarray:
    """Each input's real (unpadded) encoder tokens (one host read of ``mask``)."""
    batch, width = states.shape[:2]
    real = np.full(batch, width, np.int64) if mask is None else mask.detach().cpu().bool().sum(1).numpy()
    return real.astype(np.int64)


def repeated_inputs(states: torch.Tensor, mask: torch.Tensor | None) -> int:
    """m > 1 when the inputs come in runs of m identical ones (Whisper's best-of-m repeats its features
    before generate sees them): their cross K/V is then stored and read once per run, exactly. A cheap
    fingerprint first, then exact comparisons of the candidates only (a few host reads per call)."""
    batch = states.shape[0]
    if batch < 2:
        return 1
    fingerprint = states.reshape(batch, -1).sum(1, dtype=torch.float32).tolist()     # no float copy of states
    same = [fingerprint[i] == fingerprint[i - 1] and torch.equal(states[i], states[i - 1])
            and (mask is None or torch.equal(mask[i], mask[i - 1])) for i in range(1, batch)]
    starts = [0] + [i for i in range(1, batch) if not same[i - 1]]
    runs = {b - a for a, b in zip(starts, starts[1:] + [batch])}
    return runs.pop() if len(runs) == 1 else 1


# ---- the cross-attention K/V, once per input ------------------------------------------------------
class CrossLayer(CacheLayerMixin):
    """One decoder layer's cross K/V: a pool ``[num_blocks, 2, block_size, H, D]`` (its ``storage``, a
    FixedStorage) holding each input's real encoder tokens once. ``keys``/``values`` are placeholders
    ``[B, H, S_max, D]`` the model passes back to the attention function (T5 reads S_max from them)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: "CrossAttentionCache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.storage = self.pool = self.kv = None

    def fill(self, k: torch.Tensor, v: torch.Tensor, num_blocks: int, block: torch.Tensor, slot: torch.Tensor,
             batch: int, max_len: int) -> None:
        """``k``/``v`` [N, H, D]: the real tokens of all inputs, in order; token i goes to (block[i], slot[i])."""
        _, heads, dim = k.shape
        # CPU: K of all blocks, then V of all blocks (``kv``): an input's tokens are one contiguous run that
        # attention reads in place; ``pool`` is the same memory in the paged layout. Elsewhere ``pool`` is the
        # contiguous [num_blocks, 2, block_size, H, D] pool the GPU kernels take, and ``kv`` None.
        self.storage = make_fixed_storage((2, self.cache.block_size, heads, dim), k.dtype, k.device, num_blocks,
                                          kv_runs=in_place_layout(k.device))
        self.pool, self.kv = self.storage.tensor, self.storage.runs
        self.pool[block, 0, slot] = k
        self.pool[block, 1, slot] = v
        self._placeholders(k, batch, max_len)
        self.dtype, self.device, self.is_initialized = k.dtype, k.device, True

    def _placeholders(self, k: torch.Tensor, batch: int, max_len: int) -> None:
        _, heads, dim = k.shape
        self.keys = k.new_full((), float("nan")).expand(batch, heads, max_len, dim)
        self.values = self.keys

    def refill(self, k: torch.Tensor, v: torch.Tensor, num_blocks: int, block: torch.Tensor, slot: torch.Tensor,
               batch: int, max_len: int) -> None:
        """:meth:`fill` of another call's K/V into the same memory (a kept decode graph reads this pool by address),
        nothing allocated: ``block``/``slot`` inside the pool's ``num_blocks``; the blocks and slots it leaves are never
        read (the plan's lengths end before them). The placeholders stay unless the call's inputs are wider."""
        _, heads, dim = k.shape
        pool = self.pool
        if pool is None or tuple(pool.shape) != (num_blocks, 2, self.cache.block_size, heads, dim) \
                or pool.dtype != k.dtype or pool.device != k.device:
            raise RuntimeError("hf_cascade internal error: cross-attention K/V refilled in place into a storage of "
                               "another geometry; please report it")
        pool[block, 0, slot] = k
        pool[block, 1, slot] = v
        if self.keys.shape[2] < max_len:
            self._placeholders(k, batch, max_len)

    def lazy_initialization(self, key_states, value_states):
        raise RuntimeError("CrossAttentionCache is filled by hf_cascade's generate entry, never by the model.")

    def update(self, *args, **kwargs):
        self.lazy_initialization(None, None)

    def get_seq_length(self) -> int:
        return self.cache.max_len

    def get_mask_sizes(self, query_length: int):
        return self.cache.max_len, 0

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx):
        return None          # all beams of an input read the same K/V

    def reset(self) -> None:
        self.storage = self.pool = self.kv = self.keys = self.values = None
        self.is_initialized = False


def in_place_layout(device: torch.device) -> bool:
    """Where the cross K/V is stored as one K run and one V run (read in place by sdpa): the CPU. GPU kernels
    take the contiguous paged pool."""
    return device.type == "cpu"


class CrossAttentionCache(Cache):
    """Cross-attention K/V of every decoder layer, once per input (see the module docstring).

    Its storages and plans may outlive the call (kept with the model's last call: ``encoder_decoder.KeptCross``) and
    serve a later call of as many inputs whose sources need no more blocks than they hold (:meth:`serves`): the
    storages' blocks (``num_blocks``) and the tables' width in blocks are the capacity, the inputs' lengths the
    call's values, written into the same storages and into the plans' device tensors in place (:meth:`refill`); each
    plan's launch follows the widths (``StepPlan.fixed_widths``)."""

    def __init__(self, num_layers: int, cascade_config: CascadeConfig | None = None):
        self.cascade_config = cascade_config or CascadeConfig()
        super().__init__(layers=[CrossLayer(self, i) for i in range(num_layers)])
        self.block_size = self.cascade_config.block_size
        self.batch, self.max_len, self.num_blocks = 0, 0, 0
        self.lengths = np.zeros(0, np.int64)                      # each input's real encoder tokens
        self.prefix_table = np.zeros((0, 0), np.int32)            # each input's blocks (-1 past them)
        self.starts: list[int] = []                               # each input's first token in a layer's K run
        self._plans: dict = {}

    def _blocks(self, lengths: np.ndarray) -> np.ndarray:
        return -(-np.asarray(lengths, np.int64) // self.block_size)

    def serves(self, lengths: np.ndarray) -> bool:
        """Whether the filled storages and plans take a call of inputs of ``lengths`` (:func:`real_lengths`) in place:
        as many inputs, no more blocks than the storages hold, none wider than the tables, and the tables at most
        ``plan.ADOPT_SPAN`` times the widest input's blocks (every step reads the tables' width: a kept state much
        wider than a call's sources would cost it more than it saves)."""
        blocks = self._blocks(lengths)
        width = self.prefix_table.shape[1]
        return (self.batch > 0 and blocks.shape[0] == self.batch and int(blocks.sum()) <= self.num_blocks
                and int(blocks.max()) <= width <= ADOPT_SPAN * int(blocks.max()))

    def room_for(self, lengths: np.ndarray) -> tuple[int, int]:
        """The capacity (blocks, table width) of new storages for inputs of ``lengths`` that this cache does not
        serve (:meth:`serves`): at least this one's where that stays within ``plan.ADOPT_SPAN`` of their width, so
        that the state kept over an evaluation loop's batches grows to serve each of them; else (0, 0), theirs
        alone."""
        blocks = self._blocks(lengths)
        room = (max(self.num_blocks, int(blocks.sum())), max(self.prefix_table.shape[1], int(blocks.max())))
        return room if room[1] <= ADOPT_SPAN * int(blocks.max()) else (0, 0)

    def fill(self, projections: list[CrossProjection], states: torch.Tensor, mask: torch.Tensor | None,
             cap: KVCap | None = None, room: tuple[int, int] = (0, 0)) -> None:
        """Project and store each input's real encoder tokens with each layer's projection
        (``seq2seq_models.cross_projections``): ``states`` [B, S, d], ``mask`` [B, S] or None; their bytes are
        checked against ``cap`` (max_kv_bytes) before anything is projected or allocated. ``room``: at least this
        many blocks and this table width (:meth:`room_for`), for later calls."""
        self._store(projections, states, mask, cap, in_place=False, room=room)

    def refill(self, projections: list[CrossProjection], states: torch.Tensor, mask: torch.Tensor | None) -> None:
        """:meth:`fill` where the cache holds a last call's K/V and :meth:`serves` this call's inputs: the new K/V go
        into the same storages (a kept decode graph reads them by address), the new tables and lengths into the
        plans' host arrays and device tensors in place."""
        self._store(projections, states, mask, None, in_place=True)

    @torch.no_grad()
    def _store(self, projections, states, mask, cap, in_place: bool, room=(0, 0)) -> None:
        batch, width, _ = states.shape
        real = torch.ones(batch, width, dtype=torch.bool) if mask is None else mask.detach().cpu().bool()
        lengths = real.sum(1).numpy().astype(np.int64)            # one host read per generate call
        if (lengths == 0).any():
            raise ValueError("An input of the batch has no real encoder token (its attention_mask is all zeros); "
                             "remove it from the batch.")
        if in_place and not self.serves(lengths):
            raise RuntimeError("hf_cascade internal error: cross-attention K/V refilled in place for inputs its "
                               "storages do not serve; please report it")
        bs = self.block_size
        blocks = self._blocks(lengths)
        num_blocks, table_width = ((self.num_blocks, self.prefix_table.shape[1]) if in_place else
                                   (max(int(blocks.sum()), room[0]), max(int(blocks.max()), room[1])))
        first = np.concatenate([[0], np.cumsum(blocks)[:-1]])
        table = np.full((batch, table_width), -1, np.int32)
        for b in range(batch):                                    # once per input, not per token
            table[b, : blocks[b]] = np.arange(first[b], first[b] + blocks[b])
        order = np.concatenate([np.arange(n) for n in lengths])   # token's index within its input
        owner = np.repeat(np.arange(batch), lengths)
        device = states.device
        block = torch.from_numpy(first[owner] + order // bs).to(device)
        slot = torch.from_numpy(order % bs).to(device)
        if cap is not None:
            need = sum(num_blocks * bs * project.width * project.itemsize(states) for project in projections)
            cap.check(need, f"the cross-attention K/V ({int(lengths.sum())} encoder tokens of {batch} inputs, "
                            f"stored once per input in blocks of {bs}, {len(projections)} layers)")
        flat = states.reshape(batch * width, -1)
        if mask is not None:
            flat = flat[real.reshape(-1).to(device)]              # only real tokens: pads are never stored
        on_device = {}     # a model spread over devices (device_map): each layer's K/V on its layer's device
        for layer, project in zip(self.layers, projections):
            dev = project.device
            if dev not in on_device:
                on_device[dev] = (flat.to(dev), block.to(dev), slot.to(dev))
            states_d, block_d, slot_d = on_device[dev]
            k, v = project(states_d)
            (layer.refill if in_place else layer.fill)(k, v, num_blocks, block_d, slot_d, batch, width)
        self.lengths, self.prefix_table, self.starts = lengths, table, (first * bs).tolist()
        if in_place:        # the same plans (the kept step contexts hold them): their values rewritten in place
            self.max_len = max(self.max_len, width)
            for plan in self._plans.values():
                plan.rewrite_prefix(table, lengths)
            return
        self.batch, self.max_len, self.num_blocks = batch, width, num_blocks
        self._plans = {}

    def plan(self, rows: int, q_len: int) -> StepPlan:
        """The one-level cascade of a step with ``rows`` query rows (input b owns rows b*n .. b*n+n-1):
        groups = inputs, prefix = the input's encoder blocks, no suffix. Built once per (rows, q_len) and kept while
        the storages are: a later call's sources rewrite its tables and lengths (``fixed_widths``: a backend's launch
        follows the widths)."""
        key = (rows, q_len)
        if key not in self._plans:
            if not self.batch or rows % self.batch:
                raise RuntimeError(f"cross-attention with {rows} query rows over {self.batch} inputs: rows must be "
                                   "a whole number of beams/samples per input.")
            n = rows // self.batch
            none = np.zeros(0, np.int64)
            self._plans[key] = StepPlan(
                fresh=False, q_len=q_len, src_index=None, write_block=none, write_offset=none,
                copy_src=none, copy_dst=none,
                group_rows=np.arange(rows, dtype=np.int32).reshape(self.batch, n),
                prefix_table=self.prefix_table, prefix_len=self.lengths.astype(np.int32),
                suffix_table=np.zeros((rows, 0), np.int32), q_limit=np.zeros((rows, q_len), np.int32),
                fixed_widths=True)
        return self._plans[key]

    def check_reorder(self, beam_idx) -> None:
        """Beams never move between inputs: what makes the no-op reorder exact (checked every step)."""
        index = np.asarray(beam_idx.detach().cpu() if isinstance(beam_idx, torch.Tensor) else beam_idx)
        rows = index.size
        if not self.batch or rows % self.batch:
            return
        n = rows // self.batch
        if not (index // n == np.arange(rows) // n).all():
            raise RuntimeError("A beam reorder moved a row to another input; the cross-attention K/V are stored "
                               "once per input and cannot follow. Use attn_implementation='sdpa'.")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.max_len

    def reorder_cache(self, beam_idx) -> None:
        self.check_reorder(beam_idx)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.batch, self.max_len, self.num_blocks, self._plans = 0, 0, 0, {}

    @property
    def kv_bytes(self) -> int:
        return sum(l.storage.nbytes for l in self.layers if l.storage is not None)

    def sdpa_in_place(self, layer: CrossLayer, query: torch.Tensor, scale: float) -> torch.Tensor:
        """CPU: each input's beams stacked on the query axis, one sdpa over that input's K/V run read in
        place (no gather, no copy of the K/V); all inputs in one call when they are equally long.
        ``query`` [R, H, q, D] -> [R, q, H, D]."""
        rows, heads, q_len, dim = query.shape
        n, batch = rows // self.batch, self.batch
        stacked = query.reshape(batch, n, heads, q_len, dim).transpose(1, 2).reshape(batch, heads, n * q_len, dim)
        lengths = self.lengths.tolist()
        if len(set(lengths)) == 1:
            stride = self.starts[1] if batch > 1 else lengths[0]
            k, v = (layer.kv[i][: batch * stride].view(batch, stride, heads, dim)[:, : lengths[0]].transpose(1, 2)
                    for i in (0, 1))
            out = torch.nn.functional.scaled_dot_product_attention(stacked, k, v, scale=scale)
        else:      # one call per input: a loop over inputs, not tokens or blocks
            out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
                stacked[b:b + 1], layer.kv[0][None, start:start + length].transpose(1, 2),
                layer.kv[1][None, start:start + length].transpose(1, 2), scale=scale)
                for b, (start, length) in enumerate(zip(self.starts, lengths))])
        return out.reshape(batch, heads, n, q_len, dim).permute(0, 2, 3, 1, 4).reshape(rows, q_len, heads, dim)


class CascadeEncoderDecoderCache(EncoderDecoderCache):
    """Decoder self-attention (CascadeCache, or DynamicCache for relative-bias families) plus the
    cross-attention K/V once per input. Reordering beams touches the self-attention part only."""

    def __init__(self, self_attention_cache: Cache, cross_attention_cache: CrossAttentionCache):
        super().__init__(self_attention_cache, cross_attention_cache)
        self.is_updated = {i: True for i in range(len(cross_attention_cache.layers))}   # the model never projects

    def reorder_cache(self, beam_idx) -> None:
        self.cross_attention_cache.check_reorder(beam_idx)
        self.self_attention_cache.reorder_cache(beam_idx)

    def reset(self) -> None:
        self.self_attention_cache.reset()
        self.cross_attention_cache.reset()
