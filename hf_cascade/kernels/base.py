"""The interface of an attention kernel backend (vLLM's backend / metadata builder / impl split, in one class).

A backend declares what it takes (``dtypes``, ``head_dims``, ``devices``, ``quirks``) and what it offers
(``graph_safe``, ``min_saved_tokens``, ``solo_prefix``); :meth:`Backend.unsupported_reason` checks the declared
capabilities, then the backend's own :meth:`Backend._unsupported`. Per step (or per static decode layout: a whole
generate call) :meth:`Backend.build` turns the step's plan into the backend's metadata: its launch shapes, partial
buffers, planned FlashInfer wrappers. Every layer of the step then calls :meth:`Backend.forward` with that metadata
and its own quirks. One instance per backend (each backend module's ``BACKEND``); the step context keeps the
metadata (:mod:`hf_cascade.context`), so a backend holds no per-step state of its own.

A quantized KV pool (``CascadeConfig(kv_dtype="float8_e4m3fn")``) is a pool tensor of that dtype that carries its
dequantisation scales as the attribute :data:`KV_SCALE_ATTR` (:func:`kv_scale`; float32 ``[2, Hkv]``: K's scale per KV
head, then V's): the attention function hands the pool to the backends, so the scales travel with it. A backend
declares the quantized dtypes it reads in ``kv_dtypes``; the others refuse such a pool with the reason.

Adding a quirk: a field of :class:`Quirks` and its name in ``QUIRK_NAMES`` here, the ``quirks`` and ``forward`` of
the backends that implement it, and where :mod:`hf_cascade.attention` reads it from the model's call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# the per-layer attention variants, by Quirks field, as messages name them
QUIRK_NAMES = {"softcap": "attention logit softcapping", "window": "a sliding window shorter than the sequence",
               "sinks": "attention sinks (s_aux)"}


@dataclass(frozen=True, eq=False)
class Quirks:
    """One layer's attention variants, as the model's attention call passes them (None: off).

    ``sinks``: the layer's attention-sink logits [Hq] (GPT-OSS ``s_aux``), a tensor, so quirk sets compare
    (and key the context's dicts) by its identity: the same parameter every step of a layer."""

    softcap: float | None = None
    window: int | None = None
    sinks: torch.Tensor | None = None

    def _key(self):
        return self.softcap, self.window, None if self.sinks is None else id(self.sinks)

    def __eq__(self, other):
        return isinstance(other, Quirks) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def used(self) -> tuple[str, ...]:
        """The names of the variants that are on."""
        return tuple(name for name in QUIRK_NAMES if getattr(self, name) is not None)

    def kwargs(self) -> dict:
        """As :meth:`Backend.forward` takes them."""
        return {name: getattr(self, name) for name in QUIRK_NAMES}


NO_QUIRKS = Quirks()

# pool dtypes stored with scales (a real value = stored value x its K/V, KV head's scale)
KV_SCALED_DTYPES = (torch.float8_e4m3fn,)
KV_SCALE_ATTR = "hfc_kv_scale"


def kv_scale(pool) -> torch.Tensor | None:
    """The dequantisation scales a quantized pool carries (float32 ``[2, Hkv]``, on the pool's device), else None."""
    return getattr(pool, KV_SCALE_ATTR, None)


def with_kv_scale(pool: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``pool`` carrying ``scale`` (see :func:`kv_scale`); returns the same tensor object."""
    setattr(pool, KV_SCALE_ATTR, scale)
    return pool


def is_quantized(pool) -> bool:
    """Whether ``pool`` (or anything with a ``dtype``) holds scaled K/V (:data:`KV_SCALED_DTYPES`)."""
    return getattr(pool, "dtype", None) in KV_SCALED_DTYPES


class Backend:
    """One kernel backend. Subclasses set the capabilities and implement ``_unsupported``, ``build``, ``forward``.

    Capabilities:

    - ``name``: as ``CascadeConfig(backend=...)`` names it;
    - ``dtypes`` / ``head_dims`` / ``devices``: what the queries and pool may be (None: any);
    - ``kv_dtypes``: the quantized pool dtypes (:data:`KV_SCALED_DTYPES`) it reads, besides pools in the queries' dtype;
    - ``quirks``: the :class:`Quirks` fields the backend implements (a layer using another is refused);
    - ``graph_safe``: a static decode step on it can be captured in a CUDA graph (no host sync, launch shapes from
      the layout, lengths read on the device);
    - ``min_saved_tokens``: a cascade pays on it once the groups of a step save this many token reads per layer;
    - ``solo_prefix``: a row sharing no prefix reads its full blocks faster through the prefix kernel (a static
      decode layout then makes it a group of one);
    - ``layout_metadata``: metadata built for a static decode step holds for every step of its layout (it reads
      only the layout's fixed part and device buffers), so the layout keeps it for the call; else it is per step.
    """

    name = "?"
    dtypes: tuple | None = None
    head_dims: tuple | None = None
    devices: tuple | None = None
    kv_dtypes: tuple = ()
    auto_kv_dtypes: tuple = ()      # those of kv_dtypes that backend="auto" hands it (the others: on request only)
    quirks: tuple = ()
    graph_safe = False
    min_saved_tokens = 0
    solo_prefix = False
    layout_metadata = False

    def unsupported_reason(self, q, pool, plan=None, quirks: Quirks = NO_QUIRKS) -> str | None:
        """Why this backend cannot run a layer with queries ``q`` [R, Lq, Hq, D] (or anything with that
        ``shape``/``dtype``/``device``) over ``pool`` with ``quirks`` in the step of ``plan`` (None: any step), or
        None when it can."""
        lacking = [QUIRK_NAMES[name] for name in quirks.used() if name not in self.quirks]
        if lacking:
            return f"{' and '.join(lacking)} not implemented in this backend"
        if is_quantized(pool):
            name = str(pool.dtype).replace("torch.", "")
            if pool.dtype not in self.kv_dtypes:
                return (f"a {name} KV cache (this backend reads K/V in the model's dtype only: use "
                        "CascadeConfig(kv_dtype=None), or backend='cuda' / 'reference')")
            if kv_scale(pool) is None:
                return f"a {name} KV pool without its scales (hf_cascade.kernels.base.with_kv_scale)"
        if self.dtypes is not None and q.dtype not in self.dtypes:
            return f"dtype {q.dtype} (takes {', '.join(str(d).replace('torch.', '') for d in self.dtypes)})"
        if self.head_dims is not None and q.shape[-1] not in self.head_dims:
            return f"head_dim {q.shape[-1]} (takes {', '.join(map(str, self.head_dims))})"
        reason = self._unsupported(q, pool, plan)        # (first: says more than the device would)
        if reason is None and self.devices is not None and q.device.type not in self.devices:
            reason = f"{q.device.type} tensors (needs {' or '.join(d.upper() for d in self.devices)} tensors)"
        return reason

    def _unsupported(self, q, pool, plan) -> str | None:
        """What the declared capabilities do not say (pool layout, GQA, the plan, a library that cannot load); the
        device is checked after it."""
        return None

    def metadata_key(self, q, pool, quirks: Quirks, plan=None) -> tuple:
        """Which layers of ``plan``'s step share one metadata: those with equal keys (the layer shape, by default)."""
        return (str(q.device), q.dtype, q.shape[-2], q.shape[-1], pool.shape[2], pool.shape[3])

    def build(self, plan, q, pool, quirks: Quirks = NO_QUIRKS):
        """The metadata of ``plan`` for layers like this one (once per step, or per static layout)."""
        return plan

    def reusable(self, metadata) -> bool:
        """Whether metadata built earlier still holds (FlashInfer: its wrappers were not re-planned since)."""
        return True

    def forward(self, q, pool, metadata, scale: float, *, softcap=None, window=None, sinks=None):
        """One layer's cascade attention: ``q`` [R, Lq, Hq, D] (may be a non-contiguous view), ``pool`` the layer's
        ``[num_blocks, 2, block_size, Hkv, D]``; returns o [R, Lq, Hq, D] in q's dtype."""
        raise NotImplementedError

    def attend(self, q, pool, plan, scale: float, quirks: Quirks = NO_QUIRKS):
        """``build`` then ``forward``, for one layer alone (tests, one-off calls)."""
        return self.forward(q, pool, self.build(plan, q, pool, quirks), scale, **quirks.kwargs())

    def __repr__(self):
        return f"<{self.name} attention backend>"
