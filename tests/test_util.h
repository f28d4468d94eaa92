// Helpers shared by the test suites.
#pragma once

#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <initializer_list>
#include <mutex>
#include <string>
#include <vector>

#include "berth/core/error.h"

namespace berth::test {

/// Calls f; requires an Error of `cat` whose message contains every needle.
template <class F>
void expect_error(ErrorCategory cat, F&& f, std::initializer_list<std::string> needles) {
  try {
    f();
    FAIL("no error thrown");
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(e.category() == cat);
    for (const std::string& n : needles) CHECK(std::string(e.what()).find(n) != std::string::npos);
  }
}

/// ../shared next to the repository (CI has it at the same relative path).
inline std::filesystem::path shared_dir() { return BERTH_SHARED_DIR; }
inline std::filesystem::path stories260k() { return shared_dir() / "models" / "stories260K.gguf"; }

namespace detail {
/// The temp_dir folders of this process, removed with their contents when it exits normally
/// (a test binary's runs used to leave ~1 GB in /tmp each, until the disk filled). A forked
/// child that exits leaves them to the process that made them; BERTH_KEEP_TEST_FILES=1 keeps
/// them for a post-mortem.
struct TempDirs {
  pid_t owner = ::getpid();
  std::mutex mu;
  std::vector<std::filesystem::path> dirs;
  ~TempDirs() {
    if (::getpid() != owner || std::getenv("BERTH_KEEP_TEST_FILES") != nullptr) return;
    std::error_code ec;
    for (const auto& d : dirs) std::filesystem::remove_all(d, ec);
  }
};
inline TempDirs& temp_dirs() {
  static TempDirs t;
  return t;
}
}  // namespace detail

/// A temporary directory for `tag` in this process (the same path on every call with the same
/// tag), removed at normal process exit (detail::TempDirs).
inline std::filesystem::path temp_dir(const std::string& tag) {
  auto p = std::filesystem::temp_directory_path() /
           ("berth-test-" + tag + "-" + std::to_string(::getpid()));
  std::filesystem::create_directories(p);
  detail::TempDirs& t = detail::temp_dirs();
  const std::lock_guard<std::mutex> lock(t.mu);
  if (std::find(t.dirs.begin(), t.dirs.end(), p) == t.dirs.end()) t.dirs.push_back(p);
  return p;
}

}  // namespace berth::test

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace berth::test {

/// What a child process did: exit code (or the signal that killed it) and its output.
struct CommandResult {
  int exit_code = -1;     ///< valid when !signaled
  bool signaled = false;  ///< killed by a signal (a crash)
  int signal = 0;
  std::string out, err;
};

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// Runs `args` (already shell-quoted where needed) through /bin/sh, capturing stdout/stderr
/// (of every process of a pipeline) and giving it no stdin.
inline CommandResult run_command(const std::string& args) {
  static int counter = 0;
  const auto dir = temp_dir("cmd");
  const auto out = dir / ("out" + std::to_string(counter));
  const auto err = dir / ("err" + std::to_string(counter++));
  // Braces: the redirections apply to the whole command, pipelines included.
  const std::string cmd =
      "{ " + args + "; } >" + out.string() + " 2>" + err.string() + " </dev/null";
  const int status = std::system(cmd.c_str());
  CommandResult r;
  if (WIFEXITED(status)) {
    r.exit_code = WEXITSTATUS(status);
    // sh reports a child killed by signal N as exit code 128 + N.
    if (r.exit_code > 128 && r.exit_code < 160) {
      r.signaled = true;
      r.signal = r.exit_code - 128;
    }
  } else if (WIFSIGNALED(status)) {
    r.signaled = true;
    r.signal = WTERMSIG(status);
  }
  r.out = read_file(out);
  r.err = read_file(err);
  return r;
}

/// Single-quotes `s` for /bin/sh.
inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += (c == '\'') ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

/// The berth executable under test.
inline std::string berth_bin() { return BERTH_BIN; }

/// The 64 greedy tokens stories260K generates after "Once upon a time" (with BOS), as text
/// (../shared/models/README.md).
inline const std::string kStoriesContinuation =
    ", there was a little girl named Lily. She loved to play outside in the park. One day, she "
    "saw a big, red ball. She wanted to play with it, but it was too high.\nLily's mom said";

}  // namespace berth::test
