// Helpers of the runtime suites that compare placements: greedy runs of a Session, bit-for-bit
// and NMSE comparisons of their logits, and the device the device cases run on.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "berth/backends/device.h"
#include "berth/runtime/session.h"

namespace berth::test {

/// Whether the device cases run on the CUDA backend (BERTH_TEST_DEVICE=cuda, on a GPU machine)
/// instead of the simulated device.
inline bool use_cuda() {
  const char* e = std::getenv("BERTH_TEST_DEVICE");
  return e && std::string(e) == "cuda";
}

/// The device of the device cases: CUDA device 0 when use_cuda(), else a simulated device of
/// `capacity` bytes whose kCopy copies first sleep `copy_delay_us` microseconds.
inline std::unique_ptr<Device> test_device(size_t capacity = size_t{2} << 30,
                                           int64_t copy_delay_us = 0) {
  if (use_cuda()) return make_cuda_device(0);
  return make_sim_device(capacity, copy_delay_us);
}

/// The greedy tokens of a run and the logits (n_vocab floats each) each was chosen from: the
/// prompt's last row, then each decode step.
struct Run {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;
};

/// The index of the largest element (the first of equals).
inline int32_t argmax(std::span<const float> x) {
  return static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
}

/// `n` greedy steps after `prompt` through Session::eval; the last chosen token is fed too
/// (the session then holds prompt + n tokens) unless `feed_last` is false.
inline Run greedy(Session& s, const std::vector<int32_t>& prompt, int n, bool feed_last = true) {
  Run r;
  std::span<const float> l = s.eval(prompt);
  for (int i = 0; i < n; ++i) {
    r.logits.emplace_back(l.begin(), l.end());
    const int32_t t = argmax(l);
    r.tokens.push_back(t);
    if (feed_last || i + 1 < n) l = s.eval(std::span<const int32_t>(&t, 1));
  }
  return r;
}

/// Top-2 logit gap under which an f16 KV cache may flip a greedy choice (a placement that keeps
/// K and V in f16 against the CPU-only run's f32).
inline constexpr double kTieBand = 1e-2;

/// 1 when the first step whose tokens differ has a reference top-2 logit gap wider than `band`
/// (a difference inside the band is a tie the KV cache's f16 rounding may flip; after the first
/// differing step the sequences may diverge and are not compared further), else 0.
inline int hard_mismatches(const Run& got, const Run& ref, double band) {
  for (size_t s = 0; s < ref.tokens.size(); ++s) {
    if (got.tokens[s] == ref.tokens[s]) continue;
    std::vector<float> l = ref.logits[s];
    std::partial_sort(l.begin(), l.begin() + 2, l.end(), std::greater<float>());
    return l[0] - l[1] > band ? 1 : 0;
  }
  return 0;
}

/// The same tokens and the same logits, bit for bit, at every step (any type with `tokens` and
/// `logits` as in Run).
template <class R>
bool same_bits(const R& a, const R& b) {
  if (a.tokens != b.tokens || a.logits.size() != b.logits.size()) return false;
  for (size_t s = 0; s < a.logits.size(); ++s)
    if (a.logits[s].size() != b.logits[s].size() ||
        std::memcmp(a.logits[s].data(), b.logits[s].data(), a.logits[s].size() * 4) != 0)
      return false;
  return true;
}

/// sum (a - b)^2 / sum b^2 over the steps both have.
inline double nmse(const Run& a, const Run& b) {
  double num = 0, den = 0;
  for (size_t s = 0; s < std::min(a.logits.size(), b.logits.size()); ++s)
    for (size_t i = 0; i < a.logits[s].size(); ++i) {
      const double d = static_cast<double>(a.logits[s][i]) - b.logits[s][i];
      num += d * d;
      den += static_cast<double>(b.logits[s][i]) * b.logits[s][i];
    }
  return num / den;
}

}  // namespace berth::test
