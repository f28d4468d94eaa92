// The prefix cache's view of one sequence's state, through checkpoints, so that states which
// cannot be cut back to an arbitrary position (the recurrent layers of hybrid models such as
// Qwen3.5/Qwen3-Next: a Gated DeltaNet state summarises every position it has seen) plug in
// snapshots, while attention-only models just truncate their KV cache.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <vector>

namespace berth {
class KvCache;
}

namespace berth::server {

/// A position a SequenceState can return to: the state after its first `n_past` tokens.
/// `handle` identifies what save() kept (0 for states that keep nothing).
struct Checkpoint {
  int64_t n_past = 0;
  uint64_t handle = 0;
};

/// One sequence's state (KV cache rows, recurrent state) as a prefix cache sees it. Not
/// thread-safe: the engine thread owns it.
class SequenceState {
 public:
  virtual ~SequenceState() = default;
  /// Tokens the state holds: positions 0 .. n_past() - 1.
  virtual int64_t n_past() const = 0;
  /// True when truncate_to(n) works for every 0 <= n <= n_past() (attention KV: later positions
  /// are overwritten by later evaluations). False for recurrent states, which return to earlier
  /// positions only through restore().
  virtual bool can_truncate() const = 0;
  /// Forgets positions >= n. truncate_to(0) (an empty sequence) always works; other n need
  /// can_truncate(). Throws Error(invalid_argument) for n outside 0..n_past() and
  /// Error(unsupported) for an n > 0 a recurrent state cannot reach.
  virtual void truncate_to(int64_t n) = 0;
  /// Keeps what restore() needs to return to the current position and returns its checkpoint.
  /// States that can truncate keep nothing (the KV rows of earlier positions stay valid).
  virtual Checkpoint save() = 0;
  /// Returns to `cp`, a checkpoint save() returned on this state. The caller guarantees that
  /// the tokens before cp.n_past were not replaced since (SlotCache drops checkpoints past a
  /// point it rewrites). Throws Error(invalid_argument) for a checkpoint this state cannot reach.
  virtual void restore(const Checkpoint& cp) = 0;
  /// Frees what save() kept for `cp`.
  virtual void drop(const Checkpoint& cp) = 0;
};

/// One sequence of a KV cache of attention layers only, stepped by Session::eval_step (which
/// takes each token's position, so the sequence's length is this object's bookkeeping): it
/// truncates anywhere (later steps overwrite the rows past the end), checkpoints are positions.
/// The engine calls advance() for the tokens each step evaluated.
class KvSequenceState : public SequenceState {
 public:
  explicit KvSequenceState(int64_t n_ctx) : n_ctx_(n_ctx) {}
  int64_t n_past() const override { return n_past_; }
  bool can_truncate() const override { return true; }
  void truncate_to(int64_t n) override;
  Checkpoint save() override { return Checkpoint{n_past_, 0}; }
  void restore(const Checkpoint& cp) override;
  void drop(const Checkpoint&) override {}
  /// Records `n` tokens evaluated at positions n_past() .. n_past() + n - 1. Throws
  /// Error(invalid_argument) past the sequence's n_ctx.
  void advance(int64_t n);

 protected:
  int64_t n_ctx_;
  int64_t n_past_ = 0;
};

/// Spare recurrent-state rows a server gives each slot (SessionParams::n_state_spare): its
/// newest checkpoints stay where the state lives (on the device: device-to-device copies).
inline constexpr int32_t kDeviceCheckpointsPerSlot = 2;

/// One sequence of a model with recurrent layers (KvCache::recurrent(): Qwen3.5's Gated
/// DeltaNet), stepped like KvSequenceState: its recurrent state summarises every position, so
/// it cannot truncate (truncate_to(0) zeroes it; other n throw Error(unsupported)); save()
/// copies the sequence's whole recurrent state and restore() writes it back bit for bit, the
/// attention layers' KV rows before the checkpoint being still valid (SlotCache's guarantee).
/// A checkpoint goes to one of `spare_rows` (KvCache spare state rows this sequence owns: a copy
/// where the state lives, device to device when it is on the device); with none free, the oldest
/// checkpoint on a spare row first moves to host memory (KvCache::spare_state), so the newest
/// stay on the rows; without spare rows every checkpoint is a host copy (KvCache::save_state).
/// `kv` must outlive the state; the rows must be distinct, within kv's spare rows and owned by
/// this state alone.
class RecurrentSequenceState : public KvSequenceState {
 public:
  RecurrentSequenceState(int64_t n_ctx, KvCache& kv, int32_t seq,
                         std::vector<int32_t> spare_rows = {})
      : KvSequenceState(n_ctx), kv_(kv), seq_(seq), free_rows_(std::move(spare_rows)) {}
  bool can_truncate() const override { return false; }
  void truncate_to(int64_t n) override;
  Checkpoint save() override;
  void restore(const Checkpoint& cp) override;
  void drop(const Checkpoint& cp) override;
  /// Checkpoints held, and those of them on spare rows (for tests).
  size_t n_saved() const { return saved_.size(); }
  size_t n_saved_on_rows() const;

 private:
  struct Saved {
    int64_t n_past = 0;
    int32_t row = -1;         // the spare row holding it, or -1: `host`
    std::vector<float> host;  // save_state()'s layout
  };
  KvCache& kv_;
  int32_t seq_;
  uint64_t next_handle_ = 1;
  std::vector<int32_t> free_rows_;   // owned spare rows holding no checkpoint
  std::map<uint64_t, Saved> saved_;  // by handle: oldest first
};

/// What one slot's state holds (its token ids) and how much of a new prompt it can reuse: the
/// longest common prefix of the two, reached by truncation when the state allows it, else by
/// the latest checkpoint at or before it. Keeps at most `max_checkpoints` checkpoints (the
/// oldest are dropped), taken by checkpoint() and only for states that cannot truncate.
/// BatchEngine takes one a token before the end of each prompt (the same prompt again, a retry,
/// evaluates only its last token, whose logits it needs) and one at the end of each request (the
/// reply), so the default 4 hold the latest two turns: dropping the oldest first keeps the
/// latest turn's pair and the previous reply's end, which a prompt branching off the chat
/// (a regenerated reply, an edited user message) restores.
class SlotCache {
 public:
  explicit SlotCache(SequenceState& state, int max_checkpoints = 4);
  ~SlotCache();
  SlotCache(const SlotCache&) = delete;
  SlotCache& operator=(const SlotCache&) = delete;

  /// Token ids at positions 0 .. state.n_past() - 1.
  const std::vector<int32_t>& tokens() const { return tokens_; }

  /// Length of the longest common prefix of `a` and `b`.
  static int64_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b);

  /// Readies the state for `prompt` (not empty) and returns n, the number of its leading tokens
  /// the state now holds; the caller evaluates prompt[n..] and calls append() with them. n is at
  /// most prompt.size() - 1 (the last prompt token is always evaluated: its logits are needed)
  /// and 0 when `reuse` is false.
  int64_t prepare(std::span<const int32_t> prompt, bool reuse);
  /// How much of a prompt the state shares and can bring back.
  struct PrefixReuse {
    /// The common prefix of tokens() and the prompt, at most prompt.size() - 1.
    int64_t shared = 0;
    /// What prepare(prompt, true) would return: `shared` for a state that can truncate or when
    /// the prompt continues all it holds, else the latest checkpoint at or before `shared` (0
    /// without one). restorable < shared: the slot would lose the rest of the shared prefix.
    int64_t restorable = 0;
  };
  /// The prompt's PrefixReuse, changing nothing (both 0 for an empty prompt). BatchEngine ranks
  /// free slots by it.
  PrefixReuse reuse(std::span<const int32_t> prompt) const;
  /// Records tokens the state has just evaluated after tokens().
  void append(std::span<const int32_t> evaluated);
  /// Saves a checkpoint at the current end when the state cannot truncate (no-op otherwise).
  void checkpoint();
  /// Whether checkpoint() saves anything: a state that cannot truncate, and room for one.
  bool keeps_checkpoints() const { return !state_.can_truncate() && max_checkpoints_ > 0; }
  /// Forgets everything (after a failed step, when the state's content is unknown).
  void clear();

 private:
  SequenceState& state_;
  int max_checkpoints_;
  std::vector<int32_t> tokens_;
  std::vector<Checkpoint> checkpoints_;  // ascending n_past
};

}  // namespace berth::server
