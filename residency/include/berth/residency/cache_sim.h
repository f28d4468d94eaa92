// Expert-cache simulation on routing traces: how many routed expert calls a per-layer cache of
// `capacity` experts would serve under a residency policy. The residency manager's policies are
// compared here, on the same traces, before they move a byte.
//
// Model: each MoE layer has `capacity` expert slots. Token by token (in trace order, prefill
// and decode alike), for each MoE layer: each of the token's n_expert_used calls is a hit when
// its expert is resident *before* the token (the token's own calls never serve each other: a
// step's experts run together), then the policy sees the token's ids and updates the layer's
// resident set (at most `capacity` experts). A policy sees only past and present routing.
// Hit rate = hits / calls over the counted tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "berth/residency/routing_trace.h"

namespace berth::residency {

/// A residency policy over per-layer expert slots, driven by one token's routing at a time.
class ExpertCachePolicy {
 public:
  virtual ~ExpertCachePolicy() = default;
  /// Short name for tables ("lru", "lfu-decay(h=64)").
  virtual std::string name() const = 0;
  /// Starts empty for a model of `n_layer` MoE layers of `n_expert` experts, `capacity` slots
  /// per layer (0 <= capacity <= n_expert).
  virtual void reset(int32_t n_layer, int32_t n_expert, int32_t capacity) = 0;
  /// Whether expert `expert` of MoE layer `layer` is resident now.
  virtual bool resident(int32_t layer, int32_t expert) const = 0;
  /// Takes one token's ids at `layer` (top-k order, distinct, < n_expert) after its hits were
  /// counted; updates the layer's resident set. Returns how many experts became resident (the
  /// uploads a real cache would make).
  virtual int32_t update(int32_t layer, std::span<const uint16_t> ids) = 0;
};

/// Least recently used: after a token, its experts are the most recent (slot 0 of the top-k the
/// most recent of all), the others keep their order behind them, and those beyond `capacity`
/// leave. With capacity < n_expert_used only the first `capacity` of the token's top-k stay.
class LruPolicy final : public ExpertCachePolicy {
 public:
  std::string name() const override { return "lru"; }
  void reset(int32_t n_layer, int32_t n_expert, int32_t capacity) override;
  bool resident(int32_t layer, int32_t expert) const override;
  int32_t update(int32_t layer, std::span<const uint16_t> ids) override;

 private:
  void unlink(size_t base, int32_t e);
  void push_front(size_t base, int32_t e);
  int32_t n_expert_ = 0, capacity_ = 0;
  // Per layer, a doubly linked list of the resident experts, most recent first:
  // [n_layer][n_expert] prev/next (-1 = none), head/tail/count per layer.
  std::vector<int32_t> prev_, next_, head_, tail_, count_;
  std::vector<uint8_t> in_;   // [n_layer][n_expert]
  std::vector<uint8_t> was_;  // scratch of update(): slot j's expert was resident
};

/// Least frequently used with exponential decay: each expert's score is the number of calls it
/// had, each weighted by 0.5^(age in tokens / half_life); the `capacity` experts of highest
/// score are resident (ties keep the resident one). Experts enter only through a call, so the
/// set changes only when a called expert's score passes the lowest resident one. With a margin
/// z > 0 it must pass it by more than noise: a called expert e replaces the lowest resident r
/// only when s_e - s_r > z * sqrt(s_e + s_r) (scores in decayed calls; the difference of two
/// Poisson counts has that standard deviation), so routing without favourites (a uniform trace)
/// stops moving experts while hot experts still displace cold ones.
class LfuDecayPolicy final : public ExpertCachePolicy {
 public:
  /// `half_life_tokens` > 0, `margin` >= 0 (throws Error(invalid_argument) otherwise).
  explicit LfuDecayPolicy(double half_life_tokens, double margin = 0.0);
  std::string name() const override;
  void reset(int32_t n_layer, int32_t n_expert, int32_t capacity) override;
  bool resident(int32_t layer, int32_t expert) const override;
  int32_t update(int32_t layer, std::span<const uint16_t> ids) override;

 private:
  double half_life_, decay_, margin_;
  int32_t n_expert_ = 0, capacity_ = 0;
  // Scores in units that grow by 1/decay per token (instead of decaying every score):
  // [n_layer][n_expert]; inc_ per layer; rescaled when inc_ grows large.
  std::vector<double> score_, inc_;
  std::vector<uint8_t> in_;                // [n_layer][n_expert]
  std::vector<std::vector<int32_t>> set_;  // per layer, the resident experts
};

/// Slots per layer for a fraction of the experts: round(fraction * n_expert), clamped to
/// [0, n_expert] (0.125 of 128 = 16).
int32_t cache_capacity(double fraction, int32_t n_expert);

struct CacheSimOptions {
  int64_t warmup_tokens = 0;  ///< the first tokens update the policy but are not counted
};

struct CacheSimResult {
  std::string policy;
  int32_t capacity = 0;  ///< slots per layer
  int64_t tokens = 0;    ///< tokens counted
  int64_t calls = 0;     ///< routed expert calls counted (tokens * n_layer * n_expert_used)
  int64_t hits = 0;      ///< calls whose expert was resident
  int64_t loads = 0;     ///< experts made resident during the counted tokens
  double hit_rate() const { return calls > 0 ? static_cast<double>(hits) / calls : 0.0; }
  double loads_per_token() const { return tokens > 0 ? static_cast<double>(loads) / tokens : 0.0; }
};

/// Replays `trace` through `policy` (reset first) with `capacity` slots per layer. Throws
/// Error(invalid_argument) for a capacity outside 0..n_expert or a warm-up that is negative.
CacheSimResult simulate_cache(const RoutingTrace& trace, ExpertCachePolicy& policy,
                              int32_t capacity, const CacheSimOptions& options = {});

/// Static popularity of a trace, per MoE layer: the fewest experts whose calls make up at least
/// `share` (0 < share <= 1) of the layer's calls, as a fraction of n_expert. [n_layer].
/// Throws Error(invalid_argument) for a share outside (0, 1] or a trace without tokens.
std::vector<double> coverage_fraction(const RoutingTrace& trace, double share);

}  // namespace berth::residency
