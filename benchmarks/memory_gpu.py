"""Where the KV pool's bytes live, on the GPU: memory="vmm" vs "grow" vs "static" vs stock DynamicCache.

A Llama-3.2-1B-shaped model with random weights (hidden 2048, 16 layers, 32 heads / 8 KV heads, head_dim 64,
intermediate 8192, vocab 128256), bf16, beam search whose length is not known in advance: eos is a token the
model produces at a random step of a short greedy preview, so beams end when they happen to reach it. Per run:

- peak reserved GPU memory: per forward, torch.cuda.max_memory_reserved() since the previous forward plus the
  bytes VMM pools hold mapped (torch does not see those), also shown over the memory reserved before the call;
  and the device's own view (mem_get_info) as a cross-check;
- the cascade's KV bytes in use (peak) and reserved (peak) from cache.stats();
- per-step time from CUDA events around each forward (pre/post hooks): prefill, median and max decode step,
  and "spikes" (steps over 2x the median); pool growth events (steps whose reserved KV bytes grew).

``static`` is sized for the worst case: every prompt stored once plus ``ceil(new/block)+2`` blocks per row.

    PYTHONPATH=. python benchmarks/memory_gpu.py [--scenarios 4096x8x256,1024x16x128x2] [--out ...]

A scenario is PROMPTxBEAMSxNEW[xBATCH].
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, LlamaConfig

import harness
import hf_cascade
from hf_cascade import memory

GIB, MIB = float(1 << 30), float(1 << 20)
SHAPE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
             intermediate_size=8192, vocab_size=128256, max_position_embeddings=32768, pad_token_id=0,
             bos_token_id=None, eos_token_id=None)
POLICIES = ("vmm", "grow", "static", "stock")


def parse_scenario(text: str) -> dict:
    parts = [int(x) for x in text.lower().split("x")]
    if len(parts) not in (3, 4):
        raise argparse.ArgumentTypeError(f"scenario {text!r} is not PROMPTxBEAMSxNEW[xBATCH]")
    return dict(prompt=parts[0], beams=parts[1], new=parts[2], batch=parts[3] if len(parts) == 4 else 1)


def static_bytes(sc: dict, block_size: int, dtype: torch.dtype) -> int:
    """Worst case of the cascade pool: prompts once, each row's own tail, one block of slack per row for
    copy-on-write."""
    blocks = sc["batch"] * math.ceil(sc["prompt"] / block_size) + \
        sc["batch"] * sc["beams"] * (math.ceil(sc["new"] / block_size) + 2)
    per_block = 2 * block_size * SHAPE["num_key_value_heads"] * SHAPE["head_dim"] * dtype.itemsize
    return blocks * per_block * SHAPE["num_hidden_layers"]


class StepProbe(harness.ForwardTimer):
    """CUDA events per forward (the harness's ForwardTimer), and memory read after each forward."""

    def __init__(self, model, device):
        super().__init__(model)
        self.device, self.samples = device, []

    def after_forward(self, kwargs, output):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        sample = dict(torch_peak=torch.cuda.max_memory_reserved(self.device),
                      vmm=memory.vmm_mapped_bytes(self.device),
                      free=torch.cuda.mem_get_info(self.device)[0])
        if isinstance(cache, hf_cascade.CascadeCache):
            st = cache.stats()
            sample.update(kv_in_use=st.kv_bytes_in_use, kv_peak=st.peak_kv_bytes_in_use,
                          kv_reserved=st.kv_bytes_reserved)
            stores = [l.storage for l in cache.layers if l.storage is not None]
            sample.update(maps_on_step=sum(getattr(x, "maps_on_step", 0) for x in stores),
                          maps_ahead=sum(getattr(x, "maps_ahead", 0) for x in stores))
        elif cache is not None and getattr(cache, "layers", None):
            kv = sum(l.keys.nbytes + l.values.nbytes for l in cache.layers if getattr(l, "keys", None) is not None)
            sample.update(kv_in_use=kv, kv_peak=kv, kv_reserved=kv)
        self.samples.append(sample)
        torch.cuda.reset_peak_memory_stats(self.device)     # the next sample's torch peak is that step's own


def run_one(model, policy: str, sc: dict, ids, mask, eos: int, args) -> dict:
    device = ids.device
    kw = dict(input_ids=ids, attention_mask=mask, num_beams=sc["beams"], max_new_tokens=sc["new"], pad_token_id=0,
              eos_token_id=eos, early_stopping=False)
    if policy == "stock":
        model.set_attn_implementation("sdpa")
    else:
        model.set_attn_implementation("cascade")
        cap = static_bytes(sc, args.block_size, model.dtype) if policy == "static" else None
        # transformers' loop: the StepProbe reads memory after each forward (the whole step's replays call none);
        # unfused: stock's runs share the model (fusing it would change their products and move its weights)
        kw["hf_cascade_config"] = hf_cascade.CascadeConfig(memory=policy, max_kv_bytes=cap, backend=args.backend,
                                                           block_size=args.block_size, fuse_projections=False)
        kw.update(harness.transformers_loop())
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base_reserved = torch.cuda.memory_reserved(device)
    base_free, total = torch.cuda.mem_get_info(device)
    torch.cuda.reset_peak_memory_stats(device)
    probe = StepProbe(model, device)
    error, seq = None, None
    t0 = time.perf_counter()
    try:
        seq = model.generate(**kw)
    except MemoryError as err:
        error = str(err)
    finally:
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        probe.remove()
        model.set_attn_implementation("sdpa")
    times = probe.times_ms()
    steps = times[1:]
    med = harness.median(steps) if steps else float("nan")
    samples = probe.samples or [dict(torch_peak=0, vmm=0, free=base_free)]
    peak = max(s["torch_peak"] + s["vmm"] for s in samples)
    reserved_kv = [s.get("kv_reserved", 0) for s in samples]
    # decode step i (forward i + 1): did the pool grow during it, and how (a mapping the step waited
    # for, or one started ahead in the background); the step times of those steps against the median
    grew = [b > a for a, b in zip(reserved_kv, reserved_kv[1:])]
    waited = [b.get("maps_on_step", 0) > a.get("maps_on_step", 0) for a, b in zip(samples, samples[1:])]
    ahead = [b.get("maps_ahead", 0) > a.get("maps_ahead", 0) for a, b in zip(samples, samples[1:])]
    growth_times = [t for t, g, w, a in zip(steps, grew, waited, ahead) if g or w or a]
    slowest = max(range(len(steps)), key=steps.__getitem__) if steps else None
    return dict(
        policy=policy, error=error, tokens=None if seq is None else seq.cpu(),
        new_tokens=None if seq is None else int(seq.shape[1] - ids.shape[1]), forwards=len(times),
        static_bytes=kw["hf_cascade_config"].max_kv_bytes if policy == "static" else None,
        peak_reserved_gib=peak / GIB, peak_over_base_gib=(peak - base_reserved) / GIB,
        device_peak_over_base_gib=(base_free - min(s["free"] for s in samples)) / GIB,
        vmm_peak_gib=max(s["vmm"] for s in samples) / GIB,
        kv_in_use_peak_mib=max(s.get("kv_peak", 0) for s in samples) / MIB,
        kv_reserved_peak_mib=max(reserved_kv) / MIB,
        growth_events=sum(grew),                      # decode steps in which the reserved KV bytes grew
        steps_with_waited_map=sum(waited), steps_with_map_ahead=sum(ahead),
        growth_step_max_ms=max(growth_times) if growth_times else None,
        growth_step_median_ms=harness.median(growth_times) if growth_times else None,
        slowest_step=None if slowest is None else dict(
            index=slowest, ms=steps[slowest], grew=grew[slowest], waited_map=waited[slowest],
            map_ahead=ahead[slowest]),
        prefill_ms=times[0] if times else float("nan"), step_median_ms=med,
        step_max_ms=max(steps) if steps else float("nan"),
        step_p99_ms=statistics.quantiles(steps, n=100, method="inclusive")[98] if len(steps) >= 2 else float("nan"),
        spikes=sum(t > 2 * med for t in steps), wall_s=wall, vmm_left_mapped=memory.vmm_mapped_bytes(device))


def pick_eos(model, ids, mask, sc, rng: torch.Generator) -> int:
    """A token the model produces at a random step of a short greedy preview (so beams end, but when is unknown)."""
    model.set_attn_implementation("sdpa")
    horizon = max(4, min(sc["new"] // 2, 64))
    out = model.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=horizon, pad_token_id=0,
                         do_sample=False)
    step = int(torch.randint(horizon // 4, horizon, (1,), generator=rng))
    return int(out[0, ids.shape[1] + step])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default="4096x8x256,1024x16x128x2",
                   help="comma-separated PROMPTxBEAMSxNEW[xBATCH] (default: %(default)s)")
    p.add_argument("--policies", default=",".join(POLICIES), help="subset of %(default)s")
    p.add_argument("--backend", default="auto", help="CascadeConfig.backend of the cascade runs")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-eos", action="store_true",
                   help="generate all NEW tokens (the pool still does not know the length in advance)")
    p.add_argument("--out", help="JSON path (default: benchmarks/results/<sm90|...>/memory_gpu.json)")
    args = p.parse_args(argv)
    args.out = args.out or str(harness.results_path("memory_gpu"))
    if not torch.cuda.is_available():
        print("memory_gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    scenarios = [parse_scenario(s) for s in args.scenarios.split(",") if s]
    policies = [x for x in args.policies.split(",") if x]
    if set(policies) - set(POLICIES):
        p.error(f"unknown policies {set(policies) - set(POLICIES)}; choose from {POLICIES}")
    console = Console(width=220)   # non-interactive runs default to 80 columns
    device = torch.device("cuda")
    vmm_reason = memory.vmm_unavailable_reason(device)
    if vmm_reason and "vmm" in policies:
        console.print(f"[yellow]memory='vmm' unavailable: {vmm_reason}; skipping it[/]")
        policies.remove("vmm")

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    with device:
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), attn_implementation="sdpa", dtype=dtype).eval()
    rng = torch.Generator().manual_seed(args.seed)

    # warm-up: kernels, cuBLAS, backend builds; no figures kept
    warm = dict(prompt=64, beams=2, new=4, batch=1)
    wids = torch.randint(3, SHAPE["vocab_size"], (1, 64), generator=rng).to(device)
    for policy in policies:
        run_one(model, policy, warm, wids, torch.ones_like(wids), None, args)

    results = []
    for sc in scenarios:
        ids = torch.randint(3, SHAPE["vocab_size"], (sc["batch"], sc["prompt"]), generator=rng).to(device)
        mask = torch.ones_like(ids)
        if sc["batch"] > 1:
            mask[1:, : sc["prompt"] // 4] = 0                     # later prompts left-padded by a quarter
            ids = ids.masked_fill(mask == 0, 0)
        eos = None if args.no_eos else pick_eos(model, ids, mask, sc, rng)
        for policy in policies:       # first-use costs of this shape (kernels, cuBLAS) off the measured runs
            run_one(model, policy, dict(sc, new=2), ids, mask, None, args)
        runs = []
        for policy in policies:
            console.print(f"{sc} eos={eos} memory={policy} ...")
            runs.append(run_one(model, policy, sc, ids, mask, eos, args))
        ref = next((r["tokens"] for r in runs if r["policy"] == "grow" and r["tokens"] is not None), None)
        stock = next((r["tokens"] for r in runs if r["policy"] == "stock" and r["tokens"] is not None), None)
        for r in runs:
            tok = r.pop("tokens")
            r["same_tokens_as_grow"] = None if tok is None or ref is None else bool(torch.equal(tok, ref))
            r["same_tokens_as_stock"] = None if tok is None or stock is None else bool(torch.equal(tok, stock))
        results.append(dict(scenario=sc, eos=eos, runs=runs))

    rows = []
    for res in results:
        sc = res["scenario"]
        name = f"{sc['batch']}x{sc['prompt']} k={sc['beams']} n<={sc['new']}"
        for r in res["runs"]:
            if r["error"]:
                rows.append((name, r["policy"], "[red]MemoryError[/]", *[""] * 15))
                continue
            rows.append((name, r["policy"], str(r["new_tokens"]), f"{r['peak_reserved_gib']:.2f}",
                         f"{r['peak_over_base_gib']:.2f}", f"{r['device_peak_over_base_gib']:.2f}",
                         f"{r['kv_in_use_peak_mib']:.0f}", f"{r['kv_reserved_peak_mib']:.0f}",
                         str(r["growth_events"]), str(r["steps_with_waited_map"]),
                         "" if r["growth_step_max_ms"] is None else f"{r['growth_step_max_ms']:.1f}",
                         f"{r['prefill_ms']:.0f}", f"{r['step_median_ms']:.1f}",
                         f"{r['step_max_ms']:.1f}", str(r["spikes"]), f"{r['wall_s']:.1f}",
                         str(r["same_tokens_as_grow"]), str(r["same_tokens_as_stock"])))
    harness.table(f"KV memory policies, Llama-3.2-1B shape, {args.dtype}, {torch.cuda.get_device_name(device)}",
                  ["scenario", "memory", "new tok", "peak GiB", "over base", "device", "KV used MiB", "KV resv MiB",
                   "grows", "waited", "grow step max", "prefill ms", "step med", "step max", "spikes", "wall s",
                   "= grow", "= stock"], rows, console, left=("scenario", "memory"))

    record = harness.run_record(__file__, argv)
    out = harness.write_json(args.out, dict(
        record, git_commit=record["commit"],                    # git_commit: the field's name before the harness
        device=torch.cuda.get_device_name(device), vmm_unavailable=vmm_reason, model_shape=SHAPE, dtype=args.dtype,
        backend=args.backend, block_size=args.block_size, results=results), indent=2)
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
