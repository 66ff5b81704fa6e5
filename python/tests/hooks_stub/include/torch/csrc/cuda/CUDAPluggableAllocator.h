// Test stub of torch's CUDAPluggableAllocator: the setters allocd_torch/_hooks.cpp calls, with
// the std::function signatures of torch/csrc/cuda/CUDAPluggableAllocator.h.
#pragma once
#include <c10/cuda/CUDACachingAllocator.h>
#include <functional>
#include <memory>
namespace torch::cuda::CUDAPluggableAllocator {
std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> getCurrentAllocator();
struct CUDAPluggableAllocator : public c10::cuda::CUDACachingAllocator::CUDAAllocator {
  bool initialized() override { return true; }
  std::string name() override { return "pluggable"; }
  void set_reset_fn(std::function<void()> f) { reset_fn_ = std::move(f); }
  void set_memory_fraction_fn(std::function<void(double, int)> f) { memory_fraction_fn_ = std::move(f); }
  void set_record_stream_fn(std::function<void(void* ptr, cudaStream_t stream)> f) {
    record_stream_fn_ = std::move(f);
  }
  std::function<void()> reset_fn_;
  std::function<void(double, int)> memory_fraction_fn_;
  std::function<void(void* ptr, cudaStream_t stream)> record_stream_fn_;
};
}  // namespace torch::cuda::CUDAPluggableAllocator
