// The prefix cache over a recurrent model (Qwen3.5: Gated DeltaNet layers whose state cannot be
// cut back): RecurrentSequenceState's checkpoints restore a sequence's whole state bit for bit,
// so a prompt that diverges after a checkpoint continues exactly as a fresh evaluation does.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <filesystem>
#include <string>
#include <vector>

#include "berth/core/error.h"
#include "berth/io/gguf.h"
#include "berth/models/model.h"
#include "berth/runtime/kv_cache.h"
#include "berth/runtime/session.h"
#include "berth/server/sequence_state.h"
#include "berth/tools/synth.h"
#include "test_util.h"

using namespace berth;
using namespace berth::server;

TEST_CASE("RecurrentSequenceState: a restored checkpoint continues as a fresh evaluation does") {
  SynthSpec spec = synth_preset("tiny-qwen35");
  spec.type = "f32";
  spec.seed = 3;
  const auto path = test::temp_dir("recurrent-state") / "tiny-qwen35.gguf";
  if (!std::filesystem::exists(path)) write_synth_model(spec, path.string(), 2);
  gguf::File f = gguf::File::open(path.string());
  std::unique_ptr<Model> m = load_model(f);
  SessionParams sp;
  sp.n_threads = 2;
  sp.n_ctx = 64;
  sp.n_seq = 2;
  Session s(*m, sp);
  const int32_t seq = s.kv().acquire();
  // Evaluates toks at positions pos0.. of sequence q; the last row's logits.
  auto eval = [&](int32_t q, const std::vector<int32_t>& toks, int32_t pos0) {
    std::vector<int32_t> pos(toks.size()), seqs(toks.size(), q);
    for (size_t i = 0; i < toks.size(); ++i) pos[i] = pos0 + static_cast<int32_t>(i);
    std::span<const float> l = s.eval_step(toks, pos, seqs, 1);
    return std::vector<float>(l.begin(), l.end());
  };
  RecurrentSequenceState st(64, s.kv(), seq);
  CHECK_FALSE(st.can_truncate());
  {
    SlotCache cache(st, 2);
    const std::vector<int32_t> turn1 = {5, 17, 300, 42, 9, 77, 8, 600};
    REQUIRE(cache.prepare(turn1, true) == 0);
    eval(seq, turn1, 0);
    st.advance(8);
    cache.append(turn1);
    cache.checkpoint();
    CHECK(st.n_saved() == 1);
    const std::vector<int32_t> reply = {11, 12, 13};
    eval(seq, reply, 8);
    st.advance(3);
    cache.append(reply);
    // Cutting back to 5 cannot be done; staying or going to 0 can.
    CHECK_THROWS_AS(st.truncate_to(5), Error);
    // A prompt diverging after turn1: back to the checkpoint at 8, then the new tail.
    std::vector<int32_t> retry = turn1;
    retry.insert(retry.end(), {40, 41, 44});
    REQUIRE(cache.prepare(retry, true) == 8);
    CHECK(st.n_past() == 8);
    const std::vector<int32_t> tail(retry.begin() + 8, retry.end());
    const std::vector<float> got = eval(seq, tail, 8);
    // Fresh: another sequence (zeroed when acquired) evaluates the same chunks.
    const int32_t other = s.kv().acquire();
    eval(other, turn1, 0);
    CHECK(got == eval(other, tail, 8));
    // Staying where it is and going back to 0 work.
    RecurrentSequenceState st2(64, s.kv(), other);
    st2.advance(11);
    CHECK_NOTHROW(st2.truncate_to(11));
    st2.truncate_to(0);
    CHECK(st2.n_past() == 0);
  }
  CHECK(st.n_saved() == 0);  // the cache dropped its checkpoints
}
