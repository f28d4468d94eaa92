// What a user can do about a plan that does not fit: the remedies that make it fit when tried
// (placement's refusal messages name only those).
#include <fmt/format.h>

#include <algorithm>
#include <cctype>

#include "berth/core/error.h"
#include "internal.h"

namespace berth::placement {

// True when `req` plans without running out of memory (a probe for refusal hints: no hints of
// its own are computed inside it).
bool plan_fits(const Request& req) {
  try {
    (void)make_plan_once(req, /*probing=*/true);
    return true;
  } catch (const Error&) {
    return false;
  }
}

// "a", "a, or b", "a, b, or c".
std::string or_list(const std::vector<std::string>& parts) {
  std::string s;
  for (size_t i = 0; i < parts.size(); ++i)
    s += (i == 0 ? "" : i + 1 == parts.size() ? ", or " : ", ") + parts[i];
  return s;
}

// `flags` without its -ot rules that name the GPU (those win over -ngl); true when it had any.
bool drop_gpu_rules(Flags& flags) {
  const size_t n = flags.overrides.size();
  std::erase_if(flags.overrides, [](const auto& rule) {
    std::string d = rule.second;
    for (char& c : d) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return d != "CPU";
  });
  return flags.overrides.size() < n;
}

// The remedies that make `req` (refused) fit when tried, as a list for a message: lower -ngl
// (-ngl 0 fits), --cpu-moe, the automatic plan, and on a board planned with copies (--unified
// off) --unified auto; when none does, a smaller context (if the plan fits without any KV
// cache), a smaller quantization, more memory. `probing`: inside such a try; nothing is tried.
std::string remedies(const Request& req, bool has_exps, bool probing) {
  const Flags& f = req.flags;
  const bool board = (req.unified && req.discrete_free_bytes == 0) || req.shared_pool;
  const std::string more = board ? "a larger board" : "a GPU with more memory";
  if (probing) return more;
  const auto with = [&](auto change) {
    Request r = req;
    change(r.flags);
    return plan_fits(r);
  };
  std::vector<std::string> parts;
  if (req.shared_pool && req.has_device && f.n_gpu_layers != 0) {
    Request u = req;
    u.unified = true;
    u.pool_bytes = u.device_free_bytes = req.shared_pool_bytes;
    u.device_reported_free_bytes = req.device_reported_free_bytes;
    u.shared_pool = false;
    if (plan_fits(u)) parts.push_back("--unified auto (which holds each weight once)");
  }
  if (f.n_gpu_layers > 0 && with([](Flags& g) { g.n_gpu_layers = 0; }))
    parts.push_back("lower -ngl");
  // -ot rules that send tensors to the GPU (with -ngl 0 nothing else does): the plan without
  // them (it named only a smaller quantization or a larger board).
  if (Flags g = f; drop_gpu_rules(g)) {
    if (with([&](Flags& h) { h = g; }))
      parts.push_back("leave out the -ot rules that send tensors to the GPU");
    else if (f.n_gpu_layers > 0 && with([&](Flags& h) { h = g, h.n_gpu_layers = 0; }))
      parts.push_back("lower -ngl and leave out the -ot rules that send tensors to the GPU");
  }
  if (f.n_gpu_layers != 0 && has_exps && !f.cpu_moe && with([](Flags& g) { g.cpu_moe = true; }))
    parts.push_back("add --n-cpu-moe N or --cpu-moe");
  if (f.n_gpu_layers >= 0 && with([](Flags& g) { g.n_gpu_layers = -1; }))
    parts.push_back("leave out -ngl for the automatic plan");
  // On a board's one pool, budgets given below it: the flags, not the board, may be too small.
  if (board) {
    const auto without = [&](bool ram, bool vram) {
      Request r = req;
      if (ram) {
        r.flags.ram_budget.reset();
        r.ram_budget_bytes = req.unified ? req.pool_bytes : req.shared_pool_bytes;
      }
      if (vram) r.flags.vram_budget.reset();
      return plan_fits(r);
    };
    const bool ram = f.ram_budget && without(true, false);
    const bool vram = f.vram_budget && without(false, true);
    if (ram) parts.push_back("raise --ram-budget");
    if (vram) parts.push_back("raise --vram-budget");
    // Each budget alone too small for the other's side: only raising both helps.
    if (f.ram_budget && f.vram_budget && !ram && !vram && without(true, true))
      parts.push_back("raise both --ram-budget and --vram-budget");
  }
  if (!parts.empty()) return or_list(parts);
  // Nothing the placement flags can do: a smaller context (when the plan fits without a KV
  // cache at all), a smaller file, more memory.
  Request r = req;
  if (f.n_gpu_layers > 0) r.flags.n_gpu_layers = -1;
  std::fill(r.kv_bytes.begin(), r.kv_bytes.end(), size_t{0});
  const bool ctx = plan_fits(r);
  // A board whose OS reports less available than its memory: freeing memory (other processes,
  // the page cache they pin) is enough where the whole board would hold the plan. The board's
  // size, not what the device reports free (on a unified board cudaMemGetInfo counts the page
  // cache as used: a GB10 reports ~3 GiB free with 52 GiB available).
  const size_t board_bytes = req.board_bytes;
  if (board && req.os_available_bytes > 0 && board_bytes > req.os_available_bytes) {
    Request w = req;
    const size_t whole =
        board_bytes > req.pool_margin_bytes ? board_bytes - req.pool_margin_bytes : 0;
    w.os_available_bytes = board_bytes;
    if (req.unified) w.pool_bytes = w.device_free_bytes = whole;
    if (req.shared_pool) w.shared_pool_bytes = whole;
    if (!f.ram_budget) w.ram_budget_bytes = whole;
    if (plan_fits(w))
      return fmt::format(
          "{}use a smaller quantization, or free memory on the board (the OS reports {} "
          "available of the board's {}; the plan fits the whole board)",
          ctx ? "lower -c, " : "", mib(req.os_available_bytes), mib(board_bytes));
  }
  return fmt::format("{}use a smaller quantization or {}", ctx ? "lower -c, " : "", more);
}

// What a user can do about a plan whose GPU side does not fit: only the remedies that make the
// plan fit when tried (`probing`: inside such a try, the remedies are not tried again).
std::string refusal_hint(const Request& req, const Plan& plan, bool has_exps, bool probing) {
  const Flags& f = req.flags;
  if (plan.scratch_bytes + plan.margin_bytes >= plan.budget_bytes) {
    const bool board = (req.unified && req.discrete_free_bytes == 0) || req.shared_pool;
    // -ot rules that name the GPU win over -ngl: running on the CPU means leaving them out.
    Request cpu = req;
    cpu.flags.n_gpu_layers = 0;
    const bool gpu_rules = drop_gpu_rules(cpu.flags);
    std::string on_cpu;
    if (probing || plan_fits(cpu))
      on_cpu = !gpu_rules            ? "run on the CPU with -ngl 0"
               : f.n_gpu_layers == 0 ? "leave out the -ot rules that send tensors to the GPU"
                                     : "run on the CPU with -ngl 0 and without the -ot rules "
                                       "that send tensors to the GPU";
    const std::string more = fmt::format("use a smaller quantization or {}",
                                         board ? "a larger board" : "a GPU with more memory");
    // A budget the device (or the board's pool) caps cannot be raised by --vram-budget.
    if (board)
      return fmt::format("the pool does not even hold the GPU's scratch and margin: {}",
                         on_cpu.empty() ? more : on_cpu);
    if (req.has_device && plan.budget_bytes >= req.device_free_bytes)
      return fmt::format("the device's free memory does not even hold the scratch and margin: {}",
                         on_cpu.empty() ? more : on_cpu);
    return fmt::format(
        "the budget does not even hold the scratch and margin: give a larger --vram-budget{}",
        on_cpu.empty() ? "" : " or " + on_cpu);
  }
  if (f.n_gpu_layers < 0) return "the -ot rules send more to the GPU than the budget holds";
  return remedies(req, has_exps, probing);
}

}  // namespace berth::placement
