// CudaDevice: the Device contract (device.h) on a CUDA GPU: three non-blocking streams, events
// for the waits between them, cudaLaunchHostFunc for host callbacks, stream capture into CUDA
// graphs, and the gpu_kernels launchers. Compiled only with BERTH_CUDA.
#ifdef BERTH_HAVE_CUDA

#include <cuda.h>
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "berth/core/error.h"
#include "berth/gpu_kernels/kernels.h"
#include "berth/backends/device.h"

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

class CudaDevice final : public Device {
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
    // The host thread sleeps in synchronize() instead of spinning on a core that a CPU worker
    // needs (the hybrid step runs CPU experts on every core while it waits).
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

  std::string name() const override { return name_; }
  size_t total_bytes() const override {
    size_t f = 0, t = 0;
    cudaMemGetInfo(&f, &t);
    return t;
  }
  size_t free_bytes() const override {
    size_t f = 0, t = 0;
    cudaMemGetInfo(&f, &t);
    return f;
  }

  void* alloc(size_t bytes, std::string_view what) override {
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 1));
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error state of a failed allocation
      throw Error(
          ErrorCategory::out_of_memory,
          fmt::format("{}: cannot allocate {} MiB for {} ({} MiB free): {}", name_,
                      (bytes + kMiB - 1) / kMiB, what, free_bytes() / kMiB, cudaGetErrorString(e)));
    }
    return p;
  }
  void dealloc(void* p) override { cudaFree(p); }
  void* alloc_host(size_t bytes, std::string_view what) override {
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocDefault);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw Error(ErrorCategory::out_of_memory,
                  fmt::format("{}: cannot allocate {} MiB of pinned host memory for {}: {}", name_,
                              (bytes + kMiB - 1) / kMiB, what, cudaGetErrorString(e)));
    }
    return p;
  }
  void dealloc_host(void* p) override { cudaFreeHost(p); }
  bool can_register_host() const override { return register_ok_; }
  bool register_host(const void* p, size_t bytes) override {
    if (!can_register_host() || bytes == 0) return false;
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
  void upload(void* dst, const void* src, size_t bytes) override {
    check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "upload (cudaMemcpy)");
  }
  void download(void* dst, const void* src, size_t bytes) override {
    check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "download (cudaMemcpy)");
  }

  void copy_h2d(int s, void* dst, const void* src, size_t bytes) override {
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, st(s)), "copy_h2d");
  }
  void copy_d2h(int s, void* dst, const void* src, size_t bytes) override {
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, st(s)), "copy_d2h");
  }
  void copy_d2d(int s, void* dst, const void* src, size_t bytes) override {
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st(s)), "copy_d2d");
  }
  void host_fn(int s, void (*fn)(void*), void* arg) override {
    check(cudaLaunchHostFunc(st(s), fn, arg), "cudaLaunchHostFunc");
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
  double elapsed_ms(int from, int to) override {
    float ms = 0;
    check(cudaEventElapsedTime(&ms, marks_.at(static_cast<size_t>(from)),
                               marks_.at(static_cast<size_t>(to))),
          "cudaEventElapsedTime");
    return ms;
  }
  bool supports_flags() const override { return flags_; }
  bool computes_on_host() const override { return false; }
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
    if (!small(copies, n)) return Device::copy_out_signal(s, copies, n, flag, value);
    gpu::copy_out_signal(copies, n, flag, value, st(s));
  }
  void wait_copy_in(int s, const uint32_t* flag, uint32_t value, const HostCopy* copies,
                    int n) override {
    if (!small(copies, n)) return Device::wait_copy_in(s, flag, value, copies, n);
    gpu::wait_copy_in(flag, value, copies, n, st(s));
  }
  void synchronize() override {
    for (auto& s : streams_) check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  }

  void begin_capture() override {
    check(cudaStreamBeginCapture(streams_[kMain], cudaStreamCaptureModeThreadLocal),
          "cudaStreamBeginCapture");
    capturing_ = true;
  }
  int end_capture() override {
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

  size_t matmul_workspace_bytes(GgmlType type, int64_t n_in, int64_t n_out,
                                int64_t n_tok) override {
    return gpu::matmul_workspace_bytes(type, n_in, n_out, n_tok);
  }
  void matmul(int s, GgmlType type, const void* w, int64_t n_in, int64_t n_out, const float* x,
              int64_t n_tok, float* out, void* ws, size_t ws_bytes) override {
    gpu::matmul(type, w, n_in, n_out, x, n_tok, out, ws, ws_bytes, st(s));
  }
  void matmul_group(int s, const MatmulJob* jobs, int n_jobs, int64_t n_in, const float* x,
                    int64_t n_tok, void* ws, size_t ws_bytes) override {
    gpu::matmul_group(jobs, n_jobs, n_in, x, n_tok, ws, ws_bytes, st(s));
  }
  void matmul_group_q8(int s, const MatmulJob* jobs, int n_jobs, int64_t n_in, const float* x,
                       int64_t n_tok, void* ws, size_t ws_bytes) override {
    gpu::matmul_group(jobs, n_jobs, n_in, x, n_tok, ws, ws_bytes, st(s), true);
  }
  void embed(int s, GgmlType type, const void* w, int64_t n_embd, int64_t n_vocab,
             const int32_t* tokens, int64_t n_tok, float* out) override {
    gpu::embed(type, w, n_embd, n_vocab, tokens, n_tok, out, st(s));
  }
  void rms_norm(int s, const float* x, const float* w, float* out, int64_t rows, int64_t cols,
                int64_t group, float eps) override {
    gpu::rms_norm(x, w, out, rows, cols, group, eps, st(s));
  }
  void add_rms_norm(int s, const float* a, const float* b, float* sum, const float* w, float* out,
                    int64_t rows, int64_t cols, float eps) override {
    gpu::add_rms_norm(a, b, sum, w, out, rows, cols, eps, st(s));
  }
  void wait_add_rms_norm(int s, const uint32_t* flag, uint32_t value, const float* a,
                         const float* b_host, float* sum, const float* w, float* out, int64_t rows,
                         int64_t cols, float eps) override {
    gpu::wait_add_rms_norm(flag, value, a, b_host, sum, w, out, rows, cols, eps, st(s));
  }
  void add(int s, const float* a, const float* b, float* out, int64_t n) override {
    gpu::add(a, b, out, n, st(s));
  }
  void add_bias(int s, const float* x, const float* bias, float* out, int64_t rows,
                int64_t cols) override {
    gpu::add_bias(x, bias, out, rows, cols, st(s));
  }
  void swiglu(int s, const float* gate, const float* up, float* out, int64_t n) override {
    gpu::swiglu(gate, up, out, n, st(s));
  }
  void rope(int s, const float* x, float* out, int64_t rows, int32_t n_head, int32_t head_dim,
            int32_t n_rot, float freq_base, bool neox, const int32_t* positions) override {
    gpu::rope(x, out, rows, n_head, head_dim, n_rot, freq_base, neox, positions, st(s));
  }
  void norm_rope(int s, const NormRopeJob* jobs, int n_jobs, int64_t rows, int32_t head_dim,
                 float eps, int32_t n_rot, float freq_base, bool neox,
                 const int32_t* positions) override {
    gpu::norm_rope(jobs, n_jobs, rows, head_dim, eps, n_rot, freq_base, neox, positions, st(s));
  }
  size_t attention_workspace_bytes(int64_t n_tok, int64_t n_ctx, int32_t n_head,
                                   int32_t head_dim) override {
    return gpu::attention_workspace_bytes(n_tok, n_ctx, n_head, head_dim);
  }
  void attention(int s, const float* q, const float* k, const float* v, int64_t n_tok,
                 const int32_t* positions, uint16_t* k_cache, uint16_t* v_cache, int64_t n_ctx,
                 int32_t n_head, int32_t n_head_kv, int32_t head_dim, float scale, float* out,
                 void* ws, size_t ws_bytes) override {
    gpu::attention(q, k, v, n_tok, positions, k_cache, v_cache, n_ctx, n_head, n_head_kv, head_dim,
                   scale, out, ws, ws_bytes, st(s));
  }
  void moe_route(int s, const float* logits, int64_t n_tok, int32_t n_expert, int32_t k, bool norm,
                 float* out) override {
    gpu::moe_route(logits, n_tok, n_expert, k, norm, out, st(s));
  }
  bool attention_q8(int s, const float* q, const float* k, const float* v, int64_t n_tok,
                    const int32_t* positions, uint16_t* k_cache, uint16_t* v_cache, int64_t n_ctx,
                    int32_t n_head, int32_t n_head_kv, int32_t head_dim, float scale, float* out,
                    void* ws, size_t ws_bytes, void* q8_ws) override {
    // The 8-bit blocks need the room the output projection's workspace has (ws is that one).
    const int64_t n = static_cast<int64_t>(n_head) * head_dim;
    if (q8_ws != ws || n % 32 != 0 ||
        ws_bytes < gpu::matmul_workspace_bytes(GgmlType::Q8_0, n, 1, 1))
      q8_ws = nullptr;
    return gpu::attention(q, k, v, n_tok, positions, k_cache, v_cache, n_ctx, n_head, n_head_kv,
                          head_dim, scale, out, ws, ws_bytes, st(s), q8_ws);
  }
  void moe_route_signal(int s, const float* logits, int32_t n_expert, int32_t k, bool norm,
                        float* out, const HostCopy* copies, int n, uint32_t* flag,
                        uint32_t value) override {
    if (!small(copies, n))
      return Device::moe_route_signal(s, logits, n_expert, k, norm, out, copies, n, flag, value);
    gpu::moe_route_signal(logits, n_expert, k, norm, out, copies, n, flag, value, st(s));
  }
  void router_route_signal(int s, GgmlType type, const void* w, int64_t n_in, const float* x,
                           int32_t n_expert, int32_t k, bool norm, float* logits, float* route,
                           const HostCopy* copies, int n, uint32_t* flag, uint32_t value, void* ws,
                           size_t ws_bytes) override {
    const bool float_w = type == GgmlType::F32 || type == GgmlType::F16 || type == GgmlType::BF16;
    if (!small(copies, n) || !float_w)
      return Device::router_route_signal(s, type, w, n_in, x, n_expert, k, norm, logits, route,
                                         copies, n, flag, value, ws, ws_bytes);
    gpu::router_route_signal(type, w, n_in, x, n_expert, k, norm, logits, route, copies, n, flag,
                             value, st(s));
  }

  size_t moe_workspace_bytes(const MoeWeights& w, int64_t n_tok, const MoeSlots& slots) override {
    return gpu::moe_workspace_bytes(w, n_tok, slots);
  }
  void moe_experts(int s, const MoeWeights& w, const float* h, const float* route, int64_t n_tok,
                   const uint8_t* mask, const MoeSlots& slots, float* out, void* ws,
                   size_t ws_bytes) override {
    gpu::moe_experts(w, h, route, n_tok, mask, out, ws, ws_bytes, st(s), slots);
  }
  void argmax(int s, const float* logits, int64_t rows, int64_t n_vocab, int32_t* ids) override {
    gpu::argmax(logits, rows, n_vocab, ids, st(s));
  }

 private:
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
  std::string name_;
  std::vector<std::pair<const void*, void*>> registered_;  // register_host: key, page base
  bool register_ok_ = false;                               // can_register_host()
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
