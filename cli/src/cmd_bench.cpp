// `berth bench kernels`: CPU kernel throughput against the measured DRAM bandwidth
// (bench/include/berth/bench/kernel_bench.h says what is measured and how).
#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "berth/bench/batch_bench.h"
#include "berth/bench/bench_tests.h"
#include "berth/bench/disk_bench.h"
#include "berth/bench/kernel_bench.h"
#include "berth/bench/model_bench.h"
#include "berth/core/error.h"
#include "commands.h"
#include "placement_flags.h"

namespace berth::cli {
namespace {

struct BenchOptions {
  std::string types, threads, json_path;
  bool quick = false;
  int repetitions = 0;
  size_t gemv_mib = 0, dram_mib = 0;
  std::vector<std::string> few_tokens;  // --few-tokens lists as typed
  std::vector<int> few_token_counts;    // ... parsed
  bool quiet = false;
  CLI::App* kernels = nullptr;
  // bench model
  CLI::App* model = nullptr;
  bench::ModelBenchOptions m;
  size_t model_dram_mib = 0;
  int64_t ctx_size = 0;  // -c with --parallel (0: -p + -n per sequence)
  bool greedy = false;   // --greedy with --parallel
  // llama-bench's list options as typed (each occurrence one list), and -o.
  std::vector<std::string> n_prompt, n_gen, n_depth, n_batch, n_ubatch, pg;
  std::string output = "md";
  bench::OutputFormat format = bench::OutputFormat::md;
  std::vector<std::string> parallel;  // --parallel lists as typed (the batch measurement)
  std::vector<int> n_parallel;        // ... parsed
  // bench disk
  CLI::App* disk = nullptr;
  bench::DiskBenchOptions d;
  size_t block_kib = 0;
};

// The --json destination: "-" is standard output (the text table then goes to standard
// error); a file is checked for writing before minutes of measuring, without truncating it, so
// a run that fails leaves a file that held earlier results as it was (and removes the empty
// file the check created).
class JsonOut {
 public:
  explicit JsonOut(std::string path) : path_(std::move(path)) {
    if (path_.empty() || path_ == "-") return;
    std::error_code ec;
    existed_ = std::filesystem::exists(path_, ec);
    errno = 0;
    std::ofstream probe(path_, std::ios::binary | std::ios::app);
    if (!probe) {
      const int err = errno;
      throw Error(ErrorCategory::io, fmt::format("cannot write the JSON file '{}': {}", path_,
                                                 err != 0 ? std::strerror(err) : "not writable"));
    }
    armed_ = true;
  }
  ~JsonOut() {
    if (armed_ && !existed_) {
      std::error_code ec;
      std::filesystem::remove(path_, ec);
    }
  }
  JsonOut(const JsonOut&) = delete;
  JsonOut& operator=(const JsonOut&) = delete;
  bool to_stdout() const { return path_ == "-"; }
  /// Writes the JSON (to the file, or to standard output for "-").
  void write(const nlohmann::json& j) {
    if (path_.empty()) return;
    if (to_stdout()) {
      (void)write_stdout(j.dump(2) + "\n");
      return;
    }
    std::ofstream out(path_, std::ios::binary | std::ios::trunc);
    out << j.dump(2) << "\n";
    out.close();
    if (!out)
      throw Error(ErrorCategory::io, fmt::format("writing the JSON file '{}' failed", path_));
    armed_ = false;
  }
  /// The text table: standard output, or standard error when the JSON goes to standard output.
  void text(const std::string& t) const {
    if (to_stdout())
      std::fputs(t.c_str(), stderr);
    else
      (void)write_stdout(t);  // false: the reader closed the pipe, not an error
  }

 private:
  std::string path_;
  bool existed_ = false, armed_ = false;
};

// bench model's lists and -o, checked once parsing is done (a usage error, exit 2, naming the
// flag).
void parse_model_lists(BenchOptions& o) {
  constexpr int kMaxTokens = 1 << 20, kMaxDepth = 1 << 24;
  bench::TestLists& l = o.m.tests;
  try {
    l.n_prompt = bench::parse_int_lists(o.n_prompt, "-p", 0, kMaxTokens, {bench::kDefaultPrompt});
    l.n_gen = bench::parse_int_lists(o.n_gen, "-n", 0, kMaxTokens, {bench::kDefaultGen});
    l.n_depth = bench::parse_int_lists(o.n_depth, "-d", 0, kMaxDepth, {0});
    l.n_batch = bench::parse_int_lists(o.n_batch, "-b", 1, kMaxTokens, {bench::kDefaultBatch});
    l.n_ubatch = bench::parse_int_lists(o.n_ubatch, "-ub", 1, kMaxTokens, {bench::kDefaultUbatch});
    o.n_parallel = bench::parse_int_lists(o.parallel, "--parallel", 1, 4096, {});
    l.pg.clear();
    for (const std::string& s : o.pg) l.pg.push_back(bench::parse_pg(s, kMaxTokens));
    o.format = bench::parse_output_format(o.output);
  } catch (const Error& e) {
    throw CLI::ValidationError(e.what());
  }
  // --parallel: one prompt length, one decode length, one ubatch; the other lists do not apply.
  const bool one_each = l.n_prompt.size() == 1 && l.n_gen.size() == 1 && l.n_ubatch.size() == 1 &&
                        l.n_depth == std::vector<int>{0} &&
                        l.n_batch == std::vector<int>{bench::kDefaultBatch} && l.pg.empty() &&
                        o.output == "md" && o.m.routing_trace.empty();
  if ((!o.n_parallel.empty() && !one_each) ||
      (o.n_parallel.empty() && (o.ctx_size > 0 || o.greedy)))
    throw CLI::ValidationError(
        "--parallel takes one -p, -n and -ub value, and no -d, -b, -pg, -o or --routing-trace; "
        "-c and --greedy apply to --parallel only");
  if (o.json_path == "-" && o.format != bench::OutputFormat::md)
    throw CLI::ValidationError(fmt::format(
        "--json - and -o {} both write to standard output (give --json a file)", o.output));
}

int bench_model(BenchOptions& o) {
  JsonOut json_out(o.json_path);
  o.m.dram_bytes = o.model_dram_mib * 1024 * 1024;
  if (!o.quiet)
    o.m.progress = [](std::string_view line) {
      std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data());
    };
  if (!o.n_parallel.empty()) {
    const bench::TestLists& l = o.m.tests;
    bench::BatchBenchOptions b{o.m, o.n_parallel};
    b.n_prompt = l.n_prompt[0];
    b.n_gen = l.n_gen[0];
    b.n_ubatch = l.n_ubatch[0];
    b.n_ctx = o.ctx_size;
    b.greedy = o.greedy;
    const bench::BatchBenchResult r = bench::run_batch_bench(b);
    json_out.write(bench::to_json(r));
    json_out.text(bench::format_text(r));
    return 0;
  }
  // csv and jsonl: a line per test as it finishes (what ran is kept if a later test fails);
  // md and json are printed whole at the end.
  const bench::OutputFormat f = o.format;
  bool first = true;
  if (f == bench::OutputFormat::csv || f == bench::OutputFormat::jsonl)
    o.m.on_test = [&](const bench::ModelBenchResult& r, const bench::TestResult& t) {
      (void)write_stdout(bench::format_record_line(f, r, t, first));
      first = false;
    };
  const bench::ModelBenchResult r = bench::run_model_bench(o.m);
  json_out.write(bench::to_json(r));
  if (f == bench::OutputFormat::md) {
    // The table, then the analysis: standard output (standard error with --json -).
    json_out.text(bench::format_records(f, r) + "\n" + bench::format_text(r));
    return 0;
  }
  // Standard output holds only the records; the analysis goes to standard error.
  if (f == bench::OutputFormat::json) (void)write_stdout(bench::format_records(f, r));
  std::fputs(bench::format_text(r).c_str(), stderr);
  return 0;
}

int bench_disk(BenchOptions& o) {
  JsonOut json_out(o.json_path);
  if (o.block_kib != 0) o.d.block_bytes = {o.block_kib * 1024};
  if (!o.quiet)
    o.d.progress = [](std::string_view line) {
      std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data());
    };
  const bench::DiskBenchResult r = bench::run_disk_bench(o.d);
  json_out.write(bench::to_json(r));
  json_out.text(bench::format_text(r));
  return 0;
}

int bench_kernels(const BenchOptions& o) {
  bench::KernelBenchOptions k;
  // Given at all (even empty: an error), the list is parsed; absent, every type runs.
  if (o.kernels->count("--types") > 0) k.types = bench::parse_type_list(o.types);
  if (!o.threads.empty()) k.threads = bench::parse_thread_list(o.threads);
  k.quick = o.quick;
  k.repetitions = o.repetitions;
  k.gemv_bytes = o.gemv_mib * 1024 * 1024;
  k.dram_bytes = o.dram_mib * 1024 * 1024;
  k.few_tokens.assign(o.few_token_counts.begin(), o.few_token_counts.end());
  JsonOut json_out(o.json_path);
  if (!o.quiet)
    k.progress = [](std::string_view line) {
      std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data());
    };

  bench::KernelBenchResult r = bench::run_kernel_bench(k);
  json_out.write(bench::to_json(r));
  json_out.text(bench::format_text(r));
  return 0;
}

}  // namespace

Runner add_bench(CLI::App& app) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* sub = app.add_subcommand("bench", "benchmarks");
  sub->require_subcommand(1);
  CLI::App* k = sub->add_subcommand(
      "kernels",
      "CPU kernels: DRAM read bandwidth, decode GEMV GB/s per weight type, GEMM tok/s at ubatch "
      "32/128/512, single-thread GFLOP/s in L2, few-token GEMM GB/s on expert-sized matrices");
  o->kernels = k;
  k->add_option("--types", o->types,
                "comma-separated weight types (default: q4_0,q4_1,q5_0,q5_1,q8_0,q2_K,q3_K,q4_K,"
                "q5_K,q6_K,f16,bf16,f32)");
  k->add_option("--threads", o->threads,
                "comma-separated thread counts (default: 1,2,4,... up to the physical cores)");
  k->add_option("--json", o->json_path,
                "also write every number as JSON to this file (-: to standard output, the table to "
                "standard error)");
  k->add_flag("--quick", o->quick, "small sizes: a smoke test, numbers not meaningful");
  k->add_option("--reps", o->repetitions, "timed runs per measurement after a warm-up (default 5)")
      ->check(range(1, 1000));
  k->add_option("--gemv-mib", o->gemv_mib, "MiB of weights in the decode GEMV (default 1024)")
      ->check(range(size_t{1}, size_t{1} << 20));
  k->add_option("--dram-mib", o->dram_mib,
                "MiB streamed for the DRAM bandwidth (default max(1024, 8 x LLC))")
      ->check(range(size_t{1}, size_t{1} << 20));
  k->add_option("--few-tokens", o->few_tokens,
                "token counts of the few-token GEMM (routed experts), a list such as 2,3,4 or 1-16 "
                "(default 1,2,3,4,6,8; 1 always runs)");
  k->add_flag("-q,--quiet", o->quiet, "no progress lines on stderr");
  // --few-tokens, checked once parsing is done (a usage error, exit 2, naming the flag).
  k->callback([o] {
    try {
      o->few_token_counts = bench::parse_int_lists(o->few_tokens, "--few-tokens", 1, 4096, {});
    } catch (const Error& e) {
      throw CLI::ValidationError(e.what());
    }
  });
  CLI::App* m = sub->add_subcommand(
      "model",
      "a model, on the CPU or placed on a GPU by the placement flags: prefill (pp) and decode "
      "(tg) tok/s, bytes read per decode token and the bandwidth bound measured in the same run");
  o->model = m;
  m->add_option("-m,--model", o->m.model_path, "GGUF model file")->required();
  m->add_option("-t,--threads", o->m.n_threads, "worker threads (default: physical cores)")
      ->check(range(0, 4096));
  // llama-bench's lists: comma-separated, ranges FIRST-LAST[+STEP|*MULT], the option repeated
  // adds to the list; every combination is a test.
  auto list = [&](const std::string& names, std::vector<std::string>& to, const std::string& what) {
    m->add_option(names, to, what)
        ->type_name("LIST")
        ->expected(1)
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  };
  list("-p,--n-prompt", o->n_prompt,
       "prompt tokens of the pp tests, a list (default 512; 0: no pp test)");
  list("-n,--n-gen", o->n_gen, "decode steps of the tg tests, a list (default 128; 0: no tg test)");
  list("-d,--n-depth", o->n_depth,
       "tokens of context already in the KV cache when each test starts, a list (default 0)");
  list("-b,--batch-size", o->n_batch,
       "logical batch: prompt tokens submitted per call, a list (default 2048)");
  list("--ubatch-size", o->n_ubatch,
       "-ub: tokens per prefill step, a list (default 512; a batch is cut into ubatches)");
  m->add_option("--prompt-gen", o->pg,
                "-pg PP,TG: a test of PP prompt tokens then TG decode steps, timed together "
                "(repeat for more)")
      ->type_name("PP,TG")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  m->add_option("-o,--output", o->output,
                "the tests' records on standard output: md (a table, then the analysis), csv, "
                "json or jsonl (the analysis then on standard error)");
  m->add_option("-r,--repetitions", o->m.repetitions, "timed runs after a warm-up (default 3)")
      ->check(range(1, 1000));
  m->add_option("--dram-mib", o->model_dram_mib,
                "MiB streamed for the DRAM bandwidth (default max(1024, 8 x LLC))")
      ->check(range(size_t{1}, size_t{1} << 20));
  m->add_flag("--profile", o->m.profile,
              "also report time per op kind (with a device: decode steps run without graph "
              "replay, each device op timed)");
  m->add_option("--parallel", o->parallel,
                "N[,N...]: instead of pp/tg, N sequences decoding together after -p prompt "
                "tokens each (-n steps of N tokens): aggregate and per-sequence tok/s, distinct "
                "routed experts per layer per step, and the bound from the bytes a step reads "
                "(1..4096; lists and ranges as -p takes them)")
      ->type_name("LIST")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  m->add_option("-c,--ctx-size", o->ctx_size,
                "with --parallel: the KV cache's tokens over all N sequences, each getting c / N "
                "as a server's slots do (0, the default: -p + -n per sequence)")
      ->check(range(int64_t{0}, int64_t{1} << 24));
  m->add_flag("--greedy", o->greedy,
              "with --parallel: decode each sequence's greedy token (picked as a server picks "
              "it) from the prompts `bench serve` sends, instead of random tokens");
  add_host_expert_share(*m, o->m.host_expert_share);
  add_warm_workers(*m, o->m.warm_workers_us);
  add_residency_swaps(*m, o->m.residency_swaps);
  m->add_option("--disk-bench", o->m.disk_bench_seconds,
                "with a disk tier (--ram-budget): after the tests, measure the drive's O_DIRECT "
                "random-read bandwidth at queue depth 32 for expert-slice reads for SECONDS, so "
                "the tier's achieved bandwidth is a fraction within this run (0: off)")
      ->check(CLI::Range(0.0, 600.0));
  add_residency_policy(*m, o->m.residency_policy);
  m->add_option("--routing-trace", o->m.routing_trace,
                "replay this routing trace's expert choices (berth trace gen, run "
                "--dump-routing): the run's token i takes the trace's token i mod its length; "
                "only the routers' picks change")
      ->check(CLI::ExistingFile);
  m->add_option("--residency-window", o->m.residency_window,
                "decode steps per window of the expert-slot report (--residency adaptive)")
      ->capture_default_str()
      ->check(range(1, 1 << 20));
  add_handoff(*m, o->m.handoff);
  add_placement_flags(*m, o->m.placement);
  add_stream_experts(*m, o->m.stream_min_tokens);
  add_stream_split(*m, o->m.stream_split);
  m->add_option("--json", o->json_path,
                "also write every number as JSON to this file (-: to standard output, the table to "
                "standard error)");
  m->add_flag("-q,--quiet", o->quiet, "no progress lines on stderr");
  m->callback([o] { parse_model_lists(*o); });
  CLI::App* d = sub->add_subcommand(
      "disk",
      "the drive under a model file: random-read GB/s of expert-sized blocks through io_uring "
      "with O_DIRECT (at --qd and at depth 1), a pool of pread threads and mmap page faults, "
      "each from a cold page cache");
  o->disk = d;
  d->add_option("-m,--model", o->d.path, "the file to read (a GGUF model or any large file)")
      ->required();
  d->add_option("--qd", o->d.queue_depth, "io_uring queue depth and pread threads (default 32)")
      ->check(range(1u, 1024u));
  d->add_option("--block-kib", o->block_kib,
                "KiB per read, a multiple of 4 (default: 3072 and 1024; 3 MiB is one qwen3-30b-a3b "
                "Q4_K expert's gate + up + down)")
      ->check(range(size_t{4}, size_t{1} << 20));
  d->add_option("--seconds", o->d.seconds, "seconds per run (default 10)")
      ->check(range(0.001, 3600.0));
  d->add_option("--reps", o->d.repetitions,
                "runs per method, interleaved; the table then adds median, min and max (default 1)")
      ->check(range(1, 1000));
  d->add_option("--json", o->json_path,
                "also write every number as JSON to this file (-: to standard output, the table to "
                "standard error)");
  d->add_flag("-q,--quiet", o->quiet, "no progress lines on stderr");
  Runner serve = add_bench_serve(*sub);
  CLI::App* serve_cmd = sub->get_subcommand("serve");
  return [o, serve, serve_cmd] {
    if (o->kernels->parsed()) return bench_kernels(*o);
    if (o->disk->parsed()) return bench_disk(*o);
    if (o->model->parsed()) return bench_model(*o);
    if (serve_cmd->parsed()) return serve();
    return 2;
  };
}

}  // namespace berth::cli
