#include "berth/server/sequence_state.h"

#include <fmt/format.h>

#include <algorithm>

#include "berth/core/error.h"
#include "berth/runtime/kv_cache.h"

namespace berth::server {

void KvSequenceState::truncate_to(int64_t n) {
  if (n < 0 || n > n_past_)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("truncate_to({}) outside 0..{}", n, n_past_));
  n_past_ = n;
}

void KvSequenceState::restore(const Checkpoint& cp) {
  if (cp.n_past < 0 || cp.n_past > n_past_)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("cannot restore a checkpoint at position {}: the KV cache holds {}",
                            cp.n_past, n_past_));
  n_past_ = cp.n_past;
}

void KvSequenceState::advance(int64_t n) {
  if (n < 0 || n_past_ + n > n_ctx_)
    throw Error(
        ErrorCategory::invalid_argument,
        fmt::format("{} tokens after {} exceed the sequence's context of {}", n, n_past_, n_ctx_));
  n_past_ += n;
}

void RecurrentSequenceState::truncate_to(int64_t n) {
  if (n < 0 || n > n_past_)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("truncate_to({}) outside 0..{}", n, n_past_));
  if (n == n_past_) return;
  if (n > 0)
    throw Error(ErrorCategory::unsupported,
                fmt::format("sequence {}: a recurrent state of {} tokens cannot be cut back to {} "
                            "(only restored from a checkpoint)",
                            seq_, n_past_, n));
  kv_.reset_state(seq_);
  n_past_ = 0;
}

Checkpoint RecurrentSequenceState::save() {
  const uint64_t h = next_handle_++;
  Saved sv;
  sv.n_past = n_past_;
  if (free_rows_.empty())  // the oldest checkpoint on a row makes room for this newest one
    for (auto& [handle, old] : saved_)
      if (old.row >= 0) {
        old.host = kv_.spare_state(old.row);
        free_rows_.push_back(old.row);
        old.row = -1;
        break;
      }
  if (!free_rows_.empty()) {
    sv.row = free_rows_.back();
    kv_.save_state_spare(seq_, sv.row);
    free_rows_.pop_back();
  } else {
    sv.host = kv_.save_state(seq_);
  }
  saved_[h] = std::move(sv);
  return Checkpoint{n_past_, h};
}

void RecurrentSequenceState::restore(const Checkpoint& cp) {
  const auto it = saved_.find(cp.handle);
  if (it == saved_.end() || it->second.n_past != cp.n_past || cp.n_past > n_past_)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("sequence {}: no checkpoint {} at position {} to restore (the "
                            "sequence holds {} tokens)",
                            seq_, cp.handle, cp.n_past, n_past_));
  if (it->second.row >= 0)
    kv_.restore_state_spare(seq_, it->second.row);
  else
    kv_.restore_state(seq_, it->second.host);
  n_past_ = cp.n_past;
}

void RecurrentSequenceState::drop(const Checkpoint& cp) {
  const auto it = saved_.find(cp.handle);
  if (it == saved_.end()) return;
  if (it->second.row >= 0) free_rows_.push_back(it->second.row);
  saved_.erase(it);
}

size_t RecurrentSequenceState::n_saved_on_rows() const {
  return static_cast<size_t>(
      std::count_if(saved_.begin(), saved_.end(), [](const auto& e) { return e.second.row >= 0; }));
}

SlotCache::SlotCache(SequenceState& state, int max_checkpoints)
    : state_(state), max_checkpoints_(std::max(max_checkpoints, 0)) {}

SlotCache::~SlotCache() {
  for (const Checkpoint& cp : checkpoints_) state_.drop(cp);
}

int64_t SlotCache::common_prefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return static_cast<int64_t>(i);
}

SlotCache::PrefixReuse SlotCache::reuse(std::span<const int32_t> prompt) const {
  if (prompt.empty()) return {};
  PrefixReuse r;
  r.shared = std::min(common_prefix(tokens_, prompt), static_cast<int64_t>(prompt.size()) - 1);
  if (r.shared == static_cast<int64_t>(tokens_.size()) || state_.can_truncate()) {
    r.restorable = r.shared;
    return r;
  }
  // The latest checkpoint at or before `shared`, else nothing.
  for (const Checkpoint& cp : checkpoints_)
    if (cp.n_past <= r.shared) r.restorable = cp.n_past;
  return r;
}

int64_t SlotCache::prepare(std::span<const int32_t> prompt, bool reuse) {
  BERTH_CHECK(!prompt.empty(), "SlotCache::prepare: empty prompt");
  BERTH_CHECK(static_cast<int64_t>(tokens_.size()) == state_.n_past(),
              "SlotCache: the state holds a different number of tokens than recorded");
  const int64_t n = reuse ? this->reuse(prompt).restorable : 0;
  if (n == state_.n_past()) {
    // The prompt continues exactly what the state holds.
  } else if (n == 0 || state_.can_truncate()) {
    state_.truncate_to(n);
  } else {
    const auto cp = std::find_if(checkpoints_.begin(), checkpoints_.end(),
                                 [&](const Checkpoint& c) { return c.n_past == n; });
    BERTH_CHECK(cp != checkpoints_.end(), "SlotCache::prepare: no checkpoint at the reused length");
    state_.restore(*cp);
  }
  // Checkpoints past n describe tokens about to be overwritten.
  while (!checkpoints_.empty() && checkpoints_.back().n_past > n) {
    state_.drop(checkpoints_.back());
    checkpoints_.pop_back();
  }
  tokens_.resize(static_cast<size_t>(n));
  return n;
}

void SlotCache::append(std::span<const int32_t> evaluated) {
  tokens_.insert(tokens_.end(), evaluated.begin(), evaluated.end());
  BERTH_CHECK(static_cast<int64_t>(tokens_.size()) == state_.n_past(),
              "SlotCache::append: the state holds a different number of tokens than recorded");
}

void SlotCache::checkpoint() {
  if (state_.can_truncate() || max_checkpoints_ == 0) return;
  if (!checkpoints_.empty() && checkpoints_.back().n_past == state_.n_past()) return;
  if (static_cast<int>(checkpoints_.size()) >= max_checkpoints_) {
    state_.drop(checkpoints_.front());
    checkpoints_.erase(checkpoints_.begin());
  }
  checkpoints_.push_back(state_.save());
}

void SlotCache::clear() {
  for (const Checkpoint& cp : checkpoints_) state_.drop(cp);
  checkpoints_.clear();
  tokens_.clear();
  state_.truncate_to(0);
}

}  // namespace berth::server
