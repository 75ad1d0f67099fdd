"""Random paged layouts for the kernel tests (reference, CUDA and FlashInfer backends).

One decode/prefill step of R rows: queries ``q [R, Lq, Hq, D]``, a KV pool ``[N, 2, bs, Hkv, D]`` whose
blocks are handed out in a random permutation (unused blocks and the unused slots of partly filled
blocks hold ``garbage``, NaN by default, so a kernel that reads them shows it), groups of rows sharing
a prefix (in random row order, one group may have an empty prefix or end inside a block), rows in no
group, and each row's own suffix, whose last ``Lq`` tokens are the step's queries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from hf_cascade.context import StepContext
from hf_cascade.plan import StepPlan


@dataclass
class PagedLayout:
    q: torch.Tensor             # [R, Lq, Hq, D]
    pool: torch.Tensor          # [N, 2, bs, Hkv, D]
    group_rows: torch.Tensor    # [G, Rg] int32, -1 padded: the rows of each group
    prefix_table: torch.Tensor  # [G, Mp] int32, -1 padded (at least one -1 column)
    prefix_len: torch.Tensor    # [G] int32: prefix tokens of each group
    suffix_table: torch.Tensor  # [R, Ms] int32, -1 padded (at least one -1 column)
    q_limit: torch.Tensor       # [R, Lq] int32: suffix tokens query i of the row sees
    suffix_len: np.ndarray      # [R] tokens in each row's suffix blocks
    scale: float

    @property
    def block_size(self) -> int:
        return self.pool.shape[2]

    def plan(self) -> StepPlan:
        """The layout as the plan a backend's ``attend`` takes (its arrays share the layout's memory)."""
        return step_plan(self)

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """Each row's whole block table (its group's prefix blocks, then its own) [R, W] int32 and its
        length in tokens [R] int64, as a cache holds them (prefixes must end on a block boundary)."""
        bs = self.block_size
        R = self.q.shape[0]
        prefix = [([], 0)] * R
        for g, rows in enumerate(self.group_rows.tolist()):
            n = int(self.prefix_len[g])
            assert n % bs == 0, "tables() needs block-aligned prefixes (random_layout(aligned_prefixes=True))"
            for r in rows:
                if r >= 0:
                    prefix[r] = (self.prefix_table[g, : n // bs].tolist(), n)
        own = [[b for b in row if b >= 0] for row in self.suffix_table.tolist()]
        width = max(len(p) + len(o) for (p, _), o in zip(prefix, own)) + 1
        tables = np.full((R, width), -1, dtype=np.int32)
        for r, ((blocks, _), mine) in enumerate(zip(prefix, own)):
            tables[r, : len(blocks) + len(mine)] = blocks + mine
        lengths = np.array([n for _, n in prefix], dtype=np.int64) + self.suffix_len
        return tables, lengths


PLAN_LEVELS = ("group_rows", "prefix_table", "prefix_len", "suffix_table", "q_limit",
               "mid_group_rows", "mid_table", "mid_len", "inner_suffix_table", "inner_q_limit")


def step_plan(lay) -> StepPlan:
    """The StepPlan of a layout: a :class:`PagedLayout`, or any object with the level tables as CPU tensors
    (the middle level of a three-level layout where it has one). The plan's arrays share their memory."""
    empty = np.zeros(0, dtype=np.int64)
    levels = {name: getattr(lay, name).numpy() for name in PLAN_LEVELS if hasattr(lay, name)}
    return StepPlan(fresh=False, q_len=lay.q.shape[1], src_index=None, write_block=empty, write_offset=empty,
                    copy_src=empty, copy_dst=empty, **levels)


def random_layout(seed, *, groups=((3, 40),), lone_rows=1, suffix=(1, 20), Lq=1, Hkv=2, ratio=2, D=32, bs=4,
                  dtype=torch.float64, device="cpu", garbage=float("nan"), extra_blocks=3, random_limits=False,
                  empty_suffix_rows=0, aligned_prefixes=False, shuffle=True, q_scale=1.0,
                  q_view=False, Hq=None) -> PagedLayout:
    """A random :class:`PagedLayout`.

    Args:
        groups: ``(rows, prefix tokens)`` per group.
        lone_rows: rows in no group.
        suffix: ``(low, high)`` of the suffix lengths (at least Lq); one row gets exactly ``max(low, Lq)``.
        random_limits: each query sees a random part of its suffix (one query of each row all of it);
            otherwise query i sees the suffix up to tail token i (causal).
        empty_suffix_rows: grouped rows with an empty suffix (their queries see the prefix only).
        aligned_prefixes: cut each group's prefix to whole blocks and give the rest to every member row's
            suffix, as a cache stores a prompt whose last block is partly filled (each row its own copy).
        shuffle: rows of a group interleaved with others in random order (else in order).
        q_scale: the queries' standard deviation (large values test the softmax's range).
        q_view: ``q`` is a ``[R, Hq, Lq, D]`` tensor seen as ``[R, Lq, Hq, D]``, as attention.py passes it.
        Hq: query heads (default ``Hkv * ratio``; another value tests a backend's refusal).
    """
    rng = np.random.default_rng(seed)
    sizes = [int(n) for n, _ in groups]
    prefixes = [int(p) for _, p in groups]
    R, Hq = sum(sizes) + lone_rows, Hq or Hkv * ratio
    rows = rng.permutation(R) if shuffle else np.arange(R)
    members, at = [], 0
    for n in sizes:
        members.append(rows[at:at + n])
        at += n
    tail = [0] * len(groups)
    if aligned_prefixes:
        tail = [p % bs for p in prefixes]
        prefixes = [p - t for p, t in zip(prefixes, tail)]
    lo = max(suffix[0], Lq)
    slens = rng.integers(lo, max(suffix[1], lo) + 1, size=R)
    slens[rng.integers(R)] = lo
    grouped = np.concatenate(members) if members else np.zeros(0, dtype=np.int64)
    for r in grouped[:empty_suffix_rows]:
        slens[r] = 0
    for mem, t in zip(members, tail):
        slens[mem] += t

    nblk = lambda n: -(-int(n) // bs)  # noqa: E731
    N = sum(nblk(p) for p in prefixes) + sum(nblk(s) for s in slens) + extra_blocks
    free = list(rng.permutation(N))
    valid = np.zeros((N, bs), dtype=bool)
    G, Rg = len(groups), max(sizes, default=0)
    group_rows = np.full((G, Rg), -1, dtype=np.int32)
    prefix_table = np.full((G, max((nblk(p) for p in prefixes), default=0) + 1), -1, dtype=np.int32)
    for g, (p, mem) in enumerate(zip(prefixes, members)):
        group_rows[g, : len(mem)] = rng.permutation(mem) if shuffle else np.sort(mem)
        for j in range(nblk(p)):
            b = free.pop()
            prefix_table[g, j] = b
            valid[b, : min(bs, p - j * bs)] = True
    suffix_table = np.full((R, max(nblk(s) for s in slens) + 1), -1, dtype=np.int32)
    q_limit = np.zeros((R, Lq), dtype=np.int32)
    for r in range(R):
        s = int(slens[r])
        for j in range(nblk(s)):
            b = free.pop()
            suffix_table[r, j] = b
            valid[b, : min(bs, s - j * bs)] = True
        if s == 0:
            continue
        if random_limits:
            q_limit[r] = rng.integers(0, s + 1, size=Lq)
            q_limit[r, rng.integers(Lq)] = s
        else:
            q_limit[r] = s - Lq + 1 + np.arange(Lq)

    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(N, 2, bs, Hkv, D, generator=gen, dtype=torch.float64)
    pool = pool.masked_fill(~torch.from_numpy(valid)[:, None, :, None, None], garbage).to(device=device, dtype=dtype)
    if q_view:
        q = (q_scale * torch.randn(R, Hq, Lq, D, generator=gen, dtype=torch.float64)).to(device, dtype).transpose(1, 2)
    else:
        q = (q_scale * torch.randn(R, Lq, Hq, D, generator=gen, dtype=torch.float64)).to(device, dtype)
    t = torch.from_numpy
    return PagedLayout(q=q, pool=pool, group_rows=t(group_rows), prefix_table=t(prefix_table),
                       prefix_len=t(np.asarray(prefixes, dtype=np.int32)), suffix_table=t(suffix_table),
                       q_limit=t(q_limit), suffix_len=slens.astype(np.int64), scale=1.0 / math.sqrt(D))


def random_three_level(seed, *, sys_tokens, prompts, beams, own_tokens, suffix, lone_rows=1, Lq=1, Hkv=2, ratio=4,
                       D=128, bs=16, dtype=torch.float64, garbage=float("nan")):
    """A three-level layout as a batch of prompts sharing a system prompt holds it: all ``prompts x beams`` rows
    share ``sys_tokens`` (level 0, whole blocks), each prompt's beams its own ``own_tokens`` = (low, high) tokens
    after it (the middle level, whole blocks), each row its own suffix of ``suffix`` = (low, high) tokens (at least
    Lq, causal limits); ``lone_rows`` rows in no group read a suffix only. Rows in random order, blocks in a random
    permutation, NaN in unused slots and blocks. Returns a namespace with the level tables as CPU tensors (for
    :func:`step_plan`), q, pool and scale; the two-level ``suffix_table`` / ``q_limit`` are each row's middle
    blocks followed by its own suffix."""
    from types import SimpleNamespace
    assert sys_tokens % bs == 0
    rng = np.random.default_rng(seed)
    nblk = lambda n: -(-int(n) // bs)  # noqa: E731
    R, Hq = prompts * beams + lone_rows, Hkv * ratio
    order = rng.permutation(R)
    subgroups = [order[p * beams:(p + 1) * beams] for p in range(prompts)]
    lone = order[prompts * beams:]
    mids = [bs * nblk(rng.integers(own_tokens[0], own_tokens[1] + 1)) for _ in range(prompts)]
    lo = max(suffix[0], Lq)
    own = rng.integers(lo, max(suffix[1], lo) + 1, size=R)
    N = nblk(sys_tokens) + sum(nblk(m) for m in mids) + sum(nblk(n) for n in own) + 3
    free = iter(rng.permutation(N).tolist())
    valid = np.zeros((N, bs), dtype=bool)

    def take(n):
        ids = [next(free) for _ in range(nblk(n))]
        for j, b in enumerate(ids):
            valid[b, : min(bs, int(n) - j * bs)] = True
        return ids

    def padded(rows, width):
        out = np.full((len(rows), width), -1, dtype=np.int32)
        for i, row in enumerate(rows):
            out[i, : len(row)] = row
        return out

    sys_blocks = take(sys_tokens)
    mid_blocks = [take(m) for m in mids]
    own_blocks = [take(n) for n in own]
    mid_of = {int(r): p for p, rows in enumerate(subgroups) for r in rows}
    two_level = [(mid_blocks[mid_of[r]] if r in mid_of else []) + own_blocks[r] for r in range(R)]
    causal = own[:, None] - Lq + 1 + np.arange(Lq)[None, :]
    q_limit = causal + np.array([mids[mid_of[r]] if r in mid_of else 0 for r in range(R)])[:, None]
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(N, 2, bs, Hkv, D, generator=gen, dtype=torch.float64)
    pool = pool.masked_fill(~torch.from_numpy(valid)[:, None, :, None, None], garbage).to(dtype)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
    grouped = np.concatenate(subgroups)
    return SimpleNamespace(
        q=(1.5 * torch.randn(R, Lq, Hq, D, generator=gen, dtype=torch.float64)).to(dtype), pool=pool,
        group_rows=t(grouped[None, :]), prefix_table=t(padded([sys_blocks], len(sys_blocks) + 1)),
        prefix_len=t([sys_tokens]),
        mid_group_rows=t(np.stack(subgroups)), mid_table=t(padded(mid_blocks, max(map(len, mid_blocks)) + 1)),
        mid_len=t(mids),
        inner_suffix_table=t(padded(own_blocks, max(map(len, own_blocks)) + 1)), inner_q_limit=t(causal),
        suffix_table=t(padded(two_level, max(map(len, two_level)) + 1)), q_limit=t(q_limit),
        scale=1.0 / math.sqrt(D), lone_rows=lone)


_contexts: dict = {}


def step_context_of(plan: StepPlan) -> StepContext:
    """The step context the attention would hold for ``plan`` (one per plan): layers of one step share its backend
    metadata."""
    entry = _contexts.get(id(plan))
    if entry is None or entry[0] is not plan:
        entry = _contexts[id(plan)] = (plan, StepContext(None, plan, 0))
    return entry[1]


def padded_pairs(generator: torch.Generator, blocks: int, real: int, copies: int,
                 device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(copy_src, copy_dst) int64 [copies] over ``blocks`` block ids: ``real`` copies of distinct blocks, then a static
    step's padding: pair 0 repeated, and one block copied onto itself (last, where there is room)."""
    ids = torch.randperm(blocks, generator=generator, device=device)
    src, dst = ids[:real], ids[real:2 * real]
    pad = copies - real
    if pad:
        src = torch.cat([src, src[:1].expand(pad - 1), ids[-1:]]) if real else ids[-1:].expand(pad)
        dst = torch.cat([dst, dst[:1].expand(pad - 1), ids[-1:]]) if real else ids[-1:].expand(pad)
    return src.contiguous(), dst.contiguous()


def wide_values(shape, generator: torch.Generator, specials: int = 40) -> torch.Tensor:
    """float32 values over 10 decades (e4m3's subnormals to beyond any fp8 scale's saturation point), ``specials / 4``
    each of exact zeros, negative zeros, +inf and -inf among them: K/V that exercise an fp8 encoding's every case."""
    x = torch.randn(shape, generator=generator) * 10.0 ** (torch.rand(shape, generator=generator) * 10 - 6)
    flat = x.view(-1)
    picks = torch.randperm(flat.numel(), generator=generator)[:specials].view(4, -1)
    for row, value in zip(picks, (0.0, -0.0, float("inf"), float("-inf"))):
        flat[row] = value
    return x
