"""hf_cascade: transformers' generate() with prompt KV shared across beams and samples.

``import hf_cascade`` registers ``attn_implementation="cascade"``; load a model with it and call
``generate`` as usual (settings: ``generate(..., hf_cascade_config=CascadeConfig(...) or a dict)``).

Public API: :class:`CascadeConfig` (settings, checked when made), :class:`CascadeCache` (the paged KV
cache; pass your own to ``generate`` to read :meth:`CascadeCache.stats`), :class:`CacheStats`,
:class:`PoolExhausted` (the KV pool hit ``max_kv_bytes``; a ``MemoryError``), :func:`cascade_generate`
(the decoding entry ``generate`` runs for cascade models), :func:`prefill`, :func:`register` and
:func:`release` (drop what generate keeps for a model's next call: reserved pools, a captured decode graph).
Which kernel backend runs is logged on the ``"hf_cascade"`` logger; ``python -m hf_cascade env``
reports what this machine offers.
"""
from . import _cli

if _cli.invoked():      # `python -m hf_cascade ...`: answer --help or a bad flag before torch loads (seconds)
    _cli.check_argv()

from .attention import register
from .kv.blocks import PoolExhausted
from .kv.cache import CacheStats, CascadeCache
from .config import CascadeConfig
from .generation import cascade_generate, prefill
from ._version import __version__  # noqa: F401 (the package version)
from .decode.session import release

# The modules' names before the subpackages (hf_cascade.cache, hf_cascade.whole_step, ...) stay importable: each is
# the moved module itself.
_MOVED = {**{name: "kv" for name in ("blocks", "cache", "context", "memory", "plan", "static_step")},
          **{name: "decode" for name in ("device_blocks", "device_select", "fused_linears", "fused_ops", "graphs",
                                         "host_select", "regional", "session", "whole_step")},
          **{name: "seq2seq" for name in ("cross_attention", "cross_kv", "dense_cache", "encoder_decoder",
                                          "encoder_expansion", "seq2seq_models")}}


def _alias_moved_modules() -> None:
    import importlib
    import sys
    for name, package in _MOVED.items():
        module = importlib.import_module(f"{__name__}.{package}.{name}")
        sys.modules.setdefault(f"{__name__}.{name}", module)
        globals().setdefault(name, module)


_alias_moved_modules()

__all__ = ["CascadeCache", "CascadeConfig", "CacheStats", "PoolExhausted", "cascade_generate", "prefill", "register",
           "release"]

register()


def _import_patches():
    """``hf_cascade.patches`` is installed from the top-level patches/ folder; in a source checkout
    used without installing (PYTHONPATH=.), load it from there under the same name."""
    try:
        from . import patches
        return patches
    except ImportError:
        import importlib.util
        import pathlib
        import sys
        init = pathlib.Path(__file__).resolve().parent.parent / "patches" / "__init__.py"
        spec = importlib.util.spec_from_file_location(__name__ + ".patches", init,
                                                      submodule_search_locations=[str(init.parent)])
        patches = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = patches
        spec.loader.exec_module(patches)
        return patches


_import_patches().apply()
