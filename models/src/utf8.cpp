#include "berth/models/utf8.h"

namespace berth::utf8 {

int sequence_length(uint8_t b) {
  if (b < 0x80) return 1;
  if (b < 0xC2) return 0;  // continuation byte, or C0/C1 (always overlong)
  if (b < 0xE0) return 2;
  if (b < 0xF0) return 3;
  if (b < 0xF5) return 4;
  return 0;
}

Unit next_unit(std::string_view s, size_t pos) {
  const auto b0 = static_cast<uint8_t>(s[pos]);
  const int n = sequence_length(b0);
  if (n == 0) return {Status::invalid, 1};
  if (n == 1) return {Status::ok, 1};
  // Allowed range of the second byte (Unicode table 3-7); later bytes are always 80..BF.
  uint8_t lo = 0x80, hi = 0xBF;
  if (b0 == 0xE0) lo = 0xA0;
  if (b0 == 0xED) hi = 0x9F;
  if (b0 == 0xF0) lo = 0x90;
  if (b0 == 0xF4) hi = 0x8F;
  for (int i = 1; i < n; ++i) {
    if (pos + i >= s.size()) return {Status::incomplete, static_cast<size_t>(i)};
    const auto c = static_cast<uint8_t>(s[pos + i]);
    const bool in_range = i == 1 ? (c >= lo && c <= hi) : (c >= 0x80 && c <= 0xBF);
    if (!in_range) return {Status::invalid, static_cast<size_t>(i)};
  }
  return {Status::ok, static_cast<size_t>(n)};
}

bool is_valid(std::string_view s) {
  for (size_t pos = 0; pos < s.size();) {
    const Unit u = next_unit(s, pos);
    if (u.status != Status::ok) return false;
    pos += u.length;
  }
  return true;
}

std::vector<std::string_view> split(std::string_view s) {
  std::vector<std::string_view> out;
  out.reserve(s.size());
  for (size_t pos = 0; pos < s.size();) {
    const Unit u = next_unit(s, pos);
    const size_t len = u.status == Status::ok ? u.length : 1;
    out.push_back(s.substr(pos, len));
    pos += len;
  }
  return out;
}

void append(std::string& out, char32_t cp) {
  if ((cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
    out.append(kReplacement);
  } else if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t pos = 0; pos < s.size();) {
    const Unit u = next_unit(s, pos);
    if (u.status == Status::ok) {
      out.append(s.substr(pos, u.length));
    } else {
      out.append(kReplacement);
    }
    pos += u.length;
  }
  return out;
}

size_t incomplete_tail(std::string_view s) {
  // An incomplete sequence is at most 3 bytes long, so only the last 3 lead positions matter.
  const size_t start = s.size() > 3 ? s.size() - 3 : 0;
  for (size_t pos = start; pos < s.size(); ++pos) {
    const Unit u = next_unit(s, pos);
    if (u.status == Status::incomplete) return s.size() - pos;
  }
  return 0;
}

}  // namespace berth::utf8
