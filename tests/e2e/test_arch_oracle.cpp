// Every architecture's forward against the double-precision oracle (tests/oracle), on small
// synthetic files from berth's generator; upcycled MoE files against stories260K; routing
// against the oracle's, exactly.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "berth/backends/cpu_executor.h"
#include "berth/backends/thread_pool.h"
#include "berth/cpu_kernels/ops.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/runtime/kv_cache.h"
#include "berth/runtime/session.h"
#include "berth/tools/synth.h"
#include "naive_llama.h"
#include "test_util.h"
#include "upcycle.h"

using namespace berth;

namespace {

std::string synth_file(const std::string& preset, const std::string& type, double skew = 0.0,
                       uint64_t seed = 7) {
  SynthSpec spec = synth_preset(preset);
  spec.type = type;
  spec.seed = seed;
  spec.router_skew = skew;
  const auto path = test::temp_dir("arch") / fmt::format("{}-{}-{}.gguf", preset, type, skew);
  if (!std::filesystem::exists(path)) write_synth_model(spec, path.string(), 2);
  return path.string();
}

int32_t argmax(std::span<const float> v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

struct Compare {
  double max_rel = 0;   // max over steps of max|berth - oracle| / max|oracle|
  double max_nmse = 0;  // max over steps of the logits' NMSE
  int greedy_mismatch =
      0;          // steps where berth's argmax differs from the oracle's outside the tie band
  int steps = 0;  // positions compared
};

// Prefill `prompt`, then `n` greedy steps chosen by berth; the oracle is fed the same tokens.
// Greedy agreement is checked where the oracle's top two logits are more than `tie_band` x
// max|logit| apart.
Compare compare_with_oracle(const std::string& path, const std::vector<int32_t>& prompt, int n,
                            double tie_band, int threads = 2) {
  gguf::File file = gguf::File::open(path);
  std::unique_ptr<Model> model = load_model(file);
  oracle::NaiveModel naive(file, 128);
  Session s(*model, {.n_threads = threads, .n_ctx = 128, .n_ubatch = 512});
  Compare c;
  auto check = [&](std::span<const float> got, const std::vector<double>& want) {
    double max_abs = 0, max_err = 0, err2 = 0, ref2 = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      max_abs = std::max(max_abs, std::abs(want[i]));
      const double d = got[i] - want[i];
      max_err = std::max(max_err, std::abs(d));
      err2 += d * d;
      ref2 += want[i] * want[i];
    }
    c.max_rel = std::max(c.max_rel, max_err / max_abs);
    c.max_nmse = std::max(c.max_nmse, err2 / ref2);
    // Greedy agreement, except where the oracle's top two are within the tie band.
    std::vector<double> sorted(want);
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
    const auto want_arg =
        static_cast<int32_t>(std::max_element(want.begin(), want.end()) - want.begin());
    if (argmax(got) != want_arg && sorted[0] - sorted[1] > tie_band * max_abs) ++c.greedy_mismatch;
  };
  std::span<const float> all = s.eval(prompt, /*all_logits=*/true);
  const size_t nv = static_cast<size_t>(model->hparams().n_vocab);
  std::vector<float> logits(all.begin(), all.end());
  for (size_t t = 0; t < prompt.size(); ++t) {
    const std::vector<double> want = naive.step(prompt[t]);
    check(std::span<const float>(logits).subspan(t * nv, nv), want);
    ++c.steps;
  }
  int32_t next = argmax(std::span<const float>(logits).subspan((prompt.size() - 1) * nv, nv));
  for (int i = 0; i < n; ++i) {
    std::span<const float> got = s.eval(std::span<const int32_t>(&next, 1));
    const std::vector<double> want = naive.step(next);
    check(got, want);
    ++c.steps;
    next = argmax(got);
  }
  return c;
}

std::vector<int32_t> greedy_tokens(const std::string& path, const std::vector<int32_t>& prompt,
                                   int n, int32_t n_ubatch = 512) {
  gguf::File file = gguf::File::open(path);
  std::unique_ptr<Model> model = load_model(file);
  Session s(*model, {.n_threads = 2, .n_ctx = 256, .n_ubatch = n_ubatch});
  std::vector<int32_t> out;
  std::span<const float> l = s.eval(prompt);
  for (int i = 0; i < n; ++i) {
    const int32_t next = argmax(l);
    out.push_back(next);
    l = s.eval(std::span<const int32_t>(&next, 1));
  }
  return out;
}

const std::vector<int32_t> kStoriesPrompt = {1, 403, 407, 261, 378};  // "Once upon a time"

}  // namespace

TEST_CASE("every architecture matches the double-precision oracle over 32 greedy steps") {
  struct Case {
    std::string preset;
    std::string type;
    double skew;
    double max_rel;   // bound on max|berth - oracle| / max|oracle| per step
    double max_nmse;  // bound on the logits' NMSE per step
  };
  // f32: the only differences are float vs double rounding (measured <= 6.8e-7 relative,
  // NMSE <= 3.3e-13; stories260K: 4.6e-7). q8_0 and q4_K: the oracle decodes the same quantized
  // weights, so the difference is the 8-bit quantization of berth's activations (Q8_0 blocks
  // of 32, Q8_K blocks of 256): measured NMSE <= 1.4e-3, max rel <= 4.2e-2; greedy
  // tokens must agree where the oracle's top two differ by more than the max rel bound.
  // Quantized MoE files are not compared here: their 4 experts give routing near-ties every
  // few tokens, where 8-bit activations may pick the other expert (a real, expected flip, not
  // an error); tests/runtime/test_moe.cpp checks quantized expert math against double
  // precision with the routing fixed.
  const Case cases[] = {
      {"tiny-llama", "f32", 0, 1e-5, 1e-11},
      {"tiny-qwen2", "f32", 0, 1e-5, 1e-11},
      {"tiny-qwen3", "f32", 0, 1e-5, 1e-11},
      {"tiny-qwen3moe", "f32", 0, 1e-5, 1e-11},
      {"tiny-qwen3moe", "f32", 1.0, 1e-5, 1e-11},
      {"tiny-mixtral", "f32", 0, 1e-5, 1e-11},
      {"tiny-llama", "q8_0", 0, 0.1, 5e-3},
      {"tiny-llama", "q4_k", 0, 0.1, 5e-3},
      {"tiny-qwen3", "q4_k", 0, 0.1, 5e-3},
      {"tiny-qwen2", "q8_0", 0, 0.1, 5e-3},
      // The Qwen3.5 hybrids (H_k != H_v in tiny-qwen35 and tiny-qwen35moe). Measured: f32 max rel
      // 1.2e-6; q8_0 max rel 0.060, NMSE 3.1e-3, about 5x the dense files' (not yet explained;
      // a guess: the recurrent state carries the activations' rounding from token to token).
      // q4_k (NMSE 1.1e-2) is outside the dense band and not listed.
      {"tiny-qwen35", "f32", 0, 1e-5, 1e-11},
      {"tiny-qwen35moe", "f32", 0, 1e-5, 1e-11},
      {"tiny-qwen35", "q8_0", 0, 0.1, 5e-3},
  };
  for (const Case& c : cases) {
    INFO(c.preset, " ", c.type, " skew ", c.skew);
    const std::string path = synth_file(c.preset, c.type, c.skew);
    std::mt19937 rng(3);
    const int64_t n_vocab = gguf::File::open(path).tensor("token_embd.weight").ne[1];
    std::vector<int32_t> prompt(8);
    for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(n_vocab));
    const bool quantized = c.type != "f32";
    const Compare r = compare_with_oracle(path, prompt, 32, quantized ? c.max_rel : 1e-4);
    MESSAGE(c.preset, " ", c.type, " skew ", c.skew, ": ", r.steps, " positions, max rel ",
            r.max_rel, ", max nmse ", r.max_nmse);
    CHECK(r.steps == 40);
    CHECK(r.max_rel < c.max_rel);
    CHECK(r.max_nmse < c.max_nmse);
    CHECK(r.greedy_mismatch == 0);
  }
}

TEST_CASE(
    "upcycled stories260K (4 identical experts, random router) generates stories260K's tokens") {
  const std::string src = test::stories260k().string();
  const std::vector<int32_t> want = greedy_tokens(src, kStoriesPrompt, 64);
  const auto dir = test::temp_dir("upcycle");
  for (auto style : {oracle::UpcycleStyle::mixtral, oracle::UpcycleStyle::qwen3moe}) {
    const std::string dst =
        (dir / (style == oracle::UpcycleStyle::mixtral ? "mixtral.gguf" : "qwen3moe.gguf"))
            .string();
    oracle::write_upcycled(src, dst, style, 4, 2, 11);
    CHECK(gguf::File::open(dst).architecture() ==
          (style == oracle::UpcycleStyle::mixtral ? "llama" : "qwen3moe"));
    CHECK(greedy_tokens(dst, kStoriesPrompt, 64) == want);
    CHECK(greedy_tokens(dst, kStoriesPrompt, 64, /*n_ubatch=*/2) == want);
  }
  // Negative control: without the Q/K row permutation NeoX RoPE computes other attention.
  oracle::UpcycleOptions bad{.style = oracle::UpcycleStyle::qwen3moe, .permute_qk = false};
  {
    gguf::File f = gguf::File::open(src);
    oracle::make_upcycled(f, bad).write((dir / "unpermuted.gguf").string());
  }
  CHECK(greedy_tokens((dir / "unpermuted.gguf").string(), kStoriesPrompt, 64) != want);
}

TEST_CASE("moe_topk routes exactly as the oracle, ties included") {
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.0f, 2.0f);
  for (int n_expert : {4, 8, 128}) {
    for (int k : {1, 2, n_expert / 2}) {
      for (int row = 0; row < 200; ++row) {
        std::vector<float> logits(static_cast<size_t>(n_expert));
        for (float& l : logits) l = d(rng);
        if (row % 2 == 1)  // coarse values: many exact ties
          for (float& l : logits) l = std::round(l);
        for (bool norm : {true, false}) {
          std::vector<int32_t> ids(static_cast<size_t>(k));
          std::vector<float> w(static_cast<size_t>(k));
          cpu::moe_topk(logits.data(), n_expert, k, norm, ids.data(), w.data());
          const oracle::Routing want = oracle::route_experts(logits, k, norm);
          REQUIRE(ids == want.ids);
          for (int j = 0; j < k; ++j)
            CHECK(w[static_cast<size_t>(j)] ==
                  oracle::Routing::round_weight(want.weights[static_cast<size_t>(j)]));
        }
      }
    }
  }
}

TEST_CASE("a qwen3moe forward routes every token of a batch as the oracle does") {
  const std::string path = synth_file("tiny-qwen3moe", "f32", 1.0);
  gguf::File file = gguf::File::open(path);
  std::unique_ptr<Model> model = load_model(file);
  oracle::NaiveModel naive(file, 64);
  const Hparams& hp = model->hparams();
  const int32_t n = 24, k = static_cast<int32_t>(hp.n_expert_used);
  std::mt19937 rng(9);
  std::vector<int32_t> tokens(n), pos(n);
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(hp.n_vocab));
  std::iota(pos.begin(), pos.end(), 0);
  ThreadPool pool(2);
  KvCache kv(model->kv_layers(), 64);
  CpuExecutor ex(pool, model->weights(), kv.view());
  const graph::Graph g = model->build_step(n, 1);
  (void)ex.run(g, tokens, pos);
  std::vector<std::span<const float>> routes;
  for (const graph::Op& op : g.ops)
    if (op.kind == graph::OpKind::moe_route) routes.push_back(ex.value(g, op.output));
  REQUIRE(routes.size() == static_cast<size_t>(hp.n_layer));
  int compared = 0;
  for (int32_t t = 0; t < n; ++t) {
    (void)naive.step(tokens[static_cast<size_t>(t)]);
    for (int64_t l = 0; l < hp.n_layer; ++l) {
      const oracle::Routing& want = naive.last_routing()[static_cast<size_t>(l)];
      // Skip a token whose k-th and (k+1)-th probabilities are too close for float inputs.
      std::vector<double> p = want.probs;
      std::sort(p.begin(), p.end(), std::greater<>());
      if (p[static_cast<size_t>(k - 1)] - p[static_cast<size_t>(k)] < 1e-5) continue;
      const float* r = routes[static_cast<size_t>(l)].data() + t * 2 * k;
      for (int32_t j = 0; j < k; ++j) {
        CHECK(static_cast<int32_t>(r[j]) == want.ids[static_cast<size_t>(j)]);
        CHECK(std::abs(r[k + j] - want.weights[static_cast<size_t>(j)]) < 1e-5);
      }
      ++compared;
    }
  }
  CHECK(compared > n * hp.n_layer * 3 / 4);
}

TEST_CASE("MoE models: ubatch size and thread count change no bit of the logits") {
  const std::string path = synth_file("tiny-qwen3moe", "q4_k", 1.0);
  gguf::File file = gguf::File::open(path);
  std::unique_ptr<Model> model = load_model(file);
  std::vector<int32_t> tokens(40);
  std::mt19937 rng(2);
  for (int32_t& t : tokens)
    t = static_cast<int32_t>(rng() % static_cast<uint32_t>(model->hparams().n_vocab));
  auto logits = [&](int threads, int32_t ub) {
    Session s(*model, {.n_threads = threads, .n_ctx = 64, .n_ubatch = ub});
    std::span<const float> l = s.eval(tokens, true);
    return std::vector<float>(l.begin(), l.end());
  };
  const std::vector<float> ref = logits(2, 512);
  CHECK(logits(1, 512) == ref);
  CHECK(logits(2, 1) == ref);
  CHECK(logits(2, 7) == ref);
}
