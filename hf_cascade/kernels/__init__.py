"""Attention kernel backends behind one interface, and the registry that chooses one.

A backend is an instance of :class:`~hf_cascade.kernels.base.Backend` (each backend module's ``BACKEND``): declared
capabilities, ``unsupported_reason`` (the layer's variants: ``refusal(params)``), a per-step ``build(plan, ...) ->
metadata`` and ``forward(q, pool, metadata, params)``, ``params`` the layer's
:class:`~hf_cascade.kernels.base.AttentionParams` (scale, softcap, window, sinks: one value). :data:`REGISTRY` names
them in ``backend="auto"``'s order; :func:`select` chooses one for a layer shape (the step context calls it once per
step and shape).

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

from .base import QUIRK_NAMES, AttentionParams, Backend, as_params, is_quantized  # noqa: F401  (re-exported)
from .capture import capture_underway, refuse_in_capture  # noqa: F401 (re-exported)

logger = logging.getLogger("hf_cascade")

# Preference order for backend="auto", fastest first as measured on the H200 (benchmarks/RESULTS.md:
# our kernels 321 µs vs FlashInfer 494 µs per 8B layer at 16k x 8 beams, 26 vs 45 ms per 8B step).
# A backend that cannot load or take a shape falls through to the next with one logged line.
# The registry: backend name -> its module under hf_cascade.kernels (which defines BACKEND), in "auto"'s order.
REGISTRY = {"cuda": "cuda", "flashinfer": "flashinfer", "reference": "reference"}
BACKENDS = tuple(REGISTRY)
# a backend's instance, or why it cannot load here (a string: an exception would keep, through its traceback, the frames
# of the first generate call that loaded it, and so that call's model, alive for the whole process)
_loaded: dict[str, Backend | str | Exception] = {}
_logged: set = set()
_lock = threading.RLock()      # generate may run in several threads: one import per backend, each line logged once


def load(name: str) -> Backend:
    """Backend ``name`` (its module imported once; raises ImportError with the reason if it cannot load here)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {BACKENDS} or 'auto'")
    found = _loaded.get(name)
    if found is None:
        with _lock:
            found = _loaded.get(name)
            if found is None:
                try:
                    found = module(name).BACKEND
                except Exception as err:  # noqa: BLE001 — an optional backend missing here is expected
                    found = str(err) or type(err).__name__
                _loaded[name] = found
    if isinstance(found, (str, Exception)):     # (tests set an exception)
        raise ImportError(f"kernel backend {name!r} is unavailable: {found}")
    return found


def module(name: str) -> ModuleType:
    """The module of backend ``name`` (its library loading and diagnostics); raises as importing it does."""
    return importlib.import_module(f"{__name__}.{REGISTRY[name]}")


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
              name, reason, BACKENDS, FIXES.get(name, "see the reason"), level=logging.WARNING)


def check_kv_dtype(name: str, kv_dtype: torch.dtype, device) -> None:
    """Refuse, before anything is stored, a quantized KV cache of ``kv_dtype`` on ``device`` that backend ``name``
    cannot read ("auto" always can: the reference reads every ``kv_dtypes`` dtype on every device). A backend that
    does not load here is left to the step, which says why."""
    if name == "auto":
        return
    try:
        backend = load(name)
    except ImportError:
        return
    dtype_name = str(kv_dtype).replace("torch.", "")
    device = torch.device(device)
    reason = None
    if kv_dtype not in backend.kv_dtypes:
        reason = "it reads K/V in the model's dtype only"
    elif backend.devices is not None and device.type not in backend.devices:
        reason = f"it runs on {' or '.join(backend.devices)} only, and the K/V are on {device}"
    if reason is not None:
        raise ValueError(f"CascadeConfig(kv_dtype={dtype_name!r}, backend={name!r}) cannot be served: {reason}. Use "
                         f"backend='auto', or kv_dtype=None.")


def select(name: str, q, pool, plan=None, params: AttentionParams | None = None) -> Backend:
    """The backend that runs a layer with queries ``q`` over ``pool`` with ``params`` (None: no variant on) in the
    step of ``plan`` (None: any step): ``name``, or for "auto" the first in the registry that can."""
    if name != "auto":
        backend = load(name)
        reason = backend.unsupported_reason(q, pool, plan, params)
        if reason is not None:
            raise NotImplementedError(f"kernel backend {name!r} cannot run this step: {reason}. "
                                      "Use CascadeConfig(backend='auto') or 'reference'.")
        return backend
    padded = plan is not None and plan.src_index is not None
    key = (q.device.type, q.dtype, q.shape[-2], q.shape[-1], pool.shape[2], not padded)
    for candidate in BACKENDS:
        try:
            backend = load(candidate)
        except ImportError as err:   # logged as text: a record holding the error would hold this call's frames
            _log_once((candidate, "import"), "%s", str(err))
            _warn_fixable(candidate, str(err), q)
            continue
        reason = backend.unsupported_reason(q, pool, plan, params)
        if reason is None and is_quantized(pool) and pool.dtype not in backend.auto_kv_dtypes:
            reason = f"a {str(pool.dtype).replace('torch.', '')} pool is served on request only (backend={candidate!r})"
        if reason is None:
            _log_once((candidate, key), "attention backend %r for %s", candidate, key)
            return backend
        _log_once((candidate, key, reason), "backend %r skipped (%s)", candidate, reason)
        if reason.startswith(FIXABLE_PREFIX):
            _warn_fixable(candidate, reason, q)
    raise RuntimeError("no kernel backend can run this step")  # unreachable: reference takes everything
