// Scalar reference quantization and dequantization for every computable type, bit for bit in
// ggml's block layouts (ggml/src/ggml-common.h for the structs; ggml-quants.c for the
// formulas). These are the "reference twins" that tests and the naive forward use; SIMD
// kernels are checked against them.
//
// All functions work on whole rows: `n` elements along the contiguous axis, n a multiple of
// the type's block size (1 for F32/F16/BF16). Passing another n (or n < 0, or a null pointer
// with n > 0) throws berth::Error(invalid_argument); a known ggml type that berth cannot
// compute with (TypeTraits::computable false, e.g. IQ2_XXS, Q8_1) throws
// berth::Error(unsupported); a value that is not a ggml type id throws berth::Error(internal).
// Pointers need no particular alignment for the quantized side; float arrays must be aligned
// as floats.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "berth/core/types.h"

namespace berth {

// ---------------------------------------------------------------------------------------------
// Block layouts (ggml-common.h). Every `uint16_t d`/`dmin`/`m` is an IEEE binary16 value
// (ggml_half) stored little-endian; decode with fp16_to_f32 (berth/core/fp16.h). The structs
// mirror the file bytes on a little-endian host (asserted below). Sizes are checked by
// static_assert (the block_bytes of the type table). All structs are trivially copyable and
// have no padding, so a row of n elements is n / block_size consecutive structs. Their
// alignment is 2 (4 for BlockQ8_K); GGUF aligns tensor data (32 bytes by default), but the
// reference functions below copy blocks with memcpy and accept any address.
// Decoded value of element i of a block, as a formula, is given with each struct.
// ---------------------------------------------------------------------------------------------

inline constexpr int kQK4_0 = 32;  ///< elements per Q4_0 block
inline constexpr int kQK4_1 = 32;  ///< elements per Q4_1 block
inline constexpr int kQK5_0 = 32;  ///< elements per Q5_0 block
inline constexpr int kQK5_1 = 32;  ///< elements per Q5_1 block
inline constexpr int kQK8_0 = 32;  ///< elements per Q8_0 block
/// Bytes of the packed 6-bit scales and mins of Q4_K/Q5_K (ggml's K_SCALE_SIZE).
inline constexpr int kKScaleSize = 12;

/// Q4_0, 32 elements in 18 bytes. Element j < 16: d * ((qs[j] & 0xF) - 8);
/// element j + 16: d * ((qs[j] >> 4) - 8).
struct BlockQ4_0 {
  uint16_t d;              ///< scale (f16)
  uint8_t qs[kQK4_0 / 2];  ///< nibbles: low = elements 0..15, high = 16..31
};

/// Q4_1, 32 elements in 20 bytes. Element j < 16: d * (qs[j] & 0xF) + m;
/// element j + 16: d * (qs[j] >> 4) + m.
struct BlockQ4_1 {
  uint16_t d;              ///< scale (f16)
  uint16_t m;              ///< offset, the block minimum (f16)
  uint8_t qs[kQK4_1 / 2];  ///< nibbles as in Q4_0
};

/// Q5_0, 32 elements in 22 bytes. With h = little-endian uint32 of qh, element j < 16:
/// d * (((qs[j] & 0xF) | (bit j of h) << 4) - 16); element j + 16:
/// d * (((qs[j] >> 4) | (bit j + 16 of h) << 4) - 16).
struct BlockQ5_0 {
  uint16_t d;              ///< scale (f16)
  uint8_t qh[4];           ///< fifth bits, bit e of the uint32 belongs to element e
  uint8_t qs[kQK5_0 / 2];  ///< low four bits, nibbles as in Q4_0
};

/// Q5_1, 32 elements in 24 bytes: as Q5_0 without the -16, times d plus m.
struct BlockQ5_1 {
  uint16_t d;              ///< scale (f16)
  uint16_t m;              ///< offset (f16)
  uint8_t qh[4];           ///< fifth bits as in Q5_0
  uint8_t qs[kQK5_1 / 2];  ///< low four bits as in Q5_0
};

/// Q8_0, 32 elements in 34 bytes. Element j: d * qs[j].
struct BlockQ8_0 {
  uint16_t d;         ///< scale (f16)
  int8_t qs[kQK8_0];  ///< quants
};

/// Q2_K, 256 elements in 84 bytes: 16 sub-blocks of 16. Sub-block s has scale
/// d * (scales[s] & 0xF) and min dmin * (scales[s] >> 4); element i = 128*h + 32*k + l
/// (h < 2, k < 4, l < 32) has the 2-bit quant (qs[32*h + l] >> 2k) & 3, sub-block i / 16, and
/// decodes to scale * q - min.
struct BlockQ2_K {
  uint8_t scales[kQK_K / 16];  ///< low nibble scale, high nibble min, per sub-block
  uint8_t qs[kQK_K / 4];       ///< 2-bit quants
  uint16_t d;                  ///< super-block scale of the scales (f16)
  uint16_t dmin;               ///< super-block scale of the mins (f16)
};

/// Q3_K, 256 elements in 110 bytes: 16 sub-blocks of 16 with signed 6-bit scales.
/// Element i = 128*h + 32*k + l: low bits (qs[32*h + l] >> 2k) & 3, high bit
/// (hmask[l] >> (4h + k)) & 1; q = low - (high ? 0 : 4) in [-4, 3]. Sub-block s = i / 16 has
/// 6-bit scale sc = low4 | high2 << 4 with low4 = scales[s] & 0xF (s < 8) or
/// scales[s - 8] >> 4 (s >= 8), high2 = (scales[8 + s % 4] >> (2 * (s / 4))) & 3; the element
/// decodes to d * (sc - 32) * q.
struct BlockQ3_K {
  uint8_t hmask[kQK_K / 8];  ///< high bits of the 3-bit quants
  uint8_t qs[kQK_K / 4];     ///< low two bits
  uint8_t scales[12];        ///< 16 packed 6-bit scales, biased by 32
  uint16_t d;                ///< super-block scale (f16)
};

/// Q4_K, 256 elements in 144 bytes: 8 sub-blocks of 32 with 6-bit scale and min.
/// For sub-block j < 4: sc = scales[j] & 63, mn = scales[j + 4] & 63; for j >= 4:
/// sc = (scales[j + 4] & 0xF) | (scales[j - 4] >> 6) << 4,
/// mn = (scales[j + 4] >> 4) | (scales[j] >> 6) << 4. Element i = 64*c + 32*u + l (c < 4,
/// u < 2, l < 32) is the low (u = 0) or high (u = 1) nibble of qs[32*c + l], sub-block 2c + u,
/// and decodes to d * sc * q - dmin * mn.
struct BlockQ4_K {
  uint16_t d;                   ///< super-block scale of the scales (f16)
  uint16_t dmin;                ///< super-block scale of the mins (f16)
  uint8_t scales[kKScaleSize];  ///< packed 6-bit scales and mins
  uint8_t qs[kQK_K / 2];        ///< 4-bit quants
};

/// Q5_K, 256 elements in 176 bytes: Q4_K plus a fifth bit. Element i = 64*c + 32*u + l has
/// q = nibble u of qs[32*c + l] | ((qh[l] >> (2c + u)) & 1) << 4, scales as Q4_K.
struct BlockQ5_K {
  uint16_t d;                   ///< super-block scale of the scales (f16)
  uint16_t dmin;                ///< super-block scale of the mins (f16)
  uint8_t scales[kKScaleSize];  ///< packed 6-bit scales and mins as in Q4_K
  uint8_t qh[kQK_K / 8];        ///< fifth bits
  uint8_t qs[kQK_K / 2];        ///< low four bits
};

/// Q6_K, 256 elements in 210 bytes: 16 sub-blocks of 16 with int8 scales.
/// Element i = 128*h + 32*k + l (h < 2, k < 4, l < 32): low four bits are the low (k < 2) or
/// high (k >= 2) nibble of ql[64*h + 32*(k % 2) + l], high two bits (qh[32*h + l] >> 2k) & 3;
/// q = (low | high << 4) - 32; decodes to d * scales[i / 16] * q.
struct BlockQ6_K {
  uint8_t ql[kQK_K / 2];      ///< low four bits
  uint8_t qh[kQK_K / 4];      ///< high two bits
  int8_t scales[kQK_K / 16];  ///< sub-block scales
  uint16_t d;                 ///< super-block scale (f16)
};

/// Q8_K, 256 elements in 292 bytes; the activation format the K-quant dot products use.
/// Element i: d * qs[i]; bsums[g] = sum of qs[16g .. 16g + 15].
struct BlockQ8_K {
  float d;                    ///< scale (f32, not f16)
  int8_t qs[kQK_K];           ///< quants
  int16_t bsums[kQK_K / 16];  ///< sums of groups of 16 quants
};

static_assert(std::endian::native == std::endian::little,
              "ggml block structs hold little-endian f16/int16 fields");
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22 &&
              sizeof(BlockQ5_1) == 24 && sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ2_K) == 84 && sizeof(BlockQ3_K) == 110 && sizeof(BlockQ4_K) == 144 &&
              sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210 && sizeof(BlockQ8_K) == 292);

namespace ref {

/// Decodes `n` elements of type `type` at `src` (row_bytes(type, n) bytes) into `dst` floats.
/// Bit exact: every output equals ggml's dequantize_row_* / fp16 / bf16 conversion.
/// Throws as described at the top of this header.
void dequantize_row(GgmlType type, const void* src, float* dst, int64_t n);

/// Encodes `n` floats at `src` into `dst` (row_bytes(type, n) bytes) with ggml's reference
/// quantizer for `type` (quantize_row_*_ref: no importance matrix). F16 and BF16 round to
/// nearest even; F32 copies. Throws as described at the top of this header.
void quantize_row(GgmlType type, const float* src, void* dst, int64_t n);

/// quantize_row without the K-quant scale searches, for bulk data whose precision does not
/// matter (synthetic models). Output is the ggml block layout (ggml-common.h) and decodes with
/// dequantize_row; deterministic.
/// - Q4_K: each sub-block's scale and min come from its min/max grid alone (the starting
///   point of ggml's make_qkx2_quants), about 10x faster, NMSE about 1.3x the reference's.
/// - Q6_K: each sub-block of 16 takes the scale m / -32 (m its element of largest magnitude,
///   which lands on level -32), the int8 sub-block scales are quantized against the f16
///   d = max |scale| / 127, levels rounded against the decoded scales; no search. NMSE at most
///   about 1.1x the reference's on normal data (see test_quants.cpp).
/// Every other type is encoded exactly as quantize_row.
void quantize_row_fast(GgmlType type, const float* src, void* dst, int64_t n);

/// Decodes a whole tensor of `n_rows` rows of `n_per_row` elements into `dst`
/// (n_rows * n_per_row floats, row-major; rows of `src` are row_bytes(type, n_per_row) apart).
/// Throws as dequantize_row, and Error(invalid_argument) when n_rows < 0.
void dequantize_rows(GgmlType type, const void* src, float* dst, int64_t n_rows, int64_t n_per_row);

}  // namespace ref
}  // namespace berth
