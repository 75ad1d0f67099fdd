"""Where a layer's KV pool lives: a tensor ``[num_blocks, 2, block_size, kv_heads, head_dim]``.

Every storage has the same small interface: ``tensor``, ``num_blocks``, ``block_nbytes``, ``nbytes``
(bytes reserved: allocated or mapped), ``ensure(num_blocks) -> tensor`` and ``release()``.
:func:`make_storage` builds one per layer for a policy:

- ``grow``: amortised doubling with one copy (portable: CPU and any GPU);
- ``static``: a fixed number of blocks allocated once;
- ``vmm``: CUDA virtual memory (vAttention / dAttention): one virtual range is reserved for the
  largest pool, and physical memory is mapped into it as the pool grows. The pool never moves and
  never copies; its base address (``tensor.data_ptr()``) is fixed, only the tensor's shape grows.
- ``auto``: ``vmm`` where the device supports it and cuda-bindings imports, else ``grow``.

:func:`make_fixed_storage` builds the pool of K/V written once whose size is known up front (an encoder-decoder
call's cross-attention K/V): a zeroed :class:`FixedStorage`, paged, or as one K run and one V run on the CPU.

A pool of a quantized dtype (``CascadeConfig(kv_dtype="float8_e4m3fn")``) also owns its scales, ``scale`` float32
``[2, kv_heads]`` (K's per KV head, then V's), and :meth:`BlockStorage.encode` turns the K/V of a write into stored
values. The scales are static per layer and KV head: fixed by the first write after a reset (a generate call's
prefill) as ``amax x SCALE_MARGIN / 448`` over its tokens, then kept until the pool is released. Why this choice:
per-head scales are what keeps e4m3 accurate (heads differ in range by orders of magnitude, tokens of one head far
less); a scale fixed before the decode lets a captured graph and the kernels read one scalar per head (no per-block
scale to recompute when a block fills, nothing to requantize), and the margin costs only precision below 1/7000 of
the amax (e4m3 is floating point: a larger scale moves only the subnormal floor) while later tokens up to 4x the
prefill's amax still fit; anything beyond saturates at +-448 x scale (never inf or NaN).

Block ids index dim 0, so growth never renumbers blocks. A storage raises PoolExhausted (a MemoryError),
with the numbers, when asked for more blocks than its cap, MemoryError when the device has no room, and
is unchanged and usable afterwards. What a CUDA graph capture needs from these pools (no background mapping,
no range freed while it runs) is one object, :data:`capture_hold`.
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import threading
from collections import deque

import torch

from .blocks import PoolExhausted
from ..config import MEMORY_POLICIES
from ..logs import log_once
from ..kernels.base import KV_SCALED_DTYPES
from ..kernels.capture import capture_underway, refuse_in_capture

logger = logging.getLogger("hf_cascade")

# a quantized pool's scale per layer, K/V and KV head: the first write's amax x SCALE_MARGIN / the dtype's largest value
SCALE_MARGIN = 4.0
# CascadeConfig(keep_kv_bytes="auto"): the vmm pools of a cache keep what a call mapped, up to 1/KEEP_AUTO_FRACTION of
# the device's memory over all layers, for the next call
KEEP_AUTO_FRACTION = 16


class PoolAllocationError(torch.OutOfMemoryError):
    """The device could not allocate a KV pool; the message names the CascadeConfig setting to change (a
    ``torch.OutOfMemoryError``, so code that catches that still does)."""


class BlockStorage:
    """The bytes of one layer's paged KV pool (the shared part of every policy).

    Args:
        block_shape: ``(2, block_size, kv_heads, head_dim)``, the shape of one block (K and V).
        dtype, device: of the pool; those of the first K/V written to the layer.
        max_blocks: the cap; ``None`` for no cap.
    """

    in_torch_allocator = True   # False where torch.cuda.memory_reserved() does not see the bytes (vmm)

    def __init__(self, block_shape, dtype: torch.dtype, device, max_blocks: int | None = None):
        self.block_shape = tuple(int(s) for s in block_shape)
        self.dtype, self.device, self.max_blocks = dtype, torch.device(device), max_blocks
        self.block_nbytes = torch.empty((), dtype=dtype).element_size() * math.prod(self.block_shape)
        # a quantized pool's scales (one tensor for the pool's life: a captured graph reads it by address)
        self.scale = (torch.ones((2, self.block_shape[2]), dtype=torch.float32, device=self.device)
                      if dtype in KV_SCALED_DTYPES else None)
        self.scale_fixed = False        # set by the first encode after a release
        self.tensor = self._empty(0)

    @property
    def scale_nbytes(self) -> int:
        """Bytes of the scales (0 for a pool in the model's dtype)."""
        return 0 if self.scale is None else self.scale.numel() * self.scale.element_size()

    def encode(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored form of a write's ``key`` and ``value`` ``[tokens, kv_heads, head_dim]``: as they are for a pool
        in the model's dtype; for a quantized pool, divided by the scales (fixed here by the first write with tokens
        after a release) and saturated to the dtype's range. No host-device synchronisation."""
        if self.scale is None:
            return key, value
        top = torch.finfo(self.dtype).max
        if not self.scale_fixed and key.shape[0]:
            for kv, states in ((0, key), (1, value)):
                amax = states.detach().abs().amax(dim=(0, 2)).to(device=self.device, dtype=torch.float32)
                self.scale[kv].copy_(torch.where(amax > 0, amax * (SCALE_MARGIN / top), torch.ones_like(amax)))
            self.scale_fixed = True
        return tuple((states.to(device=self.device, dtype=torch.float32) / self.scale[kv][None, :, None])
                     .clamp_(-top, top).to(self.dtype) for kv, states in ((0, key), (1, value)))

    def _forget_scale(self) -> None:
        """The next write fixes the scales anew (the pool holds no K/V of the last call any more)."""
        self.scale_fixed = False

    def _empty(self, num_blocks: int) -> torch.Tensor:
        return self._allocate((num_blocks, *self.block_shape), num_blocks)

    def _allocate(self, shape, num_blocks: int) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` (``num_blocks`` blocks); PoolAllocationError says what to change."""
        try:
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        except RuntimeError as err:        # torch.OutOfMemoryError on CUDA, a plain RuntimeError from the CPU allocator
            if not isinstance(err, torch.OutOfMemoryError) and "alloc" not in str(err).lower():
                raise
            raise PoolAllocationError(self._allocation_advice(num_blocks, err)) from err

    def _allocation_advice(self, num_blocks: int, err: Exception) -> str:
        what = (f"the KV pool of one layer ({type(self).__name__}: {num_blocks} blocks of {self.block_shape[1]} tokens, "
                f"{num_blocks * self.block_nbytes} bytes) could not be allocated on {self.device}")
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"{what}: {first[:200]}. {self._allocation_fix()}."

    def _allocation_fix(self) -> str:
        """What to change when the pool cannot be allocated (the setting, per kind of storage)."""
        return (f"lower CascadeConfig.block_size (now {self.block_shape[1]} tokens per block; 16-256 are usual) or "
                "the beams, prompt length or batch; CascadeConfig.max_kv_bytes turns this into a PoolExhausted")

    @property
    def num_blocks(self) -> int:
        return self.tensor.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held: the blocks, and a quantized pool's scales while it holds blocks."""
        pool = self.num_blocks * self.block_nbytes
        return pool + (self.scale_nbytes if pool else 0)

    def _too_many(self, num_blocks: int, cap: int) -> PoolExhausted:
        return PoolExhausted(
            f"KV pool ({type(self).__name__}, one layer) needs {num_blocks} blocks = {num_blocks * self.block_nbytes} "
            f"bytes but holds at most {cap} blocks = {cap * self.block_nbytes} bytes; raise "
            "CascadeConfig.max_kv_bytes or lower beams, prompt length or new tokens.")

    def ensure(self, num_blocks: int) -> torch.Tensor:
        """Make block ids ``[0, num_blocks)`` addressable; returns the (possibly new) pool tensor."""
        raise NotImplementedError

    def stable_view(self) -> torch.Tensor:
        """The pool as a tensor whose address and shape stay while the pool grows, as far as this policy
        can promise (a captured CUDA graph bakes both in): ``vmm`` views its whole reserved range, ``static``
        is fixed anyway, ``grow`` moves when it grows (the graph runner re-captures then)."""
        return self.tensor

    def release(self) -> None:
        """Give the pool's memory back (what each policy can give)."""
        raise NotImplementedError

    def close(self) -> None:
        """Give everything back now, whatever the policy keeps on :meth:`release` (the storage is not used again)."""
        self.tensor = self._empty(0)
        self._forget_scale()


class GrowStorage(BlockStorage):
    """Amortised doubling: a bigger tensor and one copy when the pool runs out."""

    MIN_BLOCKS = 16

    def ensure(self, num_blocks: int) -> torch.Tensor:
        if num_blocks <= self.num_blocks:
            return self.tensor
        if self.max_blocks is not None and num_blocks > self.max_blocks:
            raise self._too_many(num_blocks, self.max_blocks)
        refuse_in_capture(f"KV pool growth (a new pool of {num_blocks} blocks and a copy; {self.num_blocks} held)")
        # a power of two (as doubling keeps it): a compiled decode step bakes the pool's shape in, and a pool whose
        # size followed the first prompt's length exactly would give each prompt length a compile of its own
        new_size = max(num_blocks, 2 * self.num_blocks, self.MIN_BLOCKS)
        new_size = 1 << (new_size - 1).bit_length()
        if self.max_blocks is not None:
            new_size = min(new_size, self.max_blocks)
        try:
            grown = self._empty(new_size)
        except torch.OutOfMemoryError:
            grown = self._empty(num_blocks)      # no room to double: take just what is asked
        grown[: self.num_blocks].copy_(self.tensor)   # the one copy growth costs; block ids stay valid
        self.tensor = grown
        return grown

    def release(self) -> None:
        self.tensor = self._empty(0)
        self._forget_scale()


class StaticStorage(BlockStorage):
    """``max_blocks`` blocks allocated once; never grows, keeps its allocation on release."""

    def __init__(self, block_shape, dtype, device, max_blocks: int | None = None):
        if max_blocks is None:
            raise ValueError('static storage needs max_blocks (CascadeConfig(memory="static", max_kv_bytes=...))')
        super().__init__(block_shape, dtype, device, max_blocks)
        self.tensor = self._empty(max_blocks)

    def ensure(self, num_blocks: int) -> torch.Tensor:
        if num_blocks > self.num_blocks:
            raise self._too_many(num_blocks, self.num_blocks)
        return self.tensor

    def release(self) -> None:
        self._forget_scale()

    def _allocation_fix(self) -> str:
        return ('memory="static" allocates CascadeConfig.max_kv_bytes up front (split over the layers): lower '
                'max_kv_bytes to what the device holds, or use memory="auto" to grow the pool as it fills')


class FixedStorage(StaticStorage):
    """``num_blocks`` zeroed blocks for K/V written once, up front (an encoder-decoder call's cross-attention
    K/V): never grows, released by dropping it. Zeroed, so the unused tail of an input's last block reads as 0,
    never as stale bytes.

    ``kv_runs=True`` lays the same bytes out as one K run then one V run, ``runs``
    ``[2, num_blocks * block_size, kv_heads, head_dim]``, where an input's tokens are one contiguous run that
    sdpa reads in place; ``tensor`` is then that memory seen in the paged layout (a permuted view, not
    contiguous). Otherwise ``tensor`` is the contiguous paged pool the GPU kernels take and ``runs`` is None.
    """

    def __init__(self, block_shape, dtype, device, num_blocks: int, kv_runs: bool = False):
        self.kv_runs = kv_runs
        super().__init__(block_shape, dtype, device, num_blocks)

    def _empty(self, num_blocks: int) -> torch.Tensor:
        if not self.kv_runs:
            self.runs = None
            return super()._empty(num_blocks).zero_()
        two, block_size, *head = self.block_shape
        self.runs = self._allocate((two, num_blocks * block_size, *head), num_blocks).zero_()
        return self.runs.view(two, num_blocks, block_size, *head).permute(1, 0, 2, 3, 4)

    def _allocation_fix(self) -> str:
        return ("these blocks hold the cross-attention K/V of an encoder-decoder call: lower the number or length "
                "of the inputs; CascadeConfig.max_kv_bytes turns this into a PoolExhausted")


# ---- CUDA virtual memory ----------------------------------------------------------------------------
class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; ``code`` is its CUresult."""

    def __init__(self, call: str, code):
        self.call, self.code = call, code
        try:
            err, text = _driver().cuGetErrorString(code)
            text = text.decode() if isinstance(text, bytes) else str(text)
        except Exception:  # noqa: BLE001  the message is best effort
            text = ""
        super().__init__(f"CUDA driver call {call} failed: {getattr(code, 'name', code)} {text}".rstrip())

    @property
    def out_of_memory(self) -> bool:
        return self.code == _driver().CUresult.CUDA_ERROR_OUT_OF_MEMORY


def _driver():
    from cuda.bindings import driver   # optional dependency: pip install cuda-bindings
    return driver


def _cu(call: str, *args):
    """``driver.<call>(*args)`` with its CUresult checked; returns the call's outputs (one value, a tuple or None)."""
    drv = _driver()
    out = getattr(drv, call)(*args)
    err, values = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CudaDriverError(call, err)
    return values[0] if len(values) == 1 else (values or None)


_vmm_reason: dict[int, str | None] = {}
_primary_ctx: dict[int, object] = {}
_mapped_bytes: dict[int, int] = {}        # device index -> bytes mapped by all VMM storages
# the counters here change from generate's threads and the mapping worker: read-modify-writes under this lock
_counts_lock = threading.Lock()


def _device_index(device) -> int:
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def vmm_unavailable_reason(device) -> str | None:
    """Why ``memory="vmm"`` cannot run on ``device`` (None when it can). Checked once per device."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"device {device} is not a CUDA device"
    if not torch.cuda.is_available():
        return "torch has no CUDA"
    index = _device_index(device)
    if index not in _vmm_reason:
        try:
            drv = _driver()
        except Exception as err:  # noqa: BLE001  ImportError, or a broken install
            reason = f"cuda-bindings does not import ({err}); pip install cuda-bindings"
        else:
            try:
                _cu("cuInit", 0)
                supported = _cu("cuDeviceGetAttribute",
                                drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                _cu("cuDeviceGet", index))
                reason = None if supported else f"CUDA device {index} does not support virtual memory management"
            except Exception as err:  # noqa: BLE001
                reason = f"the CUDA driver check failed: {err}"
        _vmm_reason[index] = reason
    return _vmm_reason[index]


def vmm_mapped_bytes(device=None) -> int:
    """Bytes that VMM storages hold mapped on ``device`` (all devices if None); torch's counters miss these. Ranges
    collected during a graph capture and set aside are freed first (outside a capture), so they do not count."""
    capture_hold.release_deferred()
    if device is None:
        return sum(_mapped_bytes.values())
    if not isinstance(device, int) and torch.device(device).type != "cuda":
        return 0
    return _mapped_bytes.get(_device_index(device), 0)


class _Context:
    """Makes the device's primary context (the one torch uses) current around driver calls."""

    def __init__(self, index: int):
        if index not in _primary_ctx:
            _cu("cuInit", 0)
            _primary_ctx[index] = _cu("cuDevicePrimaryCtxRetain", _cu("cuDeviceGet", index))
        self.ctx = _primary_ctx[index]

    def __enter__(self):
        _cu("cuCtxPushCurrent", self.ctx)

    def __exit__(self, *exc):
        _cu("cuCtxPopCurrent")


class _VirtualRange:
    """A reserved virtual address range whose first ``mapped`` bytes are backed by device memory.

    Physical memory comes in segments, one per growth, each a multiple of the allocation granularity
    (2 MiB on the H200); a segment is unmapped as a whole (the driver cannot unmap part of a mapping).
    Everything is unmapped and the range freed when this object is dropped. Holds no tensors, so the
    tensors over the range (which keep it alive) form no reference cycle with it.
    """

    def __init__(self, index: int, nbytes: int):
        drv = _driver()
        self.index, self.context = index, _Context(index)
        self.prop = drv.CUmemAllocationProp()
        self.prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = index
        self.access = drv.CUmemAccessDesc()
        self.access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.access.location.id = index
        self.access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.base, self.reserved, self.mapped, self.segments = 0, 0, 0, []   # segments: (offset, size)
        with self.context:
            self.granularity = int(_cu("cuMemGetAllocationGranularity", self.prop,
                                       drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
            self.reserved = self.round_up(max(nbytes, 1))
            self.base = int(_cu("cuMemAddressReserve", self.reserved, self.granularity, drv.CUdeviceptr(0), 0))

    def round_up(self, nbytes: int) -> int:
        return -(-nbytes // self.granularity) * self.granularity

    def grow(self, need: int, want: int) -> None:
        """Map at least ``need`` bytes from the base, ``want`` if memory allows (both capped by the reservation).

        Raises MemoryError with the numbers when not even ``need`` can be mapped; what this call mapped is
        unmapped again, and the range stays as it was.
        """
        need, want = self.round_up(need), min(self.round_up(max(want, need)), self.reserved)
        if need > self.reserved:
            raise MemoryError(f"KV pool asks {need} bytes mapped but its virtual range holds {self.reserved} bytes")
        for attempt, size in enumerate((want, need)):
            try:
                return self._map(size - self.mapped)
            except CudaDriverError as err:
                if not err.out_of_memory:
                    raise
                if attempt == 0:
                    torch.cuda.empty_cache()       # torch's cached free blocks are memory we may map
        free, total = torch.cuda.mem_get_info(self.index)
        raise MemoryError(
            f"CUDA out of memory mapping the KV pool: asked {need - self.mapped} more bytes ({need} in all), "
            f"{self.mapped} bytes mapped, at most {self.reserved} reserved; the device has {free} of {total} bytes "
            "free. Lower beams, prompt length or new tokens, or free GPU memory.")

    def _map(self, size: int) -> None:
        drv, offset = _driver(), self.mapped
        ptr = drv.CUdeviceptr(self.base + offset)
        handle, mapped = None, False
        with self.context:
            try:
                handle = _cu("cuMemCreate", size, self.prop, 0)
                _cu("cuMemMap", ptr, size, 0, handle, 0)
                mapped = True
                _cu("cuMemSetAccess", ptr, size, [self.access], 1)
            except BaseException:
                # undo this call's steps; a failure while undoing must not hide the first error
                undo = ([("cuMemUnmap", ptr, size)] if mapped else []) + \
                       ([("cuMemRelease", handle)] if handle is not None else [])
                for call, *args in undo:
                    try:
                        _cu(call, *args)
                    except CudaDriverError as err:
                        logger.warning("undoing a failed KV mapping: %s", str(err))
                raise
            _cu("cuMemRelease", handle)    # the mapping keeps the memory; unmapping frees it
        self.segments.append((offset, size))
        self.mapped += size
        with _counts_lock:
            _mapped_bytes[self.index] = _mapped_bytes.get(self.index, 0) + size

    def shrink(self, keep: int) -> None:
        """Unmap whole segments from the end while at least ``keep`` bytes stay mapped."""
        if not self.segments or self.segments[-1][0] < keep:
            return
        refuse_in_capture("unmapping KV memory (torch.cuda.synchronize, cuMemUnmap)")
        torch.cuda.synchronize(self.index)       # queued kernels may still read what is unmapped
        with self.context:
            while self.segments and self.segments[-1][0] >= keep:
                offset, size = self.segments[-1]
                _cu("cuMemUnmap", _driver().CUdeviceptr(self.base + offset), size)
                self.segments.pop()
                self.mapped -= size
                with _counts_lock:
                    _mapped_bytes[self.index] -= size

    def close(self) -> None:
        if self.base:
            self.shrink(0)
            with self.context:
                _cu("cuMemAddressFree", _driver().CUdeviceptr(self.base), self.reserved)
            self.base = 0

    def __del__(self):
        if sys.is_finalizing():
            return
        # Collected inside a graph capture (the cyclic GC runs at any allocation, and a dead CascadeCache's layers
        # form a cycle): close() synchronises the device and unmaps, which invalidates the capture, and an error
        # here is swallowed, so the capture would only fail later as "invalidated". Set aside instead (this
        # resurrects the range; __del__ does not run again) and closed when the capture is over.
        if capture_hold.defer(self):
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001  nothing to do about it while being collected
            pass


class CaptureHold:
    """What a CUDA graph capture needs from the pools' memory, as one object (the process has one,
    :data:`capture_hold`): while held (:meth:`held`, nestable, from the warm-up to the end of a capture), the
    background mappings in flight are waited for and no new one starts (a driver mapping call from the worker
    thread during a capture can invalidate it; steps map synchronously if they must); virtual ranges collected
    while held or while any capture runs are set aside (:meth:`defer`) and freed once neither is the case
    (:meth:`release_deferred`)."""

    def __init__(self):
        self._holds = 0                # held() blocks entered and not left
        self._deferred: deque = deque()   # ranges collected meanwhile (append/popleft: safe from __del__)

    @property
    def active(self) -> bool:
        """Whether no background mapping may start now."""
        return self._holds > 0

    @property
    def holds(self) -> int:
        return self._holds

    @property
    def deferred(self) -> int:
        """Ranges set aside, not yet freed."""
        return len(self._deferred)

    @contextlib.contextmanager
    def held(self):
        with _counts_lock:
            self._holds += 1
        try:
            if _executor is not None:
                _executor.submit(lambda: None).result()      # one worker, in order: every earlier mapping is done
            yield
        finally:
            with _counts_lock:
                self._holds -= 1
            self.release_deferred()          # what was collected meanwhile, now that no capture runs

    def defer(self, vrange: "_VirtualRange") -> bool:
        """Set ``vrange`` aside if it cannot be closed now (held, or a capture under way); whether it was."""
        if self._holds or capture_underway():
            self._deferred.append(vrange)
            return True
        return False

    def release_deferred(self) -> int:
        """Unmap and free the ranges set aside, unless still held or a capture is under way; how many were freed."""
        if not self._deferred or self._holds or capture_underway():
            return 0
        freed = 0
        while True:
            try:
                vrange = self._deferred.popleft()
            except IndexError:
                return freed
            try:
                vrange.close()
                freed += 1
            except Exception as err:  # noqa: BLE001  as when collected: the memory goes back with the process
                logger.warning("freeing a KV virtual range collected during a graph capture failed: %s",
                               str(err))


capture_hold = CaptureHold()


_executor = None


def _background():
    """One worker thread that maps KV memory ahead of need (driver calls are thread-safe)."""
    global _executor
    with _counts_lock:
        if _executor is None:
            from concurrent.futures import ThreadPoolExecutor
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_cascade_vmm")
        return _executor


class _Window:
    """What ``torch.as_tensor`` sees: ``nbytes`` bytes at the range's base; keeps the range alive."""

    def __init__(self, vrange: _VirtualRange, nbytes: int):
        self.vrange = vrange
        self.__cuda_array_interface__ = dict(shape=(nbytes,), typestr="|u1", data=(vrange.base, False),
                                             strides=None, version=2)


class VMMStorage(BlockStorage):
    """A pool that grows in place in CUDA virtual memory (vAttention / dAttention).

    One virtual range is reserved up front for ``max_blocks`` blocks (without a cap, for the device's
    total memory); ``ensure`` maps physical memory at its end. Mapping is a few driver calls (on the H200,
    vmm_probe.py: 0.09-0.14 ms for 2-128 MiB; the first GPU session read about 0.25 ms per MiB from whole
    prefills, benchmarks/RESULTS.md), so the pool maps ahead of need in a background thread, as dAttention
    does: when less than ``ahead`` bytes of headroom remain (1/64 of the pool, at least one granule), the
    next ``ahead`` bytes are mapped off the critical path; a step maps synchronously only when it outruns
    that (the first prefill, a burst). The tensor object is re-created with more blocks
    over the same base: no copy, and ``data_ptr()`` never changes. ``release``/``shrink_to`` unmap from the
    end (tensors taken before then must not read the unmapped blocks).

    Args:
        keep_bytes: what ``release()`` leaves mapped for the next use (0: everything goes back).
    """

    in_torch_allocator = False
    AHEAD_FRACTION = 64        # headroom kept mapped ahead: 1/64 of the pool, at least one granule

    def __init__(self, block_shape, dtype, device, max_blocks: int | None = None, keep_bytes: int = 0):
        capture_hold.release_deferred()
        index = _device_index(device)
        super().__init__(block_shape, dtype, torch.device("cuda", index), max_blocks)
        limit = (max_blocks * self.block_nbytes if max_blocks is not None
                 else torch.cuda.get_device_properties(index).total_memory)
        self.vrange = _VirtualRange(index, limit)
        fits = self.vrange.reserved // self.block_nbytes
        self.max_blocks = fits if max_blocks is None else min(max_blocks, fits)
        self.keep_bytes = int(keep_bytes)
        self._pending = None       # a background mapping in flight (a Future)
        # growths so far: mapped while a step waited, and mapped ahead in the background (for benchmarks)
        self.maps_on_step, self.maps_ahead = 0, 0

    @property
    def nbytes(self) -> int:
        return self.vrange.mapped + (self.scale_nbytes if self.vrange.mapped else 0)

    def _ahead(self, nbytes: int) -> int:
        return max(nbytes // self.AHEAD_FRACTION, self.granularity)

    def _settle(self, wait: bool) -> None:
        """Adopt a finished (or, with ``wait``, the in-flight) background mapping."""
        job = self._pending
        if job is None or not (wait or job.done()):
            return
        if capture_underway():      # adopted after the capture (a graph bakes the stable view, not this tensor)
            if wait:
                refuse_in_capture("waiting for a background KV mapping")
            return
        self._pending = None
        try:
            job.result()
        except (MemoryError, CudaDriverError) as err:   # the synchronous path will retry and report
            logger.info("background KV mapping failed: %s", str(err))   # (text: a record keeps no frames)
        self._refresh()

    @property
    def granularity(self) -> int:
        return self.vrange.granularity

    def _refresh(self) -> torch.Tensor:
        n = min(self.vrange.mapped // self.block_nbytes, self.max_blocks)
        if n == 0:
            self.tensor = self._empty(0)
        else:
            raw = torch.as_tensor(_Window(self.vrange, n * self.block_nbytes))
            if raw.device != self.device or raw.data_ptr() != self.vrange.base:
                raise RuntimeError(f"torch read the VMM range at {self.vrange.base:#x} as {raw.device} "
                                   f"{raw.data_ptr():#x}, expected {self.device}")
            self.tensor = raw.view(self.dtype).view(n, *self.block_shape)
        return self.tensor

    def ensure(self, num_blocks: int) -> torch.Tensor:
        if capture_hold.deferred:
            capture_hold.release_deferred()
        self._settle(wait=False)
        if num_blocks > self.num_blocks:
            if num_blocks > self.max_blocks:
                raise self._too_many(num_blocks, self.max_blocks)
            # cuMemCreate / cuMemMap / cuMemSetAccess (and adopting the worker's mapping): never inside a capture
            refuse_in_capture(f"KV pool growth (cuMemCreate/cuMemMap to {num_blocks} blocks; {self.num_blocks} mapped)")
            self._settle(wait=True)
            need = num_blocks * self.block_nbytes
            if need > self.vrange.mapped:                  # outran the headroom: map now
                self.vrange.grow(need, need + self._ahead(need))
                self.maps_on_step += 1
                self._refresh()
        need = num_blocks * self.block_nbytes
        headroom, ahead = self.vrange.mapped - need, self._ahead(self.vrange.mapped)
        if (self._pending is None and not capture_hold.active and headroom < ahead
                and self.vrange.mapped < self.vrange.reserved and not capture_underway()):
            target = self.vrange.mapped + ahead
            self._pending = _background().submit(self.vrange.grow, target, target)
            self.maps_ahead += 1
        return self.tensor

    def __reduce__(self):
        """A copy or a pickle is a plain ("grow") pool holding the same blocks: a virtual range cannot travel."""
        self._settle(wait=True)
        return _grow_storage_of, (self.block_shape, self.dtype, self.device, self.max_blocks, self.tensor,
                                  self.scale, self.scale_fixed)

    def stable_view(self) -> torch.Tensor:
        """The whole reserved range as ``[max_blocks, ...]`` (only mapped blocks are ever indexed)."""
        view = getattr(self, "_stable", None)
        if view is None:
            raw = torch.as_tensor(_Window(self.vrange, self.max_blocks * self.block_nbytes))
            view = self._stable = raw.view(self.dtype).view(self.max_blocks, *self.block_shape)
        return view

    def shrink_to(self, num_blocks: int) -> torch.Tensor:
        """Unmap what lies beyond ``num_blocks`` blocks (whole segments: a little more may stay mapped)."""
        capture_hold.release_deferred()
        self._settle(wait=True)
        self.vrange.shrink(num_blocks * self.block_nbytes)
        return self._refresh()

    def release(self, keep_bytes: int | None = None) -> None:
        """Unmap the pool, except about ``keep_bytes`` (default: the factory's ``keep_bytes``)."""
        self.shrink_to(-(-(self.keep_bytes if keep_bytes is None else keep_bytes) // self.block_nbytes))
        self._forget_scale()

    def close(self) -> None:
        """Unmap everything and free the virtual range now (also done when the storage is collected)."""
        self._settle(wait=True)
        self.tensor = self._empty(0)
        self._stable = None
        self.vrange.close()


def _grow_storage_of(block_shape, dtype, device, max_blocks, tensor, scale=None, scale_fixed=False) -> GrowStorage:
    """A GrowStorage over ``tensor`` (and a quantized pool's scales: how a copied or unpickled VMM pool comes back)."""
    storage = GrowStorage(block_shape, dtype, device, max_blocks)
    storage.tensor = tensor
    if scale is not None:
        storage.scale, storage.scale_fixed = scale, scale_fixed
    return storage


def keep_bytes_of(setting: int | str, device, layers: int) -> int:
    """What one of ``layers`` layers' pools keeps mapped on release for ``CascadeConfig.keep_kv_bytes``: its share of a
    byte count, or of ``"auto"``'s cap (1/KEEP_AUTO_FRACTION of a CUDA device's memory; 0 elsewhere, where no pool maps
    anything)."""
    if setting == "auto":
        device = torch.device(device)
        setting = (torch.cuda.get_device_properties(_device_index(device)).total_memory // KEEP_AUTO_FRACTION
                   if device.type == "cuda" else 0)
    return int(setting) // max(1, layers)


# ---- the factory --------------------------------------------------------------------------------------
def resolve_policy(policy: str, device) -> str:
    """``"auto"`` -> ``"vmm"`` where it can run on ``device``, else ``"grow"`` (the reason logged once)."""
    if policy not in MEMORY_POLICIES:
        raise ValueError(f"memory policy must be one of {MEMORY_POLICIES}, got {policy!r}")
    if policy != "auto":
        return policy
    reason = vmm_unavailable_reason(device)
    chosen = "grow" if reason else "vmm"
    log_once(("memory auto", str(torch.device(device)), chosen), logging.INFO, "memory='auto' on %s: %s", device,
             f"'grow' ({reason})" if reason else "'vmm' (CUDA virtual memory: the KV pool grows in place)")
    return chosen


def make_storage(block_shape, dtype: torch.dtype, device, policy: str = "auto", max_blocks: int | None = None,
                 keep_bytes: int = 0) -> BlockStorage:
    """The storage of one layer's pool for the configured policy (``CascadeConfig.memory``).

    ``max_blocks`` caps the pool (``static`` allocates exactly that many); ``keep_bytes`` is what a
    ``vmm`` pool keeps mapped after ``release()``.
    """
    policy = resolve_policy(policy, device)
    if policy == "vmm":
        reason = vmm_unavailable_reason(device)
        if reason:
            raise RuntimeError(f"CascadeConfig(memory='vmm') cannot run here: {reason}. Use memory='auto' or 'grow'.")
        return VMMStorage(block_shape, dtype, device, max_blocks, keep_bytes)
    if policy == "static":
        return StaticStorage(block_shape, dtype, device, max_blocks)
    return GrowStorage(block_shape, dtype, device, max_blocks)


def make_fixed_storage(block_shape, dtype: torch.dtype, device, num_blocks: int, kv_runs: bool = False
                       ) -> FixedStorage:
    """The storage of K/V written once, ``num_blocks`` blocks (see :class:`FixedStorage` for ``kv_runs``): fixed
    whatever ``CascadeConfig.memory`` says, since its size is known before it is filled (growing or mapping
    ahead would buy nothing)."""
    return FixedStorage(block_shape, dtype, device, num_blocks, kv_runs)
