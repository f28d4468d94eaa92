// `berth trace`: routing traces for residency benchmarks (residency/routing_trace.h for the
// format, residency/trace_gen.h for the generator, residency/cache_sim.h for the simulator).
//   berth trace gen --preset locality --tokens N -s SEED -o FILE   (prints its LRU hit rates)
//   berth trace stats FILE
//   berth trace dump FILE [--first T] [--count N]
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <optional>
#include <span>

#include "berth/core/error.h"
#include "berth/residency/cache_sim.h"
#include "berth/residency/routing_trace.h"
#include "berth/residency/trace_gen.h"
#include "commands.h"

namespace berth::cli {
namespace {

using namespace berth::residency;

struct TraceOptions {
  CLI::App *gen = nullptr, *stats = nullptr, *dump = nullptr;
  // gen
  std::string preset = "locality", out;
  int64_t tokens = 0, n_prompt = 0;
  uint64_t seed = 0;
  int64_t popularity_seed = -1;
  std::optional<int32_t> n_layer, n_expert, n_expert_used, window;
  std::optional<double> zipf, reuse, lag_exponent;
  // stats, dump
  std::string file;
  double half_life = 64.0;
  double margin = 0.0;
  int64_t first = 0, count = -1;
};

// One line per policy and cache size (12.5% and 25% of each layer's experts): the share of
// routed calls served and the loads per token (`trace stats`; `trace gen` with LRU alone).
std::string cache_lines(const RoutingTrace& tr, std::span<ExpertCachePolicy* const> policies) {
  std::string out;
  const int32_t n_expert = tr.shape.n_expert;
  for (ExpertCachePolicy* p : policies)
    for (double f : {0.125, 0.25}) {
      const int32_t cap = cache_capacity(f, n_expert);
      const CacheSimResult r = simulate_cache(tr, *p, cap);
      out += fmt::format(
          "{} cache of {:g}% ({} of {} experts per layer): {:.1f}% of routed calls served, "
          "{:.2f} loads per token\n",
          r.policy, 100.0 * f, cap, n_expert, 100.0 * r.hit_rate(), r.loads_per_token());
    }
  return out;
}

// `trace gen` simulates LRU on the trace it wrote up to this many bytes of ids in memory
// (about 1.4 million tokens of the qwen3-30b-a3b shape); beyond, `trace stats` does it.
constexpr uint64_t kGenStatsMaxBytes = uint64_t{1} << 30;

int trace_gen(const TraceOptions& o) {
  TraceGenSpec s = trace_preset(o.preset);
  if (o.n_layer) s.n_layer = *o.n_layer;
  if (o.n_expert) s.n_expert = *o.n_expert;
  if (o.n_expert_used) s.n_expert_used = *o.n_expert_used;
  if (o.zipf) s.zipf = *o.zipf;
  if (o.reuse) s.reuse = *o.reuse;
  if (o.window) s.window = *o.window;
  if (o.lag_exponent) s.lag_exponent = *o.lag_exponent;
  s.n_tokens = o.tokens;
  s.n_prompt = o.n_prompt;
  s.seed = o.seed;
  s.popularity_seed = o.popularity_seed;
  validate_trace_gen_spec(s);
  write_generated_trace(s, o.out);
  TraceShape shape;
  shape.n_layer = s.n_layer;
  shape.n_expert = s.n_expert;
  shape.n_expert_used = s.n_expert_used;
  const double mb =
      static_cast<double>(shape.data_offset() + s.n_tokens * shape.record_bytes()) / 1e6;
  (void)write_stdout(fmt::format(
      "{}: '{}' routing trace (zipf {:g}, reuse {:g}, window {}, lag exponent {:g}), {} tokens "
      "({} prefill), {} MoE layers x {} experts, top-{}, seed {}, {:.1f} MB\n",
      o.out, s.preset, s.zipf, s.reuse, s.window, s.lag_exponent, s.n_tokens, s.n_prompt, s.n_layer,
      s.n_expert, s.n_expert_used, s.seed, mb));
  // The generator's check: LRU hit rates of the trace as written (the locality preset's
  // calibration is ~67% / ~81% for the qwen3-30b-a3b shape).
  const uint64_t id_bytes = static_cast<uint64_t>(s.n_tokens) *
                            static_cast<uint64_t>(shape.ids_per_token()) * sizeof(uint16_t);
  if (id_bytes > kGenStatsMaxBytes) {
    (void)write_stdout(
        fmt::format("LRU hit rates not simulated for a trace this long ({:.1f} MB of ids in "
                    "memory): `berth trace stats {}` gives them\n",
                    static_cast<double>(id_bytes) / 1e6, o.out));
    return 0;
  }
  LruPolicy lru;
  ExpertCachePolicy* const policies[] = {&lru};
  (void)write_stdout(cache_lines(read_routing_trace(o.out), policies));
  return 0;
}

int trace_stats(const TraceOptions& o) {
  const RoutingTrace tr = read_routing_trace(o.file);
  const TraceShape& s = tr.shape;
  if (tr.n_tokens() == 0)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("{}: the trace has no tokens: no statistics", o.file));
  const int64_t prefill = std::count(tr.kinds.begin(), tr.kinds.end(), TokenKind::prefill);
  std::string out = fmt::format(
      "{}: {} tokens ({} prefill, {} decode), {} MoE layers (blocks {}..{}), {} experts, top-{}, "
      "{}\n",
      o.file, tr.n_tokens(), prefill, tr.n_tokens() - prefill, s.n_layer, s.blocks.front(),
      s.blocks.back(), s.n_expert, s.n_expert_used,
      s.has_weights ? "with weights" : "without weights");
  out += fmt::format("routed calls: {} ({} per MoE layer)\n", tr.n_tokens() * s.ids_per_token(),
                     tr.n_tokens() * s.n_expert_used);
  LruPolicy lru;
  LfuDecayPolicy lfu(o.half_life, o.margin);
  ExpertCachePolicy* const policies[] = {&lru, &lfu};
  out += cache_lines(tr, policies);
  const std::vector<double> cov = coverage_fraction(tr, 0.9);
  const auto [lo, hi] = std::minmax_element(cov.begin(), cov.end());
  out += fmt::format(
      "experts covering 90% of routed calls: {:.1f}% (mean of layers; min {:.1f}%, max {:.1f}%)\n",
      100.0 * std::accumulate(cov.begin(), cov.end(), 0.0) / static_cast<double>(cov.size()),
      100.0 * *lo, 100.0 * *hi);
  (void)write_stdout(out);
  return 0;
}

int trace_dump(const TraceOptions& o) {
  const RoutingTrace tr = read_routing_trace(o.file);
  const int64_t first = std::min(o.first, tr.n_tokens());
  const int64_t end =
      o.count < 0 ? tr.n_tokens() : first + std::min(o.count, tr.n_tokens() - first);
  if (!write_stdout(dump_routing_trace(tr, first, 0, true))) return 0;
  constexpr int64_t kChunk = 256;  // tokens per write: `| head` stops early
  for (int64_t t = first; t < end; t += kChunk)
    if (!write_stdout(dump_routing_trace(tr, t, std::min(kChunk, end - t), false))) return 0;
  return 0;
}

}  // namespace

Runner add_trace(CLI::App& app) {
  auto o = std::make_shared<TraceOptions>();
  CLI::App* sub = app.add_subcommand(
      "trace",
      "routing traces (the experts each token chose per MoE layer) for residency benchmarks: "
      "generate, summarise, dump");
  sub->require_subcommand(1);

  CLI::App* g = sub->add_subcommand(
      "gen",
      "generate a trace with Zipf popularity and temporal locality (residency/trace_gen.h) and "
      "print its LRU hit rates with 12.5% and 25% of each layer's experts cached");
  o->gen = g;
  g->add_option("--preset", o->preset,
                "locality (LRU at 12.5%/25% of experts serves ~67%/81% of calls), popularity "
                "(the same Zipf law, no locality) or uniform")
      ->capture_default_str()
      ->check(CLI::IsMember(trace_presets()));
  g->add_option("--tokens", o->tokens, "tokens to generate")->required();
  g->add_option("--n-prompt", o->n_prompt, "the first N tokens are marked prefill (default 0)");
  g->add_option("-s,--seed", o->seed, "random seed (same seed, same bytes)")->capture_default_str();
  g->add_option("--popularity-seed", o->popularity_seed,
                "seed of the experts' popularity order only (-1: from --seed): traces with one "
                "popularity seed share their hot experts (a calibration trace for "
                "--residency-policy frequency:TRACE)")
      ->capture_default_str()
      ->check(range(int64_t{-1}, int64_t{1} << 62));
  g->add_option("-o,--output", o->out, "trace file to write")->required();
  g->add_option("--n-layer", o->n_layer, "MoE layers (default 48, qwen3-30b-a3b)");
  g->add_option("--n-expert", o->n_expert, "experts per layer (default 128)");
  g->add_option("--n-expert-used", o->n_expert_used, "experts per token (default 8)");
  g->add_option("--zipf", o->zipf, "override the preset: Zipf exponent of popularity");
  g->add_option("--reuse", o->reuse,
                "override the preset: probability that a slot re-uses a recent call");
  g->add_option("--window", o->window, "override the preset: tokens a re-use reaches back");
  g->add_option("--lag-exponent", o->lag_exponent,
                "override the preset: p(lag d) ~ d^-X within the window");

  CLI::App* st = sub->add_subcommand(
      "stats",
      "LRU and LFU-with-decay hit rates with 12.5% and 25% of each layer's experts cached, and "
      "the share of experts that covers 90% of routed calls");
  o->stats = st;
  st->add_option("file", o->file, "trace file")->required();
  st->add_option("--margin", o->margin,
                 "the LFU policy's margin z: an expert displaces a resident one only when its "
                 "score exceeds it by z standard deviations of the difference (0: any excess)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  st->add_option("--half-life", o->half_life, "half-life of the LFU policy's counts, in tokens")
      ->capture_default_str()
      ->check(range(1e-3, 1e12));

  CLI::App* d = sub->add_subcommand(
      "dump", "print a trace as text: one line per (token, layer) with the expert ids");
  o->dump = d;
  d->add_option("file", o->file, "trace file")->required();
  d->add_option("--first", o->first, "first token (default 0)")
      ->check(range(int64_t{0}, INT64_MAX));
  d->add_option("--count", o->count, "tokens to print (default: all)")
      ->check(range(int64_t{0}, INT64_MAX));

  return [o] {
    if (o->gen->parsed()) return trace_gen(*o);
    if (o->stats->parsed()) return trace_stats(*o);
    if (o->dump->parsed()) return trace_dump(*o);
    return 2;
  };
}

}  // namespace berth::cli
