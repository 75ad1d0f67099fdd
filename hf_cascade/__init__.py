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



def _alias_moved_modules() -> None:
    """The modules' names before the subpackages (hf_cascade.cache, hf_cascade.whole_step, ...) stay importable: each
    is the moved module itself."""
    import importlib
    import pkgutil
    import sys
    for package in ("kv", "decode", "seq2seq"):
        for info in pkgutil.iter_modules(importlib.import_module(f"{__name__}.{package}").__path__):
            module = importlib.import_module(f"{__name__}.{package}.{info.name}")
            sys.modules.setdefault(f"{__name__}.{info.name}", module)
            globals().setdefault(info.name, module)


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
