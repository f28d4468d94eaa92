#include "berth/runtime/plan_request.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <string_view>
#include <unordered_set>

#include "berth/core/error.h"
#include "berth/scheduler/scheduler.h"

namespace berth {

size_t device_scratch_bytes(const Model& model, int32_t n_ubatch, int64_t n_ctx, Device* dev) {
  return device_scratch_bytes(model.build_step(n_ubatch, 1), model.weights(), n_ctx, dev);
}

size_t expert_stage_bytes(const Model& model, int32_t stream_experts_min_tokens,
                          double host_expert_share) {
  return expert_stage_bytes(model.build_step(1, 1), model.weights(), stream_experts_min_tokens,
                            host_expert_share);
}

placement::Request plan_request(const Model& model, int64_t n_ctx, int32_t n_ubatch,
                                const placement::Flags& flags, std::string device_name,
                                size_t device_free_bytes, bool has_device,
                                int32_t stream_experts_min_tokens, double host_expert_share,
                                int32_t n_seq) {
  if (n_ctx < 1)
    throw Error(ErrorCategory::invalid_argument, fmt::format("-c {}: must be >= 1", n_ctx));
  if (n_ubatch < 1)
    throw Error(ErrorCategory::invalid_argument, fmt::format("-ub {}: must be >= 1", n_ubatch));
  placement::Request req;
  req.n_layer = static_cast<int32_t>(model.hparams().n_layer);
  std::unordered_set<std::string_view> seen;
  const graph::WeightTable& w = model.weights();
  for (size_t i = 0; i < w.size(); ++i) {
    const TensorView& t = w.tensors[i];
    if (!seen.insert(t.name).second) continue;
    placement::TensorEntry e;
    e.name = t.name;
    e.bytes = t.n_bytes;
    e.layer = w.layers[i];
    e.role = w.roles[i];
    if (e.role == graph::WeightRole::routed_expert && w.tensors[i].ne[2] > 1)
      e.n_expert = static_cast<int32_t>(w.tensors[i].ne[2]);
    if (e.layer >= req.n_layer)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("tensor '{}' is read in layer {} but the model has {} layers", t.name,
                              e.layer, req.n_layer));
    e.type = std::string(type_name(t.type));
    req.tensors.push_back(std::move(e));
  }
  // The weights the recurrent-state ops read (placement keeps them with the state).
  {
    std::unordered_set<std::string_view> companions;
    for (const graph::Op& op : model.build_step(1, 1).ops)
      if (op.kind == graph::OpKind::ssm_conv || op.kind == graph::OpKind::gated_delta)
        for (graph::WeightId id : {op.weight, op.ssm.dt_bias})
          if (id != graph::kNoWeight) companions.insert(w.tensors[static_cast<size_t>(id)].name);
    for (placement::TensorEntry& e : req.tensors) e.state_companion = companions.contains(e.name);
  }
  const std::vector<KvLayer> kv = model.kv_layers();
  req.kv_bytes.assign(static_cast<size_t>(req.n_layer), 0);
  req.state_bytes.assign(static_cast<size_t>(req.n_layer), 0);
  for (size_t l = 0; l < kv.size() && l < req.kv_bytes.size(); ++l) {
    req.kv_bytes[l] =
        static_cast<size_t>(kv[l].k_dim + kv[l].v_dim) * 2 * static_cast<size_t>(n_ctx);
    req.state_bytes[l] = static_cast<size_t>(kv[l].conv_dim + kv[l].ssm_dim) * sizeof(float) *
                         static_cast<size_t>(std::max(n_seq, 1));
  }
  req.scratch_bytes = device_scratch_bytes(model, n_ubatch, n_ctx) +
                      expert_stage_bytes(model, stream_experts_min_tokens, host_expert_share);
  req.has_device = has_device;
  req.device_name = std::move(device_name);
  req.device_free_bytes = device_free_bytes;
  req.flags = flags;
  return req;
}

}  // namespace berth
