"""Launch geometry of the CUDA backend's kernels: which prefix kernel runs, its row tile and chunks, the suffix split.

Host arithmetic only (numpy on the plan's host arrays, no CUDA call but the library's one-time prefix setup), done
once per step state and reused by every layer:

- :func:`prefix_level`: the prefix kernel's launch for one shared level (kernel, row tile, chunk length, chunks per
  group); :func:`choose_chunk_blocks` and :func:`choose_suffix_split` the chunk and split rules.
- The prefix kernel is an architecture decision: on a GPU that runs the library's sm_90a code (the library's probe,
  ``csrc/prefix_sm90.cu``, compiled under ``__CUDA_ARCH__``), plain bf16 / fp16 head_dim-128 layers run the Hopper
  kernel (:data:`HOPPER_KERNEL`; over an fp8 pool :data:`HOPPER_FP8_KERNEL` where :data:`hopper_fp8` is on);
  elsewhere the portable mma.sync kernel of ``csrc/prefix.cu``.
- :func:`choose_solo_split`: the split of rows that share no prefix (one launch, ``csrc/solo.cu``) where
  :data:`solo_kernel` is on.
- :class:`PrefixTune`: the tuning knobs of a sweep (``benchmarks/prefix_sweep_gpu.py``), from
  ``$HF_CASCADE_PREFIX_TUNE`` or :func:`set_prefix_tune`; unset ("auto"), every launch is the production one.

Mutable state: the tuning in effect (``_prefix_tune``), set under ``_tune_lock``.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
import numpy as np
import torch

from .cuda_binding import DTYPE_CODES

__all__ = ["PrefixTune", "PrefixLevel", "parse_prefix_tune", "prefix_tune", "set_prefix_tune", "prefix_level",
           "choose_chunk_blocks", "choose_suffix_split", "choose_solo_split", "solo_counters", "PREFIX_TUNE_ENV",
           "PREFIX_VARIANTS", "HOPPER_KERNEL", "HOPPER_FP8_KERNEL"]

MIN_CHUNK_TOKENS = 256     # a prefix chunk's partial costs D floats per query row: keep chunks long enough
MIN_SPLIT_TOKENS = 256     # same for suffix splits
# prefer 1024-token prefix chunks while they still fill one wave: fewer partials to write and merge
# (H200, 8x8 beams at 16k: prefix + merge 239 us at 1024 tokens vs 257 us at the wave rule's 448)
PREFER_CHUNK_TOKENS = 1024
SUFFIX_QB = 4              # query vectors per suffix CTA (kQB in csrc/suffix.cu)
SUFFIX_CTAS_PER_SM = 4     # the suffix kernel's occupancy (128 threads x 128 registers)
# The Hopper prefix kernel (csrc/prefix_sm90.cu: wgmma fed by a producer warp): its kernel code in
# hfc_prefix_params.tune (HFC_PREFIX_KERNEL_SM90 in csrc/include/hfc/params.h; the codes below it are csrc/prefix.cu's
# tuning variants, PREFIX_VARIANTS), what it serves and its one row tile. It runs where the library holds
# sm_90a code for the GPU (the library's probe: Lib.prefix_runs). H200 (benchmarks/RESULTS.md, "The prefix kernel on
# Hopper"), Llama-3-8B layer, 16k prefix: 8x8 222 -> 184 us, 8x16 294 -> 201 us, 8x4 213 -> 180 us, 8x8 at 4k
# 79 -> 79 us; groups of 8 query rows (8x2) 231 -> 179 us; fp16 8x8 255 -> 185 us. So it serves groups of any size.
HOPPER_KERNEL = 6
HOPPER_DTYPES = (torch.bfloat16, torch.float16)
HOPPER_HEAD_DIM = 128
HOPPER_M_TILE = 64
# The same kernel over a float8_e4m3fn pool (HFC_PREFIX_KERNEL_SM90_FP8): two producer warps stage the fp8 tiles and
# convert them (exactly) into the 16-bit tiles the wgmma reads, so the pool's bytes are read once, at half bf16's
# count. H100 (2026-12-05, tests/kv/test_gpu_fp8.py -k time_report), 8B layer at 8 x 8 beams x 16k: prefix 234 us on
# the portable kernel's fp8 path -> 168 us here, against 201 us for the bf16 Hopper kernel (0.84x; issue 34 wants
# <= 0.6x); its GPU tests passed there (tests/kv/test_gpu_fp8.py -k hopper). False: fp8 pools run the portable kernel
HOPPER_FP8_KERNEL = 7
hopper_fp8 = True

# Rows that share no prefix (every group of one row: greedy search, one sample per prompt) in one launch of
# csrc/solo.cu instead of the prefix, suffix and merge kernels: a decode step's layer reads a few MB there, and the
# three dependent launches took ~20 us a layer of 8B greedy at 4k on the H200 (prefix 9.5, suffix 8, merge 3.1 us).
# Its GPU tests passed on an H100 (2026-12-05, tests/kernels/test_gpu_kernels.py -k solo), but it was slower there:
# 704 us a step of 8B greedy at 4k against 310 + 251 + ~100 us for the three kernels (benchmarks/RESULTS.md,
# "Twentieth session"), so it stays off. False: the three kernels everywhere
solo_kernel = False
SOLO_QB = 4                # query vectors per solo CTA (kQB in csrc/solo.cu)
SOLO_MAX_SPLIT = 512       # tokens per split at most (kMaxSplit there: its staged pool rows)
SOLO_CTAS_PER_SM = 3       # the solo kernel's occupancy (128 threads x 155 registers)
SOLO_MIN_SPLIT = 64        # tokens per split at least: a split's partial costs D floats per query
SOLO_SPLIT_ALIGN = 32      # a CTA's tokens per round (4 warps x 2 tokens x kU 4 at head_dim 128)
SOLO_MAX_SLOTS = 64        # splits per row at most: the last CTA merges them (16 at a time), so longer rows (past
                           # 64 x 512 tokens) keep the prefix kernel, which also reads them at a higher bandwidth

# Tuning the prefix kernel's launch for a sweep (benchmarks/prefix_sweep_gpu.py), e.g. "variant=n64,m=32,chunk=1024":
#   variant  a compiled tuning variant of csrc/prefix.cu (PrefixTune<code>): its code and the row tiles it is compiled
#            for; it serves bf16, head_dim 128 layers without softcap / window (others run the default kernel).
#            "auto" (the production choice): AUTO_TUNE where the sweep measured it faster, else "default"
#   kernel   "auto": the architecture's choice (with every other knob at its default; else the portable kernel);
#            "sm90": the Hopper kernel wherever it runs and fits, with the other knobs (chunk, prefer, min); where it
#            does not, the portable default kernel. "variant=wg" (its name while it was a tuning variant) reads as it
#   m        the row tile (16, 32, 64; 64 only for head_dim <= 128): more row tiles per group when smaller
#   chunk    fixed prefix chunk length in tokens (rounded up to whole blocks), instead of choose_chunk_blocks
#   prefer   choose_chunk_blocks' preferred chunk tokens (0: the wave rule alone); min: its shortest chunk
#   split    the suffix split's shortest length in tokens (choose_suffix_split's min_tokens; 0: MIN_SPLIT_TOKENS)
# Unset ("auto"), every launch is the production one.
PREFIX_TUNE_ENV = "HF_CASCADE_PREFIX_TUNE"
# name -> (code in hfc_prefix_params.tune, the row tiles it is compiled for); csrc/prefix.cu's with_tune lists the same
PREFIX_VARIANTS = {"default": (0, (16, 32, 64)), "n64": (1, (16, 32, 64)), "n64w8": (2, (32, 64)),
                   "w8": (3, (32, 64)), "s3c4": (4, (16, 32)), "s6": (5, (32, 64))}
PREFIX_KERNELS = ("auto", "sm90")
_RETIRED_HOPPER_VARIANT = "wg"    # the Hopper kernel was tuning variant "wg" (code 6) until it became the arch's choice


@dataclass(frozen=True)
class PrefixTune:
    """One point of the prefix kernel's tuning space (0 / None / "auto": the production choice), and the suffix
    split's shortest length (``split_min``, tokens; 0: MIN_SPLIT_TOKENS), which the same sweep times (a layer's
    attention is prefix, suffix and merge)."""
    variant: str = "auto"
    m_tile: int = 0
    chunk_tokens: int = 0
    prefer_tokens: int | None = None
    min_tokens: int = 0
    kernel: str = "auto"
    split_min: int = 0

    def _prefix_knobs(self) -> "PrefixTune":
        """This tuning less the suffix's knob (what the prefix kernel's choices read)."""
        return replace(self, split_min=0)

    def wants_hopper(self, dtype, head_dim: int, plain: bool) -> bool:
        """Whether this tuning lets a layer of this kind run the Hopper kernel where the GPU runs it: "auto" with
        every knob at its default, or kernel=sm90 (at its one row tile)."""
        fits = plain and dtype in HOPPER_DTYPES and head_dim == HOPPER_HEAD_DIM
        if self.kernel == "sm90":
            return fits and self.m_tile in (0, HOPPER_M_TILE)
        return fits and self._prefix_knobs() == PrefixTune()

    def resolve(self, dtype, head_dim: int, query_rows: int, plain: bool) -> "PrefixTune":
        """The tuning of a portable-kernel launch: "auto" alone is, for bf16 head_dim-128 layers without softcap /
        window in groups of >= AUTO_MIN_QUERY_ROWS query rows, AUTO_TUNE (where the H200 measured it faster), else
        the default kernel (as are "auto" with other knobs set); any other setting as given."""
        if self.variant != "auto":
            return self
        if (self._prefix_knobs() == PrefixTune() and plain and head_dim == 128 and dtype == torch.bfloat16
                and query_rows >= AUTO_MIN_QUERY_ROWS):
            return replace(AUTO_TUNE, split_min=self.split_min)
        return replace(self, variant="default")

    def splits_by_plainness(self, dtype, head_dim: int) -> bool:
        """Whether plain layers may launch a kernel that layers with softcap / window cannot (their launch states
        then differ); otherwise every layer of a step shares one state."""
        if self.wants_hopper(dtype, head_dim, True):
            return True
        if self.variant == "auto":
            return False
        return self.variant != "default"

    def code(self, dtype, head_dim: int, m_tile: int, plain: bool) -> int:
        """The portable kernel's tune code for this launch: the variant's where it is compiled, else 0."""
        code, m_tiles = PREFIX_VARIANTS[self.variant]
        fits = plain and dtype == torch.bfloat16 and head_dim == 128 and m_tile in m_tiles
        return code if fits else 0

    def __str__(self) -> str:
        parts = [f"variant={self.variant}"] if self.variant != "auto" else []
        if self.kernel != "auto":
            parts.append(f"kernel={self.kernel}")
        for key, value in (("m", self.m_tile), ("chunk", self.chunk_tokens), ("min", self.min_tokens),
                           ("split", self.split_min)):
            if value:
                parts.append(f"{key}={value}")
        if self.prefer_tokens is not None:
            parts.append(f"prefer={self.prefer_tokens}")
        return ",".join(parts) or "auto"


# The production tuning of the portable kernel where it applies (PrefixTune.resolve): 64-token K/V tiles and 8 warps,
# 64-row tiles, the wave rule's chunks. Prefix sweep on the H200 (benchmarks/RESULTS.md), Llama-3-8B layer, 8 prompts
# x B beams, 16k prefix: 8x8 252 -> 221 us, 8x16 362 -> 292 us, 8x4 234 -> 212 us; 8x8 at 4k 94 -> 80 us. Smaller
# groups were not measured.
AUTO_TUNE = PrefixTune(variant="n64w8", m_tile=64, prefer_tokens=0)
AUTO_MIN_QUERY_ROWS = 16
# the Hopper kernel's chunking: the wave rule's chunks (as AUTO_TUNE's)
HOPPER_PREFER_TOKENS = 0


def parse_prefix_tune(text: str | None) -> PrefixTune:
    """``"variant=n64,m=32,chunk=1024,prefer=0,min=512"`` (any subset, any order) -> PrefixTune; "" -> default."""
    fields: dict = {}
    for item in (text or "").replace(" ", "").split(","):
        if not item or item == "auto":
            continue
        if item == "default":                 # the default kernel with the default launch rules
            item = "variant=default"
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"prefix tune {text!r}: {item!r} is not key=value")
        if key == "variant" and value == _RETIRED_HOPPER_VARIANT:
            key, value = "kernel", "sm90"
        if key == "variant":
            if value not in PREFIX_VARIANTS and value != "auto":
                raise ValueError(f"prefix tune {text!r}: variant {value!r} (one of {', '.join(PREFIX_VARIANTS)})")
            fields["variant"] = value
            continue
        if key == "kernel":
            if value not in PREFIX_KERNELS:
                raise ValueError(f"prefix tune {text!r}: kernel {value!r} (one of {', '.join(PREFIX_KERNELS)})")
            fields["kernel"] = value
            continue
        names = {"m": "m_tile", "chunk": "chunk_tokens", "prefer": "prefer_tokens", "min": "min_tokens",
                 "split": "split_min"}
        if key not in names:
            raise ValueError(f"prefix tune {text!r}: unknown key {key!r} (variant, kernel, {', '.join(names)})")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"prefix tune {text!r}: {key}={value!r} is not an integer") from None
        if number < 0 or (key == "m" and number not in (0, 16, 32, 64)):
            raise ValueError(f"prefix tune {text!r}: {key}={number} (m: 16, 32 or 64; the others >= 0)")
        fields[names[key]] = number
    return PrefixTune(**fields)


_tune_lock = threading.Lock()
_prefix_tune: PrefixTune | None = None      # None: not read yet (prefix_tune reads $HF_CASCADE_PREFIX_TUNE once)


def prefix_tune() -> PrefixTune:
    """The tuning in effect: set_prefix_tune's, else $HF_CASCADE_PREFIX_TUNE's (read once), else the default."""
    global _prefix_tune
    found = _prefix_tune
    if found is None:
        with _tune_lock:
            if _prefix_tune is None:
                _prefix_tune = parse_prefix_tune(os.environ.get(PREFIX_TUNE_ENV, ""))
            found = _prefix_tune
    return found


def set_prefix_tune(tune: "PrefixTune | str | None") -> PrefixTune:
    """Set the tuning for the next step states (None or "": the default); returns it. A plan's cached launch state
    is keyed by the tuning, so a plan built before still takes the new one."""
    global _prefix_tune
    parsed = tune if isinstance(tune, PrefixTune) else parse_prefix_tune(tune)
    with _tune_lock:
        _prefix_tune = parsed
    return parsed


# ------------------------------------------------------------------------------------------ chunking

def choose_chunk_blocks(prefix_blocks, ctas_per_chunk: int, slots: int, block_size: int, tile_tokens: int,
                        min_tokens: int = MIN_CHUNK_TOKENS, max_waves: int = 8,
                        prefer_tokens: int | None = None) -> int:
    """Blocks per prefix chunk, the same for all groups.

    ``prefix_blocks``: blocks of each group's prefix; ``ctas_per_chunk``: CTAs per (group, chunk), i.e.
    KV heads x row tiles; ``slots``: CTAs resident at once (SMs x CTAs per SM). Picks the fewest waves whose
    last wave is at least 90% full (the grid fills the GPU, at least one full wave when the prefix is long
    enough), with chunks a multiple of the K/V tile and at least ``min_tokens`` long. With
    ``prefer_tokens``, chunks of that length are taken whenever they still make one full wave.
    """
    pb = np.asarray(prefix_blocks, dtype=np.int64)
    pb = pb[pb > 0]
    if pb.size == 0:
        return 1
    align = tile_tokens // block_size if (block_size <= tile_tokens and tile_tokens % block_size == 0) else 1
    round_up = lambda x: -(-int(x) // align) * align  # noqa: E731
    min_cb = round_up(max(1, -(-min_tokens // block_size)))
    max_cb = round_up(int(pb.max()))
    if prefer_tokens:
        cb = min(round_up(-(-prefer_tokens // block_size)), max_cb)
        if ctas_per_chunk * int((-(-pb // cb)).sum()) >= slots:
            return int(cb)
    total = int(pb.sum()) * ctas_per_chunk
    best_cb, best_eff = max_cb, -1.0
    for waves in range(1, max_waves + 1):
        cb = min(max(round_up(-(-total // (waves * slots))), min_cb), max_cb)
        ctas = ctas_per_chunk * int((-(-pb // cb)).sum())
        eff = ctas / (-(-ctas // slots) * slots)
        if eff > best_eff + 1e-9:
            best_cb, best_eff = cb, eff
        if eff >= 0.9 or cb == min_cb:
            break
    return int(best_cb)


def choose_suffix_split(max_tokens: int, ctas: int, slots: int, min_tokens: int = MIN_SPLIT_TOKENS) -> tuple[int, int]:
    """(tokens per split, splits) of the suffix: split long suffixes until ~2 waves of ``slots`` CTAs."""
    if max_tokens <= 0:
        return 1, 1
    want = max(1, -(-2 * slots // max(ctas, 1)))
    nsplit = max(1, min(want, -(-max_tokens // min_tokens)))
    split_tokens = -(-max_tokens // nsplit)
    return split_tokens, -(-max_tokens // split_tokens)


def solo_counters(R: int, Lq: int, Hq: int, Hkv: int) -> int:
    """The solo kernel's counters (and CTAs per split): one per (row, KV head, query block of SOLO_QB queries)."""
    return R * Hkv * -(-(Lq * (Hq // Hkv)) // SOLO_QB)


def choose_solo_split(capacity_tokens: int, units: int, slots: int) -> tuple[int, int] | None:
    """(tokens per split, splits) of the solo kernel over rows of ``capacity_tokens`` (prefix and suffix tables' widths
    in tokens): about one wave of ``slots`` CTAs over ``units`` (rows x KV heads x query blocks) CTAs per split, splits
    of SOLO_MIN_SPLIT to SOLO_MAX_SPLIT tokens in multiples of SOLO_SPLIT_ALIGN; None where that takes more than
    SOLO_MAX_SLOTS splits (the three kernels then)."""
    capacity_tokens = max(int(capacity_tokens), 1)
    want = -(-capacity_tokens * max(units, 1) // max(slots, 1))
    split = min(max(SOLO_MIN_SPLIT, -(-want // SOLO_SPLIT_ALIGN) * SOLO_SPLIT_ALIGN), SOLO_MAX_SPLIT)
    nsplit = -(-capacity_tokens // split)
    return (split, nsplit) if nsplit <= SOLO_MAX_SLOTS else None


# ------------------------------------------------------------------------------- one prefix level

@dataclass
class PrefixLevel:
    """The prefix kernel's launch shape for one shared level (the group prefix, or a three-level plan's middle)."""
    has: bool
    m_tile: int
    row_tiles: int
    chunk_tokens: int
    max_chunks: int
    row_nchunks: np.ndarray       # int32 [R]: this level's partials of each row (0: in no (sub)group)
    tune: int = 0                 # the kernel code: the portable kernel's tuning variant (PrefixTune.code; 0: the
                                  # default) or HOPPER_KERNEL (the architecture's choice)


def prefix_level(lib, gr, pl, table_blocks, R, Lq, grp, Hkv, D, dtype, bs, sms, tune: PrefixTune = PrefixTune(),
                 plain: bool = True, fp8: bool = False) -> PrefixLevel:
    """Kernel, row tile and chunking of one shared level's prefix kernel launch (host arrays only, no sync); ``tune``
    (the default: the production choice) for a sweep, ``plain``: the layer has no softcap / window, ``fp8``: the
    pool holds float8_e4m3fn (the Hopper kernel's fp8 code where :data:`hopper_fp8` is on, else the portable
    default kernel)."""
    pl = np.asarray(pl).astype(np.int64)
    gr = np.asarray(gr)
    G, Rg = gr.shape
    row_nchunks = np.zeros(R, dtype=np.int32)
    if not (G > 0 and Rg > 0 and table_blocks > 0 and int(pl.max(initial=0)) > 0):
        return PrefixLevel(False, 1, 1, 1, 0, row_nchunks)
    rows_q = Rg * Lq * grp
    dtype_code = DTYPE_CODES[dtype]
    m_max = 64 if D <= 128 else 32
    # the architecture's choice: the Hopper kernel where the library's sm_90a code runs on this GPU (its probe)
    hopper = HOPPER_FP8_KERNEL if fp8 else HOPPER_KERNEL
    if ((hopper_fp8 or not fp8) and tune.wants_hopper(dtype, D, plain)
            and lib.prefix_runs(dtype_code, D, HOPPER_M_TILE, hopper)):
        code, m_tile = hopper, HOPPER_M_TILE
        if tune.prefer_tokens is None:
            tune = replace(tune, prefer_tokens=HOPPER_PREFER_TOKENS)
    else:
        plain = plain and not fp8          # the portable kernel's fp8 path is its default configuration only
        tune = tune.resolve(dtype, D, rows_q, plain)
        m_tile = next((m for m in (16, 32, 64) if m <= m_max and rows_q <= m), m_max)
        if tune.m_tile and tune.m_tile <= m_max:
            m_tile = tune.m_tile
        code = tune.code(dtype, D, m_tile, plain)
    row_tiles = -(-rows_q // m_tile)
    occ, _, tile_tokens = lib.prefix_info(dtype_code, D, m_tile, tune=code)
    if tune.chunk_tokens:
        chunk_blocks = -(-tune.chunk_tokens // bs)
    else:
        chunk_blocks = choose_chunk_blocks(
            -(-pl // bs), Hkv * row_tiles, sms * occ, bs, tile_tokens, min_tokens=tune.min_tokens or MIN_CHUNK_TOKENS,
            prefer_tokens=PREFER_CHUNK_TOKENS if tune.prefer_tokens is None else tune.prefer_tokens)
    chunk_tokens = chunk_blocks * bs
    nchunks = -(-pl // chunk_tokens)
    for g in range(G):              # one iteration per group (a prompt), not per block
        rows = gr[g][gr[g] >= 0]
        row_nchunks[rows] = nchunks[g]
    return PrefixLevel(True, m_tile, row_tiles, chunk_tokens, int(nchunks.max()), row_nchunks, code)
