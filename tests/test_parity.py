"""Parity with stock generate() where the cascade path used to differ or refuse: model inputs besides the ids
(token_type_ids, inputs_embeds), continuing from a returned CascadeCache, empty prompts in a left-padded batch;
calls with nothing to share on stock's own path; the caller's cache left empty by a failed generate; refusals
that name an attention implementation the model has. Token-exact in float64 against stock sdpa."""
from __future__ import annotations

import logging

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, GPT2Config, StoppingCriteria, StoppingCriteriaList

from hf_cascade import CascadeCache, CascadeConfig, generation, logs
from conftest import VOCAB, FirstForwardRows, cache_kw, model_pair, padded_batch, returned_cache

NEW = 6
MODES = {
    "greedy": dict(),
    "sample": dict(do_sample=True, num_return_sequences=3, top_k=0, temperature=1.5),
    "beam": dict(num_beams=4, num_return_sequences=3, length_penalty=0.7),
}
def both(pair, seed=0, **kw):
    """(stock output, cascade output) of the same call with the same RNG seed."""
    outs = []
    for model in pair:
        torch.manual_seed(seed)
        outs.append(model.generate(**kw))
    return outs


def assert_same(expected, got):
    """Same sequences; same scores and beam scores to float64 rounding."""
    assert torch.equal(expected.sequences, got.sequences)
    for name in ("scores", "sequences_scores"):
        want, have = getattr(expected, name, None), getattr(got, name, None)
        if want is None:
            continue
        want, have = (torch.stack(x) if isinstance(x, tuple) else x for x in (want, have))
        assert want.shape == have.shape and torch.allclose(want, have, rtol=0, atol=1e-9), name


def out_kw(mode, **kw):
    return dict(max_new_tokens=NEW, pad_token_id=0, return_dict_in_generate=True, output_scores=True,
                **MODES[mode], **kw)


@pytest.fixture(scope="module")
def gpt2_pair():
    """GPT-2 (token type ids go through its embedding), weights sharp enough that the wrong inputs change tokens."""
    def config():
        return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, pad_token_id=0,
                          bos_token_id=1, eos_token_id=None, initializer_range=0.3)
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(config(), attn_implementation="sdpa", dtype=torch.float64).eval()
    cascade = AutoModelForCausalLM.from_config(config(), attn_implementation="cascade", dtype=torch.float64).eval()
    cascade.load_state_dict(stock.state_dict())
    return stock, cascade


def token_types(ids, seed=1):
    return torch.randint(0, 5, ids.shape, generator=torch.Generator().manual_seed(seed))


# ---- model inputs besides the ids --------------------------------------------------------------------------

@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("explicit", [False, True])
def test_token_type_ids_reach_the_prefill(gpt2_pair, mode, explicit):
    stock, cascade = gpt2_pair
    ids, mask = padded_batch(seed=3)
    kw = out_kw(mode, input_ids=ids, attention_mask=mask, token_type_ids=token_types(ids))
    expected = both(gpt2_pair, **kw)[0]
    # test setup: the token types matter (the old cascade dropped them from the prefill)
    without = stock.generate(**{k: v for k, v in kw.items() if k != "token_type_ids"})
    assert not torch.equal(expected.sequences, without.sequences)
    torch.manual_seed(0)
    extra = cache_kw(cascade, CascadeCache(cascade.config)) if explicit else {}
    assert_same(expected, cascade.generate(**kw, **extra))


@pytest.mark.parametrize("differ_at", [None, 20])
def test_token_type_ids_with_a_shared_system_prompt(gpt2_pair, differ_at):
    """The prompts share 40 tokens; the shared prefill takes their token types, and sharing stops where the
    token types of the prompts differ even if the ids do not."""
    stock, cascade = gpt2_pair
    g = torch.Generator().manual_seed(4)
    system = torch.randint(3, VOCAB, (40,), generator=g)
    tails = [torch.randint(3, VOCAB, (n,), generator=g) for n in (9, 5)]
    ids = torch.zeros(2, 49, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tail in enumerate(tails):
        prompt = torch.cat([system, tail])
        ids[row, 49 - len(prompt):], mask[row, 49 - len(prompt):] = prompt, 1
    types = torch.zeros_like(ids)
    for row, tail in enumerate(tails):
        types[row, 49 - len(tail):] = 1              # each prompt's own part is of another type
    if differ_at is not None:
        types[1, 49 - 45 + differ_at] = 3           # row 1 starts at column 4: its system prompt's token 20
    kw = out_kw("beam", input_ids=ids, attention_mask=mask, token_type_ids=types)
    expected = both(gpt2_pair, **kw)[0]
    rows = FirstForwardRows(cascade)
    try:
        torch.manual_seed(0)
        got = cascade.generate(**kw)
    finally:
        rows.remove()
    assert_same(expected, got)
    block = CascadeConfig().block_size
    shared = generation.shared_prefix_length(ids[:, :-1], mask[:, :-1], block, also=(types[:, :-1],))
    assert shared == (40 if differ_at is None else differ_at)
    assert rows.rows[:2] == [1, 2]                 # the shared part once, then each prompt's rest


def test_unknown_tensor_input_is_refused_not_dropped(gpt2_pair):
    _, cascade = gpt2_pair
    ids, mask = padded_batch(seed=5)
    with pytest.raises(NotImplementedError, match="'encoder_attention_mask'.*cannot place per prompt"):
        cascade.generate(input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=2, pad_token_id=0,
                         encoder_attention_mask=torch.ones(ids.shape[0], 5))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("with_ids", [False, True])
def test_generate_from_inputs_embeds(llama_pair, mode, with_ids):
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=6)
    embeds = stock.get_input_embeddings()(ids)
    kw = out_kw(mode, inputs_embeds=embeds, attention_mask=mask, **({"input_ids": ids} if with_ids else {}))
    expected = both(llama_pair, **kw)[0]
    for extra in ({}, cache_kw(cascade, CascadeCache(cascade.config))):
        torch.manual_seed(0)
        assert_same(expected, cascade.generate(**kw, **extra))


# ---- continuing from a returned CascadeCache -------------------------------------------------------------

def next_turn(sequences, mask, seed, tokens=4):
    """The previous sequences followed by a few new user tokens, and the mask extended over them."""
    new = torch.randint(3, VOCAB, (sequences.shape[0], tokens), generator=torch.Generator().manual_seed(seed))
    ids = torch.cat([sequences, new], 1)
    return ids, torch.cat([mask, mask.new_ones(ids.shape[0], ids.shape[1] - mask.shape[1])], 1)


@pytest.mark.parametrize("first", ["greedy", "sample"])
@pytest.mark.parametrize("second", list(MODES))
def test_continue_from_returned_cache(llama_pair, first, second):
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=7)
    kw = dict(max_new_tokens=NEW, pad_token_id=0, return_dict_in_generate=True, **MODES[first])
    if first == "sample":
        kw["num_return_sequences"] = 2
    torch.manual_seed(0)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    torch.manual_seed(0)
    got = cascade.generate(input_ids=ids, attention_mask=mask, **kw,
                           **({} if first == "sample" else cache_kw(cascade, CascadeCache(cascade.config))))
    assert torch.equal(expected.sequences, got.sequences)
    cache = returned_cache(got)
    assert isinstance(cache, CascadeCache)      # the caller's, or (sampling 2 per prompt shares) generate's own
    mask = mask.repeat_interleave(expected.sequences.shape[0] // ids.shape[0], 0)
    ids2, mask2 = next_turn(got.sequences, mask, seed=8)
    second_kw = out_kw(second, input_ids=ids2, attention_mask=mask2)
    if second == "greedy":    # stock continues its own cache: one row per stored row
        torch.manual_seed(0)
        want = stock.generate(**second_kw, **cache_kw(cascade, returned_cache(expected)))
    else:                     # stock cannot fork a cache to beams: compare with the whole conversation afresh
        torch.manual_seed(0)
        want = stock.generate(**second_kw)
    stored = cache.get_seq_length()
    rows = FirstForwardRows(cascade)
    try:
        torch.manual_seed(0)
        have = cascade.generate(**second_kw, **cache_kw(cascade, cache))
    finally:
        rows.remove()
    assert_same(want, have)
    n = max(second_kw.get("num_beams", 1), second_kw.get("num_return_sequences", 1))
    new_tokens = ids2.shape[1] - stored
    assert rows.rows[0] == ids2.shape[0] and rows.caches[0] is cache     # only the new tokens, once per prompt
    assert rows.rows[1] == ids2.shape[0] * n                            # then the beams/samples of each
    assert new_tokens == 1 + 4 and returned_cache(have) is cache


def test_continuation_refusals(llama_pair):
    _, cascade = llama_pair
    ids, mask = padded_batch(seed=9)
    kw = dict(max_new_tokens=3, pad_token_id=0, return_dict_in_generate=True)
    out = cascade.generate(input_ids=ids, attention_mask=mask, **kw, **cache_kw(cascade, CascadeCache(cascade.config)))
    ids2, mask2 = next_turn(out.sequences, mask, seed=10)
    with pytest.raises(ValueError, match="holds 2 rows.*has 1 prompts"):
        cascade.generate(input_ids=ids2[:1], attention_mask=mask2[:1], **kw, **cache_kw(cascade, returned_cache(out)))
    assert returned_cache(out).get_seq_length() == 0              # refused: left empty
    beams = cascade.generate(input_ids=ids, attention_mask=mask, num_beams=2, **kw,
                             **cache_kw(cascade, CascadeCache(cascade.config)))
    ids2, mask2 = next_turn(beams.sequences, mask, seed=10)
    with pytest.raises(ValueError, match="filled by beam search"):
        cascade.generate(input_ids=ids2, attention_mask=mask2, **kw, **cache_kw(cascade, returned_cache(beams)))
    again = cascade.generate(input_ids=ids, attention_mask=mask, **kw, **cache_kw(cascade, CascadeCache(cascade.config)))
    with pytest.raises(ValueError, match="at least one new token"):
        cascade.generate(input_ids=again.sequences[:, :-1], attention_mask=mask2[:, :again.sequences.shape[1] - 1],
                         **kw, **cache_kw(cascade, returned_cache(again)))


# ---- empty prompts in a left-padded batch ----------------------------------------------------------------

@pytest.fixture(scope="module")
def unpadded_embedding_pair():
    """Token 0 (the pad) has a real embedding: an empty row's outputs are not trivially zero."""
    return model_pair("llama", pad_token_id=None)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("explicit", [False, True])
def test_empty_prompt_in_left_padded_batch(unpadded_embedding_pair, mode, explicit):
    stock, cascade = unpadded_embedding_pair
    ids, mask = padded_batch(seed=11)
    ids, mask = torch.cat([ids, torch.zeros_like(ids[:1])]), torch.cat([mask, torch.zeros_like(mask[:1])])
    kw = out_kw(mode, input_ids=ids, attention_mask=mask)
    expected = both(unpadded_embedding_pair, **kw)[0]
    assert not bool((expected.sequences[-1, -NEW:] == 0).all()), "test setup: the empty row generates tokens"
    torch.manual_seed(0)
    extra = cache_kw(cascade, CascadeCache(cascade.config)) if explicit else {}
    assert_same(expected, cascade.generate(**kw, **extra))


# ---- nothing to share: stock's path ----------------------------------------------------------------------

def test_nothing_to_share_runs_on_stock_path_logged_once(llama_pair, caplog, monkeypatch):
    stock, cascade = llama_pair
    monkeypatch.setattr(logs, "_logged", set())
    ids, mask = padded_batch(seed=13)
    seen = FirstForwardRows(cascade)
    try:
        with caplog.at_level(logging.INFO, logger="hf_cascade"):
            for mode in ("greedy", "sample"):
                kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0,
                          **{k: v for k, v in MODES[mode].items() if k != "num_return_sequences"})
                expected, got = both((stock, cascade), **kw)
                assert torch.equal(expected, got)
    finally:
        seen.remove()
    assert all(not isinstance(c, CascadeCache) for c in seen.caches)
    assert caplog.text.count("stock's dense path") == 1


def test_stock_path_reason():
    stock, cascade = model_pair("llama", max_position_embeddings=512)
    config = CascadeConfig()
    ids, mask = padded_batch(seed=14)
    one = cascade.generation_config.__class__(max_new_tokens=2)
    assert "nothing to share" in generation.stock_path_reason(cascade, config, one, ids, mask)
    for several in (dict(num_beams=2), dict(do_sample=True, num_return_sequences=2)):
        gc = cascade.generation_config.__class__(max_new_tokens=2, **several)
        assert generation.stock_path_reason(cascade, config, gc, ids, mask) is None
    prompts = torch.randint(3, VOCAB, (2, 25), generator=torch.Generator().manual_seed(1))
    assert "nothing to share" in generation.stock_path_reason(cascade, config, one, prompts, None)
    prompts[1, :20] = prompts[0, :20]           # a system prompt of 20 tokens (>= one block): shared
    assert generation.stock_path_reason(cascade, config, one, prompts, None) is None
    types = torch.zeros_like(prompts)
    types[1, 3] = 1                             # ... unless the token types differ within it
    assert generation.stock_path_reason(cascade, config, one, prompts, None, inputs={"token_type_ids": types})


@pytest.mark.parametrize("threshold,cascade_path", [(100, True), (200, False)])
def test_min_shared_tokens_routes_little_sharing_to_stock(llama_pair, monkeypatch, threshold, cascade_path):
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=18)            # prompts of 23 and 17 tokens: 4 beams save 3 x (22 + 16) = 114
    monkeypatch.setattr(generation, "MIN_SHARED_TOKENS", {"cpu": threshold})
    kw = dict(input_ids=ids, attention_mask=mask, num_beams=4, num_return_sequences=2, max_new_tokens=NEW,
              pad_token_id=0)
    seen = FirstForwardRows(cascade)
    try:
        expected, got = both((stock, cascade), **kw)
    finally:
        seen.remove()
    assert torch.equal(expected, got)
    assert isinstance(seen.caches[0], CascadeCache) == cascade_path
    reason = generation.stock_path_reason(cascade, CascadeConfig(), cascade.generation_config.__class__(num_beams=4),
                                          ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0))
    assert (reason is None) == cascade_path and (cascade_path or "114 prompt-token reads" in reason)


def test_explicit_cache_keeps_the_cascade_path(llama_pair):
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=15)
    cache = CascadeCache(cascade.config)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0)
    seen = FirstForwardRows(cascade)
    try:
        got = cascade.generate(**kw, **cache_kw(cascade, cache))
    finally:
        seen.remove()
    assert torch.equal(stock.generate(**kw), got)
    assert all(c is cache for c in seen.caches) and seen.rows[0] == 2


# ---- a failed generate leaves the caller's cache empty and reusable --------------------------------------

class Raise(StoppingCriteria):
    def __init__(self, error, after):
        self.error, self.after, self.calls = error, after, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls >= self.after:
            raise self.error
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _failures(cascade):
    ids, mask = padded_batch(seed=16)
    base = dict(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=6, pad_token_id=0)
    positions = torch.zeros(3, *ids.shape, dtype=torch.long)     # several position axes: refused by the prefill
    return {
        "bad input": (dict(base, position_ids=positions), NotImplementedError, CascadeConfig()),
        "stopping criterion": (dict(base, stopping_criteria=StoppingCriteriaList([Raise(RuntimeError("x"), 3)])),
                               RuntimeError, CascadeConfig()),
        "KeyboardInterrupt": (dict(base, stopping_criteria=StoppingCriteriaList([Raise(KeyboardInterrupt(), 2)])),
                              KeyboardInterrupt, CascadeConfig()),
        # 3 blocks of 16 tokens over both layers: the two prompts need 2 each
        "pool exhausted": (base, Exception, CascadeConfig(max_kv_bytes=3 * 2 * 2 * 16 * 2 * 16 * 8)),
    }


@pytest.mark.parametrize("failure", ["bad input", "stopping criterion", "KeyboardInterrupt", "pool exhausted"])
@pytest.mark.parametrize("filled", [False, True])
def test_failed_generate_leaves_cache_empty_and_reusable(llama_pair, failure, filled):
    stock, cascade = llama_pair
    kw, error, config = _failures(cascade)[failure]
    cache = CascadeCache(cascade.config, config)
    if filled and failure != "pool exhausted":          # a conversation in progress: its cache fails too
        ids, mask = kw["input_ids"], padded_batch(seed=16)[1]
        first = cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0,
                                 return_dict_in_generate=True, **cache_kw(cascade, cache))
        assert cache.get_seq_length() > 0 and returned_cache(first) is cache
        ids2, mask2 = next_turn(first.sequences, mask, seed=18)
        kw = dict(kw, input_ids=ids2, attention_mask=mask2)
        if failure == "bad input":
            kw["position_ids"] = torch.zeros(3, *ids2.shape, dtype=torch.long)
    with pytest.raises(error) as info:
        cascade.generate(**kw, **cache_kw(cascade, cache))
    if failure == "pool exhausted":
        assert "max_kv_bytes" in str(info.value) or "PoolExhausted" in type(info.value).__name__
    stats = cache.stats()
    assert (cache.get_seq_length(), cache.batch_size, stats.blocks_in_use) == (0, 0, 0)
    assert cache.blocks.refcount.sum() == 0
    # reusable: the next call gives stock's tokens
    ids, mask = padded_batch(seed=17)
    ok = dict(input_ids=ids[:1, -5:], num_beams=2, max_new_tokens=4, pad_token_id=0)   # fits the small pool too
    assert torch.equal(stock.generate(**ok), cascade.generate(**ok, **cache_kw(cascade, cache)))


# ---- refusals name an attention implementation the model has ---------------------------------------------

@pytest.mark.parametrize("config,expected", [
    (lambda: transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4), "eager"),
    (lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4), "eager"),
    # multi-head latent attention (StableLM was here: it routes its attention through the interface and is served)
    (lambda: transformers.DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                           moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                                           qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                                           num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1),
     "sdpa"),
], ids=["mamba", "bloom", "deepseek_v3_mla"])
def test_refusal_names_an_attention_the_model_has(config, expected):
    model = AutoModelForCausalLM.from_config(config(), attn_implementation="cascade").eval()
    assert generation.stock_attention(model) == expected
    with pytest.raises(NotImplementedError, match=f"attn_implementation='{expected}' instead") as info:
        model.generate(input_ids=torch.tensor([[3, 4, 5]]), max_new_tokens=2, pad_token_id=0)
    if expected == "eager":
        assert "sdpa" not in str(info.value)
        # and the model really loads with what the message names
        AutoModelForCausalLM.from_config(config(), attn_implementation=expected)
