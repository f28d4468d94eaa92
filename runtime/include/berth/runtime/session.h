// A session: one sequence's state (KV cache, position) over a loaded model, and the
// prefill/decode loop that turns a prompt into generated tokens.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "berth/backends/cpu_executor.h"
#include "berth/backends/thread_pool.h"
#include "berth/models/model.h"
#include "berth/models/tokenizer.h"
#include "berth/residency/direct_load.h"
#include "berth/residency/disk_tier.h"
#include "berth/residency/residency.h"
#include "berth/runtime/kv_cache.h"
#include "berth/runtime/sampler.h"
#include "berth/scheduler/scheduler.h"

namespace berth {

struct SessionParams {
  int32_t n_threads = 0;  ///< -t: workers; 0 = all physical cores
  int64_t n_ctx = 0;      ///< -c: context size in tokens; 0 = min(4096, the model's context_length)
  int32_t n_ubatch = 512;  ///< -ub: tokens per prefill step
  /// -ub was not given (the CLI's default): place() may lower n_ubatch, with a note, where the
  /// CPU's activations for it do not fit one pool (unified memory, --unified off) beside the plan.
  bool n_ubatch_auto = false;
  /// Sequences the KV cache holds (-np), each of n_ctx positions. eval() and eval_argmax() use
  /// sequence 0; eval_step() any (the batching loop, runtime/batch.h).
  int32_t n_seq = 1;
  /// Spare recurrent-state rows of the KV cache (KvCache's n_state_spare: checkpoints kept where
  /// the state lives; the server gives each slot kDeviceCheckpointsPerSlot); placement counts them
  /// with the sequences' state. No effect on a model without recurrent layers.
  int32_t n_state_spare = 0;
  /// With a device: weights and KV caches where `weight_home` (one per WeightTable entry) and
  /// `kv_home` (one per layer) say (Residency puts them there), and the Scheduler runs each op
  /// where they are. Null: CPU only.
  Device* device = nullptr;
  std::vector<placement::Home> weight_home, kv_home;
  /// Unified memory (placement/plan.h, --unified): the device reads the weights it computes in
  /// place from the host's memory (ResidencyOptions::unified); none is copied to it.
  bool unified = false;
  HybridOptions hybrid;
  /// The disk tier (residency/disk_tier.h; use_disk_tier() in runtime/placed.h fills it from
  /// the plan): its layers' moe_experts ops read their experts through a RAM cache of slots
  /// filled from the file. Empty layers: none.
  DiskTierOptions disk;
};

/// Default context when -c is 0: as llama.cpp, 4096 unless the model was trained on fewer.
int64_t default_n_ctx(const Hparams& hp);

class Session {
 public:
  /// Allocates the KV cache and the worker pool and, with a device, puts the weights and KV caches
  /// there. `model` (and params.device) must outlive the session. Throws Error(invalid_argument)
  /// for n_ubatch < 1 or n_ctx < 1 or homes that do not match the model, Error(out_of_memory)
  /// when the KV cache or the device's share cannot be allocated.
  Session(const Model& model, SessionParams params);

  /// Evaluates `tokens` at positions n_past() .. n_past() + size - 1, in ubatches of at most
  /// n_ubatch tokens. Returns the logits of the last token (n_vocab floats) or, with
  /// `all_logits`, of every token ([tokens.size(), n_vocab], row-major). The span is valid until
  /// the next call. Throws Error(invalid_argument) when the tokens do not fit in the context
  /// (naming both numbers) or an id is outside the vocabulary; on error n_past() is unchanged.
  std::span<const float> eval(std::span<const int32_t> tokens, bool all_logits = false);

  /// Evaluates one token (a decode step) and returns the argmax of its logits (ties: lowest
  /// id), as greedy sampling picks it. On a device that makes the logits, the selection runs
  /// there and only the id comes back; else as eval() followed by an argmax. Same errors as
  /// eval().
  int32_t eval_argmax(int32_t token);

  /// One step over tokens of several sequences: token i is tokens[i] at position positions[i]
  /// of sequence seqs[i] (a sequence's tokens need not be adjacent, but in this order their
  /// positions are consecutive, continuing what the KV cache holds for it). Returns the logits
  /// of the last `n_out` tokens ([n_out, n_vocab] row-major, 1 <= n_out <= tokens.size()),
  /// valid until the next call. A token's logits and the KV rows it writes do not depend on the
  /// other tokens of the step (CpuExecutor::run). Does not change n_past(). Throws
  /// Error(invalid_argument) for spans of different lengths or no tokens, n_out out of range,
  /// a sequence outside [0, n_seq), a position outside [0, n_ctx) or positions of a sequence
  /// that are not consecutive, a token id outside the vocabulary, n_decode outside
  /// [-1, tokens.size()] or a decode token whose sequence has another token in the step.
  /// n_decode: the last n_decode tokens are decode tokens (generating sequences' sampled tokens,
  /// one per sequence; StepPacker puts them last), the others prompt tokens: a device may compute
  /// a row by its kind (graph::Graph::n_decode), so a sequence gives the same bits whatever shares
  /// its step as long as each row keeps its kind. -1: 1 for a one-token step, else 0 (as eval()).
  std::span<const float> eval_step(std::span<const int32_t> tokens,
                                   std::span<const int32_t> positions,
                                   std::span<const int32_t> seqs, int32_t n_out,
                                   int32_t n_decode = -1);

  /// eval_step with one output row, the last token's, reduced to its argmax (ties: lowest id),
  /// as greedy sampling picks it: on a device that makes the logits the selection runs there
  /// and only the id comes back (Scheduler::run_argmax); else the argmax of eval_step's row.
  /// n_decode as eval_step's. Same errors as eval_step.
  int32_t eval_step_argmax(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                           std::span<const int32_t> seqs, int32_t n_decode = -1);

  /// eval_step with every output row reduced to its argmax (ties: lowest id; NaN as -inf):
  /// [n_out] token ids in row order, valid until the next step. On a device that makes the
  /// logits the selection runs there and only the ids come back (Scheduler::run_select): a
  /// server step of several greedy sequences copies 4 bytes per sequence instead of n_vocab
  /// floats and skips a host pass over each row. Same errors as eval_step.
  std::span<const int32_t> eval_step_select(std::span<const int32_t> tokens,
                                            std::span<const int32_t> positions,
                                            std::span<const int32_t> seqs, int32_t n_out,
                                            int32_t n_decode = -1);

  /// The KV cache: its pool of sequences (acquire, release, copy).
  KvCache& kv() { return kv_; }

  int64_t n_past() const { return n_past_; }
  int64_t n_ctx() const { return kv_.n_ctx(); }
  int64_t n_vocab() const { return model_.hparams().n_vocab; }
  const SessionParams& params() const { return params_; }
  /// Forgets positions >= n (0 <= n <= n_past()): later evals overwrite them. reset() ==
  /// truncate(0). A model with recurrent layers (KvCache::recurrent()) can only go back to 0
  /// (its state is zeroed) or stay at n_past(): other n throw Error(unsupported), see
  /// can_truncate().
  void truncate(int64_t n);
  void reset() { truncate(0); }
  /// Whether truncate() reaches every 0 <= n <= n_past() (false with recurrent layers).
  bool can_truncate() const { return !kv_.recurrent(); }
  /// Goes back to position n (0 <= n <= n_past()) where truncate() cannot: `state` is sequence
  /// 0's recurrent state saved when n_past() was n (kv().save_state(0)), and the tokens before n
  /// were not replaced since, so the attention layers' KV rows before n still hold them. It is
  /// written back bit for bit (on the device where the state lives there). Without recurrent
  /// layers `state` is empty and this is truncate(n). Throws Error(invalid_argument) for n
  /// outside 0..n_past(), and KvCache::restore_state's for a state of another size.
  void rewind(int64_t n, std::span<const float> state);

  /// Tokens evaluated so far in steps of more than one token (prefill) and one token (decode).
  int64_t n_prefill_tokens() const { return n_prefill_tokens_; }
  int64_t n_decode_tokens() const { return n_decode_tokens_; }
  ThreadPool& pool() { return *pool_; }
  /// The executor of the CPU side (of every op without a device).
  CpuExecutor& executor() { return scheduler_->cpu(); }
  /// What runs each step (with or without a device).
  Scheduler& scheduler() { return *scheduler_; }
  /// The device, or nullptr for a CPU-only session.
  Device* device() const { return params_.device; }
  /// Where the weights are (with a device), or nullptr.
  Residency* residency() { return residency_.get(); }
  /// The disk tier, or nullptr.
  DiskTier* disk_tier() { return disk_.get(); }
  size_t kv_bytes() const { return kv_.bytes(); }
  /// Device bytes of the KV cache's device rows.
  size_t kv_device_bytes() const { return kv_.device_bytes(); }

 private:
  const graph::Graph& graph_for(int32_t n_tokens, int32_t n_outputs, int32_t n_decode);
  /// eval_step's argument checks (its errors); returns the resolved n_decode.
  int32_t check_step(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                     std::span<const int32_t> seqs, int32_t n_out, int32_t n_decode) const;

  const Model& model_;
  SessionParams params_;
  std::unique_ptr<ThreadPool> pool_;
  KvCache kv_;
  // With a disk tier: the CPU-held weights read in with O_DIRECT (what everything below reads).
  std::unique_ptr<DirectWeights> direct_;
  std::unique_ptr<Residency> residency_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<DiskTier> disk_;  // bound to scheduler_'s CPU executor
  int64_t n_past_ = 0;
  int64_t n_prefill_tokens_ = 0, n_decode_tokens_ = 0;
  std::vector<float> logits_;
  std::vector<int32_t> positions_;
  struct CachedGraph {
    int32_t n_tokens, n_outputs, n_decode;
    graph::Graph g;
  };
  std::vector<CachedGraph> graphs_;
};

/// Why generation stopped.
enum class StopReason { eos, n_predict, context_full, callback };

struct GenerateStats {
  int64_t n_prompt = 0;        ///< prompt tokens evaluated (prefill)
  double prompt_seconds = 0;   ///< wall time of the prefill
  int64_t n_generated = 0;     ///< tokens sampled
  int64_t n_decode_steps = 0;  ///< single-token forward steps
  double decode_seconds = 0;   ///< wall time of the decode steps (forward + sampling)
  StopReason stop = StopReason::n_predict;
};

/// Called with each generated token and the text it completes (valid UTF-8, possibly empty);
/// return false to stop.
using TokenCallback = std::function<bool(int32_t token, std::string_view text)>;

/// Prefills `prompt` (after what the session already holds), then samples up to `n_predict`
/// tokens (< 0: until EOS or the context is full), streaming them to `on_token`. Stops at a
/// token the tokenizer marks end-of-generation (not passed to on_token). Throws
/// Error(invalid_argument) when the prompt alone does not fit in the context.
GenerateStats generate(Session& session, const Tokenizer& tok, Sampler& sampler,
                       std::span<const int32_t> prompt, int32_t n_predict,
                       const TokenCallback& on_token);

}  // namespace berth
