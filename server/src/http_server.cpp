#include <fmt/format.h>
#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "berth/core/error.h"
#include "berth/core/log.h"
#include "berth/core/strings.h"
#include "berth/models/utf8.h"
#include "http_internal.h"

namespace berth::server {

using json = nlohmann::json;

int64_t unix_time() { return static_cast<int64_t>(std::time(nullptr)); }

void send_json(httplib::Response& res, const json& j, int status) {
  res.status = status;
  res.set_content(j.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) {
  json err = {{"code", e.status}, {"message", e.message}, {"type", e.type}};
  for (const auto& [k, v] : e.extra.items()) err[k] = v;
  if (e.status == 503) res.set_header("Retry-After", "1");
  send_json(res, json{{"error", err}}, e.status);
}

bool read_body(const httplib::Request& req, httplib::Response& res,
               const httplib::ContentReader& reader, size_t max, std::string& body) {
  // A request with neither Content-Length nor Transfer-Encoding has no body (RFC 9112, 6.3);
  // reading one would wait for the client to close or the read timeout.
  if (!req.has_header("Content-Length") && !req.has_header("Transfer-Encoding")) return true;
  bool too_big = false;
  const bool ok = reader([&](const char* data, size_t n) {
    if (body.size() + n > max) {
      too_big = true;
      return false;
    }
    body.append(data, n);
    return true;
  });
  if (too_big || res.status == 413) {
    const std::string len = req.get_header_value("Content-Length");
    res.set_header("Connection", "close");
    send_error(
        res, ApiError{413, "invalid_request_error",
                      fmt::format("the request body{} is over the limit of {} bytes",
                                  len.empty() ? "" : " of " + printable(len, 40) + " bytes", max)});
    return false;
  }
  if (!ok) {
    res.set_header("Connection", "close");
    send_error(res, ApiError{400, "invalid_request_error", "the request body could not be read"});
    return false;
  }
  return true;
}

HttpServer::Impl::Impl(ServerOptions o)
    : opt(std::move(o)), svr(std::make_unique<HttplibServer>()) {
  std::random_device rd;
  static constexpr char kAlnum[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  for (int i = 0; i < 12; ++i) id_seed += kAlnum[rd() % 62];
}

std::string HttpServer::Impl::next_id(const char* prefix) {
  return fmt::format("{}{}{:012d}", prefix, id_seed, counter.fetch_add(1) + 1);
}

bool HttpServer::Impl::wrong_method(const httplib::Request& req, httplib::Response& res) const {
  const auto it = allow.find(req.path);
  if (it == allow.end()) return false;
  res.set_header("Allow", it->second);
  send_error(res, ApiError{405, "invalid_request_error",
                           fmt::format("method {} is not allowed on {} (it answers {})",
                                       printable(req.method, 20), req.path, it->second)});
  return true;
}

namespace {

bool is_public(const std::string& path) {
  return path == "/health" || path == "/v1/health" || path == "/v1/models" || path == "/models";
}

// Constant-time comparison, so the key cannot be guessed byte by byte from response times.
bool same_secret(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i)
    diff |= static_cast<unsigned char>(a[i] ^ b[i % std::max<size_t>(b.size(), 1)]);
  return diff == 0 && !b.empty();
}

json tokens_with_pieces(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  json arr = json::array();
  for (int32_t id : ids) {
    const std::string piece = tok.token_to_piece(id, true);
    json p;
    if (utf8::is_valid(piece)) {
      p = piece;
    } else {
      p = json::array();
      for (unsigned char c : piece) p.push_back(static_cast<int>(c));
    }
    arr.push_back({{"id", id}, {"piece", p}});
  }
  return arr;
}

// cpp-httplib's task queue with threads added while every thread is busy, up to `max`: a
// connection holds its thread until it closes or stays silent past the read timeout, so a fixed
// pool lets a few clients that send their requests slowly (a byte every few seconds) leave none
// for /health or anyone else. At most `max` threads; one beyond the `base` ones that has waited
// `retire_after` for a connection ends.
class GrowingPool : public httplib::TaskQueue {
 public:
  GrowingPool(size_t base, size_t max, std::chrono::milliseconds retire_after,
              std::atomic<int64_t>* n_live)
      : base_(std::max<size_t>(base, 1)),
        max_(std::max(base_, max)),
        retire_after_(retire_after),
        n_live_(n_live) {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < base_; ++i) spawn();
  }
  ~GrowingPool() override = default;

  void enqueue(std::function<void()> fn) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(std::move(fn));
      if (idle_ < jobs_.size() && live_ < max_) spawn();
    }
    cv_.notify_one();
  }

  // Runs what is queued, then waits until every thread has ended (they are detached: a thread
  // past its idle time ends on its own, so none is left to join).
  void shutdown() override {
    std::unique_lock<std::mutex> lock(mu_);
    shutdown_ = true;
    cv_.notify_all();
    // No thread is added after shutdown_ (enqueue runs on the listener, which has stopped).
    ended_.wait(lock, [&] { return live_ == 0; });
  }

 private:
  // A new thread counts as idle from here, before it first waits: a job enqueued while it starts
  // is its job, so the pool does not add another for it.
  void spawn() {  // mu_ held
    ++idle_;
    n_live_->store(static_cast<int64_t>(++live_));
    std::thread([this] { work(); }).detach();
  }
  void work() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {  // idle_ counts this thread here
      const bool woken =
          cv_.wait_for(lock, retire_after_, [&] { return !jobs_.empty() || shutdown_; });
      if (jobs_.empty()) {
        // Shut down with nothing left, or idle too long beyond the base threads: end. The last
        // touch of the pool is here, under mu_ (shutdown() returns only after this unlocks).
        if (shutdown_ || (!woken && live_ > base_)) {
          --idle_;
          n_live_->store(static_cast<int64_t>(--live_));
          if (live_ == 0) ended_.notify_all();
          return;
        }
        continue;
      }
      --idle_;
      std::function<void()> fn = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      fn();
      fn = nullptr;  // the task's captures go before the lock is taken again
      lock.lock();
      ++idle_;
    }
  }

  const size_t base_, max_;
  const std::chrono::milliseconds retire_after_;
  std::atomic<int64_t>* const n_live_;  // the server's count (it outlives the pool)
  std::mutex mu_;
  std::condition_variable cv_, ended_;
  std::deque<std::function<void()>> jobs_;
  size_t live_ = 0, idle_ = 0;
  bool shutdown_ = false;
};

}  // namespace

void HttpServer::Impl::routes() {
  httplib::Server& s = *svr;
  // cpp-httplib 0.11's default sets SO_REUSEPORT: a second server on a port in use would bind
  // too and share the traffic. SO_REUSEADDR alone lets a restart reuse a port in TIME_WAIT and
  // makes a port that another process listens on fail to bind, as llama-server does.
  s.set_socket_options([](auto sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  s.set_payload_max_length(opt.max_body_bytes);
  s.set_default_headers({{"Access-Control-Allow-Origin", "*"}});
  const int n_threads = opt.n_http_threads > 0
                            ? opt.n_http_threads
                            : std::min(std::max(opt.n_slots_hint, 1) + opt.queue_hint + 8, 512);
  const int max_threads = std::max(n_threads, opt.max_http_threads);
  const std::chrono::milliseconds retire(std::max(opt.http_thread_retire_ms, 1));
  s.new_task_queue = [this, n_threads, max_threads, retire] {
    return new GrowingPool(static_cast<size_t>(n_threads), static_cast<size_t>(max_threads), retire,
                           &http_threads);
  };

  s.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    n_requests.fetch_add(1, std::memory_order_relaxed);
    static const char* kMethods[] = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"};
    if (std::none_of(std::begin(kMethods), std::end(kMethods),
                     [&](const char* m) { return req.method == m; })) {
      res.set_header("Connection", "close");
      send_error(res, ApiError{404, "not_found_error",
                               fmt::format("method {} is not served", printable(req.method, 20))});
      return httplib::Server::HandlerResponse::Handled;
    }
    if (req.is_multipart_form_data()) {
      res.set_header("Connection", "close");
      send_error(res, ApiError{400, "invalid_request_error",
                               "multipart bodies are not accepted: send a JSON object"});
      return httplib::Server::HandlerResponse::Handled;
    }
    // Content-Length, judged before any of the body is read: values that disagree make the
    // body's end ambiguous (RFC 9112, 6.3: a request smuggling risk), and a length over the limit
    // is refused at once (cpp-httplib would first read and discard that many bytes, waiting for
    // a client that never sends them until its read timeout).
    // Transfer codings: chunked alone is read (cpp-httplib); any other coding is 501 (RFC 9112,
    // 6.1), and a message with both Transfer-Encoding and Content-Length is refused (6.3: the
    // body's end would be ambiguous between hops) rather than read by one and kept alive.
    if (req.has_header("Transfer-Encoding")) {
      std::string te = req.get_header_value("Transfer-Encoding");
      std::transform(te.begin(), te.end(), te.begin(),
                     [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      if (req.get_header_value_count("Transfer-Encoding") > 1 || te != "chunked") {
        res.set_header("Connection", "close");
        send_error(res,
                   ApiError{501, "not_supported_error",
                            fmt::format("Transfer-Encoding '{}' is not supported (chunked is)",
                                        printable(req.get_header_value("Transfer-Encoding"), 60))});
        return httplib::Server::HandlerResponse::Handled;
      }
      if (req.has_header("Content-Length")) {
        res.set_header("Connection", "close");
        send_error(res, ApiError{400, "invalid_request_error",
                                 "the request has both Transfer-Encoding and Content-Length"});
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    if (const size_t n_len = req.get_header_value_count("Content-Length"); n_len > 0) {
      const std::string len = req.get_header_value("Content-Length", 0);
      bool bad = len.empty() || len.size() > 19 ||
                 !std::all_of(len.begin(), len.end(), [](char c) { return c >= '0' && c <= '9'; });
      for (size_t i = 1; i < n_len; ++i)
        bad = bad || req.get_header_value("Content-Length", i) != len;
      if (bad) {
        res.set_header("Connection", "close");
        send_error(res, ApiError{400, "invalid_request_error",
                                 n_len > 1 ? "the request has Content-Length values that disagree"
                                           : fmt::format("Content-Length '{}' is not a length",
                                                         printable(len, 40))});
        return httplib::Server::HandlerResponse::Handled;
      }
      if (std::stoull(len) > opt.max_body_bytes) {
        res.set_header("Connection", "close");
        send_error(res, ApiError{413, "invalid_request_error",
                                 fmt::format("the request body of {} bytes is over the limit of {} "
                                             "bytes",
                                             len, opt.max_body_bytes)});
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    // A CORS preflight (OPTIONS with Access-Control-Request-Method) of a route: 204 naming the
    // methods it answers, before the API key check (browsers send a preflight without
    // credentials). Every response carries Access-Control-Allow-Origin: * (as llama-server's),
    // so a page of another origin can call the server; the API key still guards the routes.
    if (req.method == "OPTIONS" && req.has_header("Access-Control-Request-Method")) {
      if (const auto it = allow.find(req.path); it != allow.end()) {
        res.status = 204;
        res.set_header("Access-Control-Allow-Methods", it->second + ", OPTIONS");
        const std::string asked = req.get_header_value("Access-Control-Request-Headers");
        res.set_header("Access-Control-Allow-Headers",
                       asked.empty() || asked.size() > 1000
                           ? std::string("Authorization, Content-Type, X-Api-Key")
                           : asked);
        res.set_header("Access-Control-Max-Age", "86400");
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    if (!opt.api_key.empty() && !is_public(req.path)) {
      std::string key = req.get_header_value("X-Api-Key");
      const std::string auth = req.get_header_value("Authorization");
      // The scheme is case-insensitive (RFC 9110, 11.1).
      if (key.empty() && auth.size() > 7 &&
          std::equal(auth.begin(), auth.begin() + 7, "bearer ", [](char a, char b) {
            return std::tolower(static_cast<unsigned char>(a)) == b;
          }))
        key = auth.substr(7);
      if (!same_secret(key, opt.api_key)) {
        res.set_header("Connection", "close");         // the body, if any, stays unread
        res.set_header("WWW-Authenticate", "Bearer");  // a 401 names its scheme (RFC 9110, 11.6.1)
        send_error(res, ApiError{401, "authentication_error", "Invalid API Key"});
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    if (!ready.load() && req.path != "/health" && req.path != "/v1/health") {
      res.set_header("Connection", "close");
      send_error(res, ApiError{503, "unavailable_error", "Loading model"});
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });

  // Fills a JSON body into errors cpp-httplib answers itself (unknown route 404, a malformed
  // request line 400, 414, 413); leaves the ones berth wrote alone.
  s.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request&,
                                                                  httplib::Response& res) {
    n_errors.fetch_add(1, std::memory_order_relaxed);
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    ApiError e;
    e.status = res.status;
    if (res.status == 404) {
      e.type = "not_found_error";
      e.message = "File Not Found";
    } else if (res.status == 413) {
      e.message = fmt::format("the request body is over the limit of {} bytes", opt.max_body_bytes);
    } else if (res.status >= 500) {
      e.type = "server_error";
      e.message = "internal server error";
    } else {
      e.message = fmt::format("bad request (HTTP {})", res.status);
    }
    send_error(res, e);
    return httplib::Server::HandlerResponse::Handled;
  }));
  s.set_logger([](const httplib::Request& req, const httplib::Response& res) {
    log::info("{} {} {} -> {}", req.remote_addr, printable(req.method, 16),
              printable(req.path, 200), res.status);
  });
  s.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        log::error("HTTP handler failed: {}", what);
        send_error(res, ApiError{500, "server_error", printable(what, 500)});
      });

  // Routes, each recorded in `allow` (cpp-httplib answers HEAD with a GET route).
  auto get = [this](const char* path, httplib::Server::Handler h) {
    allow[path] = "GET, HEAD";
    svr->Get(path, std::move(h));
  };
  auto post = [this](const char* path, httplib::Server::HandlerWithContentReader h) {
    allow[path] = "POST";
    svr->Post(path, std::move(h));
  };

  get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (!ready.load())
      send_error(res, ApiError{503, "unavailable_error", "Loading model"});
    else
      send_json(res, json{{"status", "ok"}});
  });
  get("/v1/health", [this](const httplib::Request&, httplib::Response& res) {
    if (!ready.load())
      send_error(res, ApiError{503, "unavailable_error", "Loading model"});
    else
      send_json(res, json{{"status", "ok"}});
  });
  auto models = [this](const httplib::Request&, httplib::Response& res) {
    send_json(res, json{{"object", "list"},
                        {"data", json::array({json{{"id", model.alias},
                                                   {"object", "model"},
                                                   {"created", unix_time()},
                                                   {"owned_by", "berth"},
                                                   {"meta",
                                                    {{"n_vocab", model.n_vocab},
                                                     {"n_ctx_train", model.n_ctx_train},
                                                     {"n_embd", model.n_embd},
                                                     {"n_layer", model.n_layer},
                                                     {"size", model.file_size}}}}})}});
  };
  get("/v1/models", models);
  get("/models", models);

  get("/props", [this](const httplib::Request&, httplib::Response& res) {
    const SamplerParams d;
    send_json(res, json{{"default_generation_settings",
                         {{"n_ctx", engine->n_ctx_per_slot()},
                          {"params",
                           {{"temperature", d.temp},
                            {"top_k", d.top_k},
                            {"top_p", d.top_p},
                            {"min_p", d.min_p},
                            {"repeat_penalty", d.repeat_penalty},
                            {"repeat_last_n", d.repeat_last_n},
                            {"presence_penalty", 0.0},
                            {"frequency_penalty", 0.0},
                            {"n_predict", -1},
                            {"seed", -1}}}}},
                        {"total_slots", engine->n_slots()},
                        {"model_path", model.model_path},
                        {"model_alias", model.alias},
                        {"chat_template", model.chat_template},
                        {"chat_format", std::string(chat_format_name(model.chat_format))},
                        {"modalities", {{"vision", false}, {"audio", false}}},
                        {"build_info", "berth 0.1.0"}});
  });
  get("/slots", [this](const httplib::Request&, httplib::Response& res) {
    json arr = json::array();
    for (const SlotInfo& si : engine->slots())
      arr.push_back({{"id", si.id},
                     {"n_ctx", si.n_ctx},
                     {"is_processing", si.is_processing},
                     {"id_task", si.is_processing ? json(si.id_task) : json(nullptr)},
                     {"tokens_cached", si.n_cached}});
    send_json(res, arr);
  });
  get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    if (!opt.metrics) {
      send_error(res, ApiError{501, "not_supported_error",
                               "This server does not support metrics endpoint. Start it with "
                               "`--metrics`"});
      return;
    }
    const EngineMetrics m = engine->metrics();
    std::string out;
    auto metric = [&](const char* name, const char* type, const char* help, double v) {
      out += fmt::format("# HELP berth:{0} {1}\n# TYPE berth:{0} {2}\nberth:{0} {3}\n", name, help,
                         type, v);
    };
    metric("prompt_tokens_total", "counter", "Prompt tokens evaluated.",
           static_cast<double>(m.prompt_tokens_total));
    metric("prompt_seconds_total", "counter", "Prefill time.", m.prompt_seconds_total);
    metric("prompt_tokens_cached_total", "counter", "Prompt tokens reused from slot caches.",
           static_cast<double>(m.n_cached_total));
    metric("tokens_predicted_total", "counter", "Tokens generated.",
           static_cast<double>(m.tokens_predicted_total));
    metric("tokens_predicted_seconds_total", "counter", "Decode time.",
           m.tokens_predicted_seconds_total);
    metric("n_decode_total", "counter", "Forward steps (prefill chunks and decode steps).",
           static_cast<double>(m.n_decode_total));
    metric("step_slots_total", "counter",
           "Slots carried by forward steps, summed (/ n_decode_total: the mean batch).",
           static_cast<double>(m.n_step_seqs_total));
    metric("step_slots_max", "gauge", "The most slots one forward step carried.",
           static_cast<double>(m.max_step_seqs));
    metric("decode_steps_total", "counter", "Forward steps of decode tokens only.",
           static_cast<double>(m.decode_steps_total));
    metric("decode_rows_total", "counter", "Decode tokens of those steps.",
           static_cast<double>(m.decode_rows_total));
    metric("decode_step_seconds_total", "counter", "Forward time of those steps.",
           m.decode_step_seconds_total);
    metric("decode_intervals_total", "counter",
           "Decode-only steps followed by another step (start to next start).",
           static_cast<double>(m.decode_intervals_total));
    metric("decode_interval_seconds_total", "counter",
           "Start of a decode-only step to the start of the next, summed.",
           m.decode_interval_seconds_total);
    metric("requests_processing", "gauge", "Requests in a slot.",
           static_cast<double>(m.requests_processing));
    metric("requests_deferred", "gauge", "Requests waiting for a slot.",
           static_cast<double>(m.requests_deferred));
    metric("http_requests_total", "counter", "HTTP requests received.",
           static_cast<double>(n_requests.load()));
    metric("http_errors_total", "counter", "HTTP responses with a status of 400 or more.",
           static_cast<double>(n_errors.load()));
    metric("http_threads", "gauge", "HTTP worker threads alive.",
           static_cast<double>(http_threads.load()));
    res.status = 200;
    res.set_content(out, "text/plain; version=0.0.4");
  });

  for (const char* p : {"/v1/chat/completions", "/chat/completions"})
    post(p, [this](const httplib::Request& req, httplib::Response& res,
                   const httplib::ContentReader& r) { completion(req, res, r, Endpoint::chat); });
  for (const char* p : {"/v1/completions", "/completions"})
    post(p, [this](const httplib::Request& req, httplib::Response& res,
                   const httplib::ContentReader& r) {
      completion(req, res, r, Endpoint::completions);
    });
  post("/completion",
       [this](const httplib::Request& req, httplib::Response& res,
              const httplib::ContentReader& r) { completion(req, res, r, Endpoint::native); });

  // /tokenize, /detokenize, /apply-template: small JSON in, JSON out.
  auto simple = [this, &post](const char* path, std::function<json(const json&)> fn) {
    post(path, [this, fn](const httplib::Request& req, httplib::Response& res,
                          const httplib::ContentReader& reader) {
      std::string body;
      if (!read_body(req, res, reader, opt.max_body_bytes, body)) return;
      try {
        send_json(res, fn(parse_body(body)));
      } catch (const ApiError& e) {
        send_error(res, e);
      } catch (const Error& e) {
        send_error(res, ApiError{400, "invalid_request_error", printable(e.what(), 1000)});
      }
    });
  };
  simple("/tokenize", [this](const json& j) {
    auto it = j.find("content");
    if (it == j.end() || !it->is_string())
      throw ApiError{400, "invalid_request_error", "'content' must be a string"};
    auto flag = [&](const char* key, bool def) {
      auto f = j.find(key);
      if (f == j.end() || f->is_null()) return def;
      if (!f->is_boolean())
        throw ApiError{400, "invalid_request_error",
                       fmt::format("'{}' must be true or false", key)};
      return f->get<bool>();
    };
    const std::vector<int32_t> ids = model.tok->encode(
        it->get<std::string>(), flag("add_special", false), flag("parse_special", true));
    if (flag("with_pieces", false)) return json{{"tokens", tokens_with_pieces(*model.tok, ids)}};
    return json{{"tokens", ids}};
  });
  simple("/detokenize", [this](const json& j) {
    auto it = j.find("tokens");
    if (it == j.end() || !it->is_array())
      throw ApiError{400, "invalid_request_error", "'tokens' must be an array of token ids"};
    std::vector<int32_t> ids;
    for (size_t i = 0; i < it->size(); ++i) {
      const json& t = (*it)[i];
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= model.n_vocab)
        throw ApiError{
            400, "invalid_request_error",
            fmt::format("'tokens[{}]' must be a token id in 0..{}", i, model.n_vocab - 1)};
      ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
    return json{{"content", utf8::sanitize(model.tok->decode(ids))}};
  });
  simple("/apply-template", [this](const json& j) {
    const std::vector<ChatMessage> msgs = parse_messages(j);
    const ChatOptions options = parse_chat_options(j);
    std::vector<ChatPiece> pieces;
    try {
      pieces = render_chat(model.chat_format, msgs, true, options);
    } catch (const Error& e) {
      throw ApiError{400, "invalid_request_error", fmt::format("'messages': {}", e.what())};
    }
    return json{{"prompt", chat_text(pieces)}};
  });

  // Anything else: 405 on a route that answers other methods (Allow names them), 404 on any
  // other path; after reading (at most max_body_bytes of) the body where there is one.
  auto not_routed = [this](const httplib::Request& req, httplib::Response& res) {
    if (!wrong_method(req, res))
      send_error(res, ApiError{404, "not_found_error", "File Not Found"});
  };
  auto not_routed_body = [this, not_routed](const httplib::Request& req, httplib::Response& res,
                                            const httplib::ContentReader& reader) {
    std::string body;
    if (!read_body(req, res, reader, opt.max_body_bytes, body)) return;
    not_routed(req, res);
  };
  s.Get(".*", not_routed);  // GET and HEAD
  s.Options(".*", not_routed);
  s.Post(".*", not_routed_body);
  s.Put(".*", not_routed_body);
  s.Patch(".*", not_routed_body);
  s.Delete(".*", not_routed_body);
}

HttpServer::HttpServer(ServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  impl_->routes();
}

int64_t HttpServer::http_threads() const { return impl_->http_threads.load(); }

HttpServer::~HttpServer() {
  stop();
  wait();
}

int HttpServer::bind() {
  Impl& m = *impl_;
  if (m.opt.port == 0) {
    port_ = m.svr->bind_to_any_port(m.opt.host);
  } else if (m.svr->bind_to_port(m.opt.host, m.opt.port)) {
    port_ = m.opt.port;
  } else {
    port_ = -1;
  }
  if (port_ <= 0)
    throw Error(ErrorCategory::io, fmt::format("cannot listen on {}:{} (in use, or not an address "
                                               "of this machine)",
                                               m.opt.host, m.opt.port));
  ::listen(m.svr->listening_socket(), SOMAXCONN);  // a longer accept queue (see HttplibServer)
  return port_;
}

void HttpServer::start() {
  Impl& m = *impl_;
  m.started.store(true);
  m.thread = std::thread([&m] {
    m.svr->listen_after_bind();
    m.finished.store(true);
  });
}

void HttpServer::set_ready(ModelContext model, Engine& engine) {
  impl_->model = std::move(model);
  impl_->engine = &engine;
  impl_->ready.store(true);
}

void HttpServer::begin_shutdown() {
  Impl& m = *impl_;
  if (m.engine) m.engine->close();
  m.draining.store(true);  // after close(): draining() implies refusals
}

void HttpServer::shutdown(std::chrono::milliseconds grace) {
  Impl& m = *impl_;
  using Clock = std::chrono::steady_clock;
  begin_shutdown();
  if (m.engine) {
    const auto until = Clock::now() + grace;
    auto idle = [&] { return m.engine->n_in_flight() == 0 && m.active.load() == 0; };
    while (!idle() && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (!idle()) {
      log::warn("shutdown: cancelling {} requests still running after {} ms",
                m.engine->n_in_flight(), grace.count());
      m.engine->cancel_all();
      const auto hard = Clock::now() + std::chrono::seconds(5);
      while (m.active.load() > 0 && Clock::now() < hard)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  stop();
  wait();
}

bool HttpServer::draining() const { return impl_->draining.load(); }

void HttpServer::stop() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.stop_mu);
  if (!m.started.load()) return;
  // httplib::Server::stop() acts only once the listener runs, and must be called once.
  while (!m.finished.load()) {
    if (!m.stop_called && m.svr->is_running()) {
      m.stop_called = true;
      m.stopping.store(true);  // open streams and waiting handlers end
      m.svr->stop();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void HttpServer::wait() {
  if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace berth::server
