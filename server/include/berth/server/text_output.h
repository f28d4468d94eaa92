// From generated token pieces to the text a response carries.
#pragma once

#include <cstdint>
#include <deque>
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
///
/// It also tells which pushed pieces (tokens) the released text covers, for the log-probability
/// entries of a response: a piece counts once its text is entirely released. A piece whose text
/// lies partly or wholly in the stop string is never released, even when part of it comes
/// before the stop string (llama-server too drops the stop word's tokens and keeps those before
/// it): e.g. stop "y. She" over " named", " Lily", ".", " She" releases " named Lil" and covers
/// the pieces up to " named". The text of a released piece is therefore always in the response,
/// and a streamed entry never comes before its text.
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
  /// How many of the pieces pushed so far, counted from the first, have their text entirely in
  /// the text released (by push() or flush()); pieces with no text count once the text before
  /// them is released. All of them after flush(); after a stop, those wholly before it.
  size_t n_released_pieces() const { return n_released_pieces_; }

 private:
  /// Releases the first `n` bytes of waiting_ and counts the pieces they complete.
  std::string release(size_t n);

  std::vector<std::string> stops_;
  size_t max_stop_ = 0;
  std::string raw_;      // bytes not yet decoded (an incomplete character)
  std::string waiting_;  // decoded text held back (a possible stop-string start)
  bool stopped_ = false;
  std::string stop_word_;
  uint64_t raw_in_ = 0;         // bytes pushed
  uint64_t raw_decoded_ = 0;    // of those, decoded (into waiting_ or released)
  size_t released_ = 0;         // decoded bytes released
  std::deque<uint64_t> open_;   // pieces not decoded whole: the end of each in the pushed bytes
  std::deque<size_t> decoded_;  // pieces decoded, not released: the end of each in decoded text
  size_t n_released_pieces_ = 0;
};

}  // namespace berth::server
