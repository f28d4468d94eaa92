// From placement flags to a session that follows them: picks the device, plans, fills
// SessionParams. Shared by `berth run`, `berth bench model` and `berth plan`.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "berth/backends/device.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/placement/plan.h"
#include "berth/runtime/session.h"
#include "berth/scheduler/schedule.h"

namespace berth {

/// params.hybrid.stream_experts_min_tokens value for `--stream-experts auto` (the CLI default):
/// place() turns it into kStreamExpertsAutoTokens when a device holds part of the model, some
/// stacked expert tensors stay on the CPU and host memory holds their pinned copy, else 0.
constexpr int32_t kStreamExpertsAuto = -1;
/// The ubatch size from which streaming CPU-held experts to the device pays (the crossover
/// measured on the H200: docs/performance.md, "--stream-experts").
constexpr int32_t kStreamExpertsAutoTokens = 64;

struct PlacementSetup {
  std::unique_ptr<Device> device;  ///< null: CPU only
  placement::Request request;
  placement::Plan plan;
  /// One line for stderr, e.g. "placement (automatic): 17.2 GiB of weights + 0.4 GiB KV on
  /// CUDA0 (NVIDIA H200), 0.0 GiB on the CPU".
  std::string summary() const;
};

/// The device to plan for: the first CUDA device when this build and machine have one; else, when
/// the environment variable BERTH_SIM_DEVICE=SIZE is set (e.g. "1G"), a simulated device of that
/// size (runs the hybrid executor on the CPU: for tests of the placement paths without a GPU), or
/// with BERTH_SIM_DEVICE=unified:SIZE[,KEY=VALUE...] (the prefix in any case) a simulated
/// unified-memory board
/// (parse_unified_sim in backends/device.h: e.g. "unified:128G" for a GB10,
/// "unified:8G,available=6G" for an Orin 8 GB); else none. Throws Error(usage) for a
/// bad BERTH_SIM_DEVICE.
std::unique_ptr<Device> default_device();

/// Plans `model` with `flags` for default_device() (or none when flags.n_gpu_layers == 0 and no
/// -ot names the GPU, so a CPU-only run touches no device), using params.n_ctx (0: the
/// default), params.n_ubatch and params.hybrid's stream_experts_min_tokens and
/// host_expert_share (their device buffers count as scratch; kStreamExpertsAuto is resolved
/// here, see there), and sets params.device,
/// weight_home and kv_home (device null
/// when nothing is on it). Uploads happen when the Session is built; `progress_to_stderr` sets
/// params.hybrid.progress to a progress bar on stderr (a bar on a terminal, one summary line
/// otherwise); on unified memory, where nothing is loaded to the device, it prints the
/// "note: unified memory ..." line `berth plan` shows instead. Unified mode is decided here for
/// plan, run and serve alike: never when nothing would be computed on the GPU (-ngl 0 and no -ot
/// naming it); on a unified board (its device, or when none is opened the simulated one
/// BERTH_SIM_DEVICE names, or on an Arm host a CUDA device 0 that reports itself integrated,
/// asked once) the pool then still bounds the CPU's side (Request::shared_pool). Throws what
/// placement::make_plan throws (Error(out_of_memory) naming every term when the plan cannot fit).
///
/// `plan_only` (`berth plan`): the device is opened whatever the flags (the plan shows it); with
/// none found and --vram-budget SIZE, the plan is made for a GPU of that size ("GPU (none
/// found)"); notes are not logged but left in plan.notes (with a note saying which device was
/// planned for, and why --stream-experts auto is off), params.device stays null and no progress
/// bar is set.
PlacementSetup place(const Model& model, const placement::Flags& flags, SessionParams& params,
                     bool progress_to_stderr, bool plan_only = false);
/// place() for `device`, opened by the caller (placement_device(), or default_device() for
/// plan_only) so that it can size things by the same device before planning.
PlacementSetup place(const Model& model, const placement::Flags& flags, SessionParams& params,
                     bool progress_to_stderr, bool plan_only, std::unique_ptr<Device> device);

/// The device place() plans for when not plan_only: default_device() when `flags` give the GPU
/// something to compute (-ngl other than 0, or an -ot rule naming it), else none.
std::unique_ptr<Device> placement_device(const placement::Flags& flags);

/// `berth serve`'s context when -c is not given, from the plan serve then makes (place() with
/// `flags`, `params` as serve passes them, n_ctx set, and `device`: placement_device(), handed
/// back after each trial): the model's context_length (4096 when it has none) when the plan
/// accepts it with its KV cache taking at most half of the memory the plan draws on left beside
/// the weights other than routed experts and the recurrent state: on a board's pool (unified, or
/// --unified off with the GPU computing) the KV cache counted at f32 whoever holds it, and the
/// GPU's scratch and margin left to the plan's own check (a criterion independent of the plan's
/// shape: the context never shrinks on a larger board); else the KV cache as the plan holds it
/// (f16 on the GPU, f32 on the CPU), the memory the GPU's budget plus the RAM budget (or this
/// machine's memory with --ram-budget none) less the GPU's scratch and margin. Else the largest
/// multiple of 256 below both bounds that the plan accepts (by bisection). Sets `note` (when not
/// null) to a line naming the terms when it lowers, else leaves it. Throws Error(out_of_memory)
/// naming the terms (or the plan's refusal) when that leaves fewer than 256 tokens (or 2 per
/// sequence); what place() throws otherwise.
int64_t default_serve_context(const Model& model, const placement::Flags& flags,
                              const SessionParams& params, std::unique_ptr<Device>& device,
                              std::string* note);

/// The default --ram-budget: MemAvailable of /proc/meminfo minus placement::kRamMargin (0 when
/// less is available), bytes.
size_t default_ram_budget();

/// Fills params.disk (the disk tier) from `plan`'s tiered layers (Plan::layer_ram_slots): each
/// layer's ffn_{gate,up,down}_exps with its file offset in `file` (the file `model` was loaded
/// from), its router for read-ahead, `reader` as the reader's options; read-ahead is off when
/// the environment has BERTH_DISK_READ_AHEAD=0 (for measuring it). Clears params.disk when the
/// plan has no disk tier. Throws Error(internal) when a tiered layer lacks its tensors.
void use_disk_tier(const gguf::File& file, const Model& model, const placement::Plan& plan,
                   SessionParams& params, const io::DiskReaderOptions& reader = {});

/// The schedules the Scheduler would run under `setup` and `params` (as place() left them): of a
/// decode step (1 token) and of a full prefill ubatch (params.n_ubatch tokens, capped at the
/// context), each with its title. Without a device holding part of the model, the CPU-only
/// schedules. The CPU-held experts count as pinned when streaming or the decode share is on, as
/// Residency pins them.
std::vector<std::pair<std::string, Schedule>> step_schedules(const Model& model,
                                                             const PlacementSetup& setup,
                                                             const SessionParams& params);

/// Why `--stream-experts auto` stays off for `plan`: "-" when no stacked expert tensor stays
/// on the CPU (nothing to stream, nothing to say), a sentence when the CPU-held weights with
/// 2 GiB to spare, plus their experts' pinned copy when `extra_copy` (a copy is made and the CPU
/// does not read it: see copy_read_by_cpu), exceed `host_available` bytes; empty when it
/// streams.
std::string auto_stream_off(const Model& model, const placement::Plan& plan, size_t host_available,
                            bool extra_copy);

/// Warnings (one line each) for params.hybrid options that cannot act: ones that need a device
/// when params.device is null, e.g. "--host-expert-share 0.25 has no effect: no GPU holds any
/// weight or KV cache", and the expert options (--stream-experts, --host-expert-share,
/// --stream-split) when no stacked expert tensor of `model` has its home on the CPU;
/// --stream-split also when nothing streams or the session has several sequences. `handoff_set`,
/// `warm_set`: the hand-off or --warm-workers was given by the user.
std::vector<std::string> device_option_notes(const Model& model, const SessionParams& params,
                                             bool handoff_set, bool warm_set = false);

}  // namespace berth
