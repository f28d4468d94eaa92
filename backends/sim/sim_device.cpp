// SimDevice: the Device contract on the CPU (see device.h). Memory is ordinary host memory
// tracked against a capacity; kernels are the CPU kernels, with the KV cache stored as f16 as
// on the GPU. Stream operations run asynchronously, as on a GPU: one worker thread runs the main
// and aux streams' operations in enqueue order (a valid schedule of those streams: whatever a
// wait or an event orders, enqueue order already does), or they are recorded while capturing and
// enqueued again by replay; a second worker runs the copy stream's (kCopy), so weights copied
// there land while the other streams compute, as on a GPU's copy engine, and a wait or an event
// between the two workers really waits. (Captured work must not cross between them: capture
// refuses it.) make_sim_device's copy_delay_us slows each kCopy copy down, so tests can make a
// copy overlap the steps after it. So the executor's flag hand-off works here as on CUDA (the
// worker waits for a flag a host thread writes), and host code that reads results without the
// synchronisation a GPU needs reads stale memory here too. upload, download and the frees
// wait for the worker first (cudaMemcpy and cudaFree order themselves after earlier work).
// An operation that throws (or a flag wait that times out) makes the device fail: the rest of
// the queue is dropped and the next synchronize() rethrows the error.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <new>
#include <thread>
#include <unordered_map>
#include <vector>

#include "berth/backends/device.h"
#include "berth/core/error.h"
#include "berth/core/fp16.h"
#include "berth/cpu_kernels/gdn.h"
#include "berth/cpu_kernels/ops.h"
#include "berth/cpu_kernels/quant_dot.h"
#include "stream_device.h"

namespace berth {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

using backend_detail::moe_slots;
using backend_detail::moe_weights;
using graph::Op;
using graph::OpKind;

class SimDevice final : public backend_detail::StreamDevice {
 public:
  explicit SimDevice(const SimDeviceOptions& o)
      : opt_(o),
        capacity_(o.capacity_bytes),
        copy_delay_us_(o.copy_delay_us),
        worker_([this] { work(0); }),
        copy_worker_([this] { work(1); }) {}
  ~SimDevice() override {
    stop_flag_waits_.store(true, std::memory_order_relaxed);  // no flag will come any more
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
    copy_worker_.join();
    for (auto& [p, n] : sizes_) std::free(p);
    for (void* p : host_) std::free(p);
  }

  DeviceInfo info() const override {
    return DeviceInfo{.name = opt_.unified ? "SIM0 (unified)" : "SIM0",
                      .total_bytes = capacity_,
                      .free_bytes = opt_.reported_free_bytes > 0
                                        ? std::min(opt_.reported_free_bytes, capacity_ - used_)
                                        : capacity_ - used_,
                      .flags = true,
                      .computes_on_host = true,
                      .can_register_host = true,
                      .multi_seq = true,
                      .moe_expert_reads = moe_reads_.load(),
                      .moe_expert_bytes = moe_bytes_.load(),
                      .unified = opt_.unified,
                      .pageable_access = opt_.pageable_access,
                      .os_available_bytes = opt_.unified ? opt_.os_available_bytes : 0,
                      .gpu_gbps = opt_.gpu_gbps,
                      .cpu_gbps = opt_.cpu_gbps,
                      .gpu_tflops = opt_.gpu_tflops,
                      .cpu_tflops = opt_.cpu_tflops};
  }
  void* alloc(size_t bytes, Mem kind, std::string_view what) override {
    return kind == Mem::device ? alloc_device(bytes, what) : alloc_pinned(bytes, what);
  }
  void free(void* p, Mem kind) override {
    if (kind == Mem::device)
      free_device(p);
    else
      free_pinned(p);
  }

  void* alloc_device(size_t bytes, std::string_view what) {
    bytes = std::max<size_t>(bytes, 1);
    if (bytes > capacity_ - used_)
      throw Error(ErrorCategory::out_of_memory,
                  fmt::format("{}: cannot allocate {:.1f} MiB for {} ({:.1f} MiB free)", name(),
                              static_cast<double>(bytes) / kMiB, what,
                              static_cast<double>(capacity_ - used_) / kMiB));
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (!p)
      throw Error(ErrorCategory::out_of_memory,
                  fmt::format("{}: host memory for {:.1f} MiB of {} is exhausted", name(),
                              static_cast<double>(bytes) / kMiB, what));
    // Fresh device memory holds garbage, not zeros: make reads of unwritten bytes visible.
    std::memset(p, 0x7f, bytes);
    sizes_[p] = bytes;
    used_ += bytes;
    return p;
  }
  void free_device(void* p) {
    drain();
    auto it = sizes_.find(p);
    if (it == sizes_.end()) return;
    used_ -= it->second;
    std::free(p);
    sizes_.erase(it);
  }
  void* alloc_pinned(size_t bytes, std::string_view what) {
    void* p = std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256);
    if (!p)
      throw Error(ErrorCategory::out_of_memory,
                  fmt::format("{}: cannot allocate {:.1f} MiB of pinned host memory for {}", name(),
                              static_cast<double>(bytes) / kMiB, what));
    host_.push_back(p);
    return p;
  }
  void free_pinned(void* p) {
    drain();
    auto it = std::find(host_.begin(), host_.end(), p);
    if (it == host_.end()) return;
    std::free(p);
    host_.erase(it);
  }
  // Host memory is what the worker reads anyway: nothing to lock.
  bool register_host(const void*, size_t) override { return true; }
  void unregister_host(const void*) override { drain(); }
  // kSync waits for the worker first (cudaMemcpy orders itself after earlier work too).
  void copy(int s, void* dst, const void* src, size_t bytes) override {
    if (s == kSync) {
      synchronize();
      std::memcpy(dst, src, bytes);
      return;
    }
    if (s == kCopy && copy_delay_us_ > 0) {
      const int64_t us = copy_delay_us_;
      enqueue(s, [=] {
        std::this_thread::sleep_for(std::chrono::microseconds(us));
        std::memcpy(dst, src, bytes);
      });
      return;
    }
    enqueue(s, [=] { std::memcpy(dst, src, bytes); });
  }
  void host_fn(int s, void (*fn)(void*), void* arg) override {
    enqueue(s, [fn, arg] { fn(arg); });
  }
  // Streams on one worker are ordered by enqueue order already; across the two workers a wait
  // is a mark on `on` and an operation on `s` that blocks until the mark is reached.
  void wait(int s, int on) override {
    check_stream(s), check_stream(on);
    if (queue_of(s) != queue_of(on)) wait_event(s, record(on));
  }
  // Work runs at enqueue time (or at replay), so a mark's time is when its place in the stream
  // is reached: host steady-clock milliseconds, in a ring of 4096 as the contract allows.
  int record(int s) override {
    check_stream(s);
    const int id = static_cast<int>(next_mark_++ % kMarks);
    const uint64_t seq = next_mark_;
    mark_seq_[static_cast<size_t>(id)] = seq;
    mark_queue_[static_cast<size_t>(id)] = queue_of(s);
    enqueue(s, [this, id, seq] {
      marks_[static_cast<size_t>(id)] = std::chrono::duration<double, std::milli>(
                                            std::chrono::steady_clock::now().time_since_epoch())
                                            .count();
      reached_[static_cast<size_t>(id)].store(seq, std::memory_order_release);
    });
    return id;
  }
  void wait_event(int s, int ev) override {
    check_stream(s);
    const auto id = static_cast<size_t>(ev);
    if (id >= kMarks) throw Error(ErrorCategory::internal, fmt::format("SIM0: no mark {}", ev));
    if (queue_of(s) == mark_queue_[id]) return;
    if (capturing_)
      throw Error(ErrorCategory::internal,
                  "SIM0: captured work waits across the copy stream, which replay cannot order");
    const uint64_t seq = mark_seq_[id];
    enqueue(s, [this, id, seq] {
      for (int spin = 0; reached_[id].load(std::memory_order_acquire) < seq; ++spin) {
        if (stop_flag_waits_.load(std::memory_order_relaxed))
          throw Error(ErrorCategory::internal, "SIM0: device closed while waiting for a mark");
        if (failed_.load(std::memory_order_acquire)) return;  // the mark's work was dropped
        if (spin < 256)
          std::this_thread::yield();
        else
          std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    });
  }
  bool done(int ev) override {
    const auto id = static_cast<size_t>(ev);
    if (id >= kMarks) throw Error(ErrorCategory::internal, fmt::format("SIM0: no mark {}", ev));
    return reached_[id].load(std::memory_order_acquire) >= mark_seq_[id];
  }
  double elapsed_ms(int from, int to) override {
    synchronize();  // CUDA refuses marks not yet reached; here they are waited for
    return marks_.at(static_cast<size_t>(to)) - marks_.at(static_cast<size_t>(from));
  }
  void write_flag(int s, uint32_t* flag, uint32_t value) override {
    enqueue(s, [flag, value] {
      std::atomic_ref<uint32_t>(*flag).store(value, std::memory_order_release);
    });
  }
  // Waits on the worker, as the GPU's stream would; a flag not written within kFlagTimeout
  // fails the device (a GPU would hang) so that a test reports it instead of hanging.
  void wait_flag(int s, const uint32_t* flag, uint32_t value) override {
    enqueue(s, [this, flag, value] {
      std::atomic_ref<uint32_t> f(*const_cast<uint32_t*>(flag));
      const auto t0 = std::chrono::steady_clock::now();
      for (uint64_t spin = 0; f.load(std::memory_order_acquire) < value; ++spin) {
        if (stop_flag_waits_.load(std::memory_order_relaxed))
          throw Error(ErrorCategory::internal, "SIM0: device closed while waiting for a flag");
        if (std::chrono::steady_clock::now() - t0 > kFlagTimeout)
          throw Error(
              ErrorCategory::internal,
              fmt::format("SIM0: a flag wait for value {} was not met in {} s", value,
                          std::chrono::duration_cast<std::chrono::seconds>(kFlagTimeout).count()));
        // Yield at first, then sleep: the host thread that writes the flag needs a core, and
        // on a loaded machine a yielding loop keeps taking it.
        if (spin < 256)
          std::this_thread::yield();
        else
          std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    });
  }
  // Waits until the worker has run everything enqueued; rethrows the error that failed it.
  void synchronize() override {
    drain();
    std::exception_ptr e;
    {
      std::lock_guard<std::mutex> lk(mu_);
      std::swap(e, error_);
      failed_.store(false, std::memory_order_release);
    }
    if (e) std::rethrow_exception(e);
  }

  // Stream s's worker has passed a mark recorded now (or failed: the error is rethrown).
  void synchronize(int s) override {
    check_stream(s);
    if (capturing_) throw Error(ErrorCategory::internal, "SIM0: synchronize while capturing");
    const int ev = record(s);
    const auto id = static_cast<size_t>(ev);
    const uint64_t seq = mark_seq_[id];
    bool failed = false;
    {
      // The workers notify after each operation.
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] {
        return reached_[id].load(std::memory_order_acquire) >= seq || error_ != nullptr;
      });
      failed = error_ != nullptr;
    }
    if (failed) synchronize();  // rethrows
  }

  int capture(const std::function<void()>& enqueue_work) override {
    if (capturing_) throw Error(ErrorCategory::internal, "SIM0: capture already begun");
    capturing_ = true;
    captured_.clear();
    try {
      enqueue_work();
    } catch (...) {
      capturing_ = false;
      captured_.clear();
      throw;
    }
    capturing_ = false;
    graphs_.push_back(std::move(captured_));
    captured_.clear();
    return static_cast<int>(graphs_.size() - 1);
  }
  void replay(int graph) override {
    for (auto& f : graphs_.at(static_cast<size_t>(graph))) push(0, f);
  }

  // The kernels, each enqueued on stream `s` (contracts in gpu_kernels/kernels.h).
  void matmul(int s, GgmlType type, const void* w, int64_t n_in, int64_t n_out, const float* x,
              int64_t n_tok, float* out, void* ws) {
    enqueue(s, [=] {
      const size_t ab = cpu::activation_row_bytes(type, n_in);
      for (int64_t t = 0; t < n_tok; ++t) {
        cpu::quantize_activation(type, x + t * n_in, ws, n_in);
        cpu::gemm_rows(type, w, n_out, ws, ab, 1, n_in, out + t * n_out, n_out);
      }
    });
  }
  void embed(int s, GgmlType type, const void* w, int64_t n_embd, int64_t n_vocab,
             const int32_t* tokens, int64_t n_tok, float* out) {
    enqueue(s, [=] {
      TensorView v;
      v.type = type;
      v.ne = {n_embd, n_vocab, 1, 1};
      v.data = w;
      for (int64_t t = 0; t < n_tok; ++t) {
        const int32_t id = tokens[t];
        if (id < 0 || id >= n_vocab)
          std::fill(out + t * n_embd, out + (t + 1) * n_embd, 0.0f);
        else
          cpu::get_row(v, id, out + t * n_embd);
      }
    });
  }
  void rms_norm(int s, const float* x, const float* w, float* out, int64_t rows, int64_t cols,
                int64_t group, float eps) {
    enqueue(s, [=] {
      const int64_t n = rows * (cols / group);
      for (int64_t r = 0; r < n; ++r) cpu::rms_norm(x + r * group, w, out + r * group, group, eps);
    });
  }
  void add(int s, const float* a, const float* b, float* out, int64_t n) {
    enqueue(s, [=] { cpu::add(a, b, out, n); });
  }
  void add_bias(int s, const float* x, const float* bias, float* out, int64_t rows, int64_t cols) {
    enqueue(s, [=] {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = x[r * cols + c] + bias[c];
    });
  }
  void swiglu(int s, const float* gate, const float* up, float* out, int64_t n) {
    enqueue(s, [=] { cpu::swiglu(gate, up, out, n); });
  }
  void rope(int s, const float* x, float* out, int64_t rows, int32_t n_head, int32_t head_dim,
            int32_t n_rot, float freq_base, bool neox, const int32_t* positions) {
    enqueue(s, [=] {
      const int32_t half = n_rot / 2;
      std::vector<float> cs(static_cast<size_t>(2 * half));
      const int64_t cols = int64_t{n_head} * head_dim;
      for (int64_t r = 0; r < rows; ++r) {
        const double pos = positions[r];
        for (int32_t i = 0; i < half; ++i) {
          const double theta = pos * std::pow(static_cast<double>(freq_base), -2.0 * i / n_rot);
          cs[static_cast<size_t>(i)] = static_cast<float>(std::cos(theta));
          cs[static_cast<size_t>(half + i)] = static_cast<float>(std::sin(theta));
        }
        if (out != x) std::memcpy(out + r * cols, x + r * cols, static_cast<size_t>(cols) * 4);
        cpu::rope_inplace(out + r * cols, n_head, head_dim, n_rot, cs.data(), cs.data() + half,
                          !neox);
      }
    });
  }
  void attention(int s, const float* q, const float* k, const float* v, int64_t n_tok,
                 const int32_t* positions, const int32_t* seqs, uint16_t* k_cache,
                 uint16_t* v_cache, int64_t n_ctx, int32_t n_head, int32_t n_head_kv,
                 int32_t head_dim, float scale, float* out, void* ws) {
    enqueue(s, [=] {
      const int64_t kv_dim = int64_t{n_head_kv} * head_dim;
      const auto base = [&](int64_t t) { return seqs ? int64_t{seqs[t]} * n_ctx : 0; };
      for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t i = 0; i < kv_dim; ++i) {
          const int64_t row = base(t) + positions[t];
          k_cache[row * kv_dim + i] = f32_to_fp16(k[t * kv_dim + i]);
          v_cache[row * kv_dim + i] = f32_to_fp16(v[t * kv_dim + i]);
        }
      // Per run of adjacent tokens of one sequence and per KV head: the sequence's K and V rows
      // decoded to f32 once, then every query head of the group.
      float* kf = static_cast<float*>(ws);
      float* vf = kf + n_ctx * head_dim;
      float* scores = vf + n_ctx * head_dim;
      const int32_t group = n_head / n_head_kv;
      for (int64_t r0 = 0, r1; r0 < n_tok; r0 = r1) {
        for (r1 = r0 + 1; r1 < n_tok && base(r1) == base(r0);) ++r1;
        const int64_t n_kv = positions[r1 - 1] + 1;
        const uint16_t* kc = k_cache + base(r0) * kv_dim;
        const uint16_t* vc = v_cache + base(r0) * kv_dim;
        for (int32_t hk = 0; hk < n_head_kv; ++hk) {
          for (int64_t j = 0; j < n_kv; ++j)
            for (int32_t d = 0; d < head_dim; ++d) {
              kf[j * head_dim + d] = fp16_to_f32(kc[j * kv_dim + hk * head_dim + d]);
              vf[j * head_dim + d] = fp16_to_f32(vc[j * kv_dim + hk * head_dim + d]);
            }
          for (int32_t h = hk * group; h < (hk + 1) * group; ++h)
            for (int64_t t = r0; t < r1; ++t) {
              const int64_t qo = t * n_head * head_dim + int64_t{h} * head_dim;
              cpu::attention_head(q + qo, kf, head_dim, vf, head_dim, positions[t] + 1, head_dim,
                                  scale, out + qo, scores);
            }
        }
      }
    });
  }
  void moe_route(int s, const float* logits, int64_t n_tok, int32_t n_expert, int32_t k, bool norm,
                 float* out, const int32_t* forced) {
    enqueue(s, [=] {
      std::vector<int32_t> ids(static_cast<size_t>(k));
      for (int64_t t = 0; t < n_tok; ++t) {
        float* o = out + t * 2 * k;
        if (forced) {
          std::copy_n(forced + t * k, k, ids.data());
          cpu::moe_forced(logits + t * n_expert, n_expert, k, norm, ids.data(), o + k);
        } else {
          cpu::moe_topk(logits + t * n_expert, n_expert, k, norm, ids.data(), o + k);
        }
        for (int32_t j = 0; j < k; ++j) o[j] = static_cast<float>(ids[static_cast<size_t>(j)]);
      }
    });
  }
  // Host and device memory are one here, so MoeSlots::stage needs no copy (and no room).
  static size_t moe_workspace_bytes(const MoeWeights& w) {
    const size_t a = std::max(cpu::activation_row_bytes(w.gate_type, w.n_embd),
                              cpu::activation_row_bytes(w.up_type, w.n_embd));
    const size_t b = cpu::activation_row_bytes(w.down_type, w.n_ff);
    return a + b + static_cast<size_t>(3 * w.n_ff + w.n_embd) * 4 + 256;
  }
  void moe_experts(int s, const MoeWeights& w, const float* h, const float* route, int64_t n_tok,
                   const uint8_t* mask, const MoeSlots& slots, float* out, void* ws) {
    enqueue(s, [=, this] {
      const int32_t k = w.n_expert_used;
      const int32_t sb = slots.begin, se = slots.end < 0 ? k : slots.end;
      const size_t gate_row = row_bytes(w.gate_type, w.n_embd);
      const size_t up_row = row_bytes(w.up_type, w.n_embd);
      const size_t down_row = row_bytes(w.down_type, w.n_ff);
      uint8_t* act = static_cast<uint8_t*>(ws);
      uint8_t* act_d = act + std::max(cpu::activation_row_bytes(w.gate_type, w.n_embd),
                                      cpu::activation_row_bytes(w.up_type, w.n_embd));
      float* g = reinterpret_cast<float*>(
          (reinterpret_cast<uintptr_t>(act_d + cpu::activation_row_bytes(w.down_type, w.n_ff)) +
           63) /
          64 * 64);
      float* u = g + w.n_ff;
      // The (token, slot) pairs grouped by expert, each expert's matrices read once for all of
      // its pairs (the count the read-once tests check); then each token's sum in slot order.
      // by_table: expert e computes here when the slot table (device memory, read now, as a
      // kernel reads it) gives it a slot, and its matrices are that slot's.
      const int32_t* table = slots.by_table ? slots.table : nullptr;
      if (slots.by_table && !table)
        throw Error(ErrorCategory::internal, "SIM0: moe_experts over expert slots without a table");
      const auto computes = [&](int32_t e) {
        if (e < 0 || e >= w.n_expert) return false;
        if (table) return table[e] >= 0 && table[e] < slots.n_slots;
        return !mask || mask[e] != 0;
      };
      const auto matrix = [&](int32_t e) -> int64_t { return table ? table[e] : e; };
      std::vector<std::vector<int64_t>> by_expert(static_cast<size_t>(w.n_expert));
      for (int64_t t = 0; t < n_tok; ++t)
        for (int32_t j = sb; j < se; ++j) {
          const int32_t e = static_cast<int32_t>(route[t * 2 * k + j]);
          if (!computes(e)) continue;
          by_expert[static_cast<size_t>(e)].push_back(t * k + j);
        }
      std::vector<float> ys(static_cast<size_t>(n_tok * k * w.n_embd));
      int64_t distinct = 0;
      for (int32_t e = 0; e < w.n_expert; ++e) {
        const std::vector<int64_t>& pairs = by_expert[static_cast<size_t>(e)];
        if (pairs.empty()) continue;
        ++distinct;
        const int64_t m = matrix(e);
        const auto* gw = static_cast<const uint8_t*>(w.gate) + m * w.n_ff * gate_row;
        const auto* uw = static_cast<const uint8_t*>(w.up) + m * w.n_ff * up_row;
        const auto* dw = static_cast<const uint8_t*>(w.down) + m * w.n_embd * down_row;
        for (int64_t pair : pairs) {
          const float* x = h + (pair / k) * w.n_embd;
          float* y = ys.data() + pair * w.n_embd;
          cpu::quantize_activation(w.gate_type, x, act, w.n_embd);
          cpu::gemm_rows(w.gate_type, gw, w.n_ff, act, 0, 1, w.n_embd, g, w.n_ff);
          cpu::quantize_activation(w.up_type, x, act, w.n_embd);
          cpu::gemm_rows(w.up_type, uw, w.n_ff, act, 0, 1, w.n_embd, u, w.n_ff);
          cpu::swiglu(g, u, g, w.n_ff);
          cpu::quantize_activation(w.down_type, g, act_d, w.n_ff);
          cpu::gemm_rows(w.down_type, dw, w.n_embd, act_d, 0, 1, w.n_ff, y, w.n_embd);
        }
      }
      moe_reads_ += distinct;
      moe_bytes_ += distinct *
                    static_cast<int64_t>(w.n_ff * gate_row + w.n_ff * up_row + w.n_embd * down_row);
      for (int64_t t = 0; t < n_tok; ++t) {
        float* o = out + t * w.n_embd;
        std::fill(o, o + w.n_embd, 0.0f);
        for (int32_t j = sb; j < se; ++j) {
          const int32_t e = static_cast<int32_t>(route[t * 2 * k + j]);
          if (!computes(e)) continue;
          const float wt = route[t * 2 * k + k + j];
          const float* y = ys.data() + (t * k + j) * w.n_embd;
          for (int64_t c = 0; c < w.n_embd; ++c) o[c] += wt * y[c];
        }
      }
    });
  }
  void argmax(int s, const float* logits, int64_t rows, int64_t n_vocab, int32_t* ids) {
    enqueue(s, [=] {
      for (int64_t r = 0; r < rows; ++r) {
        const float* l = logits + r * n_vocab;
        int64_t best = 0;
        for (int64_t i = 1; i < n_vocab; ++i)
          if (l[i] > l[best]) best = i;
        ids[r] = static_cast<int32_t>(best);
      }
    });
  }

  // The Qwen3.5 hybrids' ops (graph.h), with the CPU executor's kernels in its order: tokens in
  // row order, each against its sequence's state (zeroed at position 0).
  void head_slice(int s, const float* x, float* out, int64_t rows, int64_t n_group,
                  graph::SliceParams p) {
    enqueue(s, [=] {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < n_group; ++j)
          std::memcpy(out + (r * n_group + j) * p.len, x + (r * n_group + j) * p.group + p.offset,
                      static_cast<size_t>(p.len) * sizeof(float));
    });
  }
  void sigmoid_mul(int s, const float* x, const float* gate, float* out, int64_t rows, int64_t cols,
                   bool per_row) {
    enqueue(s, [=] {
      std::vector<float> row(per_row ? static_cast<size_t>(cols) : 0);
      for (int64_t r = 0; r < rows; ++r) {
        const float* gr = gate + r * cols;
        if (per_row) {
          std::fill(row.begin(), row.end(), gate[r]);
          gr = row.data();
        }
        cpu::sigmoid_gate(x + r * cols, gr, out + r * cols, cols);
      }
    });
  }
  void rms_norm_gated(int s, const float* x, const float* z, const float* w, float* out,
                      int64_t rows, int64_t cols, int64_t group, float eps) {
    enqueue(s, [=] {
      for (int64_t r = 0; r < rows * (cols / group); ++r)
        cpu::rms_norm_gated(x + r * group, w, z + r * group, out + r * group, group, eps);
    });
  }
  void ssm_conv(int s, const float* x, float* out, int64_t n_tok, int64_t cols, const float* w,
                int32_t kernel, float* state, const int32_t* positions, const int32_t* seqs) {
    enqueue(s, [=] {
      const int64_t dim = (kernel - 1) * cols;
      for (int64_t t = 0; t < n_tok; ++t) {
        float* st = state + (seqs ? seqs[t] : 0) * dim;
        if (positions[t] == 0) std::fill_n(st, dim, 0.0f);
        cpu::conv1d_causal(x + t * cols, cols, out + t * cols, cols, 1, w, kernel, st, cols, 0,
                           cols, true);
      }
    });
  }
  void gated_delta(int s, const float* y, const float* alpha, const float* b, const float* ssm_a,
                   const float* dt_bias, int64_t n_tok, graph::SsmParams p, float* state,
                   const int32_t* positions, const int32_t* seqs, float* out) {
    enqueue(s, [=] {
      const int64_t hk = p.n_k_head, hv = p.n_v_head, dk = p.d_k, dv = p.d_v;
      const int64_t qk_cols = 2 * hk * dk, y_cols = qk_cols + hv * dv, dim = hv * dk * dv;
      const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
      std::vector<float> qk(static_cast<size_t>(qk_cols)), g(static_cast<size_t>(hv)),
          beta(static_cast<size_t>(hv));
      for (int64_t t = 0; t < n_tok; ++t) {
        float* st = state + (seqs ? seqs[t] : 0) * dim;
        if (positions[t] == 0) std::fill_n(st, dim, 0.0f);
        for (int64_t j = 0; j < 2 * hk; ++j)
          cpu::l2_norm(y + t * y_cols + j * dk, qk.data() + j * dk, dk, p.eps);
        cpu::gdn_gates(alpha + t * hv, b + t * hv, dt_bias, ssm_a, g.data(), beta.data(), hv);
        for (int64_t h = 0; h < hv; ++h) {
          const int64_t j = h % hk;  // V head h reads K head h mod H_k
          cpu::gated_delta_rule(qk.data() + j * dk, qk_cols, qk.data() + (hk + j) * dk, qk_cols,
                                y + t * y_cols + qk_cols + h * dv, y_cols, g.data() + h,
                                beta.data() + h, hv, 1, static_cast<int32_t>(dk),
                                static_cast<int32_t>(dv), scale, st + h * dk * dv,
                                out + t * hv * dv + h * dv, hv * dv, 0, static_cast<int32_t>(dv));
        }
      }
    });
  }

  // --- Compute: every op kind; fused calls run as their parts, one after the other. ---------
  bool supports(const Op& op) const override {
    (void)op;
    return true;
  }

  size_t op_workspace(const StepView& view, const Op& op, bool host_w) const override {
    const graph::WeightTable& w = *view.weights;
    (void)host_w;  // host and device memory are one: staging needs no room
    switch (op.kind) {
      case OpKind::matmul:
        return cpu::activation_row_bytes(w[op.weight].type, w[op.weight].ne[0]);
      case OpKind::attention:
        return static_cast<size_t>(view.n_ctx) * 4 *
               (2 * static_cast<size_t>(op.attn.head_dim) + 1);
      case OpKind::moe_experts:
        return moe_workspace_bytes(moe_weights(w, op.moe, nullptr));
      default:
        return 0;
    }
  }

  void enqueue(const Call& c, const StepBindings& b) override {
    if (enqueue_handoff(c, b)) return;
    const graph::Graph& g = *b.view.g;
    if (c.kind == CallKind::select) {
      const graph::ValueInfo& oi = g.values[static_cast<size_t>(g.output)];
      argmax(kMain, b.value[static_cast<size_t>(g.output)], oi.rows, oi.cols, b.selected_dev);
      copy(kMain, b.selected_host, b.selected_dev, sizeof(int32_t) * static_cast<size_t>(oi.rows));
      return;
    }
    if (c.kind == CallKind::wait_add_norm) wait_flag(kMain, &b.flags[2 * c.seg + 1], 1);
    for (int32_t i : c.ops) enqueue_op(i, c.host_w, b);
    for (int32_t i : c.ropes) enqueue_op(i, false, b);
    if (c.kind == CallKind::route_fork || c.kind == CallKind::router_route_fork)
      fork_rest(c, b, false);
  }

  void enqueue_op(int32_t index, bool host_w, const StepBindings& b) {
    const graph::Graph& g = *b.view.g;
    const graph::WeightTable& weights = *b.view.weights;
    const auto i = static_cast<size_t>(index);
    const Op& op = g.ops[i];
    const graph::ValueInfo& oi = g.values[static_cast<size_t>(op.output)];
    float* out = b.value[static_cast<size_t>(op.output)];
    const auto in = [&](size_t j) { return b.value[static_cast<size_t>(op.inputs.at(j))]; };
    const auto wdev = [&](graph::WeightId id) { return b.weight.at(static_cast<size_t>(id)); };
    const auto wf = [&](graph::WeightId id) {
      return id == graph::kNoWeight ? nullptr : static_cast<const float*>(wdev(id));
    };
    const int64_t rows = oi.rows, cols = oi.cols;
    switch (op.kind) {
      case OpKind::embed: {
        const TensorView& w = weights[op.weight];
        embed(kMain, w.type, wdev(op.weight), w.ne[0], w.ne[1], b.tokens, rows, out);
        return;
      }
      case OpKind::rms_norm:
        rms_norm(kMain, in(0), wf(op.weight), out, rows, cols,
                 op.norm_group > 0 ? op.norm_group : cols, op.eps);
        return;
      case OpKind::matmul: {
        const TensorView& w = weights[op.weight];
        matmul(kMain, w.type, wdev(op.weight), w.ne[0], w.n_rows(), in(0), rows, out, b.ws);
        return;
      }
      case OpKind::add:
        add(kMain, in(0), in(1), out, rows * cols);
        return;
      case OpKind::swiglu:
        swiglu(kMain, in(0), in(1), out, rows * cols);
        return;
      case OpKind::rope: {
        const graph::RopeParams& p = op.rope;
        rope(kMain, in(0), out, rows, p.n_head, p.head_dim, p.n_rot, p.freq_base,
             p.mode == graph::RopeMode::neox, b.positions);
        return;
      }
      case OpKind::attention: {
        const graph::AttentionParams& p = op.attn;
        const auto l = static_cast<size_t>(p.layer);
        attention(kMain, in(0), in(1), in(2), rows, b.positions, b.seqs, b.k_cache.at(l),
                  b.v_cache.at(l), b.view.n_ctx, p.n_head, p.n_head_kv, p.head_dim, p.scale, out,
                  b.ws);
        return;
      }
      case OpKind::take_last_rows: {
        const graph::ValueInfo& ii = g.values[static_cast<size_t>(op.inputs[0])];
        copy(kMain, out, in(0) + (ii.rows - rows) * cols, static_cast<size_t>(rows * cols) * 4);
        return;
      }
      case OpKind::add_bias:
        add_bias(kMain, in(0), wf(op.weight), out, rows, cols);
        return;
      case OpKind::moe_route:
        moe_route(kMain, in(0), rows, op.moe.n_expert, op.moe.n_expert_used, op.moe.norm_weights,
                  out, backend_detail::forced_route_of(b, i));
        return;
      case OpKind::moe_experts: {
        const std::array<const void*, 3>& o = b.moe_w.at(i);
        const void* dw[3] = {wdev(op.moe.gate), wdev(op.moe.up), wdev(op.moe.down)};
        moe_experts(kMain, moe_weights(weights, op.moe, o[0] ? o.data() : dw), in(0), in(1), rows,
                    b.mask.at(i), moe_slots(op, host_w, backend_detail::slot_table_of(b, i)), out,
                    b.ws);
        return;
      }
      case OpKind::head_slice: {
        const int64_t in_cols = g.values[static_cast<size_t>(op.inputs[0])].cols;
        head_slice(kMain, in(0), out, rows, in_cols / op.slice.group, op.slice);
        return;
      }
      case OpKind::sigmoid_mul: {
        const bool per_row = g.values[static_cast<size_t>(op.inputs[1])].cols == 1 && cols != 1;
        sigmoid_mul(kMain, in(0), in(1), out, rows, cols, per_row);
        return;
      }
      case OpKind::rms_norm_gated:
        rms_norm_gated(kMain, in(0), in(1), wf(op.weight), out, rows, cols, op.norm_group, op.eps);
        return;
      case OpKind::ssm_conv: {
        const auto kernel = static_cast<int32_t>(weights[op.weight].ne[0]);
        ssm_conv(kMain, in(0), out, rows, cols, wf(op.weight), kernel,
                 b.conv_state.at(static_cast<size_t>(op.ssm.layer)), b.positions, b.seqs);
        return;
      }
      case OpKind::gated_delta:
        gated_delta(kMain, in(0), in(1), in(2), wf(op.weight), wf(op.ssm.dt_bias), rows, op.ssm,
                    b.ssm_state.at(static_cast<size_t>(op.ssm.layer)), b.positions, b.seqs, out);
        return;
    }
    throw Error(ErrorCategory::internal, fmt::format("SIM0: op '{}' has an unknown kind", op.name));
  }

 private:
  static void check_stream(int s) {
    if (s < 0 || s >= kNumStreams)
      throw Error(ErrorCategory::internal, fmt::format("SIM0: no stream {}", s));
  }
  static int queue_of(int s) { return s == kCopy ? 1 : 0; }
  void enqueue(int s, std::function<void()> f) {
    check_stream(s);
    if (capturing_) {
      if (queue_of(s) != 0)
        throw Error(ErrorCategory::internal, "SIM0: work on the copy stream while capturing");
      captured_.push_back(std::move(f));
    } else {
      push(queue_of(s), std::move(f));
    }
  }
  void push(int q, std::function<void()> f) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_[q].push_back(std::move(f));
    }
    cv_.notify_all();
  }
  // Blocks until both queues are empty and the workers idle (errors stay for synchronize()).
  void drain() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk,
             [this] { return queue_[0].empty() && queue_[1].empty() && !busy_[0] && !busy_[1]; });
  }
  // A worker: runs queue q in order; after an error it drops what is queued until the error is
  // collected.
  void work(int q) {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      cv_.wait(lk, [this, q] { return stop_ || !queue_[q].empty(); });
      if (queue_[q].empty()) return;  // stop_
      std::function<void()> f = std::move(queue_[q].front());
      queue_[q].pop_front();
      const bool failed = error_ != nullptr;
      busy_[q] = true;
      lk.unlock();
      std::exception_ptr e;
      if (!failed) {
        try {
          f();
        } catch (...) {
          e = std::current_exception();
        }
      }
      lk.lock();
      busy_[q] = false;
      if (e && !error_) {
        error_ = e;
        failed_.store(true, std::memory_order_release);
      }
      cv_.notify_all();
    }
  }

  static constexpr size_t kMarks = 4096;
  std::vector<double> marks_ = std::vector<double>(kMarks, 0.0);
  // Per mark: the sequence number of its latest record, the queue it was recorded on, and the
  // latest sequence number the workers passed (done(), cross-queue waits).
  std::vector<uint64_t> mark_seq_ = std::vector<uint64_t>(kMarks, 0);
  std::vector<int> mark_queue_ = std::vector<int>(kMarks, 0);
  std::unique_ptr<std::atomic<uint64_t>[]> reached_ =
      std::make_unique<std::atomic<uint64_t>[]>(kMarks);
  uint64_t next_mark_ = 0;
  SimDeviceOptions opt_;
  size_t capacity_, used_ = 0;
  int64_t copy_delay_us_ = 0;
  std::atomic<int64_t> moe_reads_{0}, moe_bytes_{0};  // DeviceInfo::moe_expert_reads, _bytes
  std::unordered_map<void*, size_t> sizes_;
  std::vector<void*> host_;
  bool capturing_ = false;
  std::vector<std::function<void()>> captured_;
  std::vector<std::vector<std::function<void()>>> graphs_;
  static constexpr std::chrono::seconds kFlagTimeout{120};
  std::atomic<bool> stop_flag_waits_{false};
  std::atomic<bool> failed_{false};  // error_ is set (a cross-queue wait stops waiting)
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_[2];  // main + aux, copy
  bool busy_[2] = {false, false}, stop_ = false;
  std::exception_ptr error_;
  std::thread worker_, copy_worker_;  // last: started once the members they use exist
};

}  // namespace

std::unique_ptr<Device> make_sim_device(size_t capacity_bytes, int64_t copy_delay_us) {
  return std::make_unique<SimDevice>(
      SimDeviceOptions{.capacity_bytes = capacity_bytes, .copy_delay_us = copy_delay_us});
}

std::unique_ptr<Device> make_sim_device(const SimDeviceOptions& options) {
  SimDeviceOptions o = options;
  if (o.unified && o.os_available_bytes == 0) o.os_available_bytes = o.capacity_bytes;
  return std::make_unique<SimDevice>(o);
}

#ifndef BERTH_HAVE_CUDA
bool cuda_available() { return false; }
bool set_cuda_pdl(bool) { return false; }
std::unique_ptr<Device> make_cuda_device(int) {
  throw Error(ErrorCategory::unsupported,
              "this build of berth has no CUDA backend (configure with -DBERTH_CUDA=ON and a "
              "CUDA toolkit)");
}
#endif

}  // namespace berth
