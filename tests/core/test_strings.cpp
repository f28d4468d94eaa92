// printable(): what error messages and `inspect` show of bytes taken from files or users.
#include <doctest/doctest.h>

#include <string>

#include "berth/core/strings.h"

using berth::printable;

TEST_CASE("printable keeps valid UTF-8 and escapes control bytes and invalid UTF-8") {
  CHECK(printable("plain text") == "plain text");
  CHECK(printable("a\nb\tc\rd") == "a\\nb\\tc\\rd");
  CHECK(printable(std::string("nul\0x", 5)) == "nul\\x00x");
  CHECK(printable("esc\x1b[31m") == "esc\\x1b[31m");
  CHECK(printable("caf\xc3\xa9 \xe4\xb8\xad \xf0\x9f\x98\x80") ==
        "caf\xc3\xa9 \xe4\xb8\xad \xf0\x9f\x98\x80");
  CHECK(printable("qwen\xffmoe") == "qwen\\xffmoe");               // not UTF-8
  CHECK(printable("\xc3") == "\\xc3");                             // truncated sequence
  CHECK(printable("\xe0\x80\x80") == "\\xe0\\x80\\x80");           // overlong
  CHECK(printable("\xed\xa0\x80") == "\\xed\\xa0\\x80");           // surrogate
  CHECK(printable("\xf4\x90\x80\x80") == "\\xf4\\x90\\x80\\x80");  // above U+10FFFF
  CHECK(printable("csi\xc2\x9b"
                  "31m") == "csi\\xc2\\x9b31m");  // C1 control U+009B
  CHECK(printable("\xc2\xa0") == "\xc2\xa0");     // U+00A0 is kept
  // Cut at a character boundary, with the full length noted.
  CHECK(printable("ab\xc3\xa9", 3) == "ab...(4 bytes)");
}
