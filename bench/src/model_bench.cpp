#include "berth/bench/model_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <span>

#include "berth/backends/thread_pool.h"
#include "berth/bench/disk_bench.h"
#include "berth/core/error.h"
#include "berth/core/log.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/residency/expert_slots.h"
#include "berth/residency/routing_trace.h"
#include "berth/runtime/placed.h"
#include "berth/runtime/routing_io.h"
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

// A size for model_type from the parameter count: "293K", "7.6B", "30.5B", "236B".
std::string size_label(int64_t n) {
  const double x = static_cast<double>(n);
  if (x >= 1e11) return fmt::format("{:.0f}B", x / 1e9);
  if (x >= 1e9) return fmt::format("{:.1f}B", x / 1e9);
  if (x >= 1e6) return fmt::format("{:.0f}M", x / 1e6);
  return fmt::format("{:.0f}K", x / 1e3);
}

// The file type as llama.cpp names it: general.file_type (llama.cpp's enum llama_ftype) or, in
// a file without it, the type of most of the matrices' bytes ("all F32", "Q8_0").
std::string file_type_text(const gguf::File& file) {
  const std::optional<int64_t> ft = file.get_int_opt("general.file_type");
  if (!ft) {
    std::map<GgmlType, uint64_t> bytes;
    for (const gguf::TensorInfo& t : file.tensors())
      if (t.ne[1] > 1) bytes[t.type] += t.n_bytes;
    if (bytes.empty()) return "all F32";
    const GgmlType top =
        std::max_element(bytes.begin(), bytes.end(), [](const auto& a, const auto& b) {
          return a.second < b.second;
        })->first;
    std::string name(type_name(top));
    for (char& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return top == GgmlType::F32 ? "all F32" : name;
  }
  static const std::pair<int64_t, const char*> names[] = {
      {0, "all F32"},        {1, "F16"},
      {2, "Q4_0"},           {3, "Q4_1"},
      {7, "Q8_0"},           {8, "Q5_0"},
      {9, "Q5_1"},           {10, "Q2_K - Medium"},
      {11, "Q3_K - Small"},  {12, "Q3_K - Medium"},
      {13, "Q3_K - Large"},  {14, "Q4_K - Small"},
      {15, "Q4_K - Medium"}, {16, "Q5_K - Small"},
      {17, "Q5_K - Medium"}, {18, "Q6_K"},
      {32, "BF16"}};
  for (const auto& [id, name] : names)
    if (id == *ft) return name;
  return fmt::format("file type {}", *ft);
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return date;
}

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

// Per decode token, the bytes of the routed experts whose stacked tensors are on `side`
// (n_expert_used of n_expert experts' slices per MoE layer).
uint64_t routed_expert_bytes(const Model& m, const std::vector<placement::Home>& home,
                             placement::Home side) {
  const graph::Graph g = m.build_step(1, 1);
  const graph::WeightTable& w = m.weights();
  uint64_t bytes = 0;
  for (const graph::Op& op : g.ops)
    if (op.kind == graph::OpKind::moe_experts)
      for (graph::WeightId id : {op.moe.gate, op.moe.up, op.moe.down})
        if (home[static_cast<size_t>(id)] == side)
          bytes += w[id].n_bytes / static_cast<uint64_t>(op.moe.n_expert) *
                   static_cast<uint64_t>(op.moe.n_expert_used);
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

std::vector<OpShare> shares(const std::vector<CpuExecutor::OpTime>& prof, int runs) {
  double total = 0;
  for (const auto& p : prof) total += p.seconds;
  std::vector<OpShare> out;
  for (const auto& p : prof)
    out.push_back({p.kind, p.seconds / runs, total > 0 ? p.seconds / total : 0});
  return out;
}

}  // namespace

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

void set_step_options(const ModelBenchOptions& o, SessionParams& sp) {
  if (o.warm_workers_us >= 0) sp.hybrid.warm_workers_us = o.warm_workers_us;
  if (o.handoff == "flags")
    sp.hybrid.handoff = Handoff::flags;
  else if (o.handoff == "callback")
    sp.hybrid.handoff = Handoff::callback;
  else if (o.handoff != "auto")
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("--handoff must be auto, flags or callback, got '{}'", o.handoff));
}

ModelBenchResult run_model_bench(const ModelBenchOptions& options) {
  ModelBenchOptions o = options;
  o.progress = nullptr;
  o.on_test = nullptr;
  const TestLists& lists = o.tests;
  auto all_at_least = [](const std::vector<int>& v, int m) {
    return std::all_of(v.begin(), v.end(), [m](int x) { return x >= m; });
  };
  if (!all_at_least(lists.n_prompt, 0) || !all_at_least(lists.n_gen, 0) ||
      !all_at_least(lists.n_depth, 0) || o.repetitions < 1)
    throw Error(ErrorCategory::invalid_argument,
                "bench model: -p, -n and -d must be >= 0 and -r >= 1");
  if (lists.n_batch.empty() || lists.n_ubatch.empty() || lists.n_depth.empty() ||
      !all_at_least(lists.n_batch, 1) || !all_at_least(lists.n_ubatch, 1))
    throw Error(ErrorCategory::invalid_argument, "bench model: -b and -ub must be >= 1");
  for (const PromptGen& pg : lists.pg)
    if (pg.n_prompt < 0 || pg.n_gen < 0 || (pg.n_prompt == 0 && pg.n_gen == 0))
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("bench model: -pg {},{} is not a test", pg.n_prompt, pg.n_gen));
  const std::vector<BenchTest> planned = expand_tests(lists);
  if (planned.empty())
    throw Error(ErrorCategory::invalid_argument,
                "bench model: -p 0 and -n 0 (and no -pg) leave nothing to measure");
  auto say = [&](const std::string& s) {
    if (options.progress) options.progress(s);
  };
  ModelBenchResult r;
  r.machine = machine_info();
  r.planned = planned;
  for (size_t i = 0; i < planned.size(); ++i) {
    if (r.pp_test < 0 && planned[i].is_pp()) r.pp_test = static_cast<int>(i);
    if (r.tg_test < 0 && planned[i].is_tg()) r.tg_test = static_cast<int>(i);
  }
  gguf::File file = gguf::File::open(o.model_path);
  std::unique_ptr<Model> model = load_model(file);
  const Hparams& hp = model->hparams();
  r.arch = hp.arch;
  r.model_name = file.get_string_opt("general.name").value_or("");
  for (const gguf::TensorInfo& t : file.tensors()) {
    r.n_params += t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3];
    r.weight_bytes += t.n_bytes;
  }
  r.model_type = fmt::format("{} {} {}", r.arch, size_label(r.n_params), file_type_text(file));
  r.n_layer = hp.n_layer;
  r.n_expert = hp.n_expert;
  r.n_expert_used = hp.n_expert_used;

  int64_t n_ctx = 16;
  for (const BenchTest& t : planned) {
    if (t.n_ctx() > hp.n_ctx_train) {
      std::string terms;
      auto term = [&](bool on, const std::string& s) {
        if (on) terms += (terms.empty() ? "" : " + ") + s;
      };
      term(t.n_depth > 0, fmt::format("-d {}", t.n_depth));
      const bool pg = !t.is_pp() && !t.is_tg();
      term(pg, fmt::format("-pg {},{}", t.n_prompt, t.n_gen));
      term(!pg && t.n_prompt > 0, fmt::format("-p {}", t.n_prompt));
      term(!pg && t.n_gen > 0, fmt::format("-n {}", t.n_gen));
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("bench model: the test {} needs {} tokens of context ({}), more "
                              "than the model's context_length {}",
                              t.name(), t.n_ctx(), terms, hp.n_ctx_train));
    }
    n_ctx = std::max(n_ctx, t.n_ctx());
  }
  SessionParams sp;
  sp.n_threads = o.n_threads;
  sp.n_ctx = n_ctx;
  // Steps never exceed the largest ubatch the tests run (each eval below is one ubatch).
  sp.n_ubatch = max_step_tokens(planned);
  sp.hybrid.stream_experts_min_tokens = o.stream_min_tokens;  // before place(): they need room
  sp.hybrid.host_expert_share = o.host_expert_share;
  sp.hybrid.stream_rates = parse_stream_split(o.stream_split, sp.hybrid.stream_split);
  sp.hybrid.expert_slots.max_swaps_per_step = o.residency_swaps;
  if (!o.residency_policy.empty())
    sp.hybrid.expert_slots.policy = make_slot_policy(o.residency_policy);
  PlacementSetup placed = place(*model, o.placement, sp, static_cast<bool>(options.progress));
  use_disk_tier(file, *model, placed.plan, sp);
  set_step_options(o, sp);
  for (const std::string& note :
       device_option_notes(*model, sp, o.handoff != "auto", o.warm_workers_us >= 0))
    log::warn("{}", note);
  r.placement = placed.plan.how;
  r.backend = "CPU";
  if (sp.device) {
    r.device = sp.device->name();
    r.gpu_weight_bytes = placed.plan.gpu_weight_bytes;
    r.unified = sp.unified;
    r.unified_over_bus = sp.unified && !sp.device->info().unified;
    const size_t kind =
        r.device.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz");
    r.backend = kind == 0 ? r.device : r.device.substr(0, kind);
    say(placed.summary());
  }
  Session session(*model, sp);
  if (!o.routing_trace.empty()) {
    const residency::TraceShape shape = routing_shape(*model, false);
    auto replay = std::make_shared<residency::RoutingReplay>(
        residency::read_routing_trace(o.routing_trace), o.routing_trace, shape.blocks,
        shape.n_expert, shape.n_expert_used);
    r.routing_trace_tokens = replay->trace().n_tokens();
    attach_routing(session, *model, replay, nullptr);
    say(
        fmt::format("routing forced from the trace {} ({} tokens; the run's token i takes its "
                    "token i mod {}): only the routers' picks change",
                    o.routing_trace, r.routing_trace_tokens, r.routing_trace_tokens));
  }
  const ExpertSlots* slots = session.residency() ? session.residency()->expert_slots() : nullptr;
  const auto slot_counts = [&] {
    ModelBenchResult::ResidencyWindow w;
    if (!slots) return w;
    const ExpertSlots::Stats st = slots->stats();
    w.calls = st.calls;
    w.device_calls = st.device_calls;
    w.swaps = st.swaps;
    w.bytes_moved = st.bytes_moved;
    return w;
  };
  const auto minus = [](ModelBenchResult::ResidencyWindow a,
                        const ModelBenchResult::ResidencyWindow& b) {
    a.calls -= b.calls;
    a.device_calls -= b.device_calls;
    a.swaps -= b.swaps;
    a.bytes_moved -= b.bytes_moved;
    return a;
  };
  r.tg_residency.slots = slots != nullptr;
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
  r.options = o;
  auto reset_gpu = [&] {
    if (session.device()) session.scheduler().reset_gpu_profile();
  };
  auto gpu_shares = [&] {
    return session.device() ? shares(session.scheduler().gpu_profile(), o.repetitions)
                            : std::vector<OpShare>{};
  };
  using clock = std::chrono::steady_clock;
  auto seconds_since = [](clock::time_point t0) {
    return std::chrono::duration<double>(clock::now() - t0).count();
  };
  // Evaluates `t` in the test's batches and ubatches, one eval (one step) per ubatch; adds the
  // CPU segments' seconds to *cpu_s.
  auto eval_steps = [&](std::span<const int32_t> t, const BenchTest& bt, double* cpu_s) {
    size_t at = 0;
    for (int u : ubatch_sizes(static_cast<int>(t.size()), bt.n_batch, bt.n_ubatch)) {
      (void)session.eval(t.subspan(at, static_cast<size_t>(u)));
      at += static_cast<size_t>(u);
      if (cpu_s && session.device()) *cpu_s += session.scheduler().last_cpu_seconds();
    }
  };
  // The depth context: one token sequence (its own generator), so the positions one test leaves
  // filled serve the next; positions 0 .. filled-1 hold its first `filled` tokens.
  std::mt19937_64 depth_rng(o.seed ^ 0x9e3779b97f4a7c15ull);
  std::vector<int32_t> depth_tokens;
  int64_t filled = 0;
  // A model with recurrent layers (Qwen3.5) cannot cut its state back to `filled`
  // (Session::truncate): the state there is saved once the depth is filled and written back
  // before each run (Session::rewind); a shallower depth than the one filled starts from 0.
  const bool recurrent = !session.can_truncate();
  std::vector<float> depth_state;
  auto to_depth = [&](const BenchTest& t) {
    if (recurrent && t.n_depth < filled) filled = 0;
    filled = std::min<int64_t>(filled, t.n_depth);
    if (recurrent && filled > 0)
      session.rewind(filled, depth_state);
    else
      session.truncate(filled);
    if (filled == t.n_depth) return;
    while (static_cast<int64_t>(depth_tokens.size()) < t.n_depth)
      depth_tokens.push_back(static_cast<int32_t>(depth_rng() % static_cast<uint64_t>(hp.n_vocab)));
    const auto t0 = clock::now();
    eval_steps(std::span<const int32_t>(depth_tokens)
                   .subspan(static_cast<size_t>(filled), static_cast<size_t>(t.n_depth - filled)),
               t, nullptr);
    say(fmt::format("d{}  context filled in {:.2f} s", t.n_depth, seconds_since(t0)));
    filled = t.n_depth;
    if (recurrent) depth_state = session.kv().save_state(0);
  };
  // One run of a test after its depth: returns its seconds, adds CPU segment seconds to cpu_s.
  // windows: where the decode steps' residency windows go (null: not recorded).
  auto run_once = [&](const BenchTest& t, double& cpu_s,
                      std::vector<ModelBenchResult::ResidencyWindow>* windows) {
    to_depth(t);
    const std::vector<int32_t> p = tokens(t.n_prompt), g = tokens(t.n_gen);
    const auto t0 = clock::now();
    eval_steps(p, t, &cpu_s);
    ModelBenchResult::ResidencyWindow at = slot_counts();
    int64_t first = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      (void)session.eval(std::span<const int32_t>(&g[i], 1));
      if (session.device()) cpu_s += session.scheduler().last_cpu_seconds();
      const auto n = static_cast<int64_t>(i + 1);
      if (windows && (n - first == o.residency_window || i + 1 == g.size())) {
        const ModelBenchResult::ResidencyWindow now = slot_counts();
        ModelBenchResult::ResidencyWindow w = minus(now, at);
        w.first_token = first;
        w.n_tokens = n - first;
        windows->push_back(w);
        at = now;
        first = n;
      }
    }
    return seconds_since(t0);
  };

  for (size_t i = 0; i < planned.size(); ++i) {
    const BenchTest& t = planned[i];
    const bool is_pp = static_cast<int>(i) == r.pp_test, is_tg = static_cast<int>(i) == r.tg_test;
    TestResult tr;
    tr.test = t;
    tr.test_time = utc_now();
    std::vector<double> secs;
    ModelBenchResult::ResidencyWindow slots_before;
    for (int rep = 0; rep <= o.repetitions; ++rep) {
      if (rep == 1 && (is_pp || is_tg)) session.executor().reset_profile(), reset_gpu();
      if (rep == 1 && is_pp && session.device()) session.scheduler().reset_stream_split_stats();
      if (rep == 1 && is_tg && session.disk_tier()) session.disk_tier()->reset_stats();
      if (rep == 1 && is_tg) slots_before = slot_counts();
      double cpu_s = 0;
      const bool last_tg = is_tg && slots && rep == o.repetitions;
      if (last_tg) r.tg_residency.windows.clear();
      const double s = run_once(t, cpu_s, last_tg ? &r.tg_residency.windows : nullptr);
      if (rep > 0) {
        secs.push_back(s);
        tr.samples_ns.push_back(static_cast<uint64_t>(std::llround(s * 1e9)));
        if (session.device()) tr.cpu_busy += cpu_s / s / o.repetitions;
      }
      say(fmt::format("{}   run {}{}  {:8.2f} tok/s", t.name(), rep, rep ? "" : " (warm-up)",
                      (t.n_prompt + t.n_gen) / s));
    }
    filled = t.n_depth;
    tr.stats = test_stats(t, tr.samples_ns);
    if (is_pp) {
      r.pp_tok_s = rate_of(secs, t.n_prompt);
      r.pp_cpu_busy = tr.cpu_busy;
      r.pp_profile = shares(session.executor().profile(), o.repetitions);
      r.pp_gpu_profile = gpu_shares();
      if (session.device()) {
        const Scheduler& sch = session.scheduler();
        const Scheduler::StreamSplitStats& ss = sch.stream_split_stats();
        r.pp_split = {.layer_steps = ss.layer_steps,
                      .experts_cpu = ss.experts_cpu,
                      .experts_streamed = ss.experts_streamed,
                      .cpu_calls = ss.cpu_calls,
                      .calls = ss.calls,
                      .bytes_streamed = ss.bytes_streamed,
                      .bytes_whole = ss.bytes_whole,
                      .pcie_gbps = sch.stream_rates().pcie_gbps,
                      .dram_gbps = sch.stream_rates().dram_gbps,
                      .cpu_gflops = sch.stream_rates().cpu_gflops,
                      .cpu_scale = sch.stream_cpu_scale()};
      }
    }
    if (is_tg) {
      r.tg_tok_s = rate_of(secs, t.n_gen);
      if (slots) {
        // The timed runs' prompts count too: a tg test has none unless -pg.
        r.tg_residency.total = minus(slot_counts(), slots_before);
        r.tg_residency.total.n_tokens = int64_t{t.n_gen} * o.repetitions;
      }
      r.tg_cpu_busy = tr.cpu_busy;
      r.tg_profile = shares(session.executor().profile(), o.repetitions);
      r.tg_gpu_profile = gpu_shares();
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
      if (DiskTier* d = session.disk_tier()) {
        const DiskTier::Stats st = d->stats();
        auto& x = r.disk;
        x.tokens = static_cast<int64_t>(t.n_gen) * o.repetitions;
        x.calls = st.calls, x.hits = st.hits, x.reads_demand = st.reads_demand;
        x.reads_ahead = st.reads_ahead, x.ahead_used = st.ahead_used;
        x.bytes_per_token = static_cast<double>(st.bytes_read) / std::max<int64_t>(1, x.tokens);
        x.ahead_hit_rate = st.ahead_hit_rate();
        x.predictions = st.predictions, x.predictions_read = st.predictions_read;
        x.prediction_precision = st.prediction_precision();
        x.achieved_gbps = st.bandwidth() / 1e9;
        x.wait_s_per_token = st.wait_seconds / std::max<int64_t>(1, x.tokens);
      }
      if (session.device() && r.tg_cpu_busy > 0) {
        // The device alone: the same steps with the CPU segments skipped (timing only; the
        // outputs and the KV rows they write are wrong, so the cache is cut back to the depth
        // after), as many runs as above, median over median.
        std::vector<double> alone;
        session.scheduler().set_skip_cpu_segments(true);
        try {
          for (int rep = 0; rep < o.repetitions; ++rep) {
            session.truncate(t.n_depth);
            const std::vector<int32_t> g = tokens(t.n_gen);
            const auto t0 = clock::now();
            for (int32_t id : g) (void)session.eval(std::span<const int32_t>(&id, 1));
            alone.push_back(seconds_since(t0));
          }
        } catch (...) {
          session.scheduler().set_skip_cpu_segments(false);
          throw;
        }
        session.scheduler().set_skip_cpu_segments(false);
        session.truncate(t.n_depth);
        const double alone_tok_s = rate_of(alone, t.n_gen).median;
        r.tg_device_busy = alone_tok_s > 0 ? r.tg_tok_s.median / alone_tok_s : 0;
        say(fmt::format("{}   device alone  {:8.2f} tok/s", t.name(), alone_tok_s));
      }
    }
    r.tests.push_back(std::move(tr));
    if (options.on_test) options.on_test(r, r.tests.back());
  }
  if (DiskTier* d = session.disk_tier()) {
    auto& x = r.disk;
    x.used = true;
    x.backend = std::string(io::backend_name(d->reader().backend()));
    x.layers = d->n_layers();
    x.slots_per_layer = d->slots_per_layer();
    x.arena_bytes = d->arena_bytes();
    const DiskTierLayer& l0 = sp.disk.layers.front();
    x.read_bytes_per_expert = 0;
    size_t slice = 0;
    for (graph::WeightId id : l0.weights) {
      const TensorView& w = model->weights()[id];
      slice = std::max<size_t>(slice, w.n_bytes / static_cast<size_t>(w.ne[2]));
      x.read_bytes_per_expert += w.n_bytes / static_cast<size_t>(w.ne[2]);
    }
    if (o.disk_bench_seconds > 0) {
      DiskBenchOptions db;
      db.path = o.model_path;
      db.queue_depth = 32;
      db.block_bytes = {(slice + 4095) / 4096 * 4096};
      db.seconds = o.disk_bench_seconds;
      const DiskBenchResult dr = run_disk_bench(db);
      for (const DiskBenchSummary& m : dr.summary)
        if (m.method == "io_uring O_DIRECT" && m.depth == 32) x.drive_gbps = m.gbps_median;
      if (x.drive_gbps <= 0) log::warn("--disk-bench: no io_uring O_DIRECT run ({})", dr.io_uring);
      x.fraction = x.drive_gbps > 0 ? x.achieved_gbps / x.drive_gbps : 0;
      say(fmt::format("disk   O_DIRECT QD32 {} KiB reads  {:8.2f} GB/s", db.block_bytes[0] / 1024,
                      x.drive_gbps));
    }
  }
  const size_t llc = r.machine.llc_bytes;
  r.dram =
      measure_dram_bandwidth(r.n_threads, o.dram_bytes ? o.dram_bytes : std::max(kGiB, 8 * llc),
                             std::max(3, o.repetitions));
  say(fmt::format("dram   threads {:>3}  {:8.2f} GB/s", r.n_threads, r.dram.gbps.median));

  // The decode bytes of the first tg test: the KV rows at its average position, depth included.
  const BenchTest* tg = r.tg_test >= 0 ? &planned[static_cast<size_t>(r.tg_test)] : nullptr;
  const uint64_t kv_positions_x2 =
      tg ? 2 * static_cast<uint64_t>(tg->n_depth) + static_cast<uint64_t>(tg->n_gen) + 1 : 1;
  r.decode_weight_bytes = decode_weight_bytes(*model);
  uint64_t kv_row = 0;
  for (const KvLayer& l : model->kv_layers())
    kv_row += static_cast<uint64_t>(l.k_dim + l.v_dim) * 4;
  r.decode_kv_bytes = kv_row * kv_positions_x2 / 2;
  for (const KvLayer& l : model->kv_layers())
    r.decode_state_bytes += 2 * static_cast<uint64_t>(l.conv_dim + l.ssm_dim) * 4;
  const double bytes =
      static_cast<double>(r.decode_weight_bytes + r.decode_kv_bytes + r.decode_state_bytes);
  r.bound_tok_s = r.dram.gbps.median * 1e9 / bytes;
  if (tg) {
    r.fraction_of_bound = r.tg_tok_s.median / r.bound_tok_s;
    r.decode_gbps = r.tg_tok_s.median * bytes / 1e9;
  }
  if (sp.device) {
    Device& dev = *sp.device;
    const auto& home = placed.plan.home;
    uint64_t kv_gpu = 0, kv_cpu = 0;
    const auto kvl = model->kv_layers();
    for (size_t l = 0; l < kvl.size(); ++l) {
      const uint64_t avg = static_cast<uint64_t>(kvl[l].k_dim + kvl[l].v_dim) * kv_positions_x2 / 2;
      // The recurrent state, read and written, where the layer's KV cache is (f32 either side).
      const uint64_t state = 2 * static_cast<uint64_t>(kvl[l].conv_dim + kvl[l].ssm_dim) * 4;
      if (placed.plan.kv_home[l] == placement::Home::gpu)
        kv_gpu += avg * 2 + state;  // f16 rows
      else
        kv_cpu += avg * 4 + state;  // f32 rows
    }
    r.decode_gpu_bytes = decode_weight_bytes(*model, &home, placement::Home::gpu) + kv_gpu;
    r.decode_cpu_bytes = decode_weight_bytes(*model, &home, placement::Home::cpu) + kv_cpu;
    if (!r.host_experts_pinning.empty()) {
      r.decode_share_bytes = decode_share_bytes(*model, home, o.host_expert_share);
      r.decode_cpu_bytes -= r.decode_share_bytes;
    }
    if (r.tg_residency.slots && r.tg_residency.total.calls > 0) {
      // Expert slots serve a measured share of the CPU-held routed calls from device memory:
      // that share of the routed bytes moves to the device's side of the bound, and the copies
      // into slots read host DRAM (per token, as measured).
      const ModelBenchResult::ResidencyWindow& t = r.tg_residency.total;
      const double f = t.device_fraction();
      const auto moved = static_cast<uint64_t>(
          f * static_cast<double>(routed_expert_bytes(*model, home, placement::Home::cpu)));
      r.decode_slot_bytes = moved;
      r.decode_cpu_bytes -= std::min(moved, r.decode_cpu_bytes);
      r.decode_gpu_bytes += moved;
      r.decode_swap_bytes =
          static_cast<uint64_t>(static_cast<double>(t.bytes_moved) /
                                static_cast<double>(std::max<int64_t>(1, t.n_tokens)));
      r.decode_cpu_bytes += r.decode_swap_bytes;
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
    // --unified on a discrete GPU: the weights it computes cross the bus at every step.
    const uint64_t over_bus =
        r.unified_over_bus ? decode_weight_bytes(*model, &home, placement::Home::gpu) : 0;
    const double t = std::max(static_cast<double>(r.decode_cpu_bytes) / (r.dram.gbps.median * 1e9),
                              static_cast<double>(r.decode_share_bytes) / (r.h2d_gbps * 1e9)) +
                     static_cast<double>(r.decode_gpu_bytes - over_bus) / (r.hbm_gbps * 1e9) +
                     static_cast<double>(over_bus) / (r.h2d_gbps * 1e9);
    r.hybrid_bound_tok_s = t > 0 ? 1.0 / t : 0;
    if (tg) r.fraction_of_bound = r.tg_tok_s.median / r.hybrid_bound_tok_s;
  }
  r.options = o;
  return r;
}

namespace {

nlohmann::json residency_json(const ModelBenchResult& r) {
  if (!r.tg_residency.slots) return nullptr;
  const auto one = [](const ModelBenchResult::ResidencyWindow& w) {
    const double n = static_cast<double>(std::max<int64_t>(1, w.n_tokens));
    return nlohmann::json{{"first_token", w.first_token},
                          {"n_tokens", w.n_tokens},
                          {"routed_calls", w.calls},
                          {"device_calls", w.device_calls},
                          {"device_fraction", w.device_fraction()},
                          {"swaps", w.swaps},
                          {"swaps_per_token", static_cast<double>(w.swaps) / n},
                          {"bytes_moved", w.bytes_moved},
                          {"bytes_moved_per_token", static_cast<double>(w.bytes_moved) / n}};
  };
  nlohmann::json windows = nlohmann::json::array();
  for (const auto& w : r.tg_residency.windows) windows.push_back(one(w));
  return {{"total", one(r.tg_residency.total)}, {"windows", windows}};
}

}  // namespace

nlohmann::json to_json(const ModelBenchResult& r) {
  using nlohmann::json;
  auto prof = [](const std::vector<OpShare>& p) {
    json a = json::array();
    for (const OpShare& s : p)
      a.push_back({{"op", s.kind}, {"seconds", s.seconds}, {"fraction", s.fraction}});
    return a;
  };
  const MachineInfo& m = r.machine;
  const BenchTest* pp = r.pp_test >= 0 ? &r.planned[static_cast<size_t>(r.pp_test)] : nullptr;
  const BenchTest* tg = r.tg_test >= 0 ? &r.planned[static_cast<size_t>(r.tg_test)] : nullptr;
  const BenchTest first = r.planned.empty() ? BenchTest{} : r.planned.front();
  json tests = json::array();
  for (const TestResult& t : r.tests) tests.push_back(json(test_record(r, t)));
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
        {"n_prompt", pp ? pp->n_prompt : 0},
        {"n_gen", tg ? tg->n_gen : 0},
        {"n_depth", first.n_depth},
        {"n_batch", first.n_batch},
        {"n_ubatch", first.n_ubatch},
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
      {"decode_state_bytes", r.decode_state_bytes},
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
      {"unified", r.unified},
      {"unified_over_bus", r.unified_over_bus},
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
      {"disk_tier", r.disk.used ? json{{"backend", r.disk.backend},
                                       {"layers", r.disk.layers},
                                       {"ram_slots_per_layer", r.disk.slots_per_layer},
                                       {"arena_bytes", r.disk.arena_bytes},
                                       {"read_bytes_per_expert", r.disk.read_bytes_per_expert},
                                       {"tg_tokens", r.disk.tokens},
                                       {"expert_uses", r.disk.calls},
                                       {"ram_hits", r.disk.hits},
                                       {"reads_on_demand", r.disk.reads_demand},
                                       {"reads_ahead", r.disk.reads_ahead},
                                       {"reads_ahead_used", r.disk.ahead_used},
                                       {"bytes_per_token", r.disk.bytes_per_token},
                                       {"ahead_hit_rate", r.disk.ahead_hit_rate},
                                       {"predictions", r.disk.predictions},
                                       {"predictions_read_ahead", r.disk.predictions_read},
                                       {"prediction_precision", r.disk.prediction_precision},
                                       {"achieved_gbps", r.disk.achieved_gbps},
                                       {"wait_s_per_token", r.disk.wait_s_per_token},
                                       {"drive_odirect_qd32_gbps", r.disk.drive_gbps},
                                       {"fraction_of_drive", r.disk.fraction}}
                                : json(nullptr)},
      {"stream_min_tokens", r.options.stream_min_tokens},
      {"host_expert_share", r.options.host_expert_share},
      {"warm_workers_us", r.warm_workers_us},
      {"handoff", r.handoff},
      {"stream_min_tokens_in_effect", r.stream_experts_min_tokens},
      {"stream_split", r.options.stream_split},
      {"pp_stream_split", r.pp_split.layer_steps > 0
                              ? json{{"layer_steps", r.pp_split.layer_steps},
                                     {"experts_cpu", r.pp_split.experts_cpu},
                                     {"experts_streamed", r.pp_split.experts_streamed},
                                     {"cpu_calls", r.pp_split.cpu_calls},
                                     {"calls", r.pp_split.calls},
                                     {"bytes_streamed", r.pp_split.bytes_streamed},
                                     {"bytes_whole", r.pp_split.bytes_whole},
                                     {"pcie_gbps", r.pp_split.pcie_gbps},
                                     {"dram_gbps", r.pp_split.dram_gbps},
                                     {"cpu_gflops", r.pp_split.cpu_gflops},
                                     {"cpu_scale", r.pp_split.cpu_scale}}
                              : json(nullptr)},
      {"host_experts_pinning", r.host_experts_pinning},
      {"decode_slot_bytes", r.decode_slot_bytes},
      {"decode_swap_bytes", r.decode_swap_bytes},
      {"routing_trace", r.options.routing_trace},
      {"residency_policy", r.options.residency_policy},
      {"routing_trace_tokens", r.routing_trace_tokens},
      {"tg_residency", residency_json(r)},
      {"pp_gpu_profile", prof(r.pp_gpu_profile)},
      {"tg_gpu_profile", prof(r.tg_gpu_profile)},
      {"pp_profile", prof(r.pp_profile)},
      {"tg_profile", prof(r.tg_profile)},
      {"tests", tests},
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
  // The first pp and tg tests, which the analysis below is about.
  std::string pp_name, tg_name;
  if (r.pp_test >= 0) pp_name = r.planned[static_cast<size_t>(r.pp_test)].name();
  if (r.tg_test >= 0) tg_name = r.planned[static_cast<size_t>(r.tg_test)].name();
  const size_t w = std::max<size_t>({10, pp_name.size(), tg_name.size()});
  const int n_analysed = (r.pp_test >= 0) + (r.tg_test >= 0);
  if (r.planned.size() > static_cast<size_t>(n_analysed) && n_analysed > 0)
    s += fmt::format("the first pp and tg test of the {}:\n", r.planned.size());
  s += fmt::format("{:<{}} {:>12} {:>12}\n", "test", w, "tok/s", "best");
  if (r.pp_test >= 0)
    s +=
        fmt::format("{:<{}} {:>12.2f} {:>12.2f}\n", pp_name, w, r.pp_tok_s.median, r.pp_tok_s.best);
  if (r.tg_test >= 0)
    s +=
        fmt::format("{:<{}} {:>12.2f} {:>12.2f}\n", tg_name, w, r.tg_tok_s.median, r.tg_tok_s.best);
  s += fmt::format(
      "\ndecode reads {:.3f} GB/token (weights {:.3f} + KV {:.4f}{}); DRAM {:.1f} GB/s "
      "-> bound {:.2f} tok/s\n",
      static_cast<double>(r.decode_weight_bytes + r.decode_kv_bytes + r.decode_state_bytes) / 1e9,
      static_cast<double>(r.decode_weight_bytes) / 1e9,
      static_cast<double>(r.decode_kv_bytes) / 1e9,
      r.decode_state_bytes > 0 ? fmt::format(" + recurrent state read and written {:.4f}",
                                             static_cast<double>(r.decode_state_bytes) / 1e9)
                               : "",
      r.dram.gbps.median, r.bound_tok_s);
  if (!r.device.empty()) {
    s += fmt::format(
        "device {} ({}): {} of weights {}; HBM copy {:.0f} GB/s, pinned H2D "
        "{:.1f} GB/s; hand-off {}{}{}{}{}\ndecode reads {:.3f} GB/token on the device and {:.3f} "
        "GB/token from DRAM{} -> hybrid bound {:.2f} tok/s\n",
        r.device, r.placement,
        r.gpu_weight_bytes >= 10'000'000
            ? fmt::format("{:.2f} GB", static_cast<double>(r.gpu_weight_bytes) / 1e9)
            : fmt::format("{:.2f} MB", static_cast<double>(r.gpu_weight_bytes) / 1e6),
        !r.unified           ? "resident"
        : r.unified_over_bus ? "read in place from host memory over the bus (--unified on)"
                             : "read in place (unified memory)",
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
    if (r.tg_test >= 0) busy += fmt::format("tg {:.0f}%", 100 * r.tg_cpu_busy);
    if (r.pp_test >= 0)
      busy += fmt::format("{}pp {:.0f}%", busy.empty() ? "" : ", ", 100 * r.pp_cpu_busy);
    if (!busy.empty()) s += fmt::format("CPU segments busy: {} of the step\n", busy);
    if (r.tg_device_busy > 0)
      s += fmt::format(
          "device busy: tg {:.0f}% of the step (the same steps with the CPU segments skipped: "
          "device ops plus hand-offs){}\n",
          100 * r.tg_device_busy,
          r.tg_device_busy > 1
              ? "; over 100%: the re-timed steps ran slower than the real ones (noise: more -r)"
              : "");
  }
  if (const auto& ps = r.pp_split; ps.layer_steps > 0) {
    const double n = static_cast<double>(ps.layer_steps);
    s += fmt::format(
        "prefill split (timed pp runs): per streamed layer and ubatch {:.1f} experts copied, "
        "{:.1f} "
        "left to the CPU ({:.1f}% of the routed calls); {:.1f}% of the expert bytes copied "
        "({:.1f} of {:.1f} MB per layer and ubatch); rates pcie {:.1f} GB/s, dram {:.1f} GB/s, "
        "cpu {:.0f} GFLOP/s x {:.2f}\n",
        static_cast<double>(ps.experts_streamed) / n, static_cast<double>(ps.experts_cpu) / n,
        ps.calls > 0 ? 100.0 * static_cast<double>(ps.cpu_calls) / static_cast<double>(ps.calls)
                     : 0.0,
        ps.bytes_whole > 0
            ? 100.0 * static_cast<double>(ps.bytes_streamed) / static_cast<double>(ps.bytes_whole)
            : 0.0,
        static_cast<double>(ps.bytes_streamed) / 1e6 / n,
        static_cast<double>(ps.bytes_whole) / 1e6 / n, ps.pcie_gbps, ps.dram_gbps, ps.cpu_gflops,
        ps.cpu_scale);
  }
  if (r.tg_test >= 0)
    s += fmt::format("decode reaches {:.0f}% of the {}bound\n", 100 * r.fraction_of_bound,
                     r.device.empty() ? "DRAM " : "hybrid ");
  if (r.routing_trace_tokens > 0)
    s += fmt::format("routing: forced from {} ({} tokens, repeated as needed)\n",
                     r.options.routing_trace, r.routing_trace_tokens);
  if (r.tg_residency.slots && r.tg_test >= 0) {
    const auto& t = r.tg_residency.total;
    const double n = static_cast<double>(std::max<int64_t>(1, t.n_tokens));
    s += fmt::format(
        "expert slots (tg, timed runs): {:.1f}% of routed calls on the device, {:.2f} swaps and "
        "{:.2f} MiB moved per token (the hybrid bound counts {:.3f} GB/token of routed experts "
        "on the device's side and the copies on the host's)\n",
        100 * t.device_fraction(), static_cast<double>(t.swaps) / n,
        static_cast<double>(t.bytes_moved) / n / (1024.0 * 1024.0),
        static_cast<double>(r.decode_slot_bytes) / 1e9);
    std::string line;
    for (const auto& w : r.tg_residency.windows)
      line += fmt::format(" {:.0f}%", 100 * w.device_fraction());
    if (!line.empty())
      s += fmt::format("  on the device per {} decode steps of the last run:{}\n",
                       r.options.residency_window, line);
  }
  if (r.tg_moe.calls > 0) {
    const auto& m = r.tg_moe;
    s += fmt::format(
        "tg moe_experts on the CPU, mean per call: {:.1f} us = {:.1f} before + {:.1f} region + "
        "{:.1f} after; per thread in the region ({:.1f} threads): join {:.1f} us, waits {:.1f} "
        "us, tail {:.1f} us\n",
        m.total_us, m.before_us, m.region_us, m.after_us, m.threads, m.join_us, m.wait_us,
        m.tail_us);
  }
  if (r.disk.used) {
    const auto& d = r.disk;
    s += fmt::format(
        "disk tier ({}, {} MoE layers x {} RAM slots, {:.1f} MiB): tg reads {:.2f} MB/token "
        "from disk ({:.1f} experts/token; {:.1f}% of expert uses hit RAM), read-ahead hit rate "
        "{:.1f}% ({} ahead, {} used; {} on demand; next-layer predictions {:.0f}% precise, {} of "
        "{} read ahead), achieved {:.2f} GB/s{}, waits {:.1f} ms/token\n",
        d.backend, d.layers, d.slots_per_layer, static_cast<double>(d.arena_bytes) / (1 << 20),
        d.bytes_per_token / 1e6,
        static_cast<double>(d.reads_demand + d.reads_ahead) /
            static_cast<double>(std::max<int64_t>(1, d.tokens)),
        d.calls > 0 ? 100.0 * static_cast<double>(d.hits) / static_cast<double>(d.calls) : 0.0,
        100 * d.ahead_hit_rate, d.reads_ahead, d.ahead_used, d.reads_demand,
        100 * d.prediction_precision, d.predictions_read, d.predictions, d.achieved_gbps,
        d.drive_gbps > 0
            ? fmt::format(" = {:.0f}% of the drive's O_DIRECT QD32 {:.2f} GB/s{}", 100 * d.fraction,
                          d.drive_gbps,
                          // O_DIRECT bypasses this machine's page cache, not one below it.
                          d.fraction > 1.05 ? " (more than the drive: a cache below this "
                                              "machine, e.g. a virtual disk's host page cache, "
                                              "served the tier's repeated reads)"
                                            : "")
            : std::string(),
        1e3 * d.wait_s_per_token);
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
