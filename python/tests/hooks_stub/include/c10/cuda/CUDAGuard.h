// Test stub of torch's c10/cuda/CUDAGuard.h: CUDAGuard sets the current device for its scope
// and restores the previous one, through c10::cuda::GetDevice/SetDevice.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDAFunctions.h>

namespace c10::cuda {

struct CUDAGuard {
  explicit CUDAGuard() = delete;
  explicit CUDAGuard(DeviceIndex device_index) {
    C10_CUDA_CHECK(GetDevice(&original_device_));
    C10_CUDA_CHECK(SetDevice(device_index));
  }
  CUDAGuard(const CUDAGuard&) = delete;
  CUDAGuard& operator=(const CUDAGuard&) = delete;
  CUDAGuard(CUDAGuard&& other) = delete;
  CUDAGuard& operator=(CUDAGuard&& other) = delete;
  ~CUDAGuard() { (void)SetDevice(original_device_); }

 private:
  DeviceIndex original_device_ = 0;
};

}  // namespace c10::cuda
