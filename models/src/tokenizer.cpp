#include "berth/models/tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "berth/core/error.h"
#include "berth/core/strings.h"
#include "berth/io/gguf.h"
#include "berth/models/utf8.h"
#include "tokenizer_bpe.h"
#include "tokenizer_spm.h"

namespace berth {
namespace {

constexpr int64_t kNoToken32 = 0xFFFFFFFF;  // converters write "none" as uint32 -1

/// A special token id from `key`: absent -> `fallback`; negative or 0xFFFFFFFF -> -1;
/// otherwise it must lie in [0, n_vocab).
int32_t read_special_id(const gguf::File& file, std::string_view key, int32_t fallback,
                        size_t n_vocab) {
  const std::optional<int64_t> v = file.get_int_opt(key);
  if (!v) return fallback < static_cast<int64_t>(n_vocab) ? fallback : -1;
  if (*v < 0 || *v == kNoToken32) return -1;
  if (*v >= static_cast<int64_t>(n_vocab)) {
    throw Error(ErrorCategory::format,
                fmt::format("{}: {} = {} is outside the vocabulary of {} tokens", file.path(), key,
                            *v, n_vocab));
  }
  return static_cast<int32_t>(*v);
}

bool read_bool(const gguf::File& file, std::string_view key, bool fallback) {
  return file.has(key) ? file.get_bool(key) : fallback;
}

// Texts of control tokens that end a turn in common chat formats (Llama 3, ChatML, Phi-3,
// Gemma, CodeLlama infill); they count as end-of-generation when the vocabulary has them.
constexpr std::string_view kEogTexts[] = {"<|eot_id|>",    "<|eom_id|>",    "<|im_end|>", "<|end|>",
                                          "<end_of_turn>", "<|endoftext|>", "<EOT>"};

/// tokenizer.ggml.token_type, checked to hold TokenType values; empty when absent.
std::vector<TokenType> read_token_types(const gguf::File& file) {
  std::vector<TokenType> out;
  if (file.has("tokenizer.ggml.token_type")) {
    const std::vector<int64_t> types = file.get_int_array("tokenizer.ggml.token_type");
    out.reserve(types.size());
    for (size_t i = 0; i < types.size(); ++i) {
      if (types[i] < 0 || types[i] > static_cast<int64_t>(TokenType::byte)) {
        throw Error(ErrorCategory::format,
                    fmt::format("{}: tokenizer.ggml.token_type[{}] = {} is outside 0..6",
                                file.path(), i, types[i]));
      }
      out.push_back(static_cast<TokenType>(types[i]));
    }
  }
  return out;
}

/// The end-of-generation ids named by tokenizer.ggml.eot_token_id / eom_token_id, then the
/// control tokens with an end-of-turn text.
std::vector<int32_t> read_extra_eog_ids(const gguf::File& file, const VocabData& v) {
  std::vector<int32_t> out;
  for (std::string_view key : {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"}) {
    const int32_t id = read_special_id(file, key, -1, v.tokens.size());
    if (id >= 0) out.push_back(id);
  }
  for (int32_t id : eog_ids_by_text(v.tokens, v.types)) out.push_back(id);
  return out;
}

std::unique_ptr<Tokenizer> spm_from_gguf(const gguf::File& file) {
  VocabData v;
  v.source = file.path();
  v.tokens = file.get_string_array("tokenizer.ggml.tokens");
  const size_t n = v.tokens.size();
  if (file.has("tokenizer.ggml.scores")) v.scores = file.get_float_array("tokenizer.ggml.scores");
  v.types = read_token_types(file);
  // SentencePiece llama vocabularies put <unk>, <s>, </s> at 0, 1, 2 (llama.cpp's defaults).
  v.bos_id = read_special_id(file, "tokenizer.ggml.bos_token_id", 1, n);
  v.eos_id = read_special_id(file, "tokenizer.ggml.eos_token_id", 2, n);
  v.unk_id = read_special_id(file, "tokenizer.ggml.unknown_token_id", 0, n);
  v.extra_eog_ids = read_extra_eog_ids(file, v);
  v.add_bos = read_bool(file, "tokenizer.ggml.add_bos_token", true);
  v.add_eos = read_bool(file, "tokenizer.ggml.add_eos_token", false);
  v.add_space_prefix = read_bool(file, "tokenizer.ggml.add_space_prefix", true);
  return Tokenizer::make_spm(std::move(v));
}

/// tokenizer.ggml.model "gpt2": tokens, token_type and merges (required), pre (absent:
/// "default", as llama.cpp reads it). Byte-level vocabularies have no conventional special ids,
/// so BOS/EOS/unknown default to none and add_bos_token to false.
std::unique_ptr<Tokenizer> bpe_from_gguf(const gguf::File& file) {
  VocabData v;
  v.source = file.path();
  v.tokens = file.get_string_array("tokenizer.ggml.tokens");
  const size_t n = v.tokens.size();
  v.types = read_token_types(file);
  v.merges = file.get_string_array("tokenizer.ggml.merges");
  v.pre = file.has("tokenizer.ggml.pre") ? file.get_string("tokenizer.ggml.pre") : "default";
  v.bos_id = read_special_id(file, "tokenizer.ggml.bos_token_id", -1, n);
  v.eos_id = read_special_id(file, "tokenizer.ggml.eos_token_id", -1, n);
  v.unk_id = read_special_id(file, "tokenizer.ggml.unknown_token_id", -1, n);
  v.extra_eog_ids = read_extra_eog_ids(file, v);
  v.add_bos = read_bool(file, "tokenizer.ggml.add_bos_token", false);
  v.add_eos = read_bool(file, "tokenizer.ggml.add_eos_token", false);
  v.add_space_prefix = false;
  return Tokenizer::make_bpe(std::move(v));
}

}  // namespace

std::vector<int32_t> eog_ids_by_text(const std::vector<std::string>& tokens,
                                     const std::vector<TokenType>& types) {
  std::vector<int32_t> out;
  if (types.size() != tokens.size()) return out;
  for (std::string_view text : kEogTexts) {
    const auto it = std::find(tokens.begin(), tokens.end(), text);
    if (it != tokens.end()) {
      const auto id = static_cast<int32_t>(it - tokens.begin());
      if (types[id] == TokenType::control) out.push_back(id);
    }
  }
  return out;
}

std::unique_ptr<Tokenizer> Tokenizer::from_gguf(const gguf::File& file) {
  const std::string& model = file.get_string("tokenizer.ggml.model");
  if (model == "llama") return spm_from_gguf(file);
  if (model == "gpt2") return bpe_from_gguf(file);
  throw Error(ErrorCategory::unsupported,
              fmt::format("{}: tokenizer.ggml.model '{}' is not supported (supported: llama, gpt2)",
                          file.path(), printable(model)));
}

std::unique_ptr<Tokenizer> Tokenizer::make_spm(VocabData vocab) {
  return std::make_unique<SpmTokenizer>(std::move(vocab));
}

std::unique_ptr<Tokenizer> Tokenizer::make_bpe(VocabData vocab) {
  return std::make_unique<BpeTokenizer>(std::move(vocab));
}

void Tokenizer::check_vocab(VocabData& vocab) {
  const size_t n = vocab.tokens.size();
  const std::string& src = vocab.source;
  if (n == 0)
    throw Error(ErrorCategory::format, fmt::format("{}: tokenizer.ggml.tokens is empty", src));
  if (n >= static_cast<size_t>(INT32_MAX))
    throw Error(
        ErrorCategory::format,
        fmt::format("{}: tokenizer.ggml.tokens has {} entries, more than int32 ids allow", src, n));
  if (vocab.scores.empty()) vocab.scores.assign(n, 0.0f);
  if (vocab.types.empty()) vocab.types.assign(n, TokenType::normal);
  for (auto [key, size] : {std::pair<const char*, size_t>{"scores", vocab.scores.size()},
                           {"token_type", vocab.types.size()}})
    if (size != n)
      throw Error(
          ErrorCategory::format,
          fmt::format("{}: tokenizer.ggml.{} has {} entries but tokenizer.ggml.tokens has {}", src,
                      key, size, n));
  for (size_t i = 0; i < n; ++i) {
    const auto t = static_cast<int32_t>(vocab.types[i]);
    if (t < 0 || t > static_cast<int32_t>(TokenType::byte))
      throw Error(
          ErrorCategory::format,
          fmt::format("{}: token {} has tokenizer.ggml.token_type {}, outside 0..6", src, i, t));
  }
  auto check_id = [&](int32_t id, std::string_view key) {
    if (id < -1 || id >= static_cast<int64_t>(n))
      throw Error(
          ErrorCategory::format,
          fmt::format("{}: {} = {} is outside the vocabulary of {} tokens", src, key, id, n));
  };
  check_id(vocab.bos_id, "tokenizer.ggml.bos_token_id");
  check_id(vocab.eos_id, "tokenizer.ggml.eos_token_id");
  check_id(vocab.unk_id, "tokenizer.ggml.unknown_token_id");
  for (int32_t id : vocab.extra_eog_ids) check_id(id, "end-of-generation id");
}

void Tokenizer::adopt_vocab(VocabData& vocab) {
  tokens_ = std::move(vocab.tokens);
  types_ = std::move(vocab.types);
  bos_id_ = vocab.bos_id;
  eos_id_ = vocab.eos_id;
  unk_id_ = vocab.unk_id;
  add_bos_ = vocab.add_bos;
  add_eos_ = vocab.add_eos;
  eog_ids_.clear();
  if (eos_id_ >= 0) eog_ids_.push_back(eos_id_);
  for (int32_t id : vocab.extra_eog_ids)
    if (id >= 0 && std::find(eog_ids_.begin(), eog_ids_.end(), id) == eog_ids_.end())
      eog_ids_.push_back(id);
  build_token_index();
}

void Tokenizer::build_token_index() {
  token_ids_.clear();
  token_ids_.reserve(tokens_.size());
  for (size_t i = 0; i < tokens_.size(); ++i) {
    token_ids_.emplace(tokens_[i], static_cast<int32_t>(i));  // keeps the first (lowest) id
  }
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  bool strip_space = add_space_prefix_;
  for (int32_t id : ids) {
    std::string piece = token_to_piece(id);
    if (piece.empty()) continue;
    if (strip_space && piece[0] == ' ') piece.erase(0, 1);
    strip_space = false;
    out += piece;
  }
  return out;
}

bool Tokenizer::is_eog(int32_t id) const {
  return id >= 0 && std::find(eog_ids_.begin(), eog_ids_.end(), id) != eog_ids_.end();
}

const std::string& Tokenizer::token_text(int32_t id) const {
  if (id < 0 || id >= n_vocab()) {
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("token_text: token id {} is outside [0, {})", id, n_vocab()));
  }
  return tokens_[id];
}

TokenType Tokenizer::token_type(int32_t id) const {
  if (id < 0 || id >= n_vocab()) {
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("token_type: token id {} is outside [0, {})", id, n_vocab()));
  }
  return types_[id];
}

int32_t Tokenizer::find_token(std::string_view text) const {
  const auto it = token_ids_.find(text);
  return it == token_ids_.end() ? -1 : it->second;
}

std::string StreamDecoder::push(int32_t id) {
  pending_ += tok_.token_to_piece(id);
  std::string out;
  size_t pos = 0;
  while (pos < pending_.size()) {
    const utf8::Unit u = utf8::next_unit(pending_, pos);
    if (u.status == utf8::Status::incomplete) break;  // wait for the rest of the character
    if (u.status == utf8::Status::ok) {
      out.append(pending_, pos, u.length);
    } else {
      out.append(utf8::kReplacement);
    }
    pos += u.length;
  }
  pending_.erase(0, pos);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = utf8::sanitize(pending_);
  pending_.clear();
  return out;
}

}  // namespace berth
