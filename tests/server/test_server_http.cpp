// The HTTP server in this process, on an ephemeral port of 127.0.0.1, over the real stories260K
// model (exact golden text and token counts) and small synthetic ones: endpoints and response
// shapes, stream == non-stream, stop strings, context overflow, determinism across slot counts
// under load, authentication and limits.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "berth/models/utf8.h"
#include "server_harness.h"

using namespace berth;
using namespace berth::test;

namespace {

json completion_body(const std::string& prompt, int max_tokens, bool stream = false) {
  return json{
      {"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}, {"stream", stream}};
}

json chat_body(const std::string& text, int max_tokens, bool stream = false) {
  return json{{"messages", {{{"role", "user"}, {"content", text}}}},
              {"max_tokens", max_tokens},
              {"temperature", 0},
              {"stream", stream}};
}

void check_error(const Reply& r, int status, const std::string& type) {
  CHECK(r.status == status);
  REQUIRE(r.j.is_object());
  REQUIRE(r.j.contains("error"));
  CHECK(r.j["error"]["code"] == status);
  CHECK(r.j["error"]["type"] == type);
  CHECK(r.j["error"]["message"].is_string());
}

// Content of a stream's events, by endpoint.
std::string stream_text(const Stream& s) {
  std::string out;
  for (const json& e : s.events()) {
    if (e.contains("content") && e["content"].is_string()) out += e["content"].get<std::string>();
    if (!e.contains("choices")) continue;
    for (const json& c : e["choices"]) {
      if (c.contains("text")) out += c["text"].get<std::string>();
      if (c.contains("delta") && c["delta"].contains("content") &&
          c["delta"]["content"].is_string())
        out += c["delta"]["content"].get<std::string>();
    }
  }
  return out;
}

}  // namespace

TEST_CASE("endpoints answer in llama-server's and OpenAI's shapes") {
  TestServer srv(stories(), ServerConfig{});
  const int port = srv.port;
  Reply r = get(port, "/health");
  CHECK(r.status == 200);
  CHECK(r.j == json{{"status", "ok"}});
  r = get(port, "/v1/models");
  CHECK(r.status == 200);
  CHECK(r.j["object"] == "list");
  CHECK(r.j["data"][0]["id"] == "test-model");
  CHECK(r.j["data"][0]["object"] == "model");
  CHECK(r.j["data"][0]["meta"]["n_vocab"] == 512);
  r = get(port, "/props");
  CHECK(r.j["total_slots"] == 1);
  CHECK(r.j["default_generation_settings"]["n_ctx"] == 1024);
  CHECK(r.j["model_path"] == stories260k().string());
  CHECK(r.j["chat_template"] == "");
  r = get(port, "/slots");
  REQUIRE(r.j.is_array());
  REQUIRE(r.j.size() == 1);
  CHECK(r.j[0]["id"] == 0);
  CHECK(r.j[0]["n_ctx"] == 1024);
  CHECK(r.j[0]["is_processing"] == false);
  check_error(get(port, "/metrics"), 501, "not_supported_error");

  r = post(port, "/tokenize", {{"content", kOnce}, {"add_special", true}});
  CHECK(r.j["tokens"] == json{1, 403, 407, 261, 378});
  r = post(port, "/tokenize", {{"content", kOnce}, {"with_pieces", true}});
  CHECK(r.j["tokens"][0] == json{{"id", 403}, {"piece", " Once"}});
  r = post(port, "/detokenize", {{"tokens", {403, 407, 261, 378}}});
  CHECK(r.j["content"] == kOnce);
  check_error(post(port, "/detokenize", {{"tokens", {403, 4000}}}), 400, "invalid_request_error");
  CHECK(post(port, "/detokenize", {{"tokens", {403, 4000}}})
            .j["error"]["message"]
            .get<std::string>()
            .find("tokens[1]") != std::string::npos);
  check_error(post(port, "/tokenize", {{"content", 5}}), 400, "invalid_request_error");
  r = post(port, "/apply-template", {{"messages", {{{"role", "user"}, {"content", "hi"}}}}});
  CHECK(r.j["prompt"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");

  check_error(get(port, "/nope"), 404, "not_found_error");
  check_error(post(port, "/nope", {{"a", 1}}), 404, "not_found_error");
  check_error(post_raw(port, "/v1/completions", "{\"prompt\": "), 400, "invalid_request_error");
  check_error(post_raw(port, "/v1/completions", "\"just a string\""), 400, "invalid_request_error");
}

TEST_CASE("chat_template_kwargs.enable_thinking: an empty thinking block in the qwen3 format") {
  LoadedModel q(stories260k().string());
  q.ctx.chat_format = ChatFormat::qwen3;
  TestServer srv(q, ServerConfig{});
  const json msgs = {{{"role", "user"}, {"content", "hi"}}};
  const std::string plain = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
  auto templ = [&](const json& kwargs) {
    json b = {{"messages", msgs}};
    if (!kwargs.is_discarded()) b["chat_template_kwargs"] = kwargs;
    return post(srv.port, "/apply-template", b);
  };
  CHECK(templ(json(json::value_t::discarded)).j["prompt"] == plain);
  CHECK(templ(nullptr).j["prompt"] == plain);
  CHECK(templ({{"enable_thinking", true}}).j["prompt"] == plain);
  CHECK(templ({{"enable_thinking", false}}).j["prompt"] == plain + "<think>\n\n</think>\n\n");
  CHECK(templ({{"enable_thinking", false}, {"other", 1}}).j["prompt"] ==
        plain + "<think>\n\n</think>\n\n");
  Reply r = templ({{"enable_thinking", "no"}});
  check_error(r, 400, "invalid_request_error");
  CHECK(r.j["error"]["message"] ==
        "'chat_template_kwargs.enable_thinking' must be true or false, got \"no\"");
  r = templ(3);
  check_error(r, 400, "invalid_request_error");
  CHECK(r.j["error"]["message"] == "'chat_template_kwargs' must be an object, got 3");
  // The chat endpoint renders the same prompt: the empty block adds prompt tokens.
  auto prompt_tokens = [&](const json& kwargs) {
    json b = {{"messages", msgs}, {"max_tokens", 1}};
    if (!kwargs.is_null()) b["chat_template_kwargs"] = kwargs;
    Reply c = post(srv.port, "/v1/chat/completions", b);
    REQUIRE(c.status == 200);
    return c.j["usage"]["prompt_tokens"].get<int64_t>();
  };
  CHECK(prompt_tokens({{"enable_thinking", false}}) > prompt_tokens(nullptr));
  check_error(post(srv.port, "/v1/chat/completions",
                   {{"messages", msgs}, {"chat_template_kwargs", {{"enable_thinking", 0}}}}),
              400, "invalid_request_error");
}

TEST_CASE("a route asked with a method it does not answer is 405 with Allow; others stay 404") {
  TestServer srv(stories(), ServerConfig{});
  auto c = client(srv.port);
  auto send = [&](const std::string& method, const std::string& path, const std::string& body) {
    httplib::Request req;
    req.method = method;
    req.path = path;
    if (!body.empty()) {
      req.body = body;
      req.set_header("Content-Type", "application/json");
    }
    httplib::Response res;
    httplib::Error err = httplib::Error::Success;
    Reply out;
    if (!c.send(req, res, err)) return out;
    out.status = res.status;
    out.body = res.body;
    out.headers = res.headers;
    out.j = json::parse(out.body, nullptr, false);
    return out;
  };
  struct Case {
    std::string method, path, body, allow;
  };
  for (const Case& k : std::vector<Case>{{"GET", "/v1/chat/completions", "", "POST"},
                                         {"GET", "/completion", "", "POST"},
                                         {"POST", "/health", "", "GET, HEAD"},
                                         {"POST", "/v1/models", "{\"a\": 1}", "GET, HEAD"},
                                         {"DELETE", "/props", "", "GET, HEAD"},
                                         {"PUT", "/tokenize", "{\"content\": \"hi\"}", "POST"},
                                         {"PATCH", "/slots", "{}", "GET, HEAD"},
                                         {"OPTIONS", "/metrics", "", "GET, HEAD"}}) {
    CAPTURE(k.method);
    CAPTURE(k.path);
    const Reply r = send(k.method, k.path, k.body);
    CHECK(r.status == 405);
    CHECK(httplib::detail::get_header_value(r.headers, "Allow", 0, "") == k.allow);
    CHECK(r.j == json{{"error",
                       {{"code", 405},
                        {"message", "method " + k.method + " is not allowed on " + k.path +
                                        " (it answers " + k.allow + ")"},
                        {"type", "invalid_request_error"}}}});
  }
  // A CORS preflight of a route: 204 with the route's methods, before the API key (browsers send
  // it without credentials); of no route: no preflight answer, the key check as for any request.
  // Every answer, errors included, carries Access-Control-Allow-Origin.
  {
    TestServer keyed(stories(), ServerConfig{.api_key = "k"});
    auto c = client(keyed.port);
    httplib::Headers pre = {{"Origin", "http://example.org"},
                            {"Access-Control-Request-Method", "POST"},
                            {"Access-Control-Request-Headers", "authorization, content-type"}};
    auto res = c.Options("/v1/chat/completions", pre);
    REQUIRE(res);
    CHECK(res->status == 204);
    CHECK(res->get_header_value("Access-Control-Allow-Origin") == "*");
    CHECK(res->get_header_value("Access-Control-Allow-Methods") == "POST, OPTIONS");
    CHECK(res->get_header_value("Access-Control-Allow-Headers") == "authorization, content-type");
    res = c.Options("/health", {{"Access-Control-Request-Method", "GET"}});
    REQUIRE(res);
    CHECK(res->status == 204);
    CHECK(res->get_header_value("Access-Control-Allow-Methods") == "GET, HEAD, OPTIONS");
    CHECK(res->get_header_value("Access-Control-Allow-Headers") ==
          "Authorization, Content-Type, X-Api-Key");
    res = c.Options("/nope", pre);
    REQUIRE(res);
    CHECK(res->status == 401);
    res = c.Post("/v1/completions", {{"Origin", "http://example.org"}}, "{}", "application/json");
    REQUIRE(res);
    CHECK(res->status == 401);
    CHECK(res->get_header_value("Access-Control-Allow-Origin") == "*");
    res = c.Get("/health");
    REQUIRE(res);
    CHECK(res->status == 200);
    CHECK(res->get_header_value("Access-Control-Allow-Origin") == "*");
  }
  // HEAD has no body; the Allow of a GET route is true of HEAD.
  Reply r = send("HEAD", "/v1/completions", "");
  CHECK(r.status == 405);
  CHECK(httplib::detail::get_header_value(r.headers, "Allow", 0, "") == std::string("POST"));
  CHECK(send("HEAD", "/health", "").status == 200);
  // Paths that are no route: 404, whatever the method, and no Allow.
  for (const std::string method : {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}) {
    CAPTURE(method);
    for (const std::string path : {"/nope", "/health/", "/v1/chat/completions/x"}) {
      CAPTURE(path);
      r = send(method, path, "");
      CHECK(r.status == 404);
      CHECK(!r.headers.count("Allow"));
      if (method != "HEAD") check_error(r, 404, "not_found_error");
    }
  }
  // A POST with neither Content-Length nor Transfer-Encoding has no body (RFC 9112, 6.3): the
  // answer comes at once, not after the server waited for a body until its read timeout (which
  // then answered 400 "the request body could not be read").
  {
    const auto [status, got] =
        raw_exchange(srv.port, "POST /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    CHECK(status == 405);
    CHECK(got.find("method POST is not allowed on /health (it answers GET, HEAD)") !=
          std::string::npos);
  }
  {
    const auto [status, got] =
        raw_exchange(srv.port, "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    CHECK(status == 400);
    CHECK(got.find("invalid_request_error") != std::string::npos);
    CHECK(got.find("could not be read") == std::string::npos);
  }
  // The connection and the routes go on as before.
  CHECK(send("GET", "/health", "").j == json{{"status", "ok"}});
  CHECK(send("POST", "/tokenize", "{\"content\": \"Once upon a time\"}").j["tokens"] ==
        json{403, 407, 261, 378});
}

TEST_CASE("exact token counts, finish_reason and the golden continuation") {
  TestServer srv(stories(), ServerConfig{});
  Reply r = post(srv.port, "/v1/completions", completion_body(kOnce, 64));
  REQUIRE(r.status == 200);
  CHECK(r.j["object"] == "text_completion");
  CHECK(r.j["id"].get<std::string>().rfind("cmpl-", 0) == 0);
  CHECK(r.j["model"] == "test-model");
  CHECK(r.j["choices"][0]["text"] == kStoriesContinuation);
  CHECK(r.j["choices"][0]["finish_reason"] == "length");
  CHECK(r.j["usage"] == json{{"prompt_tokens", 5},
                             {"completion_tokens", 64},
                             {"total_tokens", 69},
                             {"prompt_tokens_details", {{"cached_tokens", 0}}}});
  // The same prompt again: 4 of its 5 tokens come from the slot's cache (the last is evaluated
  // for its logits), and the text is the same.
  r = post(srv.port, "/v1/completions", completion_body(kOnce, 10));
  CHECK(r.j["usage"]["prompt_tokens_details"]["cached_tokens"] == 4);
  CHECK(r.j["usage"]["completion_tokens"] == 10);
  const std::string ten = r.j["choices"][0]["text"];
  CHECK(kStoriesContinuation.rfind(ten, 0) == 0);
  CHECK(ten.size() > 20);
  // cache_prompt false evaluates the whole prompt.
  json b = completion_body(kOnce, 3);
  b["cache_prompt"] = false;
  CHECK(post(srv.port, "/v1/completions", b).j["usage"]["prompt_tokens_details"]["cached_tokens"] ==
        0);

  // n_predict 0: no token at all.
  r = post(srv.port, "/completion", {{"prompt", kOnce}, {"n_predict", 0}});
  CHECK(r.j["content"] == "");
  CHECK(r.j["tokens_predicted"] == 0);
  CHECK(r.j["stop_type"] == "limit");
  // The native endpoint's fields.
  r = post(srv.port, "/completion",
           {{"prompt", kOnce}, {"n_predict", 8}, {"temperature", 0}, {"return_tokens", true}});
  CHECK(r.j["stop"] == true);
  CHECK(r.j["tokens_predicted"] == 8);
  CHECK(r.j["tokens_evaluated"] == 5);
  CHECK(r.j["tokens"].size() == 8);
  CHECK(r.j["id_slot"] == 0);
  CHECK(r.j["prompt"] == kOnce);
  CHECK(kStoriesContinuation.rfind(r.j["content"].get<std::string>(), 0) == 0);
  CHECK(r.j["timings"]["predicted_n"] == 8);

  // Chat: an assistant message, length at max_tokens.
  r = post(srv.port, "/v1/chat/completions", chat_body("Tell me a story.", 7));
  REQUIRE(r.status == 200);
  CHECK(r.j["object"] == "chat.completion");
  CHECK(r.j["id"].get<std::string>().rfind("chatcmpl-", 0) == 0);
  CHECK(r.j["choices"][0]["message"]["role"] == "assistant");
  CHECK(r.j["choices"][0]["finish_reason"] == "length");
  CHECK(r.j["usage"]["completion_tokens"] == 7);
  const int64_t n_prompt = r.j["usage"]["prompt_tokens"];
  CHECK(r.j["usage"]["total_tokens"] == n_prompt + 7);
  // The rendered conversation, tokenized piece by piece, is what was counted.
  std::vector<ChatMessage> msgs = {{ChatRole::user, "Tell me a story."}};
  CHECK(
      n_prompt ==
      static_cast<int64_t>(
          tokenize_chat(*stories().tok, render_chat(ChatFormat::chatml, msgs, true), true).size()));
}

TEST_CASE("a stream carries the same text and counts as the whole response") {
  TestServer srv(stories(), ServerConfig{});
  for (const bool greedy : {true, false}) {
    CAPTURE(greedy);
    json chat = chat_body("Tell me a story about a dog.", 24);
    json comp = completion_body(kOnce, 24);
    for (json* b : {&chat, &comp}) {
      (*b)["temperature"] = greedy ? 0.0 : 0.9;
      (*b)["seed"] = 1234;
    }
    // Chat.
    Reply whole = post(srv.port, "/v1/chat/completions", chat);
    chat["stream"] = true;
    chat["stream_options"] = {{"include_usage", true}};
    Stream s = post_stream(srv.port, "/v1/chat/completions", chat);
    REQUIRE(s.status == 200);
    CHECK(httplib::detail::get_header_value(s.headers, "Content-Type", 0, "") ==
          std::string("text/event-stream"));
    REQUIRE(s.data.size() >= 4);
    CHECK(s.data.back() == "[DONE]");
    const std::vector<json> ev = s.events();
    const std::string id = ev[0]["id"];
    for (const json& e : ev) {
      CHECK(e["id"] == id);
      CHECK(e["object"] == "chat.completion.chunk");
      CHECK(e.contains("choices"));
    }
    CHECK(ev[0]["choices"][0]["delta"] == json{{"role", "assistant"}, {"content", nullptr}});
    for (size_t i = 1; i + 2 < ev.size(); ++i) {
      CHECK(ev[i]["choices"][0]["finish_reason"].is_null());
      CHECK(ev[i]["choices"][0]["delta"]["content"].is_string());
    }
    const json& last = ev[ev.size() - 2];
    CHECK(last["choices"][0]["delta"] == json::object());
    CHECK(last["choices"][0]["finish_reason"] == whole.j["choices"][0]["finish_reason"]);
    const json& usage = ev.back();
    CHECK(usage["choices"] == json::array());
    CHECK(usage["usage"]["completion_tokens"] == whole.j["usage"]["completion_tokens"]);
    CHECK(usage["usage"]["prompt_tokens"] == whole.j["usage"]["prompt_tokens"]);
    CHECK(stream_text(s) == whole.j["choices"][0]["message"]["content"].get<std::string>());
    // Without include_usage there is no usage chunk (it would break clients that read
    // choices[0]).
    chat.erase("stream_options");
    s = post_stream(srv.port, "/v1/chat/completions", chat);
    for (const json& e : s.events()) CHECK_FALSE(e["choices"].empty());
    CHECK(stream_text(s) == whole.j["choices"][0]["message"]["content"].get<std::string>());

    // Completions.
    whole = post(srv.port, "/v1/completions", comp);
    comp["stream"] = true;
    s = post_stream(srv.port, "/v1/completions", comp);
    CHECK(s.data.back() == "[DONE]");
    CHECK(stream_text(s) == whole.j["choices"][0]["text"].get<std::string>());
    CHECK(s.events().back()["choices"][0]["finish_reason"] == "length");

    // Native: no [DONE]; the last event has stop: true.
    json nat = {
        {"prompt", kOnce}, {"n_predict", 24}, {"temperature", greedy ? 0.0 : 0.9}, {"seed", 1234}};
    whole = post(srv.port, "/completion", nat);
    nat["stream"] = true;
    s = post_stream(srv.port, "/completion", nat);
    CHECK(s.data.back() != "[DONE]");
    CHECK(s.events().back()["stop"] == true);
    CHECK(s.events().back()["tokens_predicted"] == 24);
    CHECK(stream_text(s) == whole.j["content"].get<std::string>());
    if (greedy)
      CHECK(whole.j["content"] ==
            kStoriesContinuation.substr(0, whole.j["content"].get<std::string>().size()));
  }
}

TEST_CASE("stop strings across tokens: held back, never streamed in part, not in the output") {
  TestServer srv(stories(), ServerConfig{});
  // Which token completes "little girl": from the tokens of the golden continuation.
  Reply ref = post(srv.port, "/completion",
                   {{"prompt", kOnce}, {"n_predict", 64}, {"temperature", 0}, {"n_probs", 1}});
  std::string acc;
  int64_t n_to_stop = 0;
  for (const json& t : ref.j["completion_probabilities"]) {
    ++n_to_stop;
    for (int b : t["bytes"]) acc += static_cast<char>(b);
    if (acc.find("little girl") != std::string::npos) break;
  }
  REQUIRE(acc.find("little girl") != std::string::npos);
  for (const bool stream : {false, true}) {
    CAPTURE(stream);
    json b = completion_body(kOnce, 64, stream);
    b["stop"] = {"never-there", "little girl"};
    if (stream) {
      b["stream_options"] = {{"include_usage", true}};
      Stream s = post_stream(srv.port, "/v1/completions", b);
      CHECK(stream_text(s) == ", there was a ");
      for (const json& e : s.events())
        for (const json& c : e["choices"])
          CHECK(c["text"].get<std::string>().find("lit") == std::string::npos);
      CHECK(s.events()[s.events().size() - 2]["choices"][0]["finish_reason"] == "stop");
      CHECK(s.events().back()["usage"]["completion_tokens"] == n_to_stop);
    } else {
      Reply r = post(srv.port, "/v1/completions", b);
      CHECK(r.j["choices"][0]["text"] == ", there was a ");
      CHECK(r.j["choices"][0]["finish_reason"] == "stop");
      CHECK(r.j["usage"]["completion_tokens"] == n_to_stop);
    }
  }
  // A stop string that starts and ends inside tokens.
  json b = completion_body(kOnce, 64);
  b["stop"] = "ttle gi";
  CHECK(post(srv.port, "/v1/completions", b).j["choices"][0]["text"] == ", there was a li");
  // One whose start shows up ("Lily") but which never completes: all the text, length.
  b["stop"] = {"Lily's dog", "\n\n"};
  Reply r = post(srv.port, "/v1/completions", b);
  CHECK(r.j["choices"][0]["text"] == kStoriesContinuation);
  CHECK(r.j["choices"][0]["finish_reason"] == "length");
  b["stream"] = true;
  CHECK(stream_text(post_stream(srv.port, "/v1/completions", b)) == kStoriesContinuation);
  // Native: stop_type word and the stopping word.
  r = post(srv.port, "/completion",
           {{"prompt", kOnce}, {"n_predict", 64}, {"temperature", 0}, {"stop", {"Lily"}}});
  CHECK(r.j["content"] == ", there was a little girl named ");
  CHECK(r.j["stop_type"] == "word");
  CHECK(r.j["stopping_word"] == "Lily");
}

TEST_CASE("context overflow is 400 exceed_context_size_error, streaming or not") {
  TestServer srv(stories(), ServerConfig{.n_slots = 2, .n_ctx = 256});
  std::vector<int32_t> ids(128, 403);
  ids[0] = 1;
  for (const bool stream : {false, true}) {
    CAPTURE(stream);
    json b = {{"prompt", ids}, {"max_tokens", 4}, {"stream", stream}};
    Reply r = post(srv.port, "/v1/completions", b);
    check_error(r, 400, "exceed_context_size_error");
    CHECK(r.j["error"]["n_prompt_tokens"] == 128);
    CHECK(r.j["error"]["n_ctx"] == 128);
    CHECK(httplib::detail::get_header_value(r.headers, "Content-Type", 0, "") ==
          std::string("application/json"));
    json c = chat_body(std::string(2000, 'a'), 4, stream);
    check_error(post(srv.port, "/v1/chat/completions", c), 400, "exceed_context_size_error");
  }
  // One token less fits: the context then holds the prompt and one generated token, and the
  // token sampled from its logits is the second and last (n_ctx + 1 tokens in all).
  ids.pop_back();
  Reply r = post(srv.port, "/v1/completions",
                 {{"prompt", ids}, {"max_tokens", 4}, {"temperature", 0}, {"ignore_eos", true}});
  CHECK(r.status == 200);
  CHECK(r.j["usage"]["completion_tokens"] == 2);
  CHECK(r.j["choices"][0]["finish_reason"] == "length");
  // Without a limit generation ends at the full context.
  ids.resize(100);
  r = post(srv.port, "/completion", {{"prompt", ids}, {"temperature", 0}, {"ignore_eos", true}});
  CHECK(r.j["tokens_predicted"] == 128 - 100 + 1);
  CHECK(r.j["stop_type"] == "limit");
}

TEST_CASE("identical greedy output with -np 1 and -np 4 under concurrent load") {
  const std::vector<std::string> prompts = {kOnce,
                                            "Lily and Tom went to",
                                            "The little dog",
                                            "One day, a bird",
                                            "Sam had a big red",
                                            "The sun was",
                                            "Mom said",
                                            "There was a tree"};
  auto ask = [](int port, const std::string& p) {
    Reply r = post(port, "/v1/completions", completion_body(p, 48));
    CHECK_MESSAGE(r.status == 200, r.body);  // CHECK: this runs on several threads
    return r.status == 200 ? r.j["choices"][0]["text"].get<std::string>() : std::string();
  };
  std::map<std::string, std::string> expected;
  {
    TestServer one(stories(), ServerConfig{.n_slots = 1, .n_ctx = 512});
    for (const std::string& p : prompts) expected[p] = ask(one.port, p);
  }
  for (const int np : {4, 1}) {
    CAPTURE(np);
    TestServer srv(stories(), ServerConfig{.n_slots = np, .n_ctx = 2048});
    std::vector<std::string> got(prompts.size() * 3);
    std::vector<std::thread> threads;
    for (size_t i = 0; i < got.size(); ++i)
      threads.emplace_back([&, i] { got[i] = ask(srv.port, prompts[i % prompts.size()]); });
    for (std::thread& t : threads) t.join();
    for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == expected[prompts[i % prompts.size()]]);
  }
}

TEST_CASE("/slots shows every slot busy when requests exceed slots") {
  static LoadedModel slow(synth_model("slow-llama"));
  TestServer srv(slow, ServerConfig{.n_slots = 2, .n_ctx = 512, .metrics = true});
  std::vector<Stream> streams(3);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < streams.size(); ++i)
    threads.emplace_back([&, i] {
      streams[i] = post_stream(srv.port, "/completion",
                               {{"prompt", {1, 20 + static_cast<int>(i)}},
                                {"n_predict", 120},
                                {"temperature", 0},
                                {"ignore_eos", true},
                                {"stream", true}});
    });
  bool all_busy = eventually(
      [&] {
        Reply s = get(srv.port, "/slots");
        return s.j.is_array() && s.j.size() == 2 && s.j[0]["is_processing"] == true &&
               s.j[1]["is_processing"] == true;
      },
      30);
  CHECK(all_busy);
  // The third request waits once it has arrived (its thread may still be sending it when both
  // slots are busy: a fresh-clone CI run read "requests_deferred 0" here).
  std::string metrics;
  const bool deferred = eventually(
      [&] {
        metrics = get(srv.port, "/metrics").body;
        return metrics.find("berth:requests_deferred 1\n") != std::string::npos;
      },
      30);
  CHECK(deferred);
  CHECK(metrics.find("berth:requests_processing 2\n") != std::string::npos);
  for (std::thread& t : threads) t.join();
  for (const Stream& s : streams) {
    CHECK(s.status == 200);
    CHECK(s.events().back()["tokens_predicted"] == 120);
  }
  // Both slots were busy at once, so steps carried both.
  CHECK(get(srv.port, "/metrics").body.find("berth:step_slots_max 2\n") != std::string::npos);
  Reply s = get(srv.port, "/slots");
  CHECK(s.j[0]["is_processing"] == false);
  CHECK(s.j[1]["is_processing"] == false);
}

TEST_CASE("a client that vanishes frees its slot within a step: mid-stream, in prefill, waiting") {
  static LoadedModel slow(synth_model("slow-llama"));
  TestServer srv(slow, ServerConfig{.n_slots = 1, .n_ctx = 1024, .n_ubatch = 1, .metrics = true});
  auto idle = [&] {
    Reply s = get(srv.port, "/slots");
    return s.j.is_array() && s.j[0]["is_processing"] == false;
  };
  auto metric = [&](const std::string& name) {
    const std::string body = get(srv.port, "/metrics").body;
    const size_t p = body.find("\nberth:" + name + " ");
    REQUIRE(p != std::string::npos);
    return std::stod(body.substr(p + name.size() + 8));
  };
  const auto t0 = metric("tokens_predicted_total");
  {  // Mid-stream: read the first token's event, then hang up.
    RawConn c(srv.port);
    const std::string body =
        json{{"prompt", {1, 5}}, {"n_predict", 600}, {"stream", true}, {"ignore_eos", true}}.dump();
    REQUIRE(c.send(http_post_head("/completion", body.size()) + body));
    CHECK(c.read_until("\"tokens_predicted\"").find("data: ") != std::string::npos);
  }
  CHECK(eventually(idle, 3));
  CHECK(metric("tokens_predicted_total") - t0 < 300);
  {  // In prefill (-ub 1: a step per prompt token; nothing is sent before the first token):
     // hang up once the prompt is under way.
    std::vector<int32_t> ids(600, 7);
    ids[0] = 1;
    const double p0 = metric("prompt_tokens_total");
    RawConn c(srv.port);
    const std::string body = json{{"prompt", ids}, {"n_predict", 4}, {"stream", true}}.dump();
    REQUIRE(c.send(http_post_head("/completion", body.size()) + body));
    CHECK(eventually([&] { return metric("prompt_tokens_total") >= p0 + 8; }, 10));
  }
  CHECK(eventually(idle, 3));
  CHECK(metric("prompt_tokens_total") < 300);
  {  // Not streaming: the socket is watched while the request runs.
    RawConn c(srv.port);
    const std::string body =
        json{{"prompt", {1, 9}}, {"n_predict", 600}, {"ignore_eos", true}}.dump();
    REQUIRE(c.send(http_post_head("/completion", body.size()) + body));
    CHECK(eventually([&] { return !idle(); }, 10));
  }
  CHECK(eventually(idle, 3));
  // And the server goes on answering.
  Reply r =
      post(srv.port, "/completion", {{"prompt", {1, 5}}, {"n_predict", 3}, {"temperature", 0}});
  CHECK(r.status == 200);
  CHECK(r.j["tokens_predicted"] == 3);
}

TEST_CASE("503 with Retry-After when every slot is busy and the queue is full") {
  static LoadedModel slow(synth_model("slow-llama"));
  TestServer srv(slow, ServerConfig{.n_slots = 1, .n_ctx = 512, .queue = 1});
  const std::string body =
      json{{"prompt", {1, 5}}, {"n_predict", 400}, {"stream", true}, {"ignore_eos", true}}.dump();
  RawConn running(srv.port), waiting(srv.port);
  REQUIRE(running.send(http_post_head("/completion", body.size()) + body));
  running.read_until("data: ");
  REQUIRE(waiting.send(http_post_head("/completion", body.size()) + body));
  CHECK(eventually([&] { return srv.engine->metrics().requests_deferred == 1; }, 10));
  Reply r = post(srv.port, "/v1/completions", completion_body("a", 2));
  check_error(r, 503, "unavailable_error");
  CHECK(httplib::detail::get_header_value(r.headers, "Retry-After", 0, "") == std::string("1"));
  r = post(srv.port, "/v1/completions", completion_body("a", 2, true));
  CHECK(r.status == 503);
  running.close();
  waiting.close();
  CHECK(eventually([&] { return srv.engine->n_in_flight() == 0; }, 5));
  CHECK(post(srv.port, "/v1/completions", completion_body("a", 2)).status == 200);
}

TEST_CASE("--api-key: 401 without it (Bearer or X-Api-Key); /health and /v1/models stay public") {
  TestServer srv(stories(), ServerConfig{.api_key = "s3cret"});
  CHECK(get(srv.port, "/health").status == 200);
  CHECK(get(srv.port, "/v1/models").status == 200);
  check_error(get(srv.port, "/props"), 401, "authentication_error");
  check_error(get(srv.port, "/slots"), 401, "authentication_error");
  check_error(post(srv.port, "/v1/completions", completion_body("a", 2)), 401,
              "authentication_error");
  check_error(post(srv.port, "/v1/completions", completion_body("a", 2),
                   {{"Authorization", "Bearer wrong"}}),
              401, "authentication_error");
  check_error(
      post(srv.port, "/v1/completions", completion_body("a", 2), {{"Authorization", "s3cret"}}),
      401, "authentication_error");
  CHECK(post(srv.port, "/v1/completions", completion_body("a", 2),
             {{"Authorization", "Bearer s3cret"}})
            .status == 200);
  CHECK(post(srv.port, "/v1/completions", completion_body("a", 2), {{"X-Api-Key", "s3cret"}})
            .status == 200);
  CHECK(get(srv.port, "/props", {{"X-Api-Key", "s3cret"}}).status == 200);
  // The scheme's name is case-insensitive; a 401 names the scheme it wants.
  CHECK(get(srv.port, "/props", {{"Authorization", "bearer s3cret"}}).status == 200);
  CHECK(get(srv.port, "/props", {{"Authorization", "BEARER s3cret"}}).status == 200);
  const Reply denied = get(srv.port, "/props");
  CHECK(denied.status == 401);
  CHECK(httplib::detail::get_header_value(denied.headers, "WWW-Authenticate", 0, "") ==
        std::string("Bearer"));
}

TEST_CASE("413 for a body over the limit, whatever its framing; the server answers on") {
  TestServer srv(stories(), ServerConfig{.max_body_bytes = 64 << 10});
  const std::string big = "{\"prompt\": \"" + std::string(70 << 10, 'a') + "\"}";
  Reply r = post_raw(srv.port, "/v1/completions", big);
  check_error(r, 413, "invalid_request_error");
  CHECK(r.j["error"]["message"].get<std::string>().find("65536") != std::string::npos);
  {  // Chunked (cpp-httplib 0.11 bounds only Content-Length bodies itself).
    RawConn c(srv.port);
    std::string req =
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
    const std::string chunk(8192, 'a');
    for (int i = 0; i < 10; ++i) req += "2000\r\n" + chunk + "\r\n";
    req += "0\r\n\r\n";
    c.send(req);
    c.read_until("\r\n\r\n");
    CHECK(c.status() == 413);
  }
  {  // A Content-Length over the limit: the body is read and dropped, never stored.
    RawConn c(srv.port);
    c.send(http_post_head("/v1/completions", size_t{1} << 20) + std::string(size_t{1} << 20, '{'));
    c.read_until("\r\n\r\n");
    CHECK(c.status() == 413);
  }
  {  // ... and when the client sends none of it: refused from the header alone, before the
     // server's 5 s read timeout (it used to wait for the body to discard it).
    RawConn c(srv.port);
    const auto t0 = std::chrono::steady_clock::now();
    c.send(http_post_head("/v1/completions", size_t{17} << 20));
    const std::string got = c.read_until("}}");
    CHECK(c.status() == 413);
    CHECK(got.find("the request body of 17825792 bytes is over the limit of 65536 bytes") !=
          std::string::npos);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(3));
  }
  {  // A transfer coding other than chunked: 501 at once (it used to wait 10 s, then 400).
    const auto [status, got] = raw_exchange(
        srv.port,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: gzip\r\n\r\nxyz");
    CHECK(status == 501);
    CHECK(got.find("Transfer-Encoding 'gzip' is not supported (chunked is)") != std::string::npos);
  }
  {  // Transfer-Encoding and Content-Length together: 400 and the connection closes.
    RawConn c(srv.port);
    c.send(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n");
    const std::string got = c.read_all();
    CHECK(c.status() == 400);
    CHECK(got.find("the request has both Transfer-Encoding and Content-Length") !=
          std::string::npos);
    CHECK(got.find("Connection: close") != std::string::npos);
  }
  {  // Content-Length values that disagree: 400, whichever the body matches.
    const auto [status, got] = raw_exchange(
        srv.port,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 2\r\nContent-Length: 30\r\n\r\n{\"prompt\": \"a\", \"max_tokens\": 1}");
    CHECK(status == 400);
    CHECK(got.find("the request has Content-Length values that disagree") != std::string::npos);
  }
  CHECK(post(srv.port, "/v1/completions", completion_body(kOnce, 2)).status == 200);
}

TEST_CASE("/health is 503 while loading, then 200; --metrics serves Prometheus text") {
  server::ServerOptions so;
  so.port = 0;
  so.metrics = true;
  server::HttpServer http(so);
  const int port = http.bind();
  http.start();
  Reply r = get(port, "/health");
  check_error(r, 503, "unavailable_error");
  CHECK(r.j["error"]["message"] == "Loading model");
  check_error(get(port, "/v1/models"), 503, "unavailable_error");
  check_error(post(port, "/v1/completions", completion_body("a", 1)), 503, "unavailable_error");
  server::BatchEngineOptions eo;
  eo.n_ctx = 256;
  eo.session.n_threads = 1;
  server::BatchEngine engine(*stories().model, *stories().tok, eo);
  http.set_ready(stories().ctx, engine);
  CHECK(get(port, "/health").status == 200);
  CHECK(post(port, "/v1/completions", completion_body(kOnce, 6)).status == 200);
  r = get(port, "/metrics");
  CHECK(r.status == 200);
  CHECK(r.body.find("# TYPE berth:prompt_tokens_total counter\nberth:prompt_tokens_total 5\n") !=
        std::string::npos);
  CHECK(r.body.find("berth:tokens_predicted_total 6\n") != std::string::npos);
  // 6 tokens: the prompt's step samples the first, 5 decode-only steps the others.
  CHECK(r.body.find("# TYPE berth:decode_steps_total counter\nberth:decode_steps_total 5\n") !=
        std::string::npos);
  CHECK(r.body.find("berth:decode_rows_total 5\n") != std::string::npos);
  CHECK(r.body.find("berth:decode_intervals_total 4\n") != std::string::npos);
  CHECK(r.body.find("berth:requests_processing 0\n") != std::string::npos);
  // The HTTP pool's base: 1 slot + a queue of 64 + 8.
  CHECK(r.body.find("# TYPE berth:http_threads gauge\nberth:http_threads 73\n") !=
        std::string::npos);
  http.stop();
}

TEST_CASE(
    "shutdown lets requests in flight finish, refuses new ones, and ends late ones with "
    "an error event") {
  static LoadedModel slow(synth_model("slow-llama"));
  for (const bool late : {false, true}) {
    CAPTURE(late);
    TestServer srv(slow, ServerConfig{.n_slots = 1, .n_ctx = 512});
    Stream s;
    std::thread t([&] {
      s = post_stream(srv.port, "/v1/completions",
                      {{"prompt", {1, 5}},
                       {"max_tokens", late ? 400 : 300},
                       {"stream", true},
                       {"ignore_eos", true},
                       {"temperature", 0}});
    });
    REQUIRE(eventually([&] { return srv.engine->n_in_flight() == 1; }, 10));
    // Late: a second streaming request waits for the slot and is cancelled by the shutdown
    // before its first token, so it gets a real status, not 200 and an error event.
    Stream queued;
    std::thread t2;
    if (late) {
      t2 = std::thread([&] {
        queued = post_stream(srv.port, "/v1/completions",
                             {{"prompt", {1, 9}}, {"max_tokens", 8}, {"stream", true}});
      });
      REQUIRE(eventually([&] { return srv.engine->n_in_flight() == 2; }, 10));
    }
    std::thread stopper([&] { srv.http->shutdown(std::chrono::milliseconds(late ? 200 : 60000)); });
    if (!late) {  // Once the drain began (the long request still runs), new requests get 503.
      CHECK(eventually([&] { return srv.http->draining(); }, 10));
      Reply r = post(srv.port, "/v1/completions", completion_body("a", 2));
      CHECK(r.status == 503);
      CHECK(r.j.dump().find("the server is shutting down") != std::string::npos);
    }
    t.join();
    if (t2.joinable()) t2.join();
    stopper.join();
    CHECK(s.status == 200);
    if (late) {
      CHECK(queued.status == 503);
      CHECK(queued.data.empty());
      const json qe = json::parse(queued.raw);
      CHECK(qe["error"]["code"] == 503);
      CHECK(qe["error"]["type"] == "unavailable_error");
      CHECK(s.data.back() != "[DONE]");
      const json e = json::parse(s.data.back());
      CHECK(e["error"]["code"] == 503);
      CHECK(e["error"]["type"] == "unavailable_error");
    } else {
      CHECK(s.data.back() == "[DONE]");
      CHECK(s.events().back()["choices"][0]["finish_reason"] == "length");
    }
  }
}

TEST_CASE(
    "output is valid UTF-8 when tokens split characters; chat content never makes "
    "control tokens") {
  // The synthetic byte-level BPE vocabulary (1024 tokens, a quarter of them single bytes, half of
  // those bytes >= 0x80) under random weights: sampled text is full of split and ill-formed
  // UTF-8.
  static LoadedModel q(synth_model("tiny-qwen3"));
  TestServer srv(q, ServerConfig{.n_slots = 1, .n_ctx = 1024});
  json b = {{"messages", {{{"role", "user"}, {"content", "写一首关于猫的诗 <|im_end|>"}}}},
            {"max_tokens", 64},
            {"temperature", 1.0},
            {"top_k", 0},
            {"top_p", 1.0},
            {"min_p", 0},
            {"seed", 99},
            {"logprobs", true}};
  Reply r = post(srv.port, "/v1/chat/completions", b);
  REQUIRE(r.status == 200);
  const std::string content = r.j["choices"][0]["message"]["content"];
  CHECK(utf8::is_valid(content));
  std::string bytes;
  int split = 0;  // tokens whose bytes are not valid UTF-8 on their own
  for (const json& t : r.j["choices"][0]["logprobs"]["content"]) {
    std::string piece;
    for (int x : t["bytes"]) piece += static_cast<char>(x);
    split += utf8::is_valid(piece) ? 0 : 1;
    bytes += piece;
  }
  CHECK(split > 0);  // the test exercised the hold-back
  CHECK(utf8::sanitize(bytes) == content);
  b["stream"] = true;
  Stream s = post_stream(srv.port, "/v1/chat/completions", b);
  CHECK(stream_text(s) == content);
  for (const json& e : s.events())
    for (const json& c : e["choices"])
      if (c["delta"].contains("content") && c["delta"]["content"].is_string())
        CHECK(utf8::is_valid(c["delta"]["content"].get<std::string>()));

  // "<|im_end|>" typed by the user stays text: the prompt holds the control token once per
  // message end only.
  server::CompletionRequest req = server::parse_completion(
      json{{"messages", {{{"role", "user"}, {"content", "a<|im_end|>b"}}}}}, server::Endpoint::chat,
      q.ctx);
  const int32_t im_end = q.tok->find_token("<|im_end|>");
  REQUIRE(im_end >= 0);
  CHECK(std::count(req.gen.prompt.begin(), req.gen.prompt.end(), im_end) == 1);
  CHECK(req.gen.stop_ids == std::vector<int32_t>{im_end});
}

TEST_CASE("prefix cache: a chat's next turn prefills only what is new; slots chosen by prefix") {
  TestServer srv(stories(), ServerConfig{.n_slots = 2, .n_ctx = 2048});
  json turn = chat_body("Tell me a story about a cat.", 16);
  Reply r1 = post(srv.port, "/v1/chat/completions", turn);
  REQUIRE(r1.status == 200);
  const int64_t p1 = r1.j["usage"]["prompt_tokens"];
  // Another conversation takes the other slot (it shares little with the first).
  Reply other = post(srv.port, "/v1/chat/completions", chat_body("Why is the sky blue?", 8));
  CHECK(other.j["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>() < p1 / 2);
  turn["messages"].push_back(
      {{"role", "assistant"}, {"content", r1.j["choices"][0]["message"]["content"]}});
  turn["messages"].push_back({{"role", "user"}, {"content", "And then?"}});
  Reply r2 = post(srv.port, "/v1/chat/completions", turn);
  REQUIRE(r2.status == 200);
  const int64_t p2 = r2.j["usage"]["prompt_tokens"];
  const int64_t cached = r2.j["usage"]["prompt_tokens_details"]["cached_tokens"];
  CHECK(cached >= p1);  // the first turn's whole prompt (at least) came from the cache
  CHECK(cached < p2);
  CHECK(r2.j["timings"]["prompt_n"] == p2 - cached);
  // The same request on a fresh server, without the cache, gives the same reply.
  TestServer fresh(stories(), ServerConfig{.n_slots = 1, .n_ctx = 1024});
  CHECK(post(fresh.port, "/v1/chat/completions", turn).j["choices"][0]["message"]["content"] ==
        r2.j["choices"][0]["message"]["content"]);
}

TEST_CASE("a port another server listens on is refused") {
  server::ServerOptions so;
  so.port = 0;
  server::HttpServer first(so);
  const int port = first.bind();
  REQUIRE(port > 0);
  server::ServerOptions so2;
  so2.port = port;
  server::HttpServer second(so2);
  try {
    second.bind();
    FAIL("a second server must not bind a port in use");
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::io);
    CHECK(std::string(e.what()).find(std::to_string(port)) != std::string::npos);
  }
}

TEST_CASE("clients that send their requests slowly do not leave /health without a thread") {
  // -np 1 and no queue: the server starts with 1 + 0 + 8 HTTP threads. Twelve connections hold
  // one each while their request headers trickle in (each stays open, silent, until the read
  // timeout of 5 s); /health must still answer at once on a thirteenth.
  TestServer srv(stories(), ServerConfig{.n_slots = 1, .queue = 0, .http_thread_retire_ms = 300});
  // The pool grows by the holders' threads and, once they are gone and idle for 300 ms, shrinks
  // back to its base.
  auto n_threads = [&] { return srv.http->http_threads(); };
  httplib::Client c("127.0.0.1", srv.port);
  c.set_connection_timeout(2, 0);
  c.set_read_timeout(2, 0);   // well under the holders' 5 s: a pool of 9 answers only after them
  REQUIRE(c.Get("/health"));  // the pool's base threads have started (the listener makes them)
  const int64_t before = n_threads();
  CHECK(before == 9);
  std::vector<std::unique_ptr<RawConn>> holders;
  for (int i = 0; i < 12; ++i) {
    holders.push_back(std::make_unique<RawConn>(srv.port));
    REQUIRE(holders.back()->ok());
    REQUIRE(holders.back()->send("GET /health HTTP/1.1\r\nHo"));
  }
  auto r = c.Get("/health");
  REQUIRE(r);
  CHECK(r->status == 200);
  CHECK(json::parse(r->body) == json{{"status", "ok"}});
  CHECK(n_threads() >= 13);  // 13 connections at once on 9 base threads
  holders.clear();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (n_threads() > before && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(n_threads() == before);
  // The base threads stay and answer.
  r = c.Get("/health");
  REQUIRE(r);
  CHECK(r->status == 200);
}
