#include "berth/runtime/sampler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_set>

#include "berth/core/error.h"

namespace berth {
namespace {

constexpr uint64_t kRandomSeed = 0xFFFFFFFFu;

// Names the field and the CLI flag that sets it (llama.cpp's spelling), e.g. "top_p (--top-p)".
[[noreturn]] void bad_param(std::string_view field, std::string_view why) {
  std::string flag = "--" + std::string(field);
  for (char& c : flag)
    if (c == '_') c = '-';
  if (field == "n_vocab") flag = "the model";
  throw Error(ErrorCategory::invalid_argument,
              fmt::format("sampler: {} ({}) {}", field, flag, why));
}

void validate(const SamplerParams& p, int32_t n_vocab) {
  if (n_vocab <= 0) bad_param("n_vocab", fmt::format("= {} must be > 0", n_vocab));
  if (std::isnan(p.temp)) bad_param("temp", "is NaN");
  if (!(p.top_p >= 0.0f && p.top_p <= 1.0f)) {
    bad_param("top_p", fmt::format("= {} is outside [0, 1]", p.top_p));
  }
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) {
    bad_param("min_p", fmt::format("= {} is outside [0, 1]", p.min_p));
  }
  if (!(p.repeat_penalty > 0.0f) || std::isinf(p.repeat_penalty)) {
    bad_param("repeat_penalty", fmt::format("= {} must be finite and > 0", p.repeat_penalty));
  }
  if (p.repeat_last_n < 0) {
    bad_param("repeat_last_n", fmt::format("= {} must be >= 0", p.repeat_last_n));
  }
}

uint64_t resolve_seed(uint64_t seed) {
  if (seed != kRandomSeed) return seed;
  // A 32-bit value other than kRandomSeed, so the seed a run reports can be passed back (-s).
  std::random_device rd;
  uint64_t s;
  do {
    s = static_cast<uint32_t>(rd());
  } while (s == kRandomSeed);
  return s;
}

/// Uniform double in [0, 1) from the top 53 bits of one mt19937_64 draw.
double uniform01(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

/// Candidate order: higher logit first, ties to the lower id (deterministic everywhere).
bool higher_first(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
  if (a.first != b.first) return a.first > b.first;
  return a.second < b.second;
}

}  // namespace

Sampler::Sampler(SamplerParams params, int32_t n_vocab)
    : params_(params), n_vocab_(n_vocab), seed_(0) {
  validate(params_, n_vocab_);
  seed_ = resolve_seed(params_.seed);
  rng_.seed(seed_);
}

void Sampler::accept(int32_t token) {
  if (token < 0 || token >= n_vocab_) {
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("sampler: accepted token {} is outside [0, {})", token, n_vocab_));
  }
  if (params_.repeat_last_n == 0) return;
  recent_.push_back(token);
  while (recent_.size() > static_cast<size_t>(params_.repeat_last_n)) recent_.pop_front();
}

void Sampler::reset() {
  recent_.clear();
  rng_.seed(seed_);
}

int32_t Sampler::sample(std::span<const float> logits) {
  if (logits.size() != static_cast<size_t>(n_vocab_)) {
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("sampler: logits has {} entries, expected n_vocab = {}", logits.size(),
                            n_vocab_));
  }
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (params_.temp <= 0.0f && (params_.repeat_penalty == 1.0f || recent_.empty())) {
    // Greedy without a penalty: one pass over the logits, no candidate list (the pass below
    // writes n_vocab pairs first: about 0.2 ms per token at 151,936). Same choice: NaN counts
    // as -inf, ties go to the lower id.
    size_t best = 0;
    float best_v = std::isnan(logits[0]) ? kNegInf : logits[0];
    for (size_t i = 1; i < logits.size(); ++i)
      if (logits[i] > best_v) best_v = logits[i], best = i;
    return static_cast<int32_t>(best);
  }
  cand_.resize(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) {
    const float l = logits[i];
    cand_[i] = {std::isnan(l) ? kNegInf : l, static_cast<int32_t>(i)};
  }

  // Repetition penalty (CTRL, Keskar et al. 2019, as llama.cpp applies it): once per distinct
  // token of the window; positive logits are divided by the penalty, negative multiplied.
  if (params_.repeat_penalty != 1.0f && !recent_.empty()) {
    const std::unordered_set<int32_t> seen(recent_.begin(), recent_.end());
    for (int32_t t : seen) {
      float& l = cand_[t].first;
      l = l > 0.0f ? l / params_.repeat_penalty : l * params_.repeat_penalty;
    }
  }

  if (params_.temp <= 0.0f) {
    const auto best = std::min_element(cand_.begin(), cand_.end(), higher_first);
    return best->second;
  }

  // Top-k: the k highest logits, sorted; otherwise sort everything (top-p needs the order).
  size_t n = cand_.size();
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < n) {
    n = static_cast<size_t>(params_.top_k);
    std::partial_sort(cand_.begin(), cand_.begin() + n, cand_.end(), higher_first);
  } else {
    std::sort(cand_.begin(), cand_.end(), higher_first);
  }
  const float max_logit = cand_[0].first;
  // All -inf (nothing possible) or a +inf logit: the first candidate, without a draw.
  if (std::isinf(max_logit)) return cand_[0].second;

  // Top-p (nucleus, Holtzman et al. 2019) on the softmax of the candidates at temperature 1:
  // the smallest prefix whose probability mass reaches top_p, at least one token.
  if (params_.top_p < 1.0f) {
    double sum = 0.0;
    for (size_t i = 0; i < n; ++i) sum += std::exp(double(cand_[i].first) - max_logit);
    const double target = double(params_.top_p) * sum;
    double cum = 0.0;
    size_t keep = n;
    for (size_t i = 0; i < n; ++i) {
      cum += std::exp(double(cand_[i].first) - max_logit);
      if (cum >= target) {
        keep = i + 1;
        break;
      }
    }
    n = std::max<size_t>(keep, 1);
  }

  // Min-p: keep p_i >= min_p * p_max, i.e. logit_i >= max_logit + log(min_p).
  if (params_.min_p > 0.0f) {
    const double threshold = double(max_logit) + std::log(double(params_.min_p));
    size_t keep = 1;
    while (keep < n && double(cand_[keep].first) >= threshold) ++keep;
    n = keep;
  }

  // Temperature, softmax, and one draw by inverse CDF over the sorted candidates.
  const double inv_temp = 1.0 / double(params_.temp);
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) sum += std::exp((double(cand_[i].first) - max_logit) * inv_temp);
  const double target = uniform01(rng_) * sum;
  double cum = 0.0;
  for (size_t i = 0; i < n; ++i) {
    cum += std::exp((double(cand_[i].first) - max_logit) * inv_temp);
    if (target < cum) return cand_[i].second;
  }
  return cand_[n - 1].second;
}

}  // namespace berth
