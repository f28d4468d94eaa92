// Expert-cache simulation: LRU and LFU-with-decay on hand-made sequences (exact hits and loads
// worked out by hand in the comments), the simulator's totals and warm-up, coverage.
#include <doctest/doctest.h>

#include "berth/core/error.h"
#include "berth/residency/cache_sim.h"
#include "berth/residency/trace_gen.h"

namespace {

using berth::Error;
using berth::ErrorCategory;
using namespace berth::residency;

// A one-layer trace (or n_layer layers all routing the same) from per-token id lists.
RoutingTrace make_trace(int32_t n_expert, std::vector<std::vector<uint16_t>> tokens,
                        int32_t n_layer = 1) {
  RoutingTrace tr;
  tr.shape.n_layer = n_layer;
  tr.shape.n_expert = n_expert;
  tr.shape.n_expert_used = static_cast<int32_t>(tokens.at(0).size());
  for (int32_t l = 0; l < n_layer; ++l) tr.shape.blocks.push_back(l);
  for (const auto& t : tokens) {
    tr.kinds.push_back(TokenKind::decode);
    for (int32_t l = 0; l < n_layer; ++l) tr.ids.insert(tr.ids.end(), t.begin(), t.end());
  }
  return tr;
}

}  // namespace

TEST_CASE("LRU: exact hits, loads and contents on a hand-made sequence") {
  // 5 experts, top-2, 3 slots. Lists are most recent first.
  const std::vector<std::vector<uint16_t>> seq = {{0, 1}, {2, 3}, {1, 0}, {3, 2},
                                                  {0, 4}, {3, 1}, {4, 0}, {3, 4}};
  // t0 {0,1}: 0 hits; 0 1;      2 loads
  // t1 {2,3}: 0 hits; 2 3 0;    2 loads (1 leaves)
  // t2 {1,0}: 1 hit (0); 1 0 2; 1 load (3 leaves)
  // t3 {3,2}: 1 hit (2); 3 2 1; 1 load (0 leaves)
  // t4 {0,4}: 0 hits; 0 4 3;    2 loads (2, 1 leave)
  // t5 {3,1}: 1 hit (3); 3 1 0; 1 load (4 leaves)
  // t6 {4,0}: 1 hit (0); 4 0 3; 1 load (1 leaves)
  // t7 {3,4}: 2 hits;    3 4 0; 0 loads
  const std::vector<int> hits = {0, 0, 1, 1, 0, 1, 1, 2};
  const std::vector<int> loads = {2, 2, 1, 1, 2, 1, 1, 0};
  const std::vector<std::vector<int>> after = {{0, 1},    {0, 2, 3}, {0, 1, 2}, {1, 2, 3},
                                               {0, 3, 4}, {0, 1, 3}, {0, 3, 4}, {0, 3, 4}};
  LruPolicy lru;
  lru.reset(1, 5, 3);
  for (size_t t = 0; t < seq.size(); ++t) {
    INFO("token " << t);
    int h = 0;
    for (uint16_t e : seq[t]) h += lru.resident(0, e) ? 1 : 0;
    CHECK(h == hits[t]);
    CHECK(lru.update(0, seq[t]) == loads[t]);
    std::vector<int> in;
    for (int e = 0; e < 5; ++e)
      if (lru.resident(0, e)) in.push_back(e);
    CHECK(in == after[t]);
  }

  // The simulator gives the same totals, on every layer; a warm-up of 2 tokens drops t0, t1.
  const RoutingTrace tr = make_trace(5, seq, 3);
  CacheSimResult r = simulate_cache(tr, lru, 3);
  CHECK(r.policy == "lru");
  CHECK(r.capacity == 3);
  CHECK(r.tokens == 8);
  CHECK(r.calls == 3 * 16);
  CHECK(r.hits == 3 * 6);
  CHECK(r.loads == 3 * 10);
  CHECK(r.hit_rate() == doctest::Approx(6.0 / 16));
  r = simulate_cache(tr, lru, 3, {.warmup_tokens = 2});
  CHECK(r.tokens == 6);
  CHECK(r.calls == 3 * 12);
  CHECK(r.hits == 3 * 6);
  CHECK(r.loads == 3 * 6);
  // No slots: nothing hits, nothing loads.
  r = simulate_cache(tr, lru, 0);
  CHECK(r.hits == 0);
  CHECK(r.loads == 0);
  // All slots: everything after each expert's first call hits (5 first calls).
  r = simulate_cache(tr, lru, 5);
  CHECK(r.hits == 3 * (16 - 5));
  CHECK(r.loads == 3 * 5);
}

TEST_CASE("LRU: fewer slots than n_expert_used keeps the first slots of the top-k") {
  // 4 experts, top-3, 2 slots.
  // t0 {0,1,2}: 0 hits; keeps 0 1 (2 never enters): 2 loads
  // t1 {2,1,3}: 1 hit (1); keeps 2 1: 1 load
  // t2 {3,0,2}: 1 hit (2); keeps 3 0: 2 loads (2 was resident but is not among the first two)
  LruPolicy lru;
  lru.reset(1, 4, 2);
  const std::vector<std::vector<uint16_t>> seq = {{0, 1, 2}, {2, 1, 3}, {3, 0, 2}};
  const std::vector<int> hits = {0, 1, 1}, loads = {2, 1, 2};
  const std::vector<std::vector<int>> after = {{0, 1}, {1, 2}, {0, 3}};
  for (size_t t = 0; t < seq.size(); ++t) {
    INFO("token " << t);
    int h = 0;
    for (uint16_t e : seq[t]) h += lru.resident(0, e) ? 1 : 0;
    CHECK(h == hits[t]);
    CHECK(lru.update(0, seq[t]) == loads[t]);
    std::vector<int> in;
    for (int e = 0; e < 4; ++e)
      if (lru.resident(0, e)) in.push_back(e);
    CHECK(in == after[t]);
  }
}

TEST_CASE("LFU with decay: the half-life decides between old and recent counts") {
  // 4 experts, top-1, 1 slot; expert 0 three times, then expert 1 three times.
  const RoutingTrace tr = make_trace(4, {{0}, {0}, {0}, {1}, {1}, {1}});
  // Half-life 1 token (each older call counts half): at t3 expert 0's score is
  // (1 + 0.5 + 0.25) / 2 = 0.875 < 1 for expert 1, which enters at once: hits t1 t2 t4 t5 = 4.
  LfuDecayPolicy fast(1.0);
  CHECK(fast.name() == "lfu-decay(h=1)");
  CacheSimResult r = simulate_cache(tr, fast, 1);
  CHECK(r.hits == 4);
  CHECK(r.loads == 2);
  // Half-life 10^6 tokens (almost plain LFU): expert 1 needs a third call to outweigh expert 0's
  // three older ones, and enters only after t5: hits t1 t2 = 2.
  LfuDecayPolicy slow(1e6);
  r = simulate_cache(tr, slow, 1);
  CHECK(r.hits == 2);
  CHECK(r.loads == 2);
  slow.reset(1, 4, 1);
  for (int t = 0; t < 5; ++t) (void)slow.update(0, tr.token_ids(t, 0));
  CHECK(slow.resident(0, 0));  // after t4: 2 recent calls of expert 1 < 3 of expert 0
  (void)slow.update(0, tr.token_ids(5, 0));
  CHECK(slow.resident(0, 1));
  CHECK_FALSE(slow.resident(0, 0));

  // Many tokens: the rescaling of the growing increment keeps scores finite and the policy
  // right (half-life 0.5 tokens: the increment grows 4x per token and would overflow a double
  // after ~512 tokens). A long-called expert's score, decayed once, is 1/4 + 1/16 + ... = 1/3
  // of a fresh call's, so the new expert enters at its first call.
  LfuDecayPolicy faster(0.5);
  std::vector<std::vector<uint16_t>> seq;
  for (int t = 0; t < 5000; ++t) seq.push_back({static_cast<uint16_t>(t / 1000 % 2)});
  r = simulate_cache(make_trace(2, seq), faster, 1);
  CHECK(r.hits == 5000 - 5);  // one miss at each change of expert
  CHECK(r.loads == 5);

  CHECK_THROWS_AS(LfuDecayPolicy(0.0), Error);
  CHECK_THROWS_AS(LfuDecayPolicy(-1.0), Error);
  CHECK_THROWS_AS(LfuDecayPolicy(64.0, -1.0), Error);
}

TEST_CASE("LFU with a margin: no swaps on routing without favourites, hot experts still move in") {
  // Generated traces of qwen3-30b-a3b's shape, 2,000 tokens, a cache of 12.5%.
  TraceGenSpec spec = trace_preset("uniform");
  spec.n_tokens = 2000;
  spec.seed = 3;
  const RoutingTrace uni = generate_routing_trace(spec);
  spec = trace_preset("locality");
  spec.n_tokens = 2000;
  spec.seed = 3;
  const RoutingTrace loc = generate_routing_trace(spec);
  const int32_t cap = cache_capacity(0.125, 128);
  LfuDecayPolicy plain(64.0), held(64.0, 3.0);
  CHECK(held.name() == "lfu-decay(h=64,z=3)");
  const CacheSimResult u0 = simulate_cache(uni, plain, cap), u3 = simulate_cache(uni, held, cap);
  const CacheSimResult l0 = simulate_cache(loc, plain, cap), l3 = simulate_cache(loc, held, cap);
  MESSAGE("uniform: z=0 ", u0.loads_per_token(), " loads/token, z=3 ", u3.loads_per_token(),
          "; locality: z=0 ", l0.hit_rate(), " / ", l0.loads_per_token(), ", z=3 ", l3.hit_rate(),
          " / ", l3.loads_per_token());
  // Uniform: without the margin dozens of loads per token; with it little beyond the first fill
  // (48 layers x 16 slots).
  CHECK(u0.loads_per_token() > 20);
  CHECK(u3.loads < 48 * 16 + 200);
  // Locality: nearly the same hit rate at a small fraction of the loads.
  CHECK(l3.hit_rate() > l0.hit_rate() - 0.03);
  CHECK(l3.loads_per_token() < l0.loads_per_token() / 5);
}

TEST_CASE("cache capacity, coverage and the simulator's argument errors") {
  CHECK(cache_capacity(0.125, 128) == 16);
  CHECK(cache_capacity(0.25, 128) == 32);
  CHECK(cache_capacity(0.125, 60) == 8);  // 7.5 rounds up
  CHECK(cache_capacity(0.0, 128) == 0);
  CHECK(cache_capacity(2.0, 128) == 128);

  // Layer 0: expert 0 seven times, 1 twice, 2 once; layer 1: expert 3 always.
  RoutingTrace tr = make_trace(4, {{0}, {0}, {0}, {0}, {0}, {0}, {0}, {1}, {1}, {2}});
  tr.shape.n_layer = 2;
  tr.shape.blocks = {0, 1};
  std::vector<uint16_t> ids;
  for (uint16_t e : tr.ids) ids.insert(ids.end(), {e, 3});
  tr.ids = ids;
  CHECK(coverage_fraction(tr, 0.9) == std::vector<double>{0.5, 0.25});
  CHECK(coverage_fraction(tr, 1.0) == std::vector<double>{0.75, 0.25});
  CHECK(coverage_fraction(tr, 0.7) == std::vector<double>{0.25, 0.25});

  LruPolicy lru;
  CHECK_THROWS_AS(simulate_cache(tr, lru, 5), Error);
  CHECK_THROWS_AS(simulate_cache(tr, lru, -1), Error);
  CHECK_THROWS_AS(simulate_cache(tr, lru, 1, {.warmup_tokens = -1}), Error);
  try {
    (void)coverage_fraction(tr, 1.5);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::invalid_argument);
  }
  tr.kinds.clear();
  tr.ids.clear();
  CHECK_THROWS_AS((void)coverage_fraction(tr, 0.9), Error);
}
