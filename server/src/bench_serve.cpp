#include "berth/server/bench_serve.h"

#include <fmt/format.h>
#include <httplib.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>
#include <vector>

#include "berth/core/error.h"
#include "berth/server/engine.h"

namespace berth::server {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// Nearest-rank percentile of `v` (sorted here); 0 for no samples.
double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(v.size())));
  return v[std::min(v.size() - 1, rank > 0 ? rank - 1 : 0)];
}

httplib::Headers auth(const ServeBenchOptions& o) {
  httplib::Headers h;
  if (!o.api_key.empty()) h.emplace("Authorization", "Bearer " + o.api_key);
  return h;
}

ServeRequestSamples one_request(const ServeBenchOptions& o, const std::vector<int32_t>& prompt) {
  ServeRequestSamples s;
  httplib::Client cli(o.host, o.port);
  cli.set_read_timeout(600, 0);
  cli.set_connection_timeout(10, 0);
  httplib::Request req;
  req.method = "POST";
  req.path = "/completion";
  req.headers = auth(o);
  req.set_header("Content-Type", "application/json");
  req.body = json{{"prompt", prompt},      {"n_predict", o.n_predict}, {"stream", true},
                  {"return_tokens", true}, {"ignore_eos", true},       {"temperature", 0},
                  {"cache_prompt", false}}
                 .dump();
  std::string buf;
  Clock::time_point last{};
  const Clock::time_point t0 = Clock::now();
  Clock::time_point first{};
  int64_t n_first = 0;  // tokens of the first read that carried any
  bool finished = false;
  // Events that arrive in one read share its time: the inter-token latency of a read's tokens
  // is the gap since the previous read that carried tokens, divided by their number.
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    const Clock::time_point now = Clock::now();
    buf.append(data, n);
    int64_t k = 0;  // tokens in this read
    size_t end;
    while ((end = buf.find("\n\n")) != std::string::npos) {
      const std::string event = buf.substr(0, end);
      buf.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0) continue;  // a comment
      json j = json::parse(event.substr(6), nullptr, false);
      if (j.is_discarded()) continue;
      if (j.contains("error")) {
        s.error = j["error"].value("message", "error event");
        return false;
      }
      if (j.contains("tokens")) k += static_cast<int64_t>(j["tokens"].size());
      if (j.value("stop", false)) finished = true;
    }
    if (k > 0) {
      if (s.n_tokens == 0) {
        s.ttft_ms = ms(now - t0);
        first = now;
        n_first = k;
      } else {
        const double gap = ms(now - last) / static_cast<double>(k);
        for (int64_t i = 0; i < k; ++i) s.itl_ms.push_back(gap);
      }
      s.n_tokens += k;
      last = now;
    }
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  if (!cli.send(req, res, err)) {
    if (s.error.empty()) s.error = "HTTP: " + httplib::to_string(err);
    return s;
  }
  if (res.status != 200) {
    // With a content receiver the body of an error answer arrives there, not in res.body.
    const std::string body = res.body.empty() ? buf : res.body;
    const json j = json::parse(body, nullptr, false);
    std::string msg = body.substr(0, 200);
    if (j.is_object() && j.contains("error") && j["error"].is_object() &&
        j["error"].contains("message") && j["error"]["message"].is_string())
      msg = j["error"]["message"].get<std::string>();
    s.error = fmt::format("HTTP {}: {}", res.status, msg);
    return s;
  }
  if (!finished && s.error.empty()) s.error = "the stream ended without its final event";
  // ignore_eos: only the slot's context ends a request early, and then the rates and the token
  // count would not be those asked for.
  if (finished && s.error.empty() && s.n_tokens != o.n_predict)
    s.error = fmt::format(
        "the request ended after {} of {} tokens (the slot's context, -c / -np, is too short for "
        "-p + -n?)",
        s.n_tokens, o.n_predict);
  s.ok = finished && s.error.empty();
  // Tokens that arrived after the first read over the time since it: the first read's tokens
  // (one, unless the client fell behind) arrived at its time.
  if (s.n_tokens > n_first && last > first)
    s.decode_tok_s = static_cast<double>(s.n_tokens - n_first) / (ms(last - first) / 1e3);
  return s;
}

}  // namespace

std::string url_host(std::string_view host) {
  if (host.find(':') == std::string_view::npos) return std::string(host);
  // An IPv6 literal in brackets (built by appends: GCC 12 warns -Wrestrict on "[" + s + "]").
  std::string s;
  s.reserve(host.size() + 2);
  s += '[';
  s += host;
  s += ']';
  return s;
}

ServeBenchResult run_serve_bench(const ServeBenchOptions& o) {
  if (o.n_clients < 1 || o.n_requests < 1 || o.n_prompt < 1 || o.n_predict < 1)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("bench serve: --clients, --requests, -p and -n must be at least 1 "
                            "(got {}, {}, {}, {})",
                            o.n_clients, o.n_requests, o.n_prompt, o.n_predict));
  int64_t n_vocab = o.n_vocab;
  {
    httplib::Client cli(o.host, o.port);
    cli.set_connection_timeout(10, 0);
    auto health = cli.Get("/health");
    if (!health || health->status != 200)
      throw Error(
          ErrorCategory::io,
          fmt::format("bench serve: http://{}:{}/health did not answer 200 ({})", url_host(o.host),
                      o.port, health ? std::to_string(health->status) : "no answer"));
    if (n_vocab <= 0) {
      auto models = cli.Get("/v1/models", auth(o));
      json j = models ? json::parse(models->body, nullptr, false) : json();
      if (!j.is_object() || !j.contains("data") || j["data"].empty() ||
          !j["data"][0]["meta"].contains("n_vocab"))
        throw Error(ErrorCategory::io,
                    "bench serve: GET /v1/models gave no data[0].meta.n_vocab (pass --n-vocab)");
      n_vocab = j["data"][0]["meta"]["n_vocab"].get<int64_t>();
    }
  }
  if (n_vocab < 2) throw Error(ErrorCategory::invalid_argument, "bench serve: n_vocab below 2");

  if (o.n_warmup < 0)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("bench serve: --warmup must be at least 0 (got {})", o.n_warmup));
  std::vector<std::vector<ServeRequestSamples>> per_client(static_cast<size_t>(o.n_clients));
  std::vector<std::vector<ServeRequestSamples>> warm(static_cast<size_t>(o.n_clients));
  std::mutex progress_mu;
  int done = 0;
  Clock::time_point t0 = Clock::now();
  // The completion step runs once, on one thread, when the last client ends its warm-up.
  auto measure = [&]() noexcept {
    if (o.on_measure_start) o.on_measure_start();
    t0 = Clock::now();
  };
  std::barrier warmed(o.n_clients, measure);
  std::barrier<> round(o.n_clients);
  std::vector<std::thread> threads;
  for (int c = 0; c < o.n_clients; ++c)
    threads.emplace_back([&, c] {
      std::mt19937_64 rng(o.seed * 1000003u + static_cast<uint64_t>(c));
      std::uniform_int_distribution<int32_t> id(1, static_cast<int32_t>(n_vocab - 1));
      for (int r = 0; r < o.n_warmup + o.n_requests; ++r) {
        std::vector<int32_t> prompt(static_cast<size_t>(o.n_prompt));
        for (int32_t& t : prompt) t = id(rng);
        const bool warming = r < o.n_warmup;
        if (r == o.n_warmup) warmed.arrive_and_wait();
        if (o.sync) round.arrive_and_wait();
        (warming ? warm : per_client)[static_cast<size_t>(c)].push_back(one_request(o, prompt));
        if (o.progress) {
          std::lock_guard<std::mutex> lock(progress_mu);
          if (warming) {
            o.progress(fmt::format("bench serve: warm-up request of client {} ended", c));
          } else {
            ++done;
            o.progress(
                fmt::format("bench serve: {}/{} requests", done, o.n_clients * o.n_requests));
          }
        }
      }
    });
  for (std::thread& t : threads) t.join();
  ServeBenchResult r = summarize_serve_bench(per_client, ms(Clock::now() - t0) / 1e3);
  for (const auto& reqs : warm)
    for (const ServeRequestSamples& s : reqs)
      if (!s.ok) {
        ++r.n_warmup_failed;
        if (r.first_error.empty()) r.first_error = "warm-up: " + s.error;
      }
  return r;
}

ServeBenchResult summarize_serve_bench(
    const std::vector<std::vector<ServeRequestSamples>>& per_client, double wall_s) {
  ServeBenchResult r;
  r.wall_s = wall_s;
  r.n_clients = static_cast<int>(per_client.size());
  std::vector<double> ttft, itl, rates;
  for (const auto& reqs : per_client)
    for (const ServeRequestSamples& s : reqs) {
      ++r.n_requests;
      r.n_tokens += s.n_tokens;
      if (!s.ok) {
        ++r.n_failed;
        if (r.first_error.empty()) r.first_error = s.error;
        continue;
      }
      ttft.push_back(s.ttft_ms);
      itl.insert(itl.end(), s.itl_ms.begin(), s.itl_ms.end());
      if (s.decode_tok_s > 0) rates.push_back(s.decode_tok_s);
    }
  r.aggregate_tok_s = r.wall_s > 0 ? static_cast<double>(r.n_tokens) / r.wall_s : 0;
  r.ttft_p50_ms = percentile(ttft, 50);
  r.ttft_p99_ms = percentile(ttft, 99);
  r.itl_p50_ms = percentile(itl, 50);
  r.itl_p99_ms = percentile(itl, 99);
  r.per_request_tok_s = percentile(rates, 50);
  double sum = 0;
  for (double x : rates) sum += x;
  r.per_request_tok_s_mean = rates.empty() ? 0 : sum / static_cast<double>(rates.size());
  return r;
}

json to_json(const ServeBenchResult& r) {
  return json{{"clients", r.n_clients},
              {"requests", r.n_requests},
              {"failed", r.n_failed},
              {"warmup_failed", r.n_warmup_failed},
              {"tokens", r.n_tokens},
              {"wall_s", r.wall_s},
              {"aggregate_tok_s", r.aggregate_tok_s},
              {"ttft_ms", {{"p50", r.ttft_p50_ms}, {"p99", r.ttft_p99_ms}}},
              {"itl_ms", {{"p50", r.itl_p50_ms}, {"p99", r.itl_p99_ms}}},
              {"per_request_tok_s", r.per_request_tok_s},
              {"per_request_tok_s_mean", r.per_request_tok_s_mean},
              {"first_error", r.first_error}};
}

std::string format_text(const ServeBenchResult& r) {
  const std::string warm =
      r.n_warmup_failed > 0 ? fmt::format("; {} warm-up requests failed", r.n_warmup_failed) : "";
  std::string s = fmt::format(
      "clients {} | requests {} ({} failed{}) | tokens {} in {:.2f} s\n"
      "aggregate {:.1f} tok/s | per request {:.1f} tok/s (median), {:.1f} (mean)\n"
      "TTFT p50 {:.1f} ms, p99 {:.1f} ms | ITL p50 {:.2f} ms, p99 {:.2f} ms\n",
      r.n_clients, r.n_requests, r.n_failed, warm, r.n_tokens, r.wall_s, r.aggregate_tok_s,
      r.per_request_tok_s, r.per_request_tok_s_mean, r.ttft_p50_ms, r.ttft_p99_ms, r.itl_p50_ms,
      r.itl_p99_ms);
  if (!r.first_error.empty()) s += "first error: " + r.first_error + "\n";
  return s;
}

EngineStepMeans engine_step_means(const EngineMetrics& now, const EngineMetrics& before) {
  EngineMetrics d;
  d.decode_steps_total = now.decode_steps_total - before.decode_steps_total;
  d.decode_rows_total = now.decode_rows_total - before.decode_rows_total;
  d.decode_step_seconds_total = now.decode_step_seconds_total - before.decode_step_seconds_total;
  d.decode_intervals_total = now.decode_intervals_total - before.decode_intervals_total;
  d.decode_interval_seconds_total =
      now.decode_interval_seconds_total - before.decode_interval_seconds_total;
  return engine_step_means(d);
}

EngineStepMeans engine_step_means(const EngineMetrics& m) {
  const auto per = [](double v, int64_t n) { return n > 0 ? v / static_cast<double>(n) : 0.0; };
  EngineStepMeans e;
  e.decode_steps = m.decode_steps_total;
  e.rows_per_step = per(static_cast<double>(m.decode_rows_total), m.decode_steps_total);
  e.forward_ms = 1e3 * per(m.decode_step_seconds_total, m.decode_steps_total);
  e.interval_ms = 1e3 * per(m.decode_interval_seconds_total, m.decode_intervals_total);
  return e;
}

json to_json(const EngineStepMeans& e) {
  return json{{"decode_steps", e.decode_steps},
              {"decode_rows_per_step", e.rows_per_step},
              {"decode_step_ms", e.forward_ms},
              {"decode_interval_ms", e.interval_ms}};
}

std::string format_text(const EngineStepMeans& e) {
  return fmt::format(
      "engine: {} decode steps of {:.2f} rows (means: forward {:.2f} ms, start to next start "
      "{:.2f} ms)\n",
      e.decode_steps, e.rows_per_step, e.forward_ms, e.interval_ms);
}

}  // namespace berth::server
