#include "berth/runtime/batch.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "berth/core/error.h"

namespace berth {

struct BatchLoop::Seq {
  int64_t id = 0;
  BatchRequest req;
  Sampler sampler;
  int32_t kv_seq = -1;      // the KV cache's sequence, once admitted
  int64_t n_past = 0;       // positions in the KV cache
  int64_t n_generated = 0;  // tokens sampled
  int32_t next = -1;        // generating: the token to feed at n_past
  bool cancelled = false;
  Seq(int64_t i, BatchRequest r, int32_t n_vocab)
      : id(i), req(std::move(r)), sampler(req.sampling, n_vocab) {}
  bool prefilling() const { return n_past < static_cast<int64_t>(req.prompt.size()); }
};

BatchLoop::BatchLoop(Session& session, const Tokenizer* tok) : session_(session), tok_(tok) {}

BatchLoop::~BatchLoop() {
  for (auto& s : running_)
    if (s->kv_seq >= 0) session_.kv().release(s->kv_seq);
}

int64_t BatchLoop::submit(BatchRequest request) {
  if (request.prompt.empty())
    throw Error(ErrorCategory::invalid_argument, "the prompt has no tokens");
  const auto n = static_cast<int64_t>(request.prompt.size());
  if (n >= session_.n_ctx())
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("a prompt of {} tokens does not fit a sequence's context of {} "
                            "(raise -c or lower -np)",
                            n, session_.n_ctx()));
  const int64_t n_vocab = session_.n_vocab();
  for (int32_t t : request.prompt)
    if (t < 0 || t >= n_vocab)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("token id {} is outside the vocabulary of {} tokens", t, n_vocab));
  auto s = std::make_unique<Seq>(next_id_, std::move(request), static_cast<int32_t>(n_vocab));
  for (int32_t t : s->req.prompt) s->sampler.accept(t);
  queue_.push_back(std::move(s));
  return next_id_++;
}

void BatchLoop::cancel(int64_t id) {
  for (auto& s : running_)
    if (s->id == id) s->cancelled = true;
  for (auto& s : queue_)
    if (s->id == id) s->cancelled = true;
}

void BatchLoop::admit() {
  // Cancelled requests leave first: queued ones never take a sequence.
  for (size_t i = 0; i < queue_.size();) {
    if (!queue_[i]->cancelled) {
      ++i;
      continue;
    }
    events_.push_back({queue_[i]->id, -1, true, StopReason::callback});
    queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(i));
  }
  for (size_t i = 0; i < running_.size();)
    if (running_[i]->cancelled)
      finish(i, StopReason::callback);
    else
      ++i;
  while (!queue_.empty() && session_.kv().n_free() > 0) {
    queue_.front()->kv_seq = session_.kv().acquire();
    running_.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
}

void BatchLoop::finish(size_t i, StopReason why) {
  Seq& s = *running_[i];
  events_.push_back({s.id, -1, true, why});
  session_.kv().release(s.kv_seq);
  running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
}

const std::vector<BatchEvent>& BatchLoop::step() {
  events_.clear();
  last_ = {};
  admit();
  if (running_.empty()) return events_;

  // Pack: one token per generating sequence, then prompt chunks, up to n_ubatch tokens. Rows
  // whose logits are wanted (decode tokens, the last token of a prompt) go at the end, in the
  // order of admission; a prompt chunk's other tokens go first.
  const auto budget = static_cast<int64_t>(session_.params().n_ubatch);
  int64_t used = 0;
  struct Out {
    size_t seq;  // index in running_
  };
  std::vector<Out> outs;
  std::vector<int32_t> tail_tok, tail_pos, tail_seq;
  std::vector<int64_t> chunk(running_.size(), 0);  // prompt tokens this step, per sequence
  tokens_.clear();
  positions_.clear();
  seqs_.clear();
  for (size_t i = 0; i < running_.size() && used < budget; ++i) {
    Seq& s = *running_[i];
    if (s.prefilling()) continue;
    chunk[i] = -1;  // a decode token
    ++used;
  }
  for (size_t i = 0; i < running_.size() && used < budget; ++i) {
    Seq& s = *running_[i];
    if (!s.prefilling()) continue;
    chunk[i] = std::min<int64_t>(budget - used, static_cast<int64_t>(s.req.prompt.size()) - s.n_past);
    used += chunk[i];
  }
  for (size_t i = 0; i < running_.size(); ++i) {
    Seq& s = *running_[i];
    if (chunk[i] == 0) continue;
    if (chunk[i] < 0) {
      tail_tok.push_back(s.next);
      tail_pos.push_back(static_cast<int32_t>(s.n_past));
      tail_seq.push_back(s.kv_seq);
      outs.push_back({i});
      ++last_.n_decode;
      continue;
    }
    const bool finishes = s.n_past + chunk[i] == static_cast<int64_t>(s.req.prompt.size());
    const int64_t body = finishes ? chunk[i] - 1 : chunk[i];
    for (int64_t j = 0; j < body; ++j) {
      tokens_.push_back(s.req.prompt[static_cast<size_t>(s.n_past + j)]);
      positions_.push_back(static_cast<int32_t>(s.n_past + j));
      seqs_.push_back(s.kv_seq);
    }
    if (finishes) {
      tail_tok.push_back(s.req.prompt.back());
      tail_pos.push_back(static_cast<int32_t>(s.n_past + body));
      tail_seq.push_back(s.kv_seq);
      outs.push_back({i});
    }
    last_.n_prompt += static_cast<int32_t>(chunk[i]);
  }
  tokens_.insert(tokens_.end(), tail_tok.begin(), tail_tok.end());
  positions_.insert(positions_.end(), tail_pos.begin(), tail_pos.end());
  seqs_.insert(seqs_.end(), tail_seq.begin(), tail_seq.end());
  for (size_t i = 0; i < running_.size(); ++i) last_.n_seqs += chunk[i] != 0;
  // A step without a row to sample (prompt chunks only) still makes one output row.
  const auto n_out = static_cast<int32_t>(std::max<size_t>(outs.size(), 1));

  const auto t0 = std::chrono::steady_clock::now();
  std::span<const float> logits;
  try {
    logits = session_.eval_step(tokens_, positions_, seqs_, n_out);
  } catch (...) {
    for (size_t i = running_.size(); i-- > 0;)
      if (chunk[i] != 0) finish(i, StopReason::callback);
    throw;
  }
  last_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  const int64_t n_vocab = session_.n_vocab();
  for (size_t i = 0; i < running_.size(); ++i)
    if (chunk[i] != 0) running_[i]->n_past += chunk[i] < 0 ? 1 : chunk[i];
  std::vector<uint8_t> ended(running_.size(), 0);
  std::vector<StopReason> why(running_.size(), StopReason::n_predict);
  std::vector<int64_t> event_of(running_.size(), -1);  // this step's token event, per sequence
  for (size_t r = 0; r < outs.size(); ++r) {
    const size_t i = outs[r].seq;
    Seq& s = *running_[i];
    if (s.req.n_predict >= 0 && s.n_generated >= s.req.n_predict) {
      ended[i] = 1;  // n_predict 0: the prompt only
      continue;
    }
    const std::span<const float> row = logits.subspan(r * static_cast<size_t>(n_vocab),
                                                      static_cast<size_t>(n_vocab));
    if (on_logits) on_logits(s.id, row);
    const int32_t id = s.sampler.sample(row);
    s.sampler.accept(id);
    ++s.n_generated;
    if (tok_ && tok_->is_eog(id)) {
      ended[i] = 1;
      why[i] = StopReason::eos;
      continue;
    }
    event_of[i] = static_cast<int64_t>(events_.size());
    events_.push_back({s.id, id, false, StopReason::n_predict});
    s.next = id;
    if (s.req.n_predict >= 0 && s.n_generated >= s.req.n_predict) {
      ended[i] = 1;
    } else if (s.n_past >= session_.n_ctx()) {
      ended[i] = 1;
      why[i] = StopReason::context_full;
    }
  }
  for (size_t i = running_.size(); i-- > 0;) {
    if (!ended[i]) continue;
    if (event_of[i] >= 0) {
      // The sequence's last token and its end are one event.
      BatchEvent& e = events_[static_cast<size_t>(event_of[i])];
      e.done = true;
      e.stop = why[i];
      session_.kv().release(running_[i]->kv_seq);
      running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      finish(i, why[i]);
    }
  }
  return events_;
}

}  // namespace berth
