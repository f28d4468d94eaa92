// Placement: which device holds each weight tensor (and each layer's KV cache), decided before
// anything is loaded. The executor follows the plan: an op runs where its weights live.
//
// Flags keep llama.cpp's meanings (common/arg.cpp, tools/main/README.md):
// - `-ngl N` (--n-gpu-layers): the last N of the n_layer repeating layers on the GPU, the output
//   layer (output_norm, output) too when N > n_layer; token_embd stays on the CPU (unless the
//   model has no output.weight: then the head reuses token_embd, which counts as the output
//   layer's matrix).
// - `-ot REGEX=DEVICE` (--override-tensor, repeatable; comma-separated lists allowed): tensors
//   whose name matches REGEX (PCRE2, Perl-compatible; searched anywhere in the name) go to DEVICE
//   ("CPU", "CUDA0"/"GPU"); the first matching rule wins and overrides -ngl, --cpu-moe and
//   --n-cpu-moe.
// - `--cpu-moe`: every routed-expert tensor (role routed_expert: `blk.N.ffn_{gate,up,down}_exps`)
//   on the CPU.
// - `--n-cpu-moe N`: the routed-expert tensors of the first N layers on the CPU.
// - `--vram-budget SIZE` (berth's own): plan as if the device had only SIZE free.
// Attention and KV cache: everything of layer N that is not a routed expert moves with the layer,
// and the layer's KV cache lives where its attention runs (kv_home[N] = home of the layer's first
// attention-role tensor, blk.N.attn_q or attn_qkv, when -ot splits a layer; else of its first
// other non-expert tensor). A recurrent layer's state lives with its KV cache, and the small
// tensors the state's ops read (TensorEntry::state_companion) follow it, -ot notwithstanding.
//
// Without -ngl and with a device, the automatic plan fills the budget (what is left after
// scratch, margin and tensors that -ot sends to the GPU) in order of time saved per byte: output
// norm, each layer's non-expert tensors (attention, norms, router, shared experts) together with
// its KV cache (last layers first), the output matrix, then whole layers' routed experts (last
// layers first, stopping at the first layer that does not fit, so it agrees with --n-cpu-moe),
// token_embd last; a unit that does not fit is skipped. If not all layers' non-expert parts fit
// it places whole layers instead, from the last layer down while they fit (what -ngl would
// do), and nothing when none fits or scratch + margin alone exceed the budget. Tensors that
// -ot, --cpu-moe or --n-cpu-moe pin are honoured and not counted in the units. The automatic
// plan only fails (out_of_memory) when -ot pins more to the GPU than the budget holds.
//
// Residency (`--residency static|adaptive`, berth's own): `static` is the above, exactly.
// `adaptive` (the default when the budget, min(device free, --vram-budget), cannot hold every
// weight with its KV cache, scratch and margin) gives the CPU-held routed experts expert slots
// (residency/expert_slots.h: experts that move between the host and the device while decoding):
// the automatic plan places the non-expert units as above but no whole layer's routed experts,
// and the room left in the budget goes to slots, the same count C per MoE layer whose experts
// stay on the CPU (1 <= C < n_expert; none when not even one fits); with explicit -ngl,
// --cpu-moe or --n-cpu-moe the room their plan leaves goes to slots the same way; layers whose
// routed experts an -ot rule placed get none. The slots count in the GPU totals (slot_bytes), so
// the budget holds. Without a device, with --residency static, or for a model whose routed-expert
// tensors do not stack a known expert count (TensorEntry::n_expert), no slots and the plan above.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "berth/core/strings.h"
#include "berth/graph/graph.h"

namespace berth::placement {

enum class Home : uint8_t { cpu, gpu };
std::string_view home_name(Home h);  ///< "CPU" / "GPU"

/// One weight tensor, in the model's WeightTable order.
struct TensorEntry {
  std::string name;    ///< GGUF name, e.g. "blk.3.ffn_gate_exps.weight" (for -ot and the table)
  size_t bytes = 0;    ///< as stored
  int32_t layer = -1;  ///< the layer the model reads it in; -1: none (embedding, head, output norm)
  /// What the model reads it for (graph/graph.h). Placement groups tensors by role and layer:
  /// routed_expert tensors are the experts --cpu-moe and --n-cpu-moe move; the rest of a layer
  /// moves with it; embedding, the layer -1 norm (the output norm) and head are the global ones.
  graph::WeightRole role = graph::WeightRole::other;
  std::string type;  ///< ggml type name for the table ("q4_K"); may be empty
  /// Routed experts: how many experts the tensor stacks (ne[2]); each expert's slice is
  /// bytes / n_expert. 0 otherwise (or unknown: such a layer gets no expert slots).
  int32_t n_expert = 0;
  /// Read by the ops that update its layer's recurrent state (Qwen3.5's ssm_conv1d, ssm_a,
  /// ssm_dt): it lives where the layer's state does (Plan::kv_home), whatever -ot says.
  bool state_companion = false;
  bool routed_expert() const { return role == graph::WeightRole::routed_expert; }
};

/// --residency: static (whole tensors, decided once), adaptive (expert slots), or automatic
/// (the default: adaptive when the budget cannot hold every weight, else static).
enum class ResidencyMode : uint8_t { automatic, fixed, adaptive };
/// "auto", "static", "adaptive".
std::string_view residency_mode_name(ResidencyMode m);
/// Parses --residency's value; throws Error(invalid_argument) naming the flag and the value.
ResidencyMode parse_residency_mode(std::string_view s);

/// --unified: automatic (as the device says: DeviceInfo::unified), on (treat the device as
/// sharing the host's memory: it reads the weights it computes in place, nothing is copied to
/// it), off (a discrete device, even on a unified board).
enum class UnifiedMode : uint8_t { automatic, on, off };
/// "auto", "on", "off".
std::string_view unified_mode_name(UnifiedMode m);
/// Parses --unified's value; throws Error(invalid_argument) naming the flag and the value.
UnifiedMode parse_unified_mode(std::string_view s);

/// The cost model's rates on unified memory: read bandwidth of the shared memory each processor
/// reaches (GB/s) and its dense compute (TFLOP/s). A unit of work (a layer's attention and
/// dense parts, a layer's routed experts, the head) costs, per decoded token, the bytes it reads
/// over the bandwidth plus 2 FLOP per weight it reads over the compute; the processor with the
/// lower cost computes it. The defaults are a GB10-class board's published figures (LPDDR5X at
/// 273 GB/s) with assumed shares of it (GPU 230, CPU 120 GB/s) and assumed compute (GPU 50,
/// CPU 1 TFLOP/s): unmeasured on real hardware (docs/unified.md).
struct UnifiedRates {
  double gpu_gbps = 230, cpu_gbps = 120, gpu_tflops = 50, cpu_tflops = 1;
};

/// Placement flags as the CLI parses them.
struct Flags {
  int32_t n_gpu_layers = -1;  ///< -ngl; -1 = automatic; more than n_layer = all (e.g. 99)
  /// -ot rules (regex, device as typed: "CPU", "GPU", "CUDA0", any case), in order.
  std::vector<std::pair<std::string, std::string>> overrides;
  bool cpu_moe = false;                                ///< --cpu-moe
  int32_t n_cpu_moe = 0;                               ///< --n-cpu-moe (layers)
  std::optional<size_t> vram_budget;                   ///< --vram-budget, bytes
  ResidencyMode residency = ResidencyMode::automatic;  ///< --residency
  /// --ram-budget, bytes: host memory the plan may fill with CPU-held weights, their KV cache
  /// and the RAM cache of disk-held experts. nullopt: the default (place(): MemAvailable minus
  /// kRamMargin); kNoRamBudget ("--ram-budget none" or 0): no limit, no disk tier.
  std::optional<size_t> ram_budget;
  UnifiedMode unified = UnifiedMode::automatic;  ///< --unified
};

/// Flags::ram_budget's "no limit".
inline constexpr size_t kNoRamBudget = static_cast<size_t>(-1);
/// What the default --ram-budget leaves of MemAvailable, bytes (1 GiB): activations, executor
/// scratch, the process itself and whatever else runs on the machine.
inline constexpr size_t kRamMargin = size_t{1} << 30;

/// Everything make_plan needs; plan_request() (runtime/plan_request.h) fills it from a model.
struct Request {
  std::vector<TensorEntry> tensors;
  int32_t n_layer = 0;
  /// Device KV cache bytes of each layer (f16 K and V for the context size), n_layer entries.
  /// A layer on the CPU keeps f32 K and V: twice this.
  std::vector<size_t> kv_bytes;
  /// The recurrent state of each layer (Qwen3.5's Gated DeltaNet: conv rows and the delta-rule
  /// matrix, f32, all sequences), bytes; empty or 0: none. It lives with the layer's KV cache
  /// (kv_home: the ops that update it run there), f32 on either side.
  std::vector<size_t> state_bytes;
  /// Device bytes for activations and kernel workspaces at the chosen ubatch size.
  size_t scratch_bytes = 0;
  /// Kept free for the CUDA context, allocator slack and fragmentation.
  size_t margin_bytes = size_t{512} << 20;
  bool has_device = false;       ///< a GPU is present (or planned for with --vram-budget)
  std::string device_name;       ///< for messages, e.g. "CUDA0 (NVIDIA H200)"
  size_t device_free_bytes = 0;  ///< what the device reports free
  /// Host bytes the plan may fill (the resolved --ram-budget; kNoRamBudget: no limit). See
  /// make_plan for the disk tier it gives a model that does not fit.
  size_t ram_budget_bytes = kNoRamBudget;
  /// Unified memory (--unified, or a device that shares the host's memory): the device reads
  /// the weights it computes where they are, so every weight is held once, in one pool of
  /// pool_bytes that the weights (all of them, whoever computes them), both KV caches, the
  /// scratch, the margin and the disk tier's RAM slots draw on. --vram-budget caps what the
  /// device's side takes of it (its weights, KV cache, scratch and margin), --ram-budget the
  /// CPU's side. No expert slots (experts are never copied). The automatic plan picks who
  /// computes each unit by `rates` (UnifiedRates), not by where bytes live.
  bool unified = false;
  /// The pool: os_available_bytes minus pool_margin_bytes, at most the device's total memory,
  /// less activation_reserve_bytes: the part the runtime keeps for the activations where they
  /// did not fit beside a plan for the whole pool (messages name the whole pool).
  size_t pool_bytes = 0;
  /// The same reserve taken from shared_pool_bytes on a board planned with --unified off.
  size_t activation_reserve_bytes = 0;
  size_t os_available_bytes = 0;  ///< the OS's MemAvailable (for messages)
  size_t pool_margin_bytes = 0;   ///< what the pool leaves of it
  /// What the device itself reports free (cudaMemGetInfo; for messages: on a unified board it
  /// counts the page cache as used, so it is not the pool).
  size_t device_reported_free_bytes = 0;
  /// A board's memory (the device's total on a unified board, unified or --unified off; 0:
  /// unknown or not a board): what a remedy of freeing memory on the board is measured against.
  size_t board_bytes = 0;
  UnifiedRates rates;
  int32_t n_expert_used = 0;  ///< routed experts per token (the cost of a layer's experts)
  /// Unified mode on a device with memory of its own (--unified on on a discrete GPU): what it
  /// reports free, which the GPU's KV cache, scratch and margin take (its weights stay in host
  /// memory, in the pool); a plan whose device allocations exceed it is refused. 0: not that case.
  size_t discrete_free_bytes = 0;
  /// A board whose memory the device shares, planned without unified mode (--unified off): the
  /// device's side (copies of the weights it computes, its KV cache, scratch, margin) and the
  /// CPU's side draw on one pool of this many bytes (the OS's available memory minus
  /// pool_margin_bytes, at most the board's memory; os_available_bytes as for unified). The
  /// CPU's side gets at most what the device's side leaves; a plan beyond the pool is refused
  /// naming every term and the remedies that make it fit when tried, and one that fits says in a
  /// note that it holds the GPU's weights twice (the device copies beside the file's pages). The
  /// automatic plan gives the GPU a unit only where the CPU's side keeps room for its least
  /// beside it (as on unified memory), else everything runs on the CPU. With nothing on the GPU
  /// (-ngl 0 on such a board, has_device or not) the pool bounds the CPU's side strictly: what
  /// must stay in RAM and one disk-tier RAM slot per MoE layer must fit, or the plan is refused.
  /// Only with shared_pool (which is false for a discrete device, none, or unified mode).
  bool shared_pool = false;
  size_t shared_pool_bytes = 0;
  Flags flags;
};

struct Plan {
  std::vector<Home> home;     ///< per tensor (Request::tensors order)
  std::vector<Home> kv_home;  ///< per layer: where its attention runs and its KV cache lives
  size_t budget_bytes = 0;    ///< min(device free, --vram-budget); 0 without a device
  size_t gpu_weight_bytes = 0, cpu_weight_bytes = 0;
  /// KV caches, each with the recurrent state of its layers (Request::state_bytes).
  size_t gpu_kv_bytes = 0, cpu_kv_bytes = 0;
  size_t state_bytes = 0;      ///< the recurrent state of every layer, wherever it lives
  size_t cpu_state_bytes = 0;  ///< of cpu_kv_bytes (and state_bytes): the CPU-held state
  size_t scratch_bytes = 0, margin_bytes = 0;  ///< 0 when nothing is on the GPU
  std::string how;  ///< "automatic", "-ngl 12", "-ngl 99 --cpu-moe", ... (for the table)
  /// --residency as resolved: static or adaptive.
  ResidencyMode residency = ResidencyMode::fixed;
  /// Expert slots per MoE layer that has them (C; 0: none), per layer (n_layer entries): C for
  /// layers whose routed experts stay on the CPU without an -ot rule placing them, else 0.
  int32_t expert_slots = 0;
  std::vector<int32_t> layer_slots;
  /// Per layer (n_layer entries; empty when unknown): the experts its expert slots hold when the
  /// run starts, slot s the s-th, empty for a layer without slots. make_plan leaves it empty;
  /// runtime's place() fills it from the slot policy (residency/expert_slots.h, seed_slots: the
  /// code that loads the slots), with the policy's name and whether it moves them while running.
  std::vector<std::vector<int32_t>> slot_seed;
  std::string slot_policy;
  bool slots_move = true;
  /// Device bytes of the slots and their expert->slot tables (int32 per expert per layer).
  size_t slot_bytes = 0;
  /// The disk tier (only when the CPU-held weights and KV cache exceed Request::ram_budget_bytes):
  /// the routed-expert tensors (ffn_{gate,up,down}_exps) of the MoE layers with
  /// layer_ram_slots[l] > 0 stay in the file and are read on demand (O_DIRECT) into a RAM cache
  /// of that many expert slots per layer (residency/disk_tier.h); their home stays Home::cpu.
  /// At any time at least n_expert - layer_ram_slots[l] experts of such a layer are disk-held.
  size_t ram_budget_bytes = kNoRamBudget;  ///< as resolved (kNoRamBudget: none)
  int32_t ram_slots = 0;                   ///< slots per tiered layer (0: no disk tier)
  std::vector<int32_t> layer_ram_slots;    ///< per layer (n_layer entries)
  std::vector<int32_t> layer_n_expert;     ///< per layer: routed experts (0: not a MoE layer)
  size_t disk_weight_bytes = 0;  ///< bytes of the tiered tensors (not in cpu_weight_bytes)
  size_t ram_slot_bytes = 0;     ///< the RAM cache's slots (4 KiB-padded expert slices)
  /// Host bytes the plan holds: cpu weights + CPU KV cache + the RAM cache's slots.
  size_t ram_total() const { return cpu_weight_bytes + cpu_kv_bytes + ram_slot_bytes; }
  /// Unified memory (Request::unified): weights held once in a pool of pool_bytes; home says
  /// who computes a tensor, not where its bytes live.
  bool unified = false;
  size_t pool_bytes = 0;
  /// A board's one pool also holds the activations, set by runtime's place() (0: not counted):
  /// with nothing on the GPU the CPU's step arena at -ub; for a split plan
  /// (activations_host_buffers) the scheduler's host buffers for a decode step and a ubatch.
  /// whole_pool_bytes is the pool they share with the plan; pool_bytes is what the plan was made
  /// for: the pool less them where they did not fit beside a plan for the whole pool (the disk
  /// tier then takes more routed experts).
  size_t activation_bytes = 0;
  bool activations_host_buffers = false;
  size_t whole_pool_bytes = 0;
  /// Unified memory: everything the plan holds in the pool, each weight once.
  size_t pool_total() const {
    return gpu_weight_bytes + cpu_weight_bytes + gpu_kv_bytes + cpu_kv_bytes + scratch_bytes +
           margin_bytes + ram_slot_bytes;
  }
  /// Remarks shown with the plan (flags ignored for lack of a GPU, an automatic plan that fell
  /// back to the CPU); make_plan also logs them as warnings. Callers may append their own.
  std::vector<std::string> notes;
  /// True when a tensor or a layer's KV cache lives on (is computed by) the GPU.
  bool any_on_gpu() const {
    for (Home h : home)
      if (h == Home::gpu) return true;
    for (Home h : kv_home)
      if (h == Home::gpu) return true;
    return false;
  }
  /// Total device bytes the plan needs.
  size_t gpu_total() const {
    return gpu_weight_bytes + slot_bytes + gpu_kv_bytes + scratch_bytes + margin_bytes;
  }
};

/// Bytes for messages: MiB with one decimal; below 1 MiB in KiB or bytes, so a small budget never
/// reads "0.0 MiB".
std::string mib(size_t bytes);

/// Sizes such as 24G (core/strings.h).
using berth::parse_size;

/// Parses one -ot argument "REGEX=DEVICE[,REGEX=DEVICE...]" and appends to flags.overrides.
/// The list splits at commas outside (), [] and {} (so "blk\.[0-9]{1,2}=CPU" is one rule); each
/// rule splits at its last '='. Throws Error(invalid_argument) naming -ot and the rule for a
/// missing '=', an empty or invalid regex or an unknown device name (CPU, GPU, CUDA0 are known).
/// Nothing is appended when any rule is bad.
void add_override(Flags& flags, std::string_view arg);

/// The plan for `req` (see the file comment). Throws Error(invalid_argument) for inconsistent
/// flags or requests (-ngl < -1, --n-cpu-moe < 0, a bad -ot rule, kv_bytes not n_layer long, a
/// tensor's layer outside [-1, n_layer)); -ngl > 0 or -ot naming the GPU when there is none
/// (has_device false) is only a warning and everything goes to the CPU. Throws
/// Error(out_of_memory) when the GPU share does not fit the budget, with one message naming
/// every term: "plan needs 30512.0 MiB on CUDA0 (NVIDIA H200) but the budget is 24576.0 MiB:
/// weights 28000.0 MiB + KV cache 1536.0 MiB + scratch 464.0 MiB + margin 512.0 MiB (-ngl 99)".
/// Scratch and margin count only when something is on the GPU. Warnings (flags that change
/// nothing, no device) go to Plan::notes; the caller shows them (berth plan in its report, run
/// and bench as log warnings).
Plan make_plan(const Request& req);

/// Unified memory (Request::unified): home is who computes; with -ngl, --cpu-moe, --n-cpu-moe
/// and -ot as above, else (automatic) every unit goes to the processor whose modelled time per
/// token is lower (UnifiedRates), in order of time saved per byte while the device's side fits
/// budget_bytes = min(pool, --vram-budget). The device's side must fit budget_bytes, the CPU's
/// min(--ram-budget, pool - device's side) (routed experts beyond it go to the disk tier as
/// below), and everything pool_bytes: otherwise Error(out_of_memory) naming every term
/// (weights held once and who computes them, both KV caches, scratch, margin, RAM slots, the
/// OS's available memory, the pool's margin, the device's own report), before anything loads.
/// The automatic plan (no -ngl; --cpu-moe, --n-cpu-moe and -ot pins honoured) gives a unit to
/// the device only where the CPU's side keeps room beside it for its least (CpuSide in
/// placement/src/internal.h: what must stay in RAM plus one disk-tier RAM slot per MoE layer it
/// computes) within the pool and --ram-budget, counting the device's scratch and margin; where
/// no split fits, everything goes to the CPU (as --vram-budget 0) with a note, and the checks
/// accept or refuse that. A --vram-budget above the pool (discrete: above the device's free memory)
/// and an explicit --ram-budget above what the GPU's side leaves of the pool are capped with a note
/// naming the value and the cap.
///
/// Disk tier (Request::ram_budget_bytes): when cpu weights + CPU KV cache exceed the budget,
/// the CPU-held routed-expert tensors of every MoE layer whose three stacked expert tensors are
/// CPU-held (-ot CPU included) move to the disk tier with the same number C of RAM slots per
/// layer: the most that the budget's room (budget - other CPU weights - CPU KV cache) holds,
/// each slot one expert's three slices padded to 4 KiB, C < n_expert. Which experts the slots
/// hold is decided while running (the hottest: residency/disk_tier.h), so the coldest are the
/// disk-held ones. GPU expert slots (--residency adaptive) are then dropped with a note. Throws
/// Error(out_of_memory) naming the sizes when what must stay in RAM (weights other than those
/// routed experts, the KV cache) exceeds the budget, or the room holds not even one slot per
/// layer.
///
/// Expert ids as ascending runs: {0, 1, 2, 3, 7, 9} -> "0-3,7,9" (sorted and deduplicated
/// first; "" for none).
std::string expert_ranges(std::span<const int32_t> ids);

/// Human-readable table: the notes; per MoE layer how many of its experts are on the GPU (all:
/// its expert tensors are there; C of n: C expert slots, followed by the experts they start
/// with as expert_ranges when Plan::slot_seed says, the residency line saying whether they
/// move while running (and the policy); 0: none), runs of consecutive layers alike on one
/// line, and, with `tensors`, one line
/// per tensor (name, type, MiB, home); the KV cache as runs of consecutive layers with the same
/// home, then totals per device (weights, expert slots, KV cache, scratch, margin, total; the
/// GPU's against the budget).
std::string plan_table(const Request& req, const Plan& plan, bool tensors = false);
/// The same as JSON (sizes in bytes): {"how", "budget_bytes", "notes": [...],
/// "devices": {"GPU": {"name", "weights_bytes", "kv_bytes", "scratch_bytes", "margin_bytes",
/// "total_bytes", "budget_bytes"}, "CPU": {"weights_bytes", "kv_bytes", "total_bytes"}},
/// "tensors": [{"name", "role", "type", "bytes", "layer", "home"}...],
/// "kv": [{"layer", "bytes", "home"}...], "residency": "static"|"adaptive", "expert_slots" (C),
/// "slot_policy" (Plan::slot_policy; null when not set),
/// "moe_layers": [{"layer", "n_expert", "experts_on_gpu", "gpu_experts", "gpu_experts_move",
/// "slots", "home", "ram_slots", "experts_on_disk"}...] (home of its expert tensors;
/// experts_on_gpu = n_expert on the GPU, else its slots; gpu_experts: which experts are on the
/// GPU when the run starts, ascending: all for a layer whose expert tensors are there, the
/// slots' seed (Plan::slot_seed; null when the plan does not have it), [] for none;
/// gpu_experts_move: the slots' policy moves them while running; experts_on_disk = n_expert -
/// ram_slots for a tiered layer, else 0),
/// "tiers": {"vram_bytes", "gpu_computed_host_bytes" (unified memory: the weights the GPU
/// computes, held once in host memory; else 0), "ram_bytes", "disk_bytes", "ram_budget_bytes"
/// (null: none), "ram_slots"}, "unified": null or {"pool_bytes" (the whole pool),
/// "planned_pool_bytes" (Plan::pool_bytes), "activation_bytes" (Plan::activation_bytes),
/// "activations" ("cpu": the CPU's step arena; "host_buffers": a split step's host buffers),
/// "os_available_bytes", "pool_margin_bytes", "device_reported_free_bytes", "total_bytes"
/// (Plan::pool_total plus the activations),
/// "weights_bytes" (held once: in the pool, or on the disk tier), "gpu_computes_bytes",
/// "cpu_computes_bytes" (the disk tier's experts included)}}; "GPU" (with
/// "slot_bytes") is absent when the request has no device. On unified memory "vram_bytes" is 0 (no
/// weight is copied).
std::string plan_json(const Request& req, const Plan& plan);

}  // namespace berth::placement
