// `berth quantize IN OUT TYPE`: rewrite a GGUF model with its weight matrices in TYPE.
#include <fmt/format.h>

#include <map>

#include "berth/backends/thread_pool.h"
#include "berth/tools/quantize.h"
#include "commands.h"

namespace berth::cli {
namespace {

struct QuantizeOptions {
  std::string in, out, type;
  int32_t n_threads = 0;
};

int quantize(const QuantizeOptions& o) {
  const GgmlType type = parse_quantize_type(o.type);  // before any file work
  ThreadPool pool(o.n_threads > 0 ? o.n_threads : physical_core_count());
  QuantizeReport rep = quantize_model(o.in, o.out, type, pool);

  constexpr double kMiB = 1024.0 * 1024.0;
  std::string s;
  s += fmt::format("{} -> {} ({}, general.file_type {})\n", o.in, o.out, type_name(type),
                   llama_ftype_of(type));
  s += fmt::format("quantized: {} tensors to {}\n", rep.n_quantized, type_name(type));
  // Kept matrices, grouped by reason so a model with hundreds of layers stays readable.
  std::map<std::string, std::vector<std::string>> kept;
  for (const QuantizedTensor& t : rep.tensors)
    if (t.action == QuantizedTensor::Action::kept)
      kept[fmt::format("{}, {}", type_name(t.from), t.reason)].push_back(t.name);
  s += fmt::format("kept:      {} weight matrices in their type\n", rep.n_kept);
  for (const auto& [reason, names] : kept) {
    s += fmt::format("  {} ({}): {}", names.size(), reason, names.front());
    for (size_t i = 1; i < names.size() && i < 4; ++i) s += ", " + names[i];
    if (names.size() > 4) s += fmt::format(", ... ({} more)", names.size() - 4);
    s += "\n";
  }
  s += fmt::format("copied:    {} other tensors (1-D norms and biases) unchanged\n", rep.n_copied);
  s += fmt::format(
      "size:      {:.3f} MiB -> {:.3f} MiB of tensor data ({:.1f}%), file {:.3f} MiB\n",
      static_cast<double>(rep.bytes_in) / kMiB, static_cast<double>(rep.bytes_out) / kMiB,
      rep.bytes_in ? 100.0 * static_cast<double>(rep.bytes_out) / static_cast<double>(rep.bytes_in)
                   : 100.0,
      static_cast<double>(rep.file_bytes_out) / kMiB);
  (void)write_stdout(s);  // false: the reader closed the pipe, not an error
  return 0;
}

}  // namespace

Runner add_quantize(CLI::App& app) {
  auto o = std::make_shared<QuantizeOptions>();
  CLI::App* sub =
      app.add_subcommand("quantize",
                         "rewrite a GGUF model with its weight matrices in another type "
                         "(q4_0 q4_1 q5_0 q5_1 q8_0 q2_K q3_K q4_K q5_K q6_K f16 bf16 f32)");
  sub->add_option("input", o->in, "GGUF file to read")->required();
  sub->add_option("output", o->out, "GGUF file to write")->required();
  sub->add_option("type", o->type, "target type, e.g. q8_0 or q4_K")->required();
  sub->add_option("-t,--threads", o->n_threads, "worker threads (0: all physical cores)")
      ->check(range(0, 4096))
      ->capture_default_str();
  return [o] { return quantize(*o); };
}

}  // namespace berth::cli
