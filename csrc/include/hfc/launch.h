// Host launchers of the three components, one per .cu file (csrc/prefix.cu, csrc/suffix.cu, csrc/merge.cu),
// called by the C ABI in csrc/api.cu. Each checks its params, dispatches on dtype / head_dim (/ m_tile) and
// launches on `stream`; cudaSuccess without a launch when there is nothing to do.
#pragma once

#include <cuda_runtime.h>

#include "hfc/params.h"

namespace hfc {

cudaError_t prefix_setup(int dtype, int head_dim, int m_tile, int tune, hfc_prefix_info* info);  // not capture safe
cudaError_t prefix_launch(const hfc_prefix_params& p, cudaStream_t stream);
cudaError_t suffix_launch(const hfc_suffix_params& p, cudaStream_t stream);
cudaError_t merge_launch(const hfc_merge_params& p, cudaStream_t stream);

}  // namespace hfc
