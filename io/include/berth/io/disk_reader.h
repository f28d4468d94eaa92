// DiskReader: reads byte ranges of one file (a GGUF model's weights) into caller buffers, many
// ranges in flight at once, without a compute thread ever waiting in the kernel.
//
// Two backends, chosen when the reader opens (one log line names the choice and its reason):
//   io_uring: liburing, the file opened with O_DIRECT (the page cache is bypassed: a read costs
//     no page-cache memory and is not served from it), the file registered with the ring,
//     caller memory registered as fixed buffers where given (DiskReaderOptions::fixed_buffers),
//     up to `queue_depth` reads in the kernel, queued reads submitted in batches by one I/O
//     thread that also reaps the completions.
//   pread: `pread_threads` threads calling pread(2) on the file opened without O_DIRECT
//     (buffered: reads go through the page cache). Used when io_uring cannot be set up (EPERM
//     under Docker's default seccomp profile or kernel.io_uring_disabled, ENOSYS), when
//     open(O_DIRECT) is refused (EINVAL on some file systems: FUSE, exFAT, older tmpfs) or a
//     probe read with O_DIRECT fails; and when forced by DiskReaderOptions::backend or by the
//     environment variable BERTH_DISK_READER=pread.
//
// Alignment (io_uring backend). O_DIRECT needs file offsets, lengths and memory addresses that
// are multiples of the logical block size; the reader uses kDirectAlignment (4096, a multiple of
// every common block size) and accepts ANY range and destination:
//   - zero-copy path: when the destination is congruent to the file offset modulo 4096
//     (dst % 4096 == offset % 4096; direct_layout() places a range so), the whole 4096-aligned
//     interior of the range is read straight into the destination, and the partial block at
//     each end (if any) is read into a 4 KiB bounce block and copied;
//   - otherwise the covering aligned span is read in bounce chunks of at most 1 MiB and copied
//     (correct, but it costs a memcpy of every byte on the I/O thread).
// Nothing outside [dst, dst + length) is ever written. The pread backend needs no alignment.
//
// Thread safety: every public member function may be called from any thread at the same time.
// submit() only queues work (and wakes the I/O thread); poll() never blocks (a short mutex
// hold); wait() blocks only its caller. A ticket is retired by the first poll() that returns
// true (or throws) or by wait(); using it again is an error.
//
// A short read is continued where it stopped. Errors of a read (EIO and other errnos, the end
// of the file reached before the range's end: a file that shrank since it was opened) are
// reported by poll()/wait() of its ticket as berth::Error(io) naming the file, the request's
// offset and length, the tensor (when the request names one) and the cause; they never crash
// the process.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace berth::io {

/// Alignment of direct reads, bytes: file offsets, lengths and memory addresses of O_DIRECT
/// reads are multiples of it (4096 covers drives with 512-byte and 4 KiB logical blocks).
inline constexpr size_t kDirectAlignment = 4096;

/// Where to put a file range in a buffer so the io_uring backend reads it without copying:
/// allocate `bytes` bytes at a kDirectAlignment-aligned address and read the range to
/// address + `pad`. pad = offset % 4096; bytes = pad + length rounded up to 4096.
struct DirectLayout {
  size_t pad = 0;
  size_t bytes = 0;
};
constexpr DirectLayout direct_layout(uint64_t offset, size_t length) {
  const size_t pad = static_cast<size_t>(offset % kDirectAlignment);
  return {pad, (pad + length + kDirectAlignment - 1) / kDirectAlignment * kDirectAlignment};
}

/// Heap memory aligned to kDirectAlignment (posix_memalign), freed on destruction; move-only.
/// For destinations of reads; any memory works as a destination (pinned host memory included,
/// passed as a raw pointer), this is only the convenient way to get aligned memory.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  /// Throws Error(out_of_memory) naming `bytes` when the allocation fails. bytes 0: empty.
  explicit AlignedBuffer(size_t bytes);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& o) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

enum class DiskBackend { io_uring, pread };
/// "io_uring" or "pread".
std::string_view backend_name(DiskBackend b);

/// A memory area given to the reader (raw pointer: heap, an AlignedBuffer, pinned memory).
struct MemoryRegion {
  void* data = nullptr;
  size_t bytes = 0;
};

/// Test hooks that make the reader behave as if the system had failed. Each field also has an
/// environment variable (read at open, used when the field is 0) so that end-to-end tests can
/// inject faults into the `berth` executable.
struct DiskReaderFaults {
  /// Pretend io_uring_queue_init failed with this errno (EPERM: seccomp; ENOSYS: no io_uring).
  int uring_setup_errno = 0;
  /// Pretend open(O_DIRECT) failed with this errno (EINVAL: the file system refuses it).
  int direct_open_errno = 0;
  /// The Nth read issued to the kernel (1-based, counted over the reader's life) fails with
  /// `read_errno`; 0: none. A request is one read, except that the io_uring backend reads the
  /// partial blocks at an unaligned range's ends separately and splits ranges over
  /// max_read_bytes (and bounced ranges over 1 MiB), and the pread backend splits ranges over
  /// max_read_bytes.
  /// Environment: BERTH_DISK_READER_FAIL_NTH=N.
  uint64_t fail_read_nth = 0;
  int read_errno = EIO;
};

struct DiskReaderOptions {
  enum class Backend {
    /// io_uring with O_DIRECT, else pread (the reason logged). The environment variable
    /// BERTH_DISK_READER (pread | io_uring | auto) overrides this automatic choice only.
    automatic,
    /// io_uring with O_DIRECT or Error(unsupported) naming why it is unavailable.
    io_uring,
    pread,
  };
  Backend backend = Backend::automatic;
  /// io_uring: reads in the kernel at once (1..4096). The pread backend's default thread count
  /// derives from it.
  unsigned queue_depth = 32;
  /// pread backend: threads (1..1024); 0: min(queue_depth, 8).
  unsigned pread_threads = 0;
  /// Bytes per read issued to the kernel: longer ranges are split into reads of this size (a
  /// multiple of kDirectAlignment up to 1 GiB; io_uring reads through bounce blocks, for a
  /// destination not congruent to its offset, stay in pieces of at most 1 MiB whatever it is).
  /// More, smaller reads keep more of a drive's queue busy when few ranges are in flight. 0: the
  /// environment variable BERTH_DISK_MAX_READ, else 8 MiB.
  size_t max_read_bytes = 0;
  /// io_uring: memory registered with the ring as fixed buffers (pinned by the kernel while the
  /// reader lives; regions over 1 GiB are registered in 1 GiB parts); a read whose destination
  /// lies wholly inside one part is issued as READ_FIXED. Must outlive the reader. Registration
  /// that fails (RLIMIT_MEMLOCK, memory the kernel cannot pin) is named in the log line and the
  /// reads go without it. Ignored by the pread backend.
  std::vector<MemoryRegion> fixed_buffers;
  DiskReaderFaults faults;
};

/// Identifies one submit() call's reads; 0 is never a ticket.
using Ticket = uint64_t;

/// One range of the file to read.
struct ReadRequest {
  uint64_t offset = 0;  ///< file byte offset
  size_t length = 0;    ///< bytes
  void* dst = nullptr;  ///< receives the `length` bytes; must stay valid until the ticket is done
  std::string_view tensor;  ///< optional: the tensor (or other name) errors should name; copied
};

class DiskReader {
 public:
  /// Opens `path` (a regular file) and sets up the backend (module comment). Throws Error(io)
  /// naming the path when it cannot be opened or is not a regular file, Error(invalid_argument)
  /// for a bad option or a bad BERTH_DISK_READER or BERTH_DISK_MAX_READ value, Error(unsupported)
  /// when io_uring is required and unavailable.
  explicit DiskReader(const std::string& path, DiskReaderOptions options = {});
  /// Waits for the reads already in the kernel (their destinations are written until then);
  /// queued reads are dropped. Outstanding tickets must not be used afterwards.
  ~DiskReader();
  DiskReader(const DiskReader&) = delete;
  DiskReader& operator=(const DiskReader&) = delete;

  /// Queues `requests` and returns the ticket that completes when all of them are read (at once
  /// for an empty list or zero lengths). Never blocks on I/O. Throws Error(invalid_argument),
  /// queueing nothing, when a range ends past the file's size at open or a destination is null.
  Ticket submit(std::span<const ReadRequest> requests);
  Ticket submit(const ReadRequest& request) { return submit(std::span(&request, 1)); }

  /// True when every read of `t` has finished (the ticket is then retired); false while any is
  /// pending. Never blocks. Throws the first error of a finished ticket (Error(io), or
  /// Error(out_of_memory) when a bounce block could not be allocated) and retires it; throws
  /// Error(invalid_argument) for a ticket that is unknown or already retired.
  bool poll(Ticket t);
  /// Blocks until every read of `t` has finished (also when one failed: the destinations are
  /// no longer written when it returns or throws), then retires it. Throws as poll().
  void wait(Ticket t);

  DiskBackend backend() const;
  /// Why this backend, as logged at open (for io_uring: its settings; for pread: the cause).
  const std::string& backend_reason() const;
  const std::string& path() const;
  uint64_t file_size() const;  ///< at open
  unsigned queue_depth() const;
  bool registered_file() const;       ///< io_uring: the file is registered with the ring
  size_t registered_buffers() const;  ///< io_uring: fixed buffers (parts) registered
  /// Seconds since open during which at least one of this reader's reads was in the kernel:
  /// io_uring, from a read's submission to the reaping of its completion by the I/O thread,
  /// which waits on the ring and so reaps as completions arrive; pread, while a thread was
  /// inside pread(2). An interval still open when called is counted up to now. bytes_read()
  /// over it is the rate the drive delivered while the reader kept it busy (the quantity a
  /// queue-depth benchmark measures over its whole run).
  double busy_seconds() const;
  /// Bytes the kernel returned to this reader's reads since open (partial blocks of unaligned
  /// ranges included).
  uint64_t bytes_read() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace berth::io
