"""Cascade generate() with the model spread over several devices, against the same weights on one:
accelerate's `device_map="auto"` (layers split across GPUs, each layer's pool on its layer's GPU) and
transformers' tensor parallelism (`tp_plan="auto"` under torchrun, each rank caching only its heads).

Every run builds the same model, from a checkpoint of random weights saved once (`--dir`) or, for shapes too large to
save, from no checkpoint at all (`--random SHAPE`: transformers builds the model on the meta device, shards or places
it as it would a checkpoint's, and each parameter is filled with values its name seeds):

    python benchmarks/multi_gpu.py single --random 8b --graphs on --with-stock --out single.json
    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py tp --random 8b --graphs on --with-stock --ref single.json \
        --out tp.json
    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py tp --random 70b --prompt 8192 --graphs on --with-stock \
        --out tp70b.json
    python benchmarks/multi_gpu.py save --shape 8b --dir /tmp/ckpt8b      # the checkpoint route
    python benchmarks/multi_gpu.py device-map --dir /tmp/ckpt8b --gpus 2 --ref single.json --out dmap.json

Each run prints one line and writes JSON (under tp: rank 0's; the others add .rankN). One generate call with a cache
of the script's own gives the generated tokens (and whether they equal the reference run's), the KV heads each
process caches and its KV bytes, prefill and per-forward step time (every device synchronised after each forward;
None where decode steps run as the whole step, which calls no forward hook) and peak memory per GPU above the
weights. Then the whole-generate step (``--rounds`` > 0): step = (t(N new) - t(B new)) / (N - B), B = ``--step-base``
(1 by default), each t one whole generate() call (CUDA events; host wall time, devices synchronised, on the CPU; the
ranks start each call together), after a warm-up round of the same calls so that first-call costs (captures) fall
outside; the median over rounds, stock interleaved (s, c, s, c, ...) with ``--with-stock``: stock sdpa on the same
weights (its out-of-memory reported as {"oom": true}). Beside it the memory floor: the bytes one GPU must read per
step (its weights plus the K/V of the call's last step, its heads only) at ``--bandwidth`` (one H200: 4.8 TB/s), and
step / floor. `--device cpu` runs the same on the CPU (tensor parallelism over gloo), for tiny shapes. The cascade's
q/k/v and gate/up run fused (``CascadeConfig.fuse_projections``; under tensor parallelism over each rank's local
shards): ``fused_groups`` says how many products this process fused, ``--no-fuse`` runs them separate.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import os
import time
import types
import zlib

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import harness
import hf_cascade

SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=96, vocab_size=96),
    # the 70B's ratios (8 query heads per KV head, intermediate 3.5 x hidden) at a size the CPU tests run
    "tiny70b": dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=2, head_dim=8,
                    intermediate_size=448, vocab_size=128),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               intermediate_size=8192, vocab_size=128256),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=14336, vocab_size=128256),
    # Llama-3-70B: 141 GB of bf16 weights, more than one H200 holds (and than a 128 GiB disk stores): --random only
    "70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                intermediate_size=28672, vocab_size=128256),
}
H200_BYTES_PER_S = 4.8e12


def llama_config(shape: str) -> LlamaConfig:
    return LlamaConfig(max_position_embeddings=65536, pad_token_id=0, bos_token_id=None, eos_token_id=None,
                       **SHAPES[shape])


def save(args) -> None:
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(llama_config(args.shape), dtype=getattr(torch, args.dtype))
    model.save_pretrained(args.dir)
    print(f"saved {args.shape} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters) to {args.dir}")


def _devices(args) -> list[torch.device]:
    if args.device == "cpu":
        return [torch.device("cpu")]
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def _tp_kwargs() -> dict:
    from transformers.distributed import DistributedConfig
    return {"distributed_config": DistributedConfig(tp_plan="auto")}


def init_distributed(args) -> None:
    """The process group, as transformers would make it (nccl with the rank's GPU bound, gloo on the CPU) but with
    ``--dist-timeout``: transformers' own waits 2 hours, and a rank left alone in a collective (the other one out of
    memory in stock's call) would hold the GPUs that long."""
    if torch.distributed.is_initialized():
        return
    cuda = args.device == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    torch.distributed.init_process_group(backend="nccl" if cuda else "gloo",
                                         device_id=torch.device("cuda", local_rank) if cuda else None,
                                         timeout=datetime.timedelta(seconds=args.dist_timeout))


def _local(param: torch.Tensor) -> torch.Tensor:
    """This process's part of ``param``: a tensor-parallel DTensor's shard, else the tensor itself."""
    return param.to_local() if hasattr(param, "to_local") else param


@torch.no_grad()
def fill_random(model, seed: int = 0) -> None:
    """Every parameter as the model's init draws it (the config's ``initializer_range`` for matrices, ones for the
    norms' vectors) from a generator seeded by the parameter's name, so that every run, every rank and every layout
    (one GPU, a device_map split, tensor parallelism) holds the same weights. Values are drawn in float32 on the
    parameter's device and cast (a float32 and a bf16 model hold the same weights up to rounding); a DTensor takes
    its shard of the full tensor (torch's ``distribute_tensor`` without communication: each rank drew it whole)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    std = model.config.initializer_range
    for name, param in model.named_parameters():
        local = _local(param)
        generator = torch.Generator(device=local.device).manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
        full = torch.empty(param.shape, dtype=torch.float32, device=local.device)
        if param.ndim == 1:
            full.fill_(1.0)
        else:
            full.normal_(0.0, std, generator=generator)
        if isinstance(param, DTensor):
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        local.copy_(full)
        del full


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' load report names every parameter as missing when there is no checkpoint: not worth a page."""
    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


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
    if not args.random:
        return AutoModelForCausalLM.from_pretrained(args.dir, **kw).eval()
    # no checkpoint: from_pretrained with an empty state dict builds the model on the meta device, shards it
    # (tp_plan) or places it (device_map) as it would a checkpoint's, and initialises every weight where it lives,
    # as missing (each rank only its shards); fill_random then gives each its seeded values
    with _quiet_transformers():
        model = LlamaForCausalLM.from_pretrained(None, config=llama_config(args.random), state_dict={}, **kw)
    fill_random(model)
    return model.eval()


def _cache_of(out):
    return out.cache if "cache" in type(out).__dataclass_fields__ else out.past_key_values    # 5.24 renamed it


def _agreement(tokens: list, ref: list) -> float:
    """The share of generated positions (row by row) where ``tokens`` equal ``ref``'s."""
    pairs = [(a, b) for row, ref_row in zip(tokens, ref) for a, b in zip(row, ref_row)]
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)


def _sync(devices) -> None:
    for d in devices:
        harness.synchronize(d)


def _generate_kwargs(args, new_tokens: int) -> dict:
    return dict(num_beams=args.beams, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                do_sample=False, early_stopping=False)


@contextlib.contextmanager
def collect_runners():
    """The step runners (hf_cascade.graphs.DecodeGraphRunner, or None) the generate calls inside the block make: their
    counters say how the call's decode steps ran (replays, steps on the device, captures)."""
    from hf_cascade.session import DecodeSession
    real, runners = DecodeSession.decode_runner, []

    def spy(session):
        runner = real(session)
        runners.append(runner)
        return runner

    DecodeSession.decode_runner = spy
    try:
        yield runners
    finally:
        DecodeSession.decode_runner = real


def measure_call(model, args, mode: str, ids, devices) -> dict:
    """One generate call on a cache of the script's own (its stats), every forward timed with hooks."""
    rank = int(os.environ.get("RANK", 0))
    kw = dict(_generate_kwargs(args, args.new_tokens), return_dict_in_generate=True)
    config = _cascade_config(args)
    if args.graphs != "off":
        # decode steps on the graph runner ("eager": its static path without capture, any device) and, where the
        # call allows, the whole step on the device; a cache of our own keeps the stats without
        # return_dict_in_generate (which keeps transformers' loop)
        kw["return_dict_in_generate"] = False
        cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        kw[cache_name] = kept_cache = hf_cascade.CascadeCache(model.config, config)
    elif config is not None:
        kw["hf_cascade_config"] = config
    model.generate(input_ids=ids[:, :64], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    if args.graphs != "off":
        kept_cache.reset()
    _sync(devices)
    base = {d: torch.cuda.memory_allocated(d) for d in devices if d.type == "cuda"}
    for d in base:
        torch.cuda.reset_peak_memory_stats(d)
    # wall time of every forward, all devices synchronised before and after (the same in every mode, so that
    # one GPU, a device_map split and tensor parallelism compare like with like)
    # (with graphs the decode loop is the whole step, which hooks on the model would turn back into transformers' loop)
    clock = harness.ForwardTimer(model, sync_devices=devices, model_hooks=args.graphs == "off")
    try:
        with collect_runners() as runners:
            out = model.generate(input_ids=ids, **kw)
    finally:
        clock.remove()
    times_ms = clock.times_ms()
    if args.graphs != "off":
        out, cache = types.SimpleNamespace(sequences=out), kept_cache
    else:
        cache = _cache_of(out)
    cascade = isinstance(cache, hf_cascade.CascadeCache)
    pools = [layer.storage for layer in cache.layers] if cascade else []
    runner = runners[-1] if runners else None
    result = {
        "mode": mode, "rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", 1)),
        "shape": args.random or args.dir, "prompt": args.prompt, "beams": args.beams, "new_tokens": args.new_tokens,
        "dtype": args.dtype, "devices_of_layers": sorted({str(p.device) for p in model.parameters()}),
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
        # steps of the timed call on the runner: replayed forwards, steps of the whole step on the device, captures
        "runner_replays": runner.replays if runner is not None else None,
        "device_steps": runner.device_steps if runner is not None else None,
        "runner_captures": runner.captures if runner is not None else None,
        # q/k/v and gate/up products fused on this process (under tensor parallelism over its local shards)
        "fuse_projections": not args.no_fuse, "fused_groups": hf_cascade.fused_linears.fused_groups(model),
    }
    if cascade:
        cache.reset()
    return result


def _cascade_config(args):
    """The cascade's settings in every call: None (generate's own choice; on a GPU the whole step captured) unless
    ``--graphs`` asks for the runner's eager steps or captured steps, or ``--no-fuse`` for separate q/k/v and gate/up
    products."""
    if args.graphs == "off" and not args.no_fuse:
        return None
    graphs = {} if args.graphs == "off" else {"cuda_graphs": "eager" if args.graphs == "eager" else True}
    return hf_cascade.CascadeConfig(fuse_projections=not args.no_fuse, **graphs)


def _whole_config(args):
    """The cascade's settings in the whole-generate calls (:func:`_cascade_config`) as generate's keyword."""
    config = _cascade_config(args)
    return {} if config is None else {"hf_cascade_config": config}


def whole_step(model, args, ids, devices, variants: list[str]) -> dict[str, dict]:
    """Per variant ("cascade", "stock"): the whole-generate step and its calls' figures (see the module docstring);
    {"oom": True} for a variant that ran out of memory on any rank."""
    distributed = torch.distributed.is_initialized()
    cuda = [d for d in devices if d.type == "cuda"]
    n, base_new = args.new_tokens, args.step_base

    def call(variant: str, new_tokens: int) -> dict:
        model.set_attn_implementation(args.stock_attn if variant == "stock" else "cascade")
        # stock's loop is the same with its cache returned (which gives its KV heads and bytes); the cascade's
        # return_dict_in_generate would keep transformers' loop instead of the whole step
        kw = dict(_generate_kwargs(args, new_tokens), return_dict_in_generate=variant == "stock",
                  **({} if variant == "stock" else _whole_config(args)))
        if distributed:
            torch.distributed.barrier()
        _sync(devices)
        base = {d: torch.cuda.memory_allocated(d) for d in cuda}
        for d in cuda:
            torch.cuda.reset_peak_memory_stats(d)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
        start = time.perf_counter()
        if events:
            events[0].record()
        with collect_runners() as runners:
            out = model.generate(input_ids=ids, **kw)
        if events:
            events[1].record()
        _sync(devices)
        wall = time.perf_counter() - start
        runner = runners[-1] if runners else None
        figures = {"s": events[0].elapsed_time(events[1]) / 1e3 if events else wall, "wall_s": wall,
                   "sequences": out.sequences if variant == "stock" else out,
                   "captures": runner.captures if runner is not None else None,
                   "device_steps": runner.device_steps if runner is not None else None,
                   # everything the GPU held at the call's peak (the weights, and during stock's calls the cascade's
                   # state kept for its next call), and what the call added to what it found allocated
                   "peak_gib": {str(d): (torch.cuda.max_memory_allocated(d)
                                         + hf_cascade.memory.vmm_mapped_bytes(d)) / 2**30 for d in cuda},
                   "peak_gib_above_start": {str(d): (torch.cuda.max_memory_allocated(d) - base[d]) / 2**30
                                            for d in cuda}}
        if variant == "stock":
            cache = _cache_of(out)
            figures.update(kv_heads_cached=cache.layers[0].keys.shape[1],
                           peak_kv_bytes_in_use=sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers))
        return figures

    def one_round(variant: str, rnd: int) -> dict:
        oom = False
        try:
            short, full = call(variant, base_new), call(variant, n)
        except torch.OutOfMemoryError:
            oom = True
        if cuda:
            torch.cuda.empty_cache()
        if distributed:             # every rank gives up on the variant if one ran out of memory
            flag = torch.tensor([float(oom)], device=cuda[0] if cuda else "cpu")
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            oom = bool(flag.item())
        if oom:
            return {"oom": True}
        return {"short": short, "full": full}

    try:
        # round 0 warms each variant up at this very shape (its first call's captures, stock's slow first call)
        runs = harness.interleave(variants, one_round, args.rounds, warmup=1, failed=lambda r: "oom" in r)
    finally:
        model.set_attn_implementation(args.attn)
    results = {}
    for variant, kept in runs.items():
        if kept and "oom" in kept[0]:
            results[variant] = {"oom": True}
            continue
        steps = [(r["full"]["s"] - r["short"]["s"]) / (n - base_new) * 1e3 for r in kept]
        walls = [(r["full"]["wall_s"] - r["short"]["wall_s"]) / (n - base_new) * 1e3 for r in kept]
        last = kept[-1]["full"]
        results[variant] = {
            "whole_step_ms": harness.median(steps), "whole_step_ms_rounds": steps,
            "whole_step_wall_ms": harness.median(walls),
            "whole_short_s": harness.median(r["short"]["s"] for r in kept),
            "whole_full_s": harness.median(r["full"]["s"] for r in kept),
            # captures and device steps of each timed full call: a capture there would be inside the step figure
            "whole_captures": [r["full"]["captures"] for r in kept],
            "whole_device_steps": [r["full"]["device_steps"] for r in kept],
            "whole_peak_gib": last["peak_gib"], "whole_peak_gib_above_start": last["peak_gib_above_start"],
            "whole_tokens": last["sequences"][:, args.prompt:].tolist(),
            **{k: last[k] for k in ("kv_heads_cached", "peak_kv_bytes_in_use") if k in last},
        }
    return results


def memory_floor(model, args, kv_heads_cached: int, bandwidth: float) -> dict:
    """The bytes one process's device must read per decode step at least: its weights (its shards under tensor
    parallelism) and the K/V of its cached heads once, at the call's last step (the prompt once, each beam's new
    tokens), in the model's dtype; and their time at ``bandwidth``."""
    config = model.config
    weights = sum(_local(p).nbytes for p in model.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    tokens = args.prompt + args.beams * args.new_tokens
    kv = config.num_hidden_layers * 2 * kv_heads_cached * head_dim * tokens * model.dtype.itemsize
    return {"weight_bytes_per_process": weights, "kv_bytes_per_process": kv, "bandwidth_bytes_per_s": bandwidth,
            "floor_ms": (weights + kv) / bandwidth * 1e3}


def generate(args, mode: str) -> dict:
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
    result = measure_call(model, args, mode, ids, devices)
    result.update(memory_floor(model, args, result["kv_heads_cached"], args.bandwidth))
    if args.rounds:
        variants = [args.attn_variant] + (["stock"] if args.with_stock else [])
        whole = whole_step(model, args, ids, devices, variants)
        mine = whole.pop(args.attn_variant)
        if "whole_tokens" in mine:       # the timed calls made the tokens of the measured call
            result["whole_tokens_match"] = mine.pop("whole_tokens") == result["tokens"]
        result.update(mine)
        for variant, figures in whole.items():
            if "whole_tokens" in figures:
                tokens = figures.pop("whole_tokens")
                figures.update(tokens_match=tokens == result["tokens"],
                               token_agreement=_agreement(tokens, result["tokens"]))
            result[variant] = figures
        for figures in (result, *whole.values()):
            if figures.get("whole_step_ms") is not None:
                figures["whole_step_vs_floor"] = figures["whole_step_ms"] / result["floor_ms"]
        if "stock" in whole and "whole_step_ms" in whole["stock"] and "whole_step_ms" in result:
            result["whole_step_vs_stock"] = result["whole_step_ms"] / whole["stock"]["whole_step_ms"]
    if args.ref:
        with open(args.ref) as f:
            ref = json.load(f)
        result["tokens_match_ref"] = result["tokens"] == ref["tokens"]
        result["token_agreement_ref"] = _agreement(result["tokens"], ref["tokens"])
        if result["step_ms"] is not None and ref.get("step_ms"):
            result["step_vs_ref"] = result["step_ms"] / ref["step_ms"]
        if result.get("whole_step_ms") is not None and ref.get("whole_step_ms"):
            result["whole_step_vs_ref"] = result["whole_step_ms"] / ref["whole_step_ms"]
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["save", "single", "device-map", "tp"])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--dir", help="checkpoint folder (written by save, read by the others)")
    source.add_argument("--random", choices=list(SHAPES),
                        help="no checkpoint: build this shape and fill it with seeded random weights")
    parser.add_argument("--shape", default="8b", choices=list(SHAPES), help="save: the shape to save")
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
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds of the whole-generate step after one warm-up round (0: none)")
    parser.add_argument("--step-base", type=int, default=1, choices=[1, 2],
                        help="the short call's new tokens B: step = (t(N) - t(B)) / (N - B)")
    parser.add_argument("--no-fuse", action="store_true",
                        help="CascadeConfig(fuse_projections=False): q/k/v and gate/up as separate products")
    parser.add_argument("--with-stock", action="store_true",
                        help="stock sdpa on the same weights, interleaved in the whole-generate rounds")
    parser.add_argument("--bandwidth", type=float, default=H200_BYTES_PER_S,
                        help="bytes/s of one device's memory, for the floor (default: one H200's 4.8e12)")
    parser.add_argument("--dist-timeout", type=int, default=300, help="tp: seconds a collective may wait")
    args = parser.parse_args(argv)
    if args.mode == "save":
        if args.dir is None:
            parser.error("save writes a checkpoint: give --dir")
        return save(args)
    if args.mode == "tp" and "WORLD_SIZE" not in os.environ:
        parser.error("tp runs under torchrun: torchrun --nproc-per-node 2 benchmarks/multi_gpu.py tp ...")
    if args.mode == "device-map" and torch.cuda.device_count() < args.gpus:
        parser.error(f"device-map over {args.gpus} GPUs needs {args.gpus}; this machine has "
                     f"{torch.cuda.device_count()}")
    if args.device == "cpu" and args.mode == "device-map":
        parser.error("device-map splits over GPUs; use --device cuda")
    if args.with_stock and (args.attn != "cascade" or not args.rounds):
        parser.error("--with-stock interleaves stock with the cascade in the whole-generate rounds: "
                     "keep --attn cascade and --rounds >= 1")
    if args.rounds and args.new_tokens <= args.step_base:
        parser.error(f"the whole-generate step needs --new-tokens > --step-base ({args.step_base})")
    args.attn_variant = "cascade" if args.attn == "cascade" else "stock"
    args.stock_attn = "sdpa" if args.attn == "cascade" else args.attn
    if args.mode == "tp":
        init_distributed(args)
    result = generate(args, args.mode)
    summary = {k: v for k, v in result.items() if k != "tokens"}
    print(json.dumps(summary))
    if args.out:
        path = args.out if result["rank"] == 0 else f"{args.out}.rank{result['rank']}"
        harness.write_json(path, {**harness.run_record(__file__, argv), **result})


if __name__ == "__main__":
    main()
