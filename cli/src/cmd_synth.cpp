// `berth synth`: write a synthetic GGUF model (random weights of realistic scale) of a preset
// or a given shape. See runtime/include/berth/tools/synth.h for the file it writes.
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>

#include "berth/core/error.h"
#include "berth/tools/synth.h"
#include "commands.h"

namespace berth::cli {
namespace {

struct SynthOptions {
  std::string arch, preset, type, out, vocab;
  uint64_t seed = 0;
  double router_skew = 0.0;
  int32_t n_threads = 0;
  bool sparse = false;
  // Shape flags: nullopt when not given (the preset's value, or the default, applies).
  std::optional<int64_t> n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_ctx,
      n_expert, n_expert_used, n_ff_exp, n_rot, full_attention_interval, ssm_d_conv, ssm_d_state,
      ssm_n_group, ssm_dt_rank, n_ff_shexp, n_mtp;
  std::optional<float> rope_base;
};

std::string human_time(double s) {
  if (!(s >= 0.0) || s > 1e7) return "?";
  const auto t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02}m{:02}s", t / 3600, t / 60 % 60, t % 60);
  if (t >= 60) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

int synth(const SynthOptions& o) {
  SynthSpec s;
  if (!o.preset.empty()) {
    s = synth_preset(o.preset);
    if (!o.arch.empty() && o.arch != s.arch)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("--arch {} does not match preset '{}' (architecture {})", o.arch,
                              o.preset, s.arch));
  } else {
    std::string missing;
    auto need = [&](bool given, const char* flag) {
      if (!given) missing += std::string(missing.empty() ? "" : ", ") + flag;
    };
    need(!o.arch.empty(), "--arch");
    need(o.n_layer.has_value(), "--n-layer");
    need(o.n_embd.has_value(), "--n-embd");
    need(o.n_head.has_value(), "--n-head");
    // qwen35moe has no dense FFN (its feed_forward_length is optional).
    need(o.n_ff.has_value() || o.arch == "qwen35moe", "--n-ff");
    if (o.arch == "qwen35" || o.arch == "qwen35moe") {  // the GDN layers' shape
      need(o.ssm_d_state.has_value(), "--ssm-d-state");
      need(o.ssm_n_group.has_value(), "--ssm-n-group");
      need(o.ssm_dt_rank.has_value(), "--ssm-dt-rank");
    }
    need(o.n_vocab.has_value() || !o.vocab.empty(), "--n-vocab");
    if (!missing.empty()) {
      std::fprintf(stderr,
                   "berth: error: synth needs --preset or the shape flags; missing: %s (run "
                   "'berth synth --help' for usage)\n",
                   missing.c_str());
      return 2;
    }
    s.arch = o.arch;
    s.name = "custom";
    if (s.arch != "llama") {  // Qwen's defaults
      s.rope_freq_base = 1e6f;
      s.rms_eps = 1e-6f;
    }
  }
  if (o.n_layer) s.n_layer = *o.n_layer;
  if (o.n_embd) s.n_embd = *o.n_embd;
  if (o.n_head) s.n_head = *o.n_head;
  if (o.n_head_kv) s.n_head_kv = *o.n_head_kv;
  if (o.head_dim) s.head_dim = *o.head_dim;
  if (o.n_ff) s.n_ff = *o.n_ff;
  if (o.n_vocab) s.n_vocab = *o.n_vocab;
  if (o.n_ctx) s.n_ctx_train = *o.n_ctx;
  if (o.n_expert) s.n_expert = *o.n_expert;
  if (o.n_expert_used) s.n_expert_used = *o.n_expert_used;
  if (o.n_ff_exp) s.n_ff_exp = *o.n_ff_exp;
  if (o.rope_base) s.rope_freq_base = *o.rope_base;
  if (o.n_rot) s.n_rot = *o.n_rot;
  if (o.full_attention_interval) s.full_attention_interval = *o.full_attention_interval;
  if (o.ssm_d_conv) s.ssm_d_conv = *o.ssm_d_conv;
  if (o.ssm_d_state) s.ssm_d_state = *o.ssm_d_state;
  if (o.ssm_n_group) s.ssm_n_group = *o.ssm_n_group;
  if (o.ssm_dt_rank) s.ssm_dt_rank = *o.ssm_dt_rank;
  if (o.n_ff_shexp) s.n_ff_shexp = *o.n_ff_shexp;
  if (o.n_mtp) s.n_mtp = *o.n_mtp;
  s.type = o.type;
  s.seed = o.seed;
  s.router_skew = o.router_skew;
  s.vocab_path = o.vocab;
  s.sparse = o.sparse;
  validate_synth_spec(s);  // before any file work
  if ((s.arch == "qwen35" || s.arch == "qwen35moe") && s.full_attention_interval > s.n_layer)
    std::fprintf(stderr,
                 "berth: warning: --full-attention-interval %lld is beyond --n-layer %lld: every "
                 "layer is Gated DeltaNet; berth run and serve refuse such a file (it is for the "
                 "oracle and kernel tests)\n",
                 static_cast<long long>(s.full_attention_interval),
                 static_cast<long long>(s.n_layer));

  const bool tty = isatty(STDERR_FILENO) != 0;
  const auto t0 = std::chrono::steady_clock::now();
  double last = -1.0;
  uint64_t total_bytes = 0;
  for (const SynthTensor& t : synth_tensor_plan(s)) {
    uint64_t rows = 1;
    for (size_t i = 1; i < t.ne.size(); ++i) rows *= static_cast<uint64_t>(t.ne[i]);
    total_bytes += rows * row_bytes(t.type, t.ne[0]);
  }
  auto progress = [&](double f) {
    const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double every = tty ? 0.25 : 5.0;
    if (f < 1.0 && el - last < every) return;
    last = el;
    const double gb = f * static_cast<double>(total_bytes) / 1e9;
    const double rate = el > 0 ? gb / el : 0.0;
    std::fprintf(
        stderr, "%ssynth: %5.1f%%  %.2f / %.2f GB  %.1f MB/s  ETA %s%s", tty ? "\r" : "", 100.0 * f,
        gb, static_cast<double>(total_bytes) / 1e9, rate * 1e3,
        human_time(rate > 0 ? (static_cast<double>(total_bytes) / 1e9 - gb) / rate : -1).c_str(),
        tty ? "   " : "\n");
    std::fflush(stderr);
  };
  SynthStats st = write_synth_model(s, o.out, o.n_threads, progress);
  if (tty) std::fputc('\n', stderr);

  std::string out = fmt::format(
      "{}: {} '{}' ({}), {} tensors, {} parameters, {:.3f} GB in {:.1f} s ({:.1f} MB/s)\n", o.out,
      s.arch, s.name, s.type, st.n_tensors, st.n_params,
      static_cast<double>(st.bytes_written) / 1e9, st.seconds,
      st.seconds > 0 ? static_cast<double>(st.bytes_written) / 1e6 / st.seconds : 0.0);
  if (!st.notes.empty()) {
    out += fmt::format("{} matrices stay f32:\n", st.notes.size());
    for (size_t i = 0; i < st.notes.size() && i < 8; ++i) out += "  " + st.notes[i] + "\n";
    if (st.notes.size() > 8) out += fmt::format("  ... ({} more)\n", st.notes.size() - 8);
  }
  (void)write_stdout(out);
  return 0;
}

}  // namespace

Runner add_synth(CLI::App& app) {
  auto o = std::make_shared<SynthOptions>();
  std::string presets;
  for (const std::string& p : synth_presets()) presets += (presets.empty() ? "" : ", ") + p;
  CLI::App* sub = app.add_subcommand(
      "synth", "write a synthetic GGUF model (random weights of realistic scale) for testing");
  sub->add_option("--arch", o->arch,
                  "architecture: llama, qwen2, qwen3, qwen3moe, qwen35, qwen35moe");
  sub->add_option("--preset", o->preset, "a named shape: " + presets);
  sub->add_option("--type", o->type,
                  "weight type: f32 f16 bf16 q4_0 q4_1 q5_0 q5_1 q8_0 q2_k q3_k q4_k q5_k q6_k "
                  "or q4_k_m (llama.cpp's Q4_K_M mix)")
      ->required();
  sub->add_option("-s,--seed", o->seed, "random seed (same seed, same bytes)")
      ->capture_default_str();
  sub->add_option("-o,--output", o->out, "GGUF file to write")->required();
  sub->add_option("--vocab", o->vocab,
                  "Hugging Face tokenizer.json to use instead of the synthetic vocabulary");
  sub->add_option("--router-skew", o->router_skew,
                  "Zipf exponent A of expert popularity, p(rank r) ~ 1/r^A (0: uniform)")
      ->check(range(0.0, 100.0))
      ->capture_default_str();
  sub->add_option("-t,--threads", o->n_threads, "worker threads (0: all physical cores)")
      ->check(range(0, 4096))
      ->capture_default_str();
  sub->add_option("--n-layer", o->n_layer, "block_count (overrides the preset's)");
  sub->add_option("--n-embd", o->n_embd, "embedding_length");
  sub->add_option("--n-head", o->n_head, "attention.head_count");
  sub->add_option("--n-head-kv", o->n_head_kv, "attention.head_count_kv (default: n_head)");
  sub->add_option("--head-dim", o->head_dim, "attention.key_length (default: n_embd / n_head)");
  sub->add_option("--n-ff", o->n_ff, "feed_forward_length (Mixtral: the expert size)");
  sub->add_option("--n-vocab", o->n_vocab, "vocabulary size (rows of token_embd)");
  sub->add_option("--n-ctx", o->n_ctx, "context_length (default 4096)");
  sub->add_option("--n-expert", o->n_expert, "expert_count (0: dense)");
  sub->add_option("--n-expert-used", o->n_expert_used, "expert_used_count");
  sub->add_option("--n-ff-exp", o->n_ff_exp, "expert_feed_forward_length (qwen3moe)");
  sub->add_option("--rope-base", o->rope_base, "rope.freq_base (default 10000; qwen 1e6)");
  sub->add_option("--n-rot", o->n_rot, "rope.dimension_count (qwen35*; default head_dim / 4)");
  sub->add_option("--full-attention-interval", o->full_attention_interval,
                  "qwen35*: every N-th layer is full attention, the others Gated DeltaNet "
                  "(default 4)");
  sub->add_option("--ssm-d-conv", o->ssm_d_conv, "qwen35*: ssm.conv_kernel (default 4)");
  sub->add_option("--ssm-d-state", o->ssm_d_state, "qwen35*: ssm.state_size, the GDN head dim");
  sub->add_option("--ssm-n-group", o->ssm_n_group, "qwen35*: ssm.group_count, GDN K heads");
  sub->add_option("--ssm-dt-rank", o->ssm_dt_rank,
                  "qwen35*: ssm.time_step_rank, GDN V heads (a multiple of the K heads)");
  sub->add_option("--n-ff-shexp", o->n_ff_shexp,
                  "qwen35moe: expert_shared_feed_forward_length (0: no shared expert)");
  sub->add_option("--n-mtp", o->n_mtp,
                  "qwen35*: 1 writes the MTP block blk.{n_layer}.nextn.* (0: none)");
  sub->add_flag("--sparse", o->sparse,
                "write only the header and tensor infos; the tensor data is a hole of zeros (a "
                "sparse file, no disk space): for `berth plan` on shapes larger than the disk, "
                "not for running");
  return [o] { return synth(*o); };
}

}  // namespace berth::cli
