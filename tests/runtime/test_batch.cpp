// Several sequences in one step: the KV cache's pool of sequences, the batching loop, per-
// sequence results that never depend on the batch (bit for bit: tokens and logits), and MoE
// steps that read each distinct routed expert once.
//
// The device cases use the simulated device (CI) unless BERTH_TEST_DEVICE=cuda.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <string>

#include "berth/backends/device.h"
#include "berth/core/error.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/placement/plan.h"
#include "berth/residency/disk_tier.h"
#include "berth/residency/expert_slots.h"
#include "berth/residency/routing_trace.h"
#include "berth/runtime/batch.h"
#include "berth/runtime/kv_cache.h"
#include "berth/runtime/placed.h"
#include "berth/runtime/session.h"
#include "berth/tools/synth.h"
#include "greedy_run.h"
#include "test_util.h"

using namespace berth;
using placement::Home;

namespace {

using test::same_bits;
using test::test_device;
using test::use_cuda;

std::string tiny_moe_file(const std::string& type) {
  SynthSpec spec = synth_preset("tiny-qwen3moe");
  spec.type = type;
  spec.seed = 5;
  spec.router_skew = 1.0;
  const auto path = test::temp_dir("batch") / fmt::format("tiny-qwen3moe-{}.gguf", type);
  if (!std::filesystem::exists(path)) write_synth_model(spec, path.string(), 2);
  return path.string();
}

/// Where the weights and KV caches go: nowhere (CPU only), or on `dev` for the layers `gpu_layer`
/// says (and the non-layer weights when `gpu_rest`).
struct Placement {
  Device* dev = nullptr;
  std::function<bool(int)> gpu_layer;
  bool gpu_rest = false;
  bool cpu_experts = false;  ///< routed experts on the CPU whatever gpu_layer says (--cpu-moe)
  /// Further settings over the homes (unified memory, streaming, expert slots, the disk tier).
  std::function<void(SessionParams&)> more;
  /// Called with each session once its sequences have run (checks that a setting took effect).
  std::function<void(Session&)> after;
};

SessionParams params(const Model& m, const Placement& p, int32_t n_seq, int64_t n_ctx,
                     int32_t n_ubatch) {
  SessionParams sp;
  sp.n_threads = 2;
  sp.n_ctx = n_ctx;
  sp.n_seq = n_seq;
  sp.n_ubatch = n_ubatch;
  if (p.dev) {
    sp.device = p.dev;
    const graph::WeightTable& w = m.weights();
    for (size_t i = 0; i < w.size(); ++i) {
      const auto id = static_cast<graph::WeightId>(i);
      const int32_t l = w.layer(id);
      const bool gpu = (l >= 0 ? p.gpu_layer(l) : p.gpu_rest) &&
                       !(p.cpu_experts && w.role(id) == graph::WeightRole::routed_expert);
      sp.weight_home.push_back(gpu ? Home::gpu : Home::cpu);
    }
    for (int32_t l = 0; l < m.hparams().n_layer; ++l)
      sp.kv_home.push_back(p.gpu_layer(l) ? Home::gpu : Home::cpu);
  }
  if (p.more) p.more(sp);
  return sp;
}

std::vector<int32_t> prompt_of(int n, int salt, int32_t n_vocab) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((i * 37 + salt * 101 + 11) % (n_vocab - 3) + 3);
  return p;
}

/// What one sequence of a loop produced: its tokens, and the logits of each sampled step.
struct Trace {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;
  StopReason stop = StopReason::n_predict;
};

struct Others {
  int n = 0;             ///< other sequences
  int delay_steps = 0;   ///< they join after this many steps of the first
  int prompt_len = 24;   ///< their prompts' length
  bool sampled = false;  ///< they sample at temperature 0.9 (else greedy)
};

/// Runs sequence A (`prompt`, greedy, `n_gen` tokens) in a BatchLoop beside `o`; returns A's
/// trace. Checks every sequence ends.
Trace run_beside(const Model& m, const Placement& pl, const std::vector<int32_t>& prompt, int n_gen,
                 const Others& o, int32_t n_ubatch, int64_t n_ctx = 128) {
  Session s(m, params(m, pl, 8, n_ctx, n_ubatch));
  BatchLoop loop(s);
  const auto n_vocab = static_cast<int32_t>(m.hparams().n_vocab);
  std::map<int64_t, Trace> traces;
  loop.on_logits = [&](int64_t id, std::span<const float> l) {
    traces[id].logits.emplace_back(l.begin(), l.end());
  };
  BatchRequest a;
  a.prompt = prompt;
  a.sampling.temp = 0;
  a.n_predict = n_gen;
  const int64_t a_id = loop.submit(a);
  auto submit_others = [&] {
    for (int i = 0; i < o.n; ++i) {
      BatchRequest r;
      r.prompt = prompt_of(o.prompt_len + 5 * i, i + 1, n_vocab);
      r.sampling.temp = o.sampled ? 0.9f : 0.0f;
      r.sampling.seed = 1000 + static_cast<uint64_t>(i);
      r.n_predict = n_gen + 7 * i;
      loop.submit(r);
    }
  };
  if (o.delay_steps == 0) submit_others();
  std::set<int64_t> done;
  for (int step = 0; !loop.idle(); ++step) {
    if (step == o.delay_steps && o.delay_steps > 0) submit_others();
    for (const BatchEvent& e : loop.step()) {
      REQUIRE(done.count(e.id) == 0);
      if (e.token >= 0) traces[e.id].tokens.push_back(e.token);
      if (e.done) {
        traces[e.id].stop = e.stop;
        done.insert(e.id);
      }
    }
    REQUIRE(step < 10000);
  }
  CHECK(done.size() == static_cast<size_t>(1 + o.n));
  if (pl.after) pl.after(s);
  return traces[a_id];
}

/// The same sequence through Session::eval (sequence 0), no loop. On the CPU and the simulated
/// device a session of one sequence; with CUDA a session of two, because a one-sequence session
/// (Graph::batch_invariant false) deliberately multiplies prompt rows by shape-dependent means
/// (cuBLAS, the MoE path by token count) that a session of several sequences must not use.
Trace run_alone_session(const Model& m, const Placement& pl, const std::vector<int32_t>& prompt,
                        int n_gen) {
  Session s(m, params(m, pl, use_cuda() && pl.dev ? 2 : 1, 128, 512));
  Trace t;
  std::span<const float> l = s.eval(prompt);
  for (int i = 0; i < n_gen; ++i) {
    t.logits.emplace_back(l.begin(), l.end());
    const auto id = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
    t.tokens.push_back(id);
    if (i + 1 < n_gen) l = s.eval(std::span<const int32_t>(&id, 1));
  }
  if (pl.after) pl.after(s);
  return t;
}

/// The sequence of the invariance cases: its prompt, and the tokens it generates.
std::vector<int32_t> seq_prompt(const Model& m) {
  return prompt_of(37, 0, static_cast<int32_t>(m.hparams().n_vocab));
}
constexpr int kSeqGen = 24;

/// The sequence alone in the loop.
Trace run_alone(const Model& m, const Placement& pl) {
  return run_beside(m, pl, seq_prompt(m), kSeqGen, {}, 512);
}

/// The invariance cases of one model and placement. Returns the sequence's trace alone.
Trace check_invariance(const Model& m, const Placement& pl) {
  const std::vector<int32_t> prompt = seq_prompt(m);
  const int n_gen = kSeqGen;
  const Trace alone = run_alone(m, pl);
  REQUIRE(alone.tokens.size() == static_cast<size_t>(n_gen));
  CHECK(alone.stop == StopReason::n_predict);
  // The loop alone is the one-sequence Session, bit for bit.
  CHECK(same_bits(alone, run_alone_session(m, pl, prompt, n_gen)));
  struct Case {
    const char* name;
    Others o;
    int32_t n_ubatch;
  };
  const Case cases[] = {
      {"beside 1 other", {1}, 512},
      {"beside 3 others", {3}, 512},
      {"beside 7 others (sampled)", {7, 0, 24, true}, 512},
      {"others' prompt chunks in its decode steps (-ub 16)", {3, 4, 40, false}, 16},
      {"its prompt in chunks beside others' decode tokens (-ub 8)", {2, 0, 5, true}, 8},
      {"7 others joining late, -ub 5", {7, 9, 13, true}, 5},
  };
  for (const Case& c : cases) {
    const std::string name = c.name;
    CAPTURE(name);
    const Trace got = run_beside(m, pl, prompt, n_gen, c.o, c.n_ubatch);
    CHECK(got.tokens == alone.tokens);
    CHECK(same_bits(got, alone));
  }
  return alone;
}

}  // namespace

TEST_CASE("batch: the KV cache's pool of sequences") {
  KvCache kv({KvLayer{4, 4}, KvLayer{2, 2}}, 8, 3);
  CHECK(kv.n_seq() == 3);
  CHECK(kv.view().n_rows() == 24);
  CHECK(kv.bytes() == 24 * (8 + 4) * 4);
  CHECK(kv.acquire() == 0);
  CHECK(kv.acquire() == 1);
  CHECK(kv.acquire() == 2);
  CHECK(kv.n_free() == 0);
  try {
    kv.acquire();
    FAIL("a full pool must refuse");
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::out_of_memory);
    CHECK(std::string(e.what()).find("3 sequences") != std::string::npos);
  }
  kv.release(1);
  CHECK(kv.n_free() == 1);
  CHECK(kv.acquire() == 1);
  kv.release(2);
  CHECK_THROWS_AS(kv.release(2), Error);
  CHECK_THROWS_AS(kv.release(3), Error);
  // copy: positions [0, n) of one sequence to another, every layer.
  for (int64_t p = 0; p < 8; ++p)
    for (int i = 0; i < 4; ++i) {
      kv.k(0)[kv.view().row(1, p) * 4 + i] = static_cast<float>(100 * p + i);
      kv.v(0)[kv.view().row(1, p) * 4 + i] = static_cast<float>(-100 * p - i);
    }
  for (int64_t r = 0; r < 24; ++r)
    for (int i = 0; i < 2; ++i) kv.k(1)[r * 2 + i] = static_cast<float>(r);
  kv.copy(1, 2, 5);
  for (int64_t p = 0; p < 5; ++p) {
    CHECK(kv.k(0)[kv.view().row(2, p) * 4 + 3] == static_cast<float>(100 * p + 3));
    CHECK(kv.v(0)[kv.view().row(2, p) * 4 + 1] == static_cast<float>(-100 * p - 1));
    CHECK(kv.k(1)[kv.view().row(2, p) * 2] == static_cast<float>(kv.view().row(1, p)));
  }
  CHECK(kv.k(1)[kv.view().row(2, 5) * 2] == static_cast<float>(kv.view().row(2, 5)));
  CHECK_THROWS_AS(kv.copy(1, 1, 2), Error);
  CHECK_THROWS_AS(kv.copy(1, 2, 9), Error);
  CHECK_THROWS_AS(KvCache({KvLayer{4, 4}}, 8, 0), Error);
}

TEST_CASE("batch: a sequence's tokens and logits do not depend on its neighbours (stories260K)") {
  gguf::File file = gguf::File::open(test::stories260k().string());
  auto model = load_model(file);
  SUBCASE("CPU") { check_invariance(*model, {}); }
  SUBCASE("device, every layer") {
    auto dev = test_device();
    REQUIRE(dev->info().multi_seq);
    check_invariance(*model, {dev.get(), [](int) { return true; }, true});
  }
  SUBCASE("device, last 3 layers") {
    auto dev = test_device();
    const int n_layer = static_cast<int>(model->hparams().n_layer);
    check_invariance(*model, {dev.get(), [&](int l) { return l >= n_layer - 3; }, false});
  }
}

TEST_CASE("batch: a MoE sequence's tokens and logits do not depend on its neighbours") {
  for (const std::string type : {"q8_0", "q4_k"}) {
    CAPTURE(type);
    gguf::File file = gguf::File::open(tiny_moe_file(type));
    auto model = load_model(file);
    SUBCASE("CPU") { check_invariance(*model, {}); }
    SUBCASE("device") {
      auto dev = test_device();
      check_invariance(*model, {dev.get(), [](int l) { return l == 1; }, true});
    }
    SUBCASE("device, all layers, experts on the CPU") {
      auto dev = test_device();
      check_invariance(*model, {dev.get(), [](int) { return true; }, true, true});
    }
  }
}

// By count the CUDA moe_experts would take the per-pair GEMV up to moe_gemv_max_tok() tokens
// and the grouped WMMA GEMM above, so a row's bits would change with the step; in a
// batch-invariant step the device computes rows by kind (decode rows on the GEMV, prompt rows
// on the GEMM). Every layer's experts on the device (BERTH_TEST_DEVICE=cuda: the GPU).
TEST_CASE(
    "batch: a MoE sequence with its experts on the device does not depend on its neighbours") {
  gguf::File file = gguf::File::open(tiny_moe_file("q8_0"));
  auto model = load_model(file);
  auto dev = test_device();
  check_invariance(*model, {dev.get(), [](int) { return true; }, true});
}

// The disk tier (docs/disk.md): every MoE layer's routed experts stay in the file and are read
// into a RAM cache of 2 slots per layer (of 4 experts, top 2). The sequence's decode token alone
// needs at most the 2 the slots hold; a step of several sequences (and a prompt) needs more and
// computes them in groups, evicting and reading again. The combine stays in slot order, so the
// sequence's bits are those of the untiered run too.
TEST_CASE(
    "batch: a MoE sequence whose experts are read from disk does not depend on its neighbours") {
  gguf::File file = gguf::File::open(tiny_moe_file("q4_k"));
  auto model = load_model(file);
  const int32_t n_layer = model->hparams().n_layer;
  placement::Plan plan;  // the disk tier's part of a plan: every MoE layer, 2 RAM slots
  plan.ram_slots = 2;
  plan.layer_ram_slots.assign(static_cast<size_t>(n_layer), 2);
  int sessions = 0;
  const auto tiered = [&](Placement pl) {
    pl.more = [&](SessionParams& sp) { use_disk_tier(file, *model, plan, sp); };
    pl.after = [&](Session& s) {
      ++sessions;
      REQUIRE(s.disk_tier() != nullptr);
      const DiskTier::Stats st = s.disk_tier()->stats();
      // More expert reads than slots: experts were evicted and read again.
      CHECK(st.reads_demand + st.reads_ahead > int64_t{plan.ram_slots} * n_layer);
      CHECK(st.calls > 0);
    };
    return pl;
  };
  auto dev = test_device();
  const Placement cpu{}, gpu{dev.get(), [](int) { return true; }, true, true};
  for (const Placement* base : {&cpu, &gpu}) {
    CAPTURE(base->dev != nullptr);
    sessions = 0;
    const Trace alone = check_invariance(*model, tiered(*base));
    CHECK(sessions == 8);  // the loop alone, the session alone, 6 neighbourhoods
    CHECK(same_bits(alone, run_alone(*model, *base)));
  }
}

// Unified memory (--unified, docs/unified.md): the device reads the weights it computes in host
// memory (a device without pageable memory access reads one page-locked host copy of them);
// nothing is uploaded. Same kernels on the same bytes: the bits of the placement that uploads.
TEST_CASE("batch: a MoE sequence on unified memory does not depend on its neighbours") {
  gguf::File file = gguf::File::open(tiny_moe_file("q8_0"));
  auto model = load_model(file);
  auto dev = test_device();
  int sessions = 0;
  const auto unified = [&](Placement pl) {
    pl.more = [](SessionParams& sp) { sp.unified = true; };
    pl.after = [&](Session& s) {
      ++sessions;
      REQUIRE(s.residency() != nullptr);
      CHECK(s.residency()->device_weight_bytes() == 0);
      CHECK(s.residency()->in_place_weight_bytes() > 0);
    };
    return pl;
  };
  const Placement all{dev.get(), [](int) { return true; }, true},
      cpu_experts{dev.get(), [](int) { return true; }, true, true};
  for (const Placement* base : {&all, &cpu_experts}) {
    const std::string where = base == &all ? "every layer" : "experts on the CPU";
    CAPTURE(where);
    sessions = 0;
    const Trace alone = check_invariance(*model, unified(*base));
    CHECK(sessions == 8);
    CHECK(same_bits(alone, run_alone(*model, *base)));
  }
}

namespace {

/// --residency-policy frequency:TRACE (FrequencySlotPolicy) with a calibration trace of one token
/// that routed to experts `hot` in every layer of `m`: the slots hold those for good.
std::shared_ptr<SlotPolicy> static_slots(const Model& m, std::vector<uint16_t> hot) {
  residency::RoutingTrace t;
  t.shape.n_layer = m.hparams().n_layer;
  t.shape.n_expert = m.hparams().n_expert;
  t.shape.n_expert_used = static_cast<int32_t>(hot.size());
  for (int32_t l = 0; l < t.shape.n_layer; ++l) t.shape.blocks.push_back(l);
  t.kinds.push_back(residency::TokenKind::prefill);
  for (int32_t l = 0; l < t.shape.n_layer; ++l) t.ids.insert(t.ids.end(), hot.begin(), hot.end());
  return std::make_shared<FrequencySlotPolicy>(t, "calibration");
}

}  // namespace

// Expert slots that do not move (--residency-policy frequency:TRACE): each MoE layer's experts 1
// and 3 in device slots, 0 and 2 on the CPU, every other weight on the device. A token's experts
// are computed where their expert lives, whatever shares its step.
TEST_CASE("batch: a MoE sequence with static expert slots does not depend on its neighbours") {
  gguf::File file = gguf::File::open(tiny_moe_file("q8_0"));
  auto model = load_model(file);
  REQUIRE(model->hparams().n_expert == 4);
  auto dev = test_device();
  int sessions = 0;
  Placement pl{dev.get(), [](int) { return true; }, true, true};
  pl.more = [&](SessionParams& sp) {
    sp.hybrid.expert_slots = {.slots_per_layer = 2, .policy = static_slots(*model, {3, 1})};
  };
  pl.after = [&](Session& s) {
    ++sessions;
    REQUIRE(s.residency()->expert_slots() != nullptr);
    const ExpertSlots::Stats st = s.residency()->expert_slots()->stats();
    CHECK(st.swaps == 0);
    CHECK(st.device_calls > 0);         // routed calls served from the slots
    CHECK(st.device_calls < st.calls);  // and on the CPU
  };
  check_invariance(*model, pl);
  CHECK(sessions == 8);
}

// Streamed prefill (--stream-experts N): a step of at least N tokens (and more than one) computes
// the CPU-held experts on the device, their tensors copied there layer by layer; a smaller step
// computes them on the CPU (scheduler/schedule.h, step 2), whose rounding a device's expert
// kernels do not share (CUDA's quantize the activations). So that a sequence's rows never depend
// on what shares their steps, a step of several sequences (batch-invariant) never streams: here
// N = 16, and of the sessions check_invariance runs only the one-sequence Session streams (on
// the simulated device; with CUDA its reference Session has two sequences and streams nothing).
// Before steps of several sequences stopped streaming, this case failed on an H100 in the -ub 16,
// 8 and 5 cases (their steps streamed or not by size) while the simulated device, whose experts
// are the CPU's bits, passed.
TEST_CASE("batch: steps of several sequences never stream experts; a sequence keeps its bits") {
  gguf::File file = gguf::File::open(tiny_moe_file("q8_0"));
  auto model = load_model(file);
  auto dev = test_device();
  std::vector<int64_t> streamed;
  Placement pl{dev.get(), [](int) { return true; }, true, true};
  pl.more = [](SessionParams& sp) { sp.hybrid.stream_experts_min_tokens = 16; };
  pl.after = [&](Session& s) { streamed.push_back(s.scheduler().streamed_ops()); };
  check_invariance(*model, pl);
  // Per session, in check_invariance's order: the loop alone, the one-sequence Session (its
  // prompt's one step of 37 tokens streams every layer), then the six cases beside others.
  const int64_t n_layer = model->hparams().n_layer;
  REQUIRE(streamed.size() == 8);
  CHECK(streamed[1] == (use_cuda() ? 0 : n_layer));
  for (size_t i : {0, 2, 3, 4, 5, 6, 7}) {
    CAPTURE(i);
    CHECK(streamed[i] == 0);
  }
}

namespace {

/// Per MoE layer of graph g's last run on `s`'s CPU executor: the distinct experts its tokens
/// were routed to.
std::vector<std::set<int32_t>> routed_experts(Session& s, const graph::Graph& g) {
  std::vector<std::set<int32_t>> out;
  for (const graph::Op& op : g.ops) {
    if (op.kind != graph::OpKind::moe_route) continue;
    const std::span<const float> r = s.executor().value(g, op.output);
    const int32_t k = op.moe.n_expert_used;
    std::set<int32_t> e;
    for (size_t t = 0; t < r.size() / (2 * static_cast<size_t>(k)); ++t)
      for (int32_t j = 0; j < k; ++j) e.insert(static_cast<int32_t>(r[t * 2 * k + j]));
    out.push_back(e);
  }
  return out;
}

}  // namespace

TEST_CASE("batch: a step of several sequences reads each distinct routed expert once") {
  gguf::File file = gguf::File::open(tiny_moe_file("q8_0"));
  auto model = load_model(file);
  const Hparams& hp = model->hparams();
  const auto n_vocab = static_cast<int32_t>(hp.n_vocab);
  // Per expert, the bytes of its gate, up and down slices.
  const graph::WeightTable& w = model->weights();
  int64_t expert_bytes = -1;
  for (size_t i = 0; i < w.size(); ++i)
    if (w.tensors[i].name == "blk.0.ffn_gate_exps.weight") {
      const TensorView& t = w.tensors[i];
      expert_bytes = static_cast<int64_t>(t.n_bytes / static_cast<size_t>(t.ne[2])) * 3;
    }
  REQUIRE(expert_bytes > 0);
  const int n_seq = 4;
  Session s(*model, params(*model, {}, n_seq, 64, 512));
  // Prompts of different lengths, each in its sequence.
  std::vector<int64_t> len(n_seq);
  for (int q = 0; q < n_seq; ++q) {
    const std::vector<int32_t> p = prompt_of(5 + 3 * q, q, n_vocab);
    REQUIRE(s.kv().acquire() == q);
    std::vector<int32_t> pos(p.size()), seq(p.size(), q);
    for (size_t i = 0; i < p.size(); ++i) pos[i] = static_cast<int32_t>(i);
    s.eval_step(p, pos, seq, 1);
    len[q] = static_cast<int64_t>(p.size());
  }
  // One decode step of all four, and one step of two prompt chunks and two decode tokens.
  struct Step {
    std::vector<int32_t> tokens, positions, seqs;
  };
  Step dec;
  for (int q = 0; q < n_seq; ++q) {
    dec.tokens.push_back(7 + q);
    dec.positions.push_back(static_cast<int32_t>(len[q]));
    dec.seqs.push_back(q);
  }
  Step mixed;
  for (int q = 0; q < 2; ++q)
    for (int i = 0; i < 6; ++i) {
      mixed.tokens.push_back(20 + i + q);
      mixed.positions.push_back(static_cast<int32_t>(len[q] + 1 + i));
      mixed.seqs.push_back(q);
    }
  for (int q = 2; q < n_seq; ++q) {
    mixed.tokens.push_back(9);
    mixed.positions.push_back(static_cast<int32_t>(len[q] + 1));
    mixed.seqs.push_back(q);
  }
  for (const Step* st : {&dec, &mixed}) {
    const auto n = static_cast<int32_t>(st->tokens.size());
    const graph::Graph g = model->build_step(n, n);
    s.executor().reset_moe_reads();
    s.scheduler().run(g, st->tokens, st->positions, st->seqs);
    const CpuExecutor::MoeReads& r = s.executor().moe_reads();
    const auto routed = routed_experts(s, g);
    REQUIRE(routed.size() == static_cast<size_t>(hp.n_layer));
    int64_t distinct = 0;
    for (const auto& e : routed) distinct += static_cast<int64_t>(e.size());
    CHECK(r.calls == hp.n_layer);
    CHECK(r.pairs == int64_t{n} * hp.n_expert_used * hp.n_layer);
    CHECK(r.experts == distinct);
    CHECK(r.bytes == distinct * expert_bytes);
    CHECK(r.experts < r.pairs);  // tokens shared experts, and each was read once
  }

  SUBCASE("on the simulated device") {
    if (use_cuda()) return;
    auto dev = test_device();
    Session sd(*model, params(*model, {dev.get(), [](int) { return true; }, true}, n_seq, 64, 512));
    for (int q = 0; q < n_seq; ++q) {
      const std::vector<int32_t> p = prompt_of(5 + 3 * q, q, n_vocab);
      REQUIRE(sd.kv().acquire() == q);
      std::vector<int32_t> pos(p.size()), seq(p.size(), q);
      for (size_t i = 0; i < p.size(); ++i) pos[i] = static_cast<int32_t>(i);
      sd.eval_step(p, pos, seq, 1);
    }
    // The same decode step on the CPU session gives the routes; the device counts its reads.
    const graph::Graph g = model->build_step(n_seq, n_seq);
    s.scheduler().run(g, dec.tokens, dec.positions, dec.seqs);
    int64_t distinct = 0;
    for (const auto& e : routed_experts(s, g)) distinct += static_cast<int64_t>(e.size());
    const DeviceInfo before = dev->info();
    sd.eval_step(dec.tokens, dec.positions, dec.seqs, n_seq);
    const DeviceInfo after = dev->info();
    CHECK(after.moe_expert_reads - before.moe_expert_reads == distinct);
    CHECK(after.moe_expert_bytes - before.moe_expert_bytes == distinct * expert_bytes);
  }
}

TEST_CASE("batch: the loop queues, cancels and stops sequences") {
  gguf::File file = gguf::File::open(test::stories260k().string());
  auto model = load_model(file);
  const auto n_vocab = static_cast<int32_t>(model->hparams().n_vocab);
  SessionParams sp = params(*model, {}, 2, 32, 8);
  Session s(*model, sp);
  BatchLoop loop(s);
  auto req = [&](int len, int n_predict, int salt) {
    BatchRequest r;
    r.prompt = prompt_of(len, salt, n_vocab);
    r.sampling.temp = 0;
    r.n_predict = n_predict;
    return r;
  };
  const int64_t a = loop.submit(req(5, 3, 0));
  const int64_t b = loop.submit(req(6, -1, 1));  // until the context (32) is full
  const int64_t c = loop.submit(req(7, 0, 2));   // the prompt only
  const int64_t d = loop.submit(req(4, 5, 3));   // cancelled while queued
  CHECK(loop.n_queued() == 4);
  std::map<int64_t, std::vector<int32_t>> toks;
  std::map<int64_t, StopReason> stop;
  std::vector<int64_t> order;
  bool cancelled = false;
  for (int i = 0; !loop.idle(); ++i) {
    REQUIRE(i < 1000);
    for (const BatchEvent& e : loop.step()) {
      if (e.token >= 0) toks[e.id].push_back(e.token);
      if (e.done) {
        stop[e.id] = e.stop;
        order.push_back(e.id);
      }
    }
    CHECK(loop.n_running() <= 2);  // the pool has two sequences
    if (!cancelled) {
      loop.cancel(d);
      cancelled = true;
    }
  }
  CHECK(toks[a].size() == 3);
  CHECK(stop[a] == StopReason::n_predict);
  CHECK(toks[b].size() == 32 - 6 + 1);  // positions 6..31 fed, and the last sampled token
  CHECK(stop[b] == StopReason::context_full);
  CHECK(toks[c].empty());
  CHECK(stop[c] == StopReason::n_predict);
  CHECK(toks[d].empty());
  CHECK(stop[d] == StopReason::callback);
  CHECK(order.front() == d);  // cancelled before it ran
  CHECK(s.kv().n_free() == 2);

  // Bad requests: named errors, nothing queued.
  for (auto bad : {BatchRequest{}, req(32, 1, 0)}) CHECK_THROWS_AS(loop.submit(bad), Error);
  BatchRequest oov = req(3, 1, 0);
  oov.prompt[1] = n_vocab;
  try {
    loop.submit(oov);
    FAIL("an id outside the vocabulary must be refused");
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::invalid_argument);
    CHECK(std::string(e.what()).find(std::to_string(n_vocab)) != std::string::npos);
  }
  BatchRequest bad_temp = req(3, 1, 0);
  bad_temp.sampling.top_p = 2;
  CHECK_THROWS_AS(loop.submit(bad_temp), Error);
  CHECK(loop.idle());
}

TEST_CASE("batch: eval_step refuses positions that break a sequence") {
  gguf::File file = gguf::File::open(test::stories260k().string());
  auto model = load_model(file);
  Session s(*model, params(*model, {}, 2, 16, 8));
  const std::vector<int32_t> t = {5, 6, 7};
  auto expect_invalid = [&](const std::vector<int32_t>& pos, const std::vector<int32_t>& seq,
                            int32_t n_out, const char* what, int32_t n_decode = -1) {
    const std::string w = what;
    CAPTURE(w);
    try {
      s.eval_step(t, pos, seq, n_out, n_decode);
      FAIL("must throw");
    } catch (const Error& e) {
      CHECK(e.category() == ErrorCategory::invalid_argument);
    }
  };
  expect_invalid({0, 2, 3}, {0, 0, 0}, 1, "a gap");
  expect_invalid({0, 1, 2}, {0, 0, 2}, 1, "a sequence outside the cache");
  expect_invalid({14, 15, 16}, {1, 1, 1}, 1, "a position outside the context");
  expect_invalid({0, 1, 0}, {0, 0, 1}, 4, "more output rows than tokens");
  expect_invalid({0, 1}, {0, 0, 1}, 1, "fewer positions than tokens");
  expect_invalid({3, 0, 5}, {0, 1, 0}, 1, "a gap between a sequence's tokens");
  expect_invalid({0, 1, 2}, {0, 0, 0}, 1, "more decode tokens than tokens", 4);
  expect_invalid({0, 1, 2}, {0, 0, 0}, 1, "n_decode below -1", -2);
  expect_invalid({0, 1, 0}, {0, 0, 1}, 1, "a decode token beside its sequence's prompt", 2);
  // Interleaved sequences with consecutive positions each are fine.
  const std::vector<int32_t> pos = {0, 0, 1}, seq = {0, 1, 0};
  const std::span<const float> out = s.eval_step(t, pos, seq, 2);
  CHECK(out.size() == static_cast<size_t>(2 * model->hparams().n_vocab));
  // Prompt tokens of sequence 0, then one decode token of sequence 1.
  const std::vector<int32_t> pos2 = {2, 3, 1}, seq2 = {0, 0, 1};
  CHECK(s.eval_step(t, pos2, seq2, 1, 1).size() == static_cast<size_t>(model->hparams().n_vocab));
}

TEST_CASE("batch: the packer puts the decode tokens last, the wanted prompt rows before them") {
  const std::vector<int32_t> p0 = {1, 2, 3, 4, 5}, p2 = {7, 8}, d1 = {9}, d3 = {10};
  const StepInput in[] = {{0, 0, p0, false}, {1, 4, d1, true}, {2, 0, p2, false}, {3, 6, d3, true}};
  StepPacker pk;
  pk.pack(in, 16);
  CHECK(pk.n_decode() == 2);
  CHECK(pk.n_prompt() == 7);
  // Bodies of the prompts, then the prompts' last tokens, then the decode tokens (input order).
  CHECK(std::vector<int32_t>(pk.tokens().begin(), pk.tokens().end()) ==
        std::vector<int32_t>{1, 2, 3, 4, 7, 5, 8, 9, 10});
  CHECK(std::vector<int32_t>(pk.seqs().begin(), pk.seqs().end()) ==
        std::vector<int32_t>{0, 0, 0, 0, 2, 0, 2, 1, 3});
  CHECK(std::vector<int32_t>(pk.positions().begin(), pk.positions().end()) ==
        std::vector<int32_t>{0, 1, 2, 3, 0, 4, 1, 4, 6});
  CHECK(pk.n_out() == 4);
  CHECK(pk.out_row(0) == 0);
  CHECK(pk.out_row(2) == 1);
  CHECK(pk.out_row(1) == 2);
  CHECK(pk.out_row(3) == 3);
  // A budget that cuts the prompts: decode tokens first in the budget, still last in the step.
  pk.pack(in, 5);
  CHECK(pk.n_decode() == 2);
  CHECK(pk.n_prompt() == 3);
  CHECK(std::vector<int32_t>(pk.tokens().begin(), pk.tokens().end()) ==
        std::vector<int32_t>{1, 2, 3, 9, 10});
  CHECK(pk.out_row(0) == -1);
  CHECK(pk.out_row(1) == 0);
  CHECK(pk.out_row(3) == 1);
  // A prompt offered short of its end (stops_short): all of it taken, no output row for it.
  StepInput held[] = {{0, 0, p0, false}, {1, 4, d1, true}};
  held[0].stops_short = true;
  pk.pack(held, 16);
  CHECK(pk.n_prompt() == 5);
  CHECK(std::vector<int32_t>(pk.tokens().begin(), pk.tokens().end()) ==
        std::vector<int32_t>{1, 2, 3, 4, 5, 9});
  CHECK(pk.out_row(0) == -1);
  CHECK(pk.out_row(1) == 0);
  CHECK(pk.n_out() == 1);
}

TEST_CASE("batch: more generating sequences than -ub take turns") {
  gguf::File file = gguf::File::open(test::stories260k().string());
  auto model = load_model(file);
  const auto n_vocab = static_cast<int32_t>(model->hparams().n_vocab);
  Session s(*model, params(*model, {}, 5, 64, 2));  // 5 sequences, 2 tokens per step
  BatchLoop loop(s);
  std::map<int64_t, std::vector<int>> steps_with_token;  // per request: the steps it got a token
  std::vector<int64_t> ids;
  for (int q = 0; q < 5; ++q) {
    BatchRequest r;
    r.prompt = prompt_of(2, q, n_vocab);
    r.sampling.temp = 0;
    r.n_predict = 8;
    ids.push_back(loop.submit(r));
  }
  for (int step = 0; !loop.idle(); ++step) {
    REQUIRE(step < 500);
    for (const BatchEvent& e : loop.step())
      if (e.token >= 0) steps_with_token[e.id].push_back(step);
    CHECK(loop.last_step().n_decode + loop.last_step().n_prompt <= 2);
  }
  for (int64_t id : ids) {
    CAPTURE(id);
    const std::vector<int>& st = steps_with_token[id];
    REQUIRE(st.size() == 8);
    // Five generating sequences, two decode tokens per step: a turn every third step at most.
    for (size_t i = 1; i < st.size(); ++i) CHECK(st[i] - st[i - 1] <= 3);
  }
}
