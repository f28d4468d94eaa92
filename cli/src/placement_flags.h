// The placement flags shared by the commands that put weights on a GPU (plan; run and bench to
// follow), with llama.cpp's names and meanings (see placement/plan.h).
#pragma once

#include <CLI/CLI.hpp>

#include "berth/placement/plan.h"
#include "berth/scheduler/schedule.h"

namespace berth::cli {

/// Default -ub of `run` and `plan`: tokens per prefill step. Measured on an H200 (synthetic
/// qwen3-30b-a3b, all on the GPU; docs/performance.md, "Prefill against ik_llama.cpp, one
/// lease", its ubatch table): pp4096 9311 / 13616 / 14423 tok/s at -ub 512 / 2048 / 4096,
/// pp32768 6409 / 8232 / 8533; 2048 takes most of the gain with half of 4096's activations. `bench
/// model` keeps llama-bench's 512 and `serve` llama-server's 512 (a step's prompt chunk delays the
/// other slots' next token).
inline constexpr int32_t kRunUbatch = 2048;

/// Registers on `cmd`, writing into `f` (which must outlive the parse):
/// `--n-gpu-layers,--gpu-layers N` (-ngl; -1 = automatic), `--override-tensor REGEX=DEVICE`
/// (-ot; repeatable, comma-separated lists), `--cpu-moe` (-cmoe), `--n-cpu-moe N` (-ncmoe) and
/// `--vram-budget SIZE` (e.g. 24G, 1.5GiB, 512M). CLI11 cannot declare multi-letter short flags,
/// so main.cpp maps -ngl, -ot, -cmoe and -ncmoe to the long names. A bad -ot rule or size is a
/// usage error (exit code 2) whose message names the flag and the value.
void add_placement_flags(CLI::App& cmd, placement::Flags& f);

/// Checks a fraction in [0, 1]; unlike CLI::Range it refuses NaN ("nan" parses as a double and
/// compares false both ways). A usage error names the value.
CLI::Validator unit_fraction();

/// Registers `--host-expert-share F` (run and bench model; HybridOptions::host_expert_share):
/// at decode the GPU computes the fraction F of each token's routed experts in every CPU-held
/// MoE layer, copying their weights from pinned host memory, while the CPU computes the rest.
void add_host_expert_share(CLI::App& cmd, double& share);

/// Registers `--warm-workers US` (run and bench model; HybridOptions::warm_workers_us): with
/// the flag hand-off the CPU workers spin for up to US microseconds while waiting for the GPU;
/// 0: off; not given, `us` keeps kAutoWarmWorkersUs (the executor's default).
void add_warm_workers(CLI::App& cmd, int64_t& us);
/// --residency-swaps N: ExpertSlotsOptions::max_swaps_per_step (1..65536).
void add_residency_swaps(CLI::App& cmd, int32_t& swaps);
/// --residency-policy NAME: the expert slots' policy, as make_slot_policy (residency/
/// expert_slots.h) takes it: lfu-decay[:H], lru, frequency:TRACE. Empty: the default.
void add_residency_policy(CLI::App& cmd, std::string& policy);

/// Registers `--stream-experts N|auto` (run and bench model): prefill ubatches of at least N
/// tokens compute CPU-held experts on the GPU, streaming their weights; 0: off; auto (stored as
/// kStreamExpertsAuto, the default): from kStreamExpertsAutoTokens when host memory has room
/// to lock them (runtime/placed.h). Anything else is a usage error naming the value.
void add_stream_experts(CLI::App& cmd, int32_t& min_tokens);
/// --stream-split SPEC (parse_stream_split's forms; checked when parsed).
void add_stream_split(CLI::App& cmd, std::string& spec);

/// Registers `--handoff auto|flags|callback` (bench model and plan): how CPU segments hand over
/// with the device (HybridOptions::handoff).
void add_handoff(CLI::App& cmd, std::string& handoff);
/// The Handoff of a --handoff value (auto, flags or callback; anything else: Error
/// invalid_argument naming it).
Handoff parse_handoff(const std::string& s);

}  // namespace berth::cli
