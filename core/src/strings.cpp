#include "berth/core/strings.h"

#include <fmt/format.h>

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

}  // namespace berth
