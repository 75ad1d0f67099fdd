#!/usr/bin/env bash
# The two-GPU runs of RESULTS.md (issue: two GPUs), on a machine with 2 GPUs:
#   bash benchmarks/multi_gpu.sh OUT_DIR
# Llama-3-8B shape, random weights saved once; one GPU vs device_map="auto" over 2 GPUs vs tensor
# parallelism (torchrun, 2 ranks): bf16 for memory and time, float32 (TF32 off) for exact tokens.
set -euo pipefail
out="${1:?output folder}"
# NVLink multicast stays off (a program using it can take a shared host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ck="${CKPT:-/tmp/hfc_ckpt8b}"
common=(--prompt "${PROMPT:-4096}" --beams "${BEAMS:-8}" --new-tokens "${NEW:-32}")
py="${PYTHON:-$(command -v python3 || command -v python)}"
run() { "$py" benchmarks/multi_gpu.py "$@"; }
tp() { "$py" -m torch.distributed.run --nproc-per-node 2 benchmarks/multi_gpu.py tp "$@"; }
[ -f "$ck/config.json" ] || run save --shape 8b --dtype bfloat16 --dir "$ck"
run single "${common[@]}" --dir "$ck" --out "$out/mg_single.json"
run device-map "${common[@]}" --gpus 2 --dir "$ck" --ref "$out/mg_single.json" --out "$out/mg_dmap.json"
tp "${common[@]}" --dir "$ck" --ref "$out/mg_single.json" --out "$out/mg_tp.json"
# float32 from the same bf16 weights: tensor parallelism's sums in another order must not flip a beam
f32=(--dtype float32 --prompt 2048 --beams 8 --new-tokens 24)
run single "${f32[@]}" --dir "$ck" --out "$out/mg_single_f32.json"
tp "${f32[@]}" --dir "$ck" --ref "$out/mg_single_f32.json" --out "$out/mg_tp_f32.json"
