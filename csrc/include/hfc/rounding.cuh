// Float arithmetic as PyTorch's CUDA ops do it, whatever this library's flags: the library is built with
// --use_fast_math (hf_cascade/kernels/_build.py), whose -ftz flushes subnormal operands and results to zero and whose
// -fmad contracts a product into a following sum; round-to-nearest PTX keeps both out. Included by csrc/elementwise.cu
// and csrc/select.cu; the host forms (no __CUDA_ARCH__) are the same IEEE operations, for the CPU emulation tests
// (tests/decode/test_select_emulation.py).
#pragma once

namespace hfc {

// a + b rounded to nearest, subnormals kept
__device__ __forceinline__ float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
#else
  return a + b;
#endif
}

// a * b rounded to nearest, subnormals kept (e.g. a bf16 product below 2^-126)
__device__ __forceinline__ float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
#else
  return a * b;
#endif
}

// a > b (false where either is NaN), subnormals compared as they are
__device__ __forceinline__ bool greater(float a, float b) {
#if defined(__CUDA_ARCH__)
  unsigned r;
  asm("{\n\t.reg .pred gt_p;\n\tsetp.gt.f32 gt_p, %1, %2;\n\tselp.u32 %0, 1, 0, gt_p;\n\t}" : "=r"(r) : "f"(a), "f"(b));
  return r != 0;
#else
  return a > b;
#endif
}

}  // namespace hfc
