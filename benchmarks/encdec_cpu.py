"""Encoder-decoder beam search on the CPU: stock sdpa vs cascade, side by side in one run.

Random-weight models shaped like whisper-base, t5-small and bart-base (float32, 1 torch thread, as
measured in reference/encoder_decoder.md: 2 threads thrash on the shared 2-core machine), batch 2,
8 beams, 64 new tokens (``min_new_tokens`` = ``max_new_tokens``, so every run decodes its full
length); Whisper through its own generate on 30 s of audio (1500 encoder frames), the text models on
512-token sources. Per model: a short warm-up of each, then ``--rounds`` interleaved rounds (stock,
cascade, stock, cascade, ...; default 1), medians of each side. Reported: CPU seconds of the generating thread,
wall seconds, peak RSS above the RSS at the start of generate (sampled every millisecond; the script re-executes
itself with MALLOC_MMAP_THRESHOLD_=65536 so freed tensors go back to the OS), and whether the tokens are the same.
Targets: whisper-base time <= 0.3x and peak <= 0.2x stock's (issue 11); t5-small and bart-base time <= 0.4x (issue 21;
0.45x in issue 11).

    python benchmarks/encdec_cpu.py [--models whisper-base,t5-small,bart-base] [--new 64] [--beams 8] [--rounds 1]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":        # before torch allocates anything
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402
import transformers as T  # noqa: E402
from transformers import AutoModelForSeq2SeqLM, WhisperForConditionalGeneration  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import harness  # noqa: E402
import hf_cascade  # noqa: E402,F401  registers "cascade"

SOURCE_LEN, BATCH = 512, 2
TARGETS = {"whisper-base": dict(time=0.3, peak=0.2), "t5-small": dict(time=0.4), "bart-base": dict(time=0.4)}


def _config(name):
    if name == "whisper-base":
        return T.WhisperConfig(vocab_size=51865, num_mel_bins=80, d_model=512, encoder_layers=6, decoder_layers=6,
                               encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048,
                               decoder_ffn_dim=2048, max_source_positions=1500, max_target_positions=448,
                               pad_token_id=50257, bos_token_id=50257, eos_token_id=50257,
                               decoder_start_token_id=50258, suppress_tokens=[], begin_suppress_tokens=[])
    if name == "t5-small":
        return T.T5Config(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
                          pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    if name == "bart-base":
        return T.BartConfig(vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6,
                            encoder_attention_heads=12, decoder_attention_heads=12, encoder_ffn_dim=3072,
                            decoder_ffn_dim=3072, max_position_embeddings=1024, forced_bos_token_id=None,
                            forced_eos_token_id=None)
    raise ValueError(name)


def build(name, attn):
    torch.manual_seed(0)
    if name.startswith("whisper"):
        model = WhisperForConditionalGeneration._from_config(_config(name), attn_implementation=attn).eval()
        g = model.generation_config          # the special tokens of the real checkpoints' generation config
        g.decoder_start_token_id, g.eos_token_id, g.pad_token_id = 50258, 50257, 50257
        g.lang_to_id, g.task_to_id = {"<|en|>": 50259}, {"transcribe": 50359, "translate": 50358}
        g.no_timestamps_token_id, g.prev_sot_token_id, g.is_multilingual = 50363, 50361, True
        g.max_initial_timestamp_index, g.suppress_tokens, g.begin_suppress_tokens = 50, [], []
        return model
    return AutoModelForSeq2SeqLM.from_config(_config(name), attn_implementation=attn).eval()


def inputs(name):
    g = torch.Generator().manual_seed(1)
    if name.startswith("whisper"):
        return dict(input_features=torch.randn(BATCH, 80, 3000, generator=g), language="en",
                    force_unique_generate_call=True)
    ids = torch.randint(5, 32000, (BATCH, SOURCE_LEN), generator=g)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(model, kwargs):
    """(tokens, thread CPU s, wall s, peak RSS above the start in bytes)."""
    start_rss, peak, stop = _rss(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cpu, wall = time.thread_time(), time.perf_counter()
    with torch.no_grad():
        out = model.generate(**kwargs)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    stop.set()
    sampler.join()
    return out, cpu, wall, max(peak[0], _rss()) - start_rss


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="whisper-base,t5-small,bart-base")
    p.add_argument("--beams", type=int, default=8)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds (stock, cascade, ...); medians")
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "cpu" / "encdec_cpu.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.models.split(","):
        stock, cascade = build(name, "sdpa"), build(name, "cascade")
        kwargs = dict(inputs(name), num_beams=args.beams, max_new_tokens=args.new, min_new_tokens=args.new)
        for model in (stock, cascade):     # warm-up: first-call costs out of the timed runs
            model.generate(**{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        models = {"stock": stock, "cascade": cascade}
        runs = harness.interleave(list(models), lambda side, _: measure(models[side], kwargs), args.rounds)
        s_out, c_out = runs["stock"][0][0], runs["cascade"][0][0]
        same = all(r[0].shape == s_out.shape and torch.equal(r[0], s_out) for r in runs["stock"] + runs["cascade"])
        s_cpu, s_wall, s_peak = (harness.median(r[i] for r in runs["stock"]) for i in (1, 2, 3))
        c_cpu, c_wall, c_peak = (harness.median(r[i] for r in runs["cascade"]) for i in (1, 2, 3))
        row = dict(model=name, batch=BATCH, beams=args.beams, new_tokens=args.new, rounds=args.rounds,
                   source=1500 if name.startswith("whisper") else SOURCE_LEN,
                   stock_cpu_s=round(s_cpu, 2), cascade_cpu_s=round(c_cpu, 2),
                   stock_wall_s=round(s_wall, 2), cascade_wall_s=round(c_wall, 2),
                   stock_peak_mib=round(s_peak / 2**20, 1), cascade_peak_mib=round(c_peak / 2**20, 1),
                   time_ratio=round(c_cpu / s_cpu, 3), peak_ratio=round(c_peak / max(s_peak, 1), 3),
                   # each round's cascade / stock, measured back to back: steadier under a varying load
                   time_ratio_rounds=[round(c[1] / s[1], 3) for s, c in zip(runs["stock"], runs["cascade"])],
                   same_tokens=bool(same),
                   stock_cpu_s_runs=[round(r[1], 2) for r in runs["stock"]],
                   cascade_cpu_s_runs=[round(r[1], 2) for r in runs["cascade"]])
        target = TARGETS.get(name, {})
        row["targets"] = {k: dict(limit=v, met=row[f"{k}_ratio"] <= v) for k, v in target.items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del stock, cascade, models
    record = harness.run_record(__file__, argv)
    # git_commit: the field's name before the harness
    harness.write_json(args.output, dict(record, git_commit=record["commit"], threads=1, dtype="float32", rows=rows))
    print(f"| model | batch x beams | new | stock CPU s | cascade CPU s | time ratio | stock peak MiB | "
          f"cascade peak MiB | peak ratio | same tokens |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['batch']} x {r['beams']} | {r['new_tokens']} | {r['stock_cpu_s']} | "
              f"{r['cascade_cpu_s']} | {r['time_ratio']} | {r['stock_peak_mib']} | {r['cascade_peak_mib']} | "
              f"{r['peak_ratio']} | {r['same_tokens']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
