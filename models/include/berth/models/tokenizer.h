// Tokenizers read from GGUF metadata (tokenizer.ggml.*).
//
// Keys (ggml docs/gguf.md, "Tokenizer"): tokenizer.ggml.model ("llama" = SentencePiece-style
// unigram/BPE scores, "gpt2" = byte-level BPE), tokenizer.ggml.tokens (string array),
// tokenizer.ggml.scores (float array), tokenizer.ggml.token_type (int32 array, values of
// TokenType), tokenizer.ggml.merges (gpt2), tokenizer.ggml.bos_token_id / eos_token_id /
// unknown_token_id / padding_token_id, tokenizer.ggml.add_bos_token / add_eos_token.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace berth::gguf {
class File;
}

namespace berth {

/// Token attribute as stored in tokenizer.ggml.token_type (SentencePiece's piece types).
enum class TokenType : int32_t {
  undefined = 0,
  normal = 1,
  unknown = 2,
  control = 3,
  user_defined = 4,
  unused = 5,
  byte = 6,
};

/// A vocabulary plus its encoding algorithm. Thread-safe for concurrent const use.
class Tokenizer {
 public:
  /// Builds the tokenizer named by tokenizer.ggml.model. Throws gguf::GgufError(missing_key)
  /// when a required key is missing, Error(format) when arrays disagree in length or ids are
  /// out of range, Error(unsupported) for an unknown tokenizer.ggml.model.
  static std::unique_ptr<Tokenizer> from_gguf(const gguf::File& file);

  virtual ~Tokenizer() = default;

  /// Text -> token ids. `add_bos`: prepend BOS when the vocabulary asks for it
  /// (tokenizer.ggml.add_bos_token, default true for "llama"). `parse_special`: when true,
  /// control/user-defined token texts in `text` (e.g. "<s>", "<|im_end|>") become those tokens;
  /// when false (user text) they are tokenized as plain characters.
  virtual std::vector<int32_t> encode(std::string_view text, bool add_bos,
                                      bool parse_special = false) const = 0;

  /// The bytes token `id` stands for: byte tokens "<0xNN>" give the raw byte, "▁" becomes a
  /// space; control tokens give "" unless `render_special`. May be an incomplete UTF-8
  /// sequence. Throws Error(invalid_argument) for an id outside [0, n_vocab()).
  virtual std::string token_to_piece(int32_t id, bool render_special = false) const = 0;

  /// Concatenated pieces of `ids` (control tokens omitted). Invalid UTF-8 is kept as bytes.
  std::string decode(std::span<const int32_t> ids) const;

  int32_t n_vocab() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t bos_id() const { return bos_id_; }  ///< -1 when the vocabulary has none
  int32_t eos_id() const { return eos_id_; }  ///< -1 when the vocabulary has none
  bool add_bos() const { return add_bos_; }
  /// True for tokens that end generation (EOS, and EOT-like ids when known).
  bool is_eog(int32_t id) const;
  const std::string& token_text(int32_t id) const;
  TokenType token_type(int32_t id) const;
  /// Id of the exact token text, or -1.
  int32_t find_token(std::string_view text) const;

 protected:
  std::vector<std::string> tokens_;
  std::vector<TokenType> types_;
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  int32_t unk_id_ = -1;
  bool add_bos_ = true;
  std::vector<int32_t> eog_ids_;
};

/// Turns a stream of token ids into text that is always valid UTF-8: bytes of a multi-byte
/// character split across tokens are held back until the character is complete.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok) : tok_(tok) {}
  /// Appends token `id`; returns the text that became complete (possibly empty).
  std::string push(int32_t id);
  /// Returns what is held back at the end of a stream; bytes that can never form a valid
  /// character come out as U+FFFD.
  std::string flush();

 private:
  const Tokenizer& tok_;
  std::string pending_;
};

}  // namespace berth
