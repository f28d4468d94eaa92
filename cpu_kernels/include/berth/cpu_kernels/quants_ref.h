// Scalar reference quantization and dequantization for every computable type, bit for bit in
// ggml's block layouts (ggml/src/ggml-common.h for the structs; ggml-quants.c for the
// formulas). These are the "reference twins" that tests and the naive forward use; SIMD
// kernels are checked against them.
//
// All functions work on whole rows: `n` elements along the contiguous axis, n a multiple of
// the type's block size (1 for F32/F16/BF16). Passing another n, or a type that is not
// computable, throws berth::Error(invalid_argument).
#pragma once

#include <cstddef>
#include <cstdint>

#include "berth/core/types.h"

namespace berth::ref {

/// Decodes `n` elements of type `type` at `src` (row_bytes(type, n) bytes) into `dst` floats.
void dequantize_row(GgmlType type, const void* src, float* dst, int64_t n);

/// Encodes `n` floats at `src` into `dst` (row_bytes(type, n) bytes) with ggml's reference
/// quantizer for `type` (quantize_row_*_ref: no importance matrix).
void quantize_row(GgmlType type, const float* src, void* dst, int64_t n);

/// Decodes a whole tensor of `n_rows` rows of `n_per_row` elements into `dst`
/// (n_rows * n_per_row floats, row-major).
void dequantize_rows(GgmlType type, const void* src, float* dst, int64_t n_rows, int64_t n_per_row);

}  // namespace berth::ref
