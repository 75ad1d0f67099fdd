"""Where a short call's time goes: generate() with 1 and 2 new tokens, stock vs hf_cascade, split into phases.

A greedy 8B call on a 4k prompt took 0.269 s for 2 new tokens against stock's 0.164 s on an H100 (generate_gpu.py's
t(2)), while its steady step is 6x faster. This splits such a call, interleaved with stock, into what it waits for:
``setup`` (generate's own work before the first forward), ``prefill`` (the prompt's forward), ``between`` (from the
prefill to the first decode forward: forking, the decode layout, the call's device state), ``first`` (the first
decode forward: for hf_cascade the host-path step that feeds the last prompt token to every row; for stock its first
decode step), ``rest`` (everything after it to the end of the call), each on the host's clock and on the GPU's (CUDA
events recorded at the same points, no synchronisation added), and ``map_s``: the KV mappings a vmm pool made on the
call's thread. Variants: ``stock``, ``cascade`` (the defaults), ``cascade-keep`` (``keep_kv_bytes="auto"``).

    PYTHONPATH=. python benchmarks/first_tokens_gpu.py --shape 8b --prompt 4096 --mode greedy --rounds 3

``--device cpu --shape tiny`` runs the same split on the CPU (a smoke test of the script, not a figure).
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, LlamaConfig

import harness
import hf_cascade
from hf_cascade.decode import session, whole_step
from generate_gpu import _mode_kwargs, _model_of, _spying, collecting_maps

# the variant -> generate_gpu's (its model choice: stock keeps unfused projections) and the cascade config
VARIANTS = {"stock": ("stock", None), "cascade": ("whole", {}),
            "cascade-keep": ("whole-keep", dict(keep_kv_bytes="auto"))}
PHASES = ("setup", "prefill", "between", "first", "rest")
TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=1000, max_position_embeddings=8192, pad_token_id=0,
            bos_token_id=None, eos_token_id=None)


class Timeline:
    """Named points of one call on the host's clock and (on a GPU) as CUDA events on the current stream."""

    def __init__(self, cuda: bool):
        self.cuda, self.points = cuda, {}

    def mark(self, name: str) -> None:
        if name in self.points:          # the first time a point is reached
            return
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.points[name] = (time.perf_counter(), event)

    def spans(self, order) -> dict:
        """Seconds between consecutive points of ``order`` that were reached: host ``<a>_s`` and GPU ``<a>_gpu_s``."""
        if self.cuda:
            torch.cuda.synchronize()
        reached = [name for name in order if name in self.points]
        out = {}
        for a, b in zip(reached, reached[1:]):
            (ta, ea), (tb, eb) = self.points[a], self.points[b]
            out[f"{a}_s"] = tb - ta
            if ea is not None:
                out[f"{a}_gpu_s"] = ea.elapsed_time(eb) / 1e3
        return out


@contextlib.contextmanager
def _marking(model, variant: str, line: Timeline, maps: list):
    """Points: the prefill's start and end, the first decode forward's start and end (stock: its model forwards;
    hf_cascade: its own prefill forwards and the whole step's first host step); ``maps``: (seconds, bytes) of the
    vmm mappings made on this thread."""
    def spy_host_step(real):
        def host_step(loop, first: bool = False):
            if first:
                line.mark("first")
            try:
                return real(loop, first)
            finally:
                if first:
                    line.mark("rest")
        return host_step

    forwards = [0]

    def pre(module, args, kwargs):
        line.mark("prefill" if forwards[0] == 0 else "first")

    def post(module, args, kwargs, output):
        forwards[0] += 1
        line.mark("between" if forwards[0] == 1 else "rest")

    handles = []
    if variant == "stock":
        handles = [model.register_forward_pre_hook(pre, with_kwargs=True),
                   model.register_forward_hook(post, with_kwargs=True)]
    else:
        handles = [session.register_prefill_hook(pre=lambda m, kw: line.mark("prefill"),
                                                 post=lambda m, kw, out: line.mark("between"))]
    try:
        with collecting_maps(maps), _spying(whole_step.WholeStepLoop, "_host_step", spy_host_step):
            yield
    finally:
        for handle in handles:
            handle.remove()


def one_call(model, ids, variant: str, new_tokens: int, mode: str, device: str) -> dict:
    config = VARIANTS[variant][1]
    model.set_attn_implementation(getattr(model, "stock_attention", "sdpa") if config is None else "cascade")
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0, **_mode_kwargs(mode))
    if config is not None:
        kw["hf_cascade_config"] = hf_cascade.CascadeConfig(**config)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    line, maps = Timeline(cuda), []
    with _marking(model, variant, line, maps):
        line.mark("setup")
        model.generate(input_ids=ids, **kw)
        line.mark("end")
    spans = line.spans((*PHASES, "end"))
    (t0, _), (t1, _) = line.points["setup"], line.points["end"]
    return {"wall_s": t1 - t0, "map_s": sum(s for s, _ in maps), "map_mib": sum(b for _, b in maps) / 2**20, **spans}


def _tiny(device: str, dtype):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), attn_implementation="sdpa", dtype=dtype)
    model.stock_attention = "sdpa"
    return model.to(device).eval()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8b", help="a generate_gpu.SHAPES entry, or tiny")
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--mode", default="greedy", help="greedy, beamK or sampleK")
    p.add_argument("--new-tokens", type=int, nargs="+", default=[1, 2])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    models = {}

    def model_of(variant: str):
        if args.shape == "tiny":        # one model for every variant: a smoke test, not a figure
            return models.setdefault("tiny", _tiny(args.device, dtype))
        return _model_of(models, args.shape, dtype, VARIANTS[variant][0])

    if args.shape != "tiny":
        from generate_gpu import build
        models[args.shape] = build(args.shape, dtype)
    vocab = model_of(args.variants[0]).config.vocab_size
    ids = torch.randint(1, min(vocab, 128000), (1, args.prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    rows = []
    for n in args.new_tokens:
        runs = harness.interleave(args.variants, lambda v, rnd: one_call(model_of(v), ids, v, n, args.mode,
                                                                          args.device), args.rounds, warmup=1)
        for v in args.variants:
            keys = sorted({k for r in runs[v] for k in r})
            row = {"variant": v, "new_tokens": n, **{k: harness.median(r[k] for r in runs[v] if k in r) for k in keys}}
            rows.append(row)
    columns = ["variant", "new_tokens", "wall_s", *(f"{ph}_s" for ph in PHASES), *(f"{ph}_gpu_s" for ph in PHASES),
               "map_s", "map_mib"]
    harness.table(f"{args.shape} {args.prompt} {args.mode}: a short call's phases (median of {args.rounds})",
                  columns, rows, Console(), left=("variant",))
    if args.out:
        harness.write_json(args.out, {**harness.run_record(__file__, argv), "shape": args.shape,
                                      "prompt": args.prompt, "mode": args.mode, "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
