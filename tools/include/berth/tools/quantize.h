// Model quantization (`berth quantize IN OUT TYPE`): rewrites a GGUF file with its weight
// matrices in another type, copying everything else.
//
// Which tensors change (the ecosystem's convention, llama.cpp's llama-quantize):
//   - tensors with two or more dimensions whose name ends in "weight" are encoded in the target
//     type, row by row (a row is ne[0] contiguous elements) with the scalar reference quantizer
//     ref::quantize_row (cpu_kernels/quants_ref.h; ggml's quantize_row_*_ref, no importance
//     matrix). Source rows of another float or quantized type are decoded to f32 first
//     (ref::dequantize_row);
//   - such a tensor whose row length ne[0] is not a multiple of the target's block size (32, or
//     256 for the K-quants) keeps its original type and bytes, as do tensors of a type berth
//     cannot decode;
//   - 1-D tensors (norm weights, biases) and tensors whose name does not end in "weight" are
//     copied unchanged (in practice: F32).
// Metadata is copied in file order; `general.file_type` is set to the llama_ftype value of the
// target (llama.h, enum llama_ftype) and `general.quantization_version` to 2 (ggml's
// GGML_QNT_VERSION, the block layouts of quants_ref.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "berth/backends/thread_pool.h"
#include "berth/core/types.h"

namespace berth {

/// The target types `berth quantize` accepts, in ggml's spelling:
/// q4_0 q4_1 q5_0 q5_1 q8_0 q2_K q3_K q4_K q5_K q6_K f16 bf16 f32.
const std::vector<GgmlType>& quantize_target_types();

/// Parses a target type name (case-insensitive, e.g. "q4_k", "Q8_0", "bf16").
/// Throws Error(invalid_argument) naming the text and the accepted names when it is not one of
/// quantize_target_types().
GgmlType parse_quantize_type(std::string_view name);

/// llama.cpp's `general.file_type` (enum llama_ftype in llama.h) for a file whose weight
/// matrices are all of type `t`: f32 0, f16 1, q4_0 2, q4_1 3, q8_0 7, q5_0 8, q5_1 9, q2_K 10,
/// q3_K 11 (Q3_K_S), q4_K 14 (Q4_K_S), q5_K 16 (Q5_K_S), q6_K 18, bf16 32. The K-quants map to
/// the "_S" variants, the ones whose matrices are all of that type.
/// Throws Error(invalid_argument) for a type not in quantize_target_types().
uint32_t llama_ftype_of(GgmlType t);

/// What happened to one tensor.
struct QuantizedTensor {
  enum class Action {
    quantized,  ///< re-encoded in the target type
    kept,       ///< a weight matrix left in its type (see `reason`)
    copied,     ///< not a weight matrix (1-D, or not named "*weight"): copied unchanged
  };
  std::string name;
  GgmlType from = GgmlType::F32;
  GgmlType to = GgmlType::F32;
  Action action = Action::copied;
  std::string reason;      ///< why a matrix was kept, e.g. "row length 172 is not a multiple of 32"
  uint64_t bytes_in = 0;   ///< tensor data bytes in the input
  uint64_t bytes_out = 0;  ///< tensor data bytes in the output
};

struct QuantizeReport {
  GgmlType type = GgmlType::F32;
  std::vector<QuantizedTensor> tensors;  ///< in file order
  int64_t n_quantized = 0, n_kept = 0, n_copied = 0;
  uint64_t bytes_in = 0, bytes_out = 0;            ///< tensor data bytes (sum over tensors)
  uint64_t file_bytes_in = 0, file_bytes_out = 0;  ///< whole files, bytes
};

/// Reads the GGUF at `in_path` and writes `out_path` with its weight matrices in `type` (rules
/// at the top of this file). Tensor data is produced one tensor at a time while the file is
/// written (rows split across `pool`), so memory stays at one output tensor plus the mapping.
/// Throws: GgufError for an unreadable or malformed input (category io / format);
/// Error(invalid_argument) for a type outside quantize_target_types() or when `out_path` is the
/// input file; Error(io) naming `out_path` when it cannot be written (no partial file is left).
QuantizeReport quantize_model(const std::string& in_path, const std::string& out_path,
                              GgmlType type, ThreadPool& pool);

}  // namespace berth
