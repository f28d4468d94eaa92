// `berth bench serve`: N concurrent streaming clients against a running server.
//
// Each client sends `n_requests` requests one after another to POST /completion (llama-server's
// native endpoint) with stream, return_tokens and ignore_eos, temperature 0, a prompt of
// `n_prompt` token ids drawn from a seeded generator (distinct per request, so no prefix is
// reused beyond the first token) and n_predict = `n_predict`, so every request generates exactly
// n_predict tokens. Measured on the client:
//   TTFT (time to first token): from sending the request to the first event carrying a token;
//   ITL (inter-token latency): the gap between consecutive reads of the stream that carry
//     tokens, divided by the tokens of the later read (one token per read unless the client
//     fell behind); the first read's other tokens have no sample;
//   aggregate tok/s: generated tokens of all requests / wall time from the first request sent
//     to the last response read.
// With `sync`, the clients start each round's requests together (a barrier before every request),
// so the N prompts are prefilled in the same steps and the N sequences then decode together, as
// the batching loop's `bench model --parallel N` does; without it each client sends its next
// request as soon as its last one ended, so prompts are prefilled in steps that others decode in.
// With `n_warmup`, each client first sends that many requests that are not measured.
// Percentiles: nearest-rank (p50, p99) over every request's samples; each request's decode rate
// (tokens after the first read that carried any over the time from it to the last) gives a
// median (the nearest-rank p50) and a mean.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace berth::server {

struct EngineMetrics;  // berth/server/engine.h

struct ServeBenchOptions {
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string api_key;
  int n_clients = 4;    ///< concurrent streaming clients
  int n_requests = 4;   ///< requests per client, one after another
  int n_prompt = 32;    ///< prompt tokens per request
  int n_predict = 64;   ///< tokens generated per request
  int64_t n_vocab = 0;  ///< prompt ids are drawn from [1, n_vocab); 0: ask GET /v1/models
  uint64_t seed = 1;
  bool sync = false;  ///< a barrier before each round's requests (see above)
  /// Requests per client before the measured ones (as `bench model` runs a warm-up pass): each
  /// client draws their prompts first from its generator, so with `sync` and one warm-up request
  /// the measured prompts are those of `bench model --parallel N --greedy`'s measured runs. Their
  /// samples count in no statistic; a failed one counts in n_warmup_failed (first_error
  /// "warm-up: " + its error when no measured one failed before).
  int n_warmup = 0;
  /// Called once, after every client's warm-up requests ended and before the measured ones
  /// start (e.g. to read the engine's counters, so that its means cover the measured steps).
  std::function<void()> on_measure_start;
  std::function<void(std::string_view)> progress;
};

struct ServeBenchResult {
  int n_clients = 0, n_requests = 0, n_failed = 0;
  int n_warmup_failed = 0;     ///< warm-up requests that failed (not in n_requests nor n_failed)
  int64_t n_tokens = 0;        ///< generated, over all requests
  double wall_s = 0;           ///< seconds
  double aggregate_tok_s = 0;  ///< n_tokens / wall_s
  double ttft_p50_ms = 0, ttft_p99_ms = 0;
  double itl_p50_ms = 0, itl_p99_ms = 0;
  /// Median over requests of ServeRequestSamples::decode_tok_s: the nearest-rank p50, so
  /// the lower of the two middle rates for an even count.
  double per_request_tok_s = 0;
  double per_request_tok_s_mean = 0;  ///< the mean of the same per-request rates
  std::string first_error;            ///< of a failed request, "" when none failed
};

/// What a client measured of one request.
struct ServeRequestSamples {
  bool ok = false;
  std::string error;
  int64_t n_tokens = 0;
  double ttft_ms = 0;
  std::vector<double> itl_ms;
  /// Tokens after the first read that carried any over the time from that read to the last
  /// (n_tokens - 1 of them when the first read held one token); 0 when no later read held one.
  double decode_tok_s = 0;
};

/// Runs the benchmark. Throws Error(invalid_argument) for counts < 1, Error(io) when the server
/// cannot be reached (GET /health) or n_vocab cannot be read.
ServeBenchResult run_serve_bench(const ServeBenchOptions& options);

/// `host` as the host part of an http:// URL: an IPv6 address (one holding ':') in brackets
/// (RFC 3986 3.2.2), anything else as given.
std::string url_host(std::string_view host);

/// The result of `per_client`'s requests over `wall_s` seconds (run_serve_bench's statistics):
/// every request counts in n_requests and n_tokens; a failed one (not ok) in n_failed and, the
/// first, first_error, and in no statistic; a decode rate of 0 in no per-request statistic.
ServeBenchResult summarize_serve_bench(
    const std::vector<std::vector<ServeRequestSamples>>& per_client, double wall_s);

nlohmann::json to_json(const ServeBenchResult& r);
std::string format_text(const ServeBenchResult& r);

/// The engine's decode-only steps in means, from its counters (EngineMetrics, the decode_* lines
/// of GET /metrics); 0 where a count is 0. `bench serve` prints them beside the clients' ITL and
/// writes them as its JSON's "engine".
struct EngineStepMeans {
  int64_t decode_steps = 0;
  double rows_per_step = 0;  ///< decode rows / decode steps
  double forward_ms = 0;     ///< forward time / decode steps
  double interval_ms = 0;    ///< start of a decode step to the next start / such intervals
};

EngineStepMeans engine_step_means(const EngineMetrics& m);
/// The means of the decode-only steps counted between `before` and `now` (two reads of one
/// engine's counters, `before` the earlier).
EngineStepMeans engine_step_means(const EngineMetrics& now, const EngineMetrics& before);
nlohmann::json to_json(const EngineStepMeans& e);
/// "engine: N decode steps of R rows (means: forward F ms, start to next start I ms)\n"
std::string format_text(const EngineStepMeans& e);

}  // namespace berth::server
