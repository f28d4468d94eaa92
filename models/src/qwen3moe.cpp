// The `qwen3moe` architecture (Qwen3 technical report, arXiv:2505.09388): qwen3's attention and,
// in every layer, routed experts (expert_count, expert_used_count, expert_feed_forward_length):
// softmax over all experts, top-k, weights renormalised unless qwen3moe.expert_weights_norm is
// false. No shared expert. Blocks: blocks.h.
#include "berth/io/gguf.h"
#include "blocks.h"

namespace berth {

std::unique_ptr<Model> make_qwen3moe(const gguf::File& file) {
  using namespace models_detail;
  Hparams hp = read_hparams(file);
  const LayerSpec layer{.attn = {.rope = graph::RopeMode::neox, .qk_norm = true},
                        .ffn = FfnKind::moe};
  return make_transformer(file, hp, std::vector<LayerSpec>(static_cast<size_t>(hp.n_layer), layer));
}

}  // namespace berth
