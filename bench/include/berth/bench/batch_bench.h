// `berth bench model --parallel N[,N...]`: N sequences decoding together after their prompts,
// each step one token of every sequence (the batching loop's decode steps).
//
// Per N (each the median of `repetitions` runs after a warm-up; each run prefills N prompts of
// n_prompt seeded random tokens, one sequence per step, then times n_gen decode steps of N
// tokens fed without sampling; with `greedy`, each step feeds every sequence its own greedy
// token, picked as a server picks it (Session::eval_step_select: on the device where there is
// one, only the ids come back), from the prompts `bench serve` sends: run k's prompt of sequence
// q is client q's k-th request (std::mt19937_64 seeded seed * 1000003 + q, ids uniform in
// [1, n_vocab)). A sequence's tokens never depend on its neighbours (the batch-invariance rule),
// so the loop then decodes exactly the tokens a server's slots decode for those requests, and
// its steps read the same experts):
//   aggregate tok/s = N * n_gen / s; per-sequence tok/s = n_gen / s.
//   Routed experts: the CPU's moe_experts calls count the distinct experts a step reads
//   (CpuExecutor::moe_reads: each expert's gate/up/down once for all of the step's tokens routed
//   to it); per layer per step = experts / calls. Experts on a device that counts its reads
//   (DeviceInfo::moe_expert_reads) add theirs; elsewhere min(N * n_expert_used, n_expert) per
//   layer, an upper bound (marked so).
//   Bytes per step: every other weight a decode step reads, once per step whatever N (matmul:
//   the tensor; embed: N rows), plus the distinct experts' bytes, plus each sequence's KV rows
//   (f32 on the host, f16 on the device) at the run's average position, split by where they
//   live. Bound tok/s = N / (host bytes / DRAM GB/s + device bytes / HBM GB/s), bandwidths
//   measured in the same run (the per-layer dependency: the sides wait for each other).
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "berth/bench/kernel_bench.h"
#include "berth/bench/model_bench.h"

namespace berth::bench {

struct BatchBenchOptions {
  /// Model, threads, -r, DRAM buffer, seed, placement flags, --stream-experts,
  /// --host-expert-share, --warm-workers, --handoff; its test lists and --profile are not used.
  ModelBenchOptions model;
  std::vector<int> parallel;  ///< N values, each >= 1
  int n_prompt = 512;         ///< -p: prompt tokens per sequence (>= 1)
  int n_gen = 128;            ///< -n: decode steps (>= 1)
  int n_ubatch = 512;         ///< -ub: tokens per prefill step of each prompt (>= 1)
  /// -c: KV cache tokens over all sequences, each sequence getting n_ctx / N (as `serve -c -np`
  /// gives its slots); 0: n_prompt + n_gen per sequence. The decode attention's KV split is a
  /// function of a sequence's n_ctx, so this changes the step's kernels.
  int64_t n_ctx = 0;
  bool greedy = false;  ///< --greedy: decode greedy tokens from bench serve's prompts (above)
};

struct BatchRow {
  int n_seq = 0;
  Rate agg_tok_s;                ///< N tokens per step
  double seq_tok_s = 0;          ///< per sequence, at the median
  double experts_per_layer = 0;  ///< distinct routed experts per MoE layer per step (0: dense)
  bool experts_exact = true;     ///< false: some layers' count is the upper bound
  double host_bytes = 0, device_bytes = 0;  ///< per step
  double bound_tok_s = 0;                   ///< aggregate
  double fraction = 0;                      ///< agg_tok_s.median / bound_tok_s
  /// --profile: device op time per decode step by op kind (steps run without graph replay,
  /// each device op timed), seconds per step; empty without --profile or a device.
  std::vector<std::pair<std::string, double>> device_profile;
};

struct BatchBenchResult {
  MachineInfo machine;
  std::string arch, model_name, device, placement;
  int n_threads = 0, n_prompt = 0, n_gen = 0, repetitions = 0;
  int64_t n_ctx = 0;  ///< -c as given (0: n_prompt + n_gen per sequence)
  bool greedy = false;
  double dram_gbps = 0, hbm_gbps = 0;
  std::vector<BatchRow> rows;
};

/// Runs the measurements above. Throws Error(invalid_argument) for an empty or non-positive N
/// list, -p or -n below 1, contexts beyond the model's context_length; what loading, placing
/// and Session throw (e.g. Error(unsupported) for several sequences with attention on a device
/// that serves one).
BatchBenchResult run_batch_bench(const BatchBenchOptions& options);

nlohmann::json to_json(const BatchBenchResult& r);
std::string format_text(const BatchBenchResult& r);

}  // namespace berth::bench
