#include "berth/backends/kv_cache.h"

#include <fmt/format.h>

#include <new>

#include "berth/core/error.h"
#include "berth/backends/thread_pool.h"

namespace berth {

KvCache::KvCache(const std::vector<KvLayer>& layers, int64_t n_ctx)
    : layers_(layers), n_ctx_(n_ctx) {
  if (n_ctx < 1)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("the context size must be at least 1, got {}", n_ctx));
  constexpr double kMiB = 1024.0 * 1024.0;
  const size_t total = bytes();
  const size_t phys = physical_memory_bytes();
  if (phys > 0 && total > phys)
    throw Error(
        ErrorCategory::out_of_memory,
        fmt::format("the KV cache for a context of {} tokens needs {:.1f} MiB, more than "
                    "this machine's {:.1f} MiB of memory (lower -c)",
                    n_ctx, static_cast<double>(total) / kMiB, static_cast<double>(phys) / kMiB));
  try {
    for (const KvLayer& l : layers_) {
      // make_unique_for_overwrite leaves the pages untouched until positions are written.
      k_.push_back(std::make_unique_for_overwrite<float[]>(static_cast<size_t>(n_ctx * l.k_dim)));
      v_.push_back(std::make_unique_for_overwrite<float[]>(static_cast<size_t>(n_ctx * l.v_dim)));
    }
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCategory::out_of_memory,
                fmt::format("cannot allocate the KV cache: {:.1f} MiB for {} positions (lower -c)",
                            static_cast<double>(total) / kMiB, n_ctx));
  }
}

size_t KvCache::bytes() const {
  size_t total = 0;
  for (const KvLayer& l : layers_)
    total += static_cast<size_t>(n_ctx_) * static_cast<size_t>(l.k_dim + l.v_dim) * sizeof(float);
  return total;
}

}  // namespace berth
