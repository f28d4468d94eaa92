// GGUF reader: the real model stories260K.gguf, typed getters and their errors,
// Value::to_string.
#include <doctest/doctest.h>

#include <bit>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "berth/io/gguf.h"
#include "berth/io/gguf_writer.h"
#include "io/gguf_builder.h"
#include "test_util.h"

namespace {

using berth::ErrorCategory;
using berth::GgmlType;
using berth::gguf::Errc;
using berth::gguf::File;
using berth::gguf::GgufError;
using berth::gguf::Value;
using berth::gguf::ValueType;
using berth::gguf::Writer;

std::vector<uint8_t> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
}

// Calls f and returns the GgufError it throws (fails the test when none is thrown).
template <class F>
GgufError expect_gguf_error(F&& f) {
  try {
    f();
  } catch (const GgufError& e) {
    return e;
  }
  FAIL("no GgufError thrown");
  return GgufError(Errc::truncated, "unreachable");
}

}  // namespace

TEST_CASE("gguf reader: stories260K.gguf") {
  const std::string path = berth::test::stories260k().string();
  const File f = File::open(path);

  CHECK(f.path() == path);
  CHECK(f.version() == 3);
  CHECK(f.file_size() == 1185376);
  CHECK(f.kvs().size() == 19);
  CHECK(f.tensors().size() == 48);
  CHECK(f.alignment() == 32);
  // The tensor infos end at byte 14152 (counted independently); padded to 32 -> 14176.
  CHECK(f.data_offset() == 14176);

  // Metadata, in file order.
  CHECK(f.kvs()[0].key == "tokenizer.ggml.tokens");
  CHECK(f.kvs()[4].key == "general.architecture");
  CHECK(f.kvs()[18].key == "llama.attention.layer_norm_rms_epsilon");
  CHECK(f.architecture() == "llama");
  CHECK(f.get_string("general.name") == "llama");
  CHECK(f.get_string("tokenizer.ggml.model") == "llama");
  CHECK(f.get_int("llama.embedding_length") == 64);
  CHECK(f.get_int("llama.feed_forward_length") == 172);
  CHECK(f.get_int("llama.attention.head_count") == 8);
  CHECK(f.get_int("llama.attention.head_count_kv") == 4);
  CHECK(f.get_int("llama.block_count") == 5);
  CHECK(f.get_int("llama.context_length") == 2048);
  CHECK(f.get_int("llama.rope.dimension_count") == 8);
  CHECK(f.get_int("tokenizer.ggml.bos_token_id") == 1);
  CHECK(f.get_int("tokenizer.ggml.eos_token_id") == 2);
  CHECK(f.get_int("tokenizer.ggml.padding_token_id") == 4294967295);  // uint32 0xffffffff
  CHECK(f.find("llama.embedding_length")->type() == ValueType::uint32);
  const double eps = f.get_float("llama.attention.layer_norm_rms_epsilon");
  CHECK(std::bit_cast<uint32_t>(static_cast<float>(eps)) == 0x3727c5acu);  // bytes in the file
  CHECK(f.find("llama.attention.layer_norm_rms_epsilon")->type() == ValueType::float32);

  const auto& tokens = f.get_string_array("tokenizer.ggml.tokens");
  REQUIRE(tokens.size() == 512);
  CHECK(tokens[0] == "<unk>");
  CHECK(tokens[1] == "<s>");
  CHECK(tokens[2] == "</s>");
  const Value* tv = f.find("tokenizer.ggml.tokens");
  REQUIRE(tv != nullptr);
  CHECK(tv->type() == ValueType::array);
  CHECK(tv->array_type() == ValueType::string);
  CHECK(tv->array_size() == 512);
  CHECK(tv->to_string(3) == "[string x 512] ['<unk>', '<s>', '</s>', ...]");
  CHECK(f.find("general.architecture")->to_string() == "'llama'");
  CHECK(f.find("llama.embedding_length")->to_string() == "64");
  CHECK(f.get_float_array("tokenizer.ggml.scores").size() == 512);
  const auto token_type = f.get_int_array("tokenizer.ggml.token_type");
  REQUIRE(token_type.size() == 512);
  CHECK(token_type[0] == 2);  // unknown
  CHECK(token_type[1] == 3);  // control

  // Tensors.
  const auto& emb = f.tensor("token_embd.weight");
  CHECK(emb.type == GgmlType::F32);
  CHECK(emb.n_dims == 2);
  CHECK(emb.ne == std::array<int64_t, 4>{64, 512, 1, 1});
  CHECK(emb.n_elements() == 64 * 512);
  CHECK(emb.offset == 0);
  CHECK(emb.n_bytes == 64 * 512 * 4);
  const auto& norm = f.tensor("output_norm.weight");
  CHECK(norm.n_dims == 1);
  CHECK(norm.ne == std::array<int64_t, 4>{64, 1, 1, 1});
  CHECK(norm.offset == 131072);
  const auto& last = f.tensors().back();
  CHECK(last.name == "blk.4.ffn_norm.weight");
  CHECK(last.offset == 1170944);
  CHECK(f.data_offset() + last.offset + last.n_bytes == f.file_size());  // no trailing padding

  std::set<std::string> names;
  for (const auto& t : f.tensors()) {
    CHECK(t.type == GgmlType::F32);
    CHECK(t.offset % 32 == 0);
    // Data used in place: all pointers are offsets from the same mapping.
    CHECK(t.data == emb.data + t.offset);
    names.insert(t.name);
  }
  CHECK(names.size() == 48);
  CHECK(f.find_tensor("blk.0.attn_q.weight") != nullptr);
  CHECK(f.find_tensor("blk.5.attn_q.weight") == nullptr);

  // The mapped bytes are the file's bytes.
  const std::vector<uint8_t> raw = read_all(path);
  CHECK(std::memcmp(emb.data, raw.data() + 14176, emb.n_bytes) == 0);
  CHECK(std::memcmp(last.data, raw.data() + 14176 + 1170944, last.n_bytes) == 0);
  float first;
  std::memcpy(&first, emb.data, 4);
  float first_raw;
  std::memcpy(&first_raw, raw.data() + 14176, 4);
  CHECK(first == first_raw);

  const berth::TensorView v = emb.view();
  CHECK(v.name == "token_embd.weight");
  CHECK(v.n_dims == 2);
  CHECK(v.n_rows() == 512);
  CHECK(v.row_bytes() == 256);
  CHECK(v.data == emb.data);
  CHECK(v.n_bytes == 131072);

  // Missing tensor / key.
  const GgufError e1 = expect_gguf_error([&] { f.tensor("nope.weight"); });
  CHECK(e1.code() == Errc::missing_tensor);
  CHECK(e1.category() == ErrorCategory::missing);
  CHECK(std::string(e1.what()).find("'nope.weight'") != std::string::npos);
  CHECK(std::string(e1.what()).find(path) != std::string::npos);

  // The same bytes parsed from memory give the same result.
  const File m = File::from_memory(raw, "stories");
  CHECK(m.data_offset() == f.data_offset());
  CHECK(m.kvs().size() == 19);
  CHECK(m.tensors().size() == 48);
  CHECK(std::memcmp(m.tensor("output.weight").data, f.tensor("output.weight").data,
                    f.tensor("output.weight").n_bytes) == 0);
}

TEST_CASE("gguf reader: File is movable and keeps its data alive") {
  File a = File::open(berth::test::stories260k().string());
  const uint8_t* p = a.tensor("output.weight").data;
  File b = std::move(a);
  CHECK(b.tensor("output.weight").data == p);
  File c = File::from_memory(Writer().to_bytes());
  c = std::move(b);
  CHECK(c.tensors().size() == 48);
  CHECK(c.tensor("output.weight").data == p);
}

namespace {

File getter_file() {
  Writer w;
  w.set("u8", Value{uint8_t{200}});
  w.set("i8", Value{int8_t{-5}});
  w.set("u16", Value{uint16_t{65535}});
  w.set("i16", Value{int16_t{-32768}});
  w.set("u32", Value{uint32_t{4000000000u}});
  w.set("i32", Value{int32_t{-7}});
  w.set("f32", Value{0.25f});
  w.set("b", Value{true});
  w.set("s", Value{std::string("hello")});
  w.set("u64", Value{uint64_t{1} << 40});
  w.set("u64max", Value{std::numeric_limits<uint64_t>::max()});
  w.set("i64", Value{int64_t{-(int64_t{1} << 50)}});
  w.set("f64", Value{-2.5});
  w.set("a.f32", Value{Value::Array{std::vector<float>{1.5f, -2.0f}}});
  w.set("a.f64", Value{Value::Array{std::vector<double>{0.5, 3.0}}});
  w.set("a.u8", Value{Value::Array{std::vector<uint8_t>{1, 255}}});
  w.set("a.i16", Value{Value::Array{std::vector<int16_t>{-3, 4}}});
  w.set("a.u64big", Value{Value::Array{std::vector<uint64_t>{1, uint64_t{1} << 63}}});
  w.set("a.i64", Value{Value::Array{std::vector<int64_t>{-1, int64_t{1} << 40}}});
  w.set("a.s", Value{Value::Array{std::vector<std::string>{"x", "y"}}});
  w.set("a.b", Value{Value::Array{std::vector<bool>{true, false}}});
  return File::from_memory(w.to_bytes(), "getters.gguf");
}

}  // namespace

TEST_CASE("gguf reader: typed getters") {
  const File f = getter_file();
  CHECK(f.get_int("u8") == 200);
  CHECK(f.get_int("i8") == -5);
  CHECK(f.get_int("u16") == 65535);
  CHECK(f.get_int("i16") == -32768);
  CHECK(f.get_int("u32") == 4000000000);
  CHECK(f.get_int("i32") == -7);
  CHECK(f.get_int("u64") == int64_t{1} << 40);
  CHECK(f.get_int("i64") == -(int64_t{1} << 50));
  CHECK(f.get_int("b") == 1);
  CHECK(f.get_float("f32") == 0.25);
  CHECK(f.get_float("f64") == -2.5);
  CHECK(f.get_float("i32") == -7.0);
  CHECK(f.get_float("u64") == 1099511627776.0);
  CHECK(f.get_bool("b") == true);
  CHECK(f.get_string("s") == "hello");
  CHECK(f.get_string_array("a.s") == std::vector<std::string>{"x", "y"});
  CHECK(f.get_float_array("a.f32") == std::vector<float>{1.5f, -2.0f});
  CHECK(f.get_float_array("a.f64") == std::vector<float>{0.5f, 3.0f});
  CHECK(f.get_int_array("a.u8") == std::vector<int64_t>{1, 255});
  CHECK(f.get_int_array("a.i16") == std::vector<int64_t>{-3, 4});
  CHECK(f.get_int_array("a.i64") == std::vector<int64_t>{-1, int64_t{1} << 40});
  CHECK(f.get_int_opt("u8") == 200);
  CHECK(f.get_int_opt("absent") == std::nullopt);
  CHECK(f.get_float_opt("f64") == -2.5);
  CHECK(f.get_float_opt("absent") == std::nullopt);
  CHECK(f.get_string_opt("s") == "hello");
  CHECK(f.get_string_opt("absent") == std::nullopt);
  CHECK(f.has("u8"));
  CHECK_FALSE(f.has("absent"));
  CHECK(f.find("absent") == nullptr);
  CHECK(f.tensors().empty());

  // Missing keys: category missing, message names key and file.
  for (auto get : std::vector<std::function<void()>>{
           [&] { f.get_int("absent.key"); }, [&] { f.get_float("absent.key"); },
           [&] { f.get_bool("absent.key"); }, [&] { f.get_string("absent.key"); },
           [&] { f.get_string_array("absent.key"); }, [&] { f.get_float_array("absent.key"); },
           [&] { f.get_int_array("absent.key"); }, [&] { f.architecture(); }}) {
    const GgufError e = expect_gguf_error(get);
    CHECK(e.code() == Errc::missing_key);
    CHECK(e.category() == ErrorCategory::missing);
    CHECK(std::string(e.what()).find("getters.gguf") != std::string::npos);
    CHECK(std::string(e.what()).find("missing metadata key") != std::string::npos);
  }
  const GgufError em = expect_gguf_error([&] { f.get_int("absent.key"); });
  CHECK(std::string(em.what()).find("'absent.key'") != std::string::npos);

  // Wrong types: category format, message names key, actual type and file.
  struct Wrong {
    std::function<void()> get;
    std::string key, actual;
  };
  for (const Wrong& w : std::vector<Wrong>{
           {[&] { f.get_int("s"); }, "'s'", "type string"},
           {[&] { f.get_int("f32"); }, "'f32'", "type float32"},
           {[&] { f.get_int("u64max"); }, "'u64max'", "type uint64"},
           {[&] { f.get_float("s"); }, "'s'", "type string"},
           {[&] { f.get_float("b"); }, "'b'", "type bool"},
           {[&] { f.get_bool("u8"); }, "'u8'", "type uint8"},
           {[&] { f.get_string("u32"); }, "'u32'", "type uint32"},
           {[&] { f.get_string_array("a.f32"); }, "'a.f32'", "array of float32"},
           {[&] { f.get_string_array("s"); }, "'s'", "type string"},
           {[&] { f.get_float_array("a.s"); }, "'a.s'", "array of string"},
           {[&] { f.get_float_array("a.u8"); }, "'a.u8'", "array of uint8"},
           {[&] { f.get_int_array("a.f64"); }, "'a.f64'", "array of float64"},
           {[&] { f.get_int_array("a.b"); }, "'a.b'", "array of bool"},
           {[&] { f.get_int_array("a.u64big"); }, "'a.u64big'", "array of uint64"},
           {[&] { f.get_int_array("u8"); }, "'u8'", "type uint8"},
           {[&] { f.get_int_opt("s"); }, "'s'", "type string"},
           {[&] { f.get_float_opt("s"); }, "'s'", "type string"},
           {[&] { f.get_string_opt("u8"); }, "'u8'", "type uint8"},
       }) {
    CAPTURE(w.key);
    const GgufError e = expect_gguf_error(w.get);
    const std::string msg = e.what();
    CAPTURE(msg);
    CHECK(e.code() == Errc::wrong_type);
    CHECK(e.category() == ErrorCategory::format);
    CHECK(msg.find("getters.gguf") != std::string::npos);
    CHECK(msg.find(w.key) != std::string::npos);
    CHECK(msg.find(w.actual) != std::string::npos);
  }
}

TEST_CASE("gguf reader: Value::to_string") {
  CHECK(Value{uint8_t{200}}.to_string() == "200");
  CHECK(Value{int8_t{-5}}.to_string() == "-5");
  CHECK(Value{uint16_t{65535}}.to_string() == "65535");
  CHECK(Value{int16_t{-32768}}.to_string() == "-32768");
  CHECK(Value{uint32_t{7}}.to_string() == "7");
  CHECK(Value{int32_t{-7}}.to_string() == "-7");
  CHECK(Value{uint64_t{18446744073709551615u}}.to_string() == "18446744073709551615");
  CHECK(Value{int64_t{-9}}.to_string() == "-9");
  CHECK(Value{0.5f}.to_string() == "0.5");
  CHECK(Value{1e-5f}.to_string() == "1e-05");
  CHECK(Value{-2.25}.to_string() == "-2.25");
  CHECK(Value{true}.to_string() == "true");
  CHECK(Value{false}.to_string() == "false");
  CHECK(Value{std::string("llama")}.to_string() == "'llama'");
  CHECK(Value{std::string("a'b\n\\")}.to_string() == "'a\\'b\\n\\\\'");
  CHECK(Value{std::string("\x01")}.to_string() == "'\\x01'");
  CHECK(Value{std::string("▁the")}.to_string() == "'▁the'");  // UTF-8 kept

  const Value u32s{Value::Array{std::vector<uint32_t>{1, 2, 3}}};
  CHECK(u32s.to_string() == "[uint32 x 3] [1, 2, 3]");
  CHECK(u32s.to_string(2) == "[uint32 x 3] [1, 2, ...]");
  CHECK(u32s.to_string(0) == "[uint32 x 3] [...]");
  CHECK(u32s.array_type() == ValueType::uint32);
  CHECK(u32s.array_size() == 3);
  CHECK(Value{Value::Array{std::vector<int32_t>{}}}.to_string() == "[int32 x 0] []");
  CHECK(Value{Value::Array{std::vector<int8_t>{-1, 2}}}.to_string() == "[int8 x 2] [-1, 2]");
  CHECK(Value{Value::Array{std::vector<bool>{true, false}}}.to_string() ==
        "[bool x 2] [true, false]");
  CHECK(Value{Value::Array{std::vector<float>{0.5f, -1.0f}}}.to_string() ==
        "[float32 x 2] [0.5, -1]");
  CHECK(Value{Value::Array{std::vector<double>{0.5}}}.to_string() == "[float64 x 1] [0.5]");
  CHECK(Value{Value::Array{std::vector<uint64_t>{5}}}.to_string() == "[uint64 x 1] [5]");
  CHECK(Value{Value::Array{std::vector<int64_t>{-5}}}.to_string() == "[int64 x 1] [-5]");
  CHECK(Value{Value::Array{std::vector<std::string>{"<s>", "it's"}}}.to_string() ==
        "[string x 2] ['<s>', 'it\\'s']");

  // Element types behind the variant's index shift after `array`.
  CHECK(Value{Value::Array{std::vector<uint64_t>{}}}.array_type() == ValueType::uint64);
  CHECK(Value{Value::Array{std::vector<int64_t>{}}}.array_type() == ValueType::int64);
  CHECK(Value{Value::Array{std::vector<double>{}}}.array_type() == ValueType::float64);
  CHECK(Value{Value::Array{std::vector<std::string>{}}}.array_type() == ValueType::string);

  // Non-arrays have no element type.
  try {
    (void)Value{uint32_t{1}}.array_type();
    FAIL("array_type() of a scalar");
  } catch (const berth::Error& e) {
    CHECK(e.category() == ErrorCategory::internal);
  }
  CHECK_THROWS_AS((void)Value{std::string("x")}.array_size(), berth::Error);
}

TEST_CASE("gguf reader: names of value types and error codes") {
  CHECK(berth::gguf::value_type_name(ValueType::boolean) == "bool");
  CHECK(berth::gguf::value_type_name(ValueType::float64) == "float64");
  CHECK(berth::gguf::value_type_name(ValueType::array) == "array");
  CHECK(berth::gguf::errc_name(Errc::big_endian) == "big_endian");
  CHECK(berth::gguf::errc_name(Errc::missing_tensor) == "missing_tensor");
  CHECK(berth::gguf::errc_name(Errc::open_failed) == "open_failed");
  CHECK(GgufError(Errc::open_failed, "x").category() == ErrorCategory::io);
  CHECK(GgufError(Errc::missing_key, "x").category() == ErrorCategory::missing);
  CHECK(GgufError(Errc::bad_dims, "x").category() == ErrorCategory::format);
  CHECK(GgufError(Errc::bad_dims, "x", 12).offset() == 12u);
  CHECK_FALSE(GgufError(Errc::bad_dims, "x").offset().has_value());
}

TEST_CASE("gguf reader: valid edge cases") {
  using berth::test::GgufBuilder;
  namespace gt = berth::test::gt;
  namespace tt = berth::test::tt;

  SUBCASE("version 2, no tensors, no keys") {
    const File f = File::from_memory(GgufBuilder().header(2, 0, 0).bytes());
    CHECK(f.version() == 2);
    CHECK(f.kvs().empty());
    CHECK(f.tensors().empty());
    CHECK(f.data_offset() == 32);  // 24 header bytes padded to 32; the data section is empty
    CHECK(f.file_size() == 24);
  }
  SUBCASE("zero-dimension tensor, scalar tensor, empty strings and arrays") {
    GgufBuilder b;
    b.header(3, 3, 3);
    b.kv_str("empty.string", "");
    b.kv_array("empty.array", gt::str, 0);
    b.kv_u32("general.alignment", 16);
    b.tensor_info("zero", {0, 7}, tt::Q4_0, 0);  // 0 bytes at offset 0
    b.tensor_info("scalar", {}, tt::F32, 0);     // n_dims 0: one element
    b.tensor_info("vec", {3}, tt::F16, 16);
    b.pad(16);
    const size_t data_at = b.size();
    b.raw(std::string("\x01\x02\x03\x04", 4)).zeros(12).raw("abcdef");
    const File f = File::from_memory(b.bytes());
    CHECK(f.alignment() == 16);
    CHECK(f.data_offset() == data_at);
    CHECK(f.get_string("empty.string").empty());
    CHECK(f.get_string_array("empty.array").empty());
    const auto& z = f.tensor("zero");
    CHECK(z.n_bytes == 0);
    CHECK(z.n_elements() == 0);
    CHECK(z.ne == std::array<int64_t, 4>{0, 7, 1, 1});
    const auto& s = f.tensor("scalar");
    CHECK(s.n_dims == 0);
    CHECK(s.n_elements() == 1);
    CHECK(s.n_bytes == 4);
    CHECK(std::memcmp(s.data, "\x01\x02\x03\x04", 4) == 0);
    const auto& v = f.tensor("vec");
    CHECK(v.n_bytes == 6);
    CHECK(std::memcmp(v.data, "abcdef", 6) == 0);
  }
  SUBCASE("a name of 63 bytes is fine") {
    GgufBuilder b;
    b.header(3, 1, 0).tensor_info(std::string(63, 'n'), {4}, tt::F32, 0).pad(32).zeros(16);
    const File f = File::from_memory(b.bytes());
    CHECK(f.tensors()[0].name.size() == 63);
  }
  SUBCASE("tensors stored out of order, touching exactly") {
    GgufBuilder b;
    b.header(3, 2, 0).tensor_info("late", {8}, tt::F32, 32).tensor_info("early", {8}, tt::F32, 0);
    b.pad(32).zeros(64);
    const File f = File::from_memory(b.bytes());
    CHECK(f.tensor("late").data == f.tensor("early").data + 32);
  }
}
