// SentencePiece-style tokenizer (tokenizer.ggml.model = "llama"): synthetic vocabularies that
// pin down the merge order, special-token handling, byte fallback and validation, and the real
// stories260K vocabulary (golden ids from ../shared/models/README.md, a naive reference
// implementation of the same algorithm, round trips, streaming).
#include <doctest/doctest.h>

#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "berth/core/error.h"
#include "berth/io/gguf.h"
#include "berth/io/gguf_writer.h"
#include "berth/models/tokenizer.h"
#include "berth/models/utf8.h"
#include "test_util.h"

using berth::ErrorCategory;
using berth::StreamDecoder;
using berth::Tokenizer;
using berth::TokenType;
using berth::VocabData;
using Ids = std::vector<int32_t>;

namespace {

const std::string kSp = "\xE2\x96\x81";  // "▁"

/// A vocabulary of (text, score, type) entries; ids are the positions.
struct Entry {
  std::string text;
  float score = 0.0f;
  TokenType type = TokenType::normal;
};

VocabData vocab_of(const std::vector<Entry>& entries) {
  VocabData v;
  for (const Entry& e : entries) {
    v.tokens.push_back(e.text);
    v.scores.push_back(e.score);
    v.types.push_back(e.type);
  }
  return v;
}

/// <unk>, <s>, </s>, then the 256 byte tokens (ids 3..258), then `rest` from id 259 on.
VocabData vocab_with_bytes(const std::vector<Entry>& rest) {
  std::vector<Entry> all = {{"<unk>", 0, TokenType::unknown},
                            {"<s>", 0, TokenType::control},
                            {"</s>", 0, TokenType::control}};
  char buf[8];
  for (int b = 0; b < 256; ++b) {
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    all.push_back({buf, 0, TokenType::byte});
  }
  all.insert(all.end(), rest.begin(), rest.end());
  VocabData v = vocab_of(all);
  v.unk_id = 0;
  v.bos_id = 1;
  v.eos_id = 2;
  return v;
}

template <typename F>
void check_error(F&& f, ErrorCategory category, const std::string& needle) {
  bool thrown = false;
  try {
    f();
  } catch (const berth::Error& e) {
    thrown = true;
    CHECK(e.category() == category);
    INFO("message: ", e.what());
    CHECK(std::string(e.what()).find(needle) != std::string::npos);
  }
  CHECK(thrown);
}

std::unique_ptr<Tokenizer> load_stories() {
  static const berth::gguf::File file = berth::gguf::File::open(berth::test::stories260k());
  return Tokenizer::from_gguf(file);
}

}  // namespace

TEST_CASE("spm: the highest-scoring pair merges first, not the leftmost") {
  // "ab" would win a greedy left-to-right merge; "bc" has the higher score.
  VocabData v = vocab_of({{"a", -10}, {"b", -10}, {"c", -10}, {"ab", -5}, {"bc", -1}});
  v.add_space_prefix = false;
  const auto tok = Tokenizer::make_spm(v);
  CHECK(tok->encode("abc", false) == Ids{0, 4});  // a + bc

  // Equal scores: the leftmost pair wins.
  VocabData tie = vocab_of({{"a", -10}, {"b", -10}, {"c", -10}, {"ab", -1}, {"bc", -1}});
  tie.add_space_prefix = false;
  CHECK(Tokenizer::make_spm(tie)->encode("abc", false) == Ids{3, 2});  // ab + c
}

TEST_CASE("spm: merges chain through new neighbours by score") {
  // abcd: cd (-0.5) first, then bcd (-0.7) beats ab (-0.9), then abcd is not a token.
  VocabData v = vocab_of({{"a", -9},
                          {"b", -9},
                          {"c", -9},
                          {"d", -9},
                          {"ab", -0.9f},
                          {"cd", -0.5f},
                          {"bcd", -0.7f},
                          {"abc", -0.1f}});
  v.add_space_prefix = false;
  const auto tok = Tokenizer::make_spm(v);
  CHECK(tok->encode("abcd", false) == Ids{0, 6});        // a + bcd
  CHECK(tok->encode("abcdabc", false) == Ids{0, 6, 7});  // a + bcd + abc (via ab, then abc)
}

TEST_CASE("spm: dummy prefix, spaces become U+2581, decode removes the prefix") {
  VocabData v = vocab_with_bytes(
      {{kSp, -1}, {"h", -9}, {"i", -9}, {kSp + "h", -3}, {kSp + "hi", -2}, {"hi", -4}});
  const auto tok = Tokenizer::make_spm(v);
  // ids: ▁=259 h=260 i=261 ▁h=262 ▁hi=263 hi=264
  CHECK(tok->encode("hi", false) == Ids{263});
  CHECK(tok->encode("hi hi", true) == Ids{1, 263, 263});
  CHECK(tok->encode(" hi", false) == Ids{259, 263});
  CHECK(tok->encode("", true) == Ids{1});
  CHECK(tok->encode("", false).empty());
  CHECK(tok->decode(Ids{1, 263, 263}) == "hi hi");
  CHECK(tok->decode(Ids{259, 263}) == " hi");
  CHECK(tok->token_to_piece(263) == " hi");

  v.add_space_prefix = false;
  const auto no_prefix = Tokenizer::make_spm(v);
  CHECK(no_prefix->encode("hi", false) == Ids{264});
  CHECK(no_prefix->decode(Ids{263}) == " hi");
}

TEST_CASE("spm: control and byte tokens are never produced by merging") {
  VocabData v = vocab_with_bytes({{"<", -9},
                                  {"s", -9},
                                  {">", -9},
                                  {"<s", -1},
                                  {"0", -9},
                                  {"x", -9},
                                  {"4", -9},
                                  {"1", -9},
                                  {"<0", -1},
                                  {"<0x", -1},
                                  {"<0x4", -1},
                                  {"<0x41", -1}});
  v.add_space_prefix = false;
  const auto tok = Tokenizer::make_spm(v);
  const int32_t lt_s = tok->find_token("<s");
  const int32_t gt = tok->find_token(">");
  const int32_t lt_0x41 = tok->find_token("<0x41");
  REQUIRE(lt_s == 262);
  // "<s>" is the control token 1 but plain text never becomes it.
  CHECK(tok->encode("<s>", false) == Ids{lt_s, gt});
  CHECK(tok->encode("<s>", false, /*parse_special=*/true) == Ids{1});
  // "<0x41>" is the byte token for 'A' (id 3 + 0x41) but merging stops at "<0x41".
  CHECK(tok->encode("<0x41>", false) == Ids{lt_0x41, gt});
  CHECK(tok->encode("<0x41>", false, true) == Ids{lt_0x41, gt});  // bytes are not special
}

TEST_CASE("spm: parse_special splits at control tokens, longest match, prefix after special") {
  VocabData v = vocab_with_bytes({{kSp, -1},
                                  {"a", -9},
                                  {kSp + "a", -2},
                                  {"<|x|>", 0, TokenType::control},
                                  {"<|x|>y", 0, TokenType::control},
                                  {"y", -9},
                                  {kSp + "y", -2}});
  // ids: ▁=259 a=260 ▁a=261 <|x|>=262 <|x|>y=263 y=264 ▁y=265
  const auto tok = Tokenizer::make_spm(v);
  CHECK(tok->encode("a<s>a", true, true) == Ids{1, 261, 1, 261});
  CHECK(tok->encode("<s>a</s>", false, true) == Ids{1, 261, 2});
  CHECK(tok->encode("a<|x|>y", false, true) == Ids{261, 263});  // longest special wins
  CHECK(tok->encode("a<|x|>ya", false, true) == Ids{261, 263, 261});
  CHECK(tok->encode("<unk>", false, true) == Ids{0});
  // Without parse_special, none of them appears.
  for (int32_t id : tok->encode("a<s>a<|x|>y</s><unk>", false, false)) {
    CHECK(tok->token_type(id) != TokenType::control);
    CHECK(id != 0);
  }
  // Rendering: control tokens vanish unless asked for.
  CHECK(tok->decode(tok->encode("a<|x|>ya", false, true)) == "a a");
  CHECK(tok->token_to_piece(263, true) == "<|x|>y");
  CHECK(tok->token_to_piece(1) == "");
  CHECK(tok->token_to_piece(1, true) == "<s>");
}

TEST_CASE("spm: user-defined tokens are matched even in plain text") {
  VocabData v = vocab_with_bytes(
      {{kSp, -1}, {"a", -9}, {kSp + "a", -2}, {"<tag>", 0, TokenType::user_defined}});
  v.add_space_prefix = false;
  const auto tok = Tokenizer::make_spm(v);
  CHECK(tok->encode("a<tag>a", false, false) == Ids{260, 262, 260});
  CHECK(tok->token_to_piece(262) == "<tag>");
  CHECK(tok->decode(Ids{260, 262, 260}) == "a<tag>a");
}

TEST_CASE("spm: byte fallback, unknown fallback, and the error when neither exists") {
  VocabData v = vocab_with_bytes({{kSp, -1}, {"a", -9}});
  v.add_space_prefix = false;
  const auto tok = Tokenizer::make_spm(v);
  // é = C3 A9 -> two byte tokens; ids are 3 + byte.
  CHECK(tok->encode("a\xC3\xA9", false) == Ids{260, 3 + 0xC3, 3 + 0xA9});
  CHECK(tok->token_to_piece(3 + 0xC3) == "\xC3");
  CHECK(tok->decode(Ids{260, 3 + 0xC3, 3 + 0xA9}) == "a\xC3\xA9");
  // Ill-formed input survives as bytes.
  CHECK(tok->encode("\x80z", false) == Ids{3 + 0x80, 3 + 'z'});

  VocabData no_bytes = vocab_of({{"<unk>", 0, TokenType::unknown}, {"a", -1}});
  no_bytes.unk_id = 0;
  no_bytes.add_space_prefix = false;
  const auto unk_tok = Tokenizer::make_spm(no_bytes);
  CHECK(unk_tok->encode("a\xC3\xA9z", false) == Ids{1, 0, 0});  // one <unk> per character
  CHECK(unk_tok->token_to_piece(0) == "\xEF\xBF\xBD");
  CHECK(unk_tok->token_to_piece(0, true) == "<unk>");

  VocabData bare = vocab_of({{"a", -1}});
  bare.add_space_prefix = false;
  const auto bare_tok = Tokenizer::make_spm(bare);
  CHECK(bare_tok->encode("aa", false) == Ids{0, 0});
  check_error([&] { bare_tok->encode("ab", false); }, ErrorCategory::unsupported, "0x62");
}

TEST_CASE("spm: vocabulary validation names the key") {
  VocabData v = vocab_of({{"a"}, {"b"}});
  v.scores.push_back(1.0f);
  check_error([&] { Tokenizer::make_spm(v); }, ErrorCategory::format, "tokenizer.ggml.scores");

  v = vocab_of({{"a"}, {"b"}});
  v.types.pop_back();
  check_error([&] { Tokenizer::make_spm(v); }, ErrorCategory::format, "tokenizer.ggml.token_type");

  v = vocab_of({{"a"}, {"b"}});
  v.bos_id = 2;
  check_error([&] { Tokenizer::make_spm(v); }, ErrorCategory::format,
              "tokenizer.ggml.bos_token_id");
  v.bos_id = -1;
  v.eos_id = -7;
  check_error([&] { Tokenizer::make_spm(v); }, ErrorCategory::format,
              "tokenizer.ggml.eos_token_id");
  v.eos_id = -1;
  v.unk_id = 5;
  check_error([&] { Tokenizer::make_spm(v); }, ErrorCategory::format,
              "tokenizer.ggml.unknown_token_id");

  v = vocab_of({{"a"}, {"<0xZZ>", 0, TokenType::byte}});
  check_error([&] { Tokenizer::make_spm(v); }, ErrorCategory::format, "<0xZZ>");

  v = vocab_of({{"a"}, {"b", 0, static_cast<TokenType>(9)}});
  check_error([&] { Tokenizer::make_spm(v); }, ErrorCategory::format, "token_type 9");

  check_error([&] { Tokenizer::make_spm(VocabData{}); }, ErrorCategory::format, "empty");

  // Scores and types may be absent: all 0 / normal.
  VocabData minimal;
  minimal.tokens = {"x", "y", "xy"};
  minimal.add_space_prefix = false;
  const auto tok = Tokenizer::make_spm(minimal);
  CHECK(tok->encode("xyx", false) == Ids{2, 0});
  CHECK(tok->token_type(2) == TokenType::normal);
  check_error([&] { tok->token_to_piece(3); }, ErrorCategory::invalid_argument, "3");
  check_error([&] { tok->token_to_piece(-1); }, ErrorCategory::invalid_argument, "-1");
  check_error([&] { tok->decode(Ids{0, 9}); }, ErrorCategory::invalid_argument, "9");
}

// ---- from_gguf on handcrafted files ----

namespace {

berth::gguf::Writer tiny_gguf() {
  berth::gguf::Writer w;
  w.set_string("general.architecture", "llama");
  w.set_string("tokenizer.ggml.model", "llama");
  w.set_string_array("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", kSp, "a", kSp + "a"});
  w.set_f32_array("tokenizer.ggml.scores", {0, 0, 0, -1, -2, -0.5f});
  w.set_i32_array("tokenizer.ggml.token_type", {2, 3, 3, 1, 1, 1});
  return w;
}

std::unique_ptr<Tokenizer> from_writer(const berth::gguf::Writer& w) {
  const auto file = berth::gguf::File::from_memory(w.to_bytes(), "tiny.gguf");
  return Tokenizer::from_gguf(file);
}

}  // namespace

TEST_CASE("spm from_gguf: metadata keys, defaults and errors") {
  {
    const auto tok = from_writer(tiny_gguf());  // no id keys: llama defaults 1 / 2 / 0
    CHECK(tok->n_vocab() == 6);
    CHECK(tok->bos_id() == 1);
    CHECK(tok->eos_id() == 2);
    CHECK(tok->unk_id() == 0);
    CHECK(tok->add_bos());
    CHECK(tok->is_eog(2));
    CHECK_FALSE(tok->is_eog(1));
    CHECK(tok->encode("a a", true) == Ids{1, 5, 5});
  }
  {
    auto w = tiny_gguf();
    w.set_bool("tokenizer.ggml.add_bos_token", false);
    w.set_bool("tokenizer.ggml.add_eos_token", true);
    w.set_u32("tokenizer.ggml.bos_token_id", 0xFFFFFFFFu);  // "none" as converters write it
    w.set_u32("tokenizer.ggml.eos_token_id", 2);
    w.set_u32("tokenizer.ggml.eot_token_id", 4);
    const auto tok = from_writer(w);
    CHECK(tok->bos_id() == -1);
    CHECK_FALSE(tok->add_bos());
    CHECK(tok->encode("a", true) == Ids{5, 2});  // no BOS, EOS appended
    CHECK(tok->encode("a", false) == Ids{5});
    CHECK(tok->is_eog(2));
    CHECK(tok->is_eog(4));
  }
  {
    auto w = tiny_gguf();
    w.set_bool("tokenizer.ggml.add_space_prefix", false);
    const auto tok = from_writer(w);
    CHECK(tok->encode("a", false) == Ids{4});
  }
  {
    auto w = tiny_gguf();
    w.set_f32_array("tokenizer.ggml.scores", {0, 0, 0});
    check_error([&] { from_writer(w); }, ErrorCategory::format, "tokenizer.ggml.scores");
  }
  {
    auto w = tiny_gguf();
    w.set_i32_array("tokenizer.ggml.token_type", {2, 3, 3, 1, 1, 1, 1});
    check_error([&] { from_writer(w); }, ErrorCategory::format, "tokenizer.ggml.token_type");
  }
  {
    auto w = tiny_gguf();
    w.set_i32_array("tokenizer.ggml.token_type", {2, 3, 3, 1, 1, 7});
    check_error([&] { from_writer(w); }, ErrorCategory::format, "token_type[5] = 7");
  }
  {
    auto w = tiny_gguf();
    w.set_u32("tokenizer.ggml.eos_token_id", 6);
    check_error([&] { from_writer(w); }, ErrorCategory::format, "tokenizer.ggml.eos_token_id");
  }
  {
    auto w = tiny_gguf();
    w.set_string("tokenizer.ggml.model", "t5");
    check_error([&] { from_writer(w); }, ErrorCategory::unsupported, "t5");
  }
  {
    berth::gguf::Writer w;
    w.set_string("tokenizer.ggml.model", "llama");
    bool thrown = false;
    try {
      from_writer(w);
    } catch (const berth::gguf::GgufError& e) {
      thrown = true;
      CHECK(e.code() == berth::gguf::Errc::missing_key);
      CHECK(std::string(e.what()).find("tokenizer.ggml.tokens") != std::string::npos);
    }
    CHECK(thrown);
  }
}

// ---- the real stories260K vocabulary ----

namespace {

/// The merge algorithm written the slow, obvious way: rescan all adjacent pairs each step.
Ids naive_encode(const berth::gguf::File& file, const std::string& text) {
  const auto& tokens = file.get_string_array("tokenizer.ggml.tokens");
  const auto scores = file.get_float_array("tokenizer.ggml.scores");
  const auto types = file.get_int_array("tokenizer.ggml.token_type");
  if (text.empty()) return {};
  std::map<std::string, int32_t> pieces;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (types[i] == 1 || types[i] == 4 || types[i] == 0) pieces.emplace(tokens[i], int32_t(i));
  }
  std::string escaped = kSp;
  for (char c : text) {
    if (c == ' ') {
      escaped += kSp;
    } else {
      escaped += c;
    }
  }
  std::vector<std::string> sym;
  for (auto c : berth::utf8::split(escaped)) sym.emplace_back(c);
  for (;;) {
    int best = -1;
    float best_score = 0;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      auto it = pieces.find(sym[i] + sym[i + 1]);
      if (it == pieces.end()) continue;
      if (best < 0 || scores[it->second] > best_score) {
        best = int(i);
        best_score = scores[it->second];
      }
    }
    if (best < 0) break;
    sym[best] += sym[best + 1];
    sym.erase(sym.begin() + best + 1);
  }
  Ids out;
  for (const auto& s : sym) {
    auto it = pieces.find(s);
    if (it != pieces.end()) {
      out.push_back(it->second);
    } else {
      for (unsigned char b : s) out.push_back(3 + b);  // <0x00> is id 3 in this vocabulary
    }
  }
  return out;
}

}  // namespace

TEST_CASE("spm stories260K: golden ids and metadata") {
  const auto tok = load_stories();
  CHECK(tok->n_vocab() == 512);
  CHECK(tok->bos_id() == 1);
  CHECK(tok->eos_id() == 2);
  CHECK(tok->unk_id() == 0);
  CHECK(tok->add_bos());
  CHECK(tok->is_eog(2));
  CHECK(tok->token_type(1) == TokenType::control);
  CHECK(tok->token_type(3) == TokenType::byte);
  CHECK(tok->token_text(403) == kSp + "Once");
  CHECK(tok->find_token(kSp + "time") == 378);
  CHECK(tok->find_token("no such token") == -1);

  // ../shared/models/README.md: "Once upon a time" -> [1, 403, 407, 261, 378].
  CHECK(tok->encode("Once upon a time", true) == Ids{1, 403, 407, 261, 378});
  CHECK(tok->encode("Once upon a time", false) == Ids{403, 407, 261, 378});
  CHECK(tok->decode(Ids{1, 403, 407, 261, 378}) == "Once upon a time");
  CHECK(tok->token_to_piece(403) == " Once");
}

TEST_CASE("spm stories260K: round trips, byte fallback for characters outside the vocabulary") {
  const auto tok = load_stories();
  const int32_t space = tok->find_token(kSp);
  REQUIRE(space >= 0);
  const std::vector<std::string> texts = {
      "Once upon a time, there was a little girl named Lily.",
      "  two leading spaces and trailing  ",
      "Line one.\nLine two!\t(tab) \"quoted\" 123",
      "caf\xC3\xA9",                           // é is in this vocabulary
      "\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E",  // 日本語: bytes
      "crab \xF0\x9F\xA6\x80 emoji",           // 🦀: bytes
      "mixed \xC3\xA9\xE6\x97\xA5\xF0\x9F\xA6\x80 end",
  };
  for (const auto& text : texts) {
    INFO("text: ", text);
    const Ids ids = tok->encode(text, true);
    CHECK(ids.front() == 1);
    CHECK(tok->decode(ids) == text);
  }
  // 日本語 has no tokens: "▁" then one byte token per UTF-8 byte (<0xNN> is id 3 + NN).
  CHECK(tok->encode("\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E", false) ==
        Ids{space, 3 + 0xE6, 3 + 0x97, 3 + 0xA5, 3 + 0xE6, 3 + 0x9C, 3 + 0xAC, 3 + 0xE8, 3 + 0xAA,
            3 + 0x9E});
  CHECK(tok->encode("\xF0\x9F\xA6\x80", false) ==
        Ids{space, 3 + 0xF0, 3 + 0x9F, 3 + 0xA6, 3 + 0x80});
  // é is a single-character token here: no byte tokens.
  for (int32_t id : tok->encode("caf\xC3\xA9", false))
    CHECK(tok->token_type(id) != TokenType::byte);
}

TEST_CASE("spm stories260K: special-token text in plain text vs parse_special") {
  const auto tok = load_stories();
  const Ids plain = tok->encode("<s>Hello</s>", true, false);
  REQUIRE(plain.size() > 2);
  CHECK(plain[0] == 1);  // the BOS we asked for
  for (size_t i = 1; i < plain.size(); ++i) {
    CHECK(plain[i] != 1);
    CHECK(plain[i] != 2);
  }
  CHECK(tok->decode(plain) == "<s>Hello</s>");

  const Ids parsed = tok->encode("<s>Hello</s>", false, true);
  REQUIRE(parsed.size() >= 3);
  CHECK(parsed.front() == 1);
  CHECK(parsed.back() == 2);
  CHECK(Ids(parsed.begin() + 1, parsed.end() - 1) == tok->encode("Hello", false));
  // decode drops the control tokens and the first dummy-prefix space.
  CHECK(tok->decode(parsed) == "Hello");
}

TEST_CASE("spm stories260K: matches the naive reference on random text") {
  const auto file = berth::gguf::File::open(berth::test::stories260k());
  const auto tok = Tokenizer::from_gguf(file);
  const std::vector<std::string> alphabet = {"a",
                                             "e",
                                             "t",
                                             "o",
                                             "h",
                                             "n",
                                             " ",
                                             " ",
                                             "s",
                                             "l",
                                             "i",
                                             "d",
                                             "r",
                                             "y",
                                             ".",
                                             ",",
                                             "T",
                                             "L",
                                             "\xC3\xA9",
                                             "\xE6\x97\xA5",
                                             "\xF0\x9F\xA6\x80",
                                             "<",
                                             ">",
                                             "\n",
                                             "x",
                                             "q",
                                             "ing",
                                             "the"};
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 500; ++trial) {
    std::string text;
    const int len = int(rng() % 40);
    for (int i = 0; i < len; ++i) text += alphabet[rng() % alphabet.size()];
    INFO("text: '", text, "'");
    const Ids ids = tok->encode(text, false);
    REQUIRE(ids == naive_encode(file, text));
    CHECK(tok->decode(ids) == text);
  }
}

TEST_CASE("spm stories260K: StreamDecoder holds back split characters") {
  const auto tok = load_stories();
  const Ids ids = tok->encode("\xF0\x9F\xA6\x80", false);
  REQUIRE(ids.size() == 5);  // ▁ + 4 byte tokens
  StreamDecoder dec(*tok);
  CHECK(dec.push(ids[0]) == " ");
  CHECK(dec.push(ids[1]) == "");
  CHECK(dec.push(ids[2]) == "");
  CHECK(dec.push(ids[3]) == "");
  CHECK(dec.push(ids[4]) == "\xF0\x9F\xA6\x80");
  CHECK(dec.flush() == "");

  // Whole story text streams to the same bytes decode gives (modulo the dummy prefix).
  const std::string story = "Lily saw a big \xE6\x97\xA5 and a \xF0\x9F\xA6\x80.";
  StreamDecoder dec2(*tok);
  std::string streamed;
  for (int32_t id : tok->encode(story, true)) {
    const std::string part = dec2.push(id);
    CHECK(berth::utf8::is_valid(part));
    streamed += part;
  }
  streamed += dec2.flush();
  CHECK(streamed == " " + story);

  // An unfinished character at the end becomes U+FFFD; a stray continuation byte at once.
  StreamDecoder dec3(*tok);
  CHECK(dec3.push(3 + 0xF0) == "");
  CHECK(dec3.push(3 + 0x9F) == "");
  CHECK(dec3.flush() == "\xEF\xBF\xBD");
  CHECK(dec3.push(3 + 0x80) == "\xEF\xBF\xBD");
  // A lead byte followed by ASCII: the lead is replaced, the ASCII kept.
  CHECK(dec3.push(3 + 0xE6) == "");
  CHECK(dec3.push(3 + 'A') ==
        "\xEF\xBF\xBD"
        "A");
  CHECK(dec3.push(1) == "");  // control tokens render nothing
}

TEST_CASE("spm stories260K: the README's greedy continuation decodes to its golden text") {
  // The first 64 greedy tokens after "Once upon a time" (as the f64 oracle in tests/oracle
  // produces them); ../shared/models/README.md gives the text they read as.
  const Ids ids = {432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337,
                   410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394,
                   261, 370, 432, 352, 266, 268, 388, 426, 338, 391, 266, 267, 337, 335, 312, 432,
                   398, 312, 286, 267, 414, 270, 333, 415, 426, 13,  438, 310, 439, 419, 357, 336};
  const std::string golden =
      ", there was a little girl named Lily. She loved to play outside in the park. One day, she "
      "saw a big, red ball. She wanted to play with it, but it was too high.\nLily's mom said";
  const auto tok = load_stories();
  CHECK(tok->decode(ids) == golden);
  StreamDecoder dec(*tok);
  std::string streamed;
  for (int32_t id : ids) streamed += dec.push(id);
  streamed += dec.flush();
  CHECK(streamed == golden);
}
