"""How far two settings' tokens part in bf16, where their math differs in its last bits: each variant's generate
call on random-weight Llama-shaped models (generate_gpu.SHAPES), the new tokens' agreement with a reference
variant's (positions equal, rows equal throughout, the first step where a row parts), and each variant's
sequences scored by one scorer (stock's model, sdpa, the same dtype, one teacher-forced forward per row): the mean
log-probability of the new tokens, and its gap to the reference's. A gap near zero says the other tokens are as
likely as the reference's (ties broken otherwise), not worse ones.

    PYTHONPATH=. python benchmarks/token_agreement_gpu.py --configs 8b:16384:beam8 8b:4096:greedy \
        --variants stock no-elementwise default

Variants: "stock" (sdpa, DynamicCache, the shape's unfused model), "default" (``CascadeConfig()``) and the
``CascadeConfig`` overrides in VARIANTS; the first one named is the reference.
"""
from __future__ import annotations

import argparse

import torch
from rich.console import Console

import harness
import hf_cascade
from generate_gpu import _mode_kwargs, _model_and_prompt, build

VARIANTS = {
    "stock": None,
    "default": dict(),
    "no-elementwise": dict(fuse_elementwise=False),      # the default before the norm/rotary kernels
    "unfused": dict(fuse_elementwise=False, fuse_projections=False),
    "compile": dict(compile=True),
}


def _generate(model, ids, mode: str, new_tokens: int, variant: str) -> torch.Tensor:
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0, **_mode_kwargs(mode))
    if VARIANTS[variant] is None:
        model.set_attn_implementation("sdpa")
    else:
        model.set_attn_implementation("cascade")
        kw["hf_cascade_config"] = hf_cascade.CascadeConfig(**VARIANTS[variant])
    torch.manual_seed(0)        # (sampling: every variant draws from the same generator state)
    out = model.generate(input_ids=ids, **kw)
    hf_cascade.release(model)
    return out[:, ids.shape[1]:]


@torch.no_grad()
def _mean_logprob(scorer, ids, new: torch.Tensor) -> torch.Tensor:
    """Per row: the mean log-probability of ``new`` after its prompt under ``scorer`` (one forward a row)."""
    rows = ids.shape[0]
    prompts = ids.repeat_interleave(new.shape[0] // rows, dim=0)
    out = []
    for prompt, tokens in zip(prompts, new):
        seq = torch.cat([prompt, tokens])[None]
        logits = scorer(input_ids=seq, use_cache=False, logits_to_keep=tokens.numel() + 1).logits[0, :-1].float()
        out.append(logits.log_softmax(-1).gather(-1, tokens[:, None]).mean())
    return torch.stack(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["8b:16384:beam8", "8b:4096:greedy", "8b:4096:sample8"])
    parser.add_argument("--variants", nargs="+", default=["stock", "no-elementwise", "default"], choices=list(VARIANTS))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    models, results = {}, []
    for entry in args.configs:
        shape, prompt, mode = entry.split(":")
        stock, ids = _model_and_prompt(models, shape, prompt, dtype)
        if (shape, "cascade") not in models:     # fusing projections changes a model in place: stock keeps its own
            models[(shape, "cascade")] = build(shape, dtype)
        new = {v: _generate(stock if VARIANTS[v] is None else models[(shape, "cascade")], ids, mode,
                            args.new_tokens, v) for v in args.variants}
        stock.set_attn_implementation("sdpa")
        scores = {v: _mean_logprob(stock, ids, tokens) for v, tokens in new.items()}
        reference = args.variants[0]
        for v in args.variants:
            same = new[v] == new[reference]
            parted = (~same).float().argmax(-1)
            parted = parted[~same.all(-1)]
            results.append({"shape": shape, "prompt": prompt, "mode": mode, "variant": v, "reference": reference,
                            "token_agreement": same.float().mean().item(),
                            "rows_equal": f"{int(same.all(-1).sum())}/{same.shape[0]}",
                            "first_parting_step": parted.min().item() if parted.numel() else None,
                            "mean_logprob": scores[v].mean().item(),
                            "logprob_gap": (scores[v] - scores[reference]).mean().item()})
            print(results[-1], flush=True)
        path = harness.write_json(args.out or harness.results_path("token_agreement_gpu"),
                                  {**harness.run_record("token_agreement_gpu"), "dtype": args.dtype,
                                   "new_tokens": args.new_tokens, "results": results})
    harness.table(f"token agreement, {args.dtype}, {args.new_tokens} new tokens", list(results[0]), results,
                  Console(), left=("shape", "prompt", "mode", "variant", "reference", "rows_equal"))
    print(path)


if __name__ == "__main__":
    main()
