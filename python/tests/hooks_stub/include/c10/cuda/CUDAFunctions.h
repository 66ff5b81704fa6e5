// Test stub of torch's c10/cuda/CUDAFunctions.h: the raw device functions (declarations; the
// tests define them).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

namespace c10::cuda {
cudaError_t GetDevice(DeviceIndex* device);
cudaError_t SetDevice(DeviceIndex device, const bool force = false);
}  // namespace c10::cuda
