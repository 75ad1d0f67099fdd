"""T5-family decode steps on the graph runner's static path (issue 21, item 2): a relative position bias replayed.

T5, mT5 and UMT5 decoders add a relative position bias to their self-attention scores, computed from the length the
cache reports; stock's DynamicCache reports a host int and returns K/V as wide as that length, which a replayed CUDA
graph would freeze. Where the decode steps run on the graph runner, hf_cascade.dense_cache.StaticSelfAttentionCache
holds the self K/V in buffers of the call's capacity written at a device position, reports that position as a device
tensor (the bias is computed from it on the device), follows beam reorders by a gather table on the device, and
gives the step's mask, which hf_cascade.patches.t5_mask hands to the decoder stack. On the CPU the runner's eager form
(``cuda_graphs="eager"``) runs that static path without capture; the tests also freeze every host length the decoder
could read in a decode step (as a replayed graph would) and still get stock's tokens. Every test checks that the
runner served the steps (no "disabled" reason, replays) inside transformers' loop (``return_dict_in_generate`` or a
processor of the caller's own keep it; the whole step on the device: tests/seq2seq/test_whole_step_t5.py). Tiny random models
in float64 (stock sdpa and eager, and cascade, same weights); beam search with flan-t5's usual settings (4 beams, no_repeat_ngram_size, length_penalty),
greedy and sampling, padded sources, decoder prompts longer than one token (padded too).

LongT5 is refused with the reason (its attention does not go through transformers' attention interface).

The ``gpu`` tests (run on the GPU machine: pytest -m gpu tests/seq2seq/test_t5_graphs.py) capture T5 decode steps on CUDA:
the replayed graph equals the eager static step bitwise in bf16, and float32 (TF32 off) equals stock, also with a
padded decoder prompt and two rooms (two layouts captured).
"""
from __future__ import annotations

import functools

import pytest
import torch
import transformers as T
from transformers import AutoModelForSeq2SeqLM

import hf_cascade  # noqa: F401  registers "cascade", applies the patches
from hf_cascade import cross_kv, dense_cache, seq2seq_models
from hf_cascade.config import CascadeConfig
from hf_cascade.patches import t5_mask

from conftest import RunnerSpy, assert_captured_matches_stock, assert_replay_equals_eager, host_loop
from test_seq2seq_graphs import assert_same, assert_served   # (the same NEW: 10 tokens)

VOCAB = 96
NEW = 10
# the runner's static steps; generate() below asks for the scores, which keeps transformers' loop around them (calls
# without scores add host_loop(); the whole step on the device: tests/seq2seq/test_whole_step_t5.py)
_STATIC = CascadeConfig(backend="reference", cuda_graphs="eager", block_size=4)


def _t5_like(cls, **extra):
    common = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=3, num_decoder_layers=3, num_heads=4,
                  relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=0,
                  eos_token_id=1, decoder_start_token_id=0,
                  initializer_factor=5.0)    # (stock's 1.0 makes tiny models repeat one token whatever the positions)
    common.update(extra)
    return lambda: cls(**common)


FAMILIES = {
    "t5": _t5_like(T.T5Config),
    "mt5": _t5_like(T.MT5Config),
    "umt5": _t5_like(T.UMT5Config),        # a bias in every layer's self-attention
    "flan-t5": _t5_like(T.T5Config, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}
MODES = {
    "beam": dict(num_beams=4, num_return_sequences=2, no_repeat_ngram_size=3, length_penalty=2.0, min_length=8),
    "greedy": dict(min_new_tokens=NEW),
    "sample": dict(do_sample=True, num_return_sequences=3, top_k=0),
}


@functools.lru_cache(maxsize=None)
def pair(family: str, stock_attention: str = "sdpa", dtype=torch.float64):
    torch.manual_seed(0)
    make = FAMILIES[family]
    stock = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation=stock_attention, dtype=dtype).eval()
    cascade = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="cascade", dtype=dtype).eval()
    cascade.load_state_dict(stock.state_dict())
    return stock, cascade


def sources(lengths=(13, 9, 5), seed=0):
    """Right-padded sources (as T5's tokenizer pads) of different lengths, and their mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=g)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def decoder_prompt(rows=3, lengths=(4, 4, 4), side="left", seed=9):
    """Decoder prompts starting with the decoder start token (0), padded to one width where lengths differ."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (rows, width), generator=g)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        cols = slice(width - length, width) if side == "left" else slice(0, length)
        mask[row, cols] = 1
        ids[row, cols.start] = 0
    return ids.masked_fill(mask == 0, 0), mask


def generate(model, mode, config=None, **inputs):
    """Inside transformers' loop (host_loop(): the runner's path) unless ``inputs`` bring processors of their own."""
    torch.manual_seed(1234)
    extra = {} if config is None else {"hf_cascade_config": config}
    return model.generate(**{**host_loop(), **inputs}, max_new_tokens=NEW, return_dict_in_generate=True,
                          output_scores=True, **MODES[mode], **extra)


class StaticSteps:
    """What a replayed graph needs of each static step, recorded: the K/V every self-attention layer gets (shape and
    address: the same every step), the length the model reads (a device tensor) and the stack's mask (the cache's)."""

    def __init__(self, monkeypatch):
        self.reads, self.lengths, self.masks = [], [], []
        cls = dense_cache.StaticSelfAttentionCache
        update, length, mask = cls.update, cls.get_seq_length, cls.static_step_mask

        def spy_update(cache, key_states, value_states, layer_idx, *args, **kwargs):
            keys, values = update(cache, key_states, value_states, layer_idx, *args, **kwargs)
            if cache.static_step_mask() is not None:
                self.reads.append((layer_idx, tuple(keys.shape), keys.data_ptr(), values.data_ptr()))
            return keys, values

        def spy_length(cache, *args, **kwargs):
            value = length(cache, *args, **kwargs)
            if cache.static_step_mask() is not None:
                self.lengths.append(value)
            return value

        def spy_mask(cache):
            value = mask(cache)
            if value is not None:
                self.masks.append((tuple(value.shape), value.data_ptr()))
            return value

        monkeypatch.setattr(cls, "update", spy_update)
        monkeypatch.setattr(cls, "get_seq_length", spy_length)
        monkeypatch.setattr(cls, "static_step_mask", spy_mask)


@pytest.fixture
def frozen_host_lengths(monkeypatch):
    """What a replayed graph does to whatever the decoder reads on the host in a decode step: the cache's host token
    counts answer, in every static step, the first static step's values (the device position and mask are the
    step's own). Yields the number of frozen steps."""
    frozen = []
    cls = dense_cache.StaticSelfAttentionCache
    prepare = cls.prepare_step

    def prepare_frozen(cache, *args, **kwargs):
        step = prepare(cache, *args, **kwargs)
        first = cache.__dict__.setdefault("_first_static_counts", list(cache._stored))
        true_counts, cache._stored = cache._stored, list(first)
        finish = step.finish

        def finish_thawed():
            if not step.finished:
                cache._stored = true_counts
            finish()

        step.finish = finish_thawed
        frozen.append(1)
        return step

    monkeypatch.setattr(cls, "prepare_step", prepare_frozen)
    yield frozen


# ---- token-exact with stock ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_static_steps_give_stock_tokens(family, mode, monkeypatch):
    stock, cascade = pair(family)
    ids, mask = sources()
    spy, steps = RunnerSpy(monkeypatch), StaticSteps(monkeypatch)
    want = generate(stock, mode, input_ids=ids, attention_mask=mask)
    got = generate(cascade, mode, _STATIC, input_ids=ids, attention_mask=mask)
    assert_same(want, got, mode)
    assert_served(spy)
    # every static step hands each layer K/V of one shape at one address, the length as a device tensor, one mask
    layers = cascade.config.num_decoder_layers
    assert len(steps.reads) >= layers * (NEW - 2) and len(set(steps.reads)) == layers, set(steps.reads)
    assert all(isinstance(length, torch.Tensor) for length in steps.lengths) and steps.lengths
    assert len(set(steps.masks)) == 1


@pytest.mark.parametrize("mode", ["beam", "greedy"])
@pytest.mark.parametrize("family", ["t5", "umt5"])
def test_eager_stock_attention_too(family, mode, monkeypatch):
    """Against stock's eager attention (its own scores, bias added before the softmax) as well as sdpa."""
    stock, cascade = pair(family, "eager")
    ids, mask = sources(lengths=(11, 4), seed=2)
    spy = RunnerSpy(monkeypatch)
    want = generate(stock, mode, input_ids=ids, attention_mask=mask)
    got = generate(cascade, mode, _STATIC, input_ids=ids, attention_mask=mask)
    assert torch.equal(want.sequences, got.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=0, atol=1e-9)
    assert_served(spy)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mode", ["beam", "greedy", "sample"])
@pytest.mark.parametrize("family", ["t5", "mt5", "umt5"])
def test_decoder_prompts_longer_than_one_token(family, mode, side, monkeypatch):
    """A decoder prompt of several tokens (the first forward stores it), and one padded to a common width (its pads
    masked in every static step, through beam reorders): stock's tokens."""
    stock, cascade = pair(family)
    ids, mask = sources()
    spy = RunnerSpy(monkeypatch)
    for lengths in ((4, 4, 4), (5, 2, 3)):
        decoder_ids, decoder_mask = decoder_prompt(lengths=lengths, side=side)     # one per input: generate expands
        inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                      decoder_attention_mask=decoder_mask)
        want = generate(stock, mode, **inputs)
        got = generate(cascade, mode, _STATIC, **inputs)
        assert_same(want, got, mode)
    assert_served(spy)


@pytest.mark.parametrize("mode", ["beam", "greedy"])
def test_room_follows_the_tokens(mode, monkeypatch):
    """The buffers' room starts small and widens as rows grow (each widening a new layout, its first step run anew),
    the last widening to the whole capacity; through beam reorders and a padded decoder prompt: stock's tokens."""
    monkeypatch.setattr(dense_cache.StaticSelfAttentionCache, "FIRST_ROOM", 4)
    rooms = []
    widen = dense_cache.StaticSelfAttentionCache._widen
    monkeypatch.setattr(dense_cache.StaticSelfAttentionCache, "_widen",
                        lambda self, *a: (widen(self, *a), rooms.append(self.room))[0])
    stock, cascade = pair("t5")
    ids, mask = sources()
    spy = RunnerSpy(monkeypatch)
    for lengths in ((1, 1, 1), (5, 2, 3)):
        decoder_ids, decoder_mask = decoder_prompt(lengths=lengths, side="left")
        inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                      decoder_attention_mask=decoder_mask)
        rooms.clear()
        want, got = generate(stock, mode, **inputs), generate(cascade, mode, _STATIC, **inputs)
        assert_same(want, got, mode)
        width = decoder_ids.shape[1]
        assert rooms == ([4, 8, NEW + width] if width == 1 else [5, 10, NEW + width]), rooms
    assert_served(spy, min_replays=NEW - 6)
    # a first step per layout the decode steps ran in: rooms 4, 8, 11; then 10, 15 (the prompt filled room 5)
    assert [runner.first_steps for runner in spy.runners] == [3, 2]


@pytest.mark.parametrize("mode", list(MODES))
def test_umt5_without_the_runner(mode, monkeypatch):
    """UMT5 (served from this issue on) also where no runner serves the steps: the dense cache of before."""
    stock, cascade = pair("umt5")
    ids, mask = sources()
    spy = RunnerSpy(monkeypatch)
    for config in (None, CascadeConfig(backend="reference", block_size=4)):
        assert_same(generate(stock, mode, input_ids=ids, attention_mask=mask),
                     generate(cascade, mode, config, input_ids=ids, attention_mask=mask), mode)
    assert not [r for r in spy.runners if r is not None]


def test_batch_of_one_and_many_beams(monkeypatch):
    stock, cascade = pair("t5")
    ids, mask = sources(lengths=(7,))
    spy = RunnerSpy(monkeypatch)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, num_beams=6, num_return_sequences=6,
              length_penalty=0.7)
    assert torch.equal(stock.generate(**kw), cascade.generate(**kw, hf_cascade_config=_STATIC, **host_loop()))
    assert_served(spy)


# ---- the cache, its memory and where it applies -----------------------------------------------------------------
def test_the_static_cache_runs_only_with_the_runner(monkeypatch):
    """On the CPU without cuda_graphs="eager" (no runner) T5 keeps the dense cache of before; with the runner the
    static one, its buffers the call's capacity wide; stock's tokens both ways."""
    stock, cascade = pair("t5")
    ids, mask = sources()
    made = []
    init = dense_cache.StaticSelfAttentionCache.__init__
    monkeypatch.setattr(dense_cache.StaticSelfAttentionCache, "__init__",
                        lambda self, *a, **k: (made.append(self), init(self, *a, **k))[1])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, num_beams=4)
    want = stock.generate(**kw)
    assert torch.equal(want, cascade.generate(**kw, hf_cascade_config=CascadeConfig(backend="reference")))
    assert not made
    assert torch.equal(want, cascade.generate(**kw, hf_cascade_config=_STATIC, **host_loop()))
    cache, = made
    assert cache.capacity == NEW + 1 and cache.rows == 3 * 4


def test_memory_of_the_static_buffers(monkeypatch):
    """The buffers cost 2 x layers x rows x capacity x heads x head_dim elements, plus one spare pair once beams are
    reordered (greedy: none); max_kv_bytes counts them and refuses a cap below them before they are made."""
    stock, cascade = pair("t5")
    ids, mask = sources()
    seen = []
    reset = dense_cache.StaticSelfAttentionCache.reset
    monkeypatch.setattr(dense_cache.StaticSelfAttentionCache, "reset",
                        lambda self: (seen.append(self.kv_bytes), reset(self))[1])
    config = cascade.config
    layers, heads, dim, item = config.num_decoder_layers, config.num_heads, config.d_kv, 8
    for mode, spares in (("beam", 1), ("greedy", 0)):
        rows = 3 * MODES[mode].get("num_beams", 1)
        seen.clear()
        generate(cascade, mode, _STATIC, input_ids=ids, attention_mask=mask)
        per_copy = rows * (NEW + 1) * heads * dim * item * 2
        assert seen[0] == per_copy * (layers + spares), (seen, per_copy)
    # max_kv_bytes: the buffers are counted before they are made, the spare pair before the first reorder makes it
    checks = []
    check = cross_kv.KVCap.check
    monkeypatch.setattr(cross_kv.KVCap, "check",
                        lambda cap, extra, what: (checks.append(extra), check(cap, extra, what))[1])
    capped = CascadeConfig(backend="reference", cuda_graphs="eager", max_kv_bytes=1 << 30)
    want = generate(stock, "beam", input_ids=ids, attention_mask=mask)
    assert torch.equal(want.sequences, generate(cascade, "beam", capped, input_ids=ids, attention_mask=mask).sequences)
    per_copy = 3 * 4 * (NEW + 1) * heads * dim * item * 2
    assert checks[-2:] == [per_copy * layers, per_copy], (checks, per_copy)
    with pytest.raises(hf_cascade.PoolExhausted, match="max_kv_bytes"):
        generate(cascade, "beam", CascadeConfig(backend="reference", cuda_graphs="eager", max_kv_bytes=per_copy),
                 input_ids=ids, attention_mask=mask)


def test_patch_relies_on_what_it_checks():
    """The stacks the patch serves on this transformers version, and what it checks of each (tests fail here first if
    upstream changes under it)."""
    assert t5_mask.is_applied() and set(t5_mask.applied_families()) == {"t5", "mt5", "umt5"}
    for name, stack, attention in t5_mask.FAMILIES:
        assert t5_mask.unchanged_reason(name, stack, attention) is None
        stack_cls = getattr(t5_mask._modeling(name), stack)
        assert hasattr(stack_cls.forward, "__hf_cascade_original__")
    for family in ("t5", "mt5", "umt5"):
        assert seq2seq_models.static_mask_reason(pair(family)[1]) is None


def test_longt5_is_refused_with_the_reason():
    """LongT5's attention does not go through transformers' attention interface (its modules compute it themselves):
    generate refuses it with the reason and the implementation to load instead."""
    config = T.LongT5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    assert "longt5" not in seq2seq_models.SUPPORTED
    model = AutoModelForSeq2SeqLM.from_config(config, attn_implementation="cascade").eval()
    ids, mask = sources()
    with pytest.raises(NotImplementedError, match="type 'longt5'.*attn_implementation='eager'"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=3)


# ---- on the GPU: captured and replayed ---------------------------------------------------------------------------
def _gpu_config():
    """A small flan-t5-shaped model (gated GELU, untied head)."""
    return T.T5Config(vocab_size=1000, d_model=256, d_kv=64, d_ff=512, num_layers=2, num_decoder_layers=2, num_heads=4,
                      feed_forward_proj="gated-gelu", tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                      decoder_start_token_id=0, initializer_factor=5.0)


def _gpu_pair(dtype):
    make = _gpu_config
    torch.manual_seed(0)
    stock = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="sdpa", dtype=dtype).cuda().eval()
    cascade = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="cascade", dtype=dtype).cuda().eval()
    cascade.load_state_dict(stock.state_dict())
    return stock, cascade


def _gpu_sources():
    lengths = torch.tensor([[400], [250], [96], [37]], device="cuda")
    ids = torch.randint(3, 990, (4, 400), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    mask = (torch.arange(400, device="cuda")[None, :] < lengths).long()
    return ids.masked_fill(mask == 0, 0), mask


_GPU_MODES = {"beam": dict(num_beams=4, num_return_sequences=2, no_repeat_ngram_size=3, length_penalty=2.0,
                           min_length=24),
              "greedy": dict(min_new_tokens=24)}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(_GPU_MODES))
def test_gpu_float32_captured_steps_match_stock(mode, monkeypatch, no_tf32):
    stock, cascade = _gpu_pair(torch.float32)
    ids, mask = _gpu_sources()
    assert_captured_matches_stock(stock, cascade, ids, mask, monkeypatch, **_GPU_MODES[mode])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(_GPU_MODES))
def test_gpu_bf16_replay_equals_eager_bitwise(mode, monkeypatch):
    """bf16: the replayed decode step gives bitwise the eager static step's tokens and scores."""
    _, cascade = _gpu_pair(torch.bfloat16)
    ids, mask = _gpu_sources()
    assert_replay_equals_eager(cascade, ids, mask, monkeypatch, **_GPU_MODES[mode])


@pytest.mark.gpu
def test_gpu_float32_padded_decoder_prompt_and_wider_rooms(monkeypatch):
    """A padded decoder prompt and 100 new tokens (two rooms: 64 positions, then the whole max_length, each layout
    captured): stock's tokens in float32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    stock, cascade = _gpu_pair(torch.float32)
    ids, mask = _gpu_sources()
    decoder_ids, decoder_mask = decoder_prompt(rows=4, lengths=(3, 1, 2, 3))
    kw = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids.cuda(),
              decoder_attention_mask=decoder_mask.cuda(), max_new_tokens=100, min_new_tokens=100,
              num_beams=4, no_repeat_ngram_size=3, length_penalty=2.0)
    want = stock.generate(**kw)
    spy = RunnerSpy(monkeypatch)
    got = cascade.generate(**kw)
    assert torch.equal(want, got)
    runner, = spy.runners
    assert runner.disabled is None and runner.captures >= 2 and runner.replays >= 90, \
        (runner.disabled, runner.captures, runner.replays)
