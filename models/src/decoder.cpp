#include "decoder.h"

#include <fmt/format.h>

#include <cmath>

#include "berth/core/error.h"
#include "berth/io/gguf.h"
#include "weights.h"

namespace berth::models_detail {
namespace {

using graph::kNoWeight;
using graph::WeightId;

class DecoderModel final : public Model {
 public:
  DecoderModel(const gguf::File& f, const Variant& variant) : v_(variant) {
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
    moe_ = v_.moe || (v_.moe_allowed && hp_.n_expert > 0);
    if (v_.moe && hp_.n_expert == 0)
      throw Error(ErrorCategory::format,
                  fmt::format("{}: architecture '{}' needs {}.expert_count > 0", f.path(), hp_.arch,
                              hp_.arch));
    if (!moe_ && hp_.n_expert > 0)
      throw Error(ErrorCategory::unsupported,
                  fmt::format("{}: {}.expert_count = {} but architecture '{}' has no experts",
                              f.path(), hp_.arch, hp_.n_expert, hp_.arch));

    const int64_t E = hp_.n_embd, V = hp_.n_vocab, F = hp_.n_ff, D = hp_.head_dim;
    const int64_t q_dim = hp_.n_head * D, kv_dim = hp_.n_head_kv * D;
    tok_embd_ = need(f, weights_, "token_embd.weight", {E, V});
    layers_.resize(static_cast<size_t>(hp_.n_layer));
    for (int64_t l = 0; l < hp_.n_layer; ++l) {
      Layer& L = layers_[static_cast<size_t>(l)];
      auto name = [&](const char* t, const char* kind = "weight") {
        return fmt::format("blk.{}.{}.{}", l, t, kind);
      };
      L.attn_norm = need(f, weights_, name("attn_norm"), {E});
      L.wq = need(f, weights_, name("attn_q"), {E, q_dim});
      L.wk = need(f, weights_, name("attn_k"), {E, kv_dim});
      L.wv = need(f, weights_, name("attn_v"), {E, kv_dim});
      if (v_.qkv_bias) {
        L.bq = need(f, weights_, name("attn_q", "bias"), {q_dim});
        L.bk = need(f, weights_, name("attn_k", "bias"), {kv_dim});
        L.bv = need(f, weights_, name("attn_v", "bias"), {kv_dim});
      }
      if (v_.qk_norm) {
        L.q_norm = maybe(f, weights_, name("attn_q_norm"), {D}).value_or(kNoWeight);
        L.k_norm = maybe(f, weights_, name("attn_k_norm"), {D}).value_or(kNoWeight);
        if ((L.q_norm == kNoWeight) != (L.k_norm == kNoWeight))
          throw Error(
              ErrorCategory::format,
              fmt::format("{}: layer {} has only one of attn_q_norm and attn_k_norm", f.path(), l));
      }
      L.wo = need(f, weights_, name("attn_output"), {q_dim, E});
      L.ffn_norm = need(f, weights_, name("ffn_norm"), {E});
      if (moe_) {
        const int64_t X = hp_.n_expert, FE = hp_.n_ff_exp;
        L.router = need(f, weights_, name("ffn_gate_inp"), {E, X});
        L.ffn_gate = need(f, weights_, name("ffn_gate_exps"), {E, FE, X});
        L.ffn_up = need(f, weights_, name("ffn_up_exps"), {E, FE, X});
        L.ffn_down = need(f, weights_, name("ffn_down_exps"), {FE, E, X});
      } else {
        L.ffn_gate = need(f, weights_, name("ffn_gate"), {E, F});
        L.ffn_up = need(f, weights_, name("ffn_up"), {E, F});
        L.ffn_down = need(f, weights_, name("ffn_down"), {F, E});
      }
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
    const auto D = static_cast<int32_t>(hp_.head_dim);
    const graph::RopeParams rope{.n_head = static_cast<int32_t>(hp_.n_head),
                                 .head_dim = D,
                                 .n_rot = static_cast<int32_t>(hp_.n_rot),
                                 .freq_base = hp_.rope_freq_base,
                                 .mode = v_.rope};
    graph::RopeParams rope_k = rope;
    rope_k.n_head = static_cast<int32_t>(hp_.n_head_kv);
    graph::MoeParams moe{.n_expert = static_cast<int32_t>(hp_.n_expert),
                         .n_expert_used = static_cast<int32_t>(hp_.n_expert_used),
                         .norm_weights = hp_.expert_weights_norm};

    graph::ValueId x = b.embed(tok_embd_, "token_embd");
    for (int64_t l = 0; l < hp_.n_layer; ++l) {
      const Layer& L = layers_[static_cast<size_t>(l)];
      auto nm = [&](const char* t) { return fmt::format("blk.{}.{}", l, t); };
      graph::ValueId h = b.rms_norm(x, L.attn_norm, eps, nm("attn_norm"));
      graph::ValueId q = b.matmul(h, L.wq, nm("attn_q"));
      graph::ValueId k = b.matmul(h, L.wk, nm("attn_k"));
      graph::ValueId v = b.matmul(h, L.wv, nm("attn_v"));
      if (v_.qkv_bias) {
        q = b.add_bias(q, L.bq, nm("attn_q_bias"));
        k = b.add_bias(k, L.bk, nm("attn_k_bias"));
        v = b.add_bias(v, L.bv, nm("attn_v_bias"));
      }
      if (L.q_norm != kNoWeight) {
        q = b.rms_norm_grouped(q, L.q_norm, D, eps, nm("attn_q_norm"));
        k = b.rms_norm_grouped(k, L.k_norm, D, eps, nm("attn_k_norm"));
      }
      q = b.rope(q, rope, nm("rope_q"));
      k = b.rope(k, rope_k, nm("rope_k"));
      graph::AttentionParams ap{.layer = static_cast<int32_t>(l),
                                .n_head = static_cast<int32_t>(hp_.n_head),
                                .n_head_kv = static_cast<int32_t>(hp_.n_head_kv),
                                .head_dim = D,
                                .scale = 1.0f / std::sqrt(static_cast<float>(hp_.head_dim))};
      graph::ValueId a = b.attention(q, k, v, ap, nm("attn"));
      x = b.add(x, b.matmul(a, L.wo, nm("attn_output")), nm("attn_residual"));
      h = b.rms_norm(x, L.ffn_norm, eps, nm("ffn_norm"));
      graph::ValueId d;
      if (moe_) {
        graph::ValueId route =
            b.moe_route(b.matmul(h, L.router, nm("ffn_gate_inp")), moe, nm("ffn_route"));
        graph::MoeParams ep = moe;
        ep.gate = L.ffn_gate;
        ep.up = L.ffn_up;
        ep.down = L.ffn_down;
        d = b.moe_experts(h, route, ep, nm("ffn_moe"));
      } else {
        graph::ValueId g = b.matmul(h, L.ffn_gate, nm("ffn_gate"));
        graph::ValueId u = b.matmul(h, L.ffn_up, nm("ffn_up"));
        d = b.matmul(b.swiglu(g, u, nm("ffn_swiglu")), L.ffn_down, nm("ffn_down"));
      }
      x = b.add(x, d, nm("ffn_residual"));
    }
    if (n_outputs < n_tokens) x = b.take_last_rows(x, n_outputs, "outputs");
    x = b.rms_norm(x, out_norm_, eps, "output_norm");
    return b.finish(b.matmul(x, output_, "output"));
  }

 private:
  struct Layer {
    WeightId attn_norm = kNoWeight, wq = kNoWeight, wk = kNoWeight, wv = kNoWeight, wo = kNoWeight;
    WeightId bq = kNoWeight, bk = kNoWeight, bv = kNoWeight;
    WeightId q_norm = kNoWeight, k_norm = kNoWeight;
    WeightId ffn_norm = kNoWeight, router = kNoWeight;
    WeightId ffn_gate = kNoWeight, ffn_up = kNoWeight, ffn_down = kNoWeight;
  };
  Variant v_;
  bool moe_ = false;
  WeightId tok_embd_ = kNoWeight, out_norm_ = kNoWeight, output_ = kNoWeight;
  std::vector<Layer> layers_;
};

}  // namespace

std::unique_ptr<Model> make_decoder(const gguf::File& file, const Variant& variant) {
  return std::make_unique<DecoderModel>(file, variant);
}

}  // namespace berth::models_detail
