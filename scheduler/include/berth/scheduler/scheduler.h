// The run step: a step graph in, its output out, each op where the Schedule (schedule.h) puts
// it, the device's calls on its streams and the CPU's segments on the pinned worker pool at the
// same time.
//
// How a step runs. The first step of each shape (n_tokens, output rows, ops, selection) makes
// its Schedule with partition() and the device's fusions (Device::prepare), its MemoryPlan, and
// allocates: one device arena for activations, page-locked host buffers for values that cross,
// the workspace and the hand-off flags; later steps of that shape reuse them. The host thread
// enqueues the whole step (the device's calls in order; a fork lets a CPU segment start after the
// device op it waits for, a join makes the main stream wait for what segments wrote) and waits
// once at the end. With the flag hand-off the calling thread runs the CPU segments itself as
// their ready flags come; with callbacks the device's aux stream runs them as host functions.
// Decode steps (every token a decode token of its own sequence, graph::Graph::n_decode; up to 64
// of them) are captured as a device graph the first time a step of that many tokens runs and
// replayed after that; token ids, positions and sequence ids travel through fixed page-locked and
// device buffers, so a replay sees the new ones. Without a device every step is one CPU segment run
// by the CpuExecutor.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "berth/backends/cpu_executor.h"
#include "berth/backends/device.h"
#include "berth/backends/kv_view.h"
#include "berth/backends/thread_pool.h"
#include "berth/graph/graph.h"
#include "berth/placement/plan.h"
#include "berth/residency/residency.h"
#include "berth/scheduler/memory.h"
#include "berth/scheduler/schedule.h"
#include "berth/scheduler/stream_split.h"

namespace berth {

/// HybridOptions::warm_workers_us: chosen by the scheduler (see there).
inline constexpr int64_t kAutoWarmWorkersUs = -1;
/// What kAutoWarmWorkersUs gives replayed decode steps on a device with its own cores, in us.
inline constexpr int64_t kDecodeWarmWorkersUs = 1000;

/// How steps run on a device.
struct HybridOptions {
  Handoff handoff = Handoff::automatic;
  /// Capture decode steps (n_decode == n_tokens <= 64) as device graphs, one per token count,
  /// and replay them.
  bool graphs = true;
  /// Prefill: a ubatch of at least this many tokens (and more than one: never decode) computes
  /// the routed experts that live on the CPU on the device instead, streaming each layer's expert
  /// tensors from page-locked host memory through two stage buffers (layer l + 1 copies while
  /// layer l computes). Costs a pinned copy of those tensors in host memory (which the CPU then
  /// reads instead of the file's pages: Residency::cpu_weights) and two layers' expert tensors
  /// on the device. 0: never (the CPU computes them at every batch size).
  int32_t stream_experts_min_tokens = 0;
  /// Prefill steps that stream: split each streamed layer between the stage buffer (the device
  /// computes the experts the ubatch is expected to use most) and the CPU workers (the others,
  /// at the same time; an expert no token routes to costs nothing there), by the cost model of
  /// stream_split.h. Which experts go where is chosen per step from the layer's routed calls in
  /// earlier steps, so a prompt row's last bits may depend on the ubatch; batch-invariant steps
  /// never split. Off (the default: it measured slower than the whole copy on the H200 at
  /// ubatch 512 and 4096, docs/performance.md): every streamed layer is copied whole.
  bool stream_split = false;
  /// The cost model's rates; each 0 is measured: PCIe by a timed copy of a streamed tensor,
  /// DRAM by the workers reading the pinned experts, both when the first split step runs; the
  /// CPU's GEMM rate starts at 25 GFLOP/s per worker and, unless given, every split step scales
  /// the CPU side's model by the time its CPU parts took against the model's prediction.
  StreamRates stream_rates;
  /// Decode steps: the device computes this fraction (0..1) of each token's routed experts in
  /// every CPU-held layer, at the same time as the CPU computes the others (schedule.h, step 1);
  /// their matrices are staged from the pinned host copy into the workspace. 0: off. Only
  /// single-token steps are split (a multi-token step with the device reading host memory did
  /// not finish in a diagnostic run; see docs/performance.md).
  double host_expert_share = 0;
  /// Flag hand-off: while the calling thread waits for a CPU segment's ready flag, the pool's
  /// workers spin with it for up to this many microseconds (ThreadPool::spin_until), so the
  /// segment does not pay their wake-up. 0: off. -1 (kAutoWarmWorkersUs, the default): 1000 us in
  /// graph-replayed (single-token decode) steps on a device whose work does not run on the host's
  /// cores (Device::computes_on_host), off in eager steps and with the simulated device.
  int64_t warm_workers_us = kAutoWarmWorkersUs;
  /// ResidencyOptions::copy_host_experts.
  bool copy_host_experts = true;
  /// Expert slots (residency/expert_slots.h; `--residency adaptive`): slots_per_layer > 0 gives
  /// each CPU-held MoE layer that many experts on the device, swapped between steps by the
  /// policy (at most max_swaps_per_step per layer per step); the layer's moe_experts ops split
  /// by the slot table (schedule.h, step 1). Needs the CPU-held experts pinned (the Session
  /// pins them). 0: off.
  ExpertSlotsOptions expert_slots;
  /// Host memory, in bytes, that the kept step shapes' host buffers (MemoryPlan::host_bytes:
  /// the values a split step passes between the CPU and the device, and the CPU ops' own) may
  /// hold together: before a new shape allocates its own, the least recently used shapes without
  /// a captured graph are freed until it fits; a shape larger alone still runs (with one
  /// warning). A freed shape's page-locked buffers stay as spares the next shapes take (one of
  /// at most twice a value's size), the spares they leave freed once the cap is reached. A
  /// board's plan sets it to what it counted in the pool (the decode steps of 1..-np tokens,
  /// greedy and sampled, and a full ubatch). Shapes that change from step to step (a server's
  /// mixed steps) are then compiled again more often than the 8 kept without a cap. 0: no cap (at
  /// most 8 shapes are kept, nothing spared).
  size_t step_host_bytes = 0;
  /// Called while uploading weights: bytes done and total.
  std::function<void(size_t done, size_t total)> progress;
};

class Scheduler {
 public:
  /// Runs steps over `weights` with the KV cache `kv`: on the CPU only when `residency` is null,
  /// else with residency->device() for the ops and KV caches placed there (`kv_home`, one per
  /// layer; kv must hold the device rows of those layers). All references must outlive the
  /// scheduler. Throws Error(invalid_argument) when kv_home does not match the cache, and the
  /// device's Error(out_of_memory), Error(unsupported) for a KV cache of several sequences with
  /// layers on a device whose attention serves one (DeviceInfo::multi_seq).
  Scheduler(ThreadPool& pool, const graph::WeightTable& weights, const KvView& kv,
            Residency* residency, std::vector<placement::Home> kv_home, HybridOptions options = {});
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  /// Runs `g` on the ubatch `tokens` at `positions` of the sequences `seqs` (as
  /// CpuExecutor::run: all n_tokens long, `seqs` empty for sequence 0, each sequence's positions
  /// consecutive in ubatch order and below the KV cache's n_ctx) and returns its output value
  /// ([rows, n_vocab] row-major, on the host), valid until the next run. Throws
  /// Error(invalid_argument) for a token id outside the vocabulary, a position outside the
  /// context or a sequence outside the cache.
  std::span<const float> run(const graph::Graph& g, std::span<const int32_t> tokens,
                             std::span<const int32_t> positions,
                             std::span<const int32_t> seqs = {});

  /// Runs `g` as run() does and returns the argmax of the last output row (ties: lowest id; NaN
  /// counts as -inf), as a greedy sampler would pick it. When the logits are made on the device,
  /// the selection runs there and only the token id is copied back.
  int32_t run_argmax(const graph::Graph& g, std::span<const int32_t> tokens,
                     std::span<const int32_t> positions, std::span<const int32_t> seqs = {});

  /// run_argmax for every output row: [rows of g's output] token ids, row order (valid until
  /// the next step). On a device that makes the logits only the ids come back.
  std::span<const int32_t> run_select(const graph::Graph& g, std::span<const int32_t> tokens,
                                      std::span<const int32_t> positions,
                                      std::span<const int32_t> seqs = {});

  /// The schedule steps of the shape of `g` run (made now if no step of that shape ran yet).
  /// Like a step, it may free a kept shape (and the output of the step that ran on it).
  const Schedule& schedule(const graph::Graph& g, bool select = false);
  /// Where op `i` of `g` runs.
  placement::Home op_home(const graph::Graph& g, size_t i);

  bool has_device() const { return dev_ != nullptr; }
  /// Wall time of the last run() and the time its CPU segments took (summed; with a device).
  double last_step_seconds() const { return last_step_s_; }
  double last_cpu_seconds() const { return last_cpu_s_; }
  /// Timing only (`berth bench model`): while on, CPU segments return without computing, so a
  /// step measures the device's part alone (its ops plus the hand-offs). Outputs, and the KV rows
  /// a step writes, are wrong while on: reset the session afterwards.
  void set_skip_cpu_segments(bool on) { skip_cpu_ = on; }
  /// Device bytes of the steps' arenas and workspaces.
  size_t device_scratch_bytes() const;
  /// Host bytes of the kept steps' host buffers (their host arenas and page-locked buffers) and
  /// of the spare page-locked buffers freed steps left for later ones (0 without a device).
  size_t host_buffer_bytes() const;
  /// Page-locked buffers allocated for step values so far (spares taken are not counted).
  int64_t host_allocs() const { return host_allocs_; }
  /// Step shapes compiled and kept (at most 8 besides captured decode steps: the least recently
  /// run other one is freed to make room).
  size_t n_steps() const { return steps_.size(); }
  /// Device time per op kind: when on, steps run eagerly and unfused (no graph replay) with a
  /// timed mark around each device op; gpu_profile() sums them since the last reset. With the
  /// environment variable BERTH_PROFILE_BY_NAME=1 an entry is an op kind and its op's name
  /// without the layer prefix ("matmul attn_qkv", "matmul ffn_down"), to tell apart the weights
  /// of one kind.
  void set_profiling(bool on) { profiling_ = on; }
  std::vector<CpuExecutor::OpTime> gpu_profile() const;
  void reset_gpu_profile() { gpu_prof_.clear(); }
  /// gpu_profile()'s entry for an op (its kind, and its name with BERTH_PROFILE_BY_NAME=1).
  static std::string profile_entry(const graph::Op& op);
  /// The hand-off in use (automatic resolved; callback without a device).
  Handoff handoff() const { return handoff_; }
  /// HybridOptions::warm_workers_us in effect in single-token (decode) steps, in us (0: off):
  /// the value given, or for kAutoWarmWorkersUs 1000 where those steps are replayed (graphs on,
  /// profiling off) on a device with its own cores, else 0.
  int64_t warm_workers_us() const;
  /// Waits for a ready flag the workers spun through (warm_workers_us) since construction.
  int64_t warm_spins() const { return n_warm_spins_; }
  /// moe_experts ops run on the device with streamed weights since construction.
  int64_t streamed_ops() const { return n_streamed_; }
  /// Device ops enqueued that read expert weights from page-locked host memory (the share).
  int64_t host_expert_ops() const { return n_host_w_; }
  /// The split of streamed layers (HybridOptions::stream_split) since construction or the last
  /// reset: per streamed layer and step, the experts each side took and the bytes copied,
  /// against the bytes a whole copy would have moved.
  struct StreamSplitStats {
    int64_t layer_steps = 0;       ///< streamed layers split, summed over the steps
    int64_t experts_cpu = 0;       ///< experts left to the CPU, summed likewise
    int64_t experts_streamed = 0;  ///< experts copied to the stage buffer, summed likewise
    int64_t cpu_calls = 0;         ///< routed (token, expert) calls the CPU computed
    int64_t calls = 0;             ///< routed calls of the split layers
    int64_t bytes_streamed = 0;    ///< expert bytes copied
    int64_t bytes_whole = 0;       ///< expert bytes whole copies would have copied
  };
  const StreamSplitStats& stream_split_stats() const { return split_stats_; }
  void reset_stream_split_stats() { split_stats_ = {}; }
  /// The cost model's rates in use (the measured ones once the first split step ran) and the
  /// CPU side's learned scale (1: the model as given).
  const StreamRates& stream_rates() const { return rates_; }
  double stream_cpu_scale() const { return cpu_scale_; }
  /// Routing traces (residency/routing_trace.h): hooks around every step's moe_route ops. Route
  /// r is the graph's r-th moe_route op in op order (one per MoE layer, in layer order).
  struct RoutingHooks {
    /// Before each step, fills ids [n_route][g.n_tokens][k] (k = n_expert_used; the step's
    /// tokens in order; each token's ids distinct and < n_expert, unchecked here): the experts
    /// every route of the step selects, wherever it runs; their weights stay the router's
    /// (cpu::moe_forced). Null: the router selects.
    std::function<void(const graph::Graph& g, int32_t* ids)> force;
    /// After each step, routes[r] = route r's output [g.n_tokens][2k] (graph.h, moe_route: ids as
    /// exact floats, then weights) in host memory valid during the call. Null: not recorded.
    std::function<void(const graph::Graph& g, std::span<const float* const> routes)> record;
  };
  /// Installs `hooks` for graphs with `n_route` moe_route ops of n_expert_used `k`. Call before
  /// the first step (captured decode graphs read the forced ids from a buffer bound when they
  /// are made). Throws Error(invalid_argument) after a step ran or for n_route or k < 1, and the
  /// device's Error(out_of_memory) for the forced ids' buffers (n_ctx * n_seq tokens' worth). A
  /// step whose graph has another number of moe_route ops throws Error(invalid_argument).
  void set_routing(int32_t n_route, int32_t k, RoutingHooks hooks);

  CpuExecutor& cpu() { return cpu_; }
  Device* device() const { return dev_; }
  const HybridOptions& options() const { return opt_; }

  struct Step;  // a compiled shape (scheduler.cpp)

 private:
  Step& step_for(const graph::Graph& g, bool select);
  Step& step(const graph::Graph& g, std::span<const int32_t> tokens,
             std::span<const int32_t> positions, std::span<const int32_t> seqs, bool select);
  void enqueue_step(Step& st);
  static void run_segment(void* arg);
  void serve_segments(Step& st, int64_t warm_us);  // flag hand-off: runs ready segments in order
  void release_flags(Step& st, size_t from);       // sets the done flags of segments >= from
  // Frees a step's memory; with `recycle` (and HybridOptions::step_host_bytes set) its
  // page-locked buffers become spares that later steps take instead of allocating.
  void free_step(Step& st, bool recycle = false);
  // A page-locked buffer of at least `bytes` (a spare of at most twice that, else a new one);
  // its size in *got.
  void* take_host(size_t bytes, const char* name, size_t* got);
  // Host bytes of the kept steps' buffers, spares not included.
  size_t kept_host_bytes() const;
  void release();  // frees everything on the device (destructor, failed constructor)
  // Routing hooks around a step of schedule graph `g` (the partitioned one).
  void route_before(const graph::Graph& g);
  void route_after(const graph::Graph& g, const Step* st);
  // Copies device value v of step `st` into `out` (after the step) and returns out.data().
  const float* value_to_host(const Step& st, graph::ValueId v, std::vector<float>& out);
  // The split of streamed layers: before a step, each split layer's table; after it, the counts.
  void split_before(Step& st);
  void split_after(Step& st);
  void measure_stream_rates(const Step& st);

  ThreadPool& pool_;
  const graph::WeightTable& weights_;
  const KvView& kv_;
  Residency* res_;
  Device* dev_;
  std::vector<placement::Home> kv_home_;
  HybridOptions opt_;
  bool host_budget_warned_ = false;
  std::multimap<size_t, void*> spare_host_;  // size -> page-locked buffer freed by a step
  size_t spare_host_bytes_ = 0;
  int64_t host_allocs_ = 0;
  CpuExecutor cpu_;
  Capabilities caps_;
  int32_t* tokens_host_ = nullptr;  // page-locked, n_ctx long
  int32_t* positions_host_ = nullptr;
  int32_t* tokens_dev_ = nullptr;
  int32_t* positions_dev_ = nullptr;
  int32_t* seqs_host_ = nullptr;  // sequence ids, with a multi-sequence KV cache
  int32_t* seqs_dev_ = nullptr;
  RoutingHooks routing_;
  int32_t n_route_ = 0, route_k_ = 0;
  bool stepped_ = false;            // a step ran (route_before)
  int32_t* forced_host_ = nullptr;  // [n_route][n_tokens][k]: page-locked with a device
  int32_t* forced_dev_ = nullptr;
  std::vector<int32_t> forced_cpu_;  // without a device
  std::vector<const float*> route_ptrs_;
  std::vector<std::vector<float>> route_held_;  // device routes copied for record
  std::vector<int32_t> selected_;               // run_select's ids when the CPU selects
  std::vector<float> seat_buf_;  // a streamed layer's route, copied for its expert slots
  std::vector<std::unique_ptr<Step>> steps_;
  uint64_t use_clock_ = 0;  // counts step_for calls (least recently used eviction)
  double last_step_s_ = 0, last_cpu_s_ = 0;
  bool skip_cpu_ = false;
  std::atomic<bool> serve_abort_{false};  // an eager step's enqueue failed: stop serving
  Handoff handoff_ = Handoff::callback;
  bool profiling_ = false;
  std::vector<std::pair<std::string, std::pair<int, int>>> marks_;  // this step's timed ops
  std::map<std::string, CpuExecutor::OpTime> gpu_prof_;             // by entry (gpu_profile)
  int64_t n_streamed_ = 0, n_host_w_ = 0;
  // A streamed layer split by the cost model: its step table (page-locked, and on the device),
  // its decayed routed calls per expert and the routing its CPU op logged this step.
  struct SplitLayer {
    graph::WeightId gate = graph::kNoWeight, up = graph::kNoWeight, down = graph::kNoWeight;
    int32_t n_expert = 0, k = 0;
    int32_t* host_table = nullptr;
    int32_t* dev_table = nullptr;
    std::vector<double> counts;
    std::vector<uint16_t> log;
    ExpertCost cost;
  };
  std::deque<SplitLayer> split_;  // stable: the CPU executor holds pointers to their logs
  StreamRates rates_;
  bool rates_measured_ = false;
  double cpu_scale_ = 1.0;
  StreamSplitStats split_stats_;
  StreamSplitStats split_pending_;  // the running step's, added to split_stats_ once it succeeds
  int64_t n_warm_spins_ = 0;  // written by serve_segments (a step's server thread), read after
};

/// The Capabilities a Schedule needs of `dev` (null: no device) and `res` (its pinned experts).
Capabilities capabilities(Device* dev, const Residency* res, size_t n_weights);

/// The schedule the Scheduler runs for steps of `g`: partition(), then the device's fusions and
/// workspaces (when `dev` is given; `n_ctx` sizes attention's workspace). What `berth plan
/// --ops` prints.
Schedule make_schedule(const graph::Graph& g, const graph::WeightTable& weights,
                       const std::vector<placement::Home>& weight_home,
                       const std::vector<placement::Home>& kv_home, const Capabilities& caps,
                       const ScheduleOptions& options, Device* dev, int64_t n_ctx);

}  // namespace berth
