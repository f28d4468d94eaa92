// Dot products of weight rows in their stored (quantized) type against activation rows
// quantized to the weight type's partner format, as ggml pairs them (ggml-cpu's vec_dot_type):
//   Q4_0, Q4_1, Q5_0, Q5_1, Q8_0  ->  Q8_0 activations (32-element blocks)
//   Q2_K, Q3_K, Q4_K, Q5_K, Q6_K  ->  Q8_K activations (256-element super-blocks)
//   F32, F16, BF16                ->  F32 activations (no quantization)
// (Q4_1/Q5_1 need the sum of each activation block for their min term; it is computed from
// the Q8_0 block itself.)
//
// The kernels are Highway SIMD with dynamic dispatch (AVX2, AVX-512, AVX-512 VNNI on x86;
// NEON, SVE on arm64; a portable fallback elsewhere). Each has a scalar twin in namespace
// berth::ref with the same signature, used by the oracle tests (tests/core/test_kernel_oracle*).
//
// Shapes: a weight row has n elements (n a multiple of the block size), stored in
// row_bytes(type, n) bytes; an activation row has n elements in activation_row_bytes(type, n)
// bytes. n must be a multiple of the block size of both formats (so a multiple of 256 for
// the K-quants). Rows of a tile are consecutive in memory.
//
// Determinism: the value of each output depends only on its weight row and activation row,
// never on the tile shape, the row's position in the tile, or the thread that computes it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "berth/core/types.h"

namespace berth::cpu {

/// The activation format `weight_type` is multiplied with (Q8_0, Q8_K or F32).
/// Throws Error(unsupported) for a type without a dot product.
GgmlType activation_type(GgmlType weight_type);

/// Bytes of one activation row of n elements for weights of `weight_type`.
size_t activation_row_bytes(GgmlType weight_type, int64_t n);

/// Quantizes n floats (x) into dst in the activation format of `weight_type` (for float weight
/// types: copies the floats). Matches ref::quantize_activation within the rounding of the
/// scale (d computed in a different order).
void quantize_activation(GgmlType weight_type, const float* x, void* dst, int64_t n);

/// out[t * out_stride + r] = sum_i W[r, i] * A[t, i] for r in [0, n_rows), t in [0, n_tok):
/// W rows start at `w` (row_bytes(weight_type, n) apart), activation rows at `act`
/// (`act_stride` bytes apart). Each weight block is loaded once per tile and used for all
/// n_tok activation rows (GEMM reuse); n_tok = 1 is the decode GEMV.
void dot_tile(GgmlType weight_type, const void* w, int64_t n_rows, const void* act,
              size_t act_stride, int64_t n_tok, int64_t n, float* out, int64_t out_stride);

/// Cache-tiled matrix product over a row range, the unit of work the runtime gives each
/// thread: out[t * out_stride + r] = W[r] . A[t] for r in [0, n_rows), t in [0, n_tok).
/// Splits the range into blocks of 4 x kGemmRowTile rows and, within them, tiles of
/// kGemmTokTile tokens, calling dot_tile on each, so a block's weights stay in cache while they
/// are applied to every token and a token tile's activations are fetched once per block.
/// Where the dispatched kernel blocks for the cache itself (the AVX3_DL GEMMs of the legacy and
/// K families), one dot_tile call takes the whole range, so that it unpacks each weight row and
/// transposes each activation row once (AVX3_DL K-quants with 2..11 tokens: FewTokDL streams
/// the rows once per 8 tokens, each super-block unpacked once for all of them). Same arguments and
/// result as dot_tile (bit for bit: see "Determinism"); throws what dot_tile throws.
void gemm_rows(GgmlType weight_type, const void* w, int64_t n_rows, const void* act,
               size_t act_stride, int64_t n_tok, int64_t n, float* out, int64_t out_stride);

inline constexpr int64_t kGemmRowTile = 16;
inline constexpr int64_t kGemmTokTile = 64;

}  // namespace berth::cpu

namespace berth::ref {

/// Scalar twin of cpu::quantize_activation (ggml's reference quantizers for Q8_0 / Q8_K).
void quantize_activation(GgmlType weight_type, const float* x, void* dst, int64_t n);

/// Scalar twin of cpu::dot_tile: per block, the integer dot product of the quants, then the
/// float scales, exactly as the formats define (ggml-quants.c's reference dot products).
void dot_tile(GgmlType weight_type, const void* w, int64_t n_rows, const void* act,
              size_t act_stride, int64_t n_tok, int64_t n, float* out, int64_t out_stride);

}  // namespace berth::ref

namespace berth::cpu::detail {
// Per-family entry points, each defined in its own Highway translation unit (which owns its
// HWY_EXPORT table) and called by quant_dot.cpp's switch.
void quantize_q8_0(const float* x, void* dst, int64_t n);  // quant_dot_legacy.cc
void quantize_q8_K(const float* x, void* dst, int64_t n);  // quant_dot_k.cc
void dot_tile_legacy(GgmlType t, const void* w, int64_t n_rows, const void* act, size_t act_stride,
                     int64_t n_tok, int64_t n, float* out, int64_t out_stride);  // Q4_0..Q8_0
void dot_tile_float(GgmlType t, const void* w, int64_t n_rows, const void* act, size_t act_stride,
                    int64_t n_tok, int64_t n, float* out, int64_t out_stride);  // F32/F16/BF16
void dot_tile_k(GgmlType t, const void* w, int64_t n_rows, const void* act, size_t act_stride,
                int64_t n_tok, int64_t n, float* out, int64_t out_stride);  // Q2_K..Q6_K
// Whether the dispatched target's dot_tile of the family does its own cache blocking for
// n_tok > 1 (so gemm_rows hands it the whole row range and all tokens in one call, and it
// unpacks each weight row and transposes each activation row once; AVX3_DL today).
bool legacy_gemm_tiles_itself();  // quant_dot_legacy.cc
bool k_gemm_tiles_itself();       // quant_dot_k.cc
}  // namespace berth::cpu::detail
