"""Regional compilation of the decode step (``CascadeConfig(compile="regional")``): one compiled decoder layer serving
every layer of the model.

``compile=True`` compiles the whole decode forward as one graph: dynamo traces every layer and inductor compiles
them all, once per shape (45-72 s for an 8B model on the H200). A model's decoder layers are one class run N times on
other weights; torch's regional-compilation recipe compiles the repeated block once instead: dynamo inlines the
modules, so their parameters are graph inputs, and the code compiled for the first layer serves every later layer
whose guards hold. Here it is one compiled function, :func:`region` (shared by every layer of every model in the
process, so a model's second call and a second model of the same shapes compile nothing).

What would make the guards fail layer after layer is the layer's Python identity: its attention's ``layer_idx``,
with which ``Cache.update(k, v, layer_idx)`` and the cascade attention find the layer's pool and its attention bound
on the layout. So for the length of one regional forward each decoder layer's ``forward`` is :class:`_LayerForward`
(an instance attribute), which looks those up on the host before the layer's compiled code runs and hands them in
as one :class:`~hf_cascade.context.LayerStep`: as the layer's cache (its ``update`` writes into this layer's pool,
whatever index it is given) and as the ``cascade_step`` argument that reaches the layer's attention call (the layer's
keyword arguments go on to it on every transformers version). Inside the compiled layer ``layer_idx`` is passed on and
never read: nothing guards on it. Layers whose Python differs otherwise (a sliding window's layers and the
full-attention ones, through their ``sliding_window``) compile one graph per kind.

Outside the layers the forward stays eager: the embedding, the masks and rotary tables, the final norm and the logits
(a few kernels; inside a captured CUDA graph they cost no host time). What runs on the host per layer (the lookups
above, the step's record of the layer's write) runs while the step is captured, not when it is replayed.

A layer runs its own uncompiled forward where the step is not a static decode step whose layer was bound on its
layout (a layout's first step runs the plain forward first: the graph runner's rule), so every other forward of the
model is untouched; and a model whose decoder layers cannot be found (:func:`unsupported_reason`) compiles whole.
"""
from __future__ import annotations

import threading
import weakref

import torch
from torch import nn

from ..compat import CACHE_KWARGS
from ..kv.context import STEP_KWARG, LayerStep, StepContext, _binding_key

_lock = threading.Lock()         # generate may run in several threads: guards installing the layers' forwards
_regions: dict = {}              # compile options -> the one compiled layer function of the process


def _layer_forward(module, args, kwargs):
    """What :func:`region` compiles: a decoder layer's own forward (its class's: not the instance's
    :class:`_LayerForward`)."""
    return type(module).forward(module, *args, **kwargs)


def region(options: dict):
    """The compiled decoder layer for ``torch.compile`` ``options`` (one per process and options: every layer of every
    model calls the same one, so that dynamo's cache for it serves them all)."""
    key = tuple(sorted(options.items()))
    with _lock:
        if key not in _regions:
            _regions[key] = torch.compile(_layer_forward, **options)
        return _regions[key]


def _attention_index(layer: nn.Module) -> int | None:
    """The ``layer_idx`` of the self-attention inside decoder layer ``layer`` (None where it has none or several)."""
    found = {m.layer_idx for m in layer.modules() if isinstance(getattr(m, "layer_idx", None), int)}
    return found.pop() if len(found) == 1 else None


def decoder_layers(model) -> list[tuple[nn.Module, int]] | None:
    """(layer, its attention's layer_idx) of every decoder layer of ``model``: the one ``nn.ModuleList`` of blocks of
    one class whose self-attention modules carry ``layer_idx`` 0..N-1 in order; None where there is not exactly one."""
    found = []
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or not len(module):
            continue
        if len({type(block) for block in module}) != 1:
            continue
        indices = [_attention_index(block) for block in module]
        if indices == list(range(len(module))):
            found.append([(block, i) for block, i in zip(module, indices)])
    return found[0] if len(found) == 1 else None


def unsupported_reason(model) -> str | None:
    """Why ``model``'s decode forward cannot be compiled layer by layer (None where it can)."""
    if getattr(model.config, "is_encoder_decoder", False):
        return ("an encoder-decoder model (its decoder layers find their cross-attention K/V by layer_idx inside the "
                "layer)")
    if decoder_layers(model) is None:
        return "no one list of decoder layers with layer_idx 0..N-1 was found"
    return None


class _LayerForward:
    """A decoder layer's ``forward`` while a :class:`RegionalForward` runs: on a static decode step whose layer is
    bound on the layout, the layer's share of the step (:class:`~hf_cascade.context.LayerStep`) found on the host and
    the compiled layer run on it; any other call, the layer's own forward."""

    def __init__(self, layer: nn.Module, layer_idx: int, options: dict):
        self._layer = weakref.ref(layer)       # (the layer holds this object while installed: no cycle)
        self.layer_idx, self.options = layer_idx, options

    def plain(self, layer):
        return type(layer).forward.__get__(layer, type(layer))

    def __call__(self, *args, **kwargs):
        layer = self._layer()
        ctx = kwargs.get(STEP_KWARG)
        # (a forward compiled whole in another thread meanwhile traces the layer's own forward)
        share = (_layer_share(ctx, self.layer_idx) if isinstance(ctx, StepContext)
                 and not torch.compiler.is_compiling() else None)
        if share is None or not any(name in kwargs for name in CACHE_KWARGS):
            # (a layer given its cache positionally would call the cache's update with its layer_idx: its own forward)
            return self.plain(layer)(*args, **kwargs)
        step, cascade_layer, key_shape = share
        inner = {k: v for k, v in kwargs.items() if k not in CACHE_KWARGS}
        inner.update({name: step for name in CACHE_KWARGS if name in kwargs})
        inner[STEP_KWARG] = step
        if "attention_mask" in inner:
            # a static step's attention reads no mask (its plan says what each row sees); the layout's first, eager
            # step checked it (attention._check_supported)
            inner["attention_mask"] = None
        out = region(self.options)(layer, args, inner)
        # what the cache's update and the attention record of a layer (the graph runner checks it after a step)
        ctx.written[self.layer_idx] = (cascade_layer, key_shape)
        ctx.backends[step.bound.backend_key] = step.bound.backend
        return out


def _layer_share(ctx: StepContext, layer_idx: int):
    """(the layer's LayerStep, its CascadeLayer, the K/V shape it stores) for a static decode step under way whose
    layer ``layer_idx`` is bound on the layout and not yet written; else None (the layer's own forward runs)."""
    plan, cache = ctx.plan, ctx.cache
    if cache is None or ctx.finished or ctx.unread or layer_idx in ctx.written or not plan.static:
        return None
    bound = plan.layout.metadata.get(_binding_key(layer_idx))
    layers = getattr(cache, "layers", ())
    if bound is None or layer_idx >= len(layers) or not layers[layer_idx].is_initialized:
        return None
    layer = layers[layer_idx]
    if layer.storage is None:
        return None
    layer.step_pool = layer._with_scale(layer.storage.stable_view())
    _, _, heads, head_dim = layer.storage.block_shape
    key_shape = torch.Size((cache.batch_size, heads, plan.q_len, head_dim))
    return LayerStep(plan, layer, bound), layer, key_shape


class RegionalForward:
    """``model.forward`` with each decoder layer compiled on its own (:func:`region`): what the graph runner calls in
    place of a forward compiled whole. Called with the step context as its ``cascade_step`` argument (the runner's
    compiled call), it installs every layer's :class:`_LayerForward` for the call and removes them after it."""

    def __init__(self, forward, options: dict):
        self.forward, self.options = forward, options
        model = forward.__self__
        self.layers = [(weakref.ref(layer), i) for layer, i in (decoder_layers(model) or ())]

    def __call__(self, *args, **kwargs):
        layers = [(layer(), i) for layer, i in self.layers]
        with _installed([(layer, i) for layer, i in layers if layer is not None], self.options):
            return self.forward(*args, **kwargs)


_installs: dict = {}         # id(layer) -> (its _LayerForward, how many regional forwards run with it installed)


class _installed:
    """Each layer's :class:`_LayerForward` for the length of a block (reference-counted: two threads' regional
    forwards of one model share them; the last one out removes them). A layer that has an instance ``forward`` of
    its own (accelerate's) keeps it: it runs uncompiled."""

    def __init__(self, layers, options):
        self.layers, self.options, self.mine = layers, options, []

    def __enter__(self):
        with _lock:
            for layer, i in self.layers:
                entry = _installs.get(id(layer))
                if entry is None:
                    if "forward" in layer.__dict__:
                        continue
                    entry = [_LayerForward(layer, i, self.options), 0]
                    _installs[id(layer)] = entry
                    layer.forward = entry[0]
                entry[1] += 1
                self.mine.append(layer)
        return self

    def __exit__(self, *exc):
        with _lock:
            for layer in self.mine:
                entry = _installs[id(layer)]
                entry[1] -= 1
                if entry[1] == 0:
                    del _installs[id(layer)]
                    if layer.__dict__.get("forward") is entry[0]:
                        del layer.forward
        return False
