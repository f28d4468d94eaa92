// Private to the backends: the fusion pass over a step's device calls (Device::prepare). The CUDA
// device does each fused call in one launch; the simulated device does its parts one after the
// other (the same bits), so CI runs the fused calls' hand-off paths.
#pragma once

#include <vector>

#include "berth/backends/call.h"

namespace berth {

/// `calls` with neighbouring calls replaced by the fused kinds of CallKind where the rules allow
/// (each fused call gives the bits of the calls it replaces): matmul_group, add_norm,
/// wait_add_norm, norm_rope, route_fork and router_route_fork (flag hand-off only),
/// attention_q8, swiglu_matmul.
std::vector<Call> fuse_calls(const StepView& view, std::vector<Call> calls);

}  // namespace berth
