#include "berth/core/error.h"

#include <fmt/format.h>

namespace berth {

std::string_view category_name(ErrorCategory c) {
  switch (c) {
    case ErrorCategory::io:
      return "io";
    case ErrorCategory::format:
      return "format";
    case ErrorCategory::missing:
      return "missing";
    case ErrorCategory::unsupported:
      return "unsupported";
    case ErrorCategory::invalid_argument:
      return "invalid_argument";
    case ErrorCategory::usage:
      return "usage";
    case ErrorCategory::out_of_memory:
      return "out_of_memory";
    case ErrorCategory::internal:
      return "internal";
  }
  return "unknown";
}

namespace detail {
void check_failed(const char* cond, const char* file, int line, const std::string& msg) {
  throw Error(ErrorCategory::internal, fmt::format("internal error: check '{}' failed at {}:{}{}{}",
                                                   cond, file, line, msg.empty() ? "" : ": ", msg));
}
}  // namespace detail

}  // namespace berth
