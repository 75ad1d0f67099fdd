"""Stock transformers (sdpa, DynamicCache) vs hf_cascade per backend: beam search on random-weight
Llama-shaped models on one GPU. Prefill time and per-step time from CUDA events around each forward,
peak memory above the weights, tokens/s and token agreement. Prints a table, writes JSON.

    PYTHONPATH=. python benchmarks/generate_gpu.py --configs 8b:16384:8 1b:4096:8 --backends reference cuda flashinfer

``--whole-step`` measures instead what a user waits for per new token: the whole generate() wall time,
step = (t(N new) - t(2 new)) / (N - 2), beam search / sampling bookkeeping included, for stock and for
hf_cascade with CUDA graphs off ("eager") and on ("graph"), interleaved (s, e, g, s, e, g, ...) after a
warm-up of the same shape, the median of ``--rounds`` rounds. Entries are shape:prompt:mode with shape
one of SHAPES (Llama 1B/8B, Mistral-7B, Gemma-2-9B, GPT-OSS-20B; stock runs the last two in eager, as
they have no faithful sdpa), prompt a length or "4096+512x8" (8 prompts sharing a 4096-token system prompt,
then 512 tokens each), mode beamK, sampleK (K returned samples) or greedy. Cascade rows also give the K/V
bytes the first decode step's attention reads (each shared level once) and what per-row reads would be:

    PYTHONPATH=. python benchmarks/generate_gpu.py --whole-step --configs 8b:16384:beam8 8b:4096:greedy \
        mistral7b:8192:beam8 8b:4096+512x8:beam4

Cascade rows also give the step's memory floor (``floor_ms``: the weights but the embedding table, and the K/V its
attention reads, at 4.8 TB/s) and ``step_vs_floor``. Long context with an fp8 KV cache (issue 34):

    PYTHONPATH=. python benchmarks/generate_gpu.py --whole-step --configs 8b:131072:beam4 \
        --variants stock whole whole-fp8 --rounds 1 --new-tokens 17

``stock-static`` is transformers' own fast path (its static cache, whose forward generate() compiles on CUDA); cascade
rows then also give ``step_vs_stock_static`` (issue 33's greedy target):

    PYTHONPATH=. python benchmarks/generate_gpu.py --whole-step --configs 8b:4096:greedy --variants stock stock-static whole
"""
from __future__ import annotations

import argparse
import contextlib
import threading
import time

import torch
from rich.console import Console
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, Gemma2Config, GptOssConfig, LlamaConfig, MistralConfig

import harness
import hf_cascade
from harness import ForwardTimer, median

# shape name: (config class, its fields). Random weights; the names say which checkpoint's shape.
SHAPES = {
    "1b": (LlamaConfig, dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                             head_dim=64, intermediate_size=8192, vocab_size=128256)),
    "8b": (LlamaConfig, dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                             head_dim=128, intermediate_size=14336, vocab_size=128256)),
    # Mistral-7B-v0.1: every layer has a 4096-token sliding window
    "mistral7b": (MistralConfig, dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                      num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=32000,
                                      sliding_window=4096)),
    # Gemma-2-9B: logit softcap 50 on every layer, a 4096-token window on every other layer
    "gemma2-9b": (Gemma2Config, dict(hidden_size=3584, num_hidden_layers=42, num_attention_heads=16,
                                     num_key_value_heads=8, head_dim=256, intermediate_size=14336, vocab_size=256000,
                                     sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                     query_pre_attn_scalar=256)),
    # GPT-OSS-20B: attention sinks, a 128-token window on every other layer, 32 experts (4 per token)
    "gpt-oss-20b": (GptOssConfig, dict(hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
                                       num_key_value_heads=8, head_dim=64, intermediate_size=2880,
                                       num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
                                       sliding_window=128, max_position_embeddings=131072)),
}
# stock's attention where stock sdpa would not give the model's own results (sdpa drops Gemma-2's softcap;
# GPT-OSS has no sdpa: its sinks need eager)
STOCK_ATTENTION = {"gemma2-9b": "eager", "gpt-oss-20b": "eager"}
LEFT = ("shape", "prompt", "mode", "variant", "attention", "error")     # text columns of the tables


def build(shape: str, dtype) -> torch.nn.Module:
    config_class, fields = SHAPES[shape]
    config = config_class(**{**dict(max_position_embeddings=262144, pad_token_id=0, bos_token_id=None,
                                    eos_token_id=None), **fields})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=STOCK_ATTENTION.get(shape, "sdpa"),
                                                 dtype=dtype)
    model.stock_attention = STOCK_ATTENTION.get(shape, "sdpa")
    return model.eval()


def _model_of(models: dict, shape: str, dtype, variant: str):
    """The model a variant runs on: the shape's model for stock and the variants that do not fuse projections, for the
    others (CascadeConfig.fuse_projections, the default) a second one of the same weights (same seed), built on first
    use and kept with the shape's. Fusing changes a model in place (its products, also stock's, and unfusing it for
    the next variant would recompile and recapture every round): the other variants must not see it. Twice the
    weights' memory while both are held."""
    if WHOLE_VARIANTS[variant] is None or not WHOLE_VARIANTS[variant].get("fuse_projections", True):
        return models[shape]
    if (shape, "fused") not in models:
        models[(shape, "fused")] = build(shape, dtype)
    return models[(shape, "fused")]


def parse_prompt(prompt: str) -> tuple[int, int, int]:
    """"16384" (one prompt) or "4096+512x8" (8 prompts: a 4096-token system prompt they share, then 512 tokens
    of their own) -> (shared tokens, own tokens, prompts)."""
    if "+" not in prompt:
        return 0, int(prompt), 1
    shared, rest = prompt.split("+")
    own, prompts = rest.split("x")
    return int(shared), int(own), int(prompts)


def _model_and_prompt(models: dict, shape: str, prompt, dtype):
    """The model of ``shape`` (one kept at a time) and random prompts on the GPU: ``prompt`` tokens, or a
    "4096+512x8" batch (see parse_prompt)."""
    if shape not in models:
        models.clear()
        torch.cuda.empty_cache()
        models[shape] = build(shape, dtype)
    shared, own, prompts = parse_prompt(str(prompt))
    vocab = min(models[shape].config.vocab_size, 128000)
    gen = torch.Generator().manual_seed(shared + own)
    ids = torch.randint(1, vocab, (prompts, shared + own), generator=gen)
    ids[:, :shared] = ids[0, :shared]
    return models[shape], ids.cuda()


def run_one(model, ids, beams, new_tokens, variant):
    """variant: "stock" or a backend name. Returns a dict of figures (or {"error": ...})."""
    model.set_attn_implementation(model.stock_attention if variant == "stock" else "cascade")
    kw = dict(num_beams=beams, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
              return_dict_in_generate=True, early_stopping=False)
    if variant != "stock":
        # transformers' loop (return_dict_in_generate keeps it): the ForwardTimer times each forward (the whole step's
        # replays would call none); unfused: stock's runs share the model, and fusing it would change their products
        kw["hf_cascade_config"] = hf_cascade.CascadeConfig(backend=variant, fuse_projections=False)
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    timer = ForwardTimer(model)
    try:
        wall, out = harness.timed(lambda: model.generate(input_ids=ids, **kw), "cuda")
    except torch.cuda.OutOfMemoryError as err:
        return {"error": f"OOM: {str(err).splitlines()[0][:120]}"}
    finally:
        timer.remove()
    times = timer.times_ms()
    cache = out.cache if "cache" in type(out).__dataclass_fields__ else out.past_key_values   # 5.24 renamed it
    figures = {
        "prefill_s": times[0] / 1e3 if variant == "stock" else (times[0] + times[1]) / 1e3,
        "step_ms": median(times[1:] if variant == "stock" else times[2:]),
        "step_ms_max": max(times[2:]),
        "peak_gib_above_weights": (torch.cuda.max_memory_allocated() - base) / 2**30,
        "wall_s": wall,
        "beam_tokens_per_s": ids.shape[0] * beams * new_tokens / wall,
        "sequences": out.sequences.cpu(),
    }
    if isinstance(cache, hf_cascade.CascadeCache):
        stats = cache.stats()
        # pool bytes outside torch's allocator (CUDA virtual memory) are added to the peak
        figures["peak_gib_above_weights"] += hf_cascade.memory.vmm_mapped_bytes(ids.device) / 2**30
        figures["kv_gib_in_use_peak"] = stats.peak_kv_bytes_in_use / 2**30
        cache.reset()
    del out, cache
    return figures


WHOLE_VARIANTS = {
    "stock": None,
    # transformers' own fast path: its static cache, whose forward generate() compiles itself on CUDA (issue 33's
    # greedy target is measured against it); stock's model, so the same weights
    "stock-static": None,
    "eager": dict(backend="cuda", cuda_graphs=False),
    "graph": dict(backend="cuda", cuda_graphs=True),         # transformers' loop, forward replayed (TRANSFORMERS_LOOP)
    "whole": dict(backend="cuda", cuda_graphs=True),         # the whole step on the device
    "compile": dict(backend="cuda", cuda_graphs=True, compile=True),
    "whole-compile": dict(backend="cuda", cuda_graphs=True, compile=True),
    # one compiled decoder layer for every layer (hf_cascade/decode/regional.py): first_call_wall_s says its compile
    "whole-regional": dict(backend="cuda", cuda_graphs=True, compile="regional"),
    # the default before the norms and rotary embeddings ran on the library's kernels (hf_cascade/decode/fused_ops.py)
    "whole-no-elementwise": dict(backend="cuda", cuda_graphs=True, fuse_elementwise=False),
    # q/k/v and gate/up as separate products (CascadeConfig(fuse_projections=False)), on stock's model: see _model_of
    "whole-unfused": dict(backend="cuda", cuda_graphs=True, compile=True, fuse_projections=False),
    # the default step before fused projections became the default (what "whole" was up to 3f03ad0)
    "whole-uncompiled-unfused": dict(backend="cuda", cuda_graphs=True, fuse_projections=False),
    # an fp8 KV cache (e4m3 with per-head scales): half the K/V bytes (long context: issue 34)
    "whole-fp8": dict(backend="cuda", cuda_graphs=True, kv_dtype="float8_e4m3fn"),
    # the pools keep what a call mapped for the next one (CascadeConfig.keep_kv_bytes="auto"; the default, 0, unmaps it
    # and the next call maps it again: what that costs a call, t2_map_s says)
    "whole-keep": dict(backend="cuda", cuda_graphs=True, keep_kv_bytes="auto"),
}
# the memory floor of a decode step: every weight but the embedding table (a step gathers a few of its rows) and the
# K/V the step's attention reads, once, at the H200's DRAM bandwidth
BANDWIDTH = 4.8e12
# what each stock variant adds to generate()'s arguments
STOCK_KWARGS = {"stock": {}, "stock-static": dict(cache_implementation="static")}
# the variants run in transformers' loop around the replayed forward (harness.transformers_loop)
TRANSFORMERS_LOOP = ("graph", "compile")


def _mode_kwargs(mode: str) -> dict:
    if mode == "greedy":
        return dict(do_sample=False)
    if mode.startswith("beam"):
        return dict(num_beams=int(mode[4:]), early_stopping=False)
    if mode.startswith("sample"):
        return dict(do_sample=True, num_return_sequences=int(mode[6:]), top_k=0)
    raise ValueError(f"mode {mode!r}: use beamK, sampleK or greedy")


@contextlib.contextmanager
def _spying(owner, name: str, wrap):
    """``owner.name`` replaced by ``wrap(original)`` inside the block; nothing where the library no longer has
    that internal (the figures it feeds are then missing from the JSON, the timing is the same)."""
    original = getattr(owner, name, None) if owner is not None else None
    if original is None:
        yield
        return
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def collecting_runners(runners: list):
    """Inside the block, every decode runner a generate call makes is appended to ``runners`` (its captures,
    replays and device steps are read after the call)."""
    def spy_runner(real):
        def spy(*a, **k):
            runner = real(*a, **k)
            runners.append(runner)
            return runner
        return spy

    with _spying(getattr(getattr(hf_cascade, "session", None), "DecodeSession", None), "decode_runner", spy_runner):
        yield runners


@contextlib.contextmanager
def collecting_maps(maps: list):
    """Inside the block, ``(seconds, bytes)`` of every KV mapping a vmm pool makes on this thread (the call waits for
    it) is appended to ``maps``; the worker's mappings ahead of need are left out."""
    caller = threading.current_thread()

    def spy_map(real_map):
        def map_(vrange, size):
            start = time.perf_counter()
            try:
                return real_map(vrange, size)
            finally:
                if threading.current_thread() is caller:
                    maps.append((time.perf_counter() - start, size))
        return map_

    with _spying(getattr(hf_cascade.memory, "_VirtualRange", None), "_map", spy_map):
        yield maps


def _timed_generate(model, ids, new_tokens, mode, variant, info):
    model.set_attn_implementation(model.stock_attention if variant in STOCK_KWARGS else "cascade")
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0, **_mode_kwargs(mode),
              **STOCK_KWARGS.get(variant, {}))
    if WHOLE_VARIANTS[variant] is not None:
        kw["hf_cascade_config"] = hf_cascade.CascadeConfig(**WHOLE_VARIANTS[variant])
    if variant in TRANSFORMERS_LOOP:
        kw.update(harness.transformers_loop())
    runners = []

    def spy_prepare(real_prepare):
        def prepare(cache, *a, **k):        # the first decode step's attention reads (per layer and KV head)
            ctx = real_prepare(cache, *a, **k)
            plan = getattr(ctx, "plan", None)
            if ("kv_reads" not in info and getattr(plan, "q_len", None) == 1 and not getattr(plan, "fresh", True)
                    and hasattr(plan, "kv_reads")):
                info["kv_reads"] = plan.kv_reads()
            return ctx
        return prepare

    maps = []           # (seconds, bytes) of each KV mapping the call waited for
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        # (every host-planned step, the one-loop's first decode step included, begins in _begin_step_shape)
        with (collecting_runners(runners), _spying(hf_cascade.CascadeCache, "_begin_step_shape", spy_prepare),
              collecting_maps(maps)):
            wall, _ = harness.timed(lambda: model.generate(input_ids=ids, **kw), "cuda")
    except torch.cuda.OutOfMemoryError as err:
        return {"error": f"OOM: {str(err).splitlines()[0][:100]}"}
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 + hf_cascade.memory.vmm_mapped_bytes(ids.device) / 2**30
    runner = runners[0] if runners else None
    if runner is not None:
        info.update(captures=getattr(runner, "captures", None), capture_s=getattr(runner, "capture_seconds", None),
                    replays=getattr(runner, "replays", None), graph_disabled=getattr(runner, "disabled", None),
                    device_steps=getattr(runner, "device_steps", None))
    return {"wall": wall, "peak": peak, "map_s": sum(t for t, _ in maps), "map_mib": sum(b for _, b in maps) / 2**20}


def _step_weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads: all but the input embedding table."""
    embedding = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)


def whole_step(args, dtype, console):
    results, models = [], {}
    for entry in tqdm(args.configs, desc="configs"):
        shape, prompt, mode = entry.split(":")
        model, ids = _model_and_prompt(models, shape, prompt, dtype)
        n = args.new_tokens
        info = {v: {} for v in args.variants}

        def one_round(v, rnd):
            # t(2) - not t(1) - as the base: the whole step captures its graph at the second step of a call (the first
            # runs on the host path), transformers' loop at the first; from 2 on, both calls of a pair hold the same
            # one-off costs (a capture, or none where the kept graph serves), which the difference cancels
            m = _model_of(models, shape, dtype, v)
            r1 = _timed_generate(m, ids, 2, mode, v, {})
            rn = _timed_generate(m, ids, n, mode, v, info[v] if rnd == 0 else {})
            if "error" in r1 or "error" in rn:
                return {"error": r1.get("error") or rn.get("error")}
            if rnd == 0:
                info[v]["first_call_wall_s"] = rn["wall"]
            return {"t1": r1["wall"], "tn": rn["wall"], "peak": rn["peak"], "t2_map_s": r1["map_s"],
                    "t2_map_mib": r1["map_mib"]}

        # round 0 warms each variant up at this very shape
        runs = harness.interleave(args.variants, one_round, args.rounds, warmup=1, failed=lambda r: "error" in r)
        errors = {v: rs[0]["error"] for v, rs in runs.items() if rs and "error" in rs[0]}
        for v in args.variants:             # a second call of the same shape in a row: the graph is reused
            if v in errors or WHOLE_VARIANTS[v] is None or not WHOLE_VARIANTS[v].get("cuda_graphs"):
                continue
            again, m = {}, _model_of(models, shape, dtype, v)
            _timed_generate(m, ids, n, mode, v, {})
            second = _timed_generate(m, ids, n, mode, v, again)
            info[v].update(second_call_captures=again.get("captures"), second_call_wall_s=second.get("wall"),
                           second_call_replays=again.get("replays"))
        shape_rows = {}
        for v in args.variants:
            if v in errors:
                results.append({"shape": shape, "prompt": prompt, "mode": mode, "variant": v, "error": errors[v]})
                continue
            steps = [(r["tn"] - r["t1"]) / (n - 2) * 1e3 for r in runs[v]]
            row = {"shape": shape, "prompt": prompt, "mode": mode, "variant": v,
                   "attention": model.stock_attention if v in STOCK_KWARGS else "cascade",
                   "step_ms": median(steps), "step_ms_all": [round(x, 2) for x in steps],
                   "t2_s": median(r["t1"] for r in runs[v]), "peak_gib": max(r["peak"] for r in runs[v]),
                   # the KV mappings the t(2) call waited for (a vmm pool's cuMemCreate/Map/SetAccess on its thread)
                   "t2_map_s": median(r["t2_map_s"] for r in runs[v]),
                   "t2_map_mib": median(r["t2_map_mib"] for r in runs[v]), **info[v]}
            if "kv_reads" in row:       # bytes of K/V the step's attention reads, all layers
                config = model.config
                head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
                kv_dtype = (WHOLE_VARIANTS[v] or {}).get("kv_dtype")
                bits = torch.finfo(getattr(torch, kv_dtype) if kv_dtype else dtype).bits
                per_token = 2 * head_dim * config.num_key_value_heads * config.num_hidden_layers * bits // 8
                cascade_tokens, per_row_tokens = row.pop("kv_reads")
                row.update(kv_read_gib=cascade_tokens * per_token / 2**30,
                           kv_read_gib_per_row=per_row_tokens * per_token / 2**30)
                weights = _step_weight_bytes(model)
                row["floor_ms"] = (weights + cascade_tokens * per_token) / BANDWIDTH * 1e3
                row["step_vs_floor"] = row["step_ms"] / row["floor_ms"]
            shape_rows[v] = row
            results.append(row)
        for v, row in shape_rows.items():      # every variant against stock, ours also against stock's static cache
            for base, key in (("stock", "stock"), ("stock-static", "stock_static")):
                if base in shape_rows and v != base and not (v in STOCK_KWARGS and base != "stock"):
                    row[f"step_vs_{key}"] = row["step_ms"] / shape_rows[base]["step_ms"]
                    row[f"t2_vs_{key}"] = row["t2_s"] / shape_rows[base]["t2_s"]
        _write(args, results)       # after every shape: a command stopped at its time limit keeps the shapes done
    harness.table(f"whole-generate step, {args.dtype}, {args.new_tokens} new tokens, median of {args.rounds}",
                  ["shape", "prompt", "mode", "variant", "attention", "step_ms", "step_vs_stock", "step_vs_stock_static", "t2_s",
                   "t2_vs_stock", "t2_map_s",
                   "peak_gib", "kv_read_gib", "kv_read_gib_per_row", "floor_ms", "step_vs_floor", "captures",
                   "capture_s", "second_call_captures",
                   "first_call_wall_s", "graph_disabled", "error"], results, console, left=LEFT)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--whole-step", action="store_true",
                        help="whole-generate step per new token, stock vs eager vs graph, interleaved")
    parser.add_argument("--variants", nargs="+", default=["stock", "eager", "graph", "whole"],
                        help=f"with --whole-step: some of {', '.join(WHOLE_VARIANTS)} (compile: graph + torch.compile; "
                             "graph and compile run transformers' loop around the replayed forward)")
    parser.add_argument("--rounds", type=int, default=3, help="with --whole-step: timed rounds after the warm-up")
    parser.add_argument("--configs", nargs="+", default=["1b:4096:8", "8b:16384:8"],
                        help="shape:prompt:beams entries, shape in " + ",".join(SHAPES))
    parser.add_argument("--backends", nargs="+", default=["reference", "cuda", "flashinfer"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--set", nargs="*", default=[], metavar="MODULE.NAME=VALUE",
                        help="module switches for this process, e.g. decode.whole_step.select_kernel=true")
    parser.add_argument("--out", help="JSON path (default: benchmarks/results/<sm90|...>/generate_gpu.json, "
                                      "without --whole-step generate_gpu_forward.json)")
    args = parser.parse_args(argv)
    harness.apply_switches(args.set)      # (the command line in the record names them)
    args.out = args.out or str(harness.results_path("generate_gpu" if args.whole_step else "generate_gpu_forward"))
    dtype = getattr(torch, args.dtype)
    results, models = [], {}
    console = Console()
    if args.whole_step:
        _write(args, whole_step(args, dtype, console), console)
        return
    for entry in tqdm(args.configs, desc="configs"):
        shape, prompt, beams = entry.split(":")
        prompt, beams = int(prompt), int(beams)
        model, ids = _model_and_prompt(models, shape, prompt, dtype)
        run_one(model, ids[:, :256], 2, 4, "stock")                   # warm-up (cuBLAS, allocator)
        stock = run_one(model, ids, beams, args.new_tokens, "stock")
        rows = [("stock", stock)]
        for backend in args.backends:
            try:
                hf_cascade.kernels.load(backend)
            except ImportError as err:
                rows.append((backend, {"error": str(err)[:120]}))
                continue
            run_one(model, ids[:, :256], 2, 4, backend)               # warm-up (kernel build / JIT)
            rows.append((backend, run_one(model, ids, beams, args.new_tokens, backend)))
        for variant, fig in rows:
            if "sequences" in fig and "sequences" in stock and variant != "stock":
                a, b = stock["sequences"][:, prompt:], fig["sequences"][:, prompt:]
                fig["token_agreement"] = float((a == b).float().mean())
                fig["step_vs_stock"] = fig["step_ms"] / stock["step_ms"]
                fig["prefill_vs_stock"] = fig["prefill_s"] / stock["prefill_s"]
                fig["peak_vs_stock"] = fig["peak_gib_above_weights"] / stock["peak_gib_above_weights"]
            results.append({"shape": shape, "prompt": prompt, "beams": beams, "variant": variant,
                            **{k: v for k, v in fig.items() if k != "sequences"}})
    harness.table(f"generate(num_beams) on one GPU, {args.dtype}, {args.new_tokens} new tokens",
                  ["shape", "prompt", "beams", "variant", "prefill_s", "step_ms", "peak_gib_above_weights",
                   "beam_tokens_per_s", "token_agreement", "step_vs_stock", "prefill_vs_stock", "peak_vs_stock",
                   "error"], results, console, left=LEFT)
    _write(args, results, console)


def _write(args, results, console=None):
    # meta: the harness's record (date, commit, command, hardware, versions) and, as before, the GPU's name
    meta = {**harness.run_record(__file__), "gpu": torch.cuda.get_device_name()}
    harness.write_json(args.out, {"meta": meta, "results": results})
    if console is not None:
        console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
