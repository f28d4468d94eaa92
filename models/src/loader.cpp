#include "loader.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>

#include "berth/core/error.h"

namespace berth::models_detail {

std::optional<graph::WeightId> WeightLoader::maybe(const std::string& name, std::vector<int64_t> ne,
                                                   graph::WeightRole role, int32_t layer) {
  const gguf::TensorInfo* t = file_.find_tensor(name);
  if (!t) return std::nullopt;
  std::array<int64_t, 4> want{1, 1, 1, 1};
  for (size_t i = 0; i < ne.size() && i < 4; ++i) want[i] = ne[i];
  if (t->ne != want) {
    auto shape = [](const std::array<int64_t, 4>& a, size_t n) {
      return fmt::format("[{}]", fmt::join(a.begin(), a.begin() + static_cast<long>(n), ", "));
    };
    throw Error(ErrorCategory::format,
                fmt::format("{}: tensor '{}' has shape {}, expected {}", file_.path(), name,
                            shape(t->ne, std::max<size_t>(t->n_dims, 1)), shape(want, ne.size())));
  }
  if (!traits(t->type).computable)
    throw Error(ErrorCategory::unsupported,
                fmt::format("{}: tensor '{}' has type {}, which berth cannot compute with yet",
                            file_.path(), name, type_name(t->type)));
  return table_.add(t->view(), role, layer);
}

graph::WeightId WeightLoader::need(const std::string& name, std::vector<int64_t> ne,
                                   graph::WeightRole role, int32_t layer) {
  if (auto id = maybe(name, std::move(ne), role, layer)) return *id;
  file_.tensor(name);  // throws GgufError(missing_tensor) naming the tensor and file
  throw Error(ErrorCategory::internal, "unreachable");
}

}  // namespace berth::models_detail
