// The schedule of a step: which side runs each op of the step graph and why, how the CPU's ops
// group into segments that run while the device works, what crosses between the sides, and the
// device's calls in enqueue order. A plain value: partition() allocates nothing and needs no
// device, so `berth plan --ops` prints exactly what the Scheduler (scheduler.h) runs, and tests
// check schedules without a GPU. (The idea of cutting the graph by where weights live and
// recording the cause of each decision follows ggml's ggml_backend_sched_split_graph; the
// concurrency of the two sides is berth's own.)
//
// How a step is cut (partition):
// 1. Expert slots and the decode share. A moe_experts op of a layer with expert slots
//    (capabilities.slotted: residency/expert_slots.h) becomes the device's op over the experts
//    the layer's slot table marks resident (ExpertSet::resident, reading the slots), the CPU's op
//    over the others (ExpertSet::not_resident, reading the table's host mirror) and an add
//    (device part first, as below); except in a step that streams CPU-held experts (>= N tokens,
//    more than one), which keeps the whole op and may stream it (step 2). The decode share
//    (options.host_expert_share f > 0, single-token steps): each moe_experts op whose experts stay
//    on the CPU, pinned (capabilities.pinned), with the norm before it on the device, becomes the
//    CPU's op over the first slots of each token's route, the device's op over the last round((c +
//    1) f k) - round(c f k) slots (the c-th such layer, k its slots: f k = 1.5 alternates 2 and 1),
//    reading the experts from page-locked host memory, and an add. Ops over disjoint slot ranges
//    (or expert sets) add up to the layer (the graph's contract). Layers with expert slots take no
//    share. With options.stream_split, in a step that streams and is not batch-invariant, the
//    moe_experts op of a CPU-held, pinned layer without slots whose norm is on the device
//    becomes, the same way, the device's op over the experts its step table gives a slot of the
//    stage buffer (ExpertSet::resident, streamed in step 2) and the CPU's over the others
//    (ExpertSet::not_resident): which experts each takes is chosen per step (stream_split.h).
// 2. Sides: an op with a weight runs where the weight lives (moe_experts: where its expert
//    tensors live; they must live together), attention where its layer's KV cache lives; with
//    streaming (options.stream_experts_min_tokens N > 0), a moe_experts op of CPU-held, pinned
//    experts in a step of >= N tokens (and more than one) that is not batch-invariant (a step
//    of several sequences never streams: its rows' experts would be computed on the device or
//    the CPU by the step's size) whose input is on the device runs on the device, its experts
//    streamed; any other op on the device when one of its inputs was
//    produced there, else on the CPU. An op the device does not support (capabilities.supports)
//    runs on the CPU.
// 3. CPU segments: runs of consecutive CPU ops. Each forks after the last device op producing
//    one of its inputs (never before the previous segment's fork: the aux stream is in order);
//    its device-produced inputs are copied to the host at the fork, its outputs that device ops
//    read are copied back after it. A segment that reads nothing from the device runs on the
//    calling thread before the step (its outputs are uploaded first).
// 4. In-place joins (flag hand-off): when the one output of a segment that device ops read is
//    small (<= 64 KiB) and read by one device op, a residual add whose result only the whole-row
//    norm right after it reads (no fork between), that add waits for the segment's done flag and
//    reads the output from its page-locked buffer: no copy and no wait between the streams.
// 5. The device's calls: its ops in graph order, a fork after the op each segment waits for, a
//    join before the first device op reading a value a forked segment writes (the main stream
//    waits for the aux stream), a wait_segment before an in-place join's add, then the output
//    (or, for greedy selection, select). A device may fuse neighbouring calls (Device::prepare).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "berth/backends/call.h"
#include "berth/graph/graph.h"
#include "berth/placement/plan.h"

namespace berth {

enum class Side : uint8_t { cpu, device };
std::string_view side_name(Side s);  ///< "CPU" / "GPU"

/// Why an op runs on its side.
enum class Cause : uint8_t {
  no_device,       ///< CPU: the step has no device
  weight,          ///< its weight lives there
  expert_weights,  ///< moe_experts: its expert tensors live there
  kv_cache,      ///< attention, ssm_conv, gated_delta: its layer's KV cache / recurrent state lives
                 ///< there
  streamed,      ///< device: CPU-held experts streamed to it (a prefill step of >= N tokens)
  host_share,    ///< device: its slots of CPU-held experts, read from page-locked host memory
  expert_slots,  ///< device: the layer's slot-resident experts, read from the expert slots
  not_resident,  ///< CPU: the layer's experts not in its expert slots
  stream_cpu,    ///< CPU: a streamed layer's experts the split leaves to the CPU this step
  device_input,  ///< weightless: an input was produced on the device
  host_inputs,   ///< weightless: every input (if any) was produced on the CPU
  unsupported,   ///< CPU: the device cannot run this op
};
std::string_view cause_name(Cause c);

/// How a CPU segment and the device's streams hand over (see Scheduler).
enum class Handoff : uint8_t {
  automatic,  ///< flags when the device supports them, else callback
  callback,   ///< the aux stream runs the segment as a host callback (cudaLaunchHostFunc)
  /// The device writes a "ready" flag in page-locked memory and waits for a "done" flag
  /// (cuStreamWriteValue32 / cuStreamWaitValue32); the thread that runs the step polls the
  /// ready flags in order, runs each segment and writes its done flag.
  flags,
};
std::string_view handoff_name(Handoff h);

/// What the device (if any) can do, as the schedule needs it.
struct Capabilities {
  bool has_device = false;
  std::string device_name;  ///< for reports, e.g. "CUDA0 (NVIDIA H200)"
  bool flags = false;       ///< Handoff::flags works (Device::supports_flags)
  /// Whether the device runs `op` (null: every op).
  std::function<bool(const graph::Op&)> supports;
  /// Per WeightId: page-locked host memory the device can read holds this CPU-held tensor
  /// (Residency::pinned); empty: none.
  std::vector<bool> pinned;
  /// Per WeightId: this ffn_gate_exps's layer has expert slots, C of them (0: none); empty: no
  /// layer has.
  std::vector<int32_t> slotted;
};

struct ScheduleOptions {
  Handoff handoff = Handoff::automatic;
  int32_t stream_experts_min_tokens = 0;  ///< 0: never stream CPU-held experts
  double host_expert_share = 0;           ///< the decode share, 0..1 (0: off)
  /// Streamed layers split between the stage buffer and the CPU (stream_split.h, step 1).
  bool stream_split = false;
  bool select = false;   ///< end with greedy selection on the device (when it makes the logits)
  bool profile = false;  ///< ops timed one by one: no in-place joins (and no fusion)
};

struct CpuSegment {
  std::vector<int32_t> ops;  ///< ops of the schedule's graph, ascending
  int32_t fork_after = -1;   ///< the device op after which it may start (-1: before the step)
  std::vector<graph::ValueId> inputs;   ///< device-produced values it reads (copied down)
  std::vector<graph::ValueId> outputs;  ///< its values that device ops read (copied up)
  bool in_place = false;                ///< outputs[0] is read in place by one device add (step 4)
};

struct Schedule {
  /// The step graph as it runs (the model's, after the decode share's split) and, per op of the
  /// model's graph, its op here.
  graph::Graph g;
  std::vector<int32_t> orig_index;
  int32_t n_model_ops = 0;
  bool has_device = false;
  std::string device_name;
  Handoff handoff = Handoff::callback;  ///< resolved (meaningless without a device)
  std::vector<Side> op_side;
  std::vector<Cause> op_cause;
  std::vector<Side> value_side;   ///< where each value is produced
  std::vector<uint8_t> streamed;  ///< per op: CPU-held experts streamed to the device
  std::vector<uint8_t> host_w;    ///< per op: device op reading experts from host memory
  std::vector<uint8_t> slotted;   ///< per op: the device or CPU part of a layer with slots
  /// per op: the device or CPU part of a streamed layer split by the table of its step
  std::vector<uint8_t> stream_split;
  std::vector<CpuSegment> segments;
  /// The device's calls in enqueue order (empty without a device). Fused by the device where
  /// it can when made by make_schedule with a device.
  std::vector<Call> calls;
  bool select = false;  ///< calls end with select (the device makes the logits)

  /// Bytes a step copies device -> host and host -> device (segment inputs and outputs, the
  /// output or the selected id excluded); an in-place output counts as read by the device.
  size_t bytes_to_host() const;
  size_t bytes_to_device() const;
  /// The side of op i of the model's graph: of the op that makes its output here (for an op the
  /// decode share split, the add of its two parts).
  Side model_op_side(size_t i) const { return op_side.at(static_cast<size_t>(orig_index.at(i))); }
};

/// Per op of the step graph `g`: how many route slots the decode share `f` gives the device (0:
/// none, the op is not split; the op's k: the device computes it all), as partition() splits a
/// single-token step. Candidates are moe_experts ops whose gate, up and down tensors are stacked
/// (n_expert > 1) and CPU-held (`weight_home`, per WeightId) and whose input comes from an op
/// with a device-held weight; the c-th candidate takes round((c + 1) f k) - round(c f k) of its
/// k slots. All zeros for f <= 0 or, unless `any_tokens`, a multi-token graph. (partition also
/// needs them pinned; it finds the streamed layers to split as the candidates at f = 1.)
std::vector<int32_t> host_share_device_slots(const graph::Graph& g,
                                             const std::vector<placement::Home>& weight_home,
                                             double f, bool any_tokens = false);

/// The schedule of `g` (see the file comment). `weight_home`: one per WeightTable entry;
/// `kv_home`: one per layer of the KV cache. Throws Error(invalid_argument) when the homes do
/// not match the table, when a moe_experts op's gate, up and down tensors live on different
/// sides (naming them), or when an attention op's KV cache is on the device but the device
/// cannot run attention; Error(unsupported) for Handoff::flags on a device without flags.
Schedule partition(const graph::Graph& g, const graph::WeightTable& weights,
                   const std::vector<placement::Home>& weight_home,
                   const std::vector<placement::Home>& kv_home, const Capabilities& caps,
                   const ScheduleOptions& options);

/// The schedule as a table for people: per op its side, kind, name and cause; the forks, joins
/// and crossings (value, bytes) where they happen; the device's calls (fused ones named); a
/// summary line. `title` heads it (e.g. "decode step: 1 token").
std::string schedule_text(const Schedule& s, const graph::WeightTable& weights,
                          std::string_view title);
/// The same as JSON: {"title", "n_tokens", "device", "handoff", "ops": [{"index", "name", "kind",
/// "side", "cause"}...], "segments": [{"ops": [...], "fork_after", "inputs": [{"name",
/// "bytes"}...], "outputs": [...], "in_place"}...], "calls": [{"kind", "ops": [...],
/// "segment"}...], "bytes_to_host", "bytes_to_device"}.
std::string schedule_json(const Schedule& s, const graph::WeightTable& weights,
                          std::string_view title);

}  // namespace berth
