// The `llama` architecture (LLaMA, arXiv:2302.13971; grouped-query attention, arXiv:2305.13245):
// pre-norm layers of attention with rotary embeddings on adjacent pairs (GGUF llama files store Q
// and K permuted for that layout) and a SwiGLU feed-forward. With llama.expert_count > 0 every
// layer's feed-forward is Mixtral's (arXiv:2401.04088): a router picks llama.expert_used_count of
// the stacked experts per token and their softmax weights are renormalised. Blocks: blocks.h.
#include "berth/io/gguf.h"
#include "blocks.h"

namespace berth {

std::unique_ptr<Model> make_llama(const gguf::File& file) {
  using namespace models_detail;
  Hparams hp = read_hparams(file);
  const LayerSpec layer{.attn = {.rope = graph::RopeMode::adjacent},
                        .ffn = hp.n_expert > 0 ? FfnKind::moe : FfnKind::dense};
  return make_transformer(file, hp, std::vector<LayerSpec>(static_cast<size_t>(hp.n_layer), layer));
}

}  // namespace berth
