// Expert slots: experts of CPU-held MoE layers that move to the device and back between steps.
//
// For each MoE layer whose stacked expert tensors (ffn_{gate,up,down}_exps) are CPU-held with
// page-locked memory (Residency::pinned), the device holds:
// - C expert slots: one allocation [gate slots | up slots | down slots], each C experts' matrices
//   as stored (expert e's slice of the stacked tensor, ggml layout untouched: gate and up
//   n_ff_exp rows of n_embd, down n_embd rows of n_ff_exp), so slot s of gate starts at
//   gate_base + s * gate_expert_bytes;
// - the expert->slot table, int32 [n_expert] in device memory (a slot index, or -1), read by the
//   kernels when they run, so captured CUDA graphs stay valid when it changes; and its host
//   mirror, int32 [n_expert] in page-locked memory, which the CPU side reads.
// Each split step (scheduler/schedule.h, step 1) computes the experts the table marks resident
// on the device from the slots and the others on the CPU; the two tables are equal for the whole
// of a step.
//
// Swaps happen only between steps (between_steps(), called by the Scheduler before a step is
// enqueued, while nothing but kCopy work may be in flight):
// (a) copies that have landed (Device::done on their event) are committed: table[e_in] = slot,
//     host mirror and device table;
// (b) the policy's wanted experts that are neither resident nor in flight replace, at most S per
//     layer, a free slot or one whose expert the policy no longer wants: table[e_out] is cleared
//     first (so this step neither computes e_out on the device nor reads the slot), then e_in's
//     gate, up and down slices are copied from the pinned host copy into the slot on kCopy and an
//     event is recorded; e_in computes on the CPU until its copy is committed at a later
//     boundary, so a step never waits for an upload;
// (c) when a table changed, the host mirror is copied to the device table on kMain, ahead of the
//     step's kernels (outside any captured region: replayed graphs read the new table).
// Slots are allocated once, at construction: the device bytes never change afterwards, so the
// plan's budget (placement/plan.h, --residency adaptive) holds at every moment.
//
// Counts (stats()): routed calls of the layers with slots as their CPU op saw them (each
// (token, route slot) pair of a step where the layer was split: decode and prefill steps that do
// not stream the whole layer), and how many of those had their expert slot-resident at that
// step; swaps started, bytes copied into slots.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "berth/backends/cpu_executor.h"
#include "berth/backends/device.h"
#include "berth/graph/graph.h"
#include "berth/residency/cache_sim.h"
#include "berth/residency/routing_trace.h"

namespace berth {

/// Which experts the slots of each layer should hold: fed with the routing of past steps only,
/// asked between steps.
class SlotPolicy {
 public:
  virtual ~SlotPolicy() = default;
  virtual std::string name() const = 0;
  /// Starts over for `n_layer` layers with slots (0.. in graph order) of `n_expert` experts and
  /// `capacity` slots each.
  virtual void reset(int32_t n_layer, int32_t n_expert, int32_t capacity) = 0;
  /// One token's expert ids at `layer` (n_expert_used of them, top-k order) from a step that ran.
  virtual void observe(int32_t layer, std::span<const uint16_t> ids) = 0;
  /// A step boundary: called once before the boundary's target() calls.
  virtual void next_step() {}
  /// Called before reset() with the model layer (GGUF blk.N) of each layer with slots, in the
  /// order reset() counts them. A policy that knows experts by model layer (FrequencySlotPolicy)
  /// keeps them; the others ignore it.
  virtual void set_blocks(std::span<const int32_t> /*blocks*/) {}
  /// The experts `layer`'s slots should hold now (distinct, < n_expert, at most capacity), the
  /// most wanted first.
  virtual std::vector<int32_t> target(int32_t layer) = 0;
  /// After reset(): the experts `layer`'s `capacity` slots hold when they are made, slot s the
  /// s-th (capacity distinct ids < n_expert). The default: experts 0..capacity-1.
  virtual std::vector<int32_t> seed(int32_t layer, int32_t capacity);
  /// Whether the slots' experts change while running (false: the seed stays, as
  /// FrequencySlotPolicy's does).
  virtual bool moves() const { return true; }
};

/// The experts each layer's slots start with, in slot order: policy.set_blocks(blocks),
/// policy.reset(blocks.size(), n_expert, capacity), then policy.seed() per layer. ExpertSlots
/// loads these at construction and `berth plan` prints them (runtime's place() fills
/// placement::Plan::slot_seed with it). Throws what the policy's reset() throws;
/// Error(internal) for a seed that is not `capacity` distinct ids < n_expert.
std::vector<std::vector<int32_t>> seed_slots(SlotPolicy& policy, std::span<const int32_t> blocks,
                                             int32_t n_expert, int32_t capacity);

/// A routing-trace cache policy (residency/cache_sim.h: LruPolicy, LfuDecayPolicy) as a slot
/// policy: observe() is its update(), target() its resident set (ascending ids).
class CacheSlotPolicy final : public SlotPolicy {
 public:
  explicit CacheSlotPolicy(std::unique_ptr<residency::ExpertCachePolicy> p);
  std::string name() const override { return p_->name(); }
  void reset(int32_t n_layer, int32_t n_expert, int32_t capacity) override;
  void observe(int32_t layer, std::span<const uint16_t> ids) override;
  std::vector<int32_t> target(int32_t layer) override;

 private:
  std::unique_ptr<residency::ExpertCachePolicy> p_;
  int32_t n_expert_ = 0;
};

/// For tests: ignores routing and moves every slot at every boundary. At boundary b (from 0),
/// layer l wants experts (b * shift + l + i) mod n_expert for i < capacity: with shift >=
/// capacity and n_expert >= 2 * capacity, no expert stays, so each boundary swaps up to S per
/// layer.
class RotatingSlotPolicy final : public SlotPolicy {
 public:
  explicit RotatingSlotPolicy(int32_t shift) : shift_(shift) {}
  std::string name() const override { return "rotating"; }
  void reset(int32_t n_layer, int32_t n_expert, int32_t capacity) override;
  void observe(int32_t, std::span<const uint16_t>) override {}
  void next_step() override { ++boundary_; }
  std::vector<int32_t> target(int32_t layer) override;

 private:
  int32_t shift_ = 1, n_expert_ = 0, capacity_ = 0;
  int64_t boundary_ = -1;
};

/// The frequency-static baseline: each layer's slots hold the experts a calibration trace called
/// most (ties: the lower id), loaded when the slots are made (seed()) and fixed for the whole
/// run; routing is ignored. Throws Error(invalid_argument) from set_blocks()/reset() when
/// the trace does not record a layer with slots or has another n_expert.
class FrequencySlotPolicy final : public SlotPolicy {
 public:
  /// `name`: the trace's file, for messages.
  FrequencySlotPolicy(const residency::RoutingTrace& calibration, std::string name);
  std::string name() const override { return "frequency(" + name_ + ")"; }
  void set_blocks(std::span<const int32_t> blocks) override;
  void reset(int32_t n_layer, int32_t n_expert, int32_t capacity) override;
  void observe(int32_t, std::span<const uint16_t>) override {}
  std::vector<int32_t> target(int32_t layer) override;
  std::vector<int32_t> seed(int32_t layer, int32_t) override { return target(layer); }
  bool moves() const override { return false; }

 private:
  std::string name_;
  int32_t trace_n_expert_ = 0;
  std::vector<int32_t> trace_blocks_;
  std::vector<std::vector<int64_t>> counts_;  // [trace layer][expert]: calls
  std::vector<int32_t> blocks_;               // per layer with slots: its model layer
  std::vector<std::vector<int32_t>> want_;    // per layer with slots
};

/// The default slot policy's LFU half-life (tokens) and margin (residency::LfuDecayPolicy).
inline constexpr double kDefaultHalfLife = 64.0;
inline constexpr double kDefaultMargin = 3.0;

/// The default slot policy: LFU with decay, half-life 64 tokens, margin 3 (docs/residency.md: on
/// the locality trace within 1-2 points of the best hit rate at a twentieth of the loads; on the
/// uniform trace no swaps after the slots fill).
std::unique_ptr<SlotPolicy> default_slot_policy();

/// A policy by name (`--residency-policy`): "lfu-decay" (the default: half-life 64 tokens,
/// margin 3), "lfu-decay:H" (H tokens, > 0, margin 3), "lfu-decay:H:Z" (margin Z >= 0; 0: swap on
/// any excess), "lru", or "frequency:TRACE" (FrequencySlotPolicy of the routing trace file
/// TRACE). Throws Error(invalid_argument) naming the accepted forms for another name, the trace
/// reader's errors for a bad file.
std::shared_ptr<SlotPolicy> make_slot_policy(const std::string& spec);

struct ExpertSlotsOptions {
  int32_t slots_per_layer = 0;     ///< C, 1..n_expert - 1
  int32_t max_swaps_per_step = 4;  ///< S: swaps started per layer per boundary (>= 1)
  /// Null: default_slot_policy().
  std::shared_ptr<SlotPolicy> policy;
  /// Per model layer: whether it may have slots (placement::Plan::layer_slots > 0); empty: every
  /// layer whose experts are CPU-held and pinned.
  std::vector<bool> layers;
};

/// One layer with slots: its stacked expert tensors (CPU-held, pinned).
struct SlotLayer {
  graph::WeightId gate = graph::kNoWeight, up = graph::kNoWeight, down = graph::kNoWeight;
  int32_t n_expert = 0, n_expert_used = 0;
};

class ExpertSlots {
 public:
  struct Stats {
    int64_t swaps = 0;         ///< copies into slots started
    int64_t commits = 0;       ///< copies committed to the tables
    int64_t late = 0;          ///< boundaries at which a copy was still in flight (per copy)
    int64_t bytes_moved = 0;   ///< bytes copied into slots
    int64_t calls = 0;         ///< routed calls of the layers with slots (see file comment)
    int64_t device_calls = 0;  ///< of those, whose expert was slot-resident at that step
    int64_t boundaries = 0;    ///< between_steps() calls
    int64_t seated = 0;        ///< of the swaps, started at a boundary after a streamed prefill
  };

  /// Allocates options.slots_per_layer slots per layer of `layers` on `dev` and their tables,
  /// and fills them with the policy's seed (seed_slots: by default slot s holds expert s;
  /// synchronously). `pinned(id)` gives each
  /// tensor's page-locked host memory. Throws Error(invalid_argument) for C outside
  /// [1, n_expert), S < 1, a layer without pinned tensors or of a shape unlike the table's; the
  /// device's Error(out_of_memory).
  ExpertSlots(Device& dev, const graph::WeightTable& weights, std::vector<SlotLayer> layers,
              const std::vector<const void*>& pinned, ExpertSlotsOptions options);
  ~ExpertSlots();
  ExpertSlots(const ExpertSlots&) = delete;
  ExpertSlots& operator=(const ExpertSlots&) = delete;

  /// Device bytes that `c` slots per layer of `layers` take (slots and tables).
  static size_t device_bytes(const graph::WeightTable& weights, std::span<const SlotLayer> layers,
                             int32_t c);

  int32_t n_layers() const { return static_cast<int32_t>(layers_.size()); }
  int32_t capacity() const { return opt_.slots_per_layer; }
  const SlotLayer& layer(int32_t l) const { return layers_.at(static_cast<size_t>(l)).ids; }
  /// The layer whose ffn_gate_exps is `gate`, or -1.
  int32_t layer_of(graph::WeightId gate) const;
  /// Layer l's device table (int32 [n_expert]) and slot arrays (gate, up, down bases).
  const int32_t* device_table(int32_t l) const { return at(l).dev_table; }
  std::array<const void*, 3> slot_bases(int32_t l) const;
  /// Layer l's host mirror (int32 [n_expert]); equal to the device table while a step runs.
  const int32_t* host_table(int32_t l) const { return at(l).host_table; }
  /// What the CPU executor needs for layer l (CpuExecutor::bind_expert_table).
  CpuExecutor::ExpertTable cpu_binding(int32_t l);
  /// Per slot of layer l: the committed expert, or -1 (free or loading).
  std::vector<int32_t> slot_experts(int32_t l) const;
  /// Device bytes held (slots and tables).
  size_t device_bytes() const { return device_bytes_; }

  /// The protocol's steps (a)-(c) of the file comment. Call between steps only: after the
  /// previous step's main and aux work completed, before anything of the next is enqueued.
  void between_steps();
  /// Prompt-time seating: layer l ran the step's `n_tokens` tokens with all its experts
  /// streamed to the device (a prefill ubatch; its CPU op did not run, so nothing was logged),
  /// and `route` is that step's moe_route output, [n_tokens][2 * n_expert_used] in host memory
  /// (ids as exact floats). The policy observes these tokens at the next boundary, which may
  /// then start up to C swaps in the layer instead of S, so that decode starts with the prompt's
  /// hottest experts in the slots (their copies overlap the first decode steps, which compute
  /// them on the CPU until they land). Not counted in calls (the stream served them).
  void observe_prefill(int32_t l, const float* route, int64_t n_tokens);
  /// The counts so far (the last step's routed calls included).
  Stats stats() const;
  /// The share of routed calls served from slots, device_calls / calls (0 without calls).
  double device_share() const;
  /// "residency: <N> swaps, <P>% of routed expert calls on the device, <M> MiB moved" (stats():
  /// swaps started; P = 100 x device_share(), one decimal; M = bytes copied into slots / 2^20).
  std::string summary() const;
  const SlotPolicy& policy() const { return *opt_.policy; }

 private:
  struct Pending {
    int32_t slot, expert, event;
  };
  struct Layer {
    SlotLayer ids;
    size_t bytes[3] = {0, 0, 0};  // one expert's gate, up, down
    const uint8_t* pinned[3] = {nullptr, nullptr, nullptr};
    uint8_t* slots = nullptr;  // device: [C gate | C up | C down]
    int32_t* dev_table = nullptr;
    int32_t* host_table = nullptr;     // page-locked
    std::vector<int32_t> slot_expert;  // committed expert per slot, or -1
    std::vector<int32_t> loading;      // expert being copied into each slot, or -1
    std::vector<Pending> pending;
    std::vector<uint16_t> route_log;
    int64_t calls = 0, device_calls = 0;
    bool seat = false;  // a streamed prefill's routing arrived: the next boundary may fill all
  };
  const Layer& at(int32_t l) const { return layers_.at(static_cast<size_t>(l)); }
  void start_copy(Layer& L, int32_t slot, int32_t expert);
  void release();

  Device& dev_;
  ExpertSlotsOptions opt_;
  std::vector<Layer> layers_;
  std::vector<int32_t> layer_of_gate_;  // per WeightId
  size_t device_bytes_ = 0;
  Stats stats_;
};

}  // namespace berth
