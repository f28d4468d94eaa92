// BatchEngine without HTTP: the slots share each forward step, a request's tokens are those it
// gets alone whatever shares its steps, cancellation frees a slot in prefill and in decode, the
// queue limit, and the prefix cache's reuse giving the same tokens as a full prefill (for
// Qwen3.5, through the checkpoints at the end of each prompt and of each reply).
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "berth/backends/device.h"
#include "server_harness.h"

using namespace berth;
using namespace berth::test;
using server::BatchEngine;
using server::BatchEngineOptions;
using server::FinishReason;
using server::GenerationRequest;

namespace {

std::unique_ptr<BatchEngine> make_engine(const LoadedModel& m, int32_t n_slots, int64_t n_ctx,
                                         int32_t n_ubatch = 512, int32_t queue = 64,
                                         Device* device = nullptr, int32_t n_state_spare = 0) {
  BatchEngineOptions o;
  o.session.n_state_spare = n_state_spare;
  if (device != nullptr) {  // everything on the device
    o.session.device = device;
    o.session.weight_home.assign(m.model->weights().size(), placement::Home::gpu);
    o.session.kv_home.assign(static_cast<size_t>(m.model->hparams().n_layer), placement::Home::gpu);
  }
  o.n_slots = n_slots;
  o.n_ctx = n_ctx;
  o.queue_limit = queue;
  o.session.n_threads = 1;
  o.session.n_ubatch = n_ubatch;
  return std::make_unique<BatchEngine>(*m.model, *m.tok, o);
}

GenerationRequest greedy(const LoadedModel& m, const std::string& text, int64_t max_tokens) {
  GenerationRequest r;
  r.prompt = m.tok->encode(text, true);
  r.sampling.sampler.temp = 0;
  r.max_tokens = max_tokens;
  return r;
}

// What a Generation produced, read to its end.
struct Result {
  std::vector<server::GeneratedToken> tokens;
  FinishReason finish = FinishReason::length;
  std::optional<std::string> error;
  server::GenerationTimings timings;
  int32_t slot = -1;
  std::vector<int32_t> ids() const {
    std::vector<int32_t> out;
    for (const auto& t : tokens) out.push_back(t.id);
    return out;
  }
};

Result drain(server::Generation& g) {
  Result r;
  while (true) {
    server::GenerationUpdate u = g.wait(std::chrono::milliseconds(1000));
    for (auto& t : u.tokens) r.tokens.push_back(std::move(t));
    if (u.started) r.slot = u.slot;
    if (u.done) {
      r.finish = u.finish;
      r.error = u.error;
      r.timings = u.timings;
      return r;
    }
  }
}

Result run_alone(const LoadedModel& m, const GenerationRequest& req) {
  auto e = make_engine(m, 1, 512);
  return drain(*e->submit(req));
}

const std::vector<std::string> kPrompts = {"Once upon a time", "Lily and Tom went to the park",
                                           "The little dog", "One day, a bird sang"};

}  // namespace

TEST_CASE("BatchEngine: four requests share each step and each gets its tokens alone") {
  const LoadedModel& m = stories();
  std::vector<GenerationRequest> reqs;
  for (const std::string& p : kPrompts) reqs.push_back(greedy(m, p, 40));
  // A sampled request with penalties and logprobs: its own sampler and seed, the same draws.
  GenerationRequest sampled = greedy(m, "Sam had a big red", 40);
  sampled.sampling.sampler.temp = 0.9f;
  sampled.sampling.sampler.seed = 1234;
  sampled.sampling.presence_penalty = 0.4f;
  sampled.sampling.frequency_penalty = 0.3f;
  sampled.sampling.logprobs = true;
  sampled.sampling.n_top_logprobs = 3;
  reqs.push_back(sampled);
  std::vector<Result> alone;
  for (const GenerationRequest& r : reqs) alone.push_back(run_alone(m, r));

  for (const int32_t n_ubatch : {512, 3}) {  // 3: prompt chunks beside other slots' decodes
    CAPTURE(n_ubatch);
    auto e = make_engine(m, 4, 4 * 256, n_ubatch);
    e->hold_queue(true);  // all start in the same step (the fifth waits for a slot)
    std::vector<std::shared_ptr<server::Generation>> gens;
    for (const GenerationRequest& r : reqs) gens.push_back(e->submit(r));
    CHECK(e->metrics().requests_deferred == 5);
    e->hold_queue(false);
    for (size_t i = 0; i < gens.size(); ++i) {
      CAPTURE(i);
      const Result got = drain(*gens[i]);
      REQUIRE_FALSE(got.error);
      CHECK(got.ids() == alone[i].ids());
      CHECK(got.finish == alone[i].finish);
      CHECK(got.timings.n_predicted == alone[i].timings.n_predicted);
      REQUIRE(got.tokens.size() == alone[i].tokens.size());
      for (size_t t = 0; t < got.tokens.size(); ++t) {
        CHECK(got.tokens[t].logprob == alone[i].tokens[t].logprob);
        CHECK(got.tokens[t].top == alone[i].tokens[t].top);
      }
    }
    CHECK(alone.back().tokens.front().top.size() == 3);
    const server::EngineMetrics mt = e->metrics();
    // -ub 512: the first step carried the four prompts; -ub 3: three slots' decode tokens.
    CHECK(mt.max_step_seqs == std::min(4, n_ubatch));
    CHECK(mt.n_step_seqs_total > mt.n_decode_total);
    CHECK(mt.requests_processing == 0);
    CHECK(e->n_in_flight() == 0);
    for (const server::SlotInfo& s : e->slots()) CHECK_FALSE(s.is_processing);
  }
}

TEST_CASE(
    "BatchEngine on a device: greedy rows are picked on the device, the same tokens alone and "
    "beside others") {
  // Greedy slots without penalties or logprobs: the device picks each output row's token and
  // only the ids come back, alone and beside other slots; a step with a slot that needs the
  // logits (logprobs) takes every row's logits and the samplers pick: the same tokens.
  const LoadedModel& m = stories();
  std::unique_ptr<Device> dev = make_sim_device(size_t{1} << 30);
  std::vector<std::vector<int32_t>> alone;
  for (const std::string& p : kPrompts) {
    auto e = make_engine(m, 1, 512, 512, 64, dev.get());
    alone.push_back(drain(*e->submit(greedy(m, p, 24))).ids());
    const server::EngineMetrics mt = e->metrics();
    CHECK(mt.tokens_device_picked_total == 24);
    // The prompt's step samples the first token, 23 decode-only steps the rest: 22 of them
    // follow a decode-only step.
    CHECK(mt.decode_steps_total == 23);
    CHECK(mt.decode_rows_total == 23);
    CHECK(mt.decode_intervals_total == 22);
    CHECK(mt.decode_step_seconds_total > 0);
    CHECK(mt.decode_interval_seconds_total > 0);
    CHECK(alone.back().size() == 24);
  }
  auto e = make_engine(m, 4, 4 * 256, 512, 64, dev.get());
  e->hold_queue(true);
  std::vector<std::shared_ptr<server::Generation>> gens;
  for (const std::string& p : kPrompts) gens.push_back(e->submit(greedy(m, p, 24)));
  e->hold_queue(false);
  for (size_t i = 0; i < gens.size(); ++i) CHECK(drain(*gens[i]).ids() == alone[i]);
  CHECK(e->metrics().tokens_device_picked_total == 4 * 24);
  // The four prompts in one step (-ub 512), then 23 steps of four decode tokens.
  CHECK(e->metrics().decode_steps_total == 23);
  CHECK(e->metrics().decode_rows_total == 4 * 23);
  {  // one slot wants logprobs for its 8 tokens: those steps' rows come back as logits
    auto mixed = make_engine(m, 4, 4 * 256, 512, 64, dev.get());
    mixed->hold_queue(true);
    std::vector<std::shared_ptr<server::Generation>> mg;
    for (size_t i = 0; i < kPrompts.size(); ++i) {
      GenerationRequest r = greedy(m, kPrompts[i], i == 0 ? 8 : 24);
      r.sampling.logprobs = i == 0;
      mg.push_back(mixed->submit(r));
    }
    mixed->hold_queue(false);
    for (size_t i = 0; i < mg.size(); ++i) {
      const std::vector<int32_t> want =
          i == 0 ? std::vector<int32_t>(alone[0].begin(), alone[0].begin() + 8) : alone[i];
      CHECK(drain(*mg[i]).ids() == want);
    }
    // 4 x 8 rows came back as logits, the other 3 x 16 were picked on the device
    CHECK(mixed->metrics().tokens_device_picked_total == 3 * 16);
  }
  // A logprobs request alone still takes the logits (its top tokens need them).
  auto lp = make_engine(m, 1, 512, 512, 64, dev.get());
  GenerationRequest r = greedy(m, kPrompts[0], 8);
  r.sampling.logprobs = true;
  const Result got = drain(*lp->submit(r));
  CHECK(got.ids() == std::vector<int32_t>(alone[0].begin(), alone[0].begin() + 8));
  CHECK(lp->metrics().tokens_device_picked_total == 0);
}

TEST_CASE("BatchEngine: cancel frees the slot in prefill and in decode; the other slot goes on") {
  static LoadedModel slow(synth_model("slow-llama"));
  GenerationRequest other;
  other.prompt = {1, 5, 9};
  other.sampling.sampler.temp = 0;
  other.max_tokens = 60;
  other.ignore_eos = true;
  const Result other_alone = run_alone(slow, other);

  // -ub 2: a prompt of 400 tokens takes 200 steps.
  auto e = make_engine(slow, 2, 2 * 512, 2);
  auto bystander = e->submit(other);
  {  // In prefill: cancel after the first chunk.
    GenerationRequest r;
    r.prompt.assign(400, 7);
    r.prompt[0] = 1;
    r.max_tokens = 4;
    auto g = e->submit(r);
    while (true) {
      const server::GenerationUpdate u = g->wait(std::chrono::milliseconds(1000));
      if (u.n_prompt_done > 0 || u.done) break;
    }
    g->cancel();
    const Result got = drain(*g);
    CHECK(got.finish == FinishReason::cancelled);
    CHECK(got.tokens.empty());
    CHECK(got.timings.n_evaluated < 400);
    CHECK_FALSE(e->slots()[static_cast<size_t>(got.slot)].is_processing);
  }
  {  // In decode: cancel after the first token.
    GenerationRequest r;
    r.prompt = {1, 20};
    r.max_tokens = 400;
    r.ignore_eos = true;
    auto g = e->submit(r);
    size_t n = 0;
    while (n == 0) {
      const server::GenerationUpdate u = g->wait(std::chrono::milliseconds(1000));
      n += u.tokens.size();
      if (u.done) break;
    }
    g->cancel();
    const Result got = drain(*g);
    CHECK(got.finish == FinishReason::cancelled);
    CHECK(got.timings.n_predicted < 400);
    CHECK_FALSE(e->slots()[static_cast<size_t>(got.slot)].is_processing);
  }
  const Result b = drain(*bystander);
  CHECK(b.ids() == other_alone.ids());
  CHECK(e->n_in_flight() == 0);
  // Both slots take requests again.
  auto g1 = e->submit(other);
  auto g2 = e->submit(other);
  CHECK(drain(*g1).ids() == other_alone.ids());
  CHECK(drain(*g2).ids() == other_alone.ids());
}

TEST_CASE("BatchEngine: queue_full beyond the slots and --queue; a cancelled waiter leaves") {
  const LoadedModel& m = stories();
  auto e = make_engine(m, 2, 2 * 256, 512, 1);
  e->hold_queue(true);
  auto a = e->submit(greedy(m, "Once upon a time", 8));
  auto b = e->submit(greedy(m, "The little dog", 8));
  auto c = e->submit(greedy(m, "Mom said", 8));
  try {
    e->submit(greedy(m, "There was a tree", 8));
    FAIL("a fourth request was accepted by 2 slots and a queue of 1");
  } catch (const server::Rejected& r) {
    CHECK(r.reason() == server::Rejected::Reason::queue_full);
    // Held in the queue, none has a slot yet: the count is of every request the server holds.
    CHECK(std::string(r.what()) ==
          "the server holds 3 requests, its limit (2 slots and --queue 1 waiting)");
  }
  c->cancel();  // leaves the queue without taking a slot
  e->hold_queue(false);
  CHECK(drain(*a).finish == FinishReason::length);
  CHECK(drain(*b).finish == FinishReason::length);
  const Result rc = drain(*c);
  CHECK(rc.finish == FinishReason::cancelled);
  CHECK(rc.slot == -1);
  CHECK(drain(*e->submit(greedy(m, "There was a tree", 8))).tokens.size() == 8);
  e->close();
  CHECK_THROWS_AS(e->submit(greedy(m, "a", 1)), server::Rejected);
}

TEST_CASE("BatchEngine: a prompt sharing a prefix reuses the slot's cache, with the same tokens") {
  const LoadedModel& m = stories();
  auto e = make_engine(m, 2, 2 * 512, 4);  // -ub 4: the rest of the prompt in several chunks
  const GenerationRequest first = greedy(m, "Once upon a time, there was a little girl", 24);
  const Result r1 = drain(*e->submit(first));
  // Something unrelated takes the other slot (it shares less than half with the first).
  const Result r_other = drain(*e->submit(greedy(m, "Why is the sky blue?", 8)));
  CHECK(r_other.slot != r1.slot);
  // The next turn: the first prompt, its reply, and more.
  GenerationRequest next = first;
  for (int32_t id : r1.ids()) next.prompt.push_back(id);
  for (int32_t id : m.tok->encode(" Then she went home.", false)) next.prompt.push_back(id);
  next.max_tokens = 24;
  const Result r2 = drain(*e->submit(next));
  CHECK(r2.slot == r1.slot);
  CHECK(r2.timings.n_cached >= static_cast<int64_t>(first.prompt.size()));
  CHECK(r2.timings.n_cached + r2.timings.n_evaluated == static_cast<int64_t>(next.prompt.size()));
  CHECK(e->metrics().n_cached_total >= r2.timings.n_cached);
  // Without reuse, on this engine and alone: the same tokens.
  GenerationRequest no_cache = next;
  no_cache.cache_prompt = false;
  const Result r3 = drain(*e->submit(no_cache));
  CHECK(r3.timings.n_cached == 0);
  CHECK(r3.ids() == r2.ids());
  CHECK(run_alone(m, no_cache).ids() == r2.ids());
  // A pinned slot is honoured.
  GenerationRequest pinned = next;
  pinned.slot = 1 - r3.slot;
  const Result r4 = drain(*e->submit(pinned));
  CHECK(r4.slot == pinned.slot);
  CHECK(r4.ids() == r2.ids());
}

TEST_CASE(
    "BatchEngine: a Qwen3.5 slot keeps a checkpoint a token before the end of each prompt and at "
    "the end of each reply, so the same prompt again evaluates one token and a next turn "
    "branching off the chat none of the reply, with the same tokens") {
  // tiny-qwen35: Gated DeltaNet layers whose state cannot be cut back; the prefix cache reaches
  // earlier positions only through SlotCache's checkpoints (one token before the end of each
  // prompt, and the end of each reply). Token-id prompts: nothing is retokenized.
  // Checkpoints as host copies (no spare state rows), on the slot's two spare rows on the CPU,
  // and on them on the (simulated) device, where they are device-to-device copies; with two rows
  // the older checkpoints move to the host as newer ones come (the reply's end at 17 among them).
  static LoadedModel m(synth_model("tiny-qwen35"));
  std::unique_ptr<Device> dev = make_sim_device(size_t{1} << 30);
  for (const int config : {0, 1, 2}) {
    CAPTURE(config);
    const int32_t spare = config == 0 ? 0 : server::kDeviceCheckpointsPerSlot;
    auto e = make_engine(m, 1, 256, 8, 64, config == 2 ? dev.get() : nullptr, spare);
    auto ids_request = [](std::vector<int32_t> prompt, int64_t max_tokens) {
      GenerationRequest r;
      r.prompt = std::move(prompt);
      r.sampling.sampler.temp = 0;
      r.max_tokens = max_tokens;
      r.ignore_eos = true;  // exactly max_tokens tokens
      return r;
    };
    const std::vector<int32_t> p = {5, 17, 300, 42, 9, 77, 8, 600, 123, 31, 64, 999};  // 12
    constexpr int64_t kReply = 6;
    const Result r1 = drain(*e->submit(ids_request(p, kReply)));
    REQUIRE(r1.ids().size() == static_cast<size_t>(kReply));
    CHECK(r1.timings.n_cached == 0);
    // The same prompt again (a retry): from the checkpoint at 11, only the last token.
    const Result r0 = drain(*e->submit(ids_request(p, kReply)));
    CHECK(r0.timings.n_cached == static_cast<int64_t>(p.size()) - 1);
    CHECK(r0.timings.n_evaluated == 1);
    CHECK(r0.ids() == r1.ids());
    // The slot holds the prompt and the reply but its last token (sampled, never evaluated).
    const auto n_state = static_cast<int64_t>(p.size()) + kReply - 1;  // 17
    CHECK(e->slots()[0].n_cached == n_state);

    // The next turn: the prompt, the reply, a user message. It continues what the slot holds.
    std::vector<int32_t> next = p;
    for (int32_t id : r1.ids()) next.push_back(id);
    for (int32_t id : {700, 701, 702, 703, 704}) next.push_back(id);  // 23 tokens
    const Result r2 = drain(*e->submit(ids_request(next, kReply)));
    CHECK(r2.timings.n_cached == n_state);
    CHECK(r2.timings.n_evaluated == static_cast<int64_t>(next.size()) - n_state);

    // That turn regenerated: the same prompt again. Its last token must be evaluated again: from
    // the checkpoint one token before that prompt's end (22).
    const Result r3 = drain(*e->submit(ids_request(next, kReply)));
    CHECK(r3.timings.n_cached == static_cast<int64_t>(next.size()) - 1);
    CHECK(r3.timings.n_evaluated == 1);
    // That turn's user message edited: the nearest checkpoint at or before the edit is the first
    // reply's end (17); without it, the first prompt's (11), and the whole reply would be
    // evaluated again.
    std::vector<int32_t> edited(next.begin(), next.begin() + n_state + 1);
    for (int32_t id : {800, 801, 802}) edited.push_back(id);
    const Result r4 = drain(*e->submit(ids_request(edited, kReply)));
    CHECK(r4.timings.n_cached == n_state);
    CHECK(r4.timings.n_evaluated == 4);  // the reply's last token and the 3 of the user message

    // Bit-identical tokens to an engine without a cache (a fresh slot, the prompt from position 0).
    const std::vector<int32_t> fresh = run_alone(m, ids_request(next, kReply)).ids();
    CHECK(fresh.size() == static_cast<size_t>(kReply));
    CHECK(r2.ids() == fresh);
    CHECK(r3.ids() == fresh);
    CHECK(r4.ids() == run_alone(m, ids_request(edited, kReply)).ids());
    // Branching off right after that prompt: the checkpoint a token before its end (20), among
    // the newest (on a spare row where the slot has them).
    std::vector<int32_t> branch = edited;
    for (int32_t id : {900, 901}) branch.push_back(id);
    const Result r5 = drain(*e->submit(ids_request(branch, kReply)));
    CHECK(r5.timings.n_cached == static_cast<int64_t>(edited.size()) - 1);
    CHECK(r5.timings.n_evaluated == 3);
    CHECK(r5.ids() == run_alone(m, ids_request(branch, kReply)).ids());
  }
}

TEST_CASE(
    "BatchEngine: a Qwen3.5 prompt takes the slot that can bring back most of it, not one whose "
    "state it shares but could only start over") {
  // Two slots of tiny-qwen35. A's slot shares A's first 8 tokens with the prompt Ap below but
  // holds checkpoints only at 11 and 17: it could bring back none of Ap, so Ap goes to B's slot
  // (the more recently used one) and A's state survives for A's repeat.
  static LoadedModel m(synth_model("tiny-qwen35"));
  auto e = make_engine(m, 2, 256, 8);
  auto ids_request = [](std::vector<int32_t> prompt) {
    GenerationRequest r;
    r.prompt = std::move(prompt);
    r.sampling.sampler.temp = 0;
    r.max_tokens = 6;
    r.ignore_eos = true;
    return r;
  };
  const std::vector<int32_t> a = {5, 17, 300, 42, 9, 77, 8, 600, 123, 31, 64, 999};
  const std::vector<int32_t> b = {400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411};
  std::vector<int32_t> ap(a.begin(), a.begin() + 8);
  ap.insert(ap.end(), {700, 701});
  const Result ra = drain(*e->submit(ids_request(a)));
  const Result rb = drain(*e->submit(ids_request(b)));
  REQUIRE(ra.slot != rb.slot);
  const Result rap = drain(*e->submit(ids_request(ap)));
  CHECK(rap.slot == rb.slot);
  CHECK(rap.timings.n_cached == 0);
  const Result ra2 = drain(*e->submit(ids_request(a)));
  CHECK(ra2.slot == ra.slot);
  CHECK(ra2.timings.n_cached == static_cast<int64_t>(a.size()) - 1);
  CHECK(ra2.ids() == ra.ids());
  CHECK(rap.ids() == run_alone(m, ids_request(ap)).ids());
  // B again: its slot now holds Ap (nothing shared), A's slot holds A: B starts over in the least
  // recently used of the two, Ap's.
  const Result rb2 = drain(*e->submit(ids_request(b)));
  CHECK(rb2.slot == rb.slot);
  CHECK(rb2.timings.n_cached == 0);
  CHECK(rb2.ids() == rb.ids());
}

TEST_CASE("BatchEngine: logit_bias moves greedy's argmax, on the host and on a device") {
  // stories260K continues "Once upon a" with " time" (378), then "re" (276) is the most likely;
  // a bias of -100 or -inf on 378 makes "re" the first token. On a device, a slot with a bias
  // takes its logits to the host (the device's pick would not see the bias).
  const LoadedModel& m = stories();
  REQUIRE(m.tok->token_to_piece(378) == " time");
  REQUIRE(m.tok->token_to_piece(276) == "re");
  std::unique_ptr<Device> dev = make_sim_device(size_t{1} << 30);
  for (Device* d : {static_cast<Device*>(nullptr), dev.get()}) {
    CAPTURE(d != nullptr);
    auto e = make_engine(m, 1, 512, 512, 64, d);
    CHECK(drain(*e->submit(greedy(m, "Once upon a", 3))).ids() ==
          std::vector<int32_t>{378, 432, 383});
    const int64_t picked = e->metrics().tokens_device_picked_total;
    CHECK(picked == (d ? 3 : 0));
    for (const float bias : {-100.0f, -INFINITY}) {
      GenerationRequest r = greedy(m, "Once upon a", 3);
      r.sampling.logit_bias = {{378, bias}};
      CHECK(drain(*e->submit(r)).ids() == std::vector<int32_t>{276, 364, 334});
    }
    // A positive bias makes its token win everywhere; a bias summed with another cancels.
    GenerationRequest r = greedy(m, "Once upon a", 3);
    r.sampling.logit_bias = {{13, 100.0f}};
    CHECK(drain(*e->submit(r)).ids() == std::vector<int32_t>{13, 13, 13});
    r.sampling.logit_bias = {{13, 100.0f}, {13, -100.0f}};
    CHECK(drain(*e->submit(r)).ids() == std::vector<int32_t>{378, 432, 383});
    CHECK(e->metrics().tokens_device_picked_total == picked);  // none of the biased ones
  }
  CHECK_FALSE(BatchEngine::device_pickable(
      server::SamplingSettings{.sampler = {.temp = 0}, .logit_bias = {{378, -1.0f}}}));
  CHECK(BatchEngine::device_pickable(server::SamplingSettings{.sampler = {.temp = 0}}));

  // Checked at submit: an id outside the vocabulary, a NaN or +inf bias.
  auto e = make_engine(m, 1, 512);
  for (const auto& [id, bias, msg] : std::vector<std::tuple<int32_t, float, std::string>>{
           {512, 1.0f, "logit_bias token 512 is outside the vocabulary of 512 tokens"},
           {-1, 1.0f, "logit_bias token -1 is outside the vocabulary of 512 tokens"},
           {5, NAN, "logit_bias of token 5 must be a number or -inf, got nan"},
           {5, INFINITY, "logit_bias of token 5 must be a number or -inf, got inf"}}) {
    GenerationRequest r = greedy(m, "Once upon a", 3);
    r.sampling.logit_bias = {{id, bias}};
    try {
      e->submit(r);
      FAIL("accepted");
    } catch (const server::Rejected& err) {
      CHECK(err.reason() == server::Rejected::Reason::invalid);
      CHECK(std::string(err.what()) == msg);
    }
  }
}
