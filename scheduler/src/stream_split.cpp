#include "berth/scheduler/stream_split.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "berth/core/error.h"

namespace berth {

StreamRates parse_stream_split(std::string_view spec, bool& on) {
  StreamRates r;
  on = true;
  if (spec == "on") return r;
  if (spec == "off") {
    on = false;
    return r;
  }
  const auto bad = [&](std::string_view item, std::string_view why) {
    return Error(ErrorCategory::invalid_argument,
                 fmt::format("--stream-split '{}': '{}' {} (expected on, off, or comma-separated "
                             "pcie=GBPS, dram=GBPS, cpu=GFLOPS)",
                             spec, item, why));
  };
  size_t at = 0;
  bool seen[3] = {false, false, false};
  while (at <= spec.size()) {
    const size_t comma = std::min(spec.find(',', at), spec.size());
    const std::string_view item = spec.substr(at, comma - at);
    at = comma + 1;
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) throw bad(item, "is not KEY=VALUE");
    const std::string_view key = item.substr(0, eq);
    const std::string value(item.substr(eq + 1));
    int which = key == "pcie" ? 0 : key == "dram" ? 1 : key == "cpu" ? 2 : -1;
    if (which < 0) throw bad(item, "names no rate");
    if (seen[which]) throw bad(item, "repeats a rate");
    seen[which] = true;
    char* end = nullptr;
    const double v = value.empty() ? 0.0 : std::strtod(value.c_str(), &end);
    if (value.empty() || end != value.c_str() + value.size() || !std::isfinite(v) || v <= 0 ||
        v > 1e9)
      throw bad(item, "is not a positive number up to 1e9");
    (which == 0 ? r.pcie_gbps : which == 1 ? r.dram_gbps : r.cpu_gflops) = v;
  }
  return r;
}

std::vector<double> expected_tokens(std::span<const double> counts, int64_t n_tokens, int32_t k) {
  const double total = std::accumulate(counts.begin(), counts.end(), 0.0);
  const double denom = total + 0.5 * static_cast<double>(counts.size());
  std::vector<double> t(counts.size(), 0.0);
  const double calls = static_cast<double>(n_tokens) * static_cast<double>(k);
  for (size_t e = 0; e < counts.size(); ++e) t[e] = calls * (counts[e] + 0.5) / denom;
  return t;
}

namespace {

bool usable(double v) { return std::isfinite(v) && v > 0; }

double cpu_seconds(double tokens, const ExpertCost& c, const StreamRates& r) {
  const double p_used = -std::expm1(-std::max(tokens, 0.0));
  return p_used * c.bytes / (r.dram_gbps * 1e9) +
         std::max(tokens, 0.0) * c.flops_per_token / (r.cpu_gflops * 1e9);
}

}  // namespace

std::vector<uint8_t> choose_cpu_experts(std::span<const double> tokens, const ExpertCost& cost,
                                        const StreamRates& rates, double cpu_scale) {
  const size_t n = tokens.size();
  std::vector<uint8_t> on_cpu(n, 0);
  if (n == 0 || !usable(rates.pcie_gbps) || !usable(rates.dram_gbps) || !usable(rates.cpu_gflops) ||
      !usable(cpu_scale) || !(cost.bytes > 0))
    return on_cpu;
  std::vector<double> c(n);
  for (size_t e = 0; e < n; ++e) c[e] = cpu_scale * cpu_seconds(tokens[e], cost, rates);
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return c[a] < c[b]; });
  const double copy_one = cost.bytes / (rates.pcie_gbps * 1e9);
  size_t best_n = 0;
  double best = static_cast<double>(n) * copy_one, cpu = 0;
  for (size_t m = 1; m <= n; ++m) {
    cpu += c[order[m - 1]];
    const double t = std::max(cpu, static_cast<double>(n - m) * copy_one);
    if (t < best) best = t, best_n = m;
  }
  for (size_t m = 0; m < best_n; ++m) on_cpu[order[m]] = 1;
  return on_cpu;
}

SplitTimes split_times(std::span<const double> tokens, std::span<const uint8_t> on_cpu,
                       const ExpertCost& cost, const StreamRates& rates, double cpu_scale) {
  SplitTimes t;
  for (size_t e = 0; e < tokens.size(); ++e) {
    if (e < on_cpu.size() && on_cpu[e])
      t.cpu += cpu_scale * cpu_seconds(tokens[e], cost, rates);
    else
      t.copy += cost.bytes / (rates.pcie_gbps * 1e9);
  }
  return t;
}

std::string format_stream_rates(const StreamRates& r) {
  return fmt::format("pcie={:.1f},dram={:.1f},cpu={:.0f}", r.pcie_gbps, r.dram_gbps, r.cpu_gflops);
}

}  // namespace berth
