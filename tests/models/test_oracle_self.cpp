// Tests of the oracle itself beyond dense llama (tests/oracle/naive_llama.h, upcycle.h): the
// qwen2 / qwen3 attention variants and the MoE FFN (qwen3moe, Mixtral-style llama) against
// values derived by hand or by an independent loop in this file, the routing function, the
// upcycled-MoE files against the dense stories260K, and the errors for malformed files.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "berth/core/error.h"
#include "berth/core/types.h"
#include "berth/io/gguf.h"
#include "berth/io/gguf_writer.h"
#include "naive_llama.h"
#include "test_util.h"
#include "upcycle.h"

namespace {

using berth::Error;
using berth::ErrorCategory;
using berth::GgmlType;
namespace gguf = berth::gguf;
using berth::oracle::greedy_generate;
using berth::oracle::make_upcycled;
using berth::oracle::NaiveLlama;
using berth::oracle::NaiveModel;
using berth::oracle::route_experts;
using berth::oracle::Routing;
using berth::oracle::UpcycleStyle;

const std::vector<int32_t> kPrompt = {1, 403, 407, 261, 378};  // "<s>Once upon a time"

template <typename Fn>
Error expect_error(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e;
  }
  FAIL("no berth::Error was thrown");
  return Error(ErrorCategory::internal, "unreachable");
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

/// An F32 tensor: shape (ne[0] contiguous) and values in memory order.
struct Tensor {
  std::vector<int64_t> ne;
  std::vector<float> data;
};

/// W mapping n_in -> n_out (ne {n_in, n_out}) with W[o][i] = f(o, i).
Tensor mat(int64_t n_in, int64_t n_out, const std::function<double(int64_t, int64_t)>& f) {
  Tensor t{{n_in, n_out}, {}};
  for (int64_t o = 0; o < n_out; ++o) {
    for (int64_t i = 0; i < n_in; ++i) t.data.push_back(static_cast<float>(f(o, i)));
  }
  return t;
}
Tensor vec(std::vector<float> v) { return Tensor{{static_cast<int64_t>(v.size())}, v}; }
Tensor zeros(std::vector<int64_t> ne) {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;
  return Tensor{ne, std::vector<float>(static_cast<size_t>(n), 0.0f)};
}
Tensor identity(int64_t n) {
  return mat(n, n, [](int64_t o, int64_t i) { return o == i; });
}

/// A small GGUF model described by editable maps, so that a test can drop a key or tensor or
/// change a shape before writing it. Keys are stored without the "{arch}." prefix.
struct Tiny {
  std::string arch;
  std::map<std::string, uint32_t> u32;
  std::map<std::string, float> f32;
  std::map<std::string, bool> flags;
  std::map<std::string, Tensor> tensors;

  gguf::File file(const std::string& name = "tiny.gguf") const {
    gguf::Writer w;
    w.set_string("general.architecture", arch);
    for (const auto& [k, v] : u32) w.set_u32(arch + "." + k, v);
    for (const auto& [k, v] : f32) w.set_f32(arch + "." + k, v);
    for (const auto& [k, v] : flags) w.set_bool(arch + "." + k, v);
    for (const auto& [n, t] : tensors) {
      std::vector<uint8_t> bytes(t.data.size() * sizeof(float));
      std::memcpy(bytes.data(), t.data.data(), bytes.size());
      w.add_tensor(n, GgmlType::F32, t.ne, bytes);
    }
    return gguf::File::from_memory(w.to_bytes(), name);
  }
};

// Token embeddings shared by the tiny attention models (n_embd 8, each with mean square 1):
//   E0 = ones, E1 = (1,-1,1,-1,1,-1,1,-1), E2 = (1,1,1,1,-1,-1,-1,-1).
const std::vector<std::vector<double>> kE = {
    {1, 1, 1, 1, 1, 1, 1, 1}, {1, -1, 1, -1, 1, -1, 1, -1}, {1, 1, 1, 1, -1, -1, -1, -1}};

Tensor tiny_embd() {
  Tensor t{{8, 3}, {}};
  for (const auto& row : kE) {
    for (double v : row) t.data.push_back(static_cast<float>(v));
  }
  return t;
}

/// Tied head with unit output_norm and eps 0: logits[v] = E[v] . x / sqrt(mean(x^2)).
std::vector<double> tied_logits(const std::vector<double>& x) {
  double ms = 0.0;
  for (double v : x) ms += v * v;
  ms /= static_cast<double>(x.size());
  std::vector<double> out;
  for (const auto& row : kE) {
    double dot = 0.0;
    for (size_t i = 0; i < x.size(); ++i) dot += row[i] * x[i];
    out.push_back(dot / std::sqrt(ms));
  }
  return out;
}

void check_close(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("index " << i << ": got " << got[i] << ", want " << want[i]);
    CHECK(std::abs(got[i] - want[i]) <= tol * std::max(1.0, std::abs(want[i])));
  }
}

/// One layer, n_embd 8, head_dim 4, n_rot 4, eps 0, tied head, zero FFN (n_ff 2); attention
/// weights left to the caller.
Tiny tiny_attention_model(const std::string& arch, uint32_t n_head, uint32_t n_head_kv) {
  Tiny m;
  m.arch = arch;
  m.u32 = {{"embedding_length", 8},
           {"block_count", 1},
           {"attention.head_count", n_head},
           {"attention.head_count_kv", n_head_kv},
           {"attention.key_length", 4},
           {"attention.value_length", 4},
           {"rope.dimension_count", 4},
           {"feed_forward_length", 2},
           {"context_length", 16}};
  m.f32 = {{"attention.layer_norm_rms_epsilon", 0.0f}, {"rope.freq_base", 10000.0f}};
  m.tensors["token_embd.weight"] = tiny_embd();
  m.tensors["output_norm.weight"] = vec(std::vector<float>(8, 1.0f));
  m.tensors["blk.0.attn_norm.weight"] = vec(std::vector<float>(8, 1.0f));
  m.tensors["blk.0.ffn_norm.weight"] = vec(std::vector<float>(8, 1.0f));
  m.tensors["blk.0.attn_output.weight"] = identity(8);
  m.tensors["blk.0.ffn_gate.weight"] = zeros({8, 2});
  m.tensors["blk.0.ffn_up.weight"] = zeros({8, 2});
  m.tensors["blk.0.ffn_down.weight"] = zeros({2, 8});
  return m;
}

/// qwen3, 2 query heads sharing 1 KV head. Only dims 0 and 2 of each head are non-zero, which
/// NeoX RoPE rotates together by theta_0 = pos (adjacent-pair RoPE would rotate 0 with 1).
///   q head 0 = (3 x0, 0, 3 x1, 0), q head 1 = (2 x2, 0, -2 x3, 0), k = (5 x4, 0, 5 x5, 0),
///   v = (x6, x7, 0, 0); attn_q_norm = 1, attn_k_norm = (2, 7, 0.5, 7); attn_output = I.
Tiny tiny_qwen3() {
  Tiny m = tiny_attention_model("qwen3", 2, 1);
  m.tensors["blk.0.attn_q.weight"] = mat(8, 8, [](int64_t o, int64_t i) {
    if (o == 0 && i == 0) return 3.0;
    if (o == 2 && i == 1) return 3.0;
    if (o == 4 && i == 2) return 2.0;
    if (o == 6 && i == 3) return -2.0;
    return 0.0;
  });
  m.tensors["blk.0.attn_k.weight"] = mat(8, 4, [](int64_t o, int64_t i) {
    return (o == 0 && i == 4) || (o == 2 && i == 5) ? 5.0 : 0.0;
  });
  m.tensors["blk.0.attn_v.weight"] = mat(8, 4, [](int64_t o, int64_t i) {
    return (o == 0 && i == 6) || (o == 1 && i == 7) ? 1.0 : 0.0;
  });
  m.tensors["blk.0.attn_q_norm.weight"] = vec({1, 1, 1, 1});
  m.tensors["blk.0.attn_k_norm.weight"] = vec({2, 7, 0.5f, 7});
  return m;
}

}  // namespace

TEST_CASE("oracle self: route_experts on hand-made logits") {
  SUBCASE("equal logits: lowest ids win, weights exact with and without renormalisation") {
    const Routing raw = route_experts(std::vector<double>{0, 0, 0, 0}, 2, false);
    CHECK(raw.ids == std::vector<int32_t>{0, 1});
    CHECK(raw.weights == std::vector<double>{0.25, 0.25});
    CHECK(raw.probs == std::vector<double>{0.25, 0.25, 0.25, 0.25});
    const Routing norm = route_experts(std::vector<double>{0, 0, 0, 0}, 2, true);
    CHECK(norm.ids == std::vector<int32_t>{0, 1});
    CHECK(norm.weights == std::vector<double>{0.5, 0.5});
  }
  SUBCASE("a tie at the cut-off goes to the lowest id; order is descending p") {
    const Routing r = route_experts(std::vector<double>{2, 5, 2, 2}, 2, true);
    CHECK(r.ids == std::vector<int32_t>{1, 0});
    const Routing r3 = route_experts(std::vector<double>{2, 5, 2, 2}, 3, true);
    CHECK(r3.ids == std::vector<int32_t>{1, 0, 2});
    // Selected weights: e^5 / (e^5 + 2 e^2) and e^2 / (e^5 + 2 e^2).
    const double den = std::exp(5.0) + 2 * std::exp(2.0);
    CHECK(r3.weights[0] == doctest::Approx(std::exp(5.0) / den).epsilon(1e-15));
    CHECK(r3.weights[1] == doctest::Approx(std::exp(2.0) / den).epsilon(1e-15));
    CHECK(r3.weights[2] == doctest::Approx(std::exp(2.0) / den).epsilon(1e-15));
  }
  SUBCASE("weights are the softmax over all experts, renormalised on request") {
    const std::vector<double> logits = {0.5, 3.0, -1.0, 2.0};
    double all = 0.0;
    for (double l : logits) all += std::exp(l);
    const Routing raw = route_experts(logits, 3, false);
    CHECK(raw.ids == std::vector<int32_t>{1, 3, 0});
    CHECK(raw.weights[0] == doctest::Approx(std::exp(3.0) / all).epsilon(1e-15));
    CHECK(raw.weights[1] == doctest::Approx(std::exp(2.0) / all).epsilon(1e-15));
    CHECK(raw.weights[2] == doctest::Approx(std::exp(0.5) / all).epsilon(1e-15));
    const double sel = std::exp(3.0) + std::exp(2.0) + std::exp(0.5);
    const Routing norm = route_experts(logits, 3, true);
    CHECK(norm.ids == raw.ids);
    CHECK(norm.weights[0] == doctest::Approx(std::exp(3.0) / sel).epsilon(1e-15));
    CHECK(norm.weights[1] == doctest::Approx(std::exp(2.0) / sel).epsilon(1e-15));
    CHECK(norm.weights[2] == doctest::Approx(std::exp(0.5) / sel).epsilon(1e-15));
    // Softmax is shift-invariant, so large logits do not overflow.
    const Routing big = route_experts(std::vector<double>{1000.5, 1003, 999, 1002}, 3, true);
    CHECK(big.ids == norm.ids);
    for (size_t j = 0; j < 3; ++j) {
      CHECK(big.weights[j] == doctest::Approx(norm.weights[j]).epsilon(1e-14));
    }
  }
  SUBCASE("float logits are widened exactly; round_weight is one rounding to float") {
    const std::vector<float> lf = {0.1f, -0.7f, 0.3f};
    const std::vector<double> ld(lf.begin(), lf.end());
    const Routing a = route_experts(lf, 2, true), b = route_experts(ld, 2, true);
    CHECK(a.ids == std::vector<int32_t>{2, 0});
    CHECK(a.ids == b.ids);
    CHECK(a.weights == b.weights);
    CHECK(Routing::round_weight(a.weights[0]) == static_cast<float>(a.weights[0]));
    CHECK(Routing::round_weight(0.1) == 0.1f);
  }
  SUBCASE("bad arguments are Error(invalid_argument)") {
    const std::vector<double> l = {1, 2, 3, 4};
    CHECK(expect_error([&] { route_experts(l, 0, true); }).category() ==
          ErrorCategory::invalid_argument);
    CHECK(expect_error([&] { route_experts(l, 5, true); }).category() ==
          ErrorCategory::invalid_argument);
    CHECK(expect_error([&] { route_experts(std::vector<double>{}, 1, true); }).category() ==
          ErrorCategory::invalid_argument);
    const Error nan = expect_error([&] { route_experts(std::vector<double>{1, NAN}, 1, true); });
    CHECK(nan.category() == ErrorCategory::invalid_argument);
    CHECK(contains(nan.what(), "expert 1"));
    CHECK(expect_error([&] {
            route_experts(std::vector<double>{INFINITY, 0}, 1, true);
          }).category() == ErrorCategory::invalid_argument);
  }
}

// Derivation (c = cos 1, s = sin 1; eps 0; every embedding row has mean square 1, so the
// attn_norm output is the embedding itself):
//  pos 0, token 0: attention over one position returns v = (1, 1, 0, 0) for both heads;
//    x = E0 + (1,1,0,0, 1,1,0,0) = (2,2,1,1,2,2,1,1); logits = E . x / sqrt(mean(x^2) = 2.5).
//  pos 1, token 1: per-head RMSNorm over 4 dims maps (a, 0, b, 0) with |a| = |b| to
//    sqrt(2) (sign a, 0, sign b, 0), whatever the scale 3, 2 or 5; then RoPE rotates dims (0, 2)
//    by theta = pos (NeoX pair i = 0; the (1, 3) pair is zero).
//    q head 0 = sqrt2 R(1)(1, -1), q head 1 = sqrt2 R(1)(1, 1)    (in the (d0, d2) plane)
//    k pos 0 = sqrt2 (2, 0.5),  k pos 1 = sqrt2 R(1)(2, -0.5)       (k_norm weights 2 and 0.5)
//    scores / sqrt(4): head 0: (3c + 5s)/2 and 5/2; head 1: (5c - 3s)/2 and 3/2
//    (rotating both vectors by the same angle keeps their dot product).
//    v pos 0 = (1, 1, 0, 0), v pos 1 = (1, -1, 0, 0): head out = (1, a0 - a1, 0, 0).
//    x = E1 + (1, d_0, 0, 0, 1, d_1, 0, 0) with d_h = a0 - a1 of head h.
TEST_CASE("oracle self: tiny qwen3 (per-head q/k norm, NeoX RoPE, GQA) matches the hand values") {
  const gguf::File file = tiny_qwen3().file("tiny-qwen3.gguf");
  NaiveModel m(file);
  const auto& c = m.config();
  CHECK(c.arch == "qwen3");
  CHECK(c.rope_neox);
  CHECK(c.q_norm);
  CHECK(c.k_norm);
  CHECK_FALSE(c.attn_bias);
  CHECK(c.tied_output);
  CHECK(c.head_dim == 4);
  CHECK(c.n_expert == 0);
  CHECK(m.last_routing().empty());

  check_close(m.step(0), tied_logits({2, 2, 1, 1, 2, 2, 1, 1}), 1e-13);

  const double cs = std::cos(1.0), sn = std::sin(1.0);
  auto diff = [](double s_pos0, double s_pos1) {
    const double a0 = 1.0 / (1.0 + std::exp(s_pos1 - s_pos0));
    return a0 - (1.0 - a0);
  };
  const double d0 = diff((3 * cs + 5 * sn) / 2, 2.5), d1 = diff((5 * cs - 3 * sn) / 2, 1.5);
  const std::vector<double> want = tied_logits({2, -1 + d0, 1, -1, 2, -1 + d1, 1, -1});
  check_close(m.step(1), want, 1e-13);

  // Without the q/k norms the scores change (q and k keep their scales 3, 2 and 5).
  Tiny plain = tiny_qwen3();
  plain.tensors.erase("blk.0.attn_q_norm.weight");
  plain.tensors.erase("blk.0.attn_k_norm.weight");
  NaiveModel mp(plain.file());
  CHECK_FALSE(mp.config().q_norm);
  CHECK_FALSE(mp.config().k_norm);
  check_close(mp.step(0), tied_logits({2, 2, 1, 1, 2, 2, 1, 1}), 1e-13);  // pos 0 returns v
  const std::vector<double> got = mp.step(1);
  CHECK(std::abs(got[0] - want[0]) > 1e-3);
}

// q_dim = n_head * head_dim = 12 differs from n_embd = 8 (head_dim from attention.key_length).
// At position 0 attention returns v for every head, so with v = (x0..x5) for the single KV head
// and attn_output summing head h's dim j into x[j] (j < 6) scaled by (h + 1):
//   x = E0 + 3 * (1,1,1,1,1,1,0,0) = (4,4,4,4,4,4,1,1).
TEST_CASE("oracle self: qwen3 with key_length * n_head != n_embd") {
  Tiny t = tiny_attention_model("qwen3", 2, 1);
  t.u32["attention.key_length"] = 6;
  t.u32["attention.value_length"] = 6;
  t.u32["rope.dimension_count"] = 6;
  t.tensors["blk.0.attn_q.weight"] = mat(8, 12, [](int64_t o, int64_t i) { return 0.1 * (o - i); });
  t.tensors["blk.0.attn_k.weight"] = mat(8, 6, [](int64_t o, int64_t i) { return 0.2 * (o + i); });
  t.tensors["blk.0.attn_v.weight"] = mat(8, 6, [](int64_t o, int64_t i) { return o == i; });
  t.tensors["blk.0.attn_output.weight"] = mat(12, 8, [](int64_t o, int64_t i) {
    return o == i % 6 ? 1.0 + static_cast<double>(i / 6) : 0.0;
  });
  t.tensors["blk.0.attn_q_norm.weight"] = vec({1, 2, 3, 4, 5, 6});
  t.tensors["blk.0.attn_k_norm.weight"] = vec({1, 1, 1, 1, 1, 1});
  NaiveModel m(t.file());
  CHECK(m.config().head_dim == 6);
  check_close(m.step(0), tied_logits({4, 4, 4, 4, 4, 4, 1, 1}), 1e-13);
  CHECK(m.step(2).size() == 3);
}

// qwen2: zero Q/K weights, so q = attn_q.bias and k = attn_k.bias at every position; head 0:
// bq = (2, 0, 0, 0), bk = (0, 0, 1, 0); head 1: zero (uniform attention). V = x + bv.
//  pos 0: x = E0 + (E0 + bv).
//  pos 1, head 0: NeoX rotates dims (0, 2) by 1: q = (2c, 0, 2s, 0); k pos 0 = (0, 0, 1, 0),
//    k pos 1 rotated like q, so q.k1 = bq.bk = 0: scores / 2 = (s, 0). Head 1: (0, 0).
//    x = E1 + [a0 v0 + a1 v1 per head] with v_t = E_t + bv.
TEST_CASE("oracle self: tiny qwen2 (Q/K/V biases, NeoX RoPE, tied head) matches the hand values") {
  Tiny t = tiny_attention_model("qwen2", 2, 2);
  t.u32.erase("attention.key_length");  // head_dim = n_embd / n_head = 4
  t.u32.erase("attention.value_length");
  const std::vector<float> bv = {1, 0, -1, 0, 0.5f, 0, 0, -2};
  t.tensors["blk.0.attn_q.weight"] = zeros({8, 8});
  t.tensors["blk.0.attn_k.weight"] = zeros({8, 8});
  t.tensors["blk.0.attn_v.weight"] = identity(8);
  t.tensors["blk.0.attn_q.bias"] = vec({2, 0, 0, 0, 0, 0, 0, 0});
  t.tensors["blk.0.attn_k.bias"] = vec({0, 0, 1, 0, 0, 0, 0, 0});
  t.tensors["blk.0.attn_v.bias"] = vec(bv);
  NaiveModel m(t.file("tiny-qwen2.gguf"));
  CHECK(m.config().attn_bias);
  CHECK(m.config().rope_neox);
  CHECK(m.config().tied_output);

  std::vector<double> v0(8), v1(8), x0(8);
  for (int i = 0; i < 8; ++i) {
    v0[i] = kE[0][i] + bv[i];
    v1[i] = kE[1][i] + bv[i];
    x0[i] = kE[0][i] + v0[i];
  }
  check_close(m.step(0), tied_logits(x0), 1e-13);

  const double a0_h0 = 1.0 / (1.0 + std::exp(0.0 - std::sin(1.0)));  // scores (sin 1, 0)
  std::vector<double> x1(8);
  for (int i = 0; i < 8; ++i) {
    const double a0 = i < 4 ? a0_h0 : 0.5;
    x1[i] = kE[1][i] + a0 * v0[i] + (1.0 - a0) * v1[i];
  }
  check_close(m.step(1), tied_logits(x1), 1e-13);

  SUBCASE("a missing bias is GgufError(missing_tensor) naming it") {
    t.tensors.erase("blk.0.attn_k.bias");
    const gguf::File f = t.file();
    try {
      NaiveModel bad(f);
      FAIL("expected missing_tensor");
    } catch (const gguf::GgufError& e) {
      CHECK(e.code() == gguf::Errc::missing_tensor);
      CHECK(contains(e.what(), "blk.0.attn_k.bias"));
    }
  }
  SUBCASE("a bias of the wrong length is Error(format) with both shapes") {
    t.tensors["blk.0.attn_v.bias"] = vec({1, 2, 3, 4});
    const Error e = expect_error([&] { NaiveModel bad(t.file()); });
    CHECK(e.category() == ErrorCategory::format);
    CHECK(contains(e.what(), "blk.0.attn_v.bias"));
    CHECK(contains(e.what(), "[4]"));
    CHECK(contains(e.what(), "[8]"));
  }
}

namespace {

// A one-layer MoE model with 3 distinct experts (n_ff_exp 2, n_embd 4) and an attention block
// that adds nothing (attn_output = 0), so at position 0 the FFN input is rms(E[t]).
constexpr int64_t kMoeEmbd = 4, kMoeFf = 2, kMoeExperts = 3;
double moe_gate(int64_t e, int64_t f, int64_t i) { return 0.3 * (e + 1) - 0.2 * f + 0.1 * i; }
double moe_up(int64_t e, int64_t f, int64_t i) { return 0.5 - 0.25 * e + 0.15 * f * i; }
double moe_down(int64_t e, int64_t o, int64_t f) {
  return (e == 1 ? -1.0 : 1.0) * (0.2 * o + 0.7 * f + 0.1 * e);
}
// Router rows (expert e): chosen so token 0 and token 1 route differently.
const double kRouter[3][4] = {{1.0, 0.5, 0.0, -1.0}, {0.0, 1.5, -0.5, 0.0}, {-1.0, 0.0, 2.0, 0.5}};
// Token embeddings (vocab 4; tokens 0 and 1 are the ones fed).
const double kMoeE[4][4] = {
    {1.0, 2.0, -1.0, 0.5}, {-2.0, 0.5, 1.5, 1.0}, {0.5, -1.0, 2.0, 1.0}, {1.0, 1.0, 1.0, 1.0}};

/// Stacked expert tensor {n_in, n_out, n_expert}: element [e][o][i] = f(e, o, i).
Tensor stacked(int64_t n_in, int64_t n_out, double (*f)(int64_t, int64_t, int64_t)) {
  Tensor t{{n_in, n_out, kMoeExperts}, {}};
  for (int64_t e = 0; e < kMoeExperts; ++e) {
    for (int64_t o = 0; o < n_out; ++o) {
      for (int64_t i = 0; i < n_in; ++i) t.data.push_back(static_cast<float>(f(e, o, i)));
    }
  }
  return t;
}

Tiny tiny_moe(const std::string& arch) {
  Tiny m;
  m.arch = arch;
  m.u32 = {{"embedding_length", 4}, {"block_count", 1},  {"attention.head_count", 1},
           {"context_length", 8},   {"expert_count", 3}, {"expert_used_count", 2}};
  if (arch == "llama") {
    m.u32["feed_forward_length"] = kMoeFf;
  } else {
    m.u32["expert_feed_forward_length"] = kMoeFf;
  }
  m.f32 = {{"attention.layer_norm_rms_epsilon", 0.0f}};
  Tensor embd{{4, 4}, {}}, router{{4, 3}, {}};
  for (const auto& row : kMoeE) {
    for (double v : row) embd.data.push_back(static_cast<float>(v));
  }
  for (const auto& row : kRouter) {
    for (double v : row) router.data.push_back(static_cast<float>(v));
  }
  m.tensors["token_embd.weight"] = embd;
  m.tensors["output_norm.weight"] = vec({1, 1, 1, 1});
  m.tensors["output.weight"] = identity(4);  // separate head: logits = rms(x)
  m.tensors["blk.0.attn_norm.weight"] = vec({1, 1, 1, 1});
  m.tensors["blk.0.attn_q.weight"] = identity(4);
  m.tensors["blk.0.attn_k.weight"] = identity(4);
  m.tensors["blk.0.attn_v.weight"] = identity(4);
  m.tensors["blk.0.attn_output.weight"] = zeros({4, 4});
  m.tensors["blk.0.ffn_norm.weight"] = vec({1, 1, 1, 1});
  m.tensors["blk.0.ffn_gate_inp.weight"] = router;
  m.tensors["blk.0.ffn_gate_exps.weight"] = stacked(kMoeEmbd, kMoeFf, moe_gate);
  m.tensors["blk.0.ffn_up_exps.weight"] = stacked(kMoeEmbd, kMoeFf, moe_up);
  m.tensors["blk.0.ffn_down_exps.weight"] = stacked(kMoeFf, kMoeEmbd, moe_down);
  return m;
}

/// The expected output of tiny_moe for token t at position 0, computed here with its own
/// loops: routing by explicit softmax and sort, then the weighted sum of the chosen experts.
std::vector<double> moe_expected(int t, bool renormalise, std::vector<int32_t>* ids_out) {
  std::vector<double> x(kMoeE[t], kMoeE[t] + 4), h(4);
  double ms = 0.0;
  for (double v : x) ms += v * v / 4.0;
  for (int i = 0; i < 4; ++i) h[i] = x[i] / std::sqrt(ms);
  double logit[3], p[3], sum = 0.0;
  for (int e = 0; e < 3; ++e) {
    logit[e] = 0.0;
    for (int i = 0; i < 4; ++i) logit[e] += static_cast<float>(kRouter[e][i]) * h[i];
  }
  for (int e = 0; e < 3; ++e) sum += std::exp(logit[e]);
  for (int e = 0; e < 3; ++e) p[e] = std::exp(logit[e]) / sum;
  // The two largest of three: drop the smallest (no ties in these numbers).
  const int drop = static_cast<int>(std::min_element(p, p + 3) - p);
  std::vector<int32_t> ids;
  for (int e = 0; e < 3; ++e) {
    if (e != drop) ids.push_back(e);
  }
  if (p[ids[1]] > p[ids[0]]) std::swap(ids[0], ids[1]);
  const double wsum = p[ids[0]] + p[ids[1]];
  for (int32_t e : ids) {
    const double w = renormalise ? p[e] / wsum : p[e];
    double hidden[kMoeFf];
    for (int f = 0; f < kMoeFf; ++f) {
      double g = 0.0, u = 0.0;
      for (int i = 0; i < 4; ++i) {
        g += static_cast<float>(moe_gate(e, f, i)) * h[i];
        u += static_cast<float>(moe_up(e, f, i)) * h[i];
      }
      hidden[f] = g / (1.0 + std::exp(-g)) * u;
    }
    for (int o = 0; o < 4; ++o) {
      double y = 0.0;
      for (int f = 0; f < kMoeFf; ++f) y += static_cast<float>(moe_down(e, o, f)) * hidden[f];
      x[o] += w * y;
    }
  }
  if (ids_out) *ids_out = ids;
  double ms2 = 0.0;
  for (double v : x) ms2 += v * v / 4.0;
  std::vector<double> logits(4);
  for (int i = 0; i < 4; ++i) logits[i] = x[i] / std::sqrt(ms2);
  return logits;
}

}  // namespace

TEST_CASE("oracle self: MoE FFN with distinct experts matches an independent loop") {
  for (const std::string arch : {"qwen3moe", "llama"}) {
    CAPTURE(arch);
    const Tiny t = tiny_moe(arch);
    NaiveModel m(t.file());
    const auto& c = m.config();
    CHECK(c.n_expert == 3);
    CHECK(c.n_expert_used == 2);
    CHECK(c.n_ff_exp == 2);
    CHECK(c.expert_weights_norm);
    CHECK(c.rope_neox == (arch == "qwen3moe"));
    REQUIRE(m.last_routing().size() == 1);
    CHECK(m.last_routing()[0].ids.empty());
    std::vector<int32_t> ids0, ids1;
    for (int tok = 0; tok < 2; ++tok) {
      m.reset();
      std::vector<int32_t>& ids = tok == 0 ? ids0 : ids1;
      const std::vector<double> want = moe_expected(tok, true, &ids);
      check_close(m.step(tok), want, 1e-13);
      const Routing& r = m.last_routing()[0];
      CHECK(r.ids == ids);
      REQUIRE(r.weights.size() == 2);
      CHECK(r.weights[0] + r.weights[1] == doctest::Approx(1.0).epsilon(1e-15));
      CHECK(r.weights[0] >= r.weights[1]);
    }
    CHECK(ids0 != ids1);  // the two tokens exercise different experts
    m.reset();
    CHECK(m.last_routing()[0].ids.empty());
  }
  SUBCASE("qwen3moe.expert_weights_norm = false keeps the raw probabilities") {
    Tiny t = tiny_moe("qwen3moe");
    t.flags["expert_weights_norm"] = false;
    NaiveModel m(t.file());
    CHECK_FALSE(m.config().expert_weights_norm);
    for (int tok = 0; tok < 2; ++tok) {
      m.reset();
      check_close(m.step(tok), moe_expected(tok, false, nullptr), 1e-13);
      const Routing& r = m.last_routing()[0];
      CHECK(r.weights[0] + r.weights[1] < 1.0);
    }
  }
  SUBCASE("Mixtral-style llama refuses expert_weights_norm = false") {
    Tiny t = tiny_moe("llama");
    t.flags["expert_weights_norm"] = false;
    const Error e = expect_error([&] { NaiveModel m(t.file()); });
    CHECK(e.category() == ErrorCategory::unsupported);
    CHECK(contains(e.what(), "llama.expert_weights_norm"));
  }
}

TEST_CASE("oracle self: MoE and qwen errors name the key or tensor") {
  SUBCASE("missing expert_used_count") {
    Tiny t = tiny_moe("qwen3moe");
    t.u32.erase("expert_used_count");
    const gguf::File f = t.file();
    try {
      NaiveModel m(f);
      FAIL("expected missing_key");
    } catch (const gguf::GgufError& e) {
      CHECK(e.code() == gguf::Errc::missing_key);
      CHECK(e.category() == ErrorCategory::missing);
      CHECK(contains(e.what(), "qwen3moe.expert_used_count"));
    }
  }
  SUBCASE("missing expert_feed_forward_length") {
    Tiny t = tiny_moe("qwen3moe");
    t.u32.erase("expert_feed_forward_length");
    const gguf::File f = t.file();
    try {
      NaiveModel m(f);
      FAIL("expected missing_key");
    } catch (const gguf::GgufError& e) {
      CHECK(e.code() == gguf::Errc::missing_key);
      CHECK(contains(e.what(), "qwen3moe.expert_feed_forward_length"));
    }
  }
  SUBCASE("qwen3moe without experts") {
    Tiny t = tiny_moe("qwen3moe");
    t.u32.erase("expert_count");
    const Error e = expect_error([&] { NaiveModel m(t.file()); });
    CHECK(e.category() == ErrorCategory::format);
    CHECK(contains(e.what(), "qwen3moe.expert_count"));
  }
  SUBCASE("expert_used_count > expert_count") {
    Tiny t = tiny_moe("llama");
    t.u32["expert_used_count"] = 4;
    const Error e = expect_error([&] { NaiveModel m(t.file()); });
    CHECK(e.category() == ErrorCategory::format);
    CHECK(contains(e.what(), "llama.expert_used_count"));
  }
  SUBCASE("wrong-shaped stacked expert tensor") {
    Tiny t = tiny_moe("qwen3moe");
    t.tensors["blk.0.ffn_down_exps.weight"] = stacked(kMoeEmbd, kMoeFf, moe_down);  // transposed
    const Error e = expect_error([&] { NaiveModel m(t.file()); });
    CHECK(e.category() == ErrorCategory::format);
    CHECK(contains(e.what(), "blk.0.ffn_down_exps.weight"));
    CHECK(contains(e.what(), "[4, 2, 3]"));
    CHECK(contains(e.what(), "[2, 4, 3]"));
  }
  SUBCASE("wrong-shaped router") {
    Tiny t = tiny_moe("llama");
    t.tensors["blk.0.ffn_gate_inp.weight"] = zeros({4, 2});
    const Error e = expect_error([&] { NaiveModel m(t.file()); });
    CHECK(e.category() == ErrorCategory::format);
    CHECK(contains(e.what(), "blk.0.ffn_gate_inp.weight"));
  }
  SUBCASE("missing stacked tensor") {
    Tiny t = tiny_moe("llama");
    t.tensors.erase("blk.0.ffn_up_exps.weight");
    const gguf::File f = t.file();
    try {
      NaiveModel m(f);
      FAIL("expected missing_tensor");
    } catch (const gguf::GgufError& e) {
      CHECK(e.code() == gguf::Errc::missing_tensor);
      CHECK(contains(e.what(), "blk.0.ffn_up_exps.weight"));
    }
  }
  SUBCASE("sigmoid gating is unsupported") {
    Tiny t = tiny_moe("qwen3moe");
    t.u32["expert_gating_func"] = 2;
    const Error e = expect_error([&] { NaiveModel m(t.file()); });
    CHECK(e.category() == ErrorCategory::unsupported);
    CHECK(contains(e.what(), "expert_gating_func"));
  }
  SUBCASE("qwen3 with experts is unsupported") {
    Tiny t = tiny_qwen3();
    t.u32["expert_count"] = 2;
    const Error e = expect_error([&] { NaiveModel m(t.file()); });
    CHECK(e.category() == ErrorCategory::unsupported);
    CHECK(contains(e.what(), "qwen3.expert_count"));
  }
  SUBCASE("wrong-shaped q_norm") {
    Tiny t = tiny_qwen3();
    t.tensors["blk.0.attn_q_norm.weight"] = vec({1, 1, 1, 1, 1, 1, 1, 1});
    const Error e = expect_error([&] { NaiveModel m(t.file()); });
    CHECK(e.category() == ErrorCategory::format);
    CHECK(contains(e.what(), "blk.0.attn_q_norm.weight"));
    CHECK(contains(e.what(), "[8]"));
    CHECK(contains(e.what(), "[4]"));
  }
  SUBCASE("a dense FFN tensor left in a MoE file is unused") {
    Tiny t = tiny_moe("qwen3moe");
    t.tensors["blk.0.ffn_gate.weight"] = zeros({4, 2});
    const Error e = expect_error([&] { NaiveModel m(t.file()); });
    CHECK(e.category() == ErrorCategory::unsupported);
    CHECK(contains(e.what(), "blk.0.ffn_gate.weight"));
  }
  SUBCASE("q/k norms on qwen2 are unused tensors") {
    Tiny t = tiny_attention_model("qwen2", 2, 2);
    t.tensors["blk.0.attn_q.weight"] = zeros({8, 8});
    t.tensors["blk.0.attn_k.weight"] = zeros({8, 8});
    t.tensors["blk.0.attn_v.weight"] = zeros({8, 8});
    t.tensors["blk.0.attn_q.bias"] = zeros({8});
    t.tensors["blk.0.attn_k.bias"] = zeros({8});
    t.tensors["blk.0.attn_v.bias"] = zeros({8});
    NaiveModel ok(t.file());  // the base file is valid
    t.tensors["blk.0.attn_q_norm.weight"] = zeros({4});
    const Error e = expect_error([&] { NaiveModel m(t.file()); });
    CHECK(e.category() == ErrorCategory::unsupported);
    CHECK(contains(e.what(), "blk.0.attn_q_norm.weight"));
  }
  SUBCASE("unknown architecture; NaiveLlama refuses qwen files") {
    Tiny t = tiny_qwen3();
    t.arch = "gpt2";
    Error e = expect_error([&] { NaiveModel m(t.file()); });
    CHECK(e.category() == ErrorCategory::unsupported);
    CHECK(contains(e.what(), "gpt2"));
    e = expect_error([&] { NaiveLlama m(tiny_qwen3().file()); });
    CHECK(e.category() == ErrorCategory::unsupported);
    CHECK(contains(e.what(), "qwen3"));
  }
}

namespace {

/// max |a - b| / max |b| over the vocabulary.
double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < b.size(); ++i) {
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return num / den;
}

/// Feeds kPrompt then 16 greedy tokens; returns the logits after each fed token (21 rows) and
/// the 16 greedy ids in `ids`. Also checks each step's routing when the model has experts.
std::vector<std::vector<double>> run_prompt_and_greedy(NaiveModel& m, std::vector<int32_t>& ids,
                                                       std::vector<std::vector<int32_t>>* routes) {
  std::vector<std::vector<double>> all;
  auto feed = [&](int32_t tok) {
    all.push_back(m.step(tok));
    if (routes == nullptr) return;
    for (const Routing& r : m.last_routing()) {
      REQUIRE(r.ids.size() == 2);
      CHECK(r.ids[0] != r.ids[1]);
      CHECK(r.weights[0] >= r.weights[1]);
      CHECK(r.weights[0] + r.weights[1] == doctest::Approx(1.0).epsilon(1e-15));
      routes->push_back(r.ids);
    }
  };
  for (int32_t t : kPrompt) feed(t);
  ids.clear();
  for (int i = 0; i < 16; ++i) {
    const std::vector<double>& l = all.back();
    const int32_t best = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
    ids.push_back(best);
    feed(best);
  }
  return all;
}

}  // namespace

TEST_CASE("oracle self: upcycled Mixtral and qwen3moe files reproduce stories260K") {
  const gguf::File src = gguf::File::open(berth::test::stories260k().string());
  NaiveLlama dense(src, 64);
  std::vector<int32_t> want_ids;
  const std::vector<std::vector<double>> want = run_prompt_and_greedy(dense, want_ids, nullptr);
  {
    // The same 16 tokens as greedy_generate (and the start of the golden continuation).
    dense.reset();
    CHECK(greedy_generate(dense, kPrompt, 16) == want_ids);
  }

  // (a) Mixtral style, through the file API.
  const auto dir = berth::test::temp_dir("oracle-upcycle");
  const std::string mixtral_path = (dir / "stories260K-mixtral.gguf").string();
  berth::oracle::write_upcycled(berth::test::stories260k().string(), mixtral_path,
                                UpcycleStyle::mixtral, 4, 2, 42);
  const gguf::File mixtral = gguf::File::open(mixtral_path);
  // (b) qwen3moe style, in memory.
  const gguf::File qwen = gguf::File::from_memory(
      make_upcycled(
          src, {.style = UpcycleStyle::qwen3moe, .n_expert = 4, .n_expert_used = 2, .seed = 42})
          .to_bytes(),
      "stories260K-qwen3moe.gguf");

  CHECK(mixtral.architecture() == "llama");
  CHECK(qwen.architecture() == "qwen3moe");
  CHECK(qwen.get_string("tokenizer.ggml.model") == "llama");
  CHECK(qwen.get_string_array("tokenizer.ggml.tokens").size() == 512);
  CHECK_FALSE(qwen.has("llama.embedding_length"));
  CHECK(qwen.get_int("qwen3moe.embedding_length") == 64);
  CHECK(qwen.get_int("qwen3moe.expert_feed_forward_length") == 172);
  // Same seed, same router in both files.
  const gguf::TensorInfo& ra = mixtral.tensor("blk.3.ffn_gate_inp.weight");
  const gguf::TensorInfo& rb = qwen.tensor("blk.3.ffn_gate_inp.weight");
  REQUIRE(ra.n_bytes == 64 * 4 * sizeof(float));
  CHECK(std::memcmp(ra.data, rb.data, ra.n_bytes) == 0);

  for (const gguf::File* f : {&mixtral, &qwen}) {
    CAPTURE(f->path());
    NaiveModel m(*f, 64);
    const auto& c = m.config();
    CHECK(c.n_expert == 4);
    CHECK(c.n_expert_used == 2);
    CHECK(c.n_ff_exp == 172);
    CHECK(c.expert_weights_norm);
    CHECK_FALSE(c.q_norm);
    CHECK(c.rope_neox == (f == &qwen));
    std::vector<int32_t> ids;
    std::vector<std::vector<int32_t>> routes;
    const std::vector<std::vector<double>> got = run_prompt_and_greedy(m, ids, &routes);
    CHECK(ids == want_ids);
    REQUIRE(got.size() == want.size());
    double worst = 0.0;
    for (size_t s = 0; s < got.size(); ++s) worst = std::max(worst, rel_err(got[s], want[s]));
    MESSAGE("max relative logit error vs dense: " << worst);
    CHECK(worst <= 1e-9);
    // The random router spreads the tokens over the experts: every expert is used somewhere.
    std::vector<int> used(4, 0);
    for (const auto& r : routes) {
      for (int32_t e : r) used[e]++;
    }
    for (int e = 0; e < 4; ++e) CHECK(used[e] > 0);
  }

  SUBCASE("without the Q/K row permutation, NeoX RoPE changes the result") {
    const gguf::File unpermuted = gguf::File::from_memory(
        make_upcycled(src, {.style = UpcycleStyle::qwen3moe, .seed = 42, .permute_qk = false})
            .to_bytes(),
        "unpermuted.gguf");
    NaiveModel m(unpermuted, 64);
    std::vector<int32_t> ids;
    const auto got = run_prompt_and_greedy(m, ids, nullptr);
    CHECK(rel_err(got[4], want[4]) > 1e-3);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("oracle self: make_upcycled errors") {
  const gguf::File src = gguf::File::open(berth::test::stories260k().string());
  CHECK(expect_error([&] { make_upcycled(src, {.n_expert = 2, .n_expert_used = 3}); }).category() ==
        ErrorCategory::invalid_argument);
  CHECK(expect_error([&] { make_upcycled(src, {.n_expert = 0, .n_expert_used = 0}); }).category() ==
        ErrorCategory::invalid_argument);
  const gguf::File moe = gguf::File::from_memory(make_upcycled(src, {}).to_bytes(), "moe.gguf");
  const Error e = expect_error([&] { make_upcycled(moe, {}); });
  CHECK(e.category() == ErrorCategory::unsupported);
  CHECK(contains(e.what(), "expert_count"));
  const Error q = expect_error([&] { make_upcycled(tiny_qwen3().file(), {}); });
  CHECK(q.category() == ErrorCategory::unsupported);
  CHECK(contains(q.what(), "qwen3"));
}
