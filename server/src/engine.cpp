#include "berth/server/engine.h"

namespace berth::server {

GenerationUpdate Generation::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!changed_) cv_.wait_for(lock, timeout, [this] { return changed_; });
  GenerationUpdate out;
  out.started = state_.started;
  out.slot = state_.slot;
  out.n_prompt_done = state_.n_prompt_done;
  out.progressed = state_.progressed;
  out.tokens = std::move(state_.tokens);
  out.done = state_.done;
  out.finish = state_.finish;
  out.error = state_.error;
  out.timings = state_.timings;
  state_.tokens.clear();
  state_.progressed = false;
  changed_ = false;
  return out;
}

void Generation::start(int32_t slot, int64_t n_cached, double queued_ms) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    state_.started = true;
    state_.slot = slot;
    state_.n_prompt_done = n_cached;
    state_.timings.n_cached = n_cached;
    state_.timings.queued_ms = queued_ms;
    changed_ = true;
  }
  cv_.notify_all();
}

void Generation::progress(int64_t n_prompt_done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    state_.n_prompt_done = n_prompt_done;
    state_.progressed = true;
    changed_ = true;
  }
  cv_.notify_all();
}

void Generation::push(GeneratedToken token) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    state_.tokens.push_back(std::move(token));
    changed_ = true;
  }
  cv_.notify_all();
}

void Generation::finish(FinishReason reason, const GenerationTimings& timings) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    state_.done = true;
    state_.finish = reason;
    state_.timings = timings;
    changed_ = true;
  }
  cv_.notify_all();
}

void Generation::fail(std::string message, const GenerationTimings& timings) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    state_.done = true;
    state_.error = std::move(message);
    state_.timings = timings;
    changed_ = true;
  }
  cv_.notify_all();
}

}  // namespace berth::server
