#!/usr/bin/env bash
# Prepare the weight quantizers for the offline GPU machine (Python 3.12, torch 2.11.0+cu130, no package index).
# Run it here, in the project's root:
#   bash tools/prepare_quant_wheels.sh
# It writes .device/quant/ (git-ignored: .device/ is in .gitignore):
#   bitsandbytes_slim.tar.gz  bitsandbytes 0.50.2 (its package and dist-info) with only the CUDA 13.0 and CPU
#                             libraries (the wheel bundles one library per CUDA/ROCm version: 43 MB -> ~3 MB; it
#                             picks libbitsandbytes_cuda130.so from torch.version.cuda)
#   torchao-*.whl             torchao 0.18.0 (abi3; its C++ extensions load on torch >= 2.11; pure wheel, 3.4 MB)
#   setup.sh                  puts both on PYTHONPATH
# On the GPU machine, carry ".device" and start the command with:  source .device/quant/setup.sh &&
set -euo pipefail
BNB_VERSION=${BNB_VERSION:-0.50.2}
TORCHAO_VERSION=${TORCHAO_VERSION:-0.18.0}
CUDA_LIB=${CUDA_LIB:-cuda130}        # the GPU machine's torch.version.cuda, as bitsandbytes names its libraries
root=$(git rev-parse --show-toplevel)
cd "$root"
out=.device/quant
rm -rf "$out" && mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$tmp" "bitsandbytes==$BNB_VERSION" "torchao==$TORCHAO_VERSION"
mv "$tmp"/torchao-*.whl "$out/"
python3 - "$tmp" "$out" "$CUDA_LIB" <<'PY'
import os, re, sys, tarfile, zipfile
tmp, out, cuda_lib = sys.argv[1:]
whl = next(f for f in os.listdir(tmp) if f.startswith("bitsandbytes-") and f.endswith(".whl"))
# every native library but the GPU machine's CUDA one and the CPU one (the CPU backend's ops are registered too)
other = re.compile(r"libbitsandbytes_(?!(%s|cpu)\.so$)" % re.escape(cuda_lib))
kept = 0
slim = os.path.join(out, "bitsandbytes_slim.tar.gz")
with zipfile.ZipFile(os.path.join(tmp, whl)) as z, tarfile.open(slim, "w:gz") as t:
    names = z.namelist()
    if f"bitsandbytes/libbitsandbytes_{cuda_lib}.so" not in names:
        sys.exit(f"{whl} has no libbitsandbytes_{cuda_lib}.so; set CUDA_LIB to one of "
                 f"{sorted(n.split('_', 1)[1][:-3] for n in names if 'libbitsandbytes_' in n)}")
    z.extractall(os.path.join(tmp, "x"), [n for n in names if not other.search(n)])
    for n in names:
        if not other.search(n):
            t.add(os.path.join(tmp, "x", n), n)
            kept += 1
print("wrote", slim, f"({kept} files)")
PY
cat > "$out/setup.sh" <<'SH'
# Sourced on the GPU machine: puts bitsandbytes and torchao on PYTHONPATH (unpacked once per machine into
# /tmp/quant-site; no package index is needed).
_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -d /tmp/quant-site/bitsandbytes ] || [ ! -d /tmp/quant-site/torchao ]; then
  mkdir -p /tmp/quant-site && tar xzf "$_here/bitsandbytes_slim.tar.gz" -C /tmp/quant-site &&
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/quant-site \
    "$_here"/torchao-*.whl
fi
export PYTHONPATH=/tmp/quant-site${PYTHONPATH:+:$PYTHONPATH}
SH
du -sh "$out"
ls -la "$out"
