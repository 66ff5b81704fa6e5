// Test stub of torch's c10/cuda/CUDAStream.h: CUDAStream wraps a c10::Stream; stream() and
// getCurrentCUDAStream are declared here and defined by the tests (torch's live in c10_cuda).
#pragma once

#include <c10/core/Stream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

namespace c10::cuda {

class CUDAStream {
 public:
  enum Unchecked { UNCHECKED };

  explicit CUDAStream(Stream stream) : stream_(stream) { TORCH_CHECK(stream_.device_type() == DeviceType::CUDA); }
  explicit CUDAStream(Unchecked /*unused*/, Stream stream) : stream_(stream) {}

  operator cudaStream_t() const { return stream(); }
  operator Stream() const { return unwrap(); }
  DeviceIndex device_index() const { return stream_.device_index(); }
  StreamId id() const { return stream_.id(); }
  cudaStream_t stream() const;
  Stream unwrap() const { return stream_; }

 private:
  Stream stream_;
};

CUDAStream getCurrentCUDAStream(DeviceIndex device_index = -1);

}  // namespace c10::cuda
