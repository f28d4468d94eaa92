// Strict reading of integer environment variables (knobs such as BERTH_SYNC_SPIN_US): a value
// that is set must be a plain decimal integer in range, so a typo is an error naming the variable
// instead of a silent 0.
#pragma once

#include <cstdint>
#include <optional>

namespace berth {

/// The value of environment variable `name` as an integer in [0, max]: std::nullopt when it is
/// unset or empty, else its decimal digits (no sign, spaces or other characters). Throws
/// Error(invalid_argument) "NAME='VALUE': expected an integer from 0 to MAX" for any other value
/// (one above `max` included).
std::optional<uint64_t> env_uint(const char* name, uint64_t max = UINT64_MAX);

}  // namespace berth
