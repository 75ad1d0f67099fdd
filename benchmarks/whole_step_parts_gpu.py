"""GPU time of the whole decode step's parts (hf_cascade/whole_step.py), each captured as its own CUDA graph and
replayed with CUDA events around it: the block bookkeeping, the forward on the planned step, the token choice, and
the whole step's own graph. Where the whole step is slower than transformers' loop replaying the forward, this says
which part costs what. The parts are timed inside a real generate call (its first device chunk), which is then
stopped.

    PYTHONPATH=. python benchmarks/whole_step_parts_gpu.py --configs 8b:16384:beam8 8b:4096:greedy
"""
from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console

import harness
import hf_cascade
from hf_cascade import whole_step
from generate_gpu import _mode_kwargs, _model_and_prompt


class _Stop(Exception):
    pass


def _graph(fn):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_parts(loop, reps: int) -> dict:
    logits = {}

    def forward():
        logits["out"] = loop._forward()

    parts = {"blocks": _graph(loop._advance), "forward": _graph(forward)}
    parts["choose"] = _graph(lambda: loop._choose(logits["out"]))
    parts["whole"] = loop.graph
    out = {}
    for name, graph in parts.items():
        median_us, min_us = harness.cuda_time_us(graph.replay, reps=reps, warmup=3)
        out[name + "_us"] = median_us
        out[name + "_min_us"] = min_us
    # the host's part of a step: what the loop does between two replays (the device is kept busy meanwhile)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        loop.cache.logical_length += 1
        loop.graph.replay()
        loop.runner.replays += 1
    out["host_us_per_step"] = (time.perf_counter() - started) / reps * 1e6
    torch.cuda.synchronize()
    # the memory floor: every weight and every stored K/V byte read once at the H200's 4.8 TB/s
    weights = sum(p.numel() * p.element_size() for p in loop.model.parameters())
    kv = loop.cache.stats().kv_bytes_in_use
    out["floor_us"] = (weights + kv) / 4.8e12 * 1e6
    out["whole_vs_floor"] = out["whole_us"] / out["floor_us"]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["8b:16384:beam8", "8b:4096:greedy"])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    models, results = {}, []
    real_chunk = whole_step.WholeStepLoop._chunk
    for entry in args.configs:
        shape, prompt, mode = entry.split(":")
        model, ids = _model_and_prompt(models, shape, prompt, torch.bfloat16)
        model.set_attn_implementation("cascade")
        found = {}

        def chunk(self, steps):
            done = real_chunk(self, steps)
            if self.graph is not None and self.held is not None:
                found.update(time_parts(self, args.reps))
                raise _Stop
            return done

        # a plain call first: the wall time of each chunk of device steps (replays and the flag read), per step
        walls = []

        def timed_chunk(self, steps):
            torch.cuda.synchronize()
            started = time.perf_counter()
            done = real_chunk(self, steps)
            walls.append(((time.perf_counter() - started) / steps * 1e6, steps, self.graph is not None))
            return done

        config = hf_cascade.CascadeConfig(backend="cuda", cuda_graphs=True)
        kw = dict(max_new_tokens=40, min_new_tokens=40, pad_token_id=0, **_mode_kwargs(mode))
        whole_step.WholeStepLoop._chunk = timed_chunk
        try:
            for _ in range(2):        # the second call replays the kept graph from its first device step
                walls.clear()
                model.generate(input_ids=ids, hf_cascade_config=config, **kw)
        finally:
            whole_step.WholeStepLoop._chunk = real_chunk
        replayed = [w for w, n, graph in walls if graph and n > 1]
        found["chunk_wall_us_per_step"] = sorted(replayed)[len(replayed) // 2] if replayed else None
        found["chunks"] = [(round(w), n) for w, n, _ in walls]
        whole_step.WholeStepLoop._chunk = chunk
        try:
            model.generate(input_ids=ids, hf_cascade_config=config, **kw)
        except _Stop:
            pass
        finally:
            whole_step.WholeStepLoop._chunk = real_chunk
        results.append({"shape": shape, "prompt": prompt, "mode": mode, **found})
    harness.table("whole step parts (µs, CUDA events, median)", ["shape", "prompt", "mode", "blocks_us", "forward_us",
                                                                "choose_us", "whole_us", "chunk_wall_us_per_step", "host_us_per_step",
                                                                "floor_us", "whole_vs_floor"], results,
                  console=Console(width=160))
    harness.write_json(args.out or harness.results_path("whole_step_parts_gpu"),
                       {**harness.run_record("whole_step_parts_gpu.py"), "results": results})


if __name__ == "__main__":
    main()
