#include "berth/residency/trace_gen.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "berth/core/error.h"

namespace berth::residency {
namespace {

// Calibrated on qwen3-30b-a3b's shape (48 x 128, top-8); docs/routing-traces.md.
constexpr double kLocalityZipf = 1.25;
constexpr double kLocalityReuse = 0.375;
constexpr int32_t kLocalityWindow = 5;
constexpr double kLocalityLagExponent = 1.0;

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

bool contains(std::span<const uint16_t> v, uint16_t e) {
  return std::find(v.begin(), v.end(), e) != v.end();
}

}  // namespace

std::vector<std::string> trace_presets() { return {"locality", "popularity", "uniform"}; }

TraceGenSpec trace_preset(std::string_view name) {
  TraceGenSpec s;
  s.preset = std::string(name);
  if (name == "uniform") return s;
  if (name == "popularity" || name == "locality") {
    s.zipf = kLocalityZipf;
    if (name == "locality") {
      s.reuse = kLocalityReuse;
      s.window = kLocalityWindow;
      s.lag_exponent = kLocalityLagExponent;
    }
    return s;
  }
  throw Error(ErrorCategory::invalid_argument,
              fmt::format("--preset: unknown trace preset '{}' (one of: locality, popularity, "
                          "uniform)",
                          name));
}

void validate_trace_gen_spec(const TraceGenSpec& s) {
  auto bad = [](const std::string& m) { throw Error(ErrorCategory::invalid_argument, m); };
  TraceShape shape;
  shape.n_layer = s.n_layer;
  shape.n_expert = s.n_expert;
  shape.n_expert_used = s.n_expert_used;
  if (s.n_layer < 1 || s.n_layer > static_cast<int32_t>(kMaxTraceLayers))
    bad(fmt::format("--n-layer {} is outside 1..{}", s.n_layer, kMaxTraceLayers));
  if (s.n_expert < 1 || s.n_expert > static_cast<int32_t>(kMaxTraceExperts))
    bad(fmt::format("--n-expert {} is outside 1..{}", s.n_expert, kMaxTraceExperts));
  const int32_t max_used = std::min<int32_t>(s.n_expert, kMaxTraceExpertsUsed);
  if (s.n_expert_used < 1 || s.n_expert_used > max_used)
    bad(fmt::format("--n-expert-used {} is outside 1..{} (n_expert {})", s.n_expert_used, max_used,
                    s.n_expert));
  if (s.n_tokens < 1 || s.n_tokens > kMaxGenTokens)
    bad(fmt::format("--tokens {} is outside 1..{}", s.n_tokens, kMaxGenTokens));
  if (s.n_prompt < 0 || s.n_prompt > s.n_tokens)
    bad(fmt::format("--n-prompt {} is outside 0..{} (the tokens)", s.n_prompt, s.n_tokens));
  if (!(s.zipf >= 0.0 && s.zipf <= 8.0)) bad(fmt::format("--zipf {} is outside 0..8", s.zipf));
  if (!(s.reuse >= 0.0 && s.reuse <= 1.0)) bad(fmt::format("--reuse {} is outside 0..1", s.reuse));
  if (s.window < 1 || s.window > 4096) bad(fmt::format("--window {} is outside 1..4096", s.window));
  if (!(s.lag_exponent >= 0.0 && s.lag_exponent <= 8.0))
    bad(fmt::format("--lag-exponent {} is outside 0..8", s.lag_exponent));
}

// ---------------------------------------------------------------------------------------------
// Generator

uint64_t TraceGenerator::Rng::next() {  // xoshiro256** (Blackman and Vigna, 2018)
  const uint64_t r = rotl(s[1] * 5, 7) * 9;
  const uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = rotl(s[3], 45);
  return r;
}

double TraceGenerator::Rng::uniform() { return static_cast<double>(next() >> 11) * 0x1p-53; }

uint32_t TraceGenerator::Rng::below(uint32_t n) {  // rejection of the biased top range
  const uint64_t limit = (uint64_t{1} << 32) - ((uint64_t{1} << 32) % n);
  for (;;) {
    const uint64_t x = next() >> 32;
    if (x < limit) return static_cast<uint32_t>(x % n);
  }
}

TraceGenerator::TraceGenerator(const TraceGenSpec& spec) : spec_(spec) {
  validate_trace_gen_spec(spec_);
  uint64_t x = spec_.seed;
  for (uint64_t& w : rng_.s) w = splitmix64(x);
  const int32_t n = spec_.n_expert;
  rank_p_.resize(static_cast<size_t>(n));
  rank_cdf_.resize(static_cast<size_t>(n));
  double sum = 0.0;
  for (int32_t r = 0; r < n; ++r)
    sum += rank_p_[static_cast<size_t>(r)] = std::pow(r + 1.0, -spec_.zipf);
  double c = 0.0;
  for (int32_t r = 0; r < n; ++r) {
    rank_p_[static_cast<size_t>(r)] /= sum;
    c += rank_p_[static_cast<size_t>(r)];
    rank_cdf_[static_cast<size_t>(r)] = c;
  }
  rank_cdf_.back() = 1.0;
  lag_cdf_.resize(static_cast<size_t>(spec_.window));
  double lsum = 0.0;
  for (int32_t d = 1; d <= spec_.window; ++d)
    lag_cdf_[static_cast<size_t>(d - 1)] = lsum +=
        std::pow(static_cast<double>(d), -spec_.lag_exponent);
  // Left unnormalised: draws scale by the CDF at the lags available.
  perm_.resize(static_cast<size_t>(spec_.n_layer) * n);
  rank_of_.resize(perm_.size());
  Rng pop{};  // the popularity order's own generator, when it has its own seed
  if (spec_.popularity_seed >= 0) {
    uint64_t y = static_cast<uint64_t>(spec_.popularity_seed);
    for (uint64_t& w : pop.s) w = splitmix64(y);
  }
  Rng& order_rng = spec_.popularity_seed >= 0 ? pop : rng_;
  for (int32_t l = 0; l < spec_.n_layer; ++l) {
    uint16_t* p = perm_.data() + static_cast<size_t>(l) * n;
    for (int32_t e = 0; e < n; ++e) p[e] = static_cast<uint16_t>(e);
    for (int32_t i = n - 1; i > 0; --i)  // Fisher-Yates
      std::swap(p[i], p[order_rng.below(static_cast<uint32_t>(i + 1))]);
    for (int32_t r = 0; r < n; ++r)
      rank_of_[static_cast<size_t>(l) * n + p[r]] = static_cast<uint16_t>(r);
  }
  history_.resize(static_cast<size_t>(spec_.window) * spec_.n_layer * spec_.n_expert_used);
}

TraceShape TraceGenerator::shape() const {
  TraceShape s;
  s.n_layer = spec_.n_layer;
  s.n_expert = spec_.n_expert;
  s.n_expert_used = spec_.n_expert_used;
  for (int32_t l = 0; l < s.n_layer; ++l) s.blocks.push_back(l);
  return s;
}

int32_t TraceGenerator::draw_rank(std::span<const uint16_t> chosen, const uint16_t* perm) {
  // Rejection first (exact for the law restricted to the experts not chosen yet); with a steep
  // law and most of its mass chosen, walk the remaining mass instead.
  for (int tries = 0; tries < 32; ++tries) {
    const double u = rng_.uniform();
    const size_t r = static_cast<size_t>(std::upper_bound(rank_cdf_.begin(), rank_cdf_.end(), u) -
                                         rank_cdf_.begin());
    const uint16_t e = perm[std::min(r, rank_cdf_.size() - 1)];
    if (!contains(chosen, e)) return e;
  }
  double left = 0.0;
  for (int32_t r = 0; r < spec_.n_expert; ++r)
    if (!contains(chosen, perm[r])) left += rank_p_[static_cast<size_t>(r)];
  double u = rng_.uniform() * left;
  int32_t last = -1;
  for (int32_t r = 0; r < spec_.n_expert; ++r) {
    if (contains(chosen, perm[r])) continue;
    last = perm[r];
    u -= rank_p_[static_cast<size_t>(r)];
    if (u < 0.0) return perm[r];
  }
  BERTH_CHECK(last >= 0, "no expert left to draw");
  return last;  // rounding left u at or just above 0
}

TokenKind TraceGenerator::next(std::span<uint16_t> ids) {
  const int32_t k = spec_.n_expert_used;
  const size_t per_token = static_cast<size_t>(spec_.n_layer) * k;
  BERTH_CHECK(ids.size() == per_token);
  const int64_t have = std::min<int64_t>(t_, spec_.window);  // tokens of history
  const double lag_mass = have > 0 ? lag_cdf_[static_cast<size_t>(have - 1)] : 0.0;
  for (int32_t l = 0; l < spec_.n_layer; ++l) {
    uint16_t* out = ids.data() + static_cast<size_t>(l) * k;
    const uint16_t* perm = perm_.data() + static_cast<size_t>(l) * spec_.n_expert;
    for (int32_t j = 0; j < k; ++j) {
      const std::span<const uint16_t> chosen(out, static_cast<size_t>(j));
      int32_t e = -1;
      if (have > 0 && spec_.reuse > 0.0 && rng_.uniform() < spec_.reuse) {
        for (int tries = 0; tries < 16 && e < 0; ++tries) {
          const double u = rng_.uniform() * lag_mass;
          const int64_t d = 1 + (std::upper_bound(lag_cdf_.begin(), lag_cdf_.begin() + have, u) -
                                 lag_cdf_.begin());
          const int64_t lag = std::min(d, have);
          const int64_t slot = (t_ - lag) % spec_.window;
          const uint16_t c =
              history_[static_cast<size_t>(slot) * per_token + static_cast<size_t>(l) * k +
                       rng_.below(static_cast<uint32_t>(k))];
          if (!contains(chosen, c)) e = c;
        }
      }
      if (e < 0) e = draw_rank(chosen, perm);
      out[j] = static_cast<uint16_t>(e);
    }
  }
  std::copy(ids.begin(), ids.end(),
            history_.begin() + static_cast<ptrdiff_t>((t_ % spec_.window) * per_token));
  const TokenKind kind = t_ < spec_.n_prompt ? TokenKind::prefill : TokenKind::decode;
  ++t_;
  return kind;
}

RoutingTrace generate_routing_trace(const TraceGenSpec& spec) {
  TraceGenerator g(spec);
  RoutingTrace tr;
  tr.shape = g.shape();
  const size_t per = static_cast<size_t>(tr.shape.ids_per_token());
  tr.kinds.resize(static_cast<size_t>(spec.n_tokens));
  tr.ids.resize(static_cast<size_t>(spec.n_tokens) * per);
  for (int64_t t = 0; t < spec.n_tokens; ++t)
    tr.kinds[static_cast<size_t>(t)] = g.next({tr.ids.data() + static_cast<size_t>(t) * per, per});
  return tr;
}

void write_generated_trace(const TraceGenSpec& spec, const std::string& path) {
  TraceGenerator g(spec);
  RoutingTraceWriter w(path, g.shape());
  std::vector<uint16_t> ids(static_cast<size_t>(w.shape().ids_per_token()));
  for (int64_t t = 0; t < spec.n_tokens; ++t) {
    const TokenKind kind = g.next(ids);
    w.append_token(kind, ids);
  }
  w.finish();
}

}  // namespace berth::residency
