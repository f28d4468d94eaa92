// Tests of the qwen35 / qwen35moe oracle itself (tests/oracle/naive_qwen35.h): the delta rule
// and the conv by hand, the chunked form against the token loop, the attention layers against
// the qwen3 / qwen3moe oracle on equivalent files, the shared expert, a GDN layer against an
// independent loop in this file, the V-head order against a conversion of Hugging Face-ordered
// weights (llama.cpp's converter), the MTP block skipped, snapshots, and malformed files.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "berth/core/error.h"
#include "berth/core/types.h"
#include "berth/io/gguf.h"
#include "berth/io/gguf_writer.h"
#include "naive_llama.h"
#include "naive_qwen35.h"

namespace {

using berth::Error;
using berth::ErrorCategory;
using berth::GgmlType;
namespace gguf = berth::gguf;
namespace oracle = berth::oracle;
using oracle::NaiveModel;
using oracle::NaiveQwen35;
using oracle::VHeadMapping;

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

/// max |a - b| / max |b|.
double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < b.size(); ++i) {
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return num / den;
}

/// An F32 tensor: shape (ne[0] contiguous) and values in memory order.
struct Tensor {
  std::vector<int64_t> ne;
  std::vector<float> data;
  float& at(int64_t row, int64_t col) { return data[static_cast<size_t>(row * ne[0] + col)]; }
};

/// A GGUF model described by editable maps (keys without the "{arch}." prefix).
struct Model {
  std::string arch;
  std::map<std::string, uint32_t> u32;
  std::map<std::string, float> f32;
  std::map<std::string, std::vector<int32_t>> i32s;
  std::map<std::string, Tensor> tensors;

  gguf::File file(const std::string& name = "tiny-hybrid.gguf") const {
    gguf::Writer w;
    w.set_string("general.architecture", arch);
    for (const auto& [k, v] : u32) w.set_u32(arch + "." + k, v);
    for (const auto& [k, v] : f32) w.set_f32(arch + "." + k, v);
    for (const auto& [k, v] : i32s) w.set_i32_array(arch + "." + k, v);
    for (const auto& [n, t] : tensors) {
      std::vector<uint8_t> bytes(t.data.size() * sizeof(float));
      std::memcpy(bytes.data(), t.data.data(), bytes.size());
      w.add_tensor(n, GgmlType::F32, t.ne, bytes);
    }
    return gguf::File::from_memory(w.to_bytes(), name);
  }
};

/// Shape of a random tiny hybrid model.
struct Dims {
  std::string arch = "qwen35";
  int n_layer = 4, interval = 4, n_embd = 16, n_vocab = 12, n_head = 2, n_kv = 1, hd = 8;
  int n_rot = 4, hk = 2, hv = 4, dk = 4, dv = 4, kernel = 4, n_ff = 12;
  int n_expert = 4, n_used = 2, n_ff_exp = 6, n_ff_shexp = 5;
};

class Gen {
 public:
  explicit Gen(uint64_t seed) : rng_(seed) {}
  Tensor normal(std::vector<int64_t> ne, double sd, double mean = 0.0) {
    std::normal_distribution<double> d(mean, sd);
    Tensor t{std::move(ne), {}};
    int64_t n = 1;
    for (int64_t x : t.ne) n *= x;
    for (int64_t i = 0; i < n; ++i) t.data.push_back(static_cast<float>(d(rng_)));
    return t;
  }
  Tensor uniform(std::vector<int64_t> ne, double lo, double hi) {
    std::uniform_real_distribution<double> d(lo, hi);
    Tensor t{std::move(ne), {}};
    for (int64_t i = 0; i < t.ne[0]; ++i) t.data.push_back(static_cast<float>(d(rng_)));
    return t;
  }

 private:
  std::mt19937_64 rng_;
};

/// A random model of `dm`: weights of unit-variance outputs, norms near 1, decays in (0.3, 1).
Model random_hybrid(const Dims& dm, uint64_t seed) {
  Gen g(seed);
  Model m;
  m.arch = dm.arch;
  const int64_t n = dm.n_embd, key_dim = dm.hk * dm.dk, vd = dm.hv * dm.dv;
  const int64_t conv_dim = 2 * key_dim + vd;
  const double in = 1.0 / std::sqrt(static_cast<double>(n));
  m.u32 = {{"embedding_length", dm.n_embd},
           {"block_count", dm.n_layer},
           {"context_length", 64},
           {"attention.head_count", dm.n_head},
           {"attention.head_count_kv", dm.n_kv},
           {"attention.key_length", dm.hd},
           {"attention.value_length", dm.hd},
           {"rope.dimension_count", dm.n_rot},
           {"full_attention_interval", dm.interval},
           {"ssm.conv_kernel", dm.kernel},
           {"ssm.state_size", dm.dk},
           {"ssm.group_count", dm.hk},
           {"ssm.time_step_rank", dm.hv},
           {"ssm.inner_size", vd}};
  m.f32 = {{"attention.layer_norm_rms_epsilon", 1e-6f}, {"rope.freq_base", 1e4f}};
  m.i32s = {{"rope.dimension_sections", {1, 1, 0, 0}}};
  m.tensors["token_embd.weight"] = g.normal({n, dm.n_vocab}, 1.0);
  m.tensors["output_norm.weight"] = g.normal({n}, 0.1, 1.0);
  m.tensors["output.weight"] = g.normal({n, dm.n_vocab}, in);
  for (int l = 0; l < dm.n_layer; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    m.tensors[p + "attn_norm.weight"] = g.normal({n}, 0.1, 1.0);
    m.tensors[p + "post_attention_norm.weight"] = g.normal({n}, 0.1, 1.0);
    if ((l + 1) % dm.interval == 0) {
      const int64_t dq = dm.n_head * dm.hd, dkv = dm.n_kv * dm.hd;
      m.tensors[p + "attn_q.weight"] = g.normal({n, 2 * dq}, in);
      m.tensors[p + "attn_k.weight"] = g.normal({n, dkv}, in);
      m.tensors[p + "attn_v.weight"] = g.normal({n, dkv}, in);
      m.tensors[p + "attn_q_norm.weight"] = g.normal({dm.hd}, 0.1, 1.0);
      m.tensors[p + "attn_k_norm.weight"] = g.normal({dm.hd}, 0.1, 1.0);
      m.tensors[p + "attn_output.weight"] = g.normal({dq, n}, 0.5 / std::sqrt(double(dq)));
    } else {
      m.tensors[p + "attn_qkv.weight"] = g.normal({n, conv_dim}, in);
      m.tensors[p + "attn_gate.weight"] = g.normal({n, vd}, in);
      m.tensors[p + "ssm_conv1d.weight"] = g.normal({dm.kernel, conv_dim}, 0.5);
      m.tensors[p + "ssm_dt.bias"] = g.normal({dm.hv}, 0.5);
      m.tensors[p + "ssm_a"] = g.uniform({dm.hv}, -1.0, -0.1);
      m.tensors[p + "ssm_beta.weight"] = g.normal({n, dm.hv}, in);
      m.tensors[p + "ssm_alpha.weight"] = g.normal({n, dm.hv}, in);
      m.tensors[p + "ssm_norm.weight"] = g.normal({dm.dv}, 0.1, 1.0);
      m.tensors[p + "ssm_out.weight"] = g.normal({vd, n}, 0.5 / std::sqrt(double(vd)));
    }
    if (dm.arch == "qwen35moe") {
      const int64_t e = dm.n_expert, f = dm.n_ff_exp, fs = dm.n_ff_shexp;
      m.tensors[p + "ffn_gate_inp.weight"] = g.normal({n, e}, in);
      m.tensors[p + "ffn_gate_exps.weight"] = g.normal({n, f, e}, in);
      m.tensors[p + "ffn_up_exps.weight"] = g.normal({n, f, e}, in);
      m.tensors[p + "ffn_down_exps.weight"] = g.normal({f, n, e}, 0.5 / std::sqrt(double(f)));
      m.tensors[p + "ffn_gate_inp_shexp.weight"] = g.normal({n}, in);
      m.tensors[p + "ffn_gate_shexp.weight"] = g.normal({n, fs}, in);
      m.tensors[p + "ffn_up_shexp.weight"] = g.normal({n, fs}, in);
      m.tensors[p + "ffn_down_shexp.weight"] = g.normal({fs, n}, 0.5 / std::sqrt(double(fs)));
    } else {
      m.tensors[p + "ffn_gate.weight"] = g.normal({n, dm.n_ff}, in);
      m.tensors[p + "ffn_up.weight"] = g.normal({n, dm.n_ff}, in);
      m.tensors[p + "ffn_down.weight"] = g.normal({dm.n_ff, n}, 0.5 / std::sqrt(double(dm.n_ff)));
    }
  }
  if (dm.arch == "qwen35moe") {
    m.u32["expert_count"] = dm.n_expert;
    m.u32["expert_used_count"] = dm.n_used;
    m.u32["expert_feed_forward_length"] = dm.n_ff_exp;
    m.u32["expert_shared_feed_forward_length"] = dm.n_ff_shexp;
  } else {
    m.u32["feed_forward_length"] = dm.n_ff;
  }
  return m;
}

const std::vector<int32_t> kTokens = {3, 7, 1, 1, 10, 0, 5, 8};

std::vector<std::vector<double>> run(NaiveQwen35& m, const std::vector<int32_t>& tokens) {
  std::vector<std::vector<double>> out;
  for (int32_t t : tokens) out.push_back(m.step(t));
  return out;
}
std::vector<std::vector<double>> run(NaiveModel& m, const std::vector<int32_t>& tokens) {
  std::vector<std::vector<double>> out;
  for (int32_t t : tokens) out.push_back(m.step(t));
  return out;
}
double worst(const std::vector<std::vector<double>>& a, const std::vector<std::vector<double>>& b) {
  double w = 0.0;
  for (size_t i = 0; i < a.size(); ++i) w = std::max(w, rel_err(a[i], b[i]));
  return w;
}

}  // namespace

TEST_CASE("qwen35 oracle: the delta rule and the conv by hand") {
  // d_k = d_v = 2 (the kernel test's case, in double): from S = 0 with k = (1, 0),
  // v = (2, -4), beta = 0.5, q = (0.6, 0.8): out = scale * 0.6 * (1, -2); then g = ln 0.5,
  // k = (0, 1), v = (3, 3), beta = 1, q = (1, 0): S = [[0.5, -1], [3, 3]], out = scale (0.5, -1).
  std::vector<double> s(4, 0.0);
  const double q0[2] = {0.6, 0.8}, k0[2] = {1, 0}, v0[2] = {2, -4};
  std::vector<double> o = oracle::delta_rule_step(s, 2, 2, q0, k0, v0, 0.0, 0.5, 0.5);
  CHECK(o[0] == doctest::Approx(0.3));
  CHECK(o[1] == doctest::Approx(-0.6));
  const double q1[2] = {1, 0}, k1[2] = {0, 1}, v1[2] = {3, 3};
  o = oracle::delta_rule_step(s, 2, 2, q1, k1, v1, std::log(0.5), 1.0, 0.5);
  CHECK(o[0] == doctest::Approx(0.25));
  CHECK(o[1] == doctest::Approx(-0.5));
  CHECK(s == std::vector<double>{0.5, -1, 3, 3});
  // A key already stored with beta = 1 is overwritten, not added: S^T k = v afterwards.
  std::vector<double> s2 = {0, 0, 5, 7};  // row 1 (k = (0, 1)) holds (5, 7)
  o = oracle::delta_rule_step(s2, 2, 2, q1, k1, v1, 0.0, 1.0, 1.0);
  CHECK(s2 == std::vector<double>{0, 0, 3, 3});

  // Conv, kernel 3, two channels: state rows (x_{-2}, x_{-1}).
  std::vector<double> st = {1, 10, 2, 20};
  const std::vector<double> w = {1, 2, 3, 0, 0, 1};  // channel 0: taps 1, 2, 3; channel 1: x_t
  std::vector<double> y = oracle::causal_conv1d_step({4, 40}, w, 3, st);
  CHECK(y == std::vector<double>{1 * 1 + 2 * 2 + 3 * 4, 40});
  CHECK(st == std::vector<double>{2, 20, 4, 40});
  y = oracle::causal_conv1d_step({5, 50}, w, 3, st);
  CHECK(y == std::vector<double>{1 * 2 + 2 * 4 + 3 * 5, 50});
  CHECK(st == std::vector<double>{4, 40, 5, 50});
}

TEST_CASE("qwen35 oracle: the chunked delta rule equals the token loop") {
  const int32_t dk = 8, dv = 6;
  const int64_t T = 100;
  std::mt19937_64 rng(5);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  std::vector<double> q(T * dk), k(T * dk), v(T * dv), g(T), beta(T), s0(dk * dv);
  for (double& x : q) x = nd(rng);
  for (double& x : k) x = nd(rng);
  for (double& x : v) x = nd(rng);
  for (int64_t t = 0; t < T; ++t) {
    for (double* x : {q.data() + t * dk, k.data() + t * dk}) {
      double ss = 0;
      for (int i = 0; i < dk; ++i) ss += x[i] * x[i];
      for (int i = 0; i < dk; ++i) x[i] /= std::sqrt(ss);
    }
    g[t] = -2.0 * ud(rng);
    beta[t] = ud(rng);
  }
  for (double& x : s0) x = nd(rng);
  std::vector<double> s_loop = s0, out_loop;
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<double> o = oracle::delta_rule_step(s_loop, dk, dv, &q[t * dk], &k[t * dk],
                                                          &v[t * dv], g[t], beta[t], 0.25);
    out_loop.insert(out_loop.end(), o.begin(), o.end());
  }
  for (const int32_t chunk : {1, 7, 64, 200}) {
    CAPTURE(chunk);
    std::vector<double> s = s0;
    const std::vector<double> out = oracle::delta_rule_chunked(
        s, dk, dv, T, q.data(), k.data(), v.data(), g.data(), beta.data(), 0.25, chunk);
    CHECK(rel_err(out, out_loop) < 1e-12);
    CHECK(rel_err(s, s_loop) < 1e-12);
    // Two calls (a prompt split into ubatches) carry the state between them.
    std::vector<double> s2 = s0;
    std::vector<double> o1 = oracle::delta_rule_chunked(
        s2, dk, dv, 37, q.data(), k.data(), v.data(), g.data(), beta.data(), 0.25, chunk);
    const std::vector<double> o2 = oracle::delta_rule_chunked(
        s2, dk, dv, T - 37, &q[37 * dk], &k[37 * dk], &v[37 * dv], &g[37], &beta[37], 0.25, chunk);
    o1.insert(o1.end(), o2.begin(), o2.end());
    CHECK(rel_err(o1, out_loop) < 1e-12);
    CHECK(rel_err(s2, s_loop) < 1e-12);
  }
}

TEST_CASE("qwen35 oracle: attention layers equal the qwen3 oracle on an equivalent file") {
  // Every layer full attention (interval 1). With the gate rows of attn_q zero, sigmoid(0) = 1/2
  // halves the attention output: the qwen3 file takes the query rows, attn_output / 2,
  // post_attention_norm as ffn_norm and the same partial rotary (rope.dimension_count 4 of 8).
  Dims dm;
  dm.n_layer = 2;
  dm.interval = 1;
  Model h = random_hybrid(dm, 11);
  Model q3;
  q3.arch = "qwen3";
  for (const char* k : {"embedding_length", "block_count", "context_length", "attention.head_count",
                        "attention.head_count_kv", "attention.key_length", "attention.value_length",
                        "rope.dimension_count", "feed_forward_length"})
    q3.u32[k] = h.u32.at(k);
  q3.f32 = h.f32;
  const int64_t dq = dm.n_head * dm.hd;
  for (auto& [name, t] : h.tensors) {
    std::string out_name = name;
    Tensor out = t;
    if (contains(name, "attn_q.weight")) {
      out.ne = {dm.n_embd, dq};
      out.data.clear();
      for (int head = 0; head < dm.n_head; ++head) {
        for (int r = 0; r < dm.hd; ++r) {
          const int64_t row = head * 2 * dm.hd + r;
          out.data.insert(out.data.end(), t.data.begin() + row * dm.n_embd,
                          t.data.begin() + (row + 1) * dm.n_embd);
          for (int c = 0; c < dm.n_embd; ++c) h.tensors[name].at(row + dm.hd, c) = 0.0f;
        }
      }
    } else if (contains(name, "attn_output.weight")) {
      for (float& x : out.data) x *= 0.5f;
    } else if (contains(name, "post_attention_norm")) {
      out_name = name.substr(0, name.find("post_attention_norm")) + "ffn_norm.weight";
    }
    q3.tensors[out_name] = out;
  }
  NaiveQwen35 hybrid(h.file());
  NaiveModel plain(q3.file("qwen3-equivalent.gguf"));
  const auto a = run(hybrid, kTokens), b = run(plain, kTokens);
  CHECK(worst(a, b) < 1e-12);
  // Gate rows that are not zero change the result.
  NaiveQwen35 gated(random_hybrid(dm, 11).file());
  CHECK(worst(run(gated, kTokens), b) > 1e-3);
}

TEST_CASE("qwen35moe oracle: routed experts equal qwen3moe's; the shared expert is gated") {
  Dims dm;
  dm.arch = "qwen35moe";
  dm.n_layer = 2;
  dm.interval = 1;
  SUBCASE("without a shared expert: the qwen3moe oracle on the same weights") {
    Model h = random_hybrid(dm, 21);
    h.u32.erase("expert_shared_feed_forward_length");
    Model q3;
    q3.arch = "qwen3moe";
    for (const char* k : {"embedding_length", "block_count", "context_length",
                          "attention.head_count", "attention.head_count_kv", "attention.key_length",
                          "attention.value_length", "rope.dimension_count", "expert_count",
                          "expert_used_count", "expert_feed_forward_length"})
      q3.u32[k] = h.u32.at(k);
    q3.f32 = h.f32;
    for (auto it = h.tensors.begin(); it != h.tensors.end();) {
      if (contains(it->first, "shexp")) {
        it = h.tensors.erase(it);
        continue;
      }
      std::string name = it->first;
      Tensor t = it->second;
      if (contains(name, "attn_q.weight")) {  // zero gates; the query rows for qwen3moe
        Tensor qrows{{dm.n_embd, dm.n_head * dm.hd}, {}};
        for (int head = 0; head < dm.n_head; ++head)
          for (int r = 0; r < dm.hd; ++r) {
            const int64_t row = head * 2 * dm.hd + r;
            qrows.data.insert(qrows.data.end(), t.data.begin() + row * dm.n_embd,
                              t.data.begin() + (row + 1) * dm.n_embd);
            for (int c = 0; c < dm.n_embd; ++c) it->second.at(row + dm.hd, c) = 0.0f;
          }
        t = qrows;
      } else if (contains(name, "attn_output.weight")) {
        for (float& x : t.data) x *= 0.5f;
      } else if (contains(name, "post_attention_norm")) {
        name = name.substr(0, name.find("post_attention_norm")) + "ffn_norm.weight";
      }
      q3.tensors[name] = t;
      ++it;
    }
    NaiveQwen35 hybrid(h.file());
    NaiveModel plain(q3.file("qwen3moe-equivalent.gguf"));
    CHECK(hybrid.config().n_ff_shexp == 0);
    CHECK(worst(run(hybrid, kTokens), run(plain, kTokens)) < 1e-12);
    for (int l = 0; l < dm.n_layer; ++l)
      CHECK(hybrid.last_routing()[l].ids == plain.last_routing()[l].ids);
  }
  SUBCASE("routed experts silent, shared gate vector 0: half the shared expert, as a dense FFN") {
    Model h = random_hybrid(dm, 22);
    Model dense = h;
    dense.arch = "qwen35";
    for (auto& [name, t] : h.tensors) {
      if (contains(name, "ffn_down_exps")) std::fill(t.data.begin(), t.data.end(), 0.0f);
      if (contains(name, "ffn_gate_inp_shexp")) std::fill(t.data.begin(), t.data.end(), 0.0f);
    }
    for (auto it = dense.tensors.begin(); it != dense.tensors.end();) {
      const std::string name = it->first;
      if (contains(name, "_exps") || contains(name, "ffn_gate_inp")) {
        it = dense.tensors.erase(it);
        continue;
      }
      if (contains(name, "_shexp")) {
        Tensor t = it->second;
        if (contains(name, "ffn_down_shexp"))
          for (float& x : t.data) x *= 0.5f;
        const std::string base = name.substr(0, name.find("_shexp"));
        it = dense.tensors.erase(it);
        dense.tensors[base + ".weight"] = t;
        continue;
      }
      ++it;
    }
    for (const char* k : {"expert_count", "expert_used_count", "expert_feed_forward_length",
                          "expert_shared_feed_forward_length"})
      dense.u32.erase(k);
    dense.u32["feed_forward_length"] = dm.n_ff_shexp;
    NaiveQwen35 moe(h.file()), plain(dense.file("dense.gguf"));
    CHECK(moe.config().n_ff_shexp == dm.n_ff_shexp);
    CHECK(worst(run(moe, kTokens), run(plain, kTokens)) < 1e-12);
  }
}

namespace {

// An independent loop for a model of GDN layers (every layer GDN) with a dense FFN: the layer
// written out from the formulas of naive_qwen35.h, sharing no code with the oracle.
struct IndependentGdn {
  static constexpr double kEps = 1e-6f;  // the file's rms eps (a float key)
  const Model& m;
  Dims dm;
  int pos = 0;
  std::vector<std::vector<double>> conv, state;  // per layer

  IndependentGdn(const Model& model, const Dims& d) : m(model), dm(d) {
    const int conv_dim = 2 * dm.hk * dm.dk + dm.hv * dm.dv;
    conv.assign(dm.n_layer, std::vector<double>((dm.kernel - 1) * conv_dim, 0.0));
    state.assign(dm.n_layer, std::vector<double>(dm.hv * dm.dk * dm.dv, 0.0));
  }
  const Tensor& t(const std::string& name) const { return m.tensors.at(name); }
  std::vector<double> mv(const std::string& name, const std::vector<double>& x) const {
    const Tensor& w = t(name);
    std::vector<double> y(static_cast<size_t>(w.ne[1]), 0.0);
    for (int64_t o = 0; o < w.ne[1]; ++o)
      for (int64_t i = 0; i < w.ne[0]; ++i) y[o] += w.data[o * w.ne[0] + i] * x[i];
    return y;
  }
  std::vector<double> norm(const std::vector<double>& x, const std::string& w) const {
    double ms = 0;
    for (double v : x) ms += v * v / x.size();
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] / std::sqrt(ms + kEps) * t(w).data[i];
    return y;
  }
  static double sg(double x) { return 1 / (1 + std::exp(-x)); }
  std::vector<double> step(int token) {
    const int n = dm.n_embd, kd = dm.hk * dm.dk, vd = dm.hv * dm.dv, cd = 2 * kd + vd;
    std::vector<double> x(n);
    for (int i = 0; i < n; ++i) x[i] = t("token_embd.weight").data[token * n + i];
    for (int l = 0; l < dm.n_layer; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      const std::vector<double> h = norm(x, p + "attn_norm.weight");
      const std::vector<double> qkv = mv(p + "attn_qkv.weight", h),
                                z = mv(p + "attn_gate.weight", h);
      const std::vector<double> b = mv(p + "ssm_beta.weight", h), a = mv(p + "ssm_alpha.weight", h);
      std::vector<double> y(cd);
      for (int c = 0; c < cd; ++c) {
        std::vector<double> window;  // oldest first
        for (int r = 0; r < dm.kernel - 1; ++r) window.push_back(conv[l][r * cd + c]);
        window.push_back(qkv[c]);
        double acc = 0;
        for (int i = 0; i < dm.kernel; ++i)
          acc += t(p + "ssm_conv1d.weight").data[c * dm.kernel + i] * window[i];
        y[c] = acc * sg(acc);
        for (int r = 0; r < dm.kernel - 1; ++r) conv[l][r * cd + c] = window[r + 1];
      }
      auto unit = [](std::vector<double> v) {
        double ss = 0;
        for (double e : v) ss += e * e;
        for (double& e : v) e /= std::sqrt(ss + kEps);
        return v;
      };
      std::vector<double> o(vd);
      for (int hh = 0; hh < dm.hv; ++hh) {
        const int j = hh % dm.hk;  // tiled
        const std::vector<double> q = unit({y.begin() + j * dm.dk, y.begin() + (j + 1) * dm.dk});
        const std::vector<double> k =
            unit({y.begin() + kd + j * dm.dk, y.begin() + kd + (j + 1) * dm.dk});
        const double* v = y.data() + 2 * kd + hh * dm.dv;
        const double u = a[hh] + t(p + "ssm_dt.bias").data[hh];
        const double gg = t(p + "ssm_a").data[hh] * std::log(1 + std::exp(u));
        const double beta = sg(b[hh]);
        double* S = state[l].data() + hh * dm.dk * dm.dv;  // [dk][dv]
        for (int e = 0; e < dm.dk * dm.dv; ++e) S[e] *= std::exp(gg);
        std::vector<double> oh(dm.dv);
        for (int c = 0; c < dm.dv; ++c) {
          double sk = 0;
          for (int r = 0; r < dm.dk; ++r) sk += S[r * dm.dv + c] * k[r];
          const double delta = beta * (v[c] - sk);
          for (int r = 0; r < dm.dk; ++r) S[r * dm.dv + c] += k[r] * delta;
          double sq = 0;
          for (int r = 0; r < dm.dk; ++r) sq += S[r * dm.dv + c] * q[r];
          oh[c] = sq / std::sqrt(double(dm.dk));
        }
        double ms = 0;
        for (double e : oh) ms += e * e / dm.dv;
        for (int c = 0; c < dm.dv; ++c) {
          const double zz = z[hh * dm.dv + c];
          o[hh * dm.dv + c] =
              oh[c] / std::sqrt(ms + kEps) * t(p + "ssm_norm.weight").data[c] * zz * sg(zz);
        }
      }
      const std::vector<double> out = mv(p + "ssm_out.weight", o);
      for (int i = 0; i < n; ++i) x[i] += out[i];
      const std::vector<double> h2 = norm(x, p + "post_attention_norm.weight");
      const std::vector<double> gt = mv(p + "ffn_gate.weight", h2),
                                up = mv(p + "ffn_up.weight", h2);
      std::vector<double> hid(gt.size());
      for (size_t i = 0; i < gt.size(); ++i) hid[i] = gt[i] * sg(gt[i]) * up[i];
      const std::vector<double> f = mv(p + "ffn_down.weight", hid);
      for (int i = 0; i < n; ++i) x[i] += f[i];
    }
    ++pos;
    return mv("output.weight", norm(x, "output_norm.weight"));
  }
};

/// Reorders V heads of a GDN layer from Hugging Face's grouped order (V head k * r + v pairs
/// with K head k) to the tiled order qwen35 files store (position v * H_k + k), in every tensor
/// llama.cpp's converter reorders: attn_qkv's V rows, the V channels of ssm_conv1d, attn_gate,
/// ssm_beta, ssm_alpha, ssm_dt, ssm_a, and ssm_out's columns.
void hf_to_gguf_order(Model& m, const Dims& dm, int layer) {
  const std::string p = "blk." + std::to_string(layer) + ".";
  const int r = dm.hv / dm.hk, kd = dm.hk * dm.dk;
  auto src_head = [&](int pos) { return (pos % dm.hk) * r + pos / dm.hk; };  // tiled <- grouped
  auto rows = [&](const std::string& name, int64_t first_row, int head_rows) {
    Tensor& t = m.tensors.at(name);
    const Tensor old = t;
    for (int pos = 0; pos < dm.hv; ++pos)
      for (int i = 0; i < head_rows; ++i)
        for (int64_t c = 0; c < t.ne[0]; ++c)
          t.at(first_row + pos * head_rows + i, c) =
              old.data[(first_row + src_head(pos) * head_rows + i) * t.ne[0] + c];
  };
  rows(p + "attn_qkv.weight", 2 * kd, dm.dv);
  rows(p + "ssm_conv1d.weight", 2 * kd, dm.dv);
  rows(p + "attn_gate.weight", 0, dm.dv);
  rows(p + "ssm_beta.weight", 0, 1);
  rows(p + "ssm_alpha.weight", 0, 1);
  for (const char* vecname : {"ssm_dt.bias", "ssm_a"}) {
    Tensor& t = m.tensors.at(p + vecname);
    const Tensor old = t;
    for (int pos = 0; pos < dm.hv; ++pos) t.data[pos] = old.data[src_head(pos)];
  }
  Tensor& out = m.tensors.at(p + "ssm_out.weight");  // columns: ne[0] = value_dim
  const Tensor old = out;
  for (int64_t o = 0; o < out.ne[1]; ++o)
    for (int pos = 0; pos < dm.hv; ++pos)
      for (int i = 0; i < dm.dv; ++i)
        out.at(o, pos * dm.dv + i) = old.data[o * out.ne[0] + src_head(pos) * dm.dv + i];
}

}  // namespace

TEST_CASE("qwen35 oracle: GDN layers equal an independent loop (H_k != H_v)") {
  Dims dm;
  dm.n_layer = 2;
  dm.interval = 1000;  // no attention layer
  for (const auto& [hk, hv] : {std::pair{2, 4}, std::pair{1, 3}, std::pair{3, 3}}) {
    CAPTURE(hk);
    CAPTURE(hv);
    dm.hk = hk;
    dm.hv = hv;
    const Model m = random_hybrid(dm, 31 + hk * 10 + hv);
    NaiveQwen35 o(m.file());
    CHECK(o.config().is_attention(0) == false);
    IndependentGdn ind(m, dm);
    for (int32_t tok : kTokens) CHECK(rel_err(o.step(tok), ind.step(tok)) < 1e-12);
    // The state is carried: a fresh model fed only the last token differs.
    NaiveQwen35 fresh(m.file());
    CHECK(rel_err(fresh.step(kTokens.back()), IndependentGdn(m, dm).step(kTokens.back())) < 1e-12);
  }
}

TEST_CASE("qwen35 oracle: the V-head order of converted files (tiled) is Hugging Face's grouped") {
  // A model written in HF's order, converted as llama.cpp's converter does: the oracle reading
  // the converted file with V head h -> K head h mod H_k equals the grouped reading of the HF
  // order; reading the unconverted file tiled does not. With H_k == H_v nothing can tell.
  for (const auto& [hk, hv] : {std::pair{2, 4}, std::pair{2, 6}, std::pair{4, 4}}) {
    CAPTURE(hk);
    CAPTURE(hv);
    Dims dm;
    dm.hk = hk;
    dm.hv = hv;
    const Model hf = random_hybrid(dm, 41 + hv);
    Model converted = hf;
    for (int l = 0; l < dm.n_layer; ++l)
      if ((l + 1) % dm.interval != 0) hf_to_gguf_order(converted, dm, l);
    NaiveQwen35 grouped(hf.file(), 0, VHeadMapping::grouped);
    NaiveQwen35 tiled_converted(converted.file());
    NaiveQwen35 tiled_raw(hf.file());
    const auto want = run(grouped, kTokens);
    CHECK(worst(run(tiled_converted, kTokens), want) < 1e-12);
    const double raw = worst(run(tiled_raw, kTokens), want);
    if (hk == hv) {
      CHECK(raw == 0.0);
    } else {
      CHECK(raw > 1e-3);
    }
  }
}

TEST_CASE("qwen35 oracle: MTP block skipped, per-layer head_count_kv, snapshots and reset") {
  Dims dm;
  const Model base = random_hybrid(dm, 51);
  NaiveQwen35 ref(base.file());
  const auto want = run(ref, kTokens);
  CHECK(ref.pos() == static_cast<int32_t>(kTokens.size()));
  CHECK(ref.config().n_layer == 4);
  CHECK(ref.config().is_attention(3));
  CHECK(!ref.config().is_attention(2));

  SUBCASE("an MTP block counted in block_count is not read") {
    Model m = base;
    m.u32["block_count"] = dm.n_layer + 1;
    m.u32["nextn_predict_layers"] = 1;
    Gen g(52);
    const std::string p = "blk." + std::to_string(dm.n_layer) + ".";
    for (const char* t : {"nextn.enorm.weight", "nextn.hnorm.weight",
                          "nextn.shared_head_norm.weight", "attn_norm.weight"})
      m.tensors[p + t] = g.normal({dm.n_embd}, 0.1, 1.0);
    m.tensors[p + "nextn.eh_proj.weight"] = g.normal({2 * dm.n_embd, dm.n_embd}, 0.1);
    NaiveQwen35 o(m.file());
    CHECK(o.config().n_layer == dm.n_layer);
    CHECK(o.config().n_mtp == 1);
    CHECK(worst(run(o, kTokens), want) == 0.0);
    // NaiveModel delegates to the hybrid.
    NaiveModel nm(m.file());
    REQUIRE(nm.hybrid() != nullptr);
    CHECK(nm.config().n_layer == dm.n_layer);
    CHECK(worst(run(nm, kTokens), want) == 0.0);
    // Without nextn_predict_layers the extra layer is a layer the file does not describe.
    m.u32.erase("nextn_predict_layers");
    const Error e = expect_error([&] { NaiveQwen35 bad(m.file()); });
    CHECK(contains(e.what(), "blk.4."));
  }
  SUBCASE("head_count_kv as a per-layer array with 0 on GDN layers") {
    Model m = base;
    m.u32.erase("attention.head_count_kv");
    m.i32s["attention.head_count_kv"] = {0, 0, 0, dm.n_kv};
    NaiveQwen35 o(m.file());
    CHECK(o.config().n_head_kv == std::vector<int32_t>{0, 0, 0, dm.n_kv});
    CHECK(worst(run(o, kTokens), want) == 0.0);
  }
  SUBCASE("a copy is a checkpoint; reset starts over") {
    NaiveQwen35 o(base.file());
    for (size_t i = 0; i < 4; ++i) o.step(kTokens[i]);
    NaiveQwen35 snap = o;
    for (size_t i = 4; i < kTokens.size(); ++i) CHECK(rel_err(o.step(kTokens[i]), want[i]) == 0.0);
    CHECK(snap.pos() == 4);
    for (size_t i = 4; i < kTokens.size(); ++i)
      CHECK(rel_err(snap.step(kTokens[i]), want[i]) == 0.0);
    o.reset();
    CHECK(o.pos() == 0);
    for (double s : o.gdn_state(0).s) CHECK(s == 0.0);
    CHECK(worst(run(o, kTokens), want) == 0.0);
    CHECK(expect_error([&] { (void)o.gdn_state(3); }).category() ==
          ErrorCategory::invalid_argument);
  }
}

TEST_CASE("qwen35 oracle: malformed files are refused with the key or tensor named") {
  Dims dm;
  const Model base = random_hybrid(dm, 61);
  SUBCASE("a missing ssm key") {
    Model m = base;
    m.u32.erase("ssm.group_count");
    const Error e = expect_error([&] { NaiveQwen35 o(m.file()); });
    CHECK(e.category() == ErrorCategory::missing);
    CHECK(contains(e.what(), "qwen35.ssm.group_count"));
  }
  SUBCASE("V heads not a multiple of K heads") {
    Model m = base;
    m.u32["ssm.group_count"] = 3;
    const Error e = expect_error([&] { NaiveQwen35 o(m.file()); });
    CHECK(e.category() == ErrorCategory::format);
    CHECK(contains(e.what(), "ssm.time_step_rank"));
  }
  SUBCASE("attn_qkv of the wrong shape") {
    Model m = base;
    m.tensors["blk.0.attn_qkv.weight"].ne[1] -= 1;
    m.tensors["blk.0.attn_qkv.weight"].data.resize(static_cast<size_t>(
        m.tensors["blk.0.attn_qkv.weight"].ne[0] * m.tensors["blk.0.attn_qkv.weight"].ne[1]));
    const Error e = expect_error([&] { NaiveQwen35 o(m.file()); });
    CHECK(e.category() == ErrorCategory::format);
    CHECK(contains(e.what(), "blk.0.attn_qkv.weight"));
  }
  SUBCASE("a missing tensor, an extra tensor, another architecture, a bad token") {
    Model m = base;
    m.tensors.erase("blk.1.ssm_a");
    Error e = expect_error([&] { NaiveQwen35 o(m.file()); });
    CHECK(contains(e.what(), "blk.1.ssm_a"));
    m = base;
    m.tensors["blk.0.attn_q.weight"] = Tensor{{dm.n_embd, 4}, std::vector<float>(64, 0.0f)};
    e = expect_error([&] { NaiveQwen35 o(m.file()); });
    CHECK(e.category() == ErrorCategory::unsupported);
    CHECK(contains(e.what(), "blk.0.attn_q.weight"));
    m = base;
    m.arch = "qwen3next";
    e = expect_error([&] { NaiveQwen35 o(m.file()); });
    CHECK(e.category() == ErrorCategory::unsupported);
    NaiveQwen35 o(base.file(), 2);
    CHECK(expect_error([&] { o.step(dm.n_vocab); }).category() == ErrorCategory::invalid_argument);
    o.step(0);
    o.step(0);
    CHECK(contains(expect_error([&] { o.step(0); }).what(), "context full"));
  }
}
