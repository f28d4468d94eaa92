// Oracle tests of the 32-element-family and float dot products (quant_dot.h): the Highway
// kernels of quant_dot_legacy.cc / quant_dot_float.cc against their scalar twins
// (quant_dot_legacy_ref.cpp / quant_dot_float_ref.cpp) on every Highway target compiled in and
// supported by this CPU. Inputs come from seeded generators; outputs are poisoned before each
// run; every type has its NMSE tolerance written below with its reason.
//
// Covered per type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F32, F16, BF16) and target:
//  - Q8_0 activation quantization: SIMD equals ref::quantize_activation bit for bit (random rows
//    and rows with ties, NaN, infinities, an all-zero block);
//  - dot_tile vs ref::dot_tile on the same quantized activations, for n = 32, 64, 96 (odd block
//    count), 1184 (37 blocks), 4096 (plus float tails), n_rows 1, 3, 17, n_tok 1, 2, 3, 7, 64
//    and 512;
//  - out_stride > n_rows: the gaps keep their sentinel; every written output is finite;
//  - a tile split into sub-tiles (rows and tokens) gives bit-identical outputs, and so does each
//    token computed alone (the decode GEMV);
//  - exact results when every product and partial sum is representable (power-of-two scales,
//    random quant bytes, including Q8_0's -128);
//  - end to end: SIMD-quantized activations times the weights is close to the double product of
//    the dequantized weights and the float activations;
//  - argument errors (Error(invalid_argument)).
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "berth/core/error.h"
#include "berth/core/fp16.h"
#include "berth/core/types.h"
#include "berth/cpu_kernels/quant_dot.h"
#include "berth/cpu_kernels/quants_ref.h"
#include "core/kernel_harness.h"

namespace berth {
namespace {

using test::for_each_simd_target;
using test::gaussian;
using test::nmse;

constexpr GgmlType kQuantTypes[] = {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1,
                                    GgmlType::Q8_0};
constexpr GgmlType kFloatTypes[] = {GgmlType::F32, GgmlType::F16, GgmlType::BF16};

// NMSE tolerances of dot_tile against ref::dot_tile (same weights, same activations).
// Quantized types: the integer block sums are exact in both; only the float accumulation of
// (d_w * d_a) * isum differs (the SIMD kernel keeps per-lane partial sums in two accumulators
// and uses FMA, the twin adds block results in order): relative error per output ~1e-7 at
// n = 4096, NMSE ~1e-14 observed. 1e-10 leaves room while any wrong quant, scale or block
// (an error of >= 1/(2 * 32 * nb) relative) gives NMSE > 1e-6. Observed at most 1.3e-12.
constexpr double kTolQuant = 1e-10;
// Float types: f32 FMA accumulation in lanes against the twin's double accumulation; relative
// error ~ sqrt(n / lanes) * 2^-24 per output, worst on the narrow targets (one lane on
// HWY_SCALAR): observed at most 1.5e-10 (f32, n = 4096, a single output).
constexpr double kTolFloat = 1e-8;
// End to end (Q8_0-quantized activations against the float activations): the activation
// rounding error is uniform with step d = amax / 127 (~2.2 sigma / 127 for Gaussian blocks),
// relative variance ~(0.017 / sqrt(12))^2 = 2.5e-5 of the dot product; 5e-4 is 20x that.
constexpr double kTolEndToEnd = 5e-4;

// The bit pattern left in output gaps; a kernel that writes outside its outputs changes it.
constexpr uint32_t kSentinelBits = 0x7fc0deadu;

float sentinel() { return std::bit_cast<float>(kSentinelBits); }

bool same_bits(const float* a, const float* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

double tolerance(GgmlType t) {
  return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16 ? kTolFloat : kTolQuant;
}

// n_rows weight rows of type t from Gaussian floats (Q4_1/Q5_1 get a nonzero mean so their
// minimum term matters), quantized with the reference quantizer.
std::vector<uint8_t> make_weights(GgmlType t, int64_t n_rows, int64_t n, uint64_t seed) {
  const bool has_min = t == GgmlType::Q4_1 || t == GgmlType::Q5_1;
  const std::vector<float> x =
      gaussian(static_cast<size_t>(n_rows * n), seed, 1.0f, has_min ? 0.3f : 0.0f);
  const size_t rb = row_bytes(t, n);
  std::vector<uint8_t> w(rb * static_cast<size_t>(n_rows));
  for (int64_t r = 0; r < n_rows; ++r) ref::quantize_row(t, x.data() + r * n, w.data() + r * rb, n);
  return w;
}

// Activation rows for weights of type t, quantized by the SIMD quantizer of the current
// target; also checks it against the scalar quantizer bit for bit.
std::vector<uint8_t> make_activations(GgmlType t, const std::vector<float>& x, int64_t n_tok,
                                      int64_t n) {
  const size_t rb = cpu::activation_row_bytes(t, n);
  std::vector<uint8_t> a(rb * static_cast<size_t>(n_tok), 0xA5);
  std::vector<uint8_t> r(a.size(), 0x5A);
  for (int64_t k = 0; k < n_tok; ++k) {
    cpu::quantize_activation(t, x.data() + k * n, a.data() + k * rb, n);
    ref::quantize_activation(t, x.data() + k * n, r.data() + k * rb, n);
  }
  CHECK(a == r);
  return a;
}

// Runs cpu::dot_tile into an output with gaps (out_stride = n_rows + 3) filled with the
// sentinel; checks the gaps and returns the outputs packed as [n_tok][n_rows].
std::vector<float> run_tile(GgmlType t, const std::vector<uint8_t>& w, int64_t n_rows,
                            const std::vector<uint8_t>& a, int64_t n_tok, int64_t n) {
  const int64_t stride = n_rows + 3;
  std::vector<float> out(static_cast<size_t>(stride * n_tok), sentinel());
  cpu::dot_tile(t, w.data(), n_rows, a.data(), cpu::activation_row_bytes(t, n), n_tok, n,
                out.data(), stride);
  std::vector<float> packed(static_cast<size_t>(n_rows * n_tok));
  bool gaps_ok = true, written_ok = true;
  for (int64_t k = 0; k < n_tok; ++k)
    for (int64_t i = 0; i < stride; ++i) {
      const float v = out[static_cast<size_t>(k * stride + i)];
      if (i < n_rows) {
        written_ok = written_ok && std::isfinite(v);
        packed[static_cast<size_t>(k * n_rows + i)] = v;
      } else {
        gaps_ok = gaps_ok && std::bit_cast<uint32_t>(v) == kSentinelBits;
      }
    }
  CHECK_MESSAGE(gaps_ok, "dot_tile wrote between rows (out_stride > n_rows)");
  CHECK_MESSAGE(written_ok, "dot_tile left an output unwritten or non-finite");
  return packed;
}

// The same product computed as four sub-tiles (rows split at r1, tokens at t1), packed as
// run_tile's result.
std::vector<float> run_split(GgmlType t, const std::vector<uint8_t>& w, int64_t n_rows,
                             const std::vector<uint8_t>& a, int64_t n_tok, int64_t n, int64_t r1,
                             int64_t t1) {
  std::vector<float> out(static_cast<size_t>(n_rows * n_tok),
                         std::numeric_limits<float>::quiet_NaN());
  const size_t wrb = row_bytes(t, n), arb = cpu::activation_row_bytes(t, n);
  const int64_t rs[3] = {0, r1, n_rows}, ts[3] = {0, t1, n_tok};
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      const int64_t nr = rs[i + 1] - rs[i], nt = ts[j + 1] - ts[j];
      if (nr == 0 || nt == 0) continue;
      cpu::dot_tile(t, w.data() + static_cast<size_t>(rs[i]) * wrb, nr,
                    a.data() + static_cast<size_t>(ts[j]) * arb, arb, nt, n,
                    out.data() + ts[j] * n_rows + rs[i], n_rows);
    }
  return out;
}

void check_shape(GgmlType t, int64_t n, int64_t n_rows, int64_t n_tok, uint64_t seed) {
  CAPTURE(type_name(t));
  CAPTURE(n);
  CAPTURE(n_rows);
  CAPTURE(n_tok);
  const std::vector<uint8_t> w = make_weights(t, n_rows, n, seed);
  const std::vector<float> x = gaussian(static_cast<size_t>(n_tok * n), seed + 1, 1.5f, 0.1f);
  // The reference activations and outputs, once per shape.
  const size_t arb = cpu::activation_row_bytes(t, n);
  std::vector<uint8_t> a_ref(arb * static_cast<size_t>(n_tok));
  for (int64_t k = 0; k < n_tok; ++k)
    ref::quantize_activation(t, x.data() + k * n, a_ref.data() + k * arb, n);
  std::vector<float> want(static_cast<size_t>(n_rows * n_tok));
  test::poison(want);
  ref::dot_tile(t, w.data(), n_rows, a_ref.data(), arb, n_tok, n, want.data(), n_rows);
  for_each_simd_target([&](const std::string&) {
    const std::vector<uint8_t> a = make_activations(t, x, n_tok, n);
    const std::vector<float> got = run_tile(t, w, n_rows, a, n_tok, n);
    const double e = nmse(want.data(), got.data(), got.size());
    CHECK(e <= tolerance(t));
    if (n_rows > 1 || n_tok > 1) {
      const std::vector<float> split = run_split(t, w, n_rows, a, n_tok, n, n_rows / 2, n_tok / 3);
      CHECK_MESSAGE(same_bits(got.data(), split.data(), got.size()),
                    "a tile split into sub-tiles differs from the whole tile");
    }
    if (n_tok > 1) {
      // Each token alone (the decode GEMV) gives the tile's bits (GEMM == GEMV).
      const size_t arb = cpu::activation_row_bytes(t, n);
      std::vector<float> one(static_cast<size_t>(n_rows));
      bool same = true;
      for (int64_t k = 0; k < n_tok; ++k) {
        test::poison(one);
        cpu::dot_tile(t, w.data(), n_rows, a.data() + static_cast<size_t>(k) * arb, arb, 1, n,
                      one.data(), n_rows);
        same = same && same_bits(one.data(), got.data() + k * n_rows, one.size());
      }
      CHECK_MESSAGE(same, "a token computed alone (GEMV) differs from the tile (GEMM)");
    }
  });
}

TEST_CASE("oracle: legacy and float dot_tile on every SIMD target") {
  // 1184 = 37 blocks: two full groups of 16 blocks (the AVX3_DL chain width) and an odd tail.
  const int64_t ns[] = {32, 64, 96, 1184, 4096};
  const int64_t rows[] = {1, 3, 17};
  const int64_t toks[] = {1, 2, 3, 7, 64};
  uint64_t seed = 1000;
  // BERTH_TEST_SHAPES=small (emulated wide SVE): no n = 4096, no 3 tokens, 64 tokens with 1 row.
  const bool small = test::small_shapes();
  const auto skip_small = [&](int64_t n, int64_t r, int64_t k) {
    return small && (n == 4096 || k == 3 || (k == 64 && r != 1));
  };
  for (const GgmlType t : kQuantTypes)
    for (const int64_t n : ns)
      for (const int64_t r : rows)
        for (const int64_t k : toks) {
          // Keep the largest shapes (and the ASan Debug run) cheap: n = 4096 with 64 tokens
          // only for one row count.
          if ((n == 4096 && k == 64 && r != 3) || skip_small(n, r, k)) continue;
          check_shape(t, n, r, k, seed += 7);
        }
  // Float weights: n need not be a multiple of 32; 37 and 1001 exercise the scalar tails.
  const int64_t fns[] = {32, 37, 96, 1001, 4096};
  for (const GgmlType t : kFloatTypes)
    for (const int64_t n : fns)
      for (const int64_t r : rows)
        for (const int64_t k : toks) {
          if ((n == 4096 && k == 64 && r != 3) || skip_small(n, r, k)) continue;
          check_shape(t, n, r, k, seed += 7);
        }
  // A prefill-sized tile of 512 tokens for one small shape per type.
  for (const GgmlType t : kQuantTypes) check_shape(t, 64, 3, 512, seed += 7);
  for (const GgmlType t : kFloatTypes) check_shape(t, 64, 3, 512, seed += 7);
}

TEST_CASE("oracle: Q8_0 activation quantization is bit exact, including ties and non-finite") {
  // Block 0: amax 127 so d = 1 and id = 1: x * id are the values themselves, with ties
  // (2.5, -3.5, 0.5, -0.5, 126.5) that round away from zero (C's roundf), not to even.
  // Block 1: all zeros (d = 0). Block 2: a NaN (ignored by amax, quantized to 0).
  // Block 3: an infinity (d = inf, id = 0: every quant 0). Blocks 4..7: Gaussian.
  const int64_t n = 8 * 32;
  std::vector<float> x = gaussian(static_cast<size_t>(n), 77, 2.0f);
  const float ties[] = {127.0f, 2.5f,  -3.5f, 0.5f,    -0.5f,
                        126.5f, -1.5f, 4.5f,  -126.5f, 0.49999997f};
  for (int j = 0; j < 32; ++j)
    x[static_cast<size_t>(j)] = j < 10 ? ties[j] : static_cast<float>(j % 7) - 3.0f;
  for (int j = 32; j < 64; ++j) x[static_cast<size_t>(j)] = 0.0f;
  x[70] = std::numeric_limits<float>::quiet_NaN();
  x[100] = -std::numeric_limits<float>::infinity();
  for (const GgmlType wt : kQuantTypes) {
    CAPTURE(type_name(wt));
    std::vector<uint8_t> want(cpu::activation_row_bytes(wt, n));
    ref::quantize_activation(wt, x.data(), want.data(), n);
    // The tie rule as stated, independently of the twin.
    const auto* q = reinterpret_cast<const int8_t*>(want.data() + 2);
    CHECK(q[1] == 3);
    CHECK(q[2] == -4);
    CHECK(q[3] == 1);
    CHECK(q[4] == -1);
    CHECK(q[5] == 127);
    CHECK(q[9] == 0);
    for_each_simd_target([&](const std::string&) {
      std::vector<uint8_t> got(want.size(), 0xCC);
      cpu::quantize_activation(wt, x.data(), got.data(), n);
      CHECK(got == want);
    });
  }
}

// Every weight and activation value is a small integer times a power of two, so every product,
// block sum and total is exact in float: each target and the twin must give the double result
// of the dequantized rows exactly. Quant bytes are random (all patterns, Q8_0's -128 included).
TEST_CASE("dot_tile is exact when every partial sum is representable") {
  const int64_t n = 256, n_rows = 5, n_tok = 6;
  std::mt19937_64 rng(4242);
  for (const GgmlType t : kQuantTypes) {
    CAPTURE(type_name(t));
    const TypeTraits& tr = traits(t);
    const size_t wrb = row_bytes(t, n);
    std::vector<uint8_t> w(wrb * n_rows);
    for (auto& b : w) b = static_cast<uint8_t>(rng());
    const bool has_min = t == GgmlType::Q4_1 || t == GgmlType::Q5_1;
    for (int64_t blk = 0; blk < n_rows * n / 32; ++blk) {
      uint8_t* p = w.data() + static_cast<size_t>(blk) * tr.block_bytes;
      const uint16_t d = f32_to_fp16(std::ldexp(1.0f, -static_cast<int>(rng() % 4)));
      std::memcpy(p, &d, 2);
      if (has_min) {
        const uint16_t m = f32_to_fp16(std::ldexp(static_cast<float>(rng() % 16) - 8.0f, -2));
        std::memcpy(p + 2, &m, 2);
      }
    }
    const size_t arb = cpu::activation_row_bytes(t, n);
    std::vector<uint8_t> a(arb * n_tok);
    for (int64_t blk = 0; blk < n_tok * n / 32; ++blk) {
      uint8_t* p = a.data() + static_cast<size_t>(blk) * 34;
      const uint16_t d = f32_to_fp16(std::ldexp(1.0f, -static_cast<int>(rng() % 3)));
      std::memcpy(p, &d, 2);
      for (int j = 0; j < 32; ++j)
        p[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(rng() % 255) - 127);
    }
    std::vector<float> wf(static_cast<size_t>(n_rows * n)), af(static_cast<size_t>(n_tok * n));
    ref::dequantize_rows(t, w.data(), wf.data(), n_rows, n);
    ref::dequantize_rows(GgmlType::Q8_0, a.data(), af.data(), n_tok, n);
    std::vector<float> exact(static_cast<size_t>(n_rows * n_tok));
    for (int64_t k = 0; k < n_tok; ++k)
      for (int64_t r = 0; r < n_rows; ++r) {
        double s = 0;
        for (int64_t i = 0; i < n; ++i) s += static_cast<double>(wf[r * n + i]) * af[k * n + i];
        exact[static_cast<size_t>(k * n_rows + r)] = static_cast<float>(s);
        REQUIRE(static_cast<double>(static_cast<float>(s)) == s);  // the premise of the test
      }
    std::vector<float> twin(exact.size());
    ref::dot_tile(t, w.data(), n_rows, a.data(), arb, n_tok, n, twin.data(), n_rows);
    CHECK(twin == exact);
    for_each_simd_target(
        [&](const std::string&) { CHECK(run_tile(t, w, n_rows, a, n_tok, n) == exact); });
  }
}

TEST_CASE("end to end: quantized activations stay close to the float product") {
  const int64_t n = 1024, n_rows = 8, n_tok = 5;
  uint64_t seed = 9000;
  for (const GgmlType t : kQuantTypes) {
    CAPTURE(type_name(t));
    const std::vector<uint8_t> w = make_weights(t, n_rows, n, seed += 3);
    const std::vector<float> x = gaussian(static_cast<size_t>(n_tok * n), seed + 1);
    std::vector<float> wf(static_cast<size_t>(n_rows * n));
    ref::dequantize_rows(t, w.data(), wf.data(), n_rows, n);
    std::vector<float> want(static_cast<size_t>(n_rows * n_tok));
    for (int64_t k = 0; k < n_tok; ++k)
      for (int64_t r = 0; r < n_rows; ++r) {
        double s = 0;
        for (int64_t i = 0; i < n; ++i) s += static_cast<double>(wf[r * n + i]) * x[k * n + i];
        want[static_cast<size_t>(k * n_rows + r)] = static_cast<float>(s);
      }
    for_each_simd_target([&](const std::string&) {
      const std::vector<uint8_t> a = make_activations(t, x, n_tok, n);
      const std::vector<float> got = run_tile(t, w, n_rows, a, n_tok, n);
      const double e = nmse(want.data(), got.data(), got.size());
      CHECK(e < kTolEndToEnd);
      CHECK(e > 0.0);  // the activations really were quantized
    });
  }
}

TEST_CASE("legacy and float dot products reject bad arguments") {
  std::vector<uint8_t> w(row_bytes(GgmlType::Q4_0, 64) * 2), a(34 * 2 * 2);
  std::vector<float> out(8), x(64, 1.0f);
  auto category = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return e.category();
    }
    return ErrorCategory::internal;  // no exception: fails the CHECKs below
  };
  // n not a multiple of the 32-element block.
  CHECK(category([&] {
          cpu::dot_tile(GgmlType::Q4_0, w.data(), 1, a.data(), 34, 1, 48, out.data(), 1);
        }) == ErrorCategory::invalid_argument);
  CHECK(category([&] { cpu::quantize_activation(GgmlType::Q8_0, x.data(), a.data(), 40); }) ==
        ErrorCategory::invalid_argument);
  // Overlapping outputs (out_stride < n_rows) and short activation strides.
  CHECK(category([&] {
          cpu::dot_tile(GgmlType::Q8_0, w.data(), 2, a.data(), 68, 2, 64, out.data(), 1);
        }) == ErrorCategory::invalid_argument);
  CHECK(category([&] {
          cpu::dot_tile(GgmlType::Q8_0, w.data(), 1, a.data(), 34, 2, 64, out.data(), 1);
        }) == ErrorCategory::invalid_argument);
  CHECK(category([&] {
          cpu::dot_tile(GgmlType::F16, w.data(), 2, x.data(), 16, 2, 16, out.data(), 2);
        }) == ErrorCategory::invalid_argument);
  CHECK(category([&] {
          cpu::dot_tile(GgmlType::F32, nullptr, 2, x.data(), 64, 1, 16, out.data(), 2);
        }) == ErrorCategory::invalid_argument);
  CHECK(category([&] {
          ref::dot_tile(GgmlType::Q5_1, w.data(), 1, a.data(), 34, 1, 40, out.data(), 1);
        }) == ErrorCategory::invalid_argument);
}

}  // namespace
}  // namespace berth
