#include "berth/core/strings.h"

#include <fmt/format.h>

namespace berth {

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
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20 || c == 0x7f) out += fmt::format("\\x{:02x}", c);
        else out += static_cast<char>(c);
    }
  }
  if (end < s.size()) out += fmt::format("...({} bytes)", s.size());
  return out;
}

}  // namespace berth
