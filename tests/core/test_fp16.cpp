// f16 and bf16 conversions: exhaustive round trips, agreement with the hardware F16C
// conversion (VCVTPS2PH, round to nearest even) and hand-worked rounding cases.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <ios>
#include <limits>
#include <random>
#include <vector>

#include "berth/core/fp16.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define BERTH_TEST_HAVE_X86 1
#endif

namespace berth {
namespace {

float f32_bits(uint32_t b) { return std::bit_cast<float>(b); }
uint32_t bits_f32(float f) { return std::bit_cast<uint32_t>(f); }
bool is_nan_f16(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }

TEST_CASE("f16 decodes known values exactly") {
  CHECK(fp16_to_f32(0x0000) == 0.0f);
  CHECK(bits_f32(fp16_to_f32(0x8000)) == 0x80000000u);  // -0
  CHECK(fp16_to_f32(0x3c00) == 1.0f);
  CHECK(fp16_to_f32(0xc000) == -2.0f);
  CHECK(fp16_to_f32(0x3800) == 0.5f);
  CHECK(fp16_to_f32(0x3555) == 0x1.554p-2f);
  CHECK(fp16_to_f32(0x7bff) == 65504.0f);                  // largest finite
  CHECK(fp16_to_f32(0x0400) == std::ldexp(1.0f, -14));     // smallest normal
  CHECK(fp16_to_f32(0x0001) == std::ldexp(1.0f, -24));     // smallest subnormal
  CHECK(fp16_to_f32(0x03ff) == std::ldexp(1023.0f, -24));  // largest subnormal
  CHECK(fp16_to_f32(0x0200) == std::ldexp(1.0f, -15));
  CHECK(fp16_to_f32(0x7c00) == std::numeric_limits<float>::infinity());
  CHECK(fp16_to_f32(0xfc00) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(fp16_to_f32(0x7e00)));
  CHECK(std::isnan(fp16_to_f32(0x7c01)));
  CHECK(std::isnan(fp16_to_f32(0xfd00)));
}

TEST_CASE("all 65536 f16 patterns round-trip through f32") {
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t h16 = static_cast<uint16_t>(h);
    const float f = fp16_to_f32(h16);
    const uint16_t back = f32_to_fp16(f);
    if (is_nan_f16(h16)) {
      REQUIRE(std::isnan(f));
      REQUIRE(is_nan_f16(back));
      REQUIRE((back & 0x8000u) == (h16 & 0x8000u));
    } else {
      REQUIRE(back == h16);
      // The decoded value is the exact binary16 value: sign * mant * 2^(exp - 25).
      const int exp = (h >> 10) & 0x1f;
      const int mant = h & 0x3ff;
      if (exp != 0x1f) {
        const double v = exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, exp - 25);
        REQUIRE(static_cast<double>(f) == ((h & 0x8000u) ? -v : v));
      }
    }
  }
}

TEST_CASE("f32 -> f16 rounding by hand") {
  CHECK(f32_to_fp16(1.0f) == 0x3c00);
  CHECK(f32_to_fp16(-2.0f) == 0xc000);
  CHECK(f32_to_fp16(65504.0f) == 0x7bff);
  CHECK(f32_to_fp16(65519.99f) == 0x7bff);  // below the halfway point to 65536
  CHECK(f32_to_fp16(65520.0f) == 0x7c00);   // tie between 65504 (odd) and 2^16: rounds to inf
  CHECK(f32_to_fp16(1e10f) == 0x7c00);
  CHECK(f32_to_fp16(-1e10f) == 0xfc00);
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1.0).
  CHECK(f32_to_fp16(1.0f + 0x1p-11f) == 0x3c00);
  // 1 + 3 * 2^-11 is halfway between 1 + 2^-10 (odd) and 1 + 2^-9: rounds up to even.
  CHECK(f32_to_fp16(1.0f + 0x3p-11f) == 0x3c02);
  CHECK(f32_to_fp16(1.0f + 0x1p-11f + 0x1p-20f) == 0x3c01);  // just above the tie
  // Subnormals: 2^-25 is halfway between 0 and 2^-24: ties to even (0).
  CHECK(f32_to_fp16(0x1p-25f) == 0x0000);
  CHECK(f32_to_fp16(0x1.000002p-25f) == 0x0001);
  CHECK(f32_to_fp16(-0x1p-25f) == 0x8000);
  CHECK(f32_to_fp16(0x3p-25f) == 0x0002);  // 1.5 * 2^-24: tie, rounds up to even 2
  CHECK(f32_to_fp16(0x1p-24f) == 0x0001);
  CHECK(f32_to_fp16(0x1p-30f) == 0x0000);
  CHECK(f32_to_fp16(0x1.ffcp-15f) == 0x0400);  // 1023.5 * 2^-24 ties up into the normals
  CHECK(f32_to_fp16(0x1.ff8p-15f) == 0x03ff);  // exactly the largest subnormal
  CHECK(f32_to_fp16(0x1p-14f) == 0x0400);
  CHECK(f32_to_fp16(std::numeric_limits<float>::denorm_min()) == 0x0000);
  CHECK(f32_to_fp16(std::numeric_limits<float>::infinity()) == 0x7c00);
  CHECK(is_nan_f16(f32_to_fp16(std::numeric_limits<float>::quiet_NaN())));
  CHECK(is_nan_f16(f32_to_fp16(f32_bits(0x7f800001u))));  // payload only in the low bits
  CHECK(f32_to_fp16(f32_bits(0x80000000u)) == 0x8000);
}

#ifdef BERTH_TEST_HAVE_X86
__attribute__((target("f16c"))) uint16_t hw_f32_to_f16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float hw_f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#endif

TEST_CASE("f32 -> f16 matches the F16C instruction") {
#ifdef BERTH_TEST_HAVE_X86
  if (!__builtin_cpu_supports("f16c")) {
    MESSAGE("CPU has no F16C; hardware comparison skipped");
    return;
  }
  std::vector<uint32_t> samples;
  // Every exponent with mantissas at and around the rounding boundaries of f16 (low 13 bits
  // 0x0fff, 0x1000, 0x1001, and the subnormal shifts), both signs.
  for (uint32_t e = 0; e < 256; ++e)
    for (uint32_t m :
         {0x000000u, 0x000001u, 0x000fffu, 0x001000u, 0x001001u, 0x002000u, 0x003000u, 0x7fe000u,
          0x7fefffu, 0x7ff000u, 0x7fffffu, 0x400000u, 0x200000u, 0x100000u, 0x080000u, 0x040000u,
          0x020000u, 0x010000u, 0x008000u, 0x004000u, 0x00c000u, 0x018000u, 0x030000u, 0x600000u})
      for (uint32_t s : {0u, 0x80000000u}) samples.push_back(s | (e << 23) | m);
  // Exact ties at every subnormal shift: a value v = (2k + 1) * 2^(-25 - t).
  for (int t = 0; t <= 10; ++t)
    for (int k = 0; k < 64; ++k)
      samples.push_back(bits_f32(std::ldexp(static_cast<float>(2 * k + 1), -25 - t)));
  // Random bit patterns, and random values concentrated in the f16 range.
  std::mt19937 rng(1234);
  for (int i = 0; i < 400000; ++i) samples.push_back(static_cast<uint32_t>(rng()));
  std::uniform_int_distribution<uint32_t> in_range(0x33000000u - 0x100000u,
                                                   0x47800000u + 0x100000u);
  for (int i = 0; i < 400000; ++i) samples.push_back(in_range(rng) | (rng() & 0x80000000u));
  // Midpoints between every pair of consecutive f16 values.
  for (uint32_t h = 0; h < 0x7c00u; ++h) {
    const double a = fp16_to_f32(static_cast<uint16_t>(h));
    const double b = h + 1 < 0x7c00u ? fp16_to_f32(static_cast<uint16_t>(h + 1)) : 65536.0;
    samples.push_back(bits_f32(static_cast<float>((a + b) / 2)));
  }
  size_t mismatches = 0;
  for (uint32_t b : samples) {
    const float f = f32_bits(b);
    const uint16_t mine = f32_to_fp16(f);
    const uint16_t hw = hw_f32_to_f16(f);
    if (mine != hw) {
      if (++mismatches <= 10)
        FAIL_CHECK("f32 bits 0x" << std::hex << b << ": berth 0x" << mine << " F16C 0x" << hw);
    }
  }
  CHECK(mismatches == 0);
  // And f16 -> f32 for every non-NaN pattern (F16C quiets signalling NaNs; berth keeps the bits).
  for (uint32_t h = 0; h < 65536; ++h) {
    if (is_nan_f16(static_cast<uint16_t>(h))) continue;
    REQUIRE(bits_f32(fp16_to_f32(static_cast<uint16_t>(h))) ==
            bits_f32(hw_f16_to_f32(static_cast<uint16_t>(h))));
  }
#else
  MESSAGE("not an x86 build; hardware comparison skipped");
#endif
}

TEST_CASE("bf16 conversions") {
  CHECK(bf16_to_f32(0x3f80) == 1.0f);
  CHECK(bf16_to_f32(0xc040) == -3.0f);
  CHECK(bf16_to_f32(0x7f80) == std::numeric_limits<float>::infinity());
  CHECK(f32_to_bf16(1.0f) == 0x3f80);
  // Ties to even: 0x3f808000 lies halfway between 0x3f80 (even) and 0x3f81.
  CHECK(f32_to_bf16(f32_bits(0x3f808000u)) == 0x3f80);
  // 0x3f818000 lies halfway between 0x3f81 (odd) and 0x3f82: rounds up.
  CHECK(f32_to_bf16(f32_bits(0x3f818000u)) == 0x3f82);
  CHECK(f32_to_bf16(f32_bits(0x3f808001u)) == 0x3f81);
  CHECK(f32_to_bf16(f32_bits(0x3f807fffu)) == 0x3f80);
  CHECK(f32_to_bf16(f32_bits(0xbf808000u)) == 0xbf80);
  CHECK(f32_to_bf16(f32_bits(0xbf818000u)) == 0xbf82);
  // Carry into the exponent: 0x3fffffff rounds up to 2.0 (0x4000).
  CHECK(f32_to_bf16(f32_bits(0x3fffffffu)) == 0x4000);
  // FLT_MAX rounds to infinity; infinity stays infinity.
  CHECK(f32_to_bf16(std::numeric_limits<float>::max()) == 0x7f80);
  CHECK(f32_to_bf16(-std::numeric_limits<float>::infinity()) == 0xff80);
  // Subnormals round like normals (no flush): 0x00008000 ties to even 0x0000; 0x00018000 up.
  CHECK(f32_to_bf16(f32_bits(0x00008000u)) == 0x0000);
  CHECK(f32_to_bf16(f32_bits(0x00018000u)) == 0x0002);
  // NaN becomes a quiet NaN, even when its payload lives only in the low 16 bits.
  CHECK(f32_to_bf16(f32_bits(0x7f800001u)) == 0x7fc0);
  CHECK(f32_to_bf16(f32_bits(0xff800001u)) == 0xffc0);
  CHECK(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()) == 0x7fc0);

  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t h16 = static_cast<uint16_t>(h);
    const float f = bf16_to_f32(h16);
    REQUIRE(bits_f32(f) == (h << 16));
    if (std::isnan(f))
      REQUIRE(std::isnan(bf16_to_f32(f32_to_bf16(f))));
    else
      REQUIRE(f32_to_bf16(f) == h16);
  }
  // Random floats: the result is the nearest bf16, ties to even (checked in double).
  std::mt19937 rng(99);
  for (int i = 0; i < 200000; ++i) {
    const float f = f32_bits(static_cast<uint32_t>(rng()));
    if (std::isnan(f) || std::isinf(f)) continue;
    const uint32_t b = bits_f32(f);
    const uint16_t r = f32_to_bf16(f);
    const uint16_t down = static_cast<uint16_t>(b >> 16);
    const double lo = bf16_to_f32(down);
    const uint16_t up = static_cast<uint16_t>(down + 1);
    const double hi = (up & 0x7f80u) == 0x7f80u && (up & 0x7fu) == 0
                          ? std::ldexp((b & 0x80000000u) ? -1.0 : 1.0, 128)
                          : static_cast<double>(bf16_to_f32(up));
    const double dlo = std::fabs(f - lo), dhi = std::fabs(hi - f);
    const uint16_t expected = dlo < dhi ? down : dhi < dlo ? up : ((down & 1u) ? up : down);
    REQUIRE(r == expected);
  }
}

}  // namespace
}  // namespace berth
