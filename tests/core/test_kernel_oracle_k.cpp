// Oracle tests of the K-quant dot products (cpu_kernels/src/quant_dot_k.cc) against their scalar
// twins (quant_dot_k_ref.cpp, and ref::quantize_row for Q8_K): every weight type Q2_K..Q6_K,
// on every Highway target compiled in and supported by this CPU, over row lengths with one,
// two, eleven and sixteen super-blocks, 1, 3 and 17 weight rows and 1..512 tokens.
//  - Q8_K activation quantization: bit-identical to the reference, plus hand-checked values.
//  - dot_tile on the same quantized activations: NMSE against ref::dot_tile within the
//    tolerance below; outputs poisoned; out_stride > n_rows leaves the gaps untouched; any
//    split into sub-tiles (rows, tokens, single tokens) gives the same bits as one tile.
//  - 2..9, 15 and 17 tokens (the few-token kernels) give the one-token GEMV's bits, through
//    dot_tile and gemm_rows, at odd row counts.
//  - End to end (SIMD quantization + SIMD dot) against the double-precision product of the
//    dequantized weights and the float activations: NMSE below the Q8_K activation error.
// Weights come from ref::quantize_row of seeded random floats (realistic scales), with a few
// blocks overwritten by raw bytes (random, all ones) for extreme scales, mins and quants.
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
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
using test::poison;
using test::small_shapes;

constexpr GgmlType kTypes[] = {GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K,
                               GgmlType::Q6_K};

// SIMD dot vs ref::dot_tile on identical Q8_K activations. The integer part of every block is
// exact in both; the x86 kernels convert 8 partial integer lanes to float and accumulate the
// blocks in 8 float lanes (FMA) where the reference converts the block total and adds blocks
// in one float: a few float roundings per block, relative to the block values, not to the
// output. Pooled over all shapes of a type the NMSE is 6e-15..2.5e-14 (largest: Q2_K, whose min
// term nearly cancels the scale term); a single output whose blocks nearly cancel can reach a
// few 1e-11. Any wrong quant, scale or lane gives 1e-4 or more. The portable path (other
// targets) repeats the reference's float operations and is bit-identical to it.
constexpr double kTolVsRefPooled = 1e-11;  // per type, all shapes and targets together
constexpr double kTolVsRefShape = 1e-9;    // per shape and target
// End to end vs the exact product of the dequantized weights and the float activations: the
// Q8_K rounding error of the activations (step max|x| / 127 per 256 elements, variance
// step^2 / 12: ~5e-5 relative for Gaussian activations); pooled over all shapes of a type.
constexpr double kTolEndToEnd = 1e-4;

bool same_bits(const float* a, const float* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

// Offset of the f16 super-block scale (and min, where present) in a block of type t.
void set_block_scales(GgmlType t, uint8_t* blk, float d, float dmin) {
  const uint16_t hd = f32_to_fp16(d), hm = f32_to_fp16(dmin);
  auto put = [&](size_t off, uint16_t v) { std::memcpy(blk + off, &v, 2); };
  switch (t) {
    case GgmlType::Q2_K:
      put(offsetof(BlockQ2_K, d), hd);
      put(offsetof(BlockQ2_K, dmin), hm);
      break;
    case GgmlType::Q3_K:
      put(offsetof(BlockQ3_K, d), hd);
      break;
    case GgmlType::Q4_K:
      put(offsetof(BlockQ4_K, d), hd);
      put(offsetof(BlockQ4_K, dmin), hm);
      break;
    case GgmlType::Q5_K:
      put(offsetof(BlockQ5_K, d), hd);
      put(offsetof(BlockQ5_K, dmin), hm);
      break;
    default:
      put(offsetof(BlockQ6_K, d), hd);
      break;
  }
}

// n_rows quantized weight rows of n elements: Gaussian rows (with an offset, so the mins
// matter) quantized by the reference quantizer; then, where the matrix has them, block 0 of
// row 0 is all ones bytes (largest quants, scales and mins), block 1 of row 0 and block 0 of
// the last row are random bytes, all with finite f16 super-block scales.
std::vector<uint8_t> make_weights(GgmlType t, int64_t n_rows, int64_t n, uint64_t seed) {
  const size_t rb = row_bytes(t, n), bb = row_bytes(t, kQK_K);
  std::vector<uint8_t> w(rb * static_cast<size_t>(n_rows));
  for (int64_t r = 0; r < n_rows; ++r) {
    const std::vector<float> x =
        gaussian(static_cast<size_t>(n), seed + static_cast<uint64_t>(r), 0.05f, 0.01f);
    ref::quantize_row(t, x.data(), w.data() + static_cast<size_t>(r) * rb, n);
  }
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  std::memset(w.data(), 0xFF, bb);
  set_block_scales(t, w.data(), 0.01f, 0.02f);
  auto randomize = [&](uint8_t* blk) {
    for (size_t i = 0; i < bb; ++i) blk[i] = static_cast<uint8_t>(rng());
    set_block_scales(t, blk, 0.003f, 0.005f);
  };
  if (n / kQK_K > 1) randomize(w.data() + bb);
  if (n_rows > 1) randomize(w.data() + static_cast<size_t>(n_rows - 1) * rb);
  return w;
}

// n_tok activation rows of n floats: Gaussian, except every third token has values +-1 with
// random signs (every quant at +-127: the largest integer sums).
std::vector<float> make_activations(int64_t n_tok, int64_t n, uint64_t seed) {
  std::vector<float> x = gaussian(static_cast<size_t>(n_tok * n), seed);
  for (int64_t t = 2; t < n_tok; t += 3)
    for (int64_t i = 0; i < n; ++i) {
      float& v = x[static_cast<size_t>(t * n + i)];
      v = v < 0 ? -1.0f : 1.0f;
    }
  return x;
}

struct Shape {
  int64_t n, n_rows, n_tok;
};

std::vector<Shape> shapes() {
  std::vector<Shape> s;
  const bool small = small_shapes();
  for (const int64_t n : {256, 512, 2816, 4096})
    for (const int64_t rows : {1, 3, 17})
      for (const int64_t tok : {1, 2, 3, 7, 64}) {
        // 64 tokens with 1 and 3 rows of 1 and 11 super-blocks only (the largest products
        // would dominate the run time, and the suite must stay fast under ASan); 17 rows and
        // 16 super-blocks are covered with up to 7 tokens.
        if (tok == 64 && (rows == 17 || n == 512 || n == 4096)) continue;
        // Small: 1 and 11 super-blocks, 3 tokens only with 3 rows.
        if (small && (n == 512 || n == 4096 || (tok == 3 && rows != 3))) continue;
        s.push_back({n, rows, tok});
      }
  s.push_back({256, 3, 512});
  // Register tiles of the AVX3_DL GEMM (4 rows x 2 chunks of 16 tokens) with row and token
  // remainders: 17 rows = 4 x 4 + 1, 40 tokens = 32 + 8, 20 tokens = 16 + 4.
  s.push_back({2816, 17, 40});
  s.push_back({512, 8, 20});
  return s;
}

TEST_CASE("oracle K-quants: Q8_K activation quantization is bit-identical to the reference") {
  // Hand-checked block: the signed max is x[0] = -127, so iscale = -127 / -127 = 1, d = 1, and
  // the quants are x rounded half to even.
  std::vector<float> x = gaussian(kQK_K, 7, 30.0f);
  for (int i = 0; i < kQK_K; ++i) x[i] = std::fmod(x[i], 100.0f);
  x[0] = -127.0f;
  x[1] = 0.5f;
  x[2] = 1.5f;
  x[3] = 2.5f;
  x[4] = -0.5f;
  x[5] = -126.5f;
  x[6] = 127.0f;  // same magnitude as x[0] but later: x[0] stays the signed max
  for_each_simd_target([&](const std::string&) {
    BlockQ8_K b;
    std::memset(&b, 0x5A, sizeof(b));
    cpu::quantize_activation(GgmlType::Q4_K, x.data(), &b, kQK_K);
    CHECK(b.d == 1.0f);
    CHECK(b.qs[0] == -127);
    CHECK(b.qs[1] == 0);
    CHECK(b.qs[2] == 2);
    CHECK(b.qs[3] == 2);
    CHECK(b.qs[4] == 0);
    CHECK(b.qs[5] == -126);
    CHECK(b.qs[6] == 127);
    for (int g = 0; g < 16; ++g) {
      int sum = 0;
      for (int l = 0; l < 16; ++l) sum += b.qs[16 * g + l];
      CHECK(b.bsums[g] == sum);
    }
  });

  // Random rows of every tested length (plus a zero block, a block whose largest magnitude is
  // positive and ties of magnitude with opposite signs): same bytes as the reference.
  for (const int64_t n : {256, 512, 2816, 4096}) {
    CAPTURE(n);
    std::vector<float> xs = gaussian(static_cast<size_t>(n), 11 + static_cast<uint64_t>(n), 2.0f);
    xs[3] = 40.0f;  // block 0: positive signed max
    if (n >= 512) {
      for (int i = 256; i < 512; ++i) xs[static_cast<size_t>(i)] = 0.0f;  // block 1: zeros
    }
    if (n >= 1024) {
      xs[512 + 9] = -33.0f;  // block 2: -33 first, then +33
      xs[512 + 200] = 33.0f;
    }
    const size_t bytes = row_bytes(GgmlType::Q8_K, n);
    std::vector<uint8_t> want(bytes);
    ref::quantize_activation(GgmlType::Q6_K, xs.data(), want.data(), n);
    for_each_simd_target([&](const std::string&) {
      std::vector<uint8_t> got(bytes, 0xA5);
      cpu::quantize_activation(GgmlType::Q6_K, xs.data(), got.data(), n);
      CHECK(std::memcmp(got.data(), want.data(), bytes) == 0);
    });
  }
}

TEST_CASE("oracle K-quants: dot_tile against the scalar twin, tiling, strides, end to end") {
  const std::vector<Shape> all = shapes();
  for (const GgmlType t : kTypes) {
    CAPTURE(type_name(t));
    // Pooled squared errors (SIMD end to end, reference dot) and squared exact products.
    double e2e_num = 0, e2e_den = 0, ref_num = 0, ref_den = 0;
    double vs_num = 0, vs_den = 0;  // SIMD vs reference dot, pooled
    uint64_t seed = 1000 * static_cast<uint64_t>(t);
    for (const Shape& s : all) {
      CAPTURE(s.n);
      CAPTURE(s.n_rows);
      CAPTURE(s.n_tok);
      ++seed;
      const std::vector<uint8_t> w = make_weights(t, s.n_rows, s.n, seed);
      const std::vector<float> x = make_activations(s.n_tok, s.n, seed + 500);
      const size_t arb = cpu::activation_row_bytes(t, s.n);
      REQUIRE(arb == row_bytes(GgmlType::Q8_K, s.n));
      // Activations quantized once by the reference: SIMD and reference dot see the same bytes.
      std::vector<uint8_t> act(arb * static_cast<size_t>(s.n_tok));
      for (int64_t k = 0; k < s.n_tok; ++k)
        ref::quantize_activation(t, x.data() + k * s.n, act.data() + static_cast<size_t>(k) * arb,
                                 s.n);

      const int64_t os = s.n_rows + 3;  // out_stride with a 3-float gap after each token
      const size_t out_n = static_cast<size_t>(s.n_tok * os);
      const size_t dense_n = static_cast<size_t>(s.n_tok * s.n_rows);
      auto dense = [&](const std::vector<float>& o) {
        std::vector<float> d(dense_n);
        for (int64_t k = 0; k < s.n_tok; ++k)
          for (int64_t r = 0; r < s.n_rows; ++r)
            d[static_cast<size_t>(k * s.n_rows + r)] = o[static_cast<size_t>(k * os + r)];
        return d;
      };
      std::vector<float> want(out_n);
      poison(want);
      ref::dot_tile(t, w.data(), s.n_rows, act.data(), arb, s.n_tok, s.n, want.data(), os);
      const std::vector<float> want_d = dense(want);

      // Exact product of the dequantized weights and the float activations (double sums).
      std::vector<float> wf(static_cast<size_t>(s.n_rows * s.n));
      ref::dequantize_rows(t, w.data(), wf.data(), s.n_rows, s.n);
      std::vector<float> exact(dense_n);
      for (int64_t k = 0; k < s.n_tok; ++k)
        for (int64_t r = 0; r < s.n_rows; ++r) {
          double acc = 0;
          for (int64_t i = 0; i < s.n; ++i)
            acc += static_cast<double>(wf[static_cast<size_t>(r * s.n + i)]) *
                   x[static_cast<size_t>(k * s.n + i)];
          exact[static_cast<size_t>(k * s.n_rows + r)] = static_cast<float>(acc);
          ref_den += acc * acc;
        }
      // The reference dot itself is within the activation-quantization error (pooled below).
      for (size_t i = 0; i < dense_n; ++i) {
        const double d = static_cast<double>(want_d[i]) - exact[i];
        ref_num += std::isfinite(want_d[i]) ? d * d : 1e30;
      }

      bool first_target = true;
      for_each_simd_target([&](const std::string&) {
        const float kGap = -7777.0f;
        std::vector<float> got(out_n, kGap);
        for (int64_t k = 0; k < s.n_tok; ++k)
          for (int64_t r = 0; r < s.n_rows; ++r)
            got[static_cast<size_t>(k * os + r)] = std::numeric_limits<float>::quiet_NaN();
        cpu::dot_tile(t, w.data(), s.n_rows, act.data(), arb, s.n_tok, s.n, got.data(), os);
        const std::vector<float> got_d = dense(got);
        CHECK(nmse(want_d.data(), got_d.data(), dense_n) <= kTolVsRefShape);
        for (size_t i = 0; i < dense_n; ++i) {
          const double d = static_cast<double>(got_d[i]) - want_d[i];
          vs_num += std::isfinite(got_d[i]) ? d * d : 1e30;
          vs_den += static_cast<double>(want_d[i]) * want_d[i];
        }
        bool gaps_ok = true;
        for (int64_t k = 0; k < s.n_tok; ++k)
          for (int64_t r = s.n_rows; r < os; ++r)
            gaps_ok = gaps_ok && got[static_cast<size_t>(k * os + r)] == kGap;
        CHECK(gaps_ok);

        // Sub-tiles: rows split at r1, tokens split at t1, give the same bits as one tile.
        const int64_t r1 = s.n_rows / 2, t1 = (s.n_tok + 1) / 2;
        std::vector<float> sub(out_n, kGap);
        const size_t wrb = row_bytes(t, s.n);
        for (const auto& [r0, nr] : {std::pair{int64_t{0}, r1}, std::pair{r1, s.n_rows - r1}})
          for (const auto& [k0, nk] : {std::pair{int64_t{0}, t1}, std::pair{t1, s.n_tok - t1}}) {
            if (nr == 0 || nk == 0) continue;
            cpu::dot_tile(t, w.data() + static_cast<size_t>(r0) * wrb, nr,
                          act.data() + static_cast<size_t>(k0) * arb, arb, nk, s.n,
                          sub.data() + k0 * os + r0, os);
          }
        CHECK(same_bits(got.data(), sub.data(), out_n));
        // One token at a time (the decode GEMV), each into a dense output.
        bool gemv_same = true;
        std::vector<float> one(static_cast<size_t>(s.n_rows));
        for (int64_t k = 0; k < s.n_tok; ++k) {
          poison(one);
          cpu::dot_tile(t, w.data(), s.n_rows, act.data() + static_cast<size_t>(k) * arb, arb, 1,
                        s.n, one.data(), s.n_rows);
          gemv_same = gemv_same &&
                      same_bits(one.data(), got.data() + k * os, static_cast<size_t>(s.n_rows));
        }
        CHECK(gemv_same);

        // End to end with the SIMD quantizer (pooled per type, checked below).
        if (first_target || s.n_tok <= 7) {
          std::vector<uint8_t> act2(act.size());
          for (int64_t k = 0; k < s.n_tok; ++k)
            cpu::quantize_activation(t, x.data() + k * s.n,
                                     act2.data() + static_cast<size_t>(k) * arb, s.n);
          std::vector<float> e2e(dense_n);
          poison(e2e);
          cpu::dot_tile(t, w.data(), s.n_rows, act2.data(), arb, s.n_tok, s.n, e2e.data(),
                        s.n_rows);
          for (size_t i = 0; i < dense_n; ++i) {
            const double d = static_cast<double>(e2e[i]) - exact[i];
            e2e_num += std::isfinite(e2e[i]) ? d * d : 1e30;
            e2e_den += static_cast<double>(exact[i]) * exact[i];
          }
        }
        first_target = false;
      });
    }
    const double e2e = e2e_num / e2e_den;
    CAPTURE(e2e);
    CHECK(e2e <= kTolEndToEnd);
    CHECK(ref_num / ref_den <= kTolEndToEnd);
    const double vs_ref = vs_num / vs_den;
    CAPTURE(vs_ref);
    CHECK(vs_ref <= kTolVsRefPooled);
  }
}

// The few-token kernels (2..8 tokens per pass over the rows; AVX3_DL's FewTokDL, which reduces
// 4 tokens' block integers together) against the one-token GEMV, bit for bit, through both
// entry points: every K type, row lengths of 1, 8 and 17 super-blocks (prefetch and slice
// edges), odd row counts (one over 64: row blocks of several slices), 2..9 tokens plus 15 and 17
// (whole 8-token slices and a remainder), tokens with very different scales (every third one +-1),
// output gaps left untouched.
TEST_CASE("oracle K-quants: 2..17 tokens give the one-token GEMV's bits, per token") {
  for (const GgmlType t : kTypes) {
    CAPTURE(type_name(t));
    uint64_t seed = 7000 + 100 * static_cast<uint64_t>(t);
    for (const int64_t n : {256, 2048, 4352})
      for (const int64_t rows : {1, 5, 67}) {  // 67: two 64-row blocks, odd
        // Small shapes: 4352 (17 super-blocks) only with 1 row, 67 rows only with 256.
        if (small_shapes() && ((n == 4352 && rows > 1) || (rows == 67 && n > 256))) continue;
        CAPTURE(n);
        CAPTURE(rows);
        ++seed;
        constexpr int64_t kMaxTok = 17;
        const std::vector<uint8_t> w = make_weights(t, rows, n, seed);
        const std::vector<float> x = make_activations(kMaxTok, n, seed + 1);
        const size_t arb = cpu::activation_row_bytes(t, n);
        std::vector<uint8_t> act(arb * static_cast<size_t>(kMaxTok));
        for (int64_t k = 0; k < kMaxTok; ++k)
          cpu::quantize_activation(t, x.data() + k * n, act.data() + static_cast<size_t>(k) * arb,
                                   n);
        for_each_simd_target([&](const std::string&) {
          // The one-token GEMV of each token, dense.
          std::vector<float> one(static_cast<size_t>(kMaxTok * rows));
          poison(one);
          for (int64_t k = 0; k < kMaxTok; ++k)
            cpu::dot_tile(t, w.data(), rows, act.data() + static_cast<size_t>(k) * arb, arb, 1, n,
                          one.data() + k * rows, rows);
          bool finite = true;
          for (const float v : one) finite = finite && std::isfinite(v);
          CHECK(finite);
          const int64_t os = rows + 2;  // a 2-float gap after each token's outputs
          const float kGap = -5555.0f;
          for (const int64_t n_tok : {2, 3, 4, 5, 6, 7, 8, 9, 15, 17}) {
            CAPTURE(n_tok);
            for (const bool via_gemm_rows : {false, true}) {
              CAPTURE(via_gemm_rows);
              std::vector<float> got(static_cast<size_t>(n_tok * os), kGap);
              for (int64_t k = 0; k < n_tok; ++k)
                for (int64_t r = 0; r < rows; ++r)
                  got[static_cast<size_t>(k * os + r)] = std::numeric_limits<float>::quiet_NaN();
              if (via_gemm_rows)
                cpu::gemm_rows(t, w.data(), rows, act.data(), arb, n_tok, n, got.data(), os);
              else
                cpu::dot_tile(t, w.data(), rows, act.data(), arb, n_tok, n, got.data(), os);
              bool same = true, gaps = true;
              for (int64_t k = 0; k < n_tok; ++k) {
                same = same && same_bits(got.data() + k * os, one.data() + k * rows,
                                         static_cast<size_t>(rows));
                gaps = gaps && got[static_cast<size_t>(k * os + rows)] == kGap &&
                       got[static_cast<size_t>(k * os + rows + 1)] == kGap;
              }
              CHECK(same);
              CHECK(gaps);
            }
          }
        });
      }
  }
}

TEST_CASE("oracle K-quants: argument errors") {
  std::vector<uint8_t> w(row_bytes(GgmlType::Q4_K, 512)), a(row_bytes(GgmlType::Q8_K, 512));
  std::vector<float> x(512, 1.0f), out(4);
  auto category = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return e.category();
    }
    return ErrorCategory::internal;  // no throw: reported as a mismatch below
  };
  CHECK(category([&] {
          cpu::dot_tile(GgmlType::Q4_K, w.data(), 1, a.data(), a.size(), 1, 300, out.data(), 1);
        }) == ErrorCategory::invalid_argument);
  CHECK(category([&] {
          cpu::dot_tile(GgmlType::Q6_K, w.data(), -1, a.data(), a.size(), 1, 256, out.data(), 1);
        }) == ErrorCategory::invalid_argument);
  CHECK(category([&] { cpu::quantize_activation(GgmlType::Q2_K, x.data(), a.data(), 100); }) ==
        ErrorCategory::invalid_argument);
  CHECK_THROWS_AS(cpu::detail::dot_tile_k(GgmlType::Q8_0, w.data(), 1, a.data(), a.size(), 1, 256,
                                          out.data(), 1),
                  Error);
}

}  // namespace
}  // namespace berth
