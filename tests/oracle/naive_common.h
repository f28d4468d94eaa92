// Helpers shared by the oracle's forward passes (naive_llama.cpp, naive_qwen35.cpp): reading
// GGUF keys and tensors into doubles, and the plain double-precision building blocks. Internal
// to tests/oracle; no SIMD, no threads, no code shared with the fast path.
#pragma once

#include <array>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "berth/io/gguf.h"

namespace berth::oracle::detail {

/// "[ne0, ne1, ...]" of the first n_dims axes (at least one).
std::string shape_string(const std::array<int64_t, 4>& ne, uint32_t n_dims);
std::string shape_string(const std::vector<int64_t>& ne);

/// Reads a required positive integer key; Error(format) when it is not positive, and
/// Error(unsupported) when it is an array (per-layer values, which the oracle does not model).
int32_t positive_int(const gguf::File& file, const std::string& k);

/// Same as positive_int for an optional key: `fallback` when absent.
int32_t positive_int_or(const gguf::File& file, const std::string& k, int32_t fallback);

/// Decodes all of `t` into doubles, row-major with ne[0] contiguous. F32 and F64 are read
/// directly; every other type goes through the scalar reference dequantizer.
std::vector<double> to_double(const gguf::File& file, const gguf::TensorInfo& t);

/// Loads tensor `name`, checking that its shape is exactly `expected` (ne[0] first; trailing
/// axes of size 1 may be omitted in the file). Records the name in `used`.
std::vector<double> load(const gguf::File& file, const std::string& name,
                         const std::vector<int64_t>& expected, std::set<std::string>& used);

/// out[o] = sum_i w[o * n_in + i] * x[i] for o in [0, n_out).
/// `w` points at an n_out x n_in row-major matrix (n_in contiguous).
std::vector<double> matvec(const double* w, const std::vector<double>& x, int64_t n_in,
                           int64_t n_out);

/// RMSNorm: x * w / sqrt(mean(x^2) + eps).
std::vector<double> rms_norm(const std::vector<double>& x, const std::vector<double>& w,
                             double eps);

/// silu(z) = z / (1 + e^-z).
double silu(double z);

/// Per-head RMSNorm in place (qwen3's q_norm / k_norm): each of the n_heads chunks of head_dim
/// values is divided by sqrt(mean(chunk^2) + eps) and multiplied elementwise by w [head_dim].
void head_rms_norm_in_place(std::vector<double>& x, int32_t n_heads, int32_t head_dim,
                            const std::vector<double>& w, double eps);

/// x[i] += b[i].
void add_in_place(std::vector<double>& x, const std::vector<double>& b);

}  // namespace berth::oracle::detail
