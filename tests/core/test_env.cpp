// env_uint(): strict reading of integer environment variables.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "berth/core/env.h"
#include "berth/core/error.h"

using berth::env_uint;
using berth::Error;
using berth::ErrorCategory;

namespace {

constexpr const char* kVar = "BERTH_TEST_ENV_UINT";

// Sets kVar to `value` and checks that env_uint(kVar, max) throws Error(invalid_argument) whose
// message names the variable, quotes the value and states the range.
void check_refused(const char* value, uint64_t max) {
  CAPTURE(value);
  setenv(kVar, value, 1);
  const std::string expected =
      std::string(kVar) + "='" + value + "': expected an integer from 0 to " + std::to_string(max);
  CHECK_THROWS_WITH_AS(env_uint(kVar, max), expected.c_str(), Error);
  try {
    (void)env_uint(kVar, max);
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::invalid_argument);
  }
  unsetenv(kVar);
}

}  // namespace

TEST_CASE("env_uint: unset or empty is nullopt") {
  unsetenv(kVar);
  CHECK_FALSE(env_uint(kVar).has_value());
  CHECK_FALSE(env_uint(kVar, 2).has_value());
  setenv(kVar, "", 1);
  CHECK_FALSE(env_uint(kVar).has_value());
  unsetenv(kVar);
}

TEST_CASE("env_uint: decimal integers in [0, max] are read") {
  setenv(kVar, "0", 1);
  CHECK(env_uint(kVar, 2) == uint64_t{0});
  setenv(kVar, "42", 1);
  CHECK(env_uint(kVar) == uint64_t{42});
  setenv(kVar, "2", 1);
  CHECK(env_uint(kVar, 2) == uint64_t{2});  // max itself
  setenv(kVar, "1000000000", 1);
  CHECK(env_uint(kVar, 1000000000) == uint64_t{1000000000});
  setenv(kVar, "18446744073709551615", 1);
  CHECK(env_uint(kVar) == UINT64_MAX);
  unsetenv(kVar);
}

TEST_CASE("env_uint: other values throw Error(invalid_argument) naming the variable") {
  check_refused("3", 2);  // max + 1
  check_refused("1000000001", 1000000000);
  check_refused("10", 9);  // above max by more than a digit's worth
  check_refused("-1", UINT64_MAX);
  check_refused("+5", UINT64_MAX);
  check_refused("12x", UINT64_MAX);
  check_refused(" 5", UINT64_MAX);
  check_refused("5 ", UINT64_MAX);
  check_refused("abc", 1000000000);
  check_refused("99999999999999999999999", UINT64_MAX);  // overflow
  check_refused("18446744073709551616", UINT64_MAX);     // UINT64_MAX + 1
}

TEST_CASE("env_uint: the message quotes control bytes escaped") {
  setenv(kVar, "1\n2", 1);
  CHECK_THROWS_WITH_AS(env_uint(kVar, 9),
                       "BERTH_TEST_ENV_UINT='1\\n2': expected an integer from 0 to 9", Error);
  unsetenv(kVar);
}
