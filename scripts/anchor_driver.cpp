// The anchor's replay loop (anchor_ext.cpp, replay_passes) with the allocator
// left out, as allocd's DriverCost leaves its own out: each allocation stores a
// made-up address in ptr[id], each free of a set address loads and clears it.
// An empty asm statement that clobbers memory stands where the loop calls
// raw_alloc and raw_delete, so that the compiler keeps the stores and reloads
// what an opaque call would make it reload, and the loop is not vectorised
// away. The operations are read through their two strides, as the anchor's
// tensor accessor reads them.
//
// It is a plain C library, without torch's headers, so that it compiles in a
// second: scripts/paired_replays.py builds it with `c++ -O2 -shared -fPIC`
// after its paired rounds, loads it with ctypes and subtracts nothing with
// it: it prints each side's driver beside the replays.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>
using clk = std::chrono::steady_clock;

// replay_driver returns the fastest of passes passes over the n operations
// at ops (int64 rows of (op 0=alloc 1=free, id, size), row i's column j at
// ops[i*s0 + j*s1]), in ns per operation.
extern "C" double replay_driver(const int64_t* ops, int64_t n, int64_t s0, int64_t s1, int64_t passes) {
  auto at = [&](int64_t i, int64_t j) { return ops[i * s0 + j * s1]; };
  int64_t maxid = 0;
  for (int64_t i = 0; i < n; i++) maxid = std::max(maxid, at(i, 1));
  std::vector<void*> ptr(maxid + 1, nullptr);
  double best = 1e300;
  for (int64_t pass = 0; pass < passes; pass++) {
    std::fill(ptr.begin(), ptr.end(), nullptr);
    auto t0 = clk::now();
    for (int64_t i = 0; i < n; i++) {
      int64_t id = at(i, 1);
      if (at(i, 0) == 0) {
        ptr[id] = reinterpret_cast<void*>(static_cast<uintptr_t>(i + 1) << 9);
        asm volatile("" ::: "memory");
      } else if (ptr[id]) {
        void* p = ptr[id];
        asm volatile("" : : "r"(p) : "memory");
        ptr[id] = nullptr;
      }
    }
    best = std::min(best, std::chrono::duration<double, std::nano>(clk::now() - t0).count());
  }
  return n ? best / n : 0;
}
