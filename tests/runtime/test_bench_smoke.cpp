// Smoke test of the kernel benchmark library (berth bench kernels --quick): it runs, fills every
// field of its JSON with sensible values and its GEMM agrees bit for bit with the per-token GEMV.
// No timing assertions: only that rates are positive and finite.
#include <doctest/doctest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "berth/bench/kernel_bench.h"
#include "berth/core/error.h"

using namespace berth;

namespace {

bool positive(const nlohmann::json& v) {
  return v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() > 0;
}

}  // namespace

TEST_CASE("bench kernels --quick on q4_0 fills every JSON field with positive numbers") {
  bench::KernelBenchOptions o;
  o.quick = true;
  o.types = bench::parse_type_list("q4_0");
  o.threads = {1};
  o.dram_bytes = 4 << 20;  // smaller than --quick: the suite also runs under ASan
  o.gemv_bytes = 2 << 20;
  o.ubatches = {1, 7, 32};
  o.few_tokens = {3, 2, 3};  // resolved to 1, 3, 2: 1 first, each count once
  int progress_lines = 0;
  o.progress = [&](std::string_view) { ++progress_lines; };
  bench::KernelBenchResult r = bench::run_kernel_bench(o);
  const nlohmann::json j = bench::to_json(r);

  CHECK(j["benchmark"] == "berth bench kernels");
  CHECK(j["date"].get<std::string>().size() == 20);  // 2025-01-31T12:34:56Z
  const auto& m = j["machine"];
  for (const char* k : {"hostname", "cpu_model", "build"}) {
    CAPTURE(k);
    REQUIRE(m.contains(k));
    CHECK(m[k].is_string());
  }
  CHECK(m["physical_cores"].get<int>() >= 1);
  CHECK(m["logical_cpus"].get<int>() >= 1);
  CHECK(m["cpu_flags"].is_array());
  CHECK(m["simd_targets"].size() >= 1);
  CHECK(j["timing"]["repetitions"] == 2);
  CHECK(j["config"]["types"] == nlohmann::json::array({"q4_0"}));
  CHECK(j["config"]["gemm_rows"] == 256);

  REQUIRE(j["dram"].size() == 1);
  CHECK(j["dram"][0]["threads"] == 1);
  CHECK(positive(j["dram"][0]["gbps"]));
  CHECK(positive(j["dram"][0]["gbps_best"]));
  CHECK(j["dram"][0]["gbps_best"].get<double>() >= j["dram"][0]["gbps"].get<double>());

  REQUIRE(j["gemv"].size() == 1);
  const auto& g = j["gemv"][0];
  CHECK(g["type"] == "q4_0");
  CHECK(g["cols"] == 4096);
  CHECK(g["rows"].get<int64_t>() % 16 == 0);
  // 4096 q4_0 elements are 128 blocks of 18 bytes.
  CHECK(g["weight_bytes"].get<int64_t>() == g["rows"].get<int64_t>() * 128 * 18);
  for (const char* k : {"gbps", "gbps_best", "ratio_to_dram", "dram_paired_gbps"}) {
    CAPTURE(k);
    CHECK(positive(g[k]));
  }
  // The fraction is the median of the pairs' ratios (two runs: their mean).
  REQUIRE(g["pair_ratios"].size() == 2);
  CHECK(g["ratio_to_dram"].get<double>() ==
        doctest::Approx(0.5 *
                        (g["pair_ratios"][0].get<double>() + g["pair_ratios"][1].get<double>())));
  CHECK(j["config"]["threads_run"] == nlohmann::json::array({1}));

  REQUIRE(j["gemm"].size() == 3);
  int64_t ub[3] = {1, 7, 32};
  for (size_t i = 0; i < 3; ++i) {
    const auto& e = j["gemm"][i];
    CAPTURE(i);
    CHECK(e["ubatch"] == ub[i]);
    for (const char* k : {"tok_s", "tok_s_best", "gflops", "gemv_tok_s", "speedup_vs_gemv",
                          "decode_tok_s", "speedup_vs_decode"}) {
      CAPTURE(k);
      CHECK(positive(e[k]));
    }
    // Determinism (quant_dot.h): the tiled GEMM gives the GEMV's bits for every token.
    CHECK(e["matches_gemv"] == true);
  }

  REQUIRE(j["l2_gemv"].size() == 1);
  CHECK(j["l2_gemv"][0]["rows"] == 64);  // 64 rows of 2304 bytes fit the 256 KiB budget
  CHECK(positive(j["l2_gemv"][0]["gflops"]));

  // Few-token GEMM: 768 x 2048 experts (2 of them: the 2 MiB budget holds 2, and at least 2 per
  // thread), tokens 1, 3, 2, the per-token GEMV's bits.
  REQUIRE(j["few_tok"].size() == 3);
  CHECK(j["config"]["few_tokens"] == nlohmann::json::array({1, 3, 2}));
  const int64_t few_tok[3] = {1, 3, 2};
  for (size_t i = 0; i < 3; ++i) {
    const auto& f = j["few_tok"][i];
    CAPTURE(i);
    CHECK(f["type"] == "q4_0");
    CHECK(f["n_tok"] == few_tok[i]);
    CHECK(f["rows"] == 768);
    CHECK(f["cols"] == 2048);
    CHECK(f["experts"] == 2);
    // 2048 q4_0 elements are 64 blocks of 18 bytes.
    CHECK(f["weight_bytes"].get<int64_t>() == 2 * 768 * 64 * 18);
    for (const char* k : {"gbps", "gbps_best", "ratio_to_one", "gemv_gbps", "speedup_vs_gemv"}) {
      CAPTURE(k);
      CHECK(positive(f[k]));
    }
    CHECK(f["matches_gemv"] == true);
  }
  CHECK(j["few_tok"][0]["ratio_to_one"].get<double>() == 1.0);

  // One progress line per measurement: dram, gemv, 3 gemm, 3 few-token, l2.
  CHECK(progress_lines == 9);
  const std::string text = bench::format_text(r);
  CHECK(text.find("DRAM read bandwidth") != std::string::npos);
  CHECK(text.find("q4_0") != std::string::npos);
  CHECK(text.find("Few-token GEMM") != std::string::npos);
}

TEST_CASE("bench kernels option lists reject bad input with the right category") {
  CHECK(bench::parse_type_list("q4_K, q8_0,q4_K") ==
        std::vector<GgmlType>{GgmlType::Q4_K, GgmlType::Q8_0});
  CHECK(bench::parse_thread_list("1,2,16") == std::vector<int>{1, 2, 16});
  auto category = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return e.category();
    }
    return ErrorCategory::internal;  // nothing thrown
  };
  CHECK(category([] { bench::parse_type_list("q4_9"); }) == ErrorCategory::invalid_argument);
  CHECK(category([] { bench::parse_type_list("iq2_xxs"); }) == ErrorCategory::unsupported);
  CHECK(category([] { bench::parse_type_list(""); }) == ErrorCategory::invalid_argument);
  CHECK(category([] { bench::parse_thread_list("1,0"); }) == ErrorCategory::invalid_argument);
  CHECK(category([] { bench::parse_thread_list("two"); }) == ErrorCategory::invalid_argument);
  bench::KernelBenchOptions o;
  o.quick = true;
  o.types = {GgmlType::Q8_0};
  o.threads = {1};
  o.gemm_cols = 100;  // not a multiple of 256
  CHECK(category([&] { bench::run_kernel_bench(o); }) == ErrorCategory::invalid_argument);
  o.gemm_cols = 0;
  o.few_cols = 1000;  // not a multiple of 256
  CHECK(category([&] { bench::run_kernel_bench(o); }) == ErrorCategory::invalid_argument);
  o.few_cols = 0;
  o.few_tokens = {2, 0};
  CHECK(category([&] { bench::run_kernel_bench(o); }) == ErrorCategory::invalid_argument);
}
