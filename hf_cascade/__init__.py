"""hf_cascade: transformers' generate() with prompt KV shared across beams and samples.

``import hf_cascade`` registers ``attn_implementation="cascade"``; load a model with it and call
``generate`` as usual.
"""
from .attention import register
from .cache import CacheStats, CascadeCache
from .config import CascadeConfig
from .generation import cascade_generate, prefill

__version__ = "0.1.0"
__all__ = ["CascadeCache", "CascadeConfig", "CacheStats", "cascade_generate", "prefill", "register"]

register()

from . import patches as _patches  # noqa: E402  (installed from the top-level patches/ folder)

_patches.apply()
