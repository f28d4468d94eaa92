// Tensor element types and their block layouts.
//
// Type ids, block sizes and bytes per block are those of ggml's `enum ggml_type` and
// `type_traits` table (ggml/include/ggml.h, ggml/src/ggml.c), which GGUF files store in each
// tensor info. They must match bit for bit so files from the ecosystem load as downloaded.
// A "block" is the unit of quantization: `block_size` consecutive elements of a row (along
// ne[0], the contiguous axis) stored in `block_bytes` bytes. Plain types have block_size 1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace berth {

/// ggml type ids as stored in GGUF tensor infos. Gaps (4, 5, 31-33, 36-38) are ids ggml has
/// removed; files using them are rejected as unknown.
enum class GgmlType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ2_XXS = 16,
  IQ2_XS = 17,
  IQ3_XXS = 18,
  IQ1_S = 19,
  IQ4_NL = 20,
  IQ3_S = 21,
  IQ2_S = 22,
  IQ4_XS = 23,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  IQ1_M = 29,
  BF16 = 30,
  TQ1_0 = 34,
  TQ2_0 = 35,
  MXFP4 = 39,
};

/// Elements per super-block of the K-quants (ggml's QK_K).
inline constexpr int64_t kQK_K = 256;

/// Static description of one type.
struct TypeTraits {
  GgmlType type;
  std::string_view name;  ///< ggml's name, e.g. "q4_K", "f32", "bf16"
  int64_t block_size;     ///< elements per block (1 for plain types)
  size_t block_bytes;     ///< bytes per block
  bool quantized;         ///< block_size > 1 or a packed integer format
  bool computable;        ///< berth can dequantize and compute with it
};

/// Traits of type id `id`, or nullptr when `id` is not a ggml type id (unknown or removed).
const TypeTraits* find_type(uint32_t id) noexcept;

/// Traits of `t`; throws Error(internal) if `t` is not a valid enumerator.
const TypeTraits& traits(GgmlType t);

/// ggml's name of `t` ("q4_K"), or "type<id>" for an invalid value.
std::string_view type_name(GgmlType t);

/// Parses a type name, case-insensitively ("Q4_K", "q4_k", "F32", "bf16").
std::optional<GgmlType> parse_type(std::string_view name);

/// Bytes of one row of `n` elements of type `t`.
/// Throws Error(invalid_argument) when n < 0 or n is not a multiple of the block size.
size_t row_bytes(GgmlType t, int64_t n);

}  // namespace berth
