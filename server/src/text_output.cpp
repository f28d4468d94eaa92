#include "berth/server/text_output.h"

#include <algorithm>
#include <utility>

#include "berth/models/utf8.h"

namespace berth::server {

TextFilter::TextFilter(std::vector<std::string> stops) : stops_(std::move(stops)) {
  stops_.erase(std::remove(stops_.begin(), stops_.end(), std::string()), stops_.end());
  for (const std::string& s : stops_) max_stop_ = std::max(max_stop_, s.size());
}

std::string TextFilter::release(size_t n) {
  std::string out = waiting_.substr(0, n);
  waiting_.erase(0, n);
  released_ += n;
  while (!decoded_.empty() && decoded_.front() <= released_) {
    decoded_.pop_front();
    ++n_released_pieces_;
  }
  return out;
}

std::string TextFilter::push(std::string_view piece) {
  if (stopped_) return {};
  raw_.append(piece);
  raw_in_ += piece.size();
  open_.push_back(raw_in_);
  // A piece is decoded whole once the unit holding its last byte is (its decoded end: that
  // unit's end).
  auto settle = [&] {
    while (!open_.empty() && open_.front() <= raw_decoded_) {
      open_.pop_front();
      decoded_.push_back(released_ + waiting_.size());
    }
  };
  settle();
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
    raw_decoded_ += u.length;
    settle();
  }
  raw_.erase(0, pos);
  if (stops_.empty()) return release(waiting_.size());

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
    // The pieces wholly before the stop string are released; the rest (a piece that straddles
    // its start included) are dropped with it.
    std::string out = release(best);
    stopped_ = true;
    stop_word_ = *word;
    waiting_.clear();
    raw_.clear();
    open_.clear();
    decoded_.clear();
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
  return release(waiting_.size() - hold);
}

std::string TextFilter::flush() {
  if (stopped_) return {};
  std::string out = std::exchange(waiting_, {});
  out += utf8::sanitize(raw_);
  raw_.clear();
  released_ += out.size();
  n_released_pieces_ += decoded_.size() + open_.size();
  decoded_.clear();
  open_.clear();
  return out;
}

}  // namespace berth::server
