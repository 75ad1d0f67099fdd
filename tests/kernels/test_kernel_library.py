"""Where the CUDA backend's library comes from (hf_cascade/kernels/cuda_library.py), on the CPU: a prebuilt library
with the right ABI version and struct layout is used without a compiler; a wrong one falls back to building; with
neither a usable prebuilt library nor nvcc the backend is off with a one-line reason (hf_cascade.kernels.select turns
it into the one WARNING: tests/test_errors.py) and nothing logged above INFO here; availability() reports each case.
The prebuilt library is stood in for by a stub with the same C symbols, compiled with the system C compiler, whose
layout table is the real one (csrc/include/hfc/layout.h over params.h): the ctypes mirrors of
hf_cascade/kernels/cuda_binding.py are checked against the C structs here (the real library needs nvcc:
tools/check_wheel.py checks it in CI).
"""
from __future__ import annotations

import ctypes
import logging
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_cascade import device_blocks as db
from hf_cascade.kernels import _build, cuda_binding, cuda_library, ops
from hf_cascade.kv.blocks import BlockManager
from hf_cascade.kv.plan import DecodeLayout, _StaticBuffers

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

INCLUDE = Path(__file__).resolve().parents[2] / "csrc" / "include"
STUB = r"""
#include <stdint.h>
#include "hfc/layout.h"
#ifdef BREAK_LAYOUT   /* a library whose hfc_suffix_params has one more field than the binding knows */
typedef struct { hfc_suffix_params base; int32_t extra; } broken_suffix;
static const hfc_layout_entry broken[] = {HFC_PARAMS_LAYOUT_ROWS, {"hfc_suffix_params", "extra",
    (int64_t)offsetof(broken_suffix, extra), 4}};
const hfc_layout_entry* hfc_params_layout(int32_t* n) { *n = sizeof(broken) / sizeof(broken[0]); return broken; }
#else
const hfc_layout_entry* hfc_params_layout(int32_t* n) { *n = hfc_params_layout_rows; return hfc_params_layout_table; }
#endif
int hfc_abi_version(void) { return ABI; }
const char* hfc_error_string(int e) { (void)e; return "stub"; }
const char* hfc_last_error(void) { return "head_dim 96 has no instantiation (compiled: 64, 128, 256)"; }
int hfc_sync(void) { return 0; }
int hfc_prefix_setup(int32_t a, int32_t b, int32_t c, int32_t t, void* d) {
  (void)a; (void)b; (void)c; (void)t; (void)d; return 0;
}
int hfc_prefix(const void* p, uintptr_t s) { (void)p; (void)s; return 0; }
int hfc_suffix(const void* p, uintptr_t s) { (void)p; (void)s; return 0; }
int hfc_merge(const void* p, uintptr_t s) { (void)p; (void)s; return 0; }
int hfc_write(void* a, const void* b, const void* c, const void* d, const void* e, int64_t f, const void* g,
              const void* h, int64_t i, int64_t j, int64_t k, uintptr_t s) {
  (void)a; (void)b; (void)c; (void)d; (void)e; (void)f; (void)g; (void)h; (void)i; (void)j; (void)k; (void)s;
  return 0;
}
#ifdef WITH_BLOCKS   /* a library with the bookkeeping kernel: it keeps what it was called with */
const void* stub_blocks_ptrs[23];
int64_t stub_blocks_sizes[8];
int hfc_blocks_advance(void* p0, void* p1, void* p2, void* p3, void* p4, const void* p5, const void* p6,
                       const void* p7, const void* p8, const void* p9, const void* p10, const void* p11,
                       const void* p12, const void* p13, void* p14, void* p15, void* p16, void* p17, void* p18,
                       void* p19, void* p20, void* p21, void* p22, int64_t rows, int64_t width, int64_t pool,
                       int64_t block_size, int64_t suffix_width, int64_t inner_width, int64_t checks, uintptr_t s) {
  const void* p[23] = {p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15, p16, p17, p18, p19,
                       p20, p21, p22};
  const int64_t n[8] = {rows, width, pool, block_size, suffix_width, inner_width, checks, (int64_t)s};
  for (int i = 0; i < 23; ++i) stub_blocks_ptrs[i] = p[i];
  for (int i = 0; i < 8; ++i) stub_blocks_sizes[i] = n[i];
  return 0;
}
#endif
#ifdef WITH_STRIDED_WRITE   /* a library with the strided cache write: it keeps what it was called with */
const void* stub_write_ptrs[7];
int64_t stub_write_sizes[7];
int hfc_write_strided(void* pool, const void* key, const void* value, int64_t key_stride, int64_t value_stride,
                      const void* block, const void* offset, int64_t tokens, const void* src, const void* dst,
                      int64_t copies, int64_t block_size, int64_t token_bytes, uintptr_t s) {
  const void* p[7] = {pool, key, value, block, offset, src, dst};
  const int64_t n[7] = {key_stride, value_stride, tokens, copies, block_size, token_bytes, (int64_t)s};
  for (int i = 0; i < 7; ++i) stub_write_ptrs[i] = p[i], stub_write_sizes[i] = n[i];
  return 0;
}
#endif
#ifdef WITH_LAYER_COPIES   /* a library with the all-layer copy: it keeps what it was called with */
const void* stub_copy_ptrs[3];
int64_t stub_copy_sizes[4];
int hfc_copy_blocks_layers(const void* pools, int64_t layers, const void* src, const void* dst, int64_t copies,
                           int64_t block_bytes, uintptr_t s) {
  stub_copy_ptrs[0] = pools, stub_copy_ptrs[1] = src, stub_copy_ptrs[2] = dst;
  const int64_t n[4] = {layers, copies, block_bytes, (int64_t)s};
  for (int i = 0; i < 4; ++i) stub_copy_sizes[i] = n[i];
  return 0;
}
#endif
#ifdef WITH_SILU_MUL   /* a library with the MLP activation kernel: it keeps what it was called with */
const void* stub_silu_ptrs[3];
int64_t stub_silu_sizes[6];
int hfc_silu_mul(void* out, const void* gate, const void* up, int64_t rows, int64_t width, int64_t gate_stride,
                 int64_t up_stride, int32_t dtype, uintptr_t s) {
  stub_silu_ptrs[0] = out, stub_silu_ptrs[1] = gate, stub_silu_ptrs[2] = up;
  const int64_t n[6] = {rows, width, gate_stride, up_stride, dtype, (int64_t)s};
  for (int i = 0; i < 6; ++i) stub_silu_sizes[i] = n[i];
  return 0;
}
#endif
"""


def stub_library(tmp_path, abi, *defines):
    name = f"stub{abi}{''.join(defines)}"
    src = tmp_path / f"{name}.c"
    src.write_text(STUB)
    out = tmp_path / f"lib{name}.so"
    subprocess.run(["cc", "-shared", "-fPIC", f"-I{INCLUDE}", f"-DABI={abi}", *(f"-D{d}" for d in defines),
                    "-o", str(out), str(src)], check=True)
    return out


@pytest.fixture
def loader(monkeypatch, tmp_path):
    """A fresh loader on a pretend sm_90 GPU, without nvcc, with an empty build cache."""
    monkeypatch.setattr(cuda_library, "_libs", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(_build, "find_nvcc", lambda: None)
    monkeypatch.setenv("HF_CASCADE_CACHE", str(tmp_path / "cache"))
    return monkeypatch


def test_prebuilt_library_is_used_without_a_compiler(loader, tmp_path, caplog):
    loader.setattr(cuda_library, "PREBUILT", stub_library(tmp_path, cuda_binding.ABI_VERSION))
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        lib = cuda_library.library("cuda:0")
    assert lib.path == cuda_library.PREBUILT
    assert cuda_library.library("cuda:0") is lib                     # loaded once
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert cuda_library.prebuilt_library() == str(cuda_library.PREBUILT)
    ok, reason = cuda_library.availability()
    assert "prebuilt" in reason and (ok or "no CUDA GPU" in reason)


def test_wrong_abi_falls_back_to_building(loader, tmp_path, caplog):
    loader.setattr(cuda_library, "PREBUILT", stub_library(tmp_path, cuda_binding.ABI_VERSION - 1))
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        for _ in range(3):          # the failure is remembered: one attempt, the same reason every time
            with pytest.raises(RuntimeError, match=f"ABI version {cuda_binding.ABI_VERSION - 1}.*nvcc not found"):
                cuda_library.library("cuda:0")
    assert len([r for r in caplog.records if "unusable" in r.getMessage()]) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert cuda_library.prebuilt_library() is None
    ok, reason = cuda_library.availability()
    assert not ok and "unusable" in reason and "nvcc" in reason


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_prebuilt_or_loaded_loads_the_prebuilt_library_and_never_builds(loader, tmp_path):
    """What a call's fused norms decide on before its first forward (hf_cascade.fused_ops.configure): the library
    loaded already, or the prebuilt one (loaded, remembered, the one library() then gives), never a build."""
    loader.setattr(cuda_library, "_arch_of", {})
    loader.setattr(torch.cuda, "current_device", lambda: 0)
    loader.setattr(cuda_library, "build_library", lambda arch: pytest.fail("prebuilt_or_loaded built a library"))
    device = torch.device("cuda", 0)
    loader.setattr(cuda_library, "PREBUILT", tmp_path / "absent.so")
    assert cuda_library.prebuilt_or_loaded(device) is None
    loader.setattr(cuda_library, "PREBUILT", stub_library(tmp_path, cuda_binding.ABI_VERSION - 1))
    assert cuda_library.prebuilt_or_loaded(device) is None and cuda_library._libs == {}    # unusable: not remembered
    loader.setattr(cuda_library, "PREBUILT", stub_library(tmp_path, cuda_binding.ABI_VERSION))
    lib = cuda_library.prebuilt_or_loaded(device)
    assert lib is not None and lib.path == cuda_library.PREBUILT
    assert cuda_library.prebuilt_or_loaded(device) is lib and cuda_library.library("cuda:0") is lib


def test_neither_prebuilt_nor_nvcc(loader, tmp_path, caplog):
    loader.setattr(cuda_library, "PREBUILT", tmp_path / "absent.so")
    with caplog.at_level(logging.WARNING, logger="hf_cascade"):
        with pytest.raises(RuntimeError, match="no prebuilt kernel library.*nvcc not found") as err:
            cuda_library.library("cuda:0")
    assert "\n" not in str(err.value) and not caplog.records
    ok, reason = cuda_library.availability()
    assert not ok and "no prebuilt kernel library" in reason and "nvcc" in reason


def test_a_failed_build_is_one_line_with_the_details_at_info(loader, tmp_path, caplog):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo "fake nvcc 0.0"; exit 0; fi\n'
                    'echo "prefix.cu(1): error: something broke" >&2\necho "second line of the details" >&2\nexit 2\n')
    nvcc.chmod(0o755)
    loader.setattr(cuda_library, "PREBUILT", tmp_path / "absent.so")
    loader.setattr(_build, "find_nvcc", lambda: str(nvcc))
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        with pytest.raises(RuntimeError, match="nvcc failed with exit code 2") as err:
            cuda_library.library("cuda:0")
    assert "\n" not in str(err.value) and "second line" not in str(err.value)
    assert any("second line of the details" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_binding_structs_are_the_c_structs(tmp_path):
    # the real layout table (sizeof / offsetof of csrc/include/hfc/params.h by the C compiler) against the mirrors
    lib = ctypes.CDLL(str(stub_library(tmp_path, cuda_binding.ABI_VERSION)))
    table = cuda_binding.read_layout(lib)
    structs = {**cuda_binding.PARAMS_STRUCTS, **cuda_binding.OPTIONAL_STRUCTS}
    assert {row[0] for row in table} == set(structs)
    cuda_binding.check_layout(table, structs)
    for struct, mirror in structs.items():      # every field of every mirror is described
        assert {row[1] for row in table if row[0] == struct} == {None} | {f for f, _ in mirror._fields_}


@pytest.mark.parametrize("change,message", [
    (lambda rows: [r if r[:2] != ("hfc_prefix_params", "window") else (*r[:2], r[2] + 4, r[3]) for r in rows],
     r"hfc_prefix_params\.window: offset \d+, 4 bytes in the library's C struct, offset \d+"),
    (lambda rows: [r if r[:2] != ("hfc_merge_params", None) else (*r[:3], r[3] + 8) for r in rows],
     r"sizeof\(hfc_merge_params\) is \d+ in the library"),
    (lambda rows: [r for r in rows if r[:2] != ("hfc_suffix_params", "softcap")],
     r"hfc_suffix_params\.softcap is in the ctypes mirror _SuffixParams but not in the library's C struct"),
    (lambda rows: [r for r in rows if r[0] != "hfc_prefix_info"], r"does not describe struct hfc_prefix_info")])
def test_a_layout_mismatch_names_the_struct_and_field(tmp_path, change, message):
    table = cuda_binding.read_layout(ctypes.CDLL(str(stub_library(tmp_path, cuda_binding.ABI_VERSION))))
    with pytest.raises(cuda_binding.LayoutMismatch, match=message):
        cuda_binding.check_layout(change(table))


def test_a_library_with_another_layout_is_not_loaded(loader, tmp_path, caplog):
    # a prebuilt library whose struct has a field the binding lacks: unusable, named, then a build is tried
    loader.setattr(cuda_library, "PREBUILT", stub_library(tmp_path, cuda_binding.ABI_VERSION, "BREAK_LAYOUT"))
    with pytest.raises(cuda_binding.LayoutMismatch, match=r"hfc_suffix_params\.extra .* not in its ctypes mirror"):
        cuda_binding._Lib(cuda_library.PREBUILT)
    with pytest.raises(RuntimeError, match=r"unusable .*hfc_suffix_params\.extra.*nvcc not found"):
        cuda_library.library("cuda:0")


def test_a_refused_call_says_why(loader, tmp_path):
    # hfc_last_error's words (a dispatch naming the value) join CUDA's name of the code in the raised error
    lib = cuda_binding._Lib(stub_library(tmp_path, cuda_binding.ABI_VERSION))
    with pytest.raises(RuntimeError, match=r"suffix failed: stub: head_dim 96 has no instantiation \(compiled: 64, "
                                           r"128, 256\) \(cudaError 1\)"):
        lib.check(1, "suffix")


def test_a_dtype_without_kernels_is_named(tmp_path):
    lib = cuda_binding._Lib(stub_library(tmp_path, cuda_binding.ABI_VERSION))
    out = torch.zeros(1, 1, 8, 128)
    with pytest.raises(TypeError, match=r"dtype torch.float32 has no instantiation \(compiled: torch.bfloat16, "
                                        r"torch.float16\)"):
        lib.merge(ops.MergeArgs(out, out, out, out, 0, 1), 0)


def test_the_cache_write_takes_the_kernel_only_where_it_fits(monkeypatch):
    """cuda_library.write_slots (the cache write on csrc/write.cu) writes only with a loaded library and tensors the
    kernel reads as they are: contiguous, int64 indices, the pool's element size, whole 16-byte vectors per token;
    anything else is left to the torch write (False), never launched with a wrong layout."""
    launches = []

    class Loaded:
        def write(self, *args):
            launches.append(args)

    pool = torch.zeros(4, 2, 16, 2, 8, dtype=torch.bfloat16)          # a token: 2 x 8 x 2 = 32 bytes
    key, value = torch.randn(3, 2, 8).bfloat16(), torch.randn(3, 2, 8).bfloat16()
    index = torch.zeros(3, dtype=torch.long)
    args = (index, index, index, index, True)
    monkeypatch.setattr(cuda_library, "write_kernel", True)
    monkeypatch.setattr(cuda_library, "loaded", lambda device: None)
    assert not cuda_library.write_slots(pool, key, value, *args)          # no library loaded: none is loaded for it
    monkeypatch.setattr(cuda_library, "loaded", lambda device: Loaded())
    monkeypatch.setattr(cuda_library, "write_kernel", False)
    assert not cuda_library.write_slots(pool, key, value, *args)          # turned off ($HF_CASCADE_WRITE_KERNEL=0)
    monkeypatch.setattr(cuda_library, "write_kernel", True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: type("Stream", (), {"cuda_stream": 0}))
    assert cuda_library.write_slots(pool, key, value, *args) and len(launches) == 1
    strided = torch.randn(2, 3, 8).bfloat16().transpose(0, 1)
    assert not cuda_library.write_slots(pool, strided, value, *args)
    assert not cuda_library.write_slots(pool, key, value, index.int(), index, index, index, True)
    assert not cuda_library.write_slots(pool.to(torch.float8_e4m3fn), key, value, *args)
    odd = torch.zeros(4, 2, 16, 2, 6, dtype=torch.bfloat16)              # 24-byte tokens
    assert not cuda_library.write_slots(odd, key[..., :6].contiguous(), value[..., :6].contiguous(), *args)
    assert len(launches) == 1


def _fused_value(tokens, q_heads=4, kv_heads=2, dim=8):
    """V as the cache gets it with fused projections: a column slice of a [tokens, q | k | v] product,
    [tokens, kv_heads, dim], its tokens strided by the fused width."""
    fused = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim).bfloat16()
    return fused[:, (q_heads + kv_heads) * dim:].view(tokens, kv_heads, dim)


def test_the_cache_write_reads_a_strided_value_only_with_the_flag_and_the_entry(monkeypatch):
    """With cuda_library.strided_write on and a library that has hfc_write_strided, a fused product's V slice goes to
    write_strided as it is (no copy); with the flag off or a library without the entry, the cache makes
    K/V contiguous and calls write, as before; layouts the strided kernel cannot read are copied even with both."""
    launches = []

    class Loaded:
        has_strided_write = True

        def write(self, pool, key, value, *args):
            launches.append(("write", key, value))

        def write_strided(self, pool, key, value, *args):
            launches.append(("write_strided", key, value))

    class Older(Loaded):
        has_strided_write = False

    from hf_cascade.kv import cache as cache_module
    monkeypatch.setattr(cuda_library, "strided_write", False)
    monkeypatch.setattr(cuda_library, "write_kernel", True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: type("Stream", (), {"cuda_stream": 0}))
    pool = torch.zeros(4, 2, 16, 2, 8, dtype=torch.bfloat16)
    value, key = _fused_value(3), torch.randn(3, 2, 8).bfloat16()
    assert not value.is_contiguous() and value.data_ptr() % 16 == 0
    index = torch.zeros(3, dtype=torch.long)
    args = (index, index, index, index, True)

    def written(library, flag):
        launches.clear()
        monkeypatch.setattr(cuda_library, "loaded", lambda device: library)
        monkeypatch.setattr(cuda_library, "strided_write", flag)
        assert cache_module._write_slots_kernel(pool, key, value, *args)
        (entry, k, v), = launches
        assert torch.equal(k, key) and torch.equal(v, value)
        return entry, v

    for library, flag in ((Loaded(), False), (Older(), True)):
        entry, v = written(library, flag)                                 # today's path: copied, then write
        assert entry == "write" and v.is_contiguous() and v.data_ptr() != value.data_ptr()
        assert not cuda_library.write_fits(pool, key, value)
        assert not cuda_library.write_slots(pool, key, value, *args)     # the kernel alone refuses it
    entry, v = written(Loaded(), True)
    assert entry == "write_strided" and v is value                        # uncopied
    assert cuda_library.write_fits(pool, key, value) and cuda_library.write_fits(pool, key, key)
    launches.clear()
    assert cuda_library.write_slots(pool, key, value, *args) and launches[0][0] == "write_strided"
    assert cuda_library.write_slots(pool, key, key.clone(), *args) and launches[1][0] == "write"   # as before
    # what the strided kernel cannot read: D strided, tokens 36 bytes apart, data not 16-byte aligned
    odd_stride = torch.randn(3, 18).bfloat16()[:, :16].view(3, 2, 8)
    unaligned = torch.randn(3, 40).bfloat16()[:, 1:17].view(3, 2, 8)
    for bad in (value.transpose(1, 2).contiguous().transpose(1, 2), odd_stride, unaligned):
        assert cuda_library._tokens_fit(bad.contiguous())                 # (each is refused for its layout alone)
        assert not cuda_library.write_fits(pool, key, bad)
        assert not cuda_library.write_slots(pool, key, bad, *args)
        launches.clear()
        assert cache_module._write_slots_kernel(pool, key, bad, *args)
        (entry, _, v), = launches
        assert entry == "write" and v.is_contiguous() and torch.equal(v, bad)


def test_the_binding_passes_the_strided_write_its_strides_in_bytes(tmp_path):
    """cuda_binding._Lib looks hfc_write_strided up (a library built before it has none: has_strided_write False) and
    passes each tensor's token stride in bytes (a single token's as a token's bytes), the token's bytes, the pool's
    block size and the copies' count."""
    assert not cuda_binding._Lib(stub_library(tmp_path, cuda_binding.ABI_VERSION)).has_strided_write
    lib = cuda_binding._Lib(stub_library(tmp_path, cuda_binding.ABI_VERSION, "WITH_STRIDED_WRITE"))
    assert lib.has_strided_write
    pool = torch.zeros(4, 2, 16, 2, 8, dtype=torch.bfloat16)
    for tokens in (3, 1):
        value, key = _fused_value(tokens), torch.randn(tokens, 2, 8).bfloat16()
        block, offset, src, dst = (torch.zeros(tokens, dtype=torch.long) for _ in range(4))
        lib.write_strided(pool, key, value, block, offset, src, dst, True, 77)
        got = (ctypes.c_void_p * 7).in_dll(lib.lib, "stub_write_ptrs")
        assert list(got) == [t.data_ptr() for t in (pool, key, value, block, offset, src, dst)]
        sizes = list((ctypes.c_int64 * 7).in_dll(lib.lib, "stub_write_sizes"))
        value_stride = (4 + 2 * 2) * 8 * 2 if tokens > 1 else 32
        assert sizes == [32, value_stride, tokens, tokens, 16, 32, 77]
        lib.write_strided(pool, key, value, block, offset, src, dst, False, 77)
        assert list((ctypes.c_int64 * 7).in_dll(lib.lib, "stub_write_sizes"))[3] == 0


def test_the_all_layer_copy_is_called_with_the_addresses_and_pairs_it_names(tmp_path, monkeypatch):
    """cuda_binding looks hfc_copy_blocks_layers up (a library built before it has none: has_layer_copies False) and
    passes the address array, the layers, the pairs, their count, the block bytes and the stream;
    cuda_library.copy_blocks_layers launches it only for a library that has it and int64 contiguous tensors on the
    pools' device with whole 16-byte vectors per block (False otherwise: the layers copy their own blocks), and
    layer_copies is on (its GPU tests passed on an H100, 2026-12-05)."""
    assert cuda_library.layer_copies is True
    assert not cuda_binding._Lib(stub_library(tmp_path, cuda_binding.ABI_VERSION)).has_layer_copies
    lib = cuda_binding._Lib(stub_library(tmp_path, cuda_binding.ABI_VERSION, "WITH_LAYER_COPIES"))
    assert lib.has_layer_copies
    addresses, src, dst = torch.arange(3, dtype=torch.int64), torch.arange(5), torch.arange(5) + 5
    lib.copy_blocks_layers(addresses, src, dst, 4096, 66)
    assert list((ctypes.c_void_p * 3).in_dll(lib.lib, "stub_copy_ptrs")) == [t.data_ptr() for t in (addresses, src,
                                                                                                  dst)]
    assert list((ctypes.c_int64 * 4).in_dll(lib.lib, "stub_copy_sizes")) == [3, 5, 4096, 66]
    assert not cuda_library.copy_blocks_layers(addresses, src, dst, 4096)              # (CPU tensors)

    class CudaLike:       # a tensor that says it is on a GPU, for the checks before a launch
        def __init__(self, t):
            self.t, self.is_cuda, self.device = t, True, torch.device("cuda", 0)
            self.dtype, self.shape = t.dtype, t.shape

        def dim(self):
            return self.t.dim()

        def is_contiguous(self):
            return self.t.is_contiguous()

    launches = []

    class Loaded:
        has_layer_copies = True

        def copy_blocks_layers(self, *args):
            launches.append(args)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: type("Stream", (), {"cuda_stream": 9}))
    monkeypatch.setattr(cuda_library, "loaded", lambda device: Loaded())
    a, s, d = CudaLike(addresses), CudaLike(src), CudaLike(dst)
    assert cuda_library.copy_blocks_layers(a, s, d, 4096) and launches[-1][3:] == (4096, 9)
    strided = CudaLike(torch.arange(10)[::2])
    for bad in ((a, s, d, 24), (a, s, d, 0), (CudaLike(addresses.int()), s, d, 4096), (a, strided, d, 4096),
                (a, s, CudaLike(dst[:4]), 4096), (CudaLike(addresses[None]), s, d, 4096)):
        assert not cuda_library.copy_blocks_layers(*bad)
    monkeypatch.setattr(Loaded, "has_layer_copies", False)
    assert not cuda_library.copy_blocks_layers(a, s, d, 4096)
    monkeypatch.setattr(cuda_library, "loaded", lambda device: None)
    assert not cuda_library.copy_blocks_layers(a, s, d, 4096)
    assert len(launches) == 1


def test_the_elementwise_kernels_take_only_layouts_they_read_as_they_are(tmp_path):
    """cuda_library.norm_fits / rotary_fits decide where csrc/elementwise.cu runs (the callers run eager ops
    elsewhere); a library built before those kernels (the stub: no hfc_rms_norm, no hfc_rotary) has none."""
    assert not cuda_binding._Lib(stub_library(tmp_path, cuda_binding.ABI_VERSION)).has_elementwise
    bf16 = torch.bfloat16
    x, weight = torch.randn(8, 1, 256, dtype=bf16), torch.randn(256, dtype=bf16)
    assert cuda_library.norm_fits(x, weight)
    assert cuda_library.norm_fits(torch.randn(8, 768, dtype=bf16)[:, 256:512], weight)     # strided rows
    assert not cuda_library.norm_fits(x.float(), weight.float())                          # float32
    assert not cuda_library.norm_fits(x, weight.float())                                  # weight's dtype
    assert not cuda_library.norm_fits(torch.randn(256, 8, dtype=bf16).t(), torch.randn(8, dtype=bf16))
    # q and k as views of one fused q|k|v product [B, L, (Hq + 2 Hk) D], per head, transposed
    fused = torch.randn(2, 5, (4 + 2 * 2) * 32, dtype=bf16)
    q = fused[..., :128].view(2, 5, 4, 32).transpose(1, 2)
    k = fused[..., 128:192].view(2, 5, 2, 32).transpose(1, 2)
    cos, sin = torch.randn(2, 5, 32, dtype=bf16), torch.randn(2, 5, 32, dtype=bf16)
    assert cuda_library.rotary_fits(q, k, cos, sin)
    assert cuda_library.rotary_fits(q, k, cos[:1], sin[:1])                               # one row for all
    assert not cuda_library.rotary_fits(q, k, cos, sin.transpose(0, 1).contiguous().transpose(0, 1))
    assert not cuda_library.rotary_fits(q.float(), k.float(), cos.float(), sin.float())
    assert not cuda_library.rotary_fits(q, k, cos.unsqueeze(1), sin.unsqueeze(1))        # [B, 1, L, D]: not 3-D
    assert not cuda_library.rotary_fits(q.transpose(-1, -2), k.transpose(-1, -2), cos, sin)
    assert cuda_library.rms_norm(x, weight, 1e-6) is None and cuda_library.rotary(q, k, cos, sin) is None   # (CPU)


def test_the_activation_kernel_is_called_with_the_rows_and_strides_of_its_views(tmp_path):
    """cuda_binding passes hfc_silu_mul (csrc/api.cu) the pointers, the rows, the width and each input's row stride (the
    halves of a fused gate|up product: strided views, no copy); a single row's stride is the width, whatever its view
    says. silu_mul_fits decides where the kernel runs; a library built before it (no symbol) has none."""
    assert not cuda_binding._Lib(stub_library(tmp_path, cuda_binding.ABI_VERSION)).has_silu_mul
    lib = cuda_binding._Lib(stub_library(tmp_path, cuda_binding.ABI_VERSION, "WITH_SILU_MUL"))
    assert lib.has_silu_mul
    for rows, width in ((6, 40), (1, 24)):
        fused = torch.randn(rows, 2 * width + 8, dtype=torch.float16)
        gate, up = fused[:, :width], fused[:, width + 8:]
        out = torch.empty(rows, width, dtype=torch.float16)
        lib.silu_mul(out, gate, up, stream=55)
        got = (ctypes.c_void_p * 3).in_dll(lib.lib, "stub_silu_ptrs")
        assert list(got) == [out.data_ptr(), gate.data_ptr(), up.data_ptr()]
        stride = fused.stride(0) if rows > 1 else width
        sizes = list((ctypes.c_int64 * 6).in_dll(lib.lib, "stub_silu_sizes"))
        assert sizes == [rows, width, stride, stride, cuda_binding.DTYPE_CODES[torch.float16], 55]
    bf16 = torch.bfloat16
    fused = torch.randn(2, 3, 2 * 64, dtype=bf16)
    gate, up = fused[..., :64], fused[..., 64:]
    assert cuda_library.silu_mul_fits(gate, up)
    assert not cuda_library.silu_mul_fits(gate.float(), up.float())                       # float32
    assert not cuda_library.silu_mul_fits(gate, up.half())                                # two dtypes
    assert not cuda_library.silu_mul_fits(gate, up[:, :2])                                # two shapes
    assert not cuda_library.silu_mul_fits(gate.transpose(0, 2), up.transpose(0, 2))       # last dim strided
    assert not cuda_library.silu_mul_fits(fused[..., :0], fused[..., :0])                 # empty rows
    assert cuda_library.silu_mul(gate, up) is None                                        # (CPU)


def test_the_bookkeeping_kernel_is_called_with_the_state_and_plan_it_names(tmp_path):
    """cuda_binding passes hfc_blocks_advance (csrc/api.cu) every tensor of the state, the step and the plan in the C
    signature's order, the middle level's plan tensors as NULL without one, and the sizes; a library built before the
    kernel (no symbol) has none, and whole_step.advance runs the torch ops."""
    assert not cuda_binding._Lib(stub_library(tmp_path, cuda_binding.ABI_VERSION)).has_blocks
    lib = cuda_binding._Lib(stub_library(tmp_path, cuda_binding.ABI_VERSION, "WITH_BLOCKS"))
    assert lib.has_blocks
    for system_len in (0, 5):       # without, then with a middle level
        m = BlockManager(4)
        if system_len:
            m.add_rows(1)
            m.append([system_len])
            m.fork(2)
        else:
            m.add_rows(2)
        m.append([9, 6])
        m.fork(3)
        layout = DecodeLayout.freeze(m.tables(), m.lengths, 4, 8, min_group_rows=2)
        assert (layout.inner_width > 0) == bool(system_len)
        blocks = db.DeviceBlocks.from_host(m, layout, m.capacity + 10)
        plan = _StaticBuffers(layout, torch.device("cpu")).plan
        parents, done, peak = torch.arange(6), torch.tensor(False), torch.zeros((), dtype=torch.int64)
        lib.blocks_advance(blocks, plan, parents, done, peak, stream=77)
        tensors = [blocks.tables, blocks.lengths, blocks.refcount, blocks.flags, blocks.steps, blocks.token_limit,
                   blocks.row_prefix_blocks, blocks.row_inner_blocks, blocks.check_rows, blocks.check_cols,
                   blocks.check_ids, blocks.check_used, parents, done, peak, plan.suffix_table, plan.q_limit,
                   plan.inner_suffix_table, plan.inner_q_limit, plan.write_block, plan.write_offset, plan.copy_src,
                   plan.copy_dst]
        got = (ctypes.c_void_p * 23).in_dll(lib.lib, "stub_blocks_ptrs")
        assert list(got) == [t.data_ptr() if t is not None else None for t in tensors]
        sizes = list((ctypes.c_int64 * 8).in_dll(lib.lib, "stub_blocks_sizes"))
        assert sizes == [6, blocks.tables.shape[1], m.capacity + 10, 4, layout.suffix_width, layout.inner_width,
                         blocks.check_rows.shape[0], 77]
        assert cuda_library.blocks_fit(blocks, plan, parents, done, peak)
    assert np.all(got[17:19]) and not cuda_library.blocks_advance(blocks, plan, parents, done, peak)   # (CPU)


def test_the_token_choice_kernels_take_only_the_tensors_they_read(tmp_path):
    """A library built before csrc/select.cu has none (has_select False: whole_step.choose runs the torch ops); the
    kernels take a state of the dtypes and shapes they read, contiguous, with at most 1024 rows and two position
    tensors, and never CPU tensors (select_library None)."""
    from hf_cascade.decode import device_select
    assert not cuda_binding._Lib(stub_library(tmp_path, cuda_binding.ABI_VERSION)).has_select

    def inputs(rows):
        return (torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, 1, dtype=torch.int64),
                (torch.zeros(rows, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)))

    for fields in (dict(batch_size=2, eos_token_ids=(3,)), dict(batch_size=2, num_beams=3, eos_token_ids=(3,))):
        config = device_select.SelectionConfig(prompt_length=4, max_length=9, **fields)
        state = device_select.new_state(config, torch.zeros(config.rows, 4, dtype=torch.int64))
        parents, ids, positions = inputs(config.rows)
        assert cuda_library.select_fits(state, parents, ids, positions)
        assert cuda_library.select_library(state, parents, ids, positions) is None                  # (CPU)
        assert not cuda_library.select_fits(state, parents, ids, positions + positions[:1])        # three positions
        assert not cuda_library.select_fits(state, parents.int(), ids, positions)                  # int32 parents
        assert not cuda_library.select_fits(state, parents, ids.view(-1), positions)               # ids [R]
        state.sequences = state.sequences.t().contiguous().t()                                     # column-major
        assert not cuda_library.select_fits(state, parents, ids, positions)
    config = device_select.SelectionConfig(batch_size=1025, prompt_length=2, max_length=6)
    state = device_select.new_state(config, torch.zeros(1025, 2, dtype=torch.int64))
    assert not cuda_library.select_fits(state, *inputs(1025))                                      # > a CTA
