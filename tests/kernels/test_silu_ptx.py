"""The MLP activation kernel's element function (csrc/elementwise.cu ``silu_mul_element``) computes what PyTorch's
eager ``F.silu(g) * u`` computes, op for op, without a GPU: the kernel's PTX, compiled with the library's own flags
(``--use_fast_math``), against the PTX of the plain expression ``T(float(T(x / (1 + expf(-x)))) * float(u))``
compiled as PyTorch compiles its CUDA kernels (no fast math). Each side's stored value is evaluated symbolically
(registers replaced by the expressions that define them, the two loads as leaves), and the trees must be equal: the
same expf (libdevice's range reduction and ex2.approx), an IEEE division, non-flushing products and round-to-nearest
conversions. Fast math would make expf one product and ex2.approx, the division div.approx and every op flush
subnormals: a tree this test tells apart (it checks that too). The kernel's values on the GPU:
tests/decode/test_gpu_fused_ops.py.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from hf_cascade.kernels import _build

NVCC = _build.find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc (compiles to PTX only)")

CSRC = Path(__file__).resolve().parents[2] / "csrc"
TYPES = {"bf16": ("__nv_bfloat16", "13__nv_bfloat16", "__float2bfloat16_rn", "__bfloat162float"),
         "fp16": ("__half", "6__half", "__float2half_rn", "__half2float")}

# eager mode's ops as PyTorch's CUDA kernels compute them (silu: x / (1 + exp(-x)) in float, rounded to T; mul: the
# product of two T values in float, rounded to T)
PLAIN = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
__global__ void plain(%(T)s* out, const %(T)s* gate, const %(T)s* up) {
  const float x = %(to_float)s(gate[threadIdx.x]);
  const %(T)s act = %(from_float)s(x / (1.0f + expf(-x)));
  out[threadIdx.x] = %(from_float)s(%(to_float)s(act) * %(to_float)s(up[threadIdx.x]));
}
"""


def _ptx(source: Path, out: Path, *flags: str) -> str:
    subprocess.run([NVCC, "-std=c++17", "-O3", *flags, f"-I{CSRC / 'include'}", "-arch=sm_90", "-ptx", str(source),
                    "-o", str(out)], check=True, capture_output=True, text=True, timeout=300)
    return out.read_text()


_ENTRY = re.compile(r"(\.visible\s+)?\.(entry|func)\s")


def _entry(ptx: str, name: str) -> list[str]:
    """The instructions of the kernel whose mangled name contains ``name`` (inline asm's braces dropped)."""
    start = next(i for i, line in enumerate(ptx.splitlines()) if _ENTRY.match(line) and name in line)
    body = []
    for line in ptx.splitlines()[start:]:
        line = line.split("//")[0].strip().strip("{}").strip()
        if body and _ENTRY.match(line):
            break
        if line and not line.startswith((".", "$", "@", "ret", "bra")):
            body.append(line.rstrip(";").strip())
    return body


def _opcode(op: str) -> str:
    # (add/sub/mul without a rounding mode round to nearest: the same op as .rn)
    return re.sub(r"^(add|sub|mul)\.(f32)$", r"\1.rn.\2", op)


def _stored(body: list[str]):
    """The expression of the value the kernel stores: each register the expression of its definition, each load a
    leaf numbered in program order, immediates as written; ``mov`` is the identity (a register copy or a bitcast)."""
    env, loads = {}, 0
    for line in body:
        op, _, rest = line.partition(" ")
        args = [a.strip().strip("{}").strip() for a in rest.split(",")] if rest else []    # ({%rs5}: a 1-vector)
        if op.startswith("ld.global"):
            env[args[0]] = f"load{loads}"
            loads += 1
        elif op.startswith("st.global"):
            return env.get(args[1], args[1])
        elif op.startswith("mov"):
            env[args[0]] = env.get(args[1], args[1])
        elif args:
            env[args[0]] = (_opcode(op), *(env.get(a, a) for a in args[1:]))
    raise AssertionError("no store")


def _ops(tree) -> set:
    return set() if not isinstance(tree, tuple) else {tree[0]}.union(*map(_ops, tree[1:]))


@pytest.fixture(scope="module")
def kernel_ptx(tmp_path_factory):
    # the library's own flags (hf_cascade/kernels/_build.py: fast math) for the file as it is
    assert "--use_fast_math" in _build.NVCC_FLAGS
    return _ptx(CSRC / "elementwise.cu", tmp_path_factory.mktemp("ptx") / "elementwise.ptx", "--use_fast_math")


@pytest.mark.parametrize("dtype", list(TYPES))
def test_the_kernel_s_element_is_eager_silu_times_up_op_for_op(dtype, kernel_ptx, tmp_path):
    T, mangled, from_float, to_float = TYPES[dtype]
    source = tmp_path / "plain.cu"
    source.write_text(PLAIN % dict(T=T, from_float=from_float, to_float=to_float))
    plain = _stored(_entry(_ptx(source, tmp_path / "plain.ptx"), "plain"))
    kernel = _stored(_entry(kernel_ptx, f"15silu_mul_kernelI{mangled}Li1E"))      # (the element-wise instance)
    assert kernel == plain
    # what fast math would have changed is not there: libdevice's expf, an IEEE division, no flushing
    ops = _ops(kernel)
    assert {"ex2.approx.ftz.f32", "div.rn.f32", "mul.rn.f32", "fma.rm.f32"} <= ops, ops
    assert not any(".ftz" in op for op in ops - {"ex2.approx.ftz.f32"}) and "div.approx.f32" not in ops


@pytest.mark.parametrize("dtype", list(TYPES))
def test_the_vector_kernel_computes_each_element_so(dtype, kernel_ptx):
    """The 16-byte kernel's eight elements: each the same eager-silu division and rounded product."""
    body = "\n".join(_entry(kernel_ptx, f"15silu_mul_kernelI{TYPES[dtype][1]}Li8E"))
    assert body.count("div.rn.f32") == 8 and body.count("mul.rn.f32") == 8 and body.count("ex2.approx.ftz.f32") == 8
    assert "div.approx" not in body and "mul.rn.ftz" not in body


def test_fast_math_would_change_the_expression(tmp_path):
    """The comparison can fail: the plain expression compiled with fast math is another tree."""
    T, _, from_float, to_float = TYPES["bf16"]
    source = tmp_path / "plain.cu"
    source.write_text(PLAIN % dict(T=T, from_float=from_float, to_float=to_float))
    exact = _stored(_entry(_ptx(source, tmp_path / "exact.ptx"), "plain"))
    fast = _stored(_entry(_ptx(source, tmp_path / "fast.ptx", "--use_fast_math"), "plain"))
    assert fast != exact
