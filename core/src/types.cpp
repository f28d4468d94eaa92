#include "berth/core/types.h"

#include <fmt/format.h>

#include <array>
#include <cctype>

#include "berth/core/error.h"

namespace berth {
namespace {

using T = GgmlType;

// Block sizes and bytes per block: ggml's type_traits table (ggml.c) and the block structs in
// ggml-common.h. K-quants use QK_K = 256.
constexpr std::array<TypeTraits, 32> kTypes{{
    {T::F32, "f32", 1, 4, false, true},
    {T::F16, "f16", 1, 2, false, true},
    {T::Q4_0, "q4_0", 32, 18, true, true},
    {T::Q4_1, "q4_1", 32, 20, true, true},
    {T::Q5_0, "q5_0", 32, 22, true, true},
    {T::Q5_1, "q5_1", 32, 24, true, true},
    {T::Q8_0, "q8_0", 32, 34, true, true},
    {T::Q8_1, "q8_1", 32, 36, true, false},
    {T::Q2_K, "q2_K", 256, 84, true, true},
    {T::Q3_K, "q3_K", 256, 110, true, true},
    {T::Q4_K, "q4_K", 256, 144, true, true},
    {T::Q5_K, "q5_K", 256, 176, true, true},
    {T::Q6_K, "q6_K", 256, 210, true, true},
    {T::Q8_K, "q8_K", 256, 292, true, true},
    {T::IQ2_XXS, "iq2_xxs", 256, 66, true, false},
    {T::IQ2_XS, "iq2_xs", 256, 74, true, false},
    {T::IQ3_XXS, "iq3_xxs", 256, 98, true, false},
    {T::IQ1_S, "iq1_s", 256, 50, true, false},
    {T::IQ4_NL, "iq4_nl", 32, 18, true, false},
    {T::IQ3_S, "iq3_s", 256, 110, true, false},
    {T::IQ2_S, "iq2_s", 256, 82, true, false},
    {T::IQ4_XS, "iq4_xs", 256, 136, true, false},
    {T::I8, "i8", 1, 1, false, false},
    {T::I16, "i16", 1, 2, false, false},
    {T::I32, "i32", 1, 4, false, false},
    {T::I64, "i64", 1, 8, false, false},
    {T::F64, "f64", 1, 8, false, false},
    {T::IQ1_M, "iq1_m", 256, 56, true, false},
    {T::BF16, "bf16", 1, 2, false, true},
    {T::TQ1_0, "tq1_0", 256, 54, true, false},
    {T::TQ2_0, "tq2_0", 256, 66, true, false},
    {T::MXFP4, "mxfp4", 32, 17, true, false},
}};

bool iequal(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i])))
      return false;
  return true;
}

}  // namespace

const TypeTraits* find_type(uint32_t id) noexcept {
  for (const auto& t : kTypes)
    if (static_cast<uint32_t>(t.type) == id) return &t;
  return nullptr;
}

const TypeTraits& traits(GgmlType t) {
  const TypeTraits* tr = find_type(static_cast<uint32_t>(t));
  BERTH_CHECK(tr != nullptr, fmt::format("invalid GgmlType value {}", static_cast<uint32_t>(t)));
  return *tr;
}

std::string_view type_name(GgmlType t) {
  const TypeTraits* tr = find_type(static_cast<uint32_t>(t));
  if (tr) return tr->name;
  static thread_local std::string buf;
  buf = fmt::format("type{}", static_cast<uint32_t>(t));
  return buf;
}

std::optional<GgmlType> parse_type(std::string_view name) {
  for (const auto& t : kTypes)
    if (iequal(t.name, name)) return t.type;
  return std::nullopt;
}

size_t row_bytes(GgmlType t, int64_t n) {
  const TypeTraits& tr = traits(t);
  if (n < 0 || n % tr.block_size != 0)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("a row of {} elements is not a whole number of {} blocks of {}", n,
                            tr.name, tr.block_size));
  return static_cast<size_t>(n / tr.block_size) * tr.block_bytes;
}

}  // namespace berth
