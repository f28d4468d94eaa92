// Request fields over HTTP against the real stories260K model (greedy, exact values): the
// log-probability entries cover exactly the tokens whose text is returned (stop strings), on
// every endpoint, streamed or not.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "server_harness.h"

using namespace berth;
using namespace berth::test;

namespace {

// The log-probability entries of a whole response or of one streamed event, one JSON object
// per token ({"token", "logprob", "top"}), by endpoint; and the text the response or event
// carries.
struct Entries {
  std::vector<json> list;
  std::string text;
};

Entries entries_of(const json& j, const std::string& path) {
  Entries e;
  if (path == "/completion") {
    if (j.contains("content")) e.text = j["content"];
    if (j.contains("completion_probabilities"))
      for (const json& t : j["completion_probabilities"])
        e.list.push_back(
            {{"token", t["token"]}, {"logprob", t["logprob"]}, {"top", t["top_logprobs"]}});
    return e;
  }
  if (!j.contains("choices") || j["choices"].empty()) return e;
  const json& c = j["choices"][0];
  if (c.contains("text")) e.text = c["text"];
  if (c.contains("message")) e.text = c["message"]["content"];
  if (c.contains("delta") && c["delta"].contains("content") && c["delta"]["content"].is_string())
    e.text = c["delta"]["content"];
  const json& lp = c["logprobs"];
  if (lp.is_null()) return e;
  if (path == "/v1/completions") {
    for (size_t i = 0; i < lp["tokens"].size(); ++i)
      e.list.push_back({{"token", lp["tokens"][i]},
                        {"logprob", lp["token_logprobs"][i]},
                        {"top", lp["top_logprobs"][i]},
                        {"offset", lp["text_offset"][i]}});
  } else {
    for (const json& t : lp["content"])
      e.list.push_back(
          {{"token", t["token"]}, {"logprob", t["logprob"]}, {"top", t["top_logprobs"]}});
  }
  return e;
}

std::vector<std::string> tokens_of(const std::vector<json>& list) {
  std::vector<std::string> out;
  for (const json& t : list) out.push_back(t["token"]);
  return out;
}

std::string concat(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += x;
  return s;
}

}  // namespace

TEST_CASE("logprobs cover exactly the tokens whose text is returned: stop strings, streaming") {
  TestServer srv(stories(), ServerConfig{.n_slots = 2});
  struct Case {
    std::string path;
    json body;
    std::string text;                 // the returned text
    std::vector<std::string> tokens;  // its logprob entries
  };
  const json chat_msgs = {{{"role", "user"}, {"content", "Tell me a story."}}};
  const std::vector<std::string> girl_named = {",",  " there", " was", " a",    " little",
                                               " g", "ir",     "l",    " named"};
  const std::vector<Case> cases = {
      // " Lily" straddles the stop string's start (" Lil" before "y. She"): dropped with " ."
      // and " She".
      {"/v1/completions",
       {{"prompt", kOnce}, {"max_tokens", 20}, {"logprobs", 1}, {"stop", "y. She"}},
       ", there was a little girl named Lil",
       girl_named},
      // " Lily" holds the space before the stop string "Lily": dropped too.
      {"/completion",
       {{"prompt", kOnce}, {"n_predict", 20}, {"n_probs", 1}, {"stop", {"Lily"}}},
       ", there was a little girl named ",
       girl_named},
      // "re" straddles 'e," r' ("r" before it).
      {"/v1/chat/completions",
       {{"messages", chat_msgs}, {"max_tokens", 20}, {"logprobs", true}, {"stop", "e,\" r"}},
       "\"Her",
       {"\"", "H", "e"}},
      // A stop string that starts right after a token: every token before it is kept.
      {"/v1/chat/completions",
       {{"messages", chat_msgs},
        {"max_tokens", 20},
        {"logprobs", true},
        {"top_logprobs", 2},
        {"stop", ",\" re"}},
       "\"Here",
       {"\"", "H", "e", "re"}},
      // No stop string: every token.
      {"/v1/completions",
       {{"prompt", kOnce}, {"max_tokens", 6}, {"logprobs", 2}},
       ", there was a little g",
       {",", " there", " was", " a", " little", " g"}},
  };
  for (const Case& c : cases) {
    CAPTURE(c.path);
    CAPTURE(c.body.dump());
    json b = c.body;
    b["temperature"] = 0;
    b["cache_prompt"] = false;  // every request evaluates the same prompt the same way
    Reply whole = post(srv.port, c.path, b);
    REQUIRE(whole.status == 200);
    const Entries w = entries_of(whole.j, c.path);
    CHECK(w.text == c.text);
    CHECK(tokens_of(w.list) == c.tokens);
    CHECK(c.text.rfind(concat(tokens_of(w.list)), 0) == 0);
    if (c.path == "/v1/completions") {  // text_offset: the characters (here bytes) before each
      size_t at = 0;
      for (const json& t : w.list) {
        CHECK(t["offset"] == at);
        at += t["token"].get<std::string>().size();
      }
    }

    // Streamed: the entries of all events are the whole response's, and none arrives before
    // its token's text.
    b["stream"] = true;
    Stream s = post_stream(srv.port, c.path, b);
    REQUIRE(s.status == 200);
    std::string sent;
    std::vector<json> streamed;
    for (const json& ev : s.events()) {
      const Entries e = entries_of(ev, c.path);
      sent += e.text;
      streamed.insert(streamed.end(), e.list.begin(), e.list.end());
      CHECK(sent.rfind(concat(tokens_of(streamed)), 0) == 0);
    }
    CHECK(sent == c.text);
    CHECK(streamed == w.list);
  }
}

TEST_CASE("logit_bias over HTTP: greedy's first token moves; malformed values are 400") {
  TestServer srv(stories(), ServerConfig{.n_slots = 2});
  // "Once upon a" continues with " time" (378); "re" (276) is next most likely.
  auto first = [&](const std::string& path, const json& bias) {
    json b = {{"prompt", "Once upon a"}, {"temperature", 0}};
    if (path == "/completion") {
      b["n_predict"] = 3;
      b["return_tokens"] = true;
    } else {
      b["max_tokens"] = 3;
    }
    if (!bias.is_null()) b["logit_bias"] = bias;
    Reply r = post(srv.port, path, b);
    REQUIRE(r.status == 200);
    return path == "/completion" ? r.j["content"].get<std::string>()
                                 : r.j["choices"][0]["text"].get<std::string>();
  };
  for (const std::string path : {"/completion", "/v1/completions"}) {
    CAPTURE(path);
    CHECK(first(path, nullptr) == " time, there");
    CHECK(first(path, {{"378", -100}}) == "re you o");
    CHECK(first(path, json::array({json::array({378, false})})) == "re you o");
    CHECK(first(path, json::array({json::array({378, -100})})) == "re you o");
    CHECK(first(path, {{"378", -5}}) == " time, there");  // not enough to move it
    CHECK(first(path, {{"13", 100}}) == "\n\n\n");
  }
  // Chat: a bias against what the model says first changes it.
  json chat = {{"messages", {{{"role", "user"}, {"content", "Tell me a story."}}}},
               {"max_tokens", 4},
               {"temperature", 0}};
  Reply plain = post(srv.port, "/v1/chat/completions", chat);
  REQUIRE(plain.status == 200);
  CHECK(plain.j["choices"][0]["message"]["content"] == "\"Here");
  const int32_t quote = stories().tok->find_token("\"");
  REQUIRE(quote >= 0);
  chat["logit_bias"] = {{std::to_string(quote), -100}};
  Reply biased = post(srv.port, "/v1/chat/completions", chat);
  REQUIRE(biased.status == 200);
  CHECK(biased.j["choices"][0]["message"]["content"] == "Then,");

  struct Bad {
    json bias;
    std::string message;
  };
  const std::vector<Bad> bad = {
      {{{"x378", 1}}, "'logit_bias' key \"x378\" is not a token id (an integer)"},
      {{{"512", 1}}, "'logit_bias' key \"512\" is outside the vocabulary of 512 tokens"},
      {{{"378", "-100"}},
       "'logit_bias[\"378\"]' must be a number in [-100, 100] or false, got \"-100\""},
      {{{"378", -1000}},
       "'logit_bias[\"378\"]' must be a number in [-100, 100] or false, got -1000"},
      {json::array({json::array({378, true})}),
       "'logit_bias[0][1]' must be a number in [-100, 100] or false, got true"},
      {json::array({json::array({100000, 1})}),
       "'logit_bias[0][0]' = 100000 is outside the vocabulary of 512 tokens"},
      {json::array({378}), "'logit_bias[0]' must be a [token id, bias] pair, got 378"},
      {true,
       "'logit_bias' must be an object of token ids to biases or an array of [token id, bias] "
       "pairs, got true"},
  };
  for (const Bad& x : bad)
    for (const std::string path : {"/completion", "/v1/completions", "/v1/chat/completions"}) {
      CAPTURE(path);
      CAPTURE(x.bias.dump());
      json b = path == "/v1/chat/completions"
                   ? json{{"messages", {{{"role", "user"}, {"content", "Hi"}}}}}
                   : json{{"prompt", "Once upon a"}};
      b["logit_bias"] = x.bias;
      b["max_tokens"] = 2;
      Reply r = post(srv.port, path, b);
      CHECK(r.status == 400);
      CHECK(r.j["error"] ==
            json{{"code", 400}, {"type", "invalid_request_error"}, {"message", x.message}});
    }
}

TEST_CASE("grammar and json_schema are 400 on every endpoint, streaming or not; null is absent") {
  TestServer srv(stories(), ServerConfig{});
  const std::vector<std::pair<std::string, json>> endpoints = {
      {"/completion", {{"prompt", kOnce}, {"n_predict", 4}}},
      {"/v1/completions", {{"prompt", kOnce}, {"max_tokens", 4}}},
      {"/v1/chat/completions",
       {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"max_tokens", 4}}}};
  for (const auto& [path, base] : endpoints)
    for (const bool stream : {false, true}) {
      CAPTURE(path);
      CAPTURE(stream);
      json b = base;
      b["stream"] = stream;
      b["grammar"] = "root ::= \"yes\" | \"no\"";
      Reply r = post(srv.port, path, b);
      CHECK(r.status == 400);
      CHECK(r.j ==
            json{{"error",
                  {{"code", 400},
                   {"type", "invalid_request_error"},
                   {"message", "'grammar' is not supported: berth has no constrained decoding"}}}});
      b.erase("grammar");
      b["json_schema"] = {{"type", "object"}, {"properties", {{"a", {{"type", "string"}}}}}};
      r = post(srv.port, path, b);
      CHECK(r.status == 400);
      CHECK(r.j == json{{"error",
                         {{"code", 400},
                          {"type", "invalid_request_error"},
                          {"message",
                           "'json_schema' is not supported: berth has no constrained decoding"}}}});
      b["json_schema"] = nullptr;
      b["grammar"] = nullptr;
      if (stream) {
        CHECK(post_stream(srv.port, path, b).status == 200);
      } else {
        CHECK(post(srv.port, path, b).status == 200);
      }
    }
}
