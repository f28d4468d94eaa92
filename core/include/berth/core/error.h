// Error types shared by every berth library.
//
// Errors at load, config and server boundaries are exceptions carrying context (file, tensor,
// key, offset). Each has a category so tests can assert *which* error happened, not only that
// one did, and so the CLI can map it to an exit code.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace berth {

/// Broad category of a berth::Error; `category_name()` gives its stable lowercase name.
enum class ErrorCategory {
  io,                ///< the OS refused: open, stat, mmap, read or write failed
  format,            ///< a file is malformed (GGUF structure, tensor layout, vocabulary)
  missing,           ///< a required metadata key or tensor is absent
  unsupported,       ///< valid input berth cannot run (architecture, tensor type, feature)
  invalid_argument,  ///< a caller or user passed a bad value (flag, request field, shape)
  usage,             ///< bad usage of the command line or its environment (BERTH_SIM_DEVICE)
  out_of_memory,     ///< an allocation failed (host or device)
  internal,          ///< a bug in berth: an invariant did not hold
};

/// Stable name of a category ("io", "format", ...).
std::string_view category_name(ErrorCategory c);

/// Base class of all berth exceptions. `what()` is a complete, single-line message that names
/// what is wrong and where (file, tensor, key, offset), ready to print to a user.
class Error : public std::runtime_error {
 public:
  Error(ErrorCategory category, const std::string& message)
      : std::runtime_error(message), category_(category) {}
  ErrorCategory category() const noexcept { return category_; }

 private:
  ErrorCategory category_;
};

/// Throws Error(internal) with the file and line when `cond` is false. For invariants that
/// would otherwise corrupt memory; cheap enough for load paths, not for inner loops.
#define BERTH_CHECK(cond, ...)                                                                     \
  do {                                                                                             \
    if (!(cond))                                                                                   \
      ::berth::detail::check_failed(#cond, __FILE__, __LINE__, ::berth::detail::msg(__VA_ARGS__)); \
  } while (0)

namespace detail {
[[noreturn]] void check_failed(const char* cond, const char* file, int line,
                               const std::string& msg);
inline std::string msg() { return {}; }
inline std::string msg(std::string s) { return s; }
}  // namespace detail

}  // namespace berth
