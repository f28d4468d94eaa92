// SlotEngine: the simple engine behind `berth serve` until the batching loop exists (several
// sequences in one step). Each of the `-np` slots is a runtime Session of its own (its own KV
// cache of n_ctx / n_slots positions and, because Session owns one, its own worker pool) over the
// one loaded Model. One engine thread advances every busy slot by one step in turn: a prefill
// chunk of at most n_ubatch prompt tokens, or one decode token. So each request makes progress
// every round, and a cancelled request (a vanished client) leaves its slot within one step.
//
// Limits (until the batching loop replaces it): slots never share a forward pass, so aggregate
// throughput is that of one sequence; with a device each Session would upload its own copy of
// the weights, so more than one slot is refused on a CUDA device (allowed on the CPU and on
// BERTH_SIM_DEVICE, whose tests need it).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "berth/models/model.h"
#include "berth/models/tokenizer.h"
#include "berth/runtime/sampler.h"
#include "berth/runtime/session.h"
#include "berth/server/engine.h"
#include "berth/server/sequence_state.h"

namespace berth::server {

struct SlotEngineOptions {
  int32_t n_slots = 1;       ///< -np
  int64_t n_ctx = 0;         ///< -c: the total context; each slot gets n_ctx / n_slots tokens
  int32_t queue_limit = 64;  ///< --queue: requests that may wait when every slot is busy
  /// -t, -ub and the placement (device, weight_home, kv_home) of every slot's Session;
  /// session.n_ctx is ignored (set per slot).
  SessionParams session;
};

class SlotEngine : public Engine {
 public:
  /// Builds the slots' Sessions and starts the engine thread. `model` and `tok` must outlive
  /// the engine. Throws Error(invalid_argument) for n_slots < 1, queue_limit < 0 or a per-slot
  /// context below 2 tokens (naming -c and -np); Error(unsupported) for n_slots > 1 with a
  /// device other than the simulated one; what Session's constructor throws.
  SlotEngine(const Model& model, const Tokenizer& tok, SlotEngineOptions options);
  /// Cancels every request (each ends with FinishReason::cancelled) and joins the thread.
  ~SlotEngine() override;
  SlotEngine(const SlotEngine&) = delete;
  SlotEngine& operator=(const SlotEngine&) = delete;

  std::shared_ptr<Generation> submit(GenerationRequest request) override;
  int32_t n_slots() const override { return static_cast<int32_t>(slots_.size()); }
  int64_t n_ctx_per_slot() const override { return n_ctx_slot_; }
  int32_t queue_limit() const override { return options_.queue_limit; }
  std::vector<SlotInfo> slots() const override;
  EngineMetrics metrics() const override;
  void close() override;
  int64_t n_in_flight() const override;
  void cancel_all() override;

  /// Worker threads of each slot's pool.
  int n_threads() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Waiting {
    std::shared_ptr<Generation> gen;
    GenerationRequest req;
    Sampler sampler;
    Clock::time_point submitted;
  };
  struct Slot {
    int32_t id = 0;
    std::unique_ptr<Session> session;
    std::unique_ptr<SessionSequenceState> state;
    std::unique_ptr<SlotCache> cache;
    uint64_t last_used = 0;
    // The request it runs (gen null: idle).
    std::shared_ptr<Generation> gen;
    GenerationRequest req;
    std::optional<Sampler> sampler;
    int64_t n_prompt_done = 0;   // prompt tokens the state holds
    int32_t pending = -1;        // sampled, not yet evaluated
    std::deque<int32_t> recent;  // the penalty window: last repeat_last_n tokens
    std::vector<float> scratch;  // penalised logits
    GenerationTimings t;
  };

  void loop();
  void assign_locked();
  void step(Slot& s);
  void sample(Slot& s, std::span<const float> logits);
  void end(Slot& s, FinishReason reason);
  void fail(Slot& s, const std::string& message);
  void note_recent(Slot& s, int32_t id);

  const Model& model_;
  const Tokenizer& tok_;
  SlotEngineOptions options_;
  int64_t n_ctx_slot_ = 0;
  std::vector<Slot> slots_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Waiting> waiting_;
  std::vector<SlotInfo> info_;  // what slots() reports, updated by the engine thread
  EngineMetrics metrics_;
  uint64_t next_id_ = 1;
  uint64_t use_counter_ = 0;
  int64_t n_busy_ = 0;
  bool closed_ = false;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace berth::server
