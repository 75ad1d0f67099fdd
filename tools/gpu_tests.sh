#!/usr/bin/env bash
# The GPU test suite (`pytest -m gpu`) in five processes sharing one GPU, within one device call's ten minutes.
# FlashInfer's tests need `source .device/setup.sh` and the quantized ones `.device/quant/setup.sh` (the two together
# made the FlashInfer tests skip), so each group sources what it needs where present. Logs: $OUT/p1..p5.log (or
# ./gpu-tests/ without $OUT), then each group's summary lines.
# Usage (device machine, repository root): bash tools/gpu_tests.sh [timeout seconds per group, default 540]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
out="${OUT:-gpu-tests}"
limit="${1:-540}"
mkdir -p "$out"
group() {   # name, setup script (or ""), test files...
  local name=$1 setup=$2; shift 2
  ( { [[ -n "$setup" && -f "$setup" ]] && source "$setup" >/dev/null; }
    timeout "$limit" python -m pytest -q -m gpu -p no:cacheprovider "$@" > "$out/$name.log" 2>&1
    echo "rc=$?" >> "$out/$name.log" ) &
}
group p1 "" tests/seq2seq/test_gpu_encoder_decoder.py tests/decode/test_gpu_graphs.py \
  tests/decode/test_host_select.py tests/test_edges.py tests/test_gpu_generate.py tests/decode/test_gpu_threads.py
group p5 "" tests/decode/test_gpu_whole_step.py
group p2 "" tests/decode/test_compile.py tests/seq2seq/test_seq2seq_graphs.py tests/seq2seq/test_t5_graphs.py tests/seq2seq/test_seq2seq_keep.py \
  tests/seq2seq/test_whole_step_t5.py tests/seq2seq/test_whole_step_seq2seq.py tests/decode/test_gpu_fused_ops.py
group p3 .device/setup.sh tests/kernels/test_gpu_flashinfer.py tests/test_gpu_variants.py tests/kv/test_cache_lifetime.py \
  tests/test_multi_device.py tests/decode/test_fused_linears.py tests/kernels/test_gpu_sinks.py tests/kv/test_gpu_memory.py
group p4 .device/quant/setup.sh tests/kv/test_gpu_fp8.py tests/test_gpu_quantized.py tests/kernels/test_gpu_kernels.py \
  tests/kernels/test_kernel_ops.py tests/decode/test_gpu_device_blocks.py
wait
for f in "$out"/p*.log; do echo "== $f"; grep -E "passed|failed|error|^FAILED|^ERROR|rc=" "$f" | tail -25; done
