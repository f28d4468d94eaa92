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
//   q, k = rope(q), rope(k)   (adjacent pairs: llama; NeoX halves: qwen*; the first n_rot
//          dims of each head: rope.dimension_count)
//   x += attn_output(attention(q, k, v))  {q_dim, n_embd}
// Gated attention (output_gate: Qwen3.5 / Qwen3-Next full-attention layers): attn_q is
//   {n_embd, 2 * q_dim}, per head head_dim query columns then head_dim gate columns (head_slice);
//   attn_q_norm / attn_k_norm required; x += attn_output(attention(q, k, v) * sigmoid(gate)).
// Gated DeltaNet mixer (MixerKind::gdn, Qwen3.5; arXiv:2412.06464; key_dim = H_k * d_k,
// value_dim = H_v * d_v, conv channels C = 2 * key_dim + value_dim):
//   h = rms_norm(x) * attn_norm
//   qkv = attn_qkv h {n_embd, C};  z = attn_gate h {n_embd, value_dim}
//   b = ssm_beta h {n_embd, H_v};  alpha = ssm_alpha h {n_embd, H_v}
//   y = ssm_conv(qkv) with ssm_conv1d {kernel, C} and the layer's conv state (SiLU included)
//   o = gated_delta(y, alpha, b) with ssm_a {H_v}, ssm_dt.bias {H_v} and the layer's state
//   o = rms_norm_gated(o, z) per V head with ssm_norm {d_v}
//   x += ssm_out o {value_dim, n_embd}
// The FFN's norm is ffn_norm (post_attention_norm in qwen35 files: LayerSpec::ffn_norm).

// Dense FFN block:
//   h = rms_norm(x) * ffn_norm                                   blk.N.ffn_norm {n_embd}
//   x += ffn_down(silu(ffn_gate h) * ffn_up h)   gate/up {n_embd, n_ff}, down {n_ff, n_embd}
// MoE FFN block (routed experts; Mixtral arXiv:2401.04088, Qwen3-MoE):
//   h = rms_norm(x) * ffn_norm
//   route = top-k(softmax(ffn_gate_inp h))                       ffn_gate_inp {n_embd, n_expert}
//   x += sum_j w_j ffn_down_exps[e_j](silu(ffn_gate_exps[e_j] h) * ffn_up_exps[e_j] h)
//   gate/up_exps {n_embd, n_ff_exp, n_expert}, down_exps {n_ff_exp, n_embd, n_expert}
//   shared expert (LayerSpec::shared_expert, qwen35moe): x += sigmoid(ffn_gate_inp_shexp . h) *
//   ffn_down_shexp(silu(ffn_gate_shexp h) * ffn_up_shexp h); gate_inp_shexp {n_embd},
//   gate/up_shexp {n_embd, n_ff_shexp}, down_shexp {n_ff_shexp, n_embd}
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
  /// attn_q holds a sigmoid output gate per head (gated attention); needs qk_norm and then
  /// requires attn_q_norm / attn_k_norm.
  bool output_gate = false;
};

enum class FfnKind : uint8_t { dense, moe };

/// What mixes tokens in a layer: softmax attention (KV cache), or a Gated DeltaNet (recurrent
/// state: KvLayer::conv_dim / ssm_dim).
enum class MixerKind : uint8_t { attention, gdn };

/// One layer: a mixer (attention or GDN), then a feed-forward block.
struct LayerSpec {
  MixerKind mixer = MixerKind::attention;
  AttentionSpec attn;  ///< mixer == attention
  FfnKind ffn = FfnKind::dense;
  bool shared_expert = false;         ///< moe: a sigmoid-gated shared expert (qwen35moe)
  const char* ffn_norm = "ffn_norm";  ///< the FFN norm's tensor name (qwen35: post_attention_norm)
};

struct GdnWeights {
  graph::WeightId norm = graph::kNoWeight, qkv = graph::kNoWeight, z = graph::kNoWeight,
                  beta = graph::kNoWeight, alpha = graph::kNoWeight, conv = graph::kNoWeight,
                  dt_bias = graph::kNoWeight, a = graph::kNoWeight, ssm_norm = graph::kNoWeight,
                  out = graph::kNoWeight;
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
  graph::WeightId sh_gate_inp = graph::kNoWeight, sh_gate = graph::kNoWeight,
                  sh_up = graph::kNoWeight, sh_down = graph::kNoWeight;  ///< shared expert
};

/// Reads layer `l`'s attention weights. Throws as WeightLoader::need does, and Error(format)
/// when only one of attn_q_norm and attn_k_norm is present.
AttentionWeights load_attention(WeightLoader& ld, const Hparams& hp, int32_t l,
                                const AttentionSpec& spec);
/// Reads layer `l`'s feed-forward weights as `spec` describes them.
FfnWeights load_ffn(WeightLoader& ld, const Hparams& hp, int32_t l, const LayerSpec& spec);
/// Reads layer `l`'s Gated DeltaNet weights (shapes from hp.ssm_*). Throws as
/// WeightLoader::need does.
GdnWeights load_gdn(WeightLoader& ld, const Hparams& hp, int32_t l);
/// The recurrent state a GDN layer keeps per sequence (KvLayer with conv_dim, ssm_dim).
KvLayer gdn_state(const Hparams& hp);

/// Adds layer `l`'s attention block on the residual stream x; returns the new residual stream.
graph::ValueId attention_block(graph::Builder& b, const Hparams& hp, int32_t l,
                               const AttentionSpec& spec, const AttentionWeights& w,
                               graph::ValueId x);
/// Adds layer `l`'s GDN mixer on the residual stream x; returns the new residual stream.
graph::ValueId gdn_block(graph::Builder& b, const Hparams& hp, int32_t l, const GdnWeights& w,
                         graph::ValueId x);
/// Adds layer `l`'s feed-forward block as `spec` describes it on x; returns the new residual
/// stream.
graph::ValueId ffn_block(graph::Builder& b, const Hparams& hp, int32_t l, const LayerSpec& spec,
                         const FfnWeights& w, graph::ValueId x);

/// The checks every architecture of this family makes of its file: rope_freqs.weight and rope
/// scaling are not supported (Error(unsupported)); routed experts only where `layers` asks for
/// them: a MoE layer without expert_count (Error(format)), expert_count on a model without MoE
/// layers (Error(unsupported)).
void check_variant(const gguf::File& f, const Hparams& hp, const std::vector<LayerSpec>& layers);

/// The model of `hp` whose layers are `layers` (one per hp.n_layer), reading its weights from
/// `f`: token_embd, the layers, output_norm and output (tied to token_embd when absent). Its
/// kv_layers(): K/V rows for attention layers, the recurrent state (gdn_state) for GDN layers.
std::unique_ptr<Model> make_transformer(const gguf::File& f, Hparams hp,
                                        std::vector<LayerSpec> layers);

}  // namespace berth::models_detail
