// The per-test records of `berth bench model` in llama-bench's output formats (model_bench.h).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "berth/bench/model_bench.h"
#include "berth/core/error.h"

namespace berth::bench {
namespace {

using nlohmann::ordered_json;

// "1.12 MiB", "17.28 GiB": binary units, as llama-bench prints a model's size.
std::string size_text(uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return fmt::format("{:.2f} MiB", b / (1024.0 * 1024));
  return fmt::format("{:.2f} KiB", b / 1024.0);
}

// "292.80 K", "30.53 B": decimal units, as llama-bench prints a parameter count.
std::string params_text(int64_t n) {
  double x = static_cast<double>(n);
  const char* units[] = {"", " K", " M", " B", " T"};
  int i = 0;
  while (i < 4 && std::abs(x) >= 1000.0) x /= 1000.0, ++i;
  return fmt::format("{:.2f}{}", x, units[i]);
}

std::string overrides_text(const placement::Flags& f) {
  std::string s;
  for (const auto& [re, dev] : f.overrides) s += (s.empty() ? "" : ";") + re + "=" + dev;
  return s.empty() ? "none" : s;
}

// Display width of UTF-8 text: its code points ("±" is one).
size_t text_width(std::string_view s) {
  return static_cast<size_t>(std::count_if(
      s.begin(), s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; }));
}

std::string pad(const std::string& s, size_t width, bool right) {
  const size_t w = text_width(s);
  if (w >= width) return s;
  const std::string fill(width - w, ' ');
  return right ? fill + s : s + fill;
}

struct Column {
  std::string title;
  bool right = false;
  size_t width = 0;
};

// llama-bench's table: model, size, params, backend, threads, n_batch (only when a test's differs
// from the default), n_ubatch, test, t/s.
class MdTable {
 public:
  explicit MdTable(const ModelBenchResult& r) : r_(r) {
    show_batch_ = std::any_of(r.planned.begin(), r.planned.end(),
                              [](const BenchTest& t) { return t.n_batch != kDefaultBatch; });
    size_t test_w = 15;
    for (const BenchTest& t : r.planned) test_w = std::max(test_w, text_width(t.name()));
    cols_ = {{"model", false, std::max<size_t>(30, text_width(r.model_type))},
             {"size", true, 10},
             {"params", true, 10},
             {"backend", false, std::max<size_t>(10, text_width(r.backend))},
             {"threads", true, 7}};
    if (show_batch_) cols_.push_back({"n_batch", true, 7});
    cols_.push_back({"n_ubatch", true, 8});
    cols_.push_back({"test", true, test_w});
    cols_.push_back({"t/s", true, 20});
  }
  std::string header() const {
    std::vector<std::string> titles, rules;
    for (const Column& c : cols_) {
      titles.push_back(c.title);
      rules.push_back(std::string(c.width - (c.right ? 1 : 0), '-') + (c.right ? ":" : ""));
    }
    return line(titles, false) + line(rules, true);
  }
  std::string row(const TestResult& t) const {
    std::vector<std::string> cells = {r_.model_type, size_text(r_.weight_bytes),
                                      params_text(r_.n_params), r_.backend,
                                      fmt::format("{}", r_.n_threads)};
    if (show_batch_) cells.push_back(fmt::format("{}", t.test.n_batch));
    cells.push_back(fmt::format("{}", t.test.n_ubatch));
    cells.push_back(t.test.name());
    cells.push_back(fmt::format("{:.2f} ± {:.2f}", t.stats.avg_ts, t.stats.stddev_ts));
    return line(cells, false);
  }

 private:
  std::string line(const std::vector<std::string>& cells, bool rule) const {
    std::string s = "|";
    for (size_t i = 0; i < cols_.size(); ++i)
      s += " " + (rule ? cells[i] : pad(cells[i], cols_[i].width, cols_[i].right)) + " |";
    return s + "\n";
  }
  const ModelBenchResult& r_;
  bool show_batch_ = false;
  std::vector<Column> cols_;
};

std::string csv_quote(const std::string& s) {
  std::string q = "\"";
  for (char c : s) {
    if (c == '"') q += '"';
    q += c;
  }
  return q + "\"";
}

// The scalar fields (the sample arrays left out, as llama-bench's CSV does).
std::string csv_line(const ordered_json& rec, bool names) {
  std::string s;
  for (auto it = rec.begin(); it != rec.end(); ++it) {
    if (it.value().is_array()) continue;
    const std::string v = names                    ? it.key()
                          : it.value().is_string() ? it.value().get<std::string>()
                                                   : it.value().dump();
    s += (s.empty() ? "" : ",") + (names ? v : csv_quote(v));
  }
  return s + "\n";
}

}  // namespace

ordered_json test_record(const ModelBenchResult& r, const TestResult& t) {
  const placement::Flags& f = r.options.placement;
  ordered_json j;
  j["cpu_info"] = r.machine.cpu_model;
  j["gpu_info"] = r.device;
  j["backends"] = r.backend;
  j["model_filename"] = r.options.model_path;
  j["model_type"] = r.model_type;
  j["model_size"] = r.weight_bytes;
  j["model_n_params"] = r.n_params;
  j["n_batch"] = t.test.n_batch;
  j["n_ubatch"] = t.test.n_ubatch;
  j["n_threads"] = r.n_threads;
  j["n_gpu_layers"] = f.n_gpu_layers;
  j["n_cpu_moe"] = f.n_cpu_moe;
  j["tensor_buft_overrides"] = overrides_text(f);
  j["n_prompt"] = t.test.n_prompt;
  j["n_gen"] = t.test.n_gen;
  j["n_depth"] = t.test.n_depth;
  j["test_time"] = t.test_time;
  j["avg_ns"] = static_cast<uint64_t>(std::llround(t.stats.avg_ns));
  j["stddev_ns"] = static_cast<uint64_t>(std::llround(t.stats.stddev_ns));
  j["avg_ts"] = t.stats.avg_ts;
  j["stddev_ts"] = t.stats.stddev_ts;
  j["samples_ns"] = t.samples_ns;
  j["samples_ts"] = t.stats.samples_ts;
  // berth's own.
  j["test"] = t.test.name();
  j["median_ts"] = t.stats.median_ts;
  j["best_ts"] = t.stats.best_ts;
  j["repetitions"] = r.options.repetitions;
  j["placement"] = r.placement;
  j["cpu_moe"] = f.cpu_moe;
  j["vram_budget"] = f.vram_budget.value_or(0);
  j["gpu_weight_bytes"] = r.gpu_weight_bytes;
  j["handoff"] = r.handoff;
  j["warm_workers_us"] = r.warm_workers_us;
  j["stream_experts_min_tokens"] = r.stream_experts_min_tokens;
  j["host_expert_share"] = r.options.host_expert_share;
  j["host_experts_pinning"] = r.host_experts_pinning;
  j["cpu_busy"] = t.cpu_busy;
  j["build"] = r.machine.build;
  return j;
}

std::string format_record_line(OutputFormat f, const ModelBenchResult& r, const TestResult& t,
                               bool first) {
  switch (f) {
    case OutputFormat::md: {
      const MdTable table(r);
      return (first ? table.header() : "") + table.row(t);
    }
    case OutputFormat::csv: {
      const ordered_json rec = test_record(r, t);
      return (first ? csv_line(rec, true) : "") + csv_line(rec, false);
    }
    case OutputFormat::jsonl:
      return test_record(r, t).dump() + "\n";
    case OutputFormat::json:
      break;
  }
  throw Error(ErrorCategory::invalid_argument, "format_record_line: json is a whole document");
}

std::string format_records(OutputFormat f, const ModelBenchResult& r) {
  if (f == OutputFormat::json) {
    ordered_json a = ordered_json::array();
    for (const TestResult& t : r.tests) a.push_back(test_record(r, t));
    return a.dump(2) + "\n";
  }
  if (f == OutputFormat::md && r.tests.empty()) return MdTable(r).header();
  std::string s;
  for (size_t i = 0; i < r.tests.size(); ++i) s += format_record_line(f, r, r.tests[i], i == 0);
  return s;
}

}  // namespace berth::bench
