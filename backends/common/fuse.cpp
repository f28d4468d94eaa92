// The fusions of a step's device calls: neighbouring calls that one launch can do with the same
// bits (see CallKind's fused kinds).
#include "fuse.h"

#include <algorithm>

namespace berth {

using graph::Op;
using graph::OpKind;
using graph::ValueId;

namespace {

bool is_float(GgmlType t) {
  return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16;
}

}  // namespace

std::vector<Call> fuse_calls(const StepView& view, std::vector<Call> calls) {
  const graph::Graph& g = *view.g;
  const graph::WeightTable& w = *view.weights;
  const size_t n_ops = g.ops.size(), n = calls.size();
  // Where each device op's call is, and who reads each value (any side).
  std::vector<int64_t> call_of(n_ops, -1);
  for (size_t k = 0; k < n; ++k)
    if (calls[k].kind == CallKind::op) call_of[static_cast<size_t>(calls[k].ops[0])] = k;
  std::vector<int32_t> readers(g.values.size(), 0);
  std::vector<int64_t> reader(g.values.size(), -1);
  for (size_t i = 0; i < n_ops; ++i)
    for (ValueId v : g.ops[i].inputs) {
      ++readers[static_cast<size_t>(v)];
      reader[static_cast<size_t>(v)] = static_cast<int64_t>(i);
    }
  const auto op_call = [&](size_t k) { return k < n && calls[k].kind == CallKind::op; };
  const auto op_at = [&](size_t k) -> const Op& {
    return g.ops[static_cast<size_t>(calls[k].ops[0])];
  };

  // Per-head norms whose only reader is a device rope of the same head_dim (Qwen3's q and k
  // norms): the rope can run right after the norm, in the same call.
  std::vector<int64_t> rope_of(n_ops, -1);
  for (size_t i = 0; i < n_ops; ++i) {
    const Op& op = g.ops[i];
    if (op.kind != OpKind::rms_norm || op.norm_group <= 0 || call_of[i] < 0) continue;
    const auto v = static_cast<size_t>(op.output);
    if (readers[v] != 1 || op.output == g.output) continue;
    const auto r = static_cast<size_t>(reader[v]);
    const Op& rope = g.ops[r];
    if (rope.kind != OpKind::rope || call_of[r] < 0 || rope.inputs[0] != op.output ||
        rope.rope.head_dim != op.norm_group ||
        g.values[v].cols != static_cast<int64_t>(rope.rope.n_head) * rope.rope.head_dim)
      continue;
    rope_of[i] = static_cast<int64_t>(r);
  }
  // Norms i and i + 1 as one call: both fuse, with the same parameters, and no fork between
  // (a join between is hoisted before the pair).
  std::vector<bool> pair(n_ops, false);
  for (size_t i = 0; i + 1 < n_ops; ++i) {
    if (rope_of[i] < 0 || rope_of[i + 1] < 0 || (i > 0 && pair[i - 1])) continue;
    const int64_t a = call_of[i], b = call_of[i + 1];
    bool only_joins = b > a;
    for (int64_t k = a + 1; only_joins && k < b; ++k)
      only_joins = calls[static_cast<size_t>(k)].kind == CallKind::join;
    if (!only_joins) continue;
    const Op &x = g.ops[i], &y = g.ops[i + 1];
    const graph::RopeParams& rx = g.ops[static_cast<size_t>(rope_of[i])].rope;
    const graph::RopeParams& ry = g.ops[static_cast<size_t>(rope_of[i + 1])].rope;
    pair[i] = x.eps == y.eps && x.norm_group == y.norm_group && rx.n_rot == ry.n_rot &&
              rx.freq_base == ry.freq_base && rx.mode == ry.mode;
  }

  // One fork right after call k (a single segment forks there) and the flag hand-off.
  const auto single_fork_at = [&](size_t k) {
    return view.flags && k < n && calls[k].kind == CallKind::fork &&
           !(k + 1 < n && calls[k + 1].kind == CallKind::fork);
  };
  const auto is_route_1 = [&](size_t k) {
    // A decode row: the fused router GEMV gives the bits of the decode rows' matmul.
    return op_call(k) && op_at(k).kind == OpKind::moe_route &&
           g.values[static_cast<size_t>(op_at(k).output)].rows == 1 && g.decode_rows(1) == 1;
  };

  std::vector<Call> out;
  std::vector<bool> used(n, false);
  for (size_t k = 0; k < n; ++k) {
    if (used[k]) continue;
    Call& c = calls[k];
    if (c.kind != CallKind::op) {
      out.push_back(std::move(c));
      continue;
    }
    const size_t i = static_cast<size_t>(c.ops[0]);
    const Op& op = g.ops[i];
    if (rope_of[i] >= 0) {
      Call f{.kind = CallKind::norm_rope,
             .ops = {c.ops[0]},
             .ropes = {static_cast<int32_t>(rope_of[i])}};
      used[static_cast<size_t>(call_of[static_cast<size_t>(rope_of[i])])] = true;
      if (pair[i]) {
        const auto k2 = static_cast<size_t>(call_of[i + 1]);
        for (size_t j = k + 1; j < k2; ++j) {  // joins hoisted before the pair
          out.push_back(std::move(calls[j]));
          used[j] = true;
        }
        f.ops.push_back(static_cast<int32_t>(i + 1));
        f.ropes.push_back(static_cast<int32_t>(rope_of[i + 1]));
        used[k2] = true;
        used[static_cast<size_t>(call_of[static_cast<size_t>(rope_of[i + 1])])] = true;
      }
      out.push_back(std::move(f));
      continue;
    }
    if (c.streamed || c.host_w) {
      out.push_back(std::move(c));
      continue;
    }
    if (op.kind == OpKind::matmul) {
      // Consecutive device matmuls of one input (a layer's Q, K, V).
      size_t e = k + 1;
      while (op_call(e) && op_at(e).kind == OpKind::matmul && !calls[e].streamed &&
             op_at(e).inputs[0] == op.inputs[0])
        ++e;
      if (e - k >= 2) {
        Call f{.kind = CallKind::matmul_group};
        for (size_t j = k; j < e; ++j) f.ops.push_back(calls[j].ops[0]), used[j] = true;
        out.push_back(std::move(f));
        continue;
      }
      // The router's matmul (float weights), the route reading it, and the single fork after.
      if (is_float(w[op.weight].type) && is_route_1(k + 1) &&
          static_cast<size_t>(calls[k + 1].ops[0]) == i + 1 &&
          op_at(k + 1).inputs[0] == op.output && single_fork_at(k + 2)) {
        Call& fork = calls[k + 2];
        out.push_back(Call{.kind = CallKind::router_route_fork,
                           .ops = {c.ops[0], calls[k + 1].ops[0]},
                           .seg = fork.seg,
                           .send = std::move(fork.send),
                           .recv = std::move(fork.recv),
                           .in_place = fork.in_place});
        used[k + 1] = used[k + 2] = true;
        continue;
      }
    }
    if (op.kind == OpKind::add && op_call(k + 1)) {
      const Op& nm = op_at(k + 1);
      if (nm.kind == OpKind::rms_norm && nm.inputs[0] == op.output &&
          static_cast<size_t>(calls[k + 1].ops[0]) == i + 1 &&
          (nm.norm_group <= 0 || nm.norm_group == g.values[static_cast<size_t>(op.output)].cols)) {
        Call f{.kind = CallKind::add_norm, .ops = {c.ops[0], calls[k + 1].ops[0]}};
        if (!out.empty() && out.back().kind == CallKind::wait_segment) {
          // The segment's output read in place: the wait goes into the same launch.
          f.kind = CallKind::wait_add_norm;
          f.seg = out.back().seg;
          f.recv = std::move(out.back().recv);
          out.pop_back();
        }
        used[k + 1] = true;
        out.push_back(std::move(f));
        continue;
      }
    }
    if (is_route_1(k) && single_fork_at(k + 1)) {
      Call& fork = calls[k + 1];
      out.push_back(Call{.kind = CallKind::route_fork,
                         .ops = {c.ops[0]},
                         .seg = fork.seg,
                         .send = std::move(fork.send),
                         .recv = std::move(fork.recv),
                         .in_place = fork.in_place});
      used[k + 1] = true;
      continue;
    }
    if (op.kind == OpKind::swiglu && op_call(k + 1)) {
      // A decode row's FFN down projection (quantized weights) reading the swiglu alone: the
      // swiglu's output goes straight into the projection's 8-bit blocks.
      const Op& mm = op_at(k + 1);
      const auto v = static_cast<size_t>(op.output);
      if (mm.kind == OpKind::matmul && static_cast<size_t>(calls[k + 1].ops[0]) == i + 1 &&
          mm.inputs[0] == op.output && readers[v] == 1 && op.output != g.output &&
          !calls[k + 1].streamed && !calls[k + 1].host_w && g.values[v].rows == 1 &&
          g.decode_rows(1) == 1 && !is_float(w[mm.weight].type)) {
        out.push_back(
            Call{.kind = CallKind::swiglu_matmul, .ops = {c.ops[0], calls[k + 1].ops[0]}});
        used[k + 1] = true;
        continue;
      }
    }
    if (op.kind == OpKind::attention && op_call(k + 1)) {
      // The output projection of one token with quantized weights, reading the attention's
      // output: the attention can leave its 8-bit blocks in the workspace (unless another matmul
      // of the same input follows: that group quantizes for itself).
      const Op& mm = op_at(k + 1);
      const bool group_next = op_call(k + 2) && op_at(k + 2).kind == OpKind::matmul &&
                              op_at(k + 2).inputs[0] == mm.inputs[0];
      if (mm.kind == OpKind::matmul && static_cast<size_t>(calls[k + 1].ops[0]) == i + 1 &&
          mm.inputs[0] == op.output && !calls[k + 1].streamed && !calls[k + 1].host_w &&
          g.values[static_cast<size_t>(op.output)].rows == 1 && g.decode_rows(1) == 1 &&
          !is_float(w[mm.weight].type) && !group_next) {
        out.push_back(Call{.kind = CallKind::attention_q8, .ops = {c.ops[0], calls[k + 1].ops[0]}});
        used[k + 1] = true;
        continue;
      }
    }
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace berth
