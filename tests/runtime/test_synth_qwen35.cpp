// Synthetic Qwen3.5 hybrids (tools/synth.h, presets qwen3.5-* and tiny-qwen35*): the presets'
// shapes against ../shared/notes/qwen35-hybrid.md (including its state-size table), the exact
// metadata keys and tensor list (written out here independently of synth_hybrid.cpp) that
// llama.cpp / ik_llama.cpp load, the weight types, the tokenizer, the MTP block, and the oracle
// running a prompt and greedy steps on each tiny preset (H_k != H_v where a wrong V-head mapping
// shows).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "berth/core/error.h"
#include "berth/io/gguf.h"
#include "berth/models/tokenizer.h"
#include "berth/tools/synth.h"
#include "naive_llama.h"
#include "naive_qwen35.h"
#include "test_util.h"

using berth::ErrorCategory;
using berth::GgmlType;
using berth::SynthSpec;
namespace fs = std::filesystem;
namespace gguf = berth::gguf;
namespace oracle = berth::oracle;

namespace {

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

struct Expected {
  std::string name;
  std::vector<int64_t> ne;
  bool f32;  // stays F32 whatever the weight type
};

// The tensors of a hybrid spec, from the notes (not from synth_hybrid.cpp).
std::vector<Expected> expected_tensors(const SynthSpec& s) {
  const int64_t n = s.n_embd, hd = s.head_dim, qd = s.n_head * hd, kvd = s.n_head_kv * hd;
  const int64_t d = s.ssm_d_state, kd = s.ssm_n_group * d, vd = s.ssm_dt_rank * d;
  std::vector<Expected> e = {{"token_embd.weight", {n, s.n_vocab}, false},
                             {"output_norm.weight", {n}, true}};
  if (!s.tie_embeddings) e.push_back({"output.weight", {n, s.n_vocab}, false});
  for (int64_t l = 0; l < s.n_layer + s.n_mtp; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    e.push_back({b + "attn_norm.weight", {n}, true});
    e.push_back({b + "post_attention_norm.weight", {n}, true});
    if (l >= s.n_layer || (l + 1) % 4 == 0) {
      e.push_back({b + "attn_q.weight", {n, 2 * qd}, false});
      e.push_back({b + "attn_k.weight", {n, kvd}, false});
      e.push_back({b + "attn_v.weight", {n, kvd}, false});
      e.push_back({b + "attn_output.weight", {qd, n}, false});
      e.push_back({b + "attn_q_norm.weight", {hd}, true});
      e.push_back({b + "attn_k_norm.weight", {hd}, true});
    } else {
      e.push_back({b + "attn_qkv.weight", {n, 2 * kd + vd}, false});
      e.push_back({b + "attn_gate.weight", {n, vd}, false});
      e.push_back({b + "ssm_conv1d.weight", {4, 2 * kd + vd}, true});
      e.push_back({b + "ssm_dt.bias", {s.ssm_dt_rank}, true});
      e.push_back({b + "ssm_a", {s.ssm_dt_rank}, true});
      e.push_back({b + "ssm_beta.weight", {n, s.ssm_dt_rank}, true});
      e.push_back({b + "ssm_alpha.weight", {n, s.ssm_dt_rank}, true});
      e.push_back({b + "ssm_norm.weight", {d}, true});
      e.push_back({b + "ssm_out.weight", {vd, n}, false});
    }
    if (l >= s.n_layer) {
      e.push_back({b + "nextn.eh_proj.weight", {2 * n, n}, false});
      for (const char* t :
           {"nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight"})
        e.push_back({b + t, {n}, true});
    }
    if (s.n_expert > 0) {
      const int64_t f = s.n_ff_exp, E = s.n_expert, fs = s.n_ff_shexp;
      e.push_back({b + "ffn_gate_inp.weight", {n, E}, true});
      e.push_back({b + "ffn_gate_exps.weight", {n, f, E}, false});
      e.push_back({b + "ffn_up_exps.weight", {n, f, E}, false});
      e.push_back({b + "ffn_down_exps.weight", {f, n, E}, false});
      e.push_back({b + "ffn_gate_inp_shexp.weight", {n}, true});
      e.push_back({b + "ffn_gate_shexp.weight", {n, fs}, false});
      e.push_back({b + "ffn_up_shexp.weight", {n, fs}, false});
      e.push_back({b + "ffn_down_shexp.weight", {fs, n}, false});
    } else {
      e.push_back({b + "ffn_gate.weight", {n, s.n_ff}, false});
      e.push_back({b + "ffn_up.weight", {n, s.n_ff}, false});
      e.push_back({b + "ffn_down.weight", {s.n_ff, n}, false});
    }
  }
  return e;
}

std::vector<int64_t> shape_of(const gguf::TensorInfo& t) {
  return std::vector<int64_t>(t.ne.begin(), t.ne.begin() + t.n_dims);
}

std::string write(SynthSpec s, const std::string& tag) {
  const fs::path path = berth::test::temp_dir("synth-q35") / (tag + ".gguf");
  if (!fs::exists(path)) berth::write_synth_model(s, path.string(), 2);
  return path.string();
}

template <class F>
void expect_invalid(F fn, const std::string& flag) {
  try {
    fn();
    FAIL("no error; expected one naming " << flag);
  } catch (const berth::Error& e) {
    CHECK(e.category() == ErrorCategory::invalid_argument);
    CHECK_MESSAGE(contains(e.what(), flag), e.what());
  }
}

}  // namespace

TEST_CASE("synth qwen35: preset shapes are the notes' (and their recurrent-state table)") {
  const auto names = berth::synth_presets();
  for (const char* p : {"qwen3.5-0.8b", "qwen3.5-4b", "qwen3.5-27b", "qwen3.5-35b-a3b",
                        "tiny-qwen35", "tiny-qwen35-eqheads", "tiny-qwen35moe"})
    CHECK(std::find(names.begin(), names.end(), p) != names.end());
  struct Row {
    const char* preset;
    const char* arch;
    int64_t layers, n_embd, n_ff, heads, kv_heads, h_k, h_v;
    bool tied;
    // Notes' table "State sizes per sequence": conv / layer (KiB), S / layer (MiB), KV per token
    // at f16 over the attention layers (KiB).
    double conv_kib, s_mib, kv_kib;
  };
  const Row rows[] = {
      {"qwen3.5-0.8b", "qwen35", 24, 1024, 3584, 8, 2, 16, 16, true, 72, 1, 12},
      {"qwen3.5-4b", "qwen35", 32, 2560, 9216, 16, 4, 16, 32, true, 96, 2, 32},
      {"qwen3.5-27b", "qwen35", 64, 5120, 17408, 24, 4, 16, 48, false, 120, 3, 64},
      {"qwen3.5-35b-a3b", "qwen35moe", 40, 2048, 0, 16, 2, 16, 32, false, 96, 2, 20},
  };
  for (const Row& r : rows) {
    CAPTURE(r.preset);
    const SynthSpec s = berth::synth_preset(r.preset);
    CHECK(s.arch == r.arch);
    CHECK(s.n_layer == r.layers);
    CHECK(s.n_embd == r.n_embd);
    CHECK(s.n_ff == r.n_ff);
    CHECK(s.n_head == r.heads);
    CHECK(s.n_head_kv == r.kv_heads);
    CHECK(s.head_dim == 256);
    CHECK(s.n_rot == 64);
    CHECK(s.ssm_n_group == r.h_k);
    CHECK(s.ssm_dt_rank == r.h_v);
    CHECK(s.ssm_d_state == 128);
    CHECK(s.ssm_d_conv == 4);
    CHECK(s.full_attention_interval == 4);
    CHECK(s.tie_embeddings == r.tied);
    CHECK(s.n_vocab == 248320);
    CHECK(s.rope_freq_base == 1e7f);
    CHECK(s.rms_eps == 1e-6f);
    CHECK(s.n_mtp == 0);
    const double conv_dim = 2.0 * r.h_k * 128 + r.h_v * 128;
    CHECK(3 * conv_dim * 4 / 1024 == doctest::Approx(r.conv_kib));
    CHECK(r.h_v * 128.0 * 128 * 4 / (1 << 20) == doctest::Approx(r.s_mib));
    CHECK((r.layers / 4) * r.kv_heads * 256.0 * 2 * 2 / 1024 == doctest::Approx(r.kv_kib));
  }
  const SynthSpec moe = berth::synth_preset("qwen3.5-35b-a3b");
  CHECK(moe.n_expert == 256);
  CHECK(moe.n_expert_used == 8);
  CHECK(moe.n_ff_exp == 512);
  CHECK(moe.n_ff_shexp == 512);
  // The real sizes plan without writing: parameter count of the 27B text model.
  int64_t params = 0;
  for (const berth::SynthTensor& t : berth::synth_tensor_plan(berth::synth_preset("qwen3.5-27b"))) {
    int64_t n = 1;
    for (int64_t d : t.ne) n *= d;
    params += n;
  }
  MESSAGE("qwen3.5-27b text parameters: ", params);
  CHECK(params > 26'000'000'000);
  CHECK(params < 28'000'000'000);
  const SynthSpec tiny = berth::synth_preset("tiny-qwen35");
  CHECK(tiny.ssm_n_group != tiny.ssm_dt_rank);
  CHECK(berth::synth_preset("tiny-qwen35moe").ssm_n_group !=
        berth::synth_preset("tiny-qwen35moe").ssm_dt_rank);
  CHECK(berth::synth_preset("tiny-qwen35-eqheads").ssm_n_group ==
        berth::synth_preset("tiny-qwen35-eqheads").ssm_dt_rank);
}

TEST_CASE("synth qwen35: tiny presets write the keys and tensors other engines load") {
  for (const char* preset : {"tiny-qwen35", "tiny-qwen35-eqheads", "tiny-qwen35moe"}) {
    for (const int n_mtp : {0, 1}) {
      CAPTURE(preset);
      CAPTURE(n_mtp);
      SynthSpec s = berth::synth_preset(preset);
      s.type = "q8_0";
      s.seed = 5;
      s.n_mtp = n_mtp;
      const std::string path = write(s, std::string(preset) + "-q8-" + std::to_string(n_mtp));
      gguf::File f = gguf::File::open(path);
      const std::string a = s.arch + ".";
      CHECK(f.architecture() == s.arch);
      CHECK(f.get_int(a + "block_count") == s.n_layer + n_mtp);
      CHECK(f.has(a + "nextn_predict_layers") == (n_mtp > 0));
      if (n_mtp > 0) CHECK(f.get_int(a + "nextn_predict_layers") == 1);
      CHECK(f.get_int(a + "embedding_length") == s.n_embd);
      CHECK(f.get_int(a + "context_length") == s.n_ctx_train);
      CHECK(f.has(a + "feed_forward_length") == (s.arch == "qwen35"));
      CHECK(f.get_int(a + "attention.head_count") == s.n_head);
      CHECK(f.get_int(a + "attention.head_count_kv") == s.n_head_kv);
      CHECK(f.get_int(a + "attention.key_length") == 256);
      CHECK(f.get_int(a + "attention.value_length") == 256);
      CHECK(f.get_float(a + "attention.layer_norm_rms_epsilon") == doctest::Approx(1e-6));
      CHECK(f.get_float(a + "rope.freq_base") == doctest::Approx(1e7));
      CHECK(f.get_int(a + "rope.dimension_count") == 64);
      CHECK(f.get_int_array(a + "rope.dimension_sections") == std::vector<int64_t>{11, 11, 10, 0});
      CHECK(f.get_int(a + "full_attention_interval") == 4);
      CHECK(f.get_int(a + "ssm.conv_kernel") == 4);
      CHECK(f.get_int(a + "ssm.state_size") == 128);
      CHECK(f.get_int(a + "ssm.group_count") == s.ssm_n_group);
      CHECK(f.get_int(a + "ssm.time_step_rank") == s.ssm_dt_rank);
      CHECK(f.get_int(a + "ssm.inner_size") == s.ssm_dt_rank * 128);
      if (s.arch == "qwen35moe") {
        CHECK(f.get_int(a + "expert_count") == s.n_expert);
        CHECK(f.get_int(a + "expert_used_count") == s.n_expert_used);
        CHECK(f.get_int(a + "expert_feed_forward_length") == s.n_ff_exp);
        CHECK(f.get_int(a + "expert_shared_feed_forward_length") == s.n_ff_shexp);
      } else {
        CHECK(f.get_int(a + "feed_forward_length") == s.n_ff);
      }
      const std::vector<Expected> want = expected_tensors(s);
      CHECK(f.tensors().size() == want.size());
      for (const Expected& e : want) {
        CAPTURE(e.name);
        const gguf::TensorInfo* t = f.find_tensor(e.name);
        REQUIRE(t != nullptr);
        CHECK(shape_of(*t) == e.ne);
        CHECK(t->type == (e.f32 ? GgmlType::F32 : GgmlType::Q8_0));
      }
      // Stored conversions: ssm_a = -exp(A_log) < 0; norms (1 + w) near 1.
      const gguf::TensorInfo& ssm_a = f.tensor("blk.0.ssm_a");
      for (int64_t i = 0; i < ssm_a.ne[0]; ++i) {
        const float v = reinterpret_cast<const float*>(ssm_a.data)[i];
        CHECK((v < -0.04f && v > -1.01f));
      }
      const gguf::TensorInfo& norm = f.tensor("blk.0.ssm_norm.weight");
      for (int64_t i = 0; i < norm.ne[0]; ++i)
        CHECK(std::fabs(reinterpret_cast<const float*>(norm.data)[i] - 1.0f) < 0.1f);
      // The qwen35 pre-tokenizer, and text round-trips.
      CHECK(f.get_string("tokenizer.ggml.pre") == "qwen35");
      auto tok = berth::Tokenizer::from_gguf(f);
      const std::string text = "Hello world, the quick brown fox jumps over 12 lazy dogs.";
      const std::vector<int32_t> ids = tok->encode(text, false);
      CHECK(ids.size() < text.size());
      CHECK(tok->decode(ids) == text);
    }
  }
}

TEST_CASE("synth qwen35: q4_k_m types; the MTP block does not change the main model") {
  SynthSpec s = berth::synth_preset("tiny-qwen35moe");
  s.type = "q4_k_m";
  s.n_mtp = 1;
  for (const berth::SynthTensor& t : berth::synth_tensor_plan(s)) {
    CAPTURE(t.name);
    if (contains(t.name, "attn_qkv")) CHECK(t.type == GgmlType::Q5_K);
    if (contains(t.name, "ssm_beta") || contains(t.name, "ssm_alpha") ||
        contains(t.name, "ssm_conv1d") || contains(t.name, "ffn_gate_inp"))
      CHECK(t.type == GgmlType::F32);
    if (contains(t.name, "attn_gate") || contains(t.name, "ssm_out"))
      CHECK(t.type == GgmlType::Q4_K);
  }
  // F32 files with and without the MTP block: the main model is the same bytes, so the oracle
  // (which skips the block) gives the same logits.
  SynthSpec a = berth::synth_preset("tiny-qwen35");
  a.seed = 9;
  SynthSpec b = a;
  b.n_mtp = 1;
  gguf::File fa = gguf::File::open(write(a, "mtp0"));
  gguf::File fb = gguf::File::open(write(b, "mtp1"));
  oracle::NaiveQwen35 ma(fa, 64), mb(fb, 64);
  CHECK(mb.config().n_mtp == 1);
  for (int32_t t : {5, 300, 17, 17}) CHECK(ma.step(t) == mb.step(t));
}

TEST_CASE("synth qwen35: the oracle runs a prompt and 32 greedy steps on each tiny preset") {
  const std::vector<int32_t> prompt = {9, 400, 3, 77, 512, 1000, 42, 8};
  for (const std::string preset : {"tiny-qwen35", "tiny-qwen35-eqheads", "tiny-qwen35moe"}) {
    CAPTURE(preset);
    SynthSpec s = berth::synth_preset(preset);
    s.seed = 3;
    gguf::File f = gguf::File::open(write(s, preset + "-f32"));
    oracle::NaiveModel m(f, 64);
    REQUIRE(m.hybrid() != nullptr);
    const std::vector<int32_t> out = oracle::greedy_generate(m, prompt, 32);
    CHECK(out.size() == 32);
    CHECK(m.pos() == static_cast<int32_t>(prompt.size() + 32));
    // Not one token repeated: the logits move with the input and the state.
    CHECK(std::set<int32_t>(out.begin(), out.end()).size() > 4);
    // The logits of a step are finite and spread; the recurrent state carries the prompt (the
    // last token alone gives other logits).
    m.reset();
    std::vector<double> logits;
    for (int32_t t : prompt) logits = m.step(t);
    for (double x : logits) REQUIRE(std::isfinite(x));
    const auto [lo, hi] = std::minmax_element(logits.begin(), logits.end());
    CHECK(*hi - *lo > 0.5);
    oracle::NaiveModel fresh(f, 64);
    const std::vector<double> alone = fresh.step(prompt.back());
    double diff = 0;
    for (size_t i = 0; i < logits.size(); ++i)
      diff = std::max(diff, std::abs(alone[i] - logits[i]));
    CHECK(diff > 1e-2);
    // The V-head mapping matters exactly when H_k != H_v.
    oracle::NaiveQwen35 tiled(f, 64), grouped(f, 64, oracle::VHeadMapping::grouped);
    double worst = 0;
    for (int32_t t : prompt) {
      const std::vector<double> x = tiled.step(t), y = grouped.step(t);
      for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::abs(x[i] - y[i]));
    }
    if (s.ssm_n_group == s.ssm_dt_rank) {
      CHECK(worst == 0.0);
    } else {
      CHECK(worst > 1e-3);
    }
  }
}

TEST_CASE("synth qwen35: bad hybrid arguments name their flag") {
  SynthSpec s = berth::synth_preset("tiny-qwen35");
  s.ssm_dt_rank = 3;
  expect_invalid([&] { berth::validate_synth_spec(s); }, "--ssm-dt-rank");
  s = berth::synth_preset("tiny-qwen35");
  s.ssm_d_state = 0;
  expect_invalid([&] { berth::validate_synth_spec(s); }, "--ssm-d-state");
  s = berth::synth_preset("tiny-qwen35");
  s.n_rot = 7;
  expect_invalid([&] { berth::validate_synth_spec(s); }, "--n-rot");
  s = berth::synth_preset("tiny-qwen35");
  s.n_mtp = 2;
  expect_invalid([&] { berth::validate_synth_spec(s); }, "--n-mtp");
  s = berth::synth_preset("tiny-qwen35");
  s.n_ff_shexp = 64;
  expect_invalid([&] { berth::validate_synth_spec(s); }, "--n-ff-shexp");
  s = berth::synth_preset("tiny-qwen35");
  s.n_expert = 4;
  expect_invalid([&] { berth::validate_synth_spec(s); }, "--n-expert");
  s = berth::synth_preset("tiny-qwen35moe");
  s.n_expert = 0;
  expect_invalid([&] { berth::validate_synth_spec(s); }, "--n-expert");
  s = berth::synth_preset("tiny-qwen35");
  s.full_attention_interval = 0;
  expect_invalid([&] { berth::validate_synth_spec(s); }, "--full-attention-interval");
  // The loader's range of ssm.conv_kernel.
  s = berth::synth_preset("tiny-qwen35");
  s.ssm_d_conv = 1;
  expect_invalid([&] { berth::validate_synth_spec(s); }, "--ssm-d-conv");
}
