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
from hf_cascade.config import ConfigTypeError
from hf_cascade.memory import make_storage
from conftest import cache_kw, padded_batch, tiny_config

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
])
def test_config_refuses_wrong_types_and_values(kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        CascadeConfig(**kwargs)
    if error is TypeError:      # also a ValueError, as these errors were before
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
    assert list(report["backends"]) == list(kernels.AUTO_ORDER)
    for name, (ok, reason) in report["backends"].items():
        assert isinstance(ok, bool) and reason, name
    if not torch.cuda.is_available():
        assert report["backends"]["cuda"][0] is False and "CUDA" in report["backends"]["cuda"][1]
        assert report["gpus"] == []


# ----------------------------------------------------------------------------------------- which backend runs

def _select_with(monkeypatch, caplog, device: str, cuda_reason: str, calls: int = 3, dtype=torch.bfloat16):
    monkeypatch.setattr(kernels, "_logged", set())
    monkeypatch.setitem(kernels._loaded, "cuda", types.SimpleNamespace(unsupported_reason=lambda q, p, s: cuda_reason))
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
    cuda = kernels.load("cuda")
    assert f'f"{kernels.FIXABLE_PREFIX}: ' in inspect.getsource(cuda.unsupported_reason)


def test_env_names_what_is_missing_for_the_cuda_kernels(monkeypatch):
    """On a GPU without nvcc and without prebuilt kernels the report says so and how to fix it; with a
    prebuilt library it loads that (a stand-in backend and a pretend GPU)."""
    from hf_cascade import diagnostics
    loaded = []
    fake = types.SimpleNamespace(_find_nvcc=lambda: None,
                                 library=lambda device: loaded.append(device) or types.SimpleNamespace(
                                     path="/pkg/libhfc.so", prefix_kernel="v2"))
    monkeypatch.setitem(kernels._loaded, "cuda", fake)
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
