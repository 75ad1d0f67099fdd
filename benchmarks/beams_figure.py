"""The README's picture: KV memory and time per new token against the number of beams, stock sdpa vs cascade, CPU.

A tiny Llama-shaped model built from a config (random weights, float32), one prompt, beams 1/2/4/8/16. KV bytes:
the cascade cache's peak in use (its stats) against stock's final DynamicCache (``hf_cascade.__main__.kv_bytes``).
Time per new token: the wall time of a plain ``generate()`` after its prefill forward returned, over the tokens that
follow (``hf_cascade.__main__.timed_once``, as the main job reports it), one thread, stock and cascade interleaved,
the median of the rounds; the first call of each (the one that reads its cache) is untimed. Below 4 beams too little is
shared on the CPU (``MIN_SHARED_TOKENS``), so the cascade model runs stock's own path there (stock's figures).

    PYTHONPATH=. python benchmarks/beams_figure.py [--rounds 5]     # writes the JSON and docs/img/beams.svg
    PYTHONPATH=. python benchmarks/beams_figure.py --plot-only      # re-renders the SVG from the committed JSON
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import harness

ROOT = harness.ROOT
JSON_PATH = ROOT / "benchmarks" / "results" / "cpu" / "beams_figure.json"
FIGURE_PATH = ROOT / "docs" / "img" / "beams.svg"
BEAMS = (1, 2, 4, 8, 16)
SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=704, vocab_size=4096)


def build_pair(seed: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_cascade  # noqa: F401  registers "cascade"

    def config():      # one config per model: from_config writes the attention choice into the one it is given
        return LlamaConfig(**SHAPE, max_position_embeddings=4096, pad_token_id=0, bos_token_id=None,
                           eos_token_id=None)
    torch.manual_seed(seed)
    stock = AutoModelForCausalLM.from_config(config(), attn_implementation="sdpa", dtype=torch.float32).eval()
    cascade = AutoModelForCausalLM.from_config(config(), attn_implementation="cascade", dtype=torch.float32).eval()
    cascade.load_state_dict(stock.state_dict())
    return stock, cascade


def measure(prompt_len: int, new_tokens: int, rounds: int, seed: int) -> list[dict]:
    import torch

    from hf_cascade.__main__ import generate_once, timed_once
    torch.set_num_threads(1)
    models = dict(zip(("stock", "cascade"), build_pair(seed)))
    ids = torch.randint(1, SHAPE["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    rows = []
    for beams in BEAMS:
        first = {name: generate_once(model, ids, beams, new_tokens) for name, model in models.items()}
        kept = harness.interleave(list(models), lambda name, rnd: timed_once(models[name], ids, beams, new_tokens),
                                  rounds=rounds)
        row = dict(beams=beams)
        for name in models:
            steps = [1e3 * r["per_token"] for r in kept[name]]
            row.update({f"{name}_ms_per_token": harness.median(steps), f"{name}_ms_per_token_rounds": steps,
                        f"{name}_kv_bytes": first[name]["kv_bytes"]})
        row["cascade_path"] = "stock" if first["cascade"]["stock_path"] else "cascade"
        row["same_tokens"] = all(torch.equal(r["sequences"], first["stock"]["sequences"])
                                 for r in [first["cascade"], *kept["stock"], *kept["cascade"]])
        print(row, file=sys.stderr)
        rows.append(row)
    return rows


def plot(record: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["rows"]
    beams = [r["beams"] for r in rows]
    fig, (mem, step) = plt.subplots(1, 2, figsize=(9, 3.4))
    for name, style in (("stock", "o-"), ("cascade", "s-")):
        label = "stock sdpa" if name == "stock" else 'attn_implementation="cascade"'
        mem.plot(beams, [r[f"{name}_kv_bytes"] / 2**20 for r in rows], style, label=label)
        step.plot(beams, [r[f"{name}_ms_per_token"] for r in rows], style, label=label)
    for ax, title in ((mem, "KV cache (MiB)"), (step, "time per new token (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(beams, [str(b) for b in beams])
        ax.set_xlabel("num_beams")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    mem.legend()
    stock_path = [str(r["beams"]) for r in rows if r["cascade_path"] == "stock"]
    if stock_path:      # too little shared there: the cascade model ran stock's own path, with stock's figures
        fig.text(0.5, 0.01, f"beams {', '.join(stock_path)}: too little to share on the CPU, the cascade model runs "
                 "stock's own path", ha="center", fontsize=8, color="0.35")
    s = record["settings"]
    fig.suptitle(f"beam search, one {s['prompt_len']}-token prompt, tiny random Llama, float32, 1 CPU thread "
                 f"({record['date'][:10]}, {record['commit']})", fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Date": None})      # no timestamp: re-rendering the same JSON gives the same file
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot-only", action="store_true", help="re-render the figure from the committed JSON")
    args = p.parse_args(argv)
    if args.plot_only:
        record = json.loads(JSON_PATH.read_text())
    else:
        record = dict(harness.run_record(__file__, argv), settings=dict(vars(args), model=SHAPE, threads=1),
                      rows=measure(args.prompt_len, args.new_tokens, args.rounds, args.seed))
        harness.write_json(JSON_PATH, record)
    plot(record, FIGURE_PATH)
    print(f"wrote {FIGURE_PATH.relative_to(ROOT)}" + ("" if args.plot_only else f" and {JSON_PATH.relative_to(ROOT)}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
