// bench model's llama-bench options as values: the list syntax, the cartesian product and its
// order, the steps a prompt is cut into, the statistics and the output formats of the records.
// Nothing is timed: results are made by hand.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "berth/bench/bench_tests.h"
#include "berth/bench/model_bench.h"
#include "berth/core/error.h"

using namespace berth;
using namespace berth::bench;

namespace {

// The message of the Error that `f` throws ("" when it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::invalid_argument);
    return e.what();
  }
  return "";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != s.npos; }

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

}  // namespace

TEST_CASE("bench lists: numbers, commas and llama-bench's ranges") {
  using V = std::vector<int>;
  CHECK(parse_int_list("512", "-p", 0, 1 << 20) == V{512});
  CHECK(parse_int_list("16,32, 64", "-p", 0, 1 << 20) == V{16, 32, 64});
  CHECK(parse_int_list("0", "-n", 0, 100) == V{0});
  CHECK(parse_int_list("1-4", "-p", 0, 100) == V{1, 2, 3, 4});
  CHECK(parse_int_list("128-512+128", "-p", 0, 1 << 20) == V{128, 256, 384, 512});
  CHECK(parse_int_list("128-1000+128", "-p", 0, 1 << 20) == V{128, 256, 384, 512, 640, 768, 896});
  CHECK(parse_int_list("512-4096*2", "-ub", 1, 1 << 20) == V{512, 1024, 2048, 4096});
  CHECK(parse_int_list("3-3*2", "-ub", 1, 100) == V{3});
  CHECK(parse_int_list("8,1-2", "-d", 0, 100) == V{8, 1, 2});  // order kept
  // Repeated occurrences add up; none: the default.
  CHECK(parse_int_lists({"16", "32,64"}, "-n", 0, 100, {128}) == V{16, 32, 64});
  CHECK(parse_int_lists({}, "-n", 0, 100, {128}) == V{128});
}

TEST_CASE("bench lists: bad input names the flag and the item") {
  auto err = [](const char* text, const char* flag, int lo, int hi) {
    return error_of([&] { (void)parse_int_list(text, flag, lo, hi); });
  };
  std::string e = err("abc", "-p", 0, 100);
  CHECK(has(e, "-p: 'abc' is not a whole number"));
  CHECK(has(err("", "-p", 0, 100), "-p: no value"));
  CHECK(has(err("16,,32", "-n", 0, 100), "-n: an empty item in '16,,32'"));
  CHECK(has(err("16,", "-n", 0, 100), "-n: an empty item"));
  CHECK(has(err("0", "-ub", 1, 100), "-ub: 0 in '0' is below the minimum 1"));
  CHECK(has(err("-1", "-n", 0, 100), "-n: -1 in '-1' is below the minimum 0"));
  CHECK(has(err("4096", "-b", 1, 2048), "-b: 4096 in '4096' is above the maximum 2048"));
  CHECK(has(err("99999999999999999999999", "-d", 0, 100), "above the maximum 100"));
  CHECK(has(err("12x", "-p", 0, 100), "-p: '12x' is not a whole number"));
  CHECK(has(err("1.5", "-p", 0, 100), "-p: '1.5'"));
  CHECK(has(err("1-", "-p", 0, 100), "-p: '1-'"));
  CHECK(has(err("1-4/2", "-p", 0, 100), "-p: '1-4/2'"));
  CHECK(has(err("1-4+2+1", "-p", 0, 100), "-p: '1-4+2+1'"));
  CHECK(has(err("8-4", "-p", 0, 100), "-p: the range '8-4' ends before it starts"));
  CHECK(has(err("1-8+0", "-p", 0, 100), "-p: the step of '1-8+0' must be at least 1"));
  CHECK(has(err("1-8*1", "-p", 0, 100), "-p: the factor of '1-8*1' must be at least 2"));
  CHECK(has(err("0-8*2", "-p", 0, 100), "-p: the range '0-8*2' multiplies from 0"));
  CHECK(has(err("0-100000", "-p", 0, 1 << 20), "-p: more than 4096 values"));
  // A huge step or factor ends the range instead of overflowing.
  CHECK(parse_int_list("1-8+9223372036854775807", "-p", 0, 100) == std::vector<int>{1});
  CHECK(parse_int_list("1-8*9223372036854775807", "-p", 0, 100) == std::vector<int>{1});
}

TEST_CASE("bench -pg and -o") {
  CHECK(parse_pg("512,128", 1 << 20) == PromptGen{512, 128});
  CHECK(parse_pg("0,16", 1 << 20) == PromptGen{0, 16});
  for (const char* bad : {"512", "512,", ",128", "a,b", "1,2,3", "512;128"}) {
    CAPTURE(bad);
    CHECK(has(error_of([&] { (void)parse_pg(bad, 1 << 20); }), "-pg: '"));
  }
  CHECK(has(error_of([] { (void)parse_pg("0,0", 100); }), "-pg: 0,0 leaves nothing"));
  CHECK(has(error_of([] { (void)parse_pg("-1,4", 100); }), "-pg: -1 in '-1,4' is outside 0..100"));
  CHECK(parse_output_format("md") == OutputFormat::md);
  CHECK(parse_output_format("csv") == OutputFormat::csv);
  CHECK(parse_output_format("json") == OutputFormat::json);
  CHECK(parse_output_format("jsonl") == OutputFormat::jsonl);
  CHECK(has(error_of([] { (void)parse_output_format("xml"); }),
            "-o: 'xml' is not an output format (md, csv, json or jsonl)"));
}

TEST_CASE("bench tests: names, the cartesian product in llama-bench's order") {
  CHECK(BenchTest{512, 0, 0}.name() == "pp512");
  CHECK(BenchTest{0, 128, 0}.name() == "tg128");
  CHECK(BenchTest{512, 0, 4096}.name() == "pp512 @ d4096");
  CHECK(BenchTest{512, 128, 0}.name() == "pp512+tg128");
  CHECK(BenchTest{0, 16, 0}.is_tg());
  CHECK(BenchTest{512, 128, 16}.n_ctx() == 656);

  // Defaults: pp512 then tg128, -b 2048, -ub 512.
  std::vector<BenchTest> t = expand_tests(TestLists{});
  REQUIRE(t.size() == 2);
  CHECK(t[0] == BenchTest{512, 0, 0, 2048, 512});
  CHECK(t[1] == BenchTest{0, 128, 0, 2048, 512});

  // -p 16,32 -n 8 -d 0,16: per depth, the pp tests then the tg tests.
  TestLists l;
  l.n_prompt = {16, 32};
  l.n_gen = {8};
  l.n_depth = {0, 16};
  t = expand_tests(l);
  std::vector<std::string> names;
  for (const BenchTest& x : t) names.push_back(x.name());
  CHECK(names ==
        std::vector<std::string>{"pp16", "pp32", "tg8", "pp16 @ d16", "pp32 @ d16", "tg8 @ d16"});

  // Every list multiplies: 2 batches x 2 ubatches x 1 depth x (1 pp + 0 tg + 1 pg); 0 in -p
  // and -n is no test.
  l = TestLists{};
  l.n_prompt = {0, 64};
  l.n_gen = {0};
  l.n_batch = {32, 2048};
  l.n_ubatch = {16, 512};
  l.pg = {{64, 8}};
  t = expand_tests(l);
  REQUIRE(t.size() == 8);
  CHECK(t[0] == BenchTest{64, 0, 0, 32, 16});
  CHECK(t[1] == BenchTest{64, 8, 0, 32, 16});
  CHECK(t[2] == BenchTest{64, 0, 0, 32, 512});
  CHECK(t[4] == BenchTest{64, 0, 0, 2048, 16});
  CHECK(t[7] == BenchTest{64, 8, 0, 2048, 512});

  l = TestLists{};
  l.n_prompt = {0};
  l.n_gen = {0};
  CHECK(expand_tests(l).empty());
}

TEST_CASE("bench tests: batches cut into ubatches, the largest step") {
  using V = std::vector<int>;
  CHECK(ubatch_sizes(0, 2048, 512).empty());
  CHECK(ubatch_sizes(1, 2048, 512) == V{1});
  CHECK(ubatch_sizes(512, 2048, 512) == V{512});
  CHECK(ubatch_sizes(1300, 2048, 512) == V{512, 512, 276});
  // A batch boundary ends a ubatch early, as llama.cpp splits.
  CHECK(ubatch_sizes(2100, 1000, 512) == V{512, 488, 512, 488, 100});
  // -ub above -b: the batch is the step.
  CHECK(ubatch_sizes(100, 32, 512) == V{32, 32, 32, 4});
  CHECK(error_of([] { (void)ubatch_sizes(8, 0, 4); }) != "");

  CHECK(max_step_tokens({BenchTest{0, 128, 0}}) == 1);
  CHECK(max_step_tokens({BenchTest{16, 0, 0}, BenchTest{0, 8, 64, 2048, 32}}) == 32);
  CHECK(max_step_tokens({BenchTest{4096, 0, 0, 2048, 512}}) == 512);
  CHECK(max_step_tokens({BenchTest{4096, 0, 0, 256, 512}}) == 256);
}

TEST_CASE("bench tests: llama-bench's statistics") {
  const BenchTest t{100, 0, 0};
  // 0.1 s and 0.2 s: 1000 and 500 tok/s.
  TestStats s = test_stats(t, {100'000'000, 200'000'000});
  CHECK(s.avg_ns == doctest::Approx(150e6));
  CHECK(s.stddev_ns == doctest::Approx(70710678.1186548));
  CHECK(s.samples_ts == std::vector<double>{1000.0, 500.0});
  CHECK(s.avg_ts == doctest::Approx(750));
  CHECK(s.stddev_ts == doctest::Approx(353.5533905932738));
  CHECK(s.median_ts == doctest::Approx(100 / 0.15));  // the tokens over the median time
  CHECK(s.best_ts == doctest::Approx(1000));
  // One run: no spread. pp+tg counts both.
  s = test_stats(BenchTest{30, 10, 0}, {40'000'000});
  CHECK(s.stddev_ts == 0);
  CHECK(s.avg_ts == doctest::Approx(1000));
  CHECK(test_stats(t, {}).avg_ts == 0);
}

TEST_CASE("bench model records: llama-bench's fields in md, csv, json and jsonl") {
  ModelBenchResult r;
  r.machine.cpu_model = "Test CPU \"X\"";
  r.machine.build = "release";
  r.options.model_path = "m.gguf";
  r.options.repetitions = 2;
  r.options.placement.n_gpu_layers = 99;
  r.options.placement.overrides = {{"exps", "CPU"}};
  r.model_type = "llama 293K all F32";
  r.backend = "CPU";
  r.weight_bytes = 1'185'376;
  r.n_params = 292'800;
  r.n_threads = 2;
  TestLists l;
  l.n_prompt = {16};
  l.n_gen = {8};
  l.n_depth = {0, 16};
  r.planned = expand_tests(l);
  for (const BenchTest& t : r.planned) {
    TestResult tr;
    tr.test = t;
    tr.test_time = "2026-12-02T10:00:00Z";
    tr.samples_ns = {100'000'000, 200'000'000};
    tr.stats = test_stats(t, tr.samples_ns);
    r.tests.push_back(tr);
  }

  // JSON: an array, a record per test with llama-bench's names and values.
  const nlohmann::json j = nlohmann::json::parse(format_records(OutputFormat::json, r));
  REQUIRE(j.is_array());
  REQUIRE(j.size() == 4);
  for (const char* k : {"cpu_info",
                        "gpu_info",
                        "backends",
                        "model_filename",
                        "model_type",
                        "model_size",
                        "model_n_params",
                        "n_batch",
                        "n_ubatch",
                        "n_threads",
                        "n_gpu_layers",
                        "n_cpu_moe",
                        "tensor_buft_overrides",
                        "n_prompt",
                        "n_gen",
                        "n_depth",
                        "test_time",
                        "avg_ns",
                        "stddev_ns",
                        "avg_ts",
                        "stddev_ts",
                        "samples_ns",
                        "samples_ts",
                        "test",
                        "median_ts",
                        "placement",
                        "handoff",
                        "cpu_busy"}) {
    CAPTURE(k);
    CHECK(j[0].contains(k));
  }
  CHECK(j[0]["n_prompt"] == 16);
  CHECK(j[0]["n_gen"] == 0);
  CHECK(j[1]["n_gen"] == 8);
  CHECK(j[2]["n_depth"] == 16);
  CHECK(j[3]["test"] == "tg8 @ d16");
  CHECK(j[0]["n_batch"] == 2048);
  CHECK(j[0]["n_ubatch"] == 512);
  CHECK(j[0]["model_size"] == 1'185'376);
  CHECK(j[0]["avg_ns"] == 150'000'000);
  CHECK(j[0]["samples_ns"].size() == 2);
  CHECK(j[0]["avg_ts"].get<double>() == doctest::Approx(16 * 7.5));
  CHECK(j[0]["tensor_buft_overrides"] == "exps=CPU");
  CHECK(j[0]["n_gpu_layers"] == 99);
  // llama-bench's field order: the record starts with the machine and ends its llama-bench part
  // with the samples.
  const auto rec = test_record(r, r.tests[0]);
  CHECK(rec.begin().key() == "cpu_info");

  // JSONL: the same records, one per line.
  const std::vector<std::string> jl = lines(format_records(OutputFormat::jsonl, r));
  REQUIRE(jl.size() == 4);
  for (size_t i = 0; i < 4; ++i) CHECK(nlohmann::json::parse(jl[i]) == j[i]);

  // CSV: a header, then a line per test; the sample arrays left out; quotes doubled.
  const std::vector<std::string> csv = lines(format_records(OutputFormat::csv, r));
  REQUIRE(csv.size() == 5);
  CHECK(csv[0].rfind("cpu_info,gpu_info,backends,model_filename,model_type,", 0) == 0);
  CHECK(has(csv[0], ",n_prompt,n_gen,n_depth,test_time,avg_ns,stddev_ns,avg_ts,stddev_ts,"));
  CHECK_FALSE(has(csv[0], "samples_ns"));
  CHECK(csv[1].rfind("\"Test CPU \"\"X\"\"\",\"\",\"CPU\",\"m.gguf\",", 0) == 0);
  CHECK(has(csv[3], ",\"16\",\"0\",\"16\",\"2026-12-02T10:00:00Z\",\"150000000\","));
  // Streamed: the header only before the first line.
  CHECK(format_record_line(OutputFormat::csv, r, r.tests[0], true) ==
        csv[0] + "\n" + csv[1] + "\n");
  CHECK(format_record_line(OutputFormat::csv, r, r.tests[1], false) == csv[2] + "\n");
  CHECK(error_of([&] { (void)format_record_line(OutputFormat::json, r, r.tests[0], true); }) != "");

  // md: llama-bench's table, tests named as llama-bench names them, t/s as mean ± deviation.
  const std::vector<std::string> md = lines(format_records(OutputFormat::md, r));
  REQUIRE(md.size() == 6);
  auto cells = [](const std::string& row) {
    std::vector<std::string> c;
    std::string cell;
    std::istringstream in(row.substr(1));
    while (std::getline(in, cell, '|')) {
      const size_t a = cell.find_first_not_of(' '), b = cell.find_last_not_of(' ');
      c.push_back(a == cell.npos ? "" : cell.substr(a, b - a + 1));
    }
    return c;
  };
  CHECK(cells(md[0]) == std::vector<std::string>{"model", "size", "params", "backend", "threads",
                                                 "n_ubatch", "test", "t/s"});
  CHECK(md[1].rfind("| ------------------------------ | ---------: |", 0) == 0);
  CHECK(cells(md[2]) == std::vector<std::string>{"llama 293K all F32", "1.13 MiB", "292.80 K",
                                                 "CPU", "2", "512", "pp16", "120.00 ± 56.57"});
  CHECK(cells(md[3])[6] == "tg8");
  CHECK(cells(md[4])[6] == "pp16 @ d16");
  CHECK(cells(md[5])[6] == "tg8 @ d16");
  // Every row as wide as the header (in characters: "±" is one).
  auto width = [](const std::string& s) {
    size_t n = 0;
    for (unsigned char c : s) n += (c & 0xC0) != 0x80;
    return n;
  };
  for (const std::string& row : md) CHECK(width(row) == width(md[0]));

  // A -b other than the default adds the n_batch column.
  r.planned[0].n_batch = 256;
  r.tests[0].test.n_batch = 256;
  const std::vector<std::string> md_b = lines(format_records(OutputFormat::md, r));
  CHECK(cells(md_b[0])[5] == "n_batch");
  CHECK(cells(md_b[2])[5] == "256");
  CHECK(cells(md_b[3])[5] == "2048");
}
