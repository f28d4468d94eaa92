// Internal parts of the synthetic model generator (synth.h) shared by its translation units:
// the vocabulary writers (synth_vocab.cpp) and the Qwen3.5 hybrid layers (synth_hybrid.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "berth/io/gguf_writer.h"
#include "berth/models/tokenizer.h"
#include "berth/tools/synth.h"

namespace berth::synth_detail {

// ---- vocabularies (synth_vocab.cpp) --------------------------------------------------------

/// The synthetic SentencePiece vocabulary (tokenizer.ggml.model "llama") of s.n_vocab tokens.
void write_spm_vocab(const SynthSpec& s, gguf::Writer& w);

/// The synthetic byte-level BPE vocabulary (tokenizer.ggml.model "gpt2") of s.n_vocab tokens
/// with tokenizer.ggml.pre = `pre` and a ChatML chat template.
void write_bpe_vocab(const SynthSpec& s, const std::string& pre, gguf::Writer& w);

/// The gpt2 keys of a Hugging Face tokenizer.json (s.vocab_path), padded to s.n_vocab, and the
/// chat template of the tokenizer_config.json next to it when present.
void write_hf_vocab(const SynthSpec& s, VocabData v, gguf::Writer& w);

// ---- tensor kinds ----------------------------------------------------------------------------

/// How a tensor's values are drawn (z ~ N(0, 1) approximately, u ~ U(0, 1)):
/// normal / embedding / router: std * z (embedding and router get the skew direction);
/// norm: 1 + std * z; bias: std * z (1-D, F32); ssm_a: -exp(ln 0.05 + u * ln 20), i.e. -A with
/// A log-uniform in [0.05, 1] (the GGUF stores ssm_a = -exp(A_log)).
enum class Kind { normal, norm, bias, embedding, router, ssm_a };

constexpr float kNormNoise = 0.02f;
constexpr float kBiasStd = 0.02f;

/// Adds one tensor to the plan: name, ne (ne[0] contiguous), kind, std, whether its rows are
/// made orthogonal to the router-skew direction (rows of length n_embd read by anything but a
/// router), layer (-1 for globals).
using AddTensor = std::function<void(std::string name, std::vector<int64_t> ne, Kind kind,
                                     float std, bool orth, int64_t layer)>;

// ---- the Qwen3.5 hybrids (synth_hybrid.cpp) ---------------------------------------------------

/// qwen35 or qwen35moe.
bool is_hybrid_arch(std::string_view arch);

/// Checks the hybrid fields of a resolved spec (ssm sizes, interval, n_rot, MTP layers, shared
/// expert); throws Error(invalid_argument) naming the flag.
void check_hybrid_spec(const SynthSpec& s);

/// The tensors of layer `layer` of a hybrid spec: a main layer (< n_layer; attention or GDN by
/// full_attention_interval) or an MTP layer (>= n_layer: the nextn tensors, then an attention
/// block and the FFN).
void add_hybrid_layer(const SynthSpec& s, int64_t layer, const AddTensor& add);

/// The hybrid-specific metadata keys (rope.dimension_count and sections,
/// full_attention_interval, ssm.*, nextn_predict_layers, expert_shared_feed_forward_length).
void write_hybrid_metadata(const SynthSpec& s, gguf::Writer& w);

}  // namespace berth::synth_detail
