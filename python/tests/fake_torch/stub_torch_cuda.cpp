// A stand-in for libtorch_cuda.so, built against the stub headers of ../hooks_stub/include:
// torch's current-allocator globals, and entry points through which test_enable_fake_torch.py
// plays torch (allocating through the malloc handed to change_current_allocator, calling the
// hooks the way torch's recordStream / emptyCache / setMemoryFraction do).
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <string>

namespace CA = c10::cuda::CUDACachingAllocator;
namespace PA = torch::cuda::CUDAPluggableAllocator;

namespace {
struct Native : CA::CUDAAllocator {
  bool initialized() override { return false; }
  std::string name() override { return "native"; }
};
Native native;
std::shared_ptr<CA::CUDAAllocator> current;
using MallocFn = void* (*)(size_t, int, cudaStream_t);
using FreeFn = void (*)(void*, size_t, int, cudaStream_t);
MallocFn malloc_fn = nullptr;
FreeFn free_fn = nullptr;
PA::CUDAPluggableAllocator* pluggable() { return dynamic_cast<PA::CUDAPluggableAllocator*>(current.get()); }
}  // namespace

std::atomic<CA::CUDAAllocator*> CA::allocator{&native};
std::shared_ptr<CA::CUDAAllocator> PA::getCurrentAllocator() { return current; }

extern "C" {
void stub_change_current(void* m, void* f) {
  auto p = std::make_shared<PA::CUDAPluggableAllocator>();
  current = p;
  CA::allocator.store(p.get());
  malloc_fn = reinterpret_cast<MallocFn>(m);
  free_fn = reinterpret_cast<FreeFn>(f);
}
// Returns the pointer, or 0 when the malloc threw (the message is then in err).
void* stub_malloc(size_t n, char* err, size_t errn) {
  try {
    return malloc_fn(n, 0, nullptr);
  } catch (const std::exception& e) {
    std::string s = std::string(dynamic_cast<const c10::OutOfMemoryError*>(&e) ? "OutOfMemoryError: " : "Error: ") +
                    e.what();
    s.copy(err, errn - 1);
    err[std::min(s.size(), errn - 1)] = '\0';
    return nullptr;
  }
}
void stub_free(void* p, size_t n) { free_fn(p, n, 0, nullptr); }
// Bit 0: record_stream hook installed; 1: reset; 2: memory fraction.
int stub_hooks() {
  auto* p = pluggable();
  if (p == nullptr) return -1;
  return (p->record_stream_fn_ ? 1 : 0) | (p->reset_fn_ ? 2 : 0) | (p->memory_fraction_fn_ ? 4 : 0);
}
void stub_record_stream(void* ptr) { pluggable()->record_stream_fn_(ptr, nullptr); }
void stub_empty_cache() { pluggable()->reset_fn_(); }
}
