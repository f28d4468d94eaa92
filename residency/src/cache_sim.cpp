#include "berth/residency/cache_sim.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "berth/core/error.h"

namespace berth::residency {

// ---------------------------------------------------------------------------------------------
// LRU

void LruPolicy::reset(int32_t n_layer, int32_t n_expert, int32_t capacity) {
  BERTH_CHECK(n_layer >= 0 && n_expert >= 0 && capacity >= 0 && capacity <= n_expert);
  n_expert_ = n_expert;
  capacity_ = capacity;
  const size_t n = static_cast<size_t>(n_layer) * static_cast<size_t>(n_expert);
  prev_.assign(n, -1);
  next_.assign(n, -1);
  in_.assign(n, 0);
  head_.assign(static_cast<size_t>(n_layer), -1);
  tail_.assign(static_cast<size_t>(n_layer), -1);
  count_.assign(static_cast<size_t>(n_layer), 0);
}

bool LruPolicy::resident(int32_t layer, int32_t expert) const {
  return in_[static_cast<size_t>(layer) * n_expert_ + expert] != 0;
}

void LruPolicy::unlink(size_t base, int32_t e) {
  const size_t layer = base / static_cast<size_t>(n_expert_);
  const int32_t p = prev_[base + e], n = next_[base + e];
  if (p >= 0)
    next_[base + p] = n;
  else
    head_[layer] = n;
  if (n >= 0)
    prev_[base + n] = p;
  else
    tail_[layer] = p;
  prev_[base + e] = next_[base + e] = -1;
}

void LruPolicy::push_front(size_t base, int32_t e) {
  const size_t layer = base / static_cast<size_t>(n_expert_);
  const int32_t h = head_[layer];
  prev_[base + e] = -1;
  next_[base + e] = h;
  if (h >= 0)
    prev_[base + h] = e;
  else
    tail_[layer] = e;
  head_[layer] = e;
}

int32_t LruPolicy::update(int32_t layer, std::span<const uint16_t> ids) {
  if (capacity_ == 0) return 0;
  const size_t base = static_cast<size_t>(layer) * n_expert_;
  const size_t li = static_cast<size_t>(layer);
  // The new order: the token's experts (slot 0 first, as many as fit), then the previous order
  // without them, cut at the capacity.
  was_.assign(ids.size(), 0);
  for (size_t j = 0; j < ids.size(); ++j) {
    const int32_t e = ids[j];
    if (!in_[base + e]) continue;
    was_[j] = 1;
    unlink(base, e);
    in_[base + e] = 0;
    --count_[li];
  }
  int32_t loaded = 0;
  for (size_t j = std::min(ids.size(), static_cast<size_t>(capacity_)); j-- > 0;) {
    push_front(base, ids[j]);
    in_[base + ids[j]] = 1;
    ++count_[li];
    loaded += was_[j] ? 0 : 1;
  }
  while (count_[li] > capacity_) {
    const int32_t victim = tail_[li];
    unlink(base, victim);
    in_[base + victim] = 0;
    --count_[li];
  }
  return loaded;
}

// ---------------------------------------------------------------------------------------------
// LFU with decay

LfuDecayPolicy::LfuDecayPolicy(double half_life_tokens, double margin)
    : half_life_(half_life_tokens), margin_(margin) {
  if (!(half_life_tokens > 0.0) || std::isinf(half_life_tokens))
    throw Error(
        ErrorCategory::invalid_argument,
        fmt::format("LFU half-life {} must be a finite number of tokens > 0", half_life_tokens));
  if (!(margin >= 0.0) || std::isinf(margin))
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("LFU margin {} must be a finite number >= 0", margin));
  decay_ = std::pow(0.5, 1.0 / half_life_tokens);
}

std::string LfuDecayPolicy::name() const {
  return margin_ > 0 ? fmt::format("lfu-decay(h={:g},z={:g})", half_life_, margin_)
                     : fmt::format("lfu-decay(h={:g})", half_life_);
}

void LfuDecayPolicy::reset(int32_t n_layer, int32_t n_expert, int32_t capacity) {
  BERTH_CHECK(n_layer >= 0 && n_expert >= 0 && capacity >= 0 && capacity <= n_expert);
  n_expert_ = n_expert;
  capacity_ = capacity;
  const size_t n = static_cast<size_t>(n_layer) * static_cast<size_t>(n_expert);
  score_.assign(n, 0.0);
  in_.assign(n, 0);
  inc_.assign(static_cast<size_t>(n_layer), 1.0);
  set_.assign(static_cast<size_t>(n_layer), {});
  for (auto& s : set_) s.reserve(static_cast<size_t>(capacity));
}

bool LfuDecayPolicy::resident(int32_t layer, int32_t expert) const {
  return in_[static_cast<size_t>(layer) * n_expert_ + expert] != 0;
}

int32_t LfuDecayPolicy::update(int32_t layer, std::span<const uint16_t> ids) {
  const size_t li = static_cast<size_t>(layer);
  const size_t base = li * n_expert_;
  // One token passes: every score decays by decay_, i.e. a new call counts 1/decay_ more.
  inc_[li] /= decay_;
  if (inc_[li] > 1e200) {
    for (size_t e = 0; e < static_cast<size_t>(n_expert_); ++e) score_[base + e] /= inc_[li];
    inc_[li] = 1.0;
  }
  for (uint16_t e : ids) score_[base + e] += inc_[li];
  if (capacity_ == 0) return 0;
  // Only the called experts' scores rose, so the top-capacity set changes only by called
  // experts displacing the lowest resident one (a streaming top-k over set + called).
  int32_t loaded = 0;
  std::vector<int32_t>& set = set_[li];
  for (uint16_t e : ids) {
    if (in_[base + e]) continue;
    if (static_cast<int32_t>(set.size()) < capacity_) {
      set.push_back(e);
      in_[base + e] = 1;
      ++loaded;
      continue;
    }
    size_t lo = 0;
    for (size_t i = 1; i < set.size(); ++i)
      if (score_[base + set[i]] < score_[base + set[lo]]) lo = i;
    const double se = score_[base + e], sr = score_[base + set[lo]];
    // In decayed calls: divide by inc_ (scores grow by inc_ per call).
    const bool passes =
        margin_ > 0 ? (se - sr) / inc_[li] > margin_ * std::sqrt((se + sr) / inc_[li]) : se > sr;
    if (passes) {
      in_[base + set[lo]] = 0;
      set[lo] = e;
      in_[base + e] = 1;
      ++loaded;
    }
  }
  return loaded;
}

// ---------------------------------------------------------------------------------------------
// Simulation and statistics

int32_t cache_capacity(double fraction, int32_t n_expert) {
  if (!(fraction > 0.0)) return 0;
  const double c = std::floor(fraction * n_expert + 0.5);
  return c >= n_expert ? n_expert : static_cast<int32_t>(c);
}

CacheSimResult simulate_cache(const RoutingTrace& trace, ExpertCachePolicy& policy,
                              int32_t capacity, const CacheSimOptions& options) {
  const TraceShape& s = trace.shape;
  if (capacity < 0 || capacity > s.n_expert)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("cache capacity {} is outside 0..n_expert ({})", capacity, s.n_expert));
  if (options.warmup_tokens < 0)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("warm-up of {} tokens is negative", options.warmup_tokens));
  policy.reset(s.n_layer, s.n_expert, capacity);
  CacheSimResult r;
  r.policy = policy.name();
  r.capacity = capacity;
  for (int64_t t = 0; t < trace.n_tokens(); ++t) {
    const bool counted = t >= options.warmup_tokens;
    for (int32_t l = 0; l < s.n_layer; ++l) {
      const auto ids = trace.token_ids(t, l);
      int64_t hits = 0;
      for (uint16_t e : ids) hits += policy.resident(l, e) ? 1 : 0;
      const int32_t loaded = policy.update(l, ids);
      if (counted) {
        r.hits += hits;
        r.calls += static_cast<int64_t>(ids.size());
        r.loads += loaded;
      }
    }
    if (counted) ++r.tokens;
  }
  return r;
}

std::vector<double> coverage_fraction(const RoutingTrace& trace, double share) {
  const TraceShape& s = trace.shape;
  if (!(share > 0.0 && share <= 1.0))
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("coverage share {} is outside (0, 1]", share));
  if (trace.n_tokens() == 0)
    throw Error(ErrorCategory::invalid_argument, "coverage of a routing trace without tokens");
  std::vector<int64_t> counts(static_cast<size_t>(s.n_layer) * s.n_expert, 0);
  for (int64_t t = 0; t < trace.n_tokens(); ++t)
    for (int32_t l = 0; l < s.n_layer; ++l)
      for (uint16_t e : trace.token_ids(t, l)) ++counts[static_cast<size_t>(l) * s.n_expert + e];
  std::vector<double> out(static_cast<size_t>(s.n_layer));
  const int64_t calls = trace.n_tokens() * s.n_expert_used;  // per layer
  for (int32_t l = 0; l < s.n_layer; ++l) {
    std::vector<int64_t> c(counts.begin() + static_cast<ptrdiff_t>(l) * s.n_expert,
                           counts.begin() + static_cast<ptrdiff_t>(l + 1) * s.n_expert);
    std::sort(c.begin(), c.end(), std::greater<>());
    const double need = share * static_cast<double>(calls);
    int64_t sum = 0;
    int32_t m = 0;
    while (m < s.n_expert && static_cast<double>(sum) < need) sum += c[static_cast<size_t>(m++)];
    out[static_cast<size_t>(l)] = static_cast<double>(m) / s.n_expert;
  }
  return out;
}

}  // namespace berth::residency
