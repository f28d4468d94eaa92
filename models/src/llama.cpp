// The `llama` architecture (LLaMA, arXiv:2302.13971; grouped-query attention, arXiv:2305.13245):
// pre-norm decoder blocks with RMSNorm, rotary embeddings on adjacent pairs (as GGUF llama files
// store Q and K), causal attention over the KV cache, and a SwiGLU feed-forward.
//
// Tensors (GGUF names, ne[0] contiguous):
//   token_embd.weight          {n_embd, n_vocab}
//   blk.N.attn_norm.weight     {n_embd}
//   blk.N.attn_q.weight        {n_embd, n_head * head_dim}
//   blk.N.attn_k.weight        {n_embd, n_head_kv * head_dim}
//   blk.N.attn_v.weight        {n_embd, n_head_kv * head_dim}
//   blk.N.attn_output.weight   {n_head * head_dim, n_embd}
//   blk.N.ffn_norm.weight      {n_embd}
//   blk.N.ffn_gate.weight      {n_embd, n_ff}
//   blk.N.ffn_up.weight        {n_embd, n_ff}
//   blk.N.ffn_down.weight      {n_ff, n_embd}
//   output_norm.weight         {n_embd}
//   output.weight              {n_embd, n_vocab}  (absent: tied to token_embd.weight)
#include <fmt/format.h>

#include <cmath>

#include "berth/core/error.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "weights.h"

namespace berth {
namespace {

using graph::WeightId;
using models_detail::maybe;
using models_detail::need;

class LlamaModel final : public Model {
 public:
  explicit LlamaModel(const gguf::File& f) {
    hp_ = read_hparams(f);
    const gguf::TensorInfo& embd = f.tensor("token_embd.weight");
    hp_.n_vocab = embd.ne[1];
    if (f.find_tensor("rope_freqs.weight"))
      throw Error(ErrorCategory::unsupported,
                  fmt::format("{}: rope_freqs.weight (per-dimension RoPE frequency factors, as in "
                              "Llama 3.1) is not supported yet",
                              f.path()));
    if (auto st = f.get_string_opt(hp_.arch + ".rope.scaling.type"); st && *st != "none")
      throw Error(ErrorCategory::unsupported,
                  fmt::format("{}: {}.rope.scaling.type = '{}' is not supported yet", f.path(),
                              hp_.arch, *st));
    if (f.has(hp_.arch + ".expert_count") && f.get_int(hp_.arch + ".expert_count") > 0)
      throw Error(ErrorCategory::unsupported,
                  fmt::format("{}: llama with experts ({}.expert_count) is not supported yet",
                              f.path(), hp_.arch));

    const int64_t E = hp_.n_embd, V = hp_.n_vocab, F = hp_.n_ff;
    const int64_t q_dim = hp_.n_head * hp_.head_dim, kv_dim = hp_.n_head_kv * hp_.head_dim;
    tok_embd_ = need(f, weights_, "token_embd.weight", {E, V});
    layers_.resize(static_cast<size_t>(hp_.n_layer));
    for (int64_t l = 0; l < hp_.n_layer; ++l) {
      Layer& L = layers_[static_cast<size_t>(l)];
      auto name = [&](const char* t) { return fmt::format("blk.{}.{}.weight", l, t); };
      L.attn_norm = need(f, weights_, name("attn_norm"), {E});
      L.wq = need(f, weights_, name("attn_q"), {E, q_dim});
      L.wk = need(f, weights_, name("attn_k"), {E, kv_dim});
      L.wv = need(f, weights_, name("attn_v"), {E, kv_dim});
      L.wo = need(f, weights_, name("attn_output"), {q_dim, E});
      L.ffn_norm = need(f, weights_, name("ffn_norm"), {E});
      L.ffn_gate = need(f, weights_, name("ffn_gate"), {E, F});
      L.ffn_up = need(f, weights_, name("ffn_up"), {E, F});
      L.ffn_down = need(f, weights_, name("ffn_down"), {F, E});
    }
    out_norm_ = need(f, weights_, "output_norm.weight", {E});
    output_ = maybe(f, weights_, "output.weight", {E, V}).value_or(tok_embd_);
  }

  std::vector<KvLayer> kv_layers() const override {
    const int64_t kv_dim = hp_.n_head_kv * hp_.head_dim;
    return std::vector<KvLayer>(static_cast<size_t>(hp_.n_layer), KvLayer{kv_dim, kv_dim});
  }

  graph::Graph build_step(int32_t n_tokens, int32_t n_outputs) const override {
    if (n_tokens < 1 || n_outputs < 1 || n_outputs > n_tokens)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("build_step: need 1 <= n_outputs ({}) <= n_tokens ({})", n_outputs,
                              n_tokens));
    graph::Builder b(weights_, n_tokens);
    const float eps = hp_.rms_eps;
    const graph::RopeParams rope{.n_head = static_cast<int32_t>(hp_.n_head),
                                 .head_dim = static_cast<int32_t>(hp_.head_dim),
                                 .n_rot = static_cast<int32_t>(hp_.n_rot),
                                 .freq_base = hp_.rope_freq_base,
                                 .mode = graph::RopeMode::adjacent};
    graph::RopeParams rope_k = rope;
    rope_k.n_head = static_cast<int32_t>(hp_.n_head_kv);

    graph::ValueId x = b.embed(tok_embd_, "token_embd");
    for (int64_t l = 0; l < hp_.n_layer; ++l) {
      const Layer& L = layers_[static_cast<size_t>(l)];
      auto nm = [&](const char* t) { return fmt::format("blk.{}.{}", l, t); };
      graph::ValueId h = b.rms_norm(x, L.attn_norm, eps, nm("attn_norm"));
      graph::ValueId q = b.rope(b.matmul(h, L.wq, nm("attn_q")), rope, nm("rope_q"));
      graph::ValueId k = b.rope(b.matmul(h, L.wk, nm("attn_k")), rope_k, nm("rope_k"));
      graph::ValueId v = b.matmul(h, L.wv, nm("attn_v"));
      graph::AttentionParams ap{.layer = static_cast<int32_t>(l),
                                .n_head = static_cast<int32_t>(hp_.n_head),
                                .n_head_kv = static_cast<int32_t>(hp_.n_head_kv),
                                .head_dim = static_cast<int32_t>(hp_.head_dim),
                                .scale = 1.0f / std::sqrt(static_cast<float>(hp_.head_dim))};
      graph::ValueId a = b.attention(q, k, v, ap, nm("attn"));
      x = b.add(x, b.matmul(a, L.wo, nm("attn_output")), nm("attn_residual"));
      h = b.rms_norm(x, L.ffn_norm, eps, nm("ffn_norm"));
      graph::ValueId g = b.matmul(h, L.ffn_gate, nm("ffn_gate"));
      graph::ValueId u = b.matmul(h, L.ffn_up, nm("ffn_up"));
      graph::ValueId d = b.matmul(b.swiglu(g, u, nm("ffn_swiglu")), L.ffn_down, nm("ffn_down"));
      x = b.add(x, d, nm("ffn_residual"));
    }
    if (n_outputs < n_tokens) x = b.take_last_rows(x, n_outputs, "outputs");
    x = b.rms_norm(x, out_norm_, eps, "output_norm");
    return b.finish(b.matmul(x, output_, "output"));
  }

 private:
  struct Layer {
    WeightId attn_norm, wq, wk, wv, wo, ffn_norm, ffn_gate, ffn_up, ffn_down;
  };
  WeightId tok_embd_ = graph::kNoWeight, out_norm_ = graph::kNoWeight, output_ = graph::kNoWeight;
  std::vector<Layer> layers_;
};

}  // namespace

std::unique_ptr<Model> make_llama(const gguf::File& file) {
  return std::make_unique<LlamaModel>(file);
}

}  // namespace berth
