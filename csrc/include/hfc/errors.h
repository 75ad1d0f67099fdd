// Why a call of the C ABI failed, in words: a launcher that refuses its arguments (a head_dim / dtype / row tile /
// tuning variant with no instantiation, ...) records a message naming the value and what is available, and returns
// the cudaError_t code as before; hfc_last_error (csrc/api.cu) hands the calling thread's last message to Python.
#pragma once

#include <cuda_runtime.h>

namespace hfc {

void clear_error();                                   // at the start of every C ABI call
const char* last_error();                             // this thread's last message ("" if none)
// records the printf-style message for this thread and returns err (cudaErrorInvalidValue for bad arguments)
cudaError_t fail(cudaError_t err, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

}  // namespace hfc
