// GPU kernels of gpu_kernels/kernels.h (the non-matmul ones) against the CPU path's reference
// kernels (berth::ref, berth::cpu::moe_topk) and a double-precision attention that reads the same
// f16-rounded K/V as the GPU cache. House rules as tests/core/kernel_harness.h: inputs come from
// seeded generators (never zeros), outputs are poisoned (all bits set: NaN floats, -1 ints)
// before each run so an element the kernel did not write fails, and each op's tolerance (NMSE =
// sum (gpu - ref)^2 / sum ref^2) is written next to it with its reason. Selections (moe_route,
// argmax, top_k) must match exactly.
//
// Needs a CUDA device: without one every case fails with a message saying so.
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "berth/core/fp16.h"
#include "berth/cpu_kernels/ops.h"
#include "berth/gpu_kernels/kernels.h"
#include "core/kernel_harness.h"
#include "gpu/attention_tol.h"
#include "gpu/gpu_test_util.h"

namespace berth {
namespace {

// Tolerances, each with its reason.
// add, add_bias: one IEEE addition per element on both sides: exact.
constexpr double kTolAdd = 0.0;
// rms_norm: both sum squares in double (in another order); the float scale can differ by one
// rounding.
constexpr double kTolRmsNorm = 1e-13;
// swiglu: the device expf and the host's differ by at most a couple of ulp, damped by 1/(1+e).
constexpr double kTolSwiglu = 1e-13;
// rope: angles in double on both sides (device pow/sincos vs libm, rounded to float), products
// rounded one by one (no FMA contraction) on the device.
constexpr double kTolRope = 1e-13;
// attention: tests/gpu/attention_tol.h.
using test::attention_tol;
using test::kTolAttention;
using test::kTolAttentionMma;

using gpu_test::ck;
using gpu_test::Dev;
using gpu_test::nmse;
using gpu_test::same_bits;
using test::gaussian;

TEST_CASE("gpu: add, add_bias, swiglu") {
  REQUIRE_DEVICE();
  for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{300000}}) {
    CAPTURE(n);
    const size_t un = static_cast<size_t>(n);
    const auto a = gaussian(un, 10 + un), b = gaussian(un, 20 + un, 2.0f, 0.5f);
    auto gate = gaussian(un, 30 + un, 4.0f);
    if (n >= 7) gate[1] = -100.0f, gate[3] = 95.0f, gate[5] = -88.5f;
    Dev<float> da(a), db(b), dg(gate), dout(un);
    std::vector<float> ref(un);

    dout.poison();
    gpu::add(da.p, db.p, dout.p, n, nullptr);
    ref::add(a.data(), b.data(), ref.data(), n);
    CHECK(nmse(ref, dout.down()) <= kTolAdd);

    dout.poison();
    gpu::swiglu(dg.p, db.p, dout.p, n, nullptr);
    ref::swiglu(gate.data(), b.data(), ref.data(), n);
    CHECK(nmse(ref, dout.down()) <= kTolSwiglu);

    // In place (out aliases a).
    Dev<float> dx(a);
    gpu::add(dx.p, db.p, dx.p, n, nullptr);
    ref::add(a.data(), b.data(), ref.data(), n);
    CHECK(nmse(ref, dx.down()) <= kTolAdd);
  }
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{1, 5}, {7, 96}, {64, 4096}}) {
    CAPTURE(rows);
    CAPTURE(cols);
    const auto x = gaussian(static_cast<size_t>(rows * cols), 40 + cols);
    const auto bias = gaussian(static_cast<size_t>(cols), 50 + cols, 0.5f, 0.2f);
    std::vector<float> ref(x.size());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) ref[r * cols + c] = x[r * cols + c] + bias[c];
    Dev<float> dx(x), db(bias), dout(x.size());
    dout.poison();
    gpu::add_bias(dx.p, db.p, dout.p, rows, cols, nullptr);
    CHECK(nmse(ref, dout.down()) <= kTolAdd);
    gpu::add_bias(dx.p, db.p, dx.p, rows, cols, nullptr);  // in place
    CHECK(nmse(ref, dx.down()) <= kTolAdd);
  }
}

TEST_CASE("gpu: rms_norm, whole rows and per-head groups") {
  REQUIRE_DEVICE();
  struct Case {
    int64_t rows, cols, group;
    bool weight;
  };
  const Case cases[] = {{1, 7, 7, true},      {5, 4096, 4096, true}, {3, 1000, 1000, false},
                        {9, 4096, 128, true}, {4, 64, 8, true},      {2, 96, 32, false},
                        {2, 6000, 6000, true}};
  for (const Case& c : cases) {
    CAPTURE(c.rows);
    CAPTURE(c.cols);
    CAPTURE(c.group);
    const size_t n = static_cast<size_t>(c.rows * c.cols);
    const auto x = gaussian(n, 60 + n, 1.5f, 0.3f);
    const auto w = gaussian(static_cast<size_t>(c.group), 70 + n, 0.3f, 1.0f);
    std::vector<float> ref(n);
    for (int64_t r = 0; r < c.rows * (c.cols / c.group); ++r)
      ref::rms_norm(x.data() + r * c.group, c.weight ? w.data() : nullptr, ref.data() + r * c.group,
                    c.group, 1e-6f);
    Dev<float> dx(x), dw(w), dout(n);
    dout.poison();
    gpu::rms_norm(dx.p, c.weight ? dw.p : nullptr, dout.p, c.rows, c.cols, c.group, 1e-6f, nullptr);
    CHECK(nmse(ref, dout.down()) <= kTolRmsNorm);
    gpu::rms_norm(dx.p, c.weight ? dw.p : nullptr, dx.p, c.rows, c.cols, c.group, 1e-6f,
                  nullptr);  // in place
    CHECK(nmse(ref, dx.down()) <= kTolRmsNorm);
  }
}

TEST_CASE("gpu: add_rms_norm equals add then rms_norm bit for bit") {
  REQUIRE_DEVICE();
  for (const int64_t cols :
       {int64_t{7}, int64_t{100}, int64_t{2048}, int64_t{4096}, int64_t{6000}}) {
    for (const bool weight : {true, false}) {
      CAPTURE(cols);
      CAPTURE(weight);
      const int64_t rows = 3;
      const size_t n = static_cast<size_t>(rows * cols);
      const auto a = gaussian(n, 80 + n, 1.5f, 0.3f), b = gaussian(n, 90 + n, 0.7f);
      const auto w = gaussian(static_cast<size_t>(cols), 95 + n, 0.3f, 1.0f);
      Dev<float> da(a), db(b), dw(w), sum1(n), out1(n), sum2(n), out2(n);
      sum1.poison(), out1.poison(), sum2.poison(), out2.poison();
      gpu::add(da.p, db.p, sum1.p, static_cast<int64_t>(n), nullptr);
      gpu::rms_norm(sum1.p, weight ? dw.p : nullptr, out1.p, rows, cols, cols, 1e-6f, nullptr);
      gpu::add_rms_norm(da.p, db.p, sum2.p, weight ? dw.p : nullptr, out2.p, rows, cols, 1e-6f,
                        nullptr);
      const auto s1 = sum1.down(), s2 = sum2.down(), o1 = out1.down(), o2 = out2.down();
      CHECK(std::memcmp(s1.data(), s2.data(), n * 4) == 0);
      CHECK(std::memcmp(o1.data(), o2.data(), n * 4) == 0);
      // The sum in place of an input (the residual stream is updated in place).
      gpu::add_rms_norm(da.p, db.p, da.p, weight ? dw.p : nullptr, out2.p, rows, cols, 1e-6f,
                        nullptr);
      const auto s3 = da.down(), o3 = out2.down();
      CHECK(std::memcmp(s1.data(), s3.data(), n * 4) == 0);
      CHECK(std::memcmp(o1.data(), o3.data(), n * 4) == 0);
    }
  }
}

TEST_CASE("gpu: norm_rope equals rms_norm then rope bit for bit (one or two tensors, in place)") {
  REQUIRE_DEVICE();
  struct Case {
    int32_t nh0, nh1, head_dim, n_rot;
  };
  // Qwen3's q/k (32 and 4 heads of 128), partial rotation, a head_dim of two slots per thread.
  const Case cases[] = {{32, 4, 128, 128}, {3, 0, 64, 32}, {5, 2, 96, 64}, {2, 3, 512, 256}};
  const std::vector<int32_t> positions = {0, 1, 17, 511, 4095};
  const int64_t rows = static_cast<int64_t>(positions.size());
  Dev<int32_t> dpos(positions);
  for (const Case& c : cases) {
    for (const bool neox : {false, true}) {
      for (const bool weight : {true, false}) {
        CAPTURE(c.nh0);
        CAPTURE(c.nh1);
        CAPTURE(c.head_dim);
        CAPTURE(neox);
        CAPTURE(weight);
        const int n_jobs = c.nh1 > 0 ? 2 : 1;
        const int32_t nh[2] = {c.nh0, c.nh1};
        std::deque<Dev<float>> x, w, sep, fused;  // Dev does not move
        std::vector<std::vector<float>> xh;
        NormRopeJob jobs[2];
        for (int j = 0; j < n_jobs; ++j) {
          const size_t n = static_cast<size_t>(rows * nh[j] * c.head_dim);
          xh.push_back(gaussian(n, 300 + n + static_cast<size_t>(j), 2.0f, 0.1f));
          x.emplace_back(xh.back());
          w.emplace_back(gaussian(static_cast<size_t>(c.head_dim), 400 + n, 0.3f, 1.0f));
          sep.emplace_back(n);
          fused.emplace_back(n);
        }
        for (int j = 0; j < n_jobs; ++j) {
          sep[j].poison(), fused[j].poison();
          const int64_t cols = static_cast<int64_t>(nh[j]) * c.head_dim;
          gpu::rms_norm(x[j].p, weight ? w[j].p : nullptr, sep[j].p, rows, cols, c.head_dim, 1e-6f,
                        nullptr);
          gpu::rope(sep[j].p, sep[j].p, rows, nh[j], c.head_dim, c.n_rot, 1e6f, neox, dpos.p,
                    nullptr);
          jobs[j] = {x[j].p, weight ? w[j].p : nullptr, fused[j].p, nh[j]};
        }
        gpu::norm_rope(jobs, n_jobs, rows, c.head_dim, 1e-6f, c.n_rot, 1e6f, neox, dpos.p, nullptr);
        for (int j = 0; j < n_jobs; ++j) {
          const auto a = sep[j].down(), b = fused[j].down();
          CHECK(std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
        }
        // In place (out == x), as the executor may place them.
        for (int j = 0; j < n_jobs; ++j) jobs[j].out = const_cast<float*>(jobs[j].x);
        gpu::norm_rope(jobs, n_jobs, rows, c.head_dim, 1e-6f, c.n_rot, 1e6f, neox, dpos.p, nullptr);
        for (int j = 0; j < n_jobs; ++j) {
          const auto a = sep[j].down(), b = x[j].down();
          CHECK(std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
        }
      }
    }
  }
  // Bad arguments name the function.
  NormRopeJob j{nullptr, nullptr, nullptr, 4};
  CHECK_THROWS_WITH(gpu::norm_rope(&j, 3, 1, 128, 1e-6f, 128, 1e4f, true, dpos.p, nullptr),
                    doctest::Contains("gpu::norm_rope"));
  CHECK_THROWS_WITH(gpu::norm_rope(&j, 1, 1, 128, 1e-6f, 127, 1e4f, true, dpos.p, nullptr),
                    doctest::Contains("n_rot"));
}

TEST_CASE("gpu: hand-off kernels copy to and from pinned memory around their flags") {
  REQUIRE_DEVICE();
  // Two values of a decode hand-off (a hidden state and a route of 8 pairs), one of them not a
  // multiple of 16 bytes (the 4-byte path).
  const size_t n0 = 2048, n1 = 13;
  const auto a = gaussian(n0, 7), b = gaussian(n1, 8);
  Dev<float> da(a), db(b);
  float* host = nullptr;
  uint32_t* flags = nullptr;
  ck(cudaHostAlloc(reinterpret_cast<void**>(&host), (n0 + n1) * 4, cudaHostAllocDefault),
     "cudaHostAlloc");
  ck(cudaHostAlloc(reinterpret_cast<void**>(&flags), 8, cudaHostAllocDefault), "cudaHostAlloc");
  std::fill(host, host + n0 + n1, std::numeric_limits<float>::quiet_NaN());
  flags[0] = flags[1] = 0;
  cudaStream_t st = nullptr;
  ck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
  // Out: the data is on the host once the flag is.
  const HostCopy out[2] = {{host, da.p, n0 * 4}, {host + n0, db.p, n1 * 4}};
  gpu::copy_out_signal(out, 2, &flags[0], 1, st);
  const auto t0 = std::chrono::steady_clock::now();
  while (std::atomic_ref<uint32_t>(flags[0]).load(std::memory_order_acquire) != 1)
    REQUIRE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
  CHECK(std::memcmp(host, a.data(), n0 * 4) == 0);
  CHECK(std::memcmp(host + n0, b.data(), n1 * 4) == 0);
  ck(cudaStreamSynchronize(st), "sync");
  // In: nothing is copied until the host's flag; then the host's new data arrives.
  Dev<float> ra(n0), rb(n1);
  ra.poison(), rb.poison();
  const HostCopy in[2] = {{ra.p, host, n0 * 4}, {rb.p, host + n0, n1 * 4}};
  gpu::wait_copy_in(&flags[1], 1, in, 2, st);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(cudaStreamQuery(st) == cudaErrorNotReady);
  for (size_t i = 0; i < n0 + n1; ++i) host[i] = -host[i];
  std::atomic_ref<uint32_t>(flags[1]).store(1, std::memory_order_release);
  ck(cudaStreamSynchronize(st), "sync");
  const auto ga = ra.down(), gb = rb.down();
  for (size_t i = 0; i < n0; ++i) REQUIRE(ga[i] == -a[i]);
  for (size_t i = 0; i < n1; ++i) REQUIRE(gb[i] == -b[i]);
  // More than four copies or a size that is not whole words: an error naming the function.
  const HostCopy five[5] = {};
  CHECK_THROWS_WITH(gpu::copy_out_signal(five, 5, &flags[0], 1, st),
                    doctest::Contains("gpu::copy_out_signal"));
  const HostCopy odd[1] = {{ra.p, host, 6}};
  CHECK_THROWS_WITH(gpu::wait_copy_in(&flags[1], 1, odd, 1, st), doctest::Contains("32-bit"));
  cudaStreamDestroy(st);
  cudaFreeHost(host);
  cudaFreeHost(flags);
}

// A non-blocking stream and 16 bytes of page-locked host memory for hand-off flags, released
// at the end of the scope.
struct HandoffRig {
  cudaStream_t st = nullptr;
  uint32_t* flags = nullptr;
  HandoffRig() {
    ck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
    ck(cudaHostAlloc(reinterpret_cast<void**>(&flags), 16, cudaHostAllocDefault), "cudaHostAlloc");
  }
  ~HandoffRig() {
    cudaStreamDestroy(st);
    cudaFreeHost(flags);
  }
  HandoffRig(const HandoffRig&) = delete;
  HandoffRig& operator=(const HandoffRig&) = delete;
};

TEST_CASE("gpu: the fused hand-offs equal moe_route + copy_out and wait_copy_in + add_rms_norm") {
  REQUIRE_DEVICE();
  const HandoffRig rig;
  cudaStream_t st = rig.st;
  uint32_t* flags = rig.flags;
  const auto wait_host = [&](uint32_t* f) {
    const auto t0 = std::chrono::steady_clock::now();
    while (std::atomic_ref<uint32_t>(*f).load(std::memory_order_acquire) != 1)
      REQUIRE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
  };
  // moe_route_signal: the route of one token (128 experts, 8 used) as moe_route computes it, and
  // on the host with a hidden state once the flag is set.
  const int32_t n_expert = 128, k = 8;
  const size_t n_h = 2048;
  const auto logits = gaussian(n_expert, 21), hid = gaussian(n_h, 22);
  Dev<float> dl(logits), dh(hid), r1(2 * k), r2(2 * k);
  gpu::moe_route(dl.p, 1, n_expert, k, true, r1.p, st);
  float* host = nullptr;
  ck(cudaHostAlloc(reinterpret_cast<void**>(&host), (n_h + 2 * k) * 4, cudaHostAllocDefault),
     "cudaHostAlloc");
  std::fill(host, host + n_h + 2 * k, std::numeric_limits<float>::quiet_NaN());
  std::fill(flags, flags + 4, 0u);
  const HostCopy out[2] = {{host, dh.p, n_h * 4}, {host + n_h, r2.p, 2 * k * 4}};
  gpu::moe_route_signal(dl.p, n_expert, k, true, r2.p, out, 2, &flags[0], 1, st);
  wait_host(&flags[0]);
  ck(cudaStreamSynchronize(st), "sync");
  const auto route1 = r1.down(), route2 = r2.down();
  CHECK(std::memcmp(route1.data(), route2.data(), 2 * k * 4) == 0);
  CHECK(std::memcmp(host, hid.data(), n_h * 4) == 0);
  CHECK(std::memcmp(host + n_h, route1.data(), 2 * k * 4) == 0);
  // wait_add_rms_norm: nothing runs before the host's flag; then the sum and norm of the host's
  // new data, bit for bit as wait_copy_in into device memory then add_rms_norm.
  const int64_t cols = 2048;
  const auto a = gaussian(static_cast<size_t>(cols), 23),
             w = gaussian(static_cast<size_t>(cols), 24);
  Dev<float> da(a), dw(w), db(static_cast<size_t>(cols)), sum1(static_cast<size_t>(cols)),
      out1(static_cast<size_t>(cols)), sum2(static_cast<size_t>(cols)),
      out2(static_cast<size_t>(cols));
  sum2.poison(), out2.poison();
  gpu::wait_add_rms_norm(&flags[1], 1, da.p, host, sum2.p, dw.p, out2.p, 1, cols, 1e-6f, st);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(cudaStreamQuery(st) == cudaErrorNotReady);
  for (size_t i = 0; i < n_h; ++i) host[i] = 0.5f * host[i] + 1.0f;
  std::atomic_ref<uint32_t>(flags[1]).store(1, std::memory_order_release);
  ck(cudaStreamSynchronize(st), "sync");
  const HostCopy in[1] = {{db.p, host, static_cast<size_t>(cols) * 4}};
  gpu::wait_copy_in(&flags[1], 1, in, 1, st);
  gpu::add_rms_norm(da.p, db.p, sum1.p, dw.p, out1.p, 1, cols, 1e-6f, st);
  ck(cudaStreamSynchronize(st), "sync");
  const auto s1 = sum1.down(), s2 = sum2.down(), o1 = out1.down(), o2 = out2.down();
  CHECK(std::memcmp(s1.data(), s2.data(), s1.size() * 4) == 0);
  CHECK(std::memcmp(o1.data(), o2.data(), o1.size() * 4) == 0);
  cudaFreeHost(host);
}

TEST_CASE("gpu: router_route_signal equals matmul + moe_route_signal bit for bit") {
  REQUIRE_DEVICE();
  const HandoffRig rig;
  cudaStream_t st = rig.st;
  uint32_t* flags = rig.flags;
  struct Case {
    int32_t n_expert, k;
    int64_t n_in;
  };
  // qwen3moe's router; an n_in of 64 (several rows per warp); more experts than warps; rows
  // of 128 lanes (4096 and 5120 inputs: 4 warps per row, gemv_store's shared sums).
  const Case cases[] = {{128, 8, 2048}, {60, 4, 64}, {256, 8, 4096}, {8, 2, 40}, {48, 4, 5120}};
  for (const GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::BF16}) {
    for (const Case& c : cases) {
      CAPTURE(type_name(t));
      CAPTURE(c.n_expert);
      CAPTURE(c.n_in);
      const auto wf = gaussian(static_cast<size_t>(c.n_expert * c.n_in), 31 + c.n_in, 0.05f);
      std::vector<uint8_t> wb;
      if (t == GgmlType::F32) {
        wb.resize(wf.size() * 4);
        std::memcpy(wb.data(), wf.data(), wb.size());
      } else {
        wb.resize(wf.size() * 2);
        for (size_t i = 0; i < wf.size(); ++i) {
          uint32_t u = 0;
          std::memcpy(&u, &wf[i], 4);
          const uint16_t h =
              t == GgmlType::F16 ? f32_to_fp16(wf[i]) : static_cast<uint16_t>(u >> 16);
          std::memcpy(wb.data() + 2 * i, &h, 2);
        }
      }
      const auto x = gaussian(static_cast<size_t>(c.n_in), 32 + c.n_in);
      Dev<uint8_t> dw(wb);
      Dev<float> dx(x), l1(static_cast<size_t>(c.n_expert)), l2(static_cast<size_t>(c.n_expert)),
          r1(static_cast<size_t>(2 * c.k)), r2(static_cast<size_t>(2 * c.k));
      const size_t ws_bytes = gpu::matmul_workspace_bytes(t, c.n_in, c.n_expert, 1);
      Dev<uint8_t> ws(std::max<size_t>(ws_bytes, 1));
      float* host = nullptr;
      const size_t nh = static_cast<size_t>(c.n_in + 2 * c.k);
      ck(cudaHostAlloc(reinterpret_cast<void**>(&host), 2 * nh * 4, cudaHostAllocDefault),
         "cudaHostAlloc");
      std::fill(host, host + 2 * nh, std::numeric_limits<float>::quiet_NaN());
      std::fill(flags, flags + 4, 0u);
      const size_t xb = static_cast<size_t>(c.n_in) * 4, rb = static_cast<size_t>(2 * c.k) * 4;
      const HostCopy out1[2] = {{host, dx.p, xb}, {host + c.n_in, r1.p, rb}};
      const HostCopy out2[2] = {{host + nh, dx.p, xb}, {host + nh + c.n_in, r2.p, rb}};
      l2.poison(), r2.poison();
      gpu::matmul(t, dw.p, c.n_in, c.n_expert, dx.p, 1, l1.p, ws.p, ws_bytes, st);
      gpu::moe_route_signal(l1.p, c.n_expert, c.k, true, r1.p, out1, 2, &flags[0], 1, st);
      gpu::router_route_signal(t, dw.p, c.n_in, dx.p, c.n_expert, c.k, true, l2.p, r2.p, out2, 2,
                               &flags[1], 1, st);
      ck(cudaStreamSynchronize(st), "sync");
      CHECK(flags[0] == 1);
      CHECK(flags[1] == 1);
      const auto a1 = l1.down(), a2 = l2.down(), b1 = r1.down(), b2 = r2.down();
      CHECK(std::memcmp(a1.data(), a2.data(), a1.size() * 4) == 0);
      CHECK(std::memcmp(b1.data(), b2.data(), b1.size() * 4) == 0);
      CHECK(std::memcmp(host, host + nh, nh * 4) == 0);
      CHECK(std::memcmp(host + c.n_in, b1.data(), rb) == 0);
      cudaFreeHost(host);
    }
  }
  // A quantized router is refused with the function's name.
  const HostCopy none[1] = {};
  CHECK_THROWS_WITH(gpu::router_route_signal(GgmlType::Q8_0, nullptr, 64, nullptr, 8, 2, true,
                                             nullptr, nullptr, none, 0, &flags[0], 1, st),
                    doctest::Contains("gpu::router_route_signal"));
}

TEST_CASE("gpu: rope, adjacent and neox, partial rotation, several positions") {
  REQUIRE_DEVICE();
  struct Case {
    int32_t n_head, head_dim, n_rot;
    float base;
  };
  const Case cases[] = {
      {4, 64, 64, 10000.0f}, {3, 128, 64, 1000000.0f}, {2, 8, 8, 10000.0f}, {5, 96, 32, 500000.0f}};
  const std::vector<int32_t> positions = {0, 1, 2, 17, 511, 4095, 32767};
  const int64_t rows = static_cast<int64_t>(positions.size());
  Dev<int32_t> dpos(positions);
  for (const Case& c : cases) {
    for (const bool neox : {false, true}) {
      CAPTURE(c.n_head);
      CAPTURE(c.head_dim);
      CAPTURE(c.n_rot);
      CAPTURE(neox);
      const int64_t cols = static_cast<int64_t>(c.n_head) * c.head_dim;
      const auto x = gaussian(static_cast<size_t>(rows * cols), 80 + cols + c.n_rot);
      // The reference: the CPU backend's table (angles in double, rounded to float) and
      // ref::rope_inplace.
      std::vector<float> ref = x;
      const int32_t half = c.n_rot / 2;
      std::vector<float> cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
      for (int64_t r = 0; r < rows; ++r) {
        for (int32_t i = 0; i < half; ++i) {
          const double theta = static_cast<double>(positions[static_cast<size_t>(r)]) *
                               std::pow(static_cast<double>(c.base), -2.0 * i / c.n_rot);
          cs[static_cast<size_t>(i)] = static_cast<float>(std::cos(theta));
          sn[static_cast<size_t>(i)] = static_cast<float>(std::sin(theta));
        }
        ref::rope_inplace(ref.data() + r * cols, c.n_head, c.head_dim, c.n_rot, cs.data(),
                          sn.data(), !neox);
      }
      Dev<float> dx(x), dout(x.size());
      dout.poison();
      gpu::rope(dx.p, dout.p, rows, c.n_head, c.head_dim, c.n_rot, c.base, neox, dpos.p, nullptr);
      CHECK(nmse(ref, dout.down()) <= kTolRope);
      gpu::rope(dx.p, dx.p, rows, c.n_head, c.head_dim, c.n_rot, c.base, neox, dpos.p, nullptr);
      CHECK(nmse(ref, dx.down()) <= kTolRope);
    }
  }
}

// ---- attention --------------------------------------------------------------------------------

struct AttnShape {
  int32_t n_head, n_head_kv, head_dim;
};

// The f16 round trip of the cache.
float f16r(float x) { return fp16_to_f32(f32_to_fp16(x)); }

// One attention call on a cache whose rows [0, n_past) hold earlier keys/values and whose rows
// past the ubatch hold f16 NaN (never to be read). Checks the written cache rows (bit exact)
// and returns the NMSE of the output against a double-precision reference on the f16 K/V.
double attention_case(const AttnShape& s, int64_t n_ctx, int64_t n_past, int64_t n_tok,
                      uint64_t seed, int64_t n_decode = -1) {
  const int64_t kv_dim = static_cast<int64_t>(s.n_head_kv) * s.head_dim;
  const int64_t q_dim = static_cast<int64_t>(s.n_head) * s.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  const auto q = gaussian(static_cast<size_t>(n_tok * q_dim), seed, 1.5f);
  const auto k = gaussian(static_cast<size_t>(n_tok * kv_dim), seed + 1, 1.5f);
  const auto v = gaussian(static_cast<size_t>(n_tok * kv_dim), seed + 2);
  const auto old_k = gaussian(static_cast<size_t>(n_past * kv_dim), seed + 3, 1.5f);
  const auto old_v = gaussian(static_cast<size_t>(n_past * kv_dim), seed + 4);
  std::vector<uint16_t> kc(static_cast<size_t>(n_ctx * kv_dim), 0xffff);  // f16 NaN
  std::vector<uint16_t> vc = kc;
  for (size_t i = 0; i < old_k.size(); ++i)
    kc[i] = f32_to_fp16(old_k[i]), vc[i] = f32_to_fp16(old_v[i]);
  std::vector<int32_t> pos(static_cast<size_t>(n_tok));
  std::iota(pos.begin(), pos.end(), static_cast<int32_t>(n_past));

  Dev<float> dq(q), dk(k), dv(v), dout(static_cast<size_t>(n_tok * q_dim));
  Dev<uint16_t> dkc(kc), dvc(vc);
  Dev<int32_t> dpos(pos);
  const size_t ws_bytes =
      gpu::attention_workspace_bytes(n_tok, n_ctx, s.n_head, s.n_head_kv, s.head_dim, n_decode);
  Dev<uint8_t> ws(ws_bytes);
  dout.poison();
  gpu::attention(dq.p, dk.p, dv.p, n_tok, dpos.p, dkc.p, dvc.p, n_ctx, s.n_head, s.n_head_kv,
                 s.head_dim, scale, dout.p, ws.p, ws_bytes, nullptr, nullptr, nullptr, n_decode);
  const std::vector<float> got = dout.down();

  // The cache rows of this ubatch: k, v rounded to f16 (round to nearest even), bit exact.
  const std::vector<uint16_t> gk = dkc.down(), gv = dvc.down();
  bool cache_ok = true;
  for (int64_t i = 0; i < n_tok * kv_dim; ++i) {
    const size_t c = static_cast<size_t>(n_past * kv_dim + i);
    cache_ok = cache_ok && gk[c] == f32_to_fp16(k[static_cast<size_t>(i)]) &&
               gv[c] == f32_to_fp16(v[static_cast<size_t>(i)]);
  }
  CHECK(cache_ok);

  // Reference: double precision on the f16-rounded K/V.
  std::vector<float> kf(static_cast<size_t>((n_past + n_tok) * kv_dim)), vf(kf.size());
  for (size_t i = 0; i < old_k.size(); ++i) kf[i] = f16r(old_k[i]), vf[i] = f16r(old_v[i]);
  for (size_t i = 0; i < k.size(); ++i)
    kf[old_k.size() + i] = f16r(k[i]), vf[old_k.size() + i] = f16r(v[i]);
  const int32_t group = s.n_head / s.n_head_kv;
  std::vector<float> ref(got.size());
  std::vector<double> sc(static_cast<size_t>(n_past + n_tok));
  for (int64_t t = 0; t < n_tok; ++t) {
    const int64_t n_kv = n_past + t + 1;
    for (int32_t h = 0; h < s.n_head; ++h) {
      const float* qh = q.data() + t * q_dim + static_cast<int64_t>(h) * s.head_dim;
      const int64_t koff = static_cast<int64_t>(h / group) * s.head_dim;
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < n_kv; ++j) {
        double dot = 0;
        for (int32_t d = 0; d < s.head_dim; ++d)
          dot += static_cast<double>(qh[d]) * kf[static_cast<size_t>(j * kv_dim + koff + d)];
        sc[static_cast<size_t>(j)] = static_cast<double>(scale) * dot;
        mx = std::max(mx, sc[static_cast<size_t>(j)]);
      }
      double sum = 0;
      for (int64_t j = 0; j < n_kv; ++j)
        sum += (sc[static_cast<size_t>(j)] = std::exp(sc[static_cast<size_t>(j)] - mx));
      for (int32_t d = 0; d < s.head_dim; ++d) {
        double a = 0;
        for (int64_t j = 0; j < n_kv; ++j)
          a += sc[static_cast<size_t>(j)] * vf[static_cast<size_t>(j * kv_dim + koff + d)];
        ref[static_cast<size_t>(t * q_dim + static_cast<int64_t>(h) * s.head_dim + d)] =
            static_cast<float>(a / sum);
      }
    }
  }
  return nmse(ref, got);
}

const AttnShape kAttnShapes[] = {
    {2, 2, 8},   {8, 2, 8},    // head_dim 8 (stories260K-like), GQA ratios 1 and 4
    {2, 2, 64},  {8, 2, 64},   //
    {2, 2, 128}, {8, 2, 128},  //
    {4, 1, 256},               // the largest head_dim, ratio 4
    {4, 2, 6},                 // head_dim % 4 != 0: the 4-byte cache-load path
};

TEST_CASE("gpu: attention decode at several cache lengths") {
  REQUIRE_DEVICE();
  const int64_t n_ctx = 2048;  // split into 8 at full length (>= 256 positions a split)
  // Both decode paths: the cluster kernel (compute capability >= 9.0) and the general kernel
  // with kv_write and the split combine.
  const AttnShape shapes[] = {
      {16, 2, 128}, {40, 4, 64}, {12, 1, 256}, {6, 1, 128}};  // groups past 4
  for (const bool cluster : {true, false}) {
    gpu::detail::attention_cluster_decode() = cluster;
    double worst = 0;
    auto run = [&](const AttnShape& s, int64_t pos) {
      CAPTURE(cluster);
      CAPTURE(s.n_head);
      CAPTURE(s.n_head_kv);
      CAPTURE(s.head_dim);
      CAPTURE(pos);
      const double e = attention_case(s, n_ctx, pos, 1, 1000 + pos + s.head_dim);
      worst = std::max(worst, e);
      CHECK(e <= kTolAttention);
    };
    for (const AttnShape& s : kAttnShapes)
      for (const int64_t pos :
           {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{8}, int64_t{63}, int64_t{64}, int64_t{300},
            int64_t{511}, int64_t{1000}, int64_t{2047}})
        run(s, pos);
    for (const AttnShape& s : shapes)
      for (const int64_t pos : {int64_t{0}, int64_t{70}, int64_t{1500}}) run(s, pos);
    MESSAGE("attention decode (" << (cluster ? "cluster kernel" : "general kernel")
                                 << "): worst NMSE " << worst);
  }
  gpu::detail::attention_cluster_decode() = true;
}

TEST_CASE("gpu: attention decode split over clusters of the KV range (long caches)") {
  REQUIRE_DEVICE();
  // The cluster decode kernel with 4 and 8 query heads per block, 1 (auto at short positions),
  // 2, 3 or 5 clusters per KV head of 1, 2, 4 or 8 blocks: positions where one, several or all
  // clusters take part (several decode tokens of one call: test_gpu_batch.cpp).
  const int64_t n_ctx = 16384;
  const AttnShape shapes[] = {
      {32, 4, 128},  // qwen3-30b-a3b: 8 heads per block, one subgroup
      {16, 2, 256},  // head_dim 256: always 4 per block
      {24, 4, 256},  // group 6 (Qwen3.5-27B-like): a partial subgroup
      {12, 1, 128},  // group 12 with 8 per block: a partial second subgroup
      {8, 2, 64},    // group 4
      {4, 2, 6},     // head_dim % 4 != 0
  };
  const int saved_heads = gpu::detail::attention_decode_heads();
  const int saved_clusters = gpu::detail::attention_decode_clusters();
  gpu::detail::attention_cluster_decode() = true;
  double worst = 0;
  struct Variant {
    int heads, clusters, cb;
  };
  const Variant variants[] = {{0, 0, 0}, {4, 0, 0}, {8, 0, 0}, {4, 5, 1},
                              {8, 5, 2}, {0, 2, 4}, {0, 0, 1}, {8, 3, 8}};
  const int saved_cb = gpu::detail::attention_decode_cluster_blocks();
  for (const auto& [heads, clusters, cb] : variants) {
    gpu::detail::attention_decode_heads() = heads;
    gpu::detail::attention_decode_clusters() = clusters;
    gpu::detail::attention_decode_cluster_blocks() = cb;
    for (const AttnShape& s : shapes) {
      for (const int64_t pos : {int64_t{0}, int64_t{1023}, int64_t{4000}, int64_t{16383}}) {
        CAPTURE(heads);
        CAPTURE(clusters);
        CAPTURE(cb);
        CAPTURE(s.n_head);
        CAPTURE(s.n_head_kv);
        CAPTURE(s.head_dim);
        CAPTURE(pos);
        const double e = attention_case(s, n_ctx, pos, 1, 3000 + pos + s.head_dim);
        worst = std::max(worst, e);
        CHECK(e <= kTolAttention);
      }
    }
  }
  gpu::detail::attention_decode_heads() = saved_heads;
  gpu::detail::attention_decode_clusters() = saved_clusters;
  gpu::detail::attention_decode_cluster_blocks() = saved_cb;
  MESSAGE("attention decode split over clusters: worst NMSE " << worst);
}

TEST_CASE("gpu: attention prefill after a non-zero n_past") {
  REQUIRE_DEVICE();
  // Both prompt kernels: tensor cores (head_dim 64, 128, 256) and f32 (every head dim).
  for (const bool mma : {true, false}) {
    gpu::detail::attention_prefill_mma() = mma;
    double worst = 0, worst_mma = 0;
    for (const AttnShape& s : kAttnShapes) {
      for (const int64_t n_tok : {int64_t{1}, int64_t{2}, int64_t{7}, int64_t{64}, int64_t{512}}) {
        if (s.head_dim == 256 && n_tok == 512) continue;  // keeps the host reference short
        CAPTURE(mma);
        CAPTURE(s.n_head);
        CAPTURE(s.n_head_kv);
        CAPTURE(s.head_dim);
        CAPTURE(n_tok);
        const double e = attention_case(s, 1024, 37, n_tok, 2000 + n_tok + s.head_dim);
        const bool on_mma = n_tok > 1 && test::prompt_on_mma(s.head_dim);
        (on_mma ? worst_mma : worst) = std::max(on_mma ? worst_mma : worst, e);
        CHECK(e <= attention_tol(s.head_dim, n_tok > 1));
      }
    }
    // No history at all, a full ubatch from position 0.
    const double e0 = attention_case({8, 2, 128}, 600, 0, 512, 77);
    CHECK(e0 <= attention_tol(128, true));
    MESSAGE("attention prefill (" << std::string(mma ? "tensor-core kernel where it serves"
                                                     : "f32 kernel")
                                  << "): worst NMSE f32 kernel " << worst << ", tensor cores "
                                  << std::max(worst_mma, mma ? e0 : 0.0));
  }
  gpu::detail::attention_prefill_mma() = true;
}

TEST_CASE("gpu: attention prompt rows on tensor cores at 1, 127, 4096 and 32768 positions") {
  REQUIRE_DEVICE();
  REQUIRE(test::prompt_on_mma(128));
  struct Case {
    AttnShape s;
    int64_t n_ctx, n_past, n_tok;
  };
  const Case cases[] = {
      {{8, 2, 128}, 64, 0, 1},          // one prompt row (n_decode 0) at position 0
      {{8, 2, 128}, 256, 0, 127},       // a partial K/V tile and a partial block of rows
      {{4, 1, 256}, 256, 0, 127},       // head_dim 256 (tiles of 32 positions)
      {{8, 8, 64}, 256, 0, 127},        // head_dim 64, no grouping
      {{2, 1, 128}, 4096, 0, 4096},     // 4096 positions in one call from position 0
      {{4, 1, 128}, 32768, 32704, 64},  // a ubatch ending at position 32767, the cache full
  };
  // Q K^T on mma.sync, then on wgmma (where this build's sm_90a code runs; else mma.sync again).
  const bool saved_wg = gpu::detail::attention_prefill_wgmma();
  MESSAGE("attention wgmma variant runs on this device: " << gpu::detail::attention_wgmma_runs());
  for (const bool wg : {false, true}) {
    gpu::detail::attention_prefill_wgmma() = wg;
    CAPTURE(wg);
    double worst = 0;
    for (const Case& c : cases) {
      CAPTURE(c.s.n_head);
      CAPTURE(c.s.head_dim);
      CAPTURE(c.n_past);
      CAPTURE(c.n_tok);
      const double e = attention_case(c.s, c.n_ctx, c.n_past, c.n_tok, 500 + c.n_tok, 0);
      worst = std::max(worst, e);
      CHECK(e <= kTolAttentionMma);
    }
    MESSAGE("attention prompt rows on tensor cores (wgmma " << wg << "): worst NMSE " << worst);
  }
  gpu::detail::attention_prefill_wgmma() = saved_wg;
}

TEST_CASE("gpu: a captured decode graph replays at later positions like eager launches") {
  REQUIRE_DEVICE();
  const AttnShape s{8, 2, 128};
  // Positions where 1, 2 and 3 clusters of the decode kernel take part with 3 forced (a
  // cluster of 2 blocks per 512 rows at this shape); 1, 2 and 10 with the automatic count.
  const int64_t n_ctx = 8192, p = 300;
  const int64_t step_pos[3] = {p, 700, 5000};
  const int64_t kv_dim = static_cast<int64_t>(s.n_head_kv) * s.head_dim;
  const int64_t q_dim = static_cast<int64_t>(s.n_head) * s.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  std::vector<uint16_t> kc(static_cast<size_t>(n_ctx * kv_dim)), vc(kc.size());
  {
    const auto a = gaussian(kc.size(), 91, 1.5f), b = gaussian(kc.size(), 92);
    for (size_t i = 0; i < kc.size(); ++i) kc[i] = f32_to_fp16(a[i]), vc[i] = f32_to_fp16(b[i]);
  }
  Dev<float> dq(gaussian(static_cast<size_t>(q_dim), 93, 1.5f));
  Dev<float> dk(gaussian(static_cast<size_t>(kv_dim), 94, 1.5f));
  Dev<float> dv(gaussian(static_cast<size_t>(kv_dim), 95));
  Dev<uint16_t> dkc(kc), dvc(vc);
  Dev<int32_t> dpos(std::vector<int32_t>{static_cast<int32_t>(p)});
  Dev<float> dout(static_cast<size_t>(q_dim));

  cudaStream_t stream;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  size_t ws_bytes = 0;
  std::unique_ptr<Dev<uint8_t>> ws;
  auto launch = [&] {
    gpu::attention(dq.p, dk.p, dv.p, 1, dpos.p, dkc.p, dvc.p, n_ctx, s.n_head, s.n_head_kv,
                   s.head_dim, scale, dout.p, ws->p, ws_bytes, stream);
  };
  const int saved_clusters = gpu::detail::attention_decode_clusters();
  for (const auto& [cluster, clusters] :
       {std::pair{true, 0}, std::pair{true, 3}, std::pair{false, 0}}) {
    CAPTURE(cluster);
    CAPTURE(clusters);
    gpu::detail::attention_cluster_decode() = cluster;
    gpu::detail::attention_decode_clusters() = clusters;
    ws_bytes = gpu::attention_workspace_bytes(1, n_ctx, s.n_head, s.n_head_kv, s.head_dim);
    REQUIRE(ws_bytes > 0);  // this shape splits the KV range (both kernels)
    ws = std::make_unique<Dev<uint8_t>>(ws_bytes);
    dkc.up(kc);
    dvc.up(vc);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    ck(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
    launch();
    ck(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    ck(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");

    std::vector<float> prev;
    for (int64_t step = 0; step < 3; ++step) {
      CAPTURE(step);
      dpos.up({static_cast<int32_t>(step_pos[step])});
      dout.poison();
      ck(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
      ck(cudaStreamSynchronize(stream), "replay");
      const std::vector<float> replayed = dout.down();
      dout.poison();
      launch();
      ck(cudaStreamSynchronize(stream), "eager");
      const std::vector<float> eager = dout.down();
      CHECK(same_bits(replayed, eager));
      CHECK(std::all_of(eager.begin(), eager.end(), [](float x) { return std::isfinite(x); }));
      if (!prev.empty()) CHECK(!same_bits(prev, eager));  // the position really moved
      prev = eager;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  gpu::detail::attention_cluster_decode() = true;
  gpu::detail::attention_decode_clusters() = saved_clusters;
  cudaStreamDestroy(stream);
}

// ---- selection --------------------------------------------------------------------------------

TEST_CASE("gpu: moe_route equals cpu::moe_topk exactly, ties included") {
  REQUIRE_DEVICE();
  struct Case {
    int32_t n_expert, k;
  };
  const Case cases[] = {{8, 2}, {60, 4}, {64, 8}, {128, 8}, {7, 7}, {128, 1}, {256, 8}, {300, 6}};
  const int64_t n_tok = 1000;
  for (const Case& c : cases) {
    for (const bool norm : {false, true}) {
      CAPTURE(c.n_expert);
      CAPTURE(c.k);
      CAPTURE(norm);
      const size_t n = static_cast<size_t>(n_tok * c.n_expert);
      std::vector<float> logits = gaussian(n, 300 + c.n_expert + c.k, 3.0f);
      // A third of the rows quantised to a few levels (many exact ties), some rows all equal,
      // some with -inf and NaN entries.
      for (int64_t t = 0; t < n_tok; ++t) {
        float* row = logits.data() + t * c.n_expert;
        if (t % 3 == 1)
          for (int32_t e = 0; e < c.n_expert; ++e) row[e] = std::round(row[e]) * 0.5f;
        if (t % 50 == 7)
          for (int32_t e = 0; e < c.n_expert; ++e) row[e] = 1.25f;
        if (t % 10 == 3) row[t % c.n_expert] = -std::numeric_limits<float>::infinity();
        if (t % 10 == 5) row[(t / 10) % c.n_expert] = std::numeric_limits<float>::quiet_NaN();
      }
      std::vector<float> ref(static_cast<size_t>(n_tok * 2 * c.k));
      std::vector<int32_t> ids(static_cast<size_t>(c.k));
      for (int64_t t = 0; t < n_tok; ++t) {
        float* o = ref.data() + t * 2 * c.k;
        cpu::moe_topk(logits.data() + t * c.n_expert, c.n_expert, c.k, norm, ids.data(), o + c.k);
        for (int32_t j = 0; j < c.k; ++j) o[j] = static_cast<float>(ids[static_cast<size_t>(j)]);
      }
      Dev<float> dl(logits), dout(ref.size());
      dout.poison();
      gpu::moe_route(dl.p, n_tok, c.n_expert, c.k, norm, dout.p, nullptr);
      const std::vector<float> got = dout.down();
      int64_t bad_rows = 0;
      for (int64_t t = 0; t < n_tok; ++t)
        if (std::memcmp(ref.data() + t * 2 * c.k, got.data() + t * 2 * c.k,
                        static_cast<size_t>(2 * c.k) * sizeof(float)) != 0)
          ++bad_rows;
      CHECK(bad_rows == 0);
    }
  }
}

TEST_CASE("gpu: argmax, ties give the lowest id") {
  REQUIRE_DEVICE();
  for (const int64_t n_vocab : {int64_t{1}, int64_t{33}, int64_t{32000}, int64_t{151936}}) {
    CAPTURE(n_vocab);
    const int64_t rows = 6;
    std::vector<float> l = gaussian(static_cast<size_t>(rows * n_vocab), 500 + n_vocab);
    // Row 1: the maximum twice; row 2: all equal; row 3: NaNs and a tie at the top; row 4:
    // quantised (many ties).
    auto row = [&](int64_t r) { return l.data() + r * n_vocab; };
    row(1)[n_vocab - 1] = 10.0f, row(1)[n_vocab / 2] = 10.0f;
    std::fill(row(2), row(2) + n_vocab, -3.5f);
    row(3)[0] = std::numeric_limits<float>::quiet_NaN();
    row(3)[n_vocab - 1] = 9.0f, row(3)[n_vocab / 3] = 9.0f;
    for (int64_t i = 0; i < n_vocab; ++i) row(4)[i] = std::round(row(4)[i]);
    std::vector<int32_t> ref(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      int32_t best = 0;
      float bv = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < n_vocab; ++i)
        if (row(r)[i] > bv) bv = row(r)[i], best = static_cast<int32_t>(i);
      ref[static_cast<size_t>(r)] = best;
    }
    Dev<float> dl(l);
    Dev<int32_t> dids(static_cast<size_t>(rows));
    dids.poison();
    gpu::argmax(dl.p, rows, n_vocab, dids.p, nullptr);
    CHECK(dids.down() == ref);
  }
}

TEST_CASE("gpu: top_k order and ties") {
  REQUIRE_DEVICE();
  for (const int64_t n_vocab : {int64_t{300}, int64_t{4096}, int64_t{5000}, int64_t{151936}}) {
    for (const int32_t k : {1, 40, 256}) {
      if (k > n_vocab) continue;
      for (const bool quantised : {false, true}) {
        CAPTURE(n_vocab);
        CAPTURE(k);
        CAPTURE(quantised);
        std::vector<float> l = gaussian(static_cast<size_t>(n_vocab), 600 + n_vocab + k, 2.0f);
        if (quantised)  // few distinct values: long runs of ties across the top k
          for (float& x : l) x = std::round(x * 2.0f);
        l[static_cast<size_t>(n_vocab / 7)] = -0.0f;
        std::vector<int32_t> order(static_cast<size_t>(n_vocab));
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
          return l[static_cast<size_t>(a)] > l[static_cast<size_t>(b)];
        });
        std::vector<int32_t> ref_ids(order.begin(), order.begin() + k);
        std::vector<float> ref_vals(static_cast<size_t>(k));
        for (int32_t j = 0; j < k; ++j)
          ref_vals[static_cast<size_t>(j)] =
              l[static_cast<size_t>(ref_ids[static_cast<size_t>(j)])];
        const size_t ws_bytes = gpu::top_k_workspace_bytes(n_vocab, k);
        Dev<float> dl(l), dvals(static_cast<size_t>(k));
        Dev<int32_t> dids(static_cast<size_t>(k));
        Dev<uint8_t> ws(ws_bytes);
        dids.poison();
        dvals.poison();
        gpu::top_k(dl.p, n_vocab, k, dids.p, dvals.p, ws.p, ws_bytes, nullptr);
        CHECK(dids.down() == ref_ids);
        CHECK(same_bits(dvals.down(), ref_vals));
      }
    }
  }
}

// ---- timing (printed, never asserted) ---------------------------------------------------------

TEST_CASE("gpu: router timing (printed only)") {
  REQUIRE_DEVICE();
  // qwen3moe's decode router: 128 x 2048 f32, 8 used, with the hand-off of a hidden state.
  const int32_t n_expert = 128, k = 8;
  const int64_t n_in = 2048;
  Dev<float> dw(gaussian(static_cast<size_t>(n_expert * n_in), 41, 0.05f));
  Dev<float> dx(gaussian(static_cast<size_t>(n_in), 42)), dl(static_cast<size_t>(n_expert)),
      dr(static_cast<size_t>(2 * k));
  float* host = nullptr;
  uint32_t* flag = nullptr;
  ck(cudaHostAlloc(reinterpret_cast<void**>(&host), (n_in + 2 * k) * 4, cudaHostAllocDefault),
     "cudaHostAlloc");
  ck(cudaHostAlloc(reinterpret_cast<void**>(&flag), 4, cudaHostAllocDefault), "cudaHostAlloc");
  const HostCopy out[2] = {{host, dx.p, static_cast<size_t>(n_in) * 4},
                           {host + n_in, dr.p, static_cast<size_t>(2 * k) * 4}};
  cudaStream_t st = nullptr;
  ck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  const auto time_us = [&](bool fused) {
    const auto run = [&] {
      if (fused) {
        gpu::router_route_signal(GgmlType::F32, dw.p, n_in, dx.p, n_expert, k, true, dl.p, dr.p,
                                 out, 2, flag, 1, st);
      } else {
        gpu::matmul(GgmlType::F32, dw.p, n_in, n_expert, dx.p, 1, dl.p, nullptr, 0, st);
        gpu::moe_route_signal(dl.p, n_expert, k, true, dr.p, out, 2, flag, 1, st);
      }
    };
    for (int i = 0; i < 5; ++i) run();
    const int iters = 200;
    cudaEventRecord(e0, st);
    for (int i = 0; i < iters; ++i) run();
    cudaEventRecord(e1, st);
    ck(cudaEventSynchronize(e1), "timing");
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    return 1000.0 * ms / iters;
  };
  const double sep = time_us(false), fused = time_us(true);
  MESSAGE("decode router 128 x 2048 f32 + route + hand-off: matmul + moe_route_signal "
          << sep << " us, router_route_signal " << fused << " us");
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(st);
  cudaFreeHost(host);
  cudaFreeHost(flag);
}

TEST_CASE("gpu: attention timing (printed only)") {
  REQUIRE_DEVICE();
  const AttnShape s{32, 8, 128};  // Qwen3-8B-like
  const int64_t n_ctx = 4096;
  const int64_t kv_dim = static_cast<int64_t>(s.n_head_kv) * s.head_dim;
  const int64_t q_dim = static_cast<int64_t>(s.n_head) * s.head_dim;
  const int64_t n_tok_max = 512;
  std::vector<uint16_t> kc(static_cast<size_t>(n_ctx * kv_dim));
  {
    const auto a = gaussian(kc.size(), 7);
    for (size_t i = 0; i < kc.size(); ++i) kc[i] = f32_to_fp16(a[i]);
  }
  Dev<uint16_t> dkc(kc), dvc(kc);
  Dev<float> dq(gaussian(static_cast<size_t>(n_tok_max * q_dim), 8));
  Dev<float> dk(gaussian(static_cast<size_t>(n_tok_max * kv_dim), 9));
  Dev<float> dout(static_cast<size_t>(n_tok_max * q_dim));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  auto time_us = [&](int64_t n_tok, int32_t pos0) {
    std::vector<int32_t> pos(static_cast<size_t>(n_tok));
    std::iota(pos.begin(), pos.end(), pos0);
    Dev<int32_t> dpos(pos);
    const size_t ws_bytes =
        gpu::attention_workspace_bytes(n_tok, n_ctx, s.n_head, s.n_head_kv, s.head_dim);
    Dev<uint8_t> ws(ws_bytes);
    auto run = [&] {
      gpu::attention(dq.p, dk.p, dk.p, n_tok, dpos.p, dkc.p, dvc.p, n_ctx, s.n_head, s.n_head_kv,
                     s.head_dim, 0.088f, dout.p, ws.p, ws_bytes, nullptr);
    };
    for (int i = 0; i < 5; ++i) run();
    const int iters = 50;
    cudaEventRecord(e0);
    for (int i = 0; i < iters; ++i) run();
    cudaEventRecord(e1);
    ck(cudaEventSynchronize(e1), "timing");
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    return 1000.0 * ms / iters;
  };
  for (const bool cluster : {true, false}) {
    gpu::detail::attention_cluster_decode() = cluster;
    const double d639 = time_us(1, 639), dec = time_us(1, 4095);
    MESSAGE("attention 32q/8kv heads x 128, n_ctx 4096, decode ("
            << (cluster ? "cluster kernel" : "general kernel") << "): at position 639 " << d639
            << " us, at 4095 " << dec << " us (K+V " << (2.0 * 4096 * kv_dim * 2 / 1e6) << " MB -> "
            << (2.0 * 4096 * kv_dim * 2 / (dec * 1e-6) / 1e9) << " GB/s)");
  }
  gpu::detail::attention_cluster_decode() = true;
  const double pre = time_us(512, 0);
  const double pre_late = time_us(512, 3584);
  MESSAGE("attention 32q/8kv heads x 128, n_ctx 4096: prefill 512 from 0: "
          << pre << " us; prefill 512 at 3584: " << pre_late << " us");
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

}  // namespace
}  // namespace berth
