// The vocabularies of berth synth (synth.h): the synthetic SentencePiece and byte-level BPE
// vocabularies, and a Hugging Face tokenizer.json padded to the model's n_vocab.
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <unordered_set>
#include <utility>

#include "berth/core/error.h"
#include "berth/core/strings.h"
#include "synth_internal.h"

namespace berth::synth_detail {
namespace {

// Common English words, most frequent first (used to learn plausible merges).
constexpr std::string_view kWords[] = {
    "the",       "of",      "and",      "to",      "in",       "a",       "is",      "that",
    "for",       "it",      "as",       "was",     "with",     "be",      "by",      "on",
    "not",       "he",      "this",     "are",     "or",       "his",     "from",    "at",
    "which",     "but",     "have",     "an",      "had",      "they",    "you",     "were",
    "there",     "one",     "all",      "we",      "can",      "her",     "has",     "been",
    "if",        "more",    "when",     "will",    "would",    "who",     "so",      "no",
    "she",       "other",   "its",      "may",     "these",    "what",    "them",    "than",
    "some",      "him",     "time",     "into",    "only",     "do",      "their",   "two",
    "also",      "about",   "could",    "new",     "first",    "like",    "then",    "any",
    "over",      "such",    "our",      "after",   "most",     "made",    "between", "before",
    "through",   "where",   "many",     "each",    "under",    "those",   "people",  "world",
    "because",   "while",   "should",   "found",   "state",    "same",    "system",  "number",
    "great",     "small",   "house",    "water",   "little",   "story",   "called",  "world",
    "school",    "during",  "another",  "without", "against",  "however", "always",  "nothing",
    "something", "example", "language", "model",   "question", "answer",  "think",   "know",
    "hello",     "once",    "upon",     "dragon",  "quick",    "brown",   "fox",     "jumps",
    "lazy",      "dog",     "day",      "night",   "king",     "queen",   "city",    "river",
};

// GPT-2's bytes_to_unicode symbols of the 256 bytes (models' gpt2_byte_symbol).
std::vector<std::string> gpt2_byte_symbols() {
  std::vector<std::string> out(256);
  for (int b = 0; b < 256; ++b)
    out[static_cast<size_t>(b)] = gpt2_byte_symbol(static_cast<uint8_t>(b));
  return out;
}

struct Merge {
  std::string left, right;
};

// Learns up to `budget` merges over the word list (words prefixed with `space`, frequencies
// falling as 1/rank), then extends tokens systematically by one letter, so that every merge joins
// two existing tokens into a new one. `have` holds the base tokens and receives the new ones.
std::vector<Merge> make_merges(const std::string& space, int64_t budget,
                               std::unordered_set<std::string>& have) {
  std::vector<Merge> merges;
  struct Word {
    std::vector<std::string> sym;
    int64_t freq;
  };
  std::vector<Word> words;
  int64_t rank = 1;
  for (std::string_view w : kWords) {
    Word x;
    x.freq = 10000 / rank++;
    x.sym.push_back(space);
    for (char c : w) x.sym.emplace_back(1, c);
    words.push_back(std::move(x));
  }
  while (static_cast<int64_t>(merges.size()) < budget) {
    std::map<std::pair<std::string, std::string>, int64_t> count;
    for (const Word& w : words)
      for (size_t i = 0; i + 1 < w.sym.size(); ++i) count[{w.sym[i], w.sym[i + 1]}] += w.freq;
    const std::pair<std::string, std::string>* best = nullptr;
    int64_t best_n = 0;
    for (const auto& [pair, c] : count)  // ordered map: ties go to the smallest pair
      if (c > best_n) best = &pair, best_n = c;
    if (!best) break;
    const std::string l = best->first, r = best->second, lr = l + r;
    for (Word& w : words) {
      std::vector<std::string> out;
      for (size_t i = 0; i < w.sym.size(); ++i) {
        if (i + 1 < w.sym.size() && w.sym[i] == l && w.sym[i + 1] == r) {
          out.push_back(lr);
          ++i;
        } else {
          out.push_back(w.sym[i]);
        }
      }
      w.sym = std::move(out);
    }
    if (have.insert(lr).second) merges.push_back({l, r});
  }
  std::vector<std::string> grow = {space};
  for (char c = 'a'; c <= 'z'; ++c) grow.emplace_back(1, c);
  for (size_t i = 0; static_cast<int64_t>(merges.size()) < budget; ++i) {
    const std::string base = grow[i];  // copy: grow reallocates
    for (char c = 'a'; c <= 'z' && static_cast<int64_t>(merges.size()) < budget; ++c) {
      std::string s = base + c;
      if (!have.insert(s).second) continue;
      merges.push_back({base, std::string(1, c)});
      grow.push_back(std::move(s));
    }
  }
  return merges;
}

constexpr const char* kChatMl =
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}";

}  // namespace

void write_spm_vocab(const SynthSpec& s, gguf::Writer& w) {
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types = {int32_t(TokenType::unknown), int32_t(TokenType::control),
                                int32_t(TokenType::control)};
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(fmt::format("<0x{:02X}>", b));
    types.push_back(int32_t(TokenType::byte));
  }
  const std::string space = "\xE2\x96\x81";  // U+2581
  std::vector<std::string> chars = {space};
  for (int c = 0x21; c <= 0x7E; ++c) chars.emplace_back(1, static_cast<char>(c));
  std::unordered_set<std::string> have(chars.begin(), chars.end());
  const int64_t n_base = static_cast<int64_t>(tokens.size() + chars.size());
  std::vector<Merge> merges = make_merges(space, s.n_vocab - n_base, have);
  std::vector<float> scores(tokens.size(), 0.0f);
  // Pieces score by creation order (a merge learned earlier wins); single characters last.
  for (size_t i = 0; i < merges.size(); ++i) {
    tokens.push_back(merges[i].left + merges[i].right);
    types.push_back(int32_t(TokenType::normal));
    scores.push_back(-static_cast<float>(i));
  }
  for (size_t i = 0; i < chars.size(); ++i) {
    tokens.push_back(chars[i]);
    types.push_back(int32_t(TokenType::normal));
    scores.push_back(-static_cast<float>(merges.size() + i));
  }
  BERTH_CHECK(static_cast<int64_t>(tokens.size()) == s.n_vocab, "spm vocabulary size");
  w.set_string("tokenizer.ggml.model", "llama");
  w.set_string_array("tokenizer.ggml.tokens", std::move(tokens));
  w.set_f32_array("tokenizer.ggml.scores", std::move(scores));
  w.set_i32_array("tokenizer.ggml.token_type", std::move(types));
  w.set_u32("tokenizer.ggml.bos_token_id", 1);
  w.set_u32("tokenizer.ggml.eos_token_id", 2);
  w.set_u32("tokenizer.ggml.unknown_token_id", 0);
  w.set_bool("tokenizer.ggml.add_bos_token", true);
  w.set_bool("tokenizer.ggml.add_eos_token", false);
}

namespace {

void write_gpt2_keys(gguf::Writer& w, std::vector<std::string> tokens, std::vector<int32_t> types,
                     std::vector<std::string> merges, const std::string& pre,
                     const std::string& chat_template) {
  auto find = [&](std::string_view t) -> int64_t {
    for (size_t i = tokens.size(); i-- > 0;)
      if (tokens[i] == t) return static_cast<int64_t>(i);
    return -1;
  };
  const int64_t eot = find("<|endoftext|>");
  int64_t eos = find("<|im_end|>");
  if (eos < 0) eos = eot;
  w.set_string("tokenizer.ggml.model", "gpt2");
  w.set_string("tokenizer.ggml.pre", pre);
  w.set_string_array("tokenizer.ggml.tokens", std::move(tokens));
  w.set_i32_array("tokenizer.ggml.token_type", std::move(types));
  w.set_string_array("tokenizer.ggml.merges", std::move(merges));
  if (eos >= 0) w.set_u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(eos));
  if (eot >= 0) {
    w.set_u32("tokenizer.ggml.padding_token_id", static_cast<uint32_t>(eot));
    w.set_u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(eot));
  }
  w.set_bool("tokenizer.ggml.add_bos_token", false);
  if (!chat_template.empty()) w.set_string("tokenizer.chat_template", chat_template);
}

}  // namespace

void write_bpe_vocab(const SynthSpec& s, const std::string& pre, gguf::Writer& w) {
  std::vector<std::string> tokens = gpt2_byte_symbols();
  std::unordered_set<std::string> have(tokens.begin(), tokens.end());
  const std::vector<std::string> specials = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  const int64_t n_merges = s.n_vocab - 256 - static_cast<int64_t>(specials.size());
  std::vector<Merge> m = make_merges(tokens[' '], n_merges, have);
  std::vector<std::string> merges;
  merges.reserve(m.size());
  for (const Merge& x : m) {
    tokens.push_back(x.left + x.right);
    merges.push_back(x.left + " " + x.right);
  }
  std::vector<int32_t> types(tokens.size(), int32_t(TokenType::normal));
  for (const std::string& t : specials) {
    tokens.push_back(t);
    types.push_back(int32_t(TokenType::control));
  }
  BERTH_CHECK(static_cast<int64_t>(tokens.size()) == s.n_vocab, "bpe vocabulary size");
  write_gpt2_keys(w, std::move(tokens), std::move(types), std::move(merges), pre, kChatMl);
}

namespace {

// tokenizer_config.json's chat_template (a string, or a list of {name, template} entries of
// which "default" is taken); empty when the file or the field is absent.
std::string read_chat_template(const std::string& tokenizer_json) {
  const std::filesystem::path cfg =
      std::filesystem::path(tokenizer_json).parent_path() / "tokenizer_config.json";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(cfg, ec)) return {};
  std::ifstream f(cfg);
  if (!f) throw Error(ErrorCategory::io, fmt::format("cannot read '{}'", cfg.string()));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw Error(ErrorCategory::format,
                fmt::format("{}: not valid JSON: {}", cfg.string(), printable(e.what())));
  }
  if (!j.is_object() || !j.contains("chat_template")) return {};
  const nlohmann::json& t = j["chat_template"];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_array())
    for (const auto& e : t)
      if (e.is_object() && e.value("name", "") == "default" && e.contains("template") &&
          e["template"].is_string())
        return e["template"].get<std::string>();
  throw Error(ErrorCategory::format,
              fmt::format("{}: chat_template is neither a string nor a list with a \"default\" "
                          "entry",
                          cfg.string()));
}

}  // namespace

void write_hf_vocab(const SynthSpec& s, VocabData v, gguf::Writer& w) {
  const auto n_tok = static_cast<int64_t>(v.tokens.size());
  std::vector<int32_t> types(static_cast<size_t>(s.n_vocab), int32_t(TokenType::normal));
  for (int64_t i = 0; i < n_tok && i < static_cast<int64_t>(v.types.size()); ++i)
    types[i] = static_cast<int32_t>(v.types[i]);
  for (int64_t i = n_tok; i < s.n_vocab; ++i) {
    v.tokens.push_back(fmt::format("[PAD{}]", i));
    types[i] = int32_t(TokenType::unused);
  }
  write_gpt2_keys(w, std::move(v.tokens), std::move(types), std::move(v.merges),
                  v.pre.empty() ? "default" : v.pre, read_chat_template(s.vocab_path));
}

}  // namespace berth::synth_detail
