// `berth bench model --json` on a tiny synthetic MoE file, with and without a simulated device:
// the reported numbers obey the relations the docs state (bounds from bytes and bandwidths,
// fractions of the step), whatever the timings were. No speed is asserted.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "test_util.h"

namespace {

using berth::test::CommandResult;
using berth::test::run_command;
using berth::test::shell_quote;

nlohmann::json bench_json(const std::string& env, const std::string& model,
                          const std::string& flags, const std::filesystem::path& out) {
  const CommandResult r =
      run_command(env + " " + berth::test::berth_bin() + " bench model -m " + shell_quote(model) +
                  " -p 8 -n 8 -r 2 -t 2 -q " + flags + " --json " + shell_quote(out.string()));
  CAPTURE(r.err);
  REQUIRE(r.exit_code == 0);
  std::ifstream in(out);
  return nlohmann::json::parse(in);
}

bool near(double a, double b) { return std::abs(a - b) <= 1e-9 * std::max(std::abs(a), 1.0); }

}  // namespace

TEST_CASE("bench model: bounds and busy shares follow from the measured numbers") {
  const auto dir = berth::test::temp_dir("bench_model");
  const std::string model = (dir / "moe.gguf").string();
  const CommandResult s =
      run_command(berth::test::berth_bin() + " synth --preset tiny-qwen3moe --type q8_0 -o " +
                  shell_quote(model));
  REQUIRE(s.exit_code == 0);

  // CPU only: the DRAM bound, no device fields.
  nlohmann::json j = bench_json("", model, "-ngl 0", dir / "cpu.json");
  const double bytes = j["decode_weight_bytes"].get<double>() + j["decode_kv_bytes"].get<double>();
  CHECK(near(j["bound_tok_s"].get<double>(), j["dram_gbps"].get<double>() * 1e9 / bytes));
  CHECK(near(j["fraction_of_bound"].get<double>(),
             j["tg_tok_s"].get<double>() / j["bound_tok_s"].get<double>()));
  CHECK(j["tg_device_busy"].get<double>() == 0);
  // The experts' split: one call per layer and decode step (-n 8), the parts adding up to the
  // whole, and between one and two threads of the pool (-t 2) taking tasks in the region (a
  // thread that joins after the tasks ran out takes none).
  const auto& moe = j["tg_moe"];
  CHECK(moe["calls_per_run"].get<int64_t>() == 8 * j["model"]["n_layer"].get<int64_t>());
  const double parts = moe["before_us"].get<double>() + moe["region_us"].get<double>() +
                       moe["after_us"].get<double>();
  CHECK(std::abs(parts - moe["total_us"].get<double>()) <= 1e-6 * moe["total_us"].get<double>());
  CHECK(moe["threads"].get<double>() >= 1.0);
  CHECK(moe["threads"].get<double>() <= 2.0);
  CHECK(moe["region_us"].get<double>() > 0);

  // Experts on the CPU, the rest on a simulated device.
  j = bench_json("BERTH_SIM_DEVICE=1G", model, "-ngl 99 --cpu-moe", dir / "hyb.json");
  const double wb = j["decode_weight_bytes"].get<double>() + j["decode_kv_bytes"].get<double>();
  // The DRAM bound stays the whole model's at DRAM speed (it was once overwritten).
  CHECK(near(j["bound_tok_s"].get<double>(), j["dram_gbps"].get<double>() * 1e9 / wb));
  const double cpu_b = j["decode_cpu_bytes"].get<double>(),
               gpu_b = j["decode_gpu_bytes"].get<double>();
  CHECK(cpu_b > 0);
  CHECK(gpu_b > 0);
  const double t = cpu_b / (j["dram_gbps"].get<double>() * 1e9) +
                   gpu_b / (j["hbm_copy_gbps"].get<double>() * 1e9);
  CHECK(near(j["hybrid_bound_tok_s"].get<double>(), 1.0 / t));
  CHECK(near(j["fraction_of_bound"].get<double>(),
             j["tg_tok_s"].get<double>() / j["hybrid_bound_tok_s"].get<double>()));
  // Both sides worked: shares of the step's wall time (timings, so only their range is checked).
  CHECK(j["tg_cpu_busy"].get<double>() > 0);
  CHECK(j["tg_cpu_busy"].get<double>() <= 1.0);
  CHECK(j["tg_device_busy"].get<double>() > 0);

  // --host-expert-share 0.25: the device takes round(n_layer x 0.25 x k) of the CPU-held route
  // slots (q8_0 experts, every layer alike), which leave the DRAM bytes for the PCIe bytes, and
  // the two sides' expert parts run at the same time (max, not sum).
  nlohmann::json sh = bench_json("BERTH_SIM_DEVICE=1G", model,
                                 "-ngl 99 --cpu-moe --host-expert-share 0.25", dir / "share.json");
  const double n_layer = sh["model"]["n_layer"].get<double>(),
               k = sh["model"]["n_expert_used"].get<double>();
  const double slots = std::floor(n_layer * 0.25 * k + 0.5);
  REQUIRE(slots > 0);
  const double share_b = sh["decode_share_bytes"].get<double>(),
               cpu_share = sh["decode_cpu_bytes"].get<double>();
  // Share 1: every slot to the device, so the whole routed experts' bytes (cpu_b also counts
  // the token_embd row that stays on the CPU).
  const double experts_b =
      bench_json("BERTH_SIM_DEVICE=1G", model, "-ngl 99 --cpu-moe --host-expert-share 1",
                 dir / "all.json")["decode_share_bytes"]
          .get<double>();
  CHECK(experts_b > 0);
  CHECK(experts_b < cpu_b);
  CHECK(near(share_b, experts_b * slots / (n_layer * k)));
  CHECK(near(cpu_share + share_b, cpu_b));
  CHECK(near(sh["decode_gpu_bytes"].get<double>(), gpu_b));
  const double ts = std::max(cpu_share / (sh["dram_gbps"].get<double>() * 1e9),
                             share_b / (sh["h2d_pinned_gbps"].get<double>() * 1e9)) +
                    gpu_b / (sh["hbm_copy_gbps"].get<double>() * 1e9);
  CHECK(near(sh["hybrid_bound_tok_s"].get<double>(), 1.0 / ts));
  CHECK(j["decode_share_bytes"].get<double>() == 0);
  // -ngl 1: layer 0 stays wholly on the CPU (its norm too), so only layer 1 is split; the two
  // layers' experts are alike (q8_0), so share 1 moves half of the experts' bytes.
  const double half_b =
      bench_json("BERTH_SIM_DEVICE=1G", model, "-ngl 1 --cpu-moe --host-expert-share 1",
                 dir / "ngl1.json")["decode_share_bytes"]
          .get<double>();
  CHECK(near(half_b, experts_b / 2));

  // --profile with a device: device time per op kind (the simulated device times its marks too;
  // it once reported every op at 0 s), and the device's ops are the model's (matmul among them).
  j = bench_json("BERTH_SIM_DEVICE=1G", model, "-ngl 99 --cpu-moe --profile", dir / "prof.json");
  double dev_s = 0;
  bool matmul = false;
  for (const auto& o : j["tg_gpu_profile"]) {
    dev_s += o["seconds"].get<double>();
    matmul = matmul || (o["op"] == "matmul" && o["seconds"].get<double>() > 0);
  }
  CHECK(dev_s > 0);
  CHECK(matmul);

  // --json -: the JSON on standard output (the table on standard error).
  const CommandResult o = run_command(berth::test::berth_bin() + " bench model -m " +
                                      shell_quote(model) + " -p 4 -n 4 -r 1 -t 2 -q --json -");
  REQUIRE(o.exit_code == 0);
  CHECK(nlohmann::json::parse(o.out)["tg_tok_s"].get<double>() > 0);
  CHECK(o.err.find("tg4") != std::string::npos);
}

TEST_CASE("bench model: a run that fails leaves the --json file as it was") {
  const auto dir = berth::test::temp_dir("bench_model_fail");
  const auto kept = dir / "kept.json";
  {
    std::ofstream f(kept);
    f << "{\"earlier\": 1}\n";
  }
  const std::string missing = shell_quote((dir / "no-such-model.gguf").string());
  CommandResult r = run_command(berth::test::berth_bin() + " bench model -m " + missing +
                                " --json " + shell_quote(kept.string()));
  CHECK(r.exit_code == 1);
  std::ifstream in(kept);
  CHECK(nlohmann::json::parse(in)["earlier"] == 1);
  // A file the run would have created is not left behind empty.
  const auto fresh = dir / "fresh.json";
  r = run_command(berth::test::berth_bin() + " bench model -m " + missing + " --json " +
                  shell_quote(fresh.string()));
  CHECK(r.exit_code == 1);
  CHECK_FALSE(std::filesystem::exists(fresh));
}

TEST_CASE("bench model: depths on a Qwen3.5 file, whose recurrent state is written back per run") {
  // The state cannot be cut back to the depth (Session::truncate): bench saves it there and
  // writes it back before each run; a shallower depth after a deeper one fills again from 0.
  const auto dir = berth::test::temp_dir("bench_model_qwen35");
  const std::string model = (dir / "q35.gguf").string();
  const CommandResult s =
      run_command(berth::test::berth_bin() + " synth --preset tiny-qwen35 --type q8_0 -o " +
                  shell_quote(model));
  REQUIRE(s.exit_code == 0);
  const CommandResult r =
      run_command(berth::test::berth_bin() + " bench model -m " + shell_quote(model) +
                  " -t 2 -q -p 8 -n 4 -pg 8,4 -d 0,16,8 -r 2 -o json");
  CAPTURE(r.err);
  REQUIRE(r.exit_code == 0);
  const nlohmann::json j = nlohmann::json::parse(r.out);
  REQUIRE(j.is_array());
  REQUIRE(j.size() == 9);
  const char* names[] = {"pp8",           "tg4",      "pp8+tg4",  "pp8 @ d16",   "tg4 @ d16",
                         "pp8+tg4 @ d16", "pp8 @ d8", "tg4 @ d8", "pp8+tg4 @ d8"};
  for (size_t i = 0; i < 9; ++i) {
    CAPTURE(i);
    CHECK(j[i]["test"] == names[i]);
    CHECK(j[i]["n_depth"] == (i < 3 ? 0 : i < 6 ? 16 : 8));
    CHECK(j[i]["samples_ns"].size() == 2);
    CHECK(j[i]["model_type"].get<std::string>().rfind("qwen35 ", 0) == 0);
  }
}

TEST_CASE("bench model: llama-bench's lists, depth and output formats") {
  const std::string bin = berth::test::berth_bin() + " bench model -m " +
                          shell_quote(berth::test::stories260k().string()) +
                          " -t 2 -q --dram-mib 16 ";
  // -o json: an array of records, one per test of the product (2 prompts + 1 gen) x 2 depths,
  // in llama-bench's order (per depth: the pp tests, then the tg tests).
  CommandResult r = run_command(bin + "-p 16,32 -n 8 -d 0,16 -r 1 -o json");
  CAPTURE(r.err);
  REQUIRE(r.exit_code == 0);
  const nlohmann::json j = nlohmann::json::parse(r.out);
  REQUIRE(j.is_array());
  REQUIRE(j.size() == 6);
  const int prompt[] = {16, 32, 0, 16, 32, 0}, gen[] = {0, 0, 8, 0, 0, 8},
            depth[] = {0, 0, 0, 16, 16, 16};
  const char* names[] = {"pp16", "pp32", "tg8", "pp16 @ d16", "pp32 @ d16", "tg8 @ d16"};
  for (size_t i = 0; i < 6; ++i) {
    CAPTURE(i);
    const auto& t = j[i];
    for (const char* k : {"model_filename", "model_type", "model_size", "model_n_params", "n_batch",
                          "n_ubatch", "n_threads", "avg_ts", "stddev_ts", "avg_ns", "samples_ts",
                          "samples_ns", "test_time", "backends", "placement"}) {
      CAPTURE(k);
      CHECK(t.contains(k));
    }
    CHECK(t["n_prompt"] == prompt[i]);
    CHECK(t["n_gen"] == gen[i]);
    CHECK(t["n_depth"] == depth[i]);
    CHECK(t["test"] == names[i]);
    CHECK(t["n_batch"] == 2048);
    CHECK(t["n_ubatch"] == 512);
    CHECK(t["n_threads"] == 2);
    CHECK(t["backends"] == "CPU");
    CHECK(t["samples_ns"].size() == 1);
    CHECK(t["samples_ts"].size() == 1);
    CHECK(t["avg_ts"].get<double>() > 0);
    CHECK(t["stddev_ts"] == 0);  // one run
    CHECK(t["model_type"].get<std::string>().rfind("llama ", 0) == 0);
  }
  // The analysis goes to standard error, standard output holds only the records.
  CHECK(r.err.find("decode reaches") != std::string::npos);

  // jsonl: the same tests, one object per line; csv: a header and a line per test.
  r = run_command(bin + "-p 16,32 -n 8 -d 0,16 -r 1 -o jsonl");
  REQUIRE(r.exit_code == 0);
  std::istringstream lines(r.out);
  int n = 0;
  for (std::string l; std::getline(lines, l); ++n)
    CHECK(nlohmann::json::parse(l)["n_depth"] == depth[n]);
  CHECK(n == 6);
  r = run_command(bin + "-p 16 -n 8 -r 2 -o csv");
  REQUIRE(r.exit_code == 0);
  CHECK(std::count(r.out.begin(), r.out.end(), '\n') == 3);
  CHECK(r.out.rfind("cpu_info,", 0) == 0);

  // md (the default): llama-bench's table, then berth's analysis of the first pp and tg tests.
  r = run_command(bin + "-p 16 -n 8 -d 0,16 -r 1");
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.rfind("| model ", 0) == 0);
  CHECK(r.out.find("| n_ubatch |") != std::string::npos);
  CHECK(r.out.find("n_batch") == std::string::npos);  // the default -b: no column
  CHECK(r.out.find(" pp16 @ d16 |") != std::string::npos);
  CHECK(r.out.find(" tg8 @ d16 |") != std::string::npos);
  CHECK(r.out.find("\ntg8 ") != std::string::npos);  // the analysis' median line
  CHECK(r.out.find("decode reaches") != std::string::npos);

  // -b and -ub: a 20-token prompt in batches of 8 cut into ubatches of 3; -pg times pp+tg.
  r = run_command(bin + "-p 20 -n 0 -b 8 -ub 3 -pg 6,2 -r 1 -o json");
  CAPTURE(r.err);
  REQUIRE(r.exit_code == 0);
  const nlohmann::json b = nlohmann::json::parse(r.out);
  REQUIRE(b.size() == 2);
  CHECK(b[0]["n_batch"] == 8);
  CHECK(b[0]["n_ubatch"] == 3);
  CHECK(b[1]["test"] == "pp6+tg2");
  CHECK(b[1]["n_prompt"] == 6);
  CHECK(b[1]["n_gen"] == 2);

  // --json FILE keeps its document (the first pp and tg tests) and adds every test's record.
  const auto dir = berth::test::temp_dir("bench_model_lists");
  const auto file = dir / "b.json";
  r = run_command(bin + "-p 16,32 -n 8 -r 1 --json " + shell_quote(file.string()));
  REQUIRE(r.exit_code == 0);
  std::ifstream in(file);
  const nlohmann::json legacy = nlohmann::json::parse(in);
  CHECK(legacy["config"]["n_prompt"] == 16);
  CHECK(legacy["config"]["n_gen"] == 8);
  CHECK(legacy["pp_tok_s"].get<double>() > 0);
  CHECK(legacy["tg_tok_s"].get<double>() > 0);
  CHECK(legacy["tests"].size() == 3);
  CHECK(r.out.rfind("| model ", 0) == 0);
}

TEST_CASE("bench model: bad llama-bench options are errors naming the flag") {
  const std::string bin = berth::test::berth_bin() + " bench model -m " +
                          shell_quote(berth::test::stories260k().string()) + " -r 1 -q ";
  struct Case {
    const char* args;
    int code;
    const char* message;
  };
  for (const Case& c : {
           Case{"-p abc", 2, "-p: 'abc' is not a whole number"},
           Case{"-n 8,,16", 2, "-n: an empty item"},
           Case{"-o xml", 2, "-o: 'xml' is not an output format"},
           Case{"-ub 0", 2, "-ub: 0 in '0' is below the minimum 1"},
           Case{"-b 0", 2, "-b: 0 in '0' is below the minimum 1"},
           Case{"-d -4", 2, "-d: -4 in '-4' is below the minimum 0"},
           Case{"-d 16-4", 2, "-d: the range '16-4' ends before it starts"},
           Case{"-pg 512", 2, "-pg: '512' is not PP,TG"},
           Case{"-o json --json -", 2, "--json - and -o json both write to standard output"},
           // stories260K's context_length is 2048.
           Case{"-p 16 -n 0 -d 2040", 1,
                "the test pp16 @ d2040 needs 2056 tokens of context (-d 2040 + -p 16), more "
                "than the model's context_length 2048"},
           Case{"-p 0 -n 0 -pg 2000,100", 1, "(-pg 2000,100)"},
           Case{"-p 0 -n 0", 1, "nothing to measure"},
       }) {
    CAPTURE(c.args);
    const CommandResult r = run_command(bin + c.args);
    CHECK(r.exit_code == c.code);
    CHECK(r.err.find(c.message) != std::string::npos);
    CHECK(r.out.empty());
  }
}
