// Private helpers shared by the architectures: find a weight, check its shape and type.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "berth/graph/graph.h"
#include "berth/io/gguf.h"

namespace berth::models_detail {

/// Adds tensor `name` of `file` to `table` after checking that its shape is exactly `ne`
/// (ne[0] contiguous; missing trailing axes are 1) and that berth can compute with its type.
/// Throws GgufError(missing_tensor), Error(format) (shape, naming actual and expected) or
/// Error(unsupported) (type).
graph::WeightId need(const gguf::File& file, graph::WeightTable& table, const std::string& name,
                     std::vector<int64_t> ne);

/// Like need(), but returns nullopt when the tensor is absent.
std::optional<graph::WeightId> maybe(const gguf::File& file, graph::WeightTable& table,
                                     const std::string& name, std::vector<int64_t> ne);

}  // namespace berth::models_detail
