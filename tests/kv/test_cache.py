"""CascadeCache driven by hand against stock DynamicCache (float64): tails after a shared prefix,
beam reorders, crops, the pool's contents, and the dense fallback."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_cascade
from hf_cascade import CascadeCache, CascadeConfig
from conftest import cache_kw, model_pair, padded_batch, returned_cache


def positions(mask):
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


@pytest.fixture(scope="module")
def pair():
    return model_pair("llama", num_hidden_layers=3)


def _prefilled(pair, n, block_size=4):
    """Both caches holding the padded prompts, expanded to n rows per prompt."""
    stock, cascade = pair
    ids, mask = padded_batch(seed=1)
    cache = CascadeCache(cascade.config, CascadeConfig(block_size=block_size))
    hf_cascade.prefill(cascade, cache, ids, mask)
    cache.batch_repeat_interleave(n)
    dense = DynamicCache(config=stock.config)
    ids_n, mask_n = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
    stock(input_ids=ids_n, attention_mask=mask_n, position_ids=positions(mask_n), **cache_kw(stock, dense))
    return ids_n, mask_n, cache, dense


def _step(pair, tokens, mask, cache, dense):
    """Feed `tokens` [R, q] to both; returns (cascade logits, stock logits)."""
    stock, cascade = pair
    pos = positions(mask)[:, -tokens.shape[1]:]
    got = cascade(input_ids=tokens, attention_mask=mask, position_ids=pos, **cache_kw(cascade, cache)).logits
    ref = stock(input_ids=tokens, attention_mask=mask, position_ids=pos, **cache_kw(stock, dense)).logits
    return got, ref


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_tail_after_shared_prefix(pair, block_size):
    ids_n, mask_n, cache, dense = _prefilled(pair, n=3, block_size=block_size)
    tail = torch.randint(3, 90, (ids_n.shape[0], 5), generator=torch.Generator().manual_seed(0))
    mask = torch.cat([mask_n, torch.ones_like(tail)], 1)
    got, ref = _step(pair, tail, mask, cache, dense)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
    stats = cache.stats()
    assert stats.tokens_stored < stats.tokens_logical
    assert stats.kv_bytes_in_use < sum(l.keys.nbytes + l.values.nbytes for l in dense.layers)


def test_decode_with_reorders_and_crop(pair):
    ids_n, mask, cache, dense = _prefilled(pair, n=4)
    g = torch.Generator().manual_seed(3)
    reorders = [torch.tensor([0, 0, 1, 3, 4, 6, 6, 6]), torch.tensor([3, 2, 1, 0, 7, 7, 5, 4]),
                torch.tensor([1, 1, 1, 1, 4, 5, 6, 7])]
    for step in range(6):
        token = torch.randint(3, 90, (ids_n.shape[0], 1), generator=g)
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        got, ref = _step(pair, token, mask, cache, dense)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
        if step < len(reorders):
            cache.reorder_cache(reorders[step])
            dense.reorder_cache(reorders[step])
    # crop two tokens from both, then feed them again
    cache.crop(-2)
    dense.crop(-2)
    assert cache.get_seq_length() == dense.get_seq_length()
    mask = mask[:, :-2]
    token = torch.randint(3, 90, (ids_n.shape[0], 2), generator=g)
    mask = torch.cat([mask, torch.ones_like(token)], 1)
    got, ref = _step(pair, token, mask, cache, dense)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)


def test_pool_holds_each_rows_tokens(pair):
    ids_n, mask, cache, dense = _prefilled(pair, n=2)
    token = torch.randint(3, 90, (ids_n.shape[0], 1), generator=torch.Generator().manual_seed(9))
    mask = torch.cat([mask, torch.ones_like(token)], 1)
    _step(pair, token, mask, cache, dense)
    cache.reorder_cache(torch.tensor([1, 1, 2, 2]))
    dense.reorder_cache(torch.tensor([1, 1, 2, 2]))
    bs = cache.block_size
    for layer_idx, layer in enumerate(cache.layers):
        for row in range(cache.blocks.num_rows):
            real = mask[row].bool()
            expected_k = dense.layers[layer_idx].keys[row][:, real].transpose(0, 1)       # [T, H, D]
            expected_v = dense.layers[layer_idx].values[row][:, real].transpose(0, 1)
            table = torch.from_numpy(cache.blocks.table(row)).long()
            t = torch.arange(int(cache.blocks.lengths[row]))
            assert t.numel() == int(real.sum())                                          # pads are not stored
            torch.testing.assert_close(layer.pool[table[t // bs], 0, t % bs], expected_k, rtol=0, atol=1e-12)
            torch.testing.assert_close(layer.pool[table[t // bs], 1, t % bs], expected_v, rtol=0, atol=1e-12)


def test_batch_select_and_repeat(pair):
    ids_n, mask, cache, dense = _prefilled(pair, n=1)
    cache.batch_repeat_interleave(2)
    dense.batch_repeat_interleave(2)
    cache.batch_select_indices(torch.tensor([3, 0]))
    dense.batch_select_indices(torch.tensor([3, 0]))
    mask = mask.repeat_interleave(2, 0)[[3, 0]]
    token = torch.tensor([[7], [8]])
    mask = torch.cat([mask, torch.ones_like(token)], 1)
    got, ref = _step(pair, token, mask, cache, dense)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)


def test_stats_and_reset(pair):
    _, _, cache, dense = _prefilled(pair, n=4)
    stats = cache.stats()
    assert stats.blocks_shared == stats.blocks_in_use > 0       # right after the fork every block is shared
    assert stats.tokens_stored == 23 + 17
    assert stats.tokens_logical == 8 * 23
    assert stats.kv_bytes_reserved >= stats.kv_bytes_in_use == stats.peak_kv_bytes_in_use
    cache.reset()
    stats = cache.stats()
    assert (stats.blocks_in_use, stats.kv_bytes_in_use, stats.peak_kv_bytes_in_use, stats.kv_bytes_reserved) == (0, 0, 0, 0)
    assert cache.get_seq_length() == 0 and cache.blocks.num_rows == 0


def test_free_memory_drops_the_storages_and_the_cache_is_reusable(pair):
    """free_memory (what hf_cascade.release does to a kept cache): every block back, every layer's storage dropped
    (what keep_kv_bytes would keep included); the cache then serves a new prefill as a fresh one does."""
    _, _, cache, dense = _prefilled(pair, n=4)
    assert all(layer.storage is not None for layer in cache.layers)
    cache.free_memory()
    assert all(layer.storage is None and not layer.is_initialized for layer in cache.layers)
    assert cache.stats().kv_bytes_reserved == 0 and cache.get_seq_length() == 0
    ids, mask = padded_batch(seed=1)
    hf_cascade.prefill(pair[1], cache, ids, mask)              # the freed cache, filled again
    cache.batch_repeat_interleave(4)
    ids_n, mask_n, _, dense = _prefilled(pair, n=4)
    token = torch.full((ids_n.shape[0], 1), 7)
    mask_n = torch.cat([mask_n, torch.ones_like(token)], 1)
    got, ref = _step(pair, token, mask_n, cache, dense)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)


def test_dense_fallback_without_cascade_cache(pair):
    """Trainer's loss pass, use_cache=False, or a DynamicCache: plain sdpa, bit for bit."""
    stock, cascade = pair
    ids, mask = padded_batch(seed=12)
    labels = ids.masked_fill(mask == 0, -100)
    for use_cache in (False, True):
        a = stock(input_ids=ids, attention_mask=mask, labels=labels, use_cache=use_cache)
        b = cascade(input_ids=ids, attention_mask=mask, labels=labels, use_cache=use_cache)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)


# ---- bad input ---------------------------------------------------------------------------------

def test_padded_forward_without_prefill_is_refused(pair):
    _, cascade = pair
    ids, mask = padded_batch(seed=1)
    cache = CascadeCache(cascade.config)
    with pytest.raises(ValueError, match="padding"):
        cascade(input_ids=ids, attention_mask=mask, **cache_kw(cascade, cache))


def test_cascade_cache_needs_cascade_model(pair):
    stock, _ = pair
    ids, mask = padded_batch(seed=1)
    with pytest.raises(ValueError, match="attn_implementation='cascade'"):
        stock.generate(input_ids=ids, attention_mask=mask, **cache_kw(stock, CascadeCache(stock.config)),
                       max_new_tokens=2, pad_token_id=0)
    with pytest.raises(RuntimeError, match="attn_implementation='cascade'"):
        stock(input_ids=ids[:, -3:], **cache_kw(stock, CascadeCache(stock.config)))


def test_cache_reused_with_another_model(pair):
    _, cascade = pair
    _, other = model_pair("qwen2", hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    ids, mask = padded_batch(seed=1)
    out = cascade.generate(input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=2, pad_token_id=0,
                           return_dict_in_generate=True)
    cache = returned_cache(out)
    with pytest.raises(ValueError, match="another model"):
        other.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, **cache_kw(other, cache))
    cache.reset()
    other.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, **cache_kw(other, cache))


def test_filled_cache_is_refused(pair):
    _, cascade = pair
    ids, mask = padded_batch(seed=1)
    cache = CascadeCache(cascade.config)
    cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, **cache_kw(cascade, cache))
    with pytest.raises(ValueError, match="already holds"):
        cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, **cache_kw(cascade, cache))


def test_right_padding_runs_with_stock_tokens(pair):
    # was: refused; pads are not stored (tests/test_padding.py covers modes, caches and windows)
    stock, cascade = pair
    ids, mask = padded_batch(seed=1)
    kw = dict(input_ids=ids.flip(1), attention_mask=mask.flip(1), max_new_tokens=3, pad_token_id=0, num_beams=2)
    assert torch.equal(stock.generate(**kw), cascade.generate(**kw))


def test_sliding_window_beyond_window_matches_stock():
    # was: refused; the reference kernels now implement the window (tests/test_families.py covers more families)
    stock, cascade = model_pair("mistral", sliding_window=8)
    ids, mask = padded_batch(seed=1)
    kw = dict(num_beams=2, max_new_tokens=4, pad_token_id=0)
    assert torch.equal(stock.generate(input_ids=ids, attention_mask=mask, **kw),
                       cascade.generate(input_ids=ids, attention_mask=mask, **kw))


# encoder-decoder models: served, or refused by family, in tests/seq2seq/test_encoder_decoder.py


def test_pool_cap_error_releases_everything(pair):
    stock, cascade = pair
    ids, mask = padded_batch(seed=1)
    per_block = 2 * 4 * 2 * 16 * 8 * 3          # K+V, block 4, 2 KV heads, head_dim 16, float64, 3 layers
    cache = CascadeCache(cascade.config, CascadeConfig(block_size=4, max_kv_bytes=12 * per_block))
    with pytest.raises(MemoryError, match="block"):
        cascade.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=8, pad_token_id=0,
                         **cache_kw(cascade, cache))
    cache.reset()
    assert cache.stats().blocks_in_use == 0
    kw = dict(num_beams=2, max_new_tokens=3, pad_token_id=0)
    assert torch.equal(cascade.generate(input_ids=ids, attention_mask=mask, **kw),
                       stock.generate(input_ids=ids, attention_mask=mask, **kw))


def test_min_prefix_tokens_reads_short_prefixes_as_suffixes(pair):
    """Below the threshold no prefix level is planned; attention stays exact either way."""
    stock, cascade = pair
    ids, mask = padded_batch(seed=1)                 # prompts of 23 and 17 tokens, 22 and 16 prefilled
    kw = dict(num_beams=3, max_new_tokens=5, pad_token_id=0, return_dict_in_generate=True)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw).sequences
    def prefix_lens(threshold):
        out = cascade.generate(input_ids=ids, attention_mask=mask, **kw,
                               hf_cascade_config=CascadeConfig(block_size=4, min_prefix_tokens=threshold))
        assert torch.equal(out.sequences, expected)
        cache = returned_cache(out)
        token = torch.full((cache.blocks.num_rows, 1), 5)
        full = torch.ones(cache.blocks.num_rows, cache.get_seq_length() + 1, dtype=torch.long)
        cascade(input_ids=token, attention_mask=full, **cache_kw(cascade, cache))
        lens = sorted(cache.plan.prefix_len.tolist())
        cache.reset()
        return lens

    every = prefix_lens(0)
    assert len(every) == 2                           # one group per prompt
    for threshold in (every[0], every[0] + 1, every[-1] + 1):
        assert prefix_lens(threshold) == [n for n in every if n >= threshold], threshold
    with pytest.raises(ValueError, match="min_prefix_tokens"):
        CascadeConfig(min_prefix_tokens=-1)


def _plan_after(cascade, ids, mask, kw, config):
    """Generate, then one more forward through the returned cache: that step's plan."""
    out = cascade.generate(input_ids=ids, attention_mask=mask, **kw, hf_cascade_config=config)
    cache = returned_cache(out)
    token = torch.full((cache.blocks.num_rows, 1), 5)
    full = torch.ones(cache.blocks.num_rows, cache.get_seq_length() + 1, dtype=torch.long)
    cascade(input_ids=token, attention_mask=full, **cache_kw(cascade, cache))
    plan = cache.plan
    cache.reset()
    return out.sequences, plan


def test_min_saved_tokens_skips_a_cascade_that_saves_too_little(pair, monkeypatch):
    """No prefix level when the groups together save fewer reads than the threshold; exact either way.
    Unset, the threshold is the one the layer shapes' backend declares (``min_saved_tokens``)."""
    stock, cascade = pair
    ids, mask = padded_batch(seed=1)
    kw = dict(num_beams=3, max_new_tokens=5, pad_token_id=0, return_dict_in_generate=True)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw).sequences
    seq, plan = _plan_after(cascade, ids, mask, kw, CascadeConfig(block_size=4))
    assert torch.equal(seq, expected)
    saved = sum((int((rows >= 0).sum()) - 1) * int(n) for rows, n in zip(plan.group_rows, plan.prefix_len))
    assert plan.num_groups == 2 and saved > 0
    for threshold, groups in ((saved, 2), (saved + 1, 0)):
        seq, plan = _plan_after(cascade, ids, mask, kw, CascadeConfig(block_size=4, min_saved_tokens=threshold))
        assert torch.equal(seq, expected) and plan.num_groups == groups, threshold
    monkeypatch.setattr(hf_cascade.kernels.reference.BACKEND, "min_saved_tokens", saved + 1)
    seq, plan = _plan_after(cascade, ids, mask, kw, CascadeConfig(block_size=4))
    assert torch.equal(seq, expected) and plan.num_groups == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="min_saved_tokens"):
            CascadeConfig(min_saved_tokens=bad)


def test_the_step_context_reaches_the_attention_as_an_argument(pair, monkeypatch):
    """transformers >= 5.24 hands Cache.update the attention kwargs: the step context travels in them and the
    per-thread shim (older versions, modeling files that pass no kwargs) stays unused; below 5.24 the shim carries
    it. Either way the cascade attention runs and gives stock's tokens."""
    from hf_cascade import cache as cache_module, context
    from hf_cascade.kernels import reference
    stock, cascade = pair
    shim, cascaded = [], []
    real_set, real_forward = cache_module.set_context, reference.BACKEND.forward
    monkeypatch.setattr(cache_module, "set_context", lambda ctx: shim.append(ctx) or real_set(ctx))
    monkeypatch.setattr(reference.BACKEND, "forward", lambda *a, **kw: cascaded.append(1) or real_forward(*a, **kw))
    ids, mask = padded_batch(seed=2)
    kw = dict(num_beams=2, max_new_tokens=4, pad_token_id=0)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    got = cascade.generate(input_ids=ids, attention_mask=mask, **kw, hf_cascade_config=dict(cuda_graphs="eager"))
    assert torch.equal(got, expected) and cascaded
    assert (shim == []) == context.UPDATE_PASSES_KWARGS


def test_kv_changed_between_update_and_attention_is_refused(pair):
    """The cascade attention reads the K/V its cache stored: K/V the model reshaped after update (here: KV heads
    repeated, as a model that expands them itself would) are refused, not silently ignored."""
    from hf_cascade import attention, context
    _, cascade = pair
    cache = CascadeCache(cascade.config)
    module = cascade.model.layers[0].self_attn
    k = torch.randn(2, cascade.config.num_key_value_heads, 3, module.head_dim, dtype=torch.float64)
    attention_kwargs = {}
    cache.update(k, k.clone(), 0, kwargs=attention_kwargs)
    if not context.UPDATE_PASSES_KWARGS:
        attention_kwargs = {}                  # the shim carries it
    q = torch.randn(2, cascade.config.num_attention_heads, 3, module.head_dim, dtype=torch.float64)
    repeated = k.repeat_interleave(2, dim=1)
    with pytest.raises(RuntimeError, match="changed the K/V between cache.update and the attention call"):
        attention.cascade_attention(module, q, repeated, repeated, None, **attention_kwargs)
    cache.reset()
