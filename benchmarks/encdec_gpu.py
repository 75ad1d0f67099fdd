"""Encoder-decoder generate on a GPU: stock sdpa vs cascade, side by side (issue 11's H200 targets).

Random-weight models shaped like whisper-large-v3 (batch 16 x 5 beams, 30 s of audio = 1500 encoder
frames), bart-large-cnn (1024-token sources, batch 16 x 4 beams) and flan-t5-large (512-token sources,
batch 32 x 4 beams), bf16. Per model: one warm-up of each at the measured shape, then ``--rounds``
interleaved rounds (stock, cascade, stock, cascade, ...) of ``generate`` with 1 and with ``--new`` new
tokens (``min_new_tokens`` = ``max_new_tokens``); medians. Reported per side: the step
((t(new) - t(1)) / (new - 1)), the throughput (sequences x new tokens / t(new)), the attention K/V a
generate call held (stock: its EncoderDecoderCache; cascade: the cross K/V once per input plus the paged
self-attention cache), its cross-attention part alone, and peak memory allocated above the weights.
Targets: whisper cross-attention K/V <= 0.2x (the floor is 1/beams = 0.2 at 5 beams, plus the last pool
block's rounding of each input's 1500 frames: 1504 slots, 0.2005) and step <= 0.4x stock's; bart and
flan-t5 throughput >= 2.5x stock's. Ends with a table and the total seconds (also in the JSON).

    PYTHONPATH=. python benchmarks/encdec_gpu.py [--models whisper-large-v3,bart-large-cnn,flan-t5-large]
    python benchmarks/encdec_gpu.py --device cpu --dtype float32 --scale tiny --rounds 1   # a smoke test
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers as T

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import hf_cascade  # noqa: E402
from hf_cascade.encoder_decoder import CascadeEncoderDecoderCache  # noqa: E402
import harness  # noqa: E402

SHAPES = {   # (config kwargs, batch, beams, source length)
    "whisper-large-v3": (dict(d_model=1280, encoder_layers=32, decoder_layers=32, encoder_attention_heads=20,
                              decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120,
                              num_mel_bins=128, vocab_size=51866), 16, 5, 1500),
    "bart-large-cnn": (dict(d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
                            decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096,
                            vocab_size=50264), 16, 4, 1024),
    "flan-t5-large": (dict(d_model=1024, d_kv=64, num_heads=16, num_layers=24, num_decoder_layers=24, d_ff=2816,
                           feed_forward_proj="gated-gelu", vocab_size=32128), 32, 4, 512),
}
TARGETS = {"whisper-large-v3": dict(kv=0.2, step=0.4), "bart-large-cnn": dict(throughput=2.5),
           "flan-t5-large": dict(throughput=2.5)}


def _tiny(name, kw):
    """--scale tiny: the same families and generate paths at toy sizes (a smoke test that runs anywhere)."""
    small = dict(kw)
    for key in ("encoder_layers", "decoder_layers", "num_layers", "num_decoder_layers"):
        if key in small:
            small[key] = 2
    for key in ("d_model",):
        small[key] = 64
    for key in ("encoder_ffn_dim", "decoder_ffn_dim", "d_ff"):
        if key in small:
            small[key] = 128
    for key in ("encoder_attention_heads", "decoder_attention_heads", "num_heads"):
        if key in small:
            small[key] = 4
    if "d_kv" in small:
        small["d_kv"] = 16
    return small


def build(name, attn, dtype, device, scale):
    kw, batch, beams, source = SHAPES[name]
    kw = _tiny(name, kw) if scale == "tiny" else kw
    torch.manual_seed(0)
    with torch.device(device):
        if name.startswith("whisper"):
            config = T.WhisperConfig(**kw, max_source_positions=1500, max_target_positions=448, pad_token_id=50256,
                                     bos_token_id=50257, eos_token_id=50257, decoder_start_token_id=50258,
                                     suppress_tokens=[], begin_suppress_tokens=[])
            model = T.WhisperForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=dtype)
            g = model.generation_config          # the special tokens of the real checkpoints (v3 vocabulary)
            g.decoder_start_token_id, g.eos_token_id, g.pad_token_id = 50258, 50257, 50256
            g.lang_to_id, g.task_to_id = {"<|en|>": 50259}, {"transcribe": 50360, "translate": 50359}
            g.no_timestamps_token_id, g.prev_sot_token_id, g.is_multilingual = 50364, 50362, True
            g.max_initial_timestamp_index, g.suppress_tokens, g.begin_suppress_tokens = 50, [], []
        elif name.startswith("bart"):
            config = T.BartConfig(**kw, max_position_embeddings=1024, forced_bos_token_id=None,
                                  forced_eos_token_id=None)
            model = T.AutoModelForSeq2SeqLM.from_config(config, attn_implementation=attn, dtype=dtype)
        else:
            config = T.T5Config(**kw, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
            model = T.AutoModelForSeq2SeqLM.from_config(config, attn_implementation=attn, dtype=dtype)
    return model.eval(), batch, beams, source


def inputs(name, model, batch, source, device, dtype):
    g = torch.Generator().manual_seed(1)
    if name.startswith("whisper"):
        bins = model.config.num_mel_bins
        return dict(input_features=torch.randn(batch, bins, 3000, generator=g).to(device, dtype), language="en",
                    force_unique_generate_call=True)
    ids = torch.randint(5, 32000, (batch, source), generator=g)
    lengths = torch.randint(source // 2, source + 1, (batch,), generator=g)
    lengths[0] = source
    mask = (torch.arange(source)[None, :] < lengths[:, None]).long()   # right-padded sources of varied length
    return dict(input_ids=ids.masked_fill(mask == 0, 0).to(device), attention_mask=mask.to(device))


class KV:
    """The most attention K/V bytes a generate call's cache held (decoder forward hook): in all (``peak``)
    and its cross-attention part alone (``cross``: stock's k copies per input vs the cascade's one)."""

    def __init__(self, model):
        self.peak = self.cross = 0
        self.handle = model.get_decoder().register_forward_hook(self.hook, with_kwargs=True)

    @staticmethod
    def _dense(cache):
        return sum(l.keys.nbytes + l.values.nbytes for l in cache.layers
                   if isinstance(getattr(l, "keys", None), torch.Tensor) and l.keys.stride(0))

    def hook(self, module, args, kwargs, out):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, CascadeEncoderDecoderCache):
            own = cache.self_attention_cache
            own = own.stats().peak_kv_bytes_in_use if isinstance(own, hf_cascade.CascadeCache) else self._dense(own)
            cross = cache.cross_attention_cache.kv_bytes
        elif cache is not None and hasattr(cache, "cross_attention_cache"):
            own, cross = self._dense(cache.self_attention_cache), self._dense(cache.cross_attention_cache)
        else:
            return
        self.peak, self.cross = max(self.peak, cross + own), max(self.cross, cross)


def timed(model, kwargs, device):
    with torch.no_grad():
        return harness.timed(lambda: model.generate(**kwargs), device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(SHAPES))
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--scale", default="real", choices=["real", "tiny"])
    p.add_argument("--output", help="JSON path (default: benchmarks/results/<sm90|cpu>/encdec_gpu.json)")
    args = p.parse_args(argv)
    args.output = args.output or str(harness.results_path("encdec_gpu"))
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    rows = []
    for name in args.models.split(","):
        stock, batch, beams, source = build(name, "sdpa", dtype, args.device, args.scale)
        cascade, *_ = build(name, "cascade", dtype, args.device, args.scale)
        cascade.load_state_dict(stock.state_dict())
        base = dict(inputs(name, stock, batch, source, args.device, dtype), num_beams=beams)
        long = dict(base, max_new_tokens=args.new, min_new_tokens=args.new)
        short = dict(base, max_new_tokens=1, min_new_tokens=1)
        times = {side: {"long": [], "short": []} for side in ("stock", "cascade")}
        kv, cross_kv, peak, tokens = {}, {}, {}, {}
        for model in (stock, cascade):                # warm-up at the measured shape
            timed(model, long, args.device)
        models = {"stock": stock, "cascade": cascade}

        def one_round(side, _):
            model = models[side]
            meter = KV(model)
            if args.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            seconds, out = timed(model, long, args.device)
            meter.handle.remove()
            times[side]["long"].append(seconds)
            times[side]["short"].append(timed(model, short, args.device)[0])
            kv[side], cross_kv[side] = meter.peak, meter.cross
            tokens[side] = out
            if args.device.startswith("cuda"):
                peak[side] = torch.cuda.max_memory_allocated() - before

        harness.interleave(list(models), one_round, args.rounds)
        row = dict(model=name, batch=batch, beams=beams, source=source, new_tokens=args.new, dtype=args.dtype,
                   same_tokens=bool(tokens["stock"].shape == tokens["cascade"].shape
                                    and torch.equal(tokens["stock"], tokens["cascade"])))
        for side in ("stock", "cascade"):
            t_long, t_short = harness.median(times[side]["long"]), harness.median(times[side]["short"])
            row[f"{side}_step_ms"] = round(1000 * (t_long - t_short) / max(args.new - 1, 1), 2)
            row[f"{side}_throughput_tok_s"] = round(batch * args.new / t_long, 1)
            row[f"{side}_kv_gib"] = round(kv[side] / 2**30, 3)
            row[f"{side}_cross_kv_gib"] = round(cross_kv[side] / 2**30, 3)
            row[f"{side}_peak_above_weights_gib"] = round(peak.get(side, 0) / 2**30, 3)
        # the K/V target is on the cross-attention K/V; its floor is 1/beams (one copy per input instead
        # of one per beam), plus the pool's block rounding of each input's encoder tokens
        row["cross_kv_ratio"] = round(cross_kv["cascade"] / max(cross_kv["stock"], 1), 4)
        row["cross_kv_floor"] = round(1 / beams, 4)
        row["kv_ratio"] = round(kv["cascade"] / max(kv["stock"], 1), 4)          # self + cross
        row["step_ratio"] = round(row["cascade_step_ms"] / max(row["stock_step_ms"], 1e-9), 3)
        row["throughput_ratio"] = round(row["cascade_throughput_tok_s"] / max(row["stock_throughput_tok_s"], 1e-9), 3)
        target = TARGETS[name]
        ratio = {"kv": cross_kv["cascade"] / max(cross_kv["stock"], 1), "step": row["step_ratio"],
                 "throughput": row["throughput_ratio"]}
        row["targets"] = {k: dict(limit=v, value=round(ratio[k], 4),
                                  met=bool(ratio[k] >= v if k == "throughput" else ratio[k] <= v))
                          for k, v in target.items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del stock, cascade, models
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    record = harness.run_record(__file__, argv)
    result = dict(record, git_commit=record["commit"],          # git_commit: the field's name before the harness
                  device=torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
                  total_s=round(time.perf_counter() - started, 1), rows=rows)
    harness.write_json(args.output, result)
    print(f"| model | batch x beams | step ms stock / cascade | step ratio | throughput tok/s stock / cascade | "
          f"throughput ratio | cross K/V GiB stock / cascade | cross K/V ratio | same tokens | targets |\n"
          f"|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        met = ", ".join(f"{k} {t['value']} ({'<=' if k != 'throughput' else '>='} {t['limit']}: "
                        f"{'met' if t['met'] else 'not met'})" for k, t in r["targets"].items())
        print(f"| {r['model']} | {r['batch']} x {r['beams']} | {r['stock_step_ms']} / {r['cascade_step_ms']} | "
              f"{r['step_ratio']} | {r['stock_throughput_tok_s']} / {r['cascade_throughput_tok_s']} | "
              f"{r['throughput_ratio']} | {r['stock_cross_kv_gib']} / {r['cascade_cross_kv_gib']} | "
              f"{r['cross_kv_ratio']} | {r['same_tokens']} | {met} |")
    print(f"total {result['total_s']} s; JSON: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
