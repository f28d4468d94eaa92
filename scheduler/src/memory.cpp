#include "berth/scheduler/memory.h"

#include <algorithm>

namespace berth {

using graph::Op;
using graph::OpKind;
using graph::ValueId;

namespace {

size_t value_bytes(const graph::ValueInfo& v) { return static_cast<size_t>(v.rows * v.cols) * 4; }
size_t round_up_mib(size_t bytes) { return (bytes + (size_t{1} << 20) - 1) >> 20 << 20; }

}  // namespace

MemoryPlan plan_memory(const Schedule& s, const graph::WeightTable& w,
                       std::span<const graph::ValueId> keep) {
  const graph::Graph& g = s.g;
  const size_t n_val = g.values.size();
  MemoryPlan m;
  m.on_device.assign(n_val, 0);
  m.pinned.assign(n_val, 0);
  m.host.assign(n_val, 0);
  std::vector<uint8_t> need_host(n_val, 0), in_place(n_val, 0);
  std::vector<int64_t> birth(n_val, -1), death(n_val, -1);
  const auto live = [&](ValueId vi, int64_t t) {
    const auto v = static_cast<size_t>(vi);
    m.on_device[v] = 1;
    if (birth[v] < 0) birth[v] = t;
    death[v] = std::max(death[v], t);
  };
  // Host side: values CPU ops read or write, and the output.
  for (size_t i = 0; i < g.ops.size(); ++i) {
    if (s.op_side[i] != Side::cpu) continue;
    need_host[static_cast<size_t>(g.ops[i].output)] = 1;
    for (ValueId v : g.ops[i].inputs) need_host[static_cast<size_t>(v)] = 1;
  }
  const auto out = static_cast<size_t>(g.output);
  need_host[out] = 1;
  for (const CpuSegment& seg : s.segments)
    if (seg.in_place) in_place[static_cast<size_t>(seg.outputs[0])] = 1;
  // Device side, in call order. A value written by the device is born at the call that writes
  // it (a fused call writes all its outputs at once); one copied there at its fork or upload.
  const int64_t n_calls = static_cast<int64_t>(s.calls.size());
  for (int64_t t = 0; t < n_calls; ++t) {
    const Call& c = s.calls[static_cast<size_t>(t)];
    std::vector<int32_t> ops = c.ops;
    ops.insert(ops.end(), c.ropes.begin(), c.ropes.end());
    // Inputs first: a call's outputs may not share memory with what it still reads.
    for (int32_t i : ops)
      for (ValueId v : g.ops[static_cast<size_t>(i)].inputs)
        if (!in_place[static_cast<size_t>(v)]) live(v, t);
    for (int32_t i : ops) live(g.ops[static_cast<size_t>(i)].output, t);
    for (ValueId v : c.send) live(v, t);
    if (!c.in_place)
      for (ValueId v : c.recv)
        if (!in_place[static_cast<size_t>(v)]) live(v, t);
    if (c.kind == CallKind::output || c.kind == CallKind::select) live(g.output, n_calls);
    if (c.streamed && !c.ops.empty()) {
      const graph::MoeParams& p = g.ops[static_cast<size_t>(c.ops[0])].moe;
      m.stage_bytes =
          std::max(m.stage_bytes, w[p.gate].n_bytes + w[p.up].n_bytes + w[p.down].n_bytes);
    }
    m.ws_bytes = std::max(m.ws_bytes, c.ws_bytes);
  }
  if (s.value_side[out] == Side::device) death[out] = n_calls;
  for (ValueId v : keep)
    if (m.on_device[static_cast<size_t>(v)]) death[static_cast<size_t>(v)] = n_calls;
  std::vector<size_t> sizes(n_val, 0);
  for (size_t v = 0; v < n_val; ++v) {
    if (m.on_device[v]) sizes[v] = value_bytes(g.values[v]);
    m.pinned[v] = need_host[v] && (m.on_device[v] || in_place[v]);
    m.host[v] = need_host[v] && !m.pinned[v];
    if (m.pinned[v]) m.pinned_bytes += value_bytes(g.values[v]);
  }
  m.arena_bytes = assign_offsets(sizes, birth, death, m.offset);
  // The host arena, by the CPU ops' order: segment after segment, each in op order
  // (graph::op_lifetimes, as CpuExecutor::run_ops groups them).
  std::vector<int32_t> order;
  for (const CpuSegment& seg : s.segments)
    order.insert(order.end(), seg.ops.begin(), seg.ops.end());
  const auto n_order = static_cast<int64_t>(order.size());
  std::vector<int64_t> h_birth, h_death;
  graph::op_lifetimes(g, order, h_birth, h_death);
  std::vector<size_t> host_sizes(n_val, 0);
  for (size_t v = 0; v < n_val; ++v) {
    if (!m.host[v]) continue;
    host_sizes[v] = value_bytes(g.values[v]);
    if (h_birth[v] < 0) h_birth[v] = 0;  // no CPU op touches it: the whole step, to be safe
    if (h_death[v] < 0) h_death[v] = n_order;
  }
  h_death[out] = n_order;
  for (ValueId v : graph::kept_after_step(g)) h_death[static_cast<size_t>(v)] = n_order;
  m.host_arena_bytes = assign_offsets(host_sizes, h_birth, h_death, m.host_offset);
  m.host_bytes = m.pinned_bytes + m.host_arena_bytes;
  return m;
}

size_t device_scratch_bytes(const graph::Graph& g, const graph::WeightTable& w, int64_t n_ctx,
                            Device* dev) {
  const int64_t n_ubatch = g.n_tokens;
  const size_t n_val = g.values.size(), n_ops = g.ops.size();
  std::vector<size_t> sizes(n_val), offsets;
  std::vector<int64_t> birth(n_val, 0), death(n_val, 0);
  for (size_t i = 0; i < n_ops; ++i) {
    const size_t o = static_cast<size_t>(g.ops[i].output);
    birth[o] = death[o] = static_cast<int64_t>(i);
    sizes[o] = value_bytes(g.values[o]);
    for (ValueId v : g.ops[i].inputs) death[static_cast<size_t>(v)] = static_cast<int64_t>(i);
  }
  death[static_cast<size_t>(g.output)] = static_cast<int64_t>(n_ops);
  size_t total = assign_offsets(sizes, birth, death, offsets);
  size_t ws = 0;
  if (dev) {
    // Every op on the device, one call each: the device sizes each call's workspace.
    std::vector<Call> calls(n_ops);
    for (size_t i = 0; i < n_ops; ++i) calls[i].ops = {static_cast<int32_t>(i)};
    for (const Call& c : dev->prepare(StepView{&g, &w, n_ctx, false}, std::move(calls), false))
      ws = std::max(ws, c.ws_bytes);
  }
  for (const Op& op : g.ops) {
    if (dev) {
      break;
    } else if (op.kind == OpKind::matmul || op.kind == OpKind::moe_experts) {
      const TensorView& t = w[op.kind == OpKind::matmul ? op.weight : op.moe.gate];
      ws = std::max(ws, (size_t{64} << 20) + static_cast<size_t>(n_ubatch * t.ne[0]) * 8);
    }
  }
  total += ws;
  return round_up_mib(total);
}

}  // namespace berth
