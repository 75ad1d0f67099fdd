"""The block bookkeeping kernel's algorithm (csrc/blocks.cu), emulated on the CPU (no GPU needed).

A numpy transliteration of the kernel, phase by phase as the CTA runs it: the reorder one tile of columns at a time
(every read of a tile before its writes), reference counts changed only where an entry changes; each row's
copy-on-write count over the rows before it; the ranks of the rows that take an id (the CTA scan); the pool's free ids
counted per chunk of 4096, the chunks' running totals, and only the chunks holding the first free ranks scanned id by
id; the prefix checks against the tables with each row's new entry in place; the flag; the commit; the peak from the
ids in use before the commit plus the ids taken; the copy pairs padded; the suffix tables from the committed state. It
must equal the torch ops of hf_cascade/decode/whole_step.py ``advance`` bit for bit on the cases of
tests/decode/test_gpu_device_blocks.py. This checks the algorithm only as far as the transliteration is faithful;
tests/decode/test_gpu_device_blocks.py runs the kernel.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from test_gpu_device_blocks import CASES, _drive

TILE_INTS, CHUNK = 4096, 4096           # csrc/blocks.cu: kTileInts, kChunk (4 ids a thread of 1024)


def _emulated(b, plan, parents, done, peak) -> None:
    """csrc/blocks.cu's kernel on DeviceBlocks ``b``, DevicePlan ``plan`` (CPU tensors, changed in place)."""
    T, L, C = b.tables.numpy(), b.lengths.numpy(), b.refcount.numpy()
    R, W = T.shape
    P, bs = b.pool_blocks, b.block_size
    par = parents.numpy()
    rows = np.arange(R)
    live = int(b.flags) == 0

    # 1. the reorder
    length = L[par].copy() if live else L.copy()
    if live:
        L[:] = length
        cols = TILE_INTS // R
        for c0 in range(0, W, cols):
            tile = T[:, c0:c0 + cols].copy()                      # (read, then a barrier, then the writes)
            now, old = tile[par], tile
            changed = now != old
            T[:, c0:c0 + cols] = np.where(changed, now, old)
            for ids, delta in ((now, 1), (old, -1)):             # (atomics: only where an entry changed)
                hit = changed & (ids >= 0) & (ids < P)
                np.add.at(C, ids[hit], delta)

    # 2. each row's append
    partial = length % bs != 0
    v = T[rows, np.minimum(np.maximum(length - 1, 0) // bs, W - 1)]
    last = np.where((v >= 0) & (v <= P), v, P)
    col = np.minimum(length // bs, W - 1)
    kept = T[rows, col].copy()
    last_s = np.where(partial, last, -1)
    same = np.array([(last_s[:t] == last[t]).sum() if partial[t] else 0 for t in rows])
    last_count = np.where(partial, C[last], 0)
    cow = partial & (last_count - same > 1)
    need = cow | ~partial
    rank, slot = np.cumsum(need) - need, np.cumsum(cow) - cow    # (exclusive scans)
    n_need, n_cow = int(need.sum()), int(cow.sum())

    # 3. the pool's free ids: chunk counts, their running totals, then the chunks holding ranks < target
    chunks = -(-P // CHUNK)
    counts = np.array([(C[c * CHUNK:min(P, (c + 1) * CHUNK)] == 0).sum() for c in range(chunks)])
    positives = int((C[:P] > 0).sum())
    ends = np.cumsum(counts)
    total_free = int(ends[-1])
    target = min(n_need, total_free)
    free_ids = np.zeros(max(target, 1), dtype=np.int64)
    found, visited = 0, 0
    while found < target:
        lo = int(np.searchsorted(ends, found, side="right"))        # the first chunk whose total passes `found`
        base, q = lo * CHUNK, int(ends[lo - 1]) if lo else 0
        for e in np.flatnonzero(C[base:min(P, base + CHUNK)] == 0) + base:
            if q < target:
                free_ids[q] = e
            q += 1
        found, visited = int(ends[lo]), visited + 1
    assert visited <= max(target, 0)                                 # (each chunk visited gives a needed id)

    # 4. the ids, the flag, the commit, the plan, the peak
    pool_short = n_need > total_free
    ids = np.where(need, np.minimum(np.where(rank < total_free, free_ids[np.minimum(rank, free_ids.size - 1)], P),
                                    max(P - 1, 0)), P)
    value = np.where(need, ids, kept)
    used = b.check_used.numpy()
    r, c = b.check_rows.numpy()[used], b.check_cols.numpy()[used]
    held = np.where(c == col[r], value[r], T[r, c])
    left = bool((held != b.check_ids.numpy()[used]).any())
    blocks = (length + 1 + bs - 1) // bs
    over = ((length + 1 > int(b.token_limit)) | (blocks - b.row_prefix_blocks.numpy() > b.suffix_width)).any()
    if b.inner_width > 0:
        over |= (blocks - b.row_inner_blocks.numpy() > b.inner_width).any()
    active = not bool(done)
    flag = 0 if not active else 1 if pool_short else 2 if left else 4 if over else 0
    ok = live and flag == 0 and active
    if live:
        b.flags.fill_(flag)
    b.steps.add_(int(ok))
    offset = length % bs
    if ok:
        T[rows, col] = value
        L[:] = length + 1
        np.add.at(C, last[cow], -1)
        C[ids[need]] = 1
        length = length + 1
    emptied = int((ok & cow & (same == 0) & (last_count > 0) & (C[last] <= 0)).sum())
    C[P] = 0
    in_use = positives + (n_need - emptied if ok else 0)
    if in_use > int(peak):
        peak.fill_(in_use)
    scratch = np.full(R, P, dtype=np.int64)
    plan.write_block.copy_(torch.as_tensor(np.where(ok, value, scratch)))
    plan.write_offset.copy_(torch.as_tensor(np.where(ok, offset, 0)))
    first = int(np.argmax(cow))
    src = np.full(R, last[first] if n_cow else (value[0] if ok else P), dtype=np.int64)
    dst = np.full(R, ids[first] if n_cow else src[0], dtype=np.int64)
    src[slot[cow]], dst[slot[cow]] = last[cow], ids[cow]
    plan.copy_src.copy_(torch.as_tensor(np.where(ok, src, scratch)))
    plan.copy_dst.copy_(torch.as_tensor(np.where(ok, dst, scratch)))
    for skip, width, table, q_limit in ((b.row_prefix_blocks.numpy(), b.suffix_width, plan.suffix_table, plan.q_limit),
                                        (b.row_inner_blocks.numpy(), b.inner_width, plan.inner_suffix_table,
                                         plan.inner_q_limit)):
        if width == 0 or table is None:
            continue
        k = np.arange(width)
        held_cols = k[None, :] < ((L + bs - 1) // bs - skip)[:, None]
        entries = T[rows[:, None], np.minimum(skip[:, None] + k[None, :], W - 1)]
        table.copy_(torch.as_tensor(np.where(held_cols, entries, -1).astype(np.int32)))
        q_limit.copy_(torch.as_tensor((length - skip * bs).astype(np.int32))[:, None])


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", [c for c in CASES if c != "bs16-many-rows"])
def test_the_kernels_algorithm_equals_the_torch_ops(case, seed):
    flags, steps, _ = _drive(case, _emulated, "cpu", seed)
    assert flags == CASES[case][-1] and steps >= 2, case

