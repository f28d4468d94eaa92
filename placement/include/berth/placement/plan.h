// Placement: which device holds each weight tensor (and each layer's KV cache), decided before
// anything is loaded. The executor follows the plan: an op runs where its weights live.
//
// Flags keep llama.cpp's meanings (common/arg.cpp, tools/main/README.md):
// - `-ngl N` (--n-gpu-layers): the last N of the n_layer repeating layers on the GPU, the output
//   layer (output_norm, output) too when N > n_layer; token_embd stays on the CPU.
// - `-ot REGEX=DEVICE` (--override-tensor, repeatable; comma-separated lists allowed): tensors
//   whose name matches REGEX (ECMAScript, searched anywhere in the name) go to DEVICE ("CPU",
//   "CUDA0"/"GPU"); the first matching rule wins and overrides -ngl.
// - `--cpu-moe`: every routed-expert tensor (`blk.N.ffn_{gate,up,down}_exps.weight`) on the CPU.
// - `--n-cpu-moe N`: the routed-expert tensors of the first N layers on the CPU.
// - `--vram-budget SIZE` (berth's own): plan as if the device had only SIZE free.
// Without -ngl and with a device, the automatic plan fills the budget in order of time saved
// per byte: output norm, each layer's non-expert tensors (attention, norms, router, shared
// experts) together with its KV cache, the output matrix, then whole layers' routed experts
// (last layers first, so it agrees with --n-cpu-moe), token_embd last.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace berth::placement {

enum class Home : uint8_t { cpu, gpu };
std::string_view home_name(Home h);  ///< "CPU" / "GPU"

/// One weight tensor, in the model's WeightTable order.
struct TensorEntry {
  std::string name;   ///< GGUF name, e.g. "blk.3.ffn_gate_exps.weight"
  size_t bytes = 0;   ///< as stored
  int32_t layer = -1; ///< N of "blk.N.", -1 for token_embd/output_norm/output
  bool routed_expert = false;  ///< a stacked routed-expert tensor (name contains "_exps")
};

/// Placement flags as the CLI parses them.
struct Flags {
  int32_t n_gpu_layers = -1;  ///< -ngl; -1 = automatic
  std::vector<std::pair<std::string, std::string>> overrides;  ///< -ot (regex, device), in order
  bool cpu_moe = false;                                        ///< --cpu-moe
  int32_t n_cpu_moe = 0;                                       ///< --n-cpu-moe
  std::optional<size_t> vram_budget;                           ///< --vram-budget, bytes
};

struct Request {
  std::vector<TensorEntry> tensors;
  int32_t n_layer = 0;
  /// Device KV cache bytes of each layer (f16 K and V for the context size), n_layer entries.
  std::vector<size_t> kv_bytes;
  /// Device bytes for activations and kernel workspaces at the chosen ubatch size.
  size_t scratch_bytes = 0;
  /// Kept free for the CUDA context, allocator slack and fragmentation.
  size_t margin_bytes = size_t{512} << 20;
  bool has_device = false;     ///< a GPU is present (or planned for with --vram-budget)
  std::string device_name;     ///< for messages, e.g. "CUDA0 (NVIDIA H200)"
  size_t device_free_bytes = 0;  ///< what the device reports free
  Flags flags;
};

struct Plan {
  std::vector<Home> home;     ///< per tensor (Request::tensors order)
  std::vector<Home> kv_home;  ///< per layer: where its attention runs and its KV cache lives
  size_t budget_bytes = 0;    ///< min(device free, --vram-budget); 0 without a device
  size_t gpu_weight_bytes = 0, cpu_weight_bytes = 0;
  size_t gpu_kv_bytes = 0, cpu_kv_bytes = 0;
  size_t scratch_bytes = 0, margin_bytes = 0;  ///< 0 when nothing is on the GPU
  std::string how;  ///< "automatic", "-ngl 12", "-ngl 99 --cpu-moe", ... (for the table)
  /// Total device bytes the plan needs.
  size_t gpu_total() const { return gpu_weight_bytes + gpu_kv_bytes + scratch_bytes + margin_bytes; }
};

/// Parses "24G", "512M", "1.5GiB", "1000000" (bytes); K/M/G/T are powers of 1024.
/// Throws Error(invalid_argument) naming `flag` and the text.
size_t parse_size(std::string_view text, std::string_view flag);

/// Parses one -ot argument "REGEX=DEVICE[,REGEX=DEVICE...]" and appends to flags.overrides.
/// Throws Error(invalid_argument) for a missing '=', an invalid regex or an unknown device name.
void add_override(Flags& flags, std::string_view arg);

/// The plan for `req`. Throws Error(invalid_argument) for inconsistent flags (e.g. -ngl < 0 other
/// than -1, --n-cpu-moe < 0, -ot/-ngl naming the GPU when there is none is only a warning) and
/// Error(out_of_memory) when the GPU share does not fit the budget, with one message naming
/// every term: "plan needs 30512 MiB on CUDA0 (NVIDIA H200) but the budget is 24576 MiB: weights
/// 28000 MiB + KV cache 1536 MiB + scratch 464 MiB + margin 512 MiB".
Plan make_plan(const Request& req);

/// Human-readable table: one line per tensor (name, bytes, home) then totals per device.
std::string plan_table(const Request& req, const Plan& plan);
/// The same as JSON: {"how", "budget_bytes", "devices": {"GPU": {...}, "CPU": {...}},
/// "tensors": [{"name", "bytes", "layer", "home"}...], "kv": [{"layer", "bytes", "home"}...]}.
std::string plan_json(const Request& req, const Plan& plan);

}  // namespace berth::placement
