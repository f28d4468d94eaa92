// Highway kernels of the legacy 32-element formats: Q8_0 activation quantization and the dot
// tiles of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights against Q8_0 activations (quant_dot.h).
//
// Formats: quants_ref.h (ggml-common.h block layouts). Scalar twins: quant_dot_legacy_ref.cpp
// (dot) and quants_ref.cpp's quant_q8_0 (activation quantization).
//
// Per block b of a weight row and an activation row the kernel forms the exact integer dot
// product of the 32 quants as a vector of int32 partial sums (lanes), converts it to float and
// accumulates it, times d_w * d_a, into one of two float vector accumulators (alternating
// blocks, or block pairs on AVX-512: two independent FMA chains; AVX3_DL: see below).
// Q4_1/Q5_1 add (m * d_a) times the partial sums of the activation quants. The result is the
// lane sum of the two accumulators. The order of operations for one output depends only on n and
// the target, never on the tile shape or the number of tokens, so outputs are bit-identical however
// a matrix is split into tiles (quant_dot.h's determinism contract).
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
// AVX3_DL (GCC) has its own float order, shared by its GEMV (RowDotC) and GEMM (GemmVnni, tiles
// of 8 or more tokens): one conversion and FMA per whole block into 16 chains (see the AVX3_DL
// section), so the GEMM, vectorized across 16 tokens, does one float step per block, row and 16
// tokens instead of one per 4-element lane.
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
// AVX3_DL (GCC): decode GEMV and GEMM share one float order per output in which each block
// enters once, as a whole. Its exact integer dot isum_b = sum_i w_i * a_i (and, for Q4_1/Q5_1,
// asum_b = sum_i a_i) is converted to float and accumulated by one FMA into one of 16 chains:
//   chain[c] = fma(float(isum_b), d_w(b) * d_a(b), chain[c])
//   chain[c] = fma(float(asum_b), m_w(b) * d_a(b), chain[c])        (Q4_1, Q5_1)
// with c = kLaneOf(b % 16), blocks in increasing order within a chain, chains starting at +0;
// the output is the sum of the 16 chains by the fixed tree of Tree16 (lane i + lane i+8, then
// i + 4, i + 2, i + 1). One float conversion and FMA per block and output, instead of one per
// 4-element lane, is what lets the GEMM reach its integer rate.
//   GEMV (RowDotC): the chains are the 16 lanes of one vector. Per 16 blocks, vpdpbusd leaves 8
// int32 partial sums per block (two blocks per vector, sign trick as above), a transposing add
// tree (ReduceBlocks16) brings block b's total to lane kLaneOf(b), one gather fetches the 16
// weight scales, and one conversion and one FMA update all chains.
//   GEMM (GemmVnni): a vector holds one chain for 16 tokens. Activations are transposed once per
// tile (dword l of each block for 16 tokens per vector); the tile's weight rows are decoded
// once into unsigned quants (offset kUOff). Per chain, block, 4 rows and 2 token vectors: 8
// vpdpbusd (one broadcast weight dword against 16 tokens' activations) starting from
// -kUOff * asum_b, which gives isum_b exactly, then one conversion and one FMA.
// ------------------------------------------------------------------------------------------
constexpr int64_t kGemmMinTok = 8;  // fewer tokens: RowDotC per group of up to 4 tokens
constexpr int64_t kGemmRowBlock = 64;

// Lane (chain) of block b % 16, and its inverse: the order ReduceBlocks16 leaves blocks in
// (lanes 0-3: blocks 0, 2, 4, 6; 4-7: 1, 3, 5, 7; 8-11: 8, 10, 12, 14; 12-15: 9, 11, 13, 15).
constexpr int kLaneOf(int b) { return (b & 8) | ((b & 1) << 2) | ((b & 7) >> 1); }
constexpr int kBlockOf(int lane) { return ((lane & 8) | ((lane >> 2) & 1)) + 2 * (lane & 3); }
static_assert(kBlockOf(kLaneOf(5)) == 5 && kBlockOf(kLaneOf(14)) == 14 && kLaneOf(9) == 12);

template <GgmlType T>
constexpr int kUOff = T == GgmlType::Q4_0   ? 8
                      : T == GgmlType::Q5_0 ? 16
                      : T == GgmlType::Q8_0 ? 128
                                            : 0;

// 64-byte aligned per-thread scratch (grows, never shrinks).
struct GemmScratch {
  std::vector<uint8_t> bytes;
  uint8_t* Get(size_t n) {
    if (bytes.size() < n + 64) bytes.resize(n + 64);
    uint8_t* p = bytes.data();
    return p + (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64;
  }
};

// Sum of the 16 lanes by the chain tree: lanes i + (i + 8), then + 4, + 2, + 1.
HWY_INLINE float Tree16(__m512 v) {
  const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)));
}

// v[p]: int32 partial sums of block 2p (lanes 0-7) and 2p + 1 (lanes 8-15). Returns the block
// totals, block b in lane kLaneOf(b).
HWY_INLINE __m512i ReduceBlocks16(const __m512i* v) {
  auto l1 = [](__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  };
  const __m512i s01 = l1(v[0], v[1]), s23 = l1(v[2], v[3]);
  const __m512i s45 = l1(v[4], v[5]), s67 = l1(v[6], v[7]);
  // Dword i of 128-bit lane q: the sum of 128-bit lane q of v[i] (t0) or v[4 + i] (t1).
  const __m512i t0 =
      _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
  const __m512i t1 =
      _mm512_add_epi32(_mm512_unpacklo_epi64(s45, s67), _mm512_unpackhi_epi64(s45, s67));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(t0, t1, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(t0, t1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Repacked activations of up to four tokens for RowDotC: qa the quants (64-byte aligned, 64 zero
// bytes after the last block), dp / sp per group of 16 blocks the scale d_a(b) / float(asum_b)
// of block b in lane kLaneOf(b % 16) (0 past the last block).
struct RepackedC {
  std::vector<uint8_t> bytes;
  int8_t* qa[4];
  float* dp[4];
  float* sp[4];
};

template <GgmlType T>
HWY_INLINE void RepackTokensC(const uint8_t* const* a, int nt, int64_t nb, RepackedC& rp) {
  auto round64 = [](size_t x) { return (x + 63) / 64 * 64; };
  const int64_t ng = (nb + 15) / 16;
  // RowDotC reads whole groups of 16 blocks plus 64 bytes; past the last block: zeros.
  const size_t qbytes = static_cast<size_t>(ng) * 16 * kQK + 64;
  const size_t fbytes = static_cast<size_t>(ng) * 16 * sizeof(float);
  const size_t per_tok = qbytes + 2 * fbytes;
  if (rp.bytes.size() < 4 * per_tok + 64) rp.bytes.resize(4 * per_tok + 64);
  uint8_t* base = rp.bytes.data();
  base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
  for (int k = 0; k < nt; ++k) {
    uint8_t* q = base + static_cast<size_t>(k) * per_tok;
    rp.qa[k] = reinterpret_cast<int8_t*>(q);
    rp.dp[k] = reinterpret_cast<float*>(q + qbytes);
    rp.sp[k] = reinterpret_cast<float*>(q + qbytes + fbytes);
    for (int64_t b = 0; b < nb; ++b)
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + static_cast<size_t>(b) * kQK),
                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                             a[k] + static_cast<size_t>(b) * kActBlockBytes + 2)));
    std::memset(q + static_cast<size_t>(nb) * kQK, 0, qbytes - static_cast<size_t>(nb) * kQK);
    for (int64_t g = 0; g < ng; ++g)
      for (int lane = 0; lane < 16; ++lane) {
        const int64_t b = 16 * g + kBlockOf(lane);
        float d = 0.0f, s = 0.0f;
        if (b < nb) {
          const uint8_t* ab = a[k] + static_cast<size_t>(b) * kActBlockBytes;
          d = H2F(ab);
          if constexpr (kHasMin<T>) {
            int32_t sum = 0;
            for (int i = 0; i < kQK; ++i) sum += static_cast<int8_t>(ab[2 + i]);
            s = static_cast<float>(sum);
          }
        }
        rp.dp[k][16 * g + lane] = d;
        rp.sp[k][16 * g + lane] = s;
      }
  }
}

// Word tables of ScaleWords: for window j (128 bytes of a group of 16 blocks) and lane L, the
// word of the window holding the f16 at byte 2 * kWord of block kBlockOf(L) (0 if elsewhere);
// sel[j]: the lanes whose word lies in window j.
template <GgmlType T, int kWord>
struct ScaleTables {
  static constexpr int kH = static_cast<int>(kWBlockBytes<T>) / 2;  // words per block
  static constexpr int kWindows = (16 * kH + 63) / 64;
  alignas(64) int16_t idx[kWindows][32];
  uint32_t sel[kWindows];
  constexpr ScaleTables() : idx{}, sel{} {
    for (int j = 0; j < kWindows; ++j) {
      sel[j] = 0;
      for (int lane = 0; lane < 32; ++lane) idx[j][lane] = 0;
      for (int lane = 0; lane < 16; ++lane) {
        const int word = kBlockOf(lane) * kH + kWord - 64 * j;
        if (word >= 0 && word < 64) {
          idx[j][lane] = static_cast<int16_t>(word);
          sel[j] |= 1u << lane;
        }
      }
    }
  }
};

// The f16 at byte 2 * kWord of each of the nbg (<= 16) blocks at wg, block b in word kLaneOf(b)
// (0 for absent blocks): masked loads of the group's bytes (never past block nbg - 1) and one
// two-table word permute per 128 bytes.
template <GgmlType T, int kWord>
HWY_INLINE __m256i ScaleWords(const uint8_t* wg, int nbg) {
  static constexpr ScaleTables<T, kWord> kTab{};
  constexpr int kH = ScaleTables<T, kWord>::kH;
  const int valid = nbg * kH;  // words of the group
  __m512i r = _mm512_setzero_si512();
#pragma GCC unroll 5
  for (int j = 0; j < ScaleTables<T, kWord>::kWindows; ++j) {
    __m512i half[2];
    for (int h = 0; h < 2; ++h) {
      const int v = valid - 64 * j - 32 * h;
      const __mmask32 lm = v >= 32 ? 0xFFFFFFFFu : v <= 0 ? 0u : (1u << v) - 1u;
      half[h] = _mm512_maskz_loadu_epi16(lm, wg + 128 * j + 64 * h);
    }
    const __m512i t = _mm512_permutex2var_epi16(half[0], _mm512_load_si512(kTab.idx[j]), half[1]);
    r = _mm512_mask_mov_epi16(r, kTab.sel[j], t);
  }
  return _mm512_castsi512_si256(r);
}

// res[k] = dot(weight row w, token k) for k < NT in the chain order above.
template <GgmlType T, int NT>
HWY_NOINLINE void RowDotC(const uint8_t* w, const RepackedC& rp, int64_t nb, float* res) {
  constexpr size_t B = kWBlockBytes<T>;
  __m512 ch[NT];
  for (int k = 0; k < NT; ++k) ch[k] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < nb; g0 += 16) {
    const uint8_t* wg = w + static_cast<size_t>(g0) * B;
    // The hardware prefetcher alone leaves a single-thread weight stream short of DRAM speed.
#pragma GCC unroll 9
    for (size_t off = 0; off < 16 * B; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wg) + kPrefetchBytes + off, _MM_HINT_T0);
    const int nbg = nb - g0 < 16 ? static_cast<int>(nb - g0) : 16;
    __mmask16 m = 0xFFFF;
    W2 wq[8];
    if (nbg == 16) {
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) wq[p] = LoadW2<T>(wg + 2 * p * B, wg + (2 * p + 1) * B);
    } else {
      m = 0;
      for (int b = 0; b < nbg; ++b) m = static_cast<__mmask16>(m | (1u << kLaneOf(b)));
      for (int p = 0; p < 8; ++p) {
        const int b0 = 2 * p < nbg ? 2 * p : 0;
        const int b1 = 2 * p + 1 < nbg ? 2 * p + 1 : b0;
        wq[p] = LoadW2<T>(wg + b0 * B, wg + b1 * B);  // lanes of absent blocks are masked below
      }
    }
    const __m512 dw = _mm512_cvtph_ps(ScaleWords<T, 0>(wg, nbg));
    __m512 mw = _mm512_setzero_ps();
    if constexpr (kHasMin<T>) mw = _mm512_cvtph_ps(ScaleWords<T, 1>(wg, nbg));
#pragma GCC unroll 4
    for (int k = 0; k < NT; ++k) {
      const int8_t* qa = rp.qa[k] + static_cast<size_t>(g0) * kQK;
      __m512i v[8];
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        const __m512i av = _mm512_load_si512(qa + 64 * p);  // zero padding past the row
        if constexpr (kHasMin<T>) {
          v[p] = DotUS2(wq[p].u, av);
        } else {
          v[p] = DotUS2(wq[p].u, _mm512_mask_sub_epi8(av, wq[p].neg, _mm512_setzero_si512(), av));
        }
      }
      const __m512 da = _mm512_load_ps(rp.dp[k] + g0);
      ch[k] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(ReduceBlocks16(v)), _mm512_mul_ps(dw, da),
                                    ch[k], m);
      if constexpr (kHasMin<T>)
        ch[k] =
            _mm512_mask3_fmadd_ps(_mm512_load_ps(rp.sp[k] + g0), _mm512_mul_ps(mw, da), ch[k], m);
    }
  }
  for (int k = 0; k < NT; ++k) res[k] = Tree16(ch[k]);
}

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

// One block of a 16-token chunk in the GEMM's activation scratch: at[l] dword l of the block's
// quants for the 16 tokens, cs the block's start value per token (-kUOff * asum_b as int32; for
// the offset-free Q4_1/Q5_1 float(asum_b)), da the 16 scales d_a(b).
struct alignas(64) TBlock {
  __m512i at[8];
  __m512i cs;
  __m512 da;
};

// Transposes block `off` (byte offset of its quants) of 16 activation rows a[0..15] into tb.
template <GgmlType T>
HWY_INLINE void TransposeBlock(const uint8_t* const* a, size_t off, TBlock& tb) {
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
  for (int j = 0; j < 4; ++j) {
    tb.at[j] = _mm512_permutex2var_epi64(u[j], ilo, u[4 + j]);
    tb.at[j + 4] = _mm512_permutex2var_epi64(u[j], ihi, u[4 + j]);
  }
  __m512i sum = _mm512_setzero_si512();
  for (int l = 0; l < 8; ++l) sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), tb.at[l]);
  if constexpr (kUOff<T> != 0) {
    tb.cs = _mm512_mullo_epi32(sum, _mm512_set1_epi32(-kUOff<T>));
  } else {
    tb.cs = _mm512_castps_si512(_mm512_cvtepi32_ps(sum));
  }
}

// Chain of blocks b0, b0 + 16, ... for NR rows (decoded quants wu[r], scales wd[r][2b] = d_w,
// wd[r][2b + 1] = m_w) and NT 16-token chunks (tb[t], block-indexed): acc[r * NT + t].
template <GgmlType T, int NR, int NT>
HWY_INLINE void ChainC(const uint8_t* const* wu, const float* const* wd, const TBlock* const* tb,
                       int64_t nb, int b0, __m512* acc) {
#pragma GCC unroll 8
  for (int i = 0; i < NR * NT; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = b0; b < nb; b += 16) {
    __m512i x[NR * NT];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t)
        x[r * NT + t] = kUOff<T> != 0 ? tb[t][b].cs : _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) {
      __m512i av[NT];
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) av[t] = tb[t][b].at[l];
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        int32_t wq;
        std::memcpy(&wq, wu[r] + b * kQK + 4 * l, 4);
        const __m512i wv = _mm512_set1_epi32(wq);
#pragma GCC unroll 2
        for (int t = 0; t < NT; ++t) x[r * NT + t] = _mm512_dpbusd_epi32(x[r * NT + t], wv, av[t]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m512 dw = _mm512_set1_ps(wd[r][2 * b]);
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) {
        __m512& c = acc[r * NT + t];
        c = _mm512_fmadd_ps(_mm512_cvtepi32_ps(x[r * NT + t]), _mm512_mul_ps(dw, tb[t][b].da), c);
        if constexpr (kHasMin<T>)
          c = _mm512_fmadd_ps(_mm512_castsi512_ps(tb[t][b].cs),
                              _mm512_mul_ps(_mm512_set1_ps(wd[r][2 * b + 1]), tb[t][b].da), c);
      }
    }
  }
}

// NR rows x NT chunks: the 16 chains, then Tree16's sums, written to out (chunk t's tokens at
// out + t * 16 * out_stride, nt[t] of them valid).
template <GgmlType T, int NR, int NT>
HWY_INLINE void MicroC(const uint8_t* const* wu, const float* const* wd, const TBlock* const* tb,
                       int64_t nb, const int64_t* nt, float* out, int64_t out_stride) {
  alignas(64) __m512 ch[16][NR * NT];
  for (int lane = 0; lane < 16; ++lane) {
    if (kBlockOf(lane) < nb) {
      ChainC<T, NR, NT>(wu, wd, tb, nb, kBlockOf(lane), ch[lane]);
    } else {
      for (int i = 0; i < NR * NT; ++i) ch[lane][i] = _mm512_setzero_ps();
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) {
      const int i = r * NT + t;
      __m512 s8[8], s4[4];
      for (int j = 0; j < 8; ++j) s8[j] = _mm512_add_ps(ch[j][i], ch[j + 8][i]);
      for (int j = 0; j < 4; ++j) s4[j] = _mm512_add_ps(s8[j], s8[j + 4]);
      const __m512 res = _mm512_add_ps(_mm512_add_ps(s4[0], s4[2]), _mm512_add_ps(s4[1], s4[3]));
      alignas(64) float v[16];
      _mm512_store_ps(v, res);
      float* o = out + t * 16 * out_stride + r;
      for (int64_t k = 0; k < nt[t]; ++k) o[k * out_stride] = v[k];
    }
}

template <GgmlType T>
void GemmVnni(const uint8_t* wp, size_t wrb, int64_t n_rows, const uint8_t* ap, size_t act_stride,
              int64_t n_tok, int64_t nb, float* out, int64_t out_stride) {
  thread_local GemmScratch wsc, asc;
  const int64_t n_chunks = (n_tok + 15) / 16;
  TBlock* tbuf =
      reinterpret_cast<TBlock*>(asc.Get(static_cast<size_t>(n_chunks * nb) * sizeof(TBlock)));
  for (int64_t ch = 0; ch < n_chunks; ++ch) {
    const uint8_t* a[16];
    for (int t = 0; t < 16; ++t) {
      const int64_t tok = ch * 16 + t < n_tok ? ch * 16 + t : ch * 16;  // pad with a real row
      a[t] = ap + static_cast<size_t>(tok) * act_stride;
    }
    TBlock* tb = tbuf + ch * nb;
    for (int64_t b = 0; b < nb; ++b) {
      const size_t off = static_cast<size_t>(b) * kActBlockBytes;
      TransposeBlock<T>(a, off + 2, tb[b]);
      alignas(32) uint16_t h[16];
      for (int t = 0; t < 16; ++t) std::memcpy(&h[t], a[t] + off, 2);
      tb[b].da = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h)));
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
    for (int64_t c0 = 0; c0 < n_chunks; c0 += 2) {
      const int nc = n_chunks - c0 >= 2 ? 2 : 1;
      const TBlock* tb[2] = {tbuf + c0 * nb, tbuf + (c0 + nc - 1) * nb};
      int64_t nt[2];
      for (int t = 0; t < nc; ++t) nt[t] = n_tok - (c0 + t) * 16 < 16 ? n_tok - (c0 + t) * 16 : 16;
      float* o = out + c0 * 16 * out_stride + r0;
      int64_t r = 0;
      for (; r + 4 <= nr; r += 4) {
        const uint8_t* wu[4];
        const float* wd[4];
        for (int k = 0; k < 4; ++k) {
          wu[k] = wbuf + static_cast<size_t>(r + k) * wrow;
          wd[k] = reinterpret_cast<const float*>(wu[k] + wu_bytes);
        }
        if (nc == 2) {
          MicroC<T, 4, 2>(wu, wd, tb, nb, nt, o + r, out_stride);
        } else {
          MicroC<T, 4, 1>(wu, wd, tb, nb, nt, o + r, out_stride);
        }
      }
      for (; r < nr; ++r) {
        const uint8_t* wu = wbuf + static_cast<size_t>(r) * wrow;
        const float* wd = reinterpret_cast<const float*>(wu + wu_bytes);
        if (nc == 2) {
          MicroC<T, 1, 2>(&wu, &wd, tb, nb, nt, o + r, out_stride);
        } else {
          MicroC<T, 1, 1>(&wu, &wd, tb, nb, nt, o + r, out_stride);
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
#if BERTH_QL_VNNI
  if (n_tok >= kGemmMinTok) {
    GemmVnni<T>(wp, wrb, n_rows, ap, act_stride, n_tok, nb, out, out_stride);
    return;
  }
  thread_local RepackedC rp;
#else
  thread_local Repacked rp;
#endif
  for (int64_t t0 = 0; t0 < n_tok; t0 += 4) {
    const int nt = static_cast<int>(n_tok - t0 < 4 ? n_tok - t0 : 4);
    const uint8_t* a[4];
    for (int k = 0; k < nt; ++k) a[k] = ap + static_cast<size_t>(t0 + k) * act_stride;
    float* o = out + t0 * out_stride;
#if BERTH_QL_VNNI
    RepackTokensC<T>(a, nt, nb, rp);
    for (int64_t r = 0; r < n_rows; ++r) {
      const uint8_t* wr = wp + static_cast<size_t>(r) * wrb;
      float res[4];
      switch (nt) {
        case 4:
          RowDotC<T, 4>(wr, rp, nb, res);
          break;
        case 3:
          RowDotC<T, 3>(wr, rp, nb, res);
          break;
        case 2:
          RowDotC<T, 2>(wr, rp, nb, res);
          break;
        default:
          RowDotC<T, 1>(wr, rp, nb, res);
          break;
      }
      for (int k = 0; k < nt; ++k) o[k * out_stride + r] = res[k];
    }
#else
    RepackTokens(a, nt, nb, rp);
    const int8_t* const* qa = rp.qa;
    const float* const* ds = rp.ds;
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
#endif
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

// Whether Tile blocks for the cache itself when n_tok > 1 (GemmVnni).
bool GemmTilesItself() { return BERTH_QL_VNNI != 0; }

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
HWY_EXPORT(GemmTilesItself);
}  // namespace qlegacy

namespace detail {

/// Whether the legacy dot_tile of the CPU's dispatched target blocks for the cache itself when
/// n_tok > 1 (quant_dot.h; AVX3_DL's GemmVnni). No errors.
bool legacy_gemm_tiles_itself() { return HWY_DYNAMIC_DISPATCH(qlegacy::GemmTilesItself)(); }

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
