// Text helpers for messages that quote bytes taken from files or users.
#pragma once

#include <string>
#include <string_view>

namespace berth {

/// `s` made safe to print on one line: control bytes (< 0x20, 0x7f, NUL included) become C-style
/// escapes (\n, \t, \x1b, ...), and text longer than `max_bytes` is cut (at a UTF-8 character
/// boundary) and marked with "...(N bytes)". Valid UTF-8 above 0x7f is kept, except the C1
/// controls U+0080..U+009F; bytes that are not well-formed UTF-8 (RFC 3629) become \xNN.
std::string printable(std::string_view s, size_t max_bytes = 120);

}  // namespace berth
