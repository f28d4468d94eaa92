// The engine behind `berth serve`: what the HTTP layer needs from whatever runs the model.
//
// The HTTP layer turns a request into token ids and sampler settings, submits them, and reads the
// generated token ids back from a Generation (a thread-safe queue the engine fills); it decodes
// text, applies stop strings and formats responses itself. An engine owns a fixed number of
// slots (llama-server's `-np`): each holds one sequence's state (its KV cache) and runs one
// request at a time; requests wait in a bounded queue when every slot is busy.
//
// The engine is BatchEngine (batch_engine.h: the slots are the sequences of one Session, and
// each step carries tokens of every busy slot).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "berth/core/error.h"
#include "berth/runtime/sampler.h"

namespace berth::server {

/// Sampling settings of one request: the runtime Sampler's chain (temperature <= 0: greedy) plus
/// OpenAI's presence and frequency penalties, applied as llama.cpp's penalties sampler does
/// (logit -= count * frequency_penalty + (count > 0) * presence_penalty, count = occurrences of
/// the token among the last `sampler.repeat_last_n` tokens of the sequence, prompt included).
struct SamplingSettings {
  SamplerParams sampler;  ///< sampler.seed 0xFFFFFFFF: a random seed
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  /// Report the log-probability of each generated token, and of the `n_top_logprobs` most
  /// likely tokens at its position, from the model's distribution (log-softmax of the raw
  /// logits, before penalties and temperature).
  bool logprobs = false;
  int32_t n_top_logprobs = 0;  ///< 0..20
  /// (token id, bias) added to that token's logit before anything else (OpenAI's logit_bias,
  /// llama.cpp's logit-bias sampler, first in its chain); -inf bans the token, and an id listed
  /// twice gets the sum. Greedy requests see the biased logits too; log-probabilities stay the
  /// model's (above).
  std::vector<std::pair<int32_t, float>> logit_bias;
};

/// One generation request: `prompt` is evaluated after whatever prefix of it a slot's cache
/// holds, then tokens are sampled until an end-of-generation token, `max_tokens`, or a full
/// slot context. Stop strings are the HTTP layer's (it cancels the Generation when one appears).
struct GenerationRequest {
  std::vector<int32_t> prompt;  ///< token ids, 1 <= size < the slot's n_ctx
  SamplingSettings sampling;
  int64_t max_tokens = -1;  ///< tokens to generate at most; -1: until EOS or the context is full
  /// Ids that end generation like the vocabulary's end-of-generation tokens (a chat format's
  /// end-of-turn tokens); neither kind is passed on as a generated token.
  std::vector<int32_t> stop_ids;
  /// Generate past end-of-generation tokens (they are passed on and evaluated like any token;
  /// stop_ids still end generation): llama-server's ignore_eos, for benchmarks.
  bool ignore_eos = false;
  bool cache_prompt = true;  ///< reuse the longest common prefix a slot's cache holds
  int32_t slot = -1;         ///< -1: any slot; else wait for that slot (0..n_slots-1)
};

/// Why a generation ended.
enum class FinishReason {
  eos,        ///< an end-of-generation token or one of GenerationRequest::stop_ids
  length,     ///< max_tokens tokens were generated
  context,    ///< the slot's context is full
  cancelled,  ///< Generation::cancel() (a stop string, a vanished client, shutdown)
};

/// One generated token.
struct GeneratedToken {
  int32_t id = -1;
  float logprob = 0.0f;                        ///< with SamplingSettings::logprobs
  std::vector<std::pair<int32_t, float>> top;  ///< (id, logprob), most likely first
};

/// Timings of one generation, for responses and /metrics.
struct GenerationTimings {
  int64_t n_prompt = 0;     ///< prompt tokens of the request
  int64_t n_cached = 0;     ///< of those, reused from the slot's cache (not evaluated)
  int64_t n_evaluated = 0;  ///< prompt tokens evaluated: n_prompt - n_cached
  double prompt_ms = 0;     ///< wall time of the prefill steps of this request
  int64_t n_predicted = 0;  ///< tokens sampled (including a final end-of-generation token)
  double predicted_ms = 0;  ///< wall time of this request's decode steps (forward + sampling)
  double queued_ms = 0;     ///< from submit() until a slot took the request
};

/// What a consumer sees of a Generation at one moment (see Generation::wait).
struct GenerationUpdate {
  bool started = false;  ///< a slot took the request (slot and timings.n_cached are set)
  int32_t slot = -1;
  int64_t n_prompt_done = 0;  ///< prompt tokens in the slot's state so far (cached + evaluated)
  bool progressed = false;    ///< prefill advanced since the last wait() (a chunk of -ub tokens)
  std::vector<GeneratedToken> tokens;          ///< tokens generated since the last wait()
  bool done = false;                           ///< no more tokens will come
  FinishReason finish = FinishReason::length;  ///< valid when done and !error
  std::optional<std::string> error;            ///< the engine failed this request (done too)
  GenerationTimings timings;                   ///< valid when done
};

/// A submitted request's output: the engine pushes, one consumer (an HTTP thread) waits. All
/// members are thread-safe.
class Generation {
 public:
  explicit Generation(uint64_t id) : id_(id) {}
  uint64_t id() const { return id_; }

  // --- consumer ---
  /// Waits until something new happened or `timeout` passed, and returns it: tokens are handed
  /// over once (the next wait() returns only later ones); started/slot/n_prompt_done/done/
  /// finish/error/timings describe the current state.
  GenerationUpdate wait(std::chrono::milliseconds timeout);
  /// Asks the engine to drop the request: it stops within one step (FinishReason::cancelled)
  /// and frees the slot. A no-op once done.
  void cancel() { cancelled_.store(true, std::memory_order_relaxed); }
  bool cancelled() const { return cancelled_.load(std::memory_order_relaxed); }

  // --- producer (the engine) ---
  void start(int32_t slot, int64_t n_cached, double queued_ms);
  void progress(int64_t n_prompt_done);
  void push(GeneratedToken token);
  void finish(FinishReason reason, const GenerationTimings& timings);
  void fail(std::string message, const GenerationTimings& timings);

 private:
  const uint64_t id_;
  std::atomic<bool> cancelled_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  GenerationUpdate state_;  // tokens: not yet handed over
  bool changed_ = false;
};

/// A request the engine refuses at submit(), before anything runs.
class Rejected : public Error {
 public:
  enum class Reason {
    invalid,           ///< a bad field (message names it): HTTP 400
    context_exceeded,  ///< the prompt does not fit in a slot's context: HTTP 400
    queue_full,        ///< every slot is busy and the queue is full: HTTP 503
    shutting_down,     ///< the engine no longer takes requests: HTTP 503
  };
  Rejected(Reason reason, const std::string& message, int64_t n_prompt = 0, int64_t n_ctx = 0)
      : Error(ErrorCategory::invalid_argument, message),
        reason_(reason),
        n_prompt_(n_prompt),
        n_ctx_(n_ctx) {}
  Reason reason() const { return reason_; }
  int64_t n_prompt() const { return n_prompt_; }  ///< context_exceeded: prompt tokens
  int64_t n_ctx() const { return n_ctx_; }        ///< context_exceeded: a slot's context

 private:
  Reason reason_;
  int64_t n_prompt_, n_ctx_;
};

/// One slot as /slots shows it.
struct SlotInfo {
  int32_t id = 0;
  int64_t n_ctx = 0;  ///< tokens
  bool is_processing = false;
  uint64_t id_task = 0;  ///< the Generation id it runs (when processing)
  int64_t n_cached = 0;  ///< tokens its cache holds
};

/// Counters since start, for /metrics (Prometheus names in http_server.cpp).
struct EngineMetrics {
  int64_t prompt_tokens_total = 0;  ///< prompt tokens evaluated
  double prompt_seconds_total = 0;
  int64_t tokens_predicted_total = 0;  ///< tokens sampled
  double tokens_predicted_seconds_total = 0;
  int64_t n_decode_total = 0;  ///< forward steps (prefill chunks and decode steps)
  int64_t n_cached_total = 0;  ///< prompt tokens reused from slot caches
  /// Sum over forward steps of the slots each carried (/ n_decode_total: the mean batch).
  int64_t n_step_seqs_total = 0;
  int32_t max_step_seqs = 0;  ///< the most slots one forward step carried
  /// Tokens the device picked (greedy, one output row in the step: only the id came back).
  int64_t tokens_device_picked_total = 0;
  /// Steps of decode tokens only: how many, their rows summed, and the time of their forward
  /// pass (Session::eval_step*), seconds.
  int64_t decode_steps_total = 0;
  int64_t decode_rows_total = 0;
  double decode_step_seconds_total = 0;
  /// From the start of a decode-only step to the start of the next when that is one too (the
  /// forward pass plus the engine's host work between steps), seconds; how many such pairs.
  int64_t decode_intervals_total = 0;
  double decode_interval_seconds_total = 0;
  int64_t requests_processing = 0;  ///< now: requests in a slot
  int64_t requests_deferred = 0;    ///< now: requests waiting for a slot
};

class Engine {
 public:
  virtual ~Engine() = default;

  /// Queues `request`. Checks it first and throws Rejected: invalid (empty prompt, a token id
  /// outside the vocabulary, max_tokens < -1, slot outside 0..n_slots()-1, bad sampler
  /// settings, a logit_bias id outside the vocabulary or bias NaN or +inf), context_exceeded
  /// (prompt.size() >= n_ctx_per_slot(), with both numbers), queue_full (n_slots() requests run and
  /// queue_limit() wait), shutting_down. Once it returns, the request runs and its Generation ends
  /// with done (finish or error).
  virtual std::shared_ptr<Generation> submit(GenerationRequest request) = 0;

  virtual int32_t n_slots() const = 0;
  virtual int64_t n_ctx_per_slot() const = 0;  ///< tokens
  virtual int32_t queue_limit() const = 0;     ///< requests that may wait beyond the slots
  virtual std::vector<SlotInfo> slots() const = 0;
  virtual EngineMetrics metrics() const = 0;

  /// Stops taking requests (submit throws shutting_down); requests already submitted go on.
  virtual void close() = 0;
  /// Requests submitted and not yet done (running or waiting).
  virtual int64_t n_in_flight() const = 0;
  /// Cancels every request not yet done.
  virtual void cancel_all() = 0;
};

}  // namespace berth::server
