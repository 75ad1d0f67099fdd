"""The interface of an attention kernel backend (vLLM's backend / metadata builder / impl split, in one class).

A backend declares what it takes (``dtypes``, ``head_dims``, ``devices``, ``quirks``) and what it offers
(``graph_safe``, ``min_saved_tokens``, ``solo_prefix``); :meth:`Backend.unsupported_reason` checks the declared
capabilities, then the backend's own :meth:`Backend._unsupported`. Per step (or per static decode layout: a whole
generate call) :meth:`Backend.build` turns the step's plan into the backend's metadata: its launch shapes, partial
buffers, planned FlashInfer wrappers. Every layer of the step then calls :meth:`Backend.forward` with that metadata
and its own :class:`AttentionParams` (scale, softcap, window, sinks: one value). One instance per backend (each
backend module's ``BACKEND``); the step context keeps the metadata (:mod:`hf_cascade.context`), so a backend holds
no per-step state of its own.

A quantized KV pool (``CascadeConfig(kv_dtype="float8_e4m3fn")``) is a pool tensor of that dtype that carries its
dequantisation scales as the attribute :data:`KV_SCALE_ATTR` (:func:`kv_scale`; float32 ``[2, Hkv]``: K's scale per KV
head, then V's): the attention function hands the pool to the backends, so the scales travel with it. A backend
declares the quantized dtypes it reads in ``kv_dtypes``; the others refuse such a pool with the reason.

Adding a quirk: a field of :class:`AttentionParams` and its name in ``QUIRK_NAMES`` here, where
:mod:`hf_cascade.attention` reads it from the model's call, and the backends that implement it (their ``quirks`` and
``forward``; the others refuse it through :meth:`Backend.refusal` and ``backend="auto"`` falls through, the reason
logged once).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

# the per-layer attention variants (the AttentionParams fields besides the scale), as messages name them
QUIRK_NAMES = {"softcap": "attention logit softcapping", "window": "a sliding window shorter than the sequence",
               "sinks": "attention sinks (s_aux)"}


@dataclass(frozen=True, eq=False)
class AttentionParams:
    """One layer's attention parameters: everything besides q, the pool and the step's plan that decides what a
    layer's attention computes, as one value (None: that variant off). Built where the layer's attention is set up
    (:mod:`hf_cascade.attention`: once per static decode layout, else once per call off it), handed as one argument
    to :meth:`Backend.refusal`, :meth:`Backend.build` and :meth:`Backend.forward`; each backend turns it into its
    kernels' arguments in one place (the CUDA kernels' scalars: :func:`hf_cascade.kernels.ops.layer_args`).

    - ``scale``: float, the softmax scale: scores = scale x q.k (natural log domain), before the softcap;
    - ``softcap``: float > 0 or None, logit soft-capping (Gemma 2): scores -> softcap x tanh(scores / softcap);
    - ``window``: int >= 1 or None, a sliding window: each query sees its last ``window`` keys (itself included) over
      the group prefix and its row's suffix (left out by the attention where no row can pass it);
    - ``sinks``: float tensor [Hq] or None, attention-sink logits (GPT-OSS ``s_aux``: natural log, neither scaled nor
      soft-capped nor windowed), one extra key of value 0 per query head in every query's softmax.

    ``sinks`` is the layer's own parameter, held by reference (never copied: a captured graph reads it by address,
    and the kernels convert it where they need another dtype). Values compare, and key the step context's dicts, by
    their scalars and the sinks tensor's identity: the same parameter every step of a layer, so the value is
    hashable and cheap, and torch.compile reads its fields as constants.

    Adding a variant: a field here and its name in :data:`QUIRK_NAMES` (backends that do not declare it in
    ``quirks`` refuse it, with the reason), where :mod:`hf_cascade.attention` reads it from the model's call, and the
    backends that implement it (:mod:`hf_cascade.kernels.reference` first: the executable spec)."""

    scale: float
    softcap: float | None = None
    window: int | None = None
    sinks: torch.Tensor | None = None

    def _key(self):
        return self.scale, self.softcap, self.window, None if self.sinks is None else id(self.sinks)

    def __eq__(self, other):
        return isinstance(other, AttentionParams) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def serves(self, scale, softcap, window, sinks) -> bool:
        """Whether a call passing these (the fields in order) gets this value: equal scalars, the same sinks tensor
        (comparisons only: what a compiled static step traces)."""
        return scale == self.scale and softcap == self.softcap and window == self.window and sinks is self.sinks

    def quirks(self) -> tuple[str, ...]:
        """The names of the variants that are on (:data:`QUIRK_NAMES`' keys)."""
        return tuple(name for name in QUIRK_NAMES if getattr(self, name) is not None)

    def without_window(self) -> "AttentionParams":
        """This value with no window (a window no sequence can pass is plain causal attention)."""
        return self if self.window is None else replace(self, window=None)


def as_params(params: "AttentionParams | float") -> AttentionParams:
    """``params``, or a bare scale as the :class:`AttentionParams` with no variant on (one-off calls and tests)."""
    return params if isinstance(params, AttentionParams) else AttentionParams(float(params))


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
    - ``quirks``: the :class:`AttentionParams` variants the backend implements (a layer using another is refused:
      :meth:`refusal`);
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

    def unsupported_reason(self, q, pool, plan=None, params: AttentionParams | None = None) -> str | None:
        """Why this backend cannot run a layer with queries ``q`` [R, Lq, Hq, D] (or anything with that
        ``shape``/``dtype``/``device``) over ``pool`` with ``params`` (None: no variant on) in the step of ``plan``
        (None: any step), or None when it can."""
        reason = None if params is None else self.refusal(params)
        if reason is not None:
            return reason
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

    def refusal(self, params: AttentionParams) -> str | None:
        """Why this backend cannot run a layer of ``params``, or None: by default the variants on in it that
        ``quirks`` does not declare."""
        lacking = [QUIRK_NAMES[name] for name in params.quirks() if name not in self.quirks]
        return f"{' and '.join(lacking)} not implemented in this backend" if lacking else None

    def _unsupported(self, q, pool, plan) -> str | None:
        """What the declared capabilities do not say (pool layout, GQA, the plan, a library that cannot load); the
        device is checked after it."""
        return None

    def metadata_key(self, q, pool, params: AttentionParams, plan=None) -> tuple:
        """Which layers of ``plan``'s step share one metadata: those with equal keys (the layer shape, by default)."""
        return (str(q.device), q.dtype, q.shape[-2], q.shape[-1], pool.shape[2], pool.shape[3])

    def build(self, plan, q, pool, params: AttentionParams | None = None):
        """The metadata of ``plan`` for layers like this one, of ``params`` (None: no variant on; once per step, or per
        static layout)."""
        return plan

    def reusable(self, metadata) -> bool:
        """Whether metadata built earlier still holds (FlashInfer: its wrappers were not re-planned since)."""
        return True

    def forward(self, q, pool, metadata, params: AttentionParams):
        """One layer's cascade attention: ``q`` [R, Lq, Hq, D] (may be a non-contiguous view), ``pool`` the layer's
        ``[num_blocks, 2, block_size, Hkv, D]``, ``params`` the layer's (:class:`AttentionParams`); returns
        o [R, Lq, Hq, D] in q's dtype."""
        raise NotImplementedError

    def attend(self, q, pool, plan, params: "AttentionParams | float"):
        """``build`` then ``forward``, for one layer alone (tests, one-off calls); ``params`` may be a bare scale (no
        variant on)."""
        params = as_params(params)
        return self.forward(q, pool, self.build(plan, q, pool, params), params)

    def __repr__(self):
        return f"<{self.name} attention backend>"
