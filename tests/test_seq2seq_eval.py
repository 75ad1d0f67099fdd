"""examples/seq2seq_eval.py: Seq2SeqTrainer evaluation of an encoder-decoder model on the cascade path gives
sdpa's predictions, in one process and data-parallel under torchrun (2 processes over gloo on the CPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import seq2seq_eval  # noqa: E402

ARGS = ["--model", "", "--dtype", "float64", "--examples", "8", "--batch", "2", "--beams", "3", "--new", "10"]


def test_rouge_on_known_sequences():
    assert seq2seq_eval.rouge([[1, 2, 3]], [[1, 2, 4]]) == {"rouge1": 66.67, "rougeL": 66.67}
    assert seq2seq_eval.rouge([[1, 3, 2]], [[1, 2, 3]]) == {"rouge1": 100.0, "rougeL": 66.67}
    assert seq2seq_eval.rouge([[5]], [[1, 2]]) == {"rouge1": 0.0, "rougeL": 0.0}


def test_trainer_predictions_equal_sdpa_with_less_kv():
    stock, cascade, tokenizer, _ = seq2seq_eval.load_pair(None, torch.float64)
    data = seq2seq_eval.make_dataset(tokenizer, stock.config.vocab_size, 6)
    want, stock_metrics = seq2seq_eval.evaluate(stock, data, batch_size=3, num_beams=4, max_new_tokens=8)
    got, cascade_metrics = seq2seq_eval.evaluate(cascade, data, batch_size=3, num_beams=4, max_new_tokens=8)
    assert got == want and len(got) == 6 and all(got)
    assert cascade_metrics["loss"] == stock_metrics["loss"]           # the loss pass is stock's dense path
    assert cascade_metrics["kv_mib"] < 0.5 * stock_metrics["kv_mib"]  # cross K/V once per input, not per beam


def _run(cmd, out):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    done = subprocess.run([*cmd, str(ROOT / "examples" / "seq2seq_eval.py"), *ARGS, "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.mark.slow      # two torchrun processes and one more: ~15 s on 2 cores
def test_data_parallel_on_cpu_matches_one_process(tmp_path):
    one = _run([sys.executable], tmp_path / "one.json")
    two = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"], tmp_path / "two.json")
    assert one["cascade"]["predictions"] == one["stock"]["predictions"]
    assert two["cascade"]["predictions"] == one["cascade"]["predictions"]
    assert two["stock"]["predictions"] == one["stock"]["predictions"]
    assert two["cascade"]["metrics"]["loss"] == one["cascade"]["metrics"]["loss"]
