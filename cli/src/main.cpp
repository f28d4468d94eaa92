// berth: run LLMs whose weights do not fit in GPU memory.
//
// Exit codes: 0 success; 1 an error in the input or the run (one line on stderr, naming what
// and where); 2 bad command-line usage.
#include <CLI/CLI.hpp>

#include <csignal>
#include <cstdio>
#include <map>
#include <new>
#include <string>
#include <vector>

#include "berth/core/error.h"
#include "berth/core/log.h"
#include "commands.h"

namespace {

// llama.cpp's multi-letter short flags, which CLI11 cannot declare as short options, mapped to
// their long names so users' habits carry over.
std::vector<std::string> normalise_args(int argc, char** argv) {
  static const std::map<std::string, std::string> aliases = {
      {"-ub", "--ubatch-size"}, {"-ngl", "--n-gpu-layers"}, {"-ot", "--override-tensor"},
      {"-cnv", "--conversation"}, {"-np", "--parallel"},  {"-fa", "--flash-attn"},
  };
  std::vector<std::string> out;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (auto it = aliases.find(a); it != aliases.end()) a = it->second;
    out.push_back(a);
  }
  std::reverse(out.begin(), out.end());  // CLI11 parses a reversed vector
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"berth: LLM inference for models larger than GPU memory", "berth"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "berth 0.1.0");
  std::string log_level = "warn";
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error or off")
      ->capture_default_str();

  berth::cli::Runner run = berth::cli::add_run(app);
  berth::cli::Runner inspect = berth::cli::add_inspect(app);
  berth::cli::Runner tokenize = berth::cli::add_tokenize(app);
  berth::cli::Runner quantize = berth::cli::add_quantize(app);
  berth::cli::Runner bench = berth::cli::add_bench(app);

  try {
    std::vector<std::string> args = normalise_args(argc, argv);
    app.parse(args);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "berth: error: %s\nRun 'berth --help' for usage.\n", e.what());
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
    }
    return 2;
  } catch (const berth::Error& e) {
    std::fprintf(stderr, "berth: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "berth: error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "berth: error: %s\n", e.what());
    return 1;
  }
}
