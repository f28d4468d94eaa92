#include "berth/tools/quantize.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <system_error>
#include <vector>

#include "berth/core/error.h"
#include "berth/cpu_kernels/quants_ref.h"
#include "berth/io/gguf.h"
#include "berth/io/gguf_writer.h"

namespace berth {
namespace {

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

std::string target_names() {
  std::string s;
  for (GgmlType t : quantize_target_types()) {
    if (!s.empty()) s += ", ";
    s += type_name(t);
  }
  return s;
}

// True when `out_path` names the same file as `in_path` (writing it would truncate the mapping
// the tensors are read from).
bool same_file(const std::string& in_path, const std::string& out_path) {
  std::error_code ec;
  if (!std::filesystem::exists(out_path, ec)) return false;
  return std::filesystem::equivalent(in_path, out_path, ec) && !ec;
}

// Encodes rows [r0, r1) of `src` (type `from`, n elements per row) into `dst` (type `to`).
void convert_rows(const gguf::TensorInfo& src, GgmlType to, int64_t r0, int64_t r1, uint8_t* dst) {
  const int64_t n = src.ne[0];
  const size_t in_rb = row_bytes(src.type, n);
  const size_t out_rb = row_bytes(to, n);
  std::vector<float> scratch(src.type == GgmlType::F32 ? 0 : static_cast<size_t>(n));
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* in = src.data + static_cast<size_t>(r) * in_rb;
    const float* f;
    if (src.type == GgmlType::F32) {
      f = reinterpret_cast<const float*>(in);  // GGUF data is aligned (>= 32 bytes), rows by 4
    } else {
      ref::dequantize_row(src.type, in, scratch.data(), n);
      f = scratch.data();
    }
    ref::quantize_row(to, f, dst + static_cast<size_t>(r) * out_rb, n);
  }
}

}  // namespace

const std::vector<GgmlType>& quantize_target_types() {
  static const std::vector<GgmlType> types = {
      GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0,
      GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K,
      GgmlType::F16,  GgmlType::BF16, GgmlType::F32};
  return types;
}

GgmlType parse_quantize_type(std::string_view name) {
  std::optional<GgmlType> t = parse_type(name);
  const auto& ok = quantize_target_types();
  if (!t || std::find(ok.begin(), ok.end(), *t) == ok.end())
    throw Error(
        ErrorCategory::invalid_argument,
        fmt::format("unknown quantization type '{}' (expected one of: {})", name, target_names()));
  return *t;
}

uint32_t llama_ftype_of(GgmlType t) {
  // enum llama_ftype, llama.h.
  switch (t) {
    case GgmlType::F32:
      return 0;
    case GgmlType::F16:
      return 1;
    case GgmlType::Q4_0:
      return 2;
    case GgmlType::Q4_1:
      return 3;
    case GgmlType::Q8_0:
      return 7;
    case GgmlType::Q5_0:
      return 8;
    case GgmlType::Q5_1:
      return 9;
    case GgmlType::Q2_K:
      return 10;
    case GgmlType::Q3_K:
      return 11;  // LLAMA_FTYPE_MOSTLY_Q3_K_S
    case GgmlType::Q4_K:
      return 14;  // LLAMA_FTYPE_MOSTLY_Q4_K_S
    case GgmlType::Q5_K:
      return 16;  // LLAMA_FTYPE_MOSTLY_Q5_K_S
    case GgmlType::Q6_K:
      return 18;
    case GgmlType::BF16:
      return 32;
    default:
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("{} is not a quantization target (expected one of: {})", type_name(t),
                              target_names()));
  }
}

QuantizeReport quantize_model(const std::string& in_path, const std::string& out_path,
                              GgmlType type, ThreadPool& pool) {
  const uint32_t ftype = llama_ftype_of(type);  // validates `type`
  gguf::File in = gguf::File::open(in_path);
  if (same_file(in_path, out_path))
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("the output '{}' is the input file; write to another path", out_path));

  gguf::Writer w(in.version() >= 3 ? 3 : 2, in.alignment());
  for (const gguf::KeyValue& kv : in.kvs()) w.set(kv.key, kv.value);
  w.set_u32("general.file_type", ftype);
  w.set_u32("general.quantization_version", 2);

  QuantizeReport rep;
  rep.type = type;
  const int64_t block = traits(type).block_size;
  const int n_threads = pool.n_threads();
  for (const gguf::TensorInfo& t : in.tensors()) {
    QuantizedTensor q;
    q.name = t.name;
    q.from = t.type;
    q.to = t.type;
    q.bytes_in = t.n_bytes;
    const bool matrix = t.n_dims >= 2 && ends_with(t.name, "weight") && t.n_elements() > 0;
    if (!matrix) {
      q.action = QuantizedTensor::Action::copied;
    } else if (t.type == type) {
      q.action = QuantizedTensor::Action::kept;
      q.reason = fmt::format("already {}", type_name(type));
    } else if (t.ne[0] % block != 0) {
      q.action = QuantizedTensor::Action::kept;
      q.reason = fmt::format("row length {} is not a multiple of {}", t.ne[0], block);
    } else if (!traits(t.type).computable) {
      q.action = QuantizedTensor::Action::kept;
      q.reason = fmt::format("berth cannot decode {}", type_name(t.type));
    } else {
      q.action = QuantizedTensor::Action::quantized;
      q.to = type;
    }

    std::vector<int64_t> ne(t.ne.begin(), t.ne.begin() + std::max<uint32_t>(t.n_dims, 1));
    if (q.action == QuantizedTensor::Action::quantized) {
      const int64_t n_rows = t.n_elements() / t.ne[0];
      q.bytes_out = static_cast<uint64_t>(n_rows) * row_bytes(type, t.ne[0]);
      // `t` points into `in`'s mapping, which outlives w.write() below.
      const gguf::TensorInfo* src = &t;
      w.add_tensor(t.name, type, std::move(ne),
                   [src, type, n_rows, n_threads, &pool](std::span<uint8_t> dst) {
                     const int64_t grain =
                         std::max<int64_t>(1, n_rows / (static_cast<int64_t>(n_threads) * 8));
                     pool.parallel_for(n_rows, grain, [&](int64_t r0, int64_t r1) {
                       convert_rows(*src, type, r0, r1, dst.data());
                     });
                   });
    } else {
      q.bytes_out = t.n_bytes;
      // Copied as is: the bytes stay in the mapping until written.
      const gguf::TensorInfo* src = &t;
      w.add_tensor(t.name, t.type, std::move(ne), [src](std::span<uint8_t> dst) {
        std::copy(src->data, src->data + src->n_bytes, dst.data());
      });
    }
    switch (q.action) {
      case QuantizedTensor::Action::quantized:
        ++rep.n_quantized;
        break;
      case QuantizedTensor::Action::kept:
        ++rep.n_kept;
        break;
      case QuantizedTensor::Action::copied:
        ++rep.n_copied;
        break;
    }
    rep.bytes_in += q.bytes_in;
    rep.bytes_out += q.bytes_out;
    rep.tensors.push_back(std::move(q));
  }

  w.write(out_path);
  rep.file_bytes_in = in.file_size();
  std::error_code ec;
  const auto out_size = std::filesystem::file_size(out_path, ec);
  rep.file_bytes_out = ec ? 0 : static_cast<uint64_t>(out_size);
  return rep;
}

}  // namespace berth
