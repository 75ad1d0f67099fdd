"""Where the CUDA backend's library comes from (hf_cascade/kernels/cuda.py), on the CPU: a prebuilt library with the
right ABI version is used without a compiler; a wrong one falls back to building; with neither a usable prebuilt
library nor nvcc the backend is off with a one-line reason (hf_cascade.kernels.select turns it into the one
WARNING: tests/test_errors.py) and nothing logged above INFO here; availability() reports each case. The prebuilt library is stood in for by a stub with the same C symbols, compiled
with the system C compiler (the real one needs nvcc: tools/check_wheel.py checks it in CI).
"""
from __future__ import annotations

import logging
import shutil
import subprocess

import pytest
import torch

from hf_cascade.kernels import _build
from hf_cascade.kernels import cuda as cuda_backend

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

STUB = r"""
#include <stdint.h>
int hfc_abi_version(void) { return ABI; }
const char* hfc_error_string(int e) { (void)e; return "stub"; }
int hfc_sync(void) { return 0; }
int hfc_prefix_setup(int32_t a, int32_t b, int32_t c, int32_t t, void* d) {
  (void)a; (void)b; (void)c; (void)t; (void)d; return 0;
}
int hfc_prefix(const void* p, uintptr_t s) { (void)p; (void)s; return 0; }
int hfc_suffix(const void* p, uintptr_t s) { (void)p; (void)s; return 0; }
int hfc_merge(const void* p, uintptr_t s) { (void)p; (void)s; return 0; }
"""


def stub_library(tmp_path, abi):
    src = tmp_path / f"stub{abi}.c"
    src.write_text(STUB)
    out = tmp_path / f"libstub{abi}.so"
    subprocess.run(["cc", "-shared", "-fPIC", f"-DABI={abi}", "-o", str(out), str(src)], check=True)
    return out


@pytest.fixture
def loader(monkeypatch, tmp_path):
    """A fresh loader on a pretend sm_90 GPU, without nvcc, with an empty build cache."""
    monkeypatch.setattr(cuda_backend, "_libs", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(_build, "find_nvcc", lambda: None)
    monkeypatch.setenv("HF_CASCADE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_CASCADE_PREFIX_KERNEL", raising=False)
    return monkeypatch


def test_prebuilt_library_is_used_without_a_compiler(loader, tmp_path, caplog):
    loader.setattr(cuda_backend, "PREBUILT", stub_library(tmp_path, cuda_backend.ABI_VERSION))
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        lib = cuda_backend.library("cuda:0")
    assert lib.path == cuda_backend.PREBUILT
    assert cuda_backend.library("cuda:0") is lib                     # loaded once
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert cuda_backend.prebuilt_library() == str(cuda_backend.PREBUILT)
    ok, reason = cuda_backend.availability()
    assert "prebuilt" in reason and (ok or "no CUDA GPU" in reason)


def test_wrong_abi_falls_back_to_building(loader, tmp_path, caplog):
    loader.setattr(cuda_backend, "PREBUILT", stub_library(tmp_path, cuda_backend.ABI_VERSION - 1))
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        for _ in range(3):          # the failure is remembered: one attempt, the same reason every time
            with pytest.raises(RuntimeError, match=f"ABI version {cuda_backend.ABI_VERSION - 1}.*nvcc not found"):
                cuda_backend.library("cuda:0")
    assert len([r for r in caplog.records if "unusable" in r.getMessage()]) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert cuda_backend.prebuilt_library() is None
    ok, reason = cuda_backend.availability()
    assert not ok and "unusable" in reason and "nvcc" in reason


def test_neither_prebuilt_nor_nvcc(loader, tmp_path, caplog):
    loader.setattr(cuda_backend, "PREBUILT", tmp_path / "absent.so")
    with caplog.at_level(logging.WARNING, logger="hf_cascade"):
        with pytest.raises(RuntimeError, match="no prebuilt kernel library.*nvcc not found") as err:
            cuda_backend.library("cuda:0")
    assert "\n" not in str(err.value) and not caplog.records
    ok, reason = cuda_backend.availability()
    assert not ok and "no prebuilt kernel library" in reason and "nvcc" in reason


def test_retired_v1_is_an_error_not_a_fallback(loader, tmp_path):
    loader.setattr(cuda_backend, "PREBUILT", stub_library(tmp_path, cuda_backend.ABI_VERSION))
    loader.setenv("HF_CASCADE_PREFIX_KERNEL", "v1")
    with pytest.raises(ValueError, match="retired"):
        cuda_backend.library("cuda:0")
    ok, reason = cuda_backend.availability()
    assert not ok and "retired" in reason


def test_a_failed_build_is_one_line_with_the_details_at_info(loader, tmp_path, caplog):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo "fake nvcc 0.0"; exit 0; fi\n'
                    'echo "prefix.cu(1): error: something broke" >&2\necho "second line of the details" >&2\nexit 2\n')
    nvcc.chmod(0o755)
    loader.setattr(cuda_backend, "PREBUILT", tmp_path / "absent.so")
    loader.setattr(_build, "find_nvcc", lambda: str(nvcc))
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        with pytest.raises(RuntimeError, match="nvcc failed with exit code 2") as err:
            cuda_backend.library("cuda:0")
    assert "\n" not in str(err.value) and "second line" not in str(err.value)
    assert any("second line of the details" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
