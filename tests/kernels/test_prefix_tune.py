"""The prefix kernel's launch geometry (hf_cascade.kernels.cuda_tuning): the architecture's choice of the Hopper kernel
and the tuning knobs for a sweep (PrefixTune, $HF_CASCADE_PREFIX_TUNE), on the CPU: the parser, the launch parameters
they give (the default's must not change), and that a tuned launch still computes the reference's result (the
emulated kernels of tests/decode/test_cuda_emulation.py walk the variant's tiles and warps).
"""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_cascade.kernels import cuda as cuda_backend
from hf_cascade.kernels import cuda_tuning
from kernel_helpers import random_layout, step_plan
from test_cuda_emulation import PREFIX_TUNES, _FakeLib, check, prefix_cfg, run

ROOT = Path(__file__).resolve().parents[2]
parse = cuda_backend.parse_prefix_tune


@pytest.fixture(autouse=True)
def _default_tune():
    cuda_backend.set_prefix_tune(None)
    yield
    cuda_backend.set_prefix_tune(None)


def test_parse():
    assert parse("") == parse(None) == parse("auto") == cuda_backend.PrefixTune()
    assert parse("default") == parse("variant=default") == cuda_backend.PrefixTune(variant="default")
    t = parse("variant=n64w8, m=64,chunk=1376,prefer=0,min=512")
    assert (t.variant, t.m_tile, t.chunk_tokens, t.prefer_tokens, t.min_tokens) == ("n64w8", 64, 1376, 0, 512)
    assert parse(str(t)) == t and str(cuda_backend.PrefixTune()) == "auto"
    for bad, what in (("variant=n128", "variant"), ("m=48", "m=48"), ("chunk=x", "not an integer"),
                      ("stages=5", "unknown key"), ("n64", "key=value"), ("chunk=-1", "chunk=-1")):
        with pytest.raises(ValueError, match=what):
            parse(bad)


def test_environment_is_read_once(monkeypatch):
    monkeypatch.setattr(cuda_tuning, "_prefix_tune", None)
    monkeypatch.setenv(cuda_backend.PREFIX_TUNE_ENV, "variant=s6,chunk=2048")
    assert cuda_backend.prefix_tune() == parse("variant=s6,chunk=2048")
    monkeypatch.setenv(cuda_backend.PREFIX_TUNE_ENV, "m=16")
    assert cuda_backend.prefix_tune().variant == "s6"
    monkeypatch.setattr(cuda_tuning, "_prefix_tune", None)
    monkeypatch.setenv(cuda_backend.PREFIX_TUNE_ENV, "bogus")
    with pytest.raises(ValueError):
        cuda_backend.prefix_tune()


class _H200:
    """prefix_info of the default kernels on an H200 (3 CTAs per SM at 16/32 rows, 2 at 64; 32-token tiles at D 128)
    and of the tuning variants (their tile; 2 CTAs per SM), recording the tune codes set up."""

    def __init__(self, sm90=False):
        self.codes = []
        self.sm90 = sm90         # the library holds the Hopper kernel's sm_90a code

    def prefix_info(self, dtype_code, D, m_tile, device_index=None, tune=0):
        self.codes.append(tune)
        if tune:
            return 2, 0, prefix_cfg(D, m_tile, tune)[2]
        return (2 if m_tile == 64 else 3), 0, prefix_cfg(D, m_tile)[2]

    def prefix_runs(self, dtype_code, D, m_tile, tune):
        return self.sm90 or tune not in (SM90_CODE, SM90_FP8_CODE)


SM90_CODE = cuda_tuning.HOPPER_KERNEL
SM90_FP8_CODE = cuda_tuning.HOPPER_FP8_KERNEL


def level(groups, beams, prefix, tune=cuda_backend.PrefixTune(), dtype=torch.bfloat16, D=128, plain=True, sm90=False,
          fp8=False):
    lib = _H200(sm90)
    gr = np.arange(groups * beams, dtype=np.int32).reshape(groups, beams)
    lv = cuda_backend._prefix_level(lib, gr, np.full(groups, prefix), prefix // 16, groups * beams, 1, 4, 8, D, dtype,
                                    16, 132, tune, plain, fp8)
    return (lv.m_tile, lv.row_tiles, lv.chunk_tokens, lv.max_chunks, lv.tune), lib.codes


@pytest.mark.parametrize("shape,want", [
    ((8, 8, 16384), (32, 1, 1024, 16, 0)), ((8, 16, 16384), (64, 1, 1024, 16, 0)),
    ((8, 4, 16384), (16, 1, 1024, 16, 0)), ((8, 8, 4096), (32, 1, 352, 12, 0))])
def test_default_launch_is_unchanged(shape, want):
    # the default kernel's launch of the sweep's shapes (benchmarks/prefix_sweep_gpu.py), as before the tuning knobs
    got, codes = level(*shape, parse("default"))
    assert got == want and codes == [0]


@pytest.mark.parametrize("shape,want", [
    ((8, 8, 16384), (64, 1, 2048, 8, 2)), ((8, 16, 16384), (64, 1, 2048, 8, 2)),
    ((8, 4, 16384), (64, 1, 2048, 8, 2)), ((8, 8, 4096), (64, 1, 1024, 4, 2))])
def test_production_launch_is_the_sweeps_winner(shape, want):
    # "auto": the launches the H200 sweep timed as "variant=n64w8,m=64,prefer=0" (benchmarks/RESULTS.md)
    got, codes = level(*shape)
    assert got == want and codes == [2]
    # ... and where the library's Hopper kernel runs (the architecture's choice): the same tiles and chunks
    got, codes = level(*shape, sm90=True)
    assert got == (*want[:4], SM90_CODE) and codes == [SM90_CODE]


def test_hopper_kernel_only_where_it_runs():
    # "kernel=sm90" (read from the retired "variant=wg" too) asked for where the library has no sm_90a code: the
    # default kernel; bf16 and fp16 at head_dim 128 only
    assert parse("variant=wg") == parse("kernel=sm90") and str(parse("variant=wg")) == "kernel=sm90"
    tuning_codes = {c for c, _ in cuda_backend.PREFIX_VARIANTS.values()}
    assert "wg" not in cuda_backend.PREFIX_VARIANTS and SM90_CODE not in tuning_codes     # not a tuning variant
    assert level(8, 8, 16384, parse("variant=wg"))[0][4] == 0
    assert level(8, 8, 16384, parse("variant=wg"), sm90=True)[0][:2] == (64, 1)
    assert level(8, 8, 16384, parse("variant=wg"), sm90=True)[0][4] == SM90_CODE
    assert level(8, 8, 16384, parse("variant=wg"), dtype=torch.float16, sm90=True)[0][4] == SM90_CODE
    assert level(8, 8, 16384, parse("variant=wg"), D=64, sm90=True)[0][4] == 0
    assert level(8, 8, 16384, parse("variant=wg"), plain=False, sm90=True)[0][4] == 0
    assert level(8, 8, 16384, parse("variant=wg,m=32"), sm90=True)[0][4] == 0          # 64-row tiles only
    # "auto" on a Hopper library: the Hopper kernel for bf16 and fp16 groups of any size (timed from 8 query rows)
    assert level(8, 8, 16384, dtype=torch.float16, sm90=True)[0][4] == SM90_CODE
    assert level(8, 2, 16384, sm90=True)[0][:2] + level(8, 2, 16384, sm90=True)[0][4:] == (64, 1, SM90_CODE)
    assert level(8, 8, 16384, dtype=torch.float16)[0][4] == 0                          # elsewhere fp16: the default
    assert level(8, 8, 16384, plain=False, sm90=True)[0][4] == 0
    assert level(8, 8, 16384, D=64, sm90=True)[0][4] == 0


def test_fp8_pools_take_the_hopper_kernel_only_where_switched_on_and_it_runs(monkeypatch):
    # off: an fp8 pool runs the portable default kernel, never a tuning variant
    monkeypatch.setattr(cuda_tuning, "hopper_fp8", False)
    assert level(8, 8, 16384, fp8=True, sm90=True) == level(8, 8, 16384, parse("default"), fp8=True)
    assert level(8, 8, 16384, fp8=True)[0][4] == 0
    monkeypatch.setattr(cuda_tuning, "hopper_fp8", True)
    got, codes = level(8, 8, 16384, fp8=True, sm90=True)
    assert got == (*level(8, 8, 16384, sm90=True)[0][:4], SM90_FP8_CODE) and codes == [SM90_FP8_CODE]
    assert level(8, 8, 16384, dtype=torch.float16, fp8=True, sm90=True)[0][4] == SM90_FP8_CODE
    assert level(8, 8, 16384, fp8=True, sm90=True)[0][4] == SM90_FP8_CODE
    # where it does not run or fit: the portable default kernel (as before), not a tuning variant
    assert level(8, 8, 16384, fp8=True) == level(8, 8, 16384, parse("default"), fp8=True)
    assert level(8, 8, 16384, fp8=True, plain=False, sm90=True)[0][4] == 0
    assert level(8, 8, 16384, fp8=True, D=64, sm90=True)[0][4] == 0
    assert level(8, 8, 16384, parse("m=32"), fp8=True, sm90=True)[0][4] == 0
    # a 16-bit pool is unchanged by the switch
    assert level(8, 8, 16384, sm90=True)[0][4] == SM90_CODE


def test_production_tuning_only_where_it_was_measured():
    auto = cuda_backend.PrefixTune()
    assert level(8, 8, 16384, auto, dtype=torch.float16)[0] == level(8, 8, 16384, parse("default"),
                                                                      dtype=torch.float16)[0]
    assert level(8, 8, 16384, auto, D=64)[0][4] == 0 and level(8, 8, 16384, auto, plain=False)[0][4] == 0
    assert level(8, 2, 16384, auto)[0] == level(8, 2, 16384, parse("default"))[0]       # 8 query rows
    assert level(8, 8, 16384, parse("m=32"))[0][4] == 0                                 # knobs: the default kernel
    assert auto.splits_by_plainness(torch.bfloat16, 128) and auto.splits_by_plainness(torch.float16, 128)
    assert not auto.splits_by_plainness(torch.float16, 64)
    assert not parse("default").splits_by_plainness(torch.bfloat16, 128)


def test_knobs_give_their_launch():
    assert level(8, 8, 16384, parse("prefer=0"))[0] == (32, 1, 448, 37, 0)        # the wave rule alone
    assert level(8, 8, 16384, parse("chunk=1376"))[0] == (32, 1, 1376, 12, 0)
    assert level(8, 8, 16384, parse("chunk=1000"))[0][2] == 1008                    # whole blocks
    assert level(8, 16, 16384, parse("m=32"))[0][:2] == (32, 2)
    assert level(8, 8, 16384, parse("m=64"), D=256)[0][0] == 32                    # 64 rows: D <= 128 only
    got, codes = level(8, 8, 16384, parse("variant=n64"))
    assert got[4] == 1 and codes == [1]
    # a variant serves bf16, D 128, plain layers and its compiled row tiles only; elsewhere the default runs
    assert level(8, 8, 16384, parse("variant=n64"), dtype=torch.float16)[0][4] == 0
    assert level(8, 8, 16384, parse("variant=n64"), plain=False)[0][4] == 0
    assert level(8, 4, 16384, parse("variant=w8"))[0][4] == 0                       # 16 rows: not compiled
    assert level(8, 4, 16384, parse("variant=w8,m=32"))[0][4] == 3


def test_variant_tables_match_the_kernel_source():
    # csrc/prefix.cu: PrefixTune<V> and with_tune's (V, M) cases; cuda.PREFIX_VARIANTS and the emulation's table
    src = (ROOT / "csrc" / "prefix.cu").read_text()
    tunes = {int(v): (int(n), int(w)) for v, n, w in re.findall(
        r"struct PrefixTune<(\d)> \{ static constexpr int N = (\d+), STAGES = \d+, WARPS = (\d+)", src)}
    # the Hopper kernel (csrc/prefix_sm90.cu): its tile and its consumer warpgroup, and its code in launch.h
    sm90 = (ROOT / "csrc" / "prefix_sm90.cu").read_text()
    d, m, n = map(int, re.search(r"static constexpr int D = (\d+), M = (\d+), N = (\d+);", sm90).groups())
    consumers = int(re.search(r"static constexpr int CONSUMERS = (\d+)", sm90).group(1))
    params = (ROOT / "csrc" / "include" / "hfc" / "params.h").read_text()
    code = int(re.search(r"HFC_PREFIX_KERNEL_SM90 = (\d+)", params).group(1))
    fp8_code = int(re.search(r"HFC_PREFIX_KERNEL_SM90_FP8 = (\d+)", params).group(1))
    assert (d, code, fp8_code) == (128, SM90_CODE, SM90_FP8_CODE)
    tunes[code] = tunes[fp8_code] = (n, consumers // 32)
    assert tunes == {k: v for k, v in PREFIX_TUNES.items() if k}
    cases = {(int(c) // 100, int(c) % 100) for c in re.findall(r"case (\d{3}): return f\(I", src)} | {(code, m)}
    assert cases == {(c, m) for c, ms in cuda_backend.PREFIX_VARIANTS.values() if c for m in ms} | \
        {(code, cuda_tuning.HOPPER_M_TILE)}


@pytest.mark.parametrize("tune", ["auto", "variant=n64", "variant=n64w8", "variant=w8", "variant=s3c4", "variant=s6",
                                  "variant=n64w8,m=64,chunk=96", "m=16,chunk=64", "prefer=0,min=32", "variant=wg",
                                  "auto-sm90"])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_tuned_launch_matches_the_reference(tune, softcap, monkeypatch):
    # D 128, bf16, 8 query heads per KV head: the variants' shapes (with a softcap the default kernel runs); a small
    # GPU, so that the chunk rule cuts the prefixes into several chunks. "wg" / "auto-sm90": a Hopper library.
    monkeypatch.setattr(cuda_backend, "_sm_count", lambda dev: 4)
    if tune in ("variant=wg", "auto-sm90"):
        monkeypatch.setattr(_FakeLib, "sm90", True)
        tune = tune.replace("auto-sm90", "auto")
    cuda_backend.set_prefix_tune(tune)
    lay = random_layout(11, groups=((3, 700), (2, 90), (2, 0)), lone_rows=1, suffix=(1, 300), Lq=1, Hkv=2, ratio=8,
                        D=128, bs=16, dtype=torch.float32, q_scale=1.5)
    plan = step_plan(lay)
    out, ref, emu = run(lay, plan, softcap=softcap)
    check(out, ref, emu)
    variant = cuda_backend.prefix_tune().variant
    hopper = _FakeLib.sm90 and cuda_backend.prefix_tune() in (cuda_backend.PrefixTune(), parse("kernel=sm90"))
    if variant == "auto":        # the production tuning on these plain 24-query-row groups; with knobs, the default
        variant = "n64w8" if cuda_backend.prefix_tune() == cuda_backend.PrefixTune() else "default"
    code, m_tiles = (SM90_CODE, (64,)) if hopper else cuda_backend.PREFIX_VARIANTS[variant]
    st = emu.state
    assert set(emu.tunes) == {code if softcap is None and st.m_tile in m_tiles else 0}


def test_the_suffix_split_knob_parses_and_sets_the_split_alone():
    """``split=N`` (the suffix split's shortest length, a sweep's knob): parsed and printed back; the prefix kernel's
    choices read the tuning without it (the Hopper kernel and the auto variant stay the production ones), and the split
    rule then cuts a 256-token suffix into 4 splits of 64 where it took one."""
    from hf_cascade.kernels import cuda_tuning
    tune = cuda_tuning.parse_prefix_tune("split=64")
    assert tune == cuda_tuning.PrefixTune(split_min=64) and str(tune) == "split=64"
    assert tune.wants_hopper(torch.bfloat16, 128, True)
    assert tune.resolve(torch.bfloat16, 128, 64, True) == replace(cuda_tuning.AUTO_TUNE, split_min=64)
    assert cuda_tuning.choose_suffix_split(256, 8, 528) == (256, 1)
    assert cuda_tuning.choose_suffix_split(256, 8, 528, tune.split_min) == (64, 4)
