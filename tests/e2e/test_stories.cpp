// End to end on the real stories260K model: the CLI's golden output, and the optimised forward's
// logits against the naive double-precision oracle over a whole greedy run.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/models/tokenizer.h"
#include "berth/runtime/session.h"
#include "naive_llama.h"
#include "test_util.h"

using namespace berth;

namespace {

const std::vector<int32_t> kPromptIds = {1, 403, 407, 261, 378};  // "Once upon a time" with BOS

/// max_i |a_i - b_i| / max_i |b_i|: the error relative to the scale of the reference logits.
double max_rel_error(std::span<const float> a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return num / den;
}

int32_t argmax(std::span<const float> x) {
  return static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
}

}  // namespace

TEST_CASE("berth run prints the golden stories260K continuation with -t 1 and -t 2") {
  for (int threads : {1, 2}) {
    CAPTURE(threads);
    test::CommandResult r = test::run_command(
        test::berth_bin() + " run -m " + test::shell_quote(test::stories260k().string()) +
        " -p 'Once upon a time' -n 64 --temp 0 -t " + std::to_string(threads));
    CHECK_FALSE(r.signaled);
    CHECK(r.exit_code == 0);
    CHECK(r.out == test::kStoriesContinuation);
    CHECK(r.err.find("tok/s") != std::string::npos);
  }
}

TEST_CASE("berth tokenize prints the ids of the golden prompt") {
  test::CommandResult r =
      test::run_command(test::berth_bin() + " tokenize -m " +
                        test::shell_quote(test::stories260k().string()) + " -p 'Once upon a time'");
  CHECK(r.exit_code == 0);
  CHECK(r.out == "[1, 403, 407, 261, 378]\n");
}

TEST_CASE("optimised forward matches the naive f64 oracle over a 64-token greedy run") {
  gguf::File file = gguf::File::open(test::stories260k().string());
  std::unique_ptr<Model> model = load_model(file);
  oracle::NaiveLlama ref(file, 128);

  for (int threads : {1, 2}) {
    CAPTURE(threads);
    ref.reset();
    Session s(*model, SessionParams{.n_threads = threads, .n_ctx = 128, .n_ubatch = 512});
    // Prefill: compare every prompt position's logits.
    std::span<const float> all = s.eval(kPromptIds, /*all_logits=*/true);
    const size_t V = static_cast<size_t>(model->hparams().n_vocab);
    double worst = 0;
    std::vector<double> ref_logits;
    for (size_t i = 0; i < kPromptIds.size(); ++i) {
      ref_logits = ref.step(kPromptIds[i]);
      worst = std::max(worst, max_rel_error(all.subspan(i * V, V), ref_logits));
    }
    // Decode: 64 greedy tokens, the oracle fed the same tokens.
    std::vector<float> logits(all.end() - V, all.end());
    std::vector<int32_t> generated;
    for (int step = 0; step < 64; ++step) {
      const int32_t next = argmax(logits);
      generated.push_back(next);
      const int32_t one[1] = {next};
      std::span<const float> l = s.eval(one);
      logits.assign(l.begin(), l.end());
      ref_logits = ref.step(next);
      worst = std::max(worst, max_rel_error(logits, ref_logits));
    }
    MESSAGE("max relative logit error vs the f64 oracle: ", worst);
    CHECK(worst < 1e-4);
    std::unique_ptr<Tokenizer> tok = Tokenizer::from_gguf(file);
    CHECK(tok->decode(generated) == test::kStoriesContinuation);
  }
}

TEST_CASE("thread count and ubatch size do not change the logits bit for bit") {
  gguf::File file = gguf::File::open(test::stories260k().string());
  std::unique_ptr<Model> model = load_model(file);
  std::vector<int32_t> prompt = kPromptIds;
  for (int i = 0; i < 20; ++i) prompt.push_back(static_cast<int32_t>(3 + (i * 37) % 500));

  auto run = [&](int threads, int ubatch) {
    Session s(*model, SessionParams{.n_threads = threads, .n_ctx = 64, .n_ubatch = ubatch});
    std::span<const float> l = s.eval(prompt, /*all_logits=*/true);
    return std::vector<float>(l.begin(), l.end());
  };
  const std::vector<float> base = run(1, 512);
  CHECK(run(2, 512) == base);
  CHECK(run(1, 1) == base);
  CHECK(run(2, 7) == base);
}

TEST_CASE("session bounds: context overflow, bad ids and truncate") {
  gguf::File file = gguf::File::open(test::stories260k().string());
  std::unique_ptr<Model> model = load_model(file);
  Session s(*model, SessionParams{.n_threads = 1, .n_ctx = 8});
  const std::vector<int32_t> nine(9, 5);
  CHECK_THROWS_AS(s.eval(nine), Error);
  CHECK(s.n_past() == 0);
  const int32_t bad[1] = {512};
  CHECK_THROWS_AS(s.eval(bad), Error);
  CHECK(s.n_past() == 0);
  // Truncating and re-evaluating gives the same logits as the first time.
  std::span<const float> a = s.eval(kPromptIds);
  const std::vector<float> first(a.begin(), a.end());
  s.truncate(2);
  std::span<const float> b = s.eval(std::span(kPromptIds).subspan(2));
  CHECK(std::vector<float>(b.begin(), b.end()) == first);
}
