// The memory of a step: which values get a device buffer (one arena, offsets by liveness in the
// order the device's calls are enqueued), which a page-locked host buffer (values that cross
// between the sides), which plain host memory (values only CPU ops touch), and the largest
// workspace and stage a call needs. Computed from the Schedule alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "berth/backends/device.h"
#include "berth/graph/arena.h"
#include "berth/graph/graph.h"
#include "berth/scheduler/schedule.h"

namespace berth {

struct MemoryPlan {
  std::vector<uint8_t> on_device;   ///< per value: a buffer in the device arena
  std::vector<size_t> offset;       ///< per value: its offset in the arena (256-byte aligned)
  std::vector<uint8_t> pinned;      ///< per value: a page-locked host buffer (it crosses)
  std::vector<uint8_t> host;        ///< per value: in the host arena (CPU ops only touch it)
  std::vector<size_t> host_offset;  ///< per host value: its offset in the host arena
  size_t arena_bytes = 0;
  size_t ws_bytes = 0;     ///< the largest call's workspace (Call::ws_bytes)
  size_t stage_bytes = 0;  ///< the largest streamed layer's gate + up + down bytes
  /// The host arena: the values only CPU ops touch, a value's bytes reused once its last CPU
  /// reader has run (the CPU segments run one after another, in order); each moe_route output
  /// and the graph's output live to the end of the step.
  size_t host_arena_bytes = 0;
  size_t pinned_bytes = 0;  ///< the page-locked values' bytes (one buffer each)
  size_t host_bytes = 0;    ///< host memory of the step: pinned_bytes + host_arena_bytes
};

/// Offsets in one arena for buffers of known lifetimes (graph/arena.h).
using graph::assign_offsets;

/// The memory plan of schedule `s` (with a device; its calls' ws_bytes already set). A value
/// lives on the device from the call that writes it (its producing call, or the fork or upload
/// that copies it there) to the last call that reads it; the graph's output, and the device
/// values in `keep` (e.g. routes recorded after the step), to the end.
MemoryPlan plan_memory(const Schedule& s, const graph::WeightTable& weights,
                       std::span<const graph::ValueId> keep = {});

/// Device bytes the scheduler needs besides weights and KV cache for steps of the shape of `g`
/// (the step graph of a full ubatch, as a model builds it) with a context of `n_ctx`: the peak
/// of live activations of the all-GPU step plus the largest kernel workspace (asked from `dev`
/// when given, else estimated: 64 MiB + 8 bytes per input element), rounded up to MiB. An
/// estimate from shapes alone, used by placement before loading.
size_t device_scratch_bytes(const graph::Graph& g, const graph::WeightTable& weights, int64_t n_ctx,
                            Device* dev = nullptr);

}  // namespace berth
