// The split of a streamed prefill layer between the copy engine and the CPU workers.
//
// A prefill ubatch that streams a CPU-held MoE layer to the device (HybridOptions::
// stream_experts_min_tokens) reads every byte of the layer's experts over PCIe, even the experts
// its tokens do not route to, while the CPU workers idle. With the split, the device computes the
// experts the ubatch is expected to use most, copied into the stage buffer, and the CPU workers
// compute the others from host memory at the same time; the two parts add up (the device's
// first, as for expert slots). Which experts go where is chosen before the step (the copies run
// ahead of the layers that need them, so they cannot wait for the layer's routing): from each
// layer's routed calls in earlier steps (decayed), the ubatch's size and the rates below. An
// expert left to the CPU costs the CPU only when some token routes to it, so rarely used
// experts are not copied at all.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace berth {

/// The rates the split's cost model uses. 0: measured (see Scheduler).
struct StreamRates {
  double pcie_gbps = 0;   ///< host-to-device copies from page-locked memory, 1e9 bytes/s
  double dram_gbps = 0;   ///< the CPU workers reading expert weights from host memory, 1e9 bytes/s
  double cpu_gflops = 0;  ///< the CPU workers' expert GEMM throughput, 1e9 multiply-adds x 2 / s
};

/// Parses `--stream-split`: "on" (every rate measured), "off", or comma-separated
/// `pcie=G`, `dram=G`, `cpu=G` (on, those rates fixed: positive finite numbers; the others
/// measured). Sets `on`. Throws Error(invalid_argument) naming the bad item.
StreamRates parse_stream_split(std::string_view spec, bool& on);

/// One expert of a layer as the cost model sees it.
struct ExpertCost {
  double bytes = 0;            ///< its gate, up and down rows, as stored
  double flops_per_token = 0;  ///< 2 x (2 n_embd n_ff + n_ff n_embd)
};

/// Expected tokens routed to each expert of a layer in a ubatch of `n_tokens` tokens that each
/// pick `k` experts: n_tokens k (counts[e] + 0.5) / (sum of counts + 0.5 n_expert), where
/// counts are the layer's decayed routed calls of earlier steps (all zero: uniform).
std::vector<double> expected_tokens(std::span<const double> counts, int64_t n_tokens, int32_t k);

/// Which experts of one layer the CPU computes (1) and which stream to the device (0), for a
/// ubatch expected to route tokens[e] tokens to expert e. The CPU's expected time for expert e
/// is cpu_scale x ((1 - exp(-tokens[e])) bytes / dram + tokens[e] flops_per_token / cpu) (it
/// reads the expert only if a token routes to it); a streamed expert costs bytes / pcie. The
/// CPU takes the experts cheapest for it first, as many as minimise the larger of the two
/// sides' times (ties: fewer). Any rate <= 0 or not finite: every expert streams.
std::vector<uint8_t> choose_cpu_experts(std::span<const double> tokens, const ExpertCost& cost,
                                        const StreamRates& rates, double cpu_scale = 1.0);

/// The two sides' expected times, in seconds, of a choice (choose_cpu_experts's model).
struct SplitTimes {
  double cpu = 0, copy = 0;
};
SplitTimes split_times(std::span<const double> tokens, std::span<const uint8_t> on_cpu,
                       const ExpertCost& cost, const StreamRates& rates, double cpu_scale = 1.0);

/// "pcie=G,dram=G,cpu=G" with the given rates (for reports).
std::string format_stream_rates(const StreamRates& r);

}  // namespace berth
