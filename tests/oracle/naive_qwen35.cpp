// Naive double-precision forward of qwen35 / qwen35moe (see naive_qwen35.h for the model).
// Deliberately simple: no SIMD, no threads, no shared kernels.
#include "naive_qwen35.h"

#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "berth/core/error.h"
#include "naive_common.h"

namespace berth::oracle {

using namespace detail;  // NOLINT: the shared helpers of naive_common.h

namespace {

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

/// x / sqrt(|x|^2 + eps) over n values in place (HF's l2norm).
void l2_normalise(double* x, int32_t n, double eps) {
  double ss = 0.0;
  for (int32_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const double inv = 1.0 / std::sqrt(ss + eps);
  for (int32_t i = 0; i < n; ++i) x[i] *= inv;
}

/// A count key that may be a scalar or a per-layer array; returns one value per layer.
std::vector<int64_t> per_layer(const gguf::File& file, const std::string& key, int32_t n_layer) {
  const gguf::Value* v = file.find(key);
  if (v != nullptr && v->type() == gguf::ValueType::array) {
    const std::vector<int64_t> a = file.get_int_array(key);
    if (static_cast<int64_t>(a.size()) < n_layer) {
      throw Error(ErrorCategory::format, "oracle: " + file.path() + ": key '" + key + "' has " +
                                             std::to_string(a.size()) + " entries for " +
                                             std::to_string(n_layer) + " layers");
    }
    return std::vector<int64_t>(a.begin(), a.begin() + n_layer);
  }
  return std::vector<int64_t>(static_cast<size_t>(n_layer), file.get_int(key));
}

}  // namespace

std::vector<double> causal_conv1d_step(const std::vector<double>& x, const std::vector<double>& w,
                                       int32_t kernel, std::vector<double>& state) {
  const int64_t n = static_cast<int64_t>(x.size());
  const int64_t hist = kernel - 1;
  std::vector<double> y(static_cast<size_t>(n));
  for (int64_t c = 0; c < n; ++c) {
    double acc = 0.0;
    for (int64_t i = 0; i < hist; ++i) acc += w[c * kernel + i] * state[i * n + c];
    acc += w[c * kernel + hist] * x[c];
    y[c] = acc;
    for (int64_t i = 0; i + 1 < hist; ++i) state[i * n + c] = state[(i + 1) * n + c];
    if (hist > 0) state[(hist - 1) * n + c] = x[c];
  }
  return y;
}

std::vector<double> delta_rule_step(std::vector<double>& s, int32_t d_k, int32_t d_v,
                                    const double* q, const double* k, const double* v, double g,
                                    double beta, double scale) {
  const double decay = std::exp(g);
  for (double& x : s) x *= decay;
  std::vector<double> out(static_cast<size_t>(d_v));
  for (int32_t j = 0; j < d_v; ++j) {
    double kv = 0.0;
    for (int32_t i = 0; i < d_k; ++i) kv += s[static_cast<size_t>(i) * d_v + j] * k[i];
    const double delta = beta * (v[j] - kv);
    double o = 0.0;
    for (int32_t i = 0; i < d_k; ++i) {
      double& sij = s[static_cast<size_t>(i) * d_v + j];
      sij += k[i] * delta;
      o += sij * q[i];
    }
    out[j] = scale * o;
  }
  return out;
}

std::vector<double> delta_rule_chunked(std::vector<double>& s, int32_t d_k, int32_t d_v,
                                       int64_t n_tokens, const double* q, const double* k,
                                       const double* v, const double* g, const double* beta,
                                       double scale, int32_t chunk) {
  BERTH_CHECK(chunk >= 1);
  auto dot = [d_k](const double* a, const double* b) {
    double r = 0.0;
    for (int32_t i = 0; i < d_k; ++i) r += a[i] * b[i];
    return r;
  };
  std::vector<double> out(static_cast<size_t>(n_tokens * d_v));
  for (int64_t c0 = 0; c0 < n_tokens; c0 += chunk) {
    const int64_t len = std::min<int64_t>(chunk, n_tokens - c0);
    // G_r: cumulative log decay inside the chunk.
    std::vector<double> G(static_cast<size_t>(len));
    for (int64_t r = 0; r < len; ++r) G[r] = (r ? G[r - 1] : 0.0) + g[c0 + r];
    // Unrolled from the chunk's initial state S0:
    //   delta_r = beta_r (v_r - e^{G_r} S0^T k_r - sum_{u<r} e^{G_r - G_u} (k_r . k_u) delta_u)
    // solved by forward substitution (a unit lower-triangular system);
    //   out_r = scale (e^{G_r} S0^T q_r + sum_{u<=r} e^{G_r - G_u} (q_r . k_u) delta_u);
    //   S_end = e^{G_last} S0 + sum_u e^{G_last - G_u} k_u delta_u^T.
    std::vector<double> delta(static_cast<size_t>(len * d_v));
    for (int64_t r = 0; r < len; ++r) {
      const double* kr = k + (c0 + r) * d_k;
      const double* qr = q + (c0 + r) * d_k;
      const double gr = std::exp(G[r]);
      double* dr = delta.data() + r * d_v;
      double* orow = out.data() + (c0 + r) * d_v;
      for (int32_t j = 0; j < d_v; ++j) {
        double s0k = 0.0, s0q = 0.0;
        for (int32_t i = 0; i < d_k; ++i) {
          s0k += s[static_cast<size_t>(i) * d_v + j] * kr[i];
          s0q += s[static_cast<size_t>(i) * d_v + j] * qr[i];
        }
        dr[j] = v[(c0 + r) * d_v + j] - gr * s0k;
        orow[j] = gr * s0q;
      }
      for (int64_t u = 0; u < r; ++u) {
        const double a = std::exp(G[r] - G[u]) * dot(kr, k + (c0 + u) * d_k);
        for (int32_t j = 0; j < d_v; ++j) dr[j] -= a * delta[u * d_v + j];
      }
      for (int32_t j = 0; j < d_v; ++j) dr[j] *= beta[c0 + r];
      for (int64_t u = 0; u <= r; ++u) {
        const double a = std::exp(G[r] - G[u]) * dot(qr, k + (c0 + u) * d_k);
        for (int32_t j = 0; j < d_v; ++j) orow[j] += a * delta[u * d_v + j];
      }
      for (int32_t j = 0; j < d_v; ++j) orow[j] *= scale;
    }
    const double g_last = G[len - 1];
    for (double& x : s) x *= std::exp(g_last);
    for (int64_t u = 0; u < len; ++u) {
      const double a = std::exp(g_last - G[u]);
      const double* ku = k + (c0 + u) * d_k;
      for (int32_t i = 0; i < d_k; ++i)
        for (int32_t j = 0; j < d_v; ++j)
          s[static_cast<size_t>(i) * d_v + j] += a * ku[i] * delta[u * d_v + j];
    }
  }
  return out;
}

NaiveQwen35::NaiveQwen35(const gguf::File& file, int n_ctx, VHeadMapping mapping)
    : mapping_(mapping) {
  const std::string& arch = file.architecture();
  if (arch != "qwen35" && arch != "qwen35moe") {
    throw Error(ErrorCategory::unsupported, "oracle: " + file.path() +
                                                ": general.architecture is '" + arch +
                                                "', NaiveQwen35 runs 'qwen35' and 'qwen35moe'");
  }
  if (n_ctx < 0) {
    throw Error(ErrorCategory::invalid_argument,
                "oracle: n_ctx = " + std::to_string(n_ctx) + " is negative");
  }
  auto key = [&](const char* suffix) { return arch + "." + suffix; };
  auto fail = [&](ErrorCategory cat, const std::string& what) {
    throw Error(cat, "oracle: " + file.path() + ": " + what);
  };
  const bool moe = arch == "qwen35moe";

  // ---- hyper-parameters -------------------------------------------------------------------
  NaiveQwen35Config& c = cfg_;
  c.arch = arch;
  c.n_embd = positive_int(file, key("embedding_length"));
  const int32_t block_count = positive_int(file, key("block_count"));
  const int64_t n_mtp = file.get_int_opt(key("nextn_predict_layers")).value_or(0);
  if (n_mtp < 0 || n_mtp >= block_count) {
    fail(ErrorCategory::format, key("nextn_predict_layers") + " = " + std::to_string(n_mtp) +
                                    " must be in [0, block_count = " + std::to_string(block_count) +
                                    ")");
  }
  c.n_mtp = static_cast<int32_t>(n_mtp);
  c.n_layer = block_count - c.n_mtp;
  c.context_length = positive_int(file, key("context_length"));
  c.rms_eps = file.get_float(key("attention.layer_norm_rms_epsilon"));
  c.rope_freq_base = file.get_float_opt(key("rope.freq_base")).value_or(10000.0);
  c.full_attention_interval = positive_int_or(file, key("full_attention_interval"), 4);
  c.ssm_d_conv = positive_int(file, key("ssm.conv_kernel"));
  c.ssm_d_state = positive_int(file, key("ssm.state_size"));
  c.ssm_n_group = positive_int(file, key("ssm.group_count"));
  c.ssm_dt_rank = positive_int(file, key("ssm.time_step_rank"));
  c.ssm_d_inner = positive_int(file, key("ssm.inner_size"));
  if (c.ssm_dt_rank % c.ssm_n_group != 0) {
    fail(ErrorCategory::format, "ssm.time_step_rank (V heads) " + std::to_string(c.ssm_dt_rank) +
                                    " is not a multiple of ssm.group_count (K heads) " +
                                    std::to_string(c.ssm_n_group));
  }
  if (c.ssm_d_inner % c.ssm_dt_rank != 0) {
    fail(ErrorCategory::format, "ssm.inner_size " + std::to_string(c.ssm_d_inner) +
                                    " is not a multiple of ssm.time_step_rank " +
                                    std::to_string(c.ssm_dt_rank));
  }
  if (!(c.rms_eps >= 0.0) || !(c.rope_freq_base > 0.0)) {
    fail(ErrorCategory::format, "layer_norm_rms_epsilon must be >= 0 and rope.freq_base > 0");
  }

  // Attention heads: scalar keys, or per-layer arrays (0 allowed on GDN layers).
  bool any_attention = false;
  for (int32_t l = 0; l < c.n_layer; ++l) any_attention = any_attention || c.is_attention(l);
  const std::vector<int64_t> heads = per_layer(file, key("attention.head_count"), c.n_layer);
  const std::vector<int64_t> heads_kv =
      file.has(key("attention.head_count_kv"))
          ? per_layer(file, key("attention.head_count_kv"), c.n_layer)
          : heads;
  c.n_head_kv.assign(static_cast<size_t>(c.n_layer), 0);
  for (int32_t l = 0; l < c.n_layer; ++l) {
    if (!c.is_attention(l)) continue;
    if (heads[l] <= 0 || heads[l] > 65536 || heads_kv[l] <= 0 || heads[l] % heads_kv[l] != 0) {
      fail(ErrorCategory::format, "layer " + std::to_string(l) + " (attention): head_count " +
                                      std::to_string(heads[l]) + " / head_count_kv " +
                                      std::to_string(heads_kv[l]) +
                                      " must be positive with head_count a multiple of "
                                      "head_count_kv");
    }
    if (c.n_head != 0 && heads[l] != c.n_head) {
      fail(ErrorCategory::unsupported, "attention.head_count differs between attention layers");
    }
    c.n_head = static_cast<int32_t>(heads[l]);
    c.n_head_kv[l] = static_cast<int32_t>(heads_kv[l]);
  }
  if (any_attention) {
    c.head_dim = positive_int_or(file, key("attention.key_length"), c.n_embd / c.n_head);
    if (positive_int_or(file, key("attention.value_length"), c.head_dim) != c.head_dim) {
      fail(ErrorCategory::unsupported, "attention.value_length differs from key_length");
    }
    c.n_rot = positive_int_or(file, key("rope.dimension_count"), c.head_dim);
    if (c.n_rot % 2 != 0 || c.n_rot > c.head_dim) {
      fail(ErrorCategory::format, "rope.dimension_count " + std::to_string(c.n_rot) +
                                      " must be even and at most head_dim " +
                                      std::to_string(c.head_dim));
    }
  }

  // FFN.
  if (moe) {
    c.n_expert = positive_int(file, key("expert_count"));
    c.n_expert_used = positive_int(file, key("expert_used_count"));
    if (c.n_expert_used > c.n_expert) {
      fail(ErrorCategory::format, "expert_used_count " + std::to_string(c.n_expert_used) +
                                      " exceeds expert_count " + std::to_string(c.n_expert));
    }
    c.n_ff_exp = positive_int(file, key("expert_feed_forward_length"));
    c.n_ff = positive_int_or(file, key("feed_forward_length"), 0);
    c.expert_weights_norm = file.get_int_opt(key("expert_weights_norm")).value_or(1) != 0;
    if (auto gating = file.get_int_opt(key("expert_gating_func")); gating && *gating != 1) {
      fail(ErrorCategory::unsupported, key("expert_gating_func") + " = " + std::to_string(*gating) +
                                           "; the oracle routes with softmax (1) only");
    }
    if (file.has(key("expert_shared_feed_forward_length"))) {
      c.n_ff_shexp = positive_int(file, key("expert_shared_feed_forward_length"));
    } else if (const gguf::TensorInfo* t = file.find_tensor("blk.0.ffn_up_shexp.weight")) {
      c.n_ff_shexp = static_cast<int32_t>(t->ne[1]);  // as llama.cpp: the tensor's size
    }
  } else {
    c.n_ff = positive_int(file, key("feed_forward_length"));
  }
  c.n_ctx = n_ctx == 0 ? c.context_length : n_ctx;

  // ---- weights ------------------------------------------------------------------------------
  std::set<std::string> used;
  const gguf::TensorInfo& embd = file.tensor("token_embd.weight");
  if (embd.ne[1] <= 0 || embd.ne[1] > INT32_MAX) {
    fail(ErrorCategory::format, "tensor 'token_embd.weight' has shape " +
                                    shape_string(embd.ne, embd.n_dims) + ", expected [" +
                                    std::to_string(c.n_embd) + ", n_vocab]");
  }
  c.n_vocab = static_cast<int32_t>(embd.ne[1]);
  const int64_t d = c.n_embd, nv = c.n_vocab, hd = c.head_dim;
  token_embd_ = load(file, "token_embd.weight", {d, nv}, used);
  output_norm_ = load(file, "output_norm.weight", {d}, used);
  if (file.find_tensor("output.weight") != nullptr) {
    output_ = load(file, "output.weight", {d, nv}, used);
  } else {
    c.tied_output = true;
  }
  const int64_t conv_dim = c.conv_dim(), vd = c.ssm_d_inner, hv = c.ssm_dt_rank;
  layers_.resize(static_cast<size_t>(c.n_layer));
  for (int32_t l = 0; l < c.n_layer; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    Layer& L = layers_[l];
    L.attn_norm = load(file, p + "attn_norm.weight", {d}, used);
    L.post_norm = load(file, p + "post_attention_norm.weight", {d}, used);
    if (c.is_attention(l)) {
      const int64_t dq = int64_t{c.n_head} * hd, dkv = int64_t{c.n_head_kv[l]} * hd;
      L.wq = load(file, p + "attn_q.weight", {d, 2 * dq}, used);
      L.wk = load(file, p + "attn_k.weight", {d, dkv}, used);
      L.wv = load(file, p + "attn_v.weight", {d, dkv}, used);
      L.q_norm = load(file, p + "attn_q_norm.weight", {hd}, used);
      L.k_norm = load(file, p + "attn_k_norm.weight", {hd}, used);
      L.wo = load(file, p + "attn_output.weight", {dq, d}, used);
    } else {
      L.w_qkv = load(file, p + "attn_qkv.weight", {d, conv_dim}, used);
      L.w_gate = load(file, p + "attn_gate.weight", {d, vd}, used);
      L.conv_w = load(file, p + "ssm_conv1d.weight", {c.ssm_d_conv, conv_dim}, used);
      L.dt_bias = load(file, p + "ssm_dt.bias", {hv}, used);
      L.ssm_a = load(file, p + "ssm_a", {hv}, used);
      L.w_beta = load(file, p + "ssm_beta.weight", {d, hv}, used);
      L.w_alpha = load(file, p + "ssm_alpha.weight", {d, hv}, used);
      L.ssm_norm = load(file, p + "ssm_norm.weight", {c.d_v()}, used);
      L.w_out = load(file, p + "ssm_out.weight", {vd, d}, used);
      L.state.conv.assign(static_cast<size_t>((c.ssm_d_conv - 1) * conv_dim), 0.0);
      L.state.s.assign(static_cast<size_t>(hv) * c.ssm_d_state * c.d_v(), 0.0);
    }
    if (moe) {
      const int64_t ne = c.n_expert, fe = c.n_ff_exp;
      L.w_router = load(file, p + "ffn_gate_inp.weight", {d, ne}, used);
      L.w_gate_ffn = load(file, p + "ffn_gate_exps.weight", {d, fe, ne}, used);
      L.w_up = load(file, p + "ffn_up_exps.weight", {d, fe, ne}, used);
      L.w_down = load(file, p + "ffn_down_exps.weight", {fe, d, ne}, used);
      if (c.n_ff_shexp > 0) {
        const int64_t fs = c.n_ff_shexp;
        L.shexp_gate = load(file, p + "ffn_gate_inp_shexp.weight", {d}, used);
        L.shexp_gate_ffn = load(file, p + "ffn_gate_shexp.weight", {d, fs}, used);
        L.shexp_up = load(file, p + "ffn_up_shexp.weight", {d, fs}, used);
        L.shexp_down = load(file, p + "ffn_down_shexp.weight", {fs, d}, used);
      }
    } else {
      L.w_gate_ffn = load(file, p + "ffn_gate.weight", {d, c.n_ff}, used);
      L.w_up = load(file, p + "ffn_up.weight", {d, c.n_ff}, used);
      L.w_down = load(file, p + "ffn_down.weight", {c.n_ff, d}, used);
    }
  }
  if (moe) last_routing_.resize(static_cast<size_t>(c.n_layer));
  // A tensor of a main layer (or a global one) that is not read would be a feature this model
  // does not have: refuse rather than compute something else. The MTP layers are skipped.
  for (const gguf::TensorInfo& t : file.tensors()) {
    if (used.count(t.name)) continue;
    bool mtp = false;
    for (int32_t l = c.n_layer; l < block_count && !mtp; ++l)
      mtp = t.name.rfind("blk." + std::to_string(l) + ".", 0) == 0;
    if (!mtp) {
      fail(ErrorCategory::unsupported,
           "tensor '" + t.name + "' is not used by the " + arch + " oracle");
    }
  }
}

const GdnLayerState& NaiveQwen35::gdn_state(int32_t layer) const {
  if (layer < 0 || layer >= cfg_.n_layer || cfg_.is_attention(layer)) {
    throw Error(ErrorCategory::invalid_argument,
                "oracle: layer " + std::to_string(layer) + " is not a GDN layer");
  }
  return layers_[layer].state;
}

std::vector<double> NaiveQwen35::attention(Layer& L, const std::vector<double>& h, int32_t l) {
  const NaiveQwen35Config& c = cfg_;
  const int64_t d = c.n_embd, hd = c.head_dim, nh = c.n_head, nkv = c.n_head_kv[l];
  const std::vector<double> qg = matvec(L.wq.data(), h, d, 2 * nh * hd);
  std::vector<double> q(static_cast<size_t>(nh * hd)), gate(static_cast<size_t>(nh * hd));
  for (int64_t head = 0; head < nh; ++head) {
    for (int64_t i = 0; i < hd; ++i) {
      q[head * hd + i] = qg[head * 2 * hd + i];
      gate[head * hd + i] = qg[head * 2 * hd + hd + i];
    }
  }
  std::vector<double> k = matvec(L.wk.data(), h, d, nkv * hd);
  const std::vector<double> v = matvec(L.wv.data(), h, d, nkv * hd);
  head_rms_norm_in_place(q, c.n_head, c.head_dim, L.q_norm, c.rms_eps);
  head_rms_norm_in_place(k, static_cast<int32_t>(nkv), c.head_dim, L.k_norm, c.rms_eps);
  // NeoX rotation of the first n_rot dims at position pos_.
  const int32_t half = c.n_rot / 2;
  for (std::vector<double>* x : {&q, &k}) {
    const int64_t n_heads = static_cast<int64_t>(x->size()) / hd;
    for (int64_t head = 0; head < n_heads; ++head) {
      double* xh = x->data() + head * hd;
      for (int32_t i = 0; i < half; ++i) {
        const double theta = pos_ * std::pow(c.rope_freq_base, -2.0 * i / c.n_rot);
        const double a = xh[i], b = xh[i + half];
        xh[i] = a * std::cos(theta) - b * std::sin(theta);
        xh[i + half] = a * std::sin(theta) + b * std::cos(theta);
      }
    }
  }
  L.k_cache.insert(L.k_cache.end(), k.begin(), k.end());
  L.v_cache.insert(L.v_cache.end(), v.begin(), v.end());
  const int32_t n_pos = pos_ + 1;
  const int64_t group = nh / nkv, dkv = nkv * hd;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<double> o(static_cast<size_t>(nh * hd), 0.0);
  for (int64_t head = 0; head < nh; ++head) {
    const int64_t kvh = head / group;
    const double* qh = q.data() + head * hd;
    std::vector<double> score(static_cast<size_t>(n_pos));
    double mx = -INFINITY;
    for (int32_t t = 0; t < n_pos; ++t) {
      const double* kt = L.k_cache.data() + t * dkv + kvh * hd;
      double dot = 0.0;
      for (int64_t i = 0; i < hd; ++i) dot += qh[i] * kt[i];
      score[t] = dot * scale;
      mx = std::max(mx, score[t]);
    }
    double den = 0.0;
    for (double& s : score) den += (s = std::exp(s - mx));
    double* oh = o.data() + head * hd;
    for (int32_t t = 0; t < n_pos; ++t) {
      const double* vt = L.v_cache.data() + t * dkv + kvh * hd;
      for (int64_t i = 0; i < hd; ++i) oh[i] += score[t] / den * vt[i];
    }
    for (int64_t i = 0; i < hd; ++i) oh[i] *= sigmoid(gate[head * hd + i]);
  }
  return matvec(L.wo.data(), o, nh * hd, d);
}

std::vector<double> NaiveQwen35::gdn(Layer& L, const std::vector<double>& h) {
  const NaiveQwen35Config& c = cfg_;
  const int64_t d = c.n_embd, conv_dim = c.conv_dim(), hk = c.ssm_n_group, hv = c.ssm_dt_rank;
  const int32_t dk = c.ssm_d_state, dv = c.d_v();
  const int64_t key_dim = c.key_dim();
  const std::vector<double> qkv = matvec(L.w_qkv.data(), h, d, conv_dim);
  const std::vector<double> z = matvec(L.w_gate.data(), h, d, c.ssm_d_inner);
  const std::vector<double> b = matvec(L.w_beta.data(), h, d, hv);
  const std::vector<double> a = matvec(L.w_alpha.data(), h, d, hv);
  std::vector<double> y = causal_conv1d_step(qkv, L.conv_w, c.ssm_d_conv, L.state.conv);
  for (double& x : y) x = silu(x);
  double* q = y.data();
  double* k = y.data() + key_dim;
  const double* v = y.data() + 2 * key_dim;
  for (int64_t j = 0; j < hk; ++j) {
    l2_normalise(q + j * dk, dk, c.rms_eps);
    l2_normalise(k + j * dk, dk, c.rms_eps);
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(dk));
  std::vector<double> o(static_cast<size_t>(hv * dv));
  const size_t state_size = static_cast<size_t>(dk) * dv;
  for (int64_t head = 0; head < hv; ++head) {
    const int64_t j = mapping_ == VHeadMapping::tiled ? head % hk : head / (hv / hk);
    const double beta = sigmoid(b[head]);
    const double g = L.ssm_a[head] * softplus(a[head] + L.dt_bias[head]);
    std::vector<double> s(L.state.s.begin() + head * state_size,
                          L.state.s.begin() + (head + 1) * state_size);
    std::vector<double> oh =
        delta_rule_step(s, dk, dv, q + j * dk, k + j * dk, v + head * dv, g, beta, scale);
    std::copy(s.begin(), s.end(), L.state.s.begin() + head * state_size);
    // Gated RMSNorm: rms(o_h) * ssm_norm * silu(z_h).
    double ss = 0.0;
    for (double x : oh) ss += x * x;
    const double inv = 1.0 / std::sqrt(ss / dv + c.rms_eps);
    for (int32_t i = 0; i < dv; ++i)
      o[head * dv + i] = oh[i] * inv * L.ssm_norm[i] * silu(z[head * dv + i]);
  }
  return matvec(L.w_out.data(), o, c.ssm_d_inner, d);
}

std::vector<double> NaiveQwen35::ffn(Layer& L, const std::vector<double>& h, int32_t l) {
  const NaiveQwen35Config& c = cfg_;
  const int64_t d = c.n_embd;
  auto swiglu = [&](const double* wg, const double* wu, const double* wd, int64_t f) {
    const std::vector<double> gate = matvec(wg, h, d, f);
    const std::vector<double> up = matvec(wu, h, d, f);
    std::vector<double> hidden(static_cast<size_t>(f));
    for (int64_t i = 0; i < f; ++i) hidden[i] = silu(gate[i]) * up[i];
    return matvec(wd, hidden, f, d);
  };
  if (L.w_router.empty())
    return swiglu(L.w_gate_ffn.data(), L.w_up.data(), L.w_down.data(), c.n_ff);
  const int64_t fe = c.n_ff_exp;
  Routing r = route_experts(matvec(L.w_router.data(), h, d, c.n_expert), c.n_expert_used,
                            c.expert_weights_norm);
  std::vector<double> out(static_cast<size_t>(d), 0.0);
  for (size_t j = 0; j < r.ids.size(); ++j) {
    const int64_t e = r.ids[j];
    const std::vector<double> y =
        swiglu(L.w_gate_ffn.data() + e * fe * d, L.w_up.data() + e * fe * d,
               L.w_down.data() + e * d * fe, fe);
    for (int64_t i = 0; i < d; ++i) out[i] += r.weights[j] * y[i];
  }
  if (!L.shexp_gate.empty()) {
    double gl = 0.0;
    for (int64_t i = 0; i < d; ++i) gl += L.shexp_gate[i] * h[i];
    const double w = sigmoid(gl);
    const std::vector<double> y =
        swiglu(L.shexp_gate_ffn.data(), L.shexp_up.data(), L.shexp_down.data(), c.n_ff_shexp);
    for (int64_t i = 0; i < d; ++i) out[i] += w * y[i];
  }
  last_routing_[l] = std::move(r);
  return out;
}

std::vector<double> NaiveQwen35::step(int32_t token) {
  const NaiveQwen35Config& c = cfg_;
  if (token < 0 || token >= c.n_vocab) {
    throw Error(ErrorCategory::invalid_argument, "oracle: token " + std::to_string(token) +
                                                     " outside [0, " + std::to_string(c.n_vocab) +
                                                     ")");
  }
  if (pos_ >= c.n_ctx) {
    throw Error(ErrorCategory::invalid_argument,
                "oracle: context full (n_ctx = " + std::to_string(c.n_ctx) + ")");
  }
  const int64_t d = c.n_embd;
  std::vector<double> x(token_embd_.begin() + token * d, token_embd_.begin() + (token + 1) * d);
  for (int32_t l = 0; l < c.n_layer; ++l) {
    Layer& L = layers_[l];
    std::vector<double> h = rms_norm(x, L.attn_norm, c.rms_eps);
    add_in_place(x, c.is_attention(l) ? attention(L, h, l) : gdn(L, h));
    h = rms_norm(x, L.post_norm, c.rms_eps);
    add_in_place(x, ffn(L, h, l));
  }
  const std::vector<double> xn = rms_norm(x, output_norm_, c.rms_eps);
  ++pos_;
  return matvec(c.tied_output ? token_embd_.data() : output_.data(), xn, d, c.n_vocab);
}

void NaiveQwen35::reset() {
  for (Layer& L : layers_) {
    L.k_cache.clear();
    L.v_cache.clear();
    std::fill(L.state.conv.begin(), L.state.conv.end(), 0.0);
    std::fill(L.state.s.begin(), L.state.s.end(), 0.0);
  }
  for (Routing& r : last_routing_) r = Routing{};
  pos_ = 0;
}

}  // namespace berth::oracle
