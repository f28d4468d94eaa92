#include "tokenizer_spm.h"

#include <fmt/format.h>

#include <algorithm>
#include <queue>

#include "berth/core/error.h"
#include "berth/models/utf8.h"

namespace berth {
namespace {

constexpr std::string_view kSpace = "\xE2\x96\x81";  // U+2581 LOWER ONE EIGHTH BLOCK "▁"

/// The byte a "<0xNN>" token stands for (two uppercase or lowercase hex digits), or -1.
int parse_byte_token(std::string_view text) {
  if (text.size() != 6 || text.substr(0, 3) != "<0x" || text[5] != '>') return -1;
  int value = 0;
  for (size_t i = 3; i < 5; ++i) {
    const char c = text[i];
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (c >= 'A' && c <= 'F') {
      d = c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else {
      return -1;
    }
    value = value * 16 + d;
  }
  return value;
}

/// A symbol of the merge loop: bytes [begin, begin + size) of the fragment, in a doubly linked
/// list of the symbols still alive. size == 0 marks a symbol merged into its left neighbour.
struct Symbol {
  size_t begin;
  size_t size;
  int prev;
  int next;
};

/// A candidate merge of symbol `left` with its right neighbour into a token of `size` bytes.
struct Bigram {
  float score;
  int left;
  size_t size;
};

/// Priority: higher score first; on equal scores the leftmost pair first.
struct BigramLess {
  bool operator()(const Bigram& a, const Bigram& b) const {
    if (a.score != b.score) return a.score < b.score;
    return a.left > b.left;
  }
};

}  // namespace

SpmTokenizer::SpmTokenizer(VocabData vocab) {
  check_vocab(vocab);
  const size_t n = vocab.tokens.size();
  const std::string& src = vocab.source;
  scores_ = std::move(vocab.scores);
  adopt_vocab(vocab);
  add_space_prefix_ = vocab.add_space_prefix;

  byte_ids_.fill(-1);
  byte_value_.assign(n, -1);
  for (size_t i = 0; i < n; ++i) {
    const auto id = static_cast<int32_t>(i);
    const std::string& text = tokens_[i];
    const int byte = parse_byte_token(text);
    switch (types_[i]) {
      case TokenType::byte:
        if (byte < 0) {
          throw Error(ErrorCategory::format,
                      fmt::format("{}: token {} has tokenizer.ggml.token_type byte (6) but its "
                                  "text '{}' is not of the form <0xNN>",
                                  src, id, text));
        }
        byte_value_[i] = static_cast<int16_t>(byte);
        if (byte_ids_[byte] < 0) byte_ids_[byte] = id;
        break;
      case TokenType::normal:
      case TokenType::undefined:
        piece_ids_.emplace(text, id);
        break;
      case TokenType::user_defined:
        piece_ids_.emplace(text, id);
        if (!text.empty()) always_[static_cast<uint8_t>(text[0])].push_back({text, id});
        break;
      case TokenType::control:
      case TokenType::unknown:
        if (!text.empty()) parsed_[static_cast<uint8_t>(text[0])].push_back({text, id});
        break;
      case TokenType::unused:
        break;
      default:
        throw Error(ErrorCategory::format,
                    fmt::format("{}: token {} has tokenizer.ggml.token_type {}, outside 0..6", src,
                                id, static_cast<int32_t>(types_[i])));
    }
  }
  const auto longest_first = [](const Special& a, const Special& b) {
    if (a.text.size() != b.text.size()) return a.text.size() > b.text.size();
    return a.id < b.id;
  };
  for (auto& v : always_) std::sort(v.begin(), v.end(), longest_first);
  for (auto& v : parsed_) std::sort(v.begin(), v.end(), longest_first);
}

int32_t SpmTokenizer::find_piece(std::string_view text) const {
  const auto it = piece_ids_.find(text);
  return it == piece_ids_.end() ? -1 : it->second;
}

const SpmTokenizer::Special* SpmTokenizer::match_special(std::string_view text, size_t pos,
                                                         bool parse_special) const {
  const auto first = static_cast<uint8_t>(text[pos]);
  const std::string_view rest = text.substr(pos);
  const Special* best = nullptr;
  for (const Special& s : always_[first]) {
    if (rest.starts_with(s.text)) {
      best = &s;
      break;
    }
  }
  if (parse_special) {
    for (const Special& s : parsed_[first]) {
      if (best != nullptr && s.text.size() <= best->text.size()) break;
      if (rest.starts_with(s.text)) {
        best = &s;
        break;
      }
    }
  }
  return best;
}

std::vector<int32_t> SpmTokenizer::encode(std::string_view text, bool add_bos,
                                          bool parse_special) const {
  std::vector<int32_t> out;
  if (add_bos && add_bos_ && bos_id_ >= 0) out.push_back(bos_id_);

  std::string fragment;
  bool after_special = true;  // the start of the text counts as "after a special token"
  size_t plain_begin = 0;
  const auto flush_plain = [&](size_t end) {
    if (end == plain_begin) return;
    fragment.clear();
    if (add_space_prefix_ && after_special) fragment.append(kSpace);
    for (size_t i = plain_begin; i < end; ++i) {
      if (text[i] == ' ') {
        fragment.append(kSpace);
      } else {
        fragment.push_back(text[i]);
      }
    }
    encode_fragment(fragment, out);
    after_special = false;
  };
  for (size_t pos = 0; pos < text.size();) {
    const Special* s = match_special(text, pos, parse_special);
    if (s == nullptr) {
      ++pos;
      continue;
    }
    flush_plain(pos);
    out.push_back(s->id);
    after_special = true;
    pos += s->text.size();
    plain_begin = pos;
  }
  flush_plain(text.size());

  if (add_bos && add_eos_ && eos_id_ >= 0) out.push_back(eos_id_);
  return out;
}

void SpmTokenizer::encode_fragment(std::string_view text, std::vector<int32_t>& out) const {
  const std::vector<std::string_view> chars = utf8::split(text);
  std::vector<Symbol> symbols;
  symbols.reserve(chars.size());
  size_t offset = 0;
  for (size_t i = 0; i < chars.size(); ++i) {
    const int idx = static_cast<int>(i);
    symbols.push_back({offset, chars[i].size(), idx - 1, i + 1 < chars.size() ? idx + 1 : -1});
    offset += chars[i].size();
  }

  std::priority_queue<Bigram, std::vector<Bigram>, BigramLess> queue;
  const auto try_pair = [&](int left) {
    if (left < 0) return;
    const int right = symbols[left].next;
    if (right < 0) return;
    const size_t size = symbols[left].size + symbols[right].size;
    const int32_t id = find_piece(text.substr(symbols[left].begin, size));
    if (id >= 0) queue.push({scores_[id], left, size});
  };
  for (int i = 0; i + 1 < static_cast<int>(symbols.size()); ++i) try_pair(i);

  while (!queue.empty()) {
    const Bigram b = queue.top();
    queue.pop();
    Symbol& left = symbols[b.left];
    // Stale entry: the left symbol was merged away, or it or its neighbour grew since. The
    // left symbol's start never moves, so equal sizes mean the same text, hence the same token.
    if (left.size == 0 || left.next < 0 || left.size + symbols[left.next].size != b.size) {
      continue;
    }
    Symbol& right = symbols[left.next];
    left.size = b.size;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = b.left;
    right.size = 0;
    try_pair(left.prev);
    try_pair(b.left);
  }

  for (int i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[i].next) {
    const std::string_view piece = text.substr(symbols[i].begin, symbols[i].size);
    const int32_t id = find_piece(piece);
    if (id >= 0) {
      out.push_back(id);
    } else {
      append_bytes(piece, out);
    }
  }
}

void SpmTokenizer::append_bytes(std::string_view symbol, std::vector<int32_t>& out) const {
  const bool all_bytes = std::all_of(symbol.begin(), symbol.end(), [&](char c) {
    return byte_ids_[static_cast<uint8_t>(c)] >= 0;
  });
  if (all_bytes) {
    for (char c : symbol) out.push_back(byte_ids_[static_cast<uint8_t>(c)]);
    return;
  }
  if (unk_id_ >= 0) {
    out.push_back(unk_id_);
    return;
  }
  throw Error(ErrorCategory::unsupported,
              fmt::format("SPM tokenizer: cannot encode '{}' (byte 0x{:02X}): the vocabulary has "
                          "no such token, no <0xNN> byte token and no unknown token",
                          utf8::sanitize(symbol), static_cast<uint8_t>(symbol[0])));
}

std::string SpmTokenizer::token_to_piece(int32_t id, bool render_special) const {
  if (id < 0 || id >= n_vocab()) {
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("token_to_piece: token id {} is outside [0, {})", id, n_vocab()));
  }
  const std::string& text = tokens_[id];
  switch (types_[id]) {
    case TokenType::byte:
      return std::string(1, static_cast<char>(byte_value_[id]));
    case TokenType::control:
      return render_special ? text : std::string();
    case TokenType::unknown:
      return render_special ? text : std::string(utf8::kReplacement);
    case TokenType::user_defined:
      return text;
    default: {
      std::string piece;
      piece.reserve(text.size());
      for (size_t pos = 0; pos < text.size();) {
        if (text.compare(pos, kSpace.size(), kSpace) == 0) {
          piece.push_back(' ');
          pos += kSpace.size();
        } else {
          piece.push_back(text[pos++]);
        }
      }
      return piece;
    }
  }
}

}  // namespace berth
