// Highway kernels of the legacy 32-element formats: Q8_0 activation quantization and the dot
// tiles of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights against Q8_0 activations (quant_dot.h).
//
// Formats: quants_ref.h (ggml-common.h block layouts). Scalar twins: quant_dot_legacy_ref.cpp
// (dot) and quants_ref.cpp's quant_q8_0 (activation quantization).
//
// Per block b of a weight row and an activation row the kernel forms the exact integer dot
// product of the 32 quants as a vector of int32 partial sums (lanes), converts it to float and
// accumulates it, times d_w * d_a, into one of two float vector accumulators (alternating
// blocks, or block pairs on AVX-512: two independent FMA chains). Q4_1/Q5_1 add (m * d_a) times
// the partial sums of the activation quants. The result is the lane sum of the two
// accumulators. The order of operations for one output depends only on n and the target, never
// on the tile shape or the number of tokens, so outputs are bit-identical however a matrix is
// split into tiles (quant_dot.h's determinism contract).
//
// Integer dot products:
//   AVX-512 (AVX3, AVX3_DL): two blocks per 512-bit vector. Signed weights use the sign trick
//     (|w| unsigned, the activations negated where w < 0, by a masked subtract); Q4_1/Q5_1
//     quants are already unsigned. AVX3: vpmaddubsw + vpmaddwd; AVX3_DL (GCC): vpdpbusd.
//   AVX2: one block per 256-bit vector, vpsignb for the sign trick, vpmaddubsw + vpmaddwd.
//     No saturation is possible: |w| <= 128 (Q8_0), |a| <= 127 (Q8_0 activations), so a pair
//     sum is at most 32512.
//   Other targets (NEON, SVE, EMU128, SSE4, ...): 16 quants per 128-bit vector, widened to int16
//     and multiplied with ReorderWidenMulAccumulate into int32 lanes; HWY_SCALAR: plain loops.
// All give the exact integer sums; only the float accumulation order differs between targets.
//
// GEMM reuse: tokens go in groups of up to four with separate accumulators. On x86 the group's
// activations are first repacked once per tile (aligned quants, float scales; RepackTokens), then
// each weight row is read once per group and each weight block (pair) decoded once for all of
// the group's tokens; the weight rows of the tile are streamed from DRAM for the first group and
// from cache for the following ones when the tile fits (cpu::gemm_rows uses 16-row tiles).
// GEMV (n_tok = 1) streams the rows with a software prefetch 1 KiB ahead.
// AVX3_DL (GCC) tiles of 8 or more tokens take GemmVnni instead: activations transposed once
// per tile (16 tokens per vector), the tile's weight rows decoded once into unsigned quants,
// then a micro-kernel of 4 rows x 16 tokens x 4 lanes doing, per block, exactly RowDot's float
// operations for each output (see GemmVnni's comment).
// GCC 12's AVX-512 broadcast intrinsics start from _mm512_undefined_*() and trip
// -W(maybe-)uninitialized inside its own headers; silenced for this translation unit only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "quant_dot_legacy.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "berth/core/fp16.h"
#include "berth/core/types.h"
#include "berth/cpu_kernels/quant_dot.h"

#if HWY_ARCH_X86
#include <immintrin.h>
#endif

HWY_BEFORE_NAMESPACE();

// vpdpbusd (AVX512_VNNI): Highway 1.0.3's AVX3_DL target checks the CPU for AVX512_VNNI at run
// time, but its target string names only the VEX-encoded "avxvnni", which AMD Zen 4 lacks, and
// with it GCC encodes _mm256_dpbusd_epi32 as {vex} vpdpbusd: SIGILL on Zen 4. So "avx512vnni" is
// added for this target (GCC applies a pragma target on top of the current ones; the 512-bit
// form is EVEX-only) and the 256-bit form is written as inline assembly with an explicit {evex}
// prefix (GCC/GNU as only).
#undef BERTH_QL_VNNI
#if HWY_TARGET == HWY_AVX3_DL && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx512vnni")
#define BERTH_QL_VNNI 1
#else
#define BERTH_QL_VNNI 0
#endif

#undef BERTH_QL_X86
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
#define BERTH_QL_X86 1
#else
#define BERTH_QL_X86 0
#endif

// AVX-512 (AVX3, AVX3_DL): two blocks per 512-bit vector.
#undef BERTH_QL_512
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
#define BERTH_QL_512 1
#else
#define BERTH_QL_512 0
#endif

namespace berth::cpu::qlegacy::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr int kQK = 32;                // elements per block (weights and activations)
constexpr size_t kActBlockBytes = 34;  // sizeof(BlockQ8_0): f16 d, then 32 int8 quants

template <GgmlType T>
constexpr size_t kWBlockBytes = T == GgmlType::Q4_0   ? 18
                                : T == GgmlType::Q4_1 ? 20
                                : T == GgmlType::Q5_0 ? 22
                                : T == GgmlType::Q5_1 ? 24
                                                      : 34;
template <GgmlType T>
constexpr bool kHasMin = T == GgmlType::Q4_1 || T == GgmlType::Q5_1;

// f16 at p (little-endian, any alignment) to f32, exactly.
HWY_INLINE float H2F(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if BERTH_QL_X86
  return _cvtsh_ss(h);  // F16C is part of Highway's AVX2 and AVX3 targets
#elif HWY_ARCH_ARM_A64
  __fp16 f;
  std::memcpy(&f, &h, 2);
  return static_cast<float>(f);
#else
  return fp16_to_f32(h);
#endif
}

#if BERTH_QL_X86
// ------------------------------------------------------------------------------------------
// x86: one block per 256-bit vector.
// ------------------------------------------------------------------------------------------
using DF = hn::Full256<float>;
using DI = hn::Full256<int32_t>;
using VI = hn::Vec256<int32_t>;

// A prepared weight block is two vectors: W0 the unsigned operand (|w| or the unsigned quant),
// W1 the signed weight whose sign is moved onto the activations (signed formats only).
using W0 = __m256i;
using W1 = __m256i;

// The 32 nibbles of qs[0..15]: bytes 0..15 low nibbles, bytes 16..31 high nibbles.
HWY_INLINE __m256i Nibbles(const uint8_t* qs) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i b = _mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
  return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

// 0xFF in byte j where bit j of the little-endian uint32 at qh is set, else 0.
HWY_INLINE __m256i BitBytes(const uint8_t* qh) {
  int32_t h;
  std::memcpy(&h, qh, 4);
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(h), spread);
  // Byte k of each 8-byte group keeps all bits but bit k set; it is all-ones iff bit k is set.
  const __m256i others = _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFELL);
  return _mm256_cmpeq_epi8(_mm256_or_si256(v, others), _mm256_set1_epi8(-1));
}

HWY_INLINE void Signed(__m256i w, W0& u, W1& s) {
  u = _mm256_sign_epi8(w, w);
  s = w;
}

template <GgmlType T>
HWY_INLINE void LoadW(const uint8_t* blk, W0& u, W1& s) {
  if constexpr (T == GgmlType::Q4_0) {
    Signed(_mm256_sub_epi8(Nibbles(blk + 2), _mm256_set1_epi8(8)), u, s);
  } else if constexpr (T == GgmlType::Q4_1) {
    u = Nibbles(blk + 4);
    s = _mm256_setzero_si256();
  } else if constexpr (T == GgmlType::Q5_0) {
    // q - 16 = nibble | 0xF0 (as int8) when the fifth bit is clear, the nibble when it is set.
    const __m256i hi = _mm256_andnot_si256(BitBytes(blk + 2), _mm256_set1_epi8(-16));
    Signed(_mm256_or_si256(Nibbles(blk + 6), hi), u, s);
  } else if constexpr (T == GgmlType::Q5_1) {
    const __m256i hi = _mm256_and_si256(BitBytes(blk + 4), _mm256_set1_epi8(0x10));
    u = _mm256_or_si256(Nibbles(blk + 8), hi);
    s = _mm256_setzero_si256();
  } else {
    Signed(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)), u, s);
  }
}

// Eight int32 partial sums of u[i] * s[i] (u unsigned, s signed bytes), exact.
HWY_INLINE __m256i DotUS(__m256i u, __m256i s) {
#if BERTH_QL_VNNI
  // EVEX-encoded explicitly (see BERTH_QL_VNNI above). AT&T order: signed, unsigned, acc.
  __m256i acc = _mm256_setzero_si256();
  asm("%{evex%} vpdpbusd %[s], %[u], %[acc]" : [acc] "+v"(acc) : [u] "v"(u), [s] "v"(s));
  return acc;
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

template <GgmlType T>
HWY_INLINE VI DotW(const W0& u, const W1& s, const uint8_t* aqs) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aqs));
  if constexpr (kHasMin<T>) {
    return VI{DotUS(u, a)};
  } else {
    return VI{DotUS(u, _mm256_sign_epi8(a, s))};
  }
}

// Partial sums of the 32 activation quants.
HWY_INLINE VI ASum(const uint8_t* aqs) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aqs));
  return VI{DotUS(_mm256_set1_epi8(1), a)};
}

#if BERTH_QL_512
// ------------------------------------------------------------------------------------------
// AVX-512: blocks b0 and b1 in one vector (bytes 0..31 block b0, 32..63 block b1, in element
// order, as two activation blocks side by side).
// ------------------------------------------------------------------------------------------

// Weights of two blocks: u the unsigned operand, neg (signed formats) the lanes where w < 0.
struct W2 {
  __m512i u;
  __mmask64 neg;
};

// [qs0 | qs1] nibbles in element order: lane 0 qs0 & 15, lane 1 qs0 >> 4, lanes 2, 3 of qs1.
HWY_INLINE __m512i Nibbles2(const uint8_t* qs0, const uint8_t* qs1) {
  __m512i z = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs0)));
  z = _mm512_mask_broadcast_i32x4(z, 0xFF00,
                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs1)));
  z = _mm512_mask_srli_epi16(z, 0xFF00FF00u, z, 4);  // 16-bit words of lanes 1 and 3
  return _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
}

// 32 bytes at p0 then 32 bytes at p1.
HWY_INLINE __m512i Load2x32(const uint8_t* p0, const uint8_t* p1) {
  const __m512i z =
      _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0)));
  return _mm512_mask_broadcast_i64x4(z, 0xF0,
                                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1)));
}

// Fifth bits of two Q5 blocks (qh at p0, p1) as a 64-lane mask.
HWY_INLINE __mmask64 Bits2(const uint8_t* p0, const uint8_t* p1) {
  uint32_t h0, h1;
  std::memcpy(&h0, p0, 4);
  std::memcpy(&h1, p1, 4);
  return _cvtu64_mask64(static_cast<uint64_t>(h0) | static_cast<uint64_t>(h1) << 32);
}

HWY_INLINE W2 Signed2(__m512i w) { return W2{_mm512_abs_epi8(w), _mm512_movepi8_mask(w)}; }

template <GgmlType T>
HWY_INLINE W2 LoadW2(const uint8_t* b0, const uint8_t* b1) {
  const __m512i k16 = _mm512_set1_epi8(16);
  if constexpr (T == GgmlType::Q4_0) {
    return Signed2(_mm512_sub_epi8(Nibbles2(b0 + 2, b1 + 2), _mm512_set1_epi8(8)));
  } else if constexpr (T == GgmlType::Q4_1) {
    return W2{Nibbles2(b0 + 4, b1 + 4), 0};
  } else if constexpr (T == GgmlType::Q5_0) {
    // q - 16: subtract 16 from the nibble where the fifth bit is clear.
    const __m512i nib = Nibbles2(b0 + 6, b1 + 6);
    return Signed2(_mm512_mask_sub_epi8(nib, _knot_mask64(Bits2(b0 + 2, b1 + 2)), nib, k16));
  } else if constexpr (T == GgmlType::Q5_1) {
    const __m512i nib = Nibbles2(b0 + 8, b1 + 8);
    return W2{_mm512_mask_add_epi8(nib, Bits2(b0 + 4, b1 + 4), nib, k16), 0};
  } else {
    return Signed2(Load2x32(b0 + 2, b1 + 2));
  }
}

// Sixteen int32 partial sums of u[i] * s[i] (u unsigned, s signed bytes), exact.
HWY_INLINE __m512i DotUS2(__m512i u, __m512i s) {
#if BERTH_QL_VNNI
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}

// The f16 at p0 as float in lanes 0..7, the f16 at p1 in lanes 8..15.
HWY_INLINE __m512 Spread2H(const uint8_t* p0, const uint8_t* p1) {
  uint16_t h0, h1;
  std::memcpy(&h0, p0, 2);
  std::memcpy(&h1, p1, 2);
  __m256i h = _mm256_set1_epi16(static_cast<short>(h0));
  h = _mm256_mask_set1_epi16(h, 0xFF00, static_cast<short>(h1));
  return _mm512_cvtph_ps(h);
}
#endif  // BERTH_QL_512

#elif HWY_TARGET == HWY_SCALAR
// ------------------------------------------------------------------------------------------
// HWY_SCALAR (one-lane vectors): plain integer loops.
// ------------------------------------------------------------------------------------------
using DI = hn::Sisd<int32_t>;
using DF = hn::Sisd<float>;
using VI = hn::Vec1<int32_t>;

struct W0 {
  int8_t q[kQK];  // offset quants (Q4_1/Q5_1: the unsigned quant)
};
using W1 = int;  // unused

template <GgmlType T>
HWY_INLINE void LoadW(const uint8_t* blk, W0& w, W1& unused) {
  unused = 0;
  if constexpr (T == GgmlType::Q8_0) {
    std::memcpy(w.q, blk + 2, kQK);
  } else {
    constexpr bool kFive = T == GgmlType::Q5_0 || T == GgmlType::Q5_1;
    constexpr size_t kQs = T == GgmlType::Q4_0 ? 2
                           : T == GgmlType::Q4_1 ? 4
                           : T == GgmlType::Q5_0 ? 6
                                                 : 8;
    constexpr int kOff = T == GgmlType::Q4_0 ? 8 : T == GgmlType::Q5_0 ? 16 : 0;
    uint32_t h = 0;
    if constexpr (kFive) std::memcpy(&h, blk + kQs - 4, 4);
    for (int j = 0; j < 16; ++j) {
      const int lo = (blk[kQs + j] & 0xF) | static_cast<int>((h >> j) & 1u) << 4;
      const int hi = (blk[kQs + j] >> 4) | static_cast<int>((h >> (j + 16)) & 1u) << 4;
      w.q[j] = static_cast<int8_t>(lo - kOff);
      w.q[j + 16] = static_cast<int8_t>(hi - kOff);
    }
  }
}

template <GgmlType T>
HWY_INLINE VI DotW(const W0& w, const W1&, const uint8_t* aqs) {
  int32_t s = 0;
  for (int j = 0; j < kQK; ++j) s += w.q[j] * static_cast<int8_t>(aqs[j]);
  return hn::Set(DI(), s);
}

HWY_INLINE VI ASum(const uint8_t* aqs) {
  int32_t s = 0;
  for (int j = 0; j < kQK; ++j) s += static_cast<int8_t>(aqs[j]);
  return hn::Set(DI(), s);
}

#else
// ------------------------------------------------------------------------------------------
// Portable: two 128-bit halves per block, widened to int16.
// ------------------------------------------------------------------------------------------
using D8 = hn::CappedTag<int8_t, 16>;
using DU8 = hn::RebindToUnsigned<D8>;
using D16 = hn::RepartitionToWide<D8>;
using DI = hn::RepartitionToWide<D16>;
using DF = hn::Rebind<float, DI>;
using V8 = hn::Vec<D8>;
using VI = hn::Vec<DI>;

// A prepared weight block is the weight quants of elements 0..15 (W0) and 16..31 (W1) as int8
// (offset applied for signed formats; Q4_1/Q5_1 quants 0..31 fit as they are). Separate
// variables, not a struct: SVE vectors are sizeless and cannot be members.
using W0 = V8;
using W1 = V8;

HWY_INLINE void Nibbles(const uint8_t* qs, hn::Vec<DU8>& lo, hn::Vec<DU8>& hi) {
  const DU8 du8;
  const auto q = hn::LoadU(du8, qs);
  lo = hn::And(q, hn::Set(du8, uint8_t{0x0F}));
  hi = hn::ShiftRight<4>(q);
}

// 0x10 in byte j where bit (j + first) of the uint32 h is set, for j < 16.
HWY_INLINE hn::Vec<DU8> FifthBits(uint32_t h, int first) {
  const DU8 du8;
  constexpr uint64_t kRep = 0x0101010101010101ULL;
  alignas(16)
      uint64_t rep[2] = {((h >> first) & 0xFFu) * kRep, ((h >> (first + 8)) & 0xFFu) * kRep};
  alignas(16) static constexpr uint8_t kBits[16] = {1, 2, 4, 8, 16, 32, 64, 128,
                                                    1, 2, 4, 8, 16, 32, 64, 128};
  const auto v = hn::LoadU(du8, reinterpret_cast<const uint8_t*>(rep));
  const auto set = hn::TestBit(v, hn::LoadU(du8, kBits));
  return hn::IfThenElseZero(set, hn::Set(du8, uint8_t{0x10}));
}

template <GgmlType T>
HWY_INLINE void LoadW(const uint8_t* blk, W0& w_lo, W1& w_hi) {
  const D8 d8;
  const DU8 du8;
  if constexpr (T == GgmlType::Q8_0) {
    w_lo = hn::LoadU(d8, reinterpret_cast<const int8_t*>(blk + 2));
    w_hi = hn::LoadU(d8, reinterpret_cast<const int8_t*>(blk + 18));
  } else {
    hn::Vec<DU8> lo, hi;
    if constexpr (T == GgmlType::Q4_0 || T == GgmlType::Q4_1) {
      Nibbles(blk + (T == GgmlType::Q4_0 ? 2 : 4), lo, hi);
    } else {
      const size_t qh_off = T == GgmlType::Q5_0 ? 2 : 4;
      uint32_t h;
      std::memcpy(&h, blk + qh_off, 4);
      Nibbles(blk + qh_off + 4, lo, hi);
      lo = hn::Or(lo, FifthBits(h, 0));
      hi = hn::Or(hi, FifthBits(h, 16));
    }
    constexpr int kOff = T == GgmlType::Q4_0 ? 8 : T == GgmlType::Q5_0 ? 16 : 0;
    const auto off = hn::Set(du8, static_cast<uint8_t>(kOff));
    w_lo = hn::BitCast(d8, hn::Sub(lo, off));
    w_hi = hn::BitCast(d8, hn::Sub(hi, off));
  }
}

// Accumulates the products of 16 int8 pairs into s0/s1 (int32 lanes).
HWY_INLINE void MulAcc16(V8 w, V8 a, VI& s0, VI& s1) {
  const D16 d16;
  const DI di;
  const hn::Half<D8> dh;
  s0 = hn::ReorderWidenMulAccumulate(di, hn::PromoteTo(d16, hn::LowerHalf(dh, w)),
                                     hn::PromoteTo(d16, hn::LowerHalf(dh, a)), s0, s1);
  s0 = hn::ReorderWidenMulAccumulate(di, hn::PromoteTo(d16, hn::UpperHalf(dh, w)),
                                     hn::PromoteTo(d16, hn::UpperHalf(dh, a)), s0, s1);
}

template <GgmlType T>
HWY_INLINE VI DotW(const W0& w_lo, const W1& w_hi, const uint8_t* aqs) {
  const D8 d8;
  const DI di;
  const auto* a = reinterpret_cast<const int8_t*>(aqs);
  VI s0 = hn::Zero(di), s1 = hn::Zero(di);
  MulAcc16(w_lo, hn::LoadU(d8, a), s0, s1);
  MulAcc16(w_hi, hn::LoadU(d8, a + 16), s0, s1);
  return hn::Add(s0, s1);
}

HWY_INLINE VI ASum(const uint8_t* aqs) {
  const D8 d8;
  const auto one = hn::Set(d8, int8_t{1});
  return DotW<GgmlType::Q4_1>(one, one, aqs);
}
#endif

using VF = hn::Vec<DF>;

#if BERTH_QL_X86
// ------------------------------------------------------------------------------------------
// x86 row kernels. The activations of a token group are first repacked (RepackTokens): the
// quants of a token contiguous and 64-byte aligned (qa, n + 32 bytes, the last 32 zero), and
// each block's scale as float repeated 8 times (ds, 8 floats per block plus 8 zeros), so a block
// needs one aligned 32-byte load of quants and one of scales, a pair of blocks one 64-byte load
// of each.
// ------------------------------------------------------------------------------------------
// Software prefetch distance along a weight row (bytes ahead of the block being decoded). A
// prefetch past the end of a row lands in the next row or is dropped by the hardware (no fault).
constexpr size_t kPrefetchBytes = 1024;

#if BERTH_QL_512
// Two blocks (b, b + 1) for one token: acc += [s_b x8 | s_b+1 x8] * float(isum lanes) with
// s = d_w * d_a (dws holds d_w spread the same way), plus the min term for Q4_1/Q5_1.
template <GgmlType T>
HWY_INLINE void AccTok2(const W2& w, __m512 dws, __m512 ms, const int8_t* qa, const float* ds,
                        __m512& acc) {
  const __m512i av = _mm512_load_si512(qa);
  const __m512 das = _mm512_load_ps(ds);
  __m512i dot;
  if constexpr (kHasMin<T>) {
    dot = DotUS2(w.u, av);
  } else {
    dot = DotUS2(w.u, _mm512_mask_sub_epi8(av, w.neg, _mm512_setzero_si512(), av));
  }
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dws, das), acc);
  if constexpr (kHasMin<T>) {
    const __m512i sum = DotUS2(_mm512_set1_epi8(1), av);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(ms, das), acc);
  }
}

// Blocks b and b1 = b + 1 of the weights (b1 = b for the last block of an odd count: the
// activation side of the repeat is the zero padding, quants and scales) into c0..c3.
template <GgmlType T, int NT>
HWY_INLINE void AccumPair(const uint8_t* w, const int8_t* const* qa, const float* const* ds,
                          int64_t b, int64_t b1, __m512& c0, __m512& c1, __m512& c2, __m512& c3) {
  const uint8_t* wb0 = w + static_cast<size_t>(b) * kWBlockBytes<T>;
  const uint8_t* wb1 = w + static_cast<size_t>(b1) * kWBlockBytes<T>;
  const W2 wq = LoadW2<T>(wb0, wb1);
  const __m512 dws = Spread2H(wb0, wb1);
  __m512 ms = _mm512_setzero_ps();
  if constexpr (kHasMin<T>) ms = Spread2H(wb0 + 2, wb1 + 2);
  const size_t oq = static_cast<size_t>(b) * kQK, os = static_cast<size_t>(b) * 8;
  AccTok2<T>(wq, dws, ms, qa[0] + oq, ds[0] + os, c0);
  if constexpr (NT > 1) AccTok2<T>(wq, dws, ms, qa[1] + oq, ds[1] + os, c1);
  if constexpr (NT > 2) AccTok2<T>(wq, dws, ms, qa[2] + oq, ds[2] + os, c2);
  if constexpr (NT > 3) AccTok2<T>(wq, dws, ms, qa[3] + oq, ds[3] + os, c3);
}

// res[k] = dot(weight row w, token k) for k < NT: block pairs (2p, 2p + 1) into e* for even p
// and o* for odd p, a last single block as a pair with the padding, then the lane sum of e + o.
template <GgmlType T, int NT>
HWY_NOINLINE void RowDot(const uint8_t* w, const int8_t* const* qa, const float* const* ds,
                         int64_t nb, float* res) {
  __m512 e0 = _mm512_setzero_ps(), e1 = e0, e2 = e0, e3 = e0;
  __m512 o0 = e0, o1 = e0, o2 = e0, o3 = e0;
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    // The hardware prefetcher alone leaves a single-thread weight stream short of DRAM speed.
    _mm_prefetch(reinterpret_cast<const char*>(w + static_cast<size_t>(b) * kWBlockBytes<T>) +
                     kPrefetchBytes,
                 _MM_HINT_T0);
    AccumPair<T, NT>(w, qa, ds, b, b + 1, e0, e1, e2, e3);
    AccumPair<T, NT>(w, qa, ds, b + 2, b + 3, o0, o1, o2, o3);
  }
  if (b + 2 <= nb) {
    AccumPair<T, NT>(w, qa, ds, b, b + 1, e0, e1, e2, e3);
    b += 2;
    if (b < nb) AccumPair<T, NT>(w, qa, ds, b, b, o0, o1, o2, o3);
  } else if (b < nb) {
    AccumPair<T, NT>(w, qa, ds, b, b, e0, e1, e2, e3);
  }
  res[0] = _mm512_reduce_add_ps(_mm512_add_ps(e0, o0));
  if constexpr (NT > 1) res[1] = _mm512_reduce_add_ps(_mm512_add_ps(e1, o1));
  if constexpr (NT > 2) res[2] = _mm512_reduce_add_ps(_mm512_add_ps(e2, o2));
  if constexpr (NT > 3) res[3] = _mm512_reduce_add_ps(_mm512_add_ps(e3, o3));
}
#else   // AVX2
// One block for one token: acc += (d_w * d_a) * float(isum lanes) [+ min term].
template <GgmlType T>
HWY_INLINE void AccTok(const W0& w0, const W1& w1, __m256 dw, __m256 m, const int8_t* qa,
                       const float* ds, __m256& acc) {
  const __m256 das = _mm256_load_ps(ds);
  const VI dot = DotW<T>(w0, w1, reinterpret_cast<const uint8_t*>(qa));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot.raw), _mm256_mul_ps(dw, das), acc);
  if constexpr (kHasMin<T>) {
    const VI sum = ASum(reinterpret_cast<const uint8_t*>(qa));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum.raw), _mm256_mul_ps(m, das), acc);
  }
}

template <GgmlType T, int NT>
HWY_INLINE void AccumBlock(const uint8_t* w, const int8_t* const* qa, const float* const* ds,
                           int64_t b, __m256& c0, __m256& c1, __m256& c2, __m256& c3) {
  const uint8_t* wb = w + static_cast<size_t>(b) * kWBlockBytes<T>;
  W0 w0;
  W1 w1;
  LoadW<T>(wb, w0, w1);
  const __m256 dw = _mm256_set1_ps(H2F(wb));
  __m256 m = _mm256_setzero_ps();
  if constexpr (kHasMin<T>) m = _mm256_set1_ps(H2F(wb + 2));
  const size_t oq = static_cast<size_t>(b) * kQK, os = static_cast<size_t>(b) * 8;
  AccTok<T>(w0, w1, dw, m, qa[0] + oq, ds[0] + os, c0);
  if constexpr (NT > 1) AccTok<T>(w0, w1, dw, m, qa[1] + oq, ds[1] + os, c1);
  if constexpr (NT > 2) AccTok<T>(w0, w1, dw, m, qa[2] + oq, ds[2] + os, c2);
  if constexpr (NT > 3) AccTok<T>(w0, w1, dw, m, qa[3] + oq, ds[3] + os, c3);
}

// res[k] = dot(weight row w, token k) for k < NT: even blocks into e*, odd blocks into o*, then
// the lane sum of e + o.
template <GgmlType T, int NT>
HWY_NOINLINE void RowDot(const uint8_t* w, const int8_t* const* qa, const float* const* ds,
                         int64_t nb, float* res) {
  const DF df;
  __m256 e0 = _mm256_setzero_ps(), e1 = e0, e2 = e0, e3 = e0;
  __m256 o0 = e0, o1 = e0, o2 = e0, o3 = e0;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(w + static_cast<size_t>(b) * kWBlockBytes<T>) +
                     kPrefetchBytes,
                 _MM_HINT_T0);
    AccumBlock<T, NT>(w, qa, ds, b, e0, e1, e2, e3);
    AccumBlock<T, NT>(w, qa, ds, b + 1, o0, o1, o2, o3);
  }
  if (b < nb) AccumBlock<T, NT>(w, qa, ds, b, e0, e1, e2, e3);
  auto hsum = [&](__m256 x, __m256 y) {
    return hn::GetLane(hn::SumOfLanes(df, hn::Vec256<float>{_mm256_add_ps(x, y)}));
  };
  res[0] = hsum(e0, o0);
  if constexpr (NT > 1) res[1] = hsum(e1, o1);
  if constexpr (NT > 2) res[2] = hsum(e2, o2);
  if constexpr (NT > 3) res[3] = hsum(e3, o3);
}
#endif  // BERTH_QL_512

// Per-thread scratch of the repacked activations of one token group (grows, never shrinks).
struct Repacked {
  std::vector<uint8_t> bytes;
  int8_t* qa[4];
  float* ds[4];
};

// Repacks nt activation rows (Q8_0, nb blocks, a[k]) into the layout described above.
HWY_INLINE void RepackTokens(const uint8_t* const* a, int nt, int64_t nb, Repacked& rp) {
  auto round64 = [](size_t x) { return (x + 63) / 64 * 64; };
  const size_t qbytes = round64((static_cast<size_t>(nb) + 1) * kQK);
  const size_t sbytes = round64((static_cast<size_t>(nb) + 1) * 8 * sizeof(float));
  const size_t per_tok = qbytes + sbytes;
  if (rp.bytes.size() < 4 * per_tok + 64) rp.bytes.resize(4 * per_tok + 64);
  uint8_t* base = rp.bytes.data();
  base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
  for (int k = 0; k < nt; ++k) {
    uint8_t* q = base + static_cast<size_t>(k) * per_tok;
    rp.qa[k] = reinterpret_cast<int8_t*>(q);
    rp.ds[k] = reinterpret_cast<float*>(q + qbytes);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* ab = a[k] + static_cast<size_t>(b) * kActBlockBytes;
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + static_cast<size_t>(b) * kQK),
                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab + 2)));
      _mm256_store_ps(rp.ds[k] + static_cast<size_t>(b) * 8, _mm256_set1_ps(H2F(ab)));
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(q + static_cast<size_t>(nb) * kQK),
                       _mm256_setzero_si256());
    _mm256_store_ps(rp.ds[k] + static_cast<size_t>(nb) * 8, _mm256_setzero_ps());
  }
}

#if BERTH_QL_VNNI
// ------------------------------------------------------------------------------------------
// AVX3_DL GEMM (n_tok >= kGemmMinTok): the same per-output float operations as RowDot above,
// vectorized across 16 tokens instead of across the lanes of one output. RowDot's AVX-512
// accumulators e, o hold 32 float chains per output: chain (c, l) for c = b % 4 (e lanes 0..7:
// c = 0, lanes 8..15: c = 1; o: c = 2, 3) and lane l = 0..7, each the FMA sequence, over the
// blocks b of its class in increasing order, of float(isum(b, l)) * (d_w(b) * d_a(b)) [then
// float(asum(b, l)) * (m(b) * d_a(b))], where isum(b, l) is the exact integer dot of quants
// 4l..4l+3 of block b and asum(b, l) the sum of those activation quants. Here a register holds
// chain (c, l) of 16 tokens: isum(b, l) comes from one vpdpbusd of the weight quants 4l..4l+3
// (unsigned: the stored quant, or w + 128 for Q8_0; broadcast) with the 4-byte groups l of the
// 16 tokens (signed, transposed once per tile), started from -offset * asum(b, l), which makes
// it exactly sum(w * a); d_w * d_a is one multiply per block for the 16 tokens. The odd last
// block's padding step of RowDot (an FMA of 0 by d_w * 0) and its final reduction (e + o, then
// _mm512_reduce_add_ps's tree) are repeated as they are, so outputs are bit-identical to RowDot.
// ------------------------------------------------------------------------------------------
constexpr int64_t kGemmMinTok = 8;  // fewer tokens: RowDot
constexpr int64_t kGemmRowBlock = 32;

template <GgmlType T>
constexpr int kUOff = T == GgmlType::Q4_0 ? 8 : T == GgmlType::Q5_0 ? 16 : T == GgmlType::Q8_0 ? 128 : 0;

// 64-byte aligned per-thread scratch (grows, never shrinks).
struct GemmScratch {
  std::vector<uint8_t> bytes;
  uint8_t* Get(size_t n) {
    if (bytes.size() < n + 64) bytes.resize(n + 64);
    uint8_t* p = bytes.data();
    return p + (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64;
  }
};

// The 32 unsigned weight quants of a block in element order (offset kUOff<T> added).
template <GgmlType T>
HWY_INLINE __m256i UnsignedW(const uint8_t* blk) {
  if constexpr (T == GgmlType::Q4_0) {
    return Nibbles(blk + 2);
  } else if constexpr (T == GgmlType::Q4_1) {
    return Nibbles(blk + 4);
  } else if constexpr (T == GgmlType::Q5_0) {
    return _mm256_or_si256(Nibbles(blk + 6),
                           _mm256_and_si256(BitBytes(blk + 2), _mm256_set1_epi8(0x10)));
  } else if constexpr (T == GgmlType::Q5_1) {
    return _mm256_or_si256(Nibbles(blk + 8),
                           _mm256_and_si256(BitBytes(blk + 4), _mm256_set1_epi8(0x10)));
  } else {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)),
                            _mm256_set1_epi8(static_cast<char>(0x80)));
  }
}

// Transposes block b of 16 activation rows a[0..15] into at[l] (l = 0..7: dword l of the 16
// tokens) and writes cs[l] = -kUOff * asum(b, l) (int32; offset-free types: float(asum)).
template <GgmlType T>
HWY_INLINE void TransposeBlock(const uint8_t* const* a, size_t off, __m512i* at, __m512i* cs) {
  __m512i r[8];
  for (int t = 0; t < 8; ++t) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[t] + off));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[t + 8] + off));
    r[t] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  __m512i s[8], u[8];
  for (int k = 0; k < 4; ++k) {
    s[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    s[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 2; ++k) {
    // Rows 4k..4k+3: u[4k + j] holds element j (128-bit lanes 0, 2) and j + 4 (lanes 1, 3).
    u[4 * k + 0] = _mm512_unpacklo_epi64(s[4 * k], s[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(s[4 * k], s[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(s[4 * k + 1], s[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(s[4 * k + 1], s[4 * k + 3]);
  }
  const __m512i ilo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i ihi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int j = 0; j < 4; ++j) {
    at[j] = _mm512_permutex2var_epi64(u[j], ilo, u[4 + j]);
    at[j + 4] = _mm512_permutex2var_epi64(u[j], ihi, u[4 + j]);
  }
  for (int l = 0; l < 8; ++l) {
    const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, at[l]);
    if constexpr (kUOff<T> != 0) {
      cs[l] = _mm512_mullo_epi32(sum, _mm512_set1_epi32(-kUOff<T>));
    } else {
      cs[l] = _mm512_castps_si512(_mm512_cvtepi32_ps(sum));
    }
  }
}

// Chain class c, lanes l0..l0 + 3, of NR rows (1 to 4) for 16 tokens: acc[r * 4 + j] (lane
// l0 + j) over blocks b = c, c + 4, ...
template <GgmlType T, int NR>
HWY_INLINE void Chains(const uint8_t* const* wu, const float* const* wd, const __m512i* at,
                       const __m512i* cs, const float* dt, int64_t nb, int c, int l0,
                       __m512* acc) {
  for (int i = 0; i < NR * 4; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = c; b < nb; b += 4) {
    const __m512 da = _mm512_load_ps(dt + b * 16);
    __m512 sc[NR], ms[NR];
    for (int r = 0; r < NR; ++r) {
      sc[r] = _mm512_mul_ps(_mm512_set1_ps(wd[r][2 * b]), da);
      if constexpr (kHasMin<T>) ms[r] = _mm512_mul_ps(_mm512_set1_ps(wd[r][2 * b + 1]), da);
    }
    const __m512i* ab = at + b * 8 + l0;
    const __m512i* cb = cs + b * 8 + l0;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i av = _mm512_load_si512(ab + j);
      const __m512i cv = _mm512_load_si512(cb + j);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        int32_t wq;
        std::memcpy(&wq, wu[r] + b * kQK + 4 * (l0 + j), 4);
        __m512i x = kUOff<T> != 0 ? cv : _mm512_setzero_si512();
        x = _mm512_dpbusd_epi32(x, _mm512_set1_epi32(wq), av);
        acc[r * 4 + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(x), sc[r], acc[r * 4 + j]);
        if constexpr (kHasMin<T>) {
          acc[r * 4 + j] = _mm512_fmadd_ps(_mm512_castsi512_ps(cv), ms[r], acc[r * 4 + j]);
        }
      }
    }
  }
}

template <GgmlType T>
void GemmVnni(const uint8_t* wp, size_t wrb, int64_t n_rows, const uint8_t* ap, size_t act_stride,
              int64_t n_tok, int64_t nb, float* out, int64_t out_stride) {
  thread_local GemmScratch wsc, asc;
  const int64_t n_chunks = (n_tok + 15) / 16;
  const size_t at_bytes = static_cast<size_t>(nb) * 8 * 64;
  const size_t chunk_bytes = 2 * at_bytes + static_cast<size_t>(nb) * 64;
  uint8_t* abuf = asc.Get(static_cast<size_t>(n_chunks) * chunk_bytes);
  // Activations: per 16-token chunk, at[b][l], cs[b][l] (64 bytes each), d_a dt[b][16].
  for (int64_t ch = 0; ch < n_chunks; ++ch) {
    const uint8_t* a[16];
    for (int t = 0; t < 16; ++t) {
      const int64_t tok = ch * 16 + t < n_tok ? ch * 16 + t : ch * 16;  // pad with a real row
      a[t] = ap + static_cast<size_t>(tok) * act_stride;
    }
    uint8_t* base = abuf + static_cast<size_t>(ch) * chunk_bytes;
    auto* at = reinterpret_cast<__m512i*>(base);
    auto* cs = reinterpret_cast<__m512i*>(base + at_bytes);
    auto* dt = reinterpret_cast<float*>(base + 2 * at_bytes);
    for (int64_t b = 0; b < nb; ++b) {
      const size_t off = static_cast<size_t>(b) * kActBlockBytes;
      TransposeBlock<T>(a, off + 2, at + b * 8, cs + b * 8);
      alignas(32) uint16_t h[16];
      for (int t = 0; t < 16; ++t) std::memcpy(&h[t], a[t] + off, 2);
      _mm512_store_ps(dt + b * 16,
                      _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h))));
    }
  }
  const size_t wu_bytes = static_cast<size_t>(nb) * kQK;
  const size_t wrow = (wu_bytes + static_cast<size_t>(nb) * 2 * sizeof(float) + 63) / 64 * 64;
  for (int64_t r0 = 0; r0 < n_rows; r0 += kGemmRowBlock) {
    const int64_t nr = n_rows - r0 < kGemmRowBlock ? n_rows - r0 : kGemmRowBlock;
    uint8_t* wbuf = wsc.Get(static_cast<size_t>(nr) * wrow);
    for (int64_t r = 0; r < nr; ++r) {
      const uint8_t* wr = wp + static_cast<size_t>(r0 + r) * wrb;
      uint8_t* u = wbuf + static_cast<size_t>(r) * wrow;
      auto* d = reinterpret_cast<float*>(u + wu_bytes);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wr + static_cast<size_t>(b) * kWBlockBytes<T>;
        _mm256_store_si256(reinterpret_cast<__m256i*>(u + b * kQK), UnsignedW<T>(blk));
        d[2 * b] = H2F(blk);
        d[2 * b + 1] = kHasMin<T> ? H2F(blk + 2) : 0.0f;
      }
    }
    for (int64_t ch = 0; ch < n_chunks; ++ch) {
      const uint8_t* base = abuf + static_cast<size_t>(ch) * chunk_bytes;
      const auto* at = reinterpret_cast<const __m512i*>(base);
      const auto* cs = reinterpret_cast<const __m512i*>(base + at_bytes);
      const auto* dt = reinterpret_cast<const float*>(base + 2 * at_bytes);
      const int64_t nt = n_tok - ch * 16 < 16 ? n_tok - ch * 16 : 16;
      for (int64_t r = 0; r < nr; r += 4) {
        const int rows = nr - r >= 4 ? 4 : static_cast<int>(nr - r);
        const uint8_t* wu[4];
        const float* wd[4];
        for (int k = 0; k < rows; ++k) {
          wu[k] = wbuf + static_cast<size_t>(r + k) * wrow;
          wd[k] = reinterpret_cast<const float*>(wu[k] + wu_bytes);
        }
        alignas(64) __m512 chain[4][32];  // [c][row * 8 + l]
        for (int c = 0; c < 4; ++c) {
          for (int l0 = 0; l0 < 8; l0 += 4) {
            alignas(64) __m512 acc[16];
            switch (rows) {
              case 4:
                Chains<T, 4>(wu, wd, at, cs, dt, nb, c, l0, acc);
                break;
              case 3:
                Chains<T, 3>(wu, wd, at, cs, dt, nb, c, l0, acc);
                break;
              case 2:
                Chains<T, 2>(wu, wd, at, cs, dt, nb, c, l0, acc);
                break;
              default:
                Chains<T, 1>(wu, wd, at, cs, dt, nb, c, l0, acc);
                break;
            }
            for (int k = 0; k < rows; ++k)
              for (int j = 0; j < 4; ++j) chain[c][k * 8 + l0 + j] = acc[k * 4 + j];
          }
        }
        for (int k = 0; k < rows; ++k) {
          if (nb % 2 == 1) {
            // RowDot's last pair (b, b) with the zero padding: chain c of block b + 1.
            const int64_t bl = nb - 1;
            const int c = static_cast<int>(bl % 4) + 1;
            const __m512 z = _mm512_setzero_ps();
            const __m512 sd = _mm512_mul_ps(_mm512_set1_ps(wd[k][2 * bl]), z);
            const __m512 sm = _mm512_mul_ps(_mm512_set1_ps(wd[k][2 * bl + 1]), z);
            for (int l = 0; l < 8; ++l) {
              __m512& v = chain[c][k * 8 + l];
              v = _mm512_fmadd_ps(z, sd, v);
              if constexpr (kHasMin<T>) v = _mm512_fmadd_ps(z, sm, v);
            }
          }
          // e + o: lane l = chain 0 + chain 2, lane 8 + l = chain 1 + chain 3; then the tree of
          // _mm512_reduce_add_ps (lanes i + 8, then i + 4, then pairs (0, 2), (1, 3), then 0 + 1).
          __m512 t3[8];
          for (int l = 0; l < 8; ++l) {
            const __m512 lo = _mm512_add_ps(chain[0][k * 8 + l], chain[2][k * 8 + l]);
            const __m512 hi = _mm512_add_ps(chain[1][k * 8 + l], chain[3][k * 8 + l]);
            t3[l] = _mm512_add_ps(hi, lo);
          }
          __m512 t6[4];
          for (int l = 0; l < 4; ++l) t6[l] = _mm512_add_ps(t3[l + 4], t3[l]);
          const __m512 res =
              _mm512_add_ps(_mm512_add_ps(t6[0], t6[2]), _mm512_add_ps(t6[1], t6[3]));
          alignas(64) float v[16];
          _mm512_store_ps(v, res);
          float* o = out + ch * 16 * out_stride + r0 + r + k;
          for (int64_t t = 0; t < nt; ++t) o[t * out_stride] = v[t];
        }
      }
    }
  }
}
#endif  // BERTH_QL_VNNI

template <GgmlType T>
void Tile(const void* w, int64_t n_rows, const void* act, size_t act_stride, int64_t n_tok,
          int64_t n, float* out, int64_t out_stride) {
  const int64_t nb = n / kQK;
  const size_t wrb = static_cast<size_t>(nb) * kWBlockBytes<T>;
  const auto* wp = static_cast<const uint8_t*>(w);
  const auto* ap = static_cast<const uint8_t*>(act);
  thread_local Repacked rp;
#if BERTH_QL_VNNI
  if (n_tok >= kGemmMinTok) {
    GemmVnni<T>(wp, wrb, n_rows, ap, act_stride, n_tok, nb, out, out_stride);
    return;
  }
#endif
  for (int64_t t0 = 0; t0 < n_tok; t0 += 4) {
    const int nt = static_cast<int>(n_tok - t0 < 4 ? n_tok - t0 : 4);
    const uint8_t* a[4];
    for (int k = 0; k < nt; ++k) a[k] = ap + static_cast<size_t>(t0 + k) * act_stride;
    RepackTokens(a, nt, nb, rp);
    const int8_t* const* qa = rp.qa;
    const float* const* ds = rp.ds;
    float* o = out + t0 * out_stride;
    for (int64_t r = 0; r < n_rows; ++r) {
      const uint8_t* wr = wp + static_cast<size_t>(r) * wrb;
      float res[4];
      switch (nt) {
        case 4:
          RowDot<T, 4>(wr, qa, ds, nb, res);
          break;
        case 3:
          RowDot<T, 3>(wr, qa, ds, nb, res);
          break;
        case 2:
          RowDot<T, 2>(wr, qa, ds, nb, res);
          break;
        default:
          RowDot<T, 1>(wr, qa, ds, nb, res);
          break;
      }
      for (int k = 0; k < nt; ++k) o[k * out_stride + r] = res[k];
    }
  }
}

#else   // !BERTH_QL_X86
// acc += (d_w * d_a) * float(isum lanes) [+ (m * d_a) * float(asum lanes)] for one token;
// ab is the activation block, da its scale as float.
template <GgmlType T>
HWY_INLINE void AccTok(const W0& w0, const W1& w1, float dw, float m, const uint8_t* ab, float da,
                       VF& acc) {
  const DF df;
  acc = hn::MulAdd(hn::ConvertTo(df, DotW<T>(w0, w1, ab + 2)), hn::Set(df, dw * da), acc);
  if constexpr (kHasMin<T>) {
    acc = hn::MulAdd(hn::ConvertTo(df, ASum(ab + 2)), hn::Set(df, m * da), acc);
  }
}

// Adds block b of weight row w times block b of the NT activation rows a[] (scales da[k][b])
// into c0..c3 (one accumulator per token; separate variables because SVE vectors cannot form
// arrays).
template <GgmlType T, int NT>
HWY_INLINE void AccumBlock(const uint8_t* w, const uint8_t* const* a, const float* const* da,
                           int64_t b, VF& c0, VF& c1, VF& c2, VF& c3) {
  const uint8_t* wb = w + static_cast<size_t>(b) * kWBlockBytes<T>;
  W0 w0;
  W1 w1;
  LoadW<T>(wb, w0, w1);
  const float dw = H2F(wb);
  float m = 0.0f;
  if constexpr (kHasMin<T>) m = H2F(wb + 2);
  const size_t off = static_cast<size_t>(b) * kActBlockBytes;
  AccTok<T>(w0, w1, dw, m, a[0] + off, da[0][b], c0);
  if constexpr (NT > 1) AccTok<T>(w0, w1, dw, m, a[1] + off, da[1][b], c1);
  if constexpr (NT > 2) AccTok<T>(w0, w1, dw, m, a[2] + off, da[2][b], c2);
  if constexpr (NT > 3) AccTok<T>(w0, w1, dw, m, a[3] + off, da[3][b], c3);
}

// res[k] = dot(weight row w, activation row a[k]) for k < NT, over nb blocks: even blocks into
// the accumulators e*, odd blocks into o*, then the lane sum of e + o.
template <GgmlType T, int NT>
HWY_NOINLINE void RowDot(const uint8_t* w, const uint8_t* const* a, const float* const* da,
                         int64_t nb, float* res) {
  const DF df;
  VF e0 = hn::Zero(df), e1 = e0, e2 = e0, e3 = e0;
  VF o0 = e0, o1 = e0, o2 = e0, o3 = e0;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    AccumBlock<T, NT>(w, a, da, b, e0, e1, e2, e3);
    AccumBlock<T, NT>(w, a, da, b + 1, o0, o1, o2, o3);
  }
  if (b < nb) AccumBlock<T, NT>(w, a, da, b, e0, e1, e2, e3);
  res[0] = hn::GetLane(hn::SumOfLanes(df, hn::Add(e0, o0)));
  if constexpr (NT > 1) res[1] = hn::GetLane(hn::SumOfLanes(df, hn::Add(e1, o1)));
  if constexpr (NT > 2) res[2] = hn::GetLane(hn::SumOfLanes(df, hn::Add(e2, o2)));
  if constexpr (NT > 3) res[3] = hn::GetLane(hn::SumOfLanes(df, hn::Add(e3, o3)));
}

// Tokens in groups of up to four (their activation scales converted to float once per group,
// into a per-thread buffer with a zero pad after each row), rows inside: each weight row is
// read once per group and its blocks decoded once for the group's tokens.
template <GgmlType T>
void Tile(const void* w, int64_t n_rows, const void* act, size_t act_stride, int64_t n_tok,
          int64_t n, float* out, int64_t out_stride) {
  const int64_t nb = n / kQK;
  const size_t wrb = static_cast<size_t>(nb) * kWBlockBytes<T>;
  const auto* wp = static_cast<const uint8_t*>(w);
  const auto* ap = static_cast<const uint8_t*>(act);
  thread_local std::vector<float> scales;
  const size_t sstride = static_cast<size_t>(nb) + 1;
  if (scales.size() < 4 * sstride) scales.resize(4 * sstride);
  for (int64_t t0 = 0; t0 < n_tok; t0 += 4) {
    const int nt = static_cast<int>(n_tok - t0 < 4 ? n_tok - t0 : 4);
    const uint8_t* a[4];
    const float* da[4];
    for (int k = 0; k < nt; ++k) {
      a[k] = ap + static_cast<size_t>(t0 + k) * act_stride;
      float* s = scales.data() + static_cast<size_t>(k) * sstride;
      for (int64_t b = 0; b < nb; ++b) s[b] = H2F(a[k] + static_cast<size_t>(b) * kActBlockBytes);
      s[nb] = 0.0f;
      da[k] = s;
    }
    float* o = out + t0 * out_stride;
    for (int64_t r = 0; r < n_rows; ++r) {
      const uint8_t* wr = wp + static_cast<size_t>(r) * wrb;
      float res[4];
      switch (nt) {
        case 4:
          RowDot<T, 4>(wr, a, da, nb, res);
          break;
        case 3:
          RowDot<T, 3>(wr, a, da, nb, res);
          break;
        case 2:
          RowDot<T, 2>(wr, a, da, nb, res);
          break;
        default:
          RowDot<T, 1>(wr, a, da, nb, res);
          break;
      }
      for (int k = 0; k < nt; ++k) o[k * out_stride + r] = res[k];
    }
  }
}
#endif  // BERTH_QL_X86

void DotTileLegacy(GgmlType t, const void* w, int64_t n_rows, const void* act, size_t act_stride,
                   int64_t n_tok, int64_t n, float* out, int64_t out_stride) {
  switch (t) {
    case GgmlType::Q4_0:
      return Tile<GgmlType::Q4_0>(w, n_rows, act, act_stride, n_tok, n, out, out_stride);
    case GgmlType::Q4_1:
      return Tile<GgmlType::Q4_1>(w, n_rows, act, act_stride, n_tok, n, out, out_stride);
    case GgmlType::Q5_0:
      return Tile<GgmlType::Q5_0>(w, n_rows, act, act_stride, n_tok, n, out, out_stride);
    case GgmlType::Q5_1:
      return Tile<GgmlType::Q5_1>(w, n_rows, act, act_stride, n_tok, n, out, out_stride);
    default:
      return Tile<GgmlType::Q8_0>(w, n_rows, act, act_stride, n_tok, n, out, out_stride);
  }
}

// Q8_0 quantization, bit for bit ggml's quantize_row_q8_0_ref as implemented by
// ref::quantize_row: d = amax / 127 (NaN inputs ignored), id = 1 / d (0 when d = 0),
// q = round-half-away-from-zero(clamp(x * id, -127, 127)) with NaN products giving 0,
// d stored as f16 (round to nearest even).
void QuantizeQ8_0(const float* HWY_RESTRICT x, void* HWY_RESTRICT dst, int64_t n) {
  const hn::CappedTag<float, kQK> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<int8_t, decltype(df)> d8;
  const size_t N = hn::Lanes(df);
  auto* out = static_cast<uint8_t*>(dst);
  const auto half = hn::Set(df, 0.5f);
  const auto one = hn::Set(df, 1.0f);
  const auto lim = hn::Set(df, 127.0f);
  for (int64_t b = 0; b < n / kQK; ++b, x += kQK, out += kActBlockBytes) {
    auto vmax = hn::Zero(df);
    for (size_t i = 0; i < kQK; i += N) {
      const auto v = hn::LoadU(df, x + i);
      vmax = hn::Max(vmax, hn::IfThenElseZero(hn::Eq(v, v), hn::Abs(v)));
    }
    const float amax = hn::GetLane(hn::MaxOfLanes(df, vmax));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t dh = f32_to_fp16(d);
    std::memcpy(out, &dh, 2);
    const auto vid = hn::Set(df, id);
    for (size_t i = 0; i < kQK; i += N) {
      auto v = hn::Mul(hn::LoadU(df, x + i), vid);
      v = hn::IfThenElseZero(hn::Eq(v, v), v);
      v = hn::Min(hn::Max(v, hn::Neg(lim)), lim);
      // Round() ties to even; a tie (|v - trunc(v)| == 0.5, exact below 2^23) goes away from 0.
      const auto tr = hn::Trunc(v);
      const auto tie = hn::Eq(hn::Abs(hn::Sub(v, tr)), half);
      const auto r = hn::IfThenElse(tie, hn::Add(tr, hn::CopySign(one, v)), hn::Round(v));
      hn::StoreU(hn::DemoteTo(d8, hn::ConvertTo(di, r)), d8,
                 reinterpret_cast<int8_t*>(out + 2 + i));
    }
  }
}

}  // namespace berth::cpu::qlegacy::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <fmt/format.h>

#include "berth/core/error.h"

namespace berth::cpu {
namespace qlegacy {
HWY_EXPORT(QuantizeQ8_0);
HWY_EXPORT(DotTileLegacy);
}  // namespace qlegacy

namespace detail {

/// Quantizes n floats (x, contiguous) into n / 32 Q8_0 blocks at dst (34 bytes each, any
/// alignment). Bit for bit equal to ref::quantize_row(Q8_0, ...) on every target.
/// Throws Error(invalid_argument) when n < 0, n % 32 != 0, or a pointer is null with n > 0.
void quantize_q8_0(const float* x, void* dst, int64_t n) {
  if (n < 0 || n % 32 != 0)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("quantize_activation(q8_0): {} elements are not a whole number of "
                            "32-element blocks",
                            n));
  if (n == 0) return;
  if (x == nullptr || dst == nullptr)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("quantize_activation(q8_0): null pointer for {} elements", n));
  HWY_DYNAMIC_DISPATCH(qlegacy::QuantizeQ8_0)(x, dst, n);
}

/// cpu::dot_tile for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights (see quant_dot.h for shapes).
/// Throws Error(invalid_argument) when n is not a non-negative multiple of 32, a count is
/// negative, a pointer needed for the work is null, act_stride is smaller than an activation
/// row when n_tok > 1, or out_stride < n_rows when n_tok > 1; Error(internal) for another type.
void dot_tile_legacy(GgmlType t, const void* w, int64_t n_rows, const void* act, size_t act_stride,
                     int64_t n_tok, int64_t n, float* out, int64_t out_stride) {
  if (t != GgmlType::Q4_0 && t != GgmlType::Q4_1 && t != GgmlType::Q5_0 && t != GgmlType::Q5_1 &&
      t != GgmlType::Q8_0)
    throw Error(ErrorCategory::internal,
                fmt::format("dot_tile_legacy: {} is not a 32-element legacy type", type_name(t)));
  if (n < 0 || n % 32 != 0 || n_rows < 0 || n_tok < 0)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("dot_tile({}): bad shape n={} n_rows={} n_tok={} (n must be a "
                            "multiple of 32)",
                            type_name(t), n, n_rows, n_tok));
  if (n_rows == 0 || n_tok == 0) return;
  if (out == nullptr || (n > 0 && (w == nullptr || act == nullptr)))
    throw Error(
        ErrorCategory::invalid_argument,
        fmt::format("dot_tile({}): null pointer for a {}x{} tile", type_name(t), n_rows, n_tok));
  if (n_tok > 1 && (act_stride < row_bytes(GgmlType::Q8_0, n) || out_stride < n_rows))
    throw Error(
        ErrorCategory::invalid_argument,
        fmt::format("dot_tile({}): act_stride {} (row {} bytes) or out_stride {} "
                    "(n_rows {}) too small",
                    type_name(t), act_stride, row_bytes(GgmlType::Q8_0, n), out_stride, n_rows));
  HWY_DYNAMIC_DISPATCH(qlegacy::DotTileLegacy)
  (t, w, n_rows, act, act_stride, n_tok, n, out, out_stride);
}

}  // namespace detail
}  // namespace berth::cpu
#endif  // HWY_ONCE
