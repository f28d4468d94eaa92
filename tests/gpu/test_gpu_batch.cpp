// Several sequences in one step on the GPU (issue 19): attention over a KV cache of several
// sequences (each token reads its own sequence's rows only: checked against a double-precision
// reference on the same f16 K/V, with NaN in every row no token may read), and rows whose bits
// depend on their kind (decode or prompt) but never on the step: the same row computed alone,
// beside other sequences' tokens, or in another chunking of its prompt gives the same bits
// (attention and matmul, both decode attention kernels).
//
// Needs a CUDA device: without one every case fails with a message saying so.
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "berth/core/error.h"
#include "berth/core/fp16.h"
#include "berth/core/types.h"
#include "berth/cpu_kernels/quants_ref.h"
#include "berth/gpu_kernels/kernels.h"
#include "core/kernel_harness.h"
#include "gpu/attention_tol.h"
#include "gpu/gpu_test_util.h"

namespace berth {
namespace {

// attention: tests/gpu/attention_tol.h (double on the host, the same f16 K/V); a row reading
// another sequence's rows or a NaN row fails by far.
using test::attention_tol;
using test::kTolAttention;

using gpu_test::ck;
using gpu_test::Dev;
using gpu_test::nmse;

using test::gaussian;

float f16r(float x) { return fp16_to_f32(f32_to_fp16(x)); }

struct Shape {
  int32_t n_head, n_head_kv, head_dim;
};

// A pool of n_seq sequences of n_ctx rows: sequence s holds history rows [0, past[s]), every
// other row is f16 NaN.
struct Pool {
  Shape s;
  int64_t n_ctx;
  std::vector<int64_t> past;
  std::vector<float> hk, hv;  // history, [n_seq * n_ctx, kv_dim] (rows past history unused)
  std::vector<uint16_t> kc, vc;
  int64_t kv_dim() const { return static_cast<int64_t>(s.n_head_kv) * s.head_dim; }
  Pool(Shape sh, int64_t ctx, std::vector<int64_t> p, uint64_t seed)
      : s(sh), n_ctx(ctx), past(std::move(p)) {
    const auto n_seq = static_cast<int64_t>(past.size());
    hk = gaussian(static_cast<size_t>(n_seq * n_ctx * kv_dim()), seed, 1.5f);
    hv = gaussian(hk.size(), seed + 1);
    kc.assign(hk.size(), 0xffff);
    vc.assign(hk.size(), 0xffff);
    for (int64_t q = 0; q < n_seq; ++q)
      for (int64_t r = 0; r < past[static_cast<size_t>(q)] * kv_dim(); ++r) {
        const auto i = static_cast<size_t>(q * n_ctx * kv_dim() + r);
        kc[i] = f32_to_fp16(hk[i]);
        vc[i] = f32_to_fp16(hv[i]);
      }
  }
};

// A step: tokens (sequence, position) with their q, k, v; the last n_decode are decode rows.
struct Step {
  std::vector<int32_t> seq, pos;
  std::vector<float> q, k, v;
  int64_t n_decode = 0;
  int64_t n() const { return static_cast<int64_t>(seq.size()); }
};

// Tokens [a, b) of `st` as a step of their own (their kind: decode when `decode`).
Step slice(const Step& st, const Shape& s, int64_t a, int64_t b, bool decode) {
  const int64_t qd = static_cast<int64_t>(s.n_head) * s.head_dim;
  const int64_t kd = static_cast<int64_t>(s.n_head_kv) * s.head_dim;
  Step o;
  o.seq.assign(st.seq.begin() + a, st.seq.begin() + b);
  o.pos.assign(st.pos.begin() + a, st.pos.begin() + b);
  o.q.assign(st.q.begin() + a * qd, st.q.begin() + b * qd);
  o.k.assign(st.k.begin() + a * kd, st.k.begin() + b * kd);
  o.v.assign(st.v.begin() + a * kd, st.v.begin() + b * kd);
  o.n_decode = decode ? b - a : 0;
  return o;
}

// Runs `steps` in order on a fresh device copy of the pool; returns each step's output and the
// final cache.
struct Run {
  std::vector<std::vector<float>> out;
  std::vector<uint16_t> kc, vc;
};
Run run_steps(const Pool& pool, const std::vector<Step>& steps) {
  const Shape& s = pool.s;
  const int64_t qd = static_cast<int64_t>(s.n_head) * s.head_dim;
  Dev<uint16_t> dkc(pool.kc), dvc(pool.vc);
  Run r;
  for (const Step& st : steps) {
    Dev<float> dq(st.q), dk(st.k), dv(st.v), dout(static_cast<size_t>(st.n() * qd));
    Dev<int32_t> dpos(st.pos), dseq(st.seq);
    const size_t ws_bytes = gpu::attention_workspace_bytes(st.n(), pool.n_ctx, s.n_head,
                                                           s.n_head_kv, s.head_dim, st.n_decode);
    Dev<uint8_t> ws(ws_bytes);
    dout.poison();
    gpu::attention(dq.p, dk.p, dv.p, st.n(), dpos.p, dkc.p, dvc.p, pool.n_ctx, s.n_head,
                   s.n_head_kv, s.head_dim, 1.0f / std::sqrt(static_cast<float>(s.head_dim)),
                   dout.p, ws.p, ws_bytes, nullptr, nullptr, dseq.p, st.n_decode);
    r.out.push_back(dout.down());
  }
  r.kc = dkc.down();
  r.vc = dvc.down();
  return r;
}

// The double-precision attention of every token of `st` (its sequence's history, then the keys
// of the step's tokens of that sequence up to its position), f16-rounded K/V.
std::vector<float> reference(const Pool& pool, const Step& st) {
  const Shape& s = pool.s;
  const int64_t qd = static_cast<int64_t>(s.n_head) * s.head_dim, kd = pool.kv_dim();
  const int32_t group = s.n_head / s.n_head_kv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  std::vector<float> ref(static_cast<size_t>(st.n() * qd));
  for (int64_t t = 0; t < st.n(); ++t) {
    const int32_t sq = st.seq[static_cast<size_t>(t)], p = st.pos[static_cast<size_t>(t)];
    // Row j of the sequence: from the step when one of its tokens is at j, else history.
    auto row = [&](int64_t j, bool key) -> const float* {
      for (int64_t u = 0; u < st.n(); ++u)
        if (st.seq[static_cast<size_t>(u)] == sq && st.pos[static_cast<size_t>(u)] == j)
          return (key ? st.k.data() : st.v.data()) + u * kd;
      return (key ? pool.hk.data() : pool.hv.data()) + (sq * pool.n_ctx + j) * kd;
    };
    for (int32_t h = 0; h < s.n_head; ++h) {
      const float* qh = st.q.data() + t * qd + static_cast<int64_t>(h) * s.head_dim;
      const int64_t ko = static_cast<int64_t>(h / group) * s.head_dim;
      std::vector<double> sc(static_cast<size_t>(p + 1));
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j <= p; ++j) {
        const float* kr = row(j, true) + ko;
        double dot = 0;
        for (int32_t d = 0; d < s.head_dim; ++d) dot += static_cast<double>(qh[d]) * f16r(kr[d]);
        sc[static_cast<size_t>(j)] = scale * dot;
        mx = std::max(mx, sc[static_cast<size_t>(j)]);
      }
      double sum = 0;
      for (double& x : sc) sum += (x = std::exp(x - mx));
      for (int32_t d = 0; d < s.head_dim; ++d) {
        double a = 0;
        for (int64_t j = 0; j <= p; ++j)
          a += sc[static_cast<size_t>(j)] * f16r(row(j, false)[ko + d]);
        ref[static_cast<size_t>(t * qd + h * s.head_dim + d)] = static_cast<float>(a / sum);
      }
    }
  }
  return ref;
}

bool same_rows(const std::vector<float>& a, int64_t ra, const std::vector<float>& b, int64_t rb,
               int64_t n_rows, int64_t width) {
  return std::memcmp(a.data() + ra * width, b.data() + rb * width,
                     static_cast<size_t>(n_rows * width) * sizeof(float)) == 0;
}

const Shape kShapes[] = {{8, 2, 8}, {8, 8, 64}, {16, 2, 128}, {4, 1, 256}, {4, 2, 6}};

}  // namespace

TEST_CASE("gpu attention: several sequences in one step, each reading its own rows") {
  REQUIRE_DEVICE();
  // Decode splits > 1 past 64 positions (general kernel). With 3 clusters forced, longer
  // caches and later decode positions, where up to 3 clusters of the cluster kernel take part
  // (a cluster of 2 blocks per 256 or 512 rows: 3 at both decode tokens, 1 to 3 among the
  // eight).
  const bool saved_wg = gpu::detail::attention_prefill_wgmma();
  const int saved_clusters = gpu::detail::attention_decode_clusters();
  // (cluster decode, Q K^T of prompt rows on wgmma, decode clusters): the decode kernels, the
  // prompt rows' wgmma variant (where it runs; else mma.sync again), 3 clusters forced.
  struct Variant {
    bool cluster, wg;
    int clusters;
  };
  for (const Variant& va : {Variant{true, false, 0}, Variant{false, false, 0},
                            Variant{true, true, 0}, Variant{true, false, 3}}) {
    gpu::detail::attention_cluster_decode() = va.cluster;
    gpu::detail::attention_prefill_wgmma() = va.wg;
    gpu::detail::attention_decode_clusters() = va.clusters;
    const bool longer = va.clusters > 0;
    const int64_t n_ctx = longer ? 4500 : 1100;
    const int32_t dec_pos[2] = {longer ? 2700 : 700, longer ? 4200 : 1000};
    for (const Shape& s : kShapes) {
      CAPTURE(va.cluster);
      CAPTURE(va.wg);
      CAPTURE(va.clusters);
      CAPTURE(s.n_head);
      CAPTURE(s.n_head_kv);
      CAPTURE(s.head_dim);
      const Pool pool(s, n_ctx, {40, dec_pos[0], 0, dec_pos[1], 5}, 11 + s.head_dim);
      const int64_t qd = static_cast<int64_t>(s.n_head) * s.head_dim, kd = pool.kv_dim();
      // As StepPacker packs: prompt chunks (sequence 2 from 0, 9 tokens; sequence 0 continuing
      // with 3; sequence 4 with a 1-token prompt row), then decode tokens of sequences 1 and 3.
      Step st;
      const auto add = [&](int32_t q, int32_t p) {
        st.seq.push_back(q);
        st.pos.push_back(p);
      };
      for (int32_t p = 0; p < 9; ++p) add(2, p);
      for (int32_t p = 40; p < 43; ++p) add(0, p);
      add(4, 5);
      add(1, dec_pos[0]);
      add(3, dec_pos[1]);
      st.n_decode = 2;
      st.q = gaussian(static_cast<size_t>(st.n() * qd), 21, 1.5f);
      st.k = gaussian(static_cast<size_t>(st.n() * kd), 22, 1.5f);
      st.v = gaussian(static_cast<size_t>(st.n() * kd), 23);
      const Run mixed = run_steps(pool, {st});

      // Against the reference; the cache rows written are the step's K/V rounded to f16 at
      // seq * n_ctx + pos, and no other row changed.
      CHECK(nmse(reference(pool, st), mixed.out[0]) <= attention_tol(s.head_dim, true));
      std::vector<uint16_t> want_k = pool.kc, want_v = pool.vc;
      for (int64_t t = 0; t < st.n(); ++t)
        for (int64_t c = 0; c < kd; ++c) {
          const auto i = static_cast<size_t>(
              (st.seq[static_cast<size_t>(t)] * n_ctx + st.pos[static_cast<size_t>(t)]) * kd + c);
          want_k[i] = f32_to_fp16(st.k[static_cast<size_t>(t * kd + c)]);
          want_v[i] = f32_to_fp16(st.v[static_cast<size_t>(t * kd + c)]);
        }
      CHECK(mixed.kc == want_k);
      CHECK(mixed.vc == want_v);

      // Each decode token alone (a one-token decode call): the same bits.
      for (int64_t t = st.n() - st.n_decode; t < st.n(); ++t) {
        CAPTURE(t);
        const Run alone = run_steps(pool, {slice(st, s, t, t + 1, true)});
        CHECK(same_rows(mixed.out[0], t, alone.out[0], 0, 1, qd));
      }
      // Sequence 2's prompt alone, and in chunks of 4 + 4 + 1 (the last a one-token prompt
      // step): the same bits as beside the others.
      const Run whole = run_steps(pool, {slice(st, s, 0, 9, false)});
      CHECK(same_rows(mixed.out[0], 0, whole.out[0], 0, 9, qd));
      const Run chunks = run_steps(
          pool, {slice(st, s, 0, 4, false), slice(st, s, 4, 8, false), slice(st, s, 8, 9, false)});
      CHECK(same_rows(mixed.out[0], 0, chunks.out[0], 0, 4, qd));
      CHECK(same_rows(mixed.out[0], 4, chunks.out[1], 0, 4, qd));
      CHECK(same_rows(mixed.out[0], 8, chunks.out[2], 0, 1, qd));
      // Sequence 0's chunk and sequence 4's one prompt row alone.
      const Run s0 = run_steps(pool, {slice(st, s, 9, 12, false)});
      CHECK(same_rows(mixed.out[0], 9, s0.out[0], 0, 3, qd));
      const Run s4 = run_steps(pool, {slice(st, s, 12, 13, false)});
      CHECK(same_rows(mixed.out[0], 12, s4.out[0], 0, 1, qd));
      // Eight decode tokens of distinct sequences of one pool at once, against each alone.
      const Pool pool8 = longer
                             ? Pool(s, 3000, {0, 1, 63, 64, 65, 2100, 2999, 1028}, 5 + s.head_dim)
                             : Pool(s, 300, {0, 1, 63, 64, 65, 200, 299, 128}, 5 + s.head_dim);
      Step d;
      for (int32_t q = 0; q < 8; ++q) {
        d.seq.push_back(q);
        d.pos.push_back(static_cast<int32_t>(pool8.past[static_cast<size_t>(q)]));
      }
      d.n_decode = 8;
      d.q = gaussian(static_cast<size_t>(8 * qd), 31, 1.5f);
      d.k = gaussian(static_cast<size_t>(8 * kd), 32, 1.5f);
      d.v = gaussian(static_cast<size_t>(8 * kd), 33);
      const Run all8 = run_steps(pool8, {d});
      CHECK(nmse(reference(pool8, d), all8.out[0]) <= kTolAttention);
      for (int64_t t = 0; t < 8; ++t) {
        CAPTURE(t);
        const Run alone = run_steps(pool8, {slice(d, s, t, t + 1, true)});
        CHECK(same_rows(all8.out[0], t, alone.out[0], 0, 1, qd));
      }
    }
  }
  gpu::detail::attention_cluster_decode() = true;
  gpu::detail::attention_prefill_wgmma() = saved_wg;
  gpu::detail::attention_decode_clusters() = saved_clusters;
}

TEST_CASE("gpu attention: n_decode outside [-1, n_tok] is refused") {
  REQUIRE_DEVICE();
  CHECK_THROWS_AS(gpu::attention_workspace_bytes(4, 64, 2, 2, 8, 5), Error);
  CHECK_THROWS_AS(gpu::attention_workspace_bytes(4, 64, 2, 2, 8, -2), Error);
}

TEST_CASE("gpu matmul: a row's bits depend on its kind, never on the other rows") {
  REQUIRE_DEVICE();
  const GgmlType types[] = {GgmlType::F32,  GgmlType::F16,  GgmlType::BF16,
                            GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K};
  const int64_t n_in = 512, n_out = 200, n_tok = 21, n_dec = 11;  // decode rows past 8: 2 launches
  const auto x = gaussian(static_cast<size_t>(n_tok * n_in), 3, 1.0f);
  Dev<float> dx(x);
  // Prompt rows on the mma.sync GEMM (weights decoded in shared memory) and on the WMMA GEMM.
  const bool saved_mma = gpu::detail::moe_gemm_mma();
  for (const bool mma : {true, false})
    for (const GgmlType t : types) {
      gpu::detail::moe_gemm_mma() = mma;
      CAPTURE(mma);
      CAPTURE(type_name(t));
      const size_t rb = row_bytes(t, n_in);
      std::vector<uint8_t> w(rb * static_cast<size_t>(n_out));
      for (int64_t r = 0; r < n_out; ++r) {
        const auto wr =
            gaussian(static_cast<size_t>(n_in), 100 + static_cast<uint64_t>(r), 0.05f, 0.01f);
        ref::quantize_row(t, wr.data(), w.data() + static_cast<size_t>(r) * rb, n_in);
      }
      Dev<uint8_t> dw(w);
      // rows [r0, r0 + n) of x as a call with `dec` decode rows; returns its output.
      auto call = [&](int64_t r0, int64_t n, int64_t dec, bool invariant = true) {
        const size_t ws_bytes = gpu::matmul_workspace_bytes(t, n_in, n_out, n, dec, invariant);
        Dev<uint8_t> ws(ws_bytes);
        Dev<float> out(static_cast<size_t>(n * n_out));
        out.poison();
        gpu::matmul(t, dw.p, n_in, n_out, dx.p + r0 * n_in, n, out.p, ws.p, ws_bytes, nullptr, dec,
                    invariant);
        return out.down();
      };
      const std::vector<float> mixed = call(0, n_tok, n_dec);  // 10 prompt rows, 11 decode rows
      const int64_t n_pre = n_tok - n_dec;
      for (float f : mixed) REQUIRE(std::isfinite(f));
      // Each row alone with its kind, and in other groupings.
      for (int64_t r = 0; r < n_tok; ++r) {
        CAPTURE(r);
        const bool dec = r >= n_pre;
        CHECK(same_rows(mixed, r, call(r, 1, dec ? 1 : 0), 0, 1, n_out));
      }
      const std::vector<float> prompts = call(0, n_pre, 0);
      CHECK(same_rows(mixed, 0, prompts, 0, n_pre, n_out));
      const std::vector<float> decodes = call(n_pre, n_dec, n_dec);
      CHECK(same_rows(mixed, n_pre, decodes, 0, n_dec, n_out));
      // Rows 3..7 as 3 prompt rows and 2 decode rows: rows 3..5 as in the mixed call, rows 6 and
      // 7 (prompt rows there) as each alone as a decode row.
      const std::vector<float> some = call(3, 5, 2);
      CHECK(same_rows(mixed, 3, some, 0, 3, n_out));
      CHECK(same_rows(call(6, 1, 1), 0, some, 3, 1, n_out));
      CHECK(same_rows(call(7, 1, 1), 0, some, 4, 1, n_out));
      // A decode row and the same row as a prompt row differ (8-bit or f32 activations against
      // f16 ones): the kind is real, and the comparisons above could fail. F32 weights: both kinds
      // take the f32 GEMV.
      if (t == GgmlType::F32)
        CHECK(same_rows(call(0, 1, 1), 0, call(0, 1, 0), 0, 1, n_out));
      else
        CHECK_FALSE(same_rows(call(0, 1, 1), 0, call(0, 1, 0), 0, 1, n_out));
      // Both paths near the same product: the activations' 8-bit blocks (decode, quantized
      // weights) cost about 1e-5 of NMSE, f16 activations (prompt) about 1e-7.
      CHECK(nmse(call(0, n_tok, 0), call(0, n_tok, n_tok)) <= 1e-3);
      // invariant false (a session of one sequence): cuBLAS multiplies the prompt rows, near our
      // GEMM's result (the same f16 inputs, f32 accumulation in another order); decode rows as
      // before, bit for bit.
      const std::vector<float> cub = call(0, n_tok, n_dec, false);
      for (float f : cub) REQUIRE(std::isfinite(f));
      // (F32 weights: the invariant rows are f32 GEMV rows, cuBLAS's f16 ones.)
      CHECK(nmse(std::vector<float>(mixed.begin(), mixed.begin() + n_pre * n_out),
                 std::vector<float>(cub.begin(), cub.begin() + n_pre * n_out)) <=
            (t == GgmlType::F32 ? 1e-5 : 1e-8));
      CHECK(same_rows(mixed, n_pre, cub, n_pre, n_dec, n_out));
    }
  gpu::detail::moe_gemm_mma() = saved_mma;
  CHECK_THROWS_AS(gpu::matmul_workspace_bytes(GgmlType::Q8_0, 64, 8, 4, 5), Error);
}

}  // namespace berth
