// Drives allocd_torch/_hooks.cpp against stub torch headers (include/), with fake liballocd
// functions, so that its logic is tested on a machine without torch: the NULL -> exception
// mapping, the attach of the stream/cache/fraction hooks, the allocator-state probe, and the
// forked-child guard. Prints "ok N checks" and exits 0, or names the first failed check and
// exits 1. Built by test_loader.py as one translation unit with _hooks.cpp:
//   g++ -std=c++17 -Iinclude -DHOOKS_SOURCE="<path>/_hooks.cpp" driver.cpp -o driver
#include HOOKS_SOURCE

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace CA = c10::cuda::CUDACachingAllocator;
namespace PA = torch::cuda::CUDAPluggableAllocator;

std::atomic<CA::CUDAAllocator*> CA::allocator{nullptr};
static std::shared_ptr<CA::CUDAAllocator> g_current;
std::shared_ptr<CA::CUDAAllocator> PA::getCurrentAllocator() { return g_current; }

struct Native : CA::CUDAAllocator {
  bool init = false;
  bool initialized() override { return init; }
  std::string name() override { return "native"; }
};

// The fake liballocd.
static char g_buf[4096];
static std::string g_err;
static int g_frees = 0, g_records = 0, g_empties = 0;
static double g_fraction_seen = 0;
static const size_t kTooBig = size_t(1) << 40;

static void* fake_malloc(size_t size, int device, cudaStream_t) {
  if (size >= kTooBig) {
    g_err = "allocd: out of memory: tried to allocate 1.00 TiB (a request of " + std::to_string(size) +
            " bytes) on device " + std::to_string(device) + ". " + std::string(3000, 'x') + " END";
    return nullptr;
  }
  if (size == 7) {
    g_err = "allocd: device 9 does not exist";
    return nullptr;
  }
  if (size == 9) {
    g_err.clear();
    return nullptr;
  }
  if (size == 0) return nullptr;
  return g_buf;
}
static void fake_free(void*, size_t, int, cudaStream_t) { g_frees++; }
static void fake_record(void*, cudaStream_t) { g_records++; }
static void fake_empty() { g_empties++; }
static void fake_fraction(double f, int) { g_fraction_seen = f; }
static size_t fake_last_error(char* buf, size_t n) {
  if (n > 0) {
    size_t k = g_err.size() < n - 1 ? g_err.size() : n - 1;
    std::memcpy(buf, g_err.data(), k);
    buf[k] = '\0';
  }
  return g_err.size();
}

static int g_checks = 0;
#define CHECK(cond)                                                   \
  do {                                                                \
    g_checks++;                                                       \
    if (!(cond)) {                                                    \
      std::printf("FAIL line %d: %s\n", __LINE__, #cond);             \
      std::exit(1);                                                   \
    }                                                                 \
  } while (0)

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

int main() {
  char name[64];
  // Allocator state: an uninitialised native allocator can be swapped, an initialised one not.
  auto native = std::make_shared<Native>();
  CA::allocator.store(native.get());
  CHECK(allocd_hooks_allocator_state(name, sizeof name) == 0);
  CHECK(std::string(name) == "native");
  native->init = true;
  CHECK(allocd_hooks_allocator_state(name, sizeof name) == 1);

  CHECK(allocd_hooks_setup(nullptr, (void*)fake_free, (void*)fake_record, (void*)fake_empty,
                           (void*)fake_fraction, (void*)fake_last_error) == -1);
  CHECK(allocd_hooks_setup((void*)fake_malloc, (void*)fake_free, (void*)fake_record, (void*)fake_empty,
                           (void*)fake_fraction, (void*)fake_last_error) == 0);

  // malloc: a pointer passes through; NULL for size 0 is no error.
  CHECK(allocd_hooks_malloc(64, 0, nullptr) == g_buf);
  CHECK(allocd_hooks_malloc(0, 0, nullptr) == nullptr);
  // NULL with an out-of-memory message: c10::OutOfMemoryError with the whole message (longer
  // than the first buffer).
  std::string oom = throws<c10::OutOfMemoryError>([] { allocd_hooks_malloc(kTooBig, 3, nullptr); });
  CHECK(oom.rfind("caught:allocd: out of memory: tried to allocate", 0) == 0);
  CHECK(oom.find("on device 3") != std::string::npos);
  CHECK(oom.size() > 3000 && oom.substr(oom.size() - 4) == " END");
  // NULL with another message: c10::Error, not OutOfMemoryError.
  CHECK(throws<c10::OutOfMemoryError>([] { allocd_hooks_malloc(7, 0, nullptr); }) == "other exception");
  CHECK(throws<c10::Error>([] { allocd_hooks_malloc(7, 0, nullptr); }) ==
        "caught:allocd: device 9 does not exist");
  // NULL with no message: still an error, saying so.
  CHECK(throws<c10::Error>([] { allocd_hooks_malloc(9, 2, nullptr); }).find("left no message") !=
        std::string::npos);
  allocd_hooks_free(g_buf, 64, 0, nullptr);
  CHECK(g_frees == 1);

  // attach: refused while the current allocator is not a CUDAPluggableAllocator.
  char err[256] = {0};
  g_current = native;
  CHECK(allocd_hooks_attach(7, err, sizeof err) == -1);
  CHECK(std::string(err).find("not a CUDAPluggableAllocator") != std::string::npos);
  // attach with flags 2|4: reset and fraction installed, record_stream left alone.
  auto pluggable = std::make_shared<PA::CUDAPluggableAllocator>();
  g_current = pluggable;
  CHECK(allocd_hooks_attach(2 | 4, err, sizeof err) == 0);
  CHECK(!pluggable->record_stream_fn_);
  CHECK(pluggable->reset_fn_ && pluggable->memory_fraction_fn_);
  CHECK(allocd_hooks_attach(1 | 2 | 4, err, sizeof err) == 0);
  pluggable->record_stream_fn_(g_buf, nullptr);
  pluggable->reset_fn_();
  pluggable->memory_fraction_fn_(0.25, 0);
  CHECK(g_records == 1 && g_empties == 1 && g_fraction_seen == 0.25);

  // A forked child: free and the hooks do nothing, malloc throws without calling liballocd.
  std::fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    int bad = 0;
    allocd_hooks_free(g_buf, 64, 0, nullptr);
    pluggable->record_stream_fn_(g_buf, nullptr);
    pluggable->reset_fn_();
    pluggable->memory_fraction_fn_(0.5, 0);
    if (g_frees != 1 || g_records != 1 || g_empties != 1 || g_fraction_seen != 0.25) bad |= 1;
    std::string e = throws<c10::Error>([] { allocd_hooks_malloc(64, 0, nullptr); });
    if (e.find("forked child process") == std::string::npos) bad |= 2;
    std::_Exit(bad);
  }
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status));
  if (WEXITSTATUS(status) != 0) std::printf("child status bits %d\n", WEXITSTATUS(status));
  CHECK(WEXITSTATUS(status) == 0);
  // The parent is unaffected by its child's fork.
  CHECK(allocd_hooks_malloc(64, 0, nullptr) == g_buf);
  allocd_hooks_free(g_buf, 64, 0, nullptr);
  CHECK(g_frees == 2);
  std::printf("ok %d checks\n", g_checks);
  return 0;
}
