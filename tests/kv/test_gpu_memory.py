"""The VMM KV pool on a real GPU (run on the GPU machine: pytest -m gpu tests/kv/test_gpu_memory.py)."""
from __future__ import annotations

import gc

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_cascade  # registers attn_implementation="cascade"
from hf_cascade import CascadeConfig
from hf_cascade import memory
from conftest import host_loop, returned_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None,
                       reason="needs cuda-bindings"),
]

SHAPE = (2, 16, 8, 128)         # K+V, block 16, 8 KV heads, head_dim 128: 64 KiB per bf16 block


@pytest.fixture(autouse=True)
def vmm_here():
    reason = memory.vmm_unavailable_reason("cuda")
    if reason:
        pytest.skip(reason)
    # what generate keeps for a model's next call (mapped pools) must not count here: other files' models
    hf_cascade.release()
    gc.collect()
    yield
    torch.cuda.synchronize()


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_auto_is_vmm_here():
    s = memory.make_storage(SHAPE, torch.bfloat16, "cuda", "auto")
    assert isinstance(s, memory.VMMStorage) and not s.in_torch_allocator


def test_growth_keeps_base_address_and_data():
    s = memory.make_storage(SHAPE, torch.bfloat16, "cuda", "vmm")
    pool = s.ensure(3)
    base = pool.data_ptr()
    assert pool.dtype == torch.bfloat16 and pool.device.type == "cuda" and pool.shape[1:] == SHAPE
    assert s.nbytes % s.granularity == 0 and s.nbytes >= 3 * s.block_nbytes
    ref = torch.randn(3, *SHAPE, device="cuda").to(torch.bfloat16)
    pool[:3] = ref
    sizes = [s.nbytes]
    for need in (s.num_blocks + 1, 4 * s.num_blocks, 64 * s.num_blocks):
        grown = s.ensure(need)
        sizes.append(s.nbytes)
        assert grown.data_ptr() == base and grown.shape[0] >= need
        assert torch.equal(grown[:3], ref)
        grown[need - 1] = 1.5                                   # the newly mapped end is writable
        assert torch.all(grown[need - 1] == 1.5)
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    assert torch.equal(pool[:3], ref)                           # a tensor taken before growth still reads
    assert memory.vmm_mapped_bytes("cuda") >= s.nbytes
    s.release()
    assert s.nbytes == 0 and s.num_blocks == 0


def test_release_returns_memory_to_the_device():
    granule = memory.make_storage(SHAPE, torch.bfloat16, "cuda", "vmm").granularity
    before = _free()
    s = memory.make_storage(SHAPE, torch.bfloat16, "cuda", "vmm")
    s.ensure((1 << 30) // s.block_nbytes).fill_(1)              # 1 GiB
    s._settle(wait=True)                                        # the map-ahead in flight lands first
    during = _free()
    assert before - during >= (1 << 30) and before - during - s.nbytes <= 2 * granule
    s.release()
    assert s.nbytes == 0 and abs(_free() - before) <= 2 * granule
    s.ensure(10)                                                # usable again, then collected
    del s
    assert abs(_free() - before) <= 2 * granule


def test_keep_bytes_stay_mapped():
    s = memory.make_storage(SHAPE, torch.bfloat16, "cuda", "vmm", keep_bytes=8 << 20)
    for n in (10, 1000, 5000):
        s.ensure(n)
    s.release()
    assert (8 << 20) <= s.nbytes < 5000 * s.block_nbytes
    base = s.tensor.data_ptr()
    s.ensure(4000)
    assert s.tensor.data_ptr() == base
    s.release(0)
    assert s.nbytes == 0


def test_out_of_memory_raises_and_leaves_the_pool_usable():
    s = memory.make_storage(SHAPE, torch.bfloat16, "cuda", "vmm")   # uncapped: reserves device memory
    pool = s.ensure(100)
    pool[:100] = 2
    mapped, total_mapped = s.nbytes, memory.vmm_mapped_bytes("cuda")
    with pytest.raises(MemoryError, match=r"asked \d+ more bytes.*bytes mapped, at most \d+ reserved"):
        s.ensure(s.max_blocks)                                  # all of the device: never fits
    assert s.nbytes == mapped and memory.vmm_mapped_bytes("cuda") == total_mapped
    assert torch.all(s.ensure(200)[:100] == 2)
    with pytest.raises(MemoryError, match="blocks"):
        s.ensure(s.max_blocks + 1)                              # beyond the reservation
    s.release()


# ---- generate -----------------------------------------------------------------------------------------
LLAMA = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
             intermediate_size=1024, vocab_size=1000, max_position_embeddings=4096, pad_token_id=0,
             bos_token_id=None, eos_token_id=None)     # float32 KV: 128 KiB per block and layer


@pytest.fixture(scope="module")
def llama():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA), attn_implementation="sdpa",
                                                 dtype=torch.float32)
    return model.eval()


def _prompts(lengths=(300, 170), seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, LLAMA["vocab_size"], (len(lengths), width), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, width - n:] = 1
    return ids.masked_fill(mask == 0, 0).cuda(), mask.cuda()


def _generate(model, attn, cascade_config=None, **kw):
    model.set_attn_implementation(attn)
    try:
        extra = {} if cascade_config is None else dict(hf_cascade_config=cascade_config)
        return model.generate(**kw, **extra)
    finally:
        model.set_attn_implementation("sdpa")


class PoolWatch:
    """Per forward: (data_ptr, mapped bytes) of layer 0's pool, read from the cache the forward got."""

    def __init__(self, model):
        self.seen = []
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        storage = getattr(cache.layers[0], "storage", None) if cache is not None else None
        if storage is not None:
            self.seen.append((type(storage).__name__, storage.tensor.data_ptr(), storage.nbytes))


def test_generate_vmm_grows_in_place(llama):
    ids, mask = _prompts()
    kw = dict(input_ids=ids, attention_mask=mask, num_beams=8, max_new_tokens=240, pad_token_id=0)
    watch = PoolWatch(llama)
    try:
        # transformers' loop: its forwards pass the model's hooks (the whole step's replays and host steps do not),
        # so the watch sees the pool at every step
        got = _generate(llama, "cascade", CascadeConfig(memory="vmm", backend="reference"), **kw, **host_loop())
    finally:
        watch.handle.remove()
    kinds, ptrs, mapped = zip(*watch.seen)
    assert set(kinds) == {"VMMStorage"} and len(set(ptrs)) == 1, "the pool must never move"
    assert len(set(mapped)) >= 2, f"the pool should have grown while decoding: {sorted(set(mapped))}"
    gc.collect()      # earlier tests' dead caches (reference cycles; collection paused during graph captures)
    assert memory.vmm_mapped_bytes("cuda") == 0, "generate's reset must unmap everything"
    expected = _generate(llama, "cascade", CascadeConfig(memory="grow", backend="reference"), **kw)
    assert torch.equal(got, expected)


def test_generate_of_unknown_length_same_tokens_for_every_policy(llama):
    ids, mask = _prompts(seed=1)
    base = dict(input_ids=ids, attention_mask=mask, num_beams=4, num_return_sequences=2, pad_token_id=0)
    preview = _generate(llama, "sdpa", max_new_tokens=48, num_beams=4, input_ids=ids, attention_mask=mask,
                        pad_token_id=0)
    eos = int(preview[0, ids.shape[1] + 30])                   # a token it produces: stops early, when is unknown
    kw = dict(base, max_new_tokens=64, eos_token_id=eos)
    stock = _generate(llama, "sdpa", **kw)
    out = _generate(llama, "cascade", CascadeConfig(memory="grow", backend="reference"),
                    return_dict_in_generate=True, **kw)
    peak = returned_cache(out).stats().peak_kv_bytes_in_use
    returned_cache(out).reset()
    results = {"grow": out.sequences}
    for policy, cap in (("vmm", None), ("static", peak), ("auto", None)):
        results[policy] = _generate(llama, "cascade", CascadeConfig(memory=policy, max_kv_bytes=cap,
                                                                    backend="reference"), **kw)
    for policy, seq in results.items():
        assert torch.equal(seq, results["grow"]), f"memory={policy!r} changed the tokens"
    assert torch.equal(results["vmm"], stock)
    assert memory.vmm_mapped_bytes("cuda") == 0


def test_generate_cap_too_small_releases_every_mapping(llama):
    ids, mask = _prompts(seed=2)
    kw = dict(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=32, pad_token_id=0)
    small = CascadeConfig(memory="vmm", max_kv_bytes=40 * 4 * 2 * 16 * 8 * 128 * 4, backend="reference")  # 40 blocks
    # a first failing call makes what a process allocates once (e.g. cuBLAS's workspace on the stream that warms a
    # graph capture up); then a failing call must leave nothing behind
    for call in range(2):
        gc.collect()
        torch.cuda.empty_cache()
        free_before = _free()
        with pytest.raises(MemoryError, match="block"):
            _generate(llama, "cascade", small, **kw)
        assert memory.vmm_mapped_bytes("cuda") == 0
    gc.collect()
    torch.cuda.empty_cache()
    assert _free() >= free_before - (8 << 20), "the failed generate left device memory behind"
    got = _generate(llama, "cascade", CascadeConfig(memory="vmm", backend="reference"), **kw)
    assert torch.equal(got, _generate(llama, "sdpa", **kw))
    assert memory.vmm_mapped_bytes("cuda") == 0


def test_keep_auto_serves_the_next_call_and_release_gives_it_back(llama, monkeypatch):
    """keep_kv_bytes="auto": what a call mapped stays mapped for the model's next call (kept with its captured step),
    which maps nothing more at the same shape and gives the same tokens; hf_cascade.release(model) unmaps it all
    (the mapping the default unmaps and maps again on every call: ~0.25 ms per MiB)."""
    ids, mask = _prompts(seed=3)
    kw = dict(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=24, pad_token_id=0)
    config = CascadeConfig(keep_kv_bytes="auto")
    assert memory.vmm_mapped_bytes("cuda") == 0
    first = _generate(llama, "cascade", config, **kw)
    kept = memory.vmm_mapped_bytes("cuda")
    assert kept > 0, "keep_kv_bytes='auto' should keep the call's mapping"
    maps = []
    real_map = memory._VirtualRange._map
    monkeypatch.setattr(memory._VirtualRange, "_map", lambda vrange, size: maps.append(size) or real_map(vrange, size))
    second = _generate(llama, "cascade", config, **kw)
    assert torch.equal(first, second)
    assert maps == [] and memory.vmm_mapped_bytes("cuda") == kept, f"the second call mapped {sum(maps)} bytes more"
    hf_cascade.release(llama)
    assert memory.vmm_mapped_bytes("cuda") == 0
    assert torch.equal(_generate(llama, "cascade", CascadeConfig(), **kw), first)    # the default: same tokens
    assert memory.vmm_mapped_bytes("cuda") == 0                                     # and nothing kept mapped
