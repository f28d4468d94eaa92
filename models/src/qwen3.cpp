// The `qwen3` architecture (Qwen3 technical report, arXiv:2505.09388): no biases; per-head
// RMSNorm of Q and K (attn_q_norm / attn_k_norm, {head_dim}) before NeoX-style RoPE; head_dim
// from qwen3.attention.key_length (q_dim may differ from n_embd); a dense SwiGLU feed-forward.
// Absent attn_q_norm/attn_k_norm mean no per-head norm (used by upcycled test files).
// Blocks: blocks.h.
#include "berth/io/gguf.h"
#include "blocks.h"

namespace berth {

std::unique_ptr<Model> make_qwen3(const gguf::File& file) {
  using namespace models_detail;
  Hparams hp = read_hparams(file);
  const LayerSpec layer{.attn = {.rope = graph::RopeMode::neox, .qk_norm = true},
                        .ffn = FfnKind::dense};
  return make_transformer(file, hp, std::vector<LayerSpec>(static_cast<size_t>(hp.n_layer), layer));
}

}  // namespace berth
