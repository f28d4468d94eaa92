// GGUF reader: parses and validates a GGUF file (versions 2 and 3, little-endian) and exposes
// its metadata and tensors in place, without copying tensor data.
//
// Format: ggml's docs/gguf.md (header: magic "GGUF", uint32 version, uint64 tensor_count,
// uint64 metadata_kv_count; then the key/values, the tensor infos, padding to
// `general.alignment` (default 32), and the tensor data section). Tensor offsets are relative
// to the start of the data section and must be multiples of the alignment.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "berth/core/error.h"
#include "berth/core/tensor.h"
#include "berth/core/types.h"

namespace berth::gguf {

/// GGUF metadata value types (gguf.md, `gguf_metadata_value_type`).
enum class ValueType : uint32_t {
  uint8 = 0,
  int8 = 1,
  uint16 = 2,
  int16 = 3,
  uint32 = 4,
  int32 = 5,
  float32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  uint64 = 10,
  int64 = 11,
  float64 = 12,
};

std::string_view value_type_name(ValueType t);

/// Exactly what is wrong with a file. Tests assert these; the message says it in words.
enum class Errc {
  open_failed,           ///< the file cannot be opened, stat'ed or mapped (category io)
  empty_file,            ///< zero bytes
  bad_magic,             ///< the first four bytes are not "GGUF"
  big_endian,            ///< version field byte-swapped: a big-endian GGUF file
  bad_version,           ///< version 0, 1 or above 3
  truncated,             ///< a field or string runs past the end of the file
  too_many_tensors,      ///< tensor_count larger than the file could hold
  too_many_kvs,          ///< metadata_kv_count larger than the file could hold
  string_too_long,       ///< a string length runs past the end of the file
  array_too_long,        ///< an array length runs past the end of the file
  empty_key,             ///< a metadata key of length 0
  duplicate_key,         ///< the same metadata key twice
  unknown_value_type,    ///< a metadata value type id outside 0..12
  nested_array,          ///< an array of arrays
  bad_alignment,         ///< general.alignment zero, not a power of two, or not uint32
  tensor_name_too_long,  ///< a tensor name of 64 bytes or more
  empty_tensor_name,     ///< a tensor name of length 0
  duplicate_tensor,      ///< the same tensor name twice
  too_many_dims,         ///< n_dims > 4
  bad_dims,              ///< a negative dimension (as int64) or an overflowing element count
  unknown_tensor_type,   ///< a type id ggml does not define
  bad_row_length,        ///< ne[0] not a multiple of the type's block size
  misaligned_tensor,     ///< offset not a multiple of general.alignment
  overlapping_tensors,   ///< two tensors' byte ranges overlap
  tensor_out_of_bounds,  ///< a tensor's bytes run past the end of the file (truncated download)
                         ///< or its byte count overflows uint64
  missing_key,           ///< a required key is absent (category missing)
  wrong_type,            ///< a key has another type than the caller needs
  missing_tensor,        ///< a required tensor is absent (category missing)
};

std::string_view errc_name(Errc e);

/// A malformed or unusable GGUF file. `what()` names the file, what is wrong, and where (key,
/// tensor, byte offset). category(): io for open_failed, missing for missing_key and
/// missing_tensor, format otherwise.
class GgufError : public Error {
 public:
  GgufError(Errc code, const std::string& message, std::optional<uint64_t> offset = std::nullopt);
  Errc code() const noexcept { return code_; }
  /// Byte offset in the file where the problem was found, when there is one.
  std::optional<uint64_t> offset() const noexcept { return offset_; }

 private:
  Errc code_;
  std::optional<uint64_t> offset_;
};

/// One metadata value. Arrays hold elements of a single non-array type.
struct Value {
  using Array = std::variant<std::vector<uint8_t>, std::vector<int8_t>, std::vector<uint16_t>,
                             std::vector<int16_t>, std::vector<uint32_t>, std::vector<int32_t>,
                             std::vector<float>, std::vector<bool>, std::vector<std::string>,
                             std::vector<uint64_t>, std::vector<int64_t>, std::vector<double>>;
  using Storage = std::variant<uint8_t, int8_t, uint16_t, int16_t, uint32_t, int32_t, float, bool,
                               std::string, Array, uint64_t, int64_t, double>;
  Storage v;  ///< variant index == static_cast<size_t>(type())

  ValueType type() const { return static_cast<ValueType>(v.index()); }
  /// Element type of an array; throws Error(internal) when this is not an array.
  ValueType array_type() const;
  /// Number of elements of an array; throws Error(internal) when this is not an array.
  size_t array_size() const;
  /// Short human-readable rendering (arrays show their type, length and first elements).
  std::string to_string(size_t max_array_items = 8) const;
};

struct KeyValue {
  std::string key;
  Value value;
};

/// A tensor as described by its tensor info, with its data located in the mapping.
struct TensorInfo {
  std::string name;
  GgmlType type = GgmlType::F32;
  uint32_t n_dims = 0;                    ///< 0..4 as stored; 0 is a scalar (one element)
  std::array<int64_t, 4> ne{1, 1, 1, 1};  ///< ne[0] contiguous; unused axes are 1
  uint64_t offset = 0;                    ///< relative to the data section, as stored
  uint64_t n_bytes = 0;                   ///< bytes its type and shape need
  const uint8_t* data = nullptr;          ///< points into the file's bytes

  int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
  TensorView view() const;
};

/// A parsed, validated GGUF file. Holds the mapping (or the in-memory bytes) alive; tensor data
/// pointers stay valid as long as the File lives. Move-only.
///
/// Validation (each failure is a GgufError with its Errc, the file name, what and the byte
/// offset of the offending field): magic, version 2 or 3 (a byte-swapped 1..3 is big_endian),
/// tensor and key counts bounded by the bytes left (a KV takes >= 14 bytes, a tensor info >= 25),
/// every string/array length checked against the bytes left before it is allocated, keys
/// non-empty and unique, value type ids 0..12, no arrays of arrays, `general.alignment` a uint32
/// power of two; tensor names 1..63 bytes and unique, n_dims <= 4, no negative dims, element
/// count within int64, a known ggml type, ne[0] a multiple of the block size; offsets multiples
/// of the alignment, non-empty byte ranges disjoint and inside the file. The data section starts
/// at the end of the tensor infos rounded up to the alignment; the file may end right after the
/// last tensor's bytes (no trailing padding). A tensor with a zero dimension has 0 bytes.
class File {
 public:
  /// Maps and parses `path`. Throws GgufError (see Errc) for every malformed input; never
  /// allocates memory sized by a field before checking it against the file's size.
  static File open(const std::string& path);
  /// Parses bytes already in memory (tests). `name` stands in for the path in messages.
  static File from_memory(std::vector<uint8_t> bytes, std::string name = "<memory>");

  File(File&&) noexcept;
  File& operator=(File&&) noexcept;
  ~File();

  const std::string& path() const;
  uint32_t version() const;
  uint64_t alignment() const;  ///< general.alignment or 32
  /// Absolute offset of the data section (end of the tensor infos rounded up to alignment()).
  /// May exceed file_size() only in a file without tensors.
  uint64_t data_offset() const;
  uint64_t file_size() const;

  const std::vector<KeyValue>& kvs() const;  ///< in file order
  const Value* find(std::string_view key) const;
  bool has(std::string_view key) const { return find(key) != nullptr; }

  // Typed getters. Missing key -> GgufError(missing_key); other type -> GgufError(wrong_type);
  // both messages name the key and the file.
  /// Any integer type (and bool); throws wrong_type if the value does not fit in int64.
  int64_t get_int(std::string_view key) const;
  /// float32 or float64 (integers are accepted too).
  double get_float(std::string_view key) const;
  bool get_bool(std::string_view key) const;
  const std::string& get_string(std::string_view key) const;
  const std::vector<std::string>& get_string_array(std::string_view key) const;
  /// An array of float32 (or float64, converted).
  std::vector<float> get_float_array(std::string_view key) const;
  /// An array of any integer type, converted.
  std::vector<int64_t> get_int_array(std::string_view key) const;

  std::optional<int64_t> get_int_opt(std::string_view key) const;
  std::optional<double> get_float_opt(std::string_view key) const;
  std::optional<std::string> get_string_opt(std::string_view key) const;

  const std::vector<TensorInfo>& tensors() const;  ///< in file order
  const TensorInfo* find_tensor(std::string_view name) const;
  /// Throws GgufError(missing_tensor) naming the tensor and file.
  const TensorInfo& tensor(std::string_view name) const;

  /// `general.architecture`, or throws missing_key.
  const std::string& architecture() const { return get_string("general.architecture"); }

 private:
  struct Impl;
  explicit File(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace berth::gguf
