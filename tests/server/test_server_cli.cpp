// `berth serve` as users run it: refusing bad models and flags before listening, draining on
// SIGTERM and exiting 0, a round trip with the official OpenAI client library (Node.js, npm
// package `openai` installed by scripts/setup.sh into tests/server/openai-client), and
// `berth bench serve`.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <atomic>
#include <fstream>
#include <regex>

#include "server_harness.h"

extern char** environ;

using namespace berth;
using namespace berth::test;
namespace fs = std::filesystem;

namespace {

/// `berth serve ARGS` in the background, its stderr in a file; ready() waits for the ready line.
class ServeProcess {
 public:
  explicit ServeProcess(std::vector<std::string> args) {
    static int counter = 0;
    err_ = temp_dir("serve-cli") / ("stderr" + std::to_string(counter++));
    args.insert(args.begin(), {berth_bin(), "serve"});
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 2, err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    REQUIRE(posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ) == 0);
    posix_spawn_file_actions_destroy(&fa);
  }
  ~ServeProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  std::string stderr_text() const { return read_file(err_); }
  /// Waits for "berth: ready: ... on http://127.0.0.1:PORT" and returns PORT (0: it never came).
  int ready(double seconds = 60) {
    static const std::regex re(R"(berth: ready: .* on http://127\.0\.0\.1:(\d+),)");
    int port = 0;
    eventually(
        [&] {
          std::smatch m;
          const std::string text = stderr_text();
          if (std::regex_search(text, m, re)) port = std::stoi(m[1]);
          return port != 0 || exited();
        },
        seconds);
    return port;
  }
  bool exited() {
    if (pid_ <= 0) return true;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      status_ = status;
      pid_ = -1;
      return true;
    }
    return false;
  }
  void signal(int sig) { kill(pid_, sig); }
  /// Waits for the exit; returns the exit code (-1: killed by a signal or still running).
  int wait_exit(double seconds) {
    eventually([&] { return exited(); }, seconds);
    if (pid_ > 0) return -1;
    return WIFEXITED(status_) ? WEXITSTATUS(status_) : -1;
  }

 private:
  pid_t pid_ = -1;
  int status_ = 0;
  fs::path err_;
};

}  // namespace

TEST_CASE("berth serve refuses a bad model or bad flags before listening, exit code non-zero") {
  const fs::path dir = temp_dir("serve-bad");
  { std::ofstream(dir / "garbage.gguf") << "GGUF this is not a model"; }
  CommandResult r = run_command(berth_bin() + " serve --port 0 -m " +
                                shell_quote((dir / "garbage.gguf").string()));
  CHECK(r.exit_code == 1);
  CHECK(r.err.rfind("berth: error: ", 0) == 0);
  CHECK(r.err.find("garbage.gguf") != std::string::npos);
  CHECK(r.err.find("listening") == std::string::npos);
  r = run_command(berth_bin() + " serve --port 0 -m " +
                  shell_quote((dir / "missing.gguf").string()));
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("listening") == std::string::npos);
  const std::string model = shell_quote(stories260k().string());
  r = run_command(berth_bin() + " serve --port 0 -np 0 -m " + model);
  CHECK(r.exit_code == 2);
  r = run_command(berth_bin() + " serve --port 0 --host '' -m " + model);
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--host") != std::string::npos);
  CHECK(r.err.find("listening") == std::string::npos);
  // -c / -np below a one-token prompt and one generated token per slot: exit 1 (invalid_argument,
  // as bench model --parallel's -c check), naming -c, -np and the tokens per slot.
  for (const auto& [flags, says] : std::vector<std::pair<std::string, std::string>>{
           {"-np 4 -c 6",
            "-c 6 over -np 4 slots leaves 1 token per slot; each slot needs at "
            "least 2 (raise -c or lower -np)\n"},
           {"-np 4 -c 3",
            "-c 3 over -np 4 slots leaves 0 tokens per slot; each slot needs at "
            "least 2 (raise -c or lower -np)\n"},
           {"-c 1",
            "-c 1 over -np 1 slot leaves 1 token per slot; each slot needs at least 2 "
            "(raise -c or lower -np)\n"}}) {
    CAPTURE(flags);
    r = run_command(berth_bin() + " serve --port 0 " + flags + " -m " + model);
    CHECK(r.exit_code == 1);
    CHECK(r.err.find("berth: error: " + says) != std::string::npos);
    CHECK(r.err.find("listening") == std::string::npos);
  }
  r = run_command(berth_bin() + " serve --port 0 --chat-template nope -m " + model);
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("nope") != std::string::npos);
}

TEST_CASE("-c / -np of 2 tokens per slot serves a one-token prompt; a longer one is 400") {
  ServeProcess p({"-m", stories260k().string(), "--port", "0", "-t", "1", "-np", "4", "-c", "9"});
  const int port = p.ready();
  REQUIRE_MESSAGE(port > 0, p.stderr_text());
  CHECK(p.stderr_text().find("4 slots of 2 tokens") != std::string::npos);
  CHECK(get(port, "/props").j["default_generation_settings"]["n_ctx"] == 2);
  // The prompt's token fills one position, the first generated token the other; the second
  // generated token is never evaluated.
  Reply r = post(port, "/v1/completions",
                 {{"prompt", json::array({1})}, {"max_tokens", 8}, {"temperature", 0}});
  CHECK(r.status == 200);
  CHECK(r.j["usage"]["prompt_tokens"] == 1);
  CHECK(r.j["usage"]["completion_tokens"] == 2);
  CHECK(r.j["choices"][0]["finish_reason"] == "length");
  r = post(port, "/v1/completions",
           {{"prompt", json::array({1, 403})}, {"max_tokens", 8}, {"temperature", 0}});
  CHECK(r.status == 400);
  CHECK(r.j["error"]["type"] == "exceed_context_size_error");
  CHECK(r.j["error"]["n_ctx"] == 2);
  CHECK(r.j["error"]["n_prompt_tokens"] == 2);
  p.signal(SIGTERM);
  CHECK(p.wait_exit(20) == 0);
}

TEST_CASE("SIGTERM: the request in flight finishes, new ones are refused, exit code 0") {
  const std::string slow = synth_model("slow-llama");
  ServeProcess p({"-m", slow, "--port", "0", "-t", "1", "-c", "512"});
  const int port = p.ready();
  REQUIRE_MESSAGE(port > 0, p.stderr_text());
  Stream s;
  std::thread t([&] {
    s = post_stream(port, "/v1/completions",
                    {{"prompt", {1, 5}},
                     {"max_tokens", 80},
                     {"stream", true},
                     {"ignore_eos", true},
                     {"temperature", 0},
                     {"stream_options", {{"include_usage", true}}}});
  });
  REQUIRE(
      eventually([&] { return get(port, "/slots").body.find("true") != std::string::npos; }, 30));
  p.signal(SIGTERM);
  REQUIRE(
      eventually([&] { return p.stderr_text().find("shutting down") != std::string::npos; }, 10));
  Reply late = post(port, "/v1/completions", {{"prompt", "a"}, {"max_tokens", 2}});
  CHECK((late.status == 503 || late.status == 0));  // refused, or no longer listening
  t.join();
  CHECK(s.status == 200);
  REQUIRE_FALSE(s.data.empty());
  CHECK(s.data.back() == "[DONE]");
  CHECK(s.events().back()["usage"]["completion_tokens"] == 80);
  CHECK(p.wait_exit(30) == 0);
  CHECK(p.stderr_text().find("berth: stopped") != std::string::npos);

  // Idle: exits at once.
  ServeProcess q({"-m", stories260k().string(), "--port", "0", "-t", "1"});
  REQUIRE(q.ready() > 0);
  q.signal(SIGTERM);
  CHECK(q.wait_exit(20) == 0);
}

TEST_CASE("SIGTERM with a client still sending its request: exit 0 soon after the grace") {
  // The client sends its request line a byte per 0.5 s: never silent for the read timeout, so its
  // HTTP thread waits on it for as long as it keeps sending.
  ServeProcess p({"-m", stories260k().string(), "--port", "0", "-t", "1", "--shutdown-grace", "1"});
  const int port = p.ready();
  REQUIRE_MESSAGE(port > 0, p.stderr_text());
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    RawConn c(port);
    const std::string req = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n";
    for (size_t i = 0; !stop.load(); i = (i + 1) % req.size()) {
      if (!c.send(req.substr(i, 1))) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  p.signal(SIGTERM);
  // The grace (1 s) and the 3 s the server waits beyond it for connections.
  const int code = p.wait_exit(15);
  stop.store(true);
  trickle.join();
  CHECK(code == 0);
  CHECK(p.stderr_text().find("berth: stopped") != std::string::npos);
}

TEST_CASE("the official OpenAI client library (npm openai) round-trips through berth serve") {
  const fs::path dir = fs::path(BERTH_SOURCE_DIR) / "tests" / "server" / "openai-client";
  REQUIRE_MESSAGE(
      fs::exists(dir / "node_modules" / "openai" / "package.json"),
      "the npm package is not installed: run scripts/setup.sh (npm ci in " << dir.string() << ")");
  ServeProcess p({"-m", stories260k().string(), "--port", "0", "-t", "1", "-np", "2", "-c", "1024",
                  "--api-key", "k-123", "-a", "stories"});
  const int port = p.ready();
  REQUIRE_MESSAGE(port > 0, p.stderr_text());
  CommandResult r = run_command("node " + shell_quote((dir / "roundtrip.mjs").string()) +
                                " http://127.0.0.1:" + std::to_string(port) + "/v1 k-123");
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const json j = json::parse(r.out);
  CHECK(j["models"] == json{"stories"});
  CHECK(j["chat"]["object"] == "chat.completion");
  CHECK(j["chat"]["role"] == "assistant");
  CHECK(j["chat"]["finish_reason"] == "length");
  CHECK(j["chat"]["usage"]["completion_tokens"] == 12);
  const std::string content = j["chat"]["content"];
  CHECK_FALSE(content.empty());
  CHECK(j["stream"]["content"] == content);
  CHECK(j["stream"]["role"] == "assistant");
  CHECK(j["stream"]["finish_reason"] == "length");
  CHECK(j["stream"]["usage"]["completion_tokens"] == 12);
  CHECK(j["stream"]["usage"]["prompt_tokens"] == j["chat"]["usage"]["prompt_tokens"]);
  CHECK(j["helper"]["content"] == content);
  CHECK(j["completion"]["text"] == ", there was a little girl named ");
  CHECK(j["completion"]["finish_reason"] == "stop");
  CHECK(j["completion"]["usage"]["prompt_tokens"] == 5);
  CHECK(j["overflow"]["status"] == 400);
  CHECK(j["overflow"]["type"] == "exceed_context_size_error");
  CHECK(j["invalid"]["status"] == 400);
  CHECK(j["invalid"]["type"] == "invalid_request_error");
  CHECK(j["unauthorized"]["status"] == 401);
  CHECK(j["unauthorized"]["type"] == "authentication_error");
  p.signal(SIGTERM);
  CHECK(p.wait_exit(20) == 0);
}

TEST_CASE("berth bench serve: concurrent streaming clients, every token counted") {
  const fs::path out = temp_dir("bench-serve") / "serve.json";
  CommandResult r =
      run_command(berth_bin() + " bench serve -q -m " + shell_quote(stories260k().string()) +
                  " -np 2 -c 1024 -t 1 --clients 3 --requests 2 -n 48 -p 8 --json " +
                  shell_quote(out.string()));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.out.find("aggregate") != std::string::npos);
  CHECK(r.out.find("TTFT p50") != std::string::npos);
  const json j = json::parse(read_file(out));
  CHECK(j["requests"] == 6);
  CHECK(j["failed"] == 0);
  CHECK(j["tokens"] == 3 * 2 * 48);
  CHECK(j["aggregate_tok_s"].get<double>() > 0);
  CHECK(j["ttft_ms"]["p50"].get<double>() > 0);
  CHECK(j["ttft_ms"]["p99"].get<double>() >= j["ttft_ms"]["p50"].get<double>());
  CHECK(j["itl_ms"]["p50"].get<double>() > 0);
  CHECK(j["server"]["n_slots"] == 2);
  // The host's DRAM read rate, measured before the clients start (a server of its own only).
  CHECK(j["dram_gbps"].get<double>() > 0);
  // Per request: the median rate and the mean beside it, in the JSON and the printed line.
  CHECK(j["per_request_tok_s"].get<double>() > 0);
  CHECK(j["per_request_tok_s_mean"].get<double>() > 0);
  CHECK(r.out.find(fmt::format("| per request {:.1f} tok/s (median), {:.1f} (mean)\n",
                               j["per_request_tok_s"].get<double>(),
                               j["per_request_tok_s_mean"].get<double>())) != std::string::npos);
  // The engine's means: the same numbers in the JSON and the printed line.
  CHECK(j["engine"]["decode_steps"].get<int64_t>() > 0);
  CHECK(r.out.find(fmt::format("engine: {} decode steps of {:.2f} rows (means: forward {:.2f} ms, "
                               "start to next start {:.2f} ms)\n",
                               j["engine"]["decode_steps"].get<int64_t>(),
                               j["engine"]["decode_rows_per_step"].get<double>(),
                               j["engine"]["decode_step_ms"].get<double>(),
                               j["engine"]["decode_interval_ms"].get<double>())) !=
        std::string::npos);
  // Warm-up requests (default 1 per client) count in no statistic and not in the engine's
  // means: with one client and one slot, the measured request's first token comes from its
  // prompt's step and the 7 others from 7 decode steps of one row (21 with the two warm-ups).
  const fs::path out2 = out.parent_path() / "warm.json";
  r = run_command(berth_bin() + " bench serve -q -m " + shell_quote(stories260k().string()) +
                  " -np 1 -c 256 -t 1 --clients 1 --requests 1 --warmup 2 -p 8 -n 8 --json " +
                  shell_quote(out2.string()));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const json w = json::parse(read_file(out2));
  CHECK(w["warmup"] == 2);
  CHECK(w["requests"] == 1);
  CHECK(w["tokens"] == 8);
  CHECK(w["engine"]["decode_steps"] == 7);
  CHECK(w["engine"]["decode_rows_per_step"] == 1.0);
  CHECK(j["warmup"] == 1);
  // Requests the server refuses: the server's message, not an empty one; exit 1.
  r = run_command(berth_bin() + " bench serve -q -m " + shell_quote(stories260k().string()) +
                  " -np 1 -c 16 -t 1 --clients 1 --requests 1 -p 32 -n 4");
  CHECK(r.exit_code == 1);
  CHECK(r.out.find("first error: HTTP 400: the request exceeds the available context size") !=
        std::string::npos);
  CHECK(r.out.find("requests 1 (1 failed; 1 warm-up requests failed)") != std::string::npos);
  // A request that the slot's context cuts short (ignore_eos: nothing else ends it early) fails:
  // its tokens and rates are not those asked for.
  r = run_command(berth_bin() + " bench serve -q -m " + shell_quote(stories260k().string()) +
                  " -np 1 -c 48 -t 1 --clients 1 --requests 1 --warmup 0 -p 32 -n 32");
  CHECK(r.exit_code == 1);
  CHECK(r.out.find("requests 1 (1 failed) |") != std::string::npos);
  CHECK(r.out.find("first error: the request ended after ") != std::string::npos);
  CHECK(r.out.find(" of 32 tokens") != std::string::npos);
  // Usage errors exit 2: both -m and --url, neither, a scheme other than http.
  r = run_command(berth_bin() + " bench serve -m " + shell_quote(stories260k().string()) +
                  " --url http://127.0.0.1:1");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("not both") != std::string::npos);
  r = run_command(berth_bin() + " bench serve -n 4");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("needs -m MODEL or --url URL") != std::string::npos);
  // The serve flags configure the server of its own: with --url they would be ignored.
  r = run_command(berth_bin() + " bench serve --url http://127.0.0.1:1 -np 4");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--parallel: configures bench serve's own server (-m), not the one at --url") !=
        std::string::npos);
  r = run_command(berth_bin() + " bench serve -m " + shell_quote(stories260k().string()) +
                  " --host ::1");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--host: bench serve's own server listens on 127.0.0.1") != std::string::npos);
  r = run_command(berth_bin() + " bench serve --url https://127.0.0.1:8080");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("only http:// is supported") != std::string::npos);
  // Against a server that is not there: a clear error; an IPv6 address in brackets.
  r = run_command(berth_bin() + " bench serve --url http://[::1]:1 -n 4");
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("http://[::1]:1/health") != std::string::npos);
  r = run_command(berth_bin() + " bench serve --url http://127.0.0.1:1 -n 4");
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("/health") != std::string::npos);
}

TEST_CASE("several slots on the simulated device give the CPU's golden text") {
  setenv("BERTH_SIM_DEVICE", "1G", 1);
  ServeProcess p({"-m", stories260k().string(), "--port", "0", "-t", "1", "-np", "2", "-c", "1024",
                  "-ngl", "99"});
  unsetenv("BERTH_SIM_DEVICE");
  const int port = p.ready();
  REQUIRE_MESSAGE(port > 0, p.stderr_text());
  CHECK(p.stderr_text().find("SIM0") != std::string::npos);
  std::vector<std::string> got(4);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < got.size(); ++i)
    threads.emplace_back([&, i] {
      Reply r = post(port, "/v1/completions",
                     {{"prompt", "Once upon a time"}, {"max_tokens", 64}, {"temperature", 0}});
      got[i] = r.status == 200 ? r.j["choices"][0]["text"].get<std::string>() : r.body;
    });
  for (std::thread& t : threads) t.join();
  for (const std::string& g : got) CHECK(g == kStoriesContinuation);
  p.signal(SIGTERM);
  CHECK(p.wait_exit(20) == 0);
}
