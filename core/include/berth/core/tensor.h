// Non-owning views of tensors stored in ggml's layout.
//
// Shapes follow ggml/GGUF: ne[0] is the contiguous axis (the length of a row), ne[1] counts
// rows, ne[2] and ne[3] stack matrices (e.g. experts). A GGUF weight of a linear layer that maps
// n_in -> n_out is stored as ne = {n_in, n_out}: one row of n_in elements per output.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "berth/core/types.h"

namespace berth {

/// A read-only view of a tensor's bytes (e.g. inside a memory-mapped GGUF file).
struct TensorView {
  std::string name;                       ///< GGUF tensor name, for error messages
  GgmlType type = GgmlType::F32;          ///< element / block type
  std::array<int64_t, 4> ne{1, 1, 1, 1};  ///< elements per axis; ne[0] contiguous
  int n_dims = 0;                         ///< dimensions as stored in the file (1..4; 0 = scalar)
  const void* data = nullptr;             ///< first byte of row 0
  size_t n_bytes = 0;                     ///< total bytes of the tensor

  int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
  /// Rows of ne[0] elements across all higher axes.
  int64_t n_rows() const { return ne[1] * ne[2] * ne[3]; }
  /// Bytes of one row along ne[0].
  size_t row_bytes() const { return berth::row_bytes(type, ne[0]); }
  const uint8_t* row(int64_t i) const {
    return static_cast<const uint8_t*>(data) + static_cast<size_t>(i) * row_bytes();
  }
};

/// One matmul of a group sharing an input (Device::matmul_group, gpu::matmul_group): w is
/// n_out rows of n_in elements of `type` (n_in is the group's); out [n_tok, n_out] f32, row-major.
struct MatmulJob {
  GgmlType type = GgmlType::F32;
  const void* w = nullptr;
  int64_t n_out = 0;
  float* out = nullptr;
};

/// One copy between device memory and page-locked host memory of a hand-off
/// (Device::copy_out_signal, Device::wait_copy_in); bytes: a multiple of 4.
struct HostCopy {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
};

/// One tensor of a grouped rms_norm + rope (Device::norm_rope): x, out [rows, n_head * head_dim]
/// f32 (out may equal x), w [head_dim] f32 (nullptr: no scale).
struct NormRopeJob {
  const float* x = nullptr;
  const float* w = nullptr;
  float* out = nullptr;
  int32_t n_head = 0;
};

/// Stacked expert weights of one MoE layer, in ggml's layout (GGUF ffn_{gate,up,down}_exps):
/// gate/up ne = {n_embd, n_ff, n_expert}, down ne = {n_ff, n_embd, n_expert}; expert e's matrix
/// starts at byte e * (rows * row bytes) of its tensor. Pointers are wherever the reader of the
/// struct computes (device memory, or pinned host memory a device can read).
struct MoeWeights {
  GgmlType gate_type = GgmlType::F32, up_type = GgmlType::F32, down_type = GgmlType::F32;
  const void* gate = nullptr;
  const void* up = nullptr;
  const void* down = nullptr;
  int64_t n_embd = 0, n_ff = 0;
  int32_t n_expert = 0, n_expert_used = 0;
};

/// Which of a moe_experts call's (token, slot) pairs it computes besides its expert mask, and
/// how it reads its weights. Slots are positions in each token's route (moe_route's top-k order,
/// 0 = largest weight): the call computes slots [begin, end) (end -1: n_expert_used). `stage`:
/// the weights are pinned host memory; a single-token call first copies the matrices of the
/// experts its slots select into its workspace (large coalesced reads over PCIe) and computes
/// from there (moe_workspace_bytes counts the room). Ignored for more than one token.
///
/// `by_table` (a layer with expert slots, residency/expert_slots.h): the weights are the slot
/// arrays, gate/up/down each [n_slots] experts' matrices as stored, and the call computes the
/// pairs whose expert e has table[e] >= 0, reading slot table[e]'s matrices (table: int32
/// [n_expert] in device memory, read when the call runs, so a captured graph follows its
/// changes). The expert mask is then unused. `table` may be null when only sizing a workspace.
struct MoeSlots {
  int32_t begin = 0;
  int32_t end = -1;
  bool stage = false;
  bool by_table = false;
  const int32_t* table = nullptr;
  int32_t n_slots = 0;
};

}  // namespace berth
