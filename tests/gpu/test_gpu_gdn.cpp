// The Qwen3.5 hybrids' kernels of gpu_kernels/kernels.h (head_slice, sigmoid_mul,
// rms_norm_gated, ssm_conv, gated_delta) against the CPU path's scalar twins (berth::ref,
// cpu_kernels/gdn.h) run on the host with the same inputs. House rules as test_gpu_ops.cpp:
// seeded inputs, outputs poisoned (all bits set: NaN) before each run so an element the kernel
// did not write fails, each tolerance (NMSE = sum (gpu - ref)^2 / sum ref^2) written next to it
// with its reason. The recurrent ops run a sequence of steps over one multi-sequence state
// buffer (a prompt from position 0 over garbage, its continuation, decode rows, a step mixing a
// new sequence's prompt rows with other sequences' decode rows, prompt rows that switch
// sequences back and forth); the host runs each sequence's rows on its own state, and the
// outputs and the whole state buffer are compared after every step. A CUDA graph of a decode
// step is replayed with new positions and sequence ids.
//
// Needs a CUDA device: without one every case fails with a message saying so.
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <set>
#include <vector>

#include "berth/core/error.h"
#include "berth/cpu_kernels/gdn.h"
#include "berth/gpu_kernels/kernels.h"
#include "core/kernel_harness.h"
#include "gpu/gpu_test_util.h"

namespace berth {
namespace {

// Tolerances, each with its reason.
// head_slice: a copy: exact.
constexpr double kTolSlice = 0.0;
// sigmoid_mul: x / (1 + expf(-g)) in float against the twin's double: expf's couple of ulp and
// two roundings (the CPU SIMD kernel's bound, tests/core/test_kernel_oracle_gdn.cpp).
constexpr double kTolSigmoid = 1e-13;
// rms_norm_gated: the sum of squares in double on both sides, the float scale within a
// rounding, then three float products and silu through expf (the twin: all in double).
constexpr double kTolNormGated = 1e-12;
// ssm_conv: <= 8 products summed by FMA in float (the twin in double), then silu through expf.
constexpr double kTolConv = 1e-12;
// gated_delta: the norms and gates as the twins (double sums and transcendentals, float
// results), then float FMA dot products over d_k (four partial sums per lane, a shuffle tree)
// in the fused output form scale * (decay S^T q + (k . q) delta) against the twin's double
// sums in the notes' order; the state rounded to f32 after each token on both sides. The CPU
// SIMD kernel's bound for the same arithmetic (measured <= 2.2e-13 over 70 tokens there).
constexpr double kTolDelta = 1e-10;

using gpu_test::ck;
using gpu_test::Dev;
using gpu_test::nmse;
using gpu_test::same_bits;
using test::gaussian;

// All bits set: the float pattern poison() writes on the device (a NaN).
float garbage() {
  const uint32_t u = 0xffffffffu;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

TEST_CASE("gpu: head_slice") {
  REQUIRE_DEVICE();
  struct Case {
    int64_t rows, n_group;
    int32_t group, offset, len;
  };
  // Qwen3.5's attn_q split (queries, then gates, per head of 256), odd sizes, whole groups.
  const Case cases[] = {{3, 4, 512, 0, 256}, {3, 4, 512, 256, 256}, {5, 3, 10, 3, 4},
                        {1, 7, 9, 8, 1},     {2, 2, 6, 0, 6},       {4, 5, 12, 12, 0}};
  for (const Case& c : cases) {
    CAPTURE(c.rows);
    CAPTURE(c.group);
    CAPTURE(c.offset);
    CAPTURE(c.len);
    const int64_t in_cols = c.n_group * c.group, out_cols = c.n_group * c.len;
    const auto x = gaussian(static_cast<size_t>(c.rows * in_cols), 10 + in_cols);
    std::vector<float> ref(static_cast<size_t>(c.rows * out_cols));
    for (int64_t r = 0; r < c.rows; ++r)
      for (int64_t j = 0; j < c.n_group; ++j)
        for (int32_t i = 0; i < c.len; ++i)
          ref[r * out_cols + j * c.len + i] = x[r * in_cols + j * c.group + c.offset + i];
    Dev<float> dx(x), dout(ref.size());
    dout.poison();
    gpu::head_slice(dx.p, dout.p, c.rows, c.n_group, c.group, c.offset, c.len, nullptr);
    const auto got = dout.down();
    CHECK(nmse(ref, got) <= kTolSlice);
    CHECK(same_bits(ref, got));
  }
  Dev<float> d(16);
  CHECK_THROWS_AS(gpu::head_slice(d.p, d.p, 1, 2, 8, 5, 4, nullptr), Error);  // 5 + 4 > 8
  CHECK_THROWS_AS(gpu::head_slice(d.p, d.p, 1, 2, 0, 0, 0, nullptr), Error);
}

TEST_CASE("gpu: sigmoid_mul, elementwise and per-row gates") {
  REQUIRE_DEVICE();
  for (const auto& [rows, cols] :
       {std::pair<int64_t, int64_t>{1, 1}, {7, 96}, {3, 1}, {16, 1024}, {5, 4097}}) {
    for (const bool per_row : {false, true}) {
      CAPTURE(rows);
      CAPTURE(cols);
      CAPTURE(per_row);
      const size_t n = static_cast<size_t>(rows * cols);
      const size_t ng = per_row ? static_cast<size_t>(rows) : n;
      const auto x = gaussian(n, 20 + n, 1.5f, 0.2f);
      auto gate = gaussian(ng, 30 + ng, 4.0f);
      if (ng >= 3) gate[0] = -100.0f, gate[1] = 95.0f, gate[2] = -88.5f;  // exp's edges
      std::vector<float> ref(n), row(static_cast<size_t>(cols));
      for (int64_t r = 0; r < rows; ++r) {
        const float* g = gate.data() + r * cols;
        if (per_row) {
          std::fill(row.begin(), row.end(), gate[static_cast<size_t>(r)]);
          g = row.data();
        }
        ref::sigmoid_gate(x.data() + r * cols, g, ref.data() + r * cols, cols);
      }
      Dev<float> dx(x), dg(gate), dout(n);
      dout.poison();
      gpu::sigmoid_mul(dx.p, dg.p, dout.p, rows, cols, per_row, nullptr);
      CHECK(nmse(ref, dout.down()) <= kTolSigmoid);
      // In place over x; and over the gate when it has x's shape.
      gpu::sigmoid_mul(dx.p, dg.p, dx.p, rows, cols, per_row, nullptr);
      CHECK(nmse(ref, dx.down()) <= kTolSigmoid);
      if (!per_row) {
        Dev<float> dx2(x);
        gpu::sigmoid_mul(dx2.p, dg.p, dg.p, rows, cols, false, nullptr);
        CHECK(nmse(ref, dg.down()) <= kTolSigmoid);
      }
    }
  }
}

TEST_CASE("gpu: rms_norm_gated per group") {
  REQUIRE_DEVICE();
  struct Case {
    int64_t rows, cols;
    int32_t group;
  };
  // Qwen3.5's V heads of 128, odd groups, a group past the register path (> 256).
  const Case cases[] = {{1, 128, 128}, {5, 4096, 128}, {3, 144, 48}, {2, 35, 7}, {3, 600, 300}};
  for (const Case& c : cases) {
    CAPTURE(c.rows);
    CAPTURE(c.cols);
    CAPTURE(c.group);
    const size_t n = static_cast<size_t>(c.rows * c.cols);
    const auto x = gaussian(n, 40 + n, 1.5f, 0.3f), z = gaussian(n, 50 + n, 2.0f);
    const auto w = gaussian(static_cast<size_t>(c.group), 60 + n, 0.3f, 1.0f);
    std::vector<float> ref(n);
    for (int64_t r = 0; r < c.rows * (c.cols / c.group); ++r)
      ref::rms_norm_gated(x.data() + r * c.group, w.data(), z.data() + r * c.group,
                          ref.data() + r * c.group, c.group, 1e-6f);
    Dev<float> dx(x), dz(z), dw(w), dout(n);
    dout.poison();
    gpu::rms_norm_gated(dx.p, dz.p, dw.p, dout.p, c.rows, c.cols, c.group, 1e-6f, nullptr);
    CHECK(nmse(ref, dout.down()) <= kTolNormGated);
    gpu::rms_norm_gated(dx.p, dz.p, dw.p, dx.p, c.rows, c.cols, c.group, 1e-6f, nullptr);
    CHECK(nmse(ref, dx.down()) <= kTolNormGated);  // out over x
    Dev<float> dx2(x);
    gpu::rms_norm_gated(dx2.p, dz.p, dw.p, dz.p, c.rows, c.cols, c.group, 1e-6f, nullptr);
    CHECK(nmse(ref, dz.down()) <= kTolNormGated);  // out over z
  }
  Dev<float> d(16);
  CHECK_THROWS_AS(gpu::rms_norm_gated(d.p, d.p, d.p, d.p, 1, 10, 4, 1e-6f, nullptr), Error);
}

// One step of a recurrent op: rows' sequences and positions, the last n_decode decode rows.
// null_seqs: seqs passed as null (every row sequence 0). garbage: sequences whose state is
// overwritten with NaN (device and host) before the step (they start at position 0).
struct Step {
  std::vector<int32_t> seqs, pos;
  int64_t n_decode;
  bool null_seqs;
  std::vector<int32_t> garbage;
};

constexpr int32_t kSeqs = 4;

// The steps every recurrent test runs, in order over one state buffer of kSeqs sequences
// (sequence 0 starts from garbage, 1..3 from random states).
std::vector<Step> recurrent_steps() {
  std::vector<Step> s;
  // A prompt of sequence 0 from position 0 (over a garbage state), longer than a chunk of the
  // delta kernel (8 tokens), seqs null.
  Step a{{}, {}, 0, true, {0}};
  for (int32_t p = 0; p < 11; ++p) a.seqs.push_back(0), a.pos.push_back(p);
  s.push_back(a);
  // Its continuation from the state (prompt rows), then one decode row.
  s.push_back(Step{{0, 0, 0}, {11, 12, 13}, 0, false, {}});
  s.push_back(Step{{0}, {14}, 1, false, {}});
  // Sequence 1's prompt from position 0 (garbage state), then decode rows of 0, 2, 3.
  s.push_back(Step{{1, 1, 1, 1, 0, 2, 3}, {0, 1, 2, 3, 15, 4, 9}, 3, false, {1}});
  // Prompt rows that switch sequences (2, 2, 3, 2: a store and a reload of 2), decode rows of
  // 1 and 0.
  s.push_back(Step{{2, 2, 3, 2, 1, 0}, {5, 6, 10, 7, 4, 16}, 2, false, {}});
  // Decode rows only, one of them a new sequence 3 at position 0 (garbage state).
  s.push_back(Step{{3, 1, 2}, {0, 5, 8}, 3, false, {3}});
  return s;
}

// Host twin of gpu::ssm_conv: each sequence's rows, in row order, against its own state.
void host_ssm_conv(const std::vector<float>& x, std::vector<float>& out, int64_t channels,
                   const std::vector<float>& w, int32_t kernel, std::vector<float>& state,
                   const Step& st) {
  const int64_t n_tok = static_cast<int64_t>(st.pos.size());
  const int64_t per_seq = (kernel - 1) * channels;
  for (const int32_t s : std::set<int32_t>(st.seqs.begin(), st.seqs.end())) {
    float* ss = state.data() + s * per_seq;
    for (int64_t t = 0; t < n_tok; ++t) {
      if (st.seqs[static_cast<size_t>(t)] != s) continue;
      if (st.pos[static_cast<size_t>(t)] == 0) std::fill_n(ss, per_seq, 0.0f);
      ref::conv1d_causal(x.data() + t * channels, channels, out.data() + t * channels, channels, 1,
                         w.data(), kernel, ss, channels, 0, channels, true);
    }
  }
}

TEST_CASE("gpu: ssm_conv over per-sequence states (prompt, decode, mixed steps)") {
  REQUIRE_DEVICE();
  struct Case {
    int64_t channels;
    int32_t kernel;
  };
  // Qwen3.5 0.8B-like (kernel 4, channels not a multiple of the block), the edges of kernel.
  const Case cases[] = {{200, 4}, {6144, 4}, {37, 1}, {37, 3}, {130, 8}};
  for (const Case& c : cases) {
    CAPTURE(c.channels);
    CAPTURE(c.kernel);
    const int64_t per_seq = (c.kernel - 1) * c.channels;
    const auto w = gaussian(static_cast<size_t>(c.channels * c.kernel), 70 + c.channels, 0.5f);
    std::vector<float> state = gaussian(static_cast<size_t>(kSeqs * per_seq), 80 + c.kernel);
    Dev<float> dw(w), dstate(state.size());
    uint64_t seed = 90;
    int step_i = 0;
    for (const Step& st : recurrent_steps()) {
      CAPTURE(step_i);
      ++step_i;
      for (const int32_t g : st.garbage)
        std::fill_n(state.begin() + g * per_seq, per_seq, garbage());
      dstate.up(state);
      const int64_t n_tok = static_cast<int64_t>(st.pos.size());
      const auto x = gaussian(static_cast<size_t>(n_tok * c.channels), ++seed, 1.2f);
      std::vector<float> ref(x.size(), garbage());
      host_ssm_conv(x, ref, c.channels, w, c.kernel, state, st);
      Dev<float> dx(x), dout(x.size());
      Dev<int32_t> dpos(st.pos), dseq(st.seqs);
      dout.poison();
      gpu::ssm_conv(dx.p, dout.p, n_tok, c.channels, dw.p, c.kernel, dstate.p, dpos.p,
                    st.null_seqs ? nullptr : dseq.p, st.n_decode, nullptr);
      CHECK(nmse(ref, dout.down()) <= kTolConv);
      const auto got_state = dstate.down();
      CHECK(nmse(state, got_state) <= kTolConv);
      state = got_state;  // the next step starts from the device's state on both sides
    }
  }
  Dev<float> d(16);
  Dev<int32_t> dp(std::vector<int32_t>{0});
  CHECK_THROWS_AS(gpu::ssm_conv(d.p, d.p, 1, 2, d.p, 9, d.p, dp.p, nullptr, 0, nullptr), Error);
  CHECK_THROWS_AS(gpu::ssm_conv(d.p, d.p, 1, 2, d.p, 4, d.p, dp.p, nullptr, 2, nullptr), Error);
}

struct DeltaShape {
  int32_t hk, hv, dk, dv;
};

// The inputs of one gated_delta step of n_tok rows.
struct DeltaInputs {
  std::vector<float> y, alpha, b;
};

DeltaInputs delta_inputs(const DeltaShape& sh, int64_t n_tok, uint64_t seed) {
  const int64_t y_cols = 2 * sh.hk * sh.dk + sh.hv * sh.dv;
  DeltaInputs in;
  in.y = gaussian(static_cast<size_t>(n_tok * y_cols), seed);
  in.alpha = gaussian(static_cast<size_t>(n_tok * sh.hv), seed + 1, 1.5f);
  in.b = gaussian(static_cast<size_t>(n_tok * sh.hv), seed + 2, 2.0f);
  in.alpha[0] = 30.0f;  // softplus past its threshold (u > 20: u itself)
  return in;
}

// Host twin of gpu::gated_delta: per sequence, its rows in row order (ref::l2_norm,
// ref::gdn_gates, ref::gated_delta_rule per V head) against its own state.
void host_gated_delta(const DeltaShape& sh, const DeltaInputs& in, const std::vector<float>& ssm_a,
                      const std::vector<float>& dt_bias, float eps, std::vector<float>& state,
                      const Step& st, std::vector<float>& out) {
  const int64_t n_tok = static_cast<int64_t>(st.pos.size());
  const int64_t y_cols = 2 * sh.hk * sh.dk + sh.hv * sh.dv, out_cols = sh.hv * sh.dv;
  const int64_t head = static_cast<int64_t>(sh.dk) * sh.dv, per_seq = head * sh.hv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(sh.dk));
  std::vector<float> qk(static_cast<size_t>(2 * sh.hk * sh.dk));
  std::vector<float> g(static_cast<size_t>(sh.hv)), beta(g.size());
  for (const int32_t s : std::set<int32_t>(st.seqs.begin(), st.seqs.end())) {
    float* ss = state.data() + s * per_seq;
    for (int64_t t = 0; t < n_tok; ++t) {
      if (st.seqs[static_cast<size_t>(t)] != s) continue;
      if (st.pos[static_cast<size_t>(t)] == 0) std::fill_n(ss, per_seq, 0.0f);
      const float* yt = in.y.data() + t * y_cols;
      for (int32_t j = 0; j < 2 * sh.hk; ++j)
        ref::l2_norm(yt + j * sh.dk, qk.data() + j * sh.dk, sh.dk, eps);
      ref::gdn_gates(in.alpha.data() + t * sh.hv, in.b.data() + t * sh.hv, dt_bias.data(),
                     ssm_a.data(), g.data(), beta.data(), sh.hv);
      for (int32_t h = 0; h < sh.hv; ++h) {
        const int32_t j = h % sh.hk;
        ref::gated_delta_rule(qk.data() + j * sh.dk, sh.dk, qk.data() + (sh.hk + j) * sh.dk, sh.dk,
                              yt + 2 * sh.hk * sh.dk + h * sh.dv, sh.dv, &g[h], &beta[h], 1, 1,
                              sh.dk, sh.dv, scale, ss + h * head,
                              out.data() + t * out_cols + h * sh.dv, out_cols, 0, sh.dv);
      }
    }
  }
}

// ssm_a (-exp(A_log), A_log ~ N(0, 0.5)) and dt_bias of hv heads.
void delta_weights(int32_t hv, uint64_t seed, std::vector<float>& ssm_a,
                   std::vector<float>& dt_bias) {
  ssm_a = gaussian(static_cast<size_t>(hv), seed, 0.5f);
  for (float& a : ssm_a) a = -std::exp(a);
  dt_bias = gaussian(static_cast<size_t>(hv), seed + 1, 0.5f);
}

TEST_CASE("gpu: gated_delta over per-sequence states (prompt, decode, mixed steps)") {
  REQUIRE_DEVICE();
  // Qwen3.5 (d 128, H_v a multiple of H_k: the V-head mapping), odd sizes (d_k padded in the
  // workspace: 48, 20; d_v not a multiple of a block's columns: 48, 5), each lane split
  // (d_k 32, 64, 128, 256).
  const DeltaShape shapes[] = {{2, 4, 128, 128}, {2, 6, 32, 48},  {2, 4, 48, 32},
                               {1, 3, 20, 5},    {1, 2, 256, 64}, {3, 3, 64, 7}};
  const float eps = 1e-6f;
  for (const DeltaShape& sh : shapes) {
    CAPTURE(sh.hk);
    CAPTURE(sh.hv);
    CAPTURE(sh.dk);
    CAPTURE(sh.dv);
    const int64_t per_seq = static_cast<int64_t>(sh.hv) * sh.dk * sh.dv;
    const int64_t out_cols = static_cast<int64_t>(sh.hv) * sh.dv;
    std::vector<float> ssm_a, dt_bias;
    delta_weights(sh.hv, 100 + sh.dk, ssm_a, dt_bias);
    std::vector<float> state = gaussian(static_cast<size_t>(kSeqs * per_seq), 110 + sh.dv, 0.5f);
    Dev<float> da(ssm_a), ddt(dt_bias), dstate(state.size());
    uint64_t seed = 120;
    int step_i = 0;
    for (const Step& st : recurrent_steps()) {
      CAPTURE(step_i);
      ++step_i;
      for (const int32_t g : st.garbage)
        std::fill_n(state.begin() + g * per_seq, per_seq, garbage());
      dstate.up(state);
      const int64_t n_tok = static_cast<int64_t>(st.pos.size());
      const DeltaInputs in = delta_inputs(sh, n_tok, seed += 3);
      std::vector<float> ref(static_cast<size_t>(n_tok * out_cols), garbage());
      host_gated_delta(sh, in, ssm_a, dt_bias, eps, state, st, ref);
      const size_t ws_bytes = gpu::gated_delta_workspace_bytes(n_tok, sh.hk, sh.hv, sh.dk);
      Dev<uint8_t> ws(ws_bytes);
      ws.poison();  // the padding the kernels rely on is theirs to write
      Dev<float> dy(in.y), dal(in.alpha), db(in.b), dout(ref.size());
      Dev<int32_t> dpos(st.pos), dseq(st.seqs);
      dout.poison();
      gpu::gated_delta(dy.p, dal.p, db.p, da.p, ddt.p, n_tok, sh.hk, sh.hv, sh.dk, sh.dv, eps,
                       dstate.p, dpos.p, st.null_seqs ? nullptr : dseq.p, st.n_decode, dout.p, ws.p,
                       ws_bytes, nullptr);
      const auto got = dout.down();
      for (int64_t t = 0; t < n_tok; ++t) {
        CAPTURE(t);
        const std::vector<float> r(ref.begin() + t * out_cols, ref.begin() + (t + 1) * out_cols);
        const std::vector<float> o(got.begin() + t * out_cols, got.begin() + (t + 1) * out_cols);
        CHECK(nmse(r, o) <= kTolDelta);
      }
      const auto got_state = dstate.down();
      CHECK(nmse(state, got_state) <= kTolDelta);
      state = got_state;  // the next step starts from the device's state on both sides
    }
  }
  // Bad arguments.
  Dev<float> d(64);
  Dev<int32_t> dp(std::vector<int32_t>{0});
  const size_t ws_bytes = gpu::gated_delta_workspace_bytes(1, 2, 4, 8);
  Dev<uint8_t> ws(ws_bytes);
  CHECK_THROWS_AS(gpu::gated_delta(d.p, d.p, d.p, d.p, d.p, 1, 3, 4, 8, 8, 1e-6f, d.p, dp.p,
                                   nullptr, 0, d.p, ws.p, ws_bytes, nullptr),
                  Error);  // hv % hk != 0
  CHECK_THROWS_AS(gpu::gated_delta(d.p, d.p, d.p, d.p, d.p, 1, 2, 4, 257, 8, 1e-6f, d.p, dp.p,
                                   nullptr, 0, d.p, ws.p, ws_bytes, nullptr),
                  Error);  // d_k > 256
  CHECK_THROWS_AS(gpu::gated_delta(d.p, d.p, d.p, d.p, d.p, 1, 2, 4, 8, 8, 1e-6f, d.p, dp.p,
                                   nullptr, 0, d.p, ws.p, ws_bytes - 1, nullptr),
                  Error);  // short workspace
  CHECK_THROWS_AS(gpu::gated_delta(d.p, d.p, d.p, d.p, d.p, 1, 2, 4, 8, 8, 1e-6f, d.p, dp.p,
                                   nullptr, 2, d.p, ws.p, ws_bytes, nullptr),
                  Error);  // n_decode > n_tok
}

TEST_CASE("gpu: ssm_conv and gated_delta in a CUDA graph replayed with new positions, seqs") {
  REQUIRE_DEVICE();
  // A decode step of three sequences captured once; between replays the positions and
  // sequence ids (device memory) change, as a server's step graph sees them.
  const DeltaShape sh{2, 4, 128, 128};
  const int32_t kernel = 4;
  const int64_t n_tok = 3, channels = 2 * sh.hk * sh.dk + sh.hv * sh.dv;
  const int64_t per_seq = static_cast<int64_t>(sh.hv) * sh.dk * sh.dv;
  const int64_t conv_seq = (kernel - 1) * channels, out_cols = sh.hv * sh.dv;
  const float eps = 1e-6f;
  std::vector<float> ssm_a, dt_bias;
  delta_weights(sh.hv, 200, ssm_a, dt_bias);
  const auto w = gaussian(static_cast<size_t>(channels * kernel), 210, 0.5f);
  std::vector<float> state = gaussian(static_cast<size_t>(kSeqs * per_seq), 220, 0.5f);
  std::vector<float> conv_state = gaussian(static_cast<size_t>(kSeqs * conv_seq), 230);
  Dev<float> da(ssm_a), ddt(dt_bias), dw(w), dstate(state), dconv(conv_state);
  const auto un = static_cast<size_t>(n_tok);
  Dev<float> dx(un * static_cast<size_t>(channels)), dy(dx.n), dal(un * sh.hv), db(un * sh.hv),
      dout(un * static_cast<size_t>(out_cols));
  Dev<int32_t> dpos(un), dseq(un);
  const size_t ws_bytes = gpu::gated_delta_workspace_bytes(n_tok, sh.hk, sh.hv, sh.dk);
  Dev<uint8_t> ws(ws_bytes);

  cudaStream_t s = nullptr;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ck(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "begin capture");
  gpu::ssm_conv(dx.p, dy.p, n_tok, channels, dw.p, kernel, dconv.p, dpos.p, dseq.p, n_tok, s);
  gpu::gated_delta(dy.p, dal.p, db.p, da.p, ddt.p, n_tok, sh.hk, sh.hv, sh.dk, sh.dv, eps, dstate.p,
                   dpos.p, dseq.p, n_tok, dout.p, ws.p, ws_bytes, s);
  ck(cudaStreamEndCapture(s, &graph), "end capture");
  ck(cudaGraphInstantiate(&exec, graph, 0), "instantiate");

  const Step steps[] = {{{0, 2, 3}, {5, 0, 9}, n_tok, false, {}},
                        {{3, 1, 0}, {10, 0, 6}, n_tok, false, {}},
                        {{2, 0, 1}, {1, 7, 1}, n_tok, false, {}}};
  uint64_t seed = 240;
  int step_i = 0;
  for (const Step& st : steps) {
    CAPTURE(step_i);
    ++step_i;
    const auto x = gaussian(static_cast<size_t>(n_tok * channels), ++seed);
    DeltaInputs in = delta_inputs(sh, n_tok, seed += 3);
    dx.up(x), dal.up(in.alpha), db.up(in.b), dpos.up(st.pos), dseq.up(st.seqs);
    dout.poison();
    // Host: the conv, then the delta rule on its output.
    in.y.assign(x.size(), garbage());
    host_ssm_conv(x, in.y, channels, w, kernel, conv_state, st);
    std::vector<float> ref(static_cast<size_t>(n_tok * out_cols), garbage());
    host_gated_delta(sh, in, ssm_a, dt_bias, eps, state, st, ref);
    ck(cudaGraphLaunch(exec, s), "graph launch");
    ck(cudaStreamSynchronize(s), "graph run");
    CHECK(nmse(in.y, dy.down()) <= kTolConv);
    CHECK(nmse(ref, dout.down()) <= kTolDelta);
    const auto got_conv = dconv.down(), got_state = dstate.down();
    CHECK(nmse(conv_state, got_conv) <= kTolConv);
    CHECK(nmse(state, got_state) <= kTolDelta);
    conv_state = got_conv;
    state = got_state;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace berth
