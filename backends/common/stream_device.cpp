#include "stream_device.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>

#include "berth/core/error.h"
#include "fuse.h"

namespace berth {

std::string_view call_kind_name(CallKind k) {
  switch (k) {
    case CallKind::op:
      return "op";
    case CallKind::fork:
      return "fork";
    case CallKind::join:
      return "join";
    case CallKind::wait_segment:
      return "wait_segment";
    case CallKind::upload:
      return "upload";
    case CallKind::output:
      return "output";
    case CallKind::select:
      return "select";
    case CallKind::matmul_group:
      return "matmul_group";
    case CallKind::add_norm:
      return "add_norm";
    case CallKind::norm_rope:
      return "norm_rope";
    case CallKind::route_fork:
      return "route_fork";
    case CallKind::router_route_fork:
      return "router_route_fork";
    case CallKind::wait_add_norm:
      return "wait_add_norm";
    case CallKind::attention_q8:
      return "attention_q8";
    case CallKind::swiglu_matmul:
      return "swiglu_matmul";
  }
  return "?";
}

namespace backend_detail {

size_t value_bytes(const graph::Graph& g, graph::ValueId v) {
  const graph::ValueInfo& vi = g.values[static_cast<size_t>(v)];
  return static_cast<size_t>(vi.rows * vi.cols) * 4;
}

MoeWeights moe_weights(const graph::WeightTable& w, const graph::MoeParams& p,
                       const void* const* ptrs) {
  const TensorView& gt = w[p.gate];
  MoeWeights m;
  m.gate_type = gt.type;
  m.up_type = w[p.up].type;
  m.down_type = w[p.down].type;
  if (ptrs) m.gate = ptrs[0], m.up = ptrs[1], m.down = ptrs[2];
  m.n_embd = gt.ne[0];
  m.n_ff = gt.ne[1];
  m.n_expert = p.n_expert;
  m.n_expert_used = p.n_expert_used;
  return m;
}

MoeSlots moe_slots(const graph::Op& op, bool host_w, const int32_t* table) {
  const bool by_table = op.moe.set == graph::ExpertSet::resident;
  return MoeSlots{.begin = op.moe.slot_begin,
                  .end = op.moe.slot_end,
                  .stage = host_w,
                  .by_table = by_table,
                  .table = by_table ? table : nullptr,
                  .n_slots = by_table ? op.moe.n_slots : 0};
}

const int32_t* slot_table_of(const StepBindings& b, size_t i) {
  return i < b.slot_table.size() ? b.slot_table[i] : nullptr;
}

const int32_t* forced_route_of(const StepBindings& b, size_t i) {
  return i < b.forced_route.size() ? b.forced_route[i] : nullptr;
}

std::vector<Call> StreamDevice::prepare(const StepView& view, std::vector<Call> calls,
                                        bool fuse) const {
  if (fuse) calls = fuse_calls(view, std::move(calls));
  for (Call& c : calls) {
    c.ws_bytes = 0;
    for (int32_t i : c.ops)
      c.ws_bytes =
          std::max(c.ws_bytes, op_workspace(view, view.g->ops[static_cast<size_t>(i)], c.host_w));
  }
  return calls;
}

void StreamDevice::copy_out_signal(int s, const HostCopy* copies, int n, uint32_t* flag,
                                   uint32_t value) {
  for (int i = 0; i < n; ++i) copy(s, copies[i].dst, copies[i].src, copies[i].bytes);
  write_flag(s, flag, value);
}

void StreamDevice::wait_copy_in(int s, const uint32_t* flag, uint32_t value, const HostCopy* copies,
                                int n) {
  wait_flag(s, flag, value);
  for (int i = 0; i < n; ++i) copy(s, copies[i].dst, copies[i].src, copies[i].bytes);
}

std::vector<HostCopy> StreamDevice::copies_down(const StepBindings& b,
                                                const std::vector<graph::ValueId>& vs) {
  std::vector<HostCopy> out;
  for (graph::ValueId v : vs)
    out.push_back({b.host[static_cast<size_t>(v)], b.value[static_cast<size_t>(v)],
                   value_bytes(*b.view.g, v)});
  return out;
}

std::vector<HostCopy> StreamDevice::copies_up(const StepBindings& b,
                                              const std::vector<graph::ValueId>& vs) {
  std::vector<HostCopy> out;
  for (graph::ValueId v : vs)
    out.push_back({b.value[static_cast<size_t>(v)], b.host[static_cast<size_t>(v)],
                   value_bytes(*b.view.g, v)});
  return out;
}

void StreamDevice::fork_rest(const Call& c, const StepBindings& b, bool signalled) {
  const std::vector<HostCopy> in = copies_up(b, c.recv);
  if (b.flags) {
    // The inputs go down and the ready flag up in one device operation; the wait for the done
    // flag and the outputs' way back in another, on the aux stream, so the main stream may go on
    // with device work that does not need them (or, read in place, in the add that reads it).
    if (!signalled) {
      const std::vector<HostCopy> out = copies_down(b, c.send);
      copy_out_signal(kMain, out.data(), static_cast<int>(out.size()), &b.flags[2 * c.seg], 1);
    }
    if (c.in_place) return;
    wait(kAux, kMain);
    wait_copy_in(kAux, &b.flags[2 * c.seg + 1], 1, in.data(), static_cast<int>(in.size()));
  } else {
    for (const HostCopy& h : copies_down(b, c.send)) copy(kMain, h.dst, h.src, h.bytes);
    wait(kAux, kMain);
    host_fn(kAux, b.run_segment, b.segment_arg.at(static_cast<size_t>(c.seg)));
    for (const HostCopy& h : in) copy(kAux, h.dst, h.src, h.bytes);
  }
}

bool StreamDevice::enqueue_handoff(const Call& c, const StepBindings& b) {
  const graph::Graph& g = *b.view.g;
  switch (c.kind) {
    case CallKind::fork:
      fork_rest(c, b, false);
      return true;
    case CallKind::join:
      wait(kMain, kAux);
      return true;
    case CallKind::wait_segment:
      wait_flag(kMain, &b.flags[2 * c.seg + 1], 1);
      return true;
    case CallKind::upload:
      for (const HostCopy& h : copies_up(b, c.recv)) copy(kMain, h.dst, h.src, h.bytes);
      return true;
    case CallKind::output:
      copy(kMain, b.host[static_cast<size_t>(g.output)], b.value[static_cast<size_t>(g.output)],
           value_bytes(g, g.output));
      return true;
    default:
      return false;
  }
}

}  // namespace backend_detail
}  // namespace berth
