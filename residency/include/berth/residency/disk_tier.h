// The disk tier: routed experts of a model larger than its RAM budget stay in the file and are
// read, expert by expert, into a RAM cache of expert slots (placement/plan.h: the plan's
// layer_ram_slots; docs/disk.md).
//
// Per tiered MoE layer: C slots in one 4 KiB-aligned arena; a slot holds one expert's gate, up
// and down slices (each at the place io::direct_layout gives for its file offset, so the
// io_uring backend reads it with O_DIRECT, no copy). The layer's moe_experts op (CPU) reads its
// experts through the tier (CpuExecutor::ExpertSource):
//   - will_need(): the op's routing is known: the expert scores are updated (LFU with decay,
//     half-life DiskTierOptions::half_life_tokens tokens, the residency policy's default,
//     docs/residency.md), reads start for the op's missing experts (one io::DiskReader ticket per
//     expert: its three ranges), on demand; then, at decode (one token), the next tiered layer's
//     router is applied to this layer's input and reads start for its predicted top-k experts
//     that are not in RAM ("ahead"): they land while this layer computes;
//   - acquire(group): waits for the group's reads (reading what is still missing) and pins the
//     slots; release() unpins them.
// A slot is chosen for a new expert among the slots that are not pinned, not being read and not
// holding an expert the current op needs: an empty one, else the one whose expert has the
// lowest score. A read-ahead never replaces an expert of the layer being computed (it only
// fills the next layer's slots) and never waits.
//
// Memory: nothing reads a tiered tensor through the file mapping; at construction the tier
// drops whatever of those ranges is resident (madvise MADV_DONTNEED on the mapping's whole pages,
// posix_fadvise POSIX_FADV_DONTNEED on the file range), so the process holds the arena, not the
// experts' pages. (The pread fallback reads through the page cache, which the kernel reclaims;
// it is not counted in the process's resident memory.)
//
// Errors: a read that fails (EIO, a file that shrank) is thrown by acquire() as Error(io) naming
// the file, the tensor and expert, and the offset (io::DiskReader); the slot is left empty.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "berth/backends/cpu_executor.h"
#include "berth/graph/graph.h"
#include "berth/io/disk_reader.h"

namespace berth {

/// One tiered MoE layer.
struct DiskTierLayer {
  int32_t layer = -1;  ///< model layer (for messages)
  /// The stacked expert tensors (ffn_{gate,up,down}_exps) and their data's byte offsets in the
  /// file.
  std::array<graph::WeightId, 3> weights{graph::kNoWeight, graph::kNoWeight, graph::kNoWeight};
  std::array<uint64_t, 3> file_offset{0, 0, 0};
  /// The layer's router (ffn_gate_inp, [n_embd, n_expert]) for read-ahead from the previous
  /// tiered layer; kNoWeight or not F32: no prediction for this layer.
  graph::WeightId router = graph::kNoWeight;
  int32_t n_expert_used = 0;  ///< top-k (for the prediction)
};

struct DiskTierOptions {
  std::string path;  ///< the model file (its experts are read from it)
  /// The file's mapping (its first byte and size): with `direct_load`, Session reads the other
  /// CPU-held tensors that lie in it with O_DIRECT (residency/direct_load.h) instead of
  /// faulting them in. Null: no direct load.
  const uint8_t* file_bytes = nullptr;
  uint64_t file_size = 0;
  bool direct_load = true;
  std::vector<DiskTierLayer> layers;  ///< in execution order; empty: no tier
  int32_t slots_per_layer = 0;        ///< C, 1 <= C <= n_expert
  /// Read ahead: a prefill op's later groups, and the next tiered layer's predicted experts.
  bool read_ahead = true;
  /// A decode step reads a layer's predicted experts ahead only while the measured precision of
  /// that layer's predictions (of the predicted experts not in RAM, the share the layer then
  /// used; decayed over about the last 20 predictions, starting at 1) is at least this: a wrong
  /// prediction costs a read and evicts an expert. Below it predictions are still made and
  /// scored, without reading, so a layer whose predictions improve reads ahead again.
  double min_prediction_precision = 0.5;
  double half_life_tokens = 64;  ///< eviction scores' half-life
  io::DiskReaderOptions reader;  ///< backend, queue depth (fixed_buffers: set by the tier)
};

class DiskTier {
 public:
  struct Stats {
    int64_t calls = 0;         ///< expert uses (op, expert) of tiered layers
    int64_t hits = 0;          ///< of those, already in RAM and not read ahead for this use
    int64_t reads_demand = 0;  ///< experts read because an op needed them (misses)
    int64_t reads_ahead = 0;   ///< experts read ahead on a prediction
    int64_t ahead_used = 0;    ///< read-ahead experts that an op then used (before eviction)
    /// Decode predictions of the next layer's experts: made, and of those read ahead (the rest
    /// were below min_prediction_precision); predicted experts not in RAM, and of those the ones
    /// the layer then used (the precision).
    int64_t predictions = 0, predictions_read = 0;
    int64_t predicted_missing = 0, predicted_used = 0;
    double prediction_precision() const {
      return predicted_missing > 0
                 ? static_cast<double>(predicted_used) / static_cast<double>(predicted_missing)
                 : 0.0;
    }
    /// Bytes of the experts' slices the tier asked for (as stored), counted when their reads
    /// are submitted: the bytes the experts need, whatever the reads cost.
    int64_t bytes_read = 0;
    /// Bytes the kernel returned to the tier's reads since the last reset_stats()
    /// (io::DiskReader::bytes_read, less its value at the reset): the slices plus the rest of the
    /// 4 KiB blocks at their unaligned ends, which the io_uring backend reads whole (O_DIRECT);
    /// counted as reads complete, so a read in flight at a reset counts in the window where it
    /// ends. The bytes of bandwidth(), from the reader as busy_seconds is.
    uint64_t reader_bytes = 0;
    /// Seconds during which at least one of the tier's reads was in the kernel
    /// (io::DiskReader::busy_seconds since the last reset_stats()).
    double busy_seconds = 0;
    double wait_seconds = 0;  ///< seconds ops waited for reads
    /// Reads issued before they were needed / all reads that were needed:
    /// ahead_used / (ahead_used + reads_demand); 0 without reads.
    double ahead_hit_rate() const {
      const int64_t n = ahead_used + reads_demand;
      return n > 0 ? static_cast<double>(ahead_used) / static_cast<double>(n) : 0.0;
    }
    /// The rate the reader achieved: reader_bytes / busy_seconds, bytes per second (0 without
    /// reads). Both from io::DiskReader over the same window.
    double bandwidth() const {
      return busy_seconds > 0 ? static_cast<double>(reader_bytes) / busy_seconds : 0.0;
    }
  };

  /// Opens the file with an io::DiskReader (the arena registered as its fixed buffer),
  /// allocates the arena (C slots per layer) and drops the tiered ranges' resident pages (file
  /// comment). `weights` must outlive the tier. Throws Error(invalid_argument) for C outside
  /// [1, n_expert] or a layer whose tensors are not stacked experts of one count; what the
  /// reader throws (Error(io) naming the file); Error(out_of_memory) for the arena.
  DiskTier(const graph::WeightTable& weights, DiskTierOptions options);
  ~DiskTier();
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  /// Binds each tiered layer to `cpu` (CpuExecutor::bind_expert_source on its gate weight).
  void bind(CpuExecutor& cpu);

  size_t arena_bytes() const;
  int32_t n_layers() const;
  int32_t slots_per_layer() const;
  const io::DiskReader& reader() const;
  Stats stats() const;
  void reset_stats();
  /// "disk tier: N layers x C slots (M MiB), io_uring: R reads (X MiB), P% read ahead"
  std::string summary() const;

  class Layer;

 private:
  friend class Layer;

  const graph::WeightTable& weights_;
  DiskTierOptions opt_;
  io::AlignedBuffer arena_;  // before reader_: registered with it, freed after it
  std::unique_ptr<io::DiskReader> reader_;
  std::vector<std::unique_ptr<Layer>> layers_;
  Stats stats_;
  double busy_base_ = 0;     // reader_->busy_seconds() at the last reset_stats()
  uint64_t bytes_base_ = 0;  // reader_->bytes_read() at the last reset_stats()
};

}  // namespace berth
