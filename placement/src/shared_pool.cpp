// A board whose memory the device shares, planned without unified mode (--unified off): both
// sides of the plan draw on one pool (plan.h, Request::shared_pool_bytes).
#include <fmt/format.h>

#include <algorithm>
#include <functional>

#include "berth/core/error.h"
#include "internal.h"

namespace berth::placement {

void finish_shared_pool(const Request& req, Plan& plan, const std::string& flags,
                        const std::function<std::string()>& fix) {
  const size_t pool = req.shared_pool_bytes;
  // The whole pool, and what the plan was made for: the pool less the activations place()
  // keeps beside it where they did not fit beside a plan for the whole pool.
  const size_t whole = pool + req.activation_reserve_bytes;
  const std::string of_pool =
      req.activation_reserve_bytes > 0
          ? fmt::format("the {} the activations ({}) leave of the pool of {}", mib(pool),
                        mib(req.activation_reserve_bytes), mib(whole))
          : fmt::format("the pool of {}", mib(pool));
  const size_t gpu_side = plan.gpu_total();
  const std::string board = req.has_device ? req.device_name : std::string("the unified board");
  const std::string source = fmt::format(
      "the pool is the {} the OS reports available minus a margin of {}, at most the board's "
      "memory",
      mib(req.os_available_bytes), mib(req.pool_margin_bytes));
  if (gpu_side == 0) {
    // Nothing computes on the GPU (-ngl 0, or an automatic plan of copies that found no split):
    // the CPU's side is bounded by the same pool, strictly (no file paging in and out of it).
    Request cpu_side = req;
    cpu_side.ram_budget_bytes = std::min(req.ram_budget_bytes, pool);
    const std::string what = fmt::format(
        "{}'s memory, which the CPU shares with the GPU (a pool of {}; {}; nothing computes on "
        "the GPU)",
        board, mib(pool), source);
    try {
      add_disk_tier(cpu_side, plan, /*pool_share=*/true, fix);
    } catch (const Error& e) {
      if (e.category() != ErrorCategory::out_of_memory) throw;
      throw Error(ErrorCategory::out_of_memory,
                  fmt::format("plan does not fit {} ({}): {}", what, flags, e.what()));
    }
    if (plan.ram_total() > pool)
      throw Error(ErrorCategory::out_of_memory,
                  fmt::format("plan needs {} of {} ({}): weights {} + KV cache {} + RAM expert "
                              "slots {}; {}",
                              mib(plan.ram_total()), what, flags, mib(plan.cpu_weight_bytes),
                              mib(plan.cpu_kv_bytes), mib(plan.ram_slot_bytes), fix()));
    return;
  }
  const auto terms = [&] {
    return fmt::format(
        "the GPU's side {} (copies of {} of weights + KV cache {} + expert slots {} + scratch {} "
        "+ margin {}) + the CPU's side {} (weights {} + KV cache {} + RAM expert slots {}); {}",
        mib(gpu_side), mib(plan.gpu_weight_bytes), mib(plan.gpu_kv_bytes), mib(plan.slot_bytes),
        mib(plan.scratch_bytes), mib(plan.margin_bytes), mib(plan.ram_total()),
        mib(plan.cpu_weight_bytes), mib(plan.cpu_kv_bytes), mib(plan.ram_slot_bytes), source);
  };
  const std::string what = fmt::format(
      "{}'s memory, which the GPU shares with the CPU ({}; --unified off: the GPU computes "
      "from copies of its weights)",
      req.device_name, of_pool);
  Request cpu_side = req;
  cpu_side.ram_budget_bytes = std::min(req.ram_budget_bytes, pool > gpu_side ? pool - gpu_side : 0);
  try {
    add_disk_tier(cpu_side, plan, /*pool_share=*/true, fix);
  } catch (const Error& e) {
    if (e.category() != ErrorCategory::out_of_memory) throw;
    throw Error(ErrorCategory::out_of_memory,
                fmt::format("plan does not fit {}: {} ({}); {}", what, terms(), flags, e.what()));
  }
  const size_t total = gpu_side + plan.ram_total();
  if (total > pool)
    throw Error(ErrorCategory::out_of_memory, fmt::format("plan needs {} of {}: {} ({}); {}",
                                                          mib(total), what, terms(), flags, fix()));
  plan.notes.push_back(fmt::format(
      "--unified off on {}, whose memory the GPU shares: the plan holds the {} of weights the "
      "GPU computes twice (its copies, and the file's pages while the OS keeps them cached) and "
      "counts both sides against the pool: {} of {} ({}); --unified auto holds each weight once",
      req.device_name, mib(plan.gpu_weight_bytes), mib(total), of_pool, terms()));
}

}  // namespace berth::placement
