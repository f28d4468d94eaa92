#include <fmt/format.h>

#include <cmath>

#include "berth/core/error.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"

namespace berth {

Hparams read_hparams(const gguf::File& f) {
  Hparams hp;
  hp.arch = f.architecture();
  const std::string p = hp.arch + ".";
  auto req = [&](const char* k) { return f.get_int(p + k); };
  auto opt = [&](const char* k) { return f.get_int_opt(p + k); };

  hp.n_embd = req("embedding_length");
  hp.n_layer = req("block_count");
  hp.n_head = req("attention.head_count");
  // attention.head_count_kv: a scalar, or (Qwen3.5 hybrids) one value per layer with 0 on the
  // layers without attention; the non-zero entries must agree.
  const gguf::Value* kv_val = f.find(p + "attention.head_count_kv");
  if (kv_val && kv_val->type() == gguf::ValueType::array) {
    hp.n_head_kv_layer = f.get_int_array(p + "attention.head_count_kv");
    hp.n_head_kv = 0;
    for (int64_t v : hp.n_head_kv_layer) {
      if (v < 0 || (v > 0 && hp.n_head_kv > 0 && v != hp.n_head_kv))
        throw Error(ErrorCategory::unsupported,
                    fmt::format("{}: {}attention.head_count_kv holds per-layer values {} and {}: "
                                "only one non-zero value is supported",
                                f.path(), p, hp.n_head_kv, v));
      if (v > 0) hp.n_head_kv = v;
    }
    if (hp.n_head_kv == 0) hp.n_head_kv = hp.n_head;  // no attention layer at all
  } else {
    hp.n_head_kv = opt("attention.head_count_kv").value_or(hp.n_head);
  }
  // qwen35moe files may leave out the dense FFN width (every layer has experts).
  hp.n_ff =
      hp.arch == "qwen35moe" ? opt("feed_forward_length").value_or(0) : req("feed_forward_length");
  hp.n_ctx_train = req("context_length");
  hp.rms_eps = static_cast<float>(f.get_float(p + "attention.layer_norm_rms_epsilon"));
  hp.rope_freq_base = static_cast<float>(f.get_float_opt(p + "rope.freq_base").value_or(10000.0));

  // Bounds keep later arithmetic (n_head * head_dim, KV sizes) far from overflow; real models
  // are orders of magnitude below them.
  auto positive = [&](int64_t v, const char* key) {
    if (v <= 0 || v > (int64_t{1} << 24))
      throw Error(ErrorCategory::format,
                  fmt::format("{}: {}{} = {} is out of range", f.path(), p, key, v));
  };
  positive(hp.n_embd, "embedding_length");
  positive(hp.n_layer, "block_count");
  positive(hp.n_head, "attention.head_count");
  positive(hp.n_head_kv, "attention.head_count_kv");
  if (hp.n_ff != 0 || hp.arch != "qwen35moe") positive(hp.n_ff, "feed_forward_length");
  positive(hp.n_ctx_train, "context_length");
  // Every layer needs tensors of its own, so a file cannot have more layers than tensors.
  if (hp.n_layer > static_cast<int64_t>(f.tensors().size()))
    throw Error(ErrorCategory::format,
                fmt::format("{}: {}block_count = {} but the file has only {} tensors", f.path(), p,
                            hp.n_layer, f.tensors().size()));
  if (hp.n_head % hp.n_head_kv != 0)
    throw Error(ErrorCategory::format,
                fmt::format("{}: {}attention.head_count ({}) is not a multiple of "
                            "{}attention.head_count_kv ({})",
                            f.path(), p, hp.n_head, p, hp.n_head_kv));
  if (auto kl = opt("attention.key_length")) {
    hp.head_dim = *kl;
  } else {
    if (hp.n_embd % hp.n_head != 0)
      throw Error(ErrorCategory::format,
                  fmt::format("{}: {}embedding_length ({}) is not a multiple of "
                              "{}attention.head_count ({})",
                              f.path(), p, hp.n_embd, p, hp.n_head));
    hp.head_dim = hp.n_embd / hp.n_head;
  }
  positive(hp.head_dim, "attention.key_length");
  if (auto vl = opt("attention.value_length"); vl && *vl != hp.head_dim)
    throw Error(ErrorCategory::unsupported,
                fmt::format("{}: {}attention.value_length ({}) differs from key_length ({})",
                            f.path(), p, *vl, hp.head_dim));
  hp.n_rot = opt("rope.dimension_count").value_or(hp.head_dim);
  if (hp.n_rot <= 0 || hp.n_rot > hp.head_dim || hp.n_rot % 2 != 0)
    throw Error(ErrorCategory::format,
                fmt::format("{}: {}rope.dimension_count = {} must be even and in 1..{} (head_dim: "
                            "{}attention.key_length, or embedding_length / attention.head_count)",
                            f.path(), p, hp.n_rot, hp.head_dim, p));
  if (!(hp.rms_eps > 0.0f) || std::isinf(hp.rms_eps))
    throw Error(
        ErrorCategory::format,
        fmt::format("{}: {}attention.layer_norm_rms_epsilon = {} must be finite and positive",
                    f.path(), p, hp.rms_eps));
  if (!(hp.rope_freq_base > 0.0f) || std::isinf(hp.rope_freq_base))
    throw Error(ErrorCategory::format,
                fmt::format("{}: {}rope.freq_base = {} must be finite and positive", f.path(), p,
                            hp.rope_freq_base));
  hp.n_expert = opt("expert_count").value_or(0);
  if (hp.n_expert < 0 || hp.n_expert > 65536)
    throw Error(ErrorCategory::format,
                fmt::format("{}: {}expert_count = {} is out of range", f.path(), p, hp.n_expert));
  if (hp.n_expert > 0) {
    hp.n_expert_used = req("expert_used_count");
    if (hp.n_expert_used < 1 || hp.n_expert_used > hp.n_expert)
      throw Error(ErrorCategory::format,
                  fmt::format("{}: {}expert_used_count = {} must be in 1..{}expert_count ({})",
                              f.path(), p, hp.n_expert_used, p, hp.n_expert));
    hp.n_ff_exp = opt("expert_feed_forward_length").value_or(hp.n_ff);
    positive(hp.n_ff_exp, "expert_feed_forward_length");
    if (f.has(p + "expert_weights_norm"))
      hp.expert_weights_norm = f.get_bool(p + "expert_weights_norm");
  }
  return hp;
}

}  // namespace berth
