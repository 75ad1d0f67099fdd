"""What one cascade decode step of generate(num_beams) is made of, on the GPU.

Llama-3-8B shape (random weights, bf16), one prompt, beam search, the cascade backend given. Over the
decode steps of one generate() call (after a warm-up call):

- step wall: time from one forward's start to the next's (the whole generate loop iteration);
- forward wall: the model's forward, the GPU synchronised before and after it;
- between forwards: step wall - forward wall, i.e. logits processing, beam-search bookkeeping and our
  reorder (block tables), all on the host and the GPU;
- GPU kernel time inside the forwards (torch.profiler), split into attention (our / FlashInfer's
  cascade kernels and the pool writes), matrix products, and the rest (norms, rotary, activations,
  copies); "GPU idle in forward" = forward wall - kernel time: launch and Python overhead;
- host time of the cache's per-step bookkeeping (blocks, plan: once per step for all layers), of the
  plan's upload, and of reorder_cache; with CUDA graphs (``--cuda-graphs on``, the default), also the
  runner's pool mapping + plan upload and the host side of ``graph.replay()``.

    PYTHONPATH=. python benchmarks/step_breakdown_gpu.py --prompt 16384 --beams 8 --backend cuda

This is transformers' decode loop around the replayed forward (kept by a logits processor of the caller's own,
``harness.transformers_loop``: the forward hooks mark each step). The whole step on the device (the default) replays
one graph per step with no forward call to hook: its breakdown is ``whole_step_parts_gpu.py --profile`` (each part captured alone, and the kernels of one replay).
"""
from __future__ import annotations

import argparse
import collections
import time

import torch
from rich.console import Console
from torch.profiler import ProfilerActivity, profile

import harness
import hf_cascade
from generate_gpu import build
from hf_cascade import cache as cache_module, graphs, plan as plan_module

ATTENTION = ("hfc_", "prefix_kernel", "suffix_kernel", "merge_kernel", "flashinfer", "BatchPrefill",
             "BatchDecode", "MergeState", "index_put", "scatter")
MATMUL = ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "wgmma")


def category(name: str) -> str:
    low = name.lower()
    if any(k.lower() in low for k in ATTENTION):
        return "attention"
    if any(k.lower() in low for k in MATMUL):
        return "matmul"
    return "other"


class HostTimer:
    """Wall time of calls to ``owner.name`` (host side), patched in for the measured call."""

    def __init__(self, owner, name):
        self.owner, self.name, self.original, self.times = owner, name, getattr(owner, name), []
        original, times = self.original, self.times

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                times.append(time.perf_counter() - t0)
        setattr(owner, name, timed)

    def restore(self):
        setattr(self.owner, self.name, self.original)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8b")
    p.add_argument("--prompt", type=int, default=16384)
    p.add_argument("--beams", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--backend", default="cuda")
    p.add_argument("--cuda-graphs", choices=("on", "off"), default="on")
    p.add_argument("--compile", action="store_true", help="CascadeConfig(compile=True) (with graphs)")
    p.add_argument("--out", help="JSON path (default: benchmarks/results/<sm90|...>/step_breakdown_gpu.json)")
    args = p.parse_args(argv)
    args.out = args.out or str(harness.results_path("step_breakdown_gpu"))
    console = Console(width=160)
    model = build(args.shape, torch.bfloat16)
    model.set_attn_implementation("cascade")
    ids = torch.randint(1, 128000, (1, args.prompt), generator=torch.Generator().manual_seed(0)).cuda()
    kw = dict(num_beams=args.beams, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0,
              early_stopping=False, hf_cascade_config=hf_cascade.CascadeConfig(
                  backend=args.backend, cuda_graphs=args.cuda_graphs == "on", compile=args.compile),
              **harness.transformers_loop())
    model.generate(input_ids=ids[:, :512], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})   # warm-up

    starts, ends = [], []

    # after the GPU is synchronised at each forward's start and end, a tiny marker kernel
    # (torch.cuda._sleep's spin kernel) is queued: kernels between a start and an end marker belong
    # to that forward, the others to the work between forwards
    def pre(*_):
        torch.cuda.synchronize()
        starts.append(time.perf_counter())
        torch.cuda._sleep(1)

    def post(*_):
        torch.cuda.synchronize()
        ends.append(time.perf_counter())
        torch.cuda._sleep(1)

    hooks = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]
    # host parts timed where the library still has them (a refactored library loses a row, not the run)
    parts = {"cache bookkeeping + plan (per step)": (getattr(cache_module, "CascadeCache", None), "_begin_step_shape"),
             "plan upload (per step)": (getattr(plan_module, "StepPlan", None), "on"),
             "reorder_cache (per step)": (getattr(cache_module, "CascadeCache", None), "reorder_cache"),
             "graph runner: pools + plan upload (per step)": (getattr(graphs, "DecodeGraphRunner", None), "_upload"),
             "graph replay, host side (per step)": (torch.cuda.CUDAGraph, "replay")}
    timers = {label: HostTimer(owner, name) for label, (owner, name) in parts.items()
              if owner is not None and hasattr(owner, name)}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.generate(input_ids=ids, **kw)
        torch.cuda.synchronize()
    for h in hooks:
        h.remove()
    for t in timers.values():
        t.restore()

    # forwards 0 and 1 are our prefill and generate's first forward; decode steps are the rest
    decode = range(2, len(starts))
    steps = len(decode)
    step_wall = [starts[i + 1] - starts[i] for i in decode if i + 1 < len(starts)]
    fwd_wall = [ends[i] - starts[i] for i in decode]
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    marks = [k.time_range.start for k in kernels if "spin" in k.name.lower()]
    if len(marks) != 2 * len(starts):
        raise RuntimeError(f"expected {2 * len(starts)} marker kernels, found {len(marks)}")
    first_decode_start = marks[2 * 2]
    by_cat, between_us, top = collections.Counter(), 0.0, collections.Counter()
    for k in kernels:
        t = k.time_range.start
        if "spin" in k.name.lower() or t < first_decode_start:
            continue
        index = sum(m <= t for m in marks) - 1         # odd: after an end marker, between forwards
        if index % 2:
            between_us += k.time_range.elapsed_us()
        else:
            by_cat[category(k.name)] += k.time_range.elapsed_us()
            top[k.name[:90]] += k.time_range.elapsed_us()
    per_step = {c: by_cat[c] / steps / 1e3 for c in ("attention", "matmul", "other")}
    kernel_ms = sum(per_step.values())
    fwd_ms = harness.median(fwd_wall) * 1e3
    step_ms = harness.median(step_wall) * 1e3
    host = {name: 1e3 * harness.median(t.times[2:] if name.startswith("cache") else t.times or [0.0])
            for name, t in timers.items() if t.times}
    rows = [
        ("step wall (median)", step_ms),
        ("  forward wall (median)", fwd_ms),
        ("    GPU kernels: attention (cascade kernels, pool writes)", per_step["attention"]),
        ("    GPU kernels: matrix products", per_step["matmul"]),
        ("    GPU kernels: other (norms, rotary, activations, copies)", per_step["other"]),
        ("    GPU idle in forward (launch + Python overhead)", fwd_ms - kernel_ms),
        ("  between forwards (logits processing, beam search, reorder)", step_ms - fwd_ms),
        ("    of which GPU kernels", between_us / steps / 1e3),
        *[(f"  host: {name}", v) for name, v in host.items()],
    ]
    harness.table(f"one decode step, {args.shape} shape, prompt {args.prompt}, {args.beams} beams, "
                  f"backend {args.backend}, graphs {args.cuda_graphs}{', compiled' if args.compile else ''} "
                  f"({steps} steps, kernel times are means)", ["part", "ms", "% of step"],
                  [(name, f"{v:.2f}", f"{100 * v / step_ms:.0f}%") for name, v in rows], console, left=("part",))
    console.print("largest decode kernels (ms per step):")
    for name, us in top.most_common(10):
        console.print(f"  {us / steps / 1e3:7.3f}  {name}")
    out = harness.write_json(args.out, dict(
        harness.run_record(__file__, argv), gpu=torch.cuda.get_device_name(),
        decode_steps=steps, rows=dict(rows), top_kernels_ms_per_step={n: us / steps / 1e3 for n, us in
                                                                      top.most_common(20)}), indent=2)
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
