// `berth plan`: where each tensor and each layer's KV cache would live, without loading weights.
#include <fmt/format.h>

#include <memory>

#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/placement/plan.h"
#include "berth/backends/device.h"
#include "berth/runtime/placed.h"
#include "berth/runtime/plan_request.h"
#include "berth/runtime/session.h"
#include "berth/backends/thread_pool.h"
#include "commands.h"
#include "placement_flags.h"

namespace berth::cli {
namespace {

struct PlanOptions {
  std::string model;
  int64_t n_ctx = 0;
  int32_t n_ubatch = 512;
  placement::Flags flags;
  bool json = false;
};

int plan(const PlanOptions& o) {
  gguf::File file = gguf::File::open(o.model);
  std::unique_ptr<Model> model = load_model(file);  // views into the mapping; nothing is read
  const int64_t n_ctx = o.n_ctx > 0 ? o.n_ctx : default_n_ctx(model->hparams());

  std::string device_name;
  size_t free_bytes = 0;
  bool has_device = false;
  std::string note;
  if (std::unique_ptr<Device> dev = default_device()) {  // CUDA, or BERTH_SIM_DEVICE
    device_name = dev->name();
    free_bytes = dev->free_bytes();
    has_device = true;
  } else if (o.flags.vram_budget) {
    device_name = "GPU (none found)";
    free_bytes = *o.flags.vram_budget;
    has_device = true;
    note = "planned for a GPU with --vram-budget; none found";
  } else {
    note =
        "no GPU found: everything runs on the CPU (--vram-budget SIZE plans for a GPU of "
        "that size)";
  }

  const placement::Request req =
      plan_request(*model, n_ctx, o.n_ubatch, o.flags, device_name, free_bytes, has_device);
  placement::Plan p = placement::make_plan(req);
  if (!note.empty()) p.notes.insert(p.notes.begin(), note);
  // What `run` would refuse or warn about with the same -c (found by a new-user trial).
  if (std::string c = context_note(n_ctx, model->hparams()); !c.empty()) p.notes.push_back(c);
  const size_t phys = physical_memory_bytes();
  if (phys > 0 && p.cpu_kv_bytes > phys)
    p.notes.push_back(fmt::format(
        "the CPU's KV cache ({:.1f} MiB) is more than this machine's {:.1f} MiB of memory: run "
        "refuses it (lower -c)",
        static_cast<double>(p.cpu_kv_bytes) / (1 << 20), static_cast<double>(phys) / (1 << 20)));
  p.how += fmt::format(", context {} tokens, ubatch {}", n_ctx, o.n_ubatch);
  (void)write_stdout(o.json ? placement::plan_json(req, p) : placement::plan_table(req, p));
  return 0;
}

}  // namespace

Runner add_plan(CLI::App& app) {
  auto o = std::make_shared<PlanOptions>();
  CLI::App* sub = app.add_subcommand(
      "plan",
      "show where each tensor and KV cache would live (GPU or CPU) for the placement flags");
  sub->add_option("-m,--model", o->model, "GGUF model file")->required();
  sub->add_option("-c,--ctx-size", o->n_ctx, "context size in tokens (0: min(4096, model's))")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 24));
  sub->add_option("--ubatch-size", o->n_ubatch, "tokens per prefill step (-ub)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 16));
  add_placement_flags(*sub, o->flags);
  sub->add_flag("--json", o->json, "print the plan as JSON instead of a table");
  return [o] { return plan(*o); };
}

}  // namespace berth::cli
