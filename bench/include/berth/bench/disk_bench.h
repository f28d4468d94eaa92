// `berth bench disk`: random-read bandwidth of the drive holding a model file, for reads the
// size of experts (qwen3-30b-a3b Q4_K: gate + up + down of one expert are 3 MiB), through the
// three ways berth can read weights:
//   io_uring O_DIRECT: io::DiskReader's io_uring backend at the given queue depth, and at queue
//     depth 1 for reference; destinations registered as fixed buffers. O_DIRECT bypasses the
//     page cache, so these runs never see cached data.
//   pread pool: io::DiskReader's pread backend with as many threads as the queue depth
//     (buffered reads: the kernel's read-ahead applies).
//   mmap: one thread touching one byte per 4 KiB page of each range of a read-only mapping (the
//     page faults are the reads; fault-around and read-ahead apply), as a compute thread
//     reading mapped weights does.
// Each run reads whole blocks at random block-aligned offsets (a seeded permutation of the
// file's blocks, so no block is read twice in a run) for `seconds` or until every block was
// read, keeping 2 x depth reads submitted (the reader keeps `depth` of them in the kernel).
// Before each run the file's pages are dropped from the page cache (fdatasync, then
// posix_fadvise(POSIX_FADV_DONTNEED)); the fraction still resident (mincore) is reported, and
// the bytes the device read during the run (sysfs), to show read-ahead beyond what was asked.
// GB/s = bytes of completed reads / 1e9 / seconds from the first submission to the last
// completion.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "berth/bench/kernel_bench.h"

namespace berth::bench {

struct DiskBenchOptions {
  std::string path;           ///< the file to read (a GGUF model, or any large regular file)
  unsigned queue_depth = 32;  ///< io_uring queue depth and pread threads (1..1024)
  /// Read sizes, bytes, multiples of 4096; empty: 3 MiB and 1 MiB.
  std::vector<size_t> block_bytes;
  double seconds = 10;  ///< per run, > 0
  /// Runs per method (1..1000), interleaved: every method once, then again (a shared or
  /// throttled drive drifts; each method sees the same drift). Repetition k uses seed + k.
  int repetitions = 1;
  uint64_t seed = 1;  ///< of the block permutation
  /// Called with one line of text after each run (progress).
  std::function<void(std::string_view)> progress;
};

/// The block device under the file (sysfs), as far as it is known.
struct DiskInfo {
  std::string device;          ///< e.g. "vda"; empty when unknown
  int64_t read_ahead_kb = -1;  ///< queue/read_ahead_kb
  int rotational = -1;         ///< queue/rotational
  int64_t logical_block_size = -1;
  std::string stat_path;  ///< /sys/dev/block/MAJ:MIN/stat of the file's device or partition
};

struct DiskBenchRun {
  std::string method;  ///< "io_uring O_DIRECT", "pread pool" or "mmap"
  unsigned depth = 0;  ///< reads in the kernel at once (queue depth; threads)
  size_t block_bytes = 0;
  uint64_t reads = 0;
  uint64_t bytes = 0;
  double seconds = 0;
  double gbps = 0;             ///< 1e9 bytes per second
  double cached_fraction = 0;  ///< of the file's pages resident when the run started
  /// Bytes the device read during the run (its sysfs counter: every reader of the device
  /// counts, not only this run; read-ahead shows as device_bytes > bytes); -1: unknown.
  int64_t device_bytes = -1;
  int repetition = 0;  ///< 0-based
};

/// The runs of one method, depth and block size over the repetitions.
struct DiskBenchSummary {
  std::string method;
  unsigned depth = 0;
  size_t block_bytes = 0;
  double gbps_median = 0, gbps_min = 0, gbps_max = 0;
};

struct DiskBenchResult {
  MachineInfo machine;
  DiskInfo disk;
  DiskBenchOptions options;  ///< with the defaults filled in (progress cleared)
  uint64_t file_bytes = 0;
  /// The io_uring reader's settings line, or why io_uring is unavailable (its runs then absent).
  std::string io_uring;
  std::vector<DiskBenchRun> runs;  ///< in the order run
  std::vector<DiskBenchSummary> summary;
};

/// Runs every measurement (module comment). Memory: 2 x queue_depth blocks of the largest
/// size. Throws Error(invalid_argument) for a block size that is zero or not a multiple of
/// 4096, a queue depth outside 1..1024, repetitions outside 1..1000, seconds <= 0, or a file
/// smaller than one block;
/// Error(io) when the file cannot be opened, mapped or read.
DiskBenchResult run_disk_bench(const DiskBenchOptions& options);

/// Every number of `r`, with the machine, the disk, the date and the options.
nlohmann::json to_json(const DiskBenchResult& r);

/// An aligned text table of `r` for a terminal.
std::string format_text(const DiskBenchResult& r);

}  // namespace berth::bench
