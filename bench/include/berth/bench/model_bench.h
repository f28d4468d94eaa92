// `berth bench model`: prefill and decode speed of a whole model on the CPU, beside the bound
// that the DRAM read bandwidth (measured in the same run) puts on decode.
//
// Measurements (llama-bench's pp/tg convention; each the median of `repetitions` runs after one
// warm-up run, tokens drawn from a seeded generator, each run from an empty KV cache):
//   pp: one prefill step of `n_prompt` tokens (ubatch = n_prompt). tok/s = n_prompt / s.
//   tg: `n_gen` single-token decode steps from position 0 (no sampling). tok/s = n_gen / s.
//   DRAM: cpu bandwidth (kernel_bench.h, measurement 1) at the same thread count.
//   Bytes per decode token: what one decode step must read from memory: every weight a
//   decode graph's ops read (matmul: the whole tensor; embed: one row; norms and biases: their
//   row; moe_experts: n_expert_used experts' gate, up and down slices per layer, exact because
//   a token's top-k experts are distinct) plus the KV cache (f32 K and V rows of every layer at
//   the average position of the tg run). Bound tok/s = DRAM bytes/s / bytes per token;
//   fraction = tg tok/s / bound.
// With `profile`, the executor's per-op-kind time of the timed tg and pp runs is reported too.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "berth/bench/kernel_bench.h"
#include "berth/placement/plan.h"

namespace berth::bench {

struct ModelBenchOptions {
  std::string model_path;
  int n_threads = 0;      ///< 0: all physical cores
  int n_prompt = 512;     ///< pp tokens (0: skip pp)
  int n_gen = 128;        ///< tg tokens (0: skip tg)
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
  /// HybridOptions::warm_workers_us (0: off; -1: HybridOptions' default).
  int64_t warm_workers_us = -1;
  /// HybridOptions::handoff: "auto", "flags" or "callback".
  std::string handoff = "auto";
  std::function<void(std::string_view)> progress;
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
  int64_t n_params = 0;       ///< elements of all tensors
  uint64_t weight_bytes = 0;  ///< bytes of all tensors
  int64_t n_layer = 0, n_expert = 0, n_expert_used = 0;
  int n_threads = 0;
  Rate pp_tok_s, tg_tok_s;
  DramResult dram;
  uint64_t decode_weight_bytes = 0;  ///< weights read per decode token
  uint64_t decode_kv_bytes = 0;      ///< KV cache read per decode token (average)
  double bound_tok_s = 0;            ///< dram / (decode_weight_bytes + decode_kv_bytes)
  /// tg_tok_s.median / bound_tok_s; with a device, / hybrid_bound_tok_s
  double fraction_of_bound = 0;
  double decode_gbps = 0;  ///< tg tok/s x bytes per token / 1e9
  std::vector<OpShare> pp_profile, tg_profile;
  /// With `profile` and a device: device time per op kind (steps run without graph replay).
  std::vector<OpShare> pp_gpu_profile, tg_gpu_profile;
  std::string handoff;          ///< "flags" or "callback"
  int64_t warm_workers_us = 0;  ///< in effect in decode steps (flag hand-off only; 0: off)
  int32_t stream_experts_min_tokens = 0;  ///< in effect (--stream-experts resolved; 0: off)
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
  double hbm_gbps = 0;  ///< device-to-device copy, bytes read + written per s
  double h2d_gbps = 0;  ///< pinned host-to-device copy
  /// Decode bound with the per-layer dependency (the experts wait for attention and the reverse;
  /// the CPU's and the device's shares of the experts run at the same time):
  /// 1 / (max(decode_cpu_bytes / DRAM, decode_share_bytes / pinned H2D) + decode_gpu_bytes / HBM).
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
};

/// Loads the model and runs the measurements above. Throws what loading throws (GgufError,
/// Error(format/unsupported)), Error(invalid_argument) for negative sizes or a prompt longer
/// than the model's context, Error(out_of_memory) when the KV cache or the DRAM buffer does
/// not fit.
ModelBenchResult run_model_bench(const ModelBenchOptions& options);

nlohmann::json to_json(const ModelBenchResult& r);
std::string format_text(const ModelBenchResult& r);

}  // namespace berth::bench
