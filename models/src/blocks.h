// Private to models/: the blocks the architectures are built from, each a function that reads its
// weights (with their roles) and one that adds its ops to a step graph. A layer is an attention
// block followed by a feed-forward block, each configured per layer (LayerSpec), so variants and
// hybrid layers fit without a flag set per model.
//
// Attention block (ne[0] contiguous; q_dim = n_head * head_dim, kv_dim = n_head_kv * head_dim):
//   h = rms_norm(x) * attn_norm                                  blk.N.attn_norm {n_embd}
//   q = attn_q h (+ attn_q.bias)        {n_embd, q_dim}  bias {q_dim}        (qkv_bias: qwen2)
//   k = attn_k h (+ attn_k.bias)        {n_embd, kv_dim} bias {kv_dim}
//   v = attn_v h (+ attn_v.bias)        {n_embd, kv_dim} bias {kv_dim}
//   q, k = per-head rms_norm * attn_q_norm / attn_k_norm {head_dim}     (qk_norm: qwen3*, when
//          present; absent in both: no per-head norm, as in upcycled test files)
//   q, k = rope(q), rope(k)   (adjacent pairs: llama; NeoX halves: qwen*)
//   x += attn_output(attention(q, k, v))  {q_dim, n_embd}
// Dense FFN block:
//   h = rms_norm(x) * ffn_norm                                   blk.N.ffn_norm {n_embd}
//   x += ffn_down(silu(ffn_gate h) * ffn_up h)   gate/up {n_embd, n_ff}, down {n_ff, n_embd}
// MoE FFN block (routed experts; Mixtral arXiv:2401.04088, Qwen3-MoE):
//   h = rms_norm(x) * ffn_norm
//   route = top-k(softmax(ffn_gate_inp h))                       ffn_gate_inp {n_embd, n_expert}
//   x += sum_j w_j ffn_down_exps[e_j](silu(ffn_gate_exps[e_j] h) * ffn_up_exps[e_j] h)
//   gate/up_exps {n_embd, n_ff_exp, n_expert}, down_exps {n_ff_exp, n_embd, n_expert}
#pragma once

#include <cstdint>

#include "berth/graph/graph.h"
#include "berth/models/model.h"
#include "loader.h"

namespace berth::models_detail {

struct AttentionSpec {
  graph::RopeMode rope = graph::RopeMode::adjacent;
  bool qkv_bias = false;  ///< attn_{q,k,v}.bias present (required)
  bool qk_norm = false;   ///< attn_q_norm / attn_k_norm may be present (both or neither)
};

enum class FfnKind : uint8_t { dense, moe };

/// One layer: an attention block, then a feed-forward block.
struct LayerSpec {
  AttentionSpec attn;
  FfnKind ffn = FfnKind::dense;
};

struct AttentionWeights {
  graph::WeightId norm = graph::kNoWeight, q = graph::kNoWeight, k = graph::kNoWeight,
                  v = graph::kNoWeight, o = graph::kNoWeight;
  graph::WeightId bq = graph::kNoWeight, bk = graph::kNoWeight, bv = graph::kNoWeight;
  graph::WeightId q_norm = graph::kNoWeight, k_norm = graph::kNoWeight;
};

struct FfnWeights {
  graph::WeightId norm = graph::kNoWeight;
  graph::WeightId router = graph::kNoWeight;  ///< MoE
  graph::WeightId gate = graph::kNoWeight, up = graph::kNoWeight, down = graph::kNoWeight;
};

/// Reads layer `l`'s attention weights. Throws as WeightLoader::need does, and Error(format)
/// when only one of attn_q_norm and attn_k_norm is present.
AttentionWeights load_attention(WeightLoader& ld, const Hparams& hp, int32_t l,
                                const AttentionSpec& spec);
/// Reads layer `l`'s feed-forward weights of `kind`.
FfnWeights load_ffn(WeightLoader& ld, const Hparams& hp, int32_t l, FfnKind kind);

/// Adds layer `l`'s attention block on the residual stream x; returns the new residual stream.
graph::ValueId attention_block(graph::Builder& b, const Hparams& hp, int32_t l,
                               const AttentionSpec& spec, const AttentionWeights& w,
                               graph::ValueId x);
/// Adds layer `l`'s feed-forward block of `kind` on x; returns the new residual stream.
graph::ValueId ffn_block(graph::Builder& b, const Hparams& hp, int32_t l, FfnKind kind,
                         const FfnWeights& w, graph::ValueId x);

/// The checks every architecture of this family makes of its file: rope_freqs.weight and rope
/// scaling are not supported (Error(unsupported)); routed experts only where `layers` asks for
/// them: a MoE layer without expert_count (Error(format)), expert_count on a model without MoE
/// layers (Error(unsupported)).
void check_variant(const gguf::File& f, const Hparams& hp, const std::vector<LayerSpec>& layers);

/// The model of `hp` whose layers are `layers` (one per hp.n_layer), reading its weights from
/// `f`: token_embd, the layers, output_norm and output (tied to token_embd when absent).
std::unique_ptr<Model> make_transformer(const gguf::File& f, Hparams hp,
                                        std::vector<LayerSpec> layers);

}  // namespace berth::models_detail
