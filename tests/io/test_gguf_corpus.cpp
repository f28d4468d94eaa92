// A corpus of malformed GGUF files, each crafted byte by byte with GgufBuilder, each asserting
// the exact Errc, the category, the byte offset where known, and that the message names the
// file and what/where (key, tensor, id). Plus a truncation sweep and a mutation sweep that must
// end in GgufError and never in a crash (the suite runs under ASan/UBSan).
#include <doctest/doctest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "berth/io/gguf.h"
#include "berth/io/gguf_writer.h"
#include "io/gguf_builder.h"
#include "test_util.h"

namespace {

using berth::ErrorCategory;
using berth::gguf::Errc;
using berth::gguf::File;
using berth::gguf::GgufError;
using berth::test::GgufBuilder;
namespace gt = berth::test::gt;
namespace tt = berth::test::tt;

constexpr uint64_t kHeaderBytes = 24;  // magic, version, tensor count, kv count

struct Case {
  std::string name;
  std::vector<uint8_t> bytes;
  Errc code;
  std::vector<std::string> needles;  // substrings the message must contain
  std::optional<uint64_t> at;        // expected GgufError::offset()
};

struct Ti {
  std::string name;
  std::vector<uint64_t> ne;
  uint32_t type;
  uint64_t offset;
};

// A file with one string KV (plus general.alignment when given), the tensor infos `tis`, zero
// padding to the alignment and `data_bytes` bytes of data. `info_at` receives where each
// tensor info starts.
std::vector<uint8_t> tensor_file(const std::vector<Ti>& tis, uint64_t data_bytes,
                                 std::vector<size_t>* info_at = nullptr,
                                 std::optional<uint32_t> alignment = std::nullopt) {
  GgufBuilder b;
  b.header(3, tis.size(), alignment ? 2 : 1);
  b.kv_str("general.architecture", "llama");
  if (alignment) b.kv_u32("general.alignment", *alignment);
  for (const Ti& t : tis) {
    if (info_at) info_at->push_back(b.size());
    b.tensor_info(t.name, t.ne, t.type, t.offset);
  }
  b.pad(alignment.value_or(32));
  b.zeros(data_bytes);
  return b.bytes();
}

std::vector<Case> corpus() {
  std::vector<Case> c;
  const uint64_t u64max = std::numeric_limits<uint64_t>::max();

  // --- Header -------------------------------------------------------------------------------
  c.push_back({"empty", {}, Errc::empty_file, {"empty"}, std::nullopt});
  c.push_back({"bad_magic",
               GgufBuilder().header(3, 0, 0, "GGUX").bytes(),
               Errc::bad_magic,
               {"GGUX", "not a GGUF file"},
               0});
  c.push_back({"bad_magic_short", GgufBuilder().raw("PK").bytes(), Errc::bad_magic, {"PK"}, 0});
  c.push_back({"truncated_magic", GgufBuilder().raw("GGU").bytes(), Errc::truncated, {"magic"}, 0});
  c.push_back({"truncated_version",
               GgufBuilder().raw("GGUF").u16(3).bytes(),
               Errc::truncated,
               {"version"},
               4});
  for (uint32_t v : {0u, 1u, 4u, 0xffffffffu})
    c.push_back({"version_" + std::to_string(v),
                 GgufBuilder().header(v, 0, 0).bytes(),
                 Errc::bad_version,
                 {"version " + std::to_string(v)},
                 4});
  c.push_back({"big_endian_v3",
               GgufBuilder().raw("GGUF").u32(0x03000000u).zeros(16).bytes(),
               Errc::big_endian,
               {"big-endian", "3 byte-swapped"},
               4});
  c.push_back({"big_endian_v2",
               GgufBuilder().raw("GGUF").u32(0x02000000u).zeros(16).bytes(),
               Errc::big_endian,
               {"big-endian"},
               4});
  c.push_back({"truncated_kv_count",
               GgufBuilder().raw("GGUF").u32(3).u64(0).u32(0).bytes(),
               Errc::truncated,
               {"key/value count"},
               16});
  c.push_back({"too_many_tensors_huge",
               GgufBuilder().header(3, uint64_t{1} << 63, 0).zeros(64).bytes(),
               Errc::too_many_tensors,
               {"tensor count 9223372036854775808"},
               8});
  c.push_back({"too_many_tensors_for_size",
               GgufBuilder().header(3, 10, 0).zeros(100).bytes(),
               Errc::too_many_tensors,
               {"tensor count 10", "100 bytes"},
               8});
  c.push_back({"too_many_kvs",
               GgufBuilder().header(3, 0, u64max).zeros(64).bytes(),
               Errc::too_many_kvs,
               {"count 18446744073709551615"},
               16});
  {
    // The header check passes; the KV then eats all but 30 bytes, too few for 2 tensor infos.
    GgufBuilder b;
    b.header(3, 2, 1).kv_str("general.name", std::string(200, 'x'));
    const size_t at = b.size();
    b.zeros(30);
    c.push_back({"too_many_tensors_after_kvs",
                 b.bytes(),
                 Errc::too_many_tensors,
                 {"tensor count 2", "30 bytes"},
                 at});
  }

  // --- Keys and values ----------------------------------------------------------------------
  c.push_back({"key_length_past_end",
               GgufBuilder().header(3, 0, 1).str_with_len(1000, "general.").zeros(10).bytes(),
               Errc::string_too_long,
               {"metadata entry #0", "length 1000"},
               kHeaderBytes});
  c.push_back({"key_length_huge",
               GgufBuilder().header(3, 0, 1).str_with_len(u64max, "abcdefgh").zeros(8).bytes(),
               Errc::string_too_long,
               {"length 18446744073709551615"},
               kHeaderBytes});
  {
    GgufBuilder b;
    b.header(3, 0, 1).key("general.name", gt::str);
    const size_t at = b.size();
    b.str_with_len(500, "llama");
    c.push_back({"string_value_past_end",
                 b.bytes(),
                 Errc::string_too_long,
                 {"'general.name'", "length 500"},
                 at});
  }
  {
    GgufBuilder b;
    b.header(3, 0, 1).key("a.b", gt::u32);
    const size_t at = b.size();
    b.u16(7);
    c.push_back({"truncated_value", b.bytes(), Errc::truncated, {"value of key 'a.b'"}, at});
  }
  {
    GgufBuilder b;
    b.header(3, 0, 1).str("some.key.here");
    const size_t at = b.size();
    b.u16(0);
    c.push_back({"truncated_value_type",
                 b.bytes(),
                 Errc::truncated,
                 {"value type of key 'some.key.here'"},
                 at});
  }
  {
    GgufBuilder b;
    b.header(3, 0, 1).key("a.arr", gt::arr).u32(gt::u32);
    const size_t at = b.size();
    b.u64(uint64_t{1} << 62).u32(1).u32(2);
    c.push_back({"array_too_long_u32",
                 b.bytes(),
                 Errc::array_too_long,
                 {"'a.arr'", "4611686018427387904 uint32"},
                 at});
  }
  {
    GgufBuilder b;
    b.header(3, 0, 1).key("tokenizer.ggml.tokens", gt::arr).u32(gt::str);
    const size_t at = b.size();
    b.u64(100).str("a").str("b");
    c.push_back({"array_too_long_strings",
                 b.bytes(),
                 Errc::array_too_long,
                 {"'tokenizer.ggml.tokens'", "100 string"},
                 at});
  }
  {
    GgufBuilder b;
    b.header(3, 0, 1).kv_array("tokenizer.ggml.tokens", gt::str, 2).str("<s>");
    const size_t at = b.size();
    b.str_with_len(uint64_t{1} << 40, "abc").zeros(16);
    c.push_back({"string_array_element_past_end",
                 b.bytes(),
                 Errc::string_too_long,
                 {"element 1 of string array 'tokenizer.ggml.tokens'"},
                 at});
  }
  c.push_back({"empty_key",
               GgufBuilder().header(3, 0, 1).key("", gt::u32).u32(1).bytes(),
               Errc::empty_key,
               {"metadata entry #0", "empty key"},
               kHeaderBytes});
  {
    GgufBuilder b;
    b.header(3, 0, 2).kv_u32("a.b", 1);
    const size_t at = b.size();
    b.kv_u32("a.b", 2);
    c.push_back({"duplicate_key",
                 b.bytes(),
                 Errc::duplicate_key,
                 {"duplicate key 'a.b'", "entry #1", "entry #0"},
                 at});
  }
  {
    GgufBuilder b;
    b.header(3, 0, 1).str("a.b");
    const size_t at = b.size();
    b.u32(13).u32(0);
    c.push_back(
        {"unknown_value_type", b.bytes(), Errc::unknown_value_type, {"'a.b'", "type id 13"}, at});
  }
  {
    GgufBuilder b;
    b.header(3, 0, 1).str("a.b");
    const size_t at = b.size();
    b.u32(0xffffffffu).u32(0);
    c.push_back({"unknown_value_type_huge",
                 b.bytes(),
                 Errc::unknown_value_type,
                 {"'a.b'", "type id 4294967295"},
                 at});
  }
  {
    GgufBuilder b;
    b.header(3, 0, 1).key("a.arr", gt::arr);
    const size_t at = b.size();
    b.u32(42).u64(1).u32(0);
    c.push_back({"unknown_array_element_type",
                 b.bytes(),
                 Errc::unknown_value_type,
                 {"'a.arr'", "type id 42"},
                 at});
  }
  {
    GgufBuilder b;
    b.header(3, 0, 1).key("a.arr", gt::arr);
    const size_t at = b.size();
    b.u32(gt::arr).u64(1).u32(gt::u8).u64(1).u8(0);
    c.push_back(
        {"nested_array", b.bytes(), Errc::nested_array, {"'a.arr'", "array of arrays"}, at});
  }
  c.push_back({"alignment_zero",
               GgufBuilder().header(3, 0, 1).kv_u32("general.alignment", 0).bytes(),
               Errc::bad_alignment,
               {"general.alignment", "is 0"},
               kHeaderBytes});
  c.push_back({"alignment_not_pow2",
               GgufBuilder().header(3, 0, 1).kv_u32("general.alignment", 48).bytes(),
               Errc::bad_alignment,
               {"general.alignment", "is 48"},
               kHeaderBytes});
  {
    GgufBuilder b;
    b.header(3, 0, 2).kv_str("general.name", "x");
    const size_t at = b.size();
    b.kv_u64("general.alignment", 64);
    c.push_back({"alignment_uint64",
                 b.bytes(),
                 Errc::bad_alignment,
                 {"general.alignment", "type uint64"},
                 at});
  }
  c.push_back({"alignment_string",
               GgufBuilder().header(3, 0, 1).kv_str("general.alignment", "32").bytes(),
               Errc::bad_alignment,
               {"general.alignment", "type string"},
               kHeaderBytes});

  // --- Tensor infos -------------------------------------------------------------------------
  {
    std::vector<size_t> at;
    auto bytes = tensor_file({{"", {4}, tt::F32, 0}}, 32, &at);
    c.push_back({"empty_tensor_name", bytes, Errc::empty_tensor_name, {"tensor info #0"}, at[0]});
  }
  {
    std::vector<size_t> at;
    auto bytes =
        tensor_file({{"ok", {4}, tt::F32, 0}, {std::string(64, 'n'), {4}, tt::F32, 32}}, 64, &at);
    c.push_back({"tensor_name_64_bytes",
                 bytes,
                 Errc::tensor_name_too_long,
                 {"tensor info #1", "64 bytes"},
                 at[1]});
  }
  {
    std::vector<size_t> at;
    auto bytes = tensor_file({{"w", {4}, tt::F32, 0}, {"w", {4}, tt::F32, 32}}, 64, &at);
    c.push_back({"duplicate_tensor",
                 bytes,
                 Errc::duplicate_tensor,
                 {"duplicate tensor 'w'", "#1", "#0"},
                 at[1]});
  }
  {
    std::vector<size_t> at;
    auto bytes = tensor_file({{"w5", {1, 1, 1, 1, 1}, tt::F32, 0}}, 32, &at);
    c.push_back(
        {"too_many_dims", bytes, Errc::too_many_dims, {"'w5'", "5 dimensions"}, at[0] + 8 + 2});
  }
  {
    std::vector<size_t> at;
    auto bytes = tensor_file({{"neg", {4, static_cast<uint64_t>(-2)}, tt::F32, 0}}, 32, &at);
    c.push_back(
        {"negative_dim", bytes, Errc::bad_dims, {"'neg'", "ne[1] = -2"}, at[0] + 8 + 3 + 4 + 8});
  }
  {
    std::vector<size_t> at;
    auto bytes =
        tensor_file({{"big", {uint64_t{1} << 32, uint64_t{1} << 32}, tt::F32, 0}}, 32, &at);
    c.push_back(
        {"element_count_overflow_2d", bytes, Errc::bad_dims, {"'big'", "int64"}, at[0] + 8 + 3});
  }
  {
    const uint64_t d = uint64_t{1} << 21;  // 2^63 elements: one past INT64_MAX
    auto bytes = tensor_file({{"cube", {d, d, d}, tt::F32, 0}}, 32);
    c.push_back({"element_count_overflow_3d", bytes, Errc::bad_dims, {"'cube'"}, std::nullopt});
  }
  {
    std::vector<size_t> at;
    auto bytes = tensor_file({{"blk.0.w", {32}, 99, 0}}, 32, &at);
    c.push_back({"unknown_tensor_type",
                 bytes,
                 Errc::unknown_tensor_type,
                 {"'blk.0.w'", "type id 99"},
                 at[0] + 8 + 7 + 4 + 8});
  }
  {
    auto bytes = tensor_file({{"old", {32}, 4, 0}}, 32);  // Q4_2, removed from ggml
    c.push_back({"removed_tensor_type",
                 bytes,
                 Errc::unknown_tensor_type,
                 {"'old'", "type id 4"},
                 std::nullopt});
  }
  {
    std::vector<size_t> at;
    auto bytes = tensor_file({{"q", {48}, tt::Q4_0, 0}}, 32, &at);
    c.push_back({"row_length_q4_0",
                 bytes,
                 Errc::bad_row_length,
                 {"'q'", "q4_0", "ne[0] = 48", "block size 32"},
                 at[0] + 8 + 1 + 4});
  }
  {
    auto bytes = tensor_file({{"k", {128, 2}, tt::Q4_K, 0}}, 256);
    c.push_back({"row_length_q4_k",
                 bytes,
                 Errc::bad_row_length,
                 {"'k'", "q4_K", "block size 256"},
                 std::nullopt});
  }
  {
    std::vector<size_t> at;
    auto bytes = tensor_file({{"a", {4}, tt::F32, 0}, {"b", {4}, tt::F32, 16}}, 64, &at);
    c.push_back({"misaligned_tensor",
                 bytes,
                 Errc::misaligned_tensor,
                 {"'b'", "offset 16", "alignment 32"},
                 at[1]});
  }
  {
    std::vector<size_t> at;
    auto bytes = tensor_file({{"a", {4}, tt::F32, 0}, {"b", {4}, tt::F32, 32}}, 128, &at, 64);
    c.push_back({"misaligned_tensor_alignment_64",
                 bytes,
                 Errc::misaligned_tensor,
                 {"'b'", "offset 32", "alignment 64"},
                 at[1]});
  }
  {
    std::vector<size_t> at;
    auto bytes = tensor_file({{"a", {16}, tt::F32, 0}, {"b", {4}, tt::F32, 32}}, 96, &at);
    c.push_back({"overlapping_tensors",
                 bytes,
                 Errc::overlapping_tensors,
                 {"'b'", "overlaps tensor 'a'"},
                 at[1]});
  }
  {
    std::vector<size_t> at;
    auto bytes = tensor_file({{"a", {8}, tt::F32, 0}, {"b", {16}, tt::F32, 32}}, 32 + 63, &at);
    c.push_back({"truncated_download",
                 bytes,
                 Errc::tensor_out_of_bounds,
                 {"'b'", "64 bytes at data offset 32", "past the end"},
                 at[1]});
  }
  {
    // The file ends right after the tensor infos: no padding, no data.
    std::vector<size_t> at;
    GgufBuilder b;
    b.header(3, 1, 0);
    at.push_back(b.size());
    b.tensor_info("w", {4}, tt::F32, 0);
    c.push_back({"no_data_section", b.bytes(), Errc::tensor_out_of_bounds, {"'w'"}, at[0]});
  }
  {
    auto bytes = tensor_file({{"far", {4}, tt::F32, ~uint64_t{31}}}, 32);
    c.push_back({"huge_offset", bytes, Errc::tensor_out_of_bounds, {"'far'"}, std::nullopt});
  }
  {
    // 2^62 f64 elements fit in int64 but need 2^65 bytes.
    auto bytes = tensor_file({{"wide", {uint64_t{1} << 62}, tt::F64, 0}}, 32);
    c.push_back({"byte_count_overflow",
                 bytes,
                 Errc::tensor_out_of_bounds,
                 {"'wide'", "2^64"},
                 std::nullopt});
  }
  {
    // 25 bytes after the header pass the count check; the offset field is missing.
    GgufBuilder b;
    b.header(3, 1, 0).str("w").u32(1).u64(4).u32(tt::F32);
    const size_t at = b.size();
    c.push_back(
        {"truncated_tensor_info", b.bytes(), Errc::truncated, {"offset of tensor 'w'"}, at});
  }
  return c;
}

void check_case(const Case& k, const GgufError& e, const std::string& file_name) {
  const std::string msg = e.what();
  CAPTURE(msg);
  CHECK(berth::gguf::errc_name(e.code()) == berth::gguf::errc_name(k.code));
  CHECK(e.category() == ErrorCategory::format);
  CHECK(msg.find(file_name) != std::string::npos);
  CHECK(msg.find('\n') == std::string::npos);
  for (const std::string& needle : k.needles) {
    CAPTURE(needle);
    CHECK(msg.find(needle) != std::string::npos);
  }
  if (k.at) {
    REQUIRE(e.offset().has_value());
    CHECK(*e.offset() == *k.at);
    CHECK(msg.find("at byte " + std::to_string(*k.at)) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("gguf corpus: every malformed file raises its own Errc") {
  const std::vector<Case> cases = corpus();
  MESSAGE("malformed corpus cases: " << cases.size());
  CHECK(cases.size() >= 25);

  std::set<std::string> names;
  for (const Case& k : cases) {
    CAPTURE(k.name);
    CHECK(names.insert(k.name).second);  // distinct
    const std::string file_name = k.name + ".gguf";
    try {
      File::from_memory(k.bytes, file_name);
      FAIL("parsed without error");
    } catch (const GgufError& e) {
      check_case(k, e, file_name);
    }
  }
}

TEST_CASE("gguf corpus: the same files fail the same way through File::open (mmap)") {
  const auto dir = berth::test::temp_dir("gguf-corpus");
  for (const Case& k : corpus()) {
    CAPTURE(k.name);
    const std::string path = (dir / (k.name + ".gguf")).string();
    {
      std::ofstream f(path, std::ios::binary);
      f.write(reinterpret_cast<const char*>(k.bytes.data()),
              static_cast<std::streamsize>(k.bytes.size()));
    }
    try {
      File::open(path);
      FAIL("parsed without error");
    } catch (const GgufError& e) {
      check_case(k, e, path);
    }
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("gguf corpus: covers every structural Errc") {
  std::set<Errc> seen;
  for (const Case& k : corpus()) seen.insert(k.code);
  for (Errc e : {Errc::empty_file,        Errc::bad_magic,           Errc::big_endian,
                 Errc::bad_version,       Errc::truncated,           Errc::too_many_tensors,
                 Errc::too_many_kvs,      Errc::string_too_long,     Errc::array_too_long,
                 Errc::empty_key,         Errc::duplicate_key,       Errc::unknown_value_type,
                 Errc::nested_array,      Errc::bad_alignment,       Errc::tensor_name_too_long,
                 Errc::empty_tensor_name, Errc::duplicate_tensor,    Errc::too_many_dims,
                 Errc::bad_dims,          Errc::unknown_tensor_type, Errc::bad_row_length,
                 Errc::misaligned_tensor, Errc::overlapping_tensors, Errc::tensor_out_of_bounds}) {
    CAPTURE(berth::gguf::errc_name(e));
    CHECK(seen.count(e) == 1);
  }
}

TEST_CASE("gguf: open failures are open_failed with category io") {
  const auto dir = berth::test::temp_dir("gguf-open");
  SUBCASE("missing file") {
    const std::string path = (dir / "does-not-exist.gguf").string();
    try {
      File::open(path);
      FAIL("opened a missing file");
    } catch (const GgufError& e) {
      CHECK(e.code() == Errc::open_failed);
      CHECK(e.category() == ErrorCategory::io);
      CHECK(std::string(e.what()).find(path) != std::string::npos);
      CHECK(std::string(e.what()).find("No such file") != std::string::npos);
    }
  }
  SUBCASE("directory") {
    try {
      File::open(dir.string());
      FAIL("opened a directory");
    } catch (const GgufError& e) {
      CHECK(e.code() == Errc::open_failed);
      CHECK(e.category() == ErrorCategory::io);
      CHECK(std::string(e.what()).find("directory") != std::string::npos);
    }
  }
  SUBCASE("empty file on disk") {
    const std::string path = (dir / "empty.gguf").string();
    std::ofstream(path, std::ios::binary).close();
    try {
      File::open(path);
      FAIL("opened an empty file");
    } catch (const GgufError& e) {
      CHECK(e.code() == Errc::empty_file);
      CHECK(e.category() == ErrorCategory::format);
      CHECK(std::string(e.what()).find(path) != std::string::npos);
    }
  }
  std::filesystem::remove_all(dir);
}

namespace {

// A valid file with every kind of section: scalar and array KVs (strings among them), a
// non-default alignment and tensors of several types, one of them empty (sharing its offset
// with the next tensor). Data offsets: a 0 (40 bytes), empty 64, b 64 (36), c 128 (102); the
// file ends with padding to 256.
std::vector<uint8_t> sweep_file() {
  berth::gguf::Writer w(3, 64);
  w.set_string("general.architecture", "llama");
  w.set_u32("llama.block_count", 2);
  w.set_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  w.set_string_array("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "hello", ""});
  w.set_i32_array("tokenizer.ggml.token_type", {2, 3, 3, 1, 1});
  w.set_bool("general.flag", true);
  std::vector<uint8_t> f32(4 * 10, 0x11), q40(18 * 2, 0x22), q80(34 * 3, 0x33);
  w.add_tensor("a", berth::GgmlType::F32, {10}, f32);
  w.add_tensor("empty", berth::GgmlType::F32, {0, 4}, std::span<const uint8_t>());
  w.add_tensor("b", berth::GgmlType::Q4_0, {64}, q40);
  w.add_tensor("c", berth::GgmlType::Q8_0, {32, 3}, q80);
  return w.to_bytes();
}

}  // namespace

TEST_CASE("gguf: a valid file cut at every length parses only when all tensor bytes remain") {
  const std::vector<uint8_t> full = sweep_file();
  const File whole = File::from_memory(full, "sweep.gguf");
  uint64_t min_valid = whole.data_offset();
  for (const auto& t : whole.tensors())
    min_valid = std::max<uint64_t>(min_valid, whole.data_offset() + t.offset + t.n_bytes);
  // The trailing padding after "c" may go; nothing else.
  CHECK(min_valid == whole.data_offset() + 230);
  CHECK(full.size() == whole.data_offset() + 256);

  const std::set<Errc> cut_errors{
      Errc::empty_file,      Errc::truncated,      Errc::too_many_tensors,    Errc::too_many_kvs,
      Errc::string_too_long, Errc::array_too_long, Errc::tensor_out_of_bounds};
  size_t n_parsed = 0, n_failed = 0;
  for (size_t n = 0; n <= full.size(); ++n) {
    CAPTURE(n);
    std::vector<uint8_t> cut(full.begin(), full.begin() + static_cast<ptrdiff_t>(n));
    try {
      const File f = File::from_memory(std::move(cut), "cut.gguf");
      ++n_parsed;
      CHECK(n >= min_valid);
      CHECK(f.tensors().size() == 4);
      CHECK(f.kvs().size() == whole.kvs().size());
    } catch (const GgufError& e) {
      ++n_failed;
      CHECK(n < min_valid);
      CAPTURE(e.what());
      CHECK(cut_errors.count(e.code()) == 1);
    }
  }
  CHECK(n_parsed == full.size() - min_valid + 1);
  CHECK(n_failed == min_valid);
}

TEST_CASE("gguf: the real model cut anywhere in its header or data fails cleanly") {
  std::ifstream in(berth::test::stories260k(), std::ios::binary);
  REQUIRE(in.good());
  const std::vector<uint8_t> full((std::istreambuf_iterator<char>(in)),
                                  std::istreambuf_iterator<char>());
  REQUIRE(full.size() == 1185376);
  std::vector<size_t> cuts;
  for (size_t n = 0; n <= 14176 + 64; ++n) cuts.push_back(n);  // every byte of the header
  for (size_t n = 14176 + 64; n < full.size(); n += 4099) cuts.push_back(n);
  cuts.push_back(full.size() - 1);
  for (size_t n : cuts) {
    CAPTURE(n);
    try {
      File::from_memory(
          std::vector<uint8_t>(full.begin(), full.begin() + static_cast<ptrdiff_t>(n)),
          "stories-cut.gguf");
      FAIL("a cut file parsed");
    } catch (const GgufError& e) {
      CHECK(e.category() == ErrorCategory::format);
      if (n > 14176) CHECK(e.code() == Errc::tensor_out_of_bounds);
    }
  }
}

TEST_CASE("gguf: mutated files parse or raise GgufError, never crash") {
  const std::vector<uint8_t> base = sweep_file();
  // Header and metadata only: mutating tensor bytes cannot fail.
  const size_t header_end = File::from_memory(base).data_offset();
  size_t n_parsed = 0, n_failed = 0;
  auto attempt = [&](std::vector<uint8_t> bytes) {
    try {
      File::from_memory(std::move(bytes), "mutant.gguf");
      ++n_parsed;
    } catch (const GgufError& e) {
      ++n_failed;
      CHECK(e.category() == ErrorCategory::format);
    }
  };
  // Every byte of the header set to a few telling values.
  for (size_t i = 0; i < header_end; ++i) {
    for (uint8_t v : {uint8_t{0x00}, uint8_t{0xff}, uint8_t{0x80}, uint8_t{0x7f},
                      static_cast<uint8_t>(base[i] ^ 1), static_cast<uint8_t>(base[i] + 1)}) {
      std::vector<uint8_t> m = base;
      m[i] = v;
      attempt(std::move(m));
    }
  }
  // Random multi-byte mutations, fixed seed.
  std::mt19937 rng(1234);
  for (int it = 0; it < 5000; ++it) {
    std::vector<uint8_t> m = base;
    const int n_mut = 1 + static_cast<int>(rng() % 4);
    for (int j = 0; j < n_mut; ++j) m[rng() % header_end] = static_cast<uint8_t>(rng());
    attempt(std::move(m));
  }
  MESSAGE("mutants parsed: " << n_parsed << ", rejected: " << n_failed);
  CHECK(n_failed > 0);
  CHECK(n_parsed > 0);  // e.g. a changed character in a string value is still valid
}
