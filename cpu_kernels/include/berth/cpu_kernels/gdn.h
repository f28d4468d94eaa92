// CPU kernels of a Gated DeltaNet (GDN) layer and of gated attention (the Qwen3.5 / Qwen3-Next
// hybrid family: GGUF architectures qwen35, qwen35moe, qwen3next). Like ops.h: raw pointers and
// ranges, no threads; every output element is computed by one call in an order that depends
// only on its own index (and on the data), never on the range a caller gave, so any split of the
// work (channels, columns, heads, tokens into ubatches) gives the same bits.
//
// One GDN layer for a token t (facts from the public implementations: Hugging Face transformers
// models/qwen3_next/modular_qwen3_next.py, Qwen3NextGatedDeltaNet and
// torch_recurrent_gated_delta_rule; llama.cpp / ik_llama.cpp src/llama-delta-net.cpp and
// ggml_compute_forward_delta_net_f32; Yang et al. 2024, "Gated Delta Networks", arXiv:2412.06464):
//
//   qkv = W_attn_qkv x,  z = W_attn_gate x,  b = W_ssm_beta x,  a = W_ssm_alpha x
//   y = silu(conv1d_causal(qkv))                 conv1d_causal(..., silu = true)
//   q_j, k_j = l2_norm(y's K-head slices)        l2_norm per head, eps = the file's rms eps
//   g_h = ssm_a_h * softplus(a_h + dt_bias_h),  beta_h = sigmoid(b_h)       gdn_gates
//   per V head h (K head j = h mod H_k in qwen35 files):               gated_delta_rule
//     S_h = exp(g_h) S_h ;  S_h += k_j (beta_h (v_h - S_h^T k_j))^T ;  o_h = S_h^T q_j / sqrt(d_k)
//   o_h = rms_norm(o_h) * ssm_norm * silu(z_h)                         rms_norm_gated
//   out = W_ssm_out concat_h(o_h)
//
// Gated attention (Qwen3-Next / Qwen3.5 full-attention layers): attn_q yields, per head, the
// query and a gate of the same size; the attention output is multiplied by sigmoid(gate)
// before W_o (sigmoid_gate).
//
// SIMD kernels in berth::cpu (Highway, dispatched at run time; gdn_simd.cc), scalar twins with
// the same signatures in berth::ref (gdn_ref.cpp): plain formulas with long sums in double,
// used by the oracle tests (tests/core/test_kernel_oracle_gdn.cpp). They agree to a small NMSE,
// not bit for bit (Highway's polynomial exp/log, reordered and fused arithmetic).
#pragma once

#include <cstdint>

namespace berth::cpu {

/// Largest conv1d kernel the conv kernels accept (Qwen3.5, Qwen3-Next and Mamba use 4).
inline constexpr int32_t kMaxConvKernel = 8;

/// Causal depthwise conv1d over a rolling state (the GDN's short convolution, no bias), for
/// channels [c0, c1) of n_tokens consecutive tokens (decode: n_tokens = 1; prefill: more).
///   x:     input rows, token t's channel c at x[t * x_stride + c]
///   y:     output rows, y[t * y_stride + c]; must not overlap x or state
///   w:     weights as the GGUF tensor ssm_conv1d.weight stores them, ggml ne = {kernel,
///          channels}: channel c's taps at w[c * kernel + i], i = 0 the oldest input
///   state: kernel - 1 rows, row r at state + r * state_stride (channel c at [c]); row r holds
///          the input of token (r - (kernel - 1)) relative to the first token of this call, so
///          row kernel - 2 is the most recent one. All zeros for a new sequence.
/// For each channel: window_t = [state rows..., x_0, ..., x_t] restricted to its last `kernel`
/// entries, y_t = sum_i w[i] * window_t[i] (then y_t = silu(y_t) = y_t / (1 + exp(-y_t)) when
/// `silu`); afterwards the state holds the last kernel - 1 inputs of [old state, x_0..x_{T-1}].
/// This is torch's conv1d with padding kernel - 1 cut to the causal outputs (HF
/// torch_causal_conv1d_update) and ggml_ssm_conv. Requires 1 <= kernel <= kMaxConvKernel,
/// 0 <= c0 <= c1, n_tokens >= 0 (BERTH_CHECK: Error(internal) otherwise).
void conv1d_causal(const float* x, int64_t x_stride, float* y, int64_t y_stride, int64_t n_tokens,
                   const float* w, int32_t kernel, float* state, int64_t state_stride, int64_t c0,
                   int64_t c1, bool silu);

/// y[i] = silu(x[i]) = x[i] / (1 + exp(-x[i])), i in [0, n). y may alias x.
void silu(const float* x, float* y, int64_t n);

/// L2 normalisation of one head: y[i] = x[i] / sqrt(sum_j x[j]^2 + eps), i in [0, n). The form
/// of HF's l2norm (FLA's, eps 1e-6) that Qwen3.5 was trained with; llama.cpp's ggml_l2_norm
/// divides by max(||x||, eps) instead (eps = the rms eps), which differs by a relative
/// eps / (2 ||x||^2) (< 1e-6 for any non-degenerate head). The sum of squares accumulates in
/// double. y may alias x.
void l2_norm(const float* x, float* y, int64_t n, float eps);

/// The GDN gates of n V heads of one token:
///   g[h]    = ssm_a[h] * softplus(alpha[h] + dt_bias[h])   (log of the decay, <= 0)
///   beta[h] = sigmoid(b[h]) = 1 / (1 + exp(-b[h]))
/// with softplus(u) = log(1 + exp(u)), taken as u itself for u > 20 (torch's threshold).
/// alpha = W_ssm_alpha x, b = W_ssm_beta x; dt_bias = ssm_dt.bias; ssm_a as the GGUF stores it,
/// -exp(A_log) (HF: g = -A_log.exp() * softplus(a + dt_bias)). Outputs may alias inputs.
void gdn_gates(const float* alpha, const float* b, const float* dt_bias, const float* ssm_a,
               float* g, float* beta, int64_t n);

/// The gated delta rule of ONE V head over n_tokens consecutive tokens (decode: 1; prefill: the
/// ubatch), for state columns [j0, j1) (0 <= j0 <= j1 <= d_v; the whole head is [0, d_v)).
/// state: S, d_k x d_v f32 row-major (d_v contiguous: S[i][j] = state[i * d_v + j]), the layout
/// of HF's recurrent_state and of ggml's delta-net state; updated in place. Per token t, with
/// q_t = q + t * q_stride and k_t = k + t * k_stride (d_k floats each, already L2-normalised),
/// v_t = v + t * v_stride (d_v floats), g_t = g[t * gb_stride], beta_t = beta[t * gb_stride]:
///   S      = exp(g_t) * S
///   delta  = beta_t * (v_t - S^T k_t)            (d_v values)
///   S     += k_t delta^T
///   out_t  = scale * S^T q_t,  out_t = out + t * out_stride, columns [j0, j1) written
/// (HF torch_recurrent_gated_delta_rule, scale = 1 / sqrt(d_k)). The SIMD kernel evaluates the
/// algebraically equal form out_t = scale * (exp(g_t) * S_old^T q_t + (k_t . q_t) * delta) so
/// that the state is read once per token. Each column's result depends only on that column:
/// calling with any split of [0, d_v), or with the tokens split into several calls, gives the
/// same bits. out must not overlap the inputs or the state.
void gated_delta_rule(const float* q, int64_t q_stride, const float* k, int64_t k_stride,
                      const float* v, int64_t v_stride, const float* g, const float* beta,
                      int64_t gb_stride, int64_t n_tokens, int32_t d_k, int32_t d_v, float scale,
                      float* state, float* out, int64_t out_stride, int32_t j0, int32_t j1);

/// The GDN output norm of one V head (HF Qwen3NextRMSNormGated, "norm before gate"):
///   y[i] = x[i] / sqrt(mean(x^2) + eps) * weight[i] * silu(z[i]),  i in [0, n)
/// weight = ssm_norm.weight as stored (not shifted by 1), z = the head's slice of W_attn_gate x.
/// The sum of squares accumulates in double. y may alias x or z.
void rms_norm_gated(const float* x, const float* weight, const float* z, float* y, int64_t n,
                    float eps);

/// The attention output gate: y[i] = x[i] * sigmoid(gate[i]) = x[i] / (1 + exp(-gate[i])),
/// i in [0, n) (HF Qwen3NextAttention: attn_output * torch.sigmoid(gate)). y may alias x or
/// gate.
void sigmoid_gate(const float* x, const float* gate, float* y, int64_t n);

}  // namespace berth::cpu

namespace berth::ref {

// Scalar twins of the kernels above: same signatures and contracts, the plain formulas (the
// delta rule exactly in the notes' order: decay, delta, update, output) with float inputs and
// outputs, the delta-rule state kept in f32 as the contract says, and every sum, exp, log and
// division evaluated in double.

void conv1d_causal(const float* x, int64_t x_stride, float* y, int64_t y_stride, int64_t n_tokens,
                   const float* w, int32_t kernel, float* state, int64_t state_stride, int64_t c0,
                   int64_t c1, bool silu);
void silu(const float* x, float* y, int64_t n);
void l2_norm(const float* x, float* y, int64_t n, float eps);
void gdn_gates(const float* alpha, const float* b, const float* dt_bias, const float* ssm_a,
               float* g, float* beta, int64_t n);
void gated_delta_rule(const float* q, int64_t q_stride, const float* k, int64_t k_stride,
                      const float* v, int64_t v_stride, const float* g, const float* beta,
                      int64_t gb_stride, int64_t n_tokens, int32_t d_k, int32_t d_v, float scale,
                      float* state, float* out, int64_t out_stride, int32_t j0, int32_t j1);
void rms_norm_gated(const float* x, const float* weight, const float* z, float* y, int64_t n,
                    float eps);
void sigmoid_gate(const float* x, const float* gate, float* y, int64_t n);

}  // namespace berth::ref
