"""CUDA backend: the kernels of ``csrc/cascade_attention.cu``, built with nvcc on first use, loaded with ctypes.

Three kernels per layer, all on ``torch.cuda.current_stream()`` and with no host-device synchronisation:

1. prefix (level 0): one CTA per (prefix chunk x row tile, KV head, group), all of a group's query rows
   for that KV head against the chunk's K/V tiles on tensor cores; one partial (O, LSE) per chunk.
   Two implementations with the same launcher and outputs: ``v1`` (``hfc_prefix``: WMMA, S/P in shared
   memory) and ``v2`` (``hfc_prefix_v2``: mma.sync with S/P in registers, a deeper cp.async ring, more
   CTAs per SM). ``$HF_CASCADE_PREFIX_KERNEL`` ("v2", the default, or "v1") picks one, read once when
   the library is loaded;
2. suffix (level 1): each row's queries against its own suffix (optionally split for long suffixes);
3. merge: log-sum-exp of all partials of a row into the output, in q's dtype.

The chunking (chunk length in tokens, chunks per group, suffix splits) and the partial-output buffers are
derived from the plan's host arrays and kept in ``plan.call_scratch``: once per step, or once per generate
call on a static decode layout (then the suffix split follows the tables' capacity); every layer reuses them.

The library is compiled for the present GPU (``-arch=sm_XY``) and cached under ``$HF_CASCADE_CACHE``
(default ``~/.cache/hf_cascade``), keyed by a hash of the source, the arch, the flags and nvcc's version.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["unsupported_reason", "attend", "library", "choose_chunk_blocks", "choose_suffix_split", "SOURCE"]

logger = logging.getLogger("hf_cascade")

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "cascade_attention.cu"
HEAD_DIMS = (64, 128, 256)
DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1}
ABI_VERSION = 2
PREFIX_KERNELS = ("v1", "v2")
PREFIX_KERNEL_ENV = "HF_CASCADE_PREFIX_KERNEL"
NVCC_FLAGS = ("-O3", "--use_fast_math", "-std=c++17", "-Xcompiler", "-fPIC", "-shared", "-lineinfo")
LOG2E = 1.0 / math.log(2.0)
MIN_CHUNK_TOKENS = 256     # a prefix chunk's partial costs D floats per query row: keep chunks long enough
MIN_SPLIT_TOKENS = 256     # same for suffix splits
# v2 prefers 1024-token chunks while they still fill one wave: fewer partials to write and merge
# (H200, 8x8 beams at 16k: prefix + merge 239 us at 1024 tokens vs 257 us at the wave rule's 448)
PREFER_CHUNK_TOKENS = {"v1": None, "v2": 1024}
# a cascade pays once it saves this many token reads per layer (sum of (rows - 1) x prefix tokens);
# below, every row reads its whole table (H200, benchmarks/RESULTS.md, kernels_gpu.py --threshold)
MIN_SAVED_TOKENS = 8192
# every launch's grid and scalars depend only on shapes and the call's fixed prefix, lengths are read from device
# memory, no host sync: a decode step on a static layout can be captured in a CUDA graph (hf_cascade.graphs)
GRAPH_SAFE = True
# a row that shares no prefix still reads its full blocks through the prefix kernel on a static decode layout:
# the prefix kernel splits a long context over the whole GPU (H200, greedy 8B 4k: the suffix kernel read the 4k
# context at ~1/8 of the roofline, benchmarks/RESULTS.md)
SOLO_PREFIX = True
SUFFIX_QB = 4              # query vectors per suffix CTA (kQB in the .cu)
SUFFIX_CTAS_PER_SM = 4     # the suffix kernel's occupancy (128 threads x 128 registers)

# Set True (tests do) to synchronise and check for errors after every launch; never in production.
debug_sync = bool(os.environ.get("HF_CASCADE_CUDA_DEBUG"))

_lock = threading.Lock()
_libs: dict[str, "_Lib | str"] = {}          # arch -> loaded library, or the reason it failed


# ----------------------------------------------------------------------------------------- building

def _find_nvcc() -> str | None:
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc") if os.environ.get("CUDA_HOME") else None,
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _cache_dir() -> Path:
    env = os.environ.get("HF_CASCADE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "hf_cascade"


def build_library(arch: str) -> Path:
    """Compile ``csrc/cascade_attention.cu`` for ``arch`` (e.g. "sm_90") unless cached; returns the .so path."""
    if not SOURCE.is_file():
        raise RuntimeError(f"CUDA source not found at {SOURCE} (use hf_cascade from its source checkout)")
    nvcc = _find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (put it on PATH or set $NVCC / $CUDA_HOME)")
    try:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"cannot run {nvcc} --version: {err}") from err
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), arch.encode(), version.encode(), " ".join(NVCC_FLAGS).encode(),
                 str(ABI_VERSION).encode()):
        digest.update(part)
        digest.update(b"\0")
    cache = _cache_dir()
    target = cache / f"cascade_attention_{arch}_{digest.hexdigest()[:20]}.so"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    cmd = [nvcc, *NVCC_FLAGS, f"-arch={arch}", "-o", str(tmp), str(SOURCE)]
    logger.info("hf_cascade: building the CUDA kernels for %s (first use, takes a minute): %s", arch, " ".join(cmd))
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"nvcc could not run: {err}") from err
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"nvcc failed with exit code {res.returncode}: {(res.stderr or res.stdout)[-3000:]}")
    os.replace(tmp, target)   # atomic: concurrent builders race harmlessly
    return target


def _prefix_kernel_choice() -> str:
    """Which prefix kernel ``$HF_CASCADE_PREFIX_KERNEL`` asks for ("v2" when unset or empty: 1.2-1.4x
    faster than v1 on the H200, benchmarks/RESULTS.md)."""
    choice = os.environ.get(PREFIX_KERNEL_ENV, "").strip().lower() or "v2"
    if choice not in PREFIX_KERNELS:
        raise RuntimeError(f"${PREFIX_KERNEL_ENV}={choice!r}: expected one of {', '.join(PREFIX_KERNELS)}")
    return choice


class _Lib:
    """The loaded shared library with typed entry points."""

    def __init__(self, path: Path):
        self.path = path
        self.prefix_kernel = _prefix_kernel_choice()      # read once, when the library is loaded
        lib = ctypes.CDLL(str(path))
        vp, ll, i, f = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_float
        st = ctypes.c_uint64
        lib.hfc_abi_version.restype = i
        lib.hfc_abi_version.argtypes = []
        lib.hfc_error_string.restype = ctypes.c_char_p
        lib.hfc_error_string.argtypes = [i]
        lib.hfc_sync.restype = i
        lib.hfc_sync.argtypes = []
        lib.hfc_prefix_info.restype = i
        lib.hfc_prefix_info.argtypes = [i, i, i, ctypes.POINTER(i), ctypes.POINTER(i), ctypes.POINTER(i)]
        lib.hfc_prefix.restype = i
        lib.hfc_prefix.argtypes = [i, i, i, vp, vp, vp, vp, vp, vp, vp] + [ll] * 11 + [f, st]
        lib.hfc_prefix_v2_info.restype = i
        lib.hfc_prefix_v2_info.argtypes = lib.hfc_prefix_info.argtypes
        lib.hfc_prefix_v2.restype = i
        lib.hfc_prefix_v2.argtypes = lib.hfc_prefix.argtypes
        lib.hfc_suffix.restype = i
        lib.hfc_suffix.argtypes = [i, i, vp, vp, vp, vp, vp, vp] + [ll] * 9 + [f, st]
        lib.hfc_merge.restype = i
        lib.hfc_merge.argtypes = [i, i, vp, vp, vp, vp] + [ll] * 5 + [st]
        got = lib.hfc_abi_version()
        if got != ABI_VERSION:
            raise RuntimeError(f"{path} has ABI version {got}, expected {ABI_VERSION}")
        self.lib = lib
        # the chosen prefix kernel's launcher and occupancy query (same C signatures for v1 and v2)
        v2 = self.prefix_kernel == "v2"
        self.prefix_fn = lib.hfc_prefix_v2 if v2 else lib.hfc_prefix
        self._prefix_info_fn = lib.hfc_prefix_v2_info if v2 else lib.hfc_prefix_info
        self._info: dict = {}

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = self.lib.hfc_error_string(rc).decode(errors="replace")
            raise RuntimeError(f"hf_cascade CUDA kernel {what} failed: {msg} (cudaError {rc})")
        if debug_sync:
            rc = self.lib.hfc_sync()
            if rc != 0:
                msg = self.lib.hfc_error_string(rc).decode(errors="replace")
                raise RuntimeError(f"hf_cascade CUDA kernel {what} failed while running: {msg} (cudaError {rc})")

    def prefix_info(self, dtype_code: int, head_dim: int, m_tile: int) -> tuple[int, int, int]:
        """(CTAs per SM, dynamic shared memory bytes, tokens per K/V tile) of one variant of the chosen prefix
        kernel (v1 or v2, see ``prefix_kernel``)."""
        key = (dtype_code, head_dim, m_tile, torch.cuda.current_device())
        if key not in self._info:
            occ, smem, tile = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
            self.check(self._prefix_info_fn(dtype_code, head_dim, m_tile, ctypes.byref(occ), ctypes.byref(smem),
                                            ctypes.byref(tile)), f"prefix_info ({self.prefix_kernel})")
            if occ.value < 1:
                raise RuntimeError(f"the prefix kernel {self.prefix_kernel} (head_dim {head_dim}, rows {m_tile}) "
                                   "cannot run on this GPU "
                                   f"({smem.value} bytes of shared memory)")
            self._info[key] = (occ.value, smem.value, tile.value)
        return self._info[key]


def library(device) -> _Lib:
    """The kernel library for ``device``'s architecture, built and loaded on first use (RuntimeError if it cannot)."""
    major, minor = torch.cuda.get_device_capability(device)
    arch = f"sm_{major}{minor}"
    with _lock:
        found = _libs.get(arch)
        if found is None:
            try:
                found = _Lib(build_library(arch))
            except Exception as err:   # remember the reason: never retry a failed build every step
                found = f"{type(err).__name__}: {err}"
            _libs[arch] = found
    if isinstance(found, str):
        raise RuntimeError(found)
    return found


# ------------------------------------------------------------------------------------------ chunking

def choose_chunk_blocks(prefix_blocks, ctas_per_chunk: int, slots: int, block_size: int, tile_tokens: int,
                        min_tokens: int = MIN_CHUNK_TOKENS, max_waves: int = 8,
                        prefer_tokens: int | None = None) -> int:
    """Blocks per prefix chunk, the same for all groups.

    ``prefix_blocks``: blocks of each group's prefix; ``ctas_per_chunk``: CTAs per (group, chunk), i.e.
    KV heads x row tiles; ``slots``: CTAs resident at once (SMs x CTAs per SM). Picks the fewest waves whose
    last wave is at least 90% full (the grid fills the GPU, at least one full wave when the prefix is long
    enough), with chunks a multiple of the K/V tile and at least ``min_tokens`` long. With
    ``prefer_tokens``, chunks of that length are taken whenever they still make one full wave.
    """
    pb = np.asarray(prefix_blocks, dtype=np.int64)
    pb = pb[pb > 0]
    if pb.size == 0:
        return 1
    align = tile_tokens // block_size if (block_size <= tile_tokens and tile_tokens % block_size == 0) else 1
    round_up = lambda x: -(-int(x) // align) * align  # noqa: E731
    min_cb = round_up(max(1, -(-min_tokens // block_size)))
    max_cb = round_up(int(pb.max()))
    if prefer_tokens:
        cb = min(round_up(-(-prefer_tokens // block_size)), max_cb)
        if ctas_per_chunk * int((-(-pb // cb)).sum()) >= slots:
            return int(cb)
    total = int(pb.sum()) * ctas_per_chunk
    best_cb, best_eff = max_cb, -1.0
    for waves in range(1, max_waves + 1):
        cb = min(max(round_up(-(-total // (waves * slots))), min_cb), max_cb)
        ctas = ctas_per_chunk * int((-(-pb // cb)).sum())
        eff = ctas / (-(-ctas // slots) * slots)
        if eff > best_eff + 1e-9:
            best_cb, best_eff = cb, eff
        if eff >= 0.9 or cb == min_cb:
            break
    return int(best_cb)


def choose_suffix_split(max_tokens: int, ctas: int, slots: int, min_tokens: int = MIN_SPLIT_TOKENS) -> tuple[int, int]:
    """(tokens per split, splits) of the suffix: split long suffixes until ~2 waves of ``slots`` CTAs."""
    if max_tokens <= 0:
        return 1, 1
    want = max(1, -(-2 * slots // max(ctas, 1)))
    nsplit = max(1, min(want, -(-max_tokens // min_tokens)))
    split_tokens = -(-max_tokens // nsplit)
    return split_tokens, -(-max_tokens // split_tokens)


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


def _validate(plan, R, Lq, bs, num_blocks) -> None:
    """Loud, cheap host checks of the plan (the kernels trust every index)."""
    gr, pt, pl = plan.group_rows, plan.prefix_table, plan.prefix_len
    stb, ql = plan.suffix_table, plan.q_limit
    if ql.shape != (R, Lq):
        raise ValueError(f"plan.q_limit has shape {ql.shape}, expected {(R, Lq)}")
    if stb.ndim != 2 or stb.shape[0] != R:
        raise ValueError(f"plan.suffix_table has shape {stb.shape}, expected ({R}, Ms)")
    if gr.ndim != 2 or pt.ndim != 2 or pl.shape != (gr.shape[0],) or pt.shape[0] != gr.shape[0]:
        raise ValueError(f"inconsistent prefix plan: group_rows {gr.shape}, prefix_table {pt.shape}, "
                         f"prefix_len {pl.shape}")
    member = gr[gr >= 0]
    if (gr < -1).any() or (member >= R).any() or np.unique(member).size != member.size:
        raise ValueError("plan.group_rows must hold distinct rows in [0, R) or -1")
    if (pl < 0).any() or (pl > pt.shape[1] * bs).any():
        raise ValueError("plan.prefix_len outside [0, prefix blocks x block_size]")
    if (ql < 0).any() or (ql > stb.shape[1] * bs).any():
        raise ValueError("plan.q_limit outside [0, suffix blocks x block_size]")
    need_p = np.arange(pt.shape[1])[None, :] < (-(-pl.astype(np.int64) // bs))[:, None]
    need_s = np.arange(stb.shape[1])[None, :] < (-(-ql.max(axis=1, initial=0).astype(np.int64) // bs))[:, None]
    for name, table, need in (("prefix_table", pt, need_p), ("suffix_table", stb, need_s)):
        used = table[need]
        if used.size and (used.min() < 0 or used.max() >= num_blocks):
            raise ValueError(f"plan.{name} references blocks outside the pool [0, {num_blocks}) or -1 inside "
                             "the tokens it must cover")


def _step_state(lib: _Lib, q: torch.Tensor, pool: torch.Tensor, plan) -> _StepState:
    R, Lq, Hq, D = q.shape
    num_blocks, _, bs, Hkv, _ = pool.shape
    dev = q.device
    key = ("cuda", str(dev), R, Lq, Hq, Hkv, D, bs, num_blocks, q.dtype)
    scratch = plan.call_scratch         # a static decode layout keeps one state (and its buffers) for the call
    state = scratch.get(key)
    if state is not None:
        return state
    _validate(plan, R, Lq, bs, num_blocks)
    grp = Hq // Hkv
    gr = np.asarray(plan.group_rows)
    pl = np.asarray(plan.prefix_len).astype(np.int64)
    G, Rg = gr.shape
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    row_nchunks = np.zeros(R, dtype=np.int32)
    has_prefix = G > 0 and Rg > 0 and plan.prefix_table.shape[1] > 0 and int(pl.max(initial=0)) > 0
    m_tile = row_tiles = chunk_tokens = 1
    max_chunks = 0
    if has_prefix:
        rows_q = Rg * Lq * grp
        m_max = 64 if D <= 128 else 32
        m_tile = next((m for m in (16, 32, 64) if m <= m_max and rows_q <= m), m_max)
        row_tiles = -(-rows_q // m_tile)
        occ, _, tile_tokens = lib.prefix_info(DTYPE_CODES[q.dtype], D, m_tile)
        chunk_blocks = choose_chunk_blocks(-(-pl // bs), Hkv * row_tiles, sms * occ, bs, tile_tokens,
                                           prefer_tokens=PREFER_CHUNK_TOKENS[lib.prefix_kernel])
        chunk_tokens = chunk_blocks * bs
        nchunks = -(-pl // chunk_tokens)
        max_chunks = int(nchunks.max())
        for g in range(G):              # one iteration per group (a prompt), not per block
            rows = gr[g][gr[g] >= 0]
            row_nchunks[rows] = nchunks[g]
    nqb = -(-(Lq * grp) // SUFFIX_QB)
    # a static step's suffix split is fixed by the table's capacity, not this step's lengths (a graph
    # replays the launch; CTAs past a row's length write empty partials)
    tmax = plan.suffix_table.shape[1] * bs if plan.static else int(np.asarray(plan.q_limit).max(initial=0))
    split_tokens, nsplit = choose_suffix_split(tmax, R * Hkv * nqb, sms * SUFFIX_CTAS_PER_SM)
    slots = max_chunks + nsplit
    state = _StepState(
        has_prefix=has_prefix, m_tile=m_tile, row_tiles=row_tiles, chunk_tokens=chunk_tokens, max_chunks=max_chunks,
        split_tokens=split_tokens, nsplit=nsplit, slots=slots,
        row_nchunks=torch.from_numpy(row_nchunks).to(dev),
        part_o=torch.empty(slots * R * Lq * Hq * D, dtype=torch.float32, device=dev),
        part_lse=torch.empty(slots * R * Lq * Hq, dtype=torch.float32, device=dev),
        dp=plan.on(dev))
    scratch[key] = state
    return state


# --------------------------------------------------------------------------------------- interface

def unsupported_reason(q, pool, plan):
    """Why this backend cannot take the step, or None."""
    if not (isinstance(q, torch.Tensor) and q.is_cuda):
        return "needs CUDA tensors"
    if not (isinstance(pool, torch.Tensor) and pool.device == q.device):
        return "the KV pool is not on the queries' device"
    if q.dtype not in DTYPE_CODES:
        return f"dtype {q.dtype} (needs bfloat16 or float16)"
    if pool.dtype != q.dtype:
        return f"pool dtype {pool.dtype} differs from the queries' {q.dtype}"
    if q.dim() != 4 or pool.dim() != 5 or pool.shape[1] != 2:
        return f"unexpected shapes q {tuple(q.shape)}, pool {tuple(pool.shape)}"
    D = q.shape[-1]
    if D not in HEAD_DIMS or pool.shape[-1] != D:
        return f"head_dim {D} (supported: {HEAD_DIMS})"
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


def attend(q, pool, plan, scale):
    """One layer's cascade attention for one step (see :mod:`hf_cascade.kernels`)."""
    if q.dtype not in DTYPE_CODES or pool.dtype != q.dtype or not q.is_cuda or pool.device != q.device:
        raise TypeError(f"cuda backend: q {q.dtype} on {q.device}, pool {pool.dtype} on {pool.device}")
    if q.dim() != 4 or pool.dim() != 5 or q.shape[-1] != pool.shape[-1] or q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"cuda backend: bad shapes q {tuple(q.shape)}, pool {tuple(pool.shape)}")
    if not pool.is_contiguous():
        raise ValueError("cuda backend: the KV pool must be contiguous")
    q = q.contiguous()
    if q.data_ptr() % 16:
        q = q.clone()
    R, Lq, Hq, D = q.shape
    if Lq != plan.q_len:
        raise ValueError(f"cuda backend: q has {Lq} tokens per row, the plan {plan.q_len}")
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    num_blocks, _, bs, Hkv, _ = pool.shape
    dtype_code = DTYPE_CODES[q.dtype]
    scale_log2 = float(scale) * LOG2E
    with torch.cuda.device(q.device):
        lib = library(q.device)
        st = _step_state(lib, q, pool, plan)
        dp = st.dp
        stream = torch.cuda.current_stream(q.device).cuda_stream
        if st.has_prefix:
            G, Rg = dp.group_rows.shape
            lib.check(lib.prefix_fn(
                dtype_code, D, st.m_tile, q.data_ptr(), pool.data_ptr(), dp.group_rows.data_ptr(),
                dp.prefix_table.data_ptr(), dp.prefix_len.data_ptr(), st.part_o.data_ptr(), st.part_lse.data_ptr(),
                R, Lq, Hq, Hkv, bs, G, Rg, dp.prefix_table.shape[1], st.chunk_tokens, st.max_chunks, st.row_tiles,
                scale_log2, stream), f"prefix ({lib.prefix_kernel})")
        lib.check(lib.lib.hfc_suffix(
            dtype_code, D, q.data_ptr(), pool.data_ptr(), dp.suffix_table.data_ptr(), dp.q_limit.data_ptr(),
            st.part_o.data_ptr(), st.part_lse.data_ptr(), R, Lq, Hq, Hkv, bs, dp.suffix_table.shape[1],
            st.split_tokens, st.nsplit, st.max_chunks, scale_log2, stream), "suffix")
        lib.check(lib.lib.hfc_merge(
            dtype_code, D, st.part_o.data_ptr(), st.part_lse.data_ptr(), st.row_nchunks.data_ptr(), out.data_ptr(),
            R, Lq, Hq, st.max_chunks, st.nsplit, stream), "merge")
    return out
