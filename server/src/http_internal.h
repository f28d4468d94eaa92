// Shared by the HTTP server's translation units: the server's state and helpers.
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "berth/server/api.h"
#include "berth/server/engine.h"
#include "berth/server/server.h"

namespace berth::server {

/// Watches the socket of the connection a request came on, so that a handler waiting for the
/// engine notices a client that went away without writing to it (cpp-httplib 0.11 tells only
/// when a write fails). The socket is found by its addresses among the process's descriptors
/// (Linux /proc/self/fd); it stays open while the handler runs, so the match cannot be another
/// connection. When it cannot be found, gone() is always false and a failed write tells.
class PeerWatch {
 public:
  explicit PeerWatch(const httplib::Request& req);
  /// True when the peer closed or reset the connection (poll: POLLRDHUP, POLLHUP or POLLERR).
  bool gone() const;
  bool watching() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

/// Counts a response being produced (HttpServer::shutdown waits for none).
class ActiveGuard {
 public:
  explicit ActiveGuard(std::atomic<int64_t>& n) : n_(&n) { n_->fetch_add(1); }
  ~ActiveGuard() {
    if (n_) n_->fetch_sub(1);
  }
  ActiveGuard(ActiveGuard&& o) noexcept : n_(o.n_) { o.n_ = nullptr; }
  ActiveGuard(const ActiveGuard&) = delete;
  ActiveGuard& operator=(const ActiveGuard&) = delete;
  ActiveGuard& operator=(ActiveGuard&&) = delete;

 private:
  std::atomic<int64_t>* n_;
};

/// cpp-httplib's server with access to its listening socket: 0.11 listens with a backlog of 5
/// (CPPHTTPLIB_LISTEN_BACKLOG, compiled into Debian's library), and connections beyond the
/// accept queue in a burst wait for retransmissions or fail; bind() raises it to SOMAXCONN.
class HttplibServer : public httplib::Server {
 public:
  int listening_socket() const { return svr_sock_; }
};

struct HttpServer::Impl {
  ServerOptions opt;
  std::unique_ptr<HttplibServer> svr;
  std::thread thread;
  std::atomic<bool> started{false}, finished{false};
  std::mutex stop_mu;
  bool stop_called = false;  // guarded by stop_mu
  std::atomic<bool> ready{false};
  std::atomic<bool> draining{false};
  std::atomic<bool> stopping{false};  // stop(): handlers still waiting give up
  ModelContext model;                 // written once, before ready
  Engine* engine = nullptr;           // written once, before ready
  std::atomic<int64_t> active{0};
  std::atomic<uint64_t> counter{0};
  std::string id_seed;  // random, per process: response ids are id_seed + counter
  std::atomic<int64_t> n_requests{0}, n_errors{0};
  std::atomic<int64_t> http_threads{0};  ///< the HTTP task pool's live threads
  /// The methods each route answers, by path ("GET, HEAD" or "POST"): written by routes().
  std::map<std::string, std::string> allow;

  explicit Impl(ServerOptions o);
  void routes();
  /// A route that exists but does not answer req.method: 405 with its methods in Allow, and
  /// true; false for a path that is no route.
  bool wrong_method(const httplib::Request& req, httplib::Response& res) const;
  /// "chatcmpl-…" / "cmpl-…": the prefix, then 24 characters unique in this process.
  std::string next_id(const char* prefix);

  // Completions (completions.cpp).
  void completion(const httplib::Request& req, httplib::Response& res,
                  const httplib::ContentReader& reader, Endpoint endpoint);
};

/// Writes `e` as {"error":{"code","message","type",...extra}} with its status; a 503 gets
/// Retry-After: 1.
void send_error(httplib::Response& res, const ApiError& e);
void send_json(httplib::Response& res, const nlohmann::json& j, int status = 200);
/// Reads a request body of at most `max` bytes (also chunked or compressed ones: cpp-httplib
/// 0.11 bounds only a Content-Length). On failure answers 413 or 400 and returns false.
bool read_body(const httplib::Request& req, httplib::Response& res,
               const httplib::ContentReader& reader, size_t max, std::string& body);
/// Seconds since the epoch.
int64_t unix_time();

}  // namespace berth::server
