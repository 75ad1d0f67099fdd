"""Attention kernel backends. Each backend is a module with the same functions:
``prefix_attention``, ``suffix_attention``, ``merge_state`` and ``cascade_attention``
(see :mod:`hf_cascade.kernels.reference` for shapes and semantics)."""
from __future__ import annotations

import importlib
import logging
from types import ModuleType

logger = logging.getLogger("hf_cascade")

# Preference order for backend="auto"; a backend that cannot load is skipped with one logged line.
AUTO_ORDER = ("reference",)
_loaded: dict[str, ModuleType] = {}
_auto: ModuleType | None = None


def _load(name: str) -> ModuleType:
    if name not in _loaded:
        _loaded[name] = importlib.import_module(f"{__name__}.{name}")
    return _loaded[name]


def get_backend(name: str = "auto") -> ModuleType:
    """The kernel module for ``name`` ("auto" picks the first that loads, logged once)."""
    global _auto
    if name != "auto":
        return _load(name)
    if _auto is None:
        for candidate in AUTO_ORDER:
            try:
                _auto = _load(candidate)
            except Exception as err:  # an optional backend missing is expected
                logger.info("hf_cascade: backend %r unavailable (%s); trying the next one", candidate, err)
                continue
            logger.info("hf_cascade: attention backend %r", candidate)
            break
    return _auto
