"""The typed entry points of the CUDA kernels (hf_cascade/kernels/ops.py) and their C ABI mirror.

CPU: the ctypes structs match csrc/include/hfc/params.h byte for byte (compiled with the system C compiler); the
fake implementations accept consistent shapes over a grid and name the argument that is wrong (the solo operator's
too); torch.compile traces a layer around the three operators into one graph. GPU (``gpu``): torch.library.opcheck of
each operator on a real layout, and the operators give bitwise the eager backend's output.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hf_cascade.kernels import cuda as cuda_backend
from hf_cascade.kernels import cuda_binding, ops
from hf_cascade.kernels.base import AttentionParams

ROOT = Path(__file__).resolve().parents[2]
I32 = torch.int32


def layout(device="cuda", dtype=torch.bfloat16, R=6, Lq=1, Hq=8, Hkv=2, D=128, bs=16, N=20, G=2, Rg=3, Mp=4, Ms=3,
           m_tile=16, max_chunks=2, nsplit=2):
    """Consistent arguments of the three operators (contents irrelevant: for the fake implementations)."""
    rows = Rg * Lq * (Hq // Hkv)
    slots = max_chunks + nsplit
    q = torch.empty(R, Lq, Hq, D, dtype=dtype, device=device)
    return dict(
        q=q, pool=torch.empty(N, 2, bs, Hkv, D, dtype=dtype, device=device),
        group_rows=torch.empty(G, Rg, dtype=I32, device=device), prefix_table=torch.empty(G, Mp, dtype=I32, device=device),
        prefix_len=torch.empty(G, dtype=I32, device=device), suffix_table=torch.empty(R, Ms, dtype=I32, device=device),
        q_limit=torch.empty(R, Lq, dtype=I32, device=device), row_nchunks=torch.empty(R, dtype=I32, device=device),
        part_o=torch.empty(slots * R * Lq * Hq * D, device=device), part_lse=torch.empty(slots * R * Lq * Hq, device=device),
        out=torch.empty_like(q), m_tile=m_tile, row_tiles=-(-rows // m_tile), chunk_tokens=64, max_chunks=max_chunks,
        split_tokens=32, nsplit=nsplit, slot0=max_chunks, scale_log2=0.1,
        pslot0=0, softcap=0.0, window=0, row_nmid=None, mid_slot0=max_chunks, sinks=None)


def call(name, a):
    if name == "prefix":
        return torch.ops.hf_cascade.prefix(a["q"], a["pool"], a["group_rows"], a["prefix_table"], a["prefix_len"],
                                           a["part_o"], a["part_lse"], a["m_tile"], a["row_tiles"], a["chunk_tokens"],
                                           a["max_chunks"], a["scale_log2"], a["q_limit"], a["pslot0"], a["softcap"],
                                           a["window"], a.get("tune", 0))
    if name == "suffix":
        return torch.ops.hf_cascade.suffix(a["q"], a["pool"], a["suffix_table"], a["q_limit"], a["part_o"],
                                           a["part_lse"], a["split_tokens"], a["nsplit"], a["slot0"], a["scale_log2"],
                                           a["softcap"], a["window"])
    return torch.ops.hf_cascade.merge(a["part_o"], a["part_lse"], a["row_nchunks"], a["out"], a["slot0"], a["nsplit"],
                                      a["row_nmid"], a["mid_slot0"], a["sinks"])


# ---------------------------------------------------------------------------------------------- CPU

@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_ctypes_structs_match_the_c_header(tmp_path):
    structs = {"hfc_prefix_params": cuda_backend._PrefixParams, "hfc_prefix_info": cuda_backend._PrefixInfo,
               "hfc_suffix_params": cuda_backend._SuffixParams, "hfc_merge_params": cuda_backend._MergeParams,
               "hfc_solo_params": cuda_binding._SoloParams}
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "hfc/params.h"', "int main(void) {"]
    for cname, py in structs.items():
        lines.append(f'  printf("{cname} size %zu\\n", sizeof({cname}));')
        for field, _ in py._fields_:
            lines.append(f'  printf("{cname} {field} %zu\\n", offsetof({cname}, {field}));')
    lines += ["  return 0;", "}"]
    (tmp_path / "layout.c").write_text("\n".join(lines))
    subprocess.run(["cc", "-std=c99", "-Wall", "-Werror", f"-I{ROOT / 'csrc' / 'include'}", "-o",
                    str(tmp_path / "layout"), str(tmp_path / "layout.c")], check=True)
    got = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout.split("\n")
    want = []
    for cname, py in structs.items():
        want.append(f"{cname} size {ctypes.sizeof(py)}")
        want += [f"{cname} {field} {getattr(py, field).offset}" for field, _ in py._fields_]
    assert [g for g in got if g] == want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D,m_tile", [(64, 64), (128, 32), (256, 16), (256, 32)])
@pytest.mark.parametrize("Lq,Hq,Hkv", [(1, 8, 8), (3, 32, 8), (2, 8, 1)])
def test_fake_implementations_take_consistent_shapes(dtype, D, m_tile, Lq, Hq, Hkv):
    with FakeTensorMode():
        a = layout(dtype=dtype, D=D, m_tile=m_tile, Lq=Lq, Hq=Hq, Hkv=Hkv)
        shapes = {k: tuple(v.shape) for k, v in a.items() if isinstance(v, torch.Tensor)}
        for name in ("prefix", "suffix", "merge"):
            assert call(name, a) is None
        # the operators write into the buffers they are given: nothing is reshaped or replaced
        assert {k: tuple(v.shape) for k, v in a.items() if isinstance(v, torch.Tensor)} == shapes
        assert a["out"].dtype == dtype and a["part_o"].dtype == torch.float32


def _bad(a, key, value):
    return {**a, key: value(a) if callable(value) else value}


def _shaped(t, *shape):
    """A tensor like ``t`` of another shape (views of fake CUDA tensors need a CUDA build of torch)."""
    return torch.empty(shape, dtype=t.dtype, device=t.device)


BAD = [  # (operator, argument, how it is wrong, exception) -> the message must name the argument
    ("prefix", "q", lambda a: a["q"].float(), TypeError),
    ("prefix", "pool", lambda a: a["pool"].half(), TypeError),
    ("prefix", "pool", lambda a: _shaped(a["pool"], 20, 2, 16, 3, 128), ValueError),
    ("prefix", "prefix_table", lambda a: _shaped(a["prefix_table"], 1, 4), ValueError),
    ("prefix", "prefix_len", lambda a: a["prefix_len"].long(), TypeError),
    ("prefix", "part_o", lambda a: _shaped(a["part_o"], 10), ValueError),
    ("prefix", "part_lse", lambda a: a["part_lse"].double(), TypeError),
    ("prefix", "m_tile", 48, ValueError),
    ("prefix", "row_tiles", 0, ValueError),
    ("suffix", "suffix_table", lambda a: torch.empty_strided((6, 3), (1, 6), dtype=I32, device="cuda"), ValueError),
    ("suffix", "q_limit", lambda a: _shaped(a["q_limit"], 6, 2), ValueError),
    ("suffix", "part_lse", lambda a: _shaped(a["part_lse"], 5), ValueError),
    ("merge", "row_nchunks", lambda a: _shaped(a["row_nchunks"], 5), ValueError),
    ("merge", "out", lambda a: a["out"].float(), TypeError),
    ("prefix", "window", -1, ValueError),
    ("suffix", "softcap", -2.0, ValueError),
    ("prefix", "part_o", lambda a: a["part_o"], ValueError),   # with pslot0 below: slots past the buffer
    ("merge", "sinks", lambda a: torch.empty(5, device=a["out"].device), ValueError),
    ("merge", "sinks", lambda a: torch.empty(8, dtype=torch.bfloat16, device=a["out"].device), TypeError),
    ("merge", "row_nmid", lambda a: _shaped(a["row_nchunks"], 4), ValueError),
]


@pytest.mark.parametrize("op,arg,value,exc", BAD, ids=[f"{o}-{a}-{i}" for i, (o, a, _, _) in enumerate(BAD)])
def test_fake_implementations_name_the_wrong_argument(op, arg, value, exc):
    with FakeTensorMode():
        a = layout()
        bad = _bad(a, arg, value)
        if arg == "part_o" and bad["part_o"] is a["part_o"]:
            bad["pslot0"] = a["max_chunks"] + a["nsplit"]      # the middle level's slots would not fit
        with pytest.raises(exc, match=rf"hf_cascade::{op}: .*\b{arg}\b"):
            call(op, bad)


def solo_args(a, *, split_tokens=32, nsplit=None, counters=None) -> ops.SoloArgs:
    """The solo operator's arguments over ``layout``'s tables (every group of one row: its contents are irrelevant
    here), splits covering the tables."""
    R, Lq, Hq, D = a["q"].shape
    Hkv, bs = a["pool"].shape[3], a["pool"].shape[2]
    tokens = (a["prefix_table"].shape[1] + a["suffix_table"].shape[1]) * bs
    nsplit = nsplit or -(-tokens // split_tokens)
    device = a["q"].device
    return ops.SoloArgs(a["q"], a["pool"], torch.empty(R, dtype=I32, device=device), a["prefix_table"],
                        a["prefix_len"], a["suffix_table"], a["q_limit"],
                        torch.empty(nsplit * R * Lq * Hq * D, device=device), torch.empty(nsplit * R * Lq * Hq, device=device),
                        counters if counters is not None else
                        torch.zeros(R * Hkv * -(-(Lq * (Hq // Hkv)) // ops.SOLO_QB), dtype=I32, device=device),
                        a["out"], split_tokens, nsplit, 0.1)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("Lq,Hq,Hkv", [(1, 8, 8), (1, 32, 8), (2, 12, 2)])
def test_solo_fake_implementation_takes_consistent_shapes(D, Lq, Hq, Hkv):
    with FakeTensorMode():
        a = layout(D=D, Lq=Lq, Hq=Hq, Hkv=Hkv)
        assert torch.ops.hf_cascade.solo(*solo_args(a)) is None


SOLO_BAD = [  # (argument, how it is wrong, exception): the message names the argument
    ("pool", lambda a, s: s._replace(pool=a["pool"].half()), TypeError),
    ("row_group", lambda a, s: s._replace(row_group=_shaped(s.row_group, 5)), ValueError),
    ("prefix_len", lambda a, s: s._replace(prefix_len=a["prefix_len"].long()), TypeError),
    ("counters", lambda a, s: s._replace(counters=_shaped(s.counters, 3)), ValueError),
    ("counters", lambda a, s: s._replace(counters=s.counters.long()), TypeError),
    ("out", lambda a, s: s._replace(out=a["out"].float()), TypeError),
    ("splits", lambda a, s: s._replace(nsplit=1), ValueError),                 # do not cover the tables
    ("splits", lambda a, s: s._replace(split_tokens=1024, nsplit=1), ValueError),  # past the longest split
    ("part_lse", lambda a, s: s._replace(part_lse=_shaped(s.part_lse, 5)), ValueError),
]


@pytest.mark.parametrize("arg,change,exc", SOLO_BAD, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(SOLO_BAD)])
def test_solo_fake_implementation_names_the_wrong_argument(arg, change, exc):
    with FakeTensorMode():
        a = layout()
        with pytest.raises(exc, match=rf"hf_cascade::solo: .*\b{arg}\b"):
            torch.ops.hf_cascade.solo(*change(a, solo_args(a)))


def test_m_tile_64_needs_head_dim_at_most_128():
    with FakeTensorMode():
        a = layout(D=256, m_tile=32)
        call("prefix", a)
        with pytest.raises(ValueError, match="m_tile 64"):
            call("prefix", {**a, "m_tile": 64})


class _Layer(torch.nn.Module):
    """A projection, the three kernels through hf_cascade.kernels.ops (as attend calls them), a reduction."""

    def __init__(self, D):
        super().__init__()
        self.proj = torch.nn.Linear(D, D, dtype=torch.bfloat16)

    def forward(self, x, a):
        q = self.proj(x).view(a["q"].shape)
        ops.prefix(None, 0, ops.PrefixArgs(q, a["pool"], a["group_rows"], a["prefix_table"], a["prefix_len"],
                                           a["part_o"], a["part_lse"], a["m_tile"], a["row_tiles"], a["chunk_tokens"],
                                           a["max_chunks"], a["scale_log2"], a["q_limit"]))
        ops.suffix(None, 0, ops.SuffixArgs(q, a["pool"], a["suffix_table"], a["q_limit"], a["part_o"], a["part_lse"],
                                           a["split_tokens"], a["nsplit"], a["slot0"], a["scale_log2"]))
        out = torch.empty_like(q)
        ops.merge(None, 0, ops.MergeArgs(a["part_o"], a["part_lse"], a["row_nchunks"], out, a["slot0"], a["nsplit"]))
        return (out.float() * 2).sum()


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()       # no cache (nor automatic dynamic shapes) carried over from another test
    yield
    torch._dynamo.reset()


def test_torch_compile_traces_a_layer_around_the_operators(fresh_dynamo):
    a = layout(device="cpu")
    x = torch.randn(a["q"].numel() // a["q"].shape[-1], a["q"].shape[-1], dtype=torch.bfloat16)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(_Layer(a["q"].shape[-1]), backend=capture, fullgraph=True)
    # the operators have CUDA implementations only: running the graph on the CPU stops at the first one
    with pytest.raises(NotImplementedError, match="hf_cascade::prefix"):
        compiled(x, a)
    assert len(graphs) == 1      # fullgraph: no graph break around the kernels
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    kernels = [t for t in targets if t.startswith("hf_cascade.")]
    assert kernels == ["hf_cascade.prefix", "hf_cascade.suffix", "hf_cascade.merge"]
    assert any("linear" in t for t in targets)


def test_tracing_reports_a_bad_shape_by_name(fresh_dynamo):
    a = layout(device="cpu")
    a["q_limit"] = a["q_limit"][:2]
    x = torch.randn(a["q"].numel() // a["q"].shape[-1], a["q"].shape[-1], dtype=torch.bfloat16)
    compiled = torch.compile(_Layer(a["q"].shape[-1]), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"hf_cascade::suffix: q_limit has shape \(2, 1\), expected \(6, 1\)"):
        compiled(x, a)


# ---------------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu      # skipped without a CUDA device (tests/conftest.py)


def _real_case(dtype=torch.bfloat16, D=128):
    """A random paged layout (tests/kernels/test_gpu_kernels.py), run once through the eager backend; returns the operators'
    arguments bound to that step's buffers and the eager output."""
    from test_gpu_kernels import make_case
    q, pool, plan, scale = make_case(31, dtype=dtype, D=D, Hkv=2, ratio=4, bs=16, groups=((4, 700), (3, 40)),
                                     lone_rows=1, suffix=(1, 300))
    st = cuda_backend.BACKEND.build(plan, q, pool)
    eager = cuda_backend.BACKEND.forward(q, pool, st, AttentionParams(scale))
    dp = st.dp
    a = dict(q=q, pool=pool, group_rows=dp.group_rows, prefix_table=dp.prefix_table, prefix_len=dp.prefix_len,
             suffix_table=dp.suffix_table, q_limit=dp.q_limit, row_nchunks=st.row_nchunks,
             part_o=torch.zeros_like(st.part_o), part_lse=torch.zeros_like(st.part_lse), out=torch.empty_like(q),
             m_tile=st.m_tile, row_tiles=st.row_tiles, chunk_tokens=st.chunk_tokens, max_chunks=st.max_chunks,
             split_tokens=st.split_tokens, nsplit=st.nsplit, slot0=st.max_chunks, scale_log2=scale * cuda_backend.LOG2E,
             pslot0=0, softcap=0.0, window=0, row_nmid=None, mid_slot0=st.max_chunks, sinks=None,
             tune=st.tune)     # the prefix kernel's variant the backend launched (bf16 head_dim 128: the production one)
    assert st.has_prefix and st.max_chunks >= 1
    return a, eager


@gpu
@pytest.mark.parametrize("op", ["prefix", "suffix", "merge"])
def test_gpu_opcheck(op):
    a, _ = _real_case()
    args = {"prefix": ("q", "pool", "group_rows", "prefix_table", "prefix_len", "part_o", "part_lse", "m_tile",
                       "row_tiles", "chunk_tokens", "max_chunks", "scale_log2", "q_limit", "pslot0", "softcap",
                       "window"),
            "suffix": ("q", "pool", "suffix_table", "q_limit", "part_o", "part_lse", "split_tokens", "nsplit",
                       "slot0", "scale_log2", "softcap", "window"),
            "merge": ("part_o", "part_lse", "row_nchunks", "out", "slot0", "nsplit", "row_nmid", "mid_slot0",
                      "sinks")}[op]
    torch.library.opcheck(getattr(torch.ops.hf_cascade, op).default, tuple(a[k] for k in args))


@gpu
@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 128), (torch.float16, 64)])
def test_gpu_solo_operator_passes_opcheck_and_equals_the_eager_backend_bitwise(dtype, D, monkeypatch):
    from hf_cascade.kernels import cuda_tuning
    from test_gpu_kernels import make_case
    monkeypatch.setattr(cuda_tuning, "solo_kernel", True)
    q, pool, plan, scale = make_case(43, dtype=dtype, D=D, Hkv=2, ratio=4, bs=16, groups=((1, 700), (1, 40)),
                                     lone_rows=1, suffix=(1, 60))
    st = cuda_backend.BACKEND.build(plan, q, pool)
    assert st.solo_nsplit >= 1
    eager = cuda_backend.BACKEND.forward(q, pool, st, AttentionParams(scale))
    dp = st.dp
    args = ops.SoloArgs(q, pool, st.row_group, dp.prefix_table, dp.prefix_len, dp.suffix_table, dp.q_limit,
                        torch.zeros_like(st.part_o), torch.zeros_like(st.part_lse), torch.zeros_like(st.counters),
                        torch.empty_like(q), st.solo_split, st.solo_nsplit, scale * cuda_backend.LOG2E)
    torch.library.opcheck(torch.ops.hf_cascade.solo.default, tuple(args))
    torch.ops.hf_cascade.solo(*args)
    torch.cuda.synchronize()
    assert torch.equal(args.out, eager) and (args.counters == 0).all()


@gpu
@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 128), (torch.float16, 64), (torch.bfloat16, 256)])
def test_gpu_operators_equal_the_eager_backend_bitwise(dtype, D):
    a, eager = _real_case(dtype, D)
    for name in ("prefix", "suffix", "merge"):
        call(name, a)
    torch.cuda.synchronize()
    assert torch.equal(a["out"], eager)


@gpu
def test_gpu_attend_captures_in_a_cuda_graph_and_replays_bitwise():
    # the launches make no CUDA call but the launch (the prefix's one-time setup ran in the first, eager call)
    from test_gpu_kernels import make_case
    q, pool, plan, scale = make_case(41, dtype=torch.bfloat16, D=128, Hkv=2, ratio=4, bs=16,
                                     groups=((4, 700), (3, 40)), lone_rows=1, suffix=(1, 300))
    backend = cuda_backend.BACKEND
    st = backend.build(plan, q, pool)          # the launch state: before the capture
    params = AttentionParams(scale)
    backend.forward(q, pool, st, params)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, pool, st, params)
    for seed in (1, 2):
        q.copy_(torch.randn(q.shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, backend.forward(q.clone(), pool, st, params))


@gpu
@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_gpu_compiled_layer_equals_eager_bitwise(compile_backend, fresh_dynamo):
    # the three kernels through hf_cascade.kernels.ops inside torch.compile (the operators) vs eager (ctypes)
    a, _ = _real_case()
    lib = cuda_backend.library(a["q"].device)
    stream = torch.cuda.current_stream().cuda_stream      # eager launches' stream (the operators find their own)

    def layer(q, part_o, part_lse):
        ops.prefix(lib, stream, ops.PrefixArgs(q, a["pool"], a["group_rows"], a["prefix_table"], a["prefix_len"],
                                               part_o, part_lse, a["m_tile"], a["row_tiles"], a["chunk_tokens"],
                                               a["max_chunks"], a["scale_log2"], a["q_limit"]))
        ops.suffix(lib, stream, ops.SuffixArgs(q, a["pool"], a["suffix_table"], a["q_limit"], part_o, part_lse,
                                               a["split_tokens"], a["nsplit"], a["slot0"], a["scale_log2"]))
        out = torch.empty_like(q)
        ops.merge(lib, stream, ops.MergeArgs(part_o, part_lse, a["row_nchunks"], out, a["slot0"], a["nsplit"]))
        return out * 2

    q = (a["q"].float() * 0.5).to(a["q"].dtype)
    eager = layer(q, torch.zeros_like(a["part_o"]), torch.zeros_like(a["part_lse"]))
    compiled = torch.compile(layer, backend=compile_backend, fullgraph=True)
    got = compiled(q, torch.zeros_like(a["part_o"]), torch.zeros_like(a["part_lse"]))
    torch.cuda.synchronize()
    assert torch.equal(got, eager)
