// CPU kernels of the forward pass on f32 activations. Each function works on the rows (or
// heads) it is given and never starts threads: the runtime splits work across its pinned pool
// by calling these on disjoint ranges. Every output element is computed by one call in a fixed
// summation order, so results do not depend on how the work was split (-t 1 == -t N bit for bit).
//
// Activations are row-major [tokens, cols] f32 with `cols` contiguous; a weight row is one row of
// a ggml tensor (ne[0] elements, contiguous) in its stored type.
//
// The functions in berth::cpu are Highway SIMD kernels with run-time dispatch (AVX2, AVX-512 on
// x86; NEON, SVE on arm64; a portable fallback elsewhere), except get_row, which is plain
// C++ (the matrix products live in quant_dot.h). Each SIMD kernel has a
// scalar twin with the same signature in berth::ref: the plain formula, used by the oracle tests
// (tests/core/test_kernel_oracle_ops.cpp). SIMD and scalar results agree to a small NMSE, not
// bit for bit (the SIMD exp is a polynomial with <= 1 ULP error; sums are reordered).
#pragma once

#include <cstddef>
#include <cstdint>

#include "berth/core/tensor.h"

namespace berth::cpu {

/// KV positions per tile of the SIMD attention kernels. Tiles start at multiples of this
/// absolute position, so a query's result does not depend on which other queries share a call.
inline constexpr int64_t kAttentionKvTile = 64;

/// Decodes row `row` of `w` (ne[0] elements) into dst.
/// Throws Error(unsupported) for a type berth cannot compute.
void get_row(const TensorView& w, int64_t row, float* dst);

/// y[i] = x[i] * (1 / sqrt(mean(x^2) + eps)) * weight[i] for i in [0, n) (weight may be null:
/// no scaling). x and y may be the same array. RMSNorm: Zhang & Sennrich, arXiv:1910.07467.
/// The sum of squares accumulates in double.
void rms_norm(const float* x, const float* weight, float* y, int64_t n, float eps);

/// Rotates one token's heads in place (RoPE: Su et al., RoFormer, arXiv:2104.09864):
/// x holds n_head heads of head_dim floats (head h at x + h * head_dim); in each head the
/// first n_rot dims (n_rot even, <= head_dim) are rotated by angles theta_i = pos * inv_freq_i
/// (i < n_rot/2), given as cos_theta/sin_theta (n_rot/2 values each); dims >= n_rot are left
/// unchanged. adjacent: pairs (2i, 2i+1) (GPT-J / llama "normal" mode); else NeoX pairs
/// (i, i + n_rot/2). Pair (a, b) becomes (a cos - b sin, a sin + b cos).
void rope_inplace(float* x, int32_t n_head, int32_t head_dim, int32_t n_rot, const float* cos_theta,
                  const float* sin_theta, bool adjacent);

/// y[i] = exp(x[i] - max(x)) / sum_j exp(x[j] - max(x)) over n >= 1 elements; x and y may be
/// the same array. Entries of -inf give 0.
void softmax(const float* x, float* y, int64_t n);

/// One query head against keys/values of positions [0, n_kv), n_kv >= 1:
/// out[d] = sum_j softmax_j(scale * q.k_j) * v_j[d], d in [0, head_dim).
/// q: head_dim floats; k_j = k + j * k_stride and v_j = v + j * v_stride (head_dim contiguous
/// floats each; strides in floats). `scores` is scratch of n_kv floats (the scalar twin keeps
/// the whole score row there; the SIMD kernel works in KV tiles of kAttentionKvTile with an
/// online softmax and needs no scratch). Result bit-identical to the row of
/// attention_causal_tile for a query at position n_kv - 1 (same target).
void attention_head(const float* q, const float* k, int64_t k_stride, const float* v,
                    int64_t v_stride, int64_t n_kv, int32_t head_dim, float scale, float* out,
                    float* scores);

/// Causal attention of n_q consecutive queries of ONE head (prefill):
/// query i (i in [0, n_q)) sits at position p_i = q_pos0 + i and attends to KV positions
/// [0, p_i]: out_i[d] = sum_{j <= p_i} softmax_j(scale * q_i.k_j) * v_j[d].
///   q_i   = q + i * q_stride         (head_dim contiguous floats)
///   k_j   = k + j * k_stride,  v_j = v + j * v_stride   for j in [0, q_pos0 + n_q)
///   out_i = out + i * out_stride     (head_dim floats; must not overlap q, k or v)
/// Strides are in floats. The SIMD kernel processes KV in tiles of kAttentionKvTile positions
/// with a running max and sum per query (online softmax, FlashAttention: Dao et al.,
/// arXiv:2205.14135), blocking a few queries per K/V load, so the score matrix is never
/// materialised: working memory is O(head_dim) per query (held in `out`) plus one tile of
/// scores per query on the stack. `scratch` must hold q_pos0 + n_q floats (the scalar twin's
/// full score row; the SIMD kernel does not use it). Each query's result depends only on its
/// q, position and the KV rows, never on n_q or q_pos0 (splitting a prompt differently gives
/// the same bits).
void attention_causal_tile(const float* q, int64_t q_stride, int64_t n_q, int64_t q_pos0,
                           const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                           int32_t head_dim, float scale, float* out, int64_t out_stride,
                           float* scratch);

/// Decode attention of n_q query heads that share one KV head (a grouped-query attention
/// group of one token): each query attends to positions [0, n_kv). Same layouts as
/// attention_causal_tile (q_i = q + i * q_stride, out_i = out + i * out_stride); each K/V row
/// is read once for the whole group. Row i is bit-identical to attention_head(q_i, ...).
/// `scratch` must hold n_kv floats (scalar twin only).
void attention_group(const float* q, int64_t q_stride, int64_t n_q, int64_t n_kv, const float* k,
                     int64_t k_stride, const float* v, int64_t v_stride, int32_t head_dim,
                     float scale, float* out, int64_t out_stride, float* scratch);

/// out[i] = silu(gate[i]) * up[i], silu(z) = z / (1 + exp(-z)) (SwiGLU: Shazeer,
/// arXiv:2002.05202), i in [0, n). out may alias gate or up.
void swiglu(const float* gate, const float* up, float* out, int64_t n);

/// out[i] = a[i] + b[i], i in [0, n). out may alias a or b.
void add(const float* a, const float* b, float* out, int64_t n);

/// Mixture-of-Experts routing of one token. logits: n_expert router outputs. Computes
/// p = softmax(logits) in double, selects the k largest p (ties: lowest expert id first),
/// writes their ids to `ids` (k entries, descending p) and their weights to `weights`: p, or
/// p / sum of the selected p when `renormalise` (Mixtral arXiv:2401.04088, Qwen3-MoE), each
/// rounded once from double to float. Requires 1 <= k <= n_expert. NaN logits sort last.
void moe_topk(const float* logits, int32_t n_expert, int32_t k, bool renormalise, int32_t* ids,
              float* weights);

/// moe_topk with the selection forced: the k experts are `ids` (given, in that slot order, each
/// in [0, n_expert) and distinct: the caller's check), their weights the same p (or p / sum of
/// the selected p) moe_topk computes for an expert it selects, in the same arithmetic. Used to
/// replay a routing trace: only the router's picks change, not the math of the step.
void moe_forced(const float* logits, int32_t n_expert, int32_t k, bool renormalise,
                const int32_t* ids, float* weights);

}  // namespace berth::cpu

namespace berth::ref {

// Scalar twins of the SIMD kernels above: same signatures and contracts, the plain formulas
// (two-pass softmax and attention) with values in float and every long sum (sum of squares,
// softmax denominator, attention dot products and weighted sums) accumulated in double, so the
// oracle's own rounding stays well below the SIMD kernels' tolerance.

void rms_norm(const float* x, const float* weight, float* y, int64_t n, float eps);
void rope_inplace(float* x, int32_t n_head, int32_t head_dim, int32_t n_rot, const float* cos_theta,
                  const float* sin_theta, bool adjacent);
void softmax(const float* x, float* y, int64_t n);
/// Two-pass softmax attention: all n_kv scores into `scores`, max, exp, sum, weighted sum.
void attention_head(const float* q, const float* k, int64_t k_stride, const float* v,
                    int64_t v_stride, int64_t n_kv, int32_t head_dim, float scale, float* out,
                    float* scores);
/// ref::attention_head per query with n_kv = q_pos0 + i + 1 (scratch: q_pos0 + n_q floats).
void attention_causal_tile(const float* q, int64_t q_stride, int64_t n_q, int64_t q_pos0,
                           const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                           int32_t head_dim, float scale, float* out, int64_t out_stride,
                           float* scratch);
/// ref::attention_head per query with the same n_kv (scratch: n_kv floats).
void attention_group(const float* q, int64_t q_stride, int64_t n_q, int64_t n_kv, const float* k,
                     int64_t k_stride, const float* v, int64_t v_stride, int32_t head_dim,
                     float scale, float* out, int64_t out_stride, float* scratch);
void swiglu(const float* gate, const float* up, float* out, int64_t n);
void add(const float* a, const float* b, float* out, int64_t n);

}  // namespace berth::ref
