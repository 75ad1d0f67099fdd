"""Soak: a few hundred varied generate calls on one cascade model, every one equal to stock, and memory flat.

Greedy, sampling, beam search and beam sampling over left-padded batches, prompts sharing a prefix, explicit
CascadeCaches (fresh, and continued for a chat's next turn), settings passed as a dict, and bad calls mixed in
(they must raise, and the next call is still stock's). After a warm-up, the process's resident memory (from
/proc/self/statm: psutil is not a dependency) must stay within 5% and the count of objects the garbage
collector tracks must not grow with the calls.
"""
from __future__ import annotations

import gc
import os
import random

import pytest
import torch

from hf_cascade import CascadeCache, PoolExhausted
from conftest import VOCAB, cache_kw, model_pair, returned_cache

CALLS, WARM_UP = 300, 75
MODES = [dict(), dict(do_sample=True, top_k=0, num_return_sequences=2), dict(num_beams=3, num_return_sequences=2),
         dict(num_beams=2, do_sample=True), dict(num_beams=4), dict(do_sample=True, top_k=0, num_return_sequences=3)]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _batch(rng: random.Random, shared: int = 0):
    rows = rng.randint(1, 3)
    lengths = [rng.randint(max(2, shared + 1), 24) for _ in range(rows)]
    width = max(lengths)
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    common = torch.randint(3, VOCAB, (shared,), generator=g)
    ids, mask = torch.zeros(rows, width, dtype=torch.long), torch.zeros(rows, width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.cat([common, torch.randint(3, VOCAB, (n - shared,), generator=g)])
        mask[row, width - n:] = 1
    return ids, mask


def _generate(model, **kw):
    torch.manual_seed(99)
    out = model.generate(**kw)
    return out if isinstance(out, torch.Tensor) else out.sequences


def _one_call(rng: random.Random, stock, cascade, call: int):
    ids, mask = _batch(rng, shared=rng.choice([0, 0, 9, 17]))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=rng.randint(1, 6), pad_token_id=0,
              **rng.choice(MODES))
    kind = call % 10
    if kind == 3:                                  # a bad call: it raises, the model stays usable
        bad = rng.choice([dict(num_beams=0), dict(attention_mask=mask[:, 1:]),
                          dict(hf_cascade_config={"blocksize": 4}),
                          dict(num_beams=2, num_return_sequences=1, hf_cascade_config={"max_kv_bytes": 1})])
        with pytest.raises((ValueError, TypeError, PoolExhausted)):
            cascade.generate(**{**kw, **bad})
        return
    expected = _generate(stock, **kw)
    if kind == 5:                                  # an explicit cache, and a chat's next turn on it
        cache = CascadeCache(cascade.config, {"block_size": rng.choice([4, 16])})
        greedy = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0)
        first = cascade.generate(**greedy, **cache_kw(cascade, cache), return_dict_in_generate=True)
        assert torch.equal(first.sequences, stock.generate(**greedy))
        turn = torch.randint(3, VOCAB, (ids.shape[0], 2), generator=torch.Generator().manual_seed(call))
        ids2 = torch.cat([first.sequences, turn], 1)
        mask2 = torch.cat([mask, torch.ones(ids.shape[0], ids2.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
        nxt = dict(input_ids=ids2, attention_mask=mask2, max_new_tokens=3, pad_token_id=0)
        got = _generate(cascade, **nxt, **cache_kw(cascade, returned_cache(first)))
        assert torch.equal(got, _generate(stock, **nxt)), f"call {call}: continued cache"
        return
    extra = {}
    if kind == 7:
        extra = cache_kw(cascade, CascadeCache(cascade.config))
    elif kind in (1, 8):
        extra = dict(hf_cascade_config={"block_size": rng.choice([4, 8, 16]), "max_kv_bytes": 10 ** 7})
    got = _generate(cascade, **kw, **extra)
    assert torch.equal(got, expected), f"call {call}: {kw} {extra}"


def test_soak_tokens_equal_and_memory_flat():
    stock, cascade = model_pair("llama")
    rng = random.Random(2024)
    rss, objects = [], []
    for call in range(CALLS):
        _one_call(rng, stock, cascade, call)
        if call + 1 >= WARM_UP and (call + 1) % 25 == 0:
            gc.collect()
            rss.append(_rss_bytes())
            objects.append(len(gc.get_objects()))
    # the first sample is taken after the warm-up: everything later must stay within 5% of it (allocator noise
    # is a few MiB on a process of several hundred), and the tracked objects must not grow with the calls: they
    # stay within a few of each other once warm (a leak of one empty CascadeCache per call adds ~4 per call)
    assert max(rss) <= 1.05 * rss[0], [f"{r / 2 ** 20:.1f} MiB" for r in rss]
    assert max(objects) - objects[0] <= 100, objects
