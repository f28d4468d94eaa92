// Naive double-precision forward of llama, qwen2, qwen3 and qwen3moe (the oracle). See
// naive_llama.h for the model.
//
// Deliberately simple: no SIMD, no threads, no shared kernels. Keep it that way; clarity is the
// point, and every optimised path is compared against it.

#include "naive_llama.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "berth/core/error.h"
#include "berth/core/types.h"
#include "berth/cpu_kernels/quants_ref.h"
#include "naive_common.h"
#include "naive_qwen35.h"

namespace berth::oracle {
namespace {

using namespace detail;  // NOLINT: the shared helpers of naive_common.h

/// The architectures the oracle runs and how they differ.
struct ArchTraits {
  bool rope_neox;
  bool attn_bias;     // Q/K/V biases required
  bool qk_norm;       // optional per-head q/k norms
  bool moe_required;  // every layer is MoE (qwen3moe)
  bool moe_allowed;   // expert_count > 0 allowed
};

const ArchTraits* find_arch(const std::string& arch) {
  static const ArchTraits llama{false, false, false, false, true};
  static const ArchTraits qwen2{true, true, false, false, false};
  static const ArchTraits qwen3{true, false, true, false, false};
  static const ArchTraits qwen3moe{true, false, true, true, true};
  if (arch == "llama") return &llama;
  if (arch == "qwen2") return &qwen2;
  if (arch == "qwen3") return &qwen3;
  if (arch == "qwen3moe") return &qwen3moe;
  return nullptr;
}

}  // namespace

Routing route_experts(const std::vector<double>& logits, int n_expert_used, bool renormalise) {
  const int64_t n_expert = static_cast<int64_t>(logits.size());
  if (n_expert == 0 || n_expert_used < 1 || n_expert_used > n_expert) {
    throw Error(ErrorCategory::invalid_argument,
                "route_experts: n_expert_used = " + std::to_string(n_expert_used) +
                    " must be in [1, n_expert = " + std::to_string(n_expert) + "]");
  }
  double max_logit = -INFINITY;
  for (int64_t e = 0; e < n_expert; ++e) {
    if (!std::isfinite(logits[e])) {
      throw Error(ErrorCategory::invalid_argument,
                  "route_experts: router logit of expert " + std::to_string(e) + " is not finite");
    }
    max_logit = std::max(max_logit, logits[e]);
  }
  Routing r;
  r.probs.resize(static_cast<size_t>(n_expert));
  double denom = 0.0;
  for (int64_t e = 0; e < n_expert; ++e) {
    r.probs[e] = std::exp(logits[e] - max_logit);
    denom += r.probs[e];
  }
  for (double& p : r.probs) p /= denom;

  // Descending probability; stable, so equal probabilities keep ascending id order.
  std::vector<int32_t> order(static_cast<size_t>(n_expert));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return r.probs[a] > r.probs[b]; });
  r.ids.assign(order.begin(), order.begin() + n_expert_used);
  double sum = 0.0;
  for (int32_t e : r.ids) {
    r.weights.push_back(r.probs[e]);
    sum += r.probs[e];
  }
  if (renormalise) {
    for (double& w : r.weights) w /= sum;
  }
  return r;
}

Routing route_experts(const std::vector<float>& logits, int n_expert_used, bool renormalise) {
  return route_experts(std::vector<double>(logits.begin(), logits.end()), n_expert_used,
                       renormalise);
}

NaiveModel::~NaiveModel() = default;
NaiveModel::NaiveModel(NaiveModel&&) noexcept = default;
NaiveModel& NaiveModel::operator=(NaiveModel&&) noexcept = default;

NaiveModel::NaiveModel(const NaiveModel& o)
    : cfg_(o.cfg_),
      token_embd_(o.token_embd_),
      output_norm_(o.output_norm_),
      output_(o.output_),
      rope_freqs_(o.rope_freqs_),
      layers_(o.layers_),
      last_routing_(o.last_routing_),
      hybrid_(o.hybrid_ ? std::make_unique<NaiveQwen35>(*o.hybrid_) : nullptr),
      pos_(o.pos_) {}

NaiveModel& NaiveModel::operator=(const NaiveModel& o) {
  if (this != &o) *this = NaiveModel(o);
  return *this;
}

NaiveModel::NaiveModel(const gguf::File& file, int n_ctx) {
  const std::string& arch = file.architecture();
  if (arch == "qwen35" || arch == "qwen35moe") {
    hybrid_ = std::make_unique<NaiveQwen35>(file, n_ctx);
    const NaiveQwen35Config& h = hybrid_->config();
    NaiveModelConfig& c = cfg_;
    c.arch = arch;
    c.n_vocab = h.n_vocab;
    c.n_embd = h.n_embd;
    c.n_layer = h.n_layer;
    c.n_head = h.n_head;
    for (int32_t l = 0; l < h.n_layer && c.n_head_kv == 0; ++l) c.n_head_kv = h.n_head_kv[l];
    c.n_ff = h.n_ff;
    c.head_dim = h.head_dim;
    c.n_rot = h.n_rot;
    c.rms_eps = h.rms_eps;
    c.rope_freq_base = h.rope_freq_base;
    c.tied_output = h.tied_output;
    c.rope_neox = true;
    c.q_norm = c.k_norm = true;
    c.n_expert = h.n_expert;
    c.n_expert_used = h.n_expert_used;
    c.n_ff_exp = h.n_ff_exp;
    c.expert_weights_norm = h.expert_weights_norm;
    c.context_length = h.context_length;
    c.n_ctx = h.n_ctx;
    last_routing_ = hybrid_->last_routing();
    return;
  }
  const ArchTraits* traits = find_arch(arch);
  if (traits == nullptr) {
    throw Error(ErrorCategory::unsupported,
                "oracle: " + file.path() + ": general.architecture is '" + arch +
                    "', the oracle runs 'llama', 'qwen2', 'qwen3', 'qwen3moe', 'qwen35' and "
                    "'qwen35moe'");
  }
  if (n_ctx < 0) {
    throw Error(ErrorCategory::invalid_argument,
                "oracle: n_ctx = " + std::to_string(n_ctx) + " is negative");
  }
  auto key = [&](const char* suffix) { return arch + "." + suffix; };
  auto fail = [&](ErrorCategory cat, const std::string& what) {
    throw Error(cat, "oracle: " + file.path() + ": " + what);
  };

  // ---- hyper-parameters -------------------------------------------------------------------
  NaiveModelConfig& c = cfg_;
  c.arch = arch;
  c.rope_neox = traits->rope_neox;
  c.attn_bias = traits->attn_bias;
  c.n_embd = positive_int(file, key("embedding_length"));
  c.n_layer = positive_int(file, key("block_count"));
  c.n_head = positive_int(file, key("attention.head_count"));
  c.n_head_kv = positive_int_or(file, key("attention.head_count_kv"), c.n_head);
  c.context_length = positive_int(file, key("context_length"));
  c.rms_eps = file.get_float(key("attention.layer_norm_rms_epsilon"));
  c.rope_freq_base = file.get_float_opt(key("rope.freq_base")).value_or(10000.0);

  // Experts.
  const int64_t n_expert = file.get_int_opt(key("expert_count")).value_or(0);
  if (n_expert < 0 || n_expert > INT32_MAX) {
    fail(ErrorCategory::format,
         key("expert_count") + " = " + std::to_string(n_expert) + " is not a valid expert count");
  }
  if (n_expert > 0 && !traits->moe_allowed) {
    fail(ErrorCategory::unsupported, key("expert_count") + " = " + std::to_string(n_expert) +
                                         ": '" + arch + "' with experts is not supported");
  }
  if (n_expert == 0 && traits->moe_required) {
    fail(ErrorCategory::format,
         key("expert_count") + " is absent or 0, but '" + arch + "' needs experts");
  }
  const bool moe = n_expert > 0;
  if (moe) {
    c.n_expert = static_cast<int32_t>(n_expert);
    c.n_expert_used = positive_int(file, key("expert_used_count"));
    if (c.n_expert_used > c.n_expert) {
      fail(ErrorCategory::format, key("expert_used_count") + " = " +
                                      std::to_string(c.n_expert_used) + " exceeds " +
                                      key("expert_count") + " = " + std::to_string(c.n_expert));
    }
    if (arch == "llama") {
      c.n_ff = positive_int(file, key("feed_forward_length"));
      c.n_ff_exp = c.n_ff;  // Mixtral: every expert has the dense FFN size
      if (!file.get_int_opt(key("expert_weights_norm")).value_or(1)) {
        fail(ErrorCategory::unsupported,
             key("expert_weights_norm") + " is false; Mixtral-style llama always renormalises");
      }
      c.expert_weights_norm = true;
    } else {
      c.n_ff = positive_int_or(file, key("feed_forward_length"), 0);  // unused by the experts
      c.n_ff_exp = positive_int(file, key("expert_feed_forward_length"));
      c.expert_weights_norm = file.get_int_opt(key("expert_weights_norm")).value_or(1) != 0;
    }
    if (auto gating = file.get_int_opt(key("expert_gating_func")); gating && *gating != 1) {
      fail(ErrorCategory::unsupported, key("expert_gating_func") + " = " + std::to_string(*gating) +
                                           "; the oracle routes with softmax (1) only");
    }
    if (auto shared = file.get_int_opt(key("expert_shared_count")); shared && *shared != 0) {
      fail(ErrorCategory::unsupported, key("expert_shared_count") + " = " +
                                           std::to_string(*shared) +
                                           "; shared experts are not supported by the oracle");
    }
  } else {
    c.n_ff = positive_int(file, key("feed_forward_length"));
  }

  if (file.has(key("attention.key_length")) || c.n_embd % c.n_head == 0) {
    c.head_dim = positive_int_or(file, key("attention.key_length"), c.n_embd / c.n_head);
  } else {
    fail(ErrorCategory::format, "embedding_length " + std::to_string(c.n_embd) +
                                    " is not a multiple of head_count " + std::to_string(c.n_head) +
                                    " and " + key("attention.key_length") + " is absent");
  }
  const int32_t value_length = positive_int_or(file, key("attention.value_length"), c.head_dim);
  if (value_length != c.head_dim) {
    fail(ErrorCategory::unsupported, "attention.value_length " + std::to_string(value_length) +
                                         " differs from key_length " + std::to_string(c.head_dim));
  }
  c.n_rot = positive_int_or(file, key("rope.dimension_count"), c.head_dim);
  if (c.n_head % c.n_head_kv != 0) {
    fail(ErrorCategory::format, "head_count " + std::to_string(c.n_head) +
                                    " is not a multiple of head_count_kv " +
                                    std::to_string(c.n_head_kv));
  }
  if (c.n_rot % 2 != 0 || c.n_rot > c.head_dim) {
    fail(ErrorCategory::format, "rope.dimension_count " + std::to_string(c.n_rot) +
                                    " must be even and at most head_dim " +
                                    std::to_string(c.head_dim));
  }
  if (!(c.rms_eps >= 0.0) || !(c.rope_freq_base > 0.0)) {
    fail(ErrorCategory::format, "layer_norm_rms_epsilon must be >= 0 and rope.freq_base > 0");
  }
  if (auto scaling = file.get_string_opt(key("rope.scaling.type"))) {
    if (*scaling == "linear") {
      c.rope_linear_factor = file.get_float(key("rope.scaling.factor"));
      if (!(c.rope_linear_factor > 0.0)) {
        fail(ErrorCategory::format, "rope.scaling.factor must be positive");
      }
    } else if (*scaling != "none") {
      fail(ErrorCategory::unsupported,
           "rope.scaling.type '" + *scaling + "' is not supported by the oracle");
    }
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
  const int64_t d = c.n_embd, hd = c.head_dim, dq = int64_t{c.n_head} * hd,
                dkv = int64_t{c.n_head_kv} * hd, ff = c.n_ff, ffe = c.n_ff_exp, ne = c.n_expert,
                nv = c.n_vocab;
  token_embd_ = load(file, "token_embd.weight", {d, nv}, used);
  output_norm_ = load(file, "output_norm.weight", {d}, used);
  if (file.find_tensor("output.weight") != nullptr) {
    output_ = load(file, "output.weight", {d, nv}, used);
  } else {
    c.tied_output = true;
  }
  if (file.find_tensor("rope_freqs.weight") != nullptr) {
    rope_freqs_ = load(file, "rope_freqs.weight", {c.n_rot / 2}, used);
    c.has_rope_freqs = true;
  }
  layers_.resize(static_cast<size_t>(c.n_layer));
  for (int32_t l = 0; l < c.n_layer; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    Layer& layer = layers_[l];
    layer.attn_norm = load(file, p + "attn_norm.weight", {d}, used);
    layer.wq = load(file, p + "attn_q.weight", {d, dq}, used);
    layer.wk = load(file, p + "attn_k.weight", {d, dkv}, used);
    layer.wv = load(file, p + "attn_v.weight", {d, dkv}, used);
    if (traits->attn_bias) {
      layer.bq = load(file, p + "attn_q.bias", {dq}, used);
      layer.bk = load(file, p + "attn_k.bias", {dkv}, used);
      layer.bv = load(file, p + "attn_v.bias", {dkv}, used);
    }
    if (traits->qk_norm) {
      // Optional, independently: without them q/k are not normalised (upcycled test files).
      if (file.find_tensor(p + "attn_q_norm.weight") != nullptr) {
        layer.q_norm = load(file, p + "attn_q_norm.weight", {hd}, used);
      }
      if (file.find_tensor(p + "attn_k_norm.weight") != nullptr) {
        layer.k_norm = load(file, p + "attn_k_norm.weight", {hd}, used);
      }
      // The config flags describe layer 0; every layer is read on its own.
      if (l == 0) {
        c.q_norm = !layer.q_norm.empty();
        c.k_norm = !layer.k_norm.empty();
      }
    }
    layer.wo = load(file, p + "attn_output.weight", {dq, d}, used);
    layer.ffn_norm = load(file, p + "ffn_norm.weight", {d}, used);
    if (moe) {
      layer.w_router = load(file, p + "ffn_gate_inp.weight", {d, ne}, used);
      layer.w_gate = load(file, p + "ffn_gate_exps.weight", {d, ffe, ne}, used);
      layer.w_up = load(file, p + "ffn_up_exps.weight", {d, ffe, ne}, used);
      layer.w_down = load(file, p + "ffn_down_exps.weight", {ffe, d, ne}, used);
    } else {
      layer.w_gate = load(file, p + "ffn_gate.weight", {d, ff}, used);
      layer.w_up = load(file, p + "ffn_up.weight", {d, ff}, used);
      layer.w_down = load(file, p + "ffn_down.weight", {ff, d}, used);
    }
  }
  if (moe) last_routing_.resize(static_cast<size_t>(c.n_layer));
  // A tensor we do not read would be a feature we do not model (biases, extra norms, ...):
  // refuse rather than compute something subtly different from the file's model.
  for (const gguf::TensorInfo& t : file.tensors()) {
    if (used.count(t.name) == 0) {
      fail(ErrorCategory::unsupported,
           "tensor '" + t.name + "' is not used by the " + arch + " oracle");
    }
  }
}

void NaiveModel::rope_in_place(std::vector<double>& x, int32_t n_heads, int32_t position) const {
  const NaiveModelConfig& c = cfg_;
  const double p = static_cast<double>(position) / c.rope_linear_factor;
  const int32_t half = c.n_rot / 2;
  for (int32_t h = 0; h < n_heads; ++h) {
    double* head = x.data() + int64_t{h} * c.head_dim;
    for (int32_t i = 0; i < half; ++i) {
      double theta = p * std::pow(c.rope_freq_base, -2.0 * i / c.n_rot);
      if (!rope_freqs_.empty()) theta /= rope_freqs_[i];
      const double cos_t = std::cos(theta), sin_t = std::sin(theta);
      // The pair rotated by theta_i: adjacent (2i, 2i+1), or NeoX (i, i + n_rot/2).
      const int32_t a = c.rope_neox ? i : 2 * i;
      const int32_t b = c.rope_neox ? i + half : 2 * i + 1;
      const double x0 = head[a], x1 = head[b];
      head[a] = x0 * cos_t - x1 * sin_t;
      head[b] = x0 * sin_t + x1 * cos_t;
    }
  }
}

std::vector<double> NaiveModel::step(int32_t token) {
  if (hybrid_) {
    std::vector<double> logits = hybrid_->step(token);
    pos_ = hybrid_->pos();
    last_routing_ = hybrid_->last_routing();
    return logits;
  }
  const NaiveModelConfig& c = cfg_;
  if (token < 0 || token >= c.n_vocab) {
    throw Error(ErrorCategory::invalid_argument, "oracle: token " + std::to_string(token) +
                                                     " outside [0, " + std::to_string(c.n_vocab) +
                                                     ")");
  }
  if (pos_ >= c.n_ctx) {
    throw Error(ErrorCategory::invalid_argument,
                "oracle: context full (n_ctx = " + std::to_string(c.n_ctx) + ")");
  }
  const int64_t d = c.n_embd, hd = c.head_dim, dq = int64_t{c.n_head} * hd,
                dkv = int64_t{c.n_head_kv} * hd;
  const int32_t group = c.n_head / c.n_head_kv;
  const int32_t n_pos = pos_ + 1;  // positions 0..pos_ attend (causal)

  std::vector<double> x(token_embd_.begin() + token * d, token_embd_.begin() + (token + 1) * d);

  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& layer = layers_[l];
    // ---- attention ----
    std::vector<double> xn = rms_norm(x, layer.attn_norm, c.rms_eps);
    std::vector<double> q = matvec(layer.wq.data(), xn, d, dq);
    std::vector<double> k = matvec(layer.wk.data(), xn, d, dkv);
    std::vector<double> v = matvec(layer.wv.data(), xn, d, dkv);
    if (!layer.bq.empty()) {
      add_in_place(q, layer.bq);
      add_in_place(k, layer.bk);
      add_in_place(v, layer.bv);
    }
    if (!layer.q_norm.empty()) {
      head_rms_norm_in_place(q, c.n_head, c.head_dim, layer.q_norm, c.rms_eps);
    }
    if (!layer.k_norm.empty()) {
      head_rms_norm_in_place(k, c.n_head_kv, c.head_dim, layer.k_norm, c.rms_eps);
    }
    rope_in_place(q, c.n_head, pos_);
    rope_in_place(k, c.n_head_kv, pos_);
    layer.k_cache.insert(layer.k_cache.end(), k.begin(), k.end());
    layer.v_cache.insert(layer.v_cache.end(), v.begin(), v.end());

    std::vector<double> attn(static_cast<size_t>(dq), 0.0);
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    for (int32_t h = 0; h < c.n_head; ++h) {
      const int32_t kvh = h / group;
      const double* qh = q.data() + h * hd;
      std::vector<double> scores(static_cast<size_t>(n_pos));
      double max_score = -INFINITY;
      for (int32_t t = 0; t < n_pos; ++t) {
        const double* kt = layer.k_cache.data() + t * dkv + kvh * hd;
        double dot = 0.0;
        for (int64_t i = 0; i < hd; ++i) dot += qh[i] * kt[i];
        scores[t] = dot * scale;
        if (scores[t] > max_score) max_score = scores[t];
      }
      double denom = 0.0;
      for (int32_t t = 0; t < n_pos; ++t) {
        scores[t] = std::exp(scores[t] - max_score);
        denom += scores[t];
      }
      double* out = attn.data() + h * hd;
      for (int32_t t = 0; t < n_pos; ++t) {
        const double* vt = layer.v_cache.data() + t * dkv + kvh * hd;
        const double wgt = scores[t] / denom;
        for (int64_t i = 0; i < hd; ++i) out[i] += wgt * vt[i];
      }
    }
    std::vector<double> attn_out = matvec(layer.wo.data(), attn, dq, d);
    for (int64_t i = 0; i < d; ++i) x[i] += attn_out[i];

    // ---- feed-forward: one SwiGLU, or a weighted sum of the routed experts' SwiGLUs ----
    xn = rms_norm(x, layer.ffn_norm, c.rms_eps);
    if (layer.w_router.empty()) {
      std::vector<double> gate = matvec(layer.w_gate.data(), xn, d, c.n_ff);
      std::vector<double> up = matvec(layer.w_up.data(), xn, d, c.n_ff);
      std::vector<double> hidden(static_cast<size_t>(c.n_ff));
      for (int32_t j = 0; j < c.n_ff; ++j) hidden[j] = silu(gate[j]) * up[j];
      std::vector<double> ffn_out = matvec(layer.w_down.data(), hidden, c.n_ff, d);
      for (int64_t i = 0; i < d; ++i) x[i] += ffn_out[i];
    } else {
      const int64_t ffe = c.n_ff_exp;
      const std::vector<double> router_logits = matvec(layer.w_router.data(), xn, d, c.n_expert);
      Routing r = route_experts(router_logits, c.n_expert_used, c.expert_weights_norm);
      std::vector<double> ffn_out(static_cast<size_t>(d), 0.0);
      for (size_t j = 0; j < r.ids.size(); ++j) {
        const int64_t e = r.ids[j];
        std::vector<double> gate = matvec(layer.w_gate.data() + e * ffe * d, xn, d, ffe);
        std::vector<double> up = matvec(layer.w_up.data() + e * ffe * d, xn, d, ffe);
        std::vector<double> hidden(static_cast<size_t>(ffe));
        for (int64_t f = 0; f < ffe; ++f) hidden[f] = silu(gate[f]) * up[f];
        std::vector<double> y = matvec(layer.w_down.data() + e * d * ffe, hidden, ffe, d);
        for (int64_t i = 0; i < d; ++i) ffn_out[i] += r.weights[j] * y[i];
      }
      for (int64_t i = 0; i < d; ++i) x[i] += ffn_out[i];
      last_routing_[l] = std::move(r);
    }
  }

  std::vector<double> xn = rms_norm(x, output_norm_, c.rms_eps);
  ++pos_;
  return matvec(c.tied_output ? token_embd_.data() : output_.data(), xn, d, c.n_vocab);
}

void NaiveModel::reset() {
  if (hybrid_) {
    hybrid_->reset();
    last_routing_ = hybrid_->last_routing();
    pos_ = 0;
    return;
  }
  for (Layer& layer : layers_) {
    layer.k_cache.clear();
    layer.v_cache.clear();
  }
  for (Routing& r : last_routing_) r = Routing{};
  pos_ = 0;
}

namespace {
const gguf::File& require_llama(const gguf::File& file) {
  const std::string& arch = file.architecture();
  if (arch != "llama") {
    throw Error(ErrorCategory::unsupported,
                "oracle: " + file.path() + ": general.architecture is '" + arch +
                    "', NaiveLlama only runs 'llama' (use NaiveModel for the others)");
  }
  return file;
}
}  // namespace

NaiveLlama::NaiveLlama(const gguf::File& file, int n_ctx)
    : NaiveModel(require_llama(file), n_ctx) {}

std::vector<int32_t> greedy_generate(NaiveModel& m, const std::vector<int32_t>& prompt, int n) {
  if (prompt.empty() || n < 0) {
    throw Error(ErrorCategory::invalid_argument,
                "greedy_generate: needs a non-empty prompt and n >= 0 (got " +
                    std::to_string(prompt.size()) + " prompt tokens, n = " + std::to_string(n) +
                    ")");
  }
  std::vector<double> logits;
  for (int32_t t : prompt) logits = m.step(t);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    int32_t best = 0;
    for (int32_t v = 1; v < static_cast<int32_t>(logits.size()); ++v) {
      if (logits[v] > logits[best]) best = v;  // strict: ties keep the lowest id
    }
    out.push_back(best);
    logits = m.step(best);
  }
  return out;
}

}  // namespace berth::oracle
