"""An evaluation loop: one generate() call per prompt, prompts of different lengths, stock vs hf_cascade.

What an evaluation script does (a Trainer-free loop over a dataset, batch 1): each call has a new prompt length, so
what a cascade call keeps for the next (the cache, its captured step, compiled graphs) is reused only where the shape
allows. Per variant, the loop's total wall time: the first pass (cold: captures and compiles included) and the
median of the later passes (warm), interleaved with stock (s, c, s, c, ...). Also per call: the captures it made, so
a second pass that captures again is visible. Random weights (shapes of generate_gpu.SHAPES).

    PYTHONPATH=. python benchmarks/eval_loop_gpu.py --shape 8b --beams 4 --new-tokens 64 --rounds 2

Issue 20's figure (H200, 8B, 4 beams, 64 new tokens, 8 prompts): cascade 6.4 s vs stock 30 s before the whole step.
``--device cpu --shape tiny`` runs the same loop on the CPU (a smoke test of the script, not a figure).
"""
from __future__ import annotations

import argparse

import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, LlamaConfig

import harness
import hf_cascade
from generate_gpu import SHAPES, build, collecting_runners

VARIANTS = {
    "stock": None,
    "cascade": dict(),                                  # the defaults: whole step on the device, graphs on a GPU
    "cascade-compile": dict(compile=True),
    "graph": dict(),                                    # transformers' loop around the replayed forward (below)
    "cascade-keep": dict(keep_kv_bytes="auto"),         # the pools keep what a call mapped for the next one
}
LENGTHS = (3600, 900, 2700, 1400, 4000, 600, 2100, 3100)    # the order a dataset would give them: mixed
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=1000, max_position_embeddings=8192, pad_token_id=0,
            bos_token_id=None, eos_token_id=None)


def _model(shape: str, device: str, dtype):
    if shape != "tiny":
        return build(shape, dtype)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), attn_implementation="sdpa", dtype=dtype)
    model.stock_attention = "sdpa"
    return model.to(device).eval()


def _prompts(lengths, vocab: int, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(1, min(vocab, 128000), (1, n), generator=gen).to(device) for n in lengths]


def run_loop(model, prompts, variant: str, beams: int, new_tokens: int, device: str) -> dict:
    """One pass of the loop: total wall seconds, each call's seconds and captures (cascade variants)."""
    model.set_attn_implementation(model.stock_attention if variant == "stock" else "cascade")
    kw = dict(num_beams=beams, max_new_tokens=new_tokens, min_new_tokens=new_tokens, early_stopping=False,
              pad_token_id=0)
    if VARIANTS[variant] is not None:
        kw["hf_cascade_config"] = hf_cascade.CascadeConfig(**VARIANTS[variant])
    if variant == "graph":
        kw.update(harness.transformers_loop())
    calls, runners = [], []
    with collecting_runners(runners):
        for ids in prompts:
            before = len(runners)
            seconds, _ = harness.timed(lambda: model.generate(input_ids=ids, **kw), device)
            made = [getattr(r, "captures", None) for r in runners[before:]]
            calls.append({"prompt": ids.shape[1], "s": round(seconds, 4),
                          "captures": sum(c for c in made if c is not None) if made else None})
    return {"total_s": sum(c["s"] for c in calls), "calls": calls}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8b", help=f"one of {', '.join(SHAPES)}, or tiny (CPU smoke test)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--variants", nargs="+", default=["stock", "cascade", "cascade-compile"],
                        choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=2, help="warm passes after the first (cold) one")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", help="JSON path (default: benchmarks/results/<hardware>/eval_loop_gpu.json)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    model = _model(args.shape, args.device, dtype)
    # the cascade fuses its model's projections in place (CascadeConfig.fuse_projections): stock keeps a twin of its
    # own, the same weights (same seed), or it would run the fused products too
    twin = _model(args.shape, args.device, dtype) if "stock" in args.variants else model
    prompts = _prompts(args.lengths, model.config.vocab_size, args.device)
    passes = harness.interleave(args.variants, lambda v, rnd: run_loop(twin if v == "stock" else model, prompts, v,
                                                                        args.beams, args.new_tokens, args.device),
                                rounds=1 + args.rounds)
    rows, stock = [], None
    for v in args.variants:
        cold, warm = passes[v][0], passes[v][1:]
        row = {"variant": v, "cold_s": cold["total_s"], "warm_s": harness.median(p["total_s"] for p in warm),
               "warm_all_s": [round(p["total_s"], 3) for p in warm],
               "cold_captures": sum(c["captures"] or 0 for c in cold["calls"]),
               "warm_captures": sum(c["captures"] or 0 for c in warm[-1]["calls"]),
               "calls": [p["calls"] for p in passes[v]]}
        if v == "stock":
            stock = row
        elif stock is not None:
            row["warm_vs_stock"] = row["warm_s"] / stock["warm_s"]
            row["cold_vs_stock"] = row["cold_s"] / stock["cold_s"]
        rows.append(row)
    harness.table(f"eval loop: {len(prompts)} prompts ({min(args.lengths)}-{max(args.lengths)} tokens), "
                  f"{args.beams} beams, {args.new_tokens} new tokens, {args.shape} {args.dtype}",
                  ["variant", "cold_s", "warm_s", "warm_vs_stock", "cold_vs_stock", "cold_captures", "warm_captures"],
                  rows, Console(), left=("variant",))
    out = args.out or str(harness.results_path("eval_loop_gpu"))
    harness.write_json(out, {**harness.run_record(__file__), "results": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
