// Test stub of torch's c10/cuda/CUDACachingAllocator.h: the CUDAAllocator interface with every
// pure virtual of torch 2.11's (same signatures, so that a missing or mistyped override fails
// here as it would against torch), the non-pure ones allocd_torch/_allocator.cpp overrides (with
// torch's refusing bodies), the
// types they use, and the current-allocator global.
#pragma once

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace c10::cuda::CUDACachingAllocator {

using c10::CachingDeviceAllocator::AllocatorTraceTracker;
using c10::CachingDeviceAllocator::BlockInfo;
using c10::CachingDeviceAllocator::CreateContextFn;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::RecordContext;
using c10::CachingDeviceAllocator::SegmentInfo;
using c10::CachingDeviceAllocator::TraceEntry;

struct AllocatorState {
  virtual ~AllocatorState() = default;
};

struct AllocatorConfigInfo {
  double garbage_collection_threshold;
  size_t max_split_size;
  size_t pinned_num_register_threads;
  bool expandable_segments;
  bool release_lock_on_malloc;
  bool pinned_use_host_register;
  bool graph_capture_record_stream_reuse;
  std::string last_allocator_settings;
  std::vector<size_t> roundup_power2_divisions;
};

struct SnapshotInfo {
  std::vector<CachingDeviceAllocator::SegmentInfo> segments;
  std::vector<std::vector<CachingDeviceAllocator::TraceEntry>> device_traces;
  AllocatorConfigInfo config_metadata;
};

struct CheckpointDelta {
  std::vector<void*> ptrs_freed;
  std::vector<c10::DataPtr> dataptrs_allocd;
};

using OutOfMemoryObserver =
    std::function<void(int64_t device, size_t allocated, size_t device_total, size_t device_free)>;

struct ShareableHandle {
  ptrdiff_t offset;
  std::string handle;
};

struct StreamSegmentSize {
  StreamSegmentSize(cudaStream_t s, bool small, size_t sz) : stream(s), is_small_pool(small), total_size(sz) {}
  cudaStream_t stream;
  bool is_small_pool;
  size_t total_size;
};

class CUDAAllocator : public DeviceAllocator {
 public:
  virtual void* raw_alloc(size_t nbytes) = 0;
  virtual void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) = 0;
  virtual void raw_delete(void* ptr) = 0;
  virtual void init(int device_count) = 0;
  virtual double getMemoryFraction(c10::DeviceIndex device) = 0;
  virtual void setMemoryFraction(double fraction, c10::DeviceIndex device) = 0;
  virtual std::vector<StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex device) = 0;
  virtual void enable(bool value) = 0;
  virtual bool isEnabled() const = 0;
  virtual void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) = 0;
  virtual void* getBaseAllocation(void* ptr, size_t* size) = 0;
  virtual void recordStream(const DataPtr& ptr, CUDAStream stream) = 0;
  void recordStream(const DataPtr& ptr, c10::Stream stream) override {
    CUDAStream cuda_stream = CUDAStream(stream);
    recordStream(ptr, cuda_stream);
  }
  virtual SnapshotInfo snapshot(MempoolId_t mempool_id = {0, 0}, bool include_traces = true) = 0;
  virtual void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                                   std::function<bool(cudaStream_t)> filter) = 0;
  virtual void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) = 0;
  virtual void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) = 0;
  virtual int getPoolUseCount(c10::DeviceIndex /*device*/, MempoolId_t /*mempool_id*/) {
    TORCH_CHECK(false, name(), " does not yet support getPoolUseCount. "
                "If you need it, please file an issue describing your use case.");
  }
  virtual void createOrIncrefPool(c10::DeviceIndex /*device*/, MempoolId_t /*mempool_id*/,
                                  std::shared_ptr<CUDAAllocator> /*allocator*/ = nullptr) {
    TORCH_CHECK(false, name(), " does not yet support createOrIncrefPool. "
                "If you need it, please file an issue describing your use case.");
  }
  virtual void setUseOnOOM(c10::DeviceIndex /*device*/, MempoolId_t /*mempool_id*/, bool /*use_on_oom*/) {
    TORCH_CHECK(false, name(), " does not yet support setUseOnOOM. "
                "If you need it, please file an issue describing your use case.");
  }
  virtual void setNoSplit(c10::DeviceIndex /*device*/, MempoolId_t /*mempool_id*/) {
    TORCH_CHECK(false, name(), " does not yet support setNoSplit. "
                "If you need it, please file an issue describing your use case.");
  }
  // returns true if the allocated blocks are equal to expected live allocations
  virtual bool checkPoolLiveAllocations(c10::DeviceIndex /*device*/, MempoolId_t /*mempool_id*/,
                                        const std::unordered_set<void*>& /*expected_live_allocations*/) {
    TORCH_CHECK(false, name(), " does not yet support checkPoolLiveAllocations. "
                "If you need it, please file an issue describing your use case.");
  }
  virtual ShareableHandle shareIpcHandle(void* ptr) = 0;
  virtual std::shared_ptr<void> getIpcDevPtr(std::string handle) = 0;
  virtual bool isHistoryEnabled() {
    TORCH_CHECK(false, name(), " does not yet support recordHistory. "
                "If you need it, please file an issue describing your use case.");
  }
  virtual void recordHistory(bool enabled, CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                             RecordContext when, bool clearHistory,
                             const std::vector<std::string>& skip_actions) = 0;
  virtual void attachOutOfMemoryObserver(OutOfMemoryObserver observer) = 0;
  virtual void attachAllocatorTraceTracker(AllocatorTraceTracker tracker) = 0;
  virtual void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) = 0;
  virtual cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                                  cudaStream_t stream, bool p2p_enabled) = 0;
  virtual std::shared_ptr<AllocatorState> getCheckpointState(c10::DeviceIndex device, MempoolId_t id) = 0;
  virtual CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device, std::shared_ptr<AllocatorState> pps) = 0;
  virtual std::string name() = 0;
};

// torch defines it in c10_cuda; the tests define it.
extern std::atomic<CUDAAllocator*> allocator;

inline CUDAAllocator* get() { return allocator.load(); }

}  // namespace c10::cuda::CUDACachingAllocator

namespace c10::cuda {
using c10::CaptureId_t;
using c10::MempoolId_t;
}  // namespace c10::cuda
