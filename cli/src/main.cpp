// berth: run LLMs whose weights do not fit in GPU memory.
//
// Exit codes: 0 success; 1 an error in the input or the run (one line on stderr, naming what
// and where); 2 bad command-line usage: CLI11's parse errors and berth::Error of category usage
// (a bad value of an environment variable the CLI reads, such as BERTH_SIM_DEVICE).
#include <CLI/CLI.hpp>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <map>
#include <new>
#include <set>
#include <string>
#include <vector>

#include "berth/backends/thread_pool.h"
#include "berth/core/error.h"
#include "berth/core/log.h"
#include "berth/core/strings.h"
#include "commands.h"

namespace {

// llama.cpp's multi-letter short flags, which CLI11 cannot declare as short options, mapped to
// their long names so users' habits carry over.
std::vector<std::string> normalise_args(int argc, char** argv) {
  static const std::map<std::string, std::string> aliases = {
      {"-ub", "--ubatch-size"},   {"-cnv", "--chat"},           {"-sys", "--system-prompt"},
      {"-ngl", "--n-gpu-layers"}, {"-ot", "--override-tensor"}, {"-cmoe", "--cpu-moe"},
      {"-ncmoe", "--n-cpu-moe"},  {"-np", "--parallel"},        {"-pg", "--prompt-gen"},
  };
  // Options whose value is free text: "-p -ub" is a prompt, not a flag.
  static const std::set<std::string> text_options = {
      "-p", "--prompt", "-sys", "--system-prompt", "--chat-template", "-f", "--file"};
  std::vector<std::string> out;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    const bool is_value = i > 1 && text_options.count(argv[i - 1]) > 0;
    if (auto it = aliases.find(a); it != aliases.end() && !is_value) a = it->second;
    out.push_back(a);
  }
  std::reverse(out.begin(), out.end());  // CLI11 parses a reversed vector
  return out;
}

// Prints an error as the one line the README promises, whatever bytes the message quotes.
int fail(std::string_view message, int code) {
  std::fprintf(stderr, "berth: error: %s\n", berth::printable(message, 2000).c_str());
  return code;
}

// --help and --version print to stdout: a write that failed (a full disk, a closed pipe) is an
// error (exit 1), as every command's output is (write_stdout).
int help_exit(int code) {
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    std::fprintf(stderr, "berth: error: cannot write to stdout: %s\n",
                 std::strerror(errno ? errno : EIO));
    return 1;
  }
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);
  berth::WorkerThreadsGuard workers;  // joins oneTBB's workers before exit
  CLI::App app{"berth: LLM inference for models larger than GPU memory", "berth"};
  app.require_subcommand(1);
  // Like llama.cpp: a flag given twice takes its last value.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.set_version_flag("--version", "berth 0.1.0");
  std::string log_level = "warn";
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error or off")
      ->capture_default_str()
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}));

  berth::cli::Runner run = berth::cli::add_run(app);
  berth::cli::Runner inspect = berth::cli::add_inspect(app);
  berth::cli::Runner tokenize = berth::cli::add_tokenize(app);
  berth::cli::Runner quantize = berth::cli::add_quantize(app);
  berth::cli::Runner bench = berth::cli::add_bench(app);
  berth::cli::Runner synth = berth::cli::add_synth(app);
  berth::cli::Runner plan = berth::cli::add_plan(app);
  berth::cli::Runner trace = berth::cli::add_trace(app);
  berth::cli::Runner serve = berth::cli::add_serve(app);

  try {
    std::vector<std::string> args = normalise_args(argc, argv);
    app.parse(args);
  } catch (const CLI::CallForHelp& e) {
    return help_exit(app.exit(e));
  } catch (const CLI::CallForAllHelp& e) {
    return help_exit(app.exit(e));
  } catch (const CLI::CallForVersion& e) {
    return help_exit(app.exit(e));
  } catch (const CLI::ParseError& e) {
    std::string what = e.what();
    // "A subcommand is required" after an unknown word: name the word and the choices.
    CLI::App* at = &app;
    while (!at->get_subcommands().empty()) at = at->get_subcommands().front();
    if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) {
      // CLI11 lists the extras of the reversed vector it parsed; name them as they were typed.
      std::string typed;
      for (const std::string& a : app.remaining(true)) typed += (typed.empty() ? "" : " ") + a;
      if (!typed.empty()) what = "The following arguments were not expected: " + typed;
    }
    const std::vector<std::string> extra = at->remaining();
    if (!extra.empty() && !extra.front().empty() && extra.front()[0] != '-' &&
        !at->get_subcommands([](CLI::App*) { return true; }).empty()) {
      std::string names;
      for (const CLI::App* s : at->get_subcommands([](CLI::App*) { return true; }))
        names += (names.empty() ? "" : ", ") + s->get_name();
      const std::string cmd = at == &app ? std::string("berth") : "berth " + at->get_name();
      what = "'" + extra.front() + "' is not a subcommand of '" + cmd + "' (one of: " + names + ")";
    }
    std::fprintf(stderr, "berth: error: %s (run 'berth --help' for usage)\n",
                 berth::printable(what, 2000).c_str());
    return 2;
  }

  try {
    berth::log::set_level(berth::log::parse_level(log_level));
    for (CLI::App* sub : app.get_subcommands()) {
      const std::string& name = sub->get_name();
      if (name == "run") return run();
      if (name == "inspect") return inspect();
      if (name == "tokenize") return tokenize();
      if (name == "quantize") return quantize();
      if (name == "bench") return bench();
      if (name == "synth") return synth();
      if (name == "plan") return plan();
      if (name == "trace") return trace();
      if (name == "serve") return serve();
    }
    return 2;
  } catch (const berth::Error& e) {
    return fail(e.what(), e.category() == berth::ErrorCategory::usage ? 2 : 1);
  } catch (const std::bad_alloc&) {
    return fail("out of memory", 1);
  } catch (const std::exception& e) {
    return fail(e.what(), 1);
  }
}
