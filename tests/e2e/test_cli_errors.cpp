// The CLI on missing, unreadable, empty, truncated and garbage files, and on bad flags: one clear
// line on stderr and a non-zero exit, never a crash.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <random>

#include "test_util.h"

namespace fs = std::filesystem;
using berth::test::CommandResult;
using berth::test::run_command;
using berth::test::shell_quote;

namespace {

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Runs each subcommand that opens a model on `path` and checks the clean failure.
void expect_clean_failure(const fs::path& path, const std::string& must_mention) {
  for (const std::string& cmd : {std::string(" run -n 4 --temp 0 -p hi -m "),
                                 std::string(" inspect "), std::string(" tokenize -p hi -m ")}) {
    CAPTURE(cmd);
    CommandResult r = run_command(berth::test::berth_bin() + cmd + shell_quote(path.string()));
    CHECK_FALSE(r.signaled);
    CHECK(r.exit_code == 1);
    CHECK(r.out.empty());
    CHECK(r.err.rfind("berth: error: ", 0) == 0);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK(r.err.find(must_mention) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("missing, empty, directory and garbage files fail cleanly") {
  const fs::path dir = berth::test::temp_dir("cli-errors");
  expect_clean_failure(dir / "does-not-exist.gguf", "does-not-exist.gguf");
  write_bytes(dir / "empty.gguf", "");
  expect_clean_failure(dir / "empty.gguf", "empty.gguf");
  expect_clean_failure(dir, dir.filename().string());
  std::mt19937 rng(42);
  std::string garbage(4096, '\0');
  for (char& c : garbage) c = static_cast<char>(rng());
  write_bytes(dir / "garbage.gguf", garbage);
  expect_clean_failure(dir / "garbage.gguf", "garbage.gguf");
  // A file with the right magic and version but garbage after it.
  write_bytes(dir / "header-only.gguf", std::string("GGUF\x03\0\0\0", 8) + garbage);
  expect_clean_failure(dir / "header-only.gguf", "header-only.gguf");
}

TEST_CASE("a truncated download of the real model fails cleanly at every cut") {
  const fs::path dir = berth::test::temp_dir("cli-trunc");
  const std::string full = berth::test::read_file(berth::test::stories260k());
  REQUIRE(full.size() == 1185376);
  // Cuts inside the header, the vocabulary, the tensor infos and the tensor data.
  for (size_t cut : {size_t{3}, size_t{20}, size_t{1000}, size_t{9000}, size_t{14160},
                     size_t{600000}, full.size() - 1}) {
    CAPTURE(cut);
    const fs::path p = dir / ("cut" + std::to_string(cut) + ".gguf");
    write_bytes(p, full.substr(0, cut));
    expect_clean_failure(p, p.filename().string());
  }
}

TEST_CASE("a prompt file longer than the context names the file and the sizes") {
  const std::string model = shell_quote(berth::test::stories260k().string());
  const auto dir = berth::test::temp_dir("cli-long-prompt");
  const auto path = dir / "long prompt.txt";
  {
    std::ofstream f(path);
    for (int i = 0; i < 100; ++i) f << "once upon a time ";
  }
  const CommandResult r = run_command(berth::test::berth_bin() + " run -m " + model + " -f " +
                                      shell_quote(path.string()) + " -c 64 -n 4");
  CHECK_FALSE(r.signaled);
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("the prompt in " + path.string() + " is ") != std::string::npos);
  CHECK(r.err.find(" tokens, more than the context size of 64 (raise -c)") != std::string::npos);
}

TEST_CASE("bad flags are usage errors with exit code 2") {
  const std::string model = shell_quote(berth::test::stories260k().string());
  CommandResult r = run_command(berth::test::berth_bin() + " run -m " + model + " -p hi -t -3");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("berth: error:") != std::string::npos);
  r = run_command(berth::test::berth_bin() + " run -p hi");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--model") != std::string::npos);
  r = run_command(berth::test::berth_bin() + " frobnicate");
  CHECK(r.exit_code == 2);
  r = run_command(berth::test::berth_bin());
  CHECK(r.exit_code == 2);
  // Numeric options say whether the value is not a number or outside the range, and name both.
  r = run_command(berth::test::berth_bin() + " serve -m " + model + " -np x");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--parallel: 'x' is not a whole number in 1..256") != std::string::npos);
  r = run_command(berth::test::berth_bin() + " serve -m " + model + " --port 70000");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--port: 70000 is outside 0..65535") != std::string::npos);
  r = run_command(berth::test::berth_bin() + " bench model -m " + model +
                  " --stream-split pcie=0,cpu=9");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--stream-split: 'pcie=0,cpu=9': 'pcie=0' is not a positive number") !=
        std::string::npos);
  r = run_command(berth::test::berth_bin() + " run -m " + model + " -p hi --n-cpu-moe -1");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--n-cpu-moe: -1 is outside 0..") != std::string::npos);
  r = run_command(berth::test::berth_bin() + " run -m " + model + " -p hi -n abc");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--n-predict: 'abc' is not a whole number in -1..2147483647") !=
        std::string::npos);
  r = run_command(berth::test::berth_bin() + " run -m " + model + " -p hi -n -2");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--n-predict: -2 is outside -1..2147483647") != std::string::npos);
  // synth's shape flags: the GDN layers' three are needed for a Qwen3.5 file and named together;
  // qwen35moe has no dense FFN, so no --n-ff (nothing is written: the check comes first).
  r = run_command(
      berth::test::berth_bin() +
      " synth --arch qwen35moe --type f32 --n-layer 4 --n-embd 64 --n-head 2 --n-vocab 512 -o "
      "/nonexistent/x.gguf");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("missing: --ssm-d-state, --ssm-n-group, --ssm-dt-rank (") != std::string::npos);
  CHECK(r.err.find("--n-ff") == std::string::npos);
}

TEST_CASE("an empty model path and an unwritable JSON path are named") {
  CommandResult r = run_command(berth::test::berth_bin() + " run -m '' -p hi -n 1");
  CHECK(r.exit_code == 1);
  CHECK(r.err == "berth: error: (an empty path): cannot open: No such file or directory\n");
  const std::string model = shell_quote(berth::test::stories260k().string());
  r = run_command(berth::test::berth_bin() + " bench model -m " + model +
                  " -p 16 -n 0 -r 1 --json /nonexistent-berth-dir/x.json");
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("cannot write the JSON file '/nonexistent-berth-dir/x.json': No such file or "
                   "directory") != std::string::npos);
}

TEST_CASE("bad values fail with one clear line") {
  const std::string model = shell_quote(berth::test::stories260k().string());
  CommandResult r =
      run_command(berth::test::berth_bin() + " run -m " + model + " -p hi --top-p 1.5");
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("top_p") != std::string::npos);
  r = run_command(berth::test::berth_bin() + " run -m " + model + " -p 'Once upon a time' -c 3");
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("context") != std::string::npos);
}

TEST_CASE("berth inspect lists metadata and tensors with totals") {
  CommandResult r = run_command(berth::test::berth_bin() + " inspect " +
                                shell_quote(berth::test::stories260k().string()));
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("GGUF version 3") != std::string::npos);
  CHECK(r.out.find("llama.embedding_length") != std::string::npos);
  CHECK(r.out.find("blk.4.ffn_up.weight") != std::string::npos);
  CHECK(r.out.find("[64, 512]") != std::string::npos);
  CHECK(r.out.find("48 tensors") != std::string::npos);
}

namespace {

// A copy of stories260K with the bytes after metadata key `key` (its type, then the value)
// patched by `patch(bytes, value_offset)`.
std::string patched_stories(const std::string& key,
                            const std::function<void(std::string&, size_t)>& patch) {
  std::string bytes = berth::test::read_file(berth::test::stories260k());
  const size_t at = bytes.find(key);
  REQUIRE(at != std::string::npos);
  patch(bytes, at + key.size() + 4);  // skip the uint32 value type
  return bytes;
}

}  // namespace

TEST_CASE("a FIFO is refused at once instead of blocking") {
  const fs::path fifo = berth::test::temp_dir("cli-fifo") / "model.gguf";
  fs::remove(fifo);
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  expect_clean_failure(fifo, "not a regular file");
}

TEST_CASE("tensors the architecture does not use are an error (wrong block_count)") {
  const fs::path p = berth::test::temp_dir("cli-bc") / "bc4.gguf";
  write_bytes(p, patched_stories("llama.block_count", [](std::string& b, size_t off) {
                const uint32_t four = 4;
                std::memcpy(&b[off], &four, 4);
              }));
  CommandResult r =
      run_command(berth::test::berth_bin() + " run -n 2 -p hi -m " + shell_quote(p.string()));
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("'blk.4.attn_q.weight' is not used") != std::string::npos);
}

TEST_CASE("bytes quoted from the file are escaped: the error stays one line") {
  const fs::path p = berth::test::temp_dir("cli-esc") / "arch.gguf";
  write_bytes(p, patched_stories("general.architecture", [](std::string& b, size_t off) {
                // The string's 5 bytes ("llama") become "l\na\x1bm".
                const char evil[5] = {'l', '\n', 'a', '\x1b', 'm'};
                std::memcpy(&b[off + 8], evil, 5);
              }));
  CommandResult r =
      run_command(berth::test::berth_bin() + " run -n 2 -p hi -m " + shell_quote(p.string()));
  CHECK(r.exit_code == 1);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(r.err.find("'l\\na\\x1bm'") != std::string::npos);
}

TEST_CASE("run: prompt file checks, random seed reported, last flag wins, closed stdout") {
  const std::string model = shell_quote(berth::test::stories260k().string());
  const std::string bin = berth::test::berth_bin();
  CommandResult r = run_command(bin + " run -m " + model + " -f /tmp -n 2");
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("not a regular file") != std::string::npos);
  // -s -1 picks a random seed and reports it; passing it back repeats the run.
  r = run_command(bin + " run -m " + model + " -p 'Once upon' -n 12 -s -1");
  REQUIRE(r.exit_code == 0);
  const size_t at = r.err.find("seed ");
  REQUIRE(at != std::string::npos);
  const std::string seed = r.err.substr(at + 5, r.err.find('\n', at) - at - 5);
  CommandResult again = run_command(bin + " run -m " + model + " -p 'Once upon' -n 12 -s " + seed);
  CHECK(again.out == r.out);
  // A flag given twice takes the last value, as in llama.cpp.
  r = run_command(bin + " run -m " + model + " -p 'Once upon a time' --temp 0 -n 2 -n 64");
  CHECK(r.exit_code == 0);
  CHECK(r.out == berth::test::kStoriesContinuation);
  // Closing stdout early stops generation without an error.
  r = run_command(bin + " run -m " + model + " -p 'Once upon a time' --temp 0 -n 2000 | head -c 5");
  CHECK(r.out == ", the");
}

TEST_CASE("llama.cpp's short flags are mapped, but not inside a prompt") {
  const std::string model = shell_quote(berth::test::stories260k().string());
  CommandResult r = run_command(berth::test::berth_bin() + " run -m " + model +
                                " -p -ub --display-prompt -n 1 --temp 0 -ub 2");
  CHECK(r.exit_code == 0);
  CHECK(r.out.rfind("-ub", 0) == 0);  // the prompt as given, not "--ubatch-size"
  r = run_command(berth::test::berth_bin() + " plan -m " + model + " -ngl 0 --json");
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("\"how\"") != std::string::npos);
}

TEST_CASE("trial findings: bench kernels past the core count, NaN shares, device-only flags") {
  const std::string bin = berth::test::berth_bin();
  const std::string model = shell_quote(berth::test::stories260k().string());
  // More threads than the machine runs: the pool lowers the count; this used to crash.
  CommandResult r = run_command(bin + " bench kernels --quick -q --threads 1000,1 --types q4_0");
  CHECK_FALSE(r.signaled);
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("q4_0") != std::string::npos);
  // NaN passes CLI::Range; the share's check refuses it (and inf), naming the flag.
  for (const char* v : {"nan", "inf", "1.5"}) {
    CAPTURE(v);
    r = run_command(bin + " run -m " + model + " -p hi -n 1 --host-expert-share " + v);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("--host-expert-share") != std::string::npos);
  }
  // Options that need a device say so when nothing is on one.
  r = run_command(bin + " run -m " + model + " -p hi -n 1 --temp 0 --host-expert-share 0.5");
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("--host-expert-share 0.5 has no effect") != std::string::npos);
  // ... and when no expert tensor stays on the CPU (every weight on the simulated device).
  const std::string moe_model =
      shell_quote((berth::test::temp_dir("cli-errors") / "tiny-qwen3moe.gguf").string());
  REQUIRE(
      run_command(bin + " synth --preset tiny-qwen3moe --type q8_0 -o " + moe_model).exit_code ==
      0);
  // `berth run` with these arguments (on the simulated device) exits with `code` and its
  // stderr holds each of `says`.
  const auto expect_run = [&](const std::string& args, int code,
                              std::initializer_list<const char*> says) {
    CAPTURE(args);
    const CommandResult c = run_command("BERTH_SIM_DEVICE=1G " + bin + " run " + args);
    CHECK(c.exit_code == code);
    for (const char* text : says) {
      CAPTURE(text);
      CHECK(c.err.find(text) != std::string::npos);
    }
    return c;
  };
  const std::string moe_run = "-m " + moe_model + " -p hi -n 1 --temp 0 -ngl 99 ";
  expect_run(moe_run + "--host-expert-share 0.5 --stream-experts 64", 0,
             {"--host-expert-share 0.5 has no effect: no expert tensor stays on the CPU",
              "--stream-experts 64 has no effect: no expert tensor stays on the CPU"});
  r = expect_run(moe_run + "--cpu-moe --host-expert-share 0.5", 0, {});
  CHECK(r.err.find("has no effect") == std::string::npos);
  // --stream-split where it cannot act: no streaming, no expert on the CPU, no device.
  expect_run(moe_run + "--cpu-moe --stream-experts 0 --stream-split on", 0,
             {"--stream-split has no effect: no prefill step streams CPU-held experts"});
  expect_run(moe_run + "--stream-split on", 0,
             {"--stream-split has no effect: no expert tensor stays on the CPU"});
  r = expect_run(moe_run + "--cpu-moe --stream-experts 8 --stream-split on", 0, {});
  CHECK(r.err.find("has no effect") == std::string::npos);
  r = run_command(bin + " run -m " + moe_model + " -p hi -n 1 --temp 0 --stream-split on");
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("--stream-split has no effect: no GPU holds any weight") != std::string::npos);
  // A share too small to give the device one slot of the 2 x 2 (layers x n_expert_used).
  expect_run(moe_run + "--cpu-moe --host-expert-share 1e-300", 0, {"gives the device no slot"});
  // A dense model: the expert options name the reason.
  expect_run("-m " + model + " -p hi -n 1 --temp 0 -ngl 99 --stream-experts 8", 0,
             {"--stream-experts 8 has no effect: the model has no routed experts"});
  // --stream-experts takes auto or a token count, and says so.
  expect_run("-m " + model + " -p hi -n 1 --stream-experts foo", 2,
             {"'foo' is not auto or a number of tokens"});
  // An unknown subcommand is named, with the choices.
  r = run_command(bin + " bench foo");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find(
            "'foo' is not a subcommand of 'berth bench' (one of: kernels, model, disk, serve)") !=
        std::string::npos);
  // A budget under 1 MiB is printed in KiB, not as "0.0 MiB".
  r = run_command("BERTH_SIM_DEVICE=1G " + bin + " run -m " + model +
                  " -p hi -n 1 -ngl 99 --vram-budget 1K");
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("the budget is 1.0 KiB") != std::string::npos);
  // Bad bench kernels arguments are refused, not replaced by defaults.
  for (const char* a : {"--reps 0", "--reps -3", "--gemv-mib 0", "--dram-mib 0", "--few-tokens 0",
                        "--few-tokens 2,,3", "--few-tokens two"}) {
    CAPTURE(a);
    r = run_command(bin + " bench kernels --quick -q " + a);
    CHECK(r.exit_code == 2);
  }
  r = run_command(bin + " bench kernels --quick -q --types ''");
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("--types lists no weight type") != std::string::npos);
  r = run_command(bin + " run -m " + model + " -p hi -n 1 --top-k -5");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--top-k") != std::string::npos);
  // A budget without a GPU is reported as ignored (run; `plan` plans for such a GPU instead).
  r = run_command(bin + " run -m " + model + " -p hi -n 1 --temp 0 --vram-budget 1G");
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("--vram-budget 1024.0 MiB ignored: no GPU found") != std::string::npos);
  // --warm-workers with the hand-off by callbacks says so.
  r = run_command("BERTH_SIM_DEVICE=1G " + bin + " bench model -m " + model +
                  " -p 0 -n 2 -r 1 -q --dram-mib 64 -ngl 99 --handoff callback --warm-workers 500");
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("--warm-workers 500 has no effect: the hand-off is by host callbacks") !=
        std::string::npos);
  // --warm-workers: only a value the user gave is reported as unused, not the default.
  r = run_command(bin + " bench model -m " + model + " -p 0 -n 2 -r 1 --dram-mib 64");
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("--warm-workers") == std::string::npos);
  r = run_command(bin + " bench model -m " + model +
                  " -p 0 -n 2 -r 1 --dram-mib 64 --warm-workers 500");
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("--warm-workers 500 has no effect") != std::string::npos);
  // run takes --warm-workers too: unused without a device, a range error below 0, and with the
  // simulated device the same tokens as without the spin.
  r = run_command(bin + " run -m " + model + " -p hi -n 1 --temp 0 --warm-workers 500");
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("--warm-workers 500 has no effect") != std::string::npos);
  r = run_command(bin + " run -m " + model + " -p hi -n 1 --warm-workers -5");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--warm-workers") != std::string::npos);
  const CommandResult cold = run_command("BERTH_SIM_DEVICE=1G " + bin + " run -m " + model +
                                         " -p 'Once upon a time' -n 12 --temp 0 -ngl 99 -ot " +
                                         "'ffn=CPU' --warm-workers 0");
  const CommandResult warm = run_command("BERTH_SIM_DEVICE=1G " + bin + " run -m " + model +
                                         " -p 'Once upon a time' -n 12 --temp 0 -ngl 99 -ot " +
                                         "'ffn=CPU' --warm-workers 300");
  CHECK(cold.exit_code == 0);
  CHECK(warm.exit_code == 0);
  CHECK(cold.out.size() > 20);
  CHECK(warm.out == cold.out);
  // plan notes what run would warn about or refuse with the same -c: above the trained
  // context_length, and a CPU KV cache larger than the machine's memory (stories260K: 1280
  // bytes per position; 2^24 positions are 20 GiB, more or less than this machine has).
  r = run_command(bin + " plan -m " + model + " -c 16777216");
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("-c 16777216 is more than the 2048 tokens the model was trained on "
                   "(llama.context_length)") != std::string::npos);
  const double phys = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  CHECK((r.out.find("the CPU's KV cache (20480.0 MiB) is more than this machine's") !=
         std::string::npos) == (phys < 20480.0 * 1024 * 1024));
  r = run_command(bin + " plan -m " + model + " -c 2048");
  CHECK(r.out.find("trained on") == std::string::npos);
  // Counts and sizes below 0 are usage errors, not huge unsigned values.
  r = run_command(bin + " inspect " + model + " --max-array-items -1");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--max-array-items") != std::string::npos);
  r = run_command(bin + " bench model -m " + model + " -p 0 -n 2 --dram-mib -1");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--dram-mib") != std::string::npos);
  // Nothing to measure is an error, not an empty report.
  r = run_command(bin + " bench model -m " + model + " -p 0 -n 0");
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("nothing to measure") != std::string::npos);
}

TEST_CASE("unexpected arguments are named in the order they were typed") {
  const std::string m = shell_quote(berth::test::stories260k().string());
  const CommandResult r = run_command(berth::test::berth_bin() + " run -m " + m + " -x 3 extra");
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("not expected: -x 3 extra") != std::string::npos);
}

TEST_CASE("--help and --version to a stdout that cannot be written: exit 1 and the reason") {
  const std::string bin = berth::test::berth_bin();
  for (const std::string args : {"--help", "--version", "serve --help", "bench model --help"}) {
    CAPTURE(args);
    const CommandResult r = run_command(bin + " " + args + " > /dev/full");
    CHECK(r.exit_code == 1);
    CHECK(r.err.find("berth: error: cannot write to stdout: No space left on device") !=
          std::string::npos);
    CHECK(run_command(bin + " " + args).exit_code == 0);
  }
}
