// Loading weights by reads instead of page faults (issue 24: "loading uses large sequential
// O_DIRECT reads rather than page faults"). A mapped model file is read in page by page as the
// kernels first touch it: at queue depth 1 and through the page cache, a fraction of what the
// drive gives to large reads in flight (docs/disk.md: about 0.1-0.3 GB/s against 1-2.5 GB/s here).
// DirectWeights reads the chosen tensors' byte ranges with io::DiskReader (io_uring, O_DIRECT, 32
// reads in flight; the pread pool where that is refused) into memory of its own, and gives a
// WeightTable whose chosen tensors point there; the other tensors keep pointing into the mapping.
// The page cache holds none of the read bytes (O_DIRECT), so the weights are in memory once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "berth/graph/graph.h"
#include "berth/io/disk_reader.h"

namespace berth {

struct DirectLoadOptions {
  std::string path;                      ///< the model file the tensors are mapped from
  const uint8_t* file_bytes = nullptr;   ///< the mapping's first byte (file offset 0)
  uint64_t file_size = 0;                ///< bytes of the mapping
  size_t chunk_bytes = size_t{8} << 20;  ///< bytes per read (the last of a run may be shorter)
  io::DiskReaderOptions reader;
};

class DirectWeights {
 public:
  /// Reads every tensor i of `weights` with load[i] (load.size() == weights.size()) whose data
  /// lies in the mapping [file_bytes, file_bytes + file_size) and is not empty: ranges sorted by
  /// offset, neighbours less than 1 MiB apart merged into one run, each run placed in one
  /// allocation congruent to its file offset modulo 4096 (zero-copy O_DIRECT) and read in
  /// chunk_bytes reads, all submitted at once. Tensors sharing bytes (a tied head) share the
  /// copy. Blocks until every read is done. Throws Error(io) naming the file, the tensor and
  /// the offset of a failed read, Error(out_of_memory) when the memory cannot be allocated,
  /// Error(invalid_argument) when load.size() differs from the table's.
  DirectWeights(const graph::WeightTable& weights, const std::vector<bool>& load,
                const DirectLoadOptions& options);

  /// `weights` with the loaded tensors pointing into this object's memory (valid while it lives).
  const graph::WeightTable& weights() const { return table_; }
  size_t bytes_read() const { return bytes_; }  ///< the runs' bytes (gaps included)
  size_t n_tensors() const { return n_tensors_; }
  double seconds() const { return seconds_; }  ///< wall time of the reads
  io::DiskBackend backend() const { return backend_; }

 private:
  graph::WeightTable table_;
  std::vector<io::AlignedBuffer> runs_;
  size_t bytes_ = 0, n_tensors_ = 0;
  double seconds_ = 0;
  io::DiskBackend backend_ = io::DiskBackend::io_uring;
};

}  // namespace berth
