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
"""
from __future__ import annotations

import importlib
import logging
from types import ModuleType

logger = logging.getLogger("hf_cascade")

# Preference order for backend="auto", fastest first as measured on the H200 (benchmarks/RESULTS.md:
# our kernels 321 µs vs FlashInfer 494 µs per 8B layer at 16k x 8 beams, 26 vs 45 ms per 8B step).
# A backend that cannot load or take a shape falls through to the next with one logged line.
AUTO_ORDER = ("cuda", "flashinfer", "reference")
BACKENDS = AUTO_ORDER
_loaded: dict[str, ModuleType | Exception] = {}
_logged: set = set()


def load(name: str) -> ModuleType:
    """Import backend ``name`` (raises ImportError with the reason if it cannot load here)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {BACKENDS} or 'auto'")
    if name not in _loaded:
        try:
            _loaded[name] = importlib.import_module(f"{__name__}.{name}")
        except Exception as err:  # an optional backend missing here is expected
            _loaded[name] = err
    found = _loaded[name]
    if isinstance(found, Exception):
        raise ImportError(f"kernel backend {name!r} is unavailable: {found}") from found
    return found


def _log_once(key, message, *args):
    if key not in _logged:
        _logged.add(key)
        logger.info(message, *args)


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
        except ImportError as err:
            _log_once((candidate, "import"), "hf_cascade: %s", err)
            continue
        reason = _reason(backend, q, pool, plan)
        if reason is None:
            _log_once((candidate, key), "hf_cascade: attention backend %r for %s", candidate, key)
            return backend
        _log_once((candidate, key, reason), "hf_cascade: backend %r skipped (%s)", candidate, reason)
    raise RuntimeError("no kernel backend can run this step")  # unreachable: reference takes everything
