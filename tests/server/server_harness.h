// Helpers of the server tests: a real server in this process on an ephemeral port of 127.0.0.1,
// HTTP clients (cpp-httplib, and raw sockets for requests no well-behaved client sends), SSE
// parsing, and the small synthetic models the tests need.
#pragma once

#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "berth/io/gguf.h"
#include "berth/models/chat.h"
#include "berth/models/model.h"
#include "berth/models/tokenizer.h"
#include "berth/server/batch_engine.h"
#include "berth/server/server.h"
#include "berth/tools/synth.h"
#include "test_util.h"

namespace berth::test {

using json = nlohmann::json;

/// A model file loaded the way `berth serve` loads it.
struct LoadedModel {
  explicit LoadedModel(const std::string& path)
      : file(gguf::File::open(path)), model(load_model(file)), tok(Tokenizer::from_gguf(file)) {
    ctx.tok = tok.get();
    ctx.chat_template = file.get_string_opt("tokenizer.chat_template").value_or("");
    ctx.chat_format = ctx.chat_template.empty() ? ChatFormat::chatml : chat_format_for(file, "");
    ctx.chat_stop_ids = chat_stop_ids(*tok, ctx.chat_format);
    ctx.model_path = path;
    ctx.alias = "test-model";
    ctx.n_vocab = model->hparams().n_vocab;
    ctx.n_ctx_train = model->hparams().n_ctx_train;
    ctx.n_embd = model->hparams().n_embd;
    ctx.n_layer = model->hparams().n_layer;
    ctx.file_size = file.file_size();
  }
  gguf::File file;
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tok;
  server::ModelContext ctx;
};

/// stories260K loaded once for the whole test binary (the suites share it: nothing mutates it).
inline const LoadedModel& stories() {
  static LoadedModel m(stories260k().string());
  return m;
}

/// The prompt the stories260K goldens continue.
inline const std::string kOnce = "Once upon a time";

struct ServerConfig {
  int32_t n_slots = 1;
  int64_t n_ctx = 1024;  ///< total
  int32_t queue = 64;
  int32_t n_ubatch = 512;
  std::string api_key;
  bool metrics = false;
  size_t max_body_bytes = size_t{16} << 20;
  int http_thread_retire_ms = 30000;
};

/// A server over `m` on 127.0.0.1 and an ephemeral port, ready when constructed.
class TestServer {
 public:
  TestServer(const LoadedModel& m, const ServerConfig& c) {
    server::BatchEngineOptions eo;
    eo.n_slots = c.n_slots;
    eo.n_ctx = c.n_ctx;
    eo.queue_limit = c.queue;
    eo.session.n_threads = 1;
    eo.session.n_ubatch = c.n_ubatch;
    engine = std::make_unique<server::BatchEngine>(*m.model, *m.tok, eo);
    server::ServerOptions so;
    so.host = "127.0.0.1";
    so.port = 0;
    so.api_key = c.api_key;
    so.metrics = c.metrics;
    so.max_body_bytes = c.max_body_bytes;
    so.http_thread_retire_ms = c.http_thread_retire_ms;
    so.n_slots_hint = c.n_slots;
    so.queue_hint = c.queue;
    http = std::make_unique<server::HttpServer>(so);
    port = http->bind();
    http->start();
    http->set_ready(m.ctx, *engine);
  }
  ~TestServer() {
    http.reset();
    engine.reset();
  }
  std::unique_ptr<server::BatchEngine> engine;
  std::unique_ptr<server::HttpServer> http;
  int port = 0;
};

struct Reply {
  int status = 0;  ///< 0: no response (connection error)
  std::string body;
  httplib::Headers headers;
  json j;  ///< body parsed as JSON, or discarded
};

inline httplib::Client client(int port) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(120, 0);
  c.set_write_timeout(30, 0);
  c.set_connection_timeout(10, 0);
  return c;
}

inline Reply to_reply(const httplib::Result& r) {
  Reply out;
  if (!r) {
    out.body = "no response: " + httplib::to_string(r.error());
    return out;
  }
  out.status = r->status;
  out.body = r->body;
  out.headers = r->headers;
  out.j = json::parse(out.body, nullptr, false);
  return out;
}

inline Reply get(int port, const std::string& path, const httplib::Headers& h = {}) {
  auto c = client(port);
  return to_reply(c.Get(path.c_str(), h));
}

inline Reply post(int port, const std::string& path, const json& body,
                  const httplib::Headers& h = {}) {
  auto c = client(port);
  return to_reply(c.Post(path.c_str(), h, body.dump(), "application/json"));
}

inline Reply post_raw(int port, const std::string& path, const std::string& body,
                      const httplib::Headers& h = {}) {
  auto c = client(port);
  return to_reply(c.Post(path.c_str(), h, body, "application/json"));
}

/// A streamed response split into its events.
struct Stream {
  int status = 0;
  std::string raw;
  httplib::Headers headers;
  std::vector<std::string> data;  ///< payloads of `data: ` lines, in order
  int n_comments = 0;             ///< lines starting with ':'
  std::vector<json> events() const {
    std::vector<json> out;
    for (const std::string& d : data)
      if (d != "[DONE]") out.push_back(json::parse(d));
    return out;
  }
};

inline void split_sse(Stream& s) {
  size_t pos = 0;
  while (pos < s.raw.size()) {
    size_t end = s.raw.find('\n', pos);
    if (end == std::string::npos) end = s.raw.size();
    const std::string line = s.raw.substr(pos, end - pos);
    if (line.rfind("data: ", 0) == 0) s.data.push_back(line.substr(6));
    if (!line.empty() && line[0] == ':') ++s.n_comments;
    pos = end + 1;
  }
}

inline Stream post_stream(int port, const std::string& path, const json& body,
                          const httplib::Headers& h = {}) {
  auto c = client(port);
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.headers = h;
  req.set_header("Content-Type", "application/json");
  req.body = body.dump();
  Stream s;
  req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
    s.raw.append(d, n);
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  if (c.send(req, res, err)) {
    s.status = res.status;
    s.headers = res.headers;
    // Error answers (not streamed) land in the body, not the receiver.
    if (s.raw.empty()) s.raw = res.body;
  }
  split_sse(s);
  return s;
}

/// A raw TCP connection to 127.0.0.1:port, for requests well-behaved clients never send.
class RawConn {
 public:
  explicit RawConn(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    timeval tv{30, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~RawConn() { close(); }
  bool ok() const { return fd_ >= 0; }
  bool send(const std::string& s) {
    size_t done = 0;
    while (done < s.size()) {
      const ssize_t n = ::send(fd_, s.data() + done, s.size() - done, MSG_NOSIGNAL);
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }
  /// Reads until `needle` appears in what was read (or EOF / timeout); returns all of it.
  std::string read_until(const std::string& needle) {
    char buf[4096];
    while (got_.find(needle) == std::string::npos) {
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) break;
      got_.append(buf, static_cast<size_t>(n));
    }
    return got_;
  }
  std::string read_all() { return read_until(std::string(1, '\0') + "never"); }
  /// Tells the server nothing more comes (shutdown(SHUT_WR)); the reply can still be read.
  void shutdown_write() { ::shutdown(fd_, SHUT_WR); }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  /// The status code of an HTTP response read so far (0: none).
  int status() const {
    if (got_.rfind("HTTP/1.1 ", 0) != 0 || got_.size() < 12) return 0;
    return std::atoi(got_.substr(9, 3).c_str());
  }

 private:
  int fd_ = -1;
  std::string got_;
};

/// Sends `request` on a new raw connection and reads until `until` (the end of an error body by
/// default); returns the status and everything read.
inline std::pair<int, std::string> raw_exchange(int port, const std::string& request,
                                                const std::string& until = "}}") {
  RawConn c(port);
  if (!c.ok() || !c.send(request)) return {0, ""};
  std::string got = c.read_until(until);
  return {c.status(), std::move(got)};
}

inline std::string http_post_head(const std::string& path, size_t content_length,
                                  const std::string& extra = "") {
  return "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" +
         extra + "Content-Length: " + std::to_string(content_length) + "\r\n\r\n";
}

/// Polls `pred` every 5 ms for up to `seconds`; true once it holds.
template <class F>
bool eventually(F pred, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < until) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return pred();
}

/// Writes (once per process) a synthetic model and returns its path: "tiny-qwen3" (the preset:
/// byte-level BPE vocabulary of 1024 tokens with a ChatML template), "slow-llama" (f32 llama,
/// 6 layers of n_embd 512: several ms per token on one thread, for tests that must catch a
/// request in flight) or "tiny-qwen35" (the preset, f32: a hybrid whose Gated DeltaNet state
/// cannot be cut back, so the prefix cache goes through checkpoints).
inline std::string synth_model(const std::string& kind) {
  const std::filesystem::path dir = temp_dir("server-models");
  const std::filesystem::path p = dir / (kind + ".gguf");
  if (std::filesystem::exists(p)) return p.string();
  SynthSpec spec;
  if (kind == "tiny-qwen3") {
    spec = synth_preset("tiny-qwen3");
  } else if (kind == "tiny-qwen35") {
    spec = synth_preset("tiny-qwen35");
    spec.type = "f32";
  } else if (kind == "slow-llama") {
    spec = synth_preset("tiny-llama");
    spec.n_layer = 6;
    spec.n_embd = 512;
    spec.n_head = 8;
    spec.n_head_kv = 4;
    spec.head_dim = 64;
    spec.n_ff = 1536;
    spec.n_ctx_train = 2048;
  } else {
    FAIL("unknown synthetic model " << kind);
  }
  spec.seed = 7;
  const std::filesystem::path tmp = dir / (kind + ".tmp");
  write_synth_model(spec, tmp.string(), 2);
  std::filesystem::rename(tmp, p);
  return p.string();
}

}  // namespace berth::test
