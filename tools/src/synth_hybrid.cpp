// The Qwen3.5 hybrids of berth synth (synth.h): spec checks, the tensors of a Gated DeltaNet,
// attention or MTP layer, and the metadata keys llama.cpp and ik_llama.cpp read for qwen35 /
// qwen35moe (src/llama-hparams.cpp, src/llama-load-tensors.cpp; names and shapes, not code).
#include <fmt/format.h>

#include <cmath>
#include <string>

#include "berth/core/error.h"
#include "synth_internal.h"

namespace berth::synth_detail {
namespace {

[[noreturn]] void bad(const std::string& msg) { throw Error(ErrorCategory::invalid_argument, msg); }

float in_std(int64_t n_in) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(n_in)));
}

}  // namespace

bool is_hybrid_arch(std::string_view arch) { return arch == "qwen35" || arch == "qwen35moe"; }

void check_hybrid_spec(const SynthSpec& s) {
  auto range = [](int64_t v, int64_t lo, int64_t hi, const char* field, const char* flag) {
    if (v < lo || v > hi) bad(fmt::format("{}: {} = {} must be in {}..{}", flag, field, v, lo, hi));
  };
  range(s.ssm_d_state, 1, 4096, "ssm_d_state", "--ssm-d-state");
  range(s.ssm_n_group, 1, 4096, "ssm_n_group", "--ssm-n-group");
  range(s.ssm_dt_rank, 1, 4096, "ssm_dt_rank", "--ssm-dt-rank");
  range(s.ssm_d_conv, 2, 8, "ssm_d_conv", "--ssm-d-conv");  // the loader's range
  // An interval beyond n_layer is allowed: a file of Gated DeltaNet layers only, which the
  // oracle and kernel tests read but the loader refuses (berth synth warns).
  range(s.full_attention_interval, 1, 4096, "full_attention_interval", "--full-attention-interval");
  range(s.n_mtp, 0, 1, "n_mtp", "--n-mtp");
  if (s.ssm_dt_rank % s.ssm_n_group != 0)
    bad(fmt::format("--ssm-dt-rank: the GDN V heads ({}) must be a multiple of the K heads ({})",
                    s.ssm_dt_rank, s.ssm_n_group));
  if (s.n_rot < 2 || s.n_rot % 2 != 0 || s.n_rot > s.head_dim)
    bad(fmt::format("--n-rot: n_rot = {} must be even, at least 2 and at most head_dim ({})",
                    s.n_rot, s.head_dim));
  if (s.arch == "qwen35moe") {
    range(s.n_ff_shexp, 0, int64_t{1} << 24, "n_ff_shexp", "--n-ff-shexp");
  } else if (s.n_ff_shexp != 0) {
    bad(fmt::format("--n-ff-shexp: {} is dense; a shared expert needs qwen35moe", s.arch));
  }
}

void add_hybrid_layer(const SynthSpec& s, int64_t l, const AddTensor& add) {
  const int64_t n = s.n_embd, q_dim = s.n_head * s.head_dim, kv_dim = s.n_head_kv * s.head_dim;
  const int64_t key_dim = s.ssm_n_group * s.ssm_d_state, vd = s.ssm_dt_rank * s.ssm_d_state;
  const int64_t conv_dim = 2 * key_dim + vd;
  // Residual projections: GPT-2's scaled initialisation over the main layers (synth.h).
  const double resid = 1.0 / std::sqrt(2.0 * static_cast<double>(s.n_layer));
  auto out_std = [&](int64_t n_in) { return static_cast<float>(in_std(n_in) * resid); };
  const std::string b = fmt::format("blk.{}.", l);
  const bool mtp = l >= s.n_layer;
  if (mtp) {
    add(b + "nextn.eh_proj.weight", {2 * n, n}, Kind::normal, in_std(2 * n), false, l);
    add(b + "nextn.enorm.weight", {n}, Kind::norm, kNormNoise, false, l);
    add(b + "nextn.hnorm.weight", {n}, Kind::norm, kNormNoise, false, l);
    add(b + "nextn.shared_head_norm.weight", {n}, Kind::norm, kNormNoise, false, l);
  }
  add(b + "attn_norm.weight", {n}, Kind::norm, kNormNoise, false, l);
  if (mtp || (l + 1) % s.full_attention_interval == 0) {
    add(b + "attn_q.weight", {n, 2 * q_dim}, Kind::normal, in_std(n), true, l);
    add(b + "attn_k.weight", {n, kv_dim}, Kind::normal, in_std(n), true, l);
    add(b + "attn_v.weight", {n, kv_dim}, Kind::normal, in_std(n), true, l);
    add(b + "attn_q_norm.weight", {s.head_dim}, Kind::norm, kNormNoise, false, l);
    add(b + "attn_k_norm.weight", {s.head_dim}, Kind::norm, kNormNoise, false, l);
    add(b + "attn_output.weight", {q_dim, n}, Kind::normal, out_std(q_dim), false, l);
  } else {
    add(b + "attn_qkv.weight", {n, conv_dim}, Kind::normal, in_std(n), true, l);
    add(b + "attn_gate.weight", {n, vd}, Kind::normal, in_std(n), true, l);
    add(b + "ssm_conv1d.weight", {s.ssm_d_conv, conv_dim}, Kind::normal, in_std(s.ssm_d_conv),
        false, l);
    add(b + "ssm_dt.bias", {s.ssm_dt_rank}, Kind::bias, 0.5f, false, l);
    add(b + "ssm_a", {s.ssm_dt_rank}, Kind::ssm_a, 0.0f, false, l);
    add(b + "ssm_beta.weight", {n, s.ssm_dt_rank}, Kind::normal, in_std(n), true, l);
    add(b + "ssm_alpha.weight", {n, s.ssm_dt_rank}, Kind::normal, in_std(n), true, l);
    add(b + "ssm_norm.weight", {s.ssm_d_state}, Kind::norm, kNormNoise, false, l);
    add(b + "ssm_out.weight", {vd, n}, Kind::normal, out_std(vd), false, l);
  }
  add(b + "post_attention_norm.weight", {n}, Kind::norm, kNormNoise, false, l);
  if (s.n_expert > 0) {
    const int64_t f = s.n_ff_exp, E = s.n_expert;
    add(b + "ffn_gate_inp.weight", {n, E}, Kind::router, in_std(n), true, l);
    add(b + "ffn_gate_exps.weight", {n, f, E}, Kind::normal, in_std(n), true, l);
    add(b + "ffn_up_exps.weight", {n, f, E}, Kind::normal, in_std(n), true, l);
    add(b + "ffn_down_exps.weight", {f, n, E}, Kind::normal, out_std(f), false, l);
    if (s.n_ff_shexp > 0) {
      const int64_t fs = s.n_ff_shexp;
      add(b + "ffn_gate_inp_shexp.weight", {n}, Kind::normal, in_std(n), true, l);
      add(b + "ffn_gate_shexp.weight", {n, fs}, Kind::normal, in_std(n), true, l);
      add(b + "ffn_up_shexp.weight", {n, fs}, Kind::normal, in_std(n), true, l);
      add(b + "ffn_down_shexp.weight", {fs, n}, Kind::normal, out_std(fs), false, l);
    }
  } else {
    add(b + "ffn_gate.weight", {n, s.n_ff}, Kind::normal, in_std(n), true, l);
    add(b + "ffn_up.weight", {n, s.n_ff}, Kind::normal, in_std(n), true, l);
    add(b + "ffn_down.weight", {s.n_ff, n}, Kind::normal, out_std(s.n_ff), false, l);
  }
}

void write_hybrid_metadata(const SynthSpec& s, gguf::Writer& w) {
  const std::string a = s.arch + ".";
  const auto u32 = [](int64_t v) { return static_cast<uint32_t>(v); };
  w.set_u32(a + "rope.dimension_count", u32(s.n_rot));
  // Multimodal rotary sections (Qwen3.5's mrope_section [11, 11, 10] plus llama.cpp's fourth).
  const int32_t h = static_cast<int32_t>(s.n_rot / 2), s2 = h * 10 / 32;
  const int32_t s1 = (h - s2) / 2, s0 = h - s2 - s1;
  w.set_i32_array(a + "rope.dimension_sections", {s0, s1, s2, 0});
  w.set_u32(a + "full_attention_interval", u32(s.full_attention_interval));
  w.set_u32(a + "ssm.conv_kernel", u32(s.ssm_d_conv));
  w.set_u32(a + "ssm.state_size", u32(s.ssm_d_state));
  w.set_u32(a + "ssm.group_count", u32(s.ssm_n_group));
  w.set_u32(a + "ssm.time_step_rank", u32(s.ssm_dt_rank));
  w.set_u32(a + "ssm.inner_size", u32(s.ssm_dt_rank * s.ssm_d_state));
  if (s.n_mtp > 0) w.set_u32(a + "nextn_predict_layers", u32(s.n_mtp));
  if (s.n_ff_shexp > 0) w.set_u32(a + "expert_shared_feed_forward_length", u32(s.n_ff_shexp));
}

}  // namespace berth::synth_detail
