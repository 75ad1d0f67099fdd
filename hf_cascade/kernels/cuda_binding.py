"""The C ABI of the kernel library (``csrc/include/hfc/api.h``) through ctypes: the parameter structs, one method per
entry point, and the check at load that the structs here are the C structs.

``csrc/include/hfc/params.h`` is the only definition of the kernels' arguments; ``_PrefixParams``, ``_SuffixParams``,
``_MergeParams`` and ``_PrefixInfo`` mirror it for ctypes, and :class:`_Lib` compares them at load with the table
the library exports (``hfc_params_layout``: each struct's size and each field's offset and size, from ``sizeof`` and
``offsetof``), so a struct changed on one side only raises an error naming the struct and the field instead of
launching with shifted arguments. ``hfc_abi_version`` guards the entry points' signatures.

Mutable state: ``debug_sync`` (below), read by every launch's error check; each loaded library's ``_info`` (the
prefix kernels set up so far).
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from .capture import capture_underway, refuse_in_capture

DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1}   # HFC_BF16, HFC_FP16 in csrc/include/hfc/params.h
# the pool's element besides q's dtype (HFC_KV_SAME = 0): HFC_KV_FP8_E4M3, with its scales (kv_scale)
KV_DTYPE_CODES = {torch.float8_e4m3fn: 1}

__all__ = ["ABI_VERSION", "LayoutMismatch", "check_layout", "debug_sync", "PARAMS_STRUCTS"]

ABI_VERSION = 9                                       # HFC_ABI_VERSION in csrc/include/hfc/api.h

# Set True (tests do, or $HF_CASCADE_CUDA_DEBUG) to synchronise and check for errors after every launch outside a CUDA
# graph capture; never in production. A plain flag: read per launch, written only by tests and debugging sessions.
debug_sync = bool(os.environ.get("HF_CASCADE_CUDA_DEBUG"))

_vp, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _PrefixParams(ctypes.Structure):     # hfc_prefix_params
    _fields_ = [(n, _vp) for n in ("q", "pool", "group_rows", "prefix_table", "prefix_len", "part_o", "part_lse")] + \
               [(n, _i64) for n in ("R", "Lq", "Hq", "Hkv", "block_size", "G", "Rg", "Mp", "chunk_tokens",
                                    "max_chunks", "row_tiles")] + \
               [("scale_log2", _f32), ("dtype", _i32), ("head_dim", _i32), ("m_tile", _i32),
                ("q_limit", _vp), ("softcap", _f32), ("window", _i32), ("tune", _i32), ("kv_dtype", _i32),
                ("kv_scale", _vp)]


class _PrefixInfo(ctypes.Structure):       # hfc_prefix_info
    _fields_ = [("ctas_per_sm", _i32), ("smem_bytes", _i32), ("tile_tokens", _i32)]


class _SuffixParams(ctypes.Structure):     # hfc_suffix_params
    _fields_ = [(n, _vp) for n in ("q", "pool", "suffix_table", "q_limit", "part_o", "part_lse")] + \
               [(n, _i64) for n in ("R", "Lq", "Hq", "Hkv", "block_size", "Ms", "split_tokens", "nsplit", "slot0")] + \
               [("scale_log2", _f32), ("dtype", _i32), ("head_dim", _i32), ("softcap", _f32), ("window", _i32),
                ("kv_dtype", _i32), ("kv_scale", _vp),
                # the C side's fused merge (fuse_merge 1); never set from Python since it was deleted as slower
                # (kept in the struct: the library's ABI)
                ("fuse_merge", _i32), ("row_nchunks", _vp), ("out", _vp), ("row_nmid", _vp), ("mid_slot0", _i64),
                ("sinks", _vp)]


class _MergeParams(ctypes.Structure):      # hfc_merge_params
    _fields_ = [(n, _vp) for n in ("part_o", "part_lse", "row_nchunks", "out")] + \
               [(n, _i64) for n in ("R", "Lq", "Hq", "slot0", "nsplit")] + \
               [("dtype", _i32), ("head_dim", _i32), ("row_nmid", _vp), ("mid_slot0", _i64), ("sinks", _vp)]


class _SoloParams(ctypes.Structure):       # hfc_solo_params
    _fields_ = [(n, _vp) for n in ("q", "pool", "row_group", "prefix_table", "prefix_len", "suffix_table", "q_limit",
                                   "part_o", "part_lse", "counters", "out")] + \
               [(n, _i64) for n in ("R", "Lq", "Hq", "Hkv", "block_size", "G", "Mp", "Ms", "split_tokens", "nsplit")] + \
               [("scale_log2", _f32), ("dtype", _i32), ("head_dim", _i32)]


# C struct name -> its ctypes mirror: every struct that crosses the ABI
PARAMS_STRUCTS = {"hfc_prefix_params": _PrefixParams, "hfc_prefix_info": _PrefixInfo,
                  "hfc_suffix_params": _SuffixParams, "hfc_merge_params": _MergeParams}
# the structs of entries added without an ABI bump: checked where the library has them
OPTIONAL_STRUCTS = {"hfc_solo_params": _SoloParams}


class _LayoutEntry(ctypes.Structure):      # hfc_layout_entry (csrc/include/hfc/layout.h)
    _fields_ = [("struct_name", ctypes.c_char_p), ("field", ctypes.c_char_p), ("offset", _i64), ("size", _i64)]


class LayoutMismatch(RuntimeError):
    """A ctypes struct here differs from the library's C struct (size, a field's offset or size, a field missing)."""


def check_layout(table, structs=None) -> None:
    """Compare ``structs`` (C name -> ctypes.Structure; default :data:`PARAMS_STRUCTS`) with the library's layout
    ``table``: (struct name, field name or None for the struct itself, offset, size) rows. Raises
    :class:`LayoutMismatch` naming the struct and the field at the first difference."""
    structs = PARAMS_STRUCTS if structs is None else structs
    c_side: dict[str, dict] = {}
    for struct, field, offset, size in table:
        c_side.setdefault(struct, {})[field] = (offset, size)
    for name, mirror in structs.items():
        fields = c_side.get(name)
        if fields is None:
            raise LayoutMismatch(f"the kernel library does not describe struct {name} (a library of another "
                                 "hf_cascade version?)")
        py_fields = {field: (getattr(mirror, field).offset, getattr(mirror, field).size)
                     for field, _ in mirror._fields_}
        for field, (offset, size) in fields.items():
            if field is None:
                continue
            if field not in py_fields:
                raise LayoutMismatch(f"{name}.{field} (offset {offset}, {size} bytes) exists in the library's C struct "
                                     f"but not in its ctypes mirror {mirror.__name__}")
            if py_fields[field] != (offset, size):
                got_offset, got_size = py_fields[field]
                raise LayoutMismatch(f"{name}.{field}: offset {offset}, {size} bytes in the library's C struct, offset "
                                     f"{got_offset}, {got_size} bytes in its ctypes mirror {mirror.__name__}")
        for field in py_fields:
            if field not in fields:
                raise LayoutMismatch(f"{name}.{field} is in the ctypes mirror {mirror.__name__} but not in the "
                                     "library's C struct")
        want = fields.get(None, (0, None))[1]
        if want != ctypes.sizeof(mirror):
            raise LayoutMismatch(f"sizeof({name}) is {want} in the library, {ctypes.sizeof(mirror)} in its ctypes "
                                 f"mirror {mirror.__name__}")


def read_layout(lib: ctypes.CDLL) -> list[tuple[str, str | None, int, int]]:
    """The layout table the library exports (hfc_params_layout)."""
    fn = lib.hfc_params_layout
    fn.restype = ctypes.POINTER(_LayoutEntry)
    fn.argtypes = [ctypes.POINTER(_i32)]
    count = _i32(0)
    rows = fn(ctypes.byref(count))
    return [(rows[i].struct_name.decode(), None if rows[i].field is None else rows[i].field.decode(),
             int(rows[i].offset), int(rows[i].size)) for i in range(count.value)]


def _kv_code(pool, kv_scale) -> tuple[int, int | None]:
    """(kv_dtype code, kv_scale pointer) of a pool: (0, None) for a pool in q's dtype."""
    code = KV_DTYPE_CODES.get(pool.dtype, 0)
    if code and kv_scale is None:
        raise ValueError(f"hf_cascade CUDA kernels: a {pool.dtype} pool needs its kv_scale")
    return code, (None if not code else kv_scale.data_ptr())


def _no_dtype(dtype) -> None:
    raise TypeError(f"hf_cascade CUDA kernels: dtype {dtype} has no instantiation (compiled: "
                    f"{', '.join(map(str, DTYPE_CODES))})")


def declare_select(lib) -> bool:
    """Declare the token choice's entry points (``csrc/select.cu``, with its top-k, hfc_topk) on ``lib``; False where
    the library has none."""
    if not all(hasattr(lib, name) for name in ("hfc_sample_finish", "hfc_beam_scores", "hfc_beam_finish")):
        return False
    if hasattr(lib, "hfc_topk"):
        lib.hfc_topk.restype = ctypes.c_int
        lib.hfc_topk.argtypes = [_vp, _i64, _i64, _i64, _vp, _i64, _vp, _vp, ctypes.c_size_t]
    for fn, argtypes in ((lib.hfc_sample_finish, [_vp] * 13 + [_i64] * 7),
                         (lib.hfc_beam_scores, [_vp] * 21 + [_i64] * 6 + [_i32]),
                         (lib.hfc_beam_finish, [_vp] * 25 + [_i64] * 8 + [_i32] * 2)):
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes + [ctypes.c_size_t]
    return True


def _next_inputs(parents, input_ids, positions) -> list:
    """SelectNext's fields (csrc/include/hfc/launch.h): the next step's parents, ids and up to two position tensors."""
    positions = list(positions) + [None] * (2 - len(positions))
    return [parents.data_ptr(), input_ids.data_ptr(), *(None if p is None else p.data_ptr() for p in positions),
            *(0 if p is None else p.numel() for p in positions)]


class _Lib:
    """The loaded shared library: one method per C entry point, raw pointers and sizes in, errors raised."""

    prefix_kernel = "v2"      # the only portable prefix kernel since v1 was retired (python -m hf_cascade env)

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        lib.hfc_abi_version.restype = _i32
        lib.hfc_abi_version.argtypes = []
        got = lib.hfc_abi_version()
        if got != ABI_VERSION:
            raise RuntimeError(f"{path} has ABI version {got}, this hf_cascade needs {ABI_VERSION}")
        try:
            table = read_layout(lib)
            check_layout(table)
            described = {row[0] for row in table}
            check_layout(table, {name: mirror for name, mirror in OPTIONAL_STRUCTS.items() if name in described})
        except LayoutMismatch as err:
            raise LayoutMismatch(f"{path}: {err}") from None
        lib.hfc_error_string.restype = ctypes.c_char_p
        lib.hfc_error_string.argtypes = [ctypes.c_int]
        lib.hfc_last_error.restype = ctypes.c_char_p
        lib.hfc_last_error.argtypes = []
        lib.hfc_sync.restype = ctypes.c_int
        lib.hfc_sync.argtypes = []
        lib.hfc_prefix_setup.restype = ctypes.c_int
        lib.hfc_prefix_setup.argtypes = [_i32, _i32, _i32, _i32, ctypes.POINTER(_PrefixInfo)]
        lib.hfc_write.restype = ctypes.c_int
        lib.hfc_write.argtypes = [_vp, _vp, _vp, _vp, _vp, _i64, _vp, _vp, _i64, _i64, _i64, ctypes.c_size_t]
        # (added without an ABI bump: a library built before them has none, and the norms and rotary stay torch's)
        self.has_elementwise = hasattr(lib, "hfc_rms_norm") and hasattr(lib, "hfc_rotary")
        if self.has_elementwise:
            lib.hfc_rms_norm.restype = ctypes.c_int
            lib.hfc_rms_norm.argtypes = [_vp, _vp, _vp, _i64, _i64, _i64, ctypes.c_float, _i32, ctypes.c_size_t]
            strides = ctypes.POINTER(_i64)
            lib.hfc_rotary.restype = ctypes.c_int
            lib.hfc_rotary.argtypes = [_vp] * 6 + [_i64] * 5 + [strides] * 3 + [_i32, ctypes.c_size_t]
        # (likewise: a library without it leaves a decoder layer's residual add to torch, before the norm kernel)
        self.has_add_norm = hasattr(lib, "hfc_add_rms_norm")
        if self.has_add_norm:
            lib.hfc_add_rms_norm.restype = ctypes.c_int
            lib.hfc_add_rms_norm.argtypes = [_vp] * 5 + [_i64] * 4 + [ctypes.c_float, _i32, ctypes.c_size_t]
        # (likewise: a library without it leaves the MLP's activation to torch's two kernels)
        self.has_silu_mul = hasattr(lib, "hfc_silu_mul")
        if self.has_silu_mul:
            lib.hfc_silu_mul.restype = ctypes.c_int
            lib.hfc_silu_mul.argtypes = [_vp] * 3 + [_i64] * 4 + [_i32, ctypes.c_size_t]
        # (likewise: a library without it leaves the whole step's block bookkeeping to torch ops)
        self.has_blocks = hasattr(lib, "hfc_blocks_advance")
        if self.has_blocks:
            lib.hfc_blocks_advance.restype = ctypes.c_int
            lib.hfc_blocks_advance.argtypes = [_vp] * 23 + [_i64] * 7 + [ctypes.c_size_t]
        # (likewise: a library without it writes K/V made contiguous first, with hfc_write)
        self.has_strided_write = hasattr(lib, "hfc_write_strided")
        if self.has_strided_write:
            lib.hfc_write_strided.restype = ctypes.c_int
            lib.hfc_write_strided.argtypes = [_vp, _vp, _vp, _i64, _i64, _vp, _vp, _i64, _vp, _vp, _i64, _i64, _i64,
                                              ctypes.c_size_t]
        # (likewise: a library without it leaves an fp8 pool's encoding to torch ops before hfc_write)
        self.has_fp8_write = hasattr(lib, "hfc_write_fp8")
        if self.has_fp8_write:
            lib.hfc_write_fp8.restype = ctypes.c_int
            lib.hfc_write_fp8.argtypes = [_vp, _vp, _vp, _i64, _i64, _vp, _vp, _vp, _i64, _vp, _vp, _i64, _i64, _i64,
                                          _i64, ctypes.c_int32, ctypes.c_size_t]
        # (likewise: a library without it leaves a static step's copy-on-write copies to each layer's write)
        self.has_layer_copies = hasattr(lib, "hfc_copy_blocks_layers")
        if self.has_layer_copies:
            lib.hfc_copy_blocks_layers.restype = ctypes.c_int
            lib.hfc_copy_blocks_layers.argtypes = [_vp, _i64, _vp, _vp, _i64, _i64, ctypes.c_size_t]
        # (likewise: a library without them leaves the token choice's bookkeeping to torch ops)
        self.has_select = declare_select(lib)
        self.has_topk = self.has_select and hasattr(lib, "hfc_topk")
        # (likewise: a library without it runs rows that share no prefix on the prefix, suffix and merge kernels)
        self.has_solo = hasattr(lib, "hfc_solo") and "hfc_solo_params" in described
        if self.has_solo:
            lib.hfc_solo.restype = ctypes.c_int
            lib.hfc_solo.argtypes = [ctypes.POINTER(_SoloParams), ctypes.c_size_t]
        for name, params in (("hfc_prefix", _PrefixParams), ("hfc_suffix", _SuffixParams),
                             ("hfc_merge", _MergeParams)):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.POINTER(params), ctypes.c_size_t]
        self.lib = lib
        # (dtype, head_dim, m_tile, device, tune) -> prefix_info's figures; filled when a step state is built (two
        # threads meeting a new kernel both run its idempotent setup and store the same figures)
        self._info: dict = {}

    @property
    def debug(self) -> bool:
        """$HF_CASCADE_CUDA_DEBUG / tests: check every launch's arguments and synchronise after it."""
        return debug_sync

    def _message(self, rc: int) -> str:
        """CUDA's name of ``rc``, and what the library said about the failing call (a dispatch names the value)."""
        msg = self.lib.hfc_error_string(rc).decode(errors="replace")
        detail = (self.lib.hfc_last_error() or b"").decode(errors="replace")
        return f"{msg}: {detail}" if detail else msg

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"hf_cascade CUDA kernel {what} failed: {self._message(rc)} (cudaError {rc})")
        # never inside a CUDA graph capture: a device synchronisation there is refused
        # (cudaErrorStreamCaptureUnsupported), invalidates the capture, and was left as the thread's last CUDA error for
        # the next launch to report (how tests/kv/test_gpu_fp8.py's generate, debug_sync on, failed on the H200)
        if debug_sync and not capture_underway():
            rc = self.lib.hfc_sync()
            if rc != 0:
                raise RuntimeError(f"hf_cascade CUDA kernel {what} failed while running: {self._message(rc)} "
                                   f"(cudaError {rc})")

    def prefix_info(self, dtype_code: int, head_dim: int, m_tile: int, device_index: int | None = None,
                    tune: int = 0) -> tuple[int, int, int]:
        """(CTAs per SM, dynamic shared memory bytes, tokens per K/V tile) of one prefix kernel (``tune``: its kernel
        code, hf_cascade.kernels.cuda_tuning: a tuning variant's or HOPPER_KERNEL).

        The first call per kernel and device runs ``hfc_prefix_setup`` (the kernel's shared-memory attributes:
        not capture safe), which every prefix launch of that kernel needs first; later calls are a dict lookup.
        """
        found = self._variant(dtype_code, head_dim, m_tile, device_index, tune)
        if found[0] < 1:
            raise RuntimeError(f"the prefix kernel (code {tune}, dtype code {dtype_code}, head_dim {head_dim}, rows "
                               f"{m_tile}) cannot run on this GPU ({found[1]} bytes of shared memory)")
        return found

    def prefix_runs(self, dtype_code: int, head_dim: int, m_tile: int, tune: int) -> bool:
        """Whether the prefix kernel ``tune`` can run on the current device (the Hopper kernel needs the library's
        sm_90a code and a GPU that runs it). Its first call per kernel and device runs the setup, as prefix_info's."""
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
        """hfc_prefix_setup of one prefix kernel on device ``dev``."""
        # cudaFuncSetAttribute: a kernel first met inside a capture must have been set up by the warm-up
        refuse_in_capture(f"hfc_prefix_setup (cudaFuncSetAttribute) of the prefix kernel variant dtype code "
                          f"{dtype_code}, head_dim {head_dim}, m_tile {m_tile}, tune {tune}, device {dev}")
        info = _PrefixInfo()
        with torch.cuda.device(dev):
            self.check(self.lib.hfc_prefix_setup(dtype_code, head_dim, m_tile, tune, ctypes.byref(info)),
                       "prefix setup")
        return info

    # The launchers: one kernel's arguments (hf_cascade.kernels.ops.PrefixArgs / SuffixArgs / MergeArgs) packed into
    # its C struct, here only. Tensors are trusted (shapes, dtypes, devices, contiguity: hf_cascade.kernels.ops checks
    # them for the torch operators; the backend checks q and the pool, and the plan once per step).
    def prefix(self, a, stream: int) -> None:
        q, group_rows, prefix_table = a.q, a.group_rows, a.prefix_table
        R, Lq, Hq, D = q.shape
        items = R * Lq * Hq          # the kernel writes slots [0, max_chunks) from the pointers it is given
        o_ptr = a.part_o.data_ptr() + 4 * a.slot0 * items * D
        lse_ptr = a.part_lse.data_ptr() + 4 * a.slot0 * items
        G, Rg = group_rows.shape
        try:
            dtype_code = DTYPE_CODES[q.dtype]
        except KeyError:
            _no_dtype(q.dtype)
        m_tile, tune = a.m_tile, a.tune
        if (dtype_code, D, m_tile, q.device.index, tune) not in self._info:   # setup once, before the first launch
            self.prefix_info(dtype_code, D, m_tile, q.device.index, tune)
        pool = a.pool
        params = _PrefixParams(q.data_ptr(), pool.data_ptr(), group_rows.data_ptr(), prefix_table.data_ptr(),
                               a.prefix_len.data_ptr(), o_ptr, lse_ptr, R, Lq, Hq,
                               pool.shape[3], pool.shape[2], G, Rg, prefix_table.shape[1], a.chunk_tokens,
                               a.max_chunks, a.row_tiles, a.scale_log2, dtype_code, D, m_tile,
                               None if a.q_limit is None else a.q_limit.data_ptr(), a.softcap, a.window, tune,
                               *_kv_code(pool, a.kv_scale))
        self.check(self.lib.hfc_prefix(ctypes.byref(params), stream), "prefix")

    def suffix(self, a, stream: int) -> None:
        q, pool, suffix_table = a.q, a.pool, a.suffix_table
        R, Lq, Hq, D = q.shape
        try:
            dtype_code = DTYPE_CODES[q.dtype]
        except KeyError:
            _no_dtype(q.dtype)
        params = _SuffixParams(q.data_ptr(), pool.data_ptr(), suffix_table.data_ptr(), a.q_limit.data_ptr(),
                               a.part_o.data_ptr(), a.part_lse.data_ptr(), R, Lq, Hq, pool.shape[3], pool.shape[2],
                               suffix_table.shape[1], a.split_tokens, a.nsplit, a.slot0, a.scale_log2, dtype_code, D,
                               a.softcap, a.window, *_kv_code(pool, a.kv_scale))
        self.check(self.lib.hfc_suffix(ctypes.byref(params), stream), "suffix")

    def merge(self, a, stream: int) -> None:
        out, row_nmid, sinks = a.out, a.row_nmid, a.sinks
        R, Lq, Hq, D = out.shape
        try:
            dtype_code = DTYPE_CODES[out.dtype]
        except KeyError:
            _no_dtype(out.dtype)
        params = _MergeParams(a.part_o.data_ptr(), a.part_lse.data_ptr(), a.row_nchunks.data_ptr(), out.data_ptr(), R,
                              Lq, Hq, a.slot0, a.nsplit, dtype_code, D,
                              None if row_nmid is None else row_nmid.data_ptr(), a.mid_slot0,
                              None if sinks is None else sinks.data_ptr())
        self.check(self.lib.hfc_merge(ctypes.byref(params), stream), "merge")

    def solo(self, a, stream: int) -> None:
        q, pool, prefix_table, suffix_table = a.q, a.pool, a.prefix_table, a.suffix_table
        R, Lq, Hq, D = q.shape
        try:
            dtype_code = DTYPE_CODES[q.dtype]
        except KeyError:
            _no_dtype(q.dtype)
        params = _SoloParams(q.data_ptr(), pool.data_ptr(), a.row_group.data_ptr(), prefix_table.data_ptr(),
                             a.prefix_len.data_ptr(), suffix_table.data_ptr(), a.q_limit.data_ptr(),
                             a.part_o.data_ptr(), a.part_lse.data_ptr(), a.counters.data_ptr(), a.out.data_ptr(),
                             R, Lq, Hq, pool.shape[3], pool.shape[2], prefix_table.shape[0], prefix_table.shape[1],
                             suffix_table.shape[1], a.split_tokens, a.nsplit, a.scale_log2, dtype_code, D)
        self.check(self.lib.hfc_solo(ctypes.byref(params), stream), "solo")

    def rms_norm(self, out, x, weight, eps: float, stream: int) -> None:
        """RMSNorm of the rows of ``x`` ``[rows, hidden]`` (rows strided, elements contiguous) into ``out`` (contiguous,
        ``x``'s shape) with ``weight`` ``[hidden]`` (``csrc/elementwise.cu``); one dtype (bf16, fp16), one device."""
        rows, hidden = x.shape
        try:
            code = DTYPE_CODES[x.dtype]
        except KeyError:
            _no_dtype(x.dtype)
        self.check(self.lib.hfc_rms_norm(out.data_ptr(), x.data_ptr(), weight.data_ptr(), rows, hidden, x.stride(0),
                                         eps, code, stream), "rms_norm")

    def add_rms_norm(self, out, sum_out, x, residual, weight, eps: float, stream: int) -> None:
        """``sum_out = x + residual`` and ``out`` its RMSNorm with ``weight`` (``csrc/elementwise.cu``): ``x``,
        ``residual`` ``[rows, hidden]`` (rows strided, elements contiguous), ``out``, ``sum_out`` contiguous; one dtype
        (bf16, fp16), one device, 16-byte aligned rows (``cuda_library.add_norm_fits``)."""
        rows, hidden = x.shape
        try:
            code = DTYPE_CODES[x.dtype]
        except KeyError:
            _no_dtype(x.dtype)
        # (a single row's stride is whatever the view says: the kernel reads row 0 only)
        strides = [t.stride(0) if rows > 1 else hidden for t in (x, residual)]
        self.check(self.lib.hfc_add_rms_norm(out.data_ptr(), sum_out.data_ptr(), x.data_ptr(), residual.data_ptr(),
                                             weight.data_ptr(), rows, hidden, *strides, eps, code, stream),
                   "add_rms_norm")

    def rotary(self, q, k, cos, sin, q_out, k_out, stream: int) -> None:
        """The rotary embedding (``csrc/elementwise.cu``) of ``q`` ``[B, Hq, L, D]`` and ``k`` ``[B, Hk, L, D]``
        (strided, D contiguous) with ``cos``, ``sin`` ``[B or 1, L, D]`` into contiguous ``q_out``, ``k_out``."""
        batch, q_heads, tokens, dim = q.shape
        try:
            code = DTYPE_CODES[q.dtype]
        except KeyError:
            _no_dtype(q.dtype)
        arrays = [(_i64 * n)(*values) for n, values in (
            (3, q.stride()[:3]), (3, k.stride()[:3]),
            (2, (cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1))))]
        self.check(self.lib.hfc_rotary(q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(),
                                       k_out.data_ptr(), batch, tokens, q_heads, k.shape[1], dim, *arrays, code,
                                       stream), "rotary")

    def silu_mul(self, out, gate, up, stream: int) -> None:
        """``silu(gate) * up`` (``csrc/elementwise.cu``) of ``gate``, ``up`` ``[rows, width]`` (rows strided, elements
        contiguous) into contiguous ``out``; one dtype (bf16, fp16), one device."""
        rows, width = gate.shape
        try:
            code = DTYPE_CODES[gate.dtype]
        except KeyError:
            _no_dtype(gate.dtype)
        # (a single row's stride is whatever the view says: any value >= width serves)
        strides = [t.stride(0) if rows > 1 else width for t in (gate, up)]
        self.check(self.lib.hfc_silu_mul(out.data_ptr(), gate.data_ptr(), up.data_ptr(), rows, width, *strides, code,
                                         stream), "silu_mul")

    def blocks_advance(self, blocks, plan, parents, done, peak, stream: int) -> None:
        """One step's block bookkeeping (``csrc/blocks.cu``): ``blocks`` (a DeviceBlocks) and ``peak`` advanced in
        place, the step's plan written into ``plan`` (a DevicePlan); shapes and dtypes as
        ``cuda_library.blocks_fit`` checks them."""
        inner = blocks.inner_width > 0
        ptr = (lambda t: t.data_ptr() if t is not None and inner else None)
        R, W = blocks.tables.shape
        self.check(self.lib.hfc_blocks_advance(
            blocks.tables.data_ptr(), blocks.lengths.data_ptr(), blocks.refcount.data_ptr(), blocks.flags.data_ptr(),
            blocks.steps.data_ptr(), blocks.token_limit.data_ptr(), blocks.row_prefix_blocks.data_ptr(),
            blocks.row_inner_blocks.data_ptr(), blocks.check_rows.data_ptr(), blocks.check_cols.data_ptr(),
            blocks.check_ids.data_ptr(), blocks.check_used.data_ptr(), parents.data_ptr(), done.data_ptr(),
            peak.data_ptr(), plan.suffix_table.data_ptr(), plan.q_limit.data_ptr(), ptr(plan.inner_suffix_table),
            ptr(plan.inner_q_limit), plan.write_block.data_ptr(), plan.write_offset.data_ptr(),
            plan.copy_src.data_ptr(), plan.copy_dst.data_ptr(), R, W, blocks.pool_blocks, blocks.block_size,
            blocks.suffix_width, blocks.inner_width, blocks.check_rows.shape[0], stream), "blocks_advance")

    # The token choice's bookkeeping (csrc/select.cu); ``state`` a device_select.SelectionState, the other tensors and
    # their shapes as hf_cascade.kernels.cuda_library.select_fits checks them.
    def sample_finish(self, state, tokens, probs_total, parents, input_ids, positions, pad: int, fill: int,
                      stream: int) -> None:
        """After a greedy / sampling step's ``tokens`` [R] (and, sampling, its ``probs_total`` [] float32, else None):
        the state, and the next step's inputs, advanced."""
        rows, width = state.sequences.shape
        self.check(self.lib.hfc_sample_finish(
            tokens.data_ptr(), None if probs_total is None else probs_total.data_ptr(), state.unfinished.data_ptr(),
            state.done.data_ptr(), state.invalid.data_ptr(),
            state.sequences.data_ptr(), state.cur_len.data_ptr(), state.max_len.data_ptr(), state.eos_ids.data_ptr(),
            *_next_inputs(parents, input_ids, positions), rows, width, state.eos_ids.numel(), pad, fill, stream),
            "sample_finish")

    def beam_scores(self, state, top_log_probs, top_indices, probs_total, vocab: int, out, early_stopping_true: bool,
                    stream: int) -> None:
        """Before beam search's two top-k's: ``out`` (a dict of the step's scratch tensors: top_tokens, top_parents,
        hits, running [B, K], merged [B, nb + K], snapshot [2]; with next_indices and keep [B, nb], the top-k's too)
        from the candidates ``top_log_probs``, ``top_indices`` [B, K] (and, sampled beams, their draw's
        ``probs_total`` [] float32, else None)."""
        batch, candidates = top_indices.shape
        self.check(self.lib.hfc_beam_scores(
            top_log_probs.data_ptr(), top_indices.data_ptr(), state.cur_len.data_ptr(), state.max_len.data_ptr(),
            state.prompt_len.data_ptr(), state.done.data_ptr(), None if probs_total is None else probs_total.data_ptr(),
            state.invalid.data_ptr(), state.eos_ids.data_ptr(),
            state.is_finished.data_ptr(), state.improvement_possible.data_ptr(), state.finished_scores.data_ptr(),
            state.length_divisors.data_ptr(), *(out[name].data_ptr() for name in (
                "top_tokens", "top_parents", "hits", "running", "merged", "snapshot")),
            *(out[name].data_ptr() if name in out else None for name in ("next_indices", "keep")), batch,
            state.beam_scores.shape[1], candidates, vocab, state.eos_ids.numel(), state.length_divisors.numel(),
            int(early_stopping_true), stream), "beam_scores")

    def beam_finish(self, state, scratch, next_indices, keep, parents, input_ids, positions, fill: int,
                    early_stopping_true: bool, best_length_never: bool, stream: int) -> None:
        """After them: the state, and the next step's inputs, advanced (``scratch``: beam_scores' ``out``)."""
        batch, beams = next_indices.shape
        self.check(self.lib.hfc_beam_finish(
            next_indices.data_ptr(), keep.data_ptr(), *(scratch[name].data_ptr() for name in (
                "top_tokens", "top_parents", "hits", "running", "merged", "snapshot")),
            state.prompt_len.data_ptr(), state.max_len.data_ptr(), state.invalid.data_ptr(),
            state.length_divisors.data_ptr(), state.sequences.data_ptr(), state.finished_sequences.data_ptr(),
            state.beam_scores.data_ptr(), state.finished_scores.data_ptr(), state.finished_lengths.data_ptr(),
            state.is_finished.data_ptr(), state.improvement_possible.data_ptr(), state.cur_len.data_ptr(),
            state.done.data_ptr(), *_next_inputs(parents, input_ids, positions), batch, beams,
            scratch["top_tokens"].shape[1], state.sequences.shape[1], state.length_divisors.numel(), fill,
            int(early_stopping_true), int(best_length_never), stream), "beam_finish")

    def topk(self, x, k: int, values, indices, best, stream: int) -> None:
        """``torch.topk(x, k)`` of ``x`` [rows, n] float32 as torch orders it on CUDA (``csrc/select.cu``) into
        ``values`` [rows, k] float32 and ``indices`` [rows, k] int64; ``best`` [rows, chunks, k] int64 scratch."""
        rows, n = x.shape
        self.check(self.lib.hfc_topk(x.data_ptr(), rows, n, k, best.data_ptr(), best.shape[1], values.data_ptr(),
                                     indices.data_ptr(), stream), "topk")

    def write(self, pool, key, value, write_block, write_offset, copy_src, copy_dst, copies: bool, stream: int) -> None:
        """The cache write of one layer (``csrc/write.cu``): ``pool[copy_dst] = pool[copy_src]`` (when ``copies``),
        then ``key[i]``, ``value[i]`` ``[tokens, Hkv, D]`` into ``pool[write_block[i], 0|1, write_offset[i]]``; raw
        bytes (the pool's and K/V's element size must agree), int64 indices, everything contiguous on one device."""
        tokens, heads, dim = key.shape
        n_copies = copy_src.shape[0] if copies else 0
        self.check(self.lib.hfc_write(pool.data_ptr(), key.data_ptr(), value.data_ptr(), write_block.data_ptr(),
                                      write_offset.data_ptr(), tokens, copy_src.data_ptr(), copy_dst.data_ptr(),
                                      n_copies, pool.shape[2], heads * dim * key.element_size(), stream), "write")

    def write_strided(self, pool, key, value, write_block, write_offset, copy_src, copy_dst, copies: bool,
                      stream: int) -> None:
        """:meth:`write` with K and V read where they lie (``hfc_write_strided``): ``key``, ``value``
        ``[tokens, Hkv, D]`` with any token stride whose bytes are a multiple of 16, each token's ``Hkv x D``
        contiguous (``cuda_library.write_fits`` checks it), e.g. V as a column slice of a fused q|k|v product."""
        tokens, heads, dim = key.shape
        token_bytes = heads * dim * key.element_size()
        # (a single token's stride is whatever the view says: the kernel never steps past token 0)
        key_stride, value_stride = (t.stride(0) * t.element_size() if tokens > 1 else token_bytes
                                    for t in (key, value))
        n_copies = copy_src.shape[0] if copies else 0
        self.check(self.lib.hfc_write_strided(pool.data_ptr(), key.data_ptr(), value.data_ptr(), key_stride,
                                              value_stride, write_block.data_ptr(), write_offset.data_ptr(), tokens,
                                              copy_src.data_ptr(), copy_dst.data_ptr(), n_copies, pool.shape[2],
                                              token_bytes, stream), "write_strided")

    def write_fp8(self, pool, key, value, scale, write_block, write_offset, copy_src, copy_dst, copies: bool,
                  stream: int) -> None:
        """:meth:`write_strided` into a float8_e4m3fn ``pool`` from bf16 / fp16 ``key``, ``value`` ``[tokens, Hkv, D]``,
        encoded on the way (``hfc_write_fp8``): divided by ``scale`` ``[2, Hkv]`` float32 (K's, V's) and saturated,
        as ``BlockStorage.encode`` does (``cuda_library.write_slots_fp8`` checks the tensors)."""
        tokens, heads, dim = key.shape
        token_bytes = heads * dim * key.element_size()
        key_stride, value_stride = (t.stride(0) * t.element_size() if tokens > 1 else token_bytes
                                    for t in (key, value))
        n_copies = copy_src.shape[0] if copies else 0
        self.check(self.lib.hfc_write_fp8(pool.data_ptr(), key.data_ptr(), value.data_ptr(), key_stride, value_stride,
                                          scale.data_ptr(), write_block.data_ptr(), write_offset.data_ptr(), tokens,
                                          copy_src.data_ptr(), copy_dst.data_ptr(), n_copies, pool.shape[2], heads,
                                          dim, DTYPE_CODES[key.dtype], stream), "write_fp8")

    def copy_blocks_layers(self, pool_addresses, copy_src, copy_dst, block_bytes: int, stream: int) -> None:
        """A static step's copy-on-write copies ``pool[copy_dst[i]] = pool[copy_src[i]]`` in every layer's pool in one
        launch (``csrc/write.cu``): ``pool_addresses`` int64 ``[layers]``, each pool's base address (16-byte aligned,
        blocks of ``block_bytes`` bytes, a multiple of 16); ``copy_src``, ``copy_dst`` int64 ``[copies]``; all
        contiguous on the pools' device (``cuda_library.copy_blocks_layers`` checks them)."""
        self.check(self.lib.hfc_copy_blocks_layers(pool_addresses.data_ptr(), pool_addresses.shape[0],
                                                   copy_src.data_ptr(), copy_dst.data_ptr(), copy_src.shape[0],
                                                   block_bytes, stream), "copy_blocks_layers")
