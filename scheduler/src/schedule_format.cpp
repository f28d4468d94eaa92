// A Schedule as a table for people and as JSON (see schedule.h).
#include <fmt/format.h>

#include <map>
#include <nlohmann/json.hpp>

#include "berth/core/strings.h"
#include "berth/scheduler/schedule.h"

namespace berth {

using graph::Op;
using graph::OpKind;
using graph::ValueId;

namespace {

size_t value_bytes(const graph::ValueInfo& v) { return static_cast<size_t>(v.rows * v.cols) * 4; }

std::string bytes_text(size_t b) {
  if (b < 1024) return fmt::format("{} B", b);
  if (b < (size_t{1} << 20)) return fmt::format("{:.1f} KiB", static_cast<double>(b) / 1024);
  return fmt::format("{:.1f} MiB", static_cast<double>(b) / (1 << 20));
}

// "why" of op i: its cause and what it names.
std::string why(const Schedule& s, const graph::WeightTable& w, size_t i) {
  const Op& op = s.g.ops[i];
  const std::string side(side_name(s.op_side[i]));
  switch (s.op_cause[i]) {
    case Cause::no_device:
      return "no device";
    case Cause::weight:
      return fmt::format("weight {} on the {}", printable(w[op.weight].name), side);
    case Cause::expert_weights:
      return fmt::format("expert weights {} on the {}", printable(w[op.moe.gate].name), side);
    case Cause::kv_cache:
      if (op.kind == graph::OpKind::ssm_conv || op.kind == graph::OpKind::gated_delta)
        return fmt::format("recurrent state of layer {} on the {}", op.ssm.layer, side);
      return fmt::format("KV cache of layer {} on the {}", op.attn.layer, side);
    case Cause::streamed:
      if (op.moe.set == graph::ExpertSet::resident)
        return fmt::format("streamed: the experts of {} (on the CPU) the split copies, {} tokens",
                           printable(w[op.moe.gate].name), s.g.n_tokens);
      return fmt::format("streamed: {} on the CPU, {} tokens", printable(w[op.moe.gate].name),
                         s.g.n_tokens);
    case Cause::stream_cpu:
      return fmt::format("split: the experts of {} the step leaves to the CPU",
                         printable(w[op.moe.gate].name));
    case Cause::host_share: {
      const int32_t se = op.moe.slot_end < 0 ? op.moe.n_expert_used : op.moe.slot_end;
      return fmt::format("decode share: route slots {}-{} of {} read from host memory",
                         op.moe.slot_begin, se - 1, op.moe.n_expert_used);
    }
    case Cause::expert_slots:
      return fmt::format("expert slots: the experts of {} in its {} slots",
                         printable(w[op.moe.gate].name), op.moe.n_slots);
    case Cause::not_resident:
      return fmt::format("not in slots: the other experts of {} on the CPU",
                         printable(w[op.moe.gate].name));
    case Cause::device_input:
      return "an input on the GPU";
    case Cause::host_inputs:
      return op.inputs.empty() ? "no inputs" : "inputs on the CPU";
    case Cause::unsupported:
      return fmt::format("{} cannot run it", s.device_name);
  }
  return "?";
}

std::string values_text(const Schedule& s, const std::vector<ValueId>& vs) {
  std::string t;
  for (ValueId v : vs) {
    const graph::ValueInfo& vi = s.g.values[static_cast<size_t>(v)];
    t += fmt::format("{}{} ({})", t.empty() ? "" : ", ", vi.name, bytes_text(value_bytes(vi)));
  }
  return t.empty() ? "nothing" : t;
}

}  // namespace

std::string schedule_text(const Schedule& s, const graph::WeightTable& w, std::string_view title) {
  const graph::Graph& g = s.g;
  std::string out;
  if (s.has_device)
    out += fmt::format("{}: {}, hand-off {}\n", title, s.device_name, handoff_name(s.handoff));
  else
    out += fmt::format("{}: no device, every op on the CPU\n", title);
  // Per op: the device call that computes it (fused ones named) and what happens after it.
  std::vector<std::string> call_of(g.ops.size()), before(g.ops.size()), after(g.ops.size());
  std::string pre;
  for (size_t k = 0; k < s.calls.size(); ++k) {
    const Call& c = s.calls[k];
    for (size_t j = 0; j < c.ops.size(); ++j)
      call_of[static_cast<size_t>(c.ops[j])] =
          c.kind == CallKind::op ? fmt::format("call {}", k)
                                 : fmt::format("call {} {}", k, call_kind_name(c.kind));
    for (int32_t r : c.ropes)
      call_of[static_cast<size_t>(r)] = fmt::format("call {} {}", k, call_kind_name(c.kind));
  }
  for (size_t si = 0; si < s.segments.size(); ++si) {
    const CpuSegment& seg = s.segments[si];
    if (seg.fork_after < 0) {
      if (s.has_device)
        pre +=
            fmt::format("       CPU segment {} (ops {}-{}) runs before the step; to the GPU: {}\n",
                        si, seg.ops.front(), seg.ops.back(), values_text(s, seg.outputs));
      continue;
    }
    after[static_cast<size_t>(seg.fork_after)] +=
        fmt::format("       fork CPU segment {} (ops {}-{}): to the host {}; back {}{}\n", si,
                    seg.ops.front(), seg.ops.back(), values_text(s, seg.inputs),
                    values_text(s, seg.outputs), seg.in_place ? " (read in place)" : "");
  }
  for (size_t k = 0; k < s.calls.size(); ++k) {
    const Call& c = s.calls[k];
    if (c.kind != CallKind::join) continue;
    // Before the next call's first op, or at the end.
    size_t next = k + 1;
    while (next < s.calls.size() && s.calls[next].ops.empty()) ++next;
    const std::string line =
        fmt::format("       join (call {}): the GPU waits for the CPU segments forked so far\n", k);
    if (next < s.calls.size())
      before[static_cast<size_t>(s.calls[next].ops[0])] += line;
    else
      after[g.ops.size() - 1] += line;
  }
  out += pre;
  out += fmt::format("  {:>5}  {:<4}  {:<14}  {:<28}  {}\n", "op", "side", "kind", "name", "why");
  for (size_t i = 0; i < g.ops.size(); ++i) {
    out += before[i];
    const Op& op = g.ops[i];
    std::string line = fmt::format("  {:>5}  {:<4}  {:<14}  {:<28}  {}", i, side_name(s.op_side[i]),
                                   graph::op_name(op.kind), op.name, why(s, w, i));
    if (!call_of[i].empty()) line += fmt::format("  [{}]", call_of[i]);
    out += line + "\n";
    out += after[i];
  }
  size_t n_dev = 0;
  for (Side sd : s.op_side) n_dev += sd == Side::device;
  std::map<std::string, int> fused;
  for (const Call& c : s.calls)
    if (c.kind != CallKind::op) ++fused[std::string(call_kind_name(c.kind))];
  std::string kinds;
  for (const auto& [k, n] : fused) kinds += fmt::format("{}{} {}", kinds.empty() ? "" : ", ", n, k);
  if (s.has_device)
    out += fmt::format(
        "  {} ops on the GPU in {} calls ({}), {} on the CPU in {} segments; per step {} to the "
        "host, {} to the GPU\n",
        n_dev, s.calls.size(), kinds.empty() ? "no others" : kinds, g.ops.size() - n_dev,
        s.segments.size(), bytes_text(s.bytes_to_host()), bytes_text(s.bytes_to_device()));
  else
    out += fmt::format("  {} ops on the CPU\n", g.ops.size());
  return out;
}

std::string schedule_json(const Schedule& s, const graph::WeightTable& w, std::string_view title) {
  using nlohmann::json;
  const graph::Graph& g = s.g;
  json ops = json::array();
  for (size_t i = 0; i < g.ops.size(); ++i)
    ops.push_back({{"index", i},
                   {"name", g.ops[i].name},
                   {"kind", graph::op_name(g.ops[i].kind)},
                   {"side", side_name(s.op_side[i])},
                   {"cause", cause_name(s.op_cause[i])},
                   {"why", why(s, w, i)}});
  const auto vals = [&](const std::vector<ValueId>& vs) {
    json a = json::array();
    for (ValueId v : vs) {
      const graph::ValueInfo& vi = g.values[static_cast<size_t>(v)];
      a.push_back({{"name", vi.name}, {"bytes", value_bytes(vi)}});
    }
    return a;
  };
  json segs = json::array();
  for (const CpuSegment& seg : s.segments)
    segs.push_back({{"ops", seg.ops},
                    {"fork_after", seg.fork_after},
                    {"inputs", vals(seg.inputs)},
                    {"outputs", vals(seg.outputs)},
                    {"in_place", seg.in_place}});
  json calls = json::array();
  for (const Call& c : s.calls) {
    json j{{"kind", call_kind_name(c.kind)}, {"ops", c.ops}};
    if (!c.ropes.empty()) j["ropes"] = c.ropes;
    if (c.seg >= 0) j["segment"] = c.seg;
    if (c.streamed) j["streamed"] = true;
    if (c.host_w) j["host_weights"] = true;
    calls.push_back(std::move(j));
  }
  json out{{"title", title},
           {"n_tokens", g.n_tokens},
           {"device", s.has_device ? json(s.device_name) : json(nullptr)},
           {"handoff", s.has_device ? json(handoff_name(s.handoff)) : json(nullptr)},
           {"ops", std::move(ops)},
           {"segments", std::move(segs)},
           {"calls", std::move(calls)},
           {"bytes_to_host", s.bytes_to_host()},
           {"bytes_to_device", s.bytes_to_device()}};
  return out.dump(1);
}

}  // namespace berth
