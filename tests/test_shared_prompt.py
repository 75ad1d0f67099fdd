"""A system prompt shared by the prompts of a batch is prefilled and stored once for the whole batch."""
from __future__ import annotations

import pytest
import torch

import hf_cascade
from hf_cascade.generation import shared_prefix_length
from conftest import FirstForwardRows, cache_kw, model_pair, returned_cache

SHARED, TAILS, BEAMS, NEW = 200, (13, 30, 7, 21), 4, 6


def batch_with_system_prompt(seed=0, shared=SHARED, tails=TAILS):
    """Left-padded prompts that all begin with the same `shared` tokens, then differ."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 90, (shared,), generator=g)
    width = shared + max(tails)
    ids = torch.zeros(len(tails), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(tails):
        prompt = torch.cat([system, torch.randint(3, 90, (n,), generator=g)])
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    return ids, mask


@pytest.fixture(scope="module")
def pair():
    return model_pair("llama", max_position_embeddings=512)


@pytest.mark.parametrize("mode", ["beam", "sample", "greedy"])
def test_shared_system_prompt_matches_stock_and_is_stored_once(pair, mode):
    stock, cascade = pair
    ids, mask = batch_with_system_prompt()
    kw = dict(max_new_tokens=NEW, pad_token_id=0, return_dict_in_generate=True)
    kw.update({"beam": dict(num_beams=BEAMS, num_return_sequences=2), "sample": dict(do_sample=True,
               num_return_sequences=BEAMS), "greedy": {}}[mode])
    torch.manual_seed(5)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw).sequences
    rows = FirstForwardRows(cascade)
    try:
        torch.manual_seed(5)
        out = cascade.generate(input_ids=ids, attention_mask=mask, **kw)
    finally:
        rows.remove()
    assert torch.equal(expected, out.sequences)
    # one row for the shared part, one per prompt for the rests, then all rows
    n = 1 if mode == "greedy" else BEAMS
    assert rows.rows[:3] == [1, len(TAILS), len(TAILS) * n]
    cache = returned_cache(out)
    stats = cache.stats()
    bs = cache.block_size
    per_prompt = sum(TAILS) - len(TAILS)           # each prompt's own tokens, its last one fed by generate
    per_row = NEW + 1                                # the last prompt token and the new tokens of each row
    # stored = shared + per-prompt + per-beam parts, up to partially filled blocks
    assert stats.tokens_stored <= SHARED + per_prompt + len(TAILS) * n * per_row + (len(TAILS) * n + 1) * bs
    full = SHARED // bs                              # the system prompt's full blocks: one copy, held by every row
    tables = cache.blocks.tables()
    assert (tables[:, :full] == tables[:1, :full]).all()
    assert stats.tokens_stored < len(TAILS) * SHARED  # per-prompt storage would hold the system prompt 4 times
    cache.reset()


def test_shared_prefix_length():
    ids, mask = batch_with_system_prompt()
    assert shared_prefix_length(ids, mask, min_tokens=16) == SHARED
    assert shared_prefix_length(ids[:1], mask[:1], min_tokens=16) == 0           # a single prompt
    assert shared_prefix_length(ids, mask, min_tokens=SHARED + 1) == 0            # too short to pay
    same = ids[:1].repeat(3, 1)
    assert shared_prefix_length(same, mask[:1].repeat(3, 1), min_tokens=1) == int(mask[0].sum()) - 1
    middle = mask.clone()
    middle[0, -3] = 0                                                            # not plain left padding
    assert shared_prefix_length(ids, middle, min_tokens=1) == 0


def test_no_sharing_with_sliding_window():
    stock, cascade = model_pair("mistral", sliding_window=64, max_position_embeddings=512)
    ids, mask = batch_with_system_prompt(seed=1, shared=40, tails=(5, 9))
    kw = dict(num_beams=2, max_new_tokens=4, pad_token_id=0)
    rows = FirstForwardRows(cascade)
    try:
        got = cascade.generate(input_ids=ids, attention_mask=mask, **kw)
    finally:
        rows.remove()
    assert rows.rows[0] == 2                           # per-prompt prefill: a window counts each prompt's pads
    assert torch.equal(stock.generate(input_ids=ids, attention_mask=mask, **kw), got)


def test_plan_has_three_levels_and_they_agree_with_two(pair):
    """Batch-shared system prompt -> each prompt's rest (shared by its beams) -> each beam's suffix."""
    from hf_cascade.generation import prefill_prompts
    from hf_cascade.kernels import reference
    _, cascade = pair
    ids, mask = batch_with_system_prompt(seed=2)
    cache = hf_cascade.CascadeCache(cascade.config)
    kwarg = next(iter(cache_kw(cascade, cache)))
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    assert prefill_prompts(cascade, cache, ids[:, :-1], mask[:, :-1], positions[:, :-1], kwarg) == SHARED
    cache.batch_repeat_interleave(BEAMS)
    rows = len(TAILS) * BEAMS
    full_mask = mask.repeat_interleave(BEAMS, 0)
    cascade(input_ids=ids[:, -1:].repeat_interleave(BEAMS, 0), attention_mask=full_mask,
            position_ids=positions[:, -1:].repeat_interleave(BEAMS, 0), **{kwarg: cache})
    plan = cache.plan
    bs = cache.block_size
    assert plan.group_rows.tolist() == [list(range(rows))] and plan.prefix_len.tolist() == [SHARED // bs * bs]
    # a middle level for every prompt whose own rest (after the shared blocks) fills a whole block
    rest = [SHARED % bs + n - 1 for n in TAILS]
    expected = [list(range(p * BEAMS, (p + 1) * BEAMS)) for p, r in enumerate(rest) if r >= bs]
    assert sorted(plan.mid_group_rows.tolist()) == expected
    # the three-level computation equals the two-level one on the same pool, in float64
    pool = cache.layers[0].pool
    q = torch.randn(rows, 1, 4, pool.shape[-1], dtype=pool.dtype, generator=torch.Generator().manual_seed(0))
    three = reference.attend(q, pool, plan, 0.3)
    dp = plan.on(pool.device)
    two = reference.cascade_attention(q, pool[:, 0], pool[:, 1], dp.group_rows, dp.prefix_table, dp.prefix_len,
                                      dp.suffix_table, dp.q_limit, 0.3)
    torch.testing.assert_close(three, two, rtol=0, atol=1e-12)
    # reads per layer and KV head: the system prompt once, each prompt's rest once, each beam's own tokens
    lengths = cache.blocks.lengths.tolist()
    mid_of_row = {r: int(n) for g, n in zip(plan.mid_group_rows.tolist(), plan.mid_len.tolist()) for r in g}
    own = sum(n - int(plan.prefix_len[0]) - mid_of_row.get(r, 0) for r, n in enumerate(lengths))
    assert plan.kv_reads() == (int(plan.prefix_len[0]) + int(plan.mid_len.sum()) + own, sum(lengths))
    cache.reset()
