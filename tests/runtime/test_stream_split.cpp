// The split of streamed prefill layers (scheduler/stream_split.h): a prefill ubatch that streams
// CPU-held experts copies to the device only the experts the cost model gives it and the CPU
// workers compute the others at the same time. Checked on synthetic qwen3moe files with 16
// distinct experts (2 used): the CPU-only run's greedy tokens (outside the tie band) and logits
// within the placement bound of test_hybrid.cpp, whatever the split; a split that leaves the CPU
// nothing is bit for bit the whole copy; the bytes copied are exactly the streamed experts'; on
// concentrated routing the experts no token uses stop being copied after the first ubatch. The
// rates are given (`--stream-split pcie=..,dram=..,cpu=..`) so each split is the same on every
// run. (The split is off by default; these runs turn it on.) The device is the simulated one unless
// BERTH_TEST_DEVICE=cuda.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "berth/backends/device.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/runtime/session.h"
#include "berth/scheduler/scheduler.h"
#include "berth/scheduler/stream_split.h"
#include "berth/tools/synth.h"
#include "greedy_run.h"
#include "test_util.h"

using namespace berth;
using placement::Home;

namespace {

using test::greedy;
using test::hard_mismatches;
using test::kTieBand;
using test::nmse;
using test::Run;
using test::same_bits;
using test::use_cuda;

constexpr int32_t kExperts = 16, kUsed = 2;

std::string moe_file(const std::string& type, double skew) {
  SynthSpec spec = synth_preset("tiny-qwen3moe");
  spec.type = type;
  spec.seed = 11;
  spec.router_skew = skew;
  spec.n_expert = kExperts;
  spec.n_expert_used = kUsed;
  const auto path =
      test::temp_dir("stream-split") / fmt::format("tiny-qwen3moe-16x2-{}-skew{}.gguf", type, skew);
  if (!std::filesystem::exists(path)) write_synth_model(spec, path.string(), 2);
  return path.string();
}

// The bounds of test_hybrid.cpp (the device's f16 KV cache; on the simulated device 8-bit
// activation steps; on CUDA the oracle band), but f32 on CUDA: there this file's whole copy (no
// split, the streaming path as it was before the split) measured 2.04e-6 against the CPU-only run
// on the H200 (2026-12-04; the three split runs the same), above test_hybrid's 1e-6 for its f32
// files, which it prefills without streaming (the device's prompt kernels round to f16 tiles):
// 1e-5.
double placement_nmse(const std::string& type) {
  if (type == "f32") return use_cuda() ? 1e-5 : 1e-6;
  return use_cuda() ? 5e-3 : 1e-4;
}

std::vector<int32_t> prompt_of(int n) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((i * 53 + 7) % 300 + 3);
  return p;
}

struct Result {
  Run run;
  Scheduler::StreamSplitStats stats;
  StreamRates rates;
  double cpu_scale = 0;
  int64_t streamed_ops = 0;
};

// A session's parameters for the split: routed experts on the CPU (pinned, streamed from 8
// tokens), everything else on `dev`, the KV cache at kv; ubatches of 16, 2 threads.
SessionParams split_params(const Model& m, Device* dev, Home kv) {
  SessionParams sp;
  sp.n_threads = 2;
  sp.n_ubatch = 16;
  sp.device = dev;
  for (size_t i = 0; i < m.weights().size(); ++i)
    sp.weight_home.push_back(m.weights().role(static_cast<graph::WeightId>(i)) ==
                                     graph::WeightRole::routed_expert
                                 ? Home::cpu
                                 : Home::gpu);
  sp.kv_home.assign(static_cast<size_t>(m.hparams().n_layer), kv);
  sp.hybrid.stream_experts_min_tokens = 8;
  return sp;
}

// --cpu-moe with prefill ubatches of 16 streaming (48 prompt tokens: 3 ubatches), then `n` decode
// steps. `rates` empty: no split. No device: the CPU-only reference.
Result run(const Model& m, Device* dev, const std::string& rates, int n = 8) {
  SessionParams sp;
  if (dev) {
    sp = split_params(m, dev, Home::gpu);
    bool on = false;
    sp.hybrid.stream_rates = parse_stream_split(rates.empty() ? "off" : rates, on);
    sp.hybrid.stream_split = on;
  }
  sp.n_threads = 2;
  sp.n_ubatch = 16;
  sp.n_ctx = 256;
  Session s(m, sp);
  Result r;
  r.run = greedy(s, prompt_of(48), n);
  if (dev) {
    r.stats = s.scheduler().stream_split_stats();
    r.rates = s.scheduler().stream_rates();
    r.cpu_scale = s.scheduler().stream_cpu_scale();
    r.streamed_ops = s.scheduler().streamed_ops();
  }
  return r;
}

double expert_bytes(const Model& m) {
  double b = 0;
  for (size_t i = 0; i < m.weights().size(); ++i)
    if (m.weights().roles[i] == graph::WeightRole::routed_expert &&
        m.weights().tensors[i].name.rfind("blk.0.", 0) == 0)
      b += static_cast<double>(m.weights().tensors[i].n_bytes);
  return b / kExperts;
}

}  // namespace

TEST_CASE(
    "stream split: every split gives the CPU-only tokens; the bytes copied are the streamed "
    "experts'") {
  for (const std::string type : {"f32", "q8_0"}) {
    CAPTURE(type);
    gguf::File file = gguf::File::open(moe_file(type, 1.0));
    auto model = load_model(file);
    const int32_t n_layer = static_cast<int32_t>(model->hparams().n_layer);
    const double eb = expert_bytes(*model);
    const Result ref = run(*model, nullptr, "");
    auto dev = test::test_device();
    const Result whole = run(*model, dev.get(), "");
    CHECK(whole.streamed_ops == 3 * n_layer);
    CHECK(whole.stats.layer_steps == 0);
    CHECK(nmse(whole.run, ref.run) < placement_nmse(type));
    // Rates at which the CPU is slow: everything streams, and the split's machinery (tables, the
    // CPU's empty part, the add) changes no bit of the whole copy.
    const Result all_dev = run(*model, dev.get(), "pcie=1000,dram=0.001,cpu=0.001");
    CHECK(all_dev.stats.layer_steps == 3 * n_layer);
    CHECK(all_dev.stats.experts_cpu == 0);
    CHECK(all_dev.stats.cpu_calls == 0);
    CHECK(all_dev.stats.bytes_streamed == all_dev.stats.bytes_whole);
    CHECK(all_dev.stats.bytes_whole == static_cast<int64_t>(3 * n_layer * kExperts * eb));
    CHECK(same_bits(all_dev.run, whole.run));
    // Rates at which the copy is slow: the CPU computes every expert, nothing is copied.
    const Result all_cpu = run(*model, dev.get(), "pcie=0.001,dram=1000,cpu=1000");
    CHECK(all_cpu.stats.experts_streamed == 0);
    CHECK(all_cpu.stats.bytes_streamed == 0);
    CHECK(all_cpu.stats.cpu_calls == all_cpu.stats.calls);
    CHECK(all_cpu.stats.calls == 3 * n_layer * 16 * kUsed);
    // Balanced rates: both sides compute.
    const Result both = run(*model, dev.get(), "pcie=10,dram=10,cpu=2");
    MESSAGE(type, ": balanced split, experts CPU/streamed ", both.stats.experts_cpu, "/",
            both.stats.experts_streamed, ", calls CPU/all ", both.stats.cpu_calls, "/",
            both.stats.calls);
    CHECK(both.stats.experts_cpu > 0);
    CHECK(both.stats.experts_streamed > 0);
    CHECK(both.stats.cpu_calls > 0);
    CHECK(both.stats.cpu_calls < both.stats.calls);
    CHECK(both.stats.bytes_streamed ==
          static_cast<int64_t>(static_cast<double>(both.stats.experts_streamed) * eb));
    for (const Result* r : {&all_dev, &all_cpu, &both}) {
      CHECK(r->streamed_ops == 3 * n_layer);
      const double e = nmse(r->run, ref.run);
      MESSAGE(type, ": NMSE against the CPU-only run ", e);
      CHECK(e < placement_nmse(type));
      CHECK(hard_mismatches(r->run, ref.run, kTieBand) == 0);
    }
  }
}

TEST_CASE("stream split: rates not given are measured; the run keeps the CPU-only tokens") {
  gguf::File file = gguf::File::open(moe_file("q8_0", 1.0));
  auto model = load_model(file);
  const int32_t n_layer = static_cast<int32_t>(model->hparams().n_layer);
  auto dev = test::test_device();
  const Result ref = run(*model, nullptr, "");
  for (const std::string spec : {"on", "cpu=2"}) {
    CAPTURE(spec);
    const Result r = run(*model, dev.get(), spec);
    MESSAGE(spec, ": measured pcie ", r.rates.pcie_gbps, " GB/s, dram ", r.rates.dram_gbps,
            " GB/s, cpu ", r.rates.cpu_gflops, " GFLOP/s x ", r.cpu_scale,
            "; experts CPU/streamed ", r.stats.experts_cpu, "/", r.stats.experts_streamed);
    CHECK(r.rates.pcie_gbps > 0);
    CHECK(r.rates.dram_gbps > 0);
    // Not given: 25 GFLOP/s per worker (2 here), then scaled by what the CPU parts took.
    CHECK(r.rates.cpu_gflops == (spec == "on" ? 50.0 : 2.0));
    if (spec != "on") CHECK(r.cpu_scale == 1.0);  // a given CPU rate is not corrected
    CHECK(r.cpu_scale > 0);
    CHECK(r.stats.layer_steps == 3 * n_layer);
    CHECK(r.stats.experts_cpu + r.stats.experts_streamed == 3 * n_layer * kExperts);
    CHECK(nmse(r.run, ref.run) < placement_nmse("q8_0"));
    CHECK(hard_mismatches(r.run, ref.run, kTieBand) == 0);
  }
}

TEST_CASE("stream split: on concentrated routing the unused experts stop being copied") {
  gguf::File file = gguf::File::open(moe_file("q8_0", 4.0));
  auto model = load_model(file);
  const int32_t n_layer = static_cast<int32_t>(model->hparams().n_layer);
  auto dev = test::test_device();
  // Rates at which a uniform guess streams every expert (the CPU's cost of an expert with its
  // expected 2 tokens exceeds a copy), while an expert no token routes to is nearly free there.
  const std::string rates = "pcie=10,dram=1,cpu=1";
  const Result r = run(*model, dev.get(), rates, 2);
  const Result ref = run(*model, nullptr, "", 2);
  MESSAGE("skew 4: experts CPU/streamed ", r.stats.experts_cpu, "/", r.stats.experts_streamed,
          ", calls CPU/all ", r.stats.cpu_calls, "/", r.stats.calls, ", bytes ",
          r.stats.bytes_streamed, " of ", r.stats.bytes_whole);
  CHECK(r.stats.layer_steps == 3 * n_layer);
  // The first ubatch knows nothing and streams all; later ones leave the unused experts behind.
  CHECK(r.stats.experts_streamed >= n_layer * kExperts);
  CHECK(r.stats.experts_cpu > 0);
  CHECK(r.stats.bytes_streamed < r.stats.bytes_whole);
  // What the CPU took were the experts the ubatches rarely used.
  CHECK(static_cast<double>(r.stats.cpu_calls) / static_cast<double>(r.stats.calls) <
        static_cast<double>(r.stats.experts_cpu) /
            static_cast<double>(r.stats.experts_cpu + r.stats.experts_streamed));
  CHECK(nmse(r.run, ref.run) < placement_nmse("q8_0"));
  CHECK(hard_mismatches(r.run, ref.run, kTieBand) == 0);
}

TEST_CASE(
    "stream split: sessions of several sequences never split or stream (rows must not depend on "
    "the ubatch)") {
  gguf::File file = gguf::File::open(moe_file("q8_0", 1.0));
  auto model = load_model(file);
  auto dev = test::test_device();
  SessionParams sp = split_params(*model, dev.get(), Home::cpu);
  sp.n_ctx = 128;
  sp.n_seq = 2;
  sp.hybrid.stream_split = true;
  sp.hybrid.stream_rates = StreamRates{.pcie_gbps = 10, .dram_gbps = 10, .cpu_gflops = 2};
  Session s(*model, sp);
  (void)greedy(s, prompt_of(32), 2);
  // Whether a step streams follows its size, so a step of several sequences computes its
  // CPU-held experts on the CPU (test_batch.cpp's streamed case); the same session of one
  // sequence streams and splits.
  CHECK(s.scheduler().streamed_ops() == 0);
  CHECK(s.scheduler().stream_split_stats().layer_steps == 0);
  sp.n_seq = 1;
  Session one(*model, sp);
  (void)greedy(one, prompt_of(32), 2);
  CHECK(one.scheduler().streamed_ops() > 0);
  CHECK(one.scheduler().stream_split_stats().layer_steps > 0);
}

TEST_CASE("stream split: a step that throws adds nothing to the split's counts") {
  // The routing hook throws on the second prefill step, after that step chose its split (the
  // tables and counts of a split are made before the step's routes are forced): the counts must
  // hold the first step's layers only.
  gguf::File file = gguf::File::open(moe_file("q8_0", 1.0));
  auto model = load_model(file);
  const int32_t n_layer = static_cast<int32_t>(model->hparams().n_layer);
  auto dev = test::test_device();
  SessionParams sp = split_params(*model, dev.get(), Home::gpu);
  sp.n_ctx = 256;
  bool on = false;
  sp.hybrid.stream_rates = parse_stream_split("pcie=10,dram=10,cpu=2", on);
  sp.hybrid.stream_split = on;
  Session s(*model, sp);
  int calls = 0;
  Scheduler::RoutingHooks hooks;
  hooks.force = [&](const graph::Graph& g, int32_t* ids) {
    if (++calls == 2) throw std::runtime_error("routing hook: the second step fails");
    for (int32_t r = 0; r < n_layer; ++r)
      for (int32_t t = 0; t < g.n_tokens; ++t)
        for (int32_t j = 0; j < kUsed; ++j)
          ids[(static_cast<int64_t>(r) * g.n_tokens + t) * kUsed + j] = (t + 5 * j) % kExperts;
  };
  s.scheduler().set_routing(n_layer, kUsed, std::move(hooks));
  const std::vector<int32_t> prompt = prompt_of(48);  // three ubatches of 16
  CHECK_THROWS(s.eval(prompt));
  CHECK(calls == 2);
  const Scheduler::StreamSplitStats& st = s.scheduler().stream_split_stats();
  CHECK(st.layer_steps == n_layer);
  CHECK(st.experts_cpu + st.experts_streamed == n_layer * kExperts);
  CHECK(st.bytes_whole ==
        static_cast<int64_t>(static_cast<double>(n_layer * kExperts) * expert_bytes(*model)));
  CHECK(st.calls == n_layer * 16 * kUsed);
}
