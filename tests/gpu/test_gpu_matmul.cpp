// Oracle tests of the GPU matmul family (gpu_kernels/src/matmul.cu, moe.cu) against double-
// precision products of weights decoded by ref::dequantize_row:
//  - matmul: every supported type x row lengths of one and several blocks x n_out {1, 7, 129,
//    300} x n_tok {1, 2, 7, 12, 64, 512}, through both paths (GEMV at small n_tok, f16
//    tensor-core GEMM above; 12 tokens also through the GEMV, forced); NMSE per shape and
//    pooled per type and path.
//  - embed: bit-identical to ref::dequantize_row; ids outside the vocabulary give zero rows.
//  - moe_experts: both paths at n_tok 1, 2, 512 against a CPU reference; several tokens share
//    an expert, one expert is picked by nobody; a mask keeping a subset (a token with no valid
//    slot gets a zero row); two launches with complementary masks add up to the full result;
//    repeated launches are bit-identical.
// Inputs are seeded Gaussians (never zeros); outputs are poisoned (NaN bytes) before each run.
// A "timing" case (skipped unless asked for with --no-skip -tc=timing) prints speeds.
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "berth/core/error.h"
#include "berth/core/fp16.h"
#include "berth/core/types.h"
#include "berth/cpu_kernels/quants_ref.h"
#include "berth/gpu_kernels/kernels.h"
#include "core/kernel_harness.h"

// Tuning knobs of the launchers (gpu_kernels/src/matmul_internal.h), used here to force a path.
namespace berth::gpu::detail {
int& gemv_max_tok();
int& gemv_max_tok_float();
int& moe_gemv_max_tok();
bool matmul_uses_gemv(GgmlType t, int64_t n_tok);
}  // namespace berth::gpu::detail

namespace berth {
namespace {

using test::gaussian;
using test::nmse;

bool has_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define REQUIRE_DEVICE() REQUIRE_MESSAGE(has_device(), "no CUDA device: the GPU suite needs one")
#define CUDA_OK(call) REQUIRE_MESSAGE((call) == cudaSuccess, #call)

// A device buffer of n bytes.
struct Dev {
  void* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t bytes) : n(bytes) {
    if (bytes) CUDA_OK(cudaMalloc(&p, bytes));
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
  template <class T>
  void put(const std::vector<T>& v) {
    REQUIRE(v.size() * sizeof(T) <= n);
    CUDA_OK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  template <class T>
  std::vector<T> get(size_t count) const {
    std::vector<T> v(count);
    CUDA_OK(cudaMemcpy(v.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
  void poison() const { CUDA_OK(cudaMemset(p, 0xFF, n)); }  // 0xFFFFFFFF is a NaN
};

constexpr GgmlType kAll[] = {GgmlType::F32,  GgmlType::F16,  GgmlType::BF16, GgmlType::Q4_0,
                             GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0,
                             GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K,
                             GgmlType::Q6_K};

bool quantized(GgmlType t) { return traits(t).block_size > 1; }

// Rows of Gaussian weights with an offset (so the mins matter), quantized by the reference.
std::vector<uint8_t> make_weights(GgmlType t, int64_t rows, int64_t n, uint64_t seed) {
  const size_t rb = row_bytes(t, n);
  std::vector<uint8_t> w(rb * static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    const auto x = gaussian(static_cast<size_t>(n), seed + static_cast<uint64_t>(r), 0.05f, 0.01f);
    ref::quantize_row(t, x.data(), w.data() + static_cast<size_t>(r) * rb, n);
  }
  return w;
}

std::vector<double> decode(GgmlType t, const std::vector<uint8_t>& w, int64_t rows, int64_t n) {
  std::vector<float> f(static_cast<size_t>(rows * n));
  ref::dequantize_rows(t, w.data(), f.data(), rows, n);
  return {f.begin(), f.end()};
}

// out [n_tok, n_out] = x [n_tok, n_in] . W^T in double.
std::vector<double> ref_matmul(const std::vector<double>& W, const std::vector<float>& x,
                               int64_t n_in, int64_t n_out, int64_t n_tok) {
  std::vector<double> o(static_cast<size_t>(n_tok * n_out));
  for (int64_t t = 0; t < n_tok; ++t)
    for (int64_t r = 0; r < n_out; ++r) {
      double s = 0;
      const double* wr = &W[static_cast<size_t>(r * n_in)];
      const float* xr = &x[static_cast<size_t>(t * n_in)];
      for (int64_t i = 0; i < n_in; ++i) s += wr[i] * xr[i];
      o[static_cast<size_t>(t * n_out + r)] = s;
    }
  return o;
}

struct Pool {
  double num = 0, den = 0;
  bool bad = false;
  void add(const std::vector<double>& ref, const std::vector<float>& got) {
    for (size_t i = 0; i < ref.size(); ++i) {
      if (!std::isfinite(got[i])) bad = true;
      num += (got[i] - ref[i]) * (got[i] - ref[i]);
      den += ref[i] * ref[i];
    }
  }
  double value() const {
    if (bad) return std::numeric_limits<double>::infinity();
    return den > 0 ? num / den : num;  // an all-zero reference: the plain squared error
  }
};

double nmse_d(const std::vector<double>& ref, const std::vector<float>& got) {
  Pool p;
  p.add(ref, got);
  return p.value();
}

// Tolerances, by path:
// - dp4a GEMV, quantized weights: activations rounded to int8 per 32 values (step max|x|/127,
//   variance step^2/12: about 2.5e-5 of the signal for Gaussian inputs). Pooled over the shapes
//   of a type; a single output (n_out = n_tok = 1) can nearly cancel, hence the loose per-shape
//   bound, which still catches any wrong quant, scale or offset (NMSE ~1).
constexpr double kTolGemvQPooled = 1e-4, kTolGemvQShape = 2e-2;
// - GEMV, float weights: f32 products and sums, vs double: rounding only.
constexpr double kTolGemvFPooled = 1e-10, kTolGemvFShape = 1e-8;
// - tensor-core path: x and the weights rounded to f16 (relative 2^-11 each), f32 accumulation.
constexpr double kTolGemmPooled = 1e-5, kTolGemmShape = 1e-3;

TEST_CASE("gpu supports: the CPU path's set, nothing else") {
  for (GgmlType t : kAll) CHECK(gpu::supports(t));
  CHECK_FALSE(gpu::supports(GgmlType::Q8_K));
  CHECK_FALSE(gpu::supports(GgmlType::IQ2_XXS));
  CHECK_FALSE(gpu::supports(GgmlType::MXFP4));
  try {
    gpu::matmul_workspace_bytes(GgmlType::IQ4_XS, 256, 4, 1);
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::unsupported);
  }
  try {
    gpu::matmul_workspace_bytes(GgmlType::Q4_K, 100, 4, 1);
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::invalid_argument);
  }
}

TEST_CASE("gpu matmul: every type and shape against the double-precision reference") {
  REQUIRE_DEVICE();
  const int64_t kOut[] = {1, 7, 129, 300};
  const int64_t kTok[] = {1, 2, 7, 12, 64, 512};
  const int64_t max_out = 300, max_tok = 512;
  uint64_t seed = 100;
  for (GgmlType t : kAll) {
    CAPTURE(type_name(t));
    const int64_t bs = traits(t).block_size;
    // One block and several; for float types a length that is not a multiple of 8 (scalar
    // path), one that is (16-byte loads) and one that is a multiple of 64 (the mma.sync GEMM of
    // prompt rows; 320 and 768 for the quantized types, 32 on the WMMA GEMM).
    std::vector<int64_t> lens = bs == 1 ? std::vector<int64_t>{40, 264, 128}
                                        : std::vector<int64_t>{bs, bs == 32 ? 320 : 768};
    Pool pool_gemv, pool_gemm;
    for (int64_t n_in : lens) {
      CAPTURE(n_in);
      const auto wq = make_weights(t, max_out, n_in, seed += 1000);
      const auto W = decode(t, wq, max_out, n_in);
      const auto x = gaussian(static_cast<size_t>(max_tok * n_in), seed + 7, 1.0f, 0.1f);
      Dev dw(wq.size()), dx(x.size() * 4), dout(static_cast<size_t>(max_tok * max_out) * 4);
      dw.put(wq);
      dx.put(x);
      for (int64_t n_out : kOut) {
        CAPTURE(n_out);
        const auto ref_all = ref_matmul(W, x, n_in, n_out, max_tok);
        for (int64_t n_tok : kTok) {
          // n_tok 12 also through the GEMV forced (two token chunks of 8 and 4); 64 and 512
          // also with the mma.sync GEMM off (the WMMA GEMM on f16 weight chunks).
          for (const int variant : {0, 1, 2}) {
            const bool force = variant == 1, no_mma = variant == 2;
            if ((force && n_tok != 12) || (no_mma && n_tok < 64)) continue;
            CAPTURE(n_tok);
            CAPTURE(force);
            CAPTURE(no_mma);
            const int saved_q = gpu::detail::gemv_max_tok(),
                      saved_f = gpu::detail::gemv_max_tok_float();
            const bool saved_mma = gpu::detail::moe_gemm_mma();
            if (force) gpu::detail::gemv_max_tok() = gpu::detail::gemv_max_tok_float() = 1 << 30;
            gpu::detail::moe_gemm_mma() = !no_mma;
            const size_t wsb = gpu::matmul_workspace_bytes(t, n_in, n_out, n_tok);
            // F32 weights: every row on the GEMV (matmul's docs).
            const bool gemv = t == GgmlType::F32 || gpu::detail::matmul_uses_gemv(t, n_tok);
            Dev ws(wsb);
            dout.poison();
            gpu::matmul(t, dw.p, n_in, n_out, dx.as<float>(), n_tok, dout.as<float>(), ws.p, wsb,
                        nullptr);
            CUDA_OK(cudaDeviceSynchronize());
            gpu::detail::gemv_max_tok() = saved_q;
            gpu::detail::gemv_max_tok_float() = saved_f;
            gpu::detail::moe_gemm_mma() = saved_mma;
            const auto got = dout.get<float>(static_cast<size_t>(n_tok * n_out));
            const std::vector<double> ref(ref_all.begin(), ref_all.begin() + n_tok * n_out);
            const double e = nmse_d(ref, got);
            CAPTURE(gemv);
            CAPTURE(e);
            if (gemv) {
              CHECK(e <= (quantized(t) ? kTolGemvQShape : kTolGemvFShape));
              pool_gemv.add(ref, got);
            } else {
              CHECK(e <= kTolGemmShape);
              pool_gemm.add(ref, got);
            }
          }
        }
      }
    }
    const double pg = pool_gemv.value(), pm = pool_gemm.value();
    MESSAGE(type_name(t), ": pooled NMSE gemv ", pg, ", gemm ", pm);
    CHECK(pg <= (quantized(t) ? kTolGemvQPooled : kTolGemvFPooled));
    CHECK(pm <= kTolGemmPooled);
  }
}

TEST_CASE(
    "gpu decode GEMV, K-quants: a row's bits do not depend on tokens, rows per lane set or launch "
    "bounds") {
  REQUIRE_DEVICE();
  // The 64-element-unit kernel (gemv_kq on): lengths of 1, 3, 9 and 20 superblocks (4, 12, 36
  // and 80 units), an odd row count (the last lane set of 2 rows half outside), 1 and 8 tokens, 1
  // and 2 rows per lane set; and the 32-element-group kernel (gemv_kq off) on the same data, both
  // within the reference's bound.
  // The three lane rules (gemv_kq_lanes 0: at most 1/8 of the lane steps idle, then wider for
  // these 1031 rows, lanes 4, 16, 32, 32; 1: powers of two up to 32, lanes 4, 16, 32, 32; 2: the
  // first step of rule 0 alone, lanes 4, 4, 8, 16). One-token launches also through the kernel
  // compiled for 7 and 8 blocks per SM (gemv_kq_minb: other register allocations, spills at 8).
  const bool saved_kq = gpu::detail::gemv_kq();
  const int saved_rps = gpu::detail::gemv_kq_rps();
  const int saved_minb = gpu::detail::gemv_kq_minb();
  const int saved_lanes = gpu::detail::gemv_kq_lanes();
  const bool saved_tok4 = gpu::detail::gemv_tok4();
  uint64_t seed = 4400;
  for (GgmlType t : {GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K}) {
    CAPTURE(type_name(t));
    for (const int lanes : {0, 1, 2}) {
      CAPTURE(lanes);
      gpu::detail::gemv_kq_lanes() = lanes;
      for (const int64_t n_in : {int64_t{256}, int64_t{768}, int64_t{2304}, int64_t{5120}}) {
        CAPTURE(n_in);
        const int64_t n_out = 1031, n_tok = 8;
        const auto wq = make_weights(t, n_out, n_in, seed += 100);
        const auto W = decode(t, wq, n_out, n_in);
        const auto x = gaussian(static_cast<size_t>(n_tok * n_in), seed + 1, 1.0f, 0.1f);
        const auto ref = ref_matmul(W, x, n_in, n_out, n_tok);
        Dev dw(wq.size()), dx(x.size() * 4), dout(static_cast<size_t>(n_tok * n_out) * 4);
        dw.put(wq);
        dx.put(x);
        const size_t wsb = gpu::matmul_workspace_bytes(t, n_in, n_out, n_tok);
        Dev ws(wsb);
        auto run = [&](bool kq, int rps, int64_t nt, int minb = 0, int64_t tok0 = 0,
                       bool tok4 = false) {
          gpu::detail::gemv_kq() = kq;
          gpu::detail::gemv_kq_rps() = rps;
          gpu::detail::gemv_kq_minb() = minb;
          gpu::detail::gemv_tok4() = tok4;
          dout.poison();
          gpu::matmul(t, dw.p, n_in, n_out, dx.as<float>() + tok0 * n_in, nt, dout.as<float>(),
                      ws.p, wsb, nullptr);
          CUDA_OK(cudaDeviceSynchronize());
          gpu::detail::gemv_kq() = saved_kq;
          gpu::detail::gemv_kq_rps() = saved_rps;
          gpu::detail::gemv_kq_minb() = saved_minb;
          gpu::detail::gemv_tok4() = saved_tok4;
          return dout.get<float>(static_cast<size_t>(nt * n_out));
        };
        const auto base = run(true, 1, n_tok);
        const std::vector<double> ref8(ref.begin(), ref.end());
        const double e = nmse_d(ref8, base);
        CAPTURE(e);
        CHECK(e <= kTolGemvQShape);
        const auto two = run(true, 2, n_tok);
        CHECK(std::memcmp(base.data(), two.data(), base.size() * 4) == 0);
        for (const int rps : {1, 2})
          for (const int minb : {0, 7, 8}) {
            CAPTURE(rps);
            CAPTURE(minb);
            const auto one = run(true, rps, 1, minb);
            CHECK(std::memcmp(base.data(), one.data(), one.size() * 4) == 0);
          }
        const auto old = run(false, 0, n_tok);
        const double e_old = nmse_d(ref8, old);
        CAPTURE(e_old);
        CHECK(e_old <= kTolGemvQShape);
        // Every token's row alone has its bits in the 8-token launch (the several-token sums are
        // reduce-scattered over a row's lanes, one token's are a butterfly), on both kernels.
        bool alone_same = true;
        for (int64_t tok = 0; tok < n_tok; ++tok)
          for (const bool kq : {true, false}) {
            const auto one = run(kq, 0, 1, 0, tok);
            const auto& all = kq ? base : old;
            alone_same = alone_same &&
                         std::memcmp(one.data(), all.data() + tok * n_out, one.size() * 4) == 0;
          }
        CHECK(alone_same);
        // Launches of 2-4 tokens, through the 8-token and the 4-token kernel (gemv_tok4), and
        // rps 1 and 2: each token's row has the bits of the 8-token launch.
        bool few_same = true;
        for (const int64_t nt : {int64_t{2}, int64_t{3}, int64_t{4}})
          for (const bool kq : {true, false})
            for (const bool tok4 : {false, true})
              for (const int rps : {1, 2}) {
                const int64_t tok0 = n_tok - nt;
                const auto few = run(kq, kq ? rps : 0, nt, 0, tok0, tok4);
                const auto& all = kq ? base : old;
                few_same = few_same &&
                           std::memcmp(few.data(), all.data() + tok0 * n_out, few.size() * 4) == 0;
              }
        CHECK(few_same);
        // The two kernels sum in different orders, so their bits differ; they differ only by
        // rounding.
        CHECK(nmse_d(std::vector<double>(base.begin(), base.end()), old) <= 1e-9);
      }
    }
  }
  gpu::detail::gemv_kq_lanes() = saved_lanes;
}

TEST_CASE("gpu decode GEMV, float weights with few rows: 128 lanes per row, same bits per token") {
  REQUIRE_DEVICE();
  // 48 x 5120 (Qwen3.5-27B's ssm_alpha, ssm_beta) and 7 x 4096: rows spanning 4 warps; 300 x
  // 4096: 32 lanes per row. 1 and 8 tokens: token 0's row has the same bits.
  struct Shape {
    int64_t n_out, n_in;
  };
  uint64_t seed = 5100;
  for (GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::BF16})
    for (const Shape sh : {Shape{48, 5120}, Shape{7, 4096}, Shape{300, 4096}}) {
      CAPTURE(type_name(t));
      CAPTURE(sh.n_out);
      CAPTURE(sh.n_in);
      const int64_t n_tok = 8;
      const auto wq = make_weights(t, sh.n_out, sh.n_in, seed += 10);
      const auto W = decode(t, wq, sh.n_out, sh.n_in);
      const auto x = gaussian(static_cast<size_t>(n_tok * sh.n_in), seed + 3, 1.0f, 0.1f);
      const auto ref = ref_matmul(W, x, sh.n_in, sh.n_out, n_tok);
      Dev dw(wq.size()), dx(x.size() * 4), dout(static_cast<size_t>(n_tok * sh.n_out) * 4);
      dw.put(wq);
      dx.put(x);
      const size_t wsb = gpu::matmul_workspace_bytes(t, sh.n_in, sh.n_out, n_tok);
      Dev ws(wsb);
      const int saved_f = gpu::detail::gemv_max_tok_float();
      gpu::detail::gemv_max_tok_float() = 1 << 30;
      auto run = [&](int64_t nt) {
        dout.poison();
        gpu::matmul(t, dw.p, sh.n_in, sh.n_out, dx.as<float>(), nt, dout.as<float>(), ws.p, wsb,
                    nullptr);
        CUDA_OK(cudaDeviceSynchronize());
        return dout.get<float>(static_cast<size_t>(nt * sh.n_out));
      };
      const auto all = run(n_tok);
      const auto one = run(1);
      gpu::detail::gemv_max_tok_float() = saved_f;
      const double e = nmse_d(ref, all);
      CAPTURE(e);
      CHECK(e <= kTolGemvFShape);
      CHECK(std::memcmp(all.data(), one.data(), one.size() * 4) == 0);
    }
}

TEST_CASE("gpu matmul_group: the same bits as one matmul per job, mixed types, both paths") {
  REQUIRE_DEVICE();
  // A layer's Q, K, V (different types and widths, one input), plus an f32 job (no quantized
  // activations), at decode sizes (activations quantized once) and at a prefill size.
  const GgmlType types[] = {GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0, GgmlType::F32};
  const int64_t outs[] = {300, 64, 129, 7};
  const int64_t n_in = 768;
  uint64_t seed = 9000;
  std::vector<std::vector<uint8_t>> wq;
  std::vector<std::unique_ptr<Dev>> dws;
  for (int j = 0; j < 4; ++j) {
    wq.push_back(make_weights(types[j], outs[j], n_in, seed += 17));
    dws.push_back(std::make_unique<Dev>(wq.back().size()));
    dws.back()->put(wq.back());
  }
  for (const int64_t n_tok : {int64_t{1}, int64_t{5}, int64_t{12}, int64_t{64}}) {
    CAPTURE(n_tok);
    const auto x = gaussian(static_cast<size_t>(n_tok * n_in), seed + n_tok, 1.0f, 0.1f);
    Dev dx(x.size() * 4);
    dx.put(x);
    size_t wsb = 0;
    for (int j = 0; j < 4; ++j)
      wsb = std::max(wsb, gpu::matmul_workspace_bytes(types[j], n_in, outs[j], n_tok));
    Dev ws(wsb);
    std::vector<std::unique_ptr<Dev>> one, grp;
    std::vector<MatmulJob> jobs;
    for (int j = 0; j < 4; ++j) {
      one.push_back(std::make_unique<Dev>(static_cast<size_t>(n_tok * outs[j]) * 4));
      grp.push_back(std::make_unique<Dev>(static_cast<size_t>(n_tok * outs[j]) * 4));
      one.back()->poison();
      grp.back()->poison();
      gpu::matmul(types[j], dws[static_cast<size_t>(j)]->p, n_in, outs[j], dx.as<float>(), n_tok,
                  one.back()->as<float>(), ws.p, wsb, nullptr);
      jobs.push_back({types[j], dws[static_cast<size_t>(j)]->p, outs[j], grp.back()->as<float>()});
    }
    for (const int n_jobs : {4, 3, 2}) {  // with and without the f32 job
      CAPTURE(n_jobs);
      gpu::matmul_group(jobs.data(), n_jobs, n_in, dx.as<float>(), n_tok, ws.p, wsb, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      for (int j = 0; j < n_jobs; ++j) {
        CAPTURE(j);
        const size_t n = static_cast<size_t>(n_tok * outs[j]);
        const auto a = one[static_cast<size_t>(j)]->get<float>(n);
        const auto b = grp[static_cast<size_t>(j)]->get<float>(n);
        CHECK(std::memcmp(a.data(), b.data(), n * 4) == 0);
      }
    }
  }
}

// n_tok decode tokens (one, or up to 8: one launch per type too) through matmul_group against
// one matmul per job: the same bits for every job and token.
void check_group_one_token(int64_t n_in, const std::vector<GgmlType>& types,
                           const std::vector<int64_t>& outs, uint64_t seed, int64_t n_tok = 1) {
  CAPTURE(n_tok);
  const size_t n = types.size();
  const auto x = gaussian(static_cast<size_t>(n_tok * n_in), seed, 1.0f, 0.1f);
  Dev dx(x.size() * 4);
  dx.put(x);
  size_t wsb = 0;
  for (size_t j = 0; j < n; ++j)
    wsb = std::max(wsb, gpu::matmul_workspace_bytes(types[j], n_in, outs[j], n_tok));
  Dev ws(wsb);
  std::vector<std::unique_ptr<Dev>> dws, one, grp;
  std::vector<MatmulJob> jobs;
  for (size_t j = 0; j < n; ++j) {
    const auto wq = make_weights(types[j], outs[j], n_in, seed + 1 + j);
    dws.push_back(std::make_unique<Dev>(wq.size()));
    dws.back()->put(wq);
    one.push_back(std::make_unique<Dev>(static_cast<size_t>(n_tok * outs[j]) * 4));
    grp.push_back(std::make_unique<Dev>(static_cast<size_t>(n_tok * outs[j]) * 4));
    one.back()->poison();
    grp.back()->poison();
    gpu::matmul(types[j], dws.back()->p, n_in, outs[j], dx.as<float>(), n_tok,
                one.back()->as<float>(), ws.p, wsb, nullptr);
    jobs.push_back({types[j], dws.back()->p, outs[j], grp.back()->as<float>()});
  }
  gpu::matmul_group(jobs.data(), static_cast<int>(n), n_in, dx.as<float>(), n_tok, ws.p, wsb,
                    nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  for (size_t j = 0; j < n; ++j) {
    CAPTURE(j);
    const auto a = one[j]->get<float>(static_cast<size_t>(n_tok * outs[j]));
    const auto b = grp[j]->get<float>(static_cast<size_t>(n_tok * outs[j]));
    CHECK(std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
  }
}

TEST_CASE("gpu matmul_group, 1-8 tokens: matrices of one type share a launch, same bits") {
  REQUIRE_DEVICE();
  // Q, K, V of one type (one launch), Q and K of one type with V of another (two), and a group
  // with a float matrix; widths that end inside a block of rows.
  const std::vector<int64_t> outs = {4096, 515, 33};
  uint64_t seed = 7000;
  for (const auto& types :
       std::vector<std::vector<GgmlType>>{{GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q4_K},
                                          {GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q6_K},
                                          {GgmlType::Q8_0, GgmlType::F32, GgmlType::Q8_0},
                                          {GgmlType::Q6_K, GgmlType::Q4_K}}) {
    CAPTURE(type_name(types[0]));
    seed += 100;
    for (const int64_t n_tok : {int64_t{1}, int64_t{3}, int64_t{8}})
      check_group_one_token(2048, types, outs, seed, n_tok);
  }
  // Qwen3.5-4B's attention Q (with its gate), K, V: rows of 40 units, where K and V alone fill
  // few row blocks and get 32 lanes per row against Q's 8 (gemv_shape), so Q launches alone.
  for (const auto& types :
       std::vector<std::vector<GgmlType>>{{GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q4_K},
                                          {GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q6_K}}) {
    CAPTURE(type_name(types[2]));
    check_group_one_token(2560, types, {8192, 1024, 1024}, seed += 100);
  }
}

TEST_CASE("gpu matmul_group, five jobs: launches by type, float rows of 128 lanes") {
  REQUIRE_DEVICE();
  // A Qwen3.5-27B GDN layer's group (attn_qkv Q5_K, attn_gate Q4_K, ssm_beta and ssm_alpha f32,
  // rows of 128 lanes that share a launch) plus an f16 job: each job's bits as matmul alone.
  for (const int64_t n_tok : {int64_t{1}, int64_t{4}})
    check_group_one_token(
        5120, {GgmlType::Q5_K, GgmlType::Q4_K, GgmlType::F32, GgmlType::F32, GgmlType::F16},
        {300, 129, 48, 48, 7}, 7300, n_tok);
}

TEST_CASE("gpu swiglu_matmul: the bits of swiglu then matmul of one decode row") {
  REQUIRE_DEVICE();
  // FFN down projections: Qwen3.5-0.8B's (3584 -> 1024, Q6_K), 27B's (17408 -> 5120, Q4_K),
  // and a Q8_0 one on the 32-element-group kernel; float weights refused.
  struct Shape {
    GgmlType t;
    int64_t n_in, n_out;
  };
  uint64_t seed = 8100;
  for (const Shape sh : {Shape{GgmlType::Q6_K, 3584, 1024}, Shape{GgmlType::Q4_K, 17408, 5120},
                         Shape{GgmlType::Q8_0, 1024, 300}}) {
    CAPTURE(type_name(sh.t));
    const auto wq = make_weights(sh.t, sh.n_out, sh.n_in, seed += 10);
    const auto gate = gaussian(static_cast<size_t>(sh.n_in), seed + 1, 2.0f);
    const auto up = gaussian(static_cast<size_t>(sh.n_in), seed + 2, 1.0f);
    Dev dw(wq.size()), dg(gate.size() * 4), du(up.size() * 4), dh(gate.size() * 4);
    Dev o1(static_cast<size_t>(sh.n_out) * 4), o2(static_cast<size_t>(sh.n_out) * 4);
    dw.put(wq);
    dg.put(gate);
    du.put(up);
    o1.poison();
    o2.poison();
    const size_t wsb = gpu::matmul_workspace_bytes(sh.t, sh.n_in, sh.n_out, 1);
    Dev ws(wsb);
    gpu::swiglu(dg.as<float>(), du.as<float>(), dh.as<float>(), sh.n_in, nullptr);
    gpu::matmul(sh.t, dw.p, sh.n_in, sh.n_out, dh.as<float>(), 1, o1.as<float>(), ws.p, wsb,
                nullptr);
    gpu::swiglu_matmul(sh.t, dw.p, sh.n_in, sh.n_out, dg.as<float>(), du.as<float>(),
                       o2.as<float>(), ws.p, wsb, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const auto a = o1.get<float>(static_cast<size_t>(sh.n_out));
    const auto b = o2.get<float>(static_cast<size_t>(sh.n_out));
    CHECK(std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
  }
  Dev ws(1 << 16);
  CHECK_THROWS_WITH(gpu::swiglu_matmul(GgmlType::F32, nullptr, 64, 4, nullptr, nullptr, nullptr,
                                       ws.p, 1 << 16, nullptr),
                    doctest::Contains("quantized weights only"));
}

// matmul_group with x_q8 (the activation blocks left in the workspace by the producer of x)
// against matmul_group quantizing x itself: the same bits, for two jobs of different types.
void check_x_q8(const char* what, int64_t n_in, Dev& x, Dev& ws, size_t wsb, uint64_t seed) {
  CAPTURE(what);
  // K-quants need rows of whole 256-element blocks; legacy types serve shorter rows.
  const bool k = n_in % 256 == 0;
  const GgmlType types[2] = {k ? GgmlType::Q4_K : GgmlType::Q8_0,
                             k ? GgmlType::Q6_K : GgmlType::Q4_0};
  const int64_t outs[2] = {515, 64};
  std::vector<std::unique_ptr<Dev>> dws, got, ref;
  std::vector<MatmulJob> jg, jr;
  for (int j = 0; j < 2; ++j) {
    const auto wq = make_weights(types[j], outs[j], n_in, seed + 10 * static_cast<uint64_t>(j));
    dws.push_back(std::make_unique<Dev>(wq.size()));
    dws.back()->put(wq);
    got.push_back(std::make_unique<Dev>(static_cast<size_t>(outs[j]) * 4));
    ref.push_back(std::make_unique<Dev>(static_cast<size_t>(outs[j]) * 4));
    got.back()->poison();
    ref.back()->poison();
    jg.push_back({types[j], dws.back()->p, outs[j], got.back()->as<float>()});
    jr.push_back({types[j], dws.back()->p, outs[j], ref.back()->as<float>()});
  }
  gpu::matmul_group(jg.data(), 2, n_in, x.as<float>(), 1, ws.p, wsb, nullptr, true);
  gpu::matmul_group(jr.data(), 2, n_in, x.as<float>(), 1, ws.p, wsb, nullptr, false);
  CUDA_OK(cudaDeviceSynchronize());
  for (int j = 0; j < 2; ++j) {
    const auto a = got[static_cast<size_t>(j)]->get<float>(static_cast<size_t>(outs[j]));
    const auto b = ref[static_cast<size_t>(j)]->get<float>(static_cast<size_t>(outs[j]));
    CHECK(std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
  }
}

TEST_CASE("gpu: the 8-bit blocks left by the attention decode kernel feed matmul_group x_q8") {
  REQUIRE_DEVICE();
  // Attention of one token (32 query / 4 KV heads of 128, n_ctx 4096): written by the decode
  // kernel itself (one active cluster at position 100), or by the merge of 2 or 3 clusters'
  // partials (positions 300 and 3000 with 3 clusters of 2 blocks, one per 256 rows).
  const int32_t n_head = 32, n_head_kv = 4, hd = 128;
  const int64_t n_ctx = 4096, q_dim = n_head * hd, kv_dim = n_head_kv * hd;
  std::vector<uint16_t> kc(static_cast<size_t>(n_ctx * kv_dim));
  const auto cache = gaussian(kc.size(), 6, 1.0f);
  for (size_t i = 0; i < kc.size(); ++i) kc[i] = f32_to_fp16(cache[i]);
  Dev dq(q_dim * 4), dk(kv_dim * 4), dv(kv_dim * 4), kcache(kc.size() * 2), vcache(kc.size() * 2),
      dpos(4), out(q_dim * 4);
  dq.put(gaussian(static_cast<size_t>(q_dim), 7, 1.0f));
  dk.put(gaussian(static_cast<size_t>(kv_dim), 8, 1.0f));
  dv.put(gaussian(static_cast<size_t>(kv_dim), 9, 1.0f));
  kcache.put(kc);
  vcache.put(kc);
  const bool saved = gpu::detail::attention_cluster_decode();
  const int saved_clusters = gpu::detail::attention_decode_clusters();
  gpu::detail::attention_cluster_decode() = true;  // whatever BERTH_ATTN_CLUSTER says
  int major = 0;
  CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  size_t wsb = 0;
  for (const auto& [clusters, pos] : {std::pair{0, 100}, std::pair{3, 300}, std::pair{3, 3000}}) {
    CAPTURE(clusters);
    CAPTURE(pos);
    gpu::detail::attention_decode_clusters() = clusters;
    dpos.put(std::vector<int32_t>{pos});
    wsb = std::max(gpu::matmul_workspace_bytes(GgmlType::Q4_K, q_dim, 515, 1),
                   gpu::attention_workspace_bytes(1, n_ctx, n_head, n_head_kv, hd));
    Dev ws(wsb);
    const bool wrote =
        gpu::attention(dq.as<float>(), dk.as<float>(), dv.as<float>(), 1, dpos.as<int32_t>(),
                       kcache.as<uint16_t>(), vcache.as<uint16_t>(), n_ctx, n_head, n_head_kv, hd,
                       0.088f, out.as<float>(), ws.p, wsb, nullptr, ws.p);
    CHECK(wrote == (major >= 9));  // the cluster decode kernel (or its merge) writes them
    if (wrote) check_x_q8("attention", q_dim, out, ws, wsb, static_cast<uint64_t>(pos));
  }
  gpu::detail::attention_cluster_decode() = saved;
  gpu::detail::attention_decode_clusters() = saved_clusters;
  Dev ws(wsb);
  // x_q8 serves one token only.
  const MatmulJob job{GgmlType::Q4_K, ws.p, 1, out.as<float>()};
  CHECK_THROWS_AS(gpu::matmul_group(&job, 1, 256, out.as<float>(), 2, ws.p, wsb, nullptr, true),
                  Error);
}

TEST_CASE("gpu embed: rows equal to ref::dequantize_row, zero rows for bad ids") {
  REQUIRE_DEVICE();
  const int64_t n_vocab = 37;
  const std::vector<int32_t> tokens = {0, 36, 5, 5, -1, 37, 12, 1000};
  for (GgmlType t : kAll) {
    CAPTURE(type_name(t));
    const int64_t bs = traits(t).block_size;
    for (int64_t n : {bs == 1 ? int64_t{40} : bs, bs == 1 ? int64_t{264} : 3 * bs}) {
      CAPTURE(n);
      const auto wq = make_weights(t, n_vocab, n, 77 + static_cast<uint64_t>(n));
      std::vector<float> ref(static_cast<size_t>(n_vocab * n));
      ref::dequantize_rows(t, wq.data(), ref.data(), n_vocab, n);
      Dev dw(wq.size()), dt(tokens.size() * 4), dout(tokens.size() * static_cast<size_t>(n) * 4);
      dw.put(wq);
      dt.put(tokens);
      dout.poison();
      gpu::embed(t, dw.p, n, n_vocab, dt.as<int32_t>(), static_cast<int64_t>(tokens.size()),
                 dout.as<float>(), nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      const auto got = dout.get<float>(tokens.size() * static_cast<size_t>(n));
      for (size_t i = 0; i < tokens.size(); ++i) {
        CAPTURE(i);
        const int32_t id = tokens[i];
        std::vector<float> want(static_cast<size_t>(n), 0.0f);
        if (id >= 0 && id < n_vocab)
          std::memcpy(want.data(), &ref[static_cast<size_t>(id) * n], static_cast<size_t>(n) * 4);
        // == rather than memcmp: the reference may produce -0 where the kernel gives +0.
        bool same = true;
        for (int64_t c = 0; c < n; ++c)
          same = same && got[i * static_cast<size_t>(n) + static_cast<size_t>(c)] ==
                             want[static_cast<size_t>(c)];
        CHECK(same);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// MoE

struct MoeCase {
  GgmlType gate_t, up_t, down_t;
  int64_t n_embd = 256, n_ff = 512;
  int n_expert = 8, k = 3;
  std::vector<uint8_t> gq, uq, dq;  // stacked expert weights
  std::vector<double> G, U, D;      // decoded
  Dev *dg = nullptr, *du = nullptr, *dd = nullptr;

  MoeCase(GgmlType g, GgmlType u, GgmlType d) : gate_t(g), up_t(u), down_t(d) {
    gq = make_weights(g, n_expert * n_ff, n_embd, 11);
    uq = make_weights(u, n_expert * n_ff, n_embd, 22000);
    dq = make_weights(d, n_expert * n_embd, n_ff, 33000);
    G = decode(g, gq, n_expert * n_ff, n_embd);
    U = decode(u, uq, n_expert * n_ff, n_embd);
    D = decode(d, dq, n_expert * n_embd, n_ff);
    dg = new Dev(gq.size());
    du = new Dev(uq.size());
    dd = new Dev(dq.size());
    dg->put(gq);
    du->put(uq);
    dd->put(dq);
  }
  ~MoeCase() {
    delete dg;
    delete du;
    delete dd;
  }
  gpu::MoeWeights weights() const {
    gpu::MoeWeights w{};
    w.gate_type = gate_t;
    w.up_type = up_t;
    w.down_type = down_t;
    w.gate = dg->p;
    w.up = du->p;
    w.down = dd->p;
    w.n_embd = n_embd;
    w.n_ff = n_ff;
    w.n_expert = n_expert;
    w.n_expert_used = k;
    return w;
  }
  // Token t picks experts (t + 3j) % 7, j < 3: tokens share experts, expert 7 is never picked.
  std::vector<float> route(int64_t n_tok) const {
    std::vector<float> r(static_cast<size_t>(n_tok * 2 * k));
    std::mt19937_64 rng(5);
    std::uniform_real_distribution<float> u(0.1f, 1.0f);
    for (int64_t t = 0; t < n_tok; ++t)
      for (int j = 0; j < k; ++j) {
        r[static_cast<size_t>(t * 2 * k + j)] = static_cast<float>((t + 3 * j) % 7);
        r[static_cast<size_t>(t * 2 * k + k + j)] = u(rng);
      }
    return r;
  }
  // Slots [s0, s1) of each token (s1 -1: all).
  std::vector<double> reference(const std::vector<float>& h, const std::vector<float>& r,
                                int64_t n_tok, const std::vector<uint8_t>& mask, int s0 = 0,
                                int s1 = -1) const {
    std::vector<double> out(static_cast<size_t>(n_tok * n_embd), 0.0);
    std::vector<double> a(static_cast<size_t>(n_ff));
    for (int64_t t = 0; t < n_tok; ++t)
      for (int j = s0; j < (s1 < 0 ? k : s1); ++j) {
        const int e = static_cast<int>(r[static_cast<size_t>(t * 2 * k + j)]);
        if (!mask[static_cast<size_t>(e)]) continue;
        const double wt = r[static_cast<size_t>(t * 2 * k + k + j)];
        for (int64_t f = 0; f < n_ff; ++f) {
          double g = 0, u = 0;
          const size_t row = static_cast<size_t>((e * n_ff + f) * n_embd);
          for (int64_t i = 0; i < n_embd; ++i) {
            g += G[row + i] * h[static_cast<size_t>(t * n_embd + i)];
            u += U[row + i] * h[static_cast<size_t>(t * n_embd + i)];
          }
          a[static_cast<size_t>(f)] = g / (1.0 + std::exp(-g)) * u;
        }
        for (int64_t c = 0; c < n_embd; ++c) {
          double y = 0;
          const size_t row = static_cast<size_t>((e * n_embd + c) * n_ff);
          for (int64_t f = 0; f < n_ff; ++f) y += D[row + f] * a[static_cast<size_t>(f)];
          out[static_cast<size_t>(t * n_embd + c)] += wt * y;
        }
      }
    return out;
  }
};

// Runs moe_experts with the decode (GEMV) or prefill (grouped GEMM) path forced; `w` (default:
// mc's device copy) may point at pinned host memory.
std::vector<float> run_moe(const MoeCase& mc, const Dev& h, const Dev& route, int64_t n_tok,
                           const std::vector<uint8_t>& mask, bool decode_path,
                           const gpu::MoeSlots& slots = {},
                           const gpu::MoeWeights* weights = nullptr) {
  gpu::detail::moe_gemv_max_tok() = decode_path ? 1 << 30 : 0;
  const auto w = weights ? *weights : mc.weights();
  const size_t wsb = gpu::moe_workspace_bytes(w, n_tok, slots);
  Dev ws(wsb), dm(mask.size()), out(static_cast<size_t>(n_tok * mc.n_embd) * 4);
  dm.put(mask);
  out.poison();
  ws.poison();
  gpu::moe_experts(w, h.as<float>(), route.as<float>(), n_tok, dm.as<uint8_t>(), out.as<float>(),
                   ws.p, wsb, nullptr, slots);
  CUDA_OK(cudaDeviceSynchronize());
  return out.get<float>(static_cast<size_t>(n_tok * mc.n_embd));
}

// One call's inputs: h [n_tok, n_embd] (normal, sd 1, mean 0.05, from `seed`) and mc's route,
// on the host and on the device.
struct MoeInputs {
  std::vector<float> h, r;
  Dev dh, dr;
  MoeInputs(const MoeCase& mc, int64_t n_tok, uint64_t seed)
      : h(gaussian(static_cast<size_t>(n_tok * mc.n_embd), seed, 1.0f, 0.05f)),
        r(mc.route(n_tok)),
        dh(h.size() * 4),
        dr(r.size() * 4) {
    dh.put(h);
    dr.put(r);
  }
};

// Decode: h and the SwiGLU output rounded to int8 per 32 (two stages of the GEMV bound).
constexpr double kTolMoeDecode = 3e-4;
// Prefill: h, the weights and the SwiGLU output rounded to f16.
constexpr double kTolMoePrefill = 2e-5;
// Two complementary masks vs the full mask: the slot sums regrouped (f32 rounding only).
constexpr double kTolMoeSplit = 1e-10;

TEST_CASE("gpu moe_experts: both paths against the CPU reference, masks, determinism") {
  REQUIRE_DEVICE();
  const int saved = gpu::detail::moe_gemv_max_tok();
  const bool saved_mma = gpu::detail::moe_gemm_mma();
  const bool saved_int8 = gpu::detail::moe_gemm_int8();
  const bool saved_wgmma = gpu::detail::moe_gemm_wgmma();
  MESSAGE("wgmma kernel runs on this device: " << gpu::detail::moe_wgmma_runs());
  struct Types {
    GgmlType g, u, d;
  };
  // The grouped GEMM on its kernels: mma.sync on f16 (n_embd 256 and n_ff 512 are multiples of
  // 64), wgmma on f16 (where this build's sm_90a code runs; else the mma.sync kernel again),
  // mma.sync on int8 (every quantized type: scales per 32 and per 16; the F16 case falls back to
  // f16), and WMMA.
  enum class Gemm { mma_f16, wgmma_f16, mma_int8, wmma };
  for (const Gemm gemm : {Gemm::mma_f16, Gemm::wgmma_f16, Gemm::mma_int8, Gemm::wmma})
    for (Types ty : {Types{GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q6_K},
                     Types{GgmlType::Q8_0, GgmlType::F16, GgmlType::Q4_0},
                     Types{GgmlType::Q8_0, GgmlType::Q5_K, GgmlType::Q3_K},
                     Types{GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q2_K},
                     Types{GgmlType::Q5_1, GgmlType::Q4_0, GgmlType::Q8_0}}) {
      const bool mma = gemm != Gemm::wmma;
      const bool int8 = gemm == Gemm::mma_int8;
      // The f16 and WMMA kernels ran every type in the matmul oracle; here the first two type
      // sets cover them, the others the int8 kernel's decoding.
      if (!int8 && ty.u != GgmlType::F16 && ty.g != GgmlType::Q4_K) continue;
      gpu::detail::moe_gemm_mma() = mma;
      gpu::detail::moe_gemm_int8() = int8;
      gpu::detail::moe_gemm_wgmma() = gemm == Gemm::wgmma_f16;
      CAPTURE(gemm == Gemm::wgmma_f16);
      // The int8 kernel rounds h and the SwiGLU output to 8 bits per 32, as the decode path does.
      const bool int8_here = int8 && ty.u != GgmlType::F16;
      MoeCase mc(ty.g, ty.u, ty.d);
      CAPTURE(mma);
      CAPTURE(int8_here);
      CAPTURE(type_name(ty.g));
      CAPTURE(type_name(ty.u));
      CAPTURE(type_name(ty.d));
      const std::vector<uint8_t> all(8, 1), keep = {0, 1, 0, 0, 1, 1, 0, 0},
                                            rest = {1, 0, 1, 1, 0, 0, 1, 1};
      for (int64_t n_tok : {int64_t{1}, int64_t{2}, int64_t{512}}) {
        CAPTURE(n_tok);
        const MoeInputs in(mc, n_tok, 900 + static_cast<uint64_t>(n_tok));
        const auto &h = in.h, &r = in.r;
        const Dev &dh = in.dh, &dr = in.dr;
        const auto ref_all = mc.reference(h, r, n_tok, all);
        const auto ref_keep = mc.reference(h, r, n_tok, keep);
        for (bool dec : {true, false}) {
          CAPTURE(dec);
          const double tol = dec || int8_here ? kTolMoeDecode : kTolMoePrefill;
          const auto full = run_moe(mc, dh, dr, n_tok, all, dec);
          const double e_full = nmse_d(ref_all, full);
          CAPTURE(e_full);
          CHECK(e_full <= tol);
          const auto a = run_moe(mc, dh, dr, n_tok, keep, dec);
          const double e_keep = nmse_d(ref_keep, a);
          CAPTURE(e_keep);
          CHECK(e_keep <= tol);
          // Token 0 picks experts 0, 3, 6, all masked out by `keep`: an exact zero row.
          bool zero = true;
          for (int64_t c = 0; c < mc.n_embd; ++c) zero = zero && a[static_cast<size_t>(c)] == 0.0f;
          CHECK(zero);
          const auto b = run_moe(mc, dh, dr, n_tok, rest, dec);
          std::vector<float> sum(a.size());
          for (size_t i = 0; i < a.size(); ++i) sum[i] = a[i] + b[i];
          const double e_split = nmse(full.data(), sum.data(), sum.size());
          CAPTURE(e_split);
          CHECK(e_split <= kTolMoeSplit);
          const auto again = run_moe(mc, dh, dr, n_tok, all, dec);
          CHECK(std::memcmp(full.data(), again.data(), full.size() * 4) == 0);
        }
      }
    }
  gpu::detail::moe_gemm_mma() = saved_mma;
  gpu::detail::moe_gemm_int8() = saved_int8;
  gpu::detail::moe_gemm_wgmma() = saved_wgmma;
  gpu::detail::moe_gemv_max_tok() = saved;
}

// Pinned host memory holding a copy of `v` (cudaMallocHost: device-readable through UVA).
struct Pinned {
  void* p = nullptr;
  explicit Pinned(const std::vector<uint8_t>& v) {
    CUDA_OK(cudaMallocHost(&p, v.size()));
    std::memcpy(p, v.data(), v.size());
  }
  ~Pinned() { cudaFreeHost(p); }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
};

TEST_CASE("gpu moe_experts: slot ranges, and experts staged from pinned host memory") {
  REQUIRE_DEVICE();
  const int saved = gpu::detail::moe_gemv_max_tok();
  MoeCase mc(GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q6_K);
  const std::vector<uint8_t> all(8, 1), keep = {0, 1, 0, 0, 1, 1, 0, 0};
  Pinned hg(mc.gq), hu(mc.uq), hd(mc.dq);
  gpu::MoeWeights hw = mc.weights();
  hw.gate = hg.p;
  hw.up = hu.p;
  hw.down = hd.p;
  for (int64_t n_tok : {int64_t{1}, int64_t{2}, int64_t{512}}) {
    CAPTURE(n_tok);
    const MoeInputs in(mc, n_tok, 700 + static_cast<uint64_t>(n_tok));
    const auto &h = in.h, &r = in.r;
    const Dev &dh = in.dh, &dr = in.dr;
    for (bool dec : {true, false}) {
      CAPTURE(dec);
      const double tol = dec ? kTolMoeDecode : kTolMoePrefill;
      const auto full = run_moe(mc, dh, dr, n_tok, all, dec);
      // Slots [0, 1) and [1, 3): each against the reference over its slots, and their sum
      // against the whole call (the slot sums regrouped).
      const auto first = run_moe(mc, dh, dr, n_tok, all, dec, {0, 1});
      const auto rest = run_moe(mc, dh, dr, n_tok, all, dec, {1, -1});
      const double e_first = nmse_d(mc.reference(h, r, n_tok, all, 0, 1), first);
      const double e_rest = nmse_d(mc.reference(h, r, n_tok, all, 1, 3), rest);
      CAPTURE(e_first);
      CAPTURE(e_rest);
      CHECK(e_first <= tol);
      CHECK(e_rest <= tol);
      std::vector<float> sum(full.size());
      for (size_t i = 0; i < sum.size(); ++i) sum[i] = first[i] + rest[i];
      CHECK(nmse(full.data(), sum.data(), sum.size()) <= kTolMoeSplit);
      // Slots and the expert mask together.
      const auto both = run_moe(mc, dh, dr, n_tok, keep, dec, {1, 3});
      const double e_both = nmse_d(mc.reference(h, r, n_tok, keep, 1, 3), both);
      CAPTURE(e_both);
      CHECK(e_both <= tol);
      // Weights read from pinned host memory: in place, or staged (one token; two tokens
      // ignore `stage`). The same kernels on the same bytes: the same bits. Only 1-2 tokens:
      // a multi-token step reading host memory in place once failed to finish on the H200
      // (hybrid.h), and staging is for one token.
      if (n_tok > 2) continue;
      // Token 0 routes slots 0, 1, 2 to experts 0, 3, 6: `keep6` drops 3 and keeps 6 (a
      // masked slot inside the staged range), `keep` drops both.
      const std::vector<uint8_t> keep6 = {1, 1, 0, 0, 1, 1, 1, 0};
      for (bool stage : {false, true}) {
        CAPTURE(stage);
        const auto host_rest = run_moe(mc, dh, dr, n_tok, all, dec, {1, -1, stage}, &hw);
        CHECK(std::memcmp(host_rest.data(), rest.data(), rest.size() * 4) == 0);
        const auto host_both = run_moe(mc, dh, dr, n_tok, keep, dec, {1, 3, stage}, &hw);
        CHECK(std::memcmp(host_both.data(), both.data(), both.size() * 4) == 0);
        const auto dev6 = run_moe(mc, dh, dr, n_tok, keep6, dec, {1, 3});
        const auto host6 = run_moe(mc, dh, dr, n_tok, keep6, dec, {1, 3, stage}, &hw);
        CHECK(std::memcmp(host6.data(), dev6.data(), dev6.size() * 4) == 0);
        CHECK(nmse_d(mc.reference(h, r, n_tok, keep6, 1, 3), host6) <= tol);
        const auto dev01 = run_moe(mc, dh, dr, n_tok, all, dec, {0, 2});
        const auto host01 = run_moe(mc, dh, dr, n_tok, all, dec, {0, 2, stage}, &hw);
        CHECK(std::memcmp(host01.data(), dev01.data(), dev01.size() * 4) == 0);
        CHECK(nmse_d(mc.reference(h, r, n_tok, all, 0, 2), host01) <= tol);
      }
    }
  }
  {
    // That staging ran: the staged down matrices are the workspace's last bytes (MoeLayout),
    // in slot order: slots 1 and 2 of token 0 are experts 3 and 6.
    gpu::detail::moe_gemv_max_tok() = 1 << 30;
    const MoeInputs in(mc, 1, 701);
    Dev dm(8), out(static_cast<size_t>(mc.n_embd) * 4);
    dm.put(all);
    const gpu::MoeSlots slots{1, 3, true};
    const size_t wsb = gpu::moe_workspace_bytes(hw, 1, slots);
    Dev ws(wsb);
    ws.poison();
    gpu::moe_experts(hw, in.dh.as<float>(), in.dr.as<float>(), 1, dm.as<uint8_t>(), out.as<float>(),
                     ws.p, wsb, nullptr, slots);
    CUDA_OK(cudaDeviceSynchronize());
    const size_t db = row_bytes(GgmlType::Q6_K, mc.n_ff) * static_cast<size_t>(mc.n_embd);
    REQUIRE(2 * db % 256 == 0);  // so the region's end is the workspace's end
    const auto got = ws.get<uint8_t>(wsb);
    CHECK(std::memcmp(got.data() + wsb - 2 * db, mc.dq.data() + 3 * db, db) == 0);
    CHECK(std::memcmp(got.data() + wsb - db, mc.dq.data() + 6 * db, db) == 0);
  }
  // Staging (decode path, one token) needs room for the selected experts' matrices.
  gpu::detail::moe_gemv_max_tok() = 1 << 30;
  const gpu::MoeWeights w = mc.weights();
  const size_t one = row_bytes(GgmlType::Q4_K, mc.n_embd) * static_cast<size_t>(2 * mc.n_ff) +
                     row_bytes(GgmlType::Q6_K, mc.n_ff) * static_cast<size_t>(mc.n_embd);
  CHECK(gpu::moe_workspace_bytes(w, 1, {1, 3, true}) >= gpu::moe_workspace_bytes(w, 1) + 2 * one);
  CHECK(gpu::moe_workspace_bytes(w, 2, {1, 3, true}) == gpu::moe_workspace_bytes(w, 2));
  // Bad slot ranges are refused by name.
  for (const auto& bad :
       {gpu::MoeSlots{2, 2}, gpu::MoeSlots{-1, 2}, gpu::MoeSlots{0, 4}, gpu::MoeSlots{3, -1}}) {
    CAPTURE(bad.begin);
    CAPTURE(bad.end);
    CHECK_THROWS_WITH_AS(gpu::moe_workspace_bytes(w, 1, bad), doctest::Contains("slots"), Error);
  }
  gpu::detail::moe_gemv_max_tok() = saved;
}

TEST_CASE("gpu moe_experts decode: the fused launches give the five launches' bits") {
  REQUIRE_DEVICE();
  const int saved = gpu::detail::moe_gemv_max_tok();
  const bool saved_fused = gpu::detail::moe_gemv_fused();
  struct Types {
    GgmlType g, d;
  };
  const std::vector<uint8_t> all(8, 1), keep = {0, 1, 0, 0, 1, 1, 0, 0},
                                        rest = {1, 0, 1, 1, 0, 0, 1, 1};
  for (Types ty : {Types{GgmlType::Q4_K, GgmlType::Q6_K}, Types{GgmlType::Q8_0, GgmlType::Q4_0},
                   Types{GgmlType::Q2_K, GgmlType::Q3_K}, Types{GgmlType::Q5_1, GgmlType::Q8_0}}) {
    MoeCase mc(ty.g, ty.g, ty.d);
    CAPTURE(type_name(ty.g));
    CAPTURE(type_name(ty.d));
    Pinned hg(mc.gq), hu(mc.uq), hd(mc.dq);
    gpu::MoeWeights hw = mc.weights();
    hw.gate = hg.p;
    hw.up = hu.p;
    hw.down = hd.p;
    for (int64_t n_tok : {int64_t{1}, int64_t{2}, int64_t{7}, int64_t{40}}) {
      CAPTURE(n_tok);
      const MoeInputs in(mc, n_tok, 300 + static_cast<uint64_t>(n_tok));
      for (const auto* mask : {&all, &keep, &rest})
        for (const gpu::MoeSlots sl : {gpu::MoeSlots{}, gpu::MoeSlots{0, 1}, gpu::MoeSlots{1, -1},
                                       gpu::MoeSlots{1, 3}, gpu::MoeSlots{1, 3, true}}) {
          CAPTURE(sl.begin);
          CAPTURE(sl.end);
          CAPTURE(sl.stage);
          const gpu::MoeWeights* w = sl.stage ? &hw : nullptr;
          gpu::detail::moe_gemv_fused() = false;
          const auto five = run_moe(mc, in.dh, in.dr, n_tok, *mask, true, sl, w);
          gpu::detail::moe_gemv_fused() = true;
          const auto two = run_moe(mc, in.dh, in.dr, n_tok, *mask, true, sl, w);
          CHECK(std::memcmp(five.data(), two.data(), five.size() * 4) == 0);
          // And again: the counts the first call left behind do not leak into the second.
          const auto again = run_moe(mc, in.dh, in.dr, n_tok, *mask, true, sl, w);
          CHECK(std::memcmp(two.data(), again.data(), two.size() * 4) == 0);
        }
    }
  }
  gpu::detail::moe_gemv_fused() = saved_fused;
  gpu::detail::moe_gemv_max_tok() = saved;
}

TEST_CASE("gpu moe_experts decode: pairs grouped by expert keep each row's bits alone") {
  REQUIRE_DEVICE();
  const int saved = gpu::detail::moe_gemv_max_tok();
  const bool saved_group = gpu::detail::moe_gemv_group();
  struct Types {
    GgmlType g, u, d;
  };
  const std::vector<uint8_t> all(8, 1), keep = {0, 1, 0, 0, 1, 1, 0, 0};
  // K-quants on the unit kernel, the group kernel's types, and a float up matrix (its GEMV stays
  // one pair per block beside the grouped gate and down).
  for (Types ty : {Types{GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q6_K},
                   Types{GgmlType::Q5_K, GgmlType::Q5_K, GgmlType::Q5_K},
                   Types{GgmlType::Q8_0, GgmlType::Q8_0, GgmlType::Q4_0},
                   Types{GgmlType::Q2_K, GgmlType::Q2_K, GgmlType::Q3_K},
                   Types{GgmlType::Q8_0, GgmlType::F16, GgmlType::Q5_1}}) {
    MoeCase mc(ty.g, ty.u, ty.d);
    CAPTURE(type_name(ty.g));
    CAPTURE(type_name(ty.u));
    CAPTURE(type_name(ty.d));
    // 7 and 40 tokens: experts shared by up to 3 and 18 pairs (tiles of 4, a last partial one).
    for (int64_t n_tok : {int64_t{2}, int64_t{7}, int64_t{40}}) {
      CAPTURE(n_tok);
      const MoeInputs in(mc, n_tok, 700 + static_cast<uint64_t>(n_tok));
      for (const auto* mask : {&all, &keep})
        for (const gpu::MoeSlots sl : {gpu::MoeSlots{}, gpu::MoeSlots{1, 3}}) {
          CAPTURE(mask == &keep);
          CAPTURE(sl.begin);
          gpu::detail::moe_gemv_group() = false;
          const auto by_pair = run_moe(mc, in.dh, in.dr, n_tok, *mask, true, sl);
          gpu::detail::moe_gemv_group() = true;
          const auto grouped = run_moe(mc, in.dh, in.dr, n_tok, *mask, true, sl);
          CHECK(std::memcmp(by_pair.data(), grouped.data(), by_pair.size() * 4) == 0);
          // Every token alone (one pair per block) gives its row of the grouped step.
          bool alone_same = true;
          for (int64_t t = 0; t < n_tok; ++t) {
            Dev h1(static_cast<size_t>(mc.n_embd) * 4), r1(static_cast<size_t>(2 * mc.k) * 4);
            h1.put(std::vector<float>(in.h.begin() + t * mc.n_embd,
                                      in.h.begin() + (t + 1) * mc.n_embd));
            r1.put(
                std::vector<float>(in.r.begin() + t * 2 * mc.k, in.r.begin() + (t + 1) * 2 * mc.k));
            const auto one = run_moe(mc, h1, r1, 1, *mask, true, sl);
            alone_same = alone_same && std::memcmp(one.data(), grouped.data() + t * mc.n_embd,
                                                   one.size() * 4) == 0;
          }
          CHECK(alone_same);
        }
    }
  }
  gpu::detail::moe_gemv_group() = saved_group;
  gpu::detail::moe_gemv_max_tok() = saved;
}

// ---------------------------------------------------------------------------------------------
// Speeds (printed, never asserted). Run with: test_gpu --no-skip -tc='*timing*'

// The MoE layer of synthetic qwen3-30b-a3b Q4_K_M: 128 experts, 8 used, 2048 -> 768 -> 2048,
// Q4_K gate/up, Q6_K down; no pointers.
gpu::MoeWeights qwen3_30b_moe_shape() {
  gpu::MoeWeights w{};
  w.gate_type = w.up_type = GgmlType::Q4_K;
  w.down_type = GgmlType::Q6_K;
  w.n_embd = 2048;
  w.n_ff = 768;
  w.n_expert = 128;
  w.n_expert_used = 8;
  return w;
}

template <class F>
double time_ms(F&& f, int reps = 20) {
  f();
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a);
  for (int i = 0; i < reps; ++i) f();
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / reps;
}

bool is_kq_type(GgmlType t) {
  return t == GgmlType::Q4_K || t == GgmlType::Q5_K || t == GgmlType::Q6_K;
}

TEST_CASE("gpu matmul timing" * doctest::skip()) {
  REQUIRE_DEVICE();
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  const int saved = gpu::detail::gemv_max_tok(), saved_f = gpu::detail::gemv_max_tok_float(),
            saved_moe = gpu::detail::moe_gemv_max_tok();
  auto bench = [&](GgmlType t, int64_t n_in, int64_t n_out, int64_t n_tok, bool gemv) {
    gpu::detail::gemv_max_tok() = gpu::detail::gemv_max_tok_float() = gemv ? 1 << 30 : 0;
    const size_t wb = row_bytes(t, n_in) * static_cast<size_t>(n_out);
    Dev w(wb), x(static_cast<size_t>(n_tok * n_in) * 4), o(static_cast<size_t>(n_tok * n_out) * 4);
    CUDA_OK(cudaMemset(w.p, 0x11, wb));
    x.put(gaussian(static_cast<size_t>(n_tok * n_in), 3));
    const size_t wsb = gpu::matmul_workspace_bytes(t, n_in, n_out, n_tok);
    Dev ws(wsb);
    const double ms = time_ms([&] {
      gpu::matmul(t, w.p, n_in, n_out, x.as<float>(), n_tok, o.as<float>(), ws.p, wsb, nullptr);
    });
    CUDA_OK(cudaDeviceSynchronize());
    return std::pair<double, double>(ms, wb / ms / 1e6);  // ms, GB/s of weights
  };
  // Decode GEMV bandwidth: the stacked 128 experts of a 2048 -> 768 layer as one matrix.
  for (GgmlType t : {GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K,
                     GgmlType::Q3_K, GgmlType::F16, GgmlType::BF16}) {
    for (int64_t nt : {1, 8})
      for (const bool kq : {false, true}) {
        const bool saved_kq = gpu::detail::gemv_kq();
        gpu::detail::gemv_kq() = kq;
        const auto [ms, gbs] = bench(t, 2048, 768 * 128, nt, true);
        gpu::detail::gemv_kq() = saved_kq;
        std::printf("gemv %-5s 2048x98304 n_tok %ld%s: %.3f ms, %.0f GB/s\n",
                    std::string(type_name(t)).c_str(), static_cast<long>(nt), kq ? " kq" : "", ms,
                    gbs);
      }
  }
  // Dense decode GEMVs of the Qwen3.5 presets (27B: 5120 -> 17408 and back; the 0.8B head,
  // 1024 -> 151936), one token, through both quantized GEMV kernels (gemv_kq on, off).
  {
    const bool saved_kq = gpu::detail::gemv_kq();
    struct Shape {
      GgmlType t;
      int64_t n_in, n_out;
    };
    for (const Shape& sh :
         {Shape{GgmlType::Q4_K, 5120, 17408}, Shape{GgmlType::Q4_K, 5120, 34816},
          Shape{GgmlType::Q4_K, 17408, 5120}, Shape{GgmlType::Q6_K, 17408, 5120},
          Shape{GgmlType::Q5_K, 5120, 10240}, Shape{GgmlType::Q4_K, 5120, 5120},
          Shape{GgmlType::Q4_K, 2560, 9728}, Shape{GgmlType::Q4_K, 1024, 3584},
          Shape{GgmlType::Q6_K, 1024, 151936}, Shape{GgmlType::Q6_K, 5120, 151936},
          Shape{GgmlType::F32, 5120, 48}, Shape{GgmlType::F32, 1024, 16}}) {
      // Copies of the matrix, at least 512 MB in all, taken in turn: reads come from HBM, not
      // from the 50 MB L2.
      gpu::detail::gemv_max_tok() = 1 << 30;
      const size_t wb = row_bytes(sh.t, sh.n_in) * static_cast<size_t>(sh.n_out);
      const int copies = static_cast<int>(std::max<size_t>(1, (size_t{512} << 20) / wb + 1));
      std::vector<std::unique_ptr<Dev>> ws_;
      for (int c = 0; c < copies; ++c) {
        ws_.push_back(std::make_unique<Dev>(wb));
        CUDA_OK(cudaMemset(ws_.back()->p, 0x11, wb));
      }
      Dev x(static_cast<size_t>(sh.n_in) * 4), o(static_cast<size_t>(sh.n_out) * 4);
      x.put(gaussian(static_cast<size_t>(sh.n_in), 5));
      const size_t wsb = gpu::matmul_workspace_bytes(sh.t, sh.n_in, sh.n_out, 1);
      Dev scratch(wsb);
      // 0 the group kernel, 1 the K-quant kernel, 2 its lanes rule 1, 3 and 4 its launch bounds
      // of 7 and 8 blocks per SM (gemv_kq_minb).
      for (const int variant : {0, 1, 2, 3, 4}) {
        const bool kq = variant > 0;
        if (variant >= 2 && !is_kq_type(sh.t)) continue;
        gpu::detail::gemv_kq() = kq;
        const int saved_lanes = gpu::detail::gemv_kq_lanes();
        const int saved_minb = gpu::detail::gemv_kq_minb();
        gpu::detail::gemv_kq_lanes() = variant == 2 ? 1 : 0;
        gpu::detail::gemv_kq_minb() = variant == 3 ? 7 : variant == 4 ? 8 : 0;
        int c = 0;
        const double ms = time_ms(
            [&] {
              gpu::matmul(sh.t, ws_[static_cast<size_t>(c)]->p, sh.n_in, sh.n_out, x.as<float>(), 1,
                          o.as<float>(), scratch.p, wsb, nullptr);
              c = (c + 1) % copies;
            },
            200);
        CUDA_OK(cudaDeviceSynchronize());
        gpu::detail::gemv_kq_lanes() = saved_lanes;
        gpu::detail::gemv_kq_minb() = saved_minb;
        static const char* const kName[] = {"group", "kq   ", "kq-p2", "kq-b7", "kq-b8"};
        std::printf("gemv %-5s %ldx%ld n_tok 1 %s: %.4f ms, %.0f GB/s\n",
                    std::string(type_name(sh.t)).c_str(), static_cast<long>(sh.n_in),
                    static_cast<long>(sh.n_out), kName[variant], ms, wb / ms / 1e6);
      }
      gpu::detail::gemv_max_tok() = saved;
    }
    gpu::detail::gemv_kq() = saved_kq;
  }
  // Crossover GEMV (token chunks of 8) vs dequantize + cuBLAS.
  for (GgmlType t : {GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::F16})
    for (int64_t nt : {8, 16, 24, 32, 48, 64}) {
      const double g = bench(t, 4096, 4096, nt, true).first;
      const double m = bench(t, 4096, 4096, nt, false).first;
      std::printf("crossover %-5s 4096x4096 n_tok %2ld: gemv %.3f ms, gemm %.3f ms\n",
                  std::string(type_name(t)).c_str(), static_cast<long>(nt), g, m);
    }
  {
    const double m = bench(GgmlType::Q6_K, 2048, 151936, 512, false).first;
    std::printf("gemm q6_K 2048x151936 n_tok 512: %.3f ms, %.0f TFLOP/s\n", m,
                2.0 * 2048 * 151936 * 512 / m / 1e9);
    const double m2 = bench(GgmlType::Q4_K, 4096, 4096, 512, false).first;
    std::printf("gemm q4_K 4096x4096 n_tok 512: %.3f ms, %.0f TFLOP/s\n", m2,
                2.0 * 4096 * 4096 * 512 / m2 / 1e9);
  }
  // MoE layer: 128 experts, 8 used, 2048 -> 768 -> 2048, Q4_K gate/up, Q6_K down.
  {
    gpu::MoeWeights w = qwen3_30b_moe_shape();
    const size_t gb = row_bytes(GgmlType::Q4_K, 2048) * 768 * 128,
                 db = row_bytes(GgmlType::Q6_K, 768) * 2048 * 128;
    Dev g(gb), u(gb), d(db);
    CUDA_OK(cudaMemset(g.p, 0x11, gb));
    CUDA_OK(cudaMemset(u.p, 0x11, gb));
    CUDA_OK(cudaMemset(d.p, 0x11, db));
    w.gate = g.p;
    w.up = u.p;
    w.down = d.p;
    std::vector<uint8_t> mask(128, 1);
    Dev dm(128);
    dm.put(mask);
    for (int64_t nt : {1, 4, 8, 16, 32, 64, 512}) {
      std::mt19937_64 rng(static_cast<uint64_t>(nt));
      std::vector<float> r(static_cast<size_t>(nt * 16));
      for (int64_t t = 0; t < nt; ++t) {
        std::vector<int> ids(128);
        for (int i = 0; i < 128; ++i) ids[static_cast<size_t>(i)] = i;
        std::shuffle(ids.begin(), ids.end(), rng);
        for (int j = 0; j < 8; ++j) {
          r[static_cast<size_t>(t * 16 + j)] = static_cast<float>(ids[static_cast<size_t>(j)]);
          r[static_cast<size_t>(t * 16 + 8 + j)] = 0.125f;
        }
      }
      Dev dr(r.size() * 4), dh(static_cast<size_t>(nt * 2048) * 4),
          o(static_cast<size_t>(nt * 2048) * 4);
      dr.put(r);
      dh.put(gaussian(static_cast<size_t>(nt * 2048), 9));
      double ms[2];
      for (int dec = 0; dec < 2; ++dec) {
        gpu::detail::moe_gemv_max_tok() = dec ? 1 << 30 : 0;
        const size_t wsb = gpu::moe_workspace_bytes(w, nt);
        Dev ws(wsb);
        ms[dec] = time_ms([&] {
          gpu::moe_experts(w, dh.as<float>(), dr.as<float>(), nt, dm.as<uint8_t>(), o.as<float>(),
                           ws.p, wsb, nullptr);
        });
        CUDA_OK(cudaDeviceSynchronize());
      }
      std::printf("moe 128x(2048,768) k8 n_tok %3ld: gemv path %.3f ms, grouped gemm %.3f ms\n",
                  static_cast<long>(nt), ms[1], ms[0]);
    }
  }
  gpu::detail::gemv_max_tok() = saved;
  gpu::detail::gemv_max_tok_float() = saved_f;
  gpu::detail::moe_gemv_max_tok() = saved_moe;
}

TEST_CASE("gpu moe_experts timing, weights in pinned host memory" * doctest::skip()) {
  REQUIRE_DEVICE();
  // One decode token of a 128-expert, 2048 -> 768 layer (Q4_K gate/up, Q6_K down, as the
  // synthetic qwen3-30b-a3b), computing the last n of its 8 slots with the weights read over
  // PCIe: in place by the GEMVs, or staged to the workspace first.
  gpu::MoeWeights w = qwen3_30b_moe_shape();
  const size_t gb = row_bytes(GgmlType::Q4_K, 2048) * 768,
               db = row_bytes(GgmlType::Q6_K, 768) * 2048;
  void *g, *u, *d;
  CUDA_OK(cudaMallocHost(&g, gb * 128));
  CUDA_OK(cudaMallocHost(&u, gb * 128));
  CUDA_OK(cudaMallocHost(&d, db * 128));
  std::memset(g, 0x11, gb * 128);
  std::memset(u, 0x11, gb * 128);
  std::memset(d, 0x11, db * 128);
  w.gate = g;
  w.up = u;
  w.down = d;
  const int saved_moe = gpu::detail::moe_gemv_max_tok();
  gpu::detail::moe_gemv_max_tok() = 1 << 30;  // the decode path, where staging applies
  std::vector<uint8_t> mask(128, 1);
  const size_t one = 2 * gb + db;  // one expert's three matrices
  Dev dm(128), dh(2048 * 4), o(2048 * 4), copy(one);
  dm.put(mask);
  dh.put(gaussian(2048, 9));
  std::mt19937_64 rng(3);
  int reps_seen = 0;
  for (int n : {1, 2, 3, 8}) {
    for (int stage = 0; stage < 2; ++stage) {
      const gpu::MoeSlots slots{8 - n, -1, stage == 1};
      const size_t wsb = gpu::moe_workspace_bytes(w, 1, slots);
      Dev ws(wsb);
      // A new route per call (distinct experts), so that no expert's bytes sit in L2.
      std::vector<std::vector<float>> routes;
      for (int rep = 0; rep < 21; ++rep) {
        std::vector<int> ids(128);
        for (int i = 0; i < 128; ++i) ids[static_cast<size_t>(i)] = i;
        std::shuffle(ids.begin(), ids.end(), rng);
        std::vector<float> r(16);
        for (int j = 0; j < 8; ++j) {
          r[static_cast<size_t>(j)] = static_cast<float>(ids[static_cast<size_t>(j)]);
          r[static_cast<size_t>(8 + j)] = 0.125f;
        }
        routes.push_back(r);
      }
      Dev dra(21 * 16 * 4);
      std::vector<float> flat;
      for (auto& r : routes) flat.insert(flat.end(), r.begin(), r.end());
      dra.put(flat);
      reps_seen = 0;
      const double ms = time_ms([&] {
        const float* rt = dra.as<float>() + 16 * (reps_seen++ % 21);
        gpu::moe_experts(w, dh.as<float>(), rt, 1, dm.as<uint8_t>(), o.as<float>(), ws.p, wsb,
                         nullptr, slots);
      });
      CUDA_OK(cudaDeviceSynchronize());
      const double bytes = static_cast<double>(n) * static_cast<double>(one);
      std::printf("moe host weights, %d of 8 slots, %s: %.1f us, %.1f GB/s of weights\n", n,
                  stage ? "staged" : "in place", ms * 1e3, bytes / ms / 1e6);
    }
  }
  const double ms =
      time_ms([&] { CUDA_OK(cudaMemcpyAsync(copy.p, g, one, cudaMemcpyHostToDevice, nullptr)); });
  std::printf("cudaMemcpy pinned -> device, one expert (%.2f MB): %.1f us, %.1f GB/s\n",
              static_cast<double>(one) / 1e6, ms * 1e3, static_cast<double>(one) / ms / 1e6);
  gpu::detail::moe_gemv_max_tok() = saved_moe;
  cudaFreeHost(g);
  cudaFreeHost(u);
  cudaFreeHost(d);
}

}  // namespace
}  // namespace berth
