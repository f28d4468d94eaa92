// GGUF writer: exact layout against the independent byte builder, writer -> reader round trips
// (versions 2 and 3, default and non-default alignment, every value type, several tensor types
// and shapes), streaming producers to disk, and input validation.
#include <doctest/doctest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "berth/io/gguf.h"
#include "berth/io/gguf_writer.h"
#include "io/gguf_builder.h"
#include "test_util.h"

namespace {

using berth::ErrorCategory;
using berth::GgmlType;
using berth::gguf::File;
using berth::gguf::Value;
using berth::gguf::ValueType;
using berth::gguf::Writer;
using berth::test::GgufBuilder;
namespace gt = berth::test::gt;
namespace tt = berth::test::tt;

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> b(n);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

std::vector<uint8_t> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
}

template <class F>
void expect_error(ErrorCategory cat, F&& f, const std::string& needle = "") {
  try {
    f();
    FAIL("no error thrown");
  } catch (const berth::gguf::GgufError& e) {
    FAIL("a GgufError where a plain Error was expected: " << e.what());
  } catch (const berth::Error& e) {
    CAPTURE(e.what());
    CHECK(e.category() == cat);
    if (!needle.empty()) CHECK(std::string(e.what()).find(needle) != std::string::npos);
  }
}

struct TensorSpec {
  std::string name;
  GgmlType type;
  std::vector<int64_t> ne;
  size_t n_bytes;
};

// Tensors of several types and 1..4 dims, one of them empty. n_bytes from ggml's block tables:
// f32 4, f16 2, bf16 2, q4_0 18/32, q8_0 34/32, q4_K 144/256, q6_K 210/256.
const std::vector<TensorSpec> kTensors = {
    {"f32.1d", GgmlType::F32, {7}, 28},
    {"f16.2d", GgmlType::F16, {3, 5}, 30},
    {"q4_0.3d", GgmlType::Q4_0, {64, 2, 3}, 2 * 18 * 6},
    {"q8_0.4d", GgmlType::Q8_0, {32, 1, 2, 2}, 34 * 4},
    {"zero", GgmlType::F32, {0, 3}, 0},
    {"q4_K.2d", GgmlType::Q4_K, {256, 2}, 144 * 2},
    {"q6_K.1d", GgmlType::Q6_K, {512}, 210 * 2},
    {"bf16.2d", GgmlType::BF16, {4, 2}, 16},
};

// One value of every type, arrays of every element type (strings included), in this order.
std::vector<berth::gguf::KeyValue> all_values() {
  using A = Value::Array;
  return {
      {"v.u8", Value{uint8_t{250}}},
      {"v.i8", Value{int8_t{-128}}},
      {"v.u16", Value{uint16_t{65000}}},
      {"v.i16", Value{int16_t{-1234}}},
      {"v.u32", Value{uint32_t{4000000000u}}},
      {"v.i32", Value{int32_t{-2000000000}}},
      {"v.f32", Value{3.5f}},
      {"v.bool", Value{true}},
      {"v.string", Value{std::string("héllo\nworld")}},
      {"v.u64", Value{uint64_t{0xfedcba9876543210u}}},
      {"v.i64", Value{int64_t{-0x123456789abcdef}}},
      {"v.f64", Value{-1.0e300}},
      {"a.u8", Value{A{std::vector<uint8_t>{0, 1, 255}}}},
      {"a.i8", Value{A{std::vector<int8_t>{-128, 0, 127}}}},
      {"a.u16", Value{A{std::vector<uint16_t>{1, 65535}}}},
      {"a.i16", Value{A{std::vector<int16_t>{-32768, 32767}}}},
      {"a.u32", Value{A{std::vector<uint32_t>{7, 8, 9}}}},
      {"a.i32", Value{A{std::vector<int32_t>{-1, 2, -3}}}},
      {"a.f32", Value{A{std::vector<float>{0.5f, -0.25f, 1e-7f}}}},
      {"a.bool", Value{A{std::vector<bool>{true, false, true}}}},
      {"a.string", Value{A{std::vector<std::string>{"<unk>", "<s>", "", "▁the"}}}},
      {"a.u64", Value{A{std::vector<uint64_t>{0, 0xffffffffffffffffu}}}},
      {"a.i64", Value{A{std::vector<int64_t>{-1, 1}}}},
      {"a.f64", Value{A{std::vector<double>{2.5, -3.75}}}},
      {"a.empty", Value{A{std::vector<uint32_t>{}}}},
  };
}

void check_round_trip(uint32_t version, uint64_t alignment) {
  CAPTURE(version);
  CAPTURE(alignment);
  Writer w(version, alignment);
  const auto kvs = all_values();
  for (const auto& kv : kvs) w.set(kv.key, kv.value);
  std::vector<std::vector<uint8_t>> data;
  for (size_t i = 0; i < kTensors.size(); ++i) {
    data.push_back(random_bytes(kTensors[i].n_bytes, static_cast<uint32_t>(i + 1)));
    w.add_tensor(kTensors[i].name, kTensors[i].type, kTensors[i].ne, data.back());
  }
  const std::vector<uint8_t> bytes = w.to_bytes();
  const File f = File::from_memory(bytes, "round-trip.gguf");

  CHECK(f.version() == version);
  CHECK(f.alignment() == alignment);
  CHECK(f.file_size() == bytes.size());
  CHECK(f.data_offset() % alignment == 0);
  CHECK(bytes.size() % alignment == 0);  // the writer pads after the last tensor too

  // Keys in insertion order, general.alignment added last when not the default.
  const size_t n_expected = kvs.size() + (alignment != 32 ? 1 : 0);
  REQUIRE(f.kvs().size() == n_expected);
  for (size_t i = 0; i < kvs.size(); ++i) {
    CAPTURE(kvs[i].key);
    CHECK(f.kvs()[i].key == kvs[i].key);
    CHECK(f.kvs()[i].value.type() == kvs[i].value.type());
    CHECK(f.kvs()[i].value.v == kvs[i].value.v);
  }
  if (alignment != 32) {
    CHECK(f.kvs().back().key == "general.alignment");
    CHECK(f.kvs().back().value.type() == ValueType::uint32);
    CHECK(f.get_int("general.alignment") == static_cast<int64_t>(alignment));
  } else {
    CHECK_FALSE(f.has("general.alignment"));
  }

  REQUIRE(f.tensors().size() == kTensors.size());
  uint64_t expected_offset = 0;
  for (size_t i = 0; i < kTensors.size(); ++i) {
    const auto& t = f.tensors()[i];
    const auto& s = kTensors[i];
    CAPTURE(s.name);
    CHECK(t.name == s.name);
    CHECK(t.type == s.type);
    CHECK(t.n_dims == s.ne.size());
    for (size_t d = 0; d < 4; ++d) CHECK(t.ne[d] == (d < s.ne.size() ? s.ne[d] : 1));
    CHECK(t.n_bytes == s.n_bytes);
    CHECK(t.offset == expected_offset);
    CHECK(t.offset % alignment == 0);
    CHECK(t.data == f.tensors()[0].data + t.offset);  // in place, one base
    CHECK(std::equal(data[i].begin(), data[i].end(), t.data));
    expected_offset = (t.offset + t.n_bytes + alignment - 1) / alignment * alignment;
  }
  CHECK(f.data_offset() + expected_offset == bytes.size());
}

}  // namespace

TEST_CASE("gguf writer: exact bytes of a small file (version 3, alignment 32)") {
  const auto w_bytes = random_bytes(8, 1);
  const auto v_bytes = random_bytes(6, 2);
  Writer w;
  w.set_u32("a", 7);
  w.set_string_array("t", {"x", "yz"});
  w.add_tensor("w", GgmlType::F32, {2}, w_bytes);
  w.add_tensor("v", GgmlType::F16, {3, 1}, v_bytes);

  GgufBuilder b;
  b.header(3, 2, 2).kv_u32("a", 7).kv_array("t", gt::str, 2).str("x").str("yz");
  b.tensor_info("w", {2}, tt::F32, 0).tensor_info("v", {3, 1}, tt::F16, 32);
  b.pad(32).raw(w_bytes).pad(32).raw(v_bytes).pad(32);
  CHECK(w.to_bytes() == b.bytes());
}

TEST_CASE("gguf writer: exact bytes of a small file (version 2, alignment 64)") {
  const auto w_bytes = random_bytes(8, 1);
  Writer w(2, 64);
  w.set_f32("f", 1.5f);
  w.set_bool("b", false);
  w.set_i32_array("i", {-1, 2});
  w.add_tensor("w", GgmlType::F32, {2}, w_bytes);
  w.add_tensor("z", GgmlType::Q8_0, {0}, std::span<const uint8_t>());

  GgufBuilder b;
  b.header(2, 2, 4).key("f", gt::f32).f32(1.5f).key("b", gt::boolean).u8(0);
  b.kv_array("i", gt::i32, 2).u32(0xffffffffu).u32(2);
  b.kv_u32("general.alignment", 64);
  b.tensor_info("w", {2}, tt::F32, 0).tensor_info("z", {0}, tt::Q8_0, 64);
  b.pad(64).raw(w_bytes).pad(64);
  CHECK(w.to_bytes() == b.bytes());
}

TEST_CASE("gguf writer: an empty writer makes a valid file") {
  const auto bytes = Writer().to_bytes();
  CHECK(bytes == GgufBuilder().header(3, 0, 0).pad(32).bytes());
  const File f = File::from_memory(bytes);
  CHECK(f.kvs().empty());
  CHECK(f.tensors().empty());
}

TEST_CASE("gguf writer -> reader round trips") {
  SUBCASE("version 3, alignment 32") { check_round_trip(3, 32); }
  SUBCASE("version 2, alignment 32") { check_round_trip(2, 32); }
  SUBCASE("version 3, alignment 64") { check_round_trip(3, 64); }
  SUBCASE("version 2, alignment 256") { check_round_trip(2, 256); }
  SUBCASE("version 3, alignment 8") { check_round_trip(3, 8); }
}

TEST_CASE("gguf writer: set replaces in place, general.alignment is written once") {
  Writer w(3, 64);
  w.set_u32("x", 1);
  w.set_u32("general.alignment", 64);
  w.set_string("y", "b");
  w.set_u64("x", 3);  // replaces, keeps the first position, takes the new type
  const File f = File::from_memory(w.to_bytes());
  REQUIRE(f.kvs().size() == 3);
  CHECK(f.kvs()[0].key == "x");
  CHECK(f.kvs()[0].value.type() == ValueType::uint64);
  CHECK(f.get_int("x") == 3);
  CHECK(f.kvs()[1].key == "general.alignment");
  CHECK(f.kvs()[2].key == "y");
  CHECK(f.alignment() == 64);

  Writer d;  // the default alignment may be stated explicitly too
  d.set_u32("general.alignment", 32);
  const File g = File::from_memory(d.to_bytes());
  CHECK(g.kvs().size() == 1);
  CHECK(g.alignment() == 32);
}

TEST_CASE("gguf writer: write() to disk, File::open, producers streamed") {
  const auto dir = berth::test::temp_dir("gguf-writer");
  const std::string path = (dir / "model.gguf").string();

  // A producer tensor larger than the writer's 4 MiB buffer, one small producer, and bytes.
  constexpr int64_t kCols = 1024, kRows = 1300;  // 5,324,800 bytes of f32
  int big_calls = 0, small_calls = 0;
  auto pattern = [](size_t i) { return static_cast<uint8_t>((i * 7 + 3) ^ (i >> 9)); };
  Writer w(3, 128);
  w.set_string("general.architecture", "llama");
  w.set_string_array("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>"});
  w.add_tensor("big", GgmlType::F32, {kCols, kRows}, [&](std::span<uint8_t> dst) {
    ++big_calls;
    CHECK(dst.size() == static_cast<size_t>(kCols * kRows * 4));
    for (size_t i = 0; i < dst.size(); ++i) dst[i] = pattern(i);
  });
  const auto small = random_bytes(34 * 2, 9);
  w.add_tensor("q8", GgmlType::Q8_0, {32, 2}, small);
  w.add_tensor("small", GgmlType::Q4_0, {32}, [&](std::span<uint8_t> dst) {
    ++small_calls;
    REQUIRE(dst.size() == 18);
    for (size_t i = 0; i < dst.size(); ++i) dst[i] = static_cast<uint8_t>(100 + i);
  });
  w.write(path);
  CHECK(big_calls == 1);
  CHECK(small_calls == 1);

  const File f = File::open(path);
  CHECK(f.path() == path);
  CHECK(f.version() == 3);
  CHECK(f.alignment() == 128);
  CHECK(f.architecture() == "llama");
  CHECK(f.get_string_array("tokenizer.ggml.tokens")[2] == "</s>");
  const auto& big = f.tensor("big");
  REQUIRE(big.n_bytes == static_cast<uint64_t>(kCols * kRows * 4));
  bool same = true;
  for (size_t i = 0; i < big.n_bytes && same; ++i) same = big.data[i] == pattern(i);
  CHECK(same);
  CHECK(std::equal(small.begin(), small.end(), f.tensor("q8").data));
  const auto& s = f.tensor("small");
  for (size_t i = 0; i < 18; ++i) CHECK(s.data[i] == 100 + i);
  CHECK(s.offset % 128 == 0);

  // The streamed file and to_bytes() agree byte for byte.
  CHECK(read_all(path) == w.to_bytes());
  CHECK(big_calls == 2);
  std::filesystem::remove_all(dir);
}

TEST_CASE("gguf writer: write() failures") {
  const auto dir = berth::test::temp_dir("gguf-writer-fail");
  SUBCASE("unwritable path is an io error naming the path") {
    const std::string path = (dir / "no-such-dir" / "x.gguf").string();
    expect_error(
        ErrorCategory::io, [&] { Writer().write(path); }, path);
  }
  SUBCASE("a throwing producer propagates and leaves no partial file") {
    const std::string path = (dir / "partial.gguf").string();
    Writer w;
    w.add_tensor("t", GgmlType::F32, {4},
                 [](std::span<uint8_t>) { throw std::runtime_error("producer failed"); });
    CHECK_THROWS_WITH_AS(w.write(path), "producer failed", std::runtime_error);
    CHECK_FALSE(std::filesystem::exists(path));
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("gguf writer: invalid inputs are invalid_argument") {
  const auto inv = ErrorCategory::invalid_argument;
  expect_error(
      inv, [] { Writer(1); }, "version 1");
  expect_error(
      inv, [] { Writer(4); }, "version 4");
  expect_error(
      inv, [] { Writer(3, 0); }, "alignment 0");
  expect_error(
      inv, [] { Writer(3, 48); }, "alignment 48");
  expect_error(inv, [] { Writer(3, uint64_t{1} << 33); });

  Writer w;
  std::vector<uint8_t> f32x4(16);
  w.add_tensor("t", GgmlType::F32, {4}, f32x4);
  expect_error(
      inv, [&] { w.set("", Value{uint32_t{1}}); }, "empty");
  expect_error(
      inv, [&] { w.set_u32("general.alignment", 64); }, "general.alignment");
  expect_error(
      inv, [&] { w.set_u64("general.alignment", 32); }, "general.alignment");
  expect_error(
      inv, [&] { w.add_tensor("", GgmlType::F32, {4}, f32x4); }, "empty");
  expect_error(
      inv, [&] { w.add_tensor(std::string(64, 'n'), GgmlType::F32, {4}, f32x4); }, "64 bytes");
  expect_error(
      inv, [&] { w.add_tensor("t", GgmlType::F32, {4}, f32x4); }, "'t' added twice");
  expect_error(
      inv, [&] { w.add_tensor("u", GgmlType::F32, {}, f32x4); }, "0 dimensions");
  expect_error(
      inv,
      [&] {
        w.add_tensor("u", GgmlType::F32, {1, 1, 1, 1, 4}, f32x4);
      },
      "5 dimensions");
  expect_error(
      inv, [&] { w.add_tensor("u", GgmlType::F32, {-4}, f32x4); }, "negative");
  expect_error(
      inv, [&] { w.add_tensor("u", GgmlType::Q4_0, {16}, f32x4); }, "block size 32");
  expect_error(
      inv, [&] { w.add_tensor("u", GgmlType::F32, {5}, f32x4); }, "needs 20 bytes, got 16");
  expect_error(
      inv, [&] { w.add_tensor("u", static_cast<GgmlType>(4), {4}, f32x4); }, "type id 4");
  expect_error(inv, [&] {
    w.add_tensor("u", GgmlType::F32, {int64_t{1} << 32, int64_t{1} << 32}, f32x4);
  });
  expect_error(
      inv, [&] { w.add_tensor("u", GgmlType::F32, {4}, Writer::Producer()); }, "empty producer");
  // Nothing invalid was added: the file still has just "t".
  const File f = File::from_memory(w.to_bytes());
  CHECK(f.tensors().size() == 1);
  CHECK(f.kvs().empty());
}

TEST_CASE("gguf writer: a sparse file has write()'s layout with the tensor data as a hole") {
  // 64 MiB of f16 data: write() and write_sparse() give files of the same size, the same header
  // and tensor infos; the sparse one's data reads as zeros, its producer never runs, and it
  // takes far less disk than its size where the file system keeps holes.
  const auto dir = berth::test::temp_dir("gguf-sparse");
  Writer w;
  w.set_string("general.architecture", "llama");
  bool produced = false;
  w.add_tensor("big", GgmlType::F16, {4096, 8192}, [&](std::span<uint8_t> dst) {
    produced = true;
    std::fill(dst.begin(), dst.end(), uint8_t{0});
  });
  w.add_tensor("small", GgmlType::F32, {3}, std::vector<uint8_t>(12, 0));
  const std::string sparse = (dir / "sparse.gguf").string();
  w.write_sparse(sparse);
  CHECK_FALSE(produced);
  const std::string full = (dir / "full.gguf").string();
  w.write(full);
  CHECK(produced);
  REQUIRE(std::filesystem::file_size(sparse) == std::filesystem::file_size(full));
  std::ifstream a(sparse, std::ios::binary), b(full, std::ios::binary);
  const std::string sa((std::istreambuf_iterator<char>(a)), {}),
      sb((std::istreambuf_iterator<char>(b)), {});
  CHECK(sa == sb);  // the full file's data is zeros too
  const File f = File::open(sparse);
  REQUIRE(f.tensors().size() == 2);
  CHECK(f.tensors()[0].name == "big");
  struct stat st {};
  REQUIRE(::stat(sparse.c_str(), &st) == 0);
  MESSAGE("sparse file: ", st.st_size, " bytes, ", static_cast<int64_t>(st.st_blocks) * 512,
          " on disk");
  CHECK(static_cast<int64_t>(st.st_blocks) * 512 < st.st_size);
  std::filesystem::remove(sparse);
  std::filesystem::remove(full);
}
