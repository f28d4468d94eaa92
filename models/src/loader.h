// Private to models/: reading an architecture's weights from a GGUF file into the WeightTable,
// each with its role and layer, after checking its shape and type.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "berth/graph/graph.h"
#include "berth/io/gguf.h"

namespace berth::models_detail {

class WeightLoader {
 public:
  /// `file` and `table` must outlive the loader.
  WeightLoader(const gguf::File& file, graph::WeightTable& table) : file_(file), table_(table) {}

  /// Adds tensor `name` to the table with `role` and `layer` (-1: none) after checking that its
  /// shape is exactly `ne` (ne[0] contiguous; missing trailing axes are 1) and that berth can
  /// compute with its type. Throws GgufError(missing_tensor), Error(format) (shape, naming
  /// actual and expected) or Error(unsupported) (type).
  graph::WeightId need(const std::string& name, std::vector<int64_t> ne, graph::WeightRole role,
                       int32_t layer = -1);
  /// Like need(), but returns nullopt when the tensor is absent.
  std::optional<graph::WeightId> maybe(const std::string& name, std::vector<int64_t> ne,
                                       graph::WeightRole role, int32_t layer = -1);
  const gguf::File& file() const { return file_; }
  const graph::WeightTable& table() const { return table_; }

 private:
  const gguf::File& file_;
  graph::WeightTable& table_;
};

}  // namespace berth::models_detail
