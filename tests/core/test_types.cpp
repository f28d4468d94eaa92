// The type table against the published ggml/GGUF values (ggml.h enum ggml_type, ggml.c
// type_traits, ggml-common.h block structs).
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "berth/core/error.h"
#include "berth/core/types.h"

namespace berth {
namespace {

struct Expected {
  uint32_t id;
  const char* name;
  int64_t block_size;
  size_t block_bytes;
  bool quantized;
  bool computable;
};

// Published values: id, ggml name, elements per block, bytes per block.
constexpr Expected kExpected[] = {
    {0, "f32", 1, 4, false, true},         {1, "f16", 1, 2, false, true},
    {2, "q4_0", 32, 18, true, true},     // f16 d + 16 bytes of nibbles
    {3, "q4_1", 32, 20, true, true},     // f16 d, m + 16
    {6, "q5_0", 32, 22, true, true},     // f16 d + 4 qh + 16
    {7, "q5_1", 32, 24, true, true},     // f16 d, m + 4 + 16
    {8, "q8_0", 32, 34, true, true},     // f16 d + 32 int8
    {9, "q8_1", 32, 36, true, false},    // f16 d, s + 32 int8
    {10, "q2_K", 256, 84, true, true},   // 16 scales + 64 qs + 2 f16
    {11, "q3_K", 256, 110, true, true},  // 32 hmask + 64 qs + 12 scales + f16
    {12, "q4_K", 256, 144, true, true},  // 2 f16 + 12 scales + 128 qs
    {13, "q5_K", 256, 176, true, true},  // 2 f16 + 12 + 32 qh + 128 qs
    {14, "q6_K", 256, 210, true, true},  // 128 ql + 64 qh + 16 int8 scales + f16
    {15, "q8_K", 256, 292, true, true},  // f32 d + 256 int8 + 16 int16
    {16, "iq2_xxs", 256, 66, true, false}, {17, "iq2_xs", 256, 74, true, false},
    {18, "iq3_xxs", 256, 98, true, false}, {19, "iq1_s", 256, 50, true, false},
    {20, "iq4_nl", 32, 18, true, false},   {21, "iq3_s", 256, 110, true, false},
    {22, "iq2_s", 256, 82, true, false},   {23, "iq4_xs", 256, 136, true, false},
    {24, "i8", 1, 1, false, false},        {25, "i16", 1, 2, false, false},
    {26, "i32", 1, 4, false, false},       {27, "i64", 1, 8, false, false},
    {28, "f64", 1, 8, false, false},       {29, "iq1_m", 256, 56, true, false},
    {30, "bf16", 1, 2, false, true},       {34, "tq1_0", 256, 54, true, false},
    {35, "tq2_0", 256, 66, true, false},   {39, "mxfp4", 32, 17, true, false},
};

TEST_CASE("type table matches ggml's published ids, block sizes and bytes") {
  for (const Expected& e : kExpected) {
    CAPTURE(e.id);
    const TypeTraits* t = find_type(e.id);
    REQUIRE(t != nullptr);
    CHECK(static_cast<uint32_t>(t->type) == e.id);
    CHECK(t->name == e.name);
    CHECK(t->block_size == e.block_size);
    CHECK(t->block_bytes == e.block_bytes);
    CHECK(t->quantized == e.quantized);
    CHECK(t->computable == e.computable);
    CHECK(&traits(t->type) == t);
    CHECK(type_name(t->type) == e.name);
  }
  CHECK(kQK_K == 256);
}

TEST_CASE("unknown and removed type ids are rejected") {
  for (uint32_t id : {4u, 5u, 31u, 32u, 33u, 36u, 37u, 38u, 40u, 41u, 1000u, 0xffffffffu}) {
    CAPTURE(id);
    CHECK(find_type(id) == nullptr);
  }
  CHECK(type_name(static_cast<GgmlType>(4)) == "type4");
  CHECK(type_name(static_cast<GgmlType>(40)) == "type40");
  try {
    (void)traits(static_cast<GgmlType>(31));
    FAIL("traits() accepted id 31");
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::internal);
  }
}

TEST_CASE("parse_type is case-insensitive and exact") {
  CHECK(parse_type("q4_K") == GgmlType::Q4_K);
  CHECK(parse_type("Q4_K") == GgmlType::Q4_K);
  CHECK(parse_type("q4_k") == GgmlType::Q4_K);
  CHECK(parse_type("F32") == GgmlType::F32);
  CHECK(parse_type("bf16") == GgmlType::BF16);
  CHECK(parse_type("BF16") == GgmlType::BF16);
  CHECK(parse_type("Q8_0") == GgmlType::Q8_0);
  CHECK(parse_type("iq4_XS") == GgmlType::IQ4_XS);
  CHECK(parse_type("MXFP4") == GgmlType::MXFP4);
  CHECK_FALSE(parse_type("").has_value());
  CHECK_FALSE(parse_type("q4").has_value());
  CHECK_FALSE(parse_type("q4_K ").has_value());
  CHECK_FALSE(parse_type("q4_0_4_4").has_value());
  CHECK_FALSE(parse_type("f8").has_value());
  // Every table name parses back to its own type.
  for (const Expected& e : kExpected) CHECK(parse_type(e.name) == static_cast<GgmlType>(e.id));
}

TEST_CASE("row_bytes") {
  CHECK(row_bytes(GgmlType::F32, 7) == 28);
  CHECK(row_bytes(GgmlType::F16, 3) == 6);
  CHECK(row_bytes(GgmlType::BF16, 5) == 10);
  CHECK(row_bytes(GgmlType::Q4_0, 64) == 36);
  CHECK(row_bytes(GgmlType::Q8_0, 4096) == 128 * 34);
  CHECK(row_bytes(GgmlType::Q4_K, 0) == 0);
  CHECK(row_bytes(GgmlType::Q6_K, 512) == 420);
  CHECK(row_bytes(GgmlType::Q8_K, 256) == 292);
  CHECK(row_bytes(GgmlType::MXFP4, 2880) == 90 * 17);

  auto category_of = [](GgmlType t, int64_t n) {
    try {
      (void)row_bytes(t, n);
    } catch (const Error& e) {
      return std::string(category_name(e.category()));
    }
    return std::string("no error");
  };
  CHECK(category_of(GgmlType::Q4_0, 33) == "invalid_argument");
  CHECK(category_of(GgmlType::Q4_K, 128) == "invalid_argument");
  CHECK(category_of(GgmlType::Q4_K, 32) == "invalid_argument");
  CHECK(category_of(GgmlType::F32, -1) == "invalid_argument");
  CHECK(category_of(GgmlType::Q8_0, -32) == "invalid_argument");
  CHECK(category_of(static_cast<GgmlType>(5), 32) == "internal");
  CHECK(category_of(GgmlType::Q4_0, 32) == "no error");
}

}  // namespace
}  // namespace berth
