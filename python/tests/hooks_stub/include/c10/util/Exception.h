// Test stub of torch's c10/util/Exception.h: c10::Error, c10::OutOfMemoryError and the checks,
// shaped like torch's (TORCH_CHECK_WITH names the error type unqualified and throws
// ::c10::<type> with the arguments concatenated).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace c10 {
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream ss;
  ((void)(ss << args), ...);
  return ss.str();
}
}  // namespace c10

#define TORCH_CHECK_WITH(error_t, cond, ...)                      \
  do {                                                            \
    if (!(cond)) throw ::c10::error_t(::c10::str(__VA_ARGS__));   \
  } while (0)
#define TORCH_CHECK(cond, ...) TORCH_CHECK_WITH(Error, cond, __VA_ARGS__)
