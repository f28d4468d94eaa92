// The oracle: a naive, double-precision reference forward pass of the `llama` architecture.
//
// Every optimised path of berth (models/, runtime/, the SIMD and CUDA kernels) is tested
// against this class. It shares no math code with those paths on purpose: weights are decoded
// once to double (F32/F64 read directly; every other type through the scalar reference
// dequantizer berth::ref::dequantize_rows), and the forward is plain single-threaded loops in
// double precision, written to be read and checked by eye rather than to be fast.
//
// Model (as GGUF files of architecture "llama" expect it; Touvron et al. 2023, "LLaMA"):
//   x = token_embd[token]
//   for each layer:
//     x += attn_output( attention( rope(attn_q(rms(x)*attn_norm)), rope(attn_k(...)),
//                                  attn_v(...) ) )
//     x += ffn_down( silu(ffn_gate(rms(x)*ffn_norm)) * ffn_up(rms(x)*ffn_norm) )
//   logits = output( rms(x) * output_norm )        (output tied to token_embd when absent)
// with RMSNorm y = x * w / sqrt(mean(x^2) + eps) (Zhang & Sennrich 2019), RoPE in the "normal"
// (GPT-J style) layout of GGUF llama files: adjacent pairs (x[2i], x[2i+1]) of each head's
// first n_rot dims rotated by pos * freq_base^(-2i/n_rot) (Su et al. 2021), causal grouped-
// query attention (query head h reads KV head h / (n_head / n_head_kv); Ainslie et al. 2023)
// with scores q.k / sqrt(head_dim), and SwiGLU with silu(z) = z / (1 + e^-z) (Shazeer 2020).
//
// Weight layout: a GGUF linear weight mapping n_in -> n_out has ne = {n_in, n_out} with ne[0]
// contiguous, so y[o] = sum_i W[o * n_in + i] * x[i].
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "berth/io/gguf.h"

namespace berth::oracle {

/// Hyper-parameters of a llama model as read from its GGUF metadata (keys carry the
/// `llama.` prefix, i.e. `{general.architecture}.`).
struct NaiveLlamaConfig {
  int32_t n_vocab = 0;    ///< token_embd.weight ne[1]
  int32_t n_embd = 0;     ///< llama.embedding_length
  int32_t n_layer = 0;    ///< llama.block_count
  int32_t n_head = 0;     ///< llama.attention.head_count
  int32_t n_head_kv = 0;  ///< llama.attention.head_count_kv (default n_head)
  int32_t n_ff = 0;       ///< llama.feed_forward_length
  int32_t head_dim = 0;   ///< llama.attention.key_length (default n_embd / n_head)
  int32_t n_rot = 0;      ///< llama.rope.dimension_count (default head_dim); even, <= head_dim
  double rms_eps = 0.0;   ///< llama.attention.layer_norm_rms_epsilon
  double rope_freq_base = 10000.0;  ///< llama.rope.freq_base (default 10000)
  /// Linear RoPE position scaling: positions are divided by this (llama.rope.scaling.factor
  /// when llama.rope.scaling.type is "linear"; 1 otherwise).
  double rope_linear_factor = 1.0;
  bool has_rope_freqs = false;  ///< rope_freqs.weight present: theta_i divided by its entry i
  bool tied_output = false;     ///< output.weight absent: the head reuses token_embd.weight
  int32_t context_length = 0;   ///< llama.context_length (the file's training context)
  int32_t n_ctx = 0;            ///< positions this instance accepts (constructor's n_ctx)
};

/// Naive llama forward with its own KV cache. Not thread-safe; one position per step().
class NaiveLlama {
 public:
  /// Reads hyper-parameters and all weights (converted to double) from `file`, whose
  /// general.architecture must be "llama". `n_ctx`: the most positions step() accepts
  /// (0 = the file's llama.context_length). The File may be destroyed afterwards.
  /// Throws: gguf::GgufError(missing_key / missing_tensor / wrong_type) for an absent or
  /// mistyped key or tensor; Error(format) for inconsistent hyper-parameters or a tensor whose
  /// shape does not match them (the message names the tensor, the expected and actual shape);
  /// Error(unsupported) for another architecture, MoE (expert_count > 0), RoPE scaling other
  /// than none/linear, per-layer head counts, a tensor type that cannot be dequantized, or any
  /// tensor this model does not use (e.g. biases); Error(invalid_argument) for n_ctx < 0.
  explicit NaiveLlama(const gguf::File& file, int n_ctx = 0);

  /// Feeds `token` at position pos() (0, 1, 2, ...), appends its keys and values to the KV
  /// cache and returns the logits for the next token: n_vocab doubles, unnormalised.
  /// Throws Error(invalid_argument) for a token outside [0, n_vocab) or when pos() == n_ctx.
  std::vector<double> step(int32_t token);

  /// Clears the KV cache; the next step() is at position 0 again.
  void reset();

  int32_t n_vocab() const { return cfg_.n_vocab; }
  /// Number of tokens fed since construction or the last reset().
  int32_t pos() const { return pos_; }
  const NaiveLlamaConfig& config() const { return cfg_; }

 private:
  struct Layer {
    std::vector<double> attn_norm;  // [n_embd]
    std::vector<double> wq;         // [n_head*head_dim][n_embd], n_embd contiguous
    std::vector<double> wk;         // [n_head_kv*head_dim][n_embd]
    std::vector<double> wv;         // [n_head_kv*head_dim][n_embd]
    std::vector<double> wo;         // [n_embd][n_head*head_dim]
    std::vector<double> ffn_norm;   // [n_embd]
    std::vector<double> w_gate;     // [n_ff][n_embd]
    std::vector<double> w_up;       // [n_ff][n_embd]
    std::vector<double> w_down;     // [n_embd][n_ff]
    std::vector<double> k_cache;    // [pos][n_head_kv*head_dim], grows by one row per step
    std::vector<double> v_cache;    // [pos][n_head_kv*head_dim]
  };

  void rope_in_place(std::vector<double>& x, int32_t n_heads, int32_t position) const;

  NaiveLlamaConfig cfg_;
  std::vector<double> token_embd_;   // [n_vocab][n_embd]
  std::vector<double> output_norm_;  // [n_embd]
  std::vector<double> output_;       // [n_vocab][n_embd]; empty when tied to token_embd_
  std::vector<double> rope_freqs_;   // [n_rot/2]; empty when absent
  std::vector<Layer> layers_;
  int32_t pos_ = 0;
};

/// Greedy decoding with the oracle: continues from m's current position (call m.reset() first
/// for a fresh sequence), feeds every id of `prompt`, then picks `n` tokens by argmax (ties go
/// to the lowest id), feeding each one in turn; returns the n generated ids. Afterwards
/// m.pos() has grown by prompt.size() + n.
/// Throws Error(invalid_argument) for an empty prompt or n < 0, and whatever step() throws.
std::vector<int32_t> greedy_generate(NaiveLlama& m, const std::vector<int32_t>& prompt, int n);

}  // namespace berth::oracle
