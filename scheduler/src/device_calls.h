// Private: a step's calls on the device through the Device's kernel methods (the fusions'
// launches, the hand-off's copies and flags). Moves into the backends with the backend
// interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "berth/backends/call.h"
#include "berth/backends/device.h"

namespace berth {

/// Workspace op `op` of `g` needs on `dev` (`host_w`: a moe_experts op reading its weights from
/// page-locked host memory, staged into the workspace).
size_t op_workspace_bytes(Device& dev, const graph::Graph& g, const graph::WeightTable& w,
                          const graph::Op& op, int64_t n_ctx, bool host_w);

/// `calls` fused (when `fuse`: fuse_calls) with each call's ws_bytes set.
std::vector<Call> prepare_calls(Device& dev, const StepView& view, std::vector<Call> calls,
                                bool fuse);

/// Enqueues `c` on `dev`: its work on the main stream, a fork's return on the aux stream.
void enqueue_call(Device& dev, const Call& c, const StepBindings& b);

}  // namespace berth
