// Runtime value -> compile-time constant (flash-attention's static_switch.h, FlashInfer's DISPATCH_* macros).
// Each case runs the body with the constant bound; an unsupported value returns cudaErrorInvalidValue from the
// enclosing function, so the body must `return` (no fall-through). Used by csrc/{prefix,suffix,merge}.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "hfc/params.h"

// dtype code (HFC_BF16, HFC_FP16) -> element type T
#define HFC_DISPATCH_DTYPE(dtype, T, ...)              \
  switch (dtype) {                                     \
    case HFC_BF16: { using T = __nv_bfloat16; __VA_ARGS__ } \
    case HFC_FP16: { using T = __half; __VA_ARGS__ }        \
    default: return cudaErrorInvalidValue;             \
  }

// head_dim -> constexpr int D (64, 128, 256)
#define HFC_DISPATCH_HEAD_DIM(head_dim, D, ...)    \
  switch (head_dim) {                              \
    case 64: { constexpr int D = 64; __VA_ARGS__ }   \
    case 128: { constexpr int D = 128; __VA_ARGS__ } \
    case 256: { constexpr int D = 256; __VA_ARGS__ } \
    default: return cudaErrorInvalidValue;         \
  }

// prefix row tile -> constexpr int M (16, 32; 64 only for head_dim <= 128: registers)
#define HFC_DISPATCH_M_TILE(D, m_tile, M, ...)                               \
  switch (m_tile) {                                                          \
    case 16: { constexpr int M = 16; __VA_ARGS__ }                           \
    case 32: { constexpr int M = 32; __VA_ARGS__ }                           \
    case 64: { if constexpr (D <= 128) { constexpr int M = 64; __VA_ARGS__ } \
               else return cudaErrorInvalidValue; }                          \
    default: return cudaErrorInvalidValue;                                   \
  }
