// `berth serve`'s HTTP server: llama-server's endpoints and OpenAI's wire format over an Engine,
// with cpp-httplib (a thread per live connection) and nlohmann-json.
//
// Endpoints: GET /health, /v1/models (and /models), /props, /slots, /metrics; POST
// /v1/chat/completions (and /chat/completions), /v1/completions (and /completions),
// /completion, /tokenize, /detokenize, /apply-template. Errors are
// {"error":{"code","message","type"}} with the HTTP status (400 invalid_request_error or
// exceed_context_size_error, 401 authentication_error, 404 not_found_error, 405
// invalid_request_error with an Allow header for a method a route does not answer, 413, 500
// server_error, 501 not_supported_error, 503 unavailable_error). A completion request is
// checked, tokenized and accepted by the engine before any byte of the response is written, so
// every refusal has its real status, streaming or not; after a stream began, an error is an
// event `data: {"error":{...}}`.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "berth/server/api.h"
#include "berth/server/engine.h"

namespace httplib {
class Server;
}

namespace berth::server {

struct ServerOptions {
  std::string host = "127.0.0.1";            ///< --host
  int port = 8080;                           ///< --port; 0: an ephemeral port (bind() returns it)
  std::string api_key;                       ///< --api-key; empty: no authentication
  bool metrics = false;                      ///< --metrics: serve GET /metrics
  size_t max_body_bytes = size_t{16} << 20;  ///< larger request bodies get 413
  /// HTTP worker threads started with the server (one per live connection). 0: n_slots + queue
  /// + 8 (at most 512), so every request the engine can hold has a thread and a few more answer
  /// /health, refusals and the like. While every thread is busy (slow or idle keep-alive
  /// clients hold theirs until the read timeout) a connection gets a new thread, up to
  /// max_http_threads in all; beyond that it waits, unanswered, until one is free.
  int n_http_threads = 0;
  int max_http_threads = 1024;
  /// A thread beyond n_http_threads that has had no connection for this long ends, so a burst
  /// of connections does not keep its threads for the server's life; milliseconds.
  int http_thread_retire_ms = 30000;
  int n_slots_hint = 1, queue_hint = 64;  ///< for the automatic n_http_threads
  /// Seconds between SSE comments (": ping") on a stream that has nothing else to send; they
  /// keep proxies from timing out and let a vanished client be noticed.
  double ping_interval_s = 1.0;
};

/// The server. Lifecycle: construct, bind() (answers /health 503 "Loading model" and every
/// other route 503 from then on), start(), set_ready() once the engine exists (then every
/// route answers), shutdown() or stop(), and destruction. Thread-safe.
class HttpServer {
 public:
  explicit HttpServer(ServerOptions options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  /// Binds options.host:options.port and returns the port. Throws Error(io) naming the address
  /// when it cannot be bound.
  int bind();
  /// Serves on a thread of its own (after bind()).
  void start();
  /// The model is loaded: from now on requests reach `engine`. `model` and `engine` must
  /// outlive the server (or its stop()).
  void set_ready(ModelContext model, Engine& engine);

  /// First half of shutdown(): from its return on, new completion requests are refused (503).
  /// Idempotent; shutdown() calls it.
  void begin_shutdown();

  /// Graceful end (SIGTERM): refuses new completion requests (503), lets the ones in flight
  /// finish for up to `grace`, then cancels the rest (a stream then ends with an error event),
  /// waits for their responses to be written, and stops listening. Returns after the
  /// listener thread ended.
  void shutdown(std::chrono::milliseconds grace);
  /// True once shutdown() began (completion requests are refused from then on).
  bool draining() const;
  /// Stops at once: open streams end where they are.
  void stop();
  /// Blocks until the listener thread ended (after shutdown() or stop()).
  void wait();

  int port() const { return port_; }
  /// The HTTP worker threads alive now (0 before start() has made the pool).
  int64_t http_threads() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace berth::server
