// `berth bench disk` (see disk_bench.h for what is measured and how).
//
// JSON schema (to_json):
//   { "benchmark": "berth bench disk", "date": ISO 8601 UTC,
//     "machine": {hostname, cpu_model, ...: kernel_bench.h MachineInfo},
//     "disk": {device, read_ahead_kb, rotational, logical_block_size} (-1: unknown),
//     "file": {path, bytes},
//     "config": {queue_depth, block_bytes[], seconds, repetitions, seed},
//     "io_uring": the reader's settings line or why it is unavailable,
//     "runs": [{method, depth, block_bytes, reads, bytes, seconds, gbps, cached_fraction,
//               device_bytes (-1: unknown), repetition}],
//     "summary": [{method, depth, block_bytes, gbps_median, gbps_min, gbps_max}] }
#include "berth/bench/disk_bench.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "berth/core/error.h"
#include "berth/io/disk_reader.h"

namespace berth::bench {
namespace {

constexpr size_t kPage = 4096;

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

[[noreturn]] void fail_io(const std::string& path, std::string_view what) {
  throw Error(ErrorCategory::io,
              fmt::format("{}: cannot {}: {}", path, what, std::strerror(errno)));
}

// A read-only descriptor of the bench file, closed on every exit path.
struct File {
  int fd = -1;
  explicit File(const std::string& path) {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail_io(path, "open");
  }
  ~File() { ::close(fd); }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
};

// A read-only mapping of the whole file.
struct Mapping {
  uint8_t* p = nullptr;
  size_t n = 0;
  Mapping(int fd, size_t bytes, const std::string& path) : n(bytes) {
    void* m = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) fail_io(path, "mmap");
    p = static_cast<uint8_t*>(m);
  }
  ~Mapping() { ::munmap(p, n); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
};

// Drops the file's pages from the page cache and returns the fraction still resident.
double drop_cache(int fd, size_t bytes, const std::string& path) {
  (void)::fdatasync(fd);  // dirty pages are not dropped
  if (int e = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED); e != 0) {
    errno = e;
    fail_io(path, "posix_fadvise(POSIX_FADV_DONTNEED)");
  }
  Mapping m(fd, bytes, path);
  std::vector<unsigned char> resident((bytes + kPage - 1) / kPage);
  if (::mincore(m.p, bytes, resident.data()) != 0) fail_io(path, "mincore");
  size_t n = 0;
  for (unsigned char r : resident) n += r & 1;
  return static_cast<double>(n) / static_cast<double>(resident.size());
}

std::string sysfs_line(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::string s;
  std::getline(in, s);
  return s;
}

int64_t sysfs_int(const std::filesystem::path& p) {
  const std::string s = sysfs_line(p);
  if (s.empty()) return -1;
  try {
    return std::stoll(s);
  } catch (const std::exception&) {
    return -1;
  }
}

// The block device holding the file: /sys/dev/block/MAJ:MIN (a partition's queue is its
// parent's).
DiskInfo disk_info(int fd) {
  DiskInfo d;
  struct stat st;
  if (::fstat(fd, &st) != 0) return d;
  namespace fs = std::filesystem;
  fs::path dev = fmt::format("/sys/dev/block/{}:{}", major(st.st_dev), minor(st.st_dev));
  std::error_code ec;
  if (!fs::exists(dev, ec)) return d;
  // The counters of the file's own device or partition; the queue of the whole disk.
  d.stat_path = (dev / "stat").string();
  if (!fs::exists(dev / "queue", ec)) dev = dev / "..";
  const std::string uevent_dev = [&] {
    std::ifstream in(dev / "uevent");
    for (std::string line; std::getline(in, line);)
      if (line.rfind("DEVNAME=", 0) == 0) return line.substr(8);
    return std::string();
  }();
  d.device = uevent_dev;
  d.read_ahead_kb = sysfs_int(dev / "queue" / "read_ahead_kb");
  d.rotational = static_cast<int>(sysfs_int(dev / "queue" / "rotational"));
  d.logical_block_size = sysfs_int(dev / "queue" / "logical_block_size");
  return d;
}

// Bytes the device has read since boot: /sys/dev/block/MAJ:MIN/stat, field 3 (512-byte sectors,
// Documentation/block/stat.rst); -1 when unknown.
int64_t device_read_bytes(const std::string& stat_path) {
  std::ifstream in(stat_path);
  int64_t ios = 0, merges = 0, sectors = 0;
  if (stat_path.empty() || !(in >> ios >> merges >> sectors)) return -1;
  return sectors * 512;
}

// Fills the run's time, bytes and rates; t0 and dev0: the clock and the device counter at start.
void finish_run(DiskBenchRun& run, double t0, int64_t dev0, const std::string& stat_path) {
  run.seconds = now_seconds() - t0;
  run.bytes = run.reads * run.block_bytes;
  run.gbps = static_cast<double>(run.bytes) / 1e9 / run.seconds;
  const int64_t dev1 = device_read_bytes(stat_path);
  run.device_bytes = dev0 >= 0 && dev1 >= dev0 ? dev1 - dev0 : -1;
}

std::string size_text(size_t bytes) {
  if (bytes % (size_t{1} << 20) == 0) return fmt::format("{} MiB", bytes >> 20);
  return fmt::format("{} KiB", bytes >> 10);
}

// Random block-aligned reads through a DiskReader, 2 x depth submitted, for `seconds`.
DiskBenchRun reader_run(const DiskBenchOptions& o, const std::vector<uint64_t>& order, size_t block,
                        io::DiskReaderOptions::Backend backend, unsigned depth, int fd,
                        uint64_t file_bytes, const std::string& stat_path, std::string* settings) {
  const size_t n_buf = 2 * static_cast<size_t>(depth);
  io::AlignedBuffer arena(n_buf * block);
  std::memset(arena.data(), 0, arena.size());  // faulted in before timing
  io::DiskReaderOptions ro;
  ro.backend = backend;
  ro.queue_depth = depth;
  ro.pread_threads = depth;
  // The reader's default largest read, whatever BERTH_DISK_MAX_READ says: blocks up to 8 MiB are
  // read whole, as before the variable existed.
  ro.max_read_bytes = size_t{8} << 20;
  ro.fixed_buffers = {{arena.data(), arena.size()}};
  io::DiskReader reader(o.path, ro);
  if (settings != nullptr) *settings = reader.backend_reason();

  DiskBenchRun run;
  run.method =
      backend == io::DiskReaderOptions::Backend::io_uring ? "io_uring O_DIRECT" : "pread pool";
  run.depth = depth;
  run.block_bytes = block;
  run.cached_fraction = drop_cache(fd, file_bytes, o.path);
  std::deque<std::pair<io::Ticket, size_t>> out;  // ticket, buffer
  size_t next = 0;
  auto submit = [&](size_t b) {
    const uint64_t offset = order[next++] * block;
    out.emplace_back(reader.submit(io::ReadRequest{offset, block, arena.data() + b * block}), b);
  };
  const int64_t dev0 = device_read_bytes(stat_path);
  const double t0 = now_seconds();
  for (size_t b = 0; b < n_buf && next < order.size(); ++b) submit(b);
  while (!out.empty()) {
    const auto [ticket, b] = out.front();
    out.pop_front();
    reader.wait(ticket);
    ++run.reads;
    if (now_seconds() - t0 < o.seconds && next < order.size()) submit(b);
  }
  finish_run(run, t0, dev0, stat_path);
  return run;
}

// Random block-aligned ranges of a mapping, one byte per page touched, for `seconds`.
DiskBenchRun mmap_run(const DiskBenchOptions& o, const std::vector<uint64_t>& order, size_t block,
                      int fd, uint64_t file_bytes, const std::string& stat_path) {
  DiskBenchRun run;
  run.method = "mmap";
  run.depth = 1;
  run.block_bytes = block;
  run.cached_fraction = drop_cache(fd, file_bytes, o.path);
  Mapping m(fd, file_bytes, o.path);
  volatile uint8_t sink = 0;
  const int64_t dev0 = device_read_bytes(stat_path);
  const double t0 = now_seconds();
  for (size_t i = 0; i < order.size() && now_seconds() - t0 < o.seconds; ++i) {
    const uint8_t* p = m.p + order[i] * block;
    uint8_t s = 0;
    for (size_t at = 0; at < block; at += kPage) s ^= p[at];
    sink = sink ^ s;
    ++run.reads;
  }
  finish_run(run, t0, dev0, stat_path);
  return run;
}

}  // namespace

DiskBenchResult run_disk_bench(const DiskBenchOptions& options) {
  DiskBenchResult r;
  r.options = options;
  r.options.progress = nullptr;
  DiskBenchOptions& o = r.options;
  if (o.block_bytes.empty()) o.block_bytes = {size_t{3} << 20, size_t{1} << 20};
  for (size_t b : o.block_bytes)
    if (b == 0 || b % kPage != 0)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("block size {} bytes is not a positive multiple of 4096", b));
  if (o.queue_depth < 1 || o.queue_depth > 1024)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("queue depth {} is outside 1..1024", o.queue_depth));
  if (o.repetitions < 1 || o.repetitions > 1000)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("repetitions {} is outside 1..1000", o.repetitions));
  if (!(o.seconds > 0))
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("seconds {} is not positive", o.seconds));

  File file(o.path);
  struct stat st;
  if (::fstat(file.fd, &st) != 0) fail_io(o.path, "stat");
  if (!S_ISREG(st.st_mode))
    throw Error(ErrorCategory::io, fmt::format("{}: cannot read: not a regular file", o.path));
  r.file_bytes = static_cast<uint64_t>(st.st_size);
  for (size_t b : o.block_bytes)
    if (r.file_bytes < b)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("{}: the file ({} bytes) is smaller than one {}-byte block", o.path,
                              r.file_bytes, b));
  r.machine = machine_info();
  r.disk = disk_info(file.fd);

  using Backend = io::DiskReaderOptions::Backend;
  bool uring = true;
  for (size_t block : o.block_bytes) {
    for (int rep = 0; rep < o.repetitions; ++rep) {
      // A permutation per repetition: a host that caches the virtual disk sees other blocks.
      std::vector<uint64_t> order(r.file_bytes / block);
      std::iota(order.begin(), order.end(), uint64_t{0});
      std::shuffle(order.begin(), order.end(), std::mt19937_64(o.seed + rep));
      auto add = [&](DiskBenchRun run) {
        run.repetition = rep;
        r.runs.push_back(run);
        if (options.progress)
          options.progress(fmt::format(
              "{:<18} depth {:>4}  {:>8}: {:7.3f} GB/s ({} reads in {:.1f} s; {:.1f}% cached "
              "before)",
              run.method, run.depth, size_text(run.block_bytes), run.gbps, run.reads, run.seconds,
              100 * run.cached_fraction));
      };
      if (uring) {
        try {
          add(reader_run(o, order, block, Backend::io_uring, o.queue_depth, file.fd, r.file_bytes,
                         r.disk.stat_path, &r.io_uring));
          if (o.queue_depth != 1)
            add(reader_run(o, order, block, Backend::io_uring, 1, file.fd, r.file_bytes,
                           r.disk.stat_path, nullptr));
        } catch (const Error& e) {
          if (e.category() != ErrorCategory::unsupported) throw;
          uring = false;
          r.io_uring = e.what();
          if (options.progress)
            options.progress(fmt::format("io_uring runs skipped: {}", e.what()));
        }
      }
      add(reader_run(o, order, block, Backend::pread, o.queue_depth, file.fd, r.file_bytes,
                     r.disk.stat_path, nullptr));
      add(mmap_run(o, order, block, file.fd, r.file_bytes, r.disk.stat_path));
    }
  }
  // One summary per method, depth and block, in the order of first appearance.
  for (const DiskBenchRun& x : r.runs) {
    auto same = [&](const DiskBenchSummary& g) {
      return g.method == x.method && g.depth == x.depth && g.block_bytes == x.block_bytes;
    };
    if (std::find_if(r.summary.begin(), r.summary.end(), same) != r.summary.end()) continue;
    DiskBenchSummary g{x.method, x.depth, x.block_bytes};
    std::vector<double> v;
    for (const DiskBenchRun& y : r.runs)
      if (y.method == x.method && y.depth == x.depth && y.block_bytes == x.block_bytes)
        v.push_back(y.gbps);
    g.gbps_median = median_of(v);
    g.gbps_min = *std::min_element(v.begin(), v.end());
    g.gbps_max = *std::max_element(v.begin(), v.end());
    r.summary.push_back(g);
  }
  return r;
}

nlohmann::json to_json(const DiskBenchResult& r) {
  using nlohmann::json;
  json runs = json::array();
  for (const DiskBenchRun& x : r.runs)
    runs.push_back({{"method", x.method},
                    {"depth", x.depth},
                    {"block_bytes", x.block_bytes},
                    {"reads", x.reads},
                    {"bytes", x.bytes},
                    {"seconds", x.seconds},
                    {"gbps", x.gbps},
                    {"cached_fraction", x.cached_fraction},
                    {"device_bytes", x.device_bytes},
                    {"repetition", x.repetition}});
  json summary = json::array();
  for (const DiskBenchSummary& g : r.summary)
    summary.push_back({{"method", g.method},
                       {"depth", g.depth},
                       {"block_bytes", g.block_bytes},
                       {"gbps_median", g.gbps_median},
                       {"gbps_min", g.gbps_min},
                       {"gbps_max", g.gbps_max}});
  return {{"benchmark", "berth bench disk"},
          {"date", r.machine.date_utc},
          {"machine", to_json(r.machine)},
          {"disk",
           {{"device", r.disk.device},
            {"read_ahead_kb", r.disk.read_ahead_kb},
            {"rotational", r.disk.rotational},
            {"logical_block_size", r.disk.logical_block_size}}},
          {"file", {{"path", r.options.path}, {"bytes", r.file_bytes}}},
          {"config",
           {{"queue_depth", r.options.queue_depth},
            {"block_bytes", r.options.block_bytes},
            {"seconds", r.options.seconds},
            {"repetitions", r.options.repetitions},
            {"seed", r.options.seed}}},
          {"io_uring", r.io_uring},
          {"runs", runs},
          {"summary", summary}};
}

std::string format_text(const DiskBenchResult& r) {
  std::string s = fmt::format(
      "berth bench disk: {} ({:.2f} GB) on {} (read_ahead_kb {}), {} on {}\n"
      "random block-aligned reads, up to {} s per run, {} repetition(s) interleaved, page cache "
      "dropped before each run\n"
      "io_uring: {}\n\n",
      r.options.path, static_cast<double>(r.file_bytes) / 1e9,
      r.disk.device.empty() ? "an unknown device" : r.disk.device, r.disk.read_ahead_kb,
      r.machine.date_utc, r.machine.hostname, r.options.seconds, r.options.repetitions, r.io_uring);
  s += fmt::format("{:<18} {:>5} {:>8} {:>4} {:>7} {:>8} {:>8} {:>9} {:>13}\n", "method", "depth",
                   "block", "rep", "reads", "seconds", "GB/s", "cached", "device/asked");
  for (const DiskBenchRun& x : r.runs)
    s += fmt::format("{:<18} {:>5} {:>8} {:>4} {:>7} {:>8.1f} {:>8.3f} {:>8.1f}% {:>13}\n",
                     x.method, x.depth, size_text(x.block_bytes), x.repetition + 1, x.reads,
                     x.seconds, x.gbps, 100 * x.cached_fraction,
                     x.device_bytes < 0 || x.bytes == 0
                         ? std::string("-")
                         : fmt::format("{:.2f}", static_cast<double>(x.device_bytes) /
                                                     static_cast<double>(x.bytes)));
  if (r.options.repetitions > 1) {
    s += fmt::format("\n{:<18} {:>5} {:>8} {:>12} {:>17}\n", "method", "depth", "block",
                     "median GB/s", "min - max GB/s");
    for (const DiskBenchSummary& g : r.summary)
      s += fmt::format("{:<18} {:>5} {:>8} {:>12.3f} {:>8.3f} - {:<6.3f}\n", g.method, g.depth,
                       size_text(g.block_bytes), g.gbps_median, g.gbps_min, g.gbps_max);
  }
  return s;
}

}  // namespace berth::bench
