// SentencePiece-style tokenizer for GGUF vocabularies with tokenizer.ggml.model = "llama".
// Private to berth_models; users go through Tokenizer::from_gguf / Tokenizer::make_spm.
#pragma once

#include <array>
#include <string>
#include <string_view>
#include <vector>

#include "berth/models/tokenizer.h"

namespace berth {

/// Encoding as SentencePiece BPE-with-scores models converted to GGUF expect (the behaviour of
/// llama.cpp's "SPM" tokenizer):
///  1. split the text at special tokens (user-defined always; control and unknown when
///     parse_special), leftmost-longest;
///  2. for each plain fragment: prepend a space when add_space_prefix and the fragment starts
///     the text or follows a special token, then replace ' ' with U+2581 "▁";
///  3. split into UTF-8 characters, then repeatedly merge the adjacent pair whose
///     concatenation is a vocabulary token with the highest score (ties: the leftmost pair);
///     only normal, user-defined and undefined-type tokens take part, so control, unknown,
///     unused and byte tokens are never produced by merging;
///  4. a final symbol that is not such a token becomes one byte token "<0xNN>" per UTF-8 byte,
///     or the unknown token when the vocabulary lacks byte tokens.
class SpmTokenizer final : public Tokenizer {
 public:
  explicit SpmTokenizer(VocabData vocab);

  std::vector<int32_t> encode(std::string_view text, bool add_bos,
                              bool parse_special = false) const override;
  std::string token_to_piece(int32_t id, bool render_special = false) const override;

 private:
  struct Special {
    std::string_view text;  // views into tokens_
    int32_t id;
  };

  /// Appends the ids of one plain fragment (already escaped: spaces are "▁").
  void encode_fragment(std::string_view text, std::vector<int32_t>& out) const;
  /// Appends the byte tokens of `symbol` (or the unknown token).
  void append_bytes(std::string_view symbol, std::vector<int32_t>& out) const;
  /// Id of a token merging may produce, or -1.
  int32_t find_piece(std::string_view text) const;
  /// The special token that starts at `text[pos]` (longest first), or nullptr.
  const Special* match_special(std::string_view text, size_t pos, bool parse_special) const;

  std::vector<float> scores_;
  TokenIndex piece_ids_;               // normal / user-defined / undefined tokens
  std::array<int32_t, 256> byte_ids_;  // "<0xNN>" -> id, -1 when absent
  std::vector<int16_t> byte_value_;    // byte-type token id -> its byte
  // Candidates for special matching by first byte, longest text first. `always` holds
  // user-defined tokens, `parsed` control and unknown ones (only with parse_special).
  std::array<std::vector<Special>, 256> always_;
  std::array<std::vector<Special>, 256> parsed_;
};

}  // namespace berth
