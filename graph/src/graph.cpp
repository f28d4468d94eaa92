#include "berth/graph/graph.h"

#include <fmt/format.h>

#include <algorithm>

#include "berth/core/error.h"

namespace berth::graph {

std::string_view op_name(OpKind k) {
  switch (k) {
    case OpKind::embed:
      return "embed";
    case OpKind::rms_norm:
      return "rms_norm";
    case OpKind::matmul:
      return "matmul";
    case OpKind::add:
      return "add";
    case OpKind::swiglu:
      return "swiglu";
    case OpKind::rope:
      return "rope";
    case OpKind::attention:
      return "attention";
    case OpKind::take_last_rows:
      return "take_last_rows";
    case OpKind::add_bias:
      return "add_bias";
    case OpKind::moe_route:
      return "moe_route";
    case OpKind::moe_experts:
      return "moe_experts";
    case OpKind::head_slice:
      return "head_slice";
    case OpKind::sigmoid_mul:
      return "sigmoid_mul";
    case OpKind::ssm_conv:
      return "ssm_conv";
    case OpKind::gated_delta:
      return "gated_delta";
    case OpKind::rms_norm_gated:
      return "rms_norm_gated";
  }
  return "?";
}

std::string_view role_name(WeightRole r) {
  switch (r) {
    case WeightRole::other:
      return "other";
    case WeightRole::embedding:
      return "embedding";
    case WeightRole::norm:
      return "norm";
    case WeightRole::attention:
      return "attention";
    case WeightRole::dense_ffn:
      return "dense FFN";
    case WeightRole::router:
      return "router";
    case WeightRole::routed_expert:
      return "routed expert";
    case WeightRole::shared_expert:
      return "shared expert";
    case WeightRole::head:
      return "head";
  }
  return "?";
}

std::string_view expert_set_name(ExpertSet s) {
  switch (s) {
    case ExpertSet::all:
      return "all";
    case ExpertSet::list:
      return "list";
    case ExpertSet::resident:
      return "resident";
    case ExpertSet::not_resident:
      return "not resident";
  }
  return "?";
}

bool MoeParams::has_expert(int32_t e) const {
  if (!static_experts())
    throw Error(ErrorCategory::internal,
                fmt::format("has_expert({}) asked of a moe_experts op over the {} experts: the "
                            "answer is in the layer's slot table at run time",
                            e, expert_set_name(set)));
  return experts.empty() || std::binary_search(experts.begin(), experts.end(), e);
}

ValueId Graph::add_value(int64_t rows, int64_t cols, std::string name) {
  values.push_back(ValueInfo{rows, cols, std::move(name)});
  return static_cast<ValueId>(values.size() - 1);
}

ValueId Graph::add_op(Op op) {
  BERTH_CHECK(op.output >= 0 && op.output < static_cast<ValueId>(values.size()));
  ops.push_back(std::move(op));
  return ops.back().output;
}

namespace {

[[noreturn]] void bad(const Op& op, const std::string& what) {
  throw Error(ErrorCategory::internal,
              fmt::format("invalid graph: op '{}' ({}): {}", op.name, op_name(op.kind), what));
}

}  // namespace

void Graph::validate(const WeightTable& weights) const {
  if (n_decode < -1 || n_decode > n_tokens)
    throw Error(ErrorCategory::internal,
                fmt::format("graph: {} decode rows in a step of {} tokens", n_decode, n_tokens));
  std::vector<bool> written(values.size(), false);
  auto val = [&](const Op& op, ValueId id) -> const ValueInfo& {
    if (id < 0 || id >= static_cast<ValueId>(values.size()))
      bad(op, fmt::format("value id {} out of range", id));
    return values[static_cast<size_t>(id)];
  };
  for (const Op& op : ops) {
    for (ValueId in : op.inputs) {
      val(op, in);
      if (!written[static_cast<size_t>(in)])
        bad(op, fmt::format("reads value '{}' before it is written", values[in].name));
    }
    const ValueInfo& out = val(op, op.output);
    if (written[static_cast<size_t>(op.output)]) bad(op, "writes a value twice");
    written[static_cast<size_t>(op.output)] = true;
    const TensorView* w = nullptr;
    if (op.weight != kNoWeight) {
      if (op.weight < 0 || op.weight >= static_cast<WeightId>(weights.size()))
        bad(op, fmt::format("weight id {} out of range", op.weight));
      w = &weights[op.weight];
    }
    auto need_inputs = [&](size_t n) {
      if (op.inputs.size() != n)
        bad(op, fmt::format("needs {} inputs, has {}", n, op.inputs.size()));
    };
    auto need_weight = [&] {
      if (!w) bad(op, "needs a weight");
    };
    switch (op.kind) {
      case OpKind::embed:
        need_inputs(0);
        need_weight();
        if (out.rows != n_tokens || out.cols != w->ne[0]) bad(op, "output shape");
        break;
      case OpKind::rms_norm: {
        need_inputs(1);
        const ValueInfo& x = values[op.inputs[0]];
        const int64_t len = op.norm_group > 0 ? op.norm_group : x.cols;
        if (op.norm_group < 0 || x.cols % len != 0) bad(op, "norm_group does not divide the row");
        if (w && (w->ne[0] != len || w->n_rows() != 1))
          bad(op, "norm weight length differs from the normalised length");
        if (out.rows != x.rows || out.cols != x.cols) bad(op, "output shape");
        break;
      }
      case OpKind::matmul: {
        need_inputs(1);
        need_weight();
        const ValueInfo& x = values[op.inputs[0]];
        if (w->ne[0] != x.cols)
          bad(op, fmt::format("weight '{}' rows have {} elements, input has {} columns", w->name,
                              w->ne[0], x.cols));
        if (out.rows != x.rows || out.cols != w->n_rows()) bad(op, "output shape");
        break;
      }
      case OpKind::add:
      case OpKind::swiglu: {
        need_inputs(2);
        const ValueInfo& a = values[op.inputs[0]];
        const ValueInfo& b = values[op.inputs[1]];
        if (a.rows != b.rows || a.cols != b.cols || out.rows != a.rows || out.cols != a.cols)
          bad(op, "shape mismatch");
        break;
      }
      case OpKind::rope: {
        need_inputs(1);
        const ValueInfo& x = values[op.inputs[0]];
        const RopeParams& p = op.rope;
        if (x.rows != n_tokens) bad(op, "rope input must have one row per token");
        if (p.n_head <= 0 || p.head_dim <= 0 || int64_t{p.n_head} * p.head_dim != x.cols)
          bad(op, "n_head * head_dim differs from the input's columns");
        if (p.n_rot <= 0 || p.n_rot > p.head_dim || p.n_rot % 2 != 0) bad(op, "bad n_rot");
        if (out.rows != x.rows || out.cols != x.cols) bad(op, "output shape");
        break;
      }
      case OpKind::attention: {
        need_inputs(3);
        const AttentionParams& p = op.attn;
        const ValueInfo& q = values[op.inputs[0]];
        const ValueInfo& k = values[op.inputs[1]];
        const ValueInfo& v = values[op.inputs[2]];
        if (p.n_head <= 0 || p.n_head_kv <= 0 || p.n_head % p.n_head_kv != 0)
          bad(op, "n_head must be a positive multiple of n_head_kv");
        if (q.rows != n_tokens || k.rows != n_tokens || v.rows != n_tokens)
          bad(op, "q, k, v need one row per token");
        if (q.cols != int64_t{p.n_head} * p.head_dim) bad(op, "q columns");
        if (k.cols != int64_t{p.n_head_kv} * p.head_dim || v.cols != k.cols) bad(op, "k/v columns");
        if (out.rows != q.rows || out.cols != q.cols) bad(op, "output shape");
        break;
      }
      case OpKind::take_last_rows: {
        need_inputs(1);
        const ValueInfo& x = values[op.inputs[0]];
        if (op.n_out <= 0 || op.n_out > x.rows) bad(op, "n_out out of range");
        if (out.rows != op.n_out || out.cols != x.cols) bad(op, "output shape");
        break;
      }
      case OpKind::add_bias: {
        need_inputs(1);
        need_weight();
        const ValueInfo& x = values[op.inputs[0]];
        if (w->ne[0] != x.cols || w->n_rows() != 1)
          bad(op, fmt::format("bias '{}' must be one row of length {}", w->name, x.cols));
        if (out.rows != x.rows || out.cols != x.cols) bad(op, "output shape");
        break;
      }
      case OpKind::moe_route: {
        need_inputs(1);
        const MoeParams& p = op.moe;
        const ValueInfo& x = values[op.inputs[0]];
        if (p.n_expert <= 0 || p.n_expert_used <= 0 || p.n_expert_used > p.n_expert)
          bad(op, "need 1 <= n_expert_used <= n_expert");
        if (x.cols != p.n_expert) bad(op, "router logits need n_expert columns");
        if (out.rows != x.rows || out.cols != 2 * int64_t{p.n_expert_used}) bad(op, "output shape");
        break;
      }
      case OpKind::moe_experts: {
        need_inputs(2);
        const MoeParams& p = op.moe;
        const ValueInfo& h = values[op.inputs[0]];
        const ValueInfo& r = values[op.inputs[1]];
        if (p.n_expert <= 0 || p.n_expert_used <= 0 || p.n_expert_used > p.n_expert)
          bad(op, "need 1 <= n_expert_used <= n_expert");
        if (r.rows != h.rows || r.cols != 2 * int64_t{p.n_expert_used}) bad(op, "route shape");
        for (WeightId id : {p.gate, p.up, p.down})
          if (id < 0 || id >= static_cast<WeightId>(weights.size())) bad(op, "expert weight id");
        const TensorView& g = weights[p.gate];
        const TensorView& u = weights[p.up];
        const TensorView& d = weights[p.down];
        if (g.ne[0] != h.cols || u.ne[0] != h.cols || g.ne[2] != p.n_expert ||
            u.ne[2] != p.n_expert || d.ne[2] != p.n_expert || g.ne[1] != u.ne[1] ||
            d.ne[0] != g.ne[1] || d.ne[1] != h.cols || g.ne[3] != 1 || u.ne[3] != 1 || d.ne[3] != 1)
          bad(op, fmt::format("expert tensors '{}', '{}', '{}' do not fit n_embd {} and "
                              "n_expert {}",
                              g.name, u.name, d.name, h.cols, p.n_expert));
        if (!p.static_experts() && !p.experts.empty())
          bad(op, fmt::format("an expert list with the {} experts", expert_set_name(p.set)));
        if (p.set == ExpertSet::list && p.experts.empty()) bad(op, "an empty expert list");
        if (p.set == ExpertSet::resident && (p.n_slots < 1 || p.n_slots > p.n_expert))
          bad(op, fmt::format("{} expert slots for {} experts", p.n_slots, p.n_expert));
        for (size_t i = 0; i < p.experts.size(); ++i)
          if (p.experts[i] < 0 || p.experts[i] >= p.n_expert ||
              (i > 0 && p.experts[i] <= p.experts[i - 1]))
            bad(op, "experts must be ascending ids below n_expert");
        if (p.slot_begin < 0 || p.slot_begin >= p.n_expert_used ||
            (p.slot_end >= 0 && (p.slot_end <= p.slot_begin || p.slot_end > p.n_expert_used)) ||
            p.slot_end < -1)
          bad(op, fmt::format("route slots [{}, {}) are not a non-empty range of the {} used",
                              p.slot_begin, p.slot_end, p.n_expert_used));
        if (out.rows != h.rows || out.cols != h.cols) bad(op, "output shape");
        break;
      }
      case OpKind::head_slice: {
        need_inputs(1);
        const ValueInfo& x = values[op.inputs[0]];
        const SliceParams& p = op.slice;
        if (p.group <= 0 || p.len <= 0 || p.offset < 0 || p.offset + p.len > p.group ||
            x.cols % p.group != 0)
          bad(op, fmt::format("slice [{}, {}) of groups of {} does not fit {} columns", p.offset,
                              p.offset + p.len, p.group, x.cols));
        if (out.rows != x.rows || out.cols != x.cols / p.group * p.len) bad(op, "output shape");
        break;
      }
      case OpKind::sigmoid_mul: {
        need_inputs(2);
        const ValueInfo& a = values[op.inputs[0]];
        const ValueInfo& b = values[op.inputs[1]];
        if (a.rows != b.rows || (b.cols != a.cols && b.cols != 1))
          bad(op, "the gate needs the input's shape or one column");
        if (out.rows != a.rows || out.cols != a.cols) bad(op, "output shape");
        break;
      }
      case OpKind::ssm_conv: {
        need_inputs(1);
        need_weight();
        const ValueInfo& x = values[op.inputs[0]];
        if (x.rows != n_tokens) bad(op, "ssm_conv input must have one row per token");
        if (w->type != GgmlType::F32 || w->ne[1] != x.cols || w->ne[0] < 1 || w->ne[0] > 8 ||
            w->ne[2] != 1)
          bad(op, fmt::format("conv weight '{}' must be F32 {{kernel <= 8, {}}}", w->name, x.cols));
        if (op.ssm.layer < 0) bad(op, "layer");
        if (out.rows != x.rows || out.cols != x.cols) bad(op, "output shape");
        break;
      }
      case OpKind::gated_delta: {
        need_inputs(3);
        need_weight();
        const SsmParams& p = op.ssm;
        const ValueInfo& y = values[op.inputs[0]];
        const ValueInfo& a = values[op.inputs[1]];
        const ValueInfo& b = values[op.inputs[2]];
        if (p.n_k_head <= 0 || p.n_v_head <= 0 || p.n_v_head % p.n_k_head != 0 || p.d_k <= 0 ||
            p.d_v <= 0 || p.layer < 0)
          bad(op, "need H_v a positive multiple of H_k, d_k, d_v > 0, layer >= 0");
        if (y.rows != n_tokens || a.rows != n_tokens || b.rows != n_tokens)
          bad(op, "inputs need one row per token");
        if (y.cols != 2 * int64_t{p.n_k_head} * p.d_k + int64_t{p.n_v_head} * p.d_v)
          bad(op, "y needs 2 * H_k * d_k + H_v * d_v columns");
        if (a.cols != p.n_v_head || b.cols != p.n_v_head) bad(op, "alpha and b need H_v columns");
        if (p.dt_bias < 0 || p.dt_bias >= static_cast<WeightId>(weights.size()))
          bad(op, "dt_bias weight id");
        for (const TensorView* t : {w, &weights[p.dt_bias]})
          if (t->type != GgmlType::F32 || t->ne[0] != p.n_v_head || t->n_rows() != 1)
            bad(op, fmt::format("'{}' must be F32 {{{}}}", t->name, p.n_v_head));
        if (out.rows != y.rows || out.cols != int64_t{p.n_v_head} * p.d_v) bad(op, "output shape");
        break;
      }
      case OpKind::rms_norm_gated: {
        need_inputs(2);
        need_weight();
        const ValueInfo& x = values[op.inputs[0]];
        const ValueInfo& z = values[op.inputs[1]];
        if (op.norm_group <= 0 || x.cols % op.norm_group != 0)
          bad(op, "norm_group does not divide the row");
        if (z.rows != x.rows || z.cols != x.cols) bad(op, "z needs x's shape");
        if (w->ne[0] != op.norm_group || w->n_rows() != 1)
          bad(op, "norm weight length differs from the group");
        if (out.rows != x.rows || out.cols != x.cols) bad(op, "output shape");
        break;
      }
    }
  }
  if (output == kNoValue || !written.at(static_cast<size_t>(output)))
    throw Error(ErrorCategory::internal, "invalid graph: no output value");
}

std::string Graph::to_string(const WeightTable& weights) const {
  std::string s =
      fmt::format("graph: {} tokens, {} ops, {} values\n", n_tokens, ops.size(), values.size());
  for (const Op& op : ops) {
    const ValueInfo& out = values[op.output];
    s += fmt::format("  {:<16} {:<22} -> [{} x {}]", op_name(op.kind), op.name, out.rows, out.cols);
    if (op.weight != kNoWeight)
      s += fmt::format("  w={} ({})", weights[op.weight].name, type_name(weights[op.weight].type));
    if (op.kind == OpKind::moe_experts)
      s += fmt::format("  w={} ({}) x{} experts, top {}", weights[op.moe.gate].name,
                       type_name(weights[op.moe.gate].type), op.moe.n_expert, op.moe.n_expert_used);
    s += '\n';
  }
  return s;
}

Builder::Builder(const WeightTable& weights, int32_t n_tokens) : weights_(weights) {
  BERTH_CHECK(n_tokens > 0);
  g_.n_tokens = n_tokens;
}

ValueId Builder::embed(WeightId w, std::string name) {
  ValueId out = g_.add_value(g_.n_tokens, weights_[w].ne[0], name);
  return g_.add_op(Op{.kind = OpKind::embed, .output = out, .weight = w, .name = std::move(name)});
}

ValueId Builder::rms_norm(ValueId x, WeightId w, float eps, std::string name) {
  const ValueInfo& in = info(x);
  ValueId out = g_.add_value(in.rows, in.cols, name);
  return g_.add_op(Op{.kind = OpKind::rms_norm,
                      .inputs = {x},
                      .output = out,
                      .weight = w,
                      .eps = eps,
                      .name = std::move(name)});
}

ValueId Builder::matmul(ValueId x, WeightId w, std::string name) {
  ValueId out = g_.add_value(info(x).rows, weights_[w].n_rows(), name);
  return g_.add_op(Op{
      .kind = OpKind::matmul, .inputs = {x}, .output = out, .weight = w, .name = std::move(name)});
}

ValueId Builder::add(ValueId a, ValueId b, std::string name) {
  ValueId out = g_.add_value(info(a).rows, info(a).cols, name);
  return g_.add_op(
      Op{.kind = OpKind::add, .inputs = {a, b}, .output = out, .name = std::move(name)});
}

ValueId Builder::swiglu(ValueId gate, ValueId up, std::string name) {
  ValueId out = g_.add_value(info(gate).rows, info(gate).cols, name);
  return g_.add_op(
      Op{.kind = OpKind::swiglu, .inputs = {gate, up}, .output = out, .name = std::move(name)});
}

ValueId Builder::rope(ValueId x, const RopeParams& p, std::string name) {
  ValueId out = g_.add_value(info(x).rows, info(x).cols, name);
  return g_.add_op(
      Op{.kind = OpKind::rope, .inputs = {x}, .output = out, .rope = p, .name = std::move(name)});
}

ValueId Builder::attention(ValueId q, ValueId k, ValueId v, const AttentionParams& p,
                           std::string name) {
  ValueId out = g_.add_value(info(q).rows, info(q).cols, name);
  return g_.add_op(Op{.kind = OpKind::attention,
                      .inputs = {q, k, v},
                      .output = out,
                      .attn = p,
                      .name = std::move(name)});
}

ValueId Builder::take_last_rows(ValueId x, int32_t n_out, std::string name) {
  ValueId out = g_.add_value(n_out, info(x).cols, name);
  return g_.add_op(Op{.kind = OpKind::take_last_rows,
                      .inputs = {x},
                      .output = out,
                      .n_out = n_out,
                      .name = std::move(name)});
}

ValueId Builder::rms_norm_grouped(ValueId x, WeightId w, int32_t group, float eps,
                                  std::string name) {
  const ValueInfo& in = info(x);
  ValueId out = g_.add_value(in.rows, in.cols, name);
  return g_.add_op(Op{.kind = OpKind::rms_norm,
                      .inputs = {x},
                      .output = out,
                      .weight = w,
                      .eps = eps,
                      .norm_group = group,
                      .name = std::move(name)});
}

ValueId Builder::add_bias(ValueId x, WeightId bias, std::string name) {
  ValueId out = g_.add_value(info(x).rows, info(x).cols, name);
  return g_.add_op(Op{.kind = OpKind::add_bias,
                      .inputs = {x},
                      .output = out,
                      .weight = bias,
                      .name = std::move(name)});
}

ValueId Builder::moe_route(ValueId router_logits, const MoeParams& p, std::string name) {
  ValueId out = g_.add_value(info(router_logits).rows, 2 * int64_t{p.n_expert_used}, name);
  return g_.add_op(Op{.kind = OpKind::moe_route,
                      .inputs = {router_logits},
                      .output = out,
                      .moe = p,
                      .name = std::move(name)});
}

ValueId Builder::moe_experts(ValueId h, ValueId route, const MoeParams& p, std::string name) {
  ValueId out = g_.add_value(info(h).rows, info(h).cols, name);
  return g_.add_op(Op{.kind = OpKind::moe_experts,
                      .inputs = {h, route},
                      .output = out,
                      .moe = p,
                      .name = std::move(name)});
}

ValueId Builder::head_slice(ValueId x, const SliceParams& p, std::string name) {
  const ValueInfo& in = info(x);
  ValueId out = g_.add_value(in.rows, p.group > 0 ? in.cols / p.group * p.len : 0, name);
  return g_.add_op(Op{.kind = OpKind::head_slice,
                      .inputs = {x},
                      .output = out,
                      .slice = p,
                      .name = std::move(name)});
}

ValueId Builder::sigmoid_mul(ValueId x, ValueId gate, std::string name) {
  ValueId out = g_.add_value(info(x).rows, info(x).cols, name);
  return g_.add_op(
      Op{.kind = OpKind::sigmoid_mul, .inputs = {x, gate}, .output = out, .name = std::move(name)});
}

ValueId Builder::ssm_conv(ValueId x, WeightId conv1d, const SsmParams& p, std::string name) {
  ValueId out = g_.add_value(info(x).rows, info(x).cols, name);
  return g_.add_op(Op{.kind = OpKind::ssm_conv,
                      .inputs = {x},
                      .output = out,
                      .weight = conv1d,
                      .ssm = p,
                      .name = std::move(name)});
}

ValueId Builder::gated_delta(ValueId y, ValueId alpha, ValueId b, WeightId ssm_a,
                             const SsmParams& p, std::string name) {
  ValueId out = g_.add_value(info(y).rows, int64_t{p.n_v_head} * p.d_v, name);
  return g_.add_op(Op{.kind = OpKind::gated_delta,
                      .inputs = {y, alpha, b},
                      .output = out,
                      .weight = ssm_a,
                      .ssm = p,
                      .name = std::move(name)});
}

ValueId Builder::rms_norm_gated(ValueId x, ValueId z, WeightId w, int32_t group, float eps,
                                std::string name) {
  ValueId out = g_.add_value(info(x).rows, info(x).cols, name);
  return g_.add_op(Op{.kind = OpKind::rms_norm_gated,
                      .inputs = {x, z},
                      .output = out,
                      .weight = w,
                      .eps = eps,
                      .norm_group = group,
                      .name = std::move(name)});
}

Graph Builder::finish(ValueId logits) {
  g_.output = logits;
  g_.validate(weights_);
  return std::move(g_);
}

}  // namespace berth::graph
