// From generated token pieces to the text a response carries.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace berth::server {

/// Releases generated text so that (1) it is always valid UTF-8: the bytes of a character split
/// across tokens wait until it is complete, and ill-formed bytes become U+FFFD (maximal
/// subparts, models/utf8.h); (2) no stop string is ever released, not even in part: text that
/// could be the start of a stop string waits until the next tokens tell, and at the first
/// complete stop string the text ends, without it. Search is over the released-or-waiting text
/// as one string, so a stop string spanning any number of tokens is found.
class TextFilter {
 public:
  /// `stops`: non-empty, valid UTF-8 strings (the API layer checks them).
  explicit TextFilter(std::vector<std::string> stops);

  /// Appends one token's bytes; returns the text that can be released now (possibly empty).
  /// After a stop string was found, returns "" and ignores `piece`.
  std::string push(std::string_view piece);
  /// The end of the generation: returns the text still waiting (an incomplete character as
  /// U+FFFD, the start of a stop string as the text it is).
  std::string flush();

  bool stopped() const { return stopped_; }
  /// The stop string that ended the text ("" when none).
  const std::string& stop_word() const { return stop_word_; }

 private:
  std::vector<std::string> stops_;
  size_t max_stop_ = 0;
  std::string raw_;      // bytes not yet decoded (an incomplete character)
  std::string waiting_;  // decoded text held back (a possible stop-string start)
  bool stopped_ = false;
  std::string stop_word_;
};

}  // namespace berth::server
