"""``python -m hf_cascade``: the same beam search with stock sdpa and with cascade, side by side.

Builds a small Llama-shaped model with random weights (or loads ``--model PATH``), runs
``generate(num_beams=...)`` on seeded random prompts with each attention implementation, and
reports whether the tokens match, the KV bytes each kept, the rows each prefilled and the wall time.
A cascade call where sharing would not pay runs on stock's own path
(:func:`hf_cascade.generation.stock_path_reason`); the report then says so, with the reason.
Exit codes: 0 same tokens, 1 the tokens differ, 2 bad flags, 3 the run failed.
``python -m hf_cascade env`` prints versions, GPUs and which kernel backends can run here, with the reason.
The flags are parsed by :mod:`hf_cascade._cli`, before torch is imported.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, StoppingCriteria, StoppingCriteriaList

import hf_cascade
from hf_cascade import generation
from hf_cascade._cli import PROG, build_env_parser, build_parser

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def builtin_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                       intermediate_size=1408, vocab_size=32000, max_position_embeddings=4096, pad_token_id=0,
                       bos_token_id=None, eos_token_id=None)


def build_model(attn_implementation: str, model_path: str | None = None, dtype: str = "float32",
                device: str = "cpu", seed: int = 0):
    """The built-in random model (weights fixed by ``seed``) or the checkpoint at ``model_path``, in eval mode."""
    torch.manual_seed(seed)
    kwargs = dict(attn_implementation=attn_implementation, dtype=DTYPES[dtype])
    if model_path is None:
        model = AutoModelForCausalLM.from_config(builtin_config(), **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    return model.to(device).eval()


class ProgressBar(StoppingCriteria):
    """Ticks a tqdm bar once per decoding step; never stops generation."""

    def __init__(self, bar: tqdm):
        self.bar = bar

    def __call__(self, input_ids, scores, **kwargs):
        self.bar.update(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def kv_bytes(cache) -> int:
    """KV bytes a cache holds: the peak for a CascadeCache, the final tensors for a DynamicCache."""
    if isinstance(cache, hf_cascade.CascadeCache):
        return cache.stats().peak_kv_bytes_in_use
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def stock_path(model, input_ids, beams: int = 1, attention_mask=None, backend: str = "auto",
               num_return_sequences: int = 1) -> str | None:
    """Why ``model.generate(input_ids, num_beams=beams, ...)`` on a cascade model runs on stock's own path
    (dense attention, transformers' cache: nothing shared, no saving), or None where it runs the cascade;
    None for a model that is not a cascade model. What :func:`hf_cascade.generation.stock_path_reason`
    says, given the rows as generate expands them."""
    if getattr(model.config, "_attn_implementation", None) != "cascade" or model.config.is_encoder_decoder:
        return None
    n = max(beams, num_return_sequences)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    return generation.stock_path_reason(
        model, hf_cascade.CascadeConfig(backend=backend),
        GenerationConfig(num_beams=beams, num_return_sequences=num_return_sequences),
        input_ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0))


def generate_once(model, input_ids, beams: int, new_tokens: int, backend: str = "auto", desc: str = "",
                  progress: bool = True) -> dict:
    """One ``generate`` call: its tokens, KV bytes, rows in its first forward call and wall time; on a cascade
    model also ``stock_path``: None where the call ran the cascade (then ``stats``: its CacheStats as a dict),
    else why it ran on stock's own path."""
    rows = []

    def count_rows(module, args, kwargs):      # batch rows of every forward call; the first one is the prefill
        x = kwargs.get("input_ids")
        x = kwargs.get("inputs_embeds") if x is None else x
        rows.append((args[0] if x is None else x).shape[0])

    hook = model.register_forward_pre_hook(count_rows, with_kwargs=True)
    prefill_hook = hf_cascade.generation.register_prefill_hook(pre=lambda model, kwargs: count_rows(model, (), kwargs))
    extra = {}
    if model.config._attn_implementation == "cascade":
        extra["hf_cascade_config"] = hf_cascade.CascadeConfig(backend=backend)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    bar = tqdm(total=new_tokens, desc=desc, unit="tok", leave=False, disable=not progress, file=sys.stderr)
    try:
        with torch.inference_mode():
            _sync(input_ids.device)
            start = time.perf_counter()
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), num_beams=beams,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=pad, stopping_criteria=StoppingCriteriaList([ProgressBar(bar)]),
                                 return_dict_in_generate=True, **extra)
            _sync(input_ids.device)
            seconds = time.perf_counter() - start
    finally:
        hook.remove()
        prefill_hook.remove()
        bar.close()
    cache = getattr(out, "cache", None)       # transformers >= 5.24; older ones call it past_key_values
    if cache is None:
        cache = out.past_key_values
    result = dict(sequences=out.sequences.cpu(), kv_bytes=kv_bytes(cache), rows_prefilled=rows[0], seconds=seconds)
    if isinstance(cache, hf_cascade.CascadeCache):
        result["stock_path"] = None
        result["stats"] = vars(cache.stats())
        cache.reset()
    elif "hf_cascade_config" in extra:       # a cascade model whose call went to stock's path
        result["stock_path"] = (stock_path(model, input_ids, beams, backend=backend)
                                or "generate returned no CascadeCache (reason unknown)")
    return result


def run_comparison(model_path: str | None = None, prompt_len: int = 1024, beams: int = 8, new_tokens: int = 16,
                   batch: int = 1, device: str = "cpu", dtype: str = "float32", backend: str = "auto",
                   seed: int = 0, repeats: int = 1, warmup: int = 0, progress: bool = True) -> dict:
    """Stock sdpa vs cascade on the same weights and prompts. With ``repeats`` > 1 the runs alternate
    (stock, cascade, stock, ...) and the times are medians; ``warmup`` untimed runs of each come first."""
    stock = build_model("sdpa", model_path, dtype, device, seed)
    cascade = build_model("cascade", model_path, dtype, device, seed)
    cascade.load_state_dict(stock.state_dict())     # same weights, whatever the random init did
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, stock.config.vocab_size, (batch, prompt_len), generator=gen).to(device)
    runs = {"stock": [], "cascade": []}
    for i in range(warmup + repeats):
        for name, model in (("stock", stock), ("cascade", cascade)):
            label = f"{name} {'warm-up' if i < warmup else f'run {i - warmup + 1}'}"
            r = generate_once(model, input_ids, beams, new_tokens, backend, desc=label, progress=progress)
            if i >= warmup:
                runs[name].append(r)
    s, c = runs["stock"][0], runs["cascade"][0]
    t_stock = statistics.median(r["seconds"] for r in runs["stock"])
    t_cascade = statistics.median(r["seconds"] for r in runs["cascade"])
    identical = all(torch.equal(r["sequences"], s["sequences"]) for r in runs["stock"] + runs["cascade"])
    return dict(
        model=model_path or "built-in random Llama (8 layers, hidden 512, 8 heads, 2 KV heads)",
        prompt_len=prompt_len, beams=beams, new_tokens=new_tokens, batch=batch, device=str(device), dtype=dtype,
        backend=backend, seed=seed, repeats=repeats, warmup=warmup,
        tokens_identical=identical,
        kv_bytes_stock=s["kv_bytes"], kv_bytes_cascade=c["kv_bytes"], kv_ratio=c["kv_bytes"] / s["kv_bytes"],
        rows_prefilled_stock=s["rows_prefilled"], rows_prefilled_cascade=c["rows_prefilled"],
        seconds_stock=t_stock, seconds_cascade=t_cascade, time_ratio=t_cascade / t_stock,
        seconds_stock_all=[r["seconds"] for r in runs["stock"]],
        seconds_cascade_all=[r["seconds"] for r in runs["cascade"]],
        cascade_path="stock" if c["stock_path"] else "cascade", stock_path_reason=c["stock_path"],
        cascade_stats=c.get("stats"))


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def print_table(result: dict, console: Console | None = None) -> None:
    r = result
    table = Table(title="beam search: stock sdpa vs cascade",
                  caption=f"{r['model']}\nbatch {r['batch']}, prompt {r['prompt_len']}, {r['beams']} beams, "
                          f"{r['new_tokens']} new tokens, {r['dtype']} on {r['device']}, backend {r['backend']}\n"
                          "KV bytes: stock's final DynamicCache, cascade's peak in use")
    for col, justify in (("", "left"), ("stock sdpa", "right"), ("cascade", "right"), ("cascade / stock", "right")):
        table.add_column(col, justify=justify)
    same = "[green]yes[/]" if r["tokens_identical"] else "[red]NO[/]"
    table.add_row("identical tokens", "", "", same)
    table.add_row("KV bytes", _mib(r["kv_bytes_stock"]), _mib(r["kv_bytes_cascade"]),
                  f"{r['kv_ratio']:.3f}")
    table.add_row("rows prefilled", str(r["rows_prefilled_stock"]), str(r["rows_prefilled_cascade"]),
                  f"{r['rows_prefilled_cascade'] / r['rows_prefilled_stock']:.3f}")
    label = "wall time" + (f" (median of {r['repeats']})" if r["repeats"] > 1 else "")
    table.add_row(label, f"{r['seconds_stock']:.3f} s", f"{r['seconds_cascade']:.3f} s", f"{r['time_ratio']:.3f}")
    console = console or Console()
    console.print(table)
    line = stock_path_line(r)
    if line:
        console.print(line, highlight=False, markup=False, soft_wrap=True)     # one line, however wide


def stock_path_line(result: dict) -> str | None:
    """One line saying that the cascade call ran on stock's path, and why (None where it ran the cascade)."""
    reason = result.get("stock_path_reason")
    if not reason:
        return None
    hint = (" (raise --prompt-len, --beams or --batch to share more)" if "MIN_SHARED_TOKENS" in reason else "")
    return f"cascade ran on stock's own path (dense attention, no KV shared): {reason}{hint}"


GPU_BACKENDS = ("cuda", "flashinfer")
HALF_DTYPES = ("bfloat16", "float16")


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Refuse flags that cannot run here before anything is loaded (one line and exit 2, argparse's way)."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError):
        p.error(f"--device {args.device!r} is not a torch device; use cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            p.error(f"--device {args.device}: no CUDA GPU is visible to torch {torch.__version__}; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            p.error(f"--device {args.device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif device.type not in ("cpu", "mps", "xpu"):
        p.error(f"--device {args.device}: device type {device.type!r} is not supported here; use cpu or cuda")
    if args.backend in GPU_BACKENDS:
        if device.type != "cuda":
            p.error(f"--backend {args.backend} runs on CUDA only; use --device cuda, or --backend auto/reference")
        if args.dtype not in HALF_DTYPES:
            p.error(f"--backend {args.backend} takes bfloat16/float16, not {args.dtype}; add --dtype bfloat16")
    if args.model is not None and not os.path.isdir(os.path.expanduser(args.model)):
        p.error(f"--model {args.model}: no such folder (a local checkpoint with config.json and weights)")
    if args.json not in (None, "-"):
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder):
            p.error(f"--json {args.json}: folder {folder} does not exist")
    return args


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    return _check(p, p.parse_args(argv))


def env_main(argv) -> int:
    """``python -m hf_cascade env [--json]``: versions, GPUs, each backend's availability with the reason."""
    args = build_env_parser().parse_args(argv)
    from . import diagnostics
    found = diagnostics.report()
    print(json.dumps(found, indent=2) if args.json else diagnostics.format_report(found))
    return 0


def write_json(result: dict, path: str) -> None:
    text = json.dumps(result, indent=2)
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text + "\n")


def main(argv=None) -> int:
    """Exit codes: 0 same tokens (also where the cascade call ran on stock's path: the report says why),
    1 the tokens differ, 2 bad flags (one line on stderr), 3 the run failed: for a reason the message names
    (unsupported model or backend, KV pool too small, checkpoint unreadable) in one line, otherwise with
    the traceback (Python's own exit code for an uncaught error, 1, would read as "the tokens differ")."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["env"]:
        return env_main(argv[1:])
    args = parse_args(argv)
    warmup = args.warmup if args.warmup is not None else int(torch.device(args.device).type == "cuda")
    try:
        result = run_comparison(args.model, args.prompt_len, args.beams, args.new_tokens, args.batch, args.device,
                                args.dtype, args.backend, args.seed, warmup=warmup)
    except (NotImplementedError, MemoryError, OSError) as err:      # errors that say what to do: no traceback
        print(f"{PROG}: error: {type(err).__name__}: {err}", file=sys.stderr)
        raise SystemExit(3) from None
    except Exception as err:                # a bug: keep the traceback for the report
        traceback.print_exc()
        print(f"{PROG}: error: the run failed ({type(err).__name__}); please report it with the command line and "
              f"the output of `{PROG} env`", file=sys.stderr)
        raise SystemExit(3) from None
    print_table(result, Console(stderr=args.json == "-"))     # keep stdout pure JSON with --json -
    if args.json:
        write_json(result, args.json)
    if not result["tokens_identical"]:
        raise SystemExit(1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
