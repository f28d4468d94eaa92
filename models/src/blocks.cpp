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
  w.q =
      ld.need(name("attn_q"), {E, spec.output_gate ? 2 * q_dim : q_dim}, WeightRole::attention, l);
  w.k = ld.need(name("attn_k"), {E, kv_dim}, WeightRole::attention, l);
  w.v = ld.need(name("attn_v"), {E, kv_dim}, WeightRole::attention, l);
  if (spec.qkv_bias) {
    w.bq = ld.need(name("attn_q", "bias"), {q_dim}, WeightRole::attention, l);
    w.bk = ld.need(name("attn_k", "bias"), {kv_dim}, WeightRole::attention, l);
    w.bv = ld.need(name("attn_v", "bias"), {kv_dim}, WeightRole::attention, l);
  }
  if (spec.qk_norm && spec.output_gate) {
    w.q_norm = ld.need(name("attn_q_norm"), {D}, WeightRole::attention, l);
    w.k_norm = ld.need(name("attn_k_norm"), {D}, WeightRole::attention, l);
  } else if (spec.qk_norm) {
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

FfnWeights load_ffn(WeightLoader& ld, const Hparams& hp, int32_t l, const LayerSpec& spec) {
  const int64_t E = hp.n_embd;
  auto name = [&](const char* t) { return fmt::format("blk.{}.{}.weight", l, t); };
  FfnWeights w;
  w.norm = ld.need(name(spec.ffn_norm), {E}, WeightRole::norm, l);
  if (spec.ffn == FfnKind::moe && spec.shared_expert) {
    const int64_t FS = hp.n_ff_shexp;
    w.sh_gate_inp = ld.need(name("ffn_gate_inp_shexp"), {E}, WeightRole::shared_expert, l);
    w.sh_gate = ld.need(name("ffn_gate_shexp"), {E, FS}, WeightRole::shared_expert, l);
    w.sh_up = ld.need(name("ffn_up_shexp"), {E, FS}, WeightRole::shared_expert, l);
    w.sh_down = ld.need(name("ffn_down_shexp"), {FS, E}, WeightRole::shared_expert, l);
  }
  if (spec.ffn == FfnKind::moe) {
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

GdnWeights load_gdn(WeightLoader& ld, const Hparams& hp, int32_t l) {
  const int64_t E = hp.n_embd, HV = hp.ssm_dt_rank, DK = hp.ssm_d_state;
  const int64_t key_dim = hp.ssm_n_group * DK, value_dim = hp.ssm_d_inner;
  const int64_t C = 2 * key_dim + value_dim;
  auto name = [&](const char* t, const char* kind = "weight") {
    return fmt::format("blk.{}.{}{}{}", l, t, *kind ? "." : "", kind);
  };
  // The GDN's projections, conv and gates count as attention (the layer's token mixer) for
  // placement; its output norm as a norm.
  GdnWeights w;
  w.norm = ld.need(name("attn_norm"), {E}, WeightRole::norm, l);
  w.qkv = ld.need(name("attn_qkv"), {E, C}, WeightRole::attention, l);
  w.z = ld.need(name("attn_gate"), {E, value_dim}, WeightRole::attention, l);
  w.beta = ld.need(name("ssm_beta"), {E, HV}, WeightRole::attention, l);
  w.alpha = ld.need(name("ssm_alpha"), {E, HV}, WeightRole::attention, l);
  w.conv = ld.need(name("ssm_conv1d"), {hp.ssm_conv_kernel, C}, WeightRole::attention, l);
  w.dt_bias = ld.need(name("ssm_dt", "bias"), {HV}, WeightRole::attention, l);
  w.a = ld.need(name("ssm_a", ""), {HV}, WeightRole::attention, l);
  w.ssm_norm = ld.need(name("ssm_norm"), {value_dim / HV}, WeightRole::norm, l);
  w.out = ld.need(name("ssm_out"), {value_dim, E}, WeightRole::attention, l);
  for (graph::WeightId id : {w.conv, w.dt_bias, w.a})
    if (ld.table()[id].type != GgmlType::F32)
      throw Error(ErrorCategory::unsupported,
                  fmt::format("{}: tensor '{}' is {}; berth reads it as F32 only", ld.file().path(),
                              ld.table()[id].name, type_name(ld.table()[id].type)));
  return w;
}

KvLayer gdn_state(const Hparams& hp) {
  const int64_t C = 2 * hp.ssm_n_group * hp.ssm_d_state + hp.ssm_d_inner;
  return KvLayer{.conv_dim = (hp.ssm_conv_kernel - 1) * C,
                 .ssm_dim = hp.ssm_d_inner * hp.ssm_d_state};
}

ValueId gdn_block(graph::Builder& b, const Hparams& hp, int32_t l, const GdnWeights& w, ValueId x) {
  auto nm = [&](const char* t) { return fmt::format("blk.{}.{}", l, t); };
  const auto d_v = static_cast<int32_t>(hp.ssm_d_inner / hp.ssm_dt_rank);
  ValueId h = b.rms_norm(x, w.norm, hp.rms_eps, nm("attn_norm"));
  ValueId qkv = b.matmul(h, w.qkv, nm("attn_qkv"));
  ValueId z = b.matmul(h, w.z, nm("attn_gate"));
  ValueId beta = b.matmul(h, w.beta, nm("ssm_beta"));
  ValueId alpha = b.matmul(h, w.alpha, nm("ssm_alpha"));
  const graph::SsmParams p{.layer = l,
                           .n_k_head = static_cast<int32_t>(hp.ssm_n_group),
                           .n_v_head = static_cast<int32_t>(hp.ssm_dt_rank),
                           .d_k = static_cast<int32_t>(hp.ssm_d_state),
                           .d_v = d_v,
                           .eps = hp.rms_eps,
                           .dt_bias = w.dt_bias};
  ValueId y = b.ssm_conv(qkv, w.conv, p, nm("ssm_conv"));
  ValueId o = b.gated_delta(y, alpha, beta, w.a, p, nm("gated_delta"));
  o = b.rms_norm_gated(o, z, w.ssm_norm, d_v, hp.rms_eps, nm("ssm_norm"));
  return b.add(x, b.matmul(o, w.out, nm("ssm_out")), nm("gdn_residual"));
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
  ValueId k = b.matmul(h, w.k, nm("attn_k"));  // consecutive matmuls of h: one parallel region
  ValueId v = b.matmul(h, w.v, nm("attn_v"));
  ValueId gate = graph::kNoValue;
  if (spec.output_gate) {  // per head: D query columns, then D gate columns
    gate = b.head_slice(q, {.group = 2 * D, .offset = D, .len = D}, nm("attn_gate"));
    q = b.head_slice(q, {.group = 2 * D, .offset = 0, .len = D}, nm("attn_q_heads"));
  }
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
  if (spec.output_gate) a = b.sigmoid_mul(a, gate, nm("attn_gated"));
  return b.add(x, b.matmul(a, w.o, nm("attn_output")), nm("attn_residual"));
}

ValueId ffn_block(graph::Builder& b, const Hparams& hp, int32_t l, const LayerSpec& spec,
                  const FfnWeights& w, ValueId x) {
  auto nm = [&](const char* t) { return fmt::format("blk.{}.{}", l, t); };
  ValueId h = b.rms_norm(x, w.norm, hp.rms_eps, nm(spec.ffn_norm));
  ValueId d;
  if (spec.ffn == FfnKind::moe) {
    graph::MoeParams moe{.n_expert = static_cast<int32_t>(hp.n_expert),
                         .n_expert_used = static_cast<int32_t>(hp.n_expert_used),
                         .norm_weights = hp.expert_weights_norm};
    ValueId route = b.moe_route(b.matmul(h, w.router, nm("ffn_gate_inp")), moe, nm("ffn_route"));
    moe.gate = w.gate;
    moe.up = w.up;
    moe.down = w.down;
    d = b.moe_experts(h, route, moe, nm("ffn_moe"));
    if (spec.shared_expert) {
      ValueId sg = b.matmul(h, w.sh_gate, nm("ffn_gate_shexp"));
      ValueId su = b.matmul(h, w.sh_up, nm("ffn_up_shexp"));
      ValueId gi = b.matmul(h, w.sh_gate_inp, nm("ffn_gate_inp_shexp"));  // [rows, 1]
      ValueId sd =
          b.matmul(b.swiglu(sg, su, nm("ffn_swiglu_shexp")), w.sh_down, nm("ffn_down_shexp"));
      d = b.add(d, b.sigmoid_mul(sd, gi, nm("ffn_shexp_gated")), nm("ffn_moe_shexp"));
    }
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
  for (const LayerSpec& s : layers)
    if (s.shared_expert && hp.n_ff_shexp <= 0)
      throw Error(ErrorCategory::format,
                  fmt::format("{}: architecture '{}' needs {}.expert_shared_feed_forward_length > "
                              "0 (its layers have a shared expert)",
                              f.path(), hp.arch, hp.arch));
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
      if (s.mixer == MixerKind::gdn) {
        attn_.emplace_back();
        gdn_.push_back(load_gdn(ld, hp_, l));
      } else {
        attn_.push_back(load_attention(ld, hp_, l, s.attn));
        gdn_.emplace_back();
      }
      ffn_.push_back(load_ffn(ld, hp_, l, s));
    }
    out_norm_ = ld.need("output_norm.weight", {E}, WeightRole::norm);
    output_ = ld.maybe("output.weight", {E, V}, WeightRole::head).value_or(tok_embd_);
  }

  std::vector<KvLayer> kv_layers() const override {
    const int64_t kv_dim = hp_.n_head_kv * hp_.head_dim;
    std::vector<KvLayer> kv;
    for (const LayerSpec& s : specs_)
      kv.push_back(s.mixer == MixerKind::gdn ? gdn_state(hp_) : KvLayer{kv_dim, kv_dim});
    return kv;
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
      x = s.mixer == MixerKind::gdn
              ? gdn_block(b, hp_, l, gdn_[static_cast<size_t>(l)], x)
              : attention_block(b, hp_, l, s.attn, attn_[static_cast<size_t>(l)], x);
      x = ffn_block(b, hp_, l, s, ffn_[static_cast<size_t>(l)], x);
    }
    if (n_outputs < n_tokens) x = b.take_last_rows(x, n_outputs, "outputs");
    x = b.rms_norm(x, out_norm_, hp_.rms_eps, "output_norm");
    return b.finish(b.matmul(x, output_, "output"));
  }

 private:
  std::vector<LayerSpec> specs_;
  std::vector<AttentionWeights> attn_;  // default (no weights) on GDN layers
  std::vector<GdnWeights> gdn_;         // default on attention layers
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
