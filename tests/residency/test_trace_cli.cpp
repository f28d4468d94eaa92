// `berth trace gen | stats | dump` end to end through the executable.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <regex>

#include "test_util.h"

namespace {

using berth::test::run_command;
using berth::test::shell_quote;

// The percentage after "<policy> cache of <fraction>% (...): " in `berth trace stats` output.
double served(const std::string& out, const std::string& line_start) {
  const size_t at = out.find(line_start);
  REQUIRE(at != std::string::npos);
  std::smatch m;
  const std::string line = out.substr(at, out.find('\n', at) - at);
  REQUIRE(std::regex_search(line, m, std::regex(R"(: ([0-9.]+)% of routed calls served)")));
  return std::stod(m[1]) / 100.0;
}

}  // namespace

TEST_CASE("berth trace: gen, stats and dump") {
  const std::string bin = berth::test::berth_bin();
  const auto dir = berth::test::temp_dir("trace-cli");
  const std::string file = shell_quote((dir / "loc.trace").string());

  auto r =
      run_command(bin + " trace gen --preset locality --tokens 3000 --n-prompt 10 -s 5 -o " + file);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("'locality' routing trace") != std::string::npos);
  CHECK(r.out.find("3000 tokens (10 prefill), 48 MoE layers x 128 experts, top-8, seed 5") !=
        std::string::npos);
  CHECK(std::filesystem::file_size(dir / "loc.trace") == 32 + 4 * 48 + 3000 * 385);
  // gen prints the trace's LRU hit rates (the generator's check), the lines `trace stats` prints.
  const std::string lru12 = "lru cache of 12.5% (16 of 128 experts per layer)";
  const std::string lru25 = "lru cache of 25% (32 of 128 experts per layer)";
  CHECK(std::abs(served(r.out, lru12) - 0.67) <= 0.03);
  CHECK(std::abs(served(r.out, lru25) - 0.81) <= 0.03);
  CHECK(r.out.find("lfu-decay") == std::string::npos);
  const std::string gen_lru = r.out.substr(r.out.find(lru12));

  r = run_command(bin + " trace stats " + file);
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find(gen_lru) != std::string::npos);
  CHECK(r.out.find("3000 tokens (10 prefill, 2990 decode), 48 MoE layers (blocks 0..47), 128 "
                   "experts, top-8, without weights") != std::string::npos);
  CHECK(r.out.find("routed calls: 1152000 (24000 per MoE layer)") != std::string::npos);
  CHECK(std::abs(served(r.out, "lru cache of 12.5% (16 of 128 experts per layer)") - 0.67) <= 0.03);
  CHECK(std::abs(served(r.out, "lru cache of 25% (32 of 128 experts per layer)") - 0.81) <= 0.03);
  CHECK(served(r.out, "lfu-decay(h=64) cache of 12.5%") > 0.5);
  CHECK(r.out.find("experts covering 90% of routed calls: ") != std::string::npos);

  // Dump: 2 header lines, then 48 lines per token.
  r = run_command(bin + " trace dump " + file + " --first 9 --count 2");
  REQUIRE(r.exit_code == 0);
  CHECK(std::count(r.out.begin(), r.out.end(), '\n') == 2 + 2 * 48);
  CHECK(r.out.find("\n9 prefill 0 0: ") != std::string::npos);
  CHECK(r.out.find("\n10 decode 47 47: ") != std::string::npos);
  // A closed pipe stops the dump quietly.
  r = run_command(bin + " trace dump " + file + " | head -3");
  CHECK(r.exit_code == 0);
  CHECK(std::count(r.out.begin(), r.out.end(), '\n') == 3);

  // Uniform through the CLI: the hit rate is the cached fraction.
  const std::string ufile = shell_quote((dir / "u.trace").string());
  r = run_command(bin + " trace gen --preset uniform --tokens 2000 -o " + ufile + " && " + bin +
                  " trace stats " + ufile);
  REQUIRE(r.exit_code == 0);
  CHECK(std::abs(served(r.out, "lru cache of 12.5%") - 0.125) <= 0.01);
}

TEST_CASE("berth trace: errors") {
  const std::string bin = berth::test::berth_bin();
  const auto dir = berth::test::temp_dir("trace-cli-errors");
  const std::string bad = (dir / "bad.trace").string();
  {
    std::ofstream out(bad, std::ios::binary);
    out << "GGUF and not a trace at all, but long enough for a header";
  }
  auto r = run_command(bin + " trace stats " + shell_quote(bad));
  CHECK(r.exit_code == 1);
  CHECK(r.out.empty());
  CHECK(r.err == "berth: error: " + bad +
                     ": byte 0: bad magic 'GGUF' (expected 'BRTR'): not a berth routing trace\n");
  r = run_command(bin + " trace dump " + shell_quote((dir / "none").string()));
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("cannot open routing trace") != std::string::npos);

  const std::string out = shell_quote((dir / "x.trace").string());
  r = run_command(bin + " trace gen --preset zipf --tokens 10 -o " + out);
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--preset") != std::string::npos);
  r = run_command(bin + " trace gen --tokens 0 -o " + out);
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("--tokens 0 is outside") != std::string::npos);
  r = run_command(bin + " trace gen --tokens 10 --n-expert-used 200 -o " + out);
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("--n-expert-used 200 is outside 1..128") != std::string::npos);
  r = run_command(bin + " trace gen --tokens 10");
  CHECK(r.exit_code == 2);
  r = run_command(bin + " trace frobnicate");
  CHECK(r.exit_code == 2);
  CHECK(
      r.err.find("'frobnicate' is not a subcommand of 'berth trace' (one of: gen, stats, dump)") !=
      std::string::npos);
}
