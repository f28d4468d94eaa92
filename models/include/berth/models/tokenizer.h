// Tokenizers read from GGUF metadata (tokenizer.ggml.*).
//
// Keys (ggml docs/gguf.md, "Tokenizer"): tokenizer.ggml.model ("llama" = SentencePiece-style
// unigram/BPE scores, "gpt2" = byte-level BPE), tokenizer.ggml.tokens (string array),
// tokenizer.ggml.scores (float array), tokenizer.ggml.token_type (int32 array, values of
// TokenType), tokenizer.ggml.merges (gpt2), tokenizer.ggml.bos_token_id / eos_token_id /
// unknown_token_id / padding_token_id, tokenizer.ggml.add_bos_token / add_eos_token.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
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

/// A vocabulary as the GGUF tokenizer.ggml.* keys describe it, for building a tokenizer without
/// a file (tests, synthetic models). Arrays are indexed by token id.
struct VocabData {
  std::vector<std::string> tokens;     ///< tokenizer.ggml.tokens (SPM: "▁" stands for a space)
  std::vector<float> scores;           ///< tokenizer.ggml.scores; empty: all 0
  std::vector<TokenType> types;        ///< tokenizer.ggml.token_type; empty: all normal
  int32_t bos_id = -1;                 ///< tokenizer.ggml.bos_token_id; -1: none
  int32_t eos_id = -1;                 ///< tokenizer.ggml.eos_token_id; -1: none
  int32_t unk_id = -1;                 ///< tokenizer.ggml.unknown_token_id; -1: none
  std::vector<int32_t> extra_eog_ids;  ///< end-of-generation ids besides EOS (eot, eom)
  bool add_bos = true;                 ///< tokenizer.ggml.add_bos_token
  bool add_eos = false;                ///< tokenizer.ggml.add_eos_token
  bool add_space_prefix = true;        ///< tokenizer.ggml.add_space_prefix (SPM)
  std::vector<std::string> merges;     ///< tokenizer.ggml.merges (BPE): "left right", by rank
  std::string pre;                  ///< tokenizer.ggml.pre (BPE pre-tokenizer name, e.g. "qwen2")
  std::string source = "<memory>";  ///< names the vocabulary (file path) in error messages
};

/// A vocabulary plus its encoding algorithm. Thread-safe for concurrent const use.
class Tokenizer {
 public:
  /// Builds the tokenizer named by tokenizer.ggml.model. Throws gguf::GgufError(missing_key)
  /// when a required key is missing, Error(format) when arrays disagree in length or ids are
  /// out of range, Error(unsupported) for an unknown tokenizer.ggml.model.
  static std::unique_ptr<Tokenizer> from_gguf(const gguf::File& file);

  /// SentencePiece-style tokenizer (tokenizer.ggml.model "llama") from arrays. Throws
  /// Error(format), naming the tokenizer.ggml.* key and `vocab.source`, when scores/types
  /// differ in length from tokens, the vocabulary is empty, a special id is outside
  /// [-1, n_vocab), or a byte-type token is not spelled "<0xNN>".
  static std::unique_ptr<Tokenizer> make_spm(VocabData vocab);

  /// Byte-level BPE tokenizer (tokenizer.ggml.model "gpt2") from arrays: tokens spelled in
  /// GPT-2's byte-to-unicode alphabet, `merges` by rank ("left right"), pre-tokenizer regexes
  /// chosen by `vocab.pre` ("qwen2", "qwen35", "llama-bpe", "deepseek-v3", "default"/"gpt-2";
  /// "" means "default"); `scores` are ignored. Input text is assumed to be NFC (no normaliser
  /// runs). Throws Error(format) naming the key and `vocab.source` for a malformed merge ("left
  /// right" with one space), a merge whose sides or result are not tokens, inconsistent array
  /// lengths or a special id outside [-1, n_vocab); Error(unsupported) naming the value and
  /// the supported list for an unknown `pre`.
  static std::unique_ptr<Tokenizer> make_bpe(VocabData vocab);

  Tokenizer() = default;
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  virtual ~Tokenizer() = default;

  /// Text -> token ids. `add_bos`: add the special tokens the vocabulary asks for: BOS in front
  /// (tokenizer.ggml.add_bos_token, default true for "llama") and EOS at the end
  /// (tokenizer.ggml.add_eos_token, default false). `parse_special`: when true, control and
  /// unknown token texts in `text` (e.g. "<s>", "<|im_end|>") become those tokens (leftmost,
  /// longest match); when false (user text) they are tokenized as plain characters.
  /// User-defined tokens (e.g. Qwen3's "<think>", "<tool_call>": added tokens that are not
  /// special) are always matched, as SentencePiece, Hugging Face tokenizers and llama.cpp do;
  /// only control tokens need `parse_special`. BPE accepts any bytes: each byte of ill-formed UTF-8
  /// is a piece of its own. Throws Error(unsupported) only when a character (SPM) or byte (BPE) has
  /// no token, no byte token and no unknown id.
  virtual std::vector<int32_t> encode(std::string_view text, bool add_bos,
                                      bool parse_special = false) const = 0;

  /// The bytes token `id` stands for: byte tokens "<0xNN>" give the raw byte, "▁" becomes a
  /// space; control tokens give "" and the unknown token U+FFFD unless `render_special` (then
  /// their text); user-defined tokens give their text as is. May be an incomplete UTF-8
  /// sequence. Throws Error(invalid_argument) for an id outside [0, n_vocab()).
  virtual std::string token_to_piece(int32_t id, bool render_special = false) const = 0;

  /// Concatenated pieces of `ids` (control tokens omitted). Invalid UTF-8 is kept as bytes.
  /// When the vocabulary adds a dummy space prefix (SPM), the leading space of the first
  /// visible piece is removed, so decode(encode(text)) == text for text without "▁".
  /// Throws Error(invalid_argument) for an id outside [0, n_vocab()).
  std::string decode(std::span<const int32_t> ids) const;

  int32_t n_vocab() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t bos_id() const { return bos_id_; }  ///< -1 when the vocabulary has none
  int32_t eos_id() const { return eos_id_; }  ///< -1 when the vocabulary has none
  int32_t unk_id() const { return unk_id_; }  ///< -1 when the vocabulary has none
  bool add_bos() const { return add_bos_; }
  /// True for tokens that end generation (EOS, and EOT-like ids when known).
  bool is_eog(int32_t id) const;
  const std::string& token_text(int32_t id) const;
  TokenType token_type(int32_t id) const;
  /// Id of the exact token text (the lowest id when a text repeats), or -1.
  int32_t find_token(std::string_view text) const;

 protected:
  /// Checks the arrays every vocabulary shares and fills the optional ones: tokens non-empty
  /// (fewer than 2^31), token_type and scores empty (filled: normal, 0) or of the tokens'
  /// length, each type in 0..6, BOS/EOS/unknown and end-of-generation ids in [-1, n_vocab).
  /// Throws Error(format) naming the tokenizer.ggml.* key and vocab.source.
  static void check_vocab(VocabData& vocab);
  /// Takes the tokens, types, special ids and add_bos/add_eos flags of a checked `vocab`, builds
  /// the end-of-generation list (EOS, then extra_eog_ids) and the token index.
  void adopt_vocab(VocabData& vocab);
  /// Fills token_ids_ from tokens_; call once tokens_ is final.
  void build_token_index();

  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using TokenIndex = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

  std::vector<std::string> tokens_;
  std::vector<TokenType> types_;
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  int32_t unk_id_ = -1;
  bool add_bos_ = true;
  bool add_eos_ = false;
  bool add_space_prefix_ = false;
  std::vector<int32_t> eog_ids_;
  TokenIndex token_ids_;
};

/// The symbol that stands for byte `b` in byte-level BPE vocabularies (GPT-2's bytes_to_unicode,
/// openai/gpt-2 src/encoder.py), UTF-8 encoded: '!'..'~', 0xA1..0xAC and 0xAE..0xFF are
/// themselves; the other 68 bytes map in order to U+0100, U+0101, ... (' ' -> "Ġ", '\n' -> "Ċ").
const std::string& gpt2_byte_symbol(uint8_t b);

/// Reads a Hugging Face `tokenizer.json` (model.type "BPE", byte-level) into the arrays a GGUF
/// file would hold, as llama.cpp's converter writes them: tokens by id (vocab plus
/// added_tokens), token types (added special tokens -> control, other added tokens ->
/// user_defined, the rest normal), merges as "left right" strings by rank (model.merges may
/// hold ["left", "right"] pairs or, in older files, "left right" strings), `pre` from the Split
/// regexes of pre_tokenizer: "qwen2" (Qwen2/Qwen3), "qwen35" (Qwen3.5), "llama-bpe" (Llama 3) or
/// "deepseek-v3" when they equal those models' published patterns exactly, otherwise "default"
/// (GPT-2's pattern, which may split differently: check `pre` before trusting ids of an unknown
/// family). The normalizer (NFC for Qwen) is not applied. BOS/EOS ids are left at -1 (they live
/// in tokenizer_config.json); add_bos = false; extra_eog_ids holds the control tokens with an
/// end-of-turn text ("<|im_end|>", "<|endoftext|>", ...). Throws Error(io) when the file cannot
/// be read, Error(format) naming the file and JSON field when it is not such a tokenizer (not
/// JSON, model.type not "BPE", no ByteLevel step, a malformed merge, an id given twice, or ids
/// not dense 0..n-1: the message names the missing id).
VocabData read_hf_tokenizer_json(const std::string& path);

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
