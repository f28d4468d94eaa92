// Highway SIMD kernels of the non-matmul forward ops (ops.h): RMSNorm, RoPE, softmax, SwiGLU,
// add, and attention for decode (one query, or a GQA group, against the KV cache) and prefill
// (causal, KV-tiled with an online softmax). Compiled once per target by foreach_target and
// dispatched at run time at each entry point in berth::cpu. Scalar twins: ops.cpp (berth::ref).
//
// Every per-element result is computed by a sequence of operations that depends only on the
// element's index within its row (and, for attention, on the query's position), never on how a
// caller split the rows, so threads and ubatch boundaries do not change any bit.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops_simd.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// foreach_target re-includes this file once per target; everything below is per target.
#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "berth/cpu_kernels/ops.h"

HWY_BEFORE_NAMESPACE();
namespace berth::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// Upper bound on the f32 lanes of a vector of this target (SVE: up to 2048 bits), for stack
// buffers that hold one padded vector. Capped so a huge HWY_MAX_BYTES (RVV) stays small.
constexpr size_t kMaxLanes = HWY_MIN(HWY_MAX_BYTES, 256) / sizeof(float);
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Copies the r < N trailing elements at p into an aligned buffer filled with `fill`, so the
// tail goes through the same vector code (and the same exp polynomial) as the body.
inline VF LoadTail(DF d, const float* p, size_t r, float fill, float* buf) {
  for (size_t i = 0; i < hn::Lanes(d); ++i) buf[i] = i < r ? p[i] : fill;
  return hn::Load(d, buf);
}
inline void StoreTail(DF d, VF v, float* p, size_t r, float* buf) {
  hn::Store(v, d, buf);
  for (size_t i = 0; i < r; ++i) p[i] = buf[i];
}

// ---------------------------------------------------------------------------------------------
// Elementwise ops and norms.

void RmsNorm(const float* x, const float* weight, float* y, int64_t n, float eps) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const size_t un = static_cast<size_t>(n);
  // Sum of squares in double (like the twin): half a float vector promoted per step.
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> dfh;
  const size_t ND = hn::Lanes(dd);
  auto acc0 = hn::Zero(dd), acc1 = hn::Zero(dd);
  size_t i = 0;
  for (; i + 2 * ND <= un; i += 2 * ND) {
    const auto lo = hn::PromoteTo(dd, hn::LoadU(dfh, x + i));
    const auto hi = hn::PromoteTo(dd, hn::LoadU(dfh, x + i + ND));
    acc0 = hn::MulAdd(lo, lo, acc0);
    acc1 = hn::MulAdd(hi, hi, acc1);
  }
  double ss = hn::GetLane(hn::SumOfLanes(dd, hn::Add(acc0, acc1)));
  for (; i < un; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float scale = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
  const VF vs = hn::Set(d, scale);
  i = 0;
  if (weight) {
    for (; i + N <= un; i += N)
      hn::StoreU(hn::Mul(hn::Mul(hn::LoadU(d, x + i), vs), hn::LoadU(d, weight + i)), d, y + i);
    for (; i < un; ++i) y[i] = x[i] * scale * weight[i];
  } else {
    for (; i + N <= un; i += N) hn::StoreU(hn::Mul(hn::LoadU(d, x + i), vs), d, y + i);
    for (; i < un; ++i) y[i] = x[i] * scale;
  }
}

void Add(const float* a, const float* b, float* out, int64_t n) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const size_t un = static_cast<size_t>(n);
  size_t i = 0;
  for (; i + N <= un; i += N)
    hn::StoreU(hn::Add(hn::LoadU(d, a + i), hn::LoadU(d, b + i)), d, out + i);
  for (; i < un; ++i) out[i] = a[i] + b[i];
}

// silu(g) * u = g / (1 + exp(-g)) * u. exp's argument is capped at 88 (e^88 ~ 1.7e38 is still
// finite; Highway's Exp is valid up to +104 only): for g < -88 the exact result is below 1e-36
// in magnitude and the capped one is too.
HWY_INLINE VF SwigluVec(DF d, VF g, VF u) {
  const VF e = hn::Exp(d, hn::Min(hn::Neg(g), hn::Set(d, 88.0f)));
  return hn::Mul(hn::Div(g, hn::Add(hn::Set(d, 1.0f), e)), u);
}

void Swiglu(const float* gate, const float* up, float* out, int64_t n) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const size_t un = static_cast<size_t>(n);
  size_t i = 0;
  for (; i + N <= un; i += N)
    hn::StoreU(SwigluVec(d, hn::LoadU(d, gate + i), hn::LoadU(d, up + i)), d, out + i);
  if (i < un) {
    HWY_ALIGN float bg[kMaxLanes], bu[kMaxLanes];
    const size_t r = un - i;
    const VF g = LoadTail(d, gate + i, r, 0.0f, bg);
    const VF u = LoadTail(d, up + i, r, 0.0f, bu);
    StoreTail(d, SwigluVec(d, g, u), out + i, r, bg);
  }
}

void Softmax(const float* x, float* y, int64_t n) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const size_t un = static_cast<size_t>(n);
  const size_t body = un - un % N;
  const size_t r = un - body;
  HWY_ALIGN float buf[kMaxLanes];
  VF vmax = hn::Set(d, kNegInf);
  for (size_t i = 0; i < body; i += N) vmax = hn::Max(vmax, hn::LoadU(d, x + i));
  if (r) vmax = hn::Max(vmax, LoadTail(d, x + body, r, kNegInf, buf));
  const VF mx = hn::MaxOfLanes(d, vmax);
  // exp(x - max); -inf (and the padding) give exactly 0: Exp returns 0 below -104.
  // The sum runs per block of kBlock floats in float lanes, blocks summed in double, so no
  // float accumulator sees more than kBlock / N terms even for a vocabulary-sized row.
  constexpr size_t kBlock = 1024;
  double total = 0.0;
  for (size_t b0 = 0; b0 < body; b0 += kBlock) {
    const size_t b1 = std::min(body, b0 + kBlock);
    VF vsum = hn::Zero(d);
    for (size_t i = b0; i < b1; i += N) {
      const VF e = hn::Exp(d, hn::Sub(hn::LoadU(d, x + i), mx));
      hn::StoreU(e, d, y + i);
      vsum = hn::Add(vsum, e);
    }
    total += hn::GetLane(hn::SumOfLanes(d, vsum));
  }
  if (r) {
    const VF e = hn::Exp(d, hn::Sub(LoadTail(d, x + body, r, kNegInf, buf), mx));
    StoreTail(d, e, y + body, r, buf);
    total += hn::GetLane(hn::SumOfLanes(d, e));
  }
  const float inv = static_cast<float>(1.0 / total);
  const VF vinv = hn::Set(d, inv);
  for (size_t i = 0; i < body; i += N) hn::StoreU(hn::Mul(hn::LoadU(d, y + i), vinv), d, y + i);
  for (size_t i = body; i < un; ++i) y[i] *= inv;
}

// ---------------------------------------------------------------------------------------------
// RoPE.

void RopeInplace(float* x, int32_t n_head, int32_t head_dim, int32_t n_rot, const float* cos_theta,
                 const float* sin_theta, bool adjacent) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const size_t half = static_cast<size_t>(n_rot / 2);
  if (!adjacent) {
    // NeoX: x[i] and x[i + half] pair up, so both halves load as plain vectors.
    for (int32_t h = 0; h < n_head; ++h) {
      float* xa = x + static_cast<int64_t>(h) * head_dim;
      float* xb = xa + half;
      size_t i = 0;
      for (; i + N <= half; i += N) {
        const VF a = hn::LoadU(d, xa + i), b = hn::LoadU(d, xb + i);
        const VF c = hn::LoadU(d, cos_theta + i), s = hn::LoadU(d, sin_theta + i);
        hn::StoreU(hn::MulSub(a, c, hn::Mul(b, s)), d, xa + i);
        hn::StoreU(hn::MulAdd(a, s, hn::Mul(b, c)), d, xb + i);
      }
      for (; i < half; ++i) {
        const float a = xa[i], b = xb[i];
        xa[i] = a * cos_theta[i] - b * sin_theta[i];
        xb[i] = a * sin_theta[i] + b * cos_theta[i];
      }
    }
    return;
  }
  // Adjacent pairs (2i, 2i+1): with C = (c0, c0, c1, c1, ...), S = (-s0, s0, -s1, s1, ...) and
  // the pair-swapped vector w = (b0, a0, b1, a1, ...), the rotation is x * C + w * S.
  // C and S are expanded once per chunk of pairs and reused by every head.
  constexpr size_t kChunkPairs = 128;
  HWY_ALIGN float cc[2 * kChunkPairs], ss[2 * kChunkPairs];
  for (size_t p0 = 0; p0 < half; p0 += kChunkPairs) {
    const size_t np = std::min(kChunkPairs, half - p0);
    for (size_t i = 0; i < np; ++i) {
      cc[2 * i] = cc[2 * i + 1] = cos_theta[p0 + i];
      ss[2 * i] = -sin_theta[p0 + i];
      ss[2 * i + 1] = sin_theta[p0 + i];
    }
    const size_t nf = 2 * np;  // floats of this chunk
    for (int32_t h = 0; h < n_head; ++h) {
      float* xh = x + static_cast<int64_t>(h) * head_dim + 2 * p0;
      size_t i = 0;
      // (A 1-lane target, HWY_SCALAR, has no pairs in a vector: it takes the scalar loop.)
      for (; N >= 2 && i + N <= nf; i += N) {
        const VF v = hn::LoadU(d, xh + i);
        const VF w = hn::Reverse2(d, v);
        hn::StoreU(hn::MulAdd(v, hn::Load(d, cc + i), hn::Mul(w, hn::Load(d, ss + i))), d, xh + i);
      }
      for (; i < nf; i += 2) {
        const float a = xh[i], b = xh[i + 1];
        xh[i] = a * cc[i] + b * ss[i];
        xh[i + 1] = b * cc[i] + a * ss[i + 1];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Attention.
//
// A block of NB queries of one head walks the KV positions in tiles [t0, t0 + kTile), t0 a
// multiple of kTile. Query r attends to positions [0, n_kv[r]). Per tile:
//   1. scores s_j = scale * q_r.k_j: each K row is loaded once and used by all NB queries;
//   2. per query: m' = max(m, max_j s_j), p_j = exp(s_j - m'), alpha = exp(m - m'),
//      l = l * alpha + sum_j p_j (online softmax, arXiv:2205.14135);
//   3. out_r = out_r * alpha + sum_j p_j v_j, one head_dim chunk at a time with the NB
//      accumulators in registers; each V row chunk is loaded once for all NB queries.
// At the end out_r /= l. For a given query the operations and their order depend only on
// n_kv[r] (never on NB or the other queries), so any blocking gives the same bits.

constexpr int64_t kTile = kAttentionKvTile;

// NB accumulators, one per query of the block. Fixed-width targets keep them in an array of
// vectors (registers); scalable targets (SVE) cannot put vectors in arrays, so there they live
// in an aligned float buffer, loaded and stored around each update (same values, same order).
#undef BERTH_ACC_DECLARE
#undef BERTH_ACC_GET
#undef BERTH_ACC_SET
#if HWY_HAVE_SCALABLE
#define BERTH_ACC_DECLARE(name) HWY_ALIGN float name[NB * kMaxLanes]
#define BERTH_ACC_GET(name, r) hn::Load(d, name + (r)*kMaxLanes)
#define BERTH_ACC_SET(name, r, value) hn::Store((value), d, name + (r)*kMaxLanes)
#else
#define BERTH_ACC_DECLARE(name) VF name[NB]
#define BERTH_ACC_GET(name, r) name[r]
#define BERTH_ACC_SET(name, r, value) name[r] = (value)
#endif
constexpr int kQueryBlock = 4;

template <int NB>
HWY_NOINLINE void AttendBlock(const float* const* qs, const int64_t* n_kv, const float* k,
                              int64_t k_stride, const float* v, int64_t v_stride, int32_t head_dim,
                              float scale, float* const* outs) {
  const DF d;
  const size_t N = hn::Lanes(d);
  const size_t hd = static_cast<size_t>(head_dim);
  const size_t hd_body = hd - hd % N;
  HWY_ALIGN float p[NB][kTile + kMaxLanes];  // scores, then exp(score - m), of one tile
  float m[NB] = {}, l[NB] = {}, alpha[NB] = {};
  int64_t len[NB] = {};
  int64_t max_kv = 0;
  for (int r = 0; r < NB; ++r) max_kv = std::max(max_kv, n_kv[r]);

  for (int64_t t0 = 0; t0 < max_kv; t0 += kTile) {
    const bool first = t0 == 0;
    const int64_t tile_len = std::min(kTile, max_kv - t0);
    int64_t common = tile_len;  // positions every query of the block attends to
    for (int r = 0; r < NB; ++r) {
      len[r] = std::clamp<int64_t>(n_kv[r] - t0, 0, kTile);
      common = std::min(common, len[r]);
    }

    // 1. Scores.
    for (int64_t j = 0; j < tile_len; ++j) {
      const float* kj = k + (t0 + j) * k_stride;
      BERTH_ACC_DECLARE(acc);
      for (int r = 0; r < NB; ++r) BERTH_ACC_SET(acc, r, hn::Zero(d));
      for (size_t c = 0; c < hd_body; c += N) {
        const VF kv = hn::LoadU(d, kj + c);
        for (int r = 0; r < NB; ++r)
          BERTH_ACC_SET(acc, r, hn::MulAdd(hn::LoadU(d, qs[r] + c), kv, BERTH_ACC_GET(acc, r)));
      }
      for (int r = 0; r < NB; ++r) {
        if (j >= len[r]) continue;
        float s = hn::GetLane(hn::SumOfLanes(d, BERTH_ACC_GET(acc, r)));
        for (size_t c = hd_body; c < hd; ++c) s += qs[r][c] * kj[c];
        p[r][j] = scale * s;
      }
    }

    // 2. Online softmax per query.
    for (int r = 0; r < NB; ++r) {
      if (len[r] == 0) continue;
      const size_t n = static_cast<size_t>(len[r]);
      const size_t padded = (n + N - 1) / N * N;
      for (size_t j = n; j < padded; ++j) p[r][j] = kNegInf;
      VF vmax = hn::Set(d, kNegInf);
      for (size_t j = 0; j < padded; j += N) vmax = hn::Max(vmax, hn::Load(d, p[r] + j));
      const float tile_max = hn::GetLane(hn::MaxOfLanes(d, vmax));
      const float m_new = first ? tile_max : std::max(m[r], tile_max);
      alpha[r] = first ? 0.0f : (m_new == m[r] ? 1.0f : std::exp(m[r] - m_new));
      const VF vm = hn::Set(d, m_new);
      VF vsum = hn::Zero(d);
      for (size_t j = 0; j < padded; j += N) {
        const VF e = hn::Exp(d, hn::Sub(hn::Load(d, p[r] + j), vm));  // padding: exp(-inf) = 0
        hn::Store(e, d, p[r] + j);
        vsum = hn::Add(vsum, e);
      }
      const float tile_sum = hn::GetLane(hn::SumOfLanes(d, vsum));
      l[r] = first ? tile_sum : l[r] * alpha[r] + tile_sum;
      m[r] = m_new;
    }

    // 3. out = out * alpha + P V. The tile's sum starts from zero and joins the running sum
    // once, so each float accumulator sees at most kTile terms before being combined.
    for (size_t c = 0; c < hd_body; c += N) {
      BERTH_ACC_DECLARE(acc);
      for (int r = 0; r < NB; ++r) BERTH_ACC_SET(acc, r, hn::Zero(d));
      int64_t j = 0;
      for (; j < common; ++j) {
        const VF vv = hn::LoadU(d, v + (t0 + j) * v_stride + c);
        for (int r = 0; r < NB; ++r)
          BERTH_ACC_SET(acc, r, hn::MulAdd(hn::Set(d, p[r][j]), vv, BERTH_ACC_GET(acc, r)));
      }
      for (; j < tile_len; ++j) {
        const VF vv = hn::LoadU(d, v + (t0 + j) * v_stride + c);
        for (int r = 0; r < NB; ++r)
          if (j < len[r])
            BERTH_ACC_SET(acc, r, hn::MulAdd(hn::Set(d, p[r][j]), vv, BERTH_ACC_GET(acc, r)));
      }
      for (int r = 0; r < NB; ++r) {
        if (len[r] == 0) continue;
        VF a = BERTH_ACC_GET(acc, r);
        if (!first) a = hn::MulAdd(hn::LoadU(d, outs[r] + c), hn::Set(d, alpha[r]), a);
        hn::StoreU(a, d, outs[r] + c);
      }
    }
    for (size_t c = hd_body; c < hd; ++c) {
      for (int r = 0; r < NB; ++r) {
        if (len[r] == 0) continue;
        float a = 0.0f;
        for (int64_t j = 0; j < len[r]; ++j) a += p[r][j] * v[(t0 + j) * v_stride + c];
        outs[r][c] = first ? a : outs[r][c] * alpha[r] + a;
      }
    }
  }

  for (int r = 0; r < NB; ++r) {
    const float inv = 1.0f / l[r];
    const VF vinv = hn::Set(d, inv);
    size_t c = 0;
    for (; c < hd_body; c += N)
      hn::StoreU(hn::Mul(hn::LoadU(d, outs[r] + c), vinv), d, outs[r] + c);
    for (; c < hd; ++c) outs[r][c] *= inv;
  }
}

// Query i of n_q: q + i * q_stride, out + i * out_stride, n_kv = kv0 + i * kv_step.
void AttendQueries(const float* q, int64_t q_stride, int64_t n_q, int64_t kv0, int64_t kv_step,
                   const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                   int32_t head_dim, float scale, float* out, int64_t out_stride) {
  for (int64_t i0 = 0; i0 < n_q; i0 += kQueryBlock) {
    const int nb = static_cast<int>(std::min<int64_t>(kQueryBlock, n_q - i0));
    const float* qs[kQueryBlock];
    float* os[kQueryBlock];
    int64_t nkv[kQueryBlock];
    for (int r = 0; r < nb; ++r) {
      qs[r] = q + (i0 + r) * q_stride;
      os[r] = out + (i0 + r) * out_stride;
      nkv[r] = kv0 + (i0 + r) * kv_step;
    }
    switch (nb) {
      case 4:
        AttendBlock<4>(qs, nkv, k, k_stride, v, v_stride, head_dim, scale, os);
        break;
      case 3:
        AttendBlock<3>(qs, nkv, k, k_stride, v, v_stride, head_dim, scale, os);
        break;
      case 2:
        AttendBlock<2>(qs, nkv, k, k_stride, v, v_stride, head_dim, scale, os);
        break;
      default:
        AttendBlock<1>(qs, nkv, k, k_stride, v, v_stride, head_dim, scale, os);
        break;
    }
  }
}

}  // namespace berth::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace berth::cpu {

HWY_EXPORT(RmsNorm);
HWY_EXPORT(RopeInplace);
HWY_EXPORT(Softmax);
HWY_EXPORT(Swiglu);
HWY_EXPORT(Add);
HWY_EXPORT(AttendQueries);

void rms_norm(const float* x, const float* weight, float* y, int64_t n, float eps) {
  HWY_DYNAMIC_DISPATCH(RmsNorm)(x, weight, y, n, eps);
}

void rope_inplace(float* x, int32_t n_head, int32_t head_dim, int32_t n_rot, const float* cos_theta,
                  const float* sin_theta, bool adjacent) {
  HWY_DYNAMIC_DISPATCH(RopeInplace)(x, n_head, head_dim, n_rot, cos_theta, sin_theta, adjacent);
}

void softmax(const float* x, float* y, int64_t n) { HWY_DYNAMIC_DISPATCH(Softmax)(x, y, n); }

void swiglu(const float* gate, const float* up, float* out, int64_t n) {
  HWY_DYNAMIC_DISPATCH(Swiglu)(gate, up, out, n);
}

void add(const float* a, const float* b, float* out, int64_t n) {
  HWY_DYNAMIC_DISPATCH(Add)(a, b, out, n);
}

void attention_head(const float* q, const float* k, int64_t k_stride, const float* v,
                    int64_t v_stride, int64_t n_kv, int32_t head_dim, float scale, float* out,
                    float* /*scores*/) {
  HWY_DYNAMIC_DISPATCH(AttendQueries)
  (q, head_dim, 1, n_kv, 0, k, k_stride, v, v_stride, head_dim, scale, out, head_dim);
}

void attention_causal_tile(const float* q, int64_t q_stride, int64_t n_q, int64_t q_pos0,
                           const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                           int32_t head_dim, float scale, float* out, int64_t out_stride,
                           float* /*scratch*/) {
  HWY_DYNAMIC_DISPATCH(AttendQueries)
  (q, q_stride, n_q, q_pos0 + 1, 1, k, k_stride, v, v_stride, head_dim, scale, out, out_stride);
}

void attention_group(const float* q, int64_t q_stride, int64_t n_q, int64_t n_kv, const float* k,
                     int64_t k_stride, const float* v, int64_t v_stride, int32_t head_dim,
                     float scale, float* out, int64_t out_stride, float* /*scratch*/) {
  HWY_DYNAMIC_DISPATCH(AttendQueries)
  (q, q_stride, n_q, n_kv, 0, k, k_stride, v, v_stride, head_dim, scale, out, out_stride);
}

}  // namespace berth::cpu
#endif  // HWY_ONCE
