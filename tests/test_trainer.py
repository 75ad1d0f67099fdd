"""Trainer evaluation on a cascade model (examples/trainer_eval.py, tiny float64 model): the loss pass takes
the dense fallback, Seq2SeqTrainer.predict and a plain generate loop give sdpa's tokens, and every
CascadeCache generate creates is empty again when generate returns."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch

import hf_cascade
from conftest import VOCAB, model_pair
from hf_cascade import generation

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import trainer_eval  # noqa: E402

BEAMS, NEW, BATCH = 4, 5, 4
REAL_THRESHOLD = dict(generation.MIN_SHARED_TOKENS)     # read at import, before conftest's autouse fixture empties it


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # tiny matmuls: threads only add overhead
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair():
    return model_pair("llama", dtype=torch.float64)


@pytest.fixture(scope="module")
def data():
    # 6 examples in batches of 4: a full batch and a short one, prompts of different lengths (left padding)
    return trainer_eval.synthetic_dataset(6, VOCAB, prompt_lens=(4, 15), target_len=NEW, seed=1)


class CacheWatch:
    """Wraps ``model.generate`` (the instance attribute the Trainer and the loop call) and hooks the model's
    forwards: every CascadeCache a forward sees is recorded per generate call, and its stats are read
    right after that generate returns."""

    def __init__(self, model):
        self.model, self.calls, self._current = model, [], None
        self.prefill_rows = []
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)
        # generate's own prefill runs the model's forward without its hooks (they run once per chosen token)
        self.prefill_handle = hf_cascade.generation.register_prefill_hook(lambda m, kwargs: self._hook(m, (), kwargs))
        original = model.generate

        def generate(*args, **kwargs):
            self._current = []
            try:
                out = original(*args, **kwargs)
            finally:
                caches, self._current = self._current, None
            self.calls.append([(c, c.stats()) for c in caches])
            return out

        model.generate = generate

    def _hook(self, module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if self._current is None:
            assert not isinstance(cache, hf_cascade.CascadeCache), "a CascadeCache outside generate"
            return
        if isinstance(cache, hf_cascade.CascadeCache) and all(c is not cache for c in self._current):
            self._current.append(cache)
            self.prefill_rows.append(kwargs["input_ids"].shape[0])

    def remove(self):
        self.handle.remove()
        self.prefill_handle.remove()
        del self.model.generate


def _predict(model, data, tmp_path):
    trainer = trainer_eval.make_trainer(model, data, str(tmp_path), batch_size=BATCH, num_beams=BEAMS)
    return trainer.predict(data, max_new_tokens=NEW)


def test_loss_pass_is_dense(pair, data, tmp_path):
    stock, cascade = pair
    losses = {}
    for name, model in (("stock", stock), ("cascade", cascade)):
        trainer = trainer_eval.make_trainer(model, data, str(tmp_path / name), batch_size=BATCH, num_beams=BEAMS)
        seen = []
        hook = model.register_forward_pre_hook(
            lambda m, a, k: seen.append(k.get("cache", k.get("past_key_values"))), with_kwargs=True)
        try:
            metrics = trainer.evaluate(prediction_loss_only=True)
        finally:
            hook.remove()
        assert seen and all(c is None for c in seen)       # the loss pass gets no cache: dense fallback
        losses[name] = metrics["eval_loss"]
    assert losses["cascade"] == losses["stock"]

    # and the same loss as a direct forward on the whole data set in one batch
    batch = trainer_eval.PromptTargetCollator(stock.config.pad_token_id)(data)
    with torch.no_grad():
        out_s = stock(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        out_c = cascade(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    assert torch.equal(out_s.logits, out_c.logits)
    assert out_c.loss.item() == out_s.loss.item()


def test_predictions_equal_sdpa_and_no_cache_leaks(pair, data, tmp_path):
    stock, cascade = pair
    ref = _predict(stock, data, tmp_path / "stock")
    ref_loop = trainer_eval.plain_eval_loop(stock, data, BATCH, BEAMS, NEW)

    watch = CacheWatch(cascade)
    try:
        pred = _predict(cascade, data, tmp_path / "cascade")
        n_trainer = len(watch.calls)
        loop = trainer_eval.plain_eval_loop(cascade, data, BATCH, BEAMS, NEW)
    finally:
        watch.remove()

    # Seq2SeqTrainer.predict: sdpa's tokens, the new tokens only, and the targets as label_ids
    assert pred.predictions.shape == (len(data), NEW)
    assert (pred.predictions == ref.predictions).all()
    assert (pred.label_ids == ref.label_ids).all()
    assert (torch.as_tensor(pred.label_ids) == torch.tensor([d["target"] for d in data])).all()
    assert pred.metrics["test_loss"] == ref.metrics["test_loss"]
    # the plain loop: sdpa's tokens, and the Trainer's
    assert torch.equal(loop, ref_loop)
    assert torch.equal(loop, torch.as_tensor(pred.predictions))

    # one generate per batch, each with its own CascadeCache, each prefilled once per prompt, each empty after
    batches = -(-len(data) // BATCH)
    assert n_trainer == batches and len(watch.calls) == 2 * batches
    assert watch.prefill_rows == [BATCH, len(data) - BATCH] * 2
    for caches in watch.calls:
        assert len(caches) == 1
        cache, stats = caches[0]
        assert stats.blocks_in_use == 0 and stats.kv_bytes_reserved == 0, stats
        assert stats.tokens_stored == 0
    assert len({id(c) for call in watch.calls for c, _ in call}) == len(watch.calls)   # no cache reused


def test_compare_reports_agreement(pair, data):
    stock, cascade = pair
    r = trainer_eval.compare(stock, cascade, data, BATCH, BEAMS, NEW)
    assert r["trainer_agreement"] == r["loop_agreement"] == r["trainer_vs_loop_agreement"] == 1.0
    assert r["stock"]["loss"] == r["cascade"]["loss"]
    # measured, not compared: with prompts this short (4-15 tokens) the cascade cache's 16-token blocks
    # hold more than stock's dense rows
    assert r["cascade"]["kv_bytes"] > 0 and r["stock"]["kv_bytes"] > 0

    assert r["stock_path"] == [None, None]      # conftest keeps tiny prompts on the cascade


def test_report_prints_the_saving_and_the_stock_path_line(pair, data, capsys):
    stock, cascade = pair
    r = trainer_eval.compare(stock, cascade, data, BATCH, BEAMS, NEW)
    r["stock_path"] = [None, "sharing would save 42 prompt-token reads per step (MIN_SHARED_TOKENS)"]
    trainer_eval.report(r)
    out = capsys.readouterr().out
    assert f"rows prefilled by the plain loop: stock {len(data) * BEAMS}, cascade {len(data)}" in out
    assert "cascade / stock = " in out
    lines = [line for line in out.splitlines() if "stock's own path" in line]
    assert lines == ["cascade: 1 of 2 generate calls per evaluation ran on stock's own path (no KV shared): "
                     "sharing would save 42 prompt-token reads per step (MIN_SHARED_TOKENS)"]


def test_example_shapes_share_on_the_cpu(pair, monkeypatch):
    """The example's default prompts are long enough that every generate call of its evaluation runs the cascade
    on the CPU (below MIN_SHARED_TOKENS a call runs on stock's path and shows no saving)."""
    monkeypatch.setattr(generation, "MIN_SHARED_TOKENS", REAL_THRESHOLD)
    _, cascade = pair
    assert cascade.device.type == "cpu" and REAL_THRESHOLD.get("cpu", 0) > 0
    examples = trainer_eval.synthetic_dataset(16, VOCAB)           # PROMPT_LENS, as the example and notebook use
    # the example's --batch-size 4 --beams 4 (and the notebook's BATCH, BEAMS)
    assert trainer_eval.stock_path_reasons(cascade, examples, 4, 4) == [None] * 4
    short = trainer_eval.synthetic_dataset(8, VOCAB, prompt_lens=(4, 15))
    reasons = trainer_eval.stock_path_reasons(cascade, short, 4, 4)
    assert all("MIN_SHARED_TOKENS" in r for r in reasons)
    assert "2 of 2 generate calls" in trainer_eval.stock_path_line(reasons)
