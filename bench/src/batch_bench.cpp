#include "berth/bench/batch_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>

#include "berth/backends/thread_pool.h"
#include "berth/core/error.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/residency/expert_slots.h"
#include "berth/runtime/placed.h"
#include "berth/runtime/session.h"

namespace berth::bench {
namespace {

using placement::Home;

// Device-to-device copy GB/s (bytes read + written): 1 GiB each way, or a quarter of what the
// device has free when that is less.
double hbm_gbps(Device& dev) {
  const size_t mib = size_t{1} << 20;
  const size_t n = std::min(size_t{1} << 30, dev.free_bytes() / 4 / mib * mib);
  void* a = dev.alloc(n, "bandwidth test");
  void* b = dev.alloc(n, "bandwidth test");
  const double gbps = copy_gbps(
      dev, [&] { dev.copy(kMain, b, a, n); }, 2.0 * static_cast<double>(n));
  dev.dealloc(a);
  dev.dealloc(b);
  return gbps;
}

}  // namespace

BatchBenchResult run_batch_bench(const BatchBenchOptions& options) {
  const ModelBenchOptions& o = options.model;
  if (options.parallel.empty())
    throw Error(ErrorCategory::invalid_argument, "bench model --parallel: no sequence count");
  for (int n : options.parallel)
    if (n < 1 || n > 4096)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("bench model --parallel: {} sequences (need 1..4096)", n));
  if (options.n_prompt < 1 || options.n_gen < 1 || o.repetitions < 1)
    throw Error(ErrorCategory::invalid_argument,
                "bench model --parallel: -p and -n must be >= 1 and -r >= 1");
  auto say = [&](const std::string& s) {
    if (o.progress) o.progress(s);
  };
  BatchBenchResult r;
  r.machine = machine_info();
  r.n_prompt = options.n_prompt;
  r.n_gen = options.n_gen;
  r.n_ctx = options.n_ctx;
  r.greedy = options.greedy;
  r.repetitions = o.repetitions;
  gguf::File file = gguf::File::open(o.model_path);
  std::unique_ptr<Model> model = load_model(file);
  const Hparams& hp = model->hparams();
  r.arch = hp.arch;
  r.model_name = file.get_string_opt("general.name").value_or("");
  const int64_t n_ctx = int64_t{options.n_prompt} + options.n_gen;
  if (n_ctx > hp.n_ctx_train)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("bench model --parallel: -p {} + -n {} = {} tokens per sequence exceed "
                            "the model's context_length {}",
                            options.n_prompt, options.n_gen, n_ctx, hp.n_ctx_train));
  for (const int n_seq : options.parallel) {
    if (options.n_ctx <= 0 || n_seq < 1) continue;
    const int64_t per = options.n_ctx / n_seq;
    if (per < n_ctx)
      throw Error(
          ErrorCategory::invalid_argument,
          fmt::format("bench model --parallel: -c {} gives each of {} sequences {} token{}, "
                      "fewer than -p {} + -n {}",
                      options.n_ctx, n_seq, per, per == 1 ? "" : "s", options.n_prompt,
                      options.n_gen));
    if (per > hp.n_ctx_train)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("bench model --parallel: -c {} / {} = {} tokens per sequence exceed "
                              "the model's context_length {}",
                              options.n_ctx, n_seq, per, hp.n_ctx_train));
  }
  if (options.n_ubatch < 1)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("bench model --parallel: -ub {} (need >= 1)", options.n_ubatch));
  r.n_threads = o.n_threads > 0 ? o.n_threads : physical_core_count();
  const size_t dram_bytes = o.dram_bytes > 0 ? o.dram_bytes : size_t{1} << 30;
  r.dram_gbps = measure_dram_bandwidth(r.n_threads, dram_bytes, 3).gbps.median;
  say(fmt::format("DRAM   {:.1f} GB/s read with {} threads", r.dram_gbps, r.n_threads));

  const graph::Graph g1 = model->build_step(1, 1);
  const graph::WeightTable& w = model->weights();
  std::mt19937_64 rng(o.seed);
  // bench serve's prompts (server/src/bench_serve.cpp): client q's generator, its requests'
  // prompts drawn one after another.
  std::vector<std::mt19937_64> serve_rng;
  auto serve_prompt = [&](size_t q, int n) {
    while (serve_rng.size() <= q) serve_rng.emplace_back(o.seed * 1000003u + serve_rng.size());
    std::uniform_int_distribution<int32_t> id(1, static_cast<int32_t>(hp.n_vocab - 1));
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (int32_t& x : t) x = id(serve_rng[q]);
    return t;
  };
  auto random_tokens = [&](size_t n) {
    std::vector<int32_t> t(n);
    for (int32_t& x : t) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(hp.n_vocab));
    return t;
  };

  for (const int n_seq : options.parallel) {
    serve_rng.clear();  // each N: a server of its own, its clients' generators fresh
    SessionParams sp;
    sp.n_threads = r.n_threads;
    sp.n_ctx = options.n_ctx > 0 ? options.n_ctx / n_seq : n_ctx;
    sp.n_seq = n_seq;
    sp.n_ubatch = options.n_ubatch;
    sp.hybrid.stream_experts_min_tokens = o.stream_min_tokens;
    sp.hybrid.host_expert_share = o.host_expert_share;
    sp.hybrid.expert_slots.max_swaps_per_step = o.residency_swaps;
    if (!o.residency_policy.empty())
      sp.hybrid.expert_slots.policy = make_slot_policy(o.residency_policy);
    PlacementSetup placed = place(*model, o.placement, sp, false);
    set_step_options(o, sp);
    r.placement = placed.plan.how;
    Session session(*model, sp);
    Device* dev = session.device();
    if (dev && r.hbm_gbps == 0) {
      r.device = dev->name();
      r.hbm_gbps = hbm_gbps(*dev);
      say(fmt::format("device {}: {:.0f} GB/s device-to-device", r.device, r.hbm_gbps));
    }
    auto side_of = [&](graph::WeightId id) {
      return dev && sp.weight_home[static_cast<size_t>(id)] == Home::gpu ? Home::gpu : Home::cpu;
    };
    // Bytes a step of n_seq decode tokens reads, but the routed experts (counted per run).
    double bytes[2] = {0, 0};  // host, device
    int64_t moe_layers_dev = 0, moe_layers = 0, per_expert_dev = 0;
    for (const graph::Op& op : g1.ops) {
      if (op.kind == graph::OpKind::moe_experts) {
        ++moe_layers;
        if (side_of(op.moe.gate) == Home::gpu) {
          ++moe_layers_dev;
          int64_t eb = 0;
          for (graph::WeightId id : {op.moe.gate, op.moe.up, op.moe.down})
            eb += static_cast<int64_t>(w[id].n_bytes / static_cast<size_t>(op.moe.n_expert));
          per_expert_dev = eb;  // the same shape in every layer
        }
        continue;
      }
      if (op.weight == graph::kNoWeight) continue;
      const double b =
          op.kind == graph::OpKind::embed
              ? static_cast<double>(row_bytes(w[op.weight].type, w[op.weight].ne[0])) * n_seq
              : static_cast<double>(w[op.weight].n_bytes);
      bytes[side_of(op.weight) == Home::gpu ? 1 : 0] += b;
    }
    const double avg_pos = options.n_prompt + options.n_gen / 2.0;
    const std::vector<KvLayer> kv_layers = model->kv_layers();
    for (int32_t l = 0; l < hp.n_layer; ++l) {
      const KvLayer& kl = kv_layers[static_cast<size_t>(l)];
      const bool on_dev = dev && sp.kv_home[static_cast<size_t>(l)] == Home::gpu;
      bytes[on_dev ? 1 : 0] +=
          avg_pos * static_cast<double>(kl.k_dim + kl.v_dim) * (on_dev ? 2.0 : 4.0) * n_seq;
      // A recurrent layer's state (f32, where its KV cache is), read and written per sequence.
      bytes[on_dev ? 1 : 0] += 2.0 * static_cast<double>(kl.conv_dim + kl.ssm_dim) * 4.0 * n_seq;
    }

    std::vector<int32_t> seqs(static_cast<size_t>(n_seq));
    for (int q = 0; q < n_seq; ++q) seqs[static_cast<size_t>(q)] = session.kv().acquire();
    if (dev) session.scheduler().set_profiling(o.profile);
    std::vector<double> secs;
    int64_t cpu_experts = 0, cpu_bytes = 0, dev_reads = 0, dev_bytes = 0;
    bool dev_counts = false;
    for (int rep = 0; rep <= o.repetitions; ++rep) {
      std::vector<int32_t> next(static_cast<size_t>(n_seq));  // greedy: each one's next token
      for (int q = 0; q < n_seq; ++q) {  // each prompt in steps of at most -ub tokens
        const std::vector<int32_t> p = options.greedy
                                           ? serve_prompt(static_cast<size_t>(q), options.n_prompt)
                                           : random_tokens(static_cast<size_t>(options.n_prompt));
        for (size_t i0 = 0; i0 < p.size(); i0 += static_cast<size_t>(options.n_ubatch)) {
          const size_t n = std::min(p.size() - i0, static_cast<size_t>(options.n_ubatch));
          std::vector<int32_t> pos(n), sq(n, seqs[static_cast<size_t>(q)]);
          for (size_t i = 0; i < n; ++i) pos[i] = static_cast<int32_t>(i0 + i);
          const std::span<const int32_t> chunk = std::span<const int32_t>(p).subspan(i0, n);
          if (options.greedy && i0 + n == p.size())
            next[static_cast<size_t>(q)] = session.eval_step_select(chunk, pos, sq, 1, 0)[0];
          else
            session.eval_step(chunk, pos, sq, 1, 0);
        }
      }
      session.executor().reset_moe_reads();
      if (dev && o.profile && rep == 1) session.scheduler().reset_gpu_profile();
      const DeviceInfo before = dev ? dev->info() : DeviceInfo{};
      std::vector<int32_t> pos(static_cast<size_t>(n_seq));
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < options.n_gen; ++i) {
        std::fill(pos.begin(), pos.end(), options.n_prompt + i);
        if (options.greedy) {  // each sequence's own greedy token, as a server's slot decodes
          const std::span<const int32_t> picked =
              session.eval_step_select(next, pos, seqs, n_seq, n_seq);
          std::copy(picked.begin(), picked.end(), next.begin());
        } else {
          const std::vector<int32_t> t = random_tokens(static_cast<size_t>(n_seq));
          session.eval_step(t, pos, seqs, n_seq, n_seq);  // one decode token per sequence
        }
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      // Progress only: the rows are the result's (format_text), on standard output.
      say(fmt::format("N={:<4} run {}{}  {:8.1f} tok/s", n_seq, rep, rep ? "" : " (warm-up)",
                      s > 0 ? static_cast<double>(n_seq) * options.n_gen / s : 0.0));
      if (rep == 0) continue;  // warm-up
      secs.push_back(s);
      const CpuExecutor::MoeReads& m = session.executor().moe_reads();
      cpu_experts += m.experts;
      cpu_bytes += m.bytes;
      if (dev) {
        const DeviceInfo after = dev->info();
        dev_counts = after.moe_expert_reads >= 0;
        if (dev_counts) {
          dev_reads += after.moe_expert_reads - before.moe_expert_reads;
          dev_bytes += after.moe_expert_bytes - before.moe_expert_bytes;
        }
      }
    }
    BatchRow row;
    row.n_seq = n_seq;
    if (dev && o.profile)
      for (const CpuExecutor::OpTime& p : session.scheduler().gpu_profile())
        row.device_profile.emplace_back(
            p.kind, p.seconds / (static_cast<double>(o.repetitions) * options.n_gen));
    row.agg_tok_s = rate_of(secs, static_cast<double>(n_seq) * options.n_gen);
    row.seq_tok_s = row.agg_tok_s.median / n_seq;
    const double steps = static_cast<double>(options.n_gen) * o.repetitions;
    double experts = static_cast<double>(cpu_experts);
    double expert_bytes_host = static_cast<double>(cpu_bytes) / steps;
    double expert_bytes_dev = 0;
    if (moe_layers_dev > 0) {
      if (dev_counts) {
        experts += static_cast<double>(dev_reads);
        expert_bytes_dev = static_cast<double>(dev_bytes) / steps;
      } else {
        const double bound =
            std::min<double>(static_cast<double>(n_seq) * hp.n_expert_used, hp.n_expert);
        experts += bound * static_cast<double>(moe_layers_dev) * steps;
        expert_bytes_dev = bound * static_cast<double>(moe_layers_dev * per_expert_dev);
        row.experts_exact = false;
      }
    }
    row.experts_per_layer =
        moe_layers > 0 ? experts / (static_cast<double>(moe_layers) * steps) : 0;
    row.host_bytes = bytes[0] + expert_bytes_host;
    row.device_bytes = bytes[1] + expert_bytes_dev;
    const double t =
        row.host_bytes / (r.dram_gbps * 1e9) +
        (row.device_bytes > 0 && r.hbm_gbps > 0 ? row.device_bytes / (r.hbm_gbps * 1e9) : 0.0);
    row.bound_tok_s = t > 0 ? n_seq / t : 0;
    row.fraction = row.bound_tok_s > 0 ? row.agg_tok_s.median / row.bound_tok_s : 0;
    r.rows.push_back(row);
  }
  return r;
}

nlohmann::json to_json(const BatchBenchResult& r) {
  nlohmann::json rows = nlohmann::json::array();
  for (const BatchRow& x : r.rows)
    rows.push_back({{"n_seq", x.n_seq},
                    {"agg_tok_s", x.agg_tok_s.median},
                    {"agg_tok_s_best", x.agg_tok_s.best},
                    {"seq_tok_s", x.seq_tok_s},
                    {"experts_per_layer", x.experts_per_layer},
                    {"experts_exact", x.experts_exact},
                    {"host_bytes_per_step", x.host_bytes},
                    {"device_bytes_per_step", x.device_bytes},
                    {"bound_tok_s", x.bound_tok_s},
                    {"fraction_of_bound", x.fraction}});
  return {{"machine", to_json(r.machine)},
          {"arch", r.arch},
          {"model", r.model_name},
          {"device", r.device},
          {"placement", r.placement},
          {"n_threads", r.n_threads},
          {"n_prompt", r.n_prompt},
          {"n_gen", r.n_gen},
          {"n_ctx", r.n_ctx},
          {"greedy", r.greedy},
          {"repetitions", r.repetitions},
          {"dram_gbps", r.dram_gbps},
          {"hbm_gbps", r.hbm_gbps},
          {"parallel", rows}};
}

std::string format_text(const BatchBenchResult& r) {
  std::string s = fmt::format(
      "model {} ({}), {} threads, {}{}; {} prompt tokens per sequence, {} decode steps{}, "
      "median of {}\nDRAM {:.1f} GB/s{}\n",
      r.model_name, r.arch, r.n_threads, r.device.empty() ? "CPU only" : r.device,
      r.placement.empty() ? "" : ", " + r.placement, r.n_prompt, r.n_gen,
      (r.n_ctx > 0 ? fmt::format(", -c {} (c / N per sequence)", r.n_ctx) : std::string()) +
          (r.greedy ? ", greedy tokens from bench serve's prompts" : ""),
      r.repetitions, r.dram_gbps,
      r.hbm_gbps > 0 ? fmt::format(", device {:.0f} GB/s", r.hbm_gbps) : "");
  s += fmt::format("{:>4} {:>12} {:>12} {:>14} {:>12} {:>12} {:>12} {:>9}\n", "N", "tok/s",
                   "tok/s/seq", "experts/layer", "host MB", "device MB", "bound tok/s", "of bound");
  for (const BatchRow& x : r.rows)
    s += fmt::format("{:>4} {:>12.1f} {:>12.1f} {:>13}{} {:>12.1f} {:>12.1f} {:>12.1f} {:>8.0f}%\n",
                     x.n_seq, x.agg_tok_s.median, x.seq_tok_s,
                     x.experts_per_layer > 0 ? fmt::format("{:.1f}", x.experts_per_layer)
                                             : std::string("-"),  // a dense model
                     x.experts_exact ? " " : "*", x.host_bytes / 1e6, x.device_bytes / 1e6,
                     x.bound_tok_s, 100 * x.fraction);
  if (std::any_of(r.rows.begin(), r.rows.end(), [](const BatchRow& x) { return !x.experts_exact; }))
    s += "* upper bound: the device does not count its expert reads\n";
  for (const BatchRow& x : r.rows) {
    if (x.device_profile.empty()) continue;
    double total = 0;
    for (const auto& [kind, sec] : x.device_profile) total += sec;
    s += fmt::format("\nN={} device time by op per decode step (no graph replay): {:.1f} us\n",
                     x.n_seq, 1e6 * total);
    for (const auto& [kind, sec] : x.device_profile)
      s += fmt::format("  {:<16} {:10.1f} us {:6.1f}%\n", kind, 1e6 * sec,
                       total > 0 ? 100 * sec / total : 0.0);
  }
  return s;
}

}  // namespace berth::bench
