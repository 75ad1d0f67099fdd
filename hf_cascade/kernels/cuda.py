"""CUDA backend: the kernels of ``csrc/`` (one shared library, loaded with ctypes).

Three kernels per layer, all on ``torch.cuda.current_stream()`` and with no host-device synchronisation:

1. prefix (level 0, ``csrc/prefix.cu``; ``csrc/prefix_sm90.cu`` on Hopper): one CTA per (prefix chunk x row tile,
   KV head, group), all of a group's query rows for that KV head against the chunk's K/V tiles on tensor cores; one
   partial (O, LSE) per chunk;
2. suffix (level 1, ``csrc/suffix.cu``): each row's queries against its own suffix (optionally split for long
   suffixes);
3. merge (``csrc/merge.cu``): log-sum-exp of all partials of a row into the output, in q's dtype.

Where no row shares its prefix (groups of one row: greedy search, one sample per prompt) and ``cuda_tuning.solo_kernel``
is on, a plain layer (no softcap, window or sinks; K/V in q's dtype) of a decode step runs one launch instead
(``csrc/solo.cu``): each row's prefix and suffix split over the GPU, the last CTA of each row and KV head merging the
splits. The step state holds both launches' metadata; the other layers of the step run the three kernels.

An fp8 pool (``CascadeConfig(kv_dtype="float8_e4m3fn")``: float8_e4m3fn with its scales, :mod:`hf_cascade.kernels.base`)
is read by the same kernels: they convert the fp8 values to q's dtype in registers (exact; the prefix kernel stages the
bytes with 16-byte copies, twice the elements of a bf16 copy, and converts them into its MMA operands) and apply the
KV head's K scale to the scores and its V scale to the output, once per CTA; its prefix level runs the portable
kernel's default configuration (not the Hopper kernel nor a tuning variant: they read 16-bit pools only).

A three-level plan (a system prompt shared by a batch, each prompt's rest shared by its beams, each row's suffix)
runs the prefix kernel twice, for the group prefix and for the middle level (its partials in the slots after the
group prefix's), and the suffix kernel on the inner suffix; the merge reads the three ranges of slots of each row.

Per-layer variants (``CudaBackend.quirks``), runtime scalars of the launches (a CUDA graph bakes them; the plain path's code is
unchanged, the kernels take a compiled-in variant branch only when one is on): a logit softcap and a sliding window
in the prefix and suffix kernels, attention sinks as one more partial in the merge. The window is applied in the
kernels from the device-side lengths (``prefix_len``, ``q_limit``): they skip whole chunks and K/V tiles before a
CTA's earliest visible token and mask the edge, and the launch shapes never depend on the window. A layer with a
window reads a three-level plan as two levels (the window is defined over the group prefix and the row's suffix,
as in :mod:`hf_cascade.kernels.reference`).

This module is the backend (the step state, the launches of one layer); below it:

- :mod:`hf_cascade.kernels.cuda_library`: where the library comes from (prebuilt, or built with nvcc) and loading it;
- :mod:`hf_cascade.kernels.cuda_binding`: the C ABI through ctypes (the parameter structs of
  ``csrc/include/hfc/params.h``, checked against the library's own layout at load);
- :mod:`hf_cascade.kernels.cuda_tuning`: the launch geometry (which prefix kernel, row tile, chunks, suffix split)
  and the prefix kernel's tuning knobs for a sweep (``$HF_CASCADE_PREFIX_TUNE``);
- :mod:`hf_cascade.kernels.ops`: the kernels as torch operators (``torch.ops.hf_cascade.*``) for ``torch.compile``;
  eager calls go straight through ctypes (the operator dispatch costs more than the launch).

The chunking (chunk length in tokens, chunks per group, suffix splits) and the partial-output buffers are
the backend's metadata (:class:`_StepState`, from :meth:`CudaBackend.build`), derived from the plan's host arrays:
once per step, or once per generate call on a static decode layout (then the prefix chunks and the suffix split
follow the tables' capacity, not the lengths: a layout that adopts another call's values keeps its launches; the
layout keeps the state); every layer reuses them. An encoder-decoder's cross plan launches by its tables' capacity
too (``plan.launch_by_widths``): its step context, kept with the model's last call, serves a later call of shorter
sources whose values are written into the plan's device tensors.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch.compiler import is_compiling as _is_compiling   # bound once: the eager path pays for every lookup

from . import cuda_tuning, ops
from .capture import refuse_in_capture
from .base import KV_SCALED_DTYPES, AttentionParams, Backend, is_quantized, kv_scale
from .cuda_binding import (ABI_VERSION, _Lib, _MergeParams, _PrefixInfo, _PrefixParams,  # noqa: F401 (re-exported)
                           _SuffixParams)
from .cuda_library import (PREBUILT, _find_nvcc, availability, build_library, library,  # noqa: F401 (re-exported)
                           prebuilt_library)
from .cuda_tuning import (AUTO_MIN_QUERY_ROWS, AUTO_TUNE, HOPPER_KERNEL,  # noqa: F401 (re-exported)
                          MIN_CHUNK_TOKENS, MIN_SPLIT_TOKENS, PREFER_CHUNK_TOKENS, PREFIX_TUNE_ENV, PREFIX_VARIANTS, SUFFIX_CTAS_PER_SM,
                          SUFFIX_QB, PrefixTune, choose_chunk_blocks, choose_suffix_split, parse_prefix_tune,
                          prefix_tune, set_prefix_tune)
from .cuda_tuning import SOLO_CTAS_PER_SM, choose_solo_split, solo_counters
from .cuda_tuning import PrefixLevel as _PrefixLevel  # noqa: F401 (the step state's levels)
from .cuda_tuning import prefix_level as _prefix_level
from .ops import (DTYPE_CODES, HEAD_DIMS, LOG2E, MergeArgs, PrefixArgs, SoloArgs, SuffixArgs,  # noqa: F401
                  layer_args)

__all__ = ["CudaBackend", "BACKEND", "attend", "library", "availability", "prebuilt_library", "choose_chunk_blocks",
           "choose_suffix_split", "PrefixTune", "parse_prefix_tune", "prefix_tune",
           "set_prefix_tune", "PREFIX_TUNE_ENV", "PREFIX_VARIANTS"]

logger = logging.getLogger("hf_cascade")


@dataclass
class _StepState:
    has_prefix: bool
    m_tile: int
    row_tiles: int
    chunk_tokens: int
    max_chunks: int
    split_tokens: int
    nsplit: int
    slots: int
    row_nchunks: torch.Tensor     # int32 [R]: prefix partials of each row (0: in no group)
    part_o: torch.Tensor          # float32 [slots, R, Lq, Hq, D]
    part_lse: torch.Tensor        # float32 [slots, R, Lq, Hq]
    dp: object                    # the plan's DevicePlan
    # three levels: the middle level's chunks in slots [max_chunks, max_chunks + mid.max_chunks), then the suffix
    three: bool = False
    mid: _PrefixLevel | None = None
    row_nmid: torch.Tensor | None = None   # int32 [R]: middle-level partials of each row
    tune: int = 0                 # the group prefix's kernel tuning variant (PrefixTune.code; 0: the default)
    # the solo launch (csrc/solo.cu) for the step's plain layers where no row shares its prefix (solo_nsplit 0: none):
    # its split, each row's group, and its counters (int32 [R x Hkv x query blocks], 0 between launches)
    solo_split: int = 0
    solo_nsplit: int = 0
    row_group: torch.Tensor | None = None
    counters: torch.Tensor | None = None

    @property
    def suffix_slot0(self) -> int:
        return self.max_chunks + (self.mid.max_chunks if self.three else 0)


def _check_prefix_level(name, gr, pt, pl, R, bs, num_blocks) -> None:
    if gr.ndim != 2 or pt.ndim != 2 or pl.shape != (gr.shape[0],) or pt.shape[0] != gr.shape[0]:
        raise ValueError(f"inconsistent {name} plan: rows {gr.shape}, table {pt.shape}, lengths {pl.shape}")
    member = gr[gr >= 0]
    if (gr < -1).any() or (member >= R).any() or np.unique(member).size != member.size:
        raise ValueError(f"the {name} plan's rows must be distinct rows in [0, R) or -1")
    if (pl < 0).any() or (pl > pt.shape[1] * bs).any():
        raise ValueError(f"the {name} plan's lengths are outside [0, table blocks x block_size]")
    need = np.arange(pt.shape[1])[None, :] < (-(-pl.astype(np.int64) // bs))[:, None]
    _check_blocks(f"the {name} table", pt[need], num_blocks)


def _check_suffix_level(name, stb, ql, R, Lq, bs, num_blocks) -> None:
    if ql.shape != (R, Lq):
        raise ValueError(f"{name} q_limit has shape {ql.shape}, expected {(R, Lq)}")
    if stb.ndim != 2 or stb.shape[0] != R:
        raise ValueError(f"{name} suffix_table has shape {stb.shape}, expected ({R}, Ms)")
    if (ql < 0).any() or (ql > stb.shape[1] * bs).any():
        raise ValueError(f"{name} q_limit outside [0, suffix blocks x block_size]")
    need = np.arange(stb.shape[1])[None, :] < (-(-ql.max(axis=1, initial=0).astype(np.int64) // bs))[:, None]
    _check_blocks(f"{name} suffix_table", stb[need], num_blocks)


def _check_blocks(name, used, num_blocks) -> None:
    if used.size and (used.min() < 0 or used.max() >= num_blocks):
        raise ValueError(f"{name} references blocks outside the pool [0, {num_blocks}) or -1 inside the tokens it "
                         "must cover")


def _validate(plan, R, Lq, bs, num_blocks, three: bool = False) -> None:
    """Loud, cheap host checks of the plan (the kernels trust every index)."""
    _check_suffix_level("plan.", plan.suffix_table, plan.q_limit, R, Lq, bs, num_blocks)
    _check_prefix_level("prefix", plan.group_rows, plan.prefix_table, plan.prefix_len, R, bs, num_blocks)
    if three:
        _check_prefix_level("middle-level", plan.mid_group_rows, plan.mid_table, plan.mid_len, R, bs, num_blocks)
        _check_suffix_level("plan.inner_", plan.inner_suffix_table, plan.inner_q_limit, R, Lq, bs, num_blocks)


def _has_middle(plan) -> bool:
    """A three-level plan (group prefix, subgroup prefix, suffix) the kernels run as such."""
    return (plan.mid_group_rows.shape[0] > 0 and plan.mid_group_rows.shape[1] > 0 and plan.mid_table.shape[1] > 0
            and plan.inner_suffix_table is not None and plan.inner_q_limit is not None)


def _lengths_for_launch(plan, group_rows, lengths, table, bs) -> np.ndarray:
    """The prefix lengths a level's launch is planned for: the table capacity for every group that holds a row where
    the launch must not follow the lengths (a static step, a kept cross plan: ``plan.launch_by_widths``), else the
    lengths themselves."""
    if not plan.launch_by_widths:
        return lengths
    return np.where((np.asarray(group_rows) >= 0).any(axis=1), table.shape[1] * bs, 0).astype(np.int64)


def _sm_count(dev) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


def _step_state(lib: _Lib, q: torch.Tensor, pool: torch.Tensor, plan, three: bool = False, plain: bool = True
                ) -> _StepState:
    """The launch state of ``plan`` for layers of ``q``'s shape: ``three``: the plan's middle level runs as one
    (layers with a window read two levels: see CudaBackend.forward); ``plain``: no softcap / window, which matters
    only where a tuning variant may run (it serves only those: bf16, head_dim 128 in production). An fp8 pool runs
    the portable default prefix kernel, as a layer that is not plain does, or the Hopper kernel's fp8 code where
    cuda_tuning.hopper_fp8 is on."""
    fp8 = is_quantized(pool)
    R, Lq, Hq, D = q.shape
    num_blocks, _, bs, Hkv, _ = pool.shape
    dev = q.device
    tune = prefix_tune()
    # a new state uploads from pageable host memory (row_nchunks) and may set up a prefix variant: a captured step
    # must find the state its warm-up built
    refuse_in_capture(f"a new cuda-backend launch state (host-to-device uploads, prefix setup) for R={R} Lq={Lq} "
                      f"Hq={Hq} Hkv={Hkv} D={D} three={three} plain={plain} tune={tune}")
    _validate(plan, R, Lq, bs, num_blocks, three)
    grp = Hq // Hkv
    sms = _sm_count(dev)
    # a static step's prefix chunks cover each level's table capacity, not its lengths (as its suffix split follows
    # the table's capacity): the launch then follows the layout's shapes alone, so a captured step serves a later
    # call of another prompt length whose values the layout adopts (plan.DecodeLayout.adopt); the chunks past a
    # group's length write empty partials. The same for an encoder-decoder's cross plan (its tables rewritten in place
    # for a later call's sources: seq2seq/cross_kv.py)
    pre = _prefix_level(lib, plan.group_rows, _lengths_for_launch(plan, plan.group_rows, plan.prefix_len,
                                                                  plan.prefix_table, bs),
                        plan.prefix_table.shape[1], R, Lq, grp, Hkv, D, q.dtype, bs, sms, tune, plain, fp8)
    mid = (_prefix_level(lib, plan.mid_group_rows, _lengths_for_launch(plan, plan.mid_group_rows, plan.mid_len,
                                                                      plan.mid_table, bs),
                         plan.mid_table.shape[1], R, Lq, grp, Hkv, D, q.dtype, bs, sms, tune, plain, fp8)
           if three else None)
    suffix_table, q_limit = (plan.inner_suffix_table, plan.inner_q_limit) if three else (plan.suffix_table, plan.q_limit)
    nqb = -(-(Lq * grp) // SUFFIX_QB)
    # a static step's suffix split is fixed by the table's capacity, not this step's lengths (a graph
    # replays the launch; CTAs past a row's length write empty partials)
    tmax = suffix_table.shape[1] * bs if plan.launch_by_widths else int(np.asarray(q_limit).max(initial=0))
    split_tokens, nsplit = choose_suffix_split(tmax, R * Hkv * nqb, sms * SUFFIX_CTAS_PER_SM,
                                               tune.split_min or MIN_SPLIT_TOKENS)
    slots = pre.max_chunks + (mid.max_chunks if three else 0) + nsplit
    solo = _solo_split(lib, plan, pool, R, Lq, Hkv, grp, bs, sms, three)
    row_group = counters = None
    if solo is not None:
        row_group = np.full(R, -1, dtype=np.int32)
        for g, rows in enumerate(np.asarray(plan.group_rows)):    # one iteration per group (a prompt)
            row_group[rows[rows >= 0]] = g
        row_group = torch.from_numpy(row_group).to(dev)
        counters = torch.zeros(solo_counters(R, Lq, Hq, Hkv), dtype=torch.int32, device=dev)
        slots = max(slots, solo[1])
    return _StepState(
        has_prefix=pre.has, m_tile=pre.m_tile, row_tiles=pre.row_tiles, chunk_tokens=pre.chunk_tokens,
        max_chunks=pre.max_chunks, split_tokens=split_tokens, nsplit=nsplit, slots=slots,
        row_nchunks=torch.from_numpy(pre.row_nchunks).to(dev),
        part_o=torch.empty(slots * R * Lq * Hq * D, dtype=torch.float32, device=dev),
        part_lse=torch.empty(slots * R * Lq * Hq, dtype=torch.float32, device=dev),
        dp=plan.on(dev), three=three, mid=mid,
        row_nmid=torch.from_numpy(mid.row_nchunks).to(dev) if three else None, tune=pre.tune,
        solo_split=solo[0] if solo else 0, solo_nsplit=solo[1] if solo else 0, row_group=row_group, counters=counters)


def _solo_split(lib, plan, pool, R: int, Lq: int, Hkv: int, grp: int, bs: int, sms: int, three: bool):
    """(tokens per split, splits) of the solo launch where the step's plain layers take it, else None: the switch on,
    the library has it, a decode step (one query per row) of two levels where no group holds two rows, K/V in q's
    dtype, rows short enough (cuda_tuning.choose_solo_split)."""
    if not (cuda_tuning.solo_kernel and getattr(lib, "has_solo", False)) or three or Lq != 1 or is_quantized(pool):
        return None
    group_rows = np.asarray(plan.group_rows)
    if group_rows.size and int((group_rows >= 0).sum(axis=1).max()) > 1:
        return None
    capacity = (plan.prefix_table.shape[1] + plan.suffix_table.shape[1]) * bs
    return choose_solo_split(capacity, solo_counters(R, Lq, Hkv * grp, Hkv), sms * SOLO_CTAS_PER_SM)


# --------------------------------------------------------------------------------------- the backend

def _plain(params: AttentionParams) -> bool:
    """A layer with neither softcap nor window: a tuning variant or the Hopper prefix kernel may serve it."""
    return params.softcap is None and params.window is None


def _unsupported(q, pool):
    """Beyond the declared dtypes, head dims and device: why this backend cannot take a layer of ``q`` over
    ``pool``, or None."""
    if q.device.type != "cuda":
        return "needs CUDA tensors"           # before any question to the device
    if pool.device != q.device:
        return "the KV pool is not on the queries' device"
    if pool.dtype != q.dtype and not is_quantized(pool):
        return f"pool dtype {pool.dtype} differs from the queries' {q.dtype}"
    if len(q.shape) != 4 or pool.dim() != 5 or pool.shape[1] != 2:
        return f"unexpected shapes q {tuple(q.shape)}, pool {tuple(pool.shape)}"
    D = q.shape[-1]
    if pool.shape[-1] != D:
        return f"KV head_dim {pool.shape[-1]} differs from the queries' {D}"
    if pool.shape[3] < 1 or q.shape[2] % pool.shape[3]:
        return f"{q.shape[2]} query heads are not a multiple of {pool.shape[3]} KV heads"
    if not pool.is_contiguous() or pool.data_ptr() % 16:
        return "the KV pool is not contiguous and 16-byte aligned"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "needs compute capability 8.0 or newer"
    try:
        library(q.device)
    except RuntimeError as err:
        return f"CUDA kernels unavailable: {err}"
    return None


class CudaBackend(Backend):
    """The bundled kernels of ``csrc/`` (bfloat16/float16, the compiled head dims, compute capability 8.0 up; K/V in
    q's dtype or float8_e4m3fn)."""

    name = "cuda"
    dtypes = tuple(DTYPE_CODES)
    kv_dtypes = KV_SCALED_DTYPES
    # "auto" hands it fp8 pools too (the failure of fp8 generate on the H200 was the debug mode's device sync inside
    # the capture, cuda_binding._Lib.check; tests/kv/test_gpu_fp8.py runs the captured fp8 step against its eager one)
    auto_kv_dtypes = KV_SCALED_DTYPES
    head_dims = HEAD_DIMS
    devices = ("cuda",)
    # softcap and a sliding window in the prefix and suffix kernels, attention sinks in the merge
    quirks = ("softcap", "window", "sinks")
    # every launch's grid and scalars depend only on shapes and the call's fixed prefix, lengths are read from device
    # memory, no host sync: a decode step on a static layout can be captured in a CUDA graph (hf_cascade.graphs)
    graph_safe = True
    layout_metadata = True
    # a cascade pays once it saves this many token reads per layer (sum of (rows - 1) x prefix tokens);
    # below, every row reads its whole table (H200, benchmarks/RESULTS.md, kernels_gpu.py --threshold)
    min_saved_tokens = 8192
    # a row that shares no prefix still reads its full blocks through the prefix kernel on a static decode layout:
    # the prefix kernel splits a long context over the whole GPU (H200, greedy 8B 4k: the suffix kernel read the 4k
    # context at ~1/8 of the roofline, benchmarks/RESULTS.md)
    solo_prefix = True

    def _unsupported(self, q, pool, plan):
        return _unsupported(q, pool)

    def metadata_key(self, q, pool, params: AttentionParams, plan=None):
        # not the pool's size: a pool that grows between a graph's warm-up and its capture (VMM maps ahead in the
        # background) must not make a new state, whose uploads would break the capture; indices stay valid as it grows
        R, Lq, Hq, D = q.shape
        tune = prefix_tune()
        plain = _plain(params)
        # a layer with a window reads a three-level plan as two levels (build): its own state only then
        three = params.window is None and plan is not None and _has_middle(plan)
        return (str(q.device), R, Lq, Hq, pool.shape[3], D, pool.shape[2], q.dtype, pool.dtype, three,
                plain and tune.splits_by_plainness(q.dtype, D), tune)

    def build(self, plan, q, pool, params: AttentionParams | None = None, lib: "_Lib | None" = None) -> _StepState:
        """The launch state of ``plan`` for layers like ``q`` of ``params`` (None: no variant on; ``lib``: the
        kernels' library, by default the one of q's device)."""
        # like the reference, a layer with a window reads two levels (its window start is defined over the group
        # prefix + the row's suffix); the others read a three-level plan's middle level once per subgroup
        three = (params is None or params.window is None) and _has_middle(plan)
        plain = params is None or _plain(params)
        # on q's device: the prefix variants' one-time setup applies to the current device
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            return _step_state(library(q.device) if lib is None else lib, q, pool, plan, three, plain)

    def forward(self, q, pool, metadata: _StepState, params: AttentionParams):
        pool_ok = pool.dtype == q.dtype or (is_quantized(pool) and kv_scale(pool) is not None)
        if q.dtype not in DTYPE_CODES or not pool_ok or not q.is_cuda or pool.device != q.device:
            raise TypeError(f"cuda backend: q {q.dtype} on {q.device}, pool {pool.dtype} on {pool.device}"
                            + ("" if pool_ok else " (an fp8 pool without its scales)"))
        if q.dim() != 4 or pool.dim() != 5 or q.shape[-1] != pool.shape[-1] or q.shape[-1] not in HEAD_DIMS:
            raise ValueError(f"cuda backend: bad shapes q {tuple(q.shape)}, pool {tuple(pool.shape)}")
        if not pool.is_contiguous():
            raise ValueError("cuda backend: the KV pool must be contiguous")
        q = q.contiguous()
        traced = _is_compiling()
        if not traced and q.data_ptr() % 16:     # (traced: the operators check the alignment when they run)
            q = q.clone()
        R, Lq, Hq, D = q.shape
        if Lq != metadata.dp.q_limit.shape[1]:
            raise ValueError(f"cuda backend: q has {Lq} tokens per row, the plan {metadata.dp.q_limit.shape[1]}")
        out = torch.empty_like(q)
        if out.numel() == 0:
            return out
        if traced:      # the operators (kernels.ops) find the library and launch on the current stream when they run
            _launch(None, 0, q, pool, metadata, params, out)
            return out
        with torch.cuda.device(q.device):
            lib = library(q.device)
            _launch(lib, torch.cuda.current_stream(q.device).cuda_stream, q, pool, metadata, params, out)
        return out


BACKEND = CudaBackend()


def attend(q, pool, plan, params: AttentionParams | float):
    """One layer's cascade attention for one step (build, then forward); ``params`` may be a bare scale."""
    return BACKEND.attend(q, pool, plan, params)


def _launch(lib, stream: int, q, pool, st: _StepState, params: AttentionParams, out, kernels=ops) -> None:
    """The launches of one layer (``kernels``: :mod:`hf_cascade.kernels.ops`, or a CPU emulation in the tests)."""
    # the layer's variants: runtime scalars of the launches (fixed per layer: a CUDA graph bakes them); the
    # window is applied by the kernels from the device-side lengths, so the launch shapes never depend on it
    layer = layer_args(params, q)
    if st.three and layer.window:
        raise ValueError("cuda backend: a layer with a sliding window reads two levels; its state was built for three "
                         "(build it with the layer's params)")
    three = st.three
    dp = st.dp
    # an fp8 pool's scales (float32 [2, Hkv], the pool's own tensor: a captured graph reads it by address)
    kv = kv_scale(pool) if is_quantized(pool) else None
    # (positional: built per launch, and keywords cost several times as much on the host)
    scale_log2, softcap, window = layer.scale_log2, layer.softcap, layer.window
    if st.solo_nsplit and not softcap and not window and layer.sinks is None and kv is None:
        kernels.solo(lib, stream, SoloArgs(
            q, pool, st.row_group, dp.prefix_table, dp.prefix_len, dp.suffix_table, dp.q_limit, st.part_o,
            st.part_lse, st.counters, out, st.solo_split, st.solo_nsplit, scale_log2))
        return
    if st.has_prefix:
        kernels.prefix(lib, stream, PrefixArgs(
            q, pool, dp.group_rows, dp.prefix_table, dp.prefix_len, st.part_o, st.part_lse, st.m_tile, st.row_tiles,
            st.chunk_tokens, st.max_chunks, scale_log2, dp.q_limit, 0, softcap, window, st.tune, kv))
    if three and st.mid.has:
        mid = st.mid
        kernels.prefix(lib, stream, PrefixArgs(
            q, pool, dp.mid_group_rows, dp.mid_table, dp.mid_len, st.part_o, st.part_lse, mid.m_tile, mid.row_tiles,
            mid.chunk_tokens, mid.max_chunks, scale_log2, dp.q_limit, st.max_chunks, softcap, window, mid.tune, kv))
    suffix_table, q_limit = (dp.inner_suffix_table, dp.inner_q_limit) if three else (dp.suffix_table, dp.q_limit)
    kernels.suffix(lib, stream, SuffixArgs(
        q, pool, suffix_table, q_limit, st.part_o, st.part_lse, st.split_tokens, st.nsplit, st.suffix_slot0,
        scale_log2, softcap, window, kv))
    kernels.merge(lib, stream, MergeArgs(
        st.part_o, st.part_lse, st.row_nchunks, out, st.suffix_slot0, st.nsplit, st.row_nmid if three else None,
        st.max_chunks, layer.sinks))
