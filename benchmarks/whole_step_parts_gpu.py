"""GPU time of the whole decode step's parts (hf_cascade/decode/whole_step.py), each captured as its own CUDA graph and
replayed with CUDA events around it: the block bookkeeping, the forward on the planned step, the token choice, and
the whole step's own graph; the token choice also both ways side by side (``choose_torch_us``: its bookkeeping as torch
ops; ``choose_kernels_us``: on the library's csrc/select.cu, ``whole_step.select_kernel``; ``choose_kernels_topk_us``:
and beam search's small top-k's ranked in it, ``select_topk``). Where the whole step is slower than transformers'
loop replaying the forward, this says which part costs what. The parts are timed inside a real generate call (its
first device chunk), which is then stopped. ``--compile`` builds the step with ``CascadeConfig(compile=True)``; ``--compile MODE ...`` with each of
``false``, ``true`` (the whole forward as one graph) and ``regional`` (one compiled decoder layer for every layer:
hf_cascade/decode/regional.py), one row each on the same model, back to back, with the first call's wall time (compile and
capture) and the second's ("compile_s": the first less the second; run one mode per process with empty inductor and
Triton cache directories for compile seconds that no earlier compile served); ``--no-fuse`` with
``CascadeConfig(fuse_projections=False)`` (q/k/v and gate/up as separate products); ``--profile`` also lists the kernels of
one whole-step replay (torch.profiler over the replays): GPU time per category and the largest kernels, and the
replay's time outside kernels (the gaps between the graph's kernels). ``--quant int4wo`` (or another of
quantized_gpu.py's) quantizes the decoder's linear layers first: what limits a quantized step (issue 33 item 4; needs
``source .device/quant/setup.sh``). ``--kv-dtype float8_e4m3fn`` stores the KV cache in fp8 (``CascadeConfig(kv_dtype=...)``):
where an fp8 step's time goes against bf16's (run both in one process: ``--kv-dtype model float8_e4m3fn``). ``--set decode.whole_step.select_kernel=true`` (any module switch of hf_cascade)
and ``--blas cublaslt`` (torch's preferred BLAS library) hold for the whole process: run one process per setting,
each model's graphs being captured under it.

    PYTHONPATH=. python benchmarks/whole_step_parts_gpu.py --configs 8b:16384:beam8 8b:4096:greedy --compile --profile
    PYTHONPATH=. python benchmarks/whole_step_parts_gpu.py --configs 8b:16384:beam8 --compile false true regional
    PYTHONPATH=. python benchmarks/whole_step_parts_gpu.py --configs 8b:2048:beam8 --quant int4wo --profile
    PYTHONPATH=. python benchmarks/whole_step_parts_gpu.py --configs 8b:16384:beam8 --profile \
        --set decode.whole_step.select_kernel=true decode.fused_ops.add_norm_kernel=true --blas cublaslt
"""
from __future__ import annotations

import argparse
import json
import time

import collections

import torch
from rich.console import Console
from torch.profiler import ProfilerActivity, profile

import harness
import hf_cascade
from hf_cascade import whole_step
from generate_gpu import _mode_kwargs, _model_and_prompt
from step_breakdown_gpu import category


class _Stop(Exception):
    pass


def _graph(fn):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def kernel_profile(graph, reps: int) -> dict:
    """Kernel time per replay of ``graph``: by category (attention, matmul, other), the largest kernels, and the
    replay's wall time (CUDA events) less its kernel time: the gaps between the graph's kernels."""
    per_kernel = collections.Counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name[:100]] += event.time_range.elapsed_us() / reps
    by_category = collections.Counter()
    for name, us in per_kernel.items():
        by_category[category(name)] += us
    kernels = sum(per_kernel.values())
    return {"kernel_us": kernels, **{f"{c}_us": by_category[c] for c in ("attention", "matmul", "other")},
            "kernels_per_replay": sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events()) / reps,
            "top_kernels_us": dict((n, round(us, 1)) for n, us in per_kernel.most_common(25))}


def time_parts(loop, reps: int) -> dict:
    logits = {}

    def forward():
        logits["out"] = loop._forward()

    parts = {"blocks": _graph(loop._advance), "forward": _graph(forward)}
    parts["choose"] = _graph(lambda: loop._choose(logits["out"]))
    # the token choice both ways side by side (its bookkeeping on torch ops, on csrc/select.cu), whatever the process's
    # switch: each captured under its own setting
    default = whole_step.select_kernel, whole_step.select_topk
    try:
        for name, on, topk in (("choose_torch", False, False), ("choose_kernels", True, False),
                               ("choose_kernels_topk", True, True)):
            whole_step.select_kernel, whole_step.select_topk = on, topk
            parts[name] = _graph(lambda: loop._choose(logits["out"]))
    finally:
        whole_step.select_kernel, whole_step.select_topk = default
    parts["whole"] = loop.graph
    out = {}
    for name, graph in parts.items():
        median_us, min_us = harness.cuda_time_us(graph.replay, reps=reps, warmup=3)
        out[name + "_us"] = median_us
        out[name + "_min_us"] = min_us
    # the host's part of a step: what the loop does between two replays (the device is kept busy meanwhile) ...
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        loop.cache.logical_length += 1
        loop.graph.replay()
        loop.runner.replays += 1
    out["host_us_per_step"] = (time.perf_counter() - started) / reps * 1e6
    torch.cuda.synchronize()
    # ... which can include waiting for room in the launch queue; the host's own work is one step on an idle device
    own = []
    for _ in range(min(reps, 10)):
        torch.cuda.synchronize()
        started = time.perf_counter()
        loop.cache.logical_length += 1
        loop.graph.replay()
        loop.runner.replays += 1
        own.append((time.perf_counter() - started) * 1e6)
    torch.cuda.synchronize()
    out["host_own_us_per_step"] = harness.median(own)
    # the memory floor: every weight and every stored K/V byte read once at the H200's 4.8 TB/s
    weights = sum(p.numel() * p.element_size() for p in loop.model.parameters())
    kv = loop.cache.stats().kv_bytes_in_use
    out["floor_us"] = (weights + kv) / 4.8e12 * 1e6
    out["whole_vs_floor"] = out["whole_us"] / out["floor_us"]
    # bytes every step must read: the weights at the 8B shape's 4.8 TB/s are the matrix products' floor
    out["weights_floor_us"] = weights / 4.8e12 * 1e6
    return out


def _stopped_call(model, ids, config, kw, at_first_replay) -> None:
    """A generate call stopped at its first device chunk that has a captured step: ``at_first_replay(loop)`` there."""
    real_chunk = whole_step.WholeStepLoop._chunk

    def chunk(self, steps):
        done = real_chunk(self, steps)
        if self.graph is not None and self.held is not None:
            at_first_replay(self)
            raise _Stop
        return done

    whole_step.WholeStepLoop._chunk = chunk
    try:
        model.generate(input_ids=ids, hf_cascade_config=config, **kw)
    except _Stop:
        pass
    finally:
        whole_step.WholeStepLoop._chunk = real_chunk


def _compile_mode(text: str):
    """``--compile``'s word as CascadeConfig.compile's value."""
    modes = {"false": False, "true": True, "regional": "regional"}
    if text.lower() not in modes:
        raise SystemExit(f"--compile takes {', '.join(modes)}; got {text!r}")
    return modes[text.lower()]


def _on(text: str) -> bool:
    """``--elementwise``'s word as a bool."""
    if text.lower() not in ("false", "true"):
        raise SystemExit(f"--elementwise takes false or true; got {text!r}")
    return text.lower() == "true"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["8b:16384:beam8", "8b:4096:greedy"])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--compile", nargs="*", default=None, metavar="MODE",
                        help="CascadeConfig(compile=...) of each variant: false, true, regional (--compile alone: true)")
    parser.add_argument("--no-fuse", action="store_true",
                        help="CascadeConfig(fuse_projections=False): q/k/v and gate/up as separate matrix products")
    parser.add_argument("--elementwise", nargs="*", default=None, metavar="ON",
                        help="CascadeConfig(fuse_elementwise=...) of each variant, false and/or true (norms and "
                             "rotary on the library's kernels, the default; --elementwise alone: true), one row each "
                             "on the same model")
    parser.add_argument("--profile", action="store_true", help="also the kernels of one whole-step replay")
    parser.add_argument("--kv-dtype", nargs="*", default=None, metavar="DTYPE",
                        help="CascadeConfig(kv_dtype=...) of each variant: model (the model's dtype) and/or "
                             "float8_e4m3fn (--kv-dtype alone: float8_e4m3fn)")
    parser.add_argument("--quant", default=None, help="quantize the decoder's linears first (quantized_gpu.py's names)")
    parser.add_argument("--blas", default=None, choices=["cublas", "cublaslt"],
                        help="torch.backends.cuda.preferred_blas_library for this process (which GEMM path the "
                             "captured products take: cuBLAS picks split-K with separate reduce kernels at decode's "
                             "few rows)")
    parser.add_argument("--set", nargs="*", default=[], metavar="MODULE.NAME=VALUE",
                        help="module switches for this process, e.g. decode.whole_step.select_kernel=true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    harness.apply_switches(args.set)      # (the command line in the record names them)
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    models, results, calls = {}, [], []
    real_chunk = whole_step.WholeStepLoop._chunk
    compiles = [False] if args.compile is None else [_compile_mode(m) for m in args.compile or ["true"]]
    elementwise = ([hf_cascade.CascadeConfig().fuse_elementwise] if args.elementwise is None
                   else [_on(m) for m in args.elementwise or ["true"]])
    kv_dtypes = ([None] if args.kv_dtype is None
                 else [None if d == "model" else d for d in args.kv_dtype or ["float8_e4m3fn"]])
    for entry, compile, fuse_elementwise, kv_dtype in ((entry, compile, on, kv) for entry in args.configs
                                                       for compile in compiles for on in elementwise
                                                       for kv in kv_dtypes):
        shape, prompt, mode = entry.split(":")
        model, ids = _model_and_prompt(models, shape, prompt, torch.bfloat16)
        if args.quant and not getattr(model, "_parts_quantized", False):
            import quantized_gpu
            print("quantized:", quantized_gpu.quantize(model, args.quant), flush=True)
            model._parts_quantized = True
        model.set_attn_implementation("cascade")
        found = {}
        # a plain call first: the wall time of each chunk of device steps (replays and the flag read), per step
        walls = []

        def timed_chunk(self, steps):
            torch.cuda.synchronize()
            started = time.perf_counter()
            done = real_chunk(self, steps)
            walls.append(((time.perf_counter() - started) / steps * 1e6, steps, self.graph is not None))
            return done

        config = hf_cascade.CascadeConfig(backend="cuda", cuda_graphs=True, compile=compile,
                                          fuse_projections=not args.no_fuse, fuse_elementwise=fuse_elementwise,
                                          kv_dtype=kv_dtype)
        kw = dict(max_new_tokens=40, min_new_tokens=40, pad_token_id=0, **_mode_kwargs(mode))
        whole_step.WholeStepLoop._chunk = timed_chunk
        try:
            call_s = []
            for _ in range(2):        # the second call replays the kept graph from its first device step
                walls.clear()
                torch.cuda.synchronize()
                started = time.perf_counter()
                model.generate(input_ids=ids, hf_cascade_config=config, **kw)
                torch.cuda.synchronize()
                call_s.append(time.perf_counter() - started)
        finally:
            whole_step.WholeStepLoop._chunk = real_chunk
        replayed = [w for w, n, graph in walls if graph and n > 1]
        found["chunk_wall_us_per_step"] = sorted(replayed)[len(replayed) // 2] if replayed else None
        found["chunks"] = [(round(w), n) for w, n, _ in walls]
        # a new shape's first call: compile (where on) and capture; the second replays what the first kept
        found["first_call_s"], found["second_call_s"] = call_s
        found["compile_s"] = call_s[0] - call_s[1]
        _stopped_call(model, ids, config, kw, lambda loop: found.update(time_parts(loop, args.reps)))
        results.append({"shape": shape, "prompt": prompt, "mode": mode, "compile": str(compile).lower(),
                        "fuse": not args.no_fuse, "elementwise": fuse_elementwise, "quant": args.quant,
                        "kv_dtype": kv_dtype or "model",
                        "blas": str(torch.backends.cuda.preferred_blas_library()), "set": args.set, **found})
        print(json.dumps(results[-1], default=str), flush=True)     # (each row as it is done: a run cut short keeps it)
        calls.append((entry, model, ids, config, kw, results[-1]))     # (the row itself: its profile joins it)
    # the profiles last: a config timed after another's profile showed 230-500 µs of host time per graph launch
    # against 12-23 µs (the profiler's CUPTI hooks are the suspect), so no timing runs after a profile
    for entry, model, ids, config, kw, found in calls if args.profile else ():
        _stopped_call(model, ids, config, kw, lambda loop: found.update(kernel_profile(loop.graph, args.reps)))
        found["gaps_us"] = found["whole_us"] - found["kernel_us"]
        console = Console(width=160)
        console.print(f"{entry}: kernels of one whole-step replay (µs): " + ", ".join(
            f"{k} {found[k]:.0f}" for k in ("kernel_us", "attention_us", "matmul_us", "other_us", "gaps_us",
                                            "weights_floor_us", "kernels_per_replay")))
        for name, us in found["top_kernels_us"].items():
            console.print(f"  {us:8.1f}  {name}")
    harness.table("whole step parts (µs, CUDA events, median)",
                  ["shape", "prompt", "mode", "compile", "fuse", "first_call_s", "compile_s", "blocks_us", "forward_us",
                   "choose_us", "choose_torch_us", "choose_kernels_us", "choose_kernels_topk_us", "whole_us",
                   "chunk_wall_us_per_step", "host_us_per_step", "host_own_us_per_step", "floor_us", "whole_vs_floor"],
                  results, console=Console(width=180))
    harness.write_json(args.out or harness.results_path("whole_step_parts_gpu"),
                       {**harness.run_record("whole_step_parts_gpu.py"), "results": results})


if __name__ == "__main__":
    main()
