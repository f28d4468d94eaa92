// The oracle: a naive, double-precision reference forward pass of the architectures berth runs:
// `llama` (dense, and Mixtral-style with experts), `qwen2`, `qwen3` and `qwen3moe` (this file),
// and the hybrids `qwen35` and `qwen35moe` (naive_qwen35.h; NaiveModel delegates to it).
//
// Every optimised path of berth (models/, runtime/, the SIMD and CUDA kernels) is tested
// against this class. It shares no math code with those paths on purpose: weights are decoded
// once to double (F32/F64 read directly; every other type through the scalar reference
// dequantizer berth::ref::dequantize_rows), and the forward is plain single-threaded loops in
// double precision, written to be read and checked by eye rather than to be fast.
//
// Model (as GGUF files of these architectures expect it; Touvron et al. 2023, "LLaMA"; Qwen2
// and Qwen3 technical reports; Jiang et al. 2024, "Mixtral of Experts"):
//   x = token_embd[token]
//   for each layer:
//     h = rms(x) * attn_norm
//     q = attn_q h, k = attn_k h, v = attn_v h    (+ attn_q/k/v.bias for qwen2)
//     q, k: per-head RMSNorm times attn_q_norm / attn_k_norm   (qwen3, qwen3moe; when present)
//     q, k: RoPE at the token's position
//     x += attn_output( attention(q, k, v) )
//     h = rms(x) * ffn_norm
//     dense: x += ffn_down( silu(ffn_gate h) * ffn_up h )
//     MoE:   x += sum_j w_j * down_exps[e_j]( silu(gate_exps[e_j] h) * up_exps[e_j] h )
//            with (e_j, w_j) = route_experts(ffn_gate_inp h, n_expert_used, renormalise)
//   logits = output( rms(x) * output_norm )        (output tied to token_embd when absent)
// with RMSNorm y = x * w / sqrt(mean(x^2) + eps) (Zhang & Sennrich 2019); causal grouped-query
// attention (query head h reads KV head h / (n_head / n_head_kv); Ainslie et al. 2023) with
// scores q.k / sqrt(head_dim); SwiGLU with silu(z) = z / (1 + e^-z) (Shazeer 2020); RoPE (Su et
// al. 2021) rotating pairs of each head's first n_rot dims by theta_i = pos * freq_base^(-2i/n_rot)
// (i < n_rot/2), the pairs being
//   - "normal" (GPT-J) layout for llama: adjacent (x[2i], x[2i+1]);
//   - NeoX layout for qwen2, qwen3, qwen3moe: (x[i], x[i + n_rot/2]).
// The per-arch details follow llama.cpp's GGUF conventions (facts, not code): qwen2 has F32
// biases on Q, K and V; qwen3/qwen3moe have per-head RMSNorm of q and k before RoPE (each
// head_dim chunk normalised with the layer's eps and multiplied by the {head_dim} weight);
// head_dim comes from {arch}.attention.key_length, so n_head * head_dim may differ from n_embd.
//
// Weight layout: a GGUF linear weight mapping n_in -> n_out has ne = {n_in, n_out} with ne[0]
// contiguous, so y[o] = sum_i W[o * n_in + i] * x[i]. Stacked expert tensors have a third axis:
// ffn_gate_exps / ffn_up_exps ne = {n_embd, n_ff_exp, n_expert}, ffn_down_exps ne = {n_ff_exp,
// n_embd, n_expert}; expert e is the 2-D matrix at element offset e * ne[0] * ne[1].
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "berth/io/gguf.h"

namespace berth::oracle {

class NaiveQwen35;

/// Hyper-parameters as read from GGUF metadata. Keys carry the `{general.architecture}.`
/// prefix (written `{arch}.` below), e.g. `qwen3.attention.key_length`.
struct NaiveModelConfig {
  std::string arch;       ///< general.architecture: llama, qwen2, qwen3 or qwen3moe
  int32_t n_vocab = 0;    ///< token_embd.weight ne[1]
  int32_t n_embd = 0;     ///< {arch}.embedding_length
  int32_t n_layer = 0;    ///< {arch}.block_count
  int32_t n_head = 0;     ///< {arch}.attention.head_count
  int32_t n_head_kv = 0;  ///< {arch}.attention.head_count_kv (default n_head)
  /// {arch}.feed_forward_length: the dense FFN size. Required for dense models and for llama
  /// with experts (where it is also the expert size); optional (0 when absent) for qwen3moe.
  int32_t n_ff = 0;
  int32_t head_dim = 0;  ///< {arch}.attention.key_length (default n_embd / n_head)
  int32_t n_rot = 0;     ///< {arch}.rope.dimension_count (default head_dim); even, <= head_dim
  double rms_eps = 0.0;  ///< {arch}.attention.layer_norm_rms_epsilon
  double rope_freq_base = 10000.0;  ///< {arch}.rope.freq_base (default 10000)
  /// Linear RoPE position scaling: positions are divided by this ({arch}.rope.scaling.factor
  /// when {arch}.rope.scaling.type is "linear"; 1 otherwise).
  double rope_linear_factor = 1.0;
  bool has_rope_freqs = false;  ///< rope_freqs.weight present: theta_i divided by its entry i
  bool tied_output = false;     ///< output.weight absent: the head reuses token_embd.weight
  bool rope_neox = false;       ///< NeoX pair layout (qwen*); false: adjacent pairs (llama)
  bool attn_bias = false;       ///< attn_q/k/v.bias (qwen2, where they are required)
  bool q_norm = false;   ///< blk.0.attn_q_norm.weight present (qwen3*; each layer read on its own)
  bool k_norm = false;   ///< blk.0.attn_k_norm.weight present (qwen3*; each layer read on its own)
  int32_t n_expert = 0;  ///< {arch}.expert_count (0: dense FFN in every layer)
  int32_t n_expert_used = 0;  ///< {arch}.expert_used_count (1..n_expert when n_expert > 0)
  /// Rows of one expert's gate/up matrix: {arch}.expert_feed_forward_length for qwen3moe,
  /// {arch}.feed_forward_length for llama with experts (Mixtral); 0 for dense models.
  int32_t n_ff_exp = 0;
  /// Routing weights renormalised to sum 1 over the selected experts: qwen3moe reads
  /// {arch}.expert_weights_norm (default true); Mixtral-style llama always renormalises.
  bool expert_weights_norm = false;
  int32_t context_length = 0;  ///< {arch}.context_length (the file's training context)
  int32_t n_ctx = 0;           ///< positions this instance accepts (constructor's n_ctx)
};

/// The former name, kept for existing callers.
using NaiveLlamaConfig = NaiveModelConfig;

/// The experts one token is sent to in one MoE layer.
struct Routing {
  /// Selected expert ids, n_expert_used of them, by descending probability (ties: ascending id).
  std::vector<int32_t> ids;
  /// Weight of each selected expert (same order as ids): its softmax probability over all
  /// experts, divided by the sum over the selected ones when renormalised.
  std::vector<double> weights;
  /// Softmax over all n_expert router logits (index = expert id), for diagnosing near ties.
  std::vector<double> probs;

  /// How a weight is to be compared with a float implementation: the double rounded to the
  /// nearest float (one rounding, no intermediate float math).
  static float round_weight(double w) { return static_cast<float>(w); }
};

/// Top-k softmax routing (Shazeer et al. 2017; Mixtral and Qwen3-MoE use it): p =
/// softmax(logits) over all experts, computed in double with the maximum subtracted; the
/// n_expert_used experts with the largest p are selected, ties going to the lowest id, in
/// order of descending p then ascending id; w_j = p_j, divided by sum_j p_j when `renormalise`
/// (which equals the softmax over the selected logits).
/// logits: n_expert router outputs (index = expert id). Float logits are widened exactly.
/// Throws Error(invalid_argument) when logits is empty, holds a NaN or infinity, or
/// n_expert_used is not in [1, logits.size()].
Routing route_experts(const std::vector<double>& logits, int n_expert_used, bool renormalise);
Routing route_experts(const std::vector<float>& logits, int n_expert_used, bool renormalise);

/// Naive forward of llama (dense or Mixtral-style), qwen2, qwen3 or qwen3moe with its own KV
/// cache; for qwen35 / qwen35moe files it runs a NaiveQwen35 (hybrid()) and fills config() with
/// the fields both share (n_layer: the main layers; n_head_kv: that of the first attention
/// layer). Not thread-safe; one position per step().
class NaiveModel {
 public:
  /// Reads hyper-parameters and all weights (converted to double) from `file`. `n_ctx`: the
  /// most positions step() accepts (0 = the file's {arch}.context_length). The File may be
  /// destroyed afterwards.
  /// Tensors per layer blk.N.: attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm; qwen2:
  /// attn_q.bias, attn_k.bias, attn_v.bias; qwen3/qwen3moe (optional): attn_q_norm,
  /// attn_k_norm; dense: ffn_gate, ffn_up, ffn_down; MoE: ffn_gate_inp {n_embd, n_expert},
  /// ffn_gate_exps, ffn_up_exps, ffn_down_exps. Globals: token_embd, output_norm, output
  /// (optional), rope_freqs (optional).
  /// Throws: gguf::GgufError(missing_key / missing_tensor / wrong_type) for an absent or
  /// mistyped key or tensor; Error(format) for inconsistent hyper-parameters (e.g.
  /// n_expert_used > n_expert, qwen3moe without experts) or a tensor whose shape does not match
  /// them (the message names the tensor, the expected and actual shape); Error(unsupported) for
  /// another architecture, RoPE scaling other than none/linear, per-layer head counts, expert
  /// gating other than softmax ({arch}.expert_gating_func != 1), shared experts, a Mixtral file
  /// asking for no renormalisation, a tensor type that cannot be dequantized, or any tensor
  /// this model does not use (e.g. biases on llama); Error(invalid_argument) for n_ctx < 0.
  explicit NaiveModel(const gguf::File& file, int n_ctx = 0);
  virtual ~NaiveModel();
  NaiveModel(const NaiveModel& other);  ///< a deep copy: a snapshot of the sequence
  NaiveModel& operator=(const NaiveModel& other);
  NaiveModel(NaiveModel&&) noexcept;
  NaiveModel& operator=(NaiveModel&&) noexcept;

  /// Feeds `token` at position pos() (0, 1, 2, ...), appends its keys and values to the KV
  /// cache and returns the logits for the next token: n_vocab doubles, unnormalised. For MoE
  /// models it also records each layer's routing of this token (last_routing()).
  /// Throws Error(invalid_argument) for a token outside [0, n_vocab) or when pos() == n_ctx.
  std::vector<double> step(int32_t token);

  /// Clears the KV cache and the recorded routing; the next step() is at position 0 again.
  void reset();

  int32_t n_vocab() const { return cfg_.n_vocab; }
  /// Number of tokens fed since construction or the last reset().
  int32_t pos() const { return pos_; }
  const NaiveModelConfig& config() const { return cfg_; }
  /// The routing of the token of the last step(), one entry per layer (index = layer); empty
  /// for dense models, and entries with empty ids before the first step() or after reset().
  const std::vector<Routing>& last_routing() const { return last_routing_; }
  /// The hybrid forward for qwen35 / qwen35moe files (its config, recurrent state); null for
  /// the other architectures.
  const NaiveQwen35* hybrid() const { return hybrid_.get(); }

 private:
  struct Layer {
    std::vector<double> attn_norm;  // [n_embd]
    std::vector<double> wq;         // [n_head*head_dim][n_embd], n_embd contiguous
    std::vector<double> wk;         // [n_head_kv*head_dim][n_embd]
    std::vector<double> wv;         // [n_head_kv*head_dim][n_embd]
    std::vector<double> bq;         // [n_head*head_dim]; empty without biases
    std::vector<double> bk;         // [n_head_kv*head_dim]; empty without biases
    std::vector<double> bv;         // [n_head_kv*head_dim]; empty without biases
    std::vector<double> q_norm;     // [head_dim]; empty when absent
    std::vector<double> k_norm;     // [head_dim]; empty when absent
    std::vector<double> wo;         // [n_embd][n_head*head_dim]
    std::vector<double> ffn_norm;   // [n_embd]
    std::vector<double> w_gate;     // dense: [n_ff][n_embd]; MoE: [n_expert][n_ff_exp][n_embd]
    std::vector<double> w_up;       // dense: [n_ff][n_embd]; MoE: [n_expert][n_ff_exp][n_embd]
    std::vector<double> w_down;     // dense: [n_embd][n_ff]; MoE: [n_expert][n_embd][n_ff_exp]
    std::vector<double> w_router;   // MoE: [n_expert][n_embd]; empty for dense
    std::vector<double> k_cache;    // [pos][n_head_kv*head_dim], grows by one row per step
    std::vector<double> v_cache;    // [pos][n_head_kv*head_dim]
  };

  void rope_in_place(std::vector<double>& x, int32_t n_heads, int32_t position) const;

  NaiveModelConfig cfg_;
  std::vector<double> token_embd_;   // [n_vocab][n_embd]
  std::vector<double> output_norm_;  // [n_embd]
  std::vector<double> output_;       // [n_vocab][n_embd]; empty when tied to token_embd_
  std::vector<double> rope_freqs_;   // [n_rot/2]; empty when absent
  std::vector<Layer> layers_;
  std::vector<Routing> last_routing_;    // [n_layer] for MoE models; empty for dense ones
  std::unique_ptr<NaiveQwen35> hybrid_;  // qwen35 / qwen35moe only
  int32_t pos_ = 0;
};

/// The oracle restricted to files whose general.architecture is "llama" (dense or with
/// experts): the name existing tests use. Throws Error(unsupported) naming the architecture
/// for any other file, then whatever NaiveModel's constructor throws.
class NaiveLlama : public NaiveModel {
 public:
  explicit NaiveLlama(const gguf::File& file, int n_ctx = 0);
};

/// Greedy decoding with the oracle: continues from m's current position (call m.reset() first
/// for a fresh sequence), feeds every id of `prompt`, then picks `n` tokens by argmax (ties go
/// to the lowest id), feeding each one in turn; returns the n generated ids. Afterwards
/// m.pos() has grown by prompt.size() + n.
/// Throws Error(invalid_argument) for an empty prompt or n < 0, and whatever step() throws.
std::vector<int32_t> greedy_generate(NaiveModel& m, const std::vector<int32_t>& prompt, int n);

}  // namespace berth::oracle
