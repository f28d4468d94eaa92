// DiskReader (disk_reader.h): io_uring with O_DIRECT, or a pool of pread threads.
//
// A submitted request becomes one or more pieces (one read each); pieces wait in `pending`
// until a backend thread takes them. io_uring: one I/O thread owns the ring: it moves up to
// queue_depth pieces into slots, prepares their SQEs, submits them together with one
// io_uring_submit_and_wait, and handles every completion it reaps (copying bounce blocks,
// re-queueing the rest of a short read). submit() wakes it through an eventfd that the ring
// reads. pread: each thread takes one piece at a time. Either way a finished piece counts down
// its batch (one per ticket) under the mutex and wakes wait().
#include "berth/io/disk_reader.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <liburing.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>

#include "berth/core/env.h"
#include "berth/core/error.h"
#include "berth/core/log.h"

namespace berth::io {
namespace {

constexpr size_t kA = kDirectAlignment;
constexpr size_t kMaxBounce = size_t{1} << 20;     // bytes per read through a bounce block
constexpr size_t kMaxFixedPart = size_t{1} << 30;  // io_uring's limit per registered buffer
constexpr uint64_t kWakeTag = ~uint64_t{0};        // user_data of the eventfd read

uint64_t align_down(uint64_t x) { return x / kA * kA; }
uint64_t align_up(uint64_t x) { return (x + kA - 1) / kA * kA; }

// "Input/output error (EIO)".
std::string errno_text(int e) {
  const char* name = strerrorname_np(e);
  return name ? fmt::format("{} ({})", std::strerror(e), name) : std::string(std::strerror(e));
}

// One read issued to the kernel: all or part of one request.
struct Piece {
  Ticket ticket = 0;
  uint32_t request = 0;    // index into the batch's requests
  uint64_t file_off = 0;   // first byte (aligned for O_DIRECT)
  size_t len = 0;          // bytes asked of the kernel
  size_t need = 0;         // bytes that must arrive (< len where the span passes the file's end)
  uint8_t* dst = nullptr;  // where the kernel writes; a bounced piece's block, allocated at issue
  bool bounced = false;    // then bytes [skip, skip + copy_len) of dst go to copy_dst
  uint8_t* copy_dst = nullptr;
  size_t skip = 0, copy_len = 0;
  size_t done = 0;   // bytes arrived
  uint64_t seq = 0;  // 1-based issue number (fault injection); 0 until issued
};

struct RequestInfo {
  uint64_t offset = 0;
  size_t length = 0;
  std::string tensor;
};

// The reads of one ticket.
struct Batch {
  std::vector<RequestInfo> requests;
  size_t pieces_left = 0;
  bool failed = false;
  ErrorCategory category = ErrorCategory::io;
  std::string error;
};

struct Failure {
  ErrorCategory category = ErrorCategory::io;
  std::string what;
};

}  // namespace

struct DiskReader::Impl {
  std::string path;
  DiskReaderOptions opt;
  DiskBackend backend = DiskBackend::pread;
  std::string reason;
  int fd = -1;         // buffered: the pread backend, and fstat when a read comes up short
  int direct_fd = -1;  // O_DIRECT: the io_uring backend
  uint64_t size = 0;   // at open
  uint64_t fail_nth = 0;
  int fail_errno = EIO;
  size_t max_piece = size_t{8} << 20;  // bytes per read; longer ranges are split

  // io_uring; the ring's submission and completion sides belong to the I/O thread.
  io_uring ring{};
  bool ring_up = false;
  bool file_registered = false;
  std::vector<iovec> fixed;  // registered parts of options.fixed_buffers
  int wake_fd = -1;
  uint64_t wake_buf = 0;
  std::vector<Piece> slots;  // pieces in the kernel, indexed by user_data
  std::vector<uint32_t> free_slots;

  // Shared by every thread, under mu.
  std::mutex mu;
  std::condition_variable done_cv, work_cv;
  std::unordered_map<Ticket, Batch> batches;
  Ticket next_ticket = 1;
  std::deque<Piece> pending;
  bool stopping = false;
  std::atomic<uint64_t> issued{0};
  std::vector<std::thread> threads;

  // Busy time: the seconds with at least one read in the kernel (busy_begin/busy_end around
  // each read: io_uring from its preparation, submitted in the same round, to its reaping by
  // the I/O thread; pread around the call), and the bytes the kernel returned. busy_n is the
  // one count of reads in the kernel: the io_uring backend's queue-depth limit reads it too
  // (in_kernel()).
  std::mutex busy_mu;
  unsigned busy_n = 0;
  std::chrono::steady_clock::time_point busy_t0;
  int64_t busy_ns = 0;
  std::atomic<uint64_t> bytes{0};
  void busy_begin() {
    std::lock_guard lk(busy_mu);
    if (busy_n++ == 0) busy_t0 = std::chrono::steady_clock::now();
  }
  void busy_end() {
    std::lock_guard lk(busy_mu);
    if (busy_n > 0 && --busy_n == 0)
      busy_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                     std::chrono::steady_clock::now() - busy_t0)
                     .count();
  }
  unsigned in_kernel() {
    std::lock_guard lk(busy_mu);
    return busy_n;
  }
  double busy_seconds() {
    std::lock_guard lk(busy_mu);
    int64_t ns = busy_ns;
    if (busy_n > 0)
      ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                                 busy_t0)
                .count();
    return static_cast<double>(ns) / 1e9;
  }

  ~Impl() {
    {
      std::lock_guard lk(mu);
      stopping = true;
    }
    work_cv.notify_all();
    wake();
    for (std::thread& t : threads) t.join();
    for (Piece& p : pending)
      if (p.bounced) std::free(p.dst);
    if (ring_up) io_uring_queue_exit(&ring);
    for (int f : {fd, direct_fd, wake_fd})
      if (f >= 0) ::close(f);
  }

  void wake() {
    if (wake_fd < 0) return;
    const uint64_t one = 1;
    (void)!::write(wake_fd, &one, sizeof one);
  }

  // ---- set-up ----------------------------------------------------------------------------

  // Sets up io_uring with O_DIRECT; returns why it cannot be used ("" when it can).
  std::string setup_uring() {
    int e = opt.faults.direct_open_errno;
    if (e == 0) {
      direct_fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
      if (direct_fd < 0) e = errno;
    }
    if (e != 0)
      return fmt::format("open with O_DIRECT failed: {}{}", errno_text(e),
                         e == EINVAL ? " (the file system refuses direct I/O, as FUSE, exFAT and "
                                       "tmpfs before Linux 6.6 do)"
                                     : "");
    e = opt.faults.uring_setup_errno;
    if (e == 0) {
      const int r = io_uring_queue_init(opt.queue_depth + 1, &ring, 0);  // + the wake-up read
      if (r < 0) e = -r;
      ring_up = r == 0;
    }
    if (e != 0) {
      const char* hint = e == EPERM    ? " (refused by a seccomp profile such as Docker's default, "
                                         "or by the sysctl kernel.io_uring_disabled)"
                         : e == ENOSYS ? " (the kernel has no io_uring)"
                         : e == ENOMEM ? " (RLIMIT_MEMLOCK too small for the rings?)"
                                       : "";
      return fmt::format("io_uring_setup failed: {}{}", errno_text(e), hint);
    }
    io_uring_probe* probe = io_uring_get_probe_ring(&ring);
    const bool has_read = probe != nullptr && io_uring_opcode_supported(probe, IORING_OP_READ) &&
                          io_uring_opcode_supported(probe, IORING_OP_READ_FIXED);
    if (probe != nullptr) io_uring_free_probe(probe);
    if (!has_read) return "the kernel's io_uring has no IORING_OP_READ (Linux 5.6 or later needed)";
    // Some file systems accept O_DIRECT at open and refuse the reads: read the first block.
    if (size > 0) {
      AlignedBuffer block(kA);
      io_uring_prep_read(io_uring_get_sqe(&ring), direct_fd, block.data(), kA, 0);
      io_uring_cqe* cqe = nullptr;
      int r = io_uring_submit_and_wait(&ring, 1);
      if (r >= 0) r = io_uring_wait_cqe(&ring, &cqe);
      if (r < 0) return fmt::format("io_uring_enter failed: {}", errno_text(-r));
      const int res = cqe->res;
      io_uring_cqe_seen(&ring, cqe);
      if (res < 0)
        return fmt::format("a direct read of the first block failed: {}", errno_text(-res));
    }
    wake_fd = ::eventfd(0, EFD_CLOEXEC);
    if (wake_fd < 0) return fmt::format("eventfd failed: {}", errno_text(errno));

    std::string file_note = "registered file";
    const int rf = io_uring_register_files(&ring, &direct_fd, 1);
    file_registered = rf == 0;
    if (rf < 0) file_note = fmt::format("file not registered ({})", errno_text(-rf));
    std::vector<iovec> parts;
    for (const MemoryRegion& m : opt.fixed_buffers)
      for (size_t at = 0; at < m.bytes; at += kMaxFixedPart)
        parts.push_back(
            {static_cast<uint8_t*>(m.data) + at, std::min(kMaxFixedPart, m.bytes - at)});
    std::string buffer_note = "no fixed buffers";
    if (!parts.empty()) {
      const int rb =
          io_uring_register_buffers(&ring, parts.data(), static_cast<unsigned>(parts.size()));
      if (rb == 0) {
        fixed = std::move(parts);
        buffer_note = fmt::format("{} fixed buffer{}", fixed.size(), fixed.size() == 1 ? "" : "s");
      } else {
        buffer_note = fmt::format("fixed buffers refused ({})", errno_text(-rb));
      }
    }
    slots.resize(opt.queue_depth);
    for (uint32_t s = opt.queue_depth; s > 0; --s) free_slots.push_back(s - 1);
    reason = fmt::format("io_uring with O_DIRECT, queue depth {}, {}, {}", opt.queue_depth,
                         file_note, buffer_note);
    return {};
  }

  // ---- requests -> pieces ----------------------------------------------------------------

  void split(const ReadRequest& r, uint32_t index, std::vector<Piece>& out) const {
    uint8_t* dst = static_cast<uint8_t*>(r.dst);
    const uint64_t off = r.offset, end = r.offset + r.length;
    // [a, b) read straight into the destination.
    auto straight = [&](uint64_t a, uint64_t b) {
      for (uint64_t x = a; x < b; x += max_piece) {
        Piece p;
        p.request = index;
        p.file_off = x;
        p.len = p.need = std::min<uint64_t>(b - x, max_piece);
        p.dst = dst + (x - off);
        out.push_back(p);
      }
    };
    // Aligned [a, b) through bounce blocks; the bytes inside [off, end) are copied out.
    auto bounced = [&](uint64_t a, uint64_t b) {
      for (uint64_t x = a; x < b; x += kMaxBounce) {
        const uint64_t y = std::min<uint64_t>(b, x + kMaxBounce);
        const uint64_t lo = std::max(x, off), hi = std::min(y, end);
        Piece p;
        p.request = index;
        p.file_off = x;
        p.len = y - x;
        p.need = hi - x;
        p.bounced = true;
        p.copy_dst = dst + (lo - off);
        p.skip = lo - x;
        p.copy_len = hi - lo;
        out.push_back(p);
      }
    };
    if (backend == DiskBackend::pread) return straight(off, end);
    const bool congruent = (reinterpret_cast<uintptr_t>(dst) - off) % kA == 0;
    const uint64_t lo = align_up(off), hi = align_down(end);
    if (!congruent || lo >= hi) return bounced(align_down(off), align_up(end));
    if (off < lo) bounced(lo - kA, lo);
    straight(lo, hi);
    if (hi < end) bounced(hi, hi + kA);
  }

  // ---- completion, shared by both backends -----------------------------------------------

  std::string read_error(const Piece& p, int e) const {
    return fmt::format("the read at offset {} failed: {}", p.file_off + p.done, errno_text(e));
  }

  std::string eof_error(const Piece& p) const {
    struct stat st;
    const uint64_t at = p.file_off + p.done;
    if (::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) < size)
      return fmt::format(
          "the file ends at byte {}; it had {} bytes when opened (it shrank while "
          "open)",
          st.st_size, size);
    return fmt::format("unexpected end of file at offset {}", at);
  }

  // Counts `p` off its batch; the first failure of a batch is the one reported.
  void finish(Piece& p, const Failure* f) {
    if (p.bounced) std::free(p.dst);
    p.dst = nullptr;
    std::lock_guard lk(mu);
    Batch& b = batches.at(p.ticket);  // a batch outlives its pieces
    if (f != nullptr && !b.failed) {
      const RequestInfo& r = b.requests[p.request];
      b.failed = true;
      b.category = f->category;
      b.error =
          fmt::format("{}: cannot read {} bytes at offset {}{}: {}", path, r.length, r.offset,
                      r.tensor.empty() ? "" : fmt::format(" (tensor '{}')", r.tensor), f->what);
    }
    if (--b.pieces_left == 0) done_cv.notify_all();
  }

  // ---- pread backend ---------------------------------------------------------------------

  void pread_loop() {
    for (;;) {
      Piece p;
      {
        std::unique_lock lk(mu);
        work_cv.wait(lk, [&] { return stopping || !pending.empty(); });
        if (stopping) return;
        p = pending.front();
        pending.pop_front();
        p.seq = ++issued;  // under the lock: issue numbers follow the queue's order
      }
      std::optional<Failure> f;
      if (p.seq == fail_nth) f = Failure{ErrorCategory::io, read_error(p, fail_errno)};
      while (!f && p.done < p.need) {
        busy_begin();
        const ssize_t r =
            ::pread(fd, p.dst + p.done, p.len - p.done, static_cast<off_t>(p.file_off + p.done));
        busy_end();
        if (r > 0) bytes.fetch_add(static_cast<uint64_t>(r), std::memory_order_relaxed);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0)
          f = Failure{ErrorCategory::io, read_error(p, errno)};
        else if (r == 0)
          f = Failure{ErrorCategory::io, eof_error(p)};
        else
          p.done += static_cast<size_t>(r);
      }
      finish(p, f ? &*f : nullptr);
    }
  }

  // ---- io_uring backend (I/O thread only) ------------------------------------------------

  io_uring_sqe* sqe() {
    io_uring_sqe* s = io_uring_get_sqe(&ring);
    // At most queue_depth pieces and the wake-up read are prepared per round; the ring has
    // queue_depth + 1 entries or more, and io_uring_enter consumes every SQE it is given.
    BERTH_CHECK(s != nullptr, "io_uring submission queue full");
    return s;
  }

  void arm_wake() {
    io_uring_sqe* s = sqe();
    io_uring_prep_read(s, wake_fd, &wake_buf, sizeof wake_buf, 0);
    io_uring_sqe_set_data64(s, kWakeTag);
  }

  // The registered part holding [p, p + n), or -1.
  int fixed_index(const uint8_t* p, size_t n) const {
    const auto a = reinterpret_cast<uintptr_t>(p);
    for (size_t i = 0; i < fixed.size(); ++i) {
      const auto base = reinterpret_cast<uintptr_t>(fixed[i].iov_base);
      if (a >= base && a - base + n <= fixed[i].iov_len) return static_cast<int>(i);
    }
    return -1;
  }

  void issue(Piece&& piece) {
    const uint32_t s = free_slots.back();
    free_slots.pop_back();
    busy_begin();
    Piece& p = slots[s] = std::move(piece);
    if (p.seq == 0) p.seq = ++issued;
    if (p.bounced && p.dst == nullptr) {
      void* block = nullptr;
      if (::posix_memalign(&block, kA, p.len) != 0) {
        const Failure f{ErrorCategory::out_of_memory,
                        fmt::format("cannot allocate a bounce block of {} bytes", p.len)};
        return release(s, &f);
      }
      p.dst = static_cast<uint8_t*>(block);
    }
    uint8_t* buf = p.dst + p.done;
    const auto n = static_cast<unsigned>(p.len - p.done);
    const uint64_t at = p.file_off + p.done;
    const int file = file_registered ? 0 : direct_fd;
    io_uring_sqe* q = sqe();
    const int fi = fixed_index(buf, n);
    if (fi >= 0)
      io_uring_prep_read_fixed(q, file, buf, n, at, fi);
    else
      io_uring_prep_read(q, file, buf, n, at);
    if (file_registered) q->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data64(q, s);
  }

  // Frees slot s; the piece is finished (f: its failure) or, with requeue, read on later.
  void release(uint32_t s, const Failure* f, bool requeue = false) {
    Piece p = std::move(slots[s]);
    free_slots.push_back(s);
    busy_end();
    if (!requeue) return finish(p, f);
    std::lock_guard lk(mu);
    pending.push_front(std::move(p));
  }

  void complete(uint32_t s, int res) {
    Piece& p = slots[s];
    if (p.seq == fail_nth) res = -fail_errno;
    if (res == -EINTR || res == -EAGAIN) return release(s, nullptr, true);
    if (res < 0) {
      const Failure f{ErrorCategory::io, read_error(p, -res)};
      return release(s, &f);
    }
    p.done += static_cast<size_t>(res);
    bytes.fetch_add(static_cast<uint64_t>(res), std::memory_order_relaxed);
    if (p.done >= p.need) {
      if (p.bounced) std::memcpy(p.copy_dst, p.dst + p.skip, p.copy_len);
      return release(s, nullptr);
    }
    if (res == 0) {
      const Failure f{ErrorCategory::io, eof_error(p)};
      return release(s, &f);
    }
    release(s, nullptr, true);  // a short read: the rest goes in the next round
  }

  void uring_loop() {
    arm_wake();
    std::vector<Piece> take;
    bool warned = false;
    for (;;) {
      // Reads in the kernel: only this thread issues (busy_begin) and reaps (busy_end) them.
      const unsigned in_flight = in_kernel();
      {
        std::lock_guard lk(mu);
        if (stopping && in_flight == 0) return;  // queued pieces are dropped (~Impl frees them)
        while (!stopping && in_flight + take.size() < opt.queue_depth && !pending.empty()) {
          take.push_back(std::move(pending.front()));
          pending.pop_front();
        }
      }
      for (Piece& p : take) issue(std::move(p));
      take.clear();
      const int r = io_uring_submit_and_wait(&ring, 1);
      if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY) {
        // Not expected with a ring set up as here; back off rather than spin.
        if (!warned) log::error("disk reader: {}: io_uring_enter failed: {}", path, errno_text(-r));
        warned = true;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      unsigned head, seen = 0;
      io_uring_cqe* cqe;
      io_uring_for_each_cqe(&ring, head, cqe) {
        ++seen;
        const uint64_t tag = io_uring_cqe_get_data64(cqe);
        if (tag == kWakeTag) {
          if (cqe->res >= 0) arm_wake();
        } else {
          complete(static_cast<uint32_t>(tag), cqe->res);
        }
      }
      io_uring_cq_advance(&ring, seen);
    }
  }
};

// ---- AlignedBuffer ---------------------------------------------------------------------------

AlignedBuffer::AlignedBuffer(size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  void* p = nullptr;
  if (::posix_memalign(&p, kA, align_up(bytes)) != 0)
    throw Error(ErrorCategory::out_of_memory,
                fmt::format("cannot allocate {} bytes aligned to {} bytes", bytes, kA));
  data_ = static_cast<uint8_t*>(p);
}
AlignedBuffer::~AlignedBuffer() { std::free(data_); }
AlignedBuffer::AlignedBuffer(AlignedBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    std::free(data_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

std::string_view backend_name(DiskBackend b) {
  return b == DiskBackend::io_uring ? "io_uring" : "pread";
}

// ---- DiskReader ------------------------------------------------------------------------------

DiskReader::DiskReader(const std::string& path, DiskReaderOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.path = path;
  m.opt = std::move(options);
  using B = DiskReaderOptions::Backend;
  if (m.opt.queue_depth < 1 || m.opt.queue_depth > 4096)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("disk reader: queue depth {} is outside 1..4096", m.opt.queue_depth));
  if (m.opt.pread_threads > 1024)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("disk reader: {} pread threads is over 1024", m.opt.pread_threads));
  const uint64_t max_read = m.opt.max_read_bytes != 0
                                ? m.opt.max_read_bytes
                                : env_uint("BERTH_DISK_MAX_READ", uint64_t{1} << 30).value_or(0);
  if (max_read != 0) {
    if (max_read % kA != 0 || max_read > (uint64_t{1} << 30))
      throw Error(
          ErrorCategory::invalid_argument,
          fmt::format("disk reader: a largest read of {} bytes is not a multiple of {} "
                      "up to 1 GiB{}",
                      max_read, kA, m.opt.max_read_bytes != 0 ? "" : " (BERTH_DISK_MAX_READ)"));
    m.max_piece = static_cast<size_t>(max_read);
  }
  m.fail_nth = m.opt.faults.fail_read_nth != 0 ? m.opt.faults.fail_read_nth
                                               : env_uint("BERTH_DISK_READER_FAIL_NTH").value_or(0);
  m.fail_errno = m.opt.faults.read_errno;

  B choice = m.opt.backend;
  std::string forced = "forced by the caller";
  if (choice == B::automatic) {
    const char* env = std::getenv("BERTH_DISK_READER");
    const std::string_view v = env != nullptr ? env : "";
    if (v == "pread")
      choice = B::pread;
    else if (v == "io_uring")
      choice = B::io_uring;
    else if (!v.empty() && v != "auto")
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("BERTH_DISK_READER='{}': expected pread, io_uring or auto", v));
    forced = fmt::format("forced by BERTH_DISK_READER={}", v);
  }

  do {
    m.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // a FIFO must not block
  } while (m.fd < 0 && errno == EINTR);
  if (m.fd < 0)
    throw Error(ErrorCategory::io, fmt::format("{}: cannot open: {}", path, errno_text(errno)));
  struct stat st;
  if (::fstat(m.fd, &st) != 0)
    throw Error(ErrorCategory::io, fmt::format("{}: cannot stat: {}", path, errno_text(errno)));
  if (!S_ISREG(st.st_mode))
    throw Error(ErrorCategory::io, fmt::format("{}: cannot read: not a regular file", path));
  m.size = static_cast<uint64_t>(st.st_size);
  ::fcntl(m.fd, F_SETFL, ::fcntl(m.fd, F_GETFL) & ~O_NONBLOCK);

  if (choice != B::pread) {
    const std::string why = m.setup_uring();
    if (why.empty()) {
      m.backend = DiskBackend::io_uring;
    } else if (choice == B::io_uring) {
      throw Error(ErrorCategory::unsupported,
                  fmt::format("{}: io_uring with O_DIRECT is unavailable: {}", path, why));
    } else {
      m.reason = why;
    }
  } else {
    m.reason = forced;
  }

  if (m.backend == DiskBackend::io_uring) {
    log::info("disk reader: {}: {}", path, m.reason);
    m.threads.emplace_back([&m] { m.uring_loop(); });
    return;
  }
  // The ring (if any) is not needed; the pread threads read through the page cache.
  if (m.ring_up) io_uring_queue_exit(&m.ring);
  m.ring_up = false;
  const unsigned n =
      m.opt.pread_threads != 0 ? m.opt.pread_threads : std::min(m.opt.queue_depth, 8u);
  if (choice == B::pread)
    log::info("disk reader: {}: pread with {} threads, {}", path, n, m.reason);
  else
    log::warn("disk reader: {}: pread with {} threads (buffered reads) because {}", path, n,
              m.reason);
  for (unsigned i = 0; i < n; ++i) m.threads.emplace_back([&m] { m.pread_loop(); });
}

DiskReader::~DiskReader() = default;

Ticket DiskReader::submit(std::span<const ReadRequest> requests) {
  Impl& m = *impl_;
  Batch b;
  std::vector<Piece> pieces;
  b.requests.reserve(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const ReadRequest& r = requests[i];
    const std::string tensor =
        r.tensor.empty() ? std::string() : fmt::format(" (tensor '{}')", r.tensor);
    if (r.length > 0 && r.dst == nullptr)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("{}: read of {} bytes at offset {}{}: null destination", m.path,
                              r.length, r.offset, tensor));
    if (r.offset > m.size || r.length > m.size - r.offset)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("{}: read of {} bytes at offset {}{} ends past the end of the file "
                              "({} bytes)",
                              m.path, r.length, r.offset, tensor, m.size));
    b.requests.push_back({r.offset, r.length, std::string(r.tensor)});
    if (r.length > 0) m.split(r, static_cast<uint32_t>(i), pieces);
  }
  Ticket t;
  {
    std::lock_guard lk(m.mu);
    t = m.next_ticket++;
    b.pieces_left = pieces.size();
    m.batches.emplace(t, std::move(b));
    for (Piece& p : pieces) {
      p.ticket = t;
      m.pending.push_back(p);
    }
  }
  if (!pieces.empty()) {
    m.work_cv.notify_all();
    m.wake();
  }
  return t;
}

namespace {

// Removes a finished batch and throws its error, if any. `lk` holds the reader's mutex.
void retire(std::unordered_map<Ticket, Batch>& batches,
            std::unordered_map<Ticket, Batch>::iterator it, std::unique_lock<std::mutex>& lk) {
  Batch b = std::move(it->second);
  batches.erase(it);
  lk.unlock();
  if (b.failed) throw Error(b.category, b.error);
}

[[noreturn]] void unknown_ticket(const std::string& path, Ticket t) {
  throw Error(ErrorCategory::invalid_argument,
              fmt::format("{}: disk reader ticket {} is unknown or already retired", path, t));
}

}  // namespace

bool DiskReader::poll(Ticket t) {
  Impl& m = *impl_;
  std::unique_lock lk(m.mu);
  auto it = m.batches.find(t);
  if (it == m.batches.end()) unknown_ticket(m.path, t);
  if (it->second.pieces_left > 0) return false;
  retire(m.batches, it, lk);
  return true;
}

void DiskReader::wait(Ticket t) {
  Impl& m = *impl_;
  std::unique_lock lk(m.mu);
  if (m.batches.find(t) == m.batches.end()) unknown_ticket(m.path, t);
  m.done_cv.wait(lk, [&] {
    auto it = m.batches.find(t);  // another thread may retire it meanwhile (a misuse)
    return it == m.batches.end() || it->second.pieces_left == 0;
  });
  auto it = m.batches.find(t);
  if (it == m.batches.end()) unknown_ticket(m.path, t);
  retire(m.batches, it, lk);
}

DiskBackend DiskReader::backend() const { return impl_->backend; }
const std::string& DiskReader::backend_reason() const { return impl_->reason; }
const std::string& DiskReader::path() const { return impl_->path; }
uint64_t DiskReader::file_size() const { return impl_->size; }
unsigned DiskReader::queue_depth() const { return impl_->opt.queue_depth; }
double DiskReader::busy_seconds() const { return impl_->busy_seconds(); }
uint64_t DiskReader::bytes_read() const { return impl_->bytes.load(std::memory_order_relaxed); }
bool DiskReader::registered_file() const { return impl_->file_registered; }
size_t DiskReader::registered_buffers() const { return impl_->fixed.size(); }

}  // namespace berth::io
