"""The flags of ``python -m hf_cascade`` (and of the ``hf-cascade`` console script), checked before torch is imported.

``python -m hf_cascade`` imports the package before its ``__main__``, and the package imports torch and
transformers (seconds) to register "cascade"; so does the console script, whose entry point lives in the package.
So ``hf_cascade/__init__.py`` first asks :func:`invoked` and, when this process is one of those commands,
:func:`check_argv` answers ``--help``, a bad flag, a missing ``--model`` folder or ``--device cuda`` on a machine
without an NVIDIA driver at once (:func:`check_without_torch`). This module imports nothing heavy; the checks that
need torch (how many GPUs torch sees) come later, in ``__main__``, still before any model is built.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys

PROG = "python -m hf_cascade"
SCRIPT = "hf-cascade"           # the console script (setup.cfg's entry point)
MODULES = ("hf_cascade", "hf_cascade.__main__")
# ("auto", *hf_cascade.kernels.BACKENDS), spelled out so that parsing needs no torch (tests/test_main.py checks)
BACKENDS = ("auto", "cuda", "flashinfer", "reference")
DTYPES = ("float32", "float64", "bfloat16", "float16")


class Parser(argparse.ArgumentParser):
    """argparse, except that an error is one line naming the problem and pointing at ``--help`` (argparse
    prints the whole usage block first)."""

    def __init__(self, *args, **kwargs):
        # no prefix matching: `--beam 4` is a misspelling, not `--beams 4`
        super().__init__(*args, allow_abbrev=False, **kwargs)

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


# The shape of the run where a flag does not say (``--quick`` first, then the device's profile): on the CPU the built-in
# model at a size where sharing pays and the command ends in about a minute on 2 cores; on a GPU a Llama-3.2-1B-shaped
# model in bf16 with a prompt long enough for the prompt's KV to matter, as users run it there.
PROFILES = {
    "cpu": dict(model="small", prompt_len=1024, beams=8, new_tokens=16, rounds=3, warmup=0, dtype="float32"),
    "cuda": dict(model="1b", prompt_len=4096, beams=8, new_tokens=32, rounds=3, warmup=1, dtype="bfloat16"),
}
QUICK = dict(model="small", prompt_len=512, beams=4, new_tokens=4, rounds=1, warmup=0, dtype="float32")


def _profile_text(profile: dict) -> str:
    return (f"prompt {profile['prompt_len']}, {profile['beams']} beams, {profile['new_tokens']} new tokens, "
            f"{profile['rounds']} round(s), {profile['warmup']} warm-up(s)")


def _defaults(field: str) -> str:
    cpu, cuda = PROFILES["cpu"][field], PROFILES["cuda"][field]
    return f"{cpu}" if cpu == cuda else f"{cpu} on the CPU, {cuda} on a GPU"


def resolve(args: argparse.Namespace, device_type: str) -> argparse.Namespace:
    """Fill the flags left unset from ``--quick`` or the device's profile (``args.size``: which built-in model)."""
    profile = {**PROFILES["cuda" if device_type == "cuda" else "cpu"], **(QUICK if args.quick else {})}
    for field, value in profile.items():
        if field != "model" and getattr(args, field) is None:
            setattr(args, field, value)
    args.size = profile["model"]
    return args


def nvidia_driver() -> str | None:
    """Why no NVIDIA GPU can be used here, or None where the driver is present: /proc/driver/nvidia (Linux), or
    libcuda loading (elsewhere, and in containers without /proc/driver). No torch: this answers in milliseconds."""
    if os.path.exists("/proc/driver/nvidia/version"):
        return None
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll", "libcuda.dylib"):
        try:
            ctypes.CDLL(name)
            return None
        except OSError:
            continue
    return "no NVIDIA driver found (/proc/driver/nvidia is missing and libcuda does not load)"


GPU_BACKENDS = ("cuda", "flashinfer")
HALF_DTYPES = ("bfloat16", "float16")


def check_without_torch(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The checks that need no torch, in one line and exit 2 (argparse's way): a missing ``--model`` folder or
    ``--json`` folder, ``--device cuda`` without an NVIDIA driver, a GPU backend on the CPU or in float32."""
    device = args.device or ""
    if args.model is not None and not os.path.isdir(os.path.expanduser(args.model)):
        p.error(f"--model {args.model}: no such folder (a local checkpoint with config.json and weights)")
    if args.json not in (None, "-"):
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder):
            p.error(f"--json {args.json}: folder {folder} does not exist")
    if device.split(":")[0] == "cuda":
        missing = nvidia_driver()
        if missing:
            p.error(f"--device {device}: no CUDA GPU is visible: {missing}; use --device cpu")
    if args.backend in GPU_BACKENDS:
        if args.device is not None and device.split(":")[0] != "cuda":
            p.error(f"--backend {args.backend} runs on CUDA only; use --device cuda, or --backend auto/reference")
        if args.dtype is not None and args.dtype not in HALF_DTYPES:
            p.error(f"--backend {args.backend} takes bfloat16/float16, not {args.dtype}; add --dtype bfloat16")
    return args


def prog() -> str:
    """The command's name as the user typed it: ``hf-cascade`` for the console script, else ``python -m hf_cascade``."""
    return SCRIPT if _script() else PROG


def _script() -> bool:
    return os.path.basename(sys.argv[0] if sys.argv else "") in (SCRIPT, SCRIPT + ".exe", SCRIPT + "-script.py")


def build_parser() -> Parser:
    name = prog()
    p = Parser(
        prog=name, description="The same beam search with stock sdpa and with cascade, side by side: whether the "
                               "tokens match, the KV bytes each kept, the rows each prefilled, the time per new token "
                               "and the wall time (medians of interleaved rounds after a warm-up, with their spread).",
        epilog="Exit codes: 0 same tokens (bfloat16/float16: up to rounding, the agreement reported), 1 the tokens "
               "differ (float32/float64), 2 bad flags, 3 the run failed (the message says why). "
               f"Run `{name} env` for versions, GPUs and which kernel backends are available.")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="local checkpoint folder to load (default: a built-in random Llama-shaped model: 8 layers, "
                        "hidden 512 on the CPU; Llama-3.2-1B's shape on a GPU)")
    p.add_argument("--prompt-len", type=_positive_int, default=None, metavar="N",
                   help=f"tokens per prompt (default: {_defaults('prompt_len')})")
    p.add_argument("--beams", type=_positive_int, default=None, metavar="K",
                   help=f"num_beams (default: {_defaults('beams')})")
    p.add_argument("--new-tokens", type=_positive_int, default=None, metavar="N",
                   help=f"tokens generated per sequence (default: {_defaults('new_tokens')})")
    p.add_argument("--batch", type=_positive_int, default=1, metavar="B",
                   help="prompts per generate call (default: %(default)s)")
    p.add_argument("--device", default=None,
                   help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if a GPU is visible, else cpu)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="model dtype (default: float32 on the CPU, bfloat16 on a GPU; float32/float64 give stock's "
                        "tokens exactly, bf16/fp16 may differ by rounding)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="CascadeConfig.backend for the cascade run (default: %(default)s; cuda and flashinfer "
                        "need a CUDA device and bfloat16/float16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (default: %(default)s)")
    p.add_argument("--rounds", type=_positive_int, default=None, metavar="N",
                   help=f"timed rounds, stock and cascade in turn; times are medians (default: {_defaults('rounds')})")
    p.add_argument("--warmup", type=_non_negative_int, default=None, metavar="N",
                   help=f"untimed rounds before the timed ones, after a first untimed call of each that reads its "
                        f"cache (default: {_defaults('warmup')})")
    p.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                   help="torch CPU threads (default: $OMP_NUM_THREADS where set, else 1: the built-in model's "
                        "products are small, and extra threads on a busy machine make the times noisy)")
    p.add_argument("--quick", action="store_true",
                   help=f"a few-second smoke run: {_profile_text(QUICK)} (flags given still win)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the results as JSON to PATH ('-' or no PATH: stdout)")
    return p


def build_env_parser() -> Parser:
    p = Parser(prog=f"{prog()} env", description="Versions, GPUs and each kernel backend's availability, with the reason.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def parse(argv) -> tuple[str, argparse.Namespace]:
    """("env" or "compare", the parsed flags); a bad flag, or one :func:`check_without_torch` refuses, exits 2 in
    one line, ``--help`` exits 0."""
    argv = list(argv)
    if argv[:1] == ["env"]:
        return "env", build_env_parser().parse_args(argv[1:])
    p = build_parser()
    return "compare", check_without_torch(p, p.parse_args(argv))


def invoked() -> bool:
    """Whether this process is ``python -m hf_cascade ...`` and runpy is importing the package to find its
    ``__main__`` (while it does, ``sys.argv[0]`` is "-m"), or the ``hf-cascade`` console script."""
    if _script():
        return True
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
