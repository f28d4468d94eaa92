// POST /v1/chat/completions, /v1/completions and /completion: submit to the engine, then write
// the response whole (non-stream) or as server-sent events (stream).
#include <fmt/format.h>

#include <chrono>
#include <deque>
#include <optional>

#include "berth/core/log.h"
#include "berth/core/strings.h"
#include "berth/models/utf8.h"
#include "berth/server/text_output.h"
#include "http_internal.h"

namespace berth::server {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::chrono::milliseconds kPoll{100};

ApiError rejection(const Rejected& r) {
  switch (r.reason()) {
    case Rejected::Reason::context_exceeded:
      return ApiError{400, "exceed_context_size_error",
                      "the request exceeds the available context size, try increasing it (" +
                          std::string(r.what()) + ")",
                      json{{"n_prompt_tokens", r.n_prompt()}, {"n_ctx", r.n_ctx()}}};
    case Rejected::Reason::queue_full:
      return ApiError{503, "unavailable_error", std::string(r.what()) + "; retry later"};
    case Rejected::Reason::shutting_down:
      return ApiError{503, "unavailable_error", r.what()};
    case Rejected::Reason::invalid:
      break;
  }
  return ApiError{400, "invalid_request_error", r.what()};
}

const ApiError kShuttingDown{503, "unavailable_error", "the server is shutting down"};

std::string sse(const json& j) {
  return "data: " + j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
}

json error_json(const ApiError& e) {
  json err = {{"code", e.status}, {"message", e.message}, {"type", e.type}};
  for (const auto& [k, v] : e.extra.items()) err[k] = v;
  return json{{"error", err}};
}

json bytes_of(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

/// What Output::take released: text, the ids of the tokens taken (every generated token up to
/// the one that completes a stop string: the native endpoint's "tokens") and the tokens whose
/// log-probabilities go out with it (only those whose text is released whole: TextFilter).
struct Released {
  std::string text;
  std::vector<int32_t> ids;
  std::vector<GeneratedToken> probs;
  void clear() {
    text.clear();
    ids.clear();
    probs.clear();
  }
};

/// The consumer side of one completion: turns the engine's tokens into response text (UTF-8,
/// stop strings) and counts them. Shared by the streaming and the whole-response paths.
struct Output {
  Output(HttpServer::Impl& server, CompletionRequest request, std::shared_ptr<Generation> g,
         const httplib::Request& http)
      : srv(server),
        req(std::move(request)),
        gen(std::move(g)),
        filter(req.stop),
        watch(http),
        active(server.active),
        id(server.next_id(req.endpoint == Endpoint::chat ? "chatcmpl-" : "cmpl-")),
        created(unix_time()) {}
  ~Output() { gen->cancel(); }  // a no-op once done; else the client is gone or we stop

  HttpServer::Impl& srv;
  CompletionRequest req;
  std::shared_ptr<Generation> gen;
  TextFilter filter;
  PeerWatch watch;
  ActiveGuard active;
  std::string id;
  int64_t created;

  int32_t slot = -1;
  int64_t n_cached = 0;
  int64_t n_tokens = 0;  // tokens whose text is part of the output (up to a stop string)
  std::deque<GeneratedToken> unreleased;  // with logprobs: taken, text not all released yet
  size_t n_probs_released = 0;            // tokens moved out of `unreleased` (released whole)
  bool done = false, word_stop = false;
  FinishReason finish = FinishReason::length;
  std::optional<ApiError> error;
  GenerationTimings timings;

  /// Takes an update: appends the text it releases, the ids of its tokens and the
  /// log-probability entries of the tokens whose text is now released whole to `rel`.
  void take(GenerationUpdate& u, Released& rel) {
    if (u.started) {
      slot = u.slot;
      n_cached = u.timings.n_cached;
    }
    std::string& text = rel.text;
    for (GeneratedToken& t : u.tokens) {
      if (filter.stopped()) break;  // tokens the engine made before it saw the cancel
      ++n_tokens;
      text += filter.push(srv.model.tok->token_to_piece(t.id));
      rel.ids.push_back(t.id);
      if (req.logprobs) unreleased.push_back(std::move(t));
      if (filter.stopped()) {
        word_stop = true;
        gen->cancel();
      }
      move_released(rel.probs);
    }
    if (u.done) {
      done = true;
      finish = u.finish;
      timings = u.timings;
      if (u.error) {
        error = ApiError{500, "server_error", *u.error};
      } else if (u.finish == FinishReason::cancelled && !word_stop) {
        error = kShuttingDown;
      } else {
        text += filter.flush();
        move_released(rel.probs);
      }
    }
  }

  /// Moves the tokens whose text the filter released whole to `probs`. After a stop string
  /// the rest (the stop string's tokens) are dropped.
  void move_released(std::vector<GeneratedToken>& probs) {
    if (!req.logprobs) return;
    while (n_probs_released < filter.n_released_pieces()) {
      probs.push_back(std::move(unreleased.front()));
      unreleased.pop_front();
      ++n_probs_released;
    }
    if (filter.stopped()) unreleased.clear();
  }

  std::string finish_reason() const {
    return word_stop || finish == FinishReason::eos ? "stop" : "length";
  }
  std::string stop_type() const {
    if (word_stop) return "word";
    return finish == FinishReason::eos ? "eos" : "limit";
  }

  json usage() const {
    const int64_t n_prompt = static_cast<int64_t>(req.gen.prompt.size());
    return json{{"prompt_tokens", n_prompt},
                {"completion_tokens", n_tokens},
                {"total_tokens", n_prompt + n_tokens},
                {"prompt_tokens_details", {{"cached_tokens", n_cached}}}};
  }

  json timings_json() const {
    auto per = [](double ms, int64_t n) { return n > 0 ? ms / static_cast<double>(n) : 0.0; };
    auto rate = [](double ms, int64_t n) {
      return ms > 0 ? 1e3 * static_cast<double>(n) / ms : 0.0;
    };
    return json{{"cache_n", n_cached},
                {"prompt_n", timings.n_evaluated},
                {"prompt_ms", timings.prompt_ms},
                {"prompt_per_token_ms", per(timings.prompt_ms, timings.n_evaluated)},
                {"prompt_per_second", rate(timings.prompt_ms, timings.n_evaluated)},
                {"predicted_n", n_tokens},
                {"predicted_ms", timings.predicted_ms},
                {"predicted_per_token_ms", per(timings.predicted_ms, n_tokens)},
                {"predicted_per_second", rate(timings.predicted_ms, n_tokens)}};
  }

  std::string piece_text(int32_t t) const { return srv.model.tok->token_to_piece(t); }

  // /v1/completions' text_offset of the next token with log-probabilities: characters of the
  // generated text before it. The tokens of a response come in order, each once (the whole
  // response's list, or a stream's chunks one after another), so the count carries over.
  mutable int64_t text_offset = 0;

  // Log-probabilities of `toks` in the endpoint's format (null when not asked for); for
  // /v1/completions OpenAI's legacy object, with text_offset (characters, from the start of the
  // generated text).
  json logprobs(const std::vector<GeneratedToken>& toks) const {
    if (!req.logprobs) return nullptr;
    if (req.endpoint == Endpoint::completions) {
      json tokens = json::array(), lps = json::array(), tops = json::array(),
           offsets = json::array();
      for (const GeneratedToken& t : toks) {
        const std::string p = piece_text(t.id);
        offsets.push_back(text_offset);
        // Characters (UTF-8 lead bytes) of the generated text before the next token.
        for (const char c : p) text_offset += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
        tokens.push_back(utf8::sanitize(p));
        lps.push_back(t.logprob);
        json top = json::object();
        for (const auto& [id, lp] : t.top) top[utf8::sanitize(piece_text(id))] = lp;
        tops.push_back(top);
      }
      return json{{"tokens", tokens},
                  {"token_logprobs", lps},
                  {"top_logprobs", tops},
                  {"text_offset", offsets}};
    }
    json content = json::array();
    for (const GeneratedToken& t : toks) content.push_back(token_json(t));
    return json{{"content", content}};
  }

  json token_json(const GeneratedToken& t) const {
    const std::string p = piece_text(t.id);
    json top = json::array();
    for (const auto& [id, lp] : t.top) {
      const std::string q = piece_text(id);
      json e = {{"token", utf8::sanitize(q)}, {"logprob", lp}, {"bytes", bytes_of(q)}};
      if (req.endpoint == Endpoint::native) e["id"] = id;
      top.push_back(e);
    }
    json e = {{"token", utf8::sanitize(p)},
              {"logprob", t.logprob},
              {"bytes", bytes_of(p)},
              {"top_logprobs", top}};
    if (req.endpoint == Endpoint::native) e["id"] = t.id;
    return e;
  }

  // --- OpenAI objects ---
  json base(const char* object) const {
    return json{{"id", id},
                {"object", object},
                {"created", created},
                {"model", srv.model.alias},
                {"system_fingerprint", "berth-0.1.0"}};
  }

  /// A streamed chunk: `delta` (chat) or `text` (completions), finish_reason or null.
  json chunk(const Released& rel, const json& finish) const {
    const std::string& text = rel.text;
    if (req.endpoint == Endpoint::native) {
      json j = {{"index", 0},
                {"content", text},
                {"stop", false},
                {"id_slot", slot},
                {"tokens_predicted", n_tokens},
                {"tokens_evaluated", static_cast<int64_t>(req.gen.prompt.size())}};
      j["tokens"] = req.return_tokens ? json(rel.ids) : json::array();
      if (req.logprobs) j["completion_probabilities"] = logprobs(rel.probs)["content"];
      return j;
    }
    json choice = {{"index", 0}, {"logprobs", logprobs(rel.probs)}, {"finish_reason", finish}};
    if (req.endpoint == Endpoint::chat) {
      choice["delta"] = finish.is_null() ? json{{"content", text}} : json::object();
      json j = base("chat.completion.chunk");
      j["choices"] = json::array({choice});
      return j;
    }
    choice["text"] = text;
    json j = base("text_completion");
    j["choices"] = json::array({choice});
    return j;
  }

  /// The native endpoint's final object (whole response, or the last event of a stream).
  json native_final(const Released& rel) const {
    const std::string& content = rel.text;
    const SamplerParams& sp = req.gen.sampling.sampler;
    json j = {{"index", 0},
              {"content", content},
              {"tokens", req.return_tokens ? json(rel.ids) : json::array()},
              {"id_slot", slot},
              {"stop", true},
              {"model", srv.model.alias},
              {"tokens_predicted", n_tokens},
              {"tokens_evaluated", static_cast<int64_t>(req.gen.prompt.size())},
              {"generation_settings",
               {{"n_predict", req.gen.max_tokens},
                {"temperature", sp.temp},
                {"top_k", sp.top_k},
                {"top_p", sp.top_p},
                {"min_p", sp.min_p},
                {"repeat_penalty", sp.repeat_penalty},
                {"repeat_last_n", sp.repeat_last_n},
                {"presence_penalty", req.gen.sampling.presence_penalty},
                {"frequency_penalty", req.gen.sampling.frequency_penalty},
                {"stop", req.stop},
                {"cache_prompt", req.gen.cache_prompt}}},
              {"prompt", req.prompt_text},
              {"has_new_line", content.find('\n') != std::string::npos},
              {"truncated", false},
              {"stop_type", stop_type()},
              {"stopping_word", filter.stop_word()},
              {"tokens_cached", n_cached},
              {"timings", timings_json()}};
    if (req.logprobs) j["completion_probabilities"] = logprobs(rel.probs)["content"];
    return j;
  }

  /// The whole (non-stream) response.
  json whole(const Released& rel) const {
    if (req.endpoint == Endpoint::native) return native_final(rel);
    const std::string& content = rel.text;
    json choice = {
        {"index", 0}, {"logprobs", logprobs(rel.probs)}, {"finish_reason", finish_reason()}};
    json j;
    if (req.endpoint == Endpoint::chat) {
      choice["message"] = {{"role", "assistant"}, {"content", content}};
      j = base("chat.completion");
    } else {
      choice["text"] = content;
      j = base("text_completion");
    }
    j["choices"] = json::array({choice});
    j["usage"] = usage();
    j["timings"] = timings_json();
    return j;
  }
};

/// Server-sent events of one streaming completion, written by cpp-httplib's content provider
/// on the connection's thread.
class EventStream {
 public:
  /// `first`: what Output::take released up to the first token (the handler waits for it
  /// before committing the status).
  EventStream(std::unique_ptr<Output> out, Released first)
      : out_(std::move(out)), first_(std::move(first)) {}

  /// Writes the whole stream; false when the client went away (the generation is cancelled).
  bool run(httplib::DataSink& sink) {
    Output& o = *out_;
    sink_ = &sink;
    if (o.req.endpoint == Endpoint::chat) {
      json j = o.base("chat.completion.chunk");
      j["choices"] = json::array({json{{"index", 0},
                                       {"delta", {{"role", "assistant"}, {"content", nullptr}}},
                                       {"logprobs", nullptr},
                                       {"finish_reason", nullptr}}});
      if (!write(sse(j))) return false;
    }
    const bool native_tokens = o.req.endpoint == Endpoint::native && o.req.return_tokens;
    // Not yet sent: text, token ids and log-probability entries (an entry goes out with its
    // token's text or after it, never before).
    Released rel = std::move(first_);
    while (true) {
      if (!rel.text.empty() || (native_tokens && !rel.ids.empty())) {
        if (!write(sse(o.chunk(rel, nullptr)))) return false;
        rel.clear();
      }
      if (o.done) return finish(rel);
      if (o.srv.stopping.load()) return end_with_error(kShuttingDown);
      GenerationUpdate u = o.gen->wait(kPoll);
      if (o.watch.gone()) {
        o.gen->cancel();
        return false;
      }
      o.take(u, rel);
      if (Clock::now() - last_write_ > std::chrono::duration<double>(o.srv.opt.ping_interval_s) &&
          !write(": ping\n\n"))
        return false;
    }
  }

 private:
  bool write(const std::string& s) {
    if (!sink_->write(s.data(), s.size())) {
      out_->gen->cancel();
      return false;
    }
    last_write_ = Clock::now();
    return true;
  }

  bool end_with_error(const ApiError& e) {
    if (!write(sse(error_json(e)))) return false;
    sink_->done();
    return true;
  }

  bool finish(Released& rel) {
    Output& o = *out_;
    if (o.error) return end_with_error(*o.error);
    rel.text.clear();  // sent already
    if (o.req.endpoint == Endpoint::native) {
      if (!write(sse(o.native_final(rel)))) return false;
      sink_->done();
      return true;
    }
    json last = o.chunk(rel, o.finish_reason());
    last["timings"] = o.timings_json();
    if (!write(sse(last))) return false;
    if (o.req.include_usage) {
      json u =
          o.base(o.req.endpoint == Endpoint::chat ? "chat.completion.chunk" : "text_completion");
      u["choices"] = json::array();
      u["usage"] = o.usage();
      if (!write(sse(u))) return false;
    }
    if (!write("data: [DONE]\n\n")) return false;
    sink_->done();
    return true;
  }

  std::unique_ptr<Output> out_;
  Released first_;
  httplib::DataSink* sink_ = nullptr;
  Clock::time_point last_write_ = Clock::now();
};

/// Waits for `o`'s end (or, with `first_token`, its first token), watching the client and the
/// server's stop, appending what it releases to `rel`. False when it answered `res` itself: 503
/// at a stop, or nothing (499) for a client that went away; the generation is cancelled then.
bool await(Output& o, httplib::Response& res, Released& rel, bool first_token) {
  while (!o.done && !(first_token && o.n_tokens > 0)) {
    if (o.srv.stopping.load()) {
      o.gen->cancel();
      send_error(res, kShuttingDown);
      return false;
    }
    GenerationUpdate u = o.gen->wait(kPoll);
    if (o.watch.gone()) {
      o.gen->cancel();
      log::debug("request {}: the client went away", o.id);
      res.status = 499;  // never reaches anyone
      return false;
    }
    o.take(u, rel);
  }
  return true;
}

}  // namespace

void HttpServer::Impl::completion(const httplib::Request& http, httplib::Response& res,
                                  const httplib::ContentReader& reader, Endpoint endpoint) {
  std::string body;
  if (!read_body(http, res, reader, opt.max_body_bytes, body)) return;
  std::unique_ptr<Output> out;
  try {
    CompletionRequest req = parse_completion(parse_body(body), endpoint, model);
    body.clear();
    body.shrink_to_fit();
    std::shared_ptr<Generation> gen;
    try {
      gen = engine->submit(req.gen);
    } catch (const Rejected& r) {
      throw rejection(r);
    }
    out = std::make_unique<Output>(*this, std::move(req), std::move(gen), http);
  } catch (const ApiError& e) {
    send_error(res, e);
    return;
  } catch (const Error& e) {
    send_error(res, ApiError{400, "invalid_request_error", printable(e.what(), 1000)});
    return;
  }

  if (out->req.stream) {
    // The status goes out with the first bytes, so wait for the first token (or the end)
    // before: a request that fails before it (the engine's error, a shutdown while it waits or
    // prefills) gets a real HTTP status, as without streaming. The client is watched meanwhile
    // (PeerWatch): one that hangs up while queued or in prefill frees its slot.
    Output& o = *out;
    Released first;
    if (!await(o, res, first, /*first_token=*/true)) return;
    if (o.error && o.n_tokens == 0) {
      send_error(res, *o.error);
      return;
    }
    auto stream = std::make_shared<EventStream>(std::move(out), std::move(first));
    res.status = 200;
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    res.set_chunked_content_provider(
        "text/event-stream",
        [stream](size_t, httplib::DataSink& sink) { return stream->run(sink); });
    return;
  }

  // Whole response: wait for the end, watching the client.
  Output& o = *out;
  Released all;
  if (!await(o, res, all, /*first_token=*/false)) return;
  if (o.error) {
    send_error(res, *o.error);
    return;
  }
  send_json(res, o.whole(all));
}

}  // namespace berth::server
