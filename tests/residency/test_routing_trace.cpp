// Routing trace format: round trips, the exact bytes of the header, and every validation error
// with its category and where it points (byte offset, token, layer).
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "berth/core/error.h"
#include "berth/residency/routing_trace.h"
#include "test_util.h"

namespace {

using berth::Error;
using berth::ErrorCategory;
using namespace berth::residency;
using berth::test::expect_error;

std::vector<uint8_t> file_bytes(const std::filesystem::path& p) {
  const std::string s = berth::test::read_file(p);
  return {s.begin(), s.end()};
}

void put_bytes(const std::filesystem::path& p, const std::vector<uint8_t>& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// 3 MoE layers at blocks 1, 3, 4 (a model with dense layers 0 and 2), 10 experts, top-2,
// 4 tokens (2 prefill, 2 decode).
RoutingTrace small_trace(bool weights) {
  RoutingTrace tr;
  tr.shape.n_layer = 3;
  tr.shape.n_expert = 10;
  tr.shape.n_expert_used = 2;
  tr.shape.has_weights = weights;
  tr.shape.blocks = {1, 3, 4};
  tr.kinds = {TokenKind::prefill, TokenKind::prefill, TokenKind::decode, TokenKind::decode};
  tr.ids = {0, 9, 1, 2, 3, 4,  //
            5, 6, 7, 8, 9, 0,  //
            1, 0, 2, 1, 3, 2,  //
            4, 3, 5, 4, 6, 5};
  if (weights)  // exact in binary16
    for (size_t i = 0; i < tr.ids.size(); ++i) tr.weights.push_back(i % 2 ? 0.25f : 0.75f);
  return tr;
}

void check_same(const RoutingTrace& a, const RoutingTrace& b) {
  CHECK(a.shape.n_layer == b.shape.n_layer);
  CHECK(a.shape.n_expert == b.shape.n_expert);
  CHECK(a.shape.n_expert_used == b.shape.n_expert_used);
  CHECK(a.shape.has_weights == b.shape.has_weights);
  CHECK(a.shape.blocks == b.shape.blocks);
  CHECK(a.kinds == b.kinds);
  CHECK(a.ids == b.ids);
  CHECK(a.weights == b.weights);
}

// Offsets in small_trace(false)'s file: header 32 + 3 blocks * 4 = 44; records of
// 1 + 3 * 2 = 7 bytes; token t's layer l slot j id at 44 + 7t + 1 + 2l + j.
constexpr int64_t kData = 44;
constexpr int64_t kRec = 7;
int64_t id_offset(int64_t t, int64_t l, int64_t j) { return kData + kRec * t + 1 + 2 * l + j; }

}  // namespace

TEST_CASE("routing trace: header bytes and size formula") {
  const auto dir = berth::test::temp_dir("trace-header");
  const auto path = (dir / "t.trace").string();
  write_routing_trace(path, small_trace(false));
  const std::vector<uint8_t> b = file_bytes(path);
  const std::vector<uint8_t> header = {'B', 'R', 'T', 'R', 1, 0, 0, 0,  // magic, version 1
                                       3,   0,   0,   0,                // n_layer
                                       10,  0,   0,   0,                // n_expert
                                       2,   0,   0,   0,                // n_expert_used
                                       0,   0,   0,   0,                // flags
                                       4,   0,   0,   0,   0, 0, 0, 0,  // n_tokens
                                       1,   0,   0,   0,   3, 0, 0, 0, 4, 0, 0, 0};  // blocks
  REQUIRE(b.size() == static_cast<size_t>(kData + 4 * kRec));
  CHECK(std::vector<uint8_t>(b.begin(), b.begin() + kData) == header);
  // Token 1: kind 0 (prefill), then ids 5 6 | 7 8 | 9 0.
  CHECK(std::vector<uint8_t>(b.begin() + kData + kRec, b.begin() + kData + 2 * kRec) ==
        std::vector<uint8_t>{0, 5, 6, 7, 8, 9, 0});
  CHECK(b[kData + 2 * kRec] == 1);  // token 2 is decode

  TraceShape s;
  s.n_layer = 48;
  s.n_expert = 128;
  s.n_expert_used = 8;
  CHECK(s.record_bytes() == 385);  // 100k tokens: 38.5 MB
  s.has_weights = true;
  CHECK(s.record_bytes() == 1 + 384 * 3);
  s.n_expert = 300;  // u16 ids
  CHECK(s.id_bytes() == 2);
  CHECK(s.record_bytes() == 1 + 384 * 4);
}

TEST_CASE("routing trace: round trips (u8 and u16 ids, with and without weights, step-wise)") {
  const auto dir = berth::test::temp_dir("trace-roundtrip");
  for (bool weights : {false, true}) {
    const RoutingTrace tr = small_trace(weights);
    const auto path = (dir / (weights ? "w.trace" : "n.trace")).string();
    write_routing_trace(path, tr);
    const RoutingTrace back = read_routing_trace(path);
    check_same(tr, back);
    CHECK(back.layer_of_block(3) == 1);
    CHECK(back.layer_of_block(2) == -1);  // a dense layer
    CHECK(back.token_ids(2, 1)[0] == 2);
    CHECK(back.token_ids(2, 1)[1] == 1);

    // The executor's view: moe_route outputs per layer, layers in any order, two steps.
    const auto path2 = (dir / (weights ? "w2.trace" : "n2.trace")).string();
    {
      RoutingTraceWriter w(path2, tr.shape);
      const int32_t k = 2;
      auto route = [&](int64_t t0, int64_t n, int32_t l) {
        std::vector<float> r;
        for (int64_t t = t0; t < t0 + n; ++t) {
          const auto ids = tr.token_ids(t, l);
          for (uint16_t id : ids) r.push_back(id);
          for (int32_t j = 0; j < k; ++j)
            r.push_back(weights ? tr.weights[static_cast<size_t>((t * 3 + l) * k + j)] : 0.0f);
        }
        return r;
      };
      w.begin_step(TokenKind::prefill, 2);  // the prompt's ubatch
      for (int32_t l : {2, 0, 1}) w.add_layer_route(l, route(0, 2, l).data());
      w.end_step();
      for (int64_t t = 2; t < 4; ++t) {  // two decode steps
        w.begin_step(TokenKind::decode, 1);
        for (int32_t l = 0; l < 3; ++l) w.add_layer_route(l, route(t, 1, l).data());
        w.end_step();
      }
      CHECK(w.n_tokens() == 4);
    }  // the destructor finishes
    CHECK(file_bytes(path2) == file_bytes(path));
  }

  // u16 ids and the writer's default blocks.
  RoutingTrace big;
  big.shape.n_layer = 2;
  big.shape.n_expert = 300;
  big.shape.n_expert_used = 3;
  big.kinds = {TokenKind::decode, TokenKind::decode};
  big.ids = {299, 256, 0, 1, 2, 255, 258, 257, 3, 100, 200, 298};
  const auto path = (dir / "big.trace").string();
  write_routing_trace(path, big);
  CHECK(std::filesystem::file_size(path) == 32 + 8 + 2 * (1 + 6 * 2));
  const RoutingTrace back = read_routing_trace(path);
  CHECK(back.ids == big.ids);
  CHECK(back.shape.blocks == std::vector<int32_t>{0, 1});

  // An empty trace is valid.
  RoutingTrace empty = small_trace(false);
  empty.kinds.clear();
  empty.ids.clear();
  write_routing_trace(path, empty);
  CHECK(read_routing_trace(path).n_tokens() == 0);
}

TEST_CASE("routing trace: the text dump") {
  const RoutingTrace tr = small_trace(true);
  CHECK(dump_routing_trace(tr, 1, 1) ==
        "# routing trace: n_layer 3, n_expert 10, n_expert_used 2, n_tokens 4, weights yes\n"
        "# token kind layer block: ids in top-k order (id:weight)\n"
        "1 prefill 0 1: 5:0.7500 6:0.2500\n"
        "1 prefill 1 3: 7:0.7500 8:0.2500\n"
        "1 prefill 2 4: 9:0.7500 0:0.2500\n");
  CHECK(dump_routing_trace(small_trace(false), 3, 100, false) ==
        "3 decode 0 1: 4 3\n3 decode 1 3: 5 4\n3 decode 2 4: 6 5\n");
  CHECK(dump_routing_trace(tr, 9, 1, false).empty());
}

TEST_CASE("routing trace: every header error, with category and byte offset") {
  const auto dir = berth::test::temp_dir("trace-header-errors");
  const auto good_path = (dir / "good.trace").string();
  write_routing_trace(good_path, small_trace(false));
  const std::vector<uint8_t> good = file_bytes(good_path);
  const auto path = (dir / "bad.trace").string();
  // Writes `b` and reads it back through the file reader (the path must be in the message).
  auto read_bad = [&](const std::vector<uint8_t>& b) {
    put_bytes(path, b);
    return [&] { (void)read_routing_trace(path); };
  };
  auto patched = [&](size_t off, std::vector<uint8_t> bytes) {
    std::vector<uint8_t> b = good;
    std::memcpy(b.data() + off, bytes.data(), bytes.size());
    return b;
  };

  expect_error(ErrorCategory::io, [&] { (void)read_routing_trace((dir / "none").string()); },
               {"none", "cannot open"});
  expect_error(ErrorCategory::io, [&] { (void)read_routing_trace(dir.string()); },
               {"not a regular file"});
  expect_error(ErrorCategory::format, read_bad(patched(0, {'G', 'G', 'U', 'F'})),
               {path, "byte 0", "bad magic 'GGUF'"});
  expect_error(ErrorCategory::format, read_bad({'B', 'R'}), {path, "byte 2", "truncated header"});
  expect_error(ErrorCategory::format,
               read_bad(std::vector<uint8_t>(good.begin(), good.begin() + 20)),
               {path, "byte 20", "truncated header", "needs 32"});
  expect_error(ErrorCategory::format, read_bad({}), {path, "byte 0", "truncated header"});
  expect_error(ErrorCategory::unsupported, read_bad(patched(4, {2, 0, 0, 0})),
               {path, "byte 4", "version 2"});
  expect_error(ErrorCategory::format, read_bad(patched(8, {0, 0, 0, 0})),
               {path, "byte 8", "n_layer 0"});
  expect_error(ErrorCategory::format, read_bad(patched(8, {0x01, 0x10, 0, 0})),
               {path, "byte 8", "n_layer 4097"});
  expect_error(ErrorCategory::format, read_bad(patched(12, {0, 0, 0, 0})),
               {path, "byte 12", "n_expert 0"});
  expect_error(ErrorCategory::format, read_bad(patched(12, {1, 0, 1, 0})),
               {path, "byte 12", "n_expert 65537"});
  expect_error(ErrorCategory::format, read_bad(patched(16, {11, 0, 0, 0})),
               {path, "byte 16", "n_expert_used 11", "n_expert 10"});
  expect_error(ErrorCategory::format, read_bad(patched(16, {0, 0, 0, 0})),
               {path, "byte 16", "n_expert_used 0"});
  expect_error(ErrorCategory::unsupported, read_bad(patched(20, {2, 0, 0, 0})),
               {path, "byte 20", "unknown flag bits 0x2"});
  // Block table: layer 1's block (byte 36) equal to layer 0's.
  expect_error(ErrorCategory::format, read_bad(patched(36, {1, 0, 0, 0})),
               {path, "byte 36", "layer 1", "block index 1", "increase strictly"});
  expect_error(ErrorCategory::format, read_bad(patched(32, {0, 0, 0, 0x80})),
               {path, "byte 32", "layer 0", "block index 2147483648 is above"});
  expect_error(ErrorCategory::format,
               read_bad(std::vector<uint8_t>(good.begin(), good.begin() + 38)),
               {path, "byte 38", "truncated block table at layer 1"});
}

TEST_CASE("routing trace: every record error names the offset, token and layer") {
  const auto dir = berth::test::temp_dir("trace-record-errors");
  const auto good_path = (dir / "good.trace").string();
  write_routing_trace(good_path, small_trace(false));
  const std::vector<uint8_t> good = file_bytes(good_path);
  const std::string name = "mem.trace";
  auto parse = [&](std::vector<uint8_t> b) {
    return [b, &name] { (void)parse_routing_trace(b, name); };
  };
  auto with = [&](int64_t off, uint8_t v) {
    std::vector<uint8_t> b = good;
    b[static_cast<size_t>(off)] = v;
    return b;
  };
  auto cut = [&](int64_t size) { return std::vector<uint8_t>(good.begin(), good.begin() + size); };

  // Truncated: the data ends inside token 2's layer 1 ids, at its kind byte, in the weights.
  expect_error(ErrorCategory::format, parse(cut(id_offset(2, 1, 1))),
               {name, fmt::format("byte {}", id_offset(2, 1, 1)), "truncated in token 2",
                "layer 1 (block 3), its ids", "n_tokens 4"});
  expect_error(ErrorCategory::format, parse(cut(kData + 3 * kRec)),
               {fmt::format("byte {}", kData + 3 * kRec), "truncated in token 3", "kind byte"});
  expect_error(ErrorCategory::format, parse(cut(kData)),
               {fmt::format("byte {}", kData), "truncated in token 0"});
  {
    const auto wpath = (dir / "w.trace").string();
    write_routing_trace(wpath, small_trace(true));
    std::vector<uint8_t> w = file_bytes(wpath);
    // Weighted records: 1 + 6 ids + 12 weight bytes = 19; token 1's layer 2 weights start at
    // 44 + 19 + 7 + 8 = 78.
    w.resize(79);
    expect_error(ErrorCategory::format, parse(w),
                 {"byte 79", "truncated in token 1", "layer 2 (block 4), its weights"});
  }
  std::vector<uint8_t> longer = good;
  longer.push_back(0);
  expect_error(ErrorCategory::format, parse(longer),
               {fmt::format("byte {}", kData + 4 * kRec), "1 bytes after the last"});

  // Values: an id out of range, a repeated id, a bad kind byte.
  expect_error(ErrorCategory::format, parse(with(id_offset(1, 2, 1), 10)),
               {name, fmt::format("byte {}", id_offset(1, 2, 1)), "token 1, layer 2 (block 4)",
                "slot 1", "expert id 10 >= n_expert 10"});
  expect_error(ErrorCategory::format, parse(with(id_offset(3, 0, 1), 4)),
               {fmt::format("byte {}", id_offset(3, 0, 1)), "token 3, layer 0 (block 1)",
                "expert id 4 repeats within the token's top-2"});
  expect_error(ErrorCategory::format, parse(with(kData + 2 * kRec, 2)),
               {fmt::format("byte {}", kData + 2 * kRec), "token 2", "kind 2"});

  // Weights: NaN, infinite and negative binary16 values.
  const auto wpath = (dir / "w.trace").string();
  write_routing_trace(wpath, small_trace(true));
  const std::vector<uint8_t> w = file_bytes(wpath);
  // Token 2, layer 1, slot 0's weight: 44 + 2 * 19 + 7 + 2 * (1 * 2 + 0) = 93.
  for (uint16_t h : {uint16_t{0x7e00}, uint16_t{0x7c00}, uint16_t{0xbc00}}) {
    std::vector<uint8_t> b = w;
    b[93] = static_cast<uint8_t>(h);
    b[94] = static_cast<uint8_t>(h >> 8);
    expect_error(ErrorCategory::format, parse(b),
                 {"byte 93", "token 2, layer 1 (block 3)", "slot 0", "not a finite value >= 0"});
  }
  // Negative zero is zero: allowed.
  std::vector<uint8_t> nz = w;
  nz[93] = 0x00;
  nz[94] = 0x80;
  CHECK(parse_routing_trace(nz, name).weights[2 * 6 + 2] == 0.0f);
}

TEST_CASE("routing trace: the writer refuses what the reader would") {
  const auto dir = berth::test::temp_dir("trace-writer-errors");
  const auto path = (dir / "w.trace").string();
  TraceShape s = small_trace(false).shape;
  TraceShape bad = s;
  bad.n_expert_used = 11;
  expect_error(ErrorCategory::invalid_argument, [&] { RoutingTraceWriter w(path, bad); },
               {"n_expert_used 11"});
  bad = s;
  bad.blocks = {1, 1, 4};
  expect_error(ErrorCategory::invalid_argument, [&] { RoutingTraceWriter w(path, bad); },
               {"MoE layer 1"});
  bad.blocks = {1, 3};
  expect_error(ErrorCategory::invalid_argument, [&] { RoutingTraceWriter w(path, bad); },
               {"2 block indices for n_layer 3"});
  expect_error(ErrorCategory::io,
               [&] { RoutingTraceWriter w((dir / "no" / "such" / "dir").string(), s); },
               {"cannot create"});

  RoutingTraceWriter w(path, s);
  const std::vector<uint16_t> ok = {0, 1, 2, 3, 4, 5};
  w.append_token(TokenKind::decode, ok);
  std::vector<uint16_t> ids = ok;
  ids[5] = 10;
  expect_error(ErrorCategory::invalid_argument, [&] { w.append_token(TokenKind::decode, ids); },
               {"token 1, layer 2 (block 4), slot 1", "expert id 10 >= n_expert 10"});
  ids[5] = 4;
  expect_error(ErrorCategory::invalid_argument, [&] { w.append_token(TokenKind::decode, ids); },
               {"token 1, layer 2 (block 4), slot 1", "repeats"});
  expect_error(ErrorCategory::invalid_argument,
               [&] { w.append_token(TokenKind::decode, std::span(ok).first(5)); },
               {"5 ids, expected n_layer * n_expert_used = 6"});
  expect_error(ErrorCategory::invalid_argument,
               [&] { w.append_token(static_cast<TokenKind>(2), ok); }, {"token 1: kind 2"});
  const std::vector<float> weights(6, 0.5f);
  expect_error(ErrorCategory::invalid_argument,
               [&] { w.append_token(TokenKind::decode, ok, weights); }, {"6 weights, expected 0"});

  // Step-wise misuse.
  expect_error(ErrorCategory::invalid_argument, [&] { w.end_step(); }, {"outside a step"});
  std::vector<float> route = {0, 1, 0.5f, 0.5f};
  expect_error(ErrorCategory::invalid_argument, [&] { w.add_layer_route(0, route.data()); },
               {"outside a step"});
  w.begin_step(TokenKind::decode, 1);
  expect_error(ErrorCategory::invalid_argument, [&] { w.begin_step(TokenKind::decode, 1); },
               {"inside a step"});
  expect_error(ErrorCategory::invalid_argument, [&] { w.add_layer_route(3, route.data()); },
               {"layer 3 is outside 0..2"});
  w.add_layer_route(0, route.data());
  expect_error(ErrorCategory::invalid_argument, [&] { w.add_layer_route(0, route.data()); },
               {"layer 0 given twice"});
  route[1] = 1.5f;
  expect_error(ErrorCategory::invalid_argument, [&] { w.add_layer_route(1, route.data()); },
               {"token 1, layer 1, slot 1", "route id 1.5"});
  route[1] = 0.0f;  // repeats slot 0's id: caught at end_step, before anything is written
  w.add_layer_route(1, route.data());
  expect_error(ErrorCategory::invalid_argument, [&] { w.end_step(); },
               {"end_step without layer 2 (block 4)"});
  w.add_layer_route(2, std::vector<float>{3, 4, 0, 0}.data());
  expect_error(ErrorCategory::invalid_argument, [&] { w.end_step(); },
               {"token 1, layer 1 (block 3), slot 1", "repeats"});
  w.finish();
  expect_error(ErrorCategory::invalid_argument, [&] { w.append_token(TokenKind::decode, ok); },
               {"after finish"});
  // Only the one good token was written.
  const RoutingTrace back = read_routing_trace(path);
  CHECK(back.n_tokens() == 1);
  CHECK(back.ids == ok);

  RoutingTrace inconsistent = small_trace(true);
  inconsistent.weights.pop_back();
  expect_error(ErrorCategory::invalid_argument, [&] { write_routing_trace(path, inconsistent); },
               {"23 weights"});
}

TEST_CASE("routing trace: corrupted files give an Error, never a crash") {
  // Random byte changes and cuts of a valid weighted trace (run under ASan in CI's sanitizer
  // build): the parser either accepts the bytes or throws berth::Error(format | unsupported).
  const auto dir = berth::test::temp_dir("trace-corrupt");
  const auto path = (dir / "w.trace").string();
  write_routing_trace(path, small_trace(true));
  const std::vector<uint8_t> good = file_bytes(path);
  uint64_t x = 12345;
  auto rnd = [&] {  // xorshift64
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
  };
  int accepted = 0, rejected = 0;
  for (int i = 0; i < 3000; ++i) {
    std::vector<uint8_t> b = good;
    for (int n = 1 + static_cast<int>(rnd() % 3); n > 0; --n)
      b[rnd() % b.size()] = static_cast<uint8_t>(rnd());
    if (i % 4 == 0) b.resize(rnd() % (b.size() + 1));
    try {
      const RoutingTrace tr = parse_routing_trace(b, "fuzz");
      CHECK(tr.ids.size() == static_cast<size_t>(tr.n_tokens() * tr.shape.ids_per_token()));
      ++accepted;
    } catch (const Error& e) {
      const bool expected =
          e.category() == ErrorCategory::format || e.category() == ErrorCategory::unsupported;
      CHECK(expected);
      ++rejected;
    }
  }
  CHECK(accepted > 0);  // changes to ids and weights that stay valid
  CHECK(rejected > 0);
}

TEST_CASE("routing replay: wraps around and refuses a trace of another model") {
  const RoutingTrace tr = small_trace(false);  // MoE blocks 1, 3, 4; 10 experts, top-2
  const std::vector<int32_t> blocks = {1, 3, 4};
  const RoutingReplay r(tr, "t.trace", blocks, 10, 2);
  CHECK(r.ids(0, 1)[0] == 0);
  CHECK(r.ids(0, 1)[1] == 9);
  CHECK(r.ids(3, 4)[0] == 6);
  CHECK(r.ids(7, 4)[0] == 6);                 // token 7 of the run is the trace's token 3
  CHECK(r.ids(5, 3)[1] == 8);                 // token 5 -> trace token 1, layer 1
  CHECK_THROWS_AS((void)r.ids(0, 2), Error);  // a dense layer: a bug in the caller
  CHECK_THROWS_AS((void)r.ids(0, 9), Error);

  expect_error(ErrorCategory::invalid_argument,
               [&] { RoutingReplay(tr, "t.trace", blocks, 12, 2); },
               {"t.trace: routing trace does not fit the model", "n_expert 10, the model 12"});
  expect_error(ErrorCategory::invalid_argument,
               [&] { RoutingReplay(tr, "t.trace", blocks, 10, 3); },
               {"n_expert_used 2, the model 3"});
  const std::vector<int32_t> other = {0, 1, 2, 3};
  expect_error(ErrorCategory::invalid_argument, [&] { RoutingReplay(tr, "t.trace", other, 10, 2); },
               {"blocks 1,3,4, the model's 0,1,2,3"});
  RoutingTrace empty = tr;
  empty.kinds.clear();
  empty.ids.clear();
  expect_error(ErrorCategory::invalid_argument,
               [&] { RoutingReplay(empty, "t.trace", blocks, 10, 2); }, {"no tokens"});
}
