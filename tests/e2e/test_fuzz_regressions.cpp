// Replays the inputs fuzzing found (tests/fuzz/regressions/): each must be rejected with a
// berth::Error (or load and run), never crash, under the sanitizer build too.
#include <doctest/doctest.h>

#include <filesystem>

#include "../fuzz/exercise_file.h"
#include "test_util.h"

TEST_CASE("fuzzer regressions are rejected cleanly") {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(BERTH_FUZZ_REGRESSIONS)) {
    CAPTURE(e.path().filename().string());
    const std::string bytes = berth::test::read_file(e.path());
    CHECK_FALSE(berth::test::exercise_file(std::vector<uint8_t>(bytes.begin(), bytes.end())));
    ++n;
  }
  CHECK(n >= 1);
}
