#include "berth/core/env.h"

#include <fmt/format.h>

#include <cstdlib>
#include <string>

#include "berth/core/error.h"
#include "berth/core/strings.h"

namespace berth {

std::optional<uint64_t> env_uint(const char* name, uint64_t max) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  uint64_t n = 0;
  bool ok = true;
  for (const char* p = v; *p != '\0'; ++p) {
    if (*p < '0' || *p > '9') {
      ok = false;
      break;
    }
    const uint64_t d = static_cast<uint64_t>(*p - '0');
    if (d > max || n > (max - d) / 10) {  // n * 10 + d > max, without overflow
      ok = false;
      break;
    }
    n = n * 10 + d;
  }
  if (!ok)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("{}='{}': expected an integer from 0 to {}", name, printable(v), max));
  return n;
}

}  // namespace berth
