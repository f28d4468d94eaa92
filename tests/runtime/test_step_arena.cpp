// The CPU executor's activation arena (graph/arena.h): values whose lifetimes overlap never share
// bytes, the arena is far smaller than one buffer per value, only the kept values are readable
// after a step, and the tokens are those of the model's f64 oracle run (the golden tests).
#include <doctest/doctest.h>

#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "berth/core/error.h"
#include "berth/graph/arena.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/runtime/session.h"
#include "berth/tools/synth.h"
#include "test_util.h"

using namespace berth;

namespace {

std::string moe_file() {
  SynthSpec spec = synth_preset("tiny-qwen3moe");
  spec.type = "f32";
  spec.seed = 5;
  const auto path = test::temp_dir("arena") / "tiny-qwen3moe-f32.gguf";
  if (!std::filesystem::exists(path)) write_synth_model(spec, path.string(), 2);
  return path.string();
}

}  // namespace

TEST_CASE("step_arena: values live at one op never overlap, and bytes are reused") {
  gguf::File file = gguf::File::open(moe_file());
  auto model = load_model(file);
  for (const int32_t n_tokens : {1, 7, 64}) {
    CAPTURE(n_tokens);
    const graph::Graph g = model->build_step(n_tokens, 1);
    const std::vector<graph::ValueId> keep = graph::kept_after_step(g);
    std::vector<size_t> off;
    const size_t arena = graph::step_arena(g, keep, off);
    REQUIRE(off.size() == g.values.size());
    const size_t n_ops = g.ops.size();
    // Lifetimes from the ops alone (each op its own time: stricter than the matmul groups).
    std::vector<int64_t> birth(g.values.size(), -1), death(g.values.size(), -1);
    for (size_t i = 0; i < n_ops; ++i) {
      const auto o = static_cast<size_t>(g.ops[i].output);
      birth[o] = static_cast<int64_t>(i);
      death[o] = std::max(death[o], static_cast<int64_t>(i));
      for (graph::ValueId v : g.ops[i].inputs)
        death[static_cast<size_t>(v)] = std::max(death[static_cast<size_t>(v)], int64_t(i));
    }
    death[static_cast<size_t>(g.output)] = static_cast<int64_t>(n_ops);
    for (graph::ValueId v : keep) death[static_cast<size_t>(v)] = static_cast<int64_t>(n_ops);
    const auto bytes = [&](size_t v) {
      return static_cast<size_t>(g.values[v].rows * g.values[v].cols) * sizeof(float);
    };
    size_t sum = 0;
    for (size_t v = 0; v < g.values.size(); ++v) {
      sum += bytes(v);
      CHECK(off[v] % 256 == 0);
      CHECK(off[v] + bytes(v) <= arena);
    }
    size_t overlaps = 0;
    for (size_t a = 0; a < g.values.size(); ++a)
      for (size_t b = a + 1; b < g.values.size(); ++b) {
        if (bytes(a) == 0 || bytes(b) == 0 || birth[a] < 0 || birth[b] < 0) continue;
        const bool live_together = birth[a] <= death[b] && birth[b] <= death[a];
        const bool share = off[a] < off[b] + bytes(b) && off[b] < off[a] + bytes(a);
        if (live_together && share) ++overlaps;
      }
    CHECK(overlaps == 0);
    // Reuse: a layer's values come and go, so the arena is a fraction of the sum (2 layers here;
    // 48-layer qwen3-30b-a3b at -ub 512: 27.7 MiB against 2898.7 MiB).
    CHECK(arena < sum);
  }
}

TEST_CASE("CpuExecutor: after a step, the output and the routes are readable, nothing else") {
  gguf::File file = gguf::File::open(moe_file());
  auto model = load_model(file);
  SessionParams p;
  p.n_ctx = 64;
  p.n_threads = 1;
  Session s(*model, p);
  const std::vector<int32_t> prompt = {3, 17, 42, 9, 100, 7};
  (void)s.eval(prompt);
  const graph::Graph g = model->build_step(static_cast<int32_t>(prompt.size()), 1);
  size_t routes = 0;
  for (const graph::Op& op : g.ops) {
    if (op.kind != graph::OpKind::moe_route) continue;
    CHECK(s.executor().value(g, op.output).size() ==
          static_cast<size_t>(g.values[static_cast<size_t>(op.output)].rows *
                              g.values[static_cast<size_t>(op.output)].cols));
    ++routes;
  }
  CHECK(routes == static_cast<size_t>(model->hparams().n_layer));
  CHECK(s.executor().value(g, g.output).size() > 0);
  // A value whose bytes later ops reused: refused, naming it.
  const graph::ValueId first = g.ops.front().output;
  test::expect_error(ErrorCategory::invalid_argument, [&] { (void)s.executor().value(g, first); },
                     {"was not kept", g.values[static_cast<size_t>(first)].name});
}
