#include "berth/runtime/routing_io.h"

#include <fmt/format.h>

#include <algorithm>

#include "berth/core/error.h"

namespace berth {

std::vector<int32_t> moe_blocks(const Model& model) {
  const graph::Graph g = model.build_step(1, 1);
  std::vector<int32_t> blocks;
  for (const graph::Op& op : g.ops)
    if (op.kind == graph::OpKind::moe_experts) {
      const int32_t l = model.weights().layer(op.moe.gate);
      if (blocks.empty() || blocks.back() != l) blocks.push_back(l);
    }
  std::sort(blocks.begin(), blocks.end());
  blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
  return blocks;
}

residency::TraceShape routing_shape(const Model& model, bool weights) {
  const Hparams& hp = model.hparams();
  residency::TraceShape s;
  s.blocks = moe_blocks(model);
  if (s.blocks.empty())
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("the model ({}) has no MoE layers: it has no routing to record or "
                            "replay",
                            hp.arch));
  s.n_layer = static_cast<int32_t>(s.blocks.size());
  s.n_expert = static_cast<int32_t>(hp.n_expert);
  s.n_expert_used = static_cast<int32_t>(hp.n_expert_used);
  s.has_weights = weights;
  return s;
}

void attach_routing(Session& session, const Model& model,
                    std::shared_ptr<const residency::RoutingReplay> replay,
                    std::shared_ptr<residency::RoutingTraceWriter> writer) {
  if (!replay && !writer) return;
  const residency::TraceShape shape = routing_shape(model, true);
  if (writer) {
    const residency::TraceShape& w = writer->shape();
    if (w.n_layer != shape.n_layer || w.n_expert != shape.n_expert ||
        w.n_expert_used != shape.n_expert_used || w.blocks != shape.blocks)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("the routing trace writer's shape ({} MoE layers of {} experts, "
                              "top-{}) is not the model's ({}, {}, top-{})",
                              w.n_layer, w.n_expert, w.n_expert_used, shape.n_layer, shape.n_expert,
                              shape.n_expert_used));
  }
  const int32_t k = shape.n_expert_used;
  Scheduler::RoutingHooks hooks;
  if (replay) {
    auto next = std::make_shared<int64_t>(0);  // the run token the next step starts at
    hooks.force = [replay, next, blocks = shape.blocks, k](const graph::Graph& g, int32_t* ids) {
      const int64_t n = g.n_tokens;
      for (size_t r = 0; r < blocks.size(); ++r)
        for (int64_t t = 0; t < n; ++t) {
          const auto e = replay->ids(*next + t, blocks[r]);
          int32_t* o = ids + (static_cast<int64_t>(r) * n + t) * k;
          for (int32_t j = 0; j < k; ++j) o[j] = e[static_cast<size_t>(j)];
        }
      *next += n;
    };
  }
  if (writer) {
    hooks.record = [writer, n_layer = shape.n_layer, k](const graph::Graph& g,
                                                        std::span<const float* const> routes) {
      const int64_t n = g.n_tokens, n_dec = g.decode_rows(n);
      const auto part = [&](residency::TokenKind kind, int64_t first, int64_t count) {
        if (count == 0) return;
        writer->begin_step(kind, count);
        for (int32_t r = 0; r < n_layer; ++r)
          writer->add_layer_route(r, routes[static_cast<size_t>(r)] + first * 2 * k);
        writer->end_step();
      };
      part(residency::TokenKind::prefill, 0, n - n_dec);
      part(residency::TokenKind::decode, n - n_dec, n_dec);
    };
  }
  session.scheduler().set_routing(shape.n_layer, k, std::move(hooks));
}

}  // namespace berth
