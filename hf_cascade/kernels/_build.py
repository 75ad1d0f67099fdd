"""Compiling the kernels of ``csrc/`` into one shared library with nvcc (standard library only).

Used by :mod:`hf_cascade.kernels.cuda_library` (a build for the present GPU on first use, when no prebuilt library
fits) and by ``setup.py`` (the prebuilt library of a wheel, loaded from the file next to this one), so that
both compile the same sources with the same flags. Importable without torch or the rest of hf_cascade.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["LIBRARY_NAME", "WHEEL_GENCODE", "gencode_for", "find_csrc", "find_nvcc", "source_files", "nvcc_command",
           "compile_library"]

LIBRARY_NAME = "libhfc_kernels.so"   # the prebuilt library's file name, next to this module in a wheel
NVCC_FLAGS = ("-O3", "--use_fast_math", "-std=c++17", "-Xcompiler", "-fPIC", "-shared", "-lineinfo")
# a wheel's fatbin: machine code for Ampere (A100, A10/3090, L4/4090) and Hopper, plus compute_90 PTX that the
# driver compiles for newer GPUs on first load. Hopper's machine code is sm_90a: the wgmma prefix kernel
# (csrc/prefix_sm90.cu) needs it, and every compute-capability-9.0 GPU runs it.
WHEEL_GENCODE = ("-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_86,code=sm_86",
                 "-gencode=arch=compute_89,code=sm_89", "-gencode=arch=compute_90a,code=sm_90a",
                 "-gencode=arch=compute_90,code=compute_90")

_HERE = Path(__file__).resolve().parent


def gencode_for(arch: str) -> list[str]:
    """nvcc's targets for one GPU architecture ("sm_90" -> sm_90a machine code, see WHEEL_GENCODE)."""
    if arch == "sm_90":
        return ["-gencode=arch=compute_90a,code=sm_90a"]
    return [f"-arch={arch}"]


def find_csrc() -> Path | None:
    """The kernel sources: ``hf_cascade/csrc`` in an installed package, ``csrc/`` in a source checkout."""
    for cand in (_HERE.parent / "csrc", _HERE.parents[1] / "csrc"):
        if (cand / "api.cu").is_file() and (cand / "include" / "hfc" / "api.h").is_file():
            return cand
    return None


def find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), os.path.join(home, "bin", "nvcc") if home else None,
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def source_files(csrc: Path) -> tuple[list[Path], list[Path]]:
    """(the .cu files linked into the library, the headers they include)."""
    return sorted(csrc.glob("*.cu")), sorted(p for p in (csrc / "include").rglob("*") if p.is_file())


def nvcc_command(nvcc: str, csrc: Path, out: Path, gencode) -> list[str]:
    """``gencode``: nvcc arguments naming the targets, e.g. ``["-arch=sm_90"]`` or :data:`WHEEL_GENCODE`."""
    cus, _ = source_files(csrc)
    return [nvcc, *NVCC_FLAGS, *gencode, f"-I{csrc / 'include'}", "-o", str(out), *map(str, cus)]


def compile_library(out: Path, gencode, *, nvcc: str | None = None, csrc: Path | None = None,
                    timeout: float = 3600) -> list[str]:
    """Compile the library to ``out``; returns the command. RuntimeError with nvcc's message if it fails."""
    nvcc = nvcc or find_nvcc()
    csrc = csrc or find_csrc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (put it on PATH or set $NVCC / $CUDA_HOME)")
    if csrc is None:
        raise RuntimeError("the kernel sources (csrc/) are not in this installation")
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = nvcc_command(nvcc, csrc, out, gencode)
    if len([g for g in gencode if "arch=" in g]) > 1:
        cmd.insert(1, f"--threads={min(4, os.cpu_count() or 1)}")   # the targets of a fatbin in parallel
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"nvcc could not run: {err}") from err
    if res.returncode != 0:
        out.unlink(missing_ok=True)
        raise RuntimeError(f"nvcc failed with exit code {res.returncode}: {(res.stderr or res.stdout)[-3000:]}")
    return cmd
