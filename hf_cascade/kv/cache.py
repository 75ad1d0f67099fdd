"""CascadeCache: the transformers Cache API over a paged, copy-on-write block pool.

All layers share one block bookkeeping (:mod:`hf_cascade.blocks`); each layer owns a KV pool
``[num_blocks, 2, block_size, kv_heads, head_dim]`` on the device and dtype of its first K/V
(:mod:`hf_cascade.memory`). A forward step is planned once, at the first layer's ``update`` (:mod:`hf_cascade.plan`),
or on the device before the forward (:meth:`CascadeCache.begin_planned_step`: the whole step), into one
:class:`~hf_cascade.context.StepContext`; every layer then writes its new K/V with a few index ops, records
itself in the context and hands the context to the attention function (:mod:`hf_cascade.context` says how).
Inside ``generate`` the decode steps follow a :class:`~hf_cascade.plan.DecodeLayout` (static shapes and buffers:
what a captured CUDA graph replays), sized for the tokens made so far and widened geometrically as rows grow.
A static step that copies blocks (beam search) may copy them in every layer's pool at once when it begins
(:meth:`CascadeCache._copy_blocks_of_all_layers`: one kernel launch, ``cuda_library.layer_copies``), and its layers'
writes then copy none.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from torch.compiler import is_compiling as _is_compiling   # bound once: the eager path pays for every lookup
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import kernels
from .blocks import BlockManager
from ..config import CascadeConfig
from .context import STEP_KWARG, UPDATE_PASSES_KWARGS, StepContext, reset_context, set_context
from ..kernels import cuda_library
from ..kernels.base import with_kv_scale
from ..kernels.capture import capture_underway
from .memory import keep_bytes_of, make_storage
from ..precision import as_computed
from .plan import DecodeLayout, LayoutOutgrown, StepPlan, build_step_plan, decode_room

logger = logging.getLogger("hf_cascade")
# decode layouts a cache keeps between calls for its runner's kept steps (hf_cascade.graphs), the latest first: an
# evaluation loop meets a few ways the rows share (a prompt long enough for its beams to read it once, one below the
# cascade's threshold read as solo rows) and prompt lengths more than ADOPT_SPAN apart
KEPT_LAYOUTS = 4
# The CPU's form of the all-layer copy (CascadeCache._copy_blocks_of_all_layers: torch index copies, one layer after
# another, once per step), so that CPU tests run a static step's copies where a GPU with cuda_library.layer_copies
# does: off (each layer's write copies its own blocks) unless a test turns it on
cpu_layer_copies = False


def _write_slots(pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor, write_block: torch.Tensor,
                 write_offset: torch.Tensor, copy_src: torch.Tensor, copy_dst: torch.Tensor, copies: bool) -> None:
    """The cache write of one layer: the block copies ``pool[copy_dst] = pool[copy_src]`` (copy-on-write, when
    ``copies``), then K/V ``[tokens, kv_heads, head_dim]`` into ``pool[write_block, 0|1, write_offset]``. On a GPU
    whose kernel library is loaded (the cuda backend's), one kernel for the copies and one for K and V
    (``csrc/write.cu``; ``$HF_CASCADE_WRITE_KERNEL=0`` turns it off); else :func:`_write_slots_torch`'s four."""
    if not key.shape[0] and not (copies and copy_src.numel()):
        return      # nothing to move (a prefill of empty prompts): its pool may hold no block yet (a NULL pointer)
    if pool.is_cuda and _write_slots_kernel(pool, key, value, write_block, write_offset, copy_src, copy_dst, copies):
        return
    _write_slots_torch(pool, key, value, write_block, write_offset, copy_src, copy_dst, copies)


def _write_slots_kernel(pool, key, value, *indices_and_copies) -> bool:
    """:func:`_write_slots` on the library's kernel where it can (:func:`cuda_library.write_slots`): K/V as they are
    where the kernel reads them so (:func:`cuda_library.write_fits`), else made contiguous first: with fused
    projections (:mod:`hf_cascade.fused_linears`) V is a column slice of the fused q|k|v product, its tokens strided by
    the fused width. A copy of the new tokens is one small kernel; the torch write it would fall back to is four."""
    if not cuda_library.write_fits(pool, key, value):
        key, value = key.contiguous(), value.contiguous()
    return cuda_library.write_slots(pool, key, value, *indices_and_copies)


def _write_slots_torch(pool, key, value, write_block, write_offset, copy_src, copy_dst, copies: bool) -> None:
    """:func:`_write_slots` in torch ops. A quantized pool's bytes move as bytes (index copies of float8 are not
    implemented everywhere)."""
    quantized = pool.element_size() == 1          # float8
    target = pool.view(torch.uint8) if quantized else pool
    if copies:
        target[copy_dst] = target[copy_src]
    for kv, stored in enumerate((key, value)):
        target[write_block, kv, write_offset] = stored.view(torch.uint8) if quantized else stored


def _copy_blocks_torch(pool: torch.Tensor, copy_src: torch.Tensor, copy_dst: torch.Tensor) -> None:
    """One pool's copy-on-write copies ``pool[copy_dst] = pool[copy_src]`` in torch ops, as :func:`_write_slots_torch`
    copies them (the all-layer copy's CPU form: :data:`cpu_layer_copies`)."""
    target = pool.view(torch.uint8) if pool.element_size() == 1 else pool
    target[copy_dst] = target[copy_src]


# The write as an operator for torch.compile: inductor calls it as it is. Lowered to its own Triton kernel, the write
# into the pool (a graph input it mutates) was autotuned on first use, which copies every mutated argument to the host
# first: the whole pool, or its whole virtual reservation under memory="vmm" (out of memory on an H200).
@torch.library.custom_op("hf_cascade::write_slots", mutates_args=("pool",))
def _write_slots_op(pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor, write_block: torch.Tensor,
                    write_offset: torch.Tensor, copy_src: torch.Tensor, copy_dst: torch.Tensor, copies: bool) -> None:
    _write_slots(pool, key, value, write_block, write_offset, copy_src, copy_dst, copies)


@_write_slots_op.register_fake
def _write_slots_fake(pool, key, value, write_block, write_offset, copy_src, copy_dst, copies) -> None:
    return None


@dataclass
class CacheStats:
    """Memory accounting of a :class:`CascadeCache`, from :meth:`CascadeCache.stats`.

    Bytes count K and V of all layers together. A dense per-row cache (transformers' DynamicCache)
    would hold about ``tokens_logical / tokens_stored`` times ``kv_bytes_in_use``.

    Attributes:
        kv_bytes_in_use: bytes in blocks that some row holds now (whole blocks, partly filled ones
            included).
        peak_kv_bytes_in_use: the largest ``kv_bytes_in_use`` since the cache was created or last
            reset: the smallest ``max_kv_bytes`` the same call would have fitted in.
        kv_bytes_reserved: bytes the layers' pools hold from the device (allocated, or mapped for
            ``memory="vmm"``): at least ``kv_bytes_in_use``, more where a pool grew ahead of need.
        blocks_in_use: blocks some row holds (a block shared by several rows counts once).
        blocks_shared: blocks held by more than one row (prompt blocks shared by beams/samples).
        tokens_stored: distinct tokens physically stored (a shared token counts once; pads are not stored).
        tokens_logical: tokens a dense per-row cache would hold: rows x sequence length, pads included.
    """

    kv_bytes_in_use: int
    peak_kv_bytes_in_use: int
    kv_bytes_reserved: int
    blocks_in_use: int
    blocks_shared: int
    tokens_stored: int
    tokens_logical: int


class CascadeLayer(CacheLayerMixin):
    """One layer's KV pool. Bookkeeping lives in the owning :class:`CascadeCache`."""

    is_compileable = False      # no auto-compile and no 4D masks from generate
    is_sliding = False

    def __init__(self, cache: "CascadeCache", layer_idx: int):
        super().__init__()
        # the owning cache, weakly: no reference cycle, so a dropped cache frees its pools at once (without gc)
        self._cache = weakref.ref(cache)
        self.layer_idx = layer_idx
        self.storage = None   # a memory.make_storage(...) object, created with the first K/V
        self.step_pool = None  # the pool tensor this step's write used (and its attention reads)

    @property
    def cache(self) -> "CascadeCache":
        return self._cache()

    def __getstate__(self):
        # copied or pickled with its cache, which links the copy to itself (CascadeCache.__setstate__)
        return {**self.__dict__, "_cache": None, "step_pool": None}

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, num_heads, _, head_dim = key_states.shape
        block_shape = (2, self.cache.block_size, num_heads, head_dim)
        config = self.cache.cascade_config
        pool_dtype = config.kv_torch_dtype or key_states.dtype      # CascadeConfig.kv_dtype: a quantized pool
        if config.kv_dtype is not None:
            kernels.check_kv_dtype(config.backend, pool_dtype, key_states.device)   # refused before any K/V is stored
        self.cache._set_block_cap(block_shape, pool_dtype)
        kept = self.storage
        if kept is None or (kept.block_shape, kept.dtype, kept.device) != (block_shape, pool_dtype, key_states.device):
            keep = keep_bytes_of(config.keep_kv_bytes, key_states.device, len(self.cache.layers))
            self.storage = make_storage(block_shape, pool_dtype, key_states.device, config.memory,
                                        self.cache.blocks.max_blocks, keep_bytes=keep)
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True

    @property
    def pool(self) -> torch.Tensor:
        """``[num_blocks, 2, block_size, kv_heads, head_dim]`` (a quantized one carrying its scales:
        :func:`hf_cascade.kernels.base.kv_scale`)."""
        return self._with_scale(self.storage.tensor)

    def _with_scale(self, pool: torch.Tensor) -> torch.Tensor:
        return pool if self.storage.scale is None else with_kv_scale(pool, self.storage.scale)

    def update(self, key_states, value_states, *args, **kwargs):
        return self.cache.update(key_states, value_states, self.layer_idx, *args, **kwargs)

    def ready_pool(self, key_states: torch.Tensor, value_states: torch.Tensor, plan: StepPlan) -> None:
        """Make the pool this step writes into ready (created with the first K/V, grown for the step's blocks): host
        work, before :meth:`write`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_fits(key_states)
        pool = self.storage.ensure(self.cache.blocks.capacity)
        # a static step: an address and a shape that stay for the call (a captured graph holds both)
        self.step_pool = self._with_scale(self.storage.stable_view() if plan.static else pool)

    def use_static_pool(self, key_states: torch.Tensor) -> None:
        """:meth:`ready_pool` for a static step that made every initialized layer's pool ready when it began
        (CascadeCache._begin_step_shape): no host work, which a compiled step traces."""
        self._check_fits(key_states)
        self.step_pool = self._with_scale(self.storage.stable_view())

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, plan: StepPlan) -> None:
        """Copy-on-write copies, then this step's new tokens into their slots of the ready pool (tensor work only;
        quantized first for a quantized pool: :meth:`hf_cascade.memory.BlockStorage.encode`, or by the write's kernel
        once the scales are fixed, :func:`hf_cascade.kernels.cuda_library.write_slots_fp8`)."""
        pool = self.step_pool
        dp = plan.on(pool.device)
        _, num_heads, _, head_dim = key_states.shape
        flat = []
        for states in (key_states, value_states):
            rows = states.transpose(1, 2).reshape(-1, num_heads, head_dim)      # [R*q, H, D], row-major
            flat.append(rows if dp.src_index is None else rows.index_select(0, dp.src_index))
        # (a static step's copy pairs are padded to its rows: always copied, unless its plan says it copies no block;
        # others only where there are some)
        copies = plan.copies and (plan.static or bool(dp.copy_src.numel()))
        indices = (dp.write_block, dp.write_offset, dp.copy_src, dp.copy_dst, copies)
        compiling = _is_compiling()
        if (self.storage.scale_fixed and pool.is_cuda and not compiling
                and cuda_library.write_slots_fp8(pool, *flat, self.storage.scale, *indices)):
            return      # an fp8 pool's K/V encoded inside the write's kernel (compiled, inductor fuses the encode)
        key, value = (stored.to(pool.device) for stored in self.storage.encode(*flat))
        args = (pool, key, value, *indices)
        if compiling:      # one opaque operator: inductor neither re-generates nor autotunes a write into the pool
            torch.ops.hf_cascade.write_slots(*args)
        else:
            _write_slots(*args)

    def _check_fits(self, key_states) -> None:
        _, num_heads, _, head_dim = key_states.shape
        _, _, pool_heads, pool_dim = self.storage.block_shape
        quantized = self.storage.scale is not None
        expected = self.dtype if quantized else self.storage.dtype     # a quantized pool takes the first K/V's dtype
        if (num_heads, head_dim, key_states.dtype) != (pool_heads, pool_dim, expected):
            raise ValueError(
                f"CascadeCache layer {self.layer_idx} stores K/V with {pool_heads} heads x {pool_dim} dims in "
                f"{expected}, but got {num_heads} x {head_dim} in {key_states.dtype}: the cache was filled "
                "by another model or config. Call cache.reset() or use a new CascadeCache.")

    def get_seq_length(self) -> int:
        return self.cache.logical_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.logical_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self, keep_storage: bool = False) -> None:
        """Give the pool's memory back (a vmm pool may keep ``keep_kv_bytes`` mapped for the next call);
        the next K/V may come with another shape. ``keep_storage``: keep the storage object (a vmm pool's
        reserved address range, nothing mapped) so that the next call's pool has the same address."""
        if self.storage is not None:
            self.storage.release()
            if self.storage.nbytes == 0 and not keep_storage:
                self.storage = None
        self.is_initialized = False

    def free_storage(self) -> None:
        """Drop the pool's storage and all its memory now, what ``keep_kv_bytes`` keeps included (a vmm pool's
        reserved range too): the next K/V makes a new one."""
        if self.storage is not None:
            self.storage.close()
            self.storage = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx):
        raise RuntimeError("CascadeLayer is reordered by its CascadeCache (cache.reorder_cache), never alone.")


class CascadeCache(Cache):
    """A paged KV cache whose rows share blocks: prompts stored once for all their beams/samples.

    Pass it to ``generate`` as ``cache=`` (transformers >= 5.24) or ``past_key_values=`` (earlier); keep
    a reference to read :meth:`stats` afterwards and call :meth:`reset` to give its memory back.

    Args:
        config: the model config (``model.config``; sets the number of layers up front; needed with
            ``max_kv_bytes``). Without it, layers are added as ``update`` first sees them.
        cascade_config: a :class:`CascadeConfig` or a dict of its fields (backend, block size, memory policy).

    Copies: ``copy.deepcopy(cache)`` is an independent cache holding the same tokens (transformers' prompt-reuse
    idiom: prefill a common prefix once, deep-copy it per question, continue each copy); it shares nothing mutable
    with the original (block tables, reference counts and pools are copied). ``pickle`` and
    ``torch.save``/``torch.load(weights_only=False)`` round-trip a cache as they do a DynamicCache. What belongs
    to a step or a generate call in progress (the step context, the decode layout, a graph runner) is not
    copied. A ``memory="vmm"`` pool comes back as a plain ``"grow"`` pool holding the same blocks (a virtual
    address range cannot be copied); ``static`` and ``grow`` pools come back as they were.

    Raises:
        TypeError: ``config`` is not a model config (e.g. a CascadeConfig passed first), or
            ``cascade_config`` is neither a CascadeConfig nor a dict of its fields.
        ValueError: ``max_kv_bytes`` without ``config``, or a ``max_kv_bytes`` that cannot hold one
            block of all layers. One block's bytes are estimated from the model config:
            ``2 x block_size x kv_heads x head_dim x bytes per element x layers``, with kv heads from
            ``num_key_value_heads`` (else the attention heads), head_dim from ``head_dim`` (else
            hidden size / heads), the element size from ``config.dtype`` (``torch_dtype`` before it)
            and 2 bytes where the config names no dtype. The exact check runs again when the first
            K/V arrives.
    """

    def __init__(self, config=None, cascade_config: CascadeConfig | dict | None = None):
        cascade_config = CascadeConfig.coerce(cascade_config)
        if config is not None and not hasattr(config, "get_text_config"):
            raise TypeError(f"CascadeCache's first argument is the model config (model.config), got "
                            f"{type(config).__name__}. Use CascadeCache(model.config, cascade_config).")
        if cascade_config.max_kv_bytes is not None:
            if config is None:
                raise ValueError("CascadeCache(max_kv_bytes=...) needs the model config: "
                                 "CascadeCache(model.config, cascade_config).")
            _check_cap_holds_a_block(config, cascade_config)
        self.cascade_config = cascade_config
        num_layers = config.get_text_config(decoder=True).num_hidden_layers if config is not None else 0
        super().__init__(layers=[CascadeLayer(self, i) for i in range(num_layers)])
        self.block_size = self.cascade_config.block_size
        self.blocks = BlockManager(self.block_size)
        self.logical_length = 0
        self.model_fingerprint = None        # set by the generate entry; guards reuse with another model
        self._context: StepContext | None = None
        self._step_id = 0
        self._next_write_mask: np.ndarray | None = None
        self._peak_blocks = 0
        # the threshold of the backends the layers' shapes get (None: not chosen yet; the pools' shapes decide it)
        self._backend_min_saved_tokens: int | None = None
        self._layout: DecodeLayout | None = None
        # the last calls' layouts (the latest first), kept by reset_for_reuse for the runner's kept steps
        self._kept_layouts: tuple[DecodeLayout, ...] = ()
        self._decode_max_length: int | None = None
        self._decode_start = 0        # the logical length when the decode began (decode tokens made = the rest)
        # set by the generate entry when beam search filled it: its rows are the running beams, not the sequences
        # generate returned (a flag of the cache, so that it travels with copies)
        self._filled_by_beam_search = False
        # the all-layer copy's pool addresses per device: {device: (addresses, int64 tensor of them there, tensors it
        # replaced)}, made on first use (None: none made yet; see _pool_addresses_on)
        self._pool_addresses: dict | None = None

    # ---- copies (copy.deepcopy, pickle, torch.save) ---------------------------------------------------
    # what belongs to a step or a generate call in progress: never copied (a copy starts between calls)
    _TRANSIENT = {"_context": None, "_layout": None, "_kept_layouts": (), "_decode_max_length": None,
                  "_pool_addresses": None}

    def __getstate__(self):
        return {**self.__dict__, **self._TRANSIENT}

    def __setstate__(self, state):
        self.__dict__.update(state)
        for layer in self.layers:
            layer._cache = weakref.ref(self)

    # ---- transformers' Cache API ------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Store this step's K/V of layer ``layer_idx``; returns them (in autocast's dtype under autocast: one pool
        dtype for both, as stock's attention computes on them; :mod:`hf_cascade.precision`)."""
        key_states, value_states = as_computed(key_states, value_states)
        ctx = self._context
        # a static decode step that began before this layer (its pools made ready then) takes no host work: tensor
        # writes and dict updates only, which a compiled forward traces; anything else begins or checks on the host
        if (ctx is None or ctx.finished or ctx.unread or layer_idx in ctx.written or not ctx.plan.static
                or layer_idx >= len(self.layers) or not self.layers[layer_idx].is_initialized or self.offloading):
            ctx = self._host_update(key_states, value_states, layer_idx)
            layer = self.layers[layer_idx]
        else:
            layer = self.layers[layer_idx]
            layer.use_static_pool(key_states)
        layer.write(key_states, value_states, ctx.plan)
        ctx.written[layer_idx] = (layer, key_states.shape)
        ctx.unread.add(layer_idx)
        # the context reaches this layer's attention call as an argument, in the dict transformers splats into it;
        # where update gets no such dict (transformers < 5.24, or a modeling file that passes none, e.g. GPT-NeoX),
        # through the one per-thread channel (not in a compiled forward: the graph runner passes the context as the
        # forward's argument there)
        attention_kwargs = kwargs.get("kwargs") if UPDATE_PASSES_KWARGS else None
        if attention_kwargs is not None:
            attention_kwargs[STEP_KWARG] = ctx
        elif not _is_compiling():
            set_context(ctx)
        return key_states, value_states

    @torch.compiler.disable        # host bookkeeping: a compiled forward calls it eagerly (graph break)
    def _host_update(self, key_states, value_states, layer_idx: int) -> StepContext:
        """The step ``update`` writes layer ``layer_idx`` into (the one in progress, or a new one: checks first), and
        the layer's pool made ready for it."""
        if self.offloading:
            raise ValueError("CascadeCache does not offload layers to the CPU.")
        while len(self.layers) <= layer_idx:
            self.layers.append(CascadeLayer(self, len(self.layers)))
        ctx = self._context
        if ctx is not None and ctx.unread:
            unread = next(iter(ctx.unread))
            ctx.unread.clear()
            raise RuntimeError(
                f"The K/V that CascadeCache stored for layer {unread} were not read by the cascade "
                "attention: the model does not run attn_implementation='cascade'. Load it with "
                "attn_implementation='cascade' (after `import hf_cascade`), or use a DynamicCache.")
        if ctx is None or ctx.finished or layer_idx in ctx.written:
            ctx = self._begin_step(key_states)
        self.layers[layer_idx].ready_pool(key_states, value_states, ctx.plan)
        return ctx

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._mask_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        ctx = self._context
        if ctx is not None and not ctx.finished and not ctx.written and not _is_compiling():
            # a step begun before the forward (prepare_step, begin_planned_step) already counts its tokens: this
            # forward's mask must not count them twice (a fresh step reads the mask's last columns as its own tokens)
            return self._mask_length(), 0
        return self._mask_length() + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._mask_length()

    def _mask_length(self) -> int:
        """The length the model is told (its mask function, ``get_seq_length``): the logical length, except in a
        compiled static decode step, whose attention builds no mask (it reads each row's tokens from the pool; a dense
        path there is refused) and whose positions are inputs (the graph runner serves no model that computes them
        from the cache length: a captured step would replay the first step's): a length fixed for the layout, so that
        the compiled forward does not depend on the length, which changes every step (BART's decoder reads it, for
        positions the device positions replace: patches/positions.py). It follows the layout's bucketed shapes
        (``DecodeLayout.mask_length``), not the prompt's length: one graph serves a range of prompt lengths."""
        ctx = self._context
        if _is_compiling() and ctx is not None and ctx.plan.static:
            return ctx.plan.layout.mask_length
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
        self._end_step()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes ``repeats`` rows sharing its blocks (a fork; no K/V copied)."""
        self.blocks.fork(int(repeats))
        self._end_step()

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
        self._end_step()

    def reset(self) -> None:
        """Return every block to the pool and the pools' memory to the device; the cache becomes empty."""
        self._reset(keep=False)

    def free_memory(self) -> None:
        """:meth:`reset`, then every pool's storage dropped with all its memory, what ``keep_kv_bytes`` keeps and a vmm
        pool's reserved address range included (:func:`hf_cascade.release` does this to what generate kept)."""
        for layer in self.layers:       # (first: the reset then has no pool to shrink to keep_kv_bytes)
            layer.free_storage()
        self._reset(keep=False)

    def reset_for_reuse(self) -> None:
        """Like :meth:`reset`, but keep what a captured decode graph points at for a next call of the same
        shape: the pools' storage objects (their addresses; a vmm pool keeps nothing mapped beyond
        ``keep_kv_bytes``) and the last calls' decode layouts (their buffers; :data:`KEPT_LAYOUTS`, the latest first).
        The runner is kept beside it (:mod:`hf_cascade.session`)."""
        self._reset(keep=True)

    def _reset(self, keep: bool) -> None:
        self.blocks.release()
        for layer in self.layers:
            layer.reset(keep_storage=keep)
        self.logical_length = 0
        self.model_fingerprint = None
        self._context, self._next_write_mask = None, None
        if keep and self._layout is not None:      # not released: the kept runner's graph points at its buffers
            kept = (self._layout,) + self._kept_layouts
            self._kept_layouts, self._layout = kept[:KEPT_LAYOUTS], None
            for layout in kept[KEPT_LAYOUTS:]:
                layout.release()
        elif not keep:
            for layout in self._kept_layouts:
                layout.release()
            self._kept_layouts = ()
        self.end_decode()
        self._peak_blocks = 0
        self._backend_min_saved_tokens = None
        reset_context(self)

    # ---- cascade specifics --------------------------------------------------------------------
    def set_write_mask(self, mask) -> None:
        """Only the tokens where ``mask`` [rows, q_len] is true are stored in the next forward (drops padding)."""
        mask = np.asarray(mask.detach().cpu() if isinstance(mask, torch.Tensor) else mask).astype(bool)
        self._next_write_mask = mask

    def stats(self) -> CacheStats:
        """The cache's memory accounting now (:class:`CacheStats`); cheap, no device synchronisation.
        Read it before :meth:`reset`, which empties the cache and restarts the peak."""
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
        return None if self._context is None else self._context.plan

    @property
    def step(self) -> StepContext | None:
        """The context of the step in progress (None between steps)."""
        return self._context

    # ---- static decoding (inside generate) ------------------------------------------------------
    def begin_decode(self, max_length: int) -> None:
        """From the next one-token-per-row step on, plan decode steps on a static layout until :meth:`end_decode`;
        see DecodeLayout. ``max_length`` (generate's, padding included) only caps the layout's capacity, which
        follows the tokens made: room for a few steps first, widened geometrically as rows grow
        (:func:`~hf_cascade.plan.decode_room`)."""
        self.end_decode()
        self._decode_max_length = int(max_length)
        self._decode_start = self.logical_length

    def end_decode(self) -> None:
        if self._layout is not None:
            self._layout.release()
        self._layout, self._decode_max_length = None, None

    def attention_horizon(self, static: bool) -> int:
        """The longest sequence a step's attention must be right for: for a static decode step the capacity of the
        layout in force (a captured graph replays the step while rows grow up to it; a row that would pass it
        widens the layout, and the graph is captured again, deciding anew), else the current (padded) length.
        A sliding window at least this long cuts nothing and may be left out."""
        if static and self._layout is not None:
            return max(self._layout.max_row_tokens, self.logical_length)
        return self.logical_length

    @property
    def decode_steps_left(self) -> int | None:
        """One-token steps the decode begun (:meth:`begin_decode`) can still take before its ``max_length`` (None when
        none is begun)."""
        return None if self._decode_max_length is None else self._decode_max_length - self.logical_length

    def _decode_room(self) -> int:
        """New tokens per row the next decode layout makes room for (see plan.decode_room)."""
        return decode_room(self.logical_length - self._decode_start, self._decode_max_length - self.logical_length)

    @property
    def layout(self) -> DecodeLayout | None:
        """The static decode layout in force (None outside generate's decode steps)."""
        return self._layout

    @property
    def kept_layouts(self) -> tuple[DecodeLayout, ...]:
        """The last calls' layouts kept for a next call (:meth:`reset_for_reuse`), the latest first."""
        return self._kept_layouts

    def prepare_step(self, num_rows: int, q_len: int = 1) -> StepContext:
        """Begin a step before the forward runs (the graph runner: the plan must be uploaded before a
        replay); the forward's layers then write into this step."""
        return self._begin_step_shape(num_rows, q_len)

    def begin_planned_step(self, device: torch.device, copies: bool = True) -> StepContext:
        """Begin a static decode step whose block bookkeeping and plan the device computed
        (:mod:`hf_cascade.whole_step`): the layers read the layout's buffers as the device wrote them. Neither the
        block manager nor ``logical_length`` change here: the caller owns the device state (and hands it back with
        :meth:`restore_blocks`) and counts the steps. ``copies=False``: the holder knows that no row appends to a block
        another row holds (no copy-on-write): the layers launch no copy."""
        if self._layout is None:
            raise RuntimeError("begin_planned_step needs the static decode layout of a decode in progress")
        self._end_step()
        plan = self._layout.planned_step(device, copies)
        if copies and self._copy_blocks_of_all_layers(plan, device):
            plan = self._layout.planned_step(device, copies=False)      # (copied: the layers launch no copy)
        return self._new_context(plan)

    def restore_blocks(self, tables, lengths, refcount, logical_length: int, peak_blocks: int = 0) -> None:
        """Take back the block state that device steps reached (see :meth:`begin_planned_step`)."""
        self._end_step()
        self.blocks.restore(tables, lengths, refcount)
        self.logical_length = int(logical_length)
        self._peak_blocks = max(self._peak_blocks, int(peak_blocks), self.blocks.blocks_in_use)

    def rewind_step(self) -> None:
        """Let the current step's layers write again (a capture re-runs the step just run: same slots,
        same values)."""
        if self._context is not None:
            self._context.rewind()

    def end_step(self) -> None:
        """End the step in progress (the end of a generate call: a finished cache keeps no step context)."""
        self._end_step()

    def _block_bytes_all_layers(self) -> int:
        return sum(l.storage.block_nbytes for l in self.layers if l.storage is not None)

    def _set_block_cap(self, block_shape, dtype) -> None:
        """Translate max_kv_bytes into a block cap when the first layer learns its block size."""
        cap = self.cascade_config.max_kv_bytes
        if cap is None or self.blocks.max_blocks is not None:
            return
        per_layer = torch.empty((), dtype=dtype).element_size() * int(np.prod(block_shape))
        block_bytes = per_layer * len(self.layers)
        max_blocks = cap // block_bytes
        if max_blocks < 1:
            raise ValueError(f"max_kv_bytes={cap} holds less than one block ({block_bytes} bytes "
                             "over all layers); raise it or lower CascadeConfig.block_size.")
        self.blocks.max_blocks = int(max_blocks)
        self.blocks.cap_hint = (f"raise CascadeConfig.max_kv_bytes (now {cap} bytes: {max_blocks} blocks of "
                                f"{block_bytes} bytes over all layers)")

    def _begin_step(self, key_states: torch.Tensor) -> StepContext:
        num_rows, num_heads, q_len, head_dim = key_states.shape
        # the cap in blocks, known now from the K/V: checked before any state changes, and append then
        # refuses (PoolExhausted) before taking a block
        self._set_block_cap((2, self.block_size, num_heads, head_dim),
                            self.cascade_config.kv_torch_dtype or key_states.dtype)
        return self._begin_step_shape(num_rows, q_len)

    def _begin_step_shape(self, num_rows: int, q_len: int) -> StepContext:
        """Bookkeeping of one forward step, once for all layers: rows, blocks, plan, context."""
        self._end_step()
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
        static = (self._decode_max_length is not None and q_len == 1 and mask is None
                  and self.blocks.num_rows and bool((self.blocks.lengths > 0).all()))
        if static and self._layout is None:
            self._layout = self._freeze_layout()
        append_plan = self.blocks.append(counts)
        plan = None
        if static:
            try:
                plan = self._layout.step(self.blocks.tables(), self.blocks.lengths, append_plan)
            except LayoutOutgrown as err:     # rows outgrew the capacity (or left the frozen levels)
                old, prev = self._layout, self.blocks.lengths - counts
                old.release()
                if err.capacity:
                    self._layout = old.widened(prev, self._decode_room())
                    logger.info("decode layout widened to %d blocks per row (%s; %d decode tokens made)",
                                self._layout.suffix_width, str(err), self.logical_length - self._decode_start)
                else:
                    logger.info("decode layout re-planned (%s)", str(err))
                    self._layout = self._freeze_layout(prev)
                plan = self._layout.step(self.blocks.tables(), self.blocks.lengths, append_plan)
        if plan is None:
            plan = build_step_plan(self.blocks.tables(), self.blocks.lengths, counts, mask, q_len, append_plan,
                                   self.block_size, self.cascade_config.min_group_rows,
                                   self.cascade_config.min_prefix_tokens, self._min_saved_tokens())
        if plan.static:     # every layer's pool ready for the step now: the layers' writes do no host work
            for layer in self.layers:
                if layer.is_initialized:
                    layer.storage.ensure(self.blocks.capacity)
            self.follow_pool_addresses()
            if plan.copies and self._copy_blocks_of_all_layers(plan):
                plan.copies = False             # (a plan of this step alone: the layers launch no copy)
        self._new_context(plan)
        self.logical_length += q_len
        self._peak_blocks = max(self._peak_blocks, self.blocks.blocks_in_use)
        return self._context

    # ---- a static step's copies of every layer at once ----------------------------------------------------------
    def _copy_blocks_of_all_layers(self, plan: StepPlan, device=None) -> bool:
        """The copy-on-write copies of the static step ``plan`` (its pairs padded to the rows, on the layout's buffers)
        in every layer's pool at once, as the step begins (on the current stream: inside the graph where the step is
        captured), where it can: every layer's pool initialized on ``device`` (default: the first layer's) with blocks
        of one size, not while torch.compile traces; on CUDA with ``cuda_library.layer_copies`` on, one launch of the
        library's kernel over the pools' addresses (:meth:`_pool_addresses_on`); on the CPU with
        :data:`cpu_layer_copies` on, torch copies layer by layer. Returns whether it copied: the layers' writes then
        pass ``copies=False``. Nothing writes a source block between the step's start and a layer's write, and every
        layer's pairs are the same: the copies are those each layer's write would make."""
        if not (cuda_library.layer_copies or cpu_layer_copies):     # (off: every planned step asks)
            return False
        if not plan.static or not plan.copies or _is_compiling() or not self.layers:
            return False
        if not all(layer.is_initialized for layer in self.layers):
            return False
        storages = [layer.storage for layer in self.layers]
        device = storages[0].device if device is None else torch.device(device)
        cuda = device.type == "cuda"
        if not (cuda_library.layer_copies if cuda else cpu_layer_copies):
            return False
        dp = plan.on(device)        # (by the name the step's plan has it under: a planned step's, uploaded by none)
        if cuda and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        block_bytes = storages[0].block_nbytes
        if any(s.block_nbytes != block_bytes or s.device != device for s in storages):
            return False
        if not cuda:
            for storage in storages:
                _copy_blocks_torch(storage.stable_view(), dp.copy_src, dp.copy_dst)
            return True
        addresses = self._pool_addresses_on(device)
        return addresses is not None and cuda_library.copy_blocks_layers(addresses, dp.copy_src, dp.copy_dst,
                                                                         block_bytes)

    def _pool_addresses_on(self, device: torch.device, make: bool = True) -> torch.Tensor | None:
        """An int64 tensor on ``device`` of every layer's pool base address (``storage.stable_view()``, in layer order),
        as the pools lie now: made once (``make``), rewritten in place where a pool moved, only outside a CUDA graph
        capture (an upload); None inside one where it is not up to date, or where a pool cannot be read so (none yet,
        empty, not contiguous, not 16-byte aligned). A captured step reads it by address and replays only on the pools
        it was captured on (graphs.pool_signature, in its key): the tensor keeps its address and always holds the
        pools' current addresses (:meth:`follow_pool_addresses`)."""
        views = [None if layer.storage is None else layer.storage.stable_view() for layer in self.layers]
        if not views or any(v is None or not v.is_contiguous() or v.device != device or v.data_ptr() == 0
                            or v.data_ptr() % 16 for v in views):
            return None
        addresses = tuple(v.data_ptr() for v in views)
        known = self._pool_addresses = {} if self._pool_addresses is None else self._pool_addresses
        found = known.get(str(device))
        if found is not None and found[0] == addresses:
            return found[1]
        if (found is None and not make) or capture_underway():
            return None
        values = torch.tensor(addresses, dtype=torch.int64)
        if found is not None and found[1].shape == values.shape:
            tensor, replaced = found[1], found[2]
            tensor.copy_(values)            # (in place, stream-ordered: a kept graph reads it by address)
        else:       # (a new count of layers: a graph captured on the old tensor keeps it alive here)
            tensor, replaced = values.to(device), (() if found is None else (*found[2], found[1]))
        known[str(device)] = (addresses, tensor, replaced)
        return tensor

    def follow_pool_addresses(self) -> None:
        """Rewrite the all-layer copy's pool addresses (made so far) where a pool moved: a ``grow`` pool that grew,
        pools of a new call. Called where pools are made ready for static steps (a host step's begin, a device hold
        before its first step or replay: hf_cascade.decode.whole_step.BlocksHold.take), outside any capture."""
        for key in list(self._pool_addresses or ()):
            self._pool_addresses_on(torch.device(key), make=False)

    def _new_context(self, plan) -> StepContext:
        """The one place a step's context is made: every step of this cache, planned on the host or on the device."""
        self._step_id += 1
        self._context = StepContext(self, plan, self._step_id)
        return self._context

    def _layer_backends(self) -> list:
        """The backends the layers' shapes get (device, dtype, KV heads, head_dim, block size; one per distinct
        shape, as a decode step without quirks would choose them), or [] before any layer holds a pool."""
        chosen = {}
        for layer in self.layers:
            storage = layer.storage
            if storage is None or not storage.num_blocks:
                continue
            key = (storage.block_shape, storage.dtype, str(storage.device))
            if key not in chosen:
                pool = layer.pool
                q = pool.new_empty((1, 1, pool.shape[3], pool.shape[4]), dtype=layer.dtype)
                try:
                    chosen[key] = kernels.select(self.cascade_config.backend, q, pool)
                except Exception:   # noqa: BLE001 — the step itself will report what is wrong
                    chosen[key] = None
        return [b for b in chosen.values() if b is not None]

    def _min_saved_tokens(self) -> int:
        """Where a cascade pays in this cache's plans: the config's threshold, else the strictest declared by the
        backends of the layers' shapes (chosen once the pools exist, kept until reset)."""
        saved = self.cascade_config.min_saved_tokens
        if saved is not None:
            return saved
        if self._backend_min_saved_tokens is None:
            backends = self._layer_backends()
            if not backends:
                return 0       # nothing stored yet: a fresh step, which shares nothing
            self._backend_min_saved_tokens = max(b.min_saved_tokens for b in backends)
        return self._backend_min_saved_tokens

    def _end_step(self) -> None:
        """The step in progress is over."""
        self._context = None

    def _freeze_layout(self, prev_lengths=None) -> DecodeLayout:
        backends = self._layer_backends()
        prev = self.blocks.lengths if prev_lengths is None else prev_lengths
        layout = DecodeLayout.freeze(self.blocks.tables(), prev, self.block_size, self._decode_room(),
                                     self.cascade_config.min_group_rows, self.cascade_config.min_prefix_tokens,
                                     self._min_saved_tokens(),
                                     solo_rows=bool(backends) and all(b.solo_prefix for b in backends))
        # a kept layout whose buffers (and the graph that points at them) fit: its capacity is what a call of this
        # shape came to need; a call of another prompt length whose rows share as that call's did hands it its
        # prefix tables and lengths
        found = next((kept for kept in self._kept_layouts if kept.holds(layout) or kept.adopt(layout)), None)
        if found is None:       # the kept layouts the new one would serve are outgrown: no later call needs them
            covered = {id(kept) for kept in self._kept_layouts if layout.serves(kept)}
            for kept in self._kept_layouts:
                if id(kept) in covered:
                    kept.release()
            self._kept_layouts = tuple(kept for kept in self._kept_layouts if id(kept) not in covered)
            return layout
        self._kept_layouts = tuple(kept for kept in self._kept_layouts if kept is not found)
        return found


def _check_cap_holds_a_block(config, cascade_config: CascadeConfig) -> None:
    """Refuse a ``max_kv_bytes`` below one block of all layers, estimated from the model config (see
    :class:`CascadeCache`), before the cache holds any state."""
    text = config.get_text_config(decoder=True)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = (getattr(text, "num_key_value_heads", None) or getattr(text, "num_kv_heads", None)
                or (1 if getattr(text, "multi_query", False) else heads))
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    layers = getattr(text, "num_hidden_layers", None)
    if not (kv_heads and head_dim and layers):
        return          # not a shape we can read: the exact check runs with the first K/V
    dtype = getattr(text, "dtype", None) or getattr(text, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    itemsize = torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 2
    if cascade_config.kv_dtype is not None:
        itemsize = torch.empty((), dtype=cascade_config.kv_torch_dtype).element_size()
    block_bytes = 2 * cascade_config.block_size * kv_heads * head_dim * itemsize * layers
    cap = cascade_config.max_kv_bytes
    if cap < block_bytes:
        raise ValueError(
            f"CascadeConfig.max_kv_bytes={cap} holds less than one KV block of this model ({block_bytes} bytes: "
            f"2 x block_size {cascade_config.block_size} x {kv_heads} KV heads x head_dim {head_dim} x {itemsize} "
            f"bytes x {layers} layers). Raise max_kv_bytes (it counts bytes, e.g. 4e9 for 4 GB) or lower "
            "block_size.")
