"""CUDA backend: the kernels of ``csrc/`` (one shared library, loaded with ctypes).

Three kernels per layer, all on ``torch.cuda.current_stream()`` and with no host-device synchronisation:

1. prefix (level 0, ``csrc/prefix.cu``): one CTA per (prefix chunk x row tile, KV head, group), all of a
   group's query rows for that KV head against the chunk's K/V tiles on tensor cores (mma.sync, softmax in
   registers, a cp.async ring); one partial (O, LSE) per chunk;
2. suffix (level 1, ``csrc/suffix.cu``): each row's queries against its own suffix (optionally split for long
   suffixes);
3. merge (``csrc/merge.cu``): log-sum-exp of all partials of a row into the output, in q's dtype.

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

Each takes one parameter struct (``csrc/include/hfc/params.h``, mirrored below by ``_PrefixParams``,
``_SuffixParams``, ``_MergeParams``); launches make no CUDA call but the launch itself, so they can be captured in a
CUDA graph. :mod:`hf_cascade.kernels.ops` exposes them as torch operators (``torch.ops.hf_cascade.*``) for
``torch.compile``; eager calls go straight through ctypes (the operator dispatch costs more than the launch).

The chunking (chunk length in tokens, chunks per group, suffix splits) and the partial-output buffers are
the backend's metadata (:class:`_StepState`, from :meth:`CudaBackend.build`), derived from the plan's host arrays:
once per step, or once per generate call on a static decode layout (then the suffix split follows the tables'
capacity; the layout keeps it); every layer reuses them.

For a tuning sweep (``benchmarks/prefix_sweep_gpu.py``), the prefix launch's row tile, chunk rule and kernel
variant (extra instantiations of ``csrc/prefix.cu`` for bf16, head_dim 128) can be chosen at run time:
``$HF_CASCADE_PREFIX_TUNE`` or :func:`set_prefix_tune` (:class:`PrefixTune`); unset, every launch is the production one.

Where the library comes from, first that works: the prebuilt one of a wheel (``hf_cascade/kernels/
libhfc_kernels.so``: sm_80, sm_86, sm_89, sm_90a and compute_90 PTX) if its ABI version matches; else compiled with
nvcc for the present GPU on first use and cached under ``$HF_CASCADE_CACHE`` (default ``~/.cache/hf_cascade``),
keyed by a hash of the sources, the arch, the flags and nvcc's version; else the backend is unavailable (the
reason starts with "CUDA kernels unavailable", on which :func:`hf_cascade.kernels.select` WARNs once with what
to do) and the next backend runs.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import math
import os
import subprocess
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from . import _build, ops, refuse_in_capture
from .base import NO_QUIRKS, Backend, Quirks
from .ops import DTYPE_CODES, HEAD_DIMS

__all__ = ["CudaBackend", "BACKEND", "attend", "library", "availability", "prebuilt_library", "choose_chunk_blocks",
           "choose_suffix_split", "PrefixTune", "parse_prefix_tune", "prefix_tune",
           "set_prefix_tune", "PREFIX_TUNE_ENV", "PREFIX_VARIANTS"]

logger = logging.getLogger("hf_cascade")

ABI_VERSION = 5                                       # HFC_ABI_VERSION in csrc/include/hfc/api.h
PREBUILT = Path(__file__).resolve().parent / _build.LIBRARY_NAME
RETIRED_PREFIX_KERNEL_ENV = "HF_CASCADE_PREFIX_KERNEL"  # chose v1 (WMMA) or v2 until v1 was retired
LOG2E = 1.0 / math.log(2.0)
MIN_CHUNK_TOKENS = 256     # a prefix chunk's partial costs D floats per query row: keep chunks long enough
MIN_SPLIT_TOKENS = 256     # same for suffix splits
# prefer 1024-token prefix chunks while they still fill one wave: fewer partials to write and merge
# (H200, 8x8 beams at 16k: prefix + merge 239 us at 1024 tokens vs 257 us at the wave rule's 448)
PREFER_CHUNK_TOKENS = 1024
SUFFIX_QB = 4              # query vectors per suffix CTA (kQB in csrc/suffix.cu)
SUFFIX_CTAS_PER_SM = 4     # the suffix kernel's occupancy (128 threads x 128 registers)

# Tuning the prefix kernel's launch for a sweep (benchmarks/prefix_sweep_gpu.py), e.g. "variant=n64,m=32,chunk=1024":
#   variant  a compiled tuning variant (csrc/prefix.cu PrefixTune): its tune code and the row tiles it is compiled
#            for; it serves bf16, head_dim 128 layers without softcap / window (others run the default kernel).
#            "auto" (the production choice): AUTO_TUNE where the sweep measured it faster, else "default"
#   m        the row tile (16, 32, 64; 64 only for head_dim <= 128): more row tiles per group when smaller
#   chunk    fixed prefix chunk length in tokens (rounded up to whole blocks), instead of choose_chunk_blocks
#   prefer   choose_chunk_blocks' preferred chunk tokens (0: the wave rule alone); min: its shortest chunk
# Unset ("auto"), every launch is the production one.
PREFIX_TUNE_ENV = "HF_CASCADE_PREFIX_TUNE"
PREFIX_VARIANTS = {"default": (0, (16, 32, 64)), "n64": (1, (16, 32, 64)), "n64w8": (2, (32, 64)),
                   "w8": (3, (32, 64)), "s3c4": (4, (16, 32)), "s6": (5, (32, 64)), "wg": (6, (64,))}
# "wg" is the Hopper kernel (csrc/prefix_sm90.cu: wgmma fed by a producer warp), for bf16 and fp16 at head_dim 128; it
# runs where the library holds sm_90a code for the GPU (Lib.prefix_runs), and "auto" falls back to AUTO_TUNE elsewhere
SM90_VARIANT = "wg"


@dataclass(frozen=True)
class PrefixTune:
    """One point of the prefix kernel's tuning space (0 / None / "auto": the production choice)."""
    variant: str = "auto"
    m_tile: int = 0
    chunk_tokens: int = 0
    prefer_tokens: int | None = None
    min_tokens: int = 0

    def resolve(self, dtype, head_dim: int, query_rows: int, plain: bool,
                hopper_runs: Callable[[], bool] = lambda: False) -> "PrefixTune":
        """The tuning one level's launch uses: "auto" alone is, for head_dim-128 layers without softcap / window,
        AUTO_TUNE_SM90 where the Hopper kernel runs (``hopper_runs()``, asked only for bf16 / fp16; any group size),
        else AUTO_TUNE for bf16
        groups of >= AUTO_MIN_QUERY_ROWS query rows (where the H200 measured each faster), else the default kernel
        (as are "auto" with other knobs set); any other setting as given."""
        if self.variant != "auto":
            return self
        if self == PrefixTune() and plain and head_dim == 128:
            if dtype in (torch.bfloat16, torch.float16) and hopper_runs():
                return AUTO_TUNE_SM90
            if dtype == torch.bfloat16 and query_rows >= AUTO_MIN_QUERY_ROWS:
                return AUTO_TUNE
        return replace(self, variant="default")

    def splits_by_plainness(self, dtype, head_dim: int) -> bool:
        """Whether plain layers may launch a variant that layers with softcap / window cannot (their launch states
        then differ); otherwise every layer of a step shares one state."""
        if self.variant == "auto":
            return self == PrefixTune() and dtype in (torch.bfloat16, torch.float16) and head_dim == 128
        return self.variant != "default"

    def code(self, dtype, head_dim: int, m_tile: int, plain: bool) -> int:
        """The kernel's tune code for this launch: the variant's where it is compiled, else 0 (the default)."""
        code, m_tiles = PREFIX_VARIANTS[self.variant]
        dtypes = (torch.bfloat16, torch.float16) if self.variant == SM90_VARIANT else (torch.bfloat16,)
        fits = plain and dtype in dtypes and head_dim == 128 and m_tile in m_tiles
        return code if fits else 0

    def __str__(self) -> str:
        parts = [f"variant={self.variant}"] if self.variant != "auto" else []
        for key, value in (("m", self.m_tile), ("chunk", self.chunk_tokens), ("min", self.min_tokens)):
            if value:
                parts.append(f"{key}={value}")
        if self.prefer_tokens is not None:
            parts.append(f"prefer={self.prefer_tokens}")
        return ",".join(parts) or "auto"


# The production tuning where it applies (PrefixTune.resolve): 64-token K/V tiles and 8 warps, 64-row tiles, the wave
# rule's chunks. Prefix sweep on the H200 (benchmarks/RESULTS.md), Llama-3-8B layer, 8 prompts x B beams, 16k prefix:
# 8x8 252 -> 221 us, 8x16 362 -> 292 us, 8x4 234 -> 212 us; 8x8 at 4k 94 -> 80 us. Smaller groups were not measured.
AUTO_TUNE = PrefixTune(variant="n64w8", m_tile=64, prefer_tokens=0)
# ... and on Hopper GPUs (sm_90a code in the library): the wgmma kernel, 64-row tiles, the wave rule's chunks. Same
# shapes on the H200 (benchmarks/RESULTS.md, "The prefix kernel on Hopper"): 8x8 222 -> 184 us, 8x16 294 -> 201 us,
# 8x4 213 -> 180 us, 8x8 at 4k 79 -> 79 us; groups of 8 query rows (8x2) 231 -> 179 us; fp16 (whose "auto" was the
# default kernel) 8x8 255 -> 185 us, 8x16 363 -> 202 us. So it serves bf16 and fp16 groups of any size.
AUTO_TUNE_SM90 = PrefixTune(variant=SM90_VARIANT, m_tile=64, prefer_tokens=0)
AUTO_MIN_QUERY_ROWS = 16


def parse_prefix_tune(text: str | None) -> PrefixTune:
    """``"variant=n64,m=32,chunk=1024,prefer=0,min=512"`` (any subset, any order) -> PrefixTune; "" -> default."""
    fields: dict = {}
    for item in (text or "").replace(" ", "").split(","):
        if not item or item == "auto":
            continue
        if item == "default":                 # the default kernel with the default launch rules
            item = "variant=default"
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"prefix tune {text!r}: {item!r} is not key=value")
        if key == "variant":
            if value not in PREFIX_VARIANTS and value != "auto":
                raise ValueError(f"prefix tune {text!r}: variant {value!r} (one of {', '.join(PREFIX_VARIANTS)})")
            fields["variant"] = value
            continue
        names = {"m": "m_tile", "chunk": "chunk_tokens", "prefer": "prefer_tokens", "min": "min_tokens"}
        if key not in names:
            raise ValueError(f"prefix tune {text!r}: unknown key {key!r} (variant, {', '.join(names)})")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"prefix tune {text!r}: {key}={value!r} is not an integer") from None
        if number < 0 or (key == "m" and number not in (0, 16, 32, 64)):
            raise ValueError(f"prefix tune {text!r}: {key}={number} (m: 16, 32 or 64; the others >= 0)")
        fields[names[key]] = number
    return PrefixTune(**fields)


_prefix_tune: PrefixTune | None = None


def prefix_tune() -> PrefixTune:
    """The tuning in effect: set_prefix_tune's, else $HF_CASCADE_PREFIX_TUNE's (read once), else the default."""
    global _prefix_tune
    if _prefix_tune is None:
        _prefix_tune = parse_prefix_tune(os.environ.get(PREFIX_TUNE_ENV, ""))
    return _prefix_tune


def set_prefix_tune(tune: "PrefixTune | str | None") -> PrefixTune:
    """Set the tuning for the next step states (None or "": the default); returns it. A plan's cached launch state
    is keyed by the tuning, so a plan built before still takes the new one."""
    global _prefix_tune
    _prefix_tune = tune if isinstance(tune, PrefixTune) else parse_prefix_tune(tune)
    return _prefix_tune


# Set True (tests do) to synchronise and check for errors after every launch; never in production.
debug_sync = bool(os.environ.get("HF_CASCADE_CUDA_DEBUG"))

_lock = threading.Lock()
_libs: dict[str, "_Lib | str"] = {}          # arch -> loaded library, or the reason it failed
_find_nvcc = _build.find_nvcc                 # (hf_cascade.diagnostics reports it)


# ----------------------------------------------------------------------------------------- building

def _cache_dir() -> Path:
    env = os.environ.get("HF_CASCADE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "hf_cascade"


def build_library(arch: str) -> Path:
    """Compile the kernels of ``csrc/`` for ``arch`` (e.g. "sm_90") unless cached; returns the .so path."""
    csrc = _build.find_csrc()
    if csrc is None:
        raise RuntimeError("the CUDA kernel sources (csrc/) are not in this installation")
    nvcc = _build.find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (put it on PATH or set $NVCC / $CUDA_HOME)")
    try:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"cannot run {nvcc} --version: {err}") from err
    digest = hashlib.sha256()
    cus, headers = _build.source_files(csrc)
    for path in (*cus, *headers):
        digest.update(path.relative_to(csrc).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    gencode = _build.gencode_for(arch)
    for part in (arch, " ".join(gencode), version, " ".join(_build.NVCC_FLAGS), str(ABI_VERSION)):
        digest.update(part.encode())
        digest.update(b"\0")
    cache = _cache_dir()
    target = cache / f"hfc_kernels_{arch}_{digest.hexdigest()[:20]}.so"
    if target.is_file():
        return target
    tmp = cache / f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    logger.info("building the CUDA kernels for %s with %s (first use, takes a minute)", arch, nvcc)
    _build.compile_library(tmp, gencode, nvcc=nvcc, csrc=csrc)
    os.replace(tmp, target)   # atomic: concurrent builders race harmlessly
    return target


def _check_retired_choice() -> None:
    choice = os.environ.get(RETIRED_PREFIX_KERNEL_ENV, "").strip().lower()
    if choice == "v1":
        raise ValueError(f"${RETIRED_PREFIX_KERNEL_ENV}=v1: the v1 prefix kernel was retired (v2, 1.2-1.4x faster "
                         "on the H200, serves every shape v1 served); unset the variable")
    if choice not in ("", "v2"):
        raise ValueError(f"${RETIRED_PREFIX_KERNEL_ENV}={choice!r}: there is one prefix kernel now; unset the variable")


# ------------------------------------------------------------------------------- the C ABI (ctypes)

_vp, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _PrefixParams(ctypes.Structure):     # hfc_prefix_params
    _fields_ = [(n, _vp) for n in ("q", "pool", "group_rows", "prefix_table", "prefix_len", "part_o", "part_lse")] + \
               [(n, _i64) for n in ("R", "Lq", "Hq", "Hkv", "block_size", "G", "Rg", "Mp", "chunk_tokens",
                                    "max_chunks", "row_tiles")] + \
               [("scale_log2", _f32), ("dtype", _i32), ("head_dim", _i32), ("m_tile", _i32),
                ("q_limit", _vp), ("softcap", _f32), ("window", _i32), ("tune", _i32)]


class _PrefixInfo(ctypes.Structure):       # hfc_prefix_info
    _fields_ = [("ctas_per_sm", _i32), ("smem_bytes", _i32), ("tile_tokens", _i32)]


class _SuffixParams(ctypes.Structure):     # hfc_suffix_params
    _fields_ = [(n, _vp) for n in ("q", "pool", "suffix_table", "q_limit", "part_o", "part_lse")] + \
               [(n, _i64) for n in ("R", "Lq", "Hq", "Hkv", "block_size", "Ms", "split_tokens", "nsplit", "slot0")] + \
               [("scale_log2", _f32), ("dtype", _i32), ("head_dim", _i32), ("softcap", _f32), ("window", _i32)]


class _MergeParams(ctypes.Structure):      # hfc_merge_params
    _fields_ = [(n, _vp) for n in ("part_o", "part_lse", "row_nchunks", "out")] + \
               [(n, _i64) for n in ("R", "Lq", "Hq", "slot0", "nsplit")] + \
               [("dtype", _i32), ("head_dim", _i32), ("row_nmid", _vp), ("mid_slot0", _i64), ("sinks", _vp)]


class _Lib:
    """The loaded shared library: one method per C entry point, raw pointers and sizes in, errors raised."""

    prefix_kernel = "v2"      # the only prefix kernel since v1 was retired (python -m hf_cascade env reports it)

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        lib.hfc_abi_version.restype = _i32
        lib.hfc_abi_version.argtypes = []
        got = lib.hfc_abi_version()
        if got != ABI_VERSION:
            raise RuntimeError(f"{path} has ABI version {got}, this hf_cascade needs {ABI_VERSION}")
        lib.hfc_error_string.restype = ctypes.c_char_p
        lib.hfc_error_string.argtypes = [ctypes.c_int]
        lib.hfc_sync.restype = ctypes.c_int
        lib.hfc_sync.argtypes = []
        lib.hfc_prefix_setup.restype = ctypes.c_int
        lib.hfc_prefix_setup.argtypes = [_i32, _i32, _i32, _i32, ctypes.POINTER(_PrefixInfo)]
        for name, params in (("hfc_prefix", _PrefixParams), ("hfc_suffix", _SuffixParams),
                             ("hfc_merge", _MergeParams)):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.POINTER(params), ctypes.c_size_t]
        self.lib = lib
        self._info: dict = {}        # (dtype, head_dim, m_tile, device, tune) -> prefix_info's figures

    @property
    def debug(self) -> bool:
        """$HF_CASCADE_CUDA_DEBUG / tests: check every launch's arguments and synchronise after it."""
        return debug_sync

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = self.lib.hfc_error_string(rc).decode(errors="replace")
            raise RuntimeError(f"hf_cascade CUDA kernel {what} failed: {msg} (cudaError {rc})")
        if debug_sync:
            rc = self.lib.hfc_sync()
            if rc != 0:
                msg = self.lib.hfc_error_string(rc).decode(errors="replace")
                raise RuntimeError(f"hf_cascade CUDA kernel {what} failed while running: {msg} (cudaError {rc})")

    def prefix_info(self, dtype_code: int, head_dim: int, m_tile: int, device_index: int | None = None,
                    tune: int = 0) -> tuple[int, int, int]:
        """(CTAs per SM, dynamic shared memory bytes, tokens per K/V tile) of one prefix kernel variant (``tune``:
        a tuning variant's code, PREFIX_VARIANTS).

        The first call per variant and device runs ``hfc_prefix_setup`` (the kernel's shared-memory attributes:
        not capture safe), which every prefix launch of that variant needs first; later calls are a dict lookup.
        """
        found = self._variant(dtype_code, head_dim, m_tile, device_index, tune)
        if found[0] < 1:
            raise RuntimeError(f"the prefix kernel (head_dim {head_dim}, rows {m_tile}) cannot run on this GPU "
                               f"({found[1]} bytes of shared memory)")
        return found

    def prefix_runs(self, dtype_code: int, head_dim: int, m_tile: int, tune: int) -> bool:
        """Whether the prefix kernel variant ``tune`` can run on the current device (the Hopper kernel needs the
        library's sm_90a code). Its first call per variant and device runs the setup, as prefix_info's does."""
        return self._variant(dtype_code, head_dim, m_tile, None, tune)[0] >= 1

    def _variant(self, dtype_code: int, head_dim: int, m_tile: int, device_index: int | None, tune: int
                 ) -> tuple[int, int, int]:
        """prefix_info's figures (CTAs per SM 0: cannot run here), set up on first use."""
        dev = torch.cuda.current_device() if device_index is None else device_index
        key = (dtype_code, head_dim, m_tile, dev, tune)
        found = self._info.get(key)
        if found is None:
            info = self._setup(dtype_code, head_dim, m_tile, dev, tune)
            found = self._info[key] = (info.ctas_per_sm, info.smem_bytes, info.tile_tokens)
        return found

    def _setup(self, dtype_code: int, head_dim: int, m_tile: int, dev: int, tune: int) -> "_PrefixInfo":
        """hfc_prefix_setup of one prefix kernel variant on device ``dev``."""
        # cudaFuncSetAttribute: a variant first met inside a capture must have been set up by the warm-up
        refuse_in_capture(f"hfc_prefix_setup (cudaFuncSetAttribute) of the prefix kernel variant dtype code "
                          f"{dtype_code}, head_dim {head_dim}, m_tile {m_tile}, tune {tune}, device {dev}")
        info = _PrefixInfo()
        with torch.cuda.device(dev):
            self.check(self.lib.hfc_prefix_setup(dtype_code, head_dim, m_tile, tune, ctypes.byref(info)),
                       "prefix setup")
        return info

    # The launchers: tensors are trusted here (shapes, dtypes, devices, contiguity: hf_cascade.kernels.ops checks
    # them for the torch operators; attend checks q and the pool, _validate the plan once per step).
    def prefix(self, q, pool, group_rows, prefix_table, prefix_len, part_o, part_lse, m_tile: int, row_tiles: int,
               chunk_tokens: int, max_chunks: int, scale_log2: float, stream: int, q_limit=None, slot0: int = 0,
               softcap: float = 0.0, window: int = 0, tune: int = 0) -> None:
        R, Lq, Hq, D = q.shape
        items = R * Lq * Hq          # the kernel writes slots [0, max_chunks) from the pointers it is given
        o_ptr, lse_ptr = part_o.data_ptr() + 4 * slot0 * items * D, part_lse.data_ptr() + 4 * slot0 * items
        G, Rg = group_rows.shape
        dtype_code = DTYPE_CODES[q.dtype]
        if (dtype_code, D, m_tile, q.device.index, tune) not in self._info:   # setup once, before the first launch
            self.prefix_info(dtype_code, D, m_tile, q.device.index, tune)
        params = _PrefixParams(q.data_ptr(), pool.data_ptr(), group_rows.data_ptr(), prefix_table.data_ptr(),
                               prefix_len.data_ptr(), o_ptr, lse_ptr, R, Lq, Hq,
                               pool.shape[3], pool.shape[2], G, Rg, prefix_table.shape[1], chunk_tokens, max_chunks,
                               row_tiles, scale_log2, dtype_code, D, m_tile,
                               None if q_limit is None else q_limit.data_ptr(), softcap, window, tune)
        self.check(self.lib.hfc_prefix(ctypes.byref(params), stream), "prefix")

    def suffix(self, q, pool, suffix_table, q_limit, part_o, part_lse, split_tokens: int, nsplit: int, slot0: int,
               scale_log2: float, stream: int, softcap: float = 0.0, window: int = 0) -> None:
        R, Lq, Hq, D = q.shape
        params = _SuffixParams(q.data_ptr(), pool.data_ptr(), suffix_table.data_ptr(), q_limit.data_ptr(),
                               part_o.data_ptr(), part_lse.data_ptr(), R, Lq, Hq, pool.shape[3], pool.shape[2],
                               suffix_table.shape[1], split_tokens, nsplit, slot0, scale_log2, DTYPE_CODES[q.dtype], D,
                               softcap, window)
        self.check(self.lib.hfc_suffix(ctypes.byref(params), stream), "suffix")

    def merge(self, part_o, part_lse, row_nchunks, out, slot0: int, nsplit: int, stream: int, row_nmid=None,
              mid_slot0: int = 0, sinks=None) -> None:
        R, Lq, Hq, D = out.shape
        params = _MergeParams(part_o.data_ptr(), part_lse.data_ptr(), row_nchunks.data_ptr(), out.data_ptr(), R, Lq,
                              Hq, slot0, nsplit, DTYPE_CODES[out.dtype], D,
                              None if row_nmid is None else row_nmid.data_ptr(), mid_slot0,
                              None if sinks is None else sinks.data_ptr())
        self.check(self.lib.hfc_merge(ctypes.byref(params), stream), "merge")


def prebuilt_library() -> str | None:
    """The path of this installation's prebuilt library if it loads with this ABI version, else None."""
    if not PREBUILT.is_file():
        return None
    try:
        return str(_Lib(PREBUILT).path)
    except (OSError, RuntimeError):
        return None


def _load(arch: str) -> _Lib:
    """The prebuilt library if it is there and fits, else one built with nvcc for ``arch``."""
    prebuilt_problem = None
    if PREBUILT.is_file():
        try:
            return _Lib(PREBUILT)
        except (OSError, RuntimeError) as err:
            prebuilt_problem = f"the prebuilt {PREBUILT.name} is unusable ({err})"
            logger.info("%s; building from source instead", prebuilt_problem)
    try:
        return _Lib(build_library(arch))
    except RuntimeError as err:
        where = prebuilt_problem or "no prebuilt kernel library in this installation"
        detail = str(err)
        if "\n" in detail:         # nvcc's messages: in full at INFO, the first line in the reason
            logger.info("building the CUDA kernels for %s failed:\n%s", arch, detail)
            detail = detail.splitlines()[0] + " (nvcc's output: INFO on the 'hf_cascade' logger)"
        raise RuntimeError(f"{where}, and building one failed: {detail}") from err


def library(device) -> _Lib:
    """The kernel library for ``device``, loaded (or built) on first use; RuntimeError if it cannot be (the
    reason is one line; :func:`hf_cascade.kernels.select` turns it into the one WARNING that says how to get
    the kernels)."""
    major, minor = torch.cuda.get_device_capability(device)
    arch = f"sm_{major}{minor}"
    with _lock:
        found = _libs.get(arch)
        if found is None:
            _check_retired_choice()    # read when the library is loaded; raised, not a reason to fall back
            try:
                found = _load(arch)
            except Exception as err:   # remember the reason: never retry a failed build every step
                found = f"{type(err).__name__}: {err}"
            _libs[arch] = found
    if isinstance(found, str):
        raise RuntimeError(found)
    return found


def availability() -> tuple[bool, str]:
    """Whether the CUDA kernels can run here, and why (for ``python -m hf_cascade env``). Builds nothing."""
    try:
        _check_retired_choice()
    except ValueError as err:
        return False, str(err)
    if PREBUILT.is_file():
        try:
            source = f"prebuilt {_Lib(PREBUILT).path} (sm_80, sm_86, sm_89, sm_90a + compute_90 PTX)"
        except (OSError, RuntimeError) as err:
            source = None
            problem = f"the prebuilt library is unusable ({err})"
    else:
        source, problem = None, "no prebuilt kernel library in this installation"
    if source is None:
        nvcc, csrc = _build.find_nvcc(), _build.find_csrc()
        if nvcc and csrc:
            source = f"built with {nvcc} from {csrc} on first use, cached in {_cache_dir()}"
        else:
            missing = "nvcc" if csrc else "the kernel sources (csrc/)"
            return False, (f"{problem} and no {missing} to build one: install a wheel built with nvcc, or put nvcc on "
                           "PATH / set $CUDA_HOME")
    if not torch.cuda.is_available():
        return False, f"no CUDA GPU visible to torch (kernels: {source})"
    cap = torch.cuda.get_device_capability()
    if cap < (8, 0):
        return False, f"compute capability {cap[0]}.{cap[1]} (needs 8.0 or newer; kernels: {source})"
    return True, source


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
class _PrefixLevel:
    """The prefix kernel's launch shape for one shared level (the group prefix, or a three-level plan's middle)."""
    has: bool
    m_tile: int
    row_tiles: int
    chunk_tokens: int
    max_chunks: int
    row_nchunks: np.ndarray       # int32 [R]: this level's partials of each row (0: in no (sub)group)
    tune: int = 0                 # the kernel's tuning variant (PrefixTune.code; 0: the default)


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


def _prefix_level(lib, gr, pl, table_blocks, R, Lq, grp, Hkv, D, dtype, bs, sms, tune: PrefixTune = PrefixTune(),
                  plain: bool = True) -> _PrefixLevel:
    """Row tile and chunking of one shared level's prefix kernel launch (host arrays only, no sync); ``tune``
    (the default: the production choice) for a sweep, ``plain``: the layer has no softcap / window."""
    pl = np.asarray(pl).astype(np.int64)
    gr = np.asarray(gr)
    G, Rg = gr.shape
    row_nchunks = np.zeros(R, dtype=np.int32)
    if not (G > 0 and Rg > 0 and table_blocks > 0 and int(pl.max(initial=0)) > 0):
        return _PrefixLevel(False, 1, 1, 1, 0, row_nchunks)
    rows_q = Rg * Lq * grp
    tune = tune.resolve(dtype, D, rows_q, plain,
                        lambda: lib.prefix_runs(DTYPE_CODES[dtype], D, 64, PREFIX_VARIANTS[SM90_VARIANT][0]))
    m_max = 64 if D <= 128 else 32
    m_tile = next((m for m in (16, 32, 64) if m <= m_max and rows_q <= m), m_max)
    if tune.m_tile and tune.m_tile <= m_max:
        m_tile = tune.m_tile
    elif len(PREFIX_VARIANTS[tune.variant][1]) == 1 and PREFIX_VARIANTS[tune.variant][1][0] <= m_max:
        m_tile = PREFIX_VARIANTS[tune.variant][1][0]     # a variant compiled for one row tile (the Hopper kernel's 64)
    row_tiles = -(-rows_q // m_tile)
    code = tune.code(dtype, D, m_tile, plain)
    if code and not lib.prefix_runs(DTYPE_CODES[dtype], D, m_tile, code):
        code = 0                    # a variant asked for where it cannot run ("wg" without sm_90a): the default
    occ, _, tile_tokens = lib.prefix_info(DTYPE_CODES[dtype], D, m_tile, tune=code)
    if tune.chunk_tokens:
        chunk_blocks = -(-tune.chunk_tokens // bs)
    else:
        chunk_blocks = choose_chunk_blocks(
            -(-pl // bs), Hkv * row_tiles, sms * occ, bs, tile_tokens, min_tokens=tune.min_tokens or MIN_CHUNK_TOKENS,
            prefer_tokens=PREFER_CHUNK_TOKENS if tune.prefer_tokens is None else tune.prefer_tokens)
    chunk_tokens = chunk_blocks * bs
    nchunks = -(-pl // chunk_tokens)
    for g in range(G):              # one iteration per group (a prompt), not per block
        rows = gr[g][gr[g] >= 0]
        row_nchunks[rows] = nchunks[g]
    return _PrefixLevel(True, m_tile, row_tiles, chunk_tokens, int(nchunks.max()), row_nchunks, code)


def _sm_count(dev) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


def _step_state(lib: _Lib, q: torch.Tensor, pool: torch.Tensor, plan, three: bool = False, plain: bool = True
                ) -> _StepState:
    """The launch state of ``plan`` for layers of ``q``'s shape: ``three``: the plan's middle level runs as one
    (layers with a window read two levels: see CudaBackend.forward); ``plain``: no softcap / window, which matters
    only where a tuning variant may run (it serves only those: bf16, head_dim 128 in production)."""
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
    pre = _prefix_level(lib, plan.group_rows, plan.prefix_len, plan.prefix_table.shape[1], R, Lq, grp, Hkv, D,
                        q.dtype, bs, sms, tune, plain)
    mid = (_prefix_level(lib, plan.mid_group_rows, plan.mid_len, plan.mid_table.shape[1], R, Lq, grp, Hkv, D,
                         q.dtype, bs, sms, tune, plain) if three else None)
    suffix_table, q_limit = (plan.inner_suffix_table, plan.inner_q_limit) if three else (plan.suffix_table, plan.q_limit)
    nqb = -(-(Lq * grp) // SUFFIX_QB)
    # a static step's suffix split is fixed by the table's capacity, not this step's lengths (a graph
    # replays the launch; CTAs past a row's length write empty partials)
    tmax = suffix_table.shape[1] * bs if plan.static else int(np.asarray(q_limit).max(initial=0))
    split_tokens, nsplit = choose_suffix_split(tmax, R * Hkv * nqb, sms * SUFFIX_CTAS_PER_SM)
    slots = pre.max_chunks + (mid.max_chunks if three else 0) + nsplit
    return _StepState(
        has_prefix=pre.has, m_tile=pre.m_tile, row_tiles=pre.row_tiles, chunk_tokens=pre.chunk_tokens,
        max_chunks=pre.max_chunks, split_tokens=split_tokens, nsplit=nsplit, slots=slots,
        row_nchunks=torch.from_numpy(pre.row_nchunks).to(dev),
        part_o=torch.empty(slots * R * Lq * Hq * D, dtype=torch.float32, device=dev),
        part_lse=torch.empty(slots * R * Lq * Hq, dtype=torch.float32, device=dev),
        dp=plan.on(dev), three=three, mid=mid,
        row_nmid=torch.from_numpy(mid.row_nchunks).to(dev) if three else None, tune=pre.tune)


# --------------------------------------------------------------------------------------- the backend

def _unsupported(q, pool):
    """Beyond the declared dtypes, head dims and device: why this backend cannot take a layer of ``q`` over
    ``pool``, or None."""
    if q.device.type != "cuda":
        return "needs CUDA tensors"           # before any question to the device
    if pool.device != q.device:
        return "the KV pool is not on the queries' device"
    if pool.dtype != q.dtype:
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
    """The bundled kernels of ``csrc/`` (bfloat16/float16, the compiled head dims, compute capability 8.0 up)."""

    name = "cuda"
    dtypes = tuple(DTYPE_CODES)
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

    def metadata_key(self, q, pool, quirks: Quirks):
        # not the pool's size: a pool that grows between a graph's warm-up and its capture (VMM maps ahead in the
        # background) must not make a new state, whose uploads would break the capture; indices stay valid as it grows
        R, Lq, Hq, D = q.shape
        tune = prefix_tune()
        plain = quirks.softcap is None and quirks.window is None
        return (str(q.device), R, Lq, Hq, pool.shape[3], D, pool.shape[2], q.dtype, quirks.window is None,
                plain and tune.splits_by_plainness(q.dtype, D), tune)

    def build(self, plan, q, pool, quirks: Quirks = NO_QUIRKS, lib: "_Lib | None" = None) -> _StepState:
        """The launch state of ``plan`` for layers like ``q`` with ``quirks`` (``lib``: the kernels' library, by
        default the one of q's device)."""
        # like the reference, a layer with a window reads two levels (its window start is defined over the group
        # prefix + the row's suffix); the others read a three-level plan's middle level once per subgroup
        three = quirks.window is None and _has_middle(plan)
        plain = quirks.softcap is None and quirks.window is None
        # on q's device: the prefix variants' one-time setup applies to the current device
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            return _step_state(library(q.device) if lib is None else lib, q, pool, plan, three, plain)

    def forward(self, q, pool, metadata: _StepState, scale, *, softcap=None, window=None, sinks=None):
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
        if Lq != metadata.dp.q_limit.shape[1]:
            raise ValueError(f"cuda backend: q has {Lq} tokens per row, the plan {metadata.dp.q_limit.shape[1]}")
        out = torch.empty_like(q)
        if out.numel() == 0:
            return out
        with torch.cuda.device(q.device):
            lib = library(q.device)
            _launch(lib, torch.cuda.current_stream(q.device).cuda_stream, q, pool, metadata, scale, out,
                    softcap=softcap, window=window, sinks=sinks)
        return out


BACKEND = CudaBackend()


def attend(q, pool, plan, scale, quirks: Quirks = NO_QUIRKS):
    """One layer's cascade attention for one step (build, then forward)."""
    return BACKEND.attend(q, pool, plan, scale, quirks)


def _launch(lib, stream: int, q, pool, st: _StepState, scale, out, *, softcap=None, window=None, sinks=None,
            kernels=ops) -> None:
    """The launches of one layer (``kernels``: :mod:`hf_cascade.kernels.ops`, or a CPU emulation in the tests)."""
    scale_log2 = float(scale) * LOG2E
    # the layer's variants: runtime scalars of the launches (fixed per layer: a CUDA graph bakes them); the
    # window is applied by the kernels from the device-side lengths, so the launch shapes never depend on it
    softcap, window, sinks = _quirks(softcap, window, sinks, q)
    if st.three and window:
        raise ValueError("cuda backend: a layer with a sliding window reads two levels; its state was built for three "
                         "(build it with the layer's quirks)")
    three = st.three
    dp = st.dp
    if st.has_prefix:
        kernels.prefix(lib, stream, q, pool, dp.group_rows, dp.prefix_table, dp.prefix_len, st.part_o, st.part_lse,
                       st.m_tile, st.row_tiles, st.chunk_tokens, st.max_chunks, scale_log2, dp.q_limit, 0, softcap,
                       window, st.tune)
    if three and st.mid.has:
        mid = st.mid
        kernels.prefix(lib, stream, q, pool, dp.mid_group_rows, dp.mid_table, dp.mid_len, st.part_o, st.part_lse,
                       mid.m_tile, mid.row_tiles, mid.chunk_tokens, mid.max_chunks, scale_log2, dp.q_limit,
                       st.max_chunks, softcap, 0, mid.tune)
    suffix_table, q_limit = (dp.inner_suffix_table, dp.inner_q_limit) if three else (dp.suffix_table, dp.q_limit)
    kernels.suffix(lib, stream, q, pool, suffix_table, q_limit, st.part_o, st.part_lse, st.split_tokens,
                   st.nsplit, st.suffix_slot0, scale_log2, softcap, window)
    kernels.merge(lib, stream, st.part_o, st.part_lse, st.row_nchunks, out, st.suffix_slot0, st.nsplit,
                  st.row_nmid if three else None, st.max_chunks, sinks)


def _quirks(softcap, window, sinks, q) -> tuple[float, int, torch.Tensor | None]:
    """(softcap, window, sinks) of the layer as the kernels take them: 0 for off, the sinks float32 [Hq] on q's
    device."""
    if softcap is not None and not float(softcap) > 0.0:
        raise ValueError(f"cuda backend: softcap {softcap} must be > 0 (None: off)")
    if window is not None and int(window) < 1:
        raise ValueError(f"cuda backend: sliding window {window} must be >= 1 (None: off)")
    if sinks is not None:
        if sinks.shape != (q.shape[2],):
            raise ValueError(f"cuda backend: sinks of shape {tuple(sinks.shape)}, expected ({q.shape[2]},) (one per "
                             "query head)")
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()   # a no-op when it is already so
    return (0.0 if softcap is None else float(softcap)), (0 if window is None else int(window)), sinks
