// Drives allocd_torch/_allocator.cpp (AllocdAllocator: torch's CUDAAllocator answered from
// liballocd.so) against the stub torch headers of include/, the fake torch and CUDA runtime of
// fake_runtime.cpp and the fake liballocd below, so that its logic is tested without torch and
// without a GPU. Prints "ok N checks" and exits 0, or names the first failed check and exits 1.
// Built by test_loader.py as one translation unit with _allocator.cpp:
//   g++ -std=c++17 -Wall -Wextra -Werror -Iinclude -DHOOKS_SOURCE="<path>/_allocator.cpp"
//       driver.cpp -o driver -lpthread
#include HOOKS_SOURCE

#include "fake_runtime.cpp"

#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace CA = c10::cuda::CUDACachingAllocator;
namespace CDA = c10::CachingDeviceAllocator;
using Action = CDA::TraceEntry::Action;

// --- the fake liballocd -------------------------------------------------------------------------
// Each allocation gets a segment of its own (its size rounded up to 2 MiB) at a distinct address;
// the calls and their arguments are recorded for the checks. With history on it keeps a trace, as
// allocd does, stamped with the current time, so that its entries interleave with the C++'s.
namespace fake {

constexpr size_t kOOM = size_t(1) << 40;  // a malloc of this or more runs out of memory
constexpr size_t kSegment = size_t(2) << 20;
constexpr size_t kNoDevice = 7, kNoMessage = 9;  // malloc sizes that fail otherwise

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }
int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A private pool's id, torch's MempoolId_t pair; {0, 0} is the general cache.
using Id = std::pair<uint64_t, uint64_t>;

struct Block {
  size_t size;
  int device;
  void* stream;
  bool expandable;
  bool recorded;  // record_stream saw it: its free stays pending
  Id pool;        // the pool it was allocated in
};
std::map<uintptr_t, Block> live, pending;
uintptr_t next_addr = 0x7f0000000000;

struct FreeCall {
  void* ptr;
  size_t size;
  int device;
  void* stream;
};
std::vector<FreeCall> frees;
struct MallocCall {
  size_t size;
  int device;
  void* stream;
};
std::vector<MallocCall> mallocs;
std::vector<std::pair<void*, void*>> records;
std::vector<std::pair<double, int>> fractions_set;
int empties = 0;
std::string err;
double fraction = 0.25;
long long largest = 0;
bool expandable = false;

long long stats_count = 122;  // what device_stats returns
bool stats_fail = false;
int stats_calls = 0, stats_device = -9;
int reset_peak_calls = 0, reset_accumulated_calls = 0, reset_device = -9;
bool reset_fail = false;

bool history = false;
long long history_max = 0;
int history_calls = 0;
struct Entry {
  long long action, addr, size, stream, time;
  int device;
};
std::vector<Entry> trace;
long long snapshot_format = 2;
int snapshot_calls = 0;

void add(Action a, uintptr_t addr, size_t size, void* stream, int device) {
  if (history) {
    trace.push_back({a, static_cast<long long>(addr), static_cast<long long>(size),
                     static_cast<long long>(reinterpret_cast<uintptr_t>(stream)), now_us(), device});
  }
}

// Private pools: each pool's users (create and begin), its captures under way (begin not yet
// ended), every pool call in order, and the mallocs routed to a pool. pool_fail makes the next
// pool calls fail with a message naming the call.
std::map<Id, int> users, capturing;
struct PoolCall {
  std::string op;
  int device;
  Id id;
};
std::vector<PoolCall> pool_calls;
bool pool_fail = false;
struct PoolMalloc {
  size_t size;
  int device;
  void* stream;
  Id id;
  cudaStreamCaptureMode mode;  // the thread's capture mode during the call
};
std::vector<PoolMalloc> pool_mallocs;

void* new_block(size_t n, int device, void* stream, Id pool) {
  uintptr_t a = next_addr;
  size_t total = round_up(n, kSegment);
  next_addr += total;
  live[a] = Block{n, device, stream, expandable, false, pool};
  add(Action::SEGMENT_ALLOC, a, total, stream, device);
  add(Action::ALLOC, a, round_up(n, 512), stream, device);
  return reinterpret_cast<void*>(a);
}

void* malloc(size_t n, int device, void* stream) {
  mallocs.push_back({n, device, stream});
  if (n >= kOOM) {
    err = "allocd: out of memory: tried to allocate " + std::to_string(n) + " bytes on device " +
          std::to_string(device) + ". " + std::string(3000, 'x') + " END";
    return nullptr;
  }
  if (n == kNoDevice) {
    err = "allocd: device 9 does not exist";
    return nullptr;
  }
  if (n == kNoMessage) {
    err.clear();
    return nullptr;
  }
  return new_block(n, device, stream, Id{0, 0});
}

int pool_call(const char* op, int device, uint64_t a, uint64_t b) {
  pool_calls.push_back({op, device, Id{a, b}});
  if (pool_fail) {
    err = std::string("allocd: ") + op + " broke";
    return -1;
  }
  return 0;
}
int create_pool(int device, uint64_t a, uint64_t b) {
  if (pool_call("create", device, a, b) != 0) return -1;
  users[Id{a, b}]++;
  return 0;
}
int release_pool(int device, uint64_t a, uint64_t b) {
  if (pool_call("release", device, a, b) != 0) return -1;
  if (users[Id{a, b}] == 0) {
    err = "allocd: release pool: it has no user: unknown memory pool";
    return -1;
  }
  users[Id{a, b}]--;
  return 0;
}
int begin_pool(int device, uint64_t a, uint64_t b) {
  if (pool_call("begin", device, a, b) != 0) return -1;
  users[Id{a, b}]++;
  capturing[Id{a, b}]++;
  return 0;
}
int end_pool(int device, uint64_t a, uint64_t b) {
  if (pool_call("end", device, a, b) != 0) return -1;
  if (capturing[Id{a, b}] == 0) {
    err = "allocd: end allocate to pool: no allocation to it is under way: unknown memory pool";
    return -1;
  }
  capturing[Id{a, b}]--;
  return 0;
}
int empty_pool_cache(int device, uint64_t a, uint64_t b) { return pool_call("empty", device, a, b); }
int pool_use_count(int device, uint64_t a, uint64_t b) {
  if (pool_call("use_count", device, a, b) != 0) return -1;
  return users[Id{a, b}];
}
// Checkpoints: by handle, the pool's allocated blocks when it was taken. restore_pool frees the
// pool's blocks and allocates the checkpoint's again; restore_half makes it fail after that.
struct Checkpoint {
  int device;
  Id id;
  std::map<uintptr_t, Block> blocks;
};
std::map<uintptr_t, Checkpoint> checkpoints;
uintptr_t next_checkpoint = 0x100;
std::vector<uintptr_t> checkpoints_freed;
bool restore_half = false;

uintptr_t checkpoint_pool(int device, uint64_t a, uint64_t b) {
  if (pool_call("checkpoint", device, a, b) != 0) return 0;
  Checkpoint c{device, Id{a, b}, {}};
  for (const auto& [addr, blk] : live) {
    if (blk.pool == c.id && blk.device == device) c.blocks[addr] = blk;
  }
  checkpoints[next_checkpoint] = c;
  return next_checkpoint++;
}
void checkpoint_free(uintptr_t h) {
  checkpoints_freed.push_back(h);
  checkpoints.erase(h);
}
long long restore_pool(int device, uintptr_t h, long long** out) {
  *out = nullptr;
  auto it = checkpoints.find(h);
  if (pool_call("restore", device, 0, 0) != 0) return -1;
  if (it == checkpoints.end()) {
    err = "allocd: restore pool: no such checkpoint";
    return -1;
  }
  std::vector<long long> freed, allocated;
  for (auto b = live.begin(); b != live.end();) {
    if (b->second.pool == it->second.id && b->second.device == device) {
      freed.push_back(static_cast<long long>(b->first));
      b = live.erase(b);
    } else {
      ++b;
    }
  }
  for (const auto& [addr, blk] : it->second.blocks) {
    live[addr] = blk;
    allocated.push_back(static_cast<long long>(addr));
  }
  std::vector<long long> v{static_cast<long long>(freed.size()), static_cast<long long>(allocated.size())};
  v.insert(v.end(), freed.begin(), freed.end());
  v.insert(v.end(), allocated.begin(), allocated.end());
  *out = static_cast<long long*>(std::malloc(v.size() * sizeof(long long)));
  std::copy(v.begin(), v.end(), *out);
  if (restore_half) {
    err = "allocd: restore pool: pool does not match the checkpoint";
    return -1;
  }
  return static_cast<long long>(v.size());
}

void* malloc_pool(size_t n, int device, void* stream, uint64_t a, uint64_t b) {
  pool_mallocs.push_back({n, device, stream, Id{a, b}, fake_cuda::capture_mode});
  if (users[Id{a, b}] == 0) {
    err = "allocd: malloc in pool: unknown memory pool";
    return nullptr;
  }
  return new_block(n, device, stream, Id{a, b});
}

void free(void* p, size_t size, int device, void* stream) {
  frees.push_back({p, size, device, stream});
  auto it = live.find(reinterpret_cast<uintptr_t>(p));
  if (it == live.end()) return;
  const Block& b = it->second;
  add(Action::FREE_REQUESTED, it->first, round_up(b.size, 512), b.stream, b.device);
  if (b.recorded) {
    pending[it->first] = b;
  } else {
    add(Action::FREE_COMPLETED, it->first, round_up(b.size, 512), b.stream, b.device);
  }
  live.erase(it);
}

void record_stream(void* p, void* stream) {
  records.push_back({p, stream});
  auto it = live.find(reinterpret_cast<uintptr_t>(p));
  if (it != live.end()) it->second.recorded = true;
}
void empty_cache() { empties++; }
void set_fraction(double f, int device) { fractions_set.push_back({f, device}); }
size_t last_error(char* buf, size_t n) {
  if (n > 0) {
    size_t k = std::min(err.size(), n - 1);
    std::memcpy(buf, err.data(), k);
    buf[k] = '\0';
  }
  return err.size();
}

// device_stats writes value i as 1000+i, so that every field can be told apart.
long long device_stats(int device, long long* buf, size_t n) {
  stats_calls++;
  stats_device = device;
  if (stats_fail) {
    err = "allocd: the statistics broke";
    return -1;
  }
  if (n >= static_cast<size_t>(stats_count)) {
    for (long long i = 0; i < stats_count; i++) buf[i] = 1000 + i;
  }
  return stats_count;
}
int reset(int device, int* calls) {
  (*calls)++;
  reset_device = device;
  if (reset_fail) {
    err = "allocd: the reset broke";
    return -1;
  }
  return 0;
}
int reset_peak(int device) { return reset(device, &reset_peak_calls); }
int reset_accumulated(int device) { return reset(device, &reset_accumulated_calls); }
double memory_fraction(int /*device*/) { return fraction; }
long long largest_free(int /*device*/) { return largest; }

// snapshot_flat lays out the live and pending blocks and the trace in allocd_snapshot_flat's
// format 2 (cmd/liballocd/torchapi.go): each segment holds its block (allocated, or pending
// free) and, when the segment is larger, an inactive block after it; it is in its block's pool.
long long snapshot_flat(int traces, long long* buf, size_t n) {
  snapshot_calls++;
  std::map<uintptr_t, std::pair<Block, long long>> segs;
  for (const auto& [a, b] : live) segs[a] = {b, 1};
  for (const auto& [a, b] : pending) segs[a] = {b, 2};
  int ntraces = 0;
  if (traces) {
    for (const Entry& e : trace) ntraces = std::max(ntraces, e.device + 1);
  }
  std::vector<long long> v{snapshot_format, static_cast<long long>(segs.size()), ntraces};
  for (const auto& [a, bs] : segs) {
    const Block& b = bs.first;
    long long state = bs.second;
    long long total = static_cast<long long>(round_up(b.size, kSegment));
    long long rounded = static_cast<long long>(round_up(b.size, 512));
    long long addr = static_cast<long long>(a);
    v.insert(v.end(), {b.device, addr, total, static_cast<long long>(b.size), state == 1 ? rounded : 0, rounded,
                       static_cast<long long>(reinterpret_cast<uintptr_t>(b.stream)), b.size > (size_t(1) << 20),
                       b.expandable, static_cast<long long>(b.pool.first), static_cast<long long>(b.pool.second),
                       total > rounded ? 2 : 1});
    v.insert(v.end(), {addr, rounded, static_cast<long long>(b.size), state});
    if (total > rounded) v.insert(v.end(), {addr + rounded, total - rounded, 0, 0});
  }
  for (int d = 0; d < ntraces; d++) {
    std::vector<long long> entries;
    for (const Entry& e : trace) {
      if (e.device == d) entries.insert(entries.end(), {e.action, e.addr, e.size, e.stream, e.time});
    }
    v.push_back(static_cast<long long>(entries.size() / 5));
    v.insert(v.end(), entries.begin(), entries.end());
  }
  if (n >= v.size()) std::copy(v.begin(), v.end(), buf);
  return static_cast<long long>(v.size());
}

// record_history replaces the history, as allocd's does (its entries go).
int record_history(int enabled, long long max_entries, int /*stack_depth*/) {
  history_calls++;
  history = enabled != 0;
  history_max = max_entries;
  trace.clear();
  return 0;
}

// The table allocd_alloc_setup takes, in the order of allocd_torch::Lib.
void* table[] = {
    reinterpret_cast<void*>(&malloc),          reinterpret_cast<void*>(&free),
    reinterpret_cast<void*>(&record_stream),   reinterpret_cast<void*>(&empty_cache),
    reinterpret_cast<void*>(&set_fraction),    reinterpret_cast<void*>(&last_error),
    reinterpret_cast<void*>(&device_stats),    reinterpret_cast<void*>(&reset_peak),
    reinterpret_cast<void*>(&reset_accumulated), reinterpret_cast<void*>(&memory_fraction),
    reinterpret_cast<void*>(&largest_free),    reinterpret_cast<void*>(&snapshot_flat),
    reinterpret_cast<void*>(&record_history),
    reinterpret_cast<void*>(&malloc_pool),     reinterpret_cast<void*>(&create_pool),
    reinterpret_cast<void*>(&release_pool),    reinterpret_cast<void*>(&begin_pool),
    reinterpret_cast<void*>(&end_pool),        reinterpret_cast<void*>(&empty_pool_cache),
    reinterpret_cast<void*>(&pool_use_count),  reinterpret_cast<void*>(&checkpoint_pool),
    reinterpret_cast<void*>(&checkpoint_free), reinterpret_cast<void*>(&restore_pool),
};
constexpr int kTable = sizeof(table) / sizeof(table[0]);

}  // namespace fake

// --- checks -------------------------------------------------------------------------------------

static int g_checks = 0;
#define CHECK(cond)                                          \
  do {                                                       \
    g_checks++;                                              \
    if (!(cond)) {                                           \
      std::printf("FAIL line %d: %s\n", __LINE__, #cond);    \
      std::exit(1);                                          \
    }                                                        \
  } while (0)

// throws<E>(f) runs f and returns "caught:" and the message of an E it throws, "other
// exception" for anything else, or "no exception".
template <typename E, typename F>
static std::string throws(F f) {
  try {
    f();
  } catch (const E& e) {
    return std::string("caught:") + e.what();
  } catch (...) {
    return "other exception";
  }
  return "no exception";
}
static bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
static void* P(uintptr_t a) { return reinterpret_cast<void*>(a); }
static uintptr_t U(const void* p) { return reinterpret_cast<uintptr_t>(p); }
static cudaStream_t S(uintptr_t id) { return reinterpret_cast<cudaStream_t>(id); }
static c10::cuda::CUDAStream cuda_stream(c10::StreamId id) {
  return c10::cuda::CUDAStream(c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::CUDA, 0), id));
}
static void pause_ms() { std::this_thread::sleep_for(std::chrono::milliseconds(2)); }

// A context recorder's result, numbered in the order the recorder ran.
struct Ctx : c10::GatheredContext {
  explicit Ctx(int id) : id(id) {}
  int id;
};
static int g_contexts = 0;
static std::shared_ptr<c10::GatheredContext> make_context() { return std::make_shared<Ctx>(++g_contexts); }
static int ctx_id(const std::shared_ptr<c10::GatheredContext>& c) {
  auto* x = dynamic_cast<Ctx*>(c.get());
  return x ? x->id : 0;
}

// The block of a snapshot at address addr (blocks lie in order from their segment's address).
static const CDA::BlockInfo* find_block(const CA::SnapshotInfo& s, uintptr_t addr, const CDA::SegmentInfo** seg) {
  for (const auto& sg : s.segments) {
    size_t a = sg.address;
    for (const auto& b : sg.blocks) {
      if (a == addr) {
        if (seg) *seg = &sg;
        return &b;
      }
      a += b.size;
    }
  }
  return nullptr;
}
static std::vector<int> actions(const std::vector<CDA::TraceEntry>& tr) {
  std::vector<int> out;
  for (const auto& e : tr) out.push_back(e.action_);
  return out;
}

int main() {
  char buf[256];
  char err[256] = {0};

  // --- setup and install ------------------------------------------------------------------------
  // Install refuses before setup; setup refuses a wrong count, no table and a null pointer.
  CHECK(allocd_alloc_install(err, sizeof err) == -1 && has(err, "allocd_alloc_setup did not run"));
  CHECK(allocd_alloc_setup(fake::table, fake::kTable - 1, "", 0, 0) == -1);
  CHECK(allocd_alloc_setup(fake::table, fake::kTable + 1, "", 0, 0) == -1);
  CHECK(allocd_alloc_setup(nullptr, fake::kTable, "", 0, 0) == -1);
  void* holed[fake::kTable];
  std::memcpy(holed, fake::table, sizeof holed);
  holed[5] = nullptr;
  CHECK(allocd_alloc_setup(holed, fake::kTable, "", 0, 0) == -1);
  CHECK(allocd_alloc_setup(fake::table, fake::kTable, "expandable_segments:True,x:1", 1, 0) == 0);
  // The state names torch's current allocator: the native one, not initialised, then allocd.
  CHECK(allocd_alloc_state(buf, sizeof buf) == 0 && std::string(buf) == "native");
  CHECK(allocd_alloc_install(err, sizeof err) == 0);
  CA::CUDAAllocator* A = CA::get();
  CHECK(A->name() == "allocd");
  CHECK(torch::cuda::CUDAPluggableAllocator::getCurrentAllocator().get() == A);
  CHECK(allocd_alloc_state(buf, sizeof buf) == 0 && std::string(buf) == "allocd");
  CHECK(!A->initialized() && A->isEnabled());
  // After init() torch refuses another swap, with its message.
  A->init(1);
  CHECK(A->initialized());
  CHECK(allocd_alloc_state(buf, sizeof buf) == 1 && std::string(buf) == "allocd");
  CHECK(allocd_alloc_install(err, sizeof err) == -1 && has(err, "Can't swap an already initialized allocator"));
  CHECK(CA::get() == A);
  // A short name buffer is cut, terminated.
  CHECK(allocd_alloc_state(buf, 4) == 1 && std::string(buf) == "all");

  // --- allocate, raw_alloc and the deleter ------------------------------------------------------
  {
    fake_cuda::current_stream = 0x51;
    c10::DataPtr d = A->allocate(3 << 20);
    CHECK(d.get() != nullptr && d.get_context() == d.get());
    CHECK(d.get_deleter() == A->raw_deleter() && A->raw_deleter() != nullptr);
    CHECK(d.device().type() == c10::DeviceType::CUDA && d.device().index() == 0);
    CHECK(fake::mallocs.back().size == size_t(3) << 20 && fake::mallocs.back().device == 0 &&
          fake::mallocs.back().stream == P(0x51));
    void* p = d.get();
    size_t nfrees = fake::frees.size();
    d.clear();  // dropping the DataPtr frees: the address alone, device -1
    CHECK(fake::frees.size() == nfrees + 1);
    CHECK(fake::frees.back().ptr == p && fake::frees.back().size == 0 && fake::frees.back().device == -1 &&
          fake::frees.back().stream == nullptr);
    // Another device: the DataPtr and the malloc say so.
    fake_cuda::device = 1;
    c10::DataPtr d1 = A->allocate(512);
    CHECK(d1.device().index() == 1 && fake::mallocs.back().device == 1);
    fake_cuda::device = 0;
    fake_cuda::current_stream = 0;
    // Size 0: a null DataPtr, no malloc.
    size_t nmallocs = fake::mallocs.size();
    c10::DataPtr z = A->allocate(0);
    CHECK(z.get() == nullptr && !z && A->raw_alloc(0) == nullptr && A->raw_alloc_with_stream(0, S(3)) == nullptr);
    CHECK(fake::mallocs.size() == nmallocs);
    // raw_alloc / raw_delete, and raw_alloc_with_stream's stream.
    void* r = A->raw_alloc(4096);
    CHECK(r != nullptr && fake::live.count(U(r)) == 1);
    A->raw_delete(r);
    CHECK(fake::frees.back().ptr == r && fake::live.count(U(r)) == 0);
    void* rs = A->raw_alloc_with_stream(4096, S(0x77));
    CHECK(fake::mallocs.back().stream == P(0x77));
    A->raw_delete(rs);
    A->raw_delete(nullptr);  // nothing to free
    CHECK(fake::frees.back().ptr == rs);
    // A failing GetDevice: the CUDA error, and no malloc.
    fake_cuda::get_device_error = cudaErrorInvalidDevice;
    nmallocs = fake::mallocs.size();
    CHECK(has(throws<c10::Error>([&] { A->allocate(64); }), "invalid device ordinal"));
    CHECK(fake::mallocs.size() == nmallocs);
    fake_cuda::get_device_error = cudaSuccess;
  }

  // --- malloc failures -------------------------------------------------------------------------
  {
    // NULL with an out-of-memory message: c10::OutOfMemoryError with the whole message (longer
    // than last_error's first buffer), and the observers told the device's allocated bytes
    // (device stats value 48) and cudaMemGetInfo's figures.
    // (The observer stays attached: what it saw lives as long as the allocator.)
    struct Seen {
      int64_t device;
      size_t allocated, total, free;
    };
    static std::vector<Seen> seen;
    A->attachOutOfMemoryObserver([](int64_t dev, size_t alloc, size_t total, size_t fr) {
      seen.push_back({dev, alloc, total, fr});
    });
    fake_cuda::mem_free = 111;
    fake_cuda::mem_total = 222;
    fake_cuda::device = 2;
    std::string oom = throws<c10::OutOfMemoryError>([&] { A->allocate(fake::kOOM); });
    fake_cuda::device = 0;
    CHECK(oom.rfind("caught:allocd: out of memory: tried to allocate", 0) == 0);
    CHECK(has(oom, "on device 2") && oom.size() > 3000 && oom.substr(oom.size() - 4) == " END");
    CHECK(seen.size() == 1 && seen[0].device == 2 && seen[0].allocated == 1048 && seen[0].total == 222 &&
          seen[0].free == 111);
    CHECK(fake::stats_device == 2);
    // raw_alloc runs out of memory the same way.
    CHECK(has(throws<c10::OutOfMemoryError>([&] { A->raw_alloc(fake::kOOM); }), "out of memory"));
    CHECK(seen.size() == 2);
    // NULL with another message: c10::Error, not OutOfMemoryError, and no observer.
    CHECK(throws<c10::OutOfMemoryError>([&] { A->allocate(fake::kNoDevice); }) == "other exception");
    CHECK(throws<c10::Error>([&] { A->allocate(fake::kNoDevice); }) == "caught:allocd: device 9 does not exist");
    CHECK(seen.size() == 2);
    // NULL with no message: still an error, saying so.
    std::string none = throws<c10::Error>([&] { A->allocate(fake::kNoMessage); });
    CHECK(has(none, "allocd_torch_malloc returned NULL for 9 bytes on device 0 and left no message"));
    fake_cuda::mem_free = size_t(60) << 30;
    fake_cuda::mem_total = size_t(80) << 30;
  }

  // --- device statistics -------------------------------------------------------------------------
  {
    // Value i is 1000+i: 9 arrays x 3 pools x (current, peak, allocated, freed), the two
    // oversize stats, then the 6 counters.
    CDA::DeviceStats st = A->getDeviceStats(3);
    CHECK(fake::stats_device == 3);
    CHECK(st.allocation[0].current == 1000 && st.allocation[0].peak == 1001 && st.allocation[0].allocated == 1002 &&
          st.allocation[0].freed == 1003);
    CHECK(st.allocation[2].peak == 1009);                  // allocation, large pool
    CHECK(st.segment[1].allocated == 1018);                // segment, small pool
    CHECK(st.active[0].current == 1024 && st.inactive_split[2].freed == 1047);
    CHECK(st.allocated_bytes[0].current == 1048);          // the one the OOM observers get
    CHECK(st.reserved_bytes[0].current == 1060 && st.active_bytes[1].peak == 1077);
    CHECK(st.inactive_split_bytes[0].current == 1084);
    CHECK(st.requested_bytes[0].current == 1096 && st.requested_bytes[2].freed == 1107);
    CHECK(st.oversize_allocations.current == 1108 && st.oversize_allocations.freed == 1111);
    CHECK(st.oversize_segments.current == 1112 && st.oversize_segments.freed == 1115);
    CHECK(st.num_alloc_retries == 1116 && st.num_ooms == 1117 && st.num_sync_all_streams == 1118);
    CHECK(st.num_device_alloc == 1119 && st.num_device_free == 1120 && st.max_split_size == 1121);
    // Another count (a liballocd.so of another layout): an error saying to rebuild.
    fake::stats_count = 120;
    CHECK(has(throws<c10::Error>([&] { A->getDeviceStats(0); }), "rebuild"));
    fake::stats_count = 130;
    CHECK(has(throws<c10::Error>([&] { A->getDeviceStats(0); }), "gives 130 values"));
    fake::stats_count = 122;
    // A failure: its message.
    fake::stats_fail = true;
    CHECK(has(throws<c10::Error>([&] { A->getDeviceStats(0); }), "allocd: the statistics broke"));
    fake::stats_fail = false;
    // The resets call through with the device; a failure throws with the last error.
    A->resetPeakStats(1);
    CHECK(fake::reset_peak_calls == 1 && fake::reset_device == 1);
    A->resetAccumulatedStats(2);
    CHECK(fake::reset_accumulated_calls == 1 && fake::reset_device == 2);
    fake::reset_fail = true;
    CHECK(throws<c10::Error>([&] { A->resetPeakStats(0); }) == "caught:allocd: the reset broke");
    CHECK(throws<c10::Error>([&] { A->resetAccumulatedStats(0); }) == "caught:allocd: the reset broke");
    fake::reset_fail = false;
  }

  // --- record_stream -----------------------------------------------------------------------------
  {
    c10::DataPtr d = A->allocate(1024);
    A->recordStream(d, cuda_stream(0x99));
    CHECK(fake::records.size() == 1 && fake::records[0].first == d.get() && fake::records[0].second == P(0x99));
    // Through DeviceAllocator's c10::Stream overload, as torch's generic code calls it.
    static_cast<c10::DeviceAllocator*>(A)->recordStream(d, c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::kCUDA, 0), 0x98));
    CHECK(fake::records.size() == 2 && fake::records[1].second == P(0x98));
    // A DataPtr of another allocator, and a null one: not allocd's, ignored.
    c10::DataPtr other(d.get(), d.get(), &c10::detail::deleteNothing, c10::Device(c10::kCUDA, 0));
    A->recordStream(other, cuda_stream(0x99));
    A->recordStream(c10::DataPtr(), cuda_stream(0x99));
    CHECK(fake::records.size() == 2);
    // The test switch (setup flag bit 0) ignores record_stream.
    CHECK(allocd_alloc_setup(fake::table, fake::kTable, "expandable_segments:True,x:1", 1, 1) == 0);
    A->recordStream(d, cuda_stream(0x99));
    CHECK(fake::records.size() == 2);
    CHECK(allocd_alloc_setup(fake::table, fake::kTable, "expandable_segments:True,x:1", 1, 0) == 0);
    A->recordStream(d, cuda_stream(0x99));
    CHECK(fake::records.size() == 3);
  }  // d's block stays pending in the fake: recorded, then freed

  // --- empty cache and memory fraction -----------------------------------------------------------
  {
    A->emptyCache({0, 0});
    CHECK(fake::empties == 1);
    static_cast<c10::DeviceAllocator*>(A)->emptyCache();  // the default pool id
    CHECK(fake::empties == 2);
    // A private pool's (a MemPool's destructor): liballocd's empty_pool_cache, every device,
    // not the general cache's.
    size_t npool = fake::pool_calls.size();
    A->emptyCache({1, 0});
    A->emptyCache({0, 5});
    CHECK(fake::empties == 2 && fake::pool_calls.size() == npool + 2);
    CHECK(fake::pool_calls.back().op == "empty" && fake::pool_calls.back().device == -1 &&
          fake::pool_calls.back().id == fake::Id(0, 5));
    // Its failure is not thrown (torch calls it from a destructor).
    fake::pool_fail = true;
    CHECK(throws<c10::Error>([&] { A->emptyCache({1, 0}); }) == "no exception");
    fake::pool_fail = false;
    CHECK(has(throws<c10::Error>([&] { A->setMemoryFraction(1.5, 0); }), "invalid fraction: 1.5"));
    CHECK(has(throws<c10::Error>([&] { A->setMemoryFraction(-0.1, 0); }), "invalid fraction"));
    CHECK(fake::fractions_set.empty());
    A->setMemoryFraction(0.5, 1);
    CHECK(fake::fractions_set.size() == 1 && fake::fractions_set[0].first == 0.5 && fake::fractions_set[0].second == 1);
    CHECK(A->getMemoryFraction(0) == 0.25);
  }

  // --- cacheInfo ------------------------------------------------------------------------------------
  {
    // *largest == 0: the device's free bytes first (read with the device current), then the
    // larger of that and allocd's largest free block.
    fake_cuda::mem_free = 5000;
    fake::largest = 3000;
    size_t largest = 0;
    int calls = fake_cuda::mem_get_info_calls;
    A->cacheInfo(1, &largest);
    CHECK(largest == 5000 && fake_cuda::mem_get_info_calls == calls + 1 && fake_cuda::mem_get_info_device == 1);
    CHECK(fake_cuda::device == 0);  // the guard restored the current device
    fake::largest = 9000;
    largest = 0;
    A->cacheInfo(0, &largest);
    CHECK(largest == 9000);
    // A guess already made: cudaMemGetInfo is not asked, the guess only grows.
    calls = fake_cuda::mem_get_info_calls;
    largest = 20000;
    A->cacheInfo(0, &largest);
    CHECK(largest == 20000 && fake_cuda::mem_get_info_calls == calls);
    largest = 100;
    A->cacheInfo(0, &largest);
    CHECK(largest == 9000);
    fake_cuda::mem_free = size_t(60) << 30;
    fake::largest = 0;
  }

  // --- snapshot -------------------------------------------------------------------------------------
  {
    fake_cuda::current_stream = 0x33;
    c10::DataPtr big = A->allocate(3 << 20);  // a 4 MiB segment: the 3 MiB block, 1 MiB inactive
    fake_cuda::current_stream = 0;
    fake::expandable = true;
    c10::DataPtr small = A->allocate(1000);  // a 2 MiB segment: a 1024-byte block, the rest inactive
    fake::expandable = false;
    CA::SnapshotInfo s = A->snapshot({0, 0}, true);
    const CDA::SegmentInfo* sg = nullptr;
    const CDA::BlockInfo* b = find_block(s, U(big.get()), &sg);
    CHECK(b != nullptr && sg->address == U(big.get()));
    CHECK(sg->device == 0 && sg->total_size == size_t(4) << 20 && sg->requested_size == size_t(3) << 20);
    CHECK(sg->allocated_size == size_t(3) << 20 && sg->active_size == size_t(3) << 20);
    CHECK(sg->stream == P(0x33) && sg->is_large && !sg->is_expandable && sg->blocks.size() == 2);
    CHECK(b->size == size_t(3) << 20 && b->requested_size == size_t(3) << 20 && b->allocated && b->active);
    CHECK(!sg->blocks[1].allocated && !sg->blocks[1].active && sg->blocks[1].size == size_t(1) << 20);
    CHECK(!b->context_when_allocated);  // no history: no context
    b = find_block(s, U(small.get()), &sg);
    CHECK(b != nullptr && !sg->is_large && sg->is_expandable && sg->stream == nullptr);
    CHECK(b->size == 1024 && b->requested_size == 1000 && b->allocated);
    // The block that record_stream saw, then freed: pending free, active but not allocated.
    CHECK(fake::pending.size() == 1);
    b = find_block(s, fake::pending.begin()->first, &sg);
    CHECK(b != nullptr && !b->allocated && b->active && sg->allocated_size == 0);
    // The configuration of setup.
    CHECK(s.config_metadata.last_allocator_settings == "allocd:expandable_segments:True,x:1");
    CHECK(s.config_metadata.expandable_segments);
    // No history: no traces.
    CHECK(s.device_traces.empty());
    // Segments of the general cache name pool (0, 0); a private pool with none has none.
    for (const auto& x : s.segments) CHECK(x.owner_private_pool_id == c10::MempoolId_t(0, 0));
    CHECK(A->snapshot({1, 0}, true).segments.empty());
    // More than the first buffer holds (4096 values): read whole on a second call.
    std::vector<void*> many;
    for (int i = 0; i < 300; i++) many.push_back(A->raw_alloc(512));
    int calls = fake::snapshot_calls;
    CHECK(A->snapshot().segments.size() == 300 + 2 + 1 && fake::snapshot_calls == calls + 2);
    for (void* p : many) A->raw_delete(p);
    // Another format: an error saying to rebuild.
    fake::snapshot_format = 1;
    CHECK(has(throws<c10::Error>([&] { A->snapshot(); }), "rebuild"));
    fake::snapshot_format = 2;
  }

  // --- history ----------------------------------------------------------------------------------
  {
    A->recordHistory(true, &make_context, 100, CA::RecordContext::ALL, false, {});
    CHECK(A->isHistoryEnabled() && fake::history && fake::history_max == 100);
    fake_cuda::current_stream = 0x44;
    c10::DataPtr a = A->allocate(3 << 20);  // context 1
    fake_cuda::current_stream = 0;
    pause_ms();
    c10::DataPtr b = A->allocate(4096);  // context 2
    pause_ms();
    void* pa = a.get();
    a.clear();  // context 3 (RecordContext::ALL: frees too)
    pause_ms();
    CA::SnapshotInfo s = A->snapshot();
    // The live block has its alloc's context.
    const CDA::BlockInfo* blk = find_block(s, U(b.get()), nullptr);
    CHECK(blk != nullptr && ctx_id(blk->context_when_allocated) == 2);
    // One trace, allocd's segment and free_completed entries merged with the C++'s alloc and
    // free_requested in time order; allocd's own alloc and free_requested left out.
    CHECK(s.device_traces.size() == 1);
    const auto& tr = s.device_traces[0];
    std::vector<int> want{Action::SEGMENT_ALLOC, Action::ALLOC,          Action::SEGMENT_ALLOC,
                          Action::ALLOC,         Action::FREE_REQUESTED, Action::FREE_COMPLETED};
    CHECK(actions(tr) == want);
    CHECK(tr[1].addr_ == U(pa) && tr[1].size_ == size_t(3) << 20 && tr[1].stream_ == P(0x44) &&
          ctx_id(tr[1].context_) == 1);
    CHECK(tr[3].addr_ == U(b.get()) && tr[3].size_ == 4096 && ctx_id(tr[3].context_) == 2);
    // The free's entry has the alloc's size and stream, and its own context.
    CHECK(tr[4].addr_ == U(pa) && tr[4].size_ == size_t(3) << 20 && tr[4].stream_ == P(0x44) &&
          ctx_id(tr[4].context_) == 3);
    CHECK(tr[0].addr_ == U(pa) && tr[0].size_ == size_t(4) << 20 && tr[5].addr_ == U(pa));
    for (size_t i = 1; i < tr.size(); i++) CHECK(tr[i - 1].time_.t_ <= tr[i].time_.t_);
    CHECK(tr[1].time_.t_ > 1600000000LL * 1000000);  // microseconds since the epoch
    // An OOM is recorded, with the device's free bytes as its address.
    fake_cuda::mem_free = 4321;
    CHECK(has(throws<c10::OutOfMemoryError>([&] { A->allocate(fake::kOOM); }), "out of memory"));
    fake_cuda::mem_free = size_t(60) << 30;
    s = A->snapshot();
    CHECK(s.device_traces.size() == 1 && s.device_traces[0].back().action_ == Action::OOM &&
          s.device_traces[0].back().addr_ == 4321 && s.device_traces[0].back().size_ == fake::kOOM);
    // Without traces: segments only.
    CHECK(A->snapshot({0, 0}, false).device_traces.empty());

    // RecordContext::STATE: the live block keeps its context, the trace entries have none.
    A->recordHistory(true, &make_context, 100, CA::RecordContext::STATE, true, {});
    c10::DataPtr c = A->allocate(2048);
    s = A->snapshot();
    blk = find_block(s, U(c.get()), nullptr);
    CHECK(blk != nullptr && ctx_id(blk->context_when_allocated) == g_contexts);
    CHECK(actions(s.device_traces[0]) == (std::vector<int>{Action::SEGMENT_ALLOC, Action::ALLOC}));
    CHECK(!s.device_traces[0][1].context_);
    // skip_actions {"alloc"}: no alloc entries, the others stay.
    A->recordHistory(true, &make_context, 100, CA::RecordContext::ALL, true, {"alloc"});
    c10::DataPtr e = A->allocate(2048);
    pause_ms();  // within one microsecond the merge would put the free before the segment
    e.clear();
    s = A->snapshot();
    CHECK(actions(s.device_traces[0]) ==
          (std::vector<int>{Action::SEGMENT_ALLOC, Action::FREE_REQUESTED, Action::FREE_COMPLETED}));
    CHECK(has(throws<c10::Error>([&] {
                A->recordHistory(true, &make_context, 100, CA::RecordContext::ALL, true, {"nonsense"});
              }),
              "Unknown TraceEntry action: nonsense"));
    // The ring keeps the last alloc_trace_max_entries entries of the C++'s.
    A->recordHistory(true, nullptr, 2, CA::RecordContext::NEVER, true, {});
    CHECK(fake::history_max == 2);
    for (int i = 0; i < 4; i++) A->raw_delete(A->raw_alloc(512));
    s = A->snapshot();
    int mine = 0;
    for (const auto& x : s.device_traces[0]) mine += x.action_ == Action::ALLOC || x.action_ == Action::FREE_REQUESTED;
    CHECK(mine == 2);
    // Off: history and contexts cleared, in allocd too.
    A->recordHistory(false, &make_context, 100, CA::RecordContext::ALL, false, {});
    CHECK(!A->isHistoryEnabled() && !fake::history);
    s = A->snapshot();
    CHECK(s.device_traces.empty());
    blk = find_block(s, U(b.get()), nullptr);
    CHECK(blk != nullptr && !blk->context_when_allocated);
  }

  // --- trace trackers -------------------------------------------------------------------------------
  {
    // A tracker sees allocs and frees with history off.
    static std::vector<CDA::TraceEntry> seen;
    A->attachAllocatorTraceTracker([](const CDA::TraceEntry& te) { seen.push_back(te); });
    c10::DataPtr d = A->allocate(5000);
    void* p = d.get();
    d.clear();
    CHECK(seen.size() == 2 && seen[0].action_ == Action::ALLOC && seen[0].addr_ == U(p) && seen[0].size_ == 5000);
    CHECK(seen[1].action_ == Action::FREE_REQUESTED && seen[1].addr_ == U(p) && seen[1].size_ == 5000);
    CHECK(!seen[0].context_ && A->snapshot().device_traces.empty());
  }

  // --- private pools ----------------------------------------------------------------------------
  {
    using Id = fake::Id;
    static int filter_calls = 0;
    // A filter like torch's: it accepts one stream, counting its calls.
    auto only = [](uintptr_t want) {
      return std::function<bool(cudaStream_t)>([want](cudaStream_t s) {
        filter_calls++;
        return U(s) == want;
      });
    };
    // createOrIncrefPool (torch.cuda.MemPool): a user in allocd, on the device; the use count
    // is allocd's. The current allocator itself may be named; another allocator is refused.
    A->createOrIncrefPool(0, {0, 1}, nullptr);
    CHECK(fake::users[Id(0, 1)] == 1 && fake::pool_calls.back().op == "create" && fake::pool_calls.back().device == 0);
    CHECK(A->getPoolUseCount(0, {0, 1}) == 1 && fake::pool_calls.back().op == "use_count");
    A->createOrIncrefPool(0, {0, 1}, torch::cuda::CUDAPluggableAllocator::getCurrentAllocator());
    CHECK(A->getPoolUseCount(0, {0, 1}) == 2);
    auto other = torch::cuda::CUDAPluggableAllocator::createCustomAllocator(
        [](size_t, int, cudaStream_t) -> void* { return nullptr; }, [](void*, size_t, int, cudaStream_t) {});
    size_t ncalls = fake::pool_calls.size();
    std::string e = throws<c10::Error>([&] { A->createOrIncrefPool(0, {0, 2}, other); });
    CHECK(has(e, "allocd does not support torch.cuda.MemPool with an allocator of its own (pluggable)"));
    CHECK(fake::pool_calls.size() == ncalls);
    A->releasePool(0, {0, 1});
    CHECK(fake::users[Id(0, 1)] == 1 && fake::pool_calls.back().op == "release");

    // No capture under way: a malloc calls no filter and goes to the general cache.
    size_t nplain = fake::mallocs.size(), npool = fake::pool_mallocs.size();
    fake_cuda::current_stream = 0x61;
    c10::DataPtr d0 = A->allocate(1000);
    CHECK(fake::mallocs.size() == nplain + 1 && fake::pool_mallocs.size() == npool && filter_calls == 0);

    // beginAllocateToPool (a CUDA graph's capture of stream 0x61): a user and a capture in allocd;
    // the filter routes 0x61's mallocs to the pool, others stay in the general cache.
    A->beginAllocateToPool(0, {1, 0}, only(0x61));
    CHECK(fake::users[Id(1, 0)] == 1 && fake::capturing[Id(1, 0)] == 1 && fake::pool_calls.back().op == "begin");
    c10::DataPtr g1 = A->allocate(3 << 20);
    CHECK(fake::pool_mallocs.size() == npool + 1 && fake::pool_mallocs.back().id == Id(1, 0) &&
          fake::pool_mallocs.back().stream == P(0x61) && fake::pool_mallocs.back().size == size_t(3) << 20 &&
          fake::pool_mallocs.back().device == 0);
    CHECK(fake::mallocs.size() == nplain + 1 && filter_calls == 1);
    // It ran under the relaxed capture mode, as torch's cudaMalloc during a capture; the
    // thread's mode is back after it.
    CHECK(fake::pool_mallocs.back().mode == cudaStreamCaptureModeRelaxed);
    CHECK(fake_cuda::capture_mode == cudaStreamCaptureModeGlobal && fake_cuda::capture_mode_exchanges == 2);
    void* r = A->raw_alloc_with_stream(512, S(0x62));
    CHECK(fake::mallocs.size() == nplain + 2 && fake::pool_mallocs.size() == npool + 1);
    A->raw_delete(r);
    // Another device's mallocs consult none of device 0's captures.
    fake_cuda::device = 1;
    c10::DataPtr other_dev = A->allocate(512);
    fake_cuda::device = 0;
    CHECK(fake::mallocs.size() == nplain + 3 && fake::mallocs.back().device == 1 && filter_calls == 2);
    // The same pool twice at once is refused, as torch refuses it; allocd is not asked.
    ncalls = fake::pool_calls.size();
    CHECK(has(throws<c10::Error>([&] { A->beginAllocateToPool(0, {1, 0}, only(0x61)); }),
              "beginAllocateToPool: already recording to mempool_id (1, 0)"));
    CHECK(fake::pool_calls.size() == ncalls);
    // A second capture (use_mem_pool on this thread: every stream) is tried after the first.
    A->beginAllocateToPool(0, {0, 1}, [](cudaStream_t) { return true; });
    c10::DataPtr g2 = A->allocate(4096);  // stream 0x61: the first capture's
    CHECK(fake::pool_mallocs.back().id == Id(1, 0));
    void* m1 = A->raw_alloc_with_stream(4096, S(0x62));  // the second's
    CHECK(m1 != nullptr && fake::pool_mallocs.back().id == Id(0, 1) && fake::pool_mallocs.back().stream == P(0x62));
    A->raw_delete(m1);
    // The snapshot: each segment names its pool; a pool's snapshot keeps its own.
    CA::SnapshotInfo s = A->snapshot({0, 0}, false);
    const CDA::SegmentInfo* sg = nullptr;
    CHECK(find_block(s, U(g1.get()), &sg) != nullptr && sg->owner_private_pool_id == c10::MempoolId_t(1, 0));
    CHECK(find_block(s, U(d0.get()), &sg) != nullptr && sg->owner_private_pool_id == c10::MempoolId_t(0, 0));
    CA::SnapshotInfo ps = A->snapshot({1, 0}, false);
    CHECK(ps.segments.size() == 2 && find_block(ps, U(g1.get()), nullptr) && find_block(ps, U(g2.get()), nullptr));
    for (const auto& x : ps.segments) CHECK(x.owner_private_pool_id == c10::MempoolId_t(1, 0));
    // checkPoolLiveAllocations: the pool's allocated blocks on the device, exactly.
    CHECK(A->checkPoolLiveAllocations(0, {1, 0}, {g1.get(), g2.get()}));
    CHECK(!A->checkPoolLiveAllocations(0, {1, 0}, {g1.get()}));
    CHECK(!A->checkPoolLiveAllocations(0, {1, 0}, {g1.get(), g2.get(), d0.get()}));
    CHECK(!A->checkPoolLiveAllocations(1, {1, 0}, {g1.get(), g2.get()}));
    CHECK(A->checkPoolLiveAllocations(0, {7, 0}, {}));
    // endAllocateToPool: the pool stops taking mallocs; its user stays for releasePool.
    A->endAllocateToPool(0, {1, 0});
    CHECK(fake::capturing[Id(1, 0)] == 0 && fake::users[Id(1, 0)] == 1 && fake::pool_calls.back().op == "end");
    c10::DataPtr m2 = A->allocate(2048);  // stream 0x61: now use_mem_pool's
    CHECK(fake::pool_mallocs.back().id == Id(0, 1) && fake::pool_mallocs.back().size == 2048);
    CHECK(has(throws<c10::Error>([&] { A->endAllocateToPool(0, {1, 0}); }),
              "endAllocatePool: not currently recording to mempool_id (1, 0)"));
    CHECK(has(throws<c10::Error>([&] { A->endAllocateToPool(5, {1, 0}); }), "not currently recording"));
    A->endAllocateToPool(0, {0, 1});
    int before = filter_calls;
    nplain = fake::mallocs.size();
    npool = fake::pool_mallocs.size();
    c10::DataPtr plain = A->allocate(2048);
    CHECK(fake::mallocs.size() == nplain + 1 && fake::pool_mallocs.size() == npool && filter_calls == before);
    // releasePool: allocd's; the count follows.
    A->releasePool(0, {1, 0});
    CHECK(A->getPoolUseCount(0, {1, 0}) == 0);
    // A pool's blocks free as any: the address alone.
    void* pg1 = g1.get();
    g1.clear();
    CHECK(fake::frees.back().ptr == pg1 && fake::frees.back().device == -1);

    // Failures of allocd's pool calls are torch errors with allocd's message; a begin that
    // failed routes nothing.
    fake::pool_fail = true;
    CHECK(throws<c10::Error>([&] { A->beginAllocateToPool(0, {2, 0}, only(0x61)); }) == "caught:allocd: begin broke");
    CHECK(throws<c10::Error>([&] { A->createOrIncrefPool(0, {0, 3}, nullptr); }) == "caught:allocd: create broke");
    CHECK(throws<c10::Error>([&] { A->releasePool(0, {0, 1}); }) == "caught:allocd: release broke");
    CHECK(throws<c10::Error>([&] { A->getPoolUseCount(0, {0, 1}); }) == "caught:allocd: use_count broke");
    fake::pool_fail = false;
    nplain = fake::mallocs.size();
    c10::DataPtr after = A->allocate(512);
    CHECK(fake::mallocs.size() == nplain + 1);
    A->beginAllocateToPool(0, {2, 0}, only(0x61));  // the failed begin left no entry behind
    fake::pool_fail = true;
    CHECK(throws<c10::Error>([&] { A->endAllocateToPool(0, {2, 0}); }) == "caught:allocd: end broke");
    fake::pool_fail = false;
    nplain = fake::mallocs.size();
    c10::DataPtr after_end = A->allocate(512);  // routing ended even so
    CHECK(fake::mallocs.size() == nplain + 1);
    // A malloc in a pool that allocd refuses: its message.
    fake::users[Id(2, 0)] = 0;
    A->beginAllocateToPool(0, {3, 0}, only(0x61));
    fake::users[Id(3, 0)] = 0;
    CHECK(throws<c10::Error>([&] { A->allocate(64); }) == "caught:allocd: malloc in pool: unknown memory pool");
    A->endAllocateToPool(0, {3, 0});
    fake_cuda::current_stream = 0;

    // MemPool's options: use_on_oom=False (its destructor's call) is nothing; True and no_split
    // are refused, naming allocd.
    CHECK(throws<c10::Error>([&] { A->setUseOnOOM(0, {0, 1}, false); }) == "no exception");
    CHECK(has(throws<c10::Error>([&] { A->setUseOnOOM(0, {0, 1}, true); }),
              "allocd does not support torch.cuda.MemPool(use_on_oom=True) (pool (0, 1))"));
    CHECK(has(throws<c10::Error>([&] { A->setNoSplit(0, {0, 1}); }), "allocd does not support torch.cuda.MemPool(no_split=True)"));
  }

  // --- checkpoints (torch.compile's CUDA graph trees) -------------------------------------------
  {
    using Id = fake::Id;
    // A "recording" into pool (5, 0) leaves k1 and k2 live; the checkpoint is allocd's, by handle.
    A->createOrIncrefPool(0, {5, 0}, nullptr);
    fake_cuda::current_stream = 0x71;
    A->beginAllocateToPool(0, {5, 0}, [](cudaStream_t) { return true; });
    c10::DataPtr k1 = A->allocate(4096);
    c10::DataPtr k2 = A->allocate(8192);
    A->endAllocateToPool(0, {5, 0});
    std::shared_ptr<CA::AllocatorState> cp = A->getCheckpointState(0, {5, 0});
    CHECK(cp != nullptr && fake::checkpoints.size() == 1 && fake::pool_calls.back().op == "checkpoint" &&
          fake::pool_calls.back().id == Id(5, 0));
    uintptr_t handle = fake::checkpoints.begin()->first;
    // After a replay k2 is dead and a warmup made k3 in the pool.
    void* p1 = k1.get();
    void* p2 = k2.get();
    k2.clear();
    A->beginAllocateToPool(0, {5, 0}, [](cudaStream_t) { return true; });
    c10::DataPtr k3 = A->allocate(2048);
    A->endAllocateToPool(0, {5, 0});
    fake_cuda::current_stream = 0;
    // Restoring frees what the pool holds now (k1, k3) and gives back the checkpoint's blocks (k1,
    // k2) as DataPtrs of allocd's, on the device.
    CA::CheckpointDelta d = A->setCheckpointPoolState(0, cp);
    CHECK(fake::pool_calls.back().op == "restore" && fake::pool_calls.back().device == 0);
    std::vector<void*> freed = d.ptrs_freed;
    std::sort(freed.begin(), freed.end());
    std::vector<void*> want{p1, k3.get()};
    std::sort(want.begin(), want.end());
    CHECK(freed == want);
    CHECK(d.dataptrs_allocd.size() == 2);
    std::vector<void*> got{d.dataptrs_allocd[0].get(), d.dataptrs_allocd[1].get()};
    std::sort(got.begin(), got.end());
    want = {p1, p2};
    std::sort(want.begin(), want.end());
    CHECK(got == want);
    for (const auto& x : d.dataptrs_allocd) {
      CHECK(x.get_context() == x.get() && x.get_deleter() == A->raw_deleter() && x.device().index() == 0);
    }
    // torch takes the freed tensors' deleters away; the new DataPtrs free through allocd.
    k1.release_context();
    k3.release_context();
    size_t nfrees = fake::frees.size();
    d.dataptrs_allocd.clear();
    CHECK(fake::frees.size() == nfrees + 2 && fake::frees.back().device == -1);
    // Failures: allocd's message; one half way says the pool no longer matches torch's tensors.
    fake::pool_fail = true;
    CHECK(throws<c10::Error>([&] { A->getCheckpointState(0, {5, 0}); }) == "caught:allocd: checkpoint broke");
    CHECK(throws<c10::Error>([&] { A->setCheckpointPoolState(0, cp); }) == "caught:allocd: restore broke");
    fake::pool_fail = false;
    fake::restore_half = true;
    std::string e = throws<c10::Error>([&] { A->setCheckpointPoolState(0, cp); });
    CHECK(has(e, "pool does not match the checkpoint") && has(e, "it no longer matches torch's tensors"));
    fake::restore_half = false;
    // A state that is not allocd's is refused.
    CHECK(has(throws<c10::Error>([&] { A->setCheckpointPoolState(0, std::make_shared<CA::AllocatorState>()); }),
              "not one of allocd's getCheckpointState"));
    // The state's end drops allocd's checkpoint.
    cp.reset();
    CHECK(fake::checkpoints.empty() && fake::checkpoints_freed.size() == 1 && fake::checkpoints_freed[0] == handle);
    for (auto it = fake::live.begin(); it != fake::live.end();) {
      it = it->second.pool == Id(5, 0) ? fake::live.erase(it) : std::next(it);
    }
    A->releasePool(0, {5, 0});
  }

  // --- what allocd does not support ---------------------------------------------------------------
  {
    auto allocd_error = [](const std::string& e) { return e.rfind("caught:", 0) == 0 && has(e, "allocd"); };
    CHECK(allocd_error(throws<c10::Error>([&] { A->getIpcDevPtr("handle"); })));
    CHECK(allocd_error(throws<c10::Error>([&] { A->shareIpcHandle(P(0x1000)); })));
    size_t size = 0;
    CHECK(allocd_error(throws<c10::Error>([&] { A->getBaseAllocation(P(0x1000), &size); })));
    CHECK(A->getExpandableSegmentSizes(0).empty());
  }

  // --- CUDA pass-throughs ------------------------------------------------------------------------
  {
    A->enablePeerAccess(0, 1);
    CHECK(fake_cuda::peer_access_calls == 1);
    // Already enabled: no error, and the sticky error cleared.
    fake_cuda::peer_access_result = cudaErrorPeerAccessAlreadyEnabled;
    int cleared = fake_cuda::get_last_error_calls;
    A->enablePeerAccess(0, 1);
    CHECK(fake_cuda::get_last_error_calls == cleared + 1);
    fake_cuda::peer_access_result = cudaErrorInvalidDevice;
    CHECK(has(throws<c10::Error>([&] { A->enablePeerAccess(0, 1); }), "invalid device ordinal"));
    fake_cuda::peer_access_result = cudaSuccess;
    // memcpyAsync: plain between peers or on one device, the peer copy otherwise.
    CHECK(A->memcpyAsync(P(1), 0, P(2), 1, 8, nullptr, true) == cudaSuccess);
    CHECK(A->memcpyAsync(P(1), 0, P(2), 0, 8, nullptr, false) == cudaSuccess);
    CHECK(fake_cuda::memcpy_async_calls == 2 && fake_cuda::memcpy_peer_async_calls == 0);
    CHECK(A->memcpyAsync(P(1), 0, P(2), 1, 8, nullptr, false) == cudaSuccess);
    CHECK(fake_cuda::memcpy_peer_async_calls == 1);
    A->copy_data(P(1), P(2), 8);
    CHECK(fake_cuda::memcpy_calls == 1);
  }

  // --- fork -----------------------------------------------------------------------------------------
  {
    // In a forked child the Go runtime is gone: allocation throws, a drop frees nothing, the
    // cache and stream calls do nothing, the stats are zero, all without calling liballocd.
    c10::DataPtr keep = A->allocate(4096);
    void* kept = keep.get();
    std::fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
      int bad = 0;
      size_t nfrees = fake::frees.size(), nmallocs = fake::mallocs.size(), nrecords = fake::records.size();
      int empties = fake::empties, stats_calls = fake::stats_calls;
      A->recordStream(keep, cuda_stream(0x99));
      keep.clear();
      if (fake::frees.size() != nfrees || fake::records.size() != nrecords) bad |= 1;
      std::string e = throws<c10::Error>([&] { A->allocate(64); });
      if (!has(e, "forked child") || fake::mallocs.size() != nmallocs) bad |= 2;
      A->emptyCache({0, 0});
      A->setMemoryFraction(0.5, 0);
      CDA::DeviceStats st = A->getDeviceStats(0);
      if (fake::empties != empties || fake::stats_calls != stats_calls || st.allocated_bytes[0].current != 0) bad |= 4;
      // Pool calls: a begin or a create throws, the others do nothing; liballocd is not asked.
      size_t npool = fake::pool_calls.size();
      if (!has(throws<c10::Error>([&] { A->beginAllocateToPool(0, {9, 0}, nullptr); }), "forked child") ||
          !has(throws<c10::Error>([&] { A->createOrIncrefPool(0, {0, 9}, nullptr); }), "forked child")) {
        bad |= 8;
      }
      A->endAllocateToPool(0, {9, 0});
      A->releasePool(0, {9, 0});
      A->emptyCache({9, 0});
      if (A->getPoolUseCount(0, {9, 0}) != 0 || fake::pool_calls.size() != npool) bad |= 16;
      if (!has(throws<c10::Error>([&] { A->getCheckpointState(0, {9, 0}); }), "forked child") ||
          fake::pool_calls.size() != npool) {
        bad |= 32;
      }
      std::_Exit(bad);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status));
    if (WEXITSTATUS(status) != 0) std::printf("child status bits %d\n", WEXITSTATUS(status));
    CHECK(WEXITSTATUS(status) == 0);
    // The parent is unaffected by its child.
    keep.clear();
    CHECK(fake::frees.back().ptr == kept);
    c10::DataPtr again = A->allocate(64);
    CHECK(again.get() != nullptr);
  }

  std::printf("ok %d checks\n", g_checks);
  return 0;
}
