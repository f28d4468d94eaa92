// Byte-level BPE tokenizer for GGUF vocabularies with tokenizer.ggml.model = "gpt2".
// Private to berth_models; users go through Tokenizer::from_gguf / Tokenizer::make_bpe.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "berth/models/tokenizer.h"

namespace berth {

/// The split regexes of BPE pre-tokenizer `pre` (a tokenizer.ggml.pre value), applied in order,
/// each with Hugging Face's "Isolated" behaviour (matches and the text between them become
/// separate pieces; the next regex splits each piece again). Sources: the Split patterns of
/// the published tokenizer.json files of Qwen2/Qwen3 ("qwen2"), Meta Llama 3 ("llama-bpe"),
/// DeepSeek-V3 ("deepseek-v3", three regexes), and GPT-2's encoder.py ("default", "gpt-2").
/// Returns nullptr for any other name; "" is not accepted here (from_gguf maps a missing key
/// to "default").
const std::vector<std::string>* bpe_pre_regexes(std::string_view pre);

/// The names bpe_pre_regexes() knows, comma-separated (for error messages).
std::string_view bpe_supported_pres();

/// Ids of control tokens whose text is an end-of-turn marker of a common chat format
/// ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", ...), in id order of the marker list. `types`
/// must be as long as `tokens` (else none are returned). Defined in tokenizer.cpp; shared by
/// the SPM and BPE loaders and read_hf_tokenizer_json.
std::vector<int32_t> eog_ids_by_text(const std::vector<std::string>& tokens,
                                     const std::vector<TokenType>& types);

/// Byte-level BPE as GPT-2 defined it and Hugging Face `tokenizers` implements it:
///  1. split the text at special tokens, only when parse_special (control, user-defined and
///     unknown tokens; leftmost, longest first);
///  2. pre-tokenize each plain fragment with the regexes of tokenizer.ggml.pre (PCRE2, UTF +
///     UCP, JIT when available); the text is assumed to be NFC already (no normaliser runs);
///     ill-formed UTF-8 never reaches PCRE2: each byte of an ill-formed or truncated sequence
///     becomes a piece of its own, and the well-formed runs around it are pre-tokenized
///     separately, so any byte string encodes and decode(encode(s)) == s;
///  3. map each byte of a piece to its symbol in GPT-2's bytes_to_unicode alphabet (printable
///     bytes to themselves, the other 68 to U+0100 upward) and start from one token per byte;
///  4. repeatedly apply the merge of lowest rank (tokenizer.ggml.merges order) among adjacent
///     symbol pairs, the leftmost pair first on equal ranks, with a heap: O(n log n) for a
///     piece of n bytes. With "llama-bpe" a piece that is itself a token is taken whole first
///     (Llama 3's ignore_merges).
class BpeTokenizer final : public Tokenizer {
 public:
  /// Validates and indexes `vocab`; see Tokenizer::make_bpe for the errors.
  explicit BpeTokenizer(VocabData vocab);
  ~BpeTokenizer() override;

  std::vector<int32_t> encode(std::string_view text, bool add_bos,
                              bool parse_special = false) const override;
  std::string token_to_piece(int32_t id, bool render_special = false) const override;

  struct Regex;      // a compiled PCRE2 pattern (defined in tokenizer_bpe.cpp)
  struct Workspace;  // per-encode scratch buffers (defined in tokenizer_bpe.cpp)

 private:
  struct Special {
    std::string_view text;  // views into tokens_
    int32_t id;
  };
  /// Rank and result of the merge of a (left id, right id) pair.
  struct Merge {
    int32_t rank;
    int32_t id;
  };

  /// The special token that starts at `text[pos]` (longest first), or nullptr.
  /// Longest added token at `pos`: control/unknown ones only with `parse_special`,
  /// user-defined ones always.
  const Special* match_special(std::string_view text, size_t pos, bool parse_special) const;
  /// Appends the ids of a fragment without special tokens (any bytes).
  void encode_plain(std::string_view text, std::vector<int32_t>& out, Workspace& ws) const;
  /// Splits well-formed `text` with regexes_[level..] and BPE-encodes the pieces.
  void split_and_encode(std::string_view text, size_t level, std::vector<int32_t>& out,
                        Workspace& ws) const;
  /// Appends the BPE ids of one pre-tokenized piece (raw bytes, non-empty).
  void encode_piece(std::string_view piece, std::vector<int32_t>& out, Workspace& ws) const;
  /// Id of the merge of the pair, or nullptr.
  const Merge* find_merge(int32_t left, int32_t right) const;
  [[noreturn]] void no_byte_token(uint8_t byte) const;

  std::string pre_;
  std::vector<std::unique_ptr<Regex>> regexes_;
  bool ignore_merges_ = false;
  std::array<int32_t, 256> byte_ids_{};  // token of each byte's bytes_to_unicode symbol, or -1
  std::unordered_map<uint64_t, Merge> merges_;      // key: (uint64 left << 32) | right
  std::array<std::vector<Special>, 256> specials_;  // by first byte, longest first
};

}  // namespace berth
