// `berth plan`: where each tensor and each layer's KV cache would live, without loading weights;
// with --ops, also the schedule of a decode step and of a prefill ubatch.
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>

#include "berth/backends/thread_pool.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/placement/plan.h"
#include "berth/residency/expert_slots.h"
#include "berth/runtime/placed.h"
#include "berth/runtime/session.h"
#include "commands.h"
#include "placement_flags.h"

namespace berth::cli {
namespace {

struct PlanOptions {
  std::string model;
  int64_t n_ctx = 0;
  int32_t n_ubatch = kRunUbatch;  // as run
  bool n_ubatch_auto = true;      // -ub not given (as run: place() may lower it)
  placement::Flags flags;
  int32_t stream_min = kStreamExpertsAuto;
  double host_expert_share = 0;
  int64_t warm_workers_us = kAutoWarmWorkersUs;
  std::string handoff = "auto";
  bool json = false;
  bool ops = false;
  bool tensors = false;
  int32_t residency_swaps = 4;
  std::string residency_policy;  // --residency-policy (empty: the default)
};

int plan(const PlanOptions& o) {
  gguf::File file = gguf::File::open(o.model);
  std::unique_ptr<Model> model = load_model(file);  // views into the mapping; nothing is read
  SessionParams sp;
  sp.n_ctx = o.n_ctx;
  sp.n_ubatch = o.n_ubatch;
  sp.n_ubatch_auto = o.n_ubatch_auto;
  sp.hybrid.stream_experts_min_tokens = o.stream_min;
  sp.hybrid.host_expert_share = o.host_expert_share;
  sp.hybrid.warm_workers_us = o.warm_workers_us;
  sp.hybrid.handoff = parse_handoff(o.handoff);
  sp.hybrid.expert_slots.max_swaps_per_step = o.residency_swaps;
  // The policy seeds the slots: the plan shows the experts they start with.
  if (!o.residency_policy.empty())
    sp.hybrid.expert_slots.policy = make_slot_policy(o.residency_policy);
  const int64_t n_ctx = o.n_ctx > 0 ? o.n_ctx : default_n_ctx(model->hparams());
  PlacementSetup setup = place(*model, o.flags, sp, false, /*plan_only=*/true);
  placement::Plan& p = setup.plan;
  // What `run` would refuse or warn about with the same -c (found by a new-user trial).
  if (std::string c = context_note(n_ctx, model->hparams()); !c.empty()) p.notes.push_back(c);
  const size_t phys = physical_memory_bytes();
  if (phys > 0 && p.cpu_kv_bytes > phys)
    p.notes.push_back(fmt::format(
        "the CPU's KV cache ({:.1f} MiB) is more than this machine's {:.1f} MiB of memory: run "
        "refuses it (lower -c)",
        static_cast<double>(p.cpu_kv_bytes) / (1 << 20), static_cast<double>(phys) / (1 << 20)));
  // A step holds at most the context's tokens: -ub beyond -c is capped (as run's steps are).
  p.how += fmt::format(
      ", context {} tokens, ubatch {}{}", n_ctx, std::min<int64_t>(sp.n_ubatch, n_ctx),
      sp.n_ubatch > n_ctx ? fmt::format(" (-ub {} capped by -c)", sp.n_ubatch) : std::string());
  if (!o.ops)
    return write_stdout(o.json ? placement::plan_json(setup.request, p)
                               : placement::plan_table(setup.request, p, o.tensors)),
           0;
  const auto schedules = step_schedules(*model, setup, sp);
  if (o.json) {
    nlohmann::json j = nlohmann::json::parse(placement::plan_json(setup.request, p));
    j["schedules"] = nlohmann::json::array();
    for (const auto& [title, s] : schedules)
      j["schedules"].push_back(nlohmann::json::parse(schedule_json(s, model->weights(), title)));
    (void)write_stdout(j.dump(1) + "\n");
    return 0;
  }
  std::string out = placement::plan_table(setup.request, p, o.tensors);
  for (const auto& [title, s] : schedules) out += "\n" + schedule_text(s, model->weights(), title);
  if (!schedules.empty() && schedules.front().second.value_side.size() > 0 &&
      schedules.front().second.has_device &&
      schedules.front().second.value_side[static_cast<size_t>(schedules.front().second.g.output)] ==
          Side::device)
    out +=
        "\nWith greedy sampling (--temp 0) `run` ends the decode step with select (the argmax "
        "on the GPU, 4 bytes back) instead of output.\n";
  (void)write_stdout(out);
  return 0;
}

}  // namespace

Runner add_plan(CLI::App& app) {
  auto o = std::make_shared<PlanOptions>();
  CLI::App* sub = app.add_subcommand(
      "plan",
      "show where each tensor and KV cache would live (GPU or CPU) for the placement flags, and "
      "with --ops the schedule of a decode step and a prefill ubatch");
  sub->add_option("-m,--model", o->model, "GGUF model file")->required();
  sub->add_option("-c,--ctx-size", o->n_ctx, "context size in tokens (0: min(4096, model's))")
      ->capture_default_str()
      ->check(range(int64_t{0}, int64_t{1} << 24));
  sub->add_option("--ubatch-size", o->n_ubatch, "tokens per prefill step (-ub)")
      ->capture_default_str()
      ->check(range(1, 1 << 16))
      ->each([o](const std::string&) { o->n_ubatch_auto = false; });
  add_placement_flags(*sub, o->flags);
  add_stream_experts(*sub, o->stream_min);
  add_host_expert_share(*sub, o->host_expert_share);
  add_warm_workers(*sub, o->warm_workers_us);
  add_handoff(*sub, o->handoff);
  add_residency_swaps(*sub, o->residency_swaps);
  add_residency_policy(*sub, o->residency_policy);
  sub->add_flag("--tensors", o->tensors,
                "the table also lists every tensor (name, type, MiB, home); the default shows "
                "per MoE layer how many experts are on the GPU and which");
  sub->add_flag("--ops", o->ops,
                "also print the schedule of a decode step and of a prefill ubatch: each op's "
                "side (GPU or CPU) and why, the CPU segments, the copies between the sides with "
                "their bytes, and the device's calls (fused ones named)");
  sub->add_flag("--json", o->json, "print the plan (and schedules) as JSON instead of a table");
  return [o] { return plan(*o); };
}

}  // namespace berth::cli
