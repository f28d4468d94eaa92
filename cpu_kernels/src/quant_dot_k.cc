// Highway SIMD kernels of the K-quant family: Q8_K activation quantization and the dot-product
// tiles of Q2_K, Q3_K, Q4_K, Q5_K and Q6_K weights against Q8_K activations (quant_dot.h).
// Scalar twins: quant_dot_k_ref.cpp (dot) and quants_ref.cpp (Q8_K quantizer).
//
// Integer form used by every path. A weight super-block is decoded to
//   q[256]   unsigned quants in element order (the format's quant plus a bias: 0 for Q2_K,
//            Q4_K, Q5_K; 4 for Q3_K; 32 for Q6_K),
//   sc[16]   the integer scale of each 16-element group,
//   off[16]  the integer coefficient of each group's activation sum (Q8_K bsums): the minimum
//            for Q2_K/Q4_K/Q5_K (scaled by dmin), bias * sc for Q3_K/Q6_K (scaled by d),
// so that, with a the activation quants and bsum the activation block's group sums,
//   block = (d * da) * (sum_g sc_g * (q . a)_g - [bias] sum_g off_g * bsum_g)
//           - (dmin * da) * [min] sum_g off_g * bsum_g,
// which is the reference formula (quant_dot_k_ref.cpp) with the same exact integers.
//
// x86 (AVX2, AVX3, AVX3_DL targets): q (unsigned, <= 63) times a (signed) by
// _mm256_maddubs_epi16 (pairs, |sum| <= 2 * 63 * 128, no saturation), times the group scales by
// _mm256_madd_epi16 into int32 lanes; per block the 8 int32 lanes go to float and one FMA per
// block and token accumulates them into 8 float lanes; the lanes are summed at the end of the
// row. The decode GEMV decodes each block in registers and prefetches 16 blocks ahead; Q4_K's
// GEMV uses 512-bit vectors on the AVX-512 targets (same int32 lanes after folding the halves).
// The GEMM tile decodes each block once per 64-token chunk into an L1 scratch (PackedX86) and
// runs a register-blocked micro-kernel over it: 4 rows x 8 tokens (AVX3: token pairs in 512-bit
// vectors) or 2 rows x 4 tokens (AVX2), with the same integers and float finish per (row, token,
// block) as the GEMV.
// AVX3_DL (GCC) uses another float order, shared by its GEMV and GEMM (GemmKDL): each block's
// integers are reduced to scalars first and enter one FMA chain per output (d term) plus one for
// the min term, so the GEMM runs vpdpbusd across 16 tokens per vector (activations transposed
// once per tile, weights unpacked to bytes once per 64-row block) and does one float step per
// block, row and 16 tokens. For 2..11 tokens (several sequences decoding: each routed expert
// gets a few) AVX3_DL runs FewTokDL instead: the GEMV's row streaming with each block decoded
// once into registers for up to 8 tokens, 4 tokens' integers reduced together and finished by
// one FMA per block and 4 tokens in the same float order.
// Other targets (NEON, SVE, EMU128, SCALAR): q * sc pre-multiplied into int16
// (|q * sc| <= 63 * 128), ReorderWidenMulAccumulate against the widened activations, the block
// integer reduced exactly and the float part computed as in the reference (bit-identical to
// it).
//
// Determinism: each output's float operations depend only on its weight row and activation
// row (the token loop is the innermost one and touches only that token's accumulator), so a
// value never depends on the tile shape or its position in it.

// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "quant_dot_k.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
// clang-format on

#ifndef BERTH_CPU_KERNELS_QUANT_DOT_K_COMMON_
#define BERTH_CPU_KERNELS_QUANT_DOT_K_COMMON_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "berth/core/error.h"
#include "berth/core/fp16.h"
#include "berth/cpu_kernels/quant_dot.h"
#include "berth/cpu_kernels/quants_ref.h"

namespace berth::cpu::kquant {

/// A decoded weight super-block (integer form at the top of this file), as the portable path
/// holds it.
struct alignas(64) DecodedK {
  uint8_t q[kQK_K];   ///< unsigned quants, element order
  int16_t sc[16];     ///< scale of each 16-element group
  int16_t off[16];    ///< coefficient of each group's activation sum
  float d = 0.0f;     ///< weight super-block scale (f16 decoded)
  float dmin = 0.0f;  ///< weight super-block min scale (0 for Q3_K/Q6_K)
};

/// Whether off[] is a bias folded into the d term (Q3_K, Q6_K) or a min scaled by dmin.
inline bool off_is_bias(GgmlType t) { return t == GgmlType::Q3_K || t == GgmlType::Q6_K; }

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

/// The eight 6-bit scales and mins of Q4_K/Q5_K (quants_ref.h, BlockQ4_K), from the 12 packed
/// bytes, as bytes: sc[j] = byte j of (sc_lo | sc_hi << 32), likewise mn.
inline void unpack_scales_k4(const uint8_t* s, uint64_t& sc, uint64_t& mn) {
  const uint32_t a = load_u32(s), b = load_u32(s + 4), c = load_u32(s + 8);
  const uint32_t sc_lo = a & 0x3f3f3f3fu;
  const uint32_t mn_lo = b & 0x3f3f3f3fu;
  const uint32_t sc_hi = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
  const uint32_t mn_hi = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
  sc = sc_lo | (static_cast<uint64_t>(sc_hi) << 32);
  mn = mn_lo | (static_cast<uint64_t>(mn_hi) << 32);
}

/// The sixteen 6-bit scales of Q3_K (quants_ref.h, BlockQ3_K), unbiased (0..63, the format
/// subtracts 32): byte j of w[k] is the scale of group 4k + j.
struct ScalesQ3K {
  uint32_t w[4];
};
inline ScalesQ3K unpack_scales_q3k(const uint8_t* s) {
  const uint32_t a0 = load_u32(s), a1 = load_u32(s + 4), hi = load_u32(s + 8);
  return {{(a0 & 0x0f0f0f0fu) | ((hi & 0x03030303u) << 4),
           (a1 & 0x0f0f0f0fu) | (((hi >> 2) & 0x03030303u) << 4),
           ((a0 >> 4) & 0x0f0f0f0fu) | (((hi >> 4) & 0x03030303u) << 4),
           ((a1 >> 4) & 0x0f0f0f0fu) | (((hi >> 6) & 0x03030303u) << 4)}};
}

template <class B>
inline const B* block_at(const void* p, int64_t i) {
  return reinterpret_cast<const B*>(static_cast<const uint8_t*>(p)) + i;
}

}  // namespace berth::cpu::kquant

#endif  // BERTH_CPU_KERNELS_QUANT_DOT_K_COMMON_

HWY_BEFORE_NAMESPACE();

// vpdpwssd (AVX512_VNNI) for the AVX3_DL GEMM micro-kernel: Highway 1.0.3's AVX3_DL target string
// names only the VEX "avxvnni" (absent on Zen 4), so "avx512vnni" is added for this target (the
// 512-bit form is EVEX-only); see quant_dot_legacy.cc. GCC only.
#undef BERTH_QDK_VNNI
#if HWY_TARGET == HWY_AVX3_DL && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx512vnni")
#define BERTH_QDK_VNNI 1
#else
#define BERTH_QDK_VNNI 0
#endif
namespace berth::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using kquant::DecodedK;

#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
#define BERTH_QDK_X86 1
#else
#define BERTH_QDK_X86 0
#endif

// ---------------------------------------------------------------------------------------------
// Q8_K activation quantization (ggml's quantize_row_q8_K_ref, as ref::quantize_row): the
// element of largest magnitude (the first one on ties) maps to -127, d = 1 / iscale, quants
// round half to even and are capped at 127. Bit-identical to the reference: the same float
// product iscale * x and the same round-to-nearest-even trick (add 1.5 * 2^23).
// ---------------------------------------------------------------------------------------------

void QuantizeQ8K(const float* HWY_RESTRICT x, void* HWY_RESTRICT dst, int64_t n) {
  const hn::CappedTag<float, 16> df;  // at most 16 lanes: divides a 16-element group
  const hn::Rebind<int32_t, decltype(df)> di;
  const hn::Rebind<int8_t, decltype(df)> d8;
  const size_t L = hn::Lanes(df);
  auto* out = static_cast<BlockQ8_K*>(dst);
  for (int64_t ib = 0; ib < n / kQK_K; ++ib, x += kQK_K) {
    auto vmax = hn::Zero(df);
    for (size_t i = 0; i < kQK_K; i += L) vmax = hn::Max(vmax, hn::Abs(hn::LoadU(df, x + i)));
    const float amax = hn::GetLane(hn::MaxOfLanes(df, vmax));
    BlockQ8_K b;
    if (!(amax > 0.0f)) {
      std::memset(&b, 0, sizeof(b));
      std::memcpy(out + ib, &b, sizeof(b));
      continue;
    }
    // The first element whose magnitude is amax (the reference keeps the first strict max).
    float xmax = 0.0f;
    const auto va = hn::Set(df, amax);
    for (size_t i = 0; i < kQK_K; i += L) {
      const intptr_t k = hn::FindFirstTrue(df, hn::Eq(hn::Abs(hn::LoadU(df, x + i)), va));
      if (k >= 0) {
        xmax = x[i + static_cast<size_t>(k)];
        break;
      }
    }
    const float iscale = -127.0f / xmax;
    const auto vis = hn::Set(df, iscale);
    const auto magic = hn::Set(df, 12582912.0f);  // 1.5 * 2^23
    const auto mant = hn::Set(di, 0x007fffff);
    const auto bias = hn::Set(di, 0x00400000);
    const auto hi = hn::Set(di, 127);
    for (size_t g = 0; g < kQK_K / 16; ++g) {
      auto gsum = hn::Zero(di);
      for (size_t i = 16 * g; i < 16 * g + 16; i += L) {
        const auto v = hn::Add(hn::Mul(hn::LoadU(df, x + i), vis), magic);
        const auto q = hn::Min(hn::Sub(hn::And(hn::BitCast(di, v), mant), bias), hi);
        gsum = hn::Add(gsum, q);
        hn::StoreU(hn::DemoteTo(d8, q), d8, b.qs + i);
      }
      b.bsums[g] = static_cast<int16_t>(hn::GetLane(hn::SumOfLanes(di, gsum)));
    }
    b.d = 1.0f / iscale;
    std::memcpy(out + ib, &b, sizeof(b));
  }
}

// Tokens per pass over one decoded block, and tokens whose accumulators live on the stack
// (a chunk: its activation rows, 64 * 292 bytes per super-block, stay in L2 across the rows).
constexpr int kTokGroup = 4;
constexpr int64_t kTokChunk = 64;

#if BERTH_QDK_X86
// ---------------------------------------------------------------------------------------------
// x86: maddubs + madd (AVX2 encoding; also used by the AVX-512 targets, whose wider vectors
// bring nothing to a loop bound by memory bandwidth or by the multiply ports). Each block is
// decoded into registers (DecX86); the GEMV uses them at once, the GEMM for every token.
// ---------------------------------------------------------------------------------------------

// A decoded super-block: q[p] the 32 unsigned quants of elements 32p..32p+31; s[p] the int16
// scales of their maddubs products (lanes 0-7: group 2p, lanes 8-15: group 2p + 1); off the 16
// group coefficients of the activation bsums (top of this file).
struct DecX86 {
  __m256i q[8];
  __m256i s[8];
  __m256i off;
  float d;
  float dmin;
};

// f16 -> f32 by F16C (exact, as fp16_to_f32).
HWY_INLINE float H2F(uint16_t h) { return _cvtsh_ss(h); }

HWY_INLINE __m256i LoadU256(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Shuffle masks: within each 128-bit lane, repeat the two bytes of int16 element e.
// kPairMask[k]: lane 0 repeats element 2k, lane 1 element 2k + 1 (of an 8-element half).
alignas(32) constexpr int8_t kPairMask[4][32] = {
    {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
     2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3},
    {4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5,
     6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7},
    {8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,  8,  9,
     10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11},
    {12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13,
     14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15}};

// s[] from 16 int16 group scales given as two 8-element halves (xmm).
HWY_INLINE void PairScales(__m128i lo8, __m128i hi8, DecX86& o) {
  const __m256i h[2] = {_mm256_broadcastsi128_si256(lo8), _mm256_broadcastsi128_si256(hi8)};
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p)
    o.s[p] = _mm256_shuffle_epi8(
        h[p / 4], _mm256_load_si256(reinterpret_cast<const __m256i*>(kPairMask[p % 4])));
}

// s[] and off for Q4_K/Q5_K: one 6-bit scale and min per 32 elements (two groups).
HWY_INLINE void ScalesK4(const uint8_t* packed, DecX86& o) {
  uint64_t sc, mn;
  kquant::unpack_scales_k4(packed, sc, mn);
  const __m128i sc16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc)));
  const __m128i mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(mn)));
  // Sub-block j covers groups 2j and 2j + 1: duplicate each scale and min.
  const __m128i sc_lo = _mm_unpacklo_epi16(sc16, sc16), sc_hi = _mm_unpackhi_epi16(sc16, sc16);
  PairScales(sc_lo, sc_hi, o);
  o.off = _mm256_set_m128i(_mm_unpackhi_epi16(mn16, mn16), _mm_unpacklo_epi16(mn16, mn16));
}

HWY_INLINE void DecodeX86(const BlockQ4_K* b, DecX86& o) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m256i raw = LoadU256(b->qs + 32 * c);
    o.q[2 * c] = _mm256_and_si256(raw, m4);
    o.q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
  }
  ScalesK4(b->scales, o);
  o.d = H2F(b->d);
  o.dmin = H2F(b->dmin);
}

HWY_INLINE void DecodeX86(const BlockQ5_K* b, DecX86& o) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i m10 = _mm256_set1_epi8(0x10);
  // hb: qh >> 2c (16-bit shifts; bits 0 and 1 of each byte stay within the byte for c < 4).
  __m256i hb = LoadU256(b->qh);
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m256i raw = LoadU256(b->qs + 32 * c);
    o.q[2 * c] =
        _mm256_or_si256(_mm256_and_si256(raw, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m10));
    o.q[2 * c + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m4),
                                     _mm256_and_si256(_mm256_slli_epi16(hb, 3), m10));
    hb = _mm256_srli_epi16(hb, 2);
  }
  ScalesK4(b->scales, o);
  o.d = H2F(b->d);
  o.dmin = H2F(b->dmin);
}

HWY_INLINE void DecodeX86(const BlockQ6_K* b, DecX86& o) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i m30 = _mm256_set1_epi8(0x30);
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const __m256i ql0 = LoadU256(b->ql + 64 * h);
    const __m256i ql1 = LoadU256(b->ql + 64 * h + 32);
    const __m256i qh = LoadU256(b->qh + 32 * h);
    o.q[4 * h] =
        _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
    o.q[4 * h + 1] =
        _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
    o.q[4 * h + 2] =
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));
    o.q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                     _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
  }
  const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales));
  const __m128i lo = _mm_cvtepi8_epi16(sc8), hi = _mm_cvtepi8_epi16(_mm_srli_si128(sc8, 8));
  PairScales(lo, hi, o);
  o.off = _mm256_slli_epi16(_mm256_set_m128i(hi, lo), 5);  // bias 32 * scale
  o.d = H2F(b->d);
  o.dmin = 0.0f;
}

HWY_INLINE void DecodeX86(const BlockQ2_K* b, DecX86& o) {
  const __m256i m3 = _mm256_set1_epi8(0x03);
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const __m256i v = LoadU256(b->qs + 32 * h);
    o.q[4 * h] = _mm256_and_si256(v, m3);
    o.q[4 * h + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 2), m3);
    o.q[4 * h + 2] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m3);
    o.q[4 * h + 3] = _mm256_and_si256(_mm256_srli_epi16(v, 6), m3);
  }
  const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales));
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m128i sc = _mm_and_si128(s8, m4);
  const __m128i mn = _mm_and_si128(_mm_srli_epi16(s8, 4), m4);
  PairScales(_mm_cvtepu8_epi16(sc), _mm_cvtepu8_epi16(_mm_srli_si128(sc, 8)), o);
  o.off = _mm256_cvtepu8_epi16(mn);
  o.d = H2F(b->d);
  o.dmin = H2F(b->dmin);
}

HWY_INLINE void DecodeX86(const BlockQ3_K* b, DecX86& o) {
  const __m256i m3 = _mm256_set1_epi8(0x03);
  const __m256i m04 = _mm256_set1_epi8(0x04);
  const __m256i hm = LoadU256(b->hmask);
  // q + 4 = low | high << 2 with high = bit 4h + k of hmask[l], moved to bit 2 by a 16-bit
  // shift that keeps it inside its byte.
  const __m256i high[8] = {
      _mm256_slli_epi16(hm, 2), _mm256_slli_epi16(hm, 1), hm,
      _mm256_srli_epi16(hm, 1), _mm256_srli_epi16(hm, 2), _mm256_srli_epi16(hm, 3),
      _mm256_srli_epi16(hm, 4), _mm256_srli_epi16(hm, 5)};
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const __m256i v = LoadU256(b->qs + 32 * h);
    const __m256i low[4] = {v, _mm256_srli_epi16(v, 2), _mm256_srli_epi16(v, 4),
                            _mm256_srli_epi16(v, 6)};
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k)
      o.q[4 * h + k] =
          _mm256_or_si256(_mm256_and_si256(low[k], m3), _mm256_and_si256(high[4 * h + k], m04));
  }
  const kquant::ScalesQ3K sc6 = kquant::unpack_scales_q3k(b->scales);
  const __m128i raw = _mm_set_epi32(static_cast<int>(sc6.w[3]), static_cast<int>(sc6.w[2]),
                                    static_cast<int>(sc6.w[1]), static_cast<int>(sc6.w[0]));
  const __m128i b32 = _mm_set1_epi16(32);
  const __m128i lo = _mm_sub_epi16(_mm_cvtepu8_epi16(raw), b32);
  const __m128i hi = _mm_sub_epi16(_mm_cvtepu8_epi16(_mm_srli_si128(raw, 8)), b32);
  PairScales(lo, hi, o);
  o.off = _mm256_slli_epi16(_mm256_set_m128i(hi, lo), 2);  // bias 4 * scale
  o.d = H2F(b->d);
  o.dmin = 0.0f;
}

// GEMV software prefetch distance in super-blocks (2.3 KiB ahead for Q4_K). Measured on the
// 16-core Xeon: one thread 7.7 -> 13 GB/s, 16 threads 86 -> 109 GB/s against 4 and 8 blocks
// (7.6 / 9.6 GB/s, 92 / 100 GB/s): the hardware prefetcher alone keeps too few lines in flight
// while a core also decodes.
constexpr int kPrefetchBlocks = 16;

HWY_INLINE float HSum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#if BERTH_QDK_VNNI
// Scalar helpers of the AVX3_DL float order (see GemmKDL's section below).
// Lane 0: the sum of the 8 int32 lanes of v.
HWY_INLINE __m128i HSumI8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
}

// One block's float step, from its integer lanes (isum: 8 lanes summing to isum_b; o: 8 lanes
// summing to o_b) and dd = the weight block's f16 pair (d, dmin) as read from memory. acc lane
// 0 is the d chain, lane 2 the dmin chain (Q3_K/Q6_K: lane 0 only); vfmadd per lane, as the
// GEMM's 512-bit FMAs; the conversions stay in vector registers.
template <bool kBias>
HWY_INLINE __m128 FinishScalar(__m256i isum, __m256i o, uint32_t dd, float da, __m128 acc) {
  const __m128 w = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dd)));  // [d, dmin, 0, 0]
  const __m128 s = _mm_mul_ps(_mm_unpacklo_ps(w, w), _mm_set1_ps(da));     // [d*da, ., dmin*da, .]
  if constexpr (kBias) {
    return _mm_fmadd_ss(_mm_cvtepi32_ps(HSumI8(_mm256_sub_epi32(isum, o))), s, acc);
  } else {
    const __m128i s1 =
        _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
    const __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(o), _mm256_extracti128_si256(o, 1));
    // [s1_0 + s1_2, s1_1 + s1_3, s2_0 + s2_2, s2_1 + s2_3], then pairs: [isum_b, ., o_b, .].
    __m128i u = _mm_add_epi32(_mm_unpacklo_epi64(s1, s2), _mm_unpackhi_epi64(s1, s2));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_fmadd_ps(_mm_cvtepi32_ps(u), s, acc);
  }
}

// The output from FinishScalar's chains: d chain - dmin chain (Q3_K/Q6_K: the d chain).
template <bool kBias>
HWY_INLINE float ChainsResult(__m128 acc) {
  if constexpr (kBias) return _mm_cvtss_f32(acc);
  return _mm_cvtss_f32(_mm_sub_ss(acc, _mm_movehl_ps(acc, acc)));
}

#endif  // BERTH_QDK_VNNI

// NT tokens (activation blocks a[t]) against one decoded block: the block integer in 8 int32
// lanes, then its float part into acc[t].
template <int NT, bool kBias>
HWY_INLINE void BlockTokens(const DecX86& kb, const BlockQ8_K* const* a, __m256* acc) {
  __m256i isum[NT];
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t) isum[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) {
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      const __m256i x = LoadU256(a[t]->qs + 32 * p);
      isum[t] =
          _mm256_add_epi32(isum[t], _mm256_madd_epi16(_mm256_maddubs_epi16(kb.q[p], x), kb.s[p]));
      // Keep the running sum in a register: without this GCC reassociates the integer adds
      // into a tree, keeping every product alive and spilling them to the stack.
      asm("" : "+x"(isum[t]));
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t) {
    const __m256i o = _mm256_madd_epi16(LoadU256(a[t]->bsums), kb.off);
    if constexpr (kBias) {
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[t], o)),
                               _mm256_set1_ps(kb.d * a[t]->d), acc[t]);
    } else {
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(kb.d * a[t]->d), acc[t]);
      acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(o), _mm256_set1_ps(kb.dmin * a[t]->d), acc[t]);
    }
  }
}

// Decode GEMV: one token, rows streamed once, each block decoded in registers and used at once.
template <class B, bool kBias>
void GemvX86(const B* HWY_RESTRICT w, int64_t n_rows, const BlockQ8_K* HWY_RESTRICT act, int64_t nb,
             float* HWY_RESTRICT out) {
  DecX86 kb;
  for (int64_t r = 0; r < n_rows; ++r) {
    const B* wr = w + r * nb;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t ib = 0; ib < nb; ++ib) {
      {
        const char* pf = reinterpret_cast<const char*>(wr + ib + kPrefetchBlocks);
        for (size_t off = 0; off < sizeof(B); off += 64) _mm_prefetch(pf + off, _MM_HINT_T0);
      }
      DecodeX86(wr + ib, kb);
      const BlockQ8_K* a = act + ib;
      BlockTokens<1, kBias>(kb, &a, &acc);
    }
    out[r] = HSum8(acc);
  }
}

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// Q4_K decode GEMV with 512-bit vectors (half the instructions of the 256-bit loop; +5% on the
// Xeon when compute-bound). Sub-blocks 2c and 2c + 1 share one vector: the 32 packed
// bytes broadcast to both halves, the upper half shifted to its high nibbles, against the 64
// contiguous activations. The two 256-bit halves of the sum are added before the float part,
// which gives the same 8 int32 lanes as BlockTokens<1, false> on a DecodeX86 block (each lane
// sums the same products), so the result is identical to the 256-bit tile's.
void GemvQ4KAvx512(const BlockQ4_K* HWY_RESTRICT w, int64_t n_rows,
                   const BlockQ8_K* HWY_RESTRICT act, int64_t nb, float* HWY_RESTRICT out) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  // vpermw indices: lanes 0-15 take scale 2c, lanes 16-31 scale 2c + 1.
  __m512i idx[4];
  for (int c = 0; c < 4; ++c)
    idx[c] =
        _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(static_cast<short>(2 * c))),
                           _mm256_set1_epi16(static_cast<short>(2 * c + 1)), 1);
  for (int64_t r = 0; r < n_rows; ++r) {
    const BlockQ4_K* wr = w + r * nb;
#if BERTH_QDK_VNNI
    __m128 acc_s = _mm_setzero_ps();  // lane 0: the AVX3_DL float order (GemmKDL)
#else
    __m256 acc = _mm256_setzero_ps();
#endif
    for (int64_t ib = 0; ib < nb; ++ib) {
      const BlockQ4_K* b = wr + ib;
      const BlockQ8_K* a = act + ib;
      {
        _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchBlocks), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchBlocks) + 64, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchBlocks) + 128, _MM_HINT_T0);
      }
      uint64_t sc, mn;
      kquant::unpack_scales_k4(b->scales, sc, mn);
      const __m512i sc16 =
          _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc))));
      const __m128i mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(mn)));
      __m512i isum = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i raw = _mm512_broadcast_i64x4(LoadU256(b->qs + 32 * c));
        const __m512i q = _mm512_and_si512(
            _mm512_mask_srli_epi16(raw, static_cast<__mmask32>(0xFFFF0000u), raw, 4), m4);
        const __m512i x = _mm512_loadu_si512(a->qs + 64 * c);
        const __m512i s = _mm512_permutexvar_epi16(idx[c], sc16);
        isum = _mm512_add_epi32(isum, _mm512_madd_epi16(_mm512_maddubs_epi16(q, x), s));
        asm("" : "+v"(isum));
      }
      const __m256i isum8 =
          _mm256_add_epi32(_mm512_castsi512_si256(isum), _mm512_extracti64x4_epi64(isum, 1));
      const __m256i off =
          _mm256_set_m128i(_mm_unpackhi_epi16(mn16, mn16), _mm_unpacklo_epi16(mn16, mn16));
      const __m256i o = _mm256_madd_epi16(LoadU256(a->bsums), off);
#if BERTH_QDK_VNNI
      acc_s = FinishScalar<false>(
          isum8, o, kquant::load_u32(reinterpret_cast<const uint8_t*>(&b->d)), a->d, acc_s);
#else
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum8), _mm256_set1_ps(H2F(b->d) * a->d), acc);
      acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(o), _mm256_set1_ps(H2F(b->dmin) * a->d), acc);
#endif
    }
#if BERTH_QDK_VNNI
    out[r] = ChainsResult<false>(acc_s);
#else
    out[r] = HSum8(acc);
#endif
  }
}
#endif

// GEMM tile: a register-blocked micro-kernel of kRowGroup weight rows x kTokGroup tokens. Tokens
// go in chunks of kTokChunk (their activation rows stay in L2 while the tile's rows go by);
// inside a chunk, for each group of kRowGroup rows and each super-block, the group's blocks are
// decoded once into an L1 scratch (PackedX86), then applied to the chunk's tokens kTokGroup at a
// time: each activation vector is loaded once for all rows of the group and each weight vector
// once for all tokens of the group (the old 1-row kernel re-read every activation per row and
// was bound by L2 bandwidth). Every (row, token) pair gets exactly the integers and the float
// finish of BlockTokens<1, kBias> (FinishBlock), block after block in order, so the outputs are
// bit-identical to the GEMV's whatever the tile shape.

// A decoded super-block in memory: q[32p..32p+31] = DecX86::q[p], s[16p..16p+15] = DecX86::s[p].
struct alignas(64) PackedX86 {
  uint8_t q[kQK_K];
  int16_t s[8 * 16];
  int16_t off[16];
  float d;
  float dmin;
};

template <class B>
HWY_INLINE void PackBlock(const B* HWY_RESTRICT b, PackedX86& o) {
  DecX86 kb;
  DecodeX86(b, kb);
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(o.q + 32 * p), kb.q[p]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(o.s + 16 * p), kb.s[p]);
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(o.off), kb.off);
  o.d = kb.d;
  o.dmin = kb.dmin;
}

// The float part of one block for one (row, token), exactly as BlockTokens does it.
template <bool kBias>
HWY_INLINE void FinishBlock(__m256i isum, const PackedX86& w, const BlockQ8_K* a, __m256& acc) {
  const __m256i o = _mm256_madd_epi16(LoadU256(a->bsums),
                                      _mm256_load_si256(reinterpret_cast<const __m256i*>(w.off)));
  if constexpr (kBias) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum, o)), _mm256_set1_ps(w.d * a->d),
                          acc);
  } else {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(w.d * a->d), acc);
    acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(o), _mm256_set1_ps(w.dmin * a->d), acc);
  }
}

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// 512-bit vectors hold a token pair: lanes 0-7 token t, lanes 8-15 token t + 1, against the
// same weight chunk broadcast to both halves, so each lane sums exactly the products of the
// 256-bit BlockTokens lane (no fold needed) and the float finish runs on two tokens at once.
// Registers (32): 4 rows x 4 token pairs of int32 accumulators, 4 activation pairs, q and s.
constexpr int kRowGroup = 4;
constexpr int kPairGroup = 4;  // token pairs per micro-kernel call

// acc[r * acc_stride + 2j + h] += block of row w[r] and token a[2j + h] for r < NR, j < NP,
// h < 2 (h = 1 skipped for the last pair when `odd`, whose a[2j + 1] repeats a[2j]).
template <int NR, int NP, bool kBias>
HWY_INLINE void MicroX86(const PackedX86* HWY_RESTRICT w, const BlockQ8_K* const* a, bool odd,
                         __m256* acc, int64_t acc_stride) {
  __m512i is[NR][NP];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) is[r][j] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) {
    __m512i x[NP];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j)
      x[j] = _mm512_inserti64x4(_mm512_castsi256_si512(LoadU256(a[2 * j]->qs + 32 * p)),
                                LoadU256(a[2 * j + 1]->qs + 32 * p), 1);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m512i q = _mm512_broadcast_i64x4(
          _mm256_load_si256(reinterpret_cast<const __m256i*>(w[r].q + 32 * p)));
      const __m512i s = _mm512_broadcast_i64x4(
          _mm256_load_si256(reinterpret_cast<const __m256i*>(w[r].s + 16 * p)));
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) {
#if BERTH_QDK_VNNI
        is[r][j] = _mm512_dpwssd_epi32(is[r][j], _mm512_maddubs_epi16(q, x[j]), s);
#else
        is[r][j] = _mm512_add_epi32(is[r][j], _mm512_madd_epi16(_mm512_maddubs_epi16(q, x[j]), s));
        asm("" : "+v"(is[r][j]));
#endif
      }
    }
  }
  // Float finish, as FinishBlock for each token of each pair.
#pragma GCC unroll 4
  for (int j = 0; j < NP; ++j) {
    const BlockQ8_K* a0 = a[2 * j];
    const BlockQ8_K* a1 = a[2 * j + 1];
    const __m512 da = _mm512_insertf32x8(_mm512_set1_ps(a0->d), _mm256_set1_ps(a1->d), 1);
    const __m512i bs =
        _mm512_inserti64x4(_mm512_castsi256_si512(LoadU256(a0->bsums)), LoadU256(a1->bsums), 1);
    const __mmask16 keep = (j == NP - 1 && odd) ? 0x00FF : 0xFFFF;
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m512i off =
          _mm512_broadcast_i64x4(_mm256_load_si256(reinterpret_cast<const __m256i*>(w[r].off)));
      const __m512i o = _mm512_madd_epi16(bs, off);
      float* ap = reinterpret_cast<float*>(acc + r * acc_stride + 2 * j);
      __m512 v = _mm512_maskz_load_ps(keep, ap);
      if constexpr (kBias) {
        v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(is[r][j], o)),
                            _mm512_mul_ps(_mm512_set1_ps(w[r].d), da), v);
      } else {
        v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r][j]), _mm512_mul_ps(_mm512_set1_ps(w[r].d), da),
                            v);
        v = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(o), _mm512_mul_ps(_mm512_set1_ps(w[r].dmin), da),
                             v);
      }
      _mm512_mask_store_ps(ap, keep, v);
    }
  }
}

// NR rows (packed blocks w[0..NR)) against the nt tokens ap[k] + ib of a chunk.
template <int NR, bool kBias>
HWY_INLINE void ChunkX86(const PackedX86* HWY_RESTRICT w, const BlockQ8_K* const* ap, int64_t ib,
                         int64_t nt, __m256* acc) {
  constexpr int kTok = 2 * kPairGroup;
  const BlockQ8_K* a[kTok];
  int64_t k = 0;
  for (; k + kTok <= nt; k += kTok) {
#pragma GCC unroll 8
    for (int i = 0; i < kTok; ++i) a[i] = ap[k + i] + ib;
    MicroX86<NR, kPairGroup, kBias>(w, a, false, acc + k, kTokChunk);
  }
  for (; k < nt; k += 2) {
    const bool odd = k + 1 == nt;
    a[0] = ap[k] + ib;
    a[1] = ap[odd ? k : k + 1] + ib;
    MicroX86<NR, 1, kBias>(w, a, odd, acc + k, kTokChunk);
  }
}
#else
// AVX2 (16 vector registers): 2 rows x 4 tokens of 256-bit accumulators.
constexpr int kRowGroup = 2;

template <int NR, int NT, bool kBias>
HWY_INLINE void MicroX86(const PackedX86* HWY_RESTRICT w, const BlockQ8_K* const* a, __m256* acc,
                         int64_t acc_stride) {
  __m256i is[NR][NT];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) is[r][t] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) {
    __m256i x[NT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) x[t] = LoadU256(a[t]->qs + 32 * p);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(w[r].q + 32 * p));
      const __m256i s = _mm256_load_si256(reinterpret_cast<const __m256i*>(w[r].s + 16 * p));
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        is[r][t] = _mm256_add_epi32(is[r][t], _mm256_madd_epi16(_mm256_maddubs_epi16(q, x[t]), s));
        asm("" : "+x"(is[r][t]));
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) FinishBlock<kBias>(is[r][t], w[r], a[t], acc[r * acc_stride + t]);
}

// NR rows (packed blocks w[0..NR)) against the nt tokens ap[k] + ib of a chunk.
template <int NR, bool kBias>
HWY_INLINE void ChunkX86(const PackedX86* HWY_RESTRICT w, const BlockQ8_K* const* ap, int64_t ib,
                         int64_t nt, __m256* acc) {
  int64_t k = 0;
  for (; k + kTokGroup <= nt; k += kTokGroup) {
    const BlockQ8_K* a[kTokGroup] = {ap[k] + ib, ap[k + 1] + ib, ap[k + 2] + ib, ap[k + 3] + ib};
    MicroX86<NR, kTokGroup, kBias>(w, a, acc + k, kTokChunk);
  }
  for (; k < nt; ++k) {
    const BlockQ8_K* a = ap[k] + ib;
    MicroX86<NR, 1, kBias>(w, &a, acc + k, kTokChunk);
  }
}
#endif

template <class B, bool kBias>
void TileX86(const B* HWY_RESTRICT w, int64_t n_rows, const uint8_t* act, size_t act_stride,
             int64_t n_tok, int64_t nb, float* out, int64_t out_stride) {
  PackedX86 pk[kRowGroup];
  alignas(64) __m256 acc[kRowGroup * kTokChunk];
  const BlockQ8_K* ap[kTokChunk];
  for (int64_t t0 = 0; t0 < n_tok; t0 += kTokChunk) {
    const int64_t nt = std::min<int64_t>(kTokChunk, n_tok - t0);
    for (int64_t k = 0; k < nt; ++k)
      ap[k] = reinterpret_cast<const BlockQ8_K*>(act + static_cast<size_t>(t0 + k) * act_stride);
    for (int64_t r0 = 0; r0 < n_rows; r0 += kRowGroup) {
      const int nr = static_cast<int>(std::min<int64_t>(kRowGroup, n_rows - r0));
      for (int r = 0; r < nr; ++r)
        for (int64_t k = 0; k < nt; ++k) acc[r * kTokChunk + k] = _mm256_setzero_ps();
      for (int64_t ib = 0; ib < nb; ++ib) {
        for (int r = 0; r < nr; ++r) PackBlock(w + (r0 + r) * nb + ib, pk[r]);
        if (nr == kRowGroup) {
          ChunkX86<kRowGroup, kBias>(pk, ap, ib, nt, acc);
        } else {
          for (int r = 0; r < nr; ++r) ChunkX86<1, kBias>(pk + r, ap, ib, nt, acc + r * kTokChunk);
        }
      }
      for (int r = 0; r < nr; ++r)
        for (int64_t k = 0; k < nt; ++k)
          out[(t0 + k) * out_stride + r0 + r] = HSum8(acc[r * kTokChunk + k]);
    }
  }
}

#if BERTH_QDK_VNNI
// ---------------------------------------------------------------------------------------------
// AVX3_DL (GCC): GEMV and GEMM share a float order in which each super-block enters once per
// output, as a whole: with isum_b = sum_g sc_g * (q . a)_g and o_b = sum_g off_g * bsum_g (exact
// int32, the integers of the top of this file),
//   acc = fma(float(isum_b - o_b), d * da, acc)                          (Q3_K, Q6_K)
//   acc = fma(float(isum_b), d * da, acc); accm = fma(float(o_b), dmin * da, accm)  (others)
// over b = 0, 1, ... in order from acc = accm = +0, and the output is acc (Q3_K, Q6_K) or
// acc - accm. The GEMV reduces its 8 int32 lanes per block to these scalars (both chains in one
// 128-bit FMA, lanes 0 and 2); the GEMM (GemmKDL) computes them for 16 tokens per vector, so its
// float work is one conversion and one or two FMAs per block, row and 16 tokens.
// ---------------------------------------------------------------------------------------------
template <class B, bool kBias>
void GemvDL(const B* HWY_RESTRICT w, int64_t n_rows, const BlockQ8_K* HWY_RESTRICT act, int64_t nb,
            float* HWY_RESTRICT out) {
  DecX86 kb;
  for (int64_t r = 0; r < n_rows; ++r) {
    const B* wr = w + r * nb;
    __m128 acc = _mm_setzero_ps();
    for (int64_t ib = 0; ib < nb; ++ib) {
      {
        const char* pf = reinterpret_cast<const char*>(wr + ib + kPrefetchBlocks);
        for (size_t off = 0; off < sizeof(B); off += 64) _mm_prefetch(pf + off, _MM_HINT_T0);
      }
      DecodeX86(wr + ib, kb);
      const BlockQ8_K* a = act + ib;
      __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        const __m256i x = LoadU256(a->qs + 32 * p);
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(kb.q[p], x), kb.s[p]));
        asm("" : "+x"(isum));
      }
      const __m256i o = _mm256_madd_epi16(LoadU256(a->bsums), kb.off);
      // (d, dmin) as one load where both exist (Q3_K/Q6_K have no dmin after d).
      uint32_t dd = wr[ib].d;
      if constexpr (!kBias) dd = kquant::load_u32(reinterpret_cast<const uint8_t*>(&wr[ib].d));
      acc = FinishScalar<kBias>(isum, o, dd, a->d, acc);
    }
    out[r] = ChainsResult<kBias>(acc);
  }
}

// GEMM. Activations, per 16-token chunk and super-block (KTBlock): at[l] = dword l (elements
// 4l..4l+3) of the 16 tokens' quants, bs[k] = the bsums pair (2k, 2k + 1) of each token as one
// dword, da the 16 scales. Weights, per row and super-block (KWBlock): the unsigned quants in
// element order, the group scales as int32 and the bsum coefficients as int16 pairs.
struct alignas(64) KTBlock {
  __m512i at[64];
  __m512i bs[8];
  __m512 da;
};

struct alignas(64) KWBlock {
  uint8_t q[kQK_K];
  int32_t sc[16];  ///< scale of each 16-element group
  int32_t off[8];  ///< off[2k] | off[2k + 1] << 16
  float d;
  float dmin;
};

// 16 rows of 32 bytes (r[t] the row of token t) to 8 dword columns: out[l] dword l of each row.
HWY_INLINE void Transpose16x32(const uint8_t* const* rows, size_t off, __m512i* out) {
  __m512i r[8];
  for (int t = 0; t < 8; ++t)
    r[t] = _mm512_inserti64x4(_mm512_castsi256_si512(LoadU256(rows[t] + off)),
                              LoadU256(rows[t + 8] + off), 1);
  __m512i s[8], u[8];
  for (int k = 0; k < 4; ++k) {
    s[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    s[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 2; ++k) {
    u[4 * k + 0] = _mm512_unpacklo_epi64(s[4 * k], s[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(s[4 * k], s[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(s[4 * k + 1], s[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(s[4 * k + 1], s[4 * k + 3]);
  }
  const __m512i ilo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i ihi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int j = 0; j < 4; ++j) {
    out[j] = _mm512_permutex2var_epi64(u[j], ilo, u[4 + j]);
    out[j + 4] = _mm512_permutex2var_epi64(u[j], ihi, u[4 + j]);
  }
}

template <class B>
HWY_INLINE void PackBlockDL(const B* HWY_RESTRICT b, KWBlock& o) {
  DecX86 kb;
  DecodeX86(b, kb);
  alignas(32) int16_t s[16];
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(o.q + 32 * p), kb.q[p]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(s), kb.s[p]);
    o.sc[2 * p] = s[0];
    o.sc[2 * p + 1] = s[8];
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(o.off), kb.off);
  o.d = kb.d;
  o.dmin = kb.dmin;
}

// Groups sharing one scale: 32 elements for Q4_K/Q5_K (their two 16-element groups have the
// same scale), 16 otherwise. The integer is the same either way.
template <class B>
constexpr int kScaleGroup = std::is_same_v<B, BlockQ4_K> || std::is_same_v<B, BlockQ5_K> ? 32 : 16;

// Block of rows w[r] (r < NR) for the 16 tokens of chunks x[t] (t < NT) into the d chains
// acc[r * NT + t] and (not kBias) the dmin chains acc[NR * NT + r * NT + t].
template <int NR, int NT, int G, bool kBias>
HWY_INLINE void MicroKDL(const KWBlock* const* w, const KTBlock* const* x, __m512* acc) {
  __m512i is[NR * NT];
#pragma GCC unroll 8
  for (int i = 0; i < NR * NT; ++i) is[i] = _mm512_setzero_si512();
#pragma GCC unroll 1
  for (int g = 0; g < kQK_K / G; ++g) {
    __m512i sb[NR * NT];
#pragma GCC unroll 8
    for (int i = 0; i < NR * NT; ++i) sb[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int l = 0; l < G / 4; ++l) {
      const int col = g * (G / 4) + l;
      __m512i av[NT];
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) av[t] = _mm512_load_si512(&x[t]->at[col]);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        int32_t wq;
        std::memcpy(&wq, w[r]->q + 4 * col, 4);
        const __m512i wv = _mm512_set1_epi32(wq);
#pragma GCC unroll 2
        for (int t = 0; t < NT; ++t)
          sb[r * NT + t] = _mm512_dpbusd_epi32(sb[r * NT + t], wv, av[t]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m512i sc = _mm512_set1_epi32(w[r]->sc[g * (G / 16)]);
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t)
        is[r * NT + t] = _mm512_add_epi32(is[r * NT + t], _mm512_mullo_epi32(sb[r * NT + t], sc));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t) {
      __m512i o = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k)
        o = _mm512_dpwssd_epi32(o, x[t]->bs[k], _mm512_set1_epi32(w[r]->off[k]));
      __m512& a = acc[r * NT + t];
      const __m512 dd = _mm512_mul_ps(_mm512_set1_ps(w[r]->d), x[t]->da);
      if constexpr (kBias) {
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(is[r * NT + t], o)), dd, a);
      } else {
        __m512& m = acc[NR * NT + r * NT + t];
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r * NT + t]), dd, a);
        m = _mm512_fmadd_ps(_mm512_cvtepi32_ps(o),
                            _mm512_mul_ps(_mm512_set1_ps(w[r]->dmin), x[t]->da), m);
      }
    }
  }
}

// Tokens per call: 1 the GEMV, kKFewTokMin.. FewTokDL (below), kKGemmMinTok.. GemmKDL.
// Measured on the Zen 4 dev machine (one pinned thread, 768 x 2048 experts beyond the LLC,
// docs/performance.md): FewTokDL runs 1.5-3x the per-token GEMV's rate from 2 tokens on, and
// beats GemmKDL up to 12 tokens for every K type (Q4_K: 4.4 against 2.9 GB/s at 8 tokens, 3.3
// against 2.7 at 12; Q2_K/Q3_K even at 12, GemmKDL ahead at 16 for Q3_K and Q6_K).
constexpr int64_t kKFewTokMin = 2;
constexpr int64_t kKGemmMinTok = 12;
constexpr int64_t kKGemmRowBlock = 64;  // rows decoded at once (weights in L2)

template <class B, bool kBias>
void GemmKDL(const B* HWY_RESTRICT w, int64_t n_rows, const uint8_t* act, size_t act_stride,
             int64_t n_tok, int64_t nb, float* out, int64_t out_stride) {
  constexpr int G = kScaleGroup<B>;
  thread_local std::vector<uint8_t> xbuf, wbuf, abuf;
  auto aligned = [](std::vector<uint8_t>& v, size_t n) {
    if (v.size() < n + 64) v.resize(n + 64);
    uint8_t* p = v.data();
    return p + (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64;
  };
  const int64_t n_chunks = (n_tok + 15) / 16;
  auto* xt = reinterpret_cast<KTBlock*>(
      aligned(xbuf, static_cast<size_t>(n_chunks * nb) * sizeof(KTBlock)));
  for (int64_t c = 0; c < n_chunks; ++c) {
    const uint8_t* rows[16];
    for (int t = 0; t < 16; ++t) {
      const int64_t tok = c * 16 + t < n_tok ? c * 16 + t : c * 16;  // pad with a real row
      rows[t] = act + static_cast<size_t>(tok) * act_stride;
    }
    for (int64_t ib = 0; ib < nb; ++ib) {
      KTBlock& tb = xt[c * nb + ib];
      const size_t base = static_cast<size_t>(ib) * sizeof(BlockQ8_K);
      for (int j = 0; j < 8; ++j)
        Transpose16x32(rows, base + offsetof(BlockQ8_K, qs) + 32 * j, tb.at + 8 * j);
      Transpose16x32(rows, base + offsetof(BlockQ8_K, bsums), tb.bs);
      alignas(64) float d[16];
      for (int t = 0; t < 16; ++t)
        std::memcpy(&d[t], rows[t] + base + offsetof(BlockQ8_K, d), sizeof(float));
      tb.da = _mm512_load_ps(d);
    }
  }
  for (int64_t r0 = 0; r0 < n_rows; r0 += kKGemmRowBlock) {
    const int64_t nr = std::min(kKGemmRowBlock, n_rows - r0);
    auto* wt =
        reinterpret_cast<KWBlock*>(aligned(wbuf, static_cast<size_t>(nr * nb) * sizeof(KWBlock)));
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t ib = 0; ib < nb; ++ib) PackBlockDL(w + (r0 + r) * nb + ib, wt[r * nb + ib]);
    for (int64_t c0 = 0; c0 < n_chunks; c0 += 2) {
      const int nc = n_chunks - c0 >= 2 ? 2 : 1;
      // Chains of every row of the block for this chunk pair: acc[4 * row + chain * 2 + chunk],
      // chain 0 the d chain, 1 the dmin chain.
      auto* acc =
          reinterpret_cast<__m512*>(aligned(abuf, static_cast<size_t>(nr) * 4 * sizeof(__m512)));
      for (int64_t i = 0; i < nr * 4; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t ib = 0; ib < nb; ++ib) {
        const KTBlock* x[2] = {xt + c0 * nb + ib, xt + (c0 + nc - 1) * nb + ib};
        int64_t r = 0;
        for (; r + 4 <= nr; r += 4) {
          const KWBlock* wr[4] = {wt + r * nb + ib, wt + (r + 1) * nb + ib, wt + (r + 2) * nb + ib,
                                  wt + (r + 3) * nb + ib};
          __m512 a[16];
          if (nc == 2) {
            for (int i = 0; i < 4; ++i)
              for (int j = 0; j < 2; ++j) {
                a[2 * i + j] = acc[4 * (r + i) + j];
                a[8 + 2 * i + j] = acc[4 * (r + i) + 2 + j];
              }
            MicroKDL<4, 2, G, kBias>(wr, x, a);
            for (int i = 0; i < 4; ++i)
              for (int j = 0; j < 2; ++j) {
                acc[4 * (r + i) + j] = a[2 * i + j];
                acc[4 * (r + i) + 2 + j] = a[8 + 2 * i + j];
              }
          } else {
            for (int i = 0; i < 4; ++i) {
              a[i] = acc[4 * (r + i)];
              a[4 + i] = acc[4 * (r + i) + 2];
            }
            MicroKDL<4, 1, G, kBias>(wr, x, a);
            for (int i = 0; i < 4; ++i) {
              acc[4 * (r + i)] = a[i];
              acc[4 * (r + i) + 2] = a[4 + i];
            }
          }
        }
        for (; r < nr; ++r) {
          const KWBlock* wr = wt + r * nb + ib;
          if (nc == 2) {
            MicroKDL<1, 2, G, kBias>(&wr, x, acc + 4 * r);
          } else {
            __m512 a[2] = {acc[4 * r], acc[4 * r + 2]};
            MicroKDL<1, 1, G, kBias>(&wr, x, a);
            acc[4 * r] = a[0];
            acc[4 * r + 2] = a[1];
          }
        }
      }
      for (int t = 0; t < nc; ++t) {
        const int64_t nt = std::min<int64_t>(16, n_tok - (c0 + t) * 16);
        float* o = out + (c0 + t) * 16 * out_stride + r0;
        for (int64_t r = 0; r < nr; ++r) {
          alignas(64) float v[16];
          __m512 res = acc[4 * r + t];
          if constexpr (!kBias) res = _mm512_sub_ps(res, acc[4 * r + 2 + t]);
          _mm512_store_ps(v, res);
          for (int64_t k = 0; k < nt; ++k) o[k * out_stride + r] = v[k];
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX3_DL few-token GEMV (FewTokDL): kKFewTokMin to kKGemmMinTok - 1 tokens, rows streamed once.
// Each weight super-block is decoded once into registers (FewDec: 512-bit quants and int16
// pair scales, sub-blocks 2c and 2c + 1 in one vector) and applied to every token of the call:
// per token and block, 4 x (vpmaddubsw, vpdpwssd) give the block integer in 16 int32 lanes,
// against the GEMV's decode plus 8 x (maddubs, madd, add) per token. The integers of 4 tokens
// are then reduced together (isum_b of token t in lane t, o_b in lane 8 + t) and enter the
// float chains of the AVX3_DL order above with one FMA per block and 4 tokens: lane t the d
// chain of token t, lane 8 + t its dmin chain. The integers are exact and every output gets
// the same float operations, in the same order, as GemvDL / GemvQ4KAvx512 (FinishScalar and
// ChainsResult), so the outputs are bit-identical to the one-token GEMV's.
// ---------------------------------------------------------------------------------------------
constexpr int64_t kKFewTokSlice = 8;  // tokens per pass over the rows (2 groups of 4)

struct FewDec {
  __m512i q[4];  ///< unsigned quants of elements 64c..64c+63
  __m512i s[4];  ///< int16 scales of their vpmaddubsw pairs
  __m256i off;   ///< the 16 group coefficients of the activation bsums
};

template <class B>
HWY_INLINE void DecodeFew(const B* HWY_RESTRICT b, FewDec& o) {
  DecX86 kb;
  DecodeX86(b, kb);
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    o.q[c] = _mm512_inserti64x4(_mm512_castsi256_si512(kb.q[2 * c]), kb.q[2 * c + 1], 1);
    o.s[c] = _mm512_inserti64x4(_mm512_castsi256_si512(kb.s[2 * c]), kb.s[2 * c + 1], 1);
  }
  o.off = kb.off;
}

// vpermw indices of Q4_K's pair scales: lanes 0-15 take scale 2c, lanes 16-31 scale 2c + 1.
alignas(64) constexpr int16_t kQ4PairIdx[4][32] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
     1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
    {2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2,
     3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
     5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5},
    {6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6,
     7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7}};

// Q4_K straight into 512-bit vectors (as GemvQ4KAvx512): the 32 packed bytes of sub-blocks 2c
// and 2c + 1 broadcast to both halves, the upper half shifted to its high nibbles.
HWY_INLINE void DecodeFew(const BlockQ4_K* HWY_RESTRICT b, FewDec& o) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  uint64_t sc, mn;
  kquant::unpack_scales_k4(b->scales, sc, mn);
  const __m512i sc16 =
      _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc))));
  const __m128i mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(mn)));
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512i raw = _mm512_broadcast_i64x4(LoadU256(b->qs + 32 * c));
    o.q[c] = _mm512_and_si512(
        _mm512_mask_srli_epi16(raw, static_cast<__mmask32>(0xFFFF0000u), raw, 4), m4);
    o.s[c] = _mm512_permutexvar_epi16(_mm512_load_si512(kQ4PairIdx[c]), sc16);
  }
  o.off = _mm256_set_m128i(_mm_unpackhi_epi16(mn16, mn16), _mm_unpacklo_epi16(mn16, mn16));
}

// vpermw indices of Q6_K's pair scales: lanes 8k..8k+7 take group 4c + k.
alignas(64) constexpr int16_t kQ6PairIdx[4][32] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
     2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5,
     6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8,  8,  8,  8,  8,  8,  8,  8,  9,  9,  9,  9,  9,  9,  9,  9,
     10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13,
     14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};

// Q6_K straight into 512-bit vectors (the same bytes as DecodeX86's q[2c], q[2c + 1]): half h
// of the block is 64 bytes of low nibbles ql[64h..64h+63] and 32 bytes of high pairs qh[32h..];
// vector 2h takes the low nibbles with qh bits 0-1 (lower 256 bits) and 2-3 (upper), vector
// 2h + 1 the high nibbles with qh bits 4-5 and 6-7, each pair moved to bits 4-5 by 16-bit shifts
// that keep it inside its byte.
HWY_INLINE void DecodeFew(const BlockQ6_K* HWY_RESTRICT b, FewDec& o) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i m30 = _mm512_set1_epi8(0x30);
  constexpr __mmask32 kLo = 0x0000FFFFu, kHi = 0xFFFF0000u;
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const __m512i l = _mm512_loadu_si512(b->ql + 64 * h);
    const __m512i qh = _mm512_broadcast_i64x4(LoadU256(b->qh + 32 * h));
    __m512i h0 = _mm512_slli_epi16(qh, 2);
    h0 = _mm512_mask_slli_epi16(h0, kLo, h0, 2);                // lower half << 4, upper << 2
    const __m512i h1 = _mm512_mask_srli_epi16(qh, kHi, qh, 2);  // lower half >> 0, upper >> 2
    o.q[2 * h] = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(h0, m30));
    o.q[2 * h + 1] =
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4), _mm512_and_si512(h1, m30));
  }
  const __m256i sc16 =
      _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales)));
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c)
    o.s[c] =
        _mm512_permutexvar_epi16(_mm512_load_si512(kQ6PairIdx[c]), _mm512_castsi256_si512(sc16));
  o.off = _mm256_slli_epi16(sc16, 5);  // bias 32 * scale
}

// NT (<= 4) tokens a[t] + ib against one decoded block: acc lane t (the d chain of token t)
// += float(isum_b - [bias] o_b) * (d * da_t) and, not kBias, lane 8 + t (its dmin chain)
// += float(o_b) * (dmin * da_t). da4: the 4 tokens' activation scales of block ib; w: the
// block's (d, dmin) as floats in lanes 0 and 1 (dmin 0 for kBias).
template <int NT, bool kBias>
HWY_INLINE void FewGroup(const FewDec& kb, const BlockQ8_K* const* a, int64_t ib, const float* da4,
                         __m512 w, __m512& acc) {
  __m512i v[4];
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t) {
    const BlockQ8_K* at = a[t] + ib;
    __m512i is = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)
      is = _mm512_dpwssd_epi32(
          is, _mm512_maddubs_epi16(kb.q[c], _mm512_loadu_si512(at->qs + 64 * c)), kb.s[c]);
    const __m256i f =
        _mm256_add_epi32(_mm512_castsi512_si256(is), _mm512_extracti64x4_epi64(is, 1));
    const __m256i o = _mm256_madd_epi16(LoadU256(at->bsums), kb.off);
    if constexpr (kBias) {
      v[t] = _mm512_zextsi256_si512(_mm256_sub_epi32(f, o));
    } else {
      v[t] = _mm512_inserti64x4(_mm512_castsi256_si512(f), o, 1);
    }
  }
#pragma GCC unroll 4
  for (int t = NT; t < 4; ++t) v[t] = _mm512_setzero_si512();
  // Per 128-bit block k: lane t = the sum of the 4 lanes of block k of v[t]; blocks 0 and 1
  // hold the isum part, 2 and 3 the o part; then block 0 += block 1, block 2 += block 3.
  const __m512i r01 =
      _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
  const __m512i r23 =
      _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
  __m512i r = _mm512_add_epi32(_mm512_unpacklo_epi64(r01, r23), _mm512_unpackhi_epi64(r01, r23));
  r = _mm512_add_epi32(r, _mm512_shuffle_i32x4(r, r, _MM_SHUFFLE(2, 3, 0, 1)));
  // Lanes 0-7: d * da, lanes 8-15: dmin * da (FinishScalar's products).
  const __m512 s = _mm512_mul_ps(w, _mm512_broadcast_f32x4(_mm_loadu_ps(da4)));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(r), s, acc);
}

// Tokens [0, NT) of a slice (NT <= kKFewTokSlice, groups of 4) against every row.
template <class B, bool kBias, int NT>
void FewSliceDL(const B* HWY_RESTRICT w, int64_t n_rows, const BlockQ8_K* const* a, const float* da,
                int64_t nb, float* out, int64_t out_stride) {
  constexpr int NT0 = NT < 4 ? NT : 4;
  constexpr int NT1 = NT - NT0;
  // vpermps indices: lanes 0-7 take d (lane 0), lanes 8-15 dmin (lane 1).
  const __m512i widx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  FewDec kb;
  for (int64_t r = 0; r < n_rows; ++r) {
    const B* wr = w + r * nb;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t ib = 0; ib < nb; ++ib) {
      {
        const char* pf = reinterpret_cast<const char*>(wr + ib + kPrefetchBlocks);
        for (size_t off = 0; off < sizeof(B); off += 64) _mm_prefetch(pf + off, _MM_HINT_T0);
      }
      DecodeFew(wr + ib, kb);
      // (d, dmin) as one load where both exist (Q3_K/Q6_K have no dmin after d).
      uint32_t dd = wr[ib].d;
      if constexpr (!kBias) dd = kquant::load_u32(reinterpret_cast<const uint8_t*>(&wr[ib].d));
      const __m512 wf = _mm512_permutexvar_ps(
          widx, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dd)))));
      FewGroup<NT0, kBias>(kb, a, ib, da + ib * kKFewTokSlice, wf, acc0);
      if constexpr (NT1 > 0)
        FewGroup<NT1, kBias>(kb, a + 4, ib, da + ib * kKFewTokSlice + 4, wf, acc1);
    }
    // ChainsResult per token: the d chain minus the dmin chain (Q3_K/Q6_K: the d chain).
    alignas(16) float res[8];
    const __m512 accs[2] = {acc0, acc1};
#pragma GCC unroll 2
    for (int g = 0; g < (NT1 > 0 ? 2 : 1); ++g) {
      __m128 v = _mm512_castps512_ps128(accs[g]);
      if constexpr (!kBias) v = _mm_sub_ps(v, _mm512_extractf32x4_ps(accs[g], 2));
      _mm_store_ps(res + 4 * g, v);
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) out[t * out_stride + r] = res[t];
  }
}

// n_tok >= 1 tokens in slices of kKFewTokSlice. With more than one slice, the rows go in blocks
// of kKGemmRowBlock (72 KiB of Q4_K for n = 2048) and every slice runs over a block before the
// next, so the block comes from DRAM once and from L2 for the other slices.
template <class B, bool kBias>
void FewTokDL(const B* HWY_RESTRICT w, int64_t n_rows, const uint8_t* act, size_t act_stride,
              int64_t n_tok, int64_t nb, float* out, int64_t out_stride) {
  const int64_t n_slices = (n_tok + kKFewTokSlice - 1) / kKFewTokSlice;
  // a[s * 8 + t]: token t of slice s (padding repeats its last real token); da[(s * nb + ib) * 8
  // + t]: that token's activation scale of block ib.
  thread_local std::vector<const BlockQ8_K*> abuf;
  thread_local std::vector<float> dabuf;
  abuf.resize(static_cast<size_t>(n_slices * kKFewTokSlice));
  dabuf.resize(static_cast<size_t>(n_slices * nb * kKFewTokSlice));
  for (int64_t s = 0; s < n_slices; ++s) {
    const int64_t t0 = s * kKFewTokSlice;
    const int64_t nt = std::min(kKFewTokSlice, n_tok - t0);
    for (int64_t t = 0; t < kKFewTokSlice; ++t) {
      const BlockQ8_K* a = reinterpret_cast<const BlockQ8_K*>(
          act + static_cast<size_t>(t0 + std::min(t, nt - 1)) * act_stride);
      abuf[static_cast<size_t>(s * kKFewTokSlice + t)] = a;
      for (int64_t ib = 0; ib < nb; ++ib)
        dabuf[static_cast<size_t>((s * nb + ib) * kKFewTokSlice + t)] = a[ib].d;
    }
  }
  const int64_t row_block = n_slices > 1 ? kKGemmRowBlock : n_rows;
  for (int64_t r0 = 0; r0 < n_rows; r0 += row_block) {
    const int64_t nr = std::min(row_block, n_rows - r0);
    const B* wb = w + r0 * nb;
    for (int64_t s = 0; s < n_slices; ++s) {
      const int64_t t0 = s * kKFewTokSlice;
      const int nt = static_cast<int>(std::min(kKFewTokSlice, n_tok - t0));
      const BlockQ8_K* const* a = abuf.data() + s * kKFewTokSlice;
      const float* da = dabuf.data() + s * nb * kKFewTokSlice;
      float* o = out + t0 * out_stride + r0;
      switch (nt) {
        case 1:
          FewSliceDL<B, kBias, 1>(wb, nr, a, da, nb, o, out_stride);
          break;
        case 2:
          FewSliceDL<B, kBias, 2>(wb, nr, a, da, nb, o, out_stride);
          break;
        case 3:
          FewSliceDL<B, kBias, 3>(wb, nr, a, da, nb, o, out_stride);
          break;
        case 4:
          FewSliceDL<B, kBias, 4>(wb, nr, a, da, nb, o, out_stride);
          break;
        case 5:
          FewSliceDL<B, kBias, 5>(wb, nr, a, da, nb, o, out_stride);
          break;
        case 6:
          FewSliceDL<B, kBias, 6>(wb, nr, a, da, nb, o, out_stride);
          break;
        case 7:
          FewSliceDL<B, kBias, 7>(wb, nr, a, da, nb, o, out_stride);
          break;
        default:
          FewSliceDL<B, kBias, 8>(wb, nr, a, da, nb, o, out_stride);
          break;
      }
    }
  }
}
#endif  // BERTH_QDK_VNNI

template <class B, bool kBias>
void DotTileX86(const void* w, int64_t n_rows, const void* act, size_t act_stride, int64_t n_tok,
                int64_t nb, float* out, int64_t out_stride) {
  const B* wb = static_cast<const B*>(w);
#if BERTH_QDK_VNNI
  const auto* ab = static_cast<const uint8_t*>(act);
  if (n_tok >= kKGemmMinTok) {
    GemmKDL<B, kBias>(wb, n_rows, ab, act_stride, n_tok, nb, out, out_stride);
  } else if (n_tok >= kKFewTokMin) {
    FewTokDL<B, kBias>(wb, n_rows, ab, act_stride, n_tok, nb, out, out_stride);
  } else {
    for (int64_t k = 0; k < n_tok; ++k) {
      const auto* a = reinterpret_cast<const BlockQ8_K*>(ab + static_cast<size_t>(k) * act_stride);
      if constexpr (std::is_same_v<B, BlockQ4_K>) {
        GemvQ4KAvx512(wb, n_rows, a, nb, out + k * out_stride);
      } else {
        GemvDL<B, kBias>(wb, n_rows, a, nb, out + k * out_stride);
      }
    }
  }
  return;
#endif
  if (n_tok == 1) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
    if constexpr (std::is_same_v<B, BlockQ4_K>) {
      GemvQ4KAvx512(wb, n_rows, static_cast<const BlockQ8_K*>(act), nb, out);
      return;
    }
#endif
    GemvX86<B, kBias>(wb, n_rows, static_cast<const BlockQ8_K*>(act), nb, out);
  } else {
    TileX86<B, kBias>(wb, n_rows, static_cast<const uint8_t*>(act), act_stride, n_tok, nb, out,
                      out_stride);
  }
}

#else   // !BERTH_QDK_X86
// ---------------------------------------------------------------------------------------------
// Decoding of weight super-blocks into DecodedK (128-bit Highway ops: every target has them).
// ---------------------------------------------------------------------------------------------

// At most 16 lanes (one lane on HWY_SCALAR); the loops below step by Lanes(D8()).
using D8 = hn::CappedTag<uint8_t, 16>;

// Scales, mins and super-block scales shared by Q4_K and Q5_K: each 6-bit sub-block scale/min
// covers 32 elements, i.e. two 16-element groups of DecodedK.
void SetScalesK4(const uint8_t* scales, uint16_t d, uint16_t dmin, DecodedK& o) {
  uint64_t sc, mn;
  kquant::unpack_scales_k4(scales, sc, mn);
  for (int j = 0; j < 8; ++j) {
    o.sc[2 * j] = o.sc[2 * j + 1] = static_cast<int16_t>((sc >> (8 * j)) & 0xFF);
    o.off[2 * j] = o.off[2 * j + 1] = static_cast<int16_t>((mn >> (8 * j)) & 0xFF);
  }
  o.d = fp16_to_f32(d);
  o.dmin = fp16_to_f32(dmin);
}

void DecodeQ4K(const BlockQ4_K* HWY_RESTRICT b, DecodedK& o) {
  const D8 d8;
  const auto m4 = hn::Set(d8, uint8_t{0x0F});
  const size_t N = hn::Lanes(d8);
  for (int c = 0; c < 4; ++c)
    for (size_t l = 0; l < 32; l += N) {
      const auto v = hn::LoadU(d8, b->qs + 32 * c + l);
      hn::StoreU(hn::And(v, m4), d8, o.q + 64 * c + l);
      hn::StoreU(hn::ShiftRight<4>(v), d8, o.q + 64 * c + 32 + l);
    }
  SetScalesK4(b->scales, b->d, b->dmin, o);
}

void DecodeQ5K(const BlockQ5_K* HWY_RESTRICT b, DecodedK& o) {
  const D8 d8;
  const auto m4 = hn::Set(d8, uint8_t{0x0F});
  const auto b4 = hn::Set(d8, uint8_t{0x10});
  const size_t N = hn::Lanes(d8);
  for (size_t l = 0; l < 32; l += N) {
    const auto qh = hn::LoadU(d8, b->qh + l);
    for (int c = 0; c < 4; ++c) {
      const auto v = hn::LoadU(d8, b->qs + 32 * c + l);
      const auto h0 = hn::VecFromMask(d8, hn::TestBit(qh, hn::Set(d8, uint8_t(1u << (2 * c)))));
      const auto h1 = hn::VecFromMask(d8, hn::TestBit(qh, hn::Set(d8, uint8_t(1u << (2 * c + 1)))));
      hn::StoreU(hn::Or(hn::And(v, m4), hn::And(h0, b4)), d8, o.q + 64 * c + l);
      hn::StoreU(hn::Or(hn::ShiftRight<4>(v), hn::And(h1, b4)), d8, o.q + 64 * c + 32 + l);
    }
  }
  SetScalesK4(b->scales, b->d, b->dmin, o);
}

void DecodeQ6K(const BlockQ6_K* HWY_RESTRICT b, DecodedK& o) {
  const D8 d8;
  const auto m4 = hn::Set(d8, uint8_t{0x0F});
  const auto m30 = hn::Set(d8, uint8_t{0x30});
  const size_t N = hn::Lanes(d8);
  for (int h = 0; h < 2; ++h)
    for (size_t l = 0; l < 32; l += N) {
      const auto ql0 = hn::LoadU(d8, b->ql + 64 * h + l);
      const auto ql1 = hn::LoadU(d8, b->ql + 64 * h + 32 + l);
      const auto qh = hn::LoadU(d8, b->qh + 32 * h + l);
      uint8_t* q = o.q + 128 * h + l;
      hn::StoreU(hn::Or(hn::And(ql0, m4), hn::And(hn::ShiftLeft<4>(qh), m30)), d8, q);
      hn::StoreU(hn::Or(hn::And(ql1, m4), hn::And(hn::ShiftLeft<2>(qh), m30)), d8, q + 32);
      hn::StoreU(hn::Or(hn::ShiftRight<4>(ql0), hn::And(qh, m30)), d8, q + 64);
      hn::StoreU(hn::Or(hn::ShiftRight<4>(ql1), hn::And(hn::ShiftRight<2>(qh), m30)), d8, q + 96);
    }
  for (int g = 0; g < 16; ++g) {
    o.sc[g] = b->scales[g];
    o.off[g] = static_cast<int16_t>(32 * b->scales[g]);
  }
  o.d = fp16_to_f32(b->d);
  o.dmin = 0.0f;
}

void DecodeQ2K(const BlockQ2_K* HWY_RESTRICT b, DecodedK& o) {
  const D8 d8;
  const auto m2 = hn::Set(d8, uint8_t{0x03});
  const size_t N = hn::Lanes(d8);
  for (int h = 0; h < 2; ++h)
    for (size_t l = 0; l < 32; l += N) {
      const auto v = hn::LoadU(d8, b->qs + 32 * h + l);
      uint8_t* q = o.q + 128 * h + l;
      hn::StoreU(hn::And(v, m2), d8, q);
      hn::StoreU(hn::And(hn::ShiftRight<2>(v), m2), d8, q + 32);
      hn::StoreU(hn::And(hn::ShiftRight<4>(v), m2), d8, q + 64);
      hn::StoreU(hn::ShiftRight<6>(v), d8, q + 96);
    }
  for (int g = 0; g < 16; ++g) {
    o.sc[g] = static_cast<int16_t>(b->scales[g] & 0xF);
    o.off[g] = static_cast<int16_t>(b->scales[g] >> 4);
  }
  o.d = fp16_to_f32(b->d);
  o.dmin = fp16_to_f32(b->dmin);
}

void DecodeQ3K(const BlockQ3_K* HWY_RESTRICT b, DecodedK& o) {
  const D8 d8;
  const auto m2 = hn::Set(d8, uint8_t{0x03});
  const auto b2 = hn::Set(d8, uint8_t{0x04});
  const size_t N = hn::Lanes(d8);
  for (size_t l = 0; l < 32; l += N) {
    const auto hm = hn::LoadU(d8, b->hmask + l);
    for (int h = 0; h < 2; ++h) {
      const auto v = hn::LoadU(d8, b->qs + 32 * h + l);
      uint8_t* q = o.q + 128 * h + l;
      // q + 4 = low | high << 2, in [0, 7].
      for (int k = 0; k < 4; ++k) {
        const auto low = hn::And(hn::ShiftRightSame(v, 2 * k), m2);
        const auto hb =
            hn::VecFromMask(d8, hn::TestBit(hm, hn::Set(d8, uint8_t(1u << (4 * h + k)))));
        hn::StoreU(hn::Or(low, hn::And(hb, b2)), d8, q + 32 * k);
      }
    }
  }
  const kquant::ScalesQ3K sc6 = kquant::unpack_scales_q3k(b->scales);
  for (int g = 0; g < 16; ++g) {
    const int s = static_cast<int>((sc6.w[g / 4] >> (8 * (g % 4))) & 0xFF) - 32;
    o.sc[g] = static_cast<int16_t>(s);
    o.off[g] = static_cast<int16_t>(4 * s);
  }
  o.d = fp16_to_f32(b->d);
  o.dmin = 0.0f;
}

void DecodeBlock(GgmlType t, const void* w, int64_t ib, DecodedK& o) {
  switch (t) {
    case GgmlType::Q2_K:
      DecodeQ2K(kquant::block_at<BlockQ2_K>(w, ib), o);
      return;
    case GgmlType::Q3_K:
      DecodeQ3K(kquant::block_at<BlockQ3_K>(w, ib), o);
      return;
    case GgmlType::Q4_K:
      DecodeQ4K(kquant::block_at<BlockQ4_K>(w, ib), o);
      return;
    case GgmlType::Q5_K:
      DecodeQ5K(kquant::block_at<BlockQ5_K>(w, ib), o);
      return;
    default:
      DecodeQ6K(kquant::block_at<BlockQ6_K>(w, ib), o);
      return;
  }
}

// ---------------------------------------------------------------------------------------------
// Portable path: int16 pre-scaled weights, ReorderWidenMulAccumulate, exact block integer.
// ---------------------------------------------------------------------------------------------

using D16 = hn::CappedTag<int16_t, 8>;  // one lane on HWY_SCALAR

struct alignas(64) ScaledK {
  int16_t w[kQK_K];  ///< q * sc of each element
};

void ScaleBlock(const DecodedK& kb, ScaledK& o) {
  const D16 d16;
  const hn::Rebind<uint8_t, D16> du8;
  for (int g = 0; g < 16; ++g) {
    const auto s = hn::Set(d16, kb.sc[g]);
    for (size_t h = 0; h < 16; h += hn::Lanes(d16)) {
      const auto q = hn::BitCast(
          d16, hn::PromoteTo(hn::Rebind<uint16_t, D16>(), hn::LoadU(du8, kb.q + 16 * g + h)));
      hn::StoreU(hn::Mul(q, s), d16, o.w + 16 * g + h);
    }
  }
}

// One token (activation block a) against a decoded, pre-scaled block: the exact block integer,
// then the reference's float formula into acc. (One token per call: SVE vectors cannot be
// held in arrays; the pre-scaled weights are re-read from L1 for each token.)
HWY_INLINE void BlockTokenPortable(const DecodedK& kb, const ScaledK& sw, bool bias,
                                   const BlockQ8_K* a, float& acc) {
  const D16 d16;
  const hn::Rebind<int8_t, D16> di8;
  const hn::Repartition<int32_t, D16> d32;
  const size_t L = hn::Lanes(d16);
  auto s0 = hn::Zero(d32), s1 = hn::Zero(d32);
  for (size_t i = 0; i < kQK_K; i += L) {
    const auto x = hn::PromoteTo(d16, hn::LoadU(di8, a->qs + i));
    s0 = hn::ReorderWidenMulAccumulate(d32, hn::LoadU(d16, sw.w + i), x, s0, s1);
  }
  int32_t sumi = hn::GetLane(hn::SumOfLanes(d32, hn::Add(s0, s1)));
  int32_t so = 0;
  for (int g = 0; g < 16; ++g) so += kb.off[g] * a->bsums[g];
  int32_t summ = 0;
  if (bias)
    sumi -= so;
  else
    summ = so;
  acc += (kb.d * a->d) * static_cast<float>(sumi) - (kb.dmin * a->d) * static_cast<float>(summ);
}

void TilePortable(GgmlType t, const void* w, int64_t n_rows, const uint8_t* act, size_t act_stride,
                  int64_t n_tok, int64_t nb, float* out, int64_t out_stride) {
  const size_t wrb = row_bytes(t, nb * kQK_K);
  const bool bias = kquant::off_is_bias(t);
  DecodedK kb;
  ScaledK sw;
  float acc[kTokChunk];
  const BlockQ8_K* ap[kTokChunk];
  for (int64_t t0 = 0; t0 < n_tok; t0 += kTokChunk) {
    const int64_t nt = std::min<int64_t>(kTokChunk, n_tok - t0);
    for (int64_t r = 0; r < n_rows; ++r) {
      const uint8_t* wr = static_cast<const uint8_t*>(w) + static_cast<size_t>(r) * wrb;
      for (int64_t k = 0; k < nt; ++k) acc[k] = 0.0f;
      for (int64_t ib = 0; ib < nb; ++ib) {
        DecodeBlock(t, wr, ib, kb);
        ScaleBlock(kb, sw);
        for (int64_t k = 0; k < nt; ++k)
          ap[k] =
              reinterpret_cast<const BlockQ8_K*>(act + static_cast<size_t>(t0 + k) * act_stride) +
              ib;
        for (int64_t k = 0; k < nt; ++k) BlockTokenPortable(kb, sw, bias, ap[k], acc[k]);
      }
      for (int64_t k = 0; k < nt; ++k) out[(t0 + k) * out_stride + r] = acc[k];
    }
  }
}
#endif  // BERTH_QDK_X86

void DotTileK(GgmlType t, const void* w, int64_t n_rows, const void* act, size_t act_stride,
              int64_t n_tok, int64_t n, float* out, int64_t out_stride) {
  const int64_t nb = n / kQK_K;
#if BERTH_QDK_X86
  switch (t) {
    case GgmlType::Q2_K:
      DotTileX86<BlockQ2_K, false>(w, n_rows, act, act_stride, n_tok, nb, out, out_stride);
      return;
    case GgmlType::Q3_K:
      DotTileX86<BlockQ3_K, true>(w, n_rows, act, act_stride, n_tok, nb, out, out_stride);
      return;
    case GgmlType::Q4_K:
      DotTileX86<BlockQ4_K, false>(w, n_rows, act, act_stride, n_tok, nb, out, out_stride);
      return;
    case GgmlType::Q5_K:
      DotTileX86<BlockQ5_K, false>(w, n_rows, act, act_stride, n_tok, nb, out, out_stride);
      return;
    default:
      DotTileX86<BlockQ6_K, true>(w, n_rows, act, act_stride, n_tok, nb, out, out_stride);
      return;
  }
#else
  TilePortable(t, w, n_rows, static_cast<const uint8_t*>(act), act_stride, n_tok, nb, out,
               out_stride);
#endif
}

// Whether DotTileK blocks for the cache itself when n_tok > 1 (GemmKDL).
bool GemmTilesItself() { return BERTH_QDK_VNNI != 0; }

#undef BERTH_QDK_X86
#undef BERTH_QDK_VNNI

}  // namespace berth::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace berth::cpu {
HWY_EXPORT(QuantizeQ8K);
HWY_EXPORT(DotTileK);
HWY_EXPORT(GemmTilesItself);

namespace detail {

/// Q8_K activation quantization of n floats (n a multiple of 256) into n / 256 BlockQ8_K at
/// dst. Bit-identical to ref::quantize_row(Q8_K) for finite inputs.
void quantize_q8_K(const float* x, void* dst, int64_t n) {
  if (n < 0 || n % kQK_K != 0)
    throw Error(ErrorCategory::invalid_argument,
                "quantize_q8_K: n = " + std::to_string(n) + " is not a multiple of 256");
  HWY_DYNAMIC_DISPATCH(QuantizeQ8K)(x, dst, n);
}

/// Whether the K-quant dot_tile of the CPU's dispatched target blocks for the cache itself when
/// n_tok > 1 (quant_dot.h; AVX3_DL's GemmKDL). No errors.
bool k_gemm_tiles_itself() { return HWY_DYNAMIC_DISPATCH(GemmTilesItself)(); }

/// K-quant dot-product tile (quant_dot.h, cpu::dot_tile) for t in Q2_K..Q6_K.
/// Throws Error(invalid_argument) when n is not a positive multiple of 256 or a count is
/// negative, Error(internal) when t is not a K-quant.
void dot_tile_k(GgmlType t, const void* w, int64_t n_rows, const void* act, size_t act_stride,
                int64_t n_tok, int64_t n, float* out, int64_t out_stride) {
  switch (t) {
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
      break;
    default:
      throw Error(ErrorCategory::internal,
                  "dot_tile_k: weight type " + std::string(type_name(t)) + " is not a K-quant");
  }
  if (n <= 0 || n % kQK_K != 0 || n_rows < 0 || n_tok < 0)
    throw Error(ErrorCategory::invalid_argument,
                "dot_tile_k(" + std::string(type_name(t)) + "): n = " + std::to_string(n) +
                    " (must be a positive multiple of 256), n_rows = " + std::to_string(n_rows) +
                    ", n_tok = " + std::to_string(n_tok));
  if (n_rows == 0 || n_tok == 0) return;
  HWY_DYNAMIC_DISPATCH(DotTileK)(t, w, n_rows, act, act_stride, n_tok, n, out, out_stride);
}

}  // namespace detail
}  // namespace berth::cpu
#endif  // HWY_ONCE
