// The step graph IR, the worker pool and the CPU executor's ops on small hand-made graphs.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <set>
#include <thread>

#include "berth/backends/cpu_executor.h"
#include "berth/backends/thread_pool.h"
#include "berth/core/error.h"
#include "berth/cpu_kernels/ops.h"
#include "berth/cpu_kernels/quant_dot.h"
#include "berth/cpu_kernels/quants_ref.h"
#include "berth/graph/graph.h"
#include "berth/runtime/kv_cache.h"

using namespace berth;

namespace {

TensorView f32_view(const std::string& name, const std::vector<float>& data, int64_t ne0,
                    int64_t ne1 = 1) {
  TensorView v;
  v.name = name;
  v.type = GgmlType::F32;
  v.ne = {ne0, ne1, 1, 1};
  v.n_dims = ne1 > 1 ? 2 : 1;
  v.data = data.data();
  v.n_bytes = data.size() * sizeof(float);
  return v;
}

std::vector<float> random_floats(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

}  // namespace

TEST_CASE("ThreadPool covers every index once, for any thread count") {
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    // Lowered to the machine's hardware threads when more are asked for.
    const int hw = static_cast<int>(std::thread::hardware_concurrency());
    CHECK(pool.n_threads() == (hw > 0 ? std::min(threads, hw) : threads));
    for (int64_t n : {1, 7, 1000}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      pool.parallel_for(n, 3, [&](int64_t b, int64_t e) {
        CHECK(ThreadPool::worker_index() < pool.n_threads());
        for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)]++;
      });
      for (auto& h : hits) CHECK(h.load() == 1);
    }
  }
}

TEST_CASE("ThreadPool propagates exceptions and rejects zero threads") {
  ThreadPool pool(2);
  CHECK_THROWS_AS(pool.parallel_for(100, 1,
                                    [](int64_t b, int64_t) {
                                      if (b == 50) throw Error(ErrorCategory::internal, "boom");
                                    }),
                  Error);
  CHECK_THROWS_AS(ThreadPool(0), Error);
}

TEST_CASE("ThreadPool::spin_until: every thread waits with the caller, and the limit holds") {
  ThreadPool pool(2);
  // Already done: returns at once.
  CHECK(pool.spin_until([] { return true; }, 1000000));
  // Never done: returns false after the limit (2 ms), not much later.
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_FALSE(pool.spin_until([] { return false; }, 2000));
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  CHECK(ms >= 2.0);
  CHECK(ms < 1000.0);
  // Done once every thread of the pool is in the wait: the workers spin with the caller.
  std::mutex mu;
  std::set<std::thread::id> seen;
  const bool ok = pool.spin_until(
      [&] {
        std::lock_guard<std::mutex> lock(mu);
        seen.insert(std::this_thread::get_id());
        return static_cast<int>(seen.size()) >= pool.n_threads();
      },
      10000000);
  CHECK(ok);
  CHECK(static_cast<int>(seen.size()) == pool.n_threads());
}

TEST_CASE("Graph::validate rejects shape mismatches and use before write") {
  std::vector<float> w(4 * 3, 1.0f);
  graph::WeightTable wt;
  graph::WeightId wid = wt.add(f32_view("w", w, 4, 3));
  graph::WeightId embd = wt.add(f32_view("embd", w, 4, 3));
  {
    graph::Builder b(wt, 2);
    graph::ValueId x = b.embed(embd, "x");
    graph::ValueId y = b.matmul(x, wid, "y");
    CHECK(b.info(y).cols == 3);
    CHECK_NOTHROW(b.finish(y));
  }
  {
    graph::Graph g;
    g.n_tokens = 1;
    graph::ValueId a = g.add_value(1, 4, "a");
    graph::ValueId o = g.add_value(1, 3, "o");
    g.add_op(graph::Op{
        .kind = graph::OpKind::matmul, .inputs = {a}, .output = o, .weight = wid, .name = "mm"});
    g.output = o;
    CHECK_THROWS_WITH_AS(g.validate(wt), doctest::Contains("before it is written"), Error);
  }
  {
    graph::Graph g;
    g.n_tokens = 1;
    graph::ValueId x = g.add_value(1, 4, "x");
    g.add_op(graph::Op{.kind = graph::OpKind::embed, .output = x, .weight = embd, .name = "e"});
    graph::ValueId o = g.add_value(1, 5, "o");  // wrong: weight has 3 rows
    g.add_op(graph::Op{
        .kind = graph::OpKind::matmul, .inputs = {x}, .output = o, .weight = wid, .name = "mm"});
    g.output = o;
    CHECK_THROWS_WITH_AS(g.validate(wt), doctest::Contains("output shape"), Error);
  }
}

TEST_CASE("executor matmul over every computable weight type equals the decoded product") {
  // The executor quantizes the activations once (Q8_0 / Q8_K / none, by weight type), splits the
  // rows over the pool and runs gemm_rows; the result must equal the double-precision product of
  // the decoded weights and the decoded (quantized) activations.
  const int64_t n_in = 512, n_out = 37, n_tok = 3;
  const std::vector<float> wf = random_floats(static_cast<size_t>(n_in * n_out), 1, 0.5f);
  const std::vector<float> x = random_floats(static_cast<size_t>(n_in * n_tok), 2);
  const std::vector<int32_t> toks = {0, 1, 2}, pos = {0, 1, 2};
  ThreadPool pool(2);
  KvCache kv({}, 4);
  for (GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1,
                     GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::Q3_K,
                     GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K}) {
    CAPTURE(type_name(t));
    const size_t rb = row_bytes(t, n_in);
    std::vector<uint8_t> q(rb * n_out);
    for (int64_t o = 0; o < n_out; ++o)
      ref::quantize_row(t, wf.data() + o * n_in, q.data() + o * rb, n_in);
    std::vector<float> deq(static_cast<size_t>(n_in * n_out));
    ref::dequantize_rows(t, q.data(), deq.data(), n_out, n_in);
    // The activations as the dot product sees them: quantized to the partner format, decoded.
    const GgmlType at = cpu::activation_type(t);
    std::vector<float> xa(x.size());
    std::vector<uint8_t> abuf(cpu::activation_row_bytes(t, n_in));
    for (int64_t tk = 0; tk < n_tok; ++tk) {
      ref::quantize_activation(t, x.data() + tk * n_in, abuf.data(), n_in);
      if (at == GgmlType::F32)
        std::memcpy(xa.data() + tk * n_in, abuf.data(), abuf.size());
      else
        ref::dequantize_row(at, abuf.data(), xa.data() + tk * n_in, n_in);
    }
    graph::WeightTable wt;
    graph::WeightId e = wt.add(f32_view("x", x, n_in, n_tok));
    graph::WeightId wid = wt.add(TensorView{.name = "w",
                                            .type = t,
                                            .ne = {n_in, n_out, 1, 1},
                                            .n_dims = 2,
                                            .data = q.data(),
                                            .n_bytes = q.size()});
    graph::Builder b(wt, static_cast<int32_t>(n_tok));
    graph::Graph g = b.finish(b.matmul(b.embed(e, "x"), wid, "y"));
    CpuExecutor ex(pool, wt, kv.view());
    std::span<const float> y = ex.run(g, toks, pos);
    for (int64_t tk = 0; tk < n_tok; ++tk)
      for (int64_t o = 0; o < n_out; ++o) {
        double ref = 0;
        for (int64_t i = 0; i < n_in; ++i)
          ref += static_cast<double>(deq[o * n_in + i]) * xa[tk * n_in + i];
        CHECK(y[static_cast<size_t>(tk * n_out + o)] ==
              doctest::Approx(ref).epsilon(1e-4).scale(10));
      }
  }
}

TEST_CASE("executor: rope, attention with grouped heads and the KV cache, on a tiny graph") {
  // One layer of attention only: embed -> q = k = v = embedding, 2 query heads sharing 1 KV head.
  const int64_t head_dim = 4, n_vocab = 6;
  std::vector<float> embd = random_floats(static_cast<size_t>(head_dim * 2 * n_vocab), 7);
  std::vector<float> wk = random_floats(static_cast<size_t>(head_dim * 2 * head_dim), 8);
  graph::WeightTable wt;
  graph::WeightId e = wt.add(f32_view("embd", embd, head_dim * 2, n_vocab));
  graph::WeightId k = wt.add(f32_view("wk", wk, head_dim * 2, head_dim));
  auto build = [&](int32_t n_tokens) {
    graph::Builder b(wt, n_tokens);
    graph::ValueId x = b.embed(e, "x");
    graph::RopeParams rq{.n_head = 2, .head_dim = 4, .n_rot = 4, .freq_base = 10000.0f};
    graph::RopeParams rk = rq;
    rk.n_head = 1;
    graph::ValueId q = b.rope(x, rq, "q");
    graph::ValueId kk = b.rope(b.matmul(x, k, "k"), rk, "rk");
    graph::ValueId v = b.matmul(x, k, "v");
    graph::ValueId a = b.attention(
        q, kk, v, {.layer = 0, .n_head = 2, .n_head_kv = 1, .head_dim = 4, .scale = 0.5f}, "attn");
    return b.finish(a);
  };
  const std::vector<int32_t> toks = {3, 1, 4, 1, 5};
  const std::vector<int32_t> pos = {0, 1, 2, 3, 4};

  ThreadPool pool(2);
  KvCache kv({KvLayer{4, 4}}, 8);
  CpuExecutor ex(pool, wt, kv.view());
  graph::Graph g = build(5);
  std::span<const float> out = ex.run(g, toks, pos);
  std::vector<float> batched(out.begin(), out.end());

  // Token by token through a fresh cache gives the same result bit for bit.
  KvCache kv2({KvLayer{4, 4}}, 8);
  CpuExecutor ex2(pool, wt, kv2.view());
  graph::Graph g1 = build(1);
  for (size_t t = 0; t < toks.size(); ++t) {
    std::span<const float> o =
        ex2.run(g1, std::span(toks).subspan(t, 1), std::span(pos).subspan(t, 1));
    CHECK(std::equal(o.begin(), o.end(), batched.begin() + static_cast<long>(t * 8)));
  }

  // Independent check of the last token, head 1: recompute by hand in double.
  auto rope = [](std::vector<double> v, int p) {
    for (int i = 0; i < 2; ++i) {
      const double th = p * std::pow(10000.0, -2.0 * i / 4);
      const double a = v[2 * i], b = v[2 * i + 1];
      v[2 * i] = a * std::cos(th) - b * std::sin(th);
      v[2 * i + 1] = a * std::sin(th) + b * std::cos(th);
    }
    return v;
  };
  auto kvec = [&](int tok) {
    std::vector<double> r(4);
    for (int o = 0; o < 4; ++o)
      for (int i = 0; i < 8; ++i) r[o] += static_cast<double>(wk[o * 8 + i]) * embd[tok * 8 + i];
    return r;
  };
  std::vector<double> q1(embd.begin() + 5 * 8 + 4, embd.begin() + 5 * 8 + 8);
  q1 = rope(q1, 4);
  std::vector<double> s(5);
  double mx = -1e300;
  for (int j = 0; j < 5; ++j) {
    std::vector<double> kj = rope(kvec(toks[j]), j);
    for (int d = 0; d < 4; ++d) s[j] += 0.5 * q1[d] * kj[d];
    mx = std::max(mx, s[j]);
  }
  double sum = 0;
  for (double& x : s) sum += (x = std::exp(x - mx));
  for (int d = 0; d < 4; ++d) {
    double ref = 0;
    for (int j = 0; j < 5; ++j) ref += s[j] / sum * kvec(toks[j])[d];
    CHECK(batched[4 * 8 + 4 + d] == doctest::Approx(ref).epsilon(1e-5));
  }
}

TEST_CASE("executor rejects out-of-vocabulary tokens and positions outside the context") {
  std::vector<float> embd(8 * 4, 0.5f);
  graph::WeightTable wt;
  graph::WeightId e = wt.add(f32_view("embd", embd, 8, 4));
  graph::Builder b(wt, 1);
  graph::Graph g = b.finish(b.embed(e, "x"));
  ThreadPool pool(1);
  KvCache kv({KvLayer{8, 8}}, 4);
  CpuExecutor ex(pool, wt, kv.view());
  const int32_t bad_tok[1] = {4}, ok_tok[1] = {3}, p0[1] = {0}, p9[1] = {9};
  CHECK_THROWS_WITH_AS(ex.run(g, bad_tok, p0), doctest::Contains("outside the vocabulary"), Error);
  CHECK_THROWS_WITH_AS(ex.run(g, ok_tok, p9), doctest::Contains("outside the context"), Error);
  CHECK_NOTHROW(ex.run(g, ok_tok, p0));
}

#include <sched.h>

#include <mutex>
#include <set>

TEST_CASE("pinned workers each run on their own core") {
  const int cores = physical_core_count();
  REQUIRE(cores >= 1);
  const int threads = std::min(cores, 2);
  ThreadPool pool(threads);
  if (!pool.pinned()) {
    MESSAGE("hwloc could not bind threads here; pinning not checked");
    return;
  }
  std::mutex mu;
  std::map<int, std::set<int>> cpus_of_worker;
  pool.parallel_for(threads * 64, 1, [&](int64_t, int64_t) {
    cpu_set_t set;
    CPU_ZERO(&set);
    REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0);
    std::set<int> cpus;
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.insert(c);
    std::lock_guard<std::mutex> lock(mu);
    cpus_of_worker[ThreadPool::worker_index()] = cpus;
  });
  std::set<int> seen;
  for (const auto& [worker, cpus] : cpus_of_worker) {
    CAPTURE(worker);
    CHECK(cpus.size() >= 1);
    CHECK(cpus.size() <= 4);                          // the hardware threads of one core
    for (int c : cpus) CHECK(seen.insert(c).second);  // no CPU shared between workers
  }
}

TEST_CASE("the calling thread's CPU binding is restored when the pool goes away") {
  cpu_set_t before, after;
  CPU_ZERO(&before);
  CPU_ZERO(&after);
  REQUIRE(sched_getaffinity(0, sizeof before, &before) == 0);
  {
    ThreadPool pool(std::min(physical_core_count(), 2));
    pool.parallel_for(100, 1, [](int64_t, int64_t) {});
  }
  REQUIRE(sched_getaffinity(0, sizeof after, &after) == 0);
  CHECK(CPU_EQUAL(&before, &after));
}
