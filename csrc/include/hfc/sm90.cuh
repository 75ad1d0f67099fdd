// Hopper (sm_90a) building blocks: mbarriers, the async-proxy fence, warpgroup MMA (wgmma) and its shared-memory
// descriptors. Included by csrc/prefix_sm90.cu and csrc/tests/wgmma_layout_check.cu. Everything here compiles
// to real instructions only in an sm_90a pass (HFC_SM90A); other passes see the declarations only, and the kernels
// that use them are compiled as empty bodies there (hfc_prefix_setup reports them unavailable).
#pragma once

#include "hfc/common.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HFC_SM90A 1
#endif

namespace hfc {
namespace sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ------------------------------------------------------------------------------------------ mbarriers
// (PTX ISA, "Parallel Synchronization and Communication Instructions: mbarrier"): a phase completes when `count`
// arrivals have happened; waiters poll the parity of the phase they wait for.
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Arrive on `bar` once this thread's cp.async copies issued so far have landed (the barrier's count includes this
// arrival: .noinc), so the copying thread never waits for its own loads.
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Shared memory written through the generic proxy (ordinary stores, cp.async) and read next by wgmma (the async
// proxy): fenced between the two, by the writing thread before it signals the readers or by the reader after it has
// seen the signal and before its wgmma.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// -------------------------------------------------------------------------------------------- wgmma
// Shared-memory matrix descriptor, 128-byte swizzle (PTX ISA, "Matrix Descriptor Format"): start address, leading
// and stride byte offsets (all >> 4), swizzle mode 1 in bits 62-63. Atoms are 8 rows x 128 bytes, 1024-byte aligned
// (base offset 0); chunk c of row r of an atom sits at c ^ r.
//   K-major operand ([rows][64 elements] per atom column): SBO = 1024 (next 8 rows), LBO unused (1).
//   MN-major operand (rows = k, 64 contiguous MN elements): LBO = the next 64 MN elements, SBO = the next 8 k rows.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// keeps the compiler from moving accesses of wgmma accumulators across the wait (they are written asynchronously)
template <int N>
__device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// D (64 x N, fp32, registers) (+)= A (64 x 16, registers) x B (16 x N, shared memory descriptor); per warpgroup.
// Fragments (PTX ISA, "Register Fragments and Shared Memory Matrix Layouts" for wgmma .m64nNk16), warp w of the
// warpgroup, g = lane >> 2, q4 = lane & 3: A as mma.m16n8k16's A for rows 16w.. (a[0]: row g, k 2q4..+1; a[1]: row
// g+8; a[2]: row g, k 8+2q4..; a[3]: row g+8, k 8+2q4..); D[4j..4j+3]: (row g, cols 8j+2q4, +1), (row g+8, same).
// accumulate 0: D = A B (D's input ignored).
template <typename T> struct Wgmma;
#if defined(HFC_SM90A)
// one specialisation per element type T (PTX type name TY): m64n64k16 for S (+)= Q K^T with B K-major, and
// m64n128k16_tb for O (+)= P V with B MN-major (transposed)
#define HFC_WGMMA_FOR(T, TY) \
template <> struct Wgmma<T> { \
  static __device__ __forceinline__ void m64n64k16(float (&d)[32], const uint32_t (&a)[4], uint64_t desc, int accumulate) { \
    asm volatile( \
        "{\n.reg .pred p;\n" \
        "setp.ne.b32 p, %37, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " \
        "{" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate)); \
  } \
  static __device__ __forceinline__ void m64n128k16_tb(float (&d)[64], const uint32_t (&a)[4], uint64_t desc, int accumulate) { \
    asm volatile( \
        "{\n.reg .pred p;\n" \
        "setp.ne.b32 p, %69, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " \
        "{" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate)); \
  } \
};
HFC_WGMMA_FOR(__nv_bfloat16, "bf16")
HFC_WGMMA_FOR(__half, "f16")
#undef HFC_WGMMA_FOR
#else
template <typename T> struct Wgmma {
  static __device__ __forceinline__ void m64n64k16(float (&)[32], const uint32_t (&)[4], uint64_t, int) {}
  static __device__ __forceinline__ void m64n128k16_tb(float (&)[64], const uint32_t (&)[4], uint64_t, int) {}
};
#endif

}  // namespace sm90
}  // namespace hfc
