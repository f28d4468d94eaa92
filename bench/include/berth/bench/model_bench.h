// `berth bench model`: prefill and decode speed of a whole model on the CPU, beside the bound
// that the DRAM read bandwidth (measured in the same run) puts on decode.
//
// The tests are llama-bench's (bench_tests.h: -p, -n, -pg, -d, -b, -ub lists and their product),
// each run once as a warm-up and then `repetitions` times, tokens drawn from a seeded generator:
//   pp N: N prompt tokens from the test's depth, in batches of -b tokens cut into ubatches of
//     -ub (default 512: a prompt longer than that takes several prefill steps).
//   tg N: N single-token decode steps from the test's depth (no sampling).
//   pp P+tg G: both, timed together.
//   Depth D: before each timed run the KV cache holds D tokens of context (filled once per depth
//     and kept: each run truncates the cache back to D, Session::truncate).
// Each test gives a record (llama-bench's fields: mean and sample standard deviation of tok/s
// over the timed runs, each run's time; plus berth's placement fields), in llama-bench's output
// formats (format_records). The first pp test and the first tg test of the product are the ones
// the rest of the report analyses, with berth's statistic (the median of the timed runs):
//   DRAM: cpu bandwidth (kernel_bench.h, measurement 1) at the same thread count.
//   Bytes per decode token: what one decode step must read from memory: every weight a
//   decode graph's ops read (matmul: the whole tensor; embed: one row; norms and biases: their
//   row; moe_experts: n_expert_used experts' gate, up and down slices per layer, exact because
//   a token's top-k experts are distinct) plus the KV cache (f32 K and V rows of every layer at
//   the average position of the tg run, its depth included). Bound tok/s = DRAM bytes/s / bytes
//   per token; fraction = tg tok/s / bound.
// With `profile`, the executor's per-op-kind time of those two tests' timed runs is reported too.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "berth/bench/bench_tests.h"
#include "berth/bench/kernel_bench.h"
#include "berth/placement/plan.h"

namespace berth {
class Device;
struct SessionParams;
}  // namespace berth

namespace berth::bench {

struct ModelBenchResult;
struct TestResult;

struct ModelBenchOptions {
  std::string model_path;
  int n_threads = 0;  ///< 0: all physical cores
  /// -p, -n, -pg, -d, -b, -ub (a 0 in -p or -n: no such test).
  TestLists tests;
  int repetitions = 3;    ///< timed runs after one warm-up
  size_t dram_bytes = 0;  ///< DRAM bandwidth buffer; 0: max(1 GiB, 8 x LLC)
  uint64_t seed = 1;
  bool profile = false;
  /// Placement flags (-ngl, -ot, --cpu-moe, --n-cpu-moe, --vram-budget); with a device the
  /// default is the automatic plan, without one everything runs on the CPU.
  placement::Flags placement;
  /// HybridOptions::stream_experts_min_tokens (0: CPU-held experts stay on the CPU in prefill;
  /// -1, the default: automatic, kStreamExpertsAuto in runtime/placed.h).
  int32_t stream_min_tokens = -1;
  /// HybridOptions::host_expert_share (0: off).
  double host_expert_share = 0;
  /// --stream-split: "off" (the default), "on" or fixed rates (parse_stream_split,
  /// scheduler/stream_split.h).
  std::string stream_split = "off";
  /// --residency-swaps: ExpertSlotsOptions::max_swaps_per_step (expert slots come from the plan).
  int32_t residency_swaps = 4;
  /// --residency-policy: make_slot_policy's name (empty: the default policy).
  std::string residency_policy;
  /// HybridOptions::warm_workers_us (0: off; -1: HybridOptions' default).
  int64_t warm_workers_us = -1;
  /// HybridOptions::handoff: "auto", "flags" or "callback".
  std::string handoff = "auto";
  /// --disk-bench SECONDS: with a disk tier, also measure the drive's O_DIRECT random-read
  /// bandwidth at queue depth 32 for reads of one expert slice (berth bench disk's io_uring
  /// method, `disk_bench_seconds` per run, one run) after the tests, so the tier's achieved
  /// bandwidth is a fraction within one run. 0: not measured.
  double disk_bench_seconds = 0;
  /// --routing-trace FILE: every step's routers select this trace's experts (runtime/
  /// routing_io.h: the run's token i takes the trace's token i mod its length; the weights and
  /// the experts' arithmetic stay the model's). Empty: the model routes.
  std::string routing_trace;
  /// Decode steps per window of the residency report (tg_residency).
  int32_t residency_window = 16;
  std::function<void(std::string_view)> progress;
  /// Called after each test with the result so far (its records' shared fields are set) and the
  /// test's result (the last of result.tests).
  std::function<void(const ModelBenchResult&, const TestResult&)> on_test;
};

/// One test's timed runs.
struct TestResult {
  BenchTest test;
  std::string test_time;             ///< ISO 8601 UTC, when its warm-up began
  std::vector<uint64_t> samples_ns;  ///< one per timed run
  TestStats stats;
  /// With a device: the share of the timed runs' wall time spent in CPU segments.
  double cpu_busy = 0;
};

struct OpShare {
  std::string kind;
  double seconds = 0;   ///< per run
  double fraction = 0;  ///< of the run's op time
};

struct ModelBenchResult {
  MachineInfo machine;
  ModelBenchOptions options;
  std::string arch, model_name;
  /// llama-bench's model_type: architecture, size and file type, e.g. "qwen3moe 30.5B Q4_K -
  /// Medium" (the size from the parameter count; the type from general.file_type).
  std::string model_type;
  /// "CPU", or the device's kind ("CUDA", "SIM") when one holds part of the model.
  std::string backend;
  /// The tests in run order (expand_tests) and, as they finish, their results.
  std::vector<BenchTest> planned;
  std::vector<TestResult> tests;
  /// Index in `planned` of the first pp and the first tg test (-1: none), which the fields
  /// below (pp_tok_s, tg_tok_s, the bound, the profiles) describe.
  int pp_test = -1, tg_test = -1;
  int64_t n_params = 0;       ///< elements of all tensors
  uint64_t weight_bytes = 0;  ///< bytes of all tensors
  int64_t n_layer = 0, n_expert = 0, n_expert_used = 0;
  int n_threads = 0;
  Rate pp_tok_s, tg_tok_s;
  DramResult dram;
  uint64_t decode_weight_bytes = 0;  ///< weights read per decode token
  uint64_t decode_kv_bytes = 0;      ///< KV cache read per decode token (average)
  /// Recurrent state (Qwen3.5's GDN layers) read and written per decode token: 2 x (conv_dim +
  /// ssm_dim) x 4 bytes per recurrent layer; on the side of the hybrid bound where the layer's
  /// KV cache (and so its state) lives.
  uint64_t decode_state_bytes = 0;
  /// dram / (decode_weight_bytes + decode_kv_bytes + decode_state_bytes)
  double bound_tok_s = 0;
  /// tg_tok_s.median / bound_tok_s; with a device, / hybrid_bound_tok_s
  double fraction_of_bound = 0;
  double decode_gbps = 0;  ///< tg tok/s x bytes per token / 1e9
  std::vector<OpShare> pp_profile, tg_profile;
  /// With `profile` and a device: device time per op kind (steps run without graph replay).
  std::vector<OpShare> pp_gpu_profile, tg_gpu_profile;
  std::string handoff;          ///< "flags" or "callback"
  int64_t warm_workers_us = 0;  ///< in effect in decode steps (flag hand-off only; 0: off)
  int32_t stream_experts_min_tokens = 0;  ///< in effect (--stream-experts resolved; 0: off)
  /// The split of streamed layers over the first pp test's timed runs (HybridOptions::
  /// stream_split; Scheduler::StreamSplitStats, summed over the runs), the rates in use after
  /// them and the CPU side's learned scale. layer_steps 0: no split ran.
  struct StreamSplit {
    int64_t layer_steps = 0, experts_cpu = 0, experts_streamed = 0, cpu_calls = 0, calls = 0;
    int64_t bytes_streamed = 0, bytes_whole = 0;
    double pcie_gbps = 0, dram_gbps = 0, cpu_gflops = 0, cpu_scale = 1;
  } pp_split;
  /// Residency::host_experts_pinning(): "registered", "copied" or "" (none pinned).
  std::string host_experts_pinning;
  // With a device (hybrid runs):
  std::string device;             ///< e.g. "CUDA0 (NVIDIA H200)"; empty: CPU only
  std::string placement;          ///< the plan's description ("automatic", "--cpu-moe", ...)
  uint64_t gpu_weight_bytes = 0;  ///< weights resident on the device
  uint64_t decode_gpu_bytes = 0;  ///< per decode token: weights + KV read on the device
  uint64_t decode_cpu_bytes = 0;  ///< per decode token: weights + KV read from host DRAM
  /// Per decode token: CPU-held expert bytes the device reads over PCIe (host_expert_share,
  /// counted out of decode_cpu_bytes).
  uint64_t decode_share_bytes = 0;
  /// With expert slots (tg_residency): per decode token, the CPU-held routed expert bytes the
  /// slots served (the measured device share of routed calls times those bytes; counted in
  /// decode_gpu_bytes, not decode_cpu_bytes), and the bytes copied into slots (counted in
  /// decode_cpu_bytes: the copies read host DRAM).
  uint64_t decode_slot_bytes = 0, decode_swap_bytes = 0;
  /// Unified memory (--unified): the device reads its weights in place. On a unified board they
  /// count at the device's memory rate (hbm_gbps: the board's one memory); forced on a discrete
  /// GPU (`unified_over_bus`) its weights cross the bus every step and count at h2d_gbps.
  bool unified = false, unified_over_bus = false;
  double hbm_gbps = 0;  ///< device-to-device copy, bytes read + written per s
  double h2d_gbps = 0;  ///< pinned host-to-device copy
  /// Decode bound with the per-layer dependency (the experts wait for attention and the reverse;
  /// the CPU's and the device's shares of the experts run at the same time):
  /// 1 / (max(decode_cpu_bytes / DRAM, decode_share_bytes / pinned H2D) + decode_gpu_bytes / HBM),
  /// where with unified_over_bus the device's weight bytes count at pinned H2D instead of HBM.
  double hybrid_bound_tok_s = 0;
  /// Share of the timed tg steps' wall time spent in CPU segments (host callbacks); the rest is
  /// device work, copies and hand-offs.
  double tg_cpu_busy = 0, pp_cpu_busy = 0;
  /// The device's share of a tg step: the same decode steps timed again with the CPU segments
  /// skipped (Scheduler::set_skip_cpu_segments), over the real steps' time. It counts the
  /// device's ops and the hand-off copies and waits; 0 when the step has no CPU segment
  /// (then the device is the whole step).
  double tg_device_busy = 0;
  /// The timed tg steps' moe_experts calls on the CPU (CpuExecutor::MoeTiming), the mean per
  /// call over all timed runs (not a median: one disturbed run moves it), in microseconds: total =
  /// before (routing, grouping, activation quantization) + region (the expert FFN's parallel
  /// region) + after (combine); join / wait / tail per thread taking part (pool wake-up before its
  /// first task, down blocks spinning for their expert, idle after its last task), `threads` of
  /// them per call on average. calls == 0: no expert ran on the CPU.
  struct MoeSplit {
    int64_t calls = 0;
    double threads = 0, total_us = 0, before_us = 0, region_us = 0, after_us = 0;
    double join_us = 0, wait_us = 0, tail_us = 0;
  } tg_moe;
  /// The disk tier (residency/disk_tier.h) over the first tg test's timed runs; used false: no
  /// tier. bytes_per_token: the expert slices' bytes asked of the file per decode token
  /// (DiskTier::Stats::bytes_read); ahead_hit_rate: reads issued before they were needed / all
  /// needed reads (DiskTier::Stats::ahead_hit_rate); achieved_gbps: the reader's bytes over its
  /// seconds with a read in the kernel (1e9 B/s; DiskTier::bandwidth: io::DiskReader::bytes_read
  /// and busy_seconds, both counted where the reader reaps completions);
  /// drive_gbps: the drive's O_DIRECT QD32 random-read rate for expert-slice reads measured in
  /// the same run (--disk-bench; 0: not measured); fraction = achieved / drive.
  struct DiskTierResult {
    bool used = false;
    std::string backend;
    int32_t layers = 0, slots_per_layer = 0;
    uint64_t arena_bytes = 0, read_bytes_per_expert = 0;
    int64_t tokens = 0, calls = 0, hits = 0, reads_demand = 0, reads_ahead = 0, ahead_used = 0;
    /// Decode predictions made and read ahead; their precision (DiskTier::Stats).
    int64_t predictions = 0, predictions_read = 0;
    double prediction_precision = 0;
    double bytes_per_token = 0, ahead_hit_rate = 0, achieved_gbps = 0, wait_s_per_token = 0;
    double drive_gbps = 0, fraction = 0;
  } disk;
  /// Routing forced from options.routing_trace: its tokens (0: the model routed).
  int64_t routing_trace_tokens = 0;
  /// Expert slots (--residency adaptive) in the first tg test's timed runs: routed calls of the
  /// layers with slots and the share served from the device, swaps started and bytes copied into
  /// slots per generated token; and per window of options.residency_window decode steps of its
  /// last timed run, the same counts (how fast the slots warm up). slots == false: no slots.
  struct ResidencyWindow {
    int64_t first_token = 0, n_tokens = 0;
    int64_t calls = 0, device_calls = 0, swaps = 0, bytes_moved = 0;
    double device_fraction() const {
      return calls > 0 ? static_cast<double>(device_calls) / static_cast<double>(calls) : 0;
    }
  };
  struct Residency {
    bool slots = false;
    ResidencyWindow total;  ///< over all timed runs (first_token 0, n_tokens all generated)
    std::vector<ResidencyWindow> windows;
  } tg_residency;
};

/// Loads the model and runs the measurements above. Throws what loading throws (GgufError,
/// Error(format/unsupported)), Error(invalid_argument) for negative sizes, no test to run or a
/// test needing more context than the model's context_length (naming -d, -p, -n or -pg),
/// Error(out_of_memory) when the KV cache or the DRAM buffer does not fit.
ModelBenchResult run_model_bench(const ModelBenchOptions& options);

/// Sets params.hybrid's warm_workers_us and handoff from `o` (after place(), which plans with
/// the defaults). Throws Error(invalid_argument) for a handoff other than auto, flags, callback.
void set_step_options(const ModelBenchOptions& o, SessionParams& params);

/// GB/s moved by `copy` on `dev` (enqueued, then synchronized): `count` bytes per call, the
/// median of 5 timed calls after a warm-up.
double copy_gbps(Device& dev, const std::function<void()>& copy, double count);

/// Every number as JSON (`--json FILE`): the first pp and tg tests' analysis as before the test
/// lists, plus "tests", the records of all tests.
nlohmann::json to_json(const ModelBenchResult& r);
/// The analysis as text (machine, model, the first pp and tg tests' median and best, bytes per
/// decode token and the bound, device shares, profiles).
std::string format_text(const ModelBenchResult& r);

/// One test's record with llama-bench's field names (cpu_info, gpu_info, backends,
/// model_filename, model_type, model_size, model_n_params, n_batch, n_ubatch, n_threads,
/// n_gpu_layers, n_cpu_moe, tensor_buft_overrides, n_prompt, n_gen, n_depth, test_time, avg_ns,
/// stddev_ns, avg_ts, stddev_ts, samples_ns, samples_ts) and berth's (median_ts, placement,
/// device, ...), in that order.
nlohmann::ordered_json test_record(const ModelBenchResult& r, const TestResult& t);
/// The records of r.tests as a whole document: md (llama-bench's table: model, size, params,
/// backend, threads, n_batch when not only the default, n_ubatch, test, t/s as mean ± standard
/// deviation), csv (a header line, then a line per test, every value quoted, the sample arrays
/// left out), json (an array) or jsonl (an object per line).
std::string format_records(OutputFormat f, const ModelBenchResult& r);
/// One test's part of a csv or jsonl document, for printing as tests finish (csv: the header
/// line first when `first`).
std::string format_record_line(OutputFormat f, const ModelBenchResult& r, const TestResult& t,
                               bool first);

}  // namespace berth::bench
