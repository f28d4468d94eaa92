// Tests of the oracle (tests/oracle/naive_llama.h): the naive double-precision llama forward
// that every optimised path is compared against. The golden text is the one documented in
// ../shared/models/README.md for stories260K (greedy, BOS prepended), on which an independent
// f64 implementation and llama.cpp-family tools agree.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "berth/core/error.h"
#include "berth/core/types.h"
#include "berth/cpu_kernels/quants_ref.h"
#include "berth/io/gguf.h"
#include "berth/io/gguf_writer.h"
#include "naive_llama.h"
#include "test_util.h"

namespace {

using berth::Error;
using berth::ErrorCategory;
using berth::GgmlType;
namespace gguf = berth::gguf;
using berth::oracle::greedy_generate;
using berth::oracle::NaiveLlama;

const std::vector<int32_t> kPrompt = {1, 403, 407, 261, 378};  // "<s>Once upon a time"
const char* const kGoldenText =
    ", there was a little girl named Lily. She loved to play outside in the park. One day, she "
    "saw a big, red ball. She wanted to play with it, but it was too high.\nLily's mom said";
/// The oracle's 64 greedy ids for kPrompt (they decode to kGoldenText).
const std::vector<int32_t> kGoldenIds = {
    432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337,
    410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394,
    261, 370, 432, 352, 266, 268, 388, 426, 338, 391, 266, 267, 337, 335, 312, 432,
    398, 312, 286, 267, 414, 270, 333, 415, 426, 13,  438, 310, 439, 419, 357, 336};

/// Decodes ids with the file's SentencePiece pieces directly: "▁" (U+2581) becomes a space and
/// a byte-fallback piece "<0xNN>" becomes that byte.
std::string detokenize(const gguf::File& file, const std::vector<int32_t>& ids) {
  const std::vector<std::string>& pieces = file.get_string_array("tokenizer.ggml.tokens");
  const std::string space_marker = "\xE2\x96\x81";
  std::string text;
  for (int32_t id : ids) {
    REQUIRE(id >= 0);
    REQUIRE(static_cast<size_t>(id) < pieces.size());
    const std::string& p = pieces[id];
    if (p.size() == 6 && p.rfind("<0x", 0) == 0 && p[5] == '>') {
      text.push_back(static_cast<char>(std::stoi(p.substr(3, 2), nullptr, 16)));
      continue;
    }
    for (size_t i = 0; i < p.size();) {
      if (p.compare(i, space_marker.size(), space_marker) == 0) {
        text.push_back(' ');
        i += space_marker.size();
      } else {
        text.push_back(p[i++]);
      }
    }
  }
  return text;
}

/// Options for copy_with: what to change while copying a GGUF file through the Writer.
struct CopyEdit {
  std::string drop_tensor;     ///< tensor to leave out
  std::string reshape_tensor;  ///< tensor written with `new_ne` (same bytes)
  std::vector<int64_t> new_ne;
  std::string set_architecture;  ///< new general.architecture value
  bool add_bias = false;         ///< adds blk.0.attn_q.bias (an unused tensor)
};

/// Re-encodes `src` with berth::gguf::Writer, applying `edit`, and parses the result.
gguf::File copy_with(const gguf::File& src, const CopyEdit& edit) {
  gguf::Writer w(3, src.alignment());
  for (const gguf::KeyValue& kv : src.kvs()) {
    if (kv.key == "general.alignment") continue;  // the Writer writes its own
    w.set(kv.key, kv.value);
  }
  if (!edit.set_architecture.empty()) w.set_string("general.architecture", edit.set_architecture);
  for (const gguf::TensorInfo& t : src.tensors()) {
    if (t.name == edit.drop_tensor) continue;
    std::vector<int64_t> ne(t.ne.begin(), t.ne.begin() + std::max<uint32_t>(t.n_dims, 1));
    if (t.name == edit.reshape_tensor) ne = edit.new_ne;
    w.add_tensor(t.name, t.type, ne, std::span<const uint8_t>(t.data, t.n_bytes));
  }
  if (edit.add_bias) {
    const int64_t n = src.get_int("llama.embedding_length");
    std::vector<uint8_t> zeros(static_cast<size_t>(n) * sizeof(float), 0);
    w.add_tensor("blk.0.attn_q.bias", GgmlType::F32, {n}, zeros);
  }
  return gguf::File::from_memory(w.to_bytes(), "edited-stories260K.gguf");
}

template <typename Fn>
Error expect_error(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e;
  }
  FAIL("no berth::Error was thrown");
  return Error(ErrorCategory::internal, "unreachable");
}

std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(float));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

}  // namespace

TEST_CASE("oracle: stories260K greedy continuation of 'Once upon a time' matches the golden text") {
  const gguf::File file = gguf::File::open(berth::test::stories260k().string());
  NaiveLlama m(file);
  const auto& c = m.config();
  CHECK(c.n_vocab == 512);
  CHECK(c.n_embd == 64);
  CHECK(c.n_layer == 5);
  CHECK(c.n_head == 8);
  CHECK(c.n_head_kv == 4);
  CHECK(c.n_ff == 172);
  CHECK(c.head_dim == 8);
  CHECK(c.n_rot == 8);
  CHECK(c.n_ctx == 2048);

  const std::vector<int32_t> ids = greedy_generate(m, kPrompt, 64);
  REQUIRE(ids.size() == 64);
  CHECK(m.pos() == static_cast<int32_t>(kPrompt.size() + 64));
  CHECK(detokenize(file, ids) == kGoldenText);
  CHECK(ids == kGoldenIds);
}

TEST_CASE("oracle: reset() reproduces the same logits bit for bit") {
  const gguf::File file = gguf::File::open(berth::test::stories260k().string());
  NaiveLlama m(file, 16);
  std::vector<std::vector<double>> first;
  for (int32_t t : kPrompt) first.push_back(m.step(t));
  CHECK(m.pos() == 5);
  m.reset();
  CHECK(m.pos() == 0);
  for (size_t i = 0; i < kPrompt.size(); ++i) {
    const std::vector<double> again = m.step(kPrompt[i]);
    REQUIRE(again.size() == 512);
    CHECK(again == first[i]);
  }
  // Logits at different positions differ (the KV cache is in use), and they are finite.
  CHECK(first[3] != first[4]);
  for (double v : first[4]) CHECK(std::isfinite(v));
}

TEST_CASE("oracle: n_ctx and token range are enforced") {
  const gguf::File file = gguf::File::open(berth::test::stories260k().string());
  NaiveLlama m(file, 2);
  m.step(1);
  m.step(403);
  CHECK(expect_error([&] { m.step(407); }).category() == ErrorCategory::invalid_argument);
  m.reset();
  CHECK(expect_error([&] { m.step(512); }).category() == ErrorCategory::invalid_argument);
  CHECK(expect_error([&] { m.step(-1); }).category() == ErrorCategory::invalid_argument);
  CHECK(expect_error([&] { greedy_generate(m, {}, 3); }).category() ==
        ErrorCategory::invalid_argument);
}

TEST_CASE("oracle: a missing tensor is a GgufError(missing_tensor) naming it") {
  const gguf::File src = gguf::File::open(berth::test::stories260k().string());
  const gguf::File file = copy_with(src, {.drop_tensor = "blk.2.ffn_up.weight"});
  try {
    NaiveLlama m(file);
    FAIL("expected missing_tensor");
  } catch (const gguf::GgufError& e) {
    CHECK(e.code() == gguf::Errc::missing_tensor);
    CHECK(e.category() == ErrorCategory::missing);
    CHECK(std::string(e.what()).find("blk.2.ffn_up.weight") != std::string::npos);
  }
}

TEST_CASE("oracle: a wrong-shaped tensor is Error(format) naming it with both shapes") {
  const gguf::File src = gguf::File::open(berth::test::stories260k().string());
  // attn_k maps 64 -> 4 KV heads * 8 = 32: ne {64, 32}. Same bytes, transposed shape.
  const gguf::File file =
      copy_with(src, {.reshape_tensor = "blk.0.attn_k.weight", .new_ne = {32, 64}});
  const Error e = expect_error([&] { NaiveLlama m(file); });
  CHECK(e.category() == ErrorCategory::format);
  const std::string what = e.what();
  CHECK(what.find("blk.0.attn_k.weight") != std::string::npos);
  CHECK(what.find("[32, 64]") != std::string::npos);
  CHECK(what.find("[64, 32]") != std::string::npos);
}

TEST_CASE("oracle: another architecture or an unused tensor is Error(unsupported)") {
  const gguf::File src = gguf::File::open(berth::test::stories260k().string());
  {
    const gguf::File file = copy_with(src, {.set_architecture = "qwen2"});
    const Error e = expect_error([&] { NaiveLlama m(file); });
    CHECK(e.category() == ErrorCategory::unsupported);
    CHECK(std::string(e.what()).find("qwen2") != std::string::npos);
  }
  {
    const gguf::File file = copy_with(src, {.add_bias = true});
    const Error e = expect_error([&] { NaiveLlama m(file); });
    CHECK(e.category() == ErrorCategory::unsupported);
    CHECK(std::string(e.what()).find("blk.0.attn_q.bias") != std::string::npos);
  }
}

// A one-layer model whose attention and FFN weights are all zero, with the head tied to the
// embedding: the layer adds nothing, so logits[v] = E[v] . (E[t] * w / sqrt(mean(E[t]^2) + eps)),
// small enough to check with numbers worked out by hand.
TEST_CASE("oracle: zero-weight layer and tied output give the hand-computed logits") {
  const int64_t n_embd = 4, n_vocab = 3, n_ff = 2;
  gguf::Writer w;
  w.set_string("general.architecture", "llama");
  w.set_u32("llama.embedding_length", n_embd);
  w.set_u32("llama.block_count", 1);
  w.set_u32("llama.attention.head_count", 2);
  w.set_u32("llama.attention.head_count_kv", 1);
  w.set_u32("llama.feed_forward_length", n_ff);
  w.set_u32("llama.context_length", 8);
  w.set_f32("llama.attention.layer_norm_rms_epsilon", 0.0f);
  // Rows: token 0 = (1, 1, 1, 1), token 1 = (2, 0, 0, 0), token 2 = (0, 0, 3, -4).
  w.add_tensor("token_embd.weight", GgmlType::F32, {n_embd, n_vocab},
               f32_bytes({1, 1, 1, 1, 2, 0, 0, 0, 0, 0, 3, -4}));
  w.add_tensor("output_norm.weight", GgmlType::F32, {n_embd}, f32_bytes({1, 2, 1, 0.5f}));
  auto zeros = [](int64_t n) { return f32_bytes(std::vector<float>(static_cast<size_t>(n))); };
  auto ones = [](int64_t n) { return f32_bytes(std::vector<float>(static_cast<size_t>(n), 1)); };
  w.add_tensor("blk.0.attn_norm.weight", GgmlType::F32, {n_embd}, ones(n_embd));
  w.add_tensor("blk.0.attn_q.weight", GgmlType::F32, {n_embd, 4}, zeros(16));
  w.add_tensor("blk.0.attn_k.weight", GgmlType::F32, {n_embd, 2}, zeros(8));
  w.add_tensor("blk.0.attn_v.weight", GgmlType::F32, {n_embd, 2}, zeros(8));
  w.add_tensor("blk.0.attn_output.weight", GgmlType::F32, {4, n_embd}, zeros(16));
  w.add_tensor("blk.0.ffn_norm.weight", GgmlType::F32, {n_embd}, ones(n_embd));
  w.add_tensor("blk.0.ffn_gate.weight", GgmlType::F32, {n_embd, n_ff}, zeros(8));
  w.add_tensor("blk.0.ffn_up.weight", GgmlType::F32, {n_embd, n_ff}, zeros(8));
  w.add_tensor("blk.0.ffn_down.weight", GgmlType::F32, {n_ff, n_embd}, zeros(8));
  const gguf::File file = gguf::File::from_memory(w.to_bytes(), "tiny-tied.gguf");

  NaiveLlama m(file);
  CHECK(m.config().tied_output);
  CHECK(m.config().head_dim == 2);
  CHECK(m.config().n_ctx == 8);
  // token 2: x = (0, 0, 3, -4), mean(x^2) = 25/4, rms = 2.5, xn = (0, 0, 1.2, -0.8).
  // logits = (0 + 0 + 1.2 - 0.8, 0, 3*1.2 + 4*0.8) = (0.4, 0, 6.8).
  std::vector<double> logits = m.step(2);
  REQUIRE(logits.size() == 3);
  CHECK(logits[0] == doctest::Approx(0.4).epsilon(1e-12));
  CHECK(logits[1] == doctest::Approx(0.0).epsilon(1e-12));
  CHECK(logits[2] == doctest::Approx(6.8).epsilon(1e-12));
  // token 1 at position 1: x = (2, 0, 0, 0), rms = 1, xn = (2, 0, 0, 0): logits (2, 4, 0).
  logits = m.step(1);
  CHECK(logits[0] == doctest::Approx(2.0).epsilon(1e-12));
  CHECK(logits[1] == doctest::Approx(4.0).epsilon(1e-12));
  CHECK(logits[2] == doctest::Approx(0.0).epsilon(1e-12));
}

// Non-F32 weights go through berth::ref::dequantize_rows. A file with Q8_0 (rows of 64) and F16
// (rows of 172, not a multiple of 32) weights must give exactly the logits of an F32 file that
// holds the same weights already decoded.
TEST_CASE("oracle: quantized weights are decoded through the reference dequantizer") {
  const gguf::File src = gguf::File::open(berth::test::stories260k().string());
  gguf::Writer wq(3, src.alignment()), wf(3, src.alignment());
  for (const gguf::KeyValue& kv : src.kvs()) {
    if (kv.key == "general.alignment") continue;
    wq.set(kv.key, kv.value);
    wf.set(kv.key, kv.value);
  }
  for (const gguf::TensorInfo& t : src.tensors()) {
    std::vector<int64_t> ne(t.ne.begin(), t.ne.begin() + std::max<uint32_t>(t.n_dims, 1));
    REQUIRE(t.type == GgmlType::F32);
    if (t.n_dims < 2) {  // norms stay F32 in both files
      wq.add_tensor(t.name, t.type, ne, std::span<const uint8_t>(t.data, t.n_bytes));
      wf.add_tensor(t.name, t.type, ne, std::span<const uint8_t>(t.data, t.n_bytes));
      continue;
    }
    const GgmlType type = t.ne[0] % 32 == 0 ? GgmlType::Q8_0 : GgmlType::F16;
    const int64_t n_rows = t.n_elements() / t.ne[0];
    const size_t row_bytes = berth::row_bytes(type, t.ne[0]);
    std::vector<uint8_t> packed(row_bytes * static_cast<size_t>(n_rows));
    std::vector<float> decoded(static_cast<size_t>(t.n_elements()));
    for (int64_t r = 0; r < n_rows; ++r) {
      std::vector<float> row(static_cast<size_t>(t.ne[0]));
      std::memcpy(row.data(), t.data + r * t.ne[0] * sizeof(float), row.size() * sizeof(float));
      berth::ref::quantize_row(type, row.data(), packed.data() + r * row_bytes, t.ne[0]);
      berth::ref::dequantize_row(type, packed.data() + r * row_bytes, decoded.data() + r * t.ne[0],
                                 t.ne[0]);
    }
    wq.add_tensor(t.name, type, ne, packed);
    wf.add_tensor(t.name, GgmlType::F32, ne, f32_bytes(decoded));
  }
  const gguf::File qfile = gguf::File::from_memory(wq.to_bytes(), "stories-q8_0-f16.gguf");
  const gguf::File ffile = gguf::File::from_memory(wf.to_bytes(), "stories-decoded-f32.gguf");
  NaiveLlama mq(qfile, 8), mf(ffile, 8), m32(src, 8);
  for (int32_t t : kPrompt) {
    const std::vector<double> lq = mq.step(t), lf = mf.step(t), l32 = m32.step(t);
    CHECK(lq == lf);
    CHECK(lq != l32);  // quantization did change the weights
  }
}
