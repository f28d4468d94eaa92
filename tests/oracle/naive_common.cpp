// Shared helpers of the oracle (see naive_common.h).
#include "naive_common.h"

#include <cmath>
#include <cstring>

#include "berth/core/error.h"
#include "berth/core/types.h"
#include "berth/cpu_kernels/quants_ref.h"

namespace berth::oracle::detail {

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
                "oracle: " + file.path() + ": key '" + k +
                    "' is a per-layer array; the oracle supports one value for all layers");
  }
  const int64_t value = file.get_int(k);
  if (value <= 0 || value > INT32_MAX) {
    throw Error(ErrorCategory::format, "oracle: " + file.path() + ": key '" + k +
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
    throw Error(ErrorCategory::unsupported, "oracle: " + file.path() + ": tensor '" + t.name +
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
    throw Error(ErrorCategory::format, "oracle: " + file.path() + ": tensor '" + name +
                                           "' has shape " + shape_string(t.ne, t.n_dims) +
                                           ", expected " + shape_string(expected));
  }
  used.insert(name);
  return to_double(file, t);
}

/// out[o] = sum_i w[o * n_in + i] * x[i] for o in [0, n_out).
/// `w` points at an n_out x n_in row-major matrix (n_in contiguous).
std::vector<double> matvec(const double* w, const std::vector<double>& x, int64_t n_in,
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

/// Per-head RMSNorm in place (qwen3's q_norm / k_norm): each of the n_heads chunks of head_dim
/// values is divided by sqrt(mean(chunk^2) + eps) and multiplied elementwise by w [head_dim].
void head_rms_norm_in_place(std::vector<double>& x, int32_t n_heads, int32_t head_dim,
                            const std::vector<double>& w, double eps) {
  for (int32_t h = 0; h < n_heads; ++h) {
    double* chunk = x.data() + int64_t{h} * head_dim;
    double sum_sq = 0.0;
    for (int32_t i = 0; i < head_dim; ++i) sum_sq += chunk[i] * chunk[i];
    const double scale = 1.0 / std::sqrt(sum_sq / head_dim + eps);
    for (int32_t i = 0; i < head_dim; ++i) chunk[i] = chunk[i] * scale * w[i];
  }
}

void add_in_place(std::vector<double>& x, const std::vector<double>& b) {
  for (size_t i = 0; i < x.size(); ++i) x[i] += b[i];
}

}  // namespace berth::oracle::detail
