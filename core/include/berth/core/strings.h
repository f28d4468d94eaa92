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

/// Parses a size in bytes: "1000000", "24G", "512M", "1.5GiB", "64k"; the unit (any case, "B"
/// optional: K, KB, KiB, M, MB, MiB, G, ..., T, ...) is a power of 1024; a fraction needs a
/// unit and is rounded down to whole bytes (the syntax of --vram-budget and BERTH_SIM_DEVICE).
/// Throws Error(invalid_argument) "FLAG 'TEXT': why (expected a size such as ...)" for an empty,
/// negative or malformed value or one above SIZE_MAX.
size_t parse_size(std::string_view text, std::string_view flag);

}  // namespace berth
