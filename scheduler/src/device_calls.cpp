#include "device_calls.h"

#include <fmt/format.h>

#include <algorithm>

#include "berth/core/error.h"
#include "fuse.h"

namespace berth {

using graph::Op;
using graph::OpKind;
using graph::ValueId;

namespace {

size_t value_bytes(const graph::ValueInfo& v) { return static_cast<size_t>(v.rows * v.cols) * 4; }

// A moe_experts op's stacked expert tensors, at `ptrs` (gate, up, down; null: no pointers).
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

MoeSlots moe_slots(const Op& op, bool host_w) {
  return MoeSlots{.begin = op.moe.slot_begin, .end = op.moe.slot_end, .stage = host_w};
}

std::vector<HostCopy> copies_down(const StepBindings& b, const std::vector<ValueId>& vs) {
  std::vector<HostCopy> out;
  for (ValueId v : vs)
    out.push_back({b.host[static_cast<size_t>(v)], b.value[static_cast<size_t>(v)],
                   value_bytes(b.view.g->values[static_cast<size_t>(v)])});
  return out;
}

std::vector<HostCopy> copies_up(const StepBindings& b, const std::vector<ValueId>& vs) {
  std::vector<HostCopy> out;
  for (ValueId v : vs)
    out.push_back({b.value[static_cast<size_t>(v)], b.host[static_cast<size_t>(v)],
                   value_bytes(b.view.g->values[static_cast<size_t>(v)])});
  return out;
}

const float* wf(const StepBindings& b, graph::WeightId id) {
  return id == graph::kNoWeight ? nullptr
                                : static_cast<const float*>(b.weight.at(static_cast<size_t>(id)));
}

// The part of a fork after its inputs went down and its ready flag up (or, with callbacks, the
// whole fork).
void fork_rest(Device& dev, const Call& c, const StepBindings& b, bool signalled) {
  const std::vector<HostCopy> in = copies_up(b, c.recv);
  if (b.flags) {
    if (!signalled) {
      const std::vector<HostCopy> out = copies_down(b, c.send);
      dev.copy_out_signal(kMain, out.data(), static_cast<int>(out.size()), &b.flags[2 * c.seg], 1);
    }
    if (c.in_place) return;
    dev.wait(kAux, kMain);
    dev.wait_copy_in(kAux, &b.flags[2 * c.seg + 1], 1, in.data(), static_cast<int>(in.size()));
  } else {
    for (const HostCopy& h : copies_down(b, c.send)) dev.copy_d2h(kMain, h.dst, h.src, h.bytes);
    dev.wait(kAux, kMain);
    dev.host_fn(kAux, b.run_segment, b.segment_arg.at(static_cast<size_t>(c.seg)));
    for (const HostCopy& h : in) dev.copy_h2d(kAux, h.dst, h.src, h.bytes);
  }
}

// One op on the main stream. q8_out (attention): where the next matmul's 8-bit input blocks may
// go (returns whether they were written); x_q8 (matmul): its input's blocks are there already.
bool enqueue_op(Device& dev, const StepBindings& b, int32_t index, bool host_w,
                void* q8_out = nullptr, bool x_q8 = false) {
  const graph::Graph& g = *b.view.g;
  const graph::WeightTable& weights = *b.view.weights;
  const auto i = static_cast<size_t>(index);
  const Op& op = g.ops[i];
  const graph::ValueInfo& oi = g.values[static_cast<size_t>(op.output)];
  float* out = b.value[static_cast<size_t>(op.output)];
  const auto in = [&](size_t j) { return b.value[static_cast<size_t>(op.inputs.at(j))]; };
  const auto wdev = [&](graph::WeightId id) { return b.weight.at(static_cast<size_t>(id)); };
  const int64_t rows = oi.rows, cols = oi.cols;
  switch (op.kind) {
    case OpKind::embed: {
      const TensorView& w = weights[op.weight];
      dev.embed(kMain, w.type, wdev(op.weight), w.ne[0], w.ne[1], b.tokens, rows, out);
      return false;
    }
    case OpKind::rms_norm:
      dev.rms_norm(kMain, in(0), wf(b, op.weight), out, rows, cols,
                   op.norm_group > 0 ? op.norm_group : cols, op.eps);
      return false;
    case OpKind::matmul: {
      const TensorView& w = weights[op.weight];
      if (x_q8) {
        const MatmulJob job{w.type, wdev(op.weight), w.n_rows(), out};
        dev.matmul_group_q8(kMain, &job, 1, w.ne[0], in(0), rows, b.ws, b.ws_bytes);
      } else {
        dev.matmul(kMain, w.type, wdev(op.weight), w.ne[0], w.n_rows(), in(0), rows, out, b.ws,
                   b.ws_bytes);
      }
      return false;
    }
    case OpKind::add:
      dev.add(kMain, in(0), in(1), out, rows * cols);
      return false;
    case OpKind::swiglu:
      dev.swiglu(kMain, in(0), in(1), out, rows * cols);
      return false;
    case OpKind::rope: {
      const graph::RopeParams& p = op.rope;
      dev.rope(kMain, in(0), out, rows, p.n_head, p.head_dim, p.n_rot, p.freq_base,
               p.mode == graph::RopeMode::neox, b.positions);
      return false;
    }
    case OpKind::attention: {
      const graph::AttentionParams& p = op.attn;
      const auto l = static_cast<size_t>(p.layer);
      return dev.attention_q8(kMain, in(0), in(1), in(2), rows, b.positions, b.k_cache.at(l),
                              b.v_cache.at(l), b.view.n_ctx, p.n_head, p.n_head_kv, p.head_dim,
                              p.scale, out, b.ws, b.ws_bytes, q8_out);
    }
    case OpKind::take_last_rows: {
      const graph::ValueInfo& ii = g.values[static_cast<size_t>(op.inputs[0])];
      dev.copy_d2d(kMain, out, in(0) + (ii.rows - rows) * cols,
                   static_cast<size_t>(rows * cols) * 4);
      return false;
    }
    case OpKind::add_bias:
      dev.add_bias(kMain, in(0), wf(b, op.weight), out, rows, cols);
      return false;
    case OpKind::moe_route:
      dev.moe_route(kMain, in(0), rows, op.moe.n_expert, op.moe.n_expert_used, op.moe.norm_weights,
                    out);
      return false;
    case OpKind::moe_experts: {
      const std::array<const void*, 3>& o = b.moe_w.at(i);
      const void* dw[3] = {wdev(op.moe.gate), wdev(op.moe.up), wdev(op.moe.down)};
      const void* const* ptrs = o[0] ? o.data() : dw;
      dev.moe_experts(kMain, moe_weights(weights, op.moe, ptrs), in(0), in(1), rows, b.mask.at(i),
                      moe_slots(op, host_w), out, b.ws, b.ws_bytes);
      return false;
    }
  }
  throw Error(ErrorCategory::internal, fmt::format("op '{}' has an unknown kind", op.name));
}

}  // namespace

size_t op_workspace_bytes(Device& dev, const graph::Graph& g, const graph::WeightTable& w,
                          const Op& op, int64_t n_ctx, bool host_w) {
  const int64_t rows = g.values[static_cast<size_t>(op.output)].rows;
  switch (op.kind) {
    case OpKind::matmul: {
      const TensorView& t = w[op.weight];
      return dev.matmul_workspace_bytes(t.type, t.ne[0], t.n_rows(), rows);
    }
    case OpKind::attention:
      return dev.attention_workspace_bytes(rows, n_ctx, op.attn.n_head, op.attn.head_dim);
    case OpKind::moe_experts:
      return dev.moe_workspace_bytes(moe_weights(w, op.moe, nullptr), rows, moe_slots(op, host_w));
    default:
      return 0;
  }
}

std::vector<Call> prepare_calls(Device& dev, const StepView& view, std::vector<Call> calls,
                                bool fuse) {
  if (fuse) calls = fuse_calls(view, std::move(calls));
  for (Call& c : calls) {
    c.ws_bytes = 0;
    for (int32_t i : c.ops)
      c.ws_bytes = std::max(c.ws_bytes, op_workspace_bytes(dev, *view.g, *view.weights,
                                                           view.g->ops[static_cast<size_t>(i)],
                                                           view.n_ctx, c.host_w));
  }
  return calls;
}

void enqueue_call(Device& dev, const Call& c, const StepBindings& b) {
  const graph::Graph& g = *b.view.g;
  const graph::WeightTable& weights = *b.view.weights;
  const auto op_at = [&](size_t k) -> const Op& { return g.ops[static_cast<size_t>(c.ops.at(k))]; };
  const auto dv = [&](ValueId v) { return b.value[static_cast<size_t>(v)]; };
  switch (c.kind) {
    case CallKind::op:
      enqueue_op(dev, b, c.ops[0], c.host_w);
      return;
    case CallKind::fork:
      fork_rest(dev, c, b, false);
      return;
    case CallKind::join:
      dev.wait(kMain, kAux);
      return;
    case CallKind::wait_segment:
      dev.wait_flag(kMain, &b.flags[2 * c.seg + 1], 1);
      return;
    case CallKind::upload:
      for (const HostCopy& h : copies_up(b, c.recv)) dev.copy_h2d(kMain, h.dst, h.src, h.bytes);
      return;
    case CallKind::output: {
      const auto out = static_cast<size_t>(g.output);
      dev.copy_d2h(kMain, b.host[out], b.value[out], value_bytes(g.values[out]));
      return;
    }
    case CallKind::select: {
      // Greedy selection on the device: 4 bytes travel instead of the vocabulary's logits.
      const graph::ValueInfo& oi = g.values[static_cast<size_t>(g.output)];
      dev.argmax(kMain, dv(g.output) + (oi.rows - 1) * oi.cols, 1, oi.cols, b.selected_dev);
      dev.copy_d2h(kMain, b.selected_host, b.selected_dev, sizeof(int32_t));
      return;
    }
    case CallKind::matmul_group: {
      std::vector<MatmulJob> jobs;
      for (size_t k = 0; k < c.ops.size(); ++k) {
        const TensorView& w = weights[op_at(k).weight];
        jobs.push_back({w.type, b.weight.at(static_cast<size_t>(op_at(k).weight)), w.n_rows(),
                        dv(op_at(k).output)});
      }
      const ValueId x = op_at(0).inputs[0];
      dev.matmul_group(kMain, jobs.data(), static_cast<int>(jobs.size()),
                       weights[op_at(0).weight].ne[0], dv(x), g.values[static_cast<size_t>(x)].rows,
                       b.ws, b.ws_bytes);
      return;
    }
    case CallKind::add_norm:
    case CallKind::wait_add_norm: {
      const Op& add = op_at(0);
      const Op& nm = op_at(1);
      const graph::ValueInfo& vi = g.values[static_cast<size_t>(add.output)];
      if (c.kind == CallKind::wait_add_norm) {
        // The segment's output in its page-locked buffer, once its done flag is set (a + b is
        // the same float either way round).
        const ValueId hv = c.recv.at(0);
        const ValueId other = add.inputs[0] == hv ? add.inputs[1] : add.inputs[0];
        dev.wait_add_rms_norm(kMain, &b.flags[2 * c.seg + 1], 1, dv(other),
                              b.host[static_cast<size_t>(hv)], dv(add.output), wf(b, nm.weight),
                              dv(nm.output), vi.rows, vi.cols, nm.eps);
      } else {
        dev.add_rms_norm(kMain, dv(add.inputs[0]), dv(add.inputs[1]), dv(add.output),
                         wf(b, nm.weight), dv(nm.output), vi.rows, vi.cols, nm.eps);
      }
      return;
    }
    case CallKind::norm_rope: {
      NormRopeJob jobs[2];
      const Op& first = op_at(0);
      const graph::RopeParams& rp = g.ops[static_cast<size_t>(c.ropes.at(0))].rope;
      for (size_t k = 0; k < c.ops.size(); ++k) {
        const Op& nm = op_at(k);
        const Op& rope = g.ops[static_cast<size_t>(c.ropes.at(k))];
        jobs[k] = {dv(nm.inputs[0]), wf(b, nm.weight), dv(rope.output), rope.rope.n_head};
      }
      dev.norm_rope(kMain, jobs, static_cast<int>(c.ops.size()),
                    g.values[static_cast<size_t>(first.output)].rows, rp.head_dim, first.eps,
                    rp.n_rot, rp.freq_base, rp.mode == graph::RopeMode::neox, b.positions);
      return;
    }
    case CallKind::route_fork: {
      const Op& op = op_at(0);
      const std::vector<HostCopy> out = copies_down(b, c.send);
      dev.moe_route_signal(kMain, dv(op.inputs[0]), op.moe.n_expert, op.moe.n_expert_used,
                           op.moe.norm_weights, dv(op.output), out.data(),
                           static_cast<int>(out.size()), &b.flags[2 * c.seg], 1);
      fork_rest(dev, c, b, true);
      return;
    }
    case CallKind::router_route_fork: {
      const Op& mm = op_at(0);
      const Op& op = op_at(1);
      const TensorView& w = weights[mm.weight];
      const std::vector<HostCopy> out = copies_down(b, c.send);
      dev.router_route_signal(
          kMain, w.type, b.weight.at(static_cast<size_t>(mm.weight)), w.ne[0], dv(mm.inputs[0]),
          op.moe.n_expert, op.moe.n_expert_used, op.moe.norm_weights, dv(mm.output), dv(op.output),
          out.data(), static_cast<int>(out.size()), &b.flags[2 * c.seg], 1, b.ws, b.ws_bytes);
      fork_rest(dev, c, b, true);
      return;
    }
    case CallKind::attention_q8: {
      const bool q8 = enqueue_op(dev, b, c.ops[0], false, b.ws);
      enqueue_op(dev, b, c.ops[1], false, nullptr, q8);
      return;
    }
  }
  throw Error(ErrorCategory::internal,
              fmt::format("unknown call kind {}", static_cast<int>(c.kind)));
}

}  // namespace berth
