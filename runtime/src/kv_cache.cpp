#include "berth/runtime/kv_cache.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <new>

#include "berth/backends/thread_pool.h"
#include "berth/core/error.h"

namespace berth {

KvCache::KvCache(const std::vector<KvLayer>& layers, int64_t n_ctx, int32_t n_seq,
                 int32_t n_state_spare) {
  view_.layers = layers;
  view_.n_ctx = n_ctx;
  view_.n_seq = n_seq;
  if (n_state_spare < 0)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("spare recurrent-state rows must be >= 0, got {}", n_state_spare));
  n_spare_ = n_state_spare;
  if (n_ctx < 1)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("the context size must be at least 1, got {}", n_ctx));
  if (n_seq < 1)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("the KV cache needs at least 1 sequence, got {}", n_seq));
  used_.assign(static_cast<size_t>(n_seq), 0);
  const int64_t n_rows = view_.n_rows();
  constexpr double kMiB = 1024.0 * 1024.0;
  const size_t total = bytes();
  const size_t phys = physical_memory_bytes();
  if (phys > 0 && total > phys)
    throw Error(
        ErrorCategory::out_of_memory,
        fmt::format("the KV cache for a context of {} tokens needs {:.1f} MiB, more than "
                    "this machine's {:.1f} MiB of memory (lower -c)",
                    n_ctx, static_cast<double>(total) / kMiB, static_cast<double>(phys) / kMiB));
  try {
    for (const KvLayer& l : layers) {
      // make_unique_for_overwrite leaves the pages untouched until positions are written.
      k_.push_back(std::make_unique_for_overwrite<float[]>(static_cast<size_t>(n_rows * l.k_dim)));
      v_.push_back(std::make_unique_for_overwrite<float[]>(static_cast<size_t>(n_rows * l.v_dim)));
      view_.k.push_back(k_.back().get());
      view_.v.push_back(v_.back().get());
      // The recurrent state is small next to a long context's KV rows: allocated zeroed.
      conv_.push_back(
          l.conv_dim > 0 ? std::make_unique<float[]>(static_cast<size_t>(state_rows() * l.conv_dim))
                         : nullptr);
      ssm_.push_back(l.ssm_dim > 0
                         ? std::make_unique<float[]>(static_cast<size_t>(state_rows() * l.ssm_dim))
                         : nullptr);
      view_.conv.push_back(conv_.back().get());
      view_.ssm.push_back(ssm_.back().get());
    }
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCategory::out_of_memory,
                fmt::format("cannot allocate the KV cache: {:.1f} MiB for {} positions (lower -c)",
                            static_cast<double>(total) / kMiB, n_rows));
  }
  view_.dev_k.assign(layers.size(), nullptr);
  view_.dev_v.assign(layers.size(), nullptr);
  view_.dev_conv.assign(layers.size(), nullptr);
  view_.dev_ssm.assign(layers.size(), nullptr);
}

KvCache::~KvCache() { release_device(false); }

void KvCache::allocate_device(Device& dev, const std::vector<placement::Home>& kv_home) {
  if (kv_home.size() != view_.layers.size())
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("placement names the KV cache of {} layers but the model has {}",
                            kv_home.size(), view_.layers.size()));
  release_device(true);
  dev_ = &dev;
  try {
    for (size_t l = 0; l < kv_home.size(); ++l) {
      if (kv_home[l] != placement::Home::gpu) continue;
      const KvLayer& kl = view_.layers[l];
      if (kl.recurrent()) {
        // The layer's recurrent state moves to the device whole (its ssm_conv and gated_delta
        // run there): f32 as on the host, zeroed.
        const size_t cb = static_cast<size_t>(state_rows() * kl.conv_dim) * 4;
        const size_t sb = static_cast<size_t>(state_rows() * kl.ssm_dim) * 4;
        if (cb > 0)
          view_.dev_conv[l] =
              static_cast<float*>(dev.alloc(cb, fmt::format("the conv state of layer {}", l)));
        if (sb > 0)
          view_.dev_ssm[l] = static_cast<float*>(
              dev.alloc(sb, fmt::format("the delta-rule state of layer {}", l)));
        device_bytes_ += cb + sb;
        // The state lives on the device only: the host's copy goes.
        conv_[l].reset();
        ssm_[l].reset();
        view_.conv[l] = view_.ssm[l] = nullptr;
      }
      const size_t kb = static_cast<size_t>(view_.n_rows() * kl.k_dim) * 2;
      const size_t vb = static_cast<size_t>(view_.n_rows() * kl.v_dim) * 2;
      if (kb + vb == 0) continue;
      view_.dev_k[l] =
          static_cast<uint16_t*>(dev.alloc(kb, fmt::format("the K cache of layer {}", l)));
      view_.dev_v[l] =
          static_cast<uint16_t*>(dev.alloc(vb, fmt::format("the V cache of layer {}", l)));
      device_bytes_ += kb + vb;
    }
    for (int32_t s = 0; s < view_.n_seq; ++s) zero_device_state(s);
  } catch (...) {
    release_device(true);
    throw;
  }
}

void KvCache::zero_device_state(int32_t seq) {
  for (int32_t l = 0; l < n_layer(); ++l) {
    const KvLayer& kl = view_.layer(l);
    const auto li = static_cast<size_t>(l);
    if (view_.dev_conv[li] || view_.dev_ssm[li])
      zeros_.resize(
          std::max(zeros_.size(), static_cast<size_t>(std::max(kl.conv_dim, kl.ssm_dim))));
    if (view_.dev_conv[li])
      dev_->upload(view_.dev_conv[li] + seq * kl.conv_dim, zeros_.data(),
                   static_cast<size_t>(kl.conv_dim) * sizeof(float));
    if (view_.dev_ssm[li])
      dev_->upload(view_.dev_ssm[li] + seq * kl.ssm_dim, zeros_.data(),
                   static_cast<size_t>(kl.ssm_dim) * sizeof(float));
  }
}

void KvCache::release_device(bool keep_host_state) {
  if (!dev_) return;
  // The layers whose state was on the device get a zeroed host state back (the cache stays
  // usable on the CPU), unless the cache itself goes.
  for (size_t l = 0; keep_host_state && l < view_.layers.size(); ++l) {
    const KvLayer& kl = view_.layers[l];
    if (!view_.dev_conv[l] && !view_.dev_ssm[l]) continue;
    conv_[l] = kl.conv_dim > 0
                   ? std::make_unique<float[]>(static_cast<size_t>(state_rows() * kl.conv_dim))
                   : nullptr;
    ssm_[l] = kl.ssm_dim > 0
                  ? std::make_unique<float[]>(static_cast<size_t>(state_rows() * kl.ssm_dim))
                  : nullptr;
    view_.conv[l] = conv_[l].get();
    view_.ssm[l] = ssm_[l].get();
  }
  for (uint16_t*& p : view_.dev_k)
    if (p) dev_->dealloc(p), p = nullptr;
  for (uint16_t*& p : view_.dev_v)
    if (p) dev_->dealloc(p), p = nullptr;
  for (float*& p : view_.dev_conv)
    if (p) dev_->dealloc(p), p = nullptr;
  for (float*& p : view_.dev_ssm)
    if (p) dev_->dealloc(p), p = nullptr;
  device_bytes_ = 0;
  dev_ = nullptr;
}

size_t KvCache::bytes() const {
  size_t total = 0;
  for (size_t i = 0; i < view_.layers.size(); ++i) {
    const KvLayer& l = view_.layers[i];
    // Before the constructor has allocated (its memory check) every state is counted; after
    // allocate_device, the device-held ones are not.
    const bool host_state = i >= view_.dev_conv.size() || (!view_.dev_conv[i] && !view_.dev_ssm[i]);
    total += (static_cast<size_t>(view_.n_rows()) * static_cast<size_t>(l.k_dim + l.v_dim) +
              (host_state
                   ? static_cast<size_t>(state_rows()) * static_cast<size_t>(l.conv_dim + l.ssm_dim)
                   : 0)) *
             sizeof(float);
  }
  return total;
}

void KvCache::check_seq(int32_t seq, const char* what) const {
  if (seq < 0 || seq >= view_.n_seq)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("{}: sequence {} is outside the KV cache's {} sequences", what, seq,
                            view_.n_seq));
}

int32_t KvCache::acquire() {
  for (size_t s = 0; s < used_.size(); ++s)
    if (!used_[s]) {
      used_[s] = 1;
      reset_state(static_cast<int32_t>(s));
      return static_cast<int32_t>(s);
    }
  throw Error(ErrorCategory::out_of_memory,
              fmt::format("the KV cache holds {} sequences and all are in use", view_.n_seq));
}

void KvCache::release(int32_t seq) {
  check_seq(seq, "release");
  if (!used_[static_cast<size_t>(seq)])
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("release: sequence {} is not in use", seq));
  used_[static_cast<size_t>(seq)] = 0;
}

int32_t KvCache::n_free() const {
  return static_cast<int32_t>(std::count(used_.begin(), used_.end(), uint8_t{0}));
}

void KvCache::copy(int32_t src, int32_t dst, int64_t n) {
  check_seq(src, "copy");
  check_seq(dst, "copy");
  if (src == dst || n < 0 || n > view_.n_ctx)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("copy of {} positions from sequence {} to {}: need two different "
                            "sequences and 0 <= n <= {}",
                            n, src, dst, view_.n_ctx));
  if (n == 0) return;
  copy_state_row(src, dst);
  for (size_t l = 0; l < view_.layers.size(); ++l) {
    const KvLayer& kl = view_.layers[l];
    const size_t ks = static_cast<size_t>(n * kl.k_dim), vs = static_cast<size_t>(n * kl.v_dim);
    const int64_t s0 = view_.row(src, 0), d0 = view_.row(dst, 0);
    std::memcpy(view_.k[l] + d0 * kl.k_dim, view_.k[l] + s0 * kl.k_dim, ks * sizeof(float));
    std::memcpy(view_.v[l] + d0 * kl.v_dim, view_.v[l] + s0 * kl.v_dim, vs * sizeof(float));
    if (view_.dev_k[l]) {
      dev_->copy(kSync, view_.dev_k[l] + d0 * kl.k_dim, view_.dev_k[l] + s0 * kl.k_dim, ks * 2);
      dev_->copy(kSync, view_.dev_v[l] + d0 * kl.v_dim, view_.dev_v[l] + s0 * kl.v_dim, vs * 2);
    }
  }
}

bool KvCache::recurrent() const {
  return std::any_of(view_.layers.begin(), view_.layers.end(),
                     [](const KvLayer& l) { return l.recurrent(); });
}

void KvCache::reset_state(int32_t seq) {
  check_seq(seq, "reset_state");
  for (int32_t l = 0; l < n_layer(); ++l) {
    const KvLayer& kl = view_.layer(l);
    const auto li = static_cast<size_t>(l);
    if (view_.conv[li]) std::fill_n(view_.conv_state(l, seq), kl.conv_dim, 0.0f);
    if (view_.ssm[li]) std::fill_n(view_.ssm_state(l, seq), kl.ssm_dim, 0.0f);
  }
  if (dev_) zero_device_state(seq);
}

std::vector<float> KvCache::save_state(int32_t seq) const {
  check_seq(seq, "save_state");
  return state_of_row(seq);
}

std::vector<float> KvCache::state_of_row(int64_t row) const {
  std::vector<float> out;
  for (int32_t l = 0; l < n_layer(); ++l) {
    const KvLayer& kl = view_.layer(l);
    const auto li = static_cast<size_t>(l);
    const auto take = [&](const float* dev, const float* host, int64_t n) {
      const size_t at = out.size();
      out.resize(at + static_cast<size_t>(n));
      if (dev)
        dev_->download(out.data() + at, dev, static_cast<size_t>(n) * sizeof(float));
      else
        std::copy_n(host, n, out.data() + at);
    };
    // The state is on one side: the device's when it has one (the host's is gone then).
    if (kl.conv_dim > 0)
      take(view_.dev_conv[li] ? view_.dev_conv[li] + row * kl.conv_dim : nullptr,
           view_.dev_conv[li] ? nullptr : view_.conv[li] + row * kl.conv_dim, kl.conv_dim);
    if (kl.ssm_dim > 0)
      take(view_.dev_ssm[li] ? view_.dev_ssm[li] + row * kl.ssm_dim : nullptr,
           view_.dev_ssm[li] ? nullptr : view_.ssm[li] + row * kl.ssm_dim, kl.ssm_dim);
  }
  return out;
}

void KvCache::check_spare(int32_t r, const char* what) const {
  if (r < 0 || r >= n_spare_)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("{}: spare state row {} is outside the cache's {}", what, r, n_spare_));
}

void KvCache::copy_state_row(int64_t from, int64_t to) {
  for (size_t l = 0; l < view_.layers.size(); ++l) {
    const KvLayer& kl = view_.layers[l];
    const size_t cb = static_cast<size_t>(kl.conv_dim) * sizeof(float);
    const size_t sb = static_cast<size_t>(kl.ssm_dim) * sizeof(float);
    if (view_.dev_conv[l])
      dev_->copy(kSync, view_.dev_conv[l] + to * kl.conv_dim,
                 view_.dev_conv[l] + from * kl.conv_dim, cb);
    else if (view_.conv[l])
      std::memcpy(view_.conv[l] + to * kl.conv_dim, view_.conv[l] + from * kl.conv_dim, cb);
    if (view_.dev_ssm[l])
      dev_->copy(kSync, view_.dev_ssm[l] + to * kl.ssm_dim, view_.dev_ssm[l] + from * kl.ssm_dim,
                 sb);
    else if (view_.ssm[l])
      std::memcpy(view_.ssm[l] + to * kl.ssm_dim, view_.ssm[l] + from * kl.ssm_dim, sb);
  }
}

void KvCache::save_state_spare(int32_t seq, int32_t r) {
  check_seq(seq, "save_state_spare");
  check_spare(r, "save_state_spare");
  copy_state_row(seq, int64_t{view_.n_seq} + r);
}

void KvCache::restore_state_spare(int32_t seq, int32_t r) {
  check_seq(seq, "restore_state_spare");
  check_spare(r, "restore_state_spare");
  copy_state_row(int64_t{view_.n_seq} + r, seq);
}

std::vector<float> KvCache::spare_state(int32_t r) const {
  check_spare(r, "spare_state");
  return state_of_row(int64_t{view_.n_seq} + r);
}

void KvCache::restore_state(int32_t seq, std::span<const float> state) {
  check_seq(seq, "restore_state");
  size_t total = 0;
  for (const KvLayer& kl : view_.layers) total += static_cast<size_t>(kl.conv_dim + kl.ssm_dim);
  if (state.size() != total)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("restore_state: {} floats given, the recurrent state of a sequence "
                            "has {}",
                            state.size(), total));
  const float* p = state.data();
  for (int32_t l = 0; l < n_layer(); ++l) {
    const KvLayer& kl = view_.layer(l);
    const auto li = static_cast<size_t>(l);
    if (kl.conv_dim > 0) {
      if (view_.dev_conv[li])
        dev_->upload(view_.dev_conv[li] + seq * kl.conv_dim, p,
                     static_cast<size_t>(kl.conv_dim) * sizeof(float));
      else
        std::copy_n(p, kl.conv_dim, view_.conv_state(l, seq));
      p += kl.conv_dim;
    }
    if (kl.ssm_dim > 0) {
      if (view_.dev_ssm[li])
        dev_->upload(view_.dev_ssm[li] + seq * kl.ssm_dim, p,
                     static_cast<size_t>(kl.ssm_dim) * sizeof(float));
      else
        std::copy_n(p, kl.ssm_dim, view_.ssm_state(l, seq));
      p += kl.ssm_dim;
    }
  }
}

}  // namespace berth
