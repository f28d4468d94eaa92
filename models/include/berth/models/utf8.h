// Small UTF-8 helpers for the tokenizers and the streaming decoder.
//
// Well-formedness follows the Unicode Standard, chapter 3, table 3-7 ("Well-Formed UTF-8 Byte
// Sequences"): no overlong forms (C0, C1, E0 80..9F, F0 80..8F), no surrogates (ED A0..BF), no
// code points above U+10FFFF (F4 90.., F5..FF). Ill-formed input is handled by "maximal
// subparts" (Unicode chapter 3, "U+FFFD Substitution of Maximal Subparts"): each maximal
// prefix of a would-be well-formed sequence counts as one unit, a byte that cannot start one
// counts alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace berth::utf8 {

/// U+FFFD REPLACEMENT CHARACTER, encoded.
inline constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

/// Length in bytes (1..4) of the sequence that lead byte `b` starts, or 0 when `b` cannot start
/// a well-formed sequence (a continuation byte 80..BF, or C0, C1, F5..FF).
int sequence_length(uint8_t b);

/// What the bytes at one position hold.
enum class Status {
  ok,          ///< a complete, well-formed character of `length` bytes
  incomplete,  ///< a well-formed prefix of `length` bytes that the end of the input cuts short
  invalid,     ///< an ill-formed maximal subpart of `length` bytes (>= 1)
};

struct Unit {
  Status status;
  size_t length;
};

/// Classifies the bytes of `s` starting at `pos` (pos < s.size()).
Unit next_unit(std::string_view s, size_t pos);

/// True when all of `s` is well-formed UTF-8 (the empty string is).
bool is_valid(std::string_view s);

/// Splits `s` into characters, as views into `s`. Each well-formed character is one piece;
/// every byte of an ill-formed or truncated sequence is a piece of its own. Concatenating the
/// pieces gives back `s` exactly.
std::vector<std::string_view> split(std::string_view s);

/// Appends code point `cp` encoded as UTF-8. Surrogates and values above U+10FFFF append U+FFFD.
void append(std::string& out, char32_t cp);

/// `s` with each ill-formed maximal subpart (including a truncated sequence at the end)
/// replaced by one U+FFFD.
std::string sanitize(std::string_view s);

/// Number of bytes at the end of `s` that form a well-formed but incomplete sequence (a lead
/// byte whose continuation bytes have not all arrived yet); 0..3.
size_t incomplete_tail(std::string_view s);

}  // namespace berth::utf8
