// The C ABI of the kernel library (declared in csrc/include/hfc/api.h): thin wrappers over the component
// launchers of csrc/prefix.cu, csrc/suffix.cu and csrc/merge.cu, so that Python loads one shared library
// with ctypes (hf_cascade/kernels/cuda.py). Build: see hf_cascade/kernels/_build.py (sources, nvcc flags).

#include "hfc/api.h"
#include "hfc/launch.h"

#include <cuda_runtime.h>

extern "C" {

HFC_API int hfc_abi_version(void) { return HFC_ABI_VERSION; }

HFC_API const char* hfc_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

HFC_API int hfc_sync(void) { return (int)cudaDeviceSynchronize(); }

HFC_API int hfc_prefix_setup(int32_t dtype, int32_t head_dim, int32_t m_tile, int32_t tune, hfc_prefix_info* info) {
  return (int)hfc::prefix_setup(dtype, head_dim, m_tile, tune, info);
}

HFC_API int hfc_prefix(const hfc_prefix_params* params, uintptr_t stream) {
  if (params == nullptr) return (int)cudaErrorInvalidValue;
  return (int)hfc::prefix_launch(*params, reinterpret_cast<cudaStream_t>(stream));
}

HFC_API int hfc_suffix(const hfc_suffix_params* params, uintptr_t stream) {
  if (params == nullptr) return (int)cudaErrorInvalidValue;
  return (int)hfc::suffix_launch(*params, reinterpret_cast<cudaStream_t>(stream));
}

HFC_API int hfc_merge(const hfc_merge_params* params, uintptr_t stream) {
  if (params == nullptr) return (int)cudaErrorInvalidValue;
  return (int)hfc::merge_launch(*params, reinterpret_cast<cudaStream_t>(stream));
}

}  // extern "C"
