#include "berth/bench/bench_tests.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>

#include "berth/core/error.h"
#include "berth/core/strings.h"

namespace berth::bench {
namespace {

constexpr size_t kMaxValues = 4096;

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

[[noreturn]] void fail(std::string message) {
  throw Error(ErrorCategory::invalid_argument, std::move(message));
}

// A whole number at the start of `s` (an optional '-' and digits), or false. Numbers beyond
// the range of long long are clamped, so they fail the bounds check with a readable value.
bool take_number(std::string_view& s, long long& v) {
  const char* b = s.data();
  const char* e = b + s.size();
  const char* digits = b != e && *b == '-' ? b + 1 : b;
  if (digits == e || *digits < '0' || *digits > '9') return false;
  auto [p, ec] = std::from_chars(b, e, v);
  if (ec == std::errc::result_out_of_range) {
    v = *b == '-' ? std::numeric_limits<long long>::min() : std::numeric_limits<long long>::max();
    p = digits;
    while (p != e && *p >= '0' && *p <= '9') ++p;
  } else if (ec != std::errc()) {
    return false;
  }
  s.remove_prefix(static_cast<size_t>(p - b));
  return true;
}

}  // namespace

std::vector<int> parse_int_list(std::string_view text, std::string_view flag, int min_value,
                                int max_value) {
  const std::string quoted = printable(text);
  if (trim(text).empty()) fail(fmt::format("{}: no value given", flag));
  auto bad = [&](std::string_view item) {
    fail(
        fmt::format("{}: '{}' is not a whole number or a range (e.g. 512, 128,256, 128-512+128 or "
                    "128-1024*2)",
                    flag, printable(item)));
  };
  auto in_bounds = [&](long long v) {
    if (v < min_value)
      fail(fmt::format("{}: {} in '{}' is below the minimum {}", flag, v, quoted, min_value));
    if (v > max_value)
      fail(fmt::format("{}: {} in '{}' is above the maximum {}", flag, v, quoted, max_value));
  };
  std::vector<int> out;
  auto push = [&](long long v) {
    if (out.size() >= kMaxValues) fail(fmt::format("{}: more than {} values", flag, kMaxValues));
    out.push_back(static_cast<int>(v));
  };
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    const std::string_view item =
        trim(text.substr(start, comma == std::string_view::npos ? text.npos : comma - start));
    if (item.empty()) fail(fmt::format("{}: an empty item in '{}'", flag, quoted));
    std::string_view rest = item;
    long long first = 0;
    if (!take_number(rest, first)) bad(item);
    if (rest.empty()) {
      in_bounds(first);
      push(first);
    } else {
      // A range: FIRST-LAST, then optionally +STEP or *MULT.
      long long last = 0, by = 1;
      char op = '+';
      if (rest.front() != '-') bad(item);
      rest.remove_prefix(1);
      if (!take_number(rest, last)) bad(item);
      if (!rest.empty()) {
        op = rest.front();
        if (op != '+' && op != '*') bad(item);
        rest.remove_prefix(1);
        if (!take_number(rest, by) || !rest.empty()) bad(item);
      }
      in_bounds(first);
      in_bounds(last);
      if (last < first)
        fail(fmt::format("{}: the range '{}' ends before it starts", flag, printable(item)));
      if (op == '+' && by < 1)
        fail(fmt::format("{}: the step of '{}' must be at least 1", flag, printable(item)));
      if (op == '*' && by < 2)
        fail(fmt::format("{}: the factor of '{}' must be at least 2", flag, printable(item)));
      if (op == '*' && first < 1)
        fail(fmt::format("{}: the range '{}' multiplies from {}", flag, printable(item), first));
      // The next value is checked against `last` before it is formed: no overflow.
      for (long long v = first;;) {
        push(v);
        if (op == '+' ? by > last - v : v > last / by) break;
        v = op == '+' ? v + by : v * by;
      }
    }
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

std::vector<int> parse_int_lists(const std::vector<std::string>& texts, std::string_view flag,
                                 int min_value, int max_value, std::vector<int> fallback) {
  if (texts.empty()) return fallback;
  std::vector<int> out;
  for (const std::string& t : texts) {
    const std::vector<int> v = parse_int_list(t, flag, min_value, max_value);
    out.insert(out.end(), v.begin(), v.end());
    if (out.size() > kMaxValues) fail(fmt::format("{}: more than {} values", flag, kMaxValues));
  }
  return out;
}

PromptGen parse_pg(std::string_view text, int max_value) {
  const size_t comma = text.find(',');
  auto bad = [&] {
    fail(fmt::format("-pg: '{}' is not PP,TG (two whole numbers, e.g. 512,128)", printable(text)));
  };
  if (comma == std::string_view::npos || text.find(',', comma + 1) != std::string_view::npos) bad();
  long long v[2] = {0, 0};
  const std::string_view parts[2] = {trim(text.substr(0, comma)), trim(text.substr(comma + 1))};
  for (int i = 0; i < 2; ++i) {
    std::string_view p = parts[i];
    if (!take_number(p, v[i]) || !p.empty()) bad();
    if (v[i] < 0 || v[i] > max_value)
      fail(fmt::format("-pg: {} in '{}' is outside 0..{}", v[i], printable(text), max_value));
  }
  if (v[0] == 0 && v[1] == 0) fail("-pg: 0,0 leaves nothing to measure");
  return {static_cast<int>(v[0]), static_cast<int>(v[1])};
}

std::string BenchTest::name() const {
  std::string s = is_pp()   ? fmt::format("pp{}", n_prompt)
                  : is_tg() ? fmt::format("tg{}", n_gen)
                            : fmt::format("pp{}+tg{}", n_prompt, n_gen);
  if (n_depth > 0) s += fmt::format(" @ d{}", n_depth);
  return s;
}

std::vector<BenchTest> expand_tests(const TestLists& l) {
  std::vector<BenchTest> out;
  for (int b : l.n_batch)
    for (int ub : l.n_ubatch)
      for (int d : l.n_depth) {
        for (int p : l.n_prompt)
          if (p > 0) out.push_back({p, 0, d, b, ub});
        for (int g : l.n_gen)
          if (g > 0) out.push_back({0, g, d, b, ub});
        for (const PromptGen& pg : l.pg) out.push_back({pg.n_prompt, pg.n_gen, d, b, ub});
      }
  return out;
}

std::vector<int> ubatch_sizes(int n_tokens, int n_batch, int n_ubatch) {
  if (n_batch < 1 || n_ubatch < 1)
    fail(fmt::format("ubatch_sizes: -b {} and -ub {} must be at least 1", n_batch, n_ubatch));
  std::vector<int> out;
  for (int done = 0; done < n_tokens;) {
    const int batch = std::min(n_batch, n_tokens - done);
    for (int in = 0; in < batch;) {
      const int u = std::min(n_ubatch, batch - in);
      out.push_back(u);
      in += u;
    }
    done += batch;
  }
  return out;
}

int max_step_tokens(const std::vector<BenchTest>& tests) {
  int m = 1;
  for (const BenchTest& t : tests) {
    const int step = std::min(t.n_batch, t.n_ubatch);
    m = std::max({m, std::min(t.n_prompt, step), std::min(t.n_depth, step)});
  }
  return m;
}

TestStats test_stats(const BenchTest& t, const std::vector<uint64_t>& samples_ns) {
  TestStats s;
  const size_t n = samples_ns.size();
  if (n == 0) return s;
  const double tokens = static_cast<double>(t.n_prompt) + t.n_gen;
  std::vector<double> ns;
  for (uint64_t x : samples_ns) {
    ns.push_back(static_cast<double>(std::max<uint64_t>(x, 1)));
    s.samples_ts.push_back(tokens * 1e9 / ns.back());
  }
  auto mean_sd = [n](const std::vector<double>& v, double& mean, double& sd) {
    mean = 0;
    for (double x : v) mean += x;
    mean /= static_cast<double>(n);
    sd = 0;
    if (n < 2) return;
    for (double x : v) sd += (x - mean) * (x - mean);
    sd = std::sqrt(sd / static_cast<double>(n - 1));
  };
  mean_sd(ns, s.avg_ns, s.stddev_ns);
  mean_sd(s.samples_ts, s.avg_ts, s.stddev_ts);
  // As rate_of (kernel_bench.h): the tokens over the median and over the shortest run time.
  std::vector<double> sorted = ns;
  std::sort(sorted.begin(), sorted.end());
  const double median_ns = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  s.median_ts = tokens * 1e9 / median_ns;
  s.best_ts = tokens * 1e9 / sorted.front();
  return s;
}

OutputFormat parse_output_format(std::string_view s) {
  if (s == "md") return OutputFormat::md;
  if (s == "csv") return OutputFormat::csv;
  if (s == "json") return OutputFormat::json;
  if (s == "jsonl") return OutputFormat::jsonl;
  fail(fmt::format("-o: '{}' is not an output format (md, csv, json or jsonl)", printable(s)));
}

}  // namespace berth::bench
