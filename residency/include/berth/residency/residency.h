// Residency: the mechanisms that put weights where placement decided and bring CPU-held experts
// to the device when the scheduler asks. Placement (placement/) is the policy: a home per tensor;
// this is the mechanism:
// - upload: each tensor whose home is the device gets a device copy (1-D tensors such as norm
//   scales and biases as f32, as the kernels take them); on unified memory none: the device
//   reads the weights in place (ResidencyOptions::unified);
// - page-locked CPU-held experts: the stacked expert tensors that stay on the CPU get a pinned
//   copy (or, with BERTH_REGISTER_HOST=1, their own memory registered in place) that the device
//   can read over PCIe, for streaming (prefill) and the decode share; on a host of one NUMA node
//   the CPU then reads the copy too (cpu_weights()), so host memory holds those experts once;
// - the stage: two device buffers that streamed layers' expert tensors are copied into, one
//   layer ahead of the layer that computes;
// - expert slots (expert_slots.h): with enable_expert_slots, C experts of each CPU-held MoE layer
//   on the device, swapped between steps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "berth/backends/device.h"
#include "berth/graph/graph.h"
#include "berth/placement/plan.h"
#include "berth/residency/expert_slots.h"

namespace berth {

/// Whether the CPU segments read the CPU-held experts' pinned copy (Residency::cpu_weights)
/// rather than the model's own pages: on a host of one NUMA node (numa_node_count()). The copy
/// lands on one node, so with more nodes the workers keep reading the pages they first touched.
bool copy_read_by_cpu();

/// Whether Residency gives the device an f32 copy of `w` instead of its bytes: a 1-D tensor
/// (ne[1..3] all 1: norm scales, biases) of a type other than F32, as the device kernels take them.
/// Its device bytes are then 4 * ne[0].
bool uploads_as_f32(const TensorView& w);

/// Whether Residency registers the CPU-held experts' own memory on `dev` in place
/// (BERTH_REGISTER_HOST=1 and Device::can_register_host; otherwise a pinned copy).
bool registers_host_experts(const Device& dev);

/// Device bytes for CPU-held experts brought to the device, beyond the scheduler's scratch:
/// with stream_experts_min_tokens > 0, the two stage buffers that stream a layer's expert
/// tensors (2 x the largest layer's ffn_{gate,up,down}_exps bytes); with host_expert_share f >
/// 0, the decode workspace's staged experts (ceil(f x n_expert_used) slots x the largest
/// expert's gate + up + down bytes). `g` is any step graph of the model (its moe_experts ops
/// name each layer's stacked tensors). Counted whether or not the plan leaves experts on the
/// CPU (placement plans before it knows), rounded up to MiB; 0 for a model without stacked
/// expert tensors.
size_t expert_stage_bytes(const graph::Graph& g, const graph::WeightTable& weights,
                          int32_t stream_experts_min_tokens, double host_expert_share);

struct ResidencyOptions {
  /// Give the CPU-held stacked expert tensors page-locked memory the device can read (streaming
  /// or the decode share is on).
  bool pin_host_experts = false;
  /// When their own memory is not registered in place (the default; see
  /// registers_host_experts), pin a copy of them (true) or, false (a caller with no host memory
  /// for a copy), pin nothing: host_experts_pinning() is then "" and pinned() null.
  bool copy_host_experts = true;
  /// Called while uploading weights: bytes done and total.
  std::function<void(size_t done, size_t total)> progress;
  /// Unified memory (SessionParams::unified): the device reads each weight whose home is the
  /// device where it is (device_weight() is the host pointer; 1-D non-f32 tensors get an f32
  /// host copy), nothing is allocated on the device for weights, nothing is uploaded. Without
  /// DeviceInfo::pageable_access they are copied once into page-locked host memory
  /// (Device::alloc_host), which the device reads over its bus, and the mapping's pages of them
  /// are released (madvise MADV_PAGEOUT).
  bool unified = false;
};

class Residency {
 public:
  /// Uploads every weight whose `weight_home` (one per WeightTable entry) is GPU and pins the
  /// CPU-held experts when options.pin_host_experts. `weights` and `dev` must outlive this.
  /// Throws Error(invalid_argument) when the homes do not match the table, and the device's
  /// Error(out_of_memory) (naming it, the tensor, the MiB needed and free).
  Residency(Device& dev, const graph::WeightTable& weights,
            std::vector<placement::Home> weight_home, ResidencyOptions options = {});
  ~Residency();
  Residency(const Residency&) = delete;
  Residency& operator=(const Residency&) = delete;

  Device& device() const { return dev_; }
  const std::vector<placement::Home>& weight_home() const { return home_; }
  /// Weight `id`'s device copy, or null.
  const void* device_weight(graph::WeightId id) const {
    return dev_weight_.at(static_cast<size_t>(id));
  }
  const std::vector<const void*>& device_weights() const { return dev_weight_; }
  /// The page-locked host memory of CPU-held expert tensor `id` the device can read, or null.
  const void* pinned(graph::WeightId id) const {
    return pinned_.empty() ? nullptr : pinned_.at(static_cast<size_t>(id));
  }
  /// Whether every CPU-held stacked expert tensor has page-locked memory (all or none do).
  bool host_experts_pinned() const { return pinned_copies_ || !registered_.empty(); }
  /// "registered" (their own memory page-locked in place), "copied" (a pinned copy) or "".
  std::string_view host_experts_pinning() const {
    return pinned_copies_ ? "copied" : registered_.empty() ? "" : "registered";
  }
  /// The weights the CPU reads: the model's, except that CPU-held expert tensors with a pinned
  /// copy point at the copy where copy_read_by_cpu(), so the file mapping's pages of them go
  /// unused (advised cold: the kernel reclaims them first).
  const graph::WeightTable& cpu_weights() const { return cpu_weights_; }
  /// Device bytes of the uploaded weights (0 on unified memory).
  size_t device_weight_bytes() const { return dev_weight_bytes_; }
  /// Unified memory: bytes of the weights the device reads in place (its homed tensors, 1-D
  /// ones as their f32 host copy); 0 otherwise.
  size_t in_place_weight_bytes() const { return in_place_bytes_; }
  /// Unified memory without pageable access: bytes of the page-locked host copy the device reads
  /// (its homed tensors but the 1-D ones); 0 otherwise.
  size_t host_copy_weight_bytes() const { return host_copy_bytes_; }

  /// The MoE layers of step graph `g` that can have expert slots: moe_experts ops over stacked
  /// tensors (n_expert > 1) whose gate, up and down are CPU-held with page-locked memory here
  /// (pinned()), in graph order. Empty when the experts are not pinned.
  std::vector<SlotLayer> slot_layers(const graph::Graph& g) const;
  /// Gives every layer of slot_layers(g) options.slots_per_layer expert slots
  /// (residency/expert_slots.h); nothing when it is empty or the count is 0. Call before the
  /// Scheduler is made. Throws what ExpertSlots throws (Error(out_of_memory) naming the layer).
  void enable_expert_slots(const graph::Graph& g, ExpertSlotsOptions options);
  /// The expert slots, or null.
  ExpertSlots* expert_slots() const { return slots_.get(); }

  /// Makes both stage buffers at least `bytes` long (reallocating: call between steps).
  void reserve_stage(size_t bytes);
  void* stage(int buf) const { return stage_[buf]; }
  size_t stage_bytes() const { return stage_bytes_; }
  /// Enqueues on stream `s` the copies of expert tensors gate, up and down (CPU-held, pinned)
  /// into stage buffer `buf`, one after the other.
  void stream_in(int s, graph::WeightId gate, graph::WeightId up, graph::WeightId down, int buf);
  /// Enqueues on stream `s` the copies of the experts `table` gives a slot (int32 [n_expert]:
  /// the slot, or -1 for none; slots below n_expert) into stage buffer `buf`, laid out as
  /// stream_in lays out the whole tensors (gate, up, down; slot j of each at j times its bytes per
  /// expert), so slot e = e for every e copies what stream_in copies. Consecutive experts in
  /// consecutive slots go in one copy per tensor. Returns the bytes copied.
  size_t stream_in_experts(int s, graph::WeightId gate, graph::WeightId up, graph::WeightId down,
                           int buf, std::span<const int32_t> table);

 private:
  void pin_host_experts();
  void map_in_place();
  void release();

  Device& dev_;
  const graph::WeightTable& weights_;
  std::vector<placement::Home> home_;
  ResidencyOptions opt_;
  graph::WeightTable cpu_weights_;
  std::vector<const void*> dev_weight_;  // per WeightId
  std::vector<void*> owned_;             // per WeightId: the device allocation, or null
  std::vector<void*> pinned_;            // per WeightId: page-locked CPU-held experts, or null
  std::vector<const void*> registered_;  // keys of Device::register_host ranges
  bool pinned_copies_ = false;           // pinned_ holds copies (alloc_host)
  void* stage_[2] = {nullptr, nullptr};
  size_t stage_bytes_ = 0;
  size_t dev_weight_bytes_ = 0;
  size_t in_place_bytes_ = 0;
  // Unified: the f32 copies of 1-D device-homed tensors and, without pageable access, the
  // page-locked copy of the other device-homed tensors.
  void* host_copy_ = nullptr;
  bool host_copy_pinned_ = false;  // host_copy_ came from alloc_host
  size_t host_copy_bytes_ = 0;
  std::unique_ptr<ExpertSlots> slots_;
};

}  // namespace berth
