"""``CascadeConfig(compile=True)``: the graph runner compiles the whole decode forward as one graph.

On a static decode step the forward (every layer's cache write and cascade attention included) traces with
``fullgraph=True``: the step context is an argument, each layer's attention is bound once on the decode layout, and
no guard depends on what changes every step, so nothing recompiles per layer, per step or per call.

CPU: the runner's static path without capture (``cuda_graphs="eager"``) with inductor; the reference backend runs.
Compiled tokens equal the uncompiled step's and stock's (float64, and float32 for Llama) for decoder-only families
with GQA, biases, sliding windows and softcap; a forward that cannot trace runs uncompiled, logged. GPU
(``pytest -m gpu tests/decode/test_compile.py``): compiled + captured equals uncompiled captured (float32, TF32 off; bf16
on our kernels: the scores agree within bf16 rounding) on a 12-layer model, and the compile count stays put over
three calls.

Run these under transformers 5.17 too (the context then reaches the attention only as the forward's argument).
"""
from __future__ import annotations

import logging
import re

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_cascade
from hf_cascade import CascadeConfig, graphs, kernels, logs
from hf_cascade.kernels import reference

from conftest import RunnerSpy, cache_kw, host_loop, padded_batch
from test_families import FAMILIES, PROMPTS
from test_gpu_graphs import _batch

NEW = 7
CASES = {"beam": dict(num_beams=4, num_return_sequences=2), "greedy": dict(do_sample=False)}


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()       # no compiled code (nor counters) carried over from another test
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


class CompiledCalls:
    """The calls of the compiled forwards the runners make (``graphs._compiled``): with ``fullgraph`` a call either
    runs the compiled graph (counted in ``calls``) or raises (kept in ``failures``; the runner then runs the plain
    forward for the rest of the call)."""

    def __init__(self, monkeypatch):
        self.calls, self.failures = 0, []
        real = graphs._compiled

        def compiled(forward, compile=True):
            fn = real(forward, compile)

            def counted(*args, **kwargs):
                try:
                    out = fn(*args, **kwargs)
                except Exception as err:
                    self.failures.append(err)
                    raise
                self.calls += 1
                return out
            return counted

        monkeypatch.setattr(graphs, "_compiled", compiled)

    def check(self, calls=None) -> None:
        assert not self.failures, f"the compiled forward failed, the step ran uncompiled: {self.failures[0]!r}"
        assert self.calls >= 1 if calls is None else self.calls == calls, self.calls


def _pair(name, dtype=None, **overrides):
    """(stock, cascade) models of FAMILIES[name] with the same random weights."""
    family = FAMILIES[name]
    dtype = dtype or family.dtype

    def make():
        config = family.make()
        for key, value in overrides.items():
            setattr(config, key, value)
        return config

    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(make(), attn_implementation=family.stock or "sdpa", dtype=dtype).eval()
    cascade = AutoModelForCausalLM.from_config(make(), attn_implementation="cascade", dtype=dtype).eval()
    cascade.load_state_dict(stock.state_dict())
    return stock, cascade


def _cascade_kwargs(model, case, config: CascadeConfig) -> dict:
    # greedy shares nothing and would run on stock's own path: a cache of our own keeps it on the cascade
    if case == "greedy":
        return cache_kw(model, hf_cascade.CascadeCache(model.config, config))
    return dict(hf_cascade_config=config)


def _generate(model, ids, mask, case, config=None, **more):
    kw = dict(max_new_tokens=NEW, **CASES[case], **more)
    extra = {} if config is None else _cascade_kwargs(model, case, config)
    return model.generate(input_ids=ids, attention_mask=mask, **kw, **extra)


@pytest.mark.parametrize("chooser", ["device", "host"])
@pytest.mark.parametrize("family, case", [("Llama", "beam"), ("Llama", "greedy"), ("Qwen2", "beam"),
                                          ("Mistral", "beam"), ("Gemma2", "beam"), ("Gemma2", "greedy")])
def test_compiled_step_equals_uncompiled_and_stock(fresh_dynamo, monkeypatch, family, case, chooser):
    """Llama (GQA), Qwen2 (biases), Mistral (a window shorter than the sequences), Gemma2 (softcap, hybrid windowed
    layers, float32 as in test_families): one graph, no break, every decode step but the first (on the host path) run
    compiled — with the token choice on the device and on the host (a processor of the user's own)."""
    stock, cascade = _pair(family)
    ids, mask = padded_batch(seed=5, lengths=PROMPTS)
    expected = _generate(stock, ids, mask, case)
    loop = {} if chooser == "device" else host_loop()
    uncompiled = _generate(cascade, ids, mask, case, CascadeConfig(cuda_graphs="eager"), **loop)
    spy, compiled_calls = RunnerSpy(monkeypatch), CompiledCalls(monkeypatch)
    got = _generate(cascade, ids, mask, case, CascadeConfig(cuda_graphs="eager", compile=True), **loop)
    assert torch.equal(uncompiled, expected)
    assert torch.equal(got, expected)
    runner, = spy.runners
    assert runner.disabled is None
    compiled_calls.check(calls=runner.device_steps)     # the first step on the host path (plain forward)
    assert runner.device_steps == NEW - 1
    assert not counters["graph_break"], dict(counters["graph_break"])
    # the forward, its block bookkeeping and (on the device) its token choice, one graph each
    assert counters["stats"]["unique_graphs"] == (3 if chooser == "device" else 2)


def test_no_recompile_per_layer_step_or_call(fresh_dynamo, monkeypatch, caplog):
    """12 layers (past dynamo's default recompile limit of 8, which a per-layer recompile would hit), three calls
    of beam search in float32 with recompiling made an error: one graph for all of them, and its tokens equal the
    uncompiled step's (and stock's). The whole step compiles its block bookkeeping and token choice once each too (a
    recompile of those would fall back to the plain functions, logged: none is)."""
    stock, cascade = _pair("Llama", dtype=torch.float32, num_hidden_layers=12)
    ids, mask = padded_batch(seed=6, lengths=PROMPTS)
    expected = _generate(stock, ids, mask, "beam")
    uncompiled = _generate(cascade, ids, mask, "beam", CascadeConfig(cuda_graphs="eager"))
    compiled_calls = CompiledCalls(monkeypatch)
    monkeypatch.setattr(logs, "_logged", set())         # every log-once line shows again
    graph_counts = []
    with torch._dynamo.config.patch(error_on_recompile=True):     # a recompile fails the compiled call
        for _ in range(3):
            got = _generate(cascade, ids, mask, "beam", CascadeConfig(cuda_graphs="eager", compile=True))
            assert torch.equal(got, uncompiled)
            graph_counts.append(counters["stats"]["unique_graphs"])
    assert torch.equal(uncompiled, expected)
    # the whole step (the default): each call's first step on the host path, its NEW - 1 device steps compiled
    compiled_calls.check(calls=3 * (NEW - 1))
    assert graph_counts == [3, 3, 3]          # the forward, the bookkeeping, the token choice
    assert not counters["graph_break"]
    assert not [r.getMessage() for r in caplog.records if "failed to compile" in r.getMessage()]


# prompt lengths of one evaluation loop (rows of (n, n - 3) tokens, left-padded); from 20 on each prompt stores a full
# block (block_size 16, the prompt less its last token) that its beams share
LENGTHS = (5, 10, 15, 20, 25, 30, 35, 40)


@pytest.mark.parametrize("case", list(CASES))
def test_no_recompile_per_prompt_length(fresh_dynamo, monkeypatch, case):
    """An evaluation loop over 8 prompt lengths compiles once per batch shape, not once per length: the static step's
    shapes that follow the prompt's length (block-table widths, the pool's and the checks' counts, the token choice's
    sequence buffers) are bucketed (``plan.shape_bucket``: powers of two, at least 16 blocks / 256 tokens), and its
    values that follow it (the layout's token limit, the prompt and maximum lengths of the token choice) are tensors
    or, where the model's Python reads one, a length of the layout's shapes (``DecodeLayout.mask_length``). Before:
    3 graphs per length (24 over the 8), recompiled on ``state.config.max_length``, ``blocks.token_limit``,
    ``plan.layout.token_limit`` and the tables' widths. Now: greedy 3 graphs for all 8 lengths; beam search 2 more
    once, when the prompts come to share a block (the plan gains a prefix level: another graph, not another length),
    none after. Every call gives stock's tokens. The whole step's kept selection tensors and its bookkeeping's shapes
    are the same for every length of a bucket (on a GPU the captured step is what these shapes allow to replay)."""
    from hf_cascade import whole_step
    stock, cascade = _pair("Llama", torch.float32)
    spy, compiled_calls = RunnerSpy(monkeypatch), CompiledCalls(monkeypatch)
    shape_keys = []
    real_take = whole_step.BlocksHold.take.__func__

    def take(cls, loop):
        held, reason = real_take(cls, loop)
        if held is not None:
            shape_keys.append(held.key[2:4])     # (scalars, tensor shapes): the key less the layout serial and pools
        return held, reason

    monkeypatch.setattr(whole_step.BlocksHold, "take", classmethod(take))
    graph_counts, kept_states = [], []
    for n in LENGTHS:
        ids, mask = padded_batch(seed=n, lengths=(n, n - 3))
        want = _generate(stock, ids, mask, case)
        got = _generate(cascade, ids, mask, case, CascadeConfig(cuda_graphs="eager", compile=True))
        assert torch.equal(got, want), n
        graph_counts.append(counters["stats"]["unique_graphs"])
        kept = spy.runners[-1].whole_step_kept
        kept_states.append(None if kept is None else (kept.call_key, tuple(kept.state.sequences.shape)))
    compiled_calls.check()
    assert not counters["graph_break"], dict(counters["graph_break"])
    shared = [i for i, n in enumerate(LENGTHS) if n >= 20]
    if case == "greedy":
        assert graph_counts == [3] * len(LENGTHS), graph_counts
        assert len(set(shape_keys)) == 1, shape_keys
    else:
        assert graph_counts == [3, 3, 3] + [5] * len(shared), graph_counts
        # one runner kept for all the calls, one call key (the selection's shapes less its lengths: a kept step of a
        # layout that serves a later call refills its tensors), one shape of the bookkeeping for every length that
        # shares a block
        assert len({id(r) for r in spy.runners}) == 1
        assert len(set(kept_states)) == 1, kept_states
        assert len(set(shape_keys[-len(shared):])) == 1, shape_keys


@pytest.mark.parametrize("case", list(CASES))
def test_float32_compiled_equals_uncompiled(fresh_dynamo, monkeypatch, case):
    stock, cascade = _pair("Llama", dtype=torch.float32)
    ids, mask = padded_batch(seed=7, lengths=PROMPTS)
    uncompiled = _generate(cascade, ids, mask, case, CascadeConfig(cuda_graphs="eager"))
    compiled_calls = CompiledCalls(monkeypatch)
    got = _generate(cascade, ids, mask, case, CascadeConfig(cuda_graphs="eager", compile=True))
    compiled_calls.check(calls=NEW - 1)        # (the whole step's first step runs on the host path, uncompiled)
    assert torch.equal(got, uncompiled)
    assert torch.equal(got, _generate(stock, ids, mask, case))


def test_a_forward_that_cannot_trace_runs_uncompiled_logged(fresh_dynamo, monkeypatch, caplog):
    """A host read inside the traced step (here: the attention reading a value of a tensor) is a graph break, which
    fullgraph refuses: the runner logs it once and runs the plain forward, with the same tokens."""
    monkeypatch.setattr(logs, "_logged", set())
    stock, cascade = _pair("Llama")
    ids, mask = padded_batch(seed=8, lengths=PROMPTS)
    expected = _generate(stock, ids, mask, "beam")
    real = reference.BACKEND.forward

    def forward_with_a_host_read(q, pool, metadata, params):
        if float(q.abs().sum()) < 0:        # never true, but a value read on the host
            raise AssertionError
        return real(q, pool, metadata, params)

    monkeypatch.setattr(reference.BACKEND, "forward", forward_with_a_host_read)
    compiled_calls = CompiledCalls(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="hf_cascade"):
        got = _generate(cascade, ids, mask, "beam", CascadeConfig(cuda_graphs="eager", compile=True))
    assert torch.equal(got, expected)
    assert len(compiled_calls.failures) == 1 and compiled_calls.calls == 0      # tried once, then uncompiled
    lines = [r.getMessage() for r in caplog.records if "compile=True) failed" in r.getMessage()]
    assert len(lines) == 1 and "decode runs uncompiled" in lines[0], lines


def test_the_cache_write_is_one_in_place_operator_on_the_pool(fresh_dynamo, monkeypatch):
    """Each layer's K/V write runs in the compiled code as the ``hf_cascade::write_slots`` operator on the pool the
    graph was given (reinplaced: no copy of the pool); an inductor kernel of its own would be autotuned on first use,
    which copies the pool to the host (out of memory for a CUDA virtual-memory pool on an H200)."""
    from torch._inductor.utils import run_and_get_code
    _, cascade = _pair("Llama", torch.float32)
    ids, mask = padded_batch(seed=3, lengths=PROMPTS)
    expected = _generate(cascade, ids, mask, "beam", CascadeConfig(cuda_graphs="eager"))
    got, codes = run_and_get_code(
        lambda: _generate(cascade, ids, mask, "beam", CascadeConfig(cuda_graphs="eager", compile=True)))
    assert torch.equal(got, expected)
    code = "\n".join(codes)
    writes = re.findall(r"torch\.ops\.hf_cascade\.write_slots\.default\((\w+),", code)
    assert len(writes) == cascade.config.num_hidden_layers, writes
    assert all(re.fullmatch(r"arg\d+_1", pool) for pool in writes), writes     # a graph input, not a copy of one


@pytest.mark.parametrize("family", ["bart", "marian", "m2m_100"])
def test_seq2seq_whole_step_compiles_and_gives_stock_tokens(fresh_dynamo, monkeypatch, caplog, family):
    """BART-family decoders compile whole too (float64, beam search with bart-large-cnn's settings): the device
    positions reach the embedding while dynamo traces (patches/positions.py), and the cache length the decoder reads
    is the layout's, so nothing recompiles per step or per call: the forward, the bookkeeping and the token choice, one
    graph each, every device step compiled; stock's tokens."""
    from test_seq2seq_graphs import MODES, pair, sources
    monkeypatch.setattr(logs, "_logged", set())         # every log-once line shows again
    stock, cascade = pair(family)
    spy, compiled_calls = RunnerSpy(monkeypatch), CompiledCalls(monkeypatch)
    # a second call of other sources (other tokens and lengths, the same batch shape) reuses the compiled graphs:
    # its cross-attention plan is new, and nothing guards on the first call's
    for lengths, seed in (((13, 9, 5), 0), ((7, 13, 11), 1)):
        ids, mask = sources(lengths, seed=seed)
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, **MODES["beam"])
        want = stock.generate(**kw)
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = cascade.generate(**kw, hf_cascade_config=CascadeConfig(backend="reference", cuda_graphs="eager",
                                                                         compile=True))
        assert torch.equal(want, got)
    for runner in spy.runners:
        assert runner.device_steps >= NEW - 2, runner.device_steps
    compiled_calls.check(calls=sum(runner.device_steps for runner in spy.runners))
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"]
    assert not [r.getMessage() for r in caplog.records if "compile" in r.getMessage() and "fail" in r.getMessage()]


def test_a_static_layout_binds_each_layer_once(monkeypatch):
    """Eager static steps choose each layer's backend once for the layout (then one lookup per layer and step); the
    window decision holds for the layout (Mistral's window of 12 is passed during the call)."""
    stock, cascade = _pair("Mistral")
    ids, mask = padded_batch(seed=9, lengths=PROMPTS)
    selected = []
    real = kernels.select

    def select(name, q, pool, plan=None, params=None):
        selected.append((plan is not None and plan.static, params.window))
        return real(name, q, pool, plan, params)

    monkeypatch.setattr(kernels, "select", select)
    got = _generate(cascade, ids, mask, "beam", CascadeConfig(cuda_graphs="eager"))
    assert torch.equal(got, _generate(stock, ids, mask, "beam"))
    static = [window for is_static, window in selected if is_static]
    # one layout: its layers' shape chosen once for all its steps (planned anew, once per step)
    assert static == [12]


def test_the_cuda_backend_traces_to_its_typed_operators(fresh_dynamo):
    """The cuda backend's forward inside a compiled graph, on the CPU with fake CUDA tensors: one graph (fullgraph)
    holding its operators (prefix, suffix, merge), whose fake implementations check the launch arguments;
    nothing of the eager path (the library, the stream, an address) is touched, which fake tensors would refuse."""
    from types import SimpleNamespace
    from torch._subclasses.fake_tensor import FakeTensorMode
    from hf_cascade.kernels import cuda as cuda_backend
    from hf_cascade.kernels.base import AttentionParams
    from test_kernel_ops import layout

    graphs_seen = []

    def keep(gm, example_inputs):
        graphs_seen.append(gm)
        return gm.forward

    with FakeTensorMode(allow_non_fake_inputs=True):
        a = layout(device="cuda")
        dp = SimpleNamespace(group_rows=a["group_rows"], prefix_table=a["prefix_table"], prefix_len=a["prefix_len"],
                             suffix_table=a["suffix_table"], q_limit=a["q_limit"])
        state = cuda_backend._StepState(
            has_prefix=True, m_tile=a["m_tile"], row_tiles=a["row_tiles"], chunk_tokens=a["chunk_tokens"],
            max_chunks=a["max_chunks"], split_tokens=a["split_tokens"], nsplit=a["nsplit"],
            slots=a["max_chunks"] + a["nsplit"], row_nchunks=a["row_nchunks"], part_o=a["part_o"],
            part_lse=a["part_lse"], dp=dp)
        sinks = torch.empty(a["q"].shape[2], device="cuda")
        params = AttentionParams(0.1, softcap=30.0, window=64, sinks=sinks)

        def layer(q, pool):
            return cuda_backend.BACKEND.forward(q * 2, pool, state, params)

        out = torch.compile(layer, backend=keep, fullgraph=True)(a["q"], a["pool"])
    assert tuple(out.shape) == tuple(a["q"].shape) and out.is_cuda
    kernels_in_graph = [str(n.target) for n in graphs_seen[0].graph.nodes if str(n.target).startswith("hf_cascade.")]
    assert kernels_in_graph == ["hf_cascade.prefix", "hf_cascade.suffix", "hf_cascade.merge"]


# ------------------------------------------------------------------------------------- regional compilation

def layer_graphs() -> int:
    """The graphs dynamo holds for the one compiled decoder layer (:func:`hf_cascade.regional.region`): measured, its
    cache entries."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from hf_cascade import regional
    return len(_debug_get_cache_entry_list(regional._layer_forward.__code__))


class RegionCalls:
    """How many decoder-layer calls ran the compiled layer (:func:`hf_cascade.regional.region`), by layer class."""

    def __init__(self, monkeypatch):
        from hf_cascade import regional
        self.calls: list = []
        real = regional.region

        def region(options):
            fn = real(options)

            def counted(layer, args, kwargs):
                self.calls.append(type(layer).__name__)
                return fn(layer, args, kwargs)
            return counted

        monkeypatch.setattr(regional, "region", region)


def _layered(name, layers, **overrides):
    """(stock, cascade) of FAMILIES[name] in float32 with ``layers`` layers (``layer_types`` repeated to them)."""
    types = FAMILIES[name].make().layer_types if hasattr(FAMILIES[name].make(), "layer_types") else None
    if types is not None and "layer_types" not in overrides:
        overrides["layer_types"] = [types[i % len(types)] for i in range(layers)]
    return _pair(name, torch.float32, num_hidden_layers=layers, **overrides)


@pytest.mark.parametrize("family, case", [("Llama", "beam"), ("Llama", "greedy"), ("Mistral", "beam")])
def test_regional_compile_is_one_layer_graph_for_every_layer(fresh_dynamo, monkeypatch, family, case):
    """``compile="regional"``: 10 layers (past dynamo's recompile limit of 8, which a recompile per layer would hit),
    recompiling made an error from the first call on: every layer of every device step runs the one compiled layer
    (one graph; the whole step's bookkeeping and token choice one each), no break, stock's tokens (float32, fused
    projections: the default). Mistral's window is shorter than the sequences."""
    layers = 10
    stock, cascade = _layered(family, layers)
    ids, mask = padded_batch(seed=5, lengths=PROMPTS)
    expected = _generate(stock, ids, mask, case)
    spy, compiled_calls, region_calls = RunnerSpy(monkeypatch), CompiledCalls(monkeypatch), RegionCalls(monkeypatch)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _generate(cascade, ids, mask, case, CascadeConfig(cuda_graphs="eager", compile="regional"))
    assert torch.equal(got, expected)
    runner, = spy.runners
    assert runner.disabled is None and runner.device_steps == NEW - 1
    compiled_calls.check(calls=runner.device_steps)
    assert len(region_calls.calls) == layers * runner.device_steps, len(region_calls.calls)
    assert layer_graphs() == 1
    assert counters["stats"]["unique_graphs"] == 3          # the layer, the bookkeeping, the token choice
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert cascade.model.layers[0].__dict__.get("forward") is None      # the layers' own forwards back after the call


def test_regional_compile_two_layer_graphs_where_layer_types_differ(fresh_dynamo, monkeypatch):
    """Qwen2 with a sliding window on its upper layers (``max_window_layers``; q/k/v biases): full-attention and
    sliding layers differ in their Python (the window), two layer graphs for the 6 layers; a second call of other
    prompt lengths (same batch shape) compiles nothing (recompiling an error). Stock's tokens both times."""
    layers = 6
    types = ["full_attention"] * 2 + ["sliding_attention"] * 4
    stock, cascade = _layered("Qwen2", layers, use_sliding_window=True, sliding_window=12, max_window_layers=2,
                              layer_types=types)
    spy, compiled_calls, region_calls = RunnerSpy(monkeypatch), CompiledCalls(monkeypatch), RegionCalls(monkeypatch)
    counts = []
    for i, lengths in enumerate([PROMPTS, (17, 11)]):
        ids, mask = padded_batch(seed=10 + i, lengths=lengths)
        expected = _generate(stock, ids, mask, "beam")
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = _generate(cascade, ids, mask, "beam", CascadeConfig(cuda_graphs="eager", compile="regional"))
        assert torch.equal(got, expected), lengths
        counts.append((layer_graphs(), counters["stats"]["unique_graphs"]))
    assert counts == [(2, 4), (2, 4)], counts
    compiled_calls.check(calls=sum(runner.device_steps for runner in spy.runners))
    assert len(region_calls.calls) == layers * sum(runner.device_steps for runner in spy.runners)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_regional_compile_past_the_recompile_limit_runs_uncompiled_logged(fresh_dynamo, monkeypatch, caplog):
    """The one compiled layer serves every kind of layer of every model in the process, so dynamo's recompile limit
    (8 graphs of one function) can be met; under ``fullgraph`` that raises. Here the limit is 1 and the model's two
    kinds of layer need 2: the step runs uncompiled for the rest of the call, logged once, with stock's tokens."""
    monkeypatch.setattr(logs, "_logged", set())
    stock, cascade = _layered("Qwen2", 4, use_sliding_window=True, sliding_window=12, max_window_layers=2,
                              layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2)
    ids, mask = padded_batch(seed=12, lengths=PROMPTS)
    expected = _generate(stock, ids, mask, "beam")
    compiled_calls = CompiledCalls(monkeypatch)
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level(logging.WARNING, logger="hf_cascade"):
        got = _generate(cascade, ids, mask, "beam", CascadeConfig(cuda_graphs="eager", compile="regional"))
    assert torch.equal(got, expected)
    assert len(compiled_calls.failures) == 1 and compiled_calls.calls == 0, compiled_calls.failures
    assert "FailOnRecompileLimitHit" in type(compiled_calls.failures[0]).__name__
    lines = [r.getMessage() for r in caplog.records if "failed" in r.getMessage() and "uncompiled" in r.getMessage()]
    assert len(lines) == 1, lines


def test_regional_compile_finds_the_decoder_layers():
    """The layers regional compilation compiles: the one list of decoder layers whose attention carries layer_idx
    0..N-1; an encoder-decoder model (its cross-attention finds its K/V by layer_idx inside the layer) compiles whole,
    with the reason."""
    from transformers import BartConfig, BartForConditionalGeneration
    from hf_cascade import regional
    _, cascade = _layered("Llama", 3)
    assert regional.decoder_layers(cascade) == [(layer, i) for i, layer in enumerate(cascade.model.layers)]
    assert regional.unsupported_reason(cascade) is None
    bart = BartForConditionalGeneration(BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                                   encoder_attention_heads=2, decoder_attention_heads=2,
                                                   encoder_ffn_dim=32, decoder_ffn_dim=32))
    assert "encoder-decoder" in regional.unsupported_reason(bart)


# ---------------------------------------------------------------------------------------------------- GPU

GPU_SHAPE = dict(hidden_size=512, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                 intermediate_size=1024, vocab_size=1000, max_position_embeddings=8192, pad_token_id=0,
                 bos_token_id=None, eos_token_id=None)
GPU_CASES = {"beam": dict(num_beams=4, num_return_sequences=2), "greedy": dict(do_sample=False),
             "sample": dict(do_sample=True, num_return_sequences=3, top_k=0)}


def _gpu_model(dtype):
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(LlamaConfig(**GPU_SHAPE), attn_implementation="cascade",
                                                dtype=dtype).eval()


def _gpu_run(model, ids, mask, case, compile, backend="auto", **extra):
    torch.manual_seed(11)
    config = CascadeConfig(cuda_graphs=True, compile=compile, backend=backend)
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0,
                          hf_cascade_config=config, **GPU_CASES[case], **extra)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_compiled_captured_equals_captured_float32(fresh_dynamo, no_tf32, monkeypatch, case):
    """float32 (the reference backend on the GPU), TF32 off: compiled + captured gives the tokens of the uncompiled
    captured step; 12 layers compile as one graph."""
    model = _gpu_model(torch.float32)
    ids, mask = _batch((300, 210), seed=2)
    spy, compiled_calls = RunnerSpy(monkeypatch), CompiledCalls(monkeypatch)
    expected = _gpu_run(model, ids, mask, case, compile=False)
    got = _gpu_run(model, ids, mask, case, compile=True)
    plain, compiled = spy.runners
    assert plain.disabled is None and compiled.disabled is None, (plain.disabled, compiled.disabled)
    assert compiled.captures >= 1 and compiled.replays >= 20
    compiled_calls.check(calls=2 * compiled.captures)       # per capture: the warm-up, then the captured run
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("memory", ["vmm", "grow"])
def test_gpu_compile_count_is_stable_over_three_calls(fresh_dynamo, monkeypatch, memory):
    """bf16 on our CUDA kernels (the typed operators inside the compiled graph), captured: the second and third
    calls replay the kept graph and compile nothing; beam scores agree with the uncompiled graph's within bf16
    rounding (the tokens agree where no near-tie flips; the share is printed)."""
    if memory == "vmm" and hf_cascade.memory.vmm_unavailable_reason("cuda"):
        pytest.skip("no CUDA virtual memory here")
    model = _gpu_model(torch.bfloat16)
    ids, mask = _batch((700, 460, 590), seed=1)
    kw = dict(return_dict_in_generate=True, output_scores=True)
    spy, compiled_calls = RunnerSpy(monkeypatch), CompiledCalls(monkeypatch)
    torch.manual_seed(11)
    base = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0,
                          hf_cascade_config=CascadeConfig(cuda_graphs=True, memory=memory, backend="cuda"),
                          **GPU_CASES["beam"], **kw)
    counts = []
    for _ in range(3):
        torch.manual_seed(11)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0,
                             hf_cascade_config=CascadeConfig(cuda_graphs=True, memory=memory, backend="cuda",
                                                             compile=True), **GPU_CASES["beam"], **kw)
        runner = spy.runners[-1]
        assert runner.disabled is None and runner.replays >= 20, runner.disabled
        compiled_calls.check()
        counts.append(counters["stats"]["unique_graphs"])
    assert counts == [counts[0]] * 3, counts
    assert not counters["graph_break"], dict(counters["graph_break"])
    same = (out.sequences == base.sequences).float().mean().item()
    print(f"bf16 compiled vs uncompiled graph ({memory}): {same:.1%} of the tokens agree; sequence scores "
          f"{out.sequences_scores.tolist()} vs {base.sequences_scores.tolist()}")
    assert torch.allclose(out.sequences_scores.float(), base.sequences_scores.float(), atol=0.05, rtol=0.02)


def _ruler_scores(ruler, sequences, mask, returned: int) -> torch.Tensor:
    """Each returned beam's mean log-probability of its new tokens, teacher-forced through ``ruler`` (a float32 model):
    what its ``sequences_scores`` claim under length penalty 1, measured by one ruler for every run."""
    mask = mask.repeat_interleave(returned, 0)
    width = mask.shape[1]
    full = torch.cat([mask, mask.new_ones(mask.shape[0], sequences.shape[1] - width)], 1)
    positions = (full.cumsum(-1) - 1).clamp(min=0)     # generate's positions for left-padded rows
    with torch.no_grad():
        logits = ruler(sequences, attention_mask=full, position_ids=positions).logits.float()
    logp = torch.log_softmax(logits[:, width - 1:-1], -1).gather(-1, sequences[:, width:, None]).squeeze(-1)
    return logp.mean(-1)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_gpu_windowed_models_compile_on_our_kernels(fresh_dynamo, monkeypatch, name):
    """bf16 on our CUDA kernels with a sliding window (a row passes it while the graph replays) and Gemma-2's
    softcap: compiled + captured without a graph break. Where compiled and uncompiled tokens agree, so do their beam
    scores (within bf16 rounding); where bf16 rounding sent a beam elsewhere (Gemma-2 on the H200: two of six
    returned beams), each run's tokens score what the run claims under one float32 ruler — a wrong attention would
    claim scores its tokens do not have. The share of equal tokens is printed."""
    from test_gpu_graphs import _windowed_pair
    stock, model = _windowed_pair(name, torch.bfloat16)
    ids, mask = _batch((700, 460, 590), seed=7)          # the 460-token row passes the window at step 20
    kw = dict(max_new_tokens=40, pad_token_id=0, return_dict_in_generate=True, output_scores=True,
              **GPU_CASES["beam"])
    spy, compiled_calls = RunnerSpy(monkeypatch), CompiledCalls(monkeypatch)
    outs = []
    for compile in (False, True):
        torch.manual_seed(11)
        outs.append(model.generate(input_ids=ids, attention_mask=mask, hf_cascade_config=CascadeConfig(
            cuda_graphs=True, backend="cuda", compile=compile), **kw))
    _, compiled = spy.runners
    assert compiled.disabled is None and compiled.captures == 1 and compiled.replays >= 30, compiled.disabled
    compiled_calls.check(calls=2)
    assert not counters["graph_break"], dict(counters["graph_break"])
    base, out = outs
    same_rows = (out.sequences == base.sequences).all(-1)
    print(f"{name} bf16 compiled vs uncompiled graph: {(out.sequences == base.sequences).float().mean():.1%} of the "
          f"tokens agree, {int(same_rows.sum())} of {len(same_rows)} beams whole; scores "
          f"{out.sequences_scores.tolist()} vs {base.sequences_scores.tolist()}")
    assert torch.allclose(out.sequences_scores[same_rows].float(), base.sequences_scores[same_rows].float(),
                          atol=0.05, rtol=0.02)
    ruler = stock.float()
    for run in (base, out):
        measured = _ruler_scores(ruler, run.sequences, mask, GPU_CASES["beam"]["num_return_sequences"])
        assert torch.allclose(run.sequences_scores.float(), measured, atol=0.05, rtol=0.02), (
            run.sequences_scores.tolist(), measured.tolist())


def _gpu_pair(dtype):
    """(stock sdpa, cascade) of GPU_SHAPE with the same random weights, each from a config of its own."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        stock = AutoModelForCausalLM.from_config(LlamaConfig(**GPU_SHAPE), attn_implementation="sdpa", dtype=dtype)
        cascade = AutoModelForCausalLM.from_config(LlamaConfig(**GPU_SHAPE), attn_implementation="cascade",
                                                   dtype=dtype)
    cascade.load_state_dict(stock.state_dict())
    return stock.eval(), cascade.eval()


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_regional_compile_captured_gives_stock_tokens_float32(fresh_dynamo, no_tf32, monkeypatch, case):
    """``compile="regional"`` on the GPU, float32 (TF32 off), the whole step captured: stock sdpa's tokens (beam
    search, greedy, seeded sampling), the step captured and replayed, its 12 layers one compiled layer graph, no
    break, no recompile once the first layer compiled."""
    stock, cascade = _gpu_pair(torch.float32)
    ids, mask = _batch((300, 210), seed=2)
    kw = dict(max_new_tokens=24, pad_token_id=0, **GPU_CASES[case])
    torch.manual_seed(11)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    spy, compiled_calls, region_calls = RunnerSpy(monkeypatch), CompiledCalls(monkeypatch), RegionCalls(monkeypatch)
    torch.manual_seed(11)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = cascade.generate(input_ids=ids, attention_mask=mask, **kw,
                               hf_cascade_config=CascadeConfig(cuda_graphs=True, compile="regional"))
    runner, = spy.runners
    assert runner.disabled is None, runner.disabled
    assert runner.captures >= 1 and runner.device_steps >= 20, (runner.captures, runner.device_steps)
    compiled_calls.check()
    layers = GPU_SHAPE["num_hidden_layers"]
    assert region_calls.calls and len(region_calls.calls) % layers == 0, len(region_calls.calls)
    assert layer_graphs() == 1
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(got, expected)


@pytest.mark.gpu
def test_gpu_regional_compile_bf16_on_our_kernels(fresh_dynamo, monkeypatch):
    """bf16 on our CUDA kernels (their typed operators inside the compiled layer), captured, three calls: one layer
    graph, nothing compiled after the first call (recompiling an error); beam scores agree with the uncompiled
    captured step's within bf16 rounding (the share of equal tokens is printed)."""
    _, model = _gpu_pair(torch.bfloat16)
    ids, mask = _batch((700, 460, 590), seed=1)
    kw = dict(max_new_tokens=24, pad_token_id=0, return_dict_in_generate=True, output_scores=True,
              **GPU_CASES["beam"])
    base = model.generate(input_ids=ids, attention_mask=mask, **kw,
                          hf_cascade_config=CascadeConfig(cuda_graphs=True, backend="cuda"))
    spy, compiled_calls = RunnerSpy(monkeypatch), CompiledCalls(monkeypatch)
    counts = []
    for i in range(3):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = model.generate(input_ids=ids, attention_mask=mask, **kw,
                                 hf_cascade_config=CascadeConfig(cuda_graphs=True, backend="cuda", compile="regional"))
        runner = spy.runners[-1]
        assert runner.disabled is None and runner.replays + runner.device_steps >= 20, runner.disabled
        compiled_calls.check()
        counts.append((layer_graphs(), counters["stats"]["unique_graphs"]))
    assert counts[0][0] == 1 and counts == [counts[0]] * 3, counts
    assert not counters["graph_break"], dict(counters["graph_break"])
    same = (out.sequences == base.sequences).float().mean().item()
    print(f"bf16 regional vs uncompiled graph: {same:.1%} of the tokens agree; sequence scores "
          f"{out.sequences_scores.tolist()} vs {base.sequences_scores.tolist()}")
    assert torch.allclose(out.sequences_scores.float(), base.sequences_scores.float(), atol=0.05, rtol=0.02)
