// The accelerator as the executor sees it: its own memory, a few in-order queues (streams),
// copies to and from page-locked host memory, host callbacks in stream order, graph capture and
// replay, and the step graph's kernels.
//
// Two implementations:
// - CudaDevice (cuda_device.cpp, built with BERTH_CUDA): CUDA streams, events, cudaLaunchHostFunc,
//   CUDA graphs, gpu_kernels/.
// - SimDevice (sim_device.cpp, always built): the same contract on the CPU, with memory of its
//   own, executed asynchronously in enqueue order by one worker thread (so the pinned-memory
//   flag hand-off works as on CUDA); kernels are the scalar/SIMD CPU kernels, with the KV cache
//   rounded to f16 as on the GPU. CI has no GPU: the executor's split (what runs where, what is
//   copied, in which order, what a replayed graph reads, both hand-offs) is tested against
//   SimDevice, and the same tests run against CudaDevice on a GPU machine.
//
// Pointers called "device" below are from alloc(); "host" pointers from alloc_host() (pinned);
// a copy between device and pageable host memory is not allowed in a stream (upload() is the
// synchronous exception used at load time).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "berth/core/tensor.h"
#include "berth/core/types.h"

namespace berth {

/// Stream indices: kMain runs the step, kAux runs work that overlaps it (e.g. GPU-held experts
/// while the main stream waits for the CPU's), kCopy streams weights ahead of use.
enum : int { kMain = 0, kAux = 1, kCopy = 2, kNumStreams = 3 };

class Device {
 public:
  virtual ~Device() = default;

  /// e.g. "CUDA0 (NVIDIA H200)" or "SIM0".
  virtual std::string name() const = 0;
  virtual size_t total_bytes() const = 0;
  virtual size_t free_bytes() const = 0;

  /// Device memory. Throws Error(out_of_memory): "<name>: cannot allocate N MiB for <what>
  /// (M MiB free)".
  virtual void* alloc(size_t bytes, std::string_view what) = 0;
  virtual void dealloc(void* p) = 0;
  /// Page-locked host memory, usable by copies and host callbacks. Same errors as alloc().
  virtual void* alloc_host(size_t bytes, std::string_view what) = 0;
  virtual void dealloc_host(void* p) = 0;
  /// Page-locks host memory [p, p + bytes) that the process already owns and only reads (e.g. a
  /// read-only file mapping of the weights), so that copies from it and kernels reading it work
  /// as with alloc_host memory, at the same addresses. True on success; false when the device
  /// cannot (CUDA: cudaHostRegister with cudaHostRegisterReadOnly unsupported or refused, or
  /// host pointers not usable by kernels), and then nothing is registered. The pages covering
  /// the range are locked, so two ranges must not share a page. `p` keys unregister_host.
  virtual bool register_host(const void* p, size_t bytes) = 0;
  virtual void unregister_host(const void* p) = 0;
  /// Whether register_host can succeed here (its capability checks, no registration).
  virtual bool can_register_host() const = 0;
  /// Synchronous copy from any host memory to device memory (load time).
  virtual void upload(void* dst, const void* src, size_t bytes) = 0;
  /// Synchronous copy from device memory to any host memory (tests, diagnostics).
  virtual void download(void* dst, const void* src, size_t bytes) = 0;

  // Stream-ordered work. `s` is one of kMain, kAux, kCopy.
  virtual void copy_h2d(int s, void* dst, const void* src, size_t bytes) = 0;
  virtual void copy_d2h(int s, void* dst, const void* src, size_t bytes) = 0;
  virtual void copy_d2d(int s, void* dst, const void* src, size_t bytes) = 0;
  /// Runs fn(arg) on a host thread once the work before it in stream `s` is done; later work in
  /// `s` waits for it to return. fn must not call the Device.
  virtual void host_fn(int s, void (*fn)(void*), void* arg) = 0;
  /// Work enqueued on `s` after this call waits for everything enqueued on `on` before it.
  virtual void wait(int s, int on) = 0;
  /// Marks the current end of stream `s`; returns a handle for wait_event(). Handles are reused
  /// after 4096 further records: wait on a mark before that many more are made.
  virtual int record(int s) = 0;
  /// Work enqueued on `s` after this call waits for the work before mark `ev`.
  virtual void wait_event(int s, int ev) = 0;
  /// Milliseconds between two marks whose work has completed (after synchronize()).
  virtual double elapsed_ms(int from, int to) = 0;

  /// Flags in page-locked host memory (from alloc_host), written and awaited by a stream without
  /// a host callback: the CPU side polls and writes them itself. supports_flags() says whether
  /// this device can (CUDA: stream memory operations on host memory).
  virtual bool supports_flags() const = 0;
  /// Whether this device's work runs on the host's own cores (SimDevice: yes; CUDA: no). Host
  /// threads that spin while waiting for such a device take the cores it needs.
  virtual bool computes_on_host() const = 0;
  /// When the work before it in `s` is done, stores `value` to *flag (visible to host threads).
  virtual void write_flag(int s, uint32_t* flag, uint32_t value) = 0;
  /// Work enqueued on `s` after this call waits until *flag >= value (written by a host thread).
  virtual void wait_flag(int s, const uint32_t* flag, uint32_t value) = 0;

  /// Copies `copies` (device -> host, into alloc_host memory) then write_flag(flag, value), as
  /// one operation where the device can (CUDA: one kernel for up to 4 copies of <= 64 KiB).
  virtual void copy_out_signal(int s, const HostCopy* copies, int n, uint32_t* flag,
                               uint32_t value) {
    for (int i = 0; i < n; ++i) copy_d2h(s, copies[i].dst, copies[i].src, copies[i].bytes);
    write_flag(s, flag, value);
  }
  /// wait_flag(flag, value) then copies `copies` (host -> device), as one operation where the
  /// device can.
  virtual void wait_copy_in(int s, const uint32_t* flag, uint32_t value, const HostCopy* copies,
                            int n) {
    wait_flag(s, flag, value);
    for (int i = 0; i < n; ++i) copy_h2d(s, copies[i].dst, copies[i].src, copies[i].bytes);
  }

  /// Blocks the calling thread until all streams are idle.
  virtual void synchronize() = 0;

  /// Graphs: between begin_capture() and end_capture() the work enqueued on every stream (which
  /// must be joined back into kMain before the end) is recorded instead of run; replay(h) runs it
  /// again with the same pointers and sizes. Returns a handle >= 0.
  virtual void begin_capture() = 0;
  virtual int end_capture() = 0;
  virtual void replay(int graph) = 0;

  // Kernels, enqueued on stream `s` (contracts in gpu_kernels/kernels.h).
  virtual size_t matmul_workspace_bytes(GgmlType type, int64_t n_in, int64_t n_out,
                                        int64_t n_tok) = 0;
  virtual void matmul(int s, GgmlType type, const void* w, int64_t n_in, int64_t n_out,
                      const float* x, int64_t n_tok, float* out, void* ws, size_t ws_bytes) = 0;
  /// The matmuls of `jobs` on one input x [n_tok, n_in], each as matmul() computes it; a device
  /// may share work between them (CUDA: x quantized once). ws: the largest job's workspace.
  virtual void matmul_group(int s, const MatmulJob* jobs, int n_jobs, int64_t n_in, const float* x,
                            int64_t n_tok, void* ws, size_t ws_bytes) {
    for (int j = 0; j < n_jobs; ++j)
      matmul(s, jobs[j].type, jobs[j].w, n_in, jobs[j].n_out, x, n_tok, jobs[j].out, ws, ws_bytes);
  }
  /// matmul_group of one token whose x has its 8-bit blocks in ws already (a *_q8 producer
  /// returned true): the device need not make them again.
  virtual void matmul_group_q8(int s, const MatmulJob* jobs, int n_jobs, int64_t n_in,
                               const float* x, int64_t n_tok, void* ws, size_t ws_bytes) {
    matmul_group(s, jobs, n_jobs, n_in, x, n_tok, ws, ws_bytes);
  }
  virtual void embed(int s, GgmlType type, const void* w, int64_t n_embd, int64_t n_vocab,
                     const int32_t* tokens, int64_t n_tok, float* out) = 0;
  virtual void rms_norm(int s, const float* x, const float* w, float* out, int64_t rows,
                        int64_t cols, int64_t group, float eps) = 0;
  virtual void add(int s, const float* a, const float* b, float* out, int64_t n) = 0;
  /// sum = a + b, then out = rms_norm(sum) over whole rows of `cols` (a residual add and the next
  /// norm; a device may fuse them). Same results as add() then rms_norm().
  virtual void add_rms_norm(int s, const float* a, const float* b, float* sum, const float* w,
                            float* out, int64_t rows, int64_t cols, float eps) {
    add(s, a, b, sum, rows * cols);
    rms_norm(s, sum, w, out, rows, cols, cols, eps);
  }
  /// add_rms_norm(a, b_host, ...) once *flag >= value (written by a host thread after it wrote
  /// b_host): b_host [rows, cols] is page-locked host memory (alloc_host) read in place, so a CPU
  /// segment's output feeds the residual add after it without a copy to the device first. The
  /// same results as wait_copy_in of b_host into device memory, then add_rms_norm; needs
  /// supports_flags(). The default waits on the stream and reads b_host from the kernel (CUDA
  /// overrides it with one launch that waits and adds).
  virtual void wait_add_rms_norm(int s, const uint32_t* flag, uint32_t value, const float* a,
                                 const float* b_host, float* sum, const float* w, float* out,
                                 int64_t rows, int64_t cols, float eps) {
    wait_flag(s, flag, value);
    add_rms_norm(s, a, b_host, sum, w, out, rows, cols, eps);
  }
  virtual void add_bias(int s, const float* x, const float* bias, float* out, int64_t rows,
                        int64_t cols) = 0;
  virtual void swiglu(int s, const float* gate, const float* up, float* out, int64_t n) = 0;
  virtual void rope(int s, const float* x, float* out, int64_t rows, int32_t n_head,
                    int32_t head_dim, int32_t n_rot, float freq_base, bool neox,
                    const int32_t* positions) = 0;
  /// For each job: rms_norm of every head (group = head_dim) into out, then rope of out in
  /// place (a layer's q and k norms before RoPE); a device may fuse them. Same results as
  /// rms_norm() then rope().
  virtual void norm_rope(int s, const NormRopeJob* jobs, int n_jobs, int64_t rows, int32_t head_dim,
                         float eps, int32_t n_rot, float freq_base, bool neox,
                         const int32_t* positions) {
    for (int j = 0; j < n_jobs; ++j) {
      const int64_t cols = static_cast<int64_t>(jobs[j].n_head) * head_dim;
      rms_norm(s, jobs[j].x, jobs[j].w, jobs[j].out, rows, cols, head_dim, eps);
      rope(s, jobs[j].out, jobs[j].out, rows, jobs[j].n_head, head_dim, n_rot, freq_base, neox,
           positions);
    }
  }
  virtual size_t attention_workspace_bytes(int64_t n_tok, int64_t n_ctx, int32_t n_head,
                                           int32_t head_dim) = 0;
  virtual void attention(int s, const float* q, const float* k, const float* v, int64_t n_tok,
                         const int32_t* positions, uint16_t* k_cache, uint16_t* v_cache,
                         int64_t n_ctx, int32_t n_head, int32_t n_head_kv, int32_t head_dim,
                         float scale, float* out, void* ws, size_t ws_bytes) = 0;
  /// attention, and where the device can, also the 8-bit blocks of `out` in q8_ws (the
  /// workspace of the matmul_group_q8 that reads out next; CUDA: the decode GEMV's activation
  /// blocks, the bits its own quantization makes). Returns whether they were written (the
  /// default: never).
  virtual bool attention_q8(int s, const float* q, const float* k, const float* v, int64_t n_tok,
                            const int32_t* positions, uint16_t* k_cache, uint16_t* v_cache,
                            int64_t n_ctx, int32_t n_head, int32_t n_head_kv, int32_t head_dim,
                            float scale, float* out, void* ws, size_t ws_bytes, void* q8_ws) {
    (void)q8_ws;
    attention(s, q, k, v, n_tok, positions, k_cache, v_cache, n_ctx, n_head, n_head_kv, head_dim,
              scale, out, ws, ws_bytes);
    return false;
  }
  virtual void moe_route(int s, const float* logits, int64_t n_tok, int32_t n_expert, int32_t k,
                         bool norm, float* out) = 0;
  /// moe_route of one token, then copy_out_signal(copies, n, flag, value) (the route, which
  /// `copies` may name, and the hidden state going to a CPU segment); a device may do both in
  /// one operation (CUDA: one launch for small copies).
  virtual void moe_route_signal(int s, const float* logits, int32_t n_expert, int32_t k, bool norm,
                                float* out, const HostCopy* copies, int n, uint32_t* flag,
                                uint32_t value) {
    moe_route(s, logits, 1, n_expert, k, norm, out);
    copy_out_signal(s, copies, n, flag, value);
  }
  /// The router's matmul (w [n_expert, n_in] of `type`, x [1, n_in]) into logits, then
  /// moe_route_signal on them; a device may do both in one operation (CUDA, float weights: one
  /// launch, the same bits as the two).
  virtual void router_route_signal(int s, GgmlType type, const void* w, int64_t n_in,
                                   const float* x, int32_t n_expert, int32_t k, bool norm,
                                   float* logits, float* route, const HostCopy* copies, int n,
                                   uint32_t* flag, uint32_t value, void* ws, size_t ws_bytes) {
    matmul(s, type, w, n_in, n_expert, x, 1, logits, ws, ws_bytes);
    moe_route_signal(s, logits, n_expert, k, norm, route, copies, n, flag, value);
  }
  /// moe_experts' workspace for n_tok tokens and `slots` (its staging room).
  virtual size_t moe_workspace_bytes(const MoeWeights& w, int64_t n_tok, const MoeSlots& slots) = 0;
  /// gpu::moe_experts: the slots [slots.begin, slots.end) of each token whose expert the mask
  /// keeps; slots.stage: the weights are pinned host memory, copied in before computing.
  virtual void moe_experts(int s, const MoeWeights& w, const float* h, const float* route,
                           int64_t n_tok, const uint8_t* expert_mask, const MoeSlots& slots,
                           float* out, void* ws, size_t ws_bytes) = 0;
  virtual void argmax(int s, const float* logits, int64_t rows, int64_t n_vocab, int32_t* ids) = 0;
};

/// A simulated device with `capacity_bytes` of memory (see the file comment).
std::unique_ptr<Device> make_sim_device(size_t capacity_bytes);

/// True when this build has the CUDA backend and a CUDA device is present.
bool cuda_available();
/// Programmatic dependent launch of the CUDA kernels (gpu::set_pdl in gpu_kernels/kernels.h:
/// on by default on compute capability >= 9.0, BERTH_PDL=0 turns it off); returns the previous
/// setting. Results are the same bits either way; for tests and benchmarks. Without the CUDA
/// backend: does nothing and returns false.
bool set_cuda_pdl(bool on);

/// The CUDA device `index`. Throws Error(unsupported) when the build has no CUDA backend,
/// Error(io) naming the CUDA error when the device cannot be opened.
std::unique_ptr<Device> make_cuda_device(int index = 0);

}  // namespace berth
