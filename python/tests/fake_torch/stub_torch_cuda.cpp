// A stand-in for libtorch_cuda.so, built against the stub headers of ../hooks_stub/include
// together with ../hooks_stub/fake_runtime.cpp (torch's current-allocator global with a
// "native" default, changeCurrentAllocator, CUDAPluggableAllocator, the device, stream and
// cuda* fakes that allocd_torch's _allocator.so links against). The extern "C" entry points
// below let test_enable_fake_torch.py play torch: each calls the current allocator
// (c10::cuda::CUDACachingAllocator::get()) the way torch's own code does, and returns 0, or -1
// with the exception's type and message in err.
#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace CA = c10::cuda::CUDACachingAllocator;
namespace CDA = c10::CachingDeviceAllocator;
namespace PA = torch::cuda::CUDAPluggableAllocator;

namespace fake_cuda {
extern c10::StreamId current_stream;  // ../hooks_stub/fake_runtime.cpp
}

namespace {

std::unordered_map<void*, c10::DataPtr> live;  // the "tensors": DataPtrs by address

void copy_out(const std::string& s, char* buf, size_t n) {
  if (buf == nullptr || n == 0) return;
  size_t k = std::min(s.size(), n - 1);
  s.copy(buf, k);
  buf[k] = '\0';
}

// guarded runs f, turning an exception into -1 and "OutOfMemoryError: <message>" (or
// "Error: ...") in err.
template <typename F>
int guarded(char* err, size_t n, F f) {
  try {
    f();
    return 0;
  } catch (const c10::OutOfMemoryError& e) {
    copy_out(std::string("OutOfMemoryError: ") + e.what(), err, n);
  } catch (const std::exception& e) {
    copy_out(std::string("Error: ") + e.what(), err, n);
  }
  return -1;
}

struct Frames : c10::GatheredContext {};  // what torch's context recorder would gather
std::shared_ptr<c10::GatheredContext> gather() { return std::make_shared<Frames>(); }

}  // namespace

extern "C" {

// The current allocator's name ("native", "pluggable", "allocd").
void stub_current_name(char* buf, size_t n) { copy_out(CA::get()->name(), buf, n); }

// Initialises the current allocator, as torch's first CUDA allocation does.
void stub_init_current() { CA::get()->init(1); }

// torch.cuda.memory.change_current_allocator(CUDAPluggableAllocator(alloc_fn, free_fn)).
int stub_change_current(void* alloc_fn, void* free_fn, char* err, size_t n) {
  return guarded(err, n, [&] {
    auto a = PA::createCustomAllocator(reinterpret_cast<void* (*)(size_t, int, cudaStream_t)>(alloc_fn),
                                       reinterpret_cast<void (*)(void*, size_t, int, cudaStream_t)>(free_fn));
    PA::changeCurrentAllocator(a);
  });
}

// A tensor of n bytes: get()->allocate(n), kept until stub_drop. *ptr is its address.
int stub_alloc(size_t nbytes, void** ptr, char* err, size_t n) {
  return guarded(err, n, [&] {
    c10::DataPtr d = CA::get()->allocate(nbytes);
    *ptr = d.get();
    live[d.get()] = std::move(d);
  });
}

// Drops the tensor at p (its DataPtr's deleter frees it). Returns 0, or -1 when none is there.
int stub_drop(void* p) { return live.erase(p) == 1 ? 0 : -1; }

// x.record_stream(s) for the tensor at p and the stream whose cudaStream_t is stream.
int stub_record_stream(void* p, long long stream, char* err, size_t n) {
  return guarded(err, n, [&] {
    c10::cuda::CUDAStream s(c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::CUDA, 0), stream));
    CA::get()->recordStream(live.at(p), s);
  });
}

// torch.cuda.empty_cache().
int stub_empty_cache(char* err, size_t n) {
  return guarded(err, n, [&] { CA::get()->emptyCache({0, 0}); });
}

// torch.cuda.memory_stats(device)'s source: getDeviceStats, written to out (122 values) in
// DeviceStats' order: 9 stat arrays x 3 pools x (current, peak, allocated, freed), the two
// oversize stats, num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc,
// num_device_free, max_split_size.
int stub_device_stats(int device, long long* out, char* err, size_t n) {
  return guarded(err, n, [&] {
    CDA::DeviceStats st = CA::get()->getDeviceStats(static_cast<c10::DeviceIndex>(device));
    auto stat = [&out](const c10::CachingAllocator::Stat& s) {
      *out++ = s.current;
      *out++ = s.peak;
      *out++ = s.allocated;
      *out++ = s.freed;
    };
    for (const auto* arr : {&st.allocation, &st.segment, &st.active, &st.inactive_split, &st.allocated_bytes,
                            &st.reserved_bytes, &st.active_bytes, &st.inactive_split_bytes, &st.requested_bytes}) {
      for (const auto& s : *arr) stat(s);
    }
    stat(st.oversize_allocations);
    stat(st.oversize_segments);
    for (long long v : {st.num_alloc_retries, st.num_ooms, st.num_sync_all_streams, st.num_device_alloc,
                        st.num_device_free, st.max_split_size}) {
      *out++ = v;
    }
  });
}

// torch.cuda.memory._record_memory_history(enabled, context="all"), with a context recorder.
int stub_record_history(int enabled, char* err, size_t n) {
  return guarded(err, n, [&] {
    CA::get()->recordHistory(enabled != 0, &gather, 1000, CA::RecordContext::ALL, false, {});
  });
}

// torch.cuda.memory._snapshot() seen from the tensor at p: out gets [number of segments, the
// size of the block at p (-1: none), whether it is allocated, whether it has its alloc's context,
// the total size of its segment, the trace's alloc entries at p, its segment_alloc entries, its
// entries in all].
int stub_snapshot(void* p, long long* out, char* err, size_t n) {
  return guarded(err, n, [&] {
    CA::SnapshotInfo s = CA::get()->snapshot({0, 0}, true);
    uintptr_t at = reinterpret_cast<uintptr_t>(p);
    long long r[8] = {static_cast<long long>(s.segments.size()), -1, 0, 0, 0, 0, 0, 0};
    for (const auto& sg : s.segments) {
      uintptr_t a = sg.address;
      for (const auto& b : sg.blocks) {
        if (a == at) {
          r[1] = static_cast<long long>(b.size);
          r[2] = b.allocated;
          r[3] = b.context_when_allocated != nullptr;
          r[4] = static_cast<long long>(sg.total_size);
        }
        a += b.size;
      }
    }
    for (const auto& tr : s.device_traces) {
      for (const auto& e : tr) {
        r[5] += e.action_ == CDA::TraceEntry::ALLOC && e.addr_ == at;
        r[6] += e.action_ == CDA::TraceEntry::SEGMENT_ALLOC;
        r[7]++;
      }
    }
    std::copy(r, r + 8, out);
  });
}

// The current stream (torch.cuda.stream(s)): its cudaStream_t is stream.
void stub_set_stream(long long stream) { fake_cuda::current_stream = stream; }

// torch's pool calls, with the pool (id0, id1) of device 0. begin is CUDAGraph::capture_begin's
// beginAllocateToPool, with a filter that takes the stream whose cudaStream_t is stream (-1:
// every stream, as use_mem_pool's filter on its thread); create is torch.cuda.MemPool's
// createOrIncrefPool; empty is emptyCache(pool), as a MemPool's destructor calls it.
int stub_begin_pool(unsigned long long id0, unsigned long long id1, long long stream, char* err, size_t n) {
  return guarded(err, n, [&] {
    CA::get()->beginAllocateToPool(0, {id0, id1}, [stream](cudaStream_t s) {
      return stream == -1 || reinterpret_cast<uintptr_t>(s) == static_cast<uintptr_t>(stream);
    });
  });
}
int stub_end_pool(unsigned long long id0, unsigned long long id1, char* err, size_t n) {
  return guarded(err, n, [&] { CA::get()->endAllocateToPool(0, {id0, id1}); });
}
int stub_release_pool(unsigned long long id0, unsigned long long id1, char* err, size_t n) {
  return guarded(err, n, [&] { CA::get()->releasePool(0, {id0, id1}); });
}
int stub_create_pool(unsigned long long id0, unsigned long long id1, char* err, size_t n) {
  return guarded(err, n, [&] { CA::get()->createOrIncrefPool(0, {id0, id1}, nullptr); });
}
int stub_empty_pool(unsigned long long id0, unsigned long long id1, char* err, size_t n) {
  return guarded(err, n, [&] { CA::get()->emptyCache({id0, id1}); });
}
int stub_pool_use_count(unsigned long long id0, unsigned long long id1, int* out, char* err, size_t n) {
  return guarded(err, n, [&] { *out = CA::get()->getPoolUseCount(0, {id0, id1}); });
}

// torch.cuda.memory._snapshot(pool) seen from the tensor at p: out gets [the number of segments
// of the pool's snapshot, how many of them name the pool as their owner, whether one holds p,
// the number of segments of the whole snapshot that name the pool].
int stub_pool_snapshot(unsigned long long id0, unsigned long long id1, void* p, long long* out, char* err, size_t n) {
  return guarded(err, n, [&] {
    c10::MempoolId_t id{id0, id1};
    CA::SnapshotInfo s = CA::get()->snapshot(id, false);
    long long r[4] = {static_cast<long long>(s.segments.size()), 0, 0, 0};
    uintptr_t at = reinterpret_cast<uintptr_t>(p);
    for (const auto& sg : s.segments) {
      r[1] += sg.owner_private_pool_id == id;
      r[2] += at >= sg.address && at < sg.address + sg.total_size;
    }
    for (const auto& sg : CA::get()->snapshot({0, 0}, false).segments) r[3] += sg.owner_private_pool_id == id;
    std::copy(r, r + 4, out);
  });
}

// torch.compile's CUDA graph trees: getCheckpointState of the pool (id0, id1) of device 0, kept
// here; *index is its place.
std::vector<std::shared_ptr<CA::AllocatorState>> states;
int stub_checkpoint(unsigned long long id0, unsigned long long id1, int* index, char* err, size_t n) {
  return guarded(err, n, [&] {
    states.push_back(CA::get()->getCheckpointState(0, {id0, id1}));
    *index = static_cast<int>(states.size()) - 1;
  });
}

// setCheckpointPoolState with the checkpoint at index, and what torch's binding does with the
// delta: the "tensors" whose blocks were freed lose their deleters (torch swaps them out), and
// the blocks allocated again become the live tensors at their addresses. out gets the numbers of
// blocks freed and allocated.
int stub_restore(int index, long long* out, char* err, size_t n) {
  return guarded(err, n, [&] {
    CA::CheckpointDelta d = CA::get()->setCheckpointPoolState(0, states.at(static_cast<size_t>(index)));
    out[0] = static_cast<long long>(d.ptrs_freed.size());
    out[1] = static_cast<long long>(d.dataptrs_allocd.size());
    for (void* p : d.ptrs_freed) {
      auto it = live.find(p);
      if (it != live.end()) {
        it->second.release_context();
        live.erase(it);
      }
    }
    for (auto& dp : d.dataptrs_allocd) {
      void* p = dp.get();
      live[p] = std::move(dp);
    }
  });
}

// The checkpoint at index dies (the graph tree's node goes).
void stub_drop_checkpoint(int index) { states.at(static_cast<size_t>(index)).reset(); }

}  // extern "C"
