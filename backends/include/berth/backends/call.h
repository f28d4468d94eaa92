// What the scheduler asks a device to do: the device's share of a step as a list of calls in
// enqueue order (scheduler/schedule.h builds it), each one or a few ops of the step graph or a
// hand-off with a CPU segment, and the memory the calls run on (StepBindings). A device may fuse
// neighbouring calls into one launch (Device::prepare) when the results are the same bits.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "berth/graph/graph.h"

namespace berth {

enum class CallKind : uint8_t {
  /// ops[0]: one op of the graph.
  op,
  /// Hand-off to CPU segment `seg`: `send` (device values the segment reads) are copied to their
  /// page-locked host buffers, then the segment may start (flag hand-off: the device writes the
  /// segment's ready flag; callback hand-off: the aux stream runs it as a host function); then,
  /// unless `in_place`, the aux stream waits for the segment and copies `recv` (the segment's
  /// outputs that device ops read) to their device buffers.
  fork,
  /// The main stream waits for everything on the aux stream: every forked segment so far is done
  /// and its `recv` values are on the device.
  join,
  /// Flag hand-off, segment `seg` forked with in_place: the main stream waits for its done flag;
  /// device ops then read its output (recv[0]) from the page-locked host buffer, where
  /// StepBindings::value points for it.
  wait_segment,
  /// Before the step: `recv` (outputs of segments that ran on the calling thread before the
  /// step, e.g. embed with token_embd on the CPU) are copied to the device on the main stream.
  upload,
  /// The step's output (the graph's output value) is copied to its page-locked host buffer.
  output,
  /// Greedy selection: the argmax of the output's last row (ties: lowest id) into the selected
  /// token's device word, then copied to its host word. Only the id travels.
  select,
  // Fused calls (Device::prepare makes them; each gives the bits of the calls it replaces):
  /// ops: consecutive matmuls of one input (a layer's Q, K, V): the input quantized once.
  matmul_group,
  /// ops[0] a residual add, ops[1] the whole-row rms_norm of its result.
  add_norm,
  /// ops: one or two per-head rms_norms, ropes: the rope of each (same order), which then
  /// needs no call of its own.
  norm_rope,
  /// ops[0] a single-token moe_route whose fork follows (seg, send, recv, in_place as fork):
  /// the route, the copies and the ready flag in one launch.
  route_fork,
  /// ops[0] the router's matmul (float weights), ops[1] the moe_route reading it, then the
  /// fork of `seg`: one launch.
  router_route_fork,
  /// wait_segment of `seg`, then ops[0] (an add reading the segment's output in place) and
  /// ops[1] (the whole-row norm of its result): one launch.
  wait_add_norm,
  /// ops[0] single-token attention that also leaves its output's 8-bit blocks in the
  /// workspace, ops[1] the matmul reading that output (which then skips quantizing it).
  attention_q8,
  /// ops[0] a single-token swiglu whose only reader is ops[1], a matmul with quantized weights:
  /// the swiglu's 8-bit blocks made from gate and up directly, its f32 output never written.
  swiglu_matmul,
};

std::string_view call_kind_name(CallKind k);

/// One device operation of a step (see CallKind). Plain data: the schedule prints it and the
/// device enqueues it.
struct Call {
  CallKind kind = CallKind::op;
  std::vector<int32_t> ops;    ///< ops of the step graph computed by this call, in order
  std::vector<int32_t> ropes;  ///< norm_rope: the rope of each norm in ops
  int32_t seg = -1;            ///< fork, wait_segment, route_fork, ...: the CPU segment
  std::vector<graph::ValueId> send, recv;  ///< fork: values copied to / from the host
  bool in_place = false;  ///< fork: the segment's output is read in place (no recv copy)
  /// moe_experts: CPU-held experts streamed through a stage buffer (prefill), or read from
  /// page-locked host memory (the decode share).
  bool streamed = false, host_w = false;
  size_t ws_bytes = 0;  ///< workspace the call needs on the device (Device::prepare)
};

/// The step graph and its weights' types and shapes, for a device planning calls.
struct StepView {
  const graph::Graph* g = nullptr;
  const graph::WeightTable* weights = nullptr;  ///< types and shapes (data: host copies)
  int64_t n_ctx = 0;                            ///< positions the KV cache holds
  bool flags = false;  ///< the step hands over by flags (forks may fuse with their neighbours)
};

/// Where the memory of a step is, for Device::enqueue. Device pointers are device memory (from
/// Device::alloc) or page-locked host memory the device can read.
struct StepBindings {
  StepView view;
  /// Per WeightId: the device's copy, or null (not on the device).
  std::vector<const void*> weight;
  /// Per op (moe_experts): the gate, up and down tensors to read instead of `weight` (a stage
  /// buffer of streamed experts, or their page-locked host memory), or nulls.
  std::vector<std::array<const void*, 3>> moe_w;
  /// Per op (moe_experts on the device over a static expert set): the expert mask (n_expert
  /// bytes, 1 = computed here), or null.
  std::vector<const uint8_t*> mask;
  /// Per op (moe_experts over ExpertSet::resident): the layer's expert->slot table in device
  /// memory (int32 [n_expert], MoeSlots::table); moe_w then points at the slot arrays. Null
  /// otherwise.
  std::vector<const int32_t*> slot_table;
  /// Per op (moe_route), when the routing is forced (a routing trace replayed; Scheduler::
  /// set_routing): the experts to select, int32 [rows][n_expert_used] in device memory (token t's
  /// slot j at [t * k + j]), each distinct per token and < n_expert; the route's weights are the
  /// router's for those experts (cpu::moe_forced's arithmetic). Empty, or null for an op: the
  /// router selects.
  std::vector<const int32_t*> forced_route;
  /// Per value: where device ops read and write it (null: never on the device), and its
  /// page-locked host buffer (null: it does not cross).
  std::vector<float*> value, host;
  /// Per layer: the f16 KV cache on the device ([n_ctx, k_dim] and [n_ctx, v_dim]), or null.
  std::vector<uint16_t*> k_cache, v_cache;
  /// Per layer: the f32 recurrent state on the device (KvView::dev_conv / dev_ssm: sequence s's
  /// conv state at conv_state[l] + s * conv_dim, its delta-rule state at ssm_state[l] + s *
  /// ssm_dim), or null.
  std::vector<float*> conv_state, ssm_state;
  const int32_t* tokens = nullptr;     ///< device copy of the ubatch's token ids
  const int32_t* positions = nullptr;  ///< device copy of their positions
  /// Device copy of their sequence ids (DeviceInfo::multi_seq devices read it): token t's KV row
  /// is seqs[t] * view.n_ctx + positions[t]. Null: every token is sequence 0.
  const int32_t* seqs = nullptr;
  void* ws = nullptr;  ///< workspace, ws_bytes long
  size_t ws_bytes = 0;
  /// Flag hand-off: per CPU segment two words of page-locked host memory (ready, done).
  uint32_t* flags = nullptr;
  /// Callback hand-off: run_segment(segment_arg[s]) runs CPU segment s on a host thread.
  void (*run_segment)(void*) = nullptr;
  std::vector<void*> segment_arg;
  int32_t* selected_dev = nullptr;   ///< select: each output row's token id on the device
  int32_t* selected_host = nullptr;  ///< select: and their page-locked host copy (rows ids)
};

}  // namespace berth
