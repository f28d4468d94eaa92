// The KV cache: per layer, the keys and values of every position processed so far, held on the
// host (f32, for layers whose attention runs on the CPU) and on the device (f16, for layers
// whose attention runs there).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "berth/backends/device.h"
#include "berth/backends/kv_view.h"
#include "berth/graph/cache.h"
#include "berth/placement/plan.h"

namespace berth {

/// A pool of `n_seq` sequences of up to `n_ctx` positions each (the per-sequence context, as
/// llama-server's -c / -np): sequence s's position p is row s * n_ctx + p (KvView::row).
/// Host rows in f32: layer l holds K as [n_seq * n_ctx, k_dim] and V as [n_seq * n_ctx, v_dim],
/// row-major (one row per position, dims contiguous), reserved once for every layer, n_seq *
/// n_ctx * sum(k_dim + v_dim) * 4 bytes, without touching the memory: pages are filled as
/// positions are written, so a large -c costs only what is used. Device rows in f16, the same
/// shapes, for the layers allocate_device() is given. Sequences are taken from the pool with
/// acquire() and given back with release(); a single-sequence user (Session::eval) uses
/// sequence 0 without acquiring it. Throws Error(out_of_memory) naming the MiB when the host
/// rows would not fit in the machine's physical memory or the allocation fails,
/// Error(invalid_argument) for n_ctx < 1 or n_seq < 1.
///
/// Recurrent layers (KvLayer::recurrent(): Gated DeltaNet) hold, per sequence, their conv and
/// delta-rule state, n_seq * (conv_dim + ssm_dim) * 4 bytes per layer, on the host (counted by
/// bytes()) or, for the layers allocate_device() is given, on the device (device_bytes()), zeroed
/// when a sequence is acquired and by reset_state(); the executors also start a sequence from zero
/// at its position 0. Such a state summarises every position processed and cannot be cut back:
/// save_state() / restore_state() keep and bring back a whole sequence in host memory;
/// `n_state_spare` spare rows beside the sequences' (n_seq + n_state_spare rows per recurrent
/// layer, on the state's side, counted by bytes() / device_bytes()) keep copies where the state
/// lives: save_state_spare() / restore_state_spare() (device-to-device copies when the state is
/// on the device). Throws Error(invalid_argument) for n_state_spare < 0.
class KvCache {
 public:
  KvCache(const std::vector<KvLayer>& layers, int64_t n_ctx, int32_t n_seq = 1,
          int32_t n_state_spare = 0);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  /// Allocates on `dev` the f16 rows of each layer l with kv_home[l] == GPU (one entry per
  /// layer), and the recurrent state (f32, zeroed) of such layers that keep one: from then on
  /// their state lives on the device only (reset_state, copy, save_state and restore_state go
  /// there). `dev` must outlive the cache. Throws Error(invalid_argument) when kv_home does not
  /// have n_layer() entries, and the device's Error(out_of_memory) (naming the layer).
  void allocate_device(Device& dev, const std::vector<placement::Home>& kv_home);

  /// The rows of every layer, for the executors; valid as long as the cache.
  const KvView& view() const { return view_; }
  int64_t n_ctx() const { return view_.n_ctx; }
  int32_t n_seq() const { return view_.n_seq; }

  /// Takes a free sequence from the pool and returns its id (the lowest free one). Throws
  /// Error(out_of_memory) "the KV cache holds N sequences and all are in use" when none is free.
  int32_t acquire();
  /// Gives sequence `seq` back to the pool (its rows are overwritten by the next owner). Throws
  /// Error(invalid_argument) for an id outside [0, n_seq) or one not acquired.
  void release(int32_t seq);
  /// Sequences not acquired.
  int32_t n_free() const;
  bool in_use(int32_t seq) const { return used_.at(static_cast<size_t>(seq)) != 0; }
  /// Copies positions [0, n) of sequence `src` to sequence `dst` in every layer, host and device
  /// rows (forking a shared prefix), and, when n > 0, src's whole recurrent state (which stands
  /// for every position src has processed: the fork is exact only when n is src's length).
  /// Throws Error(invalid_argument) for ids outside [0, n_seq), src == dst, or n outside
  /// [0, n_ctx].
  void copy(int32_t src, int32_t dst, int64_t n);
  /// Whether any layer keeps a recurrent state.
  bool recurrent() const;
  /// Zeroes sequence `seq`'s recurrent state (every recurrent layer). Throws
  /// Error(invalid_argument) for an id outside [0, n_seq).
  void reset_state(int32_t seq);
  /// Sequence `seq`'s recurrent state, every recurrent layer's conv state then delta-rule state
  /// in layer order (sum over those layers of conv_dim + ssm_dim floats; empty without them).
  std::vector<float> save_state(int32_t seq) const;
  /// Writes back a save_state() of this cache into sequence `seq` (any sequence), bit for bit.
  /// Throws Error(invalid_argument) for an id outside [0, n_seq) or a size that differs.
  void restore_state(int32_t seq, std::span<const float> state);
  /// Spare state rows (the constructor's n_state_spare).
  int32_t n_state_spare() const { return n_spare_; }
  /// Copies sequence `seq`'s recurrent state into spare row `r`, on the side each layer's state
  /// lives (device to device where it is on the device), bit for bit.
  /// restore_state_spare copies spare row `r` into sequence `seq` (any sequence).
  /// spare_state(r) is spare row r's state as save_state() lays out a sequence's (host copy).
  /// Throw Error(invalid_argument) for seq outside [0, n_seq) or r outside [0, n_state_spare).
  void save_state_spare(int32_t seq, int32_t r);
  void restore_state_spare(int32_t seq, int32_t r);
  std::vector<float> spare_state(int32_t r) const;
  int32_t n_layer() const { return view_.n_layer(); }
  const KvLayer& layer(int32_t l) const { return view_.layer(l); }
  float* k(int32_t l) { return view_.k.at(static_cast<size_t>(l)); }
  float* v(int32_t l) { return view_.v.at(static_cast<size_t>(l)); }
  /// Host bytes held (reserved): K/V rows, and the recurrent state of the layers whose state is
  /// not on the device.
  size_t bytes() const;
  /// Device bytes held.
  size_t device_bytes() const { return device_bytes_; }

 private:
  // Frees the device's rows and state; with keep_host_state, the layers whose state was there
  // get a zeroed host state back.
  void release_device(bool keep_host_state);
  // Zeroes sequence seq's device-held recurrent state (layers with dev_conv / dev_ssm).
  void zero_device_state(int32_t seq);
  void check_seq(int32_t seq, const char* what) const;
  void check_spare(int32_t r, const char* what) const;
  // Copies the recurrent state of state row `from` to row `to` (rows: sequences 0..n_seq-1, then
  // the spare rows), every recurrent layer, on its side.
  void copy_state_row(int64_t from, int64_t to);
  // State row `row` in save_state()'s layout.
  std::vector<float> state_of_row(int64_t row) const;
  // Rows of each recurrent layer's state arrays: n_seq + n_spare_.
  int64_t state_rows() const { return int64_t{view_.n_seq} + n_spare_; }
  KvView view_;
  int32_t n_spare_ = 0;
  std::vector<std::unique_ptr<float[]>> k_, v_, conv_, ssm_;
  std::vector<uint8_t> used_;  // per sequence: acquired
  Device* dev_ = nullptr;
  size_t device_bytes_ = 0;
  std::vector<float> zeros_;  // the zeros zero_device_state uploads
};

}  // namespace berth
