#include "berth/tools/synth.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <span>
#include <unordered_set>
#include <utility>

#include "berth/backends/thread_pool.h"
#include "berth/core/error.h"
#include "berth/core/log.h"
#include "berth/core/strings.h"
#include "berth/cpu_kernels/quants_ref.h"
#include "berth/io/gguf_writer.h"
#include "berth/models/tokenizer.h"
#include "berth/tools/quantize.h"
#include "synth_internal.h"

namespace berth {
namespace {

using namespace synth_detail;  // NOLINT: Kind, AddTensor, the vocabulary and hybrid parts

[[noreturn]] void bad(const std::string& msg) { throw Error(ErrorCategory::invalid_argument, msg); }

// ---------------------------------------------------------------------------------------------
// Random numbers: SplitMix64 (Steele, Lea, Flood 2014, "Fast splittable pseudorandom number
// generators"), whose finaliser also hashes the (seed, tensor, row) keys.
// ---------------------------------------------------------------------------------------------

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t stream_key(uint64_t seed, uint64_t tensor, uint64_t row) {
  uint64_t k = mix64(seed + kGolden * (tensor + 1));
  return mix64(k ^ (row * 0xD1B54A32D192ED03ull + 0x8CB92BA72F3D8DD7ull));
}

// Standard deviation of the sum of four uniform 16-bit integers is sqrt((65536^2 - 1) / 3).
const float kIrwinHallScale = static_cast<float>(std::sqrt(3.0 / (65536.0 * 65536.0 - 1.0)));

struct Rng {
  uint64_t s;
  uint64_t next() { return mix64(s += kGolden); }
  /// Approximately N(0, 1): Irwin-Hall sum of four 16-bit uniforms, unit variance, |z| <= 3.47.
  float normal() {
    const uint64_t v = next();
    const int64_t sum = static_cast<int64_t>((v & 0xFFFF) + ((v >> 16) & 0xFFFF) +
                                             ((v >> 32) & 0xFFFF) + (v >> 48));
    return static_cast<float>(sum - 131070) * kIrwinHallScale;
  }
};

// Keys of the non-tensor streams (beyond any tensor index).
constexpr uint64_t kStreamU = uint64_t{1} << 40;
constexpr uint64_t kStreamPerm = uint64_t{1} << 41;  // + layer

// ---------------------------------------------------------------------------------------------
// Presets
// ---------------------------------------------------------------------------------------------

struct Preset {
  const char* name;
  SynthSpec spec;
};

SynthSpec make(const char* arch, int64_t n_layer, int64_t n_embd, int64_t n_head, int64_t n_head_kv,
               int64_t head_dim, int64_t n_ff, int64_t n_vocab, int64_t n_ctx, int64_t n_expert,
               int64_t n_expert_used, int64_t n_ff_exp, float rope_base, float eps, bool tie) {
  SynthSpec s;
  s.arch = arch;
  s.n_layer = n_layer;
  s.n_embd = n_embd;
  s.n_head = n_head;
  s.n_head_kv = n_head_kv;
  s.head_dim = head_dim;
  s.n_ff = n_ff;
  s.n_vocab = n_vocab;
  s.n_ctx_train = n_ctx;
  s.n_expert = n_expert;
  s.n_expert_used = n_expert_used;
  s.n_ff_exp = n_ff_exp;
  s.rope_freq_base = rope_base;
  s.rms_eps = eps;
  s.tie_embeddings = tie;
  return s;
}

// The hybrid fields of a qwen35 / qwen35moe preset: GDN K and V heads of 128, kernel 4, every
// 4th layer full attention, rotary on a quarter of each attention head.
SynthSpec hybrid(SynthSpec s, int64_t h_k, int64_t h_v, int64_t n_ff_shexp) {
  s.ssm_n_group = h_k;
  s.ssm_dt_rank = h_v;
  s.ssm_d_state = 128;
  s.ssm_d_conv = 4;
  s.full_attention_interval = 4;
  s.n_rot = s.head_dim / 4;
  s.n_ff_shexp = n_ff_shexp;
  return s;
}

const std::vector<Preset>& presets() {
  // Qwen3 shapes: the config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B.
  static const std::vector<Preset> p = {
      {"qwen3-30b-a3b", make("qwen3moe", 48, 2048, 32, 4, 128, 6144, 151936, 40960, 128, 8, 768,
                             1e6f, 1e-6f, false)},
      {"qwen3-235b-a22b", make("qwen3moe", 94, 4096, 64, 4, 128, 12288, 151936, 40960, 128, 8, 1536,
                               1e6f, 1e-6f, false)},
      {"tiny-llama", make("llama", 2, 256, 8, 4, 32, 512, 512, 2048, 0, 0, 0, 1e4f, 1e-5f, false)},
      {"tiny-qwen2", make("qwen2", 2, 256, 8, 2, 32, 512, 1024, 4096, 0, 0, 0, 1e6f, 1e-6f, true)},
      {"tiny-qwen3",
       make("qwen3", 2, 256, 16, 4, 32, 512, 1024, 4096, 0, 0, 0, 1e6f, 1e-6f, false)},
      {"tiny-qwen3moe",
       make("qwen3moe", 2, 256, 8, 2, 32, 512, 512, 4096, 4, 2, 256, 1e6f, 1e-6f, false)},
      {"tiny-mixtral",
       make("llama", 2, 256, 8, 4, 32, 256, 512, 4096, 4, 2, 0, 1e6f, 1e-5f, false)},
      // Qwen3.5 shapes (config.json of Qwen/Qwen3.5-*; ../shared/notes/qwen35-hybrid.md): GDN
      // heads of 128, attention heads of 256 with rotary on 64 dims, vocabulary 248,320.
      {"qwen3.5-0.8b",
       hybrid(make("qwen35", 24, 1024, 8, 2, 256, 3584, 248320, 262144, 0, 0, 0, 1e7f, 1e-6f, true),
              16, 16, 0)},
      {"qwen3.5-4b", hybrid(make("qwen35", 32, 2560, 16, 4, 256, 9216, 248320, 262144, 0, 0, 0,
                                 1e7f, 1e-6f, true),
                            16, 32, 0)},
      {"qwen3.5-27b", hybrid(make("qwen35", 64, 5120, 24, 4, 256, 17408, 248320, 262144, 0, 0, 0,
                                  1e7f, 1e-6f, false),
                             16, 48, 0)},
      {"qwen3.5-35b-a3b", hybrid(make("qwen35moe", 40, 2048, 16, 2, 256, 0, 248320, 262144, 256, 8,
                                      512, 1e7f, 1e-6f, false),
                                 16, 32, 512)},
      // Tiny hybrids: 4 layers (GDN, GDN, GDN, attention) with the real head sizes. H_k != H_v
      // (2 K heads, 4 V heads) unless named -eqheads: a wrong V-head mapping shows only there.
      {"tiny-qwen35",
       hybrid(make("qwen35", 4, 256, 4, 2, 256, 512, 1024, 4096, 0, 0, 0, 1e7f, 1e-6f, false), 2, 4,
              0)},
      {"tiny-qwen35-eqheads",
       hybrid(make("qwen35", 4, 256, 4, 2, 256, 512, 1024, 4096, 0, 0, 0, 1e7f, 1e-6f, true), 2, 2,
              0)},
      {"tiny-qwen35moe",
       hybrid(make("qwen35moe", 4, 256, 4, 2, 256, 0, 1024, 4096, 8, 2, 128, 1e7f, 1e-6f, false), 2,
              4, 128)},
  };
  return p;
}

// ---------------------------------------------------------------------------------------------
// Spec checks
// ---------------------------------------------------------------------------------------------

bool is_moe_arch(const std::string& a) { return a == "qwen3moe" || a == "qwen35moe"; }
bool has_qk_norm(const std::string& a) {
  return a == "qwen3" || a == "qwen3moe" || is_hybrid_arch(a);
}
bool uses_spm(const SynthSpec& s) { return s.arch == "llama" && s.vocab_path.empty(); }

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string type_list() {
  std::string s;
  for (GgmlType t : quantize_target_types()) s += lower(type_name(t)) + " ";
  return s + "q4_k_m";
}

// The uniform type of a spec's type string, or nullopt for q4_k_m.
std::optional<GgmlType> uniform_type(const std::string& type) {
  const std::string t = lower(type);
  if (t == "q4_k_m") return std::nullopt;
  std::optional<GgmlType> g = parse_type(t);
  const auto& ok = quantize_target_types();
  if (!g || std::find(ok.begin(), ok.end(), *g) == ok.end())
    bad(fmt::format("--type: unknown weight type '{}' (expected one of: {})", printable(type),
                    type_list()));
  return g;
}

constexpr int64_t kSpmChars = 95;  // "▁" and the printable ASCII characters 0x21..0x7E
constexpr int64_t kMaxDim = int64_t{1} << 24;
constexpr int64_t kMaxLayers = 4096;

// Fills n_head_kv, head_dim and (from the tokenizer file) n_vocab when left at 0.
SynthSpec resolved(const SynthSpec& in, VocabData* hf_vocab) {
  SynthSpec s = in;
  if (s.n_head_kv == 0) s.n_head_kv = s.n_head;
  if (s.head_dim == 0 && s.n_head > 0 && s.n_embd % s.n_head == 0) s.head_dim = s.n_embd / s.n_head;
  if (s.arch == "llama" && s.n_expert > 0) s.n_ff_exp = s.n_ff;
  if (s.n_rot == 0) s.n_rot = is_hybrid_arch(s.arch) ? s.head_dim / 4 : s.head_dim;
  if (!s.vocab_path.empty() && (s.n_vocab == 0 || hf_vocab)) {
    VocabData v = read_hf_tokenizer_json(s.vocab_path);
    const auto n_tok = static_cast<int64_t>(v.tokens.size());
    if (s.n_vocab == 0) s.n_vocab = n_tok;
    if (n_tok > s.n_vocab)
      bad(fmt::format("--n-vocab: n_vocab ({}) is smaller than the {} tokens of '{}'", s.n_vocab,
                      n_tok, printable(s.vocab_path)));
    if (hf_vocab) *hf_vocab = std::move(v);
  }
  return s;
}

void check_spec(const SynthSpec& s) {
  static const std::set<std::string> archs = {"llama",    "qwen2",  "qwen3",
                                              "qwen3moe", "qwen35", "qwen35moe"};
  if (!archs.count(s.arch))
    bad(
        fmt::format("--arch: unknown architecture '{}' (expected one of: llama qwen2 qwen3 "
                    "qwen3moe qwen35 qwen35moe)",
                    printable(s.arch)));
  auto dim = [](int64_t v, const char* field, const char* flag) {
    if (v < 1 || v > kMaxDim)
      bad(fmt::format("{}: {} = {} must be in 1..{}", flag, field, v, kMaxDim));
  };
  // Each layer adds ~10 tensor entries before the size check: bounded well above any real model
  // (Llama 3.1 405B: 126 layers) so a typo cannot allocate millions of them.
  if (s.n_layer < 1 || s.n_layer > kMaxLayers)
    bad(fmt::format("--n-layer: n_layer = {} must be in 1..{}", s.n_layer, kMaxLayers));
  dim(s.n_embd, "n_embd", "--n-embd");
  dim(s.n_head, "n_head", "--n-head");
  dim(s.n_head_kv, "n_head_kv", "--n-head-kv");
  if (s.n_head % s.n_head_kv != 0)
    bad(fmt::format("--n-head-kv: n_head ({}) is not a multiple of n_head_kv ({})", s.n_head,
                    s.n_head_kv));
  if (s.head_dim == 0)
    bad(fmt::format("--head-dim: n_embd ({}) is not a multiple of n_head ({}); give head_dim",
                    s.n_embd, s.n_head));
  dim(s.head_dim, "head_dim", "--head-dim");
  if (s.head_dim % 2 != 0)
    bad(fmt::format("--head-dim: head_dim = {} must be even (RoPE rotates pairs)", s.head_dim));
  if (s.n_head * s.head_dim > kMaxDim)
    bad(fmt::format("--n-head: n_head * head_dim = {} is too large", s.n_head * s.head_dim));
  if (s.arch != "qwen35moe" || s.n_ff != 0) dim(s.n_ff, "n_ff", "--n-ff");  // optional there
  dim(s.n_vocab, "n_vocab", "--n-vocab");
  dim(s.n_ctx_train, "n_ctx_train", "--n-ctx");
  if (s.vocab_path.empty()) {
    const int64_t min_vocab = uses_spm(s) ? 3 + 256 + kSpmChars + 1 : 256 + 3;
    if (s.n_vocab < min_vocab)
      bad(
          fmt::format("--n-vocab: n_vocab = {} is too small for the synthetic {} vocabulary "
                      "(at least {})",
                      s.n_vocab, uses_spm(s) ? "SentencePiece" : "byte-level BPE", min_vocab));
  }
  if (s.n_expert < 0 || s.n_expert > 65536)
    bad(fmt::format("--n-expert: n_expert = {} must be in 0..65536", s.n_expert));
  if (is_moe_arch(s.arch) && s.n_expert == 0)
    bad(fmt::format("--n-expert: {} needs n_expert >= 1", s.arch));
  if ((s.arch == "qwen2" || s.arch == "qwen3" || s.arch == "qwen35") && s.n_expert != 0)
    bad(fmt::format("--n-expert: {} is dense (n_expert = {}); use {}moe for experts", s.arch,
                    s.n_expert, s.arch));
  if (s.n_expert > 0) {
    if (s.n_expert_used < 1 || s.n_expert_used > s.n_expert)
      bad(fmt::format("--n-expert-used: n_expert_used = {} must be in 1..n_expert ({})",
                      s.n_expert_used, s.n_expert));
    dim(s.n_ff_exp, "n_ff_exp", "--n-ff-exp");
  }
  if (!(s.rope_freq_base > 0.0f) || std::isinf(s.rope_freq_base))
    bad(fmt::format("--rope-base: rope_freq_base = {} must be finite and positive",
                    s.rope_freq_base));
  if (!(s.rms_eps > 0.0f) || std::isinf(s.rms_eps))
    bad(fmt::format("rms_eps = {} must be finite and positive", s.rms_eps));
  if (!(s.router_skew >= 0.0) || std::isinf(s.router_skew))
    bad(fmt::format("--router-skew: router_skew = {} must be finite and >= 0", s.router_skew));
  if (is_hybrid_arch(s.arch)) check_hybrid_spec(s);
  (void)uniform_type(s.type);
}

// llama.cpp's use_more_bits (llama-quant.cpp): the layers that get more bits in the _M mixes.
bool use_more_bits(int64_t i, int64_t n) {
  return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

bool ends_with(std::string_view s, std::string_view suf) {
  return s.size() >= suf.size() && s.substr(s.size() - suf.size()) == suf;
}

// ---------------------------------------------------------------------------------------------
// The tensor plan
// ---------------------------------------------------------------------------------------------

struct TensorGen {
  SynthTensor t;
  Kind kind = Kind::normal;
  float std = 0.0f;
  bool orth = false;  // rows made orthogonal to u
  int64_t layer = -1;
};

constexpr float kEmbdStd = 0.05f;  // token part of token_embd, per element
constexpr float kShared = 0.3f;    // rms per element of the shared direction (router skew)

struct Plan {
  SynthSpec spec;  // resolved
  std::vector<TensorGen> tensors;
  bool skew = false;
  std::vector<float> u;                   // [n_embd], unit norm (skew only)
  std::vector<std::vector<float>> alpha;  // [n_layer][n_expert] (skew only)
};

// E[silu(g)^2] for g ~ N(0, var) (midpoint rule over +-8 sigma).
double silu_sq_mean(double var) {
  const double sd = std::sqrt(var);
  double acc = 0.0;
  const double h = 0.01;
  for (double x = -8.0 + h / 2; x < 8.0; x += h) {
    const double g = sd * x;
    const double s = g / (1.0 + std::exp(-g));
    acc += s * s * std::exp(-0.5 * x * x);
  }
  return acc * h / std::sqrt(2.0 * M_PI);
}

void plan_skew(Plan& p) {
  const SynthSpec& s = p.spec;
  const int64_t n = s.n_embd, L = s.n_layer, E = s.n_expert;
  // u: a random unit direction.
  Rng r{stream_key(s.seed, kStreamU, 0)};
  std::vector<double> u(static_cast<size_t>(n));
  double nn = 0.0;
  for (double& x : u) {
    x = r.normal();
    nn += x * x;
  }
  p.u.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p.u[i] = static_cast<float>(u[i] / std::sqrt(nn));

  // Expected mean square per element of the token part of the residual (orthogonal to u), layer
  // by layer: each write adds (mean square of the projection's input) / (2 n_layer) by the scaled
  // initialisation; attention averages values over positions (taken as 1/2); the routed FFN
  // averages n_expert_used experts' outputs (taken as 1 / n_expert_used).
  const double U2 = double(kShared) * kShared;
  double tok = double(kEmbdStd) * kEmbdStd;
  const double k = static_cast<double>(std::max<int64_t>(1, s.n_expert_used));
  p.alpha.assign(static_cast<size_t>(L + s.n_mtp), std::vector<float>(static_cast<size_t>(E)));
  std::vector<double> logw(static_cast<size_t>(E));
  for (int64_t l = 0; l < L + s.n_mtp; ++l) {
    // Share of u in the normalised input of layer l (exact at layer 0); the router's input also
    // holds this layer's attention write, left out (small next to the residual in deep models).
    const double share = U2 / (U2 + tok);
    const double a = 1.0 - share;
    tok += a * 0.5 / (2.0 * L);                  // attention write
    tok += silu_sq_mean(a) * a / k / (2.0 * L);  // FFN write

    // Zipf ranks over a per-layer random permutation (Fisher-Yates).
    std::vector<int64_t> perm(static_cast<size_t>(E));
    std::iota(perm.begin(), perm.end(), 0);
    Rng pr{stream_key(s.seed, kStreamPerm + static_cast<uint64_t>(l), 0)};
    for (int64_t i = E - 1; i > 0; --i)
      std::swap(perm[i], perm[pr.next() % static_cast<uint64_t>(i + 1)]);
    double mean = 0.0;
    for (int64_t rank = 0; rank < E; ++rank) {
      logw[perm[rank]] = -s.router_skew * std::log(static_cast<double>(rank + 1));
      mean += logw[perm[rank]];
    }
    mean /= static_cast<double>(E);
    // The largest of E unit normals is approximately Gumbel with scale 1/sqrt(2 ln E) (extreme
    // value theory). Offsets of c * ln(weight) with c = 1.25 / sqrt(2 ln E) give top-1 choice
    // frequencies whose fitted Zipf exponent is A within 5% for E = 8, 60 and 128 (1.25: measured
    // by simulating the argmax of offsets plus unit normal noise, 20000 draws).
    const double gumbel = 1.25 / std::sqrt(2.0 * std::log(std::max<double>(2.0, double(E))));
    const double scale = gumbel * std::sqrt(a / (static_cast<double>(n) * share));
    for (int64_t e = 0; e < E; ++e) p.alpha[l][e] = static_cast<float>((logw[e] - mean) * scale);
  }
}

Plan make_plan(const SynthSpec& in, VocabData* hf_vocab) {
  Plan p;
  p.spec = resolved(in, hf_vocab);
  const SynthSpec& s = p.spec;
  check_spec(s);
  p.skew = s.n_expert > 0 && s.router_skew > 0.0;

  const int64_t n = s.n_embd, L = s.n_layer;
  const int64_t q_dim = s.n_head * s.head_dim, kv_dim = s.n_head_kv * s.head_dim;
  const double resid = 1.0 / std::sqrt(2.0 * static_cast<double>(L));
  auto in_std = [](int64_t n_in) { return static_cast<float>(1.0 / std::sqrt(double(n_in))); };

  auto add = [&](std::string name, std::vector<int64_t> ne, Kind kind, float std, bool orth,
                 int64_t layer) {
    TensorGen g;
    g.t.name = std::move(name);
    g.t.ne = std::move(ne);
    g.kind = kind;
    g.std = std;
    g.orth = orth && p.skew;
    g.layer = layer;
    const bool matrix = kind == Kind::normal || kind == Kind::embedding;
    g.t.type = matrix ? synth_tensor_type(s, g.t.name, layer) : GgmlType::F32;
    const int64_t block = traits(g.t.type).block_size;
    if (g.t.ne[0] % block != 0) {
      g.t.note = fmt::format("{} stays f32: row length {} is not a multiple of {} ({} block)",
                             g.t.name, g.t.ne[0], block, type_name(g.t.type));
      g.t.type = GgmlType::F32;
    }
    p.tensors.push_back(std::move(g));
  };

  add("token_embd.weight", {n, s.n_vocab}, Kind::embedding, kEmbdStd, true, -1);
  if (is_hybrid_arch(s.arch)) {
    for (int64_t l = 0; l < L; ++l) add_hybrid_layer(s, l, add);
  }
  for (int64_t l = 0; l < L && !is_hybrid_arch(s.arch); ++l) {
    const std::string b = fmt::format("blk.{}.", l);
    add(b + "attn_norm.weight", {n}, Kind::norm, kNormNoise, false, l);
    add(b + "attn_q.weight", {n, q_dim}, Kind::normal, in_std(n), true, l);
    add(b + "attn_k.weight", {n, kv_dim}, Kind::normal, in_std(n), true, l);
    add(b + "attn_v.weight", {n, kv_dim}, Kind::normal, in_std(n), true, l);
    if (s.arch == "qwen2") {
      add(b + "attn_q.bias", {q_dim}, Kind::bias, kBiasStd, false, l);
      add(b + "attn_k.bias", {kv_dim}, Kind::bias, kBiasStd, false, l);
      add(b + "attn_v.bias", {kv_dim}, Kind::bias, kBiasStd, false, l);
    }
    if (has_qk_norm(s.arch)) {
      add(b + "attn_q_norm.weight", {s.head_dim}, Kind::norm, kNormNoise, false, l);
      add(b + "attn_k_norm.weight", {s.head_dim}, Kind::norm, kNormNoise, false, l);
    }
    add(b + "attn_output.weight", {q_dim, n}, Kind::normal,
        static_cast<float>(in_std(q_dim) * resid), false, l);
    add(b + "ffn_norm.weight", {n}, Kind::norm, kNormNoise, false, l);
    if (s.n_expert > 0) {
      const int64_t f = s.n_ff_exp, E = s.n_expert;
      add(b + "ffn_gate_inp.weight", {n, E}, Kind::router, in_std(n), true, l);
      add(b + "ffn_gate_exps.weight", {n, f, E}, Kind::normal, in_std(n), true, l);
      add(b + "ffn_up_exps.weight", {n, f, E}, Kind::normal, in_std(n), true, l);
      add(b + "ffn_down_exps.weight", {f, n, E}, Kind::normal,
          static_cast<float>(in_std(f) * resid), false, l);
    } else {
      add(b + "ffn_gate.weight", {n, s.n_ff}, Kind::normal, in_std(n), true, l);
      add(b + "ffn_up.weight", {n, s.n_ff}, Kind::normal, in_std(n), true, l);
      add(b + "ffn_down.weight", {s.n_ff, n}, Kind::normal,
          static_cast<float>(in_std(s.n_ff) * resid), false, l);
    }
  }
  add("output_norm.weight", {n}, Kind::norm, kNormNoise, false, -1);
  if (!s.tie_embeddings) add("output.weight", {n, s.n_vocab}, Kind::normal, in_std(n), false, -1);
  // The MTP block last, so that the main model's tensors (and their values) do not depend on it.
  for (int64_t l = L; l < L + s.n_mtp; ++l) add_hybrid_layer(s, l, add);
  if (p.skew) plan_skew(p);
  return p;
}

// Row `row` of tensor `index` (f32, ne[0] elements) into `out`.
void generate_row(const Plan& p, const TensorGen& g, uint64_t index, int64_t row, float* out) {
  const int64_t n = g.t.ne[0];
  Rng r{stream_key(p.spec.seed, index, static_cast<uint64_t>(row))};
  switch (g.kind) {
    case Kind::norm:
      for (int64_t i = 0; i < n; ++i) out[i] = 1.0f + g.std * r.normal();
      return;
    case Kind::ssm_a:
      for (int64_t i = 0; i < n; ++i) {
        const double u = static_cast<double>(r.next() >> 11) * 0x1.0p-53;
        out[i] = static_cast<float>(-std::exp(std::log(0.05) + u * std::log(20.0)));
      }
      return;
    case Kind::bias:
    case Kind::normal:
    case Kind::embedding:
    case Kind::router:
      for (int64_t i = 0; i < n; ++i) out[i] = g.std * r.normal();
      break;
  }
  if (!g.orth) return;
  // Remove the component along u (n == n_embd for every orthogonalised tensor).
  const float* u = p.u.data();
  double dot = 0.0;
  for (int64_t i = 0; i < n; ++i) dot += static_cast<double>(out[i]) * u[i];
  double add = -dot;
  if (g.kind == Kind::embedding) add += double(kShared) * std::sqrt(static_cast<double>(n));
  if (g.kind == Kind::router) add += p.alpha[g.layer][row];
  const auto a = static_cast<float>(add);
  for (int64_t i = 0; i < n; ++i) out[i] += a * u[i];
}

// ---------------------------------------------------------------------------------------------
// Metadata
// ---------------------------------------------------------------------------------------------

void write_metadata(const Plan& p, gguf::Writer& w, VocabData* hf_vocab) {
  const SynthSpec& s = p.spec;
  const std::string a = s.arch + ".";
  const auto u32 = [](int64_t v) { return static_cast<uint32_t>(v); };
  w.set_string("general.architecture", s.arch);
  w.set_string("general.name", "berth synth " + s.name);
  const std::optional<GgmlType> uni = uniform_type(s.type);
  w.set_u32("general.file_type", uni ? llama_ftype_of(*uni) : 15u);  // 15: MOSTLY_Q4_K_M
  const bool quantized = !uni || traits(*uni).quantized;
  if (quantized) w.set_u32("general.quantization_version", 2);
  w.set_u32(a + "context_length", u32(s.n_ctx_train));
  w.set_u32(a + "embedding_length", u32(s.n_embd));
  w.set_u32(a + "block_count", u32(s.n_layer + s.n_mtp));
  if (s.n_ff > 0) w.set_u32(a + "feed_forward_length", u32(s.n_ff));
  w.set_u32(a + "attention.head_count", u32(s.n_head));
  w.set_u32(a + "attention.head_count_kv", u32(s.n_head_kv));
  if (has_qk_norm(s.arch) || s.head_dim * s.n_head != s.n_embd) {
    w.set_u32(a + "attention.key_length", u32(s.head_dim));
    w.set_u32(a + "attention.value_length", u32(s.head_dim));
  }
  w.set_f32(a + "rope.freq_base", s.rope_freq_base);
  w.set_f32(a + "attention.layer_norm_rms_epsilon", s.rms_eps);
  if (s.n_expert > 0) {
    w.set_u32(a + "expert_count", u32(s.n_expert));
    w.set_u32(a + "expert_used_count", u32(s.n_expert_used));
    if (s.arch != "llama") w.set_u32(a + "expert_feed_forward_length", u32(s.n_ff_exp));
  }
  if (is_hybrid_arch(s.arch)) write_hybrid_metadata(s, w);
  if (hf_vocab)
    write_hf_vocab(s, std::move(*hf_vocab), w);
  else if (uses_spm(s))
    write_spm_vocab(s, w);
  else
    write_bpe_vocab(s, is_hybrid_arch(s.arch) ? "qwen35" : "qwen2", w);
}

int64_t n_elements(const std::vector<int64_t>& ne) {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;
  return n;
}

}  // namespace

std::vector<std::string> synth_presets() {
  std::vector<std::string> out;
  for (const Preset& p : presets()) out.emplace_back(p.name);
  return out;
}

SynthSpec synth_preset(std::string_view name) {
  for (const Preset& p : presets())
    if (name == p.name) {
      SynthSpec s = p.spec;
      s.name = p.name;
      return s;
    }
  std::string list;
  for (const Preset& p : presets()) list += std::string(list.empty() ? "" : ", ") + p.name;
  bad(fmt::format("--preset: unknown preset '{}' (expected one of: {})", printable(name), list));
}

void validate_synth_spec(const SynthSpec& spec) { check_spec(resolved(spec, nullptr)); }

GgmlType synth_tensor_type(const SynthSpec& spec, std::string_view name, int64_t layer) {
  const std::optional<GgmlType> uni = uniform_type(spec.type);
  if (ends_with(name, "_norm.weight") || ends_with(name, ".bias") ||
      ends_with(name, "ffn_gate_inp.weight") || ends_with(name, "ffn_gate_inp_shexp.weight") ||
      ends_with(name, "ssm_conv1d.weight") || ends_with(name, "ssm_beta.weight") ||
      ends_with(name, "ssm_alpha.weight") || ends_with(name, ".ssm_a"))
    return GgmlType::F32;
  if (uni) return *uni;
  // q4_k_m
  if (name == "output.weight") return GgmlType::Q6_K;
  if (ends_with(name, "attn_qkv.weight")) return GgmlType::Q5_K;
  const bool more_bits_kind = ends_with(name, "attn_v.weight") ||
                              ends_with(name, "ffn_down.weight") ||
                              ends_with(name, "ffn_down_exps.weight");
  if (more_bits_kind && layer >= 0 && use_more_bits(layer, spec.n_layer)) return GgmlType::Q6_K;
  return GgmlType::Q4_K;
}

std::vector<SynthTensor> synth_tensor_plan(const SynthSpec& spec) {
  Plan p = make_plan(spec, nullptr);
  std::vector<SynthTensor> out;
  for (TensorGen& g : p.tensors) out.push_back(std::move(g.t));
  return out;
}

SynthStats write_synth_model(const SynthSpec& spec, const std::string& path, int n_threads,
                             const std::function<void(double fraction)>& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  VocabData hf;
  {
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec))
      throw Error(ErrorCategory::io, fmt::format("output '{}' is a directory", printable(path)));
  }
  const Plan plan = make_plan(spec, spec.vocab_path.empty() ? nullptr : &hf);
  // The writer holds one whole tensor in memory while it is produced: refuse a shape whose
  // largest tensor would not fit comfortably before spending minutes on it.
  {
    const TensorGen* largest = nullptr;
    uint64_t largest_bytes = 0;
    for (const TensorGen& g : plan.tensors) {
      const uint64_t b =
          static_cast<uint64_t>(n_elements(g.t.ne) / g.t.ne[0]) * row_bytes(g.t.type, g.t.ne[0]);
      if (b > largest_bytes) largest_bytes = b, largest = &g;
    }
    const uint64_t phys = physical_memory_bytes();
    if (largest && phys > 0 && largest_bytes > phys / 2 && !spec.sparse)
      bad(fmt::format(
          "tensor '{}' would be {:.1f} GB ({} {}), and it is held in memory while it is "
          "written: more than half of this machine's {:.1f} GB (check --n-embd, "
          "--n-vocab, --n-ff, --n-expert)",
          largest->t.name, static_cast<double>(largest_bytes) / 1e9, type_name(largest->t.type),
          fmt::join(largest->t.ne, " x "), static_cast<double>(phys) / 1e9));
  }
  ThreadPool pool(n_threads > 0 ? n_threads : physical_core_count());
  const int nt = pool.n_threads();

  gguf::Writer w;
  write_metadata(plan, w, spec.vocab_path.empty() ? nullptr : &hf);

  SynthStats st;
  for (const TensorGen& g : plan.tensors) {
    st.n_params += n_elements(g.t.ne);
    st.tensor_bytes +=
        static_cast<uint64_t>(n_elements(g.t.ne) / g.t.ne[0]) * row_bytes(g.t.type, g.t.ne[0]);
    if (!g.t.note.empty()) {
      st.notes.push_back(g.t.note);
      log::info("{}", g.t.note);
    }
  }
  st.n_tensors = static_cast<int64_t>(plan.tensors.size());

  const uint64_t total = std::max<uint64_t>(1, st.tensor_bytes);
  uint64_t done = 0;
  for (size_t ti = 0; ti < plan.tensors.size(); ++ti) {
    const TensorGen* g = &plan.tensors[ti];
    const Plan* pl = &plan;
    w.add_tensor(g->t.name, g->t.type, g->t.ne,
                 [pl, g, ti, nt, total, &done, &pool, &progress](std::span<uint8_t> dst) {
                   const int64_t n = g->t.ne[0];
                   const int64_t n_rows = n_elements(g->t.ne) / n;
                   const size_t rb = row_bytes(g->t.type, n);
                   // Slabs of about 4 Mi elements: progress several times a second.
                   const int64_t slab = std::max<int64_t>(1, (int64_t{4} << 20) / n);
                   for (int64_t s0 = 0; s0 < n_rows; s0 += slab) {
                     const int64_t s1 = std::min(n_rows, s0 + slab);
                     const int64_t grain = std::max<int64_t>(1, (s1 - s0) / (int64_t{nt} * 4));
                     pool.parallel_for(s1 - s0, grain, [&](int64_t r0, int64_t r1) {
                       std::vector<float> row(static_cast<size_t>(n));
                       for (int64_t r = s0 + r0; r < s0 + r1; ++r) {
                         generate_row(*pl, *g, ti, r, row.data());
                         ref::quantize_row_fast(g->t.type, row.data(),
                                                dst.data() + static_cast<size_t>(r) * rb, n);
                       }
                     });
                     done += static_cast<uint64_t>(s1 - s0) * rb;
                     if (progress) progress(static_cast<double>(done) / static_cast<double>(total));
                   }
                 });
  }
  // Refused up front when the tensor data alone cannot fit in the free space of the output's
  // file system (a 235B f32 file is ~940 GB): better than hours of writing and a full disk.
  {
    std::error_code sec;
    std::filesystem::path dir = std::filesystem::path(path).parent_path();
    if (dir.empty()) dir = ".";
    const std::filesystem::space_info sp = std::filesystem::space(dir, sec);
    // An existing file at `path` is replaced only after the new one is complete.
    if (!sec && st.tensor_bytes > sp.available && !spec.sparse)
      throw Error(ErrorCategory::io,
                  fmt::format("synth: '{}' needs {:.1f} GB of tensor data but {} has {:.1f} GB "
                              "free",
                              printable(path), static_cast<double>(st.tensor_bytes) / 1e9,
                              printable(dir.string()), static_cast<double>(sp.available) / 1e9));
  }
  // Written under a temporary name and renamed when complete, so an interrupted run never
  // replaces an existing file with a partial one.
  const std::string partial = path + ".partial";
  try {
    if (spec.sparse)
      w.write_sparse(partial);
    else
      w.write(partial);
  } catch (...) {
    std::error_code ignore;
    std::filesystem::remove(partial, ignore);
    throw;
  }
  std::error_code ec;
  std::filesystem::rename(partial, path, ec);
  if (ec) {
    std::error_code ignore;
    std::filesystem::remove(partial, ignore);
    throw Error(ErrorCategory::io, fmt::format("cannot rename '{}' to '{}': {}", printable(partial),
                                               printable(path), ec.message()));
  }
  const auto size = std::filesystem::file_size(path, ec);
  st.bytes_written = ec ? 0 : static_cast<uint64_t>(size);
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace berth
