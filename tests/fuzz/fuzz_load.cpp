// libFuzzer target: arbitrary bytes through everything that reads a model file (see
// exercise_file.h). Anything but a berth::Error is a bug; ASan/UBSan report crashes and
// undefined behaviour. Build and run with scripts/fuzz.sh; inputs that found bugs are kept in
// tests/fuzz/regressions/ and replayed by test_e2e.
#include <cstdint>

#include "exercise_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)berth::test::exercise_file(std::vector<uint8_t>(data, data + size));
  return 0;
}
