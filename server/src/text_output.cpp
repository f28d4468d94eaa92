#include "berth/server/text_output.h"

#include <algorithm>
#include <utility>

#include "berth/models/utf8.h"

namespace berth::server {

TextFilter::TextFilter(std::vector<std::string> stops) : stops_(std::move(stops)) {
  stops_.erase(std::remove(stops_.begin(), stops_.end(), std::string()), stops_.end());
  for (const std::string& s : stops_) max_stop_ = std::max(max_stop_, s.size());
}

std::string TextFilter::push(std::string_view piece) {
  if (stopped_) return {};
  raw_.append(piece);
  // Decode every complete unit; keep an incomplete character for later.
  size_t pos = 0;
  while (pos < raw_.size()) {
    const utf8::Unit u = utf8::next_unit(raw_, pos);
    if (u.status == utf8::Status::incomplete) break;
    if (u.status == utf8::Status::ok)
      waiting_.append(raw_, pos, u.length);
    else
      waiting_.append(utf8::kReplacement);
    pos += u.length;
  }
  raw_.erase(0, pos);
  if (stops_.empty()) return std::exchange(waiting_, {});

  // The earliest complete stop string (the longest one at that position) ends the text.
  size_t best = std::string::npos;
  const std::string* word = nullptr;
  for (const std::string& s : stops_) {
    const size_t p = waiting_.find(s);
    if (p != std::string::npos && (p < best || (p == best && word && s.size() > word->size()))) {
      best = p;
      word = &s;
    }
  }
  if (word) {
    std::string out = waiting_.substr(0, best);
    stopped_ = true;
    stop_word_ = *word;
    waiting_.clear();
    raw_.clear();
    return out;
  }
  // Hold back the longest suffix that is a proper prefix of a stop string. Stop strings are
  // valid UTF-8, so such a suffix starts on a character boundary.
  size_t hold = 0;
  const size_t upto = std::min(waiting_.size(), max_stop_ - 1);
  for (size_t k = upto; k > 0 && hold == 0; --k) {
    const std::string_view tail(waiting_.data() + waiting_.size() - k, k);
    for (const std::string& s : stops_)
      if (s.size() > k && std::string_view(s).substr(0, k) == tail) {
        hold = k;
        break;
      }
  }
  std::string out = waiting_.substr(0, waiting_.size() - hold);
  waiting_.erase(0, waiting_.size() - hold);
  return out;
}

std::string TextFilter::flush() {
  if (stopped_) return {};
  std::string out = std::exchange(waiting_, {});
  out += utf8::sanitize(raw_);
  raw_.clear();
  return out;
}

}  // namespace berth::server
