"""Where the CUDA backend's kernel library comes from: the prebuilt one of a wheel, else built with nvcc, once per
GPU architecture and process.

First that works: the prebuilt library of a wheel (``hf_cascade/kernels/libhfc_kernels.so``: sm_80, sm_86, sm_89,
sm_90a and compute_90 PTX) if its ABI version and struct layout match (:mod:`hf_cascade.kernels.cuda_binding`); else
compiled with nvcc (:mod:`hf_cascade.kernels._build`) for the present GPU on first use and cached under
``$HF_CASCADE_CACHE`` (default ``~/.cache/hf_cascade``), keyed by a hash of the sources, the arch, the flags and nvcc's
version; else the backend is unavailable (the reason starts with "CUDA kernels unavailable", on which
:func:`hf_cascade.kernels.select` WARNs once with what to do) and the next backend runs.

The cache write (:func:`write_slots`) uses the library where a backend has loaded it, for any backend's pool; so
does a static step's copy-on-write copies of every layer at once (:func:`copy_blocks_layers`, with
:data:`layer_copies`).

Mutable state: ``_libs`` (arch -> the loaded library or the reason it failed), filled under ``_lock``; ``_arch_of``;
``write_kernel`` (``$HF_CASCADE_WRITE_KERNEL``, set by tests); ``strided_write``, ``layer_copies`` and ``fp8_write``
(set by tests).
"""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import threading
from pathlib import Path

import torch

from . import _build
from .cuda_binding import ABI_VERSION, DTYPE_CODES, _Lib

__all__ = ["library", "availability", "prebuilt_library", "build_library", "PREBUILT"]

logger = logging.getLogger("hf_cascade")

PREBUILT = Path(__file__).resolve().parent / _build.LIBRARY_NAME
# the cache write's kernel (csrc/write.cu) is on unless 0/false/off/no: on the H200 it equals the torch write bytewise
# (tests/kernels/test_gpu_kernels.py) and took the 8B 16k x 8 whole step from 7.07 to 6.76 ms (benchmarks/RESULTS.md)
WRITE_KERNEL_ENV = "HF_CASCADE_WRITE_KERNEL"
write_kernel = os.environ.get(WRITE_KERNEL_ENV, "1").strip().lower() not in ("0", "false", "off", "no")  # tests set it
# On: the cache write reads K/V where they lie (hfc_write_strided: e.g. V as a column slice of a fused q|k|v product)
# instead of copying them contiguous first (one copy kernel a layer, 72 us of the 8B 16k x 8 beam step on the H200;
# that copy is gone with the kernel: benchmarks/RESULTS.md). tests/kernels/test_gpu_kernels.py's strided write tests
# passed on the H200 (2026-12-05)
strided_write = True
# On: a static step that copies blocks (beam search) launches the copy-on-write copies of every layer's pool at once,
# before the forward (hfc_copy_blocks_layers, from hf_cascade.kv.cache.CascadeCache), and the layers' writes launch
# none: 32 launches a beam step at 8B, 101 us of the 6.4 ms step on the H200. Its GPU tests passed on an H100
# (2026-12-05, tests/kernels/test_gpu_kernels.py and tests/decode/test_gpu_whole_step.py -k all_layer).
layer_copies = True
# On: a float8_e4m3fn pool's new tokens are encoded inside the write (hfc_write_fp8) instead of by the four torch ops per
# tensor of BlockStorage.encode (to float32, divide, clamp, to float8) before it: 256 launches and ~455 us of the 8B
# 16k x 8 fp8 beam step on an H100 (benchmarks/RESULTS.md). Bit for bit the same bytes (tests/kv/test_gpu_fp8.py).
fp8_write = True

_lock = threading.Lock()
_libs: dict[str, "_Lib | str"] = {}          # arch -> loaded library, or the reason it failed (never retried)
_arch_of: dict[int, str] = {}                 # device index -> its "sm_XY" (read once: loaded() runs per layer)
_find_nvcc = _build.find_nvcc                 # (hf_cascade.diagnostics reports it)


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


def prebuilt_library() -> str | None:
    """The path of this installation's prebuilt library if it loads with this ABI version and layout, else None."""
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
            try:
                found = _load(arch)
            except Exception as err:   # remember the reason: never retry a failed build every step
                found = f"{type(err).__name__}: {err}"
            _libs[arch] = found
    if isinstance(found, str):
        raise RuntimeError(found)
    return found


def loaded(device: torch.device) -> _Lib | None:
    """The library if it is already loaded for ``device``'s architecture (by a backend that uses it), else None;
    never loads or builds one (callers with a torch fallback, such as the cache write, use it only where it is)."""
    found = _libs.get(_arch(device))
    return found if isinstance(found, _Lib) else None


def _arch(device: torch.device) -> str:
    """``device``'s "sm_XY" (read once a device: loaded() runs per layer)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    arch = _arch_of.get(index)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(index)
        arch = _arch_of[index] = f"sm_{major}{minor}"
    return arch


def prebuilt_or_loaded(device: torch.device) -> _Lib | None:
    """The library for ``device`` where it is loaded already or the prebuilt one loads (never a build from source:
    that is the cuda backend's to start), else None. For kernels that a call decides on once, before its first
    forward (:mod:`hf_cascade.fused_ops`): a library that a backend loads half way through a call would change how
    the rest of the call computes."""
    found = loaded(device)
    if found is None and PREBUILT.is_file():
        arch = _arch(device)
        with _lock:
            if arch not in _libs:
                try:
                    _libs[arch] = _Lib(PREBUILT)
                except (OSError, RuntimeError):
                    return None         # (not remembered: the backend's library() may still build one)
        found = loaded(device)
    return found


def write_slots(pool, key, value, write_block, write_offset, copy_src, copy_dst, copies: bool) -> bool:
    """The cache write of one layer on the library's kernel (two launches: the block copies, then every new token's
    K and V; four torch kernels otherwise) where the library is loaded for the pool's device and the tensors fit it
    (contiguous, or strided as :func:`write_fits` allows; int64 indices, whole 16-byte vectors per token); returns
    False where it did not write (the caller writes with torch ops; a library not loaded yet is not loaded for this).
    ``$HF_CASCADE_WRITE_KERNEL=0`` turns it off (:data:`write_kernel`). Shapes:
    :func:`hf_cascade.cache._write_slots`."""
    lib = loaded(pool.device) if write_kernel else None
    if lib is None or key.element_size() != pool.element_size() or key.dtype != value.dtype:
        return False
    if (key.shape[1] * key.shape[2] * key.element_size()) % 16 or not all(
            t.is_contiguous() for t in (pool, write_block, write_offset, copy_src, copy_dst)) or any(
            t.dtype != torch.int64 for t in (write_block, write_offset, copy_src, copy_dst)):
        return False
    stream = torch.cuda.current_stream(pool.device).cuda_stream
    if key.is_contiguous() and value.is_contiguous():
        lib.write(pool, key, value, write_block, write_offset, copy_src, copy_dst, copies, stream)
    elif _strided_fits(lib, key, value):
        lib.write_strided(pool, key, value, write_block, write_offset, copy_src, copy_dst, copies, stream)
    else:
        return False
    return True


def write_slots_fp8(pool, key, value, scale, write_block, write_offset, copy_src, copy_dst, copies: bool) -> bool:
    """:func:`write_slots` into a float8_e4m3fn ``pool`` from the model's bf16 / fp16 ``key``, ``value``
    ``[tokens, Hkv, D]``, encoded by the kernel as ``BlockStorage.encode`` encodes them (``scale`` ``[2, Hkv]`` float32,
    fixed) where the library has ``hfc_write_fp8`` and the tensors fit (:data:`fp8_write` on, each token's ``Hkv x D``
    contiguous and 16-byte aligned, tokens contiguous or strided, ``D`` a multiple of 8); False where it did not write
    (the caller encodes with torch ops and writes the bytes)."""
    lib = loaded(pool.device) if write_kernel and fp8_write else None
    if lib is None or not getattr(lib, "has_fp8_write", False) or pool.dtype != torch.float8_e4m3fn:
        return False
    tokens, heads, dim = key.shape
    if (key.dtype not in DTYPE_CODES or value.dtype != key.dtype or value.shape != key.shape or dim % 8
            or (heads * dim) % 16 or key.device != pool.device or value.device != pool.device):
        return False
    if (scale.dtype != torch.float32 or scale.shape != (2, heads) or scale.device != pool.device
            or not all(t.is_contiguous() for t in (pool, scale, write_block, write_offset, copy_src, copy_dst))
            or any(t.dtype != torch.int64 for t in (write_block, write_offset, copy_src, copy_dst))):
        return False
    if not (_tokens_fit(key) and _tokens_fit(value)):     # (contiguous or strided: read where they lie)
        return False
    if not tokens and not (copies and copy_src.numel()):
        return True     # nothing to move (the pool may hold no block yet: no pointer to pass)
    lib.write_fp8(pool, key, value, scale, write_block, write_offset, copy_src, copy_dst, copies,
                  torch.cuda.current_stream(pool.device).cuda_stream)
    return True


def copy_blocks_layers(pool_addresses: torch.Tensor, copy_src: torch.Tensor, copy_dst: torch.Tensor,
                       block_bytes: int) -> bool:
    """A static step's copy-on-write copies ``pool[copy_dst[i]] = pool[copy_src[i]]`` in every layer's pool in one
    launch of the library's kernel (``csrc/write.cu``, on the current stream: inside a CUDA graph when captured), where
    the library is loaded for the device (:func:`loaded`) and has the kernel; False where it did not run (the layers'
    writes then copy their own blocks). ``pool_addresses`` int64 ``[layers]``: each pool's base address (16-byte
    aligned; the caller's to check, as the kernel reads them on the device), every pool with blocks of ``block_bytes``
    (a multiple of 16); ``copy_src``, ``copy_dst`` int64 ``[copies]``; pairs that copy a block onto itself or repeat
    pair 0 are skipped. The caller decides where it is wanted (:data:`layer_copies`)."""
    if not pool_addresses.is_cuda:
        return False
    lib = loaded(pool_addresses.device)
    if lib is None or not getattr(lib, "has_layer_copies", False):
        return False
    tensors = (pool_addresses, copy_src, copy_dst)
    if (block_bytes < 16 or block_bytes % 16 or pool_addresses.dim() != 1 or copy_src.dim() != 1
            or copy_dst.shape != copy_src.shape
            or any(t.dtype != torch.int64 or not t.is_contiguous() or t.device != pool_addresses.device
                   for t in tensors)):
        return False
    lib.copy_blocks_layers(pool_addresses, copy_src, copy_dst, int(block_bytes),
                           torch.cuda.current_stream(pool_addresses.device).cuda_stream)
    return True


def write_fits(pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether :func:`write_slots` takes ``key`` and ``value`` ``[tokens, Hkv, D]`` as they are, uncopied, into
    ``pool`` (on a CUDA device): both contiguous, or (:data:`strided_write` on, and the library loaded for the pool's
    device has ``hfc_write_strided``) each token's ``Hkv x D`` contiguous, tokens a multiple of 16 bytes apart (and no
    closer than a token's bytes), the data 16-byte aligned, as a fused q|k|v product's V slice is. Where not, the
    caller makes them contiguous first."""
    return (key.is_contiguous() and value.is_contiguous()) or _strided_fits(loaded(pool.device), key, value)


def _strided_fits(lib, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``lib`` (a loaded library or None) writes ``key`` and ``value`` as they lie: :data:`strided_write` on, a
    library with the entry (one built before it has none), one shape, tokens the kernel reads (:func:`_tokens_fit`)."""
    return (strided_write and lib is not None and getattr(lib, "has_strided_write", False)
            and key.shape == value.shape and _tokens_fit(key) and _tokens_fit(value))


def _tokens_fit(t: torch.Tensor) -> bool:
    """Whether the strided write kernel reads ``t`` ``[tokens, Hkv, D]`` as it is: each token's ``Hkv x D`` elements
    contiguous (the stride of a dimension of size 1 is immaterial), the token stride a multiple of 16 bytes and at
    least a token's bytes, the data 16-byte aligned."""
    if t.dim() != 3:
        return False
    tokens, heads, dim = t.shape
    if (dim > 1 and t.stride(2) != 1) or (heads > 1 and t.stride(1) != dim):
        return False
    size = t.element_size()
    token_bytes = heads * dim * size
    stride_bytes = t.stride(0) * size if tokens > 1 else token_bytes     # (write_strided passes the same)
    return stride_bytes % 16 == 0 and stride_bytes >= token_bytes and t.data_ptr() % 16 == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of ``x`` ``[..., hidden]`` with ``weight`` ``[hidden]`` in one launch of the library's kernel
    (``csrc/elementwise.cu``: the eager forward's roundings, see :mod:`hf_cascade.fused_ops`), or None where it does
    not run (no library loaded for the device, or one built before the kernel; not :func:`norm_fits`): the caller runs
    its own forward."""
    lib = _elementwise_library(x)
    if lib is None or not norm_fits(x, weight):
        return None
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x    # (a view where the rows are evenly strided)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    lib.rms_norm(out, rows, weight, eps, torch.cuda.current_stream(x.device).cuda_stream)
    return out


def norm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the norm kernel reads ``x`` and ``weight`` as they are: bf16 or fp16, one dtype and device, ``weight``
    ``[hidden]`` contiguous, ``x``'s last dimension contiguous."""
    hidden = x.shape[-1]
    return (x.dtype in DTYPE_CODES and weight.dtype == x.dtype and weight.device == x.device
            and weight.shape == (hidden,) and weight.stride(0) == 1 and x.stride(-1) == 1)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(residual + x, rms_norm(residual + x))`` in one launch of the library's kernel (``csrc/elementwise.cu``: the
    sum rounded as eager's add, the norm as :func:`rms_norm`'s kernel), or None where it does not run (no library
    loaded for the device, or one built before the kernel; not :func:`add_norm_fits`): the caller runs its own ops."""
    lib = _elementwise_library(x)
    if lib is None or not getattr(lib, "has_add_norm", False) or not add_norm_fits(x, residual, weight):
        return None
    hidden = x.shape[-1]
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return total, out
    lib.add_rms_norm(out.view(-1, hidden), total.view(-1, hidden), x.reshape(-1, hidden), residual.reshape(-1, hidden),
                     weight, eps, torch.cuda.current_stream(x.device).cuda_stream)
    return total, out


def add_norm_fits(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the add-and-norm kernel reads them as they are: :func:`norm_fits` for each, one shape, hidden a multiple
    of 8 and at most 8192, rows evenly strided (a view as ``[rows, hidden]``), 16-byte aligned rows."""
    if residual.shape != x.shape or not (norm_fits(x, weight) and norm_fits(residual, weight)):
        return False
    hidden = x.shape[-1]
    if hidden % 8 or hidden > 8192 or weight.data_ptr() % 16:
        return False
    for t in (x, residual):
        try:
            rows = t.view(-1, hidden)
        except RuntimeError:             # (rows not evenly strided: a view cannot say them)
            return False
        if rows.data_ptr() % 16 or (rows.shape[0] > 1 and rows.stride(0) % 8):
            return False
    return True


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``(q_embed, k_embed)``: transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` (``unsqueeze_dim=1``) in one
    launch of the library's kernel, bit for bit eager mode's (:mod:`hf_cascade.fused_ops`), or None where it does
    not run (no library for the device; not :func:`rotary_fits`)."""
    lib = _elementwise_library(q)
    if lib is None or not rotary_fits(q, k, cos, sin):
        return None
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    lib.rotary(q, k, cos, sin, q_out, k_out, torch.cuda.current_stream(q.device).cuda_stream)
    return q_out, k_out


def rotary_fits(q, k, cos, sin) -> bool:
    """Whether the rotary kernel reads them as they are: q, k ``[B, H, L, D]`` (any strides but D's, which is 1),
    cos, sin ``[B or 1, L, D]`` with the same strides, D even, one dtype (bf16, fp16) and device for all four."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape or sin.stride() != cos.stride():
        return False
    batch, _, tokens, dim = q.shape
    return (q.dtype in DTYPE_CODES and dim % 2 == 0 and k.shape[0] == batch and k.shape[2:] == (tokens, dim)
            and cos.shape[1:] == (tokens, dim) and cos.shape[0] in (1, batch)
            and all(t.dtype == q.dtype and t.device == q.device for t in (k, cos, sin))
            and all(t.stride(-1) == 1 for t in (q, k, cos)))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """``F.silu(gate) * up`` in one launch of the library's kernel (``csrc/elementwise.cu``), bit for bit eager mode's
    (:func:`hf_cascade.decode.fused_ops.silu_mul_reference`), or None where it does not run (no library loaded for the
    device, or one built before the kernel; not :func:`silu_mul_fits`): the caller runs the torch ops. ``gate`` and
    ``up`` may be strided views (the two halves of a fused gate|up product); the result is contiguous."""
    lib = _elementwise_library(gate)
    if lib is None or not lib.has_silu_mul or not silu_mul_fits(gate, up):
        return None
    width = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    # (views where the rows are evenly strided, as a slice of a product's rows is; a copy otherwise)
    lib.silu_mul(out.view(-1, width), gate.reshape(-1, width), up.reshape(-1, width),
                 torch.cuda.current_stream(gate.device).cuda_stream)
    return out


def silu_mul_fits(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the activation kernel reads ``gate`` and ``up`` as they are: one shape, dtype (bf16, fp16) and device,
    the last dimension contiguous and not empty."""
    return (gate.dtype in DTYPE_CODES and up.dtype == gate.dtype and up.device == gate.device
            and up.shape == gate.shape and gate.dim() >= 1 and gate.shape[-1] >= 1
            and gate.stride(-1) == 1 and up.stride(-1) == 1)


# the block bookkeeping kernel's limits (csrc/blocks.cu): a thread per row in one CTA; pool ids counted in at most 2048
# chunks of 4096
BLOCKS_MAX_ROWS, BLOCKS_MAX_POOL = 1024, 2048 * 4096


def blocks_advance(blocks, plan, parents: torch.Tensor, done: torch.Tensor, peak: torch.Tensor) -> bool:
    """A decode step's block bookkeeping (``hf_cascade.decode.whole_step.advance``: ``device_blocks.reorder`` by
    ``parents``, ``device_blocks.append`` unless ``done``, the step's plan into ``plan``, ``peak`` raised) in one launch
    of the library's kernel (``csrc/blocks.cu``, bit for bit the torch code's), where the library is loaded for the
    device (:func:`loaded`: a library not loaded yet is not loaded for this) and the tensors fit (:func:`blocks_fit`);
    False where it did not run (the caller runs the torch ops). ``blocks``: a DeviceBlocks; ``plan``: a DevicePlan;
    ``parents`` int64 [R]; ``done`` bool []; ``peak`` int64 []."""
    if not blocks.tables.is_cuda:
        return False
    lib = loaded(blocks.tables.device)
    if lib is None or not lib.has_blocks or not blocks_fit(blocks, plan, parents, done, peak):
        return False
    lib.blocks_advance(blocks, plan, parents, done, peak, torch.cuda.current_stream(blocks.tables.device).cuda_stream)
    return True


def blocks_fit(blocks, plan, parents, done, peak) -> bool:
    """Whether the bookkeeping kernel reads and writes these tensors as they are: DeviceBlocks' and DevicePlan's
    dtypes and shapes (R rows, 1 <= R <= 1024; 1 <= pool_blocks <= 2^23), the middle level's plan tensors present
    exactly where it has one, every tensor contiguous on one device."""
    R, W = blocks.tables.shape
    P, K = blocks.pool_blocks, blocks.check_rows.shape[0]
    if not (1 <= R <= BLOCKS_MAX_ROWS and W >= 1 and 1 <= P <= BLOCKS_MAX_POOL):
        return False
    inner = blocks.inner_width > 0
    if (plan.inner_suffix_table is not None) != inner or (plan.inner_q_limit is not None) != inner:
        return False
    i32, i64, b = torch.int32, torch.int64, torch.bool
    want = [(blocks.tables, i32, (R, W)), (blocks.lengths, i64, (R,)), (blocks.refcount, i32, (P + 1,)),
            (blocks.flags, i32, ()), (blocks.steps, i64, ()), (blocks.token_limit, i64, ()),
            (blocks.row_prefix_blocks, i64, (R,)), (blocks.row_inner_blocks, i64, (R,)),
            (blocks.check_rows, i64, (K,)), (blocks.check_cols, i64, (K,)), (blocks.check_ids, i32, (K,)),
            (blocks.check_used, b, (K,)), (parents, i64, (R,)), (done, b, ()), (peak, i64, ()),
            (plan.suffix_table, i32, (R, blocks.suffix_width)), (plan.q_limit, i32, (R, 1)),
            (plan.write_block, i64, (R,)), (plan.write_offset, i64, (R,)), (plan.copy_src, i64, (R,)),
            (plan.copy_dst, i64, (R,))]
    if inner:
        want += [(plan.inner_suffix_table, i32, (R, blocks.inner_width)), (plan.inner_q_limit, i32, (R, 1))]
    device = blocks.tables.device
    return all(t.dtype == dtype and tuple(t.shape) == shape and t.device == device and t.is_contiguous()
               for t, dtype, shape in want)


# the token choice kernels' limits (csrc/select.cu): a thread per row in one CTA; beam_scores ranks the two small top-k's
# (torch's bitonic sort: k <= 32) of lists of at most 128 entries
SELECT_MAX_ROWS, CHOOSE_MAX_BEAMS, CHOOSE_MAX_ENTRIES = 1024, 32, 128


def ranks_beams(beams: int, candidates: int) -> bool:
    """Whether the library's beam_scores ranks a beam step's two small top-k's itself (its next_indices and keep)."""
    return beams <= CHOOSE_MAX_BEAMS and beams + candidates <= CHOOSE_MAX_ENTRIES


def select_library(state, parents: torch.Tensor, input_ids: torch.Tensor, positions: tuple) -> _Lib | None:
    """The library that runs a step's token-choice bookkeeping (``csrc/select.cu``: the ``sample_finish``,
    ``beam_scores`` and ``beam_finish`` methods of the binding) on ``state`` (a device_select.SelectionState) and the
    next step's inputs, where it is loaded for their CUDA device (:func:`loaded`), has the kernels, and the tensors fit
    (:func:`select_fits`); else None (the caller runs the torch ops)."""
    if not state.sequences.is_cuda:
        return None
    lib = loaded(state.sequences.device)
    if lib is None or not getattr(lib, "has_select", False) or not select_fits(state, parents, input_ids, positions):
        return None
    return lib


def select_fits(state, parents: torch.Tensor, input_ids: torch.Tensor, positions: tuple) -> bool:
    """Whether the token choice kernels read and write these tensors as they are: the state's dtypes and shapes (R
    rows, 1 <= R <= 1024), ``parents`` [R] and ``input_ids`` [R, 1] int64, at most two position tensors of int64,
    every tensor contiguous on the state's device."""
    rows, width = state.sequences.shape
    if not 1 <= rows <= SELECT_MAX_ROWS or len(positions) > 2:
        return False
    i64, f32, b = torch.int64, torch.float32, torch.bool
    want = [(state.sequences, i64, (rows, width)), (state.cur_len, i64, ()), (state.done, b, ()),
            (state.invalid, b, ()), (state.max_len, i64, ()), (state.prompt_len, i64, ()),
            (state.eos_ids, i64, (state.eos_ids.numel(),)), (parents, i64, (rows,)), (input_ids, i64, (rows, 1))]
    want += [(p, i64, tuple(p.shape)) for p in positions]
    if state.config.is_beam:
        batch, beams = state.beam_scores.shape
        if batch * beams != rows:
            return False
        want += [(state.beam_scores, f32, (batch, beams)), (state.finished_sequences, i64, (batch, beams, width)),
                 (state.finished_scores, f32, (batch, beams)), (state.finished_lengths, i64, (batch, beams)),
                 (state.is_finished, b, (batch, beams)), (state.improvement_possible, b, (batch, 1)),
                 (state.length_divisors, f32, (state.length_divisors.numel(),))]
        if state.length_divisors.numel() < 1:
            return False
    else:
        want.append((state.unfinished, b, (rows,)))
    device = state.sequences.device
    return all(t is not None and t.dtype == dtype and tuple(t.shape) == shape and t.device == device
               and t.is_contiguous() for t, dtype, shape in want)


# the top-k kernel's limits (csrc/select.cu): torch's small bitonic sort (k <= 32), at most 128 chunks a row
TOPK_MAX_K, TOPK_CHUNKS, TOPK_CHUNK_MIN = 32, 128, 4096


def topk(lib, x: torch.Tensor, k: int):
    """``torch.topk(x, k)`` (values, indices) of ``x`` [rows, n] on ``lib``'s kernel, in torch's order on CUDA, ties
    included (``csrc/select.cu``), or None where it does not take them (not float32, contiguous and 2-D; k > 32 or
    past n; n >= 2^31; more than 65535 rows): the caller runs torch.topk. Two launches: the chunks' best (at most
    128 CTAs a row, at least 4096 entries each), then the row's."""
    if (not getattr(lib, "has_topk", False) or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous()
            or not 1 <= k <= min(TOPK_MAX_K, x.shape[1]) or x.shape[1] >= 2 ** 31 or not 1 <= x.shape[0] <= 65535):
        return None
    rows, n = x.shape
    chunks = max(1, min(TOPK_CHUNKS, n // TOPK_CHUNK_MIN))
    values = torch.empty((rows, k), dtype=torch.float32, device=x.device)
    indices = torch.empty((rows, k), dtype=torch.int64, device=x.device)
    best = torch.empty((rows, chunks, k), dtype=torch.int64, device=x.device)
    lib.topk(x, k, values, indices, best, torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0)
    return values, indices


def _elementwise_library(x: torch.Tensor) -> _Lib | None:
    """The library loaded for ``x``'s CUDA device where it has the elementwise kernels."""
    if not x.is_cuda:
        return None
    lib = loaded(x.device)
    return lib if lib is not None and lib.has_elementwise else None


def availability() -> tuple[bool, str]:
    """Whether the CUDA kernels can run here, and why (for ``python -m hf_cascade env``). Builds nothing."""
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
