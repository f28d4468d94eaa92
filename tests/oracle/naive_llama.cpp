// Naive double-precision llama forward (the oracle). See naive_llama.h for the model.
//
// Deliberately simple: no SIMD, no threads, no shared kernels. Keep it that way; clarity is the
// point, and every optimised path is compared against it.

#include "naive_llama.h"

#include <array>
#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "berth/core/error.h"
#include "berth/core/types.h"
#include "berth/cpu_kernels/quants_ref.h"

namespace berth::oracle {
namespace {

constexpr const char* kArch = "llama";

std::string key(const char* suffix) { return std::string(kArch) + "." + suffix; }

std::string shape_string(const std::array<int64_t, 4>& ne, uint32_t n_dims) {
  std::string s = "[";
  const uint32_t n = n_dims == 0 ? 1 : n_dims;
  for (uint32_t i = 0; i < n; ++i) {
    if (i) s += ", ";
    s += std::to_string(ne[i]);
  }
  return s + "]";
}

std::string shape_string(const std::vector<int64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(ne[i]);
  }
  return s + "]";
}

/// Reads a required positive integer key; Error(format) when it is not positive, and
/// Error(unsupported) when it is an array (per-layer values, which this oracle does not model).
int32_t positive_int(const gguf::File& file, const std::string& k) {
  if (const gguf::Value* v = file.find(k); v && v->type() == gguf::ValueType::array) {
    throw Error(ErrorCategory::unsupported,
                "naive_llama: " + file.path() + ": key '" + k +
                    "' is a per-layer array; the oracle supports one value for all layers");
  }
  const int64_t value = file.get_int(k);
  if (value <= 0 || value > INT32_MAX) {
    throw Error(ErrorCategory::format, "naive_llama: " + file.path() + ": key '" + k +
                                           "' = " + std::to_string(value) +
                                           ", expected a positive 32-bit count");
  }
  return static_cast<int32_t>(value);
}

/// Same as positive_int for an optional key: `fallback` when absent.
int32_t positive_int_or(const gguf::File& file, const std::string& k, int32_t fallback) {
  if (!file.has(k)) return fallback;
  return positive_int(file, k);
}

/// Decodes all of `t` into doubles, row-major with ne[0] contiguous. F32 and F64 are read
/// directly; every other type goes through the scalar reference dequantizer.
std::vector<double> to_double(const gguf::File& file, const gguf::TensorInfo& t) {
  const int64_t n = t.n_elements();
  std::vector<double> out(static_cast<size_t>(n));
  if (t.type == GgmlType::F32) {
    for (int64_t i = 0; i < n; ++i) {
      float f;
      std::memcpy(&f, t.data + i * sizeof(float), sizeof(float));
      out[i] = f;
    }
    return out;
  }
  if (t.type == GgmlType::F64) {
    for (int64_t i = 0; i < n; ++i) std::memcpy(&out[i], t.data + i * sizeof(double), 8);
    return out;
  }
  const TypeTraits* tr = find_type(static_cast<uint32_t>(t.type));
  if (tr == nullptr || !tr->computable) {
    throw Error(ErrorCategory::unsupported, "naive_llama: " + file.path() + ": tensor '" + t.name +
                                                "' has type " + std::string(type_name(t.type)) +
                                                ", which cannot be dequantized");
  }
  const int64_t n_per_row = t.ne[0];
  const int64_t n_rows = n / n_per_row;
  std::vector<float> tmp(static_cast<size_t>(n));
  ref::dequantize_rows(t.type, t.data, tmp.data(), n_rows, n_per_row);
  for (int64_t i = 0; i < n; ++i) out[i] = tmp[i];
  return out;
}

/// Loads tensor `name`, checking that its shape is exactly `expected` (ne[0] first; trailing
/// axes of size 1 may be omitted in the file). Records the name in `used`.
std::vector<double> load(const gguf::File& file, const std::string& name,
                         const std::vector<int64_t>& expected, std::set<std::string>& used) {
  const gguf::TensorInfo& t = file.tensor(name);  // GgufError(missing_tensor) when absent
  bool ok = expected.size() <= 4;
  for (size_t i = 0; ok && i < 4; ++i) {
    const int64_t want = i < expected.size() ? expected[i] : 1;
    ok = t.ne[i] == want;
  }
  if (!ok) {
    throw Error(ErrorCategory::format, "naive_llama: " + file.path() + ": tensor '" + name +
                                           "' has shape " + shape_string(t.ne, t.n_dims) +
                                           ", expected " + shape_string(expected));
  }
  used.insert(name);
  return to_double(file, t);
}

/// out[o] = sum_i w[o * n_in + i] * x[i] for o in [0, n_out).
std::vector<double> matvec(const std::vector<double>& w, const std::vector<double>& x, int64_t n_in,
                           int64_t n_out) {
  std::vector<double> out(static_cast<size_t>(n_out), 0.0);
  for (int64_t o = 0; o < n_out; ++o) {
    double sum = 0.0;
    for (int64_t i = 0; i < n_in; ++i) sum += w[o * n_in + i] * x[i];
    out[o] = sum;
  }
  return out;
}

/// RMSNorm: x * w / sqrt(mean(x^2) + eps).
std::vector<double> rms_norm(const std::vector<double>& x, const std::vector<double>& w,
                             double eps) {
  double sum_sq = 0.0;
  for (double v : x) sum_sq += v * v;
  const double scale = 1.0 / std::sqrt(sum_sq / static_cast<double>(x.size()) + eps);
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = x[i] * scale * w[i];
  return out;
}

double silu(double z) { return z / (1.0 + std::exp(-z)); }

}  // namespace

NaiveLlama::NaiveLlama(const gguf::File& file, int n_ctx) {
  const std::string& arch = file.architecture();
  if (arch != kArch) {
    throw Error(ErrorCategory::unsupported, "naive_llama: " + file.path() +
                                                ": general.architecture is '" + arch +
                                                "', the oracle only runs 'llama'");
  }
  if (n_ctx < 0) {
    throw Error(ErrorCategory::invalid_argument,
                "naive_llama: n_ctx = " + std::to_string(n_ctx) + " is negative");
  }
  if (auto n_expert = file.get_int_opt(key("expert_count")); n_expert && *n_expert > 0) {
    throw Error(ErrorCategory::unsupported,
                "naive_llama: " + file.path() + ": llama.expert_count = " +
                    std::to_string(*n_expert) + " (MoE) is not supported by the oracle");
  }

  // ---- hyper-parameters -------------------------------------------------------------------
  NaiveLlamaConfig& c = cfg_;
  c.n_embd = positive_int(file, key("embedding_length"));
  c.n_layer = positive_int(file, key("block_count"));
  c.n_head = positive_int(file, key("attention.head_count"));
  c.n_head_kv = positive_int_or(file, key("attention.head_count_kv"), c.n_head);
  c.n_ff = positive_int(file, key("feed_forward_length"));
  c.context_length = positive_int(file, key("context_length"));
  c.rms_eps = file.get_float(key("attention.layer_norm_rms_epsilon"));
  c.rope_freq_base = file.get_float_opt(key("rope.freq_base")).value_or(10000.0);

  if (file.has(key("attention.key_length")) || c.n_embd % c.n_head == 0) {
    c.head_dim = positive_int_or(file, key("attention.key_length"), c.n_embd / c.n_head);
  } else {
    throw Error(ErrorCategory::format,
                "naive_llama: " + file.path() + ": embedding_length " + std::to_string(c.n_embd) +
                    " is not a multiple of head_count " + std::to_string(c.n_head));
  }
  const int32_t value_length = positive_int_or(file, key("attention.value_length"), c.head_dim);
  if (value_length != c.head_dim) {
    throw Error(ErrorCategory::unsupported,
                "naive_llama: " + file.path() + ": attention.value_length " +
                    std::to_string(value_length) + " differs from key_length " +
                    std::to_string(c.head_dim));
  }
  c.n_rot = positive_int_or(file, key("rope.dimension_count"), c.head_dim);
  if (c.n_head % c.n_head_kv != 0) {
    throw Error(ErrorCategory::format,
                "naive_llama: " + file.path() + ": head_count " + std::to_string(c.n_head) +
                    " is not a multiple of head_count_kv " + std::to_string(c.n_head_kv));
  }
  if (c.n_rot % 2 != 0 || c.n_rot > c.head_dim) {
    throw Error(ErrorCategory::format, "naive_llama: " + file.path() + ": rope.dimension_count " +
                                           std::to_string(c.n_rot) +
                                           " must be even and at most head_dim " +
                                           std::to_string(c.head_dim));
  }
  if (!(c.rms_eps >= 0.0) || !(c.rope_freq_base > 0.0)) {
    throw Error(ErrorCategory::format, "naive_llama: " + file.path() +
                                           ": layer_norm_rms_epsilon must be >= 0 and "
                                           "rope.freq_base > 0");
  }
  if (auto scaling = file.get_string_opt(key("rope.scaling.type"))) {
    if (*scaling == "linear") {
      c.rope_linear_factor = file.get_float(key("rope.scaling.factor"));
      if (!(c.rope_linear_factor > 0.0)) {
        throw Error(ErrorCategory::format,
                    "naive_llama: " + file.path() + ": rope.scaling.factor must be positive");
      }
    } else if (*scaling != "none") {
      throw Error(ErrorCategory::unsupported, "naive_llama: " + file.path() +
                                                  ": rope.scaling.type '" + *scaling +
                                                  "' is not supported by the oracle");
    }
  }
  c.n_ctx = n_ctx == 0 ? c.context_length : n_ctx;

  // ---- weights ------------------------------------------------------------------------------
  std::set<std::string> used;
  const gguf::TensorInfo& embd = file.tensor("token_embd.weight");
  if (embd.ne[1] <= 0 || embd.ne[1] > INT32_MAX) {
    throw Error(ErrorCategory::format, "naive_llama: " + file.path() +
                                           ": tensor 'token_embd.weight' has shape " +
                                           shape_string(embd.ne, embd.n_dims) + ", expected [" +
                                           std::to_string(c.n_embd) + ", n_vocab]");
  }
  c.n_vocab = static_cast<int32_t>(embd.ne[1]);
  const int64_t d = c.n_embd, dq = int64_t{c.n_head} * c.head_dim,
                dkv = int64_t{c.n_head_kv} * c.head_dim, ff = c.n_ff, nv = c.n_vocab;
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
    layer.wo = load(file, p + "attn_output.weight", {dq, d}, used);
    layer.ffn_norm = load(file, p + "ffn_norm.weight", {d}, used);
    layer.w_gate = load(file, p + "ffn_gate.weight", {d, ff}, used);
    layer.w_up = load(file, p + "ffn_up.weight", {d, ff}, used);
    layer.w_down = load(file, p + "ffn_down.weight", {ff, d}, used);
  }
  // A tensor we do not read would be a feature we do not model (biases, extra norms, ...):
  // refuse rather than compute something subtly different from the file's model.
  for (const gguf::TensorInfo& t : file.tensors()) {
    if (used.count(t.name) == 0) {
      throw Error(ErrorCategory::unsupported, "naive_llama: " + file.path() + ": tensor '" +
                                                  t.name + "' is not used by the llama oracle");
    }
  }
}

void NaiveLlama::rope_in_place(std::vector<double>& x, int32_t n_heads, int32_t position) const {
  const NaiveLlamaConfig& c = cfg_;
  const double p = static_cast<double>(position) / c.rope_linear_factor;
  for (int32_t h = 0; h < n_heads; ++h) {
    double* head = x.data() + int64_t{h} * c.head_dim;
    for (int32_t i = 0; i < c.n_rot / 2; ++i) {
      double theta = p * std::pow(c.rope_freq_base, -2.0 * i / c.n_rot);
      if (!rope_freqs_.empty()) theta /= rope_freqs_[i];
      const double cos_t = std::cos(theta), sin_t = std::sin(theta);
      const double x0 = head[2 * i], x1 = head[2 * i + 1];
      head[2 * i] = x0 * cos_t - x1 * sin_t;
      head[2 * i + 1] = x0 * sin_t + x1 * cos_t;
    }
  }
}

std::vector<double> NaiveLlama::step(int32_t token) {
  const NaiveLlamaConfig& c = cfg_;
  if (token < 0 || token >= c.n_vocab) {
    throw Error(ErrorCategory::invalid_argument, "naive_llama: token " + std::to_string(token) +
                                                     " outside [0, " + std::to_string(c.n_vocab) +
                                                     ")");
  }
  if (pos_ >= c.n_ctx) {
    throw Error(ErrorCategory::invalid_argument,
                "naive_llama: context full (n_ctx = " + std::to_string(c.n_ctx) + ")");
  }
  const int64_t d = c.n_embd, hd = c.head_dim, dq = int64_t{c.n_head} * hd,
                dkv = int64_t{c.n_head_kv} * hd;
  const int32_t group = c.n_head / c.n_head_kv;
  const int32_t n_pos = pos_ + 1;  // positions 0..pos_ attend (causal)

  std::vector<double> x(token_embd_.begin() + token * d, token_embd_.begin() + (token + 1) * d);

  for (Layer& layer : layers_) {
    // ---- attention ----
    std::vector<double> xn = rms_norm(x, layer.attn_norm, c.rms_eps);
    std::vector<double> q = matvec(layer.wq, xn, d, dq);
    std::vector<double> k = matvec(layer.wk, xn, d, dkv);
    std::vector<double> v = matvec(layer.wv, xn, d, dkv);
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
    std::vector<double> attn_out = matvec(layer.wo, attn, dq, d);
    for (int64_t i = 0; i < d; ++i) x[i] += attn_out[i];

    // ---- SwiGLU feed-forward ----
    xn = rms_norm(x, layer.ffn_norm, c.rms_eps);
    std::vector<double> gate = matvec(layer.w_gate, xn, d, c.n_ff);
    std::vector<double> up = matvec(layer.w_up, xn, d, c.n_ff);
    std::vector<double> hidden(static_cast<size_t>(c.n_ff));
    for (int32_t j = 0; j < c.n_ff; ++j) hidden[j] = silu(gate[j]) * up[j];
    std::vector<double> ffn_out = matvec(layer.w_down, hidden, c.n_ff, d);
    for (int64_t i = 0; i < d; ++i) x[i] += ffn_out[i];
  }

  std::vector<double> xn = rms_norm(x, output_norm_, c.rms_eps);
  ++pos_;
  return matvec(c.tied_output ? token_embd_ : output_, xn, d, c.n_vocab);
}

void NaiveLlama::reset() {
  for (Layer& layer : layers_) {
    layer.k_cache.clear();
    layer.v_cache.clear();
  }
  pos_ = 0;
}

std::vector<int32_t> greedy_generate(NaiveLlama& m, const std::vector<int32_t>& prompt, int n) {
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
