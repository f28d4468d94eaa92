// Plain C++ kernels: get_row (berth::cpu), and the scalar twins of the
// SIMD kernels in ops_simd.cc (berth::ref), kept as the plain formulas the oracle tests trust.
#include "berth/cpu_kernels/ops.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "berth/core/error.h"
#include "berth/core/fp16.h"
#include "berth/cpu_kernels/quants_ref.h"

namespace berth::cpu {

void get_row(const TensorView& w, int64_t row, float* dst) {
  const int64_t n = w.ne[0];
  const uint8_t* src = w.row(row);
  switch (w.type) {
    case GgmlType::F32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case GgmlType::F16: {
      const auto* h = reinterpret_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_f32(h[i]);
      return;
    }
    case GgmlType::BF16: {
      const auto* h = reinterpret_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(h[i]);
      return;
    }
    default:
      if (!traits(w.type).computable)
        throw Error(ErrorCategory::unsupported,
                    fmt::format("tensor '{}' has type {}, which berth cannot compute with", w.name,
                                type_name(w.type)));
      ref::dequantize_row(w.type, src, dst, n);
  }
}

namespace {

// The weights of the experts `ids` (slot order): p = softmax(key) in double over all experts,
// then p or p / sum of the selected p, each rounded once to float.
void route_weights(const float* logits, int32_t n_expert, int32_t k, bool renormalise,
                   const int32_t* ids, float* weights) {
  auto key = [&](int32_t e) {
    const float l = logits[e];
    return std::isnan(l) ? -std::numeric_limits<double>::infinity() : static_cast<double>(l);
  };
  double max = -std::numeric_limits<double>::infinity();
  for (int32_t e = 0; e < n_expert; ++e) max = std::max(max, key(e));
  double sum = 0.0;
  for (int32_t e = 0; e < n_expert; ++e) sum += std::exp(key(e) - max);
  double sel = 0.0;
  for (int32_t j = 0; j < k; ++j) sel += std::exp(key(ids[j]) - max) / sum;
  for (int32_t j = 0; j < k; ++j) {
    const double p = std::exp(key(ids[j]) - max) / sum;
    weights[j] = static_cast<float>(renormalise ? p / sel : p);
  }
}

}  // namespace

void moe_topk(const float* logits, int32_t n_expert, int32_t k, bool renormalise, int32_t* ids,
              float* weights) {
  BERTH_CHECK(k >= 1 && k <= n_expert);
  // Selection on the logits themselves (softmax is monotonic), NaN treated as -infinity.
  auto key = [&](int32_t e) {
    const float l = logits[e];
    return std::isnan(l) ? -std::numeric_limits<double>::infinity() : static_cast<double>(l);
  };
  std::vector<int32_t> order(static_cast<size_t>(n_expert));
  for (int32_t e = 0; e < n_expert; ++e) order[static_cast<size_t>(e)] = e;
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
    const double ka = key(a), kb = key(b);
    return ka > kb || (ka == kb && a < b);
  });
  std::copy_n(order.begin(), k, ids);
  route_weights(logits, n_expert, k, renormalise, ids, weights);
}

void moe_forced(const float* logits, int32_t n_expert, int32_t k, bool renormalise,
                const int32_t* ids, float* weights) {
  BERTH_CHECK(k >= 1 && k <= n_expert);
  for (int32_t j = 0; j < k; ++j) BERTH_CHECK(ids[j] >= 0 && ids[j] < n_expert);
  route_weights(logits, n_expert, k, renormalise, ids, weights);
}

}  // namespace berth::cpu

namespace berth::ref {

void rms_norm(const float* x, const float* weight, float* y, int64_t n, float eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float scale = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
  if (weight) {
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale * weight[i];
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale;
  }
}

void rope_inplace(float* x, int32_t n_head, int32_t head_dim, int32_t n_rot, const float* cos_theta,
                  const float* sin_theta, bool adjacent) {
  const int32_t half = n_rot / 2;
  for (int32_t h = 0; h < n_head; ++h) {
    float* xh = x + static_cast<int64_t>(h) * head_dim;
    for (int32_t i = 0; i < half; ++i) {
      const int32_t i0 = adjacent ? 2 * i : i;
      const int32_t i1 = adjacent ? 2 * i + 1 : i + half;
      const float a = xh[i0], b = xh[i1];
      xh[i0] = a * cos_theta[i] - b * sin_theta[i];
      xh[i1] = a * sin_theta[i] + b * cos_theta[i];
    }
  }
}

void attention_head(const float* q, const float* k, int64_t k_stride, const float* v,
                    int64_t v_stride, int64_t n_kv, int32_t head_dim, float scale, float* out,
                    float* scores) {
  // Scores and weights are kept in float; every sum accumulates in double, so this oracle's
  // own rounding stays far below the SIMD kernel's over long contexts.
  float mx = -INFINITY;
  for (int64_t j = 0; j < n_kv; ++j) {
    const float* kj = k + j * k_stride;
    double dot = 0.0;
    for (int32_t d = 0; d < head_dim; ++d) dot += static_cast<double>(q[d]) * kj[d];
    scores[j] = scale * static_cast<float>(dot);
    mx = std::max(mx, scores[j]);
  }
  double sum = 0.0;
  for (int64_t j = 0; j < n_kv; ++j) {
    scores[j] = std::exp(scores[j] - mx);
    sum += scores[j];
  }
  for (int32_t d = 0; d < head_dim; ++d) {
    double acc = 0.0;
    for (int64_t j = 0; j < n_kv; ++j) acc += static_cast<double>(scores[j]) * v[j * v_stride + d];
    out[d] = static_cast<float>(acc / sum);
  }
}

void softmax(const float* x, float* y, int64_t n) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i]);
  double sum = 0.0;  // double: the oracle's rounding stays below the SIMD kernel's
  for (int64_t i = 0; i < n; ++i) {
    y[i] = std::exp(x[i] - mx);
    sum += y[i];
  }
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(y[i] / sum);
}

void attention_causal_tile(const float* q, int64_t q_stride, int64_t n_q, int64_t q_pos0,
                           const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                           int32_t head_dim, float scale, float* out, int64_t out_stride,
                           float* scratch) {
  for (int64_t i = 0; i < n_q; ++i)
    attention_head(q + i * q_stride, k, k_stride, v, v_stride, q_pos0 + i + 1, head_dim, scale,
                   out + i * out_stride, scratch);
}

void attention_group(const float* q, int64_t q_stride, int64_t n_q, int64_t n_kv, const float* k,
                     int64_t k_stride, const float* v, int64_t v_stride, int32_t head_dim,
                     float scale, float* out, int64_t out_stride, float* scratch) {
  for (int64_t i = 0; i < n_q; ++i)
    attention_head(q + i * q_stride, k, k_stride, v, v_stride, n_kv, head_dim, scale,
                   out + i * out_stride, scratch);
}

void swiglu(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void add(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

}  // namespace berth::ref
