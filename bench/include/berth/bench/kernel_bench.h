// `berth bench kernels`: how close the CPU quantized-dot kernels (cpu_kernels/quant_dot.h) get
// to the machine's memory bandwidth and arithmetic throughput.
//
// Four measurements, each the median of `repetitions` timed runs after one warm-up run (the best
// run is reported too):
//   1. DRAM read bandwidth: a streaming sum over a buffer much larger than the last-level cache,
//      split across the pool like a matmul's rows. GB/s = bytes / s / 1e9.
//   2. Decode GEMV per weight type: one activation row (n_tok = 1, quantized once with
//      cpu::quantize_activation) against a weight matrix much larger than the LLC, rows split
//      across the pool exactly as the runtime's matmul splits them (CpuExecutor::matmul,
//      runtime/src/cpu_backend.cpp: chunks of ceil(rows / (4 x threads)) rows rounded up to
//      whole kGemmRowTile tiles, each chunk one cpu::gemm_rows call, which for n_tok = 1 is one
//      cpu::dot_tile call). GB/s counts weight bytes read; the ratio is to the DRAM bandwidth
//      measured with the same thread count.
//   3. GEMM per weight type and ubatch: a [gemm_rows x gemm_cols] matrix against ubatch
//      activation rows, split the same way (each chunk one cpu::gemm_rows call, which tiles
//      the rows and tokens so a tile's weights stay in cache for every token). Reported in tokens/s
//      and GFLOP/s (2 flops per weight per token), and as a speedup over (a) the GEMV run once per
//      token on the same matrix (which may sit in the LLC: the conservative baseline) and
//      (b) the decode rate of a matrix of that size streamed from DRAM at the GEMV's measured
//      GB/s (what prefilling token by token would cost on a real model).
//   4. Single-thread GEMV GFLOP/s on a matrix that fits in L2 (at most 64 rows and 256 KiB),
//      repeated: 2 flops per weight.
//   5. Few-token GEMM per weight type and token count (several sequences decoding together with
//      routed experts: each distinct expert gets 1..8 tokens per step): expert-sized matrices
//      (few_rows x few_cols) filling about gemv_bytes, so far beyond the LLC, each expert one
//      cpu::gemm_rows call with n_tok tokens, the experts shared out over the largest pool. GB/s
//      counts weight bytes read once per run (the bound is reading each expert once from DRAM);
//      the ratio is to the same run with 1 token, and the speedup is over running the GEMV once
//      per token on the same experts (what the kernels did for 2..3 K-quant tokens before).
// Weights are real quantized data (a few rows quantized with ref::quantize_row from a seeded
// Gaussian, then repeated to fill the matrix), so no kernel meets NaNs or subnormal scales.
// Activation quantization is done before timing and not counted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "berth/core/types.h"

namespace berth::bench {

/// Sizes and lists; a zero or empty field takes the default shown (the `quick` value in
/// brackets: a smoke test in well under a second per type, numbers not meaningful).
struct KernelBenchOptions {
  /// Weight types; default: every type with a dot product (q4_0 q4_1 q5_0 q5_1 q8_0 q2_K q3_K
  /// q4_K q5_K q6_K f16 bf16 f32).
  std::vector<GgmlType> types;
  /// Thread counts; default 1, 2, 4, ... below physical_core_count(), then that count.
  std::vector<int> threads;
  bool quick = false;
  int repetitions = 0;            ///< timed runs after the warm-up; 0: 5 [2]
  size_t dram_bytes = 0;          ///< streamed buffer, bytes; 0: max(1 GiB, 8 x LLC) [32 MiB]
  size_t gemv_bytes = 0;          ///< decode GEMV weight bytes; 0: 1 GiB [16 MiB]
  int64_t gemv_cols = 0;          ///< elements per weight row (multiple of 256); 0: 4096 [4096]
  int64_t gemm_rows = 0;          ///< GEMM matrix rows; 0: 4096 [256]
  int64_t gemm_cols = 0;          ///< GEMM matrix columns (multiple of 256); 0: 4096 [256]
  std::vector<int64_t> ubatches;  ///< GEMM token counts; default 32, 128, 512
  /// Tokens run one GEMV each for the per-token baseline; 0: 32 [4].
  int64_t gemv_tokens = 0;
  /// Minimum seconds per L2 GEMV sample (calls are repeated until it is reached); 0: 0.05 [0.002].
  double l2_min_seconds = 0;
  /// Token counts of the few-token GEMM (1 is always run first: the ratios' base);
  /// default 1, 2, 3, 4, 6, 8.
  std::vector<int64_t> few_tokens;
  int64_t few_rows = 0;  ///< rows of each expert matrix of the few-token GEMM; 0: 768
  int64_t few_cols = 0;  ///< its columns (a multiple of 256); 0: 2048
  /// Called with one line of text after each measurement (progress; may be empty).
  std::function<void(std::string_view)> progress;
};

struct MachineInfo {
  std::string hostname;
  std::string cpu_model;   ///< /proc/cpuinfo "model name" (x86) or implementer/part (arm)
  int physical_cores = 0;  ///< berth::physical_core_count() (hwloc)
  int logical_cpus = 0;    ///< std::thread::hardware_concurrency()
  size_t llc_bytes = 0;    ///< last-level cache (sysfs cache/index*), 0 if unknown
  std::vector<std::string> cpu_flags;     ///< SIMD features relevant to the kernels
  std::vector<std::string> simd_targets;  ///< Highway targets this CPU supports
  std::string date_utc;                   ///< ISO 8601, when the run started
  std::string build;                      ///< "release" or "debug" (NDEBUG), plus the compiler
};

/// Median and best of the timed runs of one measurement (`unit` per second, higher is better).
struct Rate {
  double median = 0;
  double best = 0;
};

/// The median of v (the mean of the middle two for an even count); v must not be empty.
double median_of(std::vector<double> v);
/// `work` units per second at the median and at the fastest of the run times `secs` (seconds,
/// not empty).
Rate rate_of(const std::vector<double>& secs, double work);

struct DramResult {
  int n_threads = 0;
  Rate gbps;  ///< GB/s (1e9 bytes) read
};

struct GemvResult {
  GgmlType type = GgmlType::F32;
  int n_threads = 0;
  int64_t rows = 0, cols = 0;
  size_t weight_bytes = 0;
  Rate gbps;  ///< GB/s of weights read
  /// Median over the timed runs of (GEMV GB/s / DRAM GB/s), each GEMV run paired with a DRAM
  /// stream run on the same pool right before or after it (alternating).
  double ratio_to_dram = 0;
  double dram_paired_gbps = 0;      ///< median GB/s of those paired DRAM runs
  std::vector<double> pair_ratios;  ///< each pair's GEMV GB/s / DRAM GB/s, in run order
};

struct GemmResult {
  GgmlType type = GgmlType::F32;
  int n_threads = 0;
  int64_t ubatch = 0;
  int64_t rows = 0, cols = 0;
  Rate tok_s;                    ///< tokens per second
  double gflops = 0;             ///< from tok_s.median, 2 flops per weight per token
  double gemv_tok_s = 0;         ///< median tokens/s running the GEMV once per token, same matrix
  double speedup_vs_gemv = 0;    ///< tok_s.median / gemv_tok_s
  double decode_tok_s = 0;       ///< GEMV GB/s (DRAM-sized matrix) / this matrix's bytes
  double speedup_vs_decode = 0;  ///< tok_s.median / decode_tok_s (0 when no GEMV result)
  bool matches_gemv = false;     ///< GEMM outputs equal the per-token GEMV outputs bit for bit
};

struct L2Result {
  GgmlType type = GgmlType::F32;
  int64_t rows = 0, cols = 0;
  size_t weight_bytes = 0;
  Rate gflops;  ///< 2 flops per weight
};

/// One few-token GEMM measurement (measurement 5): `experts` matrices of rows x cols, every one
/// multiplied with the same n_tok activation rows per run.
struct FewTokResult {
  GgmlType type = GgmlType::F32;
  int n_threads = 0;  ///< the largest pool
  int64_t n_tok = 0;
  int64_t rows = 0, cols = 0;
  int64_t experts = 0;
  size_t weight_bytes = 0;     ///< of all the experts: read once per run
  Rate gbps;                   ///< GB/s of weights with one cpu::gemm_rows call per expert
  double ratio_to_one = 0;     ///< gbps.median / the 1-token run's gbps.median
  double gemv_gbps = 0;        ///< median GB/s running the GEMV once per token instead
  double speedup_vs_gemv = 0;  ///< gbps.median / gemv_gbps
  bool matches_gemv = false;   ///< gemm_rows' outputs equal the per-token GEMV's bit for bit
};

/// Latency of a parallel region of the worker pool after the calling thread was busy elsewhere
/// for `idle_us` (as during the device's part of a hybrid step): from the call until every
/// worker has joined, median and 90th percentile over the runs, in microseconds. A worker that
/// has gone to sleep adds its wake-up time.
struct WakeResult {
  int n_threads = 0;
  int idle_us = 0;
  double median_us = 0, p90_us = 0;
};

struct KernelBenchResult {
  MachineInfo machine;
  KernelBenchOptions options;  ///< with every default filled in (progress cleared)
  std::string statistic;  ///< how each number was taken, e.g. "median of 5 runs after 1 warm-up"
  std::vector<DramResult> dram;
  std::vector<GemvResult> gemv;
  std::vector<GemmResult> gemm;
  std::vector<L2Result> l2;
  std::vector<FewTokResult> few;  ///< per type, the token counts in order (1 first)
  std::vector<WakeResult> wake;   ///< the largest pool, idle 0, 50, 100, 200, 500, 1000 us
};

/// Parses a comma-separated list of weight types ("q4_K,q8_0"). Throws Error(invalid_argument)
/// naming an unknown name, and Error(unsupported) for a type without a dot product.
std::vector<GgmlType> parse_type_list(std::string_view list);

/// Parses a comma-separated list of thread counts ("1,2,4"); throws Error(invalid_argument) for
/// anything but integers >= 1.
std::vector<int> parse_thread_list(std::string_view list);

/// Runs every measurement (module comment). Memory: the DRAM buffer, then one GEMV matrix at a
/// time (about max(dram_bytes, gemv_bytes) plus the GEMM matrix). Throws Error(invalid_argument)
/// for a column count that is not a multiple of 256, a non-positive size or token count,
/// Error(unsupported) for a type without a dot product, Error(out_of_memory) when a buffer cannot
/// be allocated.
KernelBenchResult run_kernel_bench(const KernelBenchOptions& options);

/// The machine the benchmark runs on (CPU model, cores, LLC, SIMD targets, date, build).
MachineInfo machine_info();

/// DRAM read bandwidth with `n_threads` pinned workers: measurement 1 of the module comment on
/// a buffer of `bytes` (at least 64 KiB; use >> LLC), median and best of `repetitions` runs.
/// Throws Error(out_of_memory) when the buffer cannot be allocated.
DramResult measure_dram_bandwidth(int n_threads, size_t bytes, int repetitions);

/// Every number of `r`, with the machine, the date and the options (schema in kernel_bench.cpp).
nlohmann::json to_json(const KernelBenchResult& r);

/// The machine as a JSON object (hostname, cpu_model, cores, llc_bytes, cpu_flags, simd_targets,
/// date_utc, build): the "machine" entry of every benchmark's JSON.
nlohmann::json to_json(const MachineInfo& m);

/// Aligned text tables of `r` for a terminal.
std::string format_text(const KernelBenchResult& r);

}  // namespace berth::bench
