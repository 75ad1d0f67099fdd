"""The model spread over several devices: tensor parallelism (torchrun, each rank caching its own KV
heads) and accelerate's device_map over GPUs, each against the same weights on one device.

The CPU cases (tensor parallelism over gloo, float64) run everywhere; the GPU cases need two GPUs (marked
``gpu(2)`` and ``multi_gpu``). All run benchmarks/multi_gpu.py, the script that measures the same on the Llama-3-8B
and Llama-3-70B shapes; its weights come from a saved checkpoint or, built sharded, from no checkpoint
(``--random``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "multi_gpu.py"
TP_FUSING = Path(__file__).resolve().parent / "tp_fusing_run.py"
# NVLink multicast stays off on shared multi-GPU hosts (it can take the host's GPUs out of service)
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "OMP_NUM_THREADS": "1"}


def _run(args: list[str], torchrun: bool = False, timeout: int = 600, script: Path = SCRIPT) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)] if torchrun \
        else [sys.executable, str(script)]
    env = {**os.environ, **SAFE_ENV}
    done = subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd + args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_ckpt")
    _run(["save", "--shape", "tiny", "--device", "cpu", "--dtype", "float64", "--dir", str(folder)])
    return folder


def _check_tp(tmp: Path, single: dict, ranks: int = 2) -> None:
    results = [_load(tmp / "tp.json")] + [_load(tmp / f"tp.json.rank{r}") for r in range(1, ranks)]
    for res in results:
        assert res["world_size"] == ranks
        assert res["tokens"] == single["tokens"], "tensor-parallel beams differ from the one-device run"
        # each rank stores only its own share of the KV heads, so a share of the bytes
        assert res["kv_heads_cached"] == res["kv_heads_model"] // ranks
        assert res["peak_kv_bytes_in_use"] * ranks == single["peak_kv_bytes_in_use"]
        # each rank fuses its local q/k/v and gate/up shards as the one process fuses the whole weights
        assert res["fused_groups"] == single["fused_groups"] > 0


def test_tensor_parallel_on_cpu_matches_one_process(tiny_checkpoint, tmp_path):
    common = ["--device", "cpu", "--dtype", "float64", "--dir", str(tiny_checkpoint), "--prompt", "40",
              "--beams", "4", "--new-tokens", "12", "--rounds", "0"]
    _run(["single", *common, "--out", str(tmp_path / "single.json")])
    single = _load(tmp_path / "single.json")
    assert single["kv_heads_cached"] == single["kv_heads_model"] == 2
    _run(["tp", *common, "--ref", str(tmp_path / "single.json"), "--out", str(tmp_path / "tp.json")],
         torchrun=True)
    _check_tp(tmp_path, single)


@pytest.fixture(scope="module")
def gpu_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("1b_ckpt")
    _run(["save", "--shape", "1b", "--device", "cuda", "--dtype", "float32", "--dir", str(folder)])
    return folder


GPU_COMMON = ["--dtype", "float32", "--prompt", "1000", "--beams", "4", "--new-tokens", "16", "--rounds", "0"]


@pytest.fixture(scope="module")
def gpu_single(gpu_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "single.json"
    _run(["single", *GPU_COMMON, "--dir", str(gpu_checkpoint), "--out", str(out)])
    return out


@pytest.mark.gpu(2)
@pytest.mark.multi_gpu
def test_device_map_over_two_gpus_matches_one_gpu(gpu_checkpoint, gpu_single, tmp_path):
    _run(["device-map", *GPU_COMMON, "--gpus", "2", "--dir", str(gpu_checkpoint), "--ref", str(gpu_single),
          "--out", str(tmp_path / "dmap.json")])
    res = _load(tmp_path / "dmap.json")
    assert res["devices_of_layers"] == ["cuda:0", "cuda:1"]
    assert res["pool_devices"] == ["cuda:0", "cuda:1"], "each layer's pool belongs on its layer's GPU"
    assert res["tokens_match_ref"]


@pytest.mark.gpu(2)
@pytest.mark.multi_gpu
def test_tensor_parallel_over_two_gpus_matches_one_gpu(gpu_checkpoint, gpu_single, tmp_path):
    _run(["tp", *GPU_COMMON, "--dir", str(gpu_checkpoint), "--ref", str(gpu_single),
          "--out", str(tmp_path / "tp.json")], torchrun=True)
    _check_tp(tmp_path, _load(gpu_single))


def test_tensor_parallel_whole_step_on_cpu_matches_one_process(tiny_checkpoint, tmp_path):
    """Tensor parallelism (gloo, 2 ranks) with decode steps on the graph runner's static path and the whole step on
    the device (each rank chooses the same tokens from the same gathered logits): the one-process tokens."""
    common = ["--device", "cpu", "--dtype", "float64", "--dir", str(tiny_checkpoint), "--prompt", "40",
              "--beams", "4", "--new-tokens", "12", "--graphs", "eager", "--rounds", "0"]
    _run(["single", *common, "--out", str(tmp_path / "single.json")])
    single = _load(tmp_path / "single.json")
    assert single["device_steps"] > 0
    _run(["tp", *common, "--ref", str(tmp_path / "single.json"), "--out", str(tmp_path / "tp.json")],
         torchrun=True)
    _check_tp(tmp_path, single)
    assert all(_load(path)["device_steps"] > 0 for path in (tmp_path / "tp.json", tmp_path / "tp.json.rank1"))


# ---- no checkpoint: the model built sharded, filled with seeded random weights (--random) ----

def _ranks(tmp: Path, name: str, ranks: int = 2) -> list[dict]:
    return [_load(tmp / name)] + [_load(tmp / f"{name}.rank{r}") for r in range(1, ranks)]


@pytest.fixture(scope="module", params=["tiny", "tiny70b"])
def random_runs(request, tmp_path_factory):
    """One process, then tensor parallelism over gloo (2 ranks) with stock interleaved, of a shape built from no
    checkpoint (tiny70b: the 70B's head ratios, 8 query heads per KV head); decode steps on the runner's static path
    and one timed round of the whole-generate step. Returns (shape, one-process result, the ranks' results)."""
    tmp = tmp_path_factory.mktemp(f"random_{request.param}")
    common = ["--random", request.param, "--device", "cpu", "--dtype", "float64", "--prompt", "40", "--beams", "4",
              "--new-tokens", "12", "--graphs", "eager", "--rounds", "1"]
    _run(["single", *common, "--out", str(tmp / "single.json")])
    _run(["tp", *common, "--with-stock", "--ref", str(tmp / "single.json"), "--out", str(tmp / "tp.json")],
         torchrun=True)
    return request.param, _load(tmp / "single.json"), _ranks(tmp, "tp.json")


def test_random_weights_sharded_on_cpu_match_one_process(random_runs, multi_gpu_module):
    """Each rank fills its shards of the weights the one process holds whole (the same tokens), caches only its share
    of the KV heads, and holds less than the whole model's weights; stock on the same shards gives the same tokens.
    Each rank fuses its local q/k/v and gate/up shards as the one process fuses the whole weights."""
    shape, single, ranks = random_runs
    assert single["kv_heads_cached"] == single["kv_heads_model"] == 2
    assert len({t for row in single["tokens"] for t in row}) > 1, "one token throughout: the comparison says little"
    layers = multi_gpu_module.SHAPES[shape]["num_hidden_layers"]
    assert single["fuse_projections"] and single["fused_groups"] == 2 * layers
    for res in ranks:
        assert res["world_size"] == 2 and res["shape"] == shape
        assert res["fused_groups"] == 2 * layers, "a rank left its projections unfused"
        assert res["tokens"] == single["tokens"], "tensor-parallel beams differ from the one-process run"
        assert res["kv_heads_cached"] == 1
        assert res["peak_kv_bytes_in_use"] * 2 == single["peak_kv_bytes_in_use"]
        # (the norms, and on transformers < 5.24 the embedding, are replicated: more than half, less than all)
        assert single["weight_bytes_per_process"] / 2 <= res["weight_bytes_per_process"] \
            < single["weight_bytes_per_process"]
        assert res["kv_bytes_per_process"] * 2 == single["kv_bytes_per_process"]
        assert res["stock"]["tokens_match"] and res["stock"]["kv_heads_cached"] == 1


def test_whole_generate_step_fields_on_cpu(random_runs):
    """The whole-generate step beside the per-forward one: with decode steps on the runner no forward hook runs
    (step_ms None), the whole-generate step still comes (the calls longer with more tokens), its timed calls make the
    measured call's tokens on the device loop, and the floor is the bytes a step reads at the given bandwidth."""
    _, single, ranks = random_runs
    for res in [single, *ranks]:
        assert res["step_ms"] is None and res["device_steps"] > 0
        assert res["whole_full_s"] > res["whole_short_s"] > 0 and res["whole_step_ms"] > 0
        assert len(res["whole_step_ms_rounds"]) == 1
        assert res["whole_captures"] == [0], "the CPU captures nothing"
        assert res["whole_device_steps"][0] > 0, "the timed calls left the device loop"
        assert res["whole_tokens_match"]
        floor = (res["weight_bytes_per_process"] + res["kv_bytes_per_process"]) / res["bandwidth_bytes_per_s"] * 1e3
        assert res["floor_ms"] == pytest.approx(floor)
        assert res["whole_step_vs_floor"] == pytest.approx(res["whole_step_ms"] / res["floor_ms"])
    for res in ranks:
        assert res["whole_step_vs_ref"] == pytest.approx(res["whole_step_ms"] / single["whole_step_ms"])
        assert res["stock"]["whole_step_ms"] > 0 and res["stock"]["whole_captures"] == [None]


def test_no_fuse_keeps_separate_products(random_runs, tmp_path):
    """--no-fuse: CascadeConfig(fuse_projections=False) in the script's calls: nothing fused, the same tokens."""
    shape, single, _ = random_runs
    _run(["single", "--random", shape, "--device", "cpu", "--dtype", "float64", "--prompt", "40", "--beams", "4",
          "--new-tokens", "12", "--graphs", "eager", "--rounds", "0", "--no-fuse", "--out", str(tmp_path / "s.json")])
    res = _load(tmp_path / "s.json")
    assert not res["fuse_projections"] and res["fused_groups"] == 0
    assert res["tokens"] == single["tokens"]


# ---- fuse_projections under tensor parallelism (tests/tp_fusing_run.py, 2 ranks over gloo, float64) ----

@pytest.mark.parametrize("plan", ["auto", "gathered"])
def test_tensor_parallel_fuses_each_ranks_local_shards(plan, tmp_path):
    """Each rank fuses its local shards of the colwise q/k/v and gate/up (DTensor Parameters kept, their local tensors
    now rows of the rank's buffer, transformers' forward installed again around the fused one): generate gives the
    one-process tokens and those of separate products, on transformers' own loop and on the whole step. A plain
    forward after the calls takes no fused slice and gives every projection's output and the logits of before, bit
    for bit (inside a call's extent the fused products do serve); unfusing puts transformers' forwards back.
    ``gathered``: gate/up colwise with gathered outputs (colwise_rep) are left unfused with the reason logged, the
    attention still fused."""
    _run(["--plan", plan, "--out", str(tmp_path / "fuse.json")], torchrun=True, script=TP_FUSING)
    ranks = _ranks(tmp_path, "fuse.json")
    layers = 2
    for res in ranks:
        assert res["sharded"] == "DTensor"
        assert res["tokens"] == res["tokens_one_process"] == res["tokens_unfused"] == res["tokens_whole_step"]
        assert len({t for row in res["tokens"] for t in row}) > 1
        assert res["groups_unfused"] == 0 and res["groups_one_process"] == 2 * layers
        assert res["groups"] == (2 * layers if plan == "auto" else layers), "a rank left its projections unfused"
        kinds = {name.rsplit(".", 1)[-1] for name in res["fused_members"]}
        assert kinds == ({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} if plan == "auto"
                         else {"q_proj", "k_proj", "v_proj"})
        assert res["check"] and res["locals_in_buffer"] and res["dtensors_kept"] and res["values_kept"]
        assert res["plain_forward_served"] == 0 and res["plain_forward_unchanged"]
        assert res["serving_forward_served"] == (3 if plan == "auto" else 2) * layers
        assert res["unfused_forwards_restored"] and res["unfused_plain_forward_unchanged"]
        if plan == "auto":
            assert res["refusals"] == []
        else:
            reason, = res["refusals"]
            assert "gate_proj/up_proj of model.layers.0.mlp" in reason and "Replicate()" in reason


@pytest.fixture
def multi_gpu_module(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import multi_gpu
    return multi_gpu


def test_random_weights_follow_the_parameter_names(multi_gpu_module):
    """fill_random: the same weights on every build (seeded by name, whatever else used the global generator),
    different weights for different names, at the model's init scale (norms ones)."""
    from transformers import LlamaForCausalLM
    config = multi_gpu_module.llama_config("tiny70b")
    models = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float64)
        multi_gpu_module.fill_random(model)
        models.append(dict(model.named_parameters()))
    first, second = models
    for name, param in first.items():
        assert torch.equal(param, second[name]), name
    q, k = first["model.layers.0.self_attn.q_proj.weight"], first["model.layers.1.self_attn.q_proj.weight"]
    assert not torch.equal(q, k)
    assert q.std().item() == pytest.approx(config.initializer_range, rel=0.1)
    assert torch.equal(first["model.norm.weight"], torch.ones_like(first["model.norm.weight"]))


def test_whole_step_reports_stock_out_of_memory(multi_gpu_module, monkeypatch):
    """Stock running out of memory gives {"oom": True} and is not called again; the cascade's rounds go on."""
    import argparse
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM(multi_gpu_module.llama_config("tiny")).to(torch.float64).eval()
    model.set_attn_implementation("cascade")
    real, stock_calls = model.generate, []

    def generate(*args, **kwargs):
        if model.config._attn_implementation == "sdpa":
            stock_calls.append(kwargs["max_new_tokens"])
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "generate", generate)
    args = argparse.Namespace(new_tokens=6, step_base=1, rounds=2, beams=4, prompt=40, graphs="eager",
                              attn="cascade", stock_attn="sdpa", no_fuse=False)
    ids = torch.randint(1, 90, (1, 40), generator=torch.Generator().manual_seed(0))
    got = multi_gpu_module.whole_step(model, args, ids, [torch.device("cpu")], ["cascade", "stock"])
    assert got["stock"] == {"oom": True}
    assert stock_calls == [1], "stock ran again after running out of memory"
    assert len(got["cascade"]["whole_step_ms_rounds"]) == 2 and got["cascade"]["whole_step_ms"] > 0
    assert model.config._attn_implementation == "cascade"


# ---- two GPUs: decode steps captured with the all-reduces inside, token choice on the device ----

@pytest.mark.gpu(2)
@pytest.mark.multi_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_tensor_parallel_captured_whole_step(dtype, tmp_path):
    """Tensor parallelism over 2 GPUs with the decode steps captured (--graphs on): every rank's steps ran on the
    device and were captured, each rank caching half the KV heads; float32 (TF32 off): the one-GPU run's tokens and
    stock's; bf16: the tokens' agreement with one GPU is reported (rounding differs with the sums' order). The timed
    calls of the whole-generate step replay the graph kept from the warm-up (no capture inside the step figure)."""
    common = ["--random", "1b", "--dtype", dtype, "--prompt", "1024", "--beams", "4", "--new-tokens", "16",
              "--graphs", "on", "--rounds", "1"]
    _run(["single", *common, "--out", str(tmp_path / "single.json")])
    single = _load(tmp_path / "single.json")
    assert single["device_steps"] > 0 and single["runner_captures"] > 0
    _run(["tp", *common, *(["--with-stock"] if dtype == "float32" else []), "--ref", str(tmp_path / "single.json"),
          "--out", str(tmp_path / "tp.json")], torchrun=True)
    for res in _ranks(tmp_path, "tp.json"):
        assert res["kv_heads_cached"] * 2 == res["kv_heads_model"]
        assert res["device_steps"] > 0 and res["runner_captures"] > 0, (res["device_steps"], res["runner_captures"])
        assert res["whole_device_steps"][0] > 0 and res["whole_captures"] == [0], res["whole_captures"]
        assert res["whole_step_ms"] > 0 and 0 <= res["token_agreement_ref"] <= 1
        if dtype == "float32":
            assert res["tokens_match_ref"], "float32 tensor-parallel beams differ from the one-GPU run"
            assert res["stock"]["tokens_match"], "float32 tensor-parallel beams differ from stock's"
            assert res["whole_tokens_match"]
