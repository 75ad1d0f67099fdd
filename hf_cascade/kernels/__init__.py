"""Attention kernel backends behind one small interface.

A backend is a module with:

- ``unsupported_reason(q, pool, plan) -> str | None``: why it cannot take this step (dtype, head_dim,
  device, missing package ...), or None;
- optionally ``QUIRKS``: the per-layer attention variants it implements, read from the plan as
  ``plan.softcap`` / ``plan.window`` / ``plan.sinks`` (see :class:`hf_cascade.context.LayerPlan`); none if
  absent.
  :func:`select` refuses a backend for a layer that needs a variant it lacks.
- ``attend(q, pool, plan, scale) -> o``: the cascade attention of one layer for one step.
  ``q`` [R, Lq, Hq, D] (may be a non-contiguous view), ``pool`` the layer's KV pool
  ``[num_blocks, 2, block_size, Hkv, D]``, ``plan`` the step's :class:`~hf_cascade.plan.StepPlan`
  (``plan.on(device)`` gives its index tensors; ``plan.scratch`` holds a backend's own per-step
  state, built by the first layer and reused by the others). Returns o [R, Lq, Hq, D] in q's dtype.

:mod:`hf_cascade.kernels.reference` documents the semantics; every backend must match it.

Which backend runs is logged on the ``"hf_cascade"`` logger: at INFO the choice per step shape and
routine skips (a dtype or head_dim a backend does not take); at WARNING, once per process, a fast
backend skipped on a GPU step for a reason the user can fix (FlashInfer not installed, the bundled
CUDA kernels unavailable because nvcc is missing or the build failed), with what to do. See them with
``logging.basicConfig()`` (WARNING is shown by default) or
``logging.getLogger("hf_cascade").setLevel(logging.INFO)``; ``python -m hf_cascade env`` lists
each backend's availability.
"""
from __future__ import annotations

import importlib
import logging
import threading
from types import ModuleType

import torch

logger = logging.getLogger("hf_cascade")

# Preference order for backend="auto", fastest first as measured on the H200 (benchmarks/RESULTS.md:
# our kernels 321 µs vs FlashInfer 494 µs per 8B layer at 16k x 8 beams, 26 vs 45 ms per 8B step).
# A backend that cannot load or take a shape falls through to the next with one logged line.
AUTO_ORDER = ("cuda", "flashinfer", "reference")
BACKENDS = AUTO_ORDER
# a backend's module, or why it cannot load here (a string: an exception would keep, through its traceback, the frames
# of the first generate call that loaded it, and so that call's model, alive for the whole process)
_loaded: dict[str, ModuleType | str | Exception] = {}
_logged: set = set()
_lock = threading.RLock()      # generate may run in several threads: one import per backend, each line logged once


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


def load(name: str) -> ModuleType:
    """Import backend ``name`` (raises ImportError with the reason if it cannot load here)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {BACKENDS} or 'auto'")
    found = _loaded.get(name)
    if found is None:
        with _lock:
            found = _loaded.get(name)
            if found is None:
                try:
                    found = importlib.import_module(f"{__name__}.{name}")
                except Exception as err:  # noqa: BLE001 — an optional backend missing here is expected
                    found = str(err) or type(err).__name__
                _loaded[name] = found
    if isinstance(found, (str, Exception)):     # (tests set an exception)
        raise ImportError(f"kernel backend {name!r} is unavailable: {found}")
    return found


# What to do when a fast backend is missing on a GPU (the WARNING says it once per process).
FIXES = {
    "cuda": "install the CUDA toolkit (nvcc on PATH, or $NVCC / $CUDA_HOME) to build the bundled kernels, "
            "or a hf_cascade wheel built with them",
    "flashinfer": "pip install 'hf_cascade[flashinfer]'",
}
FIXABLE_PREFIX = "CUDA kernels unavailable"   # kernels.cuda's reason when its library cannot build or load


def _log_once(key, message, *args, level=logging.INFO):
    # keyed with the level: a message first logged at INFO still shows once at WARNING
    with _lock:
        if (key, level) in _logged:
            return
        _logged.add((key, level))
    logger.log(level, message, *args)


def _warn_fixable(name: str, reason: str, q) -> None:
    """WARNING once per (process, backend) when a fast backend is off on a GPU step for a fixable reason
    (bf16/fp16 steps only: no fast backend takes other dtypes, so nothing would be gained)."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return
    _log_once(("fixable", name), "the %s attention kernels are off (%s); the next backend in %s "
              "runs instead. To use them: %s. `python -m hf_cascade env` lists each backend's status.",
              name, reason, AUTO_ORDER, FIXES.get(name, "see the reason"), level=logging.WARNING)


QUIRK_NAMES = {"softcap": "attention logit softcapping", "window": "a sliding window shorter than the sequence",
               "sinks": "attention sinks (s_aux)"}


def _reason(backend: ModuleType, q, pool, plan) -> str | None:
    lacking = [QUIRK_NAMES[quirk] for quirk in QUIRK_NAMES
               if getattr(plan, quirk, None) is not None and quirk not in getattr(backend, "QUIRKS", ())]
    if lacking:
        return f"{' and '.join(lacking)} not implemented in this backend"
    return backend.unsupported_reason(q, pool, plan)


def select(name: str, q, pool, plan) -> ModuleType:
    """The backend that runs this step: ``name``, or for "auto" the first in AUTO_ORDER that can."""
    if name != "auto":
        backend = load(name)
        reason = _reason(backend, q, pool, plan)
        if reason is not None:
            raise NotImplementedError(f"kernel backend {name!r} cannot run this step: {reason}. "
                                      "Use CascadeConfig(backend='auto') or 'reference'.")
        return backend
    key = (q.device.type, q.dtype, q.shape[-2], q.shape[-1], pool.shape[2], plan.src_index is None)
    for candidate in AUTO_ORDER:
        try:
            backend = load(candidate)
        except ImportError as err:   # logged as text: a record holding the error would hold this call's frames
            _log_once((candidate, "import"), "%s", str(err))
            _warn_fixable(candidate, str(err), q)
            continue
        reason = _reason(backend, q, pool, plan)
        if reason is None:
            _log_once((candidate, key), "attention backend %r for %s", candidate, key)
            return backend
        _log_once((candidate, key, reason), "backend %r skipped (%s)", candidate, reason)
        if reason.startswith(FIXABLE_PREFIX):
            _warn_fixable(candidate, reason, q)
    raise RuntimeError("no kernel backend can run this step")  # unreachable: reference takes everything
