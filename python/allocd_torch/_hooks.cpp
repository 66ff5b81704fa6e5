// allocd's glue into PyTorch's CUDAPluggableAllocator, compiled by allocd_torch at the first
// enable() against the installed torch and cached.
//
// Why a C++ file at all: torch's Python binding takes only the malloc and free function
// pointers (torch._C._cuda_customAllocator); set_record_stream_fn, set_reset_fn and
// set_memory_fraction_fn exist only in C++. And torch does not check the pluggable malloc's
// result: a NULL return becomes a tensor whose data_ptr() is 0. So the malloc handed to torch
// is allocd_hooks_malloc below, which turns allocd's NULL into c10::OutOfMemoryError (Python
// sees torch.OutOfMemoryError) carrying allocd's message.
//
// Fork: liballocd.so runs a Go runtime, which does not survive fork(). A DataLoader worker is
// a forked child that may still drop (free) CUDA tensors it inherited, so after a fork the free
// and the stream/cache hooks do nothing, and malloc throws a clear error instead of calling Go.
// The check is one relaxed atomic load, set by a pthread_atfork child handler.

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstddef>
#include <cstring>
#include <exception>
#include <memory>
#include <string>

namespace {

using MallocFn = void* (*)(size_t, int, cudaStream_t);
using FreeFn = void (*)(void*, size_t, int, cudaStream_t);
using RecordStreamFn = void (*)(void*, cudaStream_t);
using EmptyCacheFn = void (*)();
using FractionFn = void (*)(double, int);
using LastErrorFn = size_t (*)(char*, size_t);

// liballocd.so's functions, passed in by allocd_hooks_setup before torch can call us.
MallocFn g_malloc = nullptr;
FreeFn g_free = nullptr;
RecordStreamFn g_record_stream = nullptr;
EmptyCacheFn g_empty_cache = nullptr;
FractionFn g_fraction = nullptr;
LastErrorFn g_last_error = nullptr;

pid_t g_setup_pid = 0;
std::atomic<bool> g_forked{false};
std::atomic<bool> g_atfork_registered{false};

void mark_forked_child() { g_forked.store(true, std::memory_order_relaxed); }

inline bool in_forked_child() { return g_forked.load(std::memory_order_relaxed); }

std::string allocd_error() {
  if (g_last_error == nullptr) return std::string();
  std::string s(2048, '\0');
  size_t n = g_last_error(&s[0], s.size());
  if (n >= s.size()) {
    s.assign(n + 1, '\0');
    n = std::min(g_last_error(&s[0], s.size()), s.size() - 1);
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

}  // namespace

extern "C" {

// allocd_hooks_setup stores liballocd.so's functions; it must run before torch gets
// allocd_hooks_malloc. Returns 0, or -1 when a pointer is missing.
int allocd_hooks_setup(void* malloc_fn, void* free_fn, void* record_stream_fn, void* empty_cache_fn,
                       void* fraction_fn, void* last_error_fn) {
  if (!malloc_fn || !free_fn || !record_stream_fn || !empty_cache_fn || !fraction_fn || !last_error_fn) {
    return -1;
  }
  g_malloc = reinterpret_cast<MallocFn>(malloc_fn);
  g_free = reinterpret_cast<FreeFn>(free_fn);
  g_record_stream = reinterpret_cast<RecordStreamFn>(record_stream_fn);
  g_empty_cache = reinterpret_cast<EmptyCacheFn>(empty_cache_fn);
  g_fraction = reinterpret_cast<FractionFn>(fraction_fn);
  g_last_error = reinterpret_cast<LastErrorFn>(last_error_fn);
  g_setup_pid = getpid();
  if (!g_atfork_registered.exchange(true)) {
    if (pthread_atfork(nullptr, nullptr, mark_forked_child) != 0) return -1;
  }
  return 0;
}

// The malloc torch calls (torch/csrc/cuda/CUDAPluggableAllocator.h's signature).
void* allocd_hooks_malloc(size_t size, int device, cudaStream_t stream) {
  if (in_forked_child()) {
    TORCH_CHECK(false, "allocd_torch: CUDA memory requested in a forked child process (pid ", getpid(),
                "; allocd was set up in pid ", g_setup_pid,
                "). allocd's Go runtime does not survive fork(), and CUDA cannot be used after fork "
                "anyway: start processes that use CUDA with the 'spawn' method.");
  }
  void* p = g_malloc(size, device, stream);
  if (p == nullptr && size > 0) {
    std::string msg = allocd_error();
    if (msg.empty()) {
      msg = "allocd: allocd_torch_malloc returned NULL for " + std::to_string(size) + " bytes on device " +
            std::to_string(device) + " and left no message";
    }
    if (mentions_out_of_memory(msg)) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
    }
    TORCH_CHECK(false, msg);
  }
  return p;
}

// The free torch calls. A no-op in a forked child: the memory belongs to the parent.
void allocd_hooks_free(void* ptr, size_t size, int device, cudaStream_t stream) {
  if (in_forked_child()) return;
  g_free(ptr, size, device, stream);
}

// allocd_hooks_attach installs the record_stream (flags bit 0), reset = empty_cache (bit 1)
// and memory-fraction (bit 2) functions on the current allocator, which must be the
// CUDAPluggableAllocator made from allocd_hooks_malloc/free. Returns 0, or -1 with the
// reason in err.
int allocd_hooks_attach(int flags, char* err, size_t n) {
  try {
    auto current = torch::cuda::CUDAPluggableAllocator::getCurrentAllocator();
    auto pluggable =
        std::dynamic_pointer_cast<torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator>(current);
    if (!pluggable) {
      copy_out("the current CUDA allocator is not a CUDAPluggableAllocator (change_current_allocator "
               "did not take effect)",
               err, n);
      return -1;
    }
    if (flags & 1) {
      pluggable->set_record_stream_fn([](void* ptr, cudaStream_t stream) {
        if (!in_forked_child()) g_record_stream(ptr, stream);
      });
    }
    if (flags & 2) {
      pluggable->set_reset_fn([] {
        if (!in_forked_child()) g_empty_cache();
      });
    }
    if (flags & 4) {
      pluggable->set_memory_fraction_fn([](double fraction, int device) {
        if (!in_forked_child()) g_fraction(fraction, device);
      });
    }
    return 0;
  } catch (const std::exception& e) {
    copy_out(e.what(), err, n);
    return -1;
  }
}

// allocd_hooks_allocator_state copies the current CUDA allocator's name ("native",
// "cudaMallocAsync", "pluggable") into name and returns 1 when it is initialised (then it
// cannot be swapped any more), 0 when not, -1 on error (the message in name).
int allocd_hooks_allocator_state(char* name, size_t n) {
  try {
    c10::cuda::CUDACachingAllocator::CUDAAllocator* a = c10::cuda::CUDACachingAllocator::get();
    if (a == nullptr) {
      copy_out("", name, n);
      return 0;
    }
    copy_out(a->name(), name, n);
    return a->initialized() ? 1 : 0;
  } catch (const std::exception& e) {
    copy_out(e.what(), name, n);
    return -1;
  }
}

}  // extern "C"
