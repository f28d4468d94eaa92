// A byte-level GGUF builder for tests: it writes whatever it is told, including wrong magics,
// versions, counts, lengths, type ids and offsets, so each malformed file can be crafted byte
// by byte. It shares no code with berth's writer, so it also checks the writer's layout.
// All fields are little-endian (gguf.md).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace berth::test {

/// GGUF value type ids (gguf.md `gguf_metadata_value_type`).
namespace gt {
inline constexpr uint32_t u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7,
                          str = 8, arr = 9, u64 = 10, i64 = 11, f64 = 12;
}  // namespace gt

/// ggml type ids used by the tests (ggml.h `enum ggml_type`).
namespace tt {
inline constexpr uint32_t F32 = 0, F16 = 1, Q4_0 = 2, Q8_0 = 8, Q4_K = 12, F64 = 28;
}  // namespace tt

class GgufBuilder {
 public:
  /// Bytes written so far; use it to remember where a field starts.
  size_t size() const { return bytes_.size(); }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

  GgufBuilder& raw(std::string_view s) {
    bytes_.insert(bytes_.end(), s.begin(), s.end());
    return *this;
  }
  GgufBuilder& raw(const std::vector<uint8_t>& b) {
    bytes_.insert(bytes_.end(), b.begin(), b.end());
    return *this;
  }
  GgufBuilder& zeros(size_t n) {
    bytes_.insert(bytes_.end(), n, 0);
    return *this;
  }
  GgufBuilder& u8(uint8_t v) { return put(v); }
  GgufBuilder& u16(uint16_t v) { return put(v); }
  GgufBuilder& u32(uint32_t v) { return put(v); }
  GgufBuilder& u64(uint64_t v) { return put(v); }
  GgufBuilder& i64(int64_t v) { return put(v); }
  GgufBuilder& f32(float v) { return put(v); }
  GgufBuilder& f64(double v) { return put(v); }

  /// A gguf_string_t: uint64 length then the bytes.
  GgufBuilder& str(std::string_view s) {
    u64(s.size());
    return raw(s);
  }
  /// A string whose length field says `len` whatever bytes follow.
  GgufBuilder& str_with_len(uint64_t len, std::string_view s) {
    u64(len);
    return raw(s);
  }

  /// The fixed header: magic, version, tensor count, metadata key/value count.
  GgufBuilder& header(uint32_t version, uint64_t n_tensors, uint64_t n_kv,
                      std::string_view magic = "GGUF") {
    raw(magic);
    u32(version);
    u64(n_tensors);
    return u64(n_kv);
  }

  /// A key and its value type id; the caller writes the value.
  GgufBuilder& key(std::string_view k, uint32_t type) {
    str(k);
    return u32(type);
  }
  GgufBuilder& kv_u32(std::string_view k, uint32_t v) { return key(k, gt::u32).u32(v); }
  GgufBuilder& kv_u64(std::string_view k, uint64_t v) { return key(k, gt::u64).u64(v); }
  GgufBuilder& kv_str(std::string_view k, std::string_view v) { return key(k, gt::str).str(v); }
  /// The head of an array value: key, type `arr`, element type and length.
  GgufBuilder& kv_array(std::string_view k, uint32_t elem_type, uint64_t n) {
    key(k, gt::arr);
    u32(elem_type);
    return u64(n);
  }

  /// A tensor info: name, n_dims, ne[], ggml type id, offset in the data section.
  GgufBuilder& tensor_info(std::string_view name, const std::vector<uint64_t>& ne, uint32_t type,
                           uint64_t offset) {
    str(name);
    u32(static_cast<uint32_t>(ne.size()));
    for (uint64_t n : ne) u64(n);
    u32(type);
    return u64(offset);
  }

  /// Zero bytes up to the next multiple of `alignment`.
  GgufBuilder& pad(size_t alignment) {
    while (bytes_.size() % alignment != 0) bytes_.push_back(0);
    return *this;
  }

  /// Overwrites 8 bytes at `pos` (e.g. to fix up a count).
  GgufBuilder& patch_u64(size_t pos, uint64_t v) {
    std::memcpy(bytes_.data() + pos, &v, sizeof(v));
    return *this;
  }

 private:
  template <class T>
  GgufBuilder& put(T v) {
    uint8_t b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));  // the test hosts are little-endian, as GGUF is
    bytes_.insert(bytes_.end(), b, b + sizeof(T));
    return *this;
  }

  std::vector<uint8_t> bytes_;
};

}  // namespace berth::test
