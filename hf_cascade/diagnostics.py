"""What this machine offers hf_cascade: versions, GPUs, and each kernel backend's availability with the
reason (``python -m hf_cascade env``). Reads only; never fails: a check that errors reports its error."""
from __future__ import annotations

import importlib.metadata
import os
import platform

import torch

from . import kernels, memory

# the environment variables hf_cascade (and the tools it calls) reads
ENV_VARS = {
    "HF_CASCADE_CACHE": "where the CUDA kernels built on first use are cached (default ~/.cache/hf_cascade)",
    "HF_CASCADE_BUILD_KERNELS": "building a wheel: auto (default: compile the CUDA kernels where nvcc exists), 1, 0",
    "HF_CASCADE_PREFIX_TUNE": "the prefix kernel's launch for a tuning sweep: auto (default), default, or knobs "
                              "(variant=n64w8,m=64,chunk=2048)",
    "HF_CASCADE_CUDA_DEBUG": "non-empty: synchronise and check for errors after every CUDA kernel (slow)",
    "HF_CASCADE_KEEP_SEQ2SEQ": "1/true/on/yes: an encoder-decoder generate call of the same shape as the model's "
                               "last one reuses its cross-attention storages, decoder cache and captured decode step "
                               "(held between calls until hf_cascade.release(model); opt-in until measured on a GPU)",
    "HF_CASCADE_WRITE_KERNEL": "0: the cache write in torch index kernels instead of csrc/write.cu (default: the "
                               "kernel where the cuda backend's kernels are loaded)",
    "NVCC": "the nvcc that builds the CUDA kernels (default: nvcc on PATH, $CUDA_HOME/bin/nvcc)",
    "CUDA_HOME": "CUDA toolkit folder, for nvcc",
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
    lines += [f"  {k}: {r['environment'].get(k, '(unset)')} - {doc}" for k, doc in ENV_VARS.items()]
    return "\n".join(lines)
