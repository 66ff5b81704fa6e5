// torch_cpp_alloc_bench.cpp: what one allocation through torch's current CUDA allocator
// costs in C++, with no Python in the loop. scripts/torch_cpp_alloc_bench.py compiles it
// against the installed torch, loads it with ctypes after choosing the allocator and
// initialising CUDA, and calls:
//
//   double bench_size(size_t n, long iters)
//       1000 warm-up iterations, then `iters` timed ones of
//       { c10::DataPtr p = c10::cuda::CUDACachingAllocator::get()->allocate(n); }
//       (allocated and dropped at once: one malloc + one free, a cache hit after warm-up);
//       returns ns per iteration.
//   double bench_window(long iters, unsigned seed)
//       64 live blocks of mixed sizes (512 B to 64 MiB, most of them small); each iteration
//       replaces one block, chosen by a PRNG, with a new allocation of the next size: one
//       free + one malloc among blocks that live for different lengths of time. The sizes and
//       slots are a fixed sequence drawn from `seed` before timing, and one full pass over it
//       warms the cache first; returns ns per iteration.
//   int bench_allocator_name(char* buf, size_t n)
//       the current allocator's name() ("native" for torch's own), so the caller can check
//       which allocator it measured.
//   int bench_last_error(char* buf, size_t n)
//       the message of the last exception (the bench functions return -1 on one).
//
// Both benches allocate on the current device and stream, as torch.empty does.

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace {

std::string last_error;

int copy_out(const std::string& s, char* buf, size_t n) {
  if (buf == nullptr || n == 0) return static_cast<int>(s.size());
  size_t k = s.size() < n - 1 ? s.size() : n - 1;
  std::memcpy(buf, s.data(), k);
  buf[k] = '\0';
  return static_cast<int>(s.size());
}

struct XorShift32 {
  uint32_t s;
  explicit XorShift32(uint32_t seed) : s(seed ? seed : 0x9e3779b9u) {}
  uint32_t next() {
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    return s;
  }
};

// The window's sizes and their weights (out of 100): mostly small blocks, as in real
// programs (activations' scalars, indices, small bias and norm tensors), a few large ones.
// Some sizes are not powers of two, so they round differently in each allocator.
constexpr size_t kSizes[] = {512,       1536,      4096,           12 << 10,       64 << 10,       200 << 10,
                             1 << 20,   3 << 20,   (8 << 20) - 4096, 8 << 20,      24 << 20,       64 << 20};
constexpr unsigned kWeights[] = {22, 14, 16, 8, 10, 7, 7, 5, 4, 3, 2, 2};
constexpr int kSizeCount = sizeof(kSizes) / sizeof(kSizes[0]);
static_assert(sizeof(kWeights) / sizeof(kWeights[0]) == kSizeCount, "one weight per size");

constexpr int kWindow = 64;
constexpr size_t kSeqLen = 4096;  // a power of two

size_t pick_size(XorShift32& rng) {
  unsigned total = 0;
  for (unsigned w : kWeights) total += w;
  unsigned r = rng.next() % total;
  for (int i = 0; i < kSizeCount; i++) {
    if (r < kWeights[i]) return kSizes[i];
    r -= kWeights[i];
  }
  return kSizes[0];
}

using Clock = std::chrono::steady_clock;

double ns_per(Clock::time_point t0, Clock::time_point t1, long iters) {
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(iters);
}

}  // namespace

extern "C" {

double bench_size(size_t n, long iters) {
  try {
    if (iters <= 0) iters = 1;
    for (int i = 0; i < 1000; i++) {
      c10::DataPtr p = c10::cuda::CUDACachingAllocator::get()->allocate(n);
    }
    auto t0 = Clock::now();
    for (long i = 0; i < iters; i++) {
      c10::DataPtr p = c10::cuda::CUDACachingAllocator::get()->allocate(n);
    }
    auto t1 = Clock::now();
    return ns_per(t0, t1, iters);
  } catch (const std::exception& e) {
    last_error = e.what();
    return -1;
  }
}

double bench_window(long iters, unsigned seed) {
  try {
    if (iters <= 0) iters = 1;
    XorShift32 rng(seed);
    std::vector<c10::DataPtr> slots(kWindow);
    for (int i = 0; i < kWindow; i++) {
      slots[i] = c10::cuda::CUDACachingAllocator::get()->allocate(pick_size(rng));
    }
    // The sequence of (slot, size), drawn before timing so the PRNG is not timed.
    std::vector<size_t> sizes(kSeqLen);
    std::vector<int> slot(kSeqLen);
    for (size_t i = 0; i < kSeqLen; i++) {
      slot[i] = static_cast<int>(rng.next() % kWindow);
      sizes[i] = pick_size(rng);
    }
    for (size_t i = 0; i < kSeqLen; i++) {  // warm-up: one full pass
      slots[slot[i]] = c10::cuda::CUDACachingAllocator::get()->allocate(sizes[i]);
    }
    auto t0 = Clock::now();
    for (long i = 0; i < iters; i++) {
      size_t k = static_cast<size_t>(i) & (kSeqLen - 1);
      // The assignment drops (frees) the old block after the new one is allocated, as
      // `x = torch.empty(...)` does in Python.
      slots[slot[k]] = c10::cuda::CUDACachingAllocator::get()->allocate(sizes[k]);
    }
    auto t1 = Clock::now();
    return ns_per(t0, t1, iters);
  } catch (const std::exception& e) {
    last_error = e.what();
    return -1;
  }
}

int bench_allocator_name(char* buf, size_t n) {
  try {
    return copy_out(c10::cuda::CUDACachingAllocator::get()->name(), buf, n);
  } catch (const std::exception& e) {
    last_error = e.what();
    return -1;
  }
}

int bench_last_error(char* buf, size_t n) { return copy_out(last_error, buf, n); }

}  // extern "C"
