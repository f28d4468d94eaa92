// Sampler: greedy, determinism, the RNG/draw golden, each filter of the chain checked by the set
// of ids that can appear and by observed frequencies against the renormalised probabilities,
// repetition penalty, and parameter validation.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "berth/core/error.h"
#include "berth/runtime/sampler.h"

using berth::ErrorCategory;
using berth::Sampler;
using berth::SamplerParams;

namespace {

/// Params with every filter off and temperature 1: a plain draw from softmax(logits).
SamplerParams plain(uint64_t seed = 7) {
  SamplerParams p;
  p.temp = 1.0f;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  p.repeat_penalty = 1.0f;
  p.seed = seed;
  return p;
}

/// Logits whose softmax is exactly `probs` (up to float rounding): log p.
std::vector<float> logits_of(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(static_cast<float>(std::log(p)));
  return l;
}

/// Draws `n` tokens and returns the observed frequency of each id.
std::vector<double> frequencies(Sampler& s, const std::vector<float>& logits, int n) {
  std::vector<double> f(logits.size(), 0.0);
  for (int i = 0; i < n; ++i) f[s.sample(logits)] += 1.0;
  for (double& x : f) x /= n;
  return f;
}

/// Observed frequencies equal `expected` within `tol` each; ids expected at 0 never appear.
void check_frequencies(const std::vector<double>& observed, const std::vector<double>& expected,
                       double tol) {
  REQUIRE(observed.size() == expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    INFO("id ", i, " observed ", observed[i], " expected ", expected[i]);
    if (expected[i] == 0.0) {
      CHECK(observed[i] == 0.0);
    } else {
      CHECK(std::abs(observed[i] - expected[i]) <= tol);
    }
  }
}

template <typename F>
void check_invalid(F&& f, const std::string& field) {
  bool thrown = false;
  try {
    f();
  } catch (const berth::Error& e) {
    thrown = true;
    CHECK(e.category() == ErrorCategory::invalid_argument);
    INFO("message: ", e.what());
    CHECK(std::string(e.what()).find(field) != std::string::npos);
  }
  CHECK(thrown);
}

// A hand-made distribution, ids deliberately not in probability order:
// id 2: 0.50, id 0: 0.20, id 4: 0.15, id 1: 0.10, id 3: 0.05.
const std::vector<double> kProbs = {0.20, 0.10, 0.50, 0.05, 0.15};
constexpr int kDraws = 10000;
constexpr double kTol = 0.02;  // about 4 standard deviations at p = 0.5, n = 10000

}  // namespace

TEST_CASE("sampler: greedy picks the highest logit, ties to the lowest id") {
  SamplerParams p = plain();
  p.temp = 0.0f;
  Sampler s(p, 5);
  CHECK(s.sample(std::vector<float>{1.0f, 5.0f, 3.0f, 5.0f, -2.0f}) == 1);
  CHECK(s.sample(std::vector<float>{-3.0f, -1.0f, -2.0f, -1.0f, -5.0f}) == 1);
  CHECK(s.sample(std::vector<float>{0.0f, 0.0f, 0.0f, 0.0f, 0.0f}) == 0);
  CHECK(s.sample(std::vector<float>{0.0f, 0.0f, 0.0f, 0.0f, 9.0f}) == 4);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(s.sample(std::vector<float>{nan, -1.0f, nan, 2.0f, nan}) == 3);  // NaN never wins
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(s.sample(std::vector<float>{nan, nan, nan, nan, nan}) == 0);     // NaN counts as -inf
  CHECK(s.sample(std::vector<float>{nan, -inf, -inf, nan, -inf}) == 0);  // ... so ties with it
  CHECK(s.sample(std::vector<float>{-inf, nan, inf, inf, 1.0f}) == 2);
  p.temp = -1.0f;  // negative is greedy too
  Sampler neg(p, 3);
  CHECK(neg.sample(std::vector<float>{0.5f, 0.7f, 0.7f}) == 1);
}

TEST_CASE("sampler: the draw is berth's own: golden from mt19937_64's standard value") {
  // C++ [rand.predef]: the 10000th output of a default-constructed mt19937_64 (seed 5489) is
  // 9981545732273789042. With 256 equal logits the draw is floor(u * 256) with
  // u = (x >> 11) * 2^-53, i.e. x >> 56 = 138.
  Sampler s(plain(5489), 256);
  const std::vector<float> flat(256, 0.0f);
  int32_t last = -1;
  for (int i = 0; i < 10000; ++i) last = s.sample(flat);
  CHECK(last == 138);
}

TEST_CASE("sampler: same seed, same sequence; different seeds differ; reset replays") {
  const std::vector<float> logits = {0.1f, 0.3f, -0.2f, 0.0f, 0.25f, 0.05f, -0.1f, 0.2f};
  const auto run = [&](Sampler& s, int n) {
    std::vector<int32_t> out;
    for (int i = 0; i < n; ++i) {
      out.push_back(s.sample(logits));
      s.accept(out.back());
    }
    return out;
  };
  SamplerParams p = plain(42);
  p.repeat_penalty = 1.1f;  // state from accept() must replay too
  Sampler a(p, 8), b(p, 8);
  const auto seq_a = run(a, 200);
  CHECK(seq_a == run(b, 200));
  a.reset();
  CHECK(run(a, 200) == seq_a);
  p.seed = 43;
  Sampler c(p, 8);
  CHECK(run(c, 200) != seq_a);
  CHECK(a.seed() == 42);
  CHECK(c.seed() == 43);

  // 0xFFFFFFFF asks for a random seed; seed() reports it and reproduces the stream.
  SamplerParams r = plain(0xFFFFFFFFu);
  Sampler rnd(r, 8);
  CHECK(rnd.seed() != 0xFFFFFFFFu);
  r.seed = rnd.seed();
  Sampler again(r, 8);
  CHECK(run(rnd, 100) == run(again, 100));
}

TEST_CASE("sampler: top_k = 1 equals greedy at any temperature") {
  std::mt19937 gen(3);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  SamplerParams g = plain();
  g.temp = 0.0f;
  Sampler greedy(g, 64);
  for (float temp : {0.5f, 1.0f, 5.0f, 100.0f}) {
    SamplerParams p = plain(11);
    p.top_k = 1;
    p.temp = temp;
    Sampler s(p, 64);
    for (int trial = 0; trial < 50; ++trial) {
      std::vector<float> logits(64);
      for (float& l : logits) l = normal(gen);
      CHECK(s.sample(logits) == greedy.sample(logits));
    }
  }
}

TEST_CASE("sampler: no filter draws from the softmax") {
  Sampler s(plain(1), 5);
  check_frequencies(frequencies(s, logits_of(kProbs), kDraws), kProbs, kTol);
}

TEST_CASE("sampler: top_k keeps the k most likely") {
  SamplerParams p = plain(2);
  p.top_k = 2;  // ids 2 (0.5) and 0 (0.2)
  Sampler s(p, 5);
  check_frequencies(frequencies(s, logits_of(kProbs), kDraws), {0.2 / 0.7, 0, 0.5 / 0.7, 0, 0},
                    kTol);
}

TEST_CASE("sampler: top_p keeps the smallest set reaching the mass") {
  SamplerParams p = plain(3);
  p.top_p = 0.8f;  // 0.5, 0.7, 0.85 >= 0.8: ids 2, 0, 4
  Sampler s(p, 5);
  check_frequencies(frequencies(s, logits_of(kProbs), kDraws),
                    {0.2 / 0.85, 0, 0.5 / 0.85, 0, 0.15 / 0.85}, kTol);

  p.top_p = 0.0f;  // keeps at least one token: the most likely
  Sampler one(p, 5);
  check_frequencies(frequencies(one, logits_of(kProbs), 1000), {0, 0, 1, 0, 0}, 0.0);

  p.top_p = 0.45f;  // reached by the first token alone
  Sampler half(p, 5);
  check_frequencies(frequencies(half, logits_of(kProbs), 1000), {0, 0, 1, 0, 0}, 0.0);
}

TEST_CASE("sampler: min_p keeps p >= min_p * p_max") {
  SamplerParams p = plain(4);
  p.min_p = 0.35f;  // threshold 0.175: ids 2 (0.5) and 0 (0.2)
  Sampler s(p, 5);
  check_frequencies(frequencies(s, logits_of(kProbs), kDraws), {0.2 / 0.7, 0, 0.5 / 0.7, 0, 0},
                    kTol);
  p.min_p = 0.25f;  // threshold 0.125: ids 2, 0, 4
  Sampler s2(p, 5);
  check_frequencies(frequencies(s2, logits_of(kProbs), kDraws),
                    {0.2 / 0.85, 0, 0.5 / 0.85, 0, 0.15 / 0.85}, kTol);
}

TEST_CASE("sampler: temperature applies after top_p, before the draw") {
  // top_p on the temperature-1 distribution keeps ids 2, 0, 4 (at temperature 2 it would keep
  // four). The draw then uses p^(1/2), renormalised over those three.
  SamplerParams p = plain(5);
  p.top_p = 0.8f;
  p.temp = 2.0f;
  Sampler s(p, 5);
  const double a = std::sqrt(0.2), b = std::sqrt(0.5), c = std::sqrt(0.15), z = a + b + c;
  check_frequencies(frequencies(s, logits_of(kProbs), kDraws), {a / z, 0, b / z, 0, c / z}, kTol);

  p.top_p = 1.0f;
  p.temp = 0.5f;  // p^2
  Sampler cold(p, 5);
  double sum = 0;
  for (double q : kProbs) sum += q * q;
  std::vector<double> expected;
  for (double q : kProbs) expected.push_back(q * q / sum);
  check_frequencies(frequencies(cold, logits_of(kProbs), kDraws), expected, kTol);
}

TEST_CASE("sampler: repetition penalty changes a greedy choice") {
  SamplerParams p = plain();
  p.temp = 0.0f;
  p.repeat_penalty = 1.5f;
  p.repeat_last_n = 2;
  Sampler s(p, 4);
  const std::vector<float> pos = {2.0f, 1.8f, -1.0f, -1.1f};
  CHECK(s.sample(pos) == 0);
  s.accept(0);
  CHECK(s.sample(pos) == 1);  // 2.0 / 1.5 = 1.33 < 1.8
  s.accept(3);
  s.accept(3);  // 0 leaves the window of 2
  CHECK(s.sample(pos) == 0);

  // Negative logits are multiplied: -1.0 * 1.5 = -1.5 < -1.2.
  s.reset();
  s.accept(0);
  CHECK(s.sample(std::vector<float>{-1.0f, -1.2f, -3.0f, -3.0f}) == 1);

  // Once per distinct token, however often it repeats: 2.0 / 1.5 = 1.33 > 1.0 still wins
  // (twice would give 0.89).
  s.reset();
  s.accept(0);
  s.accept(0);
  CHECK(s.sample(std::vector<float>{2.0f, 1.0f, -3.0f, -3.0f}) == 0);

  // repeat_last_n = 0 turns it off; logits are not modified by sample().
  p.repeat_last_n = 0;
  Sampler off(p, 4);
  off.accept(0);
  CHECK(off.sample(pos) == 0);
  CHECK(pos[0] == 2.0f);
}

TEST_CASE("sampler: invalid parameters throw invalid_argument naming the field") {
  const auto make = [](SamplerParams p, int32_t n_vocab = 4) { Sampler s(p, n_vocab); };
  SamplerParams p = plain();
  p.top_p = -0.1f;
  check_invalid([&] { make(p); }, "top_p");
  p.top_p = 1.1f;
  check_invalid([&] { make(p); }, "top_p");
  p = plain();
  p.min_p = -0.01f;
  check_invalid([&] { make(p); }, "min_p");
  p.min_p = 1.5f;
  check_invalid([&] { make(p); }, "min_p");
  p = plain();
  p.repeat_penalty = 0.0f;
  check_invalid([&] { make(p); }, "repeat_penalty");
  p.repeat_penalty = -1.0f;
  check_invalid([&] { make(p); }, "repeat_penalty");
  p.repeat_penalty = std::numeric_limits<float>::quiet_NaN();
  check_invalid([&] { make(p); }, "repeat_penalty");
  p = plain();
  p.repeat_last_n = -1;
  check_invalid([&] { make(p); }, "repeat_last_n");
  p = plain();
  p.temp = std::numeric_limits<float>::quiet_NaN();
  check_invalid([&] { make(p); }, "temp");
  check_invalid([&] { make(plain(), 0); }, "n_vocab");
  check_invalid([&] { make(plain(), -3); }, "n_vocab");

  Sampler s(plain(), 4);
  check_invalid([&] { s.sample(std::vector<float>{1.0f, 2.0f, 3.0f}); }, "logits");
  check_invalid([&] { s.accept(4); }, "token");
  check_invalid([&] { s.accept(-1); }, "token");

  // The defaults are valid.
  Sampler defaults(SamplerParams{}, 4);
  CHECK(defaults.params().top_k == 40);
}
