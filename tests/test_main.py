"""`python -m hf_cascade` end to end, at a tiny size: same tokens, one prefill row per prompt, less KV."""
from __future__ import annotations

import json

import pytest
import torch

from hf_cascade.__main__ import main


@pytest.fixture
def one_thread():
    # Tiny matmuls gain nothing from threads, and on a busy machine OpenMP threads slow them ~10x.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_main_tiny(tmp_path, one_thread):
    path = tmp_path / "result.json"
    batch, beams = 2, 3
    main(["--prompt-len", "40", "--beams", str(beams), "--new-tokens", "4", "--batch", str(batch),
          "--dtype", "float64", "--device", "cpu", "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["tokens_identical"] is True
    assert result["rows_prefilled_cascade"] == batch
    assert result["rows_prefilled_stock"] == batch * beams
    assert 0 < result["kv_bytes_cascade"] < result["kv_bytes_stock"]
    assert result["kv_ratio"] == pytest.approx(result["kv_bytes_cascade"] / result["kv_bytes_stock"])
