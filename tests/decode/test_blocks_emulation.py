"""The block bookkeeping kernel's source (csrc/blocks.cu) run on the CPU (no GPU needed).

The kernel's own code (its anonymous namespace: the CTA scan, the suffix tables, the kernel) and csrc/include/hfc/
launch.h's argument struct, compiled with the system C++ compiler over a shim of the CUDA built-ins it uses: one CTA
of 1024 std::threads, a std::barrier for ``__syncthreads`` (and ``__syncthreads_or`` / ``__syncthreads_count``),
one per warp for ``__shfl_up_sync`` and ``__reduce_add_sync``, std::atomic_ref for ``atomicAdd`` / ``atomicSub``,
function-static arrays for ``__shared__``. Called through the real ctypes binding (cuda_binding._Lib.blocks_advance)
with CPU tensors, it must equal the torch ops of hf_cascade/decode/whole_step.py ``advance`` bit for bit, step after
step, on the cases of tests/decode/test_gpu_device_blocks.py. This checks the kernel's logic and indexing, not the
GPU's memory model or the compiler's code for it (the barriers order more than a GPU's do);
tests/decode/test_gpu_device_blocks.py runs the kernel on the GPU.
"""
from __future__ import annotations

import ctypes
import re
import shutil
from pathlib import Path

import pytest

from hf_cascade.kernels import cuda_binding

from conftest import CTA_SHIM, host_library
from test_gpu_device_blocks import CASES, _drive

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++20 compiler (g++)")

CSRC = Path(__file__).resolve().parents[2] / "csrc"

SHIM = r"""
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

using std::max;
using std::min;
struct EmuDim { int x; };
static thread_local EmuDim threadIdx;
static std::barrier<>* emu_cta;
static std::barrier<>* emu_warp[32];
static int emu_lanes[32][32];
static std::atomic<int> emu_count;

"""
SHIM += CTA_SHIM + r"""
inline int __shfl_up_sync(unsigned, int x, int off) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  emu_lanes[w][l] = x;
  emu_warp[w]->arrive_and_wait();
  const int y = l >= off ? emu_lanes[w][l - off] : x;
  emu_warp[w]->arrive_and_wait();
  return y;
}
inline int __reduce_add_sync(unsigned, int x) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  emu_lanes[w][l] = x;
  emu_warp[w]->arrive_and_wait();
  int s = 0;
  for (int i = 0; i < 32; ++i) s += emu_lanes[w][i];
  emu_warp[w]->arrive_and_wait();
  return s;
}
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline int atomicSub(int* p, int v) { return std::atomic_ref<int>(*p).fetch_sub(v); }
"""


def _source() -> str:
    """The shim, launch.h's BlocksAdvanceArgs, blocks.cu's kernel, and hfc_blocks_advance (api.h's signature) running
    the kernel on one CTA of threads."""
    cu = (CSRC / "blocks.cu").read_text(encoding="utf-8")
    kernel = cu[cu.index("namespace {"):cu.index("}  // namespace") + len("}  // namespace")]
    header = (CSRC / "include" / "hfc" / "launch.h").read_text(encoding="utf-8")
    struct = header[header.index("struct BlocksAdvanceArgs {"):]
    struct = struct[:struct.index("};") + 2]
    api = (CSRC / "include" / "hfc" / "api.h").read_text(encoding="utf-8")
    signature = api[api.index("HFC_API int hfc_blocks_advance("):]
    signature = signature[len("HFC_API "):signature.index(";")]
    fields = ", ".join(n for n in re.findall(r"(\w+)(?=,|\))", signature) if n != "stream")
    runner = f"""
extern "C" {signature} {{
  (void)stream;
  const hfc::BlocksAdvanceArgs a{{{fields}}};
  std::barrier<> cta(hfc::kBlocksThreads);
  emu_cta = &cta;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  for (int w = 0; w < 32; ++w) warps.emplace_back(new std::barrier<>(32)), emu_warp[w] = warps.back().get();
  std::vector<std::thread> threads;
  for (int t = 0; t < hfc::kBlocksThreads; ++t)
    threads.emplace_back([&a, t] {{ threadIdx.x = t; hfc::blocks_advance_kernel(a); }});
  for (auto& t : threads) t.join();
  return 0;
}}
"""
    return f"{SHIM}\nnamespace hfc {{\n{struct}\n{kernel}\n}}  // namespace hfc\n{runner}"


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """``advance(blocks, plan, parents, done, peak)`` on the emulated kernel, through the binding's own call."""
    lib = host_library(tmp_path_factory.mktemp("blocks"), "blocks", _source(),
                       ["-std=c++20", "-pthread", "-Wno-unknown-pragmas"])
    lib.hfc_blocks_advance.restype = ctypes.c_int
    lib.hfc_blocks_advance.argtypes = [ctypes.c_void_p] * 23 + [ctypes.c_int64] * 7 + [ctypes.c_size_t]
    binding = object.__new__(cuda_binding._Lib)          # (the binding's method and check, on this library)
    binding.lib = lib
    return lambda blocks, plan, parents, done, peak: binding.blocks_advance(blocks, plan, parents, done, peak, 0)


# ~0.3 s a step (1024 threads on the CPU): five cases, each through its flag or 8 steps (the whole sweep of
# test_gpu_device_blocks, 12 cases x 2 seeds x 50 steps, passed so too: ~6 minutes)
QUICK = {"bs16-mid": 0, "bs1-big-pool": 0, "bs1-pool-exhausted": 0, "bs16-left-levels": 1, "bs16-outgrown": 0}


@pytest.mark.parametrize("case", list(QUICK))
def test_the_kernel_source_equals_the_torch_ops(emulated, case):
    flags, steps, _ = _drive(case, emulated, "cpu", QUICK[case], steps=8 if CASES[case][-1] == 0 else 50)
    assert flags == CASES[case][-1] and steps >= 2, case
