// From a loaded model to a placement request: the tensors, the KV cache and the device scratch
// that placement::make_plan weighs against the GPU's budget.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "berth/backends/device.h"
#include "berth/models/model.h"
#include "berth/placement/plan.h"

namespace berth {

/// The placement request for `model` with a context of `n_ctx` tokens and steps of up to
/// `n_ubatch` tokens:
/// - tensors: model.weights() in order (a name appearing twice is listed once), with their
///   stored bytes, type, and the layer and role the model declares for it (WeightTable);
/// - kv_bytes: per layer, f16 K and V rows for n_ctx tokens, (k_dim + v_dim) * 2 * n_ctx bytes
///   (model.kv_layers(); a layer without an entry gets 0); n_ctx counts the rows of all
///   sequences;
/// - state_bytes: per layer, a recurrent layer's f32 state of `n_seq` state rows (the sequences
///   and the spare rows that keep checkpoints), (conv_dim + ssm_dim) * 4 * n_seq bytes (it lives
///   with the layer's KV cache);
/// - scratch_bytes: device_scratch_bytes(model, n_ubatch, n_ctx) + expert_stage_bytes(model,
///   stream_experts_min_tokens, host_expert_share) (scheduler/memory.h, residency/residency.h:
///   --stream-experts and
///   --host-expert-share bring CPU-held experts to the device);
/// - the device fields and flags as given (device_free_bytes in bytes).
/// Throws Error(invalid_argument) for n_ctx < 1 or n_ubatch < 1 (naming -c / -ub and the value)
/// and for a tensor whose layer is not below the model's n_layer.
/// scheduler/memory.h's device_scratch_bytes for `model`'s step graph of `n_ubatch` tokens.
size_t device_scratch_bytes(const Model& model, int32_t n_ubatch, int64_t n_ctx,
                            Device* dev = nullptr);
/// residency/residency.h's expert_stage_bytes for `model` (its decode step graph).
size_t expert_stage_bytes(const Model& model, int32_t stream_experts_min_tokens,
                          double host_expert_share);

placement::Request plan_request(const Model& model, int64_t n_ctx, int32_t n_ubatch,
                                const placement::Flags& flags, std::string device_name,
                                size_t device_free_bytes, bool has_device,
                                int32_t stream_experts_min_tokens = 0, double host_expert_share = 0,
                                int32_t n_seq = 1);

}  // namespace berth
