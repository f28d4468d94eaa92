// Schedules as values: partition() on real placements, no device needed. Each case is checked
// against rules stated here (sides, causes, segments, crossing bytes) and against a golden text
// (tests/scheduler/golden/*.txt: every op's side and cause, the forks and joins with their
// bytes). After a deliberate change, BERTH_UPDATE_GOLDEN=1 rewrites the golden files; review
// the diff.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/placement/plan.h"
#include "berth/runtime/plan_request.h"
#include "berth/scheduler/memory.h"
#include "berth/scheduler/schedule.h"
#include "berth/tools/synth.h"
#include "test_util.h"

namespace berth {
namespace {

using graph::OpKind;
using placement::Home;

std::string tiny_moe_path() {
  const auto path = test::temp_dir("schedule") / "tiny-qwen3moe-q8_0.gguf";
  if (!std::filesystem::exists(path)) {
    SynthSpec spec = synth_preset("tiny-qwen3moe");
    spec.type = "q8_0";
    spec.seed = 1;
    write_synth_model(spec, path.string(), 1);
  }
  return path.string();
}

struct Case {
  std::string name;                // golden file stem
  std::vector<std::string> flags;  // as on the command line
  placement::Flags f;
  double share = 0;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  const auto add = [&](std::string name, std::vector<std::string> flags, auto set) {
    Case c{std::move(name), std::move(flags), {}, 0};
    set(c);
    out.push_back(std::move(c));
  };
  add("ngl0", {"-ngl", "0"}, [](Case& c) { c.f.n_gpu_layers = 0; });
  add("ngl3", {"-ngl", "3"}, [](Case& c) { c.f.n_gpu_layers = 3; });
  add("ngl99", {"-ngl", "99"}, [](Case& c) { c.f.n_gpu_layers = 99; });
  add("cpu-moe", {"-ngl", "99", "--cpu-moe"}, [](Case& c) {
    c.f.n_gpu_layers = 99;
    c.f.cpu_moe = true;
  });
  add("n-cpu-moe-1", {"-ngl", "99", "--n-cpu-moe", "1"}, [](Case& c) {
    c.f.n_gpu_layers = 99;
    c.f.n_cpu_moe = 1;
  });
  add("share-0.375", {"-ngl", "99", "--cpu-moe", "--host-expert-share", "0.375"}, [](Case& c) {
    c.f.n_gpu_layers = 99;
    c.f.cpu_moe = true;
    c.share = 0.375;
  });
  // Expert slots: a budget with room for every weight, so adaptive is asked for (auto would
  // stay static); the room left gives the CPU-held layers n_expert - 1 slots.
  add("cpu-moe-adaptive", {"-ngl", "99", "--cpu-moe", "--residency", "adaptive"}, [](Case& c) {
    c.f.n_gpu_layers = 99;
    c.f.cpu_moe = true;
    c.f.residency = placement::ResidencyMode::adaptive;
  });
  return out;
}

// The schedule `berth run` would follow for `c` on a GPU with 4 GiB free, hand-off by flags,
// streaming at its default (from 64 tokens), at ubatch n_tokens; no fusions (no device).
Schedule schedule_for(const Model& m, const Case& c, int32_t n_tokens, bool stream_split = false,
                      bool batch_invariant = false) {
  const int32_t stream = 64;  // --stream-experts auto on a host with memory to spare
  placement::Request req =
      plan_request(m, 1024, 512, c.f, "GPU", size_t{4} << 30, true, stream, c.share);
  const placement::Plan plan = placement::make_plan(req);
  Capabilities caps{.has_device = true, .device_name = "GPU", .flags = true};
  const graph::WeightTable& w = m.weights();
  caps.pinned.assign(w.size(), false);
  for (size_t i = 0; i < w.size(); ++i)
    caps.pinned[i] = plan.home[i] == Home::cpu && w.tensors[i].ne[2] > 1;
  if (plan.expert_slots > 0) {  // as Residency gives them: the plan's layers, pinned
    caps.slotted.assign(w.size(), 0);
    for (size_t i = 0; i < w.size(); ++i)
      if (caps.pinned[i] && w.layers[i] >= 0)
        caps.slotted[i] = plan.layer_slots.at(static_cast<size_t>(w.layers[i]));
  }
  const ScheduleOptions opt{.stream_experts_min_tokens = stream,
                            .host_expert_share = c.share,
                            .stream_split = stream_split};
  graph::Graph g = m.build_step(n_tokens, 1);
  g.batch_invariant = batch_invariant;
  return partition(g, w, plan.home, plan.kv_home, caps, opt);
}

void check_golden(const std::string& stem, const std::string& text) {
  const std::filesystem::path p =
      std::filesystem::path(BERTH_TESTS_DIR) / "scheduler" / "golden" / (stem + ".txt");
  if (const char* u = std::getenv("BERTH_UPDATE_GOLDEN"); u && std::string(u) == "1") {
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
    MESSAGE("rewrote " << p.string());
    return;
  }
  REQUIRE_MESSAGE(std::filesystem::exists(p), "missing golden " << p.string());
  const std::string want = test::read_file(p);
  if (want != text) {
    // Show the first line that differs.
    std::istringstream a(want), b(text);
    std::string la, lb;
    int line = 1;
    while (std::getline(a, la) && std::getline(b, lb) && la == lb) ++line;
    FAIL_CHECK("schedule differs from " << p.string() << " at line " << line
                                        << ":\n  golden: " << la << "\n  now:    " << lb);
  }
}

size_t value_bytes(const graph::Graph& g, graph::ValueId v) {
  const auto& vi = g.values[static_cast<size_t>(v)];
  return static_cast<size_t>(vi.rows * vi.cols) * 4;
}

// Rules every schedule keeps, whatever the placement.
void check_invariants(const Schedule& s, const graph::WeightTable& w,
                      const std::vector<Home>& homes) {
  const graph::Graph& g = s.g;
  // Every op with a weight runs where the weight lives, unless streamed or shared.
  for (size_t i = 0; i < g.ops.size(); ++i) {
    const auto& op = g.ops[i];
    const graph::WeightId id = op.kind == OpKind::moe_experts ? op.moe.gate : op.weight;
    if (id == graph::kNoWeight || s.streamed[i] || s.host_w[i]) continue;
    if (op.kind == OpKind::moe_experts && op.moe.set == graph::ExpertSet::resident) {
      // The slot-resident experts of a CPU-held layer: on the device, from its slots.
      CHECK(s.op_side[i] == Side::device);
      CHECK(homes[static_cast<size_t>(id)] == Home::cpu);
      continue;
    }
    CAPTURE(op.name);
    CHECK((s.op_side[i] == Side::device) == (homes[static_cast<size_t>(id)] == Home::gpu));
  }
  // Segments are the CPU ops, in order, and fork after the device op producing their input.
  std::vector<int> seen(g.ops.size(), 0);
  int32_t prev_fork = -1;
  for (const CpuSegment& seg : s.segments) {
    CHECK(seg.fork_after >= prev_fork);
    prev_fork = seg.fork_after;
    for (int32_t i : seg.ops) {
      CHECK(s.op_side[static_cast<size_t>(i)] == Side::cpu);
      ++seen[static_cast<size_t>(i)];
      CHECK(i > seg.fork_after);
    }
    for (graph::ValueId v : seg.inputs) CHECK(s.value_side[static_cast<size_t>(v)] == Side::device);
    for (graph::ValueId v : seg.outputs) CHECK(s.value_side[static_cast<size_t>(v)] == Side::cpu);
  }
  for (size_t i = 0; i < g.ops.size(); ++i) CHECK(seen[i] == (s.op_side[i] == Side::cpu ? 1 : 0));
  // Every device op in exactly one call; a fork for each segment that waits for the device,
  // in order.
  std::vector<int> in_call(g.ops.size(), 0);
  std::vector<int32_t> forks, forked;
  for (const Call& c : s.calls) {
    for (int32_t i : c.ops) ++in_call[static_cast<size_t>(i)];
    if (c.kind == CallKind::fork) forks.push_back(c.seg);
  }
  for (size_t k = 0; k < s.segments.size(); ++k)
    if (s.segments[k].fork_after >= 0) forked.push_back(static_cast<int32_t>(k));
  CHECK(forks == forked);
  for (size_t i = 0; i < g.ops.size(); ++i)
    CHECK(in_call[i] == (s.op_side[i] == Side::device ? 1 : 0));
  (void)w;
}

TEST_CASE("schedules of stories260K and tiny qwen3moe under the placement flags (golden)") {
  gguf::File stories = gguf::File::open(test::stories260k().string());
  std::unique_ptr<Model> st = load_model(stories);
  gguf::File moe_file = gguf::File::open(tiny_moe_path());
  std::unique_ptr<Model> moe = load_model(moe_file);
  for (const auto& [label, model] : {std::pair<std::string, const Model*>{"stories260K", st.get()},
                                     {"tiny-qwen3moe", moe.get()}})
    for (const Case& c : cases())
      for (int32_t ub : {1, 512}) {
        const std::string stem = fmt::format("{}-{}-ub{}", label, c.name, ub);
        CAPTURE(stem);
        const Schedule s = schedule_for(*model, c, ub);
        placement::Request req =
            plan_request(*model, 1024, 512, c.f, "GPU", size_t{4} << 30, true, 64, c.share);
        check_invariants(s, model->weights(), placement::make_plan(req).home);
        std::string text =
            fmt::format("berth plan {} --ops, ubatch {}\n", fmt::join(c.flags, " "), ub);
        text += schedule_text(s, model->weights(), ub == 1 ? "decode step" : "prefill ubatch");
        check_golden(stem, text);
      }
}

TEST_CASE(
    "schedule rules: -ngl 0 keeps the device out, -ngl 99 leaves token_embd before the step") {
  gguf::File file = gguf::File::open(test::stories260k().string());
  std::unique_ptr<Model> m = load_model(file);
  const Schedule cpu = schedule_for(*m, cases()[0], 1);
  for (size_t i = 0; i < cpu.g.ops.size(); ++i) CHECK(cpu.op_side[i] == Side::cpu);
  REQUIRE(cpu.segments.size() == 1);
  CHECK(cpu.segments[0].fork_after == -1);  // the whole step on the calling thread
  CHECK(cpu.calls.empty());
  CHECK(cpu.bytes_to_host() == 0);
  CHECK(cpu.bytes_to_device() == 0);

  const Schedule all = schedule_for(*m, cases()[2], 512);
  // token_embd stays on the CPU (llama.cpp's -ngl): one segment before the step, its output
  // (the embeddings of 512 tokens) uploaded, nothing else crosses.
  REQUIRE(all.segments.size() == 1);
  CHECK(all.op_cause[0] == Cause::weight);
  CHECK(all.segments[0].fork_after == -1);
  CHECK(all.bytes_to_device() == size_t{512} * m->hparams().n_embd * 4);
  CHECK(all.bytes_to_host() == 0);
  CHECK(all.calls.front().kind == CallKind::upload);
  CHECK(all.calls.back().kind == CallKind::output);
}

TEST_CASE("schedule rules: --cpu-moe forks each layer's experts and joins them in place") {
  gguf::File file = gguf::File::open(tiny_moe_path());
  std::unique_ptr<Model> m = load_model(file);
  const int64_t n_embd = m->hparams().n_embd, k = m->hparams().n_expert_used;
  const Schedule s = schedule_for(*m, cases()[3], 1);
  int n_experts = 0;
  for (size_t i = 0; i < s.g.ops.size(); ++i)
    if (s.g.ops[i].kind == OpKind::moe_experts) {
      ++n_experts;
      CHECK(s.op_side[i] == Side::cpu);
      CHECK(s.op_cause[i] == Cause::expert_weights);
    }
  CHECK(n_experts == m->hparams().n_layer);
  // token_embd's segment, then one per layer: its inputs (the normed hidden state and the
  // route) go down, its output comes back read in place by the residual add.
  REQUIRE(s.segments.size() == static_cast<size_t>(1 + m->hparams().n_layer));
  for (size_t j = 1; j < s.segments.size(); ++j) {
    const CpuSegment& seg = s.segments[j];
    CHECK(seg.in_place);
    REQUIRE(seg.inputs.size() == 2);
    CHECK(value_bytes(s.g, seg.inputs[0]) == static_cast<size_t>(n_embd) * 4);
    CHECK(value_bytes(s.g, seg.inputs[1]) == static_cast<size_t>(2 * k) * 4);
  }
  CHECK(s.bytes_to_host() == static_cast<size_t>(m->hparams().n_layer * (n_embd + 2 * k) * 4));

  // At 512 tokens the experts are streamed to the device instead: no CPU segment but token_embd.
  const Schedule p = schedule_for(*m, cases()[3], 512);
  int n_streamed = 0;
  for (size_t i = 0; i < p.g.ops.size(); ++i)
    if (p.g.ops[i].kind == OpKind::moe_experts) {
      CHECK(p.op_cause[i] == Cause::streamed);
      n_streamed += p.streamed[i];
    }
  CHECK(n_streamed == m->hparams().n_layer);
  CHECK(p.segments.size() == 1);
}

TEST_CASE(
    "schedule rules: --stream-split splits each streamed layer; never below the threshold "
    "or in batch-invariant steps") {
  gguf::File file = gguf::File::open(tiny_moe_path());
  std::unique_ptr<Model> m = load_model(file);
  const Case c = cases()[3];
  REQUIRE(c.name == "cpu-moe");
  const int32_t n_expert = static_cast<int32_t>(m->hparams().n_expert);
  const Schedule p = schedule_for(*m, c, 512, true);
  placement::Request req = plan_request(*m, 1024, 512, c.f, "GPU", size_t{4} << 30, true, 64, 0);
  check_invariants(p, m->weights(), placement::make_plan(req).home);
  int n_dev = 0, n_cpu = 0;
  for (size_t i = 0; i < p.g.ops.size(); ++i) {
    const auto& op = p.g.ops[i];
    if (op.kind != OpKind::moe_experts) continue;
    CHECK(p.stream_split[i] == 1);
    if (op.moe.set == graph::ExpertSet::not_resident) {
      ++n_cpu;
      CHECK(p.op_side[i] == Side::cpu);
      CHECK(p.op_cause[i] == Cause::stream_cpu);
      REQUIRE(p.g.ops[i + 1].moe.set == graph::ExpertSet::resident);  // the CPU's part first
      continue;
    }
    ++n_dev;
    CHECK(op.moe.set == graph::ExpertSet::resident);
    CHECK(op.moe.n_slots == n_expert);  // the stage buffer holds the whole layer
    CHECK(p.op_side[i] == Side::device);
    CHECK(p.op_cause[i] == Cause::streamed);
    CHECK(p.streamed[i] == 1);
    REQUIRE(p.g.ops[i + 1].kind == OpKind::add);
    CHECK(p.g.ops[i + 1].inputs[0] == op.output);  // device part + CPU part, in that order
    CHECK(p.stream_split[i + 1] == 0);
  }
  CHECK(n_dev == m->hparams().n_layer);
  CHECK(n_cpu == m->hparams().n_layer);
  // token_embd's segment, then one per layer (the CPU's part, forked after the route).
  CHECK(p.segments.size() == static_cast<size_t>(1 + m->hparams().n_layer));
  CHECK(p.model_op_side(static_cast<size_t>(p.n_model_ops - 1)) == Side::device);
  // Below the streaming threshold, in decode and in batch-invariant steps: no split.
  for (const Schedule& s : {schedule_for(*m, c, 32, true), schedule_for(*m, c, 1, true),
                            schedule_for(*m, c, 512, true, true)})
    for (size_t i = 0; i < s.g.ops.size(); ++i) {
      CHECK(s.stream_split[i] == 0);
      if (s.g.ops[i].kind == OpKind::moe_experts)
        CHECK(s.g.ops[i].moe.set == graph::ExpertSet::all);
    }
  // Layers with expert slots stream whole, as without the split.
  const Schedule a = schedule_for(*m, cases()[6], 512, true);
  for (size_t i = 0; i < a.g.ops.size(); ++i) CHECK(a.stream_split[i] == 0);
}

TEST_CASE("schedule rules: the decode share splits each CPU-held layer by route slot") {
  gguf::File file = gguf::File::open(tiny_moe_path());
  std::unique_ptr<Model> m = load_model(file);
  const Case c = cases()[5];
  const Schedule s = schedule_for(*m, c, 1);
  const int32_t k = static_cast<int32_t>(m->hparams().n_expert_used);
  // Each layer's experts became a CPU op, a device op reading host memory, and their sum.
  int32_t dev_slots = 0;
  int n_split = 0;
  for (size_t i = 0; i < s.g.ops.size(); ++i) {
    if (!s.host_w[i]) continue;
    ++n_split;
    const auto& op = s.g.ops[i];
    CHECK(s.op_cause[i] == Cause::host_share);
    CHECK(op.moe.slot_end == k);
    dev_slots += op.moe.slot_end - op.moe.slot_begin;
    CHECK(s.g.ops[i - 1].moe.slot_end == op.moe.slot_begin);  // the CPU's part before it
    CHECK(s.g.ops[i + 1].kind == OpKind::add);
  }
  CHECK(n_split == m->hparams().n_layer);
  // round(n f k) over the layers.
  CHECK(dev_slots == static_cast<int32_t>(std::floor(m->hparams().n_layer * c.share * k + 0.5)));
  CHECK(s.model_op_side(static_cast<size_t>(s.n_model_ops - 1)) == Side::device);
  // Prefill is not split.
  const Schedule p = schedule_for(*m, c, 512);
  for (uint8_t h : p.host_w) CHECK(h == 0);
  // Nor is a one-token step of several sequences (batch-invariant): the share follows the
  // step's size, so a sequence's decode row would change sides with its neighbours.
  const Schedule inv = schedule_for(*m, c, 1, false, true);
  for (uint8_t h : inv.host_w) CHECK(h == 0);
}

TEST_CASE("schedule rules: expert slots split each CPU-held layer by residency") {
  gguf::File file = gguf::File::open(tiny_moe_path());
  std::unique_ptr<Model> m = load_model(file);
  const Case c = cases()[6];
  REQUIRE(c.name == "cpu-moe-adaptive");
  const int32_t n_expert = static_cast<int32_t>(m->hparams().n_expert);
  // Decode and a prefill below the streaming threshold (64): per layer the CPU's op over the
  // experts not in the slots, the device's over those in them, and their sum on the device.
  for (int32_t ub : {1, 32}) {
    CAPTURE(ub);
    const Schedule s = schedule_for(*m, c, ub);
    int n_split = 0;
    for (size_t i = 0; i < s.g.ops.size(); ++i) {
      const auto& op = s.g.ops[i];
      if (op.kind != OpKind::moe_experts) continue;
      CHECK(!op.moe.static_experts());
      if (op.moe.set == graph::ExpertSet::not_resident) {
        CHECK(s.op_side[i] == Side::cpu);
        CHECK(s.op_cause[i] == Cause::not_resident);
        continue;
      }
      ++n_split;
      CHECK(op.moe.set == graph::ExpertSet::resident);
      CHECK(op.moe.n_slots == n_expert - 1);
      CHECK(s.op_side[i] == Side::device);
      CHECK(s.op_cause[i] == Cause::expert_slots);
      CHECK(s.g.ops[i - 1].moe.set == graph::ExpertSet::not_resident);  // the CPU's part first
      REQUIRE(s.g.ops[i + 1].kind == OpKind::add);
      CHECK(s.g.ops[i + 1].inputs[0] == op.output);  // device part + CPU part, in that order
      CHECK(s.slotted[i] == 1);
      CHECK(s.host_w[i] == 0);
    }
    CHECK(n_split == m->hparams().n_layer);
    CHECK(s.model_op_side(static_cast<size_t>(s.n_model_ops - 1)) == Side::device);
  }
  // A prefill that streams keeps each layer whole, streamed (as without slots).
  const Schedule p = schedule_for(*m, c, 512);
  int n_streamed = 0;
  for (size_t i = 0; i < p.g.ops.size(); ++i)
    if (p.g.ops[i].kind == OpKind::moe_experts) {
      CHECK(p.g.ops[i].moe.set == graph::ExpertSet::all);
      n_streamed += p.streamed[i];
    }
  CHECK(n_streamed == m->hparams().n_layer);
  // The decode share leaves layers with slots alone.
  Case shared = c;
  shared.share = 0.5;
  const Schedule d = schedule_for(*m, shared, 1);
  for (uint8_t h : d.host_w) CHECK(h == 0);
}

TEST_CASE("the memory plan gives overlapping device values disjoint arena ranges") {
  gguf::File file = gguf::File::open(tiny_moe_path());
  std::unique_ptr<Model> m = load_model(file);
  for (const Case& c : cases())
    for (int32_t ub : {1, 7}) {
      CAPTURE(c.name);
      const Schedule s = schedule_for(*m, c, ub);
      const MemoryPlan mp = plan_memory(s, m->weights());
      // Lifetimes in call order, recomputed here the simple way: a value is live from the first
      // call touching it to the last.
      const size_t nv = s.g.values.size();
      std::vector<int64_t> first(nv, -1), last(nv, -1);
      for (size_t t = 0; t < s.calls.size(); ++t) {
        const Call& call = s.calls[t];
        std::vector<graph::ValueId> touched(call.send.begin(), call.send.end());
        touched.insert(touched.end(), call.recv.begin(), call.recv.end());
        for (int32_t i : call.ops) {
          touched.push_back(s.g.ops[static_cast<size_t>(i)].output);
          for (graph::ValueId v : s.g.ops[static_cast<size_t>(i)].inputs) touched.push_back(v);
        }
        for (graph::ValueId v : touched) {
          const auto u = static_cast<size_t>(v);
          if (!mp.on_device[u]) continue;
          if (first[u] < 0) first[u] = static_cast<int64_t>(t);
          last[u] = static_cast<int64_t>(t);
        }
      }
      for (size_t a = 0; a < nv; ++a)
        for (size_t b = a + 1; b < nv; ++b) {
          if (!mp.on_device[a] || !mp.on_device[b] || first[a] < 0 || first[b] < 0) continue;
          const bool overlap_t = first[a] <= last[b] && first[b] <= last[a];
          const size_t ea = mp.offset[a] + value_bytes(s.g, static_cast<graph::ValueId>(a));
          const size_t eb = mp.offset[b] + value_bytes(s.g, static_cast<graph::ValueId>(b));
          const bool overlap_m = mp.offset[a] < eb && mp.offset[b] < ea;
          if (overlap_t) CHECK_FALSE(overlap_m);
          CHECK(ea <= mp.arena_bytes);
        }
    }
}

}  // namespace
}  // namespace berth

namespace berth {
namespace {

TEST_CASE("models declare each weight's role and layer (placement reads them, not names)") {
  using graph::WeightRole;
  // The role each tensor name of these files is read for, written out by hand.
  const auto expected = [](const std::string& n) {
    if (n == "token_embd.weight") return WeightRole::embedding;
    if (n == "output.weight") return WeightRole::head;
    if (n.find("_norm.") != std::string::npos && n.find("attn_q_norm") == std::string::npos &&
        n.find("attn_k_norm") == std::string::npos)
      return WeightRole::norm;
    if (n.find(".attn_") != std::string::npos) return WeightRole::attention;
    if (n.find("_exps.") != std::string::npos) return WeightRole::routed_expert;
    if (n.find("ffn_gate_inp") != std::string::npos) return WeightRole::router;
    return WeightRole::dense_ffn;
  };
  gguf::File stories = gguf::File::open(test::stories260k().string());
  gguf::File moe = gguf::File::open(tiny_moe_path());
  for (const gguf::File* f : {&stories, &moe}) {
    std::unique_ptr<Model> m = load_model(*f);
    const graph::WeightTable& w = m->weights();
    REQUIRE(w.roles.size() == w.size());
    REQUIRE(w.layers.size() == w.size());
    int n_experts = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      const std::string& n = w.tensors[i].name;
      CAPTURE(n);
      CHECK(w.roles[i] == expected(n));
      const int32_t layer = n.rfind("blk.", 0) == 0 ? std::stoi(n.substr(4)) : -1;
      CHECK(w.layers[i] == layer);
      n_experts += w.roles[i] == WeightRole::routed_expert;
    }
    CHECK(n_experts == (m->hparams().n_expert > 0 ? 3 * m->hparams().n_layer : 0));
  }
}

}  // namespace
}  // namespace berth
