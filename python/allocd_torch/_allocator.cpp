// allocd as torch's own CUDA allocator: a c10::cuda::CUDACachingAllocator::CUDAAllocator
// whose every method answers from liballocd.so, compiled by allocd_torch at the first enable()
// against the installed torch and cached, and installed where change_current_allocator
// installs one (torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator).
//
// So torch's own APIs answer from allocd, through torch's own code paths, unpatched:
// torch.cuda.memory_stats() and everything built on it (memory_summary, memory_allocated,
// max_memory_reserved, reset_peak_memory_stats, reset_accumulated_memory_stats) from
// getDeviceStats and the resets; torch.cuda.memory._snapshot() and _dump_snapshot() from
// snapshot(); _record_memory_history() through recordHistory, whose context recorder gives
// Python frames; empty_cache, set/get_per_process_memory_fraction, record_stream,
// caching_allocator_alloc/delete (raw_alloc/raw_delete) and cacheInfo (cuDNN's workspace
// sizing) likewise.
//
// No pointer map: allocd knows every block. A tensor's DataPtr holds its address as both data
// and context, and its deleter (the raw deleter) hands the address alone to allocd, which
// finds the block and its device. The hot path is one call into liballocd for a malloc and a
// queued free (allocd_torch_free returns without entering Go), plus one relaxed atomic load
// that says whether history or trace trackers want to see the event.
//
// History: torch's context recorder (Python or C++ frames) runs here, where torch calls us,
// and the contexts stay here: the alloc and free entries of the trace and the contexts of
// live blocks are this file's; the segment entries (segment_alloc, segment_free,
// segment_map, segment_unmap), free_completed and oom come from allocd's own history,
// switched on and off with ours. snapshot() merges the two by time.
//
// Private memory pools (CUDA graph capture, torch.cuda.MemPool and use_mem_pool, the pools of
// torch.compile's CUDA graph trees) are allocd's: torch's pool calls create, share and release
// them through liballocd (allocd_torch_*_pool), and each segment of a snapshot names its pool.
// torch's beginAllocateToPool passes a filter of streams (a std::function, which Go cannot
// call): the filters stay here, per device, and while a capture is under way a malloc whose
// stream one of them accepts goes to that capture's pool (allocd_torch_malloc_pool), the first
// in the order they began, as torch's allocator routes it, under the relaxed capture mode that
// torch's own cudaMalloc during a capture takes; allocd itself only knows that a capture is
// under way. When none is, malloc pays one relaxed atomic load for it.
//
// torch.compile's CUDA graph trees checkpoint their pool after each recording and set it back
// before they leave a replayed path: allocd's checkpoints (allocd_torch_checkpoint_pool,
// allocd_torch_restore_pool).
//
// Not supported, each refused with torch's error naming allocd: a MemPool with an allocator of
// its own, MemPool's use_on_oom and no_split, and CUDA IPC of tensors.
//
// Fork: liballocd.so runs a Go runtime, which does not survive fork(). A DataLoader worker is
// a forked child that may still drop (free) CUDA tensors it inherited, so after a fork frees
// and the stream/cache calls do nothing, and allocation throws a clear error instead of
// calling Go. The check is one relaxed atomic load, set by a pthread_atfork child handler.

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace allocd_torch {

namespace CA = c10::cuda::CUDACachingAllocator;
namespace CDA = c10::CachingDeviceAllocator;

// liballocd.so's functions, in the order allocd_alloc_setup receives them.
struct Lib {
  void* (*malloc)(size_t, int, void*);
  void (*free)(void*, size_t, int, void*);
  void (*record_stream)(void*, void*);
  void (*empty_cache)();
  void (*set_fraction)(double, int);
  size_t (*last_error)(char*, size_t);
  long long (*device_stats)(int, long long*, size_t);
  int (*reset_peak)(int);
  int (*reset_accumulated)(int);
  double (*memory_fraction)(int);
  long long (*largest_free)(int);
  long long (*snapshot_flat)(int, long long*, size_t);
  int (*record_history)(int, long long, int);
  // Private pools: each names its pool as torch's MempoolId_t pair.
  void* (*malloc_pool)(size_t, int, void*, uint64_t, uint64_t);
  int (*create_pool)(int, uint64_t, uint64_t);
  int (*release_pool)(int, uint64_t, uint64_t);
  int (*begin_pool)(int, uint64_t, uint64_t);
  int (*end_pool)(int, uint64_t, uint64_t);
  int (*empty_pool_cache)(int, uint64_t, uint64_t);
  int (*pool_use_count)(int, uint64_t, uint64_t);
  uintptr_t (*checkpoint_pool)(int, uint64_t, uint64_t);
  void (*checkpoint_free)(uintptr_t);
  long long (*restore_pool)(int, uintptr_t, long long**);
};
constexpr int kLibFunctions = sizeof(Lib) / sizeof(void*);

Lib g_lib{};
pid_t g_setup_pid = 0;
std::atomic<bool> g_forked{false};
std::atomic<bool> g_atfork_registered{false};
std::string g_settings;  // allocd's configuration, for the snapshot's allocator_settings
bool g_expandable = false;
// A test switch (ALLOCD_TORCH_TEST_SKIP_RECORD_STREAM_HOOK): record_stream is ignored, to show
// that the GPU test of record_stream can fail.
bool g_ignore_record_stream = false;

void mark_forked_child() { g_forked.store(true, std::memory_order_relaxed); }
inline bool in_forked_child() { return g_forked.load(std::memory_order_relaxed); }

std::string last_error() {
  if (g_lib.last_error == nullptr) return std::string();
  std::string s(2048, '\0');
  size_t n = g_lib.last_error(&s[0], s.size());
  if (n >= s.size()) {
    s.assign(n + 1, '\0');
    n = std::min(g_lib.last_error(&s[0], s.size()), s.size() - 1);
  }
  s.resize(n);
  return s;
}

bool mentions_out_of_memory(std::string m) {
  std::transform(m.begin(), m.end(), m.begin(), [](unsigned char c) { return std::tolower(c); });
  return m.find("out of memory") != std::string::npos;
}

void copy_out(const std::string& s, char* buf, size_t n) {
  if (buf == nullptr || n == 0) return;
  size_t k = std::min(s.size(), n - 1);
  std::memcpy(buf, s.data(), k);
  buf[k] = '\0';
}

// Layout of allocd_device_stats (liballocd's torchapi.go): 9 arrays x 3 pools x (current, peak,
// allocated, freed), then oversize_allocations and oversize_segments, then 6 counters.
constexpr int kDeviceStats = 9 * 3 * 4 + 4 + 4 + 6;
// Layout of allocd_snapshot_flat: format 2. A segment's fields: device, address, total_size,
// requested_size, allocated_size, active_size, stream, is_large, is_expandable, its pool's id
// (two values), number of blocks; a block's: address, size, requested_size, state (0 inactive,
// 1 active_allocated, 2 active_pending_free).
constexpr long long kSnapshotFormat = 2;
constexpr int kSegmentFields = 12, kBlockFields = 4, kEntryFields = 5;
constexpr long long kActiveAllocated = 1;

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// cause_rank orders trace entries of the same microsecond by cause.
int cause_rank(CDA::TraceEntry::Action a) {
  switch (a) {
    case CDA::TraceEntry::SEGMENT_ALLOC:
    case CDA::TraceEntry::SEGMENT_MAP:
      return 0;
    case CDA::TraceEntry::ALLOC:
      return 1;
    case CDA::TraceEntry::FREE_REQUESTED:
      return 2;
    case CDA::TraceEntry::FREE_COMPLETED:
      return 3;
    case CDA::TraceEntry::SEGMENT_UNMAP:
    case CDA::TraceEntry::SEGMENT_FREE:
      return 4;
    default:
      return 5;  // snapshot, oom
  }
}

bool pool_is_default(const c10::MempoolId_t& id) { return id.first == 0 && id.second == 0; }

std::string pool_name(const c10::MempoolId_t& id) {
  return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
}

// FlatSegment is one segment of allocd_snapshot_flat's values: its kSegmentFields fields, then
// its blocks, kBlockFields values each.
struct FlatSegment {
  const long long* f;
  const long long* blocks;
  long long nblocks;
  c10::MempoolId_t pool() const {
    return {static_cast<c10::CaptureId_t>(f[9]), static_cast<c10::CaptureId_t>(f[10])};
  }
};

// walk_segments checks allocd_snapshot_flat's values v (their header and bounds), calls fn for
// each segment, and returns the position after the segments, where the traces start.
template <typename F>
size_t walk_segments(const std::vector<long long>& v, F fn) {
  auto need = [&](size_t pos, size_t k) {
    TORCH_CHECK(pos + k <= v.size(), "allocd: snapshot: truncated data from liballocd.so (", v.size(), " values)");
  };
  need(0, 3);
  TORCH_CHECK(v[0] == kSnapshotFormat, "allocd: snapshot format ", v[0], " from liballocd.so, this build of "
              "allocd_torch reads format ", kSnapshotFormat, ": rebuild it");
  size_t pos = 3;
  for (long long i = 0; i < v[1]; i++) {
    need(pos, kSegmentFields);
    long long nb = std::max(v[pos + kSegmentFields - 1], 0LL);
    need(pos + kSegmentFields, static_cast<size_t>(nb) * kBlockFields);
    fn(FlatSegment{v.data() + pos, v.data() + pos + kSegmentFields, nb});
    pos += kSegmentFields + static_cast<size_t>(nb) * kBlockFields;
  }
  return pos;
}

// The raw deleter: every DataPtr allocd hands out has the block's address as its context.
void raw_delete_fn(void* ptr);

class AllocdAllocator final : public CA::CUDAAllocator {
 public:
  // --- allocation: the hot path -------------------------------------------------------
  c10::DataPtr allocate(size_t n) override {
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    void* p = nullptr;
    if (n > 0) p = malloc(n, device, c10::cuda::getCurrentCUDAStream(device).stream());
    return {p, p, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete_fn; }

  void* raw_alloc(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return malloc(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) return nullptr;
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return malloc(nbytes, device, stream);
  }

  void raw_delete(void* ptr) override { free(ptr); }

  void* malloc(size_t n, c10::DeviceIndex device, cudaStream_t stream) {
    if (in_forked_child()) {
      TORCH_CHECK(false, "allocd_torch: CUDA memory requested in a forked child process (pid ", getpid(),
                  "; allocd was set up in pid ", g_setup_pid,
                  "). allocd's Go runtime does not survive fork(), and CUDA cannot be used after fork "
                  "anyway: start processes that use CUDA with the 'spawn' method.");
    }
    // One relaxed load when no capture is under way (captures_): the plain malloc.
    void* p = capturing_.load(std::memory_order_relaxed) == 0 ? g_lib.malloc(n, device, stream)
                                                                : routed_malloc(n, device, stream);
    if (p == nullptr) fail_malloc(n, device, stream);
    if (observed_.load(std::memory_order_relaxed)) observe(CDA::TraceEntry::ALLOC, p, n, device, stream);
    return p;
  }

  void free(void* ptr) {
    if (ptr == nullptr || in_forked_child()) return;  // in a child the memory is the parent's
    if (observed_.load(std::memory_order_relaxed)) observe(CDA::TraceEntry::FREE_REQUESTED, ptr, 0, -1, nullptr);
    g_lib.free(ptr, 0, -1, nullptr);
  }

  // --- streams, cache, fraction ---------------------------------------------------------
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    // A DataPtr of another allocator (or none) is not allocd's to track.
    if (ptr.get() == nullptr || ptr.get_deleter() != &raw_delete_fn || in_forked_child()) return;
    if (g_ignore_record_stream) return;
    g_lib.record_stream(ptr.get(), stream.stream());
  }

  void emptyCache(c10::MempoolId_t mempool_id) override {
    if (in_forked_child()) return;
    if (pool_is_default(mempool_id)) {
      g_lib.empty_cache();
      return;
    }
    // A private pool: a MemPool's destructor calls this right after its releasePool. allocd has
    // nothing to release (liballocd's pools.go says why: a pool without users went back at its
    // release, one with users keeps its memory for them). torch's emptyCache(pool) has no
    // device: -1, every device. Not checked: torch calls it from a destructor, and liballocd
    // logs a failure.
    (void)g_lib.empty_pool_cache(-1, mempool_id.first, mempool_id.second);
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    if (in_forked_child()) return 1.0;
    return g_lib.memory_fraction(device);
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    TORCH_CHECK(fraction >= 0 && fraction <= 1, "invalid fraction: ", fraction, ". Please set within [0, 1].");
    if (in_forked_child()) return;
    g_lib.set_fraction(fraction, device);
  }

  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    if (*largestBlock == 0) {  // as torch's: an initial guess of the device's free memory
      c10::cuda::CUDAGuard guard(device);
      size_t total = 0;
      C10_CUDA_CHECK(cudaMemGetInfo(largestBlock, &total));
    }
    if (in_forked_child()) return;
    long long cached = g_lib.largest_free(device);
    if (cached > 0 && static_cast<size_t>(cached) > *largestBlock) *largestBlock = static_cast<size_t>(cached);
  }

  // --- statistics -------------------------------------------------------------------------
  CDA::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    CDA::DeviceStats st;
    if (in_forked_child()) return st;
    long long v[kDeviceStats];
    long long n = g_lib.device_stats(device, v, kDeviceStats);
    TORCH_CHECK(n == kDeviceStats, "allocd: reading device ", int(device), "'s statistics failed",
                n < 0 ? ": " + last_error() : " (liballocd.so gives " + std::to_string(n) +
                                                  " values, this build of allocd_torch expects " +
                                                  std::to_string(kDeviceStats) + ": rebuild it)");
    const long long* p = v;
    auto stat = [&p](c10::CachingAllocator::Stat& s) {
      s.current = p[0];
      s.peak = p[1];
      s.allocated = p[2];
      s.freed = p[3];
      p += 4;
    };
    for (auto* arr : {&st.allocation, &st.segment, &st.active, &st.inactive_split, &st.allocated_bytes,
                      &st.reserved_bytes, &st.active_bytes, &st.inactive_split_bytes, &st.requested_bytes}) {
      for (auto& s : *arr) stat(s);
    }
    stat(st.oversize_allocations);
    stat(st.oversize_segments);
    st.num_alloc_retries = p[0];
    st.num_ooms = p[1];
    st.num_sync_all_streams = p[2];
    st.num_device_alloc = p[3];
    st.num_device_free = p[4];
    st.max_split_size = p[5];
    return st;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    if (in_forked_child()) return;
    TORCH_CHECK(g_lib.reset_accumulated(device) == 0, last_error());
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    if (in_forked_child()) return;
    TORCH_CHECK(g_lib.reset_peak(device) == 0, last_error());
  }

  // --- snapshot and history ---------------------------------------------------------------
  CA::SnapshotInfo snapshot(c10::MempoolId_t mempool_id, bool include_traces) override {
    CA::SnapshotInfo info;
    info.config_metadata.garbage_collection_threshold = 0;
    info.config_metadata.max_split_size = 0;
    info.config_metadata.pinned_num_register_threads = 0;
    info.config_metadata.expandable_segments = g_expandable;
    info.config_metadata.release_lock_on_malloc = false;
    info.config_metadata.pinned_use_host_register = false;
    info.config_metadata.graph_capture_record_stream_reuse = false;
    info.config_metadata.last_allocator_settings = "allocd:" + g_settings;
    if (in_forked_child()) return info;
    // A private pool's snapshot keeps that pool's segments only, as torch's does.
    std::vector<long long> flat = snapshot_values(include_traces);
    decode_snapshot(flat, include_traces, mempool_id, &info);
    return info;
  }

  bool isHistoryEnabled() override { return history_.load(std::memory_order_relaxed); }

  void recordHistory(bool enabled, CA::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                     CA::RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) override {
    std::lock_guard<std::mutex> lock(mu_);
    size_t max_entries = std::max<size_t>(alloc_trace_max_entries, 1);
    // allocd's history starts afresh whenever it is switched on: switch it only when it
    // goes on or off, is cleared, or changes its length, so that a call that changes only
    // the context keeps its segment entries.
    bool was = history_.load(std::memory_order_relaxed);
    if (enabled != was || clearHistory || (enabled && max_entries != max_entries_)) {
      if (g_lib.record_history(enabled ? 1 : 0, static_cast<long long>(max_entries), 0) != 0) {
        TORCH_CHECK(false, last_error());
      }
    }
    recorder_ = enabled ? context_recorder : nullptr;
    when_ = enabled ? when : CA::RecordContext::NEVER;
    max_entries_ = max_entries;
    skip_.clear();
    for (const auto& a : skip_actions) skip_.insert(static_cast<int>(CDA::parseTraceEntryAction(a)));
    if (!enabled || clearHistory) traces_.clear();
    if (!enabled) live_.clear();
    history_.store(enabled, std::memory_order_relaxed);
    update_observed();
  }

  void attachOutOfMemoryObserver(CA::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(mu_);
    oom_observers_.push_back(std::move(observer));
  }

  void attachAllocatorTraceTracker(CA::AllocatorTraceTracker tracker) override {
    std::lock_guard<std::mutex> lock(mu_);
    trackers_.push_back(std::move(tracker));
    update_observed();
  }

  // --- the rest of the interface ------------------------------------------------------------
  void init(int /*device_count*/) override { initialized_.store(true); }
  bool initialized() override { return initialized_.load(); }
  void enable(bool /*value*/) override {}
  bool isEnabled() const override { return true; }
  std::string name() override { return "allocd"; }

  std::vector<CA::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex /*device*/) override { return {}; }

  void* getBaseAllocation(void* /*ptr*/, size_t* /*size*/) override {
    TORCH_CHECK(false, "allocd does not support getBaseAllocation (CUDA IPC of tensors) yet");
  }
  CA::ShareableHandle shareIpcHandle(void* /*ptr*/) override {
    TORCH_CHECK(false, "allocd does not support sharing CUDA tensors between processes (CUDA IPC) yet");
  }
  std::shared_ptr<void> getIpcDevPtr(std::string /*handle*/) override {
    TORCH_CHECK(false, "allocd does not support opening CUDA tensors of another process (CUDA IPC) yet");
  }

  // --- private pools ---------------------------------------------------------------------------
  // torch's beginAllocateToPool (CUDAGraph::capture_begin, use_mem_pool, the graph trees'
  // warmup): the pool gains a user in allocd, which marks a capture under way, and the filter
  // routes this device's mallocs (routed_malloc) until endAllocateToPool.
  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override {
    refuse_in_child("beginAllocateToPool");
    TORCH_CHECK(device >= 0, "allocd: beginAllocateToPool on device ", int(device));
    std::lock_guard<std::mutex> lock(pools_mu_);
    if (captures_.size() <= static_cast<size_t>(device)) captures_.resize(static_cast<size_t>(device) + 1);
    auto& caps = captures_[static_cast<size_t>(device)];
    for (const Capture& c : caps) {
      TORCH_CHECK(c.id != mempool_id, "beginAllocateToPool: already recording to mempool_id ", pool_name(mempool_id));
    }
    TORCH_CHECK(g_lib.begin_pool(device, mempool_id.first, mempool_id.second) == 0, last_error());
    caps.push_back(Capture{mempool_id, std::move(filter)});
    capturing_.fetch_add(1, std::memory_order_relaxed);
  }

  // torch's endAllocateToPool: the earliest capture to the pool stops routing; its user stays
  // until releasePool.
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    if (in_forked_child()) return;
    {
      std::lock_guard<std::mutex> lock(pools_mu_);
      bool found = false;
      if (device >= 0 && static_cast<size_t>(device) < captures_.size()) {
        auto& caps = captures_[static_cast<size_t>(device)];
        auto it = std::find_if(caps.begin(), caps.end(), [&](const Capture& c) { return c.id == mempool_id; });
        if (it != caps.end()) {
          caps.erase(it);
          capturing_.fetch_sub(1, std::memory_order_relaxed);
          found = true;
        }
      }
      TORCH_CHECK(found, "endAllocatePool: not currently recording to mempool_id ", pool_name(mempool_id));
    }
    TORCH_CHECK(g_lib.end_pool(device, mempool_id.first, mempool_id.second) == 0, last_error());
  }

  // torch's releasePool (a CUDA graph's reset, a MemPool's destruction, the end of
  // use_mem_pool): at the last user the pool's memory goes back to the device, its free
  // segments at once, the rest as their blocks are freed (torch keeps it until the next
  // empty_cache instead).
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    if (in_forked_child()) return;
    TORCH_CHECK(g_lib.release_pool(device, mempool_id.first, mempool_id.second) == 0, last_error());
  }

  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override {
    if (in_forked_child()) return 0;
    int n = g_lib.pool_use_count(device, mempool_id.first, mempool_id.second);
    TORCH_CHECK(n >= 0, last_error());
    return n;
  }

  // torch's createOrIncrefPool (torch.cuda.MemPool): the pool gains a user, created when it has
  // none. A MemPool's own allocator (ncclMemAlloc, say) would serve its memory from outside
  // allocd: refused.
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                          std::shared_ptr<CA::CUDAAllocator> allocator) override {
    if (allocator != nullptr && allocator.get() != this) {
      TORCH_CHECK(false, "allocd does not support torch.cuda.MemPool with an allocator of its own (",
                  allocator->name(), "): under allocd every private pool's memory comes from allocd. "
                  "Create the MemPool without an allocator, or run this program with PyTorch's own allocator.");
    }
    refuse_in_child("createOrIncrefPool");
    TORCH_CHECK(g_lib.create_pool(device, mempool_id.first, mempool_id.second) == 0, last_error());
  }

  // MemPool(use_on_oom=True) lets torch serve other allocations from the pool's free memory when
  // the device runs out; allocd never lends a pool's memory. A MemPool's destructor calls it with
  // false for every pool: nothing to undo. (A refused MemPool's pool keeps the user its
  // constructor gave it, with no memory.)
  void setUseOnOOM(c10::DeviceIndex /*device*/, c10::MempoolId_t mempool_id, bool use_on_oom) override {
    if (!use_on_oom) return;
    TORCH_CHECK(false, "allocd does not support torch.cuda.MemPool(use_on_oom=True) (pool ", pool_name(mempool_id),
                "): allocd never serves other allocations from a private pool's memory. Create the MemPool "
                "without use_on_oom, or run this program with PyTorch's own allocator.");
  }

  void setNoSplit(c10::DeviceIndex /*device*/, c10::MempoolId_t mempool_id) override {
    TORCH_CHECK(false, "allocd does not support torch.cuda.MemPool(no_split=True) (pool ", pool_name(mempool_id),
                "): allocd splits a pool's segments as it splits the general cache's. Create the MemPool "
                "without no_split, or run this program with PyTorch's own allocator.");
  }

  // Whether the pool's allocated blocks on device are exactly expected_live_allocations
  // (torch.compile's CUDA graph trees check their pool with it): read from allocd's snapshot.
  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected_live_allocations) override {
    if (in_forked_child()) return expected_live_allocations.empty();
    std::vector<long long> flat = snapshot_values(false);
    size_t allocated = 0;
    bool unexpected = false;
    walk_segments(flat, [&](const FlatSegment& sg) {
      if (sg.f[0] != device || sg.pool() != mempool_id) return;
      for (long long j = 0; j < sg.nblocks; j++) {
        const long long* b = sg.blocks + j * kBlockFields;
        if (b[3] != kActiveAllocated) continue;
        allocated++;
        if (expected_live_allocations.count(reinterpret_cast<void*>(static_cast<uintptr_t>(b[0]))) == 0) {
          unexpected = true;
        }
      }
    });
    return !unexpected && allocated == expected_live_allocations.size();
  }

  // torch.compile's CUDA graph trees take a checkpoint of their pool after every recording
  // (getCheckpointState) and set the pool back to it (setCheckpointPoolState) when a program
  // leaves a replayed path for eager code or a new recording: the blocks allocated in the pool
  // then are freed, and those allocated at the checkpoint are allocated again at their
  // addresses, handed to torch as DataPtrs for the tensors still live. The checkpoint is
  // allocd's (Allocator.CheckpointPool), held through a handle that the state drops.
  struct PoolCheckpoint : CA::AllocatorState {
    PoolCheckpoint(c10::DeviceIndex d, uintptr_t h) : device(d), handle(h) {}
    ~PoolCheckpoint() override {
      if (!in_forked_child()) g_lib.checkpoint_free(handle);
    }
    PoolCheckpoint(const PoolCheckpoint&) = delete;
    PoolCheckpoint& operator=(const PoolCheckpoint&) = delete;
    c10::DeviceIndex device;
    uintptr_t handle;
  };

  std::shared_ptr<CA::AllocatorState> getCheckpointState(c10::DeviceIndex device, c10::MempoolId_t id) override {
    refuse_in_child("getCheckpointState");
    uintptr_t h = g_lib.checkpoint_pool(device, id.first, id.second);
    TORCH_CHECK(h != 0, last_error());
    return std::make_shared<PoolCheckpoint>(device, h);
  }

  CA::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                             std::shared_ptr<CA::AllocatorState> pps) override {
    refuse_in_child("setCheckpointPoolState");
    auto ck = std::dynamic_pointer_cast<PoolCheckpoint>(pps);
    TORCH_CHECK(ck != nullptr, "allocd: setCheckpointPoolState: the state is not one of allocd's getCheckpointState");
    long long* out = nullptr;
    long long n = g_lib.restore_pool(device, ck->handle, &out);
    std::unique_ptr<long long, void (*)(void*)> held(out, &std::free);
    // A restore that failed half way (n < 0 with an array) freed and allocated blocks that torch
    // will not know of: the pool is not as torch thinks, and the error says so.
    TORCH_CHECK(n >= 0, last_error(), out != nullptr ? " (the pool was changed part way: it no longer matches "
                                                        "torch's tensors)" : "");
    TORCH_CHECK(n >= 2 && out != nullptr && out[0] >= 0 && out[1] >= 0 && 2 + out[0] + out[1] == n,
                "allocd: restore pool: a malformed result from liballocd.so (", n, " values)");
    CA::CheckpointDelta delta;
    const long long* freed = out + 2;
    const long long* allocated = freed + out[0];
    for (long long i = 0; i < out[0]; i++) {
      void* p = reinterpret_cast<void*>(static_cast<uintptr_t>(freed[i]));
      delta.ptrs_freed.push_back(p);
      if (observed_.load(std::memory_order_relaxed)) observe(CDA::TraceEntry::FREE_REQUESTED, p, 0, -1, nullptr);
    }
    for (long long i = 0; i < out[1]; i++) {
      void* p = reinterpret_cast<void*>(static_cast<uintptr_t>(allocated[i]));
      delta.dataptrs_allocd.emplace_back(p, p, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }

  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();  // clear the error
      return;
    }
    C10_CUDA_CHECK(err);
  }

  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dstDevice == srcDevice) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

 private:
  // A capture under way on a device: its pool and torch's filter of the streams it takes.
  struct Capture {
    c10::MempoolId_t id;
    std::function<bool(cudaStream_t)> filter;
  };

  // routed_malloc is malloc while a capture is under way: the stream goes to the pool of the
  // first capture of the device, in the order they began, whose filter accepts it, else to the
  // general cache. The filters run under pools_mu_, as torch's run under its allocator's lock.
  void* routed_malloc(size_t n, c10::DeviceIndex device, cudaStream_t stream) {
    c10::MempoolId_t pool{0, 0};
    {
      std::lock_guard<std::mutex> lock(pools_mu_);
      if (device >= 0 && static_cast<size_t>(device) < captures_.size()) {
        for (const Capture& c : captures_[static_cast<size_t>(device)]) {
          if (!c.filter || c.filter(stream)) {
            pool = c.id;
            break;
          }
        }
      }
    }
    if (pool_is_default(pool)) return g_lib.malloc(n, device, stream);
    RelaxedCaptureMode relaxed;
    return g_lib.malloc_pool(n, device, stream, pool.first, pool.second);
  }

  // RelaxedCaptureMode relaxes the calling thread's stream capture mode while it lives, as torch's
  // allocator does around its cudaMalloc during a capture (cudaMallocMaybeCapturing): under a
  // global or thread-local capture (torch.cuda.graph's default, the graph trees' mode) CUDA
  // refuses a cudaMalloc on the capturing thread, and the refusal invalidates the capture.
  // allocd's Go code runs on the calling thread, so a segment it makes for the pool is made
  // under the relaxed mode. (It never frees one during a capture.)
  struct RelaxedCaptureMode {
    RelaxedCaptureMode() {
      if (cudaThreadExchangeStreamCaptureMode(&mode) != cudaSuccess) {
        (void)cudaGetLastError();
        swapped = false;
      }
    }
    ~RelaxedCaptureMode() {
      if (swapped) (void)cudaThreadExchangeStreamCaptureMode(&mode);
    }
    RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
    RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    bool swapped = true;
  };

  void refuse_in_child(const char* what) {
    TORCH_CHECK(!in_forked_child(), "allocd_torch: ", what, " in a forked child process (pid ", getpid(),
                "; allocd was set up in pid ", g_setup_pid, "): allocd's Go runtime does not survive fork().");
  }

  [[noreturn]] void fail_malloc(size_t n, c10::DeviceIndex device, cudaStream_t stream) {
    std::string msg = last_error();
    if (msg.empty()) {
      msg = "allocd: allocd_torch_malloc returned NULL for " + std::to_string(n) + " bytes on device " +
            std::to_string(int(device)) + " and left no message";
    }
    if (!mentions_out_of_memory(msg)) TORCH_CHECK(false, msg);
    std::vector<CA::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> lock(mu_);
      observers = oom_observers_;
    }
    size_t free_bytes = 0, total = 0;
    if (!observers.empty() || observed_.load(std::memory_order_relaxed)) {
      if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) (void)cudaGetLastError();
    }
    if (observed_.load(std::memory_order_relaxed)) {
      record(CDA::TraceEntry::OOM, free_bytes, n, device, stream, nullptr);
    }
    if (!observers.empty()) {
      long long v[kDeviceStats] = {};
      size_t allocated = 0;
      if (g_lib.device_stats(device, v, kDeviceStats) == kDeviceStats) allocated = static_cast<size_t>(v[4 * 12]);
      for (const auto& obs : observers) obs(device, allocated, total, free_bytes);
    }
    TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
  }

  // observe records an alloc or a free for history and trace trackers (off the hot path:
  // only when one of them is on).
  void observe(CDA::TraceEntry::Action action, void* ptr, size_t n, c10::DeviceIndex device, cudaStream_t stream) {
    std::shared_ptr<c10::GatheredContext> ctx;
    CA::CreateContextFn recorder = nullptr;
    CA::RecordContext when = CA::RecordContext::NEVER;
    {
      std::lock_guard<std::mutex> lock(mu_);
      recorder = recorder_;
      when = when_;
    }
    // The recorder may take the GIL (Python frames): never under our lock.
    bool want = action == CDA::TraceEntry::ALLOC ? when >= CA::RecordContext::STATE : when == CA::RecordContext::ALL;
    if (recorder != nullptr && want) ctx = recorder();
    std::lock_guard<std::mutex> lock(mu_);
    if (action == CDA::TraceEntry::ALLOC) {
      live_[ptr] = Live{history_.load(std::memory_order_relaxed) ? ctx : nullptr, n, device, stream};
      auto trace_ctx = when >= CA::RecordContext::ALLOC ? ctx : nullptr;
      record_locked(action, reinterpret_cast<uintptr_t>(ptr), n, device, stream, std::move(trace_ctx));
    } else {
      // The free gets the size, device and stream of the alloc, when it was seen.
      auto it = live_.find(ptr);
      if (it != live_.end()) {
        n = it->second.size;
        device = it->second.device;
        stream = it->second.stream;
        live_.erase(it);
      }
      record_locked(action, reinterpret_cast<uintptr_t>(ptr), n, device, stream, std::move(ctx));
    }
  }

  void record(CDA::TraceEntry::Action action, size_t addr, size_t n, c10::DeviceIndex device, cudaStream_t stream,
              std::shared_ptr<c10::GatheredContext> ctx) {
    std::lock_guard<std::mutex> lock(mu_);
    record_locked(action, addr, n, device, stream, std::move(ctx));
  }

  void record_locked(CDA::TraceEntry::Action action, size_t addr, size_t n, c10::DeviceIndex device,
                     cudaStream_t stream, std::shared_ptr<c10::GatheredContext> ctx) {
    CDA::TraceEntry te(action, std::max<c10::DeviceIndex>(device, 0), addr, n, stream, {0, 0}, 0, std::move(ctx));
    te.time_.t_ = now_us();
    for (const auto& t : trackers_) t(te);
    if (!history_.load(std::memory_order_relaxed) || skip_.count(static_cast<int>(action)) != 0) return;
    size_t d = static_cast<size_t>(std::max<c10::DeviceIndex>(device, 0));
    if (traces_.size() <= d) traces_.resize(d + 1);
    auto& ring = traces_[d];
    ring.push_back(std::move(te));
    while (ring.size() > max_entries_) ring.pop_front();
  }

  void update_observed() { observed_.store(history_.load() || !trackers_.empty(), std::memory_order_relaxed); }

  std::vector<long long> snapshot_values(bool traces) {
    std::vector<long long> buf(4096);
    for (int tries = 0; tries < 8; tries++) {
      long long n = g_lib.snapshot_flat(traces ? 1 : 0, buf.data(), buf.size());
      TORCH_CHECK(n >= 0, "allocd: snapshot failed: ", last_error());
      if (static_cast<size_t>(n) <= buf.size()) {
        buf.resize(static_cast<size_t>(n));
        return buf;
      }
      buf.resize(static_cast<size_t>(n) + static_cast<size_t>(n) / 4);  // it may grow meanwhile
    }
    TORCH_CHECK(false, "allocd: snapshot: the allocator's state kept growing while it was read");
  }

  // decode_snapshot turns allocd_snapshot_flat's values into torch's structures, with the
  // contexts of live blocks, and merges this file's alloc/free trace with allocd's other
  // entries. A private pool's id (only) keeps that pool's segments alone.
  void decode_snapshot(const std::vector<long long>& v, bool include_traces, c10::MempoolId_t only,
                       CA::SnapshotInfo* info) {
    auto need = [&](size_t pos, size_t k) {
      TORCH_CHECK(pos + k <= v.size(), "allocd: snapshot: truncated data from liballocd.so (", v.size(), " values)");
    };
    std::lock_guard<std::mutex> lock(mu_);
    size_t pos = walk_segments(v, [&](const FlatSegment& sg) {
      if (!pool_is_default(only) && sg.pool() != only) return;
      const long long* f = sg.f;
      CDA::SegmentInfo s;
      s.device = static_cast<c10::DeviceIndex>(f[0]);
      s.address = static_cast<size_t>(f[1]);
      s.total_size = static_cast<size_t>(f[2]);
      s.requested_size = static_cast<size_t>(f[3]);
      s.allocated_size = static_cast<size_t>(f[4]);
      s.active_size = static_cast<size_t>(f[5]);
      s.stream = reinterpret_cast<void*>(static_cast<uintptr_t>(f[6]));
      s.is_large = f[7] != 0;
      s.is_expandable = f[8] != 0;
      s.owner_private_pool_id = sg.pool();
      s.blocks.reserve(static_cast<size_t>(sg.nblocks));
      for (long long j = 0; j < sg.nblocks; j++) {
        const long long* bf = sg.blocks + j * kBlockFields;
        CDA::BlockInfo b;
        void* addr = reinterpret_cast<void*>(static_cast<uintptr_t>(bf[0]));
        b.size = static_cast<size_t>(bf[1]);
        b.requested_size = static_cast<size_t>(bf[2]);
        b.allocated = bf[3] == kActiveAllocated;
        b.active = bf[3] != 0;
        if (b.allocated) {
          auto it = live_.find(addr);
          if (it != live_.end()) b.context_when_allocated = it->second.ctx;
        }
        s.blocks.push_back(std::move(b));
      }
      info->segments.push_back(std::move(s));
    });
    long long ntraces = v[2];
    if (!include_traces) return;
    for (long long d = 0; d < ntraces; d++) {
      need(pos, 1);
      long long ne = v[pos++];
      need(pos, static_cast<size_t>(std::max(ne, 0LL)) * kEntryFields);
      std::vector<CDA::TraceEntry> merged;
      const std::deque<CDA::TraceEntry>* mine = static_cast<size_t>(d) < traces_.size() ? &traces_[d] : nullptr;
      auto m = mine ? mine->begin() : std::deque<CDA::TraceEntry>::const_iterator();
      for (long long k = 0; k < ne; k++, pos += kEntryFields) {
        auto action = static_cast<CDA::TraceEntry::Action>(v[pos]);
        // alloc and free_requested are this file's, with their contexts.
        if (action == CDA::TraceEntry::ALLOC || action == CDA::TraceEntry::FREE_REQUESTED) continue;
        if (skip_.count(static_cast<int>(action)) != 0) continue;
        int64_t t = v[pos + 4];
        // Within one microsecond, entries go in the order of cause: a segment is allocated
        // or mapped, then a block in it, which is freed (requested, then completed), then
        // the segment unmapped or freed.
        for (; mine && m != mine->end() &&
               (m->time_.t_ < t || (m->time_.t_ == t && cause_rank(m->action_) < cause_rank(action)));
             ++m) {
          merged.push_back(*m);
        }
        CDA::TraceEntry te(action, static_cast<c10::DeviceIndex>(d), static_cast<size_t>(v[pos + 1]),
                           static_cast<size_t>(v[pos + 2]), reinterpret_cast<void*>(static_cast<uintptr_t>(v[pos + 3])),
                           {0, 0}, 0);
        te.time_.t_ = t;
        merged.push_back(std::move(te));
      }
      for (; mine && m != mine->end(); ++m) merged.push_back(*m);
      info->device_traces.push_back(std::move(merged));
    }
    // Devices this file recorded on but allocd reported no trace for.
    for (size_t d = static_cast<size_t>(std::max(ntraces, 0LL)); d < traces_.size(); d++) {
      info->device_traces.emplace_back(traces_[d].begin(), traces_[d].end());
    }
  }

  std::atomic<bool> initialized_{false};
  // observed_: history is on or a trace tracker is attached: allocs and frees are recorded.
  std::atomic<bool> observed_{false};
  std::atomic<bool> history_{false};
  std::mutex mu_;  // guards everything below
  CA::CreateContextFn recorder_ = nullptr;
  CA::RecordContext when_ = CA::RecordContext::NEVER;
  size_t max_entries_ = 1;
  std::unordered_set<int> skip_;
  std::vector<std::deque<CDA::TraceEntry>> traces_;  // per device
  // Live blocks allocated while observed_ was on: their alloc's context (kept only under
  // history), size, device and stream, for the free's entry and the snapshot's blocks.
  struct Live {
    std::shared_ptr<c10::GatheredContext> ctx;
    size_t size;
    c10::DeviceIndex device;
    cudaStream_t stream;
  };
  std::unordered_map<void*, Live> live_;
  std::vector<CA::OutOfMemoryObserver> oom_observers_;
  std::vector<CA::AllocatorTraceTracker> trackers_;
  // capturing_ counts the captures under way on every device, for malloc's one relaxed load;
  // captures_ holds them per device, in the order they began.
  std::atomic<int> capturing_{0};
  std::mutex pools_mu_;  // guards captures_
  std::vector<std::vector<Capture>> captures_;
};

std::shared_ptr<AllocdAllocator> g_allocator;

void raw_delete_fn(void* ptr) {
  if (g_allocator) g_allocator->free(ptr);
}

}  // namespace allocd_torch

extern "C" {

// allocd_alloc_setup stores liballocd.so's functions (n of them, in the order of
// allocd_torch::Lib), allocd's configuration string for snapshots and whether it uses
// expandable segments; flags bit 0 is the test switch that ignores record_stream. It must run
// before allocd_alloc_install. Returns 0, or -1 when the count is wrong, a pointer is missing,
// or pthread_atfork failed.
int allocd_alloc_setup(void** fns, int n, const char* settings, int expandable, int flags) {
  using allocd_torch::g_lib;
  if (n != allocd_torch::kLibFunctions || fns == nullptr) return -1;
  for (int i = 0; i < n; i++) {
    if (fns[i] == nullptr) return -1;
  }
  static_assert(sizeof(allocd_torch::Lib) == allocd_torch::kLibFunctions * sizeof(void*), "Lib holds pointers only");
  std::memcpy(&g_lib, fns, sizeof g_lib);
  allocd_torch::g_settings = settings ? settings : "";
  allocd_torch::g_expandable = expandable != 0;
  allocd_torch::g_ignore_record_stream = (flags & 1) != 0;
  allocd_torch::g_setup_pid = getpid();
  if (!allocd_torch::g_atfork_registered.exchange(true)) {
    if (pthread_atfork(nullptr, nullptr, allocd_torch::mark_forked_child) != 0) return -1;
  }
  return 0;
}

// allocd_alloc_install makes allocd torch's CUDA allocator (changeCurrentAllocator, which
// refuses once the current one is initialised). Returns 0, or -1 with the reason in err.
int allocd_alloc_install(char* err, size_t n) {
  try {
    if (allocd_torch::g_lib.malloc == nullptr) {
      allocd_torch::copy_out("allocd_alloc_setup did not run", err, n);
      return -1;
    }
    auto a = std::make_shared<allocd_torch::AllocdAllocator>();
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
    allocd_torch::g_allocator = a;
    return 0;
  } catch (const std::exception& e) {
    allocd_torch::copy_out(e.what(), err, n);
    return -1;
  }
}

// allocd_alloc_state copies the current CUDA allocator's name ("native", "cudaMallocAsync",
// "pluggable", "allocd") into name and returns 1 when it is initialised (then it cannot be
// swapped any more), 0 when not, -1 on error (the message in name).
int allocd_alloc_state(char* name, size_t n) {
  try {
    c10::cuda::CUDACachingAllocator::CUDAAllocator* a = c10::cuda::CUDACachingAllocator::get();
    if (a == nullptr) {
      allocd_torch::copy_out("", name, n);
      return 0;
    }
    allocd_torch::copy_out(a->name(), name, n);
    return a->initialized() ? 1 : 0;
  } catch (const std::exception& e) {
    allocd_torch::copy_out(e.what(), name, n);
    return -1;
  }
}

}  // extern "C"
