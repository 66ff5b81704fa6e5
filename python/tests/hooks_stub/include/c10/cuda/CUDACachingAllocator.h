// Test stub: the part of torch's CUDAAllocator interface allocd_torch/_hooks.cpp uses.
#pragma once
#include <cuda_runtime_api.h>
#include <atomic>
#include <string>
namespace c10::cuda::CUDACachingAllocator {
class CUDAAllocator {
 public:
  virtual ~CUDAAllocator() = default;
  virtual bool initialized() = 0;
  virtual std::string name() = 0;
};
extern std::atomic<CUDAAllocator*> allocator;
inline CUDAAllocator* get() { return allocator.load(); }
}  // namespace c10::cuda::CUDACachingAllocator
