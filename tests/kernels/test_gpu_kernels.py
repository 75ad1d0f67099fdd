"""The CUDA backend (csrc/*.cu via hf_cascade.kernels.cuda) against the reference backend.

GPU tests (marked ``gpu``; tests/conftest.py skips them without CUDA) each build a random paged layout on
the GPU (tests/kernels/kernel_helpers.py): a pool whose blocks are handed out in a random permutation, unused
blocks and slots filled with NaN garbage, groups of different sizes (one with an empty prefix), rows in
no group, prefixes that end inside a block. The shapes run as one grid: dtype x head_dim x GQA ratio x
block size x query tokens per row.
The reference runs in float32 on the same inputs; the CUDA output (bf16/fp16) must match it to a relative
error below 1e-2 overall (2e-2 per row and query) with no NaN.

The per-layer variants (sliding window, softcap, attention sinks) run as a combined grid (window x softcap x
sinks x GQA ratio x head_dim x dtype, prefixes up to 4k, suffixes up to 300) against the float32 reference, and
three-level plans (a shared system prompt, each prompt's rest, each row's suffix) against the reference's
three-level attention.

Run on the GPU machine:  PYTHONPATH=. python -m pytest -q -m gpu tests/kernels/test_gpu_kernels.py
"""
from __future__ import annotations


import numpy as np
import pytest
import torch

from hf_cascade import kernels
from hf_cascade.kernels import cuda as cuda_backend
from hf_cascade.kernels import cuda_binding, cuda_tuning
from hf_cascade.kernels import reference
from hf_cascade.kernels.base import AttentionParams, as_params
from kernel_helpers import padded_pairs, random_layout, random_three_level, step_context_of, step_plan

BF, FP = torch.bfloat16, torch.float16


def make_case(seed, *, dtype=BF, D=128, Hkv=2, ratio=4, bs=16, groups=((3, 100),), lone_rows=1, suffix=(1, 40),
              **kw):
    """A random layout on the GPU (:func:`kernel_helpers.random_layout`, NaN in unused slots and blocks):
    (q, pool, plan, scale)."""
    lay = random_layout(seed, groups=groups, lone_rows=lone_rows, suffix=suffix, Hkv=Hkv, ratio=ratio, D=D, bs=bs,
                        dtype=dtype, device="cuda", q_scale=1.5, extra_blocks=5, **kw)
    return lay.q, lay.pool, lay.plan(), lay.scale


def states(plan) -> list:
    """The cuda backend's launch states built for ``plan``'s layers so far (one per layer shape and kind)."""
    return list(step_context_of(plan).metadata.values())


def cuda_attend(q, pool, plan, params):
    """One layer on the cuda backend as the attention runs it: the step's metadata, then the layer's forward
    (``params``: the layer's AttentionParams, or a bare scale)."""
    params = as_params(params)
    metadata = step_context_of(plan).backend_metadata(cuda_backend.BACKEND, q, pool, params)
    return cuda_backend.BACKEND.forward(q, pool, metadata, params)


def check_case(q, pool, plan, scale, *, tol=1e-2, row_tol=2e-2):
    out = cuda_attend(q, pool, plan, scale)
    torch.cuda.synchronize()
    ref = reference.attend(q.float(), pool.float(), plan, scale)
    return compare(out, ref, q, tol=tol, row_tol=row_tol)


def check_variants(q, pool, plan, scale, *, softcap=None, window=None, sinks=None, tol=1e-2, row_tol=2e-2):
    """The cuda backend with a layer's variants vs the float32 reference with the same ones; returns both."""
    params = AttentionParams(scale, softcap=softcap, window=window, sinks=sinks)
    assert kernels.select("cuda", q, pool, plan, params) is cuda_backend.BACKEND    # the backend declares them
    out = cuda_attend(q, pool, plan, params)
    torch.cuda.synchronize()
    ref = reference.attend(q.float(), pool.float(), plan, AttentionParams(
        scale, softcap=softcap, window=window, sinks=None if sinks is None else sinks.float()))
    compare(out, ref, q, tol=tol, row_tol=row_tol)
    return out, ref


def compare(out, ref, q, *, tol=1e-2, row_tol=2e-2):
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    o = out.float()
    assert torch.isfinite(o).all(), "NaN/inf in the CUDA output"
    assert torch.isfinite(ref).all()
    err = (o - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err < tol, f"relative error {err:.3e}"
    # per (row, query): a single wrong row must not hide in the global norm
    diff = (o - ref).flatten(2).norm(dim=-1)
    scale_ = ref.flatten(2).norm(dim=-1)
    zero = scale_ == 0
    assert (diff[zero] == 0).all(), "rows that see no key must be exactly 0"
    worst = (diff[~zero] / scale_[~zero]).max() if (~zero).any() else torch.tensor(0.0)
    assert worst < row_tol, f"worst row relative error {worst:.3e}"
    return out


@pytest.fixture(autouse=True)
def _debug_sync(monkeypatch):
    monkeypatch.setattr(cuda_binding, "debug_sync", True)   # report a failing kernel by name


# ----------------------------------------------------------------------------------------- CPU tests

def test_unsupported_reason_cpu():
    lay = random_layout(0, D=64, dtype=BF)
    reason = cuda_backend.BACKEND.unsupported_reason(lay.q, lay.pool, lay.plan())
    assert isinstance(reason, str) and "CUDA" in reason


def test_chunk_rule_fills_the_gpu():
    # Llama-3-8B layer, 8 groups x 8 beams, prefix 16k, block 16, H200 (132 SMs, 2 CTAs/SM): >= 1 full wave
    for plen in (1024, 4096, 16384, 32768):
        cb = cuda_backend.choose_chunk_blocks([plen // 16] * 8, 8, 264, 16, 64)
        ctas = 8 * 8 * -(-(plen // 16) // cb)
        assert (cb * 16) % 64 == 0 and cb * 16 >= 256
        assert ctas >= 256 and ctas / (-(-ctas // 264) * 264) >= 0.9, (plen, cb, ctas)
    assert cuda_backend.choose_chunk_blocks([0, 0], 8, 264, 16, 64) == 1
    assert cuda_backend.choose_chunk_blocks([3], 8, 264, 16, 64) >= 3        # a short prefix: one chunk
    # v2's preference: 1024-token chunks while they still fill a wave (396 slots: 3 CTAs/SM)
    assert cuda_backend.choose_chunk_blocks([1024] * 8, 8, 396, 16, 32, prefer_tokens=1024) == 64
    short = cuda_backend.choose_chunk_blocks([64] * 8, 8, 396, 16, 32, prefer_tokens=1024)
    assert short == cuda_backend.choose_chunk_blocks([64] * 8, 8, 396, 16, 32) < 64   # 1k: the wave rule
    assert cuda_backend.choose_suffix_split(64, 512, 528) == (64, 1)
    assert cuda_backend.choose_suffix_split(0, 512, 528) == (1, 1)
    split, n = cuda_backend.choose_suffix_split(16448, 512, 528)
    assert n > 1 and split * n >= 16448


def test_solo_split_rule():
    # one 8B greedy row at 4k (8 KV heads; the H200: 132 SMs x 3 CTAs): about a wave of CTAs in aligned splits
    split, n = cuda_tuning.choose_solo_split(4176, 8, 396)
    assert split % cuda_tuning.SOLO_SPLIT_ALIGN == 0 and 64 <= split <= 512 and split * n >= 4176
    assert 396 // 2 <= 8 * n <= 396 * 3 // 2
    assert cuda_tuning.choose_solo_split(0, 8, 396) == (64, 1)
    assert cuda_tuning.choose_solo_split(4176, 512, 396)[0] == 512                 # many rows: the longest splits
    assert cuda_tuning.choose_solo_split(64 * 512, 8, 396) == (512, 64)
    assert cuda_tuning.choose_solo_split(64 * 512 + 1, 8, 396) is None            # longer: the three kernels


class _SoloLib:
    has_solo = True


@pytest.mark.parametrize("case", ["solo", "off", "old library", "shared prefix", "two queries", "three levels",
                                  "fp8 pool"])
def test_solo_launch_only_where_no_row_shares_its_prefix(case, monkeypatch):
    monkeypatch.setattr(cuda_tuning, "solo_kernel", case != "off")
    lib = object() if case == "old library" else _SoloLib()
    groups = ((2, 40), (1, 9)) if case == "shared prefix" else ((1, 40), (1, 0))
    Lq = 2 if case == "two queries" else 1
    lay = random_layout(3, groups=groups, lone_rows=1, Lq=Lq, Hkv=2, ratio=4, D=64, bs=16, dtype=BF)
    plan, pool = lay.plan(), lay.pool
    if case == "fp8 pool":
        pool = pool.to(torch.float8_e4m3fn)
    got = cuda_backend._solo_split(lib, plan, pool, lay.q.shape[0], Lq, 2, 4, 16, 132, case == "three levels")
    if case == "solo":
        capacity = (plan.prefix_table.shape[1] + plan.suffix_table.shape[1]) * 16
        assert got == cuda_tuning.choose_solo_split(capacity, lay.q.shape[0] * 2, 132 * cuda_tuning.SOLO_CTAS_PER_SM)
        assert got is not None
    else:
        assert got is None


# ----------------------------------------------------------------------------------------- GPU tests

@pytest.mark.gpu
@pytest.mark.parametrize("Lq", [1, 3])
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [BF, FP], ids=["bf16", "fp16"])
def test_shape_grid(dtype, D, ratio, bs, Lq):
    # groups of different sizes, one with an empty prefix, prefixes ending inside a block; two rows in no
    # group; with Lq > 1 each query sees a random part of its suffix
    Hkv = {1: 8, 4: 4, 8: 2}[ratio]
    seed = D + 10 * ratio + bs + Lq + (dtype == FP)
    case = make_case(seed, dtype=dtype, D=D, Hkv=Hkv, ratio=ratio, bs=bs, Lq=Lq, random_limits=Lq > 1,
                     groups=((8, 2 * bs * 7 + 5), (3, 17), (2, 0), (5, 3 * bs + 1)), lone_rows=2, suffix=(1, 3 * bs))
    assert cuda_backend.BACKEND.unsupported_reason(case[0], case[1], case[2]) is None
    check_case(*case)


@pytest.mark.gpu
@pytest.mark.parametrize("Lq,random_limits", [(2, False), (3, True), (5, False), (4, True)])
def test_multi_query_steps(Lq, random_limits):
    # 8 rows x Lq x GQA 8 query rows per group and KV head (> 64: several row tiles); q_limit 0 rows too
    case = make_case(200 + Lq, dtype=FP, D=128, Hkv=2, ratio=8, bs=16, Lq=Lq,
                     groups=((8, 700), (2, 33), (3, 0)), lone_rows=2, suffix=(1, 60),
                     random_limits=random_limits, empty_suffix_rows=1)
    check_case(*case)
    state = states(case[2])[0]
    assert state.row_tiles > 1


@pytest.mark.gpu
@pytest.mark.parametrize("suffix", [(1, 8), (200, 1024)])
def test_suffix_lengths(suffix):
    case = make_case(300 + suffix[1], dtype=BF, D=64, Hkv=4, ratio=2, bs=16,
                     groups=((4, 512), (3, 64)), lone_rows=3, suffix=suffix)
    check_case(*case)


@pytest.mark.gpu
@pytest.mark.parametrize("plen,bs", [(4096 + 7, 16), (32768, 64)])
def test_long_prefix_is_chunked(plen, bs):
    case = make_case(400 + bs, dtype=BF, D=128, Hkv=2, ratio=4, bs=bs,
                     groups=((4, plen), (2, plen // 3)), lone_rows=1, suffix=(1, 64))
    check_case(*case)
    state = states(case[2])[0]
    assert state.max_chunks > 1


@pytest.mark.gpu
def test_llama_layer_shape():
    # the benchmark's shape, smaller prefix: 32/8 heads, head_dim 128, 8 groups x 8 beams, suffix 64
    case = make_case(500, dtype=BF, D=128, Hkv=8, ratio=4, bs=16,
                     groups=tuple((8, 2048) for _ in range(8)), lone_rows=0, suffix=(64, 64))
    check_case(*case)


@pytest.mark.gpu
def test_no_groups_long_suffix_split():
    # paged decode over whole tables: no prefix groups, long suffixes split across CTAs
    case = make_case(600, dtype=FP, D=128, Hkv=2, ratio=4, bs=16, groups=(), lone_rows=6,
                     suffix=(1500, 5000))
    check_case(*case)
    state = states(case[2])[0]
    assert not state.has_prefix and state.nsplit > 1


@pytest.mark.gpu
def test_nothing_visible_gives_zeros():
    # a lone row whose queries see nothing, and a grouped row with an empty suffix and an empty prefix
    q, pool, plan, scale = make_case(700, dtype=BF, D=128, Hkv=2, ratio=4, bs=16,
                                     groups=((2, 0), (3, 40)), lone_rows=2, suffix=(1, 30))
    lone = np.setdiff1d(np.arange(q.shape[0]), plan.group_rows[plan.group_rows >= 0])
    plan.q_limit[lone[0]] = 0
    plan.q_limit[plan.group_rows[0, 0]] = 0
    out = check_case(q, pool, plan, scale)
    assert (out[int(lone[0])] == 0).all() and (out[int(plan.group_rows[0, 0])] == 0).all()


@pytest.mark.gpu
def test_layers_reuse_the_step_state_and_views():
    # two "layers" with different pools/queries and one plan; q as attention.py passes it (a transposed view)
    q, pool, plan, scale = make_case(800, dtype=BF, D=128, Hkv=2, ratio=4, bs=16,
                                     groups=((4, 300), (3, 90)), lone_rows=1, suffix=(1, 50))
    check_case(q.transpose(1, 2).contiguous().transpose(1, 2), pool, plan, scale)
    pool2 = torch.randn_like(pool, dtype=torch.float32).to(pool.dtype)
    q2 = torch.randn_like(q, dtype=torch.float32).to(q.dtype)
    check_case(q2, pool2, plan, scale)
    assert len(states(plan)) == 1


@pytest.mark.gpu
def test_rejects_bad_plans_loudly():
    q, pool, plan, scale = make_case(900, dtype=BF, D=64, Hkv=2, ratio=2, bs=16,
                                     groups=((2, 40),), lone_rows=1, suffix=(1, 20))
    plan.suffix_table[0, 0] = pool.shape[0] + 5
    with pytest.raises(ValueError):
        cuda_backend.attend(q, pool, plan, scale)
    assert "dtype" in cuda_backend.BACKEND.unsupported_reason(q.float(), pool.float(), plan)


# ------------------------------------------------------------------------- the Hopper prefix kernel (GPU)

def _hopper_kernel_runs() -> bool:
    lib = cuda_backend.library(torch.device("cuda"))
    return lib.prefix_runs(cuda_backend.DTYPE_CODES[BF], 128, 64, cuda_tuning.HOPPER_KERNEL)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("groups,Lq", [(((3, 700), (2, 90), (2, 0)), 1), (((1, 5000), (4, 1500)), 1),
                                       (((2, 4100),), 3), (((16, 2100),), 1)])
@pytest.mark.parametrize("dtype", [BF, FP], ids=["bf16", "fp16"])
def test_hopper_prefix_kernel(dtype, groups, Lq, bs):
    """csrc/prefix_sm90.cu ("kernel=sm90": wgmma fed by a producer warp) against the float32 reference: groups of
    4 to 64 query rows in 64-row tiles (8 query heads per KV head), chunked prefixes ending inside a block, rows in no
    group, NaN garbage in unused slots, several query tokens per row. Runs where the library holds sm_90a code."""
    if torch.cuda.get_device_capability() != (9, 0) or not _hopper_kernel_runs():
        pytest.skip("the Hopper prefix kernel needs a compute-capability-9.0 GPU and the library's sm_90a code")
    cuda_backend.set_prefix_tune("kernel=sm90")
    try:
        q, pool, plan, scale = make_case(5, dtype=dtype, D=128, Hkv=2, ratio=8, bs=bs, groups=groups, Lq=Lq,
                                         suffix=(Lq, 60))
        check_case(q, pool, plan, scale)
        st = states(plan)[0]
        assert st.tune == cuda_tuning.HOPPER_KERNEL and st.m_tile == 64   # the kernel ran
    finally:
        cuda_backend.set_prefix_tune(None)


# ------------------------------------------------------------------------------------ variants (GPU)

WINDOWS = (None, 1, 37, 1000)      # off, only the query itself, inside the suffix mostly, across prefix chunks
SOFTCAP = 3.0                      # small enough to change the softmax of these logits (checked below)


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [BF, FP], ids=["bf16", "fp16"])
def test_variant_grid(dtype, D, ratio):
    # one layout per (dtype, D, ratio): a group with a prefix of 1k-4k tokens (ending inside a block), a short
    # one, an empty one, rows in no group, suffixes 1-300; Lq 1 or 3 (random limits); every combination of
    # window x softcap x sinks on it
    seed = 1000 + D + 10 * ratio + (dtype == FP)
    rng = np.random.default_rng(seed)
    Lq = 3 if (D + ratio) % 3 == 0 else 1
    Hkv = {1: 4, 4: 2, 8: 1}[ratio]
    q, pool, plan, scale = make_case(seed, dtype=dtype, D=D, Hkv=Hkv, ratio=ratio, bs=16, Lq=Lq,
                                     random_limits=Lq > 1, lone_rows=2, suffix=(1, 300),
                                     groups=((4, int(rng.integers(1024, 4097))), (2, int(rng.integers(1, 300))),
                                             (2, 0)))
    sinks = (2.0 * torch.randn(q.shape[2], generator=torch.Generator().manual_seed(seed))).cuda()
    results = {}
    for window in WINDOWS:
        for softcap in (None, SOFTCAP):
            for with_sinks in (False, True):
                results[window, softcap, with_sinks] = check_variants(
                    q, pool, plan, scale, softcap=softcap, window=window, sinks=sinks if with_sinks else None)
    # each variant changes the result (so the comparisons above check it)
    plain = results[None, None, False][1]
    for key in ((37, None, False), (1000, None, False), (None, SOFTCAP, False), (None, None, True)):
        assert not torch.allclose(results[key][1], plain, atol=1e-3), key
    # one state for all variants of the step: the launch shapes do not depend on them (head_dim 128: plain layers
    # may run the production tuning variant or the Hopper kernel, layers with softcap / window the default kernel:
    # two states)
    assert len(states(plan)) == (2 if D == 128 else 1)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [64, 300])
def test_window_skips_long_prefix_chunks(window):
    # an 8k prefix cut into many chunks: chunks and tiles before every row's window are skipped, the edge masked
    q, pool, plan, scale = make_case(1100 + window, dtype=BF, D=128, Hkv=2, ratio=4, bs=16,
                                     groups=((4, 8192 + 5), (3, 2000)), lone_rows=1, suffix=(1, 100))
    check_variants(q, pool, plan, scale, window=window, softcap=50.0)
    assert states(plan)[0].max_chunks > 2


@pytest.mark.gpu
def test_window_in_a_cuda_graph_follows_the_device_lengths(monkeypatch):
    monkeypatch.setattr(cuda_binding, "debug_sync", False)   # no device synchronisation inside a capture
    # the window is applied from the device-side lengths: a captured step replays correctly after the lengths
    # change (as a static decode layout's buffers do between steps), with the same launch shapes
    q, pool, plan, scale = make_case(1200, dtype=BF, D=128, Hkv=2, ratio=4, bs=16,
                                     groups=((4, 700), (3, 90)), lone_rows=1, suffix=(40, 120))
    params = AttentionParams(scale, window=64, softcap=20.0)
    cuda_attend(q, pool, plan, params)            # the prefix kernel's one-time setup, the step state
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_attend(q, pool, plan, params)
    dp = plan.on(q.device)
    for cut in (0, 30):
        plan.q_limit[:] = np.maximum(plan.q_limit - cut, 0)   # fewer suffix tokens: the window moves back
        dp.q_limit.copy_(torch.from_numpy(plan.q_limit))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.attend(q.float(), pool.float(), plan, params)
        compare(out, ref, q)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF, FP], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("ratio,Lq", [(1, 1), (4, 2), (8, 1)])
def test_three_level_plans(ratio, Lq, D, dtype):
    # small three-level layouts (tests/kernels/test_reference_kernels.py): subgroups with and without a middle level,
    # a row in no subgroup, rows in no group, NaN in unused slots; with softcap and sinks too
    from test_reference_kernels import make_three_level
    lay = make_three_level(1300 + ratio + Lq + D, Lq=Lq, Hkv=2, ratio=ratio, D=D, bs=16, dtype=torch.float32)
    q, pool = lay.q.to("cuda", dtype), lay.pool.to("cuda", dtype)
    plan = step_plan(lay)
    sinks = lay.sinks.cuda()
    for softcap, s in ((None, None), (SOFTCAP, None), (None, sinks), (SOFTCAP, sinks)):
        check_variants(q, pool, plan, lay.scale, softcap=softcap, sinks=s)
    st = states(plan)[0]
    assert st.three and st.mid.has and st.mid.max_chunks >= 1
    # a layer with a window reads the same plan as two levels (the reference's semantics), next to the others
    check_variants(q, pool, plan, lay.scale, window=20, sinks=sinks)
    # head_dim 128: plain layers may run the production tuning variant or the Hopper kernel: a state of their own
    assert len(states(plan)) == (3 if D == 128 else 2)


@pytest.mark.gpu
@pytest.mark.parametrize("D,ratio", [(128, 4), (64, 8)])
def test_three_levels_long(D, ratio):
    # 4 prompts x 4 beams sharing a 2k system prompt, each prompt's own 300-700 tokens, suffixes up to 64, plus
    # rows in no group: both shared levels are chunked
    lay = random_three_level(1400 + D, sys_tokens=2048, prompts=4, beams=4, own_tokens=(300, 700), suffix=(1, 64),
                             lone_rows=2, Lq=1, Hkv=2, ratio=ratio, D=D, bs=16)
    q, pool = lay.q.to("cuda", BF), lay.pool.to("cuda", BF)
    plan = step_plan(lay)
    check_variants(q, pool, plan, lay.scale, softcap=50.0)
    st = states(plan)[0]
    assert st.three and st.max_chunks >= 1 and st.mid.max_chunks >= 1
    assert (st.row_nmid.cpu().numpy() > 0).sum() == 16


def _assert_the_replayed_write_gives(want, pool, args) -> None:
    """The library's write of ``args`` into a copy of ``pool``, captured in a CUDA graph and replayed, leaves ``want``
    byte for byte."""
    from hf_cascade.kernels import cuda_library
    replayed = pool.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert cuda_library.write_slots(replayed, *args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed.view(torch.uint8), want.view(torch.uint8))


def _write_indices(g, blocks: int, bs: int, tokens: int, copies: int):
    """A step's write indices (write_block, write_offset, copy_src, copy_dst; int64, contiguous): real block copies,
    a static step's padding (pair 0 repeated, a block copied onto itself), tokens written into the copied blocks."""
    ids = torch.randperm(blocks, device="cuda", generator=g)
    real = max(copies - 2, min(copies, 1))             # the rest pads: pair 0 repeated, one self-copy
    src, dst = ids[:real], ids[real:2 * real]
    copy_src = torch.cat([src, src[:1].expand(max(copies - real - 1, 0)), ids[-1:]])[:copies].contiguous()
    copy_dst = torch.cat([dst, dst[:1].expand(max(copies - real - 1, 0)), ids[-1:]])[:copies].contiguous()
    write_block = torch.cat([dst, ids[2 * real:]])[:tokens].contiguous() if tokens else dst[:0].contiguous()
    write_offset = torch.randint(0, bs, (tokens,), device="cuda", generator=g)
    return write_block, write_offset, copy_src, copy_dst


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("tokens, copies", [(8, 8), (1, 1), (13, 3), (8, 0), (0, 2)])
def test_the_write_kernel_equals_the_torch_write(dtype, tokens, copies, monkeypatch):
    """csrc/write.cu (copy-on-write copies, then each token's K and V) leaves the pool byte for byte as the torch
    write does: real copies, a static step's padding (pair 0 repeated, a block copied onto itself), writes into the
    copied blocks, eagerly and replayed from a CUDA graph."""
    from hf_cascade import cache as cache_module
    from hf_cascade.kernels import cuda_library
    monkeypatch.setattr(cuda_library, "write_kernel", True)
    cuda_backend.library(torch.device("cuda"))          # loaded, as the cuda backend loads it
    g = torch.Generator(device="cuda").manual_seed(tokens * 10 + copies)
    blocks, bs, H, D = 40, 16, 8, 128
    pool = torch.randn(blocks, 2, bs, H, D, device="cuda", generator=g).to(dtype)
    key = torch.randn(tokens, H, D, device="cuda", generator=g).to(dtype)
    value = torch.randn(tokens, H, D, device="cuda", generator=g).to(dtype)
    write_block, write_offset, copy_src, copy_dst = _write_indices(g, blocks, bs, tokens, copies)
    want, got = pool.clone(), pool.clone()
    args = (key, value, write_block, write_offset, copy_src, copy_dst, copies > 0)
    cache_module._write_slots_torch(want, *args)
    assert cuda_library.write_slots(got, *args)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    _assert_the_replayed_write_gives(want, pool, args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout", ["fused_v", "fused_kv"])
@pytest.mark.parametrize("tokens, copies", [(8, 8), (1, 1), (13, 3), (8, 0), (0, 2)])
def test_the_strided_write_kernel_equals_the_torch_write(dtype, layout, tokens, copies, monkeypatch):
    """hfc_write_strided (cuda_library.strided_write on) reads V, or K and V, where they lie as column slices of a
    fused [tokens, q | k | v] product (an 8B layer's widths) and leaves the pool byte for byte as the torch write does,
    eagerly and replayed from a CUDA graph; the cache's dispatch hands them over uncopied (strided_write is on by
    default since this passed on the H200)."""
    from hf_cascade import cache as cache_module
    from hf_cascade.kernels import cuda_library
    monkeypatch.setattr(cuda_library, "write_kernel", True)
    monkeypatch.setattr(cuda_library, "strided_write", True)
    lib = cuda_backend.library(torch.device("cuda"))
    assert lib.has_strided_write
    entries = []
    for name in ("write", "write_strided"):
        def spy(*args, _name=name, _launch=getattr(lib, name)):
            entries.append(_name)
            return _launch(*args)
        monkeypatch.setattr(lib, name, spy)
    g = torch.Generator(device="cuda").manual_seed(tokens * 10 + copies + 1)
    blocks, bs, Hq, H, D = 40, 16, 32, 8, 128
    pool = torch.randn(blocks, 2, bs, H, D, device="cuda", generator=g).to(dtype)
    fused = torch.randn(tokens, (Hq + 2 * H) * D, device="cuda", generator=g).to(dtype)
    key = fused[:, Hq * D:(Hq + H) * D].view(tokens, H, D)
    key = key if layout == "fused_kv" else key.contiguous()
    value = fused[:, (Hq + H) * D:].view(tokens, H, D)
    assert value.is_contiguous() == (tokens <= 1)
    assert cuda_library.write_fits(pool, key, value)
    write_block, write_offset, copy_src, copy_dst = _write_indices(g, blocks, bs, tokens, copies)
    want, got = pool.clone(), pool.clone()
    args = (key, value, write_block, write_offset, copy_src, copy_dst, copies > 0)
    cache_module._write_slots_torch(want, *args)
    assert cache_module._write_slots_kernel(got, *args)
    assert entries == ["write_strided" if tokens > 1 else "write"]
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    _assert_the_replayed_write_gives(want, pool, args)


def _per_layer_copies(pools, copy_src, copy_dst) -> list:
    """Each pool as its layer's own torch write leaves it with these copies and no tokens."""
    from hf_cascade.kv import cache as cache_module
    out, none = [], torch.zeros(0, dtype=torch.int64, device="cuda")
    for pool in pools:
        want = pool.clone()
        empty = want.new_empty((0, *want.shape[3:]))
        cache_module._write_slots_torch(want, empty, empty, none, none, copy_src, copy_dst, True)
        out.append(want)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layers, real, copies", [(32, 5, 8), (3, 1, 1), (4, 0, 3), (2, 13, 16), (12, 64, 64)])
def test_the_all_layer_copy_kernel_equals_per_layer_torch_copies(dtype, layers, real, copies):
    """hfc_copy_blocks_layers (cuda_library.copy_blocks_layers: one launch over the pools' addresses) leaves every
    layer's pool byte for byte as its own torch copy does (ragged pairs, a static step's padding: pair 0 repeated, a
    self-copy; 8B-shaped 64 KB blocks), eagerly and replayed from a CUDA graph; the graph reads the addresses and the
    pairs when it replays (other pairs written into the same tensors after the capture are the ones copied)."""
    from hf_cascade.kernels import cuda_library
    lib = cuda_backend.library(torch.device("cuda"))        # loaded, as the cuda backend loads it
    assert lib.has_layer_copies
    g = torch.Generator(device="cuda").manual_seed(layers * 100 + real * 10 + copies)
    blocks, bs, H, D = 160, 16, 8, 128
    pools = [torch.randn(blocks, 2, bs, H, D, device="cuda", generator=g).to(dtype) for _ in range(layers)]
    block_bytes = 2 * bs * H * D * pools[0].element_size()
    copy_src, copy_dst = padded_pairs(g, blocks, real, copies, device="cuda")
    want = _per_layer_copies(pools, copy_src, copy_dst)
    got = [p.clone() for p in pools]
    addresses = torch.tensor([p.data_ptr() for p in got], dtype=torch.int64, device="cuda")
    assert cuda_library.copy_blocks_layers(addresses, copy_src, copy_dst, block_bytes)
    torch.cuda.synchronize()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want))
    # captured with other pairs in the tensors, replayed after this case's are written in: this case's copies
    replayed = [p.clone() for p in pools]
    addresses.copy_(torch.tensor([p.data_ptr() for p in replayed], dtype=torch.int64))
    src, dst = copy_src.clone(), copy_dst.clone()
    other_src, other_dst = padded_pairs(g, blocks, min(real + 1, copies), copies, device="cuda")
    src.copy_(other_src), dst.copy_(other_dst)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert cuda_library.copy_blocks_layers(addresses, src, dst, block_bytes)
    src.copy_(copy_src), dst.copy_(copy_dst)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(replayed, want))


# ------------------------------------------------------------------ rows that share no prefix in one launch (GPU)

@pytest.fixture
def solo_on(monkeypatch):
    """``cuda_tuning.solo_kernel`` on: a state whose rows share no prefix launches csrc/solo.cu."""
    monkeypatch.setattr(cuda_tuning, "solo_kernel", True)


def _solo_state(plan):
    state, = states(plan)
    assert state.solo_nsplit >= 1, "the solo kernel did not take the step"
    return state


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("ratio", [1, 4, 6, 8])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [BF, FP], ids=["bf16", "fp16"])
def test_solo_kernel_shape_grid(solo_on, dtype, D, ratio, bs):
    # groups of one row (prefixes ending inside a block, one empty), rows in no group, suffixes of 1 to 3 blocks;
    # GQA 6: two query blocks per KV head, the second half empty
    Hkv = {1: 8, 4: 4, 6: 2, 8: 2}[ratio]
    case = make_case(3000 + D + ratio + bs + (dtype == FP), dtype=dtype, D=D, Hkv=Hkv, ratio=ratio, bs=bs,
                     groups=((1, 2 * bs * 7 + 5), (1, 17), (1, 0), (1, 3 * bs + 1)), lone_rows=2, suffix=(1, 3 * bs))
    check_case(*case)
    state = _solo_state(case[2])
    assert (state.counters == 0).all(), "the last CTAs must leave the counters at 0"


@pytest.mark.gpu
@pytest.mark.parametrize("plen,bs", [(4096 + 7, 16), (16384, 16), (9000, 64)])
def test_solo_kernel_long_rows_split(solo_on, plen, bs):
    # a greedy step's shape: every split of the row counted and merged by the last CTA, prefix splits and suffix splits
    case = make_case(3100 + bs, dtype=BF, D=128, Hkv=8, ratio=4, bs=bs, groups=((1, plen), (1, plen // 3)),
                     lone_rows=1, suffix=(1, 64))
    check_case(*case)
    state = _solo_state(case[2])
    assert state.solo_nsplit > 8 and (state.counters == 0).all()
    check_case(*case)        # a second launch on the counters the first left


@pytest.mark.gpu
def test_solo_kernel_nothing_visible_gives_zeros(solo_on):
    q, pool, plan, scale = make_case(3200, dtype=BF, D=128, Hkv=2, ratio=4, bs=16,
                                     groups=((1, 0), (1, 40)), lone_rows=2, suffix=(1, 30))
    lone = np.setdiff1d(np.arange(q.shape[0]), plan.group_rows[plan.group_rows >= 0])
    plan.q_limit[lone[0]] = 0
    plan.q_limit[plan.group_rows[0, 0]] = 0
    out = check_case(q, pool, plan, scale)
    assert (out[int(lone[0])] == 0).all() and (out[int(plan.group_rows[0, 0])] == 0).all()
    _solo_state(plan)


@pytest.mark.gpu
def test_solo_state_leaves_shared_prefixes_and_variants_to_the_three_kernels(solo_on):
    # a group of two rows: the three kernels; a solo state's layer with a window, a softcap or sinks: the three kernels
    q, pool, plan, scale = make_case(3300, dtype=BF, D=128, Hkv=2, ratio=4, bs=16, groups=((2, 300), (1, 90)),
                                     lone_rows=1, suffix=(1, 50))
    check_case(q, pool, plan, scale)
    assert states(plan)[0].solo_nsplit == 0
    q, pool, plan, scale = make_case(3301, dtype=BF, D=128, Hkv=2, ratio=4, bs=16, groups=((1, 700), (1, 90)),
                                     lone_rows=1, suffix=(40, 120))
    sinks = torch.randn(q.shape[2], device="cuda")
    for kw in (dict(window=64), dict(softcap=SOFTCAP), dict(sinks=sinks)):
        check_variants(q, pool, plan, scale, **kw)
    assert any(st.solo_nsplit for st in states(plan))


@pytest.mark.gpu
def test_solo_kernel_in_a_cuda_graph_follows_the_device_lengths(solo_on, monkeypatch):
    monkeypatch.setattr(cuda_binding, "debug_sync", False)   # no device synchronisation inside a capture
    # a static decode layout's replays: the lengths change on the device, the launch and its counters stay
    q, pool, plan, scale = make_case(3400, dtype=BF, D=128, Hkv=8, ratio=4, bs=16,
                                     groups=((1, 3000), (1, 900)), lone_rows=1, suffix=(40, 120))
    cuda_attend(q, pool, plan, scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_attend(q, pool, plan, scale)
    dp = plan.on(q.device)
    for cut in (0, 30, 7):
        plan.q_limit[:] = np.maximum(plan.q_limit - cut, 0)
        dp.q_limit.copy_(torch.from_numpy(plan.q_limit))
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
        compare(out, reference.attend(q.float(), pool.float(), plan, scale), q)
    assert (_solo_state(plan).counters == 0).all()
