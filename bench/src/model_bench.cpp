#include "berth/bench/model_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>

#include "berth/backends/thread_pool.h"
#include "berth/core/error.h"
#include "berth/core/log.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/runtime/placed.h"
#include "berth/runtime/session.h"
#include "berth/scheduler/scheduler.h"

namespace berth::bench {
namespace {

// Decimal units with two decimals, so small models do not read "0.00 GB": counts as
// 292.80 K / 30.53 B (llama.cpp's style for parameters), bytes as 1.17 MB / 18.56 GB.
std::string si(double x, const char* unit) {
  const bool bytes = *unit != 0;
  const char* counts[] = {"", " K", " M", " B", " T"};
  const char* sizes[] = {" B", " KB", " MB", " GB", " TB"};
  int i = 0;
  while (i < 4 && std::abs(x) >= 1000.0) x /= 1000.0, ++i;
  return fmt::format("{:.2f}{}", x, bytes ? sizes[i] : counts[i]);
}

constexpr size_t kGiB = size_t{1} << 30;

// Bytes one decode step reads from the weights: see the module comment. With `home` (one per
// weight), only the weights whose home is `side`.
uint64_t decode_weight_bytes(const Model& m, const std::vector<placement::Home>* home = nullptr,
                             placement::Home side = placement::Home::cpu) {
  const graph::Graph g = m.build_step(1, 1);
  const graph::WeightTable& w = m.weights();
  uint64_t bytes = 0;
  auto on = [&](graph::WeightId id) { return !home || (*home)[static_cast<size_t>(id)] == side; };
  for (const graph::Op& op : g.ops) {
    switch (op.kind) {
      case graph::OpKind::embed:
        if (on(op.weight)) bytes += row_bytes(w[op.weight].type, w[op.weight].ne[0]);
        break;
      case graph::OpKind::moe_experts: {
        for (graph::WeightId id : {op.moe.gate, op.moe.up, op.moe.down})
          if (on(id))
            bytes += w[id].n_bytes / static_cast<uint64_t>(op.moe.n_expert) *
                     static_cast<uint64_t>(op.moe.n_expert_used);
        break;
      }
      default:
        if (op.weight != graph::kNoWeight && on(op.weight)) bytes += w[op.weight].n_bytes;
    }
  }
  return bytes;
}

// Per decode token, the bytes of CPU-held routed experts that HybridOptions::host_expert_share
// `f` moves to the device, which reads them over PCIe: each op's slots as the executor splits
// them (host_share_device_slots).
uint64_t decode_share_bytes(const Model& m, const std::vector<placement::Home>& home, double f) {
  const graph::Graph g = m.build_step(1, 1);
  const graph::WeightTable& w = m.weights();
  const std::vector<int32_t> slots = host_share_device_slots(g, home, f);
  uint64_t bytes = 0;
  for (size_t i = 0; i < g.ops.size(); ++i) {
    const graph::Op& op = g.ops[i];
    if (slots[i] == 0) continue;
    for (graph::WeightId id : {op.moe.gate, op.moe.up, op.moe.down})
      bytes +=
          w[id].n_bytes / static_cast<uint64_t>(op.moe.n_expert) * static_cast<uint64_t>(slots[i]);
  }
  return bytes;
}

// GB/s of `bytes` moved by `copy` (median of 5 after a warm-up); `count` bytes per copy.
double copy_gbps(Device& dev, const std::function<void()>& copy, double count) {
  std::vector<double> secs;
  for (int i = 0; i < 6; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    copy();
    dev.synchronize();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i > 0) secs.push_back(s);
  }
  std::sort(secs.begin(), secs.end());
  return count / secs[secs.size() / 2] / 1e9;
}

std::vector<OpShare> shares(const std::vector<CpuExecutor::OpTime>& prof, int runs) {
  double total = 0;
  for (const auto& p : prof) total += p.seconds;
  std::vector<OpShare> out;
  for (const auto& p : prof)
    out.push_back({p.kind, p.seconds / runs, total > 0 ? p.seconds / total : 0});
  return out;
}

}  // namespace

ModelBenchResult run_model_bench(const ModelBenchOptions& options) {
  ModelBenchOptions o = options;
  o.progress = nullptr;
  if (o.n_prompt < 0 || o.n_gen < 0 || o.repetitions < 1)
    throw Error(ErrorCategory::invalid_argument, "bench model: -p and -n must be >= 0 and -r >= 1");
  if (o.n_prompt == 0 && o.n_gen == 0)
    throw Error(ErrorCategory::invalid_argument,
                "bench model: -p 0 and -n 0 leave nothing to measure");
  auto say = [&](const std::string& s) {
    if (options.progress) options.progress(s);
  };
  ModelBenchResult r;
  r.machine = machine_info();
  gguf::File file = gguf::File::open(o.model_path);
  std::unique_ptr<Model> model = load_model(file);
  const Hparams& hp = model->hparams();
  r.arch = hp.arch;
  r.model_name = file.get_string_opt("general.name").value_or("");
  for (const gguf::TensorInfo& t : file.tensors()) {
    r.n_params += t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3];
    r.weight_bytes += t.n_bytes;
  }
  r.n_layer = hp.n_layer;
  r.n_expert = hp.n_expert;
  r.n_expert_used = hp.n_expert_used;

  SessionParams sp;
  sp.n_threads = o.n_threads;
  sp.n_ctx = std::max<int64_t>(std::max(o.n_prompt, o.n_gen), 16);
  sp.n_ubatch = std::max(o.n_prompt, 1);
  if (sp.n_ctx > hp.n_ctx_train)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("bench model: {} tokens exceed the model's context_length {}", sp.n_ctx,
                            hp.n_ctx_train));
  sp.hybrid.stream_experts_min_tokens = o.stream_min_tokens;  // before place(): they need room
  sp.hybrid.host_expert_share = o.host_expert_share;
  PlacementSetup placed = place(*model, o.placement, sp, static_cast<bool>(options.progress));
  if (o.warm_workers_us >= 0) sp.hybrid.warm_workers_us = o.warm_workers_us;
  if (o.handoff == "flags")
    sp.hybrid.handoff = Handoff::flags;
  else if (o.handoff == "callback")
    sp.hybrid.handoff = Handoff::callback;
  else if (o.handoff != "auto")
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("--handoff must be auto, flags or callback, got '{}'", o.handoff));
  for (const std::string& note :
       device_option_notes(*model, sp, o.handoff != "auto", o.warm_workers_us >= 0))
    log::warn("{}", note);
  r.placement = placed.plan.how;
  if (sp.device) {
    r.device = sp.device->name();
    say(placed.summary());
  }
  Session session(*model, sp);
  r.n_threads = session.pool().n_threads();
  o.n_threads = r.n_threads;
  say(fmt::format("model  {} ({}), {} of weights, {} threads", r.model_name, r.arch,
                  si(static_cast<double>(r.weight_bytes), "B"), r.n_threads));

  std::mt19937_64 rng(o.seed);
  auto tokens = [&](int n) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (int32_t& x : t) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(hp.n_vocab));
    return t;
  };
  session.executor().set_profiling(o.profile);
  if (session.device()) {
    session.scheduler().set_profiling(o.profile);
    r.handoff = session.scheduler().handoff() == Handoff::flags ? "flags" : "callback";
    r.stream_experts_min_tokens = sp.hybrid.stream_experts_min_tokens;
    r.host_experts_pinning = std::string(session.residency()->host_experts_pinning());
    if (r.handoff == "flags")
      r.warm_workers_us = session.scheduler().warm_workers_us();
    else if (o.warm_workers_us > 0)
      log::warn("--warm-workers {} has no effect: the hand-off is by host callbacks ({})",
                o.warm_workers_us,
                o.handoff == "callback"
                    ? std::string("--handoff callback")
                    : fmt::format("{} has no flags", r.device.empty() ? "the device" : r.device));
  }
  auto reset_gpu = [&] {
    if (session.device()) session.scheduler().reset_gpu_profile();
  };
  auto gpu_shares = [&] {
    return session.device() ? shares(session.scheduler().gpu_profile(), o.repetitions)
                            : std::vector<OpShare>{};
  };
  if (o.n_prompt > 0) {
    std::vector<double> secs;
    for (int rep = 0; rep <= o.repetitions; ++rep) {
      const std::vector<int32_t> t = tokens(o.n_prompt);
      session.reset();
      if (rep == 1) session.executor().reset_profile(), reset_gpu();
      const auto t0 = std::chrono::steady_clock::now();
      (void)session.eval(t);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rep > 0) secs.push_back(s);
      if (rep > 0 && session.device())
        r.pp_cpu_busy += session.scheduler().last_cpu_seconds() / s / o.repetitions;
      say(fmt::format("pp{}   run {}{}  {:8.2f} tok/s", o.n_prompt, rep, rep ? "" : " (warm-up)",
                      o.n_prompt / s));
    }
    r.pp_tok_s = rate_of(secs, o.n_prompt);
    r.pp_profile = shares(session.executor().profile(), o.repetitions);
    r.pp_gpu_profile = gpu_shares();
  }
  if (o.n_gen > 0) {
    std::vector<double> secs;
    for (int rep = 0; rep <= o.repetitions; ++rep) {
      const std::vector<int32_t> t = tokens(o.n_gen);
      session.reset();
      if (rep == 1) session.executor().reset_profile(), reset_gpu();
      const auto t0 = std::chrono::steady_clock::now();
      double cpu_s = 0;
      for (int32_t id : t) {
        (void)session.eval(std::span<const int32_t>(&id, 1));
        if (session.device()) cpu_s += session.scheduler().last_cpu_seconds();
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rep > 0) r.tg_cpu_busy += cpu_s / s / o.repetitions;
      if (rep > 0) secs.push_back(s);
      say(fmt::format("tg{}   run {}{}  {:8.2f} tok/s", o.n_gen, rep, rep ? "" : " (warm-up)",
                      o.n_gen / s));
    }
    r.tg_tok_s = rate_of(secs, o.n_gen);
    if (const CpuExecutor::MoeTiming& mt = session.executor().moe_timing(); mt.calls > 0) {
      const double c = static_cast<double>(mt.calls);
      const double tc = static_cast<double>(std::max<int64_t>(1, mt.thread_calls));
      auto& m = r.tg_moe;
      m.calls = mt.calls / std::max(1, o.repetitions);
      m.threads = static_cast<double>(mt.thread_calls) / c;
      m.total_us = 1e6 * mt.total / c;
      m.before_us = 1e6 * mt.before / c;
      m.region_us = 1e6 * mt.region / c;
      m.after_us = 1e6 * mt.after / c;
      m.join_us = 1e6 * mt.join / tc;
      m.wait_us = 1e6 * mt.wait / tc;
      m.tail_us = 1e6 * mt.tail / tc;
    }
    if (session.device() && r.tg_cpu_busy > 0) {
      // The device alone: the same steps with the CPU segments skipped (timing only; the
      // outputs and KV rows are wrong, so the session is reset after), as many runs as above,
      // median over median.
      std::vector<double> alone;
      session.scheduler().set_skip_cpu_segments(true);
      try {
        for (int rep = 0; rep < o.repetitions; ++rep) {
          const std::vector<int32_t> t = tokens(o.n_gen);
          session.reset();
          const auto t0 = std::chrono::steady_clock::now();
          for (int32_t id : t) (void)session.eval(std::span<const int32_t>(&id, 1));
          alone.push_back(
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
      } catch (...) {
        session.scheduler().set_skip_cpu_segments(false);
        throw;
      }
      session.scheduler().set_skip_cpu_segments(false);
      session.reset();
      const double alone_tok_s = rate_of(alone, o.n_gen).median;
      r.tg_device_busy = alone_tok_s > 0 ? r.tg_tok_s.median / alone_tok_s : 0;
      say(fmt::format("tg{}   device alone  {:8.2f} tok/s", o.n_gen, alone_tok_s));
    }
    r.tg_profile = shares(session.executor().profile(), o.repetitions);
    r.tg_gpu_profile = gpu_shares();
  }
  const size_t llc = r.machine.llc_bytes;
  r.dram =
      measure_dram_bandwidth(r.n_threads, o.dram_bytes ? o.dram_bytes : std::max(kGiB, 8 * llc),
                             std::max(3, o.repetitions));
  say(fmt::format("dram   threads {:>3}  {:8.2f} GB/s", r.n_threads, r.dram.gbps.median));

  r.decode_weight_bytes = decode_weight_bytes(*model);
  uint64_t kv_row = 0;
  for (const KvLayer& l : model->kv_layers())
    kv_row += static_cast<uint64_t>(l.k_dim + l.v_dim) * 4;
  r.decode_kv_bytes = kv_row * static_cast<uint64_t>(o.n_gen + 1) / 2;
  const double bytes = static_cast<double>(r.decode_weight_bytes + r.decode_kv_bytes);
  r.bound_tok_s = r.dram.gbps.median * 1e9 / bytes;
  if (o.n_gen > 0) {
    r.fraction_of_bound = r.tg_tok_s.median / r.bound_tok_s;
    r.decode_gbps = r.tg_tok_s.median * bytes / 1e9;
  }
  if (sp.device) {
    Device& dev = *sp.device;
    const auto& home = placed.plan.home;
    r.gpu_weight_bytes = placed.plan.gpu_weight_bytes;
    uint64_t kv_gpu = 0, kv_cpu = 0;
    const auto kvl = model->kv_layers();
    for (size_t l = 0; l < kvl.size(); ++l) {
      const uint64_t avg = static_cast<uint64_t>(kvl[l].k_dim + kvl[l].v_dim) *
                           static_cast<uint64_t>(o.n_gen + 1) / 2;
      if (placed.plan.kv_home[l] == placement::Home::gpu)
        kv_gpu += avg * 2;  // f16
      else
        kv_cpu += avg * 4;  // f32
    }
    r.decode_gpu_bytes = decode_weight_bytes(*model, &home, placement::Home::gpu) + kv_gpu;
    r.decode_cpu_bytes = decode_weight_bytes(*model, &home, placement::Home::cpu) + kv_cpu;
    if (!r.host_experts_pinning.empty()) {
      r.decode_share_bytes = decode_share_bytes(*model, home, o.host_expert_share);
      r.decode_cpu_bytes -= r.decode_share_bytes;
    }
    const size_t n = std::min<size_t>(size_t{1} << 30, dev.free_bytes() / 4);
    void* a = dev.alloc(n, "bandwidth test");
    void* b = dev.alloc(n, "bandwidth test");
    void* h = dev.alloc_host(n / 4, "bandwidth test");
    std::memset(h, 1, n / 4);
    r.hbm_gbps = copy_gbps(
        dev, [&] { dev.copy(kMain, b, a, n); }, 2.0 * static_cast<double>(n));
    r.h2d_gbps = copy_gbps(
        dev, [&] { dev.copy(kMain, a, h, n / 4); }, static_cast<double>(n / 4));
    dev.dealloc(a), dev.dealloc(b), dev.dealloc_host(h);
    const double t = std::max(static_cast<double>(r.decode_cpu_bytes) / (r.dram.gbps.median * 1e9),
                              static_cast<double>(r.decode_share_bytes) / (r.h2d_gbps * 1e9)) +
                     static_cast<double>(r.decode_gpu_bytes) / (r.hbm_gbps * 1e9);
    r.hybrid_bound_tok_s = t > 0 ? 1.0 / t : 0;
    if (o.n_gen > 0) r.fraction_of_bound = r.tg_tok_s.median / r.hybrid_bound_tok_s;
  }
  r.options = o;
  return r;
}

nlohmann::json to_json(const ModelBenchResult& r) {
  using nlohmann::json;
  auto prof = [](const std::vector<OpShare>& p) {
    json a = json::array();
    for (const OpShare& s : p)
      a.push_back({{"op", s.kind}, {"seconds", s.seconds}, {"fraction", s.fraction}});
    return a;
  };
  const MachineInfo& m = r.machine;
  return json{
      {"machine", to_json(m)},
      {"model",
       {{"path", r.options.model_path},
        {"name", r.model_name},
        {"arch", r.arch},
        {"n_params", r.n_params},
        {"weight_bytes", r.weight_bytes},
        {"n_layer", r.n_layer},
        {"n_expert", r.n_expert},
        {"n_expert_used", r.n_expert_used}}},
      {"config",
       {{"threads", r.n_threads},
        {"n_prompt", r.options.n_prompt},
        {"n_gen", r.options.n_gen},
        {"repetitions", r.options.repetitions},
        {"seed", r.options.seed}}},
      {"statistic", fmt::format("median of {} run{} after 1 warm-up", r.options.repetitions,
                                r.options.repetitions == 1 ? "" : "s")},
      {"pp_tok_s", r.pp_tok_s.median},
      {"pp_tok_s_best", r.pp_tok_s.best},
      {"tg_tok_s", r.tg_tok_s.median},
      {"tg_tok_s_best", r.tg_tok_s.best},
      {"dram_gbps", r.dram.gbps.median},
      {"decode_weight_bytes", r.decode_weight_bytes},
      {"decode_kv_bytes", r.decode_kv_bytes},
      {"bound_tok_s", r.bound_tok_s},
      {"fraction_of_bound", r.fraction_of_bound},
      {"decode_gbps", r.decode_gbps},
      {"device", r.device},
      {"placement", r.placement},
      {"gpu_weight_bytes", r.gpu_weight_bytes},
      {"decode_gpu_bytes", r.decode_gpu_bytes},
      {"decode_cpu_bytes", r.decode_cpu_bytes},
      {"decode_share_bytes", r.decode_share_bytes},
      {"hbm_copy_gbps", r.hbm_gbps},
      {"h2d_pinned_gbps", r.h2d_gbps},
      {"hybrid_bound_tok_s", r.hybrid_bound_tok_s},
      {"tg_cpu_busy", r.tg_cpu_busy},
      {"pp_cpu_busy", r.pp_cpu_busy},
      {"tg_device_busy", r.tg_device_busy},
      {"tg_moe",
       {{"statistic", "mean over the calls of the timed runs"},
        {"calls_per_run", r.tg_moe.calls},
        {"threads", r.tg_moe.threads},
        {"total_us", r.tg_moe.total_us},
        {"before_us", r.tg_moe.before_us},
        {"region_us", r.tg_moe.region_us},
        {"after_us", r.tg_moe.after_us},
        {"join_us", r.tg_moe.join_us},
        {"wait_us", r.tg_moe.wait_us},
        {"tail_us", r.tg_moe.tail_us}}},
      {"stream_min_tokens", r.options.stream_min_tokens},
      {"host_expert_share", r.options.host_expert_share},
      {"warm_workers_us", r.warm_workers_us},
      {"handoff", r.handoff},
      {"stream_min_tokens_in_effect", r.stream_experts_min_tokens},
      {"host_experts_pinning", r.host_experts_pinning},
      {"pp_gpu_profile", prof(r.pp_gpu_profile)},
      {"tg_gpu_profile", prof(r.tg_gpu_profile)},
      {"pp_profile", prof(r.pp_profile)},
      {"tg_profile", prof(r.tg_profile)},
  };
}

std::string format_text(const ModelBenchResult& r) {
  std::string s =
      fmt::format("machine: {} ({} cores), {}\nmodel:   {} ({}), {} layers", r.machine.cpu_model,
                  r.machine.physical_cores, r.machine.date_utc,
                  r.model_name.empty() ? r.options.model_path : r.model_name, r.arch, r.n_layer);
  if (r.n_expert > 0) s += fmt::format(", {} experts ({} used)", r.n_expert, r.n_expert_used);
  s += fmt::format(", {} params, {}\n", si(static_cast<double>(r.n_params), ""),
                   si(static_cast<double>(r.weight_bytes), "B"));
  s += fmt::format("threads: {}   statistic: median of {} run{} after 1 warm-up\n\n", r.n_threads,
                   r.options.repetitions, r.options.repetitions == 1 ? "" : "s");
  s += fmt::format("{:<10} {:>12} {:>12}\n", "test", "tok/s", "best");
  if (r.options.n_prompt > 0)
    s += fmt::format("{:<10} {:>12.2f} {:>12.2f}\n", fmt::format("pp{}", r.options.n_prompt),
                     r.pp_tok_s.median, r.pp_tok_s.best);
  if (r.options.n_gen > 0)
    s += fmt::format("{:<10} {:>12.2f} {:>12.2f}\n", fmt::format("tg{}", r.options.n_gen),
                     r.tg_tok_s.median, r.tg_tok_s.best);
  s += fmt::format(
      "\ndecode reads {:.3f} GB/token (weights {:.3f} + KV {:.4f}); DRAM {:.1f} GB/s "
      "-> bound {:.2f} tok/s\n",
      static_cast<double>(r.decode_weight_bytes + r.decode_kv_bytes) / 1e9,
      static_cast<double>(r.decode_weight_bytes) / 1e9,
      static_cast<double>(r.decode_kv_bytes) / 1e9, r.dram.gbps.median, r.bound_tok_s);
  if (!r.device.empty()) {
    s += fmt::format(
        "device {} ({}): {} of weights resident; HBM copy {:.0f} GB/s, pinned H2D "
        "{:.1f} GB/s; hand-off {}{}{}{}{}\ndecode reads {:.3f} GB/token on the device and {:.3f} "
        "GB/token from DRAM{} -> hybrid bound {:.2f} tok/s\n",
        r.device, r.placement,
        r.gpu_weight_bytes >= 10'000'000
            ? fmt::format("{:.2f} GB", static_cast<double>(r.gpu_weight_bytes) / 1e9)
            : fmt::format("{:.2f} MB", static_cast<double>(r.gpu_weight_bytes) / 1e6),
        r.hbm_gbps, r.h2d_gbps, r.handoff,
        r.warm_workers_us > 0 ? fmt::format(" (workers warm {} us)", r.warm_workers_us) : "",
        r.stream_experts_min_tokens > 0
            ? fmt::format("; prefill streams CPU-held experts from {} tokens",
                          r.stream_experts_min_tokens)
            : "",
        r.host_experts_pinning.empty() ? ""
        : r.host_experts_pinning == "registered"
            ? std::string("; CPU-held experts read by the device in place (registered)")
            : std::string("; CPU-held experts read by the device from a pinned copy"),
        r.options.host_expert_share > 0
            ? fmt::format("; host expert share {}", r.options.host_expert_share)
            : "",
        static_cast<double>(r.decode_gpu_bytes) / 1e9,
        static_cast<double>(r.decode_cpu_bytes) / 1e9,
        r.decode_share_bytes > 0
            ? fmt::format(", the device {:.3f} GB/token of CPU-held experts over PCIe",
                          static_cast<double>(r.decode_share_bytes) / 1e9)
            : "",
        r.hybrid_bound_tok_s);
    // Only the phases that ran.
    std::string busy;
    if (r.options.n_gen > 0) busy += fmt::format("tg {:.0f}%", 100 * r.tg_cpu_busy);
    if (r.options.n_prompt > 0)
      busy += fmt::format("{}pp {:.0f}%", busy.empty() ? "" : ", ", 100 * r.pp_cpu_busy);
    s += fmt::format("CPU segments busy: {} of the step\n", busy);
    if (r.tg_device_busy > 0)
      s += fmt::format(
          "device busy: tg {:.0f}% of the step (the same steps with the CPU segments skipped: "
          "device ops plus hand-offs){}\n",
          100 * r.tg_device_busy,
          r.tg_device_busy > 1
              ? "; over 100%: the re-timed steps ran slower than the real ones (noise: more -r)"
              : "");
  }
  if (r.options.n_gen > 0)
    s += fmt::format("decode reaches {:.0f}% of the {}bound\n", 100 * r.fraction_of_bound,
                     r.device.empty() ? "DRAM " : "hybrid ");
  if (r.tg_moe.calls > 0) {
    const auto& m = r.tg_moe;
    s += fmt::format(
        "tg moe_experts on the CPU, mean per call: {:.1f} us = {:.1f} before + {:.1f} region + "
        "{:.1f} after; per thread in the region ({:.1f} threads): join {:.1f} us, waits {:.1f} "
        "us, tail {:.1f} us\n",
        m.total_us, m.before_us, m.region_us, m.after_us, m.threads, m.join_us, m.wait_us,
        m.tail_us);
  }
  auto prof = [&](const char* what, const std::vector<OpShare>& p) {
    // Nothing measured: no table.
    if (std::none_of(p.begin(), p.end(), [](const OpShare& o) { return o.seconds > 0; })) return;
    s += fmt::format("\n{} time by op (per run):\n", what);
    for (const OpShare& o : p)
      s += fmt::format("  {:<16} {:10.4f} s {:6.1f}%\n", o.kind, o.seconds, 100 * o.fraction);
  };
  prof(r.device.empty() ? "pp" : "pp CPU", r.pp_profile);
  prof(r.device.empty() ? "tg" : "tg CPU", r.tg_profile);
  prof("pp device", r.pp_gpu_profile);
  prof("tg device", r.tg_gpu_profile);
  return s;
}

}  // namespace berth::bench
