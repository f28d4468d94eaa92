// Mixture-of-Experts ops of the step graph (moe_route, moe_experts) on the CPU executor, against
// a double-precision computation written out in the test: routing, grouped expert GEMMs for
// ubatches of 1..512 tokens, several tokens on one expert, an expert no token picks, expert
// subsets that add up to the whole layer, and bit-identical results across ubatch splits and
// thread counts.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "berth/backends/cpu_executor.h"
#include "berth/backends/thread_pool.h"
#include "berth/core/error.h"
#include "berth/core/types.h"
#include "berth/cpu_kernels/ops.h"
#include "berth/cpu_kernels/quants_ref.h"
#include "berth/graph/graph.h"
#include "berth/runtime/kv_cache.h"

using namespace berth;

namespace {

constexpr int64_t kEmbd = 256, kFf = 512, kVocab = 600;
constexpr int32_t kExperts = 8, kUsed = 2, kDeadExpert = 7;

struct Weight {
  std::vector<uint8_t> bytes;
  std::vector<double> deq;  // dequantized, row-major, ne0 contiguous
  TensorView view;
};

// A weight of `type` with ne = {ne0, ne1, ne2}, Gaussian values of std `scale` plus `offset`
// (quantized with the reference quantizer; `deq` holds what the file would decode to).
Weight make_weight(const char* name, GgmlType type, int64_t ne0, int64_t ne1, int64_t ne2,
                   uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  const int64_t rows = ne1 * ne2;
  std::vector<float> f(static_cast<size_t>(ne0 * rows));
  for (float& x : f) x = d(rng);
  Weight w;
  const size_t rb = row_bytes(type, ne0);
  w.bytes.resize(rb * static_cast<size_t>(rows));
  std::vector<float> back(static_cast<size_t>(ne0));
  w.deq.resize(f.size());
  for (int64_t r = 0; r < rows; ++r) {
    ref::quantize_row(type, f.data() + r * ne0, w.bytes.data() + rb * static_cast<size_t>(r), ne0);
    ref::dequantize_row(type, w.bytes.data() + rb * static_cast<size_t>(r), back.data(), ne0);
    for (int64_t i = 0; i < ne0; ++i)
      w.deq[static_cast<size_t>(r * ne0 + i)] = back[static_cast<size_t>(i)];
  }
  w.view.name = name;
  w.view.type = type;
  w.view.ne = {ne0, ne1, ne2, 1};
  w.view.n_dims = ne2 > 1 ? 3 : 2;
  w.view.data = w.bytes.data();
  w.view.n_bytes = w.bytes.size();
  return w;
}

struct MoeFixture {
  Weight embd, router, gate, up, down;
  graph::WeightTable wt;
  graph::WeightId id_embd, id_router, id_gate, id_up, id_down;

  explicit MoeFixture(GgmlType type) {
    embd = make_weight("token_embd.weight", GgmlType::F32, kEmbd, kVocab, 1, 1, 1.0f);
    router = make_weight("ffn_gate_inp.weight", GgmlType::F32, kEmbd, kExperts, 1, 2, 0.1f);
    // Every embedding row shares a component along dimension 0; the dead expert's router row
    // weighs it with -50, so no token ever picks that expert.
    auto* e = reinterpret_cast<float*>(embd.bytes.data());
    for (int64_t t = 0; t < kVocab; ++t) {
      e[t * kEmbd] = 4.0f;
      embd.deq[static_cast<size_t>(t * kEmbd)] = 4.0;
    }
    auto* r = reinterpret_cast<float*>(router.bytes.data());
    r[kDeadExpert * kEmbd] = -50.0f;
    router.deq[static_cast<size_t>(kDeadExpert * kEmbd)] = -50.0;
    gate = make_weight("ffn_gate_exps.weight", type, kEmbd, kFf, kExperts, 3, 0.06f);
    up = make_weight("ffn_up_exps.weight", type, kEmbd, kFf, kExperts, 4, 0.06f);
    down = make_weight("ffn_down_exps.weight", type, kFf, kEmbd, kExperts, 5, 0.06f);
    id_embd = wt.add(embd.view);
    id_router = wt.add(router.view);
    id_gate = wt.add(gate.view);
    id_up = wt.add(up.view);
    id_down = wt.add(down.view);
  }

  graph::MoeParams params(std::vector<int32_t> experts = {}, int32_t slot_begin = 0,
                          int32_t slot_end = -1) const {
    return graph::MoeParams{.n_expert = kExperts,
                            .n_expert_used = kUsed,
                            .norm_weights = true,
                            .gate = id_gate,
                            .up = id_up,
                            .down = id_down,
                            .experts = std::move(experts),
                            .slot_begin = slot_begin,
                            .slot_end = slot_end};
  }

  // As build, with one op per range of route slots [first, second) instead.
  graph::Graph build_slots(int32_t n_tok, const std::vector<std::pair<int32_t, int32_t>>& ranges,
                           std::vector<int32_t> experts = {}) const {
    graph::Builder b(wt, n_tok);
    graph::ValueId h = b.embed(id_embd, "h");
    graph::ValueId route = b.moe_route(b.matmul(h, id_router, "router"), params(), "route");
    graph::ValueId out = graph::kNoValue;
    for (const auto& [s0, s1] : ranges) {
      graph::ValueId part = b.moe_experts(h, route, params(experts, s0, s1), "moe");
      out = out == graph::kNoValue ? part : b.add(out, part, "sum");
    }
    return b.finish(out);
  }

  // Graph: h = embed(token); route = moe_route(router h); out = sum of moe_experts over the
  // given expert subsets (one op per subset).
  graph::Graph build(int32_t n_tok, const std::vector<std::vector<int32_t>>& subsets) const {
    graph::Builder b(wt, n_tok);
    graph::ValueId h = b.embed(id_embd, "h");
    graph::ValueId route = b.moe_route(b.matmul(h, id_router, "router"), params(), "route");
    graph::ValueId out = graph::kNoValue;
    for (size_t i = 0; i < subsets.size(); ++i) {
      graph::ValueId part = b.moe_experts(h, route, params(subsets[i]), "moe");
      out = out == graph::kNoValue ? part : b.add(out, part, "sum");
    }
    return b.finish(out);
  }

  // The layer in double for one token: returns the output row and the selected experts.
  std::vector<double> reference(int32_t token, std::vector<int32_t>* selected) const {
    const double* h = embd.deq.data() + token * kEmbd;
    std::vector<double> logit(kExperts);
    for (int32_t x = 0; x < kExperts; ++x)
      for (int64_t i = 0; i < kEmbd; ++i) logit[x] += router.deq[x * kEmbd + i] * h[i];
    std::vector<int32_t> order(kExperts);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return logit[a] > logit[b]; });
    double z = 0;
    for (int32_t j = 0; j < kUsed; ++j) z += std::exp(logit[order[j]]);
    std::vector<double> out(kEmbd, 0.0);
    for (int32_t j = 0; j < kUsed; ++j) {
      const int32_t x = order[j];
      selected->push_back(x);
      const double w = std::exp(logit[x]) / z;
      std::vector<double> act(kFf);
      for (int64_t f = 0; f < kFf; ++f) {
        double g = 0, u = 0;
        for (int64_t i = 0; i < kEmbd; ++i) {
          g += gate.deq[(x * kFf + f) * kEmbd + i] * h[i];
          u += up.deq[(x * kFf + f) * kEmbd + i] * h[i];
        }
        act[f] = g / (1.0 + std::exp(-g)) * u;
      }
      for (int64_t o = 0; o < kEmbd; ++o) {
        double s = 0;
        for (int64_t f = 0; f < kFf; ++f) s += down.deq[(x * kEmbd + o) * kFf + f] * act[f];
        out[o] += w * s;
      }
    }
    return out;
  }
};

/// Runs g on `tokens`; `in_region` (when given) counts the moe_experts calls whose combine ran
/// inside the expert region.
std::vector<float> run(ThreadPool& pool, const graph::WeightTable& wt, const graph::Graph& g,
                       const std::vector<int32_t>& tokens, int64_t* in_region = nullptr) {
  KvCache kv({}, 1024);
  CpuExecutor ex(pool, wt, kv.view());
  std::vector<int32_t> pos(tokens.size());
  std::iota(pos.begin(), pos.end(), 0);
  std::span<const float> out = ex.run(g, tokens, pos);
  if (in_region) *in_region += ex.moe_timing().combined_in_region;
  return {out.begin(), out.end()};
}

std::vector<int32_t> token_batch(int32_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % kVocab);
  return t;
}

}  // namespace

TEST_CASE("moe_topk: softmax weights, ties to the lowest id, renormalisation") {
  const float logits[5] = {1.0f, 3.0f, 3.0f, -2.0f, 0.5f};
  int32_t ids[3];
  float w[3];
  cpu::moe_topk(logits, 5, 3, false, ids, w);
  CHECK(ids[0] == 1);
  CHECK(ids[1] == 2);
  CHECK(ids[2] == 0);
  double z = 0;
  for (float l : logits) z += std::exp(static_cast<double>(l));
  CHECK(w[0] == static_cast<float>(std::exp(3.0) / z));
  CHECK(w[2] == static_cast<float>(std::exp(1.0) / z));
  cpu::moe_topk(logits, 5, 3, true, ids, w);
  const double zs = 2 * std::exp(3.0) + std::exp(1.0);
  CHECK(w[0] == static_cast<float>(std::exp(3.0) / zs));
  CHECK(w[1] == w[0]);
  CHECK(w[2] == static_cast<float>(std::exp(1.0) / zs));
  const float nan_first[3] = {std::nanf(""), -1.0f, -3.0f};
  cpu::moe_topk(nan_first, 3, 1, true, ids, w);
  CHECK(ids[0] == 1);
  CHECK(w[0] == 1.0f);
}

TEST_CASE("moe_experts matches the double-precision layer for ubatches of 1..512 tokens") {
  ThreadPool pool(2);
  struct Case {
    GgmlType type;
    // The reference uses the weights as decoded, so the error is the 8-bit quantization of the
    // activations (h, and the heavier-tailed swiglu output before down): one scale per 32
    // values for Q8_0 (measured <= 1.8e-4), per 256 for Q8_K (measured <= 4.3e-4). A wrong expert
    // or weight gives ~1.
    double nmse_bound;
  };
  for (Case c :
       {Case{GgmlType::F32, 1e-10}, Case{GgmlType::Q8_0, 5e-4}, Case{GgmlType::Q4_K, 1e-3}}) {
    CAPTURE(type_name(c.type));
    MoeFixture fx(c.type);
    for (int32_t n_tok : {1, 2, 7, 64, 512}) {
      CAPTURE(n_tok);
      const std::vector<int32_t> tokens = token_batch(n_tok, 100 + static_cast<uint32_t>(n_tok));
      const std::vector<float> out = run(pool, fx.wt, fx.build(n_tok, {{}}), tokens);
      std::vector<int> uses(kExperts, 0);
      double err = 0, ref2 = 0;
      for (int32_t t = 0; t < n_tok; ++t) {
        std::vector<int32_t> sel;
        const std::vector<double> want = fx.reference(tokens[static_cast<size_t>(t)], &sel);
        for (int32_t x : sel) ++uses[static_cast<size_t>(x)];
        for (int64_t o = 0; o < kEmbd; ++o) {
          const double d = out[static_cast<size_t>(t * kEmbd + o)] - want[static_cast<size_t>(o)];
          err += d * d;
          ref2 += want[static_cast<size_t>(o)] * want[static_cast<size_t>(o)];
        }
      }
      CHECK(err / ref2 < c.nmse_bound);
      CHECK(uses[kDeadExpert] == 0);  // an expert no token picks
      if (n_tok >= 7) CHECK(*std::max_element(uses.begin(), uses.end()) >= 2);  // shared experts
    }
  }
}

TEST_CASE("moe_experts: results do not depend on the ubatch split or the thread count") {
  MoeFixture fx(GgmlType::Q4_K);
  const int32_t n = 96;
  const std::vector<int32_t> tokens = token_batch(n, 7);
  ThreadPool pool2(2), pool1(1);
  // One thread: a single down block per expert, the combine after the region. Two threads (or
  // a single token): several row blocks, each combined inside the region by the thread that
  // writes its last expert's rows. The same bits either way.
  int64_t in_region1 = 0, in_region_one = 0;
  const std::vector<float> all = run(pool2, fx.wt, fx.build(n, {{}}), tokens);
  CHECK(run(pool1, fx.wt, fx.build(n, {{}}), tokens, &in_region1) == all);
  CHECK(in_region1 == 0);
  const graph::Graph g1 = fx.build(1, {{}});
  for (int32_t t = 0; t < n; t += 13) {
    const std::vector<float> one =
        run(pool2, fx.wt, g1, {tokens[static_cast<size_t>(t)]}, &in_region_one);
    CHECK(std::memcmp(one.data(), all.data() + t * kEmbd, kEmbd * sizeof(float)) == 0);
  }
  CHECK(in_region_one == (n + 12) / 13);
}

TEST_CASE("moe_experts over disjoint expert sets adds up to the whole layer") {
  MoeFixture fx(GgmlType::Q8_0);
  ThreadPool pool(2);
  const int32_t n = 40;
  const std::vector<int32_t> tokens = token_batch(n, 9);
  const std::vector<float> whole = run(pool, fx.wt, fx.build(n, {{}}), tokens);
  const std::vector<float> split =
      run(pool, fx.wt, fx.build(n, {{0, 2, 4, 6}, {1, 3, 5, 7}}), tokens);
  const std::vector<float> three =
      run(pool, fx.wt, fx.build(n, {{0}, {1, 2, 3}, {4, 5, 6, 7}}), tokens);
  double err = 0, err3 = 0, ref2 = 0;
  for (size_t i = 0; i < whole.size(); ++i) {
    err += (split[i] - whole[i]) * double(split[i] - whole[i]);
    err3 += (three[i] - whole[i]) * double(three[i] - whole[i]);
    ref2 += whole[i] * double(whole[i]);
  }
  CHECK(err / ref2 < 1e-12);
  CHECK(err3 / ref2 < 1e-12);
  // A subset that holds none of a token's experts contributes zeros for it.
  const std::vector<float> dead = run(pool, fx.wt, fx.build(n, {{kDeadExpert}}), tokens);
  CHECK(std::all_of(dead.begin(), dead.end(), [](float v) { return v == 0.0f; }));
}

TEST_CASE("moe_experts over disjoint slot ranges adds up to the whole layer") {
  MoeFixture fx(GgmlType::Q8_0);
  ThreadPool pool(2);
  for (const int32_t n : {1, 40}) {
    CAPTURE(n);
    const std::vector<int32_t> tokens = token_batch(n, 11);
    const std::vector<float> whole = run(pool, fx.wt, fx.build(n, {{}}), tokens);
    // With k = 2, slot 0's op gives w0 y0 and slot 1's w1 y1; the whole op sums 0 + w0 y0 +
    // w1 y1 in slot order and the add sums w0 y0 + w1 y1: the same bits.
    CHECK(run(pool, fx.wt, fx.build_slots(n, {{0, 1}, {1, -1}}), tokens) == whole);
    CHECK(run(pool, fx.wt, fx.build_slots(n, {{0, 2}}), tokens) == whole);
    // Slot ranges and expert sets combine: the first slot over two halves of the experts.
    const std::vector<float> first = run(pool, fx.wt, fx.build_slots(n, {{0, 1}}), tokens);
    std::vector<float> halves = run(pool, fx.wt, fx.build_slots(n, {{0, 1}}, {0, 1, 2, 3}), tokens);
    const std::vector<float> upper =
        run(pool, fx.wt, fx.build_slots(n, {{0, 1}}, {4, 5, 6, 7}), tokens);
    for (size_t i = 0; i < halves.size(); ++i) halves[i] += upper[i];
    CHECK(halves == first);  // each token's slot 0 is in exactly one half: x + 0 == x
    const bool any_nonzero =
        std::any_of(first.begin(), first.end(), [](float v) { return v != 0.0f; });
    CHECK(any_nonzero);
    CHECK(first != whole);
  }
}

TEST_CASE("Graph::validate rejects malformed MoE ops") {
  MoeFixture fx(GgmlType::F32);
  graph::Builder b(fx.wt, 2);
  graph::ValueId h = b.embed(fx.id_embd, "h");
  graph::MoeParams bad = fx.params();
  bad.n_expert_used = kExperts + 1;
  CHECK_THROWS_WITH_AS(b.finish(b.moe_route(b.matmul(h, fx.id_router, "router"), bad, "route")),
                       doctest::Contains("n_expert_used"), Error);
  graph::Builder b2(fx.wt, 2);
  h = b2.embed(fx.id_embd, "h");
  graph::ValueId route = b2.moe_route(b2.matmul(h, fx.id_router, "router"), fx.params(), "route");
  graph::MoeParams swapped = fx.params();
  std::swap(swapped.gate, swapped.down);
  CHECK_THROWS_WITH_AS(b2.finish(b2.moe_experts(h, route, swapped, "moe")),
                       doctest::Contains("do not fit"), Error);
  graph::Builder b3(fx.wt, 2);
  h = b3.embed(fx.id_embd, "h");
  route = b3.moe_route(b3.matmul(h, fx.id_router, "router"), fx.params(), "route");
  CHECK_THROWS_WITH_AS(b3.finish(b3.moe_experts(h, route, fx.params({3, 1}), "moe")),
                       doctest::Contains("ascending"), Error);
  for (const auto& [s0, s1] :
       std::vector<std::pair<int32_t, int32_t>>{{1, 1}, {-1, 2}, {0, 3}, {2, -1}, {0, -2}}) {
    CAPTURE(s0);
    CAPTURE(s1);
    graph::Builder b4(fx.wt, 2);
    h = b4.embed(fx.id_embd, "h");
    route = b4.moe_route(b4.matmul(h, fx.id_router, "router"), fx.params(), "route");
    CHECK_THROWS_WITH_AS(b4.finish(b4.moe_experts(h, route, fx.params({}, s0, s1), "moe")),
                         doctest::Contains("route slots"), Error);
  }
}
