"""Each layer's q/k/v projections as one matrix product, and gate/up as another (``CascadeConfig.fuse_projections``).

A decode step of a large model is a few rows against every weight: its matrix products are bound by reading the
weights, and the small ones (k_proj and v_proj of a GQA model) read far below the device's rate, with split-K reduce
kernels of their own. :func:`fuse` stores the members of a group (``q_proj``/``k_proj``/``v_proj`` of an attention,
``gate_proj``/``up_proj`` of an MLP) as row slices of one buffer, so that one product over the buffer serves them
all; nothing else changes: each member stays an ``nn.Linear`` with its own ``weight`` Parameter (the same object,
now a view of the buffer), so ``state_dict``, optimizers and hooks see what they saw before.

Compute (:class:`_FusedLinear`): without gradients for the weights, the group's first member computes the fused
product of its input and keeps it on the group; a later member given the very same input tensor returns its column
slice of it (the last one drops it), any other input gets the member's own product. With gradients for the weights,
every member computes its own product on its view, so gradients land on each Parameter and optimizer steps in place
land in the buffer.

Only a cascade generate call's forwards (:func:`serving`) take the fused product: a forward outside generate (a
Trainer's loss pass) computes each member's own, stock's logits bit for bit. The encoder of an encoder-decoder model
is not fused (it runs once per call).

Tensor parallelism (transformers' ``tp_plan``, 5.17 and 5.24 alike): each weight is a DTensor Parameter whose local
tensor is the rank's shard, and the module's ``forward`` is an instance attribute that transformers' style installed
(``TensorParallelLayer.install_forward``): it wraps the input, runs ``nn.Linear.forward`` with the local shards
swapped in for the DTensors (``_use_local_dtensor_params``, at inference) and wraps the output. A colwise
(``ColwiseParallel``, weight ``Shard(0)``) member's local output is the product of its local rows, so a group whose
members share one colwise style object and mesh is fused on each rank over its local shards: the buffer holds the
rank's rows, each DTensor keeps its object and its local tensor object (now a view of the buffer, as a plain member's
Parameter is), and the member's forward is installed again by the same style around :class:`_FusedLinear`'s, so that
transformers' input and output handling stays as it was (unfusing puts the original one back). A sharded group that
is not that (another style, a colwise output gathered, ``Shard`` on another dim, mixed with unsharded members) is
left unfused, the reason logged once at INFO. Rowwise layers (``o_proj``, ``down_proj``) are no group's members.
:func:`fused_groups` counts a model's (a rank's) fused products.

Anything that moves a member's weight off the buffer (``model.to(dtype)`` sets ``param.data``; a new Parameter) is
found by :func:`check`, which then unfuses the whole model; a forward before that uses the member's own weight
(:meth:`_Group.holds`; not for a same-dtype ``param.data =`` assignment, which only :func:`check` sees). The module imports nothing of the cache, plan or kernels.
"""
from __future__ import annotations

import collections
import contextlib
import inspect
import logging
import re
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..logs import log_once

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor, Shard
else:                                   # (a torch built without distributed: no tensor parallelism to meet)
    DTensor = Shard = None

# (children names) of a group, the first computing the fused product; the names of Llama-like decoder layers
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# a cross-attention's q_proj and k/v_proj take different inputs: the fused product would compute k/v's rows for
# nothing at every step
_CROSS = re.compile(r"cross|encoder_attn")
# an encoder-decoder's encoder runs once per call, not per decode step: left unfused, its products (and what
# output_hidden_states returns of it) stay stock's bit for bit
_ENCODER = re.compile(r"(^|\.)encoder\.")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_lock = threading.Lock()        # generate may run in several threads: one of them fuses or unfuses a model
# whether a cascade generate call is running (serving()): only its forwards take the fused products, so a forward
# outside generate (a Trainer's loss pass, a user's own call) gives stock's logits bit for bit. A bool, not a count:
# a compiled step guards on its value. (A plain forward in another thread during a generate call takes them too.)
_serving = False
_serving_calls = 0


class _Group:
    """One fused group: the buffers its members' weight (and bias) Parameters are row slices of, each member's row
    range, the members (weakly: they hold the group), and the fused product of the last input (``stash``:
    (input, output), one attribute so that a thread reads both at once) until the last member takes its slice.
    Under tensor parallelism ``forwards`` holds each member's (transformers' forward, the one installed in its place)
    and the buffers hold the rank's local rows; else it is None."""

    def __init__(self, where: str, names: tuple, members: list, weight: torch.Tensor, bias: torch.Tensor | None,
                 rows: tuple, forwards: list | None = None):
        self.where, self.names, self.weight, self.bias, self.rows = where, names, weight, bias, rows
        self.members = tuple(weakref.ref(m) for m in members)
        # the tensors set to views of ``weight``: the Parameters, or under tensor parallelism their local shards
        self.params = tuple(weakref.ref(_local(m.weight)) for m in members)
        self.forwards = forwards
        self.stash = None

    def holds(self, index: int, weight: torch.Tensor) -> bool:
        """Whether member ``index``'s ``weight`` may still be the buffer's rows, by what a forward can see cheaply
        (and dynamo guards): the same Parameter object, of the buffer's dtype and device. A new Parameter or
        ``model.to()`` between two generate calls then never meets the stale buffer in a plain forward; the next
        call's :func:`check` unfuses the model. Under tensor parallelism the forward sees the local shard that
        transformers swapped in: the shard itself or (``to_local`` of a Parameter in newer torch) a view of it."""
        param = self.params[index]()
        return ((param is weight or (self.forwards is not None and weight._base is param))
                and weight.dtype == self.weight.dtype and weight.device == self.weight.device)


class _FusedLinear(nn.Linear):
    """An ``nn.Linear`` member of a fused group (``__class__`` swapped in place, so isinstance, state_dict and hooks
    are as before); ``_fused_group`` and ``_fused_index`` say where its rows are."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, index = self._fused_group, self._fused_index
        if (not _serving or (torch.is_grad_enabled() and self.weight.requires_grad)
                or not group.holds(index, self.weight)):
            # outside generate, gradients for this Parameter, or moved: its own product
            return F.linear(x, self.weight, self.bias)
        low, high = group.rows[index]
        if index == 0:
            out = F.linear(x, group.weight, group.bias)
            group.stash = (x, out)
        else:
            stash = group.stash
            if stash is None or stash[0] is not x:
                group.stash = None          # the first member's input was another: nothing to keep it for
                return F.linear(x, self.weight, self.bias)
            out = stash[1]
            if index == len(group.rows) - 1:
                group.stash = None
        return out[..., low:high]


def _is_dtensor(tensor) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def _local(param):
    """The tensor a member's rows are stored in: a tensor-parallel DTensor's local shard (the object itself, as
    transformers' loader reads it), else the Parameter."""
    return param._local_tensor if _is_dtensor(param) else param


def _tp_forwards(members: list, params: list) -> tuple[tuple | None, str | None]:
    """For members whose weights are DTensors: ((style, mesh) per member, None) when each member's forward is the one
    transformers' tensor parallelism installed around ``nn.Linear.forward``, all by one ``ColwiseParallel`` style
    object on one mesh, every weight and bias sharded on its output rows (``Shard(0)``: the local output is the
    product of the local rows); else (None, why not)."""
    from transformers.integrations.tensor_parallel import ColwiseParallel
    wraps = []
    for member in members:
        forward = member.__dict__.get("forward")
        if forward is None or not getattr(forward, "__qualname__", "").endswith("install_forward.<locals>.tp_forward"):
            return None, "a member's forward is not transformers' tensor-parallel one"
        found = inspect.getclosurevars(forward).nonlocals
        style, mesh, inner = found.get("self"), found.get("mesh"), found.get("original_forward")
        if getattr(inner, "__func__", None) is not nn.Linear.forward or inner.__self__ is not member:
            return None, "a member's tensor-parallel forward wraps something else than its nn.Linear forward"
        wraps.append((style, mesh))
    style, mesh = wraps[0]
    if type(style) is not ColwiseParallel:
        return None, f"sharded {type(style).__name__}, not colwise"
    if any(s is not style or m != mesh for s, m in wraps):
        return None, "its members do not share one colwise plan and mesh"
    layout = style.output_layouts
    if not (type(layout) is Shard and layout.dim == -1 and style.use_local_output):
        # (a gathered output, colwise_rep: each member gathers its own columns; not a layout fused here)
        return None, f"its colwise output is {layout!r}, not each rank's own columns (Shard(-1))"
    for p in params:
        placement = p.placements[0] if len(p.placements) == 1 else None
        if p.device_mesh != mesh or type(placement) is not Shard or placement.dim % p.ndim != 0:
            return None, f"a weight is placed {tuple(p.placements)}, not Shard(0) on the plan's mesh"
        if type(p._local_tensor) is not torch.Tensor:
            return None, f"a local shard is a {type(p._local_tensor).__name__}"
    return tuple(wraps), None


def _eligible(module: nn.Module, names: tuple, shared: set, where: str) -> tuple[bool, tuple | None]:
    """(fusable, the members' tensor-parallel (style, mesh) or None): all of ``names`` are plain ``nn.Linear``
    children with plain, unshared Parameters (or colwise-sharded DTensors: :func:`_tp_forwards`) alike in device,
    dtype, input width and bias (wrappers such as PEFT's LoRA, quantized linears, other tensor subclasses, meta and
    offloaded weights, tied weights are left as they are; a sharded group that is not fused says why, once)."""
    members = [getattr(module, name, None) for name in names]
    if any(type(m) is not nn.Linear or hasattr(m, "_hf_hook") for m in members):
        return False, None
    params = [m.weight for m in members] + [m.bias for m in members if m.bias is not None]
    if any(id(p) in shared for p in params):
        return False, None
    sharded = [_is_dtensor(p) for p in params]
    wraps = None
    if any(sharded):
        wraps, reason = _tp_forwards(members, params) if all(sharded) else (None, "some of its weights are sharded")
        if reason is not None:
            log_once(("fuse_projections tensor parallel", names, reason), logging.INFO,
                     "fuse_projections: %s of %s (and any other group refused alike) left unfused under tensor "
                     "parallelism: %s.", "/".join(names), where, reason)
            return False, None
        params = [_local(p) for p in params]
    elif any(type(p) is not nn.Parameter for p in params):
        return False, None
    if any(p.is_meta or p.layout != torch.strided for p in params):
        return False, None
    first = params[0]
    fusable = (first.dtype in _DTYPES
               and all(p.device == first.device and p.dtype == first.dtype for p in params)
               and all(m.in_features == members[0].in_features for m in members)
               and len({m.bias is None for m in members}) == 1)
    return fusable, wraps


def _stack(params: list) -> tuple[torch.Tensor, tuple]:
    """One buffer holding ``params`` one after another along dim 0 (copied in), each Parameter's (or local shard's)
    ``data`` then set to its slice (the object, its requires_grad and its hooks kept; its old storage freed)."""
    first = params[0]
    buffer = torch.empty((sum(p.shape[0] for p in params), *first.shape[1:]), dtype=first.dtype, device=first.device)
    rows, low = [], 0
    with torch.no_grad():
        for p in params:
            high = low + p.shape[0]
            buffer[low:high].copy_(p)
            p.data = buffer[low:high]
            rows.append((low, high))
            low = high
    return buffer, tuple(rows)


@contextlib.contextmanager
def serving():
    """The extent of one cascade generate call: its forwards (prefill and decode steps) take the fused products."""
    global _serving, _serving_calls
    with _lock:
        _serving_calls += 1
        _serving = True
    try:
        yield
    finally:
        with _lock:
            _serving_calls -= 1
            _serving = _serving_calls > 0


def fuse(model: nn.Module) -> int:
    """Fuse every eligible group of ``model`` (see the module docstring); the number of groups fused now (0 on a
    second call). Peak memory: one group's weights more while it is copied."""
    with _lock:
        return _fuse(model)


def _fuse(model: nn.Module) -> int:
    counts = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    shared = {key for key, n in counts.items() if n > 1}
    fused = 0
    for name, module in model.named_modules():
        for names in GROUPS:
            if (names[0] == "q_proj" and _CROSS.search(name)) or _ENCODER.search(name):
                continue
            eligible, wraps = _eligible(module, names, shared, name)
            if not eligible:
                continue
            members = [getattr(module, n) for n in names]
            weight, rows = _stack([_local(m.weight) for m in members])
            bias = _stack([_local(m.bias) for m in members])[0] if members[0].bias is not None else None
            group = _Group(name, names, members, weight, bias, rows, [] if wraps is not None else None)
            for index, member in enumerate(members):
                member._fused_group, member._fused_index = group, index
                if wraps is None:
                    member.__class__ = _FusedLinear
                    continue
                # transformers' style installs its forward again, now around _FusedLinear's: the input and output
                # handling (and the local shards swapped in) stay its own
                style, mesh = wraps[index]
                saved = member.__dict__.pop("forward")
                member.__class__ = _FusedLinear
                style.install_forward(member, mesh)
                group.forwards.append((saved, member.__dict__["forward"]))
            fused += 1
    return fused


def fused_groups(model: nn.Module) -> int:
    """How many fused groups ``model`` holds now (each a q/k/v or gate/up product, a rank's under tensor
    parallelism)."""
    return len(_groups(model)[0])


def _groups(model: nn.Module) -> tuple[list, set]:
    """The fused groups whose members are found in ``model``, and the ids of the members found."""
    groups, present = {}, set()
    for module in model.modules():
        if type(module) is _FusedLinear:
            groups[id(module._fused_group)] = module._fused_group
            present.add(id(module))
    return list(groups.values()), present


def _views(param, buffer: torch.Tensor, rows: tuple) -> bool:
    """``param`` is still rows ``rows`` of ``buffer`` (not a copy of them, not another dtype or device)."""
    low, high = rows
    return (param is not None and param.dtype == buffer.dtype and param.device == buffer.device
            and param.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            and param.storage_offset() == buffer.storage_offset() + low * buffer.stride(0)
            and param.shape == buffer[low:high].shape and param.stride() == buffer.stride())


def _broken(group: _Group, present: set) -> str | None:
    """Why ``group`` no longer holds (a member gone from the model or moved off the buffer), or None."""
    for name, ref, rows in zip(group.names, group.members, group.rows):
        member = ref()
        name = f"{group.where}.{name}" if group.where else name
        if member is None or id(member) not in present or type(member) is not _FusedLinear:
            return f"{name} is no longer in the model"
        if not _views(_local(member.weight), group.weight, rows):
            return f"{name}.weight is no longer a view of its fused buffer (model.to(), a new Parameter, ...)"
        if (member.bias is None) != (group.bias is None) or (group.bias is not None
                                                              and not _views(_local(member.bias), group.bias, rows)):
            return f"{name}.bias is no longer a view of its fused buffer"
    return None


def check(model: nn.Module) -> bool:
    """Whether every fused group of ``model`` still holds. If one does not, unfuse the whole model (the reason
    logged once) and return False; a model with nothing fused returns True."""
    with _lock:
        groups, present = _groups(model)
        reason = next((r for r in (_broken(g, present) for g in groups) if r is not None), None)
        if reason is None:
            return True
        _unfuse(groups)
    log_once(("fuse_projections undone", reason), logging.WARNING,
             "fuse_projections: unfused the model's projections: %s. A later generate call fuses them "
             "again (unless fuse_projections=False).", reason)
    return False


def unfuse(model: nn.Module) -> None:
    """Give every member of ``model``'s fused groups its own storage again (a member still on its buffer gets a copy
    of its rows; one that moved off it keeps what it has) and its ``nn.Linear`` class back; a member no longer in
    the model too."""
    with _lock:
        _unfuse(_groups(model)[0])


def _unfuse(groups: list) -> None:
    for group in groups:
        with torch.no_grad():
            for index, (ref, rows) in enumerate(zip(group.members, group.rows)):
                member = ref()
                if member is None or getattr(member, "_fused_group", None) is not group:
                    continue
                for param, buffer in ((member.weight, group.weight), (member.bias, group.bias)):
                    if param is not None and buffer is not None and _views(_local(param), buffer, rows):
                        _local(param).data = _local(param).data.clone()
                if group.forwards is not None:
                    saved, installed = group.forwards[index]
                    if member.__dict__.get("forward") is installed:       # transformers' own forward back
                        member.forward = saved
                # a forward running in another thread meanwhile still finds the group's buffers (its values), so
                # they are not dropped here: the group goes with its last reference
                member.__class__ = nn.Linear
                del member._fused_group, member._fused_index
        group.stash = None
