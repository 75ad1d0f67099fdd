"""The measuring kit every benchmark script shares: clocks, interleaved rounds, tables and the JSON record.

- Clocks: :func:`timed` (host wall time of one call, the GPU synchronised around it), :class:`ForwardTimer` (every
  forward of a model: CUDA events, or host wall time with devices synchronised), :func:`cuda_time_us` (one kernel
  call, CUDA events, a cache flush before each).
- :func:`interleave`: variants run in turn inside each round (s, c, s, c, ...), so that a host whose load drifts
  weighs on every variant alike; the figures to report are medians over rounds (:func:`median`).
- :func:`table`: a rich table (rich is a dependency of hf_cascade).
- :func:`run_record`, :func:`write_json` and :func:`results_path`: what every result file carries beside its figures
  (date, commit, command, hardware, versions), and where it lives (``benchmarks/results/<hardware>/``).

Scripts run as ``PYTHONPATH=. python benchmarks/<script>.py``: their folder is on ``sys.path``, so ``import harness``
finds this file. It imports only the standard library, torch and rich; the versions of transformers, hf_cascade and
FlashInfer are recorded where the script itself loaded them.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


# ---- the record every result file carries ----

def git_commit() -> str | None:
    """The checkout's short commit id, "+changes" when the tree differs from it (a copy sent to the GPU
    machine can carry an older .git than its files), or None where there is no git."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD") or None
        return commit and commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def command_line(script: str, argv: Sequence[str] | None = None) -> str:
    """The command as it can be typed again: the script's file name and its arguments (``argv`` when main() was
    called with a list, else the process's own)."""
    return shlex.join([Path(script).name, *(sys.argv[1:] if argv is None else argv)])


def hardware() -> dict:
    """The GPU(s) where CUDA is available (name, SMs, count), else the CPU (model, cores)."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return dict(gpu=props.name, sms=props.multi_processor_count, gpus=torch.cuda.device_count(),
                    capability=f"sm{props.major}{props.minor}")
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return dict(cpu=cpu, cores=os.cpu_count())


def versions() -> dict:
    found = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda)
    for name in ("transformers", "hf_cascade", "flashinfer"):
        module = sys.modules.get(name)          # only what the script itself loaded: importing costs seconds
        if module is not None:
            found[name] = getattr(module, "__version__", None)
    return found


def run_record(script: str, argv: Sequence[str] | None = None) -> dict:
    """date (UTC), commit, command, hardware and versions: the fields every result file starts with."""
    return dict(date=utc_now(), commit=git_commit(), command=command_line(script, argv), hardware=hardware(),
                **versions())


def results_path(benchmark: str) -> Path:
    """Where a benchmark's result lives in the repository: ``benchmarks/results/<hardware>/<benchmark>.json``, the
    hardware being the GPU's architecture ("sm90") or "cpu" (two-GPU runs: "sm90x2", named by their scripts)."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        hardware_dir = f"sm{major}{minor}"
    else:
        hardware_dir = "cpu"
    return ROOT / "benchmarks" / "results" / hardware_dir / f"{benchmark}.json"


def write_json(path: str | Path, payload: dict, indent: int = 1) -> Path | str:
    """Writes ``payload`` to ``path`` (its folder made if missing; "-": standard output); values JSON cannot hold
    are written as their str."""
    text = json.dumps(payload, indent=indent, default=str) + "\n"
    if str(path) == "-":
        sys.stdout.write(text)
        return "-"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ---- clocks ----

def synchronize(device: str | torch.device | None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: str | torch.device | None = None) -> tuple[float, T]:
    """(host wall seconds, result) of ``fn()``; on a CUDA device the GPU is synchronised before and after, so the
    time covers the work queued."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


class ForwardTimer:
    """The time of every forward of ``model`` (the first is the prefill, the rest decode steps), in ms.

    Default: CUDA events recorded around each forward (no synchronisation; the GPU's own time of the queued work).
    With ``sync_devices``: host wall time, those devices synchronised before and after each forward (the same for
    one GPU, a split over GPUs, or one rank of tensor parallelism). ``after_forward`` is called after each forward
    with its kwargs and output (for probes that read memory there)."""

    def __init__(self, model, sync_devices: Iterable[torch.device] | None = None, model_hooks: bool = True):
        self.sync_devices = None if sync_devices is None else list(sync_devices)
        self.events: list[list] = []          # CUDA events: [start, end] per forward
        self.wall_ms: list[float] = []        # host clock: per forward
        self._t0 = 0.0
        from hf_cascade import generation   # (the cascade's once-per-prompt prefill runs forward without the hooks)
        # (hooks on the model keep transformers' loop, which runs them per step: model_hooks=False times only the
        # cascade's prefill, for a call whose decode steps run as the whole step)
        self.handles = ([model.register_forward_pre_hook(self._start, with_kwargs=True),
                         model.register_forward_hook(self._end, with_kwargs=True)] if model_hooks else []) + [
                        generation.register_prefill_hook(lambda m, kw: self._start(m, (), kw),
                                                                    lambda m, kw, out: self._end(m, (), kw, out))]

    def _sync(self) -> None:
        for d in self.sync_devices:
            synchronize(d)

    def _start(self, module, args, kwargs):
        if self.sync_devices is not None:
            self._sync()
            self._t0 = time.perf_counter()
            return
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        self.events.append([start, torch.cuda.Event(enable_timing=True)])

    def _end(self, module, args, kwargs, output):
        if self.sync_devices is not None:
            self._sync()
            self.wall_ms.append(1e3 * (time.perf_counter() - self._t0))
        else:
            self.events[-1][1].record()
        self.after_forward(kwargs, output)

    def after_forward(self, kwargs: dict, output) -> None:
        """Called after each forward, once its end is recorded; for subclasses."""

    def times_ms(self) -> list[float]:
        if self.sync_devices is not None:
            return list(self.wall_ms)
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in self.events]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def cuda_time_us(fn: Callable[[], object], reps: int, warmup: int,
                 flush: Callable[[], object] = lambda: None, graph: bool = False) -> tuple[float, float]:
    """(median, min) µs of ``fn`` over ``reps`` calls timed with CUDA events after ``warmup`` calls; ``flush`` runs
    before each timed call, outside its events (e.g. overwriting the L2 cache). ``graph``: ``fn`` captured once as a
    CUDA graph and its replays timed, so that a few short kernels are timed as a decode step runs them (in a graph),
    not with the host's launches between them: eagerly, the GPU reaches the start event as soon as the flush is done
    and then waits for each launch of ``fn`` (tens of µs of Python for three kernels of a layer's attention)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        torch.cuda.synchronize()
        fn = captured.replay
    events = []
    for _ in range(reps):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) * 1e3 for s, e in events]
    return statistics.median(times), min(times)


# ---- interleaved rounds ----

def transformers_loop() -> dict:
    """generate keyword arguments that keep transformers' decode loop around the cascade's replayed forward: a logits
    processor of the caller's own that changes nothing (the whole step on the device serves only processors it
    reproduces)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class KeepScores(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores

    return dict(logits_processor=LogitsProcessorList([KeepScores()]))


def apply_switches(settings: Sequence[str]) -> dict:
    """``--set`` entries ``module.name=value`` (a module under hf_cascade, e.g. ``decode.whole_step.select_kernel=true``,
    ``kernels.cuda_library.layer_copies=false``): each module-level switch set for this process, before any model
    runs (a model keeps the graphs it captured, so a switch is compared across processes, each interleaved with stock).
    Values: true/false, or an int. Returns the settings applied, for the run's record. Unknown names raise."""
    import importlib
    applied = {}
    for entry in settings:
        path, sep, text = entry.partition("=")
        module_name, _, name = path.rpartition(".")
        if not sep or not module_name:
            raise SystemExit(f"--set takes module.name=value; got {entry!r}")
        module = importlib.import_module(f"hf_cascade.{module_name}")
        if not hasattr(module, name):
            raise SystemExit(f"--set: hf_cascade.{module_name} has no {name}")
        value = {"true": True, "false": False}.get(text.lower())
        value = int(text) if value is None else value
        setattr(module, name, value)
        applied[path] = value
    return applied


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def interleave(variants: Sequence[str], run: Callable[[str, int], T], rounds: int, warmup: int = 0,
               failed: Callable[[T], bool] = lambda result: False) -> dict[str, list[T]]:
    """``run(variant, round)`` for every round and, inside a round, every variant in turn (s, c, s, c, ...).

    Rounds ``0 .. warmup - 1`` warm up (first-call costs of the shape) and their results are dropped; then
    ``rounds`` timed rounds. A variant whose result ``failed`` (an out-of-memory, say) is not run again: its
    failing result is its only one. Returns each variant's kept results, in round order."""
    kept: dict[str, list[T]] = {v: [] for v in variants}
    dead: set[str] = set()
    for rnd in range(warmup + rounds):
        for v in variants:
            if v in dead:
                continue
            result = run(v, rnd)
            if failed(result):
                dead.add(v)
                kept[v] = [result]
            elif rnd >= warmup:
                kept[v].append(result)
    return kept


# ---- tables ----

def table(title: str, columns: Sequence[str], rows: Iterable[Mapping | Sequence], console: Console | None = None,
          left: Sequence[str] = ()) -> Table:
    """A rich table of ``rows`` (mappings read by column name, missing cells blank; or sequences in column order);
    floats printed with 3 significant digits. Printed on ``console`` when one is given."""
    out = Table(title=title)
    for c in columns:
        out.add_column(c, justify="left" if c in left else "right")
    for r in rows:
        cells = [r.get(c, "") for c in columns] if isinstance(r, Mapping) else list(r)
        out.add_row(*[f"{x:.3g}" if isinstance(x, float) else ("" if x is None else str(x)) for x in cells])
    if console is not None:
        console.print(out)
    return out
