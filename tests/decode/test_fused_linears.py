"""``CascadeConfig(fuse_projections=True)`` (hf_cascade/decode/fused_linears.py): q/k/v and gate/up as one product each.

CPU, float64: generate gives stock's tokens (Llama GQA, Mistral, Qwen2 with q/k/v bias, OPT with bias and no gate/up),
plain forwards equal the unfused model's, state_dict and save/load are unchanged, a weight moved off its buffer
(``model.to(dtype)``) unfuses the model (logged) and the next call fuses it again, training computes the same
gradients and its optimizer steps land in the fused buffer, wrapped or quantized members are left alone, and the
fused forward compiles as one graph. The cache write keeps the kernel for the strided V a fused product gives.
GPU (``pytest -m gpu tests/decode/test_fused_linears.py``): the compiled, captured whole step of a fused model gives stock's
tokens in float32.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM

from hf_cascade import CascadeConfig, cache as cache_module, fused_linears, logs, session
from hf_cascade.kernels import cuda_library

from conftest import RunnerSpy, padded_batch
from test_families import FAMILIES, PROMPTS, generate_kwargs

FUSED = CascadeConfig(fuse_projections=True)
# groups of the tiny 2-layer families: (attention, MLP) per layer
GROUPS = {"Llama": 4, "Mistral": 4, "Qwen2": 4, "OPT": 2}


def pair(name: str, dtype=torch.float64):
    """(stock sdpa model, cascade model) of FAMILIES[name] with the same random weights, each its own config."""
    family = FAMILIES[name]
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(family.make(), attn_implementation="sdpa", dtype=dtype).eval()
    cascade = AutoModelForCausalLM.from_config(family.make(), attn_implementation="cascade", dtype=dtype).eval()
    cascade.load_state_dict(stock.state_dict())
    return stock, cascade


def fused_members(model) -> list:
    return [m for m in model.modules() if isinstance(m, fused_linears._FusedLinear)]


def beams(model, ids, mask, **extra):
    return model.generate(input_ids=ids, attention_mask=mask, **generate_kwargs("beam"), **extra)


@pytest.fixture
def fresh_logs(monkeypatch):
    monkeypatch.setattr(logs, "_logged", set())


@pytest.mark.parametrize("name", list(GROUPS))
def test_fused_generate_gives_stock_tokens_and_forward_logits(name):
    stock, cascade = pair(name)
    ids, mask = padded_batch(seed=3, lengths=PROMPTS)
    expected = beams(stock, ids, mask)
    fused_linears.fuse(cascade)
    members = fused_members(cascade)
    assert len({id(m._fused_group) for m in members}) == GROUPS[name]
    # every later member of a group finds the fused product of its input (its slice is what it returns)
    found = []
    hooks = [m.register_forward_pre_hook(lambda m, args: found.append(m._fused_group.stash[0] is args[0]))
             for m in members if m._fused_index > 0]
    got = beams(cascade, ids, mask, hf_cascade_config=FUSED)
    for hook in hooks:
        hook.remove()
    assert found and all(found)
    assert torch.equal(expected, got)
    # the static decode path (the graph runner's, uncaptured) too
    assert torch.equal(expected, beams(cascade, ids, mask, hf_cascade_config=dict(fuse_projections=True,
                                                                                   cuda_graphs="eager")))
    with torch.no_grad():
        want = stock(input_ids=ids, attention_mask=mask).logits
        logits = cascade(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, want, rtol=1e-12, atol=1e-12)
    assert all(m._fused_group.stash is None for m in members)        # the last member dropped the fused product


def test_forwards_outside_generate_give_stocks_logits_bitwise():
    """After a fused generate call, a plain forward (a Trainer's loss pass) takes each member's own product: stock's
    logits bit for bit; inside a call's extent the fused product serves."""
    stock, cascade = pair("Llama")
    ids, mask = padded_batch(seed=3, lengths=PROMPTS)
    beams(cascade, ids, mask, hf_cascade_config=FUSED)
    assert fused_members(cascade)
    with torch.no_grad():
        want = stock(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(cascade(input_ids=ids, attention_mask=mask).logits, want)
        group = fused_members(cascade)[0]._fused_group
        with fused_linears.serving():
            seen = []
            hook = cascade.model.layers[0].self_attn.k_proj.register_forward_hook(
                lambda *a: seen.append(group.stash is not None))
            cascade(input_ids=ids, attention_mask=mask)
            hook.remove()
    assert seen == [True] and not fused_linears._serving


def test_bart_fuses_the_decoders_self_attention_only():
    """An encoder-decoder: the decoder's self-attentions fused; cross-attentions not (their q_proj and k/v_proj take
    different inputs: a fused product would compute k/v's rows for nothing), nor the encoder (it runs once per call:
    its outputs stay stock's bit for bit, also in a later call); stock's beams."""
    import test_encoder_decoder as encdec
    stock, cascade = encdec.pair("bart")
    ids, mask = encdec.sources()
    want = encdec.run(stock, ids, mask, "beam")
    got = encdec.run(cascade, ids, mask, "beam", hf_cascade_config=FUSED)
    names = {name.rsplit(".", 1)[0] for name, m in cascade.named_modules() if isinstance(m, fused_linears._FusedLinear)}
    assert names == {f"model.decoder.layers.{i}.self_attn" for i in range(2)}
    assert torch.equal(want.sequences, got.sequences)
    torch.testing.assert_close(got.sequences_scores, want.sequences_scores, rtol=0, atol=1e-9)
    encoded = [model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state for model in (stock, cascade)]
    assert torch.equal(*encoded)


def test_fuse_is_idempotent_and_keeps_the_parameters_and_state_dict():
    stock, model = pair("Qwen2")
    params = dict(model.named_parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert fused_linears.fuse(model) == 4 and fused_linears.fuse(model) == 0
    assert dict(model.named_parameters()) == params          # the same Parameter objects, now views
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    attn = model.model.layers[0].self_attn
    group = attn.q_proj._fused_group
    assert group.weight.shape == (64 + 2 * 64, 64) and group.bias.shape == (3 * 64,)
    for member, (low, high) in zip((attn.q_proj, attn.k_proj, attn.v_proj), group.rows):
        assert member.weight.data_ptr() == group.weight[low:high].data_ptr()
        assert member.bias.data_ptr() == group.bias[low:high].data_ptr()
        assert type(member.weight) is nn.Parameter and member.weight.requires_grad
    assert fused_linears.check(model)
    buffer = group.weight.untyped_storage().data_ptr()
    fused_linears.unfuse(model)
    assert not fused_members(model) and type(attn.q_proj) is nn.Linear
    assert dict(model.named_parameters()) == params
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)
    assert all(p.untyped_storage().data_ptr() != buffer for p in params.values())     # each its own storage again


def test_save_pretrained_round_trip(tmp_path):
    """Shared-storage views save as separate tensors (transformers clones disjoint slices of one storage) and load
    into a plain model with the same values, on this transformers (run the file under 5.17 too)."""
    _, model = pair("Llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fused_linears.fuse(model)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", dtype=torch.float64)
    state = loaded.state_dict()
    assert set(state) == set(before), (transformers.__version__, set(state) ^ set(before))
    assert all(torch.equal(state[k], before[k]) for k in before)
    assert fused_linears.check(model) and len(fused_members(model)) == 2 * 5      # saving left the model fused


def test_a_moved_weight_unfuses_logs_and_fuses_again(fresh_logs, caplog, monkeypatch):
    stock, cascade = pair("Llama")
    ids, mask = padded_batch(seed=3, lengths=PROMPTS)
    beams(cascade, ids, mask, hf_cascade_config=FUSED)
    old = cascade.model.layers[0].self_attn.q_proj._fused_group
    for model in (stock, cascade):          # float32 and back: the same rounded weights, float64 compute
        model.to(torch.float32).to(torch.float64)
    assert fused_members(cascade)           # .to() cannot tell us: the members still think they are fused
    released = []
    real_release = session.release
    monkeypatch.setattr(session, "release", lambda model=None: (released.append(model), real_release(model)))
    with caplog.at_level(logging.WARNING, logger="hf_cascade"):
        got = beams(cascade, ids, mask, hf_cascade_config=FUSED)
    assert "unfused the model's projections: model.layers.0.self_attn.q_proj.weight is no longer a view" in caplog.text
    assert torch.equal(beams(stock, ids, mask), got)
    assert released == [cascade]            # graphs kept for the model point at the old buffers
    new = cascade.model.layers[0].self_attn.q_proj._fused_group
    assert new is not old and fused_linears.check(cascade)
    assert not any(getattr(m, "_fused_group", None) is old for m in cascade.modules())


def test_a_new_parameter_unfuses(fresh_logs, caplog):
    _, model = pair("Llama")
    fused_linears.fuse(model)
    mlp = model.model.layers[1].mlp
    mlp.up_proj.weight = nn.Parameter(mlp.up_proj.weight.detach().clone())
    with caplog.at_level(logging.WARNING, logger="hf_cascade"):
        assert not fused_linears.check(model)
    assert "model.layers.1.mlp.up_proj.weight" in caplog.text
    assert not fused_members(model) and type(mlp.gate_proj) is nn.Linear


def test_a_plain_forward_after_a_weight_moved_never_reads_the_stale_buffer():
    """Between two generate calls nothing runs check(): a forward of a model whose weights were replaced (a new
    Parameter, as accelerate's loaders assign) or converted (``model.to``) computes with the new weights."""
    stock, model = pair("Llama")
    fused_linears.fuse(model)
    ids = torch.randint(1, 100, (2, 7))
    attn = model.model.layers[0].self_attn
    new = torch.randn_like(attn.k_proj.weight)
    attn.k_proj.weight = nn.Parameter(new.clone())
    stock.model.layers[0].self_attn.k_proj.weight.data.copy_(new)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, rtol=0, atol=1e-12)
        model.to(torch.float32)
        stock.to(torch.float32)
        torch.testing.assert_close(model(ids).logits, stock(ids).logits)
    assert fused_members(model)          # still marked fused: the next generate call's check unfuses


def test_a_replaced_member_unfuses_and_the_removed_one_works_alone(fresh_logs, caplog):
    _, model = pair("Llama")
    fused_linears.fuse(model)
    attn = model.model.layers[0].self_attn
    removed = attn.k_proj
    attn.k_proj = nn.Linear(64, 32, bias=False, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="hf_cascade"):
        assert not fused_linears.check(model)
    assert "model.layers.0.self_attn.k_proj is no longer in the model" in caplog.text
    assert type(removed) is nn.Linear and removed.weight.is_contiguous()
    x = torch.randn(3, 64, dtype=torch.float64)
    torch.testing.assert_close(removed(x), x @ removed.weight.T)


def test_training_gradients_and_optimizer_steps_match_the_unfused_model():
    _, fused = pair("Qwen2")
    plain = copy.deepcopy(fused)
    fused_linears.fuse(fused)
    ids, _ = padded_batch(seed=4, lengths=(12, 12))
    optimizers = []
    for model in (fused, plain):
        model.train()
        optimizers.append(torch.optim.SGD(model.parameters(), lr=0.5))
        model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for name, p in fused.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-12, atol=1e-14, msg=name)
    for optimizer in optimizers:
        optimizer.step()
    assert fused_linears.check(fused)           # the steps updated the views in place: the buffers hold them
    group = fused.model.layers[0].mlp.gate_proj._fused_group
    low, high = group.rows[1]
    assert torch.equal(group.weight[low:high], plain.model.layers[0].mlp.up_proj.weight)
    for model in (fused, plain):
        model.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-12, atol=1e-12)


def test_frozen_weights_with_gradients_for_the_input_take_the_fused_product():
    """Weights that need no gradient (a frozen base) compute the fused product with grad mode on; the input's gradient
    is the unfused model's."""
    _, fused = pair("Llama")
    plain = copy.deepcopy(fused)
    fused_linears.fuse(fused)
    calls = []
    group = fused.model.layers[0].self_attn.q_proj._fused_group
    ids, _ = padded_batch(seed=4, lengths=(9, 9))
    grads = []
    for model in (fused, plain):
        model.requires_grad_(False)
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        if model is fused:
            hook = fused.model.layers[0].self_attn.k_proj.register_forward_hook(
                lambda *a: calls.append(group.stash is not None))
        with fused_linears.serving():           # (a generate call's extent: fused products)
            model(inputs_embeds=embeds).logits.sum().backward()
        grads.append(embeds.grad)
        if model is fused:
            hook.remove()
    assert calls == [True]          # k_proj found q_proj's fused product of its input (and took its slice)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


class LoraLike(nn.Module):
    """A PEFT-style wrapper around a base Linear."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base_layer = base
        self.in_features, self.out_features = base.in_features, base.out_features

    def forward(self, x):
        return self.base_layer(x)


class Quantized(nn.Linear):
    """A subclass of nn.Linear (as bitsandbytes' and others' are): not exactly nn.Linear."""


def test_wrapped_or_subclassed_members_leave_their_group_alone():
    _, model = pair("Llama")
    layers = model.model.layers
    layers[0].self_attn.k_proj = LoraLike(layers[0].self_attn.k_proj)
    up = layers[1].mlp.up_proj
    quantized = Quantized(up.in_features, up.out_features, bias=False, dtype=torch.float64)
    quantized.load_state_dict(up.state_dict())
    layers[1].mlp.up_proj = quantized
    layers[0].mlp.gate_proj.weight.data = layers[0].mlp.gate_proj.weight.data.float()   # another dtype than up
    assert fused_linears.fuse(model) == 1          # only layer 1's attention
    assert type(layers[1].self_attn.q_proj) is fused_linears._FusedLinear
    assert type(layers[0].self_attn.q_proj) is nn.Linear and type(layers[0].mlp.up_proj) is nn.Linear
    assert type(layers[1].mlp.gate_proj) is nn.Linear


def test_tied_or_meta_weights_are_not_fused():
    _, model = pair("Llama")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[1].mlp
    attn.v_proj.weight = attn.k_proj.weight                     # tied: one Parameter in two places
    mlp.gate_proj.to("meta")
    assert fused_linears.fuse(model) == 2                       # layer 0's MLP and layer 1's attention


@pytest.fixture
def one_rank_mesh():
    """A gloo process group of one rank and its mesh, so that transformers' tensor-parallel styles shard a model in
    this process (each local shard the whole weight; multi-rank runs: tests/test_multi_device.py)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


# Llama's own tensor-parallel plan, by the children's names
TP_PLAN = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",
           "gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}


def shard(model, mesh, **styles):
    """Each decoder layer's linears sharded and their forwards installed by transformers' own styles (``styles``:
    child name -> style name over TP_PLAN, None: left whole), as from_pretrained(tp_plan=...) does."""
    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES
    plan = {**TP_PLAN, **styles}
    for name, module in model.named_modules():
        style_name = plan.get(name.rsplit(".", 1)[-1]) if ".layers." in name else None
        if style_name is None:
            continue
        style = ALL_PARALLEL_STYLES[style_name]
        for param in ("weight", "bias"):
            style.shard_param(module, param, mesh)
        style.install_forward(module, mesh)
    return model


def test_tensor_parallel_colwise_members_fuse_their_local_shards(one_rank_mesh):
    """Colwise q/k/v and gate/up (DTensor weights, transformers' forwards) fuse over their local shards: each weight
    stays the same DTensor Parameter, its local tensor rows of the buffer, the forward transformers' again around the
    fused one; stock's tokens and, outside generate, stock's logits bit for bit; unfusing puts transformers' forwards
    back."""
    from torch.distributed.tensor import DTensor
    stock, cascade = pair("Llama")
    shard(cascade, one_rank_mesh)
    ids, mask = padded_batch(seed=3, lengths=PROMPTS)
    q = cascade.model.layers[0].self_attn.q_proj
    weight, forward = q.weight, q.forward
    assert fused_linears.fuse(cascade) == 4
    assert q.weight is weight and isinstance(weight, DTensor)
    group = q._fused_group
    assert weight._local_tensor.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
    assert q.forward is not forward and "tp_forward" in q.forward.__qualname__
    assert torch.equal(beams(stock, ids, mask), beams(cascade, ids, mask, hf_cascade_config=FUSED))
    with torch.no_grad():
        assert torch.equal(cascade(input_ids=ids, attention_mask=mask).logits,
                           stock(input_ids=ids, attention_mask=mask).logits)
    fused_linears.unfuse(cascade)
    assert q.forward is forward and type(q) is nn.Linear and not fused_members(cascade)


@pytest.mark.parametrize("styles, fused, reason", [
    (dict(q_proj="rowwise", k_proj="rowwise", v_proj="rowwise"), 2, "sharded RowwiseParallel, not colwise"),
    (dict(k_proj=None, v_proj=None), 2, "some of its weights are sharded"),
    (dict(v_proj="colwise_rep"), 2, "its members do not share one colwise plan and mesh"),
    (dict(gate_proj="colwise_rep", up_proj="colwise_rep", down_proj="rowwise_split_input"), 2,
     "its colwise output is Replicate(), not each rank's own columns"),
])
def test_tensor_parallel_groups_other_than_colwise_stay_unfused_with_the_reason(one_rank_mesh, styles, fused, reason,
                                                                               fresh_logs, caplog):
    stock, cascade = pair("Llama")
    shard(cascade, one_rank_mesh, **styles)
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        assert fused_linears.fuse(cascade) == fused
    assert "left unfused under tensor parallelism: " + reason in caplog.text
    ids, mask = padded_batch(seed=3, lengths=PROMPTS)
    assert torch.equal(beams(stock, ids, mask), beams(cascade, ids, mask, hf_cascade_config=FUSED))


def test_the_fused_forward_compiles_as_one_graph():
    torch._dynamo.reset()
    model, _ = pair("Llama", dtype=torch.float32)             # sdpa: a forward without a cache of ours
    plain = copy.deepcopy(model)
    fused_linears.fuse(model)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    ids, _ = padded_batch(seed=4, lengths=(9, 9))
    compiled = torch.compile(model.forward, backend=backend, fullgraph=True)
    try:
        with torch.no_grad(), fused_linears.serving():        # (a generate call's extent: fused products)
            got = compiled(input_ids=ids, use_cache=False).logits
            want = plain(input_ids=ids, use_cache=False).logits
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1
    linears = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    # per layer: q|k|v, o_proj, gate|up, down_proj; then lm_head (unfused: 2 x 7 + 1)
    assert len(linears) == 2 * 4 + 1
    torch.testing.assert_close(got, want)


def test_compiled_static_step_of_a_fused_model_gives_stock_tokens(monkeypatch):
    """Through the library: the runner's static step, compiled (inductor, fullgraph) on the fused model; no break."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    stock, cascade = pair("Llama")
    ids, mask = padded_batch(seed=5, lengths=PROMPTS)
    spy = RunnerSpy(monkeypatch)
    try:
        got = beams(cascade, ids, mask, hf_cascade_config=dict(fuse_projections=True, cuda_graphs="eager",
                                                               compile=True))
        assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    assert torch.equal(beams(stock, ids, mask), got)
    runner, = spy.runners
    assert runner.disabled is None and fused_members(cascade)


def test_the_cache_write_takes_the_kernel_for_a_strided_value(monkeypatch):
    """A fused product's V is a column slice: its tokens are strided by the q|k|v width. The dispatcher makes K/V
    contiguous so that the write stays on the kernel (which refuses strided tensors), with the same values."""
    launches = []

    class Loaded:
        def write(self, pool, key, value, *args):
            launches.append((key, value))

    monkeypatch.setattr(cuda_library, "write_kernel", True)
    monkeypatch.setattr(cuda_library, "loaded", lambda device: Loaded())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: type("Stream", (), {"cuda_stream": 0}))
    pool = torch.zeros(4, 2, 16, 2, 8, dtype=torch.bfloat16)
    fused = torch.randn(1, 3, 4 * 8 + 2 * 2 * 8).bfloat16()            # [batch, tokens, q | k | v]
    value = fused[..., 48:].view(1, 3, 2, 8).transpose(1, 2)             # as the attention gets it: [B, H, T, D]
    value = value.transpose(1, 2).reshape(-1, 2, 8)                      # as CascadeLayer.write flattens it
    key = torch.randn(3, 2, 8).bfloat16()
    assert not value.is_contiguous()
    index = torch.zeros(3, dtype=torch.long)
    args = (index, index, index, index, True)
    assert not cuda_library.write_slots(pool, key, value, *args)        # the kernel alone refuses it
    assert cache_module._write_slots_kernel(pool, key, value, *args)
    (k, v), = launches
    assert k.is_contiguous() and v.is_contiguous() and torch.equal(v, value) and torch.equal(k, key)


@pytest.mark.gpu
def test_gpu_fused_compiled_whole_step_gives_stock_tokens(monkeypatch, no_tf32):
    """A Llama of 12 small layers, float32 (TF32 off) on CUDA: the whole step, compiled and captured, of the fused
    model gives stock's beams; the same model in bf16 runs captured and compiled with its projections fused."""
    from test_gpu_graphs import _batch, float32_pair
    shape = dict(hidden_size=512, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                 intermediate_size=1024, vocab_size=1000, max_position_embeddings=8192, pad_token_id=0,
                 bos_token_id=None, eos_token_id=None)
    torch._dynamo.reset()
    stock, cascade = float32_pair(shape)
    ids, mask = _batch((300, 210), seed=2)
    kw = dict(max_new_tokens=24, pad_token_id=0, num_beams=4, num_return_sequences=2)
    config = CascadeConfig(cuda_graphs=True, compile=True, fuse_projections=True)
    spy = RunnerSpy(monkeypatch)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **kw)
    got = cascade.generate(input_ids=ids, attention_mask=mask, hf_cascade_config=config, **kw)
    assert torch.equal(expected, got)
    assert len(fused_members(cascade)) == 12 * 5
    runner, = spy.runners
    assert runner.disabled is None and runner.captures >= 1 and runner.device_steps > 10
    cascade.to(torch.bfloat16)                  # unfused by the next call, fused again in bf16
    out = cascade.generate(input_ids=ids, attention_mask=mask, hf_cascade_config=config, **kw)
    assert out.shape == expected.shape and fused_linears.check(cascade)
    assert cascade.model.layers[0].self_attn.q_proj._fused_group.weight.dtype == torch.bfloat16
    torch._dynamo.reset()
