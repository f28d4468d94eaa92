// BatchEngine: the engine behind `berth serve`. The `-np` slots are the sequences of one runtime
// Session's KV cache (slot i is KV sequence i, for the engine's life), over the one loaded Model
// and one worker pool. One engine thread runs the batching loop: each step packs one decode token
// of every generating slot, then chunks of the prompts of slots still prefilling, up to -ub
// tokens (runtime StepPacker: continuous batching with chunked prefill), evaluates them in one
// forward pass (Session::eval_step), and samples each slot's row with the slot's own settings.
// A slot's tokens do not depend on what shares its steps (the invariance of eval_step), so a
// greedy request gives the same tokens alone or beside others. A cancelled request (a vanished
// client, a stop string) leaves its slot before the next step.
//
// Each slot keeps the tokens its KV sequence holds (SlotCache over a KvSequenceState): a request
// reuses the longest common prefix with its prompt (cache_prompt) and evaluates only the rest.
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
#include "berth/runtime/batch.h"
#include "berth/runtime/sampler.h"
#include "berth/runtime/session.h"
#include "berth/server/engine.h"
#include "berth/server/sequence_state.h"

namespace berth::server {

struct BatchEngineOptions {
  int32_t n_slots = 1;       ///< -np: KV sequences of the Session
  int64_t n_ctx = 0;         ///< -c: the total context; each slot gets n_ctx / n_slots tokens
  int32_t queue_limit = 64;  ///< --queue: requests that may wait when every slot is busy
  /// -t, -ub and the placement (device, weight_home, kv_home) of the Session; session.n_ctx and
  /// session.n_seq are ignored (set from the slots).
  SessionParams session;
};

class BatchEngine : public Engine {
 public:
  /// Builds the Session (n_seq = n_slots sequences of n_ctx / n_slots positions), takes every
  /// sequence for its slot and starts the engine thread. `model` and `tok` must outlive the
  /// engine. Throws Error(invalid_argument) for n_slots < 1, queue_limit < 0 or a per-slot context
  /// below 2 tokens (naming -c and -np); what Session's constructor throws (Error(unsupported)
  /// for several slots with KV layers on a device whose attention serves one sequence).
  BatchEngine(const Model& model, const Tokenizer& tok, BatchEngineOptions options);
  /// The per-slot context check of the constructor, for callers that check flags before building
  /// an engine: throws Error(invalid_argument) naming -c, -np and the tokens per slot when
  /// n_ctx / n_slots is below 2 (a one-token prompt and one generated token). n_slots >= 1.
  static void check_slot_context(int64_t n_ctx, int32_t n_slots);
  /// Cancels every request (each ends with FinishReason::cancelled) and joins the thread.
  ~BatchEngine() override;
  BatchEngine(const BatchEngine&) = delete;
  BatchEngine& operator=(const BatchEngine&) = delete;

  std::shared_ptr<Generation> submit(GenerationRequest request) override;
  int32_t n_slots() const override { return static_cast<int32_t>(slots_.size()); }
  int64_t n_ctx_per_slot() const override { return n_ctx_slot_; }
  int32_t queue_limit() const override { return options_.queue_limit; }
  std::vector<SlotInfo> slots() const override;
  EngineMetrics metrics() const override;
  void close() override;
  int64_t n_in_flight() const override;
  void cancel_all() override;

  /// While `on`, waiting requests stay in the queue (slots already busy go on); off, they take
  /// their slots before the next step. For tests: requests submitted while held start in the
  /// same step.
  void hold_queue(bool on);

  /// Whether a slot sampling with `s` may take the device's pick (greedy on the device, only
  /// the id comes back): greedy, without penalties, logprobs or a logit bias. Other slots need
  /// their logits on the host.
  static bool device_pickable(const SamplingSettings& s);

  /// Worker threads of the Session's pool.
  int n_threads() const { return session_->pool().n_threads(); }

 private:
  using Clock = std::chrono::steady_clock;
  struct Waiting {
    std::shared_ptr<Generation> gen;
    GenerationRequest req;
    Sampler sampler;
    Clock::time_point submitted;
  };
  struct Slot {
    int32_t id = 0;  // == its KV sequence
    std::unique_ptr<KvSequenceState> state;
    std::unique_ptr<SlotCache> cache;
    uint64_t last_used = 0;
    uint64_t admitted = 0;  // when it took its request: packing order
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
  void step();
  /// Samples the slot's next token from `logits` (its row), or takes `picked` (>= 0: the
  /// device's greedy choice; `logits` then empty), and passes it on or ends the generation.
  void sample(Slot& s, std::span<const float> logits, int32_t picked);
  void end(Slot& s, FinishReason reason);
  void fail(Slot& s, const std::string& message);
  void note_recent(Slot& s, int32_t id);

  const Model& model_;
  const Tokenizer& tok_;
  BatchEngineOptions options_;
  int64_t n_ctx_slot_ = 0;
  std::unique_ptr<Session> session_;
  std::vector<Slot> slots_;
  // The engine thread's step buffers.
  std::vector<Slot*> busy_;
  std::vector<StepInput> inputs_;
  StepPacker packer_;
  // When the last step started, if it carried decode tokens only (for decode_interval_*).
  std::optional<Clock::time_point> last_decode_start_;

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
  bool held_ = false;
  std::thread thread_;
};

}  // namespace berth::server
