// The pre-norm decoder-only transformer that the llama and Qwen families share, parameterised
// by the few places where they differ. Each architecture file (llama.cpp, qwen.cpp) picks a
// Variant; this class reads the weights and emits the step graph.
//
// Block (ne[0] contiguous; q_dim = n_head * head_dim, kv_dim = n_head_kv * head_dim):
//   h = rms_norm(x) * attn_norm                                  blk.N.attn_norm.weight {n_embd}
//   q = attn_q h (+ attn_q.bias)        {n_embd, q_dim}  bias {q_dim}      (bias: qwen2)
//   k = attn_k h (+ attn_k.bias)        {n_embd, kv_dim} bias {kv_dim}
//   v = attn_v h (+ attn_v.bias)        {n_embd, kv_dim} bias {kv_dim}
//   q, k = per-head rms_norm * attn_q_norm / attn_k_norm {head_dim}     (qwen3, qwen3moe)
//   q, k = rope(q), rope(k)   (adjacent pairs: llama; NeoX halves: qwen*)
//   x += attn_output(attention(q, k, v))  {q_dim, n_embd}
//   h = rms_norm(x) * ffn_norm                                   blk.N.ffn_norm.weight {n_embd}
//   dense:  x += ffn_down(silu(ffn_gate h) * ffn_up h)   gate/up {n_embd, n_ff}, down {n_ff,
//   n_embd} MoE:    route = top-k(softmax(ffn_gate_inp h))        ffn_gate_inp {n_embd, n_expert}
//           x += sum_j w_j ffn_down_exps[e_j](silu(ffn_gate_exps[e_j] h) * ffn_up_exps[e_j] h)
//           gate/up_exps {n_embd, n_ff_exp, n_expert}, down_exps {n_ff_exp, n_embd, n_expert}
// logits = output(rms_norm(x) * output_norm)   output {n_embd, n_vocab}, tied to token_embd
// when absent.
#pragma once

#include <memory>

#include "berth/models/model.h"

namespace berth::models_detail {

struct Variant {
  graph::RopeMode rope = graph::RopeMode::adjacent;
  bool qkv_bias = false;  ///< attn_{q,k,v}.bias present (required)
  bool qk_norm = false;   ///< attn_q_norm / attn_k_norm may be present (absent: no per-head norm)
  bool moe = false;       ///< routed experts instead of the dense FFN (requires expert_count > 0)
  bool moe_allowed = false;  ///< expert_count > 0 selects MoE (llama: Mixtral-style)
};

std::unique_ptr<Model> make_decoder(const gguf::File& file, const Variant& variant);

}  // namespace berth::models_detail
