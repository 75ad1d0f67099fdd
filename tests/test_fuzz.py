"""Malformed generate calls, stock vs cascade (same weights, float64), ~100 per family from a seeded generator.

Each case starts from a valid call (a left-padded batch; greedy, sampling, beam search or beam sampling) and
applies one or two mutations: bad shapes, dtypes and values of ids and masks, ids out of the vocabulary,
zero/negative counts, wrong cache objects, bad or tight CascadeConfigs, bad position ids or embeddings.
The oracle, per case:

- both succeed: equal tokens (sampling from the same seed);
- both raise: fine, provided the cascade's error is not a bare internal one. An error raised inside
  hf_cascade (or its patches) must come from one of our own ``raise`` statements (a message naming the fix),
  never an IndexError/KeyError/AttributeError/RuntimeError/... from our code;
- only the cascade raises: only one of our own errors, and only for a mutation listed in ``REFUSED`` (inputs
  stock runs without complaint but reads wrongly, or cascade-only arguments such as a too small cap);
- only stock raises: never (the cascade must not accept what stock refuses... except cascade-only arguments,
  which stock does not get);

and after every case the next valid call gives stock's tokens (nothing a failed call leaves behind leaks into
the next). ``-m slow`` runs 500 cases per family.
"""
from __future__ import annotations

import linecache
import os
import random

import pytest
import torch
import transformers as T
from transformers import AutoModelForSeq2SeqLM, DynamicCache

import hf_cascade
from hf_cascade import CascadeCache
from conftest import VOCAB, cache_kw, model_pair

OURS = (os.path.dirname(hf_cascade.__file__), os.path.join(os.path.dirname(os.path.dirname(hf_cascade.__file__)),
                                                            "patches"))
# mutations the cascade may refuse (with one of its own messages) where stock runs:
REFUSED = {
    "mask_wide",        # stock reads the mask of other positions (its tokens are not those of any right input)
    "mask_4d",          # custom 4D masks: the cascade prefill takes padding masks only
    "mask_right",       # right padding in a decoder-only batch (issue 18 item 9: refused until it runs)
    "mask_hole",        # a zero inside a prompt: not left padding
    "config",           # hf_cascade_config values (stock does not get them)
    "cap",              # a max_kv_bytes too small for the call: PoolExhausted
    "cascade_cache",    # a CascadeCache that cannot serve this call (filled by beam search, another model)
    "cache_and_config",  # a CascadeCache and a different hf_cascade_config
    "decoder_mask",     # a padded decoder prompt (encoder-decoder; item 9)
    "positions",        # position_ids of another width than the ids (stock runs them, reading past the prompt)
    "mask_1d", "mask_rows", "mask_narrow",   # a mask of the wrong shape, which stock broadcasts over the ids
    "return_sequences",  # beam search with num_return_sequences -1: stock returns rows that belong to no prompt
}
# refusals of one family's path where stock runs, each with a message naming the fix (hf_cascade's known limits)
REFUSED_BY_FAMILY = {
    # a window shorter than a padded batch's prompts (attention.py: "a sliding window ... exceeded")
    "mistral-window": {"mask_zero_row"},
    # an input with no real encoder token ("remove it from the batch")
    "bart": {"mask_zero_row"},
    "t5": {"mask_zero_row"},
}


def _seq2seq_pair(family: str):
    def config():
        if family == "t5":
            return T.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                              num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                              pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
        return T.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                            decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
                            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                            decoder_start_token_id=2, forced_bos_token_id=None, forced_eos_token_id=None)
    torch.manual_seed(0)
    stock = AutoModelForSeq2SeqLM.from_config(config(), attn_implementation="sdpa", dtype=torch.float64).eval()
    cascade = AutoModelForSeq2SeqLM.from_config(config(), attn_implementation="cascade", dtype=torch.float64).eval()
    cascade.load_state_dict(stock.state_dict())
    return stock, cascade


FAMILIES = {
    "llama": lambda: model_pair("llama"),
    "mistral-window": lambda: model_pair("mistral", sliding_window=6),
    "bart": lambda: _seq2seq_pair("bart"),
    "t5": lambda: _seq2seq_pair("t5"),
}
MODES = {"greedy": {}, "sample": dict(do_sample=True, top_k=0, num_return_sequences=2),
         "beam": dict(num_beams=3, num_return_sequences=2), "beam_sample": dict(num_beams=2, do_sample=True)}


def _batch(rng: random.Random, side="left"):
    rows, width = rng.choice([1, 2, 3]), rng.randint(3, 14)
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    ids = torch.randint(3, VOCAB, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    for row in range(1, rows):
        pad = rng.randint(0, width - 1)
        cols = slice(0, pad) if side == "left" else slice(width - pad, width)
        mask[row, cols] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _valid(rng: random.Random, seq2seq: bool):
    ids, mask = _batch(rng, "right" if seq2seq else "left")
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=rng.choice([1, 2, 4]), pad_token_id=0)
    kw.update(MODES[rng.choice(list(MODES))])
    return kw


def _mutate(rng: random.Random, kw: dict, model, seq2seq: bool, kind: str, ids, mask):
    """Apply mutation ``kind`` to the call ``kw`` (whose valid ids and mask were ``ids``, ``mask``); returns
    (cascade-only extra kwargs, stock-only extra kwargs)."""
    rows, width = ids.shape
    extra, stock_extra = {}, {}
    if kind == "ids_float":
        kw["input_ids"] = ids.double()
    elif kind == "ids_1d":
        kw["input_ids"], kw["attention_mask"] = ids[0], mask[0]
    elif kind == "ids_3d":
        kw["input_ids"] = ids[..., None]
    elif kind == "ids_oob":
        kw["input_ids"] = ids.clone()
        kw["input_ids"][rng.randrange(rows), -1] = rng.choice([VOCAB, VOCAB + 7, -1])
    elif kind == "ids_empty":
        kw["input_ids"], kw["attention_mask"] = ids[:, :0], mask[:, :0]
    elif kind == "mask_wide":
        kw["attention_mask"] = torch.cat([torch.ones(rows, rng.randint(1, 5), dtype=mask.dtype), mask], 1)
    elif kind == "mask_narrow":
        kw["attention_mask"] = mask[:, rng.randint(1, width):]
    elif kind == "mask_rows":
        kw["attention_mask"] = torch.cat([mask, mask[:1]]) if rng.random() < 0.5 or rows == 1 else mask[1:]
    elif kind == "mask_1d":
        kw["attention_mask"] = mask[0]
    elif kind == "mask_4d":
        kw["attention_mask"] = mask[:, None, None, :].expand(rows, 1, width, width).clone()
    elif kind == "mask_dtype":
        kw["attention_mask"] = mask.to(rng.choice([torch.bool, torch.float32, torch.float64, torch.int32]))
    elif kind == "mask_none":
        kw.pop("attention_mask")
    elif kind == "mask_zero_row":
        kw["attention_mask"] = mask.clone()
        kw["attention_mask"][rng.randrange(rows)] = 0
    elif kind == "mask_right":
        kw["attention_mask"] = mask.clone()
        kw["attention_mask"][-1, -rng.randint(1, max(1, width - 1)):] = 0
    elif kind == "mask_hole":
        kw["attention_mask"] = mask.clone()
        kw["attention_mask"][0, rng.randrange(width)] = 0
    elif kind == "beams":
        kw["num_beams"] = rng.choice([0, -1, -3, 2.0, 1])
        kw.pop("num_return_sequences", None)
    elif kind == "return_sequences":
        kw["num_return_sequences"] = rng.choice([0, -1, 5])
    elif kind == "new_tokens":
        kw["max_new_tokens"] = rng.choice([0, -1, -5])
    elif kind == "sampling_values":
        kw.update(do_sample=True, **rng.choice([dict(top_k=-1), dict(temperature=0.0), dict(temperature=-1.0),
                                                dict(top_p=1.5), dict(top_p=0.0)]))
    elif kind == "token_ids":
        kw.update(rng.choice([dict(eos_token_id=VOCAB + 3), dict(pad_token_id=VOCAB + 1), dict(pad_token_id=None),
                              dict(eos_token_id=[5, 6]), dict(min_new_tokens=9)]))
    elif kind == "cache_dynamic":
        cache = DynamicCache(config=model.config) if not seq2seq else None
        if cache is not None:
            extra.update(cache_kw(model, cache))
            stock_extra.update(cache_kw(model, DynamicCache(config=model.config)))
    elif kind == "cache_junk":
        junk = rng.choice(["a cache", 3, (torch.zeros(1),)])
        extra.update(cache_kw(model, junk))
        stock_extra.update(cache_kw(model, junk))
    elif kind == "cascade_cache":
        cache = CascadeCache(model.config)
        if rng.random() < 0.5:
            cache.model_fingerprint = ("AnotherModel", 1, 1, 1, 1)
        extra.update(cache_kw(model, cache))
    elif kind == "cache_and_config":
        extra.update(cache_kw(model, CascadeCache(model.config)), hf_cascade_config={"block_size": 4})
    elif kind == "config":
        extra["hf_cascade_config"] = rng.choice([
            {"block_size": 0}, {"blocksize": 4}, "reference", {"backend": "cdua"}, {"memory": "static"}, 5,
            {"block_size": 10 ** 9}, {"max_kv_bytes": -1}, {"cuda_graphs": "yes"},
            {"block_size": 4}, {"backend": "reference"}, {"min_prefix_tokens": 3}, {"cuda_graphs": "eager"},
            {"whole_step": False}, {"max_kv_bytes": 10 ** 7}, {"compile": True}])
    elif kind == "cap":
        extra["hf_cascade_config"] = {"block_size": 4, "max_kv_bytes": rng.choice([1, 1000, 20000, 60000])}
    elif kind == "positions" and not seq2seq:
        kw["position_ids"] = torch.arange(width + rng.choice([-2, 3]))[None].expand(rows, -1).clone()
    elif kind == "embeds" and not seq2seq:
        hidden = model.config.hidden_size + rng.choice([0, 0, 5])
        kw["inputs_embeds"] = torch.randn(rows, width, hidden, dtype=torch.float64,
                                          generator=torch.Generator().manual_seed(rng.randrange(2 ** 31)))
        if rng.random() < 0.7:
            kw.pop("input_ids")
    elif kind == "outputs":
        kw.update(return_dict_in_generate=True, output_scores=True,
                  **rng.choice([dict(output_hidden_states=True), dict(output_attentions=True), {}]))
    elif kind == "no_cache":
        kw["use_cache"] = False
    elif kind == "decoder_inputs" and seq2seq:
        start = model.config.decoder_start_token_id
        dec = torch.full((rows + rng.choice([0, 0, 1]), rng.randint(1, 3)), start, dtype=torch.long)
        kw["decoder_input_ids"] = dec
        if rng.random() < 0.5:
            kw["decoder_attention_mask"] = torch.ones_like(dec)
    elif kind == "decoder_mask" and seq2seq:
        dec = torch.full((rows, 3), model.config.decoder_start_token_id, dtype=torch.long)
        kw["decoder_input_ids"], kw["decoder_attention_mask"] = dec, torch.ones_like(dec)
        kw["decoder_attention_mask"][0, 0] = 0
    return extra, stock_extra


KINDS = ["ids_float", "ids_1d", "ids_3d", "ids_oob", "ids_empty", "mask_wide", "mask_narrow", "mask_rows", "mask_1d",
         "mask_4d", "mask_dtype", "mask_none", "mask_zero_row", "mask_right", "mask_hole", "beams", "return_sequences",
         "new_tokens", "sampling_values", "token_ids", "cache_dynamic", "cache_junk", "cascade_cache",
         "cache_and_config", "config", "cap", "positions", "embeds", "outputs", "no_cache", "decoder_inputs",
         "decoder_mask"]


def _run(model, kw):
    torch.manual_seed(1234)
    try:
        out = model.generate(**kw)
    except Exception as err:  # noqa: BLE001 — the oracle judges it
        return None, err
    return (out if isinstance(out, torch.Tensor) else out.sequences), None


def _raised_by_us(err: BaseException):
    """(frame file, line) where ``err`` was raised if inside hf_cascade or its patches, else None."""
    tb, last = err.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return None
    path = os.path.abspath(last.tb_frame.f_code.co_filename)
    return (path, last.tb_lineno) if path.startswith(OURS) else None


def _helpful(err: BaseException) -> bool:
    """One of our own ``raise`` statements (its error type one a caller can act on), not an internal crash."""
    where = _raised_by_us(err)
    if where is None:
        return False
    if isinstance(err, (IndexError, KeyError, AttributeError, ZeroDivisionError, AssertionError, RecursionError)):
        return False
    lines = [linecache.getline(where[0], n) for n in range(max(1, where[1] - 3), where[1] + 1)]
    return any("raise " in line for line in lines) and len(str(err)) > 30


def _judge(case, kinds, got, got_err, expected, expected_err, refused=REFUSED) -> str | None:
    if got_err is None and expected_err is None:
        same = got.shape == expected.shape and torch.equal(got, expected)
        return None if same else f"{case}: tokens differ from stock"
    if got_err is not None and _raised_by_us(got_err) is not None and not _helpful(got_err):
        return f"{case}: un-helpful error from inside hf_cascade: {type(got_err).__name__}: {got_err}"
    if got_err is not None and expected_err is None:
        if _helpful(got_err) and set(kinds) & refused:
            return None
        return f"{case}: cascade raised where stock ran: {type(got_err).__name__}: {got_err}"
    if got_err is None:
        return f"{case}: stock raised ({type(expected_err).__name__}: {expected_err}) where the cascade ran"
    return None


def fuzz(family: str, cases: int, seed: int = 0) -> tuple[list[str], int]:
    """Runs ``cases`` malformed calls; returns the oracle's complaints and how many calls raised in the cascade."""
    stock, cascade = FAMILIES[family]()
    seq2seq = cascade.config.is_encoder_decoder
    rng = random.Random(f"{family}-{seed}")
    problems, raised = [], 0
    for case in range(cases):
        kw = _valid(rng, seq2seq)
        kinds = rng.sample(KINDS, rng.choice([1, 1, 2]))
        extra, stock_extra = {}, {}
        ids, mask = kw["input_ids"], kw["attention_mask"]
        for kind in kinds:
            e, s = _mutate(rng, kw, cascade, seq2seq, kind, ids, mask)
            extra.update(e)
            stock_extra.update(s)
        label = f"{family} #{case} {kinds}"
        expected, expected_err = _run(stock, {**kw, **stock_extra})
        got, got_err = _run(cascade, {**kw, **extra})
        raised += got_err is not None
        problem = _judge(label, kinds, got, got_err, expected, expected_err,
                         REFUSED | REFUSED_BY_FAMILY.get(family, set()))
        if problem:
            problems.append(problem)
        check = _valid(rng, seq2seq)                # the next valid call equals stock's
        after, after_err = _run(cascade, check)
        reference, _ = _run(stock, check)
        if after_err is not None or not torch.equal(after, reference):
            problems.append(f"{label}: the next valid call after it "
                            + (f"raised {type(after_err).__name__}: {after_err}" if after_err else "differs"))
    return problems, raised


@pytest.mark.parametrize("family", list(FAMILIES))
def test_malformed_calls(family):
    problems, _ = fuzz(family, cases=100)
    assert not problems, "\n".join(problems[:20]) + f"\n({len(problems)} problems in 100 cases)"


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_malformed_calls_many(family):
    problems, _ = fuzz(family, cases=500, seed=1)
    assert not problems, "\n".join(problems[:20]) + f"\n({len(problems)} problems in 500 cases)"
