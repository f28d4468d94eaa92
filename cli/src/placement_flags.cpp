#include "placement_flags.h"

#include <fmt/format.h>

#include <limits>
#include <string>

#include "berth/core/error.h"
#include "berth/runtime/placed.h"
#include "berth/scheduler/stream_split.h"
#include "validators.h"

namespace berth::cli {

void add_placement_flags(CLI::App& cmd, placement::Flags& f) {
  cmd.add_option("--n-gpu-layers,--gpu-layers", f.n_gpu_layers,
                 "-ngl: the last N layers on the GPU (more than the model has, e.g. 99: all, "
                 "with the output layer); -1: the automatic plan")
      ->capture_default_str()
      ->check(range(-1, std::numeric_limits<int32_t>::max()));
  cmd.add_option_function<std::vector<std::string>>(
         "--override-tensor",
         [&f](const std::vector<std::string>& rules) {
           for (const std::string& r : rules) placement::add_override(f, r);  // checked below
         },
         "-ot REGEX=DEVICE[,...]: tensors whose name matches REGEX on DEVICE (CPU, GPU or "
         "CUDA0); repeatable, the first matching rule wins")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->allow_extra_args(false)
      ->check(CLI::Validator(
          [](std::string& arg) -> std::string {
            try {
              placement::Flags scratch;
              placement::add_override(scratch, arg);
              return {};
            } catch (const Error& e) {
              // CLI11 puts the flag's name in front already.
              std::string m = e.what();
              const std::string flag = "--vram-budget ";
              return m.rfind(flag, 0) == 0 ? m.substr(flag.size()) : m;
            }
          },
          "REGEX=DEVICE"));
  cmd.add_option_function<std::string>(
         "--residency",
         [&f](const std::string& s) { f.residency = placement::parse_residency_mode(s); },
         "static: weights stay where the plan puts them; adaptive: CPU-held MoE layers get "
         "expert slots on the GPU (the budget's room left after the plan) that the most used "
         "experts move into while decoding; auto (the default): adaptive when the budget "
         "cannot hold every weight")
      ->check(CLI::IsMember({"auto", "static", "adaptive"}));
  cmd.add_option_function<std::string>(
         "--unified", [&f](const std::string& s) { f.unified = placement::parse_unified_mode(s); },
         "unified memory (GB10, Jetson Orin): on: the GPU reads the weights it computes in place "
         "from host memory, each weight held once in one pool (the OS's available memory minus "
         "1 GiB) that --vram-budget and --ram-budget both draw on; off: copy weights to the GPU; "
         "auto (the default): on when the GPU is integrated")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  cmd.add_flag("--cpu-moe", f.cpu_moe, "-cmoe: every layer's routed experts on the CPU");
  cmd.add_option("--n-cpu-moe", f.n_cpu_moe,
                 "-ncmoe: the routed experts of the first N layers on the CPU")
      ->capture_default_str()
      ->check(range(0, std::numeric_limits<int32_t>::max()));
  cmd.add_option_function<std::string>(
         "--vram-budget",
         [&f](const std::string& s) { f.vram_budget = placement::parse_size(s, "--vram-budget"); },
         "plan as if the GPU had only SIZE free (24G, 1.5GiB, 512M, bytes); without a GPU, plan "
         "for one of that size")
      ->check(CLI::Validator(
          [](std::string& s) -> std::string {
            try {
              (void)placement::parse_size(s, "--vram-budget");
              return {};
            } catch (const Error& e) {
              // CLI11 puts the flag's name in front already.
              std::string m = e.what();
              const std::string flag = "--vram-budget ";
              return m.rfind(flag, 0) == 0 ? m.substr(flag.size()) : m;
            }
          },
          "SIZE"));
  cmd.add_option_function<std::string>(
         "--ram-budget",
         [&f](const std::string& s) {
           f.ram_budget = s == "none" || s == "0" ? placement::kNoRamBudget
                                                  : placement::parse_size(s, "--ram-budget");
         },
         "host memory for CPU-held weights, their KV cache and the RAM cache of disk-held "
         "experts (24G, 1.5GiB, 512M, bytes; none or 0: no limit); routed experts beyond it "
         "stay on disk and are read on demand (O_DIRECT); default: MemAvailable minus 1 GiB")
      ->check(CLI::Validator(
          [](std::string& s) -> std::string {
            if (s == "none" || s == "0") return {};
            try {
              (void)placement::parse_size(s, "--ram-budget");
              return {};
            } catch (const Error& e) {
              std::string m = e.what();
              const std::string flag = "--ram-budget ";
              return m.rfind(flag, 0) == 0 ? m.substr(flag.size()) : m;
            }
          },
          "SIZE"));
}

void add_residency_swaps(CLI::App& cmd, int32_t& swaps) {
  cmd.add_option("--residency-swaps", swaps,
                 "--residency adaptive: experts swapped into each MoE layer's expert slots per "
                 "step, at most (copies overlap the next steps; an expert computes on the CPU "
                 "until its copy has landed)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 16));
}

void add_residency_policy(CLI::App& cmd, std::string& policy) {
  cmd.add_option("--residency-policy", policy,
                 "--residency adaptive: which experts the slots hold: lfu-decay (the default; "
                 "half-life 64 tokens, margin 3), lfu-decay:H[:Z], lru, or frequency:TRACE (the "
                 "experts a calibration routing trace called most, fixed)");
}

CLI::Validator unit_fraction() {
  return CLI::Validator(
      [](std::string& in) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(in, v) || !(v >= 0.0 && v <= 1.0))
          return "'" + in + "' is not a number in [0, 1]";
        return {};
      },
      "FLOAT in [0 - 1]");
}

void add_host_expert_share(CLI::App& cmd, double& share) {
  cmd.add_option("--host-expert-share", share,
                 "decode: the GPU computes this fraction of each token's routed experts (the "
                 "last round(F * n_expert_used) slots of its top-k, alternating between the two "
                 "nearest counts over the layers) in every CPU-held MoE layer, copying their "
                 "weights over PCIe from pinned host memory, while the CPU computes the other "
                 "slots (0: off)")
      ->check(unit_fraction());
}

void add_warm_workers(CLI::App& cmd, int64_t& us) {
  cmd.add_option("--warm-workers", us,
                 "flag hand-off: the CPU workers spin with the calling thread for up to US "
                 "microseconds while it waits for the GPU, instead of sleeping (0: off; default: "
                 "1000 in decode steps replayed on a CUDA device, off otherwise)")
      ->check(range(int64_t{0}, int64_t{1000000}));
}

void add_stream_experts(CLI::App& cmd, int32_t& min_tokens) {
  cmd.add_option("--stream-experts", min_tokens,
                 fmt::format("prefill ubatches of at least N tokens compute CPU-held experts on "
                             "the GPU, streaming their weights over PCIe from page-locked host "
                             "memory (0: off; auto, the default: from {} tokens when host memory "
                             "has room to lock them)",
                             kStreamExpertsAutoTokens))
      ->transform(CLI::Validator(
          [](std::string& in) -> std::string {
            if (in == "auto") {
              in = std::to_string(kStreamExpertsAuto);
              return {};
            }
            int64_t v = 0;
            if (!CLI::detail::lexical_cast(in, v) || v < 0 || v > (1 << 20))
              return "'" + in + "' is not auto or a number of tokens in [0, 1048576]";
            return {};
          },
          "auto|N"));
}

void add_stream_split(CLI::App& cmd, std::string& spec) {
  cmd.add_option("--stream-split", spec,
                 "prefill steps that stream CPU-held experts: split each layer between the copy "
                 "to the GPU (the experts the ubatch is expected to use most) and the CPU workers "
                 "(the others, at the same time), by a cost model of measured rates: off (the "
                 "default: copy whole layers), on, or on with fixed rates "
                 "pcie=GBPS,dram=GBPS,cpu=GFLOPS (any of them; the rest measured)")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& in) -> std::string {
            try {
              bool on = false;
              (void)parse_stream_split(in, on);
            } catch (const Error& e) {
              std::string m = e.what();  // CLI11 names the option itself
              constexpr std::string_view kOpt = "--stream-split ";
              if (m.rfind(kOpt, 0) == 0) m.erase(0, kOpt.size());
              return m;
            }
            return {};
          },
          "off|on|RATES"));
}

void add_handoff(CLI::App& cmd, std::string& handoff) {
  cmd.add_option("--handoff", handoff,
                 "how CPU segments hand over with the device: auto (the default: flags where the "
                 "device has them), flags (pinned-memory flags polled by the calling thread) or "
                 "callback (host callbacks)")
      ->check(CLI::IsMember({"auto", "flags", "callback"}));
}

Handoff parse_handoff(const std::string& s) {
  if (s == "auto") return Handoff::automatic;
  if (s == "flags") return Handoff::flags;
  if (s == "callback") return Handoff::callback;
  throw Error(ErrorCategory::invalid_argument,
              fmt::format("--handoff must be auto, flags or callback, got '{}'", s));
}

}  // namespace berth::cli
