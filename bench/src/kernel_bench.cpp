// `berth bench kernels` (see kernel_bench.h for what is measured and how).
//
// JSON schema (to_json):
//   { "benchmark": "berth bench kernels", "date": ISO 8601 UTC,
//     "machine": {hostname, cpu_model, physical_cores, logical_cpus, llc_bytes, cpu_flags[],
//                 simd_targets[], build},
//     "timing": {statistic, warmup_runs, repetitions},
//     "config": {types[], threads[] (asked), threads_run[] (pools made), quick, dram_bytes,
//                gemv_bytes, gemv_cols, gemm_rows,
//                gemm_cols, ubatches[], gemv_tokens, gemm_row_tile, gemm_tok_tile, l2_min_seconds,
//                few_tokens[], few_rows, few_cols},
//     "dram":  [{threads, gbps, gbps_best}],
//     "wake":  [{threads, idle_us, median_us, p90_us}],
//     "gemv":  [{type, threads, rows, cols, weight_bytes, gbps, gbps_best, ratio_to_dram,
//                dram_paired_gbps, pair_ratios}],
//     "gemm":  [{type, threads, ubatch, rows, cols, tok_s, tok_s_best, gflops, gemv_tok_s,
//                speedup_vs_gemv, decode_tok_s, speedup_vs_decode, matches_gemv}],
//     "l2_gemv": [{type, threads: 1, rows, cols, weight_bytes, gflops, gflops_best}],
//     "few_tok": [{type, threads, n_tok, rows, cols, experts, weight_bytes, gbps, gbps_best,
//                  ratio_to_one, gemv_gbps, speedup_vs_gemv, matches_gemv}] }
// Rates: GB/s are 1e9 bytes per second; GFLOP/s count 2 flops per weight per token.
#include "berth/bench/kernel_bench.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <hwy/targets.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "berth/backends/thread_pool.h"
#include "berth/core/error.h"
#include "berth/core/log.h"
#include "berth/cpu_kernels/quant_dot.h"
#include "berth/cpu_kernels/quants_ref.h"

namespace berth::bench {
namespace {

constexpr size_t kKiB = 1024, kMiB = 1024 * kKiB, kGiB = 1024 * kMiB;

// ---------------------------------------------------------------------------------------------
// Buffers and timing
// ---------------------------------------------------------------------------------------------

// A 64-byte aligned heap buffer (cache-line aligned rows for the kernels and the stream sum).
class Buffer {
 public:
  explicit Buffer(size_t bytes, std::string_view what) : bytes_(bytes) {
    const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
    p_ = static_cast<uint8_t*>(std::aligned_alloc(64, rounded));
    if (!p_)
      throw Error(ErrorCategory::out_of_memory,
                  fmt::format("cannot allocate {:.1f} MiB for the {}",
                              static_cast<double>(bytes) / kMiB, what));
  }
  ~Buffer() { std::free(p_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  uint8_t* data() const { return p_; }
  size_t size() const { return bytes_; }

 private:
  uint8_t* p_ = nullptr;
  size_t bytes_;
};

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Runs f once (warm-up), then `reps` timed runs; returns their durations in seconds.
template <class F>
std::vector<double> time_runs(int reps, F&& f) {
  f();
  std::vector<double> s;
  s.reserve(static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    const double t0 = now_seconds();
    f();
    s.push_back(now_seconds() - t0);
  }
  return s;
}

// The runtime's row split (CpuExecutor::matmul, runtime/src/cpu_backend.cpp): about 4 chunks per
// thread, each a whole number of kGemmRowTile-row tiles.
int64_t runtime_grain(int64_t n_rows, int n_threads) {
  const int64_t parts = static_cast<int64_t>(n_threads) * 4;
  int64_t grain = (n_rows + parts - 1) / parts;
  grain = (grain + cpu::kGemmRowTile - 1) / cpu::kGemmRowTile * cpu::kGemmRowTile;
  return std::max<int64_t>(cpu::kGemmRowTile, grain);
}

// out [n_tok, n_rows] = W [n_rows, n] x act [n_tok] rows, split across the pool as the runtime
// does.
void pool_matmul(ThreadPool& pool, GgmlType t, const uint8_t* w, int64_t n_rows, int64_t n,
                 const uint8_t* act, size_t act_stride, int64_t n_tok, float* out) {
  const size_t rb = row_bytes(t, n);
  pool.parallel_for(n_rows, runtime_grain(n_rows, pool.n_threads()), [&](int64_t r0, int64_t r1) {
    cpu::gemm_rows(t, w + static_cast<size_t>(r0) * rb, r1 - r0, act, act_stride, n_tok, n,
                   out + r0, n_rows);
  });
}

// Sum of the 64-bit words of [p, p + bytes) (bytes a multiple of 64), four independent 128-bit
// accumulators so the loop is bound by loads, not by the adds.
uint64_t stream_sum(const uint8_t* p, size_t bytes) {
  using V = uint64_t __attribute__((vector_size(16)));
  V a0{0, 0}, a1{0, 0}, a2{0, 0}, a3{0, 0};
  for (size_t i = 0; i < bytes; i += 64) {
    V x0, x1, x2, x3;
    std::memcpy(&x0, p + i, 16);
    std::memcpy(&x1, p + i + 16, 16);
    std::memcpy(&x2, p + i + 32, 16);
    std::memcpy(&x3, p + i + 48, 16);
    a0 += x0;
    a1 += x1;
    a2 += x2;
    a3 += x3;
  }
  const V s = (a0 + a1) + (a2 + a3);
  return s[0] + s[1];
}

// Fills `rows` weight rows of n elements of type t at dst with real quantized data: 64 distinct
// rows quantized from a seeded Gaussian with the reference quantizer, repeated (so every scale
// is a normal number and no kernel meets NaN or subnormal values). Pages are first touched by
// the pool's threads.
void fill_weights(ThreadPool& pool, GgmlType t, int64_t n, int64_t rows, uint8_t* dst) {
  const size_t rb = row_bytes(t, n);
  const int64_t n_distinct = std::min<int64_t>(rows, 64);
  std::vector<uint8_t> pattern(static_cast<size_t>(n_distinct) * rb);
  std::mt19937 rng(1234u + static_cast<uint32_t>(t));
  std::normal_distribution<float> gauss(0.0f, 0.02f);
  std::vector<float> f(static_cast<size_t>(n));
  for (int64_t r = 0; r < n_distinct; ++r) {
    for (float& x : f) x = gauss(rng);
    ref::quantize_row(t, f.data(), pattern.data() + static_cast<size_t>(r) * rb, n);
  }
  pool.parallel_for(rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      std::memcpy(dst + static_cast<size_t>(r) * rb,
                  pattern.data() + static_cast<size_t>(r % n_distinct) * rb, rb);
  });
}

// n_tok activation rows (seeded Gaussian) quantized for weights of type t; returns the row stride.
size_t fill_activations(GgmlType t, int64_t n, int64_t n_tok, std::vector<uint8_t>& act) {
  const size_t arb = cpu::activation_row_bytes(t, n);
  act.assign(arb * static_cast<size_t>(n_tok), 0);
  std::mt19937 rng(99);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t k = 0; k < n_tok; ++k) {
    for (float& v : x) v = gauss(rng);
    cpu::quantize_activation(t, x.data(), act.data() + static_cast<size_t>(k) * arb, n);
  }
  return arb;
}

// ---------------------------------------------------------------------------------------------
// Machine description
// ---------------------------------------------------------------------------------------------

std::string trim(std::string s) {
  const auto b = s.find_first_not_of(" \t");
  const auto e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

// The value of the first "key : value" line of /proc/cpuinfo with this key, or "".
std::string cpuinfo_field(const std::string& key) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    if (trim(line.substr(0, colon)) == key) return trim(line.substr(colon + 1));
  }
  return {};
}

size_t parse_cache_size(std::string s) {
  s = trim(s);
  if (s.empty()) return 0;
  size_t mult = 1;
  const char u = s.back();
  if (u == 'K' || u == 'k') mult = kKiB;
  if (u == 'M' || u == 'm') mult = kMiB;
  if (u == 'G' || u == 'g') mult = kGiB;
  return static_cast<size_t>(std::strtoull(s.c_str(), nullptr, 10)) * mult;
}

// Size of the highest-level cache of cpu0 from sysfs, 0 if unknown.
size_t llc_bytes() {
  size_t best = 0;
  int best_level = 0;
  for (int i = 0; i < 16; ++i) {
    const std::string dir = fmt::format("/sys/devices/system/cpu/cpu0/cache/index{}/", i);
    std::ifstream lv(dir + "level"), sz(dir + "size");
    if (!lv || !sz) continue;
    int level = 0;
    std::string size;
    lv >> level;
    sz >> size;
    const size_t bytes = parse_cache_size(size);
    if (level > best_level || (level == best_level && bytes > best)) {
      best_level = level;
      best = bytes;
    }
  }
  return best;
}

MachineInfo describe_machine() {
  MachineInfo m;
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) == 0) m.hostname = host;
  m.cpu_model = cpuinfo_field("model name");
  if (m.cpu_model.empty()) {
    const std::string impl = cpuinfo_field("CPU implementer"), part = cpuinfo_field("CPU part");
    if (!impl.empty()) m.cpu_model = fmt::format("arm implementer {} part {}", impl, part);
  }
  if (m.cpu_model.empty()) m.cpu_model = "unknown";
  m.physical_cores = physical_core_count();
  m.logical_cpus = static_cast<int>(std::thread::hardware_concurrency());
  m.llc_bytes = llc_bytes();

  static const std::set<std::string> relevant = {
      "avx2",        "fma",         "f16c",        "avx512f",  "avx512bw", "avx512vl",
      "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8",
      "amx_bf16",    "asimd",       "asimddp",     "asimdhp",  "sve",      "sve2",
      "i8mm",        "bf16",        "svei8mm",     "svebf16"};
  std::string flags = cpuinfo_field("flags");
  if (flags.empty()) flags = cpuinfo_field("Features");
  std::istringstream fs(flags);
  std::set<std::string> have;
  for (std::string f; fs >> f;)
    if (relevant.count(f)) have.insert(f);
  m.cpu_flags.assign(have.begin(), have.end());
  // Targets this CPU supports among those compiled into the kernels (HWY_TARGETS comes from
  // berth_cpu_kernels' public compile definitions); the first is the one dispatch picks.
  for (int64_t bits = hwy::SupportedTargets() & HWY_TARGETS; bits != 0; bits &= bits - 1)
    m.simd_targets.emplace_back(hwy::TargetName(bits & -bits));

  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", &tm);
  m.date_utc = date;
#ifdef NDEBUG
  m.build = "release";
#else
  m.build = "debug";
#endif
#if defined(__clang__)
  m.build += fmt::format(", clang {}.{}", __clang_major__, __clang_minor__);
#elif defined(__GNUC__)
  m.build += fmt::format(", gcc {}.{}", __GNUC__, __GNUC_MINOR__);
#endif
  return m;
}

std::vector<int> default_threads(int cores) {
  std::vector<int> t;
  for (int n = 1; n < cores; n *= 2) t.push_back(n);
  t.push_back(std::max(cores, 1));
  return t;
}

std::vector<GgmlType> all_dot_types() {
  return {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0,
          GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K,
          GgmlType::F16,  GgmlType::BF16, GgmlType::F32};
}

// Fills every default of `o` (see KernelBenchOptions) and validates it.
KernelBenchOptions resolve(const KernelBenchOptions& in, const MachineInfo& m) {
  KernelBenchOptions o = in;
  o.progress = nullptr;
  const bool q = o.quick;
  if (o.types.empty()) o.types = all_dot_types();
  if (o.threads.empty()) o.threads = default_threads(m.physical_cores);
  if (o.repetitions <= 0) o.repetitions = q ? 2 : 5;
  if (o.dram_bytes == 0) o.dram_bytes = q ? 32 * kMiB : std::max<size_t>(kGiB, 8 * m.llc_bytes);
  if (o.gemv_bytes == 0) o.gemv_bytes = q ? 16 * kMiB : kGiB;
  if (o.gemv_cols == 0) o.gemv_cols = 4096;
  if (o.gemm_rows == 0) o.gemm_rows = q ? 256 : 4096;
  if (o.gemm_cols == 0) o.gemm_cols = q ? 256 : 4096;
  if (o.ubatches.empty()) o.ubatches = {32, 128, 512};
  if (o.gemv_tokens <= 0) o.gemv_tokens = q ? 4 : 32;
  if (o.l2_min_seconds <= 0) o.l2_min_seconds = q ? 0.002 : 0.05;
  if (o.few_tokens.empty()) o.few_tokens = {1, 2, 3, 4, 6, 8};
  if (o.few_rows == 0) o.few_rows = 768;
  if (o.few_cols == 0) o.few_cols = 2048;

  // Buffers that fit in the last-level cache measure the cache, not DRAM: said, not refused.
  if (!q && m.llc_bytes > 0)
    for (auto [name, bytes] :
         {std::pair<const char*, size_t>{"--dram-mib", o.dram_bytes}, {"--gemv-mib", o.gemv_bytes}})
      if (bytes < 2 * m.llc_bytes)
        log::warn(
            "bench: {} {} is less than twice the last-level cache ({} MiB): the figures "
            "may come from the cache, not DRAM",
            name, bytes / kMiB, m.llc_bytes / kMiB);
  for (GgmlType t : o.types) (void)cpu::activation_type(t);  // throws unsupported
  for (int t : o.threads)
    if (t < 1)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("bench: thread counts must be >= 1, got {}", t));
  for (int64_t u : o.ubatches)
    if (u < 1)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("bench: ubatch sizes must be >= 1, got {}", u));
  for (int64_t k : o.few_tokens)
    if (k < 1 || k > 4096)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("bench: few-token counts must be in 1..4096, got {}", k));
  // 1 first (the ratios' base), then the others in the order given, once each.
  {
    std::vector<int64_t> toks = {1};
    for (int64_t k : o.few_tokens)
      if (std::find(toks.begin(), toks.end(), k) == toks.end()) toks.push_back(k);
    o.few_tokens = std::move(toks);
  }
  if (o.few_rows <= 0)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("bench: few_rows must be positive, got {}", o.few_rows));
  for (auto [name, cols] : {std::pair<const char*, int64_t>{"gemv_cols", o.gemv_cols},
                            {"gemm_cols", o.gemm_cols},
                            {"few_cols", o.few_cols}})
    if (cols <= 0 || cols % kQK_K != 0)
      throw Error(
          ErrorCategory::invalid_argument,
          fmt::format("bench: {} must be a positive multiple of {}, got {}", name, kQK_K, cols));
  if (o.gemm_rows <= 0 || o.dram_bytes < 64 * kKiB || o.gemv_bytes == 0)
    throw Error(ErrorCategory::invalid_argument,
                "bench: gemm_rows, dram_bytes (>= 64 KiB) and gemv_bytes must be positive");
  return o;
}

// ---------------------------------------------------------------------------------------------
// The measurements
// ---------------------------------------------------------------------------------------------

// The DRAM read-bandwidth probe: a streaming sum over a buffer of about o.dram_bytes, split into
// 4 KiB rows over a pool as the runtime splits a matmul.
class DramStream {
 public:
  DramStream(const KernelBenchOptions& o, ThreadPool& fill_pool)
      : n_rows_(static_cast<int64_t>(o.dram_bytes / kRow)),
        buf_(static_cast<size_t>(n_rows_) * kRow, "DRAM bandwidth buffer") {
    fill_pool.parallel_for(n_rows_, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)  // non-zero, so no page is the shared zero page
        std::memset(buf_.data() + static_cast<size_t>(r) * kRow, static_cast<int>(r % 251) + 1,
                    kRow);
    });
  }
  ~DramStream() {
    if (sink_.load() == 42) std::fputs("", stderr);  // keeps the sums observable
  }
  size_t bytes() const { return buf_.size(); }
  void run(ThreadPool& pool) {
    pool.parallel_for(n_rows_, runtime_grain(n_rows_, pool.n_threads()),
                      [&](int64_t r0, int64_t r1) {
                        sink_.fetch_add(stream_sum(buf_.data() + static_cast<size_t>(r0) * kRow,
                                                   static_cast<size_t>(r1 - r0) * kRow),
                                        std::memory_order_relaxed);
                      });
  }

 private:
  static constexpr size_t kRow = 4 * kKiB;  // split unit, about one weight row
  int64_t n_rows_;
  Buffer buf_;
  std::atomic<uint64_t> sink_{0};
};

std::vector<DramResult> measure_dram(const KernelBenchOptions& o,
                                     std::vector<std::unique_ptr<ThreadPool>>& pools,
                                     DramStream& stream) {
  std::vector<DramResult> out;
  for (auto& pool : pools) {
    DramResult r;
    r.n_threads = pool->n_threads();
    r.gbps = rate_of(time_runs(o.repetitions, [&] { stream.run(*pool); }),
                     static_cast<double>(stream.bytes()) / 1e9);
    out.push_back(r);
    if (o.progress)
      o.progress(fmt::format("dram   threads {:>3}  {:8.2f} GB/s", r.n_threads, r.gbps.median));
  }
  return out;
}

// Few-token GEMM (measurement 5 of kernel_bench.h) on the largest pool: expert matrices of
// few_rows x few_cols filling about gemv_bytes, each one task (one cpu::gemm_rows call with all
// its rows and n_tok tokens), against one GEMV per token on the same experts.
void measure_few(const KernelBenchOptions& o, GgmlType t, ThreadPool& pool,
                 KernelBenchResult& res) {
  const std::string tn(type_name(t));
  const int64_t rows = o.few_rows, n = o.few_cols;
  const size_t rb = row_bytes(t, n), eb = rb * static_cast<size_t>(rows);
  const int64_t experts = std::max<int64_t>(static_cast<int64_t>(o.gemv_bytes / eb),
                                            2 * static_cast<int64_t>(pool.n_threads()));
  Buffer w(static_cast<size_t>(experts) * eb, fmt::format("{} few-token experts", tn));
  fill_weights(pool, t, n, experts * rows, w.data());
  const int64_t max_tok = *std::max_element(o.few_tokens.begin(), o.few_tokens.end());
  std::vector<uint8_t> act;
  const size_t arb = fill_activations(t, n, max_tok, act);
  // Each task writes its expert's outputs into its own slot of a per-thread sized buffer:
  // out[(e % slots) * max_tok * rows ...]; slots >= threads, so no two running tasks share one.
  const int64_t slots = 2 * static_cast<int64_t>(pool.n_threads());
  std::vector<float> y(static_cast<size_t>(slots * max_tok * rows));
  auto run = [&](int64_t n_tok, bool per_token) {
    pool.parallel_for(experts, 1, [&](int64_t e0, int64_t e1) {
      for (int64_t e = e0; e < e1; ++e) {
        const uint8_t* we = w.data() + static_cast<size_t>(e) * eb;
        float* out = y.data() + (e % slots) * max_tok * rows;
        if (!per_token) {
          cpu::gemm_rows(t, we, rows, act.data(), arb, n_tok, n, out, rows);
        } else {
          for (int64_t k = 0; k < n_tok; ++k)
            cpu::gemm_rows(t, we, rows, act.data() + static_cast<size_t>(k) * arb, arb, 1, n,
                           out + k * rows, rows);
        }
      }
    });
  };
  double one_gbps = 0;
  for (const int64_t n_tok : o.few_tokens) {
    FewTokResult f;
    f.type = t;
    f.n_threads = pool.n_threads();
    f.n_tok = n_tok;
    f.rows = rows;
    f.cols = n;
    f.experts = experts;
    f.weight_bytes = w.size();
    const double gb = static_cast<double>(w.size()) / 1e9;
    // The two variants alternate run by run, so a drift of the host's rate hits both alike.
    std::vector<double> gemm_s, gemv_s;
    run(n_tok, false);  // warm-up
    run(n_tok, true);
    for (int i = 0; i < o.repetitions; ++i)
      for (const bool per_token : {i % 2 == 1, i % 2 == 0}) {
        const double t0 = now_seconds();
        run(n_tok, per_token);
        (per_token ? gemv_s : gemm_s).push_back(now_seconds() - t0);
      }
    f.gbps = rate_of(gemm_s, gb);
    f.gemv_gbps = rate_of(gemv_s, gb).median;
    f.speedup_vs_gemv = f.gemv_gbps > 0 ? f.gbps.median / f.gemv_gbps : 0;
    if (n_tok == 1) one_gbps = f.gbps.median;
    f.ratio_to_one = one_gbps > 0 ? f.gbps.median / one_gbps : 0;
    // Bits: expert 0 through gemm_rows and through one GEMV per token.
    {
      std::vector<float> a(static_cast<size_t>(n_tok * rows)), b(a.size());
      cpu::gemm_rows(t, w.data(), rows, act.data(), arb, n_tok, n, a.data(), rows);
      for (int64_t k = 0; k < n_tok; ++k)
        cpu::gemm_rows(t, w.data(), rows, act.data() + static_cast<size_t>(k) * arb, arb, 1, n,
                       b.data() + k * rows, rows);
      f.matches_gemv = std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
    }
    res.few.push_back(f);
    if (o.progress)
      o.progress(fmt::format(
          "few    {:<5} threads {:>3}  tokens {:>3}  {:8.2f} GB/s  x{:.2f} of 1 token  x{:.2f} vs "
          "GEMV/token{}",
          tn, f.n_threads, n_tok, f.gbps.median, f.ratio_to_one, f.speedup_vs_gemv,
          f.matches_gemv ? "" : "  OUTPUTS DIFFER"));
  }
}

void measure_type(const KernelBenchOptions& o, GgmlType t,
                  std::vector<std::unique_ptr<ThreadPool>>& pools, ThreadPool& fill_pool,
                  DramStream& dram_stream, KernelBenchResult& res) {
  const std::string tn(type_name(t));
  const auto say = [&](const std::string& s) {
    if (o.progress) o.progress(s);
  };
  // Decode GEMV over a DRAM-sized matrix.
  std::vector<double> gemv_gbps_by_pool(pools.size(), 0.0);
  {
    const int64_t n = o.gemv_cols;
    const size_t rb = row_bytes(t, n);
    int64_t rows = static_cast<int64_t>(o.gemv_bytes / rb) / cpu::kGemmRowTile * cpu::kGemmRowTile;
    rows = std::max<int64_t>(rows, cpu::kGemmRowTile);
    Buffer w(static_cast<size_t>(rows) * rb, fmt::format("{} GEMV weights", tn));
    fill_weights(fill_pool, t, n, rows, w.data());
    std::vector<uint8_t> act;
    const size_t arb = fill_activations(t, n, 1, act);
    std::vector<float> y(static_cast<size_t>(rows));
    for (size_t p = 0; p < pools.size(); ++p) {
      ThreadPool& pool = *pools[p];
      GemvResult g;
      g.type = t;
      g.n_threads = pool.n_threads();
      g.rows = rows;
      g.cols = n;
      g.weight_bytes = w.size();
      // Each timed GEMV run is paired with a DRAM stream run on the same pool right before or
      // after it (alternating), and the ratio is the median of the pairs' ratios: a shared
      // host's DRAM rate drifts over the minutes between the DRAM table and this line
      // (26-55 GB/s for 2 threads on the Zen 4 VM).
      std::vector<double> gemv_s, dram_s, ratios;
      const auto gemv = [&] {
        pool_matmul(pool, t, w.data(), rows, n, act.data(), arb, 1, y.data());
      };
      const auto stream = [&] { dram_stream.run(pool); };
      const auto timed = [&](auto&& f, std::vector<double>& into) {
        const double t0 = now_seconds();
        f();
        into.push_back(now_seconds() - t0);
      };
      gemv();  // warm-up
      for (int i = 0; i < o.repetitions; ++i) {
        // Alternating which of the two goes first, so neither always follows the other.
        if (i % 2 == 0) {
          timed(stream, dram_s);
          timed(gemv, gemv_s);
        } else {
          timed(gemv, gemv_s);
          timed(stream, dram_s);
        }
        ratios.push_back((static_cast<double>(w.size()) / gemv_s.back()) /
                         (static_cast<double>(dram_stream.bytes()) / dram_s.back()));
      }
      g.gbps = rate_of(gemv_s, static_cast<double>(w.size()) / 1e9);
      g.dram_paired_gbps = rate_of(dram_s, static_cast<double>(dram_stream.bytes()) / 1e9).median;
      g.ratio_to_dram = median_of(ratios);
      g.pair_ratios = std::move(ratios);  // in run order
      gemv_gbps_by_pool[p] = g.gbps.median;
      res.gemv.push_back(g);
      say(fmt::format("gemv   {:<5} threads {:>3}  {:8.2f} GB/s  {:5.1f}% of DRAM", tn, g.n_threads,
                      g.gbps.median, 100 * g.ratio_to_dram));
    }
  }

  // GEMM on a cache-friendly matrix, against the GEMV once per token.
  {
    const int64_t rows = o.gemm_rows, n = o.gemm_cols;
    const size_t rb = row_bytes(t, n);
    Buffer w(static_cast<size_t>(rows) * rb, fmt::format("{} GEMM weights", tn));
    fill_weights(fill_pool, t, n, rows, w.data());
    const int64_t max_u = *std::max_element(o.ubatches.begin(), o.ubatches.end());
    const int64_t n_act = std::max(max_u, o.gemv_tokens);
    std::vector<uint8_t> act;
    const size_t arb = fill_activations(t, n, n_act, act);
    std::vector<float> y(static_cast<size_t>(n_act * rows)), y_tok(y.size());
    const double flops_per_tok = 2.0 * static_cast<double>(rows) * static_cast<double>(n);
    for (size_t p = 0; p < pools.size(); ++p) {
      ThreadPool& pool = *pools[p];
      const int64_t k_tok = o.gemv_tokens;
      const Rate gemv = rate_of(time_runs(o.repetitions,
                                          [&] {
                                            for (int64_t k = 0; k < k_tok; ++k)
                                              pool_matmul(pool, t, w.data(), rows, n,
                                                          act.data() + static_cast<size_t>(k) * arb,
                                                          arb, 1, y_tok.data() + k * rows);
                                          }),
                                static_cast<double>(k_tok));
      const double decode_tok_s = gemv_gbps_by_pool[p] * 1e9 / static_cast<double>(w.size());
      for (int64_t u : o.ubatches) {
        GemmResult g;
        g.type = t;
        g.n_threads = pool.n_threads();
        g.ubatch = u;
        g.rows = rows;
        g.cols = n;
        g.tok_s = rate_of(
            time_runs(
                o.repetitions,
                [&] { pool_matmul(pool, t, w.data(), rows, n, act.data(), arb, u, y.data()); }),
            static_cast<double>(u));
        g.gflops = g.tok_s.median * flops_per_tok / 1e9;
        g.gemv_tok_s = gemv.median;
        g.speedup_vs_gemv = gemv.median > 0 ? g.tok_s.median / gemv.median : 0;
        g.decode_tok_s = decode_tok_s;
        g.speedup_vs_decode = decode_tok_s > 0 ? g.tok_s.median / decode_tok_s : 0;
        const int64_t k_cmp = std::min(u, k_tok);
        g.matches_gemv = std::memcmp(y.data(), y_tok.data(),
                                     static_cast<size_t>(k_cmp * rows) * sizeof(float)) == 0;
        res.gemm.push_back(g);
        say(fmt::format(
            "gemm   {:<5} threads {:>3}  ubatch {:>4}  {:10.1f} tok/s  {:7.1f} GFLOP/s  "
            "x{:.1f} vs GEMV/token  x{:.1f} vs decode{}",
            tn, g.n_threads, u, g.tok_s.median, g.gflops, g.speedup_vs_gemv, g.speedup_vs_decode,
            g.matches_gemv ? "" : "  OUTPUTS DIFFER"));
      }
    }
  }

  measure_few(o, t, fill_pool, res);

  // Single-thread GEMV on a matrix that fits in L2.
  {
    const int64_t n = o.gemv_cols;
    const size_t rb = row_bytes(t, n);
    int64_t rows = static_cast<int64_t>(256 * kKiB / rb) / cpu::kGemmRowTile * cpu::kGemmRowTile;
    rows = std::clamp<int64_t>(rows, cpu::kGemmRowTile, 64);
    Buffer w(static_cast<size_t>(rows) * rb, fmt::format("{} L2 weights", tn));
    fill_weights(fill_pool, t, n, rows, w.data());
    std::vector<uint8_t> act;
    const size_t arb = fill_activations(t, n, 1, act);
    std::vector<float> y(static_cast<size_t>(rows));
    auto once = [&] { cpu::gemm_rows(t, w.data(), rows, act.data(), arb, 1, n, y.data(), rows); };
    // Calibrate the number of calls per sample to reach l2_min_seconds.
    once();
    int64_t calls = 1;
    for (;;) {
      const double t0 = now_seconds();
      for (int64_t i = 0; i < calls; ++i) once();
      const double dt = now_seconds() - t0;
      if (dt >= o.l2_min_seconds || calls >= (int64_t{1} << 30)) break;
      calls = dt > 0
                  ? std::max(calls * 2, static_cast<int64_t>(calls * o.l2_min_seconds / dt * 1.2))
                  : calls * 16;
    }
    L2Result l;
    l.type = t;
    l.rows = rows;
    l.cols = n;
    l.weight_bytes = w.size();
    l.gflops = rate_of(time_runs(o.repetitions,
                                 [&] {
                                   for (int64_t i = 0; i < calls; ++i) once();
                                 }),
                       2.0 * static_cast<double>(rows * n) * static_cast<double>(calls) / 1e9);
    res.l2.push_back(l);
    say(fmt::format("l2     {:<5} threads   1  {:8.2f} GFLOP/s  ({} x {}, {} KiB)", tn,
                    l.gflops.median, n, rows, w.size() / kKiB));
  }
}

}  // namespace

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

Rate rate_of(const std::vector<double>& secs, double work) {
  const double floor_s = 1e-12;  // a timer tick of 0 must not divide by zero
  return Rate{work / std::max(median_of(secs), floor_s),
              work / std::max(*std::min_element(secs.begin(), secs.end()), floor_s)};
}

std::vector<GgmlType> parse_type_list(std::string_view list) {
  std::vector<GgmlType> out;
  std::string item;
  std::istringstream ss{std::string(list)};
  while (std::getline(ss, item, ',')) {
    item = trim(item);
    if (item.empty()) continue;
    std::optional<GgmlType> t = parse_type(item);
    if (!t)
      throw Error(
          ErrorCategory::invalid_argument,
          fmt::format("bench: unknown weight type '{}' in --types (e.g. q4_K, q8_0, f16)", item));
    (void)cpu::activation_type(*t);  // Error(unsupported) without a dot product
    if (std::find(out.begin(), out.end(), *t) == out.end()) out.push_back(*t);
  }
  if (out.empty())
    throw Error(ErrorCategory::invalid_argument, "bench: --types lists no weight type");
  return out;
}

std::vector<int> parse_thread_list(std::string_view list) {
  std::vector<int> out;
  std::string item;
  std::istringstream ss{std::string(list)};
  while (std::getline(ss, item, ',')) {
    item = trim(item);
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 1 || v > 4096)
      throw Error(ErrorCategory::invalid_argument,
                  fmt::format("bench: '{}' in --threads is not a thread count (1..4096)", item));
    out.push_back(static_cast<int>(v));
  }
  if (out.empty()) throw Error(ErrorCategory::invalid_argument, "bench: --threads lists no count");
  return out;
}

// Pool wake-up (WakeResult): each run busy-waits idle_us on the calling thread, then times a
// parallel region of one task per thread in which every task waits until all have started (at
// most 2 ms, so a worker that never comes cannot hang the run).
std::vector<WakeResult> measure_wake(ThreadPool& pool, int runs) {
  using clk = std::chrono::steady_clock;
  const int n = pool.n_threads();
  std::vector<WakeResult> out;
  for (const int idle_us : {0, 50, 100, 200, 500, 1000}) {
    std::vector<double> lat;
    for (int rep = 0; rep < runs; ++rep) {
      const auto t0 = clk::now();
      while (std::chrono::duration<double, std::micro>(clk::now() - t0).count() < idle_us) {
      }
      std::atomic<int> arrived{0};
      const auto t1 = clk::now();
      pool.parallel_for(n, 1, [&](int64_t, int64_t) {
        arrived.fetch_add(1, std::memory_order_acq_rel);
        const auto s = clk::now();
        while (arrived.load(std::memory_order_acquire) < n &&
               std::chrono::duration<double, std::micro>(clk::now() - s).count() < 2000) {
        }
      });
      lat.push_back(std::chrono::duration<double, std::micro>(clk::now() - t1).count());
    }
    std::sort(lat.begin(), lat.end());
    out.push_back({n, idle_us, lat[lat.size() / 2], lat[lat.size() * 9 / 10]});
  }
  return out;
}

MachineInfo machine_info() { return describe_machine(); }

DramResult measure_dram_bandwidth(int n_threads, size_t bytes, int repetitions) {
  KernelBenchOptions o;
  o.dram_bytes = std::max<size_t>(bytes, 64 * kKiB);
  o.repetitions = std::max(1, repetitions);
  std::vector<std::unique_ptr<ThreadPool>> pools;
  pools.push_back(std::make_unique<ThreadPool>(n_threads));
  DramStream stream(o, *pools.front());
  return measure_dram(o, pools, stream).front();
}

KernelBenchResult run_kernel_bench(const KernelBenchOptions& options) {
  KernelBenchResult res;
  res.machine = describe_machine();
  res.options = resolve(options, res.machine);
  KernelBenchOptions o = res.options;
  o.progress = options.progress;
  res.statistic =
      fmt::format("median of {} runs after 1 warm-up (best run also in the JSON)", o.repetitions);

  // A pool may run fewer threads than asked (ThreadPool warns and lowers the count to what the
  // machine runs at once): pools are kept by the count they run, once each.
  std::vector<std::unique_ptr<ThreadPool>> pools;
  for (int t : o.threads) {
    auto pool = std::make_unique<ThreadPool>(t);
    const bool dup = std::any_of(pools.begin(), pools.end(), [&](const auto& p) {
      return p->n_threads() == pool->n_threads();
    });
    if (!dup) pools.push_back(std::move(pool));
  }
  ThreadPool* fill_pool = pools.front().get();
  for (auto& p : pools)
    if (p->n_threads() > fill_pool->n_threads()) fill_pool = p.get();

  DramStream dram_stream(o, *fill_pool);
  res.dram = measure_dram(o, pools, dram_stream);
  if (fill_pool->n_threads() > 1) {
    res.wake = measure_wake(*fill_pool, o.quick ? 20 : 200);
    for (const WakeResult& w : res.wake)
      if (o.progress)
        o.progress(fmt::format("wake   threads {:>3}  after {:>4} us idle: {:7.1f} us (p90 {:.1f})",
                               w.n_threads, w.idle_us, w.median_us, w.p90_us));
  }
  for (GgmlType t : o.types) measure_type(o, t, pools, *fill_pool, dram_stream, res);
  return res;
}

nlohmann::json to_json(const MachineInfo& m) {
  return {{"hostname", m.hostname},
          {"cpu_model", m.cpu_model},
          {"physical_cores", m.physical_cores},
          {"logical_cpus", m.logical_cpus},
          {"llc_bytes", m.llc_bytes},
          {"cpu_flags", m.cpu_flags},
          {"simd_targets", m.simd_targets},
          {"date_utc", m.date_utc},
          {"build", m.build}};
}

nlohmann::json to_json(const KernelBenchResult& r) {
  using nlohmann::json;
  const MachineInfo& m = r.machine;
  const KernelBenchOptions& o = r.options;
  json j;
  j["benchmark"] = "berth bench kernels";
  j["date"] = m.date_utc;
  j["machine"] = to_json(m);
  j["timing"] = {{"statistic", r.statistic}, {"warmup_runs", 1}, {"repetitions", o.repetitions}};
  std::vector<std::string> types;
  for (GgmlType t : o.types) types.emplace_back(type_name(t));
  // The pools made: a count above what the machine runs is lowered, duplicates run once.
  std::vector<int> threads_run;
  for (const DramResult& d : r.dram) threads_run.push_back(d.n_threads);
  j["config"] = {{"types", types},
                 {"threads", o.threads},
                 {"threads_run", threads_run},
                 {"quick", o.quick},
                 {"dram_bytes", o.dram_bytes},
                 {"gemv_bytes", o.gemv_bytes},
                 {"gemv_cols", o.gemv_cols},
                 {"gemm_rows", o.gemm_rows},
                 {"gemm_cols", o.gemm_cols},
                 {"ubatches", o.ubatches},
                 {"gemv_tokens", o.gemv_tokens},
                 {"gemm_row_tile", cpu::kGemmRowTile},
                 {"gemm_tok_tile", cpu::kGemmTokTile},
                 {"l2_min_seconds", o.l2_min_seconds},
                 {"few_tokens", o.few_tokens},
                 {"few_rows", o.few_rows},
                 {"few_cols", o.few_cols}};
  j["wake"] = json::array();
  for (const WakeResult& w : r.wake)
    j["wake"].push_back({{"threads", w.n_threads},
                         {"idle_us", w.idle_us},
                         {"median_us", w.median_us},
                         {"p90_us", w.p90_us}});
  j["dram"] = json::array();
  for (const DramResult& d : r.dram)
    j["dram"].push_back(
        {{"threads", d.n_threads}, {"gbps", d.gbps.median}, {"gbps_best", d.gbps.best}});
  j["gemv"] = json::array();
  for (const GemvResult& g : r.gemv)
    j["gemv"].push_back({{"type", type_name(g.type)},
                         {"threads", g.n_threads},
                         {"rows", g.rows},
                         {"cols", g.cols},
                         {"weight_bytes", g.weight_bytes},
                         {"gbps", g.gbps.median},
                         {"gbps_best", g.gbps.best},
                         {"ratio_to_dram", g.ratio_to_dram},
                         {"dram_paired_gbps", g.dram_paired_gbps},
                         {"pair_ratios", g.pair_ratios}});
  j["gemm"] = json::array();
  for (const GemmResult& g : r.gemm)
    j["gemm"].push_back({{"type", type_name(g.type)},
                         {"threads", g.n_threads},
                         {"ubatch", g.ubatch},
                         {"rows", g.rows},
                         {"cols", g.cols},
                         {"tok_s", g.tok_s.median},
                         {"tok_s_best", g.tok_s.best},
                         {"gflops", g.gflops},
                         {"gemv_tok_s", g.gemv_tok_s},
                         {"speedup_vs_gemv", g.speedup_vs_gemv},
                         {"decode_tok_s", g.decode_tok_s},
                         {"speedup_vs_decode", g.speedup_vs_decode},
                         {"matches_gemv", g.matches_gemv}});
  j["l2_gemv"] = json::array();
  for (const L2Result& l : r.l2)
    j["l2_gemv"].push_back({{"type", type_name(l.type)},
                            {"threads", 1},
                            {"rows", l.rows},
                            {"cols", l.cols},
                            {"weight_bytes", l.weight_bytes},
                            {"gflops", l.gflops.median},
                            {"gflops_best", l.gflops.best}});
  j["few_tok"] = json::array();
  for (const FewTokResult& f : r.few)
    j["few_tok"].push_back({{"type", type_name(f.type)},
                            {"threads", f.n_threads},
                            {"n_tok", f.n_tok},
                            {"rows", f.rows},
                            {"cols", f.cols},
                            {"experts", f.experts},
                            {"weight_bytes", f.weight_bytes},
                            {"gbps", f.gbps.median},
                            {"gbps_best", f.gbps.best},
                            {"ratio_to_one", f.ratio_to_one},
                            {"gemv_gbps", f.gemv_gbps},
                            {"speedup_vs_gemv", f.speedup_vs_gemv},
                            {"matches_gemv", f.matches_gemv}});
  return j;
}

std::string format_text(const KernelBenchResult& r) {
  const MachineInfo& m = r.machine;
  const KernelBenchOptions& o = r.options;
  std::string s;
  std::string flags;
  for (const std::string& f : m.cpu_flags) flags += " " + f;
  s += fmt::format("berth bench kernels: {}, {} physical cores ({} logical), LLC {} MiB\n",
                   m.cpu_model, m.physical_cores, m.logical_cpus, m.llc_bytes / kMiB);
  s += fmt::format("flags:{}; SIMD targets: {}\n", flags.empty() ? " -" : flags,
                   fmt::join(m.simd_targets, " "));
  s += fmt::format("{} on {}, {} build; each number is the {}\n", m.date_utc, m.hostname, m.build,
                   r.statistic);

  s += fmt::format("\nDRAM read bandwidth (streaming sum over {} MiB)\n", o.dram_bytes / kMiB);
  s += fmt::format("  {:>7}  {:>8}\n", "threads", "GB/s");
  for (const DramResult& d : r.dram)
    s += fmt::format("  {:>7}  {:>8.2f}\n", d.n_threads, d.gbps.median);

  if (!r.wake.empty()) {
    s += fmt::format(
        "\nPool wake-up: a parallel region until all {} threads have joined, after the calling "
        "thread was busy elsewhere (median / p90, us)\n",
        r.wake.front().n_threads);
    for (const WakeResult& w : r.wake)
      s += fmt::format("  after {:>4} us idle  {:8.1f}  {:8.1f}\n", w.idle_us, w.median_us,
                       w.p90_us);
  }

  if (!r.gemv.empty()) {
    s += fmt::format(
        "\nDecode GEMV (1 token, {}-element rows, ~{} MiB of weights, rows split as the "
        "runtime splits them); each run paired with a DRAM stream run just before or after it: "
        "the median of those runs' GB/s and of the pairs' ratios\n",
        r.gemv.front().cols, o.gemv_bytes / kMiB);
    s += fmt::format("  {:<5}  {:>7}  {:>8}  {:>10}  {:>7}\n", "type", "threads", "GB/s",
                     "DRAM GB/s", "of DRAM");
    for (const GemvResult& g : r.gemv)
      s += fmt::format("  {:<5}  {:>7}  {:>8.2f}  {:>10.2f}  {:>6.1f}%\n", type_name(g.type),
                       g.n_threads, g.gbps.median, g.dram_paired_gbps, 100 * g.ratio_to_dram);
  }

  if (!r.gemm.empty()) {
    s += fmt::format(
        "\nGEMM ({} x {} matrix, rows split as the runtime splits them, each chunk one "
        "cpu::gemm_rows); speedups over the GEMV run once per token on the same matrix, and "
        "over decoding it from DRAM at the GEMV's GB/s\n",
        o.gemm_rows, o.gemm_cols);
    s +=
        fmt::format("  {:<5}  {:>7}  {:>6}  {:>10}  {:>8}  {:>10}  {:>10}  {:>8}\n", "type",
                    "threads", "ubatch", "tok/s", "GFLOP/s", "x GEMV/tok", "x decode", "same bits");
    for (const GemmResult& g : r.gemm)
      s += fmt::format("  {:<5}  {:>7}  {:>6}  {:>10.1f}  {:>8.1f}  {:>9.2f}x  {:>9.2f}x  {:>8}\n",
                       type_name(g.type), g.n_threads, g.ubatch, g.tok_s.median, g.gflops,
                       g.speedup_vs_gemv, g.speedup_vs_decode, g.matches_gemv ? "yes" : "NO");
  }

  if (!r.l2.empty()) {
    s += "\nSingle-thread GEMV on L2-resident weights (repeated; 2 flops per weight)\n";
    s += fmt::format("  {:<5}  {:>11}  {:>7}  {:>8}\n", "type", "shape", "KiB", "GFLOP/s");
    for (const L2Result& l : r.l2)
      s +=
          fmt::format("  {:<5}  {:>11}  {:>7}  {:>8.2f}\n", type_name(l.type),
                      fmt::format("{}x{}", l.cols, l.rows), l.weight_bytes / kKiB, l.gflops.median);
  }

  if (!r.few.empty()) {
    const FewTokResult& f0 = r.few.front();
    s += fmt::format(
        "\nFew-token GEMM (routed experts: {} matrices of {} x {}, ~{} MiB per type, each one "
        "cpu::gemm_rows with n tokens, {} threads); GB/s of weights read once per run, the ratio "
        "to 1 token, and the speedup over one GEMV per token on the same experts\n",
        f0.experts, f0.rows, f0.cols, f0.weight_bytes / kMiB, f0.n_threads);
    s += fmt::format("  {:<5}  {:>6}  {:>8}  {:>9}  {:>10}  {:>8}\n", "type", "tokens", "GB/s",
                     "x 1 token", "x GEMV/tok", "same bits");
    for (const FewTokResult& f : r.few)
      s += fmt::format("  {:<5}  {:>6}  {:>8.2f}  {:>8.2f}x  {:>9.2f}x  {:>8}\n", type_name(f.type),
                       f.n_tok, f.gbps.median, f.ratio_to_one, f.speedup_vs_gemv,
                       f.matches_gemv ? "yes" : "NO");
  }
  return s;
}

}  // namespace berth::bench
