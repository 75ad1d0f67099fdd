"""Quantized weights on one GPU: the decode step of an 8B-shaped Llama (random bf16 weights, quantized in place on the
GPU) at 16k x 8 beams, stock transformers (sdpa, DynamicCache) against hf_cascade (default config: graphs, the whole
step) with the same quantized model. Writes JSON.

Step, as every project figure (DESIGN.md, "How to measure"): the whole generate() time per new token,
(t(N new) - t(2 new)) / (N - 2), timed with CUDA events around each generate call, after a warm-up at the same shape
(one 2-token call each), stock and cascade interleaved (s, c, s, c, ...), the median of ``--rounds`` rounds. Also:
peak memory above the weights, whether the decode step was captured (or why not), token agreement between the two
(the last round).

Quantizations (``--quant``): torchao int4 weight-only (tinygemm, group 128), bitsandbytes nf4 (bf16 compute),
and for reference torchao float8 dynamic activation / int8 weight-only and bitsandbytes 8-bit (threshold 6.0: graphs
refused). The decoder layers' linear layers are quantized; embeddings and lm_head stay bf16 (as transformers does).
Targets (issue 22): torchao int4 step <= 4 ms; bitsandbytes nf4 step <= 0.3x stock nf4's.

On the GPU machine (quantizers from tools/prepare_quant_wheels.sh; about 3.5 minutes, --quick about 2):
    source .device/quant/setup.sh && PYTHONPATH=. python benchmarks/quantized_gpu.py --quick --out $OUT/quantized.json
"""
from __future__ import annotations

import argparse

import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, LlamaConfig

import harness
import hf_cascade
from harness import median

SHAPES = {
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=14336, vocab_size=128256),
    # for a smoke run of the script itself (--shape tiny --device cpu --quant int8wo)
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=512, vocab_size=1000),
}
TARGETS = {"int4wo": ("step_ms", 4.0), "nf4": ("step_vs_stock", 0.3)}     # (figure, bound)


def build(shape: str, device: str) -> torch.nn.Module:
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=65536, pad_token_id=0, bos_token_id=None,
                         eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    return model.eval()


def _decoder_linears(model):
    """(parent module, attribute name, nn.Linear) of every linear layer inside the decoder layers."""
    for layer in model.model.layers:
        for parent in layer.modules():
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    yield parent, name, child


def quantize(model, quant: str) -> str:
    """Quantizes ``model``'s decoder linear layers in place; returns what was done (for the record)."""
    if quant in ("int4wo", "float8dyn", "int8wo"):
        from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Int4WeightOnlyConfig,
                                          Int8WeightOnlyConfig, quantize_)
        config = {"int4wo": lambda: Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"),
                  "float8dyn": Float8DynamicActivationFloat8WeightConfig,
                  "int8wo": Int8WeightOnlyConfig}[quant]()
        linears = {id(child) for _, _, child in _decoder_linears(model)}
        quantize_(model, config, filter_fn=lambda module, fqn: id(module) in linears)
        return f"torchao {type(config).__name__}"
    if quant in ("nf4", "bnb-int8"):
        import bitsandbytes as bnb
        for parent, name, linear in list(_decoder_linears(model)):
            device = linear.weight.device
            if quant == "nf4":
                new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                        compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
                new.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4",
                                               module=new).to(device)     # quantizes on the way
            else:
                new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                          has_fp16_weights=False, threshold=6.0, device="meta")
                # (Int8Params quantizes in .to() only on the way from the CPU: on the device, its own _quantize)
                new.weight = bnb.nn.Int8Params(linear.weight.data, requires_grad=False,
                                               has_fp16_weights=False)._quantize(device)
            if linear.bias is not None:
                new.bias = linear.bias
            setattr(parent, name, new)
            del linear
        return {"nf4": "bitsandbytes Linear4bit nf4, bf16 compute", "bnb-int8": "bitsandbytes Linear8bitLt, "
                "threshold 6.0"}[quant]
    raise ValueError(f"--quant {quant!r}: use int4wo, nf4, float8dyn, int8wo or bnb-int8")


def timed_generate(model, ids, new_tokens: int, variant: str, info: dict) -> dict:
    """One generate call: its time (CUDA events around it), peak memory above what was allocated before it; the
    cascade's runner (captures, why graphs are off) into ``info``."""
    model.set_attn_implementation("sdpa" if variant == "stock" else "cascade")
    kw = dict(num_beams=8, max_new_tokens=new_tokens, min_new_tokens=new_tokens, early_stopping=False,
              pad_token_id=0)
    runners = []
    real = hf_cascade.session.DecodeSession.decode_runner

    def spy(*args, **kwargs):
        runners.append(real(*args, **kwargs))
        return runners[-1]

    cuda = ids.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    hf_cascade.session.DecodeSession.decode_runner = spy
    try:
        if cuda:
            out = model.generate(input_ids=ids, **kw)
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            seconds, out = harness.timed(lambda: model.generate(input_ids=ids, **kw))
    except torch.cuda.OutOfMemoryError as err:
        return {"error": f"OOM: {str(err).splitlines()[0][:100]}"}
    finally:
        hf_cascade.session.DecodeSession.decode_runner = real
    peak = None
    if cuda:
        peak = ((torch.cuda.max_memory_allocated() - base) / 2**30
                + hf_cascade.memory.vmm_mapped_bytes(ids.device) / 2**30)
    if variant != "stock":
        runner = runners[0] if runners else None
        info.update(graphs="off" if runner is None else
                    ("captured" if runner.captures else f"eager ({runner.disabled or 'not captured'})"),
                    captures=getattr(runner, "captures", None), device_steps=getattr(runner, "device_steps", None))
        if runner is None:
            info["graph_refusal"] = hf_cascade.graphs.unsupported_reason(model, hf_cascade.CascadeConfig())
    return {"seconds": seconds, "peak": peak, "sequences": out}


def measure(model, ids, args) -> list[dict]:
    variants = ("stock", "cascade")
    n = args.new_tokens
    info = {v: {} for v in variants}

    def one_round(v, rnd):
        r2 = timed_generate(model, ids, 2, v, {})
        rn = timed_generate(model, ids, n, v, info[v])
        if "error" in r2 or "error" in rn:
            return {"error": r2.get("error") or rn.get("error")}
        return {"t2": r2["seconds"], "tn": rn["seconds"], "peak": rn["peak"], "sequences": rn["sequences"]}

    # warm-up at this very shape: one 2-token call each (stock's first call of a shape is 3-4x slower than its later
    # ones); a whole round would cost two more of stock's 8-row 16k prefills, the longest part of this benchmark
    warm = {v: timed_generate(model, ids, 2, v, {}) for v in variants}
    runs = harness.interleave([v for v in variants if "error" not in warm[v]], one_round, args.rounds,
                              failed=lambda r: "error" in r)
    runs.update({v: [warm[v]] for v in variants if "error" in warm[v]})
    rows = {}
    for v in variants:
        if runs[v] and "error" in runs[v][0]:
            rows[v] = {"variant": v, "error": runs[v][0]["error"]}
            continue
        steps = [(r["tn"] - r["t2"]) / (n - 2) * 1e3 for r in runs[v]]
        peaks = [r["peak"] for r in runs[v] if r["peak"] is not None]
        rows[v] = {"variant": v, "step_ms": median(steps), "step_ms_all": [round(s, 2) for s in steps],
                   "t2_s": median(r["t2"] for r in runs[v]), "peak_gib": max(peaks) if peaks else None, **info[v]}
    if all("step_ms" in rows[v] for v in variants):
        stock, cascade = rows["stock"], rows["cascade"]
        cascade["step_vs_stock"] = cascade["step_ms"] / stock["step_ms"]
        a, b = runs["stock"][-1]["sequences"], runs["cascade"][-1]["sequences"]
        cascade["token_agreement"] = float((a[:, ids.shape[1]:] == b[:, ids.shape[1]:]).float().mean())
    return [rows[v] for v in variants]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", nargs="+", default=["int4wo", "nf4"],
                        help="some of int4wo, nf4, float8dyn, int8wo, bnb-int8 (default: int4wo nf4)")
    parser.add_argument("--shape", default="8b", choices=list(SHAPES))
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up round")
    parser.add_argument("--quick", action="store_true", help="1 timed round of 10 new tokens (about 2 GPU minutes)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", help="JSON path (default: benchmarks/results/<sm90|...>/quantized_gpu.json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.new_tokens = 1, 10
    if args.new_tokens < 3:
        parser.error("--new-tokens must be at least 3 (the step is (t(N) - t(2)) / (N - 2))")
    args.out = args.out or str(harness.results_path("quantized_gpu"))
    console = Console()
    results = []
    ids = torch.randint(1, min(SHAPES[args.shape]["vocab_size"], 128000), (1, args.prompt),
                        generator=torch.Generator().manual_seed(args.prompt)).to(args.device)
    for quant in args.quant:
        model = build(args.shape, args.device)
        done = quantize(model, quant)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        # (a quantized tensor subclass reports its logical shape and dtype: the allocator's count is the real one)
        weights_gib = torch.cuda.memory_allocated() / 2**30 if args.device == "cuda" else None
        for row in measure(model, ids, args):
            row.update(quant=quant, quantization=done, weights_gib=weights_gib, shape=args.shape, prompt=args.prompt,
                       beams=8)
            if row["variant"] == "cascade" and quant in TARGETS and TARGETS[quant][0] in row:
                figure, bound = TARGETS[quant]
                row.update(target=f"{figure} <= {bound}", target_met=row[figure] <= bound)
            results.append(row)
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
        # written after each quantization: a run cut short keeps what it measured
        harness.write_json(args.out, {"meta": harness.run_record(__file__), "results": results})
    harness.table(f"{args.shape} {args.prompt} x 8 beams, quantized weights, step over {args.new_tokens} new tokens, "
                  f"median of {args.rounds}",
                  ["quant", "variant", "step_ms", "step_vs_stock", "t2_s", "peak_gib", "weights_gib", "graphs",
                   "token_agreement", "target", "target_met", "error"], results, console,
                  left=("quant", "variant", "graphs", "target", "error"))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
