// Placement's last step (make_plan_once, plan.cpp): with every home decided, the plan's bytes
// counted, adaptive residency's expert slots, the GPU's budget checked, and the CPU's side given
// its disk tier and checked against its budget or its board's pool.
#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "berth/core/error.h"
#include "internal.h"

namespace berth::placement {

namespace {

// The board's whole pool (Request::pool_bytes is what the plan may fill).
size_t whole_pool(const Request& req) {
  return (req.shared_pool ? req.shared_pool_bytes : req.pool_bytes) + req.activation_reserve_bytes;
}

std::string unified_terms(const Request& req, const Plan& plan) {
  return fmt::format(
      "weights {} held once ({} computed by the GPU, {} by the CPU) + GPU KV cache {} + CPU KV "
      "cache {} + scratch {} + margin {} + RAM expert slots {}; the pool is the {} the OS "
      "reports available minus a margin of {}, at most the board's memory (the device reports "
      "{} free, which on unified memory counts the page cache as used: not used)",
      mib(plan.gpu_weight_bytes + plan.cpu_weight_bytes), mib(plan.gpu_weight_bytes),
      mib(plan.cpu_weight_bytes), mib(plan.gpu_kv_bytes), mib(plan.cpu_kv_bytes),
      mib(plan.scratch_bytes), mib(plan.margin_bytes), mib(plan.ram_slot_bytes),
      mib(req.os_available_bytes), mib(req.pool_margin_bytes), mib(req.device_reported_free_bytes));
}

// Per layer: bytes of one expert's routed-expert slices (gate + up + down), 0 for a layer that
// cannot have slots (no routed experts on the CPU, experts placed by -ot, or of unknown count);
// and the layer's expert count.
struct SlotCandidates {
  std::vector<size_t> expert_bytes;
  std::vector<int32_t> n_expert;
};

SlotCandidates slot_candidates(const Request& req, const Plan& plan,
                               const std::vector<bool>& ot_pinned) {
  SlotCandidates c;
  c.expert_bytes.assign(static_cast<size_t>(req.n_layer), 0);
  c.n_expert.assign(static_cast<size_t>(req.n_layer), 0);
  std::vector<bool> no(static_cast<size_t>(req.n_layer), false);
  for (size_t i = 0; i < req.tensors.size(); ++i) {
    const TensorEntry& t = req.tensors[i];
    if (!t.routed_expert() || t.layer < 0) continue;
    const auto l = static_cast<size_t>(t.layer);
    if (plan.home[i] != Home::cpu || ot_pinned[i] || t.n_expert < 2 ||
        (c.n_expert[l] != 0 && c.n_expert[l] != t.n_expert)) {
      no[l] = true;
      continue;
    }
    c.n_expert[l] = t.n_expert;
    c.expert_bytes[l] += t.bytes / static_cast<size_t>(t.n_expert);
  }
  for (size_t l = 0; l < no.size(); ++l)
    if (no[l]) c.expert_bytes[l] = 0, c.n_expert[l] = 0;
  return c;
}

// Gives `plan` the most expert slots per candidate layer that `room` bytes hold (C < n_expert).
void add_expert_slots(const Request& req, Plan& plan, const std::vector<bool>& ot_pinned,
                      size_t room) {
  const SlotCandidates c = slot_candidates(req, plan, ot_pinned);
  size_t per_slot = 0, tables = 0;
  int32_t max_c = std::numeric_limits<int32_t>::max();
  for (size_t l = 0; l < c.expert_bytes.size(); ++l)
    if (c.expert_bytes[l] > 0) {
      per_slot += c.expert_bytes[l];
      tables += static_cast<size_t>(c.n_expert[l]) * 4;
      max_c = std::min(max_c, c.n_expert[l] - 1);
    }
  plan.layer_slots.assign(static_cast<size_t>(req.n_layer), 0);
  if (per_slot == 0 || room <= tables) return;
  const auto n = static_cast<int32_t>(
      std::min<size_t>((room - tables) / per_slot, static_cast<size_t>(max_c)));
  if (n < 1) return;
  plan.expert_slots = n;
  plan.slot_bytes = per_slot * static_cast<size_t>(n) + tables;
  for (size_t l = 0; l < c.expert_bytes.size(); ++l)
    if (c.expert_bytes[l] > 0) plan.layer_slots[l] = n;
}

}  // namespace

void account_plan(const Request& req, Plan& plan, const std::vector<bool>& ot_pinned, bool adaptive,
                  size_t slots_at, bool has_exps, bool probing) {
  const Flags& f = req.flags;
  const int32_t n_layer = req.n_layer;
  const size_t n = req.tensors.size();
  const bool unified = req.unified && req.has_device;
  const auto note = [&](std::string s) { plan.notes.push_back(std::move(s)); };
  // Accounting and the budget check.
  bool any_gpu = false;
  for (size_t i = 0; i < n; ++i) {
    const size_t b = req.tensors[i].bytes;
    if (plan.home[i] == Home::gpu) {
      plan.gpu_weight_bytes += b;
      any_gpu = true;
    } else {
      plan.cpu_weight_bytes += b;
    }
  }
  for (size_t l = 0; l < plan.kv_home.size(); ++l) {
    plan.state_bytes += layer_state(req, l);
    if (plan.kv_home[l] == Home::gpu) {
      plan.gpu_kv_bytes += layer_cache_gpu(req, l);
      any_gpu = true;
    } else {
      plan.cpu_kv_bytes += layer_cache_cpu(req, l);  // the host cache keeps f32
      plan.cpu_state_bytes += layer_state(req, l);
    }
  }
  if (req.has_device) {
    plan.budget_bytes =
        std::min(req.device_free_bytes, f.vram_budget.value_or(std::numeric_limits<size_t>::max()));
    // A budget above what there is is capped, not silently: on unified memory the pool (which
    // place() passes as the device's free memory), else the device's free memory.
    if (f.vram_budget && *f.vram_budget > req.device_free_bytes)
      note(req.shared_pool
               ? fmt::format(
                     "--vram-budget {} is more than {} (--unified off): the GPU's side "
                     "is capped at it",
                     mib(*f.vram_budget),
                     req.activation_reserve_bytes > 0
                         ? fmt::format("the {} the activations ({}) leave of the "
                                       "board's pool of {}",
                                       mib(req.device_free_bytes),
                                       mib(req.activation_reserve_bytes), mib(whole_pool(req)))
                         : fmt::format("the board's pool of {}", mib(whole_pool(req))))
           : unified ? fmt::format("--vram-budget {} is more than the unified pool of {} (the {} "
                                   "the OS reports available minus a margin of {}): the GPU's "
                                   "side is capped at {}",
                                   mib(*f.vram_budget), mib(whole_pool(req)),
                                   mib(req.os_available_bytes), mib(req.pool_margin_bytes),
                                   req.activation_reserve_bytes > 0
                                       ? fmt::format("the {} it leaves beside the activations",
                                                     mib(req.device_free_bytes))
                                       : std::string("the pool"))
                     : fmt::format("--vram-budget {} is more than the {} free on {}: the budget "
                                   "is capped at {}",
                                   mib(*f.vram_budget), mib(req.device_free_bytes), req.device_name,
                                   mib(req.device_free_bytes)));
  }
  if (any_gpu) {
    plan.scratch_bytes = req.scratch_bytes;
    plan.margin_bytes = req.margin_bytes;
  }
  plan.layer_slots.assign(static_cast<size_t>(n_layer), 0);
  if (adaptive && any_gpu && plan.gpu_total() < plan.budget_bytes) {
    size_t room = plan.budget_bytes - plan.gpu_total();
    // A board's one pool (--unified off): the slots take only what the CPU's side, with every
    // expert it computes in RAM, leaves (with less, the disk tier would turn them off).
    if (req.shared_pool) {
      const size_t cpu_all = cpu_side(req, plan.home, plan.kv_home).all;
      const size_t used = plan.gpu_total() + cpu_all;
      room = std::min(room, req.shared_pool_bytes > used ? req.shared_pool_bytes - used : 0);
    }
    add_expert_slots(req, plan, ot_pinned, room);
  }
  const int32_t slots_given = plan.expert_slots;  // the disk tier may turn them off
  if (unified && any_gpu && plan.gpu_total() > plan.budget_bytes) {
    const bool by_flag = f.vram_budget && *f.vram_budget < req.pool_bytes;
    throw Error(
        ErrorCategory::out_of_memory,
        fmt::format("plan needs {} on the GPU side of {}'s unified memory but {} is {} "
                    "({}): {}; {}",
                    mib(plan.gpu_total()), req.device_name, by_flag ? "--vram-budget" : "the pool",
                    mib(plan.budget_bytes), describe_flags(f), unified_terms(req, plan),
                    refusal_hint(req, plan, has_exps, probing)));
  }
  // A board's pool (--unified off) that the GPU's side alone exceeds: refused below naming both
  // sides against the pool (finish_shared_pool), unless --vram-budget is the cap.
  const bool by_flag = f.vram_budget && *f.vram_budget <= req.device_free_bytes;
  if (any_gpu && plan.gpu_total() > plan.budget_bytes && (!req.shared_pool || by_flag)) {
    const std::string source =
        by_flag ? std::string("--vram-budget")
        : f.vram_budget
            ? fmt::format("free on the device; --vram-budget {} asks for more", mib(*f.vram_budget))
            : std::string("free on the device");
    throw Error(
        ErrorCategory::out_of_memory,
        fmt::format("plan needs {} on {} but the budget is {} ({}): weights {} + KV cache {} + "
                    "scratch {} + margin {} ({}); {}",
                    mib(plan.gpu_total()), req.device_name, mib(plan.budget_bytes), source,
                    mib(plan.gpu_weight_bytes), mib(plan.gpu_kv_bytes), mib(plan.scratch_bytes),
                    mib(plan.margin_bytes), describe_flags(f),
                    refusal_hint(req, plan, has_exps, probing)));
  }
  if (!unified) {
    if (req.shared_pool)
      finish_shared_pool(req, plan, describe_flags(f),
                         [&] { return remedies(req, has_exps, probing); });
    else
      add_disk_tier(req, plan);
    // What became of the room the automatic plan left for expert slots, and the slots kept.
    if (slots_at != std::string::npos)
      plan.how.insert(slots_at, plan.expert_slots > 0 ? ", the rest as expert slots"
                                : slots_given > 0     ? ", no expert slots: the disk tier turns "
                                                        "them off"
                                                      : ", no expert slot fits");
    if (plan.expert_slots > 0)
      plan.how += fmt::format(" --residency adaptive: {} expert slots per CPU-held MoE layer",
                              plan.expert_slots);
    return;
  }
  // Unified memory: the CPU's side gets what the device's side leaves of the pool (and at most
  // --ram-budget); routed experts beyond it go to the disk tier.
  const size_t gpu_side = any_gpu ? plan.gpu_total() : 0;
  const size_t pool_left = req.pool_bytes > gpu_side ? req.pool_bytes - gpu_side : size_t{0};
  Request cpu_side = req;
  cpu_side.ram_budget_bytes = std::min(req.ram_budget_bytes, pool_left);
  // An explicit --ram-budget above what the pool leaves the CPU is capped, not silently.
  if (f.ram_budget) {
    const std::string gpu =
        req.activation_reserve_bytes > 0
            ? fmt::format("what the GPU's side ({}) and the activations ({}) leave of the pool",
                          mib(gpu_side), mib(req.activation_reserve_bytes))
            : fmt::format("what the GPU's side ({}) leaves of the pool", mib(gpu_side));
    const size_t ram = *f.ram_budget;
    if (ram == kNoRamBudget)
      note(
          fmt::format("--ram-budget none: on unified memory the CPU's side is still capped at "
                      "{}, {} of {}",
                      mib(pool_left), gpu, mib(whole_pool(req))));
    else if (ram > whole_pool(req))
      note(
          fmt::format("--ram-budget {} is more than the unified pool of {}: the CPU's side is "
                      "capped at {}, {}",
                      mib(ram), mib(whole_pool(req)), mib(pool_left), gpu));
    else if (f.vram_budget && *f.vram_budget + ram > whole_pool(req))
      note(
          fmt::format("--vram-budget {} and --ram-budget {} add up to more than the unified "
                      "pool of {} they both draw on: the CPU's side gets at most {} ({})",
                      mib(*f.vram_budget), mib(ram), mib(whole_pool(req)), gpu, mib(pool_left)));
    else if (ram > pool_left)
      note(fmt::format("--ram-budget {} is more than {} ({}): the CPU's side is capped at it",
                       mib(ram), gpu, mib(pool_left)));
  }
  try {
    add_disk_tier(cpu_side, plan, /*pool_share=*/true,
                  [&] { return remedies(req, has_exps, probing); });
  } catch (const Error& e) {
    if (e.category() != ErrorCategory::out_of_memory) throw;
    // What bounds the CPU's share: --ram-budget when it is below what the GPU side leaves of the
    // pool (then raising it helps), else the pool itself.
    const bool by_ram_budget = req.ram_budget_bytes < pool_left;
    const auto raise_fits = [&] {
      Request r = req;
      r.ram_budget_bytes = kNoRamBudget;
      r.flags.ram_budget.reset();
      return !probing && plan_fits(r);
    };
    const std::string share =
        by_ram_budget
            ? fmt::format(
                  "the CPU's share, {} by --ram-budget (the pool minus the GPU side leaves {}), is "
                  "too small{}",
                  mib(req.ram_budget_bytes), mib(pool_left),
                  raise_fits() ? " (raise --ram-budget)" : "")
            : fmt::format(
                  "the CPU's share, the pool minus the GPU side ({}), is too small, and "
                  "--ram-budget cannot raise it",
                  mib(pool_left));
    throw Error(ErrorCategory::out_of_memory,
                fmt::format("plan does not fit {}'s unified memory (a pool of {}): {}: {} ({}); "
                            "{}",
                            req.device_name, mib(req.pool_bytes), share, unified_terms(req, plan),
                            describe_flags(f), e.what()));
  }
  // --unified on on a GPU with memory of its own: its KV cache, scratch and margin are still
  // allocations there (only the weights stay in host memory).
  if (any_gpu && req.discrete_free_bytes > 0 &&
      plan.gpu_kv_bytes + plan.scratch_bytes + plan.margin_bytes > req.discrete_free_bytes) {
    // What can help: a smaller KV cache where scratch and margin leave room for some, a smaller
    // ubatch where margin and KV cache do; then what the flags can do.
    const size_t own_free = req.discrete_free_bytes;
    std::vector<std::string> parts;
    if (plan.scratch_bytes + plan.margin_bytes < own_free && plan.gpu_kv_bytes > 0)
      parts.push_back("lower -c");
    if (plan.margin_bytes + plan.gpu_kv_bytes < own_free) parts.push_back("lower -ub");
    const std::string flags_fix = remedies(req, has_exps, probing);
    const std::string fix =
        parts.empty() ? fmt::format("its margin and KV cache alone fill it: {}", flags_fix)
                      : fmt::format("{}, or {}", or_list(parts), flags_fix);
    throw Error(
        ErrorCategory::out_of_memory,
        fmt::format("plan needs {} of {}'s own memory but it reports {} free (--unified "
                    "on: the weights it computes stay in host memory, its KV cache {} + "
                    "scratch {} + margin {} do not) ({}); {}",
                    mib(plan.gpu_kv_bytes + plan.scratch_bytes + plan.margin_bytes),
                    req.device_name, mib(own_free), mib(plan.gpu_kv_bytes), mib(plan.scratch_bytes),
                    mib(plan.margin_bytes), describe_flags(f), fix));
  }
  if (plan.pool_total() > req.pool_bytes)
    throw Error(
        ErrorCategory::out_of_memory,
        fmt::format("plan needs {} of {}'s unified memory but the pool is {}: {} ({}); {}",
                    mib(plan.pool_total()), req.device_name, mib(req.pool_bytes),
                    unified_terms(req, plan), describe_flags(f), remedies(req, has_exps, probing)));
}

}  // namespace berth::placement
