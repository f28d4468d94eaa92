#include "berth/residency/expert_slots.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "berth/core/error.h"

namespace berth {

std::vector<int32_t> SlotPolicy::seed(int32_t, int32_t capacity) {
  std::vector<int32_t> out;
  for (int32_t e = 0; e < capacity; ++e) out.push_back(e);
  return out;
}

std::vector<std::vector<int32_t>> seed_slots(SlotPolicy& policy, std::span<const int32_t> blocks,
                                             int32_t n_expert, int32_t capacity) {
  policy.set_blocks(blocks);
  policy.reset(static_cast<int32_t>(blocks.size()), n_expert, capacity);
  std::vector<std::vector<int32_t>> out;
  for (int32_t l = 0; l < static_cast<int32_t>(blocks.size()); ++l) {
    std::vector<int32_t> s = policy.seed(l, capacity);
    std::vector<uint8_t> seen(static_cast<size_t>(std::max(n_expert, 0)), 0);
    bool ok = static_cast<int32_t>(s.size()) == capacity;
    for (int32_t e : s) {
      ok = ok && e >= 0 && e < n_expert && !seen[static_cast<size_t>(e)];
      if (ok) seen[static_cast<size_t>(e)] = 1;
    }
    if (!ok)
      throw Error(ErrorCategory::internal,
                  fmt::format("slot policy {}: the seed of blk.{} is not {} distinct experts below "
                              "{}",
                              policy.name(), blocks[static_cast<size_t>(l)], capacity, n_expert));
    out.push_back(std::move(s));
  }
  return out;
}

CacheSlotPolicy::CacheSlotPolicy(std::unique_ptr<residency::ExpertCachePolicy> p)
    : p_(std::move(p)) {
  if (!p_) throw Error(ErrorCategory::invalid_argument, "CacheSlotPolicy: no cache policy");
}

void CacheSlotPolicy::reset(int32_t n_layer, int32_t n_expert, int32_t capacity) {
  n_expert_ = n_expert;
  p_->reset(n_layer, n_expert, capacity);
}

void CacheSlotPolicy::observe(int32_t layer, std::span<const uint16_t> ids) {
  p_->update(layer, ids);
}

std::vector<int32_t> CacheSlotPolicy::target(int32_t layer) {
  std::vector<int32_t> out;
  for (int32_t e = 0; e < n_expert_; ++e)
    if (p_->resident(layer, e)) out.push_back(e);
  return out;
}

void RotatingSlotPolicy::reset(int32_t, int32_t n_expert, int32_t capacity) {
  n_expert_ = n_expert;
  capacity_ = capacity;
  boundary_ = -1;
}

std::vector<int32_t> RotatingSlotPolicy::target(int32_t layer) {
  std::vector<int32_t> out;
  const int64_t b = std::max<int64_t>(boundary_, 0);
  for (int32_t i = 0; i < capacity_; ++i)
    out.push_back(static_cast<int32_t>((b * shift_ + layer + i) % n_expert_));
  return out;
}

std::unique_ptr<SlotPolicy> default_slot_policy() {
  return std::make_unique<CacheSlotPolicy>(
      std::make_unique<residency::LfuDecayPolicy>(kDefaultHalfLife, kDefaultMargin));
}

FrequencySlotPolicy::FrequencySlotPolicy(const residency::RoutingTrace& calibration,
                                         std::string name)
    : name_(std::move(name)),
      trace_n_expert_(calibration.shape.n_expert),
      trace_blocks_(calibration.shape.blocks) {
  const residency::TraceShape& sh = calibration.shape;
  counts_.assign(static_cast<size_t>(sh.n_layer),
                 std::vector<int64_t>(static_cast<size_t>(sh.n_expert), 0));
  for (int64_t t = 0; t < calibration.n_tokens(); ++t)
    for (int32_t l = 0; l < sh.n_layer; ++l)
      for (uint16_t e : calibration.token_ids(t, l)) ++counts_[static_cast<size_t>(l)][e];
}

void FrequencySlotPolicy::set_blocks(std::span<const int32_t> blocks) {
  blocks_.assign(blocks.begin(), blocks.end());
}

void FrequencySlotPolicy::reset(int32_t n_layer, int32_t n_expert, int32_t capacity) {
  if (n_expert != trace_n_expert_)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("{}: the calibration trace has n_expert {}, the model {}", name_,
                            trace_n_expert_, n_expert));
  if (static_cast<int32_t>(blocks_.size()) != n_layer)
    throw Error(ErrorCategory::internal,
                fmt::format("frequency policy: {} layers with slots, {} blocks given", n_layer,
                            blocks_.size()));
  want_.clear();
  for (int32_t block : blocks_) {
    const auto it = std::find(trace_blocks_.begin(), trace_blocks_.end(), block);
    if (it == trace_blocks_.end())
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("{}: the calibration trace does not record MoE layer {} (blk.{})",
                              name_, block, block));
    const std::vector<int64_t>& c = counts_[static_cast<size_t>(it - trace_blocks_.begin())];
    std::vector<int32_t> order(static_cast<size_t>(n_expert));
    for (int32_t e = 0; e < n_expert; ++e) order[static_cast<size_t>(e)] = e;
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return c[static_cast<size_t>(a)] > c[static_cast<size_t>(b)];
    });
    order.resize(static_cast<size_t>(std::min(capacity, n_expert)));
    want_.push_back(std::move(order));
  }
}

std::vector<int32_t> FrequencySlotPolicy::target(int32_t layer) {
  return want_.at(static_cast<size_t>(layer));
}

std::shared_ptr<SlotPolicy> make_slot_policy(const std::string& spec) {
  const auto bad = [&] {
    return Error(ErrorCategory::invalid_argument,
                 fmt::format("residency policy '{}': use lfu-decay, lfu-decay:H or lfu-decay:H:Z "
                             "(half-life in tokens, > 0; margin >= 0), lru or frequency:TRACE",
                             spec));
  };
  if (spec == "lfu-decay") return std::shared_ptr<SlotPolicy>(default_slot_policy());
  if (spec == "lru")
    return std::make_shared<CacheSlotPolicy>(std::make_unique<residency::LruPolicy>());
  if (spec.rfind("lfu-decay:", 0) == 0) {
    // lfu-decay:H or lfu-decay:H:Z
    const std::string rest = spec.substr(10);
    const size_t colon = rest.find(':');
    const auto number = [&](const std::string& t, bool positive) {
      char* end = nullptr;
      const double v = std::strtod(t.c_str(), &end);
      if (t.empty() || *end != '\0' || !std::isfinite(v) || (positive ? !(v > 0) : !(v >= 0)))
        throw bad();
      return v;
    };
    const double h = number(rest.substr(0, colon), true);
    const double z =
        colon == std::string::npos ? kDefaultMargin : number(rest.substr(colon + 1), false);
    return std::make_shared<CacheSlotPolicy>(std::make_unique<residency::LfuDecayPolicy>(h, z));
  }
  if (spec.rfind("frequency:", 0) == 0 && spec.size() > 10) {
    const std::string path = spec.substr(10);
    return std::make_shared<FrequencySlotPolicy>(residency::read_routing_trace(path), path);
  }
  throw bad();
}

namespace {

// One expert's gate, up and down bytes of a layer (its stacked tensors' slices).
std::array<size_t, 3> expert_bytes(const graph::WeightTable& w, const SlotLayer& l) {
  std::array<size_t, 3> b{};
  const graph::WeightId ids[3] = {l.gate, l.up, l.down};
  for (int z = 0; z < 3; ++z) {
    const TensorView& t = w[ids[z]];
    if (t.ne[2] != l.n_expert || t.n_bytes % static_cast<size_t>(l.n_expert) != 0)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("expert slots: '{}' does not hold {} experts of equal size", t.name,
                              l.n_expert));
    b[static_cast<size_t>(z)] = t.n_bytes / static_cast<size_t>(l.n_expert);
  }
  return b;
}

size_t layer_bytes(const graph::WeightTable& w, const SlotLayer& l, int32_t c) {
  const std::array<size_t, 3> b = expert_bytes(w, l);
  return static_cast<size_t>(c) * (b[0] + b[1] + b[2]) + static_cast<size_t>(l.n_expert) * 4;
}

}  // namespace

size_t ExpertSlots::device_bytes(const graph::WeightTable& weights,
                                 std::span<const SlotLayer> layers, int32_t c) {
  size_t n = 0;
  for (const SlotLayer& l : layers) n += layer_bytes(weights, l, c);
  return n;
}

ExpertSlots::ExpertSlots(Device& dev, const graph::WeightTable& weights,
                         std::vector<SlotLayer> layers, const std::vector<const void*>& pinned,
                         ExpertSlotsOptions options)
    : dev_(dev), opt_(std::move(options)) {
  if (!opt_.policy) opt_.policy = default_slot_policy();
  if (opt_.max_swaps_per_step < 1)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("expert slots: at most {} swaps per layer per step; at least 1 needed",
                            opt_.max_swaps_per_step));
  const int32_t c = opt_.slots_per_layer;
  layer_of_gate_.assign(weights.size(), -1);
  try {
    int32_t n_expert = 0;
    for (const SlotLayer& ids : layers) {
      const std::string& name = weights[ids.gate].name;
      if (c < 1 || c >= ids.n_expert)
        throw Error(ErrorCategory::invalid_argument,
                    fmt::format("expert slots: {} slots for '{}' of {} experts; 1 to {} allowed", c,
                                name, ids.n_expert, ids.n_expert - 1));
      if (n_expert != 0 && ids.n_expert != n_expert)
        throw Error(ErrorCategory::invalid_argument,
                    fmt::format("expert slots: '{}' has {} experts, an earlier layer {}", name,
                                ids.n_expert, n_expert));
      n_expert = ids.n_expert;
      Layer L;
      L.ids = ids;
      const std::array<size_t, 3> b = expert_bytes(weights, ids);
      const graph::WeightId w3[3] = {ids.gate, ids.up, ids.down};
      for (int z = 0; z < 3; ++z) {
        L.bytes[z] = b[static_cast<size_t>(z)];
        const auto id = static_cast<size_t>(w3[z]);
        L.pinned[z] = static_cast<const uint8_t*>(id < pinned.size() ? pinned[id] : nullptr);
        if (!L.pinned[z])
          throw Error(ErrorCategory::invalid_argument,
                      fmt::format("expert slots: '{}' has no page-locked host memory to copy "
                                  "experts from",
                                  weights[w3[z]].name));
      }
      layers_.push_back(std::move(L));
      Layer& M = layers_.back();
      layer_of_gate_[static_cast<size_t>(ids.gate)] = static_cast<int32_t>(layers_.size() - 1);
      const size_t slot_bytes = static_cast<size_t>(c) * (M.bytes[0] + M.bytes[1] + M.bytes[2]);
      M.slots = static_cast<uint8_t*>(
          dev_.alloc(slot_bytes, fmt::format("{} expert slots of '{}'", c, name)));
      device_bytes_ += slot_bytes;
      M.dev_table = static_cast<int32_t*>(dev_.alloc(
          static_cast<size_t>(ids.n_expert) * 4, fmt::format("expert slot table of '{}'", name)));
      device_bytes_ += static_cast<size_t>(ids.n_expert) * 4;
      M.host_table = static_cast<int32_t*>(dev_.alloc_host(
          static_cast<size_t>(ids.n_expert) * 4, fmt::format("expert slot table of '{}'", name)));
      M.slot_expert.assign(static_cast<size_t>(c), -1);
      M.loading.assign(static_cast<size_t>(c), -1);
      std::fill_n(M.host_table, ids.n_expert, -1);
    }
    std::vector<int32_t> blocks;
    for (const Layer& L : layers_) blocks.push_back(weights.layer(L.ids.gate));
    // The starting set, the policy's seed (what `berth plan` shows), uploaded now.
    const std::vector<std::vector<int32_t>> seeds = seed_slots(*opt_.policy, blocks, n_expert, c);
    for (size_t l = 0; l < layers_.size(); ++l) {
      Layer& M = layers_[l];
      for (int32_t s = 0; s < c; ++s) {
        const int32_t e = seeds[l][static_cast<size_t>(s)];
        size_t base = 0;
        for (int z = 0; z < 3; ++z) {
          dev_.upload(M.slots + base + static_cast<size_t>(s) * M.bytes[z],
                      M.pinned[z] + static_cast<size_t>(e) * M.bytes[z], M.bytes[z]);
          base += static_cast<size_t>(c) * M.bytes[z];
        }
        M.slot_expert[static_cast<size_t>(s)] = e;
        M.host_table[e] = s;
      }
      dev_.upload(M.dev_table, M.host_table, static_cast<size_t>(M.ids.n_expert) * 4);
    }
  } catch (...) {
    release();
    throw;
  }
}

ExpertSlots::~ExpertSlots() { release(); }

void ExpertSlots::release() {
  try {
    dev_.synchronize();
  } catch (...) {
  }
  for (Layer& L : layers_) {
    if (L.slots) dev_.dealloc(L.slots), L.slots = nullptr;
    if (L.dev_table) dev_.dealloc(L.dev_table), L.dev_table = nullptr;
    if (L.host_table) dev_.dealloc_host(L.host_table), L.host_table = nullptr;
  }
  layers_.clear();
}

int32_t ExpertSlots::layer_of(graph::WeightId gate) const {
  const auto i = static_cast<size_t>(gate);
  return gate >= 0 && i < layer_of_gate_.size() ? layer_of_gate_[i] : -1;
}

std::array<const void*, 3> ExpertSlots::slot_bases(int32_t l) const {
  const Layer& L = at(l);
  const auto c = static_cast<size_t>(capacity());
  return {L.slots, L.slots + c * L.bytes[0], L.slots + c * (L.bytes[0] + L.bytes[1])};
}

CpuExecutor::ExpertTable ExpertSlots::cpu_binding(int32_t l) {
  Layer& L = layers_.at(static_cast<size_t>(l));
  return CpuExecutor::ExpertTable{.table = L.host_table,
                                  .n_expert = L.ids.n_expert,
                                  .route_log = &L.route_log,
                                  .calls = &L.calls,
                                  .device_calls = &L.device_calls};
}

std::vector<int32_t> ExpertSlots::slot_experts(int32_t l) const { return at(l).slot_expert; }

ExpertSlots::Stats ExpertSlots::stats() const {
  Stats s = stats_;
  for (const Layer& L : layers_) {
    s.calls += L.calls;
    s.device_calls += L.device_calls;
  }
  return s;
}

double ExpertSlots::device_share() const {
  const Stats s = stats();
  return s.calls > 0 ? static_cast<double>(s.device_calls) / static_cast<double>(s.calls) : 0.0;
}

std::string ExpertSlots::summary() const {
  const Stats s = stats();
  return fmt::format(
      "residency: {} swaps, {:.1f}% of routed expert calls on the device, {:.1f} MiB "
      "moved",
      s.swaps, 100.0 * device_share(), static_cast<double>(s.bytes_moved) / (1024.0 * 1024.0));
}

void ExpertSlots::start_copy(Layer& L, int32_t slot, int32_t expert) {
  const auto c = static_cast<size_t>(capacity());
  size_t base = 0;
  for (int z = 0; z < 3; ++z) {
    dev_.copy(kCopy, L.slots + base + static_cast<size_t>(slot) * L.bytes[z],
              L.pinned[z] + static_cast<size_t>(expert) * L.bytes[z], L.bytes[z]);
    base += c * L.bytes[z];
    stats_.bytes_moved += static_cast<int64_t>(L.bytes[z]);
  }
  L.loading[static_cast<size_t>(slot)] = expert;
  L.pending.push_back(Pending{slot, expert, dev_.record(kCopy)});
  ++stats_.swaps;
}

void ExpertSlots::observe_prefill(int32_t l, const float* route, int64_t n_tokens) {
  Layer& L = layers_.at(static_cast<size_t>(l));
  const int32_t k = L.ids.n_expert_used;
  for (int64_t t = 0; t < n_tokens; ++t)
    for (int32_t j = 0; j < k; ++j) {
      const float id = route[t * 2 * k + j];
      if (!(id >= 0 && id < static_cast<float>(L.ids.n_expert)))
        throw Error(
            ErrorCategory::internal,
            fmt::format("expert slots: route id {} of a prefill token is not an expert", id));
      L.route_log.push_back(static_cast<uint16_t>(id));
    }
  L.seat = true;
}

void ExpertSlots::between_steps() {
  ++stats_.boundaries;
  std::vector<uint8_t> dirty(layers_.size(), 0);
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& L = layers_[l];
    // (a) Commit the copies that landed.
    std::vector<Pending> still;
    for (const Pending& p : L.pending) {
      if (!dev_.done(p.event)) {
        still.push_back(p);
        ++stats_.late;
        continue;
      }
      L.loading[static_cast<size_t>(p.slot)] = -1;
      L.slot_expert[static_cast<size_t>(p.slot)] = p.expert;
      L.host_table[p.expert] = p.slot;
      dirty[l] = 1;
      ++stats_.commits;
    }
    L.pending = std::move(still);
    // The last steps' routing, for the policy.
    const auto k = static_cast<size_t>(L.ids.n_expert_used);
    for (size_t t = 0; k > 0 && t + k <= L.route_log.size(); t += k)
      opt_.policy->observe(static_cast<int32_t>(l),
                           std::span<const uint16_t>(L.route_log.data() + t, k));
    L.route_log.clear();
    stats_.calls += L.calls;
    stats_.device_calls += L.device_calls;
    L.calls = L.device_calls = 0;
  }
  opt_.policy->next_step();
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& L = layers_[l];
    const std::vector<int32_t> want = opt_.policy->target(static_cast<int32_t>(l));
    std::vector<uint8_t> wanted(static_cast<size_t>(L.ids.n_expert), 0);
    for (int32_t e : want)
      if (e >= 0 && e < L.ids.n_expert) wanted[static_cast<size_t>(e)] = 1;
    int32_t swaps = 0;
    const int32_t limit =
        L.seat ? std::max(capacity(), opt_.max_swaps_per_step) : opt_.max_swaps_per_step;
    const bool seating = L.seat;
    L.seat = false;
    for (int32_t e : want) {
      if (swaps >= limit) break;
      if (e < 0 || e >= L.ids.n_expert || L.host_table[e] >= 0 ||
          std::find(L.loading.begin(), L.loading.end(), e) != L.loading.end())
        continue;
      // A free slot first, else one whose expert is no longer wanted (never one loading).
      int32_t victim = -1;
      for (int32_t s = 0; s < capacity() && victim < 0; ++s)
        if (L.loading[static_cast<size_t>(s)] < 0 && L.slot_expert[static_cast<size_t>(s)] < 0)
          victim = s;
      for (int32_t s = 0; s < capacity() && victim < 0; ++s) {
        const int32_t o = L.slot_expert[static_cast<size_t>(s)];
        if (L.loading[static_cast<size_t>(s)] < 0 && o >= 0 && !wanted[static_cast<size_t>(o)])
          victim = s;
      }
      if (victim < 0) break;
      // (b) Out first: this step neither computes the old expert from the slot nor reads it.
      const int32_t out = L.slot_expert[static_cast<size_t>(victim)];
      if (out >= 0) {
        L.host_table[out] = -1;
        L.slot_expert[static_cast<size_t>(victim)] = -1;
        dirty[l] = 1;
      }
      start_copy(L, victim, e);
      ++swaps;
      if (seating) ++stats_.seated;
    }
    // (c) The table the step's kernels read, ahead of them on the main stream.
    if (dirty[l])
      dev_.copy(kMain, L.dev_table, L.host_table, static_cast<size_t>(L.ids.n_expert) * 4);
  }
}

}  // namespace berth
