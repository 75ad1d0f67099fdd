"""KV pool storage (hf_cascade.memory) on the CPU: grow, static, the factory, the config, and generate with a cap.

The VMM storage's bookkeeping (segments, lookahead, undo on a failed map, release/keep) runs here against a
fake CUDA driver; tests/kv/test_gpu_memory.py runs it against the real one.
"""
from __future__ import annotations

import enum
import gc
import logging
import types

import pytest
import torch

import hf_cascade.memory as memory
from conftest import model_pair, padded_batch, returned_cache
from hf_cascade import CascadeConfig, logs
from hf_cascade.memory import GrowStorage, PoolAllocationError, StaticStorage, make_fixed_storage, make_storage

SHAPE = (2, 4, 2, 8)          # K+V, block 4, 2 KV heads, head_dim 8
BLOCK_BYTES = 2 * 4 * 2 * 8 * 4   # float32


def _fill(pool: torch.Tensor, start: int, stop: int) -> None:
    for b in range(start, stop):
        pool[b] = b + 0.5


def _check(pool: torch.Tensor, stop: int) -> None:
    for b in range(stop):
        assert torch.all(pool[b] == b + 0.5), f"block {b} changed"


# ---- grow ------------------------------------------------------------------------------------------
def test_grow_keeps_data_and_block_ids_across_growth():
    s = make_storage(SHAPE, torch.float32, "cpu", "grow")
    assert isinstance(s, GrowStorage) and s.num_blocks == 0 and s.nbytes == 0 and s.block_nbytes == BLOCK_BYTES
    pool = s.ensure(3)
    assert pool.shape == (s.num_blocks, *SHAPE) and s.num_blocks >= 3
    _fill(pool, 0, 3)
    for need in (17, 40, 41, 200):
        pool = s.ensure(need)
        assert s.num_blocks >= need and s.nbytes == s.num_blocks * BLOCK_BYTES
        _check(pool, 3)
    assert s.ensure(5) is pool          # no growth: the same tensor


def test_grow_cap_error_names_numbers_and_leaves_storage_usable():
    s = make_storage(SHAPE, torch.float32, "cpu", "grow", max_blocks=20)
    _fill(s.ensure(20), 0, 20)
    assert s.num_blocks == 20           # doubling is clipped at the cap
    before = s.tensor
    with pytest.raises(MemoryError, match=rf"21 blocks = {21 * BLOCK_BYTES} bytes.*at most 20 blocks = "
                                          rf"{20 * BLOCK_BYTES} bytes"):
        s.ensure(21)
    assert s.tensor is before and s.num_blocks == 20
    _check(s.ensure(20), 20)


def test_grow_release_returns_memory():
    s = make_storage(SHAPE, torch.float32, "cpu", "grow")
    s.ensure(100)
    assert s.nbytes >= 100 * BLOCK_BYTES
    s.release()
    assert s.nbytes == 0 and s.num_blocks == 0
    _fill(s.ensure(2), 0, 2)            # usable again
    _check(s.tensor, 2)


# ---- static -----------------------------------------------------------------------------------------
def test_static_is_fixed_and_errors_beyond_its_size():
    s = make_storage(SHAPE, torch.float32, "cpu", "static", max_blocks=12)
    assert isinstance(s, StaticStorage) and s.num_blocks == 12 and s.nbytes == 12 * BLOCK_BYTES
    pool = s.ensure(12)
    _fill(pool, 0, 12)
    with pytest.raises(MemoryError, match=rf"13 blocks.*at most 12 blocks = {12 * BLOCK_BYTES} bytes"):
        s.ensure(13)
    assert s.ensure(5) is pool
    s.release()
    assert s.num_blocks == 12 and s.tensor is pool
    _check(pool, 12)
    with pytest.raises(ValueError, match="max_blocks"):
        make_storage(SHAPE, torch.float32, "cpu", "static")


# ---- fixed (an encoder-decoder call's cross-attention K/V) ------------------------------------------------
@pytest.mark.parametrize("kv_runs", [False, True])
def test_fixed_storage_is_zeroed_and_its_two_layouts_hold_the_same_bytes(kv_runs):
    """CPU: one K run then one V run, seen as the paged pool without a copy (sdpa reads a run in place);
    elsewhere the contiguous paged pool the GPU kernels take. Either way num_blocks zeroed blocks, counted alike."""
    s = make_fixed_storage(SHAPE, torch.float32, "cpu", 5, kv_runs=kv_runs)
    pool = s.tensor
    assert isinstance(s, StaticStorage) and pool.shape == (5, *SHAPE) and s.nbytes == 5 * BLOCK_BYTES
    assert not pool.any() and s.ensure(5) is pool
    with pytest.raises(MemoryError, match="at most 5 blocks"):
        s.ensure(6)
    if not kv_runs:
        assert s.runs is None and pool.is_contiguous()
        return
    _, block_size, *head = SHAPE
    assert s.runs.shape == (2, 5 * block_size, *head) and s.runs.is_contiguous() and s.runs.nbytes == s.nbytes
    pool[3, 1, 2] = 7.0                                      # V of block 3, slot 2 ...
    assert s.runs[1, 3 * block_size + 2].eq(7).all() and s.runs.count_nonzero() == head[0] * head[1]   # ... in place


@pytest.mark.parametrize("kv_runs", [False, True])
def test_fixed_storage_the_device_cannot_allocate_names_what_to_lower(kv_runs):
    huge = (2, 16, 2 ** 20, 2 ** 20)
    with pytest.raises(PoolAllocationError, match="cross-attention K/V of an encoder-decoder call: lower the number"):
        make_fixed_storage(huge, torch.float32, "cpu", 4, kv_runs=kv_runs)


# ---- factory and config -----------------------------------------------------------------------------
def test_auto_on_cpu_is_grow_and_logged_once(caplog):
    logs._logged.clear()
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        assert isinstance(make_storage(SHAPE, torch.float32, "cpu"), GrowStorage)
        assert isinstance(make_storage(SHAPE, torch.float32, "cpu", "auto"), GrowStorage)
    lines = [r.getMessage() for r in caplog.records if "memory='auto'" in r.getMessage()]
    assert len(lines) == 1 and "grow" in lines[0] and "not a CUDA device" in lines[0]
    assert CascadeConfig().memory == "auto"


def test_vmm_on_cpu_is_refused_with_the_reason():
    with pytest.raises(RuntimeError, match="memory='vmm'.*not a CUDA device"):
        make_storage(SHAPE, torch.float32, "cpu", "vmm")
    with pytest.raises(ValueError, match="memory policy"):
        make_storage(SHAPE, torch.float32, "cpu", "paged")


@pytest.mark.parametrize("kwargs,match", [
    (dict(memory="paged"), "memory must be one of"),
    (dict(memory="GROW"), "memory must be one of"),
    (dict(memory="static"), "needs max_kv_bytes"),
    (dict(max_kv_bytes=0), "max_kv_bytes"),
    (dict(max_kv_bytes=-5), "max_kv_bytes"),
    (dict(max_kv_bytes="1GB"), "max_kv_bytes"),
    (dict(max_kv_bytes=True), "max_kv_bytes"),
    (dict(keep_kv_bytes=-1), "keep_kv_bytes"),
    (dict(keep_kv_bytes=None), "keep_kv_bytes"),
    (dict(keep_kv_bytes="all"), 'keep_kv_bytes must be a number of bytes >= 0 or "auto"'),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CascadeConfig(**kwargs)


def test_config_accepts_every_policy():
    for policy in ("auto", "vmm", "grow"):
        assert CascadeConfig(memory=policy).memory == policy
    c = CascadeConfig(memory="static", max_kv_bytes=2e6, keep_kv_bytes=1 << 20)
    assert c.max_kv_bytes == 2_000_000 and isinstance(c.max_kv_bytes, int) and c.keep_kv_bytes == 1 << 20
    assert CascadeConfig(keep_kv_bytes="auto").keep_kv_bytes == "auto"


def test_keep_bytes_per_layer():
    """A byte count is shared out over the layers; "auto" is 1/KEEP_AUTO_FRACTION of a CUDA device's memory, and
    nothing on the CPU (whose pools map nothing)."""
    assert memory.keep_bytes_of(1000, "cpu", 3) == 333 and memory.keep_bytes_of(0, "cpu", 4) == 0
    assert memory.keep_bytes_of("auto", "cpu", 4) == 0


# ---- generate with a capped pool ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    return model_pair("llama")


def test_static_generate_matches_stock_and_too_small_cap_raises(llama):
    stock, cascade = llama
    ids, mask = padded_batch(seed=3)
    kw = dict(input_ids=ids, attention_mask=mask, num_beams=4, num_return_sequences=2, max_new_tokens=12,
              pad_token_id=0)
    expected = stock.generate(**kw)

    out = cascade.generate(**kw, return_dict_in_generate=True, hf_cascade_config=CascadeConfig(memory="grow"))
    assert torch.equal(out.sequences, expected)
    peak = returned_cache(out).stats().peak_kv_bytes_in_use    # the tightest cap this call fits in
    returned_cache(out).reset()

    got = cascade.generate(**kw, return_dict_in_generate=True,
                           hf_cascade_config=CascadeConfig(memory="static", max_kv_bytes=peak))
    assert torch.equal(got.sequences, expected)
    stats = returned_cache(got).stats()
    assert stats.kv_bytes_reserved == peak == stats.peak_kv_bytes_in_use    # static: all of it, from the start
    returned_cache(got).reset()

    with pytest.raises(MemoryError, match="block"):
        cascade.generate(**kw, hf_cascade_config=CascadeConfig(memory="static", max_kv_bytes=peak // 2))
    assert torch.equal(cascade.generate(**kw), expected)     # the model is fine afterwards (default policy)


# ---- VMM bookkeeping against a fake driver -----------------------------------------------------------
GRANULE = 2 << 20


class _Result(enum.Enum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_OUT_OF_MEMORY = 2


class FakeDriver:
    """Just enough of cuda.bindings.driver: physical memory ``phys``, handles refcounted by their mappings."""

    CUresult = _Result

    def __init__(self, phys: int):
        ns = types.SimpleNamespace
        self.phys, self.used, self.maps, self.handles, self.ranges = phys, 0, {}, {}, {}
        self.fail_set_access, self.pushed = False, 0
        self.CUmemAllocationType = ns(CU_MEM_ALLOCATION_TYPE_PINNED=1)
        self.CUmemLocationType = ns(CU_MEM_LOCATION_TYPE_DEVICE=1)
        self.CUmemAccess_flags = ns(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
        self.CUmemAllocationGranularity_flags = ns(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)
        self.CUmemAllocationProp = self.CUmemAccessDesc = lambda: ns(location=ns())
        self.CUdeviceptr = int

    ok = (_Result.CUDA_SUCCESS,)

    def cuInit(self, flags): return self.ok
    def cuDeviceGet(self, i): return (*self.ok, i)
    def cuDevicePrimaryCtxRetain(self, dev): return (*self.ok, "ctx")
    def cuCtxPushCurrent(self, ctx): self.pushed += 1; return self.ok
    def cuCtxPopCurrent(self): self.pushed -= 1; return (*self.ok, "ctx")
    def cuGetErrorString(self, err): return (*self.ok, b"fake")
    def cuMemGetAllocationGranularity(self, prop, flags): return (*self.ok, GRANULE)

    def cuMemAddressReserve(self, size, align, addr, flags):
        assert size % GRANULE == 0
        base = (1 << 40) + (len(self.ranges) << 36)
        self.ranges[base] = size
        return (*self.ok, base)

    def cuMemAddressFree(self, ptr, size):
        assert self.ranges.pop(ptr) == size and not any(ptr <= p < ptr + size for p in self.maps)
        return self.ok

    def cuMemCreate(self, size, prop, flags):
        assert self.pushed and size > 0 and size % GRANULE == 0
        if self.used + size > self.phys:
            return (_Result.CUDA_ERROR_OUT_OF_MEMORY, None)
        handle = len(self.handles) + 1
        self.handles[handle] = [size, 1]
        self.used += size
        return (*self.ok, handle)

    def cuMemMap(self, ptr, size, offset, handle, flags):
        assert self.pushed and any(b <= ptr and ptr + size <= b + n for b, n in self.ranges.items())
        self.maps[ptr] = (size, handle)
        self.handles[handle][1] += 1
        return self.ok

    def cuMemSetAccess(self, ptr, size, desc, count):
        return (_Result.CUDA_ERROR_OUT_OF_MEMORY,) if self.fail_set_access else self.ok

    def _drop(self, handle):
        self.handles[handle][1] -= 1
        if self.handles[handle][1] == 0:
            self.used -= self.handles[handle][0]

    def cuMemUnmap(self, ptr, size):
        mapped_size, handle = self.maps.pop(ptr)
        assert mapped_size == size, "the driver unmaps whole mappings only"
        self._drop(handle)
        return self.ok

    def cuMemRelease(self, handle):
        self._drop(handle)
        return self.ok


@pytest.fixture
def fake(monkeypatch):
    """A fake driver with 64 MiB; pool tensors become CPU byte buffers at a fixed 'base' per range."""
    drv = FakeDriver(64 << 20)
    monkeypatch.setattr(memory, "_driver", lambda: drv)
    monkeypatch.setattr(memory, "_primary_ctx", {})
    monkeypatch.setattr(memory, "_mapped_bytes", {})
    for name, fn in dict(synchronize=lambda *a: None, empty_cache=lambda: None, current_device=lambda: 0,
                         mem_get_info=lambda *a: (drv.phys - drv.used, drv.phys),
                         get_device_properties=lambda i: types.SimpleNamespace(total_memory=drv.phys)).items():
        monkeypatch.setattr(torch.cuda, name, fn)
    buffers = {}

    def view(self):          # stands in for torch.as_tensor(__cuda_array_interface__) over the same bytes
        n = min(self.vrange.mapped // self.block_nbytes, self.max_blocks)
        buf = buffers.setdefault(self.vrange.base, torch.zeros(self.vrange.reserved, dtype=torch.uint8))
        self.tensor = buf[: n * self.block_nbytes].view(self.dtype).view(n, *self.block_shape)
        return self.tensor

    monkeypatch.setattr(memory.VMMStorage, "_refresh", view)
    monkeypatch.setattr(memory.BlockStorage, "_empty",
                        lambda self, n: torch.empty((n, *self.block_shape), dtype=self.dtype))
    return drv


VMM_SHAPE = (2, 16, 8, 64)     # bf16: 32 KiB per block, 64 blocks per granule


def test_vmm_maps_ahead_in_granules_and_releases(fake):
    s = memory.VMMStorage(VMM_SHAPE, torch.bfloat16, "cuda:0")
    assert s.block_nbytes == 32 << 10 and s.max_blocks == (64 << 20) // (32 << 10)   # uncapped: device memory
    pool = s.ensure(10)
    assert s.nbytes == 2 * GRANULE and s.num_blocks == 128     # need + one granule ahead, in whole granules
    pool[3] = 7
    assert s.ensure(128) is pool                               # full: the next granule maps in the background
    s._settle(wait=True)
    assert s.nbytes == 3 * GRANULE and len(s.vrange.segments) == 2 and s.num_blocks == 192
    assert s.tensor.data_ptr() == pool.data_ptr() and torch.all(s.tensor[3] == 7)
    s.ensure(193)                                              # outran the headroom: mapped at once
    assert len(s.vrange.segments) == 3 and s.num_blocks >= 193 and torch.all(s.tensor[3] == 7)
    s._settle(wait=True)
    assert s.nbytes == fake.used == memory.vmm_mapped_bytes("cuda:0")
    s.release()
    assert s.nbytes == 0 and s.num_blocks == 0 and fake.used == 0 and memory.vmm_mapped_bytes() == 0
    s.ensure(1)
    assert s.nbytes > 0
    s.close()
    assert fake.used == 0 and not fake.ranges


def test_vmm_cap_and_out_of_memory_leave_it_usable(fake):
    capped = memory.VMMStorage(VMM_SHAPE, torch.bfloat16, "cuda:0", max_blocks=100)
    assert capped.vrange.reserved == 2 * GRANULE
    with pytest.raises(MemoryError, match="101 blocks"):
        capped.ensure(101)
    capped.ensure(100)
    assert capped.num_blocks == 100 and capped.nbytes == 2 * GRANULE   # lookahead stops at the reservation
    s = memory.VMMStorage(VMM_SHAPE, torch.bfloat16, "cuda:0")
    s.ensure(64 * 20)
    mapped = s.nbytes
    with pytest.raises(MemoryError, match=rf"asked {(64 * 31 // 64) * GRANULE - mapped} more bytes.*"
                                          rf"{mapped} bytes mapped, at most {64 << 20} reserved"):
        s.ensure(64 * 31)                        # 62 MiB, but the other pool holds 4 of the 64
    assert s.nbytes == mapped and fake.used == mapped + capped.nbytes
    s.ensure(64 * 29)                            # what fits still maps (without lookahead if need be)
    fake.fail_set_access = True                  # a failure after cuMemCreate + cuMemMap is undone
    before, maps = fake.used, len(fake.maps)
    with pytest.raises(MemoryError):
        s.ensure(s.num_blocks + 1)
    assert fake.used == before and len(fake.maps) == maps
    fake.fail_set_access = False
    for st in (s, capped):
        st.release()
    assert fake.used == 0


def test_vmm_release_keeps_keep_bytes_and_frees_on_collection(fake):
    s = memory.VMMStorage(VMM_SHAPE, torch.bfloat16, "cuda:0", keep_bytes=GRANULE)
    for n in (10, 400, 900):
        s.ensure(n)
    first = s.vrange.segments[0][1]
    s.release()
    assert s.nbytes == first and fake.used == first      # whole segments: the first covers keep_bytes
    s.release(0)
    assert fake.used == 0
    s.ensure(500)
    del s
    gc.collect()
    assert fake.used == 0 and not fake.ranges


def test_vmm_keep_auto_keeps_a_calls_mapping_up_to_its_share_of_the_device(fake):
    """keep_kv_bytes="auto": a layer's pool keeps what it mapped (the next call of that size maps nothing) up to its
    share of 1/KEEP_AUTO_FRACTION of the device's memory; past it, whole segments from the end go back."""
    assert memory.keep_bytes_of("auto", "cuda:0", 2) == (64 << 20) // memory.KEEP_AUTO_FRACTION // 2
    keep = memory.keep_bytes_of("auto", "cuda:0", 1)
    assert keep == 2 * GRANULE
    small = memory.VMMStorage(VMM_SHAPE, torch.bfloat16, "cuda:0", keep_bytes=keep)
    small.ensure(10)
    small._settle(wait=True)
    mapped = small.nbytes
    assert 0 < mapped <= keep
    small.release()
    assert small.nbytes == mapped and fake.used == mapped        # within its share: all of it stays mapped
    handles = len(fake.handles)
    small.ensure(10)
    small._settle(wait=True)
    assert len(fake.handles) == handles                          # the next call of that size maps nothing
    big = memory.VMMStorage(VMM_SHAPE, torch.bfloat16, "cuda:0", keep_bytes=keep)
    for n in (10, 400, 900):
        big.ensure(n)
    big._settle(wait=True)
    first = big.vrange.segments[0][1]
    assert first <= keep < big.nbytes
    big.release()
    assert big.nbytes == first                                   # the segments past the share went back
    small.release(0)
    big.release(0)
    assert fake.used == 0


def test_auto_picks_vmm_where_the_driver_supports_it(fake, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memory, "_vmm_reason", {})
    fake.cuDeviceGetAttribute = lambda attr, dev: (*fake.ok, 1)
    fake.CUdevice_attribute = types.SimpleNamespace(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=102)
    assert isinstance(make_storage(VMM_SHAPE, torch.bfloat16, "cuda:0"), memory.VMMStorage)
    monkeypatch.setattr(memory, "_vmm_reason", {})
    fake.cuDeviceGetAttribute = lambda attr, dev: (*fake.ok, 0)
    assert isinstance(make_storage(VMM_SHAPE, torch.bfloat16, "cuda:0"), GrowStorage)
    with pytest.raises(RuntimeError, match="does not support virtual memory"):
        make_storage(VMM_SHAPE, torch.bfloat16, "cuda:0", "vmm")


def test_capture_hold_waits_for_mappings_in_flight():
    """What a graph capture holds: the worker's earlier mappings are done on entry, no new one starts inside."""
    import threading
    import time
    from hf_cascade import memory
    done = threading.Event()
    memory._background().submit(lambda: (time.sleep(0.2), done.set()))
    with memory.capture_hold.held():
        assert done.is_set() and memory.capture_hold.holds == 1
        with memory.capture_hold.held():
            assert memory.capture_hold.holds == 2
    assert memory.capture_hold.holds == 0


# ---- inside a CUDA graph capture (hf_cascade.graphs): no mapping, unmapping or synchronising ------------------
@pytest.fixture
def capture(fake, monkeypatch):
    """``capture.on``: torch reports a graph capture on this thread's stream; ``capture.syncs`` records, for every
    torch.cuda.synchronize, whether a capture was on (a synchronize inside a capture invalidates it)."""
    state = types.SimpleNamespace(on=False, syncs=[])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state.on)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: state.syncs.append(state.on))
    return state


def _dead_cycle(storage) -> None:
    """Drop ``storage`` inside a reference cycle, as a finished CascadeCache holds its pools (cache.layers[i].cache
    is the cache): only the cyclic garbage collector frees it, at whatever allocation it happens to run."""
    cycle = {"storage": storage}
    cycle["self"] = cycle


def test_vmm_range_collected_during_a_capture_is_freed_after_it(fake, capture):
    """The H200 failure of test_replay_equals_eager_bitwise[300-vmm-cuda-beam-eos]: an earlier call's cache,
    garbage in a cycle, collected during the capture; its range's __del__ synchronised and unmapped there (the
    error swallowed by __del__, the capture then failing as 'invalidated'). Now it is freed after the capture."""
    s = memory.VMMStorage(VMM_SHAPE, torch.bfloat16, "cuda:0")
    s.ensure(100)
    s._settle(wait=True)
    mapped = fake.used
    assert mapped > 0
    _dead_cycle(s)
    del s
    capture.on = True
    gc.collect()                                   # the collector runs inside the capture
    assert fake.used == mapped and fake.ranges, "unmapped inside the capture"
    assert True not in capture.syncs, "synchronised inside the capture"
    assert memory.capture_hold.release_deferred() == 0          # still capturing: kept
    capture.on = False
    assert memory.capture_hold.release_deferred() == 1
    assert fake.used == 0 and not fake.ranges and memory.vmm_mapped_bytes() == 0
    assert not memory.capture_hold.deferred


def test_vmm_range_collected_while_a_capture_is_held_is_freed_when_the_hold_ends(fake, capture):
    s = memory.VMMStorage(VMM_SHAPE, torch.bfloat16, "cuda:0")
    s.ensure(10)
    _dead_cycle(s)
    del s
    with memory.capture_hold.held():               # the graph runner's warm-up and capture
        gc.collect()
        assert fake.used > 0
    assert fake.used == 0 and not fake.ranges and not memory.capture_hold.deferred


def test_vmm_growth_inside_a_capture_is_an_error_naming_it(fake, capture):
    s = memory.VMMStorage(VMM_SHAPE, torch.bfloat16, "cuda:0")
    s.ensure(10)                                   # 128 blocks mapped
    pool = s.ensure(128)                           # full: a background mapping starts
    assert s._pending is not None
    capture.on = True
    assert s.ensure(128) is pool                   # what the captured step asks: mapped already, nothing happens
    with pytest.raises(RuntimeError, match=r"during CUDA graph capture: KV pool growth \(cuMemCreate/cuMemMap"):
        s.ensure(s.num_blocks + 1)
    assert s.num_blocks == 128 and s.maps_on_step == 1     # the first ensure's only: nothing mapped inside
    capture.on = False
    s._settle(wait=True)                           # the worker's mapping, adopted after the capture
    assert s.num_blocks > 128 and s.tensor.data_ptr() == pool.data_ptr()
    s.close()
    assert fake.used == 0


def test_vmm_no_background_mapping_starts_inside_a_capture(fake, capture):
    s = memory.VMMStorage(VMM_SHAPE, torch.bfloat16, "cuda:0")
    s.ensure(10)                                   # 128 blocks mapped, no mapping ahead yet
    assert s._pending is None and s.maps_ahead == 0
    capture.on = True
    s.ensure(128)                                  # no headroom left: outside a capture this maps ahead
    assert s._pending is None and s.maps_ahead == 0
    capture.on = False
    s.close()


def test_grow_storage_growth_inside_a_capture_is_an_error(monkeypatch):
    s = GrowStorage(SHAPE, torch.float32, "cpu")
    s.ensure(16)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert s.ensure(16) is s.tensor
    with pytest.raises(RuntimeError, match="during CUDA graph capture: KV pool growth"):
        s.ensure(17)
    assert s.num_blocks == 16
