// `berth serve`: an OpenAI- and llama-server-compatible HTTP server (server/).
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "berth/backends/thread_pool.h"
#include "berth/bench/kernel_bench.h"
#include "berth/core/error.h"
#include "berth/core/log.h"
#include "berth/io/gguf.h"
#include "berth/models/chat.h"
#include "berth/models/model.h"
#include "berth/models/tokenizer.h"
#include "berth/runtime/placed.h"
#include "berth/server/batch_engine.h"
#include "berth/server/bench_serve.h"
#include "berth/server/server.h"
#include "commands.h"
#include "placement_flags.h"

namespace berth::cli {
namespace {

struct ServeOptions {
  std::string model;
  server::ServerOptions http;
  int32_t n_slots = 1;
  int64_t n_ctx = 0;
  int32_t queue = 64;
  std::string alias;
  std::string chat_template;
  SessionParams session;
  placement::Flags placement;
  int32_t stream_min = kStreamExpertsAuto;
  std::string stream_split = "off";
  double host_expert_share = 0;
  int64_t warm_workers_us = kAutoWarmWorkersUs;
  double shutdown_grace_s = 30;
};

// SIGTERM / SIGINT: one byte into a pipe the main thread polls (write() is async-signal-safe).
int g_signal_pipe[2] = {-1, -1};
extern "C" void on_signal(int) {
  const int saved = errno;
  const char b = 1;
  (void)!write(g_signal_pipe[1], &b, 1);
  errno = saved;
}

void install_signals() {
  if (pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0)
    throw Error(ErrorCategory::io, "cannot create the signal pipe");
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

// Waits up to `ms` for a signal; true when one came.
bool wait_signal(int ms) {
  pollfd p{g_signal_pipe[0], POLLIN, 0};
  if (poll(&p, 1, ms) <= 0) return false;
  char buf[16];
  while (read(g_signal_pipe[0], buf, sizeof buf) > 0) {
  }
  return true;
}

/// A loaded model behind a listening server (what `serve` and `bench serve` run).
class RunningServer {
 public:
  explicit RunningServer(ServeOptions& o)
      : file_(gguf::File::open(o.model)),
        model_(load_model(file_)),
        tok_(Tokenizer::from_gguf(file_)) {
    if (tok_->n_vocab() != model_->hparams().n_vocab)
      throw Error(ErrorCategory::format,
                  fmt::format("{}: the vocabulary has {} tokens but token_embd.weight has {} rows",
                              o.model, tok_->n_vocab(), model_->hparams().n_vocab));
    server::ModelContext mc;
    mc.tok = tok_.get();
    mc.chat_template = file_.get_string_opt("tokenizer.chat_template").value_or("");
    if (!o.chat_template.empty()) {
      mc.chat_format = chat_format_from_name(o.chat_template);
    } else {
      try {
        mc.chat_format = chat_format_for(file_, "");
      } catch (const Error& e) {
        log::warn("{}; chat requests use chatml (--chat-template NAME chooses)", e.what());
        mc.chat_format = ChatFormat::chatml;
      }
    }
    mc.chat_stop_ids = chat_stop_ids(*tok_, mc.chat_format);
    mc.model_path = o.model;
    mc.alias = o.alias.empty() ? o.model : o.alias;
    const Hparams& hp = model_->hparams();
    mc.n_vocab = hp.n_vocab;
    mc.n_ctx_train = hp.n_ctx_train;
    mc.n_embd = hp.n_embd;
    mc.n_layer = hp.n_layer;
    mc.file_size = file_.file_size();

    // The device first: the default context is sized by the plan serve makes with it.
    std::unique_ptr<Device> device = placement_device(o.placement);
    SessionParams params = o.session;
    params.hybrid.stream_experts_min_tokens = o.stream_min;
    params.hybrid.stream_rates = parse_stream_split(o.stream_split, params.hybrid.stream_split);
    params.hybrid.host_expert_share = o.host_expert_share;
    int64_t n_ctx = o.n_ctx;
    if (n_ctx <= 0) {
      // Sized as one sequence of -c positions (the same KV rows as -np of -c / -np) whose
      // recurrent state rows are all the slots' and their spare rows.
      SessionParams sizing = params;
      sizing.n_state_spare = o.n_slots * (1 + server::kDeviceCheckpointsPerSlot) - 1;
      std::string note;
      n_ctx = default_serve_context(*model_, o.placement, sizing, device, &note);
      if (!note.empty()) log::warn("{}", note);
    }
    // Before listening, as every other check of the flags.
    server::BatchEngine::check_slot_context(n_ctx, o.n_slots);
    n_ctx = n_ctx / o.n_slots * o.n_slots;  // every slot the same size
    if (std::string c = context_note(n_ctx, hp); !c.empty()) log::warn("{}", c);
    // Planned as the engine runs it: -np sequences of -c / -np positions each (the same KV
    // rows as -c), and each slot's spare recurrent-state rows for its checkpoints.
    params.n_ctx = n_ctx / o.n_slots;
    params.n_seq = o.n_slots;
    params.n_state_spare = o.n_slots * server::kDeviceCheckpointsPerSlot;
    placed_ = place(*model_, o.placement, params, true, false, std::move(device));
    use_disk_tier(file_, *model_, placed_.plan, params);
    params.hybrid.warm_workers_us = o.warm_workers_us;
    for (const std::string& note :
         device_option_notes(*model_, params, false, o.warm_workers_us != kAutoWarmWorkersUs))
      log::warn("{}", note);
    if (o.n_slots > 1 && params.device && !params.device->info().multi_seq)
      for (const placement::Home h : params.kv_home)
        if (h == placement::Home::gpu)
          throw Error(ErrorCategory::unsupported,
                      fmt::format("-np {} with {}: its attention runs one sequence per step for "
                                  "now, so several slots need the attention and the KV cache on "
                                  "the CPU: use -np 1, or keep the attention on the CPU "
                                  "(-ot \"attn=CPU\" beside -ngl, or -ngl 0)",
                                  o.n_slots, params.device->name()));
    log::info("{}", placed_.summary());

    // Listen first (health answers 503 while the slots are built: KV caches, uploads).
    o.http.n_slots_hint = o.n_slots;
    o.http.queue_hint = o.queue;
    http_ = std::make_unique<server::HttpServer>(o.http);
    port_ = http_->bind();
    http_->start();
    std::fprintf(stderr, "berth: listening on http://%s:%d (loading the model)\n",
                 server::url_host(o.http.host).c_str(), port_);
    try {
      server::BatchEngineOptions eo;
      eo.n_slots = o.n_slots;
      eo.n_ctx = n_ctx;
      eo.queue_limit = o.queue;
      eo.session = params;
      engine_ = std::make_unique<server::BatchEngine>(*model_, *tok_, eo);
    } catch (...) {
      http_->stop();
      throw;
    }
    http_->set_ready(mc, *engine_);
    std::fprintf(stderr,
                 "berth: ready: %s on http://%s:%d, %d slot%s of %lld tokens batched in each step, "
                 "%d thread%s, chat format %s\n",
                 mc.alias.c_str(), server::url_host(o.http.host).c_str(), port_, o.n_slots,
                 o.n_slots == 1 ? "" : "s", static_cast<long long>(engine_->n_ctx_per_slot()),
                 engine_->n_threads(), engine_->n_threads() == 1 ? "" : "s",
                 std::string(chat_format_name(mc.chat_format)).c_str());
  }
  ~RunningServer() { http_.reset(); }  // the server goes before the engine it calls

  int port() const { return port_; }
  int64_t n_vocab() const { return model_->hparams().n_vocab; }
  server::HttpServer& http() { return *http_; }
  server::BatchEngine& engine() { return *engine_; }

 private:
  gguf::File file_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Tokenizer> tok_;
  PlacementSetup placed_;
  std::unique_ptr<server::BatchEngine> engine_;
  std::unique_ptr<server::HttpServer> http_;
  int port_ = 0;
};

int serve(ServeOptions& o) {
  install_signals();  // a SIGTERM while loading ends the server once it is up
  RunningServer srv(o);
  while (!wait_signal(500)) {
  }
  srv.http().begin_shutdown();  // refusing before saying so: a request after the line gets 503
  std::fprintf(stderr, "berth: shutting down: finishing %lld requests (at most %.0f s)\n",
               static_cast<long long>(srv.engine().n_in_flight()), o.shutdown_grace_s);
  std::atomic<bool> drained{false};
  // A second signal cancels what is still running. A connection whose request is still being
  // read (a client that sends a byte every few seconds never meets the read timeout) holds its
  // HTTP thread, and stopping the listener waits for every thread: past the grace and
  // kShutdownHardS more (1 s after a second signal), with every request finished or cancelled, the
  // process exits without waiting for such connections.
  constexpr double kShutdownHardS = 3;
  using Clock = std::chrono::steady_clock;
  Clock::time_point deadline =
      Clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>((o.shutdown_grace_s + kShutdownHardS) * 1e3));
  std::thread second([&] {
    while (!drained.load()) {
      if (wait_signal(100)) {
        std::fprintf(stderr, "berth: second signal: cancelling the requests in flight\n");
        srv.engine().cancel_all();
        deadline = std::min(deadline, Clock::now() + std::chrono::seconds(1));
      }
      if (!drained.load() && Clock::now() > deadline) {
        srv.engine().cancel_all();
        std::fprintf(stderr,
                     "berth: stopped (connections still open were not waited for: a client "
                     "still sending its request)\n");
        std::fflush(stderr);
        std::_Exit(0);
      }
    }
  });
  srv.http().shutdown(std::chrono::milliseconds(static_cast<int64_t>(o.shutdown_grace_s * 1e3)));
  drained.store(true);
  second.join();
  std::fprintf(stderr, "berth: stopped\n");
  return 0;
}

// The flags of `serve` (also those of `bench serve`, whose server they configure).
void add_serve_flags(CLI::App* sub, ServeOptions& o) {
  sub->add_option("--host", o.http.host, "address to listen on")
      ->capture_default_str()
      ->check([](const std::string& h) {
        return h.empty() ? std::string(
                               "an empty address (127.0.0.1: this machine only; 0.0.0.0: "
                               "every interface)")
                         : std::string();
      });
  sub->add_option("--port", o.http.port, "port to listen on (0: any free port)")
      ->capture_default_str()
      ->check(range(0, 65535));
  sub->add_option("--parallel", o.n_slots,
                  "-np: slots, each serving one request at a time with -c / -np tokens of context")
      ->capture_default_str()
      ->check(range(1, 256));
  sub->add_option(
         "-c,--ctx-size", o.n_ctx,
         "total context in tokens, split evenly over the slots (0: the model's "
         "context_length, lowered to what memory holds: on unified memory the pool the plan "
         "uses)")
      ->capture_default_str()
      ->check(range(int64_t{0}, int64_t{1} << 24));
  o.session.n_ubatch_auto = true;
  sub->add_option("--ubatch-size", o.session.n_ubatch,
                  "-ub: tokens per step (decode tokens of the busy slots plus prompt chunks)")
      ->capture_default_str()
      ->check(range(1, 1 << 16))
      ->each([&o](const std::string&) { o.session.n_ubatch_auto = false; });
  sub->add_option("-t,--threads", o.session.n_threads, "CPU threads (0: all physical cores)")
      ->capture_default_str()
      ->check(range(0, 4096));
  sub->add_option("--api-key", o.http.api_key,
                  "require this key (Authorization: Bearer KEY or X-Api-Key: KEY) on every route "
                  "but /health and /v1/models");
  sub->add_flag("--metrics", o.http.metrics, "serve Prometheus metrics on GET /metrics");
  sub->add_option("-a,--alias", o.alias, "model name in responses (default: the file path)");
  sub->add_option("--queue", o.queue,
                  "requests that may wait when every slot is busy; more get 503 with Retry-After")
      ->capture_default_str()
      ->check(range(0, 4096));
  sub->add_option("--chat-template", o.chat_template,
                  "chat format: " + chat_format_names() +
                      " (default: detected from tokenizer.chat_template, else chatml)");
  sub->add_option("--shutdown-grace", o.shutdown_grace_s,
                  "seconds SIGTERM lets requests in flight finish before cancelling them")
      ->capture_default_str()
      ->check(range(0.0, 3600.0));
  add_placement_flags(*sub, o.placement);
  add_stream_experts(*sub, o.stream_min);
  add_stream_split(*sub, o.stream_split);
  add_host_expert_share(*sub, o.host_expert_share);
  add_warm_workers(*sub, o.warm_workers_us);
  add_residency_swaps(*sub, o.session.hybrid.expert_slots.max_swaps_per_step);
}

struct BenchServeOptions {
  ServeOptions serve;
  server::ServeBenchOptions bench;
  std::string url;
  std::string json_path;
  bool quiet = false;
};

int bench_serve(BenchServeOptions& o) {
  std::unique_ptr<RunningServer> srv;
  if (!o.url.empty() && !o.serve.model.empty())
    throw Error(ErrorCategory::usage,
                "bench serve takes -m MODEL (a server of its own) or --url URL (a running "
                "server), not both");
  if (!o.url.empty()) {
    // http://HOST:PORT (no path); an IPv6 address in brackets, http://[::1]:8080
    std::string u = o.url;
    if (u.find("://") != std::string::npos && u.rfind("http://", 0) != 0)
      throw Error(ErrorCategory::usage, fmt::format("--url {}: only http:// is supported", o.url));
    if (u.rfind("http://", 0) == 0) u = u.substr(7);
    while (!u.empty() && u.back() == '/') u.pop_back();
    const size_t colon = u.rfind(':');
    int port = 0;
    std::string host = colon == std::string::npos ? "" : u.substr(0, colon);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
      host = host.substr(1, host.size() - 2);
    if (host.empty() || !CLI::detail::lexical_cast(u.substr(colon + 1), port) || port < 1 ||
        port > 65535)
      throw Error(ErrorCategory::usage, fmt::format("--url {}: expected http://HOST:PORT", o.url));
    o.bench.host = host;
    o.bench.port = port;
    if (o.bench.api_key.empty()) o.bench.api_key = o.serve.http.api_key;
  } else {
    if (o.serve.model.empty())
      throw Error(ErrorCategory::usage, "bench serve needs -m MODEL or --url URL");
    o.serve.http.host = "127.0.0.1";
    srv = std::make_unique<RunningServer>(o.serve);
    o.bench.host = "127.0.0.1";
    o.bench.port = srv->port();
    o.bench.api_key = o.serve.http.api_key;
    o.bench.n_vocab = srv->n_vocab();
  }
  if (!o.quiet)
    o.bench.progress = [](std::string_view line) {
      std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data());
    };
  // Host DRAM read rate before the clients start, as `bench model --parallel` measures it: host
  // bandwidth moves between runs on shared hosts, and CPU-held experts decode at its pace.
  double dram_gbps = 0;
  if (srv) {
    const int t = srv->engine().n_threads();
    dram_gbps = bench::measure_dram_bandwidth(t, size_t{1} << 30, 3).gbps.median;
    if (!o.quiet) std::fprintf(stderr, "DRAM   %.1f GB/s read with %d threads\n", dram_gbps, t);
  }
  // The engine's counters when the measured requests start: its means cover only their steps.
  server::EngineMetrics before;
  if (srv) o.bench.on_measure_start = [&] { before = srv->engine().metrics(); };
  const server::ServeBenchResult r = server::run_serve_bench(o.bench);
  nlohmann::json j = server::to_json(r);
  if (srv) j["dram_gbps"] = dram_gbps;
  std::string engine_line;
  if (srv) {
    j["server"] = {{"model", o.serve.model},
                   {"n_slots", o.serve.n_slots},
                   {"n_ctx_per_slot", srv->engine().n_ctx_per_slot()},
                   {"n_threads", srv->engine().n_threads()}};
    // The engine's own view of its decode steps, beside the clients' ITL.
    const server::EngineStepMeans e = server::engine_step_means(srv->engine().metrics(), before);
    j["engine"] = server::to_json(e);
    engine_line = server::format_text(e);
    srv->http().shutdown(std::chrono::milliseconds(1000));
  }
  j["warmup"] = o.bench.n_warmup;
  j["n_prompt"] = o.bench.n_prompt;
  j["n_predict"] = o.bench.n_predict;
  if (!o.json_path.empty()) {
    std::ofstream out(o.json_path, std::ios::binary | std::ios::trunc);
    out << j.dump(2) << "\n";
    if (!out) throw Error(ErrorCategory::io, fmt::format("cannot write '{}'", o.json_path));
  }
  (void)write_stdout(server::format_text(r) + engine_line);
  return r.n_failed == 0 && r.n_warmup_failed == 0 ? 0 : 1;
}

}  // namespace

Runner add_serve(CLI::App& app) {
  auto o = std::make_shared<ServeOptions>();
  CLI::App* sub = app.add_subcommand(
      "serve", "an OpenAI- and llama-server-compatible HTTP server (/v1/chat/completions, ...)");
  sub->add_option("-m,--model", o->model, "GGUF model file")->required();
  add_serve_flags(sub, *o);
  return [o] { return serve(*o); };
}

Runner add_bench_serve(CLI::App& bench) {
  auto o = std::make_shared<BenchServeOptions>();
  o->serve.http.port = 0;
  o->bench.n_warmup = 1;
  CLI::App* sub = bench.add_subcommand(
      "serve",
      "the HTTP server under N concurrent streaming clients: aggregate tok/s, time to first "
      "token and inter-token latency p50/p99 (a server of its own with -m and the serve flags, "
      "or a running one with --url)");
  sub->add_option("-m,--model", o->serve.model, "GGUF model file (a server of its own)");
  sub->add_option("--url", o->url, "benchmark a running server, http://HOST:PORT");
  const size_t n_before = sub->get_options().size();
  add_serve_flags(sub, o->serve);
  // The serve flags configure bench serve's own server (-m): none of them applies to a running
  // one (--url) but --api-key, which the clients then send; its server listens on 127.0.0.1.
  std::vector<const CLI::Option*> server_flags;
  for (size_t i = n_before; i < sub->get_options().size(); ++i)
    if (sub->get_options()[i]->get_name() != "--api-key")
      server_flags.push_back(sub->get_options()[i]);
  const CLI::Option* host = sub->get_option("--host");
  sub->callback([o, server_flags, host] {
    for (const CLI::Option* f : server_flags)
      if (!o->url.empty() && f->count() > 0)
        throw CLI::ValidationError(
            f->get_name(), "configures bench serve's own server (-m), not the one at --url");
    if (o->url.empty() && host->count() > 0)
      throw CLI::ValidationError("--host",
                                 "bench serve's own server listens on 127.0.0.1 (use --url to "
                                 "benchmark a server elsewhere)");
  });
  sub->add_option("--clients", o->bench.n_clients, "concurrent streaming clients")
      ->capture_default_str()
      ->check(range(1, 1024));
  sub->add_option("--requests", o->bench.n_requests, "requests per client, one after another")
      ->capture_default_str()
      ->check(range(1, 100000));
  sub->add_option("--warmup", o->bench.n_warmup,
                  "requests per client before the measured ones (not in any statistic, nor in "
                  "the engine's means)")
      ->capture_default_str()
      ->check(range(0, 100000));
  sub->add_option("-p,--n-prompt", o->bench.n_prompt, "prompt tokens per request")
      ->capture_default_str()
      ->check(range(1, 1 << 20));
  sub->add_option("-n,--n-predict", o->bench.n_predict, "tokens generated per request")
      ->capture_default_str()
      ->check(range(1, 1 << 20));
  sub->add_flag("--sync", o->bench.sync,
                "the clients start each round's requests together, so their sequences decode in "
                "the same steps (as `bench model --parallel N`)");
  sub->add_option("--json", o->json_path, "also write the numbers as JSON to this file");
  sub->add_flag("-q,--quiet", o->quiet, "no progress lines on stderr");
  return [o] { return bench_serve(*o); };
}

}  // namespace berth::cli
