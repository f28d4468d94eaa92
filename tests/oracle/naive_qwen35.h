// The oracle of the Qwen3.5 hybrid family (GGUF architectures `qwen35` and `qwen35moe`): a
// naive, double-precision reference forward in the style of naive_llama.h (weights decoded once
// to double through io and the scalar reference dequantizers, plain single-threaded loops, no
// code shared with the fast path), with the recurrent state of the Gated DeltaNet layers carried
// across step() calls beside the KV cache of the attention layers.
//
// Sources (facts, not code): Hugging Face transformers models/qwen3_next/modular_qwen3_next.py
// and models/qwen3_5*/ (Qwen3NextAttention, Qwen3NextGatedDeltaNet,
// torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule, Qwen3NextRMSNormGated,
// Qwen2MoeSparseMoeBlock); llama.cpp conversion/qwen.py (Qwen3NextModel.modify_tensors,
// _LinearAttentionVReorderBase) for what the GGUF files store; ik_llama.cpp
// src/llama-load-tensors.cpp, src/llama-hparams.cpp and src/llama-delta-net.cpp for the names,
// keys and the inference graph; Yang et al. 2024, "Gated Delta Networks", arXiv:2412.06464.
//
// Model (layer l is full attention iff (l + 1) % full_attention_interval == 0, else GDN):
//   x = token_embd[token]
//   for each main layer l (the MTP block blk.{n_layer}.* is skipped):
//     h = rms(x) * attn_norm
//     attention layer at position p:
//       [q_h | gate_h] = rows h*2*hd .. (h+1)*2*hd of attn_q h   (per head: hd query rows, then
//                                                                  hd gate rows)
//       q_h = rms(q_h) * attn_q_norm,  k = rms(attn_k h) * attn_k_norm (per head), v = attn_v h
//       NeoX rotation of each head's first n_rot dims, pairs (i, i + n_rot/2), theta_i =
//         p * freq_base^(-2i/n_rot) (rope.dimension_sections describe multimodal position
//         streams; for text all streams carry p, so the rotation is this plain one)
//       o_h = softmax_{t<=p}(q_h . k_t / sqrt(hd)) v_t  (GQA: KV head h / (n_head / n_head_kv))
//       x += attn_output (o_h * sigmoid(gate_h))
//     GDN layer:
//       qkv = attn_qkv h (rows: H_k q heads, H_k k heads, H_v v heads), z = attn_gate h,
//       b = ssm_beta h, a = ssm_alpha h
//       y_c = silu(sum_i ssm_conv1d[c][i] * window_c[i]), window_c = [conv state (K-1 values),
//         qkv_c]; the conv state keeps the last K-1 inputs
//       q_j, k_j = y's K-head slices / sqrt(|.|^2 + eps)     (eps = the rms eps; HF's l2norm)
//       beta_h = sigmoid(b_h),  g_h = ssm_a_h * softplus(a_h + ssm_dt_h)   (ssm_a = -exp(A_log))
//       V head h reads K head j = h mod H_k (qwen35 files reorder the V heads into this tiled
//         order; VHeadMapping::grouped reads K head h / (H_v / H_k), the Hugging Face order)
//       S_h = exp(g_h) S_h;  S_h += k_j (beta_h (v_h - S_h^T k_j))^T;  o_h = S_h^T q_j / sqrt(d_k)
//       o_h = rms(o_h) * ssm_norm * silu(z_h)
//       x += ssm_out concat_h(o_h)
//     h = rms(x) * post_attention_norm
//     qwen35:    x += ffn_down(silu(ffn_gate h) * ffn_up h)
//     qwen35moe: x += sum_j w_j expert_{e_j}(h) + sigmoid(ffn_gate_inp_shexp . h) * shared(h)
//                (softmax routing over ffn_gate_inp h, top n_expert_used, renormalised)
//   logits = output(rms(x) * output_norm)   (token_embd when output is absent)
// Norm weights are used as stored: the files store 1 + w for the norms the original model
// applies as x * (1 + w) (all but ssm_norm, which the model applies as x * w).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "berth/io/gguf.h"
#include "naive_llama.h"

namespace berth::oracle {

/// Which K head a V head of a GDN layer reads when H_v > H_k.
enum class VHeadMapping {
  tiled,    ///< V head h reads K head h mod H_k: what qwen35 / qwen35moe GGUF files store
  grouped,  ///< V head h reads K head h / (H_v / H_k): Hugging Face's order (and qwen3next's)
};

/// Hyper-parameters of a qwen35 / qwen35moe file. Keys carry the `{arch}.` prefix.
struct NaiveQwen35Config {
  std::string arch;     ///< general.architecture: qwen35 or qwen35moe
  int32_t n_vocab = 0;  ///< token_embd.weight ne[1]
  int32_t n_embd = 0;   ///< embedding_length
  int32_t n_layer = 0;  ///< main layers: block_count - nextn_predict_layers
  int32_t n_mtp = 0;    ///< nextn_predict_layers (0 when absent): the skipped MTP layers
  int32_t n_head = 0;   ///< attention.head_count (one value for the attention layers)
  /// attention.head_count_kv per layer (a scalar key applies to every layer; an array may hold
  /// 0 on GDN layers); GDN layers read 0 here.
  std::vector<int32_t> n_head_kv;
  int32_t head_dim = 0;                 ///< attention.key_length (= value_length)
  int32_t n_rot = 0;                    ///< rope.dimension_count (default head_dim)
  double rms_eps = 0.0;                 ///< attention.layer_norm_rms_epsilon
  double rope_freq_base = 10000.0;      ///< rope.freq_base
  int32_t full_attention_interval = 4;  ///< full_attention_interval (default 4)
  int32_t ssm_d_conv = 0;               ///< ssm.conv_kernel: K
  int32_t ssm_d_state = 0;              ///< ssm.state_size: d_k, the K head dim
  int32_t ssm_n_group = 0;              ///< ssm.group_count: H_k
  int32_t ssm_dt_rank = 0;              ///< ssm.time_step_rank: H_v
  int32_t ssm_d_inner = 0;              ///< ssm.inner_size = H_v * d_v
  int32_t n_ff = 0;                     ///< feed_forward_length (dense FFN; optional for qwen35moe)
  int32_t n_expert = 0;                 ///< expert_count (qwen35moe)
  int32_t n_expert_used = 0;            ///< expert_used_count
  int32_t n_ff_exp = 0;                 ///< expert_feed_forward_length
  int32_t n_ff_shexp = 0;               ///< shared expert size (0: no shared expert)
  bool expert_weights_norm = true;      ///< expert_weights_norm (default true)
  bool tied_output = false;             ///< output.weight absent
  int32_t context_length = 0;           ///< context_length
  int32_t n_ctx = 0;                    ///< positions this instance accepts

  bool is_attention(int32_t layer) const { return (layer + 1) % full_attention_interval == 0; }
  int32_t d_v() const { return ssm_d_inner / ssm_dt_rank; }
  int32_t key_dim() const { return ssm_n_group * ssm_d_state; }
  int32_t conv_dim() const { return 2 * key_dim() + ssm_d_inner; }
};

/// The recurrent state of one GDN layer of one sequence.
struct GdnLayerState {
  std::vector<double> conv;  ///< [K - 1][conv_dim]: row K - 2 the most recent input
  std::vector<double> s;     ///< [H_v][d_k][d_v]: S_h row-major, d_v contiguous
};

// ---- Building blocks (exposed for the oracle's self-tests) -----------------------------------

/// One token of the causal depthwise conv: for each channel c of x (n = x.size() channels),
/// y[c] = sum_i w[c * kernel + i] * window_c[i] with window_c = [state rows 0..K-2 of c, x[c]];
/// then the state rolls (state: [kernel - 1][n], row kernel - 2 the most recent input). No SiLU.
std::vector<double> causal_conv1d_step(const std::vector<double>& x, const std::vector<double>& w,
                                       int32_t kernel, std::vector<double>& state);

/// One token of the gated delta rule for one head: s is d_k x d_v row-major (d_v contiguous);
/// q, k: d_k values; v: d_v values. S = exp(g) S; delta = beta (v - S^T k); S += k delta^T;
/// returns scale * S^T q (d_v values).
std::vector<double> delta_rule_step(std::vector<double>& s, int32_t d_k, int32_t d_v,
                                    const double* q, const double* k, const double* v, double g,
                                    double beta, double scale);

/// The same recurrence over T tokens in the chunked form (the WY representation of HF's
/// torch_chunk_gated_delta_rule): tokens in chunks of `chunk`, within a chunk the corrections
/// by a unit lower-triangular solve, the state carried between chunks. q, k: [T][d_k]; v:
/// [T][d_v]; g, beta: [T]. Returns [T][d_v] outputs; updates s as T steps of delta_rule_step
/// would (equal up to rounding). chunk >= 1.
std::vector<double> delta_rule_chunked(std::vector<double>& s, int32_t d_k, int32_t d_v,
                                       int64_t n_tokens, const double* q, const double* k,
                                       const double* v, const double* g, const double* beta,
                                       double scale, int32_t chunk);

/// Naive forward of a qwen35 / qwen35moe file with its KV cache (attention layers) and recurrent
/// state (GDN layers). Copyable: a copy is a snapshot of the sequence (a checkpoint). Not
/// thread-safe; one position per step().
class NaiveQwen35 {
 public:
  /// Reads hyper-parameters and all weights of the main layers (converted to double) from
  /// `file`; the MTP layers (index >= block_count - nextn_predict_layers) are not read.
  /// `n_ctx`: the most positions step() accepts (0: context_length). `mapping`: which K head a
  /// V head reads (tiled for qwen35 files; grouped only for experiments on HF-ordered weights).
  /// Throws gguf::GgufError(missing_key / missing_tensor / wrong_type) for an absent or
  /// mistyped key or tensor; Error(format) for inconsistent hyper-parameters (H_v not a
  /// multiple of H_k, inner_size not a multiple of time_step_rank, n_rot odd or > head_dim,
  /// nextn_predict_layers >= block_count, no attention or expert counts where needed, ...) or
  /// a tensor whose shape does not match them (the message names the tensor, the expected and
  /// actual shape); Error(unsupported) for another architecture, head_count differing between
  /// attention layers, key_length != value_length, expert gating other than softmax, a tensor
  /// type that cannot be dequantized, or a tensor of a main layer (or a global one) this model
  /// does not use; Error(invalid_argument) for n_ctx < 0.
  explicit NaiveQwen35(const gguf::File& file, int n_ctx = 0,
                       VHeadMapping mapping = VHeadMapping::tiled);

  /// Feeds `token` at position pos(): appends the attention layers' keys and values, advances
  /// every GDN layer's conv and delta-rule state, and returns the next token's logits
  /// (n_vocab doubles). qwen35moe records each layer's routing (last_routing()).
  /// Throws Error(invalid_argument) for a token outside [0, n_vocab) or when pos() == n_ctx.
  std::vector<double> step(int32_t token);

  /// Clears the KV cache, zeroes the recurrent state and the routing; pos() is 0 again.
  void reset();

  int32_t pos() const { return pos_; }
  int32_t n_vocab() const { return cfg_.n_vocab; }
  const NaiveQwen35Config& config() const { return cfg_; }
  /// Routing of the last step()'s token per layer (qwen35moe; empty for qwen35).
  const std::vector<Routing>& last_routing() const { return last_routing_; }
  /// The recurrent state of GDN layer `layer` (Error(invalid_argument) for an attention layer
  /// or an index outside [0, n_layer)).
  const GdnLayerState& gdn_state(int32_t layer) const;

 private:
  struct Layer {
    std::vector<double> attn_norm, post_norm;  // [n_embd]
    // Attention layers.
    std::vector<double> wq;                // [n_head * 2 * hd][n_embd]
    std::vector<double> wk, wv;            // [n_kv * hd][n_embd]
    std::vector<double> q_norm, k_norm;    // [hd]
    std::vector<double> wo;                // [n_embd][n_head * hd]
    std::vector<double> k_cache, v_cache;  // [pos][n_kv * hd]
    // GDN layers.
    std::vector<double> w_qkv;            // [conv_dim][n_embd]
    std::vector<double> w_gate;           // [H_v * d_v][n_embd]
    std::vector<double> conv_w;           // [conv_dim][K]
    std::vector<double> dt_bias, ssm_a;   // [H_v]
    std::vector<double> w_beta, w_alpha;  // [H_v][n_embd]
    std::vector<double> ssm_norm;         // [d_v]
    std::vector<double> w_out;            // [n_embd][H_v * d_v]
    GdnLayerState state;
    // FFN (dense, or MoE with an optional shared expert).
    std::vector<double> w_gate_ffn, w_up, w_down;  // dense [n_ff][n_embd] ...; MoE per expert
    std::vector<double> w_router;                  // [n_expert][n_embd]
    std::vector<double> shexp_gate;                // [n_embd]
    std::vector<double> shexp_gate_ffn, shexp_up, shexp_down;
  };

  std::vector<double> attention(Layer& layer, const std::vector<double>& h, int32_t l);
  std::vector<double> gdn(Layer& layer, const std::vector<double>& h);
  std::vector<double> ffn(Layer& layer, const std::vector<double>& h, int32_t l);

  NaiveQwen35Config cfg_;
  VHeadMapping mapping_;
  std::vector<double> token_embd_, output_norm_, output_;
  std::vector<Layer> layers_;
  std::vector<Routing> last_routing_;
  int32_t pos_ = 0;
};

}  // namespace berth::oracle
