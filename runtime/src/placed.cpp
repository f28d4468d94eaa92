#include "berth/runtime/placed.h"

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "berth/core/error.h"
#include "berth/core/log.h"
#include "berth/runtime/plan_request.h"

namespace berth {

namespace {
double gib(size_t b) { return static_cast<double>(b) / (1ull << 30); }
}  // namespace

std::string PlacementSetup::summary() const {
  if (!device)
    return fmt::format("placement: all {:.2f} GiB of weights on the CPU ({})",
                       gib(plan.cpu_weight_bytes), plan.how);
  return fmt::format(
      "placement ({}): {:.2f} GiB of weights + {:.2f} GiB KV cache + {:.2f} GiB scratch on {}, "
      "{:.2f} GiB of weights on the CPU",
      plan.how, gib(plan.gpu_weight_bytes), gib(plan.gpu_kv_bytes), gib(plan.scratch_bytes),
      device->name(), gib(plan.cpu_weight_bytes));
}

std::unique_ptr<Device> default_device() {
  if (cuda_available()) return make_cuda_device(0);
  if (const char* sim = std::getenv("BERTH_SIM_DEVICE"); sim && *sim)
    return make_sim_device(placement::parse_size(sim, "BERTH_SIM_DEVICE"));
  return nullptr;
}

PlacementSetup place(const Model& model, const placement::Flags& flags, SessionParams& params,
                     bool progress_to_stderr) {
  PlacementSetup s;
  bool wants_gpu = flags.n_gpu_layers != 0;
  for (const auto& [re, dev] : flags.overrides)
    if (dev != "CPU" && dev != "cpu") wants_gpu = true;
  if (wants_gpu) s.device = default_device();
  const int64_t n_ctx = params.n_ctx > 0 ? params.n_ctx : default_n_ctx(model.hparams());
  s.request =
      plan_request(model, n_ctx, params.n_ubatch, flags,
                   s.device ? s.device->name() : std::string("GPU (--vram-budget)"),
                   s.device ? s.device->free_bytes() : 0, s.device != nullptr,
                   params.hybrid.stream_experts_min_tokens, params.hybrid.host_expert_share);
  s.plan = placement::make_plan(s.request);
  for (const std::string& note : s.plan.notes) log::warn("{}", note);
  bool any_gpu = false;
  for (placement::Home h : s.plan.home) any_gpu = any_gpu || h == placement::Home::gpu;
  for (placement::Home h : s.plan.kv_home) any_gpu = any_gpu || h == placement::Home::gpu;
  if (!any_gpu || !s.device) {
    s.device.reset();
    params.device = nullptr;
    return s;
  }
  params.device = s.device.get();
  params.weight_home = s.plan.home;
  params.kv_home = s.plan.kv_home;
  if (progress_to_stderr) {
    const bool tty = isatty(STDERR_FILENO) == 1;
    const std::string name = s.device->name();
    auto t0 =
        std::make_shared<std::chrono::steady_clock::time_point>(std::chrono::steady_clock::now());
    auto last = std::make_shared<int>(-1);
    params.hybrid.progress = [tty, name, t0, last](size_t done, size_t total) {
      const int pct = total ? static_cast<int>(done * 100 / total) : 100;
      if (tty && pct != *last) {
        const int fill = pct / 4;
        std::fprintf(stderr, "\rloading weights to %s [%-25s] %3d%% %.2f/%.2f GiB", name.c_str(),
                     std::string(static_cast<size_t>(fill), '#').c_str(), pct, gib(done),
                     gib(total));
        std::fflush(stderr);
      }
      *last = pct;
      if (done == total) {
        const double sec =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - *t0).count();
        // GiB for model-sized totals; a tiny model in MiB rather than "0.00 GiB".
        const std::string size = total >= (size_t{1} << 30)
                                     ? fmt::format("{:.2f} GiB", gib(total))
                                     : fmt::format("{:.1f} MiB", gib(total) * 1024.0);
        std::fprintf(stderr, "%sloaded %s of weights to %s in %.1f s\n", tty ? "\r\x1b[K" : "",
                     size.c_str(), name.c_str(), sec);
      }
    };
  }
  return s;
}

std::vector<std::string> device_option_notes(const Model& model, const SessionParams& params,
                                             bool handoff_set, bool warm_set) {
  std::vector<std::string> out;
  if (params.device) {
    // The expert options act on stacked expert tensors (ne[2] > 1) that stay on the CPU.
    const graph::WeightTable& w = model.weights();
    bool cpu_experts = false;
    for (size_t i = 0; i < w.size() && i < params.weight_home.size(); ++i)
      cpu_experts =
          cpu_experts || (params.weight_home[i] == placement::Home::cpu && w[i].ne[2] > 1);
    if (cpu_experts) return out;
    const char* none =
        "has no effect: no expert tensor stays on the CPU (--cpu-moe or "
        "--n-cpu-moe N keeps some there)";
    if (params.hybrid.stream_experts_min_tokens > 0)
      out.push_back(
          fmt::format("--stream-experts {} {}", params.hybrid.stream_experts_min_tokens, none));
    if (params.hybrid.host_expert_share > 0)
      out.push_back(
          fmt::format("--host-expert-share {} {}", params.hybrid.host_expert_share, none));
    return out;
  }
  const char* why = "has no effect: no GPU holds any weight or KV cache";
  if (params.hybrid.stream_experts_min_tokens > 0)
    out.push_back(
        fmt::format("--stream-experts {} {}", params.hybrid.stream_experts_min_tokens, why));
  if (params.hybrid.host_expert_share > 0)
    out.push_back(fmt::format("--host-expert-share {} {}", params.hybrid.host_expert_share, why));
  if (handoff_set) out.push_back(fmt::format("--handoff {}", why));
  if (warm_set)
    out.push_back(fmt::format("--warm-workers {} {}", params.hybrid.warm_workers_us, why));
  return out;
}

}  // namespace berth
