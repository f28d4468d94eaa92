// Routing traces on a session (residency/routing_trace.h, docs/routing-traces.md): replaying a
// recorded trace's expert choices (`berth bench model --routing-trace`) and recording a run's
// (`berth run --dump-routing`).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "berth/models/model.h"
#include "berth/residency/routing_trace.h"
#include "berth/runtime/session.h"

namespace berth {

/// The model layers (GGUF blk.N) of `model`'s MoE layers in increasing order: the blocks a
/// routing trace of it records. Empty for a dense model.
std::vector<int32_t> moe_blocks(const Model& model);

/// The shape of `model`'s routing traces (with weights when `weights`). Throws
/// Error(invalid_argument) for a model without MoE layers.
residency::TraceShape routing_shape(const Model& model, bool weights);

/// Hooks routing traces into `session`'s steps (Scheduler::set_routing). With `replay`, the
/// routers of every step select the trace's experts: the session's run token i (every token of
/// every step, prompt and generated, of all sequences, in the order the steps hold them) takes
/// the trace's token i mod n_tokens (RoutingReplay::ids); the weights stay the router's for those
/// experts, so only the picks change (the experts' arithmetic is the same). With `writer`,
/// every step's routes (ids and weights) are appended: a step's prompt rows as prefill tokens,
/// its decode rows (graph::Graph::decode_rows; a one-token step is a decode step) as decode
/// tokens, in step order. Both may be given (the writer then records the forced routes). Call
/// before the session's first step. Throws Error(invalid_argument) for a model without MoE
/// layers, a writer of another shape, or a session that already ran a step; the replay's shape
/// was checked when it was made (RoutingReplay).
void attach_routing(Session& session, const Model& model,
                    std::shared_ptr<const residency::RoutingReplay> replay,
                    std::shared_ptr<residency::RoutingTraceWriter> writer);

}  // namespace berth
