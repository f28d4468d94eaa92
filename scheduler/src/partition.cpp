// partition(): the step graph -> a Schedule (see schedule.h for the rules).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "berth/core/error.h"
#include "berth/scheduler/schedule.h"

namespace berth {

using graph::Op;
using graph::OpKind;
using graph::ValueId;
using placement::Home;

std::string_view side_name(Side s) { return s == Side::device ? "GPU" : "CPU"; }

std::string_view cause_name(Cause c) {
  switch (c) {
    case Cause::no_device:
      return "no device";
    case Cause::weight:
      return "weight";
    case Cause::expert_weights:
      return "expert weights";
    case Cause::kv_cache:
      return "KV cache";
    case Cause::streamed:
      return "streamed experts";
    case Cause::host_share:
      return "decode share";
    case Cause::expert_slots:
      return "expert slots";
    case Cause::not_resident:
      return "not in slots";
    case Cause::stream_cpu:
      return "left to the CPU by the split";
    case Cause::device_input:
      return "input on the GPU";
    case Cause::host_inputs:
      return "inputs on the CPU";
    case Cause::unsupported:
      return "unsupported on the GPU";
  }
  return "?";
}

std::string_view handoff_name(Handoff h) {
  switch (h) {
    case Handoff::automatic:
      return "automatic";
    case Handoff::callback:
      return "callback";
    case Handoff::flags:
      return "flags";
  }
  return "?";
}

namespace {

size_t value_bytes(const graph::ValueInfo& v) { return static_cast<size_t>(v.rows * v.cols) * 4; }

// round(n f k): the slots the share gives the device over its first n candidate layers.
int32_t host_share_slots(double f, int32_t k, int64_t n) {
  return static_cast<int32_t>(std::floor(static_cast<double>(n) * f * k + 0.5));
}

}  // namespace

size_t Schedule::bytes_to_host() const {
  size_t n = 0;
  for (const CpuSegment& s : segments)
    for (ValueId v : s.inputs) n += value_bytes(g.values[static_cast<size_t>(v)]);
  return n;
}

size_t Schedule::bytes_to_device() const {
  size_t n = 0;
  for (const CpuSegment& s : segments)
    for (ValueId v : s.outputs) n += value_bytes(g.values[static_cast<size_t>(v)]);
  return n;
}

std::vector<int32_t> host_share_device_slots(const graph::Graph& g,
                                             const std::vector<Home>& weight_home, double f,
                                             bool any_tokens) {
  std::vector<int32_t> slots(g.ops.size(), 0);
  if (f <= 0 || (g.n_tokens != 1 && !any_tokens)) return slots;  // decode only
  std::vector<int32_t> producer(g.values.size(), -1);
  const auto home = [&](graph::WeightId id) {
    return id >= 0 && static_cast<size_t>(id) < weight_home.size()
               ? weight_home[static_cast<size_t>(id)]
               : Home::cpu;
  };
  int64_t c = 0;  // candidate layers so far
  for (size_t i = 0; i < g.ops.size(); ++i) {
    const Op& op = g.ops[i];
    producer[static_cast<size_t>(op.output)] = static_cast<int32_t>(i);
    if (op.kind != OpKind::moe_experts) continue;
    const int32_t p = producer[static_cast<size_t>(op.inputs[0])];
    // Stacked experts only (n_expert > 1), as Residency pins.
    if (p < 0 || op.moe.n_expert < 2 || home(op.moe.gate) != Home::cpu ||
        home(op.moe.up) != Home::cpu || home(op.moe.down) != Home::cpu)
      continue;
    const graph::WeightId pw = g.ops[static_cast<size_t>(p)].weight;
    if (pw == graph::kNoWeight || home(pw) != Home::gpu) continue;
    const int32_t sb = op.moe.slot_begin;
    const int32_t k = (op.moe.slot_end < 0 ? op.moe.n_expert_used : op.moe.slot_end) - sb;
    slots[i] = std::clamp(host_share_slots(f, k, c + 1) - host_share_slots(f, k, c), 0, k);
    ++c;
  }
  return slots;
}

namespace {

// Step 1: the split by expert slots and the decode share's (see schedule.h). Fills orig_index,
// host_w and slotted.
void split_host_experts(Schedule& s, const std::vector<Home>& weight_home, const Capabilities& caps,
                        const ScheduleOptions& opt) {
  graph::Graph& g = s.g;
  const auto pinned = [&](graph::WeightId id) {
    return static_cast<size_t>(id) < caps.pinned.size() && caps.pinned[static_cast<size_t>(id)];
  };
  const auto n_slots = [&](graph::WeightId id) {
    return static_cast<size_t>(id) < caps.slotted.size() ? caps.slotted[static_cast<size_t>(id)]
                                                         : 0;
  };
  // A step that may stream whole CPU-held layers keeps them whole. A batch-invariant step (of a
  // session of several sequences) never streams: whether a step streams follows its size, so
  // where a row's experts are computed (and their bits) would follow its neighbours.
  const bool streams = g.n_tokens > 1 && opt.stream_experts_min_tokens > 0 &&
                       g.n_tokens >= opt.stream_experts_min_tokens && !g.batch_invariant;
  // The decode share, over the layers without slots.
  std::vector<Home> share_home = weight_home;
  for (const Op& op : g.ops)
    if (op.kind == OpKind::moe_experts && n_slots(op.moe.gate) > 0 &&
        static_cast<size_t>(op.moe.gate) < share_home.size())
      share_home[static_cast<size_t>(op.moe.gate)] = Home::gpu;
  // Not in a batch-invariant step: the share applies to one-token steps only, so a sequence's
  // decode row would have its last slots computed on the device alone and on the CPU beside
  // other sequences.
  const std::vector<int32_t> dev_slots =
      g.batch_invariant ? std::vector<int32_t>(g.ops.size(), 0)
                        : host_share_device_slots(g, share_home, opt.host_expert_share);
  // The split of streamed layers: the layers the decode share could take (CPU-held, pinned, the
  // norm before them on the device) take it, in a step that streams and whose rows must not
  // depend on their neighbours (which experts the CPU computes depends on the whole ubatch).
  const std::vector<int32_t> split_cand =
      streams && opt.stream_split && !g.batch_invariant
          ? host_share_device_slots(g, share_home, 1.0, /*any_tokens=*/true)
          : std::vector<int32_t>{};
  std::vector<Op> ops;
  s.orig_index.clear();
  s.host_w.clear();
  s.slotted.clear();
  s.stream_split.clear();
  // Emits op's split: its CPU part, its device part (output and name suffixed `dev_suffix`) and
  // their sum (device part first) into op's output; the flags of the three ops. op's readers
  // find its result at the sum.
  const auto emit_split = [&](const Op& op, Op cpu_op, Op dev_op, const char* dev_suffix,
                              uint8_t dev_host_w, uint8_t slotted, uint8_t stream) {
    s.orig_index.push_back(static_cast<int32_t>(ops.size() + 2));
    const graph::ValueInfo vi = g.values[static_cast<size_t>(op.output)];
    cpu_op.output = static_cast<ValueId>(g.values.size());
    g.values.push_back({vi.rows, vi.cols, vi.name + ".cpu"});
    dev_op.output = static_cast<ValueId>(g.values.size());
    g.values.push_back({vi.rows, vi.cols, vi.name + dev_suffix});
    cpu_op.name += ".cpu";
    dev_op.name += dev_suffix;
    Op sum;
    sum.kind = OpKind::add;
    sum.inputs = {dev_op.output, cpu_op.output};
    sum.output = op.output;
    sum.name = op.name + ".sum";
    ops.push_back(std::move(cpu_op));
    ops.push_back(std::move(dev_op));
    ops.push_back(std::move(sum));
    s.host_w.insert(s.host_w.end(), {0, dev_host_w, 0});
    s.slotted.insert(s.slotted.end(), {slotted, slotted, 0});
    s.stream_split.insert(s.stream_split.end(), {stream, stream, 0});
  };
  for (size_t i = 0; i < g.ops.size(); ++i) {
    const Op& op = g.ops[i];
    const bool expert_op = op.kind == OpKind::moe_experts && pinned(op.moe.gate) &&
                           pinned(op.moe.up) && pinned(op.moe.down);
    const int32_t c = expert_op ? n_slots(op.moe.gate) : 0;
    if (expert_op && c == 0 && !split_cand.empty() && split_cand[i] > 0 &&
        op.moe.static_experts() && op.moe.experts.empty() && op.moe.slot_begin == 0 &&
        op.moe.slot_end < 0) {
      Op cpu_op = op, dev_op = op;
      cpu_op.moe.set = graph::ExpertSet::not_resident;
      dev_op.moe.set = graph::ExpertSet::resident;
      dev_op.moe.n_slots = op.moe.n_expert;
      emit_split(op, std::move(cpu_op), std::move(dev_op), ".stream", 0, 0, 1);
      continue;
    }
    if (c > 0 && !streams && op.moe.static_experts() && op.moe.experts.empty()) {
      Op cpu_op = op, dev_op = op;
      cpu_op.moe.set = graph::ExpertSet::not_resident;
      dev_op.moe.set = graph::ExpertSet::resident;
      dev_op.moe.n_slots = c;
      emit_split(op, std::move(cpu_op), std::move(dev_op), ".slots", 0, 1, 0);
      continue;
    }
    const bool split = expert_op && c == 0;
    Op cpu_op = op, dev_op = op;
    int32_t n_dev = 0, n_cpu = 0;
    if (split) {
      const int32_t sb = op.moe.slot_begin;
      const int32_t se = op.moe.slot_end < 0 ? op.moe.n_expert_used : op.moe.slot_end;
      n_dev = dev_slots[i];
      n_cpu = se - sb - n_dev;
      cpu_op.moe.slot_begin = sb;
      cpu_op.moe.slot_end = se - n_dev;
      dev_op.moe.slot_begin = se - n_dev;
      dev_op.moe.slot_end = se;
    }
    // A side left with no slot must not become an op: the device taking none is no split, the
    // CPU taking none leaves the whole op to the device (reading host memory).
    if (!split || n_dev == 0 || n_cpu == 0) {
      s.orig_index.push_back(static_cast<int32_t>(ops.size()));
      ops.push_back(op);
      s.host_w.push_back(split && n_dev > 0);
      s.slotted.push_back(0);
      s.stream_split.push_back(0);
      continue;
    }
    emit_split(op, std::move(cpu_op), std::move(dev_op), ".gpu", 1, 0, 0);
  }
  g.ops = std::move(ops);
}

// Op i is a device residual add whose result the whole-row norm right after it reads (no CPU
// segment forking between them): the pair a device can fuse, and the reader an in-place join
// needs.
bool add_then_norm(const Schedule& s, const std::vector<bool>& fork_after_op, size_t i) {
  const graph::Graph& g = s.g;
  const Op& op = g.ops[i];
  if (op.kind != OpKind::add || s.op_side[i] != Side::device || s.host_w[i] ||
      i + 1 >= g.ops.size() || fork_after_op[i])
    return false;
  const Op& nm = g.ops[i + 1];
  return s.op_side[i + 1] == Side::device && nm.kind == OpKind::rms_norm &&
         nm.inputs[0] == op.output &&
         (nm.norm_group <= 0 || nm.norm_group == g.values[static_cast<size_t>(op.output)].cols);
}

}  // namespace

Schedule partition(const graph::Graph& model_graph, const graph::WeightTable& weights,
                   const std::vector<Home>& weight_home, const std::vector<Home>& kv_home,
                   const Capabilities& caps, const ScheduleOptions& opt) {
  Schedule s;
  s.g = model_graph;
  s.n_model_ops = static_cast<int32_t>(model_graph.ops.size());
  s.has_device = caps.has_device;
  s.device_name = caps.device_name;
  const graph::Graph& g = s.g;
  if (!caps.has_device) {
    // One CPU segment, the whole step, on the calling thread.
    const size_t n = g.ops.size();
    s.orig_index.resize(n);
    s.op_side.assign(n, Side::cpu);
    s.op_cause.assign(n, Cause::no_device);
    s.value_side.assign(g.values.size(), Side::cpu);
    s.streamed.assign(n, 0);
    s.host_w.assign(n, 0);
    s.slotted.assign(n, 0);
    s.stream_split.assign(n, 0);
    CpuSegment all;
    for (size_t i = 0; i < n; ++i) {
      s.orig_index[i] = static_cast<int32_t>(i);
      all.ops.push_back(static_cast<int32_t>(i));
    }
    s.segments.push_back(std::move(all));
    return s;
  }
  if (weight_home.size() != weights.size())
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("placement names {} tensors but the model has {}", weight_home.size(),
                            weights.size()));
  s.handoff = opt.handoff == Handoff::automatic ? (caps.flags ? Handoff::flags : Handoff::callback)
                                                : opt.handoff;
  if (s.handoff == Handoff::flags && !caps.flags)
    throw Error(ErrorCategory::unsupported,
                fmt::format("{} cannot wait on flags in host memory; use the callback hand-off",
                            caps.device_name));

  // 1. The decode share.
  split_host_experts(s, weight_home, caps, opt);
  const size_t n_ops = g.ops.size(), n_val = g.values.size();
  const auto home_of = [&](graph::WeightId id) { return weight_home.at(static_cast<size_t>(id)); };
  const auto pinned = [&](graph::WeightId id) {
    return static_cast<size_t>(id) < caps.pinned.size() && caps.pinned[static_cast<size_t>(id)];
  };
  const auto side_of = [](Home h) { return h == Home::gpu ? Side::device : Side::cpu; };

  // 2. Sides.
  s.op_side.assign(n_ops, Side::cpu);
  s.op_cause.assign(n_ops, Cause::host_inputs);
  s.streamed.assign(n_ops, 0);
  s.value_side.assign(n_val, Side::cpu);
  std::vector<int32_t> producer(n_val, -1);
  for (size_t i = 0; i < n_ops; ++i) {
    const Op& op = g.ops[i];
    Side side = Side::cpu;
    Cause cause = Cause::host_inputs;
    switch (op.kind) {
      case OpKind::moe_experts: {
        const Home h = home_of(op.moe.gate);
        if (home_of(op.moe.up) != h || home_of(op.moe.down) != h)
          throw Error(ErrorCategory::invalid_argument,
                      fmt::format("{}, {} and {} are placed on different devices; the expert "
                                  "tensors of one layer must live together",
                                  weights[op.moe.gate].name, weights[op.moe.up].name,
                                  weights[op.moe.down].name));
        side = side_of(h);
        cause = Cause::expert_weights;
        if (op.moe.set == graph::ExpertSet::resident && s.stream_split[i]) {
          side = Side::device;
          cause = Cause::streamed;
          s.streamed[i] = 1;
        } else if (op.moe.set == graph::ExpertSet::resident) {
          side = Side::device;
          cause = Cause::expert_slots;
        } else if (op.moe.set == graph::ExpertSet::not_resident) {
          side = Side::cpu;
          cause = s.stream_split[i] ? Cause::stream_cpu : Cause::not_resident;
        } else if (s.host_w[i]) {
          side = Side::device;
          cause = Cause::host_share;
        } else if (h == Home::cpu && opt.stream_experts_min_tokens > 0 && g.n_tokens > 1 &&
                   g.n_tokens >= opt.stream_experts_min_tokens && !g.batch_invariant &&
                   s.value_side[static_cast<size_t>(op.inputs[0])] == Side::device &&
                   pinned(op.moe.gate) && pinned(op.moe.up) && pinned(op.moe.down)) {
          side = Side::device;
          cause = Cause::streamed;
          s.streamed[i] = 1;
        }
        break;
      }
      case OpKind::attention:
        side = side_of(kv_home.at(static_cast<size_t>(op.attn.layer)));
        cause = Cause::kv_cache;
        if (side == Side::device && caps.supports && !caps.supports(op))
          throw Error(ErrorCategory::invalid_argument,
                      fmt::format("{}: the KV cache of layer {} is placed on {}, which cannot run "
                                  "its attention",
                                  op.name, op.attn.layer, caps.device_name));
        break;
      case OpKind::ssm_conv:
      case OpKind::gated_delta: {
        // The recurrent state's home decides, as the KV cache does for attention; the op's small
        // weights (conv taps, ssm_a, ssm_dt) must be there too.
        const auto l = static_cast<size_t>(op.ssm.layer);
        side = side_of(kv_home.at(l));
        cause = Cause::kv_cache;
        for (graph::WeightId w : {op.weight, op.ssm.dt_bias})
          if (w != graph::kNoWeight && side_of(home_of(w)) != side)
            throw Error(
                ErrorCategory::invalid_argument,
                fmt::format("{}: the recurrent state of layer {} is placed on {} but {} on "
                            "{}; a Gated DeltaNet layer's ssm tensors live with its state",
                            op.name, l, side == Side::device ? caps.device_name : "the CPU",
                            weights[w].name, side == Side::device ? "the CPU" : caps.device_name));
        if (side == Side::device && caps.supports && !caps.supports(op))
          throw Error(ErrorCategory::invalid_argument,
                      fmt::format("{}: the recurrent state of layer {} is placed on {}, which "
                                  "cannot run {}",
                                  op.name, l, caps.device_name, graph::op_name(op.kind)));
        break;
      }
      default:
        if (op.weight != graph::kNoWeight) {
          side = side_of(home_of(op.weight));
          cause = Cause::weight;
        } else {
          // Weightless ops (add, swiglu, rope, routing, last rows) run on the device as soon as
          // one input lives there: following only the first input would keep a residual chain
          // that starts on the CPU (token_embd there) on the CPU for the whole step.
          for (ValueId v : op.inputs)
            if (s.value_side[static_cast<size_t>(v)] == Side::device) {
              side = Side::device;
              cause = Cause::device_input;
            }
        }
    }
    if (side == Side::device && caps.supports && !caps.supports(op)) {
      side = Side::cpu;
      cause = Cause::unsupported;
      s.streamed[i] = 0;
    }
    s.op_side[i] = side;
    s.op_cause[i] = cause;
    s.value_side[static_cast<size_t>(op.output)] = side;
    producer[static_cast<size_t>(op.output)] = static_cast<int32_t>(i);
  }

  // 3. CPU segments: runs of consecutive CPU ops; each forks after the last device op producing
  // one of its inputs (never before the previous segment's fork: the aux stream is in order).
  std::vector<int32_t> seg_of(n_ops, -1);
  for (size_t i = 0; i < n_ops; ++i) {
    if (s.op_side[i] != Side::cpu) continue;
    if (i == 0 || s.op_side[i - 1] != Side::cpu) s.segments.emplace_back();
    CpuSegment& seg = s.segments.back();
    seg.ops.push_back(static_cast<int32_t>(i));
    seg_of[i] = static_cast<int32_t>(s.segments.size() - 1);
    for (ValueId v : g.ops[i].inputs) {
      const int32_t p = producer[static_cast<size_t>(v)];
      if (p >= 0 && s.op_side[static_cast<size_t>(p)] == Side::device)
        seg.fork_after = std::max(seg.fork_after, p);
    }
  }
  for (size_t k = 1; k < s.segments.size(); ++k)
    s.segments[k].fork_after = std::max(s.segments[k].fork_after, s.segments[k - 1].fork_after);
  std::vector<bool> fork_after_op(n_ops, false);
  for (const CpuSegment& seg : s.segments)
    if (seg.fork_after >= 0) fork_after_op[static_cast<size_t>(seg.fork_after)] = true;

  // 4. Crossings: device values a segment reads (copied down at the first segment that reads
  // them) and segment outputs device ops read (copied up).
  std::vector<bool> copied_down(n_val, false);
  std::vector<int32_t> device_readers(n_val, 0);
  std::vector<int64_t> device_reader(n_val, -1);
  for (size_t i = 0; i < n_ops; ++i) {
    for (ValueId vi : g.ops[i].inputs) {
      const auto v = static_cast<size_t>(vi);
      if (s.op_side[i] == Side::device) {
        ++device_readers[v];
        device_reader[v] = static_cast<int64_t>(i);
        if (s.value_side[v] == Side::cpu) {
          CpuSegment& seg =
              s.segments[static_cast<size_t>(seg_of[static_cast<size_t>(producer[v])])];
          if (std::find(seg.outputs.begin(), seg.outputs.end(), vi) == seg.outputs.end())
            seg.outputs.push_back(vi);
        }
      } else if (s.value_side[v] == Side::device && !copied_down[v]) {
        s.segments[static_cast<size_t>(seg_of[i])].inputs.push_back(vi);
        copied_down[v] = true;
      }
    }
  }
  // In-place joins (flag hand-off; not while ops are timed one by one).
  std::vector<int32_t> joined_in_place(n_ops, -1);  // per op: the segment it reads in place
  if (s.handoff == Handoff::flags && !opt.profile) {
    for (size_t k = 0; k < s.segments.size(); ++k) {
      CpuSegment& seg = s.segments[k];
      if (seg.fork_after < 0 || seg.outputs.size() != 1) continue;
      const auto v = static_cast<size_t>(seg.outputs[0]);
      if (value_bytes(g.values[v]) > (size_t{64} << 10) || device_readers[v] != 1) continue;
      const auto c = static_cast<size_t>(device_reader[v]);
      if (!add_then_norm(s, fork_after_op, c)) continue;
      const Op& op = g.ops[c];
      const ValueId other = op.inputs[0] == seg.outputs[0] ? op.inputs[1] : op.inputs[0];
      if (other == seg.outputs[0] || s.value_side[static_cast<size_t>(other)] != Side::device)
        continue;
      seg.in_place = true;
      joined_in_place[c] = static_cast<int32_t>(k);
    }
  }

  // 5. The device's calls.
  size_t next_seg = 0;
  std::vector<bool> pending(n_val, false);  // written by a forked segment not yet joined
  bool any_forked = false;                  // a fork whose outputs come back on the aux stream
  const auto launch_ready = [&](int32_t after) {
    for (; next_seg < s.segments.size() && s.segments[next_seg].fork_after == after; ++next_seg) {
      const CpuSegment& seg = s.segments[next_seg];
      if (after < 0) {
        // Runs on the calling thread before the step: only its outputs travel.
        if (!seg.outputs.empty())
          s.calls.push_back(Call{.kind = CallKind::upload, .recv = seg.outputs});
        continue;
      }
      Call c{.kind = CallKind::fork,
             .seg = static_cast<int32_t>(next_seg),
             .send = seg.inputs,
             .in_place = seg.in_place};
      if (!seg.in_place) {
        c.recv = seg.outputs;
        for (ValueId v : seg.outputs) pending[static_cast<size_t>(v)] = true;
        any_forked = true;
      }
      s.calls.push_back(std::move(c));
    }
  };
  launch_ready(-1);
  for (size_t i = 0; i < n_ops; ++i) {
    if (s.op_side[i] != Side::device) continue;
    bool needs_join = false;
    for (ValueId v : g.ops[i].inputs) needs_join = needs_join || pending[static_cast<size_t>(v)];
    if (needs_join) {
      s.calls.push_back(Call{.kind = CallKind::join});
      std::fill(pending.begin(), pending.end(), false);
    }
    if (joined_in_place[i] >= 0)
      s.calls.push_back(Call{.kind = CallKind::wait_segment,
                             .seg = joined_in_place[i],
                             .recv = s.segments[static_cast<size_t>(joined_in_place[i])].outputs});
    s.calls.push_back(Call{.kind = CallKind::op,
                           .ops = {static_cast<int32_t>(i)},
                           .streamed = s.streamed[i] != 0,
                           .host_w = s.host_w[i] != 0});
    launch_ready(static_cast<int32_t>(i));
  }
  if (any_forked) s.calls.push_back(Call{.kind = CallKind::join});
  const auto out = static_cast<size_t>(g.output);
  if (s.value_side[out] == Side::device) {
    s.select = opt.select;
    s.calls.push_back(Call{.kind = opt.select ? CallKind::select : CallKind::output});
  }
  return s;
}

}  // namespace berth
