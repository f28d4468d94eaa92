// GGUF writer. Layout from ggml's docs/gguf.md: header, key/values, tensor infos, zero padding
// to the alignment, then each tensor's bytes at an aligned offset followed by zero padding to
// the next multiple of the alignment.
#include "berth/io/gguf_writer.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

namespace berth::gguf {

static_assert(std::endian::native == std::endian::little,
              "the GGUF writer stores little-endian fields by memcpy");

namespace {

constexpr uint64_t kDefaultAlignment = 32;
constexpr size_t kMaxTensorNameBytes = 63;  // ggml's GGML_MAX_NAME (64) counts the NUL
constexpr const char* kAlignmentKey = "general.alignment";

[[noreturn]] void invalid(const std::string& msg) {
  throw Error(ErrorCategory::invalid_argument, "gguf writer: " + msg);
}

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// Writes fields through a byte sink and counts the bytes written.
class Out {
 public:
  explicit Out(const std::function<void(const void*, size_t)>& sink) : sink_(sink) {}

  void bytes(const void* p, size_t n) {
    if (n == 0) return;
    sink_(p, n);
    written_ += n;
  }
  template <class T>
  void scalar(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    bytes(&v, sizeof(T));
  }
  void string(std::string_view s) {
    scalar<uint64_t>(s.size());
    bytes(s.data(), s.size());
  }
  void zeros(uint64_t n) {
    static constexpr uint8_t kZeros[256] = {};
    while (n > 0) {
      const size_t k = static_cast<size_t>(std::min<uint64_t>(n, sizeof(kZeros)));
      bytes(kZeros, k);
      n -= k;
    }
  }
  void pad_to(uint64_t alignment) { zeros(align_up(written_, alignment) - written_); }
  uint64_t written() const { return written_; }

 private:
  const std::function<void(const void*, size_t)>& sink_;
  uint64_t written_ = 0;
};

void write_value(Out& out, const Value& value) {
  std::visit(
      [&](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, Value::Array>) {
          out.scalar<uint32_t>(static_cast<uint32_t>(value.array_type()));
          std::visit(
              [&](const auto& vec) {
                using E = typename std::decay_t<decltype(vec)>::value_type;
                out.scalar<uint64_t>(vec.size());
                if constexpr (std::is_same_v<E, bool>) {
                  for (bool b : vec) out.scalar<uint8_t>(b ? 1 : 0);
                } else if constexpr (std::is_same_v<E, std::string>) {
                  for (const std::string& s : vec) out.string(s);
                } else {
                  out.bytes(vec.data(), vec.size() * sizeof(E));
                }
              },
              x);
        } else if constexpr (std::is_same_v<T, std::string>) {
          out.string(x);
        } else if constexpr (std::is_same_v<T, bool>) {
          out.scalar<uint8_t>(x ? 1 : 0);
        } else {
          out.scalar<T>(x);
        }
      },
      value.v);
}

// Validates a tensor's name, type and shape against what is already added; returns its bytes.
uint64_t check_tensor(const std::string& name, GgmlType type, const std::vector<int64_t>& ne,
                      const std::unordered_set<std::string>& existing) {
  if (name.empty()) invalid("tensor name is empty");
  if (name.size() > kMaxTensorNameBytes)
    invalid(fmt::format("tensor name '{}' has {} bytes; at most {} are allowed", name, name.size(),
                        kMaxTensorNameBytes));
  if (existing.count(name)) invalid(fmt::format("tensor '{}' added twice", name));
  const TypeTraits* tr = find_type(static_cast<uint32_t>(type));
  if (tr == nullptr)
    invalid(fmt::format("tensor '{}' has invalid type id {}", name, static_cast<uint32_t>(type)));
  if (ne.empty() || ne.size() > 4)
    invalid(fmt::format("tensor '{}' has {} dimensions; 1 to 4 are allowed", name, ne.size()));
  bool has_zero = false;
  for (size_t d = 0; d < ne.size(); ++d) {
    if (ne[d] < 0) invalid(fmt::format("tensor '{}' has negative ne[{}] = {}", name, d, ne[d]));
    has_zero = has_zero || ne[d] == 0;
  }
  if (ne[0] % tr->block_size != 0)
    invalid(fmt::format("tensor '{}' of type {}: ne[0] = {} is not a multiple of the block size {}",
                        name, tr->name, ne[0], tr->block_size));
  if (has_zero) return 0;
  int64_t rows = 1;
  for (size_t d = 1; d < ne.size(); ++d)
    if (__builtin_mul_overflow(rows, ne[d], &rows))
      invalid(fmt::format("tensor '{}' has too many elements", name));
  int64_t elements = 0;
  if (__builtin_mul_overflow(rows, ne[0], &elements))
    invalid(fmt::format("tensor '{}' has too many elements", name));
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(ne[0] / tr->block_size),
                             static_cast<uint64_t>(tr->block_bytes), &bytes) ||
      __builtin_mul_overflow(bytes, static_cast<uint64_t>(rows), &bytes) ||
      bytes > std::numeric_limits<size_t>::max())
    invalid(fmt::format("tensor '{}' needs more bytes than can be addressed", name));
  return bytes;
}

// Buffered writes to a file descriptor; throws Error(io) naming the path.
class FileSink {
 public:
  static constexpr size_t kBufferBytes = size_t{4} << 20;

  explicit FileSink(const std::string& path) : path_(path) {
    do {
      fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    } while (fd_ < 0 && errno == EINTR);
    if (fd_ < 0) fail("open for writing", errno);
    buf_.reserve(kBufferBytes);
  }
  ~FileSink() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileSink(const FileSink&) = delete;
  FileSink& operator=(const FileSink&) = delete;

  void put(const void* p, size_t n) {
    if (buf_.size() + n > kBufferBytes) flush();
    if (n >= kBufferBytes) {
      write_all(static_cast<const uint8_t*>(p), n);
    } else {
      const auto* b = static_cast<const uint8_t*>(p);
      buf_.insert(buf_.end(), b, b + n);
    }
  }

  void close() {
    flush();
    const int fd = std::exchange(fd_, -1);
    if (::close(fd) != 0) fail("close", errno);
  }

 private:
  [[noreturn]] void fail(std::string_view what, int err) const {
    throw Error(ErrorCategory::io,
                fmt::format("{}: cannot {}: {}", path_, what, std::strerror(err)));
  }
  void flush() {
    write_all(buf_.data(), buf_.size());
    buf_.clear();
  }
  void write_all(const uint8_t* p, size_t n) {
    while (n > 0) {
      const ssize_t k = ::write(fd_, p, n);
      if (k < 0) {
        if (errno == EINTR) continue;
        fail("write", errno);
      }
      p += k;
      n -= static_cast<size_t>(k);
    }
  }

  std::string path_;
  int fd_ = -1;
  std::vector<uint8_t> buf_;
};

}  // namespace

Writer::Writer(uint32_t version, uint64_t alignment) : version_(version), alignment_(alignment) {
  if (version != 2 && version != 3)
    invalid(fmt::format("GGUF version {} cannot be written; use 2 or 3", version));
  if (alignment == 0 || !std::has_single_bit(alignment) ||
      alignment > std::numeric_limits<uint32_t>::max())
    invalid(fmt::format("alignment {} is not a power of two that fits in uint32", alignment));
}

void Writer::set(std::string key, Value value) {
  if (key.empty()) invalid("metadata key is empty");
  if (key == kAlignmentKey) {
    const auto* a = std::get_if<uint32_t>(&value.v);
    if (a == nullptr || *a != alignment_)
      invalid(fmt::format("'{}' must be the uint32 {} given to the Writer, got {} {}",
                          kAlignmentKey, alignment_, value_type_name(value.type()),
                          value.to_string(4)));
  }
  for (KeyValue& kv : kvs_) {
    if (kv.key == key) {
      kv.value = std::move(value);
      return;
    }
  }
  kvs_.push_back(KeyValue{std::move(key), std::move(value)});
}

void Writer::set_u32(std::string key, uint32_t v) { set(std::move(key), Value{v}); }
void Writer::set_i32(std::string key, int32_t v) { set(std::move(key), Value{v}); }
void Writer::set_u64(std::string key, uint64_t v) { set(std::move(key), Value{v}); }
void Writer::set_f32(std::string key, float v) { set(std::move(key), Value{v}); }
void Writer::set_bool(std::string key, bool v) { set(std::move(key), Value{v}); }
void Writer::set_string(std::string key, std::string v) {
  set(std::move(key), Value{std::move(v)});
}
void Writer::set_string_array(std::string key, std::vector<std::string> v) {
  set(std::move(key), Value{Value::Array{std::move(v)}});
}
void Writer::set_f32_array(std::string key, std::vector<float> v) {
  set(std::move(key), Value{Value::Array{std::move(v)}});
}
void Writer::set_i32_array(std::string key, std::vector<int32_t> v) {
  set(std::move(key), Value{Value::Array{std::move(v)}});
}

void Writer::add_tensor(std::string name, GgmlType type, std::vector<int64_t> ne,
                        std::span<const uint8_t> bytes) {
  const uint64_t n_bytes = check_tensor(name, type, ne, tensor_names_);
  if (bytes.size() != n_bytes)
    invalid(fmt::format("tensor '{}' of type {} and shape [{}] needs {} bytes, got {}", name,
                        type_name(type), fmt::join(ne, ", "), n_bytes, bytes.size()));
  tensor_names_.insert(name);
  tensors_.push_back(PendingTensor{std::move(name), type, std::move(ne), n_bytes,
                                   std::vector<uint8_t>(bytes.begin(), bytes.end()), nullptr});
}

void Writer::add_tensor(std::string name, GgmlType type, std::vector<int64_t> ne,
                        Producer produce) {
  if (!produce) invalid(fmt::format("tensor '{}' has an empty producer", name));
  const uint64_t n_bytes = check_tensor(name, type, ne, tensor_names_);
  tensor_names_.insert(name);
  tensors_.push_back(
      PendingTensor{std::move(name), type, std::move(ne), n_bytes, {}, std::move(produce)});
}

uint64_t Writer::write_to(const std::function<void(const void*, size_t)>& sink, bool data) const {
  Out out(sink);
  bool has_alignment_key = false;
  for (const KeyValue& kv : kvs_) has_alignment_key = has_alignment_key || kv.key == kAlignmentKey;
  const bool auto_alignment = alignment_ != kDefaultAlignment && !has_alignment_key;

  // Header.
  out.bytes("GGUF", 4);
  out.scalar<uint32_t>(version_);
  out.scalar<uint64_t>(tensors_.size());
  out.scalar<uint64_t>(kvs_.size() + (auto_alignment ? 1 : 0));

  // Key/values in insertion order; the automatic alignment key last.
  for (const KeyValue& kv : kvs_) {
    out.string(kv.key);
    out.scalar<uint32_t>(static_cast<uint32_t>(kv.value.type()));
    write_value(out, kv.value);
  }
  if (auto_alignment) {
    out.string(kAlignmentKey);
    out.scalar<uint32_t>(static_cast<uint32_t>(ValueType::uint32));
    out.scalar<uint32_t>(static_cast<uint32_t>(alignment_));
  }

  // Tensor infos with offsets relative to the data section, each a multiple of the alignment.
  uint64_t offset = 0;
  for (const PendingTensor& t : tensors_) {
    out.string(t.name);
    out.scalar<uint32_t>(static_cast<uint32_t>(t.ne.size()));
    for (int64_t n : t.ne) out.scalar<uint64_t>(static_cast<uint64_t>(n));
    out.scalar<uint32_t>(static_cast<uint32_t>(t.type));
    out.scalar<uint64_t>(offset);
    offset = align_up(offset + t.n_bytes, alignment_);
  }
  out.pad_to(alignment_);
  if (!data) return out.written() + offset;

  // Tensor data, one tensor in memory at a time.
  std::vector<uint8_t> buf;
  for (const PendingTensor& t : tensors_) {
    if (t.produce) {
      buf.assign(static_cast<size_t>(t.n_bytes), 0);
      t.produce(std::span<uint8_t>(buf));
      out.bytes(buf.data(), buf.size());
    } else {
      out.bytes(t.bytes.data(), t.bytes.size());
    }
    out.pad_to(alignment_);
  }
  return out.written();
}

void Writer::write_sparse(const std::string& path) const {
  FileSink file(path);
  try {
    const uint64_t size = write_to([&](const void* p, size_t n) { file.put(p, n); }, false);
    file.close();
    if (::truncate(path.c_str(), static_cast<off_t>(size)) != 0)
      throw Error(ErrorCategory::io, fmt::format("{}: cannot extend to {} bytes: {}", path, size,
                                                 std::strerror(errno)));
  } catch (...) {
    ::unlink(path.c_str());
    throw;
  }
}

void Writer::write(const std::string& path) const {
  FileSink file(path);  // throws before anything exists to clean up
  try {
    write_to([&](const void* p, size_t n) { file.put(p, n); });
    file.close();
  } catch (...) {
    ::unlink(path.c_str());  // never leave a partial file that looks like a model
    throw;
  }
}

std::vector<uint8_t> Writer::to_bytes() const {
  std::vector<uint8_t> bytes;
  write_to([&](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    bytes.insert(bytes.end(), b, b + n);
  });
  return bytes;
}

}  // namespace berth::gguf
