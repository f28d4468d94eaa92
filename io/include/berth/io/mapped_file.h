// Read-only memory mapping of a whole file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace berth::io {

/// Maps a file read-only (MAP_PRIVATE, PROT_READ). Move-only; unmaps on destruction.
/// Throws berth::Error(io) naming the path and the OS error when open/stat/mmap fail, and when
/// the path is a directory or not a regular file. An empty file maps to data() == nullptr, size 0.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

/// madvise(advice) over the whole pages inside [p, p + n) (the partial pages at both ends, which
/// may hold other data, are left alone); nothing when no whole page lies inside. The advice is a
/// hint: its result is ignored (MADV_PAGEOUT and MADV_COLD need Linux 5.4).
void advise_whole_pages(const void* p, size_t n, int advice);

}  // namespace berth::io
