// `berth inspect`: print a GGUF file's metadata and a table of its tensors.
#include <fmt/format.h>

#include <algorithm>

#include "berth/core/strings.h"
#include "berth/io/gguf.h"
#include "commands.h"

namespace berth::cli {
namespace {

struct InspectOptions {
  std::string file;
  size_t max_array_items = 8;
  size_t max_value_chars = 160;
};

std::string shape_str(const gguf::TensorInfo& t) {
  std::string s = "[";
  for (uint32_t i = 0; i < std::max<uint32_t>(t.n_dims, 1); ++i)
    s += fmt::format("{}{}", i ? ", " : "", t.ne[i]);
  return s + "]";
}

int inspect(const InspectOptions& o) {
  gguf::File f = gguf::File::open(o.file);
  constexpr double kMiB = 1024.0 * 1024.0;
  std::string out;
  out += fmt::format("file: {}\n", f.path());
  out += fmt::format(
      "GGUF version {}, {} metadata keys, {} tensors, alignment {}, data at byte {}, "
      "{:.2f} MiB\n\n",
      f.version(), f.kvs().size(), f.tensors().size(), f.alignment(), f.data_offset(),
      static_cast<double>(f.file_size()) / kMiB);
  out += "metadata:\n";
  for (const gguf::KeyValue& kv : f.kvs()) {
    std::string v = kv.value.to_string(o.max_array_items);
    // Long strings (chat templates) are cut to one readable line unless asked otherwise.
    if (o.max_value_chars > 0 && v.size() > o.max_value_chars) {
      size_t cut = o.max_value_chars;
      while (cut > 0 && (static_cast<unsigned char>(v[cut]) & 0xC0) == 0x80)
        --cut;  // UTF-8 boundary
      v = v.substr(0, cut) + fmt::format("... ({} bytes)", v.size());
    }
    for (char& c : v)
      if (c == '\n') c = ' ';
    out += fmt::format("  {:<44} {:<8} {}\n", printable(kv.key, 200),
                       gguf::value_type_name(kv.value.type()), v);
  }

  size_t name_w = 4;
  for (const gguf::TensorInfo& t : f.tensors()) name_w = std::max(name_w, printable(t.name).size());
  out += fmt::format("\ntensors:\n  {:<{}}  {:<8} {:<28} {:>10}\n", "name", name_w, "type", "shape",
                     "MiB");
  uint64_t total_bytes = 0, total_elems = 0;
  std::vector<std::pair<std::string, uint64_t>> by_type;
  for (const gguf::TensorInfo& t : f.tensors()) {
    out += fmt::format("  {:<{}}  {:<8} {:<28} {:>10.3f}\n", printable(t.name), name_w,
                       type_name(t.type), shape_str(t), static_cast<double>(t.n_bytes) / kMiB);
    total_bytes += t.n_bytes;
    total_elems += static_cast<uint64_t>(t.n_elements());
    std::string tn(type_name(t.type));
    auto it = std::find_if(by_type.begin(), by_type.end(), [&](auto& p) { return p.first == tn; });
    if (it == by_type.end())
      by_type.emplace_back(tn, t.n_bytes);
    else
      it->second += t.n_bytes;
  }
  out += fmt::format("\ntotal: {} tensors, {} parameters, {:.3f} MiB of tensor data\n",
                     f.tensors().size(), total_elems, static_cast<double>(total_bytes) / kMiB);
  for (const auto& [tn, bytes] : by_type)
    out += fmt::format("  {:<8} {:>12.3f} MiB\n", tn, static_cast<double>(bytes) / kMiB);
  (void)write_stdout(out);  // false: the reader closed the pipe, not an error
  return 0;
}

}  // namespace

Runner add_inspect(CLI::App& app) {
  auto o = std::make_shared<InspectOptions>();
  CLI::App* sub = app.add_subcommand("inspect", "print a GGUF file's metadata and tensors");
  sub->add_option("file", o->file, "GGUF file")->required();
  sub->add_option("--max-array-items", o->max_array_items, "array elements shown per key")
      ->capture_default_str()
      ->check(range(size_t{0}, size_t{1} << 40));
  sub->add_option("--max-value-chars", o->max_value_chars,
                  "characters shown per metadata value (0: all)")
      ->capture_default_str()
      ->check(range(size_t{0}, size_t{1} << 40));
  return [o] { return inspect(*o); };
}

}  // namespace berth::cli
