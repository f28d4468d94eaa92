// The batching loop: many sequences generating at once over one Session, a step at a time.
//
// Each step packs one decode token for every sequence that is generating, then chunks of the
// prompts of sequences still prefilling, up to the session's ubatch size (-ub): continuous
// batching with chunked prefill. Requests wait in a queue until the KV cache has a free
// sequence (SessionParams::n_seq, llama-server's -np), join between steps, and leave when they
// stop (end of generation, n_predict, a full context, cancel), giving their sequence back. Each
// sequence samples with its own SamplerParams and seed.
//
// A sequence's tokens and logits do not depend on the batch: every row of a step computes as
// it would alone (CpuExecutor::run), and a prompt's chunk boundaries change no bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "berth/models/tokenizer.h"
#include "berth/runtime/sampler.h"
#include "berth/runtime/session.h"

namespace berth {

/// One sequence's offer to a step (StepPacker::pack): `tokens` continue KV sequence `kv_seq` at
/// position `n_past`: the rest of its prompt while it prefills, or the one token it sampled last.
struct StepInput {
  int32_t kv_seq = 0;
  int64_t n_past = 0;
  std::span<const int32_t> tokens;  ///< at least one
  bool decode = false;              ///< a generating sequence's token (exactly one)
  /// A prompt input whose `tokens` stop short of its prompt's end: no output row even when the
  /// step takes all of them (the server's engine holds a prompt's last token back for a step
  /// of its own, to checkpoint a recurrent state just before it).
  bool stops_short = false;
};

/// Packs one step of several sequences (continuous batching with chunked prefill): the decode
/// token of every generating input first (more of them than the budget: they take turns, by KV
/// sequence id), then chunks of the prompts, in input order, up to a budget of tokens (-ub). Rows
/// whose logits are wanted go at the end of the step so that Session::eval_step returns them as
/// its last rows: first the last token of each prompt that ends here (input order), then the
/// decode tokens (input order), which are thus the step's last n_decode() rows (eval_step's
/// n_decode); a chunk's other tokens go first. BatchLoop and the server's engine pack with it.
class StepPacker {
 public:
  /// Packs a step from `in` (inputs of distinct sequences) of at most `budget` tokens.
  void pack(std::span<const StepInput> in, int64_t budget);

  /// The step, for Session::eval_step (valid until the next pack()).
  std::span<const int32_t> tokens() const { return tokens_; }
  std::span<const int32_t> positions() const { return positions_; }
  std::span<const int32_t> seqs() const { return seqs_; }
  bool empty() const { return tokens_.empty(); }
  /// Tokens of input i in the step (0: none; a decode input: 0 or 1).
  int64_t taken(size_t i) const { return taken_[i]; }
  /// The row, among the step's outputs, of input i's last token when its logits are wanted (a
  /// decode token, a chunk that ends a prompt), else -1.
  int32_t out_row(size_t i) const { return out_row_[i]; }
  /// Output rows to ask eval_step for: the wanted ones, at least 1 (a step of prompt chunks only
  /// still makes one row, unused).
  int32_t n_out() const { return std::max(n_wanted_, 1); }
  int32_t n_decode() const { return n_decode_; }  ///< decode tokens in the step
  int32_t n_prompt() const { return n_prompt_; }  ///< prompt tokens in the step
  int32_t n_seqs() const { return n_seqs_; }      ///< inputs with tokens in the step

 private:
  std::vector<int32_t> tokens_, positions_, seqs_;
  std::vector<int32_t> tail_tok_, tail_pos_, tail_seq_;
  std::vector<int64_t> taken_;
  std::vector<int32_t> out_row_;
  std::vector<size_t> order_;     // the decode inputs this step takes
  int32_t last_decode_seq_ = -1;  // the KV sequence whose decode token was taken last in a turn
  int32_t n_wanted_ = 0, n_decode_ = 0, n_prompt_ = 0, n_seqs_ = 0;
};

struct BatchRequest {
  std::vector<int32_t> prompt;  ///< token ids (at least one, fewer than the per-sequence n_ctx)
  SamplerParams sampling;
  int32_t n_predict = -1;  ///< tokens to generate; < 0: until end of generation or a full context
};

/// What one step did for one sequence: a token sampled (token >= 0) and/or the sequence ended.
struct BatchEvent {
  int64_t id = 0;      ///< BatchLoop::submit's id
  int32_t token = -1;  ///< the sampled token (not an end-of-generation token), or -1
  bool done = false;   ///< the sequence ended at this step (`stop` says why)
  StopReason stop = StopReason::n_predict;
};

class BatchLoop {
 public:
  /// Runs sequences on `session` (its n_seq sequences, all of them free: the loop acquires and
  /// releases them). `tok` (optional) marks end-of-generation tokens. Both must outlive the loop.
  explicit BatchLoop(Session& session, const Tokenizer* tok = nullptr);
  ~BatchLoop();
  BatchLoop(const BatchLoop&) = delete;
  BatchLoop& operator=(const BatchLoop&) = delete;

  /// Queues a request; returns its id (1, 2, ...). Throws Error(invalid_argument) for an empty
  /// prompt, a prompt of n_ctx tokens or more (naming both), a token outside the vocabulary, or
  /// sampler settings Sampler rejects.
  int64_t submit(BatchRequest request);
  /// Ends request `id` (queued or running) before the next step; its sequence is freed. Its
  /// last event is {id, -1, done, callback}. Unknown or finished ids are ignored.
  void cancel(int64_t id);

  /// Runs one step and returns what it produced, in the order of the sequences' admission
  /// (valid until the next call). Empty when there is nothing to do (idle()). Rethrows a step's
  /// error (the sequences of that step are then ended with StopReason::callback).
  const std::vector<BatchEvent>& step();
  /// No request queued or running.
  bool idle() const { return queue_.empty() && running_.empty(); }
  size_t n_running() const { return running_.size(); }
  size_t n_queued() const { return queue_.size(); }

  /// Called for each output row of a step with the request id and its logits (n_vocab floats),
  /// before sampling; for tests and logprobs. Null: off.
  std::function<void(int64_t id, std::span<const float> logits)> on_logits;

  /// The last step's composition.
  struct StepStats {
    int32_t n_decode = 0;  ///< generating sequences' tokens
    int32_t n_prompt = 0;  ///< prompt tokens
    int32_t n_seqs = 0;    ///< distinct sequences in the step
    double seconds = 0;    ///< wall time of the forward step
  };
  const StepStats& last_step() const { return last_; }

 private:
  struct Seq;
  void admit();
  void finish(size_t i, StopReason why);

  Session& session_;
  const Tokenizer* tok_;
  int64_t next_id_ = 1;
  std::deque<std::unique_ptr<Seq>> queue_;
  std::vector<std::unique_ptr<Seq>> running_;
  std::vector<BatchEvent> events_;
  std::vector<StepInput> inputs_;
  StepPacker packer_;
  StepStats last_;
};

}  // namespace berth
