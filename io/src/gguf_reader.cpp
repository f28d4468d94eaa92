// GGUF reader: parsing and validation. Format facts from ggml's docs/gguf.md; every count and
// length read from the file is checked against the bytes that remain before anything is
// allocated from it, so a malformed file ends in a GgufError, never in a crash or a huge
// allocation.
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <type_traits>
#include <utility>

#include "berth/core/strings.h"
#include "berth/io/gguf.h"
#include "berth/io/mapped_file.h"

namespace berth::gguf {

static_assert(std::endian::native == std::endian::little,
              "the GGUF reader decodes little-endian fields by memcpy");

namespace {

constexpr uint64_t kDefaultAlignment = 32;
// ggml's GGML_MAX_NAME (64) counts the terminating NUL: names have at most 63 bytes.
constexpr size_t kMaxTensorNameBytes = 63;
constexpr uint32_t kMaxDims = 4;
constexpr uint32_t kLastValueType = static_cast<uint32_t>(ValueType::float64);
// Smallest possible encodings, used to bound counts by the bytes that remain:
// a KV is a non-empty key (8-byte length + 1 byte), a 4-byte type and a value of >= 1 byte;
// a tensor info is a non-empty name (8 + 1), n_dims (4), type (4) and offset (8), with 0 dims.
constexpr uint64_t kMinKvBytes = 8 + 1 + 4 + 1;
constexpr uint64_t kMinTensorInfoBytes = 8 + 1 + 4 + 4 + 8;

ErrorCategory category_of(Errc e) {
  switch (e) {
    case Errc::open_failed:
      return ErrorCategory::io;
    case Errc::missing_key:
    case Errc::missing_tensor:
      return ErrorCategory::missing;
    default:
      return ErrorCategory::format;
  }
}

// Smallest number of bytes one value of type `t` occupies in a file.
uint64_t min_value_bytes(ValueType t) {
  switch (t) {
    case ValueType::uint8:
    case ValueType::int8:
    case ValueType::boolean:
      return 1;
    case ValueType::uint16:
    case ValueType::int16:
      return 2;
    case ValueType::uint32:
    case ValueType::int32:
    case ValueType::float32:
      return 4;
    case ValueType::uint64:
    case ValueType::int64:
    case ValueType::float64:
    case ValueType::string:
      return 8;  // the length; the bytes may be none
    case ValueType::array:
      return 4 + 8;
  }
  return 1;
}

// Escapes a string value for to_string: backslash and quote escaped, then core's printable()
// (valid UTF-8 kept; control bytes and bytes that are not UTF-8 as \xNN; never cut).
std::string escape_value(std::string_view s) {
  std::string quoted;
  quoted.reserve(s.size() + 2);
  for (char ch : s) {
    if (ch == '\\' || ch == '\'') quoted += '\\';
    quoted += ch;
  }
  return printable(quoted, std::string::npos);
}

// Sequential little-endian reader over the file's bytes. Every read checks the bytes left;
// descriptions of what is read are built lazily (only on error).
class Parser {
 public:
  Parser(const uint8_t* data, size_t size, const std::string& path)
      : data_(data), size_(size), path_(path) {}

  size_t pos() const { return pos_; }
  size_t left() const { return size_ - pos_; }
  const std::string& path() const { return path_; }

  [[noreturn]] void fail(Errc code, uint64_t at, const std::string& what) const {
    throw GgufError(code, fmt::format("{}: {} (at byte {})", path_, what, at), at);
  }

  template <class T, class Describe>
  T scalar(Describe&& what) {
    static_assert(std::is_trivially_copyable_v<T>);
    if (left() < sizeof(T))
      fail(Errc::truncated, pos_,
           fmt::format("file ends inside {}: {} bytes needed, {} left", what(), sizeof(T), left()));
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  template <class Describe>
  std::string string(Describe&& what) {
    const size_t at = pos_;
    const auto n = scalar<uint64_t>([&] { return fmt::format("the length of {}", what()); });
    if (n > left())
      fail(Errc::string_too_long, at,
           fmt::format("{} has length {} but only {} bytes remain", what(), n, left()));
    std::string s(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return s;
  }

  // Copies `n` plain values (already checked to fit).
  template <class T>
  std::vector<T> plain_array(uint64_t n) {
    std::vector<T> v(static_cast<size_t>(n));
    if (n > 0) std::memcpy(v.data(), data_ + pos_, static_cast<size_t>(n) * sizeof(T));
    pos_ += static_cast<size_t>(n) * sizeof(T);
    return v;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& path_;
};

template <class T>
Value::Storage read_scalar_as(Parser& p, const std::string& key) {
  return p.scalar<T>([&] { return fmt::format("the value of key '{}'", printable(key)); });
}

Value::Array read_array(Parser& p, const std::string& key) {
  const size_t at = p.pos();
  const auto et_raw = p.scalar<uint32_t>(
      [&] { return fmt::format("the element type of key '{}'", printable(key)); });
  if (et_raw == static_cast<uint32_t>(ValueType::array))
    p.fail(
        Errc::nested_array, at,
        fmt::format("key '{}' is an array of arrays, which GGUF does not allow", printable(key)));
  if (et_raw > kLastValueType)
    p.fail(Errc::unknown_value_type, at,
           fmt::format("key '{}' is an array of unknown value type id {}", printable(key), et_raw));
  const auto et = static_cast<ValueType>(et_raw);
  const size_t at_n = p.pos();
  const auto n =
      p.scalar<uint64_t>([&] { return fmt::format("the length of array '{}'", printable(key)); });
  const uint64_t min_bytes = min_value_bytes(et);
  if (n > p.left() / min_bytes)
    p.fail(Errc::array_too_long, at_n,
           fmt::format("array '{}' of {} {} elements needs at least {} bytes per element but "
                       "only {} bytes remain",
                       printable(key), n, value_type_name(et), min_bytes, p.left()));
  switch (et) {
    case ValueType::uint8:
      return p.plain_array<uint8_t>(n);
    case ValueType::int8:
      return p.plain_array<int8_t>(n);
    case ValueType::uint16:
      return p.plain_array<uint16_t>(n);
    case ValueType::int16:
      return p.plain_array<int16_t>(n);
    case ValueType::uint32:
      return p.plain_array<uint32_t>(n);
    case ValueType::int32:
      return p.plain_array<int32_t>(n);
    case ValueType::float32:
      return p.plain_array<float>(n);
    case ValueType::uint64:
      return p.plain_array<uint64_t>(n);
    case ValueType::int64:
      return p.plain_array<int64_t>(n);
    case ValueType::float64:
      return p.plain_array<double>(n);
    case ValueType::boolean: {
      std::vector<bool> v(static_cast<size_t>(n));
      for (size_t i = 0; i < v.size(); ++i) v[i] = p.scalar<uint8_t>([] { return ""; }) != 0;
      return v;
    }
    case ValueType::string: {
      std::vector<std::string> v;
      v.reserve(static_cast<size_t>(n));  // n * 8 bytes fit in the file
      for (uint64_t i = 0; i < n; ++i)
        v.push_back(p.string(
            [&] { return fmt::format("element {} of string array '{}'", i, printable(key)); }));
      return v;
    }
    case ValueType::array:
      break;  // rejected above
  }
  p.fail(Errc::unknown_value_type, at, "unreachable element type");
}

Value read_value(Parser& p, ValueType t, const std::string& key) {
  switch (t) {
    case ValueType::uint8:
      return Value{read_scalar_as<uint8_t>(p, key)};
    case ValueType::int8:
      return Value{read_scalar_as<int8_t>(p, key)};
    case ValueType::uint16:
      return Value{read_scalar_as<uint16_t>(p, key)};
    case ValueType::int16:
      return Value{read_scalar_as<int16_t>(p, key)};
    case ValueType::uint32:
      return Value{read_scalar_as<uint32_t>(p, key)};
    case ValueType::int32:
      return Value{read_scalar_as<int32_t>(p, key)};
    case ValueType::float32:
      return Value{read_scalar_as<float>(p, key)};
    case ValueType::uint64:
      return Value{read_scalar_as<uint64_t>(p, key)};
    case ValueType::int64:
      return Value{read_scalar_as<int64_t>(p, key)};
    case ValueType::float64:
      return Value{read_scalar_as<double>(p, key)};
    case ValueType::boolean:
      return Value{p.scalar<uint8_t>(
                       [&] { return fmt::format("the value of key '{}'", printable(key)); }) != 0};
    case ValueType::string:
      return Value{p.string([&] { return fmt::format("the value of key '{}'", printable(key)); })};
    case ValueType::array:
      return Value{read_array(p, key)};
  }
  return Value{};
}

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// Index of a variant alternative -> element ValueType of an Array (the Array variant has no
// `array` alternative, so indices from 9 on are shifted by one).
ValueType array_index_to_type(size_t index) {
  return static_cast<ValueType>(index < 9 ? index : index + 1);
}

template <class T>
std::string scalar_to_string(const T& x) {
  if constexpr (std::is_same_v<T, bool>) {
    return x ? "true" : "false";
  } else if constexpr (std::is_same_v<T, std::string>) {
    return fmt::format("'{}'", escape_value(x));
  } else if constexpr (std::is_same_v<T, int8_t> || std::is_same_v<T, uint8_t>) {
    return fmt::format("{}", static_cast<int>(x));
  } else {
    return fmt::format("{}", x);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Names and errors

std::string_view value_type_name(ValueType t) {
  switch (t) {
    case ValueType::uint8:
      return "uint8";
    case ValueType::int8:
      return "int8";
    case ValueType::uint16:
      return "uint16";
    case ValueType::int16:
      return "int16";
    case ValueType::uint32:
      return "uint32";
    case ValueType::int32:
      return "int32";
    case ValueType::float32:
      return "float32";
    case ValueType::boolean:
      return "bool";
    case ValueType::string:
      return "string";
    case ValueType::array:
      return "array";
    case ValueType::uint64:
      return "uint64";
    case ValueType::int64:
      return "int64";
    case ValueType::float64:
      return "float64";
  }
  return "unknown";
}

std::string_view errc_name(Errc e) {
  switch (e) {
    case Errc::open_failed:
      return "open_failed";
    case Errc::empty_file:
      return "empty_file";
    case Errc::bad_magic:
      return "bad_magic";
    case Errc::big_endian:
      return "big_endian";
    case Errc::bad_version:
      return "bad_version";
    case Errc::truncated:
      return "truncated";
    case Errc::too_many_tensors:
      return "too_many_tensors";
    case Errc::too_many_kvs:
      return "too_many_kvs";
    case Errc::string_too_long:
      return "string_too_long";
    case Errc::array_too_long:
      return "array_too_long";
    case Errc::empty_key:
      return "empty_key";
    case Errc::duplicate_key:
      return "duplicate_key";
    case Errc::unknown_value_type:
      return "unknown_value_type";
    case Errc::nested_array:
      return "nested_array";
    case Errc::bad_alignment:
      return "bad_alignment";
    case Errc::tensor_name_too_long:
      return "tensor_name_too_long";
    case Errc::empty_tensor_name:
      return "empty_tensor_name";
    case Errc::duplicate_tensor:
      return "duplicate_tensor";
    case Errc::too_many_dims:
      return "too_many_dims";
    case Errc::bad_dims:
      return "bad_dims";
    case Errc::unknown_tensor_type:
      return "unknown_tensor_type";
    case Errc::bad_row_length:
      return "bad_row_length";
    case Errc::misaligned_tensor:
      return "misaligned_tensor";
    case Errc::overlapping_tensors:
      return "overlapping_tensors";
    case Errc::tensor_out_of_bounds:
      return "tensor_out_of_bounds";
    case Errc::missing_key:
      return "missing_key";
    case Errc::wrong_type:
      return "wrong_type";
    case Errc::missing_tensor:
      return "missing_tensor";
  }
  return "unknown";
}

GgufError::GgufError(Errc code, const std::string& message, std::optional<uint64_t> offset)
    : Error(category_of(code), message), code_(code), offset_(offset) {}

// ---------------------------------------------------------------------------------------------
// Value

ValueType Value::array_type() const {
  const auto* a = std::get_if<Array>(&v);
  BERTH_CHECK(a != nullptr, fmt::format("array_type() of a {} value", value_type_name(type())));
  return array_index_to_type(a->index());
}

size_t Value::array_size() const {
  const auto* a = std::get_if<Array>(&v);
  BERTH_CHECK(a != nullptr, fmt::format("array_size() of a {} value", value_type_name(type())));
  return std::visit([](const auto& vec) { return vec.size(); }, *a);
}

std::string Value::to_string(size_t max_array_items) const {
  return std::visit(
      [&](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, Array>) {
          return std::visit(
              [&](const auto& vec) {
                std::string out = fmt::format(
                    "[{} x {}] [", value_type_name(array_index_to_type(x.index())), vec.size());
                const size_t shown = std::min(vec.size(), max_array_items);
                for (size_t i = 0; i < shown; ++i) {
                  if (i > 0) out += ", ";
                  using E = typename std::decay_t<decltype(vec)>::value_type;
                  out += scalar_to_string(static_cast<E>(vec[i]));
                }
                if (shown < vec.size()) out += shown > 0 ? ", ..." : "...";
                out += "]";
                return out;
              },
              x);
        } else {
          return scalar_to_string(x);
        }
      },
      v);
}

// ---------------------------------------------------------------------------------------------
// TensorInfo

TensorView TensorInfo::view() const {
  TensorView t;
  t.name = name;
  t.type = type;
  t.ne = ne;
  t.n_dims = static_cast<int>(n_dims);
  t.data = data;
  t.n_bytes = static_cast<size_t>(n_bytes);
  return t;
}

// ---------------------------------------------------------------------------------------------
// File

struct File::Impl {
  std::string path;
  std::optional<io::MappedFile> map;
  std::vector<uint8_t> mem;
  const uint8_t* base = nullptr;
  size_t size = 0;

  uint32_t version = 0;
  uint64_t alignment = kDefaultAlignment;
  uint64_t data_offset = 0;
  std::vector<KeyValue> kvs;
  std::map<std::string, size_t, std::less<>> kv_index;
  std::vector<uint64_t> kv_at;  // byte offset of each key/value entry
  std::vector<TensorInfo> tensors;
  std::vector<uint64_t> tensor_at;  // byte offset of each tensor info
  std::map<std::string, size_t, std::less<>> tensor_index;

  void parse();
  void parse_header(Parser& p, uint64_t& n_tensors, uint64_t& n_kv);
  void parse_kvs(Parser& p, uint64_t n_kv);
  void parse_alignment(Parser& p);
  void parse_tensor_infos(Parser& p, uint64_t n_tensors);
  void check_tensor_ranges(Parser& p);

  const Value& require(std::string_view key) const;
  [[noreturn]] void wrong_type(std::string_view key, const Value& v,
                               std::string_view expected) const;
};

void File::Impl::parse_header(Parser& p, uint64_t& n_tensors, uint64_t& n_kv) {
  static constexpr uint8_t kMagic[4] = {'G', 'G', 'U', 'F'};
  const size_t n_magic = std::min<size_t>(size, 4);
  if (std::memcmp(base, kMagic, n_magic) != 0)
    p.fail(Errc::bad_magic, 0,
           fmt::format("not a GGUF file: the first bytes are '{}', expected 'GGUF'",
                       printable(std::string_view(reinterpret_cast<const char*>(base), n_magic))));
  if (size < 4)
    p.fail(Errc::truncated, 0, fmt::format("file ends inside the magic ({} bytes)", size));
  p.scalar<uint32_t>([] { return "the magic"; });

  const size_t at_version = p.pos();
  version = p.scalar<uint32_t>([] { return "the version field"; });
  if (version != 2 && version != 3) {
    const uint32_t swapped = __builtin_bswap32(version);
    if (swapped >= 1 && swapped <= 3)
      p.fail(Errc::big_endian, at_version,
             fmt::format("big-endian GGUF file (version field reads {} byte-swapped); only "
                         "little-endian files are supported",
                         swapped));
    p.fail(Errc::bad_version, at_version,
           fmt::format("unsupported GGUF version {}; versions 2 and 3 are supported", version));
  }

  const size_t at_tensors = p.pos();
  n_tensors = p.scalar<uint64_t>([] { return "the tensor count"; });
  const size_t at_kvs = p.pos();
  n_kv = p.scalar<uint64_t>([] { return "the metadata key/value count"; });
  if (n_tensors > p.left() / kMinTensorInfoBytes)
    p.fail(Errc::too_many_tensors, at_tensors,
           fmt::format("tensor count {} cannot fit in the {} bytes after the header (a tensor "
                       "info takes at least {} bytes)",
                       n_tensors, p.left(), kMinTensorInfoBytes));
  if (n_kv > p.left() / kMinKvBytes)
    p.fail(Errc::too_many_kvs, at_kvs,
           fmt::format("metadata key/value count {} cannot fit in the {} bytes after the header "
                       "(a key/value takes at least {} bytes)",
                       n_kv, p.left(), kMinKvBytes));
}

void File::Impl::parse_kvs(Parser& p, uint64_t n_kv) {
  kvs.reserve(static_cast<size_t>(n_kv));  // bounded by the file size above
  for (uint64_t i = 0; i < n_kv; ++i) {
    const size_t at = p.pos();
    std::string key = p.string([&] { return fmt::format("the key of metadata entry #{}", i); });
    if (key.empty())
      p.fail(Errc::empty_key, at, fmt::format("metadata entry #{} has an empty key", i));
    if (auto it = kv_index.find(key); it != kv_index.end())
      p.fail(Errc::duplicate_key, at,
             fmt::format("duplicate key '{}' in metadata entry #{} (first in entry #{})",
                         printable(key), i, it->second));
    const size_t at_type = p.pos();
    const auto type_id = p.scalar<uint32_t>(
        [&] { return fmt::format("the value type of key '{}'", printable(key)); });
    if (type_id > kLastValueType)
      p.fail(Errc::unknown_value_type, at_type,
             fmt::format("key '{}' has unknown value type id {}", printable(key), type_id));
    Value value = read_value(p, static_cast<ValueType>(type_id), key);
    kv_index.emplace(key, kvs.size());
    kv_at.push_back(at);
    kvs.push_back(KeyValue{std::move(key), std::move(value)});
  }
}

void File::Impl::parse_alignment(Parser& p) {
  auto it = kv_index.find("general.alignment");
  if (it == kv_index.end()) return;
  const Value& v = kvs[it->second].value;
  const uint64_t at = kv_at[it->second];
  if (v.type() != ValueType::uint32)
    p.fail(Errc::bad_alignment, at,
           fmt::format("key 'general.alignment' has type {}, expected uint32",
                       value_type_name(v.type())));
  const uint32_t a = std::get<uint32_t>(v.v);
  if (a == 0 || !std::has_single_bit(a))
    p.fail(Errc::bad_alignment, at,
           fmt::format("key 'general.alignment' is {}, expected a non-zero power of two", a));
  alignment = a;
}

void File::Impl::parse_tensor_infos(Parser& p, uint64_t n_tensors) {
  if (n_tensors > p.left() / kMinTensorInfoBytes)
    p.fail(Errc::too_many_tensors, p.pos(),
           fmt::format("tensor count {} cannot fit in the {} bytes after the metadata (a tensor "
                       "info takes at least {} bytes)",
                       n_tensors, p.left(), kMinTensorInfoBytes));
  tensors.reserve(static_cast<size_t>(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    const size_t at = p.pos();
    TensorInfo t;
    t.name = p.string([&] { return fmt::format("the name of tensor info #{}", i); });
    const std::string pname = printable(t.name);
    if (t.name.empty())
      p.fail(Errc::empty_tensor_name, at, fmt::format("tensor info #{} has an empty name", i));
    if (t.name.size() > kMaxTensorNameBytes)
      p.fail(Errc::tensor_name_too_long, at,
             fmt::format("tensor info #{} has a name of {} bytes ('{}'); at most {} are allowed", i,
                         t.name.size(), pname, kMaxTensorNameBytes));
    if (auto it = tensor_index.find(t.name); it != tensor_index.end())
      p.fail(Errc::duplicate_tensor, at,
             fmt::format("duplicate tensor '{}' in tensor info #{} (first in tensor info #{})",
                         pname, i, it->second));

    const size_t at_dims = p.pos();
    t.n_dims = p.scalar<uint32_t>([&] { return fmt::format("n_dims of tensor '{}'", pname); });
    if (t.n_dims > kMaxDims)
      p.fail(Errc::too_many_dims, at_dims,
             fmt::format("tensor '{}' has {} dimensions; at most {} are allowed", pname, t.n_dims,
                         kMaxDims));
    bool has_zero = false;
    for (uint32_t d = 0; d < t.n_dims; ++d) {
      const size_t at_d = p.pos();
      const auto raw =
          p.scalar<uint64_t>([&] { return fmt::format("ne[{}] of tensor '{}'", d, pname); });
      const auto ne = static_cast<int64_t>(raw);
      if (ne < 0)
        p.fail(Errc::bad_dims, at_d,
               fmt::format("tensor '{}' has a negative dimension ne[{}] = {}", pname, d, ne));
      t.ne[d] = ne;
      has_zero = has_zero || ne == 0;
    }
    if (!has_zero) {
      int64_t count = 1;
      for (int64_t ne : t.ne)
        if (__builtin_mul_overflow(count, ne, &count))
          p.fail(Errc::bad_dims, at_dims,
                 fmt::format("tensor '{}' of shape [{}] has more elements than int64 can count",
                             pname, fmt::join(t.ne.begin(), t.ne.begin() + t.n_dims, ", ")));
    }

    const size_t at_type = p.pos();
    const auto type_id =
        p.scalar<uint32_t>([&] { return fmt::format("the type of tensor '{}'", pname); });
    const TypeTraits* tr = find_type(type_id);
    if (tr == nullptr)
      p.fail(Errc::unknown_tensor_type, at_type,
             fmt::format("tensor '{}' has unknown ggml type id {}", pname, type_id));
    t.type = tr->type;
    if (t.ne[0] % tr->block_size != 0)
      p.fail(Errc::bad_row_length, at_dims + 4,  // ne[0]
             fmt::format("tensor '{}' of type {} has a row length ne[0] = {} that is not a "
                         "multiple of the block size {}",
                         pname, tr->name, t.ne[0], tr->block_size));
    t.offset = p.scalar<uint64_t>([&] { return fmt::format("the offset of tensor '{}'", pname); });

    if (!has_zero) {
      const auto blocks_per_row = static_cast<uint64_t>(t.ne[0] / tr->block_size);
      const auto n_rows = static_cast<uint64_t>(t.ne[1] * t.ne[2] * t.ne[3]);  // fits: see above
      uint64_t bytes = 0;
      if (__builtin_mul_overflow(blocks_per_row, static_cast<uint64_t>(tr->block_bytes), &bytes) ||
          __builtin_mul_overflow(bytes, n_rows, &bytes))
        p.fail(Errc::tensor_out_of_bounds, at,
               fmt::format("tensor '{}' of type {} needs more than 2^64 bytes", pname, tr->name));
      t.n_bytes = bytes;
    }
    tensor_index.emplace(t.name, tensors.size());
    tensor_at.push_back(at);
    tensors.push_back(std::move(t));
  }
}

void File::Impl::check_tensor_ranges(Parser& p) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    TensorInfo& t = tensors[i];
    if (t.offset % alignment != 0)
      p.fail(Errc::misaligned_tensor, tensor_at[i],
             fmt::format("tensor '{}' has data offset {}, not a multiple of the alignment {}",
                         printable(t.name), t.offset, alignment));
    const uint64_t room = data_offset <= size ? size - data_offset : 0;
    if (data_offset > size || t.offset > room || t.n_bytes > room - t.offset)
      p.fail(Errc::tensor_out_of_bounds, tensor_at[i],
             fmt::format("tensor '{}' ({}, {} bytes at data offset {}) runs past the end of the "
                         "file ({} bytes, data section from byte {}); truncated file?",
                         printable(t.name), type_name(t.type), t.n_bytes, t.offset, size,
                         data_offset));
    t.data = base + data_offset + t.offset;
  }
  // Overlaps between non-empty byte ranges, in offset order.
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::pair(tensors[a].offset, tensors[a].n_bytes) <
           std::pair(tensors[b].offset, tensors[b].n_bytes);
  });
  const TensorInfo* prev = nullptr;
  for (size_t i : order) {
    const TensorInfo& t = tensors[i];
    if (t.n_bytes == 0) continue;
    if (prev != nullptr && t.offset < prev->offset + prev->n_bytes)
      p.fail(Errc::overlapping_tensors, tensor_at[i],
             fmt::format("tensor '{}' (data bytes {}..{}) overlaps tensor '{}' (data bytes "
                         "{}..{})",
                         printable(t.name), t.offset, t.offset + t.n_bytes, printable(prev->name),
                         prev->offset, prev->offset + prev->n_bytes));
    prev = &t;
  }
}

void File::Impl::parse() {
  Parser p(base, size, path);
  if (size == 0) throw GgufError(Errc::empty_file, fmt::format("{}: empty file (0 bytes)", path));
  uint64_t n_tensors = 0, n_kv = 0;
  parse_header(p, n_tensors, n_kv);
  parse_kvs(p, n_kv);
  parse_alignment(p);
  parse_tensor_infos(p, n_tensors);
  data_offset = align_up(p.pos(), alignment);
  check_tensor_ranges(p);
}

const Value& File::Impl::require(std::string_view key) const {
  auto it = kv_index.find(key);
  if (it == kv_index.end())
    throw GgufError(Errc::missing_key,
                    fmt::format("{}: missing metadata key '{}'", path, printable(key)));
  return kvs[it->second].value;
}

void File::Impl::wrong_type(std::string_view key, const Value& v, std::string_view expected) const {
  std::string actual(value_type_name(v.type()));
  if (v.type() == ValueType::array)
    actual = fmt::format("array of {}", value_type_name(v.array_type()));
  throw GgufError(Errc::wrong_type,
                  fmt::format("{}: metadata key '{}' has type {} (value {}), expected {}", path,
                              printable(key), actual, v.to_string(4), expected));
}

File::File(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
File::File(File&&) noexcept = default;
File& File::operator=(File&&) noexcept = default;
File::~File() = default;

File File::open(const std::string& path) {
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  try {
    impl->map.emplace(path);
  } catch (const GgufError&) {
    throw;
  } catch (const Error& e) {
    throw GgufError(Errc::open_failed, e.what());
  }
  impl->base = impl->map->data();
  impl->size = impl->map->size();
  impl->parse();
  return File(std::move(impl));
}

File File::from_memory(std::vector<uint8_t> bytes, std::string name) {
  auto impl = std::make_unique<Impl>();
  impl->path = std::move(name);
  impl->mem = std::move(bytes);
  impl->base = impl->mem.data();
  impl->size = impl->mem.size();
  impl->parse();
  return File(std::move(impl));
}

const std::string& File::path() const { return impl_->path; }
uint32_t File::version() const { return impl_->version; }
uint64_t File::alignment() const { return impl_->alignment; }
uint64_t File::data_offset() const { return impl_->data_offset; }
uint64_t File::file_size() const { return impl_->size; }
const std::vector<KeyValue>& File::kvs() const { return impl_->kvs; }

const Value* File::find(std::string_view key) const {
  auto it = impl_->kv_index.find(key);
  return it == impl_->kv_index.end() ? nullptr : &impl_->kvs[it->second].value;
}

namespace {

// The value of an integer (or bool) scalar as int64, or nullopt (other type, or too large).
std::optional<int64_t> as_int(const Value& v) {
  return std::visit(
      [](const auto& x) -> std::optional<int64_t> {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, bool>) {
          return x ? 1 : 0;
        } else if constexpr (std::is_same_v<T, uint64_t>) {
          if (x > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
          return static_cast<int64_t>(x);
        } else if constexpr (std::is_integral_v<T>) {
          return static_cast<int64_t>(x);
        } else {
          return std::nullopt;
        }
      },
      v.v);
}

std::optional<double> as_float(const Value& v) {
  return std::visit(
      [](const auto& x) -> std::optional<double> {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, bool>) {
          return std::nullopt;
        } else if constexpr (std::is_arithmetic_v<T>) {
          return static_cast<double>(x);
        } else {
          return std::nullopt;
        }
      },
      v.v);
}

}  // namespace

int64_t File::get_int(std::string_view key) const {
  const Value& v = impl_->require(key);
  auto r = as_int(v);
  if (!r) impl_->wrong_type(key, v, "an integer that fits in int64");
  return *r;
}

double File::get_float(std::string_view key) const {
  const Value& v = impl_->require(key);
  auto r = as_float(v);
  if (!r) impl_->wrong_type(key, v, "a number");
  return *r;
}

bool File::get_bool(std::string_view key) const {
  const Value& v = impl_->require(key);
  if (const bool* b = std::get_if<bool>(&v.v)) return *b;
  impl_->wrong_type(key, v, "bool");
}

const std::string& File::get_string(std::string_view key) const {
  const Value& v = impl_->require(key);
  if (const auto* s = std::get_if<std::string>(&v.v)) return *s;
  impl_->wrong_type(key, v, "string");
}

const std::vector<std::string>& File::get_string_array(std::string_view key) const {
  const Value& v = impl_->require(key);
  if (const auto* a = std::get_if<Value::Array>(&v.v))
    if (const auto* s = std::get_if<std::vector<std::string>>(a)) return *s;
  impl_->wrong_type(key, v, "array of string");
}

std::vector<float> File::get_float_array(std::string_view key) const {
  const Value& v = impl_->require(key);
  if (const auto* a = std::get_if<Value::Array>(&v.v)) {
    if (const auto* f = std::get_if<std::vector<float>>(a)) return *f;
    if (const auto* d = std::get_if<std::vector<double>>(a))
      return std::vector<float>(d->begin(), d->end());
  }
  impl_->wrong_type(key, v, "array of float32 or float64");
}

std::vector<int64_t> File::get_int_array(std::string_view key) const {
  const Value& v = impl_->require(key);
  if (const auto* a = std::get_if<Value::Array>(&v.v)) {
    std::optional<std::vector<int64_t>> out = std::visit(
        [](const auto& vec) -> std::optional<std::vector<int64_t>> {
          using E = typename std::decay_t<decltype(vec)>::value_type;
          if constexpr (std::is_integral_v<E> && !std::is_same_v<E, bool>) {
            std::vector<int64_t> r;
            r.reserve(vec.size());
            for (E x : vec) {
              if constexpr (std::is_same_v<E, uint64_t>)
                if (x > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
                  return std::nullopt;
              r.push_back(static_cast<int64_t>(x));
            }
            return r;
          } else {
            return std::nullopt;
          }
        },
        *a);
    if (out) return std::move(*out);
  }
  impl_->wrong_type(key, v, "array of integers that fit in int64");
}

std::optional<int64_t> File::get_int_opt(std::string_view key) const {
  if (!has(key)) return std::nullopt;
  return get_int(key);
}

std::optional<double> File::get_float_opt(std::string_view key) const {
  if (!has(key)) return std::nullopt;
  return get_float(key);
}

std::optional<std::string> File::get_string_opt(std::string_view key) const {
  if (!has(key)) return std::nullopt;
  return get_string(key);
}

const std::vector<TensorInfo>& File::tensors() const { return impl_->tensors; }

const TensorInfo* File::find_tensor(std::string_view name) const {
  auto it = impl_->tensor_index.find(name);
  return it == impl_->tensor_index.end() ? nullptr : &impl_->tensors[it->second];
}

const TensorInfo& File::tensor(std::string_view name) const {
  if (const TensorInfo* t = find_tensor(name)) return *t;
  throw GgufError(Errc::missing_tensor,
                  fmt::format("{}: missing tensor '{}'", impl_->path, printable(name)));
}

}  // namespace berth::gguf
