// The Qwen3.5 hybrids, GGUF architectures `qwen35` (dense FFN) and `qwen35moe` (routed experts
// plus a sigmoid-gated shared expert when expert_shared_feed_forward_length > 0): every
// full_attention_interval-th layer (layer i with (i + 1) % interval == 0, default 4) is gated
// attention (attn_q holds a per-head output gate, per-head Q/K RMSNorm, NeoX rotary on the first
// rope.dimension_count dims of each head), the others Gated DeltaNet layers with a recurrent state
// (blocks.h). The FFN's norm is stored as post_attention_norm. Facts:
// ../shared/notes/qwen35-hybrid.md, cross-checked against ik_llama.cpp (docs/qwen35-crosscheck.md).
//
// Conversions baked into the files that berth relies on: norms stored as 1 + w (applied as
// stored; ssm_norm is not shifted), ssm_a stored as -exp(A_log), V heads tiled so that V head h
// reads K head h mod H_k (gated_delta does that). The MTP block (nextn_predict_layers layers
// after the main ones, blk.{n_layer}.nextn.*, counted in block_count) is not run: its tensors
// are skipped (Hparams::n_layer_skipped). Multimodal rotary sections
// (rope.dimension_sections) reduce to plain NeoX pairs for text, where every section has the
// same position.
#include <fmt/format.h>

#include "berth/core/error.h"
#include "berth/io/gguf.h"
#include "blocks.h"

namespace berth {

namespace {

using namespace models_detail;

// A required hybrid key; Error(format) naming the key and the file when absent.
int64_t need_key(const gguf::File& f, const std::string& arch, const char* key) {
  const std::string k = arch + "." + key;
  if (!f.has(k))
    throw Error(ErrorCategory::format,
                fmt::format("{}: metadata key '{}' is missing (architecture '{}' needs it)",
                            f.path(), k, arch));
  return f.get_int(k);
}

std::unique_ptr<Model> make_qwen35_family(const gguf::File& file, bool moe) {
  Hparams hp = read_hparams(file);
  const std::string& a = hp.arch;
  auto bad = [&](const std::string& what) {
    throw Error(ErrorCategory::format, fmt::format("{}: {}", file.path(), what));
  };
  const int64_t block_count = hp.n_layer;
  hp.n_layer_skipped = file.get_int_opt(a + ".nextn_predict_layers").value_or(0);
  if (hp.n_layer_skipped < 0 || hp.n_layer_skipped >= block_count)
    bad(fmt::format("{}.nextn_predict_layers = {} must be in 0..block_count - 1 ({})", a,
                    hp.n_layer_skipped, block_count - 1));
  hp.n_layer = block_count - hp.n_layer_skipped;
  hp.full_attention_interval = file.get_int_opt(a + ".full_attention_interval").value_or(4);
  hp.ssm_conv_kernel = need_key(file, a, "ssm.conv_kernel");
  hp.ssm_d_state = need_key(file, a, "ssm.state_size");
  hp.ssm_n_group = need_key(file, a, "ssm.group_count");
  hp.ssm_dt_rank = need_key(file, a, "ssm.time_step_rank");
  hp.ssm_d_inner = need_key(file, a, "ssm.inner_size");
  auto range = [&](int64_t v, int64_t lo, int64_t hi, const char* key) {
    if (v < lo || v > hi) bad(fmt::format("{}.{} = {} must be in {}..{}", a, key, v, lo, hi));
  };
  if (hp.full_attention_interval < 1 || hp.full_attention_interval > hp.n_layer)
    bad(hp.n_layer_skipped > 0
            ? fmt::format("{}.full_attention_interval = {} must be in 1..{} (the layers left of "
                          "{}.block_count {} after {}.nextn_predict_layers {})",
                          a, hp.full_attention_interval, hp.n_layer, a, block_count, a,
                          hp.n_layer_skipped)
            : fmt::format("{}.full_attention_interval = {} must be in 1..{} ({}.block_count)", a,
                          hp.full_attention_interval, hp.n_layer, a));
  range(hp.ssm_conv_kernel, 2, 8, "ssm.conv_kernel");
  range(hp.ssm_d_state, 1, 4096, "ssm.state_size");
  range(hp.ssm_n_group, 1, 4096, "ssm.group_count");
  range(hp.ssm_dt_rank, 1, 4096, "ssm.time_step_rank");
  range(hp.ssm_d_inner, 1, int64_t{1} << 24, "ssm.inner_size");
  if (hp.ssm_dt_rank % hp.ssm_n_group != 0)
    bad(
        fmt::format("{}.ssm.time_step_rank ({}, the GDN V heads) is not a multiple of "
                    "{}.ssm.group_count ({}, the K heads)",
                    a, hp.ssm_dt_rank, a, hp.ssm_n_group));
  if (hp.ssm_d_inner % hp.ssm_dt_rank != 0)
    bad(fmt::format("{}.ssm.inner_size ({}) is not a multiple of {}.ssm.time_step_rank ({})", a,
                    hp.ssm_d_inner, a, hp.ssm_dt_rank));
  if (moe) {
    // Absent or 0: no shared expert (the released models all have one).
    hp.n_ff_shexp = file.get_int_opt(a + ".expert_shared_feed_forward_length").value_or(0);
    range(hp.n_ff_shexp, 0, int64_t{1} << 24, "expert_shared_feed_forward_length");
    if (hp.n_ff_shexp == 0)
      for (const char* t : {"ffn_up_shexp", "ffn_gate_inp_shexp"})
        if (const std::string n = fmt::format("blk.0.{}.weight", t); file.find_tensor(n))
          bad(fmt::format(
              "{}.expert_shared_feed_forward_length is {} but the file has the shared "
              "expert's tensors ({})",
              a, file.has(a + ".expert_shared_feed_forward_length") ? "0" : "missing", n));
  }
  std::vector<LayerSpec> layers;
  for (int64_t l = 0; l < hp.n_layer; ++l) {
    LayerSpec s{.ffn = moe ? FfnKind::moe : FfnKind::dense,
                .shared_expert = moe && hp.n_ff_shexp > 0,
                .ffn_norm = "post_attention_norm"};
    const bool attn = (l + 1) % hp.full_attention_interval == 0;
    if (attn)
      s.attn = {.rope = graph::RopeMode::neox, .qk_norm = true, .output_gate = true};
    else
      s.mixer = MixerKind::gdn;
    // A per-layer head_count_kv must be 0 exactly on the GDN layers.
    if (!hp.n_head_kv_layer.empty()) {
      if (hp.n_head_kv_layer.size() != static_cast<size_t>(block_count))
        bad(fmt::format("{}.attention.head_count_kv has {} entries, block_count is {}", a,
                        hp.n_head_kv_layer.size(), block_count));
      if ((hp.n_head_kv_layer[static_cast<size_t>(l)] != 0) != attn)
        bad(
            fmt::format("{}.attention.head_count_kv[{}] = {} but layer {} is {} "
                        "(full_attention_interval {})",
                        a, l, hp.n_head_kv_layer[static_cast<size_t>(l)], l,
                        attn ? "full attention" : "Gated DeltaNet", hp.full_attention_interval));
    }
    layers.push_back(s);
  }
  return make_transformer(file, hp, std::move(layers));
}

}  // namespace

std::unique_ptr<Model> make_qwen35(const gguf::File& file) {
  return make_qwen35_family(file, false);
}

std::unique_ptr<Model> make_qwen35moe(const gguf::File& file) {
  return make_qwen35_family(file, true);
}

}  // namespace berth
