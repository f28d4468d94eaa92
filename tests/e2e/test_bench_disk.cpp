// `berth bench disk` through the executable: the JSON of a run on a small file, and the exit
// status and message of bad flags and a missing file. No speed is asserted.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "test_util.h"

namespace {

using berth::test::CommandResult;
using berth::test::run_command;
using berth::test::shell_quote;

}  // namespace

TEST_CASE("bench disk: JSON of a small file, and bad input") {
  const auto dir = berth::test::temp_dir("bench-disk-cli");
  const std::string file = (dir / "data.bin").string();
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    const std::vector<char> bytes(size_t{1} << 20, 'y');
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  const std::string bench = berth::test::berth_bin() + " bench disk -m " + shell_quote(file);

  // 1 MiB in 64 KiB blocks: 16 reads per run; the JSON on stdout, the table on stderr.
  CommandResult r = run_command(bench + " --qd 2 --block-kib 64 --seconds 30 -q --json -");
  CAPTURE(r.err);
  REQUIRE(r.exit_code == 0);
  const nlohmann::json j = nlohmann::json::parse(r.out);
  CHECK(j["benchmark"] == "berth bench disk");
  CHECK(j["config"]["queue_depth"] == 2);
  CHECK(j["config"]["block_bytes"] == nlohmann::json::array({65536}));
  REQUIRE(j["runs"].size() >= 2);  // pread pool and mmap, and io_uring where it works
  for (const auto& run : j["runs"]) {
    CHECK(run["reads"] == 16);
    CHECK(run["bytes"] == 1048576);
  }
  CHECK(r.err.find("device/asked") != std::string::npos);

  r = run_command(bench + " --block-kib 6");
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("block size 6144 bytes is not a positive multiple of 4096") !=
        std::string::npos);
  r = run_command(bench + " --qd 0");
  CHECK(r.exit_code == 2);
  r = run_command(bench + " --block-kib 2048");
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("the file (1048576 bytes) is smaller than one 2097152-byte block") !=
        std::string::npos);
  r = run_command(berth::test::berth_bin() + " bench disk -m " + shell_quote(file + ".none"));
  CHECK(r.exit_code == 1);
  CHECK(r.err.find(file + ".none: cannot open: No such file or directory") != std::string::npos);
}
