// CPU kernels of the forward pass on f32 activations. Each function works on the rows (or
// heads) it is given and never starts threads: the runtime splits work across its pinned pool
// by calling these on disjoint ranges. Every output element is computed by one call in a fixed
// summation order, so results do not depend on how the work was split (-t 1 == -t N bit for bit).
//
// Activations are row-major [tokens, cols] f32 with `cols` contiguous; a weight row is one row of
// a ggml tensor (ne[0] elements, contiguous) in its stored type.
#pragma once

#include <cstddef>
#include <cstdint>

#include "berth/core/tensor.h"

namespace berth::cpu {

/// Dot product of n floats with 8 independent partial sums combined in a fixed order.
float dot_f32(const float* a, const float* b, int64_t n);

/// For t in [0, n_tokens) and output rows o in [row_begin, row_end):
/// y[t * y_stride + o] = sum_i W[o, i] * x[t * x_stride + i], i in [0, ne[0]).
/// `w` is a 2-D view (or any view; rows are counted across ne[1..3]) of a computable type.
/// Quantized and half-precision rows are decoded once into `scratch` (ne[0] floats) and reused
/// for all tokens, so each weight row is read from memory once per call.
/// Throws Error(unsupported) for a type berth cannot compute.
void matmul_rows(const TensorView& w, int64_t row_begin, int64_t row_end, const float* x,
                 int64_t x_stride, int64_t n_tokens, float* y, int64_t y_stride, float* scratch);

/// Decodes row `row` of `w` (ne[0] elements) into dst.
void get_row(const TensorView& w, int64_t row, float* dst);

/// y = x / sqrt(mean(x^2) + eps) * weight, over n elements (weight may be null: no scaling).
/// RMSNorm: Zhang & Sennrich, arXiv:1910.07467. Sum of squares accumulates in double.
void rms_norm(const float* x, const float* weight, float* y, int64_t n, float eps);

/// Rotates one token's heads in place: x holds n_head heads of head_dim floats; in each head
/// the first n_rot dims are rotated by angles pos * inv_freq[i] (i < n_rot/2), given as
/// cos_theta/sin_theta (n_rot/2 values each). adjacent: pairs (2i, 2i+1); else NeoX pairs
/// (i, i + n_rot/2).
void rope_inplace(float* x, int32_t n_head, int32_t head_dim, int32_t n_rot, const float* cos_theta,
                  const float* sin_theta, bool adjacent);

/// One query head against keys/values of positions [0, n_kv):
/// out[d] = sum_j softmax_j(scale * q.k_j) * v_j[d]. k_j = k + j * k_stride (head_dim floats),
/// v_j = v + j * v_stride. `scores` is scratch of n_kv floats. Softmax subtracts the max.
void attention_head(const float* q, const float* k, int64_t k_stride, const float* v,
                    int64_t v_stride, int64_t n_kv, int32_t head_dim, float scale, float* out,
                    float* scores);

/// out = silu(gate) * up, silu(z) = z / (1 + exp(-z)).
void swiglu(const float* gate, const float* up, float* out, int64_t n);

/// out = a + b.
void add(const float* a, const float* b, float* out, int64_t n);

}  // namespace berth::cpu
