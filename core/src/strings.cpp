#include "berth/core/strings.h"

#include <fmt/format.h>

#include <cctype>
#include <cstdint>
#include <limits>

#include "berth/core/error.h"

namespace berth {
namespace {

// Length of the well-formed UTF-8 sequence at s[i] (RFC 3629: no overlongs, no surrogates,
// at most U+10FFFF), or 0 when the bytes there are not one.
size_t utf8_sequence(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF)
    n = 2;
  else if (c == 0xE0)
    n = 3, lo = 0xA0;
  else if (c >= 0xE1 && c <= 0xEC)
    n = 3;
  else if (c == 0xED)
    n = 3, hi = 0x9F;
  else if (c >= 0xEE && c <= 0xEF)
    n = 3;
  else if (c == 0xF0)
    n = 4, lo = 0x90;
  else if (c >= 0xF1 && c <= 0xF3)
    n = 4;
  else if (c == 0xF4)
    n = 4, hi = 0x8F;
  else
    return 0;
  if (i + n > s.size()) return 0;
  if (b(i + 1) < lo || b(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if ((b(i + k) & 0xC0) != 0x80) return 0;
  return n;
}

}  // namespace

std::string printable(std::string_view s, size_t max_bytes) {
  std::string out;
  size_t end = s.size();
  if (end > max_bytes) {
    end = max_bytes;
    while (end > 0 && (static_cast<unsigned char>(s[end]) & 0xC0) == 0x80) --end;
  }
  out.reserve(end + 16);
  for (size_t i = 0; i < end; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    switch (c) {
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20 || c == 0x7f) {
          out += fmt::format("\\x{:02x}", c);
        } else if (c < 0x80) {
          out += static_cast<char>(c);
        } else if (const size_t n = utf8_sequence(s.substr(0, end), i);
                   n > 0 && !(c == 0xC2 && static_cast<unsigned char>(s[i + 1]) < 0xA0)) {
          // Valid UTF-8 is kept, except C1 controls (U+0080..U+009F), escaped below.
          out.append(s.substr(i, n));
          i += n - 1;
        } else {
          out += fmt::format("\\x{:02x}", c);  // not valid UTF-8, or a C1 control: escaped
        }
    }
  }
  if (end < s.size()) out += fmt::format("...({} bytes)", s.size());
  return out;
}

size_t parse_size(std::string_view text, std::string_view flag) {
  const auto fail = [&](std::string_view why) -> size_t {
    throw Error(
        ErrorCategory::invalid_argument,
        fmt::format("{} '{}': {} (expected a size such as 24G, 512M, 1.5GiB or a number of bytes)",
                    flag, text, why));
  };
  if (text.empty()) return fail("empty value");
  if (text[0] == '-') return fail("a size cannot be negative");
  size_t i = 0;
  uint64_t whole = 0;
  size_t n_digits = 0;
  for (; i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])); ++i, ++n_digits) {
    const uint64_t d = static_cast<uint64_t>(text[i] - '0');
    if (whole > (std::numeric_limits<uint64_t>::max() - d) / 10) return fail("too large");
    whole = whole * 10 + d;
  }
  // The fraction as digits over 10^n (at most 18 digits kept: finer than a byte at any unit).
  uint64_t frac = 0, frac_den = 1;
  bool has_frac = false;
  if (i < text.size() && text[i] == '.') {
    ++i;
    for (; i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])); ++i, ++n_digits) {
      has_frac = true;
      if (frac_den < uint64_t{1000000000000000000}) {
        frac = frac * 10 + static_cast<uint64_t>(text[i] - '0');
        frac_den *= 10;
      }
    }
  }
  if (n_digits == 0) return fail("not a number");
  std::string unit(text.substr(i));
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  uint64_t mult = 0;
  static constexpr std::pair<const char*, int> kUnits[] = {
      {"", 0},    {"b", 0}, {"k", 1},  {"kb", 1},  {"kib", 1}, {"m", 2},  {"mb", 2},
      {"mib", 2}, {"g", 3}, {"gb", 3}, {"gib", 3}, {"t", 4},   {"tb", 4}, {"tib", 4}};
  for (const auto& [name, power] : kUnits)
    if (unit == name) mult = uint64_t{1} << (10 * power);
  if (mult == 0) return fail(fmt::format("unknown unit '{}' (K, M, G, T: powers of 1024)", unit));
  if (has_frac && frac != 0 && mult == 1) return fail("a fraction of a byte needs a unit");
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(whole, mult, &bytes)) return fail("too large");
  const unsigned __int128 part = static_cast<unsigned __int128>(frac) * mult / frac_den;
  if (__builtin_add_overflow(bytes, static_cast<uint64_t>(part), &bytes)) return fail("too large");
  if (bytes > std::numeric_limits<size_t>::max()) return fail("too large");
  return static_cast<size_t>(bytes);
}

}  // namespace berth
