// The KV cache as the executors see it: per layer, where its K and V rows are. The runtime's
// KvCache owns the memory (runtime/kv_cache.h); the CPU executor reads the host side, the
// scheduler hands the device side to the device.
#pragma once

#include <cstdint>
#include <vector>

#include "berth/graph/cache.h"

namespace berth {

/// Sequence s's position p is row s * n_ctx + p of every layer: each sequence owns n_ctx rows.
struct KvView {
  int64_t n_ctx = 0;            ///< positions each sequence holds (the per-sequence context)
  int32_t n_seq = 1;            ///< sequences the cache holds
  std::vector<KvLayer> layers;  ///< row widths per layer
  /// Host f32 rows, layer l: K [n_seq * n_ctx, k_dim], V [n_seq * n_ctx, v_dim] (dims
  /// contiguous), or null.
  std::vector<float*> k, v;
  /// Device f16 rows of the layers whose attention runs on the device, same shapes, or null.
  std::vector<uint16_t*> dev_k, dev_v;
  /// Host f32 recurrent state of each layer with KvLayer::recurrent() whose state is not on the
  /// device (else null): sequence s's conv state at conv[l] + s * conv_dim, its delta-rule state
  /// at ssm[l] + s * ssm_dim. The CPU executor's ssm_conv / gated_delta ops read and write them
  /// (and zero a sequence's state at its position 0).
  std::vector<float*> conv, ssm;
  /// Device f32 recurrent state of the recurrent layers whose state lives on the device (their
  /// ssm_conv / gated_delta run there), same layout as conv / ssm, or null. A layer's state lives
  /// on one side only: where dev_conv[l] is set, the host's conv[l] / ssm[l] are null.
  std::vector<float*> dev_conv, dev_ssm;

  /// Rows of every layer: n_seq * n_ctx.
  int64_t n_rows() const { return n_ctx * n_seq; }
  /// The row of sequence `seq` at position `pos`.
  int64_t row(int32_t seq, int64_t pos) const { return seq * n_ctx + pos; }

  float* conv_state(int32_t l, int32_t seq) const {
    return conv.at(static_cast<size_t>(l)) + seq * layer(l).conv_dim;
  }
  float* ssm_state(int32_t l, int32_t seq) const {
    return ssm.at(static_cast<size_t>(l)) + seq * layer(l).ssm_dim;
  }

  int32_t n_layer() const { return static_cast<int32_t>(layers.size()); }
  const KvLayer& layer(int32_t l) const { return layers.at(static_cast<size_t>(l)); }
};

}  // namespace berth
