// The cost model of the split of streamed layers (scheduler/stream_split.h): the expected tokens
// per expert, the choice of the experts the CPU computes, and the --stream-split spec.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "berth/core/error.h"
#include "berth/scheduler/stream_split.h"

using namespace berth;

TEST_CASE("expected_tokens: calls shared by decayed counts with half a call of prior each") {
  // No history: uniform.
  const std::vector<double> u = expected_tokens(std::vector<double>(4, 0.0), 16, 2);
  for (double t : u) CHECK(t == doctest::Approx(8.0));
  // counts {6.5, 0.5, 0, 1}: (c + 0.5) / (8 + 2) of 32 calls.
  const std::vector<double> t = expected_tokens(std::vector<double>{6.5, 0.5, 0, 1}, 16, 2);
  CHECK(t[0] == doctest::Approx(32 * 7.0 / 10));
  CHECK(t[1] == doctest::Approx(32 * 1.0 / 10));
  CHECK(t[2] == doctest::Approx(32 * 0.5 / 10));
  CHECK(t[3] == doctest::Approx(32 * 1.5 / 10));
}

TEST_CASE("choose_cpu_experts: the CPU takes its cheapest experts while that shortens the step") {
  // 1 GB experts; PCIe 10 GB/s: a copy takes 0.1 s. DRAM 10 GB/s, 1 GFLOP per token, CPU 100
  // GFLOP/s: an expert with t tokens costs the CPU (1 - e^-t) 0.1 s + t 0.01 s.
  const ExpertCost cost{.bytes = 1e9, .flops_per_token = 1e9};
  const StreamRates r{.pcie_gbps = 10, .dram_gbps = 10, .cpu_gflops = 100};
  // Four experts: 0 and 20 tokens expected for two each. CPU costs: 0, 0, 0.3, 0.3 (rounded).
  const std::vector<double> t = {20, 0, 20, 0};
  const std::vector<uint8_t> c = choose_cpu_experts(t, cost, r);
  // Taking the two unused experts: CPU 0 s, copy 0.2 s; a third (0.3 s) would make it 0.3 s.
  CHECK(c == std::vector<uint8_t>{0, 1, 0, 1});
  const SplitTimes st = split_times(t, c, cost, r);
  CHECK(st.cpu == doctest::Approx(0.0));
  CHECK(st.copy == doctest::Approx(0.2));
  // Uniform 1 token each: CPU (1 - e^-1) 0.1 + 0.01 = 0.0732 s per expert against a 0.1 s copy.
  // m experts on the CPU: max(0.0732 m, 0.1 (4 - m)): m = 2 gives max(0.146, 0.2) = 0.2,
  // m = 3 gives max(0.220, 0.1) = 0.220: two.
  const std::vector<double> one(4, 1.0);
  const std::vector<uint8_t> c1 = choose_cpu_experts(one, cost, r);
  CHECK(c1 == std::vector<uint8_t>{1, 1, 0, 0});  // equal costs: the lowest ids first
  // A CPU twice as slow (scale 2): 0.146 m against 0.1 (4 - m): m = 2 gives 0.293, m = 1 0.3:
  // two still. Four times as slow: m = 1 gives max(0.293, 0.3) = 0.3, m = 2 0.586: one.
  CHECK(choose_cpu_experts(one, cost, r, 2.0) == std::vector<uint8_t>{1, 1, 0, 0});
  CHECK(choose_cpu_experts(one, cost, r, 4.0) == std::vector<uint8_t>{1, 0, 0, 0});
  // Many tokens each: the CPU is never worth it.
  const std::vector<double> many(4, 1000.0);
  CHECK(choose_cpu_experts(many, cost, r) == std::vector<uint8_t>(4, 0));
  // A rate not given or not usable: everything streams.
  for (const StreamRates& bad : {StreamRates{0, 10, 100}, StreamRates{10, 0, 100},
                                 StreamRates{10, 10, 0}, StreamRates{10, 10, NAN}})
    CHECK(choose_cpu_experts(t, cost, bad) == std::vector<uint8_t>(4, 0));
  CHECK(choose_cpu_experts(std::vector<double>{}, cost, r).empty());
}

TEST_CASE("parse_stream_split: on, off, rates; bad items named") {
  bool on = false;
  StreamRates r = parse_stream_split("on", on);
  CHECK(on);
  CHECK(r.pcie_gbps == 0);
  r = parse_stream_split("off", on);
  CHECK_FALSE(on);
  r = parse_stream_split("pcie=52.5,cpu=900", on);
  CHECK(on);
  CHECK(r.pcie_gbps == 52.5);
  CHECK(r.dram_gbps == 0);
  CHECK(r.cpu_gflops == 900);
  CHECK(format_stream_rates(StreamRates{52.5, 80, 900}) == "pcie=52.5,dram=80.0,cpu=900");
  for (const char* bad : {"", "auto", "pcie", "pcie=", "pcie=0", "pcie=-1", "pcie=1x", "dram=inf",
                          "gpu=3", "pcie=1,pcie=2", "pcie=1,", "pcie=nan"}) {
    CAPTURE(bad);
    try {
      (void)parse_stream_split(bad, on);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.category() == ErrorCategory::invalid_argument);
      CHECK(std::string(e.what()).find("--stream-split") != std::string::npos);
    }
  }
}
