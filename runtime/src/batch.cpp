#include "berth/runtime/batch.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "berth/core/error.h"

namespace berth {

void StepPacker::pack(std::span<const StepInput> in, int64_t budget) {
  const size_t n = in.size();
  taken_.assign(n, 0);
  out_row_.assign(n, -1);
  tokens_.clear();
  positions_.clear();
  seqs_.clear();
  tail_tok_.clear();
  tail_pos_.clear();
  tail_seq_.clear();
  n_wanted_ = n_decode_ = n_prompt_ = n_seqs_ = 0;
  int64_t used = 0;
  // Decode tokens first. When more sequences generate than the budget holds, they take turns:
  // this step starts after the sequence served last (by KV sequence id, cyclically), so none
  // waits more than ceil(generating / budget) steps.
  order_.clear();
  for (size_t i = 0; i < n; ++i)
    if (in[i].decode) order_.push_back(i);
  if (static_cast<int64_t>(order_.size()) > budget) {
    std::sort(order_.begin(), order_.end(),
              [&](size_t a, size_t b) { return in[a].kv_seq < in[b].kv_seq; });
    const auto next = std::find_if(order_.begin(), order_.end(),
                                   [&](size_t i) { return in[i].kv_seq > last_decode_seq_; });
    std::rotate(order_.begin(), next, order_.end());
    order_.resize(static_cast<size_t>(budget));
    last_decode_seq_ = in[order_.back()].kv_seq;
  }
  for (size_t i : order_) {
    taken_[i] = 1;
    ++used;
  }
  for (size_t i = 0; i < n && used < budget; ++i)
    if (!in[i].decode) {
      taken_[i] = std::min<int64_t>(budget - used, static_cast<int64_t>(in[i].tokens.size()));
      used += taken_[i];
    }
  for (size_t i = 0; i < n; ++i) {
    const StepInput& s = in[i];
    const int64_t k = taken_[i];
    if (k == 0) continue;
    ++n_seqs_;
    (s.decode ? n_decode_ : n_prompt_) += static_cast<int32_t>(k);
    // A decode token, or a chunk that reaches the prompt's end, has its last row among outputs.
    const bool wanted = s.decode || (!s.stops_short && k == static_cast<int64_t>(s.tokens.size()));
    const int64_t body = wanted ? k - 1 : k;
    for (int64_t j = 0; j < body; ++j) {
      tokens_.push_back(s.tokens[static_cast<size_t>(j)]);
      positions_.push_back(static_cast<int32_t>(s.n_past + j));
      seqs_.push_back(s.kv_seq);
    }
    if (wanted && !s.decode) {
      tail_tok_.push_back(s.tokens[static_cast<size_t>(body)]);
      tail_pos_.push_back(static_cast<int32_t>(s.n_past + body));
      tail_seq_.push_back(s.kv_seq);
      out_row_[i] = n_wanted_++;
    }
  }
  // The decode tokens last (Session::eval_step's n_decode rows), in input order.
  for (size_t i = 0; i < n; ++i)
    if (taken_[i] != 0 && in[i].decode) {
      tail_tok_.push_back(in[i].tokens[0]);
      tail_pos_.push_back(static_cast<int32_t>(in[i].n_past));
      tail_seq_.push_back(in[i].kv_seq);
      out_row_[i] = n_wanted_++;
    }
  tokens_.insert(tokens_.end(), tail_tok_.begin(), tail_tok_.end());
  positions_.insert(positions_.end(), tail_pos_.begin(), tail_pos_.end());
  seqs_.insert(seqs_.end(), tail_seq_.begin(), tail_seq_.end());
}

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

  inputs_.clear();
  for (const auto& sp : running_) {
    const Seq& s = *sp;
    StepInput in;
    in.kv_seq = s.kv_seq;
    in.n_past = s.n_past;
    in.decode = !s.prefilling();
    in.tokens = in.decode
                    ? std::span<const int32_t>(&s.next, 1)
                    : std::span<const int32_t>(s.req.prompt).subspan(static_cast<size_t>(s.n_past));
    inputs_.push_back(in);
  }
  packer_.pack(inputs_, session_.params().n_ubatch);
  last_.n_decode = packer_.n_decode();
  last_.n_prompt = packer_.n_prompt();
  last_.n_seqs = packer_.n_seqs();

  const auto t0 = std::chrono::steady_clock::now();
  std::span<const float> logits;
  try {
    logits = session_.eval_step(packer_.tokens(), packer_.positions(), packer_.seqs(),
                                packer_.n_out(), packer_.n_decode());
  } catch (...) {
    for (size_t i = running_.size(); i-- > 0;)
      if (packer_.taken(i) != 0) finish(i, StopReason::callback);
    throw;
  }
  last_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  const int64_t n_vocab = session_.n_vocab();
  for (size_t i = 0; i < running_.size(); ++i) running_[i]->n_past += packer_.taken(i);
  std::vector<uint8_t> ended(running_.size(), 0);
  std::vector<StopReason> why(running_.size(), StopReason::n_predict);
  std::vector<int64_t> event_of(running_.size(), -1);  // this step's token event, per sequence
  for (size_t i = 0; i < running_.size(); ++i) {
    const int32_t r = packer_.out_row(i);
    if (r < 0) continue;
    Seq& s = *running_[i];
    if (s.req.n_predict >= 0 && s.n_generated >= s.req.n_predict) {
      ended[i] = 1;  // n_predict 0: the prompt only
      continue;
    }
    const std::span<const float> row = logits.subspan(
        static_cast<size_t>(r) * static_cast<size_t>(n_vocab), static_cast<size_t>(n_vocab));
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
