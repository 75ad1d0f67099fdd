"""fuse_projections under tensor parallelism, run by tests/test_multi_device.py under torchrun (gloo, CPU, float64):
the tiny random Llama of benchmarks/multi_gpu.py sharded by transformers' plan (``--plan auto``, or ``gathered``: the
MLP's gate/up colwise with their outputs gathered, which fused_linears leaves unfused), and the same weights whole in
this process. Writes what each rank saw as JSON (``--out``; rank r > 0 adds ``.rankr``).
"""
from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import multi_gpu  # noqa: E402

from hf_cascade import CascadeConfig, fused_linears  # noqa: E402

MEMBERS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
# every rule of the model's own plan, but gate/up gather their outputs and down_proj splits its replicated input
GATHERED = {"mlp.gate_proj": "colwise_rep", "mlp.up_proj": "colwise_rep", "mlp.down_proj": "rowwise_split_input"}


def members(model) -> dict:
    return {name: m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in MEMBERS}


@torch.no_grad()
def plain_forward(model, ids) -> dict:
    """A forward outside generate: the logits, every member's output (its local columns under tensor parallelism) and
    how many members took their slice of a fused product."""
    outputs, served = {}, []
    hooks = []
    for name, m in members(model).items():
        hooks.append(m.register_forward_hook(lambda m, a, out, name=name: outputs.__setitem__(name, out.clone())))
        group = getattr(m, "_fused_group", None)
        if group is not None and m._fused_index > 0:
            hooks.append(m.register_forward_pre_hook(
                lambda m, a: served.append(m._fused_group.stash is not None and m._fused_group.stash[0] is a[0])))
    try:
        logits = model(ids).logits
    finally:
        for hook in hooks:
            hook.remove()
    return {"logits": logits, "outputs": outputs, "served": sum(served)}


def same(a: dict, b: dict) -> bool:
    return torch.equal(a["logits"], b["logits"]) and a["outputs"].keys() == b["outputs"].keys() and all(
        torch.equal(a["outputs"][k], b["outputs"][k]) for k in a["outputs"])


def transformers_forward(member) -> bool:
    """The member's forward is transformers' tensor-parallel one around nn.Linear's own (as loading left it)."""
    inner = inspect.getclosurevars(member.__dict__["forward"]).nonlocals["original_forward"]
    return inner.__func__ is nn.Linear.forward and type(member) is nn.Linear


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", choices=["auto", "gathered"], default="auto")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("hf_cascade").addHandler(Keep(logging.INFO))
    logging.getLogger("hf_cascade").setLevel(logging.INFO)
    ns = argparse.Namespace(device="cpu", dist_timeout=120, dtype="float64", attn="cascade", random="tiny", dir=None)
    multi_gpu.init_distributed(ns)
    one = multi_gpu.load(ns, "single")
    if args.plan == "gathered":
        from transformers.distributed import DistributedConfig
        plan = {key: GATHERED.get(key.split(".", 3)[-1], style) for key, style in one.tp_plan.items()}
        multi_gpu._tp_kwargs = lambda: {"distributed_config": DistributedConfig(tp_plan=plan)}
    tp = multi_gpu.load(ns, "tp")
    ids = torch.randint(1, tp.config.vocab_size - 1, (1, 40), generator=torch.Generator().manual_seed(40))
    kw = dict(input_ids=ids, num_beams=4, max_new_tokens=12, min_new_tokens=12, pad_token_id=0, do_sample=False,
              early_stopping=False)
    locals_before = {name: multi_gpu._local(p).clone() for name, p in tp.named_parameters()}
    before = plain_forward(tp, ids)
    result = {"rank": int(os.environ["RANK"]), "plan": args.plan,
              "sharded": type(tp.model.layers[0].self_attn.q_proj.weight).__name__}
    result["tokens_unfused"] = tp.generate(**kw, hf_cascade_config=CascadeConfig(fuse_projections=False)).tolist()
    result["groups_unfused"] = fused_linears.fused_groups(tp)
    result["tokens"] = tp.generate(**kw).tolist()
    result["groups"] = fused_linears.fused_groups(tp)
    # the whole step on the device (the graph runner's eager path) too
    result["tokens_whole_step"] = tp.generate(**kw, hf_cascade_config=CascadeConfig(cuda_graphs="eager")).tolist()
    result["tokens_one_process"] = one.generate(**kw).tolist()
    result["groups_one_process"] = fused_linears.fused_groups(one)
    result["check"] = fused_linears.check(tp)
    fused = {name: m for name, m in members(tp).items() if isinstance(m, fused_linears._FusedLinear)}
    result["fused_members"] = sorted(fused)
    # each member keeps its DTensor Parameter, whose local shard is now its rows of the group's buffer
    result["locals_in_buffer"] = all(
        m.weight.to_local().untyped_storage().data_ptr() == m._fused_group.weight.untyped_storage().data_ptr()
        for m in fused.values())
    result["dtensors_kept"] = all(type(m.weight).__name__ == "DTensor" for m in fused.values())
    result["values_kept"] = all(torch.equal(multi_gpu._local(p), locals_before[name])
                                for name, p in tp.named_parameters())
    after = plain_forward(tp, ids)
    result["plain_forward_unchanged"] = same(before, after)
    result["plain_forward_served"] = after["served"]
    with fused_linears.serving():       # a generate call's extent: the fused products serve the later members
        result["serving_forward_served"] = plain_forward(tp, ids)["served"]
    fused_linears.unfuse(tp)
    result["unfused_forwards_restored"] = all(transformers_forward(m) for m in members(tp).values())
    result["unfused_plain_forward_unchanged"] = same(before, plain_forward(tp, ids))
    result["refusals"] = [r for r in records if "left unfused under tensor parallelism" in r]
    path = args.out if result["rank"] == 0 else f"{args.out}.rank{result['rank']}"
    Path(path).write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
