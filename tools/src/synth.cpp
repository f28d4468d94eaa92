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

#include "berth/core/error.h"
#include "berth/core/log.h"
#include "berth/core/strings.h"
#include "berth/cpu_kernels/quants_ref.h"
#include "berth/io/gguf_writer.h"
#include "berth/models/tokenizer.h"
#include "berth/tools/quantize.h"
#include "berth/backends/thread_pool.h"

namespace berth {
namespace {

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
  };
  return p;
}

// ---------------------------------------------------------------------------------------------
// Spec checks
// ---------------------------------------------------------------------------------------------

bool is_moe_arch(const std::string& a) { return a == "qwen3moe"; }
bool has_qk_norm(const std::string& a) { return a == "qwen3" || a == "qwen3moe"; }
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
  static const std::set<std::string> archs = {"llama", "qwen2", "qwen3", "qwen3moe"};
  if (!archs.count(s.arch))
    bad(
        fmt::format("--arch: unknown architecture '{}' (expected one of: llama qwen2 qwen3 "
                    "qwen3moe)",
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
  dim(s.n_ff, "n_ff", "--n-ff");
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
  if ((s.arch == "qwen2" || s.arch == "qwen3") && s.n_expert != 0)
    bad(fmt::format("--n-expert: {} is dense (n_expert = {}); use qwen3moe for experts", s.arch,
                    s.n_expert));
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

enum class Kind { normal, norm, bias, embedding, router };

struct TensorGen {
  SynthTensor t;
  Kind kind = Kind::normal;
  float std = 0.0f;
  bool orth = false;  // rows made orthogonal to u
  int64_t layer = -1;
};

constexpr float kEmbdStd = 0.05f;  // token part of token_embd, per element
constexpr float kShared = 0.3f;    // rms per element of the shared direction (router skew)
constexpr float kNormNoise = 0.02f;
constexpr float kBiasStd = 0.02f;

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
  p.alpha.assign(static_cast<size_t>(L), std::vector<float>(static_cast<size_t>(E)));
  std::vector<double> logw(static_cast<size_t>(E));
  for (int64_t l = 0; l < L; ++l) {
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
  for (int64_t l = 0; l < L; ++l) {
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
// Vocabularies
// ---------------------------------------------------------------------------------------------

// Common English words, most frequent first (used to learn plausible merges).
constexpr std::string_view kWords[] = {
    "the",       "of",      "and",      "to",      "in",       "a",       "is",      "that",
    "for",       "it",      "as",       "was",     "with",     "be",      "by",      "on",
    "not",       "he",      "this",     "are",     "or",       "his",     "from",    "at",
    "which",     "but",     "have",     "an",      "had",      "they",    "you",     "were",
    "there",     "one",     "all",      "we",      "can",      "her",     "has",     "been",
    "if",        "more",    "when",     "will",    "would",    "who",     "so",      "no",
    "she",       "other",   "its",      "may",     "these",    "what",    "them",    "than",
    "some",      "him",     "time",     "into",    "only",     "do",      "their",   "two",
    "also",      "about",   "could",    "new",     "first",    "like",    "then",    "any",
    "over",      "such",    "our",      "after",   "most",     "made",    "between", "before",
    "through",   "where",   "many",     "each",    "under",    "those",   "people",  "world",
    "because",   "while",   "should",   "found",   "state",    "same",    "system",  "number",
    "great",     "small",   "house",    "water",   "little",   "story",   "called",  "world",
    "school",    "during",  "another",  "without", "against",  "however", "always",  "nothing",
    "something", "example", "language", "model",   "question", "answer",  "think",   "know",
    "hello",     "once",    "upon",     "dragon",  "quick",    "brown",   "fox",     "jumps",
    "lazy",      "dog",     "day",      "night",   "king",     "queen",   "city",    "river",
};

// GPT-2's bytes_to_unicode symbols of the 256 bytes (models' gpt2_byte_symbol).
std::vector<std::string> gpt2_byte_symbols() {
  std::vector<std::string> out(256);
  for (int b = 0; b < 256; ++b)
    out[static_cast<size_t>(b)] = gpt2_byte_symbol(static_cast<uint8_t>(b));
  return out;
}

struct Merge {
  std::string left, right;
};

// Learns up to `budget` merges over the word list (words prefixed with `space`, frequencies
// falling as 1/rank), then extends tokens systematically by one letter, so that every merge joins
// two existing tokens into a new one. `have` holds the base tokens and receives the new ones.
std::vector<Merge> make_merges(const std::string& space, int64_t budget,
                               std::unordered_set<std::string>& have) {
  std::vector<Merge> merges;
  struct Word {
    std::vector<std::string> sym;
    int64_t freq;
  };
  std::vector<Word> words;
  int64_t rank = 1;
  for (std::string_view w : kWords) {
    Word x;
    x.freq = 10000 / rank++;
    x.sym.push_back(space);
    for (char c : w) x.sym.emplace_back(1, c);
    words.push_back(std::move(x));
  }
  while (static_cast<int64_t>(merges.size()) < budget) {
    std::map<std::pair<std::string, std::string>, int64_t> count;
    for (const Word& w : words)
      for (size_t i = 0; i + 1 < w.sym.size(); ++i) count[{w.sym[i], w.sym[i + 1]}] += w.freq;
    const std::pair<std::string, std::string>* best = nullptr;
    int64_t best_n = 0;
    for (const auto& [pair, c] : count)  // ordered map: ties go to the smallest pair
      if (c > best_n) best = &pair, best_n = c;
    if (!best) break;
    const std::string l = best->first, r = best->second, lr = l + r;
    for (Word& w : words) {
      std::vector<std::string> out;
      for (size_t i = 0; i < w.sym.size(); ++i) {
        if (i + 1 < w.sym.size() && w.sym[i] == l && w.sym[i + 1] == r) {
          out.push_back(lr);
          ++i;
        } else {
          out.push_back(w.sym[i]);
        }
      }
      w.sym = std::move(out);
    }
    if (have.insert(lr).second) merges.push_back({l, r});
  }
  std::vector<std::string> grow = {space};
  for (char c = 'a'; c <= 'z'; ++c) grow.emplace_back(1, c);
  for (size_t i = 0; static_cast<int64_t>(merges.size()) < budget; ++i) {
    const std::string base = grow[i];  // copy: grow reallocates
    for (char c = 'a'; c <= 'z' && static_cast<int64_t>(merges.size()) < budget; ++c) {
      std::string s = base + c;
      if (!have.insert(s).second) continue;
      merges.push_back({base, std::string(1, c)});
      grow.push_back(std::move(s));
    }
  }
  return merges;
}

constexpr const char* kChatMl =
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}";

void write_spm_vocab(const SynthSpec& s, gguf::Writer& w) {
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types = {int32_t(TokenType::unknown), int32_t(TokenType::control),
                                int32_t(TokenType::control)};
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(fmt::format("<0x{:02X}>", b));
    types.push_back(int32_t(TokenType::byte));
  }
  const std::string space = "\xE2\x96\x81";  // U+2581
  std::vector<std::string> chars = {space};
  for (int c = 0x21; c <= 0x7E; ++c) chars.emplace_back(1, static_cast<char>(c));
  std::unordered_set<std::string> have(chars.begin(), chars.end());
  const int64_t n_base = static_cast<int64_t>(tokens.size() + chars.size());
  std::vector<Merge> merges = make_merges(space, s.n_vocab - n_base, have);
  std::vector<float> scores(tokens.size(), 0.0f);
  // Pieces score by creation order (a merge learned earlier wins); single characters last.
  for (size_t i = 0; i < merges.size(); ++i) {
    tokens.push_back(merges[i].left + merges[i].right);
    types.push_back(int32_t(TokenType::normal));
    scores.push_back(-static_cast<float>(i));
  }
  for (size_t i = 0; i < chars.size(); ++i) {
    tokens.push_back(chars[i]);
    types.push_back(int32_t(TokenType::normal));
    scores.push_back(-static_cast<float>(merges.size() + i));
  }
  BERTH_CHECK(static_cast<int64_t>(tokens.size()) == s.n_vocab, "spm vocabulary size");
  w.set_string("tokenizer.ggml.model", "llama");
  w.set_string_array("tokenizer.ggml.tokens", std::move(tokens));
  w.set_f32_array("tokenizer.ggml.scores", std::move(scores));
  w.set_i32_array("tokenizer.ggml.token_type", std::move(types));
  w.set_u32("tokenizer.ggml.bos_token_id", 1);
  w.set_u32("tokenizer.ggml.eos_token_id", 2);
  w.set_u32("tokenizer.ggml.unknown_token_id", 0);
  w.set_bool("tokenizer.ggml.add_bos_token", true);
  w.set_bool("tokenizer.ggml.add_eos_token", false);
}

void write_gpt2_keys(gguf::Writer& w, std::vector<std::string> tokens, std::vector<int32_t> types,
                     std::vector<std::string> merges, const std::string& pre,
                     const std::string& chat_template) {
  auto find = [&](std::string_view t) -> int64_t {
    for (size_t i = tokens.size(); i-- > 0;)
      if (tokens[i] == t) return static_cast<int64_t>(i);
    return -1;
  };
  const int64_t eot = find("<|endoftext|>");
  int64_t eos = find("<|im_end|>");
  if (eos < 0) eos = eot;
  w.set_string("tokenizer.ggml.model", "gpt2");
  w.set_string("tokenizer.ggml.pre", pre);
  w.set_string_array("tokenizer.ggml.tokens", std::move(tokens));
  w.set_i32_array("tokenizer.ggml.token_type", std::move(types));
  w.set_string_array("tokenizer.ggml.merges", std::move(merges));
  if (eos >= 0) w.set_u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(eos));
  if (eot >= 0) {
    w.set_u32("tokenizer.ggml.padding_token_id", static_cast<uint32_t>(eot));
    w.set_u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(eot));
  }
  w.set_bool("tokenizer.ggml.add_bos_token", false);
  if (!chat_template.empty()) w.set_string("tokenizer.chat_template", chat_template);
}

void write_bpe_vocab(const SynthSpec& s, gguf::Writer& w) {
  std::vector<std::string> tokens = gpt2_byte_symbols();
  std::unordered_set<std::string> have(tokens.begin(), tokens.end());
  const std::vector<std::string> specials = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  const int64_t n_merges = s.n_vocab - 256 - static_cast<int64_t>(specials.size());
  std::vector<Merge> m = make_merges(tokens[' '], n_merges, have);
  std::vector<std::string> merges;
  merges.reserve(m.size());
  for (const Merge& x : m) {
    tokens.push_back(x.left + x.right);
    merges.push_back(x.left + " " + x.right);
  }
  std::vector<int32_t> types(tokens.size(), int32_t(TokenType::normal));
  for (const std::string& t : specials) {
    tokens.push_back(t);
    types.push_back(int32_t(TokenType::control));
  }
  BERTH_CHECK(static_cast<int64_t>(tokens.size()) == s.n_vocab, "bpe vocabulary size");
  write_gpt2_keys(w, std::move(tokens), std::move(types), std::move(merges), "qwen2", kChatMl);
}

// tokenizer_config.json's chat_template (a string, or a list of {name, template} entries of
// which "default" is taken); empty when the file or the field is absent.
std::string read_chat_template(const std::string& tokenizer_json) {
  const std::filesystem::path cfg =
      std::filesystem::path(tokenizer_json).parent_path() / "tokenizer_config.json";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(cfg, ec)) return {};
  std::ifstream f(cfg);
  if (!f) throw Error(ErrorCategory::io, fmt::format("cannot read '{}'", cfg.string()));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw Error(ErrorCategory::format,
                fmt::format("{}: not valid JSON: {}", cfg.string(), printable(e.what())));
  }
  if (!j.is_object() || !j.contains("chat_template")) return {};
  const nlohmann::json& t = j["chat_template"];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_array())
    for (const auto& e : t)
      if (e.is_object() && e.value("name", "") == "default" && e.contains("template") &&
          e["template"].is_string())
        return e["template"].get<std::string>();
  throw Error(ErrorCategory::format,
              fmt::format("{}: chat_template is neither a string nor a list with a \"default\" "
                          "entry",
                          cfg.string()));
}

void write_hf_vocab(const SynthSpec& s, VocabData v, gguf::Writer& w) {
  const auto n_tok = static_cast<int64_t>(v.tokens.size());
  std::vector<int32_t> types(static_cast<size_t>(s.n_vocab), int32_t(TokenType::normal));
  for (int64_t i = 0; i < n_tok && i < static_cast<int64_t>(v.types.size()); ++i)
    types[i] = static_cast<int32_t>(v.types[i]);
  for (int64_t i = n_tok; i < s.n_vocab; ++i) {
    v.tokens.push_back(fmt::format("[PAD{}]", i));
    types[i] = int32_t(TokenType::unused);
  }
  write_gpt2_keys(w, std::move(v.tokens), std::move(types), std::move(v.merges),
                  v.pre.empty() ? "default" : v.pre, read_chat_template(s.vocab_path));
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
  w.set_u32(a + "block_count", u32(s.n_layer));
  w.set_u32(a + "feed_forward_length", u32(s.n_ff));
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
    if (s.arch == "qwen3moe") w.set_u32(a + "expert_feed_forward_length", u32(s.n_ff_exp));
  }
  if (hf_vocab)
    write_hf_vocab(s, std::move(*hf_vocab), w);
  else if (uses_spm(s))
    write_spm_vocab(s, w);
  else
    write_bpe_vocab(s, w);
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
      ends_with(name, "ffn_gate_inp.weight"))
    return GgmlType::F32;
  if (uni) return *uni;
  // q4_k_m
  if (name == "output.weight") return GgmlType::Q6_K;
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
    if (largest && phys > 0 && largest_bytes > phys / 2)
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
    if (!sec && st.tensor_bytes > sp.available)
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
