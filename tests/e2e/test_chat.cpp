// Multi-turn chat on the real stories260K model (SPM vocabulary, no chat template: ChatML
// markup is plain text for it, which is fine for counting): each turn prefills only what the
// KV cache lacks, and the replies equal those of a fresh session that prefills the whole
// conversation at once. Then `berth run --chat` through the CLI.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "berth/io/gguf.h"
#include "berth/models/chat.h"
#include "berth/models/model.h"
#include "berth/models/tokenizer.h"
#include "berth/runtime/chat.h"
#include "berth/runtime/session.h"
#include "berth/tools/synth.h"
#include "test_util.h"

using namespace berth;
using Ids = std::vector<int32_t>;

namespace {

const std::vector<std::string> kTurns = {"Tell me about a cat.", "What did the cat do next?",
                                         "Why was Lily sad?"};
const std::string kSystem = "You tell short stories.";
constexpr int32_t kPredict = 24;

SamplerParams greedy() {
  SamplerParams p;
  p.temp = 0;
  return p;
}

bool starts_with(const Ids& a, const Ids& prefix) {
  return a.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), a.begin());
}

struct Loaded {
  gguf::File file = gguf::File::open(test::stories260k().string());
  std::unique_ptr<Model> model = load_model(file);
  std::unique_ptr<Tokenizer> tok = Tokenizer::from_gguf(file);
};

/// Prefill/reuse counts and replies of the 3-turn conversation run through ChatSession.
struct ChatRun {
  std::vector<int64_t> prefilled, reused;
  std::vector<std::string> replies;
};

ChatRun run_chat(Loaded& m, const std::vector<std::string>& turns, int32_t n_predict) {
  Session s(*m.model, SessionParams{.n_threads = 1, .n_ctx = 512, .n_ubatch = 512});
  Sampler sampler(greedy(), m.tok->n_vocab());
  ChatSession chat(s, *m.tok, sampler, ChatFormat::chatml, kSystem);
  ChatRun r;
  for (const std::string& t : turns) {
    r.replies.push_back(chat.respond(t, n_predict));
    r.prefilled.push_back(chat.n_prefilled_last());
    r.reused.push_back(chat.last_turn().n_reused);
  }
  return r;
}

}  // namespace

TEST_CASE("ChatSession prefills only the new tokens and matches a fresh full prefill") {
  Loaded m;
  Session s(*m.model, SessionParams{.n_threads = 1, .n_ctx = 512, .n_ubatch = 512});
  Sampler sampler(greedy(), m.tok->n_vocab());
  ChatSession chat(s, *m.tok, sampler, ChatFormat::chatml, kSystem);

  std::vector<Ids> prompts, replies;
  std::vector<StopReason> stops;
  int64_t total = 0;
  for (size_t turn = 0; turn < kTurns.size(); ++turn) {
    CAPTURE(turn);
    const Ids cache_before = chat.cache_tokens();
    const Ids conversation_before = chat.render_tokens(false);
    CHECK(static_cast<int64_t>(cache_before.size()) == s.n_past());

    std::string streamed;
    const std::string reply =
        chat.respond(kTurns[turn], kPredict, [&](int32_t, std::string_view text) {
          streamed += text;
          return true;
        });
    CHECK(reply == streamed);
    const ChatTurnStats& st = chat.last_turn();

    // The rendered prompt of this turn: the conversation after it, cut before the reply.
    const Ids after = chat.render_tokens(false);
    REQUIRE(st.n_rendered <= static_cast<int64_t>(after.size()));
    const Ids prompt(after.begin(), after.begin() + st.n_rendered);
    const Ids& reply_ids = chat.last_reply_tokens();
    CHECK(Ids(after.begin() + st.n_rendered,
              after.begin() + st.n_rendered + static_cast<ptrdiff_t>(reply_ids.size())) ==
          reply_ids);
    CHECK(m.tok->decode(reply_ids) == reply);
    CHECK(!reply_ids.empty());

    // Earlier turns render the same tokens (replies as generated): only appending.
    CHECK(starts_with(prompt, conversation_before));
    // Everything the cache held is reused, and exactly the rest is prefilled.
    CHECK(starts_with(prompt, cache_before));
    CHECK(st.n_reused == static_cast<int64_t>(cache_before.size()));
    CHECK(st.n_prefilled == st.n_rendered - static_cast<int64_t>(cache_before.size()));
    CHECK(st.gen.n_prompt == st.n_prefilled);
    if (turn > 0) {
      // The cache held all earlier turns: the previous prompt and its reply, except the last
      // reply token when the reply was cut by -n (a sampled token is fed back only when
      // generation goes on). New tokens: that token, the end-of-turn markup, the new user turn.
      const int64_t earlier = static_cast<int64_t>(prompts.back().size() + replies.back().size());
      CHECK(st.n_reused == earlier - (stops.back() == StopReason::n_predict ? 1 : 0));
    } else {
      CHECK(st.n_reused == 0);
      CHECK(st.n_prefilled == st.n_rendered);
    }
    total += st.n_prefilled;
    CHECK(chat.n_prefilled_total() == total);
    CHECK(static_cast<int64_t>(chat.cache_tokens().size()) == s.n_past());
    prompts.push_back(prompt);
    replies.push_back(reply_ids);
    stops.push_back(st.gen.stop);
  }
  CHECK(chat.n_turns() == 3);
  CHECK(chat.messages().size() == 7);  // system + 3 x (user, assistant)

  // A fresh session that prefills each whole conversation at once generates the same tokens.
  for (size_t turn = 0; turn < prompts.size(); ++turn) {
    CAPTURE(turn);
    Session fresh(*m.model, SessionParams{.n_threads = 1, .n_ctx = 512, .n_ubatch = 512});
    Sampler fresh_sampler(greedy(), m.tok->n_vocab());
    Ids got;
    const GenerateStats gs = generate(fresh, *m.tok, fresh_sampler, prompts[turn], kPredict,
                                      [&](int32_t id, std::string_view) {
                                        if (id >= 0) got.push_back(id);
                                        return true;
                                      });
    CHECK(gs.n_prompt == static_cast<int64_t>(prompts[turn].size()));
    CHECK(got == replies[turn]);
  }
}

TEST_CASE("ChatSession: a conversation too long for the context is refused and not recorded") {
  Loaded m;
  Session s(*m.model, SessionParams{.n_threads = 1, .n_ctx = 64, .n_ubatch = 512});
  Sampler sampler(greedy(), m.tok->n_vocab());
  ChatSession chat(s, *m.tok, sampler, ChatFormat::chatml);
  try {
    chat.respond(std::string(200, 'a'), 4);
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::invalid_argument);
    CHECK(std::string(e.what()).find("context of 64 tokens") != std::string::npos);
  }
  CHECK(chat.n_turns() == 0);
  CHECK(chat.messages().empty());
  // A short turn still works afterwards.
  chat.respond("Hi", 4);
  CHECK(chat.n_turns() == 1);
  CHECK(static_cast<int64_t>(chat.cache_tokens().size()) == s.n_past());
}

TEST_CASE("berth run --chat streams one reply per stdin line and reports per-turn prefill") {
  Loaded m;
  const ChatRun expect = run_chat(m, {kTurns[0], kTurns[1]}, 16);
  const std::string base = test::berth_bin() + " run -m " +
                           test::shell_quote(test::stories260k().string()) +
                           " --chat --chat-template chatml -n 16 --temp 0 -t 1 --system-prompt " +
                           test::shell_quote(kSystem);
  const std::string counts =
      fmt::format("prefilled tokens per turn: {}, {} (total {}", expect.prefilled[0],
                  expect.prefilled[1], expect.prefilled[0] + expect.prefilled[1]);
  const std::string reused =
      fmt::format("reused from the KV cache per turn: 0, {} ", expect.reused[1]);
  const std::string out = expect.replies[0] + "\n" + expect.replies[1] + "\n";

  SUBCASE("two lines on stdin") {
    const test::CommandResult r =
        test::run_command("printf '%s\\n%s\\n' " + test::shell_quote(kTurns[0]) + " " +
                          test::shell_quote(kTurns[1]) + " | " + base);
    CHECK_FALSE(r.signaled);
    CHECK(r.exit_code == 0);
    CHECK(r.out == out);
    CHECK(r.err.find("2 turns") != std::string::npos);
    CHECK(r.err.find(counts) != std::string::npos);
    CHECK(r.err.find(reused) != std::string::npos);
    CHECK(r.err.find("> ") == std::string::npos);  // no prompt when stdin is not a terminal
  }
  SUBCASE("-p is the first user message; /exit ends the chat") {
    const test::CommandResult r =
        test::run_command("printf '%s\\n\\n/exit\\nnot read\\n' " + test::shell_quote(kTurns[1]) +
                          " | " + base + " -p " + test::shell_quote(kTurns[0]));
    CHECK(r.exit_code == 0);
    CHECK(r.out == out);
    CHECK(r.err.find(counts) != std::string::npos);
  }
  SUBCASE("a model without a chat template needs --chat-template") {
    const test::CommandResult r =
        test::run_command(test::berth_bin() + " run -m " +
                          test::shell_quote(test::stories260k().string()) + " --chat");
    CHECK(r.exit_code == 1);
    CHECK(r.err.find("--chat-template NAME") != std::string::npos);
    CHECK(r.out.empty());
  }
}

TEST_CASE(
    "berth run --chat on a synthetic Qwen3 file with Qwen3's real vocabulary reuses earlier "
    "turns") {
  // A 2-layer qwen3 with the real 151,936-token vocabulary and Qwen3's chat template (written
  // by berth's generator). Its replies are random text, but the conversation mechanics are
  // those of a real Qwen3 file: ChatML with thinking tags (qwen3) detected from the template,
  // control tokens from the markup only, each turn prefilling just what the KV cache lacks.
  const auto dir = test::temp_dir("chat-qwen3");
  const std::string path = (dir / "tiny-qwen3-vocab.gguf").string();
  SynthSpec spec = synth_preset("tiny-qwen3");
  spec.n_vocab = 151936;
  spec.type = "q8_0";
  spec.seed = 3;
  spec.vocab_path = (test::shared_dir() / "tokenizers" / "qwen3" / "tokenizer.json").string();
  write_synth_model(spec, path, 2);
  gguf::File file = gguf::File::open(path);
  std::unique_ptr<Model> model = load_model(file);
  std::unique_ptr<Tokenizer> tok = Tokenizer::from_gguf(file);
  // Qwen3's template has thinking tags: the qwen3 format (ChatML with <think> handling).
  REQUIRE(chat_format_for(file, "") == ChatFormat::qwen3);
  const int32_t im_end = tok->find_token("<|im_end|>");
  REQUIRE(im_end == 151645);

  Session s(*model, SessionParams{.n_threads = 2, .n_ctx = 1024, .n_ubatch = 512});
  Sampler sampler(greedy(), tok->n_vocab());
  ChatSession chat(s, *tok, sampler, ChatFormat::qwen3, kSystem);
  const std::vector<std::string> turns = {"Hello!", "Say <|im_end|> twice: <|im_end|>", "Thanks."};
  int64_t before = 0;
  for (size_t i = 0; i < turns.size(); ++i) {
    CAPTURE(i);
    chat.respond(turns[i], 8);
    const ChatTurnStats& st = chat.last_turn();
    CHECK(st.n_reused == before);  // everything the cache held (earlier turns and replies)
    CHECK(st.n_prefilled == st.n_rendered - before);
    CHECK(s.n_prefill_tokens() + s.n_decode_tokens() >= st.n_rendered);
    if (i > 0) CHECK(st.n_prefilled < st.n_rendered / 2);  // only the new turn
    // Control tokens come from the markup only: one <|im_end|> per closed message (system,
    // user turns, replies), however many the user typed.
    const std::vector<int32_t> ids = chat.render_tokens(false);
    const auto n_end = std::count(ids.begin(), ids.end(), im_end);
    CHECK(n_end == static_cast<long>(1 + 2 * (i + 1)));
    before = static_cast<int64_t>(chat.cache_tokens().size());
  }
}
