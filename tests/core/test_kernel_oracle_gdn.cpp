// Oracle tests of the Gated DeltaNet and gated-attention kernels (berth::cpu, gdn_simd.cc)
// against their scalar twins (berth::ref, gdn_ref.cpp): every kernel on every Highway target
// compiled in and supported by this CPU, by NMSE with the tolerance written next to each kernel;
// inputs from seeded generators, outputs poisoned with NaN before each run. Also the properties
// the runtime relies on, bit for bit on each target: a prefill over T tokens equals T decode
// steps, and splitting channels, state columns or tokens across calls changes nothing. Small
// hand-computed cases pin the formulas themselves (the twins could share a mistake).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "berth/cpu_kernels/gdn.h"
#include "core/kernel_harness.h"

namespace berth {
namespace {

using test::for_each_simd_target;
using test::gaussian;
using test::nmse;
using test::poison;

// Tolerances (NMSE = sum (simd - ref)^2 / sum ref^2). The twins evaluate sums and
// transcendental functions in double, so these bound the SIMD kernels' own rounding.
// silu, sigmoid_gate: Highway's Exp (<= 1 ULP) and one division (measured <= 4e-15).
constexpr double kTolElementwise = 1e-13;
// l2_norm: both sum squares in double; the float scale matches to within one rounding (measured
// <= 1e-15).
constexpr double kTolL2Norm = 1e-13;
// rms_norm_gated: as rms_norm, times silu(z) through Exp (measured <= 1.1e-14).
constexpr double kTolNormGated = 1e-12;
// gdn_gates: Exp and Log1p polynomials for softplus, Exp for the sigmoid (measured <= 1e-14).
constexpr double kTolGates = 1e-12;
// conv1d: <= 8 products summed by FMA in float (the twin in double), then silu; NMSE over a
// whole [T, C] output (measured <= 2.5e-14).
constexpr double kTolConv = 1e-12;
// delta rule: float FMA dot products over d_k for S^T k and S^T q, the fused output form, and
// the state rounded to f32 after each token in both (measured <= 2.2e-13, 70 tokens).
constexpr double kTolDelta = 1e-10;

bool same_bits(const float* a, const float* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

std::vector<float> uniform(size_t n, uint64_t seed, float lo, float hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

TEST_CASE("oracle: silu, sigmoid_gate, l2_norm, rms_norm_gated on every SIMD target") {
  for (const int64_t n : {1, 7, 64, 100, 128, 4096}) {
    CAPTURE(n);
    const size_t un = static_cast<size_t>(n);
    std::vector<float> x = gaussian(un, 10 + un, 3.0f);
    const std::vector<float> z = gaussian(un, 20 + un, 2.0f);
    std::vector<float> gate = gaussian(un, 30 + un, 4.0f);
    if (n >= 7) {  // past the exp cap in both directions
      x[2] = -100.0f;
      x[4] = 95.0f;
      gate[1] = -100.0f;
      gate[3] = 95.0f;
    }
    const std::vector<float> w = gaussian(un, 40 + un, 0.3f, 1.0f);
    std::vector<float> r_silu(un), r_gate(un), r_l2(un), r_ng(un);
    ref::silu(x.data(), r_silu.data(), n);
    ref::sigmoid_gate(z.data(), gate.data(), r_gate.data(), n);
    ref::l2_norm(x.data(), r_l2.data(), n, 1e-6f);
    ref::rms_norm_gated(x.data(), w.data(), z.data(), r_ng.data(), n, 1e-6f);
    double norm2 = 0;
    for (const float v : r_l2) norm2 += static_cast<double>(v) * v;
    CHECK(norm2 == doctest::Approx(1.0).epsilon(1e-6));  // the twin's own check

    for_each_simd_target([&](const std::string&) {
      std::vector<float> out(un);
      poison(out);
      cpu::silu(x.data(), out.data(), n);
      CHECK(nmse(r_silu.data(), out.data(), un) <= kTolElementwise);
      if (n >= 7) {
        CHECK(std::fabs(out[2]) < 1e-30f);  // silu(-100) ~ -4e-42
        CHECK(out[4] == 95.0f);             // silu(95) = 95 in float
      }
      poison(out);
      cpu::sigmoid_gate(z.data(), gate.data(), out.data(), n);
      CHECK(nmse(r_gate.data(), out.data(), un) <= kTolElementwise);
      if (n >= 7) {
        CHECK(std::fabs(out[1]) < 1e-30f);
        CHECK(out[3] == z[3]);
      }
      poison(out);
      cpu::l2_norm(x.data(), out.data(), n, 1e-6f);
      CHECK(nmse(r_l2.data(), out.data(), un) <= kTolL2Norm);
      poison(out);
      cpu::rms_norm_gated(x.data(), w.data(), z.data(), out.data(), n, 1e-6f);
      CHECK(nmse(r_ng.data(), out.data(), un) <= kTolNormGated);

      // In place, as the runtime may call them.
      std::vector<float> io = x;
      cpu::silu(io.data(), io.data(), n);
      CHECK(nmse(r_silu.data(), io.data(), un) <= kTolElementwise);
      io = z;
      cpu::sigmoid_gate(io.data(), gate.data(), io.data(), n);
      CHECK(nmse(r_gate.data(), io.data(), un) <= kTolElementwise);
      io = x;
      cpu::l2_norm(io.data(), io.data(), n, 1e-6f);
      CHECK(nmse(r_l2.data(), io.data(), un) <= kTolL2Norm);
      io = z;
      cpu::rms_norm_gated(x.data(), w.data(), io.data(), io.data(), n, 1e-6f);
      CHECK(nmse(r_ng.data(), io.data(), un) <= kTolNormGated);

      // Elementwise kernels split anywhere give the same bits.
      if (n >= 7) {
        std::vector<float> whole(un), split(un);
        cpu::silu(x.data(), whole.data(), n);
        const int64_t a = n / 3 + 1;
        cpu::silu(x.data(), split.data(), a);
        cpu::silu(x.data() + a, split.data() + a, n - a);
        CHECK(same_bits(whole.data(), split.data(), un));
        cpu::sigmoid_gate(z.data(), gate.data(), whole.data(), n);
        cpu::sigmoid_gate(z.data(), gate.data(), split.data(), a);
        cpu::sigmoid_gate(z.data() + a, gate.data() + a, split.data() + a, n - a);
        CHECK(same_bits(whole.data(), split.data(), un));
      }
    });
  }
}

TEST_CASE("oracle: l2_norm and rms_norm_gated by hand") {
  // (3, 4) / sqrt(25 + eps); rms of (3, 4) is sqrt(12.5).
  const float x[2] = {3.0f, 4.0f};
  const float w[2] = {2.0f, 1.0f};
  const float z[2] = {0.0f, 50.0f};  // silu(0) = 0, silu(50) = 50 (in float)
  for_each_simd_target([&](const std::string&) {
    float y[2] = {NAN, NAN};
    cpu::l2_norm(x, y, 2, 0.0f);
    CHECK(y[0] == doctest::Approx(0.6).epsilon(1e-7));
    CHECK(y[1] == doctest::Approx(0.8).epsilon(1e-7));
    cpu::rms_norm_gated(x, w, z, y, 2, 0.0f);
    CHECK(y[0] == 0.0f);
    CHECK(y[1] == doctest::Approx(4.0 / std::sqrt(12.5) * 50.0).epsilon(1e-6));
  });
}

TEST_CASE("oracle: gdn_gates on every SIMD target") {
  for (const int64_t n : {1, 5, 16, 48, 100}) {
    CAPTURE(n);
    const size_t un = static_cast<size_t>(n);
    std::vector<float> alpha = gaussian(un, 50 + un, 3.0f);
    std::vector<float> b = gaussian(un, 60 + un, 3.0f);
    const std::vector<float> dt = gaussian(un, 70 + un, 1.0f);
    const std::vector<float> a = uniform(un, 80 + un, -16.0f, -0.01f);  // -exp(A_log)
    if (n >= 5) {
      alpha[0] = 30.0f;   // softplus past the threshold: u itself
      alpha[1] = -40.0f;  // softplus ~ exp(u): a tiny decay exponent
      b[2] = -100.0f;     // beta ~ 0
      b[3] = 100.0f;      // beta = 1
    }
    std::vector<float> rg(un), rb(un);
    ref::gdn_gates(alpha.data(), b.data(), dt.data(), a.data(), rg.data(), rb.data(), n);
    for (size_t h = 0; h < un; ++h) {
      CHECK(rg[h] <= 0.0f);
      CHECK((rb[h] >= 0.0f && rb[h] <= 1.0f));
    }
    for_each_simd_target([&](const std::string&) {
      std::vector<float> g(un), be(un);
      poison(g);
      poison(be);
      cpu::gdn_gates(alpha.data(), b.data(), dt.data(), a.data(), g.data(), be.data(), n);
      CHECK(nmse(rg.data(), g.data(), un) <= kTolGates);
      CHECK(nmse(rb.data(), be.data(), un) <= kTolGates);
      if (n >= 5) {
        CHECK(g[0] == doctest::Approx(a[0] * (30.0 + dt[0])).epsilon(1e-6));
        CHECK(g[1] <= 0.0f);
        CHECK(g[1] > -1e-10f);
        CHECK(be[2] < 1e-38f);  // 1 / (1 + e^88): the exp cap
        CHECK(be[3] == 1.0f);
      }
      // In place: g over alpha, beta over b.
      std::vector<float> ga = alpha, bb = b;
      cpu::gdn_gates(ga.data(), bb.data(), dt.data(), a.data(), ga.data(), bb.data(), n);
      CHECK(same_bits(ga.data(), g.data(), un));
      CHECK(same_bits(bb.data(), be.data(), un));
    });
  }
  // softplus(0) = ln 2: g = a * ln 2; sigmoid(0) = 1/2.
  const float zero = 0.0f, a1 = -2.0f;
  for_each_simd_target([&](const std::string&) {
    float g = NAN, be = NAN;
    cpu::gdn_gates(&zero, &zero, &zero, &a1, &g, &be, 1);
    CHECK(g == doctest::Approx(-2.0 * std::log(2.0)).epsilon(1e-6));
    CHECK(be == 0.5f);
  });
}

// A conv problem: x [T][x_stride], state [kernel-1][s_stride], w [C][kernel].
struct Conv {
  int64_t C, T, xs, ss;
  int32_t K;
  std::vector<float> x, w, state;
};

Conv make_conv(int64_t C, int64_t T, int32_t K, uint64_t seed) {
  Conv c{C, T, C + 3, C + 5, K, {}, {}, {}};
  c.x = gaussian(static_cast<size_t>(T * c.xs), seed);
  c.w = gaussian(static_cast<size_t>(C * K), seed + 1, 0.5f);
  c.state = gaussian(static_cast<size_t>((K - 1) * c.ss + 1), seed + 2);
  return c;
}

TEST_CASE("oracle: conv1d_causal (prefill and decode) on every SIMD target") {
  for (const int32_t K : {1, 2, 4, 5}) {
    for (const int64_t C : {1, 7, 33, 100, 3 * 1024}) {
      for (const int64_t T : {1, 3, 17}) {
        if (C == 3 * 1024 && T == 17) continue;  // keep the suite fast under ASan
        for (const bool silu : {false, true}) {
          CAPTURE(K);
          CAPTURE(C);
          CAPTURE(T);
          CAPTURE(silu);
          const Conv c = make_conv(C, T, K, 100 + static_cast<uint64_t>(C * 7 + T * 3 + K));
          const int64_t ys = C + 2;
          const size_t ny = static_cast<size_t>(T * ys);
          std::vector<float> ry(ny, 0.0f), rstate = c.state;
          ref::conv1d_causal(c.x.data(), c.xs, ry.data(), ys, T, c.w.data(), K, rstate.data(), c.ss,
                             0, C, silu);
          for_each_simd_target([&](const std::string&) {
            std::vector<float> y(ny), st = c.state;
            poison(y);
            cpu::conv1d_causal(c.x.data(), c.xs, y.data(), ys, T, c.w.data(), K, st.data(), c.ss, 0,
                               C, silu);
            // NMSE over the whole [T, C] output (a single sum of a few products can cancel).
            std::vector<float> want, got;
            for (int64_t t = 0; t < T; ++t) {
              want.insert(want.end(), ry.begin() + t * ys, ry.begin() + t * ys + C);
              got.insert(got.end(), y.begin() + t * ys, y.begin() + t * ys + C);
              if (t + 1 < T) CHECK(std::isnan(y[static_cast<size_t>(t * ys + C)]));  // gap
            }
            CHECK(nmse(want.data(), got.data(), want.size()) <= kTolConv);
            // The state is a copy of inputs: exactly the twin's, gaps between rows untouched.
            CHECK(same_bits(rstate.data(), st.data(), st.size()));

            // T decode steps give the same bits as the prefill.
            std::vector<float> yd(ny), sd = c.state;
            poison(yd);
            for (int64_t t = 0; t < T; ++t)
              cpu::conv1d_causal(c.x.data() + t * c.xs, c.xs, yd.data() + t * ys, ys, 1, c.w.data(),
                                 K, sd.data(), c.ss, 0, C, silu);
            for (int64_t t = 0; t < T; ++t)
              CHECK(same_bits(y.data() + t * ys, yd.data() + t * ys, static_cast<size_t>(C)));
            CHECK(same_bits(st.data(), sd.data(), st.size()));

            // Channels split at odd points, tokens split into two calls: same bits.
            if (C >= 7 && T >= 3) {
              std::vector<float> yc(ny), sc = c.state;
              poison(yc);
              const int64_t cuts[] = {0, 1, C / 2 + 3, C};
              const int64_t t1 = T / 2;
              for (int part = 0; part < 3; ++part) {
                cpu::conv1d_causal(c.x.data(), c.xs, yc.data(), ys, t1, c.w.data(), K, sc.data(),
                                   c.ss, cuts[part], cuts[part + 1], silu);
                cpu::conv1d_causal(c.x.data() + t1 * c.xs, c.xs, yc.data() + t1 * ys, ys, T - t1,
                                   c.w.data(), K, sc.data(), c.ss, cuts[part], cuts[part + 1],
                                   silu);
              }
              for (int64_t t = 0; t < T; ++t)
                CHECK(same_bits(y.data() + t * ys, yc.data() + t * ys, static_cast<size_t>(C)));
              CHECK(same_bits(st.data(), sc.data(), st.size()));
            }
          });
        }
      }
    }
  }
}

TEST_CASE("oracle: conv1d_causal by hand (kernel 4: identity tap, delay tap, state roll)") {
  // Two channels; state rows hold x_{-3}, x_{-2}, x_{-1}.
  const float state0[6] = {-3, -30, -2, -20, -1, -10};
  const float x[4] = {1, 10, 2, 20};                   // two tokens
  const float w_last[8] = {0, 0, 0, 1, 0, 0, 0, 1};    // y_t = x_t
  const float w_first[8] = {1, 0, 0, 0, 1, 0, 0, 0};   // y_t = x_{t-3}
  const float w_mix[8] = {1, 2, 3, 4, 0.5, 0, 0, -1};  // channel 1: 0.5 x_{t-3} - x_t
  auto run = [&](auto conv, const float* w, float* y, float* st) {
    conv(x, 2, y, 2, 2, w, 4, st, 2, 0, 2, false);
  };
  for (int impl = 0; impl < 2; ++impl) {
    auto check = [&](auto conv) {
      float y[4], st[6];
      std::memcpy(st, state0, sizeof st);
      run(conv, w_last, y, st);
      CHECK(y[0] == 1.0f);
      CHECK(y[1] == 10.0f);
      CHECK(y[2] == 2.0f);
      CHECK(y[3] == 20.0f);
      // New state: x_{-1}, x_0, x_1.
      const float want_state[6] = {-1, -10, 1, 10, 2, 20};
      CHECK(std::memcmp(st, want_state, sizeof st) == 0);
      std::memcpy(st, state0, sizeof st);
      run(conv, w_first, y, st);
      CHECK(y[0] == -3.0f);
      CHECK(y[1] == -30.0f);
      CHECK(y[2] == -2.0f);
      CHECK(y[3] == -20.0f);
      std::memcpy(st, state0, sizeof st);
      run(conv, w_mix, y, st);
      CHECK(y[0] == 1 * -3 + 2 * -2 + 3 * -1 + 4 * 1);  // -6
      CHECK(y[1] == 0.5f * -30 - 10);                   // -25
      CHECK(y[2] == 1 * -2 + 2 * -1 + 3 * 1 + 4 * 2);   // 7
      CHECK(y[3] == 0.5f * -20 - 20);                   // -30
    };
    if (impl == 0) {
      check(ref::conv1d_causal);
    } else {
      for_each_simd_target([&](const std::string&) { check(cpu::conv1d_causal); });
    }
  }
}

// A delta-rule problem for one V head: T tokens of q, k (L2-normalised), v, g, beta.
struct Delta {
  int32_t dk, dv;
  int64_t T, qs, ks, vs, gbs;
  std::vector<float> q, k, v, g, beta, state;
};

Delta make_delta(int32_t dk, int32_t dv, int64_t T, uint64_t seed) {
  Delta p{dk, dv, T, 3 * dk + 1, 3 * dk + 1, dv + 3, 2, {}, {}, {}, {}, {}, {}};
  p.q = gaussian(static_cast<size_t>(T * p.qs), seed);
  p.k = gaussian(static_cast<size_t>(T * p.ks), seed + 1);
  for (int64_t t = 0; t < T; ++t) {
    ref::l2_norm(p.q.data() + t * p.qs, p.q.data() + t * p.qs, dk, 1e-6f);
    ref::l2_norm(p.k.data() + t * p.ks, p.k.data() + t * p.ks, dk, 1e-6f);
  }
  p.v = gaussian(static_cast<size_t>(T * p.vs), seed + 2);
  p.g = uniform(static_cast<size_t>(T * p.gbs), seed + 3, -2.0f, -0.005f);
  p.beta = uniform(static_cast<size_t>(T * p.gbs), seed + 4, 0.0f, 1.0f);
  p.state = gaussian(static_cast<size_t>(dk) * dv, seed + 5, 0.5f);
  return p;
}

TEST_CASE("oracle: gated_delta_rule (prefill and decode) on every SIMD target") {
  struct Shape {
    int32_t dk, dv;
  };
  const Shape shapes[] = {{128, 128}, {8, 8}, {36, 20}, {64, 100}, {16, 1}};
  for (const Shape sh : shapes) {
    for (const int64_t T : {1, 5, 70}) {
      if (T == 70 && sh.dk != 128 && sh.dk != 36) continue;
      CAPTURE(sh.dk);
      CAPTURE(sh.dv);
      CAPTURE(T);
      const Delta p = make_delta(sh.dk, sh.dv, T, 900 + static_cast<uint64_t>(sh.dk + sh.dv + T));
      const float scale = 1.0f / std::sqrt(static_cast<float>(sh.dk));
      const int64_t os = sh.dv + 1;
      const size_t no = static_cast<size_t>(T * os);
      const size_t dv = static_cast<size_t>(sh.dv);
      std::vector<float> rout(no, 0.0f), rstate = p.state;
      ref::gated_delta_rule(p.q.data(), p.qs, p.k.data(), p.ks, p.v.data(), p.vs, p.g.data(),
                            p.beta.data(), p.gbs, T, sh.dk, sh.dv, scale, rstate.data(),
                            rout.data(), os, 0, sh.dv);
      for_each_simd_target([&](const std::string&) {
        std::vector<float> out(no), st = p.state;
        poison(out);
        cpu::gated_delta_rule(p.q.data(), p.qs, p.k.data(), p.ks, p.v.data(), p.vs, p.g.data(),
                              p.beta.data(), p.gbs, T, sh.dk, sh.dv, scale, st.data(), out.data(),
                              os, 0, sh.dv);
        for (int64_t t = 0; t < T; ++t) {
          CAPTURE(t);
          CHECK(nmse(rout.data() + t * os, out.data() + t * os, dv) <= kTolDelta);
          if (t + 1 < T) CHECK(std::isnan(out[static_cast<size_t>(t * os) + dv]));
        }
        CHECK(nmse(rstate.data(), st.data(), st.size()) <= kTolDelta);

        // T decode steps give the same bits as the prefill.
        std::vector<float> od(no), sd = p.state;
        poison(od);
        for (int64_t t = 0; t < T; ++t)
          cpu::gated_delta_rule(p.q.data() + t * p.qs, p.qs, p.k.data() + t * p.ks, p.ks,
                                p.v.data() + t * p.vs, p.vs, p.g.data() + t * p.gbs,
                                p.beta.data() + t * p.gbs, p.gbs, 1, sh.dk, sh.dv, scale, sd.data(),
                                od.data() + t * os, os, 0, sh.dv);
        for (int64_t t = 0; t < T; ++t)
          CHECK(same_bits(out.data() + t * os, od.data() + t * os, dv));
        CHECK(same_bits(st.data(), sd.data(), st.size()));

        // Columns split at odd points (threads sharing one head), tokens in two ubatches.
        if (sh.dv >= 7) {
          std::vector<float> oc(no), sc = p.state;
          poison(oc);
          const int32_t cuts[] = {0, 3, sh.dv / 2 + 1, sh.dv};
          const int64_t t1 = T / 2;
          for (int part = 0; part < 3; ++part) {
            cpu::gated_delta_rule(p.q.data(), p.qs, p.k.data(), p.ks, p.v.data(), p.vs, p.g.data(),
                                  p.beta.data(), p.gbs, t1, sh.dk, sh.dv, scale, sc.data(),
                                  oc.data(), os, cuts[part], cuts[part + 1]);
            cpu::gated_delta_rule(p.q.data() + t1 * p.qs, p.qs, p.k.data() + t1 * p.ks, p.ks,
                                  p.v.data() + t1 * p.vs, p.vs, p.g.data() + t1 * p.gbs,
                                  p.beta.data() + t1 * p.gbs, p.gbs, T - t1, sh.dk, sh.dv, scale,
                                  sc.data(), oc.data() + t1 * os, os, cuts[part], cuts[part + 1]);
          }
          for (int64_t t = 0; t < T; ++t)
            CHECK(same_bits(out.data() + t * os, oc.data() + t * os, dv));
          CHECK(same_bits(st.data(), sc.data(), st.size()));
        }
      });
    }
  }
}

TEST_CASE("oracle: gated_delta_rule by hand") {
  // d_k = 2, d_v = 2. From S = 0 with k = (1, 0), v = (2, -4), beta = 0.5, q = (0.6, 0.8):
  //   delta = 0.5 * v = (1, -2),  S = k delta^T = [[1, -2], [0, 0]],  out = scale * S^T q
  //   = scale * 0.6 * (1, -2).
  // A second token with g = ln 0.5, k = (0, 1), v = (3, 3), beta = 1, q = (1, 0):
  //   S = 0.5 S = [[0.5, -1], [0, 0]];  S^T k = (0, 0);  delta = (3, 3);
  //   S = [[0.5, -1], [3, 3]];  out = scale * S^T q = scale * (0.5, -1).
  const float q[4] = {0.6f, 0.8f, 1.0f, 0.0f};
  const float k[4] = {1.0f, 0.0f, 0.0f, 1.0f};
  const float v[4] = {2.0f, -4.0f, 3.0f, 3.0f};
  const float g[2] = {0.0f, std::log(0.5f)};
  const float beta[2] = {0.5f, 1.0f};
  const float scale = 0.5f;
  auto check = [&](auto rule) {
    float state[4] = {0, 0, 0, 0};
    float out[4] = {NAN, NAN, NAN, NAN};
    rule(q, 2, k, 2, v, 2, g, beta, 1, 2, 2, 2, scale, state, out, 2, 0, 2);
    CHECK(out[0] == doctest::Approx(0.5 * 0.6).epsilon(1e-6));
    CHECK(out[1] == doctest::Approx(0.5 * 0.6 * -2).epsilon(1e-6));
    CHECK(out[2] == doctest::Approx(0.25).epsilon(1e-6));
    CHECK(out[3] == doctest::Approx(-0.5).epsilon(1e-6));
    CHECK(state[0] == doctest::Approx(0.5).epsilon(1e-6));
    CHECK(state[1] == doctest::Approx(-1.0).epsilon(1e-6));
    CHECK(state[2] == doctest::Approx(3.0).epsilon(1e-6));
    CHECK(state[3] == doctest::Approx(3.0).epsilon(1e-6));
  };
  check(ref::gated_delta_rule);
  for_each_simd_target([&](const std::string&) { check(cpu::gated_delta_rule); });

  // beta = 0 leaves only the decay: S = exp(g) S, out = scale * exp(g) * S_old^T q.
  const Delta p = make_delta(16, 24, 1, 77);
  std::vector<float> zero_beta(2, 0.0f);
  for_each_simd_target([&](const std::string&) {
    std::vector<float> st = p.state, out(24);
    cpu::gated_delta_rule(p.q.data(), p.qs, p.k.data(), p.ks, p.v.data(), p.vs, p.g.data(),
                          zero_beta.data(), 1, 1, 16, 24, 1.0f, st.data(), out.data(), 24, 0, 24);
    const double decay = std::exp(static_cast<double>(p.g[0]));
    for (size_t i = 0; i < st.size(); ++i)
      CHECK(st[i] == doctest::Approx(decay * p.state[i]).epsilon(1e-6));
    for (int j = 0; j < 24; ++j) {
      double want = 0;
      for (int i = 0; i < 16; ++i)
        want += decay * p.state[static_cast<size_t>(i * 24 + j)] * p.q[i];
      CHECK(out[static_cast<size_t>(j)] == doctest::Approx(want).epsilon(1e-5).scale(1.0));
    }
  });
}

}  // namespace
}  // namespace berth
