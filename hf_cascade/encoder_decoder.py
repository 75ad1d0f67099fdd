"""Encoder-decoder models (T5, BART/mBART, Marian, M2M100/NLLB, Whisper) on the cascade path.

Stock ``generate(num_beams=k)`` copies the encoder output k times, projects every decoder layer's
cross-attention K/V from the k copies and copies that K/V again at every beam reorder. Here:

- the encoder output is not expanded (``patches`` hands us the B unexpanded rows; the decoder sees a
  zero-stride placeholder of the expanded shape, which nothing reads);
- :class:`CrossAttentionCache` projects each decoder layer's cross K/V once per input, with the
  layer's own linears, storing only the input's real (unpadded) encoder tokens in a paged pool;
- its reorder is a no-op (beams never move between inputs; checked every step);
- every cross-attention call runs as a cascade with one level: the group of an input's beams reads
  that input's encoder blocks once, through the same kernel backends (``forward(q, pool, metadata, scale)``) as the
  decoder-only path (a :class:`~hf_cascade.plan.StepPlan` with groups = inputs and an empty suffix);
  on the CPU with backend="auto", one sdpa per input (its beams stacked on the query axis) reads the
  input's K/V in place instead (the PyTorch backend would gather a copy of it every layer and step);
- decoder self-attention runs on a :class:`~hf_cascade.cache.CascadeCache` as for decoder-only
  models (a shared decoder prompt, e.g. Whisper's start tokens and ``prompt_ids``, is prefilled
  once) — see :func:`paged_self_attention` for where it stays dense (T5's relative position bias;
  one-token decoder prompts on the CPU): there on a :class:`ReorderedCache` on the CPU (one copy of the
  self K/V per beam step instead of stock's two), stock's DynamicCache on GPUs.

The model's cross-attention modules read ``cache.cross_attention_cache.layers[i].keys/.values``
directly and pass them to the attention function: those tensors are placeholders; the decoder's forwards carry a
:class:`~hf_cascade.cross_attention.CrossContext` by which the attention finds the layer
(:mod:`hf_cascade.cross_attention`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer, EncoderDecoderCache

from . import cross_attention, graphs
from .blocks import PoolExhausted
from .cache import CascadeCache
from .config import CascadeConfig
from .plan import StepPlan

logger = logging.getLogger("hf_cascade")

# model_type -> quirk; every entry is tested token-exact against stock (tests/test_encoder_decoder.py)
SUPPORTED = {"bart": "", "mbart": "", "marian": "", "m2m_100": "", "whisper": "", "t5": "relative bias",
             "mt5": "relative bias"}


# Models that pair any encoder with any decoder: generate runs them on stock's dense path (their decoders'
# cross-attention modules and an encoder-to-decoder projection differ per pairing), logged once.
COMPOSITE = ("encoder-decoder", "vision-encoder-decoder", "speech-encoder-decoder")


def unsupported_reason(model) -> str | None:
    """Why the encoder-decoder cascade path cannot serve ``model`` (None when it can, also on stock's path)."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED and model_type not in COMPOSITE:
        return (f"it is an encoder-decoder model of type {model_type!r}; the cascade path serves "
                f"{', '.join(sorted(SUPPORTED))}")
    if not hasattr(model, "get_decoder"):
        return f"{type(model).__name__} has no decoder to generate with"
    return None


def _decoder(model):
    decoder = model.get_decoder()
    return decoder.get_decoder() if hasattr(decoder, "get_decoder") and not hasattr(decoder, "layers") \
        and not hasattr(decoder, "block") else decoder


def cross_attention_modules(model) -> list:
    """Each decoder layer's cross-attention module, in layer order."""
    decoder = _decoder(model)
    if hasattr(decoder, "block"):                                  # T5 / mT5
        return [block.layer[1].EncDecAttention for block in decoder.block]
    return [layer.encoder_attn for layer in decoder.layers]        # BART family, Whisper


def _project(attn, states: torch.Tensor):
    """The module's own cross K/V projection of ``states`` [N, d] -> two [N, H, D]."""
    if hasattr(attn, "k_proj"):
        k, v, head_dim = attn.k_proj(states), attn.v_proj(states), attn.head_dim
    else:                                                          # T5Attention
        k, v, head_dim = attn.k(states), attn.v(states), attn.key_value_proj_dim
    return k.view(states.shape[0], -1, head_dim), v.view(states.shape[0], -1, head_dim)


def _projected_width(attn) -> int:
    """K plus V features that :func:`_project` gives per token."""
    k, v = (attn.k_proj, attn.v_proj) if hasattr(attn, "k_proj") else (attn.k, attn.v)
    return k.out_features + v.out_features


def _projected_itemsize(attn, states: torch.Tensor) -> int:
    weight = attn.k_proj.weight if hasattr(attn, "k_proj") else attn.k.weight
    return torch.promote_types(weight.dtype, states.dtype).itemsize if weight.is_floating_point() \
        else states.element_size()


def uses_relative_bias(model) -> bool:
    return SUPPORTED.get(getattr(model.config, "model_type", None)) == "relative bias"


def paged_self_attention(model, decoder_ids: torch.Tensor, device: torch.device, config: CascadeConfig) -> bool:
    """Whether the decoder self-attention runs on a paged CascadeCache (else dense: :func:`self_attention_cache`).

    Not for relative-bias families (T5: the bias is computed from the width of the K/V the cache returns).
    On a GPU, or with a backend chosen explicitly, always: no per-step reorder copy of the self K/V. On the
    CPU with backend="auto", only where the beams can share decoder prompt blocks (a prompt of at least
    one block, e.g. Whisper with prompt_ids): with a one-token decoder prompt there is nothing to share,
    and the PyTorch paged attention costs more per step than DynamicCache's small reorder copy
    (bart-base, 8 beams: 10.5 vs 9.0 s; benchmarks/RESULTS.md)."""
    if uses_relative_bias(model):
        return False
    if device.type != "cpu" or config.backend != "auto":
        return True
    return decoder_ids.shape[1] - 1 >= config.block_size


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
    if isinstance(cache, CrossAttentionCache):
        return cache.kv_bytes
    if isinstance(cache, CascadeCache):
        return sum(l.storage.nbytes for l in cache.layers if l.storage is not None)
    if isinstance(cache, ReorderedCache):
        spares = cache.layers[0]._spares if cache.layers else {}
        return sum(b.nbytes for l in cache.layers for b in (l._buffers or ())) + \
            sum(b.nbytes for b in spares.values())
    return sum(t.nbytes for l in getattr(cache, "layers", ()) if getattr(l, "is_initialized", False)
               for t in (l.keys, l.values) if isinstance(t, torch.Tensor))


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
    """The decoder self-attention cache where it is not paged (see :func:`paged_self_attention`): a
    DynamicCache of :class:`ReorderedLayer` sized for the call's ``max_length``, one copy of the K/V per
    beam step instead of two, and one spare buffer for all layers (about stock's memory at the last step)."""

    def __init__(self, capacity: int = 64, cap: KVCap | None = None):
        Cache.__init__(self, layer_class_to_replicate=functools.partial(ReorderedLayer, capacity, {}, cap))
        if cap is not None:
            cap.caches.append(self)


_DENSE_SELF = "the decoder's self-attention K/V (a dense cache: the K/V of every beam)"


def self_attention_cache(device: torch.device, generation_config, cap: KVCap | None = None) -> DynamicCache:
    """The dense self-attention cache: :class:`ReorderedCache` on the CPU (sized for the generate call's
    ``max_length``), stock's DynamicCache elsewhere (the strided K/V views are not yet checked against stock
    on the GPU kernels); its allocations counted against ``cap`` (max_kv_bytes) where one is set."""
    if device.type != "cpu":
        return DynamicCache() if cap is None else capped_dynamic_cache(cap, _DENSE_SELF)
    return ReorderedCache(min(int(getattr(generation_config, "max_length", None) or 64), 4096), cap)


# ---- the encoder output: never expanded k times ----------------------------------------------------
def defer_expansion(encoder_outputs, expand_size: int):
    """Called by ``patches`` instead of ``repeat_interleave``: keep the B unexpanded rows of every
    tensor field (in ``encoder_outputs.hf_cascade_unexpanded``) and put a zero-stride NaN placeholder
    of the expanded shape in its place (reading it would give NaN, never plausible values)."""
    kept = {}
    encoder_outputs = type(encoder_outputs)(**encoder_outputs)    # a copy: the caller's object stays as it was
    for key in list(encoder_outputs.keys()):
        value = encoder_outputs[key]
        if isinstance(value, torch.Tensor):
            kept[key] = value
            encoder_outputs[key] = _placeholder(value, value.shape[0] * expand_size)
    encoder_outputs.hf_cascade_unexpanded = kept
    encoder_outputs.hf_cascade_expand_size = expand_size
    return encoder_outputs


def _placeholder(like: torch.Tensor, rows: int) -> torch.Tensor:
    return like.new_full((), float("nan")).expand(rows, *like.shape[1:])


def unexpanded_states(encoder_outputs, n: int) -> torch.Tensor:
    """The encoder's last hidden state, one row per input [B, S, d] (no copy)."""
    kept = getattr(encoder_outputs, "hf_cascade_unexpanded", None)
    if kept is not None:
        return kept["last_hidden_state"] if "last_hidden_state" in kept else next(iter(kept.values()))
    return encoder_outputs[0][::n]               # expanded by stock (patch not applied): a view of row 0, n, ...


def restore_expansion(encoder_outputs) -> None:
    """Undo :func:`defer_expansion` (stock's k copies) for a path that runs stock dense decoding."""
    kept = getattr(encoder_outputs, "hf_cascade_unexpanded", None)
    if kept:
        for key, value in kept.items():
            encoder_outputs[key] = value.repeat_interleave(encoder_outputs.hf_cascade_expand_size, dim=0)
        encoder_outputs.hf_cascade_unexpanded = None


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
    """One decoder layer's cross K/V: a pool ``[num_blocks, 2, block_size, H, D]`` holding each
    input's real encoder tokens once. ``keys``/``values`` are placeholders ``[B, H, S_max, D]`` the
    model passes back to the attention function (T5 reads S_max from them)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: "CrossAttentionCache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.pool = self.kv = None

    def fill(self, k: torch.Tensor, v: torch.Tensor, num_blocks: int, block: torch.Tensor, slot: torch.Tensor,
             batch: int, max_len: int) -> None:
        """``k``/``v`` [N, H, D]: the real tokens of all inputs, in order; token i goes to (block[i], slot[i])."""
        _, heads, dim = k.shape
        bs = self.cache.block_size
        if in_place_layout(k.device):
            # K of all blocks, then V of all blocks: an input's tokens are one contiguous run that
            # attention reads in place (cross_attention); ``pool`` is the same memory in the paged layout
            self.kv = k.new_zeros(2, num_blocks * bs, heads, dim)
            self.pool = self.kv.view(2, num_blocks, bs, heads, dim).permute(1, 0, 2, 3, 4)
        else:     # the GPU kernels take a contiguous [num_blocks, 2, block_size, H, D] pool
            self.kv = None
            self.pool = k.new_zeros(num_blocks, 2, bs, heads, dim)
        self.pool[block, 0, slot] = k
        self.pool[block, 1, slot] = v
        self.keys = k.new_full((), float("nan")).expand(batch, heads, max_len, dim)
        self.values = self.keys
        self.dtype, self.device, self.is_initialized = k.dtype, k.device, True

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
        self.pool = self.kv = self.keys = self.values = None
        self.is_initialized = False


def in_place_layout(device: torch.device) -> bool:
    """Where the cross K/V is stored as one K run and one V run (read in place by sdpa): the CPU. GPU kernels
    take the contiguous paged pool."""
    return device.type == "cpu"


class CrossAttentionCache(Cache):
    """Cross-attention K/V of every decoder layer, once per input (see the module docstring)."""

    def __init__(self, num_layers: int, cascade_config: CascadeConfig | None = None):
        self.cascade_config = cascade_config or CascadeConfig()
        super().__init__(layers=[CrossLayer(self, i) for i in range(num_layers)])
        self.block_size = self.cascade_config.block_size
        self.batch, self.max_len = 0, 0
        self.lengths = np.zeros(0, np.int64)                      # each input's real encoder tokens
        self.prefix_table = np.zeros((0, 0), np.int32)            # each input's blocks
        self.starts: list[int] = []                               # each input's first token in a layer's K run
        self._plans: dict = {}

    @torch.no_grad()
    def fill(self, modules, states: torch.Tensor, mask: torch.Tensor | None, cap: KVCap | None = None) -> None:
        """Project and store each input's real encoder tokens: ``states`` [B, S, d], ``mask`` [B, S] or None;
        their bytes are checked against ``cap`` (max_kv_bytes) before anything is projected or allocated."""
        batch, width, _ = states.shape
        real = torch.ones(batch, width, dtype=torch.bool) if mask is None else mask.detach().cpu().bool()
        lengths = real.sum(1).numpy().astype(np.int64)            # one host read per generate call
        if (lengths == 0).any():
            raise ValueError("An input of the batch has no real encoder token (its attention_mask is all zeros); "
                             "remove it from the batch.")
        bs = self.block_size
        blocks = -(-lengths // bs)
        first = np.concatenate([[0], np.cumsum(blocks)[:-1]])
        table = np.full((batch, int(blocks.max())), -1, np.int32)
        for b in range(batch):                                    # once per input, not per token
            table[b, : blocks[b]] = np.arange(first[b], first[b] + blocks[b])
        order = np.concatenate([np.arange(n) for n in lengths])   # token's index within its input
        owner = np.repeat(np.arange(batch), lengths)
        device = states.device
        block = torch.from_numpy(first[owner] + order // bs).to(device)
        slot = torch.from_numpy(order % bs).to(device)
        if cap is not None:
            need = sum(int(blocks.sum()) * bs * _projected_width(attn) * _projected_itemsize(attn, states)
                       for attn in modules)
            cap.check(need, f"the cross-attention K/V ({int(lengths.sum())} encoder tokens of {batch} inputs, "
                            f"stored once per input in blocks of {bs}, {len(modules)} layers)")
        flat = states.reshape(batch * width, -1)
        if mask is not None:
            flat = flat[real.reshape(-1).to(device)]              # only real tokens: pads are never stored
        on_device = {}     # a model spread over devices (device_map): each layer's K/V on its layer's device
        for layer, attn in zip(self.layers, modules):
            dev = next(attn.parameters()).device
            if dev not in on_device:
                on_device[dev] = (flat.to(dev), block.to(dev), slot.to(dev))
            states_d, block_d, slot_d = on_device[dev]
            k, v = _project(attn, states_d)
            layer.fill(k, v, int(blocks.sum()), block_d, slot_d, batch, width)
        self.batch, self.max_len, self.lengths, self.prefix_table = batch, width, lengths, table
        self.starts = (first * bs).tolist()
        self._plans = {}

    def plan(self, rows: int, q_len: int) -> StepPlan:
        """The one-level cascade of a step with ``rows`` query rows (input b owns rows b*n .. b*n+n-1):
        groups = inputs, prefix = the input's encoder blocks, no suffix. Built once per (rows, q_len)."""
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
                suffix_table=np.zeros((rows, 0), np.int32), q_limit=np.zeros((rows, q_len), np.int32))
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
        self.batch, self.max_len, self._plans = 0, 0, {}

    @property
    def kv_bytes(self) -> int:
        return sum(l.pool.numel() * l.pool.element_size() for l in self.layers if l.pool is not None)

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


# ---- the generate entry -----------------------------------------------------------------------------
def _dense(decode, model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
           model_kwargs, cascade_config: CascadeConfig, key: str):
    """Stock dense decoding (stock's expanded encoder output restored); ``max_kv_bytes`` holds on its caches too
    (stock's EncoderDecoderCache with the growth of both halves counted against it)."""
    if model_kwargs.get("encoder_outputs") is not None:
        restore_expansion(model_kwargs["encoder_outputs"])
    cap = cascade_config.max_kv_bytes
    if cap is not None and generation_config.use_cache:
        existing = model_kwargs.get(key)
        if existing is not None and getattr(existing, "_is_user_defined", False):
            raise ValueError(f"CascadeConfig.max_kv_bytes={cap} cannot be held on a cache of the caller's "
                             f"({type(existing).__name__}), which this call decodes into as stock does; pass no "
                             "cache, or leave max_kv_bytes unset.")
        kv_cap = KVCap(cap)
        model_kwargs[key] = EncoderDecoderCache(
            capped_dynamic_cache(kv_cap, "the decoder's self-attention K/V (stock's dense cache, every beam)"),
            capped_dynamic_cache(kv_cap, "the cross-attention K/V (stock's dense cache: every beam's copy)"))
    return decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                  synced_gpus=synced_gpus, **model_kwargs)


_composite_logged = False


def _log_composite(model) -> None:
    global _composite_logged
    if not _composite_logged:
        _composite_logged = True
        logger.info("%s runs generate on stock's dense path (the cascade's encoder-decoder path serves "
                    "%s, not a pairing of any encoder and decoder); load its decoder alone for the decoder-only "
                    "cascade (logged once).", type(model).__name__, ", ".join(sorted(SUPPORTED)))


def _without_cache(result):
    """generate's output without the cache (ours is released; ModelOutput cannot delete a field)."""
    names = ("cache", "past_key_values")
    if not hasattr(result, "keys") or not any(name in result.keys() for name in names):
        return result
    return type(result)(**{k: v for k, v in result.items() if k not in names})


def generate(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, decode,
             cascade_config: CascadeConfig | dict | None, key: str, **model_kwargs):
    """:func:`hf_cascade.generation.cascade_generate` for encoder-decoder models (see the module docstring)."""
    cascade_config = CascadeConfig.coerce(cascade_config)      # a dict too; every field checked
    existing = model_kwargs.get(key)
    if generation_config.cache_implementation not in (None, "dynamic"):
        raise ValueError(f"cache_implementation={generation_config.cache_implementation!r} conflicts with "
                         "attn_implementation='cascade', which brings its own cache. Unset it, or use sdpa.")
    if isinstance(existing, (CascadeCache, CascadeEncoderDecoderCache)):
        raise ValueError("A cache passed to generate of an encoder-decoder model is not supported by the cascade "
                         "path (Whisper reuses it across segments); pass no cache.")
    dense = (decode, model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
             model_kwargs, cascade_config, key)
    if model.config.model_type in COMPOSITE:
        _log_composite(model)
        return _dense(*dense)
    if generation_config.return_dict_in_generate and (generation_config.output_hidden_states
                                                      or generation_config.output_attentions):
        logger.warning("output_hidden_states/output_attentions run with dense attention "
                       "(encoder output expanded per beam, as stock).")
        return _dense(*dense)
    if not generation_config.use_cache or (existing is not None and getattr(existing, "_is_user_defined", False)):
        return _dense(*dense)
    encoder_outputs = model_kwargs.get("encoder_outputs")
    if encoder_outputs is None:
        raise ValueError("generate of an encoder-decoder model reached the cascade entry without encoder_outputs.")
    n = max(generation_config.num_beams, generation_config.num_return_sequences or 1)
    rows = input_ids.shape[0]
    states = unexpanded_states(encoder_outputs, n)
    if states.shape[0] * n != rows:
        raise ValueError(f"{states.shape[0]} encoder rows do not match {rows} decoder rows / {n} per input.")
    mask = model_kwargs.get("attention_mask")
    # Whisper's cross-attention has no mask (its attention_mask is over mel frames, for the encoder only)
    source_mask = None if mask is None or model.config.model_type == "whisper" else mask[::n]
    if source_mask is not None and source_mask.shape != states.shape[:2]:
        raise ValueError(f"attention_mask {tuple(source_mask.shape)} does not match the encoder output "
                         f"{tuple(states.shape[:2])}; use attn_implementation='sdpa' for this model.")
    decoder_mask = model_kwargs.get("decoder_attention_mask")
    if decoder_mask is not None and tuple(decoder_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"decoder_attention_mask {tuple(decoder_mask.shape)} must match the decoder prompt "
                         f"{tuple(input_ids.shape)} (one row per beam or returned sequence).")
    padded = decoder_mask is not None and not bool(decoder_mask.all())

    modules = cross_attention_modules(model)
    cap = None if cascade_config.max_kv_bytes is None else KVCap(cascade_config.max_kv_bytes)
    cross = CrossAttentionCache(len(modules), cascade_config)
    paged = paged_self_attention(model, input_ids, states.device, cascade_config)
    self_cache = runner = None
    try:
        if cap is not None:
            cap.caches.append(cross)
        repeats = repeated_inputs(states, source_mask)      # rows of one input, n each, then the next input's
        cross.fill(modules, states[::repeats], None if source_mask is None else source_mask[::repeats], cap)
        self_cache = _paged_self_cache(model, cascade_config, cap) if paged else self_attention_cache(
            states.device, generation_config, cap)
        cache = CascadeEncoderDecoderCache(self_cache, cross)
        model_kwargs[key] = cache
        model_kwargs.update(cross_attention.forward_kwargs(cache))
        # the decoder never reads the encoder states (is_updated is set): a placeholder of stock's shape
        if getattr(encoder_outputs, "hf_cascade_unexpanded", None) is None:   # not expanded (n = 1): a copy
            model_kwargs["encoder_outputs"] = encoder_outputs = type(encoder_outputs)(**encoder_outputs)
            encoder_outputs.hf_cascade_unexpanded = {"last_hidden_state": states}
            encoder_outputs.hf_cascade_expand_size = n
            encoder_outputs["last_hidden_state"] = _placeholder(states, rows)
        if paged and input_ids.shape[1] > 1:
            # the decoder prompt (Whisper's start tokens, a prompt) is the same for an input's beams: once
            _prefill_decoder_prompt(model, cache, input_ids[::n, :-1], None if not padded else decoder_mask[::n, :-1],
                                    states, source_mask, key)
            self_cache.batch_repeat_interleave(n)
            if decoder_mask is None:   # with a mask, generate's first step feeds only the tokens past the cache
                model_kwargs["decoder_attention_mask"] = input_ids.new_ones(input_ids.shape)
        if paged and padded and not bool(decoder_mask[:, -1].all()):
            self_cache.set_write_mask(decoder_mask[:, -1:])   # a last pad is not stored either
        if paged:           # the decode steps on a static layout, as a captured graph where one can run
            runner = graphs.begin_decoding(model, self_cache, generation_config, input_ids.shape[1])
        with runner or contextlib.nullcontext():
            result = decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
                            synced_gpus=synced_gpus, **model_kwargs)
        return _without_cache(result)
    except PoolExhausted as err:
        if cap is None or not paged or isinstance(err, KVCapExceeded):
            raise
        raise PoolExhausted(f"{err} (Of CascadeConfig.max_kv_bytes={cap.cap}, the cross-attention K/V of this call "
                            f"take {cross.kv_bytes} bytes; the decoder's paged self-attention cache gets the rest.)"
                            ) from err
    finally:
        if paged and self_cache is not None:   # the runner is not kept for a next call: encoder outputs differ
            graphs.finish_call(model, self_cache, runner, owned=False, ok=True)
        if self_cache is not None:
            self_cache.reset()
        cross.reset()        # nobody else can reach these caches: give every block back now


def _paged_self_cache(model, config: CascadeConfig, cap: KVCap | None) -> CascadeCache:
    """The decoder's paged self-attention CascadeCache; under max_kv_bytes, capped at what the cross K/V leave."""
    if cap is None:
        return CascadeCache(model.config, config)
    left = cap.cap - cap.held()
    try:
        return CascadeCache(model.config, dataclasses.replace(config, max_kv_bytes=max(left, 1)))
    except ValueError as err:        # less than one block left for the self-attention
        raise KVCapExceeded(f"CascadeConfig.max_kv_bytes={cap.cap} would be exceeded: the cross-attention K/V of "
                            f"this call take {cap.held()} bytes, leaving {left}, less than one block of the "
                            "decoder's self-attention. Raise max_kv_bytes, or lower the number or length of the "
                            "inputs.") from err


def _prefill_decoder_prompt(model, cache, ids: torch.Tensor, mask: torch.Tensor | None, states, source_mask,
                            key: str) -> None:
    """The decoder prompt's tokens but the last, once per input, into the paged self-attention cache; pad tokens
    (``mask`` zeros) are not stored. Positions as stock's: Whisper's from the decoder mask (its
    prepare_inputs_for_generation), the other families' from the cache length (pads count)."""
    extra = {}
    if mask is not None:
        cache.self_attention_cache.set_write_mask(mask)
        extra["decoder_attention_mask"] = mask
        if model.config.model_type == "whisper":
            extra["decoder_position_ids"] = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        model(decoder_input_ids=ids, encoder_outputs=(_placeholder(states, ids.shape[0]),),
              attention_mask=source_mask, use_cache=True, **extra, **{key: cache},
              **cross_attention.forward_kwargs(cache))
