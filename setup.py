"""Build hooks (metadata: setup.cfg). A wheel carries the kernel sources (csrc/ -> hf_cascade/csrc) and, where nvcc
exists, the kernels compiled into one library (hf_cascade/kernels/libhfc_kernels.so: sm_80, sm_86, sm_89, sm_90a
and compute_90 PTX), which the installed package loads without a compiler. ``pip install -e .`` compiles nothing
(a checkout builds its kernels with nvcc on first use).

$HF_CASCADE_BUILD_KERNELS: "auto" (default: compile when nvcc is found), "1" (compile or fail), "0" (never).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import time
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py as _build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:  # setuptools < 70.1
    try:
        from wheel.bdist_wheel import bdist_wheel as _bdist_wheel
    except ImportError:  # no wheel package: nothing builds a wheel here (e.g. setup.py sdist)
        _bdist_wheel = None

ROOT = Path(__file__).resolve().parent


def _load_build():
    """hf_cascade/kernels/_build.py without importing hf_cascade (and torch)."""
    spec = importlib.util.spec_from_file_location("_hfc_build", ROOT / "hf_cascade" / "kernels" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_kbuild = _load_build()


def _kernel_mode() -> str:
    mode = os.environ.get("HF_CASCADE_BUILD_KERNELS", "auto").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"$HF_CASCADE_BUILD_KERNELS={mode!r}: expected auto, 0 or 1")
    return mode


def _will_compile() -> bool:
    mode = _kernel_mode()
    if mode == "0":
        return False
    if _kbuild.find_nvcc() is None:
        if mode == "1":
            raise SystemExit("$HF_CASCADE_BUILD_KERNELS=1 but nvcc was not found (put it on PATH or set $CUDA_HOME)")
        return False
    return True


class build_py(_build_py):
    """Also ship csrc/ inside the package and compile the kernel library into it (not in editable mode)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        csrc = ROOT / "csrc"
        target = Path(self.build_lib) / "hf_cascade" / "csrc"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(csrc, target, ignore=shutil.ignore_patterns("__pycache__", "*.o", "*.so", "*.pyc"))
        out = Path(self.build_lib) / "hf_cascade" / "kernels" / _kbuild.LIBRARY_NAME
        out.unlink(missing_ok=True)     # never ship a library left by an earlier build of other sources
        if not _will_compile():
            print("hf_cascade: not compiling the CUDA kernels (no nvcc or $HF_CASCADE_BUILD_KERNELS=0); the installed "
                  "package builds them on first use where nvcc exists")
            return
        start = time.monotonic()
        print(f"hf_cascade: compiling the CUDA kernels into {out} ({' '.join(_kbuild.WHEEL_GENCODE)}); takes minutes")
        try:
            _kbuild.compile_library(out, _kbuild.WHEEL_GENCODE, csrc=csrc)
        except RuntimeError as err:
            if _kernel_mode() == "1":
                raise
            print(f"hf_cascade: WARNING: the CUDA kernels did not compile, the wheel ships without them: {err}")
            return
        print(f"hf_cascade: compiled the CUDA kernels in {time.monotonic() - start:.0f} s "
              f"({out.stat().st_size / 2**20:.1f} MiB)")


class BinaryDistribution(Distribution):
    """With the compiled library the package goes to platlib (it is not pure Python)."""

    def has_ext_modules(self):
        return _will_compile()


cmdclass = {"build_py": build_py}
if _bdist_wheel is not None:
    class bdist_wheel(_bdist_wheel):
        """A wheel with the compiled library is specific to the platform, not to the Python version (ctypes, no
        Python C API)."""

        def get_tag(self):
            python, abi, plat = super().get_tag()
            return (python, abi, plat) if self.root_is_pure else ("py3", "none", plat)

    cmdclass["bdist_wheel"] = bdist_wheel

setup(distclass=BinaryDistribution, cmdclass=cmdclass)
