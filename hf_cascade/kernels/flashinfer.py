"""FlashInfer backend: the step's cascade as FlashInfer paged-attention wrappers.

Level 0 (each group's queries against the group's shared prefix, non-causal) runs as one
``BatchPrefillWithPagedKVCacheWrapper`` whose requests are the groups (all query tokens of all the
group's rows, GQA heads packed by the kernel). Level 1 (each row against its own suffix pages) runs
as a tensor-core ``BatchDecodeWithPagedKVCacheWrapper`` when the step has one query token per row,
else as a causal ``BatchPrefillWithPagedKVCacheWrapper`` (FlashInfer aligns the causal mask
bottom-right, which is exactly the plan's ``q_limit`` when no new token is padding). The two
partial states are merged with ``merge_state_in_place`` (fp32 LSE, base 2).

``MODE = "multilevel"`` uses FlashInfer's ``MultiLevelCascadeAttentionWrapper(2, ...)`` instead,
for steps where every row belongs to a prefix group (other steps use the two wrappers).

The wrappers are planned once per step (by the first layer) from the plan's host arrays and kept in the
step's metadata (:class:`FlashInferMetadata`, which the step context holds); every layer then only calls
``run``. Wrapper objects and the 128 MB float workspace are created once per device and thread and reused across
steps: a wrapper holds its last plan, so two threads' concurrent steps each plan and run their own (a workspace per
thread that runs FlashInfer steps; freed with the thread).

Importing this module imports FlashInfer; an ImportError here makes ``backend="auto"`` fall
through to the next backend with one log line.
"""
from __future__ import annotations

import inspect
import threading

import numpy as np
import torch

# absolute: tests load this file alone, under another name, with a stand-in flashinfer
from hf_cascade.kernels.base import AttentionParams, Backend, is_quantized

try:
    import flashinfer as _fi
except Exception as err:  # noqa: BLE001  (a broken install raises more than ImportError)
    raise ImportError(f"flashinfer is not installed or failed to import ({err.__class__.__name__}: {err}); "
                      "install it with: pip install 'hf_cascade[flashinfer]'") from err

MIN_VERSION = "0.2.0.post1"
TESTED_VERSION = "0.7.2.post1"


def _version_tuple(text: str):
    try:
        from packaging.version import Version
        return Version(text)
    except Exception:  # noqa: BLE001  (no packaging, or an unparsable local version)
        import re
        nums = [int(x) for x in re.findall(r"\d+", text)[:4]]
        return tuple(nums + [0] * (4 - len(nums)))


VERSION = str(getattr(_fi, "__version__", "0"))
if _version_tuple(VERSION) < _version_tuple(MIN_VERSION):
    raise ImportError(f"flashinfer {VERSION} is too old: hf_cascade needs flashinfer >= {MIN_VERSION} "
                      f"(plan/run wrappers, base-2 LSE; tested with {TESTED_VERSION}). "
                      "Upgrade with: pip install 'hf_cascade[flashinfer]'")

__all__ = ["FlashInferBackend", "BACKEND", "MODE", "WORKSPACE_BYTES", "HEAD_DIMS"]

# "two_wrappers": level 0 and level 1 as separate wrappers + merge_state_in_place (default).
# "multilevel": FlashInfer's MultiLevelCascadeAttentionWrapper(2, ...) when every row is in a group.
MODE = "two_wrappers"
WORKSPACE_BYTES = 128 * 1024 * 1024
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)

# per thread: {"workspaces": device -> workspace, "slots": (config..., role) -> _Slot}
_per_thread = threading.local()


def _thread_state(name: str) -> dict:
    state = getattr(_per_thread, name, None)
    if state is None:
        state = {}
        setattr(_per_thread, name, state)
    return state


class _Slot:
    """One reusable FlashInfer wrapper and the identity of the plan it was last planned for."""

    __slots__ = ("wrapper", "token")

    def __init__(self, wrapper):
        self.wrapper = wrapper
        self.token = None


def _workspace(device: torch.device) -> torch.Tensor:
    key, workspaces = str(device), _thread_state("workspaces")
    ws = workspaces.get(key)
    if ws is None:
        # zero-initialised: the decode wrapper asks for a zeroed buffer on first use
        ws = workspaces[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return ws


def _slot(config: tuple, role: str) -> _Slot:
    """This thread's wrapper for ``role`` under ``config`` (device first), created once and reused across steps."""
    key, slots = config + (role,), _thread_state("slots")
    slot = slots.get(key)
    if slot is None:
        device = torch.device(config[0])
        ws = _workspace(device)
        if role == "multilevel":
            wrapper = _fi.MultiLevelCascadeAttentionWrapper(2, ws, "NHD")
        elif role == "suffix_decode":
            wrapper = _fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        else:  # "prefix", "suffix_prefill"
            wrapper = _fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        slot = slots[key] = _Slot(wrapper)
    return slot


def _decode_returns_lse() -> bool:
    try:
        return "return_lse" in inspect.signature(_fi.BatchDecodeWithPagedKVCacheWrapper.run).parameters
    except (TypeError, ValueError, AttributeError):
        return False


_DECODE_LSE = _decode_returns_lse() if hasattr(_fi, "BatchDecodeWithPagedKVCacheWrapper") else False


# --------------------------------------------------------------------------- support check

def _plan_reason(plan) -> str | None:
    """Why the step's plan cannot run here (on the host; the step context asks once per step and layer shape)."""
    if plan.src_index is not None:
        return ("padding among this step's new tokens (q_limit is not plain bottom-right causal, "
                "which is the only causal mask FlashInfer's paged wrappers take here)")
    lim = np.asarray(plan.q_limit, dtype=np.int64)
    if lim.ndim != 2 or lim.shape[1] != plan.q_len:
        return f"q_limit of shape {lim.shape} does not match q_len {plan.q_len}"
    if lim.size:
        last = lim[:, -1:]
        expected = last - np.arange(plan.q_len - 1, -1, -1, dtype=np.int64)[None, :]
        if (lim[:, 0] < 1).any() or not np.array_equal(lim, expected):
            return "q_limit is not bottom-right causal with every query seeing its own token"
    return None


def _unsupported(q, pool, plan):
    """Beyond the declared dtypes, head dims and device: None when FlashInfer can run this step; otherwise why not
    (pool, GQA, padding)."""
    if pool.dtype != q.dtype:
        return f"KV pool dtype {pool.dtype} differs from the query dtype {q.dtype}"
    if len(q.shape) != 4 or len(pool.shape) != 5 or pool.shape[1] != 2:
        return (f"unexpected shapes q {tuple(q.shape)} / pool {tuple(pool.shape)} "
                "(want [R, Lq, Hq, D] / [num_blocks, 2, block_size, Hkv, D])")
    D = q.shape[-1]
    if pool.shape[-1] != D:
        return f"KV head_dim {pool.shape[-1]} differs from the query head_dim {D}"
    Hq, Hkv = q.shape[2], pool.shape[3]
    if Hkv == 0 or Hq % Hkv:
        return f"num query heads {Hq} is not a multiple of num KV heads {Hkv}"
    reason = None if plan is None else _plan_reason(plan)
    if reason is not None:
        return reason
    if pool.device != q.device:
        return f"KV pool on {pool.device} but queries on {q.device}"
    if pool.stride(-1) != 1 or pool.stride(-2) != D:
        return "KV pool's [Hkv, D] slices are not contiguous"
    return None


# --------------------------------------------------------------------------- per-step planning

def _cpu_i32(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))


def _pages(lengths: np.ndarray, table: np.ndarray, block_size: int, num_blocks: int, what: str):
    """indptr, indices, last_page_len (int32 CPU tensors) for requests of ``lengths`` tokens laid out in
    ``table``'s leading blocks (every length >= 1)."""
    lengths = lengths.astype(np.int64)
    npages = -(-lengths // block_size)
    if npages.size and int(npages.max()) > table.shape[1]:
        raise ValueError(f"{what}: a length needs more blocks than its table holds")
    used = np.arange(table.shape[1])[None, :] < npages[:, None]
    indices = table[used]                                    # row-major: each request's pages in order
    if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= num_blocks):
        raise ValueError(f"{what}: block id outside [0, {num_blocks}) in a used table entry")
    indptr = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(npages, out=indptr[1:])
    last = lengths - (npages - 1) * block_size
    return _cpu_i32(indptr), _cpu_i32(indices), _cpu_i32(last)


class _Step:
    """What one step needs per layer: planned wrappers and index tensors on the device."""

    def __init__(self):
        self.kind = "two"
        self.owned: list = []          # (slot, token) pairs this step planned
        self.prefix = None             # _Slot or None (no level 0)
        self.suffix = None             # _Slot
        self.suffix_decode = False
        self.tok = None                # long [n0] tokens of level 0 in group order; None: all tokens in order
        self.n0 = 0
        self.multi = None              # _Slot (multilevel)

    def valid(self) -> bool:
        return all(slot.token is token for slot, token in self.owned)

    def own(self, slot: _Slot):
        token = object()
        slot.token = token
        self.owned.append((slot, token))


def _build(q, pool, plan, scale, config) -> _Step:
    R, Lq, Hq, D = q.shape
    N, _, bs, Hkv, _ = pool.shape
    device = q.device
    dtype = q.dtype
    step = _Step()

    # level 0: groups with a non-empty prefix and at least one row
    group_rows = np.asarray(plan.group_rows)
    prefix_len = np.asarray(plan.prefix_len, dtype=np.int64)
    counts = (group_rows >= 0).sum(axis=1)
    keep = (prefix_len > 0) & (counts > 0)
    gr = group_rows[keep]
    rows = gr[gr >= 0].astype(np.int64)                      # rows in group order
    if rows.size and (rows.min() < 0 or rows.max() >= R or np.unique(rows).size != rows.size):
        raise ValueError("group_rows must name each row at most once, within [0, R)")
    qo_indptr0 = np.zeros(int(keep.sum()) + 1, dtype=np.int64)
    np.cumsum(counts[keep] * Lq, out=qo_indptr0[1:])
    kv0 = None
    if rows.size:
        kv0 = _pages(prefix_len[keep], np.asarray(plan.prefix_table)[keep], bs, N, "prefix")

    # level 1: every row's suffix, its length is the last query's limit
    suffix_len = np.asarray(plan.q_limit, dtype=np.int64)[:, -1]
    if (suffix_len < Lq).any():
        raise ValueError("every row's suffix must hold at least the step's query tokens (q_limit[:, -1] >= q_len)")
    identity = rows.size == R and np.array_equal(rows, np.arange(R))
    tok_np = (rows[:, None] * Lq + np.arange(Lq)[None, :]).reshape(-1)

    causal = Lq > 1
    common = dict(causal=False, sm_scale=scale, q_data_type=dtype, kv_data_type=dtype)

    if MODE == "multilevel" and rows.size == R:
        # one flattened q for both levels: rows in group order so each group is a contiguous qo range
        kv1 = _pages(suffix_len[rows], np.asarray(plan.suffix_table)[rows], bs, N, "suffix")
        qo_indptr1 = _cpu_i32(np.arange(R + 1, dtype=np.int64) * Lq)
        slot = _slot(config, "multilevel")
        slot.wrapper.plan([_cpu_i32(qo_indptr0), qo_indptr1], [kv0[0], kv1[0]], [kv0[1], kv1[1]],
                          [kv0[2], kv1[2]], Hq, Hkv, D, bs, causal=causal, sm_scale=scale,
                          q_data_type=dtype, kv_data_type=dtype)
        step.kind = "multi"
        step.multi = slot
        step.own(slot)
        step.tok = None if identity else torch.from_numpy(tok_np).to(device)
        return step

    if rows.size:
        slot = _slot(config, "prefix")
        slot.wrapper.plan(_cpu_i32(qo_indptr0), kv0[0], kv0[1], kv0[2], Hq, Hkv, D, bs, **common)
        step.prefix = slot
        step.own(slot)
        step.n0 = int(tok_np.size)
        step.tok = None if identity else torch.from_numpy(tok_np).to(device)

    kv1 = _pages(suffix_len, np.asarray(plan.suffix_table), bs, N, "suffix")
    if Lq == 1 and _DECODE_LSE:
        slot = _slot(config, "suffix_decode")
        slot.wrapper.plan(kv1[0], kv1[1], kv1[2], Hq, Hkv, D, bs,
                          sm_scale=scale, q_data_type=dtype, kv_data_type=dtype)
        step.suffix_decode = True
    else:
        slot = _slot(config, "suffix_prefill")
        slot.wrapper.plan(_cpu_i32(np.arange(R + 1, dtype=np.int64) * Lq), kv1[0], kv1[1], kv1[2],
                          Hq, Hkv, D, bs, **{**common, "causal": causal})
    step.suffix = slot
    step.own(slot)
    return step


# --------------------------------------------------------------------------- the backend

class FlashInferMetadata:
    """One step's planned wrappers for layers of one shape: the plan's host arrays, and a :class:`_Step` per
    (query tokens, scale), planned by the first layer that needs it."""

    def __init__(self, plan):
        self.plan = plan
        self.steps: dict = {}


class FlashInferBackend(Backend):
    """FlashInfer's paged wrappers (float16/bfloat16, head_dim 64/128/256, CUDA; no quirks; planned on the host
    every step, so not graph-safe)."""

    name = "flashinfer"
    dtypes = DTYPES
    head_dims = HEAD_DIMS
    devices = ("cuda",)
    # a cascade pays once it saves this many token reads per layer (sum of (rows - 1) x prefix tokens):
    # FlashInfer's full-table tensor-core decode beat its two-wrapper cascade at every prefix up to 1k
    # tokens, 8 prompts x 16 beams (123k saved) included, and lost to it at 16k, 8 x 8 (917k); H200,
    # benchmarks/RESULTS.md
    min_saved_tokens = 262144

    def _unsupported(self, q, pool, plan):
        return _unsupported(q, pool, plan)

    def build(self, plan, q, pool, params: AttentionParams | None = None) -> FlashInferMetadata:
        return FlashInferMetadata(plan)

    def forward(self, q, pool, metadata: FlashInferMetadata, params: AttentionParams):
        """One layer's cascade attention for one step: q [R, Lq, Hq, D] -> o [R, Lq, Hq, D] (q.dtype)."""
        reason = self.refusal(params)     # (select never hands it a layer it refuses)
        if reason is not None:
            raise NotImplementedError(f"the flashinfer backend: {reason}")
        if is_quantized(pool):     # (kv_dtypes declares none: select never hands it one)
            raise NotImplementedError(f"the flashinfer backend reads K/V in the model's dtype only, not {pool.dtype}: "
                                      "use CascadeConfig(kv_dtype=None), or backend='cuda' / 'reference'")
        R, Lq, Hq, D = q.shape
        N, _, bs, Hkv, _ = pool.shape
        if R * Lq == 0:
            return q.new_zeros(R, Lq, Hq, D)
        scale = float(params.scale)
        config = (str(q.device), q.dtype, Hq, Hkv, D, bs)
        key = config + (Lq, scale, MODE)
        step = metadata.steps.get(key)
        if step is None or not step.valid():    # first layer of the step (or another plan re-planned the wrappers)
            step = metadata.steps[key] = _build(q, pool, metadata.plan, scale, config)

        qf = q.reshape(R * Lq, Hq, D).contiguous()

        if step.kind == "multi":
            if step.tok is None:
                return step.multi.wrapper.run(qf, pool).view(R, Lq, Hq, D)
            out = step.multi.wrapper.run(qf.index_select(0, step.tok), pool)
            o = torch.empty_like(qf)
            o.index_copy_(0, step.tok, out)
            return o.view(R, Lq, Hq, D)

        o1, lse1 = step.suffix.wrapper.run(qf, pool, return_lse=True)
        if step.prefix is not None:
            q0 = qf if step.tok is None else qf.index_select(0, step.tok)
            o0, lse0 = step.prefix.wrapper.run(q0, pool, return_lse=True)
            if step.tok is None:
                _fi.merge_state_in_place(o1, lse1, o0, lse0)
            else:   # merge only the grouped rows' tokens: never merges an empty segment
                o1s = o1.index_select(0, step.tok)
                l1s = lse1.index_select(0, step.tok)
                _fi.merge_state_in_place(o1s, l1s, o0, lse0)
                o1.index_copy_(0, step.tok, o1s)
        return o1.view(R, Lq, Hq, D)


BACKEND = FlashInferBackend()
