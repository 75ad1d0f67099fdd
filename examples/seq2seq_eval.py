"""Summarization-style evaluation of an encoder-decoder model with ``Seq2SeqTrainer(predict_with_generate=True)``,
on ``attn_implementation="cascade"`` and on stock ``"sdpa"``: the same predictions, a ROUGE score, time and the
attention KV each generate call held.

With network access it evaluates a Hub checkpoint (``--model``, default ``google/flan-t5-small``) on a few
built-in texts; without (the Hub is asked once with a 3 s timeout; ``HF_HUB_OFFLINE=1`` skips even that) a
built-in random BART-shaped model on synthetic token ids, so it runs anywhere::

    python examples/seq2seq_eval.py                       # compare stock and cascade, print a report
    torchrun --nproc-per-node 2 examples/seq2seq_eval.py --only cascade --out preds.json   # data parallel (gloo)

Under ``torchrun`` the Trainer splits the evaluation set over the processes and gathers the predictions;
``--out`` writes them (from rank 0) so they can be compared with a one-process run (gloo on the CPU, NCCL on
GPUs; ``--device cpu`` forces the CPU). ``--shape bart-large-cnn`` makes the offline fallback a random model
of bart-large-cnn's shape (12+12 layers, width 1024) and ``--source-len`` sets the longest random source;
``benchmarks/encdec_dp_gpu.py`` runs both for a two-GPU check.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from transformers import (AutoModelForSeq2SeqLM, AutoTokenizer, BartConfig, Seq2SeqTrainer,
                          Seq2SeqTrainingArguments)

import hf_cascade
import hub_check          # examples/hub_check.py: no waiting on the Hub's retries where it does not answer
from hf_cascade.encoder_decoder import CascadeEncoderDecoderCache

IGNORE = -100
TEXTS = [
    "The city council approved a plan on Tuesday to turn the old rail yard into a park with playing fields, "
    "a community garden and a bicycle path that links the river to the market district.",
    "Researchers found that bees exposed to a common pesticide foraged less and returned to the hive more slowly, "
    "which they say could explain part of the decline of wild colonies in farming regions.",
    "The company said its quarterly profit fell by a fifth as shipping costs rose, but it expects sales to recover "
    "in the second half of the year once new factories in the south begin production.",
    "After three days of heavy rain the river rose above its banks, flooding low streets and forcing the closure "
    "of two bridges; officials said the water should recede by the weekend.",
] * 2


# ---- model and data ------------------------------------------------------------------------------------
def tiny_bart_config(vocab_size=512):
    """A small random BART (the offline fallback): 2+2 layers, width 64."""
    return BartConfig(vocab_size=vocab_size, d_model=64, encoder_layers=2, decoder_layers=2,
                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                      max_position_embeddings=256, forced_bos_token_id=None, forced_eos_token_id=None)


def bart_large_cnn_config():
    """The shape of facebook/bart-large-cnn (12+12 layers, width 1024, 16 heads, 1024 positions), random weights."""
    return BartConfig(vocab_size=50264, d_model=1024, encoder_layers=12, decoder_layers=12,
                      encoder_attention_heads=16, decoder_attention_heads=16, encoder_ffn_dim=4096,
                      decoder_ffn_dim=4096, max_position_embeddings=1024, forced_bos_token_id=None,
                      forced_eos_token_id=None)


SHAPES = {"tiny": tiny_bart_config, "bart-large-cnn": bart_large_cnn_config}


def load_pair(model_id: str | None, dtype=torch.float32, shape: str = "tiny", device: str | None = None):
    """(stock, cascade, tokenizer or None, source name): the Hub model, or the built-in random BART
    (``shape``: "tiny" or "bart-large-cnn"; built on ``device`` when given, e.g. straight on the GPU)."""
    if model_id:
        try:
            kw = hub_check.from_pretrained_kwargs(model_id)
            tokenizer = AutoTokenizer.from_pretrained(model_id, **kw)
            stock = AutoModelForSeq2SeqLM.from_pretrained(model_id, attn_implementation="sdpa", dtype=dtype, **kw).eval()
            cascade = AutoModelForSeq2SeqLM.from_pretrained(model_id, attn_implementation="cascade", dtype=dtype,
                                                            **kw).eval()
            return stock, cascade, tokenizer, model_id
        except Exception as err:                     # no network, offline mode, ...
            print(f"Could not load {model_id!r} ({type(err).__name__}: {str(err).splitlines()[0][:160]})")
            print("-> falling back to a built-in random BART (2+2 layers, width 64, random weights, no tokenizer): "
                  "token ids instead of text.")
    torch.manual_seed(0)
    make = SHAPES[shape]
    with torch.device(device or "cpu"):
        # each model gets its own config object: from_config writes the attention choice into it
        stock = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="sdpa", dtype=dtype).eval()
        cascade = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="cascade", dtype=dtype).eval()
    cascade.load_state_dict(stock.state_dict())
    return stock, cascade, None, "built-in random BART" + ("" if shape == "tiny" else f" ({shape} shape)")


def make_dataset(tokenizer, vocab_size: int, n: int = 8, seed: int = 0, max_len: int = 120) -> list[dict]:
    """``{"input_ids", "labels"}`` examples: the built-in texts (summaries: their first clause), or random ids
    of varied lengths (so batches need padding)."""
    if tokenizer is not None:
        prefix = "summarize: " if "t5" in type(tokenizer).__name__.lower() else ""
        out = []
        for text in TEXTS[:n]:
            out.append({"input_ids": tokenizer(prefix + text)["input_ids"],
                        "labels": tokenizer(text.split(",")[0])["input_ids"]})
        return out
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min(20, max_len), max_len, (1,), generator=g)) if max_len > 1 else 1
        out.append({"input_ids": torch.randint(4, vocab_size, (length,), generator=g).tolist(),
                    "labels": torch.randint(4, vocab_size, (12,), generator=g).tolist()})
    return out


class Collator:
    """Right-pads sources (as these tokenizers do) with ``pad``, labels with -100."""

    def __init__(self, pad: int):
        self.pad = pad

    def __call__(self, features):
        def pad(rows, value):
            width = max(len(r) for r in rows)
            return torch.tensor([r + [value] * (width - len(r)) for r in rows])
        ids = pad([f["input_ids"] for f in features], self.pad)
        return {"input_ids": ids, "attention_mask": (ids != self.pad).long(),
                "labels": pad([f["labels"] for f in features], IGNORE)}


# ---- metric ---------------------------------------------------------------------------------------------
def _lcs(a, b) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge(predictions, references) -> dict:
    """ROUGE-1 and ROUGE-L F1 (in %) over token sequences (ids or words), averaged over examples."""
    def f1(overlap, p, r):
        return 0.0 if not overlap else 2 * overlap / (p + r)
    r1 = rl = 0.0
    for pred, ref in zip(predictions, references):
        common = sum(min(pred.count(t), ref.count(t)) for t in set(pred))
        r1 += f1(common, len(pred), len(ref))
        rl += f1(_lcs(pred, ref), len(pred), len(ref))
    n = max(len(predictions), 1)
    return {"rouge1": round(100 * r1 / n, 2), "rougeL": round(100 * rl / n, 2)}


def clean(rows, special) -> list[list[int]]:
    """Token rows without -100, pad and other special ids."""
    return [[int(t) for t in row if int(t) >= 0 and int(t) not in special] for row in rows]


# ---- KV accounting ----------------------------------------------------------------------------------------
class KVMeter:
    """Forward hook: per generate call (per cache), the most attention K/V bytes the cache held: stock's
    EncoderDecoderCache (self + cross, k copies per input) or ours (cross once per input + the paged self part)."""

    def __init__(self, model):
        self.bytes: dict[int, int] = {}
        self._keep = []
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    @staticmethod
    def _dense(cache) -> int:
        return sum(l.keys.nbytes + l.values.nbytes for l in cache.layers
                   if isinstance(getattr(l, "keys", None), torch.Tensor) and l.keys.stride(0))

    def _hook(self, module, args, kwargs, output):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None or not hasattr(cache, "cross_attention_cache"):
            return
        if isinstance(cache, CascadeEncoderDecoderCache):
            own = cache.self_attention_cache
            own = own.stats().peak_kv_bytes_in_use if isinstance(own, hf_cascade.CascadeCache) else self._dense(own)
            n = cache.cross_attention_cache.kv_bytes + own
        else:
            n = self._dense(cache.self_attention_cache) + self._dense(cache.cross_attention_cache)
        if id(cache) not in self.bytes:
            self._keep.append(cache)
        self.bytes[id(cache)] = max(self.bytes.get(id(cache), 0), n)

    def total(self) -> int:
        return sum(self.bytes.values())

    def remove(self):
        self.handle.remove()
        self._keep.clear()


# ---- evaluation -------------------------------------------------------------------------------------------
def evaluate(model, dataset, tokenizer=None, batch_size=4, num_beams=4, max_new_tokens=16, output_dir=None,
             device: str = "auto"):
    """``Seq2SeqTrainer.predict`` with beam search: (predictions as token lists, metrics dict). ``device``:
    "auto" (the GPU where there is one), "cpu" or "cuda"."""
    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    pad = model.config.pad_token_id
    special = {pad, model.config.eos_token_id, model.config.bos_token_id, model.config.decoder_start_token_id}
    with tempfile.TemporaryDirectory() as tmp:
        args = Seq2SeqTrainingArguments(
            output_dir=output_dir or tmp, per_device_eval_batch_size=batch_size, predict_with_generate=True,
            generation_num_beams=num_beams, report_to="none", use_cpu=cpu,
            dataloader_num_workers=0, disable_tqdm=True,
            ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 and cpu else None)
        trainer = Seq2SeqTrainer(model=model, args=args, data_collator=Collator(pad))
        meter = KVMeter(model)
        start = time.perf_counter()
        out = trainer.predict(dataset, max_new_tokens=max_new_tokens)
        if not cpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        meter.remove()
    preds = clean(out.predictions, special)
    refs = clean(out.label_ids, special)
    if tokenizer is not None:                      # ROUGE over words
        preds_m = [tokenizer.decode(p).split() for p in preds]
        refs_m = [tokenizer.decode(r).split() for r in refs]
    else:
        preds_m, refs_m = preds, refs
    metrics = {"loss": round(float(out.metrics["test_loss"]), 6), **rouge(preds_m, refs_m),
               "seconds": round(seconds, 2), "kv_mib": round(meter.total() / 2**20, 3)}
    return preds, metrics


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.environ.get("HF_CASCADE_SEQ2SEQ_MODEL", "google/flan-t5-small"),
                   help="Hub id or local path ('' for the built-in random BART)")
    p.add_argument("--examples", type=int, default=8)
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--shape", default="tiny", choices=list(SHAPES), help="shape of the offline random BART")
    p.add_argument("--source-len", type=int, default=120, help="longest random source (offline model)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--only", choices=["stock", "cascade"], help="evaluate one of the two (e.g. under torchrun)")
    p.add_argument("--out", help="write the predictions and metrics as JSON (rank 0)")
    args = p.parse_args(argv)
    cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    build_on = None if cpu else f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    stock, cascade, tokenizer, source = load_pair(args.model or None, getattr(torch, args.dtype), args.shape,
                                                  build_on)
    data = make_dataset(tokenizer, stock.config.vocab_size, args.examples, max_len=args.source_len)
    results = {}
    for name, model in (("stock", stock), ("cascade", cascade)):
        if args.only in (None, name):
            results[name] = evaluate(model, data, tokenizer, args.batch, args.beams, args.new, device=args.device)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"model: {source}; {len(data)} examples, {args.beams} beams, {args.new} new tokens")
        for name, (_, metrics) in results.items():
            print(f"{name:8s} {metrics}")
        if len(results) == 2:
            same = results["stock"][0] == results["cascade"][0]
            print(f"cascade predictions identical to sdpa's: {same}")
            ks, kc = results["stock"][1]["kv_mib"], results["cascade"][1]["kv_mib"]
            print(f"attention KV held, cascade / stock: {kc / ks:.3f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({**{k: {"predictions": v[0], "metrics": v[1]} for k, v in results.items()},
                           "world_size": int(os.environ.get("WORLD_SIZE", "1")), "device": "cpu" if cpu else "cuda",
                           "source": source}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
