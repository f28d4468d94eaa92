// The heterogeneous executor: runs a step graph with each op where its weights live (placement
// decides), GPU ops on Device streams and CPU ops on the pinned worker pool, at the same time.
#pragma once

#include <cstddef>
#include <cstdint>

#include "berth/models/model.h"

namespace berth {

/// Device bytes the hybrid executor needs besides weights and KV cache for steps of up to
/// `n_ubatch` tokens with a context of `n_ctx`: the peak of live activations (values are
/// assigned offsets in one arena by liveness) plus the largest kernel workspace, rounded up.
/// An estimate from shapes alone (no device needed), used by placement before loading.
size_t device_scratch_bytes(const Model& model, int32_t n_ubatch, int64_t n_ctx);

}  // namespace berth
