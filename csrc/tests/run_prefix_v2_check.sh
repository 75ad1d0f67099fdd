#!/usr/bin/env bash
# Build csrc/tests/prefix_v2_check.cu with the kernel library's sources (csrc/*.cu) for the present GPU and run it:
# the prefix kernel against a float32 CPU reference, then its timings. Needs a CUDA GPU and nvcc.
# Usage: csrc/tests/run_prefix_v2_check.sh [--no-timing] [--iters N]    ($ARCH overrides, e.g. ARCH=sm_90)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
csrc="$(dirname "$here")"
nvcc_bin="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
arch="${ARCH:-}"
if [[ -z "$arch" ]]; then
  cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')"
  arch="sm_${cap:-90}"
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
echo "building for $arch with $nvcc_bin"
"$nvcc_bin" -O3 --use_fast_math -std=c++17 -lineinfo -arch="$arch" -I"$csrc/include" -o "$out/prefix_v2_check" \
  "$here/prefix_v2_check.cu" "$csrc"/*.cu
"$out/prefix_v2_check" "$@"
