"""Placement: where each layer's KV pool lives and where its shape comes from, on a CPU machine.

What a CPU-only machine can check: accelerate's hooks (dispatch_model with a per-layer device map,
from_pretrained(device_map=...), cpu_offload, disk offload) leave the tokens as stock's and each pool
on the device of its layer's K/V; pools take their head count from the K/V tensors, not from the
config; a step's plan is uploaded once per device. Layers really spread over several GPUs need a
multi-device machine (tests/test_gpu_*.py).
"""
from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
from transformers import AutoModelForCausalLM  # noqa: E402

import hf_cascade  # noqa: E402,F401
from hf_cascade import plan as plan_module  # noqa: E402
from hf_cascade import CascadeConfig  # noqa: E402
from hf_cascade.cache import CascadeCache  # noqa: E402

from conftest import cache_kw, model_pair, padded_batch, plans_every_step, returned_cache  # noqa: E402

NEW = 6
GEN = dict(num_beams=3, num_return_sequences=2, max_new_tokens=NEW, pad_token_id=0)


def _device_map(layers: int = 2, layer_devices=None) -> dict[str, str]:
    layer_devices = layer_devices or ["cpu"] * layers
    dm = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    dm.update({f"model.layers.{i}": d for i, d in enumerate(layer_devices)})
    return dm


def _generate_with_cache(model, ids, mask, **kw):
    out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **{**GEN, **kw})
    cache = returned_cache(out)
    assert isinstance(cache, CascadeCache)
    return out.sequences, cache


def _hooked(module) -> bool:
    return hasattr(module, "_hf_hook")


def _assert_pools_follow(model, cache, device: torch.device, dtype=torch.float64):
    layers = model.model.layers
    assert len(cache.layers) == len(layers)
    for i, layer in enumerate(cache.layers):
        assert layer.storage is not None, f"layer {i} has no pool"
        assert layer.storage.device == device == layer.pool.device, i
        assert layer.pool.dtype == dtype
        assert layer.device == device and layer.dtype == dtype


# ---- (1) accelerate dispatch with an explicit per-layer device map -----------------------------------
def test_dispatch_model_per_layer_device_map():
    stock, cascade = model_pair("llama", num_hidden_layers=3)
    cascade = accelerate.dispatch_model(cascade, device_map=_device_map(3), force_hooks=True)
    assert all(_hooked(layer) for layer in cascade.model.layers), "test setup: accelerate hooks expected"
    ids, mask = padded_batch(seed=3)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **GEN)
    got, cache = _generate_with_cache(cascade, ids, mask)
    assert torch.equal(expected, got)
    for i, layer in enumerate(cascade.model.layers):
        param_device = next(layer.parameters()).device
        assert cache.layers[i].storage.device == param_device, i
    _assert_pools_follow(cascade, cache, torch.device("cpu"))
    cache.reset()


def test_from_pretrained_with_device_map(tmp_path):
    stock, cascade = model_pair("llama")
    cascade.save_pretrained(tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", attn_implementation="cascade",
                                                  dtype=torch.float64, device_map=_device_map(2)).eval()
    assert loaded.config._attn_implementation == "cascade"
    # (transformers 5.24 attaches no hooks for a map onto one device: the disk test below has them)
    ids, mask = padded_batch(seed=4)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **GEN)
    got, cache = _generate_with_cache(loaded, ids, mask)
    assert torch.equal(expected, got)
    for i, layer in enumerate(loaded.model.layers):
        assert cache.layers[i].storage.device == next(layer.parameters()).device, i
    _assert_pools_follow(loaded, cache, torch.device("cpu"))
    cache.reset()


# ---- (2) offloading: weights elsewhere, K/V computed on the execution device -------------------------
def test_cpu_offload_gives_stock_tokens():
    stock, cascade = model_pair("llama")
    accelerate.cpu_offload(cascade, execution_device=torch.device("cpu"))
    # the weights now sit on "meta" between forwards; the K/V (and so the pools) on the execution device
    assert next(cascade.model.layers[0].parameters()).device.type == "meta", "test setup: offloaded weights"
    ids, mask = padded_batch(seed=5)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **GEN)
    got, cache = _generate_with_cache(cascade, ids, mask)
    assert torch.equal(expected, got)
    _assert_pools_follow(cascade, cache, torch.device("cpu"))
    cache.reset()
    # sampling and greedy through the same hooks
    for kw in (dict(num_beams=1, do_sample=True, num_return_sequences=3, top_k=0), dict(num_beams=1,
                                                                                      num_return_sequences=1)):
        torch.manual_seed(9)
        expected = stock.generate(input_ids=ids, attention_mask=mask, **{**GEN, **kw})
        torch.manual_seed(9)
        got = cascade.generate(input_ids=ids, attention_mask=mask, **{**GEN, **kw})
        assert torch.equal(expected, got), kw


def test_disk_offload_device_map(tmp_path):
    stock, cascade = model_pair("llama")
    cascade.save_pretrained(tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", attn_implementation="cascade", dtype=torch.float64,
        device_map=_device_map(2, ["cpu", "disk"]), offload_folder=str(tmp_path / "offload")).eval()
    assert _hooked(loaded.model.layers[1]), "test setup: layer 1 offloaded to disk behind a hook"
    ids, mask = padded_batch(seed=6)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **GEN)
    got, cache = _generate_with_cache(loaded, ids, mask)
    assert torch.equal(expected, got)
    _assert_pools_follow(loaded, cache, torch.device("cpu"))
    cache.reset()


# ---- (3) head counts come from the K/V tensors, not the config --------------------------------------
def _shrink_kv_heads(model, layer_idx: int, kv_heads: int):
    """Keep the first ``kv_heads`` KV heads of one layer (as a tensor-parallel shard would hold fewer
    heads than the config says); the config still says num_key_value_heads."""
    attn = model.model.layers[layer_idx].self_attn
    keep = kv_heads * attn.head_dim
    for name in ("k_proj", "v_proj"):
        old = getattr(attn, name)
        new = torch.nn.Linear(old.in_features, keep, bias=old.bias is not None, dtype=old.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(old.weight[:keep])
            if old.bias is not None:
                new.bias.copy_(old.bias[:keep])
        setattr(attn, name, new)
    attn.num_key_value_groups = model.config.num_attention_heads // kv_heads


def test_pool_heads_follow_kv_tensors_not_config():
    stock, cascade = model_pair("llama", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    for model in (stock, cascade):
        _shrink_kv_heads(model, 1, 1)        # layer 1: MQA, layers 0 and 2: GQA 4/2 as configured
    assert cascade.config.num_key_value_heads == 2
    ids, mask = padded_batch(seed=8)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **GEN)
    got, cache = _generate_with_cache(cascade, ids, mask)
    assert torch.equal(expected, got)
    head_dim = cascade.model.layers[0].self_attn.head_dim
    for i, layer in enumerate(cascade.model.layers):
        kv_heads = layer.self_attn.k_proj.out_features // head_dim
        assert cache.layers[i].pool.shape[-2:] == (kv_heads, head_dim), i
        assert cache.layers[i].storage.block_shape == (2, cache.block_size, kv_heads, head_dim), i
    assert [cache.layers[i].pool.shape[-2] for i in range(3)] == [2, 1, 2]
    cache.reset()


def test_cache_without_config_sizes_pools_from_kv():
    """A CascadeCache built without the model config adds layers as they come, shaped by their K/V."""
    stock, cascade = model_pair("llama", num_hidden_layers=2)
    _shrink_kv_heads(stock, 0, 1)
    _shrink_kv_heads(cascade, 0, 1)
    cache = CascadeCache()
    assert len(cache.layers) == 0
    ids, mask = padded_batch(seed=2)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **GEN)
    got = cascade.generate(input_ids=ids, attention_mask=mask, **cache_kw(cascade, cache), **GEN)
    assert torch.equal(expected, got)
    assert [tuple(layer.pool.shape[-2:]) for layer in cache.layers] == [(1, 16), (2, 16)]
    cache.reset()


def test_layer_refuses_kv_with_other_head_count():
    """A filled layer's pool keeps its shape: K/V with another head count are refused, not reshaped."""
    cache = CascadeCache()
    k = torch.randn(2, 2, 3, 8, dtype=torch.float64)
    cache.update(k, k.clone(), 0)
    cache.step.unread.discard(0)          # what the attention of layer 0 would do: it read the K/V
    assert cache.layers[0].pool.shape[-2:] == (2, 8)
    k1 = torch.randn(2, 1, 3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="heads"):
        cache.update(k1, k1.clone(), 0)
    cache.step.unread.discard(0)          # what the attention of layer 0 would do: it read the K/V
    cache.reset()


# ---- the step plan is uploaded once per device and step ----------------------------------------------
def test_plan_on_returns_one_device_plan_per_device():
    cache = CascadeCache()
    k = torch.randn(3, 2, 5, 8, dtype=torch.float64)
    cache.update(k, k.clone(), 0)
    cache.step.unread.discard(0)          # what the attention of layer 0 would do: it read the K/V
    plan = cache.plan
    first = plan.on(torch.device("cpu"))
    assert plan.on("cpu") is first and plan.on(torch.device("cpu")) is first
    assert first.write_block.device.type == "cpu"
    # another device gets its own upload, also only once ("meta" stands in for a second device)
    meta = plan.on("meta")
    assert meta is not first and meta.write_block.device.type == "meta"
    assert plan.on(torch.device("meta")) is meta
    # the next step plans anew
    k2 = torch.randn(3, 2, 1, 8, dtype=torch.float64)
    cache.update(k2, k2.clone(), 0)
    cache.step.unread.discard(0)          # what the attention of layer 0 would do: it read the K/V
    assert cache.plan is not plan and cache.plan.on("cpu") is not first
    cache.reset()


def test_generate_uploads_each_step_plan_once(monkeypatch):
    stock, cascade = model_pair("llama", num_hidden_layers=3)
    cascade = accelerate.dispatch_model(cascade, device_map=_device_map(3), force_hooks=True)
    built, calls = [], []
    real_device_plan, real_on = plan_module.DevicePlan, plan_module.StepPlan.on

    def counting_device_plan(*args, **kwargs):
        built.append(1)
        return real_device_plan(*args, **kwargs)

    def counting_on(self, device):
        calls.append((self, str(torch.device(device))))   # holds the plan: its id() is not reused
        return real_on(self, device)

    monkeypatch.setattr(plan_module, "DevicePlan", counting_device_plan)
    monkeypatch.setattr(plan_module.StepPlan, "on", counting_on)
    ids, mask = padded_batch(seed=1)
    expected = stock.generate(input_ids=ids, attention_mask=mask, **GEN)
    # planned anew each step: each step's plan is uploaded once for the one device
    with pytest.MonkeyPatch.context() as mp:
        plans_every_step(mp)
        got, cache = _generate_with_cache(cascade, ids, mask)
    assert torch.equal(expected, got)
    steps = {id(plan) for plan, _ in calls}
    # every layer asks (write + attention), but each step's plan is uploaded once for the one device
    assert len(calls) >= 3 * len(steps) and len(built) == len({(id(p), d) for p, d in calls}) == len(steps)
    assert len(steps) >= NEW            # the prefill plus a plan per decoding step
    cache.reset()
    # on the call's static decode layout: one set of device buffers for all decode steps, refilled per step
    calls.clear(), built.clear()
    got, cache = _generate_with_cache(cascade, ids, mask)
    assert torch.equal(expected, got)
    static = {id(p) for p, _ in calls if p.static}
    assert len(static) >= NEW - 1 and len(built) == len({id(p) for p, _ in calls if not p.static}) + 1
    cache.reset()
