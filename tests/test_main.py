"""`python -m hf_cascade` end to end, at a tiny size: same tokens, one prefill row per prompt, less KV."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from conftest import VOCAB, model_pair
from hf_cascade import __main__ as cli
from hf_cascade import _cli, generation, kernels
from hf_cascade.__main__ import build_parser, main, stock_path

ROOT = pathlib.Path(__file__).resolve().parent.parent


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


# ------------------------------------------------------------------ small runs go to stock's path, and say so

REAL_THRESHOLD = dict(generation.MIN_SHARED_TOKENS)     # read at import, before conftest's autouse fixture empties it


@pytest.fixture
def real_threshold(monkeypatch):
    monkeypatch.setattr(generation, "MIN_SHARED_TOKENS", REAL_THRESHOLD)


def _run(argv, tmp_path, capsys) -> tuple[int, dict, str]:
    path = tmp_path / "result.json"
    code = main([*argv, "--device", "cpu", "--json", str(path)])
    return code, json.loads(path.read_text()), capsys.readouterr().out


@pytest.mark.parametrize("prompt_len,beams,why", [
    (128, 4, "MIN_SHARED_TOKENS"),            # (4 - 1) x 127 = 381 prompt-token reads saved per step < 1024
    (16, 1, "nothing to share"),
])
def test_main_small_run_says_it_ran_on_stocks_path(tmp_path, capsys, one_thread, real_threshold,
                                                   prompt_len, beams, why):
    code, result, out = _run(["--prompt-len", str(prompt_len), "--beams", str(beams), "--new-tokens", "2"],
                             tmp_path, capsys)
    assert code == 0 and result["tokens_identical"] is True
    assert result["cascade_path"] == "stock" and why in result["stock_path_reason"]
    assert result["cascade_stats"] is None and result["kv_ratio"] == 1.0
    lines = [line for line in out.splitlines() if "stock's own path" in line]
    assert len(lines) == 1 and why in lines[0], out          # one line, with the reason


def test_main_checkpoint_folder_with_a_short_prompt(tmp_path, capsys, one_thread, real_threshold):
    stock, _ = model_pair("llama", dtype=torch.float32)
    folder = tmp_path / "ckpt"
    stock.save_pretrained(folder)
    code, result, out = _run(["--model", str(folder), "--prompt-len", "12", "--beams", "4", "--new-tokens", "3"],
                             tmp_path, capsys)
    assert code == 0 and result["tokens_identical"] is True and result["model"] == str(folder)
    assert result["cascade_path"] == "stock" and "MIN_SHARED_TOKENS" in result["stock_path_reason"]
    assert "stock's own path" in out


def test_main_default_shape_shares_on_the_cpu(real_threshold):
    """The main job's defaults, and ``--quick``'s, are calls where sharing pays on the CPU (no stock's path)."""
    _, cascade = model_pair("llama", dtype=torch.float32)
    assert REAL_THRESHOLD.get("cpu", 0) > 0
    for argv in ([], ["--quick"]):
        defaults = _cli.resolve(build_parser().parse_args(argv), "cpu")
        ids = torch.randint(3, VOCAB, (defaults.batch, defaults.prompt_len))
        assert stock_path(cascade, ids, defaults.beams) is None, argv
    assert "MIN_SHARED_TOKENS" in stock_path(cascade, ids[:, :128], 4)


def test_main_exit_codes(monkeypatch, capsys):
    def differ(*args, **kwargs):
        return {**FAKE, "tokens_identical": False}
    monkeypatch.setattr(cli, "run_comparison", differ)
    with pytest.raises(SystemExit) as info:
        main(["--device", "cpu"])
    assert info.value.code == 1                       # 1: the tokens differ, and only that

    def rounded(*args, **kwargs):                     # bf16: stock's tokens up to rounding, the agreement reported
        return {**FAKE, "dtype": "bfloat16", "tokens_identical": False, "token_agreement": 0.6}
    monkeypatch.setattr(cli, "run_comparison", rounded)
    assert main(["--device", "cpu"]) == 0

    def bug(*args, **kwargs):
        raise KeyError("stats")
    monkeypatch.setattr(cli, "run_comparison", bug)
    with pytest.raises(SystemExit) as info:
        main(["--device", "cpu"])
    assert info.value.code == 3                       # an unexpected failure is not "the tokens differ"
    err = capsys.readouterr().err
    assert "KeyError" in err and err.strip().splitlines()[-1].startswith("python -m hf_cascade: error:")


FAKE = dict(model="m", prompt_len=8, beams=2, new_tokens=1, batch=1, device="cpu", dtype="float32", backend="auto",
            repeats=1, tokens_identical=True, kv_bytes_stock=2, kv_bytes_cascade=1, kv_ratio=0.5,
            rows_prefilled_stock=2, rows_prefilled_cascade=1, seconds_stock=1.0, seconds_cascade=1.0, time_ratio=1.0,
            cascade_path="cascade", stock_path_reason=None)


# ------------------------------------------------------------------ flags are checked before torch is imported

def _python_m(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "hf_cascade", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def _imported(importtime: str) -> set[str]:
    """Top-level packages in ``-X importtime``'s report."""
    return {line.split("|")[-1].strip().split(".")[0] for line in importtime.splitlines()
            if line.startswith("import time:") and "|" in line}


def test_bad_flag_answers_in_one_line_without_importing_torch():
    proc = _python_m("--prompt-len", "64", "--bogus")
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert errors == ["python -m hf_cascade: error: unrecognized arguments: --bogus "
                      "(see `python -m hf_cascade --help`)"], proc.stderr
    assert proc.stdout == ""
    assert not {"torch", "transformers"} & _imported(proc.stderr)


def test_help_without_importing_torch():
    proc = _python_m("--help")
    assert proc.returncode == 0 and "--prompt-len" in proc.stdout and "Exit codes" in proc.stdout
    assert not {"torch", "transformers"} & _imported(proc.stderr)
    proc = _python_m("env", "--bogus")
    assert proc.returncode == 2 and "see `python -m hf_cascade env --help`" in proc.stderr
    assert not {"torch", "transformers"} & _imported(proc.stderr)


def test_parser_choices_match_the_library():
    assert _cli.BACKENDS == ("auto", *kernels.BACKENDS)
    assert _cli.DTYPES == tuple(cli.DTYPES)


@pytest.mark.parametrize("argv,orig_argv,expected", [
    (["-m", "--x"], ["python", "-m", "hf_cascade", "--x"], True),
    (["-m"], ["python", "-X", "importtime", "-mhf_cascade"], True),
    (["-m", "--x"], ["python", "-m", "hf_cascade.__main__", "--x"], True),
    (["-m", "--x"], ["python", "-m", "other_tool", "--x"], False),     # another module that imports hf_cascade
    (["-c", "--x"], ["python", "-c", "import hf_cascade", "--x"], False),
    (["script.py", "--bogus"], ["python", "script.py", "--bogus"], False),
])
def test_flags_checked_on_import_only_for_python_m_hf_cascade(monkeypatch, argv, orig_argv, expected):
    """hf_cascade/__init__.py checks sys.argv only while runpy imports it for `python -m hf_cascade`: a script
    with flags of its own imports (and registers "cascade") as usual."""
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    assert _cli.invoked() is expected


# ------------------------------------------------------------------ CLI conventions: no prefixes, torch-free checks

def _quiet(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]


def test_a_prefix_of_a_flag_is_refused_without_importing_torch():
    proc = _python_m("--beam", "4")         # argparse would take it for --beams 4 (allow_abbrev)
    assert proc.returncode == 2 and "unrecognized arguments: --beam 4" in _quiet(proc)[0], proc.stderr
    assert not {"torch", "transformers"} & _imported(proc.stderr)


def test_a_missing_model_folder_is_refused_without_importing_torch(tmp_path):
    proc = _python_m("--model", str(tmp_path / "nonexistent"))
    assert proc.returncode == 2 and "no such folder" in _quiet(proc)[0], proc.stderr
    assert not {"torch", "transformers"} & _imported(proc.stderr)


@pytest.mark.skipif(_cli.nvidia_driver() is None, reason="this machine has an NVIDIA driver")
def test_cuda_without_a_driver_is_refused_without_importing_torch():
    proc = _python_m("--device", "cuda:0")
    assert proc.returncode == 2 and "no NVIDIA driver found" in _quiet(proc)[0], proc.stderr
    assert not {"torch", "transformers"} & _imported(proc.stderr)


def test_nvidia_driver_is_found_by_proc_or_by_libcuda(monkeypatch):
    def no_library(name):
        raise OSError(name)
    monkeypatch.setattr(_cli.os.path, "exists", lambda path: False)
    monkeypatch.setattr(_cli.ctypes, "CDLL", no_library)
    assert "no NVIDIA driver found" in _cli.nvidia_driver()
    monkeypatch.setattr(_cli.ctypes, "CDLL", lambda name: object())
    assert _cli.nvidia_driver() is None
    monkeypatch.setattr(_cli.ctypes, "CDLL", no_library)
    monkeypatch.setattr(_cli.os.path, "exists", lambda path: path == "/proc/driver/nvidia/version")
    assert _cli.nvidia_driver() is None


def test_console_script_names_itself_and_checks_before_torch(tmp_path):
    """setup.cfg's ``hf-cascade`` entry point, run as pip's wrapper script runs it (argv[0] is the script's path)."""
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert "hf-cascade = hf_cascade.__main__:main" in cfg["options.entry_points"]["console_scripts"]
    script = tmp_path / "hf-cascade"
    script.write_text("import sys\nfrom hf_cascade.__main__ import main\nsys.exit(main())\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-X", "importtime", str(script), "--bogus"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert _quiet(proc) == ["hf-cascade: error: unrecognized arguments: --bogus (see `hf-cascade --help`)"]
    assert not {"torch", "transformers"} & _imported(proc.stderr)


def test_env_prints_a_block_to_paste(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    report, block = out.split("```text\n")
    assert "bug report" in report and block.rstrip().endswith("```")
    assert f"torch: {torch.__version__}" in block and "kernel backends" in block


# ------------------------------------------------------------------ honest timings: rounds, spread, threads

def test_timings_are_medians_of_rounds_with_time_per_token(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    path = tmp_path / "result.json"
    threads = torch.get_num_threads()
    main(["--quick", "--prompt-len", "40", "--beams", "3", "--new-tokens", "4", "--rounds", "3", "--dtype",
          "float64", "--device", "cpu", "--json", str(path)])
    r = json.loads(path.read_text())
    assert torch.get_num_threads() == threads                    # main() gives the caller its threads back
    assert r["threads"] == 1 and r["repeats"] == 3 and r["tokens_identical"] is True and r["token_agreement"] == 1.0
    for name in ("stock", "cascade"):
        assert len(r[f"seconds_{name}_all"]) == 3 and r[f"seconds_{name}"] == pytest.approx(
            sorted(r[f"seconds_{name}_all"])[1])
        steps = r[f"ms_per_token_{name}_all"]
        assert len(steps) == 3 and all(0 < s < 1e3 * w for s, w in zip(steps, r[f"seconds_{name}_all"]))
        assert r[f"ms_per_token_{name}"] == pytest.approx(sorted(steps)[1])
    assert r["step_ratio"] == pytest.approx(r["ms_per_token_cascade"] / r["ms_per_token_stock"])


def test_threads_flag_and_omp_num_threads(monkeypatch):
    threads = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert cli.set_threads(None) == 1
        assert cli.set_threads(2) == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert cli.set_threads(None) == 2            # the user's setting stands
    finally:
        torch.set_num_threads(threads)


def test_quick_and_device_profiles():
    quick = _cli.resolve(build_parser().parse_args(["--quick", "--beams", "6"]), "cpu")
    assert (quick.prompt_len, quick.beams, quick.rounds, quick.size) == (512, 6, 1, "small")    # a flag given wins
    gpu = _cli.resolve(build_parser().parse_args([]), "cuda")
    assert (gpu.dtype, gpu.size, gpu.beams) == ("bfloat16", "1b", 8) and gpu.prompt_len >= 2048
    assert cli.builtin_config("1b").num_hidden_layers == 16
    cpu = _cli.resolve(build_parser().parse_args([]), "cpu")
    assert (cpu.dtype, cpu.size, cpu.rounds) == ("float32", "small", 3)
