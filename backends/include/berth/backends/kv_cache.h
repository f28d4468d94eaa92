// The KV cache: per layer, the keys and values of every position processed so far.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "berth/graph/cache.h"

namespace berth {

/// Host KV cache in f32. Layer l holds K as [n_ctx, k_dim] and V as [n_ctx, v_dim], row-major
/// (one row per position, dims contiguous). Reserved once, n_ctx * sum(k_dim + v_dim) * 4 bytes,
/// without touching the memory: pages are filled as positions are written, so a large -c costs
/// only what is used. Throws Error(out_of_memory) naming the MiB when the cache would not fit in
/// the machine's physical memory or the allocation fails, Error(invalid_argument) for n_ctx < 1.
class KvCache {
 public:
  KvCache(const std::vector<KvLayer>& layers, int64_t n_ctx);

  int64_t n_ctx() const { return n_ctx_; }
  int32_t n_layer() const { return static_cast<int32_t>(layers_.size()); }
  const KvLayer& layer(int32_t l) const { return layers_.at(static_cast<size_t>(l)); }
  float* k(int32_t l) { return k_[static_cast<size_t>(l)].get(); }
  float* v(int32_t l) { return v_[static_cast<size_t>(l)].get(); }
  /// Total bytes held.
  size_t bytes() const;

 private:
  std::vector<KvLayer> layers_;
  int64_t n_ctx_;
  std::vector<std::unique_ptr<float[]>> k_, v_;
};

}  // namespace berth
