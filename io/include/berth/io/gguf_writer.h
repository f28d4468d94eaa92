// GGUF writer (version 3 by default; version 2 on request). Used by tests, `berth quantize`
// and the synthetic-model generator. Tensor data may be given as bytes or produced by a
// callback at write time, so a multi-GB file is streamed to disk without being held in RAM.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <unordered_set>
#include <vector>

#include "berth/io/gguf.h"

namespace berth::gguf {

class Writer {
 public:
  /// Fills `dst` (exactly the tensor's n_bytes) with the tensor's data.
  using Producer = std::function<void(std::span<uint8_t> dst)>;

  /// Throws Error(invalid_argument) unless version is 2 or 3 and alignment a power of two that
  /// fits in uint32. An alignment other than 32 is recorded as `general.alignment` (uint32),
  /// written after the caller's keys unless the caller set it.
  explicit Writer(uint32_t version = 3, uint64_t alignment = 32);

  // Metadata, kept in insertion order. Setting an existing key replaces its value in place.
  // Throws Error(invalid_argument) for an empty key, or a `general.alignment` that is not the
  // uint32 alignment given to the constructor.
  void set(std::string key, Value value);
  void set_u32(std::string key, uint32_t v);
  void set_i32(std::string key, int32_t v);
  void set_u64(std::string key, uint64_t v);
  void set_f32(std::string key, float v);
  void set_bool(std::string key, bool v);
  void set_string(std::string key, std::string v);
  void set_string_array(std::string key, std::vector<std::string> v);
  void set_f32_array(std::string key, std::vector<float> v);
  void set_i32_array(std::string key, std::vector<int32_t> v);

  /// Adds a tensor with its bytes copied now. `ne` has 1..4 entries, ne[0] contiguous.
  /// Throws Error(invalid_argument) for a bad name (empty, >= 64 bytes, duplicate), shape or
  /// a byte count that does not match type and shape.
  void add_tensor(std::string name, GgmlType type, std::vector<int64_t> ne,
                  std::span<const uint8_t> bytes);
  /// Adds a tensor whose bytes `produce` writes when the file is written (called once per
  /// write() or to_bytes(), with a zero-filled buffer; only one tensor is in memory at a time).
  /// Throws Error(invalid_argument) as above, and for an empty `produce`.
  void add_tensor(std::string name, GgmlType type, std::vector<int64_t> ne, Producer produce);

  /// Writes the file (streaming tensor data through a 4 MiB buffer). Layout: header, keys,
  /// tensor infos, zero padding to the alignment, then each tensor at its aligned offset
  /// followed by zero padding to the alignment. Throws Error(io) naming the path on failure;
  /// a failed write (I/O or a producer's exception, rethrown) removes the partial file.
  void write(const std::string& path) const;
  /// Writes the file as write() lays it out, but only its header, keys and tensor infos: the
  /// tensor data (zeros; producers are not called) is left as a hole of the file (ftruncate),
  /// which takes no disk space on file systems with sparse files. For plans of model shapes
  /// larger than the disk. Throws Error(io) naming the path; a failure removes the file.
  void write_sparse(const std::string& path) const;
  /// The whole file as bytes (tests).
  std::vector<uint8_t> to_bytes() const;

 private:
  struct PendingTensor {
    std::string name;
    GgmlType type;
    std::vector<int64_t> ne;
    uint64_t n_bytes;
    std::vector<uint8_t> bytes;  // empty when produce is set
    Producer produce;
  };
  /// Writes through `sink`; with `data` false stops after the tensor infos' padding. Returns
  /// the file's full size, bytes.
  uint64_t write_to(const std::function<void(const void*, size_t)>& sink, bool data = true) const;

  uint32_t version_;
  uint64_t alignment_;
  std::vector<KeyValue> kvs_;
  std::vector<PendingTensor> tensors_;
  std::unordered_set<std::string> tensor_names_;  // of tensors_: a duplicate check in O(1)
};

}  // namespace berth::gguf
