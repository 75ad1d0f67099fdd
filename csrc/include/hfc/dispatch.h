// Runtime value -> compile-time constant (flash-attention's static_switch.h, FlashInfer's DISPATCH_* macros).
// Each case runs the body with the constant bound; an unsupported value returns cudaErrorInvalidValue from the
// enclosing function with a message naming the value and the compiled ones (hfc_last_error), so the body must
// `return` (no fall-through). Used by csrc/{prefix,suffix,merge}.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "hfc/errors.h"
#include "hfc/params.h"

// dtype code (HFC_BF16, HFC_FP16) -> element type T
#define HFC_DISPATCH_DTYPE(dtype, T, ...)                                                             \
  switch (dtype) {                                                                                    \
    case HFC_BF16: { using T = __nv_bfloat16; __VA_ARGS__ }                                           \
    case HFC_FP16: { using T = __half; __VA_ARGS__ }                                                  \
    default: return ::hfc::fail(cudaErrorInvalidValue, "dtype code %d has no instantiation "          \
                                "(compiled: %d bfloat16, %d float16)", (int)(dtype), HFC_BF16, HFC_FP16); \
  }

// head_dim -> constexpr int D (64, 128, 256)
#define HFC_DISPATCH_HEAD_DIM(head_dim, D, ...)                                                        \
  switch (head_dim) {                                                                                  \
    case 64: { constexpr int D = 64; __VA_ARGS__ }                                                     \
    case 128: { constexpr int D = 128; __VA_ARGS__ }                                                   \
    case 256: { constexpr int D = 256; __VA_ARGS__ }                                                   \
    default: return ::hfc::fail(cudaErrorInvalidValue, "head_dim %d has no instantiation "             \
                                "(compiled: 64, 128, 256)", (int)(head_dim));                          \
  }

// prefix row tile -> constexpr int M (16, 32; 64 only for head_dim <= 128: registers)
#define HFC_DISPATCH_M_TILE(D, m_tile, M, ...)                                                         \
  switch (m_tile) {                                                                                    \
    case 16: { constexpr int M = 16; __VA_ARGS__ }                                                     \
    case 32: { constexpr int M = 32; __VA_ARGS__ }                                                     \
    case 64: { if constexpr (D <= 128) { constexpr int M = 64; __VA_ARGS__ }                           \
               else return ::hfc::fail(cudaErrorInvalidValue, "prefix m_tile 64 has no instantiation "  \
                                       "at head_dim %d (compiled there: 16, 32)", D); }                \
    default: return ::hfc::fail(cudaErrorInvalidValue, "prefix m_tile %d has no instantiation "        \
                                "(compiled: 16, 32, and 64 for head_dim <= 128)", (int)(m_tile));      \
  }
