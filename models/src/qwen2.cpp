// The `qwen2` architecture (Qwen2 technical report, arXiv:2407.10671): llama layers with biases
// on the Q, K and V projections and NeoX-style rotary embeddings (each head's halves rotate
// together); a dense SwiGLU feed-forward. Blocks: blocks.h.
#include "berth/io/gguf.h"
#include "blocks.h"

namespace berth {

std::unique_ptr<Model> make_qwen2(const gguf::File& file) {
  using namespace models_detail;
  Hparams hp = read_hparams(file);
  const LayerSpec layer{.attn = {.rope = graph::RopeMode::neox, .qkv_bias = true},
                        .ffn = FfnKind::dense};
  return make_transformer(file, hp, std::vector<LayerSpec>(static_cast<size_t>(hp.n_layer), layer));
}

}  // namespace berth
