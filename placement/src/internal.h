// Placement's own helpers shared by its sources (not part of the library's interface).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "berth/placement/plan.h"

namespace berth::placement {

/// Bytes of layer l's recurrent state (Request::state_bytes; 0 without one).
inline size_t layer_state(const Request& req, size_t l) {
  return l < req.state_bytes.size() ? req.state_bytes[l] : 0;
}
/// Bytes of what layer l keeps between steps where kv_home puts it: on the GPU its f16 KV cache
/// and its recurrent state; on the CPU its f32 KV cache (twice kv_bytes) and its state.
inline size_t layer_cache_gpu(const Request& req, size_t l) {
  return req.kv_bytes[l] + layer_state(req, l);
}
inline size_t layer_cache_cpu(const Request& req, size_t l) {
  return 2 * req.kv_bytes[l] + layer_state(req, l);
}

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
/// `hint`: what can help, for the refusal (else one from the sizes: on a pool, lower -c only where
/// the plan fits without its KV cache).
void add_disk_tier(const Request& req, Plan& plan, bool pool_share = false,
                   const std::function<std::string()>& hint = {});

/// Request::shared_pool_bytes (a board whose memory the device shares, --unified off): gives the
/// CPU's side (with its disk tier) at most what the GPU's side leaves of the pool, then refuses
/// (Error(out_of_memory) naming every term, `flags` (the plan's flags described) and `fix()`,
/// the remedies that work) a plan whose two sides exceed it, or notes that it holds the GPU's
/// weights twice. With nothing on the GPU (-ngl 0, or an automatic plan that found no split) the
/// CPU's side is bounded by the whole pool, strictly (add_disk_tier's pool_share).
void finish_shared_pool(const Request& req, Plan& plan, const std::string& flags,
                        const std::function<std::string()>& fix);

/// The flags as a plan's `how` and its messages name them: "automatic" or "-ngl N", then
/// --cpu-moe, --n-cpu-moe N and each -ot rule.
std::string describe_flags(const Flags& f);

/// make_plan_once's last step (plan_accounting.cpp), once every tensor's and KV cache's home is
/// decided: counts the plan's bytes, gives adaptive residency (`adaptive`) its expert slots
/// (`ot_pinned`: the tensors an -ot rule placed, which get none), checks the GPU's side against
/// its budget, and gives the CPU's side its disk tier within --ram-budget, the board's pool
/// (finish_shared_pool) or, on unified memory, what the GPU's side leaves of the pool. Throws
/// Error(out_of_memory) naming every term, with hints unless `probing`. `has_exps`: the model
/// has routed experts. `slots_at`: where in plan.how the automatic plan, which left the room
/// beside its units to expert slots, says what became of it (npos: nowhere): ", the rest as
/// expert slots" where slots are kept, else that none fits or that the disk tier turned them off.
void account_plan(const Request& req, Plan& plan, const std::vector<bool>& ot_pinned, bool adaptive,
                  size_t slots_at, bool has_exps, bool probing);

/// make_plan without its refusal's wrapping (plan.cpp); `probing`: a try made while writing a
/// refusal's hint (remedies), which computes no hints of its own.
/// `fallback`, when given, says what a unified automatic plan did where no split fitted (also
/// when it then throws): 1, put everything on the CPU; 2, kept the split, as everything on the
/// CPU missed the CPU's limit by more; left as it was where no split missed.
Plan make_plan_once(const Request& req, bool probing, int* fallback = nullptr);

/// True when `req` plans without an error (make_plan_once, probing).
bool plan_fits(const Request& req);

/// "a", "a, or b", "a, b, or c".
std::string or_list(const std::vector<std::string>& parts);

/// The remedies that make `req` (refused) fit when tried, as a list for a message: lower -ngl
/// (-ngl 0 fits), --cpu-moe, the automatic plan, and on a board planned with copies (--unified
/// off) --unified auto; when none does, lower -c (if the plan fits without any KV cache), a
/// smaller quantization, more memory. `has_exps`: the model has routed experts. `probing`:
/// inside such a try, nothing is tried (the last three are named).
std::string remedies(const Request& req, bool has_exps, bool probing);

/// What a user can do about a plan whose GPU side exceeds its budget: a budget that does not hold
/// scratch and margin says so; an automatic plan's -ot rules; else remedies().
std::string refusal_hint(const Request& req, const Plan& plan, bool has_exps, bool probing);

}  // namespace berth::placement
