#include "tokenizer_bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fmt/format.h>
#include <pcre2.h>

#include <algorithm>
#include <utility>

#include "berth/core/error.h"
#include "berth/core/strings.h"
#include "berth/models/utf8.h"

namespace berth {
namespace {

// clang-format off
// Pre-tokenizer regexes, exactly as the Split patterns of the published tokenizer.json files
// spell them (after JSON unescaping), so that read_hf_tokenizer_json can recognise them.
const std::vector<std::string> kQwen2 = {
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"};
// Qwen3.5 (tokenizer.ggml.pre "qwen35"): Qwen2's pattern with combining marks in words, letter
// runs [\p{L}\p{M}]+ and punctuation runs [^\s\p{L}\p{M}\p{N}]+ (the Split pattern of the
// Qwen3.5 tokenizer.json as llama.cpp / ik_llama.cpp quote it in llama-vocab.cpp). Contractions
// match either case in both patterns ((?i:...)).
const std::vector<std::string> kQwen35 = {
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"};
const std::vector<std::string> kLlama3 = {
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"};
// DeepSeek-V3: digits in groups of up to three, runs of CJK ideographs (U+4E00..U+9FA5) and
// kana (U+3040..U+309F, U+30A0..U+30FF), then a GPT-4o-like pattern. The third pattern holds
// CR and LF as the characters themselves (the JSON file writes them "\r\n"), not as escapes.
const std::vector<std::string> kDeepSeekV3 = {
    R"(\p{N}{1,3})",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"};
// GPT-2 (openai/gpt-2 src/encoder.py).
const std::vector<std::string> kGpt2 = {
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)"};
// clang-format on

/// GPT-2's bytes_to_unicode (openai/gpt-2 src/encoder.py): the bytes '!'..'~', 0xA1..0xAC and
/// 0xAE..0xFF stand for themselves (as code points); the other 68 bytes, in increasing order,
/// map to U+0100, U+0101, ... (so ' ' -> U+0120 'Ġ', '\n' -> U+010A 'Ċ').
struct ByteAlphabet {
  std::array<char32_t, 256> to_cp{};
  std::array<int16_t, 0x144> to_byte{};  // code point -> byte, -1 where none
  std::array<std::string, 256> utf8;     // each byte's symbol, UTF-8 encoded

  ByteAlphabet() {
    to_byte.fill(-1);
    char32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      to_cp[b] = printable ? static_cast<char32_t>(b) : next++;
      to_byte[to_cp[b]] = static_cast<int16_t>(b);
      utf8::append(utf8[b], to_cp[b]);
    }
  }
};

const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  const int n = pcre2_get_error_message(code, buf, sizeof buf);
  return n < 0 ? fmt::format("PCRE2 error {}", code)
               : std::string(reinterpret_cast<const char*>(buf), static_cast<size_t>(n));
}

/// Merge-map key of a (left, right) token pair.
uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

}  // namespace

const std::vector<std::string>* bpe_pre_regexes(std::string_view pre) {
  if (pre == "qwen2") return &kQwen2;
  if (pre == "qwen35") return &kQwen35;
  if (pre == "llama-bpe") return &kLlama3;
  if (pre == "deepseek-v3") return &kDeepSeekV3;
  if (pre == "default" || pre == "gpt-2") return &kGpt2;
  return nullptr;
}

std::string_view bpe_supported_pres() {
  return "qwen2, qwen35, llama-bpe, deepseek-v3, default, gpt-2";
}

/// A compiled pattern: UTF + UCP, JIT-compiled when the library supports it.
struct BpeTokenizer::Regex {
  pcre2_code* code = nullptr;

  Regex(const std::string& pattern, const std::string& pre) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                         PCRE2_UTF | PCRE2_UCP, &err, &offset, nullptr);
    if (code == nullptr) {
      throw Error(ErrorCategory::internal,
                  fmt::format("BPE pre-tokenizer '{}': regex does not compile at offset {}: {}",
                              pre, offset, pcre2_message(err)));
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // failure (no JIT): the interpreter runs
  }
  ~Regex() { pcre2_code_free(code); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
};

/// Scratch state of one encode() call (so that concurrent calls share nothing mutable).
struct BpeTokenizer::Workspace {
  /// A symbol of the merge loop: a token id (-1: a byte without token) in a linked list.
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
  };
  /// A candidate merge of symbols `left` and `right` (adjacent when pushed) into `id`.
  struct Candidate {
    int32_t rank;
    int32_t left;
    int32_t right;
    int32_t left_id;
    int32_t right_id;
    int32_t id;
  };
  /// Heap order: lowest rank on top; on equal ranks the leftmost pair.
  static bool after(const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.left > b.left;
  }

  pcre2_match_data* match = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  std::vector<Symbol> symbols;
  std::vector<Candidate> heap;
  std::string mapped;

  Workspace() {
    match = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    if (match == nullptr || context == nullptr) {
      release();
      throw Error(ErrorCategory::out_of_memory, "BPE tokenizer: PCRE2 match data allocation");
    }
    // The JIT's default 32 KiB stack suffices for the known patterns; a larger one (grown on
    // demand up to 1 MiB) is headroom. Without JIT support (nullptr) the interpreter runs, which
    // keeps its backtracking state on the heap.
    jit_stack = pcre2_jit_stack_create(32 * 1024, 1024 * 1024, nullptr);
    if (jit_stack != nullptr) pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~Workspace() { release(); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  void release() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(match);
    jit_stack = nullptr;
    context = nullptr;
    match = nullptr;
  }
};

BpeTokenizer::~BpeTokenizer() = default;

BpeTokenizer::BpeTokenizer(VocabData vocab) {
  check_vocab(vocab);
  const std::string& src = vocab.source;

  pre_ = vocab.pre.empty() ? std::string("default") : vocab.pre;
  const std::vector<std::string>* patterns = bpe_pre_regexes(pre_);
  if (patterns == nullptr) {
    throw Error(ErrorCategory::unsupported,
                fmt::format("{}: tokenizer.ggml.pre '{}' is not supported (supported: {})", src,
                            printable(pre_), bpe_supported_pres()));
  }
  for (const std::string& p : *patterns) regexes_.push_back(std::make_unique<Regex>(p, pre_));
  ignore_merges_ = pre_ == "llama-bpe";

  adopt_vocab(vocab);
  add_space_prefix_ = false;  // byte-level BPE encodes spaces as they are

  const ByteAlphabet& abc = alphabet();
  for (int b = 0; b < 256; ++b) byte_ids_[b] = find_token(abc.utf8[b]);

  merges_.reserve(vocab.merges.size());
  std::string merged;
  for (size_t k = 0; k < vocab.merges.size(); ++k) {
    const std::string& m = vocab.merges[k];
    const size_t space = m.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 == m.size() ||
        m.find(' ', space + 1) != std::string::npos) {
      throw Error(ErrorCategory::format,
                  fmt::format("{}: tokenizer.ggml.merges[{}] = '{}' is not of the form "
                              "'left right' (two non-empty tokens and one space)",
                              src, k, printable(m)));
    }
    const std::string_view left(m.data(), space);
    const std::string_view right(m.data() + space + 1, m.size() - space - 1);
    merged.assign(left);
    merged.append(right);
    const int32_t l = find_token(left);
    const int32_t r = find_token(right);
    const int32_t id = find_token(merged);
    if (l < 0 || r < 0 || id < 0) {
      throw Error(ErrorCategory::format,
                  fmt::format("{}: tokenizer.ggml.merges[{}] = '{}': '{}' is not in "
                              "tokenizer.ggml.tokens",
                              src, k, printable(m),
                              printable(l < 0   ? left
                                        : r < 0 ? right
                                                : std::string_view(merged))));
    }
    merges_.try_emplace(pair_key(l, r), Merge{static_cast<int32_t>(k), id});  // first rank wins
  }

  for (size_t i = 0; i < tokens_.size(); ++i) {
    const TokenType t = types_[i];
    const std::string& text = tokens_[i];
    if (text.empty()) continue;
    if (t == TokenType::control || t == TokenType::user_defined || t == TokenType::unknown) {
      specials_[static_cast<uint8_t>(text[0])].push_back({text, static_cast<int32_t>(i)});
    }
  }
  for (auto& v : specials_) {
    std::sort(v.begin(), v.end(), [](const Special& a, const Special& b) {
      return a.text.size() != b.text.size() ? a.text.size() > b.text.size() : a.id < b.id;
    });
  }
}

const BpeTokenizer::Merge* BpeTokenizer::find_merge(int32_t left, int32_t right) const {
  if (left < 0 || right < 0) return nullptr;
  const auto it = merges_.find(pair_key(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

const BpeTokenizer::Special* BpeTokenizer::match_special(std::string_view text, size_t pos,
                                                         bool parse_special) const {
  const std::string_view rest = text.substr(pos);
  for (const Special& s : specials_[static_cast<uint8_t>(text[pos])]) {
    if (!parse_special && types_[static_cast<size_t>(s.id)] != TokenType::user_defined) continue;
    if (rest.starts_with(s.text)) return &s;
  }
  return nullptr;
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text, bool add_bos,
                                          bool parse_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 2);
  if (add_bos && add_bos_ && bos_id_ >= 0) out.push_back(bos_id_);
  Workspace ws;
  {
    size_t plain_begin = 0;
    for (size_t pos = 0; pos < text.size();) {
      const Special* s = match_special(text, pos, parse_special);
      if (s == nullptr) {
        ++pos;
        continue;
      }
      encode_plain(text.substr(plain_begin, pos - plain_begin), out, ws);
      out.push_back(s->id);
      pos += s->text.size();
      plain_begin = pos;
    }
    encode_plain(text.substr(plain_begin), out, ws);
  }
  if (add_bos && add_eos_ && eos_id_ >= 0) out.push_back(eos_id_);
  return out;
}

void BpeTokenizer::encode_plain(std::string_view text, std::vector<int32_t>& out,
                                Workspace& ws) const {
  // Well-formed runs go through the regexes; each byte of an ill-formed (or truncated)
  // sequence is a piece of its own.
  size_t run_begin = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const utf8::Unit u = utf8::next_unit(text, pos);
    if (u.status == utf8::Status::ok) {
      pos += u.length;
      continue;
    }
    if (pos > run_begin) split_and_encode(text.substr(run_begin, pos - run_begin), 0, out, ws);
    for (size_t i = 0; i < u.length; ++i) encode_piece(text.substr(pos + i, 1), out, ws);
    pos += u.length;
    run_begin = pos;
  }
  if (pos > run_begin) split_and_encode(text.substr(run_begin, pos - run_begin), 0, out, ws);
}

void BpeTokenizer::split_and_encode(std::string_view text, size_t level, std::vector<int32_t>& out,
                                    Workspace& ws) const {
  if (level == regexes_.size()) {
    encode_piece(text, out, ws);
    return;
  }
  const pcre2_code* code = regexes_[level]->code;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t gap_begin = 0;  // start of the text not matched yet
  size_t start = 0;
  while (start < text.size()) {
    const int rc =
        pcre2_match(code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, ws.match, ws.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      throw Error(ErrorCategory::internal,
                  fmt::format("BPE pre-tokenizer '{}': regex {} failed at byte {}: {}", pre_, level,
                              start, pcre2_message(rc)));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(ws.match);
    const size_t m_begin = ov[0];
    const size_t m_end = ov[1];
    if (m_end == m_begin) {  // an empty match (none of the known patterns has one): skip a char
      if (m_begin >= text.size()) break;
      start = m_begin + utf8::next_unit(text, m_begin).length;
      continue;
    }
    // "Isolated": the text before the match and the match are separate pieces.
    if (m_begin > gap_begin) {
      split_and_encode(text.substr(gap_begin, m_begin - gap_begin), level + 1, out, ws);
    }
    split_and_encode(text.substr(m_begin, m_end - m_begin), level + 1, out, ws);
    gap_begin = start = m_end;
  }
  if (text.size() > gap_begin) split_and_encode(text.substr(gap_begin), level + 1, out, ws);
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out,
                                Workspace& ws) const {
  if (piece.size() == 1) {
    const int32_t id = byte_ids_[static_cast<uint8_t>(piece[0])];
    if (id >= 0) {
      out.push_back(id);
    } else if (unk_id_ >= 0) {
      out.push_back(unk_id_);
    } else {
      no_byte_token(static_cast<uint8_t>(piece[0]));
    }
    return;
  }
  if (ignore_merges_) {
    const ByteAlphabet& abc = alphabet();
    ws.mapped.clear();
    for (char c : piece) ws.mapped += abc.utf8[static_cast<uint8_t>(c)];
    const int32_t id = find_token(ws.mapped);
    if (id >= 0 && types_[id] == TokenType::normal) {
      out.push_back(id);
      return;
    }
  }

  using Symbol = Workspace::Symbol;
  using Candidate = Workspace::Candidate;
  std::vector<Symbol>& sym = ws.symbols;
  std::vector<Candidate>& heap = ws.heap;
  const auto n = static_cast<int32_t>(piece.size());
  sym.resize(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    sym[i] = {byte_ids_[static_cast<uint8_t>(piece[i])], i - 1, i + 1 < n ? i + 1 : -1};
  }
  heap.clear();
  const auto try_pair = [&](int32_t left) {
    if (left < 0) return;
    const int32_t right = sym[left].next;
    if (right < 0) return;
    const Merge* m = find_merge(sym[left].id, sym[right].id);
    if (m == nullptr) return;
    heap.push_back({m->rank, left, right, sym[left].id, sym[right].id, m->id});
    std::push_heap(heap.begin(), heap.end(), Workspace::after);
  };
  for (int32_t i = 0; i + 1 < n; ++i) try_pair(i);

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), Workspace::after);
    const Candidate c = heap.back();
    heap.pop_back();
    Symbol& left = sym[c.left];
    // Stale when either side was merged away or changed since the candidate was pushed.
    if (left.next != c.right || left.id != c.left_id || sym[c.right].id != c.right_id) continue;
    Symbol& right = sym[c.right];
    left.id = c.id;
    left.next = right.next;
    if (right.next >= 0) sym[right.next].prev = c.left;
    right.id = -1;
    right.next = right.prev = -1;
    try_pair(left.prev);
    try_pair(c.left);
  }

  for (int32_t i = 0; i >= 0; i = sym[i].next) {
    const int32_t id = sym[i].id;
    if (id >= 0) {
      out.push_back(id);
    } else if (unk_id_ >= 0) {
      out.push_back(unk_id_);
    } else {
      no_byte_token(static_cast<uint8_t>(piece[i]));
    }
  }
}

void BpeTokenizer::no_byte_token(uint8_t byte) const {
  throw Error(ErrorCategory::unsupported,
              fmt::format("BPE tokenizer: cannot encode byte 0x{:02X}: the vocabulary has no "
                          "token for its byte-level symbol '{}' and no unknown token",
                          byte, alphabet().utf8[byte]));
}

std::string BpeTokenizer::token_to_piece(int32_t id, bool render_special) const {
  if (id < 0 || id >= n_vocab()) {
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("token_to_piece: token id {} is outside [0, {})", id, n_vocab()));
  }
  const std::string& text = tokens_[id];
  switch (types_[id]) {
    case TokenType::control:
      return render_special ? text : std::string();
    case TokenType::unknown:
      return render_special ? text : std::string(utf8::kReplacement);
    case TokenType::user_defined:
      return text;
    default:
      break;
  }
  // Undo the byte-level mapping; a character outside the alphabet (not produced by a
  // byte-level vocabulary) is kept as its UTF-8 bytes.
  const ByteAlphabet& abc = alphabet();
  std::string piece;
  piece.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    const utf8::Unit u = utf8::next_unit(text, pos);
    char32_t cp = 0xFFFFFFFF;
    if (u.status == utf8::Status::ok) {
      const auto b0 = static_cast<uint8_t>(text[pos]);
      if (u.length == 1) {
        cp = b0;
      } else if (u.length == 2) {
        cp = (static_cast<char32_t>(b0 & 0x1F) << 6) | (static_cast<uint8_t>(text[pos + 1]) & 0x3F);
      }
    }
    if (cp < abc.to_byte.size() && abc.to_byte[cp] >= 0) {
      piece.push_back(static_cast<char>(abc.to_byte[cp]));
    } else {
      piece.append(text, pos, u.length);
    }
    pos += u.length;
  }
  return piece;
}

const std::string& gpt2_byte_symbol(uint8_t b) { return alphabet().utf8[b]; }

}  // namespace berth
