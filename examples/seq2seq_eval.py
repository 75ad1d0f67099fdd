"""Summarization and translation evaluation of an encoder-decoder model with
``Seq2SeqTrainer(predict_with_generate=True)``, on ``attn_implementation="cascade"`` and on stock ``"sdpa"``:
the same predictions, the field's metric (ROUGE from ``rouge_score``, corpus BLEU from ``sacrebleu``: the
libraries ``evaluate`` wraps), time and the attention KV each generate call held.

``--task summarization`` (default): with network access a Hub checkpoint (``--model``, default
``google/flan-t5-small``) on a few built-in texts; without (the Hub is asked once with a 3 s timeout;
``HF_HUB_OFFLINE=1`` skips even that) a built-in random BART-shaped model on synthetic token ids.
``--task translation``: ``Helsinki-NLP/opus-mt-en-de`` on a few built-in English sentences with German
references, or offline a random Marian-shaped model (opus-mt-en-de's shape scaled down) on synthetic sentences
of different lengths (a third of them padded). Either runs anywhere::

    python examples/seq2seq_eval.py                       # compare stock and cascade, print a report
    python examples/seq2seq_eval.py --task translation    # the same for translation (BLEU)
    torchrun --nproc-per-node 2 examples/seq2seq_eval.py --only cascade --out preds.json   # data parallel (gloo)

Under ``torchrun`` the Trainer splits the evaluation set over the processes and gathers the predictions;
``--out`` writes them (from rank 0) so they can be compared with a one-process run (gloo on the CPU, NCCL on
GPUs; ``--device cpu`` forces the CPU). ``--shape bart-large-cnn`` (summarization) or ``--shape opus-mt-en-de``
(translation) makes the offline fallback a random model of that checkpoint's shape and ``--source-len`` sets
the longest random source; ``benchmarks/encdec_dp_gpu.py`` runs the summarization one for a two-GPU check.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import sacrebleu
import torch
from rouge_score import rouge_scorer
from transformers import (AutoModelForSeq2SeqLM, AutoTokenizer, BartConfig, MarianConfig, Seq2SeqTrainer,
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
# (English source, German reference) pairs for the online translation evaluation
SENTENCES = [
    ("The train to Berlin leaves at eight o'clock.", "Der Zug nach Berlin fährt um acht Uhr ab."),
    ("I would like a cup of coffee, please.", "Ich hätte gern eine Tasse Kaffee, bitte."),
    ("The museum is closed on Mondays.", "Das Museum ist montags geschlossen."),
    ("She has been learning German for two years.", "Sie lernt seit zwei Jahren Deutsch."),
    ("Where is the nearest pharmacy?", "Wo ist die nächste Apotheke?"),
    ("The weather will be sunny and warm tomorrow.", "Das Wetter wird morgen sonnig und warm."),
    ("We need to finish the report before Friday.", "Wir müssen den Bericht vor Freitag fertigstellen."),
    ("My brother lives in a small village near the sea.", "Mein Bruder wohnt in einem kleinen Dorf am Meer."),
]
TASKS = ("summarization", "translation")
DEFAULT_MODELS = {"summarization": os.environ.get("HF_CASCADE_SEQ2SEQ_MODEL", "google/flan-t5-small"),
                  "translation": "Helsinki-NLP/opus-mt-en-de"}
DEFAULT_SOURCE_LEN = {"summarization": 120, "translation": 48}


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


def marian_config(vocab_size=58101, d_model=512, layers=6, heads=8, ffn=2048, positions=512):
    """A Marian model of Helsinki-NLP/opus-mt-en-de's shape by default (6+6 layers, width 512, 8 heads, swish,
    sinusoidal positions, scaled embeddings; pad = decoder start = the last id, eos 0 and forced at the end)."""
    return MarianConfig(vocab_size=vocab_size, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
                        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
                        decoder_ffn_dim=ffn, max_position_embeddings=positions, activation_function="swish",
                        scale_embedding=True, pad_token_id=vocab_size - 1, decoder_start_token_id=vocab_size - 1,
                        bos_token_id=0, eos_token_id=0, forced_eos_token_id=0)


def tiny_marian_config(vocab_size=512):
    """opus-mt-en-de's shape scaled down for the CPU (the offline translation fallback): 2+2 layers, width 64."""
    return marian_config(vocab_size, d_model=64, layers=2, heads=4, ffn=128, positions=256)


# offline fallbacks per task: shape name -> config maker
SHAPES = {"summarization": {"tiny": tiny_bart_config, "bart-large-cnn": bart_large_cnn_config},
          "translation": {"tiny": tiny_marian_config, "opus-mt-en-de": marian_config}}
FALLBACK_NAMES = {"summarization": "BART", "translation": "Marian"}


def task_of_shape(shape: str) -> str | None:
    """The task a checkpoint shape belongs to (None for "tiny", which every task has)."""
    owners = [task for task, shapes in SHAPES.items() if shape in shapes]
    if not owners:
        raise ValueError(f"unknown shape {shape!r}: use one of {sorted({s for v in SHAPES.values() for s in v})}")
    return owners[0] if len(owners) == 1 else None


def load_pair(model_id: str | None, dtype=torch.float32, shape: str = "tiny", device: str | None = None,
              task: str = "summarization"):
    """(stock, cascade, tokenizer or None, source name): the Hub model, or the task's built-in random model
    (BART for summarization, Marian for translation; ``shape``: "tiny" or a checkpoint's shape from ``SHAPES``;
    built on ``device`` when given, e.g. straight on the GPU)."""
    if task not in SHAPES:
        raise ValueError(f"unknown task {task!r}: use one of {TASKS}")
    if shape not in SHAPES[task]:
        raise ValueError(f"shape {shape!r} is not a {task} shape: use one of {sorted(SHAPES[task])}")
    family = FALLBACK_NAMES[task]
    if model_id:
        try:
            kw = hub_check.from_pretrained_kwargs(model_id)
            tokenizer = AutoTokenizer.from_pretrained(model_id, **kw)
            stock = AutoModelForSeq2SeqLM.from_pretrained(model_id, attn_implementation="sdpa", dtype=dtype,
                                                          **kw).eval()
            cascade = AutoModelForSeq2SeqLM.from_pretrained(model_id, attn_implementation="cascade", dtype=dtype,
                                                            **kw).eval()
            return stock, cascade, tokenizer, model_id
        except Exception as err:                     # no network, offline mode, ...
            print(f"Could not load {model_id!r} ({type(err).__name__}: {str(err).splitlines()[0][:160]})")
            size = "2+2 layers, width 64" if shape == "tiny" else f"{shape} shape"
            print(f"-> falling back to a built-in random {family} ({size}, random weights, no tokenizer): "
                  "token ids instead of text.")
    torch.manual_seed(0)
    make = SHAPES[task][shape]
    with torch.device(device or "cpu"):
        # each model gets its own config object: from_config writes the attention choice into it
        stock = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="sdpa", dtype=dtype).eval()
        cascade = AutoModelForSeq2SeqLM.from_config(make(), attn_implementation="cascade", dtype=dtype).eval()
    cascade.load_state_dict(stock.state_dict())
    return stock, cascade, None, f"built-in random {family}" + ("" if shape == "tiny" else f" ({shape} shape)")


def make_dataset(tokenizer, vocab_size: int, n: int = 8, seed: int = 0, max_len: int = 120,
                 task: str = "summarization") -> list[dict]:
    """``{"input_ids", "labels"}`` examples. With a tokenizer: the built-in texts (summaries: their first
    clause) or English sentences with German references. Without: random ids of varied lengths (from 4 up; for
    translation below the last id, Marian's pad), so batches need padding; for translation two thirds of the
    sentences are nearly ``max_len`` long and every third is much shorter (padded in its batch), with targets
    about as long as their sources."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: use one of {TASKS}")
    t5 = tokenizer is not None and "t5" in type(tokenizer).__name__.lower()
    if tokenizer is not None and task == "summarization":
        prefix = "summarize: " if t5 else ""
        return [{"input_ids": tokenizer(prefix + text)["input_ids"],
                 "labels": tokenizer(text.split(",")[0])["input_ids"]} for text in TEXTS[:n]]
    if tokenizer is not None:
        prefix = "translate English to German: " if t5 else ""
        pairs = (SENTENCES * (n // len(SENTENCES) + 1))[:n]
        return [{"input_ids": tokenizer(prefix + source)["input_ids"],
                 "labels": tokenizer(text_target=target)["input_ids"]} for source, target in pairs]
    g = torch.Generator().manual_seed(seed)
    out = []
    if task == "summarization":
        for _ in range(n):
            length = int(torch.randint(min(20, max_len), max_len, (1,), generator=g)) if max_len > 1 else 1
            out.append({"input_ids": torch.randint(4, vocab_size, (length,), generator=g).tolist(),
                        "labels": torch.randint(4, vocab_size, (12,), generator=g).tolist()})
        return out

    def ids(length):
        return torch.randint(4, vocab_size - 1, (max(length, 1),), generator=g).tolist()

    def between(low, high):
        low, high = max(1, min(low, high)), max(1, high)
        return int(torch.randint(low, high + 1, (1,), generator=g))

    for i in range(n):
        length = between(max_len // 4, max_len // 2) if i % 3 == 2 else between(max_len * 7 // 8, max_len)
        out.append({"input_ids": ids(length), "labels": ids(between(length * 3 // 4, length * 5 // 4))})
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


# ---- metrics ----------------------------------------------------------------------------------------------
def _as_text(sequences) -> tuple[list[str], bool]:
    """(texts, whether they were token ids): token-id rows become space-separated numbers, one word per id."""
    rows = list(sequences)
    ids = any(not isinstance(r, str) for r in rows)
    return ([" ".join(str(int(t)) for t in r) if not isinstance(r, str) else r for r in rows], ids)


def rouge(predictions, references) -> dict:
    """ROUGE-1, ROUGE-2 and ROUGE-L F1 (in %) from ``rouge_score`` (what ``evaluate.load("rouge")`` runs:
    no stemmer, its lower-casing word tokenizer), averaged over examples (``use_aggregator=False``, then the
    mean: deterministic, unlike the bootstrap aggregate). Texts, or token-id rows (each id a word)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references: pass one each")
    types = ("rouge1", "rouge2", "rougeL")
    scorer = rouge_scorer.RougeScorer(list(types), use_stemmer=False)
    preds, _ = _as_text(predictions)
    refs, _ = _as_text(references)
    sums = dict.fromkeys(types, 0.0)
    for pred, ref in zip(preds, refs):
        scores = scorer.score(ref, pred)          # rouge_score takes (target, prediction)
        for name in types:
            sums[name] += scores[name].fmeasure
    n = max(len(preds), 1)
    return {name: round(100 * total / n, 2) for name, total in sums.items()}


def bleu(predictions, references) -> dict:
    """Corpus BLEU (0-100) from ``sacrebleu`` with one reference per prediction (what
    ``evaluate.load("sacrebleu")`` runs). Texts use sacrebleu's default "13a" tokenizer; token-id rows are
    scored id by id (tokenizer "none")."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references: pass one each")
    preds, pred_ids = _as_text(predictions)
    refs, ref_ids = _as_text(references)
    score = sacrebleu.corpus_bleu(preds, [refs], tokenize="none" if pred_ids or ref_ids else "13a")
    return {"bleu": round(score.score, 2)}


METRICS = {"summarization": rouge, "translation": bleu}


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
class KeepMaxLength(Seq2SeqTrainer):
    """Seq2SeqTrainer, except that the model's ``generation_config.max_length`` is as it was after each batch:
    Seq2SeqTrainer writes its default (20) there after a batch, and the next batch, given ``max_new_tokens``, warns
    that both are set."""

    def prediction_step(self, *args, **kwargs):
        max_length = self.model.generation_config.max_length
        try:
            return super().prediction_step(*args, **kwargs)
        finally:
            self.model.generation_config.max_length = max_length


def evaluate(model, dataset, tokenizer=None, batch_size=4, num_beams=4, max_new_tokens=16, output_dir=None,
             device: str = "auto", task: str = "summarization"):
    """``Seq2SeqTrainer.predict`` with beam search: (predictions as token lists, metrics dict with the task's
    metric: ROUGE for summarization, BLEU for translation; over decoded text with a tokenizer, over token ids
    without). ``device``: "auto" (the GPU where there is one), "cpu" or "cuda"."""
    if task not in METRICS:
        raise ValueError(f"unknown task {task!r}: use one of {TASKS}")
    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    pad = model.config.pad_token_id
    special = {pad, model.config.eos_token_id, model.config.bos_token_id, model.config.decoder_start_token_id}
    with tempfile.TemporaryDirectory() as tmp:
        args = Seq2SeqTrainingArguments(
            output_dir=output_dir or tmp, per_device_eval_batch_size=batch_size, predict_with_generate=True,
            generation_num_beams=num_beams, report_to="none", use_cpu=cpu,
            dataloader_num_workers=0, disable_tqdm=True,
            ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 and cpu else None)
        trainer = KeepMaxLength(model=model, args=args, data_collator=Collator(pad))
        meter = KVMeter(model)
        start = time.perf_counter()
        out = trainer.predict(dataset, max_new_tokens=max_new_tokens)
        if not cpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        meter.remove()
    preds = clean(out.predictions, special)
    refs = clean(out.label_ids, special)
    if tokenizer is not None:                      # the metric over text
        preds_m = tokenizer.batch_decode(preds, skip_special_tokens=True)
        refs_m = tokenizer.batch_decode(refs, skip_special_tokens=True)
    else:
        preds_m, refs_m = preds, refs
    metrics = {"loss": round(float(out.metrics["test_loss"]), 6), **METRICS[task](preds_m, refs_m),
               "seconds": round(seconds, 2), "kv_mib": round(meter.total() / 2**20, 3)}
    return preds, metrics


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=TASKS, help="summarization (ROUGE) or translation (BLEU); default: the "
                   "--shape's task, else summarization")
    p.add_argument("--model", help="Hub id or local path ('' for the built-in random model); default: "
                   f"{DEFAULT_MODELS['summarization']} (summarization), {DEFAULT_MODELS['translation']} (translation)")
    p.add_argument("--examples", type=int, default=8)
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--shape", default="tiny", choices=sorted({s for v in SHAPES.values() for s in v}),
                   help="shape of the offline random model (bart-large-cnn: summarization, opus-mt-en-de: translation)")
    p.add_argument("--source-len", type=int, help="longest random source (offline model; default "
                   f"{DEFAULT_SOURCE_LEN['summarization']} for summarization, {DEFAULT_SOURCE_LEN['translation']} "
                   "for translation)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--only", choices=["stock", "cascade"], help="evaluate one of the two (e.g. under torchrun)")
    p.add_argument("--out", help="write the predictions and metrics as JSON (rank 0)")
    args = p.parse_args(argv)
    task = args.task or task_of_shape(args.shape) or "summarization"
    if args.shape not in SHAPES[task]:
        p.error(f"--shape {args.shape} is not a {task} shape: use one of {sorted(SHAPES[task])}")
    model_id = DEFAULT_MODELS[task] if args.model is None else args.model
    source_len = args.source_len or DEFAULT_SOURCE_LEN[task]
    cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    build_on = None if cpu else f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    stock, cascade, tokenizer, source = load_pair(model_id or None, getattr(torch, args.dtype), args.shape,
                                                  build_on, task)
    data = make_dataset(tokenizer, stock.config.vocab_size, args.examples, max_len=source_len, task=task)
    results = {}
    for name, model in (("stock", stock), ("cascade", cascade)):
        if args.only in (None, name):
            results[name] = evaluate(model, data, tokenizer, args.batch, args.beams, args.new, device=args.device,
                                     task=task)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"{task}; model: {source}; {len(data)} examples, {args.beams} beams, {args.new} new tokens")
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
                           "source": source, "task": task}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
