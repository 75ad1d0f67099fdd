"""The fp8 KV cache (``CascadeConfig(kv_dtype="float8_e4m3fn")``) on the CPU: config validation, the storage's scales
and quantization, the reference backend against a float64 attention over the dequantized K/V, generate against the
full-precision cache (token agreement and log-prob gap), the bytes it holds, and csrc/prefix.cu's fp8 MMA operands
emulated lane by lane (the swizzled fp8 tile, the permuted k order, the byte permutes, the exact conversions)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import hf_cascade  # noqa: F401  registers "cascade"
from conftest import cache_kw, model_pair, padded_batch, plans_every_step
from hf_cascade import CascadeCache, CascadeConfig, kernels
from hf_cascade.config import FP8_BACKENDS, KV_DTYPES, ConfigTypeError
from hf_cascade.kernels import ops, reference
from hf_cascade.kernels.base import AttentionParams, Backend, kv_scale, with_kv_scale
from hf_cascade.memory import SCALE_MARGIN, GrowStorage, StaticStorage
from kernel_helpers import random_layout, random_three_level, step_plan

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


# ---- config ---------------------------------------------------------------------------------------------------------
def test_config_kv_dtype_values():
    assert CascadeConfig().kv_dtype is None and CascadeConfig().kv_torch_dtype is None
    assert CascadeConfig(kv_dtype="float8_e4m3fn").kv_torch_dtype is FP8
    assert CascadeConfig(kv_dtype=FP8).kv_dtype == "float8_e4m3fn"          # a torch dtype reads as its name
    assert CascadeConfig.coerce({"kv_dtype": "float8_e4m3fn"}).kv_torch_dtype is FP8


@pytest.mark.parametrize("bad,error", [("fp8", ValueError), ("float8_e4m3", ValueError), ("bfloat16", ValueError),
                                       (torch.float16, ValueError), (8, ConfigTypeError)])
def test_bad_kv_dtype_is_refused_naming_the_allowed_values(bad, error):
    with pytest.raises(error, match=r"kv_dtype must be None \(the model's dtype\) or one of \('float8_e4m3fn',\)"):
        CascadeConfig(kv_dtype=bad)


def test_fp8_on_flashinfer_is_refused_up_front():
    with pytest.raises(ValueError, match=r"backend='flashinfer'.*Use backend='auto'.*kv_dtype=None"):
        CascadeConfig(kv_dtype="float8_e4m3fn", backend="flashinfer")


def test_config_and_backends_agree_on_who_reads_fp8():
    """config.FP8_BACKENDS (checked without importing the backends) is what the backends declare."""
    for name in kernels.BACKENDS:
        try:
            backend = kernels.load(name)
        except ImportError:           # flashinfer where it is not installed: its class keeps the default
            assert name not in FP8_BACKENDS
            continue
        assert (FP8 in backend.kv_dtypes) == (name in FP8_BACKENDS), name
    assert Backend.kv_dtypes == () and KV_DTYPES == ("float8_e4m3fn",)


def test_a_backend_without_fp8_refuses_the_pool_with_the_reason():
    q = torch.zeros(2, 1, 4, 8)
    pool = torch.zeros(3, 2, 4, 2, 8, dtype=FP8)
    assert "float8_e4m3fn KV pool without its scales" in reference.BACKEND.unsupported_reason(q, pool)
    with_kv_scale(pool, torch.ones(2, 2))
    assert reference.BACKEND.unsupported_reason(q, pool) is None
    reason = Backend().unsupported_reason(q, pool)
    assert "float8_e4m3fn KV cache" in reason and "kv_dtype=None" in reason


def test_cuda_backend_on_cpu_is_refused_before_anything_is_stored():
    try:
        kernels.load("cuda")
    except ImportError:
        pytest.skip("the cuda backend module does not import here")
    _, cascade = model_pair("llama", dtype=torch.float32)
    ids, mask = padded_batch(seed=1)
    with pytest.raises(ValueError, match=r"kv_dtype='float8_e4m3fn', backend='cuda'\) cannot be served: it runs on "
                                         r"cuda only.*backend='auto'"):
        cascade.generate(input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=2, pad_token_id=0,
                         hf_cascade_config=CascadeConfig(kv_dtype="float8_e4m3fn", backend="cuda"))


# ---- the storage: scales and quantization ----------------------------------------------------------------------------
def test_encode_fixes_per_head_scales_from_the_first_write_and_saturates():
    storage = GrowStorage((2, 4, 3, 8), FP8, "cpu")
    assert storage.scale.shape == (2, 3) and storage.scale.dtype == torch.float32
    g = torch.Generator().manual_seed(0)
    head_range = torch.tensor([0.01, 1.0, 300.0])           # heads differ by orders of magnitude
    k = torch.randn(20, 3, 8, generator=g) * head_range[None, :, None]
    v = torch.randn(20, 3, 8, generator=g) * head_range.flip(0)[None, :, None]
    k8, v8 = storage.encode(k, v)
    assert k8.dtype == FP8 and v8.dtype == FP8 and storage.scale_fixed
    for kv, x, x8 in ((0, k, k8), (1, v, v8)):
        want = x.abs().amax(dim=(0, 2)) * SCALE_MARGIN / FP8_MAX
        torch.testing.assert_close(storage.scale[kv], want, rtol=1e-6, atol=0)
        back = x8.float() * storage.scale[kv][None, :, None]
        # e4m3: 3 mantissa bits, relative error <= 2^-4 above the subnormal floor (2^-6 x scale)
        floor = 2.0 ** -9 * storage.scale[kv][None, :, None]
        assert bool(((back - x).abs() <= x.abs() * 2.0 ** -4 + floor).all())
    # later writes keep the scales; values past 448 x scale saturate (finite), never inf / NaN
    fixed = storage.scale.clone()
    big = k * 1000
    k8, _ = storage.encode(big, v)
    assert torch.equal(storage.scale, fixed)
    assert bool(torch.isfinite(k8.float()).all()) and k8.float().abs().max().item() == FP8_MAX
    # a release forgets them: the next call's first write fixes its own
    storage.release()
    storage.encode(k * 2, v)
    torch.testing.assert_close(storage.scale[0], fixed[0] * 2, rtol=1e-6, atol=0)


def test_all_zero_head_gets_scale_one_and_empty_write_fixes_nothing():
    storage = StaticStorage((2, 4, 2, 8), FP8, "cpu", max_blocks=2)
    storage.encode(torch.zeros(0, 2, 8), torch.zeros(0, 2, 8))
    assert not storage.scale_fixed
    k = torch.zeros(3, 2, 8)
    k[:, 1] = 2.0
    storage.encode(k, k)
    assert storage.scale[:, 0].tolist() == [1.0, 1.0]
    assert storage.scale[0, 1].item() == pytest.approx(2.0 * SCALE_MARGIN / FP8_MAX)


def test_storage_bytes_count_the_scales_while_blocks_are_held():
    bf16 = GrowStorage((2, 4, 3, 8), torch.bfloat16, "cpu")
    fp8 = GrowStorage((2, 4, 3, 8), FP8, "cpu")
    assert fp8.block_nbytes * 2 == bf16.block_nbytes and bf16.scale is None
    assert fp8.nbytes == 0                      # nothing held: a reset pool reads as empty
    bf16.ensure(5)
    fp8.ensure(5)
    assert fp8.nbytes == bf16.nbytes // 2 + 2 * 3 * 4


# ---- the reference backend over a quantized pool ---------------------------------------------------------------------
def _quantize(pool: torch.Tensor, seed: int):
    """``pool`` (float64, NaN in unused slots) as fp8 with random per-(K/V, head) scales, and its dequantized float64
    twin: what the reference must attend over."""
    Hkv = pool.shape[3]
    g = torch.Generator().manual_seed(seed)
    scale = (10.0 ** (torch.rand(2, Hkv, generator=g, dtype=torch.float64) * 3 - 2)).float()     # 0.01 .. 10
    stored = (pool / scale.double()[None, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    dequantized = stored.double() * scale.double()[None, :, None, :, None]
    return with_kv_scale(stored, scale), dequantized


@pytest.mark.parametrize("quirks", [{}, {"softcap": 5.0}, {"window": 7}, {"sinks": torch.linspace(-1.0, 1.0, 8)}])
@pytest.mark.parametrize("Lq", [1, 3])
def test_reference_on_fp8_pool_equals_float64_attention_over_dequantized(quirks, Lq):
    lay = random_layout(3, groups=((3, 37), (2, 20)), lone_rows=2, suffix=(1, 25), Lq=Lq, Hkv=2, ratio=4, D=16, bs=4)
    pool8, deq = _quantize(lay.pool, seed=Lq)
    plan = lay.plan()
    params = AttentionParams(lay.scale, **quirks)
    want = reference.attend(lay.q, deq, plan, params)
    # float64 queries: dequantized in float64, the same numbers as `deq` (exact to float64 rounding)
    got64 = reference.attend(lay.q, pool8, plan, params)
    torch.testing.assert_close(got64, want, rtol=1e-12, atol=1e-12)
    # float32 queries compute in float32
    got32 = reference.attend(lay.q.float(), pool8, plan, params)
    torch.testing.assert_close(got32.double(), want, rtol=1e-4, atol=1e-5)
    assert bool(torch.isfinite(got32).all())


def test_reference_three_levels_on_fp8_pool():
    lay = random_three_level(5, sys_tokens=20, prompts=2, beams=3, own_tokens=(1, 6), suffix=(1, 9), D=16, bs=4)
    pool8, deq = _quantize(lay.pool, seed=7)
    plan = step_plan(lay)
    assert plan.mid_group_rows.shape[0] > 0
    want = reference.attend(lay.q, deq, plan, lay.scale)
    got = reference.attend(lay.q, pool8, plan, lay.scale)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ---- generate with the fp8 cache -------------------------------------------------------------------------------------
def _generate(model, ids, mask, kv_dtype, **kw):
    cache = CascadeCache(model.config, CascadeConfig(block_size=4, kv_dtype=kv_dtype, backend="reference"))
    out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0, return_dict_in_generate=True,
                         output_logits=True, **cache_kw(model, cache), **kw)
    return out, cache


def _agreement(a, b, prompt_len):
    new_a, new_b = a[:, prompt_len:], b[:, prompt_len:]
    return (new_a == new_b).float().mean().item()


def _first_step_logprob_gap(out_a, out_b) -> float:
    """max |log p_fp8 - log p_full| over the vocabulary at the first new token (both read the same prompt)."""
    la, lb = out_a.logits[0].double().log_softmax(-1), out_b.logits[0].double().log_softmax(-1)
    return (la - lb).abs().max().item()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_generate_fp8_cache_agrees_with_full_cache(family):
    """Greedy and beam search on a tiny random model (float32): tokens agree with the float32 cache's, and the
    log-probs move by little. The figures are printed (run with -s); the bounds are loose on purpose: a tiny random
    model's logits are nearly flat, so a quantization error flips near-ties more often than in a trained model."""
    _, cascade = model_pair(family, dtype=torch.float32, seed=11)
    ids, mask = padded_batch(seed=2)
    prompt_len = ids.shape[1]
    greedy_full, _ = _generate(cascade, ids, mask, None, max_new_tokens=12, do_sample=False)
    greedy_fp8, cache = _generate(cascade, ids, mask, "float8_e4m3fn", max_new_tokens=12, do_sample=False)
    assert cache.layers[0].storage.dtype == FP8
    greedy_agree = _agreement(greedy_fp8.sequences, greedy_full.sequences, prompt_len)
    gap = _first_step_logprob_gap(greedy_fp8, greedy_full)
    beam_full, _ = _generate(cascade, ids, mask, None, max_new_tokens=12, num_beams=4, num_return_sequences=2)
    beam_fp8, _ = _generate(cascade, ids, mask, "float8_e4m3fn", max_new_tokens=12, num_beams=4,
                            num_return_sequences=2)
    beam_agree = _agreement(beam_fp8.sequences, beam_full.sequences, prompt_len)
    print(f"\n[fp8 kv, {family}] greedy token agreement {greedy_agree:.3f}, beam(4) token agreement "
          f"{beam_agree:.3f}, first-step max |log-prob gap| {gap:.2e}")
    # the first new token reads only the prompt's quantized K/V
    assert torch.equal(greedy_fp8.sequences[:, prompt_len], greedy_full.sequences[:, prompt_len])
    assert 0.0 < gap < 0.05
    assert greedy_agree >= 0.75 and beam_agree >= 0.5


def test_prefill_stores_what_encode_makes():
    """The pool after a prefill holds exactly encode()'s bytes of the model's K (layer 0, first prompt's tokens)."""
    _, cascade = model_pair("llama", dtype=torch.float32, seed=3)
    ids, mask = padded_batch(seed=5, lengths=(9, 9))
    cache = CascadeCache(cascade.config, CascadeConfig(block_size=4, kv_dtype="float8_e4m3fn", backend="reference"))
    hf_cascade.prefill(cascade, cache, ids, mask)
    layer = cache.layers[0]
    pool, storage = layer.pool, layer.storage
    assert kv_scale(pool) is storage.scale and storage.scale_fixed and pool.dtype == FP8
    # the same K recomputed by a full-cache prefill, quantized with the stored scales, gives the same bytes
    full = CascadeCache(cascade.config, CascadeConfig(block_size=4, backend="reference"))
    hf_cascade.prefill(cascade, full, ids, mask)
    k_full = full.layers[0].pool[:, 0]                                  # [N, bs, Hkv, D] float32
    stored = pool.view(torch.uint8)[:, 0]
    used = torch.from_numpy(cache.blocks.tables()[0][: -(-int(cache.blocks.lengths[0]) // 4)].astype(np.int64))
    tokens = int(cache.blocks.lengths[0])
    want = (k_full[used].flatten(0, 1)[:tokens] / storage.scale[0][None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    assert torch.equal(stored[used].flatten(0, 1)[:tokens], want.view(torch.uint8))


# ---- bytes ----------------------------------------------------------------------------------------------------------
def test_kv_bytes_in_use_halve_against_bf16():
    _, cascade = model_pair("llama", dtype=torch.bfloat16, seed=4)
    ids, mask = padded_batch(seed=6)
    stats = {}
    for kv_dtype in (None, "float8_e4m3fn"):
        cache = CascadeCache(cascade.config, CascadeConfig(block_size=4, kv_dtype=kv_dtype, memory="grow"))
        # sampling: rows and blocks do not depend on the tokens drawn (beam search's parents would)
        cascade.generate(input_ids=ids, attention_mask=mask, do_sample=True, num_return_sequences=4,
                         max_new_tokens=6, pad_token_id=0, **cache_kw(cascade, cache))
        stats[kv_dtype] = cache.stats()
    full, fp8 = stats[None], stats["float8_e4m3fn"]
    assert fp8.blocks_in_use == full.blocks_in_use > 0 and fp8.tokens_stored == full.tokens_stored
    assert fp8.blocks_shared == full.blocks_shared > 0
    # 2 (K, V) x block 4 x 2 KV heads x head_dim 16 x 2 layers per block: 512 bytes in fp8, 1024 in bf16
    assert full.kv_bytes_in_use == full.blocks_in_use * 1024
    assert fp8.kv_bytes_in_use == fp8.blocks_in_use * 512 == full.kv_bytes_in_use // 2
    assert fp8.peak_kv_bytes_in_use * 2 == full.peak_kv_bytes_in_use
    # reserved: the same pool sizes, half the bytes, plus each layer's scales (2 x 2 KV heads x float32)
    assert fp8.kv_bytes_reserved == full.kv_bytes_reserved // 2 + 2 * (2 * 2 * 4)


def test_max_kv_bytes_counts_fp8_blocks():
    _, cascade = model_pair("llama", dtype=torch.bfloat16, seed=4)
    ids, mask = padded_batch(seed=6)
    caps = {}
    for kv_dtype in (None, "float8_e4m3fn"):
        cache = CascadeCache(cascade.config, CascadeConfig(block_size=4, kv_dtype=kv_dtype, max_kv_bytes=64 * 1024))
        cascade.generate(input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=2, pad_token_id=0,
                         **cache_kw(cascade, cache))
        caps[kv_dtype] = cache.blocks.max_blocks
    assert caps[None] == 64 and caps["float8_e4m3fn"] == 128
    # a cap below one fp8 block of all layers is refused up front with the fp8 figure (512 bytes)
    with pytest.raises(ValueError, match=r"\(512 bytes: .* x 1 bytes"):
        CascadeCache(cascade.config, CascadeConfig(block_size=4, kv_dtype="float8_e4m3fn", max_kv_bytes=500))


def test_copies_keep_the_scales():
    _, cascade = model_pair("llama", dtype=torch.float32, seed=3)
    ids, mask = padded_batch(seed=5)
    cache = CascadeCache(cascade.config, CascadeConfig(block_size=4, kv_dtype="float8_e4m3fn", backend="reference"))
    hf_cascade.prefill(cascade, cache, ids, mask)
    twin = copy.deepcopy(cache)
    for a, b in zip(cache.layers, twin.layers):
        assert torch.equal(a.storage.scale, b.storage.scale) and a.storage.scale is not b.storage.scale
        assert b.storage.scale_fixed
        assert torch.equal(a.pool.view(torch.uint8), b.pool.view(torch.uint8))
        assert kv_scale(b.pool) is b.storage.scale
    np.testing.assert_array_equal(cache.blocks.lengths, twin.blocks.lengths)


def test_encoder_decoder_self_attention_in_fp8_cross_in_model_dtype(monkeypatch):
    """BART: the decoder's self-attention pool is fp8, the cross-attention K/V stay in the model's dtype (stored once
    per input); beam search agrees with the full-precision cache's tokens."""
    from hf_cascade import cache as cache_module
    from hf_cascade import cross_kv
    from test_encoder_decoder import pair, sources
    _, cascade = pair("bart", dtype=torch.float32)
    ids, mask = sources()
    pools = []        # (which, dtype) of every pool made
    for module, name, which in ((cache_module, "make_storage", "self"), (cross_kv, "make_fixed_storage", "cross")):
        made = getattr(module, name)
        monkeypatch.setattr(module, name, lambda shape, dtype, *a, _made=made, _which=which, **k:
                            pools.append((_which, dtype)) or _made(shape, dtype, *a, **k))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, num_beams=4)
    full = cascade.generate(**kw, hf_cascade_config=CascadeConfig(backend="reference", block_size=4))
    pools.clear()
    fp8 = cascade.generate(**kw, hf_cascade_config=CascadeConfig(backend="reference", block_size=4,
                                                                 kv_dtype="float8_e4m3fn"))
    assert {dtype for which, dtype in pools if which == "self"} == {FP8}
    assert {dtype for which, dtype in pools if which == "cross"} == {torch.float32}
    agree = (full[:, -8:] == fp8[:, -8:]).float().mean().item()
    print(f"\n[fp8 kv, bart] beam(4) token agreement {agree:.3f}")
    assert agree >= 0.5


def test_kernel_operators_check_an_fp8_pool_and_its_scales():
    """The CUDA operators' argument checks (run on the CPU: they look at shapes, dtypes and devices only)."""
    from hf_cascade.kernels import ops
    from hf_cascade.kernels.cuda_binding import KV_DTYPE_CODES, _kv_code
    q = torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16)
    pool = torch.zeros(5, 2, 16, 2, 64, dtype=FP8)
    table, limit = torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, 1, dtype=torch.int32)
    part_o, part_lse = torch.zeros(2 * 2 * 8 * 64), torch.zeros(2 * 2 * 8)
    args = ops.SuffixArgs(q, pool, table, limit, part_o, part_lse, 16, 1, 0, 0.1)
    with pytest.raises(ValueError, match="needs kv_scale"):
        ops.check_suffix(args)
    with pytest.raises(ValueError, match=r"kv_scale has shape \(2, 3\), expected \(2, 2\)"):
        ops.check_suffix(args._replace(kv_scale=torch.ones(2, 3)))
    with pytest.raises(TypeError, match="kv_scale must be torch.float32"):
        ops.check_suffix(args._replace(kv_scale=torch.ones(2, 2, dtype=torch.float64)))
    ops.check_suffix(args._replace(kv_scale=torch.ones(2, 2)))
    with pytest.raises(TypeError, match="pool must be torch.bfloat16"):       # other dtypes stay refused
        ops.check_suffix(args._replace(pool=pool.view(torch.uint8)))
    assert KV_DTYPE_CODES[FP8] == 1 and _kv_code(pool.view(torch.uint8), None) == (0, None)
    with pytest.raises(ValueError, match="needs its kv_scale"):
        _kv_code(pool, None)


# ---- the cuda backend's launches on an fp8 pool, with the kernels emulated on the CPU --------------------------------
@pytest.mark.parametrize("hopper_fp8", [False, True], ids=["portable", "hopper-fp8"])
@pytest.mark.parametrize("three,window,softcap", [(False, None, None), (False, 40, 20.0), (True, None, None),
                                                  (True, None, 10.0)])
def test_cuda_launches_on_fp8_pool_emulated(monkeypatch, three, window, softcap, hopper_fp8):
    """hf_cascade.kernels.cuda._launch for real on an fp8 pool, with tests/decode/test_cuda_emulation.py's numpy kernels in
    place of the CUDA ones, fed the pool dequantized by its scales: every prefix and suffix launch gets the pool's own
    scales (the argument checks run on the fp8 pool), the prefix runs the default kernel even where the Hopper kernel
    would run for bf16 (unless cuda_tuning.hopper_fp8 is on: then plain layers run the Hopper kernel's fp8 code, its
    64-row tiles and 64-token chunks), and the result equals the float64 reference over the fp8 pool."""
    import test_cuda_emulation as emulation
    from hf_cascade.kernels import cuda as cuda_backend
    from hf_cascade.kernels import cuda_tuning, ops
    from test_reference_kernels import make_three_level
    check_prefix, check_suffix = ops.check_prefix, ops.check_suffix
    monkeypatch.setattr(cuda_backend, "_sm_count", lambda dev: 16)          # (as test_cuda_emulation's pieces)
    monkeypatch.setattr(cuda_tuning, "choose_chunk_blocks",
                        lambda pb, ctas, slots, bs, tile, **kw: 2 * max(1, tile // bs))
    monkeypatch.setattr(cuda_backend, "choose_suffix_split",
                        lambda tmax, ctas, slots, min_tokens=None: (100, max(1, -(-tmax // 100))))
    monkeypatch.setattr(emulation._FakeLib, "sm90", True)     # where bf16 head_dim 128 runs the Hopper kernel
    monkeypatch.setattr(cuda_tuning, "hopper_fp8", hopper_fp8)
    monkeypatch.setattr(ops, "check_prefix", lambda *a, **k: None)        # run below on the fp8 pool instead
    monkeypatch.setattr(ops, "check_suffix", lambda *a, **k: None)

    def dequantized(pool, scale):
        return pool.double() * scale.double()[None, :, None, :, None]

    class Fp8Kernels(emulation.Emulated):
        def __init__(self):
            super().__init__()
            self.scales = []            # the kv_scale of every launch

        def prefix(self, lib, stream, a):
            check_prefix(a)
            self.scales.append(a.kv_scale)
            super().prefix(lib, stream, a._replace(pool=dequantized(a.pool, a.kv_scale), kv_scale=None))

        def suffix(self, lib, stream, a):
            check_suffix(a)
            self.scales.append(a.kv_scale)
            super().suffix(lib, stream, a._replace(pool=dequantized(a.pool, a.kv_scale), kv_scale=None))

    if three:
        lay = make_three_level(61, Lq=1, Hkv=2, ratio=4, D=128, bs=16, dtype=torch.float32)
    else:
        lay = random_layout(17, groups=((3, 700), (2, 90), (2, 0)), lone_rows=1, suffix=(1, 300), Hkv=2, ratio=4,
                            D=128, bs=16, dtype=torch.float32, q_scale=1.5)
    plan = step_plan(lay)
    pool8, _ = _quantize(lay.pool.double(), seed=3)
    q = lay.q.to(torch.bfloat16)
    params = AttentionParams(lay.scale, softcap=softcap, window=window)
    emu = Fp8Kernels()
    emu.state = cuda_backend.BACKEND.build(plan, q, pool8, params, lib=emulation._FakeLib())
    out = torch.zeros(q.shape, dtype=torch.float64)
    cuda_backend._launch(emulation._FakeLib(), 0, q, pool8, emu.state, params, out, kernels=emu)
    ref = reference.attend(q.double(), pool8, plan, params)
    emulation.check(out, ref, emu)
    code = cuda_tuning.HOPPER_FP8_KERNEL if hopper_fp8 and softcap is None and window is None else 0
    assert emu.state.three == three and emu.state.tune == code and set(emu.tunes) == {code}
    assert len(emu.scales) == (3 if three else 2) and all(s is kv_scale(pool8) for s in emu.scales)
    # the same layout in bf16 would take the Hopper kernel here (what an fp8 pool must not)
    assert cuda_backend.BACKEND.build(plan, q, lay.pool.to(torch.bfloat16), lib=emulation._FakeLib()).tune == \
        cuda_tuning.HOPPER_KERNEL


@pytest.mark.parametrize("memory", ["grow", "static"])
def test_graph_runner_static_path_on_fp8_pool(memory, monkeypatch):
    """CascadeConfig(cuda_graphs="eager") runs the decode steps as a captured graph would (static layout, the
    pool's stable view, fixed buffers): the same tokens as plain fp8 decoding."""
    _, cascade = model_pair("llama", dtype=torch.float32, seed=8)
    ids, mask = padded_batch(seed=9)
    common = dict(block_size=4, kv_dtype="float8_e4m3fn", backend="reference", memory=memory,
                  max_kv_bytes=1 << 20 if memory == "static" else None)
    kw = dict(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=8, pad_token_id=0)
    with pytest.MonkeyPatch.context() as mp:
        plans_every_step(mp)
        plain = cascade.generate(**kw, hf_cascade_config=CascadeConfig(**common))
    runner = cascade.generate(**kw, hf_cascade_config=CascadeConfig(**common, cuda_graphs="eager"))
    assert torch.equal(plain, runner)


def test_an_fp8_call_with_nothing_to_share_still_stores_fp8(monkeypatch):
    """A call that shares nothing (one prompt, greedy) would run on stock's dense cache, in the model's dtype; with
    kv_dtype set it runs on the cascade, so the cache really is fp8."""
    from hf_cascade import generation
    monkeypatch.setattr(generation, "MIN_SHARED_TOKENS", {"cpu": 10 ** 9})      # (what the CPU threshold does)
    _, cascade = model_pair("llama", dtype=torch.float32)
    ids, mask = padded_batch(seed=2, lengths=(19,))
    out = cascade.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                           return_dict_in_generate=True,
                           hf_cascade_config=CascadeConfig(kv_dtype="float8_e4m3fn"))
    cache = out.cache if "cache" in type(out).__dataclass_fields__ else out.past_key_values
    assert isinstance(cache, CascadeCache)
    assert all(layer.storage.dtype == torch.float8_e4m3fn for layer in cache.layers)


def test_fp8_decode_steps_are_captured_like_any_other():
    """An fp8 cache does not keep decode steps off the graph runner (tests/decode/test_capture_safety.py checks that its
    captured step only launches; tests/kv/test_gpu_fp8.py replays it on the GPU against its eager step)."""
    from hf_cascade import graphs
    _, cascade = model_pair("llama", dtype=torch.float32)
    for mode in (True, "eager"):
        full = graphs.unsupported_reason(cascade, CascadeConfig(cuda_graphs=mode))
        assert graphs.unsupported_reason(cascade, CascadeConfig(kv_dtype="float8_e4m3fn", cuda_graphs=mode)) == full
    assert graphs.unsupported_reason(cascade, CascadeConfig(kv_dtype="float8_e4m3fn", cuda_graphs="eager")) is None


def test_auto_hands_fp8_pools_to_the_cuda_kernels(monkeypatch):
    """backend="auto" gives an fp8 pool to the cuda kernels where they run, as it does a 16-bit pool; a backend that
    reads fp8 without listing it in ``auto_kv_dtypes`` serves it only when asked for by name."""
    from hf_cascade.kernels import cuda as cuda_backend
    monkeypatch.setattr(type(cuda_backend.BACKEND), "unsupported_reason", lambda self, *a, **k: None)  # "on a GPU"
    q = torch.zeros(2, 1, 4, 8)
    pool = with_kv_scale(torch.zeros(3, 2, 4, 2, 8, dtype=FP8), torch.ones(2, 2))
    assert kernels.select("auto", q, pool) is cuda_backend.BACKEND
    assert kernels.select("auto", q, torch.zeros(3, 2, 4, 2, 8)) is cuda_backend.BACKEND
    monkeypatch.setattr(type(cuda_backend.BACKEND), "auto_kv_dtypes", ())
    assert kernels.select("auto", q, pool) is reference.BACKEND
    assert kernels.select("cuda", q, pool) is cuda_backend.BACKEND


# ---- csrc/prefix.cu's fp8 MMA operands, emulated lane by lane -----------------------------------------------------
# A transliteration of the kernel's fp8 path for one warp and one K/V sub-tile (no GPU needed): the swizzled fp8 tile
# (swz8) and Q tile (swz), ldmatrix over bytes (its b16 units are byte pairs), the permuted k order of Q K^T, the byte
# permute of P V, fp8x2_to<T>, mma.m16n8k16's fragment layouts (PTX ISA) and the epilogue's column order. The partial
# products must be Q K^T and P V exactly (float64, values exact in 16 bits); the real kernel: tests/kv/test_gpu_fp8.py.
def _e4m3(byte_values) -> np.ndarray:
    """float64 values of float8_e4m3fn bytes."""
    return torch.from_numpy(np.asarray(byte_values, np.uint8)).view(FP8).double().numpy()


def _swz(D, r, c):            # csrc/prefix.cu swz<D>: element offset of 16-byte chunk c of row r (16-bit elements)
    return r * D + ((c ^ (r & 7)) << 3)


def _swz8(D, r, c):           # csrc/prefix.cu swz8<D>: byte offset of 16-byte chunk c of row r of an fp8 tile
    return ((r * (D // 16) + c) ^ (r & 7)) << 4


def _ldsm8(tile: np.ndarray, addrs, trans=False):
    """ldmatrix.x4(.trans).b16 over a byte array: regs[lane][i] as 4 bytes (little-endian order of the 32-bit reg)."""
    regs = [[None] * 4 for _ in range(32)]
    for i in range(4):
        rows = [tile[addrs[8 * i + r]: addrs[8 * i + r] + 16].reshape(8, 2) for r in range(8)]   # 8 x 8 b16
        for lane in range(32):
            g, q4 = lane >> 2, lane & 3
            if trans:   # (row 2 q4, col g) in the low half, (row 2 q4 + 1, col g) in the high half
                regs[lane][i] = np.concatenate([rows[2 * q4][g], rows[2 * q4 + 1][g]])
            else:       # (row g, cols 2 q4, 2 q4 + 1)
                regs[lane][i] = np.concatenate([rows[g][2 * q4], rows[g][2 * q4 + 1]])
    return regs


def _byte_perm(four, selector):
    """__byte_perm(x, 0, selector) on x's 4 bytes (selector nibbles < 4)."""
    return np.array([four[(selector >> (4 * k)) & 0xF] for k in range(4)], np.uint8)


def _mma(c, a, b0, b1):
    """mma.m16n8k16 (fp32 accumulate, here float64): c[lane][4] += A a[lane][4 pairs] x B (b0, b1)[lane] pairs."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for j in range(2):
            A[g, 2 * t + j], A[g + 8, 2 * t + j] = a[lane][0][j], a[lane][1][j]
            A[g, 8 + 2 * t + j], A[g + 8, 8 + 2 * t + j] = a[lane][2][j], a[lane][3][j]
            B[2 * t + j, g], B[8 + 2 * t + j, g] = b0[lane][j], b1[lane][j]
            C[g, 2 * t + j], C[g + 8, 2 * t + j] = c[lane][j], c[lane][2 + j]
    out = A @ B + C
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c[lane] = [out[g, 2 * t], out[g, 2 * t + 1], out[g + 8, 2 * t], out[g + 8, 2 * t + 1]]


def test_fp8_to_bf16_rebias_is_exact_for_every_e4m3_value():
    """fp8x2_to<bf16>: the f16 of each e4m3 value, bits (h & 0x8000) | ((h >> 3) & 0x0fff), is a normal bf16 of the
    value x 2^-112 (0 stays 0); times 2^112 it is the value."""
    codes = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)            # all but the NaNs
    values = _e4m3(codes)
    assert np.array_equal(values.astype(np.float16).astype(np.float64), values)        # cvt.rn.f16x2.e4m3x2: exact
    h = values.astype(np.float16).view(np.uint16).astype(np.uint32)
    bits = (h & 0x8000) | ((h >> 3) & 0x0FFF)
    rebiased = (bits << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    exponent = (bits >> 7) & 0xFF
    assert np.all((exponent > 0) | (bits & 0x7FFF == 0)), "a subnormal bf16 on the way"
    assert np.array_equal(rebiased * 2.0 ** 112, values)
    assert np.uint32(0x7780 << 16).view(np.float32) == 2.0 ** 112                     # fp8x2_to's bf16 constant


@pytest.mark.parametrize("D,KW", [(64, 16), (128, 16), (128, 32), (256, 16)])
def test_prefix_kernel_fp8_operands_give_qk_and_pv(D, KW):
    rng = np.random.default_rng(D + KW)
    N = max(KW, 32)                          # tokens of the tile (the sub-tile starts at tok0)
    tok0 = N - KW
    # 16 query rows of a warp (values exact in bf16 and fp16), an fp8 K and V tile, P (exact in 16 bits)
    q = np.round(rng.normal(size=(16, D)) * 64) / 64
    codes = rng.integers(0, 256, size=(2, N, D)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C                                               # no NaN
    k, v = _e4m3(codes[0]), _e4m3(codes[1])
    p = np.round(rng.random(size=(16, KW)) * 256) / 256
    Q_s = np.full(16 * D, np.nan)
    K8, V8 = np.zeros(N * D, np.uint8), np.zeros(N * D, np.uint8)
    for r in range(16):
        for c in range(D // 8):
            Q_s[_swz(D, r, c): _swz(D, r, c) + 8] = q[r, 8 * c: 8 * c + 8]
    for n in range(N):                        # the loader: chunk c (dims 16c..) of token n at swz8(n, c)
        for c in range(D // 16):
            K8[_swz8(D, n, c): _swz8(D, n, c) + 16] = codes[0, n, 16 * c: 16 * c + 16]
            V8[_swz8(D, n, c): _swz8(D, n, c) + 16] = codes[1, n, 16 * c: 16 * c + 16]

    def cvt(two_bytes):                       # fp8x2_to<T>: (low byte, high byte) -> (low, high) values
        return tuple(_e4m3(two_bytes))

    f8_tok = [((lane >> 3) & 1) * 8 + (lane & 7) for lane in range(32)]
    f8_chunk = [lane >> 4 for lane in range(32)]
    # ---- S = Q K^T
    sacc = [[[0.0] * 4 for _ in range(32)] for _ in range(KW // 8)]
    for kp in range(D // 32):
        a = [[None] * 2 for _ in range(32)]
        for lane in range(32):
            g, q4 = lane >> 2, lane & 3
            for j in range(2):
                c, e = 2 * (2 * kp + j) + (q4 >> 1), 4 * (q4 & 1)
                lo = Q_s[_swz(D, g, c) + e: _swz(D, g, c) + e + 4]
                hi = Q_s[_swz(D, g + 8, c) + e: _swz(D, g + 8, c) + e + 4]
                a[lane][j] = [lo[0:2], hi[0:2], lo[2:4], hi[2:4]]
        for tp in range(KW // 16):
            b = _ldsm8(K8, [_swz8(D, tok0 + tp * 16 + f8_tok[lane], 2 * kp + f8_chunk[lane]) for lane in range(32)])
            for i in range(4):
                _mma(sacc[2 * tp + (i & 1)], [a[lane][i >> 1] for lane in range(32)],
                     [cvt(b[lane][i][0:2]) for lane in range(32)], [cvt(b[lane][i][2:4]) for lane in range(32)])
    want_s = q @ k[tok0:].T
    for nt in range(KW // 8):
        for lane in range(32):
            g, q4 = lane >> 2, lane & 3
            for e in range(4):
                assert sacc[nt][lane][e] == want_s[g + 8 * (e >> 1), nt * 8 + 2 * q4 + (e & 1)]
    # ---- O = P V
    o = [[[0.0] * 4 for _ in range(32)] for _ in range(D // 8)]
    for jt in range(KW // 16):
        pf = [[p[g, 16 * jt + 2 * q4: 16 * jt + 2 * q4 + 2], p[g + 8, 16 * jt + 2 * q4: 16 * jt + 2 * q4 + 2],
               p[g, 16 * jt + 8 + 2 * q4: 16 * jt + 10 + 2 * q4], p[g + 8, 16 * jt + 8 + 2 * q4: 16 * jt + 10 + 2 * q4]]
              for g, q4 in ((lane >> 2, lane & 3) for lane in range(32))]
        for cp in range(D // 32):
            b = _ldsm8(V8, [_swz8(D, tok0 + jt * 16 + f8_tok[lane], 2 * cp + f8_chunk[lane]) for lane in range(32)],
                       trans=True)
            for j in range(2):
                c = 2 * cp + j
                lo = [_byte_perm(b[lane][2 * j], 0x3120) for lane in range(32)]
                hi = [_byte_perm(b[lane][2 * j + 1], 0x3120) for lane in range(32)]
                _mma(o[2 * c], pf, [cvt(x[0:2]) for x in lo], [cvt(x[0:2]) for x in hi])
                _mma(o[2 * c + 1], pf, [cvt(x[2:4]) for x in lo], [cvt(x[2:4]) for x in hi])
    out = np.full((16, D), np.nan)            # the epilogue's columns: o[2c], o[2c + 1] -> dims 16c + 4 q4 + 0..3
    for lane in range(32):
        g, q4 = lane >> 2, lane & 3
        for c in range(D // 16):
            e, d = o[2 * c][lane], o[2 * c + 1][lane]
            out[g, 16 * c + 4 * q4: 16 * c + 4 * q4 + 4] = [e[0], d[0], e[1], d[1]]
            out[g + 8, 16 * c + 4 * q4: 16 * c + 4 * q4 + 4] = [e[2], d[2], e[3], d[3]]
    np.testing.assert_array_equal(out, p @ v[tok0:])


@pytest.mark.parametrize("D", [64, 128, 256])
def test_prefix_kernel_fp8_tile_swizzle_is_a_bank_conflict_free_permutation(D):
    """swz8 places every 16-byte chunk of an fp8 tile exactly once inside the tile, and the 8 rows that an ldmatrix
    matrix reads (8 consecutive tokens, one chunk) fall in 8 distinct 16-byte bank groups."""
    N = {64: 64, 128: 32, 256: 16}[D]
    offsets = [_swz8(D, r, c) for r in range(N) for c in range(D // 16)]
    assert sorted(offsets) == list(range(0, N * D, 16))
    for r0 in range(0, N, 8):
        for c in range(D // 16):
            assert len({(_swz8(D, r0 + r, c) // 16) % 8 for r in range(8)}) == 8


# ---- the cuda backend's scale folding, on the emulated kernels ----------------------------------------------------
class _FoldedScales:
    """tests/decode/test_cuda_emulation.py's numpy kernels given what the fp8 kernels compute from ``kv_scale``: the stored
    values (fp8 -> bf16: exact), K's scale of the CTA's KV head folded into the scores' scale_log2 (one scalar), V's
    applied to the partial outputs the launch writes; one emulated launch per KV head, each kept for its query heads."""

    def __init__(self):
        from test_cuda_emulation import Emulated
        self.kernels = Emulated()
        self.merge = self.kernels.merge

    def _per_head(self, launch, q, pool, part_o, part_lse, slots, scale_log2, kv_scale, **kw):
        R, Lq, Hq, D = q.shape
        Hkv = pool.shape[3]
        grp = Hq // Hkv
        po, pl = part_o.view(-1, R, Lq, Hq, D), part_lse.view(-1, R, Lq, Hq)
        for h in range(Hkv):
            o_h, lse_h = part_o.clone(), part_lse.clone()
            launch(q, pool.to(q.dtype), o_h, lse_h, scale_log2 * float(kv_scale[0, h]))
            heads = slice(h * grp, (h + 1) * grp)
            po[slots, :, :, heads] = o_h.view(po.shape)[slots, :, :, heads] * float(kv_scale[1, h])
            pl[slots, :, :, heads] = lse_h.view(pl.shape)[slots, :, :, heads]

    def prefix(self, lib, stream, a):
        ops.check_prefix(a)
        assert a.tune == 0

        def launch(q_, pool_, o_, lse_, s_):
            self.kernels.prefix(lib, stream, a._replace(q=q_, pool=pool_, part_o=o_, part_lse=lse_, scale_log2=s_,
                                                        kv_scale=None))
        self._per_head(launch, a.q, a.pool, a.part_o, a.part_lse, slice(a.slot0, a.slot0 + a.max_chunks),
                       a.scale_log2, a.kv_scale)

    def suffix(self, lib, stream, a):
        ops.check_suffix(a)

        def launch(q_, pool_, o_, lse_, s_):
            self.kernels.suffix(lib, stream, a._replace(q=q_, pool=pool_, part_o=o_, part_lse=lse_, scale_log2=s_,
                                                        kv_scale=None))
        self._per_head(launch, a.q, a.pool, a.part_o, a.part_lse, slice(a.slot0, a.slot0 + a.nsplit), a.scale_log2,
                       a.kv_scale)


@pytest.mark.parametrize("three", [False, True], ids=["two-levels", "three-levels"])
@pytest.mark.parametrize("quirks", [{}, {"softcap": 20.0}, {"window": 40}], ids=["plain", "softcap", "window"])
def test_cuda_backend_folded_scales_equal_the_reference_dequantization(monkeypatch, quirks, three):
    """The cuda backend's launches on an fp8 pool (cuda._launch: the pool's kv_scale to the prefix and suffix kernels)
    with the kernels' use of the scales emulated (K's folded into the scores' scale, once per KV head; V's on the
    partials) equal the reference on the same pool, which dequantizes every token, in float64."""
    from test_cuda_emulation import _FakeLib
    from hf_cascade.kernels import cuda as cuda_backend
    from hf_cascade.kernels import cuda_tuning
    # short chunks and several suffix splits (tests/decode/test_cuda_emulation.py's _small_pieces)
    monkeypatch.setattr(cuda_backend, "_sm_count", lambda dev: 16)
    monkeypatch.setattr(cuda_tuning, "choose_chunk_blocks",
                        lambda pb, ctas, slots, bs, tile, **kw: 2 * max(1, tile // bs))
    monkeypatch.setattr(cuda_backend, "choose_suffix_split", lambda tmax, ctas, slots, min_tokens=None: (100, max(1, -(-tmax // 100))))
    if three:
        lay = random_three_level(9, sys_tokens=160, prompts=2, beams=3, own_tokens=(40, 90), suffix=(1, 30),
                                 lone_rows=1, Hkv=2, ratio=4, D=64, bs=16, dtype=torch.float32)
    else:
        lay = random_layout(9, groups=((3, 300), (2, 90)), lone_rows=1, suffix=(1, 150), Hkv=2, ratio=4, D=64, bs=16,
                            dtype=torch.float32, q_scale=1.5)
    plan = step_plan(lay)
    pool8, _ = _quantize(lay.pool.double(), seed=5)
    q = lay.q.to(torch.bfloat16)
    params = AttentionParams(lay.scale, **quirks)
    state = cuda_backend.BACKEND.build(plan, q, pool8, params, lib=_FakeLib())
    assert state.three == (three and params.window is None) and state.max_chunks > 1 and (three or state.nsplit > 1)
    out = torch.zeros(q.shape, dtype=torch.float64)
    cuda_backend._launch(_FakeLib(), 0, q, pool8, state, params, out, kernels=_FoldedScales())
    want = reference.attend(q.double(), pool8, plan, params)
    assert torch.isfinite(out).all(), "a NaN key (an unused pool slot) was read"
    err = (out - want).abs().max() / want.abs().max()
    assert err < 2e-5, f"max error {err:.2e} relative to the largest output"
