"""The CUDA backend (csrc/cascade_attention.cu via hf_cascade.kernels.cuda) against the reference backend.

GPU tests (marked ``gpu``) are skipped without CUDA. Each builds a random paged layout on the GPU: a pool
whose blocks are handed out in a random permutation, unused blocks and slots filled with NaN garbage,
groups of different sizes (one with an empty prefix), rows in no group, prefixes that end inside a block.
The reference runs in float32 on the same inputs; the CUDA output (bf16/fp16) must match it to a relative
error below 1e-2 overall (2e-2 per row and query) with no NaN.

Run on the GPU machine:  PYTHONPATH=. python -m pytest -q -m gpu tests/test_gpu_kernels.py
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hf_cascade.kernels import cuda as cuda_backend
from hf_cascade.kernels import reference
from hf_cascade.plan import StepPlan

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def make_plan(group_rows, prefix_table, prefix_len, suffix_table, q_limit, q_len) -> StepPlan:
    empty = np.zeros(0, dtype=np.int64)
    return StepPlan(fresh=False, q_len=q_len, src_index=None, write_block=empty, write_offset=empty,
                    copy_src=empty, copy_dst=empty,
                    group_rows=np.asarray(group_rows, dtype=np.int32),
                    prefix_table=np.asarray(prefix_table, dtype=np.int32),
                    prefix_len=np.asarray(prefix_len, dtype=np.int32),
                    suffix_table=np.asarray(suffix_table, dtype=np.int32),
                    q_limit=np.asarray(q_limit, dtype=np.int32))


def make_case(seed, *, dtype=torch.bfloat16, D=128, Hkv=2, ratio=4, bs=16, Lq=1, groups=((3, 100),), lone_rows=1,
              suffix=(1, 40), random_limits=False, empty_suffix_rows=0, extra_blocks=5):
    """Random layout. ``groups``: (rows, prefix tokens) per group; ``lone_rows``: rows in no group;
    ``suffix``: (low, high) of the suffix lengths; ``empty_suffix_rows``: grouped rows whose queries see
    none of their suffix (q_limit 0). Returns (q, pool, plan, scale)."""
    rng = np.random.default_rng(seed)
    dev = torch.device("cuda")
    sizes = [n for n, _ in groups]
    R = sum(sizes) + lone_rows
    Hq = Hkv * ratio
    rows = rng.permutation(R)
    members, at = [], 0
    for n in sizes:
        members.append(np.sort(rows[at:at + n]))
        at += n
    nblk = lambda n: -(-int(n) // bs)  # noqa: E731
    slens = rng.integers(max(suffix[0], Lq), max(suffix[1], Lq) + 1, size=R)
    grouped = np.concatenate(members) if members else np.zeros(0, dtype=np.int64)
    for r in grouped[:empty_suffix_rows]:
        slens[r] = 0
    n_used = sum(nblk(p) for _, p in groups) + sum(nblk(s) for s in slens)
    N = n_used + extra_blocks
    free = list(rng.permutation(N))
    valid = np.zeros((N, bs), dtype=bool)

    G = len(groups)
    Rg = max(sizes, default=0)
    Mp = max((nblk(p) for _, p in groups), default=0) + 1
    Ms = max(nblk(s) for s in slens) + 1
    group_rows = np.full((G, Rg), -1, dtype=np.int32)
    prefix_table = np.full((G, Mp), -1, dtype=np.int32)
    prefix_len = np.zeros(G, dtype=np.int32)
    for g, ((_, p), mem) in enumerate(zip(groups, members)):
        group_rows[g, :len(mem)] = rng.permutation(mem)
        prefix_len[g] = p
        for j in range(nblk(p)):
            b = free.pop()
            prefix_table[g, j] = b
            valid[b, :min(bs, p - j * bs)] = True
    suffix_table = np.full((R, Ms), -1, dtype=np.int32)
    q_limit = np.zeros((R, Lq), dtype=np.int32)
    for r in range(R):
        s = int(slens[r])
        for j in range(nblk(s)):
            b = free.pop()
            suffix_table[r, j] = b
            valid[b, :min(bs, s - j * bs)] = True
        if s == 0:
            continue
        if random_limits:
            q_limit[r] = rng.integers(0, s + 1, size=Lq)
            q_limit[r, rng.integers(Lq)] = s
        else:                                    # the tail: query i sees up to tail token i
            q_limit[r] = s - Lq + 1 + np.arange(Lq)
    gen = torch.Generator(device=dev).manual_seed(seed)
    pool = torch.randn(N, 2, bs, Hkv, D, generator=gen, device=dev, dtype=torch.float32)
    pool = pool.masked_fill(~torch.from_numpy(valid).to(dev)[:, None, :, None, None], float("nan")).to(dtype)
    q = (1.5 * torch.randn(R, Lq, Hq, D, generator=gen, device=dev, dtype=torch.float32)).to(dtype)
    plan = make_plan(group_rows, prefix_table, prefix_len, suffix_table, q_limit, Lq)
    return q, pool, plan, 1.0 / math.sqrt(D)


def check_case(q, pool, plan, scale, *, tol=1e-2, row_tol=2e-2):
    out = cuda_backend.attend(q, pool, plan, scale)
    torch.cuda.synchronize()
    ref = reference.attend(q.float(), pool.float(), plan, scale)
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
    monkeypatch.setattr(cuda_backend, "debug_sync", True)   # report a failing kernel by name


# ----------------------------------------------------------------------------------------- CPU tests

def test_unsupported_reason_cpu():
    q = torch.zeros(2, 1, 4, 64, dtype=torch.bfloat16)
    pool = torch.zeros(3, 2, 16, 2, 64, dtype=torch.bfloat16)
    plan = make_plan(np.zeros((0, 0)), np.zeros((0, 0)), [], np.zeros((2, 1)), np.zeros((2, 1)), 1)
    reason = cuda_backend.unsupported_reason(q, pool, plan)
    assert isinstance(reason, str) and reason


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


# ----------------------------------------------------------------------------------------- GPU tests

@gpu
@needs_cuda
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dtypes_and_head_dims(dtype, D):
    # groups of different sizes, one with an empty prefix, one ending inside a block; two rows in no group
    case = make_case(1 + D, dtype=dtype, D=D, Hkv=2, ratio=4, bs=16,
                     groups=((8, 1000), (3, 17), (2, 0), (5, 300)), lone_rows=2, suffix=(1, 100))
    assert cuda_backend.unsupported_reason(case[0], case[1], case[2]) is None
    check_case(*case)


@gpu
@needs_cuda
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("bs", [16, 64])
def test_gqa_and_block_sizes(ratio, bs):
    Hkv = {1: 8, 4: 4, 8: 2}[ratio]
    case = make_case(100 + ratio + bs, dtype=torch.bfloat16, D=128, Hkv=Hkv, ratio=ratio, bs=bs,
                     groups=((8, 2 * bs * 7 + 5), (1, bs), (4, 3 * bs + 1)), lone_rows=1, suffix=(1, 3 * bs))
    check_case(*case)


@gpu
@needs_cuda
@pytest.mark.parametrize("Lq,random_limits", [(2, False), (3, True), (5, False), (4, True)])
def test_multi_query_steps(Lq, random_limits):
    # 8 rows x Lq x GQA 8 query rows per group and KV head (> 64: several row tiles); q_limit 0 rows too
    case = make_case(200 + Lq, dtype=torch.float16, D=128, Hkv=2, ratio=8, bs=16, Lq=Lq,
                     groups=((8, 700), (2, 33), (3, 0)), lone_rows=2, suffix=(1, 60),
                     random_limits=random_limits, empty_suffix_rows=1)
    check_case(*case)
    state = next(iter(case[2].scratch.values()))
    assert state.row_tiles > 1


@gpu
@needs_cuda
@pytest.mark.parametrize("suffix", [(1, 8), (200, 1024)])
def test_suffix_lengths(suffix):
    case = make_case(300 + suffix[1], dtype=torch.bfloat16, D=64, Hkv=4, ratio=2, bs=16,
                     groups=((4, 512), (3, 64)), lone_rows=3, suffix=suffix)
    check_case(*case)


@gpu
@needs_cuda
@pytest.mark.parametrize("plen,bs", [(4096 + 7, 16), (32768, 64)])
def test_long_prefix_is_chunked(plen, bs):
    case = make_case(400 + bs, dtype=torch.bfloat16, D=128, Hkv=2, ratio=4, bs=bs,
                     groups=((4, plen), (2, plen // 3)), lone_rows=1, suffix=(1, 64))
    check_case(*case)
    state = next(iter(case[2].scratch.values()))
    assert state.max_chunks > 1


@gpu
@needs_cuda
def test_llama_layer_shape():
    # the benchmark's shape, smaller prefix: 32/8 heads, head_dim 128, 8 groups x 8 beams, suffix 64
    case = make_case(500, dtype=torch.bfloat16, D=128, Hkv=8, ratio=4, bs=16,
                     groups=tuple((8, 2048) for _ in range(8)), lone_rows=0, suffix=(64, 64))
    check_case(*case)


@gpu
@needs_cuda
def test_no_groups_long_suffix_split():
    # paged decode over whole tables: no prefix groups, long suffixes split across CTAs
    case = make_case(600, dtype=torch.float16, D=128, Hkv=2, ratio=4, bs=16, groups=(), lone_rows=6,
                     suffix=(1500, 5000))
    check_case(*case)
    state = next(iter(case[2].scratch.values()))
    assert not state.has_prefix and state.nsplit > 1


@gpu
@needs_cuda
def test_nothing_visible_gives_zeros():
    # a lone row whose queries see nothing, and a grouped row with an empty suffix and an empty prefix
    q, pool, plan, scale = make_case(700, dtype=torch.bfloat16, D=128, Hkv=2, ratio=4, bs=16,
                                     groups=((2, 0), (3, 40)), lone_rows=2, suffix=(1, 30))
    lone = np.setdiff1d(np.arange(q.shape[0]), plan.group_rows[plan.group_rows >= 0])
    plan.q_limit[lone[0]] = 0
    plan.q_limit[plan.group_rows[0, 0]] = 0
    out = check_case(q, pool, plan, scale)
    assert (out[int(lone[0])] == 0).all() and (out[int(plan.group_rows[0, 0])] == 0).all()


@gpu
@needs_cuda
def test_layers_reuse_the_step_state_and_views():
    # two "layers" with different pools/queries and one plan; q as attention.py passes it (a transposed view)
    q, pool, plan, scale = make_case(800, dtype=torch.bfloat16, D=128, Hkv=2, ratio=4, bs=16,
                                     groups=((4, 300), (3, 90)), lone_rows=1, suffix=(1, 50))
    check_case(q.transpose(1, 2).contiguous().transpose(1, 2), pool, plan, scale)
    pool2 = torch.randn_like(pool, dtype=torch.float32).to(pool.dtype)
    q2 = torch.randn_like(q, dtype=torch.float32).to(q.dtype)
    check_case(q2, pool2, plan, scale)
    assert len(plan.scratch) == 1


@gpu
@needs_cuda
def test_rejects_bad_plans_loudly():
    q, pool, plan, scale = make_case(900, dtype=torch.bfloat16, D=64, Hkv=2, ratio=2, bs=16,
                                     groups=((2, 40),), lone_rows=1, suffix=(1, 20))
    plan.suffix_table[0, 0] = pool.shape[0] + 5
    with pytest.raises(ValueError):
        cuda_backend.attend(q, pool, plan, scale)
    assert "dtype" in cuda_backend.unsupported_reason(q.float(), pool.float(), plan)
