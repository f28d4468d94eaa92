// Highway SIMD kernels of the Gated DeltaNet layer and of gated attention (gdn.h). Compiled once
// per target by foreach_target, dispatched at run time at each entry point in berth::cpu.
// Scalar twins: gdn_ref.cpp (berth::ref).
//
// Lanes run over channels (conv1d), state columns (delta rule) or elements; a partial last
// vector is padded through an aligned buffer and goes through the same vector code, so an
// element's value never depends on where a caller's range began or ended (any split of the
// work gives the same bits).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "gdn_simd.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// foreach_target re-includes this file once per target; everything below is per target.
#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include "berth/core/error.h"
#include "berth/cpu_kernels/gdn.h"

HWY_BEFORE_NAMESPACE();
namespace berth::cpu::gdn::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// Upper bound on the f32 lanes of one vector of this target (capped like ops_simd.cc's).
constexpr size_t kMaxLanes = HWY_MIN(HWY_MAX_BYTES, 256) / sizeof(float);

// The r < Lanes(d) elements at p, padded with `fill`, as a vector (through `buf`).
inline VF LoadPart(DF d, const float* p, size_t r, float fill, float* buf) {
  for (size_t i = 0; i < hn::Lanes(d); ++i) buf[i] = i < r ? p[i] : fill;
  return hn::Load(d, buf);
}
inline void StorePart(DF d, VF v, float* p, size_t r, float* buf) {
  hn::Store(v, d, buf);
  for (size_t i = 0; i < r; ++i) p[i] = buf[i];
}

// 1 / (1 + exp(-u)), exp's argument capped at 88 (Highway's Exp is valid up to +104; for u < -88
// the exact value is below 1e-38 and so is the capped one).
HWY_INLINE VF Sigmoid(DF d, VF u) {
  const VF e = hn::Exp(d, hn::Min(hn::Neg(u), hn::Set(d, 88.0f)));
  return hn::Div(hn::Set(d, 1.0f), hn::Add(hn::Set(d, 1.0f), e));
}
HWY_INLINE VF Silu(DF d, VF u) {
  const VF e = hn::Exp(d, hn::Min(hn::Neg(u), hn::Set(d, 88.0f)));
  return hn::Div(u, hn::Add(hn::Set(d, 1.0f), e));
}

// Sum of squares of n floats in double (half a float vector promoted per step), then the tail.
HWY_INLINE double SumSquares(const float* x, size_t n) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> dfh;
  const size_t ND = hn::Lanes(dd);
  auto acc0 = hn::Zero(dd), acc1 = hn::Zero(dd);
  size_t i = 0;
  for (; i + 2 * ND <= n; i += 2 * ND) {
    const auto lo = hn::PromoteTo(dd, hn::LoadU(dfh, x + i));
    const auto hi = hn::PromoteTo(dd, hn::LoadU(dfh, x + i + ND));
    acc0 = hn::MulAdd(lo, lo, acc0);
    acc1 = hn::MulAdd(hi, hi, acc1);
  }
  double ss = hn::GetLane(hn::SumOfLanes(dd, hn::Add(acc0, acc1)));
  for (; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  return ss;
}

// ---------------------------------------------------------------------------------------------
// Elementwise: y = f(x) or y = f(x, z), body in vectors, the tail through a padded buffer.

template <class F>
HWY_INLINE void Map1(const float* x, float* y, int64_t n, F f) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const size_t un = static_cast<size_t>(n);
  size_t i = 0;
  for (; i + N <= un; i += N) hn::StoreU(f(d, hn::LoadU(d, x + i), i), d, y + i);
  if (i < un) {
    HWY_ALIGN float buf[kMaxLanes];
    const size_t r = un - i;
    StorePart(d, f(d, LoadPart(d, x + i, r, 0.0f, buf), i), y + i, r, buf);
  }
}

void Silu1(const float* x, float* y, int64_t n) {
  Map1(x, y, n, [](DF d, VF v, size_t) { return Silu(d, v); });
}

void SigmoidGate(const float* x, const float* gate, float* y, int64_t n) {
  HWY_ALIGN float buf[kMaxLanes];
  const size_t un = static_cast<size_t>(n);
  Map1(gate, y, n, [&](DF d, VF gv, size_t i) {
    const VF xv =
        i + hn::Lanes(d) <= un ? hn::LoadU(d, x + i) : LoadPart(d, x + i, un - i, 0.0f, buf);
    return hn::Mul(xv, Sigmoid(d, gv));
  });
}

void L2Norm(const float* x, float* y, int64_t n, float eps) {
  const double ss = SumSquares(x, static_cast<size_t>(n));
  const float inv = static_cast<float>(1.0 / std::sqrt(ss + static_cast<double>(eps)));
  Map1(x, y, n, [inv](DF d, VF v, size_t) { return hn::Mul(v, hn::Set(d, inv)); });
}

void RmsNormGated(const float* x, const float* weight, const float* z, float* y, int64_t n,
                  float eps) {
  const double ss = SumSquares(x, static_cast<size_t>(n));
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
  const size_t un = static_cast<size_t>(n);
  HWY_ALIGN float bw[kMaxLanes], bz[kMaxLanes];
  Map1(x, y, n, [&](DF d, VF xv, size_t i) {
    const bool whole = i + hn::Lanes(d) <= un;
    const VF wv = whole ? hn::LoadU(d, weight + i) : LoadPart(d, weight + i, un - i, 0.0f, bw);
    const VF zv = whole ? hn::LoadU(d, z + i) : LoadPart(d, z + i, un - i, 0.0f, bz);
    return hn::Mul(hn::Mul(hn::Mul(xv, hn::Set(d, inv)), wv), Silu(d, zv));
  });
}

void GdnGates(const float* alpha, const float* b, const float* dt_bias, const float* ssm_a,
              float* g, float* beta, int64_t n) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const size_t un = static_cast<size_t>(n);
  HWY_ALIGN float b0[kMaxLanes], b1[kMaxLanes], b2[kMaxLanes], b3[kMaxLanes];
  for (size_t i = 0; i < un; i += N) {
    const size_t r = std::min(N, un - i);
    const bool whole = r == N;
    auto load = [&](const float* p, float* buf) {
      return whole ? hn::LoadU(d, p + i) : LoadPart(d, p + i, r, 0.0f, buf);
    };
    const VF u = hn::Add(load(alpha, b0), load(dt_bias, b1));
    // softplus(u) = log1p(exp(u)), u itself above 20 (Exp is evaluated on min(u, 20) so that
    // the unused lanes stay finite).
    const VF sp = hn::IfThenElse(hn::Gt(u, hn::Set(d, 20.0f)), u,
                                 hn::Log1p(d, hn::Exp(d, hn::Min(u, hn::Set(d, 20.0f)))));
    const VF gv = hn::Mul(load(ssm_a, b2), sp);
    const VF bv = Sigmoid(d, load(b, b3));
    // Inputs are read before outputs are written (outputs may alias inputs).
    if (whole) {
      hn::StoreU(gv, d, g + i);
      hn::StoreU(bv, d, beta + i);
    } else {
      StorePart(d, gv, g + i, r, b0);
      StorePart(d, bv, beta + i, r, b1);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Causal depthwise conv1d over a rolling state. A block of N channels walks the tokens; the
// taps of the block are transposed once into `wt` (tap i of lane l at wt[i * N + l]).

void Conv1dCausal(const float* x, int64_t x_stride, float* y, int64_t y_stride, int64_t n_tokens,
                  const float* w, int32_t kernel, float* state, int64_t state_stride, int64_t c0,
                  int64_t c1, bool silu) {
  BERTH_CHECK(kernel >= 1 && kernel <= kMaxConvKernel && c0 >= 0 && c0 <= c1 && n_tokens >= 0);
  const DF d;
  const size_t N = hn::Lanes(d);
  const int64_t hist = kernel - 1;
  HWY_ALIGN float wt[kMaxConvKernel * kMaxLanes];
  HWY_ALIGN float buf[kMaxLanes];
  for (int64_t c = c0; c < c1; c += static_cast<int64_t>(N)) {
    const size_t r = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(N), c1 - c));
    const bool whole = r == N;
    for (int32_t i = 0; i < kernel; ++i)
      for (size_t l = 0; l < N; ++l)
        wt[static_cast<size_t>(i) * N + l] =
            l < r ? w[(c + static_cast<int64_t>(l)) * kernel + i] : 0.0f;
    // Input of token tau (relative to this call's first token) for this block's channels.
    auto input = [&](int64_t tau) {
      const float* p = tau < 0 ? state + (hist + tau) * state_stride + c : x + tau * x_stride + c;
      return whole ? hn::LoadU(d, p) : LoadPart(d, p, r, 0.0f, buf);
    };
    for (int64_t t = 0; t < n_tokens; ++t) {
      VF acc = hn::Mul(hn::Load(d, wt), input(t - hist));
      for (int32_t i = 1; i < kernel; ++i)
        acc = hn::MulAdd(hn::Load(d, wt + static_cast<size_t>(i) * N), input(t - hist + i), acc);
      if (silu) acc = Silu(d, acc);
      float* yp = y + t * y_stride + c;
      if (whole) {
        hn::StoreU(acc, d, yp);
      } else {
        StorePart(d, acc, yp, r, buf);
      }
    }
    // New state rows in increasing order: row s reads old row s + n_tokens (still unwritten)
    // or an input row.
    for (int64_t s = 0; s < hist && n_tokens > 0; ++s) {
      const VF v = input(n_tokens - hist + s);
      float* sp = state + s * state_stride + c;
      if (whole) {
        hn::StoreU(v, d, sp);
      } else {
        StorePart(d, v, sp, r, buf);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The gated delta rule. Lanes are state columns j. Per token, one read of the block's rows of
// the old state gives both A = S_old^T k and B = S_old^T q; then
//   delta = beta * (v - decay * A),  S_new = decay * S_old + k delta^T,
//   out   = scale * (decay * B + (k . q) * delta).
// Two column vectors per block give four independent FMA chains; a lane's operations are the
// same whatever the block width, so the result of a column does not depend on the blocking.

struct TokenScalars {
  float decay, beta, kq, scale;
};

// One token for NV column vectors at columns [0, NV * N) of `s` (row stride `ld`); v, o point
// at the block's first column.
template <int NV>
HWY_INLINE void DeltaToken(DF d, float* HWY_RESTRICT s, size_t ld, int32_t d_k,
                           const float* HWY_RESTRICT k, const float* HWY_RESTRICT q,
                           const TokenScalars& ts, const float* v, float* o) {
  const size_t N = hn::Lanes(d);
  VF a0 = hn::Zero(d), b0 = hn::Zero(d), a1 = hn::Zero(d), b1 = hn::Zero(d);
  for (int32_t i = 0; i < d_k; ++i) {
    const float* row = s + static_cast<size_t>(i) * ld;
    const VF kv = hn::Set(d, k[i]), qv = hn::Set(d, q[i]);
    const VF s0 = hn::LoadU(d, row);
    a0 = hn::MulAdd(s0, kv, a0);
    b0 = hn::MulAdd(s0, qv, b0);
    if constexpr (NV == 2) {
      const VF s1 = hn::LoadU(d, row + N);
      a1 = hn::MulAdd(s1, kv, a1);
      b1 = hn::MulAdd(s1, qv, b1);
    }
  }
  const VF decay = hn::Set(d, ts.decay), beta = hn::Set(d, ts.beta);
  const VF kq = hn::Set(d, ts.kq), scale = hn::Set(d, ts.scale);
  const VF delta0 = hn::Mul(beta, hn::NegMulAdd(decay, a0, hn::LoadU(d, v)));
  hn::StoreU(hn::Mul(scale, hn::MulAdd(decay, b0, hn::Mul(kq, delta0))), d, o);
  VF delta1 = delta0;
  if constexpr (NV == 2) {
    delta1 = hn::Mul(beta, hn::NegMulAdd(decay, a1, hn::LoadU(d, v + N)));
    hn::StoreU(hn::Mul(scale, hn::MulAdd(decay, b1, hn::Mul(kq, delta1))), d, o + N);
  }
  for (int32_t i = 0; i < d_k; ++i) {
    float* row = s + static_cast<size_t>(i) * ld;
    const VF kv = hn::Set(d, k[i]);
    hn::StoreU(hn::MulAdd(kv, delta0, hn::Mul(decay, hn::LoadU(d, row))), d, row);
    if constexpr (NV == 2)
      hn::StoreU(hn::MulAdd(kv, delta1, hn::Mul(decay, hn::LoadU(d, row + N))), d, row + N);
  }
}

void GatedDeltaRule(const float* q, int64_t q_stride, const float* k, int64_t k_stride,
                    const float* v, int64_t v_stride, const float* g, const float* beta,
                    int64_t gb_stride, int64_t n_tokens, int32_t d_k, int32_t d_v, float scale,
                    float* state, float* out, int64_t out_stride, int32_t j0, int32_t j1) {
  BERTH_CHECK(d_k >= 1 && d_v >= 1 && j0 >= 0 && j0 <= j1 && j1 <= d_v && n_tokens >= 0);
  const DF d;
  const size_t N = hn::Lanes(d);
  const size_t ld = static_cast<size_t>(d_v);
  // Per-token scalars, recomputed identically for every column block (k . q in double, in
  // order), so no call needs scratch memory.
  auto scalars = [&](int64_t t) {
    const float* qt = q + t * q_stride;
    const float* kt = k + t * k_stride;
    double kq = 0.0;
    for (int32_t i = 0; i < d_k; ++i) kq += static_cast<double>(kt[i]) * qt[i];
    return TokenScalars{std::exp(g[t * gb_stride]), beta[t * gb_stride], static_cast<float>(kq),
                        scale};
  };
  // Whole column blocks: each walks all tokens while its rows of the state stay in L1.
  size_t j = static_cast<size_t>(j0);
  const size_t end = static_cast<size_t>(j1);
  for (; j + 2 * N <= end; j += 2 * N)
    for (int64_t t = 0; t < n_tokens; ++t)
      DeltaToken<2>(d, state + j, ld, d_k, k + t * k_stride, q + t * q_stride, scalars(t),
                    v + t * v_stride + j, out + t * out_stride + j);
  for (; j + N <= end; j += N)
    for (int64_t t = 0; t < n_tokens; ++t)
      DeltaToken<1>(d, state + j, ld, d_k, k + t * k_stride, q + t * q_stride, scalars(t),
                    v + t * v_stride + j, out + t * out_stride + j);
  if (j < end) {
    // A partial vector of r columns: its rows are copied into a padded [d_k][N] block, run
    // through the same code, and copied back.
    const size_t r = end - j;
    std::vector<float> blk(static_cast<size_t>(d_k) * N, 0.0f);
    for (int32_t i = 0; i < d_k; ++i)
      for (size_t l = 0; l < r; ++l) blk[static_cast<size_t>(i) * N + l] = state[i * ld + j + l];
    HWY_ALIGN float vb[kMaxLanes], ob[kMaxLanes];
    for (int64_t t = 0; t < n_tokens; ++t) {
      const float* vt = v + t * v_stride + j;
      for (size_t l = 0; l < N; ++l) vb[l] = l < r ? vt[l] : 0.0f;
      DeltaToken<1>(d, blk.data(), N, d_k, k + t * k_stride, q + t * q_stride, scalars(t), vb, ob);
      float* ot = out + t * out_stride + j;
      for (size_t l = 0; l < r; ++l) ot[l] = ob[l];
    }
    for (int32_t i = 0; i < d_k; ++i)
      for (size_t l = 0; l < r; ++l) state[i * ld + j + l] = blk[static_cast<size_t>(i) * N + l];
  }
}

}  // namespace berth::cpu::gdn::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace berth::cpu {
namespace gdn {
HWY_EXPORT(Conv1dCausal);
HWY_EXPORT(Silu1);
HWY_EXPORT(L2Norm);
HWY_EXPORT(GdnGates);
HWY_EXPORT(GatedDeltaRule);
HWY_EXPORT(RmsNormGated);
HWY_EXPORT(SigmoidGate);
}  // namespace gdn

void conv1d_causal(const float* x, int64_t x_stride, float* y, int64_t y_stride, int64_t n_tokens,
                   const float* w, int32_t kernel, float* state, int64_t state_stride, int64_t c0,
                   int64_t c1, bool silu) {
  HWY_DYNAMIC_DISPATCH(gdn::Conv1dCausal)
  (x, x_stride, y, y_stride, n_tokens, w, kernel, state, state_stride, c0, c1, silu);
}

void silu(const float* x, float* y, int64_t n) { HWY_DYNAMIC_DISPATCH(gdn::Silu1)(x, y, n); }

void l2_norm(const float* x, float* y, int64_t n, float eps) {
  HWY_DYNAMIC_DISPATCH(gdn::L2Norm)(x, y, n, eps);
}

void gdn_gates(const float* alpha, const float* b, const float* dt_bias, const float* ssm_a,
               float* g, float* beta, int64_t n) {
  HWY_DYNAMIC_DISPATCH(gdn::GdnGates)(alpha, b, dt_bias, ssm_a, g, beta, n);
}

void gated_delta_rule(const float* q, int64_t q_stride, const float* k, int64_t k_stride,
                      const float* v, int64_t v_stride, const float* g, const float* beta,
                      int64_t gb_stride, int64_t n_tokens, int32_t d_k, int32_t d_v, float scale,
                      float* state, float* out, int64_t out_stride, int32_t j0, int32_t j1) {
  HWY_DYNAMIC_DISPATCH(gdn::GatedDeltaRule)
  (q, q_stride, k, k_stride, v, v_stride, g, beta, gb_stride, n_tokens, d_k, d_v, scale, state, out,
   out_stride, j0, j1);
}

void rms_norm_gated(const float* x, const float* weight, const float* z, float* y, int64_t n,
                    float eps) {
  HWY_DYNAMIC_DISPATCH(gdn::RmsNormGated)(x, weight, z, y, n, eps);
}

void sigmoid_gate(const float* x, const float* gate, float* y, int64_t n) {
  HWY_DYNAMIC_DISPATCH(gdn::SigmoidGate)(x, gate, y, n);
}

}  // namespace berth::cpu
#endif  // HWY_ONCE
