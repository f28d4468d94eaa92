#include "blocks.h"

#include <fmt/format.h>

#include <cmath>

#include "berth/core/error.h"

namespace berth::models_detail {

using graph::kNoWeight;
using graph::ValueId;
using graph::WeightRole;

AttentionWeights load_attention(WeightLoader& ld, const Hparams& hp, int32_t l,
                                const AttentionSpec& spec) {
  const int64_t E = hp.n_embd, D = hp.head_dim;
  const int64_t q_dim = hp.n_head * D, kv_dim = hp.n_head_kv * D;
  auto name = [&](const char* t, const char* kind = "weight") {
    return fmt::format("blk.{}.{}.{}", l, t, kind);
  };
  AttentionWeights w;
  w.norm = ld.need(name("attn_norm"), {E}, WeightRole::norm, l);
  w.q = ld.need(name("attn_q"), {E, q_dim}, WeightRole::attention, l);
  w.k = ld.need(name("attn_k"), {E, kv_dim}, WeightRole::attention, l);
  w.v = ld.need(name("attn_v"), {E, kv_dim}, WeightRole::attention, l);
  if (spec.qkv_bias) {
    w.bq = ld.need(name("attn_q", "bias"), {q_dim}, WeightRole::attention, l);
    w.bk = ld.need(name("attn_k", "bias"), {kv_dim}, WeightRole::attention, l);
    w.bv = ld.need(name("attn_v", "bias"), {kv_dim}, WeightRole::attention, l);
  }
  if (spec.qk_norm) {
    w.q_norm = ld.maybe(name("attn_q_norm"), {D}, WeightRole::attention, l).value_or(kNoWeight);
    w.k_norm = ld.maybe(name("attn_k_norm"), {D}, WeightRole::attention, l).value_or(kNoWeight);
    if ((w.q_norm == kNoWeight) != (w.k_norm == kNoWeight))
      throw Error(ErrorCategory::format,
                  fmt::format("{}: layer {} has only one of attn_q_norm and attn_k_norm",
                              ld.file().path(), l));
  }
  w.o = ld.need(name("attn_output"), {q_dim, E}, WeightRole::attention, l);
  return w;
}

FfnWeights load_ffn(WeightLoader& ld, const Hparams& hp, int32_t l, FfnKind kind) {
  const int64_t E = hp.n_embd;
  auto name = [&](const char* t) { return fmt::format("blk.{}.{}.weight", l, t); };
  FfnWeights w;
  w.norm = ld.need(name("ffn_norm"), {E}, WeightRole::norm, l);
  if (kind == FfnKind::moe) {
    const int64_t X = hp.n_expert, FE = hp.n_ff_exp;
    w.router = ld.need(name("ffn_gate_inp"), {E, X}, WeightRole::router, l);
    w.gate = ld.need(name("ffn_gate_exps"), {E, FE, X}, WeightRole::routed_expert, l);
    w.up = ld.need(name("ffn_up_exps"), {E, FE, X}, WeightRole::routed_expert, l);
    w.down = ld.need(name("ffn_down_exps"), {FE, E, X}, WeightRole::routed_expert, l);
  } else {
    const int64_t F = hp.n_ff;
    w.gate = ld.need(name("ffn_gate"), {E, F}, WeightRole::dense_ffn, l);
    w.up = ld.need(name("ffn_up"), {E, F}, WeightRole::dense_ffn, l);
    w.down = ld.need(name("ffn_down"), {F, E}, WeightRole::dense_ffn, l);
  }
  return w;
}

ValueId attention_block(graph::Builder& b, const Hparams& hp, int32_t l, const AttentionSpec& spec,
                        const AttentionWeights& w, ValueId x) {
  const float eps = hp.rms_eps;
  const auto D = static_cast<int32_t>(hp.head_dim);
  const graph::RopeParams rope{.n_head = static_cast<int32_t>(hp.n_head),
                               .head_dim = D,
                               .n_rot = static_cast<int32_t>(hp.n_rot),
                               .freq_base = hp.rope_freq_base,
                               .mode = spec.rope};
  graph::RopeParams rope_k = rope;
  rope_k.n_head = static_cast<int32_t>(hp.n_head_kv);
  auto nm = [&](const char* t) { return fmt::format("blk.{}.{}", l, t); };
  ValueId h = b.rms_norm(x, w.norm, eps, nm("attn_norm"));
  ValueId q = b.matmul(h, w.q, nm("attn_q"));
  ValueId k = b.matmul(h, w.k, nm("attn_k"));
  ValueId v = b.matmul(h, w.v, nm("attn_v"));
  if (spec.qkv_bias) {
    q = b.add_bias(q, w.bq, nm("attn_q_bias"));
    k = b.add_bias(k, w.bk, nm("attn_k_bias"));
    v = b.add_bias(v, w.bv, nm("attn_v_bias"));
  }
  if (w.q_norm != kNoWeight) {
    q = b.rms_norm_grouped(q, w.q_norm, D, eps, nm("attn_q_norm"));
    k = b.rms_norm_grouped(k, w.k_norm, D, eps, nm("attn_k_norm"));
  }
  q = b.rope(q, rope, nm("rope_q"));
  k = b.rope(k, rope_k, nm("rope_k"));
  const graph::AttentionParams ap{.layer = l,
                                  .n_head = static_cast<int32_t>(hp.n_head),
                                  .n_head_kv = static_cast<int32_t>(hp.n_head_kv),
                                  .head_dim = D,
                                  .scale = 1.0f / std::sqrt(static_cast<float>(hp.head_dim))};
  ValueId a = b.attention(q, k, v, ap, nm("attn"));
  return b.add(x, b.matmul(a, w.o, nm("attn_output")), nm("attn_residual"));
}

ValueId ffn_block(graph::Builder& b, const Hparams& hp, int32_t l, FfnKind kind,
                  const FfnWeights& w, ValueId x) {
  auto nm = [&](const char* t) { return fmt::format("blk.{}.{}", l, t); };
  ValueId h = b.rms_norm(x, w.norm, hp.rms_eps, nm("ffn_norm"));
  ValueId d;
  if (kind == FfnKind::moe) {
    graph::MoeParams moe{.n_expert = static_cast<int32_t>(hp.n_expert),
                         .n_expert_used = static_cast<int32_t>(hp.n_expert_used),
                         .norm_weights = hp.expert_weights_norm};
    ValueId route = b.moe_route(b.matmul(h, w.router, nm("ffn_gate_inp")), moe, nm("ffn_route"));
    moe.gate = w.gate;
    moe.up = w.up;
    moe.down = w.down;
    d = b.moe_experts(h, route, moe, nm("ffn_moe"));
  } else {
    ValueId g = b.matmul(h, w.gate, nm("ffn_gate"));
    ValueId u = b.matmul(h, w.up, nm("ffn_up"));
    d = b.matmul(b.swiglu(g, u, nm("ffn_swiglu")), w.down, nm("ffn_down"));
  }
  return b.add(x, d, nm("ffn_residual"));
}

void check_variant(const gguf::File& f, const Hparams& hp, const std::vector<LayerSpec>& layers) {
  if (f.find_tensor("rope_freqs.weight"))
    throw Error(ErrorCategory::unsupported,
                fmt::format("{}: rope_freqs.weight (per-dimension RoPE frequency factors, as in "
                            "Llama 3.1) is not supported yet",
                            f.path()));
  if (auto st = f.get_string_opt(hp.arch + ".rope.scaling.type"); st && *st != "none")
    throw Error(ErrorCategory::unsupported,
                fmt::format("{}: {}.rope.scaling.type = '{}' is not supported yet", f.path(),
                            hp.arch, *st));
  bool any_moe = false;
  for (const LayerSpec& s : layers) any_moe = any_moe || s.ffn == FfnKind::moe;
  if (any_moe && hp.n_expert == 0)
    throw Error(
        ErrorCategory::format,
        fmt::format("{}: architecture '{}' needs {}.expert_count > 0", f.path(), hp.arch, hp.arch));
  if (!any_moe && hp.n_expert > 0)
    throw Error(ErrorCategory::unsupported,
                fmt::format("{}: {}.expert_count = {} but architecture '{}' has no experts",
                            f.path(), hp.arch, hp.n_expert, hp.arch));
}

namespace {

class Transformer final : public Model {
 public:
  Transformer(const gguf::File& f, Hparams hp, std::vector<LayerSpec> specs)
      : specs_(std::move(specs)) {
    hp_ = std::move(hp);
    WeightLoader ld(f, weights_);
    const int64_t E = hp_.n_embd, V = hp_.n_vocab;
    tok_embd_ = ld.need("token_embd.weight", {E, V}, WeightRole::embedding);
    for (int32_t l = 0; l < static_cast<int32_t>(hp_.n_layer); ++l) {
      const LayerSpec& s = specs_[static_cast<size_t>(l)];
      attn_.push_back(load_attention(ld, hp_, l, s.attn));
      ffn_.push_back(load_ffn(ld, hp_, l, s.ffn));
    }
    out_norm_ = ld.need("output_norm.weight", {E}, WeightRole::norm);
    output_ = ld.maybe("output.weight", {E, V}, WeightRole::head).value_or(tok_embd_);
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
    ValueId x = b.embed(tok_embd_, "token_embd");
    for (int32_t l = 0; l < static_cast<int32_t>(hp_.n_layer); ++l) {
      const LayerSpec& s = specs_[static_cast<size_t>(l)];
      x = attention_block(b, hp_, l, s.attn, attn_[static_cast<size_t>(l)], x);
      x = ffn_block(b, hp_, l, s.ffn, ffn_[static_cast<size_t>(l)], x);
    }
    if (n_outputs < n_tokens) x = b.take_last_rows(x, n_outputs, "outputs");
    x = b.rms_norm(x, out_norm_, hp_.rms_eps, "output_norm");
    return b.finish(b.matmul(x, output_, "output"));
  }

 private:
  std::vector<LayerSpec> specs_;
  std::vector<AttentionWeights> attn_;
  std::vector<FfnWeights> ffn_;
  graph::WeightId tok_embd_ = kNoWeight, out_norm_ = kNoWeight, output_ = kNoWeight;
};

}  // namespace

std::unique_ptr<Model> make_transformer(const gguf::File& f, Hparams hp,
                                        std::vector<LayerSpec> layers) {
  hp.n_vocab = f.tensor("token_embd.weight").ne[1];
  check_variant(f, hp, layers);
  return std::make_unique<Transformer>(f, std::move(hp), std::move(layers));
}

}  // namespace berth::models_detail
