// Executes step graphs on the CPU worker pool.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "berth/backends/kv_view.h"
#include "berth/backends/thread_pool.h"
#include "berth/graph/graph.h"

namespace berth {

/// Runs graphs op by op, each op split across the pool (matmul by output row tiles, attention by
/// (token, head), norms and rope by token). Activation buffers are kept between runs and only
/// grow. Weights are read in place (host memory, e.g. the GGUF mapping).
class CpuExecutor {
 public:
  /// `weights`, `kv` (its host rows: layer l's K and V, f32) and `pool` must outlive the
  /// executor.
  CpuExecutor(ThreadPool& pool, const graph::WeightTable& weights, const KvView& kv);

  /// Runs `g` on the ubatch `tokens` at `positions` of the sequences `seqs` (all n_tokens long;
  /// `seqs` empty: every token is sequence 0). Each token's key and value go to its sequence's
  /// rows of the KV cache, and it attends to its sequence's positions 0..its own. A sequence's
  /// tokens need not be adjacent in the ubatch, but in ubatch order their positions must be
  /// consecutive (p, p + 1, ...), all < kv.n_ctx. A row's arithmetic depends only on its token,
  /// position and sequence's cache, never on the other rows of the step. Returns the output
  /// value, [rows, n_vocab] row-major, valid until the next run. Throws Error(invalid_argument)
  /// for a token id outside the vocabulary, a position outside the context, a sequence outside
  /// the cache or positions of a sequence that are not consecutive.
  std::span<const float> run(const graph::Graph& g, std::span<const int32_t> tokens,
                             std::span<const int32_t> positions,
                             std::span<const int32_t> seqs = {});

  /// For an executor that runs part of a step elsewhere (the Scheduler): starts a step of `g`
  /// whose values live at `value_ptrs` (one per value of g, caller-owned, nullptr for values
  /// no CPU op touches). run_subset() then runs some of g's ops on those buffers.
  void begin_external(const graph::Graph& g, std::span<float* const> value_ptrs);
  /// Runs the ops of `g` at `op_indices` (ascending) of the step begun by begin_external(), on
  /// the ubatch `tokens`/`positions`/`seqs` (validated by the caller with check_ubatch()).
  void run_subset(const graph::Graph& g, std::span<const int32_t> op_indices,
                  std::span<const int32_t> tokens, std::span<const int32_t> positions,
                  std::span<const int32_t> seqs = {});
  /// Throws Error(invalid_argument) as run() does for a ubatch that does not fit `g` or the
  /// context.
  void check_ubatch(const graph::Graph& g, std::span<const int32_t> tokens,
                    std::span<const int32_t> positions, std::span<const int32_t> seqs = {}) const;

  /// Routed-expert reads of the moe_experts ops since the last reset_moe_reads(): an op reads
  /// an expert's gate, up and down rows once for all the step's tokens routed to it (the
  /// tokens are grouped by expert), so `experts` counts (op call, distinct expert) pairs and
  /// `bytes` their weight bytes (gate + up + down slices, as stored).
  struct MoeReads {
    int64_t calls = 0;    ///< moe_experts op calls
    int64_t experts = 0;  ///< distinct experts computed, summed over the calls
    int64_t pairs = 0;    ///< (token, expert) pairs computed
    int64_t bytes = 0;    ///< expert weight bytes read
  };
  const MoeReads& moe_reads() const { return moe_reads_; }
  void reset_moe_reads() { moe_reads_ = {}; }

  /// A layer with expert slots (residency/expert_slots.h) as its CPU side sees it: the host
  /// mirror of the expert->slot table (int32 [n_expert]: slot >= 0 or -1; read by moe_experts
  /// ops over ExpertSet::resident / not_resident, and not changed by anyone while a step runs)
  /// and what the CPU op records of each step's routing for the residency policy: every
  /// (token, slot j) pair of its slot range appends the token's expert ids to `route_log`
  /// (n_expert_used uint16 per token, top-k order; once per token), and adds to `calls` (all of
  /// the range's routed calls) and `device_calls` (those whose expert the table marks
  /// resident). The pointers must outlive the executor's steps; they are written on the thread
  /// that runs the op.
  struct ExpertTable {
    const int32_t* table = nullptr;
    int32_t n_expert = 0;
    std::vector<uint16_t>* route_log = nullptr;
    int64_t* calls = nullptr;
    int64_t* device_calls = nullptr;
  };
  /// Where a moe_experts op finds its experts' weights when they are not all in the tensors'
  /// own memory (the disk tier's RAM cache, residency/disk_tier.h). Called on the thread that
  /// runs the op, once per op: will_need(), then per group of at most capacity() experts
  /// acquire() ... release().
  class ExpertSource {
   public:
    virtual ~ExpertSource() = default;
    /// The most experts one acquire() may hold (>= 1).
    virtual int32_t capacity() const = 0;
    /// The routing of this op is known: `experts` (distinct, ascending) will be computed,
    /// `tokens[i]` tokens routed to experts[i]; `h` is the op's input [n_tok, n_embd] (f32,
    /// row-major), valid until the op ends. Lets the source start reads early (and guess the
    /// next layer's). The source may reorder `experts` with `tokens` (e.g. those in memory
    /// first): the op computes them in that order, in groups of capacity() experts, or of
    /// capacity() / 2 (at least 1) when it needs more than capacity(), so that the source can
    /// read the next group while one computes. The order never changes results (each token's
    /// outputs are combined in its slot order). Must not throw for I/O: read errors are
    /// reported by acquire().
    virtual void will_need(std::span<int32_t> experts, std::span<int64_t> tokens, const float* h,
                           int64_t n_tok) = 0;
    /// Makes `experts` (a subset of will_need's, at most capacity()) readable and writes each
    /// one's gate, up and down slice addresses (as stored: expert e's rows of the stacked
    /// tensors, gate/up n_ff rows of n_embd, down n_embd rows of n_ff) to out[i]; they stay
    /// valid and unchanged until release(). May block on reads. Throws Error(io) naming the
    /// file, tensor and offset of a failed read.
    virtual void acquire(std::span<const int32_t> experts,
                         std::span<std::array<const uint8_t*, 3>> out) = 0;
    /// The experts of the last acquire() are no longer read.
    virtual void release() = 0;
  };
  /// Binds `src` (not owned; null unbinds; must outlive the executor's steps) to the layer whose
  /// ffn_gate_exps is weight `gate`: its moe_experts ops read expert weights through it, in
  /// groups of at most src->capacity() experts (one parallel region per group). Throws
  /// Error(invalid_argument) for a weight id outside the table.
  void bind_expert_source(graph::WeightId gate, ExpertSource* src);

  /// Binds `t` to the layer whose ffn_gate_exps is weight `gate`. Throws
  /// Error(invalid_argument) for a null table or a weight id outside the table.
  void bind_expert_table(graph::WeightId gate, const ExpertTable& t);

  /// Forced routing (a routing trace replayed): from now on, moe_route op number r of a step's
  /// graph (r counts the graph's moe_route ops in op order) selects, for the step's token t, the
  /// experts ids[(r * n_tokens + t) * k + j], j < k (k = the op's n_expert_used; each id in
  /// [0, n_expert), distinct per token: the caller's check), with the weights moe_topk would give
  /// them (cpu::moe_forced). `n_tokens` must be the step's token count. Null `ids`: the router
  /// selects again. The memory must stay valid while steps run.
  void set_forced_routes(const int32_t* ids, int64_t n_tokens) {
    forced_ids_ = ids;
    forced_tokens_ = n_tokens;
  }

  /// Value `v` of the last run() of graph `g` ([rows, cols] row-major): the output or a
  /// layer's routing (a moe_route output; graph::kept_after_step), after run() or a step begun
  /// by begin_external (whose caller reuses the bytes of the others too: the Scheduler's host
  /// arena). Throws Error(invalid_argument) for an id that graph does not have, or a value the
  /// step did not keep (its bytes were reused by later ops: graph::step_arena).
  std::span<const float> value(const graph::Graph& g, graph::ValueId v) const;

  /// Op timing: when on, run() adds each op's wall time to its kind's total.
  void set_profiling(bool on) { profiling_ = on; }
  struct OpTime {
    std::string kind;  ///< graph::op_name
    double seconds = 0;
    int64_t calls = 0;
  };
  /// Totals per op kind since the last reset_profile() (kinds that ran, by descending time).
  std::vector<OpTime> profile() const;
  void reset_profile() {
    prof_ = {};
    moe_timing_ = {};
  }

  /// Where the time of moe_experts goes, summed over its calls since the last reset_profile()
  /// (always collected: a few clock reads per call and per thread). Seconds. The expert FFN is
  /// one parallel region: `region` is its wall time on the calling thread; per thread (summed
  /// over the threads that took part, `thread_calls` of them in all), `join` is the time from
  /// the region's start to the thread's first task (pool wake-up), `wait` the time down blocks
  /// spun for their expert's gate/up, and `tail` the time from the thread's last task to the
  /// region's end. `before` is the routing, grouping and activation quantization before the
  /// region, `after` the combine after it; `combined_in_region` counts the calls whose combine
  /// ran inside the region instead (row block by row block, when the down blocks split n_embd).
  struct MoeTiming {
    int64_t calls = 0, thread_calls = 0, combined_in_region = 0;
    double total = 0, before = 0, region = 0, after = 0;
    double join = 0, wait = 0, tail = 0;
  };
  const MoeTiming& moe_timing() const { return moe_timing_; }

 private:
  /// Runs the ops at `subset` (ascending indices; empty = every op of g).
  void run_ops(const graph::Graph& g, std::span<const int32_t> subset,
               std::span<const int32_t> tokens, std::span<const int32_t> positions,
               std::span<const int32_t> seqs);
  void run_op(const graph::Graph& g, const graph::Op& op, std::span<const int32_t> tokens,
              std::span<const int32_t> positions, std::span<const int32_t> seqs);
  /// The attention op over the step's tokens (see run()).
  void attention(const graph::Op& op, const float* q, const float* k, const float* v, int64_t n_tok,
                 int64_t cols, float* out, std::span<const int32_t> positions,
                 std::span<const int32_t> seqs);
  /// ssm_conv / gated_delta over the step's tokens: each sequence's tokens in ubatch order
  /// against its recurrent state of op.ssm.layer (KvView::conv / ssm), zeroed at position 0.
  void ssm_conv(const graph::Op& op, const float* x, int64_t n_tok, int64_t cols, float* out,
                std::span<const int32_t> positions, std::span<const int32_t> seqs);
  void gated_delta(const graph::Op& op, const float* y, const float* alpha, const float* b,
                   int64_t n_tok, float* out, std::span<const int32_t> positions,
                   std::span<const int32_t> seqs);
  /// runs_ for the step: maximal stretches of adjacent tokens of one sequence; Run::base holds
  /// the sequence id.
  void seq_runs(int64_t n_tok, std::span<const int32_t> seqs);
  float* buf(graph::ValueId v) { return ptrs_[static_cast<size_t>(v)]; }
  const int32_t* forced_ids_ = nullptr;
  int64_t forced_tokens_ = 0;
  float* worker_scratch(size_t floats);
  /// Matmul ops reading the same input (one op, or consecutive ones such as Q/K/V), run as one
  /// parallel region: out [n_tok, n_rows(w)] = x [n_tok, ne0(w)] times w's rows for each op;
  /// activations quantized once per partner format, then row blocks of every weight (about 4
  /// per thread, whole kGemmRowTile tiles) as one task list, each a cache-tiled gemm_rows.
  void matmul_group(const graph::Graph& g, std::span<const graph::Op> ops);

  /// out [n_tok, n_embd] = the routed experts of `p` applied to h [n_tok, n_embd] with the
  /// moe_route output `route` [n_tok, 2k]: pairs grouped by expert, each expert's gate/up/down
  /// a grouped GEMM over its tokens split in row blocks across the pool, combined per token in
  /// slot order.
  void moe_experts(const graph::MoeParams& p, const float* h, const float* route, int64_t n_tok,
                   float* out);

  ThreadPool& pool_;
  const graph::WeightTable& weights_;
  const KvView& kv_;
  std::vector<float> arena_;                 // run()'s values, by graph::step_arena; grows only
  std::vector<size_t> offsets_;              // run()'s value offsets into arena_, bytes
  std::vector<uint8_t> readable_;            // per value: value() may read it after the step
  std::vector<float*> ptrs_;                 // where each value of the current step lives
  std::vector<std::vector<float>> scratch_;  // one per worker
  std::vector<float> small_weight_;          // decoded norm weights
  std::vector<uint8_t> act_;                 // quantized activations of the current matmul
  // moe_experts scratch: per-expert slot offsets, slots (token * k + j) grouped by expert,
  // quantized activations for up (when its format differs from gate's) and down, gate/up
  // outputs by pair, expert outputs by slot.
  std::vector<int64_t> moe_first_, moe_slots_, moe_fill_;
  std::vector<uint8_t> moe_mask_;              // per expert: this op computes it
  std::vector<ExpertTable> expert_tables_;     // per WeightId (gate) of layers with expert slots
  std::vector<ExpertSource*> expert_sources_;  // per WeightId (gate) of layers with a source
  std::vector<std::array<const uint8_t*, 3>> moe_wptr_;    // per expert: gate, up, down slice
  std::vector<std::array<const uint8_t*, 3>> moe_wgroup_;  // an ExpertSource group's, in order
  std::vector<int32_t> moe_active_;                        // experts the op computes
  std::vector<int64_t> moe_tok_count_;                     // tokens per active expert
  struct MoeTask {  // one (expert, block of output rows) of gate+up or of down
    int32_t e;
    int64_t r0, r1;
  };
  std::vector<MoeTask> moe_tasks_up_, moe_tasks_down_;
  std::vector<uint8_t> moe_act_u_, moe_act_d_, moe_act_tok_;
  std::vector<float> moe_gate_, moe_up_, moe_y_;
  // Per expert: gate/up blocks left, and "ready for down" (one parallel region per MoE layer).
  std::unique_ptr<std::atomic<int32_t>[]> moe_up_left_, moe_ready_;
  int32_t moe_n_flags_ = 0;
  // Per down row block: experts whose down block is not yet written (combine in the region).
  std::unique_ptr<std::atomic<int32_t>[]> moe_block_left_;
  int64_t moe_n_blocks_ = 0;
  // RoPE cos/sin per token of the current run ([rows][cos n_rot/2 | sin n_rot/2]), for one
  // (n_rot, freq_base): rebuilt at each run (new positions) and when the shape changes.
  std::vector<float> rope_tables_;
  int32_t rope_n_rot_ = 0;
  float rope_base_ = 0;
  uint64_t run_count_ = 0, rope_run_ = 0;
  static constexpr size_t kOpKinds = static_cast<size_t>(graph::OpKind::rms_norm_gated) + 1;
  // gated_delta: L2-normalised q and k heads [n_tok, 2 * H_k * d_k], gates g and beta
  // [n_tok, H_v] each.
  std::vector<float> gdn_qk_, gdn_g_, gdn_beta_;
  bool profiling_ = false;
  std::array<OpTime, kOpKinds> prof_{};
  MoeTiming moe_timing_;
  MoeReads moe_reads_;
  // attention: the rows of the step's runs (maximal stretches of adjacent tokens of one sequence)
  struct Run {
    int64_t t0, n;  // first token, tokens
    int64_t base;   // KV row of the sequence's position 0
  };
  std::vector<Run> runs_;
  std::vector<int64_t> task_first_;  // prefill attention: first task of each run, then the total
  struct ThreadSpan {  // one worker's part of a moe_experts region (seconds since its start)
    double first = -1, last = 0, wait = 0;
  };
  std::vector<ThreadSpan> moe_spans_;
};

}  // namespace berth
