// Synthetic routing traces with documented popularity and temporal locality, for residency
// benchmarks on models whose weights are random (synthetic models do not route like trained
// ones).
//
// Model, independently per MoE layer l (deterministic for a seed, on every platform: own
// xoshiro256** generator, no std:: distributions):
// - Popularity: a random permutation perm_l of the experts; the expert of rank r (r = 1..n_expert)
//   is perm_l[r-1] with p(r) = r^-zipf / sum_i i^-zipf (Zipf's law; zipf 0 = uniform).
// - Each token draws its n_expert_used distinct experts one slot at a time. With probability
//   `reuse` (and once the layer has history) the slot re-uses a recent call: a lag d in
//   1..min(window, tokens so far) with p(d) ~ d^-lag_exponent, then one of the n_expert_used
//   experts token t-d routed to at this layer, uniformly; otherwise it draws a rank from the
//   popularity law. A draw that repeats an expert the token already has is redrawn, so a token's
//   experts are distinct (reuse falls back to a popularity draw after 16 repeats; the popularity
//   draw is exact sampling without replacement).
// - The first n_prompt tokens are marked prefill, the rest decode; routing does not depend on it.
//
// Presets for a qwen3-30b-a3b-shaped model (48 MoE layers, 128 experts, top-8); the shape can be
// changed, the calibration holds for this shape only:
// - "uniform": zipf 0, reuse 0: an LRU cache of a fraction f of the experts serves f of calls.
// - "popularity": the locality preset's Zipf law without reuse (static popularity only).
// - "locality": calibrated so that an LRU cache of 12.5% of each layer's experts serves 67% and
//   one of 25% serves 81% of routed calls, the numbers published for a 512-expert top-10
//   Qwen3-Next-class model (../shared/notes/residency-and-tiers.md); measured values and the
//   calibration in docs/routing-traces.md.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "berth/residency/routing_trace.h"

namespace berth::residency {

struct TraceGenSpec {
  std::string preset;  ///< name for messages ("locality", "custom")
  int32_t n_layer = 48;
  int32_t n_expert = 128;
  int32_t n_expert_used = 8;
  int64_t n_tokens = 0;  ///< 1..kMaxGenTokens
  int64_t n_prompt = 0;  ///< the first n_prompt tokens are prefill, 0..n_tokens
  uint64_t seed = 0;
  /// Seed of the popularity order (which expert has which rank, per layer); -1: drawn from
  /// `seed` like everything else. Two traces with one popularity seed and different seeds share
  /// their hot experts but not their tokens (a calibration trace for a frequency-static
  /// placement, `--residency-policy frequency:TRACE`).
  int64_t popularity_seed = -1;
  double zipf = 0.0;          ///< Zipf exponent of popularity, 0..8
  double reuse = 0.0;         ///< probability that a slot re-uses a recent call, 0..1
  int32_t window = 1;         ///< tokens a re-use reaches back, 1..4096
  double lag_exponent = 0.0;  ///< p(lag d) ~ d^-lag_exponent, 0..8
};

inline constexpr int64_t kMaxGenTokens = int64_t{1} << 28;

/// The named presets: "locality", "popularity", "uniform".
std::vector<std::string> trace_presets();
/// A preset's parameters with the qwen3-30b-a3b shape (n_tokens, n_prompt and seed left 0).
/// Throws Error(invalid_argument) naming the presets for an unknown name.
TraceGenSpec trace_preset(std::string_view name);
/// Throws Error(invalid_argument) naming the flag (--n-layer, --zipf, ...) of a value outside
/// the ranges above or the trace format's limits.
void validate_trace_gen_spec(const TraceGenSpec& spec);

/// Draws tokens one at a time, holding `window` tokens of history (n_layer * n_expert_used ids
/// each): any length streams to a RoutingTraceWriter in constant memory.
class TraceGenerator {
 public:
  /// Validates `spec` (validate_trace_gen_spec).
  explicit TraceGenerator(const TraceGenSpec& spec);
  /// The shape of the traces it makes (blocks 0..n_layer-1, no weights).
  TraceShape shape() const;
  /// Draws the next token into `ids` ([n_layer][n_expert_used], ids_per_token() entries) and
  /// returns its kind.
  TokenKind next(std::span<uint16_t> ids);
  int64_t tokens_drawn() const { return t_; }

 private:
  struct Rng {
    uint64_t s[4];
    uint64_t next();
    double uniform();            // [0, 1)
    uint32_t below(uint32_t n);  // [0, n), unbiased
  };
  int32_t draw_rank(std::span<const uint16_t> chosen, const uint16_t* perm);

  TraceGenSpec spec_;
  Rng rng_{};
  int64_t t_ = 0;
  std::vector<double> rank_cdf_;   // [n_expert], cumulative p(rank), last = 1
  std::vector<double> rank_p_;     // [n_expert]
  std::vector<double> lag_cdf_;    // [window], cumulative p(lag), last = 1
  std::vector<uint16_t> perm_;     // [n_layer][n_expert]: rank -> expert
  std::vector<uint16_t> rank_of_;  // [n_layer][n_expert]: expert -> rank
  std::vector<uint16_t> history_;  // ring of [window][n_layer][n_expert_used]
};

/// A whole trace in memory (n_tokens * n_layer * n_expert_used * 2 bytes).
RoutingTrace generate_routing_trace(const TraceGenSpec& spec);

/// Generates `spec` straight to the trace file `path`. Throws as validate_trace_gen_spec and
/// RoutingTraceWriter.
void write_generated_trace(const TraceGenSpec& spec, const std::string& path);

}  // namespace berth::residency
