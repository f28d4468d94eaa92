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

void op_lifetimes(const Graph& g, std::span<const int32_t> order, std::vector<int64_t>& birth,
                  std::vector<int64_t>& death) {
  const auto n = static_cast<int64_t>(order.empty() ? g.ops.size() : order.size());
  const auto op_at = [&](int64_t j) {
    return order.empty() ? static_cast<size_t>(j)
                         : static_cast<size_t>(order[static_cast<size_t>(j)]);
  };
  birth.assign(g.values.size(), -1);
  death.assign(g.values.size(), -1);
  const auto touch = [&](ValueId vi, int64_t b, int64_t d) {
    const auto v = static_cast<size_t>(vi);
    if (birth[v] < 0) birth[v] = b;
    death[v] = std::max(death[v], d);
  };
  for (int64_t i = 0; i < n;) {
    const Op& op = g.ops[op_at(i)];
    int64_t k = 1;
    if (op.kind == OpKind::matmul)
      while (i + k < n && op_at(i + k) == op_at(i) + static_cast<size_t>(k) &&
             g.ops[op_at(i + k)].kind == OpKind::matmul &&
             g.ops[op_at(i + k)].inputs[0] == op.inputs[0])
        ++k;
    const int64_t first = i, last = i + k - 1;
    for (int64_t j = i; j < i + k; ++j) {
      const Op& o = g.ops[op_at(j)];
      for (ValueId v : o.inputs) touch(v, first, last);
      touch(o.output, first, last);
    }
    i += k;
  }
}

size_t step_arena(const Graph& g, std::span<const ValueId> keep, std::vector<size_t>& offsets) {
  const size_t n_val = g.values.size();
  std::vector<int64_t> birth, death;
  op_lifetimes(g, {}, birth, death);
  std::vector<size_t> sizes(n_val, 0);
  for (const Op& op : g.ops) {
    const auto o = static_cast<size_t>(op.output);
    sizes[o] = static_cast<size_t>(g.values[o].rows * g.values[o].cols) * sizeof(float);
  }
  const auto end = static_cast<int64_t>(g.ops.size());
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
