// Subcommands of the `berth` executable. Each registers its options on the parent app and
// returns the function that runs it (returning the process exit code).
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace berth::cli {

using Runner = std::function<int()>;

Runner add_run(CLI::App& app);
Runner add_inspect(CLI::App& app);
Runner add_tokenize(CLI::App& app);
Runner add_quantize(CLI::App& app);
Runner add_bench(CLI::App& app);

/// Writes all of `s` to stdout and flushes; returns false when stdout is closed (e.g. a pipe
/// whose reader exited), so commands can stop instead of dying of SIGPIPE.
bool write_stdout(std::string_view s);

}  // namespace berth::cli
