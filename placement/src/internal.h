// Placement's own helpers shared by its sources (not part of the library's interface).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "berth/placement/plan.h"

namespace berth::placement {

/// MiB with one decimal; below 1 MiB in KiB or bytes, so a small budget never reads "0.0 MiB".
std::string mib(size_t bytes);

/// What the disk tier could take under `home` (per tensor, Request::tensors order): per layer
/// whether it is a candidate (its gate, up and down tensors stacked, n_expert >= 2 of one count,
/// all CPU-held), the candidates' bytes, one RAM slot of every candidate layer (one expert's three
/// slices, each padded to 4 KiB as the RAM cache stores it), the most slots a layer may have
/// (n_expert - 1) and each layer's expert count (0: not a MoE layer).
struct TierShape {
  std::vector<bool> cand;
  size_t tier_bytes = 0, per_slot = 0;
  int32_t max_c = std::numeric_limits<int32_t>::max();
  std::vector<int32_t> layer_n_expert;
};
TierShape tier_shape(const Request& req, const std::vector<Home>& home);

/// The CPU's side of a plan with these homes, bytes: `all` it would hold without a disk tier
/// (CPU-held weights, f32 KV cache of CPU-held layers, the recurrent state), `least` with the
/// disk tier at its minimum (what must stay in RAM plus one RAM slot per candidate layer; `all`
/// when nothing can be tiered).
struct CpuSide {
  size_t all = 0, least = 0;
};
CpuSide cpu_side(const Request& req, const std::vector<Home>& home,
                 const std::vector<Home>& kv_home);

/// Gives `plan` (cpu_weight_bytes and cpu_kv_bytes counted) the disk tier when they exceed
/// req.ram_budget_bytes (plan.h). `pool_share`: req.ram_budget_bytes is the CPU's share of a
/// board's one pool, a limit rather than the default budget's guess: where routed experts could
/// go to the disk tier but no RAM slot fits, that is refused, naming the share (a pool has no
/// room for the file to page in and out). Throws Error(out_of_memory) naming the sizes.
void add_disk_tier(const Request& req, Plan& plan, bool pool_share = false);

/// Request::shared_pool_bytes (a board whose memory the device shares, --unified off): gives the
/// CPU's side (with its disk tier) at most what the GPU's side leaves of the pool, then refuses
/// (Error(out_of_memory) naming every term and `flags`, the plan's flags described) a plan whose
/// two sides exceed it, or notes that it holds the GPU's weights twice.
void finish_shared_pool(const Request& req, Plan& plan, const std::string& flags);

}  // namespace berth::placement
