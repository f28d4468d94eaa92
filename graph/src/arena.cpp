#include "berth/graph/arena.h"

#include <algorithm>

namespace berth::graph {

namespace {
constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
}  // namespace

size_t assign_offsets(const std::vector<size_t>& sizes, const std::vector<int64_t>& birth,
                      const std::vector<int64_t>& death, std::vector<size_t>& offsets) {
  const size_t n = sizes.size();
  std::vector<size_t> order;
  for (size_t i = 0; i < n; ++i)
    if (sizes[i] > 0) order.push_back(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return birth[a] < birth[b]; });
  offsets.assign(n, 0);
  struct Live {
    size_t off, size;
    int64_t death;
  };
  std::vector<Live> live;
  size_t total = 0;
  for (size_t i : order) {
    std::erase_if(live, [&](const Live& l) { return l.death < birth[i]; });
    std::sort(live.begin(), live.end(), [](const Live& a, const Live& b) { return a.off < b.off; });
    const size_t need = align_up(sizes[i]);
    size_t at = 0;
    for (const Live& l : live) {
      if (l.off >= at + need) break;
      at = std::max(at, l.off + l.size);
    }
    offsets[i] = at;
    live.push_back({at, need, death[i]});
    total = std::max(total, at + need);
  }
  return total;
}

size_t step_arena(const Graph& g, std::span<const ValueId> keep, std::vector<size_t>& offsets) {
  const size_t n_val = g.values.size(), n_ops = g.ops.size();
  std::vector<size_t> sizes(n_val, 0);
  std::vector<int64_t> birth(n_val, 0), death(n_val, 0);
  for (size_t i = 0; i < n_ops;) {
    // A group: consecutive matmuls of one input (CpuExecutor runs them as one region).
    size_t n = 1;
    if (g.ops[i].kind == OpKind::matmul)
      while (i + n < n_ops && g.ops[i + n].kind == OpKind::matmul &&
             g.ops[i + n].inputs[0] == g.ops[i].inputs[0])
        ++n;
    const auto first = static_cast<int64_t>(i), last = static_cast<int64_t>(i + n - 1);
    for (size_t j = i; j < i + n; ++j) {
      const Op& op = g.ops[j];
      for (ValueId v : op.inputs)
        death[static_cast<size_t>(v)] = std::max(death[static_cast<size_t>(v)], last);
      const auto o = static_cast<size_t>(op.output);
      sizes[o] = static_cast<size_t>(g.values[o].rows * g.values[o].cols) * sizeof(float);
      birth[o] = first;
      death[o] = std::max(death[o], last);
    }
    i += n;
  }
  const auto end = static_cast<int64_t>(n_ops);
  if (g.output >= 0) death[static_cast<size_t>(g.output)] = end;
  for (ValueId v : keep) death[static_cast<size_t>(v)] = end;
  return assign_offsets(sizes, birth, death, offsets);
}

std::vector<ValueId> kept_after_step(const Graph& g) {
  std::vector<ValueId> out;
  for (const Op& op : g.ops)
    if (op.kind == OpKind::moe_route) out.push_back(op.output);
  return out;
}

}  // namespace berth::graph
