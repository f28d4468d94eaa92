// The server's parts without HTTP: the text filter (UTF-8 hold-back, stop strings across
// tokens), the prefix cache over a state that cannot truncate (checkpoints), request parsing
// (every refusal names its field), the Generation queue, and bench serve's statistics.
#include <doctest/doctest.h>

#include <map>
#include <string>
#include <thread>
#include <vector>

#include "berth/core/error.h"
#include "berth/models/utf8.h"
#include "berth/server/api.h"
#include "berth/server/bench_serve.h"
#include "berth/server/engine.h"
#include "berth/server/sequence_state.h"
#include "berth/server/text_output.h"
#include "server_harness.h"

using namespace berth;
using namespace berth::server;
using json = nlohmann::json;

namespace {

// Pushes `pieces` one by one; returns every release (the flush last).
std::vector<std::string> run_filter(TextFilter& f, const std::vector<std::string>& pieces) {
  std::vector<std::string> out;
  for (const std::string& p : pieces) out.push_back(f.push(p));
  out.push_back(f.flush());
  return out;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += x;
  return s;
}

}  // namespace

TEST_CASE("TextFilter holds back an incomplete UTF-8 character until it is complete") {
  TextFilter f({});
  // "é" = C3 A9 and "😀" = F0 9F 98 80, split across tokens.
  const auto out = run_filter(f, {"ab\xC3", "\xA9 c", "\xF0\x9F", "\x98", "\x80!"});
  CHECK(out == std::vector<std::string>{"ab", "\xC3\xA9 c", "", "", "\xF0\x9F\x98\x80!", ""});
  for (const std::string& s : out) CHECK(utf8::is_valid(s));
}

TEST_CASE("TextFilter turns ill-formed bytes into U+FFFD and flushes a truncated character") {
  TextFilter f({});
  const auto out = run_filter(f, {"a\xFF", "b\xE2\x82"});
  CHECK(joined(out) ==
        "a\xEF\xBF\xBD"
        "b\xEF\xBF\xBD");
  CHECK(out.back() == "\xEF\xBF\xBD");  // the truncated character comes out only at the end
}

TEST_CASE("TextFilter: a stop string across tokens is never released, not even in part") {
  TextFilter f({"little girl"});
  const auto out = run_filter(f, {", there", " was", " a", " lit", "tle", " gi", "rl", " named"});
  CHECK(joined(out) == ", there was a ");
  CHECK(f.stopped());
  CHECK(f.stop_word() == "little girl");
  for (const std::string& s : out) CHECK(s.find("lit") == std::string::npos);
  // Nothing after the stop.
  CHECK(f.push(" more").empty());
  CHECK(f.flush().empty());
}

TEST_CASE("TextFilter: a stop string inside one token cuts the token's text") {
  TextFilter f({"ttle gi"});
  CHECK(joined(run_filter(f, {"a li", "ttle girl"})) == "a li");
  CHECK(f.stopped());
}

TEST_CASE("TextFilter releases held-back text once it cannot become a stop string") {
  TextFilter f({"Lily's dog", "\n\n"});
  const auto out = run_filter(f, {"named", " Lily", ". She", "\n", "Lily", "'s mom"});
  CHECK(out[1] == " ");  // " Lily" could start "Lily's dog": "Lily" waits
  CHECK(out[2] == "Lily. She");
  CHECK(out[3].empty());  // "\n" could start "\n\n"
  CHECK(joined(out) == "named Lily. She\nLily's mom");
  CHECK_FALSE(f.stopped());
}

TEST_CASE("TextFilter: the earliest stop string wins, the longest at the same place") {
  TextFilter f({"b", "abc", "ab"});
  CHECK(joined(run_filter(f, {"xxabc"})) == "xx");
  CHECK(f.stop_word() == "abc");
  // A complete stop string ends the text at once, even if a longer one might still complete.
  TextFilter h({"abc", "ab"});
  CHECK(joined(run_filter(h, {"xxab", "c"})) == "xx");
  CHECK(h.stop_word() == "ab");
  TextFilter g({"cd", "bc"});
  CHECK(joined(run_filter(g, {"abcd"})) == "a");
  CHECK(g.stop_word() == "bc");
}

TEST_CASE("TextFilter: a multi-byte stop string split inside a character") {
  TextFilter f({"\xC3\xA9t\xC3\xA9"});  // "été"
  const auto out = run_filter(f, {"l'", "\xC3", "\xA9t", "\xC3", "\xA9 chaud"});
  CHECK(joined(out) == "l'");
  CHECK(f.stopped());
}

// Pushes `pieces` one by one; returns n_released_pieces() after each (and after the flush, last).
std::vector<size_t> released_counts(TextFilter& f, const std::vector<std::string>& pieces) {
  std::vector<size_t> out;
  for (const std::string& p : pieces) {
    f.push(p);
    out.push_back(f.n_released_pieces());
  }
  f.flush();
  out.push_back(f.n_released_pieces());
  return out;
}

TEST_CASE("TextFilter counts the pieces whose text is released whole; a stop drops its pieces") {
  // The piece that straddles the stop string's start (" Lily": " Lil" before "y. She") is
  // dropped with the stop string's own pieces, as are those after it.
  TextFilter a({"y. She"});
  CHECK(released_counts(a, {", there", " named", " Lily", ".", " She", " more"}) ==
        std::vector<size_t>{1, 2, 2, 2, 2, 2, 2});
  // " Lily" starts with text before the stop string ("Lily"): still dropped.
  TextFilter b({"Lily"});
  CHECK(released_counts(b, {" girl", " named", " Lily", "."}) ==
        std::vector<size_t>{1, 2, 2, 2, 2});
  // A piece that ends where the stop string starts is released.
  TextFilter c({"ab"});
  CHECK(released_counts(c, {"x", "ab"}) == std::vector<size_t>{1, 1, 1});
  // Held-back text: " Lily" counts once "Lily" is known not to start "Lily's dog".
  TextFilter d({"Lily's dog"});
  CHECK(released_counts(d, {"named", " Lily", ". She", "Lily"}) ==
        std::vector<size_t>{1, 1, 3, 3, 4});
  // A character split across pieces: both count once it is complete; a truncated one at the
  // flush; ill-formed bytes (U+FFFD) count like text; an empty piece once what precedes is out.
  TextFilter e({});
  CHECK(released_counts(e, {"ab\xC3", "\xA9 c", "", "\xC3", "A", "x\xE2\x82"}) ==
        std::vector<size_t>{0, 2, 3, 3, 5, 5, 6});
  // A stop string inside a character's pieces: the pieces before it only.
  TextFilter f({"\xC3\xA9t\xC3\xA9"});
  CHECK(released_counts(f, {"l'", "\xC3", "\xA9t", "\xC3", "\xA9 chaud"}) ==
        std::vector<size_t>{1, 1, 1, 1, 1, 1});
}

namespace {

// A recurrent-like state: cannot truncate; save() snapshots (the position), restore() returns.
class SnapshotState : public SequenceState {
 public:
  int64_t n_past() const override { return n_; }
  bool can_truncate() const override { return false; }
  void truncate_to(int64_t n) override {
    if (n != 0 && n != n_) throw Error(ErrorCategory::unsupported, "cannot truncate");
    n_ = n;
  }
  Checkpoint save() override {
    ++saves;
    live[next_] = n_;
    return Checkpoint{n_, next_++};
  }
  void restore(const Checkpoint& cp) override {
    REQUIRE(live.count(cp.handle) == 1);
    REQUIRE(live[cp.handle] == cp.n_past);
    n_ = cp.n_past;
    ++restores;
  }
  void drop(const Checkpoint& cp) override { live.erase(cp.handle); }
  void advance(int64_t k) { n_ += k; }

  int saves = 0, restores = 0;
  std::map<uint64_t, int64_t> live;

 private:
  int64_t n_ = 0;
  uint64_t next_ = 1;
};

void eval(SnapshotState& st, SlotCache& c, const std::vector<int32_t>& prompt, int64_t from) {
  const std::vector<int32_t> rest(prompt.begin() + from, prompt.end());
  st.advance(static_cast<int64_t>(rest.size()));
  c.append(rest);
}

}  // namespace

TEST_CASE("SlotCache reuses a non-truncatable state through its checkpoints") {
  SnapshotState st;
  SlotCache cache(st, 2);
  const std::vector<int32_t> turn1 = {1, 10, 11, 12, 13};
  CHECK(cache.prepare(turn1, true) == 0);
  eval(st, cache, turn1, 0);
  cache.checkpoint();  // after the prompt
  // The reply: 3 tokens.
  const std::vector<int32_t> reply = {20, 21, 22};
  st.advance(3);
  cache.append(reply);
  CHECK(cache.tokens().size() == 8);

  // A prompt continuing exactly what the state holds needs nothing restored.
  std::vector<int32_t> turn2 = {1, 10, 11, 12, 13, 20, 21, 22, 30, 31};
  CHECK(cache.reuse(turn2).restorable == 8);
  CHECK(cache.prepare(turn2, true) == 8);
  CHECK(st.restores == 0);
  eval(st, cache, turn2, 8);
  cache.checkpoint();

  // A prompt that diverges after the first turn's prompt: back to that checkpoint (5 tokens).
  const std::vector<int32_t> retry = {1, 10, 11, 12, 13, 40, 41};
  // reuse() says so before and changes nothing (checkpoints at 5 and 10): a prompt sharing 7
  // tokens brings back 5 too, the latest checkpoint at or before 7; one diverging at 4, nothing.
  CHECK(cache.reuse(retry).shared == 5);
  CHECK(cache.reuse(retry).restorable == 5);
  const SlotCache::PrefixReuse seven =
      cache.reuse(std::vector<int32_t>{1, 10, 11, 12, 13, 20, 21, 50});
  CHECK(seven.shared == 7);
  CHECK(seven.restorable == 5);
  const SlotCache::PrefixReuse four = cache.reuse(std::vector<int32_t>{1, 10, 11, 12, 50, 51});
  CHECK(four.shared == 4);
  CHECK(four.restorable == 0);
  CHECK(cache.reuse(std::vector<int32_t>{}).shared == 0);
  CHECK(cache.reuse(std::vector<int32_t>{}).restorable == 0);
  CHECK(st.restores == 0);
  CHECK(st.n_past() == 10);
  CHECK(cache.prepare(retry, true) == 5);
  CHECK(st.restores == 1);
  CHECK(st.n_past() == 5);
  CHECK(cache.tokens() == std::vector<int32_t>(turn1.begin(), turn1.end()));
  // The checkpoint past 5 (at 10 tokens) described tokens now overwritten: dropped.
  CHECK(st.live.size() == 1);
  eval(st, cache, retry, 5);

  // Diverging before every checkpoint: from scratch.
  const std::vector<int32_t> other = {1, 99, 98};
  CHECK(cache.prepare(other, true) == 0);
  CHECK(st.n_past() == 0);
  CHECK(st.live.empty());
  eval(st, cache, other, 0);
  // cache_prompt false never reuses.
  CHECK(cache.prepare(other, false) == 0);
}

TEST_CASE(
    "SlotCache always leaves the last prompt token to evaluate and keeps at most N "
    "checkpoints") {
  SnapshotState st;
  SlotCache cache(st, 2);
  std::vector<int32_t> p = {1, 2, 3};
  cache.prepare(p, true);
  eval(st, cache, p, 0);
  for (int i = 0; i < 4; ++i) {
    cache.checkpoint();
    p.push_back(10 + i);
    CHECK(cache.prepare(p, true) == static_cast<int64_t>(p.size()) - 1);
    eval(st, cache, p, static_cast<int64_t>(p.size()) - 1);
  }
  CHECK(st.live.size() == 2);
  // The same prompt again: its last token is re-evaluated from the latest usable checkpoint.
  const int64_t n = cache.prepare(p, true);
  CHECK(n < static_cast<int64_t>(p.size()));
  CHECK(n == st.n_past());
}

namespace {

struct ParseFixture {
  test::LoadedModel m{test::stories260k().string()};
  CompletionRequest parse(const json& j, Endpoint e = Endpoint::completions) {
    return parse_completion(j, e, m.ctx);
  }
  // The message of the ApiError parse() throws (or "" when it does not throw).
  std::string refusal(const json& j, Endpoint e = Endpoint::completions) {
    try {
      parse(j, e);
    } catch (const ApiError& err) {
      CHECK(err.status == 400);
      CHECK(err.type == "invalid_request_error");
      return err.message;
    }
    return "";
  }
};

}  // namespace

TEST_CASE_FIXTURE(ParseFixture, "parse_completion: fields, defaults and token limits") {
  CompletionRequest r = parse({{"prompt", "Once upon a time"}});
  CHECK(r.gen.prompt == std::vector<int32_t>{1, 403, 407, 261, 378});
  CHECK(r.gen.max_tokens == -1);
  CHECK(r.gen.sampling.sampler.temp == doctest::Approx(0.8));
  CHECK(r.gen.sampling.sampler.seed == 0xFFFFFFFFu);
  CHECK(r.gen.cache_prompt);
  CHECK_FALSE(r.stream);
  r = parse({{"prompt", {1, 403}},
             {"max_tokens", 5},
             {"max_completion_tokens", 7},
             {"temperature", 0},
             {"seed", 42},
             {"stop", "x"},
             {"stream", true},
             {"stream_options", {{"include_usage", true}}},
             {"top_k", 3},
             {"top_p", 0.5},
             {"min_p", 0},
             {"presence_penalty", 1.5},
             {"frequency_penalty", -0.5},
             {"repeat_penalty", 1.1},
             {"cache_prompt", false},
             {"logprobs", 3}});
  CHECK(r.gen.prompt == std::vector<int32_t>{1, 403});
  CHECK(r.gen.max_tokens == 7);  // max_completion_tokens wins
  CHECK(r.gen.sampling.sampler.temp == 0);
  CHECK(r.gen.sampling.sampler.seed == 42);
  CHECK(r.stop == std::vector<std::string>{"x"});
  CHECK(r.stream);
  CHECK(r.include_usage);
  CHECK(r.gen.sampling.sampler.top_k == 3);
  CHECK(r.gen.sampling.presence_penalty == doctest::Approx(1.5));
  CHECK(r.gen.sampling.frequency_penalty == doctest::Approx(-0.5));
  CHECK_FALSE(r.gen.cache_prompt);
  CHECK(r.logprobs);
  CHECK(r.top_logprobs == 3);
  // null counts as absent; n_predict 0 is kept (no tokens at all).
  r = parse({{"prompt", "a"}, {"temperature", nullptr}, {"n_predict", 0}});
  CHECK(r.gen.sampling.sampler.temp == doctest::Approx(0.8));
  CHECK(r.gen.max_tokens == 0);
  // [["ids"]] and ["text"] hold one prompt.
  CHECK(parse({{"prompt", json::array({json::array({1, 2})})}}).gen.prompt ==
        std::vector<int32_t>{1, 2});
  CHECK(parse({{"prompt", json::array({"Once"})}}).gen.prompt.size() >= 2);
}

TEST_CASE_FIXTURE(ParseFixture, "parse_completion refuses bad fields, naming them") {
  CHECK(refusal({{"max_tokens", 3}}).find("'prompt' is required") != std::string::npos);
  CHECK(refusal({{"prompt", 5}}).find("'prompt'") != std::string::npos);
  CHECK(refusal({{"prompt", json::array({"a", "b"})}}).find("several prompts") !=
        std::string::npos);
  CHECK(refusal({{"prompt", json::array({nullptr})}}) ==
        "'prompt[0]' must be a token id (an integer), got null");
  CHECK(refusal({{"prompt", json::array({3, nullptr})}}) ==
        "'prompt[1]' must be a token id (an integer), got null");
  CHECK(refusal({{"prompt", {1, 99999}}}).find("'prompt[1]' = 99999") != std::string::npos);
  CHECK(refusal({{"prompt", {1, -3}}}).find("'prompt[1]'") != std::string::npos);
  CHECK(refusal({{"prompt", {1, 2.5}}}).find("'prompt[1]'") != std::string::npos);
  CHECK(refusal({{"prompt", json::array()}}).find("empty") != std::string::npos);
  CHECK(refusal({{"prompt", "a"}, {"temperature", "hot"}}).find("'temperature' must be a number") !=
        std::string::npos);
  CHECK(refusal({{"prompt", "a"}, {"temperature", -1}}).find("'temperature'") != std::string::npos);
  CHECK(refusal({{"prompt", "a"}, {"top_p", 1.5}}).find("'top_p'") != std::string::npos);
  CHECK(refusal({{"prompt", "a"}, {"max_tokens", -2}}).find("'max_tokens'") != std::string::npos);
  CHECK(refusal({{"prompt", "a"}, {"max_tokens", 2.5}}).find("'max_tokens'") != std::string::npos);
  CHECK(refusal({{"prompt", "a"}, {"max_tokens", "10"}}).find("'max_tokens' must be an integer") !=
        std::string::npos);
  CHECK(refusal({{"prompt", "a"}, {"seed", -5}}).find("'seed'") != std::string::npos);
  CHECK(refusal({{"prompt", "a"}, {"stream", "yes"}}).find("'stream' must be true or false") !=
        std::string::npos);
  CHECK(refusal({{"prompt", "a"}, {"stop", json::array({"ok", 3})}}).find("'stop[1]'") !=
        std::string::npos);
  CHECK(refusal({{"prompt", "a"}, {"stop", ""}}).find("'stop' is an empty string") !=
        std::string::npos);
  CHECK(refusal({{"prompt", "a"}, {"n", 2}}).find("'n' must be 1") != std::string::npos);
  CHECK(refusal({{"prompt", "a"}, {"presence_penalty", 3}}).find("'presence_penalty'") !=
        std::string::npos);
  CHECK(refusal({{"prompt", "a"}, {"logprobs", 9}}).find("'logprobs'") != std::string::npos);
  CHECK(refusal({{"prompt", "a"}, {"stream_options", 1}}).find("'stream_options'") !=
        std::string::npos);
  CHECK(refusal({{"prompt", "a"}, {"echo", true}}).find("'echo'") != std::string::npos);
}

TEST_CASE_FIXTURE(ParseFixture, "chat messages: roles, content parts, refusals by index") {
  const auto chat = Endpoint::chat;
  CompletionRequest r = parse(
      {{"messages",
        {{{"role", "developer"}, {"content", "Be brief."}},
         {{"role", "user"},
          {"content", {{{"type", "text"}, {"text", "Hi"}}, {{"type", "text"}, {"text", "!"}}}}}}}},
      chat);
  CHECK(r.gen.prompt.front() == m.tok->bos_id());
  CHECK(m.tok->decode(r.gen.prompt).find("Hi!") != std::string::npos);
  CHECK(refusal({{"model", "x"}}, chat).find("'messages' is required") != std::string::npos);
  CHECK(refusal({{"messages", json::array()}}, chat).find("'messages' is empty") !=
        std::string::npos);
  CHECK(refusal({{"messages", "hi"}}, chat).find("'messages' must be an array") !=
        std::string::npos);
  CHECK(refusal({{"messages", {{{"role", "user"}}}}}, chat).find("'messages[0].content'") !=
        std::string::npos);
  CHECK(refusal({{"messages",
                  {{{"role", "user"}, {"content", "a"}}, {{"role", "robot"}, {"content", "b"}}}}},
                chat)
            .find("'messages[1].role'") != std::string::npos);
  CHECK(
      refusal({{"messages",
                {{{"role", "user"}, {"content", {{{"type", "image_url"}, {"image_url", "x"}}}}}}}},
              chat)
          .find("'messages[0].content[0]'") != std::string::npos);
  // A system message after the first: its own turn in chatml, a refusal where the format folds
  // the system prompt into the first turn (mistral).
  const json late_system = {
      {"messages", {{{"role", "user"}, {"content", "a"}}, {{"role", "system"}, {"content", "b"}}}}};
  CHECK(refusal(late_system, chat).empty());
  m.ctx.chat_format = ChatFormat::mistral;
  CHECK(refusal(late_system, chat).find("'messages'") != std::string::npos);
  m.ctx.chat_format = ChatFormat::chatml;
  CHECK(refusal({{"messages", {{{"role", "user"}, {"content", "a"}}}},
                 {"tools", {{{"type", "function"}}}}},
                chat)
            .find("'tools'") != std::string::npos);
  CHECK(refusal({{"messages", {{{"role", "user"}, {"content", "a"}}}},
                 {"response_format", {{"type", "json_object"}}}},
                chat)
            .find("'response_format'") != std::string::npos);
  CHECK(refusal({{"messages", {{{"role", "user"}, {"content", "a"}}}}, {"top_logprobs", 2}}, chat)
            .find("'top_logprobs' needs 'logprobs'") != std::string::npos);
}

TEST_CASE("parse_body names a syntax error and refuses a non-object") {
  try {
    parse_body("{\"a\": ");
    FAIL("no error");
  } catch (const ApiError& e) {
    CHECK(e.status == 400);
    CHECK(e.message.find("not valid JSON") != std::string::npos);
    CHECK(e.message.find("column") != std::string::npos);
  }
  try {
    parse_body("[1, 2]");
    FAIL("no error");
  } catch (const ApiError& e) {
    CHECK(e.message.find("must be a JSON object, got array") != std::string::npos);
  }
}

TEST_CASE("Generation hands tokens over once and wakes a waiting consumer") {
  Generation g(7);
  std::thread producer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    g.start(1, 3, 0.5);
    g.push(GeneratedToken{5});
    g.push(GeneratedToken{6});
    GenerationTimings t;
    t.n_predicted = 2;
    g.finish(FinishReason::length, t);
  });
  std::vector<int32_t> got;
  bool done = false;
  int32_t slot = -1;
  for (int i = 0; i < 200 && !done; ++i) {
    GenerationUpdate u = g.wait(std::chrono::milliseconds(50));
    for (const GeneratedToken& t : u.tokens) got.push_back(t.id);
    if (u.started) slot = u.slot;
    done = u.done;
    if (done) CHECK(u.finish == FinishReason::length);
  }
  producer.join();
  CHECK(done);
  CHECK(slot == 1);
  CHECK(got == std::vector<int32_t>{5, 6});
  CHECK(g.wait(std::chrono::milliseconds(1)).tokens.empty());
  CHECK_FALSE(g.cancelled());
  g.cancel();
  CHECK(g.cancelled());
}

TEST_CASE("bench serve's engine means: one computation for the printed line and the JSON") {
  EngineMetrics m;
  m.decode_steps_total = 4;
  m.decode_rows_total = 10;
  m.decode_step_seconds_total = 0.01;
  m.decode_intervals_total = 3;
  m.decode_interval_seconds_total = 0.009;
  const EngineStepMeans e = engine_step_means(m);
  CHECK(e.decode_steps == 4);
  CHECK(e.rows_per_step == 2.5);
  CHECK(e.forward_ms == doctest::Approx(2.5));
  CHECK(e.interval_ms == doctest::Approx(3.0));
  CHECK(format_text(e) ==
        "engine: 4 decode steps of 2.50 rows (means: forward 2.50 ms, start to next start "
        "3.00 ms)\n");
  CHECK(to_json(e) == json{{"decode_steps", 4},
                           {"decode_rows_per_step", 2.5},
                           {"decode_step_ms", e.forward_ms},
                           {"decode_interval_ms", e.interval_ms}});
  // Between two reads of the counters: only the steps counted in between.
  EngineMetrics later = m;
  later.decode_steps_total += 2;
  later.decode_rows_total += 8;
  later.decode_step_seconds_total += 0.006;
  later.decode_intervals_total += 2;
  later.decode_interval_seconds_total += 0.007;
  const EngineStepMeans d = engine_step_means(later, m);
  CHECK(d.decode_steps == 2);
  CHECK(d.rows_per_step == 4.0);
  CHECK(d.forward_ms == doctest::Approx(3.0));
  CHECK(d.interval_ms == doctest::Approx(3.5));
  // No decode step yet: zeros, not NaN.
  const EngineStepMeans none = engine_step_means(EngineMetrics{});
  CHECK(format_text(none) ==
        "engine: 0 decode steps of 0.00 rows (means: forward 0.00 ms, start to next start "
        "0.00 ms)\n");
  CHECK(to_json(none)["decode_interval_ms"] == 0.0);
}

TEST_CASE("bench serve's per-request rates: the nearest-rank median and the mean beside it") {
  auto request = [](double rate, double ttft_ms, int64_t n_tokens) {
    ServeRequestSamples s;
    s.ok = true;
    s.n_tokens = n_tokens;
    s.ttft_ms = ttft_ms;
    if (rate > 0) s.itl_ms.assign(static_cast<size_t>(n_tokens - 1), 1000.0 / rate);
    s.decode_tok_s = rate;
    return s;
  };
  std::vector<std::vector<ServeRequestSamples>> per_client(2);
  per_client[0] = {request(10, 5, 4), request(20, 6, 4)};
  per_client[1] = {request(30, 7, 4), request(100, 8, 4)};
  ServeRequestSamples failed = request(50, 1, 3);  // in the counts, in no statistic
  failed.ok = false;
  failed.error = "HTTP 503: busy";
  per_client[1].push_back(failed);
  ServeRequestSamples one = request(0, 9, 1);  // one token: no rate
  per_client[0].push_back(one);
  const ServeBenchResult r = summarize_serve_bench(per_client, 2.0);
  CHECK(r.n_clients == 2);
  CHECK(r.n_requests == 6);
  CHECK(r.n_failed == 1);
  CHECK(r.n_tokens == 4 * 4 + 3 + 1);
  CHECK(r.first_error == "HTTP 503: busy");
  CHECK(r.aggregate_tok_s == 10.0);
  CHECK(r.per_request_tok_s == 20.0);       // rates 10, 20, 30, 100: the lower middle one
  CHECK(r.per_request_tok_s_mean == 40.0);  // (10 + 20 + 30 + 100) / 4
  CHECK(r.ttft_p50_ms == 7.0);              // 5, 6, 7, 8, 9: the middle one
  CHECK(r.itl_p50_ms == doctest::Approx(1000.0 / 30));  // 3 gaps each of 100, 50, 33.3, 10 ms
  const json j = to_json(r);
  CHECK(j["per_request_tok_s"] == 20.0);
  CHECK(j["per_request_tok_s_mean"] == 40.0);
  CHECK(format_text(r).find("aggregate 10.0 tok/s | per request 20.0 tok/s (median), 40.0 "
                            "(mean)\n") != std::string::npos);
  // No request with a rate: zeros.
  const ServeBenchResult none = summarize_serve_bench({{one}}, 1.0);
  CHECK(none.per_request_tok_s == 0.0);
  CHECK(none.per_request_tok_s_mean == 0.0);
}

TEST_CASE_FIXTURE(ParseFixture, "parse_completion: logit_bias as an object or [id, bias] pairs") {
  using Bias = std::vector<std::pair<int32_t, float>>;
  CHECK(parse({{"prompt", "a"}}).gen.sampling.logit_bias.empty());
  CHECK(parse({{"prompt", "a"}, {"logit_bias", nullptr}}).gen.sampling.logit_bias.empty());
  CHECK(parse({{"prompt", "a"}, {"logit_bias", json::object()}}).gen.sampling.logit_bias.empty());
  CHECK(parse({{"prompt", "a"}, {"logit_bias", {{"378", -100}, {"13", 2.5}, {"0", 100}}}})
            .gen.sampling.logit_bias == Bias{{0, 100.0f}, {13, 2.5f}, {378, -100.0f}});
  CHECK(parse({{"prompt", "a"}, {"logit_bias", {{378, false}, {13, -1}, {378, 3}}}})
            .gen.sampling.logit_bias == Bias{{378, -INFINITY}, {13, -1.0f}, {378, 3.0f}});
  CHECK(parse({{"prompt", "a"}, {"logit_bias", {{"511", 0}}}}, Endpoint::native)
            .gen.sampling.logit_bias == Bias{{511, 0.0f}});
  CHECK(parse({{"messages", {{{"role", "user"}, {"content", "a"}}}}, {"logit_bias", {{"7", 1}}}},
              Endpoint::chat)
            .gen.sampling.logit_bias == Bias{{7, 1.0f}});

  auto why = [&](const json& bias) { return refusal({{"prompt", "a"}, {"logit_bias", bias}}); };
  CHECK(why({{"abc", 1}}) == "'logit_bias' key \"abc\" is not a token id (an integer)");
  CHECK(why({{"37.5", 1}}) == "'logit_bias' key \"37.5\" is not a token id (an integer)");
  CHECK(why({{"", 1}}) == "'logit_bias' key \"\" is not a token id (an integer)");
  CHECK(why({{"512", 1}}) == "'logit_bias' key \"512\" is outside the vocabulary of 512 tokens");
  CHECK(why({{"-1", 1}}) == "'logit_bias' key \"-1\" is outside the vocabulary of 512 tokens");
  CHECK(why({{"99999999999999999999999", 1}}) ==
        "'logit_bias' key \"99999999999999999999999\" is outside the vocabulary of 512 tokens");
  CHECK(why({{"378", "x"}}) ==
        "'logit_bias[\"378\"]' must be a number in [-100, 100] or false, got \"x\"");
  CHECK(why({{"378", 100.5}}) ==
        "'logit_bias[\"378\"]' must be a number in [-100, 100] or false, got 100.5");
  CHECK(why({{"378", true}}) ==
        "'logit_bias[\"378\"]' must be a number in [-100, 100] or false, got true");
  CHECK(why({{"378", nullptr}}) ==
        "'logit_bias[\"378\"]' must be a number in [-100, 100] or false, got null");
  CHECK(why(json::array({378})) == "'logit_bias[0]' must be a [token id, bias] pair, got 378");
  CHECK(why({{1, 2, 3}}) == "'logit_bias[0]' must be a [token id, bias] pair, got an array of 3");
  CHECK(why(json::array({json::array({"a", 1})})) ==
        "'logit_bias[0][0]' must be a token id (an integer), got \"a\"");
  CHECK(why(json::array({json::array({1.5, 1})})) ==
        "'logit_bias[0][0]' must be a token id (an integer), got 1.5");
  CHECK(why(json::array({json::array({5, 1}), json::array({512, 1})})) ==
        "'logit_bias[1][0]' = 512 is outside the vocabulary of 512 tokens");
  CHECK(why(json::array({json::array({-3, 1})})) ==
        "'logit_bias[0][0]' = -3 is outside the vocabulary of 512 tokens");
  CHECK(why(json::array({json::array({5, -101})})) ==
        "'logit_bias[0][1]' must be a number in [-100, 100] or false, got -101");
  CHECK(why("378") ==
        "'logit_bias' must be an object of token ids to biases or an array of [token id, bias] "
        "pairs, got \"378\"");
  // Every token banned (the last one twice, in both forms): nothing could be sampled. One left
  // open, or every one pushed down by a number, is fine.
  json all = json::array(), all_but_one = json::array(), all_low = json::object();
  for (int id = 0; id < 512; ++id) {
    all.push_back(json::array({id, false}));
    if (id != 77) all_but_one.push_back(json::array({id, false}));
    all_low[std::to_string(id)] = -100;
  }
  all.push_back(json::array({511, false}));
  CHECK(why(all) ==
        "'logit_bias' bans every token of the vocabulary (512): nothing can be sampled");
  all_but_one.push_back(json::array({5, false}));
  CHECK(why(all_but_one).empty());
  CHECK(why(all_low).empty());
}

TEST_CASE("url_host: an IPv6 address in brackets") {
  CHECK(url_host("127.0.0.1") == "127.0.0.1");
  CHECK(url_host("localhost") == "localhost");
  CHECK(url_host("::1") == "[::1]");
  CHECK(url_host("fe80::1%eth0") == "[fe80::1%eth0]");
}

TEST_CASE_FIXTURE(ParseFixture,
                  "parse_completion refuses grammar and json_schema on every endpoint") {
  const json chat_msgs = {{{"role", "user"}, {"content", "a"}}};
  for (const Endpoint e : {Endpoint::chat, Endpoint::completions, Endpoint::native}) {
    CAPTURE(static_cast<int>(e));
    const json base = e == Endpoint::chat ? json{{"messages", chat_msgs}} : json{{"prompt", "a"}};
    auto with = [&](const char* key, const json& v) {
      json b = base;
      b[key] = v;
      return b;
    };
    const std::string grammar = "'grammar' is not supported: berth has no constrained decoding";
    const std::string schema = "'json_schema' is not supported: berth has no constrained decoding";
    CHECK(refusal(with("grammar", "root ::= \"yes\" | \"no\""), e) == grammar);
    CHECK(refusal(with("grammar", 3), e) == grammar);
    CHECK(refusal(with("json_schema", {{"type", "object"}}), e) == schema);
    CHECK(refusal(with("json_schema", json::object()), e) == schema);
    // Null is absent; an empty grammar is none (llama-server's default).
    CHECK(refusal(with("grammar", nullptr), e).empty());
    CHECK(refusal(with("grammar", ""), e).empty());
    CHECK(refusal(with("json_schema", nullptr), e).empty());
  }
}
