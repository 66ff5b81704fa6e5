// Fakes of what torch's libraries (c10, c10_cuda, torch_cuda) and the CUDA runtime define for
// the declarations of the stub headers in include/: the current-allocator global with a
// "native" default, changeCurrentAllocator and getCurrentAllocator (refusing, as torch's does,
// once the current allocator is initialised), a CUDAPluggableAllocator, the current device and
// stream, the thread's stream capture mode, and the cuda* functions allocd_torch/_allocator.cpp
// calls. The state of the fake
// device lives in namespace fake_cuda, for the tests to set and read.
//
// Used twice: hooks_stub/driver.cpp includes it (one translation unit with _allocator.cpp), and
// test_enable_fake_torch.py compiles it into the fake torch's libtorch_cuda.so.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace fake_cuda {
c10::DeviceIndex device = 0;                  // the current device (GetDevice, SetDevice)
cudaError_t get_device_error = cudaSuccess;   // what GetDevice returns
c10::StreamId current_stream = 0;             // the current stream's id; its cudaStream_t has this value
size_t mem_free = size_t(60) << 30, mem_total = size_t(80) << 30;  // cudaMemGetInfo's answer
int mem_get_info_calls = 0;
c10::DeviceIndex mem_get_info_device = -1;    // the current device at the last cudaMemGetInfo
cudaError_t peer_access_result = cudaSuccess;  // what cudaDeviceEnablePeerAccess returns
int peer_access_calls = 0, get_last_error_calls = 0;
int memcpy_calls = 0, memcpy_async_calls = 0, memcpy_peer_async_calls = 0;
thread_local cudaStreamCaptureMode capture_mode = cudaStreamCaptureModeGlobal;  // the thread's
int capture_mode_exchanges = 0;
}  // namespace fake_cuda

// --- c10_cuda: devices and streams ----------------------------------------------------------

namespace c10::cuda {

cudaError_t GetDevice(DeviceIndex* device) {
  if (fake_cuda::get_device_error != cudaSuccess) return fake_cuda::get_device_error;
  *device = fake_cuda::device;
  return cudaSuccess;
}

cudaError_t SetDevice(DeviceIndex device, const bool /*force*/) {
  fake_cuda::device = device;
  return cudaSuccess;
}

cudaStream_t CUDAStream::stream() const {
  return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(id()));
}

CUDAStream getCurrentCUDAStream(DeviceIndex device_index) {
  if (device_index < 0) device_index = fake_cuda::device;
  return CUDAStream(Stream(Stream::UNSAFE, Device(DeviceType::CUDA, device_index), fake_cuda::current_stream));
}

}  // namespace c10::cuda

// --- the CUDA runtime ------------------------------------------------------------------------

extern "C" {

cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  fake_cuda::mem_get_info_calls++;
  fake_cuda::mem_get_info_device = fake_cuda::device;
  *free = fake_cuda::mem_free;
  *total = fake_cuda::mem_total;
  return cudaSuccess;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode* mode) {
  fake_cuda::capture_mode_exchanges++;
  std::swap(*mode, fake_cuda::capture_mode);
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  fake_cuda::get_last_error_calls++;
  return cudaSuccess;
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorPeerAccessAlreadyEnabled: return "peer access is already enabled";
  }
  return "unknown error";
}

cudaError_t cudaDeviceEnablePeerAccess(int /*peerDevice*/, unsigned int /*flags*/) {
  fake_cuda::peer_access_calls++;
  return fake_cuda::peer_access_result;
}

cudaError_t cudaMemcpy(void* /*dst*/, const void* /*src*/, size_t /*count*/, enum cudaMemcpyKind kind) {
  fake_cuda::memcpy_calls++;
  return kind == cudaMemcpyDeviceToDevice ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t cudaMemcpyAsync(void* /*dst*/, const void* /*src*/, size_t /*count*/, enum cudaMemcpyKind kind,
                            cudaStream_t /*stream*/) {
  fake_cuda::memcpy_async_calls++;
  return kind == cudaMemcpyDeviceToDevice ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t cudaMemcpyPeerAsync(void* /*dst*/, int /*dstDevice*/, const void* /*src*/, int /*srcDevice*/,
                                size_t /*count*/, cudaStream_t /*stream*/) {
  fake_cuda::memcpy_peer_async_calls++;
  return cudaSuccess;
}

}  // extern "C"

// --- torch_cuda: the current allocator and CUDAPluggableAllocator ------------------------------

namespace torch::cuda::CUDAPluggableAllocator {

namespace CA = c10::cuda::CUDACachingAllocator;

namespace {
std::shared_ptr<CA::CUDAAllocator> current_custom_allocator;

[[noreturn]] void unsupported(const char* what) {
  TORCH_CHECK(false, "CUDAPluggableAllocator does not yet support ", what,
              ". If you need it, please file an issue describing your use case.");
}

void custom_raw_deleter(void* ptr) { current_custom_allocator->raw_delete(ptr); }

// torch's default allocator, as far as the tests need one: named "native", not initialised
// until init(), and allocating nothing.
struct FakeNative final : CUDAPluggableAllocator {
  FakeNative()
      : CUDAPluggableAllocator(
            [](size_t, int, cudaStream_t) -> void* {
              TORCH_CHECK(false, "the fake torch's native allocator allocates nothing");
            },
            [](void*, size_t, int, cudaStream_t) {}) {}
  std::string name() override { return "native"; }
};
FakeNative native;
}  // namespace

std::shared_ptr<CA::CUDAAllocator> getCurrentAllocator() { return current_custom_allocator; }

std::shared_ptr<CA::CUDAAllocator> createCustomAllocator(std::function<void*(size_t, int, cudaStream_t)> alloc_fn,
                                                         std::function<void(void*, size_t, int, cudaStream_t)> free_fn) {
  auto allocator = std::make_shared<CUDAPluggableAllocator>(std::move(alloc_fn), std::move(free_fn));
  allocator->init(1);
  return allocator;
}

void changeCurrentAllocator(const std::shared_ptr<CA::CUDAAllocator>& allocator) {
  TORCH_CHECK(!CA::allocator.load()->initialized(), "Can't swap an already initialized allocator");
  CA::allocator.store(allocator.get());
  current_custom_allocator = allocator;
}

_AllocationMetadata::_AllocationMetadata() : size(0), device_idx(-1), stream{} {}
_AllocationMetadata::_AllocationMetadata(size_t size, c10::DeviceIndex device_idx, cudaStream_t stream)
    : size(size), device_idx(device_idx), stream(stream) {}

CUDAPluggableAllocator::CUDAPluggableAllocator(std::function<void*(size_t, int, cudaStream_t)> alloc_fn,
                                               std::function<void(void*, size_t, int, cudaStream_t)> free_fn)
    : alloc_fn_(std::move(alloc_fn)), free_fn_(std::move(free_fn)) {}

void* CUDAPluggableAllocator::malloc(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
  void* r = alloc_fn_(size, device, stream);
  std::lock_guard<std::mutex> lock(allocator_mutex_);
  allocation_metadata_.emplace(r, _AllocationMetadata(size, device, stream));
  return r;
}

c10::DataPtr CUDAPluggableAllocator::allocate(size_t size) {
  c10::DeviceIndex device = -1;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  void* r = malloc(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
  return {r, r, raw_deleter(), c10::Device(c10::DeviceType::CUDA, device)};
}

c10::DeleterFnPtr CUDAPluggableAllocator::raw_deleter() const { return &custom_raw_deleter; }

void* CUDAPluggableAllocator::raw_alloc(size_t nbytes) {
  c10::DeviceIndex device = -1;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  return malloc(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
}

void* CUDAPluggableAllocator::raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) {
  c10::DeviceIndex device = -1;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  return malloc(nbytes, device, stream);
}

void CUDAPluggableAllocator::raw_delete(void* ptr) {
  _AllocationMetadata m;
  {
    std::lock_guard<std::mutex> lock(allocator_mutex_);
    auto it = allocation_metadata_.find(ptr);
    TORCH_CHECK(it != allocation_metadata_.end(), "Trying to free a pointer not allocated here");
    m = it->second;
    allocation_metadata_.erase(it);
  }
  free_fn_(ptr, m.size, m.device_idx, m.stream);
}

void CUDAPluggableAllocator::init(int /*device_count*/) { initialized_ = true; }
bool CUDAPluggableAllocator::initialized() { return initialized_; }
double CUDAPluggableAllocator::getMemoryFraction(c10::DeviceIndex /*device*/) { unsupported("getMemoryFraction"); }
void CUDAPluggableAllocator::setMemoryFraction(double /*fraction*/, c10::DeviceIndex /*device*/) {}
std::vector<CA::StreamSegmentSize> CUDAPluggableAllocator::getExpandableSegmentSizes(c10::DeviceIndex /*device*/) {
  unsupported("getExpandableSegmentSizes");
}
void CUDAPluggableAllocator::emptyCache(c10::cuda::MempoolId_t /*mempool_id*/) {}
void CUDAPluggableAllocator::cacheInfo(c10::DeviceIndex /*device*/, size_t* /*largestBlock*/) {
  unsupported("cacheInfo");
}
void* CUDAPluggableAllocator::getBaseAllocation(void* /*ptr*/, size_t* /*size*/) { unsupported("getBaseAllocation"); }
void CUDAPluggableAllocator::recordStream(const c10::DataPtr& /*ptr*/, c10::cuda::CUDAStream /*stream*/) {}
c10::CachingDeviceAllocator::DeviceStats CUDAPluggableAllocator::getDeviceStats(c10::DeviceIndex /*device*/) {
  unsupported("getDeviceStats");
}
void CUDAPluggableAllocator::resetAccumulatedStats(c10::DeviceIndex /*device*/) {
  unsupported("resetAccumulatedStats");
}
void CUDAPluggableAllocator::resetPeakStats(c10::DeviceIndex /*device*/) { unsupported("resetPeakStats"); }
CA::SnapshotInfo CUDAPluggableAllocator::snapshot(c10::cuda::MempoolId_t /*mempool*/, bool /*include_traces*/) {
  unsupported("snapshot");
}
void CUDAPluggableAllocator::beginAllocateToPool(c10::DeviceIndex /*device*/, c10::cuda::MempoolId_t /*mempool_id*/,
                                                 std::function<bool(cudaStream_t)> /*filter*/) {
  unsupported("beginAllocateToPool");
}
void CUDAPluggableAllocator::endAllocateToPool(c10::DeviceIndex /*device*/, c10::cuda::MempoolId_t /*mempool_id*/) {}
void CUDAPluggableAllocator::releasePool(c10::DeviceIndex /*device*/, c10::cuda::MempoolId_t /*mempool_id*/) {}
std::shared_ptr<void> CUDAPluggableAllocator::getIpcDevPtr(std::string /*handle*/) { unsupported("getIpcDevPtr"); }
CA::ShareableHandle CUDAPluggableAllocator::shareIpcHandle(void* /*ptr*/) { unsupported("shareIpcHandle"); }
void CUDAPluggableAllocator::recordHistory(bool /*enabled*/, CA::CreateContextFn /*context_recorder*/,
                                           size_t /*alloc_trace_max_entries*/, CA::RecordContext /*when*/,
                                           bool /*clearHistory*/, const std::vector<std::string>& /*skip_actions*/) {
  unsupported("recordHistory");
}
void CUDAPluggableAllocator::attachOutOfMemoryObserver(CA::OutOfMemoryObserver /*observer*/) {
  unsupported("attachOutOfMemoryObserver");
}
void CUDAPluggableAllocator::attachAllocatorTraceTracker(CA::AllocatorTraceTracker /*tracker*/) {
  unsupported("attachAllocatorTraceTracker");
}
std::shared_ptr<CA::AllocatorState> CUDAPluggableAllocator::getCheckpointState(c10::DeviceIndex /*device*/,
                                                                               c10::cuda::MempoolId_t /*id*/) {
  unsupported("getCheckpointState");
}
CA::CheckpointDelta CUDAPluggableAllocator::setCheckpointPoolState(c10::DeviceIndex /*device*/,
                                                                   std::shared_ptr<CA::AllocatorState> /*pps*/) {
  unsupported("setCheckpointPoolState");
}
void CUDAPluggableAllocator::enablePeerAccess(c10::DeviceIndex /*dev*/, c10::DeviceIndex /*dev_to_access*/) {
  unsupported("enablePeerAccess");
}
cudaError_t CUDAPluggableAllocator::memcpyAsync(void* dst, int /*dstDevice*/, const void* src, int /*srcDevice*/,
                                                size_t count, cudaStream_t stream, bool /*p2p_enabled*/) {
  return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
}
std::string CUDAPluggableAllocator::name() { return "pluggable"; }
void CUDAPluggableAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
}

}  // namespace torch::cuda::CUDAPluggableAllocator

// --- c10_cuda: the current allocator, torch's native one until changeCurrentAllocator ------------

std::atomic<c10::cuda::CUDACachingAllocator::CUDAAllocator*> c10::cuda::CUDACachingAllocator::allocator{
    &torch::cuda::CUDAPluggableAllocator::native};
