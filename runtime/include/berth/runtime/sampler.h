// Token sampler: turns one position's logits into a token id.
//
// The chain and defaults follow llama.cpp's common sampler (common/sampling.cpp): repetition
// penalty over the last `repeat_last_n` tokens, then top-k, top-p, min-p, temperature, and a
// draw from the softmax. Temperature <= 0 means greedy: the highest logit, ties going to the
// lowest token id, with no randomness.
#pragma once

#include <cstdint>
#include <deque>
#include <random>
#include <span>
#include <vector>

namespace berth {

struct SamplerParams {
  float temp = 0.8f;            ///< <= 0: greedy
  int32_t top_k = 40;           ///< <= 0: off (all tokens)
  float top_p = 0.95f;          ///< >= 1: off
  float min_p = 0.05f;          ///< <= 0: off; keep tokens with p >= min_p * p_max
  float repeat_penalty = 1.0f;  ///< 1: off; > 1 divides positive logits / multiplies negative
  int32_t repeat_last_n = 64;   ///< window of recent tokens the penalty looks at (0: off)
  uint64_t seed = 0xFFFFFFFFu;  ///< 0xFFFFFFFF: a random seed (as llama.cpp's LLAMA_DEFAULT_SEED)
};

/// Stateful sampler for one sequence. Same seed, same logits, same accepted tokens -> same
/// output, on every platform (the RNG and the draw are berth's own, not the standard
/// library's distributions).
class Sampler {
 public:
  /// Throws Error(invalid_argument) naming the field for out-of-range params: n_vocab <= 0,
  /// temp NaN, top_p or min_p outside [0, 1], repeat_penalty not finite and > 0,
  /// repeat_last_n < 0.
  Sampler(SamplerParams params, int32_t n_vocab);

  /// Picks a token from `logits` (n_vocab floats, indexed by token id). Does not modify
  /// `logits` and does not record the token: call accept() with the token that is actually
  /// used. NaN logits count as -inf. Top-p is measured on the softmax before temperature (as
  /// llama.cpp's chain does). Throws Error(invalid_argument) when logits.size() != n_vocab.
  int32_t sample(std::span<const float> logits);
  /// Records a token of the sequence (prompt tokens too) for the repetition penalty. Throws
  /// Error(invalid_argument) for a token outside [0, n_vocab).
  void accept(int32_t token);
  /// Forgets the accepted tokens and restarts the random stream from seed().
  void reset();

  uint64_t seed() const { return seed_; }  ///< the seed in use (the random one when asked)
  const SamplerParams& params() const { return params_; }

 private:
  SamplerParams params_;
  int32_t n_vocab_;
  uint64_t seed_;
  std::mt19937_64 rng_;
  std::deque<int32_t> recent_;
  std::vector<std::pair<float, int32_t>> cand_;  // scratch
};

}  // namespace berth
