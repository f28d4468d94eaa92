// Oracle tests of the SIMD forward ops (berth::cpu, ops_simd.cc) against their scalar twins
// (berth::ref, ops.cpp): every op on every Highway target compiled in and supported by this CPU,
// by NMSE with the tolerance written next to each op; inputs from seeded generators, outputs
// poisoned with NaN before each run. Also the attention invariants the runtime relies on: the
// tiled prefill equals decode attention per query and does not depend on how a prompt is split,
// bit for bit on each target.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "berth/cpu_kernels/ops.h"
#include "core/kernel_harness.h"

namespace berth {
namespace {

using test::for_each_simd_target;
using test::gaussian;
using test::nmse;
using test::poison;

// Tolerances (NMSE = sum (simd - ref)^2 / sum ref^2), each with its reason. The twins sum in
// double, so these bound the SIMD kernels' own rounding. Measured maxima on AVX2/AVX3/SCALAR
// are noted; each bound leaves one to two orders of magnitude of margin.
// add: one IEEE addition per element in both: exact.
constexpr double kTolAdd = 0.0;
// rms_norm: both sum squares in double (in another order), so the float scale matches to
// within one rounding and the products are the same (measured 0).
constexpr double kTolRmsNorm = 1e-13;
// rope: a*c - b*s with FMA (one rounding instead of two) (measured ~1e-15).
constexpr double kTolRope = 1e-13;
// swiglu: Highway's polynomial Exp (<= 1 ULP, hwy/contrib/math/math-inl.h) instead of libm's
// expf; the error is damped by 1 / (1 + e) (measured ~2e-17).
constexpr double kTolSwiglu = 1e-13;
// softmax: the same Exp, and the denominator summed in float lanes per 1024-element block
// (measured ~2e-14 at n = 1e5).
constexpr double kTolSoftmax = 1e-12;
// attention: Exp as above, float dot products over head_dim in lanes, float weighted sums of
// <= 64 terms per KV tile, and the online softmax's rescaling once per tile (measured ~1e-12
// at n_kv = 2000-4000 on SCALAR, less on wider targets).
constexpr double kTolAttention = 1e-10;

bool same_bits(const float* a, const float* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

TEST_CASE("oracle: add, swiglu, softmax, rms_norm on every SIMD target") {
  const int64_t sizes[] = {1, 7, 64, 100, 4096};
  for (const int64_t n : sizes) {
    CAPTURE(n);
    const size_t un = static_cast<size_t>(n);
    const std::vector<float> a = gaussian(un, 100 + un);
    const std::vector<float> b = gaussian(un, 200 + un, 2.0f, 0.5f);
    // Gates with a wide spread, plus values past the exp cap (|g| > 88) when there is room.
    std::vector<float> gate = gaussian(un, 300 + un, 4.0f);
    if (n >= 7) {
      gate[1] = -100.0f;
      gate[3] = 95.0f;
      gate[5] = -88.5f;
    }
    // Logits with a spread like a router's, some masked with -inf.
    std::vector<float> logits = gaussian(un, 400 + un, 3.0f);
    if (n >= 7) logits[2] = logits[6] = -std::numeric_limits<float>::infinity();
    const std::vector<float> w = gaussian(un, 500 + un, 0.3f, 1.0f);

    std::vector<float> r_add(un), r_swiglu(un), r_softmax(un), r_norm(un), r_norm_nw(un);
    ref::add(a.data(), b.data(), r_add.data(), n);
    ref::swiglu(gate.data(), b.data(), r_swiglu.data(), n);
    ref::softmax(logits.data(), r_softmax.data(), n);
    ref::rms_norm(a.data(), w.data(), r_norm.data(), n, 1e-6f);
    ref::rms_norm(b.data(), nullptr, r_norm_nw.data(), n, 1e-5f);

    for_each_simd_target([&](const std::string&) {
      std::vector<float> out(un);
      poison(out);
      cpu::add(a.data(), b.data(), out.data(), n);
      CHECK(nmse(r_add.data(), out.data(), un) <= kTolAdd);

      poison(out);
      cpu::swiglu(gate.data(), b.data(), out.data(), n);
      CHECK(nmse(r_swiglu.data(), out.data(), un) <= kTolSwiglu);
      if (n >= 7) {
        CHECK(std::fabs(out[1]) < 1e-30f);                            // silu(-100) ~ -4e-42
        CHECK(out[3] == doctest::Approx(95.0 * b[3]).epsilon(1e-6));  // silu(95) = 95
      }

      poison(out);
      cpu::softmax(logits.data(), out.data(), n);
      CHECK(nmse(r_softmax.data(), out.data(), un) <= kTolSoftmax);
      if (n >= 7) CHECK((out[2] == 0.0f && out[6] == 0.0f));
      double total = 0;
      for (const float p : out) total += p;
      CHECK(total == doctest::Approx(1.0).epsilon(1e-5));

      poison(out);
      cpu::rms_norm(a.data(), w.data(), out.data(), n, 1e-6f);
      CHECK(nmse(r_norm.data(), out.data(), un) <= kTolRmsNorm);

      poison(out);
      cpu::rms_norm(b.data(), nullptr, out.data(), n, 1e-5f);
      CHECK(nmse(r_norm_nw.data(), out.data(), un) <= kTolRmsNorm);

      // In place (y == x), as the runtime may call it.
      std::vector<float> inplace = a;
      cpu::rms_norm(inplace.data(), w.data(), inplace.data(), n, 1e-6f);
      CHECK(nmse(r_norm.data(), inplace.data(), un) <= kTolRmsNorm);
      inplace = logits;
      cpu::softmax(inplace.data(), inplace.data(), n);
      CHECK(nmse(r_softmax.data(), inplace.data(), un) <= kTolSoftmax);
    });
  }
}

TEST_CASE("oracle: softmax of equal logits is uniform") {
  for_each_simd_target([&](const std::string&) {
    std::vector<float> x(37, 2.5f), y(37);
    poison(y);
    cpu::softmax(x.data(), y.data(), 37);
    for (const float p : y) CHECK(p == doctest::Approx(1.0 / 37).epsilon(1e-6));
  });
}

TEST_CASE("oracle: rope (NeoX and adjacent pairs) on every SIMD target") {
  const int32_t n_head = 3;
  const int32_t head_dims[] = {8, 64, 80, 128};
  for (const int32_t head_dim : head_dims) {
    for (const int32_t n_rot : {head_dim, head_dim / 2, 2}) {
      for (const bool adjacent : {false, true}) {
        CAPTURE(head_dim);
        CAPTURE(n_rot);
        CAPTURE(adjacent);
        const size_t n = static_cast<size_t>(n_head) * head_dim;
        const std::vector<float> x = gaussian(n, 600 + n + n_rot);
        const int32_t half = n_rot / 2;
        std::vector<float> cs(static_cast<size_t>(n_rot));
        const double pos = 1234;  // large angles, as late in a long context
        for (int32_t i = 0; i < half; ++i) {
          const double theta = pos * std::pow(10000.0, -2.0 * i / n_rot);
          cs[static_cast<size_t>(i)] = static_cast<float>(std::cos(theta));
          cs[static_cast<size_t>(half + i)] = static_cast<float>(std::sin(theta));
        }
        std::vector<float> expect = x;
        ref::rope_inplace(expect.data(), n_head, head_dim, n_rot, cs.data(), cs.data() + half,
                          adjacent);
        for_each_simd_target([&](const std::string&) {
          std::vector<float> got = x;
          cpu::rope_inplace(got.data(), n_head, head_dim, n_rot, cs.data(), cs.data() + half,
                            adjacent);
          CHECK(nmse(expect.data(), got.data(), n) <= kTolRope);
          // Dims past n_rot are untouched.
          for (int32_t h = 0; h < n_head; ++h)
            CHECK(same_bits(x.data() + h * head_dim + n_rot, got.data() + h * head_dim + n_rot,
                            static_cast<size_t>(head_dim - n_rot)));
        });
      }
    }
  }
}

// A KV cache like the runtime's: rows of n_head_kv heads, this head's slice at `head` * head_dim.
struct Kv {
  int64_t stride;
  std::vector<float> k, v;
  const float* kh() const { return k.data() + kOffset; }
  const float* vh() const { return v.data() + kOffset; }
  static constexpr int64_t kOffset = 3;  // odd offset: unaligned rows
};

Kv make_kv(int64_t n_pos, int32_t head_dim, uint64_t seed) {
  Kv kv;
  kv.stride = 2 * head_dim + 5;
  const size_t n = static_cast<size_t>(n_pos * kv.stride + Kv::kOffset + head_dim);
  kv.k = gaussian(n, seed);
  kv.v = gaussian(n, seed + 1);
  return kv;
}

TEST_CASE("oracle: decode attention (attention_head, attention_group) on every SIMD target") {
  const int32_t head_dims[] = {8, 36, 64, 80, 128};
  const int64_t kv_lens[] = {1, 5, 63, 64, 65, 300, 2000};
  for (const int32_t head_dim : head_dims) {
    const Kv kv = make_kv(head_dim == 128 ? 2000 : 300, head_dim, 700 + head_dim);
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    for (const float q_sd : {1.0f, 4.0f}) {  // 4: peaked softmax (scores up to ~+-15)
      const int64_t n_q = 7;                 // a GQA group of 7 heads
      const size_t q_stride = static_cast<size_t>(head_dim) + 1;
      const std::vector<float> q = gaussian(n_q * q_stride, 800 + head_dim, q_sd);
      for (const int64_t n_kv : kv_lens) {
        if (n_kv == 2000 && (head_dim != 128 || q_sd != 1.0f)) continue;  // long context once
        CAPTURE(head_dim);
        CAPTURE(n_kv);
        CAPTURE(q_sd);
        const size_t hd = static_cast<size_t>(head_dim);
        std::vector<float> scores(static_cast<size_t>(n_kv));
        std::vector<float> expect(n_q * hd);
        ref::attention_group(q.data(), q_stride, n_q, n_kv, kv.kh(), kv.stride, kv.vh(), kv.stride,
                             head_dim, scale, expect.data(), head_dim, scores.data());
        for_each_simd_target([&](const std::string&) {
          std::vector<float> got(n_q * hd), one(hd);
          poison(got);
          cpu::attention_group(q.data(), q_stride, n_q, n_kv, kv.kh(), kv.stride, kv.vh(),
                               kv.stride, head_dim, scale, got.data(), head_dim, scores.data());
          CHECK(nmse(expect.data(), got.data(), got.size()) <= kTolAttention);
          for (int64_t i = 0; i < n_q; ++i) {
            CAPTURE(i);
            poison(one);
            cpu::attention_head(q.data() + i * q_stride, kv.kh(), kv.stride, kv.vh(), kv.stride,
                                n_kv, head_dim, scale, one.data(), scores.data());
            CHECK(nmse(expect.data() + i * hd, one.data(), hd) <= kTolAttention);
            CHECK(same_bits(got.data() + i * hd, one.data(), hd));
          }
        });
      }
    }
  }
}

TEST_CASE("oracle: one key gives its value exactly; equal keys average the values") {
  const int32_t head_dim = 64;
  const Kv kv = make_kv(4, head_dim, 900);
  const std::vector<float> q = gaussian(head_dim, 901);
  for_each_simd_target([&](const std::string&) {
    std::vector<float> out(head_dim);
    poison(out);
    cpu::attention_head(q.data(), kv.kh(), kv.stride, kv.vh(), kv.stride, 1, head_dim, 0.125f,
                        out.data(), nullptr);
    CHECK(same_bits(out.data(), kv.vh(), head_dim));
    // Three copies of one key: weights 1/3 each.
    std::vector<float> k3(3 * head_dim), v3 = gaussian(3 * head_dim, 902);
    for (int r = 0; r < 3; ++r)
      std::memcpy(k3.data() + r * head_dim, kv.kh(), head_dim * sizeof(float));
    poison(out);
    cpu::attention_head(q.data(), k3.data(), head_dim, v3.data(), head_dim, 3, head_dim, 0.125f,
                        out.data(), nullptr);
    for (int d = 0; d < head_dim; ++d)
      CHECK(out[d] ==
            doctest::Approx((v3[d] + v3[head_dim + d] + v3[2 * head_dim + d]) / 3.0).epsilon(1e-5));
  });
}

TEST_CASE("oracle: tiled causal prefill attention on every SIMD target") {
  const int32_t head_dims[] = {8, 64, 80, 128};
  const int64_t q_counts[] = {1, 3, 64, 130};
  const int64_t q_pos0s[] = {0, 61, 200};
  for (const int32_t head_dim : head_dims) {
    const size_t hd = static_cast<size_t>(head_dim);
    const Kv kv = make_kv(200 + 130, head_dim, 1000 + head_dim);
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    const int64_t q_stride = 3 * head_dim + 1;  // queries of one head inside [tokens, n_head*hd]
    const int64_t out_stride = head_dim + 2;
    const std::vector<float> q =
        gaussian(static_cast<size_t>(130 * q_stride), 1100 + head_dim, 2.0f);
    for (const int64_t n_q : q_counts) {
      for (const int64_t q_pos0 : q_pos0s) {
        // Keep the suite fast under ASan: the largest shapes only where they add coverage.
        if (n_q == 130 && (q_pos0 == 200 || (head_dim != 64 && head_dim != 128))) continue;
        CAPTURE(head_dim);
        CAPTURE(n_q);
        CAPTURE(q_pos0);
        const size_t n_out = static_cast<size_t>(n_q * out_stride);
        std::vector<float> scratch(static_cast<size_t>(q_pos0 + n_q));
        std::vector<float> expect(n_out, 0.0f);
        ref::attention_causal_tile(q.data(), q_stride, n_q, q_pos0, kv.kh(), kv.stride, kv.vh(),
                                   kv.stride, head_dim, scale, expect.data(), out_stride,
                                   scratch.data());
        for_each_simd_target([&](const std::string&) {
          std::vector<float> got(n_out);
          poison(got);
          cpu::attention_causal_tile(q.data(), q_stride, n_q, q_pos0, kv.kh(), kv.stride, kv.vh(),
                                     kv.stride, head_dim, scale, got.data(), out_stride,
                                     scratch.data());
          for (int64_t i = 0; i < n_q; ++i) {
            CAPTURE(i);
            const size_t o = static_cast<size_t>(i * out_stride);
            CHECK(nmse(expect.data() + o, got.data() + o, hd) <= kTolAttention);
            // The gap between output rows is not written.
            if (i + 1 < n_q) CHECK(std::isnan(got[o + hd]));
          }
          // Each query equals decode attention over its prefix, bit for bit.
          std::vector<float> one(hd);
          for (int64_t i = 0; i < n_q; ++i) {
            CAPTURE(i);
            poison(one);
            cpu::attention_head(q.data() + i * q_stride, kv.kh(), kv.stride, kv.vh(), kv.stride,
                                q_pos0 + i + 1, head_dim, scale, one.data(), nullptr);
            CHECK(same_bits(got.data() + i * out_stride, one.data(), hd));
          }
          // Splitting the queries into ubatches of other sizes changes no bit.
          if (n_q >= 3) {
            std::vector<float> split(n_out);
            poison(split);
            const int64_t cuts[] = {0, 1, n_q / 2 + 1, n_q};
            for (int c = 0; c < 3; ++c) {
              const int64_t i0 = cuts[c], n = cuts[c + 1] - cuts[c];
              cpu::attention_causal_tile(q.data() + i0 * q_stride, q_stride, n, q_pos0 + i0,
                                         kv.kh(), kv.stride, kv.vh(), kv.stride, head_dim, scale,
                                         split.data() + i0 * out_stride, out_stride, nullptr);
            }
            for (int64_t i = 0; i < n_q; ++i)
              CHECK(same_bits(got.data() + i * out_stride, split.data() + i * out_stride, hd));
          }
        });
      }
    }
  }
}

}  // namespace
}  // namespace berth
