#include "berth/residency/direct_load.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <unordered_map>

#include "berth/core/error.h"

namespace berth {

DirectWeights::DirectWeights(const graph::WeightTable& weights, const std::vector<bool>& load,
                             const DirectLoadOptions& o)
    : table_(weights) {
  if (load.size() != weights.size())
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("direct load: {} flags for {} tensors", load.size(), weights.size()));
  const auto t0 = std::chrono::steady_clock::now();
  // The distinct byte ranges to read (by offset), and which tensors use each start.
  struct Range {
    uint64_t offset = 0;
    size_t length = 0;
    size_t tensor = 0;  // one of its tensors, for messages
  };
  std::vector<Range> ranges;
  // Tensor i is read: chosen, not empty, and inside the mapping.
  const auto loads = [&](size_t i) {
    const TensorView& t = weights.tensors[i];
    const auto* p = static_cast<const uint8_t*>(t.data);
    return load[i] && t.n_bytes > 0 && o.file_bytes && p >= o.file_bytes &&
           p + t.n_bytes <= o.file_bytes + o.file_size;
  };
  std::unordered_map<const void*, size_t> first;  // data pointer -> a range (dedup)
  for (size_t i = 0; i < weights.size(); ++i) {
    if (!loads(i)) continue;
    const TensorView& t = weights.tensors[i];
    const auto* p = static_cast<const uint8_t*>(t.data);
    if (first.emplace(t.data, ranges.size()).second)
      ranges.push_back({static_cast<uint64_t>(p - o.file_bytes), t.n_bytes, i});
  }
  if (ranges.empty()) return;
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.offset < b.offset; });
  // Runs: neighbours under 1 MiB apart (or overlapping) read as one.
  struct Run {
    uint64_t offset = 0;
    size_t length = 0;
    size_t tensor = 0;
  };
  std::vector<Run> runs;
  constexpr uint64_t kGap = uint64_t{1} << 20;
  for (const Range& r : ranges) {
    if (!runs.empty() && r.offset <= runs.back().offset + runs.back().length + kGap) {
      Run& b = runs.back();
      const uint64_t end = std::max<uint64_t>(b.offset + b.length, r.offset + r.length);
      b.length = static_cast<size_t>(end - b.offset);
    } else {
      runs.push_back({r.offset, r.length, r.tensor});
    }
  }
  io::DiskReader reader(o.path, o.reader);
  backend_ = reader.backend();
  std::vector<io::ReadRequest> req;
  std::vector<std::string> names;
  names.reserve(runs.size());
  runs_.reserve(runs.size());
  std::vector<uint8_t*> at(runs.size());  // where each run's first byte lands
  for (size_t k = 0; k < runs.size(); ++k) {
    const Run& r = runs[k];
    const io::DirectLayout lay = io::direct_layout(r.offset, r.length);
    runs_.emplace_back(lay.bytes);
    at[k] = runs_.back().data() + lay.pad;
    names.push_back(fmt::format("{} (with its neighbours)", weights.tensors[r.tensor].name));
    for (size_t off = 0; off < r.length; off += o.chunk_bytes)
      req.push_back(io::ReadRequest{r.offset + off, std::min(o.chunk_bytes, r.length - off),
                                    at[k] + off, names.back()});
    bytes_ += r.length;
  }
  const io::Ticket ticket = reader.submit(req);
  reader.wait(ticket);
  // Point the loaded tensors at their copies.
  for (size_t i = 0; i < weights.size(); ++i) {
    if (!loads(i)) continue;
    const auto off =
        static_cast<uint64_t>(static_cast<const uint8_t*>(weights.tensors[i].data) - o.file_bytes);
    // The run holding it: the last one starting at or before it.
    const auto it = std::upper_bound(runs.begin(), runs.end(), off,
                                     [](uint64_t v, const Run& r) { return v < r.offset; });
    const auto k = static_cast<size_t>(it - runs.begin()) - 1;
    table_.tensors[i].data = at[k] + (off - runs[k].offset);
    ++n_tensors_;
  }
  seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace berth
