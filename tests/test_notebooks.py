"""The example notebooks (examples/notebooks/*.ipynb) run top to bottom without error, offline: the Hub
attempt of their first cell fails fast (HF_HUB_OFFLINE=1) and they fall back to the built-in model. They are
committed executed (``python tools/notebooks.py``), outputs and plots included, and a fresh run must print what is
committed: the same outputs, text equal, numbers within a tolerance (timings, a number followed by s or ms, only
need to be numbers). Each shows the saving it claims: its calls run the cascade on the CPU (not stock's path) and
use less KV than stock. Running them takes 20-90 s each on a 2-core machine: marked slow."""
from __future__ import annotations

import importlib.util
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
    # what tools/notebooks.py runs them with (one thread: tiny matmuls, and OpenMP threads slow them on a busy machine)
    for key, value in notebooks_tool().ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HF_CASCADE_MODEL", raising=False)


def notebooks_tool():
    spec = importlib.util.spec_from_file_location("notebooks_tool", EXAMPLES.parent / "tools" / "notebooks.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_notebooks_listed():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)


# Warnings transformers' own Whisper generate prints on stock's model too, whatever the caller passes: it fills the
# global default max_length (20) into its generation config before calling generate with max_new_tokens, and passes
# that config with arguments of its own. Everything else is refused.
KNOWN_WARNINGS = {"whisper_beam_search.ipynb": ("Passing `generation_config` together with generation-related",
                                                "The attention mask is not set with a batched input",
                                                "Both `max_new_tokens` (=24) and `max_length`(=20)")}


@pytest.mark.parametrize("name", NAMES)
def test_committed_executed(name):
    """Every code cell ran, in order, and printed no warning (where a reader browses the notebook, it shows) but
    the known ones of transformers' Whisper."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    cells = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1)), \
        f"{name}: run python tools/notebooks.py {name} before committing"
    assert any(c.outputs for c in cells)
    for cell in cells:
        for out in cell.outputs:
            assert out.output_type != "error", name
            if out.output_type == "stream" and out.name == "stderr":
                lines = [line for line in out.text.splitlines() if line.strip()]
                assert all(any(k in line for k in KNOWN_WARNINGS.get(name, ())) for line in lines), \
                    f"{name}: {out.text[:300]}"


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
TIMING_AFTER = re.compile(r"^\s*(?:s|ms)\b")                 # a timing: a number followed by its unit,
TIMING_BEFORE = re.compile(r"seconds['\"]?\s*[:=]\s*$")       # or a value named seconds


def _outputs(nb) -> list[list[tuple]]:
    """Per code cell, its outputs as (kind, text): stdout (consecutive chunks joined: how prints are split into
    chunks depends on timing), the text/plain of results, an image's presence."""
    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outs = []
        for o in cell.outputs:
            if o.output_type == "stream" and o.name == "stderr":
                continue        # warnings: test_committed_executed checks them (their wording can vary, set order)
            if o.output_type == "stream" and outs and outs[-1][0] == o.name:
                outs[-1] = (o.name, outs[-1][1] + o.text)
            elif o.output_type == "stream":
                outs.append((o.name, o.text))
            else:
                data = o.get("data", {})
                outs.append((o.output_type, "image" if "image/png" in data else data.get("text/plain", "")))
        cells.append(outs)
    return cells


def _same_text(committed: str, fresh: str, rel: float = 1e-3) -> bool:
    """Equal but for numbers: timings (a number followed by s or ms) may differ, other numbers within ``rel``."""
    def split(text):      # the words between numbers (runs of spaces as one: column widths follow the numbers)
        return ([" ".join(w.split()) for w in NUMBER.split(text)], NUMBER.findall(text),
                [m.span() for m in NUMBER.finditer(text)])
    words_a, nums_a, spans_a = split(committed)
    words_b, nums_b, _ = split(fresh)
    if words_a != words_b or len(nums_a) != len(nums_b):
        return False
    for a, b, (start, end) in zip(nums_a, nums_b, spans_a):
        if TIMING_AFTER.match(committed[end:]) or TIMING_BEFORE.search(committed[:start]):
            continue
        x, y = float(a.replace(",", "")), float(b.replace(",", ""))
        if abs(x - y) > rel * max(abs(x), abs(y), 1e-12):
            return False
    return True


def test_same_text_tolerates_timings_only():
    assert _same_text("KV 10.64 MiB, 3.09 s, cascade 1.81 s", "KV 10.64 MiB, 2.50 s, cascade 0.90 s")
    assert not _same_text("KV 10.64 MiB, 3.09 s", "KV 11.02 MiB, 3.09 s")
    assert not _same_text("identical tokens: True", "identical tokens: False")
    assert _same_text("loss 10.526022", "loss 10.526023")
    assert _same_text("{'loss': 6.2, 'seconds': 0.24, 'kv_mib': 3.3}", "{'loss': 6.2, 'seconds': 0.31, 'kv_mib': 3.3}")
    assert not _same_text("{'seconds': 0.24, 'kv_mib': 3.3}", "{'seconds': 0.24, 'kv_mib': 3.9}")


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
    committed, fresh = _outputs(nbformat.read(NOTEBOOKS / name, as_version=4)), _outputs(nb)
    assert len(committed) == len(fresh), f"{name}: the code cells changed; run python tools/notebooks.py {name}"
    for i, (a, b) in enumerate(zip(committed, fresh)):
        assert [k for k, _ in a] == [k for k, _ in b] and all(_same_text(x, y) for (_, x), (_, y) in zip(a, b)), \
            f"{name}, code cell {i}: a fresh run prints {b!r}, the committed notebook {a!r}: rerun tools/notebooks.py"
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
