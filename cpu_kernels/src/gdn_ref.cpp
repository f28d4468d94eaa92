// Scalar twins (berth::ref) of the Gated DeltaNet and gated-attention kernels of gdn.h: the
// plain formulas, in double wherever a sum or a transcendental function is evaluated, so the
// oracle's own rounding stays well below the SIMD kernels' tolerance.
#include <algorithm>
#include <cmath>
#include <vector>

#include "berth/core/error.h"
#include "berth/cpu_kernels/gdn.h"

namespace berth::ref {
namespace {

double silu_d(double x) { return x / (1.0 + std::exp(-x)); }

double softplus_d(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

}  // namespace

void conv1d_causal(const float* x, int64_t x_stride, float* y, int64_t y_stride, int64_t n_tokens,
                   const float* w, int32_t kernel, float* state, int64_t state_stride, int64_t c0,
                   int64_t c1, bool silu) {
  BERTH_CHECK(kernel >= 1 && kernel <= cpu::kMaxConvKernel && c0 >= 0 && c0 <= c1 && n_tokens >= 0);
  const int64_t hist = kernel - 1;
  // Input of token tau relative to this call's first token (tau < 0: from the state).
  auto input = [&](int64_t tau, int64_t c) {
    return tau < 0 ? state[(hist + tau) * state_stride + c] : x[tau * x_stride + c];
  };
  for (int64_t c = c0; c < c1; ++c) {
    const float* wc = w + c * kernel;
    for (int64_t t = 0; t < n_tokens; ++t) {
      double acc = 0.0;
      for (int32_t i = 0; i < kernel; ++i)
        acc += static_cast<double>(wc[i]) * input(t - hist + i, c);
      y[t * y_stride + c] = static_cast<float>(silu ? silu_d(acc) : acc);
    }
    // New state: the last `hist` inputs. Row r reads row r + n_tokens of the old state (not
    // yet overwritten) or an input row.
    for (int64_t r = 0; r < hist && n_tokens > 0; ++r)
      state[r * state_stride + c] = input(n_tokens - hist + r, c);
  }
}

void silu(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(silu_d(x[i]));
}

void l2_norm(const float* x, float* y, int64_t n, float eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const double inv = 1.0 / std::sqrt(ss + static_cast<double>(eps));
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(x[i] * inv);
}

void gdn_gates(const float* alpha, const float* b, const float* dt_bias, const float* ssm_a,
               float* g, float* beta, int64_t n) {
  for (int64_t h = 0; h < n; ++h) {
    const double gh =
        static_cast<double>(ssm_a[h]) * softplus_d(static_cast<double>(alpha[h]) + dt_bias[h]);
    const double bh = 1.0 / (1.0 + std::exp(-static_cast<double>(b[h])));
    g[h] = static_cast<float>(gh);
    beta[h] = static_cast<float>(bh);
  }
}

void gated_delta_rule(const float* q, int64_t q_stride, const float* k, int64_t k_stride,
                      const float* v, int64_t v_stride, const float* g, const float* beta,
                      int64_t gb_stride, int64_t n_tokens, int32_t d_k, int32_t d_v, float scale,
                      float* state, float* out, int64_t out_stride, int32_t j0, int32_t j1) {
  BERTH_CHECK(d_k >= 1 && d_v >= 1 && j0 >= 0 && j0 <= j1 && j1 <= d_v && n_tokens >= 0);
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* qt = q + t * q_stride;
    const float* kt = k + t * k_stride;
    const float* vt = v + t * v_stride;
    const double decay = std::exp(static_cast<double>(g[t * gb_stride]));
    const double bt = beta[t * gb_stride];
    float* ot = out + t * out_stride;
    for (int32_t j = j0; j < j1; ++j) {
      // S = exp(g) S (column j), rounded to the f32 state.
      for (int32_t i = 0; i < d_k; ++i) {
        float& s = state[static_cast<int64_t>(i) * d_v + j];
        s = static_cast<float>(decay * s);
      }
      double kv = 0.0;  // (S^T k)_j
      for (int32_t i = 0; i < d_k; ++i)
        kv += static_cast<double>(state[static_cast<int64_t>(i) * d_v + j]) * kt[i];
      const double delta = bt * (static_cast<double>(vt[j]) - kv);
      double o = 0.0;  // (S^T q)_j after the update
      for (int32_t i = 0; i < d_k; ++i) {
        float& s = state[static_cast<int64_t>(i) * d_v + j];
        s = static_cast<float>(s + static_cast<double>(kt[i]) * delta);
        o += static_cast<double>(s) * qt[i];
      }
      ot[j] = static_cast<float>(scale * o);
    }
  }
}

void rms_norm_gated(const float* x, const float* weight, const float* z, float* y, int64_t n,
                    float eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const double inv = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(x[i] * inv * weight[i] * silu_d(z[i]));
}

void sigmoid_gate(const float* x, const float* gate, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    y[i] = static_cast<float>(x[i] / (1.0 + std::exp(-static_cast<double>(gate[i]))));
}

}  // namespace berth::ref
