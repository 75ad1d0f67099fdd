"""One generate call's owner: :class:`DecodeSession`.

A session holds, for one call, everything that lives from the prefill to the end of the decode loop:

- the :class:`~hf_cascade.cache.CascadeCache` the decode steps run on: the caller's, or one the call owns
  (taken from what the model's last call kept, else new), claimed against another thread's call on it;
- the cache's static decode layout (``begin_decode`` / ``end_decode``);
- the step runner the decode loop calls (:class:`~hf_cascade.graphs.DecodeGraphRunner`: eager, captured or
  compiled), chosen by a :class:`GraphDescriptor` (what a captured graph depends on);
- what is kept for the model's next call (:class:`KeptCall`: the emptied cache and its runner, in one registry
  weakly keyed by model; :func:`release` drops it); for an encoder-decoder call
  also its strategy's state (the cross-attention storages and context), reused only where everything matches;
- the end of the call on every exit path (exceptions, KeyboardInterrupt): the cache reset, kept, or (the
  caller's) left with its tokens.

What fills the cache before the decode loop is the session's :class:`DecodeStrategy`: the decoder-only prefill
(prefill once + fork, :mod:`hf_cascade.generation`) or the encoder side of an encoder-decoder call
(:mod:`hf_cascade.encoder_decoder`).

The capture guard is process-wide (:data:`capture_guard`): generate calls whose decode steps may be captured as a
CUDA graph run one at a time (the generate patch enters :func:`capturing_call` for the whole call), and a capture
holds the pools' memory (:data:`hf_cascade.memory.capture_hold`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import weakref
from typing import Callable, Protocol

import torch

from . import graphs
from ..kv import memory
from .. import precision
from ..kv.cache import CascadeCache
from ..config import CascadeConfig
from ..logs import log_once

# guards _kept and _in_use (generate may run in several threads)
_lock = threading.Lock()


# ---- the capture guard ------------------------------------------------------------------------------------
class CaptureGuard:
    """Generate calls whose decode steps may be captured run one at a time in the process: while one thread
    captures, a kernel that another thread launches on the legacy default stream (its prefill, the encoder,
    transformers' token choice) is an illegal operation on the capturing stream ("operation not permitted when
    stream is capturing", seen on the H200). Captures also share torch's capture stream and the runner's warm-up
    streams, and torch.cuda.graph empties the allocator's cache as it begins."""

    def __init__(self):
        self._calls = threading.RLock()     # re-entrant: the whole call holds it, its captures take it again

    def call(self, model, cascade_config) -> contextlib.AbstractContextManager:
        """The context of one generate call: the lock where its decode steps may be captured, nothing otherwise
        (CPU calls, the runner's eager form)."""
        cascade_config = CascadeConfig.coerce(cascade_config)
        if cascade_config.cuda_graphs == "eager" or graphs.unsupported_reason(model, cascade_config) is not None:
            return contextlib.nullcontext()
        return self._calls

    @contextlib.contextmanager
    def capturing(self):
        """From a capture's warm-up to its end: the lock, and no background KV mapping (a driver call from the
        worker thread can invalidate a capture, and a pool that grew in between would hand it other views)."""
        with self._calls, memory.capture_hold.held():
            yield


capture_guard = CaptureGuard()


def capturing_call(model, cascade_config) -> contextlib.AbstractContextManager:
    """:meth:`CaptureGuard.call` of the process's guard (the generate patch's entry)."""
    return capture_guard.call(model, cascade_config)


# ---- what a captured graph depends on -----------------------------------------------------------------------
class _ModelRef(weakref.ref):
    """The model, weakly (what is kept must not keep a deleted model alive); equal for the same live model."""

    def __eq__(self, other):
        mine = self()
        return isinstance(other, _ModelRef) and mine is not None and mine is other()

    __hash__ = None


@dataclasses.dataclass(frozen=True, eq=True)
class GraphDescriptor:
    """What a call's decode graph depends on. Equal descriptors: a kept graph replays from the first decode step
    (the runner still re-captures when the step's inputs, layout or pools' addresses differ). Equal but for the
    rows (:meth:`fits_pools`): the kept cache and runner serve, the graph is captured anew."""

    model: _ModelRef
    encoder_decoder: bool
    rows: int
    dtype: torch.dtype | None
    device: str
    cascade_config: CascadeConfig      # every field: pools (memory, block size, cap), plan thresholds, backend, mode
    autocast: tuple = (False, None)    # the casts a captured step baked in (precision.state)
    hooks: str | None = None           # forward hooks the steps must run (graphs.inner_hooks_reason): eager steps
    outer_hooks: str | None = None     # hooks on the model (graphs.outer_hooks_reason): eager, through __call__

    @classmethod
    def of(cls, model, cascade_config: CascadeConfig, rows: int) -> "GraphDescriptor":
        try:
            dtype, device = model.dtype, str(model.device)
        except (AttributeError, StopIteration):       # no parameters: graphs are refused for it anyway
            dtype, device = None, ""
        return cls(_ModelRef(model), bool(getattr(model.config, "is_encoder_decoder", False)), int(rows), dtype,
                   device, cascade_config, precision.state(device), graphs.inner_hooks_reason(model),
                   graphs.outer_hooks_reason(model))

    @property
    def eager_reason(self) -> str | None:
        """Why the steps run eagerly whatever the config says (None: captured and compiled as it says)."""
        return self.hooks or self.outer_hooks

    @property
    def capture(self) -> bool:
        return self.cascade_config.cuda_graphs != "eager" and self.eager_reason is None

    @property
    def compile(self) -> bool | str:
        return self.cascade_config.compile if self.eager_reason is None else False

    def fits_pools(self, other: "GraphDescriptor") -> bool:
        return dataclasses.replace(self, rows=other.rows) == other


# ---- what is kept for the model's next call ---------------------------------------------------------------
@dataclasses.dataclass
class KeptCall:
    """An owned cache emptied for reuse (its pools' addresses and last layout kept) and the runner whose graph
    points at them. Holds nothing of the model (the runner is detached, the descriptor weak)."""

    descriptor: GraphDescriptor
    cache: CascadeCache
    runner: "graphs.DecodeGraphRunner"
    # an encoder-decoder call's strategy's own kept state (its cross-attention storages and step context: the graph
    # reads them too) and what it fits (DecodeStrategy.keep_key); None for a decoder-only call
    extra: object = None
    extra_key: object = None

    def release(self) -> None:
        self.runner.release()           # (the graphs first: they point at the pools)
        self.cache.free_memory()        # what keep_kv_bytes keeps mapped too: release gives it back
        if self.extra is not None:
            self.extra.release()


# model -> its last call's KeptCall (a kept state serves one call: a concurrent call makes its own)
_kept: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def release(model=None) -> None:
    """Drop what generate keeps for ``model``'s next call (its cache's reserved pools, decode buffers and
    captured graph); the next call captures again. ``None``: for every model."""
    with _lock:
        kept = [_kept.pop(each, None) for each in (list(_kept) if model is None else [model])]
    for each in kept:
        if each is not None:
            each.release()


def _take_kept_exact(model, descriptor: GraphDescriptor, extra_key, fits=None) -> KeptCall | None:
    """An encoder-decoder call's kept state where everything it was kept for matches (the descriptor and the
    strategy's ``keep_key``: cross-attention geometry, decoder prompt) and ``fits(kept.extra)`` says it serves the
    call (the strategy's ``fits``: sources its cross storages take in place); anything else is freed and None
    returned (never a partial reuse: the captured step reads the cross storages, whose addresses no runner key
    covers)."""
    with _lock:
        kept = _kept.pop(model, None)
    if kept is None:
        return None
    if (kept.extra is not None and extra_key is not None and kept.descriptor == descriptor
            and kept.extra_key == extra_key and kept.cache.get_seq_length() == 0
            and (fits is None or fits(kept.extra))):
        return kept
    kept.release()
    return None


def _take_kept(model, descriptor: GraphDescriptor) -> tuple[CascadeCache, "graphs.DecodeGraphRunner | None"]:
    """The cache (and runner) an owned call starts from: what the model's last call kept where it fits, so that
    its pools keep their addresses and its graph replays from the first decode step; otherwise a new cache."""
    with _lock:
        kept = _kept.pop(model, None)
    if kept is not None and kept.descriptor.fits_pools(descriptor) and kept.cache.get_seq_length() == 0:
        if kept.descriptor != descriptor:       # other rows: the graph is captured anew on the same pools
            kept.runner.release()
        return kept.cache, kept.runner
    if kept is not None:
        kept.release()
    return CascadeCache(model.config, descriptor.cascade_config), None


# ---- generate's own prefill forwards ---------------------------------------------------------------------------
# id -> (pre, post): observers of generate's own prefill forwards (register_prefill_hook)
_prefill_hooks: dict = {}


class _PrefillHookHandle:
    def __init__(self, key):
        self.key = key

    def remove(self) -> None:
        _prefill_hooks.pop(self.key, None)


def register_prefill_hook(pre=None, post=None) -> _PrefillHookHandle:
    """Observe generate's own once-per-prompt prefill forwards, which run ``model.forward`` without the hooks on the
    model (those run once per chosen token, as in stock's loop): ``pre(model, kwargs)`` before each, ``post(model,
    kwargs, output)`` after. For measurements (rows prefilled, prefill time); returns a handle with ``remove()``."""
    handle = _PrefillHookHandle(object())
    _prefill_hooks[handle.key] = (pre, post)
    return handle


def prefill_forward(model, **kwargs):
    """One of generate's own prefill forwards: ``model.forward`` without the hooks on the model (stock's loop has no
    such forward: its hooks see one forward per chosen token), observed by :func:`register_prefill_hook`."""
    hooks = list(_prefill_hooks.values())
    for pre, _ in hooks:
        if pre is not None:
            pre(model, kwargs)
    out = model.forward(**kwargs)
    for _, post in hooks:
        if post is not None:
            post(model, kwargs, out)
    return out


# ---- the caches calls are running on --------------------------------------------------------------------------
# id(cache) -> (the thread of the call running on it, its session)
_in_use: dict = {}


def active(cache) -> "DecodeSession | None":
    """The session a generate call is running on ``cache`` now (None between calls)."""
    with _lock:
        entry = _in_use.get(id(cache))
    return None if entry is None else entry[1]


# ---- strategies ------------------------------------------------------------------------------------------------
class DecodeStrategy(Protocol):
    """What fills a session's cache before the decode loop, and releases what it made."""

    def prepare(self, cache: CascadeCache | None) -> CascadeCache | None:
        """Fill ``cache`` (the session's, or None where the strategy makes its own) for the decode loop; returns
        the CascadeCache the decode steps run on (None: they run on a dense cache, without a runner)."""

    def decoded(self, cache: CascadeCache | None) -> None:
        """After the decode loop returned (before the session ends the cache)."""

    def release(self, ok: bool) -> None:
        """At the end of the call, every exit path: give back what :meth:`prepare` made besides the cache."""

    # Optional, for a strategy whose decode step reads more than the cache (an encoder-decoder's cross-attention):
    #   keep_key: what its kept state must match for a next call to reuse it (None: it keeps nothing);
    #   fits(extra): whether a kept state of an equal keep_key serves this call (what keep_key leaves out: sources
    #   no longer than the kept call's);
    #   reuse(extra): before prepare, the kept state of the model's last call (its keep_key was equal, it fits);
    #   kept_state(): at the end of a successful call, the state to keep beside the cache and runner (an object with
    #   release()), or None (then nothing is kept); what it returns is no longer its own to release.


# ---- the session -----------------------------------------------------------------------------------------------
class DecodeSession:
    """One generate call's decode: :meth:`running` prepares the cache (the strategy), begins its decode layout and
    step runner, lets the caller run the decode loop (hf_cascade.whole_step's, which calls the runner; where the call
    cannot run there, transformers' own loop with eager forwards: :meth:`transformers_loop`), and ends the call.
    ``model.forward`` is never replaced.

    Args:
        cache: the caller's CascadeCache (``owned=False``), or None where the session owns the cache: taken from
            what the model's last call kept (``keep=True``; see :class:`GraphDescriptor`) or made by the strategy.
        rows: the decode rows (prompts x beams or samples), for the descriptor.
        keep: an owned cache whose graph was captured is kept for the model's next call when the call succeeds (an
            encoder-decoder call: with its strategy's ``kept_state()``, taken again only by a call whose descriptor
            and strategy ``keep_key`` are equal).
        hands_out: the call returns its cache to the caller (``return_dict_in_generate``): not reset or kept.
    """

    def __init__(self, model, strategy: DecodeStrategy, generation_config, rows: int, prompt_width: int,
                 cascade_config: CascadeConfig, cache: CascadeCache | None = None, keep: bool = False,
                 hands_out: bool = False):
        self.model, self.strategy, self.generation_config = model, strategy, generation_config
        self.prompt_width = prompt_width
        self.descriptor = GraphDescriptor.of(model, cascade_config, rows)
        self.owned, self.keep, self.hands_out = cache is None, keep, hands_out
        self.runner: graphs.DecodeGraphRunner | None = None
        self.runner_refusal: str | None = None     # why the call has no runner (decode_runner)
        self.capture_refusal: str | None = None    # why its runner's steps are not captured (decode_runner)
        self.mode = None                           # how the decode ran (hf_cascade.whole_step.DecodeMode)
        self._kept_runner = None
        if cache is None and keep and self.descriptor.encoder_decoder:
            # the strategy makes its caches; the last call's (cross storages, step context) only where all fits
            extra_key = getattr(strategy, "keep_key", None)
            kept = None if extra_key is None else _take_kept_exact(model, self.descriptor, extra_key,
                                                                   getattr(strategy, "fits", None))
            if kept is not None:
                cache, self._kept_runner = kept.cache, kept.runner
                strategy.reuse(kept.extra)
        elif cache is None and keep:
            cache, self._kept_runner = _take_kept(model, self.descriptor)
        self.cache = cache

    @contextlib.contextmanager
    def running(self):
        """The call's decode, for the caller's ``with`` block: the cache prepared (the strategy), its decode layout
        and runner begun; the block runs the decode loop (the caller's: the session calls nothing above it); then
        the call ends, also where the block raises (the cache emptied, nothing kept)."""
        claimed = self.cache if self._claim(self.cache) else None   # before anything that could touch another's
        ok = False
        try:
            self.cache = self.strategy.prepare(self.cache)
            self.runner = self._begin_decoding()
            yield self
            self.strategy.decoded(self.cache)
            ok = True
        finally:
            try:
                self._end(ok)
            finally:
                try:
                    self.strategy.release(ok)
                finally:
                    if claimed is not None:
                        with _lock:
                            _in_use.pop(id(claimed), None)

    def transformers_loop(self, stock: Callable[[], object]):
        """``stock()``: transformers' decode loop on the call's cache, its forwards the model's own and eager (no runner
        inside, ``model.forward`` untouched). The call's runner, if one was begun, is dropped."""
        if self.runner is not None:
            self.runner.release()
            self.runner = None
        return stock()

    def _claim(self, cache) -> bool:
        """Refuse a cache that a generate call of another thread is running on (the calls would interleave their
        rows and blocks). Returns whether this call claimed it (False: none, or an outer call of this thread
        holds it)."""
        if cache is None:
            return False
        me = threading.get_ident()
        with _lock:
            holder = _in_use.get(id(cache))
            if holder is None:
                _in_use[id(cache)] = (me, self)
                return True
        if holder[0] != me:
            raise ValueError("This CascadeCache is in use by a generate call in another thread. Give each concurrent "
                             "call its own cache (for a shared prompt, fill one and pass copy.deepcopy(cache) to "
                             "each).")
        return False

    def _begin_decoding(self):
        """The cache's static decode layouts (``max_length`` only caps their capacity, which follows the tokens
        made), and the call's runner (None where graphs cannot run, or without a cache)."""
        cache = self.cache
        if cache is None:
            return None
        cache.begin_decode(self.generation_config.max_length or self.prompt_width + 1)
        return self.decode_runner()

    def decode_runner(self):
        """A DecodeGraphRunner for this call (the kept one where it fits), or None where the call's steps cannot run on
        one (:func:`graphs.runner_reason`; transformers' loop serves it). Steps are captured (and compiled as the config
        says) where :func:`graphs.capture_reason` allows or the config asks for eager steps; otherwise (the CPU, a
        quantized layer that cannot be captured) they run eagerly, uncompiled (``capture_refusal`` says why). Called
        once per call that decodes on a CascadeCache (tests and benchmarks wrap it to see the runner)."""
        config = self.cache.cascade_config
        reason = self.runner_refusal = graphs.runner_reason(self.model, config)
        if reason is not None:
            if config.cuda_graphs is not False:
                log_once(("off", reason), logging.WARNING if config.cuda_graphs is True else logging.INFO,
                         "decode steps run without a step runner (transformers' loop, eager forwards): %s", reason)
            return None
        self.capture_refusal = None if config.cuda_graphs == "eager" else graphs.capture_reason(self.model, config)
        if self.capture_refusal is not None:
            log_once(("off", self.capture_refusal), logging.WARNING if config.cuda_graphs is True else logging.INFO,
                     "decode steps run without CUDA graphs: %s", self.capture_refusal)
        runner = self._kept_runner      # (how its steps run is logged once with the call's mode: whole_step.decode)
        if runner is None:
            as_asked = self.capture_refusal is None
            runner = graphs.DecodeGraphRunner(self.model, self.cache, capture_guard.capturing,
                                              capture=self.descriptor.capture and as_asked,
                                              compile=self.descriptor.compile if as_asked else False,
                                              through_call=self.descriptor.outer_hooks is not None)
        runner.attach(self.model)
        runner.begin_call()
        return runner

    def _end(self, ok: bool) -> None:
        """An owned cache gives its blocks back (keeping what its graph points at when a graph was captured and
        the call succeeded); the caller's (or one handed out) keeps its tokens, and the graph is dropped."""
        cache, runner = self.cache, self.runner
        if self._kept_runner is not None and self._kept_runner is not runner:
            self._kept_runner.release()          # taken for the call, then not used (graphs off after all)
        if cache is None:
            return
        if self.owned and not (ok and self.hands_out):
            # nobody else can reach an owned cache that is not handed out: every block goes back now
            extra = extra_key = None
            # (a runner whose steps could not be captured as asked keeps nothing: no graph points at the pools, and a
            # CPU call's pools go back to the allocator as stock's cache does)
            keeping = (self.keep and ok and runner is not None and runner.whole_step_kept is not None
                       and self.capture_refusal is None)
            if keeping and self.descriptor.encoder_decoder:
                extra_key = getattr(self.strategy, "keep_key", None)
                extra = None if extra_key is None else self.strategy.kept_state()
                keeping = extra is not None
            if keeping:
                cache.reset_for_reuse()
                runner.detach()
                kept = KeptCall(self.descriptor, cache, runner, extra, extra_key)
                with _lock:                     # (a concurrent call's kept state, if any, is replaced and freed)
                    _kept[self.model] = kept
            else:
                cache.reset()
                if runner is not None:
                    runner.release()
            return
        cache.end_decode()
        cache.end_step()                        # the caller's cache keeps its tokens, not the last step's context
        if runner is not None:
            runner.release()
        if not ok and not self.owned:
            cache.reset()                       # the caller's cache: empty and reusable, never half filled
