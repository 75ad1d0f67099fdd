// GPU check of the wgmma layouts csrc/prefix_sm90.cu relies on (sm_90a only): one warpgroup computes
// S = Q K^T (A = Q fragments in registers, B = K in the swizzled shared layout, K-major) and O = P V (A = P
// re-packed from S's accumulators, B = V, MN-major) exactly as the kernel does, against a host product.
// Also tries V's descriptor with LBO and SBO swapped, to show which reading of the two fields the GPU has.
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Icsrc/include -o /tmp/wgmma_check \
//        csrc/tests/wgmma_layout_check.cu && /tmp/wgmma_check        (exit 0: the kernel's layouts hold)

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "hfc/sm90.cuh"

using namespace hfc;
using T = __nv_bfloat16;
constexpr int M = 64, N = 64, D = 128, HALF = N * 128;

// q [M][D], k and v [N][D] (bf16), s [M][N] and o [M][D] (fp32); p = bf16(s) is the A operand of P V
__global__ void check_kernel(const T* q, const T* k, const T* v, float* s_out, float* o_out, int v_lbo, int v_sbo) {
#if defined(HFC_SM90A)
  using namespace sm90;
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t raw = smem_addr(smem), base = (raw + 1023u) & ~1023u;
  unsigned char* kv = smem + (base - raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // K then V, each [2 halves][N tokens][128 bytes], chunk c of token n at (c & 7) ^ (n & 7): csrc/prefix_sm90.cu
  for (int i = tid; i < N * 16; i += 128) {
    const int n = i / 16, c = i % 16, off = (c >> 3) * HALF + n * 128 + (((c & 7) ^ (n & 7)) << 4);
    *reinterpret_cast<uint4*>(kv + off) = *reinterpret_cast<const uint4*>(k + n * D + c * 8);
    *reinterpret_cast<uint4*>(kv + 2 * HALF + off) = *reinterpret_cast<const uint4*>(v + n * D + c * 8);
  }
  fence_proxy_async();
  __syncthreads();
  const int gq = lane >> 2, q4 = lane & 3, r0 = warp * 16 + gq;
  uint32_t qa[D / 16][4];
  for (int kk = 0; kk < D / 16; ++kk)
    for (int e = 0; e < 4; ++e)
      qa[kk][e] = *reinterpret_cast<const uint32_t*>(q + (r0 + 8 * (e & 1)) * D + kk * 16 + (e >> 1) * 8 + 2 * q4);
  float sacc[N / 2];
  for (int i = 0; i < N / 2; ++i) sacc[i] = 0.0f;
  wg_fence();
  for (int kk = 0; kk < D / 16; ++kk)
    Wgmma<T>::m64n64k16(sacc, qa[kk], sw128_desc(base + (kk >> 2) * HALF + (kk & 3) * 32, 16, 1024), kk > 0);
  wg_commit();
  wg_wait<0>();
  reg_fence(sacc);
  uint32_t pf[N / 16][4];
  for (int nt = 0; nt < N / 8; ++nt) {
    for (int e = 0; e < 4; ++e) s_out[(r0 + 8 * (e >> 1)) * N + nt * 8 + 2 * q4 + (e & 1)] = sacc[nt * 4 + e];
    pf[nt >> 1][(nt & 1) * 2 + 0] = Cvt<T>::pack2(sacc[nt * 4 + 0], sacc[nt * 4 + 1]);
    pf[nt >> 1][(nt & 1) * 2 + 1] = Cvt<T>::pack2(sacc[nt * 4 + 2], sacc[nt * 4 + 3]);
  }
  float o[D / 2];
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  wg_fence();
  for (int kt = 0; kt < N / 16; ++kt)
    Wgmma<T>::m64n128k16_tb(o, pf[kt], sw128_desc(base + 2 * HALF + kt * 16 * 128, v_lbo, v_sbo), 1);
  wg_commit();
  wg_wait<0>();
  reg_fence(o);
  for (int dn = 0; dn < D / 8; ++dn)
    for (int e = 0; e < 4; ++e) o_out[(r0 + 8 * (e >> 1)) * D + dn * 8 + 2 * q4 + (e & 1)] = o[dn * 4 + e];
#endif
}

static float bf(float x) { return __bfloat162float(__float2bfloat16(x)); }

int main() {
  std::vector<T> q(M * D), k(N * D), v(N * D);
  std::vector<float> qf(M * D), kf(N * D), vf(N * D);
  srand(7);
  auto fill = [](std::vector<T>& h, std::vector<float>& f, float scale) {
    for (size_t i = 0; i < h.size(); ++i) {
      f[i] = bf(scale * ((rand() % 2001) / 1000.0f - 1.0f));
      h[i] = __float2bfloat16(f[i]);
    }
  };
  fill(q, qf, 0.25f);
  fill(k, kf, 0.25f);
  fill(v, vf, 1.0f);
  std::vector<float> s_ref(M * N), o_ref(M * D, 0.0f);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double acc = 0;
      for (int d = 0; d < D; ++d) acc += (double)qf[m * D + d] * kf[n * D + d];
      s_ref[m * N + n] = (float)acc;
    }
  T *dq, *dk, *dv;
  float *ds, *dout;
  cudaMalloc(&dq, M * D * 2);
  cudaMalloc(&dk, N * D * 2);
  cudaMalloc(&dv, N * D * 2);
  cudaMalloc(&ds, M * N * 4);
  cudaMalloc(&dout, M * D * 4);
  cudaMemcpy(dq, q.data(), M * D * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dk, k.data(), N * D * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dv, v.data(), N * D * 2, cudaMemcpyHostToDevice);
  const int smem = 1024 + 4 * HALF;
  cudaFuncSetAttribute(check_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  int failures = 0;
  const int configs[2][2] = {{HALF, 1024}, {1024, HALF}};  // the kernel's (LBO, SBO) for V, then swapped
  for (int cfg = 0; cfg < 2; ++cfg) {
    cudaMemset(ds, 0, M * N * 4);
    cudaMemset(dout, 0, M * D * 4);
    check_kernel<<<1, 128, smem>>>(dq, dk, dv, ds, dout, configs[cfg][0], configs[cfg][1]);
    cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      printf("config %d: %s\n", cfg, cudaGetErrorString(err));
      return 2;
    }
    std::vector<float> s(M * N), o(M * D);
    cudaMemcpy(s.data(), ds, M * N * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(o.data(), dout, M * D * 4, cudaMemcpyDeviceToHost);
    // O's reference from the GPU's own S, rounded to bf16 as the kernel packs it
    std::fill(o_ref.begin(), o_ref.end(), 0.0f);
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n)
        for (int d = 0; d < D; ++d) o_ref[m * D + d] += bf(s[m * N + n]) * vf[n * D + d];
    double s_err = 0, o_err = 0, o_mag = 0;
    for (int i = 0; i < M * N; ++i) s_err = fmax(s_err, fabs(s[i] - s_ref[i]));
    for (int i = 0; i < M * D; ++i) o_err = fmax(o_err, fabs(o[i] - o_ref[i])), o_mag = fmax(o_mag, fabs(o_ref[i]));
    const bool s_ok = s_err < 1e-3, o_ok = o_err < 1e-3 * fmax(1.0, o_mag);
    printf("V descriptor LBO=%d SBO=%d: S max abs err %.3g (%s), O max abs err %.3g of %.3g (%s)\n", configs[cfg][0],
           configs[cfg][1], s_err, s_ok ? "ok" : "WRONG", o_err, o_mag, o_ok ? "ok" : "WRONG");
    if (cfg == 0 && !(s_ok && o_ok)) ++failures;
  }
  printf(failures ? "FAILED: csrc/prefix_sm90.cu's layouts do not hold\n" : "OK: csrc/prefix_sm90.cu's layouts hold\n");
  return failures ? 1 : 0;
}
