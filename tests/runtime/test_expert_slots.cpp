// Expert slots (residency/expert_slots.h): experts of CPU-held MoE layers that move to the device
// and back between steps. Forced swaps every step (RotatingSlotPolicy) never change the CPU-only
// run's greedy tokens (outside the tie band) and keep the logits within the placement bound of
// tests/runtime/test_hybrid.cpp; a copy still in flight while later steps run is safe; the
// device's memory does not grow after the slots are made.
//
// The files are synthetic qwen3moe and Mixtral (llama with experts) models with random, hence
// distinct, experts (checked below: identical experts would hide a wrong slot table), 8 experts of
// which 2 are used. The device is the simulated one unless BERTH_TEST_DEVICE=cuda.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <thread>

#include "berth/backends/device.h"
#include "berth/core/error.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/residency/expert_slots.h"
#include "berth/residency/routing_trace.h"
#include "berth/runtime/placed.h"
#include "berth/runtime/session.h"
#include "berth/scheduler/scheduler.h"
#include "berth/tools/synth.h"
#include "greedy_run.h"
#include "test_util.h"

using namespace berth;
using placement::Home;

namespace {

using test::argmax;
using test::greedy;
using test::hard_mismatches;
using test::kTieBand;
using test::nmse;
using test::Run;
using test::use_cuda;

std::unique_ptr<Device> test_device(int64_t copy_delay_us = 0) {
  return test::test_device(size_t{2} << 30, copy_delay_us);
}

std::string moe_file(const std::string& preset, const std::string& type) {
  SynthSpec spec = synth_preset(preset);
  spec.type = type;
  spec.seed = 7;
  spec.router_skew = 0.5;
  spec.n_expert = 8;
  spec.n_expert_used = 2;
  const auto path = test::temp_dir("slots") / fmt::format("{}-8x2-{}.gguf", preset, type);
  if (!std::filesystem::exists(path)) write_synth_model(spec, path.string(), 2);
  return path.string();
}

// The bounds of test_hybrid.cpp (placement_nmse; kTieBand in greedy_run.h): the device's f16 KV
// cache, and on the simulated device 8-bit activation steps; on CUDA the oracle band.
double placement_nmse(const std::string& type) {
  if (type == "f32") return 1e-6;
  return use_cuda() ? 5e-3 : 1e-4;
}

// --cpu-moe: every routed expert tensor on the CPU, the rest (and the KV cache) on the device.
SessionParams cpu_moe(const Model& m, Device* dev, int32_t n_ubatch) {
  SessionParams sp;
  sp.n_threads = 2;
  sp.n_ctx = 256;
  sp.n_ubatch = n_ubatch;
  if (!dev) return sp;
  sp.device = dev;
  for (size_t i = 0; i < m.weights().size(); ++i)
    sp.weight_home.push_back(m.weights().role(static_cast<graph::WeightId>(i)) ==
                                     graph::WeightRole::routed_expert
                                 ? Home::cpu
                                 : Home::gpu);
  sp.kv_home.assign(static_cast<size_t>(m.hparams().n_layer), Home::gpu);
  return sp;
}

std::vector<int32_t> prompt_of(int n) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((i * 37 + 11) % 200 + 3);
  return p;
}

// Expert 0's and expert 1's gate slices differ (the file's experts are distinct).
bool experts_distinct(const Model& m) {
  for (size_t i = 0; i < m.weights().size(); ++i) {
    const TensorView& t = m.weights().tensors[i];
    if (m.weights().roles[i] != graph::WeightRole::routed_expert || t.ne[2] < 2) continue;
    const size_t eb = t.n_bytes / static_cast<size_t>(t.ne[2]);
    const auto* p = static_cast<const uint8_t*>(t.data);
    if (std::memcmp(p, p + eb, eb) == 0) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("expert slots: swaps forced every step keep the CPU-only greedy tokens") {
  for (const std::string preset : {"tiny-qwen3moe", "tiny-mixtral"}) {
    for (const std::string type : {"f32", "q8_0"}) {
      CAPTURE(preset);
      CAPTURE(type);
      gguf::File file = gguf::File::open(moe_file(preset, type));
      auto model = load_model(file);
      REQUIRE(model->hparams().n_expert == 8);
      REQUIRE(experts_distinct(*model));
      const std::vector<int32_t> prompt = prompt_of(40);
      auto dev = test_device();
      for (int32_t ub : {512, 1}) {
        CAPTURE(ub);
        Session cpu(*model, cpu_moe(*model, nullptr, ub));
        const Run ref = greedy(cpu, prompt, 20);
        for (int32_t c : {3, 2}) {
          CAPTURE(c);
          SessionParams sp = cpu_moe(*model, dev.get(), ub);
          // Every boundary wants one expert more and one less in each layer (shift 1): a swap per
          // layer per step, its copy racing the next step, its expert computed from the slot
          // from the step after (a set disjoint from the last at every boundary would evict each
          // expert as its copy is committed, and no slot would ever serve).
          sp.hybrid.expert_slots = {.slots_per_layer = c,
                                    .max_swaps_per_step = c,
                                    .policy = std::make_shared<RotatingSlotPolicy>(1)};
          Session s(*model, sp);
          REQUIRE(s.residency()->expert_slots() != nullptr);
          const Run got = greedy(s, prompt, 20);
          const double e = nmse(got, ref);
          MESSAGE(preset, " ", type, " ub ", ub, " C ", c, ": NMSE ", e);
          CHECK(e < placement_nmse(type));
          CHECK(hard_mismatches(got, ref, kTieBand) == 0);
          const ExpertSlots::Stats st = s.residency()->expert_slots()->stats();
          const int64_t n_layer = model->hparams().n_layer;
          // One boundary per step: prompt steps, then 20 decode steps.
          CHECK(st.boundaries == (40 + ub - 1) / ub + 20);
          // One per layer per boundary, but for a boundary at which the slot it would replace
          // is still loading (its copy late: the simulated copy worker shares the host's cores,
          // and a loaded machine delays it): each such miss has a late copy behind it.
          CHECK(st.swaps + st.late >= (st.boundaries - 1) * n_layer);
          // How many land in time is the machine's load (half or more when idle; 17 of 40 under
          // ctest -j2 once, which a bound of half failed): the first boundary, with no copy in
          // flight, swaps in every layer whatever the load.
          CHECK(st.swaps >= n_layer);
          CHECK(st.swaps <= st.boundaries * n_layer);
          CHECK(st.commits > 0);
          CHECK(st.bytes_moved > 0);
          // Some routed calls ran on the device, some on the CPU.
          CHECK(st.device_calls > 0);
          CHECK(st.device_calls < st.calls);
        }
      }
    }
  }
}

TEST_CASE("expert slots: a copy still landing while later steps run is safe") {
  if (use_cuda()) return;  // the delay is the simulated device's
  gguf::File file = gguf::File::open(moe_file("tiny-qwen3moe", "q8_0"));
  auto model = load_model(file);
  const std::vector<int32_t> prompt = prompt_of(12);
  Session cpu(*model, cpu_moe(*model, nullptr, 4));
  const Run ref = greedy(cpu, prompt, 16);
  // Each copy on kCopy sleeps 10 ms first: the copies started at one boundary are still in flight
  // at the next ones, while those steps run (and read the other slots and the tables).
  auto dev = test_device(10000);
  SessionParams sp = cpu_moe(*model, dev.get(), 4);
  sp.hybrid.expert_slots = {.slots_per_layer = 2,
                            .max_swaps_per_step = 2,
                            .policy = std::make_shared<RotatingSlotPolicy>(1)};
  Session s(*model, sp);
  const Run got = greedy(s, prompt, 16);
  CHECK(nmse(got, ref) < placement_nmse("q8_0"));
  CHECK(hard_mismatches(got, ref, kTieBand) == 0);
  const ExpertSlots::Stats st = s.residency()->expert_slots()->stats();
  MESSAGE("swaps ", st.swaps, ", commits ", st.commits, ", found in flight ", st.late);
  CHECK(st.late > 0);  // copies overlapped later steps
  // Steps keep going while copies land; with time they land and are committed (at most a few
  // seconds of 10 ms copies).
  const int32_t t = got.tokens.back();
  for (int i = 0; i < 100 && s.residency()->expert_slots()->stats().commits == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    s.eval(std::span<const int32_t>(&t, 1));
  }
  CHECK(s.residency()->expert_slots()->stats().commits > 0);
}

TEST_CASE("expert slots: the device's memory does not grow with swaps") {
  gguf::File file = gguf::File::open(moe_file("tiny-mixtral", "q8_0"));
  auto model = load_model(file);
  auto dev = test_device();
  const std::vector<int32_t> prompt = prompt_of(8);
  const size_t free0 = dev->free_bytes();
  SessionParams sp = cpu_moe(*model, dev.get(), 8);
  sp.hybrid.expert_slots = {.slots_per_layer = 3,
                            .max_swaps_per_step = 3,
                            .policy = std::make_shared<RotatingSlotPolicy>(3)};
  Session s(*model, sp);
  const ExpertSlots& xs = *s.residency()->expert_slots();
  // The slots and tables: C experts' gate + up + down per layer, plus n_expert int32 each.
  size_t expert_bytes = 0;
  for (size_t i = 0; i < model->weights().size(); ++i)
    if (model->weights().roles[i] == graph::WeightRole::routed_expert)
      expert_bytes += model->weights().tensors[i].n_bytes / 8;
  CHECK(xs.device_bytes() == 3 * expert_bytes + static_cast<size_t>(xs.n_layers()) * 8 * 4);
  std::vector<int32_t> p = prompt;
  s.eval(p);
  const int32_t t = 5;
  s.eval(std::span<const int32_t>(&t, 1));  // both step shapes compiled
  const size_t used = free0 - dev->free_bytes();
  for (int i = 0; i < 12; ++i) {
    s.eval(std::span<const int32_t>(&t, 1));
    CHECK(free0 - dev->free_bytes() == used);
  }
  CHECK(xs.stats().swaps > 0);
}

TEST_CASE("expert slots: ops of the dynamic expert sets say so instead of guessing") {
  graph::MoeParams p;
  p.n_expert = 8;
  CHECK(p.has_expert(3));
  p.set = graph::ExpertSet::resident;
  CHECK_THROWS_AS((void)p.has_expert(3), Error);
  p.set = graph::ExpertSet::not_resident;
  CHECK_THROWS_AS((void)p.has_expert(3), Error);
  // The CPU side of a layer with slots needs the layer's table bound.
  gguf::File file = gguf::File::open(moe_file("tiny-qwen3moe", "f32"));
  auto model = load_model(file);
  graph::Graph g = model->build_step(1, 1);
  for (graph::Op& op : g.ops)
    if (op.kind == graph::OpKind::moe_experts) op.moe.set = graph::ExpertSet::not_resident;
  Session cpu(*model, cpu_moe(*model, nullptr, 1));
  const int32_t tok = 3, pos = 0;
  try {
    cpu.scheduler().cpu().run(g, std::span<const int32_t>(&tok, 1),
                              std::span<const int32_t>(&pos, 1));
    FAIL("ran without a table");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("no expert slot table") != std::string::npos);
  }
}

TEST_CASE("expert slots: the policy learns from routing and serves calls from the device") {
  gguf::File file = gguf::File::open(moe_file("tiny-qwen3moe", "q8_0"));
  auto model = load_model(file);
  auto dev = test_device();
  const std::vector<int32_t> prompt = prompt_of(24);
  Session cpu(*model, cpu_moe(*model, nullptr, 512));
  const Run ref = greedy(cpu, prompt, 24);
  for (const int policy : {0, 1}) {
    CAPTURE(policy);
    SessionParams sp = cpu_moe(*model, dev.get(), 512);
    sp.hybrid.expert_slots.slots_per_layer = 4;
    sp.hybrid.expert_slots.max_swaps_per_step = 1;
    if (policy == 1)
      sp.hybrid.expert_slots.policy =
          std::make_shared<CacheSlotPolicy>(std::make_unique<residency::LruPolicy>());
    Session s(*model, sp);
    const Run got = greedy(s, prompt, 24);
    CHECK(nmse(got, ref) < placement_nmse("q8_0"));
    CHECK(hard_mismatches(got, ref, kTieBand) == 0);
    const ExpertSlots::Stats st = s.residency()->expert_slots()->stats();
    MESSAGE(s.residency()->expert_slots()->policy().name(), ": ", st.swaps, " swaps, ",
            st.device_calls, " of ", st.calls, " routed calls on the device");
    CHECK(st.calls == 2 * 2 * (24 + 24));  // layers x k x tokens (the prompt was split too)
    CHECK(st.device_calls > 0);
    // At most S = 1 swap per layer per boundary.
    CHECK(st.swaps <= st.boundaries * 2);
  }
}

TEST_CASE("berth run and plan (--ops) with --residency adaptive on the simulated device") {
  using test::run_command;
  using test::shell_quote;
  const std::string bin = test::berth_bin();
  const std::string model = shell_quote(moe_file("tiny-qwen3moe", "q8_0"));
  const std::string flags = " -c 256 -ngl 99 --cpu-moe --residency adaptive";
  // The plan: 7 of 8 experts as slots on each layer (the budget holds them all).
  test::CommandResult r = run_command(bin + " plan -m " + model + " --vram-budget 1G" + flags);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("residency: adaptive, 7 expert slots per CPU-held MoE layer") !=
        std::string::npos);
  CHECK(r.out.find("7 of 8 (expert slots; the rest on the CPU)") != std::string::npos);
  CHECK(r.out.find("blk.0.ffn_up_exps.weight") == std::string::npos);  // --tensors shows them
  // Its decode schedule splits each layer by the slot table.
  r = run_command("BERTH_SIM_DEVICE=1G " + bin + " plan -m " + model + flags + " --ops");
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("expert slots: the experts of blk.0.ffn_gate_exps.weight in its 7 slots") !=
        std::string::npos);
  CHECK(r.out.find("not in slots: the other experts of blk.1.ffn_gate_exps.weight on the CPU") !=
        std::string::npos);
  // run: the same greedy text as the CPU-only run, and the residency line at the end.
  const std::string gen = " -p " + shell_quote("hello world") + " -n 16 --temp 0 --no-bos";
  const test::CommandResult cpu = run_command(bin + " run -m " + model + gen + " -c 256 -ngl 0");
  REQUIRE(cpu.exit_code == 0);
  r = run_command("BERTH_SIM_DEVICE=1G " + bin + " run -m " + model + gen + flags +
                  " --residency-swaps 1");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out == cpu.out);
  const std::regex line(
      R"(\nresidency: \d+ swaps, \d+\.\d% of routed expert calls on the device, \d+\.\d MiB moved\n)");
  CHECK(std::regex_search(r.err, line));
  CHECK(cpu.err.find("residency:") == std::string::npos);
  // --residency static: no slots, no line.
  r = run_command("BERTH_SIM_DEVICE=1G " + bin + " run -m " + model + gen +
                  " -c 256 -ngl 99 --cpu-moe --residency static");
  REQUIRE(r.exit_code == 0);
  CHECK(r.out == cpu.out);
  CHECK(r.err.find("residency:") == std::string::npos);
  r = run_command(bin + " run -m " + model + " --residency sometimes -p hi");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--residency") != std::string::npos);
}

TEST_CASE("expert slots: the plan counts what the device holds, and the budget holds") {
  if (use_cuda()) return;  // place() opens the first CUDA device there; the sizes are the sim's
  gguf::File file = gguf::File::open(moe_file("tiny-qwen3moe", "q8_0"));
  auto model = load_model(file);
  setenv("BERTH_SIM_DEVICE", "1G", 1);
  placement::Flags f;
  f.n_gpu_layers = 99;
  f.cpu_moe = true;
  f.residency = placement::ResidencyMode::adaptive;
  // The static plan's total: a budget 1 MiB above it leaves room for a few slots only.
  size_t static_total = 0;
  {
    placement::Flags fs = f;
    fs.residency = placement::ResidencyMode::fixed;
    SessionParams sp;
    sp.n_ctx = 256;
    sp.n_ubatch = 64;
    static_total = place(*model, fs, sp, false).plan.gpu_total();
  }
  for (const size_t budget : {size_t{0}, static_total + (size_t{1} << 20)}) {
    CAPTURE(budget);
    if (budget > 0) f.vram_budget = budget;
    SessionParams sp;
    sp.n_threads = 2;
    sp.n_ctx = 256;
    sp.n_ubatch = 64;
    PlacementSetup placed = place(*model, f, sp, false);
    REQUIRE(placed.device != nullptr);
    const placement::Plan& plan = placed.plan;
    CHECK(plan.expert_slots > 0);
    if (budget == 0) CHECK(plan.expert_slots == 7);  // n_expert - 1
    if (budget > 0) CHECK(plan.expert_slots < 7);    // the budget bounds it
    CHECK(sp.hybrid.expert_slots.slots_per_layer == plan.expert_slots);
    Session s(*model, sp);
    const ExpertSlots* xs = s.residency()->expert_slots();
    REQUIRE(xs != nullptr);
    CHECK(xs->capacity() == plan.expert_slots);
    CHECK(xs->device_bytes() == plan.slot_bytes);
    Device& dev = *placed.device;
    std::vector<int32_t> p = prompt_of(64);
    s.eval(p);
    int32_t t = 7;
    for (int i = 0; i < 8; ++i) t = s.eval_argmax(t);
    // Everything the device holds (weights, slots, KV cache, steps' scratch) within the plan's
    // total, which is within the budget.
    const size_t used = dev.total_bytes() - dev.free_bytes();
    MESSAGE("device holds ", used >> 10, " KiB; the plan ", plan.gpu_total() >> 10, " KiB with ",
            plan.expert_slots, " slots per layer");
    CHECK(used <= plan.gpu_total() - plan.margin_bytes);
    CHECK(plan.gpu_total() <= plan.budget_bytes);
  }
  unsetenv("BERTH_SIM_DEVICE");
}

TEST_CASE("berth plan names the experts the slots start with, as the run loads them") {
  // tiny-qwen3moe: MoE layers blk.0 and blk.1 of 8 experts, top-2; --cpu-moe at 1 GiB gives 7
  // slots per layer. A calibration trace where blk.0 never calls expert 2 and blk.1 never calls
  // expert 5 (each other expert twice): the frequency policy seeds the slots with the other
  // seven, fixed; the default policy starts with experts 0-6 and moves them.
  if (use_cuda()) return;  // place() opens the first CUDA device there
  using test::run_command;
  using test::shell_quote;
  const std::string path = moe_file("tiny-qwen3moe", "q8_0");
  gguf::File file = gguf::File::open(path);
  auto model = load_model(file);
  residency::RoutingTrace cal;
  cal.shape.n_layer = 2;
  cal.shape.n_expert = 8;
  cal.shape.n_expert_used = 2;
  cal.shape.blocks = {0, 1};
  const std::vector<std::vector<uint16_t>> called = {{0, 1, 3, 4, 5, 6, 7}, {0, 1, 2, 3, 4, 6, 7}};
  for (size_t i = 0; i < 7; ++i) {
    cal.kinds.push_back(residency::TokenKind::decode);
    for (const auto& c : called) cal.ids.insert(cal.ids.end(), {c[i], c[(i + 1) % 7]});
  }
  const std::string trace = (test::temp_dir("slots") / "seed-cal.trace").string();
  residency::write_routing_trace(trace, cal);
  const std::vector<int32_t> want0 = {0, 1, 3, 4, 5, 6, 7}, want1 = {0, 1, 2, 3, 4, 6, 7};
  const std::vector<int32_t> first7 = {0, 1, 2, 3, 4, 5, 6};

  setenv("BERTH_SIM_DEVICE", "1G", 1);
  placement::Flags f;
  f.n_gpu_layers = 99;
  f.cpu_moe = true;
  f.residency = placement::ResidencyMode::adaptive;
  for (const bool frequency : {false, true}) {
    CAPTURE(frequency);
    SessionParams sp;
    sp.n_threads = 2;
    sp.n_ctx = 256;
    sp.n_ubatch = 64;
    if (frequency) sp.hybrid.expert_slots.policy = make_slot_policy("frequency:" + trace);
    PlacementSetup placed = place(*model, f, sp, false);
    const placement::Plan& plan = placed.plan;
    REQUIRE(plan.expert_slots == 7);
    REQUIRE(plan.slot_seed.size() == 2);
    auto sorted = [](std::vector<int32_t> v) {
      std::sort(v.begin(), v.end());
      return v;
    };
    CHECK(sorted(plan.slot_seed[0]) == (frequency ? want0 : first7));
    CHECK(sorted(plan.slot_seed[1]) == (frequency ? want1 : first7));
    CHECK(plan.slots_move == !frequency);
    // The run's slots hold exactly those, in the same slot order, before any step.
    Session s(*model, sp);
    const ExpertSlots* xs = s.residency()->expert_slots();
    REQUIRE(xs != nullptr);
    REQUIRE(xs->n_layers() == 2);
    CHECK(xs->slot_experts(0) == plan.slot_seed[0]);
    CHECK(xs->slot_experts(1) == plan.slot_seed[1]);
    CHECK(xs->stats().swaps == 0);
    // The table and the JSON say so.
    const std::string t = placement::plan_table(placed.request, plan);
    INFO(t);
    const nlohmann::json j = nlohmann::json::parse(placement::plan_json(placed.request, plan));
    REQUIRE(j["moe_layers"].size() == 2);
    CHECK(j["moe_layers"][0]["gpu_experts"].get<std::vector<int32_t>>() ==
          (frequency ? want0 : first7));
    CHECK(j["moe_layers"][1]["gpu_experts"].get<std::vector<int32_t>>() ==
          (frequency ? want1 : first7));
    CHECK(j["moe_layers"][0]["gpu_experts_move"] == !frequency);
    if (frequency) {
      CHECK(j["slot_policy"] == "frequency(" + trace + ")");
      CHECK(t.find("the slots hold the experts listed, fixed") != std::string::npos);
      CHECK(t.find("blk.0             7 of 8 (expert slots; the rest on the CPU): 0-1,3-7\n") !=
            std::string::npos);
      CHECK(t.find("blk.1             7 of 8 (expert slots; the rest on the CPU): 0-4,6-7\n") !=
            std::string::npos);
    } else {
      CHECK(j["slot_policy"] == "lfu-decay(h=64,z=3)");
      CHECK(t.find("policy lfu-decay(h=64,z=3): the slots start with the experts listed and "
                   "follow the routing while running") != std::string::npos);
      CHECK(t.find("blk.0-1           7 of 8 (expert slots; the rest on the CPU): 0-6\n") !=
            std::string::npos);
    }
  }
  unsetenv("BERTH_SIM_DEVICE");

  // The same through `berth plan --residency-policy`.
  const std::string bin = test::berth_bin();
  const test::CommandResult r =
      run_command(bin + " plan -m " + shell_quote(path) +
                  " --vram-budget 1G -c 256 -ngl 99 --cpu-moe --residency adaptive "
                  "--residency-policy " +
                  shell_quote("frequency:" + trace) + " --json");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const nlohmann::json j = nlohmann::json::parse(r.out);
  CHECK(j["moe_layers"][0]["gpu_experts"].get<std::vector<int32_t>>() == want0);
  CHECK(j["moe_layers"][1]["gpu_experts"].get<std::vector<int32_t>>() == want1);
}
