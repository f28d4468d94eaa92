// UTF-8 helpers: lead-byte lengths, well-formedness per Unicode table 3-7, splitting, maximal
// subpart replacement, incomplete tails.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "berth/models/utf8.h"

namespace u8 = berth::utf8;

TEST_CASE("utf8: sequence_length from the lead byte") {
  CHECK(u8::sequence_length(0x00) == 1);
  CHECK(u8::sequence_length('A') == 1);
  CHECK(u8::sequence_length(0x7F) == 1);
  CHECK(u8::sequence_length(0x80) == 0);  // continuation byte
  CHECK(u8::sequence_length(0xBF) == 0);
  CHECK(u8::sequence_length(0xC0) == 0);  // always overlong
  CHECK(u8::sequence_length(0xC1) == 0);
  CHECK(u8::sequence_length(0xC2) == 2);
  CHECK(u8::sequence_length(0xDF) == 2);
  CHECK(u8::sequence_length(0xE0) == 3);
  CHECK(u8::sequence_length(0xEF) == 3);
  CHECK(u8::sequence_length(0xF0) == 4);
  CHECK(u8::sequence_length(0xF4) == 4);
  CHECK(u8::sequence_length(0xF5) == 0);  // beyond U+10FFFF
  CHECK(u8::sequence_length(0xFF) == 0);
}

TEST_CASE("utf8: is_valid") {
  CHECK(u8::is_valid(""));
  CHECK(u8::is_valid("hello"));
  CHECK(u8::is_valid("caf\xC3\xA9"));               // é
  CHECK(u8::is_valid("\xE6\x97\xA5\xE6\x9C\xAC"));  // 日本
  CHECK(u8::is_valid("\xF0\x9F\xA6\x80"));          // 🦀 U+1F980
  CHECK(u8::is_valid("\xF4\x8F\xBF\xBF"));          // U+10FFFF
  CHECK_FALSE(u8::is_valid("\xC3"));                // truncated
  CHECK_FALSE(u8::is_valid("\xF0\x9F\xA6"));        // truncated
  CHECK_FALSE(u8::is_valid("\x80"));                // lone continuation
  CHECK_FALSE(u8::is_valid("\xC0\xAF"));            // overlong '/'
  CHECK_FALSE(u8::is_valid("\xE0\x80\xAF"));        // overlong
  CHECK_FALSE(u8::is_valid("\xED\xA0\x80"));        // surrogate U+D800
  CHECK_FALSE(u8::is_valid("\xF4\x90\x80\x80"));    // U+110000
  CHECK_FALSE(u8::is_valid("\xC3\x41"));            // lead then ASCII
}

TEST_CASE("utf8: next_unit statuses and lengths") {
  const std::string s = "a\xC3\xA9\xF0\x9F";
  auto u = u8::next_unit(s, 0);
  CHECK(u.status == u8::Status::ok);
  CHECK(u.length == 1);
  u = u8::next_unit(s, 1);
  CHECK(u.status == u8::Status::ok);
  CHECK(u.length == 2);
  u = u8::next_unit(s, 3);
  CHECK(u.status == u8::Status::incomplete);
  CHECK(u.length == 2);
  // E0 followed by 80: the second byte is out of range (overlong), maximal subpart is 1 byte.
  u = u8::next_unit("\xE0\x80\x80", 0);
  CHECK(u.status == u8::Status::invalid);
  CHECK(u.length == 1);
  // E6 97 then 'x': the well-formed prefix E6 97 is the maximal subpart.
  u = u8::next_unit("\xE6\x97x", 0);
  CHECK(u.status == u8::Status::invalid);
  CHECK(u.length == 2);
}

TEST_CASE("utf8: split into characters, ill-formed bytes alone") {
  const std::string s = "a\xC3\xA9\xE6\x97\xA5\xF0\x9F\xA6\x80\x80z\xE6\x97";
  const std::vector<std::string_view> parts = u8::split(s);
  const std::vector<std::string_view> expected = {
      "a", "\xC3\xA9", "\xE6\x97\xA5", "\xF0\x9F\xA6\x80", "\x80", "z", "\xE6", "\x97"};
  CHECK(parts == expected);
  std::string joined;
  for (auto p : parts) joined += p;
  CHECK(joined == s);
  CHECK(u8::split("").empty());
}

TEST_CASE("utf8: append encodes code points") {
  std::string out;
  u8::append(out, U'A');
  u8::append(out, U'\u00E9');
  u8::append(out, U'\u65E5');
  u8::append(out, U'\U0001F980');
  CHECK(out == "A\xC3\xA9\xE6\x97\xA5\xF0\x9F\xA6\x80");
  std::string bad;
  u8::append(bad, static_cast<char32_t>(0xD800));
  u8::append(bad, static_cast<char32_t>(0x110000));
  CHECK(bad == "\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST_CASE("utf8: sanitize replaces each maximal subpart with one U+FFFD") {
  CHECK(u8::sanitize("ok \xC3\xA9") == "ok \xC3\xA9");
  CHECK(u8::sanitize("a\x80"
                     "b") ==
        "a\xEF\xBF\xBD"
        "b");
  CHECK(u8::sanitize("\xF0\x9F\xA6") == "\xEF\xBF\xBD");          // one truncated sequence
  CHECK(u8::sanitize("\xE6\x97x") == "\xEF\xBF\xBDx");            // E6 97 is one subpart
  CHECK(u8::sanitize("\xC0\xAF") == "\xEF\xBF\xBD\xEF\xBF\xBD");  // two bad bytes
}

TEST_CASE("utf8: incomplete_tail") {
  CHECK(u8::incomplete_tail("") == 0);
  CHECK(u8::incomplete_tail("abc") == 0);
  CHECK(u8::incomplete_tail("ab\xF0") == 1);
  CHECK(u8::incomplete_tail("ab\xF0\x9F") == 2);
  CHECK(u8::incomplete_tail("ab\xF0\x9F\xA6") == 3);
  CHECK(u8::incomplete_tail("ab\xF0\x9F\xA6\x80") == 0);
  CHECK(u8::incomplete_tail("\xE6\x97\xA5\xE6") == 1);
  CHECK(u8::incomplete_tail("ab\x80") == 0);  // ill-formed, not incomplete
}
