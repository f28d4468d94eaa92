// Subcommands of the `berth` executable. Each registers its options on the parent app and
// returns the function that runs it (returning the process exit code).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>

#include "berth/models/model.h"
#include "validators.h"

namespace berth::cli {

using Runner = std::function<int()>;

Runner add_run(CLI::App& app);
Runner add_inspect(CLI::App& app);
Runner add_tokenize(CLI::App& app);
Runner add_quantize(CLI::App& app);
Runner add_bench(CLI::App& app);
Runner add_synth(CLI::App& app);
Runner add_plan(CLI::App& app);
Runner add_trace(CLI::App& app);
Runner add_serve(CLI::App& app);
/// `bench serve` (cmd_serve.cpp), registered by add_bench on its `bench` subcommand.
Runner add_bench_serve(CLI::App& bench);

/// Writes all of `s` to stdout and flushes. Returns false when the reader of a pipe has gone
/// (EPIPE, e.g. `| head`): commands then stop and exit 0. Throws Error(io) for any other write
/// failure (a full disk, an I/O error).
bool write_stdout(std::string_view s);

/// The warning `run` prints and `plan` notes when the context `n_ctx` exceeds the trained
/// context_length of `hp`; empty when it does not.
std::string context_note(int64_t n_ctx, const Hparams& hp);

}  // namespace berth::cli
