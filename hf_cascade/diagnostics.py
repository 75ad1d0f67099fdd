"""What this machine offers hf_cascade: versions, GPUs, and each kernel backend's availability with the
reason (``python -m hf_cascade env``). Reads only; never fails: a check that errors reports its error."""
from __future__ import annotations

import importlib.metadata
import os
import platform

import torch

from . import kernels
from .kv import memory

# The environment variables hf_cascade (and the tools it calls) reads: the one list `env` reports and
# docs/environment.md is generated from (tools/docs_pages.py). Markdown: the docs page shows it as written.
ENV_VARS = {
    "HF_CASCADE_CACHE": (
        "where the CUDA kernels built on first use are cached (default `~/.cache/hf_cascade`)"),
    "HF_CASCADE_BUILD_KERNELS": (
        "when building a wheel: `auto` (default: compile the CUDA kernels into it where `nvcc` exists), `1` "
        "(compile or fail), `0` (never)"),
    "HF_CASCADE_PREFIX_TUNE": (
        "the prefix kernel's launch for a tuning sweep (read once): `auto` (default, the production choice), "
        "`default` (the default kernel everywhere), or knobs such as `variant=n64w8,m=64,chunk=2048`; the "
        "Hopper kernel (bf16/fp16 head_dim 128) is chosen by the architecture where the library has sm_90a "
        "code, `kernel=sm90` (or the older `variant=wg`) asks for it (`hf_cascade/kernels/cuda_tuning.py`)"),
    "HF_CASCADE_CUDA_DEBUG": (
        "non-empty: synchronise and check for errors after every CUDA kernel launch (slow; for debugging)"),
    "HF_CASCADE_WRITE_KERNEL": (
        "`0` (or `false`, `off`, `no`): the cache write of each layer in four torch index kernels. Default: "
        "on `csrc/write.cu` (two launches: copy-on-write copies, then K and V) where the cuda backend has "
        "loaded the kernels"),
    "NVCC": (
        "the `nvcc` that builds the CUDA kernels (default: `nvcc` on `PATH`, then `$CUDA_HOME/bin/nvcc`, "
        "`/usr/local/cuda/bin/nvcc`)"),
    "CUDA_HOME": (
        "the `nvcc` that builds the CUDA kernels (default: `nvcc` on `PATH`, then `$CUDA_HOME/bin/nvcc`, "
        "`/usr/local/cuda/bin/nvcc`)"),
}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    import transformers

    from ._version import __version__
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch CUDA": torch.version.cuda,
        "transformers": transformers.__version__,
        "hf_cascade": __version__,
        "flashinfer-python": _version("flashinfer-python"),
        "cuda-bindings": _version("cuda-bindings"),
        "nvcc": _nvcc(),
    }


def _nvcc() -> str | None:
    try:
        find = getattr(kernels.module("cuda"), "_find_nvcc", None)
        return find() if callable(find) else None
    except Exception:  # noqa: BLE001
        return None


def gpus() -> list[dict]:
    if not torch.cuda.is_available():
        return []
    found = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        found.append({"index": i, "name": p.name, "compute capability": f"{p.major}.{p.minor}",
                      "memory GiB": round(p.total_memory / 2**30, 1)})
    return found


def _cuda_backend() -> tuple[bool, str]:
    """Whether the bundled CUDA kernels can run here, and why (loading them builds them once if needed)."""
    try:
        kernels.load("cuda")
        cuda = kernels.module("cuda")
    except ImportError as err:
        return False, str(err)
    if not torch.cuda.is_available():
        return False, "no CUDA device visible to torch"
    if torch.cuda.get_device_capability(0) < (8, 0):
        return False, "needs compute capability 8.0 or newer"
    source = None
    prebuilt = getattr(cuda, "prebuilt_library", None)          # an installed wheel's compiled kernels
    try:
        path = prebuilt() if callable(prebuilt) else None
    except Exception as err:  # noqa: BLE001  (a diagnosis reports, never fails)
        path, source = None, f"prebuilt library lookup failed ({err}); "
    if path:
        source = f"prebuilt library {path}"
    else:
        find_nvcc = getattr(cuda, "_find_nvcc", None)
        nvcc = find_nvcc() if callable(find_nvcc) else None
        if nvcc is None:
            return False, ((source or "") + "no prebuilt kernels in this install and nvcc not found; "
                           + kernels.FIXES["cuda"])
        source = f"built with {nvcc} on first use"
    try:
        lib = cuda.library(torch.device("cuda", 0))
    except Exception as err:  # noqa: BLE001
        return False, f"{source}, but loading failed: {err}"
    return True, f"{source}; loaded {getattr(lib, 'path', '')}, prefix kernel {getattr(lib, 'prefix_kernel', '?')}"


def _flashinfer_backend() -> tuple[bool, str]:
    try:
        kernels.load("flashinfer")
        fi = kernels.module("flashinfer")
    except ImportError as err:
        return False, str(err)
    if not torch.cuda.is_available():
        return False, f"flashinfer {fi.VERSION} imports, but there is no CUDA device"
    return True, f"flashinfer {fi.VERSION} (compiles each dtype/head_dim on first use)"


def backends() -> dict[str, tuple[bool, str]]:
    """Each kernel backend, in ``backend="auto"``'s order: (available, reason)."""
    checks = {"cuda": _cuda_backend, "flashinfer": _flashinfer_backend,
              "reference": lambda: (True, "PyTorch, any device and dtype")}
    found = {}
    for name in kernels.BACKENDS:
        try:
            found[name] = checks[name]()
        except Exception as err:  # noqa: BLE001
            found[name] = (False, f"check failed: {type(err).__name__}: {err}")
    return found


def memory_policies() -> dict[str, tuple[bool, str]]:
    if torch.cuda.is_available():
        reason = memory.vmm_unavailable_reason(torch.device("cuda", 0))
        vmm = (reason is None, reason or "CUDA virtual memory: the pool grows in place")
    else:
        vmm = (False, "needs a CUDA device")
    return {"vmm": vmm, "grow": (True, "doubling with one copy"), "static": (True, "needs max_kv_bytes")}


def report() -> dict:
    return {"versions": versions(), "gpus": gpus(), "backends": backends(), "memory": memory_policies(),
            "environment": {k: os.environ[k] for k in ENV_VARS if k in os.environ}}


def format_report(r: dict) -> str:
    lines = ["versions:"]
    lines += [f"  {k}: {v if v is not None else '-'}" for k, v in r["versions"].items()]
    lines.append("GPUs:" + ("" if r["gpus"] else " none visible to torch"))
    lines += [f"  cuda:{g['index']}: {g['name']}, compute capability {g['compute capability']}, "
              f"{g['memory GiB']} GiB" for g in r["gpus"]]
    lines.append("kernel backends (backend='auto' takes the first available that supports the step):")
    lines += [f"  {name}: {'yes' if ok else 'no'} - {why}" for name, (ok, why) in r["backends"].items()]
    lines.append("memory policies:")
    lines += [f"  {name}: {'yes' if ok else 'no'} - {why}" for name, (ok, why) in r["memory"].items()]
    lines.append("environment variables:")
    lines += [f"  {k}={v}" for k, v in r["environment"].items()]
    unset = [k for k in ENV_VARS if k not in r["environment"]]
    lines.append(f"  unset: {', '.join(unset)} (docs/environment.md says what each does)" if unset else "")
    return "\n".join(lines)
