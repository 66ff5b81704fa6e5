// Test stub of torch's c10/core/Stream.h: a device and a stream id, as torch's c10::Stream.
#pragma once

#include <c10/core/Allocator.h>

#include <cstdint>

namespace c10 {

using StreamId = int64_t;

class Stream final {
 private:
  Device device_;
  StreamId id_;

 public:
  enum Unsafe { UNSAFE };
  enum Default { DEFAULT };

  explicit Stream(Unsafe /*unused*/, Device device, StreamId id) : device_(device), id_(id) {}
  explicit Stream(Default /*unused*/, Device device) : device_(device), id_(0) {}

  Device device() const noexcept { return device_; }
  DeviceType device_type() const noexcept { return device_.type(); }
  DeviceIndex device_index() const noexcept { return device_.index(); }
  StreamId id() const noexcept { return id_; }
};

}  // namespace c10
