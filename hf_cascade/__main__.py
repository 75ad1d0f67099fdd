"""``python -m hf_cascade`` (or ``hf-cascade``): the same beam search with stock sdpa and with cascade, side by side.

Builds a Llama-shaped model with random weights (or loads ``--model PATH``), runs ``generate(num_beams=...)`` on
seeded random prompts with each attention implementation, and reports whether the tokens match, the KV bytes each
kept, the rows each prefilled, the time per new token and the wall time. A first call of each reads its cache
(untimed); then ``--warmup`` untimed and ``--rounds`` timed rounds of plain calls, stock and cascade in turn; the
figures are medians over rounds, shown with their range. Time per new token is the wall time after the prefill's
forward returned, over the tokens that follow (:func:`timed_once`). On the CPU torch runs one thread unless
``OMP_NUM_THREADS`` or ``--threads`` says otherwise; on a GPU the default is a Llama-3.2-1B-shaped model in bf16 with a
4k prompt (the shape at which the prompt's KV matters; ``_cli.PROFILES``).
A cascade call where sharing would not pay runs on stock's own path
(:func:`hf_cascade.generation.stock_path_reason`); the report then says so, with the reason.
Exit codes: 0 same tokens, 1 the tokens differ, 2 bad flags, 3 the run failed.
``python -m hf_cascade env`` prints versions, GPUs and which kernel backends can run here, with the reason, as a
block to paste into a bug report. The flags are parsed by :mod:`hf_cascade._cli`, before torch is imported.
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
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

import hf_cascade
from hf_cascade import _cli, generation
from hf_cascade._cli import build_env_parser, build_parser

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


# The built-in random models: "small" (the CPU's: 8 layers, hidden 512) and "1b" (Llama-3.2-1B's shape, for a GPU)
SIZES = {
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=1408, vocab_size=32000, max_position_embeddings=4096),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=True),
}
SIZE_NAMES = {"small": "built-in random Llama (8 layers, hidden 512, 8 heads, 2 KV heads)",
              "1b": "built-in random Llama-3.2-1B shape (16 layers, hidden 2048, 32 heads, 8 KV heads)"}


def builtin_config(size: str = "small") -> LlamaConfig:
    return LlamaConfig(**SIZES[size], pad_token_id=0, bos_token_id=None, eos_token_id=None)


def build_model(attn_implementation: str, model_path: str | None = None, dtype: str = "float32",
                device: str = "cpu", seed: int = 0, size: str = "small"):
    """The built-in random model (weights fixed by ``seed``) or the checkpoint at ``model_path``, in eval mode."""
    torch.manual_seed(seed)
    kwargs = dict(attn_implementation=attn_implementation, dtype=DTYPES[dtype])
    if model_path is None:
        with torch.device(device):      # initialised where it runs: a 1B model's random init on the host takes long
            model = AutoModelForCausalLM.from_config(builtin_config(size), **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    return model.to(device).eval()


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


def _generate(model, input_ids, beams: int, new_tokens: int, backend: str, **kwargs):
    extra = {}
    if model.config._attn_implementation == "cascade":
        extra["hf_cascade_config"] = hf_cascade.CascadeConfig(backend=backend)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    with torch.inference_mode():
        return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), num_beams=beams,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=pad, **extra, **kwargs)


def generate_once(model, input_ids, beams: int, new_tokens: int, backend: str = "auto") -> dict:
    """One ``generate`` call that hands out its cache (``return_dict_in_generate=True``): its tokens, KV bytes, rows
    in its first forward call and wall time; on a cascade model also ``stock_path``: None where the call ran the
    cascade (then ``stats``: its CacheStats as a dict), else why it ran on stock's own path. Such a call keeps
    transformers' decode loop on a GPU (the whole step does not serve it): :func:`timed_once` times the default
    path."""
    rows = []

    def count_rows(module, args, kwargs):      # batch rows of every forward call; the first one is the prefill
        x = kwargs.get("input_ids")
        x = kwargs.get("inputs_embeds") if x is None else x
        rows.append((args[0] if x is None else x).shape[0])

    hook = model.register_forward_pre_hook(count_rows, with_kwargs=True)
    # (the cascade's once-per-prompt prefill runs the model's forward without its hooks: observed apart)
    prefill_hook = hf_cascade.generation.register_prefill_hook(pre=lambda m, kwargs: count_rows(m, (), kwargs))
    try:
        seconds, out = _timed(lambda: _generate(model, input_ids, beams, new_tokens, backend,
                                                return_dict_in_generate=True), input_ids.device)
    finally:
        hook.remove()
        prefill_hook.remove()
    cache = getattr(out, "cache", None)       # transformers >= 5.24; older ones call it past_key_values
    if cache is None:
        cache = out.past_key_values
    result = dict(sequences=out.sequences.cpu(), kv_bytes=kv_bytes(cache), rows_prefilled=rows[0], seconds=seconds)
    if isinstance(cache, hf_cascade.CascadeCache):
        result["stock_path"] = None
        result["stats"] = vars(cache.stats())
        cache.reset()
    elif model.config._attn_implementation == "cascade":       # a cascade model whose call went to stock's path
        result["stock_path"] = (stock_path(model, input_ids, beams, backend=backend)
                                or "generate returned no CascadeCache (reason unknown)")
    return result


def _timed(fn, device):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def timed_once(model, input_ids, beams: int, new_tokens: int, backend: str = "auto") -> dict:
    """One plain ``generate`` call (the path users get): its tokens, wall time and time per new token, i.e. the time
    after the prefill's forward returned, over the forwards that follow it (None for one token). Stock's prefill also
    gives the first token (``new_tokens - 1`` forwards follow); the cascade's once-per-prompt prefill does not
    (``new_tokens`` follow). A hook on a cascade model would change its path (hooks run once per chosen token, on
    transformers' loop), so the cascade's prefill is observed by ``register_prefill_hook`` instead."""
    done = []

    def prefill_done(*_):      # the first forward is the prefill; later ones are decode steps
        if not done:
            _sync(input_ids.device)
            done.append(time.perf_counter())

    cascade = stock_path(model, input_ids, beams, backend=backend) is None and \
        model.config._attn_implementation == "cascade"          # (a cascade model on stock's path: stock's forwards)
    hook = (hf_cascade.generation.register_prefill_hook(post=prefill_done) if cascade
            else model.register_forward_hook(prefill_done))
    try:
        _sync(input_ids.device)
        start = time.perf_counter()
        out = _generate(model, input_ids, beams, new_tokens, backend)
        _sync(input_ids.device)
        end = time.perf_counter()
    finally:
        hook.remove()
    following = new_tokens if cascade else new_tokens - 1
    per_token = (end - done[0]) / following if done and following > 0 else None
    return dict(sequences=out.cpu(), seconds=end - start, per_token=per_token)


def run_comparison(model_path: str | None = None, prompt_len: int = 1024, beams: int = 8, new_tokens: int = 16,
                   batch: int = 1, device: str = "cpu", dtype: str = "float32", backend: str = "auto",
                   seed: int = 0, repeats: int = 1, warmup: int = 0, progress: bool = True,
                   size: str = "small") -> dict:
    """Stock sdpa vs cascade on the same weights and prompts. A first call of each hands out its cache (KV bytes,
    rows prefilled, which path ran; untimed: it also warms up what is lazily set up), then ``warmup`` untimed rounds
    and ``repeats`` timed ones of plain calls (:func:`timed_once`); inside a round the calls alternate (stock,
    cascade), so that a host whose load drifts weighs on both alike, and the figures are medians over rounds."""
    stock = build_model("sdpa", model_path, dtype, device, seed, size)
    cascade = build_model("cascade", model_path, dtype, device, seed, size)
    cascade.load_state_dict(stock.state_dict())     # same weights, whatever the random init did
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, stock.config.vocab_size, (batch, prompt_len), generator=gen).to(device)
    models = {"stock": stock, "cascade": cascade}
    runs = {name: [] for name in models}
    with tqdm(total=(1 + warmup + repeats) * 2, desc="generate calls", unit="call", leave=False,
              disable=not progress, file=sys.stderr) as bar:
        first = {}
        for name, model in models.items():
            bar.set_postfix_str(f"{name}: KV bytes and rows")
            first[name] = generate_once(model, input_ids, beams, new_tokens, backend)
            bar.update(1)
        for i in range(warmup + repeats):
            for name, model in models.items():
                bar.set_postfix_str(f"{'warm-up' if i < warmup else f'round {i - warmup + 1}'}: {name}")
                r = timed_once(model, input_ids, beams, new_tokens, backend)
                if i >= warmup:
                    runs[name].append(r)
                bar.update(1)
    s, c = first["stock"], first["cascade"]
    wall = {name: [r["seconds"] for r in rs] for name, rs in runs.items()}
    step = {name: [r["per_token"] for r in rs if r["per_token"] is not None] for name, rs in runs.items()}
    med = {name: statistics.median(v) for name, v in wall.items()}
    step_med = {name: statistics.median(v) if v else None for name, v in step.items()}
    identical = all(torch.equal(r["sequences"], s["sequences"])
                    for r in [c, *runs["stock"], *runs["cascade"]])
    return dict(
        model=model_path or SIZE_NAMES[size],
        prompt_len=prompt_len, beams=beams, new_tokens=new_tokens, batch=batch, device=str(device), dtype=dtype,
        backend=backend, seed=seed, repeats=repeats, warmup=warmup, threads=torch.get_num_threads(),
        tokens_identical=identical, token_agreement=_agreement(s["sequences"], c["sequences"], prompt_len),
        kv_bytes_stock=s["kv_bytes"], kv_bytes_cascade=c["kv_bytes"], kv_ratio=c["kv_bytes"] / s["kv_bytes"],
        rows_prefilled_stock=s["rows_prefilled"], rows_prefilled_cascade=c["rows_prefilled"],
        seconds_stock=med["stock"], seconds_cascade=med["cascade"], time_ratio=med["cascade"] / med["stock"],
        seconds_stock_all=wall["stock"], seconds_cascade_all=wall["cascade"],
        ms_per_token_stock=_ms(step_med["stock"]), ms_per_token_cascade=_ms(step_med["cascade"]),
        step_ratio=step_med["cascade"] / step_med["stock"] if step_med["stock"] else None,
        ms_per_token_stock_all=[_ms(x) for x in step["stock"]],
        ms_per_token_cascade_all=[_ms(x) for x in step["cascade"]],
        cascade_path="stock" if c["stock_path"] else "cascade", stock_path_reason=c["stock_path"],
        cascade_stats=c.get("stats"))


def _agreement(a: torch.Tensor, b: torch.Tensor, prompt_len: int) -> float:
    """The fraction of new-token positions where two calls' sequences hold the same token."""
    a, b = a[:, prompt_len:], b[:, prompt_len:]
    return float((a == b).float().mean()) if a.shape == b.shape and a.numel() else float(a.shape == b.shape)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def print_table(result: dict, console: Console | None = None) -> None:
    r = result
    table = Table(title="beam search: stock sdpa vs cascade",
                  caption=f"{r['model']}\nbatch {r['batch']}, prompt {r['prompt_len']}, {r['beams']} beams, "
                          f"{r['new_tokens']} new tokens, {r['dtype']} on {r['device']}"
                          f"{_threads(r)}"
                          f", backend {r['backend']}, {r.get('warmup', 0)} warm-up round(s)\n"
                          "KV bytes: stock's final DynamicCache, cascade's peak in use")
    for col, justify in (("", "left"), ("stock sdpa", "right"), ("cascade", "right"), ("cascade / stock", "right")):
        table.add_column(col, justify=justify)
    same = "[green]yes[/]" if r["tokens_identical"] else "[red]NO[/]"
    table.add_row("identical tokens", "", "", same)
    table.add_row("KV bytes", _mib(r["kv_bytes_stock"]), _mib(r["kv_bytes_cascade"]),
                  f"{r['kv_ratio']:.3f}")
    table.add_row("rows prefilled", str(r["rows_prefilled_stock"]), str(r["rows_prefilled_cascade"]),
                  f"{r['rows_prefilled_cascade'] / r['rows_prefilled_stock']:.3f}")
    rounds = f"median of {r['repeats']}, min-max" if r["repeats"] > 1 else "1 round"
    if r.get("ms_per_token_stock") is not None:
        table.add_row(f"time per new token ({rounds})", _spread(r["ms_per_token_stock_all"], "ms"),
                      _spread(r["ms_per_token_cascade_all"], "ms"),
                      f"{r['step_ratio']:.3f}" if r["step_ratio"] is not None else "-")
    table.add_row(f"wall time, {r['new_tokens']} tokens ({rounds})",
                  _spread(r.get("seconds_stock_all", [r["seconds_stock"]]), "s"),
                  _spread(r.get("seconds_cascade_all", [r["seconds_cascade"]]), "s"), f"{r['time_ratio']:.3f}")
    console = console or Console()
    console.print(table)
    if not r["tokens_identical"] and r["dtype"] in _cli.HALF_DTYPES:
        console.print(f"{r['dtype']}: each rounding step differs a little, so where two beams score within rounding "
                      f"the two may pick differently ({r.get('token_agreement', 0):.1%} of the new tokens agree); "
                      "--dtype float32 compares token for token", highlight=False, markup=False, soft_wrap=True)
    line = stock_path_line(r)
    if line:
        console.print(line, highlight=False, markup=False, soft_wrap=True)     # one line, however wide


def _threads(result: dict) -> str:
    n = result.get("threads")
    return "" if n is None else f" ({n} thread{'s' if n > 1 else ''})"


def _spread(values: list, unit: str) -> str:
    """The median of ``values`` with their range: "4.12 s (3.98-4.40)"; 3 significant digits or more."""
    if not values:
        return "-"
    fmt = (lambda x: f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}")
    med = fmt(statistics.median(values))
    return f"{med} {unit}" if len(values) == 1 else f"{med} {unit} ({fmt(min(values))}-{fmt(max(values))})"


def stock_path_line(result: dict) -> str | None:
    """One line saying that the cascade call ran on stock's path, and why (None where it ran the cascade)."""
    reason = result.get("stock_path_reason")
    if not reason:
        return None
    hint = (" (raise --prompt-len, --beams or --batch to share more)" if "MIN_SHARED_TOKENS" in reason else "")
    return f"cascade ran on stock's own path (dense attention, no KV shared): {reason}{hint}"


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Refuse flags that cannot run here before anything is loaded (one line and exit 2, argparse's way): first the
    checks that need no torch (:func:`hf_cascade._cli.check_without_torch`, already made once where the package was
    imported by the command itself), then those that ask torch; then fill the unset flags from the device's
    profile."""
    _cli.check_without_torch(p, args)
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
    _cli.resolve(args, device.type)
    if args.backend in _cli.GPU_BACKENDS:
        if device.type != "cuda":
            p.error(f"--backend {args.backend} runs on CUDA only; use --device cuda, or --backend auto/reference")
        if args.dtype not in _cli.HALF_DTYPES:
            p.error(f"--backend {args.backend} takes bfloat16/float16, not {args.dtype}; add --dtype bfloat16")
    return args


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    return _check(p, p.parse_args(argv))


def set_threads(threads: int | None) -> int:
    """torch's CPU threads: ``threads`` where given, else what ``OMP_NUM_THREADS`` says (torch read it), else 1."""
    if threads is not None:
        torch.set_num_threads(threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    return torch.get_num_threads()


def env_main(argv) -> int:
    """``python -m hf_cascade env [--json]``: versions, GPUs, each backend's availability with the reason, as a block
    to paste into a bug report."""
    args = build_env_parser().parse_args(argv)
    from . import diagnostics
    found = diagnostics.report()
    if args.json:
        print(json.dumps(found, indent=2))
    else:
        # fenced as Markdown, so that it pastes into an issue as it reads here
        print(f"Paste this block into a bug report, with the command that failed:\n\n"
              f"```text\n{diagnostics.format_report(found)}\n```")
    return 0


def write_json(result: dict, path: str) -> None:
    text = json.dumps(result, indent=2)
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text + "\n")


def main(argv=None) -> int:
    """Exit codes: 0 same tokens (also where the cascade call ran on stock's path: the report says why; in bfloat16 /
    float16, whatever rounding changed: the report gives the agreement), 1 the tokens differ (float32 / float64),
    2 bad flags (one line on stderr), 3 the run failed: for a reason the message names
    (unsupported model or backend, KV pool too small, checkpoint unreadable) in one line, otherwise with
    the traceback (Python's own exit code for an uncaught error, 1, would read as "the tokens differ")."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["env"]:
        return env_main(argv[1:])
    args = parse_args(argv)
    restore = torch.get_num_threads()
    if torch.device(args.device).type == "cpu":
        set_threads(args.threads)
    try:
        result = run_comparison(args.model, args.prompt_len, args.beams, args.new_tokens, args.batch, args.device,
                                args.dtype, args.backend, args.seed, repeats=args.rounds, warmup=args.warmup,
                                size=args.size)
    except (NotImplementedError, MemoryError, OSError) as err:      # errors that say what to do: no traceback
        print(f"{_cli.prog()}: error: {type(err).__name__}: {err}", file=sys.stderr)
        raise SystemExit(3) from None
    except Exception as err:                # a bug: keep the traceback for the report
        traceback.print_exc()
        print(f"{_cli.prog()}: error: the run failed ({type(err).__name__}); please report it with the command line "
              f"and the output of `{_cli.prog()} env`", file=sys.stderr)
        raise SystemExit(3) from None
    finally:
        torch.set_num_threads(restore)      # main() called in a process of the caller's (tests, notebooks)
    print_table(result, Console(stderr=args.json == "-"))     # keep stdout pure JSON with --json -
    if args.json:
        write_json(result, args.json)
    # bf16/fp16 promise stock's tokens only up to rounding: the report gives the agreement, and that is no failure
    if not result["tokens_identical"] and result["dtype"] not in _cli.HALF_DTYPES:
        raise SystemExit(1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
