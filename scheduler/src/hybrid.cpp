#include "berth/scheduler/hybrid.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <thread>

#include "berth/core/error.h"
#include "berth/core/log.h"
#include "berth/cpu_kernels/ops.h"

namespace berth {

using graph::Op;
using graph::OpKind;
using graph::ValueId;
using placement::Home;

namespace {

constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

/// Offsets for buffers with lifetimes [birth, death] (inclusive, in enqueue order) in one arena:
/// buffers whose lifetimes overlap get disjoint ranges; first fit in birth order. Returns the
/// arena size; offsets[i] for sizes[i] > 0.
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

size_t value_bytes(const graph::ValueInfo& v) { return static_cast<size_t>(v.rows * v.cols) * 4; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Step plans

struct Segment {
  HybridExecutor* ex = nullptr;
  HybridExecutor::StepPlan* sp = nullptr;
  std::vector<int32_t> ops;  // graph op indices, ascending
  int32_t ready = -1;        // forks after this GPU op (-1: at the start of the step)
  std::vector<ValueId> d2h;  // GPU-produced inputs copied to the host before the fork
  std::vector<ValueId> h2d;  // outputs that GPU ops read, copied to the device after it
  // Flag hand-off: the one output the device reads is read in place from its pinned buffer by
  // the residual add at StepPlan::host_join (which waits for the done flag itself).
  bool host_join = false;
};

struct HybridExecutor::StepPlan {
  std::vector<bool> streamed;    // per op: CPU-held experts computed on the device (prefill)
  std::vector<int64_t> rope_of;  // per op: the rope fused into this norm (norm_rope), or -1
  std::vector<bool> rope_pair;   // per op: this norm's norm_rope call also takes norm i + 1
  std::vector<bool> seg_after;   // per op: a CPU segment forks after it
  std::vector<bool> host_w;      // per op: device op reading expert weights from pinned host memory
  std::vector<int32_t> host_join;   // per op: the segment whose output this add reads in place
  std::vector<int32_t> orig_index;  // op of the model's graph -> op of g
  int32_t n_tokens = 0;
  int64_t out_rows = 0;
  size_t n_ops = 0;
  graph::Graph g;  // a copy: host callbacks of a captured graph refer to it
  std::vector<Home> op_home, value_home;
  std::vector<float*> dev_val, host_val;
  std::vector<std::vector<float>> host_owned;  // CPU-only values
  std::vector<void*> pinned;                   // host buffers of crossing values (to free)
  std::vector<uint8_t*> masks;                 // per op: device expert mask (moe_experts on GPU)
  std::vector<Segment> segs;
  void* arena = nullptr;
  size_t arena_bytes = 0;
  void* ws = nullptr;
  size_t ws_bytes = 0;
  float* out_host = nullptr;  // pinned copy of a GPU-produced output
  bool select = false;        // run_argmax: the device picks the token (GPU-produced output)
  int32_t* id_dev = nullptr;  // select: the token id, on the device and its pinned copy
  int32_t* id_host = nullptr;
  uint32_t* flags = nullptr;  // Handoff::flags: per segment, ready then done (pinned)
  int graph = -1;             // captured Device graph (decode)
  double cpu_seconds = 0;
  std::exception_ptr error;
};

namespace {

// Op i of sp.g is a device residual add whose result the whole-row norm right after it reads
// (no CPU segment forking between them): the two go as one Device::add_rms_norm call.
bool fuses_add_norm(const HybridExecutor::StepPlan& sp, size_t i) {
  const graph::Graph& g = sp.g;
  const Op& op = g.ops[i];
  if (op.kind != OpKind::add || sp.op_home[i] != Home::gpu || sp.host_w[i] ||
      i + 1 >= g.ops.size() || sp.seg_after[i])
    return false;
  const Op& nm = g.ops[i + 1];
  return sp.op_home[i + 1] == Home::gpu && nm.kind == OpKind::rms_norm &&
         nm.inputs[0] == op.output &&
         (nm.norm_group <= 0 || nm.norm_group == g.values[static_cast<size_t>(op.output)].cols);
}

// The copies of segment s's device-produced inputs into their pinned host buffers.
std::vector<HostCopy> copies_out(const HybridExecutor::StepPlan& sp, const Segment& s) {
  std::vector<HostCopy> out;
  for (ValueId v : s.d2h)
    out.push_back({sp.host_val[static_cast<size_t>(v)], sp.dev_val[static_cast<size_t>(v)],
                   value_bytes(sp.g.values[static_cast<size_t>(v)])});
  return out;
}

}  // namespace

HybridExecutor::HybridExecutor(ThreadPool& pool, const graph::WeightTable& weights, KvCache& cpu_kv,
                               Device& dev, std::vector<Home> weight_home,
                               std::vector<Home> kv_home, HybridOptions options)
    : pool_(pool),
      weights_(weights),
      cpu_kv_(cpu_kv),
      dev_(dev),
      weight_home_(std::move(weight_home)),
      kv_home_(std::move(kv_home)),
      opt_(std::move(options)),
      cpu_weights_(weights),
      cpu_(pool, cpu_weights_, cpu_kv) {
  if (weight_home_.size() != weights_.size())
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("placement names {} tensors but the model has {}", weight_home_.size(),
                            weights_.size()));
  if (kv_home_.size() != static_cast<size_t>(cpu_kv_.n_layer()))
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("placement names the KV cache of {} layers but the model has {}",
                            kv_home_.size(), cpu_kv_.n_layer()));
  handoff_ = opt_.handoff == Handoff::automatic
                 ? (dev_.supports_flags() ? Handoff::flags : Handoff::callback)
                 : opt_.handoff;
  if (handoff_ == Handoff::flags && !dev_.supports_flags())
    throw Error(ErrorCategory::unsupported,
                fmt::format("{} cannot wait on flags in host memory; use the callback hand-off",
                            dev_.name()));
  try {
    size_t total = 0, done = 0;
    for (size_t i = 0; i < weights_.size(); ++i)
      if (weight_home_[i] == Home::gpu) total += weights_.tensors[i].n_bytes;
    dev_weight_.assign(weights_.size(), nullptr);
    std::vector<float> f32;
    for (size_t i = 0; i < weights_.size(); ++i) {
      if (weight_home_[i] != Home::gpu) continue;
      const TensorView& w = weights_.tensors[i];
      const bool vector = w.ne[1] == 1 && w.ne[2] == 1 && w.ne[3] == 1;
      if (vector && w.type != GgmlType::F32) {
        // Norm scales and biases: f32 on the device, as the kernels take them.
        f32.resize(static_cast<size_t>(w.ne[0]));
        cpu::get_row(w, 0, f32.data());
        dev_weight_[i] = dev_.alloc(f32.size() * 4, w.name);
        dev_.upload(dev_weight_[i], f32.data(), f32.size() * 4);
        dev_weight_bytes_ += f32.size() * 4;
      } else {
        dev_weight_[i] = dev_.alloc(w.n_bytes, w.name);
        // In slices, so the progress callback moves on large tensors too.
        constexpr size_t kSlice = size_t{256} << 20;
        for (size_t off = 0; off < w.n_bytes; off += kSlice) {
          const size_t n = std::min(kSlice, w.n_bytes - off);
          dev_.upload(static_cast<uint8_t*>(dev_weight_[i]) + off,
                      static_cast<const uint8_t*>(w.data) + off, n);
          if (opt_.progress && off + n < w.n_bytes) opt_.progress(done + off + n, total);
        }
        dev_weight_bytes_ += w.n_bytes;
      }
      done += w.n_bytes;
      if (opt_.progress) opt_.progress(done, total);
    }
    const int64_t n_ctx = cpu_kv_.n_ctx();
    dev_k_.assign(kv_home_.size(), nullptr);
    dev_v_.assign(kv_home_.size(), nullptr);
    for (size_t l = 0; l < kv_home_.size(); ++l) {
      if (kv_home_[l] != Home::gpu) continue;
      const KvLayer& kl = cpu_kv_.layer(static_cast<int32_t>(l));
      const size_t kb = static_cast<size_t>(n_ctx * kl.k_dim) * 2;
      const size_t vb = static_cast<size_t>(n_ctx * kl.v_dim) * 2;
      dev_k_[l] = static_cast<uint16_t*>(dev_.alloc(kb, fmt::format("the K cache of layer {}", l)));
      dev_v_[l] = static_cast<uint16_t*>(dev_.alloc(vb, fmt::format("the V cache of layer {}", l)));
      dev_kv_bytes_ += kb + vb;
    }
    if (opt_.stream_experts_min_tokens > 0 || opt_.host_expert_share > 0) pin_host_experts();
    max_tokens_ = n_ctx;
    const size_t tb = static_cast<size_t>(max_tokens_) * 4;
    tokens_host_ = static_cast<int32_t*>(dev_.alloc_host(tb, "token ids"));
    positions_host_ = static_cast<int32_t*>(dev_.alloc_host(tb, "positions"));
    tokens_dev_ = static_cast<int32_t*>(dev_.alloc(tb, "token ids"));
    positions_dev_ = static_cast<int32_t*>(dev_.alloc(tb, "positions"));
  } catch (...) {
    release();
    throw;
  }
}

bool copy_read_by_cpu() { return numa_node_count() <= 1; }

bool registers_host_experts(const Device& dev) {
  // Off by default: with it, test_hybrid's streaming case hung on the H200 (2026-12-01; the
  // main thread running, another in a futex wait; cause not found), where the pinned copy
  // passes. llama.cpp too keeps registering mmap'd weights opt-in (GGML_CUDA_REGISTER_HOST).
  const char* v = std::getenv("BERTH_REGISTER_HOST");
  const std::string_view on = v ? v : "";
  return (on == "1" || on == "on" || on == "true") && dev.can_register_host();
}

namespace {
// round(n f k): the slots the share gives the device over its first n candidate layers.
int32_t host_share_slots(double f, int32_t k, int64_t n) {
  return static_cast<int32_t>(std::floor(static_cast<double>(n) * f * k + 0.5));
}
}  // namespace

std::vector<int32_t> host_share_device_slots(const graph::Graph& g,
                                             const std::vector<Home>& weight_home, double f) {
  std::vector<int32_t> slots(g.ops.size(), 0);
  if (f <= 0 || g.n_tokens != 1) return slots;  // decode only: see HybridOptions
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
    // Stacked experts only (n_expert > 1), as pin_host_experts pins.
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

void HybridExecutor::pin_host_experts() {
  // The CPU-held stacked expert tensors, streamed to the device (prefill) or read by it over
  // PCIe (host_expert_share), need page-locked memory: a pinned copy of each, or with
  // BERTH_REGISTER_HOST=1 their own memory (the file mapping) registered in place, as runs of
  // tensors whose gaps are under 2 MiB (so no two runs share a page).
  pinned_weight_.assign(weights_.size(), nullptr);
  std::vector<size_t> ids;
  for (size_t i = 0; i < weights_.size(); ++i) {
    const TensorView& w = weights_.tensors[i];
    if (weight_home_[i] == Home::cpu && w.ne[2] > 1 && w.n_bytes > 0) ids.push_back(i);
  }
  if (ids.empty()) return;
  const auto at = [&](size_t i) { return reinterpret_cast<uintptr_t>(weights_.tensors[i].data); };
  // In place needs 16-byte aligned tensors (the staging kernel's wide loads; a pinned copy is
  // page-aligned), as GGUF's default general.alignment of 32 gives.
  bool in_place = registers_host_experts(dev_) &&
                  std::all_of(ids.begin(), ids.end(), [&](size_t i) { return at(i) % 16 == 0; });
  if (in_place) {
    std::vector<size_t> order = ids;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return at(a) < at(b); });
    constexpr uintptr_t kGap = uintptr_t{2} << 20;
    for (size_t r = 0; r < order.size() && in_place;) {
      const uintptr_t begin = at(order[r]);
      uintptr_t end = begin + weights_.tensors[order[r]].n_bytes;
      size_t q = r + 1;
      for (; q < order.size() && at(order[q]) <= end + kGap; ++q)
        end = std::max<uintptr_t>(end, at(order[q]) + weights_.tensors[order[q]].n_bytes);
      const void* p = reinterpret_cast<const void*>(begin);
      if (dev_.register_host(p, end - begin))
        registered_.push_back(p);
      else
        in_place = false;
      r = q;
    }
    if (!in_place) {
      for (const void* p : registered_) dev_.unregister_host(p);
      registered_.clear();
    }
  }
  if (!in_place && !opt_.copy_host_experts) {
    // The caller allows no copy (HybridOptions::copy_host_experts): stream nothing instead, and
    // the share finds no pinned weights (it splits nothing).
    log::warn(
        "{}: the CPU-held experts are not registered in place and no pinned copy is allowed: "
        "the CPU computes all of them, at prefill and decode",
        dev_.name());
    opt_.stream_experts_min_tokens = 0;
    return;
  }
  pinned_copies_ = !in_place;
  const bool cpu_reads_copy = copy_read_by_cpu();
  for (size_t i : ids) {
    const TensorView& w = weights_.tensors[i];
    if (in_place) {
      pinned_weight_[i] = const_cast<void*>(w.data);  // read only: the device never writes it
    } else {
      pinned_weight_[i] = dev_.alloc_host(w.n_bytes, w.name);
      std::memcpy(pinned_weight_[i], w.data, w.n_bytes);
      // On one NUMA node the CPU reads the copy too, so the source pages are no longer needed
      // here. (The copy is allocated by this thread, on its node; with more nodes the workers
      // keep reading the pages they first touched.) MADV_COLD is a hint, non-destructive
      // whatever memory the tensor lives in (a file mapping or the heap).
      if (!cpu_reads_copy) continue;
      cpu_weights_.tensors[i].data = pinned_weight_[i];
#ifdef MADV_COLD
      const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
      const auto a = reinterpret_cast<uintptr_t>(w.data);
      const uintptr_t b = (a + page - 1) / page * page, e = (a + w.n_bytes) / page * page;
      if (e > b) ::madvise(reinterpret_cast<void*>(b), e - b, MADV_COLD);
#endif
    }
  }
}

HybridExecutor::~HybridExecutor() { release(); }

void HybridExecutor::release() {
  try {
    dev_.synchronize();
  } catch (...) {
  }
  for (auto& sp : plans_) {
    if (sp->arena) dev_.dealloc(sp->arena);
    if (sp->ws) dev_.dealloc(sp->ws);
    if (sp->id_dev) dev_.dealloc(sp->id_dev);
    for (uint8_t* m : sp->masks)
      if (m) dev_.dealloc(m);
    for (void* p : sp->pinned) dev_.dealloc_host(p);
  }
  plans_.clear();
  for (void*& p : dev_weight_)
    if (p) dev_.dealloc(p), p = nullptr;
  for (size_t i = 0; i < cpu_weights_.size(); ++i)  // before the copies it may point at go
    cpu_weights_.tensors[i].data = weights_.tensors[i].data;
  if (pinned_copies_)
    for (void*& p : pinned_weight_)
      if (p) dev_.dealloc_host(p);
  pinned_weight_.clear();
  pinned_copies_ = false;
  for (const void* p : registered_) dev_.unregister_host(p);
  registered_.clear();
  for (void*& p : stage_)
    if (p) dev_.dealloc(p), p = nullptr;
  for (auto* p : dev_k_)
    if (p) dev_.dealloc(p);
  for (auto* p : dev_v_)
    if (p) dev_.dealloc(p);
  dev_k_.clear(), dev_v_.clear();
  if (tokens_host_) dev_.dealloc_host(tokens_host_), tokens_host_ = nullptr;
  if (positions_host_) dev_.dealloc_host(positions_host_), positions_host_ = nullptr;
  if (tokens_dev_) dev_.dealloc(tokens_dev_), tokens_dev_ = nullptr;
  if (positions_dev_) dev_.dealloc(positions_dev_), positions_dev_ = nullptr;
}

size_t HybridExecutor::device_scratch_bytes() const {
  size_t n = 0;
  for (const auto& sp : plans_) n += sp->arena_bytes + sp->ws_bytes;
  return n;
}

Home HybridExecutor::op_home(const graph::Graph& g, size_t i) {
  StepPlan& sp = plan_for(g);
  return sp.op_home.at(static_cast<size_t>(sp.orig_index.at(i)));
}

void HybridExecutor::split_host_experts(StepPlan& sp) const {
  // Each moe_experts op host_share_device_slots() gives the device some slots of (experts on
  // the CPU, pinned; input from a device-held norm; single-token steps) becomes: the CPU's share
  // (the op over the first slots of each token's route), the device's share (the op over its last
  // slots, weights read from the pinned host copy) and an add. The graph's contract: ops over
  // disjoint slot ranges add up to the layer. The c-th split layer gives the device round((c + 1) f
  // k) - round(c f k) of its k slots, so every token's work divides the same way (an expert-id
  // split left a token's share to chance) and a fractional f k alternates between its neighbours
  // over the layers.
  graph::Graph& g = sp.g;
  const auto pinned = [&](graph::WeightId id) {
    return !pinned_weight_.empty() && pinned_weight_[static_cast<size_t>(id)] != nullptr;
  };
  const std::vector<int32_t> dev_slots =
      host_share_device_slots(g, weight_home_, opt_.host_expert_share);
  std::vector<Op> ops;
  sp.orig_index.clear();
  for (size_t i = 0; i < g.ops.size(); ++i) {
    const Op& op = g.ops[i];
    // pin_host_experts pins every CPU-held expert tensor or none.
    const bool split = op.kind == OpKind::moe_experts && pinned(op.moe.gate) && pinned(op.moe.up) &&
                       pinned(op.moe.down);
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
      const bool all_dev = split && n_dev > 0;
      sp.orig_index.push_back(static_cast<int32_t>(ops.size()));
      ops.push_back(op);
      sp.host_w.push_back(all_dev);
      continue;
    }
    sp.orig_index.push_back(static_cast<int32_t>(ops.size() + 2));
    const graph::ValueInfo vi = g.values[static_cast<size_t>(op.output)];
    cpu_op.output = static_cast<ValueId>(g.values.size());
    g.values.push_back({vi.rows, vi.cols, vi.name + ".cpu"});
    dev_op.output = static_cast<ValueId>(g.values.size());
    g.values.push_back({vi.rows, vi.cols, vi.name + ".gpu"});
    cpu_op.name += ".cpu";
    dev_op.name += ".gpu";
    Op sum;
    sum.kind = OpKind::add;
    sum.inputs = {dev_op.output, cpu_op.output};
    sum.output = op.output;
    sum.name = op.name + ".sum";
    ops.push_back(cpu_op);
    ops.push_back(dev_op);
    ops.push_back(sum);
    sp.host_w.insert(sp.host_w.end(), {false, true, false});
  }
  g.ops = std::move(ops);
}

namespace {

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

// A moe_experts op's slot range; `host_w`: its weights are the pinned host copy (staged).
MoeSlots moe_slots(const Op& op, bool host_w) {
  return MoeSlots{.begin = op.moe.slot_begin, .end = op.moe.slot_end, .stage = host_w};
}

// Workspace the op needs on the device (`host_w`: it reads the pinned host copy of its weights).
size_t op_workspace(Device& dev, const graph::Graph& g, const graph::WeightTable& w, const Op& op,
                    int64_t n_ctx, bool host_w) {
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

}  // namespace

HybridExecutor::StepPlan& HybridExecutor::plan_for(const graph::Graph& model_graph, bool select) {
  const int64_t out_rows = model_graph.values.at(static_cast<size_t>(model_graph.output)).rows;
  for (auto& sp : plans_)
    if (sp->n_tokens == model_graph.n_tokens && sp->out_rows == out_rows &&
        sp->n_ops == model_graph.ops.size() && sp->select == select)
      return *sp;
  auto owned = std::make_unique<StepPlan>();
  StepPlan& sp = *owned;
  sp.n_tokens = model_graph.n_tokens;
  sp.out_rows = out_rows;
  sp.n_ops = model_graph.ops.size();
  sp.select = select;
  sp.g = model_graph;
  split_host_experts(sp);
  const graph::Graph& g = sp.g;
  const size_t n_ops = g.ops.size(), n_val = g.values.size();
  const auto home_of = [&](graph::WeightId id) { return weight_home_.at(static_cast<size_t>(id)); };

  // 1. Sides.
  sp.op_home.assign(n_ops, Home::cpu);
  sp.streamed.assign(n_ops, false);
  sp.value_home.assign(n_val, Home::cpu);
  std::vector<int32_t> producer(n_val, -1);
  for (size_t i = 0; i < n_ops; ++i) {
    const Op& op = g.ops[i];
    Home h = Home::cpu;
    switch (op.kind) {
      case OpKind::moe_experts: {
        h = home_of(op.moe.gate);
        if (home_of(op.moe.up) != h || home_of(op.moe.down) != h)
          throw Error(ErrorCategory::invalid_argument,
                      fmt::format("{}, {} and {} are placed on different devices; the expert "
                                  "tensors of one layer must live together",
                                  weights_[op.moe.gate].name, weights_[op.moe.up].name,
                                  weights_[op.moe.down].name));
        if (sp.host_w[i]) {
          h = Home::gpu;
        } else if (h == Home::cpu && opt_.stream_experts_min_tokens > 0 && g.n_tokens > 1 &&
                   g.n_tokens >= opt_.stream_experts_min_tokens &&
                   sp.value_home[static_cast<size_t>(op.inputs[0])] == Home::gpu) {
          h = Home::gpu;
          sp.streamed[i] = true;
        }
        break;
      }
      case OpKind::attention:
        h = kv_home_.at(static_cast<size_t>(op.attn.layer));
        break;
      default:
        if (op.weight != graph::kNoWeight) {
          h = home_of(op.weight);
        } else {
          // Weightless ops (add, swiglu, rope, routing, last rows) run on the device as soon as
          // one input lives there: following only the first input would keep a residual chain
          // that starts on the CPU (token_embd there) on the CPU for the whole step.
          h = Home::cpu;
          for (ValueId v : op.inputs)
            if (sp.value_home[static_cast<size_t>(v)] == Home::gpu) h = Home::gpu;
        }
    }
    sp.op_home[i] = h;
    sp.value_home[static_cast<size_t>(op.output)] = h;
    producer[static_cast<size_t>(op.output)] = static_cast<int32_t>(i);
  }

  // 2. CPU segments: runs of consecutive CPU ops; each forks after the last GPU op producing one
  // of its inputs (never before the previous segment's fork: the aux stream is in order).
  std::vector<int32_t> seg_of(n_ops, -1);
  for (size_t i = 0; i < n_ops; ++i) {
    if (sp.op_home[i] != Home::cpu) continue;
    if (i == 0 || sp.op_home[i - 1] != Home::cpu) {
      sp.segs.emplace_back();
      sp.segs.back().ex = this;
      sp.segs.back().sp = &sp;
    }
    Segment& s = sp.segs.back();
    s.ops.push_back(static_cast<int32_t>(i));
    seg_of[i] = static_cast<int32_t>(sp.segs.size() - 1);
    for (ValueId v : g.ops[i].inputs) {
      const int32_t p = producer[static_cast<size_t>(v)];
      if (p >= 0 && sp.op_home[static_cast<size_t>(p)] == Home::gpu) s.ready = std::max(s.ready, p);
    }
  }
  for (size_t s = 1; s < sp.segs.size(); ++s)
    sp.segs[s].ready = std::max(sp.segs[s].ready, sp.segs[s - 1].ready);
  sp.seg_after.assign(n_ops, false);
  for (const Segment& s : sp.segs)
    if (s.ready >= 0) sp.seg_after[static_cast<size_t>(s.ready)] = true;

  // 3. Where values live, crossings, lifetimes on the device (in op-index time).
  std::vector<bool> need_dev(n_val, false), need_host(n_val, false);
  std::vector<int64_t> birth(n_val, 0), death(n_val, -1);
  std::vector<bool> copied_down(n_val, false);
  for (size_t v = 0; v < n_val; ++v) {
    const int32_t p = producer[v];
    if (p < 0) continue;
    (sp.value_home[v] == Home::gpu ? need_dev : need_host)[v] = true;
    birth[v] = sp.value_home[v] == Home::gpu
                   ? p
                   : sp.segs[static_cast<size_t>(seg_of[static_cast<size_t>(p)])].ready + 1;
    death[v] = birth[v];
  }
  for (size_t i = 0; i < n_ops; ++i) {
    for (ValueId vi : g.ops[i].inputs) {
      const size_t v = static_cast<size_t>(vi);
      if (sp.op_home[i] == Home::gpu) {
        need_dev[v] = true;
        death[v] = std::max<int64_t>(death[v], static_cast<int64_t>(i));
        if (sp.value_home[v] == Home::cpu) {
          Segment& s = sp.segs[static_cast<size_t>(seg_of[static_cast<size_t>(producer[v])])];
          if (std::find(s.h2d.begin(), s.h2d.end(), vi) == s.h2d.end()) s.h2d.push_back(vi);
        }
      } else {
        need_host[v] = true;
        if (sp.value_home[v] == Home::gpu) {
          Segment& s = sp.segs[static_cast<size_t>(seg_of[i])];
          death[v] = std::max<int64_t>(death[v], s.ready);
          if (!copied_down[v]) {
            s.d2h.push_back(vi);
            copied_down[v] = true;
          }
        }
      }
    }
  }
  const size_t out = static_cast<size_t>(g.output);
  if (sp.value_home[out] == Home::gpu) death[out] = static_cast<int64_t>(n_ops);
  // Joins read in place (flag hand-off): when the only output of a segment that device ops
  // read is small and read by one device op, a residual add fused with the whole-row norm after
  // it, that add waits for the segment's done flag and reads the output from its pinned host
  // buffer (Device::wait_add_rms_norm): no copy to the device and no wait between the streams.
  sp.host_join.assign(n_ops, -1);
  if (handoff_ == Handoff::flags) {
    std::vector<int32_t> gpu_readers(n_val, 0);
    std::vector<int64_t> gpu_reader(n_val, -1);
    for (size_t i = 0; i < n_ops; ++i)
      if (sp.op_home[i] == Home::gpu)
        for (ValueId v : g.ops[i].inputs) {
          ++gpu_readers[static_cast<size_t>(v)];
          gpu_reader[static_cast<size_t>(v)] = static_cast<int64_t>(i);
        }
    for (size_t si = 0; si < sp.segs.size(); ++si) {
      Segment& s = sp.segs[si];
      if (s.ready < 0 || s.h2d.size() != 1) continue;
      const auto v = static_cast<size_t>(s.h2d[0]);
      if (value_bytes(g.values[v]) > (size_t{64} << 10) || gpu_readers[v] != 1) continue;
      const auto c = static_cast<size_t>(gpu_reader[v]);
      const Op& op = g.ops[c];
      if (!fuses_add_norm(sp, c)) continue;
      const ValueId other = op.inputs[0] == s.h2d[0] ? op.inputs[1] : op.inputs[0];
      if (other == s.h2d[0] || sp.value_home[static_cast<size_t>(other)] != Home::gpu) continue;
      sp.host_join[c] = static_cast<int32_t>(si);
      s.host_join = true;
    }
  }
  // A norm + rope fusion writes the rope's output at the call's op (the norm, or the norm before
  // it when the two go as a pair): born one op before that, its buffer is shared with no value
  // that call still reads (one job's output must not overwrite the other job's input).
  plan_norm_rope(sp);
  for (size_t i = 0; i < n_ops; ++i)
    if (sp.rope_of[i] >= 0) {
      const auto v = static_cast<size_t>(g.ops[static_cast<size_t>(sp.rope_of[i])].output);
      const int64_t call = static_cast<int64_t>(i) - (i > 0 && sp.rope_pair[i - 1] ? 1 : 0);
      birth[v] = std::min<int64_t>(birth[v], std::max<int64_t>(0, call - 1));
    }

  // 4. Buffers. Device: one arena by liveness. Host: pinned for values that cross, the
  // executor's own vectors for values only CPU ops touch.
  std::vector<size_t> sizes(n_val, 0), offsets;
  for (size_t v = 0; v < n_val; ++v)
    if (need_dev[v]) sizes[v] = value_bytes(g.values[v]);
  sp.arena_bytes = assign_offsets(sizes, birth, death, offsets);
  sp.ws_bytes = 0;
  for (size_t i = 0; i < n_ops; ++i)
    if (sp.op_home[i] == Home::gpu)
      sp.ws_bytes = std::max(
          sp.ws_bytes, op_workspace(dev_, g, weights_, g.ops[i], cpu_kv_.n_ctx(), sp.host_w[i]));
  try {
    size_t stage = 0;
    for (size_t i = 0; i < n_ops; ++i)
      if (sp.streamed[i]) {
        const auto& m = g.ops[i].moe;
        stage = std::max(
            stage, weights_[m.gate].n_bytes + weights_[m.up].n_bytes + weights_[m.down].n_bytes);
      }
    if (stage > stage_bytes_) {
      for (void*& p : stage_)
        if (p) dev_.dealloc(p), p = nullptr;
      stage_bytes_ = 0;
      for (void*& p : stage_) p = dev_.alloc(stage, "streamed expert weights");
      stage_bytes_ = stage;
    }
    if (sp.arena_bytes > 0) sp.arena = dev_.alloc(sp.arena_bytes, "activations");
    if (sp.ws_bytes > 0) sp.ws = dev_.alloc(sp.ws_bytes, "kernel workspace");
    sp.dev_val.assign(n_val, nullptr);
    for (size_t v = 0; v < n_val; ++v)
      if (need_dev[v])
        sp.dev_val[v] = reinterpret_cast<float*>(static_cast<uint8_t*>(sp.arena) + offsets[v]);
    sp.host_val.assign(n_val, nullptr);
    sp.host_owned.resize(n_val);
    for (size_t v = 0; v < n_val; ++v) {
      if (!need_host[v] && !(v == out)) continue;
      const bool crosses = need_dev[v];
      if (crosses) {
        void* p = dev_.alloc_host(value_bytes(g.values[v]), g.values[v].name);
        sp.pinned.push_back(p);
        sp.host_val[v] = static_cast<float*>(p);
      } else {
        sp.host_owned[v].resize(static_cast<size_t>(g.values[v].rows * g.values[v].cols));
        sp.host_val[v] = sp.host_owned[v].data();
      }
    }
    sp.out_host = sp.host_val[out];
    if (select && sp.value_home[out] == Home::gpu) {
      sp.id_dev = static_cast<int32_t*>(dev_.alloc(sizeof(int32_t), "the selected token"));
      sp.id_host = static_cast<int32_t*>(dev_.alloc_host(sizeof(int32_t), "the selected token"));
      sp.pinned.push_back(sp.id_host);
    }
    if (handoff_ == Handoff::flags && !sp.segs.empty()) {
      sp.flags = static_cast<uint32_t*>(dev_.alloc_host(sp.segs.size() * 8, "hand-off flags"));
      sp.pinned.push_back(sp.flags);
    }
    sp.masks.assign(n_ops, nullptr);
    for (size_t i = 0; i < n_ops; ++i) {
      const Op& op = g.ops[i];
      if (op.kind != OpKind::moe_experts || sp.op_home[i] != Home::gpu) continue;
      std::vector<uint8_t> m(static_cast<size_t>(op.moe.n_expert));
      for (int32_t e = 0; e < op.moe.n_expert; ++e)
        m[static_cast<size_t>(e)] = op.moe.has_expert(e);
      sp.masks[i] = static_cast<uint8_t*>(dev_.alloc(m.size(), "expert mask"));
      dev_.upload(sp.masks[i], m.data(), m.size());
    }
  } catch (...) {
    if (sp.arena) dev_.dealloc(sp.arena);
    if (sp.ws) dev_.dealloc(sp.ws);
    if (sp.id_dev) dev_.dealloc(sp.id_dev);
    for (uint8_t* m : sp.masks)
      if (m) dev_.dealloc(m);
    for (void* p : sp.pinned) dev_.dealloc_host(p);
    throw;
  }
  plans_.push_back(std::move(owned));
  return *plans_.back();
}

// ---------------------------------------------------------------------------------------------
// Running

void HybridExecutor::run_segment(void* arg) {
  auto* s = static_cast<Segment*>(arg);
  StepPlan& sp = *s->sp;
  if (sp.error || s->ex->skip_cpu_) return;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    HybridExecutor& ex = *s->ex;
    const size_t n = static_cast<size_t>(sp.n_tokens);
    ex.cpu_.run_subset(sp.g, s->ops, std::span<const int32_t>(ex.tokens_host_, n),
                       std::span<const int32_t>(ex.positions_host_, n));
  } catch (...) {
    sp.error = std::current_exception();
  }
  sp.cpu_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void HybridExecutor::stream_copy(const graph::Op& op, int buf) {
  uint8_t* dst = static_cast<uint8_t*>(stage_[buf]);
  for (graph::WeightId id : {op.moe.gate, op.moe.up, op.moe.down}) {
    const size_t n = weights_[id].n_bytes;
    dev_.copy_h2d(kCopy, dst, pinned_weight_.at(static_cast<size_t>(id)), n);
    dst += n;
  }
}

bool HybridExecutor::enqueue_op(StepPlan& sp, size_t i, const void* const* stream_w, void* q8_out,
                                bool x_q8) {
  const graph::Graph& g = sp.g;
  const Op& op = g.ops[i];
  const graph::ValueInfo& oi = g.values[static_cast<size_t>(op.output)];
  float* out = sp.dev_val[static_cast<size_t>(op.output)];
  const auto in = [&](size_t j) { return sp.dev_val[static_cast<size_t>(op.inputs.at(j))]; };
  const auto wdev = [&](graph::WeightId id) { return dev_weight_.at(static_cast<size_t>(id)); };
  const int64_t rows = oi.rows, cols = oi.cols;
  switch (op.kind) {
    case OpKind::embed: {
      const TensorView& w = weights_[op.weight];
      dev_.embed(kMain, w.type, wdev(op.weight), w.ne[0], w.ne[1], tokens_dev_, rows, out);
      return false;
    }
    case OpKind::rms_norm: {
      const float* w =
          op.weight == graph::kNoWeight ? nullptr : static_cast<const float*>(wdev(op.weight));
      dev_.rms_norm(kMain, in(0), w, out, rows, cols, op.norm_group > 0 ? op.norm_group : cols,
                    op.eps);
      return false;
    }
    case OpKind::matmul: {
      const TensorView& w = weights_[op.weight];
      if (x_q8) {
        const MatmulJob job{w.type, wdev(op.weight), w.n_rows(), out};
        dev_.matmul_group_q8(kMain, &job, 1, w.ne[0], in(0), rows, sp.ws, sp.ws_bytes);
      } else {
        dev_.matmul(kMain, w.type, wdev(op.weight), w.ne[0], w.n_rows(), in(0), rows, out, sp.ws,
                    sp.ws_bytes);
      }
      return false;
    }
    case OpKind::add:
      dev_.add(kMain, in(0), in(1), out, rows * cols);
      return false;
    case OpKind::swiglu:
      dev_.swiglu(kMain, in(0), in(1), out, rows * cols);
      return false;
    case OpKind::rope: {
      const graph::RopeParams& p = op.rope;
      dev_.rope(kMain, in(0), out, rows, p.n_head, p.head_dim, p.n_rot, p.freq_base,
                p.mode == graph::RopeMode::neox, positions_dev_);
      return false;
    }
    case OpKind::attention: {
      const graph::AttentionParams& p = op.attn;
      const size_t l = static_cast<size_t>(p.layer);
      return dev_.attention_q8(kMain, in(0), in(1), in(2), rows, positions_dev_, dev_k_.at(l),
                               dev_v_.at(l), cpu_kv_.n_ctx(), p.n_head, p.n_head_kv, p.head_dim,
                               p.scale, out, sp.ws, sp.ws_bytes, q8_out);
    }
    case OpKind::take_last_rows: {
      const graph::ValueInfo& ii = g.values[static_cast<size_t>(op.inputs[0])];
      dev_.copy_d2d(kMain, out, in(0) + (ii.rows - rows) * cols,
                    static_cast<size_t>(rows * cols) * 4);
      return false;
    }
    case OpKind::add_bias:
      dev_.add_bias(kMain, in(0), static_cast<const float*>(wdev(op.weight)), out, rows, cols);
      return false;
    case OpKind::moe_route:
      dev_.moe_route(kMain, in(0), rows, op.moe.n_expert, op.moe.n_expert_used, op.moe.norm_weights,
                     out);
      return false;
    case OpKind::moe_experts: {
      const void* dw[3] = {wdev(op.moe.gate), wdev(op.moe.up), wdev(op.moe.down)};
      dev_.moe_experts(kMain, moe_weights(weights_, op.moe, stream_w ? stream_w : dw), in(0), in(1),
                       rows, sp.masks[i], moe_slots(op, sp.host_w[i]), out, sp.ws, sp.ws_bytes);
      return false;
    }
  }
  throw Error(ErrorCategory::internal, fmt::format("op '{}' has an unknown kind", op.name));
}

void HybridExecutor::enqueue_step(StepPlan& sp) {
  const graph::Graph& g = sp.g;
  const size_t tb = static_cast<size_t>(sp.n_tokens) * 4;
  dev_.copy_h2d(kMain, tokens_dev_, tokens_host_, tb);
  dev_.copy_h2d(kMain, positions_dev_, positions_host_, tb);
  std::vector<bool> pending(g.values.size(), false);  // written by a segment not yet joined
  bool any_pending = false;
  // Joins read in place (plan_for) go with the add + norm fusion, which profiling turns off.
  const bool host_joins = !profiling_;
  size_t next_seg = 0;
  std::vector<bool> signalled(sp.segs.size(), false);  // its inputs went with moe_route_signal
  const auto launch_ready = [&](int32_t after) {
    for (; next_seg < sp.segs.size() && sp.segs[next_seg].ready == after; ++next_seg) {
      Segment& s = sp.segs[next_seg];
      if (after < 0) {
        // Reads nothing from the device (e.g. embed with token_embd on the CPU): run() ran it on
        // the calling thread before this step was enqueued; only its outputs travel.
        for (ValueId v : s.h2d)
          dev_.copy_h2d(kMain, sp.dev_val[static_cast<size_t>(v)],
                        sp.host_val[static_cast<size_t>(v)],
                        value_bytes(g.values[static_cast<size_t>(v)]));
        continue;
      }
      const std::vector<HostCopy> out = copies_out(sp, s);
      std::vector<HostCopy> in;
      const bool in_place = sp.flags && s.host_join && host_joins;
      if (!in_place)
        for (ValueId v : s.h2d) {
          in.push_back({sp.dev_val[static_cast<size_t>(v)], sp.host_val[static_cast<size_t>(v)],
                        value_bytes(g.values[static_cast<size_t>(v)])});
          pending[static_cast<size_t>(v)] = true;
        }
      if (sp.flags) {
        // The inputs go down and the ready flag up in one device operation; the wait for the
        // done flag and the outputs' way back in another, on the aux stream, so the main stream
        // may go on with device work that does not need them (or, read in place, in the add
        // that reads the output).
        const size_t si = static_cast<size_t>(&s - sp.segs.data());
        if (!signalled[si])
          dev_.copy_out_signal(kMain, out.data(), static_cast<int>(out.size()), &sp.flags[2 * si],
                               1);
        if (in_place) continue;
        dev_.wait(kAux, kMain);
        dev_.wait_copy_in(kAux, &sp.flags[2 * si + 1], 1, in.data(), static_cast<int>(in.size()));
      } else {
        for (const HostCopy& c : out) dev_.copy_d2h(kMain, c.dst, c.src, c.bytes);
        dev_.wait(kAux, kMain);
        dev_.host_fn(kAux, &HybridExecutor::run_segment, &s);
        for (const HostCopy& c : in) dev_.copy_h2d(kAux, c.dst, c.src, c.bytes);
      }
      any_pending = true;
    }
  };
  launch_ready(-1);
  // Streamed experts: op j of the list copies into stage j % 2 on the copy stream once op j - 2
  // has finished with it; the main stream waits for op j's copy only.
  std::vector<size_t> streamed;
  for (size_t i = 0; i < g.ops.size(); ++i)
    if (sp.streamed[i]) streamed.push_back(i);
  std::vector<int> copied(streamed.size(), -1);
  const auto start_copy = [&](size_t j, int after_main) {
    if (after_main >= 0) dev_.wait_event(kCopy, after_main);
    stream_copy(g.ops[streamed[j]], static_cast<int>(j % 2));
    copied[j] = dev_.record(kCopy);
  };
  n_streamed_ += static_cast<int64_t>(streamed.size());
  if (!streamed.empty()) {
    dev_.wait(kCopy, kMain);
    for (size_t j = 0; j < std::min<size_t>(2, streamed.size()); ++j) start_copy(j, -1);
  }
  size_t next_stream = 0;
  const std::vector<bool>& seg_after = sp.seg_after;
  std::vector<bool> fused_away(g.ops.size(), false);  // enqueued earlier as part of a fusion
  // A single-token moe_route after which one CPU segment forks (its experts, with the flag
  // hand-off): the route and the segment's inputs go to the host with its ready flag in the same
  // device operation (Device::moe_route_signal). Off while profiling (ops are timed one by one).
  const auto signals_route = [&](size_t i) {
    const Op& op = g.ops[i];
    return sp.flags && !profiling_ && op.kind == OpKind::moe_route && seg_after[i] &&
           g.values[static_cast<size_t>(op.output)].rows == 1 && next_seg < sp.segs.size() &&
           sp.segs[next_seg].ready == static_cast<int32_t>(i) &&
           !(next_seg + 1 < sp.segs.size() &&
             sp.segs[next_seg + 1].ready == static_cast<int32_t>(i));
  };
  const auto route_and_signal = [&](size_t i) {
    if (!signals_route(i)) return false;
    const Op& op = g.ops[i];
    const std::vector<HostCopy> out = copies_out(sp, sp.segs[next_seg]);
    dev_.moe_route_signal(kMain, sp.dev_val[static_cast<size_t>(op.inputs[0])], op.moe.n_expert,
                          op.moe.n_expert_used, op.moe.norm_weights,
                          sp.dev_val[static_cast<size_t>(op.output)], out.data(),
                          static_cast<int>(out.size()), &sp.flags[2 * next_seg], 1);
    signalled[next_seg] = true;
    return true;
  };
  const auto is_float_w = [&](graph::WeightId id) {
    const GgmlType t = weights_[id].type;
    return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16;
  };
  // The router's matmul (op i, on the device, float weights) just before such a moe_route that
  // reads its output: both in one device operation (Device::router_route_signal).
  const auto router_route_signal = [&](size_t i) {
    const Op& mm = g.ops[i];
    if (mm.kind != OpKind::matmul || seg_after[i] || sp.streamed[i] || sp.host_w[i] ||
        i + 1 >= g.ops.size() || sp.op_home[i + 1] != Home::gpu ||
        g.ops[i + 1].inputs[0] != mm.output || !is_float_w(mm.weight) || !signals_route(i + 1))
      return false;
    const TensorView& w = weights_[mm.weight];
    const Op& op = g.ops[i + 1];
    const std::vector<HostCopy> out = copies_out(sp, sp.segs[next_seg]);
    dev_.router_route_signal(
        kMain, w.type, dev_weight_.at(static_cast<size_t>(mm.weight)), w.ne[0],
        sp.dev_val[static_cast<size_t>(mm.inputs[0])], op.moe.n_expert, op.moe.n_expert_used,
        op.moe.norm_weights, sp.dev_val[static_cast<size_t>(mm.output)],
        sp.dev_val[static_cast<size_t>(op.output)], out.data(), static_cast<int>(out.size()),
        &sp.flags[2 * next_seg], 1, sp.ws, sp.ws_bytes);
    signalled[next_seg] = true;
    fused_away[i + 1] = true;
    return true;
  };
  // The 8-bit activation blocks of a decode matmul's input made by its producer (the attention
  // before the output projection, Device::attention_q8): q8_val is the value whose blocks sp.ws
  // holds, good for the next device op only. (The residual add + norm kernels did it too for a
  // while: one block quantizing 64 groups took longer than the separate 64-warp launch.)
  ValueId q8_val = -1;
  // Op j (the next device op) is a single matmul of one token, quantized weights, reading v:
  // its producer may leave v's 8-bit blocks in sp.ws.
  const auto q8_for = [&](size_t j, ValueId v) -> void* {
    if (profiling_ || j >= g.ops.size() || sp.op_home[j] != Home::gpu || sp.streamed[j] ||
        sp.host_w[j] || g.ops[j].kind != OpKind::matmul || g.ops[j].inputs[0] != v ||
        g.values[static_cast<size_t>(v)].rows != 1 || is_float_w(g.ops[j].weight))
      return nullptr;
    return sp.ws;
  };
  static const std::vector<int64_t> kNoFusion;
  const std::vector<int64_t>& rope_of = profiling_ ? kNoFusion : sp.rope_of;
  for (size_t i = 0; i < g.ops.size(); ++i) {
    if (sp.op_home[i] != Home::gpu) continue;
    const ValueId q8_in = q8_val;
    q8_val = -1;
    if (fused_away[i]) {
      launch_ready(static_cast<int32_t>(i));
      continue;
    }
    bool needs_join = false;
    for (ValueId v : g.ops[i].inputs) needs_join = needs_join || pending[static_cast<size_t>(v)];
    if (needs_join) {
      dev_.wait(kMain, kAux);
      std::fill(pending.begin(), pending.end(), false);
    }
    if (!rope_of.empty() && rope_of[i] >= 0) {
      // A per-head norm whose only reader is a rope (Qwen3's q and k norms): norm and rope in one
      // call, with the next op's pair when that is one too (k after q).
      NormRopeJob jobs[2];
      int n_jobs = 0;
      const Op& first = g.ops[i];
      const graph::RopeParams& rp = g.ops[static_cast<size_t>(rope_of[i])].rope;
      const size_t last = sp.rope_pair[i] ? i + 1 : i;
      for (size_t k = i; k <= last; ++k) {
        const Op& nm = g.ops[k];
        const Op& rope = g.ops[static_cast<size_t>(rope_of[k])];
        jobs[n_jobs++] = {
            sp.dev_val[static_cast<size_t>(nm.inputs[0])],
            nm.weight == graph::kNoWeight
                ? nullptr
                : static_cast<const float*>(dev_weight_.at(static_cast<size_t>(nm.weight))),
            sp.dev_val[static_cast<size_t>(rope.output)], rope.rope.n_head};
        fused_away[static_cast<size_t>(rope_of[k])] = true;
      }
      // The pair's input may come from a CPU segment not yet joined (the first's was above).
      if (n_jobs > 1 && pending[static_cast<size_t>(g.ops[last].inputs[0])]) {
        dev_.wait(kMain, kAux);
        std::fill(pending.begin(), pending.end(), false);
      }
      dev_.norm_rope(kMain, jobs, n_jobs, g.values[static_cast<size_t>(first.output)].rows,
                     rp.head_dim, first.eps, rp.n_rot, rp.freq_base,
                     rp.mode == graph::RopeMode::neox, positions_dev_);
      for (; i < last; ++i) launch_ready(static_cast<int32_t>(i));  // none forks here
      launch_ready(static_cast<int32_t>(i));
      continue;
    }
    if (sp.streamed[i]) {
      const size_t j = next_stream++;
      dev_.wait_event(kMain, copied[j]);
      uint8_t* base = static_cast<uint8_t*>(stage_[j % 2]);
      const auto& m = g.ops[i].moe;
      const void* w[3] = {base, base + weights_[m.gate].n_bytes,
                          base + weights_[m.gate].n_bytes + weights_[m.up].n_bytes};
      enqueue_op(sp, i, w);
      const int done = dev_.record(kMain);
      if (j + 2 < streamed.size()) start_copy(j + 2, done);
    } else {
      const void* host_w[3];
      if (sp.host_w[i]) {
        const auto& m = g.ops[i].moe;
        host_w[0] = pinned_weight_[static_cast<size_t>(m.gate)];
        host_w[1] = pinned_weight_[static_cast<size_t>(m.up)];
        host_w[2] = pinned_weight_[static_cast<size_t>(m.down)];
        ++n_host_w_;
      }
      // Consecutive device matmuls of one input (a layer's Q, K, V) go as one group: the
      // device may share work between them. A group ends where a CPU segment forks.
      size_t end = i + 1;
      if (!profiling_ && g.ops[i].kind == OpKind::matmul)
        while (end < g.ops.size() && !seg_after[end - 1] && sp.op_home[end] == Home::gpu &&
               g.ops[end].kind == OpKind::matmul && g.ops[end].inputs[0] == g.ops[i].inputs[0] &&
               !sp.streamed[end])
          ++end;
      // A residual add and the whole-row norm that reads it: one call (the device may fuse).
      const Op& op = g.ops[i];
      const bool add_norm = !profiling_ && fuses_add_norm(sp, i);
      if (add_norm) {
        const Op& nm = g.ops[i + 1];
        const graph::ValueInfo& vi = g.values[static_cast<size_t>(op.output)];
        const float* w =
            nm.weight == graph::kNoWeight
                ? nullptr
                : static_cast<const float*>(dev_weight_.at(static_cast<size_t>(nm.weight)));
        const auto dv = [&](ValueId v) { return sp.dev_val[static_cast<size_t>(v)]; };
        if (host_joins && sp.host_join[i] >= 0) {
          // The segment's output in its pinned buffer, once its done flag is set (a + b is the
          // same float either way round).
          const auto si = static_cast<size_t>(sp.host_join[i]);
          const ValueId hv = sp.segs[si].h2d[0];
          const ValueId other = op.inputs[0] == hv ? op.inputs[1] : op.inputs[0];
          dev_.wait_add_rms_norm(kMain, &sp.flags[2 * si + 1], 1, dv(other),
                                 sp.host_val[static_cast<size_t>(hv)], dv(op.output), w,
                                 dv(nm.output), vi.rows, vi.cols, nm.eps);
        } else {
          dev_.add_rms_norm(kMain, dv(op.inputs[0]), dv(op.inputs[1]), dv(op.output), w,
                            dv(nm.output), vi.rows, vi.cols, nm.eps);
        }
        launch_ready(static_cast<int32_t>(i));  // none forks after the add (seg_after)
        ++i;
      } else if (end - i >= 2) {
        std::vector<MatmulJob> jobs;
        for (size_t k = i; k < end; ++k) {
          const TensorView& w = weights_[g.ops[k].weight];
          jobs.push_back({w.type, dev_weight_.at(static_cast<size_t>(g.ops[k].weight)), w.n_rows(),
                          sp.dev_val[static_cast<size_t>(g.ops[k].output)]});
        }
        const ValueId x = g.ops[i].inputs[0];
        dev_.matmul_group(kMain, jobs.data(), static_cast<int>(jobs.size()),
                          weights_[g.ops[i].weight].ne[0], sp.dev_val[static_cast<size_t>(x)],
                          g.values[static_cast<size_t>(x)].rows, sp.ws, sp.ws_bytes);
        for (; i + 1 < end; ++i) launch_ready(static_cast<int32_t>(i));  // none fork here
      } else if (!router_route_signal(i) && !route_and_signal(i)) {
        const int a = profiling_ ? dev_.record(kMain) : -1;
        void* q8_out = op.kind == OpKind::attention ? q8_for(i + 1, op.output) : nullptr;
        const bool x_q8 = op.kind == OpKind::matmul && q8_in >= 0 && op.inputs[0] == q8_in;
        if (enqueue_op(sp, i, sp.host_w[i] ? host_w : nullptr, q8_out, x_q8)) q8_val = op.output;
        if (profiling_) marks_.push_back({g.ops[i].kind, {a, dev_.record(kMain)}});
      }
    }
    launch_ready(static_cast<int32_t>(i));
  }
  if (!streamed.empty()) dev_.wait(kMain, kCopy);
  if (any_pending) dev_.wait(kMain, kAux);
  const size_t out = static_cast<size_t>(g.output);
  if (sp.id_dev) {
    // Greedy selection on the device: 4 bytes travel instead of the vocabulary's logits.
    const graph::ValueInfo& oi = g.values[out];
    dev_.argmax(kMain, sp.dev_val[out] + (oi.rows - 1) * oi.cols, 1, oi.cols, sp.id_dev);
    dev_.copy_d2h(kMain, sp.id_host, sp.id_dev, sizeof(int32_t));
  } else if (sp.value_home[out] == Home::gpu) {
    dev_.copy_d2h(kMain, sp.out_host, sp.dev_val[out], value_bytes(g.values[out]));
  }
}

std::span<const float> HybridExecutor::run(const graph::Graph& g, std::span<const int32_t> tokens,
                                           std::span<const int32_t> positions) {
  StepPlan& sp = step(g, tokens, positions, false);
  const graph::ValueInfo& oi = sp.g.values[static_cast<size_t>(sp.g.output)];
  return {sp.out_host, static_cast<size_t>(oi.rows * oi.cols)};
}

int32_t HybridExecutor::run_argmax(const graph::Graph& g, std::span<const int32_t> tokens,
                                   std::span<const int32_t> positions) {
  StepPlan& sp = step(g, tokens, positions, true);
  if (sp.id_host) return *sp.id_host;
  // The logits were made on the CPU: select there.
  const graph::ValueInfo& oi = sp.g.values[static_cast<size_t>(sp.g.output)];
  const float* last = sp.out_host + (oi.rows - 1) * oi.cols;
  int64_t best = 0;
  for (int64_t i = 1; i < oi.cols; ++i)
    if (last[i] > last[best] || (std::isnan(last[best]) && !std::isnan(last[i]))) best = i;
  return static_cast<int32_t>(best);
}

HybridExecutor::StepPlan& HybridExecutor::step(const graph::Graph& g,
                                               std::span<const int32_t> tokens,
                                               std::span<const int32_t> positions, bool select) {
  cpu_.check_ubatch(g, tokens, positions);
  for (const Op& op : g.ops)
    if (op.kind == OpKind::embed)
      for (int32_t id : tokens)
        if (id < 0 || id >= weights_[op.weight].ne[1])
          throw Error(ErrorCategory::invalid_argument,
                      fmt::format("token id {} is outside the vocabulary of {} tokens", id,
                                  weights_[op.weight].ne[1]));
  const auto t0 = std::chrono::steady_clock::now();
  StepPlan& sp = plan_for(g, select);
  std::copy(tokens.begin(), tokens.end(), tokens_host_);
  std::copy(positions.begin(), positions.end(), positions_host_);
  sp.error = nullptr;
  sp.cpu_seconds = 0;
  cpu_.begin_external(sp.g, sp.host_val);  // every segment of this step works on these buffers
  for (Segment& s : sp.segs)
    if (s.ready < 0) run_segment(&s);
  if (sp.error) std::rethrow_exception(sp.error);
  if (sp.flags)
    for (size_t i = 0; i < 2 * sp.segs.size(); ++i)
      std::atomic_ref<uint32_t>(sp.flags[i]).store(0, std::memory_order_relaxed);
  marks_.clear();
  const bool replay = sp.n_tokens == 1 && opt_.graphs && !profiling_;
  if (sp.flags && !replay) {
    // Eager steps enqueue op by op. The device stops at the first segment's wait, and once its
    // launch queue is full (about a thousand operations: a few dozen layers) the next enqueue
    // blocks the host, which then never reaches the flags it must serve. So a second thread
    // serves them while this one enqueues.
    serve_abort_.store(false, std::memory_order_relaxed);
    std::exception_ptr serve_error;
    std::thread server([&] {
      try {
        serve_segments(sp, std::max<int64_t>(opt_.warm_workers_us, 0));
      } catch (...) {
        serve_error = std::current_exception();
      }
    });
    try {
      enqueue_step(sp);
    } catch (...) {
      // Release the device from every wait and stop the server before unwinding.
      serve_abort_.store(true, std::memory_order_release);
      release_flags(sp, 0);
      server.join();
      try {
        dev_.synchronize();
      } catch (...) {
      }
      throw;
    }
    server.join();
    if (serve_error) std::rethrow_exception(serve_error);
  } else if (replay) {
    if (sp.graph < 0) {
      dev_.begin_capture();
      try {
        enqueue_step(sp);
      } catch (...) {
        try {
          dev_.end_capture();
        } catch (...) {
        }
        throw;
      }
      sp.graph = dev_.end_capture();
    }
    dev_.replay(sp.graph);
    if (sp.flags) serve_segments(sp, warm_workers_us());
  } else {
    enqueue_step(sp);
  }
  dev_.synchronize();
  for (const auto& [kind, ab] : marks_) {
    if (gpu_prof_.empty()) gpu_prof_.resize(static_cast<size_t>(OpKind::moe_experts) + 1);
    auto& t = gpu_prof_[static_cast<size_t>(kind)];
    t.seconds += dev_.elapsed_ms(ab.first, ab.second) / 1e3;
    ++t.calls;
  }
  last_step_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  last_cpu_s_ = sp.cpu_seconds;
  if (sp.error) std::rethrow_exception(sp.error);
  return sp;
}

void HybridExecutor::serve_segments(StepPlan& sp, int64_t warm_us) {
  // The device writes segment i's ready flag once its inputs are on the host, then waits for
  // its done flag; segments become ready in order.
  for (size_t i = 0; i < sp.segs.size(); ++i) {
    Segment& s = sp.segs[i];
    if (s.ready < 0) continue;
    std::atomic_ref<uint32_t> ready(sp.flags[2 * i]);
    if (warm_us > 0 && ready.load(std::memory_order_acquire) == 0) {
      ++n_warm_spins_;
      pool_.spin_until([&] { return ready.load(std::memory_order_acquire) != 0; }, warm_us);
    }
    const auto t0 = std::chrono::steady_clock::now();
    // Spins a few microseconds, then yields each turn: a device whose work runs on host cores
    // (SimDevice) or another process may need this core to produce the flag.
    for (uint64_t spin = 0; ready.load(std::memory_order_acquire) == 0; ++spin) {
      if (spin >= 4096) std::this_thread::yield();
      if ((spin & 0xff) == 0xff) {
        if (serve_abort_.load(std::memory_order_acquire)) return;  // the enqueue failed
        if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(60)) {
          // Never signalled: release every waiting stream so the device can finish, then fail.
          release_flags(sp, i);
          dev_.synchronize();
          throw Error(ErrorCategory::internal,
                      fmt::format("{}: CPU segment {} of the step was not signalled in 60 s",
                                  dev_.name(), i));
        }
        std::this_thread::yield();
      }
    }
    run_segment(&s);
    std::atomic_ref<uint32_t>(sp.flags[2 * i + 1]).store(1, std::memory_order_release);
  }
}

void HybridExecutor::plan_norm_rope(StepPlan& sp) const {
  // rope_of: for each device rms_norm over groups of head_dim whose output is read by exactly one
  // op, a device rope of that output with the same head_dim (the rope only needs the norm's
  // output and the positions, so it can run right after the norm). rope_pair: norm i and norm
  // i + 1 (Qwen3's q and k) go as one call when both fuse with the same norm and rope
  // parameters and no CPU segment forks between them.
  const graph::Graph& g = sp.g;
  const size_t n_ops = g.ops.size();
  std::vector<int32_t> readers(g.values.size(), 0);
  std::vector<int64_t> reader(g.values.size(), -1);
  for (size_t i = 0; i < n_ops; ++i)
    for (ValueId v : g.ops[i].inputs) {
      ++readers[static_cast<size_t>(v)];
      reader[static_cast<size_t>(v)] = static_cast<int64_t>(i);
    }
  sp.rope_of.assign(n_ops, -1);
  for (size_t i = 0; i < n_ops; ++i) {
    const Op& op = g.ops[i];
    if (op.kind != OpKind::rms_norm || op.norm_group <= 0 || sp.op_home[i] != Home::gpu) continue;
    const auto v = static_cast<size_t>(op.output);
    if (readers[v] != 1 || op.output == g.output) continue;
    const auto r = static_cast<size_t>(reader[v]);
    const Op& rope = g.ops[r];
    if (rope.kind != OpKind::rope || sp.op_home[r] != Home::gpu || rope.inputs[0] != op.output ||
        rope.rope.head_dim != op.norm_group ||
        g.values[v].cols != static_cast<int64_t>(rope.rope.n_head) * rope.rope.head_dim)
      continue;
    sp.rope_of[i] = static_cast<int64_t>(r);
  }
  sp.rope_pair.assign(n_ops, false);
  for (size_t i = 0; i + 1 < n_ops; ++i) {
    if (sp.rope_of[i] < 0 || sp.rope_of[i + 1] < 0 || sp.seg_after[i] ||
        (i > 0 && sp.rope_pair[i - 1]))
      continue;
    const Op &a = g.ops[i], &b = g.ops[i + 1];
    const graph::RopeParams& ra = g.ops[static_cast<size_t>(sp.rope_of[i])].rope;
    const graph::RopeParams& rb = g.ops[static_cast<size_t>(sp.rope_of[i + 1])].rope;
    sp.rope_pair[i] = a.eps == b.eps && a.norm_group == b.norm_group && ra.n_rot == rb.n_rot &&
                      ra.freq_base == rb.freq_base && ra.mode == rb.mode;
  }
}

void HybridExecutor::release_flags(StepPlan& sp, size_t from) {
  for (size_t j = from; j < sp.segs.size(); ++j)
    std::atomic_ref<uint32_t>(sp.flags[2 * j + 1]).store(1, std::memory_order_release);
}

std::vector<CpuExecutor::OpTime> HybridExecutor::gpu_profile() const {
  std::vector<CpuExecutor::OpTime> out;
  for (size_t k = 0; k < gpu_prof_.size(); ++k)
    if (gpu_prof_[k].calls > 0) {
      out.push_back(gpu_prof_[k]);
      out.back().kind = graph::op_name(static_cast<OpKind>(k));
    }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.seconds > b.seconds; });
  return out;
}

// ---------------------------------------------------------------------------------------------

namespace {
size_t round_up_mib(size_t bytes) { return (bytes + (size_t{1} << 20) - 1) >> 20 << 20; }
}  // namespace

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
  for (const Op& op : g.ops) {
    if (dev) {
      ws = std::max(ws, op_workspace(*dev, g, w, op, n_ctx, false));
    } else if (op.kind == OpKind::matmul || op.kind == OpKind::moe_experts) {
      const TensorView& t = w[op.kind == OpKind::matmul ? op.weight : op.moe.gate];
      ws = std::max(ws, (size_t{64} << 20) + static_cast<size_t>(n_ubatch * t.ne[0]) * 8);
    }
  }
  total += ws;
  return round_up_mib(total);
}

size_t expert_stage_bytes(const graph::Graph& g, const graph::WeightTable& w,
                          int32_t stream_experts_min_tokens, double host_expert_share) {
  if (stream_experts_min_tokens <= 0 && !(host_expert_share > 0)) return 0;
  // The moe_experts ops name each layer's stacked tensors.
  size_t layer = 0, expert = 0;
  int32_t k = 0;
  for (const Op& op : g.ops) {
    if (op.kind != OpKind::moe_experts) continue;
    const size_t b = w[op.moe.gate].n_bytes + w[op.moe.up].n_bytes + w[op.moe.down].n_bytes;
    layer = std::max(layer, b);
    expert = std::max(expert, b / static_cast<size_t>(std::max(op.moe.n_expert, 1)));
    k = std::max(k, op.moe.n_expert_used);
  }
  size_t total = 0;
  if (stream_experts_min_tokens > 0) total += 2 * layer;
  if (host_expert_share > 0)
    total += static_cast<size_t>(std::ceil(std::min(host_expert_share, 1.0) * k)) * expert;
  return round_up_mib(total);
}

}  // namespace berth
