// Unified memory (issue 25): a simulated unified board (BERTH_SIM_DEVICE=unified:SIZE) holds
// every weight once. The device reads the weights it computes in place (no device allocation
// holds a weight byte), the plan draws everything from one pool (the OS's available memory minus
// a margin, not what the device reports free), a plan that does not fit is refused before
// loading with every term named, and the cost model, not where bytes live, decides who computes.
//
// The model files are synthetic: a tiny qwen3moe in f32 to run, and a sparse (header-only)
// Qwen3.5-27B-shaped f16 file, ~54 GB of holes, for the plans (the simulated device tracks
// capacity, not bytes).
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "berth/backends/device.h"
#include "berth/core/error.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/residency/residency.h"
#include "berth/runtime/placed.h"
#include "berth/runtime/session.h"
#include "berth/tools/synth.h"
#include "greedy_run.h"
#include "test_util.h"

using namespace berth;
using placement::Home;

namespace {

using test::Run;
using test::same_bits;

/// `n` greedy steps after a fixed 24-token prompt.
Run greedy(Session& s, int n) {
  std::vector<int32_t> prompt;
  for (int i = 0; i < 24; ++i) prompt.push_back((i * 37 + 11) % 200 + 3);
  return test::greedy(s, prompt, n);
}

std::string moe_file() {
  SynthSpec spec = synth_preset("tiny-qwen3moe");
  spec.type = "f32";
  spec.seed = 11;
  spec.n_expert = 8;
  spec.n_expert_used = 2;
  const auto path = test::temp_dir("unified") / "tiny-qwen3moe-8x2-f32.gguf";
  if (!std::filesystem::exists(path)) write_synth_model(spec, path.string(), 2);
  return path.string();
}

// `spec` written sparse (its tensor data left as holes: plans only) as `name` in the test temp
// dir, once.
std::string sparse_file(SynthSpec spec, const std::string& name) {
  spec.sparse = true;
  const auto path = test::temp_dir("unified") / name;
  if (!std::filesystem::exists(path)) write_synth_model(spec, path.string(), 1);
  return path.string();
}
SynthSpec preset_as(const std::string& preset, const std::string& type) {
  SynthSpec spec = synth_preset(preset);
  spec.type = type;
  return spec;
}

// Qwen3.5-27B's shape in f16 (~54 GB).
std::string sparse_27b() {
  return sparse_file(preset_as("qwen3.5-27b", "f16"), "qwen3.5-27b-f16-sparse.gguf");
}

// Qwen3-30B-A3B's shape in q4_k (~16 GiB, 15 GiB of it routed experts).
std::string sparse_30b() {
  return sparse_file(preset_as("qwen3-30b-a3b", "q4_k"), "qwen3-30b-a3b-q4_k-sparse.gguf");
}

// The same in q4_k_m (~17.3 GiB; 951.3 MiB of weights other than routed experts).
std::string sparse_big() {
  return sparse_file(preset_as("qwen3-30b-a3b", "q4_k_m"), "qwen3-30b-a3b-q4_k_m-sparse.gguf");
}

// Qwen3-30B-A3B's shapes with 2 layers and a 32000-token vocabulary in q4_k (~740 MiB), written
// sparse: plans of 1-3 GB boards. `n_ctx`: its context_length.
std::string sparse_mid(int64_t n_ctx = 4096) {
  SynthSpec spec = preset_as("qwen3-30b-a3b", "q4_k");
  spec.n_layer = 2;
  spec.n_vocab = 32000;
  spec.n_ctx_train = n_ctx;
  return sparse_file(spec, fmt::format("qwen3-30b-a3b-mid-{}.gguf", n_ctx));
}

test::CommandResult berth_with(const std::string& sim, const std::string& args) {
  return test::run_command("BERTH_SIM_DEVICE=" + test::shell_quote(sim) + " " + test::berth_bin() +
                           " " + args);
}

// The SessionParams serve passes to place() by default (-ub 512, one sequence).
SessionParams serve_params() {
  SessionParams p;
  p.hybrid.stream_experts_min_tokens = kStreamExpertsAuto;
  return p;
}

bool has(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

bool any_note(const nlohmann::json& j, const std::string& needle) {
  for (const auto& n : j["notes"])
    if (has(n.get<std::string>(), needle)) return true;
  return false;
}

// A session placed by place() on the device BERTH_SIM_DEVICE names, with `flags`; runs 16
// greedy steps. Reports the device's memory in use after them and what Residency uploaded.
struct Placed {
  Run run;
  placement::Plan plan;
  bool unified = false;
  size_t device_used = 0, uploaded = 0, in_place = 0, host_copy = 0, homed_bytes = 0;
  size_t homed_matrix_bytes = 0;  // homed_bytes less the 1-D tensors
};

Placed run_on(const Model& model, const std::string& sim, placement::Flags flags) {
  ::setenv("BERTH_SIM_DEVICE", sim.c_str(), 1);
  SessionParams sp;
  sp.n_threads = 2;
  sp.n_ctx = 128;
  sp.n_ubatch = 32;
  PlacementSetup setup = place(model, flags, sp, false);
  ::unsetenv("BERTH_SIM_DEVICE");
  Placed p;
  p.plan = setup.plan;
  p.unified = sp.unified;
  {
    Session s(model, sp);
    p.run = greedy(s, 16);
    if (setup.device) {
      p.device_used = setup.device->total_bytes() - setup.device->free_bytes();
      p.uploaded = s.residency()->device_weight_bytes();
      p.in_place = s.residency()->in_place_weight_bytes();
      p.host_copy = s.residency()->host_copy_weight_bytes();
    }
  }
  const graph::WeightTable& w = model.weights();
  for (size_t i = 0; i < w.size(); ++i) {
    if (i >= p.plan.home.size() || p.plan.home[i] != Home::gpu) continue;
    const TensorView& t = w.tensors[i];
    const bool vector = uploads_as_f32(t);
    p.homed_bytes += vector ? static_cast<size_t>(t.ne[0]) * 4 : t.n_bytes;
    if (!vector) p.homed_matrix_bytes += t.n_bytes;
  }
  return p;
}

nlohmann::json plan_json(const std::string& sim, const std::string& model, const std::string& flags,
                         int* exit_code, std::string* err) {
  const test::CommandResult r =
      test::run_command("BERTH_SIM_DEVICE=" + test::shell_quote(sim) + " " + test::berth_bin() +
                        " plan -m " + test::shell_quote(model) + " --json" + flags);
  *exit_code = r.exit_code;
  *err = r.err;
  if (r.exit_code != 0) return {};
  return nlohmann::json::parse(r.out);
}

// One `berth plan --json` case: BERTH_SIM_DEVICE, the flags, the exit code, and text that the
// refusal (exit 1) or the plan's how and notes (exit 0) must contain, and must not.
struct PlanCase {
  std::string sim, flags;
  int rc = 0;
  std::vector<std::string> has, lacks;
};

// Runs each case with `model`; the plans, null for a refusal.
std::vector<nlohmann::json> check_plans(const std::string& model,
                                        const std::vector<PlanCase>& cases) {
  std::vector<nlohmann::json> out;
  for (const PlanCase& c : cases) {
    CAPTURE(c.sim);
    CAPTURE(c.flags);
    int rc = 0;
    std::string err;
    nlohmann::json j = plan_json(c.sim, model, c.flags, &rc, &err);
    CHECK_MESSAGE(rc == c.rc, err);
    std::string text = err;
    if (rc == 0) {
      text = j["how"].get<std::string>();
      for (const auto& n : j["notes"]) {
        text += '\n';
        text += n.get<std::string>();
      }
    }
    for (const std::string& h : c.has) CHECK_MESSAGE(has(text, h), h, " in: ", text);
    for (const std::string& h : c.lacks) CHECK_MESSAGE(!has(text, h), h, " in: ", text);
    out.push_back(std::move(j));
  }
  return out;
}

// "the GPU computes X of Y units" as the plan's tensors say it: a unit is a layer's routed
// experts, the rest of a layer, or a global group (output norm, head, embedding); X of them on
// the GPU.
std::string units_text(const nlohmann::json& j) {
  std::map<std::string, bool> unit;  // -> on the GPU
  for (const auto& t : j["tensors"]) {
    const int layer = t["layer"].get<int>();
    const std::string role = t["role"].get<std::string>();
    const std::string key =
        layer < 0 ? role : fmt::format("{}{}", layer, role == "routed expert" ? " exps" : "");
    unit[key] = unit[key] || t["home"].get<std::string>() == "GPU";
  }
  const auto on = std::count_if(unit.begin(), unit.end(), [](const auto& u) { return u.second; });
  return fmt::format("the GPU computes {} of {} units", on, unit.size());
}

}  // namespace

TEST_CASE("unified: the simulated board's spec") {
  SimDeviceOptions o = parse_unified_sim("128G", "unified:128G");
  CHECK(o.unified);
  CHECK(o.capacity_bytes == size_t{128} << 30);
  CHECK(o.os_available_bytes == size_t{128} << 30);  // default: the whole board
  CHECK(o.reported_free_bytes == 0);
  o = parse_unified_sim("8G,available=6G,free=2G,gpu_gbps=100,cpu_tflops=0.5", "s");
  CHECK(o.os_available_bytes == size_t{6} << 30);
  CHECK(o.reported_free_bytes == size_t{2} << 30);
  CHECK(o.gpu_gbps == 100);
  CHECK(o.cpu_tflops == 0.5);
  {
    auto dev = make_device("unified:8G,available=6G,free=2G");
    const DeviceInfo i = dev->info();
    CHECK(i.unified);
    CHECK(i.pageable_access);
    CHECK(i.os_available_bytes == size_t{6} << 30);
    CHECK(i.free_bytes == size_t{2} << 30);  // what it reports, as cudaMemGetInfo would
  }
  CHECK_FALSE(make_device("unified:8G,pageable=0")->info().pageable_access);
  CHECK_FALSE(make_device("sim:1G")->info().unified);
  using test::expect_error;
  const auto inv = ErrorCategory::invalid_argument;
  expect_error(inv, [] { parse_unified_sim("8G,fast=1", "unified:8G,fast=1"); },
               {"unified:8G,fast=1", "unknown setting 'fast'"});
  expect_error(inv, [] { parse_unified_sim("8G,available", "u"); }, {"'available'", "KEY=VALUE"});
  expect_error(inv, [] { parse_unified_sim("8G,available=9G", "u"); }, {"available=", "board"});
  expect_error(inv, [] { parse_unified_sim("lots", "u"); }, {"size 'lots'", "not a number"});
  expect_error(inv, [] { parse_unified_sim("8G,pageable=yes", "u"); }, {"pageable=yes", "0 or 1"});
  expect_error(inv, [] { parse_unified_sim("8G,gpu_gbps=-3", "u"); }, {"gpu_gbps=-3"});
  expect_error(inv, [] { make_device("unified:0"); }, {"more than 0"});
  expect_error(inv, [] { parse_unified_sim("8G,available=0", "u"); },
               {"available=0", "more than 0"});
  expect_error(inv, [] { parse_unified_sim("8G,free=9G", "u"); }, {"free=", "board"});
  expect_error(inv, [] { parse_unified_sim("8G,free=0", "u"); }, {"free=0", "more than 0"});
  expect_error(inv, [] { parse_unified_sim("8G,available=6G,available=5G", "u"); },
               {"'available'", "twice"});
}

TEST_CASE("unified: a malformed BERTH_SIM_DEVICE is a usage error (exit 2) naming the value") {
  const std::string model = test::shell_quote(moe_file());
  // "0" as "unified:0": a device of no memory is a mistake (it planned for a GPU of 0 bytes).
  // -ngl 0 opens no device, but a malformed value is still an error there (it was ignored by
  // run, serve and bench); KEY=VALUE settings without unified: are a mistake too.
  for (const char* sim : {"unified:8G,fast=1", "unified:lots", "unified:8G,available=9G", "lots",
                          "0", "unified:0", "8G,pageable=0"})
    for (const char* cmd : {" plan -m ", " run -p hi -n 1 -m ", " run -ngl 0 -p hi -n 1 -m ",
                            " bench model -ngl 0 -p 0 -n 1 -r 1 -m "}) {
      CAPTURE(sim);
      CAPTURE(cmd);
      const test::CommandResult r = test::run_command("BERTH_SIM_DEVICE=" + test::shell_quote(sim) +
                                                      " " + test::berth_bin() + cmd + model);
      CHECK(r.exit_code == 2);
      CHECK(r.err.rfind("berth: error: ", 0) == 0);
      CHECK(r.err.find("BERTH_SIM_DEVICE") != std::string::npos);
    }
  // default_device() reports it as Error(usage), the category the CLI exits 2 for.
  ::setenv("BERTH_SIM_DEVICE", "unified:8G,fast=1", 1);
  test::expect_error(ErrorCategory::usage, [] { (void)default_device(); },
                     {"unified:8G,fast=1", "unknown setting 'fast'"});
  ::unsetenv("BERTH_SIM_DEVICE");
}

TEST_CASE("unified: weights held once, read in place by the device, the same bits") {
  gguf::File file = gguf::File::open(moe_file());
  auto model = load_model(file);
  for (const bool cpu_moe : {false, true}) {
    CAPTURE(cpu_moe);
    placement::Flags f;
    f.cpu_moe = cpu_moe;
    if (cpu_moe) f.n_gpu_layers = 99;
    f.residency = placement::ResidencyMode::fixed;  // the discrete run: no expert slots
    const Placed discrete = run_on(*model, "2G", f);
    const Placed unified = run_on(*model, "unified:2G", f);
    REQUIRE_FALSE(discrete.unified);
    REQUIRE(unified.unified);
    CHECK(unified.plan.unified);
    // The same plan: the automatic one puts every unit on the GPU under the default rates.
    CHECK(unified.plan.home == discrete.plan.home);
    CHECK(unified.plan.kv_home == discrete.plan.kv_home);
    if (!cpu_moe) {
      CHECK(std::all_of(unified.plan.home.begin(), unified.plan.home.end(),
                        [](Home h) { return h == Home::gpu; }));
      CHECK(unified.plan.how.find("the GPU computes") != std::string::npos);
    }
    // Nothing uploaded, everything the device computes read where it is; the device holds
    // exactly what the discrete run holds less its weight copies.
    CHECK(discrete.uploaded == discrete.homed_bytes);
    CHECK(discrete.uploaded > 0);
    CHECK(unified.uploaded == 0);
    CHECK(unified.in_place == unified.homed_bytes);
    CHECK(unified.device_used + discrete.uploaded == discrete.device_used);
    CHECK(unified.device_used < discrete.uploaded);
    // The same kernels on the same bytes.
    CHECK(same_bits(unified.run, discrete.run));
  }
}

// The unified path where the device has no pageable memory access: the weights it computes are
// copied once into page-locked host memory, which it reads over its bus. With
// BERTH_TEST_DEVICE=cuda this is the H200 correctness run of issue 25 (--unified on on the H200,
// pageableMemoryAccess 0); otherwise the simulated board without pageable access (as Jetson Orin)
// and --unified on on the simulated discrete device (which reads in place).
TEST_CASE(
    "unified: without pageable access, one page-locked host copy and the normal path's bits") {
  gguf::File file = gguf::File::open(moe_file());
  auto model = load_model(file);
  const bool cuda = test::use_cuda();
  struct Case {
    std::string normal, unified;  // BERTH_SIM_DEVICE ("": the real GPU)
    bool copies;
  };
  std::vector<Case> cases;
  if (cuda)
    cases = {{"", "", true}};
  else
    cases = {{"2G", "unified:2G,pageable=0", true}, {"2G", "2G", false}};
  for (const Case& c : cases)
    for (const bool cpu_moe : {false, true}) {
      CAPTURE(c.unified);
      CAPTURE(cpu_moe);
      placement::Flags f;
      f.n_gpu_layers = 99;
      f.cpu_moe = cpu_moe;
      f.residency = placement::ResidencyMode::fixed;
      f.unified = placement::UnifiedMode::off;
      const Placed normal = run_on(*model, c.normal, f);
      f.unified = placement::UnifiedMode::on;
      const Placed unified = run_on(*model, c.unified, f);
      REQUIRE_FALSE(normal.unified);
      REQUIRE(unified.unified);
      CHECK(unified.plan.home == normal.plan.home);
      CHECK(normal.uploaded == normal.homed_bytes);
      CHECK(normal.uploaded > 0);
      CHECK(unified.uploaded == 0);
      CHECK(unified.in_place == unified.homed_bytes);
      CHECK(unified.host_copy == (c.copies ? unified.homed_matrix_bytes : 0));
      CHECK(unified.homed_matrix_bytes > 0);
      CHECK(same_bits(unified.run, normal.run));
    }
}

TEST_CASE("unified: the cost model, not where bytes live, picks who computes") {
  gguf::File file = gguf::File::open(moe_file());
  auto model = load_model(file);
  placement::Flags f;
  // A board whose CPU reads the shared memory faster than its GPU: the CPU computes everything
  // the automatic plan decides (the KV cache follows the layers).
  const Placed cpu = run_on(*model, "unified:2G,gpu_gbps=40,cpu_gbps=200,gpu_tflops=1", f);
  CHECK(cpu.plan.unified);
  CHECK(std::all_of(cpu.plan.home.begin(), cpu.plan.home.end(),
                    [](Home h) { return h == Home::cpu; }));
  CHECK(cpu.plan.how.find("the CPU is faster for") != std::string::npos);
  // Flags still say who computes: -ngl 99 puts the layers on the GPU whatever the rates.
  f.n_gpu_layers = 99;
  const Placed forced = run_on(*model, "unified:2G,gpu_gbps=40,cpu_gbps=200,gpu_tflops=1", f);
  CHECK(std::count(forced.plan.home.begin(), forced.plan.home.end(), Home::gpu) > 0);
  // Whoever computes, the greedy tokens are the CPU-only run's (the simulated device's f16 KV
  // cache moves logits by far less than the gaps here).
  const Placed gpu = run_on(*model, "unified:2G", placement::Flags{});
  CHECK(cpu.run.tokens == gpu.run.tokens);
  CHECK(forced.run.tokens == gpu.run.tokens);
}

TEST_CASE("unified: a 27B-class f16 plan fits a 128 GB board once, and an 8 GB one refuses it") {
  const std::string model = sparse_27b();
  int rc = 0;
  std::string err;
  // GB10-like: 128 GB, all of it available. The weights (~51 GiB) are held once: nothing counts
  // as VRAM, everything comes from one pool of 127 GiB.
  nlohmann::json j = plan_json("unified:128G", model, "", &rc, &err);
  INFO(err);
  REQUIRE(rc == 0);
  REQUIRE(j["unified"].is_object());
  const auto weights = j["unified"]["weights_bytes"].get<size_t>();
  CHECK(weights > size_t{50} << 30);
  CHECK(j["unified"]["pool_bytes"].get<size_t>() == (size_t{127} << 30));
  CHECK(j["unified"]["total_bytes"].get<size_t>() <= (size_t{127} << 30));
  CHECK(j["unified"]["total_bytes"].get<size_t>() < weights + (size_t{4} << 30));  // once
  CHECK(j["tiers"]["vram_bytes"].get<size_t>() == 0);
  CHECK(j["unified"]["gpu_computes_bytes"].get<size_t>() == weights);
  // A discrete plan of the same board size would need the weights twice (the file's pages and a
  // device copy): with --unified off, the device's share is a copy.
  j = plan_json("unified:128G", model, " --unified off", &rc, &err);
  REQUIRE(rc == 0);
  CHECK(j["unified"].is_null());
  CHECK(j["tiers"]["vram_bytes"].get<size_t>() > size_t{50} << 30);

  // --vram-budget caps the GPU's side of the pool; the CPU computes the rest, still once.
  j = plan_json("unified:128G", model, " --vram-budget 20G", &rc, &err);
  REQUIRE(rc == 0);
  CHECK(j["devices"]["GPU"]["total_bytes"].get<size_t>() <= size_t{20} << 30);
  CHECK(j["unified"]["cpu_computes_bytes"].get<size_t>() > size_t{30} << 30);
  CHECK(j["unified"]["total_bytes"].get<size_t>() < weights + (size_t{4} << 30));
  // ... and --ram-budget caps the CPU's side: a refusal says so (raising it is the fix).
  j = plan_json("unified:128G", model, " --vram-budget 20G --ram-budget 10G", &rc, &err);
  CHECK(rc == 1);
  CHECK(err.find("10240.0 MiB by --ram-budget") != std::string::npos);
  CHECK(err.find("raise --ram-budget") != std::string::npos);
  CHECK(err.find("cannot raise") == std::string::npos);
  // It described the all-CPU fallback (0 B computed by the GPU) and suggested a larger board,
  // which the 52 GiB model does not need: the refusal is the split's, and names the budgets.
  CHECK(has(err, "18301.8 MiB computed by the GPU"));
  CHECK(has(err, "raise --ram-budget, or raise --vram-budget"));
  CHECK(has(err, "everything on the CPU would miss by more"));
  CHECK_FALSE(has(err, "larger board"));
  CHECK_FALSE(has(err, "tried everything on the CPU"));
  // Each budget alone too small for its side: only raising both fits (it said "a larger board").
  j = plan_json("unified:128G", model, " -ngl 30 --vram-budget 20G --ram-budget 10G", &rc, &err);
  CHECK(rc == 1);
  CHECK_MESSAGE(has(err, "raise both --ram-budget and --vram-budget"), err);
  CHECK_FALSE(has(err, "larger board"));
  // Both remedies work.
  j = plan_json("unified:128G", model, " --vram-budget 20G --ram-budget 40G", &rc, &err);
  CHECK(rc == 0);
  j = plan_json("unified:128G", model, " --vram-budget 60G --ram-budget 10G", &rc, &err);
  CHECK(rc == 0);
  // No split of the 52 GiB model fits a 24 GB board: the refusal said so with no remedy.
  j = plan_json("unified:24G", model, " -ngl 10", &rc, &err);
  CHECK(rc == 1);
  CHECK(has(err, "unified memory but the pool is 23552.0 MiB"));
  CHECK(has(err, "(-ngl 10); use a smaller quantization or a larger board"));

  // Orin 8 GB: refused before loading, naming every term.
  test::CommandResult r = test::run_command("BERTH_SIM_DEVICE=unified:8G " + test::berth_bin() +
                                            " run -m " + test::shell_quote(model) + " -p hi -n 1");
  CHECK(r.exit_code == 1);
  for (const char* term :
       {"unified memory", "pool is 7168.0 MiB", "held once", "computed by the GPU", "by the CPU",
        "GPU KV cache", "CPU KV cache", "scratch", "margin", "RAM expert slots",
        "8192.0 MiB the OS reports available", "margin of 1024.0 MiB", "the device reports"})
    CHECK_MESSAGE(r.err.find(term) != std::string::npos, term, " in: ", r.err);
  CHECK(r.err.find("loaded") == std::string::npos);

  // The OS and the device disagree: the device reports 3 GiB free (cudaMemGetInfo on a GB10
  // counts the page cache as used) while the OS has 100 GiB available: the plan follows the OS.
  j = plan_json("unified:128G,available=100G,free=3G", model, "", &rc, &err);
  REQUIRE(rc == 0);
  CHECK(j["unified"]["pool_bytes"].get<size_t>() == (size_t{99} << 30));
  CHECK(j["unified"]["device_reported_free_bytes"].get<size_t>() == (size_t{3} << 30));
  // ... and the other way round: the device reports the whole board free, the OS has 40 GiB.
  j = plan_json("unified:128G,available=40G", model, "", &rc, &err);
  CHECK(rc == 1);
  CHECK(err.find("pool is 39936.0 MiB") != std::string::npos);
  CHECK(err.find("40960.0 MiB the OS reports available") != std::string::npos);
  CHECK(err.find("the device reports 131072.0 MiB free") != std::string::npos);

  // serve's default context on the GB10: from the pool (127 GiB beside ~51 GiB of weights), not
  // from this machine's memory (which does not even hold the file: it gave 2 tokens).
  {
    gguf::File file = gguf::File::open(model);
    auto m = load_model(file);
    placement::Flags flags;
    ::setenv("BERTH_SIM_DEVICE", "unified:128G", 1);
    std::unique_ptr<Device> dev = placement_device(flags);
    std::string note;
    CHECK(default_serve_context(*m, flags, serve_params(), dev, &note) == m->hparams().n_ctx_train);
    ::unsetenv("BERTH_SIM_DEVICE");
    CHECK(note.empty());
  }
  std::filesystem::remove(model);  // a hole, but 54 GB as ls sees it
}

TEST_CASE("unified: the automatic plan moves routed experts to the disk tier before refusing") {
  const std::string model = sparse_30b();
  // The GPU's side takes only what the pool holds beside the CPU's least (what must stay in RAM
  // and one RAM slot per MoE layer the CPU computes); the units the text counts are the plan's.
  const std::vector<nlohmann::json> j = check_plans(
      model, {
                 // Orin 8 GB without pageable access: the first 36 layers' routed experts go to
                 // the disk tier (the text said "66 of 66 units" beside them: 99 units). With the
                 // split's host buffers counted in the pool (1159.4 MiB at -ub 2048) it is 36
                 // layers, not the 33 (and 7, not 8, at 16 GB) of a plan that left them out.
                 {"unified:8G,pageable=0", "", 0, {"as --n-cpu-moe 36", "of 99 units"}, {}},
                 {"unified:16G", "", 0, {"as --n-cpu-moe 8", "of 99 units"}, {}},
                 // A board too small for any of it: refused, saying what the plan tried.
                 {"unified:2G",
                  "",
                  1,
                  {"(a pool of 1024.0 MiB)", "tried everything on the CPU",
                   "lower -c, use a smaller quantization or a larger board"},
                  {"put less on the GPU's side"}},
                 // A board above that: everything on the CPU (its disk tier), and what unified
                 // mode then means.
                 {"unified:3000M",
                  "",
                  0,
                  {"everything runs on the CPU (as --vram-budget 0)", "unified mode stays on",
                   "the plan is -ngl 0's"},
                  {}},
             });
  for (const nlohmann::json& p : {j[0], j[1]}) {
    CHECK(has(p["how"].get<std::string>(), units_text(p)));
    CHECK(p["unified"]["total_bytes"].get<size_t>() <= p["unified"]["pool_bytes"].get<size_t>());
    CHECK(p["tiers"]["ram_slots"].get<int>() >= 1);
    CHECK(p["tiers"]["disk_bytes"].get<size_t>() > 0);
  }
  CHECK(j[1]["tiers"]["ram_slots"].get<int>() == 7);
  CHECK(j[3]["tiers"]["disk_bytes"].get<size_t>() > 0);
  // A board that fits is never followed by a larger one that is refused (2 layers of the same
  // shapes: 1.5-2 GB boards plan all on the CPU, 2.2 GB on the GPU), and --cpu-moe fits wherever
  // the automatic plan does (its greedy fill left the CPU 1-50 MiB, no RAM slot: 2-3 GB boards
  // refused it while the automatic plan fitted at 3 GB).
  SynthSpec two = synth_preset("qwen3-30b-a3b");
  two.type = "q4_k";
  two.sparse = true;
  two.n_layer = 2;
  const auto two_path = test::temp_dir("unified") / "qwen3-30b-a3b-2l-q4_k-sparse.gguf";
  if (!std::filesystem::exists(two_path)) write_synth_model(two, two_path.string(), 1);
  for (const std::string& file : {two_path.string(), model})
    for (const char* flags : {"", " --cpu-moe"}) {
      CAPTURE(file);
      CAPTURE(flags);
      bool fitted = false;
      // (1200M, 2G and 3500M were dropped to keep CI's ASan run short: each plan of the
      // 48-layer file takes about 1.2 s there.)
      for (const char* board : {"1500M", "1800M", "2200M", "2500M", "3G", "4G", "6G"}) {
        CAPTURE(board);
        int rc = 0, auto_rc = 0;
        std::string err;
        const std::string sim = std::string("unified:") + board;
        (void)plan_json(sim, file, flags, &rc, &err);
        if (fitted) CHECK(rc == 0);
        fitted = fitted || rc == 0;
        if (*flags == '\0') continue;
        (void)plan_json(sim, file, "", &auto_rc, &err);
        if (auto_rc == 0) CHECK(rc == 0);
      }
      CHECK(fitted);
    }
}

TEST_CASE("unified: a board's memory is one pool whoever computes; a plan of copies says so") {
  const std::string model = sparse_30b();
  const std::vector<nlohmann::json> j = check_plans(
      model, {
                 // --unified off: the GPU's copies and the CPU's side come from the same memory (it
                 // planned 21.9 GiB on an 8 GiB board without a word). The automatic plan keeps
                 // the CPU's least beside the GPU's copies, so it fits; explicit flags beyond the
                 // pool are refused, naming only remedies that work (not --unified auto, which
                 // does not fit -ngl 99 --cpu-moe's GPU side either, nor --vram-budget, which
                 // changes no explicit plan).
                 // The figures named are those used: the pool less the activations, and the
                 // pool, 7168.0 MiB (it called 5622.8 MiB "the pool").
                 {"unified:8G",
                  " --unified off",
                  0,
                  {"counts both sides against the pool: 5536.5 MiB of the 5622.8 MiB the "
                   "activations (1545.2 MiB) leave of the pool of 7168.0 MiB",
                   "--unified auto holds each weight once"},
                  {"of 5622.8 MiB ("}},
                 {"unified:2G",
                  " --unified off -ngl 99 --cpu-moe",
                  1,
                  {"which the GPU shares with the CPU (the pool of 1024.0 MiB", "copies of",
                   "the CPU's side", "lower -c, use a smaller quantization or a larger board"},
                  {"--unified auto", "--vram-budget SIZE", "lower -ngl", "leave out -ngl"}},
                 {"unified:24G",
                  " --unified off --vram-budget 4G",
                  0,
                  {"holds the 868.6 MiB of weights the GPU computes twice", "against the pool"},
                  {}},
                 // -ngl 0 and --vram-budget 0: the board's available memory bounds the CPU's side
                 // (not this host's MemAvailable), the same plan either way.
                 {"unified:8G,available=6G", " -ngl 0", 0, {}, {}},
                 {"unified:8G,available=6G", " --vram-budget 0", 0, {"unified mode stays on"}, {}},
                 // --unified on on a discrete device: its own memory holds the KV cache, scratch
                 // and margin (the weights stay in host memory).
                 {"2G",
                  " --unified on -ngl 99 --cpu-moe -c 40960",
                  1,
                  {"of SIM0's own memory but it reports 2048.0 MiB free", "KV cache 3840.0 MiB"},
                  {}},
                 {"2G", " --unified on -ngl 99 --cpu-moe -c 4096", 0, {}, {}},
                 // The board's pool caps the GPU's side of a plan of copies, not the device's
                 // free report (it was refused on "the budget is 2048.0 MiB (free on the
                 // device)"); a refusal names both sides against the pool.
                 {"unified:8G,free=2G", " --unified off -ngl 99 --n-cpu-moe 33", 0, {}, {}},
                 {"unified:8G,free=2G",
                  " --unified off -ngl 99 --n-cpu-moe 20",
                  1,
                  {"which the GPU shares with the CPU (the pool of 7168.0 MiB",
                   "the GPU's side 10901.7 MiB", "lower -ngl"},
                  {"free on the device", "2048.0 MiB"}},
             });
  // One RAM slot is singular in the tiers line (it said "1 RAM slots").
  {
    const test::CommandResult r =
        berth_with("unified:8G,free=2G",
                   "plan -m " + test::shell_quote(model) + " --unified off -ngl 99 --n-cpu-moe 33");
    CHECK_MESSAGE(has(r.out, "1 RAM slot per MoE layer"), r.out, r.err);
  }
  // The budget column is the pool less the activations (it showed the whole board, 8192.0 MiB).
  CHECK(std::abs(j[0]["devices"]["GPU"]["budget_bytes"].get<double>() / (1 << 20) - 5622.755) <
        0.001);
  // The board's 5 GiB pool (not this host's memory), less the CPU's activations at the default
  // -ub 2048 (kept: the disk tier takes more routed experts instead).
  CHECK(j[3]["tiers"]["ram_budget_bytes"].get<size_t>() <= size_t{5} << 30);
  CHECK(j[3]["tiers"]["ram_budget_bytes"].get<size_t>() > (size_t{5} << 30) - (size_t{256} << 20));
  CHECK(any_note(j[3], "a ubatch of 2048 tokens (the default -ub)"));
  CHECK(j[3]["tiers"]["disk_bytes"].get<size_t>() > 0);
  CHECK(j[4]["tiers"]["ram_bytes"] == j[3]["tiers"]["ram_bytes"]);
  CHECK(j[4]["tiers"]["disk_bytes"] == j[3]["tiers"]["disk_bytes"]);
}

TEST_CASE("unified: --unified off with adaptive residency says whether expert slots fit") {
  // The automatic plan leaves the GPU's room beside the attention to expert slots; on a board's
  // pool of copies the CPU's side (every routed expert) takes the rest first. It said "the rest
  // as expert slots" on an 8 GB board, where none fits (the CPU's side goes to the disk tier).
  check_plans(sparse_30b(), {{"unified:8G",
                              " --unified off --residency adaptive",
                              0,
                              {"--n-cpu-moe 48, no expert slot fits)", "disk tier:"},
                              {"the rest as expert slots", "--residency adaptive:"}},
                             {"unified:24G",
                              " --unified off --residency adaptive",
                              0,
                              {"--n-cpu-moe 48, the rest as expert slots)",
                               "--residency adaptive: 44 expert slots per CPU-held MoE layer"},
                              {"no expert slot fits"}}});
}

TEST_CASE("unified: the placement summary counts the disk tier's weights on the CPU") {
  const std::string path = sparse_30b();
  gguf::File file = gguf::File::open(path);
  auto model = load_model(file);
  SessionParams sp;
  sp.n_ctx = 4096;
  ::setenv("BERTH_SIM_DEVICE", "unified:8G", 1);
  const PlacementSetup s = place(*model, placement::Flags{}, sp, false, /*plan_only=*/true);
  ::unsetenv("BERTH_SIM_DEVICE");
  REQUIRE(s.plan.disk_weight_bytes > 0);
  const double gib = 1 << 30;
  // It said "0.00 GiB of weights on the CPU" while the CPU computed 33 layers' routed experts.
  CHECK(
      has(s.summary(),
          fmt::format("{:.2f} GiB of weights on the CPU ({:.2f} GiB of them routed experts read "
                      "from disk into {} RAM slots per MoE layer)",
                      static_cast<double>(s.plan.cpu_weight_bytes + s.plan.disk_weight_bytes) / gib,
                      static_cast<double>(s.plan.disk_weight_bytes) / gib, s.plan.ram_slots)));
}

TEST_CASE("unified: budgets above the pool are capped with a note naming the value and the pool") {
  const std::string model = sparse_30b();
  int rc = 0;
  std::string err;
  nlohmann::json j = plan_json("unified:16G", model, " --vram-budget 40G", &rc, &err);
  INFO(err);
  REQUIRE(rc == 0);
  CHECK(any_note(j, "--vram-budget 40960.0 MiB is more than the unified pool of 15360.0 MiB"));
  j = plan_json("unified:16G", model, " --ram-budget 1T", &rc, &err);
  REQUIRE(rc == 0);
  CHECK(any_note(j, "--ram-budget 1048576.0 MiB is more than the unified pool of 15360.0 MiB"));
  j = plan_json("unified:16G", model, " --vram-budget 10G --ram-budget 10G", &rc, &err);
  REQUIRE(rc == 0);
  CHECK(any_note(j,
                 "--vram-budget 10240.0 MiB and --ram-budget 10240.0 MiB add up to more "
                 "than the unified pool of 15360.0 MiB"));
  j = plan_json("unified:16G", model, " --ram-budget none", &rc, &err);
  REQUIRE(rc == 0);
  CHECK(any_note(j, "--ram-budget none: on unified memory the CPU's side is still capped"));
  // -ngl 0 on the board: the same pool caps it, and a note says so (it said nothing).
  check_plans(model, {{"unified:8G",
                       " -ngl 0 --ram-budget 20G",
                       0,
                       {"--ram-budget 20480.0 MiB is more than the board's pool of 7168.0 MiB"},
                       {}},
                      {"unified:8G",
                       " -ngl 0 --ram-budget none",
                       0,
                       {"--ram-budget none: the plan is still capped at the board's pool"},
                       {}},
                      {"unified:8G", " -ngl 0 --ram-budget 4G", 0, {}, {"--ram-budget"}}});
  // Budgets within the pool: no note.
  j = plan_json("unified:16G", model, " --vram-budget 8G --ram-budget 4G", &rc, &err);
  REQUIRE(rc == 0);
  CHECK_FALSE(any_note(j, "more than"));
  // The discrete case says the same of a --vram-budget above the device's free memory.
  j = plan_json("1G", moe_file(), " --vram-budget 4G", &rc, &err);
  REQUIRE(rc == 0);
  CHECK(any_note(j, "--vram-budget 4096.0 MiB is more than the 1024.0 MiB free on SIM0"));
}

TEST_CASE("unified: serve's default context is one the plan accepts, and its note is true") {
  const std::string path = sparse_30b();
  gguf::File file = gguf::File::open(path);
  auto model = load_model(file);
  // serve's default context for `flags` (as `cli` on the command line) on `sim`: refused (-1),
  // or a context `berth plan` with the same flags and serve's -ub accepts.
  struct Case {
    std::string sim, cli;
    int64_t context;  // -1: refused; 0: any the plan accepts
    std::vector<std::string> note;
  };
  const auto flags_of = [](const std::string& cli) {
    placement::Flags f;
    if (has(cli, "--cpu-moe")) f.cpu_moe = true;
    if (has(cli, "--ram-budget 1G")) f.ram_budget = size_t{1} << 30;
    if (has(cli, "--vram-budget 2G")) f.vram_budget = size_t{2} << 30;
    if (has(cli, "-ngl 0")) f.n_gpu_layers = 0;
    if (has(cli, "--unified off")) f.unified = placement::UnifiedMode::off;
    return f;
  };
  const std::vector<Case> cases = {
      // A pool of 1 GiB: the all-CPU plan needs the 868.6 MiB of weights other than routed
      // experts, one RAM slot per layer (122.1 MiB) and the KV cache: not even 256 tokens (the
      // sizing by the pool beside the weights alone gave 256, which the plan refused).
      {"unified:2G", "", -1, {}},
      {"unified:3G", "", 0, {"the unified pool of 2048.0 MiB less the activations ("}},
      // The GPU holds the KV cache: f16, 96 KiB per token (the note said f32, 192, before).
      {"unified:8G", "", 0, {"48 layers f16 on the GPU, 0 f32 on the CPU"}},
      {"unified:8G", "--cpu-moe", 0, {"48 layers f16 on the GPU"}},
      // The budget flags bound it too.
      {"unified:16G", "--ram-budget 1G", 0, {}},
      {"unified:16G", "--vram-budget 2G", 0, {}},
      // -ngl 0: the board's available memory, not this host's; f32, 192 KiB per token.
      {"unified:8G,available=6G",
       "-ngl 0",
       0,
       // The RAM budget is the pool less the CPU's activations (it named the whole pool,
       // 5120.0 MiB, which the activations also draw on).
       {"0 layers f16 on the GPU, 48 f32 on the CPU", "the RAM budget (5092.3 MiB)"}},
      {"unified:12G", "--unified off --vram-budget 2G", 0, {"the board's pool (--unified off)"}},
  };
  for (const Case& c : cases) {
    CAPTURE(c.sim);
    CAPTURE(c.cli);
    const placement::Flags flags = flags_of(c.cli);
    ::setenv("BERTH_SIM_DEVICE", c.sim.c_str(), 1);
    std::unique_ptr<Device> dev = placement_device(flags);
    std::string note;
    int64_t ctx = -1;
    try {
      ctx = default_serve_context(*model, flags, serve_params(), dev, &note);
    } catch (const Error& e) {
      CHECK(e.category() == ErrorCategory::out_of_memory);
      CHECK(has(e.what(), "cannot be lowered to a usable context"));
    }
    ::unsetenv("BERTH_SIM_DEVICE");
    INFO(note);
    if (c.context != 0) CHECK(ctx == c.context);
    for (const std::string& n : c.note) CHECK(has(note, n));
    // The KV cache's size in the note is the plan's: f16 on the GPU, f32 on the CPU.
    if (has(note, "48 layers f16 on the GPU, 0 f32"))
      CHECK(has(note, fmt::format("{:.1f} MiB at {} tokens", ctx * 96 / 1024.0, ctx)));
    if (has(note, "0 layers f16 on the GPU, 48 f32"))
      CHECK(has(note, fmt::format("{:.1f} MiB at {} tokens", ctx * 192 / 1024.0, ctx)));
    if (ctx > 0) {
      int rc = 0;
      std::string err;
      (void)plan_json(c.sim, path, fmt::format(" {} -ub 512 -c {}", c.cli, ctx), &rc, &err);
      CHECK_MESSAGE(rc == 0, err);
    }
  }
  // serve itself: refused before listening, naming the terms.
  const test::CommandResult r =
      berth_with("unified:1536M", "serve --port 0 -m " + test::shell_quote(path));
  CHECK(r.exit_code == 1);
  CHECK(has(r.err, "cannot be lowered to a usable context"));
  CHECK_FALSE(has(r.err, "listening"));
  // A discrete device and a tiny model: its context_length, no note.
  gguf::File tiny_file = gguf::File::open(moe_file());
  auto tiny = load_model(tiny_file);
  ::setenv("BERTH_SIM_DEVICE", "1G", 1);
  placement::Flags flags;
  std::unique_ptr<Device> dev = placement_device(flags);
  std::string note;
  CHECK(default_serve_context(*tiny, flags, serve_params(), dev, &note) ==
        tiny->hparams().n_ctx_train);
  ::unsetenv("BERTH_SIM_DEVICE");
  CHECK(note.empty());
}

TEST_CASE("unified: plan and run agree on -ngl 0, and run says when unified mode is on") {
  const std::string model = test::shell_quote(moe_file());
  const std::string gen = " -p hi -n 2 --temp 0 -c 64 -m " + model;
  for (const std::string sim : {"2G", "unified:2G"}) {
    CAPTURE(sim);
    // -ngl 0: nothing computes on the GPU, so --unified on has no effect, in plan and run alike.
    test::CommandResult plan = berth_with(sim, "plan -c 64 -ngl 0 --unified on -m " + model);
    test::CommandResult run = berth_with(sim, "run -ngl 0 --unified on" + gen);
    REQUIRE(plan.exit_code == 0);
    REQUIRE(run.exit_code == 0);
    const std::string ignored = "--unified on ignored: -ngl 0 puts nothing on the GPU";
    CHECK(has(plan.out, ignored));
    CHECK(has(run.err, ignored));
    CHECK_FALSE(has(plan.out, "unified memory ("));
    CHECK_FALSE(has(run.err, "unified memory ("));
    // --unified auto on a unified board with -ngl 0: no unified plan either.
    plan = berth_with(sim, "plan --json -c 64 -ngl 0 -m " + model);
    REQUIRE(plan.exit_code == 0);
    CHECK(nlohmann::json::parse(plan.out)["unified"].is_null());
  }
  // With the GPU computing, run prints the line plan shows.
  const test::CommandResult plan = berth_with("unified:2G", "plan -c 64 -m " + model);
  const test::CommandResult run = berth_with("unified:2G", "run" + gen);
  REQUIRE(plan.exit_code == 0);
  REQUIRE(run.exit_code == 0);
  const std::string line =
      "note: unified memory (detected): weights held once; SIM0 (unified) reads the weights it "
      "computes in host memory (pageableMemoryAccess 1: the file's pages in place)";
  CHECK(has(plan.out, line));
  CHECK(has(run.err, line));
}

TEST_CASE("unified: the tiers line counts the weights the GPU computes from host memory") {
  const std::string model = sparse_30b();
  const test::CommandResult r = berth_with("unified:16G", "plan -m " + test::shell_quote(model));
  REQUIRE(r.exit_code == 0);
  CHECK(has(r.out,
            "tiers: VRAM 0.000 MiB, host memory 13828.648 MiB (GPU-computed weights, held "
            "once), RAM 142.406 MiB"));
  int rc = 0;
  std::string err;
  const nlohmann::json j = plan_json("unified:16G", model, "", &rc, &err);
  REQUIRE(rc == 0);
  CHECK(j["tiers"]["gpu_computed_host_bytes"] == j["unified"]["gpu_computes_bytes"]);
  CHECK(j["tiers"]["gpu_computed_host_bytes"].get<size_t>() > 0);
  const nlohmann::json d = plan_json("1G", moe_file(), "", &rc, &err);
  REQUIRE(rc == 0);
  CHECK(d["tiers"]["gpu_computed_host_bytes"] == 0);
  std::filesystem::remove(model);
}

TEST_CASE(
    "unified: --unified off fits wherever a smaller board fits (the GPU keeps the CPU's least)") {
  // The automatic plan of copies filled the GPU by the device's report (the whole board) and
  // left the CPU's side of the pool too little: the 2-layer file ran (all on the CPU) at 1152M,
  // was refused from 1216M to 2496M, fitted again from 2560M; the 48-layer file fitted at
  // 1-1.75 GB, was refused from 1920M to 19840M. Now the GPU takes a unit only where the pool
  // keeps the CPU's least beside it, else everything runs on the CPU.
  const std::string mid = sparse_mid(), big = sparse_30b();
  std::vector<std::string> mid_boards, big_boards;
  for (int mb = 1152; mb <= 2624; mb += 64) mid_boards.push_back(fmt::format("{}M", mb));
  for (const char* b : {"1024M", "1536M", "1792M", "1920M", "2G", "2500M", "3G", "4G", "6G", "8G",
                        "12G", "16G", "19840M", "19968M", "24G"})
    big_boards.emplace_back(b);
  for (const auto& [file, boards] : {std::pair{mid, mid_boards}, std::pair{big, big_boards}}) {
    CAPTURE(file);
    bool fitted = false;
    for (const std::string& board : boards) {
      CAPTURE(board);
      int rc = 0;
      std::string err;
      const nlohmann::json j = plan_json("unified:" + board, file, " --unified off", &rc, &err);
      if (fitted) CHECK_MESSAGE(rc == 0, err);
      fitted = fitted || rc == 0;
      if (rc != 0) continue;
      // What the plan holds, both sides, is within the pool: the board's memory less 1 GiB.
      const size_t pool = placement::parse_size(board, "board") - (size_t{1} << 30);
      const size_t gpu = j["devices"]["GPU"]["total_bytes"].get<size_t>();
      const size_t cpu = j["tiers"]["ram_bytes"].get<size_t>();  // with the RAM slots
      CHECK(gpu + cpu <= pool);
    }
    CHECK(fitted);
  }
  // The 2-layer file fits from 1216M (all on the CPU, its disk tier); 1152M's pool of 128 MiB
  // holds what must stay in RAM but not one RAM slot per layer beside it: refused (it ran,
  // paging the file in and out of a pool that has no room for it).
  check_plans(mid,
              {
                  {"unified:1152M",
                   " --unified off",
                   1,
                   {"not enough for one RAM slot per MoE layer", "nothing computes on the GPU"},
                   {}},
                  {"unified:1216M", " --unified off", 0, {"all on the CPU"}, {}},
                  {"unified:2496M", " --unified off", 0, {}, {}},
              });
}

TEST_CASE("unified: -ngl 0 on a unified board is bounded by the pool, in plan and run") {
  const std::string tiny = moe_file(), big = sparse_big();
  // A 16384 MiB KV cache on a 2 GiB board planned with rc 0 (the file "pages in and out").
  check_plans(tiny, {{"unified:2G",
                      " -ngl 0 -c 16777216",
                      1,
                      {"what must stay in RAM does not fit", "KV cache 16384.0 MiB",
                       "nothing computes on the GPU", "a pool of 1024.0 MiB", "lower -c"},
                      {}},
                     {"unified:2G", " -ngl 0 -c 4096", 0, {}, {}}});
  // A pool of 0 B (1 GiB board, less the 1 GiB margin): refused (it planned with a RAM budget
  // of 0 B). -c 256: what must stay in RAM fits the 1 GiB pool, one RAM slot per layer beside it
  // does not: the refusal says so (the note said "the disk tier cannot make up the difference
  // (what must stay in RAM: 999.3 MiB)" under a budget of 1024 MiB), and not "lower -c", which
  // cannot help.
  check_plans(big, {{"unified:1G", " -ngl 0", 1, {"a pool of 0 B"}, {}},
                    {"unified:2G",
                     " -ngl 0 -c 256",
                     1,
                     {"not enough for one RAM slot per MoE layer", "a larger board"},
                     {"what must stay in RAM does not fit", "lower -c"}},
                    {"unified:8G", " -ngl 0", 0, {}, {}}});
  // run opens no device with -ngl 0: the simulated board still bounds it, before loading.
  const test::CommandResult r =
      berth_with("unified:2G", "run -ngl 0 -c 16777216 -p hi -n 1 -m " + test::shell_quote(tiny));
  CHECK(r.exit_code == 1);
  CHECK(has(r.err, "what must stay in RAM does not fit"));
  CHECK(has(r.err, "a pool of 1024.0 MiB"));
}

TEST_CASE("unified: -ngl 0 counts the CPU's activations in the pool; -ub lowers them") {
  // One wide llama layer with a 32000-token head, q4_0, 8192 tokens of context: at -ub 8192 the
  // CPU's activations were 2.08 GB of RSS on a board whose plan said 234 MiB of a 276 MiB pool.
  SynthSpec spec;
  spec.arch = "llama";
  spec.type = "q4_0";
  spec.n_layer = 1;
  spec.n_embd = 2048;
  spec.n_head = 16;
  spec.n_ff = 8192;
  spec.n_vocab = 32000;
  spec.n_ctx_train = 8192;
  const std::string wide = sparse_file(spec, "wide-llama-q4_0.gguf");
  check_plans(wide,
              {{"unified:1300M",
                " -ngl 0 -c 8192 -ub 8192",
                1,
                {"pool of 276.0 MiB", "the CPU's activations for a ubatch of 8192 tokens (-ub)",
                 "alone exceed it", "-ub 256 fits"},
                {}},
               {"unified:1300M",
                " -ngl 0 -c 8192 -ub 512",
                1,
                {"the plan holds 234.3 MiB (weights 106.3 MiB + KV cache 128.0 MiB)",
                 "a ubatch of 512 tokens (-ub), 60.0 MiB more", "-ub 256 fits"},
                {}},
               // The remedy works.
               {"unified:1300M",
                " -ngl 0 -c 8192 -ub 256",
                0,
                {"a ubatch of 256 tokens (-ub), 30.0 MiB, counted in the pool: 264.3 MiB "
                 "of 276.0 MiB"},
                {"lowered"}},
               // -ub not given: lowered to what fits, with a note.
               {"unified:1300M",
                " -ngl 0 -c 8192",
                0,
                {"-ub lowered from 2048 to 256", "ubatch 256",
                 "a ubatch of 256 tokens (the default -ub lowered from 2048), 30.0 MiB"},
                {}}});
  // run refuses before loading, as plan does.
  const test::CommandResult r = berth_with(
      "unified:1300M", "run -ngl 0 -c 8192 -ub 8192 -p hi -n 1 -m " + test::shell_quote(wide));
  CHECK(r.exit_code == 1);
  CHECK(has(r.err, "alone exceed it"));
  // A larger board holds them.
  check_plans(wide, {{"unified:4G", " -ngl 0 -c 8192 -ub 8192", 0, {"counted in the pool"}, {}}});
  // serve (-ub 512 by default) lowers -ub with the same note on stderr (it said nothing); the
  // server is stopped once it listens (or after 60 s).
  const std::string log = test::shell_quote(
      (std::filesystem::temp_directory_path() / ("berth-serve-ub-" + std::to_string(::getpid())))
          .string());
  const test::CommandResult sv = berth_with(
      "unified:1300M", "serve --port 0 -ngl 0 -c 8192 -m " + test::shell_quote(wide) + " 2>" + log +
                           " & p=$!; for i in $(seq 120); do grep -q listening " + log +
                           " && break; sleep 0.5; done; kill $p; wait $p; cat " + log +
                           " >&2; rm -f " + log);
  CHECK_MESSAGE(has(sv.err, "note: -ub lowered from 512 to 256"), sv.err);
  CHECK_MESSAGE(has(sv.err, "listening"), sv.err);
  // Where the disk tier can take more routed experts, the default -ub stays: it was halved to 512
  // on an 8 GB board (to 1024 on 4 and 12 GB boards) while -ub 2048 given was accepted.
  const std::string q30 = sparse_30b();
  for (const char* board : {"unified:4G", "unified:8G", "unified:12G"})
    check_plans(q30, {{board, " -ngl 0", 0, {"ubatch 2048", "counted in the pool"}, {"lowered"}},
                      {board, " -ngl 0 -ub 2048", 0, {"ubatch 2048"}, {}}});
  // The JSON names the whole pool, the pool the plan was made for and the activations (its
  // pool_bytes was the pool less the activations, with no field for them).
  {
    int rc = 0;
    std::string err;
    const nlohmann::json j = plan_json("unified:3G", q30, "", &rc, &err);
    REQUIRE_MESSAGE(rc == 0, err);
    const nlohmann::json& u = j["unified"];
    CHECK(u["pool_bytes"].get<size_t>() == size_t{2} << 30);
    CHECK(u["activation_bytes"].get<size_t>() > 0);
    CHECK(u["planned_pool_bytes"].get<size_t>() + u["activation_bytes"].get<size_t>() == size_t{2}
                                                                                             << 30);
    CHECK(u["total_bytes"].get<size_t>() <= size_t{2} << 30);
    CHECK(u["total_bytes"].get<size_t>() > u["activation_bytes"].get<size_t>());
  }
  // Monotonic in the board's size: a board that fits at the default -ub 2048 (3000M, everything on
  // the CPU) means every larger one does (3200M lowered -ub to 512, 3500M to 512 with a split,
  // 3800M and 4G to 1024: the fallback to the CPU was planned for the pool less the split's host
  // buffers instead of its own activations).
  for (const char* board : {"unified:3000M", "unified:3200M", "unified:3500M", "unified:3800M"})
    check_plans(q30, {{board, "", 0, {"ubatch 2048"}, {"lowered"}}});
  // One activation figure: a plan re-made for the pool less its activations reserves what its
  // own split holds (it was made for the pool less 726.0 MiB, a round's, while holding 774.2
  // MiB: the CPU's cap said 433.4 MiB and planned_pool_bytes + activation_bytes exceeded the
  // pool), and the budget column and a --ram-budget above it say what is left: 385.1 MiB.
  {
    const std::vector<nlohmann::json> j = check_plans(
        q30, {{"unified:4G",
               " --ram-budget 0 -ub 1024",
               0,
               {"the CPU's side is still capped at 385.1 MiB, what the GPU's side (1912.6 MiB) "
                "and the activations (774.2 MiB) leave of the pool of 3072.0 MiB",
                "a ubatch of 1024 tokens (-ub), 774.2 MiB, counted in the pool"},
               {"the activations (726.0 MiB)", "433.4 MiB"}},
              {"unified:4G",
               " --ram-budget 400M -ub 1024",
               0,
               {"--ram-budget 400.0 MiB is more than what the GPU's side (1912.6 MiB) and the "
                "activations (774.2 MiB) leave of the pool (385.1 MiB)"},
               {}}});
    for (const nlohmann::json& p : j) {
      REQUIRE(p["unified"].is_object());
      const nlohmann::json& u = p["unified"];
      CHECK(u["planned_pool_bytes"].get<size_t>() + u["activation_bytes"].get<size_t>() ==
            u["pool_bytes"].get<size_t>());
      CHECK(std::abs(p["tiers"]["ram_budget_bytes"].get<double>() / (1 << 20) - 385.107) < 0.001);
    }
  }
  // A split plan counts the scheduler's host buffers in the pool (they were left out: 1061.8 MiB
  // here, the plan filling the pool without them); a plan for the pool less them computes more
  // on the CPU, so its own are named; an all-GPU plan's (the logits) need no line.
  const std::vector<nlohmann::json> split = check_plans(
      q30, {{"unified:8G",
             "",
             0,
             {"the scheduler's host buffers for the decode steps and a ubatch of 2048 tokens (the "
              "default -ub), 1062.9 MiB, do not fit beside the plan in the pool of 7168.0 MiB: "
              "planned for the 6008.6 MiB left beside the plan's own, 1159.4 MiB",
              "1159.4 MiB, counted in the pool: 7135.6 MiB of 7168.0 MiB"},
             {"not counted"}},
            // -ub 2048 given on a 4 GB board: no split fits beside its host buffers, everything
            // on the CPU does (it was refused, naming "-ub 1024 fits", though -ngl 0 -ub 2048 fit).
            {"unified:4G",
             " -ub 2048",
             0,
             {"automatic (unified memory: everything on the CPU, where no split fits beside its "
              "activations)",
              "ubatch 2048"},
             {"lowered"}},
            {"unified:128G", "", 0, {}, {"host buffers"}}});
  CHECK(split[0]["unified"]["activations"] == "host_buffers");
  const double host_mib =
      static_cast<double>(split[0]["unified"]["activation_bytes"].get<size_t>()) / (1 << 20);
  CHECK(std::abs(host_mib - 1159.4) < 0.05);
  CHECK(split[0]["unified"]["total_bytes"].get<size_t>() <= size_t{7} << 30);
  // The -ub named as the remedy is the largest halved one that fits once a plan for the pool less
  // its activations is allowed (it said -ub 256 here; 2048 fits), and it does fit.
  check_plans(
      q30,
      {{"unified:3700M", " -ngl 0 -c 8192 -ub 4096", 1, {"lower -ub: -ub 2048 fits"}, {}},
       {"unified:3700M", " -ngl 0 -c 8192 -ub 2048", 0, {"ubatch 2048"}, {}},
       // -ub beyond -c: the plan line and the note say the ubatch the steps use.
       {"unified:3G",
        " -ngl 0 -ub 65536 -c 4096",
        0,
        {"ubatch 4096 (-ub 65536 capped by -c)", "a ubatch of 4096 tokens (-ub, capped by -c)"},
        {"ubatch 65536,"}}});
}

TEST_CASE("unified: refusal hints name only remedies that work") {
  const std::string big = sparse_big(), mid = sparse_mid();
  check_plans(big, {// -ngl 0, --cpu-moe and the automatic plan are all refused on this pool: only a
                    // larger board helps (it said "lower -ngl, or leave out -ngl").
                    {"unified:2G",
                     " --cpu-moe -ngl 99",
                     1,
                     {"use a smaller quantization or a larger board"},
                     {"lower -ngl", "leave out -ngl", "lower -c"}},
                    // The cause is the RAM slots, not the context (it said "lower -c" first).
                    {"unified:2G",
                     " -c 256",
                     1,
                     {"not enough for one RAM slot per MoE layer",
                      "use a smaller quantization or a larger board"},
                     {"lower -c", "does not hold what must stay in RAM"}},
                    // Where -ngl 0 fits, lowering -ngl is named.
                    {"unified:8G", " -ngl 99", 1, {"lower -ngl"}, {}}});
  // --unified on on a discrete device whose 512 MiB margin alone fills it: the automatic plan
  // runs on the CPU; -ngl 99's refusal does not say "lower -c or -ub", which cannot help.
  check_plans(mid, {{"512M", " --unified on", 0, {}, {}},
                    {"512M",
                     " --unified on -ngl 99",
                     1,
                     {"its margin and KV cache alone fill it", "lower -ngl"},
                     {"lower -c", "lower -ub"}}});
  // The OS reports much less available than the board: freeing memory is named where the whole
  // board would hold the plan (it said "a larger board" on a 128 GB board), not where it would not.
  const std::string q27 = sparse_27b();
  check_plans(q27, {{"unified:128G,available=40G",
                     "",
                     1,
                     {"free memory on the board (the OS reports 40960.0 MiB available of the "
                      "board's 131072.0 MiB; the plan fits the whole board)"},
                     {"larger board"}},
                    // The device's free report (a GB10's ~3 GiB: the page cache counted as used)
                    // decides nothing: the board's size does (it said "a larger board", and
                    // named the free figure as the board's size).
                    {"unified:128G,available=40G,free=3G",
                     "",
                     1,
                     {"free memory on the board (the OS reports 40960.0 MiB available of the "
                      "board's 131072.0 MiB; the plan fits the whole board)"},
                     {"larger board"}},
                    {"unified:128G,available=40G", " -ngl 0", 1, {"free memory on the board"}, {}},
                    {"unified:32G,available=20G", "", 1, {"a larger board"}, {"free memory"}}});
  // -ot rules that send everything to the GPU beside -ngl 0 (or -ngl 20): leaving them out (and
  // lowering -ngl) is named, and fits (it said only "a smaller quantization or a larger board").
  check_plans(sparse_30b(),
              {{"unified:8G",
                " -ngl 0 -ot .=GPU",
                1,
                {"; leave out the -ot rules that send tensors to the GPU"},
                {"larger board"}},
               {"unified:8G",
                " -ngl 20 -ot .=GPU",
                1,
                {"; lower -ngl and leave out the -ot rules that send tensors to the GPU"},
                {"larger board"}},
               {"unified:8G", " -ngl 0", 0, {}, {}}});
  // A pool below the GPU's scratch and margin: the fix named is one that runs (with -ngl 0
  // given, only leaving out the -ot rules that name the GPU), and the pool, not "the device's
  // free memory", is the limit (it said "run on the CPU with -ngl 0" to -ngl 0 -ot .=GPU).
  const std::string stories = test::stories260k().string();
  check_plans(stories,
              {{"unified:1300M",
                " -ngl 0 -ot .=GPU",
                1,
                {"the pool does not even hold the GPU's scratch and margin: leave out the "
                 "-ot rules that send tensors to the GPU"},
                {"device's free memory", "with -ngl 0"}},
               {"unified:1300M",
                " -ngl 99",
                1,
                {"the pool does not even hold the GPU's scratch and margin: run on the CPU "
                 "with -ngl 0"},
                {}},
               {"unified:1300M", " -ngl 0 -ot .=GPU,blk.0=CPU", 1, {"leave out"}, {}}});
}

TEST_CASE("unified: serve's default context does not shrink on a larger board") {
  // A 2-layer file trained on 262144 tokens: 1800M gave 43520 tokens (all on the CPU), 1900M
  // 20992 (the GPU's scratch and margin beside an f16 cache), 2G 39936.
  const std::string path = sparse_mid(262144);
  gguf::File file = gguf::File::open(path);
  auto model = load_model(file);
  int64_t last = 0;
  for (const char* board : {"1700M", "1800M", "1900M", "2G", "2200M", "2500M", "3G", "4G"}) {
    CAPTURE(board);
    ::setenv("BERTH_SIM_DEVICE", (std::string("unified:") + board).c_str(), 1);
    placement::Flags flags;
    std::unique_ptr<Device> dev = placement_device(flags);
    std::string note;
    int64_t ctx = 0;
    try {
      ctx = default_serve_context(*model, flags, serve_params(), dev, &note);
    } catch (const Error& e) {
      CHECK(e.category() == ErrorCategory::out_of_memory);
    }
    ::unsetenv("BERTH_SIM_DEVICE");
    INFO(note);
    CHECK(ctx >= last);
    last = std::max(last, ctx);
  }
  CHECK(last > 0);
}

TEST_CASE("unified: the default RAM budget's note says why the disk tier cannot help") {
  // One MoE layer: 100 MiB that must stay in RAM, 8 experts of 3 x 8 MiB each, under a default
  // (not given) budget of 101 MiB: what must stay fits, one RAM slot beside it does not.
  placement::Request r;
  r.n_layer = 1;
  r.kv_bytes = {0};
  const size_t MiB = size_t{1} << 20;
  r.tensors.push_back(
      {"blk.0.attn_q.weight", 100 * MiB, 0, graph::WeightRole::attention, "f32", 0});
  for (const char* n :
       {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight"})
    r.tensors.push_back({n, 64 * MiB, 0, graph::WeightRole::routed_expert, "f32", 8});
  r.ram_budget_bytes = 101 * MiB;
  const placement::Plan p = placement::make_plan(r);
  std::string notes;
  for (const std::string& n : p.notes) notes += n + "\n";
  INFO(notes);
  CHECK(has(notes, "holds not one RAM slot per MoE layer"));
  CHECK_FALSE(has(notes, "exceeds it"));
  r.ram_budget_bytes = 99 * MiB;
  notes.clear();
  for (const std::string& n : placement::make_plan(r).notes) notes += n + "\n";
  CHECK(has(notes, "what must stay in RAM (100.0 MiB) exceeds it"));
}

TEST_CASE("unified: BERTH_SIM_DEVICE's unified: prefix in any case") {
  const test::CommandResult r =
      berth_with("UNIFIED:8G", "plan -c 64 -m " + test::shell_quote(moe_file()));
  CHECK(r.exit_code == 0);
  CHECK(has(r.out, "unified memory (detected)"));
}
