// Byte-level BPE tokenizer (tokenizer.ggml.model = "gpt2") and the tokenizer.json reader:
// the real Qwen3 vocabulary against the Hugging Face `tokenizers` reference ids
// (../shared/reference/qwen3_tokenize.json), handcrafted vocabularies that pin down merge
// ranks, the byte alphabet, pre-tokenizers, special tokens and validation, and a GGUF round
// trip through Tokenizer::from_gguf.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "berth/core/error.h"
#include "berth/io/gguf.h"
#include "berth/io/gguf_writer.h"
#include "berth/models/tokenizer.h"
#include "berth/models/utf8.h"
#include "test_util.h"

using berth::ErrorCategory;
using berth::Tokenizer;
using berth::TokenType;
using berth::VocabData;
using Ids = std::vector<int32_t>;

namespace {

template <typename F>
void check_error(F&& f, ErrorCategory category, const std::string& needle) {
  bool thrown = false;
  try {
    f();
  } catch (const berth::Error& e) {
    thrown = true;
    CHECK(e.category() == category);
    INFO("message: ", std::string(e.what()));
    CHECK(std::string(e.what()).find(needle) != std::string::npos);
  }
  CHECK(thrown);
}

// ---- the real Qwen3 vocabulary ----

std::string qwen3_json() {
  return (berth::test::shared_dir() / "tokenizers" / "qwen3" / "tokenizer.json").string();
}

/// Qwen3's vocabulary as read from tokenizer.json, and its tokenizer (loaded once).
struct Qwen3 {
  VocabData vocab;
  std::unique_ptr<Tokenizer> tok;
};

const Qwen3& qwen3() {
  static const Qwen3 q = [] {
    Qwen3 r;
    r.vocab = berth::read_hf_tokenizer_json(qwen3_json());
    r.tok = Tokenizer::make_bpe(r.vocab);
    return r;
  }();
  return q;
}

struct Reference {
  std::string text;
  Ids ids;
  std::string decoded;
};

const std::vector<Reference>& references() {
  static const std::vector<Reference> refs = [] {
    std::ifstream in(berth::test::shared_dir() / "reference" / "qwen3_tokenize.json");
    REQUIRE(in);
    const nlohmann::json j = nlohmann::json::parse(in);
    std::vector<Reference> r;
    for (const auto& e : j) {
      r.push_back({e.at("text").get<std::string>(), e.at("ids").get<Ids>(),
                   e.at("decoded").get<std::string>()});
    }
    return r;
  }();
  return refs;
}

constexpr int32_t kQwenFirstAdded = 151643;  // <|endoftext|>, the first added token
constexpr int32_t kImStart = 151644;
constexpr int32_t kImEnd = 151645;
constexpr int32_t kThink = 151667;  // "<think>", an added token with special = false

}  // namespace

TEST_CASE("read_hf_tokenizer_json: Qwen3's tokenizer.json") {
  const VocabData& v = qwen3().vocab;
  CHECK(v.tokens.size() == 151669);  // 151,643 vocab entries + 26 added tokens
  CHECK(v.types.size() == v.tokens.size());
  CHECK(v.merges.size() == 151387);
  CHECK(v.merges[0] == "\xC4\xA0 \xC4\xA0");  // "Ġ Ġ": the first-ranked merge
  CHECK(v.merges[2] == "i n");
  CHECK(v.tokens[0] == "!");
  CHECK(v.tokens[9707] == "Hello");
  CHECK(v.tokens[kImEnd] == "<|im_end|>");
  CHECK(v.types[0] == TokenType::normal);
  CHECK(v.types[kQwenFirstAdded - 1] == TokenType::normal);
  CHECK(v.types[kQwenFirstAdded] == TokenType::control);
  CHECK(v.types[kImEnd] == TokenType::control);
  CHECK(v.types[kThink] == TokenType::user_defined);
  CHECK(v.pre == "qwen2");
  CHECK(v.bos_id == -1);
  CHECK(v.eos_id == -1);
  CHECK_FALSE(v.add_bos);
  CHECK(v.extra_eog_ids == Ids{kImEnd, kQwenFirstAdded});
  CHECK(v.source == qwen3_json());

  const Tokenizer& tok = *qwen3().tok;
  CHECK(tok.n_vocab() == 151669);
  CHECK(tok.is_eog(kImEnd));
  CHECK(tok.is_eog(kQwenFirstAdded));
  CHECK_FALSE(tok.is_eog(kImStart));
  CHECK(tok.bos_id() == -1);
  CHECK(tok.encode("Hello", /*add_bos=*/true) == Ids{9707});  // no BOS in this vocabulary
}

TEST_CASE("bpe: Qwen3 reference ids (Hugging Face tokenizers), special tokens parsed") {
  const Tokenizer& tok = *qwen3().tok;
  REQUIRE(references().size() == 15);
  for (const Reference& r : references()) {
    INFO("text: ", r.text);
    CHECK(tok.encode(r.text, false, /*parse_special=*/true) == r.ids);
    CHECK(r.decoded == r.text);
    // `decoded` keeps special tokens (Hugging Face's skip_special_tokens=False); decode()
    // omits control tokens, token_to_piece(id, render_special=true) renders them.
    std::string rendered;
    for (int32_t id : r.ids) rendered += tok.token_to_piece(id, /*render_special=*/true);
    CHECK(rendered == r.decoded);
    if (r.text.find("<|") == std::string::npos) CHECK(tok.decode(r.ids) == r.decoded);
  }
}

TEST_CASE("bpe: Qwen3 with special-token parsing off (user text)") {
  const Tokenizer& tok = *qwen3().tok;
  int with_markers = 0;
  for (const Reference& r : references()) {
    INFO("text: ", r.text);
    const Ids ids = tok.encode(r.text, false, /*parse_special=*/false);
    CHECK(tok.decode(ids) == r.text);
    if (r.text.find("<|") != std::string::npos) {
      ++with_markers;
      CHECK(std::all_of(ids.begin(), ids.end(), [](int32_t id) { return id < kQwenFirstAdded; }));
    } else {
      CHECK(ids == r.ids);
    }
  }
  CHECK(with_markers == 1);
  // "<|im_end|>" as plain characters: "<|", "im", "_end", "|>".
  const Ids plain = tok.encode("<|im_end|>", false, false);
  CHECK(plain.size() > 1);
  CHECK(tok.decode(plain) == "<|im_end|>");
  CHECK(tok.encode("<|im_end|>", false, true) == Ids{kImEnd});
  CHECK(tok.decode(Ids{kImStart, 872, 198, 6023, kImEnd}) == "user\nhi");  // control omitted
  // User-defined added tokens (special = false) are matched in any text, as Hugging Face does.
  CHECK(tok.encode("<think>", false, true) == Ids{kThink});
  CHECK(tok.encode("<think>", false, false) == Ids{kThink});
  CHECK(tok.decode(Ids{kThink}) == "<think>");
}

TEST_CASE("bpe: Qwen3 token_to_piece and StreamDecoder") {
  const Tokenizer& tok = *qwen3().tok;
  CHECK(tok.token_to_piece(220) == " ");   // "Ġ"
  CHECK(tok.token_to_piece(198) == "\n");  // "Ċ"
  CHECK(tok.token_to_piece(9707) == "Hello");
  CHECK(tok.token_to_piece(kImEnd).empty());
  CHECK(tok.token_to_piece(kImEnd, /*render_special=*/true) == "<|im_end|>");
  CHECK(tok.token_to_piece(kThink) == "<think>");
  check_error([&] { tok.token_to_piece(151669); }, ErrorCategory::invalid_argument, "151669");
  check_error([&] { tok.token_to_piece(-1); }, ErrorCategory::invalid_argument, "-1");
  // The emoji entry splits a 4-byte character across tokens (11162, 248, 222 = "🚀").
  berth::StreamDecoder stream(tok);
  std::string streamed;
  for (int32_t id : Ids{37523, 11162, 248, 222}) streamed += stream.push(id);
  streamed += stream.flush();
  CHECK(streamed == "emoji \xF0\x9F\x9A\x80");
}

TEST_CASE("bpe: concurrent encode calls share no mutable state") {
  const Tokenizer& tok = *qwen3().tok;
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (size_t t = 0; t < mismatches.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 50; ++round) {
        for (const Reference& r : references()) {
          if (tok.encode(r.text, false, true) != r.ids) ++mismatches[t];
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  CHECK(mismatches == std::vector<int>(4, 0));
}

TEST_CASE("bpe: no NFC normaliser; input is taken as given") {
  // Qwen3's tokenizer.json declares an NFC normaliser; berth does not normalise (no Unicode
  // normalisation library is a dependency), so an NFD string tokenizes as its code points: the
  // combining accent U+0301 is not a letter and becomes a piece of its own.
  const Tokenizer& tok = *qwen3().tok;
  const std::string nfc = "caf\xC3\xA9";   // "café", é = U+00E9
  const std::string nfd = "cafe\xCC\x81";  // "cafe" + U+0301 COMBINING ACUTE ACCENT
  Ids expected = tok.encode("cafe", false);
  const Ids accent = tok.encode("\xCC\x81", false);
  expected.insert(expected.end(), accent.begin(), accent.end());
  CHECK(tok.encode(nfd, false) == expected);
  CHECK(tok.encode(nfd, false) != tok.encode(nfc, false));
  CHECK(tok.decode(tok.encode(nfd, false)) == nfd);  // bytes are kept as they came
}

TEST_CASE("bpe: Qwen3 long inputs (100 kB) and arbitrary bytes") {
  const Tokenizer& tok = *qwen3().tok;
  // A 100 kB word: the merge loop is O(n log n); 8 'a's are one token (69440), as in the
  // reference's 50-'a' entry.
  const std::string as(100000, 'a');
  const Ids a_ids = tok.encode(as, false);
  CHECK(a_ids.size() == 12500);
  CHECK(std::all_of(a_ids.begin(), a_ids.end(), [](int32_t id) { return id == 69440; }));
  // Long runs of each regex class, and mixed text.
  for (const std::string& s :
       {std::string(100000, ' '), std::string(100000, '7'), std::string(100000, '!'),
        std::string(100000, '\n'), std::string(50000, ' ') + "x"}) {
    const Ids ids = tok.encode(s, false);
    CHECK(!ids.empty());
    CHECK(tok.decode(ids) == s);
  }
  std::string mixed;
  while (mixed.size() < 100000)
    mixed += "The quick brown fox, 12345 \xE6\x97\xA5\xE6\x9C\xAC\t\r\n ";
  CHECK(tok.decode(tok.encode(mixed, false)) == mixed);

  // Random bytes (mostly ill-formed UTF-8): every byte encodes, and decoding gives them back.
  std::mt19937 rng(42);
  std::string bytes(100000, '\0');
  for (char& c : bytes) c = static_cast<char>(rng() & 0xFF);
  const Ids byte_ids = tok.encode(bytes, false, true);
  CHECK(tok.decode(byte_ids) == bytes);
}

// ---- handcrafted vocabularies ----

namespace {

/// GPT-2's byte alphabet (bytes_to_unicode), written out independently of the tokenizer:
/// printable bytes stand for themselves, the others count up from U+0100.
std::string byte_symbol(int b) {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> t(256);
    char32_t next = 0x100;
    for (int i = 0; i < 256; ++i) {
      const bool keep = (i >= '!' && i <= '~') || (i >= 0xA1 && i <= 0xAC) || i >= 0xAE;
      berth::utf8::append(t[i], keep ? static_cast<char32_t>(i) : next++);
    }
    return t;
  }();
  return table[b];
}

/// The 256 byte symbols as ids 0..255 (id == byte), then `extra` (normal tokens from 256 on,
/// given as raw bytes and spelled in the byte alphabet), then `specials` with their types;
/// `merges` by rank as raw (left, right) byte strings.
using Merges = std::vector<std::pair<std::string, std::string>>;

VocabData tiny_vocab(const std::vector<std::string>& extra, const Merges& merges,
                     const std::string& pre = "qwen2",
                     const std::vector<std::pair<std::string, TokenType>>& specials = {}) {
  VocabData v;
  for (int b = 0; b < 256; ++b) {
    v.tokens.push_back(byte_symbol(b));
    v.types.push_back(TokenType::normal);
  }
  for (const std::string& e : extra) {
    std::string spelled;
    for (char c : e) spelled += byte_symbol(static_cast<uint8_t>(c));
    v.tokens.push_back(spelled);
    v.types.push_back(TokenType::normal);
  }
  for (const auto& [text, type] : specials) {
    v.tokens.push_back(text);
    v.types.push_back(type);
  }
  // Merges are given as raw (left, right) bytes; spell each side in the byte alphabet.
  const auto spell = [](const std::string& raw) {
    std::string out;
    for (char c : raw) out += byte_symbol(static_cast<uint8_t>(c));
    return out;
  };
  for (const auto& [left, right] : merges) v.merges.push_back(spell(left) + " " + spell(right));
  v.pre = pre;
  v.add_bos = false;
  v.source = "tiny";
  return v;
}

Ids bytes_of(const std::string& s) {
  Ids ids;
  for (char c : s) ids.push_back(static_cast<uint8_t>(c));
  return ids;
}

}  // namespace

TEST_CASE("bpe: merges apply by rank, leftmost first on equal ranks") {
  {  // "b c" outranks "a b"
    const auto tok = Tokenizer::make_bpe(tiny_vocab({"ab", "bc"}, {{"b", "c"}, {"a", "b"}}));
    CHECK(tok->encode("abc", false) == Ids{'a', 257});
  }
  {  // "a b" outranks "b c"
    const auto tok = Tokenizer::make_bpe(tiny_vocab({"ab", "bc"}, {{"a", "b"}, {"b", "c"}}));
    CHECK(tok->encode("abc", false) == Ids{256, 'c'});
  }
  {  // merges chain: "a b" then "ab c"; a merge result takes part in later merges
    const auto tok = Tokenizer::make_bpe(tiny_vocab({"ab", "abc"}, {{"a", "b"}, {"ab", "c"}}));
    CHECK(tok->encode("abc", false) == Ids{257});
    CHECK(tok->encode("abcab", false) == Ids{257, 256});
    CHECK(tok->decode(Ids{257, 256}) == "abcab");
  }
  {  // a later-ranked merge whose left part only appears after an earlier one
    const auto tok = Tokenizer::make_bpe(
        tiny_vocab({"aa", "aaa", "aaaa"}, {{"a", "a"}, {"aa", "a"}, {"aa", "aa"}}));
    CHECK(tok->encode("aa", false) == Ids{256});
    CHECK(tok->encode("aaa", false) == Ids{257});          // (aa)a, then "aa a"
    CHECK(tok->encode("aaaa", false) == Ids{258});         // (aa)(aa): every "a a" before "aa a"
    CHECK(tok->encode("aaaaa", false) == Ids{256, 257});   // (aa)(aa)a -> (aa)(aaa)
    CHECK(tok->encode("aaaaaa", false) == Ids{258, 256});  // (aa)(aa)(aa) -> leftmost "aa aa"
  }
  {  // no merges at all: one token per byte
    const auto tok = Tokenizer::make_bpe(tiny_vocab({}, {}));
    CHECK(tok->encode("hello", false) == bytes_of("hello"));
  }
}

TEST_CASE("bpe: the byte alphabet (bytes_to_unicode) for unusual bytes") {
  const auto tok = Tokenizer::make_bpe(tiny_vocab({" \x01"}, {{" ", "\x01"}}));
  // Spellings: 0x00 -> U+0100 "Ā", ' ' -> U+0120 "Ġ", 0x7F -> U+0121, 0xAD -> U+0143 (the
  // last one), '!' and 0xFF unchanged.
  CHECK(tok->token_text(0x00) == "\xC4\x80");
  CHECK(tok->token_text(' ') == "\xC4\xA0");
  CHECK(tok->token_text(0x7F) == "\xC4\xA1");
  CHECK(tok->token_text(0xAD) == "\xC5\x83");
  CHECK(tok->token_text('!') == "!");
  CHECK(tok->token_text(0xFF) == "\xC3\xBF");
  // Control characters and a lone 0xFF byte encode as their byte tokens and decode back.
  const std::string s("\x00\x01\x7F\t", 4);
  CHECK(tok->encode(s, false) == bytes_of(s));
  CHECK(tok->encode("\xFF", false) == Ids{0xFF});
  CHECK(tok->encode(" \x01", false) == Ids{256});     // one piece " ?[^\s\p{L}\p{N}]+", merged
  CHECK(tok->token_text(256) == "\xC4\xA0\xC4\x81");  // "Ġā"
  for (int b = 0; b < 256; ++b) CHECK(tok->token_to_piece(b) == std::string(1, char(b)));
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  CHECK(tok->decode(tok->encode(all, false)) == all);
}

TEST_CASE("bpe: empty input, BOS/EOS") {
  VocabData v =
      tiny_vocab({}, {}, "qwen2", {{"<s>", TokenType::control}, {"</s>", TokenType::control}});
  {
    const auto tok = Tokenizer::make_bpe(v);
    CHECK(tok->encode("", false).empty());
    CHECK(tok->encode("", true).empty());  // no BOS id
    CHECK(tok->decode(Ids{}).empty());
  }
  v.bos_id = 256;
  v.eos_id = 257;
  {
    const auto tok = Tokenizer::make_bpe(v);  // add_bos = false in the vocabulary
    CHECK(tok->encode("a", true) == Ids{'a'});
    CHECK(tok->is_eog(257));
  }
  v.add_bos = true;
  v.add_eos = true;
  {
    const auto tok = Tokenizer::make_bpe(v);
    CHECK(tok->encode("", true) == Ids{256, 257});
    CHECK(tok->encode("a", true) == Ids{256, 'a', 257});
    CHECK(tok->encode("a", false) == Ids{'a'});
    CHECK(tok->decode(Ids{256, 'a', 257}) == "a");
  }
}

TEST_CASE("bpe: ill-formed UTF-8 becomes one piece per byte") {
  // Merges across the bad byte would need the pieces to be joined: they must not be.
  const auto tok = Tokenizer::make_bpe(tiny_vocab({"ab",
                                                   "\xFF"
                                                   "b"},
                                                  {{"a", "b"}, {"\xFF", "b"}}));
  CHECK(tok->encode("ab", false) == Ids{256});
  CHECK(tok->encode("a\xFF"
                    "b",
                    false) == Ids{'a', 0xFF, 'b'});
  // A truncated sequence at the end, a stray continuation byte, an overlong form.
  for (const std::string& s : {std::string("ab\xE6\x97"),
                               std::string("\x80"
                                           "ab"),
                               std::string("\xC0\xAF"
                                           "ab"),
                               std::string("\xED\xA0\x80")}) {
    INFO("bytes: ", berth::utf8::sanitize(s));
    const Ids ids = tok->encode(s, false);
    CHECK(tok->decode(ids) == s);
  }
  CHECK(tok->encode("\x80"
                    "ab",
                    false) == Ids{0x80, 256});
}

TEST_CASE("bpe: pre-tokenizers split where their published regexes say") {
  // Digits: qwen2 one per piece, llama-bpe and deepseek-v3 up to three, gpt-2 whole runs.
  const std::vector<std::string> extra = {"12", "34", "#i", "ab", "abc"};
  const Merges merges = {{"1", "2"}, {"3", "4"}, {"#", "i"}, {"a", "b"}};
  const auto qwen = Tokenizer::make_bpe(tiny_vocab(extra, merges, "qwen2"));
  const auto llama = Tokenizer::make_bpe(tiny_vocab(extra, merges, "llama-bpe"));
  const auto ds = Tokenizer::make_bpe(tiny_vocab(extra, merges, "deepseek-v3"));
  const auto gpt2 = Tokenizer::make_bpe(tiny_vocab(extra, merges, "gpt-2"));
  const auto dflt = Tokenizer::make_bpe(tiny_vocab(extra, merges, "default"));
  CHECK(qwen->encode("12345", false) == bytes_of("12345"));
  CHECK(llama->encode("12345", false) == Ids{256, '3', '4', '5'});  // "123" "45"
  CHECK(ds->encode("12345", false) == Ids{256, '3', '4', '5'});
  CHECK(gpt2->encode("12345", false) == Ids{256, 257, '5'});  // one piece "12345"
  CHECK(dflt->encode("12345", false) == gpt2->encode("12345", false));
  // qwen2 and deepseek-v3 keep one leading mark with the letters after it; gpt-2 splits.
  const Ids hash_include = {258, 'n', 'c', 'l', 'u', 'd', 'e'};
  CHECK(ds->encode("#include", false) == hash_include);
  CHECK(qwen->encode("#include", false) == hash_include);
  CHECK(llama->encode("#include", false) == hash_include);
  CHECK(gpt2->encode("#include", false) == bytes_of("#include"));
  // ... but deepseek-v3 only a mark before ASCII letters: "#é" is "#" | "é" there.
  CHECK(ds->encode("#\xC3\xA9", false) == bytes_of("#\xC3\xA9"));
  {  // deepseek-v3 isolates CJK runs first: "ab日本" is "ab" | "日本"; for qwen2 one word
    const Merges m = {{"b", "\xE6"}, {"a", "b"}};
    const auto ds_cjk = Tokenizer::make_bpe(tiny_vocab({"b\xE6", "ab"}, m, "deepseek-v3"));
    const auto qwen_cjk = Tokenizer::make_bpe(tiny_vocab({"b\xE6", "ab"}, m, "qwen2"));
    const std::string nihon = "\xE6\x97\xA5\xE6\x9C\xAC";  // "日本"
    Ids split = {257};
    for (int32_t b : bytes_of(nihon)) split.push_back(b);
    CHECK(ds_cjk->encode("ab" + nihon, false) == split);
    Ids joined = {'a', 256};
    for (int32_t b : bytes_of(nihon.substr(1))) joined.push_back(b);
    CHECK(qwen_cjk->encode("ab" + nihon, false) == joined);
  }
  // Contractions: "'s" is a piece in all; qwen2 and llama-bpe ignore case there, gpt-2 not.
  const auto q2 = Tokenizer::make_bpe(tiny_vocab({"'S"}, {{"'", "S"}}, "qwen2"));
  const auto g2 = Tokenizer::make_bpe(tiny_vocab({"'S"}, {{"'", "S"}}, "gpt-2"));
  CHECK(q2->encode("IT'S", false) == Ids{'I', 'T', 256});
  CHECK(g2->encode("IT'S", false) == Ids{'I', 'T', '\'', 'S'});  // "IT" "'" "S"
  // Spaces: a run before a word leaves its last space to the word.
  const auto sp = Tokenizer::make_bpe(tiny_vocab({"  ", " a"}, {{" ", " "}, {" ", "a"}}, "qwen2"));
  CHECK(sp->encode("   a", false) == Ids{256, 257});
  // llama-bpe takes a piece that is a whole token first (ignore_merges): "abc" is a token but
  // no merge reaches it.
  CHECK(llama->encode("abc", false) == Ids{260});
  CHECK(qwen->encode("abc", false) == Ids{259, 'c'});
}

TEST_CASE("bpe: qwen35 keeps combining marks in words (handwritten cases)") {
  // qwen35's pattern (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35) differs from qwen2's only in
  // \p{M}: letter runs are [\p{L}\p{M}]+ and punctuation runs exclude marks. Each case has a
  // merge that crosses a qwen2 piece boundary, so the ids show where each one splits.
  const std::string acute = "\xCC\x81";  // U+0301 COMBINING ACUTE ACCENT
  {
    const std::vector<std::string> extra = {"e\xCC", "e\xCC\x81"};
    const Merges m = {{"e", "\xCC"}, {"e\xCC", "\x81"}};
    const auto q35 = Tokenizer::make_bpe(tiny_vocab(extra, m, "qwen35"));
    const auto q2 = Tokenizer::make_bpe(tiny_vocab(extra, m, "qwen2"));
    // "é" spelled e + U+0301: one word for qwen35; for qwen2 the letter, then the mark.
    CHECK(q35->encode("e" + acute, false) == Ids{257});
    CHECK(q2->encode("e" + acute, false) == Ids{'e', 0xCC, 0x81});
    // Inside a word: qwen2 splits "cafe" | U+0301 "s" (the mark as a word's prefix character).
    CHECK(q35->encode("cafe" + acute + "s", false) == Ids{'c', 'a', 'f', 257, 's'});
    CHECK(q2->encode("cafe" + acute + "s", false) == Ids{'c', 'a', 'f', 'e', 0xCC, 0x81, 's'});
    CHECK(q35->decode(q35->encode("cafe" + acute + "s", false)) == "cafe" + acute + "s");
  }
  {
    // Devanagari "हि": HA (Lo) + vowel sign I (Mc). qwen2: "ह" | "ि"; qwen35: one word.
    const std::string ha = "\xE0\xA4\xB9", sign_i = "\xE0\xA4\xBF";
    const std::vector<std::string> extra = {"\xE0\xA4", ha, ha + "\xE0\xA4", ha + sign_i};
    const Merges m = {
        {"\xE0", "\xA4"}, {"\xE0\xA4", "\xB9"}, {ha, "\xE0\xA4"}, {ha + "\xE0\xA4", "\xBF"}};
    const auto q35 = Tokenizer::make_bpe(tiny_vocab(extra, m, "qwen35"));
    const auto q2 = Tokenizer::make_bpe(tiny_vocab(extra, m, "qwen2"));
    CHECK(q35->encode(ha + sign_i, false) == Ids{259});
    CHECK(q2->encode(ha + sign_i, false) == Ids{257, 256, 0xBF});
  }
  {
    // A mark after punctuation: qwen2's punctuation run takes it ("..́"); qwen35's stops at
    // it and the mark starts a word of its own.
    const Merges m = {{".", "."}, {"..", "\xCC"}};
    const std::vector<std::string> extra = {"..", "..\xCC"};
    const auto q35 = Tokenizer::make_bpe(tiny_vocab(extra, m, "qwen35"));
    const auto q2 = Tokenizer::make_bpe(tiny_vocab(extra, m, "qwen2"));
    CHECK(q35->encode(".." + acute, false) == Ids{256, 0xCC, 0x81});
    CHECK(q2->encode(".." + acute, false) == Ids{257, 0x81});
  }
  {
    // Contractions of either case are pieces ((?i:...)), as for qwen2; digits one per piece.
    const Merges m = {{"'", "T"}, {"'", "t"}, {"1", "2"}};
    const auto q35 = Tokenizer::make_bpe(tiny_vocab({"'T", "'t", "12"}, m, "qwen35"));
    CHECK(q35->encode("DON'T", false) == Ids{'D', 'O', 'N', 256});
    CHECK(q35->encode("don't", false) == Ids{'d', 'o', 'n', 257});
    CHECK(q35->encode("12", false) == Ids{'1', '2'});
    // Spaces as qwen2: a run before a word leaves its last space to the word.
    const auto sp =
        Tokenizer::make_bpe(tiny_vocab({"  ", " a"}, {{" ", " "}, {" ", "a"}}, "qwen35"));
    CHECK(sp->encode("   a", false) == Ids{256, 257});
  }
}

TEST_CASE("bpe: special tokens") {
  const auto tok = Tokenizer::make_bpe(tiny_vocab({"ab"}, {{"a", "b"}}, "qwen2",
                                                  {{"<|e", TokenType::control},
                                                   {"<|end|>", TokenType::control},
                                                   {"<x>", TokenType::user_defined}}));
  const int32_t e_short = 257, end = 258, x = 259;
  CHECK(tok->encode("ab<|end|>ab", false, true) == Ids{256, end, 256});
  CHECK(tok->encode("<|e<|end|>", false, true) == Ids{e_short, end});  // longest match first
  CHECK(tok->encode("a<x>b", false, true) == Ids{'a', x, 'b'});
  CHECK(tok->encode("ab<|end|>", false, false) == Ids{256, '<', '|', 'e', 'n', 'd', '|', '>'});
  CHECK(tok->encode("a<x>b", false, false) == Ids{'a', x, 'b'});  // user-defined: always
  CHECK(tok->token_to_piece(end).empty());
  CHECK(tok->token_to_piece(end, true) == "<|end|>");
  CHECK(tok->token_to_piece(x) == "<x>");
  CHECK(tok->decode(Ids{256, end, x}) == "ab<x>");
}

TEST_CASE("bpe: validation errors") {
  check_error([] { Tokenizer::make_bpe(tiny_vocab({}, {}, "gpt-4o")); }, ErrorCategory::unsupported,
              "'gpt-4o' is not supported (supported: qwen2");
  {
    VocabData v = tiny_vocab({"ab"}, {});
    v.merges = {"ab"};
    check_error([&] { Tokenizer::make_bpe(v); }, ErrorCategory::format,
                "tokenizer.ggml.merges[0] = 'ab' is not of the form 'left right'");
  }
  {
    VocabData v = tiny_vocab({"ab"}, {{"a", "b"}});
    v.merges.push_back("a  b");
    check_error([&] { Tokenizer::make_bpe(v); }, ErrorCategory::format,
                "tokenizer.ggml.merges[1] = 'a  b'");
    v.merges.back() = "a b ";
    check_error([&] { Tokenizer::make_bpe(v); }, ErrorCategory::format, "merges[1]");
    v.merges.back() = "b c";  // "bc" is not a token
    check_error([&] { Tokenizer::make_bpe(v); }, ErrorCategory::format, "'bc' is not in");
    v.merges.back() = "zz b";
    check_error([&] { Tokenizer::make_bpe(v); }, ErrorCategory::format, "'zz' is not in");
  }
  {
    VocabData v = tiny_vocab({}, {});
    v.types.pop_back();
    check_error([&] { Tokenizer::make_bpe(v); }, ErrorCategory::format,
                "tokenizer.ggml.token_type");
  }
  {
    VocabData v = tiny_vocab({}, {});
    v.eos_id = 256;
    check_error([&] { Tokenizer::make_bpe(v); }, ErrorCategory::format,
                "tokenizer.ggml.eos_token_id");
  }
  check_error([] { Tokenizer::make_bpe(VocabData{}); }, ErrorCategory::format, "empty");
  {  // a vocabulary without the symbol of byte 'z': unsupported, or the unknown token
    VocabData v = tiny_vocab({}, {});
    v.tokens['z'] = "<unk>";
    v.types['z'] = TokenType::unknown;
    const auto no_unk = Tokenizer::make_bpe(v);
    check_error([&] { no_unk->encode("az", false); }, ErrorCategory::unsupported, "0x7A");
    v.unk_id = 'z';
    const auto with_unk = Tokenizer::make_bpe(v);
    CHECK(with_unk->encode("az", false) == Ids{'a', 'z'});
    CHECK(with_unk->token_to_piece('z') == berth::utf8::kReplacement);
  }
}

// ---- tokenizer.json reader on handcrafted files ----

namespace {

std::string write_json(const std::string& name, const std::string& text) {
  const auto path = berth::test::temp_dir("bpe") / name;
  std::ofstream(path) << text;
  return path.string();
}

/// A minimal byte-level tokenizer.json: vocab "a" b" "ab" (0..2), merges as given.
std::string mini_json(const std::string& merges, const std::string& vocab_extra = "",
                      const std::string& added = "[]", const std::string& regex = "\\\\s+") {
  return R"({"added_tokens": )" + added +
         R"(, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
             {"type": "Split", "pattern": {"Regex": ")" +
         regex + R"("}, "behavior": "Isolated"},
             {"type": "ByteLevel"}]},
           "decoder": {"type": "ByteLevel"},
           "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2)" +
         vocab_extra + R"(}, "merges": )" + merges + "}}";
}

}  // namespace

TEST_CASE("read_hf_tokenizer_json: handcrafted files") {
  {  // pair merges and string merges read the same
    const VocabData pairs =
        berth::read_hf_tokenizer_json(write_json("p.json", mini_json(R"([["a", "b"]])")));
    const VocabData strings =
        berth::read_hf_tokenizer_json(write_json("s.json", mini_json(R"(["a b"])")));
    CHECK(pairs.merges == std::vector<std::string>{"a b"});
    CHECK(strings.merges == pairs.merges);
    CHECK(pairs.tokens == std::vector<std::string>{"a", "b", "ab"});
    CHECK(pairs.pre == "default");  // an unrecognised regex
  }
  {  // added tokens: special -> control, else user_defined; may repeat a vocab entry
    const VocabData v = berth::read_hf_tokenizer_json(
        write_json("added.json", mini_json(R"(["a b"])", "",
                                           R"([{"id": 3, "content": "<|x|>", "special": true},
                      {"id": 4, "content": "<y>", "special": false},
                      {"id": 2, "content": "ab", "special": false}])")));
    CHECK(v.tokens == std::vector<std::string>{"a", "b", "ab", "<|x|>", "<y>"});
    CHECK(v.types == std::vector<TokenType>{TokenType::normal, TokenType::normal,
                                            TokenType::user_defined, TokenType::control,
                                            TokenType::user_defined});
  }
  {  // Qwen2's regex is recognised
    const std::string qwen_regex =
        R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+)";
    const VocabData v = berth::read_hf_tokenizer_json(
        write_json("q.json", mini_json(R"(["a b"])", "", "[]", qwen_regex)));
    CHECK(v.pre == "qwen2");
  }
  check_error(
      [] {
        berth::read_hf_tokenizer_json(write_json(
            "gap.json",
            mini_json("[]", R"(, "c": 4)", R"([{"id": 4, "content": "c", "special": false}])")));
      },
      ErrorCategory::format, "id 3 is in neither");
  check_error(
      [] {
        berth::read_hf_tokenizer_json(
            write_json("far.json", mini_json("[]", R"(, "c": 1000000000)")));
      },
      ErrorCategory::format, "model.vocab['c']: id 1000000000 is outside [0, 4)");
  check_error(
      [] { berth::read_hf_tokenizer_json(write_json("dup.json", mini_json("[]", R"(, "c": 2)"))); },
      ErrorCategory::format, "id 2 is given to both");
  check_error([] { berth::read_hf_tokenizer_json(write_json("m.json", mini_json(R"([["a"]])"))); },
              ErrorCategory::format, "model.merges[0]");
  check_error([] { berth::read_hf_tokenizer_json(write_json("bad.json", "{\"model\": ")); },
              ErrorCategory::format, "not valid JSON");
  check_error(
      [] {
        berth::read_hf_tokenizer_json(
            write_json("wp.json", R"({"model": {"type": "WordPiece", "vocab": {}}})"));
      },
      ErrorCategory::format, "model.type");
  check_error([] { berth::read_hf_tokenizer_json("/nonexistent/tokenizer.json"); },
              ErrorCategory::io, "/nonexistent/tokenizer.json");
}

// ---- GGUF round trip ----

namespace {

berth::gguf::Writer qwen3_gguf() {
  const VocabData& v = qwen3().vocab;
  berth::gguf::Writer w;
  w.set_string("general.architecture", "qwen3");
  w.set_string("tokenizer.ggml.model", "gpt2");
  w.set_string("tokenizer.ggml.pre", "qwen2");
  w.set_string_array("tokenizer.ggml.tokens", v.tokens);
  std::vector<int32_t> types;
  for (TokenType t : v.types) types.push_back(static_cast<int32_t>(t));
  w.set_i32_array("tokenizer.ggml.token_type", types);
  w.set_string_array("tokenizer.ggml.merges", v.merges);
  w.set_u32("tokenizer.ggml.eos_token_id", kImEnd);
  w.set_u32("tokenizer.ggml.padding_token_id", kQwenFirstAdded);
  w.set_bool("tokenizer.ggml.add_bos_token", false);
  return w;
}

}  // namespace

TEST_CASE("bpe from_gguf: Qwen3 vocabulary written to a GGUF file and read back") {
  const auto path = (berth::test::temp_dir("bpe-gguf") / "qwen3-vocab.gguf").string();
  qwen3_gguf().write(path);
  const auto file = berth::gguf::File::open(path);
  const auto tok = Tokenizer::from_gguf(file);
  CHECK(tok->n_vocab() == 151669);
  CHECK(tok->bos_id() == -1);
  CHECK(tok->eos_id() == kImEnd);
  CHECK_FALSE(tok->add_bos());
  CHECK(tok->is_eog(kImEnd));
  CHECK(tok->is_eog(kQwenFirstAdded));  // "<|endoftext|>" by its text
  for (const Reference& r : references()) {
    INFO("text: ", r.text);
    CHECK(tok->encode(r.text, true, true) == r.ids);
    CHECK(tok->decode(tok->encode(r.text, false, false)) == r.text);
  }
  std::filesystem::remove(path);
}

TEST_CASE("bpe from_gguf: keys, defaults and errors") {
  const auto tiny = [](const std::string& pre) {
    const VocabData v = tiny_vocab({"ab"}, {{"a", "b"}});
    berth::gguf::Writer w;
    w.set_string("tokenizer.ggml.model", "gpt2");
    if (!pre.empty()) w.set_string("tokenizer.ggml.pre", pre);
    w.set_string_array("tokenizer.ggml.tokens", v.tokens);
    w.set_string_array("tokenizer.ggml.merges", v.merges);
    return w;
  };
  const auto load = [](const berth::gguf::Writer& w) {
    return Tokenizer::from_gguf(berth::gguf::File::from_memory(w.to_bytes(), "tiny.gguf"));
  };
  {  // no pre: GPT-2's pattern; no token_type: all normal; no special ids
    const auto tok = load(tiny(""));
    CHECK(tok->encode(" ab", true) == Ids{' ', 256});  // gpt-2: " ?\p{L}+" keeps the space
    CHECK(tok->bos_id() == -1);
    CHECK(tok->eos_id() == -1);
    CHECK_FALSE(tok->add_bos());
  }
  {
    auto w = tiny("qwen2");
    w.set_u32("tokenizer.ggml.bos_token_id", 'a');
    w.set_bool("tokenizer.ggml.add_bos_token", true);
    const auto tok = load(w);
    CHECK(tok->encode("ab", true) == Ids{'a', 256});
  }
  check_error([&] { load(tiny("nonsense")); }, ErrorCategory::unsupported, "'nonsense'");
  {
    auto w = tiny("qwen2");
    w.set_string_array("tokenizer.ggml.merges", {"a b", "ab"});
    check_error([&] { load(w); }, ErrorCategory::format, "tokenizer.ggml.merges[1] = 'ab'");
  }
  {
    auto w = tiny("qwen2");
    w.set_i32_array("tokenizer.ggml.token_type", {1, 1});
    check_error([&] { load(w); }, ErrorCategory::format, "tokenizer.ggml.token_type");
  }
  {
    berth::gguf::Writer w;
    w.set_string("tokenizer.ggml.model", "gpt2");
    w.set_string_array("tokenizer.ggml.tokens", {"a"});
    bool thrown = false;
    try {
      load(w);
    } catch (const berth::gguf::GgufError& e) {
      thrown = true;
      CHECK(e.code() == berth::gguf::Errc::missing_key);
      CHECK(std::string(e.what()).find("tokenizer.ggml.merges") != std::string::npos);
    }
    CHECK(thrown);
  }
}
