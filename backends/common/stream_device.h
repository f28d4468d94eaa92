// Private to the backends: what the CUDA and the simulated device share. A device with streams
// implements a few stream primitives (host callbacks, flags in page-locked memory) and its ops;
// this base turns the hand-off calls of a step (fork, join, wait_segment, upload, output) into
// those primitives, the same way for both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "berth/backends/device.h"
#include "berth/core/tensor.h"

namespace berth::backend_detail {

class StreamDevice : public Device {
 public:
  std::vector<Call> prepare(const StepView& view, std::vector<Call> calls,
                            bool fuse) const override;

 protected:
  /// Runs fn(arg) on a host thread once the work before it in stream `s` is done; later work in
  /// `s` waits for it to return. fn must not call the device.
  virtual void host_fn(int s, void (*fn)(void*), void* arg) = 0;
  /// When the work before it in `s` is done, stores `value` to *flag (visible to host threads).
  virtual void write_flag(int s, uint32_t* flag, uint32_t value) = 0;
  /// Work enqueued on `s` after this call waits until *flag >= value (written by a host thread).
  virtual void wait_flag(int s, const uint32_t* flag, uint32_t value) = 0;
  /// `copies` (device -> page-locked host) then write_flag, as one operation where the device
  /// can; the default does them one by one.
  virtual void copy_out_signal(int s, const HostCopy* copies, int n, uint32_t* flag,
                               uint32_t value);
  /// wait_flag then `copies` (page-locked host -> device), as one operation where it can.
  virtual void wait_copy_in(int s, const uint32_t* flag, uint32_t value, const HostCopy* copies,
                            int n);
  /// Workspace op `op` of the step needs (`host_w`: a moe_experts op reading its weights from
  /// page-locked host memory, staged into the workspace).
  virtual size_t op_workspace(const StepView& view, const graph::Op& op, bool host_w) const = 0;

  /// The hand-off calls: fork, join, wait_segment, upload, output. False for other kinds.
  bool enqueue_handoff(const Call& c, const StepBindings& b);
  /// A fork's part after its inputs went down and its ready flag up (signalled: a fused call
  /// did those already), or with callbacks the whole fork.
  void fork_rest(const Call& c, const StepBindings& b, bool signalled);
  /// The copies of values `vs` to their page-locked host buffers (down) or back (up).
  static std::vector<HostCopy> copies_down(const StepBindings& b,
                                           const std::vector<graph::ValueId>& vs);
  static std::vector<HostCopy> copies_up(const StepBindings& b,
                                         const std::vector<graph::ValueId>& vs);
};

/// Bytes of value `v` of `g` (f32).
size_t value_bytes(const graph::Graph& g, graph::ValueId v);

/// A moe_experts op's stacked expert tensors at `ptrs` (gate, up, down; null: no pointers).
MoeWeights moe_weights(const graph::WeightTable& w, const graph::MoeParams& p,
                       const void* const* ptrs);
/// A moe_experts op's slot range; `host_w`: its weights are page-locked host memory (staged);
/// over ExpertSet::resident, by_table with the op's n_slots and `table` (null when sizing).
MoeSlots moe_slots(const graph::Op& op, bool host_w, const int32_t* table = nullptr);
/// The slot table of op i in `b` (null when the bindings have none).
const int32_t* slot_table_of(const StepBindings& b, size_t i);
/// The forced experts of op i (a moe_route) in `b` (null: the router selects).
const int32_t* forced_route_of(const StepBindings& b, size_t i);

}  // namespace berth::backend_detail
