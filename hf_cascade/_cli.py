"""The flags of ``python -m hf_cascade``, checked before torch is imported.

``python -m hf_cascade`` imports the package before its ``__main__``, and the package imports torch and
transformers (seconds) to register "cascade". So ``hf_cascade/__init__.py`` first asks :func:`invoked`
and, when this process is that command, :func:`check_argv` answers ``--help`` or a bad flag at once.
This module imports nothing heavy; the checks that need torch (is there a GPU?) come later, in
``__main__``, still before any model is built.
"""
from __future__ import annotations

import argparse
import sys

PROG = "python -m hf_cascade"
MODULES = ("hf_cascade", "hf_cascade.__main__")
# ("auto", *hf_cascade.kernels.BACKENDS), spelled out so that parsing needs no torch (tests/test_main.py checks)
BACKENDS = ("auto", "cuda", "flashinfer", "reference")
DTYPES = ("float32", "float64", "bfloat16", "float16")


class Parser(argparse.ArgumentParser):
    """argparse, except that an error is one line naming the problem and pointing at ``--help`` (argparse
    prints the whole usage block first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _positive_int(text: str) -> int:
    value = int(text)       # argparse turns the ValueError into "invalid int value"
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


_positive_int.__name__ = _non_negative_int.__name__ = "int"     # argparse's "invalid int value: 'x'"


def build_parser() -> Parser:
    p = Parser(
        prog=PROG, description="The same beam search with stock sdpa and with cascade, side by side: whether the "
                               "tokens match, the KV bytes each kept, the rows each prefilled and the wall time.",
        epilog="Exit codes: 0 same tokens, 1 the tokens differ, 2 bad flags, 3 the run failed (the message says why). "
               f"Run `{PROG} env` for versions, GPUs and which kernel backends are available.")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="local checkpoint folder to load (default: a built-in random Llama-shaped model, 8 layers)")
    p.add_argument("--prompt-len", type=_positive_int, default=1024, metavar="N",
                   help="tokens per prompt (default: %(default)s)")
    p.add_argument("--beams", type=_positive_int, default=8, metavar="K", help="num_beams (default: %(default)s)")
    p.add_argument("--new-tokens", type=_positive_int, default=16, metavar="N",
                   help="tokens generated per sequence (default: %(default)s)")
    p.add_argument("--batch", type=_positive_int, default=1, metavar="B",
                   help="prompts per generate call (default: %(default)s)")
    p.add_argument("--device", default=None,
                   help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if a GPU is visible, else cpu)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="model dtype (default: %(default)s; float32/float64 give stock's tokens exactly, "
                        "bf16/fp16 may differ by rounding)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="CascadeConfig.backend for the cascade run (default: %(default)s; cuda and flashinfer "
                        "need a CUDA device and bfloat16/float16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (default: %(default)s)")
    p.add_argument("--warmup", type=_non_negative_int, default=None, metavar="N",
                   help="untimed runs of each before the timed one (default: 1 on CUDA, 0 on CPU)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the results as JSON to PATH ('-' or no PATH: stdout)")
    return p


def build_env_parser() -> Parser:
    p = Parser(prog=f"{PROG} env", description="Versions, GPUs and each kernel backend's availability, with the reason.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def parse(argv) -> tuple[str, argparse.Namespace]:
    """("env" or "compare", the parsed flags); a bad flag exits 2 in one line, ``--help`` exits 0."""
    argv = list(argv)
    if argv[:1] == ["env"]:
        return "env", build_env_parser().parse_args(argv[1:])
    return "compare", build_parser().parse_args(argv)


def invoked() -> bool:
    """Whether this process is ``python -m hf_cascade ...`` and runpy is importing the package to find its
    ``__main__`` (while it does, ``sys.argv[0]`` is "-m")."""
    if sys.argv[:1] != ["-m"]:
        return False
    argv = list(getattr(sys, "orig_argv", ()))
    for i, arg in enumerate(argv[1:], 1):
        if arg == "-m":
            return i + 1 < len(argv) and argv[i + 1] in MODULES
        if arg.startswith("-m"):
            return arg[2:] in MODULES
    return False


def check_argv() -> None:
    """Parse this process's flags (exits on ``--help`` or a bad flag); ``__main__`` parses them again."""
    parse(sys.argv[1:])
