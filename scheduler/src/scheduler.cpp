#include "berth/scheduler/scheduler.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <thread>

#include "berth/core/error.h"
#include "berth/core/log.h"

namespace berth {

using graph::Op;
using graph::OpKind;
using graph::ValueId;
using placement::Home;

namespace {

size_t value_bytes(const graph::ValueInfo& v) { return static_cast<size_t>(v.rows * v.cols) * 4; }

}  // namespace

struct SegmentRun {
  Scheduler* sch = nullptr;
  Scheduler::Step* st = nullptr;
  size_t index = 0;
};

struct Scheduler::Step {
  int32_t n_tokens = 0;
  int32_t n_decode = -1;  // graph::Graph::n_decode of the steps of this shape
  int64_t out_rows = 0;
  size_t n_ops = 0;
  bool select = false, profile = false;
  Schedule s;
  MemoryPlan m;
  StepBindings b;
  std::vector<SegmentRun> seg_runs;
  std::vector<float*> host_val;     // per value: where CPU ops read and write it
  std::vector<float> host_arena;    // values only CPU ops touch (MemoryPlan)
  std::vector<void*> pinned;        // page-locked host buffers (to free)
  std::vector<size_t> pinned_size;  // their sizes
  std::vector<uint8_t*> masks;      // device expert masks (to free)
  void* arena = nullptr;
  void* ws = nullptr;
  float* out_host = nullptr;
  int graph = -1;         // captured device graph (decode)
  uint64_t last_use = 0;  // Scheduler::use_clock_ when last run
  double cpu_seconds = 0;
  std::exception_ptr error;
  // Streamed layers with expert slots: (slot layer, its route value), read after the step.
  std::vector<std::pair<int32_t, graph::ValueId>> seat;
  // The split of streamed layers: per op, its layer in Scheduler::split_ (-1: none), and the
  // layers this step splits, in op order.
  std::vector<int32_t> split_of;
  std::vector<int32_t> split_layers;
  std::vector<double> seg_seconds;  // per CPU segment, this step's time
};

Capabilities capabilities(Device* dev, const Residency* res, size_t n_weights) {
  Capabilities c;
  if (!dev) return c;
  c.has_device = true;
  c.device_name = dev->name();
  c.flags = dev->supports_flags();
  c.supports = [dev](const graph::Op& op) { return dev->supports(op); };
  if (res && res->host_experts_pinned()) {
    c.pinned.assign(n_weights, false);
    for (size_t i = 0; i < n_weights; ++i)
      c.pinned[i] = res->pinned(static_cast<graph::WeightId>(i)) != nullptr;
  }
  if (res && res->expert_slots()) {
    const ExpertSlots& xs = *res->expert_slots();
    c.slotted.assign(n_weights, 0);
    for (int32_t l = 0; l < xs.n_layers(); ++l)
      c.slotted[static_cast<size_t>(xs.layer(l).gate)] = xs.capacity();
  }
  return c;
}

Schedule make_schedule(const graph::Graph& g, const graph::WeightTable& weights,
                       const std::vector<Home>& weight_home, const std::vector<Home>& kv_home,
                       const Capabilities& caps, const ScheduleOptions& opt, Device* dev,
                       int64_t n_ctx) {
  Schedule s = partition(g, weights, weight_home, kv_home, caps, opt);
  if (s.has_device && dev)
    s.calls = dev->prepare(StepView{&s.g, &weights, n_ctx, s.handoff == Handoff::flags},
                           std::move(s.calls), !opt.profile);
  return s;
}

Scheduler::Scheduler(ThreadPool& pool, const graph::WeightTable& weights, const KvView& kv,
                     Residency* residency, std::vector<Home> kv_home, HybridOptions options)
    : pool_(pool),
      weights_(weights),
      kv_(kv),
      res_(residency),
      dev_(residency ? &residency->device() : nullptr),
      kv_home_(std::move(kv_home)),
      opt_(std::move(options)),
      cpu_(pool, residency ? residency->cpu_weights() : weights, kv) {
  if (!dev_) return;
  if (kv_home_.size() != static_cast<size_t>(kv_.n_layer()))
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("placement names the KV cache of {} layers but the model has {}",
                            kv_home_.size(), kv_.n_layer()));
  caps_ = capabilities(dev_, res_, weights_.size());
  if (ExpertSlots* xs = res_ ? res_->expert_slots() : nullptr)
    for (int32_t l = 0; l < xs->n_layers(); ++l)
      cpu_.bind_expert_table(xs->layer(l).gate, xs->cpu_binding(l));
  handoff_ = opt_.handoff == Handoff::automatic
                 ? (dev_->supports_flags() ? Handoff::flags : Handoff::callback)
                 : opt_.handoff;
  if (handoff_ == Handoff::flags && !dev_->supports_flags())
    throw Error(ErrorCategory::unsupported,
                fmt::format("{} cannot wait on flags in host memory; use the callback hand-off",
                            dev_->name()));
  if (kv_.n_seq > 1 && !dev_->info().multi_seq)
    for (size_t l = 0; l < kv_home_.size(); ++l)
      if (kv_home_[l] == Home::gpu)
        throw Error(ErrorCategory::unsupported,
                    fmt::format("{} runs the attention of one sequence per step, and the KV cache "
                                "of layer {} is there: several sequences need their attention on "
                                "the CPU (or one sequence)",
                                dev_->name(), l));
  try {
    // A step holds at most n_seq * n_ctx tokens (every sequence's whole context).
    const size_t tb = static_cast<size_t>(kv_.n_rows()) * 4;
    tokens_host_ = static_cast<int32_t*>(dev_->alloc_host(tb, "token ids"));
    positions_host_ = static_cast<int32_t*>(dev_->alloc_host(tb, "positions"));
    seqs_host_ = static_cast<int32_t*>(dev_->alloc_host(tb, "sequence ids"));
    tokens_dev_ = static_cast<int32_t*>(dev_->alloc(tb, "token ids"));
    positions_dev_ = static_cast<int32_t*>(dev_->alloc(tb, "positions"));
    seqs_dev_ = static_cast<int32_t*>(dev_->alloc(tb, "sequence ids"));
  } catch (...) {
    release();
    throw;
  }
}

Scheduler::~Scheduler() { release(); }

void Scheduler::release() {
  if (!dev_) return;
  try {
    dev_->synchronize();
  } catch (...) {
  }
  for (auto& st : steps_) free_step(*st);
  steps_.clear();
  for (const auto& [bytes, p] : spare_host_) dev_->dealloc_host(p);
  spare_host_.clear();
  spare_host_bytes_ = 0;
  if (tokens_host_) dev_->dealloc_host(tokens_host_), tokens_host_ = nullptr;
  if (positions_host_) dev_->dealloc_host(positions_host_), positions_host_ = nullptr;
  if (tokens_dev_) dev_->dealloc(tokens_dev_), tokens_dev_ = nullptr;
  if (positions_dev_) dev_->dealloc(positions_dev_), positions_dev_ = nullptr;
  if (seqs_host_) dev_->dealloc_host(seqs_host_), seqs_host_ = nullptr;
  if (seqs_dev_) dev_->dealloc(seqs_dev_), seqs_dev_ = nullptr;
  if (forced_host_) dev_->dealloc_host(forced_host_), forced_host_ = nullptr;
  if (forced_dev_) dev_->dealloc(forced_dev_), forced_dev_ = nullptr;
  for (SplitLayer& L : split_) {
    if (L.host_table) dev_->dealloc_host(L.host_table), L.host_table = nullptr;
    if (L.dev_table) dev_->dealloc(L.dev_table), L.dev_table = nullptr;
  }
}

void Scheduler::set_routing(int32_t n_route, int32_t k, RoutingHooks hooks) {
  if (stepped_)
    throw Error(ErrorCategory::invalid_argument, "routing hooks must be set before the first step");
  if (n_route < 1 || k < 1)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("routing hooks for {} routes of {} experts", n_route, k));
  const size_t ids =
      static_cast<size_t>(kv_.n_rows()) * static_cast<size_t>(n_route) * static_cast<size_t>(k);
  if (dev_) {
    if (forced_host_) dev_->dealloc_host(forced_host_), forced_host_ = nullptr;
    if (forced_dev_) dev_->dealloc(forced_dev_), forced_dev_ = nullptr;
    if (hooks.force) {
      forced_host_ = static_cast<int32_t*>(dev_->alloc_host(ids * 4, "forced routes"));
      forced_dev_ = static_cast<int32_t*>(dev_->alloc(ids * 4, "forced routes"));
    }
  } else if (hooks.force) {
    forced_cpu_.assign(ids, 0);
  }
  routing_ = std::move(hooks);
  n_route_ = n_route;
  route_k_ = k;
}

void Scheduler::route_before(const graph::Graph& g) {
  stepped_ = true;
  if (!routing_.force && !routing_.record) return;
  int32_t n = 0;
  for (const Op& op : g.ops) n += op.kind == OpKind::moe_route;
  if (n != n_route_)
    throw Error(
        ErrorCategory::invalid_argument,
        fmt::format("the routing hooks are for {} MoE layers; the step has {}", n_route_, n));
  if (!routing_.force) return;
  int32_t* ids = dev_ ? forced_host_ : forced_cpu_.data();
  routing_.force(g, ids);
  cpu_.set_forced_routes(ids, g.n_tokens);
}

void Scheduler::route_after(const graph::Graph& g, const Step* st) {
  if (!routing_.record) return;
  route_ptrs_.clear();
  route_held_.resize(static_cast<size_t>(n_route_));
  size_t r = 0;
  for (size_t i = 0; i < g.ops.size(); ++i) {
    const Op& op = g.ops[i];
    if (op.kind != OpKind::moe_route) continue;
    if (!st)
      route_ptrs_.push_back(cpu_.value(g, op.output).data());
    else if (st->s.op_side[i] == Side::device)
      route_ptrs_.push_back(value_to_host(*st, op.output, route_held_[r]));
    else
      route_ptrs_.push_back(st->host_val[static_cast<size_t>(op.output)]);
    ++r;
  }
  routing_.record(g, route_ptrs_);
}

const float* Scheduler::value_to_host(const Step& st, graph::ValueId v, std::vector<float>& out) {
  const graph::ValueInfo& vi = st.s.g.values[static_cast<size_t>(v)];
  out.resize(static_cast<size_t>(vi.rows * vi.cols));
  // The step's streams are done; kSync copies to any host memory.
  dev_->copy(kSync, out.data(), st.b.value[static_cast<size_t>(v)], out.size() * 4);
  return out.data();
}

void Scheduler::free_step(Step& st, bool recycle) {
  if (st.arena) dev_->dealloc(st.arena), st.arena = nullptr;
  if (st.ws) dev_->dealloc(st.ws), st.ws = nullptr;
  if (st.b.selected_dev) dev_->dealloc(st.b.selected_dev), st.b.selected_dev = nullptr;
  for (uint8_t*& m : st.masks)
    if (m) dev_->dealloc(m), m = nullptr;
  for (size_t i = 0; i < st.pinned.size(); ++i) {
    if (recycle && opt_.step_host_bytes > 0 && i < st.pinned_size.size()) {
      spare_host_.emplace(st.pinned_size[i], st.pinned[i]);
      spare_host_bytes_ += st.pinned_size[i];
    } else {
      dev_->dealloc_host(st.pinned[i]);
    }
  }
  st.pinned.clear();
  st.pinned_size.clear();
  st.host_arena.clear();
  st.host_arena.shrink_to_fit();
}

void* Scheduler::take_host(size_t bytes, const char* name, size_t* got) {
  auto it = spare_host_.lower_bound(bytes);
  if (it != spare_host_.end() && it->first <= 2 * bytes) {
    void* p = it->second;
    *got = it->first;
    spare_host_bytes_ -= it->first;
    spare_host_.erase(it);
    return p;
  }
  void* p = dev_->alloc_host(bytes, name);
  ++host_allocs_;
  *got = bytes;
  return p;
}

int64_t Scheduler::warm_workers_us() const {
  if (opt_.warm_workers_us != kAutoWarmWorkersUs) return opt_.warm_workers_us;
  return !dev_ || dev_->computes_on_host() || !opt_.graphs || profiling_ ? 0 : kDecodeWarmWorkersUs;
}

size_t Scheduler::kept_host_bytes() const {
  size_t n = 0;
  if (dev_)
    for (const auto& st : steps_) {
      n += st->host_arena.size() * sizeof(float);
      for (size_t b : st->pinned_size) n += b;
    }
  return n;
}

size_t Scheduler::host_buffer_bytes() const { return kept_host_bytes() + spare_host_bytes_; }

size_t Scheduler::device_scratch_bytes() const {
  size_t n = 0;
  for (const auto& st : steps_) n += st->m.arena_bytes + st->m.ws_bytes;
  return n;
}

Scheduler::Step& Scheduler::step_for(const graph::Graph& g, bool select) {
  const int64_t out_rows = g.values.at(static_cast<size_t>(g.output)).rows;
  ++use_clock_;
  for (auto& st : steps_)
    if (st->n_tokens == g.n_tokens && st->n_decode == g.n_decode && st->out_rows == out_rows &&
        st->n_ops == g.ops.size() && st->select == select && st->profile == profiling_) {
      st->last_use = use_clock_;
      return *st;
    }
  // Keep a few shapes: each holds device memory (its arena, workspace, page-locked buffers),
  // and prompts of many lengths would otherwise grow it without bound. Steps with a captured
  // graph (decode: one token) stay; the least recently used of the others goes.
  const auto evict_one = [this] {
    auto victim = steps_.end();
    for (auto it = steps_.begin(); it != steps_.end(); ++it)
      if ((*it)->graph < 0 && (victim == steps_.end() || (*it)->last_use < (*victim)->last_use))
        victim = it;
    if (victim == steps_.end()) return false;
    if (dev_) {
      dev_->synchronize();
      free_step(**victim, /*recycle=*/true);
    }
    steps_.erase(victim);
    return true;
  };
  constexpr size_t kMaxSteps = 8;
  while (steps_.size() >= kMaxSteps && evict_one()) {
  }
  auto owned = std::make_unique<Step>();
  Step& st = *owned;
  st.n_tokens = g.n_tokens;
  st.n_decode = g.n_decode;
  st.out_rows = out_rows;
  st.n_ops = g.ops.size();
  st.select = select;
  st.profile = profiling_;
  st.last_use = use_clock_;
  const ScheduleOptions so{.handoff = handoff_,
                           .stream_experts_min_tokens = opt_.stream_experts_min_tokens,
                           .host_expert_share = opt_.host_expert_share,
                           .stream_split = opt_.stream_split,
                           .select = select,
                           .profile = profiling_};
  st.s = make_schedule(g, weights_, res_ ? res_->weight_home() : std::vector<Home>{}, kv_home_,
                       caps_, so, dev_, kv_.n_ctx);
  if (!dev_) {
    steps_.push_back(std::move(owned));
    return *steps_.back();
  }
  const Schedule& s = st.s;
  const graph::Graph& sg = s.g;
  const size_t n_val = sg.values.size(), n_ops = sg.ops.size();
  std::vector<graph::ValueId> keep;  // routes read after the step
  if (routing_.record)
    for (const Op& op : sg.ops)
      if (op.kind == OpKind::moe_route) keep.push_back(op.output);
  // Prompt-time seating: a streamed layer with expert slots tells them its routing.
  const ExpertSlots* xs = res_ ? res_->expert_slots() : nullptr;
  for (const Call& c : s.calls)
    if (xs && c.streamed && !c.ops.empty()) {
      const Op& op = sg.ops[static_cast<size_t>(c.ops[0])];
      if (xs->layer_of(op.moe.gate) >= 0) {
        keep.push_back(op.inputs[1]);
        st.seat.emplace_back(xs->layer_of(op.moe.gate), op.inputs[1]);
      }
    }
  st.m = plan_memory(s, weights_, keep);
  const MemoryPlan& m = st.m;
  // The kept steps' host buffers within HybridOptions::step_host_bytes (what a board's plan
  // counted): the least recently used others go first; a step larger alone still runs.
  // Evicted steps leave their page-locked buffers as spares this one takes; the spares it does
  // not take are freed once it holds its own (below).
  if (opt_.step_host_bytes > 0) {
    while (kept_host_bytes() + m.host_bytes > opt_.step_host_bytes && evict_one()) {
    }
    if (kept_host_bytes() + m.host_bytes > opt_.step_host_bytes && !host_budget_warned_) {
      host_budget_warned_ = true;
      log::warn(
          "a step of {} tokens ({} output rows) holds {:.1f} MiB of host buffers beside the "
          "{:.1f} MiB the kept steps hold: more than the {:.1f} MiB the plan counted in the pool",
          g.n_tokens, out_rows, static_cast<double>(m.host_bytes) / (1 << 20),
          static_cast<double>(kept_host_bytes()) / (1 << 20),
          static_cast<double>(opt_.step_host_bytes) / (1 << 20));
    }
  }
  StepBindings& b = st.b;
  try {
    if (m.stage_bytes > 0) res_->reserve_stage(m.stage_bytes);
    if (m.arena_bytes > 0) st.arena = dev_->alloc(m.arena_bytes, "activations");
    if (m.ws_bytes > 0) st.ws = dev_->alloc(m.ws_bytes, "kernel workspace");
    b.view = StepView{&st.s.g, &weights_, kv_.n_ctx, s.handoff == Handoff::flags};
    b.weight = res_->device_weights();
    b.value.assign(n_val, nullptr);
    b.host.assign(n_val, nullptr);
    st.host_val.assign(n_val, nullptr);
    st.host_arena.assign(m.host_arena_bytes / sizeof(float), 0.0f);
    for (size_t v = 0; v < n_val; ++v) {
      if (m.on_device[v])
        b.value[v] = reinterpret_cast<float*>(static_cast<uint8_t*>(st.arena) + m.offset[v]);
      if (m.pinned[v]) {
        size_t got = 0;
        void* p = take_host(value_bytes(sg.values[v]), sg.values[v].name.c_str(), &got);
        st.pinned.push_back(p);
        st.pinned_size.push_back(got);
        b.host[v] = static_cast<float*>(p);
        st.host_val[v] = b.host[v];
      } else if (m.host[v]) {
        st.host_val[v] = st.host_arena.data() + m.host_offset[v] / sizeof(float);
      }
    }
    // Values read in place (flag hand-off): device ops read their page-locked buffer.
    for (const CpuSegment& seg : s.segments)
      if (seg.in_place) {
        const auto v = static_cast<size_t>(seg.outputs[0]);
        b.value[v] = b.host[v];
      }
    st.out_host = st.host_val[static_cast<size_t>(sg.output)];
    b.k_cache = kv_.dev_k;
    b.v_cache = kv_.dev_v;
    b.conv_state = kv_.dev_conv;
    b.ssm_state = kv_.dev_ssm;
    b.tokens = tokens_dev_;
    b.positions = positions_dev_;
    b.seqs = kv_.n_seq > 1 ? seqs_dev_ : nullptr;
    b.ws = st.ws;
    b.ws_bytes = m.ws_bytes;
    if (s.select) {
      const size_t bytes =
          sizeof(int32_t) * static_cast<size_t>(sg.values[static_cast<size_t>(sg.output)].rows);
      b.selected_dev = static_cast<int32_t*>(dev_->alloc(bytes, "the selected tokens"));
      b.selected_host = static_cast<int32_t*>(dev_->alloc_host(bytes, "the selected tokens"));
      st.pinned.push_back(b.selected_host);
      st.pinned_size.push_back(bytes);
    }
    if (s.handoff == Handoff::flags && !s.segments.empty()) {
      b.flags = static_cast<uint32_t*>(dev_->alloc_host(s.segments.size() * 8, "hand-off flags"));
      st.pinned.push_back(b.flags);
      st.pinned_size.push_back(s.segments.size() * 8);
    }
    st.seg_runs.resize(s.segments.size());
    b.segment_arg.resize(s.segments.size());
    for (size_t k = 0; k < s.segments.size(); ++k) {
      st.seg_runs[k] = SegmentRun{this, &st, k};
      b.segment_arg[k] = &st.seg_runs[k];
    }
    b.run_segment = &Scheduler::run_segment;
    // Expert masks of the device's moe_experts ops, and the weights streamed or shared ops
    // read instead of a device copy.
    b.mask.assign(n_ops, nullptr);
    b.slot_table.assign(n_ops, nullptr);
    b.forced_route.assign(n_ops, nullptr);
    if (forced_dev_) {
      int64_t r = 0;
      for (size_t i = 0; i < n_ops; ++i)
        if (sg.ops[i].kind == OpKind::moe_route)
          b.forced_route[i] = forced_dev_ + r++ * sg.n_tokens * route_k_;
    }
    st.masks.assign(n_ops, nullptr);
    b.moe_w.assign(n_ops, {nullptr, nullptr, nullptr});
    int streamed = 0;
    for (const Call& c : s.calls) {
      if (!c.streamed && !c.host_w) continue;
      const graph::MoeParams& p = sg.ops[static_cast<size_t>(c.ops[0])].moe;
      auto& w = b.moe_w[static_cast<size_t>(c.ops[0])];
      if (c.streamed) {
        uint8_t* base = static_cast<uint8_t*>(res_->stage(streamed++ % 2));
        w = {base, base + weights_[p.gate].n_bytes,
             base + weights_[p.gate].n_bytes + weights_[p.up].n_bytes};
      } else {
        w = {res_->pinned(p.gate), res_->pinned(p.up), res_->pinned(p.down)};
      }
    }
    // Split streamed layers: the CPU part reads the step table's host side, the device part
    // its device copy (both written before each step: split_before).
    st.split_of.assign(n_ops, -1);
    st.seg_seconds.assign(s.segments.size(), 0.0);
    for (size_t i = 0; i < n_ops; ++i) {
      if (!s.stream_split[i]) continue;
      const Op& op = sg.ops[i];
      int32_t li = -1;
      for (size_t l = 0; l < split_.size(); ++l)
        if (split_[l].gate == op.moe.gate) li = static_cast<int32_t>(l);
      if (li < 0) {
        SplitLayer L;
        L.gate = op.moe.gate;
        L.up = op.moe.up;
        L.down = op.moe.down;
        L.n_expert = op.moe.n_expert;
        L.k = op.moe.n_expert_used;
        const size_t tb = static_cast<size_t>(L.n_expert) * 4;
        L.host_table = static_cast<int32_t*>(dev_->alloc_host(tb, "stream split table"));
        try {
          L.dev_table = static_cast<int32_t*>(dev_->alloc(tb, "stream split table"));
        } catch (...) {
          dev_->dealloc_host(L.host_table);
          throw;
        }
        for (int32_t e = 0; e < L.n_expert; ++e) L.host_table[e] = e;
        L.counts.assign(static_cast<size_t>(L.n_expert), 0.0);
        const auto n_e = static_cast<double>(L.n_expert);
        double bytes = 0, elems = 0;
        for (graph::WeightId w : {L.gate, L.up, L.down}) {
          bytes += static_cast<double>(weights_[w].n_bytes);
          elems += static_cast<double>(weights_[w].n_elements());
        }
        L.cost = ExpertCost{.bytes = bytes / n_e, .flops_per_token = 2.0 * elems / n_e};
        split_.push_back(std::move(L));
        li = static_cast<int32_t>(split_.size() - 1);
      }
      st.split_of[i] = li;
      if (std::find(st.split_layers.begin(), st.split_layers.end(), li) == st.split_layers.end())
        st.split_layers.push_back(li);
      SplitLayer& L = split_[static_cast<size_t>(li)];
      if (s.op_side[i] == Side::device)
        b.slot_table[i] = L.dev_table;
      else
        cpu_.bind_expert_table(op.moe.gate, CpuExecutor::ExpertTable{.table = L.host_table,
                                                                     .n_expert = L.n_expert,
                                                                     .route_log = &L.log,
                                                                     .calls = nullptr,
                                                                     .device_calls = nullptr});
    }
    for (size_t i = 0; i < n_ops; ++i) {
      const Op& op = sg.ops[i];
      if (op.kind != OpKind::moe_experts || s.op_side[i] != Side::device || st.split_of[i] >= 0)
        continue;
      if (op.moe.set == graph::ExpertSet::resident) {
        // The layer's slots and its table (read by the kernels when they run).
        const ExpertSlots* xs = res_->expert_slots();
        const int32_t l = xs ? xs->layer_of(op.moe.gate) : -1;
        if (l < 0)
          throw Error(
              ErrorCategory::internal,
              fmt::format("{}: the layer has no expert slots on {}", op.name, dev_->name()));
        b.moe_w[i] = xs->slot_bases(l);
        b.slot_table[i] = xs->device_table(l);
        continue;
      }
      if (!op.moe.static_experts())
        throw Error(ErrorCategory::internal,
                    fmt::format("{}: the device cannot compute the {} experts", op.name,
                                graph::expert_set_name(op.moe.set)));
      std::vector<uint8_t> mk(static_cast<size_t>(op.moe.n_expert));
      for (int32_t e = 0; e < op.moe.n_expert; ++e)
        mk[static_cast<size_t>(e)] = op.moe.has_expert(e);
      st.masks[i] = static_cast<uint8_t*>(dev_->alloc(mk.size(), "expert mask"));
      dev_->upload(st.masks[i], mk.data(), mk.size());
      b.mask[i] = st.masks[i];
    }
  } catch (...) {
    free_step(st);
    throw;
  }
  steps_.push_back(std::move(owned));
  // The spares this step did not take go, largest first, while the kept steps and they hold more
  // than the cap.
  while (!spare_host_.empty() && kept_host_bytes() + spare_host_bytes_ > opt_.step_host_bytes) {
    auto it = std::prev(spare_host_.end());
    dev_->dealloc_host(it->second);
    spare_host_bytes_ -= it->first;
    spare_host_.erase(it);
  }
  return *steps_.back();
}

const Schedule& Scheduler::schedule(const graph::Graph& g, bool select) {
  return step_for(g, select).s;
}

Home Scheduler::op_home(const graph::Graph& g, size_t i) {
  return schedule(g).model_op_side(i) == Side::device ? Home::gpu : Home::cpu;
}

void Scheduler::run_segment(void* arg) {
  auto* r = static_cast<SegmentRun*>(arg);
  Step& st = *r->st;
  Scheduler& sch = *r->sch;
  if (st.error || sch.skip_cpu_) return;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    const auto n = static_cast<size_t>(st.n_tokens);
    sch.cpu_.run_subset(st.s.g, st.s.segments[r->index].ops,
                        std::span<const int32_t>(sch.tokens_host_, n),
                        std::span<const int32_t>(sch.positions_host_, n),
                        sch.kv_.n_seq > 1 ? std::span<const int32_t>(sch.seqs_host_, n)
                                          : std::span<const int32_t>());
  } catch (...) {
    st.error = std::current_exception();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  st.cpu_seconds += secs;
  if (r->index < st.seg_seconds.size()) st.seg_seconds[r->index] = secs;
}

void Scheduler::enqueue_step(Step& st) {
  const Schedule& s = st.s;
  const size_t tb = static_cast<size_t>(st.n_tokens) * 4;
  dev_->copy(kMain, tokens_dev_, tokens_host_, tb);
  dev_->copy(kMain, positions_dev_, positions_host_, tb);
  if (kv_.n_seq > 1) dev_->copy(kMain, seqs_dev_, seqs_host_, tb);
  if (forced_dev_)
    dev_->copy(kMain, forced_dev_, forced_host_,
               static_cast<size_t>(st.n_tokens) * static_cast<size_t>(n_route_) *
                   static_cast<size_t>(route_k_) * 4);
  // Streamed experts: op j of the list copies into stage j % 2 on the copy stream once op j - 2
  // has finished with it; the main stream waits for op j's copy only.
  std::vector<size_t> streamed;
  for (size_t k = 0; k < s.calls.size(); ++k)
    if (s.calls[k].streamed) streamed.push_back(k);
  std::vector<int> copied(streamed.size(), -1);
  // The split layers' tables, before any of the step's kernels reads them.
  for (int32_t li : st.split_layers) {
    const SplitLayer& L = split_[static_cast<size_t>(li)];
    dev_->copy(kMain, L.dev_table, L.host_table, static_cast<size_t>(L.n_expert) * 4);
  }
  const auto start_copy = [&](size_t j, int after_main) {
    if (after_main >= 0) dev_->wait_event(kCopy, after_main);
    const auto op = static_cast<size_t>(s.calls[streamed[j]].ops[0]);
    const graph::MoeParams& p = s.g.ops[op].moe;
    const int32_t li = op < st.split_of.size() ? st.split_of[op] : -1;
    if (li >= 0) {
      const SplitLayer& L = split_[static_cast<size_t>(li)];
      split_pending_.bytes_streamed += static_cast<int64_t>(res_->stream_in_experts(
          kCopy, p.gate, p.up, p.down, static_cast<int>(j % 2),
          std::span<const int32_t>(L.host_table, static_cast<size_t>(L.n_expert))));
    } else {
      res_->stream_in(kCopy, p.gate, p.up, p.down, static_cast<int>(j % 2));
    }
    copied[j] = dev_->record(kCopy);
  };
  n_streamed_ += static_cast<int64_t>(streamed.size());
  bool stream_started = streamed.empty();
  size_t next_stream = 0;
  for (const Call& c : s.calls) {
    if (!stream_started && c.kind != CallKind::upload) {
      dev_->wait(kCopy, kMain);
      for (size_t j = 0; j < std::min<size_t>(2, streamed.size()); ++j) start_copy(j, -1);
      stream_started = true;
    }
    if (c.streamed) {
      const size_t j = next_stream++;
      dev_->wait_event(kMain, copied[j]);
      // The stage buffer as it is now (Residency may have grown it for a later shape).
      const graph::MoeParams& p = s.g.ops[static_cast<size_t>(c.ops[0])].moe;
      uint8_t* base = static_cast<uint8_t*>(res_->stage(static_cast<int>(j % 2)));
      st.b.moe_w[static_cast<size_t>(c.ops[0])] = {
          base, base + weights_[p.gate].n_bytes,
          base + weights_[p.gate].n_bytes + weights_[p.up].n_bytes};
      dev_->enqueue(c, st.b);
      const int done = dev_->record(kMain);
      if (j + 2 < streamed.size()) start_copy(j + 2, done);
      if (j + 1 == streamed.size()) dev_->wait(kMain, kCopy);
      continue;
    }
    if (c.host_w) ++n_host_w_;
    if (profiling_ && c.kind == CallKind::op) {
      const int a = dev_->record(kMain);
      dev_->enqueue(c, st.b);
      marks_.push_back(
          {profile_entry(s.g.ops[static_cast<size_t>(c.ops[0])]), {a, dev_->record(kMain)}});
    } else {
      dev_->enqueue(c, st.b);
    }
  }
}

std::span<const float> Scheduler::run(const graph::Graph& g, std::span<const int32_t> tokens,
                                      std::span<const int32_t> positions,
                                      std::span<const int32_t> seqs) {
  if (!dev_) {
    const auto t0 = std::chrono::steady_clock::now();
    route_before(g);
    std::span<const float> out = cpu_.run(g, tokens, positions, seqs);
    last_step_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    route_after(g, nullptr);
    return out;
  }
  Step& st = step(g, tokens, positions, seqs, false);
  const graph::ValueInfo& oi = st.s.g.values[static_cast<size_t>(st.s.g.output)];
  return {st.out_host, static_cast<size_t>(oi.rows * oi.cols)};
}

int32_t Scheduler::run_argmax(const graph::Graph& g, std::span<const int32_t> tokens,
                              std::span<const int32_t> positions, std::span<const int32_t> seqs) {
  return run_select(g, tokens, positions, seqs).back();
}

std::span<const int32_t> Scheduler::run_select(const graph::Graph& g,
                                               std::span<const int32_t> tokens,
                                               std::span<const int32_t> positions,
                                               std::span<const int32_t> seqs) {
  const float* logits = nullptr;
  const graph::ValueInfo& oi = g.values[static_cast<size_t>(g.output)];
  const auto rows = static_cast<size_t>(oi.rows);
  if (!dev_) {
    logits = run(g, tokens, positions, seqs).data();
  } else {
    Step& st = step(g, tokens, positions, seqs, true);
    if (st.b.selected_host) return {st.b.selected_host, rows};
    logits = st.out_host;  // the logits were made on the CPU: select there
  }
  selected_.resize(rows);
  for (size_t r = 0; r < rows; ++r) {
    const float* l = logits + r * static_cast<size_t>(oi.cols);
    int64_t best = 0;
    for (int64_t i = 1; i < oi.cols; ++i)
      if (l[i] > l[best] || (std::isnan(l[best]) && !std::isnan(l[i]))) best = i;
    selected_[r] = static_cast<int32_t>(best);
  }
  return selected_;
}

Scheduler::Step& Scheduler::step(const graph::Graph& g, std::span<const int32_t> tokens,
                                 std::span<const int32_t> positions, std::span<const int32_t> seqs,
                                 bool select) {
  cpu_.check_ubatch(g, tokens, positions, seqs);
  for (const Op& op : g.ops)
    if (op.kind == OpKind::embed)
      for (int32_t id : tokens)
        if (id < 0 || id >= weights_[op.weight].ne[1])
          throw Error(ErrorCategory::invalid_argument,
                      fmt::format("token id {} is outside the vocabulary of {} tokens", id,
                                  weights_[op.weight].ne[1]));
  const auto t0 = std::chrono::steady_clock::now();
  Step& st = step_for(g, select);
  // Expert slots: commit landed copies, start swaps and queue the table update, before any of
  // this step's work (CPU segments before the step included) reads the tables.
  if (ExpertSlots* xs = res_->expert_slots()) xs->between_steps();
  std::copy(tokens.begin(), tokens.end(), tokens_host_);
  std::copy(positions.begin(), positions.end(), positions_host_);
  if (kv_.n_seq > 1) {
    if (seqs.empty())
      std::fill_n(seqs_host_, tokens.size(), 0);
    else
      std::copy(seqs.begin(), seqs.end(), seqs_host_);
  }
  st.error = nullptr;
  st.cpu_seconds = 0;
  std::fill(st.seg_seconds.begin(), st.seg_seconds.end(), 0.0);
  if (!st.split_layers.empty()) split_before(st);
  route_before(st.s.g);
  cpu_.begin_external(st.s.g, st.host_val);  // every segment of this step works on these buffers
  for (SegmentRun& r : st.seg_runs)
    if (st.s.segments[r.index].fork_after < 0) run_segment(&r);
  if (st.error) std::rethrow_exception(st.error);
  uint32_t* flags = st.b.flags;
  if (flags)
    for (size_t i = 0; i < 2 * st.s.segments.size(); ++i)
      std::atomic_ref<uint32_t>(flags[i]).store(0, std::memory_order_relaxed);
  marks_.clear();
  // Decode steps (every token a decode token, of distinct sequences) of up to kMaxGraphTokens
  // tokens are captured once per token count and replayed: token ids, positions and sequence ids
  // travel through the fixed buffers. Steps that stream experts through the stage buffers run
  // eagerly.
  constexpr int32_t kMaxGraphTokens = 64;
  bool replay = st.s.g.decode_rows(st.n_tokens) == st.n_tokens && st.n_tokens <= kMaxGraphTokens &&
                opt_.graphs && !profiling_;
  for (const Call& c : st.s.calls) replay = replay && !c.streamed;
  if (flags && !replay) {
    // Eager steps enqueue call by call. The device stops at the first segment's wait, and once
    // its launch queue is full (about a thousand operations: a few dozen layers) the next enqueue
    // blocks the host, which then never reaches the flags it must serve. So a second thread
    // serves them while this one enqueues.
    serve_abort_.store(false, std::memory_order_relaxed);
    std::exception_ptr serve_error;
    std::thread server([&] {
      try {
        serve_segments(st, std::max<int64_t>(opt_.warm_workers_us, 0));
      } catch (...) {
        serve_error = std::current_exception();
      }
    });
    try {
      enqueue_step(st);
    } catch (...) {
      // Release the device from every wait and stop the server before unwinding.
      serve_abort_.store(true, std::memory_order_release);
      release_flags(st, 0);
      server.join();
      try {
        dev_->synchronize();
      } catch (...) {
      }
      throw;
    }
    server.join();
    if (serve_error) std::rethrow_exception(serve_error);
  } else if (replay) {
    if (st.graph < 0) st.graph = dev_->capture([&] { enqueue_step(st); });
    dev_->replay(st.graph);
    if (flags) serve_segments(st, warm_workers_us());
  } else {
    enqueue_step(st);
  }
  // The step's streams only: copies into expert slots on kCopy may go on into the next step.
  // A step without CPU segments polls (a sleeping thread's wake-up would add to the step).
  for (const int stream : {kMain, kAux}) {
    if (st.s.segments.empty())
      dev_->synchronize_polling(stream);
    else
      dev_->synchronize(stream);
  }
  for (const auto& [entry, ab] : marks_) {
    auto& t = gpu_prof_[entry];
    t.seconds += dev_->elapsed_ms(ab.first, ab.second) / 1e3;
    ++t.calls;
  }
  last_step_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  last_cpu_s_ = st.cpu_seconds;
  if (st.error) std::rethrow_exception(st.error);
  if (!st.split_layers.empty()) {
    // The step succeeded: its split counts join the totals.
    split_stats_.layer_steps += split_pending_.layer_steps;
    split_stats_.experts_streamed += split_pending_.experts_streamed;
    split_stats_.experts_cpu += split_pending_.experts_cpu;
    split_stats_.bytes_whole += split_pending_.bytes_whole;
    split_stats_.bytes_streamed += split_pending_.bytes_streamed;
    split_pending_ = {};
    split_after(st);
  }
  if (!st.seat.empty() && !skip_cpu_) {
    // The streamed layers' routes, for their expert slots' next boundary.
    ExpertSlots* xs = res_->expert_slots();
    for (const auto& [layer, v] : st.seat)
      xs->observe_prefill(layer, value_to_host(st, v, seat_buf_),
                          st.s.g.values[static_cast<size_t>(v)].rows);
  }
  route_after(st.s.g, &st);
  return st;
}

void Scheduler::measure_stream_rates(const Step& st) {
  rates_measured_ = true;
  rates_ = opt_.stream_rates;
  if (rates_.cpu_gflops <= 0) rates_.cpu_gflops = 25.0 * static_cast<double>(pool_.n_threads());
  const SplitLayer& first = split_[static_cast<size_t>(st.split_layers.front())];
  if (rates_.pcie_gbps <= 0) {
    // A copy of the first split layer's gate tensor into stage buffer 0, timed twice; the second
    // counts (the first pays first-touch costs).
    const void* src = res_->pinned(first.gate);
    void* dst = res_->stage(0);
    const size_t n = weights_[first.gate].n_bytes;
    double ms = 0;
    if (src && dst && n > 0)
      for (int rep = 0; rep < 2; ++rep) {
        const int a = dev_->record(kCopy);
        dev_->copy(kCopy, dst, src, n);
        const int b = dev_->record(kCopy);
        dev_->synchronize(kCopy);
        ms = dev_->elapsed_ms(a, b);
      }
    rates_.pcie_gbps = ms > 0 ? static_cast<double>(n) / (ms * 1e6) : 0.0;
  }
  if (rates_.dram_gbps <= 0) {
    // The workers read the split layers' pinned experts (up to 1 GiB) in pieces of up to 64 KiB;
    // a smaller model's are read again until 64 MiB have been read (so the time is not only the
    // parallel region's start; such a model's experts then come from the caches, as they do in
    // its steps).
    std::vector<std::pair<const uint64_t*, size_t>> chunks;  // (words, count)
    size_t once = 0;
    constexpr size_t kMax = size_t{1} << 30, kMin = size_t{64} << 20, kChunk = size_t{64} << 10;
    for (const SplitLayer& L : split_)
      for (graph::WeightId w : {L.gate, L.up, L.down}) {
        const auto* p = static_cast<const uint64_t*>(res_->pinned(w));
        const size_t words = std::min(weights_[w].n_bytes, kMax - once) / 8;
        if (!p) continue;
        for (size_t o = 0; o < words; o += kChunk / 8)
          chunks.emplace_back(p + o, std::min(kChunk / 8, words - o));
        once += words * 8;
      }
    const size_t passes = once == 0 ? 0 : std::max<size_t>(1, (kMin + once - 1) / once);
    if (passes > 0) {
      std::atomic<uint64_t> sink{0};
      const auto n = static_cast<int64_t>(chunks.size());
      const auto t0 = std::chrono::steady_clock::now();
      pool_.parallel_for(n * static_cast<int64_t>(passes), 1, [&](int64_t a, int64_t b) {
        uint64_t x = 0;
        for (int64_t c = a; c < b; ++c) {
          const auto& [p, words] = chunks[static_cast<size_t>(c % n)];
          for (size_t i = 0; i < words; ++i) x ^= p[i];
        }
        sink.fetch_xor(x, std::memory_order_relaxed);
      });
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      rates_.dram_gbps = secs > 0 ? static_cast<double>(once * passes) / secs / 1e9 : 0.0;
    }
  }
  if (!(rates_.pcie_gbps > 0) || !(rates_.dram_gbps > 0))
    log::warn(
        "--stream-split: the {} rate could not be measured; every expert streams (give it: "
        "--stream-split pcie=GBPS,dram=GBPS)",
        !(rates_.pcie_gbps > 0) ? "PCIe" : "DRAM");
}

void Scheduler::split_before(Step& st) {
  if (!rates_measured_) measure_stream_rates(st);
  split_pending_ = {};  // a step that threw left its counts here; they are dropped
  for (int32_t li : st.split_layers) {
    SplitLayer& L = split_[static_cast<size_t>(li)];
    L.log.clear();
    const std::vector<double> t = expected_tokens(L.counts, st.n_tokens, L.k);
    const std::vector<uint8_t> on_cpu = choose_cpu_experts(t, L.cost, rates_, cpu_scale_);
    int32_t slot = 0;
    for (int32_t e = 0; e < L.n_expert; ++e)
      L.host_table[e] = on_cpu[static_cast<size_t>(e)] ? -1 : slot++;
    ++split_pending_.layer_steps;
    split_pending_.experts_streamed += slot;
    split_pending_.experts_cpu += L.n_expert - slot;
    split_pending_.bytes_whole += static_cast<int64_t>(L.cost.bytes * L.n_expert);
  }
}

void Scheduler::split_after(Step& st) {
  if (skip_cpu_) return;
  // Counts decay with a half-life of 4096 routed tokens.
  const double decay = std::exp2(-static_cast<double>(st.n_tokens) / 4096.0);
  double predicted = 0;  // the CPU parts' model at scale 1, with this step's routing
  std::vector<double> actual;
  for (int32_t li : st.split_layers) {
    SplitLayer& L = split_[static_cast<size_t>(li)];
    actual.assign(static_cast<size_t>(L.n_expert), 0.0);
    for (uint16_t e : L.log)
      if (e < L.n_expert) actual[e] += 1.0;
    split_stats_.calls += static_cast<int64_t>(L.log.size());
    for (int32_t e = 0; e < L.n_expert; ++e) {
      const double t = actual[static_cast<size_t>(e)];
      if (L.host_table[e] < 0 && t > 0) {
        split_stats_.cpu_calls += static_cast<int64_t>(t);
        predicted += L.cost.bytes / (rates_.dram_gbps * 1e9) +
                     t * L.cost.flops_per_token / (rates_.cpu_gflops * 1e9);
      }
      double& c = L.counts[static_cast<size_t>(e)];
      c = c * decay + t;
    }
    L.log.clear();
  }
  // Unless the CPU's rate was given: scale the CPU side's model by what its parts took.
  if (opt_.stream_rates.cpu_gflops > 0 || !(predicted > 1e-4) || !std::isfinite(predicted)) return;
  double secs = 0;
  for (size_t k = 0; k < st.s.segments.size(); ++k) {
    bool split_only = true;
    for (int32_t i : st.s.segments[k].ops)
      split_only = split_only && st.split_of[static_cast<size_t>(i)] >= 0;
    if (split_only) secs += st.seg_seconds[k];
  }
  if (!(secs > 0)) return;
  const double ratio = std::clamp(secs / predicted, 1.0 / 64, 64.0);
  cpu_scale_ = std::clamp(std::sqrt(cpu_scale_ * ratio), 1.0 / 64, 64.0);
}

void Scheduler::serve_segments(Step& st, int64_t warm_us) {
  // The device writes segment i's ready flag once its inputs are on the host, then waits for
  // its done flag; segments become ready in order.
  uint32_t* flags = st.b.flags;
  for (size_t i = 0; i < st.s.segments.size(); ++i) {
    if (st.s.segments[i].fork_after < 0) continue;
    std::atomic_ref<uint32_t> ready(flags[2 * i]);
    if (warm_us > 0 && ready.load(std::memory_order_acquire) == 0) {
      ++n_warm_spins_;
      pool_.spin_until([&] { return ready.load(std::memory_order_acquire) != 0; }, warm_us);
    }
    const auto t0 = std::chrono::steady_clock::now();
    // Spins a few microseconds, then yields each turn: a device whose work runs on host cores
    // (the simulated device) or another process may need this core to produce the flag.
    for (uint64_t spin = 0; ready.load(std::memory_order_acquire) == 0; ++spin) {
      if (spin >= 4096) std::this_thread::yield();
      if ((spin & 0xff) == 0xff) {
        if (serve_abort_.load(std::memory_order_acquire)) return;  // the enqueue failed
        if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(60)) {
          // Never signalled: release every waiting stream so the device can finish, then fail.
          release_flags(st, i);
          dev_->synchronize();
          throw Error(ErrorCategory::internal,
                      fmt::format("{}: CPU segment {} of the step was not signalled in 60 s",
                                  dev_->name(), i));
        }
        std::this_thread::yield();
      }
    }
    run_segment(&st.seg_runs[i]);
    std::atomic_ref<uint32_t>(flags[2 * i + 1]).store(1, std::memory_order_release);
  }
}

void Scheduler::release_flags(Step& st, size_t from) {
  for (size_t j = from; j < st.s.segments.size(); ++j)
    std::atomic_ref<uint32_t>(st.b.flags[2 * j + 1]).store(1, std::memory_order_release);
}

std::string Scheduler::profile_entry(const graph::Op& op) {
  static const bool by_name = [] {
    const char* e = std::getenv("BERTH_PROFILE_BY_NAME");
    return e != nullptr && std::string_view(e) == "1";
  }();
  std::string entry(graph::op_name(op.kind));
  if (!by_name || op.name.empty()) return entry;
  std::string_view n = op.name;
  // "blk.12.attn_qkv" -> "attn_qkv"
  if (n.starts_with("blk.")) {
    const size_t dot = n.find('.', 4);
    if (dot != std::string_view::npos) n.remove_prefix(dot + 1);
  }
  return entry + " " + std::string(n);
}

std::vector<CpuExecutor::OpTime> Scheduler::gpu_profile() const {
  std::vector<CpuExecutor::OpTime> out;
  for (const auto& [entry, t] : gpu_prof_)
    if (t.calls > 0) {
      out.push_back(t);
      out.back().kind = entry;
    }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.seconds > b.seconds; });
  return out;
}

}  // namespace berth
