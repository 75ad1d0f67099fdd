"""Evaluate a causal LM with ``Seq2SeqTrainer(predict_with_generate=True)`` and with a plain loop, on
``attn_implementation="cascade"`` and on stock ``"sdpa"``, and compare.

Runs on the built-in random Llama of ``python -m hf_cascade`` (no download) and a tiny synthetic data set
of token-id prompts and targets, so no tokenizer is needed::

    python examples/trainer_eval.py                 # float32, 8 examples of 96-160 tokens, 4 beams
    python examples/trainer_eval.py --dtype float64 --examples 16

It prints whether the predictions of each evaluation agree with the same evaluation on sdpa, the eval
loss of both, the KV bytes the generate calls kept (cascade: the cache's peak; stock: its final
DynamicCache), the rows they prefilled and the time, and says in one line if a cascade call ran on
stock's own path, and why.

The prompts are 96-160 tokens: on the CPU a generate call runs the cascade only where sharing saves at
least ``hf_cascade.generation.MIN_SHARED_TOKENS`` (1024) prompt-token reads per step — (beams - 1) x the
batch's prompt tokens — and runs on stock's path otherwise (no saving to show). With 4 beams and batches
of 4 that takes prompts of about 90 tokens or more.

What a decoder-only model needs in ``Seq2SeqTrainer``:

* The loss and the generation need different inputs. The loss pass needs prompt + target in one
  sequence, with ``labels`` = -100 on the prompt and the padding; ``generate`` needs the prompt alone,
  left-padded. Stock ``Seq2SeqTrainer.prediction_step`` gives both the same ``input_ids`` (for an
  encoder-decoder the target lives in ``labels``/``decoder_input_ids``), so on a decoder-only model it
  would either generate after the target or compute the loss on the prompt. :class:`PromptTargetCollator`
  builds both, and :class:`CausalLMSeq2SeqTrainer` overrides ``prediction_step`` to run the loss on the
  first and ``Seq2SeqTrainer``'s own generation step on the second, then drops the prompt from the
  generated sequences so predictions are the new tokens only.
* ``remove_unused_columns=False``: the raw examples hold ``prompt`` / ``target`` lists, which the
  Trainer would otherwise strip before the collator sees them.
* Pass ``max_new_tokens`` to ``evaluate`` / ``predict`` rather than ``generation_max_length``: for a
  decoder-only model ``max_length`` counts the (padded) prompt too, so it would vary with the batch.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

import hf_cascade
from hf_cascade.__main__ import build_model, stock_path

IGNORE = -100
PROMPT_LENS = (96, 160)      # long enough that sharing pays on the CPU (module docstring)


# ---- data --------------------------------------------------------------------------------------------

def synthetic_dataset(n: int, vocab_size: int, prompt_lens=PROMPT_LENS, target_len: int = 8, seed: int = 0,
                      low: int = 3) -> list[dict]:
    """``n`` examples ``{"prompt": [ids], "target": [ids]}`` of random token ids in [low, vocab_size);
    prompt lengths drawn from ``prompt_lens`` (inclusive), so batches need padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(prompt_lens[0], prompt_lens[1] + 1, (1,), generator=g))
        out.append({"prompt": torch.randint(low, vocab_size, (length,), generator=g).tolist(),
                    "target": torch.randint(low, vocab_size, (target_len,), generator=g).tolist()})
    return out


def _left_pad(rows: list[list[int]], value: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
    return ids, mask


class PromptTargetCollator:
    """Batches ``{"prompt", "target"}`` examples for a decoder-only model.

    * ``input_ids`` / ``attention_mask`` / ``labels``: prompt + target, left-padded; ``labels`` is -100
      on the prompt and the padding (the loss pass).
    * ``prompt_input_ids`` / ``prompt_attention_mask``: the prompt alone, left-padded (generation).
    * ``target_ids``: the targets, right-padded with -100 (what predictions are compared with).
    """

    def __init__(self, pad_token_id: int):
        self.pad = pad_token_id

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        full = [f["prompt"] + f["target"] for f in features]
        input_ids, attention_mask = _left_pad(full, self.pad)
        labels = torch.full_like(input_ids, IGNORE)
        width = input_ids.shape[1]
        for i, f in enumerate(features):
            n = len(f["target"])
            labels[i, width - n:] = torch.tensor(f["target"])
        prompt_ids, prompt_mask = _left_pad([f["prompt"] for f in features], self.pad)
        t = max(len(f["target"]) for f in features)
        targets = torch.full((len(features), t), IGNORE, dtype=torch.long)
        for i, f in enumerate(features):
            targets[i, : len(f["target"])] = torch.tensor(f["target"])
        return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                    prompt_input_ids=prompt_ids, prompt_attention_mask=prompt_mask, target_ids=targets)


# ---- Trainer -----------------------------------------------------------------------------------------

class CausalLMSeq2SeqTrainer(Seq2SeqTrainer):
    """``Seq2SeqTrainer`` for a decoder-only model: the loss on prompt + target, ``generate`` on the
    prompt alone (left-padded, no labels); predictions are the generated tokens after the prompt."""

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        inputs = dict(inputs)
        prompt = {"input_ids": inputs.pop("prompt_input_ids"), "attention_mask": inputs.pop("prompt_attention_mask")}
        targets = inputs.pop("target_ids")
        if not self.args.predict_with_generate or prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        # the loss: Trainer's own step on prompt + target (a forward without a cascade cache: dense sdpa)
        loss, _, _ = super().prediction_step(model, inputs, prediction_loss_only=True, ignore_keys=ignore_keys)
        # the predictions: Seq2SeqTrainer's generation step on the prompt only (no labels reach generate)
        max_length = self.model.generation_config.max_length
        _, generated, _ = super().prediction_step(model, prompt, prediction_loss_only=False, **gen_kwargs)
        # Seq2SeqTrainer fills the model's generation_config with defaults (max_length=20) after generate;
        # put max_length back so the next call does not see both max_length and max_new_tokens
        self.model.generation_config.max_length = max_length
        start = prompt["input_ids"].shape[1]
        kwargs = gen_kwargs or getattr(self, "_gen_kwargs", {})
        new = kwargs.get("max_new_tokens") or self.model.generation_config.max_new_tokens
        # Seq2SeqTrainer pads short outputs to generation_config.max_length; keep the new tokens only
        generated = generated[:, start:] if new is None else generated[:, start:start + new]
        return loss, generated, targets


def make_trainer(model, eval_dataset, output_dir: str, batch_size: int = 4, num_beams: int = 4,
                 compute_metrics=None) -> CausalLMSeq2SeqTrainer:
    args = Seq2SeqTrainingArguments(
        output_dir=output_dir, per_device_eval_batch_size=batch_size, predict_with_generate=True,
        generation_num_beams=num_beams, remove_unused_columns=False, report_to="none", use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True, do_train=False, do_eval=True)
    return CausalLMSeq2SeqTrainer(model=model, args=args, eval_dataset=eval_dataset,
                                  data_collator=PromptTargetCollator(model.config.pad_token_id),
                                  compute_metrics=compute_metrics)


def plain_eval_loop(model, dataset, batch_size: int = 4, num_beams: int = 4, max_new_tokens: int = 8,
                    **generate_kwargs) -> torch.Tensor:
    """The loop without a Trainer: ``generate`` per batch; returns the new tokens [N, max_new_tokens]
    (rows that stop early are padded with the pad token)."""
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False,
                        collate_fn=PromptTargetCollator(model.config.pad_token_id))
    pad = model.config.pad_token_id
    out = []
    model.eval()
    with torch.no_grad():
        for batch in tqdm(loader, desc="generate batches", unit="batch", leave=False):
            ids, mask = batch["prompt_input_ids"], batch["prompt_attention_mask"]
            seq = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                 num_beams=num_beams, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=pad, **generate_kwargs)
            new = seq[:, ids.shape[1]:].cpu()
            if new.shape[1] < max_new_tokens:
                new = torch.nn.functional.pad(new, (0, max_new_tokens - new.shape[1]), value=pad)
            out.append(new)
    return torch.cat(out)


# ---- KV accounting -----------------------------------------------------------------------------------

class KVMeter:
    """Forward hook recording, per cache a forward used, the KV bytes it held (a CascadeCache's peak in
    use, a DynamicCache's tensors) and the rows of its first forward (the prefill); one figure per cache,
    i.e. per generate call (a forward given no cache, like the Trainer's loss pass, is not counted)."""

    def __init__(self, model):
        self.bytes: dict[int, int] = {}
        self.kinds: dict[int, str] = {}
        self.rows: dict[int, int] = {}
        self._keep = []          # keep caches alive so ids stay unique
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)
        # (generate's own once-per-prompt prefill runs the model's forward without its hooks: observed apart)
        self.prefill_handle = hf_cascade.generation.register_prefill_hook(
            post=lambda m, kwargs, output: self._hook(m, (), kwargs, output))

    def _hook(self, module, args, kwargs, output):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))    # generate passes its cache in
        if cache is None:
            return
        if isinstance(cache, hf_cascade.CascadeCache):
            n, kind = cache.stats().peak_kv_bytes_in_use, "cascade"
        elif hasattr(cache, "layers"):
            n = sum(l.keys.nbytes + l.values.nbytes for l in cache.layers if getattr(l, "keys", None) is not None)
            kind = "dense"
        else:
            return
        key = id(cache)
        if key not in self.bytes:
            self._keep.append(cache)
            x = kwargs.get("input_ids")
            self.rows[key] = (kwargs.get("inputs_embeds") if x is None else x).shape[0]
        self.bytes[key] = max(self.bytes.get(key, 0), n)
        self.kinds[key] = kind

    def reset(self):
        self.bytes.clear(), self.kinds.clear(), self.rows.clear(), self._keep.clear()

    def total(self) -> int:
        return sum(self.bytes.values())

    def rows_prefilled(self) -> int:
        return sum(self.rows.values())

    def remove(self):
        self.handle.remove()
        self.prefill_handle.remove()


# ---- the comparison ----------------------------------------------------------------------------------

def stock_path_reasons(model, dataset, batch_size: int = 4, num_beams: int = 4) -> list[str | None]:
    """Per batch of the evaluation, why its generate call on a cascade model runs on stock's own path (no
    saving), or None where it runs the cascade (:func:`hf_cascade.__main__.stock_path`)."""
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False,
                        collate_fn=PromptTargetCollator(model.config.pad_token_id))
    return [stock_path(model, b["prompt_input_ids"], num_beams, b["prompt_attention_mask"]) for b in loader]


def stock_path_line(reasons: list[str | None]) -> str | None:
    """One line saying how many generate calls ran on stock's path and why (None where none did)."""
    taken = [r for r in reasons if r]
    if not taken:
        return None
    return (f"cascade: {len(taken)} of {len(reasons)} generate calls per evaluation ran on stock's own path "
            f"(no KV shared): {taken[0]}")


def compare(stock, cascade, dataset, batch_size: int = 4, num_beams: int = 4, max_new_tokens: int = 8,
            output_dir: str | None = None) -> dict:
    """Trainer.predict and the plain loop on both models; predictions, agreement, losses, KV bytes, times."""
    result = {}
    # minutes on a small CPU: a bar over the four passes (TQDM_DISABLE=1 silences it, as the notebook tests do)
    bar = tqdm(total=4, desc="evaluating", unit="pass")
    with tempfile.TemporaryDirectory() as tmp, bar:
        out_dir = output_dir or tmp
        for name, model in (("stock", stock), ("cascade", cascade)):
            trainer = make_trainer(model, dataset, out_dir, batch_size, num_beams)
            meter = KVMeter(model)
            try:
                bar.set_postfix_str(f"{name}: Seq2SeqTrainer.predict")
                t0 = time.perf_counter()
                pred = trainer.predict(dataset, max_new_tokens=max_new_tokens)
                t_trainer = time.perf_counter() - t0
                bar.update(1)
                meter.reset()     # count the plain loop's generate calls only
                bar.set_postfix_str(f"{name}: plain generate loop")
                t0 = time.perf_counter()
                loop = plain_eval_loop(model, dataset, batch_size, num_beams, max_new_tokens)
                t_loop = time.perf_counter() - t0
                bar.update(1)
            finally:
                meter.remove()
            result[name] = dict(trainer_predictions=torch.as_tensor(pred.predictions),
                                label_ids=torch.as_tensor(pred.label_ids), loss=pred.metrics["test_loss"],
                                loop_predictions=loop, kv_bytes=meter.total(), seconds_trainer=t_trainer,
                                seconds_loop=t_loop, rows_prefilled=meter.rows_prefilled())
    s, c = result["stock"], result["cascade"]
    result["trainer_agreement"] = float((s["trainer_predictions"] == c["trainer_predictions"]).double().mean())
    result["loop_agreement"] = float((s["loop_predictions"] == c["loop_predictions"]).double().mean())
    result["trainer_vs_loop_agreement"] = float((c["trainer_predictions"] == c["loop_predictions"]).double().mean())
    result["kv_ratio"] = c["kv_bytes"] / s["kv_bytes"]
    result["stock_path"] = stock_path_reasons(cascade, dataset, batch_size, num_beams)
    return result


def report(r: dict) -> None:
    s, c = r["stock"], r["cascade"]
    mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
    print(f"eval loss              stock {s['loss']:.6f}   cascade {c['loss']:.6f}   (loss pass: dense sdpa)")
    print(f"Seq2SeqTrainer.predict token agreement with sdpa: {r['trainer_agreement']:.1%}   "
          f"({s['seconds_trainer']:.2f} s stock, {c['seconds_trainer']:.2f} s cascade)")
    print(f"plain generate loop    token agreement with sdpa: {r['loop_agreement']:.1%}   "
          f"({s['seconds_loop']:.2f} s stock, {c['seconds_loop']:.2f} s cascade)")
    print(f"Trainer vs plain loop (cascade): {r['trainer_vs_loop_agreement']:.1%}")
    print(f"KV bytes, all generate calls of the plain loop: stock {mib(s['kv_bytes'])}, "
          f"cascade {mib(c['kv_bytes'])}  (cascade / stock = {r['kv_ratio']:.3f})")
    print(f"rows prefilled by the plain loop: stock {s['rows_prefilled']}, cascade {c['rows_prefilled']}")
    print(stock_path_line(r["stock_path"]) or "every cascade generate call shared its prompts' KV across the beams")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-lens", type=int, nargs=2, default=PROMPT_LENS, metavar=("MIN", "MAX"),
                   help="prompt lengths drawn from [MIN, MAX] (default: %(default)s; shorter prompts run on stock's "
                        "path on the CPU: see the module docstring)")
    a = p.parse_args(argv)
    stock = build_model("sdpa", dtype=a.dtype, seed=a.seed)
    cascade = build_model("cascade", dtype=a.dtype, seed=a.seed)
    cascade.load_state_dict(stock.state_dict())
    data = synthetic_dataset(a.examples, stock.config.vocab_size, tuple(a.prompt_lens), a.new_tokens, a.seed)
    r = compare(stock, cascade, data, a.batch_size, a.beams, a.new_tokens)
    report(r)
    return r


if __name__ == "__main__":
    main()
