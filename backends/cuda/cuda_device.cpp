// CudaDevice: the Device contract (device.h) on a CUDA GPU: three non-blocking streams, events
// for the waits between them, cudaLaunchHostFunc for host callbacks, stream capture into CUDA
// graphs, and the gpu_kernels launchers. Compiled only with BERTH_CUDA.
#ifdef BERTH_HAVE_CUDA

#include <cuda.h>
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "berth/backends/device.h"
#include "berth/core/env.h"
#include "berth/core/error.h"
#include "berth/gpu_kernels/kernels.h"
#include "stream_device.h"

namespace berth {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

[[noreturn]] void fail(cudaError_t e, const std::string& what) {
  throw Error(ErrorCategory::internal, fmt::format("CUDA: {}: {}", what, cudaGetErrorString(e)));
}
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(e, what);
}
void drv(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS)
    throw Error(ErrorCategory::internal,
                fmt::format("CUDA: {}: driver error {}", what, static_cast<int>(r)));
}

// How long synchronize_polling() polls a stream before it sleeps in cudaStreamSynchronize, in
// microseconds: BERTH_SYNC_SPIN_US, default 20000 (0: sleep at once, as blocking sync does).
// Throws Error(invalid_argument) naming the variable for a value that is not an integer in
// [0, 10^9].
int64_t sync_spin_us() {
  return static_cast<int64_t>(env_uint("BERTH_SYNC_SPIN_US", 1000000000).value_or(20000));
}

// Waits for stream s (synchronize_polling). The device runs with cudaDeviceScheduleBlockingSync,
// whose waiting thread sleeps until an interrupt wakes it; on the H200 machine that wake-up cost
// about 0.16 ms per all-GPU decode step of Qwen3.5-0.8B (docs/performance.md). So this wait
// first polls the stream, yielding the core between polls, for up to sync_spin_us(); only a
// longer wait (a long prefill) sleeps.
void wait_stream(cudaStream_t s, int64_t spin_us) {
  if (spin_us > 0) {
    const auto t0 = std::chrono::steady_clock::now();
    for (uint32_t n = 0;; ++n) {
      const cudaError_t r = cudaStreamQuery(s);
      if (r == cudaSuccess) return;
      if (r != cudaErrorNotReady) fail(r, "cudaStreamQuery");
      cudaGetLastError();  // not an error: clear it
      if ((n & 63) == 63 &&
          std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(spin_us))
        break;
      std::this_thread::yield();
    }
  }
  check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

// Driver entry points through the runtime, so the binary does not link libcuda (it then loads
// on machines without the NVIDIA driver, where the device is simply absent).
using StreamValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
StreamValueFn driver_fn(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &status) !=
          cudaSuccess ||
      status != cudaDriverEntryPointSuccess)
    return nullptr;
  return reinterpret_cast<StreamValueFn>(fn);
}

class CudaDevice final : public backend_detail::StreamDevice {
 public:
  explicit CudaDevice(int index) : index_(index) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0)
      throw Error(ErrorCategory::io,
                  fmt::format("no CUDA device: {}",
                              e != cudaSuccess ? cudaGetErrorString(e) : "none found"));
    if (index < 0 || index >= n)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("CUDA device {} does not exist ({} found)", index, n));
    // A waiting host thread sleeps instead of spinning on a core that a CPU worker needs (the
    // hybrid step runs CPU experts on every core); steps without CPU work poll first
    // (synchronize_polling).
    spin_us_ = sync_spin_us();
    cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync);
    cudaGetLastError();
    check(cudaSetDevice(index), "cudaSetDevice");
    // Stream memory operations (cuStreamWaitValue32/WriteValue32) are always available since
    // CUDA 12; on host memory they need the host pointer to be usable by the device.
    int host_ptr = 0;
    cudaDeviceGetAttribute(&host_ptr, cudaDevAttrCanUseHostPointerForRegisteredMem, index);
    write_value_ = driver_fn("cuStreamWriteValue32");
    wait_value_ = driver_fn("cuStreamWaitValue32");
    flags_ = host_ptr != 0 && write_value_ && wait_value_;
    // register_host: read-only registration of memory mapped read-only (the weights' file),
    // used through its host pointer.
    int reg = 0, ro = 0;
    cudaDeviceGetAttribute(&reg, cudaDevAttrHostRegisterSupported, index);
    cudaDeviceGetAttribute(&ro, cudaDevAttrHostRegisterReadOnlySupported, index);
    cudaGetLastError();
    register_ok_ = reg != 0 && ro != 0 && host_ptr != 0;
    // Unified memory: an integrated device (GB10, Jetson Orin) shares the host's memory and
    // holds weights once (DeviceInfo::unified). Orin reports neither pageable memory access nor
    // concurrent managed access, so being integrated is what counts; without pageable access
    // the weights' mapping is registered (Residency).
    int integrated = 0, pageable = 0;
    cudaDeviceGetAttribute(&integrated, cudaDevAttrIntegrated, index);
    cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, index);
    cudaGetLastError();
    pageable_ = pageable != 0;
    unified_ = integrated != 0;
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, index), "cudaGetDeviceProperties");
    name_ = fmt::format("CUDA{} ({})", index, prop.name);
    for (auto& s : streams_)
      check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~CudaDevice() override {
    cudaSetDevice(index_);
    cudaDeviceSynchronize();
    for (cudaGraphExec_t g : graphs_) cudaGraphExecDestroy(g);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    for (cudaEvent_t e : marks_) cudaEventDestroy(e);
    for (auto& s : streams_) cudaStreamDestroy(s);
  }

  DeviceInfo info() const override {
    size_t f = 0, t = 0;
    cudaMemGetInfo(&f, &t);
    return DeviceInfo{.name = name_,
                      .total_bytes = t,
                      .free_bytes = f,
                      .flags = flags_,
                      .computes_on_host = false,
                      .can_register_host = register_ok_,
                      .multi_seq = true,
                      .unified = unified_,
                      .pageable_access = pageable_};
  }

  void* alloc(size_t bytes, Mem kind, std::string_view what) override {
    void* p = nullptr;
    if (kind == Mem::device) {
      const cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 1));
      if (e != cudaSuccess) {
        cudaGetLastError();  // clear the sticky-free error state of a failed allocation
        size_t f = 0, t = 0;
        cudaMemGetInfo(&f, &t);
        throw Error(ErrorCategory::out_of_memory,
                    fmt::format("{}: cannot allocate {:.1f} MiB for {} ({:.1f} MiB free): {}",
                                name_, static_cast<double>(bytes) / kMiB, what,
                                static_cast<double>(f) / kMiB, cudaGetErrorString(e)));
      }
      return p;
    }
    const cudaError_t e = cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocDefault);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw Error(
          ErrorCategory::out_of_memory,
          fmt::format("{}: cannot allocate {:.1f} MiB of pinned host memory for {}: {}", name_,
                      static_cast<double>(bytes) / kMiB, what, cudaGetErrorString(e)));
    }
    return p;
  }
  void free(void* p, Mem kind) override {
    if (kind == Mem::device)
      cudaFree(p);
    else
      cudaFreeHost(p);
  }
  bool register_host(const void* p, size_t bytes) override {
    if (!register_ok_ || bytes == 0) return false;
    const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const auto a = reinterpret_cast<uintptr_t>(p);
    const uintptr_t base = a / page * page, end = (a + bytes + page - 1) / page * page;
    void* b = reinterpret_cast<void*>(base);
    const cudaError_t e = cudaHostRegister(
        b, end - base,
        cudaHostRegisterMapped | cudaHostRegisterReadOnly | cudaHostRegisterPortable);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    registered_.emplace_back(p, b);
    return true;
  }
  void unregister_host(const void* p) override {
    for (size_t i = 0; i < registered_.size(); ++i)
      if (registered_[i].first == p) {
        if (cudaHostUnregister(registered_[i].second) != cudaSuccess) cudaGetLastError();
        registered_.erase(registered_.begin() + static_cast<std::ptrdiff_t>(i));
        return;
      }
  }

  void copy(int s, void* dst, const void* src, size_t bytes) override {
    if (s == kSync) {
      // cudaMemcpy may return before a device-to-device copy, or the DMA of a pageable upload,
      // has landed, and the legacy stream it uses does not order the non-blocking step streams:
      // wait for it, so that the next step reads what was copied.
      check(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy");
      check(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize");
      return;
    }
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, st(s)), "cudaMemcpyAsync");
  }
  void wait(int s, int on) override {
    // A fresh event per wait while capturing (each becomes an edge of the graph); outside
    // capture one event per stream pair is enough, as the wait is enqueued right after the record.
    cudaEvent_t ev = event_for(s, on);
    check(cudaEventRecord(ev, st(on)), "cudaEventRecord");
    check(cudaStreamWaitEvent(st(s), ev, 0), "cudaStreamWaitEvent");
  }
  int record(int s) override {
    if (marks_.size() < kMarks) {
      cudaEvent_t e = nullptr;
      check(cudaEventCreate(&e), "cudaEventCreate");  // timed: elapsed_ms
      marks_.push_back(e);
    }
    const int id = static_cast<int>(next_mark_++ % kMarks);
    check(cudaEventRecord(marks_[static_cast<size_t>(id)], st(s)), "cudaEventRecord");
    return id;
  }
  void wait_event(int s, int ev) override {
    check(cudaStreamWaitEvent(st(s), marks_.at(static_cast<size_t>(ev)), 0), "cudaStreamWaitEvent");
  }
  bool done(int ev) override {
    const cudaError_t r = cudaEventQuery(marks_.at(static_cast<size_t>(ev)));
    if (r == cudaErrorNotReady) {
      cudaGetLastError();  // not an error: clear it
      return false;
    }
    check(r, "cudaEventQuery");
    return true;
  }
  double elapsed_ms(int from, int to) override {
    float ms = 0;
    check(cudaEventElapsedTime(&ms, marks_.at(static_cast<size_t>(from)),
                               marks_.at(static_cast<size_t>(to))),
          "cudaEventElapsedTime");
    return ms;
  }
  void synchronize() override {
    for (auto& s : streams_) check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  }
  void synchronize(int s) override { check(cudaStreamSynchronize(st(s)), "cudaStreamSynchronize"); }
  void synchronize_polling(int s) override { wait_stream(st(s), spin_us_); }

  int capture(const std::function<void()>& enqueue_work) override {
    check(cudaStreamBeginCapture(streams_[kMain], cudaStreamCaptureModeThreadLocal),
          "cudaStreamBeginCapture");
    capturing_ = true;
    try {
      enqueue_work();
    } catch (...) {
      capturing_ = false;
      cudaGraph_t g = nullptr;
      if (cudaStreamEndCapture(streams_[kMain], &g) == cudaSuccess && g) cudaGraphDestroy(g);
      cudaGetLastError();
      throw;
    }
    capturing_ = false;
    cudaGraph_t g = nullptr;
    check(cudaStreamEndCapture(streams_[kMain], &g), "cudaStreamEndCapture");
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    check(e, "cudaGraphInstantiate");
    graphs_.push_back(exec);
    return static_cast<int>(graphs_.size() - 1);
  }
  void replay(int graph) override {
    check(cudaGraphLaunch(graphs_.at(static_cast<size_t>(graph)), streams_[kMain]),
          "cudaGraphLaunch");
  }

  bool supports(const graph::Op& op) const override {
    // The GDN kernels' limits (gpu_kernels/kernels.h: gated_delta, ssm_conv).
    if (op.kind == graph::OpKind::gated_delta)
      return op.ssm.d_k >= 1 && op.ssm.d_k <= 256 && op.ssm.d_v >= 1 && op.ssm.d_v <= 256 &&
             op.ssm.n_k_head >= 1 && op.ssm.n_v_head % op.ssm.n_k_head == 0;
    return true;
  }
  size_t op_workspace(const StepView& view, const graph::Op& op, bool host_w) const override;
  void enqueue(const Call& c, const StepBindings& b) override;

 protected:
  void host_fn(int s, void (*fn)(void*), void* arg) override {
    check(cudaLaunchHostFunc(st(s), fn, arg), "cudaLaunchHostFunc");
  }
  void write_flag(int s, uint32_t* flag, uint32_t value) override {
    drv(write_value_(reinterpret_cast<CUstream>(st(s)), reinterpret_cast<CUdeviceptr>(flag), value,
                     CU_STREAM_WRITE_VALUE_DEFAULT),
        "cuStreamWriteValue32");
  }
  void wait_flag(int s, const uint32_t* flag, uint32_t value) override {
    drv(wait_value_(reinterpret_cast<CUstream>(st(s)), reinterpret_cast<CUdeviceptr>(flag), value,
                    CU_STREAM_WAIT_VALUE_GEQ),
        "cuStreamWaitValue32");
  }
  // Small hand-offs (decode: a hidden state and the route) in one kernel each; large ones
  // (prefill ubatches) on the copy engines.
  static bool small(const HostCopy* c, int n) {
    if (n > 4) return false;
    size_t total = 0;
    for (int i = 0; i < n; ++i) {
      if (c[i].bytes % 4 != 0) return false;  // the kernels copy whole words
      total += c[i].bytes;
    }
    return total <= (size_t{64} << 10);
  }
  void copy_out_signal(int s, const HostCopy* copies, int n, uint32_t* flag,
                       uint32_t value) override {
    if (!small(copies, n)) return StreamDevice::copy_out_signal(s, copies, n, flag, value);
    gpu::copy_out_signal(copies, n, flag, value, st(s));
  }
  void wait_copy_in(int s, const uint32_t* flag, uint32_t value, const HostCopy* copies,
                    int n) override {
    if (!small(copies, n)) return StreamDevice::wait_copy_in(s, flag, value, copies, n);
    gpu::wait_copy_in(flag, value, copies, n, st(s));
  }

 private:
  bool enqueue_op(const StepBindings& b, int32_t index, bool host_w, void* q8_out = nullptr,
                  bool x_q8 = false);

  cudaStream_t st(int s) const {
    if (s < 0 || s >= kNumStreams)
      throw Error(ErrorCategory::internal, fmt::format("{}: no stream {}", name_, s));
    return streams_[static_cast<size_t>(s)];
  }
  cudaEvent_t event_for(int s, int on) {
    if (capturing_ || pair_events_[static_cast<size_t>(s * kNumStreams + on)] == nullptr) {
      cudaEvent_t e = nullptr;
      check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
      events_.push_back(e);
      if (!capturing_) pair_events_[static_cast<size_t>(s * kNumStreams + on)] = e;
      return e;
    }
    return pair_events_[static_cast<size_t>(s * kNumStreams + on)];
  }

  int index_;
  int64_t spin_us_ = 20000;  // sync_spin_us(), read once at construction
  std::string name_;
  std::vector<std::pair<const void*, void*>> registered_;  // register_host: key, page base
  bool register_ok_ = false;                               // can_register_host()
  bool pageable_ = false, unified_ = false;                // DeviceInfo::pageable_access, unified
  std::array<cudaStream_t, kNumStreams> streams_{};
  std::vector<cudaEvent_t> events_;
  std::array<cudaEvent_t, kNumStreams * kNumStreams> pair_events_{};
  std::vector<cudaGraphExec_t> graphs_;
  bool capturing_ = false;
  bool flags_ = false;  // stream memory operations on host memory work
  StreamValueFn write_value_ = nullptr, wait_value_ = nullptr;
  static constexpr size_t kMarks = 4096;
  std::vector<cudaEvent_t> marks_;
  size_t next_mark_ = 0;
};

using backend_detail::moe_slots;
using backend_detail::moe_weights;
using backend_detail::value_bytes;
using graph::Op;
using graph::OpKind;
using graph::ValueId;

bool is_float(GgmlType t) {
  return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16;
}

const float* weight_f32(const StepBindings& b, graph::WeightId id) {
  return id == graph::kNoWeight ? nullptr
                                : static_cast<const float*>(b.weight.at(static_cast<size_t>(id)));
}

size_t CudaDevice::op_workspace(const StepView& view, const Op& op, bool host_w) const {
  const graph::Graph& g = *view.g;
  const graph::WeightTable& w = *view.weights;
  const int64_t rows = g.values[static_cast<size_t>(op.output)].rows;
  switch (op.kind) {
    case OpKind::matmul: {
      const TensorView& t = w[op.weight];
      return gpu::matmul_workspace_bytes(t.type, t.ne[0], t.n_rows(), rows, g.decode_rows(rows),
                                         g.batch_invariant);
    }
    case OpKind::attention:
      return gpu::attention_workspace_bytes(rows, view.n_ctx, op.attn.n_head, op.attn.n_head_kv,
                                            op.attn.head_dim, g.decode_rows(rows));
    case OpKind::gated_delta:
      return gpu::gated_delta_workspace_bytes(rows, op.ssm.n_k_head, op.ssm.n_v_head, op.ssm.d_k);
    case OpKind::moe_experts: {
      const gpu::MoeWeights mw = moe_weights(w, op.moe, nullptr);
      const gpu::MoeSlots sl = moe_slots(op, host_w);
      if (!g.batch_invariant) return gpu::moe_workspace_bytes(mw, rows, sl);
      // Rows by kind (enqueue_op): the prompt rows on the GEMM, the decode rows on the GEMV.
      const int64_t n_dec = g.decode_rows(rows);
      return std::max(gpu::moe_workspace_bytes(mw, rows - n_dec, sl, gpu::MoePath::gemm),
                      gpu::moe_workspace_bytes(mw, n_dec, sl, gpu::MoePath::gemv));
    }
    default:
      return 0;
  }
}

// One op on the main stream. q8_out (attention): where the next matmul's 8-bit input blocks may
// go (returns whether they were written); x_q8 (matmul): its input's blocks are there already.
bool CudaDevice::enqueue_op(const StepBindings& b, int32_t index, bool host_w, void* q8_out,
                            bool x_q8) {
  const graph::Graph& g = *b.view.g;
  const graph::WeightTable& weights = *b.view.weights;
  const auto i = static_cast<size_t>(index);
  const Op& op = g.ops[i];
  const graph::ValueInfo& oi = g.values[static_cast<size_t>(op.output)];
  float* out = b.value[static_cast<size_t>(op.output)];
  const auto in = [&](size_t j) { return b.value[static_cast<size_t>(op.inputs.at(j))]; };
  const auto wdev = [&](graph::WeightId id) { return b.weight.at(static_cast<size_t>(id)); };
  const int64_t rows = oi.rows, cols = oi.cols;
  const int64_t n_dec = g.decode_rows(rows);  // the value's last n_dec rows are decode rows
  cudaStream_t s = st(kMain);
  switch (op.kind) {
    case OpKind::embed: {
      const TensorView& w = weights[op.weight];
      gpu::embed(w.type, wdev(op.weight), w.ne[0], w.ne[1], b.tokens, rows, out, s);
      return false;
    }
    case OpKind::rms_norm:
      gpu::rms_norm(in(0), weight_f32(b, op.weight), out, rows, cols,
                    op.norm_group > 0 ? op.norm_group : cols, op.eps, s);
      return false;
    case OpKind::matmul: {
      const TensorView& w = weights[op.weight];
      if (x_q8) {
        const MatmulJob job{w.type, wdev(op.weight), w.n_rows(), out};
        gpu::matmul_group(&job, 1, w.ne[0], in(0), rows, b.ws, b.ws_bytes, s, true, n_dec,
                          g.batch_invariant);
      } else {
        gpu::matmul(w.type, wdev(op.weight), w.ne[0], w.n_rows(), in(0), rows, out, b.ws,
                    b.ws_bytes, s, n_dec, g.batch_invariant);
      }
      return false;
    }
    case OpKind::add:
      gpu::add(in(0), in(1), out, rows * cols, s);
      return false;
    case OpKind::swiglu:
      gpu::swiglu(in(0), in(1), out, rows * cols, s);
      return false;
    case OpKind::rope: {
      const graph::RopeParams& p = op.rope;
      gpu::rope(in(0), out, rows, p.n_head, p.head_dim, p.n_rot, p.freq_base,
                p.mode == graph::RopeMode::neox, b.positions, s);
      return false;
    }
    case OpKind::attention: {
      const graph::AttentionParams& p = op.attn;
      const auto l = static_cast<size_t>(p.layer);
      // The 8-bit blocks need the room the output projection's workspace has (ws is that one).
      const int64_t n = static_cast<int64_t>(p.n_head) * p.head_dim;
      if (q8_out != b.ws || n % 32 != 0 ||
          b.ws_bytes < gpu::matmul_workspace_bytes(GgmlType::Q8_0, n, 1, 1))
        q8_out = nullptr;
      return gpu::attention(in(0), in(1), in(2), rows, b.positions, b.k_cache.at(l),
                            b.v_cache.at(l), b.view.n_ctx, p.n_head, p.n_head_kv, p.head_dim,
                            p.scale, out, b.ws, b.ws_bytes, s, q8_out, b.seqs, n_dec);
    }
    case OpKind::take_last_rows: {
      const graph::ValueInfo& ii = g.values[static_cast<size_t>(op.inputs[0])];
      copy(kMain, out, in(0) + (ii.rows - rows) * cols, static_cast<size_t>(rows * cols) * 4);
      return false;
    }
    case OpKind::add_bias:
      gpu::add_bias(in(0), weight_f32(b, op.weight), out, rows, cols, s);
      return false;
    case OpKind::moe_route:
      gpu::moe_route(in(0), rows, op.moe.n_expert, op.moe.n_expert_used, op.moe.norm_weights, out,
                     s, backend_detail::forced_route_of(b, i));
      return false;
    case OpKind::moe_experts: {
      const std::array<const void*, 3>& o = b.moe_w.at(i);
      const void* dw[3] = {wdev(op.moe.gate), wdev(op.moe.up), wdev(op.moe.down)};
      const gpu::MoeWeights mw = moe_weights(weights, op.moe, o[0] ? o.data() : dw);
      const gpu::MoeSlots sl = moe_slots(op, host_w, backend_detail::slot_table_of(b, i));
      if (!g.batch_invariant) {
        gpu::moe_experts(mw, in(0), in(1), rows, b.mask.at(i), out, b.ws, b.ws_bytes, s, sl);
        return false;
      }
      // Batch-invariant steps: a row's path depends on its kind, never on the step's size: the
      // prompt rows (first) on the grouped GEMM, the decode rows (last n_dec) on the GEMV.
      const int64_t n_prompt = rows - n_dec, k2 = 2 * static_cast<int64_t>(op.moe.n_expert_used);
      gpu::moe_experts(mw, in(0), in(1), n_prompt, b.mask.at(i), out, b.ws, b.ws_bytes, s, sl,
                       gpu::MoePath::gemm);
      gpu::moe_experts(mw, in(0) + n_prompt * cols, in(1) + n_prompt * k2, n_dec, b.mask.at(i),
                       out + n_prompt * cols, b.ws, b.ws_bytes, s, sl, gpu::MoePath::gemv);
      return false;
    }
    case OpKind::head_slice: {
      const int64_t in_cols = g.values[static_cast<size_t>(op.inputs[0])].cols;
      gpu::head_slice(in(0), out, rows, in_cols / op.slice.group, op.slice.group, op.slice.offset,
                      op.slice.len, s);
      return false;
    }
    case OpKind::sigmoid_mul: {
      const bool per_row = g.values[static_cast<size_t>(op.inputs[1])].cols == 1 && cols != 1;
      gpu::sigmoid_mul(in(0), in(1), out, rows, cols, per_row, s);
      return false;
    }
    case OpKind::rms_norm_gated:
      gpu::rms_norm_gated(in(0), in(1), weight_f32(b, op.weight), out, rows, cols, op.norm_group,
                          op.eps, s);
      return false;
    case OpKind::ssm_conv: {
      const auto kernel = static_cast<int32_t>(weights[op.weight].ne[0]);
      gpu::ssm_conv(in(0), out, rows, cols, weight_f32(b, op.weight), kernel,
                    b.conv_state.at(static_cast<size_t>(op.ssm.layer)), b.positions, b.seqs, n_dec,
                    s);
      return false;
    }
    case OpKind::gated_delta: {
      const graph::SsmParams& p = op.ssm;
      gpu::gated_delta(in(0), in(1), in(2), weight_f32(b, op.weight), weight_f32(b, p.dt_bias),
                       rows, p.n_k_head, p.n_v_head, p.d_k, p.d_v, p.eps,
                       b.ssm_state.at(static_cast<size_t>(p.layer)), b.positions, b.seqs, n_dec,
                       out, b.ws, b.ws_bytes, s);
      return false;
    }
  }
  throw Error(ErrorCategory::internal, fmt::format("op '{}' has an unknown kind", op.name));
}

void CudaDevice::enqueue(const Call& c, const StepBindings& b) {
  if (enqueue_handoff(c, b)) return;
  const graph::Graph& g = *b.view.g;
  const graph::WeightTable& weights = *b.view.weights;
  const auto op_at = [&](size_t k) -> const Op& { return g.ops[static_cast<size_t>(c.ops.at(k))]; };
  const auto dv = [&](ValueId v) { return b.value[static_cast<size_t>(v)]; };
  cudaStream_t s = st(kMain);
  switch (c.kind) {
    case CallKind::op:
      enqueue_op(b, c.ops[0], c.host_w);
      return;
    case CallKind::select: {
      // Greedy selection on the device: 4 bytes per output row travel instead of the
      // vocabulary's logits.
      const graph::ValueInfo& oi = g.values[static_cast<size_t>(g.output)];
      gpu::argmax(dv(g.output), oi.rows, oi.cols, b.selected_dev, s);
      copy(kMain, b.selected_host, b.selected_dev, sizeof(int32_t) * static_cast<size_t>(oi.rows));
      return;
    }
    case CallKind::matmul_group: {
      std::vector<MatmulJob> jobs;
      for (size_t k = 0; k < c.ops.size(); ++k) {
        const TensorView& w = weights[op_at(k).weight];
        jobs.push_back({w.type, b.weight.at(static_cast<size_t>(op_at(k).weight)), w.n_rows(),
                        dv(op_at(k).output)});
      }
      const ValueId x = op_at(0).inputs[0];
      const int64_t rows = g.values[static_cast<size_t>(x)].rows;
      gpu::matmul_group(jobs.data(), static_cast<int>(jobs.size()), weights[op_at(0).weight].ne[0],
                        dv(x), rows, b.ws, b.ws_bytes, s, false, g.decode_rows(rows),
                        g.batch_invariant);
      return;
    }
    case CallKind::add_norm:
    case CallKind::wait_add_norm: {
      const Op& add = op_at(0);
      const Op& nm = op_at(1);
      const graph::ValueInfo& vi = g.values[static_cast<size_t>(add.output)];
      if (c.kind == CallKind::wait_add_norm) {
        // The segment's output in its page-locked buffer, once its done flag is set (a + b is
        // the same float either way round).
        const ValueId hv = c.recv.at(0);
        const ValueId other = add.inputs[0] == hv ? add.inputs[1] : add.inputs[0];
        gpu::wait_add_rms_norm(
            &b.flags[2 * c.seg + 1], 1, dv(other), b.host[static_cast<size_t>(hv)], dv(add.output),
            weight_f32(b, nm.weight), dv(nm.output), vi.rows, vi.cols, nm.eps, s);
      } else {
        gpu::add_rms_norm(dv(add.inputs[0]), dv(add.inputs[1]), dv(add.output),
                          weight_f32(b, nm.weight), dv(nm.output), vi.rows, vi.cols, nm.eps, s);
      }
      return;
    }
    case CallKind::norm_rope: {
      NormRopeJob jobs[2];
      const Op& first = op_at(0);
      const graph::RopeParams& rp = g.ops[static_cast<size_t>(c.ropes.at(0))].rope;
      for (size_t k = 0; k < c.ops.size() && k < 2; ++k) {
        const Op& nm = op_at(k);
        const Op& rope = g.ops[static_cast<size_t>(c.ropes.at(k))];
        jobs[k] = {dv(nm.inputs[0]), weight_f32(b, nm.weight), dv(rope.output), rope.rope.n_head};
      }
      gpu::norm_rope(jobs, static_cast<int>(c.ops.size()),
                     g.values[static_cast<size_t>(first.output)].rows, rp.head_dim, first.eps,
                     rp.n_rot, rp.freq_base, rp.mode == graph::RopeMode::neox, b.positions, s);
      return;
    }
    case CallKind::route_fork: {
      const Op& op = op_at(0);
      const std::vector<HostCopy> out = copies_down(b, c.send);
      uint32_t* ready = &b.flags[2 * c.seg];
      if (small(out.data(), static_cast<int>(out.size()))) {
        gpu::moe_route_signal(dv(op.inputs[0]), op.moe.n_expert, op.moe.n_expert_used,
                              op.moe.norm_weights, dv(op.output), out.data(),
                              static_cast<int>(out.size()), ready, 1, s,
                              backend_detail::forced_route_of(b, static_cast<size_t>(c.ops[0])));
      } else {
        enqueue_op(b, c.ops[0], false);
        copy_out_signal(kMain, out.data(), static_cast<int>(out.size()), ready, 1);
      }
      fork_rest(c, b, true);
      return;
    }
    case CallKind::router_route_fork: {
      const Op& mm = op_at(0);
      const Op& op = op_at(1);
      const TensorView& w = weights[mm.weight];
      const std::vector<HostCopy> out = copies_down(b, c.send);
      uint32_t* ready = &b.flags[2 * c.seg];
      if (small(out.data(), static_cast<int>(out.size())) && is_float(w.type)) {
        gpu::router_route_signal(w.type, b.weight.at(static_cast<size_t>(mm.weight)), w.ne[0],
                                 dv(mm.inputs[0]), op.moe.n_expert, op.moe.n_expert_used,
                                 op.moe.norm_weights, dv(mm.output), dv(op.output), out.data(),
                                 static_cast<int>(out.size()), ready, 1, s,
                                 backend_detail::forced_route_of(b, static_cast<size_t>(c.ops[1])));
      } else {
        enqueue_op(b, c.ops[0], false);
        enqueue_op(b, c.ops[1], false);
        copy_out_signal(kMain, out.data(), static_cast<int>(out.size()), ready, 1);
      }
      fork_rest(c, b, true);
      return;
    }
    case CallKind::attention_q8: {
      const bool q8 = enqueue_op(b, c.ops[0], false, b.ws);
      enqueue_op(b, c.ops[1], false, nullptr, q8);
      return;
    }
    case CallKind::swiglu_matmul: {
      const Op& sw = op_at(0);
      const Op& mm = op_at(1);
      const TensorView& w = weights[mm.weight];
      gpu::swiglu_matmul(w.type, b.weight.at(static_cast<size_t>(mm.weight)), w.ne[0], w.n_rows(),
                         dv(sw.inputs[0]), dv(sw.inputs[1]), dv(mm.output), b.ws, b.ws_bytes,
                         st(kMain));
      return;
    }
    default:
      throw Error(ErrorCategory::internal,
                  fmt::format("{}: cannot enqueue a {} call", name_, call_kind_name(c.kind)));
  }
}

}  // namespace

bool cuda_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::unique_ptr<Device> make_cuda_device(int index) { return std::make_unique<CudaDevice>(index); }

bool set_cuda_pdl(bool on) {
  const bool was = gpu::pdl_enabled();
  gpu::set_pdl(on);
  return was;
}

}  // namespace berth

#endif  // BERTH_HAVE_CUDA
