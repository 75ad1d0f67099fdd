"""The model spread over several devices: tensor parallelism (torchrun, each rank caching its own KV
heads) and accelerate's device_map over GPUs, each against the same checkpoint on one device.

The CPU case (tensor parallelism over gloo, float64) runs everywhere; the GPU cases need two GPUs.
All run benchmarks/multi_gpu.py, the script that measures the same on the Llama-3-8B shape.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "multi_gpu.py"
# NVLink multicast stays off on shared multi-GPU hosts (it can take the host's GPUs out of service)
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "OMP_NUM_THREADS": "1"}


def _run(args: list[str], torchrun: bool = False, timeout: int = 600) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT)] if torchrun \
        else [sys.executable, str(SCRIPT)]
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


def test_tensor_parallel_on_cpu_matches_one_process(tiny_checkpoint, tmp_path):
    common = ["--device", "cpu", "--dtype", "float64", "--dir", str(tiny_checkpoint), "--prompt", "40",
              "--beams", "4", "--new-tokens", "12"]
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


GPU_COMMON = ["--dtype", "float32", "--prompt", "1000", "--beams", "4", "--new-tokens", "16"]


@pytest.fixture(scope="module")
def gpu_single(gpu_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "single.json"
    _run(["single", *GPU_COMMON, "--dir", str(gpu_checkpoint), "--out", str(out)])
    return out


@pytest.mark.gpu(2)
def test_device_map_over_two_gpus_matches_one_gpu(gpu_checkpoint, gpu_single, tmp_path):
    _run(["device-map", *GPU_COMMON, "--gpus", "2", "--dir", str(gpu_checkpoint), "--ref", str(gpu_single),
          "--out", str(tmp_path / "dmap.json")])
    res = _load(tmp_path / "dmap.json")
    assert res["devices_of_layers"] == ["cuda:0", "cuda:1"]
    assert res["pool_devices"] == ["cuda:0", "cuda:1"], "each layer's pool belongs on its layer's GPU"
    assert res["tokens_match_ref"]


@pytest.mark.gpu(2)
def test_tensor_parallel_over_two_gpus_matches_one_gpu(gpu_checkpoint, gpu_single, tmp_path):
    _run(["tp", *GPU_COMMON, "--dir", str(gpu_checkpoint), "--ref", str(gpu_single),
          "--out", str(tmp_path / "tp.json")], torchrun=True)
    _check_tp(tmp_path, _load(gpu_single))


def test_tensor_parallel_whole_step_on_cpu_matches_one_process(tiny_checkpoint, tmp_path):
    """Tensor parallelism (gloo, 2 ranks) with decode steps on the graph runner's static path and the whole step on
    the device (each rank chooses the same tokens from the same gathered logits): the one-process tokens."""
    common = ["--device", "cpu", "--dtype", "float64", "--dir", str(tiny_checkpoint), "--prompt", "40",
              "--beams", "4", "--new-tokens", "12", "--graphs", "eager"]
    _run(["single", *common, "--out", str(tmp_path / "single.json")])
    single = _load(tmp_path / "single.json")
    assert single["device_steps"] > 0
    _run(["tp", *common, "--ref", str(tmp_path / "single.json"), "--out", str(tmp_path / "tp.json")],
         torchrun=True)
    _check_tp(tmp_path, single)
    assert all(_load(path)["device_steps"] > 0 for path in (tmp_path / "tp.json", tmp_path / "tp.json.rank1"))
