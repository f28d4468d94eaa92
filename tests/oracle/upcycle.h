// Upcycled-MoE test files: a dense `llama` GGUF (e.g. stories260K) turned into a Mixture-of-
// Experts file whose experts are all copies of the dense FFN ("sparse upcycling", Komatsuzaki et
// al. 2022, with identical experts). With renormalised routing weights (sum 1), any routing
// gives y = sum_j w_j * FFN(h) = FFN(h), so the upcycled model computes the same function as the
// dense one (up to double rounding) while exercising the whole MoE path: router matmul, softmax,
// top-k, expert gather and weighted combine. A random router makes the selected experts vary
// from token to token and layer to layer.
//
// Two styles:
//  - mixtral:  general.architecture stays "llama"; adds llama.expert_count and
//              llama.expert_used_count; the expert size is llama.feed_forward_length.
//  - qwen3moe: general.architecture "qwen3moe"; every "llama.*" key renamed "qwen3moe.*";
//              adds qwen3moe.expert_count, expert_used_count, expert_feed_forward_length (=
//              the dense n_ff), attention.key_length / value_length (= head_dim) and
//              rope.freq_base (10000, llama's default, when the source has none); no
//              attn_q_norm / attn_k_norm. qwen3moe applies RoPE in the NeoX layout, so the
//              rows of attn_q and attn_k are permuted within each head from GGUF llama's
//              adjacent-pair order to NeoX order (new row i = old row 2i, new row n_rot/2 + i
//              = old row 2i + 1 for i < n_rot/2; rows n_rot.. unchanged). NeoX RoPE of the
//              permuted q (or k) is then the same permutation of the adjacent-pair RoPE of
//              the original, and permuting q and k alike keeps every q.k: the attention is
//              the original one.
// Per layer, tensors ffn_gate/ffn_up/ffn_down.weight are replaced by ffn_gate_exps/ffn_up_exps
// ({n_embd, n_ff, n_expert}) and ffn_down_exps ({n_ff, n_embd, n_expert}), each expert a byte
// copy of the dense matrix (any tensor type), plus ffn_gate_inp.weight ({n_embd, n_expert},
// F32, entries drawn from N(0, 1) by Box-Muller over std::mt19937_64(seed), so a seed gives the
// same file on every platform). Every other tensor and key (tokenizer included) is copied.
#pragma once

#include <cstdint>
#include <string>

#include "berth/io/gguf.h"
#include "berth/io/gguf_writer.h"

namespace berth::oracle {

enum class UpcycleStyle {
  mixtral,   ///< arch llama with experts (Mixtral layout)
  qwen3moe,  ///< arch qwen3moe, Q/K rows permuted to NeoX order
};

struct UpcycleOptions {
  UpcycleStyle style = UpcycleStyle::mixtral;
  int n_expert = 4;       ///< experts per layer (>= 1)
  int n_expert_used = 2;  ///< experts selected per token (1..n_expert)
  uint64_t seed = 1;      ///< router weights' seed
  /// qwen3moe only: permute Q/K rows to NeoX order. false gives a file that is NOT equivalent
  /// to the source (tests use it as a negative control).
  bool permute_qk = true;
};

/// Builds the upcycled model of `src` (see the file comment) in a Writer; tensor bytes are
/// copied, so `src` may be destroyed afterwards.
/// Throws Error(unsupported) when src is not a dense llama file (general.architecture "llama",
/// no expert_count > 0); gguf::GgufError(missing_key / missing_tensor) for a key or FFN tensor
/// it needs; Error(format) for an FFN tensor of unexpected shape or an n_rot that is odd or
/// larger than head_dim; Error(invalid_argument) for n_expert < 1 or n_expert_used outside
/// [1, n_expert].
gguf::Writer make_upcycled(const gguf::File& src, const UpcycleOptions& opt);

/// Reads `src`, writes its upcycled model to `dst` (see make_upcycled for errors; Error(io)
/// naming the path when writing fails).
void write_upcycled(const std::string& src, const std::string& dst, UpcycleStyle style,
                    int n_expert, int n_expert_used, uint64_t seed);

}  // namespace berth::oracle
