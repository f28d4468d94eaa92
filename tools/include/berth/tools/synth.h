// Synthetic GGUF models (`berth synth`): valid GGUF files with random weights of realistic
// scale, for the architectures berth runs, so that loaders, kernels and the scheduler can be
// exercised at real sizes without downloading a model.
//
// File layout (ggml docs/gguf.md; GGUF v3, alignment 32). Metadata, prefix {arch}:
//   general.architecture, general.name ("berth synth <name>"), general.file_type (llama_ftype),
//   general.quantization_version (2, when a tensor is quantized), {arch}.context_length,
//   embedding_length, block_count, feed_forward_length, attention.head_count,
//   attention.head_count_kv, attention.key_length and attention.value_length (= head_dim;
//   always for qwen3/qwen3moe, for the others only when head_dim != n_embd / n_head),
//   rope.freq_base, attention.layer_norm_rms_epsilon; with experts: expert_count,
//   expert_used_count, and for qwen3moe expert_feed_forward_length. Then the tokenizer.ggml.*
//   keys of the vocabulary (below).
// Tensors (ne[0] contiguous; q_dim = n_head * head_dim, kv_dim = n_head_kv * head_dim):
//   token_embd.weight {n_embd, n_vocab}; output_norm.weight {n_embd};
//   output.weight {n_embd, n_vocab} (absent when tie_embeddings);
//   per layer N: blk.N.attn_norm.weight {n_embd}; attn_q.weight {n_embd, q_dim};
//   attn_k.weight {n_embd, kv_dim}; attn_v.weight {n_embd, kv_dim};
//   attn_output.weight {q_dim, n_embd}; ffn_norm.weight {n_embd};
//   qwen2: attn_q.bias {q_dim}, attn_k.bias {kv_dim}, attn_v.bias {kv_dim};
//   qwen3, qwen3moe: attn_q_norm.weight {head_dim}, attn_k_norm.weight {head_dim};
//   dense: ffn_gate.weight {n_embd, n_ff}, ffn_up.weight {n_embd, n_ff},
//          ffn_down.weight {n_ff, n_embd};
//   experts (qwen3moe: n_ff_exp = expert_feed_forward_length; llama with experts, i.e.
//   Mixtral: the expert size is feed_forward_length): ffn_gate_inp.weight {n_embd, n_expert},
//   ffn_gate_exps.weight {n_embd, n_ff_exp, n_expert}, ffn_up_exps.weight {same},
//   ffn_down_exps.weight {n_ff_exp, n_embd, n_expert}.
// Hybrids (qwen35, qwen35moe: Gated DeltaNet layers and gated attention; the keys and names
// llama.cpp / ik_llama.cpp load, ../shared/notes/qwen35-hybrid.md). Keys: block_count =
// n_layer + n_mtp, nextn_predict_layers (when n_mtp > 0), attention.head_count(_kv),
// attention.key_length = value_length = head_dim, rope.dimension_count = n_rot,
// rope.dimension_sections [s0, s1, s2, 0] with h = n_rot / 2, s2 = h * 10 / 32 and s0 >= s1
// splitting the rest (64 rotary dims: [11, 11, 10, 0]; text positions make them irrelevant),
// full_attention_interval, ssm.conv_kernel, ssm.state_size (d), ssm.group_count (H_k),
// ssm.time_step_rank (H_v), ssm.inner_size (H_v * d); qwen35moe: expert_count,
// expert_used_count, expert_feed_forward_length, expert_shared_feed_forward_length (when
// n_ff_shexp > 0), feed_forward_length only when n_ff > 0. The synthetic vocabulary's pre is
// "qwen35". Tensors of layer l (key_dim = H_k d, value_dim = H_v d, conv_dim = 2 key_dim +
// value_dim): attn_norm {n_embd}, post_attention_norm {n_embd} (no ffn_norm); when
// (l + 1) % full_attention_interval == 0 attention: attn_q {n_embd, 2 q_dim} (per head head_dim
// query rows then head_dim gate rows), attn_k, attn_v {n_embd, kv_dim}, attn_q_norm,
// attn_k_norm {head_dim}, attn_output {q_dim, n_embd}; otherwise GDN: attn_qkv {n_embd,
// conv_dim}, attn_gate {n_embd, value_dim}, ssm_conv1d {ssm_d_conv, conv_dim}, ssm_dt.bias
// {H_v}, ssm_a {H_v} (no .weight suffix), ssm_beta, ssm_alpha {n_embd, H_v}, ssm_norm {d},
// ssm_out {value_dim, n_embd}; FFN: dense ffn_gate/up/down, or ffn_gate_inp and the *_exps as
// above plus, with a shared expert, ffn_gate_inp_shexp {n_embd}, ffn_gate_shexp, ffn_up_shexp
// {n_embd, n_ff_shexp}, ffn_down_shexp {n_ff_shexp, n_embd}. An MTP layer l = n_layer (n_mtp =
// 1): nextn.eh_proj {2 n_embd, n_embd}, nextn.enorm, nextn.hnorm, nextn.shared_head_norm
// {n_embd}, then an attention block and the FFN as above, written after output.weight (so the
// main model's tensors and values do not depend on it). Values: ssm_conv1d std 0.5 (unit
// variance over 4 taps), ssm_dt.bias std 0.5, ssm_a = -A with A log-uniform in [0.05, 1]
// (stored as -exp(A_log), so decays exp(ssm_a softplus(.)) mostly between 0.4 and 0.97),
// ssm_norm 1 + 0.02 z (the model applies it unshifted), the other norms 1 + 0.02 z (the files
// store 1 + w), ssm_out and attn_output as residual projections, the shared-expert gate like a
// router row.
// Norm weights, biases and the router (ffn_gate_inp) are always F32; a matrix whose row
// length ne[0] is not a multiple of its type's block size stays F32 (SynthStats::notes says so).
// Hybrids keep ssm_conv1d, ssm_beta, ssm_alpha, ssm_a, ssm_dt.bias and ffn_gate_inp_shexp in F32
// too; q4_k_m gives attn_qkv Q5_K (llama.cpp's rule for fused QKV).
//
// Weights (all values from a counter-based generator, see write_synth_model):
//   - attn_q/k/v, ffn_gate/up (and experts'): std 1/sqrt(n_embd) (unit-variance outputs);
//   - attn_output, ffn_down (and experts'): std 1/sqrt(n_in * 2 * n_layer), GPT-2's scaled
//     initialisation of residual projections (Radford et al. 2019, "Language Models are
//     Unsupervised Multitask Learners", sec. 2.3), so the residual stream grows to an rms of
//     order 1 whatever the depth and the logits stay finite;
//   - token_embd std 0.05; output.weight std 1/sqrt(n_embd) (logits of std about 1);
//   - norm weights 1 + 0.02 z; qwen2 biases 0.02 z; router rows std 1/sqrt(n_embd).
//   z is approximately standard normal: the Irwin-Hall sum of four 16-bit uniforms, scaled to
//   unit variance (bounded at +-2*sqrt(3); integer arithmetic, so identical on every platform).
//
// Router skew (router_skew = A > 0, MoE only): expert popularity follows roughly the Zipf law
// p(rank r) ~ 1/r^A, by construction. A unit direction u is drawn from the seed. Every token
// embedding gets the shared component U*sqrt(n_embd)*u (U = 0.3 per element); the token part of
// the embeddings and every row of attn_q/k/v, ffn_gate/up (dense or experts') and of the router
// are made orthogonal to u, so u is invisible to everything but the routers and its share of the
// residual is only diluted (not rotated) by later layers. Router row e of layer l gets
// alpha_{l,e} * u with alpha_{l,e} = c * A * (ln(1/r_{l,e}) - mean) * sqrt((1 - s_l) / (n_embd
// s_l)), where r_{l,e} is e's rank in a per-layer random permutation, s_l the expected share of u
// in the normalised input of layer l (exact at layer 0; later layers from a variance recurrence of
// the initialisation above), and c = 1.25 / sqrt(2 ln n_expert): the token part of a router logit
// is unit-variance noise (scaled by sqrt(1 - s_l)), whose maximum over n_expert experts is roughly
// Gumbel with scale 1/sqrt(2 ln n_expert), so adding c * ln(weight) makes top-1 choices follow
// the weights (1.25 measured by simulation: fitted exponent within 5% of A for 8..128 experts).
// Top-k choice is flatter than top-1. Verified at layer 0 by tests/runtime/test_synth.cpp;
// deeper layers follow an estimate.
//
// Vocabulary: with `vocab_path` empty, a synthetic one. llama (and Mixtral): SentencePiece-style
// (tokenizer.ggml.model "llama"): <unk>, <s>, </s>, the 256 byte tokens <0x00>..<0xFF>, the
// printable ASCII characters and "▁", then pieces ("▁the", "in", ...) learned by byte-pair
// merging over a built-in list of common English words and, past that, systematic letter
// extensions, scores decreasing with creation order. qwen2/qwen3/qwen3moe: GPT-2 byte-level BPE
// (tokenizer.ggml.model "gpt2", pre "qwen2"): the 256 symbols of GPT-2's bytes_to_unicode table,
// then one token per merge (each merge joins two existing tokens into a new one), then
// <|endoftext|>, <|im_start|>, <|im_end|> as control tokens; eos = <|im_end|>, bos = padding =
// <|endoftext|>, add_bos_token false, a ChatML tokenizer.chat_template. With `vocab_path` (a
// Hugging Face tokenizer.json, read by read_hf_tokenizer_json): the same gpt2 keys from that
// file, padded to n_vocab with "[PAD{id}]" tokens of type unused (as Qwen's own GGUF files are),
// and the chat template of tokenizer_config.json next to it when present.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "berth/core/types.h"

namespace berth {

/// Shape and content of a synthetic model. Field names follow the GGUF keys (see the top of
/// this file). Dimensions are element counts.
struct SynthSpec {
  /// general.architecture: llama, qwen2, qwen3, qwen3moe, qwen35 or qwen35moe
  std::string arch = "llama";
  std::string name = "custom";  ///< general.name is "berth synth <name>" (the preset's name)
  int64_t n_layer = 0;          ///< block_count (hybrids: the main layers; block_count adds n_mtp)
  int64_t n_embd = 0;           ///< embedding_length
  int64_t n_head = 0;           ///< attention.head_count
  int64_t n_head_kv = 0;        ///< attention.head_count_kv; 0: n_head
  int64_t head_dim = 0;         ///< attention.key_length = value_length; 0: n_embd / n_head
  /// feed_forward_length (dense FFN; Mixtral: the expert size); qwen35moe: 0 = not written
  int64_t n_ff = 0;
  int64_t n_vocab = 0;         ///< rows of token_embd; 0 with vocab_path: its token count
  int64_t n_ctx_train = 4096;  ///< context_length
  int64_t n_expert = 0;        ///< expert_count; 0: dense
  int64_t n_expert_used = 0;   ///< expert_used_count
  int64_t n_ff_exp = 0;  ///< expert_feed_forward_length (qwen3moe, qwen35moe); llama uses n_ff
  float rope_freq_base = 10000.0f;  ///< rope.freq_base
  float rms_eps = 1e-5f;            ///< attention.layer_norm_rms_epsilon
  /// Weight type: f32 f16 bf16 q4_0 q4_1 q5_0 q5_1 q8_0 q2_k q3_k q4_k q5_k q6_k
  /// (case-insensitive) or q4_k_m (the mix of synth_tensor_type).
  std::string type = "f32";
  uint64_t seed = 0;            ///< same seed and spec: same bytes, whatever the thread count
  double router_skew = 0.0;     ///< Zipf exponent A of expert popularity; 0: uniform
  std::string vocab_path;       ///< tokenizer.json; empty: synthetic vocabulary
  bool tie_embeddings = false;  ///< no output.weight: the head reuses token_embd
  // Hybrids (qwen35, qwen35moe) only:
  int64_t n_rot = 0;  ///< rope.dimension_count; 0: head_dim / 4 (Qwen3.5: 64 of 256)
  int64_t full_attention_interval = 4;  ///< layer l is full attention iff (l + 1) % this == 0
  int64_t ssm_d_conv = 4;               ///< ssm.conv_kernel
  int64_t ssm_d_state = 0;              ///< ssm.state_size: the GDN head dim (K and V heads alike)
  int64_t ssm_n_group = 0;              ///< ssm.group_count: GDN K heads (H_k)
  int64_t ssm_dt_rank = 0;  ///< ssm.time_step_rank: GDN V heads (H_v), a multiple of H_k
  int64_t n_ff_shexp = 0;   ///< qwen35moe: expert_shared_feed_forward_length (0: no shared expert)
  int64_t n_mtp = 0;        ///< MTP layers after the main ones (nextn_predict_layers), 0 or 1
  /// Write only the header, keys and tensor infos; the tensor data is a hole of zeros
  /// (gguf::Writer::write_sparse): for plans of shapes larger than the disk (`berth plan`),
  /// not for running.
  bool sparse = false;
};

/// The names synth_preset accepts: qwen3-30b-a3b, qwen3-235b-a22b, tiny-llama, tiny-qwen2,
/// tiny-qwen3, tiny-qwen3moe, tiny-mixtral, qwen3.5-0.8b, qwen3.5-4b, qwen3.5-27b,
/// qwen3.5-35b-a3b, tiny-qwen35 (H_k 2 != H_v 4), tiny-qwen35-eqheads (H_k = H_v = 2, tied
/// head), tiny-qwen35moe (H_k 2, H_v 4; 8 experts of 128, 2 used, shared expert 128).
std::vector<std::string> synth_presets();

/// The spec of a preset (type f32, seed 0, no skew; callers set those). Real shapes are those
/// of the published Qwen3 and Qwen3.5 config.json files; the tiny ones are a few MB in f32 with
/// n_embd 256 (so K-quants apply), 2 layers (hybrids: 4, the real head sizes), GQA
/// (n_head_kv < n_head).
/// Throws Error(invalid_argument) naming `name` and listing the presets.
SynthSpec synth_preset(std::string_view name);

/// Checks a spec; throws Error(invalid_argument) naming the offending field and its flag
/// (e.g. "--n-head-kv"): unknown arch or type, a dimension < 1 (or absurdly large), n_head not a
/// multiple of n_head_kv, odd head_dim, n_expert_used outside 1..n_expert, experts on a dense
/// architecture (qwen2, qwen3) or none on qwen3moe, n_vocab too small for the synthetic
/// vocabulary (llama: 3 + 256 + 95 characters + 1 piece; gpt2: 256 + 3), negative router_skew.
void validate_synth_spec(const SynthSpec& spec);

/// One tensor of the file, in file order.
struct SynthTensor {
  std::string name;
  GgmlType type = GgmlType::F32;
  std::vector<int64_t> ne;  ///< ne[0] contiguous
  std::string note;         ///< why it is F32 although the spec asked otherwise, or empty
};

/// Type of weight matrix `name` (GGUF tensor name) of layer `layer` (-1 for token_embd and
/// output) under the spec's type string, before the row-length rule. For "q4_k_m" (after
/// llama.cpp's Q4_K_M, llama-quantize): Q6_K for output.weight and for attn_v, ffn_down and
/// ffn_down_exps in the layers where i < n_layer/8, i >= 7*n_layer/8 or (i - n_layer/8) % 3 == 2;
/// Q4_K for every other matrix, token_embd included. Norms, biases and the router are F32.
/// Throws Error(invalid_argument) for an unknown type string (naming "--type").
GgmlType synth_tensor_type(const SynthSpec& spec, std::string_view name, int64_t layer);

/// The tensors write_synth_model writes, with their types and shapes. Validates the spec first.
std::vector<SynthTensor> synth_tensor_plan(const SynthSpec& spec);

struct SynthStats {
  uint64_t bytes_written = 0;  ///< size of the file, bytes
  int64_t n_tensors = 0;
  int64_t n_params = 0;            ///< elements over all tensors
  uint64_t tensor_bytes = 0;       ///< tensor data, bytes (without padding)
  std::vector<std::string> notes;  ///< one line per matrix that stayed F32, and why
  double seconds = 0.0;            ///< wall time of the write
};

/// Writes the synthetic model of `spec` to `path` (GGUF v3). Tensor data is generated and
/// quantized while the file is written, one tensor at a time in slabs of rows split across
/// `n_threads` workers (<= 0: all physical cores): memory holds the largest tensor in its
/// target type (the gguf::Writer's producer buffer) plus one f32 row per worker, never a whole
/// f32 model. Quantization uses ggml's reference quantizers (ref::quantize_row_fast: Q4_K and
/// Q6_K without the scale search, several times faster on these random values). Row r of the
/// tensor at index t (file order) draws from SplitMix64 (Steele et al. 2014) seeded with a hash
/// of (seed, t, r), so the bytes depend only on the spec, not on the thread count.
/// `progress` (optional) is called on the calling thread with the fraction of tensor bytes
/// produced, in [0, 1], after each slab (several times per second on large tensors).
/// Throws Error(invalid_argument) as validate_synth_spec, and when the vocabulary of
/// `vocab_path` has more tokens than n_vocab; Error(io)/Error(format) from reading `vocab_path`;
/// Error(io) naming `path` when it cannot be written (no partial file is left).
SynthStats write_synth_model(const SynthSpec& spec, const std::string& path, int n_threads,
                             const std::function<void(double fraction)>& progress = {});

}  // namespace berth
