"""CUDA graph capture checks shared by the kernels and the pools: whether a capture is under way on this thread's
stream, and a refusal that names a call that would break one (imports nothing of the package)."""
from __future__ import annotations

import torch


def capture_underway() -> bool:
    """Whether this thread's current CUDA stream is being captured into a CUDA graph (False where torch has no CUDA)."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001 — a torch without CUDA: nothing is captured
        return False


def refuse_in_capture(what: str) -> None:
    """Raise RuntimeError naming ``what`` if it would run inside a CUDA graph capture. A call that is not capture
    safe (a host sync, a pageable upload, a driver call such as cudaFuncSetAttribute or cuMemMap) only invalidates
    the capture there, and CUDA's error then names a later launch ("operation failed due to a previous error during
    capture"); this names the culprit instead (hf_cascade.graphs reports it as the reason graphs are off)."""
    if capture_underway():
        raise RuntimeError(f"hf_cascade: not capture safe, during CUDA graph capture: {what} (it must happen before "
                           "the capture: in the eager warm-up step or the step's plan upload)")
