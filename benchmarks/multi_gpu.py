"""Cascade generate() with the model spread over several devices, against the same weights on one:
accelerate's `device_map="auto"` (layers split across GPUs, each layer's pool on its layer's GPU) and
transformers' tensor parallelism (`tp_plan="auto"` under torchrun, each rank caching only its heads).

One checkpoint of random weights is saved first so that every run loads the same model:

    python benchmarks/multi_gpu.py save --shape 8b --dir /tmp/ckpt8b
    python benchmarks/multi_gpu.py single --dir /tmp/ckpt8b --out single.json
    python benchmarks/multi_gpu.py device-map --dir /tmp/ckpt8b --gpus 2 --ref single.json --out dmap.json
    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py tp --dir /tmp/ckpt8b --ref single.json --out tp.json

Each run prints one line and writes JSON: generated tokens, whether they equal the reference run's,
prefill and per-step wall time (every device synchronised after each forward, the same in all
modes), peak memory per GPU above the weights, and the cascade pool's KV heads and peak bytes per
process. `--device cpu` runs the same on the CPU (tensor parallelism over gloo), for tiny shapes.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import types

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import harness
import hf_cascade

SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=96, vocab_size=96),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               intermediate_size=8192, vocab_size=128256),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=14336, vocab_size=128256),
}


def save(args) -> None:
    config = LlamaConfig(max_position_embeddings=65536, pad_token_id=0, bos_token_id=None, eos_token_id=None,
                         **SHAPES[args.shape])
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.save_pretrained(args.dir)
    print(f"saved {args.shape} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters) to {args.dir}")


def _devices(args) -> list[torch.device]:
    if args.device == "cpu":
        return [torch.device("cpu")]
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def _tp_kwargs() -> dict:
    from transformers.distributed import DistributedConfig
    return {"distributed_config": DistributedConfig(tp_plan="auto")}


def load(args, mode: str):
    dtype = getattr(torch, args.dtype)
    kw = dict(attn_implementation=args.attn, dtype=dtype)
    if mode == "single":
        kw["device_map"] = "cpu" if args.device == "cpu" else "cuda:0"
    elif mode == "device-map":
        # "auto" balances the layers over the GPUs max_memory names (accelerate's get_balanced_memory)
        kw["device_map"] = "auto"
        kw["max_memory"] = {i: torch.cuda.mem_get_info(i)[0] for i in range(args.gpus)}
    else:
        kw.update(_tp_kwargs())
    return AutoModelForCausalLM.from_pretrained(args.dir, **kw).eval()


def generate(args, mode: str) -> dict:
    rank = int(os.environ.get("RANK", 0))
    if args.dtype == "float32":      # full float32 products, so that runs compare token for token
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model = load(args, mode)
    devices = _devices(args)
    if mode == "tp" and args.device == "cuda":
        first = torch.device("cuda", torch.cuda.current_device())
        devices = [first]                # each rank synchronises and measures its own GPU
    else:
        first = model.get_input_embeddings().weight.device
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab - 1, (1, args.prompt), generator=torch.Generator().manual_seed(args.prompt))
    ids = ids.to(first)
    kw = dict(num_beams=args.beams, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0,
              do_sample=False, early_stopping=False, return_dict_in_generate=True)
    runners = []
    if args.graphs != "off":
        # decode steps on the graph runner ("eager": its static path without capture, any device) and, where the
        # call allows, the whole step on the device; a cache of our own keeps the stats without
        # return_dict_in_generate (which keeps transformers' loop)
        from hf_cascade.session import DecodeSession
        real = DecodeSession.decode_runner

        def spy(session):
            runner = real(session)
            runners.append(runner)
            return runner

        DecodeSession.decode_runner = spy
        config = hf_cascade.CascadeConfig(cuda_graphs="eager" if args.graphs == "eager" else True)
        kw["return_dict_in_generate"] = False
        cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        kw[cache_name] = kept_cache = hf_cascade.CascadeCache(model.config, config)
    model.generate(input_ids=ids[:, :64], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    if args.graphs != "off":
        kept_cache.reset()
    for d in devices:
        harness.synchronize(d)
    base = {d: torch.cuda.memory_allocated(d) for d in devices if d.type == "cuda"}
    for d in base:
        torch.cuda.reset_peak_memory_stats(d)
    # wall time of every forward, all devices synchronised before and after (the same in every mode, so that
    # one GPU, a device_map split and tensor parallelism compare like with like)
    # (with graphs the decode loop is the whole step, which hooks on the model would turn back into transformers' loop)
    clock = harness.ForwardTimer(model, sync_devices=devices, model_hooks=args.graphs == "off")
    try:
        out = model.generate(input_ids=ids, **kw)
    finally:
        clock.remove()
    times_ms = clock.times_ms()
    if args.graphs != "off":
        out, cache = types.SimpleNamespace(sequences=out), kept_cache
    else:
        cache = out.cache if "cache" in type(out).__dataclass_fields__ else out.past_key_values   # 5.24 renamed it
    cascade = isinstance(cache, hf_cascade.CascadeCache)
    pools = [layer.storage for layer in cache.layers] if cascade else []
    result = {
        "mode": mode, "rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", 1)),
        "prompt": args.prompt, "beams": args.beams, "new_tokens": args.new_tokens, "dtype": args.dtype,
        "devices_of_layers": sorted({str(p.device) for p in model.parameters()}),
        "attn": args.attn, "kv_heads_model": model.config.num_key_value_heads,
        "kv_heads_cached": pools[0].block_shape[2] if cascade else cache.layers[0].keys.shape[1],
        # each layer's pool lives where its layer's K/V come from
        "pool_devices": sorted({str(pool.device) for pool in pools}),
        "peak_kv_bytes_in_use": cache.stats().peak_kv_bytes_in_use if cascade else
        sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers),
        # generate's own forward of the last prompt token over all beams follows our prefill: both count
        # (the graph runner's replays and the whole step's steps run no forward hook: then only the prefill is timed)
        "prefill_s": sum(times_ms[:2]) / 1e3,
        "step_ms": harness.median(times_ms[2:]) if len(times_ms) > 2 else None,
        "peak_gib_above_weights": {str(d): (torch.cuda.max_memory_allocated(d) - base[d]) / 2**30 for d in base},
        "tokens": out.sequences[:, args.prompt:].tolist(),
        "graphs": args.graphs,
        # steps of the timed call on the runner: replayed forwards, and steps of the whole step on the device
        "runner_replays": runners[-1].replays if runners and runners[-1] is not None else None,
        "device_steps": runners[-1].device_steps if runners and runners[-1] is not None else None,
    }
    if cascade:
        cache.reset()
    if args.ref:
        with open(args.ref) as f:
            ref = json.load(f)
        result["tokens_match_ref"] = result["tokens"] == ref["tokens"]
        if result["step_ms"] is not None and ref.get("step_ms"):
            result["step_vs_ref"] = result["step_ms"] / ref["step_ms"]
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["save", "single", "device-map", "tp"])
    parser.add_argument("--dir", required=True, help="checkpoint folder (written by save, read by the others)")
    parser.add_argument("--shape", default="8b", choices=list(SHAPES))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--gpus", type=int, default=2, help="device-map: GPUs to split the layers over")
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--beams", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--attn", default="cascade", help="attn_implementation (sdpa: stock, for comparison)")
    parser.add_argument("--ref", help="JSON of the single-device run to compare tokens and step time with")
    parser.add_argument("--out", help="write the result as JSON here (under tp: rank 0's, others add .rankN)")
    parser.add_argument("--graphs", default="off", choices=["off", "eager", "on"],
                        help="decode steps on the graph runner (and the whole step where it serves): off (default, "
                             "as generate chooses), eager (its static path without capture, any device), on (CUDA)")
    args = parser.parse_args(argv)
    if args.mode == "save":
        return save(args)
    if args.mode == "tp" and "WORLD_SIZE" not in os.environ:
        parser.error("tp runs under torchrun: torchrun --nproc-per-node 2 benchmarks/multi_gpu.py tp ...")
    if args.mode == "device-map" and torch.cuda.device_count() < args.gpus:
        parser.error(f"device-map over {args.gpus} GPUs needs {args.gpus}; this machine has "
                     f"{torch.cuda.device_count()}")
    if args.device == "cpu" and args.mode == "device-map":
        parser.error("device-map splits over GPUs; use --device cuda")
    if args.mode == "tp" and args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    result = generate(args, args.mode)
    summary = {k: v for k, v in result.items() if k != "tokens"}
    print(json.dumps(summary))
    if args.out:
        path = args.out if result["rank"] == 0 else f"{args.out}.rank{result['rank']}"
        harness.write_json(path, {**harness.run_record(__file__, argv), **result})


if __name__ == "__main__":
    main()
