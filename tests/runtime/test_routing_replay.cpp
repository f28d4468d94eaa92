// Routing traces on a session (runtime/routing_io.h): a run's recorded routing (run
// --dump-routing) replayed (bench model --routing-trace) gives the same tokens and routes; a
// generated trace forces exactly its experts, with the same routes on the CPU and on the device;
// and the errors of a trace that does not fit the model.
//
// The files are synthetic qwen3moe models with random (distinct) experts, 8 experts of which 2
// are used; the device is the simulated one unless BERTH_TEST_DEVICE=cuda.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "berth/backends/device.h"
#include "berth/core/error.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/residency/expert_slots.h"
#include "berth/residency/routing_trace.h"
#include "berth/residency/trace_gen.h"
#include "berth/runtime/routing_io.h"
#include "berth/runtime/session.h"
#include "berth/tools/synth.h"
#include "greedy_run.h"
#include "test_util.h"

using namespace berth;
using berth::test::expect_error;
using placement::Home;

namespace {

using test::greedy;
using test::Run;
using test::test_device;
using test::use_cuda;

std::string moe_file(const std::string& preset) {
  SynthSpec spec = synth_preset(preset);
  spec.type = "f32";
  spec.seed = 11;
  spec.router_skew = 0.5;
  spec.n_expert = 8;
  spec.n_expert_used = 2;
  const auto path = test::temp_dir("routing") / fmt::format("{}-8x2.gguf", preset);
  if (!std::filesystem::exists(path)) write_synth_model(spec, path.string(), 2);
  return path.string();
}

enum class Where { cpu, cpu_moe, all_device };

SessionParams params(const Model& m, Device* dev, Where w, int32_t n_ubatch) {
  SessionParams sp;
  sp.n_threads = 2;
  sp.n_ctx = 128;
  sp.n_ubatch = n_ubatch;
  if (w == Where::cpu) return sp;
  sp.device = dev;
  for (size_t i = 0; i < m.weights().size(); ++i)
    sp.weight_home.push_back(w == Where::cpu_moe && m.weights().role(static_cast<graph::WeightId>(
                                                        i)) == graph::WeightRole::routed_expert
                                 ? Home::cpu
                                 : Home::gpu);
  sp.kv_home.assign(static_cast<size_t>(m.hparams().n_layer), Home::gpu);
  return sp;
}

std::vector<int32_t> prompt_of(int n) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((i * 53 + 7) % 200 + 3);
  return p;
}

// A session on `where` that records its routing to `path` (and replays `replay` if given), runs
// the prompt and n greedy tokens.
Run run_with(const Model& m, Device* dev, Where where, int32_t ub, const std::string& path,
             std::shared_ptr<const residency::RoutingReplay> replay, int n = 10) {
  Session s(m, params(m, dev, where, ub));
  auto w = std::make_shared<residency::RoutingTraceWriter>(path, routing_shape(m, true));
  attach_routing(s, m, std::move(replay), w);
  Run r = greedy(s, prompt_of(30), n);
  w->finish();
  return r;
}

}  // namespace

TEST_CASE("routing: a run's recorded routing, replayed, gives the same tokens and routes") {
  gguf::File file = gguf::File::open(moe_file("tiny-qwen3moe"));
  auto model = load_model(file);
  const residency::TraceShape shape = routing_shape(*model, true);
  REQUIRE(shape.n_layer == model->hparams().n_layer);  // every layer routes
  auto dev = test_device();
  const auto dir = test::temp_dir("routing");
  for (Where where : {Where::cpu, Where::cpu_moe, Where::all_device}) {
    for (int32_t ub : {512, 7}) {
      CAPTURE(static_cast<int>(where));
      CAPTURE(ub);
      const std::string a = (dir / "a.trace").string(), b = (dir / "b.trace").string();
      const Run ra = run_with(*model, dev.get(), where, ub, a, nullptr);
      const residency::RoutingTrace ta = residency::read_routing_trace(a);
      // 30 prompt tokens (prefill, in ubatches of ub), then a decode step per generated token.
      REQUIRE(ta.n_tokens() == 30 + 10);
      CHECK(ta.kinds[0] == residency::TokenKind::prefill);
      CHECK(ta.kinds.back() == residency::TokenKind::decode);
      CHECK(std::count(ta.kinds.begin(), ta.kinds.end(), residency::TokenKind::decode) == 10);
      auto replay = std::make_shared<residency::RoutingReplay>(ta, a, shape.blocks, shape.n_expert,
                                                               shape.n_expert_used);
      const Run rb = run_with(*model, dev.get(), where, ub, b, replay);
      const residency::RoutingTrace tb = residency::read_routing_trace(b);
      CHECK(rb.tokens == ra.tokens);
      CHECK(rb.logits == ra.logits);  // the same picks, weights and arithmetic: the same bits
      CHECK(tb.ids == ta.ids);
      CHECK(tb.weights == ta.weights);
    }
  }
}

TEST_CASE("routing: a replayed trace forces its experts, the same on the CPU and the device") {
  gguf::File file = gguf::File::open(moe_file("tiny-qwen3moe"));
  auto model = load_model(file);
  const residency::TraceShape shape = routing_shape(*model, true);
  residency::TraceGenSpec spec = residency::trace_preset("uniform");
  spec.n_layer = shape.n_layer;
  spec.n_expert = shape.n_expert;
  spec.n_expert_used = shape.n_expert_used;
  spec.n_tokens = 17;  // shorter than the run: it repeats
  spec.n_prompt = 17;
  spec.seed = 5;
  const residency::RoutingTrace forced = residency::generate_routing_trace(spec);
  auto replay = std::make_shared<residency::RoutingReplay>(forced, "uniform", shape.blocks,
                                                           shape.n_expert, shape.n_expert_used);
  auto dev = test_device();
  const auto dir = test::temp_dir("routing");
  const std::string free_path = (dir / "free.trace").string();
  const Run free_run = run_with(*model, nullptr, Where::cpu, 512, free_path, nullptr);
  const residency::RoutingTrace free_trace = residency::read_routing_trace(free_path);
  std::vector<residency::RoutingTrace> got;
  std::vector<Run> runs;
  for (Where where : {Where::cpu, Where::cpu_moe, Where::all_device}) {
    CAPTURE(static_cast<int>(where));
    const std::string path =
        (dir / fmt::format("forced-{}.trace", static_cast<int>(where))).string();
    runs.push_back(run_with(*model, dev.get(), where, 512, path, replay));
    got.push_back(residency::read_routing_trace(path));
    const residency::RoutingTrace& t = got.back();
    REQUIRE(t.n_tokens() == 40);
    for (int64_t i = 0; i < t.n_tokens(); ++i)
      for (int32_t l = 0; l < shape.n_layer; ++l) {
        const auto want = forced.token_ids(i % forced.n_tokens(), l);
        const auto have = t.token_ids(i, l);
        REQUIRE(std::equal(want.begin(), want.end(), have.begin(), have.end()));
        // The router's weights of the forced experts, renormalised: they sum to 1.
        const float* w = t.weights.data() + (i * shape.n_layer + l) * shape.n_expert_used;
        CHECK(std::fabs(w[0] + w[1] - 1.0f) < 2e-3f);  // stored as binary16
        CHECK(w[0] > 0.0f);
      }
  }
  // The forcing took effect: the free run routed otherwise.
  CHECK(free_trace.ids != got[0].ids);
  // The same experts wherever the routers run. The weights come from the router's logits: on
  // the simulated device the same bits where the router runs on the device (both device runs),
  // near the CPU's elsewhere (the device's activations take other rounding steps); on CUDA the
  // two device runs' routers are different kernels (the fused decode router beside CPU-held
  // experts), so there only near.
  for (size_t i = 1; i < got.size(); ++i) CHECK(got[i].ids == got[0].ids);
  if (!use_cuda()) CHECK(got[1].weights == got[2].weights);
  float worst = 0;
  for (size_t j = 0; j < got[0].weights.size(); ++j)
    worst = std::max(worst, std::fabs(got[0].weights[j] - got[1].weights[j]));
  CHECK(worst < 1e-2f);
  CHECK(runs[1].tokens.size() == runs[0].tokens.size());
}

TEST_CASE("routing: traces that do not fit the model, and hooks set too late, are errors") {
  gguf::File file = gguf::File::open(moe_file("tiny-qwen3moe"));
  auto model = load_model(file);
  const residency::TraceShape shape = routing_shape(*model, true);
  residency::TraceGenSpec spec = residency::trace_preset("uniform");
  spec.n_layer = shape.n_layer;
  spec.n_expert = 16;  // the model has 8
  spec.n_expert_used = shape.n_expert_used;
  spec.n_tokens = 4;
  spec.seed = 1;
  expect_error(ErrorCategory::invalid_argument,
               [&] {
                 residency::RoutingReplay(residency::generate_routing_trace(spec), "big.trace",
                                          shape.blocks, shape.n_expert, shape.n_expert_used);
               },
               {"big.trace"});
  // Hooks after a step ran: the captured steps would not see them.
  Session s(*model, params(*model, nullptr, Where::cpu, 512));
  s.eval(prompt_of(3));
  spec.n_expert = shape.n_expert;
  auto replay =
      std::make_shared<residency::RoutingReplay>(residency::generate_routing_trace(spec), "t",
                                                 shape.blocks, shape.n_expert, shape.n_expert_used);
  expect_error(ErrorCategory::invalid_argument, [&] { attach_routing(s, *model, replay, nullptr); },
               {"before the first step"});
  // A dense model has no routing.
  gguf::File dense = gguf::File::open(test::stories260k().string());
  auto dm = load_model(dense);
  expect_error(ErrorCategory::invalid_argument, [&] { routing_shape(*dm, true); },
               {"no MoE layers"});
}

TEST_CASE("routing: berth run --dump-routing and bench model --routing-trace") {
  using test::run_command;
  using test::shell_quote;
  const std::string bin = test::berth_bin();
  const std::string model = shell_quote(moe_file("tiny-qwen3moe"));
  const auto dir = test::temp_dir("routing-cli");
  const std::string trace = shell_quote((dir / "run.trace").string());
  test::CommandResult r = run_command(bin + " run -m " + model + " -p " + shell_quote("hello") +
                                      " -n 6 --temp 0 --no-bos -c 64 --dump-routing " + trace);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const residency::RoutingTrace t = residency::read_routing_trace((dir / "run.trace").string());
  // The prompt's tokens, then a decode step per generated token but the last.
  CHECK(t.n_tokens() > 5);
  CHECK(std::count(t.kinds.begin(), t.kinds.end(), residency::TokenKind::decode) == 5);
  CHECK(r.err.find(fmt::format("routing of {} tokens written to", t.n_tokens())) !=
        std::string::npos);
  // Replayed on the simulated device with expert slots: the JSON says what was forced and how
  // the slots served, per window of 4 decode steps.
  const std::string json = (dir / "bench.json").string();
  r = run_command("BERTH_SIM_DEVICE=1G " + bin + " bench model -m " + model +
                  " -p 0 -n 10 -r 1 -ngl 99 --cpu-moe --residency adaptive --vram-budget 1G "
                  "--residency-window 4 --dram-mib 16 --routing-trace " +
                  trace + " --json " + shell_quote(json));
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("routing: forced from") != std::string::npos);
  const nlohmann::json j = nlohmann::json::parse(test::read_file(json));
  CHECK(j["routing_trace_tokens"] == t.n_tokens());
  const nlohmann::json& res = j["tg_residency"];
  REQUIRE(res.is_object());
  CHECK(res["total"]["n_tokens"] == 10);
  CHECK(res["total"]["routed_calls"] == 10 * 2 * 2);  // tokens x MoE layers x top-2
  REQUIRE(res["windows"].size() == 3);                // 4 + 4 + 2 decode steps
  CHECK(res["windows"][2]["n_tokens"] == 2);
  // The bound counts the slots' share of the routed bytes on the device's side.
  CHECK(res["total"]["device_calls"].get<int64_t>() > 0);
  CHECK(j["decode_slot_bytes"].get<uint64_t>() > 0);
  // A trace of another model's shape is refused, naming the file.
  const std::string other = (dir / "other.trace").string();
  r = run_command(bin +
                  " trace gen --preset uniform --tokens 8 --n-layer 2 --n-expert 16 "
                  "--n-expert-used 2 -o " +
                  shell_quote(other));
  REQUIRE(r.exit_code == 0);
  r = run_command(bin + " bench model -m " + model +
                  " -p 0 -n 4 -r 1 --dram-mib 16 --routing-trace " + shell_quote(other));
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("other.trace: routing trace does not fit the model") != std::string::npos);
}

namespace {

// A trace of `n_layer` MoE layers (blocks 0..n-1) of 8 experts, top-2, from per-layer lists.
residency::RoutingTrace hand_trace(const std::vector<std::vector<std::array<uint16_t, 2>>>& calls) {
  residency::RoutingTrace t;
  t.shape.n_layer = static_cast<int32_t>(calls.size());
  t.shape.n_expert = 8;
  t.shape.n_expert_used = 2;
  for (int32_t l = 0; l < t.shape.n_layer; ++l) t.shape.blocks.push_back(l);
  const size_t n = calls[0].size();
  for (size_t i = 0; i < n; ++i) {
    t.kinds.push_back(residency::TokenKind::decode);
    for (const auto& layer : calls) t.ids.insert(t.ids.end(), layer[i].begin(), layer[i].end());
  }
  return t;
}

}  // namespace

TEST_CASE("routing: the frequency-static policy holds a calibration trace's most called experts") {
  // Seven tokens. Layer 0 calls expert 3 seven times, 5 five times, 1 twice; layer 1 calls 0
  // seven times, 7 six times, 2 once.
  std::vector<std::array<uint16_t, 2>> l0, l1;
  for (int i = 0; i < 5; ++i) l0.push_back({3, 5});
  for (int i = 0; i < 2; ++i) l0.push_back({3, 1});
  for (int i = 0; i < 3; ++i) l1.push_back({7, 0});
  l1.push_back({2, 0});
  for (int i = 0; i < 3; ++i) l1.push_back({0, 7});
  const residency::RoutingTrace cal = hand_trace({l0, l1});
  FrequencySlotPolicy p(cal, "cal.trace");
  const std::vector<int32_t> blocks = {0, 1};
  p.set_blocks(blocks);
  p.reset(2, 8, 2);
  CHECK(p.target(0) == std::vector<int32_t>{3, 5});
  CHECK(p.target(1) == std::vector<int32_t>{0, 7});
  p.reset(2, 8, 1);
  CHECK(p.target(1) == std::vector<int32_t>{0});
  const std::vector<int32_t> other = {0, 4};
  p.set_blocks(other);
  expect_error(ErrorCategory::invalid_argument, [&] { p.reset(2, 8, 2); }, {"cal.trace", "blk.4"});
  p.set_blocks(blocks);
  expect_error(ErrorCategory::invalid_argument, [&] { p.reset(2, 16, 2); }, {"n_expert"});
  CHECK(make_slot_policy("lru")->name() == "lru");
  CHECK(make_slot_policy("lfu-decay:16")->name().find("16") != std::string::npos);
  for (const std::string bad : {"lfu", "lfu-decay:0", "lfu-decay:x", "frequency:"})
    expect_error(ErrorCategory::invalid_argument, [&] { make_slot_policy(bad); },
                 {"residency policy"});

  // In a session: routing forced from the calibration trace itself, two slots per layer that
  // the policy seeds with the two most called experts; every call of those
  // experts is served from the device: 25 of each 28 calls of the trace's 7 tokens (layer 0:
  // 12 of 14, layer 1: 13 of 14), at least 52 of the 60 calls of 15 tokens wherever they start.
  gguf::File file = gguf::File::open(moe_file("tiny-qwen3moe"));
  auto model = load_model(file);
  REQUIRE(routing_shape(*model, true).blocks == blocks);
  auto dev = test_device();
  SessionParams sp = params(*model, dev.get(), Where::cpu_moe, 512);
  sp.hybrid.expert_slots = {.slots_per_layer = 2,
                            .max_swaps_per_step = 2,
                            .policy = std::make_shared<FrequencySlotPolicy>(cal, "cal.trace")};
  Session s(*model, sp);
  REQUIRE(s.residency()->expert_slots() != nullptr);
  // The slots start with them (the policy's seed), most called first; nothing to swap.
  CHECK(s.residency()->expert_slots()->slot_experts(0) == std::vector<int32_t>{3, 5});
  CHECK(s.residency()->expert_slots()->slot_experts(1) == std::vector<int32_t>{0, 7});
  attach_routing(s, *model,
                 std::make_shared<residency::RoutingReplay>(cal, "cal.trace", blocks, 8, 2),
                 nullptr);
  (void)greedy(s, prompt_of(7), 4);  // warm-up
  const ExpertSlots::Stats before = s.residency()->expert_slots()->stats();
  (void)greedy(s, std::vector<int32_t>{5}, 14);
  const ExpertSlots::Stats after = s.residency()->expert_slots()->stats();
  const double share = static_cast<double>(after.device_calls - before.device_calls) /
                       static_cast<double>(after.calls - before.calls);
  MESSAGE("frequency policy: ", 100 * share, "% of routed calls on the device");
  CHECK(after.calls - before.calls == 15 * 2 * 2);
  CHECK(share > 0.85);
  CHECK(after.swaps == 0);  // fixed: seeded with them, nothing moves
}

TEST_CASE("expert slots: a streamed prefill seats the prompt's hottest experts for decode") {
  // Routing forced to experts {3, 5} in layer 0 and {6, 2} in layer 1 for every token; two
  // slots per layer holding experts 0 and 1 at first; one swap per layer per step otherwise.
  // The 100-token prompt streams both layers' experts (prefill), so the slots' CPU side sees no
  // routing; with seating the boundary after it fills both slots of each layer at once, the
  // copies land during the first decode step, and every later decode call is served from the
  // device. Without seating (the policy learning from decode steps, margin 3) the first decode
  // steps would all run on the CPU.
  if (use_cuda()) return;  // streaming from 64 tokens is the simulated device's setting here
  gguf::File file = gguf::File::open(moe_file("tiny-qwen3moe"));
  auto model = load_model(file);
  const std::vector<int32_t> blocks = {0, 1};
  REQUIRE(routing_shape(*model, true).blocks == blocks);
  std::vector<std::array<uint16_t, 2>> l0(7, {3, 5}), l1(7, {6, 2});
  const residency::RoutingTrace forced = hand_trace({l0, l1});
  auto dev = test_device();
  SessionParams sp = params(*model, dev.get(), Where::cpu_moe, 512);
  sp.hybrid.stream_experts_min_tokens = 64;
  sp.hybrid.expert_slots = {.slots_per_layer = 2, .max_swaps_per_step = 1};
  Session s(*model, sp);
  ExpertSlots* xs = s.residency()->expert_slots();
  REQUIRE(xs != nullptr);
  attach_routing(s, *model, std::make_shared<residency::RoutingReplay>(forced, "f", blocks, 8, 2),
                 nullptr);
  std::vector<int32_t> prompt = prompt_of(100);
  (void)s.eval(prompt);
  CHECK(s.scheduler().streamed_ops() > 0);  // the prompt streamed the layers
  const ExpertSlots::Stats p = xs->stats();
  CHECK(p.calls == 0);  // the stream served the prompt, not the slots
  int32_t t = 7;
  (void)s.eval(std::span<const int32_t>(&t, 1));  // boundary: seat; copies race this step
  const ExpertSlots::Stats first = xs->stats();
  CHECK(first.seated == 4);  // two experts in each of two layers
  CHECK(first.swaps == 4);
  for (int i = 0; i < 8; ++i) (void)s.eval(std::span<const int32_t>(&t, 1));
  const ExpertSlots::Stats after = xs->stats();
  CHECK(after.calls - first.calls == 8 * 2 * 2);
  CHECK(after.device_calls - first.device_calls == 8 * 2 * 2);  // every later call on the device
  CHECK(after.swaps == first.swaps);                            // and nothing moves again
  CHECK(xs->slot_experts(0) == std::vector<int32_t>{3, 5});
  CHECK(xs->slot_experts(1) == std::vector<int32_t>{2, 6});
}
