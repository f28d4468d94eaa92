#include "berth/runtime/kv_cache.h"

#include <fmt/format.h>

#include <new>

#include "berth/core/error.h"

namespace berth {

KvCache::KvCache(const std::vector<KvLayer>& layers, int64_t n_ctx) : layers_(layers), n_ctx_(n_ctx) {
  if (n_ctx < 1)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("the context size must be at least 1, got {}", n_ctx));
  try {
    for (const KvLayer& l : layers_) {
      k_.emplace_back(static_cast<size_t>(n_ctx * l.k_dim), 0.0f);
      v_.emplace_back(static_cast<size_t>(n_ctx * l.v_dim), 0.0f);
    }
  } catch (const std::bad_alloc&) {
    size_t total = 0;
    for (const KvLayer& l : layers_) total += static_cast<size_t>(n_ctx) * (l.k_dim + l.v_dim) * 4;
    throw Error(ErrorCategory::out_of_memory,
                fmt::format("cannot allocate the KV cache: {:.1f} MiB for {} positions (lower -c)",
                            static_cast<double>(total) / (1 << 20), n_ctx));
  }
}

size_t KvCache::bytes() const {
  size_t total = 0;
  for (const KvLayer& l : layers_) total += static_cast<size_t>(n_ctx_) * (l.k_dim + l.v_dim) * 4;
  return total;
}

}  // namespace berth
