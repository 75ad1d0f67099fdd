"""Compile seconds on the CPU: the decode forward compiled whole (``compile=True``) vs one decoder layer for all
(``compile="regional"``), for tiny random Llamas of 4 and 16 layers.

Each (layers, mode) runs in a process of its own with an empty inductor cache directory (nothing compiled before
it: dynamo's and inductor's on-disk caches would otherwise serve a later run). In it: beam search (4 beams, 2
left-padded prompts, 8 new tokens, float32) on the runner's static path without capture (``cuda_graphs="eager"``),
the same call twice; "compile s" is the first call's wall time less the second's (the first compiles the forward,
the whole step's bookkeeping and its token choice; the second reuses them), split by part (each part's first call less
the median of its later calls; inductor's own start in the empty cache directory is paid before, by a trivial
function), "graphs" dynamo's count of the graphs it
compiled, "layer graphs" the entries of the one compiled layer function (regional only). Every call's tokens are
checked against the uncompiled step's. Not a timed test: a small script, CPU seconds on this machine.

    PYTHONPATH=. python benchmarks/regional_compile_cpu.py [--layers 4 16] [--modes True regional]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

NEW = 8


def _model(layers: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                         bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="cascade", dtype=torch.float32).eval()


def one(layers: int, mode) -> dict:
    """One (layers, mode) in this process: the figures of the module docstring."""
    import torch
    from torch._dynamo.utils import counters
    import hf_cascade
    from hf_cascade import CascadeConfig, regional
    torch.set_num_threads(2)
    model = _model(layers)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 128, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 0

    # what each compiled part's first call costs beyond its later calls: the forward (the runner's forward_step), the
    # whole step's bookkeeping and token choice (whole_step._Compiled)
    from hf_cascade import graphs, whole_step
    parts: dict = {}

    def timed(name, fn):
        def run(*a, **k):
            started = time.perf_counter()
            out = fn(*a, **k)
            parts.setdefault(name, []).append(time.perf_counter() - started)
            return out
        return run

    real_step, real_compiled_call = graphs.DecodeGraphRunner.forward_step, whole_step._Compiled.__call__
    graphs.DecodeGraphRunner.forward_step = lambda self, static: timed("forward", real_step)(self, static)
    whole_step._Compiled.__call__ = lambda self, *a: timed(self.what, real_compiled_call)(self, *a)
    # inductor's own start in an empty cache directory (its C++ prelude), paid once by whichever compiles first
    torch.compile(lambda x: (x * 2).relu().sum())(torch.ones(8))

    def call(compile):
        started = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=NEW,
                             hf_cascade_config=CascadeConfig(cuda_graphs="eager", compile=compile))
        return out, time.perf_counter() - started

    want, _ = call(False)
    _, plain_s = call(False)
    parts.clear()
    first, first_s = call(mode)
    second, second_s = call(mode)
    # each part's first call less the median of its later ones
    part_s = {name: round(times[0] - sorted(times[1:])[len(times[1:]) // 2], 2) for name, times in parts.items()}
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    return dict(layers=layers, mode=mode, equal=bool(torch.equal(first, want) and torch.equal(second, want)),
                first_s=round(first_s, 2), second_s=round(second_s, 2), uncompiled_s=round(plain_s, 2),
                compile_s=round(first_s - second_s, 2), part_compile_s=part_s, graphs=counters["stats"]["unique_graphs"],
                layer_graphs=len(_debug_get_cache_entry_list(regional._layer_forward.__code__)),
                torch=torch.__version__, transformers=__import__("transformers").__version__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--modes", nargs="+", default=["True", "regional"])
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)      # (layers, mode): run in this process
    args = parser.parse_args()
    if args.one:
        layers, mode = int(args.one[0]), {"True": True}.get(args.one[1], args.one[1])
        print(json.dumps(one(layers, mode)))
        return
    rows = []
    for layers in args.layers:
        for mode in args.modes:
            with tempfile.TemporaryDirectory() as cache_dir:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
                done = subprocess.run([sys.executable, __file__, "--one", str(layers), mode], env=env, check=True,
                                      capture_output=True, text=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            row = rows[-1]
            print(f"{row['layers']:>3} layers  compile={str(row['mode']):<9} compile {row['compile_s']:6.2f} s  "
                  f"(first call {row['first_s']:.2f} s, second {row['second_s']:.2f} s, uncompiled "
                  f"{row['uncompiled_s']:.2f} s)  graphs {row['graphs']}  layer graphs {row['layer_graphs']}  "
                  f"tokens equal {row['equal']}\n      of which (first call less a later one): {row['part_compile_s']}",
                  flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
