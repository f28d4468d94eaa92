#include <fmt/format.h>
#include <fmt/ranges.h>

#include <unordered_set>

#include "berth/core/error.h"
#include "berth/core/strings.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"

namespace berth {

std::unique_ptr<Model> make_llama(const gguf::File& file);
std::unique_ptr<Model> make_qwen2(const gguf::File& file);
std::unique_ptr<Model> make_qwen3(const gguf::File& file);
std::unique_ptr<Model> make_qwen3moe(const gguf::File& file);
std::unique_ptr<Model> make_qwen35(const gguf::File& file);
std::unique_ptr<Model> make_qwen35moe(const gguf::File& file);

std::vector<std::string> supported_architectures() {
  return {"llama", "qwen2", "qwen3", "qwen3moe", "qwen35", "qwen35moe"};
}

namespace {

// Every tensor of the file must be one the architecture reads, as llama.cpp insists: an unused
// tensor means a wrong block_count or a variant berth would silently compute wrongly.
void check_all_tensors_used(const gguf::File& file, const Model& model) {
  std::unordered_set<std::string_view> used;
  for (const TensorView& t : model.weights().tensors) used.insert(t.name);
  // The layers the architecture skips (Hparams::n_layer_skipped: Qwen3.5's MTP block).
  const Hparams& hp = model.hparams();
  auto skipped = [&](std::string_view name) {
    for (int64_t l = hp.n_layer; l < hp.n_layer + hp.n_layer_skipped; ++l)
      if (name.starts_with(fmt::format("blk.{}.", l))) return true;
    return false;
  };
  for (const gguf::TensorInfo& t : file.tensors())
    if (!used.count(t.name) && !skipped(t.name))
      throw Error(ErrorCategory::format,
                  fmt::format("{}: tensor '{}' is not used by architecture '{}' with block_count "
                              "{} ({} of the file's {} tensors are): wrong metadata or an "
                              "unsupported variant",
                              file.path(), printable(t.name), model.hparams().arch,
                              model.hparams().n_layer, used.size(), file.tensors().size()));
}

}  // namespace

std::unique_ptr<Model> load_model(const gguf::File& file) {
  const std::string& arch = file.architecture();
  std::unique_ptr<Model> model;
  if (arch == "llama") model = make_llama(file);
  if (arch == "qwen2") model = make_qwen2(file);
  if (arch == "qwen3") model = make_qwen3(file);
  if (arch == "qwen3moe") model = make_qwen3moe(file);
  if (arch == "qwen35") model = make_qwen35(file);
  if (arch == "qwen35moe") model = make_qwen35moe(file);
  if (!model)
    throw Error(ErrorCategory::unsupported,
                fmt::format("{}: architecture '{}' is not supported (supported: {})", file.path(),
                            printable(arch), fmt::join(supported_architectures(), ", ")));
  check_all_tensors_used(file, *model);
  return model;
}

}  // namespace berth
