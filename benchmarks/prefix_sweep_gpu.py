"""Tuning sweep of the cascade prefix kernel (csrc/prefix.cu) in one GPU run: every candidate PrefixTune
(hf_cascade.kernels.cuda; the same strings as $HF_CASCADE_PREFIX_TUNE) on the Llama-3-8B layer of kernels_gpu.py.

For each candidate and shape: the cuda backend's ``attend`` (prefix + suffix + merge, as the library calls it) is
checked against the float32 reference backend (relative error < 1e-2, finite) and only then timed (CUDA events,
warm-up, median of --reps, L2 overwritten before each call). A candidate that fails is reported, never a winner.
Candidates run safest first (the production launch, then launch-shape knobs, then compiled variants without
register spills, then those with small spills): a CUDA error that poisons the context stops the sweep, and the
JSON is rewritten after every candidate. Phase 2 times, per shape, the best kernel knob with the best chunk knob.

``--profile`` also lists each candidate's kernels (torch.profiler over graph replays, the L2 flush left out): µs per
kernel and the replay's time not covered by them (launch gaps and the dependent kernels' fill and drain).

    PYTHONPATH=. python benchmarks/prefix_sweep_gpu.py [--reps 20] [--dtype float16] [--shapes 8x8x1k,8x16x16k]
        [--candidates "auto;variant=wg"] [--profile] [--out benchmarks/results/sm90/prefix_sweep_gpu.json]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from hf_cascade import kernels  # noqa: E402
from hf_cascade.kernels import cuda as cuda_backend  # noqa: E402
from hf_cascade.kernels.base import AttentionParams  # noqa: E402
import harness  # noqa: E402
from kernels_gpu import HEAD_DIM, bytes_moved, copy_bandwidth, make_step  # noqa: E402

SHAPES = [dict(groups=8, beams=b, prefix=p, suffix=64) for b, p in ((8, 16384), (16, 16384), (4, 16384), (8, 4096))]
# safest first. Launch-shape knobs (no new kernel code): the wave rule alone, fixed chunks (1376 / 928 tokens: ~2 / ~3
# full waves at 8 x 8 and 8 x 4 16k on 132 SMs x 3 CTAs; 2048: half the partials), smaller row tiles (more CTAs,
# the K/V tile read again through L2). Then the compiled variants (csrc/prefix.cu PrefixTune): n64 and s6 use no
# more registers than the default; n64w8 / w8 / s3c4 are capped at 128 registers and spill a few bytes (M 32).
CANDIDATES = [
    "auto", "default",
    "prefer=0", "chunk=1376", "chunk=928", "chunk=2048",
    "m=32", "m=16",
    "variant=n64", "variant=s6", "variant=n64w8,m=64",
    "variant=n64w8", "variant=w8", "variant=s3c4",
]
CHUNK_KEYS = ("chunk", "prefer", "min")      # phase 2: a kernel knob combined with a chunk knob
MAX_REL_ERR = 1e-2


DTYPE = torch.bfloat16      # --dtype


def shape_name(s) -> str:
    return f"{s['groups']}x{s['beams']}x{s['prefix'] // 1024}k"


def parse_shape(text: str) -> dict:
    """"8x16x16k" -> groups 8, beams 16, prefix 16384 (suffix 64)."""
    g, b, p = text.lower().split("x")
    return dict(groups=int(g), beams=int(b), prefix=int(p[:-1]) * 1024 if p.endswith("k") else int(p), suffix=64)


def split_tune(text: str) -> tuple[dict, dict]:
    """(kernel knobs, chunk knobs) of a candidate string."""
    kernel, chunk = {}, {}
    for item in filter(None, text.split(",")):
        if item in ("default", "auto"):
            continue
        key, _, value = item.partition("=")
        (chunk if key in CHUNK_KEYS else kernel)[key] = value
    return kernel, chunk


def launch_of(st, lib) -> dict:
    """The prefix launch of the cuda backend's launch state ``st`` (its metadata for one plan and tune)."""
    code = int(st.tune)
    found = lib._info.get((cuda_backend.DTYPE_CODES[DTYPE], HEAD_DIM, st.m_tile, torch.cuda.current_device(),
                           code))
    ctas, smem = (found[0], found[1]) if found else (None, None)
    return dict(tune_code=code, m_tile=st.m_tile, row_tiles=st.row_tiles, chunk_tokens=st.chunk_tokens,
                chunks=st.max_chunks, suffix_splits=st.nsplit, ctas_per_sm=ctas, smem_bytes=smem)


def kernel_profile(fn, reps: int, flush) -> dict:
    """µs per call of each kernel of ``fn`` (captured as a graph, replayed ``reps`` times after ``flush``), in launch
    order; the L2 flush's own kernel is left out."""
    from torch.profiler import ProfilerActivity, profile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    flush()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush()
            graph.replay()
        torch.cuda.synchronize()
    flush_names = {e.name for e in prof.events() if "Fill" in e.name}
    per_kernel: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name not in flush_names:
            name = event.name[:90]
            per_kernel[name] = per_kernel.get(name, 0.0) + event.time_range.elapsed_us() / reps
    return {name: round(us, 2) for name, us in per_kernel.items()}


def run_candidate(text, steps, refs, backend, lib, args, flush, bw, console) -> list[dict]:
    cuda_backend.set_prefix_tune(text)
    rows = []
    for shape, (q, pool, cascade, _full) in zip(SHAPES, steps):
        row = dict(candidate=text, shape=shape_name(shape), **shape)
        scale = 1.0 / math.sqrt(HEAD_DIM)
        try:
            meta = backend.build(cascade, q, pool)       # once per candidate and shape: only forward is timed
            params = AttentionParams(scale)
            out = backend.forward(q, pool, meta, params)
            torch.cuda.synchronize()
            row["launch"] = launch_of(meta, lib)
            ref = refs[shape_name(shape)]
            err = float((out.float() - ref).norm() / ref.norm())
            row["rel_err"] = err
            if not (torch.isfinite(out).all() and err < MAX_REL_ERR):
                row["failed"] = f"wrong result: relative error {err:.2e} (or NaN/inf)"
            else:
                med, best = harness.cuda_time_us(lambda: backend.forward(q, pool, meta, params), args.reps,
                                                 args.warmup, flush, graph=args.timing == "graph")
                roof = bytes_moved(**shape) / bw * 1e6
                row.update(median_us=med, min_us=best, roofline_us=roof, fraction_of_roofline=roof / med)
                if args.profile:
                    row["kernels_us"] = kernel_profile(lambda: backend.forward(q, pool, meta, params), args.reps,
                                                       flush)
                    row["outside_kernels_us"] = med - sum(row["kernels_us"].values())
        except Exception as err:   # report and go on; a poisoned context shows up at the next synchronize
            row["failed"] = f"{type(err).__name__}: {err}"[:300]
        meta = None                                # this candidate's partial buffers: keep memory flat
        rows.append(row)
        mark = f"{row['median_us']:.1f} µs ({100 * row['fraction_of_roofline']:.0f}%)" if "median_us" in row \
            else f"[red]FAILED[/red] {row['failed'][:80]}"
        console.print(f"  {text:28s} {row['shape']:10s} {mark}  {row.get('launch', '')}")
        for name, us in row.get("kernels_us", {}).items():
            console.print(f"      {us:8.2f} µs  {name}")
    return rows


def context_alive() -> bool:
    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
        return True
    except Exception:
        return False


def best_per_shape(results) -> dict:
    best = {}
    for r in results:
        if "median_us" in r and (r["shape"] not in best or r["median_us"] < best[r["shape"]]["median_us"]):
            best[r["shape"]] = r
    return {k: dict(candidate=v["candidate"], median_us=v["median_us"], fraction_of_roofline=v["fraction_of_roofline"],
                    launch=v.get("launch")) for k, v in best.items()}


def combos(results) -> list[str]:
    """Phase 2: per shape, the fastest kernel-knob candidate with the fastest chunk-knob candidate."""
    out = []
    for shape in [shape_name(s) for s in SHAPES]:
        timed = [r for r in results if r["shape"] == shape and "median_us" in r]
        kern = [r for r in timed if split_tune(r["candidate"])[0] and not split_tune(r["candidate"])[1]]
        chunk = [r for r in timed if split_tune(r["candidate"])[1] and not split_tune(r["candidate"])[0]]
        if not kern or not chunk:
            continue
        k = min(kern, key=lambda r: r["median_us"])["candidate"]
        c = min(chunk, key=lambda r: r["median_us"])["candidate"]
        text = f"{k},{c}"
        if text not in out and text not in CANDIDATES:
            out.append(text)
    return out


def write(path: Path, meta: dict, results: list, note: str | None = None) -> None:
    doc = dict(meta, results=results, best=best_per_shape(results))
    if note:
        doc["stopped"] = note
    harness.write_json(path, doc, indent=2)


def print_table(console, results, bw) -> None:
    names = [shape_name(s) for s in SHAPES]
    rows = []
    by = {(r["candidate"], r["shape"]): r for r in results}
    best = best_per_shape(results)
    for cand in dict.fromkeys(r["candidate"] for r in results):
        cells = []
        for n in names:
            r = by.get((cand, n))
            if r is None:
                cells.append("")
            elif "median_us" not in r:
                cells.append("[red]failed[/red]")
            else:
                cell = f"{r['median_us']:.1f} ({100 * r['fraction_of_roofline']:.0f}%)"
                if "variant=" in cand and not (r.get("launch") or {}).get("tune_code"):
                    cell += "*"          # the variant is not compiled for this row tile: the default kernel ran
                cells.append(f"[bold green]{cell}[/bold green]" if best[n]["candidate"] == cand else cell)
        rows.append((cand, *cells))
    harness.table(f"prefix kernel sweep: one 8B decode layer (prefix + suffix + merge), µs (% roofline); "
                  f"copy bw {bw / 1e12:.2f} TB/s", ["candidate", *names], rows, console, left=("candidate",))
    console.print("*: the variant is not compiled for this row tile, the default kernel ran (its launch shape only)")
    for n, b in best.items():
        console.print(f"best {n}: {b['candidate']}  {b['median_us']:.1f} µs = {100 * b['fraction_of_roofline']:.0f}% "
                      f"of roofline  launch {b['launch']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20, help="timed calls per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timing", choices=("graph", "eager"), default="graph",
                   help="graph: replays of the call captured as a CUDA graph (the kernels as a decode step runs them); "
                        "eager: the call's launches timed as they come (its host time inside; runs before 2026-12-05)")
    p.add_argument("--candidates", default=None, help="';'-separated tune strings instead of the built-in list")
    p.add_argument("--no-combos", action="store_true", help="skip phase 2 (best kernel knob x best chunk knob)")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--shapes", default=None, help="comma-separated GxBxP shapes (e.g. 8x8x1k,8x16x16k) instead of the "
                                                  "built-in ones")
    p.add_argument("--profile", action="store_true", help="also each candidate's kernels (torch.profiler, graph replays)")
    p.add_argument("--out", help="JSON path (default: benchmarks/results/<sm90|...>/prefix_sweep_gpu.json)")
    args = p.parse_args(argv)
    args.out = args.out or str(harness.results_path("prefix_sweep_gpu"))
    global SHAPES, DTYPE
    DTYPE = getattr(torch, args.dtype)
    if args.shapes:
        SHAPES = [parse_shape(t) for t in args.shapes.split(",")]
    if not torch.cuda.is_available():
        print("prefix_sweep_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    console = Console()
    torch.backends.cuda.matmul.allow_tf32 = False
    candidates = args.candidates.split(";") if args.candidates else list(CANDIDATES)
    for c in candidates:
        cuda_backend.parse_prefix_tune(c)        # a typo fails here, before the GPU work
    backend, reference = kernels.load("cuda"), kernels.load("reference")
    tb = time.perf_counter()
    lib = cuda_backend.library(torch.device("cuda", 0))   # first use may build the library (nvcc, sm_90)
    console.print(f"kernel library {lib.path} ready in {time.perf_counter() - tb:.1f} s")
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    console.print(f"[bold]{props.name}[/bold], {props.multi_processor_count} SMs; copy bandwidth {bw / 1e12:.2f} TB/s")
    l2_flush = torch.empty(max(4 * getattr(props, "L2_cache_size", 50 << 20), 256 << 20), dtype=torch.uint8,
                           device="cuda")
    steps, refs = [], {}
    for shape in SHAPES:
        step = make_step(**shape, dtype=DTYPE)
        q, pool, cascade, _ = step
        refs[shape_name(shape)] = reference.attend(q.float(), pool.float(), cascade, 1.0 / math.sqrt(HEAD_DIM))
        steps.append(step)
        torch.cuda.empty_cache()
    console.print(f"shapes and float32 references ready at {time.perf_counter() - t0:.1f} s")
    meta = dict(harness.run_record(__file__, argv), gpu=props.name, sms=props.multi_processor_count, dtype=args.dtype,
                copy_bandwidth_bytes_per_s=bw, reps=args.reps, max_rel_err=MAX_REL_ERR)
    out = Path(args.out)
    results: list[dict] = []
    note = None
    queue = list(candidates)
    phase2 = not args.no_combos and not args.candidates
    i = 0
    while i < len(queue):
        text = queue[i]
        console.print(f"[bold]candidate {i + 1}/{len(queue)}: {text}[/bold] ({time.perf_counter() - t0:.0f} s)")
        results += run_candidate(text, steps, refs, backend, lib, args, l2_flush.zero_, bw, console)
        write(out, meta, results)
        if not context_alive():
            note = f"CUDA context lost after candidate {text!r}; later candidates not run: {queue[i + 1:]}"
            console.print(f"[red]{note}[/red]")
            break
        i += 1
        if i == len(queue) and phase2:
            phase2 = False
            extra = combos(results)
            console.print(f"phase 2 (best kernel knob x best chunk knob per shape): {extra}")
            queue += extra
    cuda_backend.set_prefix_tune(None)
    write(out, meta, results, note)
    print_table(console, results, bw)
    console.print(f"wrote {out}; total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
