"""What an fp8 KV cache holds (issue 22): the 8B shape at 32k x 16 beams and a batch of 32 prompts x 8k x 4 beams,
with the cache in the model's dtype and in ``kv_dtype="float8_e4m3fn"``.

Per scenario and cache dtype, one ``generate()`` call (beam search, ``--new-tokens`` new tokens): its wall time, the
cache's peak K/V bytes (``CascadeCache.stats().peak_kv_bytes_in_use``, scales included), the GPU memory torch
allocated above the weights at its peak (activations: the K/V pool is mapped outside torch's allocator), the device
memory left at the peak ("room to spare": the device less what torch reserved and the pool), and the share of new
tokens equal to the bf16 cache's. Random weights: near-flat logits, so the agreement is a weak signal (see
fp8_agreement.py); the bytes are the point.

    PYTHONPATH=.:benchmarks python benchmarks/fp8_capacity_gpu.py
    PYTHONPATH=.:benchmarks python benchmarks/fp8_capacity_gpu.py --device cpu --shape tiny   # a smoke test
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
from generate_gpu import build

SCENARIOS = {"32k-x16": (1, 32768, 16), "32x8k-x4": (32, 8192, 4)}      # prompts, tokens each, beams
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=1000, max_position_embeddings=65536, pad_token_id=0,
            bos_token_id=None, eos_token_id=None)


def _model(shape: str, device: str):
    if shape != "tiny":
        return build(shape, torch.bfloat16)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**TINY), attn_implementation="sdpa",
                                            dtype=torch.bfloat16).to(device).eval()


@contextlib.contextmanager
def cache_peaks(peaks: list):
    """Inside the block, each generate call's cache adds its peak K/V bytes to ``peaks`` as the call ends (read
    before the call gives its blocks back)."""
    session = hf_cascade.session.DecodeSession
    real_end = session._end

    def end(self, ok):
        if getattr(self, "cache", None) is not None:
            peaks.append(self.cache.stats().peak_kv_bytes_in_use)
        return real_end(self, ok)

    session._end = end
    try:
        yield peaks
    finally:
        session._end = real_end


def one_call(model, ids, beams: int, new_tokens: int, kv_dtype, device: str) -> tuple[dict, torch.Tensor]:
    config = hf_cascade.CascadeConfig(kv_dtype=kv_dtype) if kv_dtype else hf_cascade.CascadeConfig()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()      # (max_memory_reserved restarts from what is reserved now)
        before = torch.cuda.memory_allocated()
    peaks = []
    with cache_peaks(peaks):
        seconds, out = harness.timed(lambda: model.generate(
            input_ids=ids, num_beams=beams, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            early_stopping=False, pad_token_id=0, hf_cascade_config=config), device)
    row = dict(kv_dtype=kv_dtype or str(model.dtype).removeprefix("torch."), seconds=round(seconds, 3),
               peak_kv_bytes=max(peaks, default=None), peak_kv_gib=round(max(peaks) / 2**30, 4) if peaks else None)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        total = torch.cuda.mem_get_info()[1]
        # room: the device less the most torch reserved, less the K/V pool, which memory="vmm" (the default on a
        # GPU) maps outside torch's allocator (so peak_above_weights_gib leaves it out too)
        outside = max(peaks, default=0) if hf_cascade.CascadeConfig().memory in ("auto", "vmm") else 0
        row.update(peak_above_weights_gib=round((peak - before) / 2**30, 3),
                   room_at_peak_gib=round((total - torch.cuda.max_memory_reserved() - outside) / 2**30, 1))
    return row, out[:, ids.shape[1]:]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8b", help="a generate_gpu shape, or tiny (CPU smoke test)")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--device", default="cuda")
    p.add_argument("--scale", type=int, default=1, help="divide every prompt length by this (smoke tests)")
    p.add_argument("--out", help="JSON path (default: benchmarks/results/<hardware>/fp8_capacity_gpu.json)")
    args = p.parse_args()
    model = _model(args.shape, args.device)
    model.set_attn_implementation("cascade")
    rows = []
    for name in args.scenarios:
        prompts, tokens, beams = SCENARIOS[name]
        gen = torch.Generator().manual_seed(tokens)
        ids = torch.randint(1, min(model.config.vocab_size, 128000), (prompts, tokens // args.scale),
                            generator=gen).to(args.device)
        base, base_tokens = one_call(model, ids, beams, args.new_tokens, None, args.device)
        fp8, fp8_tokens = one_call(model, ids, beams, args.new_tokens, "float8_e4m3fn", args.device)
        fp8["token_agreement"] = round(float((fp8_tokens == base_tokens).float().mean()), 3)
        if base["peak_kv_bytes"] and fp8["peak_kv_bytes"]:
            fp8["kv_vs_bf16"] = round(fp8["peak_kv_bytes"] / base["peak_kv_bytes"], 3)
        for row in (base, fp8):
            rows.append(dict(scenario=name, prompts=prompts, prompt_tokens=ids.shape[1], beams=beams, **row))
        del ids
    harness.table("fp8 KV cache capacity", ["scenario", "kv_dtype", "seconds", "peak_kv_gib", "kv_vs_bf16",
                                            "peak_above_weights_gib", "room_at_peak_gib", "token_agreement"], rows,
                  console=Console(width=160))
    path = harness.write_json(args.out or harness.results_path("fp8_capacity_gpu"),
                              {**harness.run_record("fp8_capacity_gpu.py"), "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - started:.1f} s")
