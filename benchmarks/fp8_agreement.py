"""How often beam search with an fp8 KV cache picks the tokens the full-precision cache picks, beside how often two
full-precision runs that differ only in rounding agree (issue 22: agreement with the bf16 cache >= 95% on beam search).

Random weights make near-uniform next-token distributions: candidates nearly tie, so any rounding anywhere (another
kernel, another summation order, the fp8 cache) can flip a beam. So the script reports, on the same prompts:

- fp8 vs bf16 cache: token agreement (cascade with ``kv_dtype="float8_e4m3fn"`` against cascade with the model's
  dtype in the cache, same backend) and the largest |log-prob| gap of the first decode step;
- the floor of that comparison: cascade (bf16 cache) against stock sdpa, whose tokens differ only by rounding;
- the mean top-1 probability of the first decode step (how flat the random model's distributions are).

``--logit-scales`` multiplies the lm_head (sharper distributions; the logits' rounding errors grow with them, so
this does not make the model more robust to a perturbation: it shows how the agreement moves with the scale).

    PYTHONPATH=. python benchmarks/fp8_agreement.py --device cpu            # reference backend, about 2 minutes
    PYTHONPATH=. python benchmarks/fp8_agreement.py --device cuda --layers 8 --prompt 2048
"""
from __future__ import annotations

import argparse

import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, LlamaConfig

import harness
import hf_cascade


def build(args) -> torch.nn.Module:
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256), head_dim=64, max_position_embeddings=8192,
                         pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=getattr(torch, args.dtype))
    return model.to(args.device).eval()


def generate(model, ids, args, attention: str, kv_dtype: str | None = None):
    model.set_attn_implementation(attention)
    extra = {}
    if attention == "cascade":
        extra["hf_cascade_config"] = hf_cascade.CascadeConfig(kv_dtype=kv_dtype, backend=args.backend)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=args.beams,
                             max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0,
                             early_stopping=False, return_dict_in_generate=True, output_logits=True, **extra)
    return out.sequences[:, ids.shape[1]:], out.logits[0].float().log_softmax(-1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="auto", help="the cascade's backend (auto: cuda on a GPU, reference else)")
    p.add_argument("--logit-scales", type=float, nargs="+", default=[1.0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt", type=int, default=512, help="prompt length (tokens)")
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", help="JSON path (default: benchmarks/results/<hardware>/fp8_agreement.json)")
    args = p.parse_args(argv)
    model = build(args)
    head = model.lm_head.weight
    base = head.detach().clone()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, args.vocab, (args.prompts, args.prompt), generator=gen).to(args.device)
    rows = []
    for scale in args.logit_scales:
        with torch.no_grad():
            head.copy_(base * scale)
        stock, stock_lp = generate(model, ids, args, "sdpa")
        full, full_lp = generate(model, ids, args, "cascade")
        fp8, fp8_lp = generate(model, ids, args, "cascade", "float8_e4m3fn")
        rows.append(dict(
            logit_scale=scale,
            top1_prob=round(full_lp.exp().max(-1).values.mean().item(), 3),
            fp8_vs_bf16_cache=round((fp8 == full).float().mean().item(), 3),
            bf16_cascade_vs_stock=round((full == stock).float().mean().item(), 3),
            fp8_logprob_gap=float(f"{(fp8_lp - full_lp).abs().max().item():.3g}"),
            bf16_logprob_gap_vs_stock=float(f"{(full_lp - stock_lp).abs().max().item():.3g}")))
    harness.table(f"beam search ({args.beams} beams, {args.new_tokens} new tokens, {args.prompts} prompts of "
                  f"{args.prompt}), {args.dtype} model, {args.layers} layers, vocab {args.vocab}, on {args.device}",
                  list(rows[0]), rows, Console(width=160))
    out = harness.write_json(args.out or harness.results_path("fp8_agreement"),
                             dict(harness.run_record(__file__, argv), rows=rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
