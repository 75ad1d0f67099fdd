#!/usr/bin/env bash
# Compile-only check of the bundled CUDA kernels (no GPU needed): every csrc/*.cu as sm_80, sm_90 and sm_90a object code
# with warnings as errors, then the standalone prefix-kernel harness (csrc/tests/prefix_v2_check.cu).
# Usage: csrc/check_compile.sh [extra nvcc flags, e.g. -Xptxas -v]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
nvcc_bin="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$nvcc_bin" ]]; then
  for c in "${CUDA_HOME:-}/bin/nvcc" /usr/local/cuda/bin/nvcc; do [[ -x "$c" ]] && nvcc_bin="$c" && break; done
fi
if [[ -z "$nvcc_bin" ]]; then echo "check_compile: nvcc not found" >&2; exit 1; fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
echo "check_compile: $("$nvcc_bin" --version | tail -n 2 | head -n 1)"
for src in "$here"/*.cu; do
  name="$(basename "$src" .cu)"
  cmd=("$nvcc_bin" -std=c++17 -O3 --use_fast_math -Xcompiler -fPIC -I"$here/include"
       -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90a,code=sm_90a
       -Werror all-warnings -c "$src" -o "$out/$name.o" "$@")
  echo "check_compile: ${cmd[*]}"
  "${cmd[@]}"
  echo "check_compile: OK ($(stat -c %s "$out/$name.o") bytes of object code for sm_80 + sm_90 + sm_90a)"
done
# the standalone prefix-kernel harness must keep compiling (and linking against the library's sources) too
test_cmd=("$nvcc_bin" -std=c++17 -O3 --use_fast_math -arch=sm_90 -Werror all-warnings -I"$here/include"
          -o "$out/prefix_v2_check" "$here/tests/prefix_v2_check.cu" "$here"/*.cu)
echo "check_compile: ${test_cmd[*]}"
"${test_cmd[@]}"
echo "check_compile: OK (tests/prefix_v2_check.cu)"
