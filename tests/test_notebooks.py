"""The example notebooks (examples/notebooks/*.ipynb) run top to bottom without error, offline: the Hub
attempt of their first cell fails fast (HF_HUB_OFFLINE=1) and they fall back to the built-in model. They are
committed without outputs. Each shows the saving it claims: its calls run the cascade on the CPU (not stock's
path) and use less KV than stock. Running them takes 10-40 s each on a 2-core machine: marked slow."""
from __future__ import annotations

import os
import pathlib
import re
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = EXAMPLES / "notebooks"
NAMES = ["beam_search.ipynb", "shared_system_prompt.ipynb", "trainer_eval.ipynb", "seq2seq_trainer_eval.ipynb",
         "whisper_beam_search.ipynb"]


@pytest.fixture
def offline_env(monkeypatch):
    # The kernel inherits this process's environment.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("TQDM_DISABLE", "1")
    # Tiny matmuls: on a 2-core CI machine that runs other work, OpenMP threads slow them several-fold.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("HF_CASCADE_MODEL", raising=False)


def test_notebooks_listed():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_committed_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: clear the outputs before committing"


def _ratio(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    assert found, f"no {pattern!r} in the notebook's output"
    return float(found.group(1))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, offline_env):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()        # raises CellExecutionError on the first failing cell
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
                     if o.get("output_type") == "stream")
    if name in ("beam_search.ipynb", "shared_system_prompt.ipynb"):
        assert "falling back to hf_cascade's built-in random Llama" in text
    if name in ("beam_search.ipynb", "shared_system_prompt.ipynb"):
        assert "identical tokens: True" in text
    if name == "beam_search.ipynb":
        assert "cascade call: shares each prompt's KV across its beams" in text
        assert "every cascade call above shared its prompt's KV across the beams" in text
        assert "stock's own path" not in text
        assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
                   for c in nb.cells if c.cell_type == "code" for o in c.outputs), "no plot"
    if name == "shared_system_prompt.ipynb":
        assert _ratio(r"cascade peak [\d.]+ MiB \(ratio ([\d.]+)\)", text) < 0.5
        assert "rows of the first (prefill) forward: stock 16, cascade 1" in text
    if name == "trainer_eval.ipynb":
        assert "agrees with sdpa on 100.0%" in text
        assert "every cascade generate call shared its prompts' KV across the beams" in text
        assert _ratio(r"KV bytes cascade / stock: ([\d.]+)", text) < 0.5
        assert "rows prefilled: stock 32, cascade 8" in text
    if name == "seq2seq_trainer_eval.ipynb":
        assert "falling back to a built-in random BART" in text
        assert "cascade predictions identical to sdpa's: True" in text and "rougeL" in text
        assert _ratio(r"attention KV held, cascade / stock: ([\d.]+)", text) < 0.5
        assert "falling back to a built-in random Marian" in text and "'bleu'" in text
        assert "translation: cascade predictions identical to sdpa's: True" in text
        assert _ratio(r"translation: attention KV held, cascade / stock: ([\d.]+)", text) < 0.5
    if name == "whisper_beam_search.ipynb":
        assert "falling back to a built-in random Whisper" in text
        assert "identical tokens: True" in text and "identical tokens with timestamps: True" in text


# ------------------------------------------------------------------ the Hub, offline: no waiting on retries

@pytest.fixture
def hub_check(monkeypatch):
    sys.path.insert(0, str(EXAMPLES))
    import hub_check as module
    sys.path.remove(str(EXAMPLES))
    module.hub_unreachable.cache_clear()
    yield module
    module.hub_unreachable.cache_clear()


def test_hub_check_answers_at_once_where_the_hub_does_not(hub_check, monkeypatch, tmp_path):
    """The examples ask the Hub once with a short timeout instead of waiting ~45 s per file on retries."""
    monkeypatch.setattr(hub_check, "_offline", lambda: False)
    monkeypatch.setattr(hub_check, "_endpoint", lambda: "http://127.0.0.1:9")    # nothing listens: refused
    start = time.perf_counter()
    with pytest.raises(OSError, match="HF_HUB_OFFLINE=1"):
        hub_check.from_pretrained_kwargs("hf-cascade-tests/no-such-model")
    assert time.perf_counter() - start < 10
    assert hub_check.from_pretrained_kwargs(str(tmp_path)) == {}                  # a local folder: no question
    monkeypatch.setattr(hub_check, "_cached", lambda model_id: True)
    assert hub_check.from_pretrained_kwargs("org/cached") == {"local_files_only": True}
    monkeypatch.setattr(hub_check, "_offline", lambda: True)
    assert hub_check.from_pretrained_kwargs("org/any") == {}       # HF_HUB_OFFLINE=1: transformers fails at once
