// The backend interface: an accelerator as the scheduler sees it. Eighteen methods: facts and
// memory (its own, and page-locked host memory it can read), in-order queues (streams) with
// events, graph capture and replay, and compute: whether it runs an op (an op it does not runs
// on the CPU), how it fuses and sizes a step's calls, and enqueueing a call (backends/call.h:
// one or a few ops of the step graph, or a hand-off with a CPU segment).
//
// Implementations (no code outside backends/ names them; make_device() opens one):
// - cuda/: a CUDA GPU: streams, events, cudaLaunchHostFunc, CUDA graphs, the gpu_kernels
//   launchers, and the fusions (one launch for neighbouring calls, same bits).
// - sim/: the same contract on the CPU, with memory of its own, executed asynchronously in
//   enqueue order by one worker thread (so the flag hand-off works as on CUDA); kernels are the
//   scalar/SIMD CPU kernels, with the KV cache rounded to f16 as on the GPU; a fused call runs as
//   its parts one after another (the same bits), so its hand-off path runs too. CI has no GPU: the
//   scheduler's split (what runs where, what is copied, in which order, what a replayed graph
//   reads, both hand-offs) is tested against it, and the same tests run against CUDA on a GPU
//   machine.
//
// Pointers called "device" below come from alloc(Mem::device); "host" pointers from
// alloc(Mem::host) (page-locked) or register_host. copy() in a stream needs page-locked host
// memory; copy(kSync, ...) takes any host memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "berth/backends/call.h"
#include "berth/graph/graph.h"

namespace berth {

/// Stream indices: kMain runs the step, kAux runs work that overlaps it (a fork's return while
/// the main stream goes on), kCopy streams weights ahead of use. kSync: copy() blocks instead.
enum : int { kMain = 0, kAux = 1, kCopy = 2, kNumStreams = 3, kSync = -1 };

enum class Mem : uint8_t {
  device,  ///< the device's own memory
  host,    ///< page-locked host memory the device can read and write
};

struct DeviceInfo {
  std::string name;  ///< e.g. "CUDA0 (NVIDIA H200)" or "SIM0"
  size_t total_bytes = 0, free_bytes = 0;
  /// Flags in page-locked host memory can be written and awaited by a stream (CUDA: stream
  /// memory operations on host memory): the flag hand-off (schedule.h) works.
  bool flags = false;
  /// The device's work runs on the host's own cores (the simulated device): host threads that
  /// spin while waiting for it take the cores it needs.
  bool computes_on_host = false;
  /// register_host can succeed (its capability checks, no registration).
  bool can_register_host = false;
  /// Attention honours StepBindings::seqs: a step may carry tokens of several sequences of a
  /// multi-sequence KV cache (each token's rows at seq * n_ctx + position).
  bool multi_seq = false;
  /// Routed-expert reads of the device's moe_experts calls since it was opened, each expert
  /// counted once per call however many of the call's tokens it serves: the number of (call,
  /// expert) pairs and their weight bytes (gate + up + down, as stored). -1: not counted.
  int64_t moe_expert_reads = -1, moe_expert_bytes = -1;

  // --- Unified memory (one physical memory for the CPU and the device: GB10, Jetson Orin) ----
  /// The device and the CPU share one memory, as detected (CUDA: cudaDevAttrIntegrated, as on
  /// GB10 and Jetson Orin) or simulated ("unified:SIZE"). The plan then holds weights once
  /// (--unified, placement/plan.h).
  bool unified = false;
  /// The device's kernels read pageable host memory (a file mapping) in place (CUDA:
  /// cudaDevAttrPageableMemoryAccess; the simulated device: always). Without it, unified mode
  /// registers the weights' mapping (register_host) so the device reads it at the same addresses.
  bool pageable_access = false;
  /// The host memory the operating system reports available (MemAvailable), as the simulated
  /// device's board would report it, bytes; 0: ask the operating system (/proc/meminfo).
  size_t os_available_bytes = 0;
  /// Modelled read bandwidth of the shared memory (GB/s) and dense compute (TFLOP/s) of the
  /// device and of the CPU, for placement's cost model on unified memory (who computes what);
  /// 0: placement's defaults (placement::UnifiedRates).
  double gpu_gbps = 0, cpu_gbps = 0, gpu_tflops = 0, cpu_tflops = 0;
};

class Device {
 public:
  virtual ~Device() = default;

  // --- Facts and memory -----------------------------------------------------------------------
  virtual DeviceInfo info() const = 0;
  /// Memory of `kind`. Throws Error(out_of_memory): "<name>: cannot allocate N MiB for <what>
  /// (M MiB free)".
  virtual void* alloc(size_t bytes, Mem kind, std::string_view what) = 0;
  virtual void free(void* p, Mem kind) = 0;
  /// Page-locks host memory [p, p + bytes) that the process already owns and only reads (e.g. a
  /// read-only file mapping of the weights), so that copies from it and kernels reading it work
  /// as with Mem::host memory, at the same addresses. True on success; false when the device
  /// cannot (CUDA: cudaHostRegister with cudaHostRegisterReadOnly unsupported or refused), and
  /// then nothing is registered. The pages covering the range are locked, so two ranges must not
  /// share a page. `p` keys unregister_host.
  virtual bool register_host(const void* p, size_t bytes) = 0;
  virtual void unregister_host(const void* p) = 0;

  // --- Streams and events ---------------------------------------------------------------------
  /// Copies `bytes` from `src` to `dst` (device or page-locked host memory, either way) in
  /// stream `s` (kMain, kAux, kCopy), or synchronously from or to any host memory with kSync.
  virtual void copy(int s, void* dst, const void* src, size_t bytes) = 0;
  /// Work enqueued on `s` after this call waits for everything enqueued on `on` before it.
  virtual void wait(int s, int on) = 0;
  /// Marks the current end of stream `s`; returns a handle for wait_event() and elapsed_ms().
  /// Handles are reused after 4096 further records: wait on a mark before that many more.
  virtual int record(int s) = 0;
  /// Work enqueued on `s` after this call waits for the work before mark `ev`.
  virtual void wait_event(int s, int ev) = 0;
  /// Whether the work before mark `ev` has completed, without waiting (CUDA: cudaEventQuery;
  /// the simulated device: its worker has passed the mark). For polling between steps, e.g. an
  /// expert copy on kCopy that may still be in flight. Throws Error(internal) for a handle that
  /// was never returned by record(), and the device's error for a failed one.
  virtual bool done(int ev) = 0;
  /// Milliseconds between two marks whose work has completed (after synchronize()).
  virtual double elapsed_ms(int from, int to) = 0;
  /// Blocks the calling thread until all streams are idle; rethrows an error a queued
  /// operation raised.
  virtual void synchronize() = 0;
  /// Blocks the calling thread until the work enqueued on stream `s` so far (and what it waited
  /// for) is done; rethrows an error a queued operation raised. Other streams may go on (e.g.
  /// kCopy filling expert slots while a step ends).
  virtual void synchronize(int s) = 0;
  /// synchronize(s) for a wait with no CPU work beside it (a step without CPU segments), where
  /// the waiting thread's wake-up adds to the step: the CUDA device polls the stream, yielding
  /// the core between polls, for up to BERTH_SYNC_SPIN_US microseconds (default 20000; 0: no
  /// polling) before it sleeps. Same errors as synchronize(s); by default it is synchronize(s).
  virtual void synchronize_polling(int s) { synchronize(s); }

  // --- Capture --------------------------------------------------------------------------------
  /// Runs `enqueue` while recording instead of running the work it enqueues on every stream
  /// (which must be joined back into kMain before it returns); replay(h) runs that work again with
  /// the same pointers and sizes. Returns a handle >= 0.
  virtual int capture(const std::function<void()>& enqueue) = 0;
  virtual void replay(int graph) = 0;

  // --- Compute --------------------------------------------------------------------------------
  /// Whether this device runs `op` (the scheduler runs ops it does not on the CPU). The CUDA and
  /// simulated devices run every kind, the Qwen3.5 GDN ops too (ssm_conv and gated_delta on the
  /// recurrent state of StepBindings::conv_state / ssm_state).
  virtual bool supports(const graph::Op& op) const = 0;
  /// A step's calls as this device will enqueue them: with `fuse`, neighbouring calls one launch
  /// can do with the same bits replaced by the fused kinds of CallKind; each call's ws_bytes set
  /// to the workspace it needs. Pure: no device state changes.
  virtual std::vector<Call> prepare(const StepView& view, std::vector<Call> calls,
                                    bool fuse) const = 0;
  /// Enqueues `call` (of calls prepare() returned) with the memory `b` names: its work on the
  /// main stream, a fork's return on the aux stream.
  virtual void enqueue(const Call& call, const StepBindings& b) = 0;

  // --- Conveniences over the above ------------------------------------------------------------
  std::string name() const { return info().name; }
  size_t total_bytes() const { return info().total_bytes; }
  size_t free_bytes() const { return info().free_bytes; }
  bool supports_flags() const { return info().flags; }
  bool computes_on_host() const { return info().computes_on_host; }
  bool can_register_host() const { return info().can_register_host; }
  void* alloc(size_t bytes, std::string_view what) { return alloc(bytes, Mem::device, what); }
  void* alloc_host(size_t bytes, std::string_view what) { return alloc(bytes, Mem::host, what); }
  void dealloc(void* p) { free(p, Mem::device); }
  void dealloc_host(void* p) { free(p, Mem::host); }
  void upload(void* dst, const void* src, size_t bytes) { copy(kSync, dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) { copy(kSync, dst, src, bytes); }
};

/// Opens a device by spec: "sim:SIZE" (a simulated device with SIZE of memory, e.g. "sim:1G";
/// sizes as --vram-budget takes them), "unified:SIZE[,KEY=VALUE...]" (a simulated unified-memory
/// board of SIZE: parse_unified_sim) or "cuda:N" (CUDA device N). Throws
/// Error(invalid_argument) for a bad spec, Error(unsupported) for "cuda:N" in a build without the
/// CUDA backend, Error(io) naming the CUDA error when the device cannot be opened.
std::unique_ptr<Device> make_device(std::string_view spec);

/// A simulated device's settings.
struct SimDeviceOptions {
  size_t capacity_bytes = 0;  ///< its memory (total_bytes)
  /// Each copy on the kCopy stream first sleeps this long (0: none): for tests of work that
  /// overlaps a slow copy.
  int64_t copy_delay_us = 0;
  /// A unified-memory board (DeviceInfo::unified). Its os_available_bytes, rates and
  /// pageable_access are the DeviceInfo fields of the same names.
  bool unified = false;
  /// DeviceInfo::pageable_access (false: as Jetson Orin, the unified weights are copied once
  /// into page-locked host memory).
  bool pageable_access = true;
  size_t os_available_bytes = 0;
  /// What info().free_bytes reports, bytes (as cudaMemGetInfo would, which on a unified board
  /// counts the page cache as used); 0: capacity minus allocations.
  size_t reported_free_bytes = 0;
  double gpu_gbps = 0, cpu_gbps = 0, gpu_tflops = 0, cpu_tflops = 0;
};

/// Parses the text after "unified:" of a simulated unified board's spec: "SIZE" then optional
/// ",KEY=VALUE" settings: available=SIZE (the OS's MemAvailable; default SIZE), free=SIZE (what
/// the device reports free; default: SIZE minus allocations), gpu_gbps=X, cpu_gbps=X,
/// gpu_tflops=X, cpu_tflops=X (the cost model's rates), pageable=0|1 (pageable memory access;
/// default 1). E.g. "128G", "8G,available=6G,free=2G,pageable=0".
/// Throws Error(invalid_argument) naming `spec` and the bad part.
SimDeviceOptions parse_unified_sim(std::string_view text, std::string_view spec);

/// A simulated device with `capacity_bytes` of memory (make_device("sim:SIZE")). Each copy on
/// the kCopy stream first sleeps `copy_delay_us` microseconds (0: none): for tests of work that
/// overlaps a slow copy.
std::unique_ptr<Device> make_sim_device(size_t capacity_bytes, int64_t copy_delay_us = 0);
/// A simulated device with `options`.
std::unique_ptr<Device> make_sim_device(const SimDeviceOptions& options);

/// True when this build has the CUDA backend and a CUDA device is present.
bool cuda_available();
/// Programmatic dependent launch of the CUDA kernels (gpu::set_pdl in gpu_kernels/kernels.h:
/// on by default on compute capability >= 9.0, BERTH_PDL=0 turns it off); returns the previous
/// setting. Results are the same bits either way; for tests and benchmarks. Without the CUDA
/// backend: does nothing and returns false.
bool set_cuda_pdl(bool on);

/// The CUDA device `index` (make_device("cuda:N")). Throws Error(unsupported) when the build has
/// no CUDA backend, Error(io) naming the CUDA error when the device cannot be opened.
std::unique_ptr<Device> make_cuda_device(int index = 0);

}  // namespace berth
