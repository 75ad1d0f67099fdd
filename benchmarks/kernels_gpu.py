"""One layer's decode attention (prefix + suffix + merge) per kernel backend, against the memory roofline.

Llama-3-8B-shaped layer (32 query / 8 KV heads, head_dim 128, bf16, block 16), G prompts x B beams, a
shared prefix per prompt and a private suffix per beam. Each backend is called the way the library calls
it, ``hf_cascade.kernels.load(name).attend(q, pool, plan, scale)`` with a StepPlan from
``hf_cascade.plan.build_step_plan``; timed with CUDA events (warm-up, then the median of --reps calls, the
L2 cache overwritten before each). Also "cuda-full-table": the cuda backend's paged decode over each
row's whole table (no prefix groups), i.e. what a cascade saves (and "flashinfer-full-table" likewise).
``--threshold`` times short prefixes (16 to 1024 tokens) to find where the cascade stops paying.
``--fp8`` adds "cuda-fp8", the cuda backend on the same K/V stored as float8_e4m3fn with a scale per K/V and KV head
(``CascadeConfig(kv_dtype="float8_e4m3fn")``'s pool; its roofline counts one byte per element), and
"cuda-portable", bf16 on the portable prefix kernel's default configuration (the kernel the fp8 path runs).

Roofline: bytes a cascade must move (each prefix once per group, each row's suffix, q and o) divided by the
device-to-device copy bandwidth measured in the same run.

    PYTHONPATH=. python benchmarks/kernels_gpu.py [--reps 30] [--quick] [--fp8] [--out ...kernels_gpu.json]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from rich.console import Console
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402
from hf_cascade import kernels  # noqa: E402
from hf_cascade.kernels import cuda_tuning  # noqa: E402
from hf_cascade.kernels.base import AttentionParams, with_kv_scale  # noqa: E402
from hf_cascade.plan import build_step_plan  # noqa: E402

HQ, HKV, HEAD_DIM, BLOCK = 32, 8, 128, 16
SHAPES = ([dict(groups=8, beams=8, prefix=p, suffix=64) for p in (1024, 4096, 16384, 32768)]
          + [dict(groups=8, beams=b, prefix=16384, suffix=64) for b in (4, 16)])
# --threshold: short prefixes, where a separate prefix level may cost more than it saves
THRESHOLD_SHAPES = [dict(groups=g, beams=b, prefix=p, suffix=s)
                    for g, b in ((1, 4), (1, 8), (8, 8), (8, 16))
                    for p in (16, 32, 64, 128, 256, 512, 1024) for s in (64, 512)]
FULL_TABLE = ("cuda", "flashinfer")     # backends also timed over each row's whole table (no cascade)
FP8_MAX = 448.0
# --fp8: name -> (backend, the pool it reads, the prefix tuning its state is built with)
FP8_ROWS = {"cuda-fp8": ("cuda", "fp8", None), "cuda-portable": ("cuda", "bf16", "variant=default")}


def make_step(groups, beams, prefix, suffix, seed=0, device="cuda", dtype=torch.bfloat16):
    """Pool, queries and block tables of one decode step: G prompts' prefixes stored once, B beams each."""
    rng = np.random.default_rng(seed)
    R = groups * beams
    pb, sb = prefix // BLOCK, -(-suffix // BLOCK)
    num_blocks = groups * pb + R * sb + 8
    ids = rng.permutation(num_blocks).astype(np.int32)
    tables = np.empty((R, pb + sb), dtype=np.int32)
    at = 0
    for g in range(groups):
        shared = ids[at:at + pb]
        at += pb
        for b in range(beams):
            tables[g * beams + b, :pb] = shared
            tables[g * beams + b, pb:] = ids[at:at + sb]
            at += sb
    lengths = np.full(R, prefix + suffix, dtype=np.int64)
    counts = np.ones(R, dtype=np.int64)              # this step appended the last token
    last = lengths - 1
    append = SimpleNamespace(write_block=tables[np.arange(R), last // BLOCK].astype(np.int64),
                             write_offset=(last % BLOCK).astype(np.int64),
                             copy_src=np.zeros(0, np.int64), copy_dst=np.zeros(0, np.int64))
    cascade = build_step_plan(tables, lengths, counts, None, 1, append, BLOCK, min_group_rows=2)
    full = build_step_plan(tables, lengths, counts, None, 1, append, BLOCK, min_group_rows=R + 1)
    assert cascade.num_groups == groups and int(cascade.prefix_len.min()) == prefix, "unexpected cascade plan"
    assert full.num_groups == 0
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = torch.randn(num_blocks, 2, BLOCK, HKV, HEAD_DIM, generator=gen, device=device, dtype=torch.float32).to(dtype)
    q = torch.randn(R, 1, HQ, HEAD_DIM, generator=gen, device=device, dtype=torch.float32).to(dtype)
    return q, pool, cascade, full


def fp8_pool(pool: torch.Tensor) -> torch.Tensor:
    """``pool`` as the fp8 cache stores it: float8_e4m3fn, one scale per K/V and KV head (amax / 448), carried as the
    kernels read it (hf_cascade.kernels.base.kv_scale)."""
    amax = pool.float().abs().amax(dim=(0, 2, 4))                       # [2, Hkv]
    scale = (amax / FP8_MAX).clamp_min(1e-30)
    stored = (pool.float() / scale[None, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return with_kv_scale(stored, scale.contiguous())


def bytes_moved(groups, beams, prefix, suffix, elt=2, full_table=False, kv_elt=None):
    R = groups * beams
    per_token = HKV * HEAD_DIM * 2 * (kv_elt or elt)       # K and V of one token
    kv = (R * (prefix + suffix) if full_table else groups * prefix + R * suffix) * per_token
    return kv + 2 * R * HQ * HEAD_DIM * elt                # + q and o


def copy_bandwidth(reps=20, nbytes=2 << 30):
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    med, _ = harness.cuda_time_us(lambda: dst.copy_(src), reps, 3, lambda: None)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (med * 1e-6)                        # read + write, bytes/s


def threshold_summary(results):
    """Per (prompts x beams, suffix, backend): cascade time / full-table time at each prefix, and the
    shortest prefix from which the cascade is at least as fast at every longer prefix measured."""
    timed = {(r["groups"], r["beams"], r["suffix"], r["prefix"], r["backend"]): r["median_us"]
             for r in results if "median_us" in r}
    prefixes = sorted({k[3] for k in timed})
    rows = []
    for g, b, s, backend in sorted({(k[0], k[1], k[2], k[4]) for k in timed if not k[4].endswith("-full-table")}):
        ratios = [timed.get((g, b, s, p, backend), math.nan)
                  / timed.get((g, b, s, p, f"{backend}-full-table"), math.nan) for p in prefixes]
        pays_from = next((p for i, p in enumerate(prefixes) if all(x <= 1 for x in ratios[i:])), None)
        rows.append((f"{g}x{b}", str(s), backend, *[f"{x:.2f}" for x in ratios], str(pays_from)))
    return harness.table("cascade / full-table time (< 1: the cascade pays)",
                         ["prompts x beams", "suffix", "backend", *map(str, prefixes), "pays from"], rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30, help="timed calls per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timing", choices=("graph", "eager"), default="graph",
                   help="graph: replays of the call captured as a CUDA graph (the kernels as a decode step runs them; "
                        "FlashInfer stays eager); eager: the call's launches as they come (host time inside; the runs "
                        "before 2026-12-05)")
    p.add_argument("--backends", default="reference,cuda,flashinfer", help="comma-separated backends to try")
    p.add_argument("--quick", action="store_true", help="only the 16k, 8 x 8 shape")
    p.add_argument("--threshold", action="store_true",
                   help="short prefixes (16..1024 tokens): where the cascade stops paying against full tables")
    p.add_argument("--fp8", action="store_true",
                   help="also the cuda backend on an fp8 pool, and bf16 on the portable kernel the fp8 path runs")
    p.add_argument("--out", help="JSON path (default: benchmarks/results/<sm90|...>/kernels_gpu[_threshold].json)")
    args = p.parse_args(argv)
    args.out = args.out or str(harness.results_path("kernels_gpu_threshold" if args.threshold else "kernels_gpu"))
    if not torch.cuda.is_available():
        print("kernels_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    console = Console()
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    console.print(f"[bold]{props.name}[/bold], {props.multi_processor_count} SMs; "
                  f"device-to-device copy bandwidth {bw / 1e12:.2f} TB/s")
    l2_flush = torch.empty(max(4 * getattr(props, "L2_cache_size", 50 << 20), 256 << 20), dtype=torch.uint8,
                           device="cuda")
    flush = l2_flush.zero_

    backends = {}
    for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
        try:
            backends[name] = kernels.load(name)
        except ImportError as err:
            console.print(f"[yellow]skip {name}: {err}[/yellow]")

    shapes = THRESHOLD_SHAPES if args.threshold else [
        s for s in SHAPES if not args.quick or (s["prefix"] == 16384 and s["beams"] == 8)]
    extra = [n for n, (b, _, _) in FP8_ROWS.items() if b in backends] if args.fp8 else []
    jobs = [(s, name) for s in shapes
            for name in list(backends) + [f"{b}-full-table" for b in FULL_TABLE if b in backends] + extra]
    results = []
    current = None
    for shape, name in tqdm(jobs, desc="kernels", unit="run"):
        if current is None or current[0] is not shape:
            current = (shape, make_step(**shape))
            ref_out, fp8 = {}, None
        q, pool, cascade, full = current[1]
        scale = 1.0 / math.sqrt(HEAD_DIM)
        full_table = name.endswith("-full-table")
        backend_name, kv, tune = FP8_ROWS.get(name, (name.removesuffix("-full-table"), "bf16", None))
        backend = backends[backend_name]
        if kv == "fp8":
            fp8 = fp8 if fp8 is not None else fp8_pool(pool)
        kv_pool = fp8 if kv == "fp8" else pool
        plan = full if full_table else cascade
        kv_elt = 1 if kv == "fp8" else None
        row = dict(shape, backend=name, bytes=bytes_moved(**shape, full_table=full_table, kv_elt=kv_elt),
                   cascade_bytes=bytes_moved(**shape, kv_elt=kv_elt))
        reason = backend.unsupported_reason(q, kv_pool, plan)
        if reason is not None:
            row.update(skipped=reason)
            results.append(row)
            continue
        previous = cuda_tuning.prefix_tune()
        try:
            cuda_tuning.set_prefix_tune(tune)
            meta = backend.build(plan, q, kv_pool)   # once, as a step does for all its layers: only forward is timed
            cuda_tuning.set_prefix_tune(previous)
            params = AttentionParams(scale)
            out = backend.forward(q, kv_pool, meta, params)
            torch.cuda.synchronize()
            if name != "reference" and "reference" in backends:   # float32 reference, once per shape and pool
                if kv not in ref_out:
                    ref_out[kv] = backends["reference"].attend(q.float(), kv_pool if kv == "fp8" else pool.float(),
                                                               cascade, scale)
                ref = ref_out[kv]
                row["rel_err_vs_reference"] = float((out.float() - ref).norm() / ref.norm())
            # (FlashInfer's wrappers plan on the host: its calls are timed eagerly)
            graph = args.timing == "graph" and backend_name != "flashinfer"
            row["timing"] = "graph" if graph else "eager"
            med, best = harness.cuda_time_us(lambda: backend.forward(q, kv_pool, meta, params), args.reps,
                                             args.warmup, flush, graph=graph)
        except Exception as err:  # report and go on: one failing backend must not hide the others
            cuda_tuning.set_prefix_tune(previous)
            row.update(error=f"{type(err).__name__}: {err}")
            results.append(row)
            torch.cuda.synchronize()
            continue
        roofline = row["cascade_bytes"] / bw * 1e6
        row.update(median_us=med, min_us=best, roofline_us=roofline, fraction_of_roofline=roofline / med,
                   achieved_tb_s=row["bytes"] / (med * 1e-6) / 1e12)
        if backend_name == "cuda" and not full_table:     # the cuda backend's launch state (its metadata)
            st = meta
            row["cuda_plan"] = dict(chunk_tokens=st.chunk_tokens, chunks=st.max_chunks, row_tiles=st.row_tiles,
                                    m_tile=st.m_tile, suffix_splits=st.nsplit, prefix_kernel=st.tune)
        results.append(row)
        torch.cuda.empty_cache()

    rows = []
    for r in results:
        shape = (f"{r['groups']}x{r['beams']}", str(r["prefix"]), str(r["suffix"]), r["backend"])
        if "median_us" not in r:
            rows.append((*shape, "-", "-", "-", "-", "-", (r.get("skipped") or r.get("error", ""))[:60]))
            continue
        rows.append((*shape, f"{r['median_us']:.1f}", f"{r['min_us']:.1f}", f"{r['roofline_us']:.1f}",
                     f"{100 * r['fraction_of_roofline']:.0f}%", f"{r['achieved_tb_s']:.2f}",
                     f"{r['rel_err_vs_reference']:.1e}" if "rel_err_vs_reference" in r else ""))
    harness.table(f"one decode layer ({HQ}/{HKV} heads, D {HEAD_DIM}, bf16, block {BLOCK}); "
                  f"copy bw {bw / 1e12:.2f} TB/s",
                  ["prompts x beams", "prefix", "suffix", "backend", "median µs", "min µs", "roofline µs",
                   "% roofline", "TB/s", "rel err"], rows, console, left=("backend",))
    if args.threshold:
        console.print(threshold_summary(results))

    out = harness.write_json(args.out, dict(
        harness.run_record(__file__, argv),
        gpu=props.name, sms=props.multi_processor_count,
        copy_bandwidth_bytes_per_s=bw, heads=[HQ, HKV], head_dim=HEAD_DIM, block_size=BLOCK, dtype="bfloat16",
        reps=args.reps, results=results), indent=2)
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
