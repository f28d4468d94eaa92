// The tests of `berth bench model` as llama-bench (llama.cpp tools/llama-bench) defines them, so
// one command line runs on both engines: integer lists (-p, -n, -d, -b, -ub) and -pg pairs, their
// cartesian product, the steps a test's tokens are cut into, and the per-test statistics.
// Pure values: no model, no timing; model_bench.h runs the tests and formats their records.
//
//   pp N          N prompt tokens, in logical batches of -b tokens each cut into ubatches of -ub.
//   tg N          N single-token decode steps.
//   pp P+tg G     (-pg P,G) both, timed together: tok/s counts P + G.
//   ... @ dD      (-d D) each timed run starts with D tokens of context already in the KV cache
//                 (filled before the timer starts, in the test's batches and ubatches).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace berth::bench {

/// Parses a list option of llama-bench: comma-separated items, each a whole number N or a range
/// FIRST-LAST (every number from FIRST to LAST), FIRST-LAST+STEP or FIRST-LAST*MULT (FIRST,
/// FIRST*MULT, ... up to LAST). Values outside [min_value, max_value] are refused, as are more
/// than 4096 values. Throws Error(invalid_argument) whose message starts with `flag` (e.g. "-p")
/// and quotes the item.
std::vector<int> parse_int_list(std::string_view text, std::string_view flag, int min_value,
                                int max_value);

/// The same for several occurrences of one option (`-n 16 -n 32,64`): their values in order.
/// Empty `texts`: `fallback`.
std::vector<int> parse_int_lists(const std::vector<std::string>& texts, std::string_view flag,
                                 int min_value, int max_value, std::vector<int> fallback);

struct PromptGen {
  int n_prompt = 0, n_gen = 0;
  bool operator==(const PromptGen&) const = default;
};

/// `-pg PP,TG`: two whole numbers >= 0 (at most max_value), not both 0. Throws
/// Error(invalid_argument) naming -pg.
PromptGen parse_pg(std::string_view text, int max_value);

/// llama-bench's defaults.
constexpr int kDefaultPrompt = 512, kDefaultGen = 128, kDefaultBatch = 2048, kDefaultUbatch = 512;

struct BenchTest {
  int n_prompt = 0, n_gen = 0, n_depth = 0;
  int n_batch = kDefaultBatch, n_ubatch = kDefaultUbatch;
  bool is_pp() const { return n_prompt > 0 && n_gen == 0; }
  bool is_tg() const { return n_prompt == 0 && n_gen > 0; }
  /// llama-bench's name: "pp512", "tg128", "pp512+tg128", with " @ d4096" after a depth.
  std::string name() const;
  /// Tokens of context the test needs: depth + prompt + generated.
  int64_t n_ctx() const { return int64_t{n_depth} + n_prompt + n_gen; }
  bool operator==(const BenchTest&) const = default;
};

struct TestLists {
  std::vector<int> n_prompt{kDefaultPrompt}, n_gen{kDefaultGen}, n_depth{0}, n_batch{kDefaultBatch},
      n_ubatch{kDefaultUbatch};
  std::vector<PromptGen> pg;
};

/// The cartesian product in llama-bench's order: for each -b, each -ub, each -d: a pp test for
/// every -p value (0 skipped), then a tg test for every -n value (0 skipped), then a test for
/// every -pg pair. Values repeated in a list give repeated tests, as in llama-bench.
std::vector<BenchTest> expand_tests(const TestLists& lists);

/// The steps that evaluate `n_tokens` tokens: logical batches of `n_batch` tokens, each cut into
/// ubatches of at most `n_ubatch` (llama.cpp's split: -b 1000 -ub 512 gives 512, 488, 512, ...).
/// Empty for n_tokens <= 0; n_batch and n_ubatch must be >= 1.
std::vector<int> ubatch_sizes(int n_tokens, int n_batch, int n_ubatch);

/// The largest step any of `tests` runs (its prompt, its depth fill, 1 for decode steps).
int max_step_tokens(const std::vector<BenchTest>& tests);

/// Statistics of one test's timed runs, as llama-bench reports them: per run, tok/s = (n_prompt +
/// n_gen) / seconds; avg and stddev are the mean and the sample standard deviation (n - 1; 0 for
/// one run) over the runs. berth's own: median_ts and best_ts, the tokens over the median and the
/// shortest run time (as rate_of in kernel_bench.h).
struct TestStats {
  double avg_ns = 0, stddev_ns = 0, avg_ts = 0, stddev_ts = 0;
  double median_ts = 0, best_ts = 0;
  std::vector<double> samples_ts;
};
TestStats test_stats(const BenchTest& t, const std::vector<uint64_t>& samples_ns);

enum class OutputFormat { md, csv, json, jsonl };
/// "md", "csv", "json" or "jsonl". Throws Error(invalid_argument) naming -o.
OutputFormat parse_output_format(std::string_view s);

}  // namespace berth::bench
