#include "berth/io/mapped_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "berth/core/error.h"

namespace berth::io {
namespace {

[[noreturn]] void fail(const std::string& path, std::string_view what, int err) {
  throw Error(ErrorCategory::io,
              fmt::format("{}: cannot {}: {}", path.empty() ? std::string("(an empty path)") : path,
                          what, std::strerror(err)));
}

// Closes a file descriptor on every exit path.
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd;
  do {
    // O_NONBLOCK: opening a FIFO would otherwise wait for a writer before fstat can reject it.
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) fail(path, "open", errno);
  FdGuard guard{fd};

  struct stat st;
  if (::fstat(fd, &st) != 0) fail(path, "stat", errno);
  if (S_ISDIR(st.st_mode))
    throw Error(ErrorCategory::io, fmt::format("{}: cannot map: is a directory", path));
  if (!S_ISREG(st.st_mode))
    throw Error(ErrorCategory::io, fmt::format("{}: cannot map: not a regular file", path));
  if (st.st_size == 0) return;  // mmap of length 0 is invalid; an empty file has no bytes

  const size_t size = static_cast<size_t>(st.st_size);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED) fail(path, "mmap", errno);
  data_ = static_cast<const uint8_t*>(p);
  size_ = size;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

MappedFile::MappedFile(MappedFile&& o) noexcept
    : path_(std::move(o.path_)),
      data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
    path_ = std::move(o.path_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

void advise_whole_pages(const void* p, size_t n, int advice) {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t b = (a + page - 1) / page * page, e = (a + n) / page * page;
  if (e > b) ::madvise(reinterpret_cast<void*>(b), e - b, advice);
}

}  // namespace berth::io
