#include "berth/residency/residency.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "berth/backends/thread_pool.h"
#include "berth/core/error.h"
#include "berth/core/log.h"
#include "berth/cpu_kernels/ops.h"
#include "berth/io/mapped_file.h"

namespace berth {

using placement::Home;

bool copy_read_by_cpu() { return numa_node_count() <= 1; }

bool registers_host_experts(const Device& dev) {
  // Off by default: with it, the streaming case of test_hybrid hung on the H200 (see
  // docs/performance.md, 2026-12-01), where the pinned copy passes. llama.cpp too keeps
  // registering mmap'd weights opt-in (GGML_CUDA_REGISTER_HOST).
  const char* v = std::getenv("BERTH_REGISTER_HOST");
  const std::string_view on = v ? v : "";
  return (on == "1" || on == "on" || on == "true") && dev.can_register_host();
}

namespace {
size_t round_up_mib(size_t bytes) { return (bytes + (size_t{1} << 20) - 1) >> 20 << 20; }
}  // namespace

size_t expert_stage_bytes(const graph::Graph& g, const graph::WeightTable& w,
                          int32_t stream_experts_min_tokens, double host_expert_share) {
  if (stream_experts_min_tokens <= 0 && !(host_expert_share > 0)) return 0;
  size_t layer = 0, expert = 0;
  int32_t k = 0;
  for (const graph::Op& op : g.ops) {
    if (op.kind != graph::OpKind::moe_experts) continue;
    const size_t b = w[op.moe.gate].n_bytes + w[op.moe.up].n_bytes + w[op.moe.down].n_bytes;
    layer = std::max(layer, b);
    expert = std::max(expert, b / static_cast<size_t>(std::max(op.moe.n_expert, 1)));
    k = std::max(k, op.moe.n_expert_used);
  }
  size_t total = 0;
  if (stream_experts_min_tokens > 0) total += 2 * layer;
  if (host_expert_share > 0)
    total += static_cast<size_t>(std::ceil(std::min(host_expert_share, 1.0) * k)) * expert;
  return round_up_mib(total);
}

Residency::Residency(Device& dev, const graph::WeightTable& weights, std::vector<Home> weight_home,
                     ResidencyOptions options)
    : dev_(dev),
      weights_(weights),
      home_(std::move(weight_home)),
      opt_(std::move(options)),
      cpu_weights_(weights) {
  if (home_.size() != weights_.size())
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("placement names {} tensors but the model has {}", home_.size(),
                            weights_.size()));
  try {
    if (opt_.unified) {
      map_in_place();
      return;
    }
    size_t total = 0, done = 0;
    for (size_t i = 0; i < weights_.size(); ++i)
      if (home_[i] == Home::gpu) total += weights_.tensors[i].n_bytes;
    dev_weight_.assign(weights_.size(), nullptr);
    owned_.assign(weights_.size(), nullptr);
    std::vector<float> f32;
    for (size_t i = 0; i < weights_.size(); ++i) {
      if (home_[i] != Home::gpu) continue;
      const TensorView& w = weights_.tensors[i];
      if (uploads_as_f32(w)) {
        // Norm scales and biases: f32 on the device, as the kernels take them.
        f32.resize(static_cast<size_t>(w.ne[0]));
        cpu::get_row(w, 0, f32.data());
        owned_[i] = dev_.alloc(f32.size() * 4, w.name);
        dev_.upload(owned_[i], f32.data(), f32.size() * 4);
        dev_weight_bytes_ += f32.size() * 4;
      } else {
        owned_[i] = dev_.alloc(w.n_bytes, w.name);
        // In slices, so the progress callback moves on large tensors too.
        constexpr size_t kSlice = size_t{256} << 20;
        for (size_t off = 0; off < w.n_bytes; off += kSlice) {
          const size_t n = std::min(kSlice, w.n_bytes - off);
          dev_.upload(static_cast<uint8_t*>(owned_[i]) + off,
                      static_cast<const uint8_t*>(w.data) + off, n);
          if (opt_.progress && off + n < w.n_bytes) opt_.progress(done + off + n, total);
        }
        dev_weight_bytes_ += w.n_bytes;
      }
      dev_weight_[i] = owned_[i];
      done += w.n_bytes;
      if (opt_.progress) opt_.progress(done, total);
    }
    if (opt_.pin_host_experts) pin_host_experts();
  } catch (...) {
    release();
    throw;
  }
}

bool uploads_as_f32(const TensorView& w) {
  return w.ne[1] == 1 && w.ne[2] == 1 && w.ne[3] == 1 && w.type != GgmlType::F32;
}

Residency::~Residency() { release(); }

void Residency::map_in_place() {
  dev_weight_.assign(weights_.size(), nullptr);
  owned_.assign(weights_.size(), nullptr);
  // With pageable memory access the device reads the mapping itself; without it (a discrete GPU
  // such as the H200, Jetson Orin), the weights it computes go once into page-locked host memory
  // (alloc_host) and the file's pages of them are released. Page-locking the file mapping in
  // place (cudaHostRegister) is not used: on the H200 host (Linux 6.18, driver 580) registering
  // 2.8 GB of a mapped GGUF spun in the kernel for over a minute (2026-12-03), and GB10 does not
  // support it at all.
  const bool copy = !dev_.info().pageable_access;
  constexpr size_t kAlign = 256;  // the kernels' widest loads and TMA want 16..128-byte alignment
  const auto up = [](size_t n, size_t a) { return (n + a - 1) / a * a; };
  size_t host_bytes = 0;  // the f32 copies of 1-D tensors, then (copy) the other tensors
  for (size_t i = 0; i < weights_.size(); ++i) {
    if (home_[i] != Home::gpu) continue;
    const TensorView& w = weights_.tensors[i];
    if (uploads_as_f32(w))
      host_bytes += up(static_cast<size_t>(w.ne[0]) * 4, kAlign);
    else if (copy)
      host_bytes += up(w.n_bytes, kAlign);
  }
  // Page-locked when the device reads it over its bus; plain host memory otherwise.
  if (host_bytes > 0) {
    host_copy_ = copy ? dev_.alloc_host(host_bytes, "unified weights (page-locked host copy)")
                      : std::aligned_alloc(4096, up(host_bytes, 4096));
    if (!host_copy_)
      throw Error(
          ErrorCategory::out_of_memory,
          fmt::format("cannot allocate {} bytes for the unified weights' host copy", host_bytes));
    host_copy_pinned_ = copy;
  }
  auto* at = static_cast<uint8_t*>(host_copy_);
  for (size_t i = 0; i < weights_.size(); ++i) {
    if (home_[i] != Home::gpu) continue;
    const TensorView& w = weights_.tensors[i];
    if (uploads_as_f32(w)) {
      cpu::get_row(w, 0, reinterpret_cast<float*>(at));
      dev_weight_[i] = at;
      in_place_bytes_ += static_cast<size_t>(w.ne[0]) * 4;
      at += up(static_cast<size_t>(w.ne[0]) * 4, kAlign);
      continue;
    }
    in_place_bytes_ += w.n_bytes;
    if (!copy) {
      dev_weight_[i] = w.data;
      continue;
    }
    std::memcpy(at, w.data, w.n_bytes);
    dev_weight_[i] = at;
    host_copy_bytes_ += w.n_bytes;
    at += up(w.n_bytes, kAlign);
    // The mapping's whole pages of this tensor: released (clean file pages; a later CPU read
    // faults them back in from the file).
#ifdef MADV_PAGEOUT
    io::advise_whole_pages(w.data, w.n_bytes, MADV_PAGEOUT);
#else
    io::advise_whole_pages(w.data, w.n_bytes, MADV_DONTNEED);
#endif
  }
}

void Residency::pin_host_experts() {
  // The CPU-held stacked expert tensors, streamed to the device (prefill) or read by it over
  // PCIe (the decode share), need page-locked memory: a pinned copy of each, or with
  // BERTH_REGISTER_HOST=1 their own memory (the file mapping) registered in place, as runs of
  // tensors whose gaps are under 2 MiB (so no two runs share a page).
  std::vector<size_t> ids;
  for (size_t i = 0; i < weights_.size(); ++i) {
    const TensorView& w = weights_.tensors[i];
    if (home_[i] == Home::cpu && w.ne[2] > 1 && w.n_bytes > 0) ids.push_back(i);
  }
  if (ids.empty()) return;
  pinned_.assign(weights_.size(), nullptr);
  const auto at = [&](size_t i) { return reinterpret_cast<uintptr_t>(weights_.tensors[i].data); };
  // In place needs 16-byte aligned tensors (the staging kernel's wide loads; a pinned copy is
  // page-aligned), as GGUF's default general.alignment of 32 gives.
  bool in_place = registers_host_experts(dev_) &&
                  std::all_of(ids.begin(), ids.end(), [&](size_t i) { return at(i) % 16 == 0; });
  if (in_place) {
    std::vector<size_t> order = ids;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return at(a) < at(b); });
    constexpr uintptr_t kGap = uintptr_t{2} << 20;
    for (size_t r = 0; r < order.size() && in_place;) {
      const uintptr_t begin = at(order[r]);
      uintptr_t end = begin + weights_.tensors[order[r]].n_bytes;
      size_t q = r + 1;
      for (; q < order.size() && at(order[q]) <= end + kGap; ++q)
        end = std::max<uintptr_t>(end, at(order[q]) + weights_.tensors[order[q]].n_bytes);
      const void* p = reinterpret_cast<const void*>(begin);
      if (dev_.register_host(p, end - begin))
        registered_.push_back(p);
      else
        in_place = false;
      r = q;
    }
    if (!in_place) {
      for (const void* p : registered_) dev_.unregister_host(p);
      registered_.clear();
    }
  }
  if (!in_place && !opt_.copy_host_experts) {
    // The caller allows no copy: the scheduler then streams nothing and splits nothing.
    log::warn(
        "{}: the CPU-held experts are not registered in place and no pinned copy is allowed: "
        "the CPU computes all of them, at prefill and decode",
        dev_.name());
    pinned_.clear();
    return;
  }
  pinned_copies_ = !in_place;
  const bool cpu_reads_copy = copy_read_by_cpu();
  for (size_t i : ids) {
    const TensorView& w = weights_.tensors[i];
    if (in_place) {
      pinned_[i] = const_cast<void*>(w.data);  // read only: the device never writes it
    } else {
      pinned_[i] = dev_.alloc_host(w.n_bytes, w.name);
      std::memcpy(pinned_[i], w.data, w.n_bytes);
      // On one NUMA node the CPU reads the copy too, so the source pages are no longer needed
      // here. (The copy is allocated by this thread, on its node; with more nodes the workers
      // keep reading the pages they first touched.) MADV_COLD is a hint, non-destructive
      // whatever memory the tensor lives in (a file mapping or the heap).
      if (!cpu_reads_copy) continue;
      cpu_weights_.tensors[i].data = pinned_[i];
#ifdef MADV_COLD
      io::advise_whole_pages(w.data, w.n_bytes, MADV_COLD);
#endif
    }
  }
}

std::vector<SlotLayer> Residency::slot_layers(const graph::Graph& g) const {
  std::vector<SlotLayer> out;
  for (const graph::Op& op : g.ops) {
    if (op.kind != graph::OpKind::moe_experts || op.moe.n_expert < 2) continue;
    if (!pinned(op.moe.gate) || !pinned(op.moe.up) || !pinned(op.moe.down)) continue;
    out.push_back(SlotLayer{.gate = op.moe.gate,
                            .up = op.moe.up,
                            .down = op.moe.down,
                            .n_expert = op.moe.n_expert,
                            .n_expert_used = op.moe.n_expert_used});
  }
  return out;
}

void Residency::enable_expert_slots(const graph::Graph& g, ExpertSlotsOptions options) {
  slots_.reset();
  if (options.slots_per_layer <= 0) return;
  std::vector<SlotLayer> layers = slot_layers(g);
  if (!options.layers.empty())
    std::erase_if(layers, [&](const SlotLayer& l) {
      const auto m = static_cast<size_t>(weights_.layer(l.gate));
      return m >= options.layers.size() || !options.layers[m];
    });
  if (layers.empty()) return;
  std::vector<const void*> pin(weights_.size(), nullptr);
  for (size_t i = 0; i < pin.size(); ++i) pin[i] = pinned(static_cast<graph::WeightId>(i));
  slots_ =
      std::make_unique<ExpertSlots>(dev_, weights_, std::move(layers), pin, std::move(options));
}

void Residency::reserve_stage(size_t bytes) {
  if (bytes <= stage_bytes_) return;
  for (void*& p : stage_)
    if (p) dev_.dealloc(p), p = nullptr;
  stage_bytes_ = 0;
  for (void*& p : stage_) p = dev_.alloc(bytes, "streamed expert weights");
  stage_bytes_ = bytes;
}

void Residency::stream_in(int s, graph::WeightId gate, graph::WeightId up, graph::WeightId down,
                          int buf) {
  uint8_t* dst = static_cast<uint8_t*>(stage_[buf]);
  for (graph::WeightId id : {gate, up, down}) {
    const size_t n = weights_[id].n_bytes;
    dev_.copy(s, dst, pinned_.at(static_cast<size_t>(id)), n);
    dst += n;
  }
}

size_t Residency::stream_in_experts(int s, graph::WeightId gate, graph::WeightId up,
                                    graph::WeightId down, int buf, std::span<const int32_t> table) {
  const auto n = static_cast<int64_t>(table.size());
  uint8_t* dst = static_cast<uint8_t*>(stage_[buf]);
  size_t copied = 0;
  for (graph::WeightId id : {gate, up, down}) {
    const size_t total = weights_[id].n_bytes;
    const size_t per = n > 0 ? total / static_cast<size_t>(n) : 0;
    const auto* src = static_cast<const uint8_t*>(pinned_.at(static_cast<size_t>(id)));
    for (int64_t e = 0; e < n;) {
      const int32_t slot = table[static_cast<size_t>(e)];
      if (slot < 0) {
        ++e;
        continue;
      }
      int64_t run = 1;
      while (e + run < n && table[static_cast<size_t>(e + run)] == slot + run) ++run;
      dev_.copy(s, dst + static_cast<size_t>(slot) * per, src + static_cast<size_t>(e) * per,
                static_cast<size_t>(run) * per);
      copied += static_cast<size_t>(run) * per;
      e += run;
    }
    dst += total;
  }
  return copied;
}

void Residency::release() {
  slots_.reset();
  try {
    dev_.synchronize();
  } catch (...) {
  }
  for (void*& p : owned_)
    if (p) dev_.dealloc(p), p = nullptr;
  std::fill(dev_weight_.begin(), dev_weight_.end(), nullptr);
  for (size_t i = 0; i < cpu_weights_.size(); ++i)  // before the copies it may point at go
    cpu_weights_.tensors[i].data = weights_.tensors[i].data;
  if (pinned_copies_)
    for (void*& p : pinned_)
      if (p) dev_.dealloc_host(p);
  pinned_.clear();
  pinned_copies_ = false;
  for (const void* p : registered_) dev_.unregister_host(p);
  registered_.clear();
  for (void*& p : stage_)
    if (p) dev_.dealloc(p), p = nullptr;
  stage_bytes_ = 0;
  if (host_copy_pinned_)
    dev_.dealloc_host(host_copy_);
  else
    std::free(host_copy_);
  host_copy_ = nullptr;
  host_copy_pinned_ = false;
  in_place_bytes_ = host_copy_bytes_ = 0;
}

}  // namespace berth
