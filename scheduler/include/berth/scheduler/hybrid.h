// The heterogeneous executor: runs a step graph with each op where its weights live (placement
// decides), GPU ops on Device streams and CPU ops on the pinned worker pool, at the same time
// where the graph allows.
//
// How a step runs. Each op gets a side: an op with weights runs where they live (moe_experts: where
// its expert tensors live), attention where its layer's KV cache lives, any other op on the device
// when one of its inputs was produced there, else on the CPU. Consecutive CPU ops form a segment.
// Everything is enqueued on the Device in graph order: GPU ops on the main stream; each CPU segment
// as a host callback on the aux stream, forked from the main stream right after the last GPU op
// that produces one of its inputs (whose values are copied into pinned host buffers first) and
// joined back before the first GPU op that reads one of its outputs (copied to the device on the
// aux stream). A segment that reads nothing from the device (embed with token_embd on the CPU) runs
// on the calling thread before the step is enqueued, so it costs no host callback. So GPU ops that
// do not depend on a CPU segment run while it runs, and nothing on the host waits per layer: the
// host thread enqueues the whole step and waits once at the end. Decode steps (one token) are
// captured as a Device graph the first time and replayed after that; token ids and positions travel
// through fixed pinned/device buffers, so a replay sees the new ones.
//
// Memory: GPU-resident weights are uploaded once (1-D tensors such as norm scales and biases as
// f32); device activations share one arena, offsets assigned by liveness in enqueue order
// (values written by a CPU segment are kept from its fork point on); values crossing between
// the sides get pinned host buffers; KV caches are f16 on the device (one per GPU layer) and
// the CpuExecutor's f32 cache for CPU layers.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "berth/graph/graph.h"
#include "berth/placement/plan.h"
#include "berth/backends/cpu_executor.h"
#include "berth/backends/device.h"
#include "berth/backends/kv_cache.h"
#include "berth/backends/thread_pool.h"

namespace berth {

/// Device bytes the hybrid executor needs besides weights and KV cache for steps of the shape of
/// `g` (the step graph of a full ubatch, as a model builds it) with a context of `n_ctx`: the
/// peak of live activations of the all-GPU step (values are assigned offsets in one arena by
/// liveness) plus the largest kernel workspace (asked from `dev` when given, else estimated: 64
/// MiB + 8 bytes per input element), rounded up to MiB. An estimate from shapes alone, used by
/// placement before loading.
size_t device_scratch_bytes(const graph::Graph& g, const graph::WeightTable& weights,
                            int64_t n_ctx, Device* dev = nullptr);

/// Device bytes for CPU-held experts the executor brings to the device, beyond
/// device_scratch_bytes: with stream_experts_min_tokens > 0, the two buffers that stream a
/// layer's expert tensors (2 x the largest layer's ffn_{gate,up,down}_exps bytes); with
/// host_expert_share f > 0, the decode workspace's staged experts (ceil(f x n_expert_used)
/// slots x the largest expert's gate + up + down bytes). `g` is any step graph of the model (its
/// moe_experts ops name each layer's stacked tensors). Counted whether or not the plan leaves
/// experts on the CPU (placement plans before it knows), rounded up to MiB; 0 for a model
/// without stacked expert tensors.
size_t expert_stage_bytes(const graph::Graph& g, const graph::WeightTable& weights,
                          int32_t stream_experts_min_tokens, double host_expert_share);

/// Per op of the step graph `g`: how many route slots HybridOptions::host_expert_share `f`
/// gives the device (0: none, the op is not split; the op's k: the device computes it all), as
/// HybridExecutor splits a single-token step. Candidates are moe_experts ops whose gate, up and
/// down tensors are stacked (n_expert > 1) and CPU-held (`weight_home`, per WeightId) and whose
/// input comes from an op with a device-held weight (the norm before them); the c-th candidate
/// takes round((c + 1) f k) - round(c f k) of its k slots (cumulative rounding: f k = 1.5
/// alternates 2 and 1). All zeros for f <= 0 or a multi-token graph. (The executor also needs
/// the experts pinned.)
std::vector<int32_t> host_share_device_slots(const graph::Graph& g,
                                             const std::vector<placement::Home>& weight_home,
                                             double f);

/// Whether the CPU segments read the CPU-held experts' pinned copy (HybridExecutor::cpu_weights)
/// rather than the model's own pages: on a host of one NUMA node (numa_node_count()). The copy
/// lands on one node, so with more nodes the workers keep reading the pages they first touched.
bool copy_read_by_cpu();

/// Whether HybridExecutor registers the CPU-held experts' own memory on `dev` in place
/// (BERTH_REGISTER_HOST=1 and Device::can_register_host; otherwise a pinned copy).
bool registers_host_experts(const Device& dev);

/// How a CPU segment and the device's streams hand over.
enum class Handoff {
  automatic,  ///< flags when the device supports them, else callback
  /// The aux stream runs the segment as a host callback (cudaLaunchHostFunc) on the driver's
  /// thread.
  callback,
  /// The aux stream writes a "ready" flag in pinned memory and waits for a "done" flag
  /// (cuStreamWriteValue32 / cuStreamWaitValue32); the thread that called run() polls the
  /// ready flags in order, runs each segment itself and writes its done flag. No driver
  /// callback thread, and the caller's thread does the work instead of sleeping. In a decode
  /// step the two device operations fuse with their neighbours where they can: a single-token
  /// moe_route followed by the segment's fork sends the segment's inputs and the ready flag in
  /// its own launch (Device::moe_route_signal; with the router's matmul of float weights just
  /// before it, in one launch with that too: Device::router_route_signal), and when the
  /// segment's one output that the device reads feeds only a residual add fused with the norm
  /// after it, that add waits for the done flag and reads the output from its pinned buffer
  /// (Device::wait_add_rms_norm).
  flags,
};

/// HybridOptions::warm_workers_us: chosen by the executor (see there).
inline constexpr int64_t kAutoWarmWorkersUs = -1;
/// What kAutoWarmWorkersUs gives replayed decode steps on a device with its own cores, in us.
inline constexpr int64_t kDecodeWarmWorkersUs = 1000;

struct HybridOptions {
  Handoff handoff = Handoff::automatic;
  /// Capture decode steps (1 token) as a Device graph and replay them.
  bool graphs = true;
  /// Prefill: a ubatch of at least this many tokens (and more than one: never decode) computes the
  /// routed experts that live on the CPU on the device instead, streaming each layer's expert
  /// tensors from pinned host memory through two device buffers (layer l+1 copies while layer l
  /// computes). Costs a pinned copy of those tensors in host memory (which the CPU then reads
  /// instead of the file's pages: see cpu_weights) and two layers' expert tensors on the device. 0:
  /// never (the CPU computes them at every batch size).
  int32_t stream_experts_min_tokens = 0;
  /// Decode steps: the device computes this fraction (0..1) of each token's routed experts in
  /// every CPU-held layer, at the same time as the CPU computes the others; the two partial
  /// sums are added on the device. The split is by route slot, so every token divides alike:
  /// the c-th split layer gives the device the last round((c + 1) f k) - round(c f k) of its k
  /// slots (f k = 1.5 alternates 2 and 1), whose experts' matrices one kernel copies from the
  /// pinned host copy into the workspace (MoeSlots::stage: large reads over PCIe) before the
  /// GEMVs read them there. (Until 2026-12-01 the split was by expert id, every 1/f-th id, so
  /// a token's share was left to its route, and the GEMVs read host memory in place.) Needs
  /// the pinned copy (as stream_experts_min_tokens). 0: off. A layer whose count is 0 stays
  /// with the CPU; f = 1 leaves the CPU none. Only single-token steps are split: in a
  /// diagnostic run on the H200, a 24-token step of a tiny model with the device reading host
  /// memory did not finish within 120 s (not investigated), so multi-token steps keep the CPU
  /// path. Measured on the H200 (synthetic qwen3-30b-a3b, docs/performance.md): f = 0.25 gave
  /// --cpu-moe decode +4% to +25%, depending on the host's spare DRAM bandwidth.
  double host_expert_share = 0;
  /// Flag hand-off: while the calling thread waits for a CPU segment's ready flag, the pool's
  /// workers spin with it for up to this many microseconds (ThreadPool::spin_until), so the
  /// segment does not pay their wake-up (30-50 us after >= 200 us idle on a Zen 4 VM). 0: off.
  /// -1, the default (kAutoWarmWorkersUs): 1000 us in graph-replayed (single-token decode)
  /// steps on a device whose work does not run on the host's cores (Device::computes_on_host),
  /// off in eager steps and with the simulated device. Measured on the H200's Xeon host
  /// (--cpu-moe decode of synthetic qwen3-30b-a3b, interleaved pairs, tok/s off -> 1000):
  /// 41.3 -> 42.6, 48.1 -> 52.6, 54.1 -> 52.6 (2026-12-01), 49.3 -> 60.2, 60.6 -> 69.5,
  /// 68.0 -> 73.5 (2026-12-02): the CPU's expert calls gain most on a busy host.
  int64_t warm_workers_us = kAutoWarmWorkersUs;
  /// When the CPU-held experts' own memory is not registered in place (the default; see
  /// registers_host_experts), pin a copy of them (true: place() always; the CPU then reads the
  /// copy, see cpu_weights) or, false (a caller with no host memory for a copy), turn streaming
  /// off instead.
  bool copy_host_experts = true;
  /// Called while uploading weights: bytes done and total.
  std::function<void(size_t done, size_t total)> progress;
};

class HybridExecutor {
 public:
  /// Uploads the weights whose home is GPU (`weight_home`, one per WeightTable entry) and
  /// allocates the device KV cache ([n_ctx, k_dim] and [n_ctx, v_dim] f16) of each layer whose
  /// `kv_home` is GPU. `cpu_kv` serves the CPU layers. `weights`, `pool`, `cpu_kv` and `dev`
  /// must outlive the executor. Throws Error(out_of_memory) from the device (naming it, the MiB
  /// needed and free) and Error(invalid_argument) when the homes do not match the table.
  HybridExecutor(ThreadPool& pool, const graph::WeightTable& weights, KvCache& cpu_kv, Device& dev,
                 std::vector<placement::Home> weight_home, std::vector<placement::Home> kv_home,
                 HybridOptions options = {});
  ~HybridExecutor();
  HybridExecutor(const HybridExecutor&) = delete;
  HybridExecutor& operator=(const HybridExecutor&) = delete;

  /// Runs `g` as CpuExecutor::run does (same arguments, errors and result: the output value on
  /// the host, valid until the next run). A moe_experts op whose expert tensors are split
  /// between the sides, or whose gate/up/down live on different sides, throws
  /// Error(invalid_argument) naming the tensors.
  std::span<const float> run(const graph::Graph& g, std::span<const int32_t> tokens,
                             std::span<const int32_t> positions);

  /// Runs `g` as run() does and returns the argmax of the last output row (ties: lowest id;
  /// NaN counts as -inf), as a greedy sampler would pick it. When the logits are made on the
  /// device, the selection runs there and only the token id is copied back.
  int32_t run_argmax(const graph::Graph& g, std::span<const int32_t> tokens,
                     std::span<const int32_t> positions);

  /// Where op `i` of `g` runs (after a run of g): for tests and `berth plan`-style reports.
  placement::Home op_home(const graph::Graph& g, size_t i);

  /// Wall time of the last run() and the time its CPU segments took (host callbacks, summed).
  double last_step_seconds() const { return last_step_s_; }
  double last_cpu_seconds() const { return last_cpu_s_; }
  /// Timing only (`berth bench model`): while on, CPU segments return without computing, so a
  /// step measures the device's part alone (its ops plus the hand-offs). Outputs, and the KV
  /// rows a step writes, are wrong while on: reset the session afterwards.
  void set_skip_cpu_segments(bool on) { skip_cpu_ = on; }
  /// Device bytes held: weights, KV cache, activations + workspace.
  size_t device_weight_bytes() const { return dev_weight_bytes_; }
  size_t device_kv_bytes() const { return dev_kv_bytes_; }
  size_t device_scratch_bytes() const;
  /// Device time per op kind: when on, steps run eagerly (no graph replay) with a timed mark
  /// around each device op; gpu_profile() sums them since the last reset.
  void set_profiling(bool on) { profiling_ = on; }
  std::vector<CpuExecutor::OpTime> gpu_profile() const;
  void reset_gpu_profile() { gpu_prof_.clear(); }
  /// The hand-off in use (automatic resolved).
  Handoff handoff() const { return handoff_; }
  /// HybridOptions::warm_workers_us in effect in single-token (decode) steps, in us (0: off):
  /// the value given, or for kAutoWarmWorkersUs 1000 where those steps are replayed (graphs
  /// on, profiling off) on a device with its own cores, else 0. Eager steps use the value
  /// given, off for kAutoWarmWorkersUs. The spin only runs while a CPU segment's ready flag is
  /// awaited (Handoff::flags).
  int64_t warm_workers_us() const {
    if (opt_.warm_workers_us != kAutoWarmWorkersUs) return opt_.warm_workers_us;
    return dev_.computes_on_host() || !opt_.graphs || profiling_ ? 0 : kDecodeWarmWorkersUs;
  }
  /// Waits for a ready flag the workers spun through (warm_workers_us) since construction.
  int64_t warm_spins() const { return n_warm_spins_; }

  /// moe_experts ops run on the device with streamed weights since construction.
  int64_t streamed_ops() const { return n_streamed_; }
  /// Device ops enqueued that read expert weights from pinned host memory (host_expert_share).
  int64_t host_expert_ops() const { return n_host_w_; }
  /// How the CPU-held experts reach the device (stream_experts_min_tokens, host_expert_share):
  /// "registered" (their own memory page-locked in place), "copied" (a pinned copy: the device
  /// cannot register it, or BERTH_REGISTER_HOST is not set) or "" (neither option is on).
  std::string_view host_experts_pinning() const {
    return pinned_copies_ ? "copied" : registered_.empty() ? "" : "registered";
  }
  /// The weights the CPU segments read: the model's, except that CPU-held expert tensors with
  /// a pinned copy ("copied") point at the copy where copy_read_by_cpu(), so the file mapping's
  /// pages of them go unused (advised cold: the kernel reclaims them first) and host memory
  /// holds those experts once.
  const graph::WeightTable& cpu_weights() const { return cpu_weights_; }
  CpuExecutor& cpu() { return cpu_; }
  Device& device() { return dev_; }

  struct StepPlan;  // per graph shape (defined in hybrid.cpp)

 private:
  StepPlan& plan_for(const graph::Graph& model_graph, bool select = false);
  StepPlan& step(const graph::Graph& g, std::span<const int32_t> tokens,
                 std::span<const int32_t> positions, bool select);
  void split_host_experts(StepPlan& sp) const;
  void pin_host_experts();
  void enqueue_step(StepPlan& sp);
  /// Enqueues op i on the device. q8_out (attention only): the workspace the next matmul reads,
  /// where the op may also leave its output's 8-bit blocks (returns true when it did); x_q8
  /// (single-token matmul only): its input's blocks are already there.
  bool enqueue_op(StepPlan& sp, size_t i, const void* const* stream_w = nullptr,
                  void* q8_out = nullptr, bool x_q8 = false);
  void stream_copy(const graph::Op& op, int buf);
  static void run_segment(void* arg);
  void serve_segments(StepPlan& sp,
                      int64_t warm_us);  // Handoff::flags: runs the ready segments in order
  void release_flags(StepPlan& sp, size_t from);  // sets the done flags of segments >= from
  void plan_norm_rope(StepPlan& sp) const;        // sets sp.rope_of and sp.rope_pair
  void release();  // frees everything on the device (destructor, failed constructor)

  ThreadPool& pool_;
  const graph::WeightTable& weights_;
  KvCache& cpu_kv_;
  Device& dev_;
  std::vector<placement::Home> weight_home_, kv_home_;
  HybridOptions opt_;
  graph::WeightTable cpu_weights_;  // cpu_weights(); before cpu_, which reads it
  CpuExecutor cpu_;
  std::vector<void*> dev_weight_;  // per WeightId: device copy, or nullptr
  // Per WeightId: the CPU-held expert tensor's page-locked host memory for the device (its own
  // memory registered in place, or a pinned copy), or nullptr.
  std::vector<void*> pinned_weight_;
  std::vector<const void*> registered_;  // keys of Device::register_host ranges
  bool pinned_copies_ = false;           // pinned_weight_ holds copies (alloc_host)
  void* stage_[2] = {nullptr, nullptr};  // device buffers of streamed expert layers
  size_t stage_bytes_ = 0;
  std::vector<uint16_t*> dev_k_, dev_v_;  // per layer: f16 KV cache, or nullptr
  size_t dev_weight_bytes_ = 0, dev_kv_bytes_ = 0;
  int32_t* tokens_host_ = nullptr;  // pinned, max_tokens_
  int32_t* positions_host_ = nullptr;
  int32_t* tokens_dev_ = nullptr;
  int32_t* positions_dev_ = nullptr;
  int64_t max_tokens_ = 0;
  std::vector<std::unique_ptr<StepPlan>> plans_;
  double last_step_s_ = 0, last_cpu_s_ = 0;
  bool skip_cpu_ = false;
  std::atomic<bool> serve_abort_{false};  // an eager step's enqueue failed: stop serving
  Handoff handoff_ = Handoff::callback;
  bool profiling_ = false;
  std::vector<std::pair<graph::OpKind, std::pair<int, int>>> marks_;  // this step's timed ops
  std::vector<CpuExecutor::OpTime> gpu_prof_;                         // indexed by OpKind
  int64_t n_streamed_ = 0, n_host_w_ = 0;
  int64_t n_warm_spins_ = 0;  // written by serve_segments (a step's server thread), read after
};

}  // namespace berth
