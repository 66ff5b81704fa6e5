// Test stub of torch's c10/core/Allocator.h (with the parts of c10/core/DeviceType.h,
// c10/core/Device.h and c10/util/UniqueVoidPtr.h it rests on): the declarations
// allocd_torch/_allocator.cpp uses, shaped like torch 2.11's.
#pragma once

#include <c10/util/Exception.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

namespace c10 {

enum class DeviceType : int8_t { CPU = 0, CUDA = 1 };
constexpr DeviceType kCPU = DeviceType::CPU;
constexpr DeviceType kCUDA = DeviceType::CUDA;

using DeviceIndex = int8_t;

struct Device final {
  Device(DeviceType type, DeviceIndex index = -1) : type_(type), index_(index) {}
  bool operator==(const Device& other) const noexcept { return type_ == other.type_ && index_ == other.index_; }
  bool operator!=(const Device& other) const noexcept { return !(*this == other); }
  DeviceType type() const noexcept { return type_; }
  DeviceIndex index() const noexcept { return index_; }

 private:
  DeviceType type_;
  DeviceIndex index_ = -1;
};

using DeleterFnPtr = void (*)(void*);

namespace detail {
inline void deleteNothing(void* /*ptr*/) {}
}  // namespace detail

// torch's DataPtr holds a c10::detail::UniqueVoidPtr: the data pointer and a context owned by a
// unique_ptr with the deleter; dropping it calls the deleter on the context.
class DataPtr {
 private:
  void* data_ = nullptr;
  std::unique_ptr<void, DeleterFnPtr> ctx_{nullptr, &detail::deleteNothing};
  Device device_;

 public:
  DataPtr() : device_(DeviceType::CPU) {}
  DataPtr(void* data, Device device) : data_(data), device_(device) {}
  DataPtr(void* data, void* ctx, DeleterFnPtr ctx_deleter, Device device)
      : data_(data), ctx_(ctx, ctx_deleter ? ctx_deleter : &detail::deleteNothing), device_(device) {}
  void clear() {
    ctx_ = nullptr;
    data_ = nullptr;
  }
  void* get() const { return data_; }
  void* get_context() const { return ctx_.get(); }
  void* release_context() { return ctx_.release(); }
  operator bool() const { return data_ || ctx_; }
  DeleterFnPtr get_deleter() const { return ctx_.get_deleter(); }
  Device device() const { return device_; }
};

struct Allocator {
  virtual ~Allocator() = default;
  virtual DataPtr allocate(size_t n) = 0;
  virtual DeleterFnPtr raw_deleter() const { return nullptr; }
  virtual void copy_data(void* dest, const void* src, std::size_t count) const = 0;
};

struct GatheredContext {
  virtual ~GatheredContext() = default;
};

using CaptureId_t = unsigned long long;
using MempoolId_t = std::pair<CaptureId_t, CaptureId_t>;

namespace CachingAllocator {
struct Stat {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocated = 0;
  int64_t freed = 0;
};

enum struct StatType : uint64_t { AGGREGATE = 0, SMALL_POOL = 1, LARGE_POOL = 2, NUM_TYPES = 3 };

using StatArray = std::array<Stat, static_cast<size_t>(StatType::NUM_TYPES)>;
}  // namespace CachingAllocator

}  // namespace c10
