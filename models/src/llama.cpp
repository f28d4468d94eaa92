// The `llama` architecture (LLaMA, arXiv:2302.13971; grouped-query attention, arXiv:2305.13245):
// pre-norm decoder blocks with RMSNorm, rotary embeddings on adjacent pairs (GGUF llama files
// store Q and K permuted for that layout), causal attention over the KV cache and a SwiGLU
// feed-forward. With llama.expert_count > 0 the feed-forward is Mixtral's (arXiv:2401.04088):
// a router ffn_gate_inp picks llama.expert_used_count of the stacked experts ffn_*_exps per
// token and their softmax weights are renormalised. Tensors: see decoder.h.
#include "decoder.h"

namespace berth {

std::unique_ptr<Model> make_llama(const gguf::File& file) {
  return models_detail::make_decoder(file,
                                     {.rope = graph::RopeMode::adjacent, .moe_allowed = true});
}

}  // namespace berth
