"""Bad input gets an error that names the problem and what to do: config values, the KV cap, a full pool,
the CLI's flags (before anything loads), and the WARNING when a fast kernel backend is off for a reason
the user can fix."""
from __future__ import annotations

import copy
import json
import logging
import types

import pytest
import torch

import hf_cascade
from hf_cascade import CascadeCache, CascadeConfig, PoolExhausted, kernels
from hf_cascade import __main__ as cli
from hf_cascade import generation, logs
from hf_cascade.config import MAX_BLOCK_SIZE, ConfigTypeError
from hf_cascade.memory import PoolAllocationError, make_storage
from conftest import cache_kw, model_pair, padded_batch, returned_cache, tiny_config

GEN = dict(num_beams=2, max_new_tokens=3, pad_token_id=0)


# ----------------------------------------------------------------------------------------- config

@pytest.mark.parametrize("kwargs,error,match", [
    (dict(backend=3), TypeError, "backend must be a string"),
    (dict(backend="cdua"), ValueError, "did you mean 'cuda'"),
    (dict(backend="Reference"), ValueError, "backend must be one of"),
    (dict(memory="vm"), ValueError, "did you mean 'vmm'"),
    (dict(memory=None), TypeError, "memory must be a string"),
    (dict(block_size="16"), TypeError, "block_size must be an int"),
    (dict(block_size=16.0), TypeError, "block_size must be an int"),
    (dict(block_size=0), ValueError, "block_size must be an int >= 1"),
    (dict(min_group_rows=2.0), TypeError, "min_group_rows"),
    (dict(min_group_rows=1), ValueError, "min_group_rows must be an int >= 2"),
    (dict(min_prefix_tokens=True), TypeError, "min_prefix_tokens"),
    (dict(max_kv_bytes="4GB"), TypeError, "max_kv_bytes must be a number of bytes"),
    (dict(max_kv_bytes=float("nan")), ValueError, "max_kv_bytes"),
    (dict(keep_kv_bytes=-1), ValueError, "keep_kv_bytes"),
    (dict(block_size=10**9), ValueError, "block_size must be at most 65536"),
    (dict(blocksize=16), TypeError, "'blocksize': did you mean 'block_size'"),
    (dict(compile="max_autotune"), ValueError, r"compile must be True, False or one of \('regional',\)"),
    (dict(compile=1), TypeError, "compile must be True, False or one of"),
    # removed settings: why, and what to do instead
    (dict(compile="max-autotune"), ValueError, r"compile='max-autotune'\) was removed: it measured 6% slower.*Use "
                                               r"compile=True"),
    (dict(static_decode=False), ValueError, "static_decode was removed.*your own decode loop"),
    (dict(whole_step=False), ValueError, "whole_step was removed.*use cuda_graphs=False"),
    (dict(fuse_projections=1), TypeError, "fuse_projections must be a bool"),
])
def test_config_refuses_wrong_types_and_values(kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        CascadeConfig(**kwargs)
    if "blocksize" in kwargs:     # a misspelt field: a plain TypeError, as from any __init__
        assert type(info.value) is TypeError
    elif error is TypeError:      # also a ValueError, as these errors were before
        assert isinstance(info.value, ConfigTypeError) and isinstance(info.value, ValueError)
    else:
        assert not isinstance(info.value, TypeError)


def test_config_normalises_numbers():
    config = CascadeConfig(max_kv_bytes=4e9, keep_kv_bytes=2.5e6, block_size=torch.tensor(8).numpy()[()])
    assert (config.max_kv_bytes, config.keep_kv_bytes, config.block_size) == (4_000_000_000, 2_500_000, 8)
    assert all(type(v) is int for v in (config.max_kv_bytes, config.keep_kv_bytes, config.block_size))


def test_coerce():
    config = CascadeConfig(backend="reference")
    assert CascadeConfig.coerce(config) is config
    assert CascadeConfig.coerce(None) == CascadeConfig()
    assert CascadeConfig.coerce({"backend": "reference", "block_size": 4}) == CascadeConfig(backend="reference",
                                                                                            block_size=4)
    with pytest.raises(TypeError, match="'blok_size': did you mean 'block_size'"):
        CascadeConfig.coerce({"blok_size": 4})
    with pytest.raises(TypeError, match="CascadeConfig, a dict of its fields or None, got str"):
        CascadeConfig.coerce("reference")
    with pytest.raises(ValueError, match="block_size"):          # a dict's values are checked as well
        CascadeConfig.coerce({"block_size": -1})
    # an old config of a removed setting: its old default is accepted as it is; anything else says what to do now
    assert CascadeConfig.coerce({"whole_step": True, "static_decode": True}) == CascadeConfig()
    assert CascadeConfig(whole_step=True, backend="reference") == CascadeConfig(backend="reference")
    with pytest.raises(ValueError, match=r"whole_step was removed.*\(got whole_step=False\)"):
        CascadeConfig.coerce({"whole_step": False})
    with pytest.raises(ValueError, match="static_decode was removed"):
        CascadeConfig.coerce({"static_decode": 0})
    assert not hasattr(CascadeConfig(), "whole_step") and not hasattr(CascadeConfig(), "static_decode")


def test_generate_takes_the_config_as_a_dict(llama_pair):
    stock, cascade = llama_pair
    ids, mask = padded_batch()
    expected = stock.generate(input_ids=ids, attention_mask=mask, **GEN)
    got = cascade.generate(input_ids=ids, attention_mask=mask, **GEN, hf_cascade_config={"block_size": 4})
    assert torch.equal(got, expected)
    with pytest.raises(TypeError, match="CascadeConfig"):
        cascade.generate(input_ids=ids, attention_mask=mask, **GEN, hf_cascade_config="reference")


# ----------------------------------------------------------------------------------------- the cache and its cap

def test_cache_refuses_a_cascade_config_in_the_model_config_slot():
    with pytest.raises(TypeError, match=r"CascadeCache\(model.config, cascade_config\)"):
        CascadeCache(CascadeConfig())
    cache = CascadeCache(tiny_config("llama"), {"block_size": 4})
    assert cache.cascade_config.block_size == 4 and cache.block_size == 4


def _block_bytes(config, itemsize):
    # K+V x block 4 x 2 KV heads x head_dim 16 x layers (tiny_config: hidden 64, 4 heads, 2 KV heads)
    return 2 * 4 * 2 * 16 * itemsize * config.num_hidden_layers


def test_cap_below_one_block_is_refused_when_the_cache_is_made(llama_pair):
    _, cascade = llama_pair                                    # float64
    one_block = _block_bytes(cascade.config, 8)
    with pytest.raises(ValueError, match=rf"max_kv_bytes={one_block - 1} holds less than one KV block.*"
                                         rf"{one_block} bytes.*lower block_size"):
        CascadeCache(cascade.config, CascadeConfig(block_size=4, max_kv_bytes=one_block - 1))
    CascadeCache(cascade.config, CascadeConfig(block_size=4, max_kv_bytes=one_block))
    with pytest.raises(ValueError, match="needs the model config"):
        CascadeCache(None, CascadeConfig(max_kv_bytes=10**9))


def test_cap_check_without_a_dtype_in_the_config_counts_two_bytes():
    config = tiny_config("llama")
    config.dtype = None
    two_bytes = _block_bytes(config, 2)
    with pytest.raises(ValueError, match="less than one KV block"):
        CascadeCache(config, CascadeConfig(block_size=4, max_kv_bytes=two_bytes - 1))
    CascadeCache(config, CascadeConfig(block_size=4, max_kv_bytes=two_bytes))
    config.dtype = torch.float32
    with pytest.raises(ValueError, match="less than one KV block"):
        CascadeCache(config, CascadeConfig(block_size=4, max_kv_bytes=two_bytes))


def test_a_cap_the_estimate_passed_leaves_the_cache_empty_when_the_kv_arrives(llama_pair):
    """Without a dtype in the model config the estimate counts 2 bytes; float64 K/V then need 4x: the exact
    check refuses before the cache changes, so the cache stays empty."""
    _, cascade = llama_pair
    config = copy.deepcopy(cascade.config)
    config.dtype = None
    cap = _block_bytes(config, 2)
    cache = CascadeCache(config, CascadeConfig(block_size=4, max_kv_bytes=cap))
    ids, mask = padded_batch()
    with pytest.raises(ValueError, match=f"max_kv_bytes={cap} holds less than one block"):
        cascade.generate(input_ids=ids, attention_mask=mask, **GEN, **cache_kw(cascade, cache))
    assert (cache.blocks.num_rows, cache.get_seq_length(), cache.stats().blocks_in_use) == (0, 0, 0)


def test_a_full_pool_raises_pool_exhausted_naming_max_kv_bytes(llama_pair):
    _, cascade = llama_pair
    ids, mask = padded_batch(seed=1)
    cap = 3 * _block_bytes(cascade.config, 8)                   # 3 blocks: less than the prompts need
    cache = CascadeCache(cascade.config, CascadeConfig(block_size=4, max_kv_bytes=cap))
    with pytest.raises(PoolExhausted, match=rf"raise CascadeConfig.max_kv_bytes \(now {cap} bytes: 3 blocks") as info:
        cascade.generate(input_ids=ids, attention_mask=mask, **GEN, **cache_kw(cascade, cache))
    assert isinstance(info.value, MemoryError) and hf_cascade.PoolExhausted is PoolExhausted
    assert "max_blocks" not in str(info.value).split("Lower")[1]     # the advice names a setting that exists
    cache.reset()


def test_a_storage_past_its_cap_raises_pool_exhausted():
    storage = make_storage((2, 4, 1, 8), torch.float32, "cpu", "grow", max_blocks=2)
    storage.ensure(2)
    with pytest.raises(PoolExhausted, match="max_kv_bytes"):
        storage.ensure(3)
    assert storage.num_blocks == 2


# ----------------------------------------------------------------------------------------- the CLI

@pytest.fixture
def no_loading(monkeypatch):
    """Flag errors must come before any model is built."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")
    monkeypatch.setattr(cli, "build_model", refuse)


def _one_line_error(capsys, argv, code=2) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("python -m hf_cascade: error:")
    return last


@pytest.mark.parametrize("argv,match", [
    (["--backend", "foo"], "invalid choice: 'foo'"),
    (["--backend", "cuda", "--device", "cpu"], "runs on CUDA only"),
    (["--beams", "0"], "--beams: must be >= 1"),
    (["--prompt-len", "ten"], "invalid int value: 'ten'"),
    (["--device", "gpu0"], "'gpu0' is not a torch device"),
    (["--model", "/no/such/checkpoint"], "no such folder"),
    (["--json", "/no/such/folder/out.json"], "does not exist"),
    (["--dtype", "int8"], "invalid choice: 'int8'"),
])
def test_cli_refuses_bad_flags_in_one_line(capsys, no_loading, argv, match):
    assert match in _one_line_error(capsys, argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cli_refuses_cuda_without_a_gpu(capsys, no_loading):
    assert "no CUDA GPU is visible" in _one_line_error(capsys, ["--device", "cuda"])


def test_cli_run_failure_is_one_line(capsys, monkeypatch):
    def unsupported(*args, **kwargs):
        raise NotImplementedError("this model's attention cannot run as a cascade; load it with 'sdpa'")
    monkeypatch.setattr(cli, "run_comparison", unsupported)
    line = _one_line_error(capsys, ["--device", "cpu"], code=3)
    assert "NotImplementedError" in line and "load it with 'sdpa'" in line


def test_cli_every_flag_has_help():
    for action in cli.build_parser()._actions:
        assert action.help, action.option_strings


def test_cli_env_reports_versions_and_backends(capsys):
    assert cli.main(["env"]) == 0
    text = capsys.readouterr().out
    assert f"torch: {torch.__version__}" in text and f"hf_cascade: {hf_cascade.__version__}" in text
    assert "reference: yes" in text and "HF_CASCADE_CACHE" in text
    assert cli.main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["backends"]) == list(kernels.BACKENDS)
    for name, (ok, reason) in report["backends"].items():
        assert isinstance(ok, bool) and reason, name
    if not torch.cuda.is_available():
        assert report["backends"]["cuda"][0] is False and "CUDA" in report["backends"]["cuda"][1]
        assert report["gpus"] == []


# ----------------------------------------------------------------------------------------- which backend runs

def _select_with(monkeypatch, caplog, device: str, cuda_reason: str, calls: int = 3, dtype=torch.bfloat16):
    monkeypatch.setattr(kernels, "_logged", set())
    monkeypatch.setitem(kernels._loaded, "cuda", types.SimpleNamespace(unsupported_reason=lambda *args: cuda_reason))
    monkeypatch.setitem(kernels._loaded, "flashinfer", ImportError("kernel backend 'flashinfer' is unavailable: "
                                                                   "flashinfer is not installed"))
    q = types.SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(1, 1, 2, 64))
    pool, plan = types.SimpleNamespace(shape=(1, 2, 16, 1, 64)), types.SimpleNamespace(src_index=None)
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        for _ in range(calls):
            assert kernels.select("auto", q, pool, plan) is kernels.load("reference")
    return [r for r in caplog.records if r.levelno == logging.WARNING]


def test_fast_backends_off_for_a_fixable_reason_warn_once(monkeypatch, caplog):
    warnings = _select_with(monkeypatch, caplog, "cuda", "CUDA kernels unavailable: RuntimeError: nvcc not found")
    assert len(warnings) == 2, [w.getMessage() for w in warnings]            # one per backend, not per call
    cuda_line, fi_line = (w.getMessage() for w in warnings)
    assert "cuda attention kernels are off" in cuda_line and "nvcc not found" in cuda_line
    assert "install the CUDA toolkit" in cuda_line and "python -m hf_cascade env" in cuda_line
    assert "flashinfer" in fi_line and "pip install 'hf_cascade[flashinfer]'" in fi_line
    assert all(w.name == "hf_cascade" for w in warnings)


def test_routine_choices_stay_at_info(monkeypatch, caplog):
    assert _select_with(monkeypatch, caplog, "cuda", "dtype torch.float32 (needs bfloat16 or float16)") != []
    caplog.clear()       # flashinfer missing still warns on a GPU; a dtype the kernels do not take does not
    warnings = _select_with(monkeypatch, caplog, "cuda", "dtype torch.float32 (needs bfloat16 or float16)")
    assert [w.getMessage() for w in warnings if "cuda attention" in w.getMessage()] == []
    caplog.clear()       # a float32 step: no fast backend would take it, nothing to fix
    assert _select_with(monkeypatch, caplog, "cuda", "dtype torch.float32 (needs bfloat16 or float16)",
                        dtype=torch.float32) == []
    caplog.clear()
    assert _select_with(monkeypatch, caplog, "cpu", "needs CUDA tensors") == []    # nothing to fix on the CPU
    assert any("attention backend 'reference'" in r.getMessage() for r in caplog.records)


def test_the_cuda_backend_reason_is_the_one_the_warning_looks_for():
    """The WARNING keys on the cuda backend's wording for a library that cannot build or load."""
    import inspect
    cuda = kernels.module("cuda")
    assert f'f"{kernels.FIXABLE_PREFIX}: ' in inspect.getsource(cuda._unsupported)


def test_env_names_what_is_missing_for_the_cuda_kernels(monkeypatch):
    """On a GPU without nvcc and without prebuilt kernels the report says so and how to fix it; with a
    prebuilt library it loads that (a stand-in backend and a pretend GPU)."""
    from hf_cascade import diagnostics
    loaded = []
    fake = types.SimpleNamespace(_find_nvcc=lambda: None,
                                 library=lambda device: loaded.append(device) or types.SimpleNamespace(
                                     path="/pkg/libhfc.so", prefix_kernel="v2"))
    monkeypatch.setitem(kernels._loaded, "cuda", fake)
    monkeypatch.setattr(kernels, "module", lambda name: fake)       # the backend's module: its library, nvcc
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    ok, reason = diagnostics._cuda_backend()
    assert not ok and "nvcc not found" in reason and kernels.FIXES["cuda"] in reason and not loaded
    fake.prebuilt_library = lambda: "/pkg/libhfc.so"
    ok, reason = diagnostics._cuda_backend()
    assert ok and "prebuilt library /pkg/libhfc.so" in reason and "v2" in reason and len(loaded) == 1
    fake.prebuilt_library = lambda: None
    fake._find_nvcc = lambda: "/usr/local/cuda/bin/nvcc"
    fake.library = lambda device: (_ for _ in ()).throw(RuntimeError("nvcc failed with exit code 1"))
    ok, reason = diagnostics._cuda_backend()
    assert not ok and "built with /usr/local/cuda/bin/nvcc" in reason and "nvcc failed" in reason


def test_the_largest_block_size_is_accepted():
    assert CascadeConfig(block_size=MAX_BLOCK_SIZE).block_size == 2 ** 16


@pytest.mark.parametrize("policy,match", [("static", "lower max_kv_bytes"), ("grow", "lower CascadeConfig.block_size")])
def test_a_pool_the_device_cannot_allocate_names_the_setting(policy, match):
    """The allocator's own error names no setting; the pool's names the one to change (and stays an OutOfMemoryError)."""
    huge = (2, 16, 2 ** 20, 2 ** 20)            # 2**41 elements a block: no machine allocates it
    with pytest.raises(PoolAllocationError, match=match) as info:
        storage = make_storage(huge, torch.float32, "cpu", policy, max_blocks=4)
        storage.ensure(1)
    assert isinstance(info.value, torch.OutOfMemoryError) and "could not be allocated on cpu" in str(info.value)


def test_static_pool_past_the_device_names_max_kv_bytes(llama_pair):
    _, cascade = llama_pair
    ids, mask = padded_batch()
    with pytest.raises(PoolAllocationError, match=r'memory="static" allocates CascadeConfig.max_kv_bytes up front'):
        cascade.generate(input_ids=ids, attention_mask=mask, **GEN,
                         hf_cascade_config=dict(memory="static", max_kv_bytes=1e15))
    got = cascade.generate(input_ids=ids, attention_mask=mask, **GEN)     # the model is fine afterwards
    assert got.shape == (2, ids.shape[1] + GEN["max_new_tokens"])


# ----------------------------------------------------------------------------------------- max_kv_bytes on every path

def _greedy_kw(ids, mask, **extra):
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, **extra)


@pytest.mark.parametrize("call", [dict(), dict(num_beams=2)], ids=["nothing-to-share", "below-threshold"])
def test_a_cap_holds_where_the_call_would_run_on_stocks_path(llama_pair, monkeypatch, call):
    """Greedy with one sequence per prompt (nothing to share), and beams below the CPU threshold, used to run on
    stock's path with its uncapped DynamicCache; a capped call runs the cascade, whose pool enforces the cap."""
    monkeypatch.setattr(generation, "MIN_SHARED_TOKENS", {"cpu": 1024})
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=3)
    block = _block_bytes(cascade.config, 8)                   # block_size 4, float64
    with pytest.raises(PoolExhausted, match="max_kv_bytes"):
        cascade.generate(**_greedy_kw(ids, mask, **call), hf_cascade_config=dict(block_size=4, max_kv_bytes=4 * block))
    expected = stock.generate(**_greedy_kw(ids, mask, **call))
    cap = 32 * block
    out = cascade.generate(**_greedy_kw(ids, mask, **call), hf_cascade_config=dict(block_size=4, max_kv_bytes=cap),
                           return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    stats = returned_cache(out).stats()
    assert 0 < stats.peak_kv_bytes_in_use <= cap and stats.kv_bytes_reserved <= cap


def test_paths_that_cannot_hold_a_cap_refuse_before_running(llama_pair):
    stock, cascade = llama_pair
    ids, mask = padded_batch(seed=4)
    capped = dict(hf_cascade_config=dict(max_kv_bytes=10 ** 6))
    with pytest.raises(ValueError, match="max_kv_bytes cannot be enforced for output_hidden_states"):
        cascade.generate(**_greedy_kw(ids, mask), **capped, return_dict_in_generate=True, output_hidden_states=True)
    from transformers import DynamicCache
    with pytest.raises(ValueError, match="max_kv_bytes cannot be enforced for a DynamicCache of yours.*CascadeCache"):
        cascade.generate(**_greedy_kw(ids, mask), **capped, **cache_kw(cascade, DynamicCache(config=cascade.config)))
    with pytest.raises(ValueError, match="max_kv_bytes cannot be enforced with assisted decoding"):
        cascade.generate(**_greedy_kw(ids, mask), **capped, prompt_lookup_num_tokens=2)
    with pytest.raises(ValueError, match="both a CascadeCache and hf_cascade_config"):   # the cache's config applies
        cascade.generate(**_greedy_kw(ids, mask), **capped, **cache_kw(cascade, CascadeCache(cascade.config)))
    # use_cache=False stores no K/V at all: nothing to cap, stock's tokens
    assert torch.equal(cascade.generate(**_greedy_kw(ids, mask), **capped, use_cache=False),
                       stock.generate(**_greedy_kw(ids, mask), use_cache=False))
    # without a cap those paths run as before (stock's tokens)
    one = dict(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=8, pad_token_id=0, prompt_lookup_num_tokens=2)
    assert torch.equal(cascade.generate(**one, hf_cascade_config=dict(block_size=4)), stock.generate(**one))


# ----------------------------------------------------------------------------------------- shapes and counts

@pytest.mark.parametrize("ids_shape,mask_shape,match", [
    ((23,), None, r"input_ids of shape \[batch, length\], got \(23,\)"),
    ((2, 23), (23,), r"attention_mask of shape \(23,\) for input_ids of shape \(2, 23\)"),
    ((2, 23), (2, 30), r"attention_mask of shape \(2, 30\)"),
    ((2, 23, 1), None, "input_ids of shape"),
])
def test_shared_prefix_length_names_shapes_that_disagree(ids_shape, mask_shape, match):
    ids = torch.ones(ids_shape, dtype=torch.long)
    mask = None if mask_shape is None else torch.ones(mask_shape, dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        generation.shared_prefix_length(ids, mask, min_tokens=1)
    with pytest.raises(ValueError, match=r"per-token input of shape \(2, 5\)"):
        generation.shared_prefix_length(torch.ones(2, 23, dtype=torch.long), None, 1, also=(torch.ones(2, 5),))


@pytest.mark.parametrize("width", [30, 20])
@pytest.mark.parametrize("beams", [1, 2])
def test_a_mask_wider_or_narrower_than_the_ids_says_what_generate_expects(llama_pair, width, beams):
    """Stock crashes inside on a narrower mask and runs a wider one with other positions' entries (its tokens then
    differed from ours); the message names both shapes and what generate takes."""
    _, cascade = llama_pair
    ids, _ = padded_batch()
    mask = torch.ones(2, width, dtype=torch.long)
    for extra in ({}, cache_kw(cascade, CascadeCache(cascade.config))):
        with pytest.raises(ValueError, match=r"must have the input_ids' shape \[2, 23\], one entry per prompt token") \
                as info:
            cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, num_beams=beams, pad_token_id=0,
                             **extra)
        assert f"[2, {width}]" in str(info.value) and "use model.generate" not in str(info.value)


@pytest.mark.parametrize("config", [None, dict(cuda_graphs="eager")], ids=["default", "whole-step"])
@pytest.mark.parametrize("returned", [0, -1])
def test_beam_search_returning_fewer_than_one_sequence_is_refused(llama_pair, returned, config):
    """Stock crashes inside its beam search (0) or returns rows that belong to no prompt (-1, 4 rows for 2 prompts);
    the whole step answered with an internal error (-1) or 2 rows (0): refused at the entry, on every path."""
    stock, cascade = llama_pair
    ids, mask = padded_batch()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=2, num_beams=3, num_return_sequences=returned,
              pad_token_id=0)
    if returned == 0:
        with pytest.raises(Exception):
            stock.generate(**kw)
    else:
        assert stock.generate(**kw).shape[0] != ids.shape[0] * 3
    with pytest.raises(ValueError, match=f"num_return_sequences must be a positive integer.*got {returned}"):
        cascade.generate(**kw, **({} if config is None else dict(hf_cascade_config=config)))


@pytest.mark.parametrize("beams", [0, -2])
def test_num_beams_below_one_is_refused(llama_pair, beams):
    """Stock raises (ZeroDivisionError, a negative dimension) from inside; the cascade entry ran it as greedy."""
    stock, cascade = llama_pair
    ids, mask = padded_batch()
    with pytest.raises(Exception):
        stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, num_beams=beams, pad_token_id=0)
    with pytest.raises(ValueError, match=f"num_beams must be a positive integer.*got {beams}"):
        cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, num_beams=beams, pad_token_id=0)


@pytest.mark.parametrize("kwargs", [dict(num_beams=2, num_return_sequences=3), dict(max_new_tokens=0),
                                    dict(max_new_tokens=-1), dict(do_sample=True, top_k=-1),
                                    dict(do_sample=True, temperature=0.0)])
def test_other_counts_behave_as_stock(llama_pair, kwargs):
    stock, cascade = llama_pair
    ids, mask = padded_batch()
    kw = dict(input_ids=ids, attention_mask=mask, pad_token_id=0, **{"max_new_tokens": 2, **kwargs})
    with pytest.raises(ValueError) as expected:
        stock.generate(**kw)
    with pytest.raises(ValueError) as got:
        cascade.generate(**kw)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("count", [0, -1])
def test_zero_or_negative_num_return_sequences_runs_as_stock(llama_pair, count):
    stock, cascade = llama_pair
    ids, mask = padded_batch()
    kw = dict(input_ids=ids, attention_mask=mask, pad_token_id=0, max_new_tokens=3, num_return_sequences=count)
    assert torch.equal(cascade.generate(**kw), stock.generate(**kw))


# ----------------------------------------------------------------------------------------- switching and routing

def test_hf_cascade_config_on_a_non_cascade_model_says_what_it_needs(llama_pair):
    stock, _ = llama_pair
    ids, mask = padded_batch()
    with pytest.raises(ValueError, match="hf_cascade_config applies only to models loaded with "
                                         "attn_implementation='cascade'.*uses 'sdpa'"):
        stock.generate(input_ids=ids, attention_mask=mask, **GEN, hf_cascade_config={"block_size": 4})


def _t5_pair():
    import transformers as T
    from transformers import AutoModelForSeq2SeqLM

    def config():
        return T.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
                          relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=0,
                          eos_token_id=1, decoder_start_token_id=0)
    torch.manual_seed(0)
    stock = AutoModelForSeq2SeqLM.from_config(config(), attn_implementation="sdpa", dtype=torch.float64).eval()
    other = AutoModelForSeq2SeqLM.from_config(config(), attn_implementation="sdpa", dtype=torch.float64).eval()
    other.load_state_dict(stock.state_dict())
    return stock, other


def test_a_model_switched_to_cascade_after_loading():
    """T5's stacks keep config copies: setting model.config._attn_implementation switched only the top and crashed
    with a size mismatch; it is refused with the fix, and set_attn_implementation gives stock's tokens (as does
    either way on a decoder-only model, whose layers share the model's config)."""
    stock, t5 = _t5_pair()
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, num_beams=2)
    expected = stock.generate(**kw)
    t5.config._attn_implementation = "cascade"
    refusal = r"decoder still runs 'sdpa'.*Load the model with attn_implementation='cascade'"
    with pytest.raises(ValueError, match=refusal):
        t5.generate(**kw)
    t5.set_attn_implementation("cascade")
    if t5.decoder.config._attn_implementation == "cascade":
        assert torch.equal(t5.generate(**kw), expected)
    else:             # transformers 5.17's set_attn_implementation does not reach T5's stacks
        with pytest.raises(ValueError, match=refusal):
            t5.generate(**kw)
    for switch in ("config", "set"):
        stock, llama = model_pair("llama")
        llama.set_attn_implementation("sdpa")
        if switch == "config":
            llama.config._attn_implementation = "cascade"
        else:
            llama.set_attn_implementation("cascade")
        ids, mask = padded_batch()
        assert torch.equal(llama.generate(input_ids=ids, attention_mask=mask, **GEN),
                           stock.generate(input_ids=ids, attention_mask=mask, **GEN))


# ----------------------------------------------------------------------------------------- log lines

def test_compile_without_graphs_is_warned_once(llama_pair, caplog, monkeypatch):
    monkeypatch.setattr(logs, "_logged", set())
    _, cascade = llama_pair
    ids, mask = padded_batch()
    with caplog.at_level(logging.WARNING, logger="hf_cascade"):
        for _ in range(2):
            cascade.generate(input_ids=ids, attention_mask=mask, **GEN, hf_cascade_config={"compile": True})
    lines = [r.getMessage() for r in caplog.records if "compile=True" in r.getMessage()]
    assert len(lines) == 1 and "ignored" in lines[0] and "the model is on cpu, not CUDA" in lines[0], lines
    assert caplog.records[0].levelno == logging.WARNING


def test_a_line_logged_once_at_info_still_shows_at_warning(llama_pair, caplog, monkeypatch):
    """cuda_graphs=None logs 'decode steps run without CUDA graphs' at INFO; a later cuda_graphs=True asks for a
    WARNING, which must show even though the same line was logged at INFO (and only once)."""
    monkeypatch.setattr(logs, "_logged", set())
    _, cascade = llama_pair
    ids, mask = padded_batch()
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        for graphs_mode in (None, True, True, None):
            cascade.generate(input_ids=ids, attention_mask=mask, **GEN, hf_cascade_config={"cuda_graphs": graphs_mode})
    levels = [r.levelno for r in caplog.records if "without CUDA graphs" in r.getMessage()]
    assert levels == [logging.INFO, logging.WARNING], levels


def test_kernels_log_once_keys_by_level(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_logged", set())
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        for level in (logging.INFO, logging.WARNING, logging.WARNING, logging.INFO):
            kernels._log_once(("k",), "a line", level=level)
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.WARNING]


def test_log_lines_do_not_repeat_the_logger_name(llama_pair, caplog, monkeypatch):
    monkeypatch.setattr(logs, "_logged", set())
    monkeypatch.setattr(kernels, "_logged", set())
    monkeypatch.setattr(logs, "_logged", set())
    _, cascade = llama_pair
    ids, mask = padded_batch()
    with caplog.at_level(logging.INFO, logger="hf_cascade"):
        cascade.generate(input_ids=ids, attention_mask=mask, **GEN)
        cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0)   # stock's path
    ours = [r for r in caplog.records if r.name == "hf_cascade"]
    assert len(ours) >= 3 and any("stock's dense path" in r.getMessage() for r in ours)
    assert not [r.getMessage() for r in ours if r.getMessage().startswith("hf_cascade")]


@pytest.mark.parametrize("masks", [[[0, 0, 0, 0, 1]], [[0, 0, 0, 0, 1], [0, 0, 0, 0, 0]], [[0, 0, 0, 0, 0]]])
def test_padded_prompts_of_one_token_give_stock_tokens(llama_pair, masks):
    """Left padding before each prompt's only token: the prefill stores nothing, and the first decode step's dense
    attention got the pads' mask (a size-mismatch RuntimeError); the graph runner's static step gave other tokens.
    (Found by tests/test_fuzz.py.)"""
    stock, cascade = llama_pair
    mask = torch.tensor(masks)
    ids = torch.randint(3, 96, mask.shape, generator=torch.Generator().manual_seed(0)).masked_fill(mask == 0, 0)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0, num_beams=2)
    expected = stock.generate(**kw)
    for extra in (dict(hf_cascade_config={"max_kv_bytes": 10 ** 6}), dict(hf_cascade_config={"cuda_graphs": "eager"}),
                  cache_kw(cascade, CascadeCache(cascade.config))):
        assert torch.equal(cascade.generate(**kw, **extra), expected), extra
    # on a CascadeCache with the runner too (an all-empty batch was refused there while the whole step's first step
    # ran without the attention mask: tests/test_edges.py, with a pad embedding of its own, shows it)
    got = cascade.generate(**kw, **cache_kw(cascade, CascadeCache(cascade.config, {"cuda_graphs": "eager"})))
    assert torch.equal(got, expected)
