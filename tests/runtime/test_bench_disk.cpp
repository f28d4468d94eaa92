// berth bench disk (bench/disk_bench.h) on a small file: every block is read once per run (the
// run ends when the permutation is used up, long before its time), the JSON holds every run,
// and bad options are refused with the right category. No timing assertions.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "berth/bench/disk_bench.h"
#include "berth/core/error.h"
#include "test_util.h"

using namespace berth;

namespace {

std::string make_file(const std::string& name, size_t bytes) {
  const auto path = test::temp_dir("bench-disk") / name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  std::vector<char> chunk(bytes, 'x');
  out.write(chunk.data(), static_cast<std::streamsize>(bytes));
  return path.string();
}

ErrorCategory category_of(const bench::DiskBenchOptions& o) {
  try {
    bench::run_disk_bench(o);
  } catch (const Error& e) {
    return e.category();
  }
  FAIL("no berth::Error thrown");
  return ErrorCategory::internal;
}

}  // namespace

TEST_CASE("bench disk reads every block of a small file once per run") {
  bench::DiskBenchOptions o;
  o.path = make_file("six.bin", (size_t{6} << 20) + 100);
  o.queue_depth = 4;
  o.block_bytes = {size_t{1} << 20, size_t{512} << 10};
  o.seconds = 60;  // not reached: 6 and 12 blocks
  o.repetitions = 2;
  int lines = 0;
  o.progress = [&](std::string_view) { ++lines; };
  const bench::DiskBenchResult r = bench::run_disk_bench(o);
  const bool uring = r.io_uring.rfind("io_uring with O_DIRECT, queue depth 4", 0) == 0;
  if (!uring) MESSAGE("io_uring runs skipped: " << r.io_uring);

  std::vector<std::string> methods;
  if (uring) methods = {"io_uring O_DIRECT", "io_uring O_DIRECT"};
  methods.insert(methods.end(), {"pread pool", "mmap"});
  const size_t m = methods.size();
  // Per block size, per repetition, every method.
  REQUIRE(r.runs.size() == 2 * 2 * m);
  for (size_t i = 0; i < r.runs.size(); ++i) {
    const bench::DiskBenchRun& x = r.runs[i];
    CAPTURE(i);
    const size_t block = i < 2 * m ? size_t{1} << 20 : size_t{512} << 10;
    CHECK(x.method == methods[i % m]);
    const bool one = (uring && i % m == 1) || x.method == "mmap";  // depth-1 runs
    CHECK(x.depth == (one ? 1u : 4u));
    CHECK(x.repetition == static_cast<int>((i / m) % 2));
    CHECK(x.block_bytes == block);
    CHECK(x.reads == (size_t{6} << 20) / block);
    CHECK(x.bytes == size_t{6} << 20);
    CHECK(x.gbps > 0);
    CHECK(std::isfinite(x.gbps));
    CHECK(x.cached_fraction >= 0);
    CHECK(x.cached_fraction <= 1);
    // O_DIRECT reads come from the device (its counter, where the file has one, also counts
    // other readers of the device).
    if (x.method == "io_uring O_DIRECT" && x.device_bytes != -1)
      CHECK(x.device_bytes >= static_cast<int64_t>(x.bytes));
  }
  CHECK(lines == static_cast<int>(r.runs.size()));
  REQUIRE(r.summary.size() == 2 * m);
  for (size_t g = 0; g < r.summary.size(); ++g) {
    const bench::DiskBenchSummary& s = r.summary[g];
    CAPTURE(g);
    CHECK(s.method == methods[g % m]);
    const bench::DiskBenchRun& a = r.runs[(g / m) * 2 * m + g % m];
    const bench::DiskBenchRun& b = r.runs[(g / m) * 2 * m + m + g % m];
    CHECK(s.gbps_min == std::min(a.gbps, b.gbps));
    CHECK(s.gbps_max == std::max(a.gbps, b.gbps));
    CHECK(s.gbps_median == doctest::Approx((a.gbps + b.gbps) / 2));
  }

  const nlohmann::json j = bench::to_json(r);
  CHECK(j["benchmark"] == "berth bench disk");
  CHECK(j["file"]["bytes"] == (size_t{6} << 20) + 100);
  CHECK(j["config"]["block_bytes"] == nlohmann::json::array({1048576, 524288}));
  CHECK(j["config"]["queue_depth"] == 4);
  CHECK(j["config"]["repetitions"] == 2);
  REQUIRE(j["runs"].size() == r.runs.size());
  CHECK(j["runs"][0]["reads"] == 6);
  CHECK(j["runs"][0]["device_bytes"] == r.runs[0].device_bytes);
  CHECK(j["summary"].size() == r.summary.size());
  CHECK(bench::format_text(r).find("method") != std::string::npos);
}

TEST_CASE("bench disk refuses bad options with the right category") {
  bench::DiskBenchOptions o;
  o.path = make_file("small.bin", 8192);
  o.block_bytes = {1000};
  CHECK(category_of(o) == ErrorCategory::invalid_argument);
  o.block_bytes = {16384};  // larger than the file
  CHECK(category_of(o) == ErrorCategory::invalid_argument);
  o.block_bytes = {4096};
  o.queue_depth = 0;
  CHECK(category_of(o) == ErrorCategory::invalid_argument);
  o.queue_depth = 2;
  o.seconds = 0;
  CHECK(category_of(o) == ErrorCategory::invalid_argument);
  o.seconds = 1;
  o.repetitions = 0;
  CHECK(category_of(o) == ErrorCategory::invalid_argument);
  o.repetitions = 1;
  o.path += ".missing";
  CHECK(category_of(o) == ErrorCategory::io);
}
