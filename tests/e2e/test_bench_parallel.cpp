// `berth bench model --parallel`: N sequences decoding together. The rows obey the relations
// batch_bench.h states (aggregate = N x per sequence, bound from the bytes and bandwidths), the
// distinct experts per layer per step lie between n_expert_used and min(N x n_expert_used,
// n_expert), one sequence reads exactly n_expert_used, and bad counts are refused; the table goes
// to standard output once, standard error holding only progress. No speed is asserted.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "test_util.h"

namespace {

using berth::test::CommandResult;
using berth::test::run_command;
using berth::test::shell_quote;

bool near(double a, double b) { return std::abs(a - b) <= 1e-9 * std::max(std::abs(a), 1.0); }

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

}  // namespace

TEST_CASE("bench model --parallel: rows, expert counts and bounds") {
  const auto dir = berth::test::temp_dir("bench_parallel");
  const std::string model = (dir / "moe.gguf").string();
  REQUIRE(run_command(berth::test::berth_bin() +
                      " synth --preset tiny-qwen3moe --type q8_0 --router-skew 1 -o " +
                      shell_quote(model))
              .exit_code == 0);
  for (const std::string env : {"", "BERTH_SIM_DEVICE=1G"}) {
    CAPTURE(env);
    const auto out = dir / "p.json";
    const CommandResult r =
        run_command(env + " " + berth::test::berth_bin() + " bench model -m " + shell_quote(model) +
                    " -p 8 -n 6 -r 1 -t 2 -q --parallel 1,3,8 " +
                    (env.empty() ? "-ngl 0" : "-ngl 99") + " --json " + shell_quote(out.string()));
    CAPTURE(r.err);
    REQUIRE(r.exit_code == 0);
    std::ifstream in(out);
    const nlohmann::json j = nlohmann::json::parse(in);
    CHECK(j["device"].get<std::string>().empty() == env.empty());
    const auto& rows = j["parallel"];
    REQUIRE(rows.size() == 3);
    const int k = 2, n_expert = 8;  // tiny-qwen3moe
    const int ns[] = {1, 3, 8};
    for (size_t i = 0; i < 3; ++i) {
      const auto& x = rows[i];
      CAPTURE(i);
      CHECK(x["n_seq"].get<int>() == ns[i]);
      CHECK(near(x["agg_tok_s"].get<double>(), ns[i] * x["seq_tok_s"].get<double>()));
      CHECK(x["experts_exact"].get<bool>());
      const double e = x["experts_per_layer"].get<double>();
      if (ns[i] == 1) {
        CHECK(e == k);  // a token's top-k experts are distinct
      } else {
        CHECK(e >= k);
        CHECK(e <= std::min(ns[i] * k, n_expert));
      }
      const double host = x["host_bytes_per_step"].get<double>();
      const double devb = x["device_bytes_per_step"].get<double>();
      const double t = host / (j["dram_gbps"].get<double>() * 1e9) +
                       (devb > 0 ? devb / (j["hbm_gbps"].get<double>() * 1e9) : 0.0);
      CHECK(near(x["bound_tok_s"].get<double>(), ns[i] / t));
      CHECK(near(x["fraction_of_bound"].get<double>(),
                 x["agg_tok_s"].get<double>() / x["bound_tok_s"].get<double>()));
    }
  }
  // Usage errors (exit 2) name the flag and the item, as -p's list parser does.
  for (const auto& [bad, says] : std::vector<std::pair<std::string, std::string>>{
           {"--parallel 0", "--parallel: 0 in '0' is below the minimum 1"},
           {"--parallel 2,x", "--parallel: 'x' is not a whole number or a range"},
           {"--parallel 1,,2", "--parallel: an empty item in '1,,2'"},
           {"--parallel 4097", "--parallel: 4097 in '4097' is above the maximum 4096"}}) {
    CAPTURE(bad);
    const CommandResult r = run_command(berth::test::berth_bin() + " bench model -m " +
                                        shell_quote(model) + " -p 4 -q " + bad);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find(says) != std::string::npos);
  }
  {  // A range as -p takes it: 1-4*2 is N = 1, 2, 4.
    const CommandResult r =
        run_command(berth::test::berth_bin() + " bench model -m " + shell_quote(model) +
                    " -p 4 -n 2 -r 1 -t 2 -q -ngl 0 --parallel 1-4*2 --json -");
    REQUIRE(r.exit_code == 0);
    const auto j = nlohmann::json::parse(r.out);
    REQUIRE(j["parallel"].size() == 3);
    CHECK(j["parallel"][2]["n_seq"].get<int>() == 4);
  }
  {  // -c: the KV cache over all sequences, c / N each, as a server's slots.
    const CommandResult ok =
        run_command(berth::test::berth_bin() + " bench model -m " + shell_quote(model) +
                    " -p 4 -n 2 -r 1 -t 2 -q -ngl 0 --parallel 1,4 -c 24 --greedy --json -");
    REQUIRE(ok.exit_code == 0);
    const auto j = nlohmann::json::parse(ok.out);
    CHECK(j["n_ctx"].get<int64_t>() == 24);
    CHECK(j["greedy"].get<bool>());
    REQUIRE(j["parallel"].size() == 2);
    CHECK(j["parallel"][1]["agg_tok_s"].get<double>() > 0);
    // 25 / 5 = 5 tokens per sequence < -p 4 + -n 2: refused before any row runs.
    const CommandResult few =
        run_command(berth::test::berth_bin() + " bench model -m " + shell_quote(model) +
                    " -p 4 -n 2 -r 1 -t 2 -q -ngl 0 --parallel 1,5 -c 25");
    CHECK(few.exit_code != 0);
    CHECK(!few.signaled);
    CHECK(few.out.empty());
    CHECK(few.err.find("-c 25 gives each of 5 sequences 5 tokens, fewer than -p 4 + -n 2") !=
          std::string::npos);
    const CommandResult alone = run_command(berth::test::berth_bin() + " bench model -m " +
                                            shell_quote(model) + " -p 4 -n 2 -q -c 64");
    CHECK(alone.exit_code == 2);
    CHECK(alone.err.find("-c and --greedy apply to --parallel only") != std::string::npos);
  }
  for (const std::string bad : {"--parallel 2 -n 0"}) {
    CAPTURE(bad);
    const CommandResult r = run_command(berth::test::berth_bin() + " bench model -m " +
                                        shell_quote(model) + " -p 4 -q " + bad);
    CHECK(r.exit_code != 0);
    CHECK(!r.signaled);
    CHECK(r.err.find("parallel") != std::string::npos);
  }
}

TEST_CASE(
    "bench model --parallel: the table once, on standard output; progress on standard error") {
  const CommandResult r = run_command(berth::test::berth_bin() + " bench model -m " +
                                      shell_quote(berth::test::stories260k().string()) +
                                      " -p 8 -n 4 -r 2 -t 1 --dram-mib 64 --parallel 1,2");
  CAPTURE(r.out);
  CAPTURE(r.err);
  REQUIRE(r.exit_code == 0);
  // A row of the table: N, tok/s, tok/s/seq, ...
  const std::regex row(R"(^ *(\d+) +\d+\.\d +\d+\.\d +.*%$)");
  const std::vector<std::string> out = lines_of(r.out);
  std::vector<int> ns;
  for (const std::string& line : out)
    if (std::smatch m; std::regex_match(line, m, row)) ns.push_back(std::stoi(m[1]));
  CHECK(ns == std::vector<int>{1, 2});
  CHECK(out.size() == 5);  // the model line, DRAM, the header and the two rows
  // Standard error: the DRAM measurement and a line per run of each N (a warm-up, then -r 2);
  // no row of the table, and nothing of its summary.
  const std::vector<std::string> err = lines_of(r.err);
  int n_runs = 0;
  for (const std::string& line : err) {
    CAPTURE(line);
    CHECK(!std::regex_match(line, row));
    CHECK(line.find("bound") == std::string::npos);
    CHECK(line.find("per sequence") == std::string::npos);
    if (line.rfind("N=", 0) == 0 && line.find(" run ") != std::string::npos) ++n_runs;
  }
  CHECK(n_runs == 2 * 3);
  CHECK(err.size() == 1 + 2 * 3);
}
