// The Gated DeltaNet kernels (cpu_kernels/gdn.h) composed into a GDN layer, the way a model
// calls them, against the qwen35 oracle (tests/oracle/naive_qwen35.h) on synthetic files with
// H_k != H_v: a prompt as one prefill (conv and delta rule over T tokens per call), then decode
// steps (one token per call), the recurrent state carried between them. Within the issue's
// tolerance, max |kernels - oracle| / max |oracle| <= 1e-5 per step; the conv and delta-rule
// states equal the oracle's (same layouts). This pins the call sequence and layouts the model
// code uses; it is not the engine's forward.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "berth/cpu_kernels/gdn.h"
#include "berth/cpu_kernels/ops.h"
#include "berth/io/gguf.h"
#include "berth/tools/synth.h"
#include "naive_qwen35.h"
#include "test_util.h"

namespace {

using namespace berth;

std::vector<float> f32(const gguf::File& f, const std::string& name) {
  const gguf::TensorInfo& t = f.tensor(name);
  REQUIRE(t.type == GgmlType::F32);
  std::vector<float> v(static_cast<size_t>(t.n_elements()));
  std::memcpy(v.data(), t.data, v.size() * sizeof(float));
  return v;
}

// y[r][o] = sum_i w[o][i] x[r][i] for `rows` rows (float in, double sum).
std::vector<float> matmul(const std::vector<float>& w, const std::vector<float>& x, int64_t rows,
                          int64_t n_in, int64_t n_out) {
  std::vector<float> y(static_cast<size_t>(rows * n_out));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < n_out; ++o) {
      double s = 0;
      for (int64_t i = 0; i < n_in; ++i) s += double(w[o * n_in + i]) * x[r * n_in + i];
      y[r * n_out + o] = static_cast<float>(s);
    }
  return y;
}

// A one-layer qwen35 (layer 0 is GDN) run with the kernels, T tokens per call.
struct KernelGdnModel {
  const gguf::File& f;
  int64_t n, dk, dv, hk, hv, kd, vd, cd, nv, n_ff;
  float eps;
  std::vector<float> conv_state, state;  // [3][cd], [hv][dk][dv]

  explicit KernelGdnModel(const gguf::File& file) : f(file) {
    n = f.get_int("qwen35.embedding_length");
    dk = f.get_int("qwen35.ssm.state_size");
    hk = f.get_int("qwen35.ssm.group_count");
    hv = f.get_int("qwen35.ssm.time_step_rank");
    dv = f.get_int("qwen35.ssm.inner_size") / hv;
    kd = hk * dk;
    vd = hv * dv;
    cd = 2 * kd + vd;
    nv = f.tensor("token_embd.weight").ne[1];
    n_ff = f.get_int("qwen35.feed_forward_length");
    eps = static_cast<float>(f.get_float("qwen35.attention.layer_norm_rms_epsilon"));
    conv_state.assign(static_cast<size_t>(3 * cd), 0.0f);
    state.assign(static_cast<size_t>(hv * dk * dv), 0.0f);
  }

  // Logits of each of the T tokens.
  std::vector<std::vector<float>> eval(const std::vector<int32_t>& tokens) {
    const int64_t T = static_cast<int64_t>(tokens.size());
    const std::vector<float> embd = f32(f, "token_embd.weight");
    std::vector<float> x(static_cast<size_t>(T * n)), h(x.size());
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(&x[t * n], &embd[tokens[t] * n], static_cast<size_t>(n) * sizeof(float));
    const std::vector<float> attn_norm = f32(f, "blk.0.attn_norm.weight");
    for (int64_t t = 0; t < T; ++t) cpu::rms_norm(&x[t * n], attn_norm.data(), &h[t * n], n, eps);
    const std::vector<float> qkv = matmul(f32(f, "blk.0.attn_qkv.weight"), h, T, n, cd);
    const std::vector<float> z = matmul(f32(f, "blk.0.attn_gate.weight"), h, T, n, vd);
    const std::vector<float> b = matmul(f32(f, "blk.0.ssm_beta.weight"), h, T, n, hv);
    const std::vector<float> a = matmul(f32(f, "blk.0.ssm_alpha.weight"), h, T, n, hv);
    // Conv over the rolling state, SiLU fused; channels in two ranges as two threads would.
    std::vector<float> y(static_cast<size_t>(T * cd));
    const std::vector<float> conv_w = f32(f, "blk.0.ssm_conv1d.weight");
    cpu::conv1d_causal(qkv.data(), cd, y.data(), cd, T, conv_w.data(), 4, conv_state.data(), cd, 0,
                       cd / 3, true);
    cpu::conv1d_causal(qkv.data(), cd, y.data(), cd, T, conv_w.data(), 4, conv_state.data(), cd,
                       cd / 3, cd, true);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < 2 * hk; ++j)  // q heads, then k heads
        cpu::l2_norm(&y[t * cd + j * dk], &y[t * cd + j * dk], dk, eps);
    std::vector<float> g(static_cast<size_t>(T * hv)), beta(g.size());
    const std::vector<float> dt = f32(f, "blk.0.ssm_dt.bias"), ssm_a = f32(f, "blk.0.ssm_a");
    for (int64_t t = 0; t < T; ++t)
      cpu::gdn_gates(&a[t * hv], &b[t * hv], dt.data(), ssm_a.data(), &g[t * hv], &beta[t * hv],
                     hv);
    // Per V head (parallel over heads in the engine): V head h reads K head h mod H_k.
    std::vector<float> o(static_cast<size_t>(T * vd));
    const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
    for (int64_t hh = 0; hh < hv; ++hh) {
      const int64_t j = hh % hk;
      cpu::gated_delta_rule(&y[j * dk], cd, &y[kd + j * dk], cd, &y[2 * kd + hh * dv], cd, &g[hh],
                            &beta[hh], hv, T, static_cast<int32_t>(dk), static_cast<int32_t>(dv),
                            scale, &state[hh * dk * dv], &o[hh * dv], vd, 0,
                            static_cast<int32_t>(dv));
    }
    const std::vector<float> ssm_norm = f32(f, "blk.0.ssm_norm.weight");
    for (int64_t t = 0; t < T; ++t)
      for (int64_t hh = 0; hh < hv; ++hh)
        cpu::rms_norm_gated(&o[t * vd + hh * dv], ssm_norm.data(), &z[t * vd + hh * dv],
                            &o[t * vd + hh * dv], dv, eps);
    const std::vector<float> out = matmul(f32(f, "blk.0.ssm_out.weight"), o, T, vd, n);
    cpu::add(x.data(), out.data(), x.data(), T * n);
    // FFN and head.
    const std::vector<float> post = f32(f, "blk.0.post_attention_norm.weight");
    for (int64_t t = 0; t < T; ++t) cpu::rms_norm(&x[t * n], post.data(), &h[t * n], n, eps);
    std::vector<float> gate = matmul(f32(f, "blk.0.ffn_gate.weight"), h, T, n, n_ff);
    const std::vector<float> up = matmul(f32(f, "blk.0.ffn_up.weight"), h, T, n, n_ff);
    cpu::swiglu(gate.data(), up.data(), gate.data(), T * n_ff);
    const std::vector<float> down = matmul(f32(f, "blk.0.ffn_down.weight"), gate, T, n_ff, n);
    cpu::add(x.data(), down.data(), x.data(), T * n);
    const std::vector<float> out_norm = f32(f, "output_norm.weight");
    for (int64_t t = 0; t < T; ++t) cpu::rms_norm(&x[t * n], out_norm.data(), &h[t * n], n, eps);
    const std::vector<float> logits = matmul(f32(f, "output.weight"), h, T, n, nv);
    std::vector<std::vector<float>> rows;
    for (int64_t t = 0; t < T; ++t) rows.emplace_back(&logits[t * nv], &logits[(t + 1) * nv]);
    return rows;
  }
};

double rel(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num = std::max(num, std::abs(got[i] - want[i]));
    den = std::max(den, std::abs(want[i]));
  }
  return num / den;
}

}  // namespace

TEST_CASE("gdn kernels composed as a layer match the qwen35 oracle (prefill, then decode)") {
  for (const auto& [h_k, h_v] : {std::pair{2, 4}, std::pair{2, 2}, std::pair{1, 3}}) {
    CAPTURE(h_k);
    CAPTURE(h_v);
    SynthSpec s = synth_preset("tiny-qwen35");
    s.n_layer = 1;  // layer 0 is GDN (full_attention_interval 4)
    s.ssm_n_group = h_k;
    s.ssm_dt_rank = h_v;
    s.seed = 17;
    const std::string path = (test::temp_dir("gdn-compose") /
                              ("l1-" + std::to_string(h_k) + std::to_string(h_v) + ".gguf"))
                                 .string();
    write_synth_model(s, path, 2);
    gguf::File f = gguf::File::open(path);
    oracle::NaiveQwen35 ref(f, 64);
    KernelGdnModel k(f);
    const std::vector<int32_t> prompt = {11, 500, 7, 7, 900, 64, 3};
    const std::vector<std::vector<float>> got = k.eval(prompt);  // one prefill call
    double worst = 0;
    for (size_t t = 0; t < prompt.size(); ++t)
      worst = std::max(worst, rel(got[t], ref.step(prompt[t])));
    for (int32_t tok : {42, 1000, 5, 5, 77}) {  // decode steps
      worst = std::max(worst, rel(k.eval({tok})[0], ref.step(tok)));
    }
    MESSAGE("H_k ", h_k, " H_v ", h_v, ": max |kernels - oracle| / max |oracle| = ", worst);
    CHECK(worst <= 1e-5);
    // The states: the same layouts, equal to float rounding.
    const oracle::GdnLayerState& st = ref.gdn_state(0);
    REQUIRE(st.s.size() == k.state.size());
    REQUIRE(st.conv.size() == k.conv_state.size());
    double s_num = 0, s_den = 0, c_num = 0, c_den = 0;
    for (size_t i = 0; i < st.s.size(); ++i) {
      s_num = std::max(s_num, std::abs(k.state[i] - st.s[i]));
      s_den = std::max(s_den, std::abs(st.s[i]));
    }
    for (size_t i = 0; i < st.conv.size(); ++i) {
      c_num = std::max(c_num, std::abs(k.conv_state[i] - st.conv[i]));
      c_den = std::max(c_den, std::abs(st.conv[i]));
    }
    CHECK(s_num / s_den <= 1e-5);
    CHECK(c_num / c_den <= 1e-5);
  }
}
