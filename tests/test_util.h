// Helpers shared by the test suites.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <unistd.h>

namespace berth::test {

/// ../shared next to the repository (CI has it at the same relative path).
inline std::filesystem::path shared_dir() { return BERTH_SHARED_DIR; }
inline std::filesystem::path stories260k() { return shared_dir() / "models" / "stories260K.gguf"; }

/// A fresh, empty temporary directory for one test (removed at process exit is not promised).
inline std::filesystem::path temp_dir(const std::string& tag) {
  auto p = std::filesystem::temp_directory_path() /
           ("berth-test-" + tag + "-" + std::to_string(::getpid()));
  std::filesystem::create_directories(p);
  return p;
}

}  // namespace berth::test
