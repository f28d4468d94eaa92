// The Qwen families (Qwen2 technical report arXiv:2407.10671; Qwen3 arXiv:2505.09388), as GGUF
// files of these architectures expect them; NeoX-style rotary embeddings (each head's halves
// rotate together) in all three:
//   qwen2:    llama blocks with biases on the Q, K and V projections.
//   qwen3:    no biases; per-head RMSNorm of Q and K (attn_q_norm / attn_k_norm, {head_dim})
//             before RoPE; head_dim from qwen3.attention.key_length (q_dim may differ from n_embd).
//   qwen3moe: qwen3 attention; routed experts (expert_count, expert_used_count,
//             expert_feed_forward_length): softmax over all experts, top-k, weights
//             renormalised unless qwen3moe.expert_weights_norm is false. No shared expert.
// Absent attn_q_norm/attn_k_norm mean no per-head norm (used by upcycled test files).
// Tensors: see decoder.h.
#include "decoder.h"

namespace berth {

std::unique_ptr<Model> make_qwen2(const gguf::File& file) {
  return models_detail::make_decoder(file, {.rope = graph::RopeMode::neox, .qkv_bias = true});
}

std::unique_ptr<Model> make_qwen3(const gguf::File& file) {
  return models_detail::make_decoder(file, {.rope = graph::RopeMode::neox, .qk_norm = true});
}

std::unique_ptr<Model> make_qwen3moe(const gguf::File& file) {
  return models_detail::make_decoder(file,
                                     {.rope = graph::RopeMode::neox, .qk_norm = true, .moe = true});
}

}  // namespace berth
