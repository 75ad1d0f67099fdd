#!/usr/bin/env bash
# The two-GPU runs of RESULTS.md (issue 36), on a machine with 2 GPUs (H200s), from the repository root:
#   bash benchmarks/multi_gpu.sh OUT_DIR [PART ...]        PART: 8b 8bnofuse f32 70b dmap (default: 8b f32 70b)
# Each part fits one device call (under 10 minutes); each run writes its JSON into OUT_DIR (tp runs: rank 0's, and
# .rank1 beside it). Decode steps captured (--graphs on), whole-generate step = (t(32 new) - t(1 new)) / 31 after a
# warm-up round, stock sdpa interleaved on the same weights (--with-stock; its out-of-memory reported as {"oom": true}).
#   8b:   Llama-3-8B shape, 16k prompt x 8 beams, bf16: one GPU, then tensor parallelism over 2 (torchrun) against it
#         (target: TP step <= 0.7 x one GPU's)
#   8bnofuse: the 8b part's TP run with q/k/v and gate/up as separate products (--no-fuse), against the one-GPU run
#         of the 8b part (run 8b first): what fusing each rank's local shards buys
#   f32:  the same shape in float32 (TF32 off) at 2k x 8: TP tokens = one GPU's = stock's
#   70b:  Llama-3-70B shape (random bf16 weights, built sharded: no checkpoint), 8k x 8 beams, TP over 2
#         (target: step <= 1.5 x its memory floor, the JSON's floor_ms)
#   dmap: accelerate's device_map="auto" over 2 GPUs at 4k x 8 against one GPU (RESULTS' first two-GPU table)
# Weights: --random (seeded per parameter name: every run holds the same ones). CKPT=/path makes the 8B parts load a
# saved checkpoint instead (saved there once if missing).
set -euo pipefail
out="${1:?output folder}"
shift
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(8b f32 70b)
mkdir -p "$out"
# NVLink multicast stays off (a program using it can take a shared host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="${PYTHONPATH:-$PWD}"
py="${PYTHON:-$(command -v python3 || command -v python)}"
run() { "$py" benchmarks/multi_gpu.py "$@"; }
tp() { "$py" -m torch.distributed.run --nproc-per-node 2 benchmarks/multi_gpu.py tp "$@"; }
model8=(--random 8b)
if [ -n "${CKPT:-}" ]; then
  [ -f "$CKPT/config.json" ] || run save --shape 8b --dtype bfloat16 --dir "$CKPT"
  model8=(--dir "$CKPT")
fi
timed=(--graphs on --rounds "${ROUNDS:-3}" --with-stock)
for part in "${parts[@]}"; do
  case "$part" in
    8b)
      c=("${model8[@]}" --prompt 16384 --beams 8 --new-tokens 32 "${timed[@]}")
      run single "${c[@]}" --out "$out/mg8b_single.json"
      tp "${c[@]}" --ref "$out/mg8b_single.json" --out "$out/mg8b_tp.json" ;;
    8bnofuse)
      c=("${model8[@]}" --prompt 16384 --beams 8 --new-tokens 32 "${timed[@]}")
      tp "${c[@]}" --no-fuse --ref "$out/mg8b_single.json" --out "$out/mg8b_tp_nofuse.json" ;;
    f32)
      c=("${model8[@]}" --dtype float32 --prompt 2048 --beams 8 --new-tokens 24 --graphs on --rounds 1 --with-stock)
      run single "${c[@]}" --out "$out/mg8b_single_f32.json"
      tp "${c[@]}" --ref "$out/mg8b_single_f32.json" --out "$out/mg8b_tp_f32.json" ;;
    70b)
      tp --random 70b --prompt 8192 --beams 8 --new-tokens 32 "${timed[@]}" --out "$out/mg70b_tp.json" ;;
    dmap)
      c=("${model8[@]}" --prompt 4096 --beams 8 --new-tokens 32 --rounds 0)
      run single "${c[@]}" --out "$out/mg8b_single_4k.json"
      run device-map "${c[@]}" --gpus 2 --ref "$out/mg8b_single_4k.json" --out "$out/mg8b_dmap_4k.json" ;;
    *) echo "unknown part $part (8b 8bnofuse f32 70b dmap)" >&2; exit 2 ;;
  esac
done
