// The disk tier of a plan (plan.h, make_plan's comment on it): which CPU-held routed experts
// can go to it, the least the CPU's side of a plan can hold, and the tier itself.
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <limits>

#include "berth/core/error.h"
#include "internal.h"

namespace berth::placement {

std::string mib(size_t bytes) {
  if (bytes < 1024) return fmt::format("{} B", bytes);
  if (bytes < (size_t{1} << 20))
    return fmt::format("{:.1f} KiB", static_cast<double>(bytes) / 1024);
  return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
}

namespace {

// One expert's slice of a stacked tensor of `bytes` over `n_expert`, as the RAM cache stores it:
// at most 4 KiB of padding in front (direct_layout's pad) and rounded up to 4 KiB.
size_t padded_slice(size_t bytes, int32_t n_expert) {
  const size_t slice = bytes / static_cast<size_t>(n_expert);
  return (slice + 4095) / 4096 * 4096 + 4096;
}

}  // namespace

TierShape tier_shape(const Request& req, const std::vector<Home>& home) {
  const auto n_layer = static_cast<size_t>(std::max(req.n_layer, 0));
  TierShape s;
  s.layer_n_expert.assign(n_layer, 0);
  s.cand.assign(n_layer, false);
  std::vector<int32_t> n_exps(n_layer, 0);  // CPU-held stacked expert tensors per layer
  std::vector<bool> no(n_layer, false);
  for (size_t i = 0; i < req.tensors.size(); ++i) {
    const TensorEntry& t = req.tensors[i];
    if (!t.routed_expert() || t.layer < 0) continue;
    const auto l = static_cast<size_t>(t.layer);
    s.layer_n_expert[l] = std::max(s.layer_n_expert[l], t.n_expert);
    if (home[i] != Home::cpu || t.n_expert < 2 ||
        (n_exps[l] > 0 && s.layer_n_expert[l] != t.n_expert))
      no[l] = true;
    else
      ++n_exps[l];
  }
  // Candidates: layers with exactly gate, up and down stacked and CPU-held.
  for (size_t l = 0; l < n_layer; ++l) s.cand[l] = !no[l] && n_exps[l] == 3;
  for (size_t i = 0; i < req.tensors.size(); ++i) {
    const TensorEntry& t = req.tensors[i];
    if (!t.routed_expert() || t.layer < 0 || !s.cand[static_cast<size_t>(t.layer)]) continue;
    s.tier_bytes += t.bytes;
    s.per_slot += padded_slice(t.bytes, t.n_expert);
    s.max_c = std::min(s.max_c, t.n_expert - 1);
  }
  return s;
}

CpuSide cpu_side(const Request& req, const std::vector<Home>& home,
                 const std::vector<Home>& kv_home) {
  CpuSide c;
  for (size_t i = 0; i < req.tensors.size(); ++i)
    if (home[i] == Home::cpu) c.all += req.tensors[i].bytes;
  for (size_t l = 0; l < kv_home.size() && l < req.kv_bytes.size(); ++l)
    if (kv_home[l] == Home::cpu) c.all += layer_cache_cpu(req, l);  // the host cache keeps f32
  c.least = c.all;
  const TierShape s = tier_shape(req, home);
  if (s.tier_bytes > 0 && s.max_c >= 1)
    c.least = std::min(c.all, c.all - s.tier_bytes + s.per_slot);
  return c;
}

void add_disk_tier(const Request& req, Plan& plan, bool pool_share,
                   const std::function<std::string()>& hint) {
  const auto n_layer = static_cast<size_t>(req.n_layer);
  plan.ram_budget_bytes = req.ram_budget_bytes;
  plan.layer_ram_slots.assign(n_layer, 0);
  const TierShape shape = tier_shape(req, plan.home);
  plan.layer_n_expert = shape.layer_n_expert;
  if (req.ram_budget_bytes == kNoRamBudget ||
      plan.cpu_weight_bytes + plan.cpu_kv_bytes <= req.ram_budget_bytes)
    return;
  const std::vector<bool>& cand = shape.cand;
  const size_t tier_bytes = shape.tier_bytes, per_slot = shape.per_slot;
  const int32_t max_c = shape.max_c;
  const size_t fixed = plan.cpu_weight_bytes - tier_bytes + plan.cpu_kv_bytes;
  const std::string budget =
      fmt::format("{} {}", pool_share ? "CPU's share of the unified pool," : "--ram-budget",
                  mib(req.ram_budget_bytes));
  // What can help, when the caller does not say (`hint`): on a pool, a smaller context only where
  // the plan fits without its KV cache (the recurrent state stays).
  const size_t kv_only = plan.cpu_kv_bytes - std::min(plan.cpu_kv_bytes, plan.cpu_state_bytes);
  const bool lower_c =
      kv_only > 0 && fixed - kv_only + (tier_bytes > 0 ? per_slot : 0) <= req.ram_budget_bytes;
  const auto more = [&]() -> std::string {
    if (hint) return hint();
    if (!pool_share) return "raise --ram-budget or put more on the GPU";
    return lower_c ? "lower -c, use a smaller quantization or a larger board"
                   : "use a smaller quantization or a larger board";
  };
  const size_t c_fit =
      fixed > req.ram_budget_bytes || per_slot == 0
          ? 0
          : std::min<size_t>((req.ram_budget_bytes - fixed) / per_slot, static_cast<size_t>(max_c));
  if (!req.flags.ram_budget && !(pool_share && tier_bytes > 0) && c_fit < 1) {
    // The default budget (MemAvailable minus the margin) is a guess, not a demand: a model it
    // cannot tier runs from the mapping as before, with a note.
    // Why: what must stay in RAM exceeds the budget, or (it fits) the room it leaves holds not
    // one RAM slot per MoE layer.
    const std::string why =
        fixed > req.ram_budget_bytes || per_slot == 0
            ? fmt::format("what must stay in RAM ({}) exceeds it", mib(fixed))
            : fmt::format(
                  "the {} it leaves beside what must stay in RAM ({}) holds not one RAM slot per "
                  "MoE layer ({})",
                  mib(req.ram_budget_bytes - fixed), mib(fixed), mib(per_slot));
    plan.notes.push_back(fmt::format(
        "the CPU-held weights ({}) and KV cache ({}) exceed the default RAM budget of {} "
        "(MemAvailable minus 1 GiB) and the disk tier cannot make up the difference: {}; the "
        "file is mapped and pages in and out; --ram-budget SIZE asks for the tier",
        mib(plan.cpu_weight_bytes), mib(plan.cpu_kv_bytes), mib(req.ram_budget_bytes), why));
    return;
  }
  if (fixed > req.ram_budget_bytes)
    throw Error(ErrorCategory::out_of_memory,
                fmt::format("what must stay in RAM does not fit the {}: CPU-held weights other "
                            "than routed experts {} + KV cache {} = {} (routed experts that can "
                            "go to the disk tier: {}); {}",
                            budget, mib(plan.cpu_weight_bytes - tier_bytes), mib(plan.cpu_kv_bytes),
                            mib(fixed), mib(tier_bytes), more()));
  const size_t room = req.ram_budget_bytes - fixed;
  const size_t c = c_fit;
  if (c < 1)
    throw Error(ErrorCategory::out_of_memory,
                fmt::format("the {} leaves {} for routed experts after the CPU-held weights "
                            "other than routed experts ({}) and the KV cache ({}): not enough "
                            "for one RAM slot per MoE layer ({}); {}",
                            budget, mib(room), mib(plan.cpu_weight_bytes - tier_bytes),
                            mib(plan.cpu_kv_bytes), mib(per_slot), more()));
  if (plan.expert_slots > 0) {
    plan.notes.push_back(fmt::format(
        "the disk tier turns the {} GPU expert slots per layer off (they need the experts "
        "pinned in RAM)",
        plan.expert_slots));
    plan.expert_slots = 0;
    plan.slot_bytes = 0;
    plan.layer_slots.assign(n_layer, 0);
  }
  plan.ram_slots = static_cast<int32_t>(c);
  for (size_t l = 0; l < n_layer; ++l)
    if (cand[l]) plan.layer_ram_slots[l] = plan.ram_slots;
  plan.disk_weight_bytes = tier_bytes;
  plan.cpu_weight_bytes -= tier_bytes;
  plan.ram_slot_bytes = per_slot * c;
  plan.how += fmt::format("; disk tier: {} RAM expert slot{} per MoE layer", c, c == 1 ? "" : "s");
}

}  // namespace berth::placement
