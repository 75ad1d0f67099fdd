"""examples/seq2seq_eval.py: Seq2SeqTrainer evaluation of an encoder-decoder model on the cascade path gives
sdpa's predictions for summarization (random BART) and translation (random Marian), in one process and
data-parallel under torchrun (2 processes over gloo on the CPU); its ROUGE and BLEU wrappers give the values
worked out by hand."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
# the example's metrics come from the test extras (a GPU machine without them skips this file, naming what is missing)
pytest.importorskip("rouge_score", reason="examples/seq2seq_eval.py needs rouge_score (pip install -e '.[test]')")
pytest.importorskip("sacrebleu", reason="examples/seq2seq_eval.py needs sacrebleu (pip install -e '.[test]')")
import seq2seq_eval  # noqa: E402

ARGS = ["--model", "", "--dtype", "float64", "--examples", "8", "--batch", "2", "--beams", "3", "--new", "10"]


def test_rouge_on_known_sequences():
    # "the cat sat" / "the cat ran": 2 of 3 words (P = R = 2/3), 1 of 2 bigrams, common subsequence of 2
    assert seq2seq_eval.rouge(["the cat sat"], ["the cat ran"]) == {"rouge1": 66.67, "rouge2": 50.0,
                                                                    "rougeL": 66.67}
    # the same words in another order: every word, no bigram, longest common subsequence 2 of 3; case ignored
    assert seq2seq_eval.rouge(["Cat the sat"], ["the cat sat"]) == {"rouge1": 100.0, "rouge2": 0.0,
                                                                    "rougeL": 66.67}
    # token ids are words; the mean over examples: (F1 2/3 of [1 2 3] vs [1 2 4], F1 0 of [5] vs [1 2]) / 2
    assert seq2seq_eval.rouge([[1, 2, 3], [5]], [[1, 2, 4], [1, 2]]) == {"rouge1": 33.33, "rouge2": 25.0,
                                                                         "rougeL": 33.33}
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        seq2seq_eval.rouge(["a", "b"], ["a"])


def test_bleu_on_known_sequences():
    # "the cat sat on the mat" vs "the cat sat on a mat": clipped n-gram precisions 5/6, 3/5, 2/4, 1/3, equal
    # lengths (no brevity penalty): 100 * (5/6 * 3/5 * 2/4 * 1/3) ** (1/4)
    want = round(100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25, 2)
    assert want == 53.73
    assert seq2seq_eval.bleu(["the cat sat on the mat"], ["the cat sat on a mat"]) == {"bleu": want}
    # every n-gram right but 4 words for 6: brevity penalty exp(1 - 6/4)
    brevity = round(100 * math.exp(1 - 6 / 4), 2)
    assert brevity == 60.65
    assert seq2seq_eval.bleu(["the cat sat on"], ["the cat sat on the mat"]) == {"bleu": brevity}
    # token ids: each id a word (the same n-grams as above)
    assert seq2seq_eval.bleu([[1, 2, 3, 4, 5, 6]], [[1, 2, 3, 4, 7, 6]]) == {"bleu": want}
    # corpus BLEU pools the n-gram counts of all sentences (7/8, 5/6, 3/4, 1/2), not a mean of sentence scores
    pooled = round(100 * (7 / 8 * 5 / 6 * 3 / 4 * 1 / 2) ** 0.25, 2)
    assert pooled == 72.31
    assert seq2seq_eval.bleu([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 6, 7, 9]]) == {"bleu": pooled}


def test_trainer_predictions_equal_sdpa_with_less_kv():
    stock, cascade, tokenizer, _ = seq2seq_eval.load_pair(None, torch.float64)
    data = seq2seq_eval.make_dataset(tokenizer, stock.config.vocab_size, 6)
    want, stock_metrics = seq2seq_eval.evaluate(stock, data, batch_size=3, num_beams=4, max_new_tokens=8)
    got, cascade_metrics = seq2seq_eval.evaluate(cascade, data, batch_size=3, num_beams=4, max_new_tokens=8)
    assert got == want and len(got) == 6 and all(got)
    assert cascade_metrics["loss"] == stock_metrics["loss"]           # the loss pass is stock's dense path
    assert cascade_metrics["kv_mib"] < 0.5 * stock_metrics["kv_mib"]  # cross K/V once per input, not per beam
    assert cascade_metrics["rougeL"] == stock_metrics["rougeL"]


def test_translation_predictions_equal_sdpa_with_less_kv():
    stock, cascade, tokenizer, source = seq2seq_eval.load_pair(None, torch.float64, task="translation")
    assert type(stock).__name__ == "MarianMTModel" and source == "built-in random Marian"
    data = seq2seq_eval.make_dataset(tokenizer, stock.config.vocab_size, 6, max_len=24, task="translation")
    lengths = [len(x["input_ids"]) for x in data]
    assert lengths[2] < min(lengths[:2]) and lengths[5] < min(lengths[3:5])   # a third padded in its batch
    assert all(stock.config.pad_token_id not in x["input_ids"] for x in data)
    want, stock_metrics = seq2seq_eval.evaluate(stock, data, batch_size=3, num_beams=4, max_new_tokens=8,
                                                task="translation")
    got, cascade_metrics = seq2seq_eval.evaluate(cascade, data, batch_size=3, num_beams=4, max_new_tokens=8,
                                                 task="translation")
    assert got == want and len(got) == 6 and all(got)
    assert cascade_metrics["loss"] == stock_metrics["loss"]
    assert cascade_metrics["bleu"] == stock_metrics["bleu"] and "rougeL" not in cascade_metrics
    assert cascade_metrics["kv_mib"] < 0.5 * stock_metrics["kv_mib"]


def _word_tokenizer(vocab_size: int, pad: int):
    """A word-level tokenizer over the built-in sentence pairs' words, ids below the random Marian's vocabulary
    (eos 0, unk 1, pad its last id): the online path (text in, text scored) without the Hub."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    words = sorted({w for pair in seq2seq_eval.SENTENCES for text in pair
                    for w, _ in pre_tokenizers.Whitespace().pre_tokenize_str(text)})
    assert len(words) + 4 < vocab_size
    vocab = {"</s>": 0, "<unk>": 1, "<pad>": pad, **{w: i + 4 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>", pad_token="<pad>")


def test_translation_with_a_tokenizer_scores_text():
    stock, cascade, _, _ = seq2seq_eval.load_pair(None, torch.float64, task="translation")
    tokenizer = _word_tokenizer(stock.config.vocab_size, stock.config.pad_token_id)
    data = seq2seq_eval.make_dataset(tokenizer, stock.config.vocab_size, 4, task="translation")
    german = tokenizer.decode(data[0]["labels"], skip_special_tokens=True)
    assert german == "Der Zug nach Berlin fährt um acht Uhr ab ."
    assert tokenizer.decode(data[1]["input_ids"], skip_special_tokens=True).startswith("I would like a cup")
    want, stock_metrics = seq2seq_eval.evaluate(stock, data, tokenizer, batch_size=2, num_beams=4, max_new_tokens=6,
                                                task="translation")
    got, cascade_metrics = seq2seq_eval.evaluate(cascade, data, tokenizer, batch_size=2, num_beams=4,
                                                 max_new_tokens=6, task="translation")
    assert got == want and len(got) == 4
    assert cascade_metrics["bleu"] == stock_metrics["bleu"]
    assert cascade_metrics["kv_mib"] < stock_metrics["kv_mib"]    # ~10-token sources: the paged self part weighs


def test_bad_task_or_shape_is_refused():
    with pytest.raises(ValueError, match="not a translation shape"):
        seq2seq_eval.load_pair(None, task="translation", shape="bart-large-cnn")
    with pytest.raises(ValueError, match="unknown task 'qa'"):
        seq2seq_eval.make_dataset(None, 100, task="qa")


def _run(cmd, out, *extra):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    done = subprocess.run([*cmd, str(ROOT / "examples" / "seq2seq_eval.py"), *ARGS, *extra, "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.mark.slow      # two torchrun processes and one more: ~15 s on 2 cores, per task
@pytest.mark.parametrize("task", ["summarization", "translation"])
def test_data_parallel_on_cpu_matches_one_process(tmp_path, task):
    one = _run([sys.executable], tmp_path / "one.json", "--task", task)
    two = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"], tmp_path / "two.json",
               "--task", task)
    assert one["task"] == two["task"] == task
    assert one["cascade"]["predictions"] == one["stock"]["predictions"]
    assert two["cascade"]["predictions"] == one["cascade"]["predictions"]
    assert two["stock"]["predictions"] == one["stock"]["predictions"]
    assert two["cascade"]["metrics"]["loss"] == one["cascade"]["metrics"]["loss"]
    metric = "rougeL" if task == "summarization" else "bleu"
    assert two["cascade"]["metrics"][metric] == one["cascade"]["metrics"][metric]
