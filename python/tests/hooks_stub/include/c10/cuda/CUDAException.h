// Test stub of torch's c10/cuda/CUDAException.h: c10::CUDAError and C10_CUDA_CHECK, which
// throws it with the CUDA error's string (torch's also adds the file and line).
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

namespace c10 {
class CUDAError : public c10::Error {
  using Error::Error;
};
}  // namespace c10

#define C10_CUDA_CHECK(EXPR)                                                           \
  do {                                                                                 \
    const cudaError_t __err = EXPR;                                                    \
    if (__err != cudaSuccess) {                                                        \
      throw ::c10::CUDAError(::c10::str("CUDA error: ", cudaGetErrorString(__err)));  \
    }                                                                                  \
  } while (0)
